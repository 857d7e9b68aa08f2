#include "farmem/common/config.h"

#include <fmt/format.h>

#include <charconv>

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

}  // namespace farmem
