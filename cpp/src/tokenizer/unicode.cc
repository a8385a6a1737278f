#include "unicode.h"

#include <algorithm>
#include <iterator>

#include "mlc_lora/error.h"
#include "mlc_lora/tokenizer.h"

namespace mlc_lora {
namespace detail {

namespace {
struct CodeRange {
  char32_t lo, hi;
};
#include "unicode_tables.inc"

template <size_t N>
bool InRanges(const CodeRange (&ranges)[N], char32_t cp) {
  auto it = std::upper_bound(std::begin(ranges), std::end(ranges), cp,
                             [](char32_t c, const CodeRange& r) { return c < r.lo; });
  return it != std::begin(ranges) && cp <= std::prev(it)->hi;
}

}  // namespace

// Length of the valid UTF-8 sequence at s[i] (1-4), or 0 if none starts there. Then `*prefix` is
// the length of the maximal valid prefix (>= 1 byte, the unit replaced by one U+FFFD) and
// `*partial` says whether that prefix was cut off by the end of the string.
size_t SeqLen(const std::string& s, size_t i, char32_t* cp, bool* partial, size_t* prefix) {
  *partial = false;
  *prefix = 1;
  auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char c = b(i);
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t n;
  char32_t v;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, v = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, v = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, v = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k < n; ++k) {
    if (i + k >= s.size()) {
      *partial = true;
      *prefix = k;
      return 0;
    }
    unsigned char d = b(i + k);
    if (k == 1 ? (d < lo || d > hi) : (d < 0x80 || d > 0xBF)) {
      *prefix = k;
      return 0;
    }
    v = (v << 6) | (d & 0x3F);
  }
  *cp = v;
  return n;
}

std::u32string DecodeUTF8(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    char32_t cp;
    bool partial;
    size_t prefix;
    size_t n = SeqLen(s, i, &cp, &partial, &prefix);
    if (n == 0) throw InvalidArgument("text is not valid UTF-8 (byte offset " + std::to_string(i) + ")");
    out.push_back(cp);
    i += n;
  }
  return out;
}

void AppendUTF8(std::string* out, char32_t cp) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string EncodeUTF8(const std::u32string& s) {
  std::string out;
  for (char32_t c : s) AppendUTF8(&out, c);
  return out;
}

bool IsLetter(char32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return InRanges(kLetterRanges, cp);
}

bool IsNumber(char32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return InRanges(kNumberRanges, cp);
}

bool IsWhitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

}  // namespace detail

size_t CompleteUTF8Prefix(const std::string& bytes) {
  // Only a valid-but-truncated sequence at the very end is held back; invalid bytes are final.
  size_t start = bytes.size() >= 3 ? bytes.size() - 3 : 0;
  for (size_t i = start; i < bytes.size(); ++i) {
    char32_t cp;
    bool partial;
    size_t prefix;
    if (detail::SeqLen(bytes, i, &cp, &partial, &prefix) == 0 && partial) return i;
  }
  return bytes.size();
}

std::string SanitizeUTF8(const std::string& bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    char32_t cp;
    bool partial;
    size_t prefix;
    size_t n = detail::SeqLen(bytes, i, &cp, &partial, &prefix);
    if (n > 0) {
      out.append(bytes, i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
      i += prefix;
    }
  }
  return out;
}

}  // namespace mlc_lora
