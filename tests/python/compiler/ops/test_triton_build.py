"""Programmatic dependent launch of ops/' kernels (kernel_attrs.PDL): every kernel a library
launches, Triton (ops/triton_build.py) or CUDA C++ (ops/cuda_build.py), waits for its producers
first; with PDL on the launches take CUDA's programmatic stream serialization, and a Triton kernel
that would read its producers without waiting is refused it."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from mlc_lora.compiler_passes.ops import kernel_attrs, triton_build  # noqa: E402

OPS = Path(triton_build.__file__).parent
SOURCES = [OPS / "activation_triton.py", OPS / "norm_triton.py", OPS / "lora" / "linear_triton.py",
           OPS / "lora" / "sgmv_triton.py", OPS / "attention" / "rope_append_triton.py"]


def _launched_kernels(path: Path):
    """The @triton.jit(repr=...) functions of a file: the kernels the TIR wrappers launch."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and getattr(d.func, "attr", None) == "jit" and d.keywords
                for d in node.decorator_list):
            yield node


def test_every_launched_kernel_waits_for_its_producers_first():
    seen = []
    for path in SOURCES:
        for fn in _launched_kernels(path):
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                else fn.body
            first = ast.unparse(body[0])
            assert first == "triton_build.wait_for_producers()", (path.name, fn.name, first)
            seen.append(fn.name)
    assert {"lora_linear_kernel", "lora_shrink_xs_kernel", "rms_norm_kernel", "silu_mul_kernel",
            "lora_shrink_kernel", "lora_expand_kernel", "lora_tiles_kernel"} <= set(seen)


def test_every_cuda_kernel_waits_for_its_producers_first():
    """Each __global__ kernel of the .cu files starts with wait_for_producers() (dtype.cuh)."""
    kernels = 0
    for path in sorted(OPS.glob("*/*.cu")):
        for m in re.finditer(r"__global__[^{]*\{\s*(?:__shared__[^;]*;\s*)*([^;]*;)", path.read_text()):
            first = re.sub(r"[\s\\]+", " ", m.group(1)).strip()  # (a macro's lines end in backslashes)
            assert first == "wait_for_producers();", (path.name, first)
            kernels += 1
    assert kernels >= 5  # attention prefill and decode, gemv, the CUDA stage 3's shrink and expand


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _no_wait_kernel(x_ptr, y_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(y_ptr + i, tl.load(x_ptr + i) * 2)


def test_programmatic_launch_only_for_kernels_that_wait(cubin_cache, monkeypatch):
    """On (the default): the PDL tag before the dynamic shared memory tag (TVM wants that one last)
    for a library kernel, whose PTX has griddepcontrol.wait; a kernel without it is refused. Off, or
    built for a GPU before sm_90: the plain launch tags."""
    from mlc_lora.compiler_passes.ops.lora import sgmv_triton as ST

    plain = ["blockIdx.x", "blockIdx.y", "threadIdx.x", "tirx.use_dyn_shared_memory"]
    assert kernel_attrs.PDL is True
    name, _, _, mod, _ = ST.variant_kernel("shrink", "tiny", 4096, (0, 1, 2), None, 16, 7, "float16", 64, 8, "sm_90a")
    assert mod.get_function(name) is not None
    metas = [json.loads(f.read_text()) for f in cubin_cache.glob("*.json")]
    assert [m["waits"] for m in metas if m["name"] == name] == [True]
    assert triton_build.launch_tags(True, "sm_90a")[-2:] == [kernel_attrs.PDL_TAG, "tirx.use_dyn_shared_memory"]
    assert triton_build.launch_tags(False, "sm_80") == plain
    sig = {"x_ptr": "*fp16", "y_ptr": "*fp16", "N": "constexpr"}
    with pytest.raises(ValueError, match="must wait for its producers"):
        triton_build.cuda_module(_no_wait_kernel, sig, {"N": 64}, 4, "sm_90a", Path(__file__))
    monkeypatch.setattr(kernel_attrs, "PDL", False)
    assert triton_build.launch_tags(False, "sm_90a") == plain
    triton_build.cuda_module(_no_wait_kernel, sig, {"N": 64}, 4, "sm_90a", Path(__file__))  # the plain launch


def test_kernels_built_before_sm90_do_not_wait(cubin_cache):
    """griddepcontrol is sm_90's: for sm_80 the same kernel compiles without the wait (ptxas would
    refuse it) and is launched plainly; built for sm_90a again, it waits."""
    from mlc_lora.compiler_passes.ops.lora import sgmv_triton as ST

    for arch, waits in (("sm_80", False), ("sm_90a", True)):
        name, _, _, mod, _ = ST.variant_kernel("shrink", "tiny", 4096, (0, 1, 2), None, 16, 7, "float16", 64, 8, arch)
        assert mod.get_function(name) is not None
        metas = [json.loads(f.read_text()) for f in sorted(cubin_cache.glob("*.json"), key=lambda f: f.stat().st_mtime)]
        assert metas[-1]["name"] == name and metas[-1]["waits"] is waits, (arch, metas[-1])
    assert kernel_attrs.sm_version("sm_80") == 80 and kernel_attrs.pdl_tags("sm_80") == []
    assert kernel_attrs.pdl_tags("sm_100a") == [kernel_attrs.PDL_TAG]


def test_cuda_kernels_take_the_programmatic_launch_with_pdl(cubin_cache, monkeypatch):  # noqa: ARG001  (the build)
    """The CUDA C++ kernels' modules (gemv here): the PDL tag after the plain ones when on (for
    sm_90a; never for sm_80)."""
    from mlc_lora.compiler_passes.ops import cuda_build as CB
    from mlc_lora.compiler_passes.ops.gemv import gemv_cuda

    seen = []
    monkeypatch.setattr(CB.tvm, "get_global_func", lambda name, allow_missing=False: (
        (lambda meta: seen.append(json.loads(meta)) or meta) if name == "runtime.LoadMetaDataFromJSON"
        else (lambda *a: a)))
    for pdl, arch in ((False, "sm_90a"), (True, "sm_90a"), (True, "sm_80")):
        monkeypatch.setattr(kernel_attrs, "PDL", pdl)
        gemv_cuda.build_module("float16", arch)
        tags = {tuple(f["launch_param_tags"]) for f in seen[-1]["func_info"].values()}
        assert tags == {tuple(CB.LAUNCH_TAGS) + ((kernel_attrs.PDL_TAG,) if pdl and arch != "sm_80" else ())}
