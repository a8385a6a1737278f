"""`ModelRunner`: a compiled model folder on one device, its weights, VM functions and pool."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..contract import BASE_FUNCTION_SUFFIX, FILL_COLUMNS_FUNCTION, FUSED_FUNCTION_SUFFIX, LORA_TABLE_INPUTS, PAGE_SIZE
from ..errors import MLCLoraError, PoolExhaustedError
from .base import LoraInputs, Runner, logit_rows
from .config import CompiledConfig
from .device import (ALLOCATORS, POOLED_PREFILL_SIZES, _tvm, default_allocator, device_of, hand_back_freed_buffers,
                     keep_gil_on_device, load_cublas)
from .pool import DevicePool


def decode_sizes(max_batch: int) -> list[int]:
    """The decode batch sizes a library compiled with CUDA graphs pads to (as vLLM's capture
    sizes): 1, 2, 4, then every multiple of 8 below max_batch, and max_batch."""
    return sorted({n for n in (1, 2, 4) if n < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


class ModelRunner(Runner):  # pylint: disable=too-many-instance-attributes
    """A compiled model on one device: weights, VM functions and its unified pool."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", params: Optional[Sequence] = None,
                 allocator: Optional[str] = None):
        """`params`: the weights already on the device, in `param_names` order (e.g. made there by
        a benchmark); by default they are read from the model folder. `allocator`: the VM's
        memory allocator, "naive" or "pooled"; by default `default_allocator(device)`."""
        compiled = CompiledConfig.read(model_dir, device)
        super().__init__(compiled)
        if compiled.tensor_parallel_shards > 1:
            raise MLCLoraError(f"{model_dir} was compiled with --tensor-parallel-shards "
                               f"{compiled.tensor_parallel_shards}: open it with "
                               "mlc_lora.runner.open_runner (one disco worker per shard)")
        tvm = _tvm()
        self._device = device_of(device)
        if compiled.uses_cublas:
            load_cublas(self._device)
        lib = tvm.runtime.load_module(str(compiled.model_dir / compiled.library))
        self.allocator = allocator or default_allocator(device)
        if self.allocator not in ALLOCATORS:
            raise MLCLoraError(f"unknown allocator {self.allocator!r}; use one of {', '.join(ALLOCATORS)}")
        # Freed host blocks go back to the system: the CPU's naive allocator frees each step's
        # activations, and on any device the host's per-step tables would otherwise leave glibc's
        # heap holding their free space (device.py, MALLOC_MMAP_THRESHOLD).
        hand_back_freed_buffers()
        self._vm = tvm.runtime.vm.VirtualMachine(lib, self._device, memory_cfg=self.allocator)
        # The pooled allocator keeps every buffer it freed, by size, and a prefill of a token count
        # not seen before leaves buffers of new sizes: after this many new counts the cached
        # buffers are released (0: never), so memory stays bounded under any mix of prompt lengths.
        # (none needed where prefill's memory is planned at its bounds: its buffers are the same at
        # every token count)
        self.pooled_prefill_sizes = 0 if compiled.bounded_prefill_memory else POOLED_PREFILL_SIZES
        # the most tokens embed takes (None: any), checked on every call
        self._embed_bound = (max(compiled.prefill_chunk_size, compiled.max_batch_size)
                             if compiled.bounded_prefill_memory else None)
        self._prefill_sizes: set[int] = set()
        if params is not None:
            if len(params) != len(compiled.param_names):
                raise MLCLoraError(f"{len(params)} params given, the model has {len(compiled.param_names)}")
            self.params = list(params)
        else:
            self.params = self._load_params(compiled.model_dir / compiled.params_file)
        self._base_arena = None  # zero LoRA arena for all-base batches, made on first use
        # decode captured in CUDA graphs reads the LoRA tables at fixed addresses (_graph_tables)
        self.graph_tables = self.lora is not None and compiled.cuda_graph
        # ... and runs batches padded to these sizes (one graph each; empty: no padding)
        self.decode_sizes = decode_sizes(compiled.max_batch_size) if compiled.cuda_graph else []
        self._fixed_tables = None
        self._graph_arena = None
        self._ids_buf = None  # token ids on the device (embed)
        # forwards by function: "prefill" / "decode" with "_base" (a LoRA model's batch without
        # adapters), "_fused" (the batch's adapters within the fused functions' columns) or "" (the
        # LoRA stage, or a model without LoRA)
        self.forwards: dict[str, int] = {}
        self._embed = self._vm["embed"]
        self._prefill = self._vm["prefill"]
        self._decode = self._vm["decode"]
        # LoRA models: the same functions without the LoRA inputs, for batches without adapters
        self._base_fns = None
        if self.lora is not None:
            try:
                self._base_fns = (self._vm["prefill" + BASE_FUNCTION_SUFFIX], self._vm["decode" + BASE_FUNCTION_SUFFIX])
            except (AttributeError, KeyError, RuntimeError):
                self._base_fns = None  # compiled by an older mlc-lora: the LoRA functions with empty tables
        # ... and both with each linear fused with its LoRA delta, for the batches within their limits
        # (a library compiled before prefill_fused has decode_fused only)
        self._fused_fns = (None, None)
        # ... whose weights' spare columns (the rank columns route) this fills with the pool's kept
        # adapters' B rows, when they change: (pool, columns generation) of the last fill
        self._fill_columns, self._filled = None, None
        if self.lora is not None and self.lora.fused is not None:
            self._fused_fns = (self._optional_fn("prefill" + FUSED_FUNCTION_SUFFIX),
                               self._vm["decode" + FUSED_FUNCTION_SUFFIX])
            if self.lora.fused.get("spare_columns"):  # (none where no linear takes the route)
                self._fill_columns = self._optional_fn(FILL_COLUMNS_FUNCTION)
        keep_gil_on_device(self._device, self._embed, self._prefill, self._decode, *(self._base_fns or ()),
                           *self._fused_fns)

    @property
    def device(self):
        return self._device

    @property
    def vm(self):
        return self._vm

    def _load_params(self, path: Path):
        from safetensors import safe_open  # pylint: disable=import-outside-toplevel

        tvm = _tvm()
        out = []
        with safe_open(str(path), framework="numpy") as st:
            for name in self.compiled.param_names:
                out.append(tvm.runtime.tensor(st.get_tensor(name), self._device))
        return out

    def create_pool(self, max_batch_size: int, max_total_seq_len: int,
                    prefill_chunk_size: Optional[int] = None, page_size: int = PAGE_SIZE) -> DevicePool:
        s = _tvm().runtime.ShapeTuple
        chunk = prefill_chunk_size or self.compiled.prefill_chunk_size
        if self.compiled.bounded_prefill_memory and (chunk > self.compiled.prefill_chunk_size
                                                     or max_batch_size > self.compiled.max_batch_size):
            raise MLCLoraError(f"prefill chunks of {chunk} tokens over {max_batch_size} sequences: {self.model_dir} "
                               f"plans prefill's memory for at most {self.compiled.prefill_chunk_size} tokens over "
                               f"{self.compiled.max_batch_size} sequences (compile it with larger bounds, or with "
                               "--no-bounded-prefill-memory)")
        handle = self._vm["create_paged_kv_cache"](
            s([max_batch_size]), s([max_total_seq_len]), s([chunk]), s([page_size]), s([0])
        )
        pool = DevicePool(handle, self.compiled, max_batch_size)
        if self.lora is not None:
            pool.configure_lora()
            if self._fill_columns is not None:  # fused batches keep their adapters' rank columns put
                pool.keep_lora_columns(self.lora.fused["rank_columns"], self.lora.fused["slot_columns"])
        return pool

    # --- forward passes -----------------------------------------------------------------------

    def embed(self, token_ids: np.ndarray):
        import tvm_ffi  # pylint: disable=import-outside-toplevel

        from .. import _ffi_api  # pylint: disable=import-outside-toplevel

        tvm = _tvm()
        ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        if self._embed_bound is not None and len(ids) > self._embed_bound:
            raise MLCLoraError(f"{len(ids)} tokens to embed: {self.model_dir} plans embed's memory for at most "
                               f"{self._embed_bound}")
        # One device buffer, refilled on the stream without a host sync (a fresh tensor per step
        # costs a synchronous copy and a cudaFree, which stall the host behind the GPU).
        if self._ids_buf is None or self._ids_buf.shape[0] < len(ids):
            self._ids_buf = tvm.runtime.empty((max(len(ids), 256),), "int32", self._device)
        dev_ids = self._ids_buf._create_view((len(ids),))  # pylint: disable=protected-access
        _ffi_api.upload_async(dev_ids, tvm_ffi.from_dlpack(ids))
        return self._embed(dev_ids, self.params)

    def _lora_args(self, lora: Optional[dict], n_tok: int) -> list:
        """The LoRA inputs (arrays or device tensors keyed by LORA_TABLE_INPUTS); None = all base model.
        ("pool": the pool's own tables, fetched after begin_forward by `_begin`.)"""
        spec = self.lora
        if spec is None:
            if lora is not None:
                raise MLCLoraError(f"{self.model_dir} was compiled without LoRA; recompile with "
                                   "--max-lora-rank and --lora-pool-pages")
            return []
        if lora is None:
            M, R = len(spec.modules), spec.max_rank
            if self._base_arena is None:  # one page: never read
                self._base_arena = _tvm().runtime.tensor(
                    np.zeros((spec.num_layers * spec.page_elems,), self.compiled.numpy_dtype), self._device)
            lora = {"lora_arena": self._base_arena, "lora_token_slot": np.full((n_tok,), -1, np.int32),
                    "lora_rank": np.zeros((0,), np.int32), "lora_scale": np.zeros((0, M), np.float32),
                    "lora_a_off": np.zeros((0, M, R), np.int32), "lora_b_off": np.zeros((0, M, R), np.int32),
                    "lora_token_order": np.arange(n_tok, dtype=np.int32),
                    "lora_slot_start": np.zeros((1,), np.int32)}
        self._check_slots(lora["lora_rank"].shape[0])
        tvm = _tvm()
        return [tvm.runtime.tensor(np.ascontiguousarray(lora[k]), self._device)
                if isinstance(lora[k], np.ndarray) else lora[k] for k in LORA_TABLE_INPUTS]

    def _optional_fn(self, name: str):
        try:
            return self._vm[name]
        except (AttributeError, KeyError, RuntimeError):
            return None

    def _fused(self, pool: DevicePool, lora: LoraInputs, which: int):
        """prefill_fused (which 0) or decode_fused (1) where the library has it and the batch's
        adapters (the pool's tables) fit its rank columns, else None."""
        fn = self._fused_fns[which]
        if fn is not None and lora == "pool" and self.lora.fused_fits(pool.lora_num_slots(), pool.lora_rank_total()):
            if self._fill_columns is not None:
                kept = (pool.serial, pool.lora_columns_generation())
                if self._filled != kept:
                    self._fill_columns(*pool.lora_tables(), self.params)
                    self._filled = kept
            return fn
        return None

    def _check_slots(self, num_slots: int) -> None:
        if self.lora.kernel == "single" and num_slots > 1:
            # Stage 1 applies slot 0 to every adapter token; a second slot would be silently wrong.
            raise MLCLoraError(f"{self.model_dir} was compiled with --lora-kernel single: a batch may "
                               f"use one adapter, got {num_slots}")

    def _begin(self, pool: DevicePool, seq_ids, lengths, lora: LoraInputs, n_tok: int) -> Optional[list]:
        """begin_forward, and the LoRA inputs of the batch (after it, for the pool's tables);
        None where the batch runs the base functions (a LoRA model, no token on an adapter)."""
        base = lora is None and self._base_fns is not None
        extra = self._lora_args(lora, n_tok) if not (isinstance(lora, str) or base) else None
        pool.begin_forward(seq_ids, lengths)
        if base:
            return None
        if extra is None:
            if lora != "pool" or self.lora is None:
                pool.end_forward()
                raise MLCLoraError(f"lora={lora!r}: pass a dict of tables, 'pool' (LoRA models), or None")
            if self._base_fns is not None and pool.lora_num_slots() == 0:
                return None  # no LoRA kernel runs for a batch without adapters
            extra = pool.lora_tables()
            try:
                self._check_slots(extra[2].shape[0])
            except MLCLoraError:
                pool.end_forward()
                raise
        return extra

    def prefill(self, pool: DevicePool, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]],
                lora: LoraInputs = None, positions: Optional[Sequence[Sequence[int]]] = None):
        """One ragged prefill over several sequences; returns last-token logits (b, V) on device.
        `lora` (models compiled with LoRA): a dict of the LoRA inputs for the concatenated tokens,
        "pool" for the tables the pool builds from each sequence's adapter, or None (base model)."""
        tvm = _tvm()
        lengths = [len(t) for t in tokens]
        if min(lengths) < 1:
            raise MLCLoraError("every sequence in a prefill needs at least one token")
        flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in tokens])
        if self.compiled.bounded_prefill_memory and (len(flat) > self.compiled.prefill_chunk_size
                                                     or len(tokens) > self.compiled.max_batch_size):
            raise MLCLoraError(f"a prefill of {len(flat)} tokens over {len(tokens)} sequences: {self.model_dir} "
                               f"plans prefill's memory for at most {self.compiled.prefill_chunk_size} tokens over "
                               f"{self.compiled.max_batch_size} sequences")
        self._bound_pool(len(flat))
        emb = self.embed(flat)
        emb = emb._create_view((1, len(flat), emb.shape[-1]))  # pylint: disable=protected-access
        rows = logit_rows(lengths, positions)
        last = tvm.runtime.tensor(rows, self._device)
        extra = self._begin(pool, seq_ids, lengths, lora, len(flat))
        if extra is None:
            logits, _ = self._base_fns[0](emb, last, pool.handle, self.params)
            self._count("prefill" + BASE_FUNCTION_SUFFIX)
        else:
            fused = self._fused(pool, lora, 0)
            logits, _ = (fused or self._prefill)(emb, last, pool.handle, *extra, self.params)
            self._count("prefill" + (FUSED_FUNCTION_SUFFIX if fused else ""))
        pool.end_forward()
        return logits._create_view((len(rows), logits.shape[-1]))  # pylint: disable=protected-access

    def _count(self, function: str) -> None:
        self.forwards[function] = self.forwards.get(function, 0) + 1

    def _bound_pool(self, n_tok: int) -> None:
        """Pooled allocator: release the cached buffers once `pooled_prefill_sizes` new prefill
        token counts have left theirs (buffers in use stay; CUDA graphs keep their own)."""
        if self.allocator != "pooled" or not self.pooled_prefill_sizes or n_tok in self._prefill_sizes:
            return
        if len(self._prefill_sizes) >= self.pooled_prefill_sizes:
            _tvm().get_global_func("vm.builtin.memory_manager.clear")()
            self._prefill_sizes.clear()
        self._prefill_sizes.add(n_tok)

    def _graph_tables(self, extra: list, pool: DevicePool, lora: LoraInputs) -> list:
        """The LoRA inputs of a decode captured in CUDA graphs (the compiler counts them with the
        weights, see compiler_passes/passes/lora_rewrite.py): a graph replays the addresses and the slot
        count it was captured with. The pool's own tables live at fixed addresses: they are passed
        at the pool's slot capacity (`lora_graph_tables`); tables given as a dict are copied (on
        the device) into buffers allocated once. Rows past the batch's slots are never read:
        every token reads only its own slot. The arena must stay the same one."""
        tvm = _tvm()
        arena = extra[0]
        if self._graph_arena is None:
            self._graph_arena = arena.data_ptr()
        elif arena.data_ptr() != self._graph_arena:
            raise MLCLoraError("this model's decode runs in CUDA graphs bound to the LoRA arena of the "
                               "first pool it ran with; use one pool per ModelRunner, or compile "
                               "with --no-cuda-graph")
        if lora == "pool":
            return pool.lora_graph_tables()
        if self._fixed_tables is None:
            M, R, S = len(self.lora.modules), self.lora.max_rank, self.compiled.max_batch_size
            # zeros: rows past a batch's slots are read by no sgmv kernel, and decode_fused's kernels
            # reads them as rank-0, scale-0 slots until a batch writes them
            self._fixed_tables = [tvm.runtime.tensor(np.zeros(shape, dt), self._device) for shape, dt in (
                ((S,), "int32"), ((S,), "int32"), ((S, M), "float32"), ((S, M, R), "int32"), ((S, M, R), "int32"),
                ((S,), "int32"), (tuple(extra[7].shape), "int32"))]
        if tuple(extra[7].shape) != tuple(self._fixed_tables[6].shape):
            raise MLCLoraError("this model's decode runs in CUDA graphs bound to the slot capacity of the first "
                               "pool it ran with; use one pool per ModelRunner")
        out = [arena]
        for i, (src, buf) in enumerate(zip(extra[1:], self._fixed_tables)):
            view = buf._create_view(tuple(src.shape))  # pylint: disable=protected-access
            view.copyfrom(src)
            # token_slot and token_order are (batch,); the slot tables full size; slot_start has
            # every entry of the pool's slot capacity already
            out.append(view if i in (0, 5) else buf)
        return out

    def decode(self, pool: DevicePool, seq_ids: Sequence[int], tokens: Sequence[int], lora: LoraInputs = None,
               pad: bool = True):
        """One decode step, one token per sequence; returns logits (b, V) on device. A library
        compiled with CUDA graphs pads the batch to the next of `decode_sizes` with padding
        sequences (`Pool.padding_sequences`; their rows' logits are not returned), so that a graph
        is captured per bucket, not per batch size."""
        b = len(seq_ids)
        pads = self._padding(pool, b, lora) if pad else []
        emb = self.embed(np.asarray(list(tokens) + [0] * len(pads), dtype=np.int32))
        emb = emb._create_view((b + len(pads), 1, emb.shape[-1]))  # pylint: disable=protected-access
        rows = list(seq_ids) + pads
        try:
            extra = self._begin(pool, rows, [1] * len(rows), lora, len(rows))
        except Exception as e:
            pool.reset_padding(pads)  # (begin_forward may or may not have appended their tokens)
            if pads and isinstance(e, PoolExhaustedError):  # the padding's pages: the batch as it is
                return self.decode(pool, seq_ids, tokens, lora, pad=False)
            raise
        try:
            if extra is None:
                logits, _ = self._base_fns[1](emb, pool.handle, self.params)
                self._count("decode" + BASE_FUNCTION_SUFFIX)
            else:
                if self.graph_tables:
                    try:
                        extra = self._graph_tables(extra, pool, lora)
                    except MLCLoraError:
                        pool.end_forward()
                        for s in seq_ids:  # begin_forward appended the step's token: take it back
                            pool.popn(s, 1)
                        raise
                fused = self._fused(pool, lora, 1)
                logits, _ = (fused or self._decode)(emb, pool.handle, *extra, self.params)
                self._count("decode" + (FUSED_FUNCTION_SUFFIX if fused else ""))
            pool.end_forward()
        except Exception:
            pool.reset_padding(pads)
            raise
        pool.clear_padding(pads)
        return logits._create_view((b, logits.shape[-1]))  # pylint: disable=protected-access

    def _padding(self, pool: DevicePool, b: int, lora: LoraInputs) -> list[int]:
        """The padding sequences of a decode of b sequences (none without `decode_sizes`, for
        tables given as a dict, or where the pool has not a page to spare for each beside one
        for every sequence of the batch: padding never evicts an adapter)."""
        if not self.decode_sizes or not (lora is None or lora == "pool"):
            return []
        k = next((n for n in self.decode_sizes if n >= b), b) - b
        if k == 0 or b + k > pool.max_batch_size or pool.available_pages() < b + k:
            return []
        return pool.padding_sequences(k)

    def capture_decode_graphs(self, pool: DevicePool, progress=None) -> int:
        """Run every decode function once at every size of `decode_sizes` up to the pool's batch,
        padding rows only, so that their CUDA graphs are captured now rather than by the first
        batch of each size; returns the sizes run. `progress(done, total)` is called after each. Stops at the first
        size the pool has no pages for (those sizes are captured on first use)."""
        if not self.decode_sizes:
            return 0
        fns = [(self._base_fns[1], False)] if self._base_fns is not None else []
        if self.lora is not None:
            fns += [(fn, True) for fn in (self._decode, self._fused_fns[1]) if fn is not None]
        elif not fns:
            fns = [(self._decode, False)]
        sizes = [n for n in self.decode_sizes if n <= pool.max_batch_size]
        done = 0
        for n in sizes:
            if pool.available_pages() < n:
                break
            pads = pool.padding_sequences(n)
            emb = self.embed(np.zeros(n, np.int32))
            emb = emb._create_view((n, 1, emb.shape[-1]))  # pylint: disable=protected-access
            pool.begin_forward(pads, [1] * n)
            try:
                for fn, with_tables in fns:
                    extra = self._graph_tables(pool.lora_tables(), pool, "pool") if with_tables else []
                    fn(emb, pool.handle, *extra, self.params)
                pool.end_forward()
            finally:
                pool.clear_padding(pads)
            done += 1
            if progress is not None:
                progress(done, len(sizes))
        return done
