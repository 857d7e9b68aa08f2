// Keeping what the code under test logs, to check its lines: the one way a test captures log
// lines.
//
//   testing::LogCapture log;  // from here on, every line logged is also kept (the last 4096)
//   ...
//   EXPECT_TRUE(log.Contains("every extent is whole"));
//
// It installs a new default logger with the previous one's sinks plus a ring buffer, and puts
// the previous logger back when it goes out of scope. The logger is swapped, not its sink list
// edited: threads of the code under test may be logging meanwhile, and a logger's sink vector is
// not guarded, while the previous logger stays alive (held here) for a thread that still uses it.
#pragma once

#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace farmem::testing {

class LogCapture {
 public:
  explicit LogCapture(size_t lines = 4096)
      : ring_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(lines)),
        previous_(spdlog::default_logger()) {
    std::vector<spdlog::sink_ptr> sinks = previous_->sinks();
    sinks.push_back(ring_);
    auto logger = std::make_shared<spdlog::logger>(previous_->name(), sinks.begin(), sinks.end());
    logger->set_level(previous_->level());
    logger->flush_on(previous_->flush_level());
    spdlog::set_default_logger(std::move(logger));
  }
  ~LogCapture() { spdlog::set_default_logger(previous_); }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  // The lines kept so far, oldest first, each formatted and ending in a newline.
  std::vector<std::string> Lines() const { return ring_->last_formatted(); }

  // Every line kept so far, in one string.
  std::string Joined() const {
    std::string all;
    for (const std::string& line : Lines()) all += line;
    return all;
  }

  // The kept lines that contain `what`.
  std::vector<std::string> Matching(std::string_view what) const {
    std::vector<std::string> out;
    for (std::string& line : Lines()) {
      if (line.find(what) != std::string::npos) out.push_back(std::move(line));
    }
    return out;
  }

  bool Contains(std::string_view what) const { return !Matching(what).empty(); }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> ring_;
  std::shared_ptr<spdlog::logger> previous_;
};

}  // namespace farmem::testing
