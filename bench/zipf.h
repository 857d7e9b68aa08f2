// Key generators the benchmarks share, so that far_ptr's and the kernel's figures are taken on the
// same key streams (farptr_bench, kv_bench).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

namespace farmem::bench {

// YCSB's scrambled Zipfian generator (Gray et al., "Quickly generating billion-record synthetic
// databases"): rank 0 is the most popular; ranks are hashed over [0, n) so hot items are spread
// over the structure instead of packed at its start.
class Zipf {
 public:
  Zipf(uint64_t n, double theta, uint64_t seed) : n_(n), theta_(theta), rng_(seed) {
    for (uint64_t i = 1; i <= n; ++i) zetan_ += 1.0 / std::pow(static_cast<double>(i), theta);
    const double zeta2 = 1.0 + 1.0 / std::pow(2.0, theta);
    alpha_ = 1.0 / (1.0 - theta);
    eta_ = (1.0 - std::pow(2.0 / static_cast<double>(n), 1.0 - theta)) / (1.0 - zeta2 / zetan_);
  }
  uint64_t Next() {
    const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
    const double uz = u * zetan_;
    uint64_t rank = 0;
    if (uz < 1.0) {
      rank = 0;
    } else if (uz < 1.0 + std::pow(0.5, theta_)) {
      rank = 1;
    } else {
      rank =
          static_cast<uint64_t>(static_cast<double>(n_) * std::pow(eta_ * u - eta_ + 1.0, alpha_));
    }
    uint64_t h = (rank + 1) * 0x9E3779B97F4A7C15ull;  // scramble
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return h % n_;
  }

 private:
  uint64_t n_;
  double theta_, zetan_ = 0, alpha_ = 0, eta_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace farmem::bench
