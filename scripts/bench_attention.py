"""Paged attention kernels side by side on one GPU: mlc-lora's
(compiler_passes/ops/attention/attention.cu), TVM's TIR kernels (the baseline our cache ran
before) and torch's scaled_dot_product_attention, on the same pages; correctness against a
float32 torch reference first.

  # here (no GPU needed): one library with both kernel sets for each shape
  python scripts/bench_attention.py compile --out attn
  # on the GPU (runtime-only TVM is enough)
  python scripts/bench_attention.py run --lib-dir attn [--log-dir DIR]

Shapes: Llama-2-7B (32 heads, MHA, d 128), Llama-3-8B (32/8 GQA, d 128, fp16 and bf16),
SmolLM2-135M (9/3, d 64). Decode also runs the pipelined variants of our kernel
(attention_cuda.DECODE_KERNELS: `pipe2`, `pipe4`), checked and timed beside the default one.
Timing: scripts/harness/timing.py's CUDA-graph method, the implementations of one case
interleaved, 5 calls on the same pages per graph, 10 replays each.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from harness import cli
from harness.timing import compare

VARIANTS = "decode_variants.json"  # beside the libraries: the names of the other decode kernels' functions
SHAPES = {  # name: (h_q, h_kv, d, dtype)
    "llama2-7b": (32, 32, 128, "float16"),
    "llama3-8b": (32, 8, 128, "float16"),
    "llama3-8b-bf16": (32, 8, 128, "bfloat16"),
    "smollm2": (9, 3, 64, "float16"),
}


def compile_libs(out: Path) -> None:
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode  # pylint: disable=import-outside-toplevel
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill  # pylint: disable=import-outside-toplevel

    from harness import compiler as C  # pylint: disable=import-outside-toplevel

    target = C.target("cuda")
    for name, (hq, hkv, d, dtype) in cli.tqdm(SHAPES.items(), desc="compile"):
        prefill, decode, ext = C.attention_cuda.build(dtype, d, hq, hkv, C.ARCH)
        # the other decode kernels, timed beside the default (attention_cuda.DECODE_KERNELS)
        variants = {f"ours_{k.removeprefix('mlc_lora_attn_')}": C.attention_cuda.decode_wrapper(dtype, d, hq, hkv, k)
                    for k in C.attention_cuda.DECODE_KERNELS if k != C.attention_cuda.DECODE_KERNEL}
        funcs = {
            "ours_prefill": prefill, "ours_decode": decode, **variants,
            "tir_prefill": _attention_prefill(hkv, hq, d, dtype, False, {}, target),
            "tir_decode": _attention_decode(hkv, hq, d, dtype, False, {}, target),
        }
        C.build_library(funcs, out / f"{name}.so", target, imports=[ext])
        (out / VARIANTS).write_text(json.dumps(sorted(variants)))  # (the run side has no compiler to ask)


def run(lib_dir: Path, log_dir: Path) -> None:  # pylint: disable=too-many-locals,too-many-statements
    import torch  # pylint: disable=import-outside-toplevel
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

    from mlc_lora.contract import PAGE_SIZE as PAGE  # pylint: disable=import-outside-toplevel

    tvm = cli.gpu_runtime()
    log = cli.Log(log_dir, "bench_attention")
    dev = torch.device("cuda")
    tv = tvm.runtime.from_dlpack
    results = {"correctness": [], "timing": []}

    for name, (hq, hkv, d, dtype) in SHAPES.items():
        lib = tvm.runtime.load_module(str(lib_dir / f"{name}.so"))
        tdt = getattr(torch, dtype)
        scale = 1.0 / math.sqrt(d)
        gen = torch.Generator(device="cuda").manual_seed(0)

        def make_batch(q_lens, kv_lens):
            """Pages for each sequence's kv_len keys (pages shuffled), queries for the last q_len."""
            n_pages = [-(-kv // PAGE) for kv in kv_lens]
            total = sum(n_pages) + 8
            pages = torch.randn(total, 2, hkv, PAGE, d, generator=gen, device=dev).to(tdt)
            perm = torch.randperm(total, generator=gen, device=dev)[:sum(n_pages)].to(torch.int32)
            page_indptr = torch.tensor([0] + list(torch.tensor(n_pages).cumsum(0)), dtype=torch.int32, device=dev)
            last = torch.tensor([kv - (n - 1) * PAGE for kv, n in zip(kv_lens, n_pages)], dtype=torch.int32, device=dev)
            qo_indptr = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
            q = torch.randn(sum(q_lens), hq, d, generator=gen, device=dev).to(tdt)
            return q, qo_indptr, pages, page_indptr, perm, last

        def reference(q, qo_indptr, pages, page_indptr, page_indices, last):
            out = torch.empty(q.shape, dtype=torch.float32, device=dev)
            for s in range(len(qo_indptr) - 1):
                q0, q1 = int(qo_indptr[s]), int(qo_indptr[s + 1])
                pg = page_indices[int(page_indptr[s]):int(page_indptr[s + 1])].long()
                kv = (len(pg) - 1) * PAGE + int(last[s])
                k = pages[pg, 0].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :kv].float()
                v = pages[pg, 1].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :kv].float()
                k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
                qs = q[q0:q1].float().transpose(0, 1)  # (hq, ql, d)
                ql = q1 - q0
                mask = torch.arange(kv, device=dev)[None, :] <= (torch.arange(ql, device=dev)[:, None] + kv - ql)
                sc = (qs @ k.transpose(1, 2)) * scale
                sc = sc.masked_fill(~mask, float("-inf"))
                out[q0:q1] = (sc.softmax(-1) @ v).transpose(0, 1)
            return out

        def ours_prefill(q, qo_indptr, pages, page_indptr, page_indices, last, o, lse, max_q):
            lib["ours_prefill"](tv(q), tv(qo_indptr), tv(pages), tv(page_indptr), tv(page_indices), tv(last),
                                tv(o), tv(lse), max_q, scale)

        work_o = torch.empty((264 + 256 * hq) * d, dtype=torch.float32, device=dev)
        work_l = torch.empty(264 + 256 * hq, dtype=torch.float32, device=dev)
        counters = torch.zeros(256 * hq, dtype=torch.int32, device=dev)

        def splits(b, max_kv):  # the cache's rule (src/runtime/unified_kv_cache.cc BuildAux)
            n = min(-(-264 // (b * hq)), 32, max(1, max_kv // 64))
            keys = -(-max_kv // n)
            keys = -(-keys // PAGE) * PAGE
            return -(-max_kv // keys), keys

        def ours_decode(q, pages, page_indptr, page_indices, last, o, lse, max_kv, fn="ours_decode"):
            n, keys = splits(q.shape[0], max_kv)
            lib[fn](tv(q), tv(pages), tv(page_indptr), tv(page_indices), tv(last), tv(o), tv(lse),
                    tv(work_o), tv(work_l), tv(counters), n, keys, scale)

        variants = json.loads((lib_dir / VARIANTS).read_text()) if (lib_dir / VARIANTS).is_file() else []

        def tir_prefill(q, qo_indptr, pages, page_indptr, page_indices, last, o, lse):
            zeros_b = torch.zeros(len(qo_indptr) - 1, dtype=torch.int32, device=dev)
            pos = torch.zeros(q.shape[0], dtype=torch.int32, device=dev)
            lib["tir_prefill"](tv(q), tv(qo_indptr), tv(pages), tv(page_indptr), tv(page_indices), tv(last),
                               tv(zeros_b), tv(pos), tv(o), tv(lse), 1, 0, 1.0, 10000.0, scale)

        def tir_decode(q, pages, page_indptr, page_indices, last, o, lse):
            zeros_b = torch.zeros(q.shape[0], dtype=torch.int32, device=dev)
            lib["tir_decode"](tv(q), tv(pages), tv(page_indptr), tv(page_indices), tv(last), tv(zeros_b),
                              tv(zeros_b), tv(o), tv(lse), 0, 1.0, 10000.0, scale)

        # ---- correctness: ragged prefill (with and without cached prefixes) and decode
        cases = [("prefill", [512, 37, 1, 130, 64, 3], [512, 100, 50, 130, 1000, 3]),
                 ("decode", [1] * 6, [1, 17, 525, 2000, 4097, 64])]
        for kind, q_lens, kv_lens in cases:
            q, qo, pages, pind, pidx, last = make_batch(q_lens, kv_lens)
            ref = reference(q, qo, pages, pind, pidx, last)
            for impl in ("ours", "tir", *(v.removeprefix("ours_decode_") for v in variants if kind == "decode")):
                o = torch.zeros_like(q)
                lse = torch.zeros(q.shape[0], hq, dtype=torch.float32, device=dev)
                if kind == "prefill" and impl == "ours":
                    ours_prefill(q, qo, pages, pind, pidx, last, o, lse, max(q_lens))
                elif kind == "prefill":
                    tir_prefill(q, qo, pages, pind, pidx, last, o, lse)
                elif impl == "ours":
                    ours_decode(q, pages, pind, pidx, last, o, lse, max(kv_lens))
                elif impl == "tir":
                    tir_decode(q, pages, pind, pidx, last, o, lse)
                else:
                    ours_decode(q, pages, pind, pidx, last, o, lse, max(kv_lens), fn=f"ours_decode_{impl}")
                torch.cuda.synchronize()
                err = float((o.float() - ref).norm() / ref.norm())
                mx = float((o.float() - ref).abs().max())
                results["correctness"].append(dict(shape=name, kind=kind, impl=impl, rel_err=err, max_abs=mx))
                log.say(f"[check] {name:15s} {kind:7s} {impl:4s} rel err {err:.2e} max abs {mx:.2e}")

        # ---- timing
        for kind, b, ql, kv in ([("prefill", b, 512, 512) for b in (1, 4, 16)]
                                + [("decode", b, 1, 525) for b in (1, 16, 64)]
                                + [("decode", 1, 1, 4096), ("decode", 16, 1, 4096)]
                                # short contexts at large batches (ShareGPT serving's decode steps)
                                + [("decode", b, 1, 160) for b in (64, 256)]):
            q, qo, pages, pind, pidx, last = make_batch([ql] * b, [kv] * b)
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[0], hq, dtype=torch.float32, device=dev)
            # SDPA on contiguous (b, h, len, d) tensors of the same sizes (GQA expanded, as HF does)
            qs = torch.randn(b, hq, ql, d, device=dev, dtype=tdt)
            ks = torch.randn(b, hq, kv, d, device=dev, dtype=tdt)
            vs = torch.randn(b, hq, kv, d, device=dev, dtype=tdt)
            if kind == "prefill":
                cands = {"ours": lambda _c: ours_prefill(q, qo, pages, pind, pidx, last, o, lse, ql),
                         "tir": lambda _c: tir_prefill(q, qo, pages, pind, pidx, last, o, lse)}
            else:
                cands = {"ours": lambda _c: ours_decode(q, pages, pind, pidx, last, o, lse, kv),
                         "tir": lambda _c: tir_decode(q, pages, pind, pidx, last, o, lse)}
                for v in variants:
                    cands[v.removeprefix("ours_decode_")] = \
                        lambda _c, v=v: ours_decode(q, pages, pind, pidx, last, o, lse, kv, fn=v)
            cands["sdpa"] = lambda _c: F.scaled_dot_product_attention(qs, ks, vs, is_causal=kind == "prefill")
            t = compare({k: (fn, 5) for k, fn in cands.items()}, reps=10)  # TIR prefill: up to ~50 ms a call
            t_ours, t_tir, t_sdpa = t["ours"], t["tir"], t["sdpa"]
            flops = 4 * b * hq * ql * kv * d / (2 if kind == "prefill" else 1)
            kv_bytes = 2 * b * kv * hkv * d * q.element_size()
            row = dict(shape=name, kind=kind, batch=b, q_len=ql, kv_len=kv, ours_us=t_ours, tir_us=t_tir,
                       sdpa_us=t_sdpa, ours_tflops=flops / t_ours / 1e6, ours_tbps=kv_bytes / t_ours / 1e6,
                       **{f"{k}_us": t[k] for k in cands if k not in ("ours", "tir", "sdpa")})
            results["timing"].append(row)
            pipes = "".join(f"  {k} {t[k]:8.1f} us ({t[k] / t_ours:.3f}x ours)" for k in cands
                            if k not in ("ours", "tir", "sdpa"))
            log.say(f"[time] {name:15s} {kind:7s} b={b:3d} q={ql:4d} kv={kv:5d}  ours {t_ours:9.1f} us  "
                    f"tir {t_tir:9.1f} us  sdpa {t_sdpa:9.1f} us  | tir/ours {t_tir / t_ours:6.2f}  "
                    f"ours/sdpa {t_ours / t_sdpa:5.2f}  {row['ours_tflops']:.0f} TFLOP/s {row['ours_tbps']:.2f} TB/s"
                    + pipes)
    cli.write_results(log.json, results)


def main(argv=None) -> None:
    ap, sub = cli.parser(__doc__, __file__)
    cli.add_compile(sub, "one library per shape with both kernel sets (here)")
    r = cli.add_run(sub, "check, then time ours / TIR / SDPA (the GPU machine)")
    r.add_argument("--lib-dir", required=True, type=Path)
    a = cli.parse(ap, argv)
    if a.cmd == "compile":
        compile_libs(a.out)
    else:
        run(a.lib_dir, a.log_dir)


if __name__ == "__main__":
    main()
