"""Send the model's linears to our runtime's GEMMs: on CUDA our small-batch kernel up to a few
tokens and cuBLAS above (ops/gemv/gemv_cuda.py), on CPU src/runtime/cpu_gemm.cc."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import cuda_build
from ..ops.gemv import gemv_cuda

# Registered by src/runtime/cublas_gemm.cc: out (..., N) = x (..., K) @ w (N' >= N, K)[:N]^T.
CUBLAS_GEMM = "mlc_lora.runtime.cublas_gemm"
DTYPES = ("float16", "bfloat16", "float32")
CPU_DTYPES = ("float32",)  # what the extern's CPU path (src/runtime/cpu_gemm.cc) takes
# Up to this many tokens a CUDA fp16/bf16 linear runs ops/gemv/gemv.cu, cuBLAS above (measured: docs/GPU.md).
GEMV_MAX_ROWS = 1


@tvm.transform.module_pass(opt_level=0, name="DispatchCublas")
class DispatchCublas:  # pylint: disable=too-few-public-methods
    """Rewrite matmul(x, permute_dims(W)) with a 2-D weight W into our GEMM (gemv / cuBLAS). W may
    be a view of a weight's first rows (ReserveRankRows) or a slice of its first columns
    (ReserveRankColumns): the GEMM then takes the whole weight and reads the rows and columns its
    output and input need, with the weight's row stride (no view or copy made per call)."""

    def __init__(self, cpu: bool = False, arch: str | None = None, gemv_max_rows: int = GEMV_MAX_ROWS):
        # CPU: float32 only, and single rows too (TVM's CPU matmul is an unscheduled scalar loop).
        # CUDA with `arch` and gemv_max_rows > 0: fp16/bf16 linears go through gemv_cuda's
        # wrapper (gemv.cu up to gemv_max_rows tokens, cuBLAS above); else straight to cuBLAS,
        # except a static single row, left to dlight's GEMV (0.8x cuBLAS's time measured).
        if gemv_max_rows < 0:
            raise ValueError(f"gemv_max_rows must be >= 0, not {gemv_max_rows}")
        self.cpu = cpu
        self.arch = None if cpu else arch
        self.gemv_max_rows = gemv_max_rows

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod, self.cpu, self.arch if self.gemv_max_rows else None, self.gemv_max_rows)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        # The permute_dims left without users go here.
        out = relax.transform.DeadCodeElimination()(rewriter.builder_.get())
        for dtype in sorted(rewriter.gemv_dtypes):
            out = cuda_build.attach(out, gemv_cuda.build_module(dtype, self.arch))
        return out


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, cpu: bool, gemv_arch: str | None, gemv_max_rows: int):
        super().__init__(mod)
        self._dtypes = CPU_DTYPES if cpu else DTYPES
        self._cpu = cpu
        self._gemv_arch = gemv_arch
        self._gemv_max_rows = gemv_max_rows
        self._wrappers: dict[tuple, relax.GlobalVar] = {}
        self.gemv_dtypes: set[str] = set()
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
        weight, w_rows, w_cols = self._own_part_of(weight)
        if not isinstance(x_ty, relax.TensorType) or x_ty.shape is None or x_ty.ndim < 1:
            return call
        out_dtype = call.attrs.out_dtype
        if x_ty.dtype != w_ty.dtype or x_ty.dtype not in self._dtypes or (
            out_dtype and str(out_dtype) not in ("", "void", x_ty.dtype)
        ):
            return call
        rows = x_ty.shape.values[:-1]
        n, k = w_ty.shape.values
        out_ty = relax.TensorType(list(rows) + [n], x_ty.dtype)
        if self._gemv_arch and isinstance(n, tvm.tirx.IntImm) and isinstance(k, tvm.tirx.IntImm) and (
            gemv_cuda.supported(str(x_ty.dtype), int(k), x_ty.ndim) is None
        ):
            wrapper = self._gemv_wrapper(int(n), int(k), str(x_ty.dtype), x_ty.ndim, w_rows, w_cols)
            return relax.call_tir(wrapper, [x, weight], out_ty)
        if not self._cpu and _is_static_one(rows) and w_rows is None and w_cols is None:
            # One static row: dlight's GEMV beats cuBLAS there (measured 0.8x of its time).
            return call
        return relax.call_dps_packed(relax.ExternFunc(CUBLAS_GEMM), [x, weight], out_ty)

    def _own_part_of(self, w: relax.Expr) -> tuple[relax.Expr, int | None, int | None]:
        """(the weight, its rows, its columns) where `w` is a view of a weight's first rows (same
        dtype and row length, no offset: rows reserved below) or a strided_slice of its first
        columns (columns reserved beside), else (w, None, None): the GEMMs read the whole weight's
        first rows and columns with its row stride."""
        hit = reserved_weight_of(self.lookup_binding(w) if isinstance(w, relax.Var) else None, w.ty)
        if hit is None or not _is_weight(hit[0], self):
            return w, None, None
        full, axis = hit
        n = int(full.ty.shape.values[axis])
        return (full, n, None) if axis == 0 else (full, None, n)

    def _gemv_wrapper(self, n: int, k: int, dtype: str, ndim: int, w_rows: int | None = None,
                      w_cols: int | None = None) -> relax.GlobalVar:
        key = (n, k, dtype, ndim, w_rows, w_cols)
        if key not in self._wrappers:
            rows = f"_of{w_rows}" if w_rows is not None else ""
            cols = f"_of{w_cols}" if w_cols is not None else ""
            name = f"mlc_lora_linear_{gemv_cuda.DTYPES[dtype]}_{n}{rows}x{k}{cols}_{ndim}d"
            func = gemv_cuda.wrapper(n, k, dtype, ndim, self._gemv_max_rows, w_rows=w_rows, w_cols=w_cols)
            self._wrappers[key] = self.builder_.add_func(func.with_attr("global_symbol", name), name)
            self.gemv_dtypes.add(dtype)
        return self._wrappers[key]

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


