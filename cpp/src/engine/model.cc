/*!
 * \file model.cc
 * \brief The compiled model folder: config and contract, tokenizer, library, params, KV cache;
 *        and the forward passes (runner/single.py's prefill / decode).
 *
 * MLC_LORA_CONFIG_FILE is CONFIG_FILE of python/mlc_lora/contract.py, read by CMake; everything
 * else the engine must agree on comes from the config's "contract" block.
 */
#include <sys/stat.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "dl.h"
#include "engine/engine_impl.h"
#include "safetensors.h"

#ifndef MLC_LORA_CONFIG_FILE
#error "MLC_LORA_CONFIG_FILE (contract.py CONFIG_FILE) must be defined by the build"
#endif

namespace mlc_lora {

namespace ffi = tvm::ffi;

namespace detail {

ffi::Function Global(const char* name) {
  auto f = ffi::Function::GetGlobal(name);
  if (!f.has_value()) throw ModelError(std::string("TVM runtime function '") + name + "' is not registered");
  return *f;
}

}  // namespace detail

namespace {

// TVM's memory::AllocatorType
constexpr int kNaiveAllocator = 1;
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
      try {
        dl::Open(std::string(env ? env : MLC_LORA_TVM_LIB_DIR) + "/libtvm_runtime_cuda.so",
                 "TVM's CUDA runtime");
      } catch (const ffi::Error& e) {
        throw InvalidArgument("device '" + name + "' needs TVM's CUDA runtime: " + e.message());
      }
    }
    return DLDevice{kDLCUDA, idx};
  }
  throw InvalidArgument("unknown device '" + name + "'; use 'cpu', 'cuda' or 'cuda:N'");
}

}  // namespace

