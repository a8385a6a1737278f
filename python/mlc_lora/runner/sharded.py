"""Tensor parallelism at run time: one disco worker per shard (docs/TP.md).

A model compiled with `--tensor-parallel-shards K` is one library that every shard runs on its own
slice of the weights; the all-reduces after o_proj and down_proj are `runtime.disco.allreduce`
calls, which disco sends to the worker's collective library ("ccl"): NCCL on GPUs
(src/runtime/nccl_ccl.cc, over a ProcessSession of K worker processes), or the numpy reference
below on CPU (a ThreadedSession of K threads in this process; what the CI tests run).

`ShardedModelRunner` has ModelRunner's interface. Every worker holds its own unified pool (its
KV heads and its slices of every adapter's pages); the controller sends each pool operation to all
workers in the same order, so the pools stay in step: same page ids, same tables, same evictions.
Worker-side Python (`mlc_lora.tp.*` global functions) is registered when this module is imported;
GPU worker processes import it through the entrypoint `python -m mlc_lora.tp_worker`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import MLCLoraError
from .contract import CONFIG_FILE, LORA_TABLE_INPUTS, PAGE_SIZE, set_nccl_env
from .runner import read_compiled_config

NUMPY_CCL = "mlc_lora_numpy"
set_nccl_env()


_DISCO_READY = False


def _tvm():
    global _DISCO_READY  # pylint: disable=global-statement
    import tvm  # pylint: disable=import-outside-toplevel
    import tvm.runtime.disco  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import tvm.runtime.vm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    if not _DISCO_READY:
        # tvm 0.27 imports tvm.runtime.disco before it loads libtvm_runtime_extra (where disco's
        # C++ lives), so its _ffi_api misses SessionThreaded & co.: bind them again.
        import sys  # pylint: disable=import-outside-toplevel

        import tvm_ffi  # pylint: disable=import-outside-toplevel

        tvm_ffi.init_ffi_api("runtime.disco", "tvm.runtime.disco._ffi_api")
        sys.modules["tvm.runtime.disco.session"]._ffi_api = sys.modules["tvm.runtime.disco._ffi_api"]
        _DISCO_READY = True
    return tvm


def _shards(config: dict) -> int:
    return int(config.get("tensor_parallel_shards", config["model_config"].get("tensor_parallel_shards", 1)))


# ---------------------------------------------------------------------------------------------
# The numpy reference collectives (ccl "mlc_lora_numpy") for K worker threads of one process.


class NumpyCCL:
    """Disco's collectives over the K worker threads of a ThreadedSession, computed in numpy.

    Semantics (w = the calling worker, K workers, every worker calls each collective once):
      allreduce(send, kind, in_group, recv):  recv = sum (or prod/min/max/avg) over w of send[w]
      broadcast_from_worker0(send, g, recv):  recv = send[0]
      allgather(send, g, recv):               recv = concat over w of send[w] (flattened)
    Sums are taken in float64 in worker order, then cast back: an exact-enough reference.
    """

    _REDUCE = {0: np.sum, 1: np.prod, 2: np.min, 3: np.max, 4: np.mean}

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.slots: list = [None] * num_workers
        self.barrier = threading.Barrier(num_workers)
        self.calls = 0  # collectives completed (worker 0 counts), for tests

    def _exchange(self, value):
        tvm = _tvm()
        w = int(tvm.get_global_func("runtime.disco.worker_rank")())
        self.slots[w] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every worker has read them all
        if w == 0:
            self.calls += 1
        return w, values

    def allreduce(self, send, kind: int, _in_group: bool, recv) -> None:
        _, values = self._exchange(send.numpy())
        out = self._REDUCE[int(kind)](np.stack([v.astype(np.float64) for v in values]), axis=0)
        recv.copyfrom(out.astype(values[0].dtype))

    def broadcast_from_worker0(self, send, _in_group: bool, recv) -> None:
        _, values = self._exchange(send.numpy() if send is not None else None)
        recv.copyfrom(values[0].reshape(recv.shape))

    def allgather(self, send, _in_group: bool, recv) -> None:
        _, values = self._exchange(send.numpy())
        recv.copyfrom(np.concatenate([v.reshape(-1) for v in values]).reshape(recv.shape))


# worker thread id -> the NumpyCCL of its session (several sessions may live side by side).
_NUMPY_CCL: dict[int, NumpyCCL] = {}
_CCL_BY_ID: dict[int, NumpyCCL] = {}


def _register_numpy_ccl() -> None:
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    def current() -> NumpyCCL:
        ccl = _NUMPY_CCL.get(threading.get_ident())
        if ccl is None:
            raise MLCLoraError("the numpy collectives are not initialised on this worker")
        return ccl

    def init_ccl(sess, device_ids) -> None:
        ccl = NumpyCCL(len(device_ids))
        _CCL_BY_ID[id(ccl)] = ccl
        sess.call_packed(sess.get_global_func("mlc_lora.tp._numpy_ccl_join"), id(ccl))
        sess.call_packed(sess.get_global_func("mlc_lora.runtime.disco_set_ccl"), NUMPY_CCL)
        sess._sync_all()  # pylint: disable=protected-access

    funcs = {
        "init_ccl": init_ccl,
        "allreduce": lambda s, k, g, r: current().allreduce(s, k, g, r),
        "broadcast_from_worker0": lambda s, g, r: current().broadcast_from_worker0(s, g, r),
        "allgather": lambda s, g, r: current().allgather(s, g, r),
        "sync_worker": lambda: None,
    }
    for name, f in funcs.items():
        tvm_ffi.register_global_func(f"runtime.disco.{NUMPY_CCL}.{name}", f, override=True)
    tvm_ffi.register_global_func("mlc_lora.tp._numpy_ccl_id", lambda: id(current()), override=True)
    tvm_ffi.register_global_func(  # each worker thread of a new session finds its session's ccl
        "mlc_lora.tp._numpy_ccl_join",
        lambda key: _NUMPY_CCL.__setitem__(threading.get_ident(), _CCL_BY_ID[key]), override=True)


def numpy_ccl_of(sess) -> NumpyCCL:
    """The numpy collectives of a CPU session (tests count their calls)."""
    ref = sess.get_global_func("mlc_lora.tp._numpy_ccl_id")()
    sess._sync_worker(0)  # pylint: disable=protected-access
    return _CCL_BY_ID[int(ref.debug_get_from_remote(0))]


# ---------------------------------------------------------------------------------------------
# Worker-side functions (run on every disco worker: a thread here, or a GPU worker process).


def _worker_rank() -> int:
    return int(_tvm().get_global_func("runtime.disco.worker_rank")())


def _worker_load_params(model_dir: str):
    """This worker's shard of every parameter, on its device, in param_names order."""
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel

    from .models import llama_loader  # pylint: disable=import-outside-toplevel
    from .models.llama import LlamaConfig  # pylint: disable=import-outside-toplevel

    tvm = _tvm()
    config = json.loads((Path(model_dir) / CONFIG_FILE).read_text())
    cfg = LlamaConfig(**config["model_config"])
    device = tvm.get_global_func("runtime.disco.device")()
    shard = _worker_rank()
    out = []
    with safe_open(str(Path(model_dir) / config["params_file"]), framework="numpy") as st:
        for name in config["param_names"]:
            arr = llama_loader.shard_param(cfg, name, st.get_tensor(name), shard)
            out.append(tvm.runtime.tensor(np.ascontiguousarray(arr), device))
    return out


