#include "chaos_log.h"

#include <chrono>
#include <ctime>
#include <fstream>
#include <regex>
#include <set>

#include "support/lost_ranges.h"

namespace farmem::chaos {

namespace {

// "farmem client: node 2 (127.0.0.1:4711) is down (...); leases unreachable, kept in case it
// answers again within its lease TTL (10000 ms): [0x1, 0x2 and 7 more]" (client/src/
// cluster_monitor.cc, MarkDown; "leases lost: [...]" when they cannot come back), and the restart
// case found before the failure was:
// "farmem client: the daemon at 127.0.0.1:4711 restarted (...); leases lost: [...]" (Adopt).
const std::regex kDownPatterns[] = {
    std::regex(
        R"(farmem client: node \d+ \(([^)]+)\) is down .*leases (?:lost|unreachable, kept[^:]*): \[(.*)\])"),
    std::regex(R"(farmem client: the daemon at (\S+) restarted .*leases lost: \[(.*)\])"),
};

// "farmem client: node 2 (127.0.0.1:4711) is up" (client/src/cluster_monitor.cc, MarkUp).
const std::regex kUpPattern(R"(farmem client: node \d+ \(([^)]+)\) is up)");

// One line per member re-protected: the page store's rebuild (blockdev/src/page_store_rebuild.cc,
// RebuildExtent: "page store: extent 3 member 1 rebuilt on 127.0.0.1:4711 (1 MiB)"), far_ptr's
// re-protection (spanstore/src/remote_store_recovery.cc: "far memory: slab group 6 member 1
// re-protected on 127.0.0.1:4711 (12 span sets rebuilt in 3 ms; 5012 ms after it went missing)"),
// or a far_ptr / stripe member whose daemon answered again with the lease before it was rebuilt
// (spanstore/src/remote_store.cc, RevalidateLocked: "far memory: slab group 6 member 1
// (127.0.0.1:4711) is in use again: ..."): whole again either way.
const std::regex kReprotectPatterns[] = {
    std::regex(R"(page store: extent \d+ member \d+ rebuilt on)"),
    std::regex(R"(far memory: slab group \d+ member \d+ re-protected on)"),
    std::regex(R"(far memory: slab group \d+ member \d+ \([^)]*\) is in use again)"),
};

// The end of a degraded episode. The page store's (page_store_rebuild.cc, Reprotect): "page store:
// every extent is whole again: 8 extents re-protected, 16 MiB written to new members in 412 ms
// (degraded for 5230 ms); 3 members in use again as they were". Every fault before it is
// re-protected.
const std::regex kWholePatterns[] = {
    std::regex(
        R"(page store: every extent is whole again: (\d+) extents re-protected, .* in (\d+) ms \(degraded for (\d+) ms\))"),
    // The span-set store's (the stripe layout's, far_ptr's; spanstore/src/remote_store.cc,
    // EndEpisodeIfWholeLocked): "far memory: every slab group is whole again: 12 span sets
    // re-protected, 48 KiB written to new members in 30 ms (degraded for 2100 ms); 99 members in
    // use again as they were". Members used again (a false down) need no rebuild line: this line
    // is the only sign they are whole.
    std::regex(
        R"(far memory: every slab group is whole again: (\d+) span sets re-protected, .* in (\d+) ms \(degraded for (\d+) ms\))"),
};

// "far memory: slab group 6 member 1 (127.0.0.1:45751, lease 1412680156006318084) failed: ..."
// (spanstore/src/remote_store.cc).
const std::regex kFailedMemberPattern(
    R"(far memory: slab group (\d+) member (\d+) \(([^,]+), lease \d+\) failed)");

// A page or object whose tag failed (blockdev/src/page_store_integrity.cc, RecoverPage; farptr/
// src/object_swap_in.cc, OpenSealedLocked): "page store: export page 9 (offset 36864, extent 0)
// failed authentication on member 1 (...): served from the other members; ...", "page store:
// export page 9 (offset 36864, extent 0): no copy passes authentication (...)", "far memory:
// span ...: 1 of its objects failed authentication (AES-GCM tag) ...", and a cell far_ptr's
// compaction found corrupted before moving it (farptr/src/compactor.cc, ReportCorruptCell): "far
// memory: span ... in span set member 0 failed its checksum (CRC-32C) when ...".
const std::regex kIntegrityPatterns[] = {
    std::regex(
        R"(page store: export page \d+ \(offset \d+, extent \d+\):? (failed|no copy passes) authentication)"),
    std::regex(R"(far memory: .*failed (authentication|its checksum))"),
    // The stripe layout (blockdev/src/stripe_store.cc, RecoverCell): "stripe store: export page
    // 9 failed authentication on its daemon ...", "... (bytes A..B) failed authentication and no
    // other member ...".
    std::regex(R"(stripe store: export page \d+ (\(bytes \d+\.\.\d+\) )?failed authentication)"),
};

const std::regex kNotable(
    R"(is down|is up|restarted|rebuilt|re-?protect|whole again|degraded|LOST|lost members|authentication|\[error\]|\[warning\]|\] error: |\] warning: )");

// In local time: "2026-12-01 12:13:53.123 farmem-nbd[42] info: ..." (farmemd, farmem-nbd,
// farmemctl: cli::SetUpLogging, common/src/command_line.cc) or spdlog's default
// "[2026-12-01 12:13:53.123] [farptr-workload] [info] ..." (the far_ptr workload).
std::optional<int64_t> ParseTimestamp(const std::string& line) {
  const bool bracketed = !line.empty() && line[0] == '[';
  const size_t end = bracketed ? 24 : 23;  // where the timestamp ends: ']' or ' '
  if (line.size() <= end || line[end] != (bracketed ? ']' : ' ')) return std::nullopt;
  std::tm tm{};
  int ms = 0;
  if (std::sscanf(line.c_str() + (bracketed ? 1 : 0), "%d-%d-%d %d:%d:%d.%d", &tm.tm_year,
                  &tm.tm_mon, &tm.tm_mday, &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &ms) != 7) {
    return std::nullopt;
  }
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  tm.tm_isdst = -1;
  const std::time_t t = std::mktime(&tm);
  if (t == static_cast<std::time_t>(-1)) return std::nullopt;
  return static_cast<int64_t>(t) * 1000 + ms;
}

uint64_t CountLeaseIds(const std::string& list) {
  uint64_t n = 0;
  for (size_t p = list.find("0x"); p != std::string::npos; p = list.find("0x", p + 2)) ++n;
  std::smatch m;
  static const std::regex more(R"(and (\d+) more)");
  if (std::regex_search(list, m, more)) n += std::stoull(m[1].str());
  return n;
}

}  // namespace

int64_t WallMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::vector<LogLine> ReadLog(const std::string& path) {
  std::vector<LogLine> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (auto ms = ParseTimestamp(line)) out.push_back(LogLine{*ms, line});
  }
  return out;
}

