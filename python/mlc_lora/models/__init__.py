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


def pad_weight(arr, rows: int = 0, cols: int = 0):
    """`arr` (numpy, 2-D where padded) with `rows` zero rows below it and `cols` zero columns beside
    it: a weight as a library with reserved rank rows or columns stores it (the compiled config's
    `param_reserved`: name -> [rows, cols])."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    if not rows and not cols:
        return arr
    out = np.zeros((arr.shape[0] + rows, arr.shape[1] + cols), arr.dtype)
    out[:arr.shape[0], :arr.shape[1]] = arr
    return out
