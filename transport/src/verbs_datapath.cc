// Data path of the verbs transport. Post() prepares a work request in its slot (no system call);
// Flush() hands every prepared one to the NIC as one linked list — one ibv_post_send, one
// doorbell — with only the last one signaled; Poll() reaps the completion queue, spinning for
// about the time an operation takes and then sleeping on the completion channel. Data moves
// between the NIC and the caller's registered buffers directly; only unregistered buffers are
// bounced (see verbs.h). Connection setup is in verbs_setup.cc.
#include <fmt/format.h>
#include <poll.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "verbs_channel.h"

namespace farmem::transport::verbs {

namespace {
const char* OpName(OpType t) { return t == OpType::kRead ? "READ" : "WRITE"; }
}  // namespace

Status VerbsChannel::Post(const Op& op) {
  if (!broken_.ok()) return broken_;
  if (op.length == 0 || op.length > wire::kMaxDataLen || op.local == nullptr) {
    return InvalidArgument(
        fmt::format("operation of {} bytes at {}: length must be 1 to {} with a buffer", op.length,
                    op.local, wire::kMaxDataLen));
  }
  if (outstanding() >= capacity_) {
    return ResourceExhausted(
        fmt::format("{} operations already outstanding on {}", outstanding(), peer_));
  }
  if (op.slab.remote_addr == 0) {
    return InvalidArgument(fmt::format(
        "lease {:#x} has no RDMA address: it was granted by a daemon that does not serve RDMA",
        op.slab.lease_id));
  }
  if (!wire::RangeFits(op.offset, op.length, op.slab.length)) {
    return OutOfRange(fmt::format("{} bytes at offset {} fall outside lease {:#x} of {} bytes",
                                  op.length, op.offset, op.slab.lease_id, op.slab.length));
  }
  Slot& s = slot(next_seq_);
  s.user_data = op.user_data;
  s.type = op.type;
  s.lease_id = op.slab.lease_id;
  s.offset = op.offset;
  s.remote_addr = op.slab.remote_addr + op.offset;
  s.rkey = op.slab.rkey;
  s.length = op.length;
  s.local = op.local;
  FARMEM_RETURN_IF_ERROR(ResolveLocal(op, s));
  s.status = Status();
  ++next_seq_;
  return Status::Ok();
}

// Which lkey and address the NIC uses for the op's local side.
Status VerbsChannel::ResolveLocal(const Op& op, Slot& s) {
  s.bounce = -1;
  s.temp_mr = nullptr;
  const auto* region = dynamic_cast<const Region*>(op.region);
  if (region != nullptr && region->device() == device_.get()) {
    if (!region->Contains(op.local, op.length)) {
      return InvalidArgument(
          fmt::format("{} bytes at {} are not inside the registered region {}+{}", op.length,
                      op.local, region->addr(), region->length()));
    }
    s.sge_addr = reinterpret_cast<uint64_t>(op.local);
    s.lkey = region->lkey();
    return Status::Ok();
  }
  const uint32_t slot_bytes = device_->options.bounce_slot_bytes;
  if (op.length <= slot_bytes) {
    FARMEM_RETURN_IF_ERROR(EnsureBounceBuffer());
    if (!bounce_free_.empty()) {  // one slot per outstanding op: never empty here
      s.bounce = bounce_free_.back();
      bounce_free_.pop_back();
      uint8_t* b = bounce_buf_ + size_t{static_cast<uint32_t>(s.bounce)} * slot_bytes;
      if (op.type == OpType::kWrite) std::memcpy(b, op.local, op.length);
      s.sge_addr = reinterpret_cast<uint64_t>(b);
      s.lkey = bounce_mr_->lkey;
      return Status::Ok();
    }
  }
  s.temp_mr = ibv_reg_mr(device_->pd, op.local, op.length, IBV_ACCESS_LOCAL_WRITE);
  if (s.temp_mr == nullptr) {
    return ErrnoStatus(StatusCode::kResourceExhausted,
                       fmt::format("registering an unregistered buffer of {} bytes", op.length),
                       errno);
  }
  s.sge_addr = reinterpret_cast<uint64_t>(op.local);
  s.lkey = s.temp_mr->lkey;
  return Status::Ok();
}

Status VerbsChannel::Flush() {
  if (!broken_.ok()) return broken_;
  return PostPending();
}

Status VerbsChannel::PostPending() {
  if (posted_seq_ == next_seq_) return Status::Ok();
  size_t n = 0;
  uint32_t reads = reads_in_flight_;
  const uint32_t signal_every = device_->options.signal_every;
  const auto now = Clock::now();
  while (posted_seq_ + n < next_seq_) {
    Slot& s = slot(posted_seq_ + n);
    if (s.type == OpType::kRead) {
      if (reads >= read_depth_) break;  // the daemon accepted no more READs in flight
      ++reads;
    }
    ibv_sge& sge = sges_[n];
    sge.addr = s.sge_addr;
    sge.length = s.length;
    sge.lkey = s.lkey;
    ibv_send_wr& wr = wrs_[n];
    wr = ibv_send_wr{};
    wr.wr_id = posted_seq_ + n;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = s.type == OpType::kRead ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = s.remote_addr;
    wr.wr.rdma.rkey = s.rkey;
    if (signal_every != 0 && (n + 1) % signal_every == 0) wr.send_flags = IBV_SEND_SIGNALED;
    if (n > 0) wrs_[n - 1].next = &wr;
    s.posted_at = now;
    ++n;
  }
  if (n == 0) return Status::Ok();
  wrs_[n - 1].send_flags = IBV_SEND_SIGNALED;  // completes everything before it too
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(qp_, wrs_.data(), &bad); rc != 0) {
    posted_seq_ += bad != nullptr ? static_cast<uint64_t>(bad - wrs_.data()) : 0;
    Break(ErrnoStatus(StatusCode::kUnavailable, fmt::format("ibv_post_send to {}", peer_), rc));
    return broken_;
  }
  posted_seq_ += n;
  reads_in_flight_ = reads;
  ++stats_.doorbells;
  if (!armed_) ArmCq();  // so that wait_fd() turns readable when the completion arrives
  return Status::Ok();
}

