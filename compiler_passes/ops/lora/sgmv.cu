// Stage-3 LoRA (sgmv shrink + expand) over mlc-lora's unified page arena, for sm_80+.
//
// Compiled by sgmv_cuda.py (beside this file) with nvcc once per (dtype, max rank R):
//   -DMLC_MAX_RANK=R -DMLC_MAX_PARTS=3 -DMLC_SUFFIX=f16_r16 [-DMLC_BF16]
// The kernels are named mlc_lora_sgmv_{shrink,expand}_<MLC_SUFFIX>, so several builds can share
// one library (the benchmark links R = 16 and 64).
// The TIR wrappers there launch these kernels with the TIR kernels' signatures; the references
// they are tested against are sgmv_parts_shrink_ref / sgmv_parts_expand_ref in reference.py.
//
// Arena (docs/DESIGN.md): row k of A[s, m] of the layer is arena[base + a_off[s, m, k] : + in_f],
// row k of B[s, m]^T is arena[base + b_off[s, m, k] : + out_f]; base = layer * (size / L).
//
// One launch of each covers every part of a fused linear (q|k|v, gate|up: the parts share x and
// sit side by side in y); part p is module mp[p] of the tables (-1: no module, nothing added).
// Semantics, for s = slot[t] >= 0, m = mp[p] >= 0, scale[s, m] != 0 and k < rank[s]:
//   shrink: v[t, p, c, k] = scale[s, m] * sum_{i in chunk c} x[t, i] * A[s, m][k, i]; 0 elsewhere.
//           (The results do not depend on `order`, which only says how tokens are tiled.)
//           v (n, P, C, R) fp32.
//   expand: y[t, o_p + j] += sum_k (sum_c v[t, p, c, k]) * B[s, m]^T[k, j] for j < w[p], in place
//           (o_p = w[0] + .. + w[p-1]); y (n, W) untouched elsewhere, W = sum of w.
//
// Tokens come in any order on any slot. The blocks walk them in `order` (any permutation of
// 0..n-1; the pool's lora_token_order sorts them by slot, so a tile holds one or a few slots and
// each adapter's rows are read by about one tile instead of by every tile its tokens fall in):
// a block owns TILE consecutive positions of `order` and walks the tile's distinct slots; each
// adapter row is read once per block (16-byte loads where the row is 16-byte aligned, scalar
// loads otherwise) and applied to every tile token on that slot.
// The grid depends only on the token count and the layer shape (CUDA graphs). Decode-sized
// launches are latency-bound, so the kernels keep their chains of dependent global loads short
// (slot -> rank/scale -> offsets -> rows) and blocks with nothing to do leave early.

#include <stdint.h>

#include "dtype.cuh"

#ifndef MLC_MAX_RANK
#error "define MLC_MAX_RANK"
#endif
#ifndef MLC_MAX_PARTS
#error "define MLC_MAX_PARTS"
#endif
#ifndef MLC_SUFFIX
#error "define MLC_SUFFIX"
#endif
#define MLC_CAT2(a, b) a##b
#define MLC_CAT(a, b) MLC_CAT2(a, b)

