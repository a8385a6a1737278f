"""Run each RMSNorm over the hidden state, and the residual add that makes its input, on
ops/norm_triton.py's kernel (CUDA, fp16/bf16)."""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import norm_triton
from .kernel_calls import Wrappers, rewrite_functions

_ADD = tvm.ir.Op.get("relax.add")
_RMS_NORM = tvm.ir.Op.get("relax.nn.rms_norm")


def norm_of(call: relax.Call) -> tuple[relax.Expr, relax.Expr, float] | None:
    """(h, g, eps) if `call` is an RMSNorm over h's last axis with a gain of h's dtype and a static
    row length, else None."""
    if not isinstance(call, relax.Call) or call.op != _RMS_NORM:
        return None
    h, g = call.args
    if not isinstance(h.ty, relax.TensorType) or h.ty.shape is None or not isinstance(g.ty, relax.TensorType):
        return None
    ndim = h.ty.ndim
    k = h.ty.shape.values[-1]
    if [int(a) % ndim for a in call.attrs.axes] != [ndim - 1] or str(h.ty.dtype) != str(g.ty.dtype) \
            or not isinstance(k, tvm.tirx.IntImm):
        return None
    return h, g, float(call.attrs.epsilon)


def residual_of(h: relax.Expr, lookup: Callable[[relax.Var], relax.Expr | None],
                in_dataflow: bool) -> tuple[relax.Expr, relax.Expr] | None:
    """(a, b) if h is a Var bound to add(a, b) of two tensors of h's own shape and dtype (no
    broadcast), which the fused kernel can compute and hand on in h's place, else None. Inside a
    dataflow block (`in_dataflow`) h must be local to it (a DataflowVar): its later uses are moved
    to the kernel's output, a variable of the block."""
    if not isinstance(h, relax.Var) or (in_dataflow and not isinstance(h, relax.DataflowVar)):
        return None
    add = lookup(h)
    if not (isinstance(add, relax.Call) and add.op == _ADD):
        return None
    a, b = add.args
    dims, prove = h.ty.shape.values, tvm.sym.Analyzer().can_prove_equal
    for t in (a.ty, b.ty):
        if not isinstance(t, relax.TensorType) or t.shape is None or str(t.dtype) != str(h.ty.dtype) \
                or len(t.shape.values) != len(dims) or not all(prove(u, v) for u, v in zip(t.shape.values, dims)):
            return None
    return a, b


@tvm.transform.module_pass(opt_level=0, name="DispatchNorm")
class DispatchNorm:  # pylint: disable=too-few-public-methods
    """Rewrite rms_norm(h, g) over the last axis into one call of norm_triton's kernel where it
    supports the dtype and row length; where h = a + b (the residual stream), the kernel adds them
    too and hands on the sum (h's later uses read it; the add left unused goes)."""

    def __init__(self, arch: str):
        self.arch = arch

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod, self.arch)
        return rewrite_functions(mod, rewriter, rewriter.wrappers)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, arch: str):
        super().__init__(mod)
        self.arch = arch
        self.wrappers = Wrappers(self.builder_)

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        norm = norm_of(call)
        if norm is None:
            return call
        h, g, eps = norm
        k, dtype = int(h.ty.shape.values[-1]), str(h.ty.dtype)
        if norm_triton.supported(dtype, k):
            return call
        bb = self.builder_
        res = residual_of(h, self.lookup_binding, bb.current_block_is_dataflow())
        gv = self.wrappers.get((k, dtype, eps, res is not None), f"{'add_' if res else ''}rms_norm_triton_{k}_{dtype}",
                               lambda: norm_triton.wrapper(k, dtype, eps, self.arch, residual=res is not None))
        rows = lambda e: bb.emit(relax.op.reshape(e, [-1, k]))  # noqa: E731  (rows inferred)
        if res is None:
            h2 = rows(h)
            x = bb.emit(relax.call_tir(gv, [h2, g], relax.TensorType(h2.ty.shape, dtype)))
            return relax.op.reshape(x, call.ty.shape)
        a2, b2 = rows(res[0]), rows(res[1])
        out = bb.emit(relax.call_tir(gv, [a2, b2, g], [relax.TensorType(a2.ty.shape, dtype)] * 2))
        h1 = bb.emit(relax.op.reshape(relax.TupleGetItem(out, 0), h.ty.shape))
        self.set_var_remap(h, h1)  # h's later uses (the next residual add) read the kernel's sum
        return relax.op.reshape(relax.TupleGetItem(out, 1), call.ty.shape)
