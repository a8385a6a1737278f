/*!
 * \file registry.cc
 * \brief The `mlc_lora.runtime.*` functions of the unified pool and of adapter packing, in one
 *        place (python/mlc_lora/_ffi_api.py is their Python index). cublas_gemm.cc and
 *        nccl_ccl.cc register their own (they also build alone, as tvm-ffi extensions).
 *
 * Errors: the pool raises ValueError or PoolExhaustedError; packing raises LoraError (an adapter
 * the compiled model cannot serve, or a malformed adapter folder). Python maps both kinds to
 * mlc_lora.errors with tvm_ffi.register_error.
 */
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <map>
#include <sstream>
#include <string>
#include <utility>

#include "lora_layout.h"
#include "mlc_lora/error.h"
#include "peft_adapter.h"
#include "tensor_util.h"
#include "unified_kv_cache.h"

namespace mlc_lora {
namespace {

namespace ffi = tvm::ffi;
using tvm::runtime::Tensor;
using Ref = const ffi::ObjectRef&;

UnifiedKVCacheObj* Pool(Ref kv) {
  auto* p = const_cast<UnifiedKVCacheObj*>(kv.as<UnifiedKVCacheObj>());
  if (p == nullptr) {
    TVM_FFI_THROW(ValueError) << "not an mlc-lora KV cache (" << kv->GetTypeKey()
                              << "); compile the model with the DispatchKVCache pass";
  }
  return p;
}

void UploadAsyncFn(Tensor dst, ffi::TensorView src) {
  // host array -> device tensor of the same size, without a stream synchronization
  if (src.device().device_type != kDLCPU || !src.IsContiguous()) {
    TVM_FFI_THROW(ValueError) << "upload_async takes a contiguous host array";
  }
  int64_t n = 1;
  for (int64_t i = 0; i < src.ndim(); ++i) n *= src.size(i);
  const int64_t bytes = n * Bytes(src.dtype());
  if (bytes != tvm::ffi::GetDataSize(*dst.operator->()) || src.dtype() != dst->dtype) {
    TVM_FFI_THROW(ValueError) << "upload_async: " << src.dtype() << src.shape() << " does not fit "
                              << dst->dtype << dst.Shape();
  }
  UploadAsync(dst, HostData<char>(src), bytes);
}

// ------------------------------------------------------------------------------- adapter packing

/*! \brief Run packing code; an mlc_lora::Error becomes a LoraError (mlc_lora.errors.LoraError). */
template <typename F>
auto LoraGuard(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    TVM_FFI_THROW(LoraError) << e.what();
  } catch (const std::exception& e) {  // a case no check foresaw: still the caller's adapter
    TVM_FFI_THROW(LoraError) << "malformed adapter: " << e.what();
  }
}

LoraSpec SpecOf(const std::string& config_json) {
  return LoraSpec::FromConfig(JSON::Parse(config_json, "the compiled config"));
}

ffi::Array<ffi::String> Strings(const std::vector<std::string>& v) {
  ffi::Array<ffi::String> out;
  for (const std::string& s : v) out.push_back(s);
  return out;
}

ffi::Map<ffi::String, double> Scales(const std::map<std::string, double>& s) {
  ffi::Map<ffi::String, double> out;
  for (const auto& [k, v] : s) out.Set(k, v);
  return out;
}

ffi::Map<ffi::String, ffi::Any> ToFFI(const PackedAdapter& p) {
  return {{"pages", p.pages},       {"a_off", p.a_off},       {"b_off", p.b_off},
          {"scale", p.scale},       {"rank", p.rank},         {"name", ffi::String(p.name)},
          {"modules", Strings(p.modules)}, {"scales", Scales(p.scales)},
          {"warnings", Strings(p.warnings)}};
}

/*! \brief What a PEFT folder shows besides its pages. */
void AddPeftInfo(const PeftAdapter& a, ffi::Map<ffi::String, ffi::Any>* out) {
  out->Set("lora_alpha", a.lora_alpha);
  out->Set("use_rslora", a.use_rslora);
}

ffi::Map<ffi::String, ffi::Any> PackPeftAdapterFn(const ffi::String& folder,
                                                  const ffi::String& config_json,
                                                  const ffi::String& name, int64_t shard) {
  return LoraGuard([&] {
    LoraSpec spec = SpecOf(config_json);
    PeftAdapter a = ReadPeftAdapter(folder, spec, name);
    auto out = ToFFI(PackPeftAdapter(a, spec, shard));
    AddPeftInfo(a, &out);
    return out;
  });
}

ffi::Map<ffi::String, ffi::Any> PeftAdapterPlanFn(const ffi::String& folder,
                                                  const ffi::String& config_json) {
  return LoraGuard([&] {
    LoraSpec spec = SpecOf(config_json);
    PeftAdapter a = ReadPeftAdapter(folder, spec);
    ffi::Map<ffi::String, ffi::Any> out{{"name", ffi::String(a.name)},
                                        {"rank", a.rank},
                                        {"modules", Strings(a.modules)},
                                        {"scales", Scales(a.scales)},
                                        {"num_pages", a.num_pages},
                                        {"warnings", Strings(a.warnings)}};
    AddPeftInfo(a, &out);
    return out;
  });
}

/*! \brief An adapter given as (layer, module, A (rank, in), B^T (rank, out)) float32 arrays. */
class MemoryRows : public AdapterRows {
 public:
  MemoryRows(const LoraSpec& spec, int64_t rank, const ffi::Array<ffi::Any>& entries) {
    for (const ffi::Any& e : entries) {
      auto t = e.cast<ffi::Array<ffi::Any>>();
      if (t.size() != 4) {
        throw InvalidArgument("adapter weights are (layer, module, A, B^T) entries, got one of " +
                              std::to_string(t.size()) + " items");
      }
      Entry w{t[2].cast<ffi::Tensor>(), t[3].cast<ffi::Tensor>()};
      const int64_t layer = t[0].cast<int64_t>();
      const std::string module = t[1].cast<ffi::String>();
      const int64_t mi = spec.Index(module);
      if (mi < 0) continue;  // PackAdapter refuses modules that were not compiled, by name
      if (layer < 0 || layer >= spec.num_layers) {
        throw InvalidArgument("adapter weights of layer " + std::to_string(layer) + " " + module +
                              ": the model has " + std::to_string(spec.num_layers) + " layers");
      }
      const auto [in, out] = spec.FullShape(spec.modules[mi]);
      Check(w.a, rank, in, "A", layer, module);
      Check(w.bt, rank, out, "B^T", layer, module);
      rows_[{layer, module}] = std::move(w);
    }
  }
  bool Has(int64_t layer, const std::string& module) const final {
    return rows_.count({layer, module}) != 0;
  }
  void Row(int64_t layer, const std::string& module, bool b, int64_t k, float* out) const final {
    const Entry& w = rows_.at({layer, module});
    const ffi::Tensor& t = b ? w.bt : w.a;
    const int64_t n = t.size(1);
    const float* src = reinterpret_cast<const float*>(static_cast<const char*>(t.data_ptr()) +
                                                      t.byte_offset()) + k * n;
    std::copy(src, src + n, out);
  }

