"""Disco sessions of one worker per tensor-parallel shard, and their collectives (docs/TP.md).

The all-reduces of a sharded model are `runtime.disco.allreduce` calls, which disco sends to the
worker's collective library ("ccl"): NCCL on GPUs (src/runtime/nccl_ccl.cc, over a ProcessSession
of K worker processes started as `python -m mlc_lora.runner.worker`), or the numpy reference
below on CPU (a ThreadedSession of K threads in this process; what the CI tests run).
"""

from __future__ import annotations

import threading

import numpy as np

from ..contract import set_nccl_env
from ..errors import MLCLoraError
from .device import nvidia_lib_dirs

NUMPY_CCL = "mlc_lora_numpy"
WORKER_ENTRYPOINT = "mlc_lora.runner.worker"
# Every process that may start NCCL keeps NVLink multicast off (contract.NCCL_ENV).
set_nccl_env()

_DISCO_READY = False


def disco_tvm():
    """TVM with disco and the VM runtime imported."""
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


def worker_rank() -> int:
    """On a disco worker: its shard."""
    return int(disco_tvm().get_global_func("runtime.disco.worker_rank")())


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
        w = worker_rank()
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
        sess.call_packed(sess.get_global_func("mlc_lora.disco._numpy_ccl_join"), id(ccl))
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
    tvm_ffi.register_global_func("mlc_lora.disco._numpy_ccl_id", lambda: id(current()), override=True)
    tvm_ffi.register_global_func(  # each worker thread of a new session finds its session's ccl
        "mlc_lora.disco._numpy_ccl_join",
        lambda key: _NUMPY_CCL.__setitem__(threading.get_ident(), _CCL_BY_ID[key]), override=True)


def numpy_ccl_of(sess) -> NumpyCCL:
    """The numpy collectives of a CPU session (tests count their calls)."""
    ref = sess.get_global_func("mlc_lora.disco._numpy_ccl_id")()
    sess._sync_worker(0)  # pylint: disable=protected-access
    return _CCL_BY_ID[int(ref.debug_get_from_remote(0))]


def load_nccl() -> None:
    """Preload libnccl.so.2 from the nvidia-nccl-cu13 wheel when the loader cannot find it."""
    import ctypes  # pylint: disable=import-outside-toplevel

    try:
        ctypes.CDLL("libnccl.so.2", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    for path in nvidia_lib_dirs(("nccl", "cu13")):
        if (path / "libnccl.so.2").is_file():
            ctypes.CDLL(str(path / "libnccl.so.2"), mode=ctypes.RTLD_GLOBAL)
            return
    raise MLCLoraError("libnccl.so.2 not found: pip install nvidia-nccl-cu13 (of mlc-lora's cuda extra)")


def make_session(num_shards: int, device: str = "cpu"):
    """A disco session of one worker per shard with its collectives ready.

    cpu: K threads of this process, numpy collectives. cuda: worker 0 a thread of this process and
    workers 1..K-1 processes (`python -m mlc_lora.runner.worker`), GPUs 0..K-1, NCCL (with
    contract.NCCL_ENV in every environment)."""
    tvm = disco_tvm()
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
    sess = disco.ProcessSession(num_shards, entrypoint=WORKER_ENTRYPOINT)
    sess.init_ccl("nccl", *range(num_shards))
    return sess


_register_numpy_ccl()