int VerbsChannel::Reap() {
  ibv_wc wc[32];
  const int n = ibv_poll_cq(cq_, 32, wc);
  if (n < 0) {
    Break(Internal(fmt::format("ibv_poll_cq on the channel to {} failed", peer_)));
    return 0;
  }
  for (int i = 0; i < n; ++i) {
    const uint64_t seq = wc[i].wr_id;
    if (seq == kDrainWrId || seq < completed_seq_ || seq >= posted_seq_) continue;
    if (wc[i].status == IBV_WC_SUCCESS) {
      const auto latency = Clock::now() - slot(seq).posted_at;
      latency_ewma_ = latency_ewma_.count() == 0 ? latency : (latency_ewma_ * 7 + latency) / 8;
      CompleteThrough(seq + 1);
      continue;
    }
    // RC completes in order: everything before the failed request succeeded. The QP is now in
    // error and flushes the rest.
    CompleteThrough(seq);
    Slot& s = slot(seq);
    s.status = CompletionError(wc[i], s);
    Status cause = s.status;
    FinishSlot(s, /*posted=*/true, /*ok=*/false);
    completed_seq_ = seq + 1;
    Break(std::move(cause));
  }
  return n;
}

void VerbsChannel::CompleteThrough(uint64_t end) {
  for (; completed_seq_ < end; ++completed_seq_) {
    FinishSlot(slot(completed_seq_), /*posted=*/true, /*ok=*/true);
  }
}

void VerbsChannel::FinishSlot(Slot& s, bool posted, bool ok) {
  if (posted && s.type == OpType::kRead && reads_in_flight_ > 0) --reads_in_flight_;
  if (s.bounce >= 0) {
    if (ok && s.type == OpType::kRead && !closing_) {
      std::memcpy(s.local,
                  bounce_buf_ +
                      size_t{static_cast<uint32_t>(s.bounce)} * device_->options.bounce_slot_bytes,
                  s.length);
    }
    bounce_free_.push_back(s.bounce);
    s.bounce = -1;
  }
  if (s.temp_mr != nullptr) {
    ibv_dereg_mr(s.temp_mr);
    s.temp_mr = nullptr;
  }
  if (ok) {
    ++stats_.ops;
    (s.type == OpType::kRead ? stats_.bytes_read : stats_.bytes_written) += s.length;
  }
}

