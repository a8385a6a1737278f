"""The ops the passes insert, one folder each: the op's semantics, its kernels (TIR, CUDA) and
their numpy reference (reference.py). cuda_build.py and dtype.cuh are shared by the CUDA kernels,
kernel_attrs.py by all kernels."""
