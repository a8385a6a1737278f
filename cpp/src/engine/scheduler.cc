/*!
 * \file scheduler.cc
 * \brief Requests through the engine: validation before any KV change, admission while a batch
 *        slot and the request's worst-case pages (KV and its adapter's) are free or held by idle
 *        adapters (the pool evicts those, least recently used first), chunked prefill, batched decode,
 *        streaming of whole UTF-8 characters, and cleanup that leaves the cache as it was.
 */
#include <tvm/ffi/error.h>

#include <algorithm>
#include <set>

#include "engine/engine_impl.h"

namespace mlc_lora {

namespace ffi = tvm::ffi;
using detail::Running;

std::vector<int32_t> Engine::Impl::PromptIds(const Request& r) const {
  if (!r.prompt_ids.empty()) return r.prompt_ids;
  if (!r.prompt.empty()) return tokenizer.Encode(r.prompt, /*add_special_tokens=*/true);
  if (!r.messages.empty()) return tokenizer.Encode(chat.Apply(r.messages, true), false);
  throw InvalidArgument("request has no prompt (set prompt_ids, prompt or messages)");
}

// Validates every request and turns it into a Running; throws before any KV state changes.
std::vector<Running> Engine::Impl::Prepare(const std::vector<Request>& reqs) const {
  // What one request can have with nothing else running: the free pages and those of idle
  // unpinned adapters (pinned adapters keep theirs).
  int64_t total_pages = Headroom({});
  std::vector<Running> out;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Request& r = reqs[i];
    std::string who = "request " + std::to_string(i) + ": ";
    const GenerationConfig& g = r.config;
    if (!r.adapter.empty() && !adapters.count(r.adapter)) throw InvalidArgument(who + UnknownAdapter(r.adapter));
    if (g.max_tokens < 1) throw InvalidArgument(who + "max_tokens must be >= 1");
    if (!(g.temperature >= 0.0f)) throw InvalidArgument(who + "temperature must be >= 0");
    if (!(g.top_p > 0.0f && g.top_p <= 1.0f)) throw InvalidArgument(who + "top_p must be in (0, 1]");
    if (g.top_k < 0) throw InvalidArgument(who + "top_k must be >= 0");
    std::vector<int32_t> ids;
    try {
      ids = PromptIds(r);
    } catch (const Error& e) {
      throw InvalidArgument(who + e.what());
    }
    if (ids.empty()) throw InvalidArgument(who + "the prompt is empty after tokenization");
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_size) {
        throw InvalidArgument(who + "token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                              std::to_string(vocab_size) + ")");
      }
    }
    int64_t n = static_cast<int64_t>(ids.size());
    if (n >= context_window) {
      throw InvalidArgument(who + "prompt of " + std::to_string(n) + " tokens does not fit the context window of " +
                            std::to_string(context_window));
    }
    int budget = static_cast<int>(std::min<int64_t>(g.max_tokens, context_window - n));
    int64_t pages = PagesFor(n + budget);
    if (pages > PoolStat("total_pages")) {
      throw InvalidArgument(who + std::to_string(n) + " prompt + " + std::to_string(budget) +
                            " new tokens exceed the KV cache (" + std::to_string(PoolStat("total_pages") * contract.page_size) +
                            " tokens); raise EngineOptions::max_total_tokens");
    }
    out.emplace_back(i, -1, std::move(ids), budget, pages, g);
    Running& run = out.back();
    run.result.prompt_ids = run.prompt;
    if (!r.adapter.empty()) run.adapter = adapters.at(r.adapter);
    int64_t need = AdmissionPages(run, {});
    if (need > total_pages) {
      std::string what = "its KV (" + std::to_string(pages) + " pages)";
      if (need > pages) what = "adapter '" + r.adapter + "' (" + std::to_string(need - pages) + " pages) and " + what;
      int64_t pinned = PoolStat("adapter_pages") - PoolStat("evictable_pages");
      throw InvalidArgument(who + what + " need more than the " + std::to_string(total_pages) +
                            " pages the pool can give with nothing else running (" + std::to_string(pinned) +
                            " held by pinned adapters); unpin or unload adapters, lower max_tokens, or compile "
                            "with more --lora-pool-pages");
    }
  }
  return out;
}

int64_t Engine::Impl::Headroom(const std::vector<Running*>& active) const {
  int64_t reserved = 0;
  for (const Running* r : active) reserved += r->reserved_pages;
  // KV the active requests hold already is part of their reservation; adapters they use that are
  // not resident yet are paged in by their next forward pass.
  int64_t out = pool_admittable(kv).cast<int64_t>() + PoolStat("kv_pages") - reserved;
  std::set<int64_t> seen;
  for (const Running* r : active) {
    if (r->adapter >= 0 && seen.insert(r->adapter).second && !AdapterStat(r->adapter, "resident")) {
      out -= AdapterStat(r->adapter, "num_pages");
    }
  }
  return out;
}

int64_t Engine::Impl::AdmissionPages(const Running& r, const std::vector<Running*>& active) const {
  if (r.adapter < 0) return r.reserved_pages;
  for (const Running* a : active) {
    if (a->adapter == r.adapter) return r.reserved_pages;  // counted with that request
  }
  bool kept = AdapterStat(r.adapter, "pinned") && AdapterStat(r.adapter, "resident");
  return r.reserved_pages + (kept ? 0 : AdapterStat(r.adapter, "num_pages"));
}

