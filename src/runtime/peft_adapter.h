/*!
 * \file peft_adapter.h
 * \brief PEFT LoRA folders (adapter_config.json + adapter_model.safetensors) read, checked against
 *        a compiled model and packed into the pool's input: the one implementation, behind
 *        `mlc_lora.runtime.peft_adapter_plan` / `pack_peft_adapter` and the C++ API.
 *
 * Only the plain LoRA forward `y += scale * (x @ A.T) @ B.T` on the contract's Llama linears is
 * served; every PEFT option that changes that maths is refused by name rather than silently
 * ignored. Weights are read from safetensors only (never pickle). Per-module ranks
 * (rank_pattern) are padded with zero rows to the adapter's largest; per-layer scales
 * (alpha_pattern) are folded into B^T against the module's scale in its lowest layer, which is
 * the scale the tables carry.
 *
 * Errors: ModelError for a missing or malformed folder or file, InvalidArgument for an option,
 * rank, target or shape the compiled model cannot serve, NotAvailable for a model dtype.
 */
#ifndef MLC_LORA_RUNTIME_PEFT_ADAPTER_H_
#define MLC_LORA_RUNTIME_PEFT_ADAPTER_H_

#include <tvm/ffi/any.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lora_layout.h"
#include "safetensors.h"

namespace mlc_lora {

/*! \brief A PEFT folder read and checked against a compiled model: everything but the pages. */
struct PeftAdapter {
  std::string folder, name;
  int64_t rank = 0;                      // the largest rank of its modules
  std::vector<std::string> modules;      // targeted modules, canonical order
  std::map<std::string, double> scales;  // module -> table scale (alpha/r or alpha/sqrt(r))
  tvm::ffi::Any lora_alpha;              // as adapter_config.json gives it (8 when absent)
  bool use_rslora = false;
  std::vector<std::string> warnings;     // options accepted but ignored
  int64_t num_pages = 0;                 // pages per layer of the packed adapter (each shard's)

  // The mapped weights: per (layer, module) its A (r, in) and B (out, r), the rank r and the
  // ratio of its scale to the module's table scale (folded into B^T).
  struct Pair {
    const SafeTensorsFile::Entry* a = nullptr;
    const SafeTensorsFile::Entry* b = nullptr;
    std::string a_name, b_name;  // the tensors' names in the file (for errors)
    int64_t r = 0;
    double ratio = 1.0;
  };
  std::shared_ptr<SafeTensorsFile> file;
  std::map<std::pair<int64_t, std::string>, Pair> pairs;
};

/*!
 * \brief Read `folder`'s adapter_config.json and safetensors header and check them against the
 *        compiled model `spec` (rank, modules, shapes, layers); `name` names it in errors
 *        (default: the folder's name). No tensor data is read.
 */
PeftAdapter ReadPeftAdapter(const std::string& folder, const LoraSpec& spec, std::string name = "");

/*! \brief Pack a read adapter for shard `shard` of the model compiled with `spec`. */
PackedAdapter PackPeftAdapter(const PeftAdapter& adapter, const LoraSpec& spec, int64_t shard = 0);

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_PEFT_ADAPTER_H_
