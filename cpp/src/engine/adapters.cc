/*!
 * \file adapters.cc
 * \brief PEFT adapters of the C++ engine: read and packed by the runtime (src/runtime
 *        peft_adapter.h, the implementation Python uses too) and loaded into the unified pool.
 */
#include <tvm/ffi/error.h>

#include <iostream>

#include "engine/engine_impl.h"
#include "peft_adapter.h"

namespace mlc_lora {

namespace ffi = tvm::ffi;

void Engine::Impl::ConfigureLora() {
  using detail::Global;
  Global("mlc_lora.runtime.pool_configure_lora")(kv, static_cast<int64_t>(lora_spec.modules.size()),
                                                 lora_spec.max_rank);
  pool_load = Global("mlc_lora.runtime.pool_load_adapter");
  pool_unload = Global("mlc_lora.runtime.pool_unload_adapter");
  pool_pin = Global("mlc_lora.runtime.pool_pin_adapter");
  pool_set_seq = Global("mlc_lora.runtime.pool_set_sequence_adapter");
  pool_tables = Global("mlc_lora.runtime.pool_lora_tables");
  pool_graph_tables = Global("mlc_lora.runtime.pool_lora_graph_tables");
  pool_info = Global("mlc_lora.runtime.pool_adapter_info");
}

int64_t Engine::Impl::PoolStat(const char* key) const {
  return pool_stats(kv).cast<ffi::Map<ffi::String, int64_t>>().at(key);
}

int64_t Engine::Impl::AdapterStat(int64_t id, const char* key) const {
  ffi::Any v = pool_info(kv, id).cast<ffi::Map<ffi::String, ffi::Any>>().at(key);
  return v.type_index() == kTVMFFIBool ? int64_t{v.cast<bool>()} : v.cast<int64_t>();
}

std::string Engine::Impl::UnknownAdapter(const std::string& name) const {
  if (!lora) {
    return "unknown adapter '" + name + "': '" + model_dir +
           "' was compiled without LoRA (recompile with --max-lora-rank and --lora-pool-pages)";
  }
  std::string loaded;
  for (const auto& [n, id] : adapters) loaded += (loaded.empty() ? "" : ", ") + n;
  return "unknown adapter '" + name + "' (loaded: " + (loaded.empty() ? "none" : loaded) + ")";
}

bool Engine::adapters_available() const { return impl_->lora; }

void Engine::LoadAdapter(const std::string& name, const std::string& peft_dir) {
  Impl& m = *impl_;
  if (name.empty()) throw InvalidArgument("an adapter needs a non-empty name");
  if (!m.lora) {
    throw NotAvailable("cannot load adapter '" + name + "': '" + m.model_dir +
                       "' was compiled without LoRA (recompile with --max-lora-rank and --lora-pool-pages)");
  }
  if (m.adapters.count(name)) throw InvalidArgument("an adapter named '" + name + "' is already loaded");
  PackedAdapter p;
  try {
    p = PackPeftAdapter(ReadPeftAdapter(peft_dir, m.lora_spec, name), m.lora_spec);
  } catch (const Error& e) {
    std::string msg = "cannot load adapter '" + name + "': " + e.what();
    if (dynamic_cast<const ModelError*>(&e)) throw ModelError(msg);
    if (dynamic_cast<const NotAvailable*>(&e)) throw NotAvailable(msg);
    throw InvalidArgument(msg);
  }
  for (const std::string& w : p.warnings) std::cerr << "mlc-lora: warning: " << w << "\n";
  int64_t id = m.next_adapter_id;
  try {
    m.pool_load(m.kv, id, p.pages, p.a_off, p.b_off, p.rank, p.scale, false);
  } catch (const ffi::Error& e) {
    throw InvalidArgument("cannot load adapter '" + name + "' into the page pool: " + e.what());
  }
  ++m.next_adapter_id;
  m.adapters[name] = id;
}

void Engine::UnloadAdapter(const std::string& name) {
  Impl& m = *impl_;
  auto it = m.adapters.find(name);
  if (it == m.adapters.end()) throw InvalidArgument(m.UnknownAdapter(name));
  m.pool_unload(m.kv, it->second);
  m.adapters.erase(it);
}

void Engine::PinAdapter(const std::string& name, bool pinned) {
  Impl& m = *impl_;
  auto it = m.adapters.find(name);
  if (it == m.adapters.end()) throw InvalidArgument(m.UnknownAdapter(name));
  try {
    m.pool_pin(m.kv, it->second, pinned);
  } catch (const ffi::Error& e) {
    throw InvalidArgument("cannot pin adapter '" + name + "': " + e.what());
  }
}

std::vector<std::string> Engine::ListAdapters() const {
  std::vector<std::string> out;
  for (const auto& [n, id] : impl_->adapters) out.push_back(n);
  return out;
}

}  // namespace mlc_lora
