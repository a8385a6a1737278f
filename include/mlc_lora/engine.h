/*!
 * \file mlc_lora/engine.h
 * \brief Run a compiled mlc-lora model folder from C++: batched generation, streaming, adapters.
 *
 * \code
 *   mlc_lora::Engine engine("dist/smollm2-llvm");            // device "cpu"
 *   mlc_lora::Request req;
 *   req.messages = {{"user", "What is the capital of France?"}};
 *   req.config.max_tokens = 32;
 *   auto res = engine.Generate({req}, [](size_t i, int32_t tok, const std::string& delta) {
 *     std::cout << delta << std::flush;
 *   });
 * \endcode
 *
 * Every error is a mlc_lora::Error (error.h); after one the engine is unchanged and usable.
 * An Engine is not thread-safe: call it from one thread at a time.
 */
#ifndef MLC_LORA_ENGINE_H_
#define MLC_LORA_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "error.h"
#include "tokenizer.h"

namespace mlc_lora {

struct EngineOptions {
  /*! \brief "cpu", "cuda" or "cuda:N"; must match the compiled target. */
  std::string device = "cpu";
  /*! \brief Sequences decoded together; 0 = the compiled max_batch_size. */
  int max_batch_size = 0;
  /*! \brief KV-cache capacity in tokens over all sequences; 0 = one context window. A model
   *  compiled with LoRA has a fixed pool: 0 or (pool_pages - 1) * page_size (KV and adapter pages;
   *  page_size is the config's contract.page_size). */
  int64_t max_total_tokens = 0;
  /*! \brief Tokens per prefill call; 0 = the compiled prefill_chunk_size. */
  int prefill_chunk_size = 0;
};

struct GenerationConfig {
  int max_tokens = 128;
  /*! \brief 0 = greedy (argmax). Otherwise softmax(logits / temperature), then top_k / top_p. */
  float temperature = 0.0f;
  float top_p = 1.0f;
  /*! \brief 0 = no top-k cut. */
  int top_k = 0;
  /*! \brief Seed of this request's sampler (results are reproducible for a seed). */
  uint64_t seed = 0;
  /*! \brief Keep generating past the end-of-sequence tokens (until max_tokens). */
  bool ignore_eos = false;
};

struct Message {
  std::string role;
  std::string content;
};

/*! \brief One generation request. Exactly one of prompt_ids, prompt, messages is used, in that order. */
struct Request {
  std::vector<int32_t> prompt_ids;  ///< token ids, used as-is
  std::string prompt;               ///< raw text, tokenized without a chat template
  std::vector<Message> messages;    ///< a chat, rendered with the model's chat template
  /*! \brief Name of a loaded adapter; empty = the base model. */
  std::string adapter;
  GenerationConfig config;
};

struct Result {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> output_ids;  ///< generated ids, without the stop token
  std::string text;                 ///< output_ids decoded, special tokens skipped
  std::string finish_reason;        ///< "stop" (end-of-sequence token) or "length"
};

/*!
 * \brief Called once per generated token: request index (into the vector given to Generate),
 * the token id, and the new text it completes (may be empty while a UTF-8 character is split
 * over tokens; the deltas of one request concatenate to Result::text). An exception thrown by the
 * callback stops generation, frees the requests' KV memory and propagates out of Generate.
 */
using StreamCallback = std::function<void(size_t request, int32_t token, const std::string& delta)>;

class Engine {
 public:
  /*! \brief Open a folder written by `mlc_lora compile`. Throws ModelError / InvalidArgument. */
  explicit Engine(const std::string& model_dir, const EngineOptions& options = EngineOptions());
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;

  const Tokenizer& tokenizer() const;
  /*! \brief The model's chat template (ChatML renderer; see docs/CPP.md) applied to messages. */
  std::string ApplyChatTemplate(const std::vector<Message>& messages,
                                bool add_generation_prompt = true) const;
  /*! \brief Token ids a request's prompt stands for (after the chat template). */
  std::vector<int32_t> PromptIds(const Request& request) const;

  /*!
   * \brief Generate for several requests at once, each with its own adapter and sampling
   * settings. All requests are validated before any work starts.
   */
  std::vector<Result> Generate(const std::vector<Request>& requests,
                               const StreamCallback& on_token = nullptr);
  Result Generate(const Request& request, const StreamCallback& on_token = nullptr);

  // --- adapters (PEFT LoRA folders) -------------------------------------------------------------
  /*! \brief Whether the model was compiled with LoRA (--max-lora-rank, --lora-pool-pages). */
  bool adapters_available() const;
  /*!
   * \brief Load a PEFT folder (adapter_config.json + adapter_model.safetensors) under `name` into
   * the unified page pool. Throws ModelError (missing / malformed files), InvalidArgument (name
   * taken, rank above --max-lora-rank, unsupported option or target module, pool full) or
   * NotAvailable (model compiled without LoRA); on a throw nothing is loaded.
   */
  void LoadAdapter(const std::string& name, const std::string& peft_dir);
  /*! \brief Frees the adapter's pages; requests may no longer name it. */
  void UnloadAdapter(const std::string& name);
  /*! \brief A pinned adapter is never evicted from the page pool. */
  void PinAdapter(const std::string& name, bool pinned = true);
  std::vector<std::string> ListAdapters() const;

  /*! \brief Free page-pool capacity in tokens (whole free pages): between calls, all pages not
   *  holding adapters. */
  int64_t kv_cache_free_tokens() const;
  /*! \brief Compiled model facts. */
  int32_t vocab_size() const;
  int64_t context_window_size() const;
  const std::string& model_dir() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mlc_lora

#endif  // MLC_LORA_ENGINE_H_
