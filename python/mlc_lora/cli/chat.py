"""`mlc_lora chat [MODEL] [--prompt TEXT]`: chat on the terminal (interactive, or one shot)."""

from __future__ import annotations

import argparse
import sys

from ..loader.source import DEFAULT_MODEL


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mlc_lora chat", description=__doc__)
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"compiled folder, embedded name, HF folder or .gguf (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--prompt", help="answer this one message and exit")
    p.add_argument("--system", help="a system message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args(argv)

    from ..engine import MLCEngine  # pylint: disable=import-outside-toplevel

    sampling = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                    seed=a.seed)
    with MLCEngine(a.model, a.device) as engine:
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
