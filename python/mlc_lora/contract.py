"""The contract between the compiler, the C++ runtime and the engine, written once.

Every constant that more than one part of mlc-lora must agree on lives here and nowhere else:
the page size of the unified pool, the names and order of the LoRA table inputs of the compiled
functions, the Llama linears LoRA can target, the kernel stages, the compiled folder's file names,
the cache directory and the environment of NCCL processes.

How each side reads it:
- Python (compiler passes, models, runner, engine, server) imports this module.
- The compiled model folder records what a runtime needs in the "contract" block of its
  mlc-lora-config.json (`compiled_contract()`); the C++ embedding API reads it from there.
- The name of that config file itself cannot come from the config: CMake reads `CONFIG_FILE` from
  this file with `runpy` (which is why it imports nothing but the standard library).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# --- the compiled model folder ------------------------------------------------------------------
CONFIG_FILE = "mlc-lora-config.json"
PARAMS_FILE = "params.safetensors"
TOKENIZER_FILE = "tokenizer.json"

# --- the unified page pool ----------------------------------------------------------------------
# Tokens per KV page. One page id is one KV page of every layer, or a share of one adapter's rows
# in every layer; the attention, append and copy kernels are compiled for this size.
PAGE_SIZE = 16

# --- LoRA ---------------------------------------------------------------------------------------
# The Llama linears an adapter may target, in canonical order: module index m of the tables.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Under tensor parallelism these are split by output rows; the others by input columns.
COLUMN_PARALLEL_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# The per-batch inputs the LoRA pass adds to prefill/decode, in order (docs/DESIGN.md). The last
# two sort the batch's tokens by slot: lora_token_order (n,) lists the tokens slot by slot (base-model
# tokens last) and slot s owns positions lora_slot_start[s] .. lora_slot_start[s + 1] of it; the
# table has one entry per slot the pool can hold plus one, unused slots own no position.
LORA_TABLE_INPUTS = ("lora_arena", "lora_token_slot", "lora_rank", "lora_scale", "lora_a_off", "lora_b_off",
                     "lora_token_order", "lora_slot_start")
# A model compiled with LoRA also exports its prefill and decode without the LoRA inputs under these
# suffixed names: batches in which no token has an adapter run them (no LoRA kernels at all).
BASE_FUNCTION_SUFFIX = "_base"
# ... and, on CUDA, each with every linear computing its LoRA delta over the batch's rank columns
# (ops/lora/linear_triton.py) under this name: batches within their limits (the config's lora
# "fused") run them.
FUSED_FUNCTION_SUFFIX = "_fused"
# ... and where their weights hold spare columns (the rank columns route: the config's lora "fused"
# has "spare_columns"), this function (the LoRA tables, the params) fills those columns with the
# B rows of the tables' slots; the runner calls it when the pool's kept columns change.
FILL_COLUMNS_FUNCTION = "lora_fill_columns"
# Kernel stages: "single" (one adapter per batch), "gather" (per token), "sgmv" (token tiles).
LORA_KERNELS = ("single", "gather", "sgmv")
# How the pool's pages may store adapter rows: in the model dtype, or as int8 values with a float32
# scale per row: the scale in the INT8_ROW_ALIGN bytes before a row's values (the rest zero), the
# values padded to a multiple of them; a row's offset points at its first value (lora/layout.py, the
# runtime's RowFormat, the kernels that read the scale there).
ROW_FORMATS = ("model", "int8")
INT8_ROW_ALIGN = 16

# --- sampling -----------------------------------------------------------------------------------
# The compiled sampling functions, and the columns of `top_logprobs` (OpenAI's limit).
SAMPLER_FUNCTIONS = ("sample_argmax", "sample_top_p", "chosen_logprobs", "top_logprobs", "process_logits")
TOP_LOGPROBS_MAX = 20

# --- processes ----------------------------------------------------------------------------------
# Set in every process that may start NCCL: NVLink multicast (NVLS) collectives stay off.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


def cache_dir() -> Path:
    """Where compiled models and built kernels are cached: $MLC_LORA_CACHE or ~/.cache/mlc_lora.
    Several processes may share it (two servers starting, parallel tests): entries are written with
    `write_cached` and built under `cache_lock`, so no process reads another's half-written entry."""
    return Path(os.environ.get("MLC_LORA_CACHE", Path.home() / ".cache" / "mlc_lora"))


def write_cached(path: Path, data: bytes | str) -> None:
    """Write a cache entry whole: into a sibling temporary file, then renamed over `path` (readers
    see the old entry, none, or the new one; never a part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def cache_lock(path: Path):
    """Hold an exclusive lock on `path`'s entry (the file `path` + ".lock", across processes) while
    one process checks and builds it; others wait, then find it built."""
    import fcntl  # pylint: disable=import-outside-toplevel  (POSIX)

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def set_nccl_env(overwrite: bool = False) -> None:
    """Put NCCL_ENV into this process's environment (before NCCL starts)."""
    for key, value in NCCL_ENV.items():
        if overwrite:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)


def compiled_contract() -> dict:
    """The "contract" block of mlc-lora-config.json: what a runtime of another language needs."""
    return {
        "page_size": PAGE_SIZE,
        "lora_modules": list(LORA_MODULES),
        "column_parallel_modules": list(COLUMN_PARALLEL_MODULES),
        "lora_table_inputs": list(LORA_TABLE_INPUTS),
        "base_function_suffix": BASE_FUNCTION_SUFFIX,
        "fused_function_suffix": FUSED_FUNCTION_SUFFIX,
        "fill_columns_function": FILL_COLUMNS_FUNCTION,
        "lora_kernels": list(LORA_KERNELS),
        "row_formats": list(ROW_FORMATS),
        "int8_row_align": INT8_ROW_ALIGN,
        "sampler_functions": list(SAMPLER_FUNCTIONS),
        "top_logprobs_max": TOP_LOGPROBS_MAX,
    }
