#include "farmem/client/resilience.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

namespace farmem::client {

namespace {
bool ParseInt(std::string_view s, int* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}
}  // namespace

Result<Resilience> Resilience::Parse(std::string_view text, int max_group_size) {
  Resilience res;
  if (text == "none") {
    res.mode = Mode::kNone;
    res.k = 1;
    res.r = 0;
    return res;
  }
  if (text.starts_with("replicate:")) {
    int copies = 0;
    if (!ParseInt(text.substr(10), &copies) || copies < 1 || copies > kMaxCopies) {
      return Err(
          InvalidArgument(fmt::format("'{}': replicate:N needs N from 1 to {}", text, kMaxCopies)));
    }
    res.mode = Mode::kReplicate;
    res.k = 1;
    res.r = copies - 1;
    return res;
  }
  if (text.starts_with("ec:")) {
    const std::string_view rest = text.substr(3);
    const size_t plus = rest.find('+');
    if (plus == std::string_view::npos || !ParseInt(rest.substr(0, plus), &res.k) ||
        !ParseInt(rest.substr(plus + 1), &res.r)) {
      return Err(InvalidArgument(fmt::format("'{}': write ec:k+r, e.g. ec:4+2", text)));
    }
    if (res.k < 1 || res.r < 0 || res.k + res.r > std::min(max_group_size, kMaxGroupSize)) {
      return Err(InvalidArgument(fmt::format("'{}': ec:k+r needs k >= 1, r >= 0 and k + r <= {}",
                                             text, std::min(max_group_size, kMaxGroupSize))));
    }
    res.mode = Mode::kErasure;
    return res;
  }
  return Err(InvalidArgument(
      fmt::format("unknown resilience '{}': use none, replicate:N or ec:k+r", text)));
}

std::string Resilience::ToString() const {
  switch (mode) {
    case Mode::kNone:
      return "none";
    case Mode::kReplicate:
      return fmt::format("replicate:{}", k + r);
    case Mode::kErasure:
      return fmt::format("ec:{}+{}", k, r);
  }
  return "?";
}

}  // namespace farmem::client
