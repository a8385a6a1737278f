"""Every benchmark script starts as `python scripts/x.py --help` (imports its harness, parses its
arguments) with no GPU, and the compile side's single import site of the compiler loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_script_help(script):
    r = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def test_the_compiler_import_site():
    from harness import compiler

    assert compiler.ARCH == "sm_90a" and compiler.target("llvm").kind.name == "llvm"
    for mod in ("attention_cuda", "gemv_cuda", "gather_tir", "sgmv_tir", "sgmv_cuda", "sgmv_triton"):
        assert getattr(compiler, mod).__name__.endswith(mod)
    with pytest.raises(ValueError, match="unknown target"):
        compiler.target("rocm")
