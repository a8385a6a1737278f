/*!
 * \file lora_layout.cc
 * \brief The page layout of adapter rows and packing an adapter into pages (lora_layout.h).
 */
#include "lora_layout.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "mlc_lora/error.h"

namespace mlc_lora {

namespace ffi = tvm::ffi;

namespace {

/*! \brief Zeroed, 64-byte aligned host memory for the packed tensors. */
struct HostAlloc {
  void AllocData(DLTensor* t) {
    size_t n = std::max<size_t>(ffi::GetDataSize(*t), 1);
    void* p = nullptr;
    if (posix_memalign(&p, 64, n) != 0) throw std::bad_alloc();
    std::memset(p, 0, n);
    t->data = p;
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

ffi::Tensor HostTensor(std::vector<int64_t> shape, DLDataType dtype) {
  return ffi::Tensor::FromNDAlloc(HostAlloc{}, ffi::ShapeView(shape.data(), shape.size()), dtype,
                                  DLDevice{kDLCPU, 0});
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

DLDataType PageDType(const std::string& dtype) {
  if (dtype == "float32") return DLDataType{kDLFloat, 32, 1};
  if (dtype == "float16") return DLDataType{kDLFloat, 16, 1};
  if (dtype == "bfloat16") return DLDataType{kDLBfloat, 16, 1};
  throw NotAvailable("adapters on a " + dtype + " model are not supported (float32, float16, bfloat16)");
}

#if defined(__x86_64__) && defined(__GNUC__)
/*!
 * \brief FloatToHalf over n floats with the F16C instructions, 8 at a time (round to nearest even,
 *        as FloatToHalf); a group holding a NaN takes FloatToHalf (the instruction keeps payloads).
 *        Returns how many it converted; the caller converts the rest.
 */
__attribute__((target("avx,f16c"))) int64_t FloatsToHalvesF16C(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
      for (int j = 0; j < 8; ++j) dst[i + j] = FloatToHalf(src[i + j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return i;
}
#endif

/*! \brief Write `n` floats at element `at` of `base` (a buffer of `dtype`). */
void Store(void* base, DLDataType dtype, int64_t at, const float* src, int64_t n) {
  if (dtype.bits == 32) {
    std::memcpy(static_cast<float*>(base) + at, src, n * sizeof(float));
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(base) + at;
  int64_t i = 0;
  if (dtype.code == kDLFloat) {
#if defined(__x86_64__) && defined(__GNUC__)
    static const bool f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    if (f16c) i = FloatsToHalvesF16C(src, dst, n);
#endif
    for (; i < n; ++i) dst[i] = FloatToHalf(src[i]);
  } else {
    for (; i < n; ++i) dst[i] = FloatToBF16(src[i]);
  }
}

}  // namespace

RowFormat RowFormat::Of(const std::string& rows, int64_t elem_bytes, int64_t int8_align) {
  if (rows != "model" && rows != "int8") {
    throw InvalidArgument("unknown adapter row format '" + rows + "' (model, int8)");
  }
  if (elem_bytes != 2 && elem_bytes != 4) {
    throw InvalidArgument("adapter rows on pages of " + std::to_string(elem_bytes) + "-byte elements (2, 4)");
  }
  RowFormat f;
  f.elem_bytes = elem_bytes;
  if (rows == "int8") {
    if (int8_align < 4 || int8_align % 4 != 0) {
      throw InvalidArgument("int8 adapter rows need a row alignment of a multiple of 4 bytes, not " +
                            std::to_string(int8_align) + " (a config from an older mlc-lora? compile it again)");
    }
    f.align = int8_align;
  }
  return f;
}

int64_t RowFormat::Elems(int64_t n) const {
  if (!int8()) return n;
  return (align + (n + align - 1) / align * align) / elem_bytes;
}

bool QuantizeRow(const float* w, int64_t n, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(w[i])) return false;
    amax = std::max(amax, std::fabs(w[i]));
  }
  const float s = amax / 127.f;
  for (int64_t i = 0; i < n; ++i) {
    // nearbyint: the current rounding mode, to nearest even by default (numpy's np.round)
    q[i] = s > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(w[i] / s), -127.f, 127.f)) : 0;
  }
  *scale = s;
  return true;
}

RowFormat LoraSpec::Rows() const {
  return RowFormat::Of(rows, PageDType(dtype).bits / 8, contract.int8_row_align);
}

std::string PyList(const std::vector<std::string>& items) {
  std::string s = "[";
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", '" : "'") + items[i] + "'";
  return s + "]";
}

LoraSpec LoraSpec::FromConfig(const JSON& config) {
  std::string model = config.get("model_name").is_string()
                          ? "model '" + config["model_name"].str() + "'" : std::string("the model");
  if (!config.has("lora")) {
    throw InvalidArgument(model + " was compiled without LoRA; recompile with --max-lora-rank and "
                          "--lora-pool-pages");
  }
  LoraSpec s;
  s.contract = Contract::FromConfig(config, model);
  JSON lora = config["lora"];
  s.num_layers = lora["num_layers"].i64();
  s.page_elems = lora["page_elems"].i64();
  s.max_rank = lora["max_rank"].i64();
  s.pool_pages = lora["pool_pages"].i64();
  s.shards = lora.get("tensor_parallel_shards").i64_or(1);
  s.kernel = lora.get("kernel").str_or("gather");
  s.dtype = config["dtype"].str();
  s.rows = lora.get("rows").str_or("model");
  s.Rows();  // an unknown format fails here, not at the first adapter
  for (const JSON& m : lora["modules"].items()) {
    s.modules.push_back({m["name"].str(), m["in_features"].i64(), m["out_features"].i64()});
  }
  return s;
}

int64_t LoraSpec::Index(const std::string& name) const {
  for (size_t i = 0; i < modules.size(); ++i) {
    if (modules[i].name == name) return static_cast<int64_t>(i);
  }
  return -1;
}

std::pair<int64_t, int64_t> LoraSpec::FullShape(const LoraModule& m) const {
  if (contract.IsColumnParallel(m.name)) return {m.in_features, m.out_features * shards};
  return {m.in_features * shards, m.out_features};
}

std::string LoraSpec::ModuleList() const {
  std::string s;
  for (const LoraModule& m : modules) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

AdapterLayout LayoutAdapter(int64_t E, const std::vector<LoraModule>& modules, int64_t rank,
                            const RowFormat& fmt) {
  struct Row {
    int64_t len;
    size_t mi;
    bool b;
    int64_t k;
  };
  std::vector<Row> rows;
  AdapterLayout out;
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    const LoraModule& m = modules[mi];
    const int64_t a_len = fmt.Elems(m.in_features), b_len = fmt.Elems(m.out_features);
    if (std::max(a_len, b_len) > E) {
      throw InvalidArgument("rows of " + m.name + " (" + std::to_string(m.in_features) + "/" +
                            std::to_string(m.out_features) + ") exceed a page of " + std::to_string(E));
    }
    for (int64_t k = 0; k < rank; ++k) rows.push_back({a_len, mi, false, k});
    for (int64_t k = 0; k < rank; ++k) rows.push_back({b_len, mi, true, k});
    out.used_elems += rank * (a_len + b_len);
  }
  // Stable: longest rows first, then module order, A before B, k ascending.
  std::stable_sort(rows.begin(), rows.end(), [](const Row& x, const Row& y) { return x.len > y.len; });
  std::vector<int64_t> free;  // free elements left in each local page
  out.a_off.assign(modules.size() * rank, -1);
  out.b_off.assign(modules.size() * rank, -1);
  for (const Row& row : rows) {
    int64_t best = -1;
    for (size_t j = 0; j < free.size(); ++j) {
      if (free[j] >= row.len && (best < 0 || free[j] < free[best])) best = static_cast<int64_t>(j);
    }
    if (best < 0) {
      free.push_back(E);
      best = static_cast<int64_t>(free.size()) - 1;
    }
    (row.b ? out.b_off : out.a_off)[row.mi * rank + row.k] =
        static_cast<int32_t>(best * E + (E - free[best]) + fmt.Lead());
    free[best] -= row.len;
  }
  out.num_pages = static_cast<int64_t>(free.size());
  return out;
}

PackedAdapter PackAdapter(const LoraSpec& spec, const std::string& name, int64_t rank,
                          const std::vector<std::string>& modules,
                          const std::map<std::string, double>& scales, const AdapterRows& rows,
                          int64_t shard) {
  if (shard < 0 || shard >= spec.shards) {
    throw InvalidArgument("shard " + std::to_string(shard) + " out of range for " +
                          std::to_string(spec.shards) + " shards");
  }
  if (rank < 1) {
    throw InvalidArgument("adapter " + name + " has rank " + std::to_string(rank) +
                          "; a LoRA rank must be >= 1");
  }
  if (rank > spec.max_rank) {
    throw InvalidArgument("adapter " + name + " has rank " + std::to_string(rank) +
                          ", above the compiled --max-lora-rank " + std::to_string(spec.max_rank));
  }
  std::vector<std::string> missing;
  for (const std::string& m : modules) {
    if (spec.Index(m) < 0) missing.push_back(m);
  }
  if (!missing.empty()) {
    throw InvalidArgument("adapter " + name + " targets " + PyList(missing) +
                          ", which the model was not compiled for (compiled LoRA modules: " +
                          spec.ModuleList() + ")");
  }
  const DLDataType dtype = PageDType(spec.dtype);
  std::vector<LoraModule> mods;  // targeted, in the spec's order
  for (const LoraModule& m : spec.modules) {
    if (std::find(modules.begin(), modules.end(), m.name) != modules.end()) mods.push_back(m);
  }
  const RowFormat fmt = spec.Rows();
  const AdapterLayout lay = LayoutAdapter(spec.page_elems, mods, rank, fmt);
  const int64_t L = spec.num_layers, E = spec.page_elems, n = lay.num_pages;
  const int64_t M = static_cast<int64_t>(spec.modules.size()), R = spec.max_rank;
  PackedAdapter out;
  out.name = name;
  out.rank = rank;
  out.pages = HostTensor({L, n, E}, dtype);
  out.a_off = HostTensor({M, R}, DLDataType{kDLInt, 32, 1});
  out.b_off = HostTensor({M, R}, DLDataType{kDLInt, 32, 1});
  out.scale = HostTensor({M}, DLDataType{kDLFloat, 32, 1});
  int32_t* a_off = static_cast<int32_t*>(out.a_off.data_ptr());
  int32_t* b_off = static_cast<int32_t*>(out.b_off.data_ptr());
  float* scale = static_cast<float*>(out.scale.data_ptr());
  std::fill(a_off, a_off + M * R, -1);
  std::fill(b_off, b_off + M * R, -1);
  void* pages = out.pages.data_ptr();
  std::vector<float> row;
  std::vector<int8_t> qrow;
  size_t j = 0;  // index into mods / lay
  for (int64_t mi = 0; mi < M; ++mi) {
    const LoraModule& m = spec.modules[mi];
    if (j >= mods.size() || mods[j].name != m.name) continue;
    auto sc = scales.find(m.name);
    if (sc == scales.end()) throw InvalidArgument("adapter " + name + " has no scale for " + m.name);
    scale[mi] = static_cast<float>(sc->second);
    out.modules.push_back(m.name);
    out.scales[m.name] = sc->second;
    for (int64_t k = 0; k < rank; ++k) {
      a_off[mi * R + k] = lay.a_off[j * rank + k];
      b_off[mi * R + k] = lay.b_off[j * rank + k];
    }
    const auto [in_full, out_full] = spec.FullShape(m);
    const bool column = spec.contract.IsColumnParallel(m.name);
    // This shard's slice of a full row: B^T's output columns (column-parallel) or A's inputs.
    const int64_t a_from = column ? 0 : shard * m.in_features;
    const int64_t b_from = column ? shard * m.out_features : 0;
    row.resize(std::max(in_full, out_full));
    for (int64_t l = 0; l < L; ++l) {
      if (!rows.Has(l, m.name)) continue;  // layer not transformed: zero rows
      for (int64_t k = 0; k < rank; ++k) {
        for (const bool b : {false, true}) {
          const int64_t at = l * n * E + (b ? b_off : a_off)[mi * R + k];
          const int64_t from = b ? b_from : a_from, len = b ? m.out_features : m.in_features;
          if (fmt.int8()) {  // the scale fmt.align bytes before the values (the rest of the lead stays 0)
            rows.Row(l, m.name, b, k, row.data());
            qrow.resize(len);
            float s = 0.f;
            if (!QuantizeRow(row.data() + from, len, qrow.data(), &s)) {
              throw InvalidArgument("adapter " + name + ": " + m.name + " layer " + std::to_string(l) +
                                    (b ? " lora_B" : " lora_A") + " holds a value that is not finite");
            }
            char* bytes = static_cast<char*>(pages) + at * fmt.elem_bytes;
            std::memcpy(bytes - fmt.align, &s, sizeof(float));
            std::memcpy(bytes, qrow.data(), len);
            continue;
          }
          if (dtype.bits == 16 && rows.RawRow(l, m.name, b, k, dtype, from, len, static_cast<uint16_t*>(pages) + at)) {
            continue;
          }
          rows.Row(l, m.name, b, k, row.data());
          Store(pages, dtype, at, row.data() + from, len);
        }
      }
    }
    ++j;
  }
  return out;
}

}  // namespace mlc_lora
