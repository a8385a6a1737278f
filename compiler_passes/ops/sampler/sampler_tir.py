"""On-device sampling as TIR: kernels that turn a batch of logits into token ids (and logprobs).

Only token ids and the logprobs a request asks for go back to the host; the logits stay on the
device. Each kernel runs one row per thread block (`NT` threads cooperating over the vocabulary) on
a GPU, and one row per loop iteration with `NT = 1` on a CPU: the same TIR, only the loop kinds and
scratch scopes differ. Every kernel has a numpy reference (`*_ref`) in reference.py.

Semantics of `sample_top_p` for one row (`x = logits / temperature`, `p ∝ exp(x)`):
  keep_k = {i : x_i >= x_(k)}                 (x_(k): k-th largest; all when k <= 0 or k >= V)
  keep   = {i : x_i >= t}, t the largest x_j with  sum_{x_i >= t} p_i >= top_p * sum_{keep_k} p
  token  = the first i (vocabulary order) with  sum_{i' <= i, i' in keep} p_i' > u * sum_{keep} p
This is HF's TopK-then-TopP (ties at the threshold are kept) followed by inverse-CDF sampling with
the uniform `u` drawn on the host from the request's seeded generator.

Semantics of `process_logits` (penalties, logit_bias and a grammar's mask, vLLM's order), with
the host listing each (row r, token t) a request touches and its bias, repetition factor and
subtraction (rep = 1 and sub = 0 where a penalty does not apply):
  out[r, i] = logits[r, i] if bit i of mask[r] is set else -3.4e38
  out[r, t] = g(logits[r, t] + bias) - sub   for each listed (r, t) not masked,
              g(x) = x / rep if x > 0 else x * rep
"""

from __future__ import annotations

import functools

import tvm
from tvm.script import tirx as T

from mlc_lora.contract import TOP_LOGPROBS_MAX

GPU_THREADS = 256  # threads per row on a GPU; a power of two (tree reductions)
_NEG_INF = -3.4e38


