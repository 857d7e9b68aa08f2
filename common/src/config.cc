#include "farmem/common/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <map>

namespace farmem {

Result<uint64_t> ParseSize(std::string_view text) {
  std::string_view s = text;
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  uint64_t value = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr == s.data()) {
    return Err(InvalidArgument(fmt::format("'{}' is not a size (try 4096, 64M, 1G)", text)));
  }
  std::string_view unit(ptr, s.data() + s.size() - ptr);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  int shift = 0;
  if (unit.empty() || unit == "B" || unit == "b") {
    shift = 0;
  } else {
    const char u = static_cast<char>(std::toupper(static_cast<unsigned char>(unit.front())));
    std::string_view rest = unit.substr(1);
    if (!(rest.empty() || rest == "B" || rest == "iB" || rest == "ib" || rest == "b")) {
      return Err(InvalidArgument(fmt::format("'{}': unknown size unit '{}'", text, unit)));
    }
    switch (u) {
      case 'K':
        shift = 10;
        break;
      case 'M':
        shift = 20;
        break;
      case 'G':
        shift = 30;
        break;
      case 'T':
        shift = 40;
        break;
      default:
        return Err(InvalidArgument(fmt::format("'{}': unknown size unit '{}'", text, unit)));
    }
  }
  if (shift > 0 && value > (UINT64_MAX >> shift)) {
    return Err(InvalidArgument(fmt::format("size '{}' overflows 64 bits", text)));
  }
  return value << shift;
}

std::string FormatSize(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  double v = static_cast<double>(bytes);
  while (v >= 1024 && i < 4) {
    v /= 1024;
    ++i;
  }
  if (i == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.{}f} {}", v, (v == static_cast<uint64_t>(v)) ? 0 : 1, kUnits[i]);
}

std::string Endpoint::ToString() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

Result<Endpoint> ParseEndpoint(std::string_view text, uint16_t default_port) {
  Endpoint ep;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string_view::npos) {
      return Err(InvalidArgument(fmt::format("'{}': missing ']' after IPv6 address", text)));
    }
    ep.host = std::string(text.substr(1, close - 1));
    std::string_view rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':')
        return Err(InvalidArgument(fmt::format("'{}': expected ':port'", text)));
      port_text = rest.substr(1);
    }
  } else {
    const size_t colon = text.rfind(':');
    if (colon != std::string_view::npos && text.find(':') != colon) {
      return Err(
          InvalidArgument(fmt::format("'{}': put IPv6 addresses in brackets: [addr]:port", text)));
    }
    if (colon == std::string_view::npos) {
      ep.host = std::string(text);
    } else {
      ep.host = std::string(text.substr(0, colon));
      port_text = text.substr(colon + 1);
    }
  }
  if (ep.host.empty()) return Err(InvalidArgument(fmt::format("'{}': missing host", text)));
  if (port_text.empty()) {
    if (default_port == 0) {
      return Err(InvalidArgument(fmt::format("'{}': missing port (host:port)", text)));
    }
    ep.port = default_port;
    return ep;
  }
  unsigned port = 0;
  auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || ptr != port_text.data() + port_text.size() || port > 65535) {
    return Err(InvalidArgument(fmt::format("'{}': port must be 0 to 65535", text)));
  }
  ep.port = static_cast<uint16_t>(port);
  return ep;
}

Result<std::vector<Endpoint>> ParseEndpointList(std::string_view text, uint16_t default_port) {
  std::vector<Endpoint> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = text.substr(start, comma - start);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (!item.empty()) {
      FARMEM_ASSIGN_OR_RETURN(Endpoint ep, ParseEndpoint(item, default_port));
      out.push_back(std::move(ep));
    }
    start = comma + 1;
  }
  return out;
}

Result<std::string> ParseChoice(std::string_view option, std::string_view value,
                                std::span<const std::string_view> accepted) {
  for (std::string_view a : accepted) {
    if (value == a) return std::string(value);
  }
  return Err(
      InvalidArgument(fmt::format("{}{}'{}' is not one of {}", option, option.empty() ? "" : ": ",
                                  value, fmt::join(accepted, ", "))));
}

