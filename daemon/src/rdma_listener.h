// RdmaListener: farmemd's RDMA side. It listens with rdma_cm next to the TCP port, admits a queue
// pair only for a client that authenticated on TCP, and registers every lease as a memory region
// of its own, so one-sided RDMA READ/WRITE reach exactly the leases a client holds.
//
// Admission: an authenticated client asks its TCP connection for a token (RDMA_TOKEN, see
// docs/wire-protocol.md); the token is random, single-use and short-lived, and names the client.
// The client's rdma_cm connect request carries it as private data. A request without a valid
// token is rejected (with the reason in the reject's private data); nothing else is created.
//
// Isolation: each client id has its own protection domain. A lease's memory region is registered
// in its owner's domain, and the owner's queue pairs are created in that domain too, so an rkey is
// useless on any other client's queue pair (the NIC refuses it: remote access error). Ending a
// lease deregisters its region before the slab is zeroed (SlabPool calls DeregisterLease), so a
// stale rkey stops working at once.
//
// Data path: none here. After a connection is accepted the daemon's CPU does nothing per
// operation; the listener thread only handles connection events (connect, disconnect).
//
// Threading: Start/Stop from the server's thread. IssueToken from connection threads,
// RegisterLease/DeregisterLease from SlabPool (under the pool's lock); they take mu_. The event
// thread owns the connections. Lock order: SlabPool::mu_, then mu_.
//
// Built without verbs (FARMEM_WITH_VERBS=OFF), Start always fails with Unimplemented.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "farmem/common/config.h"
#include "farmem/common/status.h"
#include "farmem/common/wire.h"
#include "slab_pool.h"

namespace farmem::daemon {

enum class RdmaMode {
  kOff,   // TCP only
  kAuto,  // RDMA when a device serves the address, else TCP only (logged)
  kOn,    // RDMA or refuse to start
};
Result<RdmaMode> ParseRdmaMode(std::string_view text);

class RdmaListener final : public LeaseRegistrar {
 public:
  // How long a token admits a connection.
  static constexpr std::chrono::milliseconds kTokenLifetime{10000};

  // Binds rdma_cm to `listen` (port 0: any), finds the device that serves that address (the first
  // device for a wildcard address) and starts the event thread. Unavailable when there is no RDMA
  // device or none serves the address.
  static Result<std::unique_ptr<RdmaListener>> Start(const Endpoint& listen);
  ~RdmaListener() override;

  // Disconnects every queue pair, deregisters every region still registered, frees the protection
  // domains and stops the thread. Detach it from the pool first (SlabPool::SetRegistrar(nullptr)).
  void Stop();

  uint16_t port() const { return port_; }
  const std::string& device_name() const { return device_name_; }

  // A fresh token for `client` (called on its authenticated TCP connection).
  Result<wire::RdmaTokenReply> IssueToken(const wire::ClientId& client);

  // LeaseRegistrar
  Result<uint32_t> RegisterLease(uint32_t slab, const wire::ClientId& owner, void* addr,
                                 uint64_t length) override;
  void DeregisterLease(uint32_t slab) override;

  struct Impl;  // the rdma-core objects (rdma_listener.cc)

 private:
  explicit RdmaListener(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
  std::string device_name_;
};

}  // namespace farmem::daemon
