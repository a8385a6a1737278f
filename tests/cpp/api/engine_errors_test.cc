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
  }

  std::cout << (failures ? "FAILED" : "PASSED") << " (" << failures << " failures)\n";
  return failures ? 1 : 0;
}
