"""The LoRA rewrite: paged-adapter table inputs on prefill/decode and a delta on every target linear.

The pass matches the linears and adds the tables; the update itself is the stage implementation
that ops/lora's registry selects per linear (ops/lora/__init__.py documents the interface).
"""

from __future__ import annotations

import re
from typing import Sequence

import tvm
from tvm import relax

from mlc_lora.contract import BASE_FUNCTION_SUFFIX, FILL_COLUMNS_FUNCTION, FUSED_FUNCTION_SUFFIX, LORA_TABLE_INPUTS

from ..ops import cuda_build, norm_triton
from ..ops import lora as lora_stages
from ..ops.lora import LoraContext, Part
from ..ops.lora.linear_triton import FUSED
from ..ops.lora.stage import layer_arg
from .dispatch_activation import gate_up_of
from .dispatch_norm import residual_of
from .dispatch_cublas import reserved_weight_of

_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_RMS_NORM = tvm.ir.Op.get("relax.nn.rms_norm")
# silu(gate) * up as down's producer in the rank columns route (linear_triton.PRODUCERS: the wrapper
# runs the activation kernel into [x | s] itself; off: the activation's own kernel and down on the
# pair). On: down 5.6 us under the pair at 1024 tokens, 4.9 at 256 (H100, `bench_lora_fused.py
# producers`, docs/results/2026-12-06-h100-inplace).
FOLD_SILU_MUL = True


def linear_weight_re(linears: dict[str, Sequence[tuple[str, int, int]]]) -> re.Pattern:
    """Matches the param name of a layer's linear of one of these kinds: group 1 the layer, 2 the kind."""
    kinds = "|".join(map(re.escape, linears))
    return re.compile(rf"layers[._](\d+)[._](?:.*[._])?({kinds})[._]weight$")


