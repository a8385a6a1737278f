/*!
 * \file engine.cc
 * \brief The public Engine (include/mlc_lora/engine.h): construction and the methods that only
 *        forward to Engine::Impl (engine_impl.h).
 */
#include <tvm/ffi/error.h>

#include "engine/engine_impl.h"

namespace mlc_lora {

namespace ffi = tvm::ffi;

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

int64_t Engine::kv_cache_free_tokens() const {
  return impl_->kv_pages(impl_->kv).cast<int64_t>() * impl_->contract.page_size;
}
int32_t Engine::vocab_size() const { return impl_->vocab_size; }
int64_t Engine::context_window_size() const { return impl_->context_window; }
const std::string& Engine::model_dir() const { return impl_->model_dir; }

}  // namespace mlc_lora
