"""Hugging Face <-> loom weight conversion."""
