"""Tensor parallelism at run time: `ShardedModelRunner`, one disco worker per shard (docs/TP.md).

A model compiled with `--tensor-parallel-shards K` is one library that every shard runs on its own
slice of the weights (the all-reduces go through the session's collectives, runner/disco.py).
Every worker holds its own unified pool (its KV heads and its slices of every adapter's pages);
`ShardedPool` sends each pool operation to all workers in the same order, so the pools stay in
step: same page ids, same tables, same evictions.

Worker-side Python (`mlc_lora.sharded.*` global functions) is registered when this module is
imported; GPU worker processes import it through `python -m mlc_lora.runner.worker`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..contract import LORA_TABLE_INPUTS, PAGE_SIZE
from ..errors import LoraError, MLCLoraError, PoolExhaustedError
from ..lora.peft import LoraAdapter, pack_peft_adapter, peft_adapter_plan
from .base import LoraInputs, Runner, logit_rows
from .config import CompiledConfig
from .device import load_cublas, load_cuda_runtime
from .disco import disco_tvm, make_session, worker_rank
from .pool import POOL_LOAD_ADAPTER, POOL_LORA_TABLES, POOL_SET_ADAPTER_HOST, HostCopy, Pool

LOAD_PARAMS = "mlc_lora.sharded.load_params"
LOAD_ADAPTER = "mlc_lora.sharded.load_adapter"
SET_ADAPTER_HOST = "mlc_lora.sharded.set_adapter_host"
INIT_WORKER = "mlc_lora.sharded.init_worker"

# ---------------------------------------------------------------------------------------------
# Worker-side functions (run on every disco worker: a thread here, or a GPU worker process).


def _worker_load_params(model_dir: str):
    """This worker's shard of every parameter, on its device, in param_names order."""
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel

    from ..models import llama_loader  # pylint: disable=import-outside-toplevel
    from ..models.llama import LlamaConfig  # pylint: disable=import-outside-toplevel

    tvm = disco_tvm()
    compiled = CompiledConfig.read(model_dir)
    cfg = LlamaConfig(**compiled.model_config)
    device = tvm.get_global_func("runtime.disco.device")()
    shard = worker_rank()
    out = []
    with safe_open(str(compiled.model_dir / compiled.params_file), framework="numpy") as st:
        for name in compiled.param_names:
            arr = llama_loader.shard_param(cfg, name, st.get_tensor(name), shard)
            out.append(tvm.runtime.tensor(np.ascontiguousarray(arr), device))
    return out


def _worker_load_adapter(handle, model_dir: str, folder: str, slot: int, pin: bool) -> int:
    """Pack this worker's slices of a PEFT adapter and load them into its pool; returns pages."""
    p = pack_peft_adapter(folder, CompiledConfig.read(model_dir).raw, name=str(slot), shard=worker_rank())
    disco_tvm().get_global_func(POOL_LOAD_ADAPTER)(handle, slot, *p.ffi_args(), pin)
    return p.pages.shape[1]


def _worker_set_adapter_host(handle, model_dir: str, folder: str, slot: int) -> int:
    """Pack this worker's slices of a PEFT adapter again and hand them back as its host copy."""
    p = pack_peft_adapter(folder, CompiledConfig.read(model_dir).raw, name=str(slot), shard=worker_rank())
    disco_tvm().get_global_func(POOL_SET_ADAPTER_HOST)(handle, slot, *p.ffi_args())
    return p.pages.shape[1]


def _worker_init(device: str) -> None:
    """Ready a GPU worker: TVM's CUDA runtime and the cuBLAS handle of its device."""
    if device == "cpu":
        return
    load_cuda_runtime()
    load_cublas(disco_tvm().get_global_func("runtime.disco.device")())


def _register_worker_functions() -> None:
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    for name, f in {LOAD_PARAMS: _worker_load_params, LOAD_ADAPTER: _worker_load_adapter,
                    SET_ADAPTER_HOST: _worker_set_adapter_host, INIT_WORKER: _worker_init}.items():
        tvm_ffi.register_global_func(name, f, override=True)


# ---------------------------------------------------------------------------------------------
# The controller side.


