"""The peers' LoRA kernels (vLLM 0.34's and SGLang 0.5.23's Triton kernels as their PyPI wheels ship
them, imports patched to run alone, with the call wrappers of `bench_peers_sgl.py`; not part of this
repository: `.dev/peers`, or a folder given with --peers), loaded for timing beside ours in the same
process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import cli

PEERS_DIR = cli.ROOT / ".dev" / "peers"


def load_peers(path: Path, dry: bool):
    """(the peers' module bench_peers_sgl, None) or (None, why not)."""
    if not (path / "bench_peers_sgl.py").is_file():
        return None, (f"no peer kernels in {path} (bench_peers_sgl.py, vllm_lora/, sglang_lora/): put them in "
                      ".dev/peers or pass --peers DIR; --no-peers runs ours alone")
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    sys.path.insert(0, str(path))
    try:
        import bench_peers_sgl as peers  # pylint: disable=import-outside-toplevel,import-error
    except ImportError as e:
        return None, f"the peer kernels do not import here: {e}"
    peers.sglang_lora.set_max_lora_chunk_size(16)  # SGLang's default --max-lora-chunk-size
    if dry:
        peers._cpu_drop_pin_memory()  # pylint: disable=protected-access  (its CPU test mode)
    return peers, None


