/*!
 * \file engine.cc
 * \brief The C++ engine: a compiled model folder driven through TVM's runtime, as runner.py does.
 *
 * TVM is reached only through tvm-ffi: the model library is a tvm-ffi Module whose
 * `vm_load_executable` gives the Relax VM; tensors are made and copied with the runtime's
 * registered `runtime.TVMTensor*` globals and the KV cache is driven by `vm.builtin.kv_state_*`.
 */
#include <dlfcn.h>
#include <sys/stat.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "chat_template.h"
#include "json.h"
#include "lora.h"
#include "mlc_lora/engine.h"
#include "safetensors.h"
#include "sampler.h"

namespace mlc_lora {

namespace ffi = tvm::ffi;
using detail::JSON;

namespace {

constexpr const char* kConfigFile = "mlc-lora-config.json";
constexpr int64_t kPageSize = 16;  // the compiled KV-cache kernels assume 16 tokens per page
constexpr int kPooledAllocator = 2;

bool IsDir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool IsFile(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
std::string ReadText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

DLDataType DType(const std::string& name) {
  if (name == "float32") return DLDataType{kDLFloat, 32, 1};
  if (name == "float16") return DLDataType{kDLFloat, 16, 1};
  if (name == "bfloat16") return DLDataType{kDLBfloat, 16, 1};
  throw ModelError("unsupported model dtype '" + name + "'");
}
const char* SafetensorsCode(const std::string& name) {
  return name == "float32" ? "F32" : name == "float16" ? "F16" : "BF16";
}

DLDevice ParseDevice(const std::string& name) {
  if (name == "cpu") return DLDevice{kDLCPU, 0};
  if (name.rfind("cuda", 0) == 0) {
    int idx = 0;
    if (name.size() > 4) {
      if (name[4] != ':' || name.size() == 5 ||
          name.find_first_not_of("0123456789", 5) != std::string::npos) {
        throw InvalidArgument("bad device '" + name + "'; use 'cpu', 'cuda' or 'cuda:N'");
      }
      idx = std::stoi(name.substr(5));
    }
    // TVM's CUDA device API lives in a separate library that is not loaded by default.
    if (!ffi::Function::GetGlobal("ffi.Module.load_from_bytes.cuda").has_value()) {
      const char* env = std::getenv("MLC_LORA_TVM_LIB_DIR");
      std::string lib = std::string(env ? env : MLC_LORA_TVM_LIB_DIR) + "/libtvm_runtime_cuda.so";
      if (::dlopen(lib.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
        throw InvalidArgument("device '" + name + "' needs TVM's CUDA runtime: " + ::dlerror());
      }
    }
    return DLDevice{kDLCUDA, idx};
  }
  throw InvalidArgument("unknown device '" + name + "'; use 'cpu', 'cuda' or 'cuda:N'");
}

ffi::Function Global(const char* name) {
  auto f = ffi::Function::GetGlobal(name);
  if (!f.has_value()) throw ModelError(std::string("TVM runtime function '") + name + "' is not registered");
  return *f;
}

// One request while it runs.
struct Running {
  size_t index;  // into the caller's vector
  int64_t seq_id;
  std::vector<int32_t> prompt;
  size_t prefilled = 0;
  int budget;  // tokens it may still generate
  int64_t reserved_pages;
  detail::Sampler sampler;
  std::string pending;  // bytes not yet streamed (an incomplete UTF-8 character)
  Result result;
  bool done = false;
  Running(size_t i, int64_t id, std::vector<int32_t> p, int b, int64_t pages, const GenerationConfig& cfg)
      : index(i), seq_id(id), prompt(std::move(p)), budget(b), reserved_pages(pages), sampler(cfg) {}
};

}  // namespace

struct Engine::Impl {
  std::string model_dir;
  int32_t vocab_size = 0;
  int64_t hidden_size = 0, context_window = 0, max_lora_rank = 0;
  // A model compiled with LoRA takes six table inputs after the KV cache (docs/DESIGN.md).
  int64_t lora_modules = 0, lora_max_rank = 0, lora_arena_elems = 0;
  detail::LoraSpec lora_spec;
  JSON model_config{ffi::Any(), "", ""};
  std::map<std::string, int64_t> adapters;  // name -> pool adapter id
  int64_t next_adapter_id = 0;
  ffi::Function pool_load, pool_unload, pool_pin, pool_set_seq, pool_tables;
  std::string dtype;
  DLDevice device{kDLCPU, 0};
  int max_batch = 0, prefill_chunk = 0;
  int64_t max_total_tokens = 0;

  Tokenizer tokenizer;
  detail::ChatTemplate chat;
  std::set<int32_t> stop_ids;

  ffi::Any lib, vm;  // the library and VM modules, kept alive
  ffi::Function f_embed, f_prefill, f_decode, f_create_kv;
  ffi::Function kv_add, kv_remove, kv_begin, kv_end, kv_pages;
  ffi::Function t_alloc, t_view, t_from_bytes, t_to_bytes;
  ffi::Array<ffi::Tensor> params;
  ffi::Any kv;
  int64_t next_seq_id = 0;

  Impl(const std::string& dir, const EngineOptions& opt) : model_dir(dir) {
    if (!IsDir(dir)) throw ModelError("model folder '" + dir + "' does not exist");
    std::string cfg_path = dir + "/" + kConfigFile;
    if (!IsFile(cfg_path)) {
      throw ModelError("'" + dir + "' is not a compiled mlc-lora model (no " + kConfigFile + ")");
    }
    JSON cfg = JSON::Parse(ReadText(cfg_path), cfg_path);
    int64_t shards = cfg.get("tensor_parallel_shards").i64_or(1);
    if (shards > 1) {
      // One process, one device here; the Python engine drives one disco worker per shard.
      throw ModelError("'" + dir + "' was compiled with --tensor-parallel-shards " + std::to_string(shards) +
                       ": the C++ engine runs one device; serve it with `mlc_lora serve` (docs/TP.md)");
    }
    JSON mc = cfg["model_config"];
    model_config = mc;
    vocab_size = static_cast<int32_t>(mc["vocab_size"].i64());
    hidden_size = mc["hidden_size"].i64();
    context_window = mc["context_window_size"].i64();
    dtype = cfg["dtype"].str();
    max_lora_rank = cfg["compile_options"].get("max_lora_rank").i64_or(0);
    if (cfg.has("lora")) {
      JSON lora = cfg["lora"];
      lora_modules = static_cast<int64_t>(lora["modules"].items().size());
      lora_max_rank = lora["max_rank"].i64();
      lora_arena_elems = lora["num_layers"].i64() * lora["pool_pages"].i64() * lora["page_elems"].i64();
      lora_spec = detail::LoraSpec::FromJSON(lora);
    }
    std::string target = cfg["target"]["kind"].str();
    device = ParseDevice(opt.device);
    if ((target == "llvm") != (device.device_type == kDLCPU)) {
      throw InvalidArgument("'" + dir + "' was compiled for target '" + target + "' and cannot run on device '" +
                            opt.device + "'");
    }
    max_batch = opt.max_batch_size > 0 ? opt.max_batch_size : static_cast<int>(mc["max_batch_size"].i64());
    prefill_chunk = opt.prefill_chunk_size > 0 ? opt.prefill_chunk_size
                                               : static_cast<int>(mc["prefill_chunk_size"].i64());
    max_total_tokens = opt.max_total_tokens > 0 ? opt.max_total_tokens : context_window;
    if (lora_arena_elems > 0) {
      // The compiled lora_arena is (L * pool_pages * E,): the cache must have exactly pool_pages
      // pages (ceil(max_total_tokens / 16) + 1), as for ModelRunner.
      int64_t pool_tokens = (lora_spec.pool_pages - 1) * kPageSize;
      if (opt.max_total_tokens > 0 && PagesFor(opt.max_total_tokens) != lora_spec.pool_pages - 1) {
        throw InvalidArgument("'" + dir + "' was compiled with LoRA and a pool of " + std::to_string(lora_spec.pool_pages) +
                              " pages: max_total_tokens must be 0 or " + std::to_string(pool_tokens));
      }
      max_total_tokens = pool_tokens;
    }
    if (opt.max_batch_size < 0 || opt.prefill_chunk_size < 0 || opt.max_total_tokens < 0) {
      throw InvalidArgument("EngineOptions sizes must be >= 0 (0 = default)");
    }

    LoadTokenizer(cfg["tokenizer"]);
    LoadModule(dir + "/" + cfg["library"].str());
    LoadParams(dir + "/" + cfg["params_file"].str(), cfg["param_names"]);
    try {
      kv = f_create_kv(ffi::Shape({max_batch}), ffi::Shape({max_total_tokens}), ffi::Shape({prefill_chunk}),
                  ffi::Shape({kPageSize}), ffi::Shape({0}));
    } catch (const ffi::Error& e) {
      throw ModelError("cannot create the KV cache of '" + dir + "': " + e.what());
    }
    if (lora_arena_elems > 0) {
      Global("mlc_lora.runtime.pool_configure_lora")(kv, lora_modules, lora_max_rank);
      pool_load = Global("mlc_lora.runtime.pool_load_adapter");
      pool_unload = Global("mlc_lora.runtime.pool_unload_adapter");
      pool_pin = Global("mlc_lora.runtime.pool_pin_adapter");
      pool_set_seq = Global("mlc_lora.runtime.pool_set_sequence_adapter");
      pool_tables = Global("mlc_lora.runtime.pool_lora_tables");
    }
  }

  void LoadTokenizer(const JSON& tok) {
    if (!tok.has("file")) throw ModelError("'" + model_dir + "' has no tokenizer (config.tokenizer.file)");
    tokenizer = Tokenizer::FromFile(model_dir + "/" + tok["file"].str());
    chat = detail::ChatTemplate(tok.get("chat_template").is_string() ? tok["chat_template"].str() : "");
    JSON eos = tok.get("eos_token_id");
    if (eos.is_int()) stop_ids.insert(static_cast<int32_t>(eos.i64()));
    if (eos.is_array()) {
      for (const JSON& e : eos.items()) stop_ids.insert(static_cast<int32_t>(e.i64()));
    }
    JSON eos_tok = tok.get("eos_token");
    std::string eos_str = eos_tok.is_string() ? eos_tok.str() : eos_tok.is_object() ? eos_tok["content"].str() : "";
    if (!eos_str.empty() && tokenizer.TokenToId(eos_str) >= 0) stop_ids.insert(tokenizer.TokenToId(eos_str));
  }

  void LoadModule(const std::string& path) {
    if (!IsFile(path)) throw ModelError("model library '" + path + "' is missing");
    auto need = [&](const ffi::Module& m, const char* name) {
      auto f = m->GetFunction(name);
      if (!f.has_value()) throw ModelError("model library '" + path + "' has no function '" + name + "'");
      return *f;
    };
    try {
      ffi::Module lib_mod = ffi::Module::LoadFromFile(path);
      ffi::Module vm_mod = need(lib_mod, "vm_load_executable")().cast<ffi::Module>();
      lib = lib_mod;
      vm = vm_mod;
      // The device plus the CPU for shape functions, each with the pooled allocator (as the
      // Python VirtualMachine does).
      ffi::Function init = need(vm_mod, "vm_initialization");
      if (device.device_type == kDLCPU) {
        init(static_cast<int>(kDLCPU), 0, kPooledAllocator);
      } else {
        init(static_cast<int>(device.device_type), device.device_id, kPooledAllocator, static_cast<int>(kDLCPU), 0,
             kPooledAllocator);
      }
      f_embed = need(vm_mod, "embed");
      f_prefill = need(vm_mod, "prefill");
      f_decode = need(vm_mod, "decode");
      f_create_kv = need(vm_mod, "create_paged_kv_cache");
      // prefill(input_embed, logit_positions, kv, [6 LoRA tables], params)
      int64_t arity = need(vm_mod, "get_function_arity")(ffi::String("prefill")).cast<int64_t>();
      int64_t want = lora_arena_elems > 0 ? 10 : 4;
      if (arity != want) {
        throw ModelError("'" + path + "': prefill takes " + std::to_string(arity) + " inputs, the config says " +
                         std::to_string(want) + "; the folder is inconsistent");
      }
    } catch (const ffi::Error& e) {
      throw ModelError("cannot load model library '" + path + "': " + e.what());
    }
    kv_add = Global("vm.builtin.kv_state_add_sequence");
    kv_remove = Global("vm.builtin.kv_state_remove_sequence");
    kv_begin = Global("vm.builtin.kv_state_begin_forward");
    kv_end = Global("vm.builtin.kv_state_end_forward");
    kv_pages = Global("vm.builtin.attention_kv_cache_get_num_available_pages");
    t_alloc = Global("runtime.TVMTensorAllocWithScope");
    t_view = Global("runtime.TVMTensorCreateView");
    t_from_bytes = Global("runtime.TVMTensorCopyFromBytes");
    t_to_bytes = Global("runtime.TVMTensorCopyToBytes");
  }

  ffi::Tensor Empty(std::vector<int64_t> shape, DLDataType dt) const {
    return t_alloc(ffi::Shape(std::move(shape)), dt, device, nullptr).cast<ffi::Tensor>();
  }

  void LoadParams(const std::string& path, const JSON& names) {
    detail::SafeTensorsFile st(path);
    DLDataType dt = DType(dtype);
    std::vector<ffi::Tensor> out;
    for (const JSON& n : names.items()) {
      std::string name = n.str();
      const auto& e = st.at(name);
      if (e.dtype != SafetensorsCode(dtype)) {
        throw ModelError("'" + path + "': tensor '" + name + "' is " + e.dtype + ", the model is " + dtype);
      }
      ffi::Tensor t = Empty(e.shape, dt);
      t_from_bytes(t, const_cast<void*>(static_cast<const void*>(e.data)), static_cast<int64_t>(e.nbytes));
      out.push_back(t);
    }
    params = ffi::Array<ffi::Tensor>(out.begin(), out.end());
  }

  // ----------------------------------------------------------------------------------------------
  // Forward passes (runner.py's prefill / decode).

  ffi::Tensor Embed(const std::vector<int32_t>& ids) const {
    ffi::Tensor t = Empty({static_cast<int64_t>(ids.size())}, DLDataType{kDLInt, 32, 1});
    t_from_bytes(t, static_cast<void*>(const_cast<int32_t*>(ids.data())), static_cast<int64_t>(ids.size() * sizeof(int32_t)));
    return f_embed(t, params).cast<ffi::Tensor>();  // (n, H)
  }

  std::vector<float> ToHost(const ffi::Tensor& logits, size_t rows) const {
    std::vector<float> host(rows * vocab_size);
    t_to_bytes(logits, static_cast<void*>(host.data()), static_cast<int64_t>(host.size() * sizeof(float)));
    return host;
  }

  ffi::Tensor FromHost(std::vector<int64_t> shape, DLDataType dt, const void* data, size_t nbytes) const {
    ffi::Tensor t = Empty(std::move(shape), dt);
    if (nbytes > 0) t_from_bytes(t, const_cast<void*>(data), static_cast<int64_t>(nbytes));
    return t;
  }

  // The LoRA inputs of the batch: the pool's arena and the tables it built in begin_forward from
  // each sequence's adapter (pool_set_sequence_adapter), as runner.py's lora="pool".
  std::vector<ffi::Any> LoraArgs() {
    if (lora_arena_elems == 0) return {};
    std::vector<ffi::Any> out;
    for (const ffi::Tensor& t : pool_tables(kv).cast<ffi::Array<ffi::Tensor>>()) out.push_back(t);
    return out;
  }

  // fn(inputs..., kv, [LoRA tables], params) -> (logits, kv)
  ffi::Tensor Call(const ffi::Function& fn, std::vector<ffi::Any> args, int64_t n_tok) {
    for (ffi::Any& a : LoraArgs()) args.push_back(std::move(a));
    args.push_back(params);
    std::vector<ffi::AnyView> views(args.begin(), args.end());
    ffi::Any ret;
    fn.CallPacked(views.data(), static_cast<int32_t>(views.size()), &ret);
    return ret.cast<ffi::Array<ffi::Any>>()[0].cast<ffi::Tensor>();
  }

  // One ragged prefill; returns each sequence's last-token logits, (b, V) row-major.
  std::vector<float> Prefill(const std::vector<int64_t>& seq_ids, const std::vector<std::vector<int32_t>>& tokens) {
    std::vector<int32_t> flat, last;
    std::vector<int64_t> lengths;
    for (const auto& t : tokens) {
      flat.insert(flat.end(), t.begin(), t.end());
      last.push_back(static_cast<int32_t>(flat.size()) - 1);
      lengths.push_back(static_cast<int64_t>(t.size()));
    }
    ffi::Tensor emb = Embed(flat);
    emb = t_view(emb, ffi::Shape({1, static_cast<int64_t>(flat.size()), hidden_size}), DType(dtype), 0)
              .cast<ffi::Tensor>();
    ffi::Tensor pos = Empty({static_cast<int64_t>(last.size())}, DLDataType{kDLInt, 32, 1});
    t_from_bytes(pos, static_cast<void*>(last.data()), static_cast<int64_t>(last.size() * sizeof(int32_t)));
    kv_begin(kv, ffi::Shape(seq_ids), ffi::Shape(lengths));
    ffi::Tensor logits = Call(f_prefill, {emb, pos, kv}, static_cast<int64_t>(flat.size()));
    kv_end(kv);
    return ToHost(logits, tokens.size());
  }

  // One decode step, one token per sequence; returns (b, V) row-major.
  std::vector<float> Decode(const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens) {
    int64_t b = static_cast<int64_t>(tokens.size());
    ffi::Tensor emb = Embed(tokens);
    emb = t_view(emb, ffi::Shape({b, 1, hidden_size}), DType(dtype), 0).cast<ffi::Tensor>();
    kv_begin(kv, ffi::Shape(seq_ids), ffi::Shape(std::vector<int64_t>(b, 1)));
    ffi::Tensor logits = Call(f_decode, {emb, kv}, b);
    kv_end(kv);
    return ToHost(logits, tokens.size());
  }

  // ----------------------------------------------------------------------------------------------
  // Requests.

  std::vector<int32_t> PromptIds(const Request& r) const {
    if (!r.prompt_ids.empty()) return r.prompt_ids;
    if (!r.prompt.empty()) return tokenizer.Encode(r.prompt, /*add_special_tokens=*/true);
    if (!r.messages.empty()) return tokenizer.Encode(chat.Apply(r.messages, true), false);
    throw InvalidArgument("request has no prompt (set prompt_ids, prompt or messages)");
  }

  int64_t PagesFor(int64_t tokens) const { return (tokens + kPageSize - 1) / kPageSize; }

  // Validates every request and turns it into a Running; throws before any KV state changes.
  std::vector<Running> Prepare(const std::vector<Request>& reqs, int64_t total_pages) const {
    std::vector<Running> out;
    for (size_t i = 0; i < reqs.size(); ++i) {
      const Request& r = reqs[i];
      std::string who = "request " + std::to_string(i) + ": ";
      const GenerationConfig& g = r.config;
      if (!r.adapter.empty() && !adapters.count(r.adapter)) throw InvalidArgument(who + UnknownAdapter(r.adapter));
      if (g.max_tokens < 1) throw InvalidArgument(who + "max_tokens must be >= 1");
      if (!(g.temperature >= 0.0f)) throw InvalidArgument(who + "temperature must be >= 0");
      if (!(g.top_p > 0.0f && g.top_p <= 1.0f)) throw InvalidArgument(who + "top_p must be in (0, 1]");
      if (g.top_k < 0) throw InvalidArgument(who + "top_k must be >= 0");
      std::vector<int32_t> ids;
      try {
        ids = PromptIds(r);
      } catch (const Error& e) {
        throw InvalidArgument(who + e.what());
      }
      if (ids.empty()) throw InvalidArgument(who + "the prompt is empty after tokenization");
      for (int32_t id : ids) {
        if (id < 0 || id >= vocab_size) {
          throw InvalidArgument(who + "token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                std::to_string(vocab_size) + ")");
        }
      }
      int64_t n = static_cast<int64_t>(ids.size());
      if (n >= context_window) {
        throw InvalidArgument(who + "prompt of " + std::to_string(n) + " tokens does not fit the context window of " +
                              std::to_string(context_window));
      }
      int budget = static_cast<int>(std::min<int64_t>(g.max_tokens, context_window - n));
      int64_t pages = PagesFor(n + budget);
      if (pages > total_pages) {
        throw InvalidArgument(who + std::to_string(n) + " prompt + " + std::to_string(budget) +
                              " new tokens exceed the KV cache (" + std::to_string(total_pages * kPageSize) +
                              " tokens); raise EngineOptions::max_total_tokens");
      }
      out.emplace_back(i, -1, std::move(ids), budget, pages, g);
      out.back().result.prompt_ids = out.back().prompt;
    }
    return out;
  }

  // Takes a sampled token: stop, or append it and stream its text.
  void Accept(Running* r, int32_t token, const GenerationConfig& g, const StreamCallback& cb) {
    if (!g.ignore_eos && stop_ids.count(token)) {
      r->done = true;
      r->result.finish_reason = "stop";
    } else {
      r->result.output_ids.push_back(token);
      r->pending += tokenizer.TokenBytes(token, /*skip_special_tokens=*/true);
      size_t cut = CompleteUTF8Prefix(r->pending);
      std::string delta = SanitizeUTF8(r->pending.substr(0, cut));
      r->pending.erase(0, cut);
      if (--r->budget == 0) {
        r->done = true;
        r->result.finish_reason = "length";
        delta += SanitizeUTF8(r->pending);
        r->pending.clear();
      }
      r->result.text += delta;
      if (cb) cb(r->index, token, delta);
    }
    if (r->done && !r->pending.empty()) {  // flush an incomplete tail at a stop token
      std::string tail = SanitizeUTF8(r->pending);
      r->pending.clear();
      r->result.text += tail;
      if (cb) cb(r->index, token, tail);
    }
  }

  std::vector<Result> Generate(const std::vector<Request>& reqs, const StreamCallback& cb) {
    int64_t total_pages = kv_pages(kv).cast<int64_t>();
    std::vector<Running> runs = Prepare(reqs, total_pages);
    std::vector<Result> results(reqs.size());
    std::vector<Running*> active;
    size_t next = 0;
    int64_t free_pages = total_pages;
    try {
      while (next < runs.size() || !active.empty()) {
        // Admit while a batch slot and the request's worst-case pages are free.
        std::vector<Running*> admitted;
        while (next < runs.size() && static_cast<int>(active.size()) < max_batch &&
               runs[next].reserved_pages <= free_pages) {
          Running* r = &runs[next++];
          r->seq_id = next_seq_id++;
          kv_add(kv, r->seq_id);
          free_pages -= r->reserved_pages;
          active.push_back(r);  // before anything else can throw: the cleanup below removes it
          admitted.push_back(r);
          if (lora_arena_elems > 0) {
            const std::string& a = reqs[r->index].adapter;
            pool_set_seq(kv, r->seq_id, a.empty() ? int64_t{-1} : adapters.at(a));
          }
        }
        PrefillAll(admitted, reqs, cb);
        std::vector<Running*> stepping;
        for (Running* r : active) {
          if (!r->done) stepping.push_back(r);
        }
        if (!stepping.empty()) {
          std::vector<int64_t> ids;
          std::vector<int32_t> toks;
          for (Running* r : stepping) {
            ids.push_back(r->seq_id);
            toks.push_back(r->result.output_ids.back());
          }
          std::vector<float> logits = Decode(ids, toks);
          for (size_t k = 0; k < stepping.size(); ++k) {
            Running* r = stepping[k];
            Accept(r, r->sampler.Next(&logits[k * vocab_size], vocab_size), reqs[r->index].config, cb);
          }
        }
        // Retire finished requests.
        for (auto it = active.begin(); it != active.end();) {
          Running* r = *it;
          if (!r->done) {
            ++it;
            continue;
          }
          kv_remove(kv, r->seq_id);
          r->seq_id = -1;
          free_pages += r->reserved_pages;
          results[r->index] = std::move(r->result);
          it = active.erase(it);
        }
      }
    } catch (...) {
      for (Running* r : active) {  // leave the cache as it was
        try {
          if (r->seq_id >= 0) kv_remove(kv, r->seq_id);
        } catch (...) {
        }
      }
      try {
        throw;
      } catch (const ffi::Error& e) {
        throw Error(std::string("model execution failed: ") + e.what());
      }
    }
    return results;
  }

  std::string UnknownAdapter(const std::string& name) const {
    if (lora_arena_elems == 0) {
      return "unknown adapter '" + name + "': '" + model_dir +
             "' was compiled without LoRA (recompile with --max-lora-rank and --lora-pool-pages)";
    }
    std::string loaded;
    for (const auto& [n, id] : adapters) loaded += (loaded.empty() ? "" : ", ") + n;
    return "unknown adapter '" + name + "' (loaded: " + (loaded.empty() ? "none" : loaded) + ")";
  }

  // Prefill newly admitted requests in chunks of at most prefill_chunk tokens (a long prompt
  // spans several chunks); each request's first token comes from its last chunk's logits.
  void PrefillAll(const std::vector<Running*>& admitted, const std::vector<Request>& reqs, const StreamCallback& cb) {
    size_t i = 0;
    while (i < admitted.size()) {
      std::vector<int64_t> ids;
      std::vector<std::vector<int32_t>> chunks;
      std::vector<Running*> finishing;
      int64_t room = prefill_chunk;
      for (size_t j = i; j < admitted.size() && room > 0 && static_cast<int>(ids.size()) < max_batch; ++j) {
        Running* r = admitted[j];
        size_t take = std::min<size_t>(room, r->prompt.size() - r->prefilled);
        ids.push_back(r->seq_id);
        chunks.emplace_back(r->prompt.begin() + r->prefilled, r->prompt.begin() + r->prefilled + take);
        r->prefilled += take;
        room -= static_cast<int64_t>(take);
        finishing.push_back(r->prefilled == r->prompt.size() ? r : nullptr);
      }
      std::vector<float> logits = Prefill(ids, chunks);
      for (size_t k = 0; k < finishing.size(); ++k) {
        if (Running* r = finishing[k]) {
          Accept(r, r->sampler.Next(&logits[k * vocab_size], vocab_size), reqs[r->index].config, cb);
        }
      }
      while (i < admitted.size() && admitted[i]->prefilled == admitted[i]->prompt.size()) ++i;
    }
  }
};

// ------------------------------------------------------------------------------------------------

Engine::Engine(const std::string& model_dir, const EngineOptions& options) {
  try {
    impl_ = std::make_unique<Impl>(model_dir, options);
  } catch (const Error&) {
    throw;
  } catch (const ffi::Error& e) {
    throw ModelError("cannot open '" + model_dir + "': " + e.what());
  }
}
Engine::~Engine() = default;
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;

const Tokenizer& Engine::tokenizer() const { return impl_->tokenizer; }

std::string Engine::ApplyChatTemplate(const std::vector<Message>& messages, bool add_generation_prompt) const {
  return impl_->chat.Apply(messages, add_generation_prompt);
}

std::vector<int32_t> Engine::PromptIds(const Request& request) const { return impl_->PromptIds(request); }

std::vector<Result> Engine::Generate(const std::vector<Request>& requests, const StreamCallback& on_token) {
  return impl_->Generate(requests, on_token);
}

Result Engine::Generate(const Request& request, const StreamCallback& on_token) {
  return impl_->Generate({request}, on_token)[0];
}

bool Engine::adapters_available() const { return impl_->lora_arena_elems > 0; }

void Engine::LoadAdapter(const std::string& name, const std::string& peft_dir) {
  Impl& m = *impl_;
  if (name.empty()) throw InvalidArgument("an adapter needs a non-empty name");
  if (m.lora_arena_elems == 0) {
    throw NotAvailable("cannot load adapter '" + name + "': '" + m.model_dir +
                       "' was compiled without LoRA (recompile with --max-lora-rank and --lora-pool-pages)");
  }
  if (m.adapters.count(name)) throw InvalidArgument("an adapter named '" + name + "' is already loaded");
  detail::PackedAdapter p;
  try {
    p = detail::PackPeftAdapter(peft_dir, m.model_config, m.lora_spec, m.dtype, name);
  } catch (const Error& e) {
    std::string msg = "cannot load adapter '" + name + "': " + e.what();
    if (dynamic_cast<const ModelError*>(&e)) throw ModelError(msg);
    if (dynamic_cast<const NotAvailable*>(&e)) throw NotAvailable(msg);
    throw InvalidArgument(msg);
  }
  const int64_t M = m.lora_modules, R = m.lora_max_rank;
  DLDevice cpu{kDLCPU, 0};
  auto host = [&](std::vector<int64_t> shape, DLDataType dt, const void* data, size_t nbytes) {
    ffi::Tensor t = m.t_alloc(ffi::Shape(std::move(shape)), dt, cpu, nullptr).cast<ffi::Tensor>();
    if (nbytes > 0) m.t_from_bytes(t, const_cast<void*>(data), static_cast<int64_t>(nbytes));
    return t;
  };
  DLDataType i32{kDLInt, 32, 1}, f32{kDLFloat, 32, 1};
  ffi::Tensor pages = host({p.num_layers, p.num_pages, p.page_elems}, DType(m.dtype), p.pages.data(), p.pages.size());
  ffi::Tensor a_off = host({M, R}, i32, p.a_off.data(), p.a_off.size() * 4);
  ffi::Tensor b_off = host({M, R}, i32, p.b_off.data(), p.b_off.size() * 4);
  ffi::Tensor scale = host({M}, f32, p.scale.data(), p.scale.size() * 4);
  int64_t id = m.next_adapter_id;
  try {
    m.pool_load(m.kv, id, pages, a_off, b_off, p.rank, scale, false);
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

int64_t Engine::kv_cache_free_tokens() const {
  return impl_->kv_pages(impl_->kv).cast<int64_t>() * kPageSize;
}
int32_t Engine::vocab_size() const { return impl_->vocab_size; }
int64_t Engine::context_window_size() const { return impl_->context_window; }
const std::string& Engine::model_dir() const { return impl_->model_dir; }

}  // namespace mlc_lora
