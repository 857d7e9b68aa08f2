// The verbs (RDMA) implementation of the transport interface, on rdma-core (libibverbs +
// librdmacm). docs/rdma.md describes the design; this is how to get one.
//
// A VerbsTransport lives on one RDMA device and one protection domain; every channel it opens is
// an RC queue pair to one farmemd, set up like this: an authenticated TCP connection to the
// daemon (HELLO/AUTH, as for TCP channels) asks for a one-time token (RDMA_TOKEN), rdma_cm
// connects to the daemon's rdma port with that token as private data, and the TCP connection is
// closed. From then on reads and writes are one-sided RDMA READ/WRITE against the lease's
// remote address and rkey (RemoteSlab, from the lease grant): the daemon's CPU is not involved.
//
// Memory: RegisterMemory() gives a region with an lkey; ops whose `region` is one of this
// transport's regions move data straight between the NIC and the caller's buffer. Ops on memory
// not registered with this transport still work: up to `bounce_slot_bytes` they go through a
// pre-registered bounce buffer (one copy), larger ones register the caller's buffer for the
// duration of the op (slow: a registration per op). Register what you reuse.
//
// Threading: the transport may be shared by threads (OpenChannel, RegisterMemory); each channel
// belongs to one thread at a time. Channels and regions keep the device open: they may outlive
// the transport object.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "farmem/common/status.h"
#include "farmem/transport/transport.h"

namespace farmem::transport {

struct VerbsOptions {
  // RDMA device to use (e.g. "rxe0"); empty: the first device that has an active port. Also
  // $FARMEM_RDMA_DEVICE when this is empty.
  std::string device;
  // RDMA READs this client asks to have in flight per queue pair; the daemon may grant fewer
  // (rdma_cm negotiates it), and the channel never exceeds what was granted.
  uint8_t read_depth = 16;
  // Transport ACK timeout, 4.096 µs * 2^ack_timeout (15: ~134 ms), and how often an unanswered
  // packet is retried (at most 7). Together they bound how long an op to a dead daemon waits
  // before it fails with "retry exceeded" (about (retry_count + 1) * timeout).
  uint8_t ack_timeout = 15;
  uint8_t retry_count = 7;
  // Poll() spins on the completion queue for at most about twice the recent operation latency,
  // clamped to [spin_min, spin_max], then sleeps on the completion channel: a thread waiting on
  // a slow or idle channel does not burn a core.
  std::chrono::microseconds spin_min{10};
  std::chrono::microseconds spin_max{1000};
  // Within one doorbell every signal_every-th work request is signaled, and always the last one
  // (selective signaling): completions then come back in groups of at most this many, so freed
  // slots can be refilled before the whole doorbell's worth has finished. 0: only the last one.
  uint32_t signal_every = 4;
  // Unregistered buffers up to this size are bounced through a registered buffer; one slot per
  // outstanding operation, allocated at the channel's first unregistered op.
  uint32_t bounce_slot_bytes = 64 << 10;
};

// The verbs transport on this machine's RDMA device. Unavailable when there is none (for instance
// no rdma_rxe: see docs/rdma.md), Unimplemented when farmem was built without FARMEM_WITH_VERBS.
Result<std::unique_ptr<Transport>> MakeVerbsTransport(const VerbsOptions& options = {});

}  // namespace farmem::transport
