// Setup side of the verbs transport: opening the device and its protection domain, registering
// memory, and connecting a channel (token over TCP, then rdma_cm resolve/route/connect, CQ and
// RC queue pair). The per-operation code is in verbs_datapath.cc.
#include "farmem/transport/verbs.h"

#ifdef FARMEM_HAVE_VERBS

#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "farmem/transport/tcp_connection.h"
#include "verbs_channel.h"

namespace farmem::transport {
namespace verbs {

namespace {

Status SetNonBlocking(int fd, const char* what) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoStatus(StatusCode::kInternal, fmt::format("making {} non-blocking", what), errno);
  }
  return Status::Ok();
}

int MillisLeft(Deadline deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

}  // namespace

Device::~Device() {
  if (pd != nullptr) ibv_dealloc_pd(pd);
}

Region::~Region() { ibv_dereg_mr(mr_); }

VerbsChannel::VerbsChannel(std::shared_ptr<Device> device, const ChannelOptions& options)
    : device_(std::move(device)), options_(options), peer_(options.endpoint.ToString()) {
  // One send-queue slot stays free for the work request that drains the queue after an error.
  const size_t limit =
      static_cast<size_t>(std::min(device_->attr.max_qp_wr, device_->attr.max_cqe)) - 2;
  capacity_ = std::clamp<size_t>(options.max_outstanding, 1, limit);
}

VerbsChannel::~VerbsChannel() {
  // Stops the NIC and releases per-op registrations before the caller's buffers go away.
  closing_ = true;
  if (broken_.ok() && completed_seq_ != next_seq_) {
    Break(Aborted(fmt::format("channel to {} closed with operations outstanding", peer_)));
  }
  DestroyVerbsObjects();
}

void VerbsChannel::DestroyVerbsObjects() {
  if (qp_ != nullptr) {
    rdma_disconnect(id_);  // QP to error, DREQ to the daemon (which then frees its side)
    rdma_destroy_qp(id_);
    qp_ = nullptr;
  }
  if (cq_ != nullptr) {
    if (unacked_cq_events_ > 0) ibv_ack_cq_events(cq_, unacked_cq_events_);
    ibv_destroy_cq(cq_);
    cq_ = nullptr;
  }
  if (comp_channel_ != nullptr) {
    ibv_destroy_comp_channel(comp_channel_);
    comp_channel_ = nullptr;
  }
  if (id_ != nullptr) {
    rdma_destroy_id(id_);
    id_ = nullptr;
  }
  if (ec_ != nullptr) {
    rdma_destroy_event_channel(ec_);
    ec_ = nullptr;
  }
  if (bounce_mr_ != nullptr) {
    ibv_dereg_mr(bounce_mr_);
    bounce_mr_ = nullptr;
  }
  std::free(bounce_buf_);
  bounce_buf_ = nullptr;
}

Result<rdma_cm_event_type> VerbsChannel::WaitCmEvent(rdma_cm_event_type want, Deadline deadline) {
  for (;;) {
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(ec_, &ev) != 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        return Err(ErrnoStatus(StatusCode::kUnavailable, "rdma_get_cm_event", errno));
      }
      const int left = MillisLeft(deadline);
      if (left == 0) {
        return Err(DeadlineExceeded(
            fmt::format("no {} from the RDMA connection manager in time", rdma_event_str(want))));
      }
      pollfd p{ec_->fd, POLLIN, 0};
      ::poll(&p, 1, left);
      continue;
    }
    const rdma_cm_event_type type = ev->event;
    const int status = ev->status;
    if (type == want) {
      rdma_ack_cm_event(ev);
      return type;
    }
    if (type == RDMA_CM_EVENT_REJECTED) {
      // status 28 is IB_CM_REJ_CONSUMER_DEFINED: the daemon said no and, in private data, why.
      StatusCode why = StatusCode::kInternal;
      if (ev->param.conn.private_data != nullptr) {
        why = wire::DecodeRdmaRejectData({static_cast<const uint8_t*>(ev->param.conn.private_data),
                                          ev->param.conn.private_data_len});
      }
      rdma_ack_cm_event(ev);
      if (why != StatusCode::kInternal) {
        return Err(Status(why, fmt::format("the daemon refused the RDMA connection ({}): see its "
                                           "log for the reason",
                                           StatusCodeName(why))));
      }
      return Err(Unavailable(fmt::format(
          "RDMA connection rejected (status {}): is a farmemd with --rdma listening there?",
          status)));
    }
    rdma_ack_cm_event(ev);
    switch (type) {
      case RDMA_CM_EVENT_ADDR_ERROR:
      case RDMA_CM_EVENT_ROUTE_ERROR:
      case RDMA_CM_EVENT_UNREACHABLE:
      case RDMA_CM_EVENT_CONNECT_ERROR:
      case RDMA_CM_EVENT_DISCONNECTED:
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        return Err(
            Unavailable(fmt::format("{} while waiting for {} (status {}: {})", rdma_event_str(type),
                                    rdma_event_str(want), status, strerror(std::abs(status)))));
      default:
        break;  // not for us (e.g. ADDR_CHANGE): keep waiting
    }
  }
}

