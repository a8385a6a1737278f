"""Build the engine, load the startup adapters, and run the app under uvicorn."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Optional

from ..errors import LoraError, MLCLoraError
from .adapters import AdapterRoots
from .app import Server, check_api_key, create_app

logger = logging.getLogger("mlc_lora.serve")


def serve(model: str | Path, *, adapters: Optional[dict[str, str]] = None, adapter_dirs: Optional[list[str]] = None,
          host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None, device: str = "cpu",
          served_model_name: Optional[str] = None, max_num_seqs: Optional[int] = None,
          max_total_tokens: Optional[int] = None, log_level: str = "info", guard_all: bool = False) -> None:
    """Serve `model` (a compiled folder, or anything MLCEngine compiles) until interrupted.

    `adapters` (name -> PEFT folder) are trusted operator input and load from anywhere; adapters
    loaded later through the API must lie inside `adapter_dirs`. `api_key` guards /v1/*;
    `guard_all` also /metrics and the docs (/health stays open).
    """
    import uvicorn  # pylint: disable=import-outside-toplevel

    from ..engine import AsyncMLCEngine  # pylint: disable=import-outside-toplevel

    check_api_key(api_key)  # before the engine: an empty key fails at once
    if guard_all and api_key is None:
        raise MLCLoraError("--api-key-all-routes needs --api-key (or MLC_LORA_API_KEY)")
    roots = AdapterRoots(adapter_dirs or [])
    engine = AsyncMLCEngine(model, device, max_num_seqs=max_num_seqs, max_total_tokens=max_total_tokens)
    try:
        name = served_model_name or engine.model_name
        server = Server(engine, name, model, roots, api_key, guard_all)
        for aname, path in (adapters or {}).items():
            if aname == name:
                raise LoraError(f"--adapter {aname}=...: the name is the base model's")
            asyncio.run(engine.load_adapter(aname, path))
            server.adapters[aname] = str(path)
            server.metrics.adapter_loads.inc()
            logger.info("loaded adapter %s from %s", aname, path)
        uvicorn.run(create_app(server), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.close()
