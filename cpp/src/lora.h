/*!
 * \file lora.h
 * \brief PEFT LoRA folders -> the unified pool's adapter input; a port of
 *        python/mlc_lora/lora/peft.py (load_peft_adapter) and layout.py (pack_adapter), bit-exact.
 */
#ifndef MLC_LORA_CPP_LORA_H_
#define MLC_LORA_CPP_LORA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "json.h"

namespace mlc_lora {
namespace detail {

struct LoraModule {
  std::string name;
  int64_t in_features, out_features;
};

/*! \brief The "lora" block of mlc-lora-config.json: what the model was compiled for. */
struct LoraSpec {
  int64_t num_layers = 0, page_elems = 0, max_rank = 0, pool_pages = 0;
  std::vector<LoraModule> modules;
  std::string kernel;
  static LoraSpec FromJSON(const JSON& lora);
};

/*! \brief Input of mlc_lora.runtime.pool_load_adapter (layout.PackedAdapter). */
struct PackedAdapter {
  int64_t num_layers = 0, num_pages = 0, page_elems = 0;
  std::vector<uint8_t> pages;   // [L, n, E] in the model dtype
  std::vector<int32_t> a_off;   // [M, R], local offsets, -1 unused
  std::vector<int32_t> b_off;   // [M, R]
  int64_t rank = 0;
  std::vector<float> scale;     // [M], 0 for modules the adapter does not target
};

/*!
 * \brief Read and validate the PEFT folder `dir` against the base model (`model_config` of the
 *        compiled config) and `spec`, and pack it in `dtype` ("float32", "float16", "bfloat16").
 *        Throws InvalidArgument (bad option, rank, target) or ModelError (missing / malformed files).
 */
PackedAdapter PackPeftAdapter(const std::string& dir, const JSON& model_config, const LoraSpec& spec,
                              const std::string& dtype, const std::string& name);

}  // namespace detail
}  // namespace mlc_lora

#endif  // MLC_LORA_CPP_LORA_H_