@functools.lru_cache(maxsize=2)  # parsing the TVMScript takes seconds; models compile many times
def sampler_kernels(gpu: bool) -> dict[str, tvm.tirx.PrimFunc]:
    """The sampling kernels, hand-scheduled for a GPU (`gpu`) or plain loops for a CPU."""
    # pylint: disable=invalid-name,too-many-locals,too-many-statements,unused-variable
    NT = GPU_THREADS if gpu else 1
    LOG_NT = NT.bit_length() - 1
    K = TOP_LOGPROBS_MAX
    ROW = functools.partial(T.thread_binding, thread="blockIdx.x") if gpu else T.serial
    THR = functools.partial(T.thread_binding, thread="threadIdx.x") if gpu else T.serial
    SHARED = "shared" if gpu else "global"
    LOCAL = "local" if gpu else "global"
    attrs = {"tirx.is_scheduled": True, "op_pattern": 8}

    @T.macro
    def sync():
        if gpu:
            T.tvm_storage_sync("shared")

    @T.macro
    def block_reduce(red, tx, out, op):
        """red[tx] holds each thread's partial; out[0] gets the row's total (all threads)."""
        sync()
        for s in T.unroll(LOG_NT):
            if tx < T.shift_right(NT // 2, s):
                red[tx] = op(red[tx], red[tx + T.shift_right(NT // 2, s)])
            sync()
        out[0] = red[0]
        sync()

    def fmax(a, b):
        return T.max(a, b)

    def fadd(a, b):
        return a + b

    def key(v):
        # float32 -> int32 with the same order (flip the magnitude bits of negatives)
        bits = T.reinterpret("int32", v)
        return T.if_then_else(bits >= 0, bits, T.bitwise_xor(bits, T.int32(0x7FFFFFFF)))

    def packed(v, i):
        # (value desc, index asc) as one int64, so an argmax is a plain max-reduction
        return T.shift_left(T.Cast("int64", key(v)), T.int64(32)) + T.Cast("int64", 0x7FFFFFFF - i)

    def packed_index(p):
        return T.int32(0x7FFFFFFF) - T.Cast("int32", T.bitwise_and(p, T.int64(0xFFFFFFFF)))

    @T.macro
    def row_argmax(logits, b, tx, V, below, red, out):
        """out[0] = max packed(logits[b, i], i) over the packed keys < below."""
        part = T.sblock_alloc_buffer((1,), "int64", scope=LOCAL)
        part[0] = T.int64(-9223372036854775807)
        for j in T.serial(T.ceildiv(V, NT)):
            if j * NT + tx < V:
                if packed(logits[b, j * NT + tx], T.Cast("int32", j * NT + tx)) < below:
                    part[0] = T.max(part[0], packed(logits[b, j * NT + tx], T.Cast("int32", j * NT + tx)))
        red[tx] = part[0]
        block_reduce(red, tx, out, fmax)

    @T.macro
    def row_max_sum(logits, b, tx, inv_t, V, red, m, s):
        """m[0] = max_i x_i and s[0] = sum_i exp(x_i - m) for x = logits[b] * inv_t."""
        part = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
        part[0] = T.float32(_NEG_INF)
        for j in T.serial(T.ceildiv(V, NT)):
            if j * NT + tx < V:
                part[0] = T.max(part[0], logits[b, j * NT + tx] * inv_t)
        red[tx] = part[0]
        block_reduce(red, tx, m, fmax)
        part[0] = T.float32(0)
        for j in T.serial(T.ceildiv(V, NT)):
            if j * NT + tx < V:
                part[0] = part[0] + T.exp(logits[b, j * NT + tx] * inv_t - m[0])
        red[tx] = part[0]
        block_reduce(red, tx, s, fadd)

    @T.prim_func(s_tir=True)
    def sample_argmax(var_logits: T.handle, var_out: T.handle):
        T.func_attr(attrs)
        B, V = T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (B, V), "float32")
        out = T.match_buffer(var_out, (B,), "int32")
        for b in ROW(B):
            for tx in THR(NT):
                with T.sblock("argmax"):
                    red = T.sblock_alloc_buffer((NT,), "int64", scope=SHARED)
                    best = T.sblock_alloc_buffer((1,), "int64", scope=LOCAL)
                    row_argmax(logits, b, tx, V, T.int64(9223372036854775807), red, best)
                    if tx == 0:
                        out[b] = packed_index(best[0])

    @T.prim_func(s_tir=True)
    def chosen_logprobs(var_logits: T.handle, var_tok: T.handle, var_out: T.handle):
        T.func_attr(attrs)
        B, V = T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (B, V), "float32")
        tok = T.match_buffer(var_tok, (B,), "int32")
        out = T.match_buffer(var_out, (B,), "float32")
        for b in ROW(B):
            for tx in THR(NT):
                with T.sblock("chosen"):
                    red = T.sblock_alloc_buffer((NT,), "float32", scope=SHARED)
                    m = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    s = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    row_max_sum(logits, b, tx, T.float32(1), V, red, m, s)
                    if tx == 0:
                        out[b] = logits[b, tok[b]] - m[0] - T.log(s[0])

    @T.prim_func(s_tir=True)
    def top_logprobs(var_logits: T.handle, var_ids: T.handle, var_lp: T.handle):
        T.func_attr(attrs)
        B, V = T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (B, V), "float32")
        ids = T.match_buffer(var_ids, (B, K), "int32")
        lp = T.match_buffer(var_lp, (B, K), "float32")
        for b in ROW(B):
            for tx in THR(NT):
                with T.sblock("top"):
                    red = T.sblock_alloc_buffer((NT,), "float32", scope=SHARED)
                    red_p = T.sblock_alloc_buffer((NT,), "int64", scope=SHARED)
                    m = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    s = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    best = T.sblock_alloc_buffer((1,), "int64", scope=LOCAL)
                    row_max_sum(logits, b, tx, T.float32(1), V, red, m, s)
                    # the k-th pick is the largest packed key below the (k-1)-th
                    best[0] = T.int64(9223372036854775807)
                    for k in T.serial(K):
                        row_argmax(logits, b, tx, V, best[0], red_p, best)
                        if tx == 0:
                            ids[b, k] = packed_index(best[0])
                            lp[b, k] = logits[b, packed_index(best[0])] - m[0] - T.log(s[0])

    @T.macro
    def kept_mass(logits, b, tx, inv_t, m, V, t, red, out):
        """out[0] = sum of exp(x_i - m) over key(x_i) >= t."""
        part = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
        part[0] = T.float32(0)
        for j in T.serial(T.ceildiv(V, NT)):
            if j * NT + tx < V:
                if T.Cast("int64", key(logits[b, j * NT + tx] * inv_t)) >= t:
                    part[0] = part[0] + T.exp(logits[b, j * NT + tx] * inv_t - m)
        red[tx] = part[0]
        block_reduce(red, tx, out, fadd)

    @T.prim_func(s_tir=True)
    def sample_top_p(var_logits: T.handle, var_temp: T.handle, var_top_p: T.handle,
                     var_top_k: T.handle, var_u: T.handle, var_out: T.handle):
        T.func_attr(attrs)
        B, V = T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (B, V), "float32")
        temperature = T.match_buffer(var_temp, (B,), "float32")
        top_p = T.match_buffer(var_top_p, (B,), "float32")
        top_k = T.match_buffer(var_top_k, (B,), "int32")
        uniform = T.match_buffer(var_u, (B,), "float32")
        out = T.match_buffer(var_out, (B,), "int32")
        for b in ROW(B):
            for tx in THR(NT):
                with T.sblock("sample"):
                    red = T.sblock_alloc_buffer((NT,), "float32", scope=SHARED)
                    cnt = T.sblock_alloc_buffer((NT,), "int32", scope=SHARED)
                    m = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    s = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    mass = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    target = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    c = T.sblock_alloc_buffer((1,), "int32", scope=LOCAL)
                    n_it = T.sblock_alloc_buffer((1,), "int32", scope=LOCAL)
                    lo = T.sblock_alloc_buffer((1,), "int64", scope=LOCAL)
                    hi = T.sblock_alloc_buffer((1,), "int64", scope=LOCAL)
                    mid = T.sblock_alloc_buffer((1,), "int64", scope=LOCAL)
                    chosen = T.sblock_alloc_buffer((1,), "int32", scope=LOCAL)
                    acc = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    rw = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    inv_t = T.sblock_alloc_buffer((1,), "float32", scope=LOCAL)
                    inv_t[0] = T.float32(1) / temperature[b]
                    row_max_sum(logits, b, tx, inv_t[0], V, red, m, s)
                    # top-k threshold: the largest key t with count(key >= t) >= k, by bisection
                    # on the order-preserving int keys (pred(lo) holds, pred(hi) does not).
                    # Loop extents, not branches, switch a search off: syncs may not sit in a branch.
                    lo[0] = T.int64(-2147483648)
                    hi[0] = T.int64(2147483648)
                    n_it[0] = T.if_then_else(top_k[b] > 0 and T.Cast("int64", top_k[b]) < V, 33, 0)
                    for it in T.serial(n_it[0]):
                        mid[0] = lo[0] + T.shift_right(hi[0] - lo[0], T.int64(1))
                        c[0] = 0
                        for j in T.serial(T.ceildiv(V, NT)):
                            if j * NT + tx < V:
                                if T.Cast("int64", key(logits[b, j * NT + tx] * inv_t[0])) >= mid[0]:
                                    c[0] = c[0] + 1
                        cnt[tx] = c[0]
                        block_reduce(cnt, tx, c, fadd)
                        if c[0] >= top_k[b]:
                            lo[0] = mid[0]
                        else:
                            hi[0] = mid[0]
                    kept_mass(logits, b, tx, inv_t[0], m[0], V, lo[0], red, mass)
                    # top-p threshold over the top-k set's renormalised mass (HF order).
                    target[0] = top_p[b] * mass[0]
                    hi[0] = T.int64(2147483648)
                    n_it[0] = T.if_then_else(top_p[b] < T.float32(1), 33, 0)
                    for it in T.serial(n_it[0]):
                        mid[0] = lo[0] + T.shift_right(hi[0] - lo[0], T.int64(1))
                        kept_mass(logits, b, tx, inv_t[0], m[0], V, mid[0], red, acc)
                        if acc[0] >= target[0]:
                            lo[0] = mid[0]
                        else:
                            hi[0] = mid[0]
                    kept_mass(logits, b, tx, inv_t[0], m[0], V, lo[0], red, mass)
                    # inverse CDF in vocabulary order: contiguous chunks per thread, then thread 0
                    # walks the chunk sums and the one chunk that holds the draw.
                    target[0] = uniform[b] * mass[0]
                    acc[0] = T.float32(0)
                    for j in T.serial(T.ceildiv(V, NT)):
                        if tx * T.ceildiv(V, NT) + j < V:
                            if T.Cast("int64", key(logits[b, tx * T.ceildiv(V, NT) + j] * inv_t[0])) >= lo[0]:
                                acc[0] = acc[0] + T.exp(logits[b, tx * T.ceildiv(V, NT) + j] * inv_t[0] - m[0])
                    red[tx] = acc[0]
                    sync()
                    if tx == 0:
                        acc[0] = T.float32(0)
                        c[0] = -1
                        chosen[0] = -1
                        for w in T.serial(NT):
                            rw[0] = red[w]
                            if c[0] < 0 and rw[0] > T.float32(0):
                                if acc[0] + rw[0] > target[0] or w == NT - 1:
                                    c[0] = w
                                else:
                                    acc[0] = acc[0] + rw[0]
                        if c[0] < 0:  # rounding put the draw past the last chunk: take the last one
                            for w in T.serial(NT):
                                rw[0] = red[w]
                                if rw[0] > T.float32(0):
                                    c[0] = w
                        for j in T.serial(T.ceildiv(V, NT)):
                            if c[0] * T.ceildiv(V, NT) + j < V and chosen[0] < 0:
                                if T.Cast("int64", key(logits[b, c[0] * T.ceildiv(V, NT) + j] * inv_t[0])) >= lo[0]:
                                    acc[0] = acc[0] + T.exp(logits[b, c[0] * T.ceildiv(V, NT) + j] * inv_t[0] - m[0])
                                    mid[0] = T.Cast("int64", c[0] * T.ceildiv(V, NT) + j)
                                    if acc[0] > target[0]:
                                        chosen[0] = T.Cast("int32", mid[0])
                        if chosen[0] < 0:
                            chosen[0] = T.Cast("int32", mid[0])  # the last kept token of the chunk
                        out[b] = chosen[0]

    @T.prim_func(s_tir=True)
    def process_logits(var_logits: T.handle, var_rows: T.handle, var_tokens: T.handle, var_bias: T.handle,
                       var_rep: T.handle, var_sub: T.handle, var_mask: T.handle, var_out: T.handle):
        T.func_attr(attrs)
        B, V, N, W = T.int64(), T.int64(), T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (B, V), "float32")
        rows = T.match_buffer(var_rows, (N,), "int32")
        tokens = T.match_buffer(var_tokens, (N,), "int32")
        bias = T.match_buffer(var_bias, (N,), "float32")
        rep = T.match_buffer(var_rep, (N,), "float32")
        sub = T.match_buffer(var_sub, (N,), "float32")
        mask = T.match_buffer(var_mask, (B, W), "int32")
        out = T.match_buffer(var_out, (B, V), "float32")
        # the mask, every row (one kernel) ...
        for b in ROW(B):
            for tx in THR(NT):
                with T.sblock("mask"):
                    for j in T.serial(T.ceildiv(V, NT)):
                        if j * NT + tx < V:
                            out[b, j * NT + tx] = T.if_then_else(
                                T.bitwise_and(T.shift_right(mask[b, (j * NT + tx) // 32],
                                                            T.Cast("int32", (j * NT + tx) % 32)), 1) == 1,
                                logits[b, j * NT + tx], T.float32(_NEG_INF))
        # ... then the (row, token) pairs (another kernel; no two pairs name the same entry)
        for k0 in ROW(T.ceildiv(N, NT)):
            for tx in THR(NT):
                with T.sblock("pairs"):
                    if k0 * NT + tx < N:
                        if out[rows[k0 * NT + tx], tokens[k0 * NT + tx]] > T.float32(_NEG_INF):
                            out[rows[k0 * NT + tx], tokens[k0 * NT + tx]] = T.if_then_else(
                                logits[rows[k0 * NT + tx], tokens[k0 * NT + tx]] + bias[k0 * NT + tx] > T.float32(0),
                                (logits[rows[k0 * NT + tx], tokens[k0 * NT + tx]] + bias[k0 * NT + tx])
                                / rep[k0 * NT + tx],
                                (logits[rows[k0 * NT + tx], tokens[k0 * NT + tx]] + bias[k0 * NT + tx])
                                * rep[k0 * NT + tx]) - sub[k0 * NT + tx]

    return {"sample_argmax": sample_argmax, "chosen_logprobs": chosen_logprobs,
            "top_logprobs": top_logprobs, "sample_top_p": sample_top_p, "process_logits": process_logits}
