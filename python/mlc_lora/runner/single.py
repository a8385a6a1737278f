"""Load a compiled model folder and run its functions: the thin layer under the engine.

Needs only TVM's runtime (it works with the runtime-only bundle used on the GPU machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from .contract import BASE_FUNCTION_SUFFIX, CONFIG_FILE, LORA_TABLE_INPUTS, PAGE_SIZE
from .errors import MLCLoraError



def _tvm():
    import tvm  # pylint: disable=import-outside-toplevel
    import tvm.runtime.vm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    return tvm


def load_cuda_runtime() -> None:
    """Runtime-only TVM does not autoload its CUDA device API; load it once."""
    tvm = _tvm()
    if tvm.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    tvm_ffi.libinfo.load_lib_ctypes("tvm", "tvm_runtime_cuda", "RTLD_GLOBAL",
                                    extra_lib_paths=tvm.libinfo.package_lib_paths())


def load_cublas(device) -> None:
    """Ready the cuBLAS extern of models compiled with `--gemm cublas`: preload libcublas(Lt).so.13
    from the nvidia-cublas wheel when the loader cannot find them, then make the device's handle and
    workspace now, before any CUDA-graph capture (which cannot allocate)."""
    import ctypes  # pylint: disable=import-outside-toplevel

    tvm = _tvm()
    init = tvm.get_global_func("mlc_lora.runtime.cublas_init", allow_missing=True)
    if init is None:
        raise MLCLoraError("this model runs its GEMMs through cuBLAS (--gemm cublas), but the mlc_lora "
                           "runtime library with mlc_lora.runtime.cublas_gemm is not loaded")
    for name in ("libcublasLt.so.13", "libcublas.so.13"):
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            continue
        except OSError:
            pass
        for path in _nvidia_lib_dirs():
            if (path / name).is_file():
                ctypes.CDLL(str(path / name), mode=ctypes.RTLD_GLOBAL)
                break
        else:
            raise MLCLoraError(f"{name} not found: pip install 'mlc-lora[cuda]' (the nvidia-cublas "
                               "wheel), or compile with --gemm tvm")
    init(device.index)


def _nvidia_lib_dirs() -> list[Path]:
    try:
        import nvidia  # pylint: disable=import-outside-toplevel
    except ImportError:
        return []
    return [Path(p) / sub / "lib" for p in nvidia.__path__ for sub in ("cu13", "cublas")]


def device_of(name: str):
    tvm = _tvm()
    if name == "cpu":
        return tvm.cpu(0)
    if name.startswith("cuda"):
        load_cuda_runtime()
        idx = int(name.split(":", 1)[1]) if ":" in name else 0
        dev = tvm.cuda(idx)
        if not dev.exist:
            raise MLCLoraError(f"device {name!r} requested but no CUDA GPU is visible")
        return dev
    raise MLCLoraError(f"unknown device {name!r}; use 'cpu' or 'cuda'")


def read_compiled_config(model_dir: Path, device: str) -> dict:
    """The folder's mlc-lora-config.json, checked to be a compiled model for `device`'s target."""
    cfg_path = model_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise MLCLoraError(f"{model_dir} is not a compiled mlc-lora model (no {CONFIG_FILE})")
    config = json.loads(cfg_path.read_text())
    want = config["target"]["kind"]
    if (want == "llvm") != (device == "cpu"):
        raise MLCLoraError(
            f"{model_dir} was compiled for target {want!r} and cannot run on device {device!r}"
        )
    return config


def open_runner(model_dir: str | Path, device: str = "cpu", params: Sequence | None = None):
    """The runner of a compiled model: ModelRunner, or for a model compiled with
    --tensor-parallel-shards K > 1 the ShardedModelRunner of K disco workers (mlc_lora.tp).
    `params` (weights already on the device) only for an unsharded model."""
    cfg_path = Path(model_dir) / CONFIG_FILE
    if cfg_path.is_file() and int(json.loads(cfg_path.read_text()).get("tensor_parallel_shards", 1)) > 1:
        from .tp import ShardedModelRunner  # pylint: disable=import-outside-toplevel

        if params is not None:
            raise MLCLoraError("params= is not supported for a tensor-parallel model")
        return ShardedModelRunner(model_dir, "cpu" if device == "cpu" else "cuda")
    return ModelRunner(model_dir, device, params=params)


class ModelRunner:  # pylint: disable=too-many-instance-attributes
    """A compiled model on one device: weights, VM functions and KV-cache builtins."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", params: Sequence | None = None):
        """`params`: the weights already on the device, in `param_names` order (e.g. made there by
        a benchmark); by default they are read from the model folder."""
        model_dir = Path(model_dir)
        self.config = read_compiled_config(model_dir, device)
        self.model_dir = model_dir
        self.model_config = self.config["model_config"]
        if int(self.config.get("tensor_parallel_shards", 1)) > 1:
            raise MLCLoraError(f"{model_dir} was compiled with --tensor-parallel-shards "
                               f"{self.config['tensor_parallel_shards']}: open it with "
                               "mlc_lora.runner.open_runner (one disco worker per shard)")
        want = self.config["target"]["kind"]
        tvm = _tvm()
        self.device = device_of(device)
        if want == "cuda" and self.config.get("compile_options", {}).get("gemm") == "cublas":
            load_cublas(self.device)
        lib = tvm.runtime.load_module(str(model_dir / self.config["library"]))
        self.vm = tvm.runtime.vm.VirtualMachine(lib, self.device)
        if params is not None:
            if len(params) != len(self.config["param_names"]):
                raise MLCLoraError(f"{len(params)} params given, the model has "
                                   f"{len(self.config['param_names'])}")
            self.params = list(params)
        else:
            self.params = self._load_params(model_dir / self.config["params_file"])
        self._base_arena = None  # zero LoRA arena for all-base batches, made on first use
        # decode captured in CUDA graphs reads the LoRA tables at fixed addresses (_graph_tables)
        opts = self.config.get("compile_options", {})
        self.graph_tables = bool(self.lora) and want == "cuda" and bool(opts.get("cuda_graph"))
        self._fixed_tables = None
        self._graph_arena = None
        self._ids_buf = None  # token ids on the device (embed)
        self._embed = self.vm["embed"]
        self._prefill = self.vm["prefill"]
        self._decode = self.vm["decode"]
        # LoRA models: the same functions without the LoRA inputs, for batches without adapters
        self._base_fns = None
        if self.lora:
            try:
                self._base_fns = (self.vm["prefill" + BASE_FUNCTION_SUFFIX], self.vm["decode" + BASE_FUNCTION_SUFFIX])
            except (AttributeError, KeyError, RuntimeError):
                self._base_fns = None  # compiled by an older mlc-lora: the LoRA functions with empty tables
        g = tvm.get_global_func
        self.kv_add = g("vm.builtin.kv_state_add_sequence")
        self.kv_remove = g("vm.builtin.kv_state_remove_sequence")
        self.kv_fork = g("vm.builtin.kv_state_fork_sequence")
        self.kv_popn = g("vm.builtin.kv_state_popn")
        self._kv_begin = g("vm.builtin.kv_state_begin_forward")
        self._kv_end = g("vm.builtin.kv_state_end_forward")
        self.kv_available_pages = g("vm.builtin.attention_kv_cache_get_num_available_pages")
        self.kv_seq_length = g("vm.builtin.attention_kv_cache_get_sequence_length")

    @property
    def vocab_size(self) -> int:
        return self.model_config["vocab_size"]

    @property
    def dtype(self) -> str:
        return self.config["dtype"]

    def _load_params(self, path: Path):
        from safetensors import safe_open  # pylint: disable=import-outside-toplevel

        tvm = _tvm()
        out = []
        with safe_open(str(path), framework="numpy") as st:
            for name in self.config["param_names"]:
                out.append(tvm.runtime.tensor(st.get_tensor(name), self.device))
        return out

    def create_kv_cache(self, max_batch_size: int, max_total_seq_len: int,
                        prefill_chunk_size: int | None = None, page_size: int = PAGE_SIZE):
        s = _tvm().runtime.ShapeTuple
        chunk = prefill_chunk_size or self.model_config["prefill_chunk_size"]
        kv = self.vm["create_paged_kv_cache"](
            s([max_batch_size]), s([max_total_seq_len]), s([chunk]), s([page_size]), s([0])
        )
        if self.lora:  # the cache is the unified pool: size its per-batch tables
            from . import _ffi_api  # pylint: disable=import-outside-toplevel

            _ffi_api.pool_configure_lora(kv, len(self.lora["modules"]), self.lora["max_rank"])
        return kv

    # --- forward passes -----------------------------------------------------------------------

    def embed(self, token_ids: np.ndarray):
        import tvm_ffi  # pylint: disable=import-outside-toplevel

        from . import _ffi_api  # pylint: disable=import-outside-toplevel

        tvm = _tvm()
        ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        # One device buffer, refilled on the stream without a host sync (a fresh tensor per step
        # costs a synchronous copy and a cudaFree, which stall the host behind the GPU).
        if self._ids_buf is None or self._ids_buf.shape[0] < len(ids):
            self._ids_buf = tvm.runtime.empty((max(len(ids), 256),), "int32", self.device)
        dev_ids = self._ids_buf._create_view((len(ids),))  # pylint: disable=protected-access
        _ffi_api.upload_async(dev_ids, tvm_ffi.from_dlpack(ids))
        return self._embed(dev_ids, self.params)

    @property
    def lora(self) -> dict | None:
        return self.config.get("lora")

    def pool(self, name: str):
        """The unified pool's `mlc_lora.runtime.<name>` (ShardedModelRunner: on every shard)."""
        from . import _ffi_api  # pylint: disable=import-outside-toplevel

        return getattr(_ffi_api, name)

    def _lora_args(self, lora: dict | None, n_tok: int) -> list:
        """The LoRA inputs (arrays or device tensors keyed by LORA_TABLE_INPUTS); None = all base model.
        ("pool": the pool's own tables, fetched after begin_forward by `_pool_tables`.)"""
        if not self.lora:
            if lora is not None:
                raise MLCLoraError(f"{self.model_dir} was compiled without LoRA; recompile with "
                                   "--max-lora-rank and --lora-pool-pages")
            return []
        if lora is None:
            M, R = len(self.lora["modules"]), self.lora["max_rank"]
            if self._base_arena is None:
                L, E = self.lora["num_layers"], self.lora["page_elems"]  # one page: never read
                dt = self.dtype
                if dt == "bfloat16":
                    import ml_dtypes  # pylint: disable=import-outside-toplevel

                    dt = ml_dtypes.bfloat16
                self._base_arena = _tvm().runtime.tensor(np.zeros((L * E,), dt), self.device)
            lora = {"lora_arena": self._base_arena, "lora_token_slot": np.full((n_tok,), -1, np.int32),
                    "lora_rank": np.zeros((0,), np.int32), "lora_scale": np.zeros((0, M), np.float32),
                    "lora_a_off": np.zeros((0, M, R), np.int32), "lora_b_off": np.zeros((0, M, R), np.int32),
                    "lora_token_order": np.arange(n_tok, dtype=np.int32),
                    "lora_slot_start": np.zeros((1,), np.int32)}
        self._check_slots(lora["lora_rank"].shape[0])
        tvm = _tvm()
        return [tvm.runtime.tensor(np.ascontiguousarray(lora[k]), self.device)
                if isinstance(lora[k], np.ndarray) else lora[k] for k in LORA_TABLE_INPUTS]

    def _check_slots(self, num_slots: int) -> None:
        if self.lora["kernel"] == "single" and num_slots > 1:
            # Stage 1 applies slot 0 to every adapter token; a second slot would be silently wrong.
            raise MLCLoraError(f"{self.model_dir} was compiled with --lora-kernel single: a batch may "
                               f"use one adapter, got {num_slots}")

    def _begin(self, kv, seq_ids, lengths, lora, n_tok: int) -> list | None:
        """begin_forward, and the LoRA inputs of the batch (after it, for the pool's tables);
        None where the batch runs the base functions (a LoRA model, no token on an adapter)."""
        tvm = _tvm()
        base = lora is None and self._base_fns is not None
        extra = self._lora_args(lora, n_tok) if not (isinstance(lora, str) or base) else None
        self._kv_begin(kv, tvm.runtime.ShapeTuple(list(seq_ids)), tvm.runtime.ShapeTuple(lengths))
        if base:
            return None
        if extra is None:
            if lora != "pool" or not self.lora:
                self._kv_end(kv)
                raise MLCLoraError(f"lora={lora!r}: pass a dict of tables, 'pool' (LoRA models), or None")
            from . import _ffi_api  # pylint: disable=import-outside-toplevel

            if self._base_fns is not None and int(_ffi_api.pool_lora_num_slots(kv)) == 0:
                return None  # no LoRA kernel runs for a batch without adapters
            extra = list(_ffi_api.pool_lora_tables(kv))
            try:
                self._check_slots(extra[2].shape[0])
            except MLCLoraError:
                self._kv_end(kv)
                raise
        return extra

    def prefill(self, kv, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]], lora: dict | None = None):
        """One ragged prefill over several sequences; returns last-token logits (b, V) on device.
        `lora` (models compiled with LoRA): a dict of the LoRA inputs for the concatenated tokens,
        "pool" for the tables the pool builds from pool_set_sequence_adapter, or None (base model)."""
        tvm = _tvm()
        lengths = [len(t) for t in tokens]
        if min(lengths) < 1:
            raise MLCLoraError("every sequence in a prefill needs at least one token")
        flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in tokens])
        emb = self.embed(flat)
        emb = emb._create_view((1, len(flat), emb.shape[-1]))  # pylint: disable=protected-access
        last = tvm.runtime.tensor(np.cumsum(lengths).astype(np.int32) - 1, self.device)
        extra = self._begin(kv, seq_ids, lengths, lora, len(flat))
        if extra is None:
            logits, _ = self._base_fns[0](emb, last, kv, self.params)
        else:
            logits, _ = self._prefill(emb, last, kv, *extra, self.params)
        self._kv_end(kv)
        return logits._create_view((len(lengths), logits.shape[-1]))  # pylint: disable=protected-access

    def _graph_tables(self, extra: list) -> list:
        """The LoRA inputs of a decode captured in CUDA graphs (the compiler counts them with the
        weights, see compiler_passes/passes/lora_rewrite.py): a graph replays the addresses and the slot
        count it was captured with, so this batch's tables are copied (on the device) into
        buffers allocated once, passed at `max_batch_size` slots. Rows past the batch's slots are
        never read: every token reads only its own slot. The arena must stay the same one."""
        tvm = _tvm()
        arena = extra[0]
        if self._graph_arena is None:
            self._graph_arena = arena.data_ptr()
        elif arena.data_ptr() != self._graph_arena:
            raise MLCLoraError("this model's decode runs in CUDA graphs bound to the LoRA arena of the "
                               "first KV cache it ran with; use one KV cache per ModelRunner, or compile "
                               "with --no-cuda-graph")
        if self._fixed_tables is None:
            M, R, S = len(self.lora["modules"]), self.lora["max_rank"], self.model_config["max_batch_size"]
            self._fixed_tables = [tvm.runtime.empty(shape, dt, self.device) for shape, dt in (
                ((S,), "int32"), ((S,), "int32"), ((S, M), "float32"), ((S, M, R), "int32"), ((S, M, R), "int32"),
                ((S,), "int32"), (tuple(extra[7].shape), "int32"))]
        if tuple(extra[7].shape) != tuple(self._fixed_tables[6].shape):
            raise MLCLoraError("this model's decode runs in CUDA graphs bound to the slot capacity of the first "
                               "KV cache it ran with; use one KV cache per ModelRunner")
        out = [arena]
        for i, (src, buf) in enumerate(zip(extra[1:], self._fixed_tables)):
            view = buf._create_view(tuple(src.shape))  # pylint: disable=protected-access
            view.copyfrom(src)
            # token_slot and token_order are (batch,); the slot tables full size; slot_start has
            # every entry of the pool's slot capacity already
            out.append(view if i in (0, 5) else buf)
        return out

    def decode(self, kv, seq_ids: Sequence[int], tokens: Sequence[int], lora: dict | None = None):
        """One decode step, one token per sequence; returns logits (b, V) on device."""
        tvm = _tvm()
        b = len(seq_ids)
        emb = self.embed(np.asarray(tokens, dtype=np.int32))
        emb = emb._create_view((b, 1, emb.shape[-1]))  # pylint: disable=protected-access
        extra = self._begin(kv, seq_ids, [1] * b, lora, b)
        if extra is None:
            logits, _ = self._base_fns[1](emb, kv, self.params)
            self._kv_end(kv)
            return logits._create_view((b, logits.shape[-1]))  # pylint: disable=protected-access
        if self.graph_tables:
            try:
                extra = self._graph_tables(extra)
            except MLCLoraError:
                self._kv_end(kv)
                for s in seq_ids:  # begin_forward appended the step's token: take it back
                    self.kv_popn(kv, s, 1)
                raise
        logits, _ = self._decode(emb, kv, *extra, self.params)
        self._kv_end(kv)
        return logits._create_view((b, logits.shape[-1]))  # pylint: disable=protected-access
