// ReedSolomon: systematic RS(k, r) erasure coding over GF(2^8), built on ISA-L.
//
// The problem: farmem keeps data on other machines' memory, and those machines die or evict our
// slabs. Instead of storing N full copies, a unit of data (a 4 KiB page for blockdev, a span set
// for farptr) is cut into k data fragments, r parity fragments are computed from them, and the
// k + r fragments go to k + r distinct nodes. Any k of the k + r fragments are enough to get the
// data back, so up to r nodes can be lost at a storage cost of (k + r) / k.
//
// The code is systematic: data fragments 0..k-1 hold the data unchanged, parity fragments
// k..k+r-1 hold the checks. The generator is ISA-L's Cauchy matrix (gf_gen_cauchy1_matrix: the
// top k rows are the identity, row i >= k, column j is 1 / (i XOR j) in GF(2^8) with polynomial
// 0x11d), for which every k x k submatrix is invertible, so every pattern of up to r erasures is
// recoverable. Fragments are therefore byte-compatible with any other ISA-L user of that matrix.
//
// Fragment numbering, used by every method: index i in [0, k) is data fragment i, index k + j
// (j in [0, r)) is parity fragment j. Methods that take "all fragments" take k + r pointers in
// that order.
//
// Fragment length: any length from 1 byte to INT_MAX bytes (ISA-L's limit) works; no multiple is
// required. ISA-L is fastest when the length is a multiple of 64 and the buffers are 64-byte
// aligned, but correctness never depends on it. In farmem a 4 KiB page split 8 ways gives 512 B
// fragments and RS(4,2) gives 1024 B fragments.
//
// Ownership: a ReedSolomon owns only its coding tables and its cache of decode tables. It never
// owns, allocates or keeps fragment buffers: every call reads and writes the caller's buffers for
// the duration of the call only. Buffers that a call writes must not overlap buffers it reads.
//
// Threads: after Create() the object is immutable except for the decode-table cache, which is
// internally synchronized. Any number of threads may call any const method at the same time on
// one object (each on its own buffers). Decode tables for an erasure pattern are computed once
// (matrix inversion, a few microseconds) and cached for the lifetime of the object; once a pattern
// is cached, Decode and ReconstructData do not allocate and normally take no lock at all.
//
// Errors: bad arguments (counts, indices, lengths, null pointers) return InvalidArgument; more
// missing fragments than the code can repair return DataLoss. Nothing asserts or aborts.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "farmem/common/mutex.h"
#include "farmem/common/status.h"

namespace farmem::ec {

// k + r may not exceed this: erasure patterns are kept as 32-bit masks.
inline constexpr int kMaxFragments = 32;

// Decode tables kept per ReedSolomon object. Past this many distinct (survivor set, output set)
// patterns, further new patterns are still decoded correctly but their tables are computed per
// call (and allocate) instead of being cached. RS(10,4) has 1470 non-empty patterns of <= 4
// erasures plus 1001 survivor sets, so every realistic code fits.
inline constexpr size_t kMaxCachedDecodePlans = 4096;

class ReedSolomon {
 public:
  // Builds an RS(k, r) code: k data fragments, r parity fragments.
  // Requires 1 <= k, 0 <= r, k + r <= kMaxFragments. r == 0 is allowed (no redundancy: Encode and
  // UpdateParity do nothing, Decode only accepts "nothing erased").
  static Result<std::unique_ptr<ReedSolomon>> Create(int k, int r);

  ReedSolomon(const ReedSolomon&) = delete;
  ReedSolomon& operator=(const ReedSolomon&) = delete;
  ~ReedSolomon();

  int data_fragments() const { return k_; }
  int parity_fragments() const { return r_; }
  int total_fragments() const { return k_ + r_; }

  // Computes the r parity fragments from the k data fragments, each `len` bytes.
  // data.size() must be k, parity.size() must be r; no pointer may be null.
  Status Encode(std::span<const uint8_t* const> data, std::span<uint8_t* const> parity,
                size_t len) const;

  // Rebuilds the erased fragments in place.
  // `fragments` holds k + r pointers (see numbering above). `erased` lists the indices whose
  // contents are lost (any mix of data and parity, any order, no duplicates, at most r of them);
  // their buffers are overwritten with the rebuilt contents. The first k indices that are not
  // erased are read; other surviving fragments are neither read nor written and may be null.
  // An empty `erased` is a no-op. More than r erasures return DataLoss.
  Status Decode(std::span<uint8_t* const> fragments, std::span<const int> erased, size_t len) const;

  // Rebuilds only the data fragments from the first k fragments to arrive (Hydra-style reads:
  // ask all k + r nodes, decode as soon as any k answered).
  // `fragments` holds k + r pointers. `present` lists the indices whose buffers hold valid
  // contents, in arrival order, no duplicates; at least k of them (fewer returns DataLoss). The
  // first k entries of `present` are read. Every data fragment that is not listed in `present`
  // is written into its buffer. Parity buffers are never written, and parity buffers not among the
  // first k entries are never read (they may still be in flight, or null).
  Status ReconstructData(std::span<uint8_t* const> fragments, std::span<const int> present,
                         size_t len) const;

