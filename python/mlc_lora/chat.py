"""The terminal chat of `mlc_lora chat`: one message or an interactive conversation, on the base
model or through a LoRA adapter (a PEFT folder or a demo adapter by name)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from .errors import LoraError

# The demo adapters (adapters/README.md), usable by name: package data of mlc_lora (in a source
# checkout python/mlc_lora/adapters links to the top-level adapters/).
DEMO_ADAPTERS = Path(__file__).resolve().parent / "adapters"


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


def chat(model: str, device: str = "cpu", *, adapter: Optional[str] = None, prompt: Optional[str] = None,
         system: Optional[str] = None, max_lora_rank: int = 64, lora_pool_pages: int = 512,
         **sampling: Any) -> None:
    """Answer `prompt` and return, or chat on stdin/stdout until /exit or end of input. `sampling`:
    max_tokens, temperature, top_p, top_k, seed. With `adapter`, a model that is not a compiled
    folder is compiled with LoRA (`max_lora_rank`, `lora_pool_pages`)."""
    found = adapter_folder(adapter) if adapter else None

    from .engine import MLCEngine  # pylint: disable=import-outside-toplevel

    lora = dict(max_lora_rank=max_lora_rank, lora_pool_pages=lora_pool_pages) if found else {}
    with MLCEngine(model, device, **lora) as engine:
        if found is not None:
            info = engine.load_adapter(*found)
            print(f"adapter {info['name']}: rank {info['rank']}, alpha {info['lora_alpha']}, "
                  f"{', '.join(info['target_modules'])}", file=sys.stderr)
        sampling["adapter_id"] = found[0] if found else None
        history = [{"role": "system", "content": system}] if system else []

        def answer(text: str) -> None:
            history.append({"role": "user", "content": text})
            reply = []
            for chunk in engine.chat.completions.create(messages=history, stream=True, **sampling):
                piece = chunk.choices[0].delta.content or ""
                reply.append(piece)
                print(piece, end="", flush=True)
            print()
            history.append({"role": "assistant", "content": "".join(reply)})

        if prompt is not None:
            answer(prompt)
            return
        print("mlc_lora chat: /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
        while True:
            try:
                text = input(">>> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return
            if text.strip() in ("/exit", "/quit"):
                return
            if text.strip() == "/reset":
                del history[int(bool(system)):]
                continue
            if text.strip():
                answer(text)
