// What page encryption costs farmem-nbd's request thread per 4 KiB page, apart from the network
// (docs/benchmarks-nbd.md "Encryption on vs off"), next to its baselines from the same run:
//   copy        memcpy of the page (one pass over the data, what a plaintext write needs at most)
//   openssl     the baselines, raw OpenSSL EVP AES-256-GCM with no farmem code: a 4 KiB seal as
//               `openssl speed -evp aes-256-gcm -bytes 4096` times it (new nonce, 12 B of AAD,
//               update, final, tag), and the cipher's pass over the data alone (one 64 KiB
//               message, per 4 KiB): their difference is what a message costs OpenSSL 3 apart
//               from the data (nonce setup, parameter lookups, final, tag)
//   aes-gcm     aead::Cipher::Seal / Open alone (key set once: the cipher itself), by the
//               implementation FARMEM_AEAD_IMPL chooses (auto: intel-ipsec-mb where the CPU has
//               AES-NI); PageCrypto's rows use that one too. Both implementations' seal and open
//               are also timed side by side in the same blocks ("both").
//   write       PageCrypto::Seal + EndWrite(ok) (what PageStore does per page written: the
//               cipher plus the page table and the bookkeeping of writes in flight)
//   read        PageCrypto::Open (per page read: the cipher plus the page table lookup)
// Pages are visited in a random order over a 256 MiB export (its page table is 1.5 MiB, as in
// the nbd_bench runs), one thread, timed by the thread's CPU clock. Run it pinned (taskset -c 0).
// The ciphertext of every page is kept in a 256 MiB array, so that reads open what was written;
// a read copies its page from there first, as it arrives from a member, and that copy (from a
// cold, random place) is measured on its own.
//   cold        the seal, the open and PageCrypto's write and read again, each alone after 2 MiB
//               (twice the L2) or 32 MiB (twice the L3) of other memory was written, with only
//               the page itself in cache: a depth-1 request finds OpenSSL's context, its code and
//               the page table evicted by whatever ran while it waited, from the L2 on a quiet
//               machine, from every cache on a busy one (medians of single calls, less the same
//               timing of nothing)
// Usage: page_crypto_bench [blocks] [pages per block] [cold samples (400)]
#include <fmt/format.h>
#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "farmem/common/cpu_time.h"
#include "page_crypto.h"

namespace {

// The thread's CPU time, not the wall clock: on a shared machine the thread is preempted, and
// what is measured is what the work costs a core.
double CpuNs() { return static_cast<double>(farmem::ThreadCpuNs()); }
constexpr uint64_t kExportPages = 65536;  // 256 MiB
constexpr size_t kPage = 4096;

// The median CPU time of `n` single calls of f(i), each after `trash` was written whole and
// `page` (4 KiB) was written again (as a request's data arrives just before it is sealed).
template <typename F>
double ColdNs(uint64_t n, std::vector<uint8_t>& trash, uint8_t* page, F&& f) {
  std::vector<double> t(n);
  for (uint64_t i = 0; i < n; ++i) {
    std::memset(trash.data(), static_cast<int>(i), trash.size());
    std::memset(page, 0x5a, 4096);
    const double t0 = CpuNs();
    f(i);
    t[i] = CpuNs() - t0;
  }
  std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(n / 2), t.end());
  return t[n / 2];
}

template <typename F>
double NsPer(uint64_t n, F&& f) {
  const double t0 = CpuNs();
  for (uint64_t i = 0; i < n; ++i) f(i);
  return (CpuNs() - t0) / static_cast<double>(n);
}

[[noreturn]] void Die(const farmem::Status& s) {
  fmt::print(stderr, "page_crypto_bench: {}\n", s.ToString());
  std::exit(1);
}