def _worker_load_adapter(kv, model_dir: str, folder: str, adapter_id: int, pin: bool) -> int:
    """Pack this worker's slices of a PEFT adapter and load them into its pool; returns pages."""
    from . import _ffi_api  # pylint: disable=import-outside-toplevel
    from .lora import pack_peft_adapter  # pylint: disable=import-outside-toplevel

    config = json.loads((Path(model_dir) / CONFIG_FILE).read_text())
    p = pack_peft_adapter(folder, config, name=str(adapter_id), shard=_worker_rank())
    _ffi_api.pool_load_adapter(kv, adapter_id, *p.ffi_args(), pin)
    return p.pages.shape[1]


def _worker_init(device: str) -> None:
    """Ready a GPU worker: TVM's CUDA runtime and the cuBLAS handle of its device."""
    if device == "cpu":
        return
    from . import runner  # pylint: disable=import-outside-toplevel

    runner.load_cuda_runtime()
    tvm = _tvm()
    dev = tvm.get_global_func("runtime.disco.device")()
    runner.load_cublas(dev)


def _register_worker_functions() -> None:
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    for name, f in {"load_params": _worker_load_params, "load_adapter": _worker_load_adapter,
                    "init_worker": _worker_init}.items():
        tvm_ffi.register_global_func(f"mlc_lora.tp.{name}", f, override=True)


