// FakeFabric: in-process daemons and a fake data transport, for fast, deterministic tests of
// failure interleavings in the page store and far_ptr (eRPC keeps a fake transport for the same
// reason). docs/testing.md ("The fake transport") says what it models and what it cannot.
//
// What is real and what is fake:
//   - Node i is a real daemon::Server and SlabPool in this process on 127.0.0.1 (the port is
//     picked at the first start and kept across restarts). The control path (HELLO/AUTH,
//     ALLOC/FREE, heartbeats, failure detection, lease checks) is the real client::Cluster
//     talking the real protocol over loopback: only the process boundary is gone, so a node
//     starts and stops in milliseconds.
//   - The data path is fake: transport() is a transport::Transport whose channels serve READ and
//     WRITE straight from the node's SlabPool (SlabPool::Acquire checks lease, owner and bounds
//     as the daemon does), on the thread that flushes them, without sockets. Give it to the
//     client with ClusterOptions::data_transport.
//   - Every data op posted to node i gets a number, 1, 2, ... over all channels to i, in flush
//     order (ops(i) is the last one). The script says what happens to op n of node i:
//       Fail(i, n, status)  op n completes with `status`, not applied;
//       DropReply(i, n)     op n is applied but its reply never comes (the caller gives up at its
//                           deadline, or when the node is declared down);
//       Break(i, n)         the channel breaks at op n: it and everything outstanding on that
//                           channel complete with Unavailable, not applied;
//       Stall(i, n)         op n and every later op to i wait, not applied, until Resume(i) (a
//                           gray failure on the data path; held longer than the channel's
//                           op_timeout they complete with DeadlineExceeded and the channel breaks,
//                           as a real channel's would);
//       At(i, n, fn)        fn runs on the flushing thread just before op n is served, with no
//                           lock held (e.g. Kill(i) between an extent's data and parity writes:
//                           op n then fails as on a daemon that died).
//     Next(i) is the number the next op to i will get, so a test scripts "the next write".
//   - Where the test cannot know which node the code under test reaches first, or how many ops
//     it sends there first (far_ptr's span sets go to whichever daemons placement picks), it
//     scripts by predicate instead: the first op after the call, to any node, for which
//     `match(node, op)` holds is failed (FailFirst), loses its reply (DropReplyFirst), or has
//     `fn(node)` run before it is served (AtFirst). Each such rule fires once; predicate rules
//     are checked in the order they were made, before the numbered ones. `match` runs with the
//     fabric's lock held: it may look at its arguments only, never call the fabric.
//   - Kill(i): the daemon stops (its connections close, new ones are refused), its data channels
//     break, its memory and leases are gone. Restart(i): a new daemon on the same port, with
//     no lease (the client sees a new node id: kLeasesLost).
//
//   farmem::testing::FakeFabric fabric({.nodes = 4});
//   ASSERT_TRUE(fabric.Start().ok());
//   client::ClusterOptions o = fabric.ClusterOptionsForTest();  // peers, secret, data_transport
//   ...
//   fabric.At(2, fabric.Next(2), [&] { fabric.Kill(2); });  // node 2 dies at its next data op
//
// Threads: every method may be called from any thread (hooks run on the flushing thread); a
// channel belongs to one thread, like any Channel.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/common/config.h"
#include "farmem/common/status.h"
#include "farmem/transport/transport.h"

namespace farmem::testing {

struct FakeFabricConfig {
  size_t nodes = 3;
  uint64_t capacity = 8 << 20;  // per node
  uint64_t slab_size = 1 << 20;
  std::chrono::milliseconds lease_ttl{10000};
  std::string secret = "farmem-fake-fabric-secret";
};

class FakeFabric {
 public:
  explicit FakeFabric(FakeFabricConfig config = {});
  ~FakeFabric();  // kills every node
  FakeFabric(const FakeFabric&) = delete;
  FakeFabric& operator=(const FakeFabric&) = delete;

  // Starts every node.
  Status Start();
  size_t size() const;
  std::vector<Endpoint> endpoints() const;
  const std::string& secret() const;
  // The data transport to install (ClusterOptions::data_transport).
  std::shared_ptr<transport::Transport> transport() const;
  // peers, secret, data_transport, and timings short enough for tests (heartbeat 50 ms, down
  // after 500 ms without an answer, down nodes retried every 50 ms).
  client::ClusterOptions ClusterOptionsForTest() const;

  // The node's daemon stops: connections close and are refused, its data channels break, its
  // memory and leases are gone. No-op on a dead node.
  void Kill(size_t i);
  // A new daemon on the node's port, without leases.
  Status Restart(size_t i);
  bool alive(size_t i) const;

  // The script (see the top of this file). `n` counts data ops to node i since Start.
  void Fail(size_t i, uint64_t n, Status status);
  void DropReply(size_t i, uint64_t n);
  void Break(size_t i, uint64_t n);
  void Stall(size_t i, uint64_t n);
  void At(size_t i, uint64_t n, std::function<void()> fn);
  // The script by predicate (see the top of this file): each applies to one op, the first one
  // after the call that `match` accepts.
  using OpMatch = std::function<bool(size_t node, const transport::Op& op)>;
  void FailFirst(OpMatch match, Status status);
  void DropReplyFirst(OpMatch match);
  void AtFirst(OpMatch match, std::function<void(size_t node)> fn);
  // Matches every op of one kind (e.g. OfType(transport::OpType::kRead)).
  static OpMatch OfType(transport::OpType type) {
    return [type](size_t, const transport::Op& op) { return op.type == type; };
  }
  // Serves the ops held by Stall now, and lifts the stall.
  void Resume(size_t i);
  // Forgets every numbered rule for node i (a stall too, without serving what it holds); rules
  // by predicate are not per node and stay until they fire.
  void ClearScript(size_t i);

  uint64_t ops(size_t i) const;  // data ops to node i so far
  uint64_t Next(size_t i) const { return ops(i) + 1; }
  uint64_t writes(size_t i) const;  // of which writes

  struct State;  // fake_fabric.cc

 private:
  std::shared_ptr<State> state_;
};

}  // namespace farmem::testing
