// Shared setup for the far_ptr tests: real farmemd daemons and a Runtime over them.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/far_ptr.h"
#include "farmem/runtime.h"
#include "support/daemon_fixture.h"
#include "support/object_pattern.h"
#include "support/sanitizer.h"
#include "support/test_runtime.h"
#include "support/test_scale.h"

namespace farmem::farptr_test {

// ThreadSanitizer runs these ~10x slower: its build (tests/run --tsan) does less work.
#if FARMEM_UNDER_TSAN
inline constexpr int kTsanScale = 8;
#else
inline constexpr int kTsanScale = 1;
#endif

// The divisor of the long workloads (far_stress_test, far_containers_test): CI runs them at a
// quarter of their by-hand size (FARMEM_LONG_TESTS=1 runs them whole; docs/testing.md).
inline int LongWorkloadScale() { return kTsanScale * (farmem::testing::LongTests() ? 1 : 4); }

// Deterministic contents for object `id` at `version` (tests/support/object_pattern.h).
inline void Fill(std::span<std::byte> out, uint64_t id, uint64_t version) {
  farmem::testing::FillObject(out, id, version);
}
inline bool Matches(std::span<const std::byte> got, uint64_t id, uint64_t version) {
  std::vector<std::byte> want(got.size());
  Fill(want, id, version);
  return std::memcmp(want.data(), got.data(), got.size()) == 0;
}

// A small object whose contents say which it is: MakePoints makes {i, i % 7, 0, 0}, and
// ExpectAllRight reads each back and checks it.
struct Point {
  uint64_t id;
  uint64_t version;
  double x, y;
};
inline std::vector<far_ptr<Point>> MakePoints(uint64_t n) {
  std::vector<far_ptr<Point>> objs;
  for (uint64_t i = 0; i < n; ++i) objs.push_back(make_far<Point>(Point{i, i % 7, 0, 0}));
  return objs;
}
inline void ExpectAllRight(std::vector<far_ptr<Point>>& objs, const char* when) {
  for (uint64_t i = 0; i < objs.size(); ++i) {
    DerefScope s;
    auto p = objs[i].try_deref(s);
    ASSERT_TRUE(p.has_value()) << when << ": object " << i << ": " << p.error().ToString();
    ASSERT_EQ((*p)->id, i) << when;
    ASSERT_EQ((*p)->version, i % 7) << when;
  }
}

class FarptrTest : public ::testing::Test {
 protected:
  void StartDaemons(size_t n, const std::string& capacity = "64M", const std::string& slab = "1M") {
    testing::DaemonConfig cfg;
    cfg.capacity = capacity;
    cfg.slab_size = slab;
    cfg.log_level = "warn";
    daemons_ = std::make_unique<testing::DaemonSet>(cfg);
    Status s = daemons_->Start(n);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }

  RuntimeOptions Options(const std::string& resilience, uint64_t budget, uint32_t span = 16384) {
    return testing::TestRuntimeOptions(daemons_->endpoints(), daemons_->secret(), resilience,
                                       budget, span);
  }

  void Open(const RuntimeOptions& o) {
    auto rt = Runtime::Create(o);
    ASSERT_TRUE(rt.has_value()) << rt.error().ToString();
    rt_ = std::move(*rt);
  }

  void TearDown() override {
    if (rt_ && (HasFailure() || std::getenv("FARPTR_TEST_STATS") != nullptr)) {
      RuntimeStats s = rt_->stats();
      std::fprintf(stderr,
                   "runtime: objects %lu local %lu/%lu remote spans %lu sets %lu swap-ins %lu "
                   "(prefetch %lu) evicted %lu cancels %lu relocated %lu degraded %lu lost %lu "
                   "compactions %lu (%lu -> %lu spans) set bytes %lu leased %lu remote live %lu\n",
                   s.objects, s.local_bytes, s.local_budget, s.remote_spans, s.span_sets,
                   s.swap_ins, s.prefetches, s.spans_evicted, s.eviction_cancels,
                   s.objects_relocated, s.degraded_reads, s.spans_lost, s.compactions,
                   s.compaction_spans_in, s.compaction_spans_out, s.remote_set_bytes,
                   s.remote_leased_bytes, s.remote_object_bytes);
    }
  }

  // The index of the daemon holding member 0 of the first slab group (the group the first objects
  // were evicted to, full of rows); daemons_->size() when nothing is out yet.
  size_t DaemonOfFirstMember() const {
    const std::vector<std::vector<Endpoint>> layout = rt_->span_set_layout();
    if (layout.empty() || layout[0].empty()) return daemons_->size();
    for (size_t d = 0; d < daemons_->size(); ++d) {
      if ((*daemons_)[d].endpoint() == layout[0][0]) return d;
    }
    return daemons_->size();
  }

  // Another client ("filler") connected to daemon d only, so that it can take that daemon's room.
  std::unique_ptr<client::Cluster> ConnectFiller(size_t d) {
    client::ClusterOptions co;
    co.peers = {(*daemons_)[d].endpoint()};
    co.secret = daemons_->secret();
    co.client_name = "filler";
    auto filler = client::Cluster::Connect(co);
    EXPECT_TRUE(filler.has_value()) << filler.error().ToString();
    return filler.has_value() ? std::move(*filler) : nullptr;
  }
  // Leases slabs through `filler` until its daemon has no room left; appends them to *held.
  static void TakeAllRoom(client::Cluster& filler, std::vector<client::Lease>* held) {
    for (;;) {
      auto got = filler.Allocate(1);
      if (!got) break;
      held->push_back(got->front());
    }
  }

  std::unique_ptr<testing::DaemonSet> daemons_;
  std::unique_ptr<Runtime> rt_;
};

}  // namespace farmem::farptr_test