def load_nccl() -> None:
    """Preload libnccl.so.2 from the nvidia-nccl-cu13 wheel when the loader cannot find it."""
    import ctypes  # pylint: disable=import-outside-toplevel

    try:
        ctypes.CDLL("libnccl.so.2", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    try:
        import nvidia  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise MLCLoraError("libnccl.so.2 not found: pip install 'mlc-lora[cuda]' (nvidia-nccl-cu13)") from e
    for root in nvidia.__path__:
        for sub in ("nccl", "cu13"):
            path = Path(root) / sub / "lib" / "libnccl.so.2"
            if path.is_file():
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                return
    raise MLCLoraError("libnccl.so.2 not found: pip install 'mlc-lora[cuda]' (nvidia-nccl-cu13)")


def make_session(num_shards: int, device: str = "cpu"):
    """A disco session of one worker per shard with its collectives ready.

    cpu: K threads of this process, numpy collectives. cuda: worker 0 a thread of this process and
    workers 1..K-1 processes (`python -m mlc_lora.tp_worker`), GPUs 0..K-1, NCCL (with
    NCCL_NVLS_ENABLE=0 in every environment)."""
    from . import _ffi_api  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    tvm = _tvm()
    disco = tvm.runtime.disco
    if device == "cpu":
        sess = disco.ThreadedSession(num_shards)
        import sys  # pylint: disable=import-outside-toplevel

        ffi_api = sys.modules["tvm.runtime.disco._ffi_api"]
        ffi_api.SessionInitCCL(sess, NUMPY_CCL, tvm.runtime.ShapeTuple(range(num_shards)))
        return sess
    if device != "cuda":
        raise MLCLoraError(f"tensor parallelism runs on 'cuda' (NCCL) or 'cpu' (reference), not {device!r}")
    set_nccl_env(overwrite=True)
    load_nccl()  # the controller makes the NCCL unique id
    sess = disco.ProcessSession(num_shards, entrypoint="mlc_lora.tp_worker")
    sess.init_ccl("nccl", *range(num_shards))
    return sess


# ---------------------------------------------------------------------------------------------
# The controller side.


class ShardedModelRunner:  # pylint: disable=too-many-instance-attributes
    """ModelRunner's interface over a disco session of one worker per tensor-parallel shard.

    Every call goes to all workers (in the same order); inputs are broadcast from worker 0 and the
    logits (replicated lm_head) are read back from worker 0. LoRA models take their tables from the
    pools (`lora="pool"`) or run a batch on the base model (`lora=None`)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", session=None):
        model_dir = Path(model_dir)
        self.config = read_compiled_config(model_dir, device)
        self.model_dir = model_dir
        self.model_config = self.config["model_config"]
        self.num_shards = _shards(self.config)
        tvm = _tvm()
        self.sess = session if session is not None else make_session(self.num_shards, device)
        if self.sess.num_workers != self.num_shards:
            raise MLCLoraError(f"{model_dir} was compiled for {self.num_shards} tensor-parallel "
                               f"shards; the session has {self.sess.num_workers} workers")
        g = self.sess.get_global_func
        g("mlc_lora.tp.init_worker")(device)
        self.mod = self.sess.load_vm_module(str(model_dir / self.config["library"]))
        self.params = g("mlc_lora.tp.load_params")(str(model_dir))
        self._embed, self._prefill, self._decode = self.mod["embed"], self.mod["prefill"], self.mod["decode"]
        self._view = g("runtime.TVMTensorCreateView")
        self._item = g("ffi.ArrayGetItem")
        self._kv_begin = g("vm.builtin.kv_state_begin_forward")
        self._kv_end = g("vm.builtin.kv_state_end_forward")
        self._funcs = {}
        self._base_lora = None
        self._vm0 = self._device0 = None
        self._shape = tvm.runtime.ShapeTuple

    @property
    def vm(self):
        """Worker 0's VM module (in this process): the engine's sampler runs its functions."""
        if self._vm0 is None:
            self._vm0 = self.worker_value(self.mod, 0)
        return self._vm0

    @property
    def device(self):
        if self._device0 is None:
            self._device0 = self.worker_value(self._f("runtime.disco.device")(), 0)
        return self._device0

    def pool(self, name: str):
        """`mlc_lora.runtime.<name>` on every shard's pool, in step; returns worker 0's result."""
        f = self._f(f"mlc_lora.runtime.{name}")
        return lambda kv, *args: self.worker_value(f(kv, *args), 0)

    def kv_available_pages(self, kv) -> int:
        return int(self.worker_value(self._f("vm.builtin.attention_kv_cache_get_num_available_pages")(kv), 0))

    def kv_seq_length(self, kv, seq_id: int) -> int:
        return int(self.worker_value(self._f("vm.builtin.attention_kv_cache_get_sequence_length")(kv, seq_id), 0))

    def _f(self, name: str):
        if name not in self._funcs:
            self._funcs[name] = self.sess.get_global_func(name)
        return self._funcs[name]

    @property
    def vocab_size(self) -> int:
        return self.model_config["vocab_size"]

    @property
    def dtype(self) -> str:
        return self.config["dtype"]

    @property
    def lora(self) -> dict | None:
        return self.config.get("lora")

    # --- the KV cache / unified pool of every worker ------------------------------------------

    def create_kv_cache(self, max_batch_size: int, max_total_seq_len: int,
                        prefill_chunk_size: int | None = None, page_size: int = PAGE_SIZE):
        s = self._shape
        chunk = prefill_chunk_size or self.model_config["prefill_chunk_size"]
        kv = self.mod["create_paged_kv_cache"](s([max_batch_size]), s([max_total_seq_len]), s([chunk]),
                                               s([page_size]), s([0]))
        if self.lora:
            self._f("mlc_lora.runtime.pool_configure_lora")(kv, len(self.lora["modules"]),
                                                            self.lora["max_rank"])
        return kv

    def kv_add(self, kv, seq_id: int) -> None:
        self._f("vm.builtin.kv_state_add_sequence")(kv, seq_id)

    def kv_remove(self, kv, seq_id: int) -> None:
        self._f("vm.builtin.kv_state_remove_sequence")(kv, seq_id)

    def kv_fork(self, kv, parent: int, child: int, fork_pos: int = -1) -> None:
        self._f("vm.builtin.kv_state_fork_sequence")(kv, parent, child, fork_pos)

    def kv_popn(self, kv, seq_id: int, n: int) -> None:
        self._f("vm.builtin.kv_state_popn")(kv, seq_id, n)

    def load_adapter(self, kv, adapter_id: int, folder: str | Path, pin: bool = False) -> None:
        """Every worker packs its slices of the PEFT adapter at `folder` into its pool. Checked here
        first (format, fit): an error thrown inside a disco worker cannot be reported cleanly."""
        from .errors import PoolExhaustedError  # pylint: disable=import-outside-toplevel
        from .lora import pack_peft_adapter  # pylint: disable=import-outside-toplevel

        need = pack_peft_adapter(folder, self.config).pages.shape[1]  # the same on every shard
        s = {k: int(v) for k, v in self.pool("pool_stats")(kv).items()}
        if need > s["free_pages"] + s["evictable_pages"]:
            raise PoolExhaustedError(f"adapter {adapter_id} needs {need} pages per shard; "
                                     f"{s['free_pages']} are free and {s['evictable_pages']} evictable")
        self._f("mlc_lora.tp.load_adapter")(kv, str(self.model_dir), str(folder), adapter_id, pin)
        self.sess.sync_worker_0()

    def pool_call(self, kv, name: str, *args) -> None:
        """`mlc_lora.runtime.<name>(kv, *args)` on every worker's pool (unload, pin, set adapter)."""
        self._f(f"mlc_lora.runtime.{name}")(kv, *args)

    def set_sequence_adapter(self, kv, seq_id: int, adapter_id: int | None) -> None:
        self.pool_call(kv, "pool_set_sequence_adapter", seq_id, -1 if adapter_id is None else adapter_id)

    def pool_stats(self, kv) -> list[dict]:
        """Every worker's pool_stats (a dict of ints per shard)."""
        ref = self._f("mlc_lora.runtime.pool_stats")(kv)
        self.sess._sync_all()  # pylint: disable=protected-access
        return [{k: int(v) for k, v in ref.debug_get_from_remote(w).items()}
                for w in range(self.num_shards)]

    def worker_value(self, ref, worker: int = 0):
        """The value of a DRef on one worker, once that worker has run everything sent so far."""
        self.sess._sync_worker(worker)  # pylint: disable=protected-access
        return ref.debug_get_from_remote(worker)

    # --- forward passes -----------------------------------------------------------------------

    def _broadcast(self, arr: np.ndarray):
        return self.sess.broadcast(np.ascontiguousarray(arr))

    def _embed_tokens(self, tokens: np.ndarray, shape: tuple[int, ...]):
        emb = self._embed(self._broadcast(tokens.astype(np.int32)), self.params)
        return self._view(emb, self._shape(shape), self.dtype, 0)

    def _lora_args(self, kv, lora, n_tok: int) -> list:
        if not self.lora:
            if lora is not None:
                raise MLCLoraError(f"{self.model_dir} was compiled without LoRA")
            return []
        if lora == "pool":
            tables = self._f("mlc_lora.runtime.pool_lora_tables")(kv)
            return [self._item(tables, i) for i in range(len(LORA_TABLE_INPUTS))]
        if lora is not None:
            raise MLCLoraError("a tensor-parallel model takes its LoRA tables from the pools: "
                               "pass lora='pool' (or None for the base model)")
        M, R = len(self.lora["modules"]), self.lora["max_rank"]
        if self._base_lora is None:
            L, E = self.lora["num_layers"], self.lora["page_elems"]  # one page: never read
            self._base_lora = [self.sess.empty((L * E,), self.dtype)] + [
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

    def _check_slots(self, kv) -> None:
        if self.lora and self.lora["kernel"] == "single":
            raise MLCLoraError("tensor parallelism needs --lora-kernel gather or sgmv")

    def prefill(self, kv, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]], lora=None):
        """One ragged prefill; returns the last-token logits (b, V) (a host tensor)."""
        lengths = [len(t) for t in tokens]
        if min(lengths) < 1:
            raise MLCLoraError("every sequence in a prefill needs at least one token")
        self._check_slots(kv)
        flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in tokens])
        emb = self._embed_tokens(flat, (1, len(flat), self.model_config["hidden_size"]))
        last = self._broadcast(np.cumsum(lengths).astype(np.int32) - 1)
        self._kv_begin(kv, self._shape(list(seq_ids)), self._shape(lengths))
        extra = self._lora_args(kv, lora, len(flat))
        out = self._prefill(emb, last, kv, *extra, self.params)
        self._kv_end(kv)
        return self._logits(out, len(lengths))

    def decode(self, kv, seq_ids: Sequence[int], tokens: Sequence[int], lora=None):
        """One decode step, one token per sequence; returns logits (b, V) (a host tensor)."""
        b = len(seq_ids)
        self._check_slots(kv)
        emb = self._embed_tokens(np.asarray(tokens, np.int32), (b, 1, self.model_config["hidden_size"]))
        self._kv_begin(kv, self._shape(list(seq_ids)), self._shape([1] * b))
        extra = self._lora_args(kv, lora, b)
        out = self._decode(emb, kv, *extra, self.params)
        self._kv_end(kv)
        return self._logits(out, b)


_register_numpy_ccl()
_register_worker_functions()
