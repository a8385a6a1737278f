"""Compiled models at run time: the layer under the engine.

`open_runner(model_dir, device)` gives a `Runner`: `ModelRunner` on one device, or for a model
compiled with `--tensor-parallel-shards K > 1` the `ShardedModelRunner` of K disco workers. Both
make a `Pool` (`create_pool`: the unified pool, KV cache and adapter store in one) and run
`prefill`/`decode` on it; the engine uses nothing else.

Modules: config (the compiled folder's config, typed), device (TVM's runtime, CUDA, cuBLAS),
pool (Pool, PoolStats, AdapterInfo, HostCopy, DevicePool), base (Runner), single (ModelRunner),
disco (sessions and collectives), sharded (ShardedModelRunner, ShardedPool, worker functions),
worker (the GPU worker process entrypoint, `python -m mlc_lora.runner.worker`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from ..errors import MLCLoraError
from .base import Runner
from .config import CompiledConfig, read_compiled_config
from .device import _tvm, device_of, keep_gil_on_device, load_cublas, load_cuda_runtime  # noqa: F401  (_tvm: for the scripts)
from .pool import AdapterInfo, DevicePool, HostCopy, Pool, PoolStats
from .sharded import ShardedModelRunner, ShardedPool
from .single import ModelRunner


def open_runner(model_dir: str | Path, device: str = "cpu", params: Optional[Sequence] = None) -> Runner:
    """The runner of a compiled model: ModelRunner, or for a model compiled with
    --tensor-parallel-shards K > 1 the ShardedModelRunner of K disco workers (cpu: threads with
    numpy collectives; cuda: GPUs 0..K-1 with NCCL). `params` (weights already on the device) only
    for an unsharded model."""
    if CompiledConfig.read(model_dir).tensor_parallel_shards > 1:
        if params is not None:
            raise MLCLoraError("params= is not supported for a tensor-parallel model")
        return ShardedModelRunner(model_dir, "cpu" if device == "cpu" else "cuda")
    return ModelRunner(model_dir, device, params=params)


__all__ = ["AdapterInfo", "CompiledConfig", "DevicePool", "HostCopy", "ModelRunner", "Pool", "PoolStats", "Runner",
           "ShardedModelRunner", "ShardedPool", "device_of", "keep_gil_on_device", "load_cublas", "load_cuda_runtime",
           "open_runner", "read_compiled_config"]
