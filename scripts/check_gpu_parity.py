"""CPU-vs-GPU parity of a compiled model: the same prompts, prefill and teacher-forced decode, in one
batch that mixes the base model and LoRA adapters.

  # here (CPU): compile for llvm float32 (with LoRA when adapters are given), record logits and greedy
  # tokens of every prompt on the base model and on each adapter
  python scripts/check_gpu_parity.py reference --model smollm2-135m --out ref.npz \
      [--adapters adapters/pirate adapters/all-caps]
  # here: the GGUF in parts small enough to travel to the GPU machine one per call
  python scripts/check_gpu_parity.py split --weights smollm2-135m --out PARTS --parts 3
  # on the GPU machine (runtime-only TVM is enough): run cuda builds and compare
  python scripts/check_gpu_parity.py device --ref ref.npz --lib-dir DIR [DIR ...] \
      [--weights MODEL.gguf|PARTS] [--adapters adapters/pirate adapters/all-caps] [--single]

`device` teacher-forces the CPU's greedy tokens so that every step's logits are comparable, and
separately reports how many of its own greedy tokens agree with the CPU's, per row (prompt x
adapter). It exits 1 when a row fails the gate: a greedy token differing within the first
GATE_STEPS steps (unless the first such token is a tie at this build's precision, reported as one:
`compare_row`), or a relative logit error above GATE_REL_ERR.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
# with adapters, also asked as a chat turn (the demo adapters were trained on chat answers)
CHAT_PROMPTS = ["What is the capital of France?"]
STEPS = 32
LOGIT_STEPS = 8  # logits are kept for the prefill and the first decode steps (size)
GATE_STEPS = 16  # a row fails if its own greedy tokens differ from the CPU's before this step
GATE_REL_ERR = 2e-2  # ... or its logits' ||a - b|| / ||b|| exceeds this
# the reference's LoRA build: ranks up to 16 (the demo adapters: 16 and 8); pages for the adapters
# (27 + 5 for the demo pair) and the KV of every row
LORA_RANK = 16
LORA_POOL_PAGES = 256
PARTS_MANIFEST = "parts.json"


def make_pool(runner, rows: int):
    """The pool every run of `rows` sequences shares: the compiled LoRA pool size on LoRA builds
    (adapters and KV), else 1024 tokens of KV. Its free pages start as NaN: a kernel that reads a
    page its batch does not own fails a row instead of passing on what the memory held."""
    from mlc_lora.contract import PAGE_SIZE

    tokens = (runner.lora.pool_pages - 1) * PAGE_SIZE if runner.lora is not None else 1024
    pool = runner.create_pool(max_batch_size=rows, max_total_seq_len=tokens)
    pool.poison_free_pages()
    return pool


def load_adapters(pool, folders: list[str]) -> list[str]:
    """Read each PEFT folder into the pool, pinned, as slot i (its folder name names it); returns the
    names, in slot order."""
    names = [Path(f).name for f in folders]
    if len(set(names)) != len(names):
        raise SystemExit(f"adapter folders must have distinct names, got {names}")
    for slot, (name, folder) in enumerate(zip(names, folders)):
        pool.load_adapter(slot, folder, pin=True, name=name)
    return names


def run(runner, pool, prompts: list[list[int]], slots: list[int], forced: np.ndarray | None, steps: int):
    """Ragged prefill of all prompts, sequence i on adapter slot slots[i] (-1: the base model), then
    `steps` decode steps, all in one batch. Returns (logits [steps+1, b, V], greedy tokens
    [steps+1, b]); with `forced`, feeds forced[k] instead of the greedy choice. The sequences are
    removed at the end, so that one pool serves every run (a decode captured in CUDA graphs stays
    bound to the LoRA arena of the first pool it ran with)."""
    lora = "pool" if runner.lora is not None else None
    ids = list(range(len(prompts)))
    for i, slot in zip(ids, slots):
        pool.add_sequence(i)
        if slot >= 0:
            pool.set_sequence_adapter(i, int(slot))
    try:
        out = [runner.prefill(pool, ids, prompts, lora=lora).numpy()]
        greedy = [out[-1].argmax(-1)]
        for k in range(steps):
            feed = forced[k] if forced is not None else greedy[-1]
            out.append(runner.decode(pool, ids, [int(t) for t in feed], lora=lora).numpy())
            greedy.append(out[-1].argmax(-1))
    finally:
        for i in ids:
            pool.remove_sequence(i)
    return np.stack(out), np.stack(greedy)


def reference(args) -> int:
    """Compile the model for llvm float32 (with LoRA when adapters are given; the folder is kept
    under --work and reused), run every prompt on the base model and on each adapter in one batch,
    save the npz and print each row's greedy text."""
    from mlc_lora.compile import CompileOptions, compile_model
    from mlc_lora.contract import CONFIG_FILE
    from mlc_lora.runner import ModelRunner
    from mlc_lora.tokenizer import Tokenizer

    lora = dict(max_lora_rank=LORA_RANK, lora_pool_pages=LORA_POOL_PAGES) if args.adapters else {}
    folder = Path(args.work) / ("ref-llvm-lora" if args.adapters else "ref-llvm")
    if not (folder / CONFIG_FILE).exists():
        compile_model(args.model, folder, CompileOptions(target="llvm", dtype="float32", prefill_chunk_size=1024,
                                                         max_batch_size=16, **lora))
    tok = Tokenizer(folder)
    texts = PROMPTS + (CHAT_PROMPTS if args.adapters else [])
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    prompts += [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
                for p in texts[len(PROMPTS):]]
    runner = ModelRunner(folder, "cpu")
    row_adapter, row_prompt = mixed_rows(len(prompts), len(args.adapters))
    pool = make_pool(runner, len(row_prompt))
    names = load_adapters(pool, args.adapters)
    logits, greedy = run(runner, pool, [prompts[p] for p in row_prompt], list(row_adapter), None, STEPS)
    save_reference(args.out, logits, greedy, prompts, texts, names, row_adapter, row_prompt)
    for i, (a, p) in enumerate(zip(row_adapter, row_prompt)):
        print(f"[{names[a] if a >= 0 else 'base'}] {texts[p]!r} -> {tok.decode(greedy[:, i].tolist())!r}")
    return 0


