// What people type into options: sizes, endpoints and peer lists. Junk and overflow are errors
// with a message that quotes the input; nothing is silently truncated.
#include "farmem/common/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace farmem {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kKiB = 1ull << 10, kMiB = 1ull << 20, kGiB = 1ull << 30, kTiB = 1ull << 40;

uint64_t SizeOrDie(std::string_view text) {
  auto r = ParseSize(text);
  EXPECT_TRUE(r.has_value()) << text << ": " << r.error().ToString();
  return r.value_or(0);
}

TEST(ParseSize, PlainBytes) {
  EXPECT_EQ(SizeOrDie("0"), 0u);
  EXPECT_EQ(SizeOrDie("4096"), 4096u);
  EXPECT_EQ(SizeOrDie("4096B"), 4096u);
  EXPECT_EQ(SizeOrDie("4096b"), 4096u);
  EXPECT_EQ(SizeOrDie("18446744073709551615"), std::numeric_limits<uint64_t>::max());
}

TEST(ParseSize, UnitsArePowersOfTwo) {
  EXPECT_EQ(SizeOrDie("64K"), 64 * kKiB);
  EXPECT_EQ(SizeOrDie("64k"), 64 * kKiB);
  EXPECT_EQ(SizeOrDie("64KB"), 64 * kKiB);
  EXPECT_EQ(SizeOrDie("64KiB"), 64 * kKiB);
  EXPECT_EQ(SizeOrDie("64kib"), 64 * kKiB);
  EXPECT_EQ(SizeOrDie("64M"), 64 * kMiB);
  EXPECT_EQ(SizeOrDie("64MiB"), 64 * kMiB);
  EXPECT_EQ(SizeOrDie("1G"), kGiB);
  EXPECT_EQ(SizeOrDie("1GiB"), kGiB);
  EXPECT_EQ(SizeOrDie("3T"), 3 * kTiB);
}

TEST(ParseSize, SpacesAroundAndBeforeTheUnit) {
  EXPECT_EQ(SizeOrDie("  256M  "), 256 * kMiB);
  EXPECT_EQ(SizeOrDie("16 MiB"), 16 * kMiB);
}

TEST(ParseSize, LargestValuesThatFitAndFirstThatOverflow) {
  EXPECT_EQ(SizeOrDie("16777215T"), 16777215 * kTiB);  // (2^64 - 1) >> 40
  EXPECT_EQ(SizeOrDie("17179869183G"), 17179869183ull * kGiB);
  for (const char* text : {"16777216T", "20000000000T", "17179869184G", "18014398509481984K",
                           "18446744073709551616", "99999999999999999999999M"}) {
    auto r = ParseSize(text);
    ASSERT_FALSE(r.has_value()) << text << " = " << *r;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(r.error().message(), HasSubstr(text));
  }
  EXPECT_THAT(ParseSize("20000000000T").error().message(), HasSubstr("overflows"));
}

TEST(ParseSize, RejectsJunk) {
  for (const char* text : {"", " ", "M", "-1", "-1G", "+5", "1.5G", "0x10", "64MM", "64 M B", "64Q",
                           "64iB", "64KiBs", "64 K i B", "1e3", "ten", "64M,"}) {
    auto r = ParseSize(text);
    ASSERT_FALSE(r.has_value()) << "'" << text << "' = " << *r;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument) << text;
  }
}

TEST(FormatSize, ReadsBackNaturally) {
  EXPECT_EQ(FormatSize(0), "0 B");
  EXPECT_EQ(FormatSize(1023), "1023 B");
  EXPECT_EQ(FormatSize(kKiB), "1 KiB");
  EXPECT_EQ(FormatSize(64 * kMiB), "64 MiB");
  EXPECT_EQ(FormatSize(kGiB + kGiB / 2), "1.5 GiB");
  EXPECT_EQ(FormatSize(2048 * kTiB), "2048 TiB");
}

Endpoint EndpointOrDie(std::string_view text, uint16_t default_port = 0) {
  auto r = ParseEndpoint(text, default_port);
  EXPECT_TRUE(r.has_value()) << text << ": " << r.error().ToString();
  return r.value_or(Endpoint{});
}

TEST(ParseEndpoint, HostAndPort) {
  EXPECT_EQ(EndpointOrDie("127.0.0.1:7000"), (Endpoint{"127.0.0.1", 7000}));
  EXPECT_EQ(EndpointOrDie("node-3.farmem.svc:7411"), (Endpoint{"node-3.farmem.svc", 7411}));
  EXPECT_EQ(EndpointOrDie("h:0"), (Endpoint{"h", 0}));
  EXPECT_EQ(EndpointOrDie("h:65535"), (Endpoint{"h", 65535}));
}

