// Network faults on the path between the clients of a chaos scenario and one daemon: a partition
// (every packet dropped, both ways, until healed), delay with jitter, packet loss.
//
// Everything of a scenario (daemons, farmem-nbd or the far_ptr program, the driver's own probes)
// talks over the loopback device of a network namespace the driver makes for itself
// (EnterPrivateNetwork), so tc on that `lo` touches nobody else. The daemons all listen on
// 127.0.0.1 with a port each; a daemon's path is "every packet to or from its port":
//  - partition: an ingress u32 filter on lo per direction redirects the daemon's packets to a
//    veth that is down, which drops them (act_mirred). This works on kernels without sch_netem
//    or act_gact — the build hosts' — and in the guest alike. TCP connections stay open and
//    retransmit; new ones get no SYN-ACK: a real partition, not a closed port.
//  - delay / loss: an egress prio qdisc on lo (every packet in band 1 by default), one band per
//    impaired daemon with a netem qdisc under it, and u32 filters steering the daemon's packets
//    there. Both directions pass lo's egress, so a delay of D ms each way is 2D ms of round trip.
//    Needs sch_netem, sch_prio (and cls_u32): in the qemu guest only, not on the build hosts.
//
// Owned by the driver's main thread.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "farmem/common/status.h"

namespace farmem::chaos {

// Moves this process into a network namespace of its own (unshare(CLONE_NEWNET); without the
// privilege, a user namespace with it), brings its lo up and makes the blackhole veth. Call it
// while the process is still single-threaded: every process started later inherits it.
Status EnterPrivateNetwork();

// Whether netem (and prio) work here: set up and torn down on the blackhole device. Call after
// EnterPrivateNetwork. Ok, or why not (the host kernel has no sch_netem).
Status NetemAvailable();

class NetworkFaults {
 public:
  ~NetworkFaults();
  // `index` names the daemon (0..15): its tc filter preference and netem band.
  Status Partition(int index, uint16_t port);
  // Delay each packet to or from the daemon by `ms` ± `jitter_ms` (netem, uniform), in addition
  // to any loss set before.
  Status Delay(int index, uint16_t port, int ms, int jitter_ms);
  // Drop `percent` of the packets to or from the daemon, at random, in addition to any delay.
  Status Loss(int index, uint16_t port, double percent);
  // Removes every fault this object made (packets already held by netem still arrive late).
  Status HealAll();
  bool any() const { return !partitioned_.empty() || !impaired_.empty(); }

 private:
  std::set<int> partitioned_;
  struct Impairment {
    int delay_ms = 0, jitter_ms = 0;
    double loss_percent = 0;
  };
  Status Impair(int index, uint16_t port, const Impairment& what);
  std::map<int, Impairment> impaired_;
  std::set<int> filtered_;  // daemons whose packets the prio qdisc steers to their netem band
};

}  // namespace farmem::chaos
