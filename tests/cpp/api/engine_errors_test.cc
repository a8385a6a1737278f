// Bad input to the C++ API raises a clear mlc_lora exception and leaves the engine usable; plus
// the engine's own invariants (batched == single greedy, seeded sampling, streaming deltas).
// usage: engine_errors_test COMPILED_MODEL_DIR
#include <mlc_lora/engine.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <sys/stat.h>

using namespace mlc_lora;

namespace {

int failures = 0;

template <typename E>
void ExpectThrow(const std::string& what, const std::function<void()>& f, const std::string& must_contain) {
  try {
    f();
    std::cerr << "FAIL " << what << ": no exception\n";
    ++failures;
  } catch (const E& e) {
    std::string msg = e.what();
    if (msg.find(must_contain) == std::string::npos) {
      std::cerr << "FAIL " << what << ": message lacks '" << must_contain << "': " << msg << "\n";
      ++failures;
    } else {
      std::cout << "ok   " << what << " -> " << msg << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "FAIL " << what << ": wrong exception type: " << e.what() << "\n";
    ++failures;
  }
}

void Expect(bool cond, const std::string& what) {
  std::cout << (cond ? "ok   " : "FAIL ") << what << "\n";
  if (!cond) ++failures;
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string MakePeft(const std::string& root, const std::string& name, const std::string& rank,
                     const std::string& extra = "", const std::string& targets = "[\"q_proj\"]") {
  std::string dir = root + "/" + name;
  ::mkdir(dir.c_str(), 0755);
  WriteFile(dir + "/adapter_config.json",
            "{\"r\": " + rank + ", \"lora_alpha\": 16, \"target_modules\": " + targets + extra + "}");
  WriteFile(dir + "/adapter_model.safetensors", "");
  return dir;
}

Request Chat(const std::string& text, int max_tokens = 12) {
  Request r;
  r.messages = {{"user", text}};
  r.config.max_tokens = max_tokens;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::cerr << "usage: engine_errors_test COMPILED_MODEL_DIR [PEFT_DIR (a valid adapter, for a LoRA build)]\n";
    return 2;
  }
  std::string peft = argc == 3 ? argv[2] : "";
  std::string model = argv[1];
  char tmpl[] = "/tmp/mlc_lora_embed_XXXXXX";
  std::string tmp = ::mkdtemp(tmpl);

  ExpectThrow<ModelError>("missing model folder", [&] { Engine("/no/such/model"); }, "does not exist");
  ExpectThrow<ModelError>("folder without config", [&] { Engine e(tmp); }, "not a compiled mlc-lora model");
  ExpectThrow<InvalidArgument>("unknown device", [&] {
    EngineOptions o;
    o.device = "tpu";
    Engine e(model, o);
  }, "unknown device 'tpu'");

  Engine engine(model);
  const int64_t free_tokens = engine.kv_cache_free_tokens();
  Request base = Chat("What is the capital of France?");
  Result before = engine.Generate(base);
  Expect(!before.output_ids.empty(), "base request generates tokens");

  ExpectThrow<InvalidArgument>("unknown adapter in a request", [&] {
    Request r = base;
    r.adapter = "pirate";
    engine.Generate(r);
  }, "unknown adapter 'pirate'");
  if (!engine.adapters_available()) {
    ExpectThrow<NotAvailable>("adapter on a model compiled without LoRA", [&] { engine.LoadAdapter("a", tmp); },
                              "compiled without LoRA");
  } else {
    ExpectThrow<ModelError>("adapter folder missing", [&] { engine.LoadAdapter("a", tmp + "/nope"); }, "does not exist");
    ExpectThrow<ModelError>("adapter folder without config", [&] { engine.LoadAdapter("a", tmp); }, "no adapter_config.json");
    ExpectThrow<InvalidArgument>("adapter rank 0", [&] { engine.LoadAdapter("a", MakePeft(tmp, "r0", "0")); }, "bad LoRA rank");
    ExpectThrow<InvalidArgument>("adapter rank -4", [&] { engine.LoadAdapter("a", MakePeft(tmp, "rneg", "-4")); }, "bad LoRA rank");
    ExpectThrow<InvalidArgument>("adapter rank 8.5", [&] { engine.LoadAdapter("a", MakePeft(tmp, "rf", "8.5")); }, "bad LoRA rank");
    ExpectThrow<InvalidArgument>("adapter rank above --max-lora-rank", [&] {
      engine.LoadAdapter("a", MakePeft(tmp, "r64", "64"));
    }, "above the compiled --max-lora-rank");
    ExpectThrow<ModelError>("adapter weights not a safetensors file", [&] { engine.LoadAdapter("a", MakePeft(tmp, "r8", "8")); },
                            "adapter_model.safetensors");
    ExpectThrow<InvalidArgument>("adapter with a PEFT option that changes the forward", [&] {
      engine.LoadAdapter("a", MakePeft(tmp, "dora", "8", ", \"use_dora\": true"));
    }, "use_dora=True is not supported");
    ExpectThrow<InvalidArgument>("adapter targeting a module LoRA cannot serve", [&] {
      engine.LoadAdapter("a", MakePeft(tmp, "head", "8", "", "[\"q_proj\", \"lm_head\"]"));
    }, "['lm_head'] are not supported");
  }
  ExpectThrow<InvalidArgument>("unload unknown adapter", [&] { engine.UnloadAdapter("a"); }, "unknown adapter 'a'");
  ExpectThrow<InvalidArgument>("pin unknown adapter", [&] { engine.PinAdapter("a"); }, "unknown adapter 'a'");
  Expect(engine.ListAdapters().empty(), "no adapter listed");

  ExpectThrow<InvalidArgument>("empty request", [&] { engine.Generate(Request()); }, "has no prompt");
  ExpectThrow<InvalidArgument>("max_tokens 0", [&] { engine.Generate(Chat("hi", 0)); }, "max_tokens");
  ExpectThrow<InvalidArgument>("top_p 0", [&] {
    Request r = base;
    r.config.top_p = 0;
    engine.Generate(r);
  }, "top_p");
  ExpectThrow<InvalidArgument>("token id outside the vocabulary", [&] {
    Request r;
    r.prompt_ids = {1, 2, engine.vocab_size()};
    engine.Generate(r);
  }, "outside the vocabulary");
  ExpectThrow<InvalidArgument>("prompt longer than the context window", [&] {
    Request r;
    r.prompt_ids.assign(engine.context_window_size() + 5, 1);
    engine.Generate(r);
  }, "context window");
  ExpectThrow<InvalidArgument>("one bad request in a batch", [&] {
    Request bad = base;
    bad.adapter = "x";
    engine.Generate(std::vector<Request>{base, bad});
  }, "request 1: unknown adapter 'x'");
  ExpectThrow<InvalidArgument>("invalid UTF-8 prompt", [&] {
    Request r;
    r.prompt = "bad \xc3";
    engine.Generate(r);
  }, "not valid UTF-8");
  ExpectThrow<std::runtime_error>("callback throws mid-generation", [&] {
    int n = 0;
    engine.Generate(std::vector<Request>{base, Chat("Tell me a story", 20)}, [&](size_t, int32_t, const std::string&) {
      if (++n == 5) throw std::runtime_error("stop from the callback");
    });
  }, "stop from the callback");

  // After all of that the engine answers exactly as before.
  Result after = engine.Generate(base);
  Expect(after.output_ids == before.output_ids && after.text == before.text, "engine unchanged after the errors");
  Expect(engine.kv_cache_free_tokens() == free_tokens, "every KV page is free again");

  // Batched greedy equals single-request greedy, and streamed deltas concatenate to the text.
  std::vector<Request> batch = {Chat("Hi there"), Chat("Write a haiku about the sea", 20), base};
  std::vector<std::string> streamed(batch.size());
  auto results = engine.Generate(batch, [&](size_t i, int32_t, const std::string& d) { streamed[i] += d; });
  for (size_t i = 0; i < batch.size(); ++i) {
    Result single = engine.Generate(batch[i]);
    Expect(results[i].output_ids == single.output_ids, "batched == single greedy, request " + std::to_string(i));
    Expect(streamed[i] == results[i].text, "streamed deltas == text, request " + std::to_string(i));
    Expect(results[i].text == engine.tokenizer().Decode(results[i].output_ids, true), "text == decode(ids)");
  }

  // Sampling: reproducible per seed; top_k = 1 is greedy.
  Request s = Chat("Tell me a story", 16);
  s.config.temperature = 1.0f;
  s.config.top_p = 0.95f;
  s.config.seed = 7;
  Result s1 = engine.Generate(s), s2 = engine.Generate(s);
  Expect(s1.output_ids == s2.output_ids, "same seed, same sample");
  s.config.seed = 8;
  Result s3 = engine.Generate(s);
  Expect(s3.output_ids != s1.output_ids, "another seed, another sample");
  Request k1 = Chat("Tell me a story", 16);
  Result greedy = engine.Generate(k1);
  k1.config.temperature = 0.8f;
  k1.config.top_k = 1;
  Expect(engine.Generate(k1).output_ids == greedy.output_ids, "top_k = 1 equals greedy");
  Request lim = Chat("Tell me a story", 3);
  lim.config.ignore_eos = true;
  Result l = engine.Generate(lim);
  Expect(l.output_ids.size() == 3 && l.finish_reason == "length", "max_tokens bounds the output");

  if (!peft.empty()) {  // a real adapter: load, use (alone and mixed with the base model), pin, unload
    engine.LoadAdapter("a", peft);
    Expect(engine.ListAdapters() == std::vector<std::string>{"a"}, "adapter listed");
    ExpectThrow<InvalidArgument>("load under a taken name", [&] { engine.LoadAdapter("a", peft); }, "already loaded");
    Request ra = base;
    ra.adapter = "a";
    Result with = engine.Generate(ra);
    Expect(with.output_ids != before.output_ids, "the adapter changes the output");
    auto mixed = engine.Generate(std::vector<Request>{base, ra, base});
    Expect(mixed[0].output_ids == before.output_ids && mixed[2].output_ids == before.output_ids,
           "base requests beside an adapter request are unchanged");
    Expect(mixed[1].output_ids == with.output_ids, "adapter request batched == alone");
    ExpectThrow<InvalidArgument>("bad adapter beside a loaded one", [&] { engine.LoadAdapter("b", MakePeft(tmp, "r0b", "0")); },
                                 "bad LoRA rank");
    engine.PinAdapter("a");
    Expect(engine.Generate(ra).output_ids == with.output_ids, "pinned adapter, same output");
    engine.PinAdapter("a", false);
    engine.UnloadAdapter("a");
    ExpectThrow<InvalidArgument>("request with an unloaded adapter", [&] { engine.Generate(ra); }, "unknown adapter 'a'");
    Expect(engine.Generate(base).output_ids == before.output_ids, "base output after unload");
    Expect(engine.kv_cache_free_tokens() == free_tokens, "every page is free after unload");
    engine.LoadAdapter("a", peft);  // a name can be reused
    Expect(engine.Generate(ra).output_ids == with.output_ids, "reloaded adapter, same output");

    // Admission counts adapter pages beside KV, and idle adapters give theirs back (the pool
    // evicts them, least recently used first), as in the Python engine.
    engine.UnloadAdapter("a");
    const int64_t page = 16;
    int64_t empty = engine.kv_cache_free_tokens() / page;
    Request big = Chat("Tell me a long story about the sea", 1);
    big.config.ignore_eos = true;
    big.config.max_tokens = static_cast<int>((empty - 1) / 2 * page) - static_cast<int>(engine.PromptIds(big).size());
    Result big_ref = engine.Generate(big);  // half the pool, with no adapter loaded
    std::vector<std::string> names;
    while (engine.kv_cache_free_tokens() / page > empty / 4) {  // idle adapters hold the rest
      names.push_back("c" + std::to_string(names.size()));
      engine.LoadAdapter(names.back(), peft);
    }
    int64_t per = (empty - engine.kv_cache_free_tokens() / page) / static_cast<int64_t>(names.size());
    Result big_out;
    try {
      big_out = engine.Generate(big);
    } catch (const std::exception& e) {
      std::cerr << "FAIL a request that fits once idle adapters are evicted: " << e.what() << "\n";
      ++failures;
    }
    Expect(big_out.output_ids == big_ref.output_ids, "a request that fits once idle adapters are evicted runs");
    std::vector<Result> two;
    try {
      two = engine.Generate(std::vector<Request>{big, big});  // the whole pool: every idle adapter goes
    } catch (const std::exception& e) {
      std::cerr << "FAIL two requests that fill the pool once idle adapters are evicted: " << e.what() << "\n";
      ++failures;
    }
    Expect(two.size() == 2 && two[0].output_ids == big_ref.output_ids && two[1].output_ids == big_ref.output_ids,
           "two requests that fill the pool once idle adapters are evicted run");
    // Evict every c*: fillers loaded later take the whole pool (the least recently used go first),
    // then leave it free.
    for (int64_t i = 0; i * per < empty; ++i) engine.LoadAdapter("filler" + std::to_string(i), peft);
    for (int64_t i = 0; i * per < empty; ++i) engine.UnloadAdapter("filler" + std::to_string(i));
    Expect(engine.kv_cache_free_tokens() / page == empty, "every c* adapter evicted, the pool free");
    // Every request on another adapter, all evicted: their KV alone fits the pool at once,
    // their KV plus the adapters' pages do not; they run in turns with the outputs of each alone.
    std::vector<Request> spread;
    const char* texts[] = {"Hi there", "Write a haiku about the sea", "What is the capital of France?"};
    int64_t kv_each = (empty - 1) / std::min<int64_t>(names.size(), 8);
    for (size_t i = 0; i < names.size() && i < 8; ++i) {
      Request r = Chat(texts[i % 3], 1);
      r.adapter = names[i];
      r.config.ignore_eos = true;
      r.config.max_tokens = static_cast<int>(kv_each * page) - static_cast<int>(engine.PromptIds(r).size());
      spread.push_back(r);
    }
    Expect(static_cast<int64_t>(spread.size()) * (kv_each + per) > empty, "the spread batch needs adapter pages too");
    std::vector<Result> spread_out;
    try {
      spread_out = engine.Generate(spread);
    } catch (const std::exception& e) {
      std::cerr << "FAIL a batch whose KV and adapter pages exceed the pool: " << e.what() << "\n";
      ++failures;
    }
    for (size_t i = 0; i < spread_out.size(); ++i) {
      Expect(spread_out[i].output_ids == engine.Generate(spread[i]).output_ids,
             "adapter pages counted at admission: request " + std::to_string(i) + " == alone");
    }
    Expect(spread_out.size() == spread.size(), "every request of the spread batch answered");
    // Pinned adapters keep their pages: a request that fits only with them gone is refused.
    for (const std::string& n : names) engine.PinAdapter(n);
    ExpectThrow<InvalidArgument>("a request that fits only without the pinned adapters", [&] { engine.Generate(big); },
                                 "held by pinned adapters");
    Request small = spread[0];
    Expect(engine.Generate(small).output_ids == spread_out.at(0).output_ids, "a small request beside pinned adapters");
    for (const std::string& n : names) engine.UnloadAdapter(n);
    Expect(engine.kv_cache_free_tokens() / page == empty, "every page is free after the adapters are unloaded");
  }

  std::cout << (failures ? "FAILED" : "PASSED") << " (" << failures << " failures)\n";
  return failures ? 1 : 0;
}
