/*!
 * \file chat_template.h
 * \brief A built-in renderer for ChatML templates (SmolLM2, Qwen, ...); C++ has no jinja.
 *
 * Renders `<|im_start|>{role}\n{content}<|im_end|>\n` per message and `<|im_start|>assistant\n`
 * for the generation prompt. A default system message written literally in the template (as
 * SmolLM2's "You are a helpful AI assistant named SmolLM...") is inserted when the chat does not
 * start with a system message, exactly as the jinja template does.
 */
#ifndef MLC_LORA_CPP_CHAT_TEMPLATE_H_
#define MLC_LORA_CPP_CHAT_TEMPLATE_H_

#include <string>
#include <vector>

#include "mlc_lora/engine.h"

namespace mlc_lora {
namespace detail {

class ChatTemplate {
 public:
  ChatTemplate() = default;
  /*! \brief From the jinja source in the model config (empty = none). */
  explicit ChatTemplate(const std::string& jinja);
  /*! \brief Throws NotAvailable if the template is not ChatML, InvalidArgument on an empty chat. */
  std::string Apply(const std::vector<Message>& messages, bool add_generation_prompt) const;

 private:
  bool chatml_ = false;
  bool has_default_system_ = false;
  std::string default_system_;
  std::string source_;
};

}  // namespace detail
}  // namespace mlc_lora

#endif  // MLC_LORA_CPP_CHAT_TEMPLATE_H_
