#include "offload.h"

#include <fmt/format.h>

#include <cstring>

#include "farmem/common/wire_gather.h"
#include "farmem/ec/crc32c.h"
#include "server.h"

namespace farmem::daemon {

Offload::Offload(Server* server, const wire::ClientId& client_id, std::string identity,
                 const wire::ClientId& owner, std::string client_name)
    : server_(server),
      client_id_(client_id),
      identity_(std::move(identity)),
      owner_(owner),
      client_name_(std::move(client_name)) {}

Offload::~Offload() = default;

Status Offload::ParityEncode(const wire::ParityEncodeRequest& req,
                             std::vector<uint8_t>* /*reply: none*/) {
  SlabPool& pool = server_->pool();
  const uint32_t len = req.length;
  // The target is checked before anything is read: a cell we could not store is not computed.
  {
    Result<Pin> pin = pool.Acquire(req.lease_id, owner_, req.offset, len);
    if (!pin.has_value()) return pin.error().WithContext("PARITY_ENCODE target");
  }
  auto& codec = codecs_[{req.k, req.r}];
  if (codec == nullptr) {
    Result<std::unique_ptr<ec::ReedSolomon>> c = ec::ReedSolomon::Create(req.k, req.r);
    if (!c.has_value()) {
      codecs_.erase({req.k, req.r});
      return c.error();
    }
    codec = std::move(*c);
  }
  PeerReader& peers = Peers();
  const Deadline deadline = DeadlineIn(std::chrono::milliseconds(req.timeout_ms));
  Status s = peers.Start(req.sources, len, deadline);
  if (!s.ok()) return Unavailable("PARITY_ENCODE source: " + s.message());
  // Accumulate parity as each data cell arrives (ec_encode_data_update, one row): parity
  // starts at zero and every data fragment contributes coefficient * cell.
  parity_.assign(len, 0);
  if (cells_.size() < len) cells_.resize(len);
  for (size_t i = 0; i < req.sources.size(); ++i) {
    s = peers.Finish(i, cells_.data(), deadline);
    if (!s.ok()) {
      peers.Abandon();
      const wire::PeerCell& c = req.sources[i];
      return Unavailable(fmt::format("PARITY_ENCODE source {} (lease {} at offset {} on {}): {}", i,
                                     c.lease_id, c.offset, Endpoint{c.host, c.port}.ToString(),
                                     s.message()));
    }
    FARMEM_RETURN_IF_ERROR(codec->UpdateParityFragmentWithDelta(
        static_cast<int>(i), req.parity_index, cells_.data(), parity_.data(), len));
  }
  // Stored only once complete: a failed request leaves the old cell as it was.
  Result<Pin> pin = pool.Acquire(req.lease_id, owner_, req.offset, len);
  if (!pin.has_value()) return pin.error().WithContext("PARITY_ENCODE target");
  std::memcpy(pin->data() + req.offset, parity_.data(), len);
  pin->Reset();
  server_->counters().ops.fetch_add(1, std::memory_order_relaxed);
  server_->counters().bytes_written.fetch_add(len, std::memory_order_relaxed);
  server_->counters().request_bytes[static_cast<size_t>(wire::Opcode::kParityEncode)].fetch_add(
      len, std::memory_order_relaxed);
  return Status::Ok();
}

PeerReader& Offload::Peers() {
  if (peers_ == nullptr) {
    peers_ = std::make_unique<PeerReader>(server_->Secrets(), identity_, client_id_,
                                          fmt::format("farmemd offload for {}", client_name_));
  }
  return *peers_;
}

Status Offload::GatherCell(const wire::GatherCellRequest& req, std::vector<uint8_t>* reply) {
  SlabPool& pool = server_->pool();
  const uint32_t len = req.length;
  {
    Result<Pin> pin = pool.Acquire(req.lease_id, owner_, req.offset, len);
    if (!pin.has_value()) return pin.error().WithContext("GATHER_CELL target");
  }
  const size_t n = req.sources.size();
  if (cells_.size() < n * len) cells_.resize(n * len);
  wire::GatherCellReply out;
  out.source_crcs.reserve(n);
  if (n > 0) {
    PeerReader& peers = Peers();
    const Deadline deadline = DeadlineIn(std::chrono::milliseconds(req.timeout_ms));
    Status s = peers.Start(req.sources, len, deadline);
    if (!s.ok()) return Unavailable("GATHER_CELL source: " + s.message());
    for (size_t i = 0; i < n; ++i) {
      s = peers.Finish(i, cells_.data() + i * len, deadline);
      if (!s.ok()) {
        peers.Abandon();
        const wire::PeerCell& c = req.sources[i];
        return Unavailable(fmt::format("GATHER_CELL source {} (lease {} at offset {} on {}): {}", i,
                                       c.lease_id, c.offset, Endpoint{c.host, c.port}.ToString(),
                                       s.message()));
      }
      out.source_crcs.push_back(ec::Crc32c({cells_.data() + i * len, len}));
    }
  }
  parity_.assign(len, 0);
  for (const wire::GatherCopy& c : req.copies) {  // bounds checked by DecodeGatherCell
    std::memcpy(parity_.data() + c.dst_offset,
                cells_.data() + size_t{c.source} * len + c.src_offset, c.length);
  }
  Result<Pin> pin = pool.Acquire(req.lease_id, owner_, req.offset, len);
  if (!pin.has_value()) return pin.error().WithContext("GATHER_CELL target");
  std::memcpy(pin->data() + req.offset, parity_.data(), len);
  pin->Reset();
  out.cell_crc = ec::Crc32c({parity_.data(), len});
  wire::EncodeGatherCellReply(out, reply);
  server_->counters().ops.fetch_add(1, std::memory_order_relaxed);
  server_->counters().bytes_written.fetch_add(len, std::memory_order_relaxed);
  server_->counters().request_bytes[static_cast<size_t>(wire::Opcode::kGatherCell)].fetch_add(
      len, std::memory_order_relaxed);
  return Status::Ok();
}

}  // namespace farmem::daemon
