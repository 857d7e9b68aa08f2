#include "farmem/common/command_line.h"

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <iterator>

#include "farmem/common/version.h"

namespace farmem::cli {
namespace {

// CLI11's config reader, replaced: CLI11's own ignores unknown keys and everything under a
// section header by default, and names no line when told to complain.
class StrictConfigFile final : public CLI::Config {
 public:
  explicit StrictConfigFile(const CLI::App* app) : app_(app) {}

  std::string to_config(const CLI::App* app, bool default_also, bool write_description,
                        std::string prefix) const override {
    return CLI::ConfigTOML().to_config(app, default_also, write_description, std::move(prefix));
  }

  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    const std::string text{std::istreambuf_iterator<char>(input), std::istreambuf_iterator<char>()};
    std::string origin = "config file";
    if (const CLI::Option* opt = app_->get_config_ptr(); opt != nullptr && opt->count() > 0) {
      origin = opt->results().front();
    }
    auto entries = ParseConfigText(text, origin);
    if (!entries) throw CLI::ConfigError(entries.error().message());
    const std::vector<std::string> known = ConfigurableKeys(*app_);
    if (Status s = CheckConfigKeys(*entries, known, origin); !s.ok()) {
      throw CLI::ConfigError(s.message());
    }
    std::vector<CLI::ConfigItem> items;
    for (ConfigEntry& e : *entries) {
      CLI::ConfigItem item;
      item.name = std::move(e.key);
      item.inputs = {std::move(e.value)};
      items.push_back(std::move(item));
    }
    return items;
  }

 private:
  const CLI::App* app_;
};

}  // namespace

CLI::Option* AddConfigFileOption(CLI::App& app, const std::string& help) {
  app.config_formatter(std::make_shared<StrictConfigFile>(&app));
  return app.set_config("--config", "", help);
}

std::vector<std::string> ConfigurableKeys(const CLI::App& app) {
  std::vector<std::string> keys;
  const CLI::Option* config = app.get_config_ptr();
  const CLI::Option* help = app.get_help_ptr();
  for (const CLI::Option* opt : app.get_options()) {
    if (opt == config || opt == help || !opt->get_configurable()) continue;
    for (const std::string& name : opt->get_lnames()) keys.push_back(name);
  }
  return keys;
}

CLI::Validator OneOf(std::span<const std::string_view> accepted) {
  std::vector<std::string_view> words(accepted.begin(), accepted.end());
  return CLI::Validator(
      [words](std::string& value) -> std::string {
        auto r = ParseChoice("", value, words);
        return r ? std::string() : r.error().message();
      },
      fmt::format("{}", fmt::join(words, "|")));
}

CLI::Validator OneOf(std::initializer_list<std::string_view> accepted) {
  return OneOf(std::span<const std::string_view>(accepted));
}

std::vector<std::string> GivenOptions(const CLI::App& app,
                                      std::initializer_list<std::string_view> options) {
  std::vector<std::string> given;
  for (std::string_view name : options) {
    if (app.count(std::string(name)) > 0) given.emplace_back(name);
  }
  return given;
}

Status RejectGiven(const CLI::App& app, std::initializer_list<std::string_view> options,
                   std::string_view why) {
  const std::vector<std::string> given = GivenOptions(app, options);
  if (given.empty()) return Status::Ok();
  return InvalidArgument(fmt::format("{} {} {}", fmt::join(given, ", "),
                                     given.size() == 1 ? "applies" : "apply", why));
}

CLI::Option* AddLogLevelOption(CLI::App& app, std::string& level) {
  return app.add_option("--log-level", level, "trace, debug, info, warn or error")
      ->capture_default_str()
      ->check(OneOf(kLogLevels));
}

void SetUpLogging(const std::string& program, const std::string& level) {
  auto logger = std::make_shared<spdlog::logger>(
      program, std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  logger->set_pattern(fmt::format("%Y-%m-%d %H:%M:%S.%e {}[%P] %l: %v", program));
  spdlog::set_default_logger(std::move(logger));
  spdlog::set_level(spdlog::level::from_str(level));
}

CLI::Option* AddVersionOption(CLI::App& app, std::string_view program) {
  return app.set_version_flag("--version", fmt::format("{} {}", program, kVersionString),
                              "Print the version and exit");
}

void AddMetricsOptions(CLI::App& app, std::string& listen, std::string& port_file) {
  app.add_option("--metrics-listen", listen,
                 "Serve Prometheus metrics (text format) at http://HOST:PORT/metrics, and "
                 "liveness at /healthz; port 0 picks one. Unauthenticated: bind to loopback or a "
                 "monitoring network");
  app.add_option("--metrics-port-file", port_file,
                 "Write the metrics port actually bound to this file (with --metrics-listen)");
}

}  // namespace farmem::cli
