"""Send the model's linears to our runtime's extern GEMM: cuBLAS on CUDA, cpu_gemm.cc on CPU."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

# Registered by src/runtime/cublas_gemm.cc: out (..., N) = x (..., K) @ w (N, K)^T.
CUBLAS_GEMM = "mlc_lora.runtime.cublas_gemm"
DTYPES = ("float16", "bfloat16", "float32")
CPU_DTYPES = ("float32",)  # what the extern's CPU path (src/runtime/cpu_gemm.cc) takes


@tvm.transform.module_pass(opt_level=0, name="DispatchCublas")
class DispatchCublas:  # pylint: disable=too-few-public-methods
    """Rewrite matmul(x, permute_dims(W)) with a 2-D weight W into call_dps_packed(cublas_gemm)."""

    def __init__(self, cpu: bool = False):
        # CPU: float32 only, and single rows too (TVM's CPU matmul is an unscheduled scalar loop;
        # on CUDA, dlight's GEMV beats cuBLAS for one static row).
        self.cpu = cpu

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod, self.cpu)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        # The permute_dims left without users go here.
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, cpu: bool):
        super().__init__(mod)
        self._dtypes = CPU_DTYPES if cpu else DTYPES
        self._cpu = cpu
        self._matmul = tvm.ir.Op.get("relax.matmul")
        self._permute = tvm.ir.Op.get("relax.permute_dims")

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        if call.op != self._matmul:
            return call
        x, wt = call.args
        weight = self._transposed_weight(wt)
        if weight is None:
            return call
        x_ty, w_ty = x.ty, weight.ty
        if not isinstance(x_ty, relax.TensorType) or x_ty.shape is None or x_ty.ndim < 1:
            return call
        out_dtype = call.attrs.out_dtype
        if x_ty.dtype != w_ty.dtype or x_ty.dtype not in self._dtypes or (
            out_dtype and str(out_dtype) not in ("", "void", x_ty.dtype)
        ):
            return call
        rows = x_ty.shape.values[:-1]
        if not self._cpu and _is_static_one(rows):
            # One static row: dlight's GEMV beats cuBLAS there (measured 0.8x of its time).
            return call
        n = w_ty.shape.values[0]
        out_ty = relax.TensorType(list(rows) + [n], x_ty.dtype)
        return relax.call_dps_packed(relax.ExternFunc(CUBLAS_GEMM), [x, weight], out_ty)

    def _transposed_weight(self, expr: relax.Expr) -> relax.Expr | None:
        """W if `expr` is permute_dims(W) of a 2-D weight (a parameter or an item of the packed ones)."""
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if bound is not None:
                expr = bound
        if not (isinstance(expr, relax.Call) and expr.op == self._permute):
            return None
        w = expr.args[0]
        axes = expr.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return None
        w_ty = w.ty
        if not isinstance(w_ty, relax.TensorType) or w_ty.ndim != 2 or w_ty.shape is None:
            return None
        return w if _is_weight(w, self) else None


def _is_weight(w: relax.Expr, rewriter: PyExprMutator) -> bool:
    """A model weight: a function parameter, or TupleGetItem of the packed parameter tuple."""
    if isinstance(w, relax.Var):
        bound = rewriter.lookup_binding(w)
        if bound is None:
            return True  # a function parameter ("plain" param mode)
        w = bound
    return isinstance(w, relax.TupleGetItem) and isinstance(w.tuple_value, relax.Var) and (
        rewriter.lookup_binding(w.tuple_value) is None
    )


def _is_static_one(dims) -> bool:
    total = 1
    for d in dims:
        if not isinstance(d, tvm.tirx.IntImm):
            return False
        total *= int(d)
    return total == 1
