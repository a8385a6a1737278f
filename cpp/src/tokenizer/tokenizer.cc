/*!
 * \file tokenizer.cc
 * \brief Byte-level BPE from tokenizer.json, matching the Hugging Face `tokenizers` library.
 *
 * Pipeline (as in `tokenizers`): split out added tokens -> pre-tokenizers split the rest into
 * words -> each word's UTF-8 bytes are mapped to GPT-2's printable byte alphabet -> BPE merges
 * -> optional post-processor template. Decoding maps the byte alphabet back.
 */
#include <algorithm>
#include <climits>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "json.h"
#include "mlc_lora/tokenizer.h"
#include "unicode.h"

namespace mlc_lora {

using detail::IsLetter;
using detail::IsNumber;
using detail::IsWhitespace;
using mlc_lora::JSON;

namespace {

// ------------------------------------------------------------------------------------------------
// Pre-tokenizer regexes. `tokenizers` uses Oniguruma; we implement the two patterns in use by hand
// (each returns the length of the match starting at s[i]; every position matches something).

bool IsNewline(char32_t c) { return c == '\r' || c == '\n'; }

size_t Contraction(const std::u32string& s, size_t i, bool ignore_case) {
  if (s[i] != '\'' || i + 1 >= s.size()) return 0;
  auto low = [&](size_t k) -> char32_t {
    if (k >= s.size()) return 0;
    char32_t c = s[k];
    return ignore_case && c >= 'A' && c <= 'Z' ? c + 32 : c;
  };
  char32_t a = low(i + 1), b = low(i + 2);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// \s+(?!\S)|\s+ at a whitespace position.
size_t TrailingSpaces(const std::u32string& s, size_t i) {
  size_t k = i;
  while (k < s.size() && IsWhitespace(s[k])) ++k;
  if (k == s.size() || k - i == 1) return k - i;
  return k - i - 1;  // leave the last space to join the next word
}

template <typename F>
size_t Run(const std::u32string& s, size_t k, F pred) {
  size_t j = k;
  while (j < s.size() && pred(s[j])) ++j;
  return j - k;
}

bool IsOther(char32_t c) { return !IsWhitespace(c) && !IsLetter(c) && !IsNumber(c); }

// GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
size_t MatchGPT2(const std::u32string& s, size_t i) {
  if (size_t n = Contraction(s, i, false)) return n;
  size_t j = i + (s[i] == ' ' && i + 1 < s.size() ? 1 : 0);
  for (int pass = 0; pass < 2; ++pass, j = i) {  // with, then without, the optional space
    if (IsLetter(s[j])) return j - i + Run(s, j, IsLetter);
    if (IsNumber(s[j])) return j - i + Run(s, j, IsNumber);
    if (IsOther(s[j])) return j - i + Run(s, j, IsOther);
    if (j == i) break;
  }
  return TrailingSpaces(s, i);
}

// Llama-3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//          ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
size_t MatchLlama3(const std::u32string& s, size_t i) {
  if (size_t n = Contraction(s, i, true)) return n;
  char32_t c = s[i];
  bool prefix_ok = !IsNewline(c) && !IsLetter(c) && !IsNumber(c);
  if (prefix_ok && i + 1 < s.size() && IsLetter(s[i + 1])) return 1 + Run(s, i + 1, IsLetter);
  if (IsLetter(c)) return Run(s, i, IsLetter);
  if (IsNumber(c)) return std::min<size_t>(3, Run(s, i, IsNumber));
  size_t j = i + (c == ' ' && i + 1 < s.size() ? 1 : 0);
  for (int pass = 0; pass < 2; ++pass, j = i) {
    if (IsOther(s[j])) {
      size_t k = j + Run(s, j, IsOther);
      return k - i + Run(s, k, IsNewline);
    }
    if (j == i) break;
  }
  // \s*[\r\n]+ : up to the last newline of the whitespace run.
  size_t end = i + Run(s, i, IsWhitespace);
  for (size_t k = end; k > i; --k) {
    if (IsNewline(s[k - 1])) return k - i;
  }
  return TrailingSpaces(s, i);
}

const char* kGPT2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const char* kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

using Matcher = size_t (*)(const std::u32string&, size_t);
using Piece = std::u32string;

void SplitWith(Matcher m, const Piece& s, std::vector<Piece>* out) {
  for (size_t i = 0; i < s.size();) {
    size_t n = m(s, i);
    out->push_back(s.substr(i, n));
    i += n;
  }
}

// One pre-tokenizer step of the pipeline (a Sequence is flattened into several steps).
struct PreStep {
  enum Kind { kRegex, kDigits, kLiteral, kPrefixSpace } kind = kRegex;
  Matcher matcher = nullptr;
  bool individual_digits = false;
  Piece literal;
  bool remove_literal = false;

  void Apply(const Piece& s, std::vector<Piece>* out) const {
    switch (kind) {
      case kRegex:
        SplitWith(matcher, s, out);
        return;
      case kDigits:
        for (size_t i = 0; i < s.size();) {
          size_t n = IsNumber(s[i]) ? (individual_digits ? 1 : Run(s, i, IsNumber))
                                    : Run(s, i, [](char32_t c) { return !IsNumber(c); });
          out->push_back(s.substr(i, n));
          i += n;
        }
        return;
      case kLiteral: {
        size_t start = 0;
        for (size_t pos; !literal.empty() && (pos = s.find(literal, start)) != Piece::npos;) {
          if (pos > start) out->push_back(s.substr(start, pos - start));
          if (!remove_literal) out->push_back(literal);
          start = pos + literal.size();
        }
        if (start < s.size()) out->push_back(s.substr(start));
        return;
      }
      case kPrefixSpace:
        out->push_back(!s.empty() && s[0] == ' ' ? s : U" " + s);
        return;
    }
  }
};

// GPT-2's reversible map from bytes to printable code points.
struct ByteAlphabet {
  char32_t to_char[256];
  std::unordered_map<char32_t, uint8_t> to_byte;
  ByteAlphabet() {
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      to_char[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
      to_byte[to_char[b]] = static_cast<uint8_t>(b);
    }
  }
};

const ByteAlphabet& Bytes() {
  static ByteAlphabet a;
  return a;
}

struct AddedToken {
  std::string content;
  int32_t id;
  bool special, lstrip, rstrip;
};

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw ModelError("cannot open tokenizer file '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

struct Tokenizer::Impl {
  std::unordered_map<std::string, int32_t> vocab;  // token string (byte alphabet, UTF-8) -> id
  std::vector<std::string> id_to_token;
  std::vector<bool> special;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a, b) -> (rank, merged)
  bool ignore_merges = false;
  int32_t unk_id = -1;
  std::vector<AddedToken> added;             // longest content first
  std::vector<PreStep> pre;                  // applied in order to every piece
  bool add_prefix_space = false;
  std::vector<int32_t> template_prefix, template_suffix;  // post-processor for a single sequence

  static uint64_t Key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void BPE(const Piece& word, std::vector<int32_t>* out) const {
    // The word's UTF-8 bytes, each as its printable stand-in character.
    std::vector<std::string> chars;
    std::string mapped;
    for (unsigned char b : detail::EncodeUTF8(word)) {
      chars.emplace_back();
      detail::AppendUTF8(&chars.back(), Bytes().to_char[b]);
      mapped += chars.back();
    }
    if (ignore_merges) {
      auto it = vocab.find(mapped);
      if (it != vocab.end()) {
        out->push_back(it->second);
        return;
      }
    }
    std::vector<int32_t> sym;
    for (const std::string& ch : chars) {
      auto it = vocab.find(ch);
      if (it != vocab.end()) {
        sym.push_back(it->second);
      } else if (unk_id >= 0) {
        sym.push_back(unk_id);
      } else {
        throw InvalidArgument("tokenizer: byte '" + ch + "' has no token and there is no unk_token");
      }
    }
    // Merge the lowest-ranked adjacent pair (leftmost on ties) until none is left.
    while (sym.size() > 1) {
      int32_t best_rank = INT32_MAX, best_id = -1;
      size_t best_pos = 0;
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        auto it = merges.find(Key(sym[i], sym[i + 1]));
        if (it != merges.end() && it->second.first < best_rank) {
          best_rank = it->second.first, best_id = it->second.second, best_pos = i;
        }
      }
      if (best_id < 0) break;
      sym[best_pos] = best_id;
      sym.erase(sym.begin() + best_pos + 1);
    }
    out->insert(out->end(), sym.begin(), sym.end());
  }

  void EncodePlain(const std::string& text, std::vector<int32_t>* out) const {
    std::vector<Piece> pieces{detail::DecodeUTF8(text)}, next;
    for (const PreStep& step : pre) {
      next.clear();
      for (const Piece& p : pieces) step.Apply(p, &next);
      pieces.swap(next);
    }
    for (const Piece& p : pieces) {
      if (!p.empty()) BPE(p, out);
    }
  }

  // Leftmost-longest match of an added token at or after `from`; returns added.size() if none.
  size_t FindAdded(const std::string& text, size_t from, size_t* pos) const {
    for (size_t i = from; i < text.size(); ++i) {
      for (size_t k = 0; k < added.size(); ++k) {  // sorted longest first
        const std::string& c = added[k].content;
        if (!c.empty() && text.compare(i, c.size(), c) == 0) {
          *pos = i;
          return k;
        }
      }
    }
    return added.size();
  }
};

namespace {

void AddPreTokenizer(const JSON& j, Tokenizer::Impl* t, bool* byte_level) {
  std::string type = j["type"].str();
  if (type == "Sequence") {
    for (const JSON& p : j["pretokenizers"].items()) AddPreTokenizer(p, t, byte_level);
  } else if (type == "ByteLevel") {
    *byte_level = true;
    if (j.get("add_prefix_space").bool_or(false)) {
      PreStep s;
      s.kind = PreStep::kPrefixSpace;
      t->pre.push_back(s);
    }
    if (j.get("use_regex").bool_or(true)) {
      PreStep s;
      s.kind = PreStep::kRegex;
      s.matcher = MatchGPT2;
      t->pre.push_back(s);
    }
  } else if (type == "Digits") {
    PreStep s;
    s.kind = PreStep::kDigits;
    s.individual_digits = j.get("individual_digits").bool_or(false);
    t->pre.push_back(s);
  } else if (type == "Split") {
    std::string behavior = j.get("behavior").str_or("Isolated");
    if (j.get("invert").bool_or(false)) j.Fail("Split with invert=true is not supported");
    JSON pat = j["pattern"];
    if (pat.has("Regex")) {
      std::string re = pat["Regex"].str();
      PreStep s;
      s.kind = PreStep::kRegex;
      if (re == kGPT2Pattern) {
        s.matcher = MatchGPT2;
      } else if (re == kLlama3Pattern) {
        s.matcher = MatchLlama3;
      } else {
        j.Fail("unsupported Split regex '" + re + "' (supported: the GPT-2 and Llama-3 patterns)");
      }
      if (behavior != "Isolated") j.Fail("Split regex behavior '" + behavior + "' is not supported");
      t->pre.push_back(s);
    } else {
      PreStep s;
      s.kind = PreStep::kLiteral;
      s.literal = detail::DecodeUTF8(pat["String"].str());
      if (behavior == "Removed") {
        s.remove_literal = true;
      } else if (behavior != "Isolated") {
        j.Fail("Split string behavior '" + behavior + "' is not supported");
      }
      t->pre.push_back(s);
    }
  } else {
    j.Fail("unsupported pre_tokenizer type '" + type + "'");
  }
}

void AddPostProcessor(const JSON& j, Tokenizer::Impl* t) {
  std::string type = j["type"].str();
  if (type == "Sequence") {
    for (const JSON& p : j["processors"].items()) AddPostProcessor(p, t);
  } else if (type == "ByteLevel") {
    // only adjusts offsets
  } else if (type == "TemplateProcessing") {
    JSON specials = j["special_tokens"];
    bool seen_a = false;
    for (const JSON& piece : j["single"].items()) {
      if (piece.has("Sequence")) {
        seen_a = true;
        continue;
      }
      std::string name = piece["SpecialToken"]["id"].str();
      for (const JSON& id : specials[name]["ids"].items()) {
        (seen_a ? t->template_suffix : t->template_prefix).push_back(static_cast<int32_t>(id.i64()));
      }
    }
  } else {
    j.Fail("unsupported post_processor type '" + type + "'");
  }
}

void CheckDecoder(const JSON& j) {
  std::string type = j["type"].str();
  if (type == "Sequence") {
    for (const JSON& d : j["decoders"].items()) CheckDecoder(d);
  } else if (type != "ByteLevel") {
    j.Fail("unsupported decoder type '" + type + "' (only ByteLevel)");
  }
}

}  // namespace

Tokenizer Tokenizer::FromFile(const std::string& path) {
  std::string text = ReadFile(path);
  try {
    return FromJSON(text);
  } catch (const ModelError& e) {
    throw ModelError(path + ": " + e.what());
  }
}

Tokenizer Tokenizer::FromJSON(const std::string& text) {
  auto t = std::make_shared<Impl>();
  JSON root = JSON::Parse(text, "tokenizer");
  JSON model = root["model"];
  std::string type = model.get("type").str_or("BPE");
  if (type != "BPE") model.Fail("unsupported model type '" + type + "' (only BPE)");
  if (model.get("byte_fallback").bool_or(false)) model.Fail("byte_fallback BPE is not supported");
  if (!model.get("continuing_subword_prefix").str_or("").empty() ||
      !model.get("end_of_word_suffix").str_or("").empty()) {
    model.Fail("continuing_subword_prefix / end_of_word_suffix are not supported");
  }
  t->ignore_merges = model.get("ignore_merges").bool_or(false);
  auto put = [&](const std::string& tok, int64_t id, const JSON& where) {
    if (id < 0 || id > INT32_MAX) where.Fail("token id out of range");
    if (static_cast<size_t>(id) >= t->id_to_token.size()) {
      t->id_to_token.resize(id + 1);
      t->special.resize(id + 1, false);
    }
    t->id_to_token[id] = tok;
    t->vocab[tok] = static_cast<int32_t>(id);
  };
  for (const auto& kv : model["vocab"].members()) put(kv.first, kv.second.i64(), kv.second);

  int32_t rank = 0;
  for (const JSON& m : model["merges"].items()) {
    std::string a, b;
    if (m.is_string()) {  // "a b"
      std::string s = m.str();
      size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) m.Fail("merge '" + s + "' has no space");
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else {  // ["a", "b"]
      auto pair = m.items();
      if (pair.size() != 2) m.Fail("a merge must have two parts");
      a = pair[0].str(), b = pair[1].str();
    }
    auto ia = t->vocab.find(a), ib = t->vocab.find(b), iab = t->vocab.find(a + b);
    if (ia == t->vocab.end() || ib == t->vocab.end() || iab == t->vocab.end()) {
      m.Fail("merge '" + a + " " + b + "' uses a token missing from the vocab");
    }
    t->merges.emplace(Impl::Key(ia->second, ib->second), std::make_pair(rank++, iab->second));
  }
  if (model.has("unk_token")) {
    auto it = t->vocab.find(model["unk_token"].str());
    if (it != t->vocab.end()) t->unk_id = it->second;
  }

  if (root.has("added_tokens")) {
    for (const JSON& a : root["added_tokens"].items()) {
      AddedToken tok{a["content"].str(), static_cast<int32_t>(a["id"].i64()),
                     a.get("special").bool_or(false), a.get("lstrip").bool_or(false),
                     a.get("rstrip").bool_or(false)};
      put(tok.content, tok.id, a);
      t->special[tok.id] = tok.special;
      t->added.push_back(tok);
    }
  }
  std::stable_sort(t->added.begin(), t->added.end(), [](const AddedToken& x, const AddedToken& y) {
    return x.content.size() > y.content.size();
  });

  if (root.has("normalizer")) root["normalizer"].Fail("normalizers are not supported");
  bool byte_level = false;
  if (root.has("pre_tokenizer")) AddPreTokenizer(root["pre_tokenizer"], t.get(), &byte_level);
  if (!byte_level) root.Fail("only byte-level BPE tokenizers are supported (no ByteLevel pre_tokenizer)");
  if (root.has("post_processor")) AddPostProcessor(root["post_processor"], t.get());
  if (root.has("decoder")) CheckDecoder(root["decoder"]);

  Tokenizer out;
  out.impl_ = std::move(t);
  return out;
}

std::vector<int32_t> Tokenizer::Encode(const std::string& text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  std::vector<int32_t> out;
  if (add_special_tokens) out = t.template_prefix;
  size_t start = 0;
  while (start < text.size()) {
    size_t pos;
    size_t k = t.FindAdded(text, start, &pos);
    size_t end = k == t.added.size() ? text.size() : pos;
    size_t next = end;
    if (k < t.added.size()) {
      const AddedToken& a = t.added[k];
      next = pos + a.content.size();
      auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
      if (a.lstrip) {
        while (end > start && ws(text[end - 1])) --end;
      }
      if (a.rstrip) {
        while (next < text.size() && ws(text[next])) ++next;
      }
    }
    if (end > start) t.EncodePlain(text.substr(start, end - start), &out);
    if (k < t.added.size()) out.push_back(t.added[k].id);
    start = next;
  }
  if (add_special_tokens) out.insert(out.end(), t.template_suffix.begin(), t.template_suffix.end());
  return out;
}

std::string Tokenizer::TokenBytes(int32_t id, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  if (id < 0 || static_cast<size_t>(id) >= t.id_to_token.size()) {
    throw InvalidArgument("token id " + std::to_string(id) + " is out of range [0, " +
                          std::to_string(t.id_to_token.size()) + ")");
  }
  if (skip_special_tokens && t.special[id]) return "";
  const std::string& tok = t.id_to_token[id];
  // As `tokenizers`' ByteLevel decoder: map every char back to its byte, unless one char is
  // outside the byte alphabet; then the token's own UTF-8 is used.
  std::string out;
  for (char32_t c : detail::DecodeUTF8(tok)) {
    auto it = Bytes().to_byte.find(c);
    if (it == Bytes().to_byte.end()) return tok;
    out.push_back(static_cast<char>(it->second));
  }
  return out;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) bytes += TokenBytes(id, skip_special_tokens);
  return SanitizeUTF8(bytes);
}

int32_t Tokenizer::TokenToId(const std::string& token) const {
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

std::string Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_to_token.size()) {
    throw InvalidArgument("token id " + std::to_string(id) + " is out of range");
  }
  return impl_->id_to_token[id];
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->special.size() && impl_->special[id];
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_to_token.size()); }

}  // namespace mlc_lora
