"""The C++ runtime's functions, `mlc_lora.runtime.*`, bound as module attributes.

src/runtime/registry.cc registers the pool's and the packing functions; cublas_gemm.cc and
nccl_ccl.cc their own.

The unified pool (KV cache + adapter pages):
create_paged_kv_cache(...)                 same arguments as vm.builtin.paged_attention_kv_cache_create
pool_configure_lora(kv, M, R)              once, before loading adapters
pool_keep_lora_columns(kv, RS, SC)         batches within RS rank columns over SC adapters keep their
                                           slots in a fixed column order (the rank columns route)
pool_lora_columns_generation(kv)           counts the changes of those kept columns
pool_load_adapter(kv, id, pages[L,n,E], a_off[M,R], b_off[M,R], rank, scale[M], pin)
                                           -> resident now (else paged in when a batch needs it)
pool_unload_adapter(kv, id)                deferred while sequences use it
pool_pin_adapter(kv, id, pin)
pool_drop_adapter_host(kv, id)             free the host copy of an adapter without pages
pool_set_adapter_host(kv, id, pages, a_off, b_off, rank, scale)   hand it back (same packing)
pool_prefetch_adapter(kv, id, keep, protect)   page in ahead of a batch if room -> resident;
                                           protect: (adapter or -1, n, n tokens) per request: their prefixes stay
pool_resident_adapters(kv)                 ids of the adapters that hold their pages
pool_adapter_pages_to_run(kv, ids)         pages a batch must find for each (0: resident and pinned or in use)
pool_set_sequence_adapter(kv, seq, id)     -1: base model
pool_lora_tables(kv)                       the batch's tables, contract.LORA_TABLE_INPUTS order
pool_lora_num_slots(kv)                    distinct adapters of the batch (0: base model only)
pool_lora_rank_total(kv)                   the sum of their ranks
pool_stats(kv)                             {total,free,kv,adapter,evictable,pinned}_pages, adapter counts,
                                           the prefix cache's pages and counters
pool_admittable_pages(kv)                  free + evictable pages (what a batch can take; per step)
pool_adapter_info(kv, id), pool_sequence_pages(kv, seq), pool_check_invariants(kv)   (tests)
pool_poison_free_pages(kv)                 NaN into every free page (tests: reads of unowned pages show)
pool_prefix_lookup(kv, adapter, tokens)    -> [matched tokens, idle pages among them]; -1: base model
pool_prefix_attach(kv, seq, tokens)        an empty sequence takes its cached prefix; -> matched tokens
pool_prefix_insert(kv, seq, start, tokens) key its full pages; -> keyed pages, -1 once its chain ended
upload_async(dst, host_array)              host -> device without a stream synchronization

Adapter packing (what pool_load_adapter takes; wrapped by mlc_lora.lora):
pack_peft_adapter(folder, compiled_config_json, name, shard)
    -> {pages [L,n,E], a_off, b_off, rank, scale, name, modules, scales, lora_alpha, use_rslora,
        warnings}                          name "": the folder's name
peft_adapter_plan(folder, compiled_config_json)
    -> {name, rank, modules, scales, num_pages, lora_alpha, use_rslora, warnings}   no packing
pack_adapter(spec_json, name, rank, modules, scales{module: s}, [(layer, module, A, B^T)], shard)
    -> {pages, a_off, b_off, rank, scale, name, modules, scales, warnings}   an adapter in memory
adapter_layout(page_elems, names, in_features, out_features, rank, rows, elem_bytes, int8_align)
    -> {num_pages, used_elems, a_off, b_off}   the rows' local offsets, [module][k] flattened

GEMM and tensor parallelism: cublas_gemm(x, w, out), cublas_init(device), cublas_available(),
nccl_version(), disco_set_ccl(name).
"""

import tvm_ffi

from . import errors
from ._lib import load_library

load_library()
# The C++ side throws kinds "PoolExhaustedError" (the pool) and "LoraError" (an adapter folder or
# in-memory adapter the compiled model cannot serve); Python sees mlc_lora.errors' classes.
tvm_ffi.register_error("PoolExhaustedError", errors.PoolExhaustedError)
tvm_ffi.register_error("LoraError", errors.LoraError)
tvm_ffi.init_ffi_api("mlc_lora.runtime", __name__)
