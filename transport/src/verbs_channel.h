// Private to the verbs transport: the objects verbs_setup.cc creates (device, regions, queue
// pairs) and verbs_datapath.cc drives (post, poll). docs/rdma.md explains the design.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "farmem/common/socket.h"
#include "farmem/common/wire.h"
#include "farmem/transport/transport.h"
#include "farmem/transport/verbs.h"

namespace farmem::transport::verbs {

// One RDMA device and the protection domain of one transport. Shared (shared_ptr) by the
// transport, its channels and its regions, so none of them can outlive the domain.
struct Device {
  ibv_context* context = nullptr;  // librdmacm's context for the device: never closed here
  ibv_pd* pd = nullptr;
  ibv_device_attr attr{};
  std::string name;
  VerbsOptions options;

  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  ~Device();
};

// Memory registered for local access by this transport's queue pairs (the lkey).
class Region final : public LocalRegion {
 public:
  Region(std::shared_ptr<Device> device, ibv_mr* mr) : device_(std::move(device)), mr_(mr) {}
  ~Region() override;
  void* addr() const override { return mr_->addr; }
  size_t length() const override { return mr_->length; }
  uint32_t lkey() const override { return mr_->lkey; }
  const Device* device() const { return device_.get(); }

 private:
  std::shared_ptr<Device> device_;
  ibv_mr* mr_;
};

// One RC queue pair to one farmemd. Operations are numbered (seq) in the order they are posted;
// an RC send queue completes in that order, so "everything before the signaled one is done"
// lets only the last work request of each doorbell be signaled. Slots live in a ring of
// max_outstanding entries indexed by seq:
//
//   delivered_seq_ <= completed_seq_ <= posted_seq_ <= next_seq_
//   [delivered, completed): done, waiting for Poll to hand them out
//   [completed, posted):    on the wire
//   [posted, next):         queued by Post, not yet given to the NIC (Flush, or the read depth)
//
// Thread: one at a time (the Channel contract).
class VerbsChannel final : public Channel {
 public:
  VerbsChannel(std::shared_ptr<Device> device, const ChannelOptions& options);
  ~VerbsChannel() override;

  // ---- setup (verbs_setup.cc) ----
  // rdma_cm: resolve, create the CQ and QP, connect with the token as private data.
  Status Connect(const Endpoint& rdma_endpoint, const wire::RdmaToken& token, Deadline deadline);
  uint32_t read_depth() const { return read_depth_; }

  // ---- data path (verbs_datapath.cc) ----
  Status Post(const Op& op) override;
  Status Flush() override;
  Result<size_t> Poll(std::span<Completion> out, std::chrono::milliseconds timeout) override;
  size_t outstanding() const override { return static_cast<size_t>(next_seq_ - delivered_seq_); }
  size_t max_outstanding() const override { return capacity_; }
  const char* kind() const override { return "verbs"; }
  std::string peer() const override { return peer_; }
  bool broken() const override { return !broken_.ok(); }
  ChannelStats stats() const override { return stats_; }
  int wait_fd() const override;

 private:
  struct Slot {
    uint64_t user_data = 0;
    uint64_t lease_id = 0;
    uint64_t offset = 0;
    uint64_t remote_addr = 0;
    void* local = nullptr;      // the caller's buffer
    uint64_t sge_addr = 0;      // what the NIC touches: `local`, or a bounce slot
    ibv_mr* temp_mr = nullptr;  // registered for this op alone
    Clock::time_point posted_at{};
    Status status;
    uint32_t lkey = 0;
    uint32_t rkey = 0;
    uint32_t length = 0;
    int32_t bounce = -1;  // bounce slot index, or -1
    OpType type = OpType::kRead;
  };
  static constexpr uint64_t kDrainWrId = ~uint64_t{0};

  // setup (verbs_setup.cc)
  Result<rdma_cm_event_type> WaitCmEvent(rdma_cm_event_type want, Deadline deadline);
  Status EnsureBounceBuffer();
  void DestroyVerbsObjects();

  // data path (verbs_datapath.cc)
  Slot& slot(uint64_t seq) { return slots_[seq % capacity_]; }
  Status ResolveLocal(const Op& op, Slot& s);
  Status PostPending();
  int Reap();  // CQEs handled
  void CompleteThrough(uint64_t end);
  void FinishSlot(Slot& s, bool posted, bool ok);
  void Break(Status why);
  void DrainAfterError();
  size_t Deliver(std::span<Completion> out);
  Status CompletionError(const ibv_wc& wc, const Slot& s) const;
  void HandleCmEvents();
  void TakeCqEvent();
  bool ArmCq();

  std::shared_ptr<Device> device_;
  ChannelOptions options_;
  std::string peer_;
  size_t capacity_ = 0;

  rdma_event_channel* ec_ = nullptr;
  rdma_cm_id* id_ = nullptr;
  ibv_comp_channel* comp_channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  uint32_t read_depth_ = 1;
  unsigned unacked_cq_events_ = 0;
  bool armed_ = false;    // a CQ notification is requested or delivered but not yet taken
  bool closing_ = false;  // in the destructor: nobody will read what is left in bounce slots

  std::vector<Slot> slots_;
  std::vector<ibv_send_wr> wrs_;
  std::vector<ibv_sge> sges_;
  uint64_t next_seq_ = 0, posted_seq_ = 0, completed_seq_ = 0, delivered_seq_ = 0;
  uint32_t reads_in_flight_ = 0;
  std::chrono::nanoseconds latency_ewma_{0};

  // Bounce buffer for unregistered memory: capacity_ slots of bounce_slot_bytes.
  uint8_t* bounce_buf_ = nullptr;
  ibv_mr* bounce_mr_ = nullptr;
  std::vector<int32_t> bounce_free_;

  Status broken_;
  ChannelStats stats_;
};

}  // namespace farmem::transport::verbs
