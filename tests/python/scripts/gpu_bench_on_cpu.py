"""Runs scripts/bench_lora_fused.py on the CPU: its kernels under Triton's interpreter (the CPU
emulation of the kernels), torch on the CPU in place of "cuda", each candidate run once instead of
timed, and the linears shrunk to a few hundred inputs. Every candidate's output still goes through
the benchmark's own delta checks against float64, so a benchmark that launches a kernel with the
wrong arguments, or checks the wrong buffer, fails here rather than on the GPU.

  TRITON_INTERPRET=1 python -m tests.python.scripts.gpu_bench_on_cpu producers --tokens 70 ...
(TRITON_INTERPRET must be set before triton is imported: test_bench_lora_fused.py runs it in a
process of its own.)"""

import contextlib
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[3]
SHAPES = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)), "gate_up": (576, (1024, 1024)), "down": (1024, (576,))}


class _OnCpu(TorchFunctionMode):
    """torch factory calls and .to() given device "cuda" run on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        args = tuple("cpu" if isinstance(a, str) and a.startswith("cuda") else a for a in args)
        return func(*args, **kwargs)


class _Stream:
    def wait_stream(self, other):
        pass


def main(argv) -> int:
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "python" / "compiler" / "ops" / "lora")]
    import triton_interp  # pylint: disable=import-outside-toplevel

    triton_interp._interpreter_scalars()  # pylint: disable=protected-access
    generator = torch.Generator
    torch.Generator = lambda device=None: generator()
    torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.Stream = torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    import bench_lora_fused as bench  # pylint: disable=import-outside-toplevel

    bench.LINEARS.update(SHAPES)
    bench.copies_for = lambda nbytes, min_copies=2, max_copies=64: 2
    bench.compare = lambda cands: {k: (fn(0), 1.0)[1] for k, (fn, _n) in cands.items()}
    with _OnCpu():
        return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
