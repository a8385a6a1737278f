"""Model architectures: one file each (config dataclass + modules + export spec + weight map)."""

from . import llama

# architecture name in config.json -> the module that implements it
MODELS = {arch: llama for arch in llama.ARCHITECTURES}