def reserved_weight_of(bound, own_ty) -> tuple[relax.Expr, int] | None:
    """(the weight, axis) where `bound` (the expression bound to a var of type `own_ty`) is a use
    reserve_rank_rows.widen_weights made of a weight with reserved rows (axis 0: a view of its first rows, same dtype
    and row length, no offset) or columns (axis 1: a strided_slice of its first columns, unit
    strides); else None. The GEMMs take the whole weight there and read its own part."""
    if not isinstance(bound, relax.Call) or bound.op not in (_VIEW, _STRIDED_SLICE):
        return None
    full = bound.args[0]
    f_ty = full.ty
    if not (isinstance(f_ty, relax.TensorType) and f_ty.ndim == 2 and f_ty.shape is not None
            and isinstance(own_ty, relax.TensorType) and own_ty.shape is not None and f_ty.dtype == own_ty.dtype
            and all(isinstance(d, tvm.tirx.IntImm) for d in (*f_ty.shape.values, *own_ty.shape.values))):
        return None
    (fr, fc), (r, c) = ([int(d) for d in t.shape.values] for t in (f_ty, own_ty))
    if bound.op == _VIEW:
        offset = bound.args[3]
        ok = isinstance(offset, relax.Tuple) and len(offset.fields) == 0 and fc == c and fr >= r
        return (full, 0) if ok else None
    ints = lambda t: [int(v.value) for v in t.fields] if isinstance(t, relax.Tuple) else None  # noqa: E731
    axes, begin = ints(bound.args[1]), ints(bound.args[2])
    strides = ints(bound.args[4]) if len(bound.args) > 4 else []
    ok = axes == [1] and begin == [0] and strides in ([1], [], None) and fr == r and fc >= c
    return (full, 1) if ok else None


_VIEW = tvm.ir.Op.get("relax.memory.view")
_STRIDED_SLICE = tvm.ir.Op.get("relax.strided_slice")


def _is_weight(w: relax.Expr, rewriter: PyExprMutator) -> bool:
    """A model weight: a function parameter, or TupleGetItem of the packed parameter tuple, or a
    view of the first rows of one (ReserveRankRows) or a slice of its first columns
    (ReserveRankColumns)."""
    if isinstance(w, relax.Var):
        bound = rewriter.lookup_binding(w)
        if bound is None:
            return True  # a function parameter ("plain" param mode)
        hit = reserved_weight_of(bound, w.ty)
        if hit is not None:
            return _is_weight(hit[0], rewriter)
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
