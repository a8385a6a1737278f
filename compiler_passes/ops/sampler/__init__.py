"""On-device sampling: sampler_tir.py (the kernels), reference.py."""
