"""What the passes that put one of our kernels in place of TVM's ops share (DispatchActivation,
DispatchNorm): a mutator adds each kernel's TIR wrapper once per shape, and the pass runs it over
every Relax function, drops what the rewrite left unused and links the kernels' CUDA modules."""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax

from ..ops import cuda_build


class Wrappers:
    """The wrappers (GlobalVars) a rewrite added, by key, and their CUDA modules."""

    def __init__(self, builder: relax.BlockBuilder):
        self.builder = builder
        self.gvs: dict[tuple, relax.GlobalVar] = {}
        self.modules: dict[tuple, tvm.runtime.Module] = {}

    def get(self, key: tuple, name: str, make: Callable[[], tuple]) -> relax.GlobalVar:
        """The wrapper of `key`, added as `name` from make() -> (PrimFunc, CUDA module) on first use."""
        if key not in self.gvs:
            func, ext = make()
            self.gvs[key] = self.builder.add_func(func.with_attr("global_symbol", name), name)
            self.modules[key] = ext
        return self.gvs[key]


def rewrite_functions(mod: tvm.IRModule, rewriter, wrappers: Wrappers) -> tvm.IRModule:
    """`rewriter` (a PyExprMutator over `mod`) over every Relax function; the bindings it left unused
    go; the wrappers' CUDA modules are linked into the module."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    out = relax.transform.DeadCodeElimination()(rewriter.builder_.get())
    for ext in wrappers.modules.values():
        out = cuda_build.attach(out, ext)
    return out
