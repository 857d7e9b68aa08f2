// The export ranges farmem-nbd reported LOST, read from its log: the one parser of those lines,
//   "page store: N pages of extent E (export bytes A..B) are LOST: ..."
// (blockdev/src/page_store_rebuild.cc), and a single page of which no copy passes authentication
// (`none`: one flipped bit on the lender loses that page),
//   "page store: export page P (offset O, extent E): no copy passes authentication ..."
// (blockdev/src/page_store_integrity.cc); and the stripe layout's (blockdev/src/stripe_store.cc)
//   "stripe store: N pages of slab group G are LOST (export bytes A..B, C..D, ...)" and
//   "stripe store: export page P (bytes A..B) failed authentication and no other member ...".
// When a line changes, adapt its pattern here. Used by
// the integration tests and the chaos driver (which adds each line's timestamp).
#pragma once

#include <cstdint>
#include <regex>
#include <string>
#include <vector>

namespace farmem::testing {

// Export bytes [begin, end) reported LOST.
struct LostRange {
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Every range reported LOST in `log` (any number of lines), in the order they were logged.
inline std::vector<LostRange> LostRanges(const std::string& log) {
  static const std::regex kLost(
      R"(page store: \d+ pages of extent \d+ \(export bytes (\d+)\.\.(\d+)\) are LOST)");
  static const std::regex kUnauthenticPage(
      R"(page store: export page \d+ \(offset (\d+), extent \d+\): no copy passes authentication)");
  static const std::regex kStripeLost(
      R"(stripe store: \d+ pages of slab group \d+ are LOST \(export bytes ([0-9., ]+)\))");
  static const std::regex kStripeUnauthenticPage(
      R"(stripe store: export page \d+ \(bytes (\d+)\.\.(\d+)\) failed authentication and no)");
  static const std::regex kRange(R"((\d+)\.\.(\d+))");
  constexpr uint64_t kPage = 4096;  // an export page
  std::vector<LostRange> out;
  size_t begin = 0;
  while (begin < log.size()) {
    size_t end = log.find('\n', begin);
    if (end == std::string::npos) end = log.size();
    const std::string line = log.substr(begin, end - begin);
    begin = end + 1;
    std::smatch m;
    if (std::regex_search(line, m, kLost)) {
      out.push_back({std::stoull(m[1].str()), std::stoull(m[2].str())});
    } else if (std::regex_search(line, m, kUnauthenticPage)) {
      const uint64_t at = std::stoull(m[1].str());
      out.push_back({at, at + kPage});
    } else if (std::regex_search(line, m, kStripeUnauthenticPage)) {
      out.push_back({std::stoull(m[1].str()), std::stoull(m[2].str())});
    } else if (std::regex_search(line, m, kStripeLost)) {
      const std::string list = m[1].str();
      for (std::sregex_iterator it(list.begin(), list.end(), kRange), e; it != e; ++it) {
        out.push_back({std::stoull((*it)[1].str()), std::stoull((*it)[2].str())});
      }
    }
  }
  return out;
}

// Whether export byte `offset` lies in one of `ranges`.
inline bool InLostRange(const std::vector<LostRange>& ranges, uint64_t offset) {
  for (const LostRange& r : ranges) {
    if (offset >= r.begin && offset < r.end) return true;
  }
  return false;
}

}  // namespace farmem::testing
