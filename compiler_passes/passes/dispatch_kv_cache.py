"""Point the model's KV-cache constructor at mlc-lora's unified page pool."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

STOCK_CREATE = "vm.builtin.paged_attention_kv_cache_create"
POOL_CREATE = "mlc_lora.runtime.create_paged_kv_cache"


@mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        if (call.op == tvm.ir.Op.get("relax.call_pure_packed") and call.args
                and isinstance(call.args[0], relax.ExternFunc)
                and call.args[0].global_symbol == STOCK_CREATE):
            args = [relax.ExternFunc(POOL_CREATE)] + list(call.args[1:])
            return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)
        return call


@tvm.transform.module_pass(opt_level=0, name="DispatchKVCache")
class DispatchKVCache:  # pylint: disable=too-few-public-methods
    """Rewrite calls of TVM's paged KV-cache constructor to mlc-lora's (same arguments)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()
