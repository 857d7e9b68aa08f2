// The metrics exposition (common/metrics.h): what Render writes is what ParseExposition (and so
// Prometheus) accepts, the parser rejects what Prometheus rejects, and the HTTP responder answers
// bad requests with an error and a close, never a crash, while good scrapes keep working.
#include "farmem/common/metrics.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cmath>
#include <string>

namespace farmem::metrics {
namespace {

TEST(MetricsRender, CountersCallbacksAndHistogramsParseBack) {
  Registry r;
  Counter& reads = r.AddCounter("farmem_test_ops_total", "Ops.", {{"op", "read"}});
  Counter& writes = r.AddCounter("farmem_test_ops_total", "Ops.", {{"op", "write"}});
  Histogram& lat = r.AddHistogram("farmem_test_latency_seconds", "Latency.", {{"op", "read"}},
                                  LatencyBoundsNs(), 1e-9);
  r.AddCallback("farmem_test_free_bytes", "Free \\ bytes\nsecond line.", Type::kGauge,
                [](const Registry::Emit& emit) {
                  emit({{"node", "a\"b\\c\nd"}}, 1.5);
                  emit({{"node", "x"}}, std::nan(""));
                });
  reads.Add(3);
  writes.Add();
  lat.Observe(5'000);          // 5 µs: first bucket
  lat.Observe(300'000);        // 300 µs
  lat.Observe(9'000'000'000);  // beyond the last bound: +Inf only
  const std::string text = r.Render();
  auto samples = ParseExposition(text);
  ASSERT_TRUE(samples.has_value()) << samples.error().ToString() << "\n" << text;
  EXPECT_EQ(Find(*samples, "farmem_test_ops_total", {{"op", "read"}}), 3.0);
  EXPECT_EQ(Find(*samples, "farmem_test_ops_total", {{"op", "write"}}), 1.0);
  EXPECT_EQ(Find(*samples, "farmem_test_free_bytes", {{"node", "a\"b\\c\nd"}}), 1.5);
  EXPECT_EQ(Find(*samples, "farmem_test_latency_seconds_count", {{"op", "read"}}), 3.0);
  EXPECT_EQ(Find(*samples, "farmem_test_latency_seconds_bucket", {{"le", "1e-05"}}), 1.0);
  EXPECT_EQ(Find(*samples, "farmem_test_latency_seconds_bucket", {{"le", "0.0005"}}), 2.0);
  EXPECT_EQ(Find(*samples, "farmem_test_latency_seconds_bucket", {{"le", "5"}}), 2.0);
  EXPECT_EQ(Find(*samples, "farmem_test_latency_seconds_bucket", {{"le", "+Inf"}}), 3.0);
  EXPECT_NEAR(*Find(*samples, "farmem_test_latency_seconds_sum"), 9.000305, 1e-9);
  EXPECT_NE(text.find("# TYPE farmem_test_ops_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("# HELP farmem_test_free_bytes Free \\\\ bytes\\nsecond line.\n"),
            std::string::npos);
}

// Observe finds the bucket through a table by the value's bit width (no scan from the first
// bound): every value lands in the first bucket whose bound is >= it, as a scan would put it, at
// each bound, one off either side, 0, the largest value, and powers of two — for the latency
// bounds and for bounds closer than 2x apart (several in one power of two).
TEST(MetricsHistogram, ObserveFindsTheBucketAScanWould) {
  for (const std::vector<uint64_t>& bounds :
       {LatencyBoundsNs(), std::vector<uint64_t>{1, 2, 3, 5, 6, 7, 100, 101, 1ull << 40}}) {
    Histogram h(bounds, 1);
    std::vector<uint64_t> values = {0, 1, ~uint64_t{0}};
    for (uint64_t b : bounds) values.insert(values.end(), {b - 1, b, b + 1});
    for (int w = 0; w < 64; ++w) {
      values.insert(values.end(), {(uint64_t{1} << w) - 1, uint64_t{1} << w});
    }
    for (uint64_t v : values) {
      size_t want = 0;
      while (want < bounds.size() && v > bounds[want]) ++want;
      const std::vector<uint64_t> before = h.Buckets();
      h.Observe(v);
      const std::vector<uint64_t> after = h.Buckets();
      for (size_t i = 0; i < after.size(); ++i) {
        EXPECT_EQ(after[i] - before[i], i == want ? 1u : 0u) << "value " << v << " bucket " << i;
      }
    }
  }
}

TEST(MetricsParse, RejectsWhatPrometheusRejects) {
  const char* bad[] = {
      "x 1\n",                                              // no TYPE
      "# TYPE x counter\nx{a=\"1\"} one\n",                 // value
      "# TYPE x counter\nx{a=1} 1\n",                       // unquoted
      "# TYPE x counter\nx{a=\"1} 1\n",                     // unterminated
      "# TYPE x counter\nx{a=\"\\q\"} 1\n",                 // bad escape
      "# TYPE x counter\nx{1a=\"1\"} 1\n",                  // label name
      "# TYPE x counter\nx{a=\"1\",a=\"2\"} 1\n",           // label twice
      "# TYPE x counter\nx 1\nx 2\n",                       // series twice
      "# TYPE x counter\n# TYPE y gauge\nx 1\ny 1\nx 2\n",  // family not contiguous
      "# TYPE x bogus\nx 1\n",                              // type
      "# TYPE x counter\nx 1",                              // no final newline
      "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 0\nh_count 1\n",
      "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 0\nh_count 1\n",     // no +Inf
      "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 0\nh_count 1\n",  // count
      "# TYPE 9x counter\n",
  };
  for (const char* t : bad) {
    EXPECT_FALSE(ParseExposition(t).has_value()) << t;
  }
  auto ok = ParseExposition("# HELP x a\n# TYPE x gauge\nx{a=\"\"} -Inf 1700000000000\n\n");
  ASSERT_TRUE(ok.has_value()) << ok.error().ToString();
  EXPECT_TRUE(std::isinf(ok->at(0).value));
}

class MetricsHttp : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_.AddCounter("farmem_test_total", "A counter.").Add(7);
    auto s = MetricsServer::Start({"127.0.0.1", 0}, &registry_);
    ASSERT_TRUE(s.has_value()) << s.error().ToString();
    server_ = std::move(*s);
  }
  Endpoint ep() const { return {"127.0.0.1", server_->port()}; }
  // Sends raw bytes (optionally half-closing), returns everything the server sent until it closed.
  std::string Raw(const std::string& bytes, bool half_close = true) {
    auto s = ConnectTcp(ep(), DeadlineIn(std::chrono::seconds(5)));
    EXPECT_TRUE(s.has_value());
    if (!s) return "";
    EXPECT_TRUE(SendAll(s->fd(), {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()},
                        DeadlineIn(std::chrono::seconds(5)))
                    .ok());
    if (half_close) ::shutdown(s->fd(), SHUT_WR);
    std::string out;
    uint8_t buf[4096];
    for (;;) {
      iovec iov{buf, sizeof buf};
      auto n = RecvSome(s->fd(), &iov, 1, DeadlineIn(std::chrono::seconds(10)));
      if (!n) break;
      out.append(reinterpret_cast<char*>(buf), *n);
    }
    return out;
  }
  void ExpectScrapeWorks() {
    auto r = HttpGet(ep(), "/metrics", DeadlineIn(std::chrono::seconds(5)));
    ASSERT_TRUE(r.has_value()) << r.error().ToString();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->content_type, "text/plain; version=0.0.4; charset=utf-8");
    auto samples = ParseExposition(r->body);
    ASSERT_TRUE(samples.has_value()) << samples.error().ToString();
    EXPECT_EQ(Find(*samples, "farmem_test_total"), 7.0);
  }
  Registry registry_;
  std::unique_ptr<MetricsServer> server_;
};

TEST_F(MetricsHttp, ServesMetricsAndHealth) {
  ExpectScrapeWorks();
  auto h = HttpGet(ep(), "/healthz", DeadlineIn(std::chrono::seconds(5)));
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(h->body, "ok\n");
  const std::string head = Raw("HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_TRUE(head.starts_with("HTTP/1.1 200 OK\r\n")) << head;
  EXPECT_TRUE(head.ends_with("\r\n\r\n")) << head;  // headers only
}

TEST_F(MetricsHttp, BadRequestsGetAnErrorAndACloseAndScrapesGoOn) {
  struct Case {
    std::string bytes;
    const char* status;
  };
  const std::vector<Case> cases = {
      {"GET /nope HTTP/1.1\r\n\r\n", "HTTP/1.1 404 "},
      {"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", "HTTP/1.1 405 "},
      {"GET /metrics\r\n\r\n", "HTTP/1.1 400 "},
      {"GET  /metrics HTTP/1.1\r\n\r\n", "HTTP/1.1 400 "},
      {"GET /metrics SPDY/3\r\n\r\n", "HTTP/1.1 400 "},
      {std::string("\0\xff\x01garbage\n\n", 12), "HTTP/1.1 400 "},
      {"GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'a') + "\r\n\r\n", "HTTP/1.1 431 "},
      {"GET /metrics HTTP/1.1\r\nX: " + std::string(8200, 'a') + "\r\n\r\n", "HTTP/1.1 431 "},
  };
  for (const Case& c : cases) {
    const std::string got = Raw(c.bytes);
    EXPECT_TRUE(got.starts_with(c.status)) << c.bytes.substr(0, 40) << " -> " << got;
    ExpectScrapeWorks();
  }
  // Closed before a whole request: nothing to answer, the server just goes on.
  EXPECT_EQ(Raw("GET /met"), "");
  ExpectScrapeWorks();
}

// A client that sends half a request and then nothing holds the (one) HTTP thread for at most
// kRequestTimeout: it gets 408 and the next scrape is served. Time is this test's subject.
TEST_F(MetricsHttp, ASilentClientGetsRequestTimeout) {
  const std::string got = Raw("GET /metrics HTTP/1.1\r\n", /*half_close=*/false);
  EXPECT_TRUE(got.starts_with("HTTP/1.1 408 ")) << got;
  ExpectScrapeWorks();
}

}  // namespace
}  // namespace farmem::metrics
