// Drain (issue 12): `farmemctl drain` makes a daemon grant nothing and notice every lease;
// `farmemctl stat` shows it draining; `undrain` lets it grant again. SIGTERM with --drain-timeout
// runs the same path: a borrower that moves its data to another daemon on the notice loses
// nothing, and the daemon exits as soon as it holds no lease, well within the timeout.
#include <gtest/gtest.h>

#include <mutex>

#include "client_options.h"
#include "farmem/client/cluster.h"
#include "support/daemon_fixture.h"

namespace farmem::client {
namespace {

using std::chrono::milliseconds;
using testing::DaemonSet;
using testing::WaitUntil;

constexpr uint64_t kSlab = 1 << 20;

ClusterOptions Options(const DaemonSet& d) { return test::OptionsFor(d, "drain-test"); }

std::vector<uint8_t> Pattern(uint8_t seed) {
  std::vector<uint8_t> v(kSlab);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
  return v;
}

testing::CommandResult Farmemctl(const DaemonSet& d, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {testing::BinPath("farmemctl")};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"--secret-file", d.work_dir() + "/secret"});
  return testing::RunCommand(argv, std::chrono::seconds(30));
}

TEST(DrainTest, FarmemctlDrainShowsInStatAndUndrainGrantsAgain) {
  DaemonSet daemons({.extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto cluster = Cluster::Connect(Options(daemons));
  ASSERT_TRUE(cluster.has_value()) << cluster.error().ToString();
  auto held = (*cluster)->Allocate(2);
  ASSERT_TRUE(held.has_value());
  std::mutex mu;
  std::vector<uint64_t> noticed;
  (*cluster)->Subscribe([&](const Event& e) {
    if (e.type != EventType::kEvictNotice) return;
    std::lock_guard lock(mu);
    noticed.insert(noticed.end(), e.lease_ids.begin(), e.lease_ids.end());
  });

  const std::string target = daemons[0].endpoint().ToString();
  testing::CommandResult r = Farmemctl(daemons, {"drain", target, "--grace-ms", "60000"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("2 lease(s) noticed"), std::string::npos) << r.out;
  ASSERT_TRUE(WaitUntil(
      [&] {
        std::lock_guard lock(mu);
        return noticed.size() == 2;
      },
      milliseconds(5000)))
      << daemons.Logs();
  auto st = (*cluster)->Stat(0);
  ASSERT_TRUE(st.has_value());
  EXPECT_NE(st->features & wire::kStateDraining, 0u);
  EXPECT_EQ(st->free_slabs, 0u);
  auto refused = (*cluster)->Allocate(1);
  ASSERT_FALSE(refused.has_value()) << "a draining daemon granted a slab";
  r = Farmemctl(daemons, {"stat", "--peers", target});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("drain"), std::string::npos) << r.out;

  r = Farmemctl(daemons, {"undrain", target});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  st = (*cluster)->Stat(0);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->features & wire::kStateDraining, 0u);
  EXPECT_TRUE((*cluster)->Allocate(1).has_value());
  EXPECT_TRUE((*cluster)->Free(*held).ok()) << "undrain lifted the notices: the leases stay";
}

// A Cluster given the client id of another (a restarted `farmemctl kmod attach` re-adopting a
// device, docs/kmod.md) did not grant that one's leases: before AdoptLeases it got no eviction
// notice (nor kNodeDown/kLeasesLost) for them and could not Free them.
TEST(DrainTest, AdoptedLeasesGetEvictNoticesAndCanBeFreed) {
  DaemonSet daemons({.extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(1).ok()) << daemons.Logs();
  auto first = Cluster::Connect(Options(daemons));
  ASSERT_TRUE(first.has_value()) << first.error().ToString();
  auto held = (*first)->Allocate(2);
  ASSERT_TRUE(held.has_value());
  ClusterOptions o = Options(daemons);
  o.client_id = (*first)->client_id();
  auto second = Cluster::Connect(o);
  ASSERT_TRUE(second.has_value()) << second.error().ToString();
  std::vector<uint64_t> ids = {(*held)[0].id(), (*held)[1].id(), 0xdead};
  auto gone = (*second)->AdoptLeases(0, ids);
  ASSERT_TRUE(gone.has_value()) << gone.error().ToString();
  EXPECT_EQ(*gone, std::vector<uint64_t>{0xdead}) << "a lease the daemon never granted is gone";
  EXPECT_EQ((*second)->node(0).leases_held, 2u);
  std::mutex mu;
  std::vector<uint64_t> noticed;
  (*second)->Subscribe([&](const Event& e) {
    if (e.type != EventType::kEvictNotice) return;
    std::lock_guard lock(mu);
    noticed.insert(noticed.end(), e.lease_ids.begin(), e.lease_ids.end());
  });
  testing::CommandResult r =
      Farmemctl(daemons, {"drain", daemons[0].endpoint().ToString(), "--grace-ms", "60000"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  ASSERT_TRUE(WaitUntil(
      [&] {
        std::lock_guard lock(mu);
        return noticed.size() == 2;
      },
      milliseconds(5000)))
      << "the adopting Cluster got no eviction notice for the adopted leases\n"
      << daemons.Logs();
  EXPECT_TRUE((*second)->Free(*held).ok()) << "adopted leases can be freed";
  EXPECT_EQ((*second)->node(0).leases_held, 0u);
  (void)(*first)->Close();  // its leases are freed already
}

TEST(DrainTest, SigtermDrainsAMovingBorrowerLosesNothingDaemonExitsEarly) {
  DaemonSet daemons(
      {.extra_args = {"--no-mlock", "--memory-source", "off", "--drain-timeout", "20000"}});
  ASSERT_TRUE(daemons.Start(2).ok()) << daemons.Logs();
  auto cluster = Cluster::Connect(Options(daemons));
  ASSERT_TRUE(cluster.has_value()) << cluster.error().ToString();
  Cluster* cl = cluster->get();

  // Three slabs of data on daemon 0.
  std::mutex mu;
  std::map<uint64_t, Lease> where;  // data id -> the lease holding it now
  std::map<uint64_t, uint64_t> data_of;
  {
    auto ch = cl->OpenChannel(0);
    ASSERT_TRUE(ch.has_value());
    for (uint8_t i = 0; i < 3; ++i) {
      auto l = cl->AllocateExcluding(std::vector<NodeId>{1});
      ASSERT_TRUE(l.has_value()) << l.error().ToString();
      ASSERT_EQ(l->node, 0u);
      ASSERT_TRUE((*ch)->Write(l->slab(), 0, Pattern(i)).ok());
      where[i] = *l;
      data_of[l->id()] = i;
    }
  }
  // The borrower's reaction: copy each noticed slab to the other daemon, then free it.
  Status move_status;
  cl->Subscribe([&](const Event& e) {
    if (e.type != EventType::kEvictNotice) return;
    auto from = cl->OpenChannel(e.node);
    std::vector<uint8_t> buf(kSlab);
    std::lock_guard lock(mu);
    for (uint64_t id : e.lease_ids) {
      const uint64_t d = data_of.at(id);
      auto to = cl->AllocateExcluding(std::vector<NodeId>{e.node});
      Status s = from.has_value() ? (*from)->Read(where[d].slab(), 0, buf) : from.error();
      if (s.ok() && to.has_value()) {
        auto ch = cl->OpenChannel(to->node);
        s = ch.has_value() ? (*ch)->Write(to->slab(), 0, buf) : ch.error();
      }
      if (s.ok() && !to.has_value()) s = to.error();
      if (s.ok()) s = cl->Free(std::vector<Lease>{where[d]});
      if (!s.ok()) {
        move_status = s;
        continue;
      }
      where[d] = *to;
    }
  });

  const auto t0 = std::chrono::steady_clock::now();
  Status stopped = daemons[0].Stop(milliseconds(20000));
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(stopped.ok()) << stopped.ToString() << daemons.Logs();
  EXPECT_LT(took, milliseconds(10000)) << "the daemon waited for its drain timeout although "
                                          "every lease was moved and freed";
  std::lock_guard lock(mu);
  EXPECT_TRUE(move_status.ok()) << move_status.ToString();
  auto ch = cl->OpenChannel(1);
  ASSERT_TRUE(ch.has_value());
  std::vector<uint8_t> back(kSlab);
  for (uint8_t i = 0; i < 3; ++i) {
    ASSERT_EQ(where[i].node, 1u);
    ASSERT_TRUE((*ch)->Read(where[i].slab(), 0, back).ok());
    EXPECT_EQ(back, Pattern(i)) << "data " << int(i) << " was lost in the move";
  }
}

}  // namespace
}  // namespace farmem::client
