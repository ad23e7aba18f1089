"""Inference: KV-cached generation with greedy / top-k / top-p sampling, under TP."""
