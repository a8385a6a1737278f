"""Relax passes of mlc-lora and the TIR kernels they insert.

Imported as ``mlc_lora.compiler_passes``. Nothing here imports the engine: the compile step of
``mlc_lora`` calls into this package, never the other way round.
"""

from .pipeline import get_pipeline

__all__ = ["get_pipeline"]
