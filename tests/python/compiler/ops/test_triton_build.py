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


def _pointer_args(fn: ast.FunctionDef) -> set[str]:
    return {a.arg for a in fn.args.args if a.arg.endswith("_ptr")}


def test_every_launched_kernel_waits_before_it_reads_its_producers():
    """Each kernel calls wait_for_producers() once, at the top of its body; what comes before it
    reads only the arguments the host writes (triton_build.HOST_WRITTEN: the LoRA tables and adapter
    rows) and stores nothing."""
    seen, early = [], {}
    for path in SOURCES:
        for fn in _launched_kernels(path):
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                else fn.body
            waits = [i for i, st in enumerate(body) if ast.unparse(st) == "triton_build.wait_for_producers()"]
            assert len(waits) == 1, (path.name, fn.name, "no wait at the top of the body" if not waits else waits)
            before = body[:waits[0]]
            names = {n.id for st in before for n in ast.walk(st) if isinstance(n, ast.Name)}
            assert names & _pointer_args(fn) <= set(triton_build.HOST_WRITTEN), (fn.name, names & _pointer_args(fn))
            calls = {ast.unparse(n.func) for st in before for n in ast.walk(st) if isinstance(n, ast.Call)}
            assert not {c for c in calls if "store" in c or "atomic" in c}, (fn.name, calls)
            seen.append(fn.name)
            early[fn.name] = len(before)
    assert {"lora_linear_kernel", "lora_shrink_xs_kernel", "rms_norm_kernel", "silu_mul_kernel",
            "lora_shrink_kernel", "lora_expand_kernel", "lora_tiles_kernel"} <= set(seen)
    # the rank columns route's kernels read their tables before the wait
    assert all(early[k] > 0 for k in ("lora_linear_kernel", "lora_shrink_xs_kernel", "lora_shrink_cols_kernel",
                                      "lora_expand_cols_kernel")), early


def test_tables_are_loaded_before_the_wait_in_the_ptx(cubin_cache):  # noqa: ARG001
    """Built for sm_90a, the shrink into [x | s] issues its table loads before griddepcontrol.wait
    (the compiler keeps the order) and x's loads after it; x's producers let the next kernel start
    (griddepcontrol.launch_dependents) after their loads; for sm_80 neither instruction is built."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mlc_lora.compiler_passes.ops import norm_triton as NORM
    from mlc_lora.compiler_passes.ops.lora import linear_triton as LT

    go = LT.xs_launch(256, 4096, [4096] * 3, [0, 1, 2], 7, 64, 8)
    _, sig = LT._cols_route_signatures("float16")  # pylint: disable=protected-access

    def ptx(fn, sig, consts, cap):
        triton_build._HAS_WAIT = tl.constexpr(cap >= kernel_attrs.PDL_MIN_SM)  # as compile_kernel sets it
        attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k].startswith("*")}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compiler.compile(src, target=GPUTarget("cuda", cap, 32), options=dict(num_warps=4)).asm["ptx"]

    lines = [ln.strip() for ln in ptx(LT.lora_shrink_xs_kernel, sig, go["shrink"], 90).splitlines()]
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    assert sum("ld.global" in ln for ln in lines[:wait]) >= 3  # rank, scale, A row offsets, slots
    assert any("cp.async" in ln or "ld.global" in ln for ln in lines[wait:])  # x
    norm = ptx(NORM.rms_norm_kernel, NORM._signature("float16"), NORM.launch(4096)["consts"], 90)  # pylint: disable=protected-access
    assert norm.index("griddepcontrol.wait") < norm.index("griddepcontrol.launch_dependents") < norm.index("st.global")
    assert "griddepcontrol" not in ptx(NORM.rms_norm_kernel, NORM._signature("float16"),  # pylint: disable=protected-access
                                       NORM.launch(4096)["consts"], 80)
    triton_build._HAS_WAIT = tl.constexpr(True)


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
