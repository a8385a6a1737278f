"""The C++ runtime's functions, `mlc_lora.runtime.*`, bound as module attributes.

create_paged_kv_cache(...)                 same arguments as vm.builtin.paged_attention_kv_cache_create
pool_configure_lora(kv, M, R)              once, before loading adapters
pool_load_adapter(kv, id, pages[L,n,E], a_off[M,R], b_off[M,R], rank, scale[M], pin)
pool_unload_adapter(kv, id)                deferred while sequences use it
pool_pin_adapter(kv, id, pin)
pool_set_sequence_adapter(kv, seq, id)     -1: base model
pool_lora_tables(kv)                       [arena, token_slot, rank, scale, a_off, b_off] of the batch
pool_stats(kv)                             {total,free,kv,adapter,evictable}_pages, adapter counts
pool_adapter_info(kv, id), pool_sequence_pages(kv, seq), pool_check_invariants(kv)   (tests)
"""

import tvm_ffi

from . import errors
from ._lib import load_library

load_library()
# The C++ side throws kind "PoolExhaustedError"; Python sees mlc_lora.errors.PoolExhaustedError.
tvm_ffi.register_error("PoolExhaustedError", errors.PoolExhaustedError)
tvm_ffi.init_ffi_api("mlc_lora.runtime", __name__)
