// Parsing of the values people type into options and config files: sizes ("64M", "1GiB"),
// endpoints ("host:port", "[::1]:7000"), peer lists, choices among fixed words ("info", "tcp"),
// and the config files themselves. Anything not understood is an error that names it, so that a
// typo never quietly turns a setting (say, the secret file) off. Pure functions; any thread.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
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

// `value` if it is one of `accepted`, else InvalidArgument naming the option, the value and every
// accepted word: "--log-level: 'bogus' is not one of trace, debug, info, warn, error" (without
// the "--log-level: " when `option` is empty).
Result<std::string> ParseChoice(std::string_view option, std::string_view value,
                                std::span<const std::string_view> accepted);
Result<std::string> ParseChoice(std::string_view option, std::string_view value,
                                std::initializer_list<std::string_view> accepted);

// The words every farmem program accepts for --log-level and --transport.
inline constexpr std::string_view kLogLevels[] = {"trace", "debug", "info", "warn", "error"};
inline constexpr std::string_view kTransports[] = {"auto", "tcp", "verbs"};

// One `name = value` line of a config file.
struct ConfigEntry {
  std::string key;
  std::string value;
  int line = 0;  // 1-based
  friend bool operator==(const ConfigEntry&, const ConfigEntry&) = default;
};

// A farmem config file: one `name = value` per line, names are option names without the dashes.
// Blank lines and lines starting with '#' or ';' are comments; so is the rest of a line after a
// '#' that follows a blank. A value may be quoted ("..." or '...'), which keeps '#' and blanks.
// Sections ("[farmemd]") are refused: every option is top-level, and a section would otherwise
// hide every key below it. So is a line without '=' and a key given twice. Every error names
// `origin` (the file) and the line number.
Result<std::vector<ConfigEntry>> ParseConfigText(std::string_view text, std::string_view origin);

// Every key must be one of `known`; an unknown key is InvalidArgument naming the key, the line
// and, when a known key is a likely typo of it, that key ("did you mean 'secret-file'?").
Status CheckConfigKeys(std::span<const ConfigEntry> entries, std::span<const std::string> known,
                       std::string_view origin);

}  // namespace farmem
