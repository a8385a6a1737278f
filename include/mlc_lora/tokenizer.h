/*!
 * \file mlc_lora/tokenizer.h
 * \brief Byte-level BPE tokenizer read from a Hugging Face `tokenizer.json`.
 *
 * Covers the tokenizers of the models mlc-lora supports (GPT-2 / SmolLM / Llama-3 style):
 * added and special tokens, the ByteLevel, Digits, Split and Sequence pre-tokenizers, the BPE
 * model (merges as "a b" strings or [a, b] pairs, ignore_merges), the ByteLevel decoder and the
 * TemplateProcessing post-processor. Anything else is refused with a ModelError naming it.
 */
#ifndef MLC_LORA_TOKENIZER_H_
#define MLC_LORA_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "error.h"

namespace mlc_lora {

class Tokenizer {
 public:
  /*! \brief Read a tokenizer.json file. Throws ModelError. */
  static Tokenizer FromFile(const std::string& path);
  /*! \brief Parse tokenizer.json text. Throws ModelError. */
  static Tokenizer FromJSON(const std::string& json);

  /*!
   * \brief Text (UTF-8) to token ids, like `tokenizers.Tokenizer.encode(text, add_special_tokens)`.
   * Special tokens written in the text (e.g. "<|im_start|>") are recognised. Throws
   * InvalidArgument on invalid UTF-8.
   */
  std::vector<int32_t> Encode(const std::string& text, bool add_special_tokens = false) const;

  /*! \brief Token ids to text; invalid UTF-8 becomes U+FFFD. Throws InvalidArgument on a bad id. */
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  /*! \brief The raw bytes one token stands for (empty for a skipped special token). */
  std::string TokenBytes(int32_t id, bool skip_special_tokens = false) const;

  /*! \brief Id of a token string (vocab or added), or -1. */
  int32_t TokenToId(const std::string& token) const;
  /*! \brief Token string of an id (as stored in tokenizer.json). */
  std::string IdToToken(int32_t id) const;
  bool IsSpecial(int32_t id) const;
  /*! \brief One past the largest id. */
  int32_t vocab_size() const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

/*!
 * \brief Split `bytes` into the longest prefix that is complete UTF-8 and the incomplete tail
 * (at most 3 bytes that may still become a character). Used for streaming text.
 */
size_t CompleteUTF8Prefix(const std::string& bytes);

/*! \brief Decode UTF-8, replacing each maximal invalid subpart with U+FFFD (like Python's "replace"). */
std::string SanitizeUTF8(const std::string& bytes);

}  // namespace mlc_lora

#endif  // MLC_LORA_TOKENIZER_H_
