"""Shared by the attention tests: a tiny llvm model whose pool cache calls numpy stand-ins of our
kernels (registered global functions) through the ["mlc_lora", f] contract, run in lockstep with the
same model on TVM's kernels."""

from __future__ import annotations

import shutil

import numpy as np
import tvm
from tvm import relax

from mlc_lora.compile import CompileOptions, export_model, make_target
from mlc_lora.compiler_passes.passes.dispatch_attention import BACKEND
from mlc_lora.compiler_passes.passes.dispatch_kv_cache import POOL_CREATE, STOCK_CREATE
from mlc_lora.models import llama
from mlc_lora.runner import ModelRunner


def use_stand_ins(funcs: dict[int, str]):
    """A module pass: the cache constructor's argument at each position (its C++ index, after the
    callee) -> ("mlc_lora", ExternFunc(name))."""

    @tvm.transform.module_pass(opt_level=0, name="UseStandIns")
    def transform(mod, _ctx):
        @relax.expr_functor.mutator
        class _M(relax.PyExprMutator):
            def visit_call_(self, call):  # pylint: disable=arguments-renamed
                call = self.visit_expr_post_order(call)
                if call.args and isinstance(call.args[0], relax.ExternFunc) and \
                        call.args[0].global_symbol in (POOL_CREATE, STOCK_CREATE):
                    args = list(call.args)
                    for pos, name in funcs.items():
                        args[pos + 1] = tvm.ir.Tuple([tvm.ir.StringImm(BACKEND), relax.ExternFunc(name)])
                    return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)
                return call

        m = _M(mod)
        for gv, f in mod.functions_items():
            if isinstance(f, relax.Function):
                m.builder_.update_func(gv, m.visit_expr(f))
        return m.builder_.get()

    return transform


class Lockstep:
    """`ref` (the tiny model of `base_dir` on TVM's kernels) and `run` (the same model compiled with
    `stand_ins` passed to use_stand_ins), each with a pool of 3 sequences; `step` feeds both the same
    random tokens and compares their logits."""

    def __init__(self, base_dir, tmp_path, stand_ins: dict[int, str], seed: int):
        from mlc_lora.compiler_passes import get_pipeline  # pylint: disable=import-outside-toplevel

        self.ref = ModelRunner(base_dir)
        ours = tmp_path / "ours"
        shutil.copytree(base_dir, ours)
        target = make_target(CompileOptions())
        mod, _ = export_model(llama, llama.LlamaConfig(**self.ref.model_config), self.ref.dtype, target)
        with target:
            ex = tvm.compile(mod, target, relax_pipeline=get_pipeline(target, extra_passes=[use_stand_ins(stand_ins)]))
        ex.export_library(str(ours / self.ref.config["library"]))
        self.run = ModelRunner(ours)
        self.rng = np.random.default_rng(seed)
        self.kv_a, self.kv_b = self.ref.create_pool(8, 1024, 256), self.run.create_pool(8, 1024, 256)
        for s in range(3):
            self.kv_a.add_sequence(s)
            self.kv_b.add_sequence(s)

    def step(self, seqs, lens) -> None:
        """A prefill of `lens` tokens for `seqs` (a decode where every one is 1) on both, logits equal."""
        ref, run = self.ref, self.run
        toks = [self.rng.integers(0, ref.vocab_size, n).tolist() for n in lens]
        if all(n == 1 for n in lens):
            a = ref.decode(self.kv_a, seqs, [t[0] for t in toks]).numpy()
            b = run.decode(self.kv_b, seqs, [t[0] for t in toks]).numpy()
        else:
            a = ref.prefill(self.kv_a, seqs, toks).numpy()
            b = run.prefill(self.kv_b, seqs, toks).numpy()
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