  // Incremental parity update after data fragment `index` (0 <= index < k) changed from
  // `old_data` to `new_data` (both `len` bytes): parity += coefficient * (old XOR new), so the
  // other k - 1 data fragments need not be read. `parity` holds the r current parity fragments
  // and is updated in place; the result equals a full Encode of the new data. `old_data` and
  // `new_data` may be the same buffer (no change). Needs no scratch memory from the caller.
  Status UpdateParity(int index, const uint8_t* old_data, const uint8_t* new_data,
                      std::span<uint8_t* const> parity, size_t len) const;

  // Same as UpdateParity when the caller already has delta = old_data XOR new_data (e.g. it was
  // computed on another node). Applying the same delta twice restores the old parity.
  Status UpdateParityWithDelta(int index, const uint8_t* delta, std::span<uint8_t* const> parity,
                               size_t len) const;

  // UpdateParityWithDelta for one parity fragment only: parity_buf (fragment k + parity) +=
  // coefficient(parity, index) * delta. Starting from a zero buffer and applying each of the k
  // data fragments once yields exactly that parity fragment of Encode: a node that holds one
  // parity fragment computes it as the data fragments arrive (farmemd's PARITY_ENCODE).
  Status UpdateParityFragmentWithDelta(int index, int parity, const uint8_t* delta,
                                       uint8_t* parity_buf, size_t len) const;

  // Builds and caches, now, the decode plan ReconstructData uses for every set of k fragments
  // present (every pattern of r erasures, C(k + r, k) of them; the ones with a data fragment
  // missing), so that a degraded read on a request path never builds one (building allocates:
  // farmem-nbd's swap safety). RS(4,2): 14 plans, about 6 KiB; RS(10,4): 1000 plans, about
  // 1.5 MiB. A code with more patterns than the cache holds (kMaxCachedDecodePlans: 8+8, 11+5
  // and wider) builds none and returns ResourceExhausted; its reads still work, building the
  // plans they meet. Returns the number of plans cached.
  Result<size_t> PrepareReconstructPlans() const;

  // Number of decode-table sets currently cached (for tests and metrics).
  size_t cached_decode_plans() const;

 private:
  static constexpr int kRecentPlanBits = 8;  // recent_plans_ has 256 slots

  // Decode tables for one (survivor set, output set) pair. Immutable once built.
  struct DecodePlan {
    uint64_t key = 0;  // (survivor_mask << 32) | output_mask
    int num_outputs = 0;
    uint8_t survivors[kMaxFragments] = {};  // the k fragment indices that are read
    uint8_t outputs[kMaxFragments] = {};    // the fragment indices that are written
    std::vector<uint8_t> tables;            // ec_init_tables output, 32 * k * num_outputs bytes
  };

  ReedSolomon(int k, int r);

  // Builds decode tables that read `survivor_mask` (exactly k bits) and write `output_mask`.
  Result<std::unique_ptr<DecodePlan>> BuildPlan(uint32_t survivor_mask, uint32_t output_mask) const;
  // Data path lookup: the plan in recent_plans_ for `key`, or null (then use FindOrBuildPlan).
  const DecodePlan* FindRecentPlan(uint64_t key) const;
  // Slow path: finds the plan in plans_ or builds and caches it. If the cache is full the plan is
  // built into `uncached` and a pointer to it is returned.
  Result<const DecodePlan*> FindOrBuildPlan(uint32_t survivor_mask, uint32_t output_mask,
                                            std::unique_ptr<DecodePlan>& uncached) const;
  // Runs `plan` on `fragments`: reads its survivors, writes its outputs.
  Status RunPlan(const DecodePlan& plan, std::span<uint8_t* const> fragments, size_t len) const;
  // The first use of a pattern (or a pattern that did not fit in the cache): look up or build the
  // plan, then RunPlan. Kept out of Decode so the cached path stays small.
  [[gnu::noinline]] Status RunUncachedPlan(uint32_t survivor_mask, uint32_t output_mask,
                                           std::span<uint8_t* const> fragments, size_t len) const;
  static size_t RecentSlot(uint64_t key) {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> (64 - kRecentPlanBits));
  }

  const int k_;
  const int r_;
  std::vector<uint8_t> encode_matrix_;  // (k + r) x k, row-major; top k rows are the identity
  std::vector<uint8_t> encode_tables_;  // ec_init_tables of the r parity rows, 32 * k * r bytes

  // Cache of decode plans, keyed by (survivor_mask << 32) | output_mask. Plans are never removed
  // while the object lives, so a pointer to one stays valid after the lock is released.
  mutable SharedMutex cache_mu_;
  // Owns every cached plan.
  mutable std::unordered_map<uint64_t, std::unique_ptr<const DecodePlan>> plans_
      GUARDED_BY(cache_mu_);
  // Lock-free front of plans_ for the data path: slot hash(key) holds the plan last used with a
  // key of that hash (or null). Readers check plan->key; a miss or a collision falls back to
  // plans_ under the lock. Stored while holding cache_mu_ (shared or exclusive), loaded without it.
  mutable std::array<std::atomic<const DecodePlan*>, 1 << kRecentPlanBits> recent_plans_{};
};

}  // namespace farmem::ec
