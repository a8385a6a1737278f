/*!
 * \file sampler.h
 * \brief Next-token choice from one row of logits: greedy, or seeded temperature / top-k / top-p.
 */
#ifndef MLC_LORA_CPP_SAMPLER_H_
#define MLC_LORA_CPP_SAMPLER_H_

#include <cstdint>
#include <random>
#include <vector>

#include "mlc_lora/engine.h"

namespace mlc_lora {
namespace detail {

/*! \brief Index of the first maximum (numpy.argmax semantics). */
int32_t Argmax(const float* logits, int32_t n);

class Sampler {
 public:
  explicit Sampler(const GenerationConfig& cfg) : cfg_(cfg), rng_(cfg.seed) {}
  /*!
   * Semantics: p = softmax(logits / T); keep the k most likely tokens (top_k > 0), then the
   * smallest most-likely prefix whose mass reaches top_p; renormalise and draw one token.
   * T == 0 is greedy.
   */
  int32_t Next(const float* logits, int32_t n);

 private:
  GenerationConfig cfg_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> buf_;
};

}  // namespace detail
}  // namespace mlc_lora

#endif  // MLC_LORA_CPP_SAMPLER_H_
