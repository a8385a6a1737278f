"""DispatchAttention (compiler_passes/passes/dispatch_attention.py) as Before/After on a cuda export
(nvcc builds the real cubin of ops/attention/attention.cu): the pool cache's constructor gets the
mlc_lora prefill/decode kernels where they fit the model, TVM's TIR kernels stay elsewhere; with
rope_append, its split-rotary argument becomes ["mlc_lora", the RoPE + append kernel's wrapper]."""

import pytest
import tvm
import tvm_ffi
from tvm import relax

from mlc_lora.compile import CompileOptions, export_model, make_target
from mlc_lora.compiler_passes.ops.attention import rope_append_triton
from mlc_lora.compiler_passes.passes.dispatch_attention import BACKEND, DECODE, PREFILL, DispatchAttention
from mlc_lora.compiler_passes.passes.dispatch_kv_cache import POOL_CREATE, STOCK_CREATE, DispatchKVCache
from mlc_lora.models import llama

from ...conftest import needs_nvcc

pytestmark = needs_nvcc

# head_dim 64: a shape the CUDA kernels are built for (the shared tiny configs use 16)
D64 = dict(hidden_size=128, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
           num_hidden_layers=1, vocab_size=64)


def _create_args(mod):
    found = []

    @relax.expr_functor.visitor
    class _V(relax.PyExprVisitor):
        def visit_call_(self, op):  # pylint: disable=arguments-renamed
            if op.args and isinstance(op.args[0], relax.ExternFunc) and \
                    op.args[0].global_symbol in (POOL_CREATE, STOCK_CREATE):
                found.append(list(op.args[1:]))

    for _, f in mod.functions_items():
        if isinstance(f, relax.Function):
            _V().visit_expr(f)
    assert len(found) == 1
    return found[0]


@pytest.fixture(scope="module")
def cuda_export():
    from mlc_lora.compile import prepare_cuda_build

    prepare_cuda_build()
    target = make_target(CompileOptions(target="cuda"))

    def export(dtype, **cfg):
        mod, _ = export_model(llama, llama.LlamaConfig(**cfg), dtype, target)
        return DispatchKVCache()(mod)

    return export


def test_pass_swaps_the_prefill_and_decode_kernels(cuda_export):
    before = cuda_export("float16", **D64)
    after = DispatchAttention("sm_90a")(before)
    a, b = _create_args(before), _create_args(after)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if i in (16, 17):
            assert [str(x.fields[0].value), x.fields[1].name_hint] == \
                ["tirx", "batch_prefill_paged_kv" if i == 16 else "batch_decode_paged_kv"]
            assert str(y.fields[0].value) == BACKEND
            assert y.fields[1].name_hint == (PREFILL if i == 16 else DECODE)
        else:
            assert tvm_ffi.structural_equal(x, y), i
    for name in (PREFILL, DECODE):
        f = after[name]
        assert isinstance(f, tvm.tirx.PrimFunc) and f.attrs["tirx.is_scheduled"]
    ext = list(after.attrs["external_mods"])
    assert len(ext) == 1
    for k in ("mlc_lora_attn_prefill", "mlc_lora_attn_decode"):
        assert ext[0].implements_function(k)
    relax.analysis.well_formed(after)


@pytest.mark.parametrize("dtype,cfg", [
    ("float32", D64),  # the kernels are fp16/bf16
    ("float16", dict(D64, num_attention_heads=8, num_key_value_heads=2)),  # head_dim 16
])
def test_pass_leaves_other_models_on_tir_kernels(cuda_export, dtype, cfg):
    before = cuda_export(dtype, **cfg)
    assert tvm_ffi.structural_equal(DispatchAttention("sm_90a")(before), before)


def test_rope_append_takes_the_split_rotary_argument(cuda_export):
    """With rope_append: argument 24 (split_rotary) is ["mlc_lora", the wrapper], whose kernel is in
    a second external module; the transpose-append function stays (the cache no longer calls it)."""
    pytest.importorskip("triton")
    before = cuda_export("float16", **D64)
    after = DispatchAttention("sm_90a", rope_append=True)(before)
    a, b = _create_args(before), _create_args(after)
    for i, (x, y) in enumerate(zip(a, b)):
        if i == 24:
            assert isinstance(x, relax.GlobalVar)
            assert str(y.fields[0].value) == BACKEND and y.fields[1].name_hint == rope_append_triton.NAME
        elif i not in (16, 17):
            assert tvm_ffi.structural_equal(x, y), i
    f = after[rope_append_triton.NAME]
    assert isinstance(f, tvm.tirx.PrimFunc) and [p.name for p in f.params][-2:] == ["rope_scale", "rope_theta"]
    kernel = next(w for w in f.script().split('"') if w.startswith("mlc_lora_triton_rope_append"))
    ext = list(after.attrs["external_mods"])
    assert len(ext) == 2 and any(m.implements_function(kernel) for m in ext)
    relax.analysis.well_formed(after)
    # off by default (the caller knows whether the model's RoPE frequencies are the default ones)
    assert tvm_ffi.structural_equal(_create_args(DispatchAttention("sm_90a")(before))[24], a[24])

