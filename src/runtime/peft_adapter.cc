/*!
 * \file peft_adapter.cc
 * \brief Reading, checking and packing PEFT LoRA folders (peft_adapter.h). Messages name the file,
 *        the option or the tensor, in the words (and Python reprs) of mlc-lora's Python API.
 */
#include "peft_adapter.h"

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <tuple>

#include "mlc_lora/error.h"

namespace mlc_lora {

namespace {

constexpr const char* kConfig = "adapter_config.json";
constexpr const char* kWeights = "adapter_model.safetensors";

// Options whose non-default value changes the forward pass (or needs weights we do not load):
// option -> the JSON values that are harmless (the first is named in the error).
const std::vector<std::pair<const char*, std::vector<const char*>>> kNeutral = {
    {"bias", {"\"none\""}},
    {"modules_to_save", {"null", "[]"}},
    {"use_dora", {"false", "null"}},
    {"lora_bias", {"false", "null"}},
    {"target_parameters", {"null", "[]"}},
    {"trainable_token_indices", {"null", "[]", "{}"}},
    {"layer_replication", {"null", "[]"}},
    {"use_qalora", {"false", "null"}},
    {"alora_invocation_tokens", {"null", "[]"}},
    {"megatron_config", {"null"}},
    {"use_bdlora", {"null", "false"}},
    {"velora_config", {"null"}},
    {"monteclora_config", {"null"}},
    {"arrow_config", {"null"}},
    {"kasa_config", {"null"}},
};
// init_lora_weights values that also rewrite the base weights: the adapter alone is not the model.
const char* const kBaseChangingInits[] = {"pissa", "olora", "corda", "loftq", "lora_ga"};

bool Exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}
bool IsDirectory(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool IsRegular(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string BaseName(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

std::string PyFloat(double d) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d);
  std::string s(buf, res.ptr);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

/*! \brief Python's repr of a JSON value as json.loads gives it. */
std::string PyRepr(const JSON& v) {
  if (v.is_null()) return "None";
  if (v.is_bool()) return v.boolean() ? "True" : "False";
  if (v.is_int()) return std::to_string(v.i64());
  if (v.is_number()) return PyFloat(v.f64());
  if (v.is_string()) return "'" + v.str() + "'";
  std::string s;
  if (v.is_array()) {
    for (const JSON& x : v.items()) s += (s.empty() ? "" : ", ") + PyRepr(x);
    return "[" + s + "]";
  }
  for (const auto& [k, x] : v.members()) s += (s.empty() ? "'" : ", '") + k + "': " + PyRepr(x);
  return "{" + s + "}";
}

std::string PyType(const JSON& v) {
  if (v.is_null()) return "NoneType";
  if (v.is_bool()) return "bool";
  if (v.is_int()) return "int";
  if (v.is_number()) return "float";
  if (v.is_string()) return "str";
  return v.is_array() ? "list" : "dict";
}

std::string PyShape(const std::vector<int64_t>& shape) {
  std::string s;
  for (int64_t d : shape) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return "(" + s + (shape.size() == 1 ? ",)" : ")");
}

bool Truthy(const JSON& v) {
  if (v.is_null()) return false;
  if (v.is_bool()) return v.boolean();
  if (v.is_number()) return v.f64() != 0;
  if (v.is_string()) return !v.str().empty();
  return v.is_array() ? !v.items().empty() : !v.members().empty();
}

bool PositiveInt(const JSON& v) { return v.is_int() && !v.is_bool() && v.i64() > 0; }
bool PositiveNumber(const JSON& v) { return v.is_number() && v.f64() > 0; }

JSON ReadConfig(const std::string& folder, const Contract& contract, std::vector<std::string>* warnings) {
  if (!Exists(folder)) throw ModelError("LoRA adapter '" + folder + "' is not a folder: it does not exist");
  if (!IsDirectory(folder)) throw ModelError("LoRA adapter '" + folder + "' is not a folder");
  const std::string f = folder + "/" + kConfig;
  if (!IsRegular(f)) throw ModelError(folder + " is not a PEFT adapter folder: no " + kConfig);
  std::ifstream in(f, std::ios::binary);
  std::stringstream contents;
  contents << in.rdbuf();
  JSON cfg = JSON::Parse(contents.str(), f);
  if (!cfg.is_object()) throw ModelError(f + " must hold a JSON object");
  if (cfg.contains("peft_type") && !(cfg["peft_type"].is_string() && cfg["peft_type"].str() == "LORA")) {
    throw InvalidArgument(f + ": peft_type " + PyRepr(cfg["peft_type"]) + " is not supported (only LORA)");
  }
  for (const auto& [opt, ok] : kNeutral) {
    if (!cfg.contains(opt)) continue;
    JSON v = cfg[opt];
    if (std::find(ok.begin(), ok.end(), v.dump()) == ok.end()) {
      throw InvalidArgument(f + ": " + opt + "=" + PyRepr(v) + " is not supported by mlc-lora (supported: " +
                            PyRepr(JSON::Parse(ok[0], "")) + ")");
    }
  }
  JSON init = cfg.get("init_lora_weights");
  if (init.is_string()) {
    std::string lower = init.str();
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    for (const char* p : kBaseChangingInits) {
      if (lower.rfind(p, 0) == 0) {
        throw InvalidArgument(f + ": init_lora_weights=" + PyRepr(init) +
                              " also changes the base weights; convert the adapter to plain LoRA (PEFT "
                              "path_initial_model_for_weight_conversion) first");
      }
    }
  }
  if (Truthy(cfg.get("fan_in_fan_out"))) {
    // PEFT itself resets it to False for nn.Linear targets; the A/B shapes are unaffected.
    warnings->push_back(f + ": fan_in_fan_out=true is ignored for Llama linear layers, as PEFT does");
  }
  for (const char* opt : {"rank_pattern", "alpha_pattern"}) {
    JSON v = cfg.get(opt);
    if (!v.is_null() && !v.is_object()) {
      throw InvalidArgument(f + ": " + opt + " must be an object, got " + PyType(v));
    }
  }
  JSON tm = cfg.get("target_modules");
  if (!tm.is_null() && !tm.is_string() && !tm.is_array()) {
    throw InvalidArgument(f + ": target_modules must be a list or a regex string");
  }
  if (tm.is_array()) {  // a regex string is checked through the tensors it produced
    std::string bad;
    for (const JSON& t : tm.items()) {
      bool ok = false;
      if (t.is_string()) {
        std::string name = t.str();
        size_t dot = name.rfind('.');
        ok = contract.IsLoraModule(dot == std::string::npos ? name : name.substr(dot + 1));
      }
      if (!ok) bad += (bad.empty() ? "" : ", ") + PyRepr(t);
    }
    if (!bad.empty()) {
      throw InvalidArgument(f + ": target_modules [" + bad + "] are not supported; mlc-lora serves LoRA on " +
                            contract.LoraModuleList());
    }
  }
  if (cfg.contains("r") && !PositiveInt(cfg["r"])) {
    throw InvalidArgument(f + ": bad LoRA rank r=" + PyRepr(cfg["r"]) + " (r must be a positive integer)");
  }
  if (cfg.contains("lora_alpha") && !PositiveNumber(cfg["lora_alpha"])) {
    throw InvalidArgument(f + ": bad lora_alpha=" + PyRepr(cfg["lora_alpha"]) +
                          " (lora_alpha must be a positive number)");
  }
  return cfg;
}

/*! \brief PEFT's get_pattern_key: the value of the first pattern matching a dotted suffix of `key`. */
JSON PatternValue(const JSON& patterns, const std::string& key, const std::string& f) {
  if (!patterns.is_object()) return JSON(tvm::ffi::Any(), "", f);
  for (const auto& [p, v] : patterns.members()) {
    try {
      if (std::regex_match(key, std::regex("(.*\\.)?(" + p + ")"))) return v;
    } catch (const std::regex_error&) {
      throw InvalidArgument(f + ": pattern '" + p + "' is not a valid regex");
    }
  }
  return JSON(tvm::ffi::Any(), "", f);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // infinity, or NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);  // rebias 15 -> 127
  } else {
    const float sub = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    std::memcpy(&bits, &sub, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

/*!
 * \brief Elements [start, start + n) of a float tensor of the safetensors file (F32, F16, BF16 or
 *        F64) as float32, the dtype dispatched once per call.
 */
void ReadElements(const SafeTensorsFile::Entry& e, int64_t start, int64_t n, float* out) {
  if (e.dtype == "F32") {
    std::memcpy(out, e.data + 4 * start, 4 * n);
  } else if (e.dtype == "F64") {
    for (int64_t i = 0; i < n; ++i) {
      double x;
      std::memcpy(&x, e.data + 8 * (start + i), 8);
      out[i] = static_cast<float>(x);
    }
  } else {  // F16, BF16
    const bool half = e.dtype == "F16";
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, e.data + 2 * (start + i), 2);
      if (half) {
        out[i] = HalfToFloat(h);
      } else {
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(out + i, &bits, 4);
      }
    }
  }
}

/*! \brief The largest LoRA scale accepted: the largest finite float16. */
constexpr double kMaxLoraScale = 65504.0;

/*! \brief The rows of a read PEFT adapter: A as stored, B transposed and scaled by its ratio. */
class PeftRows : public AdapterRows {
 public:
  explicit PeftRows(const PeftAdapter& a) : a_(a) {}
  bool Has(int64_t layer, const std::string& module) const final {
    return a_.pairs.count({layer, module}) != 0;
  }
  void Row(int64_t layer, const std::string& module, bool b, int64_t k, float* out) const final {
    const PeftAdapter::Pair& p = a_.pairs.at({layer, module});
    const int64_t in = p.a->shape[1], outf = p.b->shape[0];
    if (k >= p.r) {  // padding to the adapter's rank: zero rows contribute nothing
      std::fill(out, out + (b ? outf : in), 0.0f);
      return;
    }
    if (!b) {
      ReadElements(*p.a, k * in, in, out);
      CheckFinite(p.a_name, out, in, k * in, 1);
      return;
    }
    if (b_of_ != &p) {  // B (out, r) read once per pair, transposed: row k is column k of B
      b_t_.resize(outf * p.r);
      std::vector<float> in_row(p.r);
      for (int64_t o = 0; o < outf; ++o) {
        ReadElements(*p.b, o * p.r, p.r, in_row.data());
        for (int64_t c = 0; c < p.r; ++c) b_t_[c * outf + o] = in_row[c];
      }
      b_of_ = &p;
    }
    const float* col = b_t_.data() + k * outf;
    CheckFinite(p.b_name, col, outf, k, p.r);
    // numpy's float32 array * Python float: the scalar is cast to float32 (NEP 50).
    const float ratio = static_cast<float>(p.ratio);
    for (int64_t o = 0; o < outf; ++o) out[o] = col[o] * ratio;
  }

  // F16 rows into float16 pages, BF16 into bfloat16, B unscaled: the stored bits are what Row and
  // Store give (a 16-bit value widened to float32 and rounded back is itself), copied as they are.
  bool RawRow(int64_t layer, const std::string& module, bool b, int64_t k, DLDataType dtype, int64_t from,
              int64_t n, uint16_t* dst) const final {
    const PeftAdapter::Pair& p = a_.pairs.at({layer, module});
    const bool half = dtype.code == kDLFloat;
    const SafeTensorsFile::Entry& e = b ? *p.b : *p.a;
    if (e.dtype != (half ? "F16" : "BF16") || (b && static_cast<float>(p.ratio) != 1.0f)) return false;
    if (k >= p.r) {  // padding to the adapter's rank
      std::fill(dst, dst + n, uint16_t{0});
      return true;
    }
    const int64_t in = p.a->shape[1], outf = p.b->shape[0], len = b ? outf : in;
    const uint16_t* row;
    if (!b) {
      raw_row_.resize(in);  // the mapped data need not be 2-byte aligned
      std::memcpy(raw_row_.data(), e.data + 2 * k * in, 2 * in);
      row = raw_row_.data();
    } else {
      if (raw_b_of_ != &p) {  // B (out, r) transposed once per pair, as Row does, in blocks of outputs
        constexpr int64_t kBlock = 64;
        raw_b_t_.resize(outf * p.r);
        std::vector<uint16_t> block(kBlock * p.r);
        for (int64_t o0 = 0; o0 < outf; o0 += kBlock) {
          const int64_t no = std::min(kBlock, outf - o0);
          std::memcpy(block.data(), e.data + 2 * o0 * p.r, 2 * no * p.r);
          for (int64_t c = 0; c < p.r; ++c) {
            uint16_t* to = raw_b_t_.data() + c * outf + o0;
            for (int64_t o = 0; o < no; ++o) to[o] = block[o * p.r + c];
          }
        }
        raw_b_of_ = &p;
      }
      row = raw_b_t_.data() + k * outf;
    }
    // Infinity or NaN anywhere in the row (all exponent bits set): Row names it. The exponent
    // field plus its lowest bit reaches the sign bit only when all its bits are set (branch-free,
    // so the loop vectorizes).
    const uint16_t exp = half ? 0x7c00 : 0x7f80, step = half ? 0x0400 : 0x0080;
    uint16_t bad = 0;
    for (int64_t i = 0; i < len; ++i) bad |= static_cast<uint16_t>((row[i] & exp) + step);
    if (bad & 0x8000) return false;
    std::memcpy(dst, row + from, 2 * n);
    return true;
  }

 private:
  /*!
   * \brief InvalidArgument naming the tensor and the flat index of the first NaN or infinity
   *        among x[0..n) (elements start, start + stride, ... of the tensor).
   */
  static void CheckFinite(const std::string& tensor, const float* x, int64_t n, int64_t start, int64_t stride) {
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(x[i])) {
        throw InvalidArgument("tensor '" + tensor + "' holds a value that is not finite (" + std::to_string(x[i]) +
                              ") at flat index " + std::to_string(start + i * stride));
      }
    }
  }

 private:
  const PeftAdapter& a_;
  mutable const PeftAdapter::Pair* b_of_ = nullptr;  // whose B b_t_ holds
  mutable std::vector<float> b_t_;                    // B transposed: (r, out)
  mutable const PeftAdapter::Pair* raw_b_of_ = nullptr;  // the same for RawRow, as stored
  mutable std::vector<uint16_t> raw_b_t_;
  mutable std::vector<uint16_t> raw_row_;                // an A row, aligned
};

}  // namespace