// Takes a sampled token: stop, or append it and stream its text.
void Engine::Impl::Accept(Running* r, int32_t token, const GenerationConfig& g, const StreamCallback& cb) {
  if (!g.ignore_eos && stop_ids.count(token)) {
    r->done = true;
    r->result.finish_reason = "stop";
  } else {
    r->result.output_ids.push_back(token);
    r->pending += tokenizer.TokenBytes(token, /*skip_special_tokens=*/true);
    size_t cut = CompleteUTF8Prefix(r->pending);
    std::string delta = SanitizeUTF8(r->pending.substr(0, cut));
    r->pending.erase(0, cut);
    if (--r->budget == 0) {
      r->done = true;
      r->result.finish_reason = "length";
      delta += SanitizeUTF8(r->pending);
      r->pending.clear();
    }
    r->result.text += delta;
    if (cb) cb(r->index, token, delta);
  }
  if (r->done && !r->pending.empty()) {  // flush an incomplete tail at a stop token
    std::string tail = SanitizeUTF8(r->pending);
    r->pending.clear();
    r->result.text += tail;
    if (cb) cb(r->index, token, tail);
  }
}

std::vector<Result> Engine::Impl::Generate(const std::vector<Request>& reqs, const StreamCallback& cb) {
  std::vector<Running> runs = Prepare(reqs);
  std::vector<Result> results(reqs.size());
  std::vector<Running*> active;
  size_t next = 0;
  try {
    while (next < runs.size() || !active.empty()) {
      // Admit, in order, while a batch slot and the request's worst-case pages (KV, and its
      // adapter's unless already counted) are free or held by idle adapters.
      std::vector<Running*> admitted;
      while (next < runs.size() && static_cast<int>(active.size()) < max_batch &&
             AdmissionPages(runs[next], active) <= Headroom(active)) {
        Running* r = &runs[next++];
        r->seq_id = next_seq_id++;
        kv_add(kv, r->seq_id);
        active.push_back(r);  // before anything else can throw: the cleanup below removes it
        admitted.push_back(r);
        if (lora) pool_set_seq(kv, r->seq_id, r->adapter);
      }
      PrefillAll(admitted, reqs, cb);
      std::vector<Running*> stepping;
      for (Running* r : active) {
        if (!r->done) stepping.push_back(r);
      }
      if (!stepping.empty()) {
        std::vector<int64_t> ids;
        std::vector<int32_t> toks;
        for (Running* r : stepping) {
          ids.push_back(r->seq_id);
          toks.push_back(r->result.output_ids.back());
        }
        std::vector<float> logits = Decode(ids, toks);
        for (size_t k = 0; k < stepping.size(); ++k) {
          Running* r = stepping[k];
          Accept(r, r->sampler.Next(&logits[k * vocab_size], vocab_size), reqs[r->index].config, cb);
        }
      }
      // Retire finished requests.
      for (auto it = active.begin(); it != active.end();) {
        Running* r = *it;
        if (!r->done) {
          ++it;
          continue;
        }
        kv_remove(kv, r->seq_id);
        r->seq_id = -1;
        results[r->index] = std::move(r->result);
        it = active.erase(it);
      }
    }
  } catch (...) {
    for (Running* r : active) {  // leave the cache as it was
      try {
        if (r->seq_id >= 0) kv_remove(kv, r->seq_id);
      } catch (...) {
      }
    }
    try {
      throw;
    } catch (const ffi::Error& e) {
      throw Error(std::string("model execution failed: ") + e.what());
    }
  }
  return results;
}

// Prefill newly admitted requests in chunks of at most prefill_chunk tokens (a long prompt
// spans several chunks); each request's first token comes from its last chunk's logits.
void Engine::Impl::PrefillAll(const std::vector<Running*>& admitted, const std::vector<Request>& reqs,
                              const StreamCallback& cb) {
  size_t i = 0;
  while (i < admitted.size()) {
    std::vector<int64_t> ids;
    std::vector<std::vector<int32_t>> chunks;
    std::vector<Running*> finishing;
    int64_t room = prefill_chunk;
    for (size_t j = i; j < admitted.size() && room > 0 && static_cast<int>(ids.size()) < max_batch; ++j) {
      Running* r = admitted[j];
      size_t take = std::min<size_t>(room, r->prompt.size() - r->prefilled);
      ids.push_back(r->seq_id);
      chunks.emplace_back(r->prompt.begin() + r->prefilled, r->prompt.begin() + r->prefilled + take);
      r->prefilled += take;
      room -= static_cast<int64_t>(take);
      finishing.push_back(r->prefilled == r->prompt.size() ? r : nullptr);
    }
    std::vector<float> logits = Prefill(ids, chunks);
    for (size_t k = 0; k < finishing.size(); ++k) {
      if (Running* r = finishing[k]) {
        Accept(r, r->sampler.Next(&logits[k * vocab_size], vocab_size), reqs[r->index].config, cb);
      }
    }
    while (i < admitted.size() && admitted[i]->prefilled == admitted[i]->prompt.size()) ++i;
  }
}

}  // namespace mlc_lora
