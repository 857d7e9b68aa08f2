#include "page_crypto.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "farmem/common/auth.h"

namespace farmem::blockdev {

Result<std::unique_ptr<PageCrypto>> PageCrypto::Create(const aead::Key& key, uint64_t pages,
                                                       SealObserver observer) {
  FARMEM_ASSIGN_OR_RETURN(aead::Cipher proto, aead::Cipher::Create(key));
  std::array<uint8_t, 12> seed{};
  FARMEM_RETURN_IF_ERROR(auth::RandomBytes(seed));
  uint32_t domain = 0;
  uint64_t first = 0;
  std::memcpy(&domain, seed.data(), 4);
  std::memcpy(&first, seed.data() + 4, 8);
  // Below 2^47: at least 2^47 page writes (512 PiB) before the counter runs out.
  first = (first & ((uint64_t{1} << 47) - 1)) + 1;
  return std::unique_ptr<PageCrypto>(
      new PageCrypto(std::move(proto), pages, domain, first, std::move(observer)));
}

PageCrypto::PageCrypto(aead::Cipher proto, uint64_t pages, uint32_t domain, uint64_t first_counter,
                       SealObserver observer)
    : proto_(std::move(proto)),
      pages_(pages),
      domain_(domain),
      next_counter_(first_counter),
      observer_(std::move(observer)) {
  nchunks_ = static_cast<size_t>((pages + kChunkPages - 1) / kChunkPages);
  chunks_ = std::make_unique<std::atomic<Entry*>[]>(nchunks_);
  stripes_ = std::make_unique<Stripe[]>(kStripes);
}

PageCrypto::~PageCrypto() {
  for (size_t i = 0; i < nchunks_; ++i) {
    Entry* c = chunks_[i].load();
    if (c != nullptr) {
      // The tags are not secret, but leave nothing of the table behind.
      std::memset(static_cast<void*>(c), 0, kChunkPages * sizeof(Entry));
      delete[] c;
    }
  }
}

Result<aead::Cipher> PageCrypto::NewCipher() const { return proto_.Clone(); }

std::array<uint8_t, 12> PageCrypto::Aad(uint32_t domain, uint64_t page) {
  std::array<uint8_t, 12> a{};
  for (int i = 0; i < 4; ++i) a[i] = static_cast<uint8_t>(domain >> (24 - 8 * i));
  for (int i = 0; i < 8; ++i) a[4 + i] = static_cast<uint8_t>(page >> (56 - 8 * i));
  return a;
}

PageCrypto::Entry* PageCrypto::EntryFor(uint64_t page, bool create) {
  std::atomic<Entry*>& slot = chunks_[page / kChunkPages];
  Entry* c = slot.load(std::memory_order_acquire);
  if (c == nullptr && create) {
    Entry* fresh = new Entry[kChunkPages]();
    if (slot.compare_exchange_strong(c, fresh, std::memory_order_acq_rel)) {
      c = fresh;
    } else {
      delete[] fresh;  // another writer of this chunk was first; c is its chunk
    }
  }
  return c == nullptr ? nullptr : c + page % kChunkPages;
}

const PageCrypto::Entry* PageCrypto::EntryFor(uint64_t page) const {
  const Entry* c = chunks_[page / kChunkPages].load(std::memory_order_acquire);
  return c == nullptr ? nullptr : c + page % kChunkPages;
}

PageCrypto::Unsettled* PageCrypto::Stripe::Find(uint64_t page) {
  for (size_t i = 0; i < live; ++i) {
    if (pages[i].page == page) return &pages[i];
  }
  return nullptr;
}

PageCrypto::Unsettled* PageCrypto::Stripe::FindOrAdd(uint64_t page) {
  if (Unsettled* u = Find(page)) return u;
  if (live == pages.size()) pages.emplace_back();
  Unsettled& u = pages[live++];
  u.page = page;
  return &u;
}

void PageCrypto::Stripe::Remove(Unsettled* u) {
  Unsettled& last = pages[live - 1];
  if (u != &last) std::swap(*u, last);  // swaps the vectors' buffers: nothing is allocated
  last.overlapped = false;
  last.seals.clear();
  --live;
}

void PageCrypto::Prefetch(uint64_t page, uint64_t count) const {
  constexpr uint64_t kLine = 64;
  constexpr uint64_t kMaxLines = 16;
  for (uint64_t p = page; p < page + count && p < pages_;) {
    const Entry* e = EntryFor(p);
    const uint64_t chunk_end = (p / kChunkPages + 1) * kChunkPages;
    const uint64_t stop = std::min({page + count, pages_, chunk_end});
    if (e != nullptr) {
      // Every line the entries touch (an entry may straddle two).
      const auto from = reinterpret_cast<uintptr_t>(e) / kLine * kLine;
      const auto to = reinterpret_cast<uintptr_t>(e + (stop - p));
      uint64_t lines = 0;
      for (uintptr_t at = from; at < to && lines < kMaxLines; at += kLine, ++lines) {
        __builtin_prefetch(reinterpret_cast<const void*>(at), 0);
      }
      if (lines == kMaxLines) return;
    }
    p = stop;
  }
}

void PageCrypto::PrefetchStripe(uint64_t page) const {
  const char* s = reinterpret_cast<const char*>(&StripeFor(page));
  for (size_t at = 0; at < sizeof(Stripe); at += 64) __builtin_prefetch(s + at, 1);
}

void PageCrypto::PrefetchEndWrite(uint64_t page, uint64_t count) const {
  constexpr uint64_t kMaxPages = 16;
  const uint64_t end = std::min(page + std::min(count, kMaxPages), pages_);
  if (page >= end) return;
  Prefetch(page, end - page);  // the entries: every line they touch
  // Their stripes: consecutive pages share one (StripeFor), each is loaded once.
  const Stripe* last = nullptr;
  for (uint64_t p = page; p < end; ++p) {
    if (&StripeFor(p) == last) continue;
    last = &StripeFor(p);
    PrefetchStripe(p);
  }
}

Status PageCrypto::Seal(aead::Cipher& cipher, uint64_t page, const uint8_t* plain, uint8_t* out) {
  Entry* e = EntryFor(page, true);
  // The entry of a random page is a cache miss: load it while the cipher runs, not after.
  __builtin_prefetch(e, 1);
  __builtin_prefetch(reinterpret_cast<const char*>(e + 1) - 1, 1);  // it may straddle two lines
  PrefetchStripe(page);                                             // locked after the cipher too
  const uint64_t counter = next_counter_.fetch_add(1, std::memory_order_relaxed);
  aead::Tag tag{};
  Status st;
  if (counter > kCounterMask) {
    st = ResourceExhausted(
        "the export's page write counter is used up (2^47 page writes since it was attached): "
        "restart farmem-nbd to draw a new nonce domain");
  } else {
    if (observer_) observer_(domain_, counter, page);
    st = cipher.Seal(aead::MakeNonce(domain_, counter), Aad(domain_, page), {plain, 4096},
                     {out, 4096}, &tag);
  }
  // The write is in flight from here until EndWrite, also when sealing failed. Counting it only
  // now, after the cipher, is enough: nothing of it has left the process yet (the caller posts
  // `out` after this returns), and it keeps this to one locked section per seal.
  Stripe& s = StripeFor(page);
  MutexLock lock(&s.mu);
  const bool overlapped = InFlight(e->word);
  e->word += uint64_t{1} << kCounterBits;
  if (!st.ok()) {
    if (overlapped) s.FindOrAdd(page)->overlapped = true;
    return st;
  }
  seals_.fetch_add(1, std::memory_order_relaxed);
  Unsettled* u = s.FindOrAdd(page);
  if (overlapped) u->overlapped = true;
  if (u->seals.size() >= kMaxAlternatives) u->seals.erase(u->seals.begin());
  u->seals.push_back({counter, tag});
  return Status::Ok();
}

void PageCrypto::EndWrite(uint64_t page, bool ok) {
  Entry* e = EntryFor(page, false);
  if (e == nullptr) return;
  Stripe& s = StripeFor(page);
  MutexLock lock(&s.mu);
  if (InFlight(e->word)) e->word -= uint64_t{1} << kCounterBits;
  Unsettled* u = s.Find(page);
  if (u == nullptr) return;
  if (ok && !u->seals.empty()) {
    // The newest seal becomes the recorded one. Alone (no other write of the page overlapped
    // it), it is what every member now holds: nothing else is kept. Overlapped, the members may
    // hold any of the seals that were in flight, or the one recorded before: keep them all.
    const Candidate newest = u->seals.back();
    u->seals.pop_back();
    if (u->overlapped) {
      if ((e->word & kCounterMask) != 0) {
        if (u->seals.size() >= kMaxAlternatives) u->seals.erase(u->seals.begin());
        u->seals.insert(u->seals.begin(), Candidate{e->word & kCounterMask, e->tag});
      }
    } else {
      u->seals.clear();
    }
    e->word = (e->word & ~kCounterMask) | newest.counter;
    e->tag = newest.tag;
  }
  if (!InFlight(e->word)) {
    u->overlapped = false;
    if (u->seals.empty()) s.Remove(u);
  }
}

Status PageCrypto::Open(aead::Cipher& cipher, uint64_t page, uint8_t* data) const {
  const Entry* e = EntryFor(page);
  // The recorded seal first, then the unsettled ones newest first (left uninitialized: only the
  // first n are read).
  std::array<Candidate, kMaxAlternatives + 1> tries;
  size_t n = 0;
  if (e != nullptr) {
    Stripe& s = StripeFor(page);
    MutexLock lock(&s.mu);
    if ((e->word & kCounterMask) != 0) tries[n++] = Candidate{e->word & kCounterMask, e->tag};
    if (const Unsettled* u = s.Find(page)) {
      for (auto it = u->seals.rbegin(); it != u->seals.rend() && n < tries.size(); ++it) {
        tries[n++] = *it;
      }
    }
  }
  if (n == 0) {
    std::memset(data, 0, 4096);
    return DataLoss(fmt::format("export page {} has no recorded seal", page));
  }
  const auto aad = Aad(domain_, page);
  std::array<uint8_t, 4096> copy;  // the ciphertext again for each alternative (Open zeroes it)
  if (n > 1) std::memcpy(copy.data(), data, 4096);
  Status st;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) std::memcpy(data, copy.data(), 4096);
    st = cipher.Open(aead::MakeNonce(domain_, tries[i].counter), aad, {data, 4096}, {data, 4096},
                     tries[i].tag);
    if (st.ok()) return st;
  }
  return st;
}

uint64_t PageCrypto::Word(uint64_t page) const {
  const Entry* e = EntryFor(page);
  if (e == nullptr) return 0;
  MutexLock lock(&StripeFor(page).mu);
  return e->word;
}

}  // namespace farmem::blockdev