class ShardedPool(Pool):
    """Every shard's pool, in step: each call goes to all workers in the same order.

    An error thrown inside a disco worker ends the process, so what a caller can get wrong (an
    adapter that does not fit, pinning without room) is checked here, on worker 0's pool, first."""

    def __init__(self, runner: "ShardedModelRunner", handle):
        super().__init__(handle, runner.compiled)
        self.runner = runner

    @property
    def num_shards(self) -> int:
        return self.runner.num_shards

    def _run(self, name: str, *args) -> None:
        self.runner.function(name)(self.handle, *args)

    def _values(self, name: str, *args) -> list:
        return self.runner.worker_values(self.runner.function(name)(self.handle, *args))

    def _value(self, name: str, *args):
        return self.runner.worker_value(self.runner.function(name)(self.handle, *args), 0)

    def lora_tables(self) -> list:
        """Per-worker references to the batch's tables (every worker passes its own)."""
        tables = self.runner.function(POOL_LORA_TABLES)(self.handle)
        item = self.runner.function("ffi.ArrayGetItem")
        return [item(tables, i) for i in range(len(LORA_TABLE_INPUTS))]

    def read_adapter(self, adapter: str | Path | LoraAdapter, name: Optional[str] = None) -> HostCopy:
        """The pages (the same on every shard) are counted here without packing (peft_adapter_plan):
        every worker packs its own slices of the folder when the adapter is added, or its host copy
        handed back (so a tensor-parallel model reads the folder on the engine's thread then)."""
        self._check_lora()
        if isinstance(adapter, LoraAdapter):
            raise LoraError(f"adapter {name or adapter.name}: a tensor-parallel model loads adapters from "
                            "their PEFT folders (every shard reads its own slices)")
        plan = peft_adapter_plan(adapter, self.compiled.raw)
        if name is not None:
            plan = dataclasses.replace(plan, name=name)
        lora = self.lora
        nbytes = lora.num_layers * plan.num_pages * lora.page_elems * np.dtype(self.compiled.numpy_dtype).itemsize
        return HostCopy(plan, int(nbytes), str(adapter))

    def _add_adapter(self, slot: int, host: HostCopy, pin: bool) -> bool:
        self._run(LOAD_ADAPTER, str(self.compiled.model_dir), host.source, slot, pin)
        self.runner.sync()
        return self.adapter_info(slot).resident

    def set_adapter_host(self, slot: int, host: HostCopy) -> None:
        if self.adapter_info(slot).host:  # a worker that throws ends its process: check here
            raise ValueError(f"adapter {slot} has its host pages")
        self._run(SET_ADAPTER_HOST, str(self.compiled.model_dir), host.source, slot)
        self.runner.sync()

    def drop_adapter_host(self, slot: int) -> None:
        if self.adapter_info(slot).resident:
            raise ValueError(f"adapter {slot} holds pool pages: its host copy stays")
        super().drop_adapter_host(slot)

    def prefetch_adapter(self, slot: int, keep: Sequence[int] = (), protect=()) -> bool:
        info = self.adapter_info(slot)
        if not info.resident and not info.host:
            raise ValueError(f"adapter {slot} has no host copy: hand it back before prefetching it")
        return super().prefetch_adapter(slot, keep, protect)

    def pin_adapter(self, slot: int, pin: bool) -> None:
        if pin:
            info = self.adapter_info(slot)
            if not info.resident and not info.host:
                raise ValueError(f"adapter {slot} has no host copy: hand it back before pinning it")
            s = self.stats()
            if not info.resident and info.num_pages > s.free_pages + s.evictable_pages:
                raise PoolExhaustedError(
                    f"page pool exhausted: pinning adapter {slot} needs {info.num_pages} pages per shard; "
                    f"{s.free_pages} are free and {s.evictable_pages} can be freed by evicting idle adapters")
        super().pin_adapter(slot, pin)


