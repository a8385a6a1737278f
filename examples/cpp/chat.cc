// mlc_lora_chat: chat with a compiled mlc-lora model from C++ (see docs/CPP.md).
//
//   mlc_lora_chat MODEL_DIR                       interactive, streamed, multi-turn
//   mlc_lora_chat MODEL_DIR --prompt "Hi" --prompt "Name a color"   one batch, printed at the end
//   options: --device cpu|cuda[:N] --max-batch N --prefill-chunk N --max-tokens N --temperature T --top-p P --top-k K --seed S
//            --adapter NAME=PEFT_DIR (load a PEFT folder; repeatable) --prompts-file FILE
//            --use NAME (the adapter of the prompts that follow it and of interactive mode; - = base model)
//            --json (batch output as JSON lines: prompt, text, output_ids, finish_reason)
#include <mlc_lora/engine.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

[[noreturn]] void Usage(const char* msg) {
  std::cerr << "error: " << msg << "\nusage: mlc_lora_chat MODEL_DIR [--prompt TEXT]... [--prompts-file FILE] "
            << "[--device D] [--max-batch N] [--prefill-chunk N] [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] "
            << "[--adapter NAME=DIR]... [--use NAME] [--json]\n";
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') Usage("give a compiled model folder");
  std::string model_dir = argv[1];
  mlc_lora::EngineOptions opts;
  mlc_lora::GenerationConfig gen;
  std::vector<std::string> prompts, adapters, prompt_adapters;
  std::string use_adapter;
  bool json = false;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Usage((a + " needs a value").c_str());
      return argv[++i];
    };
    try {
      if (a == "--prompt") {
        prompts.push_back(value());
        prompt_adapters.push_back(use_adapter);
      }
      else if (a == "--prompts-file") {
        std::ifstream f(value());
        if (!f) Usage("cannot read the prompts file");
        for (std::string line; std::getline(f, line);) {
          if (!line.empty()) {
            prompts.push_back(line);
            prompt_adapters.push_back(use_adapter);
          }
        }
      } else if (a == "--device") opts.device = value();
      else if (a == "--max-batch") opts.max_batch_size = std::stoi(value());
      else if (a == "--prefill-chunk") opts.prefill_chunk_size = std::stoi(value());
      else if (a == "--max-tokens") gen.max_tokens = std::stoi(value());
      else if (a == "--temperature") gen.temperature = std::stof(value());
      else if (a == "--top-p") gen.top_p = std::stof(value());
      else if (a == "--top-k") gen.top_k = std::stoi(value());
      else if (a == "--seed") gen.seed = std::stoull(value());
      else if (a == "--adapter") adapters.push_back(value());
      else if (a == "--use") {
        use_adapter = value();
        if (use_adapter == "-") use_adapter.clear();
      }
      else if (a == "--json") json = true;
      else Usage(("unknown option " + a).c_str());
    } catch (const std::logic_error&) {  // stoi & co.
      Usage(("bad value for " + a).c_str());
    }
  }

  try {
    mlc_lora::Engine engine(model_dir, opts);
    for (const std::string& spec : adapters) {
      size_t eq = spec.find('=');
      if (eq == std::string::npos) Usage("--adapter takes NAME=PEFT_DIR");
      engine.LoadAdapter(spec.substr(0, eq), spec.substr(eq + 1));
    }

    if (!prompts.empty()) {  // batch mode: all prompts generated together
      std::vector<mlc_lora::Request> reqs(prompts.size());
      for (size_t i = 0; i < prompts.size(); ++i) {
        reqs[i].messages = {{"user", prompts[i]}};
        reqs[i].adapter = prompt_adapters[i];
        reqs[i].config = gen;
        reqs[i].config.seed = gen.seed + i;
      }
      size_t tokens = 0;
      auto t0 = std::chrono::steady_clock::now();
      auto results = engine.Generate(reqs, [&](size_t, int32_t, const std::string&) { ++tokens; });
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      for (size_t i = 0; i < results.size(); ++i) {
        const auto& r = results[i];
        if (json) {
          std::cout << "{\"prompt\": " << JsonString(prompts[i]) << ", \"adapter\": " << JsonString(prompt_adapters[i])
                    << ", \"text\": " << JsonString(r.text)
                    << ", \"finish_reason\": " << JsonString(r.finish_reason) << ", \"output_ids\": [";
          for (size_t k = 0; k < r.output_ids.size(); ++k) std::cout << (k ? ", " : "") << r.output_ids[k];
          std::cout << "]}\n";
        } else {
          std::cout << "### " << prompts[i] << "\n" << r.text << "\n[" << r.finish_reason << ", "
                    << r.output_ids.size() << " tokens]\n\n";
        }
      }
      std::cerr << results.size() << " requests, " << tokens << " tokens in " << s << " s ("
                << (s > 0 ? tokens / s : 0) << " tok/s)\n";
      return 0;
    }

    // Interactive: the chat history grows turn by turn; /reset clears it, /quit leaves.
    std::vector<mlc_lora::Message> history;
    std::cerr << "mlc-lora chat (" << model_dir << "). /reset clears the chat, /quit exits.\n";
    for (std::string line;;) {
      std::cout << "> " << std::flush;
      if (!std::getline(std::cin, line) || line == "/quit") break;
      if (line == "/reset") {
        history.clear();
        continue;
      }
      if (line.empty()) continue;
      history.push_back({"user", line});
      mlc_lora::Request req;
      req.messages = history;
      req.adapter = use_adapter;
      req.config = gen;
      try {
        auto r = engine.Generate(req, [](size_t, int32_t, const std::string& delta) { std::cout << delta << std::flush; });
        std::cout << "\n";
        history.push_back({"assistant", r.text});
      } catch (const mlc_lora::InvalidArgument& e) {  // e.g. the chat outgrew the context window
        std::cout << "\n[error] " << e.what() << "\n";
        history.pop_back();
      }
    }
    return 0;
  } catch (const mlc_lora::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