// Raw OpenSSL AES-256-GCM (EVP, keyed once, as aead::Cipher is): the baseline of the cipher
// itself, with no farmem code around it.
class RawGcm {
 public:
  RawGcm() : ctx_(EVP_CIPHER_CTX_new()) {
    const uint8_t key[32] = {7};
    if (ctx_ == nullptr ||
        EVP_EncryptInit_ex(ctx_, EVP_aes_256_gcm(), nullptr, key, nullptr) != 1) {
      fmt::print(stderr, "page_crypto_bench: OpenSSL cannot set up AES-256-GCM\n");
      std::exit(1);
    }
  }
  ~RawGcm() { EVP_CIPHER_CTX_free(ctx_); }
  RawGcm(const RawGcm&) = delete;
  RawGcm& operator=(const RawGcm&) = delete;
  // One message: a new nonce, 12 bytes of AAD, `len` bytes, final and tag. False on error.
  bool Seal(const uint8_t* in, uint8_t* out, size_t len) {
    const uint8_t nonce[12] = {1}, aad[12] = {2};
    uint8_t tag[16];
    OSSL_PARAM get_tag[] = {
        OSSL_PARAM_construct_octet_string(OSSL_CIPHER_PARAM_AEAD_TAG, tag, sizeof(tag)),
        OSSL_PARAM_construct_end()};
    int n = 0, fin = 0;
    return EVP_EncryptInit_ex(ctx_, nullptr, nullptr, nullptr, nonce) == 1 &&
           EVP_EncryptUpdate(ctx_, nullptr, &n, aad, sizeof(aad)) == 1 &&
           EVP_EncryptUpdate(ctx_, out, &n, in, static_cast<int>(len)) == 1 &&
           EVP_EncryptFinal_ex(ctx_, out + n, &fin) == 1 &&
           EVP_CIPHER_CTX_get_params(ctx_, get_tag) == 1;
  }

 private:
  EVP_CIPHER_CTX* ctx_;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace farmem;
  const uint64_t blocks = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 200;
  const uint64_t m = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 2000;
  const uint64_t cold_n = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 400;
  if (blocks == 0 || m == 0 || cold_n == 0) {
    fmt::print(stderr,
               "usage: page_crypto_bench [blocks (200)] [pages per block (2000)] [cold samples "
               "(400)]\n");
    return 2;
  }
  auto key = aead::GenerateKey();
  if (!key) Die(key.error());
  auto crypto = blockdev::PageCrypto::Create(*key, kExportPages);
  if (!crypto) Die(crypto.error());
  auto cipher = (*crypto)->NewCipher();
  if (!cipher) Die(cipher.error());
  fmt::print("{}\n", aead::DescribeChosenImpl());
  // Both implementations, for the side-by-side rows (ipsec-mb only where it can run).
  auto ossl = aead::Cipher::Create(*key, aead::Impl::kOpenSsl);
  if (!ossl) Die(ossl.error());
  auto imb = aead::Cipher::Create(*key, aead::Impl::kIpsecMb);

