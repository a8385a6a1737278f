"""`mlc_lora compile MODEL -o OUT_DIR [...]`."""

from __future__ import annotations

import argparse

from ..compile import DTYPES, CompileOptions, compile_model
from ..compiler_passes.ops.lora import BACKENDS
from ..contract import LORA_KERNELS, ROW_FORMATS
from . import HelpFormatter


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlc_lora compile", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", help="embedded name (smollm2-135m), Hugging Face folder, or .gguf file")
    p.add_argument("-o", "--output", required=True, help="the folder the compiled model is written to")
    p.add_argument("--target", choices=["llvm", "cuda"], default="llvm", help="llvm: CPU; cuda: NVIDIA GPUs")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="default: float32 for llvm, float16 for cuda")
    p.add_argument("--cuda-arch", default="sm_90a", help="cuda: the GPU architecture the kernels are built for")
    p.add_argument("--context-window-size", type=int, default=None,
                   help="longest sequence in tokens (default: the model's own)")
    p.add_argument("--prefill-chunk-size", type=int, default=2048, help="most tokens in one prefill step")
    p.add_argument("--max-batch-size", type=int, default=64, help="most sequences in one decode step")
    p.add_argument("--gemm", choices=["cublas", "tvm"], default="cublas",
                   help="cuda: base linears on cuBLAS (needs nvidia-cublas, of the cuda extra, where it runs) or TVM kernels")
    p.add_argument("--gemv-max-rows", type=int, default=1, metavar="N",
                   help="cuda: linears of up to N tokens (0-8) on mlc-lora's GEMV kernel, cuBLAS above")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="cuda: do not capture decode in CUDA graphs")
    p.add_argument("--attention", choices=["flash", "tir"], default="flash",
                   help="cuda: paged attention on mlc-lora's tensor-core kernels (fp16/bf16, head_dim "
                        "64/128; other models keep TVM's) or TVM's TIR kernels")
    p.add_argument("--no-rope-append", dest="rope_append", action="store_false",
                   help="cuda, with --attention flash: keep TVM's RoPE and KV append kernels (by default the new "
                        "queries' and keys' RoPE and the append to the KV pages run as one Triton kernel where the "
                        "model's RoPE frequencies are the default ones)")
    p.add_argument("--no-add-norm", dest="add_norm", action="store_false",
                   help="cuda: keep TVM's residual add and RMSNorm kernels (by default each RMSNorm of the hidden "
                        "state and the residual add before it run as one Triton kernel)")
    p.add_argument("--no-bounded-prefill-memory", dest="bounded_prefill_memory", action="store_false",
                   default=None,
                   help="plan prefill's memory per token count; by default a single-device library plans it once "
                        "at --prefill-chunk-size tokens over --max-batch-size sequences (as MLC-LLM does) and "
                        "refuses prefills past them")
    p.add_argument("--lora-pool-pages", type=int, default=0,
                   help="pages of the unified KV/adapter pool the engine makes unless told otherwise (any "
                        "size runs); with --max-lora-rank it enables LoRA")
    p.add_argument("--max-lora-rank", type=int, default=0, help="largest adapter rank served (0: no LoRA)")
    p.add_argument("--lora-target-modules", nargs="+", default=None, metavar="MODULE",
                   help="linears adapters may target (default: q k v o gate up down _proj)")
    p.add_argument("--lora-kernel", choices=LORA_KERNELS, default="gather",
                   help="single: one adapter per batch, dense GEMMs; gather: per-token gather; sgmv: fused shrink+expand")
    p.add_argument("--lora-sgmv-backend", choices=BACKENDS, default="auto",
                   help="who runs the LoRA stage: auto (sgmv on cuda fp16/bf16: triton where Triton is installed, "
                        "else cuda; else TIR), cuda (the CUDA C++ kernels), triton (tensor-core kernels over tokens "
                        "sorted by slot) or tir")
    p.add_argument("--no-lora-fused", dest="lora_fused", action="store_false",
                   help="do not build prefill_fused/decode_fused (sgmv on cuda fp16/bf16: each linear and its LoRA delta "
                        "over the batch's rank columns, run for batches over a few low-rank adapters; limits in the "
                        "compiled config)")
    p.add_argument("--lora-rank-rows", action="store_true",
                   help="with the fused functions: batches past 64 tokens compute the LoRA shrink inside cuBLAS's GEMM "
                        "over each targeted weight and 32 rows per part reserved below it for the batch's A rows "
                        "(the weights grow by those rows)")
    p.add_argument("--no-lora-spare-columns", dest="lora_spare_columns", action="store_const", const=False,
                   default=None,
                   help="with the fused functions: batches past 64 tokens take cuBLAS + a shrink/expand pair "
                        "instead of the rank columns route (by default each targeted weight is stored with "
                        "spare columns for the batch's B rows, and one cuBLAS GEMM over [x | shrink] and them "
                        "gives the output)")
    p.add_argument("--lora-rows", choices=ROW_FORMATS, default="model",
                   help="how the pool stores adapter rows: model (the model dtype) or int8 (int8 values with a "
                        "scale per row: half an fp16 adapter's bytes and pages, lossy; needs --lora-kernel sgmv; "
                        "builds no fused functions)")
    p.add_argument("--tensor-parallel-shards", type=int, default=1, metavar="K",
                   help="split the model over K GPUs (Megatron-style; docs/TP.md)")
    return p


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    opts = CompileOptions(target=a.target, dtype=a.dtype, cuda_arch=a.cuda_arch,
                          context_window_size=a.context_window_size,
                          prefill_chunk_size=a.prefill_chunk_size, max_batch_size=a.max_batch_size,
                          lora_pool_pages=a.lora_pool_pages, max_lora_rank=a.max_lora_rank,
                          lora_target_modules=a.lora_target_modules, lora_kernel=a.lora_kernel,
                          lora_sgmv_backend=a.lora_sgmv_backend, lora_fused=a.lora_fused,
                          lora_rank_rows=a.lora_rank_rows, lora_spare_columns=a.lora_spare_columns,
                          lora_rows=a.lora_rows,
                          gemm=a.gemm, gemv_max_rows=a.gemv_max_rows, cuda_graph=a.cuda_graph, attention=a.attention,
                          rope_append=a.rope_append, add_norm=a.add_norm,
                          bounded_prefill_memory=a.bounded_prefill_memory,
                          tensor_parallel_shards=a.tensor_parallel_shards)
    out = compile_model(a.model, a.output, opts)
    print(f"compiled {a.model} -> {out}")
    return 0