Status VerbsChannel::Connect(const Endpoint& rdma_endpoint, const wire::RdmaToken& token,
                             Deadline deadline) {
  const std::string where = fmt::format("RDMA to {}", rdma_endpoint.ToString());
  ec_ = rdma_create_event_channel();
  if (ec_ == nullptr) {
    return ErrnoStatus(StatusCode::kUnavailable, "opening the RDMA connection manager", errno);
  }
  FARMEM_RETURN_IF_ERROR(SetNonBlocking(ec_->fd, "the rdma_cm channel"));
  if (rdma_create_id(ec_, &id_, this, RDMA_PS_TCP) != 0) {
    return ErrnoStatus(StatusCode::kUnavailable, "rdma_create_id", errno);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(rdma_endpoint.port);
  if (int rc = ::getaddrinfo(rdma_endpoint.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Unavailable(
        fmt::format("{}: cannot resolve {}: {}", where, rdma_endpoint.host, gai_strerror(rc)));
  }
  const int rrc = rdma_resolve_addr(id_, nullptr, res->ai_addr, std::max(1, MillisLeft(deadline)));
  const int rerr = errno;
  ::freeaddrinfo(res);
  if (rrc != 0) return ErrnoStatus(StatusCode::kUnavailable, where + ": rdma_resolve_addr", rerr);
  auto step = [&](rdma_cm_event_type want) -> Status {
    Result<rdma_cm_event_type> r = WaitCmEvent(want, deadline);
    return r.has_value() ? Status::Ok() : r.error().WithContext(where);
  };
  FARMEM_RETURN_IF_ERROR(step(RDMA_CM_EVENT_ADDR_RESOLVED));
  if (id_->verbs != device_->context) {
    return Unavailable(fmt::format(
        "{}: the route goes through RDMA device {}, but this transport uses {} (set "
        "VerbsOptions.device / FARMEM_RDMA_DEVICE)",
        where, id_->verbs ? ibv_get_device_name(id_->verbs->device) : "?", device_->name));
  }
  uint8_t ack_timeout = device_->options.ack_timeout;
  if (rdma_set_option(id_, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &ack_timeout,
                      sizeof(ack_timeout)) != 0) {
    spdlog::debug("{}: cannot set the ACK timeout: {}", where, strerror(errno));
  }
  if (rdma_resolve_route(id_, std::max(1, MillisLeft(deadline))) != 0) {
    return ErrnoStatus(StatusCode::kUnavailable, where + ": rdma_resolve_route", errno);
  }
  FARMEM_RETURN_IF_ERROR(step(RDMA_CM_EVENT_ROUTE_RESOLVED));

  comp_channel_ = ibv_create_comp_channel(device_->context);
  if (comp_channel_ == nullptr) {
    return ErrnoStatus(StatusCode::kResourceExhausted, "ibv_create_comp_channel", errno);
  }
  FARMEM_RETURN_IF_ERROR(SetNonBlocking(comp_channel_->fd, "the completion channel"));
  // Every posted work request may complete with an error (flush), plus the drain request.
  cq_ = ibv_create_cq(device_->context, static_cast<int>(capacity_ + 2), nullptr, comp_channel_, 0);
  if (cq_ == nullptr) return ErrnoStatus(StatusCode::kResourceExhausted, "ibv_create_cq", errno);
  ibv_qp_init_attr init{};
  init.send_cq = cq_;
  init.recv_cq = cq_;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signaling: the last request of each doorbell
  init.cap.max_send_wr = static_cast<uint32_t>(capacity_ + 1);
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  if (rdma_create_qp(id_, device_->pd, &init) != 0) {
    return ErrnoStatus(StatusCode::kResourceExhausted, "creating the RC queue pair", errno);
  }
  qp_ = id_->qp;

  uint8_t pdata[wire::kRdmaConnectDataSize];
  wire::EncodeRdmaConnectData(token, pdata);
  rdma_conn_param param{};
  param.private_data = pdata;
  param.private_data_len = sizeof(pdata);
  param.initiator_depth = static_cast<uint8_t>(std::clamp<int>(
      std::min<int>(device_->options.read_depth, device_->attr.max_qp_init_rd_atom), 1, 255));
  param.responder_resources = 0;  // the daemon never reads from us
  param.retry_count = std::min<uint8_t>(device_->options.retry_count, 7);
  param.rnr_retry_count = 7;
  param.flow_control = 1;
  if (rdma_connect(id_, &param) != 0) {
    return ErrnoStatus(StatusCode::kUnavailable, where + ": rdma_connect", errno);
  }
  FARMEM_RETURN_IF_ERROR(step(RDMA_CM_EVENT_ESTABLISHED));

  // The READ depth rdma_cm negotiated (what the daemon's side accepted) is in the QP.
  ibv_qp_attr attr{};
  ibv_qp_init_attr qinit{};
  if (ibv_query_qp(qp_, &attr, IBV_QP_MAX_QP_RD_ATOMIC, &qinit) != 0) {
    return ErrnoStatus(StatusCode::kInternal, "ibv_query_qp", errno);
  }
  if (attr.max_rd_atomic == 0) {
    return Unavailable(where + ": the daemon granted no RDMA READ depth");
  }
  read_depth_ = attr.max_rd_atomic;
  slots_.resize(capacity_);
  wrs_.resize(capacity_);
  sges_.resize(capacity_);
  spdlog::debug("{}: connected on {}, {} outstanding ops, read depth {}", where, device_->name,
                capacity_, read_depth_);
  return Status::Ok();
}

Status VerbsChannel::EnsureBounceBuffer() {
  if (bounce_mr_ != nullptr) return Status::Ok();
  const size_t slot_bytes = device_->options.bounce_slot_bytes;
  const size_t bytes = slot_bytes * capacity_;
  bounce_buf_ = static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
  if (bounce_buf_ == nullptr) return ResourceExhausted("allocating the bounce buffer");
  bounce_mr_ = ibv_reg_mr(device_->pd, bounce_buf_, bytes, IBV_ACCESS_LOCAL_WRITE);
  if (bounce_mr_ == nullptr) {
    const int err = errno;
    std::free(bounce_buf_);
    bounce_buf_ = nullptr;
    return ErrnoStatus(StatusCode::kResourceExhausted, "registering the bounce buffer", err);
  }
  bounce_free_.clear();
  for (size_t i = capacity_; i > 0; --i) bounce_free_.push_back(static_cast<int32_t>(i - 1));
  return Status::Ok();
}

namespace {

class VerbsTransport final : public Transport {
 public:
  explicit VerbsTransport(std::shared_ptr<Device> device) : device_(std::move(device)) {}
  const char* kind() const override { return "verbs"; }

  Result<std::unique_ptr<Channel>> OpenChannel(const ChannelOptions& options) override {
    const Deadline deadline = DeadlineIn(options.connect_timeout);
    const std::string daemon = fmt::format("farmemd {}", options.endpoint.ToString());
    // The token comes over an authenticated TCP connection, which is closed once it is used.
    wire::RdmaTokenReply token;
    {
      FARMEM_ASSIGN_OR_RETURN(TcpConnection conn, TcpConnection::Connect(options));
      if ((conn.hello().features & wire::kFeatureVerbs) == 0) {
        return Err(Unavailable(fmt::format(
            "{} does not serve RDMA (it runs with --rdma off, on a loopback address, or without "
            "an RDMA device): use the tcp transport",
            daemon)));
      }
      const auto left =
          std::max(std::chrono::milliseconds(1),
                   std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
      auto reply = conn.Call(wire::Opcode::kRdmaToken, {}, left);
      if (!reply.has_value()) return Err(reply.error().WithContext(daemon + ": RDMA_TOKEN"));
      FARMEM_ASSIGN_OR_RETURN(token, wire::DecodeRdmaTokenReply(*reply));
    }
    auto channel = std::make_unique<VerbsChannel>(device_, options);
    Status s =
        channel->Connect(Endpoint{options.endpoint.host, token.rdma_port}, token.token, deadline);
    if (!s.ok()) return Err(s.WithContext(daemon));
    return std::unique_ptr<Channel>(std::move(channel));
  }

  Result<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, size_t length) override {
    ibv_mr* mr = ibv_reg_mr(device_->pd, addr, length, IBV_ACCESS_LOCAL_WRITE);
    if (mr == nullptr) {
      return Err(ErrnoStatus(StatusCode::kResourceExhausted,
                             fmt::format("registering {} bytes at {} with {} (RLIMIT_MEMLOCK?)",
                                         length, addr, device_->name),
                             errno));
    }
    return std::unique_ptr<LocalRegion>(new Region(device_, mr));
  }

 private:
  std::shared_ptr<Device> device_;
};

}  // namespace

// Whether any port of the device is up (a device without a link is no use).
bool PortActive(ibv_context* ctx) {
  ibv_device_attr attr{};
  if (ibv_query_device(ctx, &attr) != 0) return false;
  for (uint8_t port = 1; port <= attr.phys_port_cnt; ++port) {
    ibv_port_attr pa{};
    if (ibv_query_port(ctx, port, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) return true;
  }
  return false;
}

}  // namespace verbs

Result<std::unique_ptr<Transport>> MakeVerbsTransport(const VerbsOptions& options) {
  std::string want = options.device;
  if (const char* env = std::getenv("FARMEM_RDMA_DEVICE"); want.empty() && env != nullptr) {
    want = env;
  }
  int n = 0;
  ibv_context** devices = rdma_get_devices(&n);
  if (devices == nullptr || n == 0) {
    if (devices != nullptr) rdma_free_devices(devices);
    return Err(Unavailable(
        "no RDMA device on this machine (for soft-RoCE: modprobe rdma_rxe && rdma link add rxe0 "
        "type rxe netdev <nic>; see docs/rdma.md)"));
  }
  ibv_context* chosen = nullptr;
  std::string names;
  for (int i = 0; i < n; ++i) {
    const std::string name = ibv_get_device_name(devices[i]->device);
    names += (names.empty() ? "" : ", ") + name;
    if (want.empty() ? verbs::PortActive(devices[i]) : name == want) {
      chosen = devices[i];
      break;
    }
  }
  rdma_free_devices(devices);
  if (chosen == nullptr) {
    return Err(Unavailable(want.empty()
                               ? fmt::format("no RDMA device has an active port ({})", names)
                               : fmt::format("no RDMA device {} (there are: {})", want, names)));
  }
  auto device = std::make_shared<verbs::Device>();
  device->context = chosen;
  device->options = options;
  device->name = ibv_get_device_name(chosen->device);
  if (ibv_query_device(chosen, &device->attr) != 0) {
    return Err(ErrnoStatus(StatusCode::kUnavailable, "ibv_query_device " + device->name, errno));
  }
  device->pd = ibv_alloc_pd(chosen);
  if (device->pd == nullptr) {
    return Err(ErrnoStatus(StatusCode::kResourceExhausted,
                           "allocating a protection domain on " + device->name, errno));
  }
  return std::unique_ptr<Transport>(new verbs::VerbsTransport(std::move(device)));
}

}  // namespace farmem::transport

#else  // !FARMEM_HAVE_VERBS

namespace farmem::transport {

Result<std::unique_ptr<Transport>> MakeVerbsTransport(const VerbsOptions&) {
  return Err(Unimplemented("farmem was built without the verbs transport (FARMEM_WITH_VERBS=OFF)"));
}

}  // namespace farmem::transport

#endif