@tvm.transform.module_pass(opt_level=0, name="LoraRewrite")
class LoraRewrite:  # pylint: disable=too-few-public-methods,too-many-instance-attributes
    """Add the LoRA table inputs to prefill/decode and add each target linear's adapter delta."""

    def __init__(  # pylint: disable=too-many-arguments
        self,
        *,
        param_names: Sequence[str],
        modules: Sequence[tuple[str, int, int]],
        linears: dict[str, Sequence[tuple[str, int, int]]],
        num_layers: int,
        max_rank: int,
        kernel: str = "gather",
        arena_elems: int | None = None,
        functions: Sequence[str] = ("prefill", "decode"),
        target: tvm.target.Target | None = None,
        backend: str = "auto",
        max_slots: int = 256,
        base_functions: bool = True,
        fused: bool = False,
        add_norm: bool = False,
        rows: str = "model",
    ):
        """`param_names`: the packed params in export order. `modules`: the compiled target modules
        (name, in, out); their order is module index m. `linears`: weight kind (e.g. "qkv_proj") ->
        the HF linears it holds as (name, first row, end row). `arena_elems`: L*P*E, or None for a
        symbolic arena size. `kernel`: the LoRA stage, "single" (stage 1), "gather" (stage 2) or
        "sgmv" (stage 3). `backend`: whose implementation of the stage runs (ops/lora.STAGES:
        "tir", "cuda"), or "auto": per linear, the first registered one that supports it (for
        sgmv: sgmv.cu on CUDA fp16/bf16, else the TIR kernels). `max_slots`: the most
        adapter slots a batch's tables hold (the model's max batch size). `base_functions`: keep
        each rewritten function, unchanged, as `<name>_base` too (contract.BASE_FUNCTION_SUFFIX), for
        batches without adapters. `fused`: also build `<name>_fused` (contract.FUSED_FUNCTION_SUFFIX)
        of each, in which every linear that ops/lora/linear_triton.py supports computes the base
        product and the delta together (one kernel for small batches, cuBLAS + a shrink/expand
        pair over the batch's rank columns above); the runner takes them for the batches whose
        adapters fit its rank columns. `add_norm`: where the rank columns route's x is the RMSNorm of a
        residual sum h = a + b, the route's wrapper adds a and b too and hands on the sum in h's place
        (linear_triton.PRODUCERS' "add_rms_norm"; DispatchNorm does the same outside the route).
        `rows`: how the arena stores adapter rows (lora/layout.py ROW_FORMATS; "int8" needs a stage
        that reads them, and no fused functions)."""
        lora_stages.check(kernel, backend)
        self.param_names = list(param_names)
        self.module_index = {name: i for i, (name, _, _) in enumerate(modules)}
        self.num_modules = len(modules)
        self.linears = {k: sorted(v, key=lambda p: p[1]) for k, v in linears.items()}
        self.num_layers = num_layers
        self.max_rank = max_rank
        self.kernel = kernel
        self.arena_elems = arena_elems
        self.functions = tuple(functions)
        self.target = target
        self.backend = backend
        self.max_slots = max_slots
        self.base_functions = base_functions
        self.fused = fused
        self.add_norm = add_norm
        self.rows = rows
        if rows != "model" and fused:
            raise ValueError(f"{rows} adapter rows: the fused functions read model-dtype rows (fused=False)")
        # the rows' element offsets are multiples of this when every row length is (16-byte loads)
        self.row_align = 8 if all(i % 8 == 0 and o % 8 == 0 for _, i, o in modules) else 1
        self._name_re = linear_weight_re(self.linears)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True) or tvm.target.Target("llvm")
        rewriter = _Rewriter(mod, self, target)
        names = [gv.name_hint for gv in mod.get_global_vars()]
        for name in self.functions:
            if name in names:
                if self.base_functions:
                    base = name + BASE_FUNCTION_SUFFIX
                    copy = relax.utils.copy_with_new_vars(mod[name])
                    rewriter.builder_.add_func(copy.with_attr("global_symbol", base), base)
                if self.fused:
                    fused = name + FUSED_FUNCTION_SUFFIX
                    copy = relax.utils.copy_with_new_vars(mod[name])
                    gv = rewriter.builder_.add_func(copy.with_attr("global_symbol", fused), fused)
                    rewriter.fused = True
                    rewriter.rewrite(gv)
                    rewriter.fused = False
                rewriter.rewrite(mod.get_global_var(name))
        if rewriter.fills:
            fused = next(f for gv, f in rewriter.builder_.get().functions.items()
                         if gv.name_hint.endswith(FUSED_FUNCTION_SUFFIX) and isinstance(f, relax.Function))
            rewriter.add_fill_function(fused.params[-1].ty)
        out = rewriter.builder_.get()
        for gv, func in list(out.functions.items()):
            if gv.name_hint.endswith(FUSED_FUNCTION_SUFFIX) and isinstance(func, relax.Function):
                # the replaced permute_dims + matmul bindings are dead
                out[gv] = relax.analysis.remove_all_unused(func)
        for ext in rewriter.ctx.external_mods.values():
            out = cuda_build.attach(out, ext)
        return out


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, opts: LoraRewrite, target):
        super().__init__(mod)
        self.mod_ = mod
        self.opts = opts
        self.ctx = LoraContext(self.builder_, target, num_layers=opts.num_layers, max_rank=opts.max_rank,
                               num_modules=opts.num_modules, max_slots=opts.max_slots, row_align=opts.row_align,
                               rows=opts.rows)
        self.inputs: dict[str, relax.Var] = {}
        self.packed: relax.Var | None = None
        self.n_tok = None
        self.rewritten = 0
        self.fused = False  # rewriting a _fused copy: linears the fused kernel supports become one call
        self.fills: dict[int, tuple] = {}  # packed param index -> (layer, its fill's PrimFunc, dtype)

    def rewrite(self, gv: relax.GlobalVar) -> None:
        func = self.builder_.get()[gv]  # as the builder holds it (a _fused copy: just added)
        num_input = int(func.attrs["num_input"])
        params = list(func.params)
        x_shape = params[0].ty.shape.values
        n_tok = tvm.sym.Analyzer().simplify(_prod(x_shape[:-1]))
        self.inputs = self.table_vars(n_tok, params[0].ty.dtype)
        self.packed = params[-1] if num_input < len(params) else None
        self.n_tok, self.rewritten = n_tok, 0
        self.ctx.begin_function()
        new_params = params[:num_input] + [self.inputs[k] for k in LORA_TABLE_INPUTS] + params[num_input:]
        func = relax.Function(new_params, func.body, func.ret_ty, func.is_pure, func.attrs, func.span)
        if "relax.rewrite_cuda_graph.capture_symbolic_vars" not in (func.attrs or {}):
            func = func.with_attr("num_input", num_input + len(LORA_TABLE_INPUTS))
        # else (decode under CUDA graphs): the tables count with the weights, as RewriteCUDAGraph
        # treats every input past num_input as fixed-address, so the LoRA kernels are captured too.
        # The pool keeps its tables at fixed addresses; the runner passes them at a fixed slot
        # count (ModelRunner._graph_tables), so a graph never depends on the batch's adapters.
        new = self.visit_expr(func)
        if self.rewritten == 0:
            raise ValueError(f"LoraRewrite found no target linear in {gv.name_hint}: it must run "
                             "before FuseTransposeMatmul on permute_dims(W) + matmul")
        self.builder_.update_func(gv, new)

    def table_vars(self, n_tok, dtype: str) -> dict[str, relax.Var]:
        """The LoRA table inputs (LORA_TABLE_INPUTS) of a function over n_tok tokens."""
        slots = tvm.tirx.Var("lora_slots", "int64")
        cap1 = tvm.tirx.Var("lora_slot_capacity_plus_one", "int64")
        size = self.opts.arena_elems if self.opts.arena_elems is not None else tvm.tirx.Var(
            "lora_arena_elems", "int64")
        M, R = self.opts.num_modules, self.opts.max_rank
        shapes = {
            "lora_arena": ([size], dtype), "lora_token_slot": ([n_tok], "int32"),
            "lora_rank": ([slots], "int32"), "lora_scale": ([slots, M], "float32"),
            "lora_a_off": ([slots, M, R], "int32"), "lora_b_off": ([slots, M, R], "int32"),
            "lora_token_order": ([n_tok], "int32"), "lora_slot_start": ([cap1], "int32"),
        }
        return {k: relax.Var(k, relax.TensorType(*shapes[k])) for k in LORA_TABLE_INPUTS}

    def add_fill_function(self, packed_ty) -> None:
        """`lora_fill_columns` (contract.FILL_COLUMNS_FUNCTION): (the LoRA tables, the packed params)
        -> the weights with spare columns, each filled in place with the B rows of the tables'
        slots (the pool's kept adapters) over its layer; the runner calls it when the kept columns
        change (the rank columns route)."""
        bb = self.builder_
        first = next(iter(self.fills.values()))
        t = self.table_vars(tvm.tirx.Var("n", "int64"), first[2])
        params = relax.Var("params", packed_ty)
        with bb.function(FILL_COLUMNS_FUNCTION, [*(t[k] for k in LORA_TABLE_INPUTS), params],
                         attrs={"num_input": len(LORA_TABLE_INPUTS)}, pure=False):
            outs = []
            for idx, (layer, gv, _) in sorted(self.fills.items()):
                w = bb.emit(relax.TupleGetItem(params, idx))
                args = [t["lora_arena"], t["lora_rank"], t["lora_scale"], t["lora_b_off"], layer_arg(layer), w]
                outs.append(bb.emit(relax.call_tir_inplace(gv, args, [5], w.ty)))
            bb.emit_func_output(relax.Tuple(outs))

    # --- matching ---------------------------------------------------------------------------

    def _weight(self, rhs: relax.Expr) -> tuple[str | None, relax.Expr | None]:
        """(name, W) of a linear's `permute_dims(W)` operand; (None, None) if it is not one. Where
        W is a view of a weight's first rows (ReserveRankRows) or a slice of its first columns
        (ReserveRankColumns), the whole weight."""
        if not isinstance(rhs, relax.Var):
            return None, None
        perm = self.lookup_binding(rhs)
        if not (isinstance(perm, relax.Call) and perm.op == _PERMUTE):
            return None, None
        axes = perm.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return None, None
        w = perm.args[0]
        if isinstance(w, relax.Var):
            bound = self.lookup_binding(w)
            hit = reserved_weight_of(bound, w.ty)
            if hit is not None and isinstance(hit[0], relax.Var):  # the own part of a reserved weight
                w = hit[0]
                bound = self.lookup_binding(w)
            if isinstance(bound, relax.TupleGetItem) and bound.tuple_value.same_as(self.packed):
                return self.opts.param_names[bound.index], w
            if bound is None:
                return w.name, w
        return None, None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        if call.op != _MATMUL:
            return call
        name, w = self._weight(call.args[1])
        m = self.opts._name_re.search(name or "")  # pylint: disable=protected-access
        if m is None:
            return call
        layer, kind = int(m.group(1)), m.group(2)
        parts = self.opts.linears[kind]
        if not any(p[0] in self.opts.module_index for p in parts):
            return call
        return self._add_delta(call, layer, parts, w, name)

    # --- emission: the registered implementation of the stage ---------------------------------

    def _add_delta(self, call: relax.Call, layer: int, parts, w: relax.Expr, name: str) -> relax.Expr:
        bb, o = self.builder_, self.opts
        x = call.args[0]
        in_f = int(x.ty.shape.values[-1])
        parts = [Part(name, o.module_index.get(name, -1), lo, hi) for name, lo, hi in parts]
        if self.fused and parts[0].lo == 0 and FUSED.supported(
                self.ctx.target, str(x.ty.dtype), str(w.ty.dtype), in_f, [p.width for p in parts]) is None:
            x2 = bb.emit(relax.op.reshape(x, relax.ShapeExpr([self.n_tok, in_f])))
            self.rewritten += 1
            counters = self.ctx.per_function(("fused counters",), lambda: bb.emit(FUSED.counters()))
            # the rank columns route where the weight has spare columns and x's producer can write x
            # into [x | s] (the columns filled by lora_fill_columns); else the pair, the columns unread
            producer = None
            if self.packed is not None and int(w.ty.shape.values[1]) != in_f:
                producer = self._producer(x, in_f)
            if producer is not None:
                fill = FUSED.fill(self.ctx, parts, in_f, w.ty, str(w.ty.dtype))
                self.fills[o.param_names.index(name)] = (layer, fill, str(w.ty.dtype))
            residual = producer[3] if producer is not None else None
            y, h1 = FUSED.emit(self.ctx, x2, w, layer, parts, self.inputs, counters, call.ty.shape,
                               producer and producer[:3])
            if residual is not None:  # the residual sum's later uses (the next residual add) read the wrapper's
                self.set_var_remap(residual, bb.emit(relax.op.reshape(h1, residual.ty.shape)))
            return y
        x2 = bb.emit(relax.op.reshape(x, relax.ShapeExpr([self.n_tok, in_f])))
        impl = lora_stages.select(o.kernel, o.backend, self.ctx.target, str(call.ty.dtype), o.max_rank, len(parts),
                                  o.rows)
        self.rewritten += 1
        return impl.emit(self.ctx, call, x2, layer, parts, self.inputs)  # (the stage emits the GEMM)

    def _producer(self, x: relax.Expr, in_f: int) -> tuple | None:
        """x's producer for the rank columns route's wrapper to run in its place (writing x into
        [x | s]; linear_triton.PRODUCERS), as FusedLinear.emit takes it, and the residual sum the
        wrapper hands on: ("rms_norm", [h (n, in_f), g], eps, None) for an RMSNorm over the last
        axis; with `add_norm`, of h = a + b: ("add_rms_norm", [a, b, g], eps, h) (h's later uses are
        moved to the wrapper's sum); ("silu_mul", [y (n, 2 in_f)], 0.0, None) for silu(gate) * up
        over split(y, 2); None for anything else (the linear then keeps the pair). x's producer
        stays for other uses of x, if any."""
        bb = self.builder_
        bound = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        if not isinstance(bound, relax.Call):
            return None
        if bound.op == _RMS_NORM:
            h, g = bound.args
            ndim = h.ty.ndim
            if [int(a) % ndim for a in bound.attrs.axes] != [ndim - 1] or str(h.ty.dtype) != str(g.ty.dtype) \
                    or norm_triton.supported(str(h.ty.dtype), in_f) is not None:
                return None
            rows = lambda e: bb.emit(relax.op.reshape(e, relax.ShapeExpr([self.n_tok, in_f])))  # noqa: E731
            res = residual_of(h, self.lookup_binding, bb.current_block_is_dataflow()) if self.opts.add_norm else None
            if res is not None:
                return ("add_rms_norm", [rows(res[0]), rows(res[1]), g], float(bound.attrs.epsilon), h)
            return ("rms_norm", [rows(h), g], float(bound.attrs.epsilon), None)
        y = gate_up_of(bound, self.lookup_binding) if FOLD_SILU_MUL else None
        if y is None or y.ty.shape is None or int(y.ty.shape.values[-1]) != 2 * in_f:
            return None
        return ("silu_mul", [bb.emit(relax.op.reshape(y, relax.ShapeExpr([self.n_tok, 2 * in_f])))], 0.0, None)


def _prod(values):
    out = tvm.tirx.IntImm("int64", 1)
    for v in values:
        out = out * v
    return out
