"""The interface between LoraRewrite and a LoRA stage implementation (see ops/lora/__init__.py).

LoraRewrite finds each target linear `y = x @ W.T` (W possibly fused, e.g. q|k|v), emits the tokens
x as (n, in), and calls `LoraStage.emit` of the implementation the registry picked with y's call;
that emits it and the adapter update and returns the new y. `LoraContext` is what all calls of one rewrite
share: the block builder and the kernels and CUDA modules already added.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

# TVM's runtime is enough to import this module (relax is imported where it is used), so that the
# Triton stage's kernels import on a GPU machine that has the runtime-only TVM
import tvm

MAX_PARTS = 3  # parts of one fused linear (q|k|v) that every stage's kernels take


class Part(NamedTuple):
    """One slice of a fused linear's output: the HF linear it holds and its columns of y."""

    name: str  # e.g. "k_proj"
    module: int  # its index m on the tables' module axis; -1: the model compiles no adapter for it
    lo: int  # first column of y (first row of the fused weight)
    hi: int  # end column

    @property
    def width(self) -> int:
        return self.hi - self.lo


class LoraContext:
    """The rewrite's shared state: where to emit, the model's LoRA shape, the kernels added."""

    def __init__(self, builder: relax.BlockBuilder, target: tvm.target.Target, *, num_layers: int,
                 max_rank: int, num_modules: int, max_slots: int = 256, row_align: int = 1,
                 rows: str = "model"):
        self.builder = builder  # emits into the function being rewritten
        self.target = target
        self.num_layers = num_layers  # L: the arena holds L equal layer slices
        self.max_rank = max_rank  # R: the last axis of the offset tables
        self.num_modules = num_modules  # M: the module axis of the tables
        self.max_slots = max_slots  # the most slots lora_slot_start describes (minus one)
        self.row_align = row_align  # every row offset in the arena is a multiple of this
        self.rows = rows  # how the arena stores adapter rows: "model" or "int8" (lora/layout.py)
        self.external_mods: dict[tuple, tvm.runtime.Module] = {}  # linked into the library
        self._kernels: dict[tuple, relax.GlobalVar] = {}
        self._function_values: dict[tuple, relax.Var] = {}

    def begin_function(self) -> None:
        """The rewrite moves to another function: per_function values start afresh."""
        self._function_values = {}

    def per_function(self, key: tuple, make: Callable[[], relax.Var]) -> relax.Var:
        """A value the linears of one function share (e.g. split counters, the batch's tile
        table), emitted by `make()` at its first use in the function and reused after."""
        if key not in self._function_values:
            self._function_values[key] = make()
        return self._function_values[key]

    def kernel(self, key: tuple, name: str, make: Callable[[], tvm.tirx.PrimFunc]) -> relax.GlobalVar:
        """The PrimFunc `make()` added to the module as `name`, once per `key` (a key, not the
        name: two implementations may name their kernels alike)."""
        if key not in self._kernels:
            self._kernels[key] = self.builder.add_func(make().with_attr("global_symbol", name), name)
        return self._kernels[key]

    def external(self, key: tuple, make: Callable[[], tvm.runtime.Module]) -> None:
        """Link the runtime module `make()` (e.g. a CUDA module of ops/cuda_build.py) into the
        library, once per `key`."""
        if key not in self.external_mods:
            self.external_mods[key] = make()


class LoraStage:
    """One implementation of one LoRA stage (contract.LORA_KERNELS) on one backend."""

    stage: str = ""  # "single", "gather" or "sgmv"
    backend: str = ""  # "tir", "cuda", ...

    def supported(self, target: tvm.target.Target, dtype: str, max_rank: int, num_parts: int,
                  rows: str = "model") -> str | None:
        """None when this implementation can update a linear of `num_parts` parts of a `dtype`
        model with adapters up to `max_rank`, rows stored as `rows` (lora/layout.py ROW_FORMATS),
        on `target`; else why not, in words ("dtype float32 (the kernels are float16/bfloat16)").
        The "auto" backend takes the first that can."""
        raise NotImplementedError

    def emit(self, ctx: LoraContext, base: relax.Call, x: relax.Var, layer: int, parts: Sequence[Part],
             tables: Mapping[str, relax.Var]) -> relax.Expr:
        """Emit, with ctx.builder, the base GEMM and the adapter update of one target linear and
        return the new y.

        base: the base output's call (..., W), not yet emitted; W = parts[-1].hi. The stage emits
          it where its kernels want it: a shrink, which reads only x, goes before it, so that it
          follows x's producer rather than the GEMM (whose kernels let their dependents be
          scheduled early: a shrink launched programmatically after it starts crowded).
        x: the linear's input tokens (n, in), already emitted; n = all tokens of the batch.
        layer: the decoder layer (the kernels take it as a scalar: one kernel serves all layers).
        parts: the fused linear's slices in column order; at least one has module >= 0.
        tables: contract.LORA_TABLE_INPUTS -> the function's parameters: lora_arena (size,),
          lora_token_slot (n,) int32, lora_rank (S,) int32, lora_scale (S, M) float32,
          lora_a_off (S, M, R) int32, lora_b_off (S, M, R) int32, lora_token_order (n,) int32,
          lora_slot_start (capacity + 1,) int32 (contract.LORA_TABLE_INPUTS).
        Returns an expression of y's shape and dtype (not yet emitted): y plus every token's delta.
        """
        raise NotImplementedError


def layer_arg(layer: int) -> relax.PrimValue:
    """The layer as the kernels' int64 scalar argument."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    return relax.prim_value(tvm.tirx.IntImm("int64", layer))


def tokens(x: relax.Var):
    """n, the token count of x (n, in)."""
    return x.ty.shape.values[0]


def add_module_deltas(ctx: LoraContext, y: relax.Var, x: relax.Var, parts: Sequence[Part],
                      delta: Callable[[Part], relax.Var]) -> relax.Expr:
    """y + the concatenation over the parts of delta(part) (n, width), zeros for parts without a
    module: the update of the stages that run one kernel (or pair) per module."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    bb, n = ctx.builder, tokens(x)
    deltas = [delta(p) if p.module >= 0 else bb.emit(relax.op.zeros(relax.ShapeExpr([n, p.width]), y.ty.dtype))
              for p in parts]
    d = deltas[0] if len(deltas) == 1 else bb.emit(relax.op.concat(deltas, axis=1))
    d = bb.emit(relax.op.reshape(d, y.ty.shape))
    return relax.op.add(y, d)
