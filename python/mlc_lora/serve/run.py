"""Build the engine, load the startup adapters, and run the app under uvicorn."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Optional

from ..contract import PAGE_SIZE
from ..errors import LoraError, MLCLoraError
from .adapters import AdapterRoots
from .app import Server, check_api_key, create_app

logger = logging.getLogger("mlc_lora.serve")


def configure_logging(level: str) -> None:
    """mlc-lora's loggers ("mlc_lora.*") print to stderr at `level`; uvicorn sets up its own at the
    same level."""
    root = logging.getLogger("mlc_lora")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(level.upper())


def log_engine(engine) -> None:
    """What the engine loaded: the compiled folder, library and weights, LoRA, and the pool."""
    core = engine.engine
    compiled = core.runner.compiled
    folder = compiled.model_dir
    logger.info("model %s: compiled folder %s (%s, %s, %d shard(s))", engine.model_name, folder,
                compiled.target_kind, compiled.dtype, compiled.tensor_parallel_shards)
    logger.info("compiled library %s", folder / compiled.library)
    params = folder / compiled.params_file
    size = params.stat().st_size if params.is_file() else 0
    logger.info("weights %s: %d tensors, %.1f MiB", params, len(compiled.param_names), size / 2**20)
    lora = compiled.lora
    if lora is None:
        logger.info("LoRA: off (the model was compiled without --max-lora-rank)")
    else:
        logger.info("LoRA: ranks up to %d, kernel %s, modules %s", lora.max_rank, lora.kernel,
                    " ".join(m.name for m in lora.modules))
        budget = core.adapters.host_budget
        logger.info("adapter host copies: %s; prefetch of queued requests' adapters %s",
                    "unlimited" if budget is None else f"at most {budget / 2**20:.1f} MiB",
                    "on" if core.adapters.prefetch else "off")
    logger.info("pool: %d pages of %d tokens (%s), up to %d sequences, %d tokens at most per sequence",
                core.kv_pages_total, PAGE_SIZE, "KV cache" if lora is None else "KV cache and adapter weights",
                core.max_num_seqs, core.max_seq_len)
    logger.info("admission: %s%s", "fair share across adapters (virtual token counter)" if core.scheduler.fair_share
                else "first come first served", "" if core.scheduler.max_loras is None else
                f"; the running requests span at most {core.scheduler.max_loras} adapters")
    logger.info("prefix caching: %s", "on (KV of shared prompt prefixes reused, per adapter)" if core.prefix_caching
                else "off (--enable-prefix-caching turns it on)")


def serve(model: str | Path, *, adapters: Optional[dict[str, str]] = None, adapter_dirs: Optional[list[str]] = None,
          host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None, device: str = "cpu",
          served_model_name: Optional[str] = None, max_num_seqs: Optional[int] = None,
          max_total_tokens: Optional[int] = None, log_level: str = "info", guard_all: bool = False,
          max_body_bytes: Optional[int] = None, drain_timeout_s: Optional[float] = None,
          fair_share: bool = False, enable_prefix_caching: bool = False,
          adapter_host_bytes: Optional[int] = None, prefetch_adapters: bool = True,
          max_loras: Optional[int] = None) -> None:
    """Serve `model` (a compiled folder, or anything MLCEngine compiles) until interrupted.

    `adapters` (name -> PEFT folder) are trusted operator input and load from anywhere; adapters
    loaded later through the API must lie inside `adapter_dirs`. `api_key` guards /v1/*;
    `guard_all` also /metrics and the docs (/health stays open). `max_body_bytes`: larger request
    bodies get 413; `drain_timeout_s`: on SIGTERM, how long running requests may finish (None: the
    defaults of serve/app.py); `fair_share`: the engine admits by the virtual token counter;
    `enable_prefix_caching`: reuse cached KV of shared prompt prefixes, per adapter;
    `adapter_host_bytes`, `prefetch_adapters`: the adapter tiers, `max_loras`: the most adapters the
    running requests span (MLCEngine's options of those names).
    """
    import uvicorn  # pylint: disable=import-outside-toplevel

    from ..engine import AsyncMLCEngine  # pylint: disable=import-outside-toplevel

    configure_logging(log_level)
    check_api_key(api_key)  # before the engine: an empty key fails at once
    if guard_all and api_key is None:
        raise MLCLoraError("--api-key-all-routes needs --api-key (or MLC_LORA_API_KEY)")
    roots = AdapterRoots(adapter_dirs or [])
    start = time.perf_counter()
    logger.info("loading %s on %s", model, device)
    engine = AsyncMLCEngine(model, device, max_num_seqs=max_num_seqs, max_total_tokens=max_total_tokens,
                            fair_share=fair_share, enable_prefix_caching=enable_prefix_caching,
                            adapter_host_bytes=adapter_host_bytes, prefetch_adapters=prefetch_adapters,
                            max_loras=max_loras)
    try:
        log_engine(engine)
        name = served_model_name or engine.model_name
        limits = {k: v for k, v in (("max_body_bytes", max_body_bytes), ("drain_timeout_s", drain_timeout_s))
                  if v is not None}
        server = Server(engine, name, model, roots, api_key, guard_all, **limits)
        for aname, path in (adapters or {}).items():
            if aname == name:
                raise LoraError(f"--adapter {aname}=...: the name is the base model's")
            info = asyncio.run(engine.load_adapter(aname, path))
            server.adapters[aname] = str(path)
            server.metrics.adapter_loads.inc()
            logger.info("adapter %s from %s: rank %s, alpha %s, %s, %s pages", aname, path, info["rank"],
                        info["lora_alpha"], " ".join(info["target_modules"]), info["pages"])
        if roots.roots:
            logger.info("the API may load adapters from %s", ", ".join(map(str, roots.roots)))
        else:
            logger.info("loading adapters through the API is off (no --adapter-dir)")
        logger.info("ready in %.1f s; serving %s on http://%s:%d", time.perf_counter() - start, name, host, port)
        uvicorn.run(create_app(server), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.close()