 private:
  struct Entry {
    ffi::Tensor a, bt;
  };
  static void Check(const ffi::Tensor& t, int64_t rank, int64_t n, const char* what, int64_t layer,
                    const std::string& module) {
    if (t.device().device_type != kDLCPU || !t.IsContiguous() ||
        t.dtype() != DLDataType{kDLFloat, 32, 1} || t.ndim() != 2 || t.size(0) != rank ||
        t.size(1) != n) {
      std::ostringstream os;
      os << what << " of layer " << layer << " " << module << " must be a contiguous float32 host array ("
         << rank << ", " << n << "), got " << t.dtype() << t.shape();
      throw InvalidArgument(os.str());
    }
  }
  std::map<std::pair<int64_t, std::string>, Entry> rows_;
};

ffi::Map<ffi::String, ffi::Any> PackAdapterFn(const ffi::String& spec_json, const ffi::String& name,
                                              int64_t rank, const ffi::Array<ffi::String>& modules,
                                              const ffi::Map<ffi::String, double>& scales,
                                              const ffi::Array<ffi::Any>& entries, int64_t shard) {
  return LoraGuard([&] {
    LoraSpec spec = SpecOf(spec_json);
    std::vector<std::string> mods(modules.begin(), modules.end());
    std::map<std::string, double> sc;
    for (const auto& [k, v] : scales) sc[k] = v;
    return ToFFI(PackAdapter(spec, name, rank, mods, sc, MemoryRows(spec, rank, entries), shard));
  });
}

ffi::Map<ffi::String, ffi::Any> AdapterLayoutFn(int64_t page_elems,
                                                const ffi::Array<ffi::String>& names,
                                                const ffi::Shape& in_features,
                                                const ffi::Shape& out_features, int64_t rank,
                                                const ffi::String& rows, int64_t elem_bytes,
                                                int64_t int8_align) {
  return LoraGuard([&] {
    if (names.size() != in_features.size() || names.size() != out_features.size()) {
      throw InvalidArgument("adapter_layout needs one name, in and out size per module");
    }
    std::vector<LoraModule> mods;
    for (size_t i = 0; i < names.size(); ++i) {
      mods.push_back({names[i], in_features[i], out_features[i]});
    }
    AdapterLayout lay = LayoutAdapter(page_elems, mods, rank, RowFormat::Of(rows, elem_bytes, int8_align));
    return ffi::Map<ffi::String, ffi::Any>{
        {"num_pages", lay.num_pages},
        {"used_elems", lay.used_elems},
        {"a_off", ffi::Shape(lay.a_off.begin(), lay.a_off.end())},
        {"b_off", ffi::Shape(lay.b_off.begin(), lay.b_off.end())}};
  });
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::ObjectDef<UnifiedKVCacheObj>();
  refl::GlobalDef()
      // the unified pool: KV cache + adapter pages (unified_kv_cache.h, adapter_store.h)
      .def_packed("mlc_lora.runtime.create_paged_kv_cache", CreateUnifiedKVCache)
      .def("mlc_lora.runtime.pool_configure_lora",
           [](Ref kv, int64_t m, int64_t r) { Pool(kv)->adapters().Configure(m, r); })
      .def("mlc_lora.runtime.pool_keep_lora_columns",
           [](Ref kv, int64_t rank_columns, int64_t slot_columns) {
             Pool(kv)->adapters().CheckConfigured();
             Pool(kv)->adapters().KeepColumns(rank_columns, slot_columns);
           })
      .def("mlc_lora.runtime.pool_lora_columns_generation",
           [](Ref kv) { return Pool(kv)->adapters().columns_generation(); })
      .def("mlc_lora.runtime.pool_load_adapter",
           [](Ref kv, int64_t id, ffi::TensorView pages, ffi::TensorView a_off,
              ffi::TensorView b_off, int64_t rank, ffi::TensorView scale, bool pin) {
             return Pool(kv)->adapters().Load(id, pages, a_off, b_off, rank, scale, pin);
           })
      .def("mlc_lora.runtime.pool_set_adapter_host",
           [](Ref kv, int64_t id, ffi::TensorView pages, ffi::TensorView a_off,
              ffi::TensorView b_off, int64_t rank, ffi::TensorView scale) {
             Pool(kv)->adapters().SetHost(id, pages, a_off, b_off, rank, scale);
           })
      .def("mlc_lora.runtime.pool_drop_adapter_host",
           [](Ref kv, int64_t id) { Pool(kv)->adapters().DropHost(id); })
      .def("mlc_lora.runtime.pool_prefetch_adapter",
           // protect: (adapter or -1, n, n token ids) per waiting request whose cached prefix stays
           [](Ref kv, int64_t id, const ffi::Shape& keep, const ffi::Shape& protect) {
             std::vector<std::pair<int64_t, std::vector<int32_t>>> chains;
             for (size_t i = 0; i < protect.size();) {
               if (i + 2 > protect.size() || protect[i + 1] < 0 ||
                   static_cast<size_t>(protect[i + 1]) > protect.size() - i - 2) {
                 TVM_FFI_THROW(ValueError) << "pool_prefetch_adapter: protect is (adapter, n, n tokens) "
                                              "per request; entry at " << i << " is cut short";
               }
               auto first = protect.begin() + i + 2;
               chains.emplace_back(protect[i], std::vector<int32_t>(first, first + protect[i + 1]));
               i += 2 + protect[i + 1];
             }
             return Pool(kv)->adapters().Prefetch(id, std::vector<int64_t>(keep.begin(), keep.end()), chains);
           })
      .def("mlc_lora.runtime.pool_resident_adapters",
           [](Ref kv) {
             std::vector<int64_t> ids = Pool(kv)->adapters().Resident();
             return ffi::Shape(ids.begin(), ids.end());
           })
      .def("mlc_lora.runtime.pool_unload_adapter",
           [](Ref kv, int64_t id) { Pool(kv)->adapters().Unload(id); })
      .def("mlc_lora.runtime.pool_pin_adapter",
           [](Ref kv, int64_t id, bool pin) { Pool(kv)->adapters().Pin(id, pin); })
      .def("mlc_lora.runtime.pool_set_sequence_adapter",
           [](Ref kv, int64_t seq, int64_t adapter) {
             Pool(kv)->adapters().SetSequenceAdapter(seq, adapter);
           })
      .def("mlc_lora.runtime.pool_lora_tables", [](Ref kv) { return Pool(kv)->LoraTables(); })
      .def("mlc_lora.runtime.pool_lora_graph_tables",
           [](Ref kv) { return Pool(kv)->LoraGraphTables(); })
      .def("mlc_lora.runtime.pool_lora_num_slots", [](Ref kv) { return Pool(kv)->LoraNumSlots(); })
      .def("mlc_lora.runtime.pool_lora_rank_total", [](Ref kv) { return Pool(kv)->LoraRankTotal(); })
      .def("mlc_lora.runtime.pool_stats", [](Ref kv) { return Pool(kv)->Stats(); })
      .def("mlc_lora.runtime.pool_admittable_pages",
           [](Ref kv) { return Pool(kv)->AdmittablePages(); })
      .def("mlc_lora.runtime.pool_adapter_info",
           [](Ref kv, int64_t id) { return Pool(kv)->adapters().Info(id); })
      .def("mlc_lora.runtime.pool_adapter_pages_to_run",
           [](Ref kv, const ffi::Shape& ids) {
             std::vector<int64_t> v = Pool(kv)->adapters().PagesToRun({ids.begin(), ids.end()});
             return ffi::Shape(v.begin(), v.end());
           })
      .def("mlc_lora.runtime.pool_sequence_pages",
           [](Ref kv, int64_t seq) { return Pool(kv)->SequencePages(seq); })
      .def("mlc_lora.runtime.pool_check_invariants", [](Ref kv) { Pool(kv)->CheckInvariants(); })
      .def("mlc_lora.runtime.pool_poison_free_pages", [](Ref kv) { Pool(kv)->PoisonFreePages(); })
      // the prefix cache: full KV pages keyed by (adapter, token chain) (page_pool.h)
      .def("mlc_lora.runtime.pool_prefix_lookup",
           [](Ref kv, int64_t adapter, ffi::Shape tokens) {
             return Pool(kv)->PrefixLookup(adapter, tokens);
           })
      .def("mlc_lora.runtime.pool_prefix_attach",
           [](Ref kv, int64_t seq, ffi::Shape tokens) { return Pool(kv)->PrefixAttach(seq, tokens); })
      .def("mlc_lora.runtime.pool_prefix_insert",
           [](Ref kv, int64_t seq, int64_t start, ffi::Shape tokens) {
             return Pool(kv)->PrefixInsert(seq, start, tokens);
           })
      .def("mlc_lora.runtime.upload_async", UploadAsyncFn)
      // adapter packing (lora_layout.h, peft_adapter.h)
      .def("mlc_lora.runtime.pack_peft_adapter", PackPeftAdapterFn)
      .def("mlc_lora.runtime.peft_adapter_plan", PeftAdapterPlanFn)
      .def("mlc_lora.runtime.pack_adapter", PackAdapterFn)
      .def("mlc_lora.runtime.adapter_layout", AdapterLayoutFn);
}

}  // namespace mlc_lora
