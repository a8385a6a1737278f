#include "chat_template.h"

namespace mlc_lora {
namespace detail {

namespace {
void ReplaceAll(std::string* s, const std::string& from, const std::string& to) {
  for (size_t p = 0; (p = s->find(from, p)) != std::string::npos; p += to.size()) s->replace(p, from.size(), to);
}
}  // namespace

ChatTemplate::ChatTemplate(const std::string& jinja) : source_(jinja) {
  chatml_ = jinja.find("<|im_start|>") != std::string::npos && jinja.find("<|im_end|>") != std::string::npos;
  if (!chatml_) return;
  // The default system message: a literal "<|im_start|>system\n...<|im_end|>" in the template
  // (either a real newline or jinja's "\n" escape).
  for (const std::string& head : {std::string("<|im_start|>system\n"), std::string("<|im_start|>system\\n")}) {
    size_t p = jinja.find(head);
    if (p == std::string::npos) continue;
    size_t end = jinja.find("<|im_end|>", p + head.size());
    if (end == std::string::npos) break;
    default_system_ = jinja.substr(p + head.size(), end - p - head.size());
    ReplaceAll(&default_system_, "\\n", "\n");
    has_default_system_ = default_system_.find('\'') == std::string::npos &&
                          default_system_.find('{') == std::string::npos;  // a literal, not an expression
    break;
  }
}

std::string ChatTemplate::Apply(const std::vector<Message>& messages, bool add_generation_prompt) const {
  if (!chatml_) {
    throw NotAvailable(source_.empty()
                           ? "this model has no chat template; pass the prompt as text or token ids"
                           : "the C++ engine renders only ChatML chat templates (<|im_start|>role ... "
                             "<|im_end|>); this model's template is not one: pass the prompt as text or ids");
  }
  if (messages.empty()) throw InvalidArgument("a chat needs at least one message");
  std::string out;
  if (has_default_system_ && messages[0].role != "system") {
    out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
  }
  for (const Message& m : messages) {
    if (m.role.empty()) throw InvalidArgument("a chat message has an empty role");
    out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace detail
}  // namespace mlc_lora
