"""Point the pool cache's prefill and decode attention at the tensor-core CUDA kernels
(ops/attention/attention_cuda.py), and its RoPE + append of the new keys and values at one Triton
kernel (ops/attention/rope_append_triton.py)."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import cuda_build
from ..ops.attention import attention_cuda, rope_append_triton
from .dispatch_kv_cache import POOL_CREATE

BACKEND = "mlc_lora"  # the kernel-tuple tag our cache reads: ("mlc_lora", wrapper)
PREFILL, DECODE = "mlc_lora_paged_prefill", "mlc_lora_paged_decode"
# Positions in the constructor's argument list (after the callee): TVM's kv_cache.py order.
_HQ, _HKV, _D, _ROPE_MODE, _EXT, _INIT, _PREFILL, _DECODE, _SPLIT_ROTARY = 2, 3, 4, 8, 11, 12, 16, 17, 24
ROPE_NORMAL = 1  # TVM's RoPEMode.NORMAL: q and k roped before attention (split_rotary)


def _int(e) -> int:
    return int(e.value)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, kernels, rope_append=None):
        super().__init__(mod)
        self.kernels = kernels  # (prefill gv, decode gv)
        self.rope_append = rope_append  # the RoPE + append gv, or None: split_rotary + append stay

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        if not _is_pool_create(call):
            return call
        args = list(call.args)
        for pos, gv in zip((_PREFILL, _DECODE), self.kernels):
            args[pos + 1] = tvm.ir.Tuple([tvm.ir.StringImm(BACKEND), gv])
        if self.rope_append is not None:
            args[_SPLIT_ROTARY + 1] = tvm.ir.Tuple([tvm.ir.StringImm(BACKEND), self.rope_append])
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)


def _is_pool_create(call: relax.Call) -> bool:
    return (call.op == tvm.ir.Op.get("relax.call_pure_packed") and bool(call.args)
            and isinstance(call.args[0], relax.ExternFunc)
            and call.args[0].global_symbol == POOL_CREATE)


def _find_create(mod: tvm.IRModule) -> list[relax.Call]:
    found = []

    @relax.expr_functor.visitor
    class _V(relax.PyExprVisitor):
        def visit_call_(self, op):  # pylint: disable=arguments-renamed
            if _is_pool_create(op):
                found.append(op)

    for _, f in mod.functions_items():
        if isinstance(f, relax.Function):
            _V().visit_expr(f)
    return found


def plain_rope(call: relax.Call) -> bool:
    """Whether a constructor call's cache ropes q and k before attention without extension
    factors (what rope_append_triton computes, given the model's frequencies are the default)."""
    args = call.args[1:]
    ext = args[_EXT]
    no_ext = not isinstance(ext.ty, relax.TensorType)  # (None where the model has no factors)
    return _int(args[_ROPE_MODE]) == ROPE_NORMAL and no_ext


def cache_shape(call: relax.Call, mod: tvm.IRModule) -> tuple[str, int, int, int]:
    """(dtype, head_dim, h_q, h_kv) from a constructor call's arguments."""
    args = call.args[1:]
    init = args[_INIT]
    dtype = str(init.ty.dtype)
    del mod
    return dtype, _int(args[_D]), _int(args[_HQ]), _int(args[_HKV])


@tvm.transform.module_pass(opt_level=0, name="DispatchAttention")
class DispatchAttention:  # pylint: disable=too-few-public-methods
    """Run the pool cache's paged prefill/decode attention on ops/attention/attention.cu (sm_80+,
    fp16/bf16) and, with `rope_append` (the model's RoPE frequencies are the default ones, a
    linear position scale at most: what the caller knows of the model), its RoPE + append on
    rope_append_triton's kernel where the cache ropes q and k without extension factors."""

    def __init__(self, arch: str, rope_append: bool = False):
        self.arch = arch
        self.rope_append = rope_append

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        calls = _find_create(mod)
        if not calls:
            return mod
        shape = cache_shape(calls[0], mod)
        if attention_cuda.supported(*shape) is not None:
            return mod  # TVM's TIR kernels stay
        prefill, decode, ext = attention_cuda.build(*shape, arch=self.arch)
        rewriter = _Rewriter(mod, [])

        def add(name, func):
            return rewriter.builder_.add_func(func.with_attrs({"global_symbol": name, "tirx.is_scheduled": True}),
                                              name)

        rewriter.kernels = [add(PREFILL, prefill), add(DECODE, decode)]
        dtype, d, hq, hkv = shape
        rope_ext = None
        if self.rope_append and plain_rope(calls[0]) and rope_append_triton.supported(dtype, d) is None:
            func, rope_ext = rope_append_triton.wrapper(hq, hkv, d, dtype, self.arch)
            rewriter.rope_append = add(rope_append_triton.NAME, func)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        out = cuda_build.attach(rewriter.builder_.get(), ext)
        return out if rope_ext is None else cuda_build.attach(out, rope_ext)
