"""`mlc_lora compile`: a model source -> compiled library + converted weights + one JSON config."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .contract import CONFIG_FILE, PARAMS_FILE, TOKENIZER_FILE, cache_dir, cache_lock, compiled_contract, write_cached
from .errors import CompileError, ModelConfigError
from .loader import ModelSource, resolve_model
from .models import ARCHITECTURES, loader_module, model_module, pad_weight

DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("flash", "tir")


@dataclasses.dataclass
class CompileOptions:  # pylint: disable=too-many-instance-attributes
    """Everything the user can choose at compile time."""

    target: str = "llvm"  # "llvm" or "cuda"
    dtype: str | None = None  # default: float32 on llvm, float16 on cuda
    cuda_arch: str = "sm_90a"
    context_window_size: int | None = None
    prefill_chunk_size: int = 2048
    max_batch_size: int = 64
    gemm: str = "cublas"  # base linears on our runtime GEMM (cuBLAS / CPU) or TVM's kernels ("tvm")
    cuda_graph: bool = True  # cuda only: capture decode in CUDA graphs
    # cuda, gemm "cublas": fp16/bf16 linears of up to this many tokens on our gemv kernel (0: none)
    gemv_max_rows: int = 1
    # cuda only: paged attention on our tensor-core kernels ("flash": fp16/bf16, head_dim 64/128;
    # other models keep TVM's) or on TVM's TIR kernels ("tir")
    attention: str = "flash"
    # cuda only, with attention "flash": the cache's RoPE of q and k and its append of k and v to the
    # pages in one Triton kernel (ops/attention/rope_append_triton.py; models with the default RoPE
    # frequencies; docs/GPU.md)
    rope_append: bool = True
    # cuda only: each RMSNorm of the hidden state, and the residual add that makes its input, in one
    # Triton kernel (ops/norm_triton.py; DispatchNorm, the rank columns route's producer; docs/GPU.md)
    add_norm: bool = True
    # prefill's and embed's memory planned once at their bounds (prefill_chunk_size tokens over
    # max_batch_size sequences, as MLC-LLM plans it) instead of per token count: every prefill
    # allocates the same buffers, which the pooled allocator reuses, so the runner never releases them
    # (on CUDA it would release every cached buffer after 8 new prefill sizes); prefills past the
    # bounds are refused. None: on for single-device libraries (measured faster end to end on a GPU:
    # docs/BENCHMARKS.md), off for sharded ones, whose runner does not check prefills against them
    bounded_prefill_memory: bool | None = None
    # LoRA (off unless max_lora_rank > 0): pages of the unified pool, max rank, targets, kernel stage.
    lora_pool_pages: int = 0
    max_lora_rank: int = 0
    lora_target_modules: list[str] | None = None
    lora_kernel: str = "gather"
    # lora_kernel "sgmv" on cuda fp16/bf16: one shrink and one in-place expand per fused linear, by
    # the Triton tensor-core kernels ("triton"; "auto" with Triton), by our CUDA C++ kernels ("cuda";
    # "auto" without Triton), or the TIR kernels per module ("tir")
    lora_sgmv_backend: str = "auto"
    # lora_kernel "sgmv" on cuda fp16/bf16 with Triton: also build prefill_fused and decode_fused, each
    # linear and its LoRA delta over the batch's rank columns (one kernel for small batches, cuBLAS +
    # a shrink/expand pair above), for batches whose adapters fit them (ops/lora/linear_triton.py)
    lora_fused: bool = True
    # with lora_fused: the fused functions' batches past 64 tokens take the rank rows route (each
    # targeted weight stored with 32 spare rows per part for the batch's A rows, so that cuBLAS's GEMM
    # computes the shrink too; passes/reserve_rank_rows.py) instead of cuBLAS + a shrink/expand pair
    lora_rank_rows: bool = False
    # with lora_fused: each targeted weight stored with 32 spare columns per part beside its own (then
    # zeros to a row of a multiple of 64 elements), for the rank columns route past 64 tokens
    # (passes/reserve_rank_columns.py: the batch's B rows beside W, each token's shrink beside x, one
    # cuBLAS GEMM over both) instead of cuBLAS + a shrink/expand pair; every GEMM over the weight reads
    # its first columns. None: on wherever the fused functions are built with --gemm cublas and
    # without the rank rows route (measured faster than the pair past 64 tokens and equal below:
    # docs/SGMV.md); False: the pair
    lora_spare_columns: bool | None = None
    # how the pool's pages store adapter rows: "model" (the model dtype) or "int8" (int8 values with a
    # float32 scale per row: half an fp16 adapter's bytes and pages, lossy; needs lora_kernel "sgmv" and
    # builds no fused functions; lora/layout.py, docs/SGMV.md "int8 adapter rows")
    lora_rows: str = "model"
    # Megatron-style tensor parallelism over this many GPUs (docs/TP.md).
    tensor_parallel_shards: int = 1

    def __post_init__(self):
        if self.bounded_prefill_memory is None:
            self.bounded_prefill_memory = self.tensor_parallel_shards == 1
        elif self.bounded_prefill_memory and self.tensor_parallel_shards > 1:
            raise CompileError("bounded_prefill_memory is for single-device libraries (the sharded runner does "
                               "not check its prefills against the bounds)")

    def resolved_dtype(self) -> str:
        dtype = self.dtype or ("float32" if self.target == "llvm" else "float16")
        if dtype not in DTYPES:
            raise CompileError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return dtype


def resolve_compiled(model: str | Path, device: str, progress: bool = True, dtype: str | None = None,
                     max_lora_rank: int = 0, lora_pool_pages: int = 0) -> Path:
    """A compiled folder as is; anything else (embedded name, HF folder, .gguf) is compiled once into
    the user's cache directory (with LoRA when `max_lora_rank` and `lora_pool_pages` are given)."""
    path = Path(model)
    if (path / CONFIG_FILE).is_file():
        return path
    target = "llvm" if device == "cpu" else "cuda"
    opts = CompileOptions(target=target, dtype=dtype, max_lora_rank=max_lora_rank, lora_pool_pages=lora_pool_pages)
    lora = f"-lora{max_lora_rank}x{lora_pool_pages}" if max_lora_rank or lora_pool_pages else ""
    out = cache_dir() / f"{path.name if path.exists() else str(model)}-{target}-{opts.resolved_dtype()}{lora}"
    return compile_cached(model, out, opts, progress=progress)


