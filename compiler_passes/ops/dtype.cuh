// The element type of mlc-lora's CUDA kernels and its conversions, and their first step
// (wait_for_producers), shared by the .cu files of
// compiler_passes/ops/ (attention, gemv, lora/sgmv; ops/cuda_build.py passes this folder as -I):
// T = half, or __nv_bfloat16 with -DMLC_BF16; fp32 maths inside.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifdef MLC_BF16
typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
__device__ __forceinline__ float to_f(T x) { return __bfloat162float(x); }
__device__ __forceinline__ T from_f(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float2 to_f2(T2 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ T2 from_f2(float x, float y) { return __floats2bfloat162_rn(x, y); }
#else
typedef __half T;
typedef __half2 T2;
__device__ __forceinline__ float to_f(T x) { return __half2float(x); }
__device__ __forceinline__ T from_f(float x) { return __float2half_rn(x); }
__device__ __forceinline__ float2 to_f2(T2 x) { return __half22float2(x); }
__device__ __forceinline__ T2 from_f2(float x, float y) { return __floats2half2_rn(x, y); }
#endif

// Every kernel's first step: wait until the kernels before it in the stream have finished and their
// writes are visible (griddepcontrol.wait; a no-op after a launch that was not programmatic: the
// launches are programmatic with kernel_attrs.PDL, ops/kernel_attrs.py).
__device__ __forceinline__ void wait_for_producers() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
