"""Dataset tools: Hugging Face SWE-bench / SWE-Gym datasets into slime JSONL (`swerl data`)."""
