"""AttachSampler: the exported sampling functions (ops/sampler/sampler_tir.py) on the model module.

Only token ids and the logprobs a request asks for go back to the host; the logits stay on the
device.
"""

from __future__ import annotations

import tvm
from tvm import relax

from mlc_lora.contract import SAMPLER_FUNCTIONS, TOP_LOGPROBS_MAX

from ..ops.sampler.sampler_tir import sampler_kernels


@tvm.transform.module_pass(opt_level=0, name="AttachSampler")
class AttachSampler:  # pylint: disable=too-few-public-methods
    """Add the exported sampling functions (argmax, top-k/top-p, logprobs, logit processing) to the
    model module."""

    def __init__(self, target: tvm.target.Target):
        self.gpu = "gpu" in target.keys

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        kernels = sampler_kernels(self.gpu)
        assert set(kernels) == set(SAMPLER_FUNCTIONS), "the contract's sampler functions"
        bb = relax.BlockBuilder(mod)

        def export(name, params, out):
            # fresh symbolic sizes per function: (batch, vocab)
            b, v = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("vocab", "int64")
            n, w = tvm.tirx.Var("pairs", "int64"), tvm.tirx.Var("words", "int64")
            shape = {"b": [b], "bv": [b, v], "bk": [b, TOP_LOGPROBS_MAX], "n": [n], "bw": [b, w]}
            gv = bb.add_func(kernels[name].with_attr("global_symbol", f"{name}_kernel"), f"{name}_kernel")
            args = [relax.Var(n, relax.TensorType(shape[s], dt)) for n, s, dt in params]
            out_ty = [relax.TensorType(shape[s], dt) for s, dt in out]
            out_ty = out_ty[0] if len(out_ty) == 1 else out_ty
            with bb.function(name, args, attrs={"global_symbol": name}):
                with bb.dataflow():
                    out = bb.emit_output(relax.call_tir(gv, args, out_ty))
                bb.emit_func_output(out)

        logits = ("logits", "bv", "float32")
        export("sample_argmax", [logits], [("b", "int32")])
        export("sample_top_p", [logits, ("temperature", "b", "float32"), ("top_p", "b", "float32"),
                                ("top_k", "b", "int32"), ("uniform", "b", "float32")], [("b", "int32")])
        export("chosen_logprobs", [logits, ("tokens", "b", "int32")], [("b", "float32")])
        export("top_logprobs", [logits], [("bk", "int32"), ("bk", "float32")])
        export("process_logits", [logits, ("rows", "n", "int32"), ("tokens", "n", "int32"), ("bias", "n", "float32"),
                                  ("rep", "n", "float32"), ("sub", "n", "float32"), ("mask", "bw", "int32")],
               [("bv", "float32")])
        return bb.get()