namespace {

constexpr int TILE = 16;   // tokens per block (both kernels); fits the 32-bit token masks
constexpr int CHUNK = 512; // in_f elements per shrink block: CHUNK in reference.py
constexpr int SHRINK_THREADS = 128;
constexpr int EXPAND_THREADS = 64;
constexpr int EXPAND_OUT = EXPAND_THREADS * 8;  // outputs per expand block: 8 per thread
constexpr int KG = 16;     // B rows in flight per expand thread
constexpr int R = MLC_MAX_RANK;  // compiled max rank: the last axis of the offset tables and v
constexpr int MAX_PARTS = MLC_MAX_PARTS;  // parts of a fused linear (stage.py's MAX_PARTS)
static_assert(R >= 1 && R <= 128, "shared memory is sized for max rank <= 128");

// Elements [i, i + 8) of `row` (length `len`): one 16-byte load when in bounds and aligned,
// else element by element with zeros past `len`. Arena rows are aligned when their offsets are
// multiples of 8 (layout.py places them so for every Llama shape); the check keeps odd
// offsets correct, only slower.
__device__ __forceinline__ uint4 load8(const T* __restrict__ row, int i, int len) {
  const T* p = row + i;
  if (i + 8 <= len && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
  union {
    uint4 u;
    T h[8];
  } r;
#pragma unroll
  for (int j = 0; j < 8; ++j) r.h[j] = i + j < len ? p[j] : from_f(0.f);
  return r.u;
}

__device__ __forceinline__ void unpack8(uint4 u, float* f) {
  const T2* h = reinterpret_cast<const T2*>(&u);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float2 v = to_f2(h[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}

__device__ __forceinline__ void store8(T* __restrict__ row, int i, int len, const float* f) {
  T* p = row + i;
  if (i + 8 <= len && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    union {
      uint4 u;
      T2 h[4];
    } r;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.h[j] = from_f2(f[2 * j], f[2 * j + 1]);
    *reinterpret_cast<uint4*>(p) = r.u;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (i + j < len) p[j] = from_f(f[j]);
  }
}

// The distinct slots of a tile: tok_slot[i] (-1: nothing to compute for token i) ->
// d_lead[d] (the first tile token on the slot), d_mask[d] (bit i: token i of the tile is on it),
// *nd of them. Called by the whole block; ends with a barrier.
__device__ __forceinline__ void distinct_slots(const int* tok_slot, uint32_t* mask, int* d_lead,
                                               uint32_t* d_mask, int* nd) {
  const int tid = threadIdx.x;
  if (tid < TILE) mask[tid] = 0;
  __syncthreads();
  if (tid < TILE && tok_slot[tid] >= 0) {
    int lead = 0;
    while (tok_slot[lead] != tok_slot[tid]) ++lead;
    atomicOr(&mask[lead], 1u << tid);
  }
  __syncthreads();
  if (tid == 0) {
    int k = 0;
    for (int i = 0; i < TILE; ++i)
      if (mask[i]) {
        d_lead[k] = i;
        d_mask[k] = mask[i];
        ++k;
      }
    *nd = k;
  }
  __syncthreads();
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ int part_module(int p, int m0, int m1, int m2) {
  return p == 0 ? m0 : p == 1 ? m1 : m2;
}

// Index of the j-th set bit of `bits`.
__device__ __forceinline__ int nth_bit(uint32_t bits, int j) {
  for (; j > 0; --j) bits &= bits - 1;
  return __ffs(bits) - 1;
}

}  // namespace

// ------------------------------------------------------------------------------------- shrink
// Block (token tile, chunk c of CHUNK inputs, z), 4 warps. The work items are (distinct slot d,
// part p the slot's adapter targets, rank row k); they are spread over the gridDim.z blocks of the
// (tile, chunk) and their warps, four at a time so that four A rows are in flight per warp. The
// tile's x chunk sits in shared memory (staged only by blocks that have items); a lane holds 16
// elements of the row (two 16-byte loads), multiplies them with every tile token on that slot and
// the warp reduces each dot.
extern "C" __global__ void __launch_bounds__(SHRINK_THREADS)
    MLC_CAT(mlc_lora_sgmv_shrink_, MLC_SUFFIX)(const T* __restrict__ x, const T* __restrict__ arena,
                         const int* __restrict__ slot, const int* __restrict__ order,
                         const int* __restrict__ rank, const float* __restrict__ scale,
                         const int* __restrict__ a_off, float* __restrict__ v, int n, int in_f, int P, int m0, int m1, int m2,
                         int num_modules, int64_t base) {
  wait_for_producers();
  __shared__ __align__(16) T xs[TILE][CHUNK];
  __shared__ int tok_id[TILE], tok_slot[TILE], tok_rank[TILE], d_lead[TILE], d_pre[TILE + 1], nd;
  __shared__ uint32_t tok_parts[TILE], mask[TILE], d_mask[TILE];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int t0 = blockIdx.x * TILE, c = blockIdx.y, C = gridDim.y;
  const int i0 = c * CHUNK, len = min(CHUNK, in_f - i0);

  if (tid < TILE) {
    const int id = t0 + tid < n ? order[t0 + tid] : -1;  // the token at this tile position
    const int s = id >= 0 ? slot[id] : -1;
    tok_id[tid] = id;
    uint32_t parts = 0;
    int r = 0;
    if (s >= 0) {
      r = min(rank[s], R);
      for (int p = 0; p < P; ++p) {
        const int m = part_module(p, m0, m1, m2);
        if (m >= 0 && scale[s * num_modules + m] != 0.f) parts |= 1u << p;
      }
    }
    if (r <= 0) parts = 0;
    tok_slot[tid] = parts ? s : -1;
    tok_rank[tid] = parts ? r : 0;
    tok_parts[tid] = parts;
  }
  distinct_slots(tok_slot, mask, d_lead, d_mask, &nd);
  // Zeros wherever nothing is computed: k >= rank, parts the adapter leaves alone, base tokens.
  if (blockIdx.z == 0) {
    const int nt = min(TILE, n - t0);
    for (int e = tid; e < nt * P * R; e += SHRINK_THREADS) {
      const int t = e / (P * R), p = e / R % P, k = e % R;
      if (k >= tok_rank[t] || !(tok_parts[t] >> p & 1))
        v[((static_cast<int64_t>(tok_id[t]) * P + p) * C + c) * R + k] = 0.f;
    }
  }
  if (tid == 0) {
    d_pre[0] = 0;
    for (int d = 0; d < nd; ++d)
      d_pre[d + 1] = d_pre[d] + __popc(tok_parts[d_lead[d]]) * tok_rank[d_lead[d]];
  }
  __syncthreads();
  constexpr int NW = SHRINK_THREADS / 32, U = 4;
  const int items = d_pre[nd];
  if (blockIdx.z * NW * U >= items) return;  // the whole block: no barrier is skipped

  // x tile -> shared (zeros past in_f and past n).
  for (int e = tid; e < TILE * CHUNK / 8; e += SHRINK_THREADS) {
    const int t = e / (CHUNK / 8), i = (e % (CHUNK / 8)) * 8;
    uint4 u = make_uint4(0, 0, 0, 0);
    if (t0 + t < n) u = load8(x + static_cast<int64_t>(tok_id[t]) * in_f + i0, i, len);
    *reinterpret_cast<uint4*>(&xs[t][i]) = u;
  }
  __syncthreads();

  int d = 0;
  for (int it0 = (blockIdx.z * NW + warp) * U; it0 < items; it0 += gridDim.z * NW * U) {
    uint4 a[U][2];
    int ds[U], ps[U], ks[U];
    float sc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int it = it0 + u;
      ds[u] = -1;
      a[u][0] = a[u][1] = make_uint4(0, 0, 0, 0);
      if (it < items) {
        int dd = d;
        while (d_pre[dd + 1] <= it) ++dd;
        if (u == 0) d = dd;
        const int lead = d_lead[dd], r = tok_rank[lead], j = it - d_pre[dd];
        ds[u] = dd;
        ps[u] = nth_bit(tok_parts[lead], j / r);
        ks[u] = j % r;
        const int s = tok_slot[lead], m = part_module(ps[u], m0, m1, m2);
        sc[u] = scale[s * num_modules + m];
        const T* row = arena + base + a_off[(s * num_modules + m) * R + ks[u]] + i0;
        a[u][0] = load8(row, lane * 8, len);
        a[u][1] = load8(row, 256 + lane * 8, len);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (ds[u] < 0) continue;
      float af[16];
      unpack8(a[u][0], af);
      unpack8(a[u][1], af + 8);
      uint32_t bits = d_mask[ds[u]];
      while (bits) {
        const int t = __ffs(bits) - 1;
        bits &= bits - 1;
        float xf[16];
        unpack8(*reinterpret_cast<const uint4*>(&xs[t][lane * 8]), xf);
        unpack8(*reinterpret_cast<const uint4*>(&xs[t][256 + lane * 8]), xf + 8);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) acc = fmaf(af[j], xf[j], acc);
        acc = warp_sum(acc);
        if (lane == 0) v[((static_cast<int64_t>(tok_id[t]) * P + ps[u]) * C + c) * R + ks[u]] = acc * sc[u];
      }
    }
  }
}

// ------------------------------------------------------------------------------------- expand
// Block (token tile, output tile, z), 2 warps; the output tiles are laid part after part (none
// straddles two parts), a thread owns 8 consecutive outputs of its block's part p. Per block: the
// tile's tokens on adapters that target p, their distinct slots (spread over the gridDim.z blocks;
// blocks past them leave), h[t, k] = sum_c v[t, p, c, k] in shared memory; per distinct slot each
// thread loads KG rows of B^T (16 bytes each, all in flight), applies them to every tile token on
// the slot (fp32 partials in shared memory between rank groups when max_rank > KG) and adds the
// result into y.
extern "C" __global__ void __launch_bounds__(EXPAND_THREADS)
    MLC_CAT(mlc_lora_sgmv_expand_, MLC_SUFFIX)(const float* __restrict__ v, const T* __restrict__ arena,
                         const int* __restrict__ slot, const int* __restrict__ order,
                         const int* __restrict__ rank, const float* __restrict__ scale,
                         const int* __restrict__ b_off, T* __restrict__ y, int n, int in_chunks, int P, int m0, int m1, int m2,
                         int w0, int w1, int w2, int num_modules, int64_t base) {
  wait_for_producers();
  __shared__ float h[TILE * R];                                // h[t, k] = sum_c v[t, p, c, k]
  __shared__ float part[R > KG ? TILE * EXPAND_OUT : 1];       // fp32 partials between rank groups
  __shared__ int tok_id[TILE], tok_slot[TILE], tok_rank[TILE], d_lead[TILE], nd;
  __shared__ uint32_t mask[TILE], d_mask[TILE];
  const int tid = threadIdx.x, C = in_chunks, W = w0 + w1 + w2, t0 = blockIdx.x * TILE;
  // This block's part p, its first column o_p in y, its width w and the block's first output.
  int p = 0, o_p = 0, w = w0, tile = blockIdx.y;
  for (int q = 0; q + 1 < P; ++q) {
    const int tiles = (w + EXPAND_OUT - 1) / EXPAND_OUT;
    if (tile < tiles) break;
    tile -= tiles;
    o_p += w;
    ++p;
    w = p == 1 ? w1 : w2;
  }
  const int m = part_module(p, m0, m1, m2);
  if (m < 0) return;  // a part no adapter module covers: y stays
  const int o0 = tile * EXPAND_OUT + tid * 8;

  if (tid < TILE) {
    const int id = t0 + tid < n ? order[t0 + tid] : -1;  // the token at this tile position
    const int s = id >= 0 ? slot[id] : -1;
    tok_id[tid] = id;
    int r = 0;
    if (s >= 0 && scale[s * num_modules + m] != 0.f) r = min(rank[s], R);
    tok_slot[tid] = r > 0 ? s : -1;
    tok_rank[tid] = r;
  }
  distinct_slots(tok_slot, mask, d_lead, d_mask, &nd);
  if (static_cast<int>(blockIdx.z) >= nd) return;  // the whole block: no barrier is skipped

  const int nt = min(TILE, n - t0);
  for (int e = tid; e < nt * R; e += EXPAND_THREADS) {
    const int t = e / R, k = e % R;
    float acc = 0.f;
    if (k < tok_rank[t]) {
      // C independent loads in flight (a serial sum would chain C L2 latencies).
      const float* vt = v + (static_cast<int64_t>(tok_id[t]) * P + p) * C * R + k;
      float s8[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int c = 0; c < C; c += 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (c + j < C) s8[j] += vt[(c + j) * R];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) acc += s8[j];
    }
    h[e] = acc;
  }
  __syncthreads();
  if (o0 >= w) return;  // no barrier below

  for (int d = blockIdx.z; d < nd; d += gridDim.z) {
    const int s = tok_slot[d_lead[d]];
    const int r = tok_rank[d_lead[d]];
    const int* offs = b_off + (s * num_modules + m) * R;
    for (int g = 0; g < r; g += KG) {
      uint4 b[KG];
#pragma unroll
      for (int j = 0; j < KG; ++j) {
        b[j] = make_uint4(0, 0, 0, 0);
        if (g + j < r) b[j] = load8(arena + base + offs[g + j], o0, w);
      }
      const bool first = g == 0, last = g + KG >= r;
      uint32_t bits = d_mask[d];
      while (bits) {
        const int t = __ffs(bits) - 1;
        bits &= bits - 1;
        float acc[8];
        float* pt = part + t * EXPAND_OUT + tid * 8;
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = first ? 0.f : pt[q];
#pragma unroll
        for (int j = 0; j < KG; ++j) {
          if (g + j < r) {
            const float hk = h[t * R + g + j];
            float bf[8];
            unpack8(b[j], bf);
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] = fmaf(hk, bf[q], acc[q]);
          }
        }
        if (last) {
          T* yt = y + static_cast<int64_t>(tok_id[t]) * W + o_p;
          float yf[8];
          unpack8(load8(yt, o0, w), yf);
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] += yf[q];
          store8(yt, o0, w, acc);
        } else {
#pragma unroll
          for (int q = 0; q < 8; ++q) pt[q] = acc[q];
        }
      }
    }
  }
}
