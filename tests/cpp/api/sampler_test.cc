// The sampler's empirical distribution matches the exact filtered softmax, computed here the plain
// way (double precision, full sort), within 5 standard errors per token.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <numeric>
#include <vector>

#include "sampling/sampler.h"

using mlc_lora::GenerationConfig;
using mlc_lora::detail::Sampler;

namespace {

std::vector<double> Reference(const std::vector<float>& logits, const GenerationConfig& c) {
  size_t n = logits.size();
  std::vector<double> p(n);
  double mx = *std::max_element(logits.begin(), logits.end()), z = 0;
  for (size_t i = 0; i < n; ++i) z += p[i] = std::exp((logits[i] - mx) / c.temperature);
  for (double& v : p) v /= z;
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
  size_t keep = c.top_k > 0 ? std::min<size_t>(c.top_k, n) : n;
  double kept_mass = 0;
  for (size_t i = 0; i < keep; ++i) kept_mass += p[order[i]];
  double mass = 0;
  size_t k = 0;
  while (k < keep) {  // smallest prefix whose share of the kept mass reaches top_p
    mass += p[order[k++]];
    if (mass >= c.top_p * kept_mass) break;
  }
  std::vector<double> out(n, 0.0);
  for (size_t i = 0; i < k; ++i) out[order[i]] = p[order[i]] / mass;
  return out;
}

}  // namespace

int main() {
  const std::vector<float> logits = {1.0f, 2.5f, -0.5f, 2.0f, 0.3f, 1.7f, -3.0f, 2.2f};
  struct Case {
    float t, top_p;
    int top_k;
  };
  const Case cases[] = {{1.0f, 1.0f, 0}, {0.5f, 1.0f, 0}, {1.5f, 1.0f, 3}, {1.0f, 0.8f, 0}, {1.0f, 0.9f, 4},
                        {2.0f, 0.5f, 0}};
  const int draws = 200000;
  int failures = 0;
  for (const Case& cs : cases) {
    GenerationConfig cfg;
    cfg.temperature = cs.t, cfg.top_p = cs.top_p, cfg.top_k = cs.top_k, cfg.seed = 1234;
    Sampler s(cfg);
    std::vector<int> counts(logits.size(), 0);
    for (int d = 0; d < draws; ++d) ++counts[s.Next(logits.data(), static_cast<int32_t>(logits.size()))];
    std::vector<double> want = Reference(logits, cfg);
    double worst = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      double f = static_cast<double>(counts[i]) / draws;
      double se = std::sqrt(std::max(want[i] * (1 - want[i]), 1e-12) / draws);
      if (want[i] == 0 && counts[i] != 0) {
        std::cerr << "token " << i << " was filtered out but drawn " << counts[i] << " times\n";
        ++failures;
      }
      worst = std::max(worst, std::abs(f - want[i]) / se);
    }
    bool ok = worst < 5.0;
    failures += !ok;
    std::cout << (ok ? "ok   " : "FAIL ") << "T=" << cs.t << " top_p=" << cs.top_p << " top_k=" << cs.top_k
              << ": worst deviation " << worst << " standard errors\n";
  }
  GenerationConfig greedy;  // temperature 0: argmax, first maximum on ties
  const std::vector<float> tie = {0.f, 3.f, 1.f, 3.f};
  if (Sampler(greedy).Next(tie.data(), 4) != 1) ++failures;
  std::cout << (failures ? "FAILED" : "PASSED") << "\n";
  return failures ? 1 : 0;
}
