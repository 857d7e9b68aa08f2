// The export ranges farmem-nbd reported LOST, read from its log: the one parser of that line,
//   "page store: N pages of extent E (export bytes A..B) are LOST: ..."
// (blockdev/src/page_store_rebuild.cc). When the line changes, adapt the pattern here. Used by
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
  std::vector<LostRange> out;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), kLost); it != std::sregex_iterator();
       ++it) {
    out.push_back({std::stoull((*it)[1].str()), std::stoull((*it)[2].str())});
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