def mixed_rows(n_prompts: int, n_adapters: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of the mixed batch: every prompt on the base model (adapter -1), then on adapter 0,
    1, ...; returns (adapter of each row, prompt of each row)."""
    return np.repeat(np.arange(-1, n_adapters), n_prompts), np.tile(np.arange(n_prompts), n_adapters + 1)


def save_reference(out: str | Path, logits: np.ndarray, greedy: np.ndarray, prompts: list[list[int]],
                   texts: list[str], names: list[str], row_adapter: np.ndarray, row_prompt: np.ndarray) -> None:
    """The npz `device` reads: logits of the prefill and the first LOGIT_STEPS decode steps and the
    greedy tokens of every row, the prompts (token ids and text), the adapter names (slot order) and
    each row's adapter and prompt. Compressed: it travels to the GPU machine."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, logits=logits[: LOGIT_STEPS + 1], greedy=greedy, prompts=np.concatenate(prompts),
                        lens=np.array([len(p) for p in prompts]), texts=np.array(texts),
                        adapters=np.array(names, dtype=str), row_adapter=row_adapter, row_prompt=row_prompt)


def split(args) -> int:
    """Write the model file in `--parts` pieces part0, part1, ... and a manifest (its name, size and
    sha256), which `device --weights FOLDER` joins again."""
    if args.parts < 1:
        raise SystemExit(f"--parts must be >= 1, got {args.parts}")
    path = weights_file(args.weights)
    data = path.read_bytes()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = math.ceil(len(data) / args.parts)
    for i in range(args.parts):
        (out / f"part{i}").write_bytes(data[i * size:(i + 1) * size])
    manifest = {"file": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "parts": args.parts}
    (out / PARTS_MANIFEST).write_text(json.dumps(manifest, indent=2))
    print(f"{path} ({len(data)} bytes) -> {out}/part0..part{args.parts - 1} ({size} bytes each at most)")
    return 0


def weights_file(weights: str) -> Path:
    """The single file `weights` names: an embedded model's file, or the path itself."""
    from mlc_lora.loader.source import EMBEDDED

    path = EMBEDDED[weights]() if weights in EMBEDDED else Path(weights)
    if not path.is_file():
        raise SystemExit(f"split takes a model file (.gguf) or an embedded name ({', '.join(EMBEDDED)}); "
                         f"{weights!r} is neither")
    return path


