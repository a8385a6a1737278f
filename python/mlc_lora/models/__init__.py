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
