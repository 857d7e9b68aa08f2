// Reading what farmem-nbd and far_ptr programs log during a chaos scenario: when a daemon was
// declared down (time to detect), when what it held was re-protected (time to re-protect), and
// which export ranges were reported LOST.
//
// Every line farmem logs through spdlog starts with a wall-clock timestamp
// "YYYY-mm-dd HH:MM:SS.mmm" (in brackets in spdlog's default format); the chaos driver records the
// wall-clock time of each fault and compares. What the programs say is matched by the patterns in
// chaos_log.cc (kDownPatterns, kReprotectPatterns, kWholePattern) and, for LOST ranges, by
// support/lost_ranges.h: when a log line changes, adapt it there, in one place.
//
// Used by the driver's main thread only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace farmem::chaos {

// Milliseconds since the Unix epoch, wall clock (what log timestamps are in).
int64_t WallMs();

struct LogLine {
  int64_t ms = 0;  // parsed timestamp; lines without one are skipped
  std::string text;
};
std::vector<LogLine> ReadLog(const std::string& path);

// A daemon at `endpoint` ("127.0.0.1:port") was declared down (or found restarted) at `ms`, and
// this client lost `leases` leases there: that many members must be re-protected.
struct DownEvent {
  int64_t ms = 0;
  std::string endpoint;
  uint64_t leases = 0;
};
std::vector<DownEvent> DownEvents(const std::vector<LogLine>& log);

// The client (re)connected to the daemon at `endpoint` at `ms` ("node N (endpoint) is up").
struct UpEvent {
  int64_t ms = 0;
  std::string endpoint;
};
std::vector<UpEvent> UpEvents(const std::vector<LogLine>& log);

// far_ptr names each span-set member that failed, with its daemon; a daemon's leases may include
// some no member uses. Returns how many distinct (group, member) pairs on `endpoint` failed in
// [from, until).
uint64_t FailedMembers(const std::vector<LogLine>& log, const std::string& endpoint, int64_t from,
                       int64_t until);

// Times of the lines that say one member (a lease's worth of data) was re-protected.
std::vector<int64_t> ReprotectTimes(const std::vector<LogLine>& log);

// The page store said every extent (the span-set store: every slab group) is whole again at `ms`:
// the degraded episode that began `degraded_ms` before ended, `extents` extents (span sets) were
// re-protected in the last `reprotect_ms`; the other members were used again as they were.
struct WholeEvent {
  int64_t ms = 0;
  uint64_t extents = 0;
  uint64_t reprotect_ms = 0;
  uint64_t degraded_ms = 0;
};
std::vector<WholeEvent> WholeEvents(const std::vector<LogLine>& log);

// Times of the lines that say a page or far object read back failed authentication (its AES-GCM
// tag), whether it was then served from the other members or lost.
std::vector<int64_t> IntegrityTimes(const std::vector<LogLine>& log);

// Export byte ranges [begin, end) farmem-nbd reported LOST (support/lost_ranges.h): extents whose
// members are gone, and single pages of which no copy passes authentication (`none`: one flipped
// bit loses the page); with the time of the line.
struct LostRange {
  int64_t ms = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
};
std::vector<LostRange> LostRanges(const std::vector<LogLine>& log);

// Lines that matter for a failure report (down/up/rebuilt/degraded/LOST/errors), at most `max`.
std::vector<std::string> NotableLines(const std::vector<LogLine>& log, size_t max);

}  // namespace farmem::chaos
