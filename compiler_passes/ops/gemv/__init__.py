"""The base linear's small-batch kernel on CUDA: gemv_cuda.py (wrapper, build), gemv.cu,
reference.py."""
