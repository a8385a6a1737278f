"""Paged attention over the pool on tensor cores: attention_cuda.py (wrappers, build),
attention.cu, reference.py."""