std::vector<DownEvent> DownEvents(const std::vector<LogLine>& log) {
  std::vector<DownEvent> out;
  for (const LogLine& l : log) {
    for (const std::regex& re : kDownPatterns) {
      std::smatch m;
      if (std::regex_search(l.text, m, re)) {
        out.push_back(DownEvent{l.ms, m[1].str(), CountLeaseIds(m[2].str())});
        break;
      }
    }
  }
  return out;
}

std::vector<UpEvent> UpEvents(const std::vector<LogLine>& log) {
  std::vector<UpEvent> out;
  for (const LogLine& l : log) {
    std::smatch m;
    if (std::regex_search(l.text, m, kUpPattern)) out.push_back(UpEvent{l.ms, m[1].str()});
  }
  return out;
}

uint64_t FailedMembers(const std::vector<LogLine>& log, const std::string& endpoint, int64_t from,
                       int64_t until) {
  std::set<std::pair<std::string, std::string>> members;
  for (const LogLine& l : log) {
    if (l.ms < from || l.ms >= until) continue;
    std::smatch m;
    if (std::regex_search(l.text, m, kFailedMemberPattern) && m[3].str() == endpoint) {
      members.emplace(m[1].str(), m[2].str());
    }
  }
  return members.size();
}

std::vector<int64_t> ReprotectTimes(const std::vector<LogLine>& log) {
  std::vector<int64_t> out;
  for (const LogLine& l : log) {
    for (const std::regex& re : kReprotectPatterns) {
      if (std::regex_search(l.text, re)) {
        out.push_back(l.ms);
        break;
      }
    }
  }
  return out;
}

std::vector<WholeEvent> WholeEvents(const std::vector<LogLine>& log) {
  std::vector<WholeEvent> out;
  for (const LogLine& l : log) {
    for (const std::regex& re : kWholePatterns) {
      std::smatch m;
      if (std::regex_search(l.text, m, re)) {
        out.push_back(WholeEvent{l.ms, std::stoull(m[1].str()), std::stoull(m[2].str()),
                                 std::stoull(m[3].str())});
        break;
      }
    }
  }
  return out;
}

std::vector<int64_t> IntegrityTimes(const std::vector<LogLine>& log) {
  std::vector<int64_t> out;
  for (const LogLine& l : log) {
    for (const std::regex& re : kIntegrityPatterns) {
      if (std::regex_search(l.text, re)) {
        out.push_back(l.ms);
        break;
      }
    }
  }
  return out;
}

std::vector<LostRange> LostRanges(const std::vector<LogLine>& log) {
  std::vector<LostRange> out;
  for (const LogLine& l : log) {
    for (const testing::LostRange& r : testing::LostRanges(l.text)) {
      out.push_back(LostRange{l.ms, r.begin, r.end});
    }
  }
  return out;
}

std::vector<std::string> NotableLines(const std::vector<LogLine>& log, size_t max) {
  std::vector<std::string> out;
  for (const LogLine& l : log) {
    if (std::regex_search(l.text, kNotable)) out.push_back(l.text);
  }
  if (out.size() > max) {
    const size_t skipped = out.size() - max;
    out.erase(out.begin() + static_cast<long>(max / 2),
              out.begin() + static_cast<long>(max / 2 + skipped));
    out.insert(out.begin() + static_cast<long>(max / 2),
               "... (" + std::to_string(skipped) + " lines left out)");
  }
  return out;
}

}  // namespace farmem::chaos
