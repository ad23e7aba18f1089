"""Data pipeline: indexed datasets, tokenizers, preprocessing, GPT samples, samplers, corpus.

Submodules are imported explicitly (``from loom.data.indexed import IndexedDataset``); this package
imports nothing heavy so that ``loom preprocess --help`` stays fast and torch-free.
"""
