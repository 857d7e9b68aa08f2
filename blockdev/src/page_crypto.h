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
// Writes in flight: Seal counts a write in flight on its page (from when its ciphertext exists,
// before the caller posts it) until EndWrite, so that a read whose page fails to open while the
// page is being rewritten is recognised as that race (retried) and not as a corrupted member
// (InFlight, Word).
//
// Which seal the lenders hold: a page's recorded (counter, tag) changes only when a write of it
// is acknowledged (EndWrite with ok). A seal whose write failed may or may not have reached the
// members (a round can stop before posting it, or fail after some members took it), and two
// overlapping writes of one page may land in either order; until a write of the page succeeds
// alone, those seals are kept as alternatives and Open tries them after the recorded one (at most
// kMaxAlternatives per page, newest first). They live in a side table, only for such pages.
//
// Threading: every method may be called from any thread; a page's entry is guarded by one of a
// set of striped locks. Seal, EndWrite and Open each take their page's lock once and, once the
// stripe has held as many pages in flight before, allocate nothing. aead::Cipher is not
// thread-safe: each thread passes its own (NewCipher).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
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
  // counter and counts a write in flight on the page until EndWrite(page, ok) — also when Seal
  // fails. `ok`: the write was acknowledged by the members (then its seal becomes the page's
  // recorded one); otherwise its seal stays an alternative the members may hold.
  Status Seal(aead::Cipher& cipher, uint64_t page, const uint8_t* plain, uint8_t* out);
  void EndWrite(uint64_t page, bool ok);

  // Opens `data` (4096 bytes of export page `page`, as stored remotely) in place against the
  // page's recorded (counter, tag), then its alternatives and the seals of writes in flight.
  // DataLoss when none authenticates it (then `data` is zeroed).
  Status Open(aead::Cipher& cipher, uint64_t page, uint8_t* data) const;

  // Starts loading the page table entries of `count` pages from `page` into the cache (no effect
  // on pages never written): a read calls it when it posts, so that Open, when the ciphertext
  // arrives, does not stall on them (a random page's entry is a cache miss, ~0.3 us per page on
  // a loaded machine). At most the first 16 cache lines are requested.
  void Prefetch(uint64_t page, uint64_t count) const;

  // Starts loading what EndWrite touches for `count` pages from `page` (their table entries and
  // their stripes' locks) into the cache: a write's completion calls it for every page of its
  // batch before ending them, so that their misses overlap instead of following one another
  // (between Seal and EndWrite a network round trip has passed: on a busy machine those lines are
  // gone). At most the first 16 pages.
  void PrefetchEndWrite(uint64_t page, uint64_t count) const;

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
    uint64_t word = 0;  // writes in flight << 48 | counter of the recorded seal (0: never sealed)
    aead::Tag tag{};
  };
  static_assert(sizeof(Entry) == kEntryBytes);
  struct Candidate {  // trivial: Open keeps an uninitialized array of them on its stack
    uint64_t counter;
    aead::Tag tag;
  };
  // Seals of a page not (yet) known to be what its members hold: writes in flight, and failed or
  // overlapping writes since its last lone successful write.
  struct Unsettled {
    uint64_t page = 0;
    bool overlapped = false;       // a seal began while another write of the page was in flight
    std::vector<Candidate> seals;  // oldest first
  };
  static constexpr size_t kMaxAlternatives = 16;
  // One of the striped locks, with the unsettled pages of its stripe. Those are the first `live`
  // of `pages`; the entries after them are free and keep their vectors' capacity, so that a page
  // write allocates nothing once its stripe has had as many pages unsettled at once before (a
  // hash map here cost a node and a vector per write, and Open a vector per read). A
  // stripe holds few such pages at a time (those of the writes in flight, 8 consecutive pages in
  // every 2048 share a stripe), so they are searched linearly. Aligned so that two stripes'
  // locks never share a cache line.
  struct alignas(64) Stripe {
    Mutex mu;
    std::vector<Unsettled> pages GUARDED_BY(mu);
    size_t live GUARDED_BY(mu) = 0;

    Unsettled* Find(uint64_t page) REQUIRES(mu);
    Unsettled* FindOrAdd(uint64_t page) REQUIRES(mu);
    void Remove(Unsettled* u) REQUIRES(mu);  // u: a live entry
  };

  PageCrypto(aead::Cipher proto, uint64_t pages, uint32_t domain, uint64_t first_counter,
             SealObserver observer);
  Entry* EntryFor(uint64_t page, bool create);
  const Entry* EntryFor(uint64_t page) const;
  Stripe& StripeFor(uint64_t page) const { return stripes_[(page / 8) % kStripes]; }
  // Every cache line of a page's stripe (its lock and its unsettled pages' vector: two lines).
  void PrefetchStripe(uint64_t page) const;
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
  // Guard the entries (not expressible as GUARDED_BY: an entry's stripe is computed) and each
  // stripe's unsettled pages.
  mutable std::unique_ptr<Stripe[]> stripes_;
};

}  // namespace farmem::blockdev
