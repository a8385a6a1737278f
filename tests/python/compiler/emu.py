"""The CPU emulation of our CUDA kernels (cuda_emu/): a driver .cc compiled by g++ with the
kernel source included, run by the tests against the numpy references. Tests that use it carry
the shared `needs_cxx` mark (tests/python/conftest.py)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mlc_lora.compiler_passes.ops import cuda_build

EMU = Path(__file__).parent / "cuda_emu"


def build(driver: str, exe: Path, source: Path, dtype: str, defines: dict) -> Path:
    """`exe` built from cuda_emu/`driver`, which includes the kernel `source` (a .cu of
    compiler_passes/ops/), for `dtype` (float16 / bfloat16) with `-D` defines, once. Skips where
    g++ lacks C++20 <barrier>; any other build error fails the test."""
    if exe.exists():
        return exe
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    cmd = [cxx, "-std=c++20", "-O1", "-w", "-pthread", f"-I{EMU}", f"-I{source.parent}", f"-I{cuda_build.INCLUDE}",
           "-o", str(exe), str(EMU / driver), *(f"-D{k}={v}" for k, v in defines.items())]
    if dtype == "bfloat16":
        cmd.append("-DMLC_BF16")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        if "barrier" in proc.stderr:  # an older g++ without C++20 <barrier>
            pytest.skip(f"g++ cannot build the emulation (needs C++20 <barrier>): {proc.stderr[-500:]}")
        raise AssertionError(f"building {driver} with {source.name} failed:\n{proc.stderr[-4000:]}")
    return exe
