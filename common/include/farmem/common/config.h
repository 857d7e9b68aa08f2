// Parsing of the values people type into options and config files: sizes ("64M", "1GiB"),
// endpoints ("host:port", "[::1]:7000") and peer lists. Pure functions; any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/common/status.h"

namespace farmem {

// "4096", "64K", "64KiB", "64M", "1G", "1GiB" (powers of two). Overflow and junk are errors.
Result<uint64_t> ParseSize(std::string_view text);
std::string FormatSize(uint64_t bytes);  // "64 MiB"

struct Endpoint {
  std::string host;
  uint16_t port = 0;
  std::string ToString() const;  // "host:port", IPv6 in brackets
  friend bool operator==(const Endpoint&, const Endpoint&) = default;
};

// "host:port" or "[v6addr]:port"; with default_port, a bare "host" is accepted too.
Result<Endpoint> ParseEndpoint(std::string_view text, uint16_t default_port = 0);
// Comma-separated endpoints; empty items are skipped.
Result<std::vector<Endpoint>> ParseEndpointList(std::string_view text, uint16_t default_port = 0);

inline constexpr uint16_t kDefaultPort = 7411;

}  // namespace farmem