TEST(ParseEndpoint, Ipv6InBrackets) {
  EXPECT_EQ(EndpointOrDie("[::1]:7000"), (Endpoint{"::1", 7000}));
  EXPECT_EQ(EndpointOrDie("[fe80::1:2]:1"), (Endpoint{"fe80::1:2", 1}));
  EXPECT_EQ(EndpointOrDie("[::1]", 7411), (Endpoint{"::1", 7411}));
}

TEST(ParseEndpoint, DefaultPortForABareHost) {
  EXPECT_EQ(EndpointOrDie("10.0.0.3", kDefaultPort), (Endpoint{"10.0.0.3", kDefaultPort}));
  EXPECT_EQ(EndpointOrDie("10.0.0.3:9", kDefaultPort), (Endpoint{"10.0.0.3", 9}));
  EXPECT_EQ(kDefaultPort, 7411);
}

TEST(ParseEndpoint, RejectsMalformed) {
  struct Case {
    const char* text;
    uint16_t default_port;
    const char* says;
  } cases[] = {
      {"10.0.0.3", 0, "missing port"},
      {"[::1]", 0, "missing port"},
      {"10.0.0.3:", 0, "missing port"},
      {":7000", 0, "missing host"},
      {"", 7411, "missing host"},
      {"[]:7000", 0, "missing host"},
      {"::1", 0, "brackets"},
      {"::1:7000", 7411, "brackets"},
      {"fe80::1", 7411, "brackets"},
      {"[::1:7000", 0, "missing ']'"},
      {"[::1]7000", 0, "expected ':port'"},
      {"h:65536", 0, "0 to 65535"},
      {"h:99999999999", 0, "0 to 65535"},
      {"h:-1", 0, "0 to 65535"},
      {"h:70x", 0, "0 to 65535"},
      {"h: 70", 0, "0 to 65535"},
      {"h:http", 0, "0 to 65535"},
  };
  for (const Case& c : cases) {
    auto r = ParseEndpoint(c.text, c.default_port);
    ASSERT_FALSE(r.has_value()) << "'" << c.text << "' = " << r->ToString();
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(r.error().message(), HasSubstr(c.says)) << c.text;
  }
}

TEST(Endpoint, ToStringBracketsIpv6AndRoundTrips) {
  EXPECT_EQ((Endpoint{"::1", 7000}).ToString(), "[::1]:7000");
  EXPECT_EQ((Endpoint{"10.0.0.1", 7}).ToString(), "10.0.0.1:7");
  for (const char* text : {"[::1]:7000", "10.0.0.1:7", "[2001:db8::5]:65535", "a.b:1"}) {
    EXPECT_EQ(EndpointOrDie(text).ToString(), text);
  }
}

TEST(ParseEndpointList, CommaSeparatedWithSpacesAndEmptyItems) {
  auto r = ParseEndpointList(" a:1, [::1]:2 ,,b ,", 7411);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(*r, (std::vector<Endpoint>{{"a", 1}, {"::1", 2}, {"b", 7411}}));
  auto empty = ParseEndpointList("");
  ASSERT_TRUE(empty.has_value());
  EXPECT_TRUE(empty->empty());
  auto commas = ParseEndpointList(",,, ,");
  ASSERT_TRUE(commas.has_value());
  EXPECT_TRUE(commas->empty());
}

TEST(ParseEndpointList, OneBadItemFailsTheListAndIsNamed) {
  auto r = ParseEndpointList("a:1,b,c:3");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.error().message(), HasSubstr("'b'"));
  EXPECT_FALSE(ParseEndpointList("a:1,[::1:2").has_value());
}

// ---- config files (issue 11, defect 4: a typo must never quietly turn a setting off) ----

std::vector<ConfigEntry> EntriesOrDie(std::string_view text) {
  auto r = ParseConfigText(text, "farmemd.conf");
  EXPECT_TRUE(r.has_value()) << text << ": " << r.error().ToString();
  return r.value_or(std::vector<ConfigEntry>{});
}

TEST(ParseConfigText, NameEqualsValueWithCommentsBlanksAndQuotes) {
  EXPECT_EQ(EntriesOrDie("# farmemd\n"
                         "\n"
                         "capacity = 8G\n"
                         "; another comment\n"
                         "  slab-size=64M   # the unit of lending\n"
                         "secret-file = \"/etc/farmem/my secret#1\"  # quoted\n"
                         "port-file = /run/a#b\r\n"
                         "no-mlock = true"),
            (std::vector<ConfigEntry>{{"capacity", "8G", 3},
                                      {"slab-size", "64M", 5},
                                      {"secret-file", "/etc/farmem/my secret#1", 6},
                                      {"port-file", "/run/a#b", 7},
                                      {"no-mlock", "true", 8}}));
  EXPECT_TRUE(EntriesOrDie("").empty());
  EXPECT_EQ(EntriesOrDie("listen = ''"), (std::vector<ConfigEntry>{{"listen", "", 1}}));
}

