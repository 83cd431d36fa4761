"""swerl: gRPC microservices for RL training and evaluation of software-engineering agents."""

__version__ = "0.1.0"
