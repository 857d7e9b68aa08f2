// Page encryption in the page store (page_crypto.h has the scheme, docs/security.md the why):
// sealing writes at the page boundary, and what a read does with a page that fails
// authentication — it is treated as a failed member: another replica, a decode without the bad
// member(s), or the backup file serves it, the bad members are marked failed so re-protection
// rewrites them, and the event is counted and logged; with no good copy the read fails for
// exactly that page. Rebuilds and moves (page_store_rebuild.cc, page_store_move.cc) copy
// ciphertext and never come here.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <iterator>
#include <thread>

#include "page_store.h"
#include "page_store_round.h"

namespace farmem::blockdev {

using namespace pagestore;

namespace {
constexpr std::chrono::seconds kIntegrityLogPeriod{10};
LogEvery& IntegrityLog() {
  static LogEvery log(kIntegrityLogPeriod);
  return log;
}
// A failed page whose entry changes while it is checked is being rewritten (a race with a
// write, not a bad member): checked again this many times before the read gives up.
constexpr int kRaceAttempts = 64;
}  // namespace

Status PageStore::SealPages(Worker& w, uint64_t offset, const uint8_t* plain, uint64_t len,
                            uint8_t* out) {
  const uint64_t first = offset / kPage;
  for (uint64_t i = 0; i < len / kPage; ++i) {
    if (Status s = crypto_->Seal(*w.cipher, first + i, plain + i * kPage, out + i * kPage);
        !s.ok()) {
      EndWrites(offset, (i + 1) * kPage, /*ok=*/false);
      return s;
    }
  }
  if (backup_) {
    if (Status s = backup_->Write(offset, {out, static_cast<size_t>(len)}); !s.ok()) {
      EndWrites(offset, len, /*ok=*/false);
      return s;
    }
  }
  return Status::Ok();
}

void PageStore::EndWrites(uint64_t offset, uint64_t len, bool ok) {
  for (uint64_t p = offset / kPage; p < (offset + len) / kPage; ++p) crypto_->EndWrite(p, ok);
}

Status PageStore::OpenFromBackup(Worker& w, Piece& p) {
  const uint64_t base = p.index * (extent_bytes_ / kPage) + p.first_page;
  for (uint64_t pg = 0; pg < p.npages; ++pg) {
    uint8_t* data = p.buf + pg * kPage;
    if (!p.extent->Test(p.extent->written, p.first_page + pg)) {
      std::memset(data, 0, kPage);
      continue;
    }
    if (Status s = crypto_->Open(*w.cipher, base + pg, data); !s.ok()) {
      CountStat(&PageStoreStats::integrity_failures);
      Status err = IoError(fmt::format(
          "export page {} (offset {}): its copy in the backup file {} failed authentication and "
          "no daemon holds it: {}",
          base + pg, (base + pg) * kPage, backup_->path(), s.message()));
      spdlog::error("page store: {}", err.message());
      return err;
    }
  }
  return Status::Ok();
}

bool PageStore::FindGoodCopy(Worker& w, Extent& e, uint64_t index, uint64_t page, uint8_t* out,
                             uint32_t* bad) {
  *bad = 0;
  const uint64_t global = index * (extent_bytes_ / kPage) + page;
  const size_t n = e.members.size();
  const uint32_t live = e.live_mask();
  const size_t flen = frag_size_;
  std::vector<uint8_t> copies(n * flen);  // member m's bytes of the page at m * flen
  uint32_t read_ok = 0;
  for (size_t m = 0; m < n; ++m) {
    if (!((live >> m) & 1)) continue;
    const int one[1] = {static_cast<int>(m)};
    if (ReadMembers(w, e, one, page * flen, copies.data(), flen).ok()) read_ok |= 1u << m;
  }
  std::vector<uint8_t> trial(kPage);
  if (!codec_) {
    for (size_t m = 0; m < n; ++m) {  // each replica (none: the one member)
      if (!((read_ok >> m) & 1)) continue;
      std::memcpy(trial.data(), copies.data() + m * flen, kPage);
      if (!crypto_->Open(*w.cipher, global, trial.data()).ok()) continue;
      std::memcpy(out, trial.data(), kPage);
      for (size_t o = 0; o < n; ++o) {  // every replica read that is not this ciphertext
        if (((read_ok >> o) & 1) &&
            std::memcmp(copies.data() + o * flen, copies.data() + m * flen, kPage) != 0) {
          *bad |= 1u << o;
        }
      }
      return true;
    }
    *bad = read_ok;
    return false;
  }
  // ec: the fragments of every k-subset of the members read, until one decodes to a page that
  // opens; then the members whose fragment differs from that page's encoding are the bad ones.
  const int k = options_.resilience.k;
  const int r = options_.resilience.r;
  if (std::popcount(read_ok) < k) {
    *bad = read_ok;
    return false;
  }
  std::vector<uint8_t> work(n * flen);
  uint8_t* frags[kMaxMembers];
  for (size_t m = 0; m < n; ++m) frags[m] = work.data() + m * flen;
  int tries = 0;
  constexpr int kMaxTries = 256;  // C(6,4) = 15 for ec:4+2; large groups stop here
  for (uint32_t subset = (1u << k) - 1;
       subset != 0 && subset < (n >= 32 ? ~0u : (1u << n)) && tries < kMaxTries;) {
    if ((subset & read_ok) == subset) {
      ++tries;
      std::vector<int> erased;
      for (size_t m = 0; m < n; ++m) {
        if ((subset >> m) & 1) {
          std::memcpy(frags[m], copies.data() + m * flen, flen);
        } else {
          erased.push_back(static_cast<int>(m));
        }
      }
      if (codec_->Decode({frags, n}, erased, flen).ok()) {
        for (int j = 0; j < k; ++j) std::memcpy(trial.data() + j * flen, frags[j], flen);
        if (crypto_->Open(*w.cipher, global, trial.data()).ok()) {
          // Decode rebuilt every erased fragment, parity too: compare what each member gave.
          for (size_t m = 0; m < n; ++m) {
            if (((read_ok >> m) & 1) && std::memcmp(frags[m], copies.data() + m * flen, flen)) {
              *bad |= 1u << m;
            }
          }
          std::memcpy(out, trial.data(), kPage);
          return true;
        }
      }
    }
    // The next k-subset in lexicographic order (Gosper's hack).
    const uint32_t c = subset & -subset;
    const uint32_t rr = subset + c;
    subset = (((rr ^ subset) >> 2) / c) | rr;
  }
  (void)r;
  *bad = read_ok;
  return false;
}

Status PageStore::RecoverPage(Worker& w, Piece& p, uint64_t page) {
  Extent& e = *p.extent;
  const uint64_t global = p.index * (extent_bytes_ / kPage) + page;
  uint8_t* out = p.buf + (page - p.first_page) * kPage;
  for (int attempt = 0; attempt < kRaceAttempts; ++attempt) {
    const uint64_t word = crypto_->Word(global);
    if (PageCrypto::InFlight(word)) {
      // A write of this page is on its way: what was read may be neither version. It ends
      // within the op timeout; read again rather than blame a member.
      std::this_thread::yield();
      continue;
    }
    uint32_t bad = 0;
    const bool found = FindGoodCopy(w, e, p.index, page, out, &bad);
    if (crypto_->Word(global) != word) continue;  // rewritten meanwhile: check the new version
    const std::string where =
        fmt::format("export page {} (offset {}, extent {})", global, global * kPage, p.index);
    if (found && bad == 0) return Status::Ok();  // the first read raced with a write
    CountStat(&PageStoreStats::integrity_failures);
    auto name = [&](uint32_t mask) {
      std::string s;
      for (size_t m = 0; m < e.members.size(); ++m) {
        if ((mask >> m) & 1) {
          s +=
              fmt::format("{}member {} (lease {:#x} on {})", s.empty() ? "" : ", ", m,
                          e.members[m].id(), cluster_->node(e.members[m].node).endpoint.ToString());
        }
      }
      return s;
    };
    bool from_backup = false;
    if (!found && backup_ &&
        backup_->Read(global * kPage, {out, static_cast<size_t>(kPage)}).ok() &&
        crypto_->Open(*w.cipher, global, out).ok()) {
      from_backup = true;
    }
    if (found || from_backup) {
      // The members that gave a bad copy are failed members: re-protection rewrites them from
      // the good ones (or the backup file).
      if (bad != 0) {
        // Stale too: their bytes cannot be trusted, so the reconcile pass must rebuild them and
        // never use them again as they are (it revalidates failed members whose lease is held).
        e.stale.fetch_or(bad, std::memory_order_acq_rel);
        e.failed.fetch_or(bad, std::memory_order_acq_rel);
        NoteDegraded();
        QueueRebuild(p.index);
      }
      if (uint64_t left_out = 0; IntegrityLog().Allow(&left_out)) {
        spdlog::error(
            "page store: {} failed authentication on {}: served from {}; those members are "
            "treated as failed and re-protected{}",
            where, name(bad), from_backup ? "the backup file" : "the other members",
            Suppressed(left_out));
      }
      return Status::Ok();
    }
    std::memset(out, 0, kPage);
    Status err = IoError(fmt::format(
        "{}: no copy passes authentication ({}{}), resilience {}: it was changed on a lender or "
        "in transit; the page reads as an error until it is written again",
        where, bad != 0 ? "bad: " + name(bad) : "no member could be read",
        backup_ ? ", nor the backup file's" : "", options_.resilience.ToString()));
    if (uint64_t left_out = 0; IntegrityLog().Allow(&left_out)) {
      spdlog::error("page store: {}{}", err.message(), Suppressed(left_out));
    } else {
      NoteLostPage(global);  // named by the next flush: a lost page is never left unsaid
    }
    return err;
  }
  return IoError(fmt::format(
      "export page {}: it kept being rewritten while it was read ({} attempts); read it again",
      global, kRaceAttempts));
}

void PageStore::NoteLostPage(uint64_t global_page) {
  MutexLock lock(&lost_pages_mu_);
  // Merge into the range that ends at or contains it, and with the one that starts after it.
  auto next = lost_pages_.upper_bound(global_page);
  if (next != lost_pages_.begin()) {
    auto prev = std::prev(next);
    if (prev->second > global_page) return;  // kept already
    if (prev->second == global_page) {
      prev->second = global_page + 1;
      if (next != lost_pages_.end() && next->first == prev->second) {
        prev->second = next->second;
        lost_pages_.erase(next);
      }
      return;
    }
  }
  uint64_t end = global_page + 1;
  if (next != lost_pages_.end() && next->first == end) {
    end = next->second;
    lost_pages_.erase(next);
  }
  lost_pages_.emplace(global_page, end);
}

void PageStore::FlushLostPages(bool force) {
  std::map<uint64_t, uint64_t> ranges;
  {
    MutexLock lock(&lost_pages_mu_);
    if (lost_pages_.empty()) return;
    const Clock::time_point now = Clock::now();
    if (!force && now - lost_pages_logged_ < kIntegrityLogPeriod) return;
    lost_pages_logged_ = now;
    ranges.swap(lost_pages_);
  }
  const uint64_t per_extent = extent_bytes_ / kPage;
  for (const auto& [begin, end] : ranges) {
    for (uint64_t first = begin; first < end;) {  // one line per extent a range spans
      const uint64_t index = first / per_extent;
      const uint64_t last = std::min(end, (index + 1) * per_extent);
      spdlog::error(
          "page store: {} pages of extent {} (export bytes {}..{}) are LOST until written again: "
          "no copy of them passed authentication when read (resilience {}), while the "
          "per-page lines were rate-limited",
          last - first, index, first * kPage, last * kPage, options_.resilience.ToString());
      first = last;
    }
  }
}

}  // namespace farmem::blockdev