Result<std::string> ParseChoice(std::string_view option, std::string_view value,
                                std::initializer_list<std::string_view> accepted) {
  return ParseChoice(option, value, std::span<const std::string_view>(accepted));
}

namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// Edit distance (insertions, deletions, substitutions, adjacent swaps): how far a typo is.
size_t TypoDistance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

}  // namespace

Result<std::vector<ConfigEntry>> ParseConfigText(std::string_view text, std::string_view origin) {
  std::vector<ConfigEntry> out;
  std::map<std::string, int, std::less<>> seen;  // key -> line
  int line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = Trim(text.substr(pos, end - pos));
    pos = end + 1;
    ++line_no;
    if (line.empty() || line.front() == '#' || line.front() == ';') continue;
    auto error = [&](std::string_view what) {
      return Err(InvalidArgument(fmt::format("{} line {}: {}", origin, line_no, what)));
    };
    if (line.front() == '[') {
      return error(
          fmt::format("sections like '{}' are not supported: write every option at the top level, "
                      "`name = value`, without a section header",
                      line));
    }
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) {
      return error(fmt::format("'{}' is not `name = value`", line));
    }
    ConfigEntry entry;
    entry.line = line_no;
    entry.key = std::string(Trim(line.substr(0, eq)));
    if (entry.key.empty()) return error(fmt::format("'{}' has no name before '='", line));
    if (entry.key.starts_with("-")) {
      const size_t first = entry.key.find_first_not_of('-');
      return error(fmt::format("write the option name without dashes: '{} = ...'",
                               first == std::string::npos ? "" : entry.key.substr(first)));
    }
    std::string_view value = Trim(line.substr(eq + 1));
    if (!value.empty() && (value.front() == '"' || value.front() == '\'')) {
      const char quote = value.front();
      const size_t close = value.find(quote, 1);
      if (close == std::string_view::npos) {
        return error(fmt::format("the value of '{}' has no closing {}", entry.key, quote));
      }
      const std::string_view rest = Trim(value.substr(close + 1));
      if (!rest.empty() && rest.front() != '#') {
        return error(
            fmt::format("unexpected '{}' after the quoted value of '{}'", rest, entry.key));
      }
      value = value.substr(1, close - 1);
    } else {
      // A comment starts at a '#' that follows a blank; a '#' inside a word stays.
      for (size_t i = 1; i < value.size(); ++i) {
        if (value[i] == '#' && (value[i - 1] == ' ' || value[i - 1] == '\t')) {
          value = Trim(value.substr(0, i));
          break;
        }
      }
    }
    entry.value = std::string(value);
    if (auto [it, inserted] = seen.emplace(entry.key, line_no); !inserted) {
      return error(fmt::format("'{}' is set again (first on line {}): give each option once",
                               entry.key, it->second));
    }
    out.push_back(std::move(entry));
  }
  return out;
}

Status CheckConfigKeys(std::span<const ConfigEntry> entries, std::span<const std::string> known,
                       std::string_view origin) {
  for (const ConfigEntry& e : entries) {
    if (std::find(known.begin(), known.end(), e.key) != known.end()) continue;
    std::string best;
    size_t best_distance = SIZE_MAX;
    std::string normalized = e.key;
    std::replace(normalized.begin(), normalized.end(), '_', '-');
    for (const std::string& k : known) {
      const size_t d = TypoDistance(normalized, k);
      if (d < best_distance) {
        best_distance = d;
        best = k;
      }
    }
    const std::string hint = best_distance <= std::max<size_t>(2, e.key.size() / 4)
                                 ? fmt::format(" (did you mean '{}'?)", best)
                                 : fmt::format(" (known: {})", fmt::join(known, ", "));
    return InvalidArgument(
        fmt::format("{} line {}: unknown option '{}'{}", origin, e.line, e.key, hint));
  }
  return Status::Ok();
}

}  // namespace farmem
