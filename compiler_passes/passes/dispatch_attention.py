"""Point the pool cache's prefill and decode attention at the tensor-core CUDA kernels
(ops/attention/attention_cuda.py)."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import cuda_build
from ..ops.attention import attention_cuda
from .dispatch_kv_cache import POOL_CREATE

BACKEND = "mlc_lora"  # the kernel-tuple tag our cache reads: ("mlc_lora", wrapper)
PREFILL, DECODE = "mlc_lora_paged_prefill", "mlc_lora_paged_decode"
# Positions in the constructor's argument list (after the callee): TVM's kv_cache.py order.
_HQ, _HKV, _D, _INIT, _PREFILL, _DECODE = 2, 3, 4, 12, 16, 17


def _int(e) -> int:
    return int(e.value)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, kernels):
        super().__init__(mod)
        self.kernels = kernels  # (prefill gv, decode gv)

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        if not _is_pool_create(call):
            return call
        args = list(call.args)
        for pos, gv in zip((_PREFILL, _DECODE), self.kernels):
            args[pos + 1] = tvm.ir.Tuple([tvm.ir.StringImm(BACKEND), gv])
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
    fp16/bf16)."""

    def __init__(self, arch: str):
        self.arch = arch

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        calls = _find_create(mod)
        if not calls:
            return mod
        shape = cache_shape(calls[0], mod)
        if attention_cuda.supported(*shape) is not None:
            return mod  # TVM's TIR kernels stay
        prefill, decode, ext = attention_cuda.build(*shape, arch=self.arch)
        rewriter = _Rewriter(mod, [])
        rewriter.kernels = [rewriter.builder_.add_func(
            func.with_attrs({"global_symbol": name, "tirx.is_scheduled": True}), name)
                            for name, func in ((PREFILL, prefill), (DECODE, decode))]
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return cuda_build.attach(rewriter.builder_.get(), ext)