def join_parts(folder: Path, into: Path) -> Path:
    """The file that `split` wrote into `folder`, joined again under `into`; checks that every part
    is there and that the size and sha256 match the manifest."""
    manifest = json.loads((folder / PARTS_MANIFEST).read_text())
    parts = [folder / f"part{i}" for i in range(manifest["parts"])]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise SystemExit(f"{folder} lacks {', '.join(missing)} of the {manifest['parts']} parts of {manifest['file']}: "
                         "copy every part that `split` wrote there")
    out = into / manifest["file"]
    digest = hashlib.sha256()
    with out.open("wb") as f:
        for p in parts:
            data = p.read_bytes()
            digest.update(data)
            f.write(data)
    if out.stat().st_size != manifest["size"] or digest.hexdigest() != manifest["sha256"]:
        raise SystemExit(f"the parts in {folder} join to {out.stat().st_size} bytes with sha256 "
                         f"{digest.hexdigest()}, not the {manifest['size']} bytes of {manifest['file']} "
                         f"({manifest['sha256']})")
    return out


def adapter_folders(names: list[str], folders: list[str]) -> list[str]:
    """The folders of the reference's adapters, in its slot order (matched by folder name)."""
    by_name = {Path(f).name: f for f in folders}
    missing = [n for n in names if n not in by_name]
    extra = [n for n in by_name if n not in names]
    if missing or extra:
        raise SystemExit(f"the reference ran adapters {names}; --adapters gave {list(by_name)} (pass the PEFT "
                         "folder of each reference adapter, and no other)")
    return [by_name[n] for n in names]


def compare_row(ref_logits: np.ndarray, logits: np.ndarray, want: np.ndarray, own: np.ndarray) -> dict:
    """One row: logits [steps, V] (teacher-forced) against the CPU's, and its own greedy tokens
    against the CPU's; `ok` is the gate (no differing token before GATE_STEPS, rel err within
    GATE_REL_ERR), except that a first differing token at a tie passes, marked `tie`: the CPU's
    margin between its token and the one chosen here is within this build's logit error at that
    step (max |a - b| over the vocabulary), so the two cannot be told apart at its precision (a
    float16 build against float32: SmolLM2's pirate row of prompt #2 has a margin of 0.008 at its
    first token, against errors of ~0.06)."""
    a, b = logits.astype(np.float64), ref_logits.astype(np.float64)
    rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    diff = np.flatnonzero(own != want)
    first = int(diff[0]) if diff.size else None
    tie = None
    if first is not None and first < len(b):  # the steps before `first` fed the same tokens: same context
        margin = float(b[first, want[first]] - b[first, own[first]])
        if margin <= float(np.abs(a[first] - b[first]).max()):
            tie = margin
    return dict(max_abs=float(np.abs(a - b).max()), rel=rel, same=float((own == want).mean()), first_diff=first,
                tie=tie, ok=(first is None or first >= GATE_STEPS or tie is not None) and rel <= GATE_REL_ERR)


def device(args) -> int:
    """Run the reference's rows on each --lib-dir build (weights converted first where the folder
    has none, adapters loaded by the reference's names), teacher-forced and free-running; print the
    per-row table and the verdict. Returns 1 when a row fails the gate."""
    from mlc_lora.contract import CONFIG_FILE
    from mlc_lora.runner import ModelRunner

    ref = dict(np.load(args.ref))
    prompts = [p.tolist() for p in np.split(ref["prompts"], np.cumsum(ref["lens"])[:-1])]
    names = [str(n) for n in ref["adapters"]]
    folders = adapter_folders(names, args.adapters)
    row_adapter, row_prompt = ref["row_adapter"], ref["row_prompt"]
    n_rows = len(row_prompt)
    results = []
    for lib_dir in args.lib_dir:
        lib_dir = Path(lib_dir)
        cfg = json.loads((lib_dir / CONFIG_FILE).read_text())
        if not (lib_dir / cfg["params_file"]).exists():
            convert(args.weights, lib_dir, cfg)
        runner = ModelRunner(lib_dir, args.device)
        pool = make_pool(runner, n_rows)
        load_adapters(pool, folders)
        # all rows in one batch; with --single also each row alone (batch-1 decode paths)
        groups = [("", list(range(n_rows)))]
        groups += [(" [b=1]", [i]) for i in range(n_rows)] if args.single else []
        for tag, idx in groups:
            t0 = time.time()
            sub, slots = [prompts[row_prompt[i]] for i in idx], list(row_adapter[idx])
            logits, _ = run(runner, pool, sub, slots, ref["greedy"][:-1][:, idx], STEPS)
            _, own = run(runner, pool, sub, slots, None, STEPS)
            print(f"{lib_dir.name}{tag}: {len(idx)} rows, {time.time() - t0:.1f} s")
            for j, i in enumerate(idx):
                row = compare_row(ref["logits"][:, i], logits[: len(ref["logits"]), j], ref["greedy"][:, i], own[:, j])
                adapter = names[row_adapter[i]] if row_adapter[i] >= 0 else "base"
                results.append(dict(row, build=lib_dir.name + tag, dtype=cfg["dtype"], adapter=adapter,
                                    prompt=f"#{row_prompt[i]}"))
    print_table(results, [str(t) for t in ref["texts"]])
    failed = [r for r in results if not r["ok"]]
    ties = [r for r in results if r["ok"] and r["tie"] is not None]
    if failed:
        print(f"FAIL: {len(failed)} of {len(results)} rows differ in a greedy token before step {GATE_STEPS} "
              f"(not at a tie) or have rel err > {GATE_REL_ERR:g}")
        return 1
    print(f"PASS: {len(results) - len(ties)} of {len(results)} rows agree in every greedy token before step "
          f"{GATE_STEPS}, {len(ties)} first differ at a tie of the CPU's logits; rel err <= {GATE_REL_ERR:g}")
    return 0


