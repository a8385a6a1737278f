"""Build the engine, load the startup adapters, and run the app under uvicorn."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Optional

from ..errors import LoraError
from .adapters import AdapterRoots
from .app import Server, create_app

logger = logging.getLogger("mlc_lora.serve")


def serve(model: str | Path, *, adapters: Optional[dict[str, str]] = None, adapter_dirs: Optional[list[str]] = None,
          host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None, device: str = "cpu",
          served_model_name: Optional[str] = None, max_num_seqs: Optional[int] = None,
          max_total_tokens: Optional[int] = None, log_level: str = "info") -> None:
    """Serve `model` (a compiled folder, or anything MLCEngine compiles) until interrupted.

    `adapters` (name -> PEFT folder) are trusted operator input and load from anywhere; adapters
    loaded later through the API must lie inside `adapter_dirs`.
    """
    import uvicorn  # pylint: disable=import-outside-toplevel

    from ..engine import AsyncMLCEngine  # pylint: disable=import-outside-toplevel

    roots = AdapterRoots(adapter_dirs or [])
    engine = AsyncMLCEngine(model, device, max_num_seqs=max_num_seqs, max_total_tokens=max_total_tokens)
    try:
        name = served_model_name or engine.model_name
        server = Server(engine, name, model, roots, api_key)
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
