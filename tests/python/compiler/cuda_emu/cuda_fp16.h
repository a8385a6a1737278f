// Host stand-ins for the cuda_fp16.h intrinsics sgmv.cu and gemv.cu use (round-to-nearest-even).
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
struct float2 { float x, y; };
struct __half { uint16_t b; };
struct __half2 { __half x, y; };
inline __half __float2half_rn(float f) { _Float16 h = (_Float16)f; __half r; std::memcpy(&r.b, &h, 2); return r; }
inline float __half2float(__half h) { _Float16 v; std::memcpy(&v, &h.b, 2); return (float)v; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
