// Drain (issue 12): `farmemctl drain` makes a daemon grant nothing and notice every lease;
// `farmemctl stat` shows it draining; `undrain` lets it grant again. SIGTERM with --drain-timeout
// runs the same path: a borrower that moves its data to another daemon on the notice loses
// nothing, and the daemon exits as soon as it holds no lease, well within the timeout.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <set>

#include "client_options.h"
#include "farmem/client/cluster.h"
#include "farmem/transport/tcp_connection.h"
#include "farmem/transport/transport.h"
#include "support/daemon_fixture.h"
#include "support/raw_client.h"

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

// A borrower's reaction to an EVICT_NOTICE for `*at` on `node` (`from`: a data channel there, or
// why none could be opened): copy the slab to another daemon, free the noticed lease, and point
// `*at` at the copy. `*at` is left as it was when any step fails.
Status MoveOff(Cluster& cl, NodeId node, const Result<std::unique_ptr<transport::Channel>>& from,
               Lease* at) {
  std::vector<uint8_t> buf(kSlab);
  auto to = cl.AllocateExcluding(std::vector<NodeId>{node});
  Status s = from.has_value() ? (*from)->Read(at->slab(), 0, buf) : from.error();
  if (s.ok() && to.has_value()) {
    auto ch = cl.OpenChannel(to->node);
    s = ch.has_value() ? (*ch)->Write(to->slab(), 0, buf) : ch.error();
  }
  if (s.ok() && !to.has_value()) s = to.error();
  if (s.ok()) s = cl.Free(std::vector<Lease>{*at});
  if (s.ok()) *at = *to;
  return s;
}