PeftAdapter ReadPeftAdapter(const std::string& folder, const LoraSpec& spec, std::string name) {
  PeftAdapter out;
  out.folder = folder;
  out.name = name.empty() ? BaseName(folder) : std::move(name);
  const Contract& contract = spec.contract;
  const std::string fcfg = folder + "/" + kConfig;
  JSON cfg = ReadConfig(folder, contract, &out.warnings);
  const int64_t r_default = cfg.contains("r") ? cfg["r"].i64() : 8;
  out.lora_alpha = cfg.contains("lora_alpha") ? cfg["lora_alpha"].value() : tvm::ffi::Any(int64_t{8});
  const double alpha_default = cfg.contains("lora_alpha") ? cfg["lora_alpha"].f64() : 8.0;
  out.use_rslora = Truthy(cfg.get("use_rslora"));
  JSON rank_pattern = cfg.get("rank_pattern"), alpha_pattern = cfg.get("alpha_pattern");
  const bool per_module_ranks = rank_pattern.is_object() && !rank_pattern.members().empty();
  if (!per_module_ranks && r_default > spec.max_rank) {  // before reading any weights
    throw InvalidArgument("adapter " + out.name + " has rank " + std::to_string(r_default) +
                          ", above the compiled --max-lora-rank " + std::to_string(spec.max_rank));
  }

  const std::string fw = folder + "/" + kWeights;
  if (!IsRegular(fw)) {
    if (IsRegular(folder + "/adapter_model.bin")) {
      throw ModelError(folder + " holds adapter_model.bin (a pickle); mlc-lora loads only " + kWeights +
                       ". Re-save the adapter with safe_serialization=True");
    }
    throw ModelError(folder + " has no " + kWeights);
  }
  out.file = std::make_shared<SafeTensorsFile>(fw);
  static const std::regex kKey(
      R"(^(?:base_model\.model\.)?(.*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.[\w-]+)?\.weight$)");
  std::map<std::pair<int64_t, std::string>, std::string> module_keys;
  for (const auto& [key, entry] : out.file->entries()) {
    if (entry.dtype != "F32" && entry.dtype != "F16" && entry.dtype != "BF16" && entry.dtype != "F64") {
      throw ModelError(fw + ": tensor '" + key + "' has dtype " + entry.dtype + "; expected F32, F16 or BF16");
    }
    std::smatch m;
    if (!std::regex_match(key, m, kKey)) {
      throw InvalidArgument(fw + ": tensor '" + key + "' is not a LoRA A/B weight of a Llama linear (" +
                            contract.LoraModuleList() + "); such modules are not supported");
    }
    const std::string module = m[3].str();
    if (m[2].length() > 9) {
      throw InvalidArgument(fw + ": tensor '" + key + "' has layer number " + m[2].str() + ", out of range");
    }
    const int64_t layer = std::stoll(m[2].str());
    if (!contract.IsLoraModule(module)) {
      throw InvalidArgument(fw + ": tensor '" + key + "' targets '" + module + "'; supported LoRA modules are " +
                            contract.LoraModuleList());
    }
    if (layer >= spec.num_layers) {
      throw InvalidArgument(fw + ": tensor '" + key + "' is for layer " + std::to_string(layer) +
                            ", but the base model has " + std::to_string(spec.num_layers) + " layers");
    }
    PeftAdapter::Pair& p = out.pairs[{layer, module}];
    (m[4].str() == "A" ? p.a : p.b) = &entry;
    (m[4].str() == "A" ? p.a_name : p.b_name) = key;
    module_keys[{layer, module}] = m[1].str();
  }
  if (out.pairs.empty()) throw InvalidArgument(fw + " holds no LoRA weights");

  auto name_of = [&](const SafeTensorsFile::Entry* e) {
    for (const auto& [k, v] : out.file->entries()) {
      if (&v == e) return k;
    }
    return std::string();
  };
  std::map<std::pair<int64_t, std::string>, double> scale_of;
  for (auto& [lm, p] : out.pairs) {
    const auto& [layer, module] = lm;
    if (p.a == nullptr || p.b == nullptr) {
      throw InvalidArgument(fw + ": layer " + std::to_string(layer) + " " + module + " has lora_" +
                            (p.a ? "A" : "B") + " but not lora_" + (p.a ? "B" : "A"));
    }
    // Shapes of compiled modules are checked against the base model (before tensor-parallel
    // slicing); a module that was not compiled is refused below, after every tensor is read.
    const int64_t mi = spec.Index(module);
    int64_t in_f = -1, out_f = -1;
    if (mi >= 0) std::tie(in_f, out_f) = spec.FullShape(spec.modules[mi]);
    if (p.a->shape.size() != 2 || (mi >= 0 && p.a->shape[1] != in_f)) {
      throw InvalidArgument(fw + ": tensor '" + name_of(p.a) + "' has shape " + PyShape(p.a->shape) +
                            ", expected (r, " + (mi >= 0 ? std::to_string(in_f) : "in") + ") for " +
                            module + " of the base model");
    }
    p.r = p.a->shape[0];
    if (p.b->shape.size() != 2 || p.b->shape[1] != p.r || (mi >= 0 && p.b->shape[0] != out_f)) {
      throw InvalidArgument(fw + ": tensor '" + name_of(p.b) + "' has shape " + PyShape(p.b->shape) +
                            ", expected (" + (mi >= 0 ? std::to_string(out_f) : "out") + ", " +
                            std::to_string(p.r) + ") for " + module + " of the base model");
    }
    const std::string& mk = module_keys.at(lm);
    JSON rv = PatternValue(rank_pattern, mk, fcfg);
    if (!rv.is_null() && !PositiveInt(rv)) {
      throw InvalidArgument(fcfg + ": rank_pattern value " + PyRepr(rv) + " for " + mk +
                            " must be a positive integer");
    }
    const int64_t r_cfg = rv.is_null() ? r_default : rv.i64();
    if (p.r != r_cfg) {
      throw InvalidArgument(fw + ": tensor '" + name_of(p.a) + "' has rank " + std::to_string(p.r) +
                            ", but adapter_config.json gives r=" + std::to_string(r_cfg) + " for " + mk);
    }
    JSON av = PatternValue(alpha_pattern, mk, fcfg);
    if (!av.is_null() && !PositiveNumber(av)) {
      throw InvalidArgument(fcfg + ": alpha_pattern value " + PyRepr(av) + " for " + mk +
                            " must be a positive number");
    }
    const double alpha = av.is_null() ? alpha_default : av.f64();
    const double r = static_cast<double>(p.r);
    scale_of[lm] = out.use_rslora ? alpha / std::sqrt(r) : alpha / r;
    // A scale past half precision's range overflows every delta of a fp16/bf16 model (NaN logits).
    if (!std::isfinite(scale_of[lm]) || scale_of[lm] > kMaxLoraScale) {
      throw InvalidArgument(fcfg + ": the LoRA scale of " + mk + " (" + (out.use_rslora ? "alpha / sqrt(r)" : "alpha / r") +
                            " = " + std::to_string(scale_of[lm]) + ") is out of range (at most 65504)");
    }
    out.rank = std::max(out.rank, p.r);
  }
  for (const std::string& m : contract.lora_modules) {  // canonical order
    for (const auto& [lm, p] : out.pairs) {
      if (lm.second == m) {
        out.modules.push_back(m);
        break;
      }
    }
  }
  // The table scale of a module is its scale in the lowest layer; other layers fold the ratio.
  for (const auto& [lm, s] : scale_of) {
    if (!out.scales.count(lm.second)) out.scales[lm.second] = s;  // map order: lowest layer first
  }
  for (auto& [lm, p] : out.pairs) p.ratio = scale_of.at(lm) / out.scales.at(lm.second);
  // What the compiled model can serve (PackAdapter checks the same; here before any packing).
  if (out.rank > spec.max_rank) {
    throw InvalidArgument("adapter " + out.name + " has rank " + std::to_string(out.rank) +
                          ", above the compiled --max-lora-rank " + std::to_string(spec.max_rank));
  }
  std::vector<std::string> missing;
  std::vector<LoraModule> mods;
  for (const std::string& m : out.modules) {
    if (spec.Index(m) < 0) missing.push_back(m);
  }
  if (!missing.empty()) {
    throw InvalidArgument("adapter " + out.name + " targets " + PyList(missing) +
                          ", which the model was not compiled for (compiled LoRA modules: " +
                          spec.ModuleList() + ")");
  }
  for (const LoraModule& m : spec.modules) {
    if (std::find(out.modules.begin(), out.modules.end(), m.name) != out.modules.end()) mods.push_back(m);
  }
  out.num_pages = LayoutAdapter(spec.page_elems, mods, out.rank, spec.Rows()).num_pages;
  return out;
}

PackedAdapter PackPeftAdapter(const PeftAdapter& adapter, const LoraSpec& spec, int64_t shard) {
  PackedAdapter out = PackAdapter(spec, adapter.name, adapter.rank, adapter.modules, adapter.scales,
                                  PeftRows(adapter), shard);
  out.warnings = adapter.warnings;
  return out;
}

}  // namespace mlc_lora