class ShardedModelRunner(Runner):  # pylint: disable=too-many-instance-attributes
    """A compiled tensor-parallel model over a disco session of one worker per shard.

    Every call goes to all workers (in the same order); inputs are broadcast from worker 0 and the
    logits (replicated lm_head) are read back from worker 0. LoRA models take their tables from the
    pools (`lora="pool"`) or run a batch on the base model (`lora=None`)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", session=None):
        compiled = CompiledConfig.read(model_dir, device)
        super().__init__(compiled)
        tvm = disco_tvm()
        self.sess = session if session is not None else make_session(self.num_shards, device)
        if self.sess.num_workers != self.num_shards:
            raise MLCLoraError(f"{compiled.model_dir} was compiled for {self.num_shards} tensor-parallel "
                               f"shards; the session has {self.sess.num_workers} workers")
        self._funcs: dict = {}
        self.function(INIT_WORKER)(device)
        self.mod = self.sess.load_vm_module(str(compiled.model_dir / compiled.library))
        self.params = self.function(LOAD_PARAMS)(str(compiled.model_dir))
        self._embed, self._prefill, self._decode = self.mod["embed"], self.mod["prefill"], self.mod["decode"]
        self._view = self.function("runtime.TVMTensorCreateView")
        self._item = self.function("ffi.ArrayGetItem")
        self._base_lora = None
        self._vm0 = self._device0 = None
        self._shape = tvm.runtime.ShapeTuple

    def function(self, name: str):
        """A global function of every worker (calls return per-worker references)."""
        f = self._funcs.get(name)
        if f is None:
            f = self._funcs[name] = self.sess.get_global_func(name)
        return f

    def worker_value(self, ref, worker: int = 0):
        """The value of a DRef on one worker, once that worker has run everything sent so far."""
        self.sess._sync_worker(worker)  # pylint: disable=protected-access
        return ref.debug_get_from_remote(worker)

    def worker_values(self, ref) -> list:
        """Every worker's value of a DRef, once every worker has run everything sent so far."""
        self.sync()
        return [ref.debug_get_from_remote(w) for w in range(self.num_shards)]

    def sync(self) -> None:
        """Wait until every worker has run everything sent so far."""
        self.sess._sync_all()  # pylint: disable=protected-access

    @property
    def vm(self):
        """Worker 0's VM module (in this process): the engine's sampler runs its functions."""
        if self._vm0 is None:
            self._vm0 = self.worker_value(self.mod, 0)
        return self._vm0

    @property
    def device(self):
        if self._device0 is None:
            self._device0 = self.worker_value(self.function("runtime.disco.device")(), 0)
        return self._device0

    def create_pool(self, max_batch_size: int, max_total_seq_len: int,
                    prefill_chunk_size: Optional[int] = None, page_size: int = PAGE_SIZE) -> ShardedPool:
        s = self._shape
        chunk = prefill_chunk_size or self.compiled.prefill_chunk_size
        handle = self.mod["create_paged_kv_cache"](s([max_batch_size]), s([max_total_seq_len]), s([chunk]),
                                                   s([page_size]), s([0]))
        pool = ShardedPool(self, handle)
        if self.lora is not None:
            pool.configure_lora()
        return pool

    # --- forward passes -----------------------------------------------------------------------

    def _broadcast(self, arr: np.ndarray):
        return self.sess.broadcast(np.ascontiguousarray(arr))

    def _embed_tokens(self, tokens: np.ndarray, shape: tuple[int, ...]):
        emb = self._embed(self._broadcast(tokens.astype(np.int32)), self.params)
        return self._view(emb, self._shape(shape), self.dtype, 0)

    def _lora_args(self, pool: ShardedPool, lora: LoraInputs, n_tok: int) -> list:
        """The LoRA inputs of a batch (checked by `_check_inputs`), after begin_forward."""
        spec = self.lora
        if spec is None:
            return []
        if lora == "pool":
            return pool.lora_tables()
        M, R = len(spec.modules), spec.max_rank
        if self._base_lora is None:  # one page: never read
            self._base_lora = [self.sess.empty((spec.num_layers * spec.page_elems,), self.dtype)] + [
                self._broadcast(a) for a in (np.zeros((0,), np.int32), np.zeros((0, M), np.float32),
                                             np.zeros((0, M, R), np.int32), np.zeros((0, M, R), np.int32),
                                             np.zeros((1,), np.int32))]
        slots = self._broadcast(np.full((n_tok,), -1, np.int32))
        order = self._broadcast(np.arange(n_tok, dtype=np.int32))
        arena, rank, scale, a_off, b_off, start = self._base_lora
        return [arena, slots, rank, scale, a_off, b_off, order, start]

    def _logits(self, out, rows: int):
        """Worker 0's logits (rows, V): disco keeps worker 0 in this process (a thread), so its
        tensor is used in place, on its device, as ModelRunner's are (the sampler runs there)."""
        logits = self._view(self._item(out, 0), self._shape((rows, self.vocab_size)), "float32", 0)
        return self.worker_value(logits, 0)

    def _check_inputs(self, lora: LoraInputs) -> None:
        """Before begin_forward: what `_lora_args` would refuse after it."""
        if self.lora is None:
            if lora is not None:
                raise MLCLoraError(f"{self.model_dir} was compiled without LoRA")
            return
        if self.lora.kernel == "single":
            raise MLCLoraError("tensor parallelism needs --lora-kernel gather or sgmv")
        if lora not in ("pool", None):
            raise MLCLoraError("a tensor-parallel model takes its LoRA tables from the pools: "
                               "pass lora='pool' (or None for the base model)")

    def prefill(self, pool: ShardedPool, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]],
                lora: LoraInputs = None, positions: Optional[Sequence[Sequence[int]]] = None):
        """One ragged prefill; returns the last-token logits (b, V) (worker 0's tensor)."""
        lengths = [len(t) for t in tokens]
        if min(lengths) < 1:
            raise MLCLoraError("every sequence in a prefill needs at least one token")
        self._check_inputs(lora)
        flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in tokens])
        emb = self._embed_tokens(flat, (1, len(flat), self.model_config["hidden_size"]))
        rows = logit_rows(lengths, positions)
        last = self._broadcast(rows)
        pool.begin_forward(seq_ids, lengths)
        extra = self._lora_args(pool, lora, len(flat))
        out = self._prefill(emb, last, pool.handle, *extra, self.params)
        pool.end_forward()
        return self._logits(out, len(rows))

    def decode(self, pool: ShardedPool, seq_ids: Sequence[int], tokens: Sequence[int], lora: LoraInputs = None):
        """One decode step, one token per sequence; returns logits (b, V) (worker 0's tensor)."""
        b = len(seq_ids)
        self._check_inputs(lora)
        emb = self._embed_tokens(np.asarray(tokens, np.int32), (b, 1, self.model_config["hidden_size"]))
        pool.begin_forward(seq_ids, [1] * b)
        extra = self._lora_args(pool, lora, b)
        out = self._decode(emb, pool.handle, *extra, self.params)
        pool.end_forward()
        return self._logits(out, b)


_register_worker_functions()
