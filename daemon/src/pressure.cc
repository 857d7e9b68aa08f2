#include "pressure.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "farmem/common/config.h"

namespace farmem::daemon {

Result<Reserve> ParseReserve(std::string_view text) {
  Reserve r;
  r.text = std::string(text);
  if (text.ends_with('%')) {
    std::string_view num = text.substr(0, text.size() - 1);
    double v = 0;
    auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
    if (ec != std::errc() || ptr != num.data() + num.size() || num.empty() || !(v >= 0) ||
        v >= 100) {
      return Err(InvalidArgument(
          fmt::format("--reserve '{}': a percentage must be in [0, 100), e.g. 10%", text)));
    }
    r.fraction = v / 100;
    return r;
  }
  if (text == "0") return r;
  Result<uint64_t> bytes = ParseSize(text);
  if (!bytes) {
    return Err(InvalidArgument(fmt::format(
        "--reserve '{}' is neither a size (2G) nor a percentage of memory (10%)", text)));
  }
  r.bytes = *bytes;
  return r;
}

Status CheckReserveLeavesRoom(const Reserve& reserve, uint64_t limit, uint64_t slab_size,
                              std::string_view source) {
  const uint64_t kept = reserve.Of(limit);
  if (kept < limit && limit - kept >= slab_size) return Status::Ok();
  return InvalidArgument(fmt::format(
      "--reserve {} keeps {} of the {} of memory of {}, which leaves less than one slab ({}) to "
      "lend: this daemon would never lend anything. Give a smaller --reserve, smaller slabs "
      "(--slab-size), or --memory-source off to lend regardless of free memory",
      reserve.text, FormatSize(kept), FormatSize(limit), source, FormatSize(slab_size)));
}

PressureDecision PressurePolicy::Update(const MemorySnapshot& m, uint64_t slab_size,
                                        uint32_t noticed) {
  PressureDecision d;
  const uint64_t reserve = config_.reserve.Of(m.limit);
  const uint64_t hysteresis = std::max(slab_size, reserve / 4);
  const bool deficit = m.available < reserve;
  // The stall share since the previous reading, from PSI totals; avg10 where there are none.
  std::optional<double> stall;
  if (m.psi_full_total_us.has_value()) {
    if (last_psi_total_us_.has_value() && m.taken > last_taken_ &&
        *m.psi_full_total_us >= *last_psi_total_us_) {
      const double us = std::chrono::duration<double, std::micro>(m.taken - last_taken_).count();
      stall = 100.0 * static_cast<double>(*m.psi_full_total_us - *last_psi_total_us_) / us;
    }
    last_psi_total_us_ = m.psi_full_total_us;
    last_taken_ = m.taken;
  } else {
    stall = m.psi_full_avg10;
  }
  const bool psi =
      config_.psi_full_threshold > 0 && stall.has_value() && *stall >= config_.psi_full_threshold;
  const bool hit = last_limit_hits_.has_value() && m.limit_hits > *last_limit_hits_;
  last_limit_hits_ = m.limit_hits;
  const bool pressure = deficit || psi || hit;
  d.why = fmt::format("{} available of {}, reserve {} (--reserve {}){}{}", FormatSize(m.available),
                      FormatSize(m.limit), FormatSize(reserve), config_.reserve.text,
                      psi ? fmt::format(", memory stall (PSI full) {:.1f}%", *stall) : "",
                      hit ? ", memory limit hit" : "");
  const bool was = holding_;
  if (!holding_ && pressure) {
    holding_ = true;
    polls_under_ = 0;
  } else if (holding_ && !pressure && m.available >= reserve + hysteresis) {
    holding_ = false;
  }
  d.holding = holding_;
  d.changed = was != holding_;
  if (!holding_) {
    polls_under_ = 0;
    const uint64_t spare = m.available > reserve ? m.available - reserve : 0;
    d.grant_budget = static_cast<uint32_t>(std::min<uint64_t>(spare / slab_size, UINT32_MAX));
    return d;
  }
  d.grant_budget = 0;
  if (!deficit && !psi) {
    polls_under_ = 0;  // below the hysteresis mark or limit hits only: hold, evict nothing
    return d;
  }
  if (++polls_under_ < config_.confirm_polls) return d;
  uint64_t want = 0;
  if (deficit) {
    want = (reserve - m.available + slab_size - 1) / slab_size;
  } else {
    want = 1;  // a stall without a visible deficit: one slab at a time
  }
  d.evict =
      want > noticed ? static_cast<uint32_t>(std::min<uint64_t>(want - noticed, UINT32_MAX)) : 0;
  return d;
}

std::vector<uint64_t> ChooseVictims(std::vector<LeaseActivity> sample, uint32_t e) {
  std::stable_sort(
      sample.begin(), sample.end(),
      [](const LeaseActivity& a, const LeaseActivity& b) { return a.accesses < b.accesses; });
  std::vector<uint64_t> out;
  for (size_t i = 0; i < sample.size() && i < e; ++i) out.push_back(sample[i].lease_id);
  return out;
}

}  // namespace farmem::daemon
