#include "sampler.h"

#include <algorithm>
#include <cmath>

namespace mlc_lora {
namespace detail {

int32_t Argmax(const float* logits, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

int32_t Sampler::Next(const float* logits, int32_t n) {
  if (cfg_.temperature <= 0.0f || cfg_.top_k == 1) return Argmax(logits, n);
  float mx = logits[Argmax(logits, n)];
  buf_.resize(n);
  double total = 0;
  for (int32_t i = 0; i < n; ++i) {
    float p = std::exp((logits[i] - mx) / cfg_.temperature);
    buf_[i] = {p, i};
    total += p;
  }
  auto by_prob = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = static_cast<size_t>(n);
  if (cfg_.top_k > 0 && cfg_.top_k < n) {
    keep = cfg_.top_k;
    std::partial_sort(buf_.begin(), buf_.begin() + keep, buf_.end(), by_prob);
    total = 0;
    for (size_t i = 0; i < keep; ++i) total += buf_[i].first;
  } else if (cfg_.top_p < 1.0f) {
    std::sort(buf_.begin(), buf_.end(), by_prob);
  }
  if (cfg_.top_p < 1.0f) {
    double mass = 0;
    size_t i = 0;
    for (; i < keep; ++i) {
      mass += buf_[i].first;
      if (mass >= cfg_.top_p * total) break;
    }
    keep = std::min(keep, i + 1);
    total = mass;
  }
  double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += buf_[i].first;
    if (u < acc) return buf_[i].second;
  }
  return buf_[keep - 1].second;
}

}  // namespace detail
}  // namespace mlc_lora
