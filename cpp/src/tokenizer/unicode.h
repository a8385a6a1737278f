/*!
 * \file unicode.h
 * \brief The few Unicode facts the tokenizer needs: UTF-8 coding and the L / N / White_Space classes.
 */
#ifndef MLC_LORA_CPP_UNICODE_H_
#define MLC_LORA_CPP_UNICODE_H_

#include <string>

namespace mlc_lora {
namespace detail {

/*! \brief Strict UTF-8 to code points; throws InvalidArgument naming the byte offset. */
std::u32string DecodeUTF8(const std::string& s);
void AppendUTF8(std::string* out, char32_t cp);
std::string EncodeUTF8(const std::u32string& s);

bool IsLetter(char32_t cp);      // \p{L}
bool IsNumber(char32_t cp);      // \p{N}
bool IsWhitespace(char32_t cp);  // \s: the White_Space property

}  // namespace detail
}  // namespace mlc_lora

#endif  // MLC_LORA_CPP_UNICODE_H_
