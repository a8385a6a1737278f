"""The LoRA rewrite: paged-adapter table inputs on prefill/decode and a delta on every target linear."""

from __future__ import annotations

import re
from typing import Sequence

import tvm
from tvm import relax

from mlc_lora.contract import LORA_KERNELS, LORA_TABLE_INPUTS

from . import cuda_source, lora_sgmv_cuda
from .lora_kernels import KERNELS
from .lora_sgmv import lora_sgmv_expand_kernel, lora_sgmv_shrink_kernel, num_chunks

_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")


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
        sgmv_backend: str = "auto",
    ):
        """`param_names`: the packed params in export order. `modules`: the compiled target modules
        (name, in, out); their order is module index m. `linears`: weight kind (e.g. "qkv_proj") ->
        the HF linears it holds as (name, first row, end row). `arena_elems`: L*P*E, or None for a
        symbolic arena size. `kernel`: "single" (stage 1), "gather" (stage 2) or "sgmv" (stage 3).
        `sgmv_backend`: who runs stage 3 on CUDA targets: "cuda" (cuda/lora_sgmv.cu), "tir"
        (lora_sgmv.py's TIR kernels) or "auto" (cuda where lora_sgmv_cuda.supported, else tir)."""
        if kernel not in LORA_KERNELS:
            raise ValueError(f"unknown LoRA kernel {kernel!r}; choose from {', '.join(LORA_KERNELS)}")
        if sgmv_backend not in ("auto", "cuda", "tir"):
            raise ValueError(f"unknown sgmv backend {sgmv_backend!r}; choose from auto, cuda, tir")
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
        self.sgmv_backend = sgmv_backend
        kinds = "|".join(map(re.escape, self.linears))
        self._name_re = re.compile(rf"layers[._](\d+)[._](?:.*[._])?({kinds})[._]weight$")

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True) or tvm.target.Target("llvm")
        rewriter = _Rewriter(mod, self, target)
        for name in self.functions:
            if name in [gv.name_hint for gv in mod.get_global_vars()]:
                rewriter.rewrite(mod.get_global_var(name))
        out = rewriter.builder_.get()
        for ext in rewriter.cuda_mods.values():
            out = cuda_source.attach(out, ext)
        return out


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, opts: LoraRewrite, target):
        super().__init__(mod)
        self.mod_ = mod
        self.opts = opts
        self.target = target
        self.kernels: dict[tuple, relax.GlobalVar] = {}
        self.cuda_mods: dict[tuple, tvm.runtime.Module] = {}  # (dtype, R) -> lora_sgmv.cu module
        self.inputs: dict[str, relax.Var] = {}
        self.packed: relax.Var | None = None
        self.n_tok = None
        self.rewritten = 0

    def rewrite(self, gv: relax.GlobalVar) -> None:
        func = self.mod_[gv]
        num_input = int(func.attrs["num_input"])
        params = list(func.params)
        x_shape = params[0].ty.shape.values
        n_tok = tvm.sym.Analyzer().simplify(_prod(x_shape[:-1]))
        slots = tvm.tirx.Var("lora_slots", "int64")
        size = self.opts.arena_elems if self.opts.arena_elems is not None else tvm.tirx.Var(
            "lora_arena_elems", "int64")
        M, R = self.opts.num_modules, self.opts.max_rank
        dtype = params[0].ty.dtype
        shapes = {
            "lora_arena": ([size], dtype), "lora_token_slot": ([n_tok], "int32"),
            "lora_rank": ([slots], "int32"), "lora_scale": ([slots, M], "float32"),
            "lora_a_off": ([slots, M, R], "int32"), "lora_b_off": ([slots, M, R], "int32"),
        }
        self.inputs = {k: relax.Var(k, relax.TensorType(*shapes[k])) for k in LORA_TABLE_INPUTS}
        self.packed = params[-1] if num_input < len(params) else None
        self.n_tok, self.rewritten = n_tok, 0
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

    # --- matching ---------------------------------------------------------------------------

    def _weight_name(self, rhs: relax.Expr) -> str | None:
        if not isinstance(rhs, relax.Var):
            return None
        perm = self.lookup_binding(rhs)
        if not (isinstance(perm, relax.Call) and perm.op == _PERMUTE):
            return None
        axes = perm.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return None
        w = perm.args[0]
        if isinstance(w, relax.Var):
            bound = self.lookup_binding(w)
            if isinstance(bound, relax.TupleGetItem) and bound.tuple_value.same_as(self.packed):
                return self.opts.param_names[bound.index]
            if bound is None:
                return w.name
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        if call.op != _MATMUL:
            return call
        name = self._weight_name(call.args[1])
        m = self.opts._name_re.search(name or "")  # pylint: disable=protected-access
        if m is None:
            return call
        layer, kind = int(m.group(1)), m.group(2)
        parts = self.opts.linears[kind]
        if not any(p[0] in self.opts.module_index for p in parts):
            return call
        return self._add_delta(call, layer, parts)

    # --- emission ---------------------------------------------------------------------------

    def _add_delta(self, call: relax.Call, layer: int, parts) -> relax.Expr:
        bb = self.builder_
        y = bb.emit(call)
        x = call.args[0]
        in_f = int(x.ty.shape.values[-1])
        dtype = y.ty.dtype
        n = self.n_tok
        x2 = bb.emit(relax.op.reshape(x, relax.ShapeExpr([n, in_f])))
        if self.opts.kernel == "sgmv" and self._sgmv_cuda(dtype, len(parts)):
            self.rewritten += 1
            return self._sgmv_cuda_parts(y, x2, layer, parts, in_f, dtype)
        if self.opts.kernel == "single":
            x2 = bb.emit(relax.op.multiply(x2, self._mask(dtype)))  # base-model tokens get no delta
        deltas = []
        for name, lo, hi in parts:
            if name in self.opts.module_index:
                deltas.append(self._delta(x2, self.opts.module_index[name], layer, in_f, hi - lo, dtype))
            else:
                deltas.append(bb.emit(relax.op.zeros(relax.ShapeExpr([n, hi - lo]), dtype)))
        delta = deltas[0] if len(deltas) == 1 else bb.emit(relax.op.concat(deltas, axis=1))
        delta = bb.emit(relax.op.reshape(delta, y.ty.shape))
        self.rewritten += 1
        return relax.op.add(y, delta)

    def _delta(self, x2, mi: int, layer: int, in_f: int, out_f: int, dtype: str) -> relax.Var:
        """delta (n, out_f) of module `mi` in `layer` for the tokens x2 (n, in_f)."""
        bb, t, n, R = self.builder_, self.inputs, self.n_tok, self.opts.max_rank
        tables = [t["lora_rank"], t["lora_scale"], t["lora_a_off"], t["lora_b_off"]]
        lay = relax.prim_value(tvm.tirx.IntImm("int64", layer))
        if self.opts.kernel == "sgmv":
            shrink, expand = self._sgmv_kernels(in_f, out_f, mi, dtype)
            v = bb.emit(relax.call_tir(shrink, [x2, t["lora_arena"], t["lora_token_slot"], *tables[:3], lay],
                                       relax.TensorType([n, num_chunks(in_f), R], "float32")))
            return bb.emit(relax.call_tir(expand, [v, t["lora_arena"], t["lora_token_slot"], tables[0],
                                                   tables[3], lay], relax.TensorType([n, out_f], dtype)))
        gv = self._kernel(in_f, out_f, mi, dtype)
        if self.opts.kernel == "gather":
            return bb.emit(relax.call_tir(gv, [x2, t["lora_arena"], t["lora_token_slot"], *tables, lay],
                                          relax.TensorType([n, out_f], dtype)))
        # single: dense A (R, in) and scale*B^T (R, out) of slot 0, then two GEMMs (x2 is masked).
        ab = bb.emit(relax.call_tir(gv, [t["lora_arena"], *tables, lay],
                                    [relax.TensorType([R, in_f], dtype), relax.TensorType([R, out_f], dtype)]))
        a = bb.emit(relax.TupleGetItem(ab, 0))
        b = bb.emit(relax.TupleGetItem(ab, 1))
        h = bb.emit(relax.op.matmul(x2, relax.op.permute_dims(a)))
        return bb.emit(relax.op.matmul(h, b))

    def _sgmv_cuda_parts(self, y, x2, layer: int, parts, in_f: int, dtype: str) -> relax.Expr:
        """y + the deltas of all parts, by one shrink and one in-place expand (lora_sgmv_cuda)."""
        bb, t, n, o, dtype = self.builder_, self.inputs, self.n_tok, self.opts, str(dtype)
        mods = tuple(o.module_index.get(name, -1) for name, _, _ in parts)
        widths = tuple(hi - lo for _, lo, hi in parts)
        key = ("sgmv_cuda", in_f, mods, widths, dtype)
        if key not in self.kernels:
            tag = "_".join(str(m) if m >= 0 else "x" for m in mods)
            shrink = lora_sgmv_cuda.shrink_wrapper(in_f, mods, o.num_layers, o.max_rank, o.num_modules, dtype)
            expand = lora_sgmv_cuda.expand_wrapper(in_f, widths, mods, o.num_layers, o.max_rank, o.num_modules, dtype)
            names = (f"lora_sgmv_shrink_m{tag}_{in_f}", f"lora_sgmv_expand_m{tag}_{in_f}x{sum(widths)}")
            self.kernels[key] = tuple(self.builder_.add_func(f.with_attr("global_symbol", nm), nm)
                                      for f, nm in zip((shrink, expand), names))
        shrink, expand = self.kernels[key]
        lay = relax.prim_value(tvm.tirx.IntImm("int64", layer))
        v = bb.emit(relax.call_tir(shrink, [x2, t["lora_arena"], t["lora_token_slot"], t["lora_rank"],
                                            t["lora_scale"], t["lora_a_off"], lay],
                                   relax.TensorType([n, len(parts), num_chunks(in_f), o.max_rank], "float32")))
        y2 = bb.emit(relax.op.reshape(y, relax.ShapeExpr([n, sum(widths)])))
        # In place: the GEMM's output takes the deltas (no delta tensor, no add, no concat).
        y2 = bb.emit(relax.call_tir_inplace(expand, [v, t["lora_arena"], t["lora_token_slot"], t["lora_rank"],
                                                     t["lora_scale"], t["lora_b_off"], lay, y2], [7],
                                            relax.TensorType([n, sum(widths)], dtype)))
        return relax.op.reshape(y2, y.ty.shape)

    def _mask(self, dtype: str) -> relax.Var:
        """(n, 1): 1 for tokens on an adapter slot, 0 for base-model tokens (slot -1)."""
        # Emitted per use: a cached var could belong to another dataflow block.
        on = relax.op.greater_equal(self.inputs["lora_token_slot"], relax.const(0, "int32"))
        return self.builder_.emit(relax.op.reshape(relax.op.astype(on, dtype),
                                                   relax.ShapeExpr([self.n_tok, 1])))

    def _kernel(self, in_f: int, out_f: int, mi: int, dtype: str) -> relax.GlobalVar:
        key = (self.opts.kernel, in_f, out_f, mi, dtype)
        if key not in self.kernels:
            o = self.opts
            func = KERNELS[o.kernel](in_f, out_f, mi, o.num_layers, o.max_rank, o.num_modules, dtype,
                                     self.target)
            name = f"lora_{o.kernel}_m{mi}_{in_f}x{out_f}"
            self.kernels[key] = self.builder_.add_func(func.with_attr("global_symbol", name), name)
        return self.kernels[key]


    def _sgmv_cuda(self, dtype: str, num_parts: int) -> bool:
        """Whether stage 3 of a linear of `num_parts` parts runs on cuda/lora_sgmv.cu (building its
        module once per dtype)."""
        backend, R, dtype = self.opts.sgmv_backend, self.opts.max_rank, str(dtype)
        if backend == "tir" or self.target.kind.name != "cuda":
            return False
        why = lora_sgmv_cuda.supported(dtype, R, num_parts)
        if why is not None:
            if backend == "cuda":
                raise ValueError(f"sgmv_backend='cuda': no CUDA sgmv kernels for {why}")
            return False
        if (dtype, R) not in self.cuda_mods:
            self.cuda_mods[(dtype, R)] = lora_sgmv_cuda.build_module(dtype, R, str(self.target.arch))
        return True

    def _sgmv_kernels(self, in_f: int, out_f: int, mi: int, dtype):
        """The TIR stage-3 kernels (lora_sgmv.py) of module `mi`."""
        o, out, dtype = self.opts, [], str(dtype)  # a relax PrimType compares equal, hashes not
        make_shrink = lambda: lora_sgmv_shrink_kernel(in_f, mi, o.num_layers, o.max_rank,  # noqa: E731
                                                      o.num_modules, dtype, self.target)
        make_expand = lambda: lora_sgmv_expand_kernel(in_f, out_f, mi, o.num_layers, o.max_rank,  # noqa: E731
                                                      o.num_modules, dtype, self.target)
        for part, make in (("shrink", make_shrink), ("expand", make_expand)):
            key = ("sgmv", part, in_f, out_f if part == "expand" else 0, mi, dtype)
            if key not in self.kernels:
                name = f"lora_sgmv_{part}_m{mi}_{in_f}x{out_f}" if part == "expand" else f"lora_sgmv_shrink_m{mi}_{in_f}"
                self.kernels[key] = self.builder_.add_func(make().with_attr("global_symbol", name), name)
            out.append(self.kernels[key])
        return out


def _prod(values):
    out = tvm.tirx.IntImm("int64", 1)
    for v in values:
        out = out * v
    return out
