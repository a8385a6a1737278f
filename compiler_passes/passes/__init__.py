"""The Relax passes of mlc-lora, one per file; pipeline.py lists them in the order they run."""

from .attach_sampler import AttachSampler
from .dispatch_activation import DispatchActivation
from .dispatch_attention import DispatchAttention
from .dispatch_cublas import DispatchCublas
from .dispatch_kv_cache import DispatchKVCache
from .dispatch_norm import DispatchNorm
from .lora_rewrite import LoraRewrite
from .reserve_rank_columns import ReserveRankColumns
from .reserve_rank_rows import ReserveRankRows

__all__ = ["AttachSampler", "DispatchActivation", "DispatchAttention", "DispatchCublas", "DispatchKVCache",
           "DispatchNorm", "LoraRewrite", "ReserveRankColumns", "ReserveRankRows"]
