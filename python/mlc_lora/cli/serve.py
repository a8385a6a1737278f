"""`mlc_lora serve MODEL_DIR [--adapter NAME=PATH ...] [--adapter-dir DIR ...] [--host H] [--port P]
[--api-key KEY [--api-key-all-routes]] [--fair-share]`: an OpenAI-compatible server (chat, completions, models, LoRA load/unload, metrics)."""

from __future__ import annotations

import argparse
import os

from ..errors import LoraError, MLCLoraError
from . import HelpFormatter


def _adapter(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {spec!r}")
    return name, path


def _bytes(text: str) -> int:
    """A byte count: an integer, optionally with a K, M or G suffix (powers of 1024)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = units.get(t[-1:], 1)
    try:
        n = int(t[:-1] if t[-1:] in units else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 4096, 512M or 8G, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"a byte count must be >= 0, got {text!r}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlc_lora serve", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", help="compiled model folder (or an embedded name / HF folder / .gguf, compiled once)")
    p.add_argument("--adapter", action="append", type=_adapter, default=[], metavar="NAME=PATH",
                   help="PEFT adapter folder loaded at startup under NAME (repeatable; default: none)")
    p.add_argument("--adapter-dir", action="append", default=[], metavar="DIR",
                   help="folder the API may load adapters from (repeatable; default: none, and API loading "
                        "is off)")
    p.add_argument("--adapter-host-bytes", type=_bytes, default=None, metavar="BYTES",
                   help="budget of the adapters' host copies, e.g. 8G (K, M, G: powers of 1024); copies over it "
                        "are dropped, least recently used first, and read again from their folders on next use "
                        "(default: unlimited)")
    p.add_argument("--no-adapter-prefetch", action="store_true",
                   help="do not read and page in the adapters of queued requests ahead of scheduling (they are "
                        "then loaded on the step that admits their request)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("MLC_LORA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $MLC_LORA_API_KEY; "
                        "an empty key is refused)")
    p.add_argument("--api-key-all-routes", action="store_true",
                   help="with --api-key, also guard /metrics, /docs, /redoc and /openapi.json "
                        "(/health stays open)")
    p.add_argument("--served-model-name", default=None,
                   help="the base model's name in the API (default: the model's own name)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences running at once (default: the compiled max batch size)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="tokens the KV cache holds over all sequences (default: what the pool allows)")
    p.add_argument("--fair-share", action="store_true",
                   help="under overload admit requests of the adapter (or base model) served least so far "
                        "(virtual token counter), not first come first served (default: off)")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="the running requests span at most N adapters (as vLLM's --max-loras): each step reads "
                        "fewer adapter rows, requests on other adapters wait (default: no bound)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="keep the KV of full prompt pages in the pool, per adapter, and start later requests "
                        "with the same prefix after them (default: off)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies are refused with 413 (default: 8 MiB)")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="SECONDS",
                   help="on SIGTERM new requests get 503 and running ones this long to finish before they are "
                        "aborted (default: 3)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="level of the server's log (mlc_lora and uvicorn) on stderr")
    return p


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    adapters = dict(a.adapter)
    if len(adapters) != len(a.adapter):
        raise LoraError("--adapter: the same NAME is given twice")
    try:
        from ..serve import serve  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise MLCLoraError(f"mlc_lora serve needs the server packages ({e.name} is missing): "
                           "pip install 'mlc-lora[serve]'") from e

    serve(a.model, adapters=adapters, adapter_dirs=a.adapter_dir, host=a.host, port=a.port, api_key=a.api_key,
          device=a.device, served_model_name=a.served_model_name, max_num_seqs=a.max_num_seqs,
          max_total_tokens=a.max_total_tokens, log_level=a.log_level, guard_all=a.api_key_all_routes,
          max_body_bytes=a.max_body_bytes, drain_timeout_s=a.drain_timeout, fair_share=a.fair_share,
          max_loras=a.max_loras,
          enable_prefix_caching=a.enable_prefix_caching, adapter_host_bytes=a.adapter_host_bytes,
          prefetch_adapters=not a.no_adapter_prefetch)
    return 0
