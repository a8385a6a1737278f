"""src/runtime/nccl_ccl.cc through disco on CPU: a ThreadedSession initialised with ccl "nccl" over a
host-memory stand-in of libnccl.so.2 / libcudart.so.13 (nccl_stub.c, ranks = worker threads).
Checks the dlopen path, the unique-id hand-over, ranks and devices, and that disco's allreduce
(every ReduceKind, float32 and int32), broadcast_from_worker0 and allgather give numpy's results.
Runs in a subprocess: the stubs must be the first libnccl/libcudart the process loads."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ..conftest import needs_cxx

SCRIPT = textwrap.dedent("""
    import ctypes, os, sys
    import numpy as np
    cudart = ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    import tvm, tvm_ffi
    from mlc_lora import _ffi_api as rt
    from mlc_lora.runner.disco import disco_tvm
    disco_tvm()
    K = 2
    sess = tvm.runtime.disco.ThreadedSession(K)
    sess.init_ccl("nccl", 0, 1)
    data = {w: (np.arange(6, dtype=np.float32) + 1) * (w + 2) - 3 * w for w in range(K)}

    @tvm_ffi.register_global_func("test.fill_by_rank", override=True)
    def fill(t):
        w = int(tvm.get_global_func("runtime.disco.worker_rank")())
        t.copyfrom(data[w].astype(t.dtype))

    cpu = tvm.cpu()
    def per_worker(dtype):
        t = sess.empty((6,), dtype, device=cpu)
        sess.get_global_func("test.fill_by_rank")(t)
        return t
    def value(ref, w):
        sess._sync_worker(w)
        return ref.debug_get_from_remote(w).numpy()
    stack = np.stack([data[w] for w in range(K)]).astype(np.float64)
    want = {"sum": stack.sum(0), "prod": stack.prod(0), "min": stack.min(0), "max": stack.max(0),
            "avg": stack.mean(0)}
    for dtype in ("float32", "int32"):
        for op, ref in want.items():
            if dtype == "int32" and op == "avg":
                continue
            src, dst = per_worker(dtype), sess.empty((6,), dtype, device=cpu)
            sess.allreduce(src, dst, op)
            for w in range(K):
                np.testing.assert_allclose(value(dst, w), ref.astype(dtype), rtol=1e-6, err_msg=f"{op} {dtype}")
    src, dst = per_worker("float32"), sess.empty((6,), "float32", device=cpu)
    sess.broadcast_from_worker0(src, dst)
    for w in range(K):
        np.testing.assert_array_equal(value(dst, w), data[0])
    src, dst = per_worker("float32"), sess.empty((12,), "float32", device=cpu)
    sess.allgather(src, dst)
    for w in range(K):
        np.testing.assert_array_equal(value(dst, w), np.concatenate([data[0], data[1]]))
    ranks = (ctypes.c_int * 64).in_dll(ctypes.CDLL(sys.argv[1]), "stub_init_ranks")
    assert list(ranks[:K]) == [K, K], list(ranks[:K])
    devs = (ctypes.c_int * 64).in_dll(cudart, "stub_devices")
    n = ctypes.c_int.in_dll(cudart, "stub_num_devices").value
    assert sorted(devs[:n]) == [0, 1], list(devs[:n])
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    assert libc.getenv(b"NCCL_NVLS_ENABLE") == b"0"
    assert rt.nccl_version() == 23206
    sess.shutdown()
    print("nccl ccl ok")
""")


def _build(src: Path, out: Path, soname: str, *flags):
    """The stub as a shared library (C, built by the C++ compiler's driver)."""
    subprocess.run([os.environ.get("CXX", "g++"), "-x", "c", "-shared", "-fPIC", "-O1", *flags,
                    f"-Wl,-soname,{soname}", "-o", str(out), str(src), "-lpthread"], check=True, capture_output=True)


@needs_cxx
def test_disco_collectives_over_the_nccl_ccl(tmp_path):
    src = Path(__file__).with_name("nccl_stub.c")
    nccl, cudart = tmp_path / "libnccl.so.2", tmp_path / "libcudart.so.13"
    _build(src, nccl, "libnccl.so.2")
    _build(src, cudart, "libcudart.so.13", "-DCUDART")
    env = {k: v for k, v in os.environ.items() if k != "NCCL_NVLS_ENABLE"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(nccl), str(cudart)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0 and "nccl ccl ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


WORKER_SCRIPT = textwrap.dedent("""
    import os
    from mlc_lora.runner.disco import WORKER_ENTRYPOINT, disco_tvm
    from mlc_lora.runner.sharded import INIT_WORKER
    tvm = disco_tvm()
    assert WORKER_ENTRYPOINT == "mlc_lora.runner.worker"
    sess = tvm.runtime.disco.ProcessSession(2, entrypoint=WORKER_ENTRYPOINT)
    rank = sess.get_global_func("runtime.disco.worker_rank")()
    sess.get_global_func(INIT_WORKER)("cpu")          # registered by mlc_lora.runner.sharded
    ccl = sess.get_global_func("runtime.disco.nccl.allreduce")        # registered by the runtime lib
    sess._sync_worker(1)
    assert int(rank.debug_get_from_remote(1)) == 1
    sess.shutdown()
    print("worker ok")
""")


def test_gpu_worker_entrypoint_starts_and_registers_our_functions():
    """`python -m mlc_lora.runner.worker` (the GPU worker processes) starts as a disco worker on a CPU
    machine and has the mlc_lora.sharded.* and runtime.disco.nccl.* functions (no NCCL needed for that)."""
    r = subprocess.run([sys.executable, "-c", WORKER_SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "worker ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
