/*!
 * \file engine_impl.h
 * \brief The C++ engine's state: a compiled model folder driven through TVM's runtime, as
 *        python/mlc_lora/runner/single.py does, and the requests it runs.
 *
 * TVM is reached only through tvm-ffi: the model library is a tvm-ffi Module whose
 * `vm_load_executable` gives the Relax VM; tensors are made and copied with the runtime's
 * registered `runtime.TVMTensor*` globals and the KV cache is driven by `vm.builtin.kv_state_*`.
 * The unified page pool and adapter packing are mlc-lora's runtime (src/runtime), linked in.
 *
 *   model.cc      the folder: config, contract, tokenizer, library, params; forward passes
 *   scheduler.cc  requests: validation, admission by pages (KV and adapters), chunked prefill,
 *                 decode, streaming
 *   adapters.cc   PEFT adapters into the pool (the runtime's reader and packer)
 *   engine.cc     the public Engine methods that only forward
 */
#ifndef MLC_LORA_CPP_ENGINE_IMPL_H_
#define MLC_LORA_CPP_ENGINE_IMPL_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "contract.h"
#include "json.h"
#include "lora_layout.h"
#include "mlc_lora/engine.h"
#include "sampling/sampler.h"
#include "tokenizer/chat_template.h"

namespace mlc_lora {
namespace detail {

/*! \brief One request while it runs. */
struct Running {
  size_t index;  // into the caller's vector
  int64_t seq_id;
  std::vector<int32_t> prompt;
  size_t prefilled = 0;
  int budget;  // tokens it may still generate
  int64_t reserved_pages;  // its KV pages at the most (prompt + budget)
  int64_t adapter = -1;    // its adapter's pool id, -1 for the base model
  Sampler sampler;
  std::string pending;  // bytes not yet streamed (an incomplete UTF-8 character)
  Result result;
  bool done = false;
  Running(size_t i, int64_t id, std::vector<int32_t> p, int b, int64_t pages, const GenerationConfig& cfg)
      : index(i), seq_id(id), prompt(std::move(p)), budget(b), reserved_pages(pages), sampler(cfg) {}
};

/*! \brief A global function of TVM's runtime or mlc-lora's; ModelError if it is not registered. */
tvm::ffi::Function Global(const char* name);

}  // namespace detail

struct Engine::Impl {
  // ---- the model (model.cc)
  std::string model_dir;
  Contract contract;  // the compiled config's "contract" block
  int32_t vocab_size = 0;
  int64_t hidden_size = 0, context_window = 0;
  std::string dtype;
  DLDevice device{kDLCPU, 0};
  int max_batch = 0, prefill_chunk = 0;
  int64_t max_total_tokens = 0;
  Tokenizer tokenizer;
  detail::ChatTemplate chat;
  std::set<int32_t> stop_ids;
  tvm::ffi::Any lib, vm;  // the library and VM modules, kept alive
  tvm::ffi::Function f_embed, f_prefill, f_decode, f_create_kv;
  tvm::ffi::Function kv_add, kv_remove, kv_begin, kv_end, kv_pages, pool_stats, pool_admittable;
  tvm::ffi::Function t_alloc, t_view, t_from_bytes, t_to_bytes;
  tvm::ffi::Array<tvm::ffi::Tensor> params;
  tvm::ffi::Any kv;
  int64_t next_seq_id = 0;

  // ---- LoRA (adapters.cc): a model compiled with LoRA takes the contract's table inputs
  // after the KV cache (docs/DESIGN.md), which the pool builds per batch.
  bool lora = false;
  bool cuda_graph = false;  // decode captured in CUDA graphs (compile_options.cuda_graph on a cuda target)
  LoraSpec lora_spec;
  std::map<std::string, int64_t> adapters;  // name -> pool adapter id
  int64_t next_adapter_id = 0;
  tvm::ffi::Function pool_load, pool_unload, pool_pin, pool_set_seq, pool_tables, pool_graph_tables, pool_info;

  Impl(const std::string& dir, const EngineOptions& opt);
  void LoadTokenizer(const JSON& tok);
  void LoadModule(const std::string& path);
  void LoadParams(const std::string& path, const JSON& names);
  void ConfigureLora();

  // ---- forward passes (model.cc; runner/single.py's prefill / decode)
  tvm::ffi::Tensor Empty(std::vector<int64_t> shape, DLDataType dt) const;
  tvm::ffi::Tensor Embed(const std::vector<int32_t>& ids) const;
  std::vector<float> ToHost(const tvm::ffi::Tensor& logits, size_t rows) const;
  std::vector<tvm::ffi::Any> LoraArgs(bool decode);
  tvm::ffi::Tensor Call(const tvm::ffi::Function& fn, std::vector<tvm::ffi::Any> args, bool decode = false);
  /*! \brief One ragged prefill; each sequence's last-token logits, (b, V) row-major. */
  std::vector<float> Prefill(const std::vector<int64_t>& seq_ids,
                             const std::vector<std::vector<int32_t>>& tokens);
  /*! \brief One decode step, one token per sequence; (b, V) row-major. */
  std::vector<float> Decode(const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens);
  int64_t PagesFor(int64_t tokens) const { return (tokens + contract.page_size - 1) / contract.page_size; }

  // ---- requests (scheduler.cc)
  std::vector<int32_t> PromptIds(const Request& r) const;
  std::vector<detail::Running> Prepare(const std::vector<Request>& reqs) const;
  /*! \brief Pages the admitted requests `active` have not yet claimed: free pages plus those of idle
   *  unpinned adapters (the pool evicts them for KV), less what the active requests may still take
   *  (KV up to their budget, their adapters not yet paged in). */
  int64_t Headroom(const std::vector<detail::Running*>& active) const;
  /*! \brief The pages admitting `r` beside `active` takes: its worst-case KV, plus its adapter's
   *  pages unless an active request holds it already or it is pinned (resident for good). */
  int64_t AdmissionPages(const detail::Running& r, const std::vector<detail::Running*>& active) const;
  void Accept(detail::Running* r, int32_t token, const GenerationConfig& g, const StreamCallback& cb);
  std::vector<Result> Generate(const std::vector<Request>& reqs, const StreamCallback& cb);
  void PrefillAll(const std::vector<detail::Running*>& admitted, const std::vector<Request>& reqs,
                  const StreamCallback& cb);

  // ---- adapters (adapters.cc)
  std::string UnknownAdapter(const std::string& name) const;
  /*! \brief One of the pool's counters (`mlc_lora.runtime.pool_stats`): free_pages, kv_pages, ... */
  int64_t PoolStat(const char* key) const;
  /*! \brief The pool's view of adapter `id`: pinned, resident, refs (sequences on it), num_pages. */
  int64_t AdapterStat(int64_t id, const char* key) const;
};

}  // namespace mlc_lora

#endif  // MLC_LORA_CPP_ENGINE_IMPL_H_