// Regression: "[farmemd]" made every key below it belong to a section nobody reads.
TEST(ParseConfigText, SectionHeaderIsAnErrorNamingTheFileAndLine) {
  auto r = ParseConfigText("# daemon\n[farmemd]\ncapacity = 8G\n", "/etc/farmem/main.conf");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.error().message(), HasSubstr("/etc/farmem/main.conf line 2"));
  EXPECT_THAT(r.error().message(), HasSubstr("[farmemd]"));
}

TEST(ParseConfigText, MalformedLinesAreErrorsNamingTheLine) {
  for (const auto& [text, line, what] : std::vector<std::tuple<std::string, int, std::string>>{
           {"capacity = 8G\ncapacity 8G\n", 2, "not `name = value`"},
           {"= 8G", 1, "no name"},
           {"a = 1\n\n--capacity = 8G", 3, "without dashes"},
           {"secret-file = \"/x", 1, "no closing"},
           {"listen = \"a\" b", 1, "after the quoted value"},
           {"capacity = 1G\nlisten = x:1\ncapacity = 2G", 3, "first on line 1"},
       }) {
    auto r = ParseConfigText(text, "f.conf");
    ASSERT_FALSE(r.has_value()) << text;
    EXPECT_THAT(r.error().message(), HasSubstr("f.conf line " + std::to_string(line))) << text;
    EXPECT_THAT(r.error().message(), HasSubstr(what)) << text;
  }
}

const std::vector<std::string> kDaemonKeys = {"listen",      "capacity",  "slab-size",
                                              "secret-file", "log-level", "no-mlock"};

// Regression: "secert-file = ..." was ignored and the daemon started with no authentication.
TEST(CheckConfigKeys, UnknownKeyIsAnErrorNamingKeyLineAndTheLikelyMeant) {
  const auto entries = EntriesOrDie("capacity = 8G\n\nsecert-file = /etc/farmem/secret\n");
  const Status s = CheckConfigKeys(entries, kDaemonKeys, "main.conf");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("main.conf line 3"));
  EXPECT_THAT(s.message(), HasSubstr("unknown option 'secert-file'"));
  EXPECT_THAT(s.message(), HasSubstr("did you mean 'secret-file'?"));
}

TEST(CheckConfigKeys, FarOffKeyListsTheKnownOnesAndUnderscoresAreCorrected) {
  const Status far = CheckConfigKeys(EntriesOrDie("colour = blue"), kDaemonKeys, "c");
  EXPECT_THAT(far.message(), HasSubstr("line 1: unknown option 'colour'"));
  EXPECT_THAT(far.message(), HasSubstr("known: listen, capacity, slab-size"));
  const Status underscore = CheckConfigKeys(EntriesOrDie("slab_size = 1M"), kDaemonKeys, "c");
  EXPECT_THAT(underscore.message(), HasSubstr("did you mean 'slab-size'?"));
}

TEST(CheckConfigKeys, KnownKeysPass) {
  EXPECT_TRUE(CheckConfigKeys(EntriesOrDie("capacity = 8G\nsecret-file = /s\nno-mlock = true"),
                              kDaemonKeys, "c")
                  .ok());
}

// Regression: "--log-level bogus" silenced every log line, the no-authentication warning too.
TEST(ParseChoice, AcceptsOnlyTheListedWordsAndNamesThemAll) {
  EXPECT_EQ(ParseChoice("--log-level", "warn", kLogLevels).value_or("?"), "warn");
  auto bad = ParseChoice("--log-level", "bogus", kLogLevels);
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.error().message(),
            "--log-level: 'bogus' is not one of trace, debug, info, warn, error");
  // Case and surrounding blanks are not guessed at.
  EXPECT_FALSE(ParseChoice("--log-level", "INFO", kLogLevels).has_value());
  EXPECT_FALSE(ParseChoice("--log-level", " info", kLogLevels).has_value());
  auto transport = ParseChoice("--transport", "rdma", kTransports);
  ASSERT_FALSE(transport.has_value());
  EXPECT_THAT(transport.error().message(), HasSubstr("auto, tcp, verbs"));
  EXPECT_EQ(ParseChoice("--rdma", "on", {"auto", "on", "off"}).value_or("?"), "on");
  auto anonymous = ParseChoice("", "x", {"a"});
  ASSERT_FALSE(anonymous.has_value());
  EXPECT_EQ(anonymous.error().message(), "'x' is not one of a");
}

}  // namespace
}  // namespace farmem
