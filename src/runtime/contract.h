/*!
 * \file contract.h
 * \brief The "contract" block of a compiled model's config, read once for every C++ user.
 *
 * python/mlc_lora/contract.py is the one definition of what the compiler, the runtime and the
 * engines agree on; `compiled_contract()` writes it into mlc-lora-config.json. C++ reads it from
 * there (and nowhere else): the page size, the LoRA modules in canonical order, which of them
 * are column-parallel under tensor parallelism, the LoRA table inputs of prefill/decode, and how
 * int8 adapter rows are laid out.
 */
#ifndef MLC_LORA_RUNTIME_CONTRACT_H_
#define MLC_LORA_RUNTIME_CONTRACT_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "json.h"
#include "mlc_lora/error.h"

namespace mlc_lora {

struct Contract {
  int64_t page_size = 0;
  std::vector<std::string> lora_modules;             // every module LoRA can target, in order
  std::vector<std::string> column_parallel_modules;  // split by output rows under TP
  std::vector<std::string> lora_table_inputs;        // the per-batch inputs, in order
  int64_t int8_row_align = 0;  // int8 adapter rows: their scale's lead bytes and padding (0: none)

  /*!
   * \brief The contract of compiled config `config`; `what` names the model in errors.
   *        Throws ModelError when the config predates the block.
   */
  static Contract FromConfig(const JSON& config, const std::string& what) {
    if (!config.has("contract")) {
      throw ModelError(what + " was compiled by an older mlc-lora (its config has no \"contract\" "
                       "block); compile it again");
    }
    JSON c = config["contract"];
    Contract out;
    out.page_size = c["page_size"].i64();
    auto names = [](const JSON& list) {
      std::vector<std::string> v;
      for (const JSON& s : list.items()) v.push_back(s.str());
      return v;
    };
    out.lora_modules = names(c["lora_modules"]);
    out.column_parallel_modules = names(c["column_parallel_modules"]);
    out.lora_table_inputs = names(c["lora_table_inputs"]);
    out.int8_row_align = c.get("int8_row_align").i64_or(0);
    return out;
  }

  bool IsLoraModule(const std::string& m) const {
    return std::find(lora_modules.begin(), lora_modules.end(), m) != lora_modules.end();
  }
  bool IsColumnParallel(const std::string& m) const {
    return std::find(column_parallel_modules.begin(), column_parallel_modules.end(), m) !=
           column_parallel_modules.end();
  }
  /*! \brief "q_proj, k_proj, ..." for messages. */
  std::string LoraModuleList() const {
    std::string s;
    for (const std::string& m : lora_modules) s += (s.empty() ? "" : ", ") + m;
    return s;
  }
};

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_CONTRACT_H_
