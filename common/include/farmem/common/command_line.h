// Command-line and config-file handling shared by farmemd, farmem-nbd and farmemctl, on top of
// CLI11: everything a user types is checked, so that a typo fails at start with a message naming
// it instead of quietly turning a setting off (an ignored `secert-file` line used to start an
// open daemon).
//
//   CLI::App app{...};
//   cli::AddConfigFileOption(app, "Read options from this file");  // strict --config
//   app.add_option("--log-level", level)->check(cli::OneOf(kLogLevels));
//   CLI11_PARSE(app, argc, argv);
//   if (Status s = cli::RejectGiven(app, {"--peers"}, "apply only to --backend farmem"); ...)
//
// The word lists and the config-file syntax themselves live in config.h (pure, unit-tested);
// this file only connects them to CLI11. Setup code: main threads only.
#pragma once

#include <CLI/CLI.hpp>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/common/status.h"

namespace farmem::cli {

// Adds `--config FILE` to `app`, read with ParseConfigText (config.h): a section header, a line
// that is not `name = value`, a key given twice or a key that is not one of `app`'s long options
// fails the parse (CLI::ConfigError, so CLI11_PARSE exits non-zero) with the file, the line and
// the key in the message. Values go through the options' own validators; options given on the
// command line win over the file.
CLI::Option* AddConfigFileOption(CLI::App& app, const std::string& help);

// The long option names (without dashes) a config file for `app` may set: every long name of its
// options except --help and --config.
std::vector<std::string> ConfigurableKeys(const CLI::App& app);

// A validator accepting exactly the words in `accepted`; its message lists them.
CLI::Validator OneOf(std::span<const std::string_view> accepted);
CLI::Validator OneOf(std::initializer_list<std::string_view> accepted);

// Those of `options` ("--peers", ...) that were given, on the command line or in a config file.
std::vector<std::string> GivenOptions(const CLI::App& app,
                                      std::initializer_list<std::string_view> options);

// InvalidArgument naming every one of `options` that was given, with `why` ("apply only to
// --backend farmem, which this is not: add --backend farmem or leave them out"); Ok otherwise.
Status RejectGiven(const CLI::App& app, std::initializer_list<std::string_view> options,
                   std::string_view why);

// Adds `--log-level` (trace, debug, info, warn, error; the default is `level`'s value) to `app`.
CLI::Option* AddLogLevelOption(CLI::App& app, std::string& level);

// The one log format of every farmem program, on stderr:
//   2026-12-01 15:20:53.134 farmemd[4711] info: <message>
// Makes `program`'s logger the default one (the libraries log through it) at `level`, which
// AddLogLevelOption has checked.
void SetUpLogging(const std::string& program, const std::string& level);

// Adds `--version` to `app`: prints "<program> 0.1.0 (git v0.1.0-3-gd35b8ff)" (the generated
// farmem/common/version.h) on stdout and exits 0, before any other option is checked.
CLI::Option* AddVersionOption(CLI::App& app, std::string_view program);

// Adds `--metrics-listen HOST:PORT` (serve Prometheus metrics over HTTP there; port 0 picks one)
// and `--metrics-port-file FILE` (write the port bound) to `app`: the same for farmemd and
// farmem-nbd (common/metrics.h, docs/operations.md "Metrics").
void AddMetricsOptions(CLI::App& app, std::string& listen, std::string& port_file);

}  // namespace farmem::cli
