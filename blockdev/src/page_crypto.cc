#include "page_crypto.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
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
  stripes_ = std::make_unique<Mutex[]>(kStripes);
  unsettled_ = std::make_unique<std::unordered_map<uint64_t, Unsettled>[]>(kStripes);
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

Status PageCrypto::Seal(aead::Cipher& cipher, uint64_t page, const uint8_t* plain, uint8_t* out) {
  Entry* e = EntryFor(page, true);
  const uint64_t counter = next_counter_.fetch_add(1, std::memory_order_relaxed);
  {
    MutexLock lock(&StripeFor(page));
    e->word += uint64_t{1} << kCounterBits;  // a write in flight, until EndWrite
    // Until this write is known done, the remote copy may still hold the version before it.
    if (const uint64_t before = e->word & kCounterMask; before != 0) {
      std::vector<Version>& v = unsettled_[(page / 8) % kStripes][page].versions;
      if (std::none_of(v.begin(), v.end(), [&](const Version& x) { return x.counter == before; })) {
        if (v.size() >= kMaxUnsettled) v.erase(v.begin() + 1);  // keep the oldest
        v.push_back(Version{before, e->tag});
      }
    }
  }
  if (counter > kCounterMask) {
    return ResourceExhausted(
        "the export's page write counter is used up (2^47 page writes since it was attached): "
        "restart farmem-nbd to draw a new nonce domain");
  }
  if (observer_) observer_(domain_, counter, page);
  const auto aad = Aad(domain_, page);
  aead::Tag tag{};
  FARMEM_RETURN_IF_ERROR(
      cipher.Seal(aead::MakeNonce(domain_, counter), aad, {plain, 4096}, {out, 4096}, &tag));
  seals_.fetch_add(1, std::memory_order_relaxed);
  MutexLock lock(&StripeFor(page));
  e->word = (e->word & ~kCounterMask) | counter;
  e->tag = tag;
  return Status::Ok();
}

void PageCrypto::EndWrite(uint64_t page, bool written) {
  Entry* e = EntryFor(page, false);
  if (e == nullptr) return;
  MutexLock lock(&StripeFor(page));
  if (InFlight(e->word)) e->word -= uint64_t{1} << kCounterBits;
  auto& map = unsettled_[(page / 8) % kStripes];
  auto it = map.find(page);
  if (it == map.end()) return;
  if (!written) {
    it->second.failed = true;
  } else if (!InFlight(e->word)) {
    // Done, and no other write of the page on its way: the remote copy is the entry's version.
    map.erase(it);
  }
}

Status PageCrypto::Open(aead::Cipher& cipher, uint64_t page, uint8_t* data) const {
  const Entry* e = EntryFor(page);
  uint64_t counter = 0;
  aead::Tag tag{};
  std::vector<Version> others;  // after a failed write: the other versions it may hold
  if (e != nullptr) {
    MutexLock lock(&StripeFor(page));
    counter = e->word & kCounterMask;
    tag = e->tag;
    const auto& map = unsettled_[(page / 8) % kStripes];
    if (auto it = map.find(page); it != map.end() && it->second.failed) {
      others = it->second.versions;
    }
  }
  if (counter == 0 && others.empty()) {
    std::memset(data, 0, 4096);
    return DataLoss(fmt::format("export page {} has no recorded seal", page));
  }
  const auto aad = Aad(domain_, page);
  if (others.empty()) {
    return cipher.Open(aead::MakeNonce(domain_, counter), aad, {data, 4096}, {data, 4096}, tag);
  }
  // Newest first: the current version, then those before the failed write(s).
  others.push_back(Version{counter, tag});
  std::array<uint8_t, 4096> stored;
  std::memcpy(stored.data(), data, stored.size());
  Status first;
  for (auto v = others.rbegin(); v != others.rend(); ++v) {
    if (v->counter == 0) continue;
    if (v != others.rbegin()) std::memcpy(data, stored.data(), stored.size());
    Status s =
        cipher.Open(aead::MakeNonce(domain_, v->counter), aad, {data, 4096}, {data, 4096}, v->tag);
    if (s.ok()) return s;
    if (first.ok()) first = s;
  }
  std::memset(data, 0, 4096);
  return first;
}

uint64_t PageCrypto::Word(uint64_t page) const {
  const Entry* e = EntryFor(page);
  if (e == nullptr) return 0;
  MutexLock lock(&StripeFor(page));
  return e->word;
}

}  // namespace farmem::blockdev
