"""The CPU emulation of our CUDA kernels (cuda_emu/): a driver .cc compiled by g++ with the
kernel source included, run by the tests against the numpy references."""

import shutil
import subprocess
from pathlib import Path

import pytest

from mlc_lora.compiler_passes import cuda_source

EMU = Path(__file__).parent / "cuda_emu"
KERNELS = Path(cuda_source.__file__).parent / "cuda"


def build(driver: str, exe: Path, dtype: str, defines: dict) -> Path:
    """`exe` built from cuda_emu/`driver` for `dtype` (float16 / bfloat16) with `-D` defines, once;
    skips the test where g++ (with C++20 <barrier>) is missing."""
    if exe.exists():
        return exe
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    cmd = [cxx, "-std=c++20", "-O1", "-w", "-pthread", f"-I{EMU}", f"-I{KERNELS}", "-o", str(exe),
           str(EMU / driver), *(f"-D{k}={v}" for k, v in defines.items())]
    if dtype == "bfloat16":
        cmd.append("-DMLC_BF16")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"g++ cannot build the emulation (needs C++20 <barrier>): {proc.stderr[-500:]}")
    return exe