def print_table(results: list[dict], texts: list[str]) -> None:
    print("\nprompts: " + "; ".join(f"#{i} {t!r}" for i, t in enumerate(texts)))
    print(f"{'build':<28} {'dtype':<9} {'adapter':<10} {'prompt':>6} {'max|d|':>10} {'rel err':>10} "
          f"{'greedy same':>12} {'1st diff step':>14}  gate")
    for r in results:
        print(f"{r['build']:<28} {r['dtype']:<9} {r['adapter']:<10} {r['prompt']:>6} {r['max_abs']:>10.3e} "
              f"{r['rel']:>10.3e} {r['same']:>12.1%} {str(r['first_diff']):>14}  "
              + ("FAIL" if not r["ok"] else "ok" if r["tie"] is None else f"tie (CPU margin {r['tie']:.3g})"))


def convert(weights: str | None, lib_dir: Path, cfg: dict) -> None:
    """Convert the weights on this machine (they are too large to travel with the library): from a
    model source, or from a folder of `split` parts joined into a temporary file first."""
    if weights is None:
        raise SystemExit(f"{lib_dir} has no {cfg['params_file']}: give --weights to convert them")
    if (Path(weights) / PARTS_MANIFEST).is_file():
        with tempfile.TemporaryDirectory() as tmp:
            convert_source(str(join_parts(Path(weights), Path(tmp))), lib_dir, cfg)
    else:
        convert_source(weights, lib_dir, cfg)


def convert_source(weights: str, lib_dir: Path, cfg: dict) -> None:
    """params.safetensors of `lib_dir` from the model source `weights` (numpy only: no compiler)."""
    from types import SimpleNamespace

    from safetensors.numpy import save_file

    from mlc_lora.loader import resolve_model
    from mlc_lora.models import loader_module, pad_weight

    source = resolve_model(weights)
    mc = SimpleNamespace(**cfg["model_config"])
    reserved = cfg.get("param_reserved") or {}  # reserved rank rows or columns: zeros beside some weights
    out = {n: pad_weight(a, *reserved.get(n, (0, 0)))
           for n, a in loader_module(cfg["architecture"]).convert_hf_weights(mc, source.weights(), cfg["dtype"])}
    save_file(out, str(lib_dir / cfg["params_file"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default="dist/parity")
    r.add_argument("--adapters", nargs="*", default=[], metavar="PEFT_DIR",
                   help="also run every prompt on each of these adapters (and a chat prompt), in one batch")
    s = sub.add_parser("split")
    s.add_argument("--weights", default="smollm2-135m", help="a model file (.gguf) or an embedded name")
    s.add_argument("--out", required=True)
    s.add_argument("--parts", type=int, default=3)
    d = sub.add_parser("device")
    d.add_argument("--ref", required=True)
    d.add_argument("--lib-dir", nargs="+", required=True)
    d.add_argument("--weights", help="model source, or a folder of `split` parts, to convert weights from "
                                     "where a folder has none")
    d.add_argument("--adapters", nargs="*", default=[], metavar="PEFT_DIR",
                   help="the PEFT folders of the reference's adapters")
    d.add_argument("--single", action="store_true", help="also run each row alone (batch-1 decode)")
    d.add_argument("--device", default="cuda", help="cuda, or cpu to check the script on the reference build")
    a = p.parse_args(argv)
    return {"reference": reference, "split": split, "device": device}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
