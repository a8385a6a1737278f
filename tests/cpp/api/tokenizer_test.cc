// Checks the C++ tokenizer against ids and strings produced by the Python `tokenizers` library
// (make_tokenizer_cases.py). usage: tokenizer_test DIR...  (each DIR holds tokenizer.json, cases.json)
#include <fstream>
#include <iostream>
#include <sstream>

#include "json.h"
#include "mlc_lora/tokenizer.h"

using mlc_lora::Tokenizer;
using mlc_lora::JSON;

namespace {

std::string Read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string Show(const std::vector<int32_t>& ids, size_t at) {
  std::ostringstream os;
  size_t lo = at >= 3 ? at - 3 : 0;
  for (size_t i = lo; i < ids.size() && i < at + 4; ++i) os << (i == at ? "[" : "") << ids[i] << (i == at ? "] " : " ");
  return os.str();
}

int CheckIds(const std::string& what, const std::string& text, const std::vector<int32_t>& got,
             const std::vector<int32_t>& want) {
  if (got == want) return 0;
  size_t at = 0;
  while (at < got.size() && at < want.size() && got[at] == want[at]) ++at;
  std::cerr << what << " mismatch at token " << at << " (got " << got.size() << " ids, want " << want.size()
            << ")\n  got:  " << Show(got, at) << "\n  want: " << Show(want, at) << "\n  text: "
            << text.substr(0, 200) << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: tokenizer_test DIR...\n";
    return 2;
  }
  int failures = 0;
  for (int a = 1; a < argc; ++a) {
    std::string dir = argv[a];
    Tokenizer tok = Tokenizer::FromFile(dir + "/tokenizer.json");
    JSON cases = JSON::Parse(Read(dir + "/cases.json"), dir + "/cases.json")["cases"];
    size_t n = 0, tokens = 0;
    int before = failures;
    for (const JSON& c : cases.items()) {
      std::string text = c["text"].str();
      std::vector<int32_t> want, want_special;
      for (const JSON& id : c["ids"].items()) want.push_back(static_cast<int32_t>(id.i64()));
      for (const JSON& id : c["ids_special"].items()) want_special.push_back(static_cast<int32_t>(id.i64()));
      std::vector<int32_t> got = tok.Encode(text);
      failures += CheckIds(dir + ": encode", text, got, want);
      failures += CheckIds(dir + ": encode(add_special_tokens)", text, tok.Encode(text, true), want_special);
      if (tok.Decode(want) != c["decoded"].str()) {
        std::cerr << dir << ": decode mismatch for text: " << text.substr(0, 200) << "\n";
        ++failures;
      }
      if (tok.Decode(want, true) != c["decoded_skip"].str()) {
        std::cerr << dir << ": decode(skip_special_tokens) mismatch for text: " << text.substr(0, 200) << "\n";
        ++failures;
      }
      // Streaming: the pieces released by CompleteUTF8Prefix concatenate to the full decode.
      std::string pending, streamed;
      for (int32_t id : want) {
        pending += tok.TokenBytes(id);
        size_t cut = mlc_lora::CompleteUTF8Prefix(pending);
        streamed += mlc_lora::SanitizeUTF8(pending.substr(0, cut));
        pending.erase(0, cut);
      }
      streamed += mlc_lora::SanitizeUTF8(pending);
      if (streamed != tok.Decode(want)) {
        std::cerr << dir << ": streamed decode differs for text: " << text.substr(0, 200) << "\n";
        ++failures;
      }
      ++n;
      tokens += want.size();
      if (failures - before > 10) break;
    }
    std::cout << dir << ": " << n << " texts, " << tokens << " tokens, "
              << (failures == before ? "all match" : "MISMATCHES") << "\n";
  }
  // Bad input: a clear exception, and the tokenizer stays usable.
  Tokenizer tok = Tokenizer::FromFile(std::string(argv[1]) + "/tokenizer.json");
  try {
    tok.Encode(std::string("bad \xff utf8"));
    std::cerr << "invalid UTF-8 was accepted\n";
    ++failures;
  } catch (const mlc_lora::InvalidArgument& e) {
    std::cout << "invalid UTF-8 -> " << e.what() << "\n";
  }
  try {
    Tokenizer::FromFile(std::string(argv[1]) + "/no-such-tokenizer.json");
    ++failures;
  } catch (const mlc_lora::ModelError& e) {
    std::cout << "missing file -> " << e.what() << "\n";
  }
  try {
    Tokenizer::FromJSON("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}");
    ++failures;
  } catch (const mlc_lora::ModelError& e) {
    std::cout << "unsupported model -> " << e.what() << "\n";
  }
  if (tok.Encode("still works").empty()) ++failures;
  std::cout << (failures ? "FAILED" : "PASSED") << " (" << failures << " failures)\n";
  return failures ? 1 : 0;
}