def compile_cached(model: str | Path, out: Path, options: CompileOptions, progress: bool = True) -> Path:
    """The cache entry `out`: `model` compiled with `options`, unless the entry is there already.
    One process builds it (into a temporary sibling, renamed into place); another asking for the
    same entry meanwhile waits for it, then uses it. `out`'s name must tell its model and options."""
    with cache_lock(out):
        if not (out / CONFIG_FILE).is_file():
            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            compile_model(model, tmp, options, progress=progress)
            shutil.rmtree(out, ignore_errors=True)  # what an interrupted compile may have left
            os.replace(tmp, out)
    return out


def make_target(options: CompileOptions):
    import tvm  # pylint: disable=import-outside-toplevel

    if options.target == "llvm":
        return tvm.target.Target("llvm")
    if options.target == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": options.cuda_arch}, host="llvm")
    raise CompileError(f"unsupported target {options.target!r}; choose llvm or cuda")


def compile_model(model: str | Path, output: str | Path, options: CompileOptions | None = None,
                  progress: bool = True) -> Path:
    """Compile `model` (embedded name, HF folder or .gguf) into the folder `output`."""
    options = options or CompileOptions()
    output = Path(output)
    dtype = options.resolved_dtype()
    steps = tqdm(total=4, desc="compile", unit="step", disable=not progress)

    steps.set_postfix_str("reading model")
    source = resolve_model(model)
    cfg, arch = _model_config(source, options)
    arch_module = model_module(arch)
    steps.update()

    lora = lora_spec(cfg, options)
    output.mkdir(parents=True, exist_ok=True)
    # Weights first: a wrong-shaped or missing tensor (the user's input) fails in seconds, not
    # after the library build.
    steps.set_postfix_str("converting weights")
    reserved = weight_reserved(lora, model_module(arch), cfg)
    padded = convert_weights(source, loader_module(arch), cfg, dtype, output / PARAMS_FILE, progress=progress,
                             reserved=reserved)
    steps.update()

    steps.set_postfix_str(f"building library ({options.target})")
    lib_name = f"lib.{options.target}.so"
    param_names = build_library(arch_module, cfg, dtype, options, output / lib_name, lora=lora)
    steps.update()

    steps.set_postfix_str("writing config and tokenizer")
    tokenizer = _write_tokenizer(source, output)
    config = {
        "mlc_lora_version": _version(),
        "model_name": source.name,
        "architecture": arch,
        "model_config": dataclasses.asdict(cfg),
        "dtype": dtype,
        "target": {"kind": options.target, "arch": options.cuda_arch if options.target == "cuda" else None},
        "library": lib_name,
        "params_file": PARAMS_FILE,
        "param_names": param_names,
        # zero rows below / columns beside these weights that the library expects (the rank rows or
        # rank columns route), name -> [rows, cols], for a runtime that converts the weights itself
        "param_reserved": padded,
        "tokenizer": tokenizer,
        "compile_options": dataclasses.asdict(options),
        "lora": lora.to_json() if lora is not None else None,
        # What a runtime in another language must agree on (mlc_lora/contract.py).
        "contract": compiled_contract(),
        # The runtimes (ModelRunner, the C++ engine) start one worker per shard from this.
        "tensor_parallel_shards": cfg.tensor_parallel_shards,
        "compiled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (output / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    steps.update()
    steps.close()
    return output


def _model_config(source: ModelSource, options: CompileOptions):
    archs = source.config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None and source.config.get("model_type") in ("llama", "mistral"):
        arch = "LlamaForCausalLM"
    if arch is None:
        raise ModelConfigError(
            f"unsupported architecture {archs or source.config.get('model_type')!r} in "
            f"{source.name}: mlc-lora supports {', '.join(sorted(ARCHITECTURES))}"
        )
    module = model_module(arch)
    cfg = module.Config.from_dict(
        source.config,
        context_window_size=options.context_window_size,
        prefill_chunk_size=options.prefill_chunk_size,
        max_batch_size=options.max_batch_size,
        tensor_parallel_shards=options.tensor_parallel_shards,
    )
    return cfg, arch


def export_model(arch_module, cfg, dtype: str, target):
    """Export the nn.Module to a Relax IRModule; returns (mod, ordered param names)."""
    import tvm  # pylint: disable=import-outside-toplevel

    with target:
        model = arch_module.Model(cfg)
        model.to(dtype)
        mod, named_params = model.export_tvm(spec=model.get_default_spec())
    del tvm
    return mod, [name for name, _ in named_params]


def lora_spec(cfg, options: CompileOptions):
    """The LoRA part of the compile (a `LoraSpec`), or None when LoRA is off."""
    from .lora.layout import make_spec  # pylint: disable=import-outside-toplevel

    if not options.max_lora_rank and not options.lora_pool_pages:
        return None
    if not options.max_lora_rank or not options.lora_pool_pages:
        raise CompileError("LoRA needs both --max-lora-rank and --lora-pool-pages")
    spec = make_spec(cfg, options.max_lora_rank, options.lora_pool_pages,
                     options.lora_target_modules, options.lora_kernel, options.lora_rows)
    if spec.rows != "model" and (options.lora_rank_rows or options.lora_spare_columns):
        raise CompileError(f"{spec.rows} adapter rows: the fused functions' routes read model-dtype rows "
                           "(no --lora-rank-rows, no spare columns)")
    if (options.lora_fused and spec.rows == "model" and options.target == "cuda" and options.lora_kernel == "sgmv"
            and options.resolved_dtype() in ("float16", "bfloat16") and options.tensor_parallel_shards == 1):
        from .compiler_passes.ops.lora import linear_triton  # pylint: disable=import-outside-toplevel

        if linear_triton.triton is not None:
            cols = options.lora_spare_columns
            if cols is None:  # the default route where it can run
                cols = options.gemm == "cublas" and not options.lora_rank_rows
            spec = dataclasses.replace(spec, fused={
                "rank_columns": linear_triton.RANK_COLUMNS, "slot_columns": linear_triton.SLOT_COLUMNS,
                **({"rank_rows": True} if options.lora_rank_rows else {}),
                **({"spare_columns": True} if cols else {})})
    for on, what in ((options.lora_rank_rows, "--lora-rank-rows"), (options.lora_spare_columns, "spare columns")):
        if on and spec.fused is None:
            raise CompileError(f"{what} is a route of the fused functions, which this compile does not build "
                               "(they need --target cuda, --lora-kernel sgmv, float16/bfloat16, one shard, "
                               "Triton installed and no --no-lora-fused)")
    if options.lora_rank_rows and options.lora_spare_columns:
        raise CompileError("the rank rows and the spare columns routes are alternatives: choose one")
    if options.lora_spare_columns and options.gemm != "cublas":
        raise CompileError("spare columns need --gemm cublas (its GEMMs read a weight's first columns with "
                           "the weight's row stride)")
    return spec


def lora_pass_options(spec, cfg, arch_module, param_names: list[str], backend: str = "auto") -> dict:
    """Keyword arguments of compiler_passes.passes.LoraRewrite for a model compiled with `spec`;
    `backend` picks the implementation of the stage (compiler_passes/ops/lora.BACKENDS)."""
    return {
        "backend": backend,
        "param_names": param_names,
        "modules": [(m.name, m.in_features, m.out_features) for m in spec.modules],
        "linears": arch_module.fused_linear_parts(cfg),
        "num_layers": spec.num_layers,
        "max_rank": spec.max_rank,
        "kernel": spec.kernel,
        "max_slots": cfg.max_batch_size,
        "fused": spec.fused is not None,
        "rows": spec.rows,
        # Symbolic: the pool's size (KV + adapter pages) is chosen when the cache is created.
        "arena_elems": None,
    }


def build_library(arch_module, cfg, dtype: str, options: CompileOptions, lib_path: Path,
                  extra_passes: list | None = None, lora=None) -> list[str]:
    """Export, run our pipeline and build the library at `lib_path`; returns the param order."""
    import tvm  # pylint: disable=import-outside-toplevel

    from .compiler_passes import get_pipeline  # pylint: disable=import-outside-toplevel

    if options.gemm not in ("cublas", "tvm"):
        raise CompileError(f"unsupported gemm {options.gemm!r}; choose cublas or tvm")
    if not 0 <= options.gemv_max_rows <= 8:
        raise CompileError(f"gemv_max_rows must be 0..8 (the gemv kernels' largest token bound), "
                           f"not {options.gemv_max_rows}")
    if options.attention not in ATTENTION_BACKENDS:
        raise CompileError(f"unsupported attention {options.attention!r}; choose one of "
                           f"{', '.join(ATTENTION_BACKENDS)}")
    if options.target == "cuda":
        prepare_cuda_build()
    target = make_target(options)
    mod, param_names = export_model(arch_module, cfg, dtype, target)
    lora_opts = None if lora is None else lora_pass_options(lora, cfg, arch_module, param_names,
                                                            options.lora_sgmv_backend)
    use_graph = options.target == "cuda" and options.cuda_graph
    if use_graph:
        mod = _decode_graph_attrs(mod, options.max_batch_size)
    if options.bounded_prefill_memory:
        mod = _prefill_bound_attrs(mod, cfg.prefill_chunk_size, options.max_batch_size)
    rank_rows = bool(lora is not None and lora.fused and lora.fused.get("rank_rows"))
    spare_columns = bool(lora is not None and lora.fused and lora.fused.get("spare_columns"))
    pipeline = get_pipeline(target, extra_passes=extra_passes, lora=lora_opts, rank_rows=rank_rows,
                            spare_columns=spare_columns, gemm=options.gemm,
                            attention=options.attention, gemv_max_rows=options.gemv_max_rows,
                            default_rope=options.rope_append and getattr(cfg, "rope_scaling_dict", None) == {},
                            add_norm=options.add_norm)
    with target, tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": use_graph}):
        ex = tvm.compile(mod, target, relax_pipeline=pipeline)
        ex.export_library(str(lib_path))
    if options.target == "cuda":
        _check_cubin(lib_path)
    return param_names


def _decode_graph_attrs(mod, max_batch_size: int):
    """RewriteCUDAGraph captures decode only when its batch size is bounded and named capturable."""
    func = mod["decode"].with_attrs({
        "tir_var_upper_bound": {"batch_size": max_batch_size},
        "tir_non_negative_var": ["batch_size"],
        "relax.rewrite_cuda_graph.capture_symbolic_vars": ["batch_size"],
    })
    mod.update_func(mod.get_global_var("decode"), func)
    return mod


def _prefill_bound_attrs(mod, chunk: int, max_batch_size: int):
    """Upper bounds on prefill's and embed's token counts (and prefill's logit rows), from which
    the VM's memory plan sizes their buffers once (the functions LoraRewrite derives from prefill
    keep its attributes). Prefill's logit rows are its sequences' last tokens, or every prompt
    position a request scores (prompt logprobs): at most the chunk's tokens."""
    bounds = {"prefill": {"seq_len": chunk, "batch_size": chunk},
              "embed": {"seq_len": max(chunk, max_batch_size)}}
    for name, ub in bounds.items():
        func = mod[name].with_attrs({"tir_var_upper_bound": ub, "tir_non_negative_var": list(ub)})
        mod.update_func(mod.get_global_var(name), func)
    return mod


def weight_reserved(lora, arch_module, cfg):
    """name -> (rows, cols): the zero rows below and columns beside that weight the compiled library
    expects (the rank rows route's, passes/reserve_rank_rows.py; the rank columns route's,
    passes/reserve_rank_columns.py), (0, 0) for the others."""
    f = (lora.fused or {}) if lora is not None else {}
    axis = 0 if f.get("rank_rows") else 1 if f.get("spare_columns") else None
    if axis is None:
        return lambda name: (0, 0)
    from .compiler_passes.passes.reserve_rank_rows import extra_rows  # pylint: disable=import-outside-toplevel

    mods = [(m.name, m.in_features, m.out_features) for m in lora.modules]
    linears = arch_module.fused_linear_parts(cfg)

    def reserved(name):
        n = extra_rows(name, mods, linears, axis)
        return (n, 0) if axis == 0 else (0, n)
    return reserved


def convert_weights(source: ModelSource, weight_map, cfg, dtype: str, path: Path,
                    progress: bool = True, reserved=lambda name: (0, 0)) -> dict[str, list[int]]:
    """The model's weights in the library's names, dtype and shapes, into one safetensors file;
    `reserved(name)`: (rows, cols) of zeros appended below / beside a weight (weight_reserved).
    Returns those by name (the padded weights only)."""
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

    out: dict[str, np.ndarray] = {}
    padded: dict[str, list[int]] = {}
    it = tqdm(source.weights(), total=source.num_weights, desc="weights", unit="tensor",
              disable=not progress, leave=False)
    for name, arr in weight_map.convert_hf_weights(cfg, it, dtype):
        rows, cols = reserved(name)
        if rows or cols:
            padded[name] = [rows, cols]
        out[name] = pad_weight(arr, rows, cols)
    save_file(out, str(path), metadata={"dtype": dtype})
    return padded


def _write_tokenizer(source: ModelSource, output: Path) -> dict[str, Any]:
    info = {k: v for k, v in source.tokenizer_config.items() if _jsonable(v)}
    if source.tokenizer_json is not None:
        (output / TOKENIZER_FILE).write_text(source.tokenizer_json)
        info["file"] = TOKENIZER_FILE
    return info


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def _version() -> str:
    from importlib.metadata import version  # pylint: disable=import-outside-toplevel

    return version("mlc-lora")


# ---------------------------------------------------------------------------------------------
# CUDA on a machine without a GPU: TVM builds cubin only if libtvm_runtime_cuda.so loads, and that
# needs libcuda.so.1 (the driver) and libcudart.so.13. We give it a stub driver and the toolkit's
# cudart, and make TVM call nvcc instead of NVRTC.


def prepare_cuda_build() -> None:
    import ctypes  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel

    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    if tvm.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    if shutil.which("nvcc") is None:
        raise CompileError("--target cuda needs nvcc (the CUDA toolkit) on PATH to build cubin")
    cuda_home = Path(shutil.which("nvcc")).resolve().parent.parent
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        ctypes.CDLL(str(_cuda_stub()), mode=ctypes.RTLD_GLOBAL)
    for cand in [cuda_home / "lib64" / "libcudart.so.13", cuda_home / "lib" / "libcudart.so.13"]:
        if cand.exists():
            ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
            break
    tvm_lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    try:
        ctypes.CDLL(str(tvm_lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise CompileError(f"cannot load {tvm_lib} to build CUDA code: {e}") from e
    if tvm.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is None:
        raise CompileError("TVM's CUDA runtime did not register; cannot emit cubin")


def _cuda_stub() -> Path:
    """Build (once, in the cache) the stand-in libcuda.so.1 from _CUDA_STUB_C below."""
    cache = cache_dir()
    out = cache / "cuda_stub" / "libcuda.so.1"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "cuda_stub.c", Path(tmp) / out.name
        src.write_text(_CUDA_STUB_C)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)],
                       check=True, capture_output=True)
        write_cached(out, lib.read_bytes())
    return out


# libtvm_runtime_cuda.so imports these driver symbols; TVM never calls them while it builds, so
# each reports CUDA_ERROR_NO_DEVICE (100).
_CUDA_STUB_C = "\n".join(
    f"int {name}(void) {{ return 100; }}"
    for name in ("cuDeviceGetName", "cuFuncSetAttribute", "cuGetErrorName", "cuGetErrorString",
                 "cuLaunchKernelEx", "cuModuleGetFunction", "cuModuleLoadData", "cuModuleUnload",
                 "cuTensorMapEncodeTiled")
) + "\n"


def _check_cubin(lib_path: Path) -> None:
    """A cuda build that fell back to CUDA source cannot load on a runtime-only TVM: refuse it."""
    data = lib_path.read_bytes()
    if b".nv.info" not in data or b"__global__" in data:
        raise CompileError(f"{lib_path} holds no cubin; the CUDA build fell back to source code")
