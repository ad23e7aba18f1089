"""loom: distributed training and inference for large language models on PyTorch."""

__version__ = "0.1.0"
