"""Runs the Triton kernels under Triton's interpreter (the CPU emulation of the kernels):
`python -m tests.python.compiler.ops.lora.triton_interp IN.npz OUT.npz` with TRITON_INTERPRET=1 set
before triton is imported (Triton's own jit'd library functions are interpreted only then), so
test_sgmv_triton.py runs it in a process of its own; `... triton_interp --serve` runs one request
after another in one such process (conftest.interpret)."""

import os
import sys
import traceback

import numpy as np


def _interpreter_scalars():
    """numpy >= 2.3 refuses int() of a 1-element array; the interpreter keeps scalars as such."""
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor  # pylint: disable=protected-access
    if getattr(orig, "scalars", False):  # patched already (an earlier request of --serve)
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.scalars = True
    interp._patch_lang_tensor = patched  # pylint: disable=protected-access


def run_linear(inp: dict) -> dict:
    """The fused linear (linear_triton.py), launched as its TIR wrapper launches it."""
    import torch

    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT

    _interpreter_scalars()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    x, w = inp["x"], inp["w"]
    mods, widths = [int(m) for m in inp["mods"]], [int(v) for v in inp["widths"]]
    n, K = x.shape
    scale = inp["scale"]
    consts, warps = LT.constants(K, widths, mods, scale.shape[1], int(inp["R"]), int(inp["bm"]), 8, w.shape[1])
    if "variant" in inp:
        v = str(inp["variant"])
        return run_rows(inp) if v == "rows" else run_xs(inp) if v == "xs" else run_cols(inp)
    if "split" in inp:
        consts["SPLIT"] = int(inp["split"])
    if "swap" in inp:
        consts["SWAP"] = int(inp["swap"])
    y = torch.full((n, sum(widths)), float("nan"), dtype=t(x).dtype)
    grid = (-(-n // consts["BM"]) * consts["SPLIT"], sum(widths) // consts["BN"])
    # the partial sums' slots hold garbage, the counters zeros (as the wrapper gets them)
    ws = torch.full((grid[0] * grid[1] * consts["BM"] * (consts["BN"] + consts["RS"]),), float("nan"))
    cnt = torch.zeros((LT.COUNTER_SLOTS,), dtype=torch.int32)
    LT.lora_linear_kernel[grid](t(x), t(w), t(inp["arena"]), t(inp["slot"]), t(inp["rank"]), t(scale),
                                t(inp["a_off"]), t(inp["b_off"]), y, ws, cnt, n, len(inp["rank"]), int(inp["base"]),
                                **consts, num_warps=warps)
    return {"y": y.numpy(), "cnt": cnt.numpy()}


def run_cols(inp: dict) -> dict:
    """Above the fused kernel's tokens: x @ W.T (as cuBLAS: fp32 sums, rounded to the dtype), the
    shrink into partial sums, the in-place expand, launched as the TIR wrapper launches them."""
    import torch

    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT

    _interpreter_scalars()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    x, w, scale = inp["x"], inp["w"], inp["scale"]
    mods, widths = [int(m) for m in inp["mods"]], [int(v) for v in inp["widths"]]
    n, K = x.shape
    go = LT.cols_launch(n, K, widths, mods, scale.shape[1], int(inp["R"]), 8, str(inp["variant"]))
    y = t((x.astype(np.float32) @ w[:, :K].astype(np.float32).T).astype(x.dtype))  # its first K columns
    v = torch.full((LT.scratch_elems(n, widths),), float("nan"), dtype=torch.float32)
    S, base = len(inp["rank"]), int(inp["base"])
    LT.lora_shrink_cols_kernel[go["shrink_grid"]](
        t(x), t(inp["arena"]), t(inp["rank"]), t(scale), t(inp["a_off"]), v, n, S, base, go["chunk"], **go["shrink"],
        num_warps=4)
    LT.lora_expand_cols_kernel[go["expand_grid"]](
        v, t(inp["arena"]), t(inp["slot"]), t(inp["rank"]), t(scale), t(inp["b_off"]), y, n, S, base, go["split"],
        **go["expand"], num_warps=go["expand_warps"])
    return {"y": y.numpy()}


def run_rows(inp: dict) -> dict:
    """The rank rows route: the fill into the rows below W (holding NaN before, as a weight's
    reserved rows hold the previous batch's rows), x @ [W; rank rows].T (as cuBLAS: fp32 sums,
    rounded to the dtype), the expand into a fresh y (NaN before), launched as the TIR wrapper does."""
    import torch

    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT

    _interpreter_scalars()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    x, w, scale = inp["x"], inp["w"], inp["scale"]
    mods, widths = [int(m) for m in inp["mods"]], [int(v) for v in inp["widths"]]
    n, K = x.shape
    go = LT.rows_launch(n, K, widths, mods, scale.shape[1], int(inp["R"]), 8)
    w_ext = torch.full((go["rows"], K), float("nan"), dtype=t(x).dtype)
    w_ext[:sum(widths)] = t(w)
    S, base = len(inp["rank"]), int(inp["base"])
    LT.lora_fill_rows_kernel[go["fill_grid"]](t(inp["arena"]), t(inp["rank"]), t(scale), t(inp["a_off"]), w_ext, S,
                                              base, **go["fill"], num_warps=go["fill_warps"])
    e = t((x.astype(np.float32) @ w_ext.numpy().astype(np.float32).T).astype(x.dtype))
    y = torch.full((n, sum(widths)), float("nan"), dtype=e.dtype)
    LT.lora_expand_rows_kernel[go["expand_grid"]](
        e, t(inp["arena"]), t(inp["slot"]), t(inp["rank"]), t(scale), t(inp["b_off"]), y, n, S, base, **go["expand"],
        num_warps=go["expand_warps"])
    return {"y": y.numpy(), "rows": w_ext[sum(widths):].numpy()}


def run_xs(inp: dict) -> dict:
    """The rank columns route: the fill of the spare columns beside W (part p's own columns holding
    NaN before, as an earlier fill's B rows; the other parts' zeros, as compiled) from the tables
    of the kept slots (`fill_slots` of them: not the stale one past them, which the forward's
    tables keep), x's producer into [x | s]'s first columns (h: its input, g: its gain, eps; with
    none, x written there as a producer would), the shrink adding s (xe and the partial sums NaN
    before, the counters zeros), then [x | s] @ [W | B cols].T (as cuBLAS: fp32 sums, rounded to the
    dtype), launched as fill_wrapper and the linear's TIR wrapper launch them."""
    import torch

    from mlc_lora.compiler_passes.ops import activation_triton as AT
    from mlc_lora.compiler_passes.ops import norm_triton as NORM
    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT

    _interpreter_scalars()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    x, w, scale = inp["x"], inp["w"], inp["scale"]
    mods, widths = [int(m) for m in inp["mods"]], [int(v) for v in inp["widths"]]
    n, K = x.shape
    producer = str(inp.get("producer", "copy"))
    go = LT.xs_launch(n, K, widths, mods, scale.shape[1], int(inp["R"]), 8)
    w_ext = torch.zeros((sum(widths), go["cols"]), dtype=t(x).dtype)
    w_ext[:, :K] = t(w)
    o = 0
    for p, wp in enumerate(widths):
        w_ext[o:o + wp, K + p * LT.RANK_COLUMNS:K + (p + 1) * LT.RANK_COLUMNS] = float("nan")
        o += wp
    S, base, F = len(inp["rank"]), int(inp["base"]), int(inp["fill_slots"])
    LT.lora_fill_cols_kernel[go["fill_grid"]](t(inp["arena"]), t(inp["rank"][:F]), t(scale[:F]), t(inp["b_off"][:F]),
                                              w_ext, F, base, **go["fill"], num_warps=go["fill_warps"])
    ke = go["shrink"]["KE"]
    xe = torch.full((n, ke), float("nan"), dtype=w_ext.dtype)
    v = torch.full((LT.scratch_elems(n, widths),), float("nan"), dtype=torch.float32)
    cnt = torch.zeros((LT.COUNTER_SLOTS,), dtype=torch.int32)
    h1 = None
    if producer in ("rms_norm", "add_rms_norm"):  # the producer's kernel as the wrapper launches it, into xe
        res = producer == "add_rms_norm"
        h1 = torch.full((n, K), float("nan"), dtype=w_ext.dtype)
        nl = NORM.launch(K, ke, residual=res)
        NORM.rms_norm_kernel[(n,)](t(inp["h"]), t(inp["r"]) if res else t(inp["h"]), t(inp["g"]), xe, h1,
                                   float(inp["eps"]), **nl["consts"], num_warps=nl["warps"])
    elif producer == "silu_mul":
        bn = AT.block_cols(K)
        AT.silu_mul_kernel[(-(-n // AT.BM), K // bn)](t(inp["h"]), xe, n, I=K, BM=AT.BM, BN=bn, LDH=ke,
                                                      num_warps=AT.WARPS)
    else:
        xe[:, :K] = t(x)
    LT.lora_shrink_xs_kernel[go["shrink_grid"]](
        t(inp["arena"]), t(inp["slot"]), t(inp["rank"]), t(scale), t(inp["a_off"]), xe, v, cnt, n, S, base,
        go["chunk"], go["split"], **go["shrink"], num_warps=go["shrink_warps"])
    y = (xe.numpy().astype(np.float32) @ w_ext.numpy().astype(np.float32).T).astype(x.dtype)
    return {"y": y, "cnt": cnt.numpy(), "cols": w_ext[:, K:].numpy(), "xe": xe.numpy(),
            **({} if h1 is None else {"h1": h1.numpy()})}


def run_silu_mul(inp: dict) -> dict:
    """ops/activation_triton.py's kernel, launched as its TIR wrapper launches it."""
    import torch

    from mlc_lora.compiler_passes.ops import activation_triton as AT

    _interpreter_scalars()
    y = torch.from_numpy(np.ascontiguousarray(inp["gate_up"]))
    n, inter = y.shape[0], y.shape[1] // 2
    ldh = int(inp.get("ldh", inter))  # h's rows ldh apart: the first columns of a wider buffer
    h = torch.full((n, ldh), float("nan"), dtype=y.dtype)
    bn = AT.block_cols(inter)
    AT.silu_mul_kernel[(-(-n // AT.BM), inter // bn)](y, h, n, I=inter, BM=AT.BM, BN=bn, LDH=ldh,
                                                      num_warps=AT.WARPS)
    return {"h": h.numpy()}


def run_norm(inp: dict) -> dict:
    """ops/norm_triton.py's RMSNorm (with the residual add where `r` is given), launched as its TIR
    wrappers launch it; x's rows `ldo` apart (the first columns of a wider buffer, as the rank
    columns route's [x | s])."""
    import torch

    from mlc_lora.compiler_passes.ops import norm_triton as NORM

    _interpreter_scalars()
    h = torch.from_numpy(np.ascontiguousarray(inp["norm_rows"]))
    res = "r" in inp
    r = torch.from_numpy(np.ascontiguousarray(inp["r"])) if res else h
    g = torch.from_numpy(inp["g"])
    ldo = int(inp.get("ldo", h.shape[1]))
    x = torch.full((h.shape[0], ldo), float("nan"), dtype=h.dtype)
    h1 = torch.full(h.shape, float("nan"), dtype=h.dtype)
    nl = NORM.launch(h.shape[1], ldo, residual=res)
    NORM.rms_norm_kernel[(h.shape[0],)](h, r, g, x, h1, float(inp["eps"]), **nl["consts"], num_warps=nl["warps"])
    return {"x": x.numpy(), "h1": h1.numpy()}


def run_rope_append(inp: dict) -> dict:
    """ops/attention/rope_append_triton.py's kernel, launched as its TIR wrapper launches it."""
    import math

    import torch

    from mlc_lora.compiler_passes.ops.attention import rope_append_triton as RA

    _interpreter_scalars()
    qkv = torch.from_numpy(np.ascontiguousarray(inp["rope_qkv"]))
    hq, hkv = int(inp["hq"]), int(inp["hkv"])
    n, ht, d = qkv.shape
    q = torch.full((n, hq, d), float("nan"), dtype=qkv.dtype)
    pages = torch.from_numpy(inp["pages"].copy())
    RA.rope_append_kernel[(n, -(-ht // RA.BH))](qkv, torch.from_numpy(inp["pos"]), torch.from_numpy(inp["app"]), q,
                                                 pages, float(inp["scale"]), math.log2(float(inp["theta"])),
                                                 **RA.constants(hq, hkv, d), num_warps=RA.WARPS)
    return {"q": q.numpy(), "pages": pages.numpy()}


def run_tiles(inp: dict) -> dict:
    """The tile kernel alone over slot_start `start` (its grid for n tokens at BM)."""
    import torch

    from mlc_lora.compiler_passes.ops.lora import sgmv_triton as ST

    _interpreter_scalars()
    start, bm, n = inp["start"], int(inp["BM"]), int(inp["n"])
    cap = len(start) - 1
    tiles = torch.full((ST.tile_table_len(n),), -7, dtype=torch.int32)
    consts = dict(BM=bm, SP=ST._slot_pad(cap), TB=ST.TILE_BLOCK)  # pylint: disable=protected-access
    ST.lora_tiles_kernel[(ST.tiles_grid(n, cap, bm),)](torch.from_numpy(start), tiles, cap, **consts)
    return {"tiles": tiles.numpy()}


def run(inp: dict) -> dict:
    """The shrink then the in-place expand, launched as the TIR wrappers launch them."""
    if "tiles_only" in inp:
        return run_tiles(inp)
    if "w" in inp:
        return run_linear(inp)
    if "gate_up" in inp:
        return run_silu_mul(inp)
    if "norm_rows" in inp:
        return run_norm(inp)
    if "rope_qkv" in inp:
        return run_rope_append(inp)
    import torch

    from mlc_lora.compiler_passes.ops.lora import sgmv_triton as ST

    _interpreter_scalars()
    variant = str(inp["variant"])
    x, arena, rank, scale = inp["x"], inp["arena"], inp["rank"], inp["scale"]
    order, start = inp["order"], inp["start"]
    mods, widths = [int(m) for m in inp["mods"]], [int(w) for w in inp["widths"]]
    base, R, cap = int(inp["base"]), int(inp["R"]), len(start) - 1
    n, K = x.shape
    cfg = dict(ST.VARIANTS[variant], **{k: int(inp[k]) for k in ("BM", "SPLITS", "BN", "G", "RSPLIT", "BK", "MIN_STEPS",
                                                                 "GMIN") if k in inp})
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    rows = ST.grid_x(n, min(cap, int(inp.get("grid_slots", cap))), cfg["BM"])  # as launch(), or fewer blocks
    fmt = str(inp.get("rows", "model"))
    sc, sy = ST.constants("shrink", variant, K, mods, None, R, scale.shape[1], cap, 8, cfg, rows=fmt)
    ec, ey = ST.constants("expand", variant, K, mods, widths, R, scale.shape[1], cap, 8, cfg, rows=fmt)
    tiles = torch.full((ST.tile_table_len(n),), -7, dtype=torch.int32)
    ST.lora_tiles_kernel[(ST.tiles_grid(n, cap, cfg["BM"]),)](t(start), tiles, cap,
                                                             **ST.tiles_constants(variant, cap, cfg))
    v = torch.full((n, len(mods), sc["CMAX"], R), float("nan"), dtype=torch.float32)
    ST.lora_shrink_kernel[(rows, sy)](t(x), t(arena), t(order), tiles, t(rank), t(scale), t(inp["a_off"]), v,
                                      n, base, **sc)
    y = t(inp["y"].copy())
    ST.lora_expand_kernel[(rows, ey)](v, t(arena), t(order), tiles, t(rank), t(scale), t(inp["b_off"]), y,
                                      n, base, **ec)
    return {"v": v.numpy(), "y": y.numpy(), "tiles": tiles.numpy()}


def main(inp_path, out_path) -> None:
    with np.load(inp_path) as f:
        out = run(dict(f))
    np.savez(out_path, **out)


def serve() -> None:
    """Requests `IN.npz OUT.npz LOG` (tab-separated), one a line on stdin, until its end; each runs
    as main() does, its output and traceback into LOG, and is answered "ok" or "failed" on stdout.
    The process ends after a failed one (a fresh one serves the next)."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        inp_path, out_path, log = line.rstrip("\n").split("\t")
        with open(log, "w", encoding="utf-8") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                main(inp_path, out_path)
                ok = True
            except BaseException:  # pylint: disable=broad-except  (reported to the test)
                traceback.print_exc()
                ok = False
            sys.stdout.flush()
            sys.stderr.flush()
        answers.write("ok\n" if ok else "failed\n")
        if not ok:
            return


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
