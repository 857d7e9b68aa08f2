// AdaptiveSpin (common/adaptive_spin.h): the spin policy of the daemon-reply and NBD-request
// waits. Counts of probe calls and of spins, hits and skips: no timing assumptions beyond "a spin
// with a probe that never has anything ends".
#include "farmem/common/adaptive_spin.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

namespace farmem {
namespace {

using std::chrono::microseconds;

TEST(AdaptiveSpinTest, WithoutABudgetNeverCallsTheProbe) {
  AdaptiveSpin spin;
  int calls = 0;
  EXPECT_EQ(spin.Spin([&] { return ++calls, 1; }), 0);
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(spin.stats().spins, 0u);
}

TEST(AdaptiveSpinTest, AHitReturnsTheProbesValue) {
  AdaptiveSpin spin;
  spin.set_budget(AdaptiveSpin::kMaxBudget);
  int calls = 0;
  // Ready on the third look; the yields between looks do not end a spin of 1 ms on an idle CPU,
  // and on a busy one the spin may end early: then the next spin catches it.
  int rc = 0;
  for (int i = 0; i < 200 && rc == 0; ++i) rc = spin.Spin([&] { return ++calls >= 3 ? 7 : 0; });
  EXPECT_EQ(rc, 7);
  EXPECT_EQ(spin.stats().hits, 1u);
}

TEST(AdaptiveSpinTest, SpinsThatRunOutBackOffOneTwoFourUpToTheCap) {
  AdaptiveSpin spin;
  spin.set_budget(microseconds(50));
  int calls = 0;
  auto never = [&] { return ++calls, 0; };
  // Which calls look (spin) and which return at once: after the n-th spin that runs out, the
  // next min(2^(n-1), 64) calls return at once.
  std::vector<uint32_t> skips;
  uint32_t run = 0;
  for (int i = 0; skips.size() < 9 && i < 1000; ++i) {
    const int before = calls;
    const uint64_t skipped_before = spin.stats().skipped;
    EXPECT_EQ(spin.Spin(never), 0);
    if (calls > before) {
      if (i > 0) skips.push_back(run);
      run = 0;
    } else {
      EXPECT_EQ(spin.stats().skipped, skipped_before + 1);
      ++run;
    }
  }
  EXPECT_EQ(skips, (std::vector<uint32_t>{1, 2, 4, 8, 16, 32, 64, 64, 64}));
  EXPECT_EQ(spin.stats().hits, 0u);
}

TEST(AdaptiveSpinTest, AHitEndsTheBackoffAndAProbeErrorDoesNotStartOne) {
  AdaptiveSpin spin;
  spin.set_budget(microseconds(50));
  EXPECT_EQ(spin.Spin([] { return 0; }), 0);  // runs out: the next call returns at once
  EXPECT_EQ(spin.Spin([] { return 1; }), 0);
  EXPECT_EQ(spin.stats().skipped, 1u);
  EXPECT_EQ(spin.Spin([] { return 0; }), 0);  // runs out again: backoff 2
  spin.Spin([] { return 1; });
  spin.Spin([] { return 1; });
  EXPECT_EQ(spin.stats().skipped, 3u);
  EXPECT_EQ(spin.Spin([] { return 1; }), 1);  // a hit: backoff back to 1
  EXPECT_EQ(spin.Spin([] { return 0; }), 0);
  EXPECT_EQ(spin.Spin([] { return 1; }), 0);  // skipped once
  EXPECT_EQ(spin.Spin([] { return 1; }), 1);  // and spins again at once
  EXPECT_EQ(spin.stats().skipped, 4u);

  // An error from the probe is returned as it is and leaves no backoff.
  EXPECT_EQ(spin.Spin([] { return -1; }), -1);
  EXPECT_EQ(spin.Spin([] { return 2; }), 2);
  EXPECT_EQ(spin.stats().skipped, 4u);
}

TEST(AdaptiveSpinTest, TheCallersLimitEndsASpinAndSetBudgetClampsAndStartsAfresh) {
  AdaptiveSpin spin;
  spin.set_budget(AdaptiveSpin::kMaxBudget);
  int calls = 0;
  // A limit already past: one look, then the spin ends (and backs off).
  EXPECT_EQ(spin.Spin([&] { return ++calls, 0; }, AdaptiveSpin::Clock::now()), 0);
  EXPECT_EQ(calls, 1);
  spin.set_budget(microseconds(1'000'000));
  EXPECT_EQ(spin.budget(), AdaptiveSpin::kMaxBudget);
  EXPECT_EQ(spin.Spin([] { return 1; }), 1);  // no backoff left from before
  spin.set_budget(microseconds(-5));
  EXPECT_EQ(spin.budget().count(), 0);
}

}  // namespace
}  // namespace farmem