// After the moves: data 0..n-1 (Pattern(i)) all sit on `node`, byte for byte.
void ExpectMovedIntact(Cluster& cl, const std::map<uint64_t, Lease>& where, NodeId node,
                       uint8_t n) {
  auto ch = cl.OpenChannel(node);
  ASSERT_TRUE(ch.has_value());
  std::vector<uint8_t> back(kSlab);
  for (uint8_t i = 0; i < n; ++i) {
    ASSERT_EQ(where.at(i).node, node);
    ASSERT_TRUE((*ch)->Read(where.at(i).slab(), 0, back).ok());
    EXPECT_EQ(back, Pattern(i)) << "data " << int(i) << " was lost in the move";
  }
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

// A keeper SIGKILLed during a drain (docs/kmod.md, "the keeper killed during a drain"): the
// daemon pushed EVICT_NOTICE on the dead process's connection only, and the restarted process
// that adopts the leases (same client id) never learned that they were noticed: nothing moved
// them, and at the deadline the lender ended them with their bytes. Now the daemon lists the
// client's noticed leases in every HEARTBEAT reply: the adopting Cluster gets kEvictNotice for
// them and moves them, and sees the noticed lease it does not hold (the old lease of a move the
// first process finished) in noticed_not_held, to adopt and free. The drain then ends well
// within its grace.
TEST(DrainTest, NoticeSentBeforeARestartReachesTheAdoptingCluster) {
  DaemonSet daemons({.extra_args = {"--no-mlock", "--memory-source", "off"}});
  ASSERT_TRUE(daemons.Start(2).ok()) << daemons.Logs();
  const wire::ClientId id = testing::RandomClientId();
  transport::ChannelOptions co;
  co.endpoint = daemons[0].endpoint();
  co.credentials.secret = daemons.secret();
  co.credentials.client_id = id;
  co.credentials.client_name = "drain-test-first";
  co.connect_timeout = milliseconds(5000);
  co.op_timeout = milliseconds(5000);

  // The first process: three leases on daemon 0 (two its slab table names, one the old lease
  // of a move it finished), data in the two, a control connection that heartbeats.
  std::vector<wire::LeaseGrant> grants;
  {
    auto first = transport::TcpConnection::Connect(co);
    ASSERT_TRUE(first.has_value()) << first.error().ToString();
    std::vector<uint8_t> req;
    wire::EncodeAlloc({3}, &req);
    auto body = first->Call(wire::Opcode::kAlloc, req, milliseconds(5000));
    ASSERT_TRUE(body.has_value()) << body.error().ToString();
    auto alloc = wire::DecodeAllocReply(*body);
    ASSERT_TRUE(alloc.has_value() && alloc->leases.size() == 3);
    grants = alloc->leases;
    auto ch = transport::MakeTcpTransport()->OpenChannel(co);
    ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
    for (uint8_t i = 0; i < 2; ++i) {
      ASSERT_TRUE((*ch)->Write(transport::RemoteSlab::From(grants[i]), 0, Pattern(i)).ok());
    }
    testing::CommandResult r =
        Farmemctl(daemons, {"drain", daemons[0].endpoint().ToString(), "--grace-ms", "60000"});
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    // The notice reached the first process's connection (it comes ahead of a reply)...
    std::vector<std::vector<uint8_t>> pushes;
    ASSERT_TRUE(WaitUntil(
        [&] {
          if (!first->Call(wire::Opcode::kHeartbeat, {}, milliseconds(5000))) return false;
          pushes = first->TakePushes();
          return !pushes.empty();
        },
        milliseconds(5000)))
        << daemons.Logs();
    auto notice = wire::DecodeEvictNotice(pushes.front());
    ASSERT_TRUE(notice.has_value());
    EXPECT_EQ(notice->lease_ids.size(), 3u);
  }  // ... which dies here (SIGKILL closes its sockets), before moving anything.

  // The restarted process: same client id, adopts the two leases its slab table names.
  ClusterOptions o = Options(daemons);
  o.client_id = id;
  auto cluster = Cluster::Connect(o);
  ASSERT_TRUE(cluster.has_value()) << cluster.error().ToString();
  Cluster* cl = cluster->get();
  std::mutex mu;
  std::map<uint64_t, Lease> where;  // data id -> the lease holding it now
  std::map<uint64_t, uint64_t> data_of = {{grants[0].lease_id, 0}, {grants[1].lease_id, 1}};
  for (uint8_t i = 0; i < 2; ++i) where[i] = Lease{0, grants[i]};
  Status move_status;
  std::set<uint64_t> noticed;
  cl->Subscribe([&](const Event& e) {  // the keeper's reaction: move, then free the old lease
    if (e.type != EventType::kEvictNotice) return;
    auto from = cl->OpenChannel(e.node);
    std::lock_guard lock(mu);
    for (uint64_t lease : e.lease_ids) {
      // The orphan, once the test adopts it below, is announced too (a HEARTBEAT reply lists it
      // before the test frees it): it holds no data of ours.
      auto data = data_of.find(lease);
      if (data == data_of.end()) continue;
      noticed.insert(lease);
      if (Status s = MoveOff(*cl, e.node, from, &where[data->second]); !s.ok()) {
        move_status = s;
      }
    }
  });
  std::vector<uint64_t> table = {grants[0].lease_id, grants[1].lease_id};
  auto adopted = cl->AdoptLeases(0, table);
  ASSERT_TRUE(adopted.has_value()) << adopted.error().ToString();
  ASSERT_TRUE(adopted->empty());
  ASSERT_TRUE(WaitUntil(
      [&] {
        std::lock_guard lock(mu);
        return noticed.size() == 2;
      },
      milliseconds(5000)))
      << "the adopting Cluster never learned that its adopted leases are under notice\n"
      << daemons.Logs();
  // The orphan: under notice there, held by this client id, not adopted.
  ASSERT_TRUE(WaitUntil(
      [&] { return cl->node(0).noticed_not_held == std::vector<uint64_t>{grants[2].lease_id}; },
      milliseconds(5000)))
      << "the orphan lease was not reported under notice";
  auto gone = cl->AdoptLeases(0, cl->node(0).noticed_not_held);
  ASSERT_TRUE(gone.has_value() && gone->empty());
  EXPECT_TRUE(cl->Free(std::vector<Lease>{Lease{0, grants[2]}}).ok());

  // Every lease is off the drained daemon: `drain --wait` returns long before the 60 s grace.
  const auto t0 = std::chrono::steady_clock::now();
  testing::CommandResult r = Farmemctl(
      daemons, {"drain", daemons[0].endpoint().ToString(), "--grace-ms", "60000", "--wait"});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(10000)) << r.out;
  std::lock_guard lock(mu);
  EXPECT_TRUE(move_status.ok()) << move_status.ToString();
  ASSERT_NO_FATAL_FAILURE(ExpectMovedIntact(*cl, where, 1, 2));
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
    std::lock_guard lock(mu);
    for (uint64_t id : e.lease_ids) {
      if (Status s = MoveOff(*cl, e.node, from, &where[data_of.at(id)]); !s.ok()) move_status = s;
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
  ASSERT_NO_FATAL_FAILURE(ExpectMovedIntact(*cl, where, 1, 3));
}

}  // namespace
}  // namespace farmem::client
