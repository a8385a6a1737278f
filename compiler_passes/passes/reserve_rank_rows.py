"""Reserve rows below each LoRA-targeted weight for the batch's A rows (the rank rows route).

Past FUSED_MAX_TOKENS the _fused functions' linears can let cuBLAS compute the LoRA shrink with the
base product: with the batch's A rows stored right below W (same row length, same stride), one GEMM
over [W; A rows] gives x @ W.T and x @ A.T together, and only a small expand is left
(ops/lora/linear_triton.py, `rows`). That needs the weight's buffer to have the rows: this pass
makes every such packed param (W + rank_rows(P), K) in every function, and every existing use of it
a view of its first W rows (R.memory.view: no copy, the base functions' GEMMs unchanged).
LoraRewrite then gives the fused linears the whole buffer. The compile writes the reserved rows as
zeros (`extra_rows` says which weights and how many); the fused linears refill them per call.
"""

from __future__ import annotations

from typing import Sequence

import tvm
from tvm import relax

from ..ops.lora.linear_triton import rank_rows, spare_columns
from .lora_rewrite import linear_weight_re


def extra_rows(name: str, modules: Sequence[tuple[str, int, int]],
               linears: dict[str, Sequence[tuple[str, int, int]]], axis: int = 0) -> int:
    """Rows reserved below (axis 0: rank_rows(P)) or columns beside (axis 1: spare_columns(in, P)) the
    param `name` for the weight of a fused linear of P parts with at least one part among the LoRA
    `modules` ((name, in, out): `in` is the linear's input width), else 0."""
    m = linear_weight_re(linears).search(name)
    if m is None:
        return 0
    parts = linears[m.group(2)]
    ins = [mod[1] for mod in modules if mod[0] in {p[0] for p in parts}]
    if not ins:
        return 0
    return rank_rows(len(parts)) if axis == 0 else spare_columns(ins[0], len(parts))


@tvm.transform.module_pass(opt_level=0, name="ReserveRankRows")
class ReserveRankRows:  # pylint: disable=too-few-public-methods
    """Widen the LoRA-targeted weights by their rank rows; their uses read views of the first rows.
    `param_names`, `modules` (name, in, out) and `linears` as LoraRewrite takes them."""

    def __init__(self, *, param_names: Sequence[str], modules: Sequence[tuple[str, int, int]],
                 linears: dict[str, Sequence[tuple[str, int, int]]]):
        self.rows = {i: r for i, p in enumerate(param_names) if (r := extra_rows(p, modules, linears))}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not self.rows:
            raise ValueError("ReserveRankRows found no LoRA-targeted weight among the params")
        return widen_weights(mod, self.rows, axis=0)


def widen_weights(mod: tvm.IRModule, extra: dict[int, int], axis: int) -> tvm.IRModule:
    """Every function's packed param i of `extra` widened by extra[i] rows (axis 0, below its own)
    or columns (axis 1, beside them); each use reads the weight's own part: a view of its first
    rows, or a strided_slice of its first columns (which DispatchCublas and LoraRewrite take as
    the whole weight read with its row stride: dispatch_cublas.reserved_weight_of)."""
    rewriter = _Rewriter(mod, extra, axis)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and _packed_param(func) is not None:
            rewriter.builder_.update_func(gv, rewriter.widen(func))
    return rewriter.builder_.get()


def _packed_param(func: relax.Function) -> relax.Var | None:
    """The function's packed weights (its params past `num_input`, a tuple), or None."""
    n = func.attrs.get("num_input") if func.attrs is not None else None
    if n is None or int(n) != len(func.params) - 1 or not isinstance(func.params[-1].ty, relax.TupleType):
        return None
    return func.params[-1]


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, extra: dict[int, int], axis: int):
        super().__init__(mod)
        self.extra, self.axis = extra, axis
        self.old: relax.Var | None = None
        self.new: relax.Var | None = None

    def widen(self, func: relax.Function) -> relax.Function:
        old = _packed_param(func)
        fields = list(old.ty.fields)
        for i, r in self.extra.items():
            if i >= len(fields):
                raise ValueError(f"param {i} of {len(fields)}: the module's params are not the ones named")
            shape, dtype = list(fields[i].shape.values), fields[i].dtype
            shape[self.axis] = shape[self.axis] + r
            fields[i] = relax.TensorType(shape, dtype)
        self.old, self.new = old, relax.Var(old.name, relax.TupleType(fields))
        func = relax.Function(list(func.params[:-1]) + [self.new], func.body, func.ret_ty, func.is_pure, func.attrs,
                              func.span)
        out = self.visit_expr(func)
        self.old = self.new = None
        return out

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:  # pylint: disable=arguments-renamed
        value = binding.value
        if isinstance(value, relax.TupleGetItem) and value.tuple_value.same_as(self.old):
            full = self.builder_.emit(relax.TupleGetItem(self.new, value.index), name_hint=binding.var.name)
            if value.index in self.extra and self.axis == 0:  # the weight's own rows, as before
                full = self.builder_.emit(relax.op.memory.view(full, binding.var.ty.shape),
                                          name_hint=binding.var.name + "_rows")
            elif value.index in self.extra:  # its own columns
                k = binding.var.ty.shape.values[1]
                full = self.builder_.emit(relax.op.strided_slice(full, axes=[1], begin=[0], end=[k]),
                                          name_hint=binding.var.name + "_cols")
            self.set_var_remap(binding.var, full)
            return
        super().visit_var_binding_(binding)

    def visit_var_(self, var: relax.Var) -> relax.Expr:  # pylint: disable=arguments-renamed
        if self.old is not None and var.same_as(self.old):
            raise ValueError("reserving rank rows or columns: the packed params are used other than by index")
        return super().visit_var_(var)