Engine::Impl::Impl(const std::string& dir, const EngineOptions& opt) : model_dir(dir) {
  if (!IsDir(dir)) throw ModelError("model folder '" + dir + "' does not exist");
  const std::string cfg_path = dir + "/" + MLC_LORA_CONFIG_FILE;
  if (!IsFile(cfg_path)) {
    throw ModelError("'" + dir + "' is not a compiled mlc-lora model (no " + MLC_LORA_CONFIG_FILE + ")");
  }
  JSON cfg = JSON::Parse(ReadText(cfg_path), cfg_path);
  int64_t shards = cfg.get("tensor_parallel_shards").i64_or(1);
  if (shards > 1) {
    // One process, one device here; the Python engine drives one disco worker per shard.
    throw ModelError("'" + dir + "' was compiled with --tensor-parallel-shards " + std::to_string(shards) +
                     ": the C++ engine runs one device; serve it with `mlc_lora serve` (docs/TP.md)");
  }
  contract = Contract::FromConfig(cfg, "'" + dir + "'");
  JSON mc = cfg["model_config"];
  vocab_size = static_cast<int32_t>(mc["vocab_size"].i64());
  hidden_size = mc["hidden_size"].i64();
  context_window = mc["context_window_size"].i64();
  dtype = cfg["dtype"].str();
  if (cfg.has("lora")) {
    lora = true;
    lora_spec = LoraSpec::FromConfig(cfg);
  }
  std::string target = cfg["target"]["kind"].str();
  // decode captured in CUDA graphs replays fixed table addresses and slot counts (runner/single.py)
  cuda_graph = target == "cuda" && cfg.has("compile_options") && cfg["compile_options"].has("cuda_graph") &&
               cfg["compile_options"]["cuda_graph"].is_bool() && cfg["compile_options"]["cuda_graph"].boolean();
  device = ParseDevice(opt.device);
  if ((target == "llvm") != (device.device_type == kDLCPU)) {
    throw InvalidArgument("'" + dir + "' was compiled for target '" + target + "' and cannot run on device '" +
                          opt.device + "'");
  }
  max_batch = opt.max_batch_size > 0 ? opt.max_batch_size : static_cast<int>(mc["max_batch_size"].i64());
  prefill_chunk = opt.prefill_chunk_size > 0 ? opt.prefill_chunk_size
                                             : static_cast<int>(mc["prefill_chunk_size"].i64());
  max_total_tokens = opt.max_total_tokens > 0 ? opt.max_total_tokens : context_window;
  const auto bounded = cfg["compile_options"].get("bounded_prefill_memory");  // (null in older libraries)
  if (bounded.is_bool() && bounded.boolean() &&
      (prefill_chunk > mc["prefill_chunk_size"].i64() || max_batch > mc["max_batch_size"].i64())) {
    // (compile --bounded-prefill-memory: prefill's buffers are planned for the compiled bounds)
    throw InvalidArgument("'" + dir + "' plans prefill's memory for at most " +
                          std::to_string(mc["prefill_chunk_size"].i64()) + " tokens over " +
                          std::to_string(mc["max_batch_size"].i64()) + " sequences; got prefill_chunk_size " +
                          std::to_string(prefill_chunk) + ", max_batch_size " + std::to_string(max_batch));
  }
  if (lora) {
    // The compiled lora_arena is (L * pool_pages * E,): the cache must have exactly pool_pages
    // pages (ceil(max_total_tokens / page_size) + 1), as for ModelRunner.
    int64_t pool_tokens = (lora_spec.pool_pages - 1) * contract.page_size;
    if (opt.max_total_tokens > 0 && PagesFor(opt.max_total_tokens) != lora_spec.pool_pages - 1) {
      throw InvalidArgument("'" + dir + "' was compiled with LoRA and a pool of " +
                            std::to_string(lora_spec.pool_pages) +
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
                     ffi::Shape({contract.page_size}), ffi::Shape({0}));
  } catch (const ffi::Error& e) {
    throw ModelError("cannot create the KV cache of '" + dir + "': " + e.what());
  }
  if (lora) ConfigureLora();
}

void Engine::Impl::LoadTokenizer(const JSON& tok) {
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

void Engine::Impl::LoadModule(const std::string& path) {
  using detail::Global;
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
    // The device plus the CPU for shape functions. On the CPU the naive allocator, as ModelRunner
    // (python/mlc_lora/runner/device.py, default_allocator): the pooled one keeps a buffer of every
    // size it freed, so memory would grow with every new prompt length.
    ffi::Function init = need(vm_mod, "vm_initialization");
    if (device.device_type == kDLCPU) {
      init(static_cast<int>(kDLCPU), 0, kNaiveAllocator);
    } else {
      init(static_cast<int>(device.device_type), device.device_id, kPooledAllocator, static_cast<int>(kDLCPU), 0,
           kPooledAllocator);
    }
    f_embed = need(vm_mod, "embed");
    f_prefill = need(vm_mod, "prefill");
    f_decode = need(vm_mod, "decode");
    f_create_kv = need(vm_mod, "create_paged_kv_cache");
    // prefill(input_embed, logit_positions, kv, [the LoRA table inputs], params)
    int64_t arity = need(vm_mod, "get_function_arity")(ffi::String("prefill")).cast<int64_t>();
    int64_t want = 4 + (lora ? static_cast<int64_t>(contract.lora_table_inputs.size()) : 0);
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
  pool_stats = Global("mlc_lora.runtime.pool_stats");
  pool_admittable = Global("mlc_lora.runtime.pool_admittable_pages");
  t_alloc = Global("runtime.TVMTensorAllocWithScope");
  t_view = Global("runtime.TVMTensorCreateView");
  t_from_bytes = Global("runtime.TVMTensorCopyFromBytes");
  t_to_bytes = Global("runtime.TVMTensorCopyToBytes");
}

void Engine::Impl::LoadParams(const std::string& path, const JSON& names) {
  SafeTensorsFile st(path);
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

// ------------------------------------------------------------------------------------------------
// Forward passes.

ffi::Tensor Engine::Impl::Empty(std::vector<int64_t> shape, DLDataType dt) const {
  return t_alloc(ffi::Shape(std::move(shape)), dt, device, nullptr).cast<ffi::Tensor>();
}

ffi::Tensor Engine::Impl::Embed(const std::vector<int32_t>& ids) const {
  ffi::Tensor t = Empty({static_cast<int64_t>(ids.size())}, DLDataType{kDLInt, 32, 1});
  t_from_bytes(t, static_cast<void*>(const_cast<int32_t*>(ids.data())), static_cast<int64_t>(ids.size() * sizeof(int32_t)));
  return f_embed(t, params).cast<ffi::Tensor>();  // (n, H)
}

std::vector<float> Engine::Impl::ToHost(const ffi::Tensor& logits, size_t rows) const {
  std::vector<float> host(rows * vocab_size);
  t_to_bytes(logits, static_cast<void*>(host.data()), static_cast<int64_t>(host.size() * sizeof(float)));
  return host;
}

// The LoRA inputs of the batch: the pool's arena and the tables it built in begin_forward from
// each sequence's adapter (pool_set_sequence_adapter), as runner/single.py's lora="pool".
// A decode captured in CUDA graphs gets them at the pool's slot capacity (fixed shapes).
std::vector<ffi::Any> Engine::Impl::LoraArgs(bool decode) {
  if (!lora) return {};
  std::vector<ffi::Any> out;
  const ffi::Function& tables = decode && cuda_graph ? pool_graph_tables : pool_tables;
  for (const ffi::Tensor& t : tables(kv).cast<ffi::Array<ffi::Tensor>>()) out.push_back(t);
  return out;
}

// fn(inputs..., kv, [LoRA tables], params) -> (logits, kv)
ffi::Tensor Engine::Impl::Call(const ffi::Function& fn, std::vector<ffi::Any> args, bool decode) {
  for (ffi::Any& a : LoraArgs(decode)) args.push_back(std::move(a));
  args.push_back(params);
  std::vector<ffi::AnyView> views(args.begin(), args.end());
  ffi::Any ret;
  fn.CallPacked(views.data(), static_cast<int32_t>(views.size()), &ret);
  return ret.cast<ffi::Array<ffi::Any>>()[0].cast<ffi::Tensor>();
}

std::vector<float> Engine::Impl::Prefill(const std::vector<int64_t>& seq_ids,
                                         const std::vector<std::vector<int32_t>>& tokens) {
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
  ffi::Tensor logits = Call(f_prefill, {emb, pos, kv});
  kv_end(kv);
  return ToHost(logits, tokens.size());
}

std::vector<float> Engine::Impl::Decode(const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens) {
  int64_t b = static_cast<int64_t>(tokens.size());
  ffi::Tensor emb = Embed(tokens);
  emb = t_view(emb, ffi::Shape({b, 1, hidden_size}), DType(dtype), 0).cast<ffi::Tensor>();
  kv_begin(kv, ffi::Shape(seq_ids), ffi::Shape(std::vector<int64_t>(b, 1)));
  ffi::Tensor logits = Call(f_decode, {emb, kv}, /*decode=*/true);
  kv_end(kv);
  return ToHost(logits, tokens.size());
}

}  // namespace mlc_lora
