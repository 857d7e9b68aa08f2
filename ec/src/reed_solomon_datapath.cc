// Per-call coding paths of ReedSolomon: encode, decode, parity update. Nothing here allocates
// once the decode tables of a pattern are cached (see reed_solomon.cc).
//
// Each entry point checks its arguments with a few cheap combined tests and only on failure calls
// a cold *ArgsError function that finds the first bad argument and words the message. A whole
// 4 KiB page split 8 ways is encoded by ISA-L in about 70 ns, so per-call overhead shows.
#include <fmt/format.h>
#include <isa-l/erasure_code.h>

#include <algorithm>
#include <bit>
#include <climits>

#include "farmem/ec/reed_solomon.h"

namespace farmem::ec {
namespace {

// UpdateParity forms old XOR new in a stack buffer of this size, a chunk at a time.
constexpr size_t kUpdateChunk = 4096;

// ISA-L takes `unsigned char*` for buffers it only reads (sources, tables); it never writes them.
unsigned char* IsalIn(const uint8_t* p) { return const_cast<unsigned char*>(p); }

// True for 1 <= len <= INT_MAX (ISA-L takes the length as int).
bool LengthOk(size_t len) { return len - 1 < static_cast<size_t>(INT_MAX); }

[[gnu::cold]] Status LengthError(size_t len) {
  if (len == 0) return InvalidArgument("fragment length is 0; it must be at least 1 byte");
  return InvalidArgument(
      fmt::format("fragment length {} bytes exceeds the ISA-L limit of {} bytes", len, INT_MAX));
}

[[gnu::cold]] Status ParityError(int k, int r, std::span<uint8_t* const> parity) {
  if (parity.size() != static_cast<size_t>(r)) {
    return InvalidArgument(
        fmt::format("RS({},{}): got {} parity fragments, need {}", k, r, parity.size(), r));
  }
  for (int j = 0; j < r; ++j) {
    if (parity[j] == nullptr) {
      return InvalidArgument(
          fmt::format("RS({},{}): parity fragment {} (index {}) is null", k, r, j, k + j));
    }
  }
  return Status::Ok();
}

[[gnu::cold]] Status EncodeArgsError(int k, int r, std::span<const uint8_t* const> data,
                                     std::span<uint8_t* const> parity, size_t len) {
  if (data.size() != static_cast<size_t>(k)) {
    return InvalidArgument(
        fmt::format("RS({},{}) encode: got {} data fragments, need {}", k, r, data.size(), k));
  }
  FARMEM_RETURN_IF_ERROR(ParityError(k, r, parity));
  if (!LengthOk(len)) return LengthError(len);
  for (int i = 0; i < k; ++i) {
    if (data[i] == nullptr) {
      return InvalidArgument(fmt::format("RS({},{}) encode: data fragment {} is null", k, r, i));
    }
  }
  return Internal("RS encode: argument check failed without a reason");
}

[[gnu::cold]] Status FragmentCountError(int k, int r, const char* op, size_t got) {
  return InvalidArgument(
      fmt::format("RS({},{}) {}: got {} fragments, need k + r = {}", k, r, op, got, k + r));
}

[[gnu::cold]] Status IndexError(int k, int r, const char* op, const char* what, int index) {
  return InvalidArgument(
      fmt::format("RS({},{}) {}: {} index {} is outside [0, {})", k, r, op, what, index, k + r));
}

[[gnu::cold]] Status DuplicateError(int k, int r, const char* op, const char* what, int index) {
  return InvalidArgument(
      fmt::format("RS({},{}) {}: {} index {} is listed twice", k, r, op, what, index));
}

[[gnu::cold]] Status UpdateArgsError(int k, int r, int index, const uint8_t* a, const uint8_t* b,
                                     std::span<uint8_t* const> parity, size_t len) {
  if (index < 0 || index >= k) {
    return InvalidArgument(fmt::format(
        "RS({},{}) parity update: data fragment index {} is outside [0, {})", k, r, index, k));
  }
  if (a == nullptr || b == nullptr) {
    return InvalidArgument(
        fmt::format("RS({},{}) parity update: data buffer of fragment {} is null", k, r, index));
  }
  FARMEM_RETURN_IF_ERROR(ParityError(k, r, parity));
  if (!LengthOk(len)) return LengthError(len);
  return Internal("RS parity update: argument check failed without a reason");
}

// `mask` without its `drop` highest set bits (drop <= popcount(mask)). Avoids std::popcount,
// which is a libgcc call on baseline x86-64.
uint32_t DropHighestBits(uint32_t mask, int drop) {
  for (int i = 0; i < drop; ++i) mask &= ~(0x80000000u >> std::countl_zero(mask));
  return mask;
}

}  // namespace

Status ReedSolomon::Encode(std::span<const uint8_t* const> data, std::span<uint8_t* const> parity,
                           size_t len) const {
  bool bad = data.size() != static_cast<size_t>(k_) || parity.size() != static_cast<size_t>(r_) ||
             !LengthOk(len);
  unsigned char* src[kMaxFragments];
  unsigned char* dst[kMaxFragments];
  if (!bad) {
    for (int i = 0; i < k_; ++i) {
      src[i] = IsalIn(data[i]);
      bad |= src[i] == nullptr;
    }
    for (int j = 0; j < r_; ++j) {
      dst[j] = parity[j];
      bad |= dst[j] == nullptr;
    }
  }
  if (bad) [[unlikely]] {
    return EncodeArgsError(k_, r_, data, parity, len);
  }
  if (r_ == 0) return Status::Ok();
  ec_encode_data(static_cast<int>(len), k_, r_, IsalIn(encode_tables_.data()), src, dst);
  return Status::Ok();
}

const ReedSolomon::DecodePlan* ReedSolomon::FindRecentPlan(uint64_t key) const {
  // Acquire pairs with the release store in FindOrBuildPlan: the plan's contents are visible
  // once its pointer is.
  const DecodePlan* plan = recent_plans_[RecentSlot(key)].load(std::memory_order_acquire);
  return (plan != nullptr && plan->key == key) ? plan : nullptr;
}

Status ReedSolomon::Decode(std::span<uint8_t* const> fragments, std::span<const int> erased,
                           size_t len) const {
  const int n = k_ + r_;
  if (fragments.size() != static_cast<size_t>(n)) [[unlikely]] {
    return FragmentCountError(k_, r_, "decode", fragments.size());
  }
  if (!LengthOk(len)) [[unlikely]] {
    return LengthError(len);
  }
  uint32_t erased_mask = 0;
  for (int e : erased) {
    if (static_cast<unsigned>(e) >= static_cast<unsigned>(n)) [[unlikely]] {
      return IndexError(k_, r_, "decode", "erased", e);
    }
    if (erased_mask & (1u << e)) [[unlikely]] {
      return DuplicateError(k_, r_, "decode", "erased", e);
    }
    erased_mask |= 1u << e;
  }
  if (erased.size() > static_cast<size_t>(r_)) [[unlikely]] {
    return DataLoss(fmt::format("RS({},{}): {} fragments are erased, at most {} can be rebuilt", k_,
                                r_, erased.size(), r_));
  }
  if (erased_mask == 0) return Status::Ok();

  const uint32_t all_mask = (n == 32) ? ~0u : ((1u << n) - 1);
  // The first k fragments that are not erased: n - e candidates, drop the r - e highest.
  const uint32_t survivor_mask =
      DropHighestBits(all_mask & ~erased_mask, r_ - static_cast<int>(erased.size()));
  const DecodePlan* plan =
      FindRecentPlan((static_cast<uint64_t>(survivor_mask) << 32) | erased_mask);
  if (plan == nullptr) [[unlikely]] {
    return RunUncachedPlan(survivor_mask, erased_mask, fragments, len);
  }
  return RunPlan(*plan, fragments, len);
}

Status ReedSolomon::ReconstructData(std::span<uint8_t* const> fragments,
                                    std::span<const int> present, size_t len) const {
  const int n = k_ + r_;
  if (fragments.size() != static_cast<size_t>(n)) [[unlikely]] {
    return FragmentCountError(k_, r_, "reconstruct", fragments.size());
  }
  if (!LengthOk(len)) [[unlikely]] {
    return LengthError(len);
  }
  uint32_t present_mask = 0;
  uint32_t survivor_mask = 0;
  for (size_t i = 0; i < present.size(); ++i) {
    const int p = present[i];
    if (static_cast<unsigned>(p) >= static_cast<unsigned>(n)) [[unlikely]] {
      return IndexError(k_, r_, "reconstruct", "present", p);
    }
    if (present_mask & (1u << p)) [[unlikely]] {
      return DuplicateError(k_, r_, "reconstruct", "present", p);
    }
    present_mask |= 1u << p;
    if (i < static_cast<size_t>(k_)) survivor_mask |= 1u << p;
  }
  if (present.size() < static_cast<size_t>(k_)) [[unlikely]] {
    return DataLoss(fmt::format("RS({},{}): only {} fragments present, {} are needed", k_, r_,
                                present.size(), k_));
  }
  const uint32_t data_mask = (k_ == 32) ? ~0u : ((1u << k_) - 1);
  const uint32_t output_mask = data_mask & ~present_mask;
  if (output_mask == 0) return Status::Ok();

  const DecodePlan* plan =
      FindRecentPlan((static_cast<uint64_t>(survivor_mask) << 32) | output_mask);
  if (plan == nullptr) [[unlikely]] {
    return RunUncachedPlan(survivor_mask, output_mask, fragments, len);
  }
  return RunPlan(*plan, fragments, len);
}

Status ReedSolomon::RunUncachedPlan(uint32_t survivor_mask, uint32_t output_mask,
                                    std::span<uint8_t* const> fragments, size_t len) const {
  std::unique_ptr<DecodePlan> uncached;
  FARMEM_ASSIGN_OR_RETURN(const DecodePlan* plan,
                          FindOrBuildPlan(survivor_mask, output_mask, uncached));
  return RunPlan(*plan, fragments, len);
}

Status ReedSolomon::RunPlan(const DecodePlan& plan, std::span<uint8_t* const> fragments,
                            size_t len) const {
  unsigned char* src[kMaxFragments];
  unsigned char* dst[kMaxFragments];
  bool any_null = false;
  for (int i = 0; i < k_; ++i) {
    src[i] = fragments[plan.survivors[i]];
    any_null |= src[i] == nullptr;
  }
  for (int o = 0; o < plan.num_outputs; ++o) {
    dst[o] = fragments[plan.outputs[o]];
    any_null |= dst[o] == nullptr;
  }
  if (any_null) [[unlikely]] {
    for (int i = 0; i < k_; ++i) {
      if (src[i] == nullptr) {
        return InvalidArgument(
            fmt::format("RS({},{}): surviving fragment {} is null", k_, r_, plan.survivors[i]));
      }
    }
    for (int o = 0; o < plan.num_outputs; ++o) {
      if (dst[o] == nullptr) {
        return InvalidArgument(fmt::format("RS({},{}): buffer for rebuilt fragment {} is null", k_,
                                           r_, plan.outputs[o]));
      }
    }
  }
  ec_encode_data(static_cast<int>(len), k_, plan.num_outputs, IsalIn(plan.tables.data()), src, dst);
  return Status::Ok();
}

Status ReedSolomon::UpdateParityWithDelta(int index, const uint8_t* delta,
                                          std::span<uint8_t* const> parity, size_t len) const {
  bool bad = index < 0 || index >= k_ || delta == nullptr ||
             parity.size() != static_cast<size_t>(r_) || !LengthOk(len);
  unsigned char* dst[kMaxFragments];
  if (!bad) {
    for (int j = 0; j < r_; ++j) {
      dst[j] = parity[j];
      bad |= dst[j] == nullptr;
    }
  }
  if (bad) [[unlikely]] {
    return UpdateArgsError(k_, r_, index, delta, delta, parity, len);
  }
  if (r_ == 0) return Status::Ok();
  // ec_encode_data_update XORs coefficient(j, index) * delta into parity j: exactly the change
  // that replacing data fragment `index` by (old XOR delta) makes to a full encode.
  ec_encode_data_update(static_cast<int>(len), k_, r_, index, IsalIn(encode_tables_.data()),
                        IsalIn(delta), dst);
  return Status::Ok();
}

Status ReedSolomon::UpdateParityFragmentWithDelta(int index, int parity, const uint8_t* delta,
                                                  uint8_t* parity_buf, size_t len) const {
  if (index < 0 || index >= k_ || parity < 0 || parity >= r_ || delta == nullptr ||
      parity_buf == nullptr || !LengthOk(len)) [[unlikely]] {
    if (!LengthOk(len)) return LengthError(len);
    return InvalidArgument(fmt::format(
        "RS({},{}) parity fragment update: data index {} (need [0, {})), parity {} (need [0, "
        "{})), or a null buffer",
        k_, r_, index, k_, parity, r_));
  }
  // The r rows of encode_tables_ are 32 * k bytes apart: row `parity` alone is a one-row table.
  unsigned char* dst[1] = {parity_buf};
  ec_encode_data_update(static_cast<int>(len), k_, 1, index,
                        IsalIn(encode_tables_.data() + size_t{32} * k_ * parity), IsalIn(delta),
                        dst);
  return Status::Ok();
}

Status ReedSolomon::UpdateParity(int index, const uint8_t* old_data, const uint8_t* new_data,
                                 std::span<uint8_t* const> parity, size_t len) const {
  bool bad = index < 0 || index >= k_ || old_data == nullptr || new_data == nullptr ||
             parity.size() != static_cast<size_t>(r_) || !LengthOk(len);
  if (!bad) {
    for (int j = 0; j < r_; ++j) bad |= parity[j] == nullptr;
  }
  if (bad) [[unlikely]] {
    return UpdateArgsError(k_, r_, index, old_data, new_data, parity, len);
  }
  if (r_ == 0 || old_data == new_data) return Status::Ok();
  alignas(64) uint8_t delta[kUpdateChunk];
  unsigned char* dst[kMaxFragments];
  for (size_t off = 0; off < len; off += kUpdateChunk) {
    const size_t chunk = std::min(kUpdateChunk, len - off);
    for (size_t i = 0; i < chunk; ++i) delta[i] = old_data[off + i] ^ new_data[off + i];
    for (int j = 0; j < r_; ++j) dst[j] = parity[j] + off;
    ec_encode_data_update(static_cast<int>(chunk), k_, r_, index, IsalIn(encode_tables_.data()),
                          delta, dst);
  }
  return Status::Ok();
}

}  // namespace farmem::ec
