"""Model architectures: one file each (config dataclass + modules + export spec), plus a
numpy-only `<arch>_loader.py` with the Hugging Face weight map."""

import importlib

# architecture name in config.json -> the model file that implements it
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"}


def model_module(arch: str):
    """The model file (imports TVM's Relax frontend)."""
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[arch]}")


def loader_module(arch: str):
    """The weight map of the model (numpy only)."""
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[arch]}_loader")


def pad_rows(arr, rows: int):
    """`arr` (numpy) with `rows` zero rows below it: a weight as a library with rank rows stores it
    (the compiled config's `param_extra_rows`)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    return np.concatenate([arr, np.zeros((rows, *arr.shape[1:]), arr.dtype)]) if rows else arr
