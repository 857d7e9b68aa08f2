// PageCrypto: the page store's encryption at the page boundary (docs/security.md "Pages of
// farmem-nbd"). Every 4 KiB page is sealed with AES-256-GCM (common/aead.h) under the export's
// data key before anything of it leaves the process — remote members, parity (computed over the
// ciphertext) and the backup file all hold ciphertext — and opened on the way back. Rebuilds,
// moves and degraded reads copy or decode ciphertext and never need the key.
//
// Nonce: (domain, counter). `domain` is a random 32-bit value drawn per attach (per PageCrypto);
// `counter` is the export's write counter, started at a random value below 2^47 and taken anew
// for every page write (overwrites, read-modify-writes and retries alike); nothing ever
// re-encrypts with an old counter, so a nonce never repeats within an attach, and two attaches
// under one data key (--data-key-file) would need the same random domain and overlapping counter
// ranges. AAD: domain || export page number, so a ciphertext cannot be moved to another page.
// The page table keeps, per page, the counter and the tag of its last write (24 bytes per 4 KiB
// page: 6 MiB per GiB of written export, allocated per 64 MiB chunk on its first write); the
// lenders only ever see ciphertext, and a stale ciphertext (an old write replayed) fails because
// its tag is not the one kept.
//
// Writes in flight: Seal counts a write in flight on its page until EndWrite, so that a read whose
// page fails to open while the page is being rewritten is recognised as that race (retried) and
// not as a corrupted member (InFlight, Word).
//
// Writes that failed: a write reported failed (EndWrite(page, false)) may or may not have reached
// the lender — it can be applied after its op timed out (a paused daemon that resumes) or never —
// so the remote copy holds either the version before it or the failed one (NBD leaves a failed
// write's range unspecified, not unreadable). Until the page is written successfully, Open accepts
// the versions sealed since its last successful write as well as the current one; a successful
// write ends that. Kept only for pages in that state (a small map per stripe).
//
// Threading: every method may be called from any thread; a page's entry is guarded by one of a
// set of striped locks. aead::Cipher is not thread-safe: each thread passes its own (NewCipher).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "farmem/common/aead.h"
#include "farmem/common/mutex.h"
#include "farmem/common/status.h"

namespace farmem::blockdev {

class PageCrypto {
 public:
  // Called with (domain, counter, page) of every seal, before the ciphertext is used: for tests
  // that check nonce uniqueness.
  using SealObserver = std::function<void(uint32_t domain, uint64_t counter, uint64_t page)>;

  // An export of `pages` pages under `key`.
  static Result<std::unique_ptr<PageCrypto>> Create(const aead::Key& key, uint64_t pages,
                                                    SealObserver observer = nullptr);
  ~PageCrypto();

  // A cipher under the export's key for one thread.
  Result<aead::Cipher> NewCipher() const;

  // Seals `plain` (4096 bytes, export page `page`) into `out` (may be `plain`) with the next
  // counter, records (counter, tag) for the page and counts a write in flight on it until
  // EndWrite(page, ...) — also when Seal fails.
  Status Seal(aead::Cipher& cipher, uint64_t page, const uint8_t* plain, uint8_t* out);
  // `written`: the write was acknowledged as done (false: it failed, or Seal did; the remote copy
  // may hold the version before it or this one, and Open accepts both until a write succeeds).
  void EndWrite(uint64_t page, bool written);

  // Opens `data` (4096 bytes of export page `page`, as stored remotely) in place against the
  // page's recorded (counter, tag) — or, after a failed write of the page, any version it may
  // hold (see above). DataLoss when it fails authentication (then `data` is zeroed).
  Status Open(aead::Cipher& cipher, uint64_t page, uint8_t* data) const;

  // The page's counter and writes in flight, as one word: equal words before and after a read
  // mean no write of the page began or ended in between.
  uint64_t Word(uint64_t page) const;
  static bool InFlight(uint64_t word) { return (word >> kCounterBits) != 0; }

  uint32_t domain() const { return domain_; }
  uint64_t seals() const { return seals_.load(std::memory_order_relaxed); }

  static constexpr size_t kEntryBytes = 24;  // counter (with writes in flight) + tag

 private:
  static constexpr int kCounterBits = 48;
  static constexpr uint64_t kCounterMask = (uint64_t{1} << kCounterBits) - 1;
  static constexpr uint64_t kChunkPages = 16384;  // 64 MiB of export per table chunk
  static constexpr size_t kStripes = 256;

  struct Entry {
    uint64_t word = 0;  // writes in flight << 48 | counter of the last seal (0: never sealed)
    aead::Tag tag{};
  };
  static_assert(sizeof(Entry) == kEntryBytes);
  struct Version {
    uint64_t counter = 0;
    aead::Tag tag{};
  };
  // Per page with a write in flight or a failed write since its last successful one: the versions
  // the remote copy may hold besides the entry's (oldest first, at most kMaxUnsettled), and
  // whether a write of it failed since.
  struct Unsettled {
    std::vector<Version> versions;
    bool failed = false;
  };
  static constexpr size_t kMaxUnsettled = 8;

  PageCrypto(aead::Cipher proto, uint64_t pages, uint32_t domain, uint64_t first_counter,
             SealObserver observer);
  Entry* EntryFor(uint64_t page, bool create);
  const Entry* EntryFor(uint64_t page) const;
  Mutex& StripeFor(uint64_t page) const { return stripes_[(page / 8) % kStripes]; }
  static std::array<uint8_t, 12> Aad(uint32_t domain, uint64_t page);

  const aead::Cipher proto_;  // only cloned (Clone is const and thread-safe)
  const uint64_t pages_;
  const uint32_t domain_;
  std::atomic<uint64_t> next_counter_;
  std::atomic<uint64_t> seals_{0};
  SealObserver observer_;
  // Chunks of the page table, allocated on their first seal; never freed before the store.
  std::unique_ptr<std::atomic<Entry*>[]> chunks_;
  size_t nchunks_ = 0;
  // Guard the entries (not expressible as GUARDED_BY: an entry's stripe is computed).
  mutable std::unique_ptr<Mutex[]> stripes_;
  // Unsettled pages, per stripe (guarded by that stripe's mutex).
  std::unique_ptr<std::unordered_map<uint64_t, Unsettled>[]> unsettled_;
};

}  // namespace farmem::blockdev
