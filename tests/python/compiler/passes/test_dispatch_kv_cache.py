"""DispatchKVCache: the model's cache constructor points at mlc-lora's pool, on llvm and cuda."""

import os

import pytest
import tvm_ffi
from tvm import relax

from mlc_lora.compile import CompileOptions, export_model, make_target
from mlc_lora.compiler_passes.passes.dispatch_kv_cache import POOL_CREATE, STOCK_CREATE, DispatchKVCache
from mlc_lora.models import llama

from ...conftest import TINY_CONFIGS, needs_nvcc


def _extern_symbols(mod):
    found = []

    @relax.expr_functor.visitor
    class _V(relax.PyExprVisitor):
        def visit_extern_func_(self, op):
            found.append(str(op.global_symbol))

    for _, f in mod.functions_items():
        if isinstance(f, relax.Function):
            _V().visit_expr(f)
    return found


def test_constructor_is_rewritten_and_nothing_else():
    """On the cuda export (the llvm one is exercised by every model test)."""
    cfg = llama.LlamaConfig(**TINY_CONFIGS["gqa"])
    target = make_target(CompileOptions(target="cuda"))
    mod, _ = export_model(llama, cfg, "float32", target)
    before = _extern_symbols(mod)
    assert STOCK_CREATE in before
    after_mod = DispatchKVCache()(mod)
    after = _extern_symbols(after_mod)
    assert STOCK_CREATE not in after and after.count(POOL_CREATE) == before.count(STOCK_CREATE)
    assert sorted(s for s in before if s != STOCK_CREATE) == sorted(s for s in after if s != POOL_CREATE)
    # The arguments (kernels, sizes) are untouched; running the pass again changes nothing.
    assert tvm_ffi.structural_equal(DispatchKVCache()(after_mod), after_mod)
    relax.analysis.well_formed(after_mod)


@needs_nvcc
@pytest.mark.skipif(not os.environ.get("MLC_LORA_TEST_CUDA_BUILD"),
                    reason="a cubin build takes minutes on CPU; set MLC_LORA_TEST_CUDA_BUILD=1")
def test_cuda_library_builds_with_the_pool(tmp_path):
    """The GPU build (cubin) of a tiny model calls our constructor; nothing is CUDA-specific in it."""
    from mlc_lora.compile import build_library

    cfg = llama.LlamaConfig(**TINY_CONFIGS["gqa"])
    lib = tmp_path / "lib.cuda.so"
    build_library(llama, cfg, "float16", CompileOptions(target="cuda"), lib)
    data = lib.read_bytes()
    assert POOL_CREATE.encode() in data and STOCK_CREATE.encode() not in data
