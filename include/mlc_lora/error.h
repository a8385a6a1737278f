/*!
 * \file mlc_lora/error.h
 * \brief Exceptions thrown by the mlc-lora C++ API (and by the runtime's adapter packing it calls,
 *        src/runtime/peft_adapter.h). Every error leaves the engine usable.
 */
#ifndef MLC_LORA_ERROR_H_
#define MLC_LORA_ERROR_H_

#include <stdexcept>
#include <string>

namespace mlc_lora {

/*! \brief Base class of every mlc-lora error. */
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/*! \brief A model folder, tokenizer or adapter folder is missing or malformed. */
class ModelError : public Error {
 public:
  using Error::Error;
};

/*! \brief A request or argument is invalid (unknown adapter, prompt too long, bad option). */
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/*! \brief The feature exists in the API but not in this build or this compiled model. */
class NotAvailable : public Error {
 public:
  using Error::Error;
};

}  // namespace mlc_lora

#endif  // MLC_LORA_ERROR_H_
