"""`swerl eval`: a model on a SWE dataset through the real services, without a training loop."""
