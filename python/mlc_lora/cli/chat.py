"""`mlc_lora chat [MODEL] [--prompt TEXT] [--adapter NAME_OR_PATH]`: chat on the terminal
(interactive, or one shot), on the base model or through a LoRA adapter."""

from __future__ import annotations

import argparse

from ..loader.source import DEFAULT_MODEL
from . import HelpFormatter


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
    from ..chat import chat  # pylint: disable=import-outside-toplevel

    chat(a.model, a.device, adapter=a.adapter, prompt=a.prompt, system=a.system, max_lora_rank=a.max_lora_rank,
         lora_pool_pages=a.lora_pool_pages, max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
         top_k=a.top_k, seed=a.seed)
    return 0
