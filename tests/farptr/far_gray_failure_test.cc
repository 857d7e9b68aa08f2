// A gray failure under far_ptr (issue 11, gap 1): a daemon holding span-set members is SIGSTOPped
// for longer than the failure timeout. It keeps its sockets open and answers nothing, so nothing
// breaks: the client declares it down after failure_timeout. From then on a deref whose span
// lived there must be served from the surviving replica (a degraded read) at once — not after
// op_timeout, and never with an error, since replicate:2 survives one lost member.
//
// Readers deref objects the whole time; the test asserts no deref failed, every object verifies,
// and the longest single deref stayed well below op_timeout. It prints the longest stall.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "farmem/client/cluster.h"
#include "farptr_fixture.h"
#include "support/wait.h"

namespace farmem::farptr_test {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr size_t kObjects = 2000;
constexpr size_t kObjectSize = 700;
constexpr int kReaders = 3;
constexpr milliseconds kFailureTimeout{1000};
// Long, so that waiting for it (the defect) and not waiting (the fix) are far apart.
constexpr milliseconds kOpTimeout{10000};

class FarGrayFailureTest : public FarptrTest {};

TEST_F(FarGrayFailureTest, PausedDaemonsSpansAreReadDegradedWithoutWaitingForOpTimeout) {
  // Two daemons: no spare to re-protect onto, so every deref of a span whose replica was on the
  // paused daemon must be a degraded read from the other one.
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2, "16M"));
  RuntimeOptions o = Options("replicate:2", 256u << 10);
  o.failure_timeout = kFailureTimeout;
  o.op_timeout = kOpTimeout;
  o.reconcile_interval = milliseconds(500);
  ASSERT_NO_FATAL_FAILURE(Open(o));

  std::vector<far_bytes> objs;
  for (size_t i = 0; i < kObjects; ++i) {
    objs.push_back(make_far_bytes_in(*rt_, kObjectSize));
    DerefScope s;
    Fill(objs.back().deref_mut(s), i, 1);
  }
  ASSERT_TRUE(rt_->EvictUntil(0).ok());
  ASSERT_GT(rt_->stats().remote_spans, 0u);

  // Pause the daemon holding the first group's data member (the replica derefs read), so some
  // derefs must be served by the other replica.
  const size_t victim = DaemonOfFirstMember();
  ASSERT_LT(victim, daemons_->size());
  client::NodeId paused_node = 0;
  bool found = false;
  for (const client::NodeInfo& n : rt_->cluster().nodes()) {
    if (n.endpoint == (*daemons_)[victim].endpoint()) {
      paused_node = n.id;
      found = true;
    }
  }
  ASSERT_TRUE(found);

  std::atomic<bool> stop{false};
  std::atomic<bool> detected{false};
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> wrong{0};
  std::atomic<int64_t> longest_us{0};
  std::atomic<uint64_t> after_detection[kReaders] = {};
  std::string first_error;
  std::mutex first_error_mu;
  std::vector<std::thread> readers;
  for (int t = 0; t < kReaders; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<uint64_t>(t) + 1);
      while (!stop.load()) {
        const size_t i = rng() % objs.size();
        const auto start = steady_clock::now();
        DerefScope s;
        auto got = objs[i].try_deref(s);
        const int64_t us =
            std::chrono::duration_cast<std::chrono::microseconds>(steady_clock::now() - start)
                .count();
        int64_t prev = longest_us.load();
        while (us > prev && !longest_us.compare_exchange_weak(prev, us)) {
        }
        if (!got.has_value()) {
          if (errors.fetch_add(1) == 0) {
            std::lock_guard lock(first_error_mu);
            first_error = got.error().ToString();
          }
        } else if (!Matches(*got, i, 1)) {
          wrong.fetch_add(1);
        }
        if (detected.load()) after_detection[t].fetch_add(1);
      }
    });
  }
  // Readers are under way (swapping spans in) before the fault.
  ASSERT_TRUE(farmem::testing::WaitUntil([&] { return rt_->stats().swap_ins > 200; },
                                         std::chrono::seconds(30)));

  (*daemons_)[victim].Pause();
  const auto paused = steady_clock::now();
  Status down =
      rt_->cluster().WaitForNode(paused_node, client::NodeState::kDown, std::chrono::seconds(20));
  ASSERT_TRUE(down.ok()) << down.ToString();
  const auto detect_ms =
      std::chrono::duration_cast<milliseconds>(steady_clock::now() - paused).count();
  detected.store(true);
  // Every reader gets on with many more derefs while the daemon stays paused (a reader stuck on
  // it until op_timeout holds this up; the limit is past op_timeout so the stall is measured).
  const bool progressed = farmem::testing::WaitUntil(
      [&] {
        return std::all_of(std::begin(after_detection), std::end(after_detection),
                           [](const std::atomic<uint64_t>& n) { return n.load() >= 300; });
      },
      kOpTimeout * 3);
  (*daemons_)[victim].Resume();
  stop.store(true);
  for (auto& r : readers) r.join();

  const int64_t longest_ms = longest_us.load() / 1000;
  std::fprintf(stderr,
               "gray failure: detected after %ld ms; longest deref %ld ms (op_timeout %ld ms, "
               "failure_timeout %ld ms); %lu degraded reads\n",
               static_cast<long>(detect_ms), static_cast<long>(longest_ms),
               static_cast<long>(kOpTimeout.count()), static_cast<long>(kFailureTimeout.count()),
               static_cast<unsigned long>(rt_->stats().degraded_reads));
  EXPECT_TRUE(progressed) << "readers stalled while the daemon was paused";
  EXPECT_EQ(errors.load(), 0u) << "derefs failed although replicate:2 survives one daemon; first: "
                               << first_error;
  EXPECT_EQ(wrong.load(), 0u) << "derefs returned wrong bytes";
  EXPECT_GT(rt_->stats().degraded_reads, 0u) << "nothing was read from the surviving replica";
  EXPECT_LT(longest_ms, kOpTimeout.count() / 2)
      << "a deref waited for the paused daemon instead of reading the other replica";
  for (size_t i = 0; i < objs.size(); ++i) {
    DerefScope s;
    auto got = objs[i].try_deref(s);
    ASSERT_TRUE(got.has_value()) << "object " << i << ": " << got.error().ToString();
    ASSERT_TRUE(Matches(*got, i, 1)) << "object " << i << " came back wrong";
  }
  EXPECT_EQ(rt_->stats().spans_lost, 0u);
}

}  // namespace
}  // namespace farmem::farptr_test
