// The programs' shared command-line layer (command_line.h) on a real CLI11 App: --config is read
// strictly (unknown key, section header: errors with file and line), enum options say what they
// accept, and options given in the file count as given (for "does not apply" checks).
#include "farmem/common/command_line.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/process.h"

namespace farmem::cli {
namespace {

using ::testing::HasSubstr;

// A farmemd-like command line.
struct Options {
  std::string capacity = "1G", secret_file, log_level = "info", rdma = "auto";
  bool no_mlock = false;
};

class CommandLineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AddConfigFileOption(app_, "config");
    app_.add_option("--capacity", o_.capacity);
    app_.add_option("--secret-file", o_.secret_file);
    app_.add_option("--log-level", o_.log_level)->check(OneOf(kLogLevels));
    app_.add_option("--rdma", o_.rdma)->check(OneOf({"auto", "on", "off"}));
    app_.add_flag("--no-mlock", o_.no_mlock);
    ASSERT_TRUE(dir_.ok()) << dir_.status().ToString();
    path_ = dir_.File("test.conf");
  }

  // Parses `args` with a config file holding `config`; the error's text, or "" on success.
  std::string Parse(const std::string& config, std::vector<std::string> args = {}) {
    std::ofstream(path_) << config;
    std::vector<std::string> argv = {"prog", "--config", path_.string()};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<const char*> c;
    for (const std::string& a : argv) c.push_back(a.c_str());
    try {
      app_.parse(static_cast<int>(c.size()), c.data());
    } catch (const CLI::ParseError& e) {
      EXPECT_NE(e.get_exit_code(), 0);
      return e.what();
    }
    return "";
  }

  CLI::App app_{"test"};
  Options o_;
  farmem::testing::TempDir dir_{"farmem-command-line-test"};  // removed with the file
  std::filesystem::path path_;
};

TEST_F(CommandLineTest, ConfigFileSetsOptionsAndTheCommandLineWins) {
  EXPECT_EQ(Parse("capacity = 8G\nsecret-file = /s\nno-mlock = true\nlog-level = warn\n",
                  {"--capacity", "4G"}),
            "");
  EXPECT_EQ(o_.capacity, "4G");
  EXPECT_EQ(o_.secret_file, "/s");
  EXPECT_TRUE(o_.no_mlock);
  EXPECT_EQ(o_.log_level, "warn");
}

// Regression (issue 11, defect 4): a mistyped key was ignored; the daemon started open.
TEST_F(CommandLineTest, UnknownKeyInTheConfigFileFailsNamingFileLineAndKey) {
  const std::string err = Parse("capacity = 8G\nsecert-file = /etc/farmem/secret\n");
  EXPECT_THAT(err, HasSubstr(path_.string() + " line 2"));
  EXPECT_THAT(err, HasSubstr("unknown option 'secert-file'"));
  EXPECT_THAT(err, HasSubstr("did you mean 'secret-file'?"));
  EXPECT_EQ(o_.secret_file, "");
}

// Regression: a section header made every key below it ignored.
TEST_F(CommandLineTest, SectionHeaderInTheConfigFileFails) {
  const std::string err = Parse("[farmemd]\nsecret-file = /s\n");
  EXPECT_THAT(err, HasSubstr(path_.string() + " line 1"));
  EXPECT_THAT(err, HasSubstr("[farmemd]"));
}

TEST_F(CommandLineTest, HelpAndConfigAreNotConfigurableKeys) {
  const std::vector<std::string> keys = ConfigurableKeys(app_);
  EXPECT_THAT(keys, ::testing::UnorderedElementsAre("capacity", "secret-file", "log-level", "rdma",
                                                    "no-mlock"));
  EXPECT_THAT(Parse("config = /other.conf\n"), HasSubstr("unknown option 'config'"));
}

// Regression: --log-level bogus silenced all logging.
TEST_F(CommandLineTest, EnumValuesAreCheckedOnTheCommandLineAndInTheFile) {
  EXPECT_THAT(Parse("", {"--log-level", "bogus"}),
              HasSubstr("--log-level: 'bogus' is not one of trace, debug, info, warn, error"));
  EXPECT_THAT(Parse("rdma = maybe\n"), HasSubstr("'maybe' is not one of auto, on, off"));
}

TEST_F(CommandLineTest, OptionsFromTheFileCountAsGiven) {
  ASSERT_EQ(Parse("secret-file = /s\n", {"--rdma", "off"}), "");
  EXPECT_EQ(GivenOptions(app_, {"--secret-file", "--rdma", "--capacity"}),
            (std::vector<std::string>{"--secret-file", "--rdma"}));
  const Status s = RejectGiven(app_, {"--secret-file", "--capacity"}, "only to X: leave it out");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "--secret-file applies only to X: leave it out");
  EXPECT_TRUE(RejectGiven(app_, {"--capacity"}, "never").ok());
}

}  // namespace
}  // namespace farmem::cli
