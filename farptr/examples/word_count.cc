// A worked example of porting a program to far memory (docs/farptr.md walks through it).
//
// The program keeps a corpus of documents, counts words across them and answers queries. The
// in-memory version would be
//
//   std::vector<std::string> docs;                       // the corpus
//   std::vector<uint32_t> doc_words;                     // words per document
//   std::unordered_map<uint64_t, uint64_t> counts;       // word hash -> occurrences
//
// The far-memory version keeps the same structure with far types: documents are far_bytes (one
// far object each, any size up to a span), the per-document array is a far_vector, the counts a
// far_hash_map. Only small handles stay local; the data lives on farmemd daemons when cold.
//
//   farptr_example --peers 10.0.0.1:7411,10.0.0.2:7411,... [--secret-file F] [--budget 16M]
//                  [--resilience ec:4+2] [--docs 20000]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/common/auth.h"
#include "farmem/common/config.h"
#include "farmem/far_hash_map.h"
#include "farmem/far_ptr.h"
#include "farmem/far_vector.h"
#include "farmem/runtime.h"

namespace {

uint64_t HashWord(std::string_view w) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (char c : w) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

// A synthetic document: Zipf-ish words from a small vocabulary.
std::string MakeDocument(std::mt19937_64& rng) {
  static const char* kWords[] = {"far",   "memory", "span", "set",   "parity", "daemon",
                                 "scope", "deref",  "cold", "hot",   "evict",  "remote",
                                 "local", "budget", "slab", "lease", "object", "pointer"};
  const size_t n = 50 + rng() % 400;
  std::string doc;
  for (size_t i = 0; i < n; ++i) {
    const size_t r = rng() % 100;
    const size_t w = r < 50 ? r % 4 : r % (sizeof(kWords) / sizeof(kWords[0]));
    doc += kWords[w];
    doc += ' ';
  }
  return doc;
}

}  // namespace

int main(int argc, char** argv) {
  farmem::RuntimeOptions opts;
  opts.local_budget = 16u << 20;
  size_t ndocs = 20000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--peers") {
      auto peers = farmem::ParseEndpointList(v, farmem::kDefaultPort);
      if (!peers) {
        std::fprintf(stderr, "--peers: %s\n", peers.error().ToString().c_str());
        return 2;
      }
      opts.peers = *peers;
    } else if (k == "--secret-file") {
      auto secret = farmem::auth::LoadSecretFile(v);
      if (!secret) {
        std::fprintf(stderr, "--secret-file: %s\n", secret.error().ToString().c_str());
        return 2;
      }
      opts.secret = *secret;
    } else if (k == "--budget") {
      auto b = farmem::ParseSize(v);
      if (!b) {
        std::fprintf(stderr, "--budget: %s\n", b.error().ToString().c_str());
        return 2;
      }
      opts.local_budget = *b;
    } else if (k == "--resilience") {
      opts.resilience = v;
    } else if (k == "--docs") {
      ndocs = std::stoul(v);
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (opts.peers.empty()) {
    std::fprintf(stderr,
                 "usage: farptr_example --peers host:port,... [--secret-file F] "
                 "[--budget 16M] [--resilience ec:4+2] [--docs N]\n");
    return 2;
  }

  // 1. One Runtime per program: it connects to the daemons and owns the local budget.
  auto rt = farmem::Runtime::Create(opts);
  if (!rt) {
    std::fprintf(stderr, "farmem: %s\n", rt.error().ToString().c_str());
    return 1;
  }

  // 2. Data structures: far types instead of std ones.
  std::vector<farmem::far_bytes> docs;  // the handles are local (8 bytes each)
  farmem::far_vector<uint32_t> doc_words(**rt);
  farmem::far_hash_map<uint64_t, uint64_t> counts(**rt);

  std::mt19937_64 rng(42);
  for (size_t d = 0; d < ndocs; ++d) {
    const std::string text = MakeDocument(rng);
    farmem::far_bytes doc = farmem::make_far_bytes_in(**rt, text.size());
    {
      // 3. Every access happens inside a DerefScope; what it returns is valid until the scope
      //    ends, so copy in and out inside it.
      farmem::DerefScope scope;
      std::memcpy(doc.deref_mut(scope).data(), text.data(), text.size());
    }
    docs.push_back(std::move(doc));
  }

  // 4. A pass over the corpus: one scope per document keeps what is pinned small.
  uint64_t total = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    std::vector<uint64_t> words;
    {
      farmem::DerefScope scope;
      auto bytes = docs[d].deref(scope);
      std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      size_t start = 0;
      for (size_t i = 0; i <= text.size(); ++i) {
        if (i == text.size() || text[i] == ' ') {
          if (i > start) words.push_back(HashWord(text.substr(start, i - start)));
          start = i + 1;
        }
      }
    }
    // Containers take their own scopes (and locks): call them outside the document's scope.
    doc_words.push_back(static_cast<uint32_t>(words.size()));
    for (uint64_t w : words) counts[w] += 1;  // one atomic read-modify-write in the bucket
    total += words.size();
  }

  // 5. The containers work with the standard algorithms (each element read by copy under a
  //    scope of its own): the longest document, and the words counted twice over.
  const auto longest = std::max_element(doc_words.begin(), doc_words.end());
  const uint64_t counted =
      std::accumulate(counts.begin(), counts.end(), uint64_t{0},
                      [](uint64_t sum, const auto& word_count) { return sum + word_count.second; });
  if (counted != total ||
      std::accumulate(doc_words.begin(), doc_words.end(), uint64_t{0}) != total) {
    std::fprintf(stderr, "farmem: the far containers disagree with the scan\n");
    return 1;
  }

  const farmem::RuntimeStats st = (*rt)->stats();
  std::printf(
      "%zu documents, %lu words, %zu distinct; 'far' occurs %lu times; the longest document "
      "(#%zu) has %u words\n",
      docs.size(), static_cast<unsigned long>(total), counts.size(),
      static_cast<unsigned long>(counts.find(HashWord("far")).value_or(0)),
      static_cast<size_t>(longest - doc_words.begin()),
      doc_words.empty() ? 0u : static_cast<uint32_t>(*longest));
  std::printf(
      "local %.1f MiB of %.1f MiB budget, %.1f MiB of objects; %lu spans swapped out, "
      "%lu swapped in; %lu span sets (%s) on the daemons\n",
      st.local_bytes / 1048576.0, st.local_budget / 1048576.0, st.object_bytes / 1048576.0,
      static_cast<unsigned long>(st.spans_evicted), static_cast<unsigned long>(st.swap_ins),
      static_cast<unsigned long>(st.span_sets), (*rt)->resilience().ToString().c_str());
  // 6. Far objects go before the runtime that holds them.
  docs.clear();
  return 0;
}
