"""CPU-vs-GPU parity of a compiled model: the same prompts, prefill and teacher-forced decode.

  # here (CPU): compile for llvm float32, record logits and greedy tokens
  python scripts/check_gpu_parity.py reference --model smollm2-135m --out ref.npz
  # on the GPU machine (runtime-only TVM is enough): run cuda builds and compare
  python scripts/check_gpu_parity.py device --ref ref.npz --lib-dir DIR [DIR ...] [--weights MODEL.gguf] [--single]

`device` teacher-forces the CPU's greedy tokens so that every step's logits are comparable, and
separately reports how many of its own greedy tokens agree with the CPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
STEPS = 32
LOGIT_STEPS = 8  # logits are kept for the prefill and the first decode steps (size)


def run(runner, prompts: list[list[int]], forced: np.ndarray | None, steps: int):
    """Ragged prefill of all prompts, then `steps` decode steps. Returns (logits [steps+1, b, V],
    greedy tokens [steps+1, b]); with `forced`, feeds forced[k] instead of the greedy choice."""
    b = len(prompts)
    kv = runner.create_pool(max_batch_size=b, max_total_seq_len=1024, prefill_chunk_size=256)
    ids = list(range(b))
    for i in ids:
        kv.add_sequence(i)
    out = [runner.prefill(kv, ids, prompts).numpy()]
    greedy = [out[-1].argmax(-1)]
    for k in range(steps):
        feed = forced[k] if forced is not None else greedy[-1]
        out.append(runner.decode(kv, ids, [int(t) for t in feed]).numpy())
        greedy.append(out[-1].argmax(-1))
    return np.stack(out), np.stack(greedy)


def reference(args) -> int:
    from mlc_lora.compile import CompileOptions, compile_model
    from mlc_lora.contract import CONFIG_FILE, TOKENIZER_FILE
    from mlc_lora.runner import ModelRunner
    from tokenizers import Tokenizer

    folder = Path(args.work) / "ref-llvm"
    if not (folder / CONFIG_FILE).exists():
        compile_model(args.model, folder, CompileOptions(target="llvm", dtype="float32",
                                                         prefill_chunk_size=256, max_batch_size=8))
    tok = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    prompts = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    runner = ModelRunner(folder, "cpu")
    logits, greedy = run(runner, prompts, None, STEPS)
    lens = np.array([len(p) for p in prompts])
    np.savez(args.out, logits=logits[: LOGIT_STEPS + 1], greedy=greedy, prompts=np.concatenate(prompts), lens=lens)
    for i, p in enumerate(PROMPTS):
        print(f"{p!r} -> {tok.decode(greedy[:, i].tolist())!r}")
    return 0


def device(args) -> int:
    from mlc_lora.contract import CONFIG_FILE
    from mlc_lora.runner import ModelRunner

    ref = np.load(args.ref)
    prompts = np.split(ref["prompts"], np.cumsum(ref["lens"])[:-1])
    prompts = [p.tolist() for p in prompts]
    rows = []
    for lib_dir in args.lib_dir:
        lib_dir = Path(lib_dir)
        cfg = json.loads((lib_dir / CONFIG_FILE).read_text())
        if not (lib_dir / cfg["params_file"]).exists():
            convert(args.weights, lib_dir, cfg)
        runner = ModelRunner(lib_dir, args.device)
        # all prompts in one batch; with --single also each prompt alone (batch-1 decode paths)
        groups = [("", list(range(len(prompts))))]
        groups += [(f" [b=1 #{i}]", [i]) for i in range(len(prompts))] if args.single else []
        for tag, idx in groups:
            t0 = time.time()
            sub = [prompts[i] for i in idx]
            logits, _ = run(runner, sub, ref["greedy"][:-1][:, idx], STEPS)
            _, own_greedy = run(runner, sub, None, STEPS)
            elapsed = time.time() - t0
            b = ref["logits"][:, idx].astype(np.float64)
            a = logits[: len(b)].astype(np.float64)
            want = ref["greedy"][:, idx]
            max_abs = float(np.abs(a - b).max())
            rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
            same = float((own_greedy == want).mean())
            first_diff = next((k for k in range(own_greedy.shape[0]) if (own_greedy[k] != want[k]).any()), None)
            rows.append((lib_dir.name + tag, cfg["dtype"], max_abs, rel, same, first_diff, elapsed))
    print(f"\n{'build':<28} {'dtype':<9} {'max|d|':>10} {'rel err':>10} {'greedy same':>12} "
          f"{'1st diff step':>14} {'secs':>6}")
    for r in rows:
        print(f"{r[0]:<28} {r[1]:<9} {r[2]:>10.3e} {r[3]:>10.3e} {r[4]:>12.1%} "
              f"{str(r[5]):>14} {r[6]:>6.1f}")
    return 0


def convert(weights: str, lib_dir: Path, cfg: dict) -> None:
    """Convert the weights on this machine (they are too large to travel with the library)."""
    from types import SimpleNamespace

    from safetensors.numpy import save_file

    from mlc_lora.loader import resolve_model
    from mlc_lora.models import loader_module

    source = resolve_model(weights)
    mc = SimpleNamespace(**cfg["model_config"])
    out = dict(loader_module(cfg["architecture"]).convert_hf_weights(mc, source.weights(), cfg["dtype"]))
    save_file(out, str(lib_dir / cfg["params_file"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default="dist/parity")
    d = sub.add_parser("device")
    d.add_argument("--ref", required=True)
    d.add_argument("--lib-dir", nargs="+", required=True)
    d.add_argument("--weights", help="model source to convert weights from where a folder has none")
    d.add_argument("--single", action="store_true", help="also run each prompt alone (batch-1 decode)")
    d.add_argument("--device", default="cuda", help="cuda, or cpu to check the script on the reference build")
    a = p.parse_args()
    return reference(a) if a.cmd == "reference" else device(a)


if __name__ == "__main__":
    sys.exit(main())