// The channel can no longer be used: stop the NIC (QP to error), wait until it has let go of every
// posted request, then complete everything still outstanding with an error. Only after that do
// callers get their buffers back, so no late DMA can land in memory they reused.
void VerbsChannel::Break(Status why) {
  if (!broken_.ok()) return;
  // Ops that merely shared the queue pair with a failed one are aborted; a lost peer is
  // Unavailable.
  const StatusCode code = why.code() == StatusCode::kUnavailable ||
                                  why.code() == StatusCode::kDeadlineExceeded ||
                                  why.code() == StatusCode::kAborted
                              ? why.code()
                              : StatusCode::kAborted;
  broken_ = Status(code, fmt::format("RDMA channel to {} is broken: {}", peer_, why.message()));
  if (qp_ != nullptr) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    if (int rc = ibv_modify_qp(qp_, &attr, IBV_QP_STATE); rc != 0) {
      spdlog::warn("{}: moving the queue pair to the error state: {}", peer_, strerror(rc));
    }
    DrainAfterError();
  }
  for (uint64_t seq = completed_seq_; seq < next_seq_; ++seq) {
    Slot& s = slot(seq);
    s.status = broken_;
    FinishSlot(s, /*posted=*/false, /*ok=*/false);
  }
  completed_seq_ = posted_seq_ = next_seq_;
  reads_in_flight_ = 0;
}

