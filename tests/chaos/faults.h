// Faults the chaos driver injects besides signals to daemons: another client that takes every
// free slab of a daemon, NBD clients that stop reading their replies, floods of idle and
// slowloris sockets at a daemon, and a probe that checks a new authenticated client is served.
//
// Each object belongs to the driver's thread; Slowloris runs one thread of its own.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/common/socket.h"
#include "farmem/common/status.h"

namespace farmem::client {
class Cluster;
}

namespace farmem::chaos {

// Takes every free slab of one daemon, as other clients would (several client identities, in
// case the daemon limits each client's share), and holds them until Release().
class SlabFiller {
 public:
  SlabFiller();
  ~SlabFiller();
  Status Fill(const Endpoint& daemon, const std::string& secret);
  void Release();
  size_t slabs() const { return slabs_; }

 private:
  std::vector<std::unique_ptr<client::Cluster>> clients_;
  size_t slabs_ = 0;
};

// `idle` TCP connections that send nothing and `slow` ones that send a frame header one byte per
// second (slowloris), all at one daemon, until Release().
class SocketFlood {
 public:
  ~SocketFlood();
  Status Start(const Endpoint& daemon, size_t idle, size_t slow);
  void Release();
  size_t connected() const { return sockets_.size(); }

 private:
  std::vector<Socket> sockets_;
  std::vector<Socket> slow_;
  std::thread slow_thread_;
  std::atomic<bool> stop_{false};
};

// NBD clients that negotiate, pipeline READs and never read a reply, until Release().
class StalledNbdClients {
 public:
  Status Start(const std::string& socket_path, size_t clients);
  void Release();

 private:
  std::vector<Socket> sockets_;
};

// A new authenticated client asks `daemon` for its STAT (farmemctl stat). Ok with the time it
// took, or the error (timeout included).
struct ProbeResult {
  bool ok = false;
  double ms = 0;
  std::string error;
};
ProbeResult ProbeDaemon(const std::string& farmemctl, const Endpoint& daemon,
                        const std::string& secret_file, std::chrono::milliseconds timeout);

}  // namespace farmem::chaos