  std::vector<uint64_t> order(kExportPages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(42));
  // 16 pages in a batch's worth of buffers, as a depth-16 NBD batch has.
  std::vector<uint8_t> plain(16 * kPage, 0x5a), out(16 * kPage);
  // The ciphertext of every page, so that reads open what was written.
  std::vector<uint8_t> stored(kExportPages * kPage);
  for (uint64_t p = 0; p < kExportPages; ++p) {
    if (Status s = (*crypto)->Seal(*cipher, p, plain.data(), stored.data() + p * kPage); !s.ok()) {
      Die(s);
    }
    (*crypto)->EndWrite(p, true);
  }
  const auto nonce = aead::MakeNonce(1, 2);
  const uint8_t aad[12] = {};
  aead::Tag tag{};
  std::vector<uint8_t> sealed(kPage);
  if (Status s = cipher->Seal(nonce, aad, {plain.data(), kPage}, {sealed.data(), kPage}, &tag);
      !s.ok()) {
    Die(s);
  }
  Status st;
  auto keep = [&st](Status s) {
    if (st.ok() && !s.ok()) st = std::move(s);
  };
  // Short blocks of each measurement in turn, many times: the figures are medians over blocks,
  // and the overheads medians of per-block differences (neighbours in time see the same load).
  // Writes go to the first half of the pages in `order`, reads to the second (still as stored).
  constexpr uint64_t kHalf = kExportPages / 2;
  RawGcm raw;
  bool raw_ok = true;
  std::vector<double> raw_seal, raw_bulk, copy, seal, open, write, cold, read, read_posted,
      write_extra, read_extra, posted_extra, seal_ossl, open_ossl, seal_imb, open_imb;
  auto seal_with = [&](aead::Cipher& c) {
    return NsPer(m, [&](uint64_t i) {
      aead::Tag t{};
      keep(c.Seal(nonce, aad, {plain.data() + (i % 16) * kPage, kPage},
                  {out.data() + (i % 16) * kPage, kPage}, &t));
    });
  };
  auto open_with = [&](aead::Cipher& c) {
    return NsPer(m, [&](uint64_t i) {
      uint8_t* page = out.data() + (i % 16) * kPage;
      std::memcpy(page, sealed.data(), kPage);
      keep(c.Open(nonce, aad, {page, kPage}, {page, kPage}, tag));
    });
  };
  uint64_t w = 0, r = 0;
  for (uint64_t b = 0; b < blocks; ++b) {
    raw_seal.push_back(NsPer(m, [&](uint64_t i) {
      raw_ok &= raw.Seal(plain.data() + (i % 16) * kPage, out.data() + (i % 16) * kPage, kPage);
    }));
    // The same pages as one 64 KiB message per 16 of them.
    raw_bulk.push_back(
        NsPer(m / 16, [&](uint64_t) { raw_ok &= raw.Seal(plain.data(), out.data(), 16 * kPage); }) /
        16);
    copy.push_back(NsPer(m, [&](uint64_t i) {
      std::memcpy(out.data() + (i % 16) * kPage, plain.data() + (i % 16) * kPage, kPage);
    }));
    seal.push_back(NsPer(m, [&](uint64_t i) {
      aead::Tag t{};
      keep(cipher->Seal(nonce, aad, {plain.data() + (i % 16) * kPage, kPage},
                        {out.data() + (i % 16) * kPage, kPage}, &t));
    }));
    open.push_back(NsPer(m,
                         [&](uint64_t i) {
                           uint8_t* page = out.data() + (i % 16) * kPage;
                           std::memcpy(page, sealed.data(), kPage);  // as it arrives
                           keep(cipher->Open(nonce, aad, {page, kPage}, {page, kPage}, tag));
                         }) -
                   copy.back());
    write.push_back(NsPer(m, [&](uint64_t i) {
      const uint64_t p = order[w++ % kHalf];
      keep((*crypto)->Seal(*cipher, p, plain.data() + (i % 16) * kPage,
                           out.data() + (i % 16) * kPage));
      (*crypto)->EndWrite(p, true);
    }));
    const uint64_t r0 = r;
    cold.push_back(NsPer(m, [&](uint64_t i) {
      const uint64_t p = order[kHalf + r++ % kHalf];
      std::memcpy(out.data() + (i % 16) * kPage, stored.data() + p * kPage, kPage);
    }));
    r = r0 + m;  // the reads visit other pages than the copies just did (those are cached now)
    read.push_back(NsPer(m, [&](uint64_t i) {
      const uint64_t p = order[kHalf + r++ % kHalf];
      uint8_t* page = out.data() + (i % 16) * kPage;
      std::memcpy(page, stored.data() + p * kPage, kPage);  // as it arrives from a member
      keep((*crypto)->Open(*cipher, p, page));
    }));
    // As the page store reads: each page's table entry prefetched when its read is posted
    // (here 16 pages, a depth-16 batch, before it is opened).
    read_posted.push_back(NsPer(m, [&](uint64_t i) {
      crypto->get()->Prefetch(order[kHalf + (r + 16) % kHalf], 1);
      const uint64_t p = order[kHalf + r++ % kHalf];
      uint8_t* page = out.data() + (i % 16) * kPage;
      std::memcpy(page, stored.data() + p * kPage, kPage);
      keep((*crypto)->Open(*cipher, p, page));
    }));
    posted_extra.push_back(read_posted.back() - cold.back() - open.back());
    seal_ossl.push_back(seal_with(*ossl));
    open_ossl.push_back(open_with(*ossl) - copy.back());
    if (imb) {
      seal_imb.push_back(seal_with(*imb));
      open_imb.push_back(open_with(*imb) - copy.back());
    }
    write_extra.push_back(write.back() - seal.back());
    read_extra.push_back(read.back() - cold.back() - open.back());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // Cold: each call alone after other data went through the caches: 2 MiB (twice the L2: the L3
  // keeps the cipher's code and state, as on a quiet machine between depth-1 requests) and 32 MiB
  // (twice the L3: everything but the page evicted, as when other processes ran meanwhile).
  struct ColdRow {
    uint64_t mib;
    double timing, raw, seal, open, copy, write, read, read_copy;
  };
  std::vector<ColdRow> colds;
  uint8_t* page = out.data();
  uint64_t cr = 0;
  for (uint64_t mib : {2, 32}) {
    std::vector<uint8_t> trash(mib << 20);
    ColdRow c{mib, 0, 0, 0, 0, 0, 0, 0, 0};
    c.timing = ColdNs(cold_n, trash, page, [](uint64_t) {});
    c.raw = ColdNs(cold_n, trash, page, [&](uint64_t) { raw_ok &= raw.Seal(page, page, kPage); });
    c.seal = ColdNs(cold_n, trash, page, [&](uint64_t) {
      aead::Tag t{};
      keep(cipher->Seal(nonce, aad, {page, kPage}, {page, kPage}, &t));
    });
    c.open = ColdNs(cold_n, trash, page, [&](uint64_t) {
      std::memcpy(page, sealed.data(), kPage);
      keep(cipher->Open(nonce, aad, {page, kPage}, {page, kPage}, tag));
    });
    c.copy =
        ColdNs(cold_n, trash, page, [&](uint64_t) { std::memcpy(page, sealed.data(), kPage); });
    c.write = ColdNs(cold_n, trash, page, [&](uint64_t) {
      const uint64_t p = order[w++ % kHalf];
      keep((*crypto)->Seal(*cipher, p, page, page));
      (*crypto)->EndWrite(p, true);
    });
    c.read = ColdNs(cold_n, trash, page, [&](uint64_t) {
      const uint64_t p = order[kHalf + cr++ % kHalf];
      std::memcpy(page, stored.data() + p * kPage, kPage);
      keep((*crypto)->Open(*cipher, p, page));
    });
    c.read_copy = ColdNs(cold_n, trash, page, [&](uint64_t) {
      const uint64_t p = order[kHalf + cr++ % kHalf];
      std::memcpy(page, stored.data() + p * kPage, kPage);
    });
    colds.push_back(c);
  }
  if (!raw_ok) Die(farmem::Internal("raw OpenSSL AES-256-GCM failed"));
  fmt::print(
      "per 4 KiB page, medians over {} blocks of {} pages (CPU ns): copy {:.0f}; baseline: raw "
      "OpenSSL AES-256-GCM seal {:.0f} (its pass over the data alone {:.0f}); aead::Cipher "
      "(aes-gcm) seal {:.0f}, open {:.0f}\n"
      "  PageCrypto write (Seal+EndWrite) {:.0f}: +{:.0f} over the seal\n"
      "  PageCrypto read (its ciphertext copied in from a random place, {:.0f}, + Open) {:.0f}: "
      "+{:.0f} over copy + open; with the entry prefetched when the read is posted {:.0f}: "
      "+{:.0f}\n",
      blocks, m, median(copy), median(raw_seal), median(raw_bulk), median(seal), median(open),
      median(write), median(write_extra), median(cold), median(read), median(read_extra),
      median(read_posted), median(posted_extra));
  if (imb) {
    fmt::print(
        "both, same blocks: openssl seal {:.0f}, open {:.0f}; ipsec-mb seal {:.0f}, open {:.0f}\n",
        median(seal_ossl), median(open_ossl), median(seal_imb), median(open_imb));
  } else {
    fmt::print(
        "both, same blocks: openssl seal {:.0f}, open {:.0f}; ipsec-mb cannot run here: {}\n",
        median(seal_ossl), median(open_ossl), imb.error().ToString());
  }
  for (const ColdRow& c : colds) {
    fmt::print(
        "cold, {} MiB of other data through the caches before each call (medians of {} calls, "
        "less {:.0f} of timing): raw OpenSSL seal {:.0f}; aead::Cipher seal {:.0f}, open {:.0f} "
        "(its copy-in {:.0f} taken off); PageCrypto write {:.0f}, read {:.0f} (its copy-in {:.0f} "
        "taken off)\n",
        c.mib, cold_n, c.timing, c.raw - c.timing, c.seal - c.timing, c.open - c.copy,
        c.copy - c.timing, c.write - c.timing, c.read - c.read_copy, c.read_copy - c.timing);
  }
  if (!st.ok()) Die(st);
  return 0;
}
