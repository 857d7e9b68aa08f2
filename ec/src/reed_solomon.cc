// Setup side of ReedSolomon: building the code, building and caching decode tables.
// The per-call coding paths are in reed_solomon_datapath.cc.
#include "farmem/ec/reed_solomon.h"

#include <fmt/format.h>
#include <isa-l/erasure_code.h>

#include <cstring>

namespace farmem::ec {

Result<std::unique_ptr<ReedSolomon>> ReedSolomon::Create(int k, int r) {
  if (k < 1) {
    return Err(
        InvalidArgument(fmt::format("RS(k={}, r={}): k must be at least 1 data fragment", k, r)));
  }
  if (r < 0) {
    return Err(
        InvalidArgument(fmt::format("RS(k={}, r={}): r (parity fragments) must be >= 0", k, r)));
  }
  if (k > kMaxFragments || r > kMaxFragments || k + r > kMaxFragments) {
    return Err(InvalidArgument(
        fmt::format("RS(k={}, r={}): k + r = {} fragments, at most {} are supported", k, r,
                    static_cast<long long>(k) + r, kMaxFragments)));
  }
  return std::unique_ptr<ReedSolomon>(new ReedSolomon(k, r));
}

ReedSolomon::ReedSolomon(int k, int r)
    : k_(k),
      r_(r),
      encode_matrix_(static_cast<size_t>(k + r) * k),
      encode_tables_(static_cast<size_t>(32) * k * r) {
  gf_gen_cauchy1_matrix(encode_matrix_.data(), k + r, k);
  if (r > 0) ec_init_tables(k, r, encode_matrix_.data() + k * k, encode_tables_.data());
}

ReedSolomon::~ReedSolomon() = default;

Result<std::unique_ptr<ReedSolomon::DecodePlan>> ReedSolomon::BuildPlan(
    uint32_t survivor_mask, uint32_t output_mask) const {
  auto plan = std::make_unique<DecodePlan>();
  plan->key = (static_cast<uint64_t>(survivor_mask) << 32) | output_mask;
  const int n = k_ + r_;
  int num_survivors = 0;
  for (int i = 0; i < n; ++i) {
    if (survivor_mask & (1u << i)) plan->survivors[num_survivors++] = static_cast<uint8_t>(i);
    if (output_mask & (1u << i)) plan->outputs[plan->num_outputs++] = static_cast<uint8_t>(i);
  }
  if (num_survivors != k_) {
    return Err(Internal(fmt::format("RS({},{}): decode plan with {} survivors instead of {}", k_,
                                    r_, num_survivors, k_)));
  }
  if (plan->num_outputs == 0) return plan;

  // Rows of the generator that produced the survivors; inverting them maps survivors back to data.
  uint8_t survivor_rows[kMaxFragments * kMaxFragments];
  uint8_t inverse[kMaxFragments * kMaxFragments];
  for (int i = 0; i < k_; ++i) {
    std::memcpy(&survivor_rows[i * k_], &encode_matrix_[plan->survivors[i] * k_], k_);
  }
  if (gf_invert_matrix(survivor_rows, inverse, k_) != 0) {
    // Cannot happen for a Cauchy generator; reported rather than trusted.
    return Err(Internal(fmt::format("RS({},{}): decode matrix for survivor mask {:#x} is singular",
                                    k_, r_, survivor_mask)));
  }

  // A lost data fragment is its row of the inverse. A lost parity fragment is its generator row
  // applied to the recovered data: (generator row) x inverse, so it comes out in the same pass.
  uint8_t decode_rows[kMaxFragments * kMaxFragments];
  for (int o = 0; o < plan->num_outputs; ++o) {
    const int out = plan->outputs[o];
    uint8_t* row = &decode_rows[o * k_];
    if (out < k_) {
      std::memcpy(row, &inverse[out * k_], k_);
      continue;
    }
    for (int j = 0; j < k_; ++j) {
      uint8_t acc = 0;
      for (int l = 0; l < k_; ++l) acc ^= gf_mul(encode_matrix_[out * k_ + l], inverse[l * k_ + j]);
      row[j] = acc;
    }
  }
  plan->tables.resize(static_cast<size_t>(32) * k_ * plan->num_outputs);
  ec_init_tables(k_, plan->num_outputs, decode_rows, plan->tables.data());
  return plan;
}

Result<const ReedSolomon::DecodePlan*> ReedSolomon::FindOrBuildPlan(
    uint32_t survivor_mask, uint32_t output_mask, std::unique_ptr<DecodePlan>& uncached) const {
  const uint64_t key = (static_cast<uint64_t>(survivor_mask) << 32) | output_mask;
  // The data path already missed in recent_plans_ (FindRecentPlan); publishing there with release
  // pairs with its acquire load, so a plan's contents are visible once its pointer is.
  std::atomic<const DecodePlan*>& slot = recent_plans_[RecentSlot(key)];
  {
    ReaderLock lock(&cache_mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      slot.store(it->second.get(), std::memory_order_release);
      return it->second.get();
    }
  }
  // Built outside the lock so that a slow first decode does not stall decodes of cached patterns.
  // Two threads may build the same plan; the second one is dropped.
  FARMEM_ASSIGN_OR_RETURN(std::unique_ptr<DecodePlan> plan, BuildPlan(survivor_mask, output_mask));
  WriterLock lock(&cache_mu_);
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    if (plans_.size() >= kMaxCachedDecodePlans) {
      uncached = std::move(plan);
      return uncached.get();
    }
    it = plans_.emplace(key, std::move(plan)).first;
  }
  slot.store(it->second.get(), std::memory_order_release);
  return it->second.get();
}

Result<size_t> ReedSolomon::PrepareReconstructPlans() const {
  const int n = k_ + r_;
  if (r_ == 0) return cached_decode_plans();
  // C(n, k), without overflow for n <= 32.
  uint64_t patterns = 1;
  for (int i = 1; i <= r_; ++i) patterns = patterns * static_cast<uint64_t>(k_ + i) / i;
  if (patterns > kMaxCachedDecodePlans) {
    return Err(ResourceExhausted(fmt::format(
        "RS({},{}): {} patterns of {} erasures exceed the {} decode plans cached; a read that "
        "meets a new one builds its plan then",
        k_, r_, patterns, r_, kMaxCachedDecodePlans)));
  }
  const uint32_t data_mask = (k_ == 32) ? ~0u : ((1u << k_) - 1);
  // Every k-subset of the n fragments, as ReconstructData sees it: those k read, the data
  // fragments among the other r written.
  // (Gosper's hack: the next larger mask with k bits set.)
  for (uint64_t present = (uint64_t{1} << k_) - 1; present < (uint64_t{1} << n);) {
    const uint32_t survivors = static_cast<uint32_t>(present);
    const uint64_t low = present & (~present + 1);
    const uint64_t ripple = present + low;
    present = ripple | (((present ^ ripple) >> 2) / low);
    const uint32_t outputs = data_mask & ~survivors;
    if (outputs == 0) continue;
    std::unique_ptr<DecodePlan> uncached;
    FARMEM_ASSIGN_OR_RETURN(const DecodePlan* plan, FindOrBuildPlan(survivors, outputs, uncached));
    (void)plan;
  }
  return cached_decode_plans();
}

size_t ReedSolomon::cached_decode_plans() const {
  ReaderLock lock(&cache_mu_);
  return plans_.size();
}

}  // namespace farmem::ec