void VerbsChannel::DrainAfterError() {
  if (completed_seq_ == posted_seq_) return;
  // A signaled request posted after the QP entered the error state completes (flushed) after all
  // earlier ones: when it shows up, the NIC is done with every buffer (ib_drain_sq does the same).
  ibv_send_wr wr{};
  wr.wr_id = kDrainWrId;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.num_sge = 0;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  const bool marker = ibv_post_send(qp_, &wr, &bad) == 0;
  const auto deadline =
      Clock::now() + (marker ? std::chrono::milliseconds(2000) : std::chrono::milliseconds(200));
  while (Clock::now() < deadline) {
    ibv_wc wc[32];
    const int n = ibv_poll_cq(cq_, 32, wc);
    if (n < 0) break;
    for (int i = 0; i < n; ++i) {
      const uint64_t seq = wc[i].wr_id;
      if (seq == kDrainWrId) return;
      // Requests that finished before the error keep their success.
      if (wc[i].status == IBV_WC_SUCCESS && seq >= completed_seq_ && seq < posted_seq_) {
        CompleteThrough(seq + 1);
      }
    }
    if (!marker && completed_seq_ == posted_seq_) return;
    if (n == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  spdlog::warn("{}: the queue pair did not flush in time after an error", peer_);
}

Status VerbsChannel::CompletionError(const ibv_wc& wc, const Slot& s) const {
  const std::string what = fmt::format("{}: RDMA {} of {} bytes at offset {} of lease {:#x}", peer_,
                                       OpName(s.type), s.length, s.offset, s.lease_id);
  switch (wc.status) {
    case IBV_WC_REM_ACCESS_ERR:
      return RemoteAccessError(
          what +
          " refused by the daemon's NIC (remote access error): the lease's memory region is gone "
          "(freed, expired or evicted) or belongs to another client");
    case IBV_WC_REM_INV_REQ_ERR:
      return RemoteAccessError(what + " refused by the daemon's NIC (remote invalid request)");
    case IBV_WC_REM_OP_ERR:
      return RemoteAccessError(what + " failed at the daemon's NIC (remote operation error)");
    case IBV_WC_RETRY_EXC_ERR:
      return Unavailable(what + ": no answer after " +
                         std::to_string(device_->options.retry_count) +
                         " retries (transport retry counter exceeded): the daemon or its host "
                         "is gone");
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return Unavailable(what + ": receiver not ready, retries exceeded");
    case IBV_WC_WR_FLUSH_ERR:
      return Unavailable(what + ": flushed: the queue pair is in the error state");
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
    case IBV_WC_LOC_LEN_ERR:
      return Internal(
          fmt::format("{}: the local buffer was refused ({}): not registered with "
                      "this transport?",
                      what, ibv_wc_status_str(wc.status)));
    default:
      return Unavailable(fmt::format("{}: {}", what, ibv_wc_status_str(wc.status)));
  }
}

size_t VerbsChannel::Deliver(std::span<Completion> out) {
  size_t n = 0;
  while (n < out.size() && delivered_seq_ < completed_seq_) {
    Slot& s = slot(delivered_seq_++);
    out[n].user_data = s.user_data;
    out[n].status = std::move(s.status);
    s.status = Status();
    ++n;
  }
  return n;
}

bool VerbsChannel::ArmCq() {
  if (ibv_req_notify_cq(cq_, 0) == 0) armed_ = true;
  return armed_;
}

void VerbsChannel::TakeCqEvent() {
  ibv_cq* cq = nullptr;
  void* context = nullptr;
  if (ibv_get_cq_event(comp_channel_, &cq, &context) != 0) return;  // none (non-blocking fd)
  armed_ = false;
  if (++unacked_cq_events_ >= 64) {
    ibv_ack_cq_events(cq_, unacked_cq_events_);
    unacked_cq_events_ = 0;
  }
}

void VerbsChannel::HandleCmEvents() {
  rdma_cm_event* ev = nullptr;
  while (rdma_get_cm_event(ec_, &ev) == 0) {
    const rdma_cm_event_type type = ev->event;
    rdma_ack_cm_event(ev);
    if (type == RDMA_CM_EVENT_DISCONNECTED) {
      Break(Unavailable(fmt::format(
          "{} closed the RDMA connection (the daemon stopped, or dropped this client)", peer_)));
    } else if (type == RDMA_CM_EVENT_DEVICE_REMOVAL) {
      Break(Unavailable("the RDMA device was removed"));
    }
  }
}

int VerbsChannel::wait_fd() const {
  return broken() || comp_channel_ == nullptr ? -1 : comp_channel_->fd;
}

Result<size_t> VerbsChannel::Poll(std::span<Completion> out, std::chrono::milliseconds timeout) {
  if (out.empty()) return size_t{0};
  size_t n = Deliver(out);
  if (n > 0 || completed_seq_ == posted_seq_) return n;  // done, or nothing on the wire

  // Spin for about as long as an operation takes (twice the recent average from posting to
  // completion, counted from when the oldest one was posted), then sleep.
  const auto& options = device_->options;
  const auto start = Clock::now();
  const auto give_up = start + timeout;
  auto spin_until = start + options.spin_min;
  if (latency_ewma_.count() > 0) {
    spin_until = std::max(spin_until, slot(completed_seq_).posted_at + 2 * latency_ewma_);
  }
  spin_until = std::min({spin_until, start + options.spin_max, give_up});
  do {
    Reap();
  } while (completed_seq_ == delivered_seq_ && Clock::now() < spin_until);

  while (completed_seq_ == delivered_seq_) {
    const auto now = Clock::now();
    const auto op_deadline = slot(completed_seq_).posted_at + options_.op_timeout;
    if (now >= op_deadline) {
      const Slot& s = slot(completed_seq_);
      Break(DeadlineExceeded(fmt::format(
          "an RDMA {} of {} bytes at offset {} of lease {:#x} did not complete within {} ms",
          OpName(s.type), s.length, s.offset, s.lease_id, options_.op_timeout.count())));
      break;
    }
    // Sleep on the completion channel: take a notification that already fired (it may be stale),
    // re-arm, and look once more, since a completion may have slipped in before the arming.
    if (armed_) TakeCqEvent();
    if (!armed_) {
      ArmCq();
      if (Reap() > 0) continue;
    }
    if (now >= give_up) return size_t{0};
    const auto wake = std::min(give_up, op_deadline);
    const int ms =
        static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(wake - now).count());
    pollfd fds[2] = {{comp_channel_->fd, POLLIN, 0}, {ec_->fd, POLLIN, 0}};
    if (::poll(fds, 2, std::max(ms, 1)) > 0) {
      if (fds[1].revents != 0) HandleCmEvents();
      if (fds[0].revents != 0) TakeCqEvent();
    }
    Reap();
  }
  // READs that waited for the negotiated read depth may go now.
  if (broken_.ok() && posted_seq_ < next_seq_) (void)PostPending();
  return Deliver(out);
}

}  // namespace farmem::transport::verbs
