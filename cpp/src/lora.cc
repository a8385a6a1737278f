/*!
 * \file lora.cc
 * \brief PEFT folder -> pool pages. Mirrors python/mlc_lora/lora/{peft,layout}.py step by step so
 *        that the packed bytes are identical (tests/cpp/embed/lora_pack_parity.py checks it).
 */
#include "lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <sys/stat.h>

#include "mlc_lora/error.h"
#include "safetensors.h"

namespace mlc_lora {
namespace detail {
namespace {

const char* const kAllModules[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

bool IsDirectory(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool IsRegular(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string AllModulesList() {
  std::string s;
  for (const char* m : kAllModules) s += (s.empty() ? "" : ", ") + std::string(m);
  return s;
}
bool IsLlamaModule(const std::string& m) {
  return std::find_if(std::begin(kAllModules), std::end(kAllModules), [&](const char* x) { return m == x; }) !=
         std::end(kAllModules);
}

// peft.py _NEUTRAL: options whose non-default value changes the forward pass.
struct Neutral {
  const char* option;
  bool null_ok, false_ok, empty_list_ok, empty_obj_ok;
  const char* string_ok;
};
const Neutral kNeutral[] = {
    {"bias", false, false, false, false, "none"},
    {"modules_to_save", true, false, true, false, nullptr},
    {"use_dora", true, true, false, false, nullptr},
    {"lora_bias", true, true, false, false, nullptr},
    {"target_parameters", true, false, true, false, nullptr},
    {"trainable_token_indices", true, false, true, true, nullptr},
    {"layer_replication", true, false, true, false, nullptr},
    {"use_qalora", true, true, false, false, nullptr},
    {"alora_invocation_tokens", true, false, true, false, nullptr},
    {"megatron_config", true, false, false, false, nullptr},
    {"use_bdlora", true, true, false, false, nullptr},
    {"velora_config", true, false, false, false, nullptr},
    {"monteclora_config", true, false, false, false, nullptr},
    {"arrow_config", true, false, false, false, nullptr},
    {"kasa_config", true, false, false, false, nullptr},
};

bool NeutralValue(const Neutral& n, const JSON& v) {
  if (v.is_null()) return n.null_ok;
  if (v.is_bool()) return n.false_ok && !v.boolean();
  if (v.is_string()) return n.string_ok != nullptr && v.str() == n.string_ok;
  if (v.is_array()) return n.empty_list_ok && v.items().empty();
  if (v.is_object()) return n.empty_obj_ok && v.members().empty();
  return false;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

JSON ReadConfig(const std::string& dir) {
  if (!IsDirectory(dir)) throw ModelError("adapter folder '" + dir + "' does not exist");
  std::string f = dir + "/adapter_config.json";
  if (!IsRegular(f)) throw ModelError("'" + dir + "' is not a PEFT adapter folder (no adapter_config.json)");
  std::ifstream in(f, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  JSON cfg = JSON::Parse(ss.str(), f);
  if (!cfg.is_object()) throw ModelError(f + " must hold a JSON object");
  JSON ptype = cfg.get("peft_type");
  if (!ptype.is_null() && !(ptype.is_string() && ptype.str() == "LORA")) {
    throw InvalidArgument(f + ": peft_type is not supported (only LORA)");
  }
  for (const Neutral& n : kNeutral) {
    JSON v = cfg.get(n.option);
    bool present = !v.is_null() || false;
    if (present && !NeutralValue(n, v)) {
      throw InvalidArgument(f + ": " + n.option + " has a value mlc-lora does not support (supported: " +
                            (n.string_ok ? "'" + std::string(n.string_ok) + "'" : n.false_ok ? "false" : "null or empty") +
                            "); only the plain LoRA forward is served");
    }
  }
  JSON init = cfg.get("init_lora_weights");
  if (init.is_string()) {
    std::string s = Lower(init.str());
    for (const char* p : {"pissa", "olora", "corda", "loftq", "lora_ga"}) {
      if (s.rfind(p, 0) == 0) {
        throw InvalidArgument(f + ": init_lora_weights='" + init.str() +
                              "' also changes the base weights; convert the adapter to plain LoRA first");
      }
    }
  }
  for (const char* opt : {"rank_pattern", "alpha_pattern"}) {
    JSON v = cfg.get(opt);
    if (!v.is_null() && !v.is_object()) throw InvalidArgument(f + ": " + opt + " must be an object");
  }
  JSON tm = cfg.get("target_modules");
  if (!tm.is_null() && !tm.is_string() && !tm.is_array()) {
    throw InvalidArgument(f + ": target_modules must be a list or a regex string");
  }
  if (tm.is_array()) {  // a regex string is checked through the tensors it produced
    std::string bad;
    for (const JSON& t : tm.items()) {
      std::string name = t.is_string() ? t.str() : "<not a string>";
      std::string last = name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);
      if (!t.is_string() || !IsLlamaModule(last)) bad += (bad.empty() ? "'" : ", '") + name + "'";
    }
    if (!bad.empty()) {
      throw InvalidArgument(f + ": target_modules [" + bad + "] are not supported; mlc-lora serves LoRA on " +
                            AllModulesList());
    }
  }
  return cfg;
}

// The value of r / lora_alpha / a pattern entry: a positive number.
double PositiveNumber(const JSON& v, const std::string& f, const std::string& key) {
  if (!v.is_number() || !(v.f64() > 0)) {
    throw InvalidArgument(f + ": bad LoRA " + key + " (must be a positive number)");
  }
  return v.f64();
}

float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float out;
  if (exp == 0) {
    out = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    out = man ? std::nanf("") : INFINITY;
  } else {
    out = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &out, 4);
  bits |= sign;
  std::memcpy(&out, &bits, 4);
  return out;
}

// numpy's float32 -> float16: round to nearest even, overflow to inf.
uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00 : 0x7c00);
  if (ax >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {                       // subnormal half (or zero)
    if (ax < 0x33000000u) return sign;          // < 2^-25 rounds to 0 (ties to even: 2^-25 -> 0)
    uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(e);      // m * 2^(e-150) in units of 2^-24: m >> (126 - e)
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t h = ((ax - 0x38000000u) >> 13), rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;
  return sign | static_cast<uint16_t>(h);
}

uint16_t FloatToBF16(float f) {  // ml_dtypes: round to nearest even, NaN stays NaN
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  x += 0x7fffu + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

struct Weights {
  std::vector<float> data;  // row-major float32
  int64_t rows = 0, cols = 0;
  std::vector<int64_t> shape;
  std::string key;
};

Weights ToFloat(const SafeTensorsFile::Entry& e, const std::string& f, const std::string& key) {
  Weights w;
  w.key = key;
  w.shape = e.shape;
  int64_t n = 1;
  for (int64_t d : e.shape) n *= d;
  int bytes = e.dtype == "F32" ? 4 : e.dtype == "F16" || e.dtype == "BF16" ? 2 : e.dtype == "F64" ? 8 : 0;
  if (bytes == 0) throw ModelError(f + ": tensor '" + key + "' has dtype " + e.dtype + "; expected F32, F16 or BF16");
  if (static_cast<size_t>(n) * bytes != e.nbytes) {
    throw ModelError(f + ": tensor '" + key + "' has " + std::to_string(e.nbytes / bytes) + " values for its shape");
  }
  w.data.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* p = e.data + i * bytes;
    if (bytes == 4) {
      std::memcpy(&w.data[i], p, 4);
    } else if (bytes == 8) {
      double d;
      std::memcpy(&d, p, 8);
      w.data[i] = static_cast<float>(d);
    } else {
      uint16_t h;
      std::memcpy(&h, p, 2);
      if (e.dtype == "F16") {
        w.data[i] = HalfToFloat(h);
      } else {
        uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(&w.data[i], &bits, 4);
      }
    }
  }
  return w;
}

// PEFT's get_pattern_key: the first pattern matching a dotted suffix of `key`, else `key`.
JSON PatternValue(const JSON& patterns, const std::string& key, const JSON& dflt) {
  if (patterns.is_null()) return dflt;
  for (const auto& [p, v] : patterns.members()) {
    try {
      if (std::regex_match(key, std::regex("(.*\\.)?(" + p + ")"))) return v;
    } catch (const std::regex_error&) {
      throw InvalidArgument("adapter_config.json: pattern '" + p + "' is not a valid regex");
    }
  }
  return dflt;
}

}  // namespace

LoraSpec LoraSpec::FromJSON(const JSON& lora) {
  LoraSpec s;
  s.num_layers = lora["num_layers"].i64();
  s.page_elems = lora["page_elems"].i64();
  s.max_rank = lora["max_rank"].i64();
  s.pool_pages = lora["pool_pages"].i64();
  s.kernel = lora.get("kernel").str_or("gather");
  for (const JSON& m : lora["modules"].items()) {
    s.modules.push_back({m["name"].str(), m["in_features"].i64(), m["out_features"].i64()});
  }
  return s;
}

PackedAdapter PackPeftAdapter(const std::string& dir, const JSON& mc, const LoraSpec& spec, const std::string& dtype,
                              const std::string& name) {
  // ---- peft.load_peft_adapter
  JSON cfg = ReadConfig(dir);
  std::string fcfg = dir + "/adapter_config.json", fw = dir + "/adapter_model.safetensors";
  if (!IsRegular(fw)) {
    if (IsRegular(dir + "/adapter_model.bin")) {
      throw ModelError("'" + dir + "' holds adapter_model.bin (a pickle); mlc-lora loads only "
                       "adapter_model.safetensors. Re-save the adapter with safe_serialization=True");
    }
    throw ModelError("'" + dir + "' has no adapter_model.safetensors");
  }
  JSON r_json = cfg.get("r"), alpha_json = cfg.get("lora_alpha");
  if (!r_json.is_null() && !(r_json.is_int() && r_json.i64() > 0)) {
    throw InvalidArgument(fcfg + ": bad LoRA rank r (must be a positive integer)");
  }
  double r_default = r_json.is_null() ? 8 : static_cast<double>(r_json.i64());
  double alpha_default = alpha_json.is_null() && !cfg.has("lora_alpha") ? 8 : PositiveNumber(alpha_json, fcfg, "lora_alpha");
  JSON rank_pattern = cfg.get("rank_pattern"), alpha_pattern = cfg.get("alpha_pattern");
  if (rank_pattern.is_null() && r_default > static_cast<double>(spec.max_rank)) {  // before reading weights
    throw InvalidArgument("adapter " + name + " has rank " + std::to_string(static_cast<int64_t>(r_default)) +
                          ", above the compiled --max-lora-rank " + std::to_string(spec.max_rank));
  }
  JSON rslora_j = cfg.get("use_rslora");
  bool rslora = rslora_j.is_bool() ? rslora_j.boolean() : false;

  const int64_t L = mc["num_hidden_layers"].i64();
  const int64_t h = mc["hidden_size"].i64(), inter = mc["intermediate_size"].i64();
  const int64_t hd = mc.has("head_dim") ? mc["head_dim"].i64() : h / mc["num_attention_heads"].i64();
  const int64_t q = mc["num_attention_heads"].i64() * hd, kvd = mc["num_key_value_heads"].i64() * hd;
  const std::map<std::string, std::pair<int64_t, int64_t>> shapes = {
      {"q_proj", {h, q}},        {"k_proj", {h, kvd}},    {"v_proj", {h, kvd}},    {"o_proj", {q, h}},
      {"gate_proj", {h, inter}}, {"up_proj", {h, inter}}, {"down_proj", {inter, h}}};

  static const std::regex kKey(
      R"(^(?:base_model\.model\.)?(.*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.[\w-]+)?\.weight$)");
  SafeTensorsFile st(fw);
  struct Pair {
    std::string module_key;
    bool has_a = false, has_b = false;
    Weights a, b;
  };
  std::map<std::pair<int64_t, std::string>, Pair> pairs;
  for (const auto& [key, entry] : st.entries()) {
    std::smatch m;
    if (!std::regex_match(key, m, kKey)) {
      throw InvalidArgument(fw + ": tensor '" + key + "' is not a LoRA A/B weight of a Llama linear (" +
                            AllModulesList() + "); such modules are not supported");
    }
    std::string module = m[3].str();
    int64_t layer = std::stoll(m[2].str());
    if (!shapes.count(module)) {
      throw InvalidArgument(fw + ": tensor '" + key + "' targets '" + module + "'; supported LoRA modules are " +
                            AllModulesList());
    }
    if (layer >= L) {
      throw InvalidArgument(fw + ": tensor '" + key + "' is for layer " + std::to_string(layer) +
                            ", but the base model has " + std::to_string(L) + " layers");
    }
    Pair& p = pairs[{layer, module}];
    p.module_key = m[1].str();
    if (m[4].str() == "A") {
      p.a = ToFloat(entry, fw, key);
      p.has_a = true;
    } else {
      p.b = ToFloat(entry, fw, key);
      p.has_b = true;
    }
  }
  if (pairs.empty()) throw InvalidArgument(fw + " holds no LoRA weights");

  std::map<std::pair<int64_t, std::string>, double> scales_lm;
  int64_t rank = 0;
  for (auto& [lm, p] : pairs) {
    const auto& [layer, module] = lm;
    if (!p.has_a || !p.has_b) {
      throw InvalidArgument(fw + ": layer " + std::to_string(layer) + " " + module + " has lora_" +
                            (p.has_a ? "A" : "B") + " but not lora_" + (p.has_a ? "B" : "A"));
    }
    auto [in_f, out_f] = shapes.at(module);
    if (p.a.shape.size() != 2 || p.a.shape[1] != in_f) {
      throw InvalidArgument(fw + ": tensor '" + p.a.key + "' has the wrong shape, expected (r, " +
                            std::to_string(in_f) + ") for " + module + " of the base model");
    }
    int64_t r = p.a.shape[0];
    if (p.b.shape.size() != 2 || p.b.shape[0] != out_f || p.b.shape[1] != r) {
      throw InvalidArgument(fw + ": tensor '" + p.b.key + "' has the wrong shape, expected (" + std::to_string(out_f) +
                            ", " + std::to_string(r) + ") for " + module + " of the base model");
    }
    p.a.rows = r;
    p.a.cols = in_f;
    JSON rv = PatternValue(rank_pattern, p.module_key, JSON(tvm::ffi::Any(), "", fcfg));
    double r_cfg = rv.is_null() ? r_default : PositiveNumber(rv, fcfg, "rank_pattern value");
    if (static_cast<double>(r) != r_cfg) {
      throw InvalidArgument(fw + ": tensor '" + p.a.key + "' has rank " + std::to_string(r) +
                            ", but adapter_config.json gives r=" + std::to_string(static_cast<int64_t>(r_cfg)) +
                            " for " + p.module_key);
    }
    JSON av = PatternValue(alpha_pattern, p.module_key, JSON(tvm::ffi::Any(), "", fcfg));
    double alpha = av.is_null() ? alpha_default : PositiveNumber(av, fcfg, "alpha_pattern value");
    scales_lm[lm] = rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
    rank = std::max(rank, r);
  }
  std::vector<std::string> modules;  // canonical order
  for (const char* m : kAllModules) {
    for (const auto& [lm, p] : pairs) {
      if (lm.second == m) {
        modules.push_back(m);
        break;
      }
    }
  }
  // ---- spec checks (peft.py and layout.pack_adapter)
  if (rank > spec.max_rank) {
    throw InvalidArgument("adapter " + name + " has rank " + std::to_string(rank) + ", above the compiled --max-lora-rank " +
                          std::to_string(spec.max_rank));
  }
  std::string missing, compiled;
  for (const LoraModule& m : spec.modules) compiled += (compiled.empty() ? "" : ", ") + m.name;
  for (const std::string& m : modules) {
    bool ok = std::any_of(spec.modules.begin(), spec.modules.end(), [&](const LoraModule& x) { return x.name == m; });
    if (!ok) missing += (missing.empty() ? "'" : ", '") + m + "'";
  }
  if (!missing.empty()) {
    throw InvalidArgument("adapter " + name + " targets [" + missing +
                          "], which the model was not compiled for (compiled LoRA modules: " + compiled + ")");
  }
  // Table scale of a module: its scale in the lowest layer; other layers fold the ratio into B^T.
  std::map<std::string, double> scales;
  for (const auto& [lm, s] : scales_lm) {
    if (!scales.count(lm.second)) scales[lm.second] = s;  // map order: lowest layer first
  }

  // ---- layout.layout_adapter: best-fit-decreasing rows
  const int64_t E = spec.page_elems, M = static_cast<int64_t>(spec.modules.size()), R = spec.max_rank;
  struct Row {
    int64_t len;
    size_t mi;
    int ab;
    int64_t k;
  };
  std::vector<Row> rows;
  for (size_t mi = 0; mi < spec.modules.size(); ++mi) {
    const LoraModule& m = spec.modules[mi];
    if (std::find(modules.begin(), modules.end(), m.name) == modules.end()) continue;
    if (std::max(m.in_features, m.out_features) > E) {
      throw InvalidArgument("rows of " + m.name + " exceed a page of " + std::to_string(E) + " elements");
    }
    for (int64_t k = 0; k < rank; ++k) rows.push_back({m.in_features, mi, 0, k});
    for (int64_t k = 0; k < rank; ++k) rows.push_back({m.out_features, mi, 1, k});
  }
  std::stable_sort(rows.begin(), rows.end(), [](const Row& x, const Row& y) { return x.len > y.len; });
  std::vector<int64_t> free;
  PackedAdapter out;
  out.rank = rank;
  out.a_off.assign(M * R, -1);
  out.b_off.assign(M * R, -1);
  out.scale.assign(M, 0.0f);
  for (const Row& row : rows) {
    int64_t best = -1;
    for (size_t j = 0; j < free.size(); ++j) {
      if (free[j] >= row.len && (best < 0 || free[j] < free[best])) best = static_cast<int64_t>(j);
    }
    if (best < 0) {
      free.push_back(E);
      best = static_cast<int64_t>(free.size()) - 1;
    }
    int32_t off = static_cast<int32_t>(best * E + (E - free[best]));
    (row.ab == 0 ? out.a_off : out.b_off)[row.mi * R + row.k] = off;
    free[best] -= row.len;
  }
  const int64_t n = static_cast<int64_t>(free.size());

  // ---- layout.pack_adapter
  std::vector<float> pages(static_cast<size_t>(L * n * E), 0.0f);
  for (size_t mi = 0; mi < spec.modules.size(); ++mi) {
    const LoraModule& m = spec.modules[mi];
    if (!scales.count(m.name)) continue;
    out.scale[mi] = static_cast<float>(scales[m.name]);
    for (int64_t l = 0; l < L; ++l) {
      auto it = pairs.find({l, m.name});
      if (it == pairs.end()) continue;  // layer not transformed: zero rows
      const Pair& p = it->second;
      int64_t r = p.a.shape[0];
      // numpy: float32 array * Python float -> the scalar is cast to float32 (NEP 50).
      float ratio = static_cast<float>(scales_lm[{l, m.name}] / scales[m.name]);
      float* layer = pages.data() + l * n * E;
      for (int64_t k = 0; k < r; ++k) {  // rows k >= r stay zero (padding)
        float* a = layer + out.a_off[mi * R + k];
        for (int64_t i = 0; i < m.in_features; ++i) a[i] = p.a.data[k * m.in_features + i];
        float* b = layer + out.b_off[mi * R + k];
        for (int64_t o = 0; o < m.out_features; ++o) b[o] = p.b.data[o * r + k] * ratio;
      }
    }
  }
  out.num_layers = L;
  out.num_pages = n;
  out.page_elems = E;
  if (dtype == "float32") {
    out.pages.resize(pages.size() * 4);
    std::memcpy(out.pages.data(), pages.data(), out.pages.size());
  } else if (dtype == "float16" || dtype == "bfloat16") {
    std::vector<uint16_t> half(pages.size());
    for (size_t i = 0; i < pages.size(); ++i) half[i] = dtype == "float16" ? FloatToHalf(pages[i]) : FloatToBF16(pages[i]);
    out.pages.resize(half.size() * 2);
    std::memcpy(out.pages.data(), half.data(), out.pages.size());
  } else {
    throw NotAvailable("adapters on a " + dtype + " model are not supported (float32, float16, bfloat16)");
  }
  return out;
}

}  // namespace detail
}  // namespace mlc_lora
