"""`mlc_lora chat [MODEL] [--prompt TEXT] [--adapter NAME_OR_PATH]`: chat on the terminal
(interactive, or one shot), on the base model or through a LoRA adapter."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import LoraError
from ..loader.source import DEFAULT_MODEL
from . import HelpFormatter

# The demo adapters (adapters/README.md), usable by name: package data of mlc_lora (in a source
# checkout python/mlc_lora/adapters links to the top-level adapters/).
DEMO_ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"


def adapter_folder(name_or_path: str) -> tuple[str, Path]:
    """(name, folder) of --adapter: a PEFT folder, or the name of a demo adapter."""
    path = Path(name_or_path)
    if path.is_dir():
        return path.resolve().name, path
    if (DEMO_ADAPTERS / name_or_path).is_dir():
        return name_or_path, DEMO_ADAPTERS / name_or_path
    demos = sorted(p.name for p in DEMO_ADAPTERS.iterdir() if p.is_dir()) if DEMO_ADAPTERS.is_dir() else []
    raise LoraError(f"--adapter {name_or_path!r} is neither a PEFT adapter folder nor a demo adapter "
                    f"({', '.join(demos) or 'none found'})")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlc_lora chat", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"compiled folder, embedded name, HF folder or .gguf (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--prompt", help="answer this one message and exit (default: an interactive chat)")
    p.add_argument("--system", help="a system message opening the conversation (default: none)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens of one answer")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                                                            "holding this probability; 1 = all")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all")
    p.add_argument("--seed", type=int, default=None, help="random seed of the sampler (default: random)")
    p.add_argument("--adapter", metavar="NAME_OR_PATH",
                   help="answer through this LoRA adapter: a PEFT folder or a demo adapter (all-caps, "
                        "pirate); a model that is not a compiled folder is then compiled with LoRA (default: "
                        "the base model)")
    p.add_argument("--max-lora-rank", type=int, default=64,
                   help="largest adapter rank, when the model is compiled for --adapter")
    p.add_argument("--lora-pool-pages", type=int, default=512,
                   help="pages of the KV/adapter pool, when the model is compiled for --adapter")
    return p


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    adapter = adapter_folder(a.adapter) if a.adapter else None

    from ..engine import MLCEngine  # pylint: disable=import-outside-toplevel

    sampling = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                    seed=a.seed)
    lora = dict(max_lora_rank=a.max_lora_rank, lora_pool_pages=a.lora_pool_pages) if adapter else {}
    with MLCEngine(a.model, a.device, **lora) as engine:
        if adapter is not None:
            info = engine.load_adapter(*adapter)
            print(f"adapter {info['name']}: rank {info['rank']}, alpha {info['lora_alpha']}, "
                  f"{', '.join(info['target_modules'])}", file=sys.stderr)
        sampling["adapter_id"] = adapter[0] if adapter else None
        history = [{"role": "system", "content": a.system}] if a.system else []

        def answer(text: str) -> None:
            history.append({"role": "user", "content": text})
            reply = []
            for chunk in engine.chat.completions.create(messages=history, stream=True, **sampling):
                piece = chunk.choices[0].delta.content or ""
                reply.append(piece)
                print(piece, end="", flush=True)
            print()
            history.append({"role": "assistant", "content": "".join(reply)})

        if a.prompt is not None:
            answer(a.prompt)
            return 0
        print("mlc_lora chat: /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
        while True:
            try:
                text = input(">>> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if text.strip() in ("/exit", "/quit"):
                return 0
            if text.strip() == "/reset":
                del history[int(bool(a.system)):]
                continue
            if text.strip():
                answer(text)
