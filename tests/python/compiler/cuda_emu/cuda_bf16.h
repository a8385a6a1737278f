// Host stand-ins for the cuda_bf16.h intrinsics sgmv.cu and gemv.cu use (round-to-nearest-even).
#pragma once
#include "cuda_fp16.h"
struct __nv_bfloat16 { uint16_t b; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); __nv_bfloat16 r; r.b = u >> 16; return r; }
inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = uint32_t(h.b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
