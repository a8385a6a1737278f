"""Run the gated MLP's `silu(gate) * up` on ops/activation_triton.py's kernel (CUDA, fp16/bf16)."""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import activation_triton
from .kernel_calls import Wrappers, rewrite_functions

_MULTIPLY = tvm.ir.Op.get("relax.multiply")
_SILU = tvm.ir.Op.get("relax.nn.silu")
_SPLIT = tvm.ir.Op.get("relax.split")


def gate_up_of(call: relax.Call, lookup: Callable[[relax.Var], relax.Expr | None]) -> relax.Expr | None:
    """y if `call` is silu(gate) * up with gate, up = split(y, 2, axis=-1), else None. `lookup`:
    the mutator's lookup_binding."""

    def bound(e, op=None):
        b = lookup(e) if isinstance(e, relax.Var) else None
        return b if op is None or (isinstance(b, relax.Call) and b.op == op) else None

    if call.op != _MULTIPLY:
        return None
    silu = bound(call.args[0], _SILU)
    gate = bound(silu.args[0]) if silu is not None else None
    up = bound(call.args[1])
    if not (isinstance(gate, relax.TupleGetItem) and isinstance(up, relax.TupleGetItem) and gate.index == 0
            and up.index == 1 and gate.tuple_value.same_as(up.tuple_value)):
        return None
    split = bound(gate.tuple_value, _SPLIT)
    if split is None:
        return None
    y, axis = split.args[0], int(split.attrs.axis)
    if _static(split.attrs.indices_or_sections) != 2 or axis not in (-1, y.ty.ndim - 1):
        return None
    return y


def _static(e) -> int | None:
    """The value of an integer constant (IntImm), else None."""
    return int(e.value) if isinstance(getattr(e, "value", None), int) else None


@tvm.transform.module_pass(opt_level=0, name="DispatchActivation")
class DispatchActivation:  # pylint: disable=too-few-public-methods
    """Rewrite silu(gate) * up over split(y, 2) into one call of activation_triton's kernel where
    it supports the dtype and size (the split, silu and multiply left unused go)."""

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
        y = gate_up_of(call, self.lookup_binding)
        if y is None or not isinstance(y.ty, relax.TensorType) or y.ty.shape is None:
            return call
        width, dtype = _static(y.ty.shape.values[-1]), str(y.ty.dtype)
        if width is None or activation_triton.supported(dtype, width // 2):
            return call
        inter = width // 2
        gv = self.wrappers.get((inter, dtype), f"silu_mul_triton_{inter}_{dtype}",
                               lambda: activation_triton.wrapper(inter, dtype, self.arch))
        y2 = self.builder_.emit(relax.op.reshape(y, [-1, width]))  # (rows, 2I): rows inferred
        rows = y2.ty.shape.values[0]
        h = self.builder_.emit(relax.call_tir(gv, [y2], relax.TensorType([rows, inter], dtype)))
        return relax.op.reshape(h, call.ty.shape)
