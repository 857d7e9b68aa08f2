// libFuzzer target: every parser of untrusted frame bytes in common/wire.h.
//
// The input is read two ways, so every decoder is reached whatever the mutator does:
//  1. as a stream of frames, the way farmemd and the transport read a socket: DecodeHeader, then
//     the body decoder for that opcode and direction (request, reply, push, error reply);
//  2. as one body for one decoder: the first byte picks the decoder, the rest is the body.
// Beyond "no crash, no UB, no leak" (ASan/UBSan), every successful decode must satisfy what
// docs/wire-protocol.md promises (limits, printable names) and survive a re-encode unchanged;
// a violation traps.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "farmem/common/wire.h"
#include "fuzz_check.h"

namespace farmem::wire {
namespace {

using Bytes = std::span<const uint8_t>;

bool Printable(const std::string& s) {
  for (char c : s) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

void CheckHeader(Bytes in, const FrameHeader& h, uint32_t max_body) {
  FUZZ_CHECK(h.version == kVersion);
  FUZZ_CHECK((h.flags & ~kKnownFlags) == 0);
  FUZZ_CHECK(h.body_len <= max_body);
  // The header is canonical: encoding what was decoded gives back the same 24 bytes.
  uint8_t again[kHeaderSize];
  EncodeHeader(h, again);
  FUZZ_CHECK(std::memcmp(again, in.data(), kHeaderSize) == 0);
}

void Hello(Bytes body) {
  auto d = DecodeHello(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(d->min_version <= d->max_version);
  FUZZ_CHECK(d->client_name.size() <= kMaxClientName);
  FUZZ_CHECK(Printable(d->client_name));
  std::vector<uint8_t> out;
  EncodeHello(*d, &out);
  FUZZ_CHECK(out.size() == body.size());
  auto e = DecodeHello(out);
  FUZZ_CHECK(e.has_value());
  FUZZ_CHECK(e->client_id == d->client_id && e->client_nonce == d->client_nonce);
  FUZZ_CHECK(e->client_name == d->client_name);
  FUZZ_CHECK(e->min_version == d->min_version && e->max_version == d->max_version);
  // The identity trailer: absent, or 1..kMaxIdentity bytes, and it survives re-encoding.
  FUZZ_CHECK(d->identity.size() <= kMaxIdentity);
  FUZZ_CHECK(e->identity == d->identity);
}

void HelloReplyBody(Bytes body) {
  auto d = DecodeHelloReply(body);
  if (!d.has_value()) return;
  std::vector<uint8_t> out;
  EncodeHelloReply(*d, &out);
  FUZZ_CHECK(out.size() <= body.size());
  auto e = DecodeHelloReply(out);
  FUZZ_CHECK(e.has_value());
  FUZZ_CHECK(e->version == d->version && e->features == d->features);
  FUZZ_CHECK(e->node_id == d->node_id && e->server_nonce == d->server_nonce);
  FUZZ_CHECK(e->daemon_version == d->daemon_version);
  FUZZ_CHECK(d->daemon_version.size() <= kMaxVersionString && Printable(d->daemon_version));
}

void Auth(Bytes body) {
  auto d = DecodeAuth(body);
  if (d.has_value()) {
    std::vector<uint8_t> out;
    EncodeAuth(*d, &out);
    FUZZ_CHECK(out.size() == body.size() && std::memcmp(out.data(), body.data(), kMacSize) == 0);
  }
  auto r = DecodeAuthReply(body);
  if (r.has_value()) {
    std::vector<uint8_t> out;
    EncodeAuthReply(*r, &out);
    FUZZ_CHECK(out.size() == body.size() && std::memcmp(out.data(), body.data(), kMacSize) == 0);
  }
  // Exactly the proof always decodes; more only as the proof and a 1..128-byte version trailer.
  if (body.size() == kMacSize) FUZZ_CHECK(d.has_value());
  if (d.has_value()) {
    FUZZ_CHECK(body.size() == kMacSize || body.size() == kMacSize + 2 + d->client_version.size());
    FUZZ_CHECK(d->client_version.size() <= kMaxVersionString && Printable(d->client_version));
  }
}

void Stat(Bytes body) {
  auto d = DecodeStatReply(body);
  if (!d.has_value()) return;
  std::vector<uint8_t> out;
  EncodeStatReply(*d, &out);
  FUZZ_CHECK(out.size() <= body.size());
  auto e = DecodeStatReply(out);
  FUZZ_CHECK(e.has_value());
  FUZZ_CHECK(e->node_id == d->node_id && e->capacity == d->capacity &&
             e->slab_size == d->slab_size && e->total_slabs == d->total_slabs &&
             e->free_slabs == d->free_slabs && e->clients == d->clients &&
             e->features == d->features && e->ops == d->ops && e->bytes_read == d->bytes_read &&
             e->bytes_written == d->bytes_written && e->rdma_port == d->rdma_port &&
             e->client_free_slabs == d->client_free_slabs &&
             e->client_max_slabs == d->client_max_slabs);
}

void Alloc(Bytes body) {
  auto d = DecodeAlloc(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(d->count >= 1 && d->count <= kMaxLeasesPerCall);
  FUZZ_CHECK(body.size() == 8);
  std::vector<uint8_t> out;
  EncodeAlloc(*d, &out);
  auto e = DecodeAlloc(out);
  FUZZ_CHECK(e.has_value() && e->count == d->count);
}

void AllocReplyBody(Bytes body) {
  auto d = DecodeAllocReply(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(d->leases.size() <= kMaxLeasesPerCall);
  FUZZ_CHECK(body.size() == 8 + d->leases.size() * kLeaseGrantSize);
  std::vector<uint8_t> out;
  EncodeAllocReply(*d, &out);
  FUZZ_CHECK(out.size() == body.size());
  auto e = DecodeAllocReply(out);
  FUZZ_CHECK(e.has_value() && e->leases.size() == d->leases.size());
  for (size_t i = 0; i < d->leases.size(); ++i) {
    FUZZ_CHECK(e->leases[i].lease_id == d->leases[i].lease_id &&
               e->leases[i].length == d->leases[i].length &&
               e->leases[i].remote_addr == d->leases[i].remote_addr &&
               e->leases[i].rkey == d->leases[i].rkey);
  }
}

void Free(Bytes body) {
  auto d = DecodeFree(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(d->lease_ids.size() <= kMaxLeasesPerCall);
  FUZZ_CHECK(body.size() == 8 + 8 * d->lease_ids.size());
  std::vector<uint8_t> out;
  EncodeFree(*d, &out);
  auto e = DecodeFree(out);
  FUZZ_CHECK(e.has_value() && e->lease_ids == d->lease_ids);
  // What the daemon does with the ids: slab and epoch split without loss.
  for (uint64_t id : d->lease_ids) FUZZ_CHECK(MakeLeaseId(LeaseEpoch(id), LeaseSlab(id)) == id);
}

void Heartbeat(Bytes body) {
  auto d = DecodeHeartbeatReply(body);
  if (!d.has_value()) return;
  std::vector<uint8_t> out;
  EncodeHeartbeatReply(*d, &out);
  auto e = DecodeHeartbeatReply(out);
  FUZZ_CHECK(e.has_value() && e->leases_held == d->leases_held &&
             e->lease_ttl_ms == d->lease_ttl_ms && e->noticed == d->noticed);
  FUZZ_CHECK(d->noticed.size() <= kMaxLeasesPerCall);
}

void Evict(Bytes body) {
  auto d = DecodeEvictNotice(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(d->lease_ids.size() <= kMaxLeasesPerCall);
  FUZZ_CHECK(body.size() == 16 + 8 * d->lease_ids.size());
  std::vector<uint8_t> out;
  EncodeEvictNotice(*d, &out);
  auto e = DecodeEvictNotice(out);
  FUZZ_CHECK(e.has_value() && e->grace_ms == d->grace_ms && e->lease_ids == d->lease_ids);
}

void Drain(Bytes body, bool reply) {
  std::vector<uint8_t> out;
  if (reply) {
    auto d = DecodeDrainReply(body);
    if (!d.has_value()) return;
    EncodeDrainReply(*d, &out);
    auto e = DecodeDrainReply(out);
    FUZZ_CHECK(e.has_value() && e->leases_noticed == d->leases_noticed &&
               e->leases_held == d->leases_held);
    return;
  }
  auto d = DecodeDrain(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(body.size() == 8);
  EncodeDrain(*d, &out);
  auto e = DecodeDrain(out);
  FUZZ_CHECK(e.has_value() && e->drain == d->drain && e->grace_ms == d->grace_ms);
}

// The overflow-free range check agrees with exact 128-bit arithmetic.
void Range(uint64_t offset, uint64_t length, uint64_t limit) {
  const unsigned __int128 end = static_cast<unsigned __int128>(offset) + length;
  FUZZ_CHECK(RangeFits(offset, length, limit) == (end <= limit));
}

void Data(Bytes body) {
  auto d = DecodeDataOp(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(d->length >= 1 && d->length <= kMaxDataLen);
  uint8_t out[kDataOpSize];
  EncodeDataOp(*d, out);
  FUZZ_CHECK(std::memcmp(out, body.data(), kDataOpSize) == 0);
  for (uint64_t limit :
       {uint64_t{0}, uint64_t{4096}, uint64_t{64} << 20, ~uint64_t{0}, d->lease_id}) {
    Range(d->offset, d->length, limit);
  }
  Range(d->offset, d->lease_id, ~uint64_t{0} - d->length);
}

void Batch(Bytes body, uint32_t body_len) {
  auto d = DecodeBatch(body, body_len);
  if (!d.has_value()) return;
  const size_t n = d->ops.size();
  FUZZ_CHECK(n >= 1 && n <= kMaxOpsPerBatch);
  FUZZ_CHECK(d->payload_offset == 8 + n * kBatchOpSize);
  FUZZ_CHECK(d->payload_offset <= body.size());
  FUZZ_CHECK(d->write_bytes <= kMaxDataLen && d->read_bytes <= kMaxDataLen);
  FUZZ_CHECK(d->payload_offset + d->write_bytes == body_len);
  uint64_t writes = 0, reads = 0;
  std::vector<uint8_t> table;
  Writer w(&table);
  w.U32(static_cast<uint32_t>(n));
  w.U32(0);
  for (const BatchOp& op : d->ops) {
    FUZZ_CHECK(op.op == Opcode::kRead || op.op == Opcode::kWrite);
    FUZZ_CHECK(op.length >= 1 && op.length <= kMaxDataLen);
    (op.op == Opcode::kWrite ? writes : reads) += op.length;
    const size_t at = table.size();
    table.resize(at + kBatchOpSize);
    EncodeBatchOp(op, table.data() + at);
    Range(op.offset, op.length, uint64_t{1} << 20);
  }
  FUZZ_CHECK(writes == d->write_bytes && reads == d->read_bytes);
  auto e = DecodeBatch(table, body_len);
  FUZZ_CHECK(e.has_value() && e->ops.size() == n && e->write_bytes == d->write_bytes);
  for (size_t i = 0; i < n; ++i) {
    FUZZ_CHECK(e->ops[i].op == d->ops[i].op && e->ops[i].length == d->ops[i].length &&
               e->ops[i].lease_id == d->ops[i].lease_id && e->ops[i].offset == d->ops[i].offset);
  }
}

// A BATCH reply as the transport reads it: the status table for the count it claims.
void BatchReplyBody(Bytes body) {
  Reader r(body);
  const uint32_t count = r.U32();
  if (!r.ok() || count == 0 || count > kMaxOpsPerBatch) return;
  const size_t table = BatchReplyTableSize(count);
  std::vector<uint16_t> codes(count);
  const Status s = DecodeBatchReplyTable(body.first(std::min(table, body.size())), codes);
  FUZZ_CHECK(s.ok() == (body.size() >= table));
  if (!s.ok()) return;
  std::vector<uint8_t> out(table);
  EncodeBatchReplyTable(count, out.data());
  for (size_t i = 0; i < count; ++i) SetBatchReplyStatus(out.data(), i, codes[i]);
  std::vector<uint16_t> again(count);
  FUZZ_CHECK(DecodeBatchReplyTable(out, again).ok() && again == codes);
}

void ErrorBody(uint16_t status, Bytes body) {
  const Status s = DecodeError(status, body);
  FUZZ_CHECK(!s.ok());
  FUZZ_CHECK(s.message().size() <= kMaxErrorMessage);
  FUZZ_CHECK(Printable(s.message()));
  FUZZ_CHECK(static_cast<uint16_t>(s.code()) <=
             static_cast<uint16_t>(StatusCode::kRemoteAccessError));
  std::vector<uint8_t> out;
  EncodeError(s, &out);
  FUZZ_CHECK(DecodeError(static_cast<uint16_t>(s.code()), out).message() == s.message());
}

void RdmaTokenReplyBody(Bytes body) {
  auto d = DecodeRdmaTokenReply(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(d->rdma_port != 0);
  std::vector<uint8_t> out;
  EncodeRdmaTokenReply(*d, &out);
  FUZZ_CHECK(out.size() <= body.size());
  auto e = DecodeRdmaTokenReply(out);
  FUZZ_CHECK(e.has_value() && e->token == d->token && e->rdma_port == d->rdma_port &&
             e->valid_ms == d->valid_ms);
}

// rdma_cm private data: what a daemon reads from anyone who reaches its RDMA port, and what a
// client reads from a rejecting daemon.
void RdmaPrivateData(Bytes data) {
  auto token = DecodeRdmaConnectData(data);
  if (token.has_value()) {
    FUZZ_CHECK(data.size() >= kRdmaConnectDataSize);
    uint8_t out[kRdmaConnectDataSize];
    EncodeRdmaConnectData(*token, out);
    auto again = DecodeRdmaConnectData(out);
    FUZZ_CHECK(again.has_value() && *again == *token);
    FUZZ_CHECK(std::memcmp(out + 8, data.data() + 8, kRdmaTokenSize) == 0);
  }
  const StatusCode why = DecodeRdmaRejectData(data);
  FUZZ_CHECK(static_cast<uint16_t>(why) <= static_cast<uint16_t>(StatusCode::kRemoteAccessError));
  uint8_t out[kRdmaRejectDataSize];
  EncodeRdmaRejectData(why, out);
  FUZZ_CHECK(DecodeRdmaRejectData(out) == why);
}

bool HostOk(const std::string& h) {
  if (h.empty() || h.size() > kMaxPeerHost) return false;
  for (char c : h) {
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
          c == '-' || c == ':' || c == '_' || c == '%')) {
      return false;
    }
  }
  return true;
}

// PARITY_ENCODE: a farmemd dials the hosts it names, so they must be plain host names.
void ParityEncodeBody(Bytes body) {
  auto d = DecodeParityEncode(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(d->k >= 1 && d->r >= 1 && d->k + d->r <= kMaxParityFragments);
  FUZZ_CHECK(d->parity_index < d->r && d->sources.size() == d->k);
  FUZZ_CHECK(d->length >= 1 && d->length <= kMaxDataLen);
  FUZZ_CHECK(d->timeout_ms >= 1 && d->timeout_ms <= kMaxParityTimeoutMs);
  for (const PeerCell& c : d->sources) FUZZ_CHECK(HostOk(c.host) && c.port != 0);
  std::vector<uint8_t> out;
  EncodeParityEncode(*d, &out);
  FUZZ_CHECK(out.size() == body.size() && std::memcmp(out.data(), body.data(), out.size()) == 0);
}

// GATHER_CELL: every copy must stay inside the cells it names.
void GatherCellBody(Bytes body) {
  auto d = DecodeGatherCell(body);
  if (!d.has_value()) return;
  FUZZ_CHECK(d->length >= 1 && d->length <= kMaxDataLen);
  FUZZ_CHECK(d->sources.size() <= kMaxGatherSources);
  FUZZ_CHECK(uint64_t{d->sources.size()} * d->length <= kMaxGatherSourceBytes);
  for (const PeerCell& c : d->sources) FUZZ_CHECK(HostOk(c.host) && c.port != 0);
  for (const GatherCopy& c : d->copies) {
    FUZZ_CHECK(c.source < d->sources.size() && c.length >= 1);
    FUZZ_CHECK(uint64_t{c.src_offset} + c.length <= d->length);
    FUZZ_CHECK(uint64_t{c.dst_offset} + c.length <= d->length);
  }
  std::vector<uint8_t> out;
  EncodeGatherCell(*d, &out);
  FUZZ_CHECK(out.size() == body.size() && std::memcmp(out.data(), body.data(), out.size()) == 0);
}

// One frame's body, routed as the daemon (requests) or the transport (replies, pushes) would.
void Body(const FrameHeader& h, Bytes body) {
  if (h.status != 0) return ErrorBody(h.status, body);
  const bool reply = h.is_reply();
  switch (static_cast<Opcode>(h.opcode)) {
    case Opcode::kHello:
      return reply ? HelloReplyBody(body) : Hello(body);
    case Opcode::kAuth:
      return Auth(body);
    case Opcode::kStat:
      return Stat(body);
    case Opcode::kAlloc:
      return reply ? AllocReplyBody(body) : Alloc(body);
    case Opcode::kFree:
      return Free(body);
    case Opcode::kHeartbeat:
      return Heartbeat(body);
    case Opcode::kRead:
    case Opcode::kWrite:
      return Data(body);
    case Opcode::kBatch:
      return reply ? BatchReplyBody(body) : Batch(body, h.body_len);
    case Opcode::kEvictNotice:
      return Evict(body);
    case Opcode::kRdmaToken:
      return reply ? RdmaTokenReplyBody(body) : void();
    case Opcode::kParityEncode:
      return reply ? void() : ParityEncodeBody(body);
    case Opcode::kGatherCell:
      return reply ? void() : GatherCellBody(body);
    case Opcode::kDrain:
      return Drain(body, reply);
  }
  (void)OpcodeName(h.opcode);
}

// Reading 1: a stream of frames. Like the daemon, a BATCH is decoded as soon as its descriptor
// table is there, even if its payload is still missing.
void Stream(Bytes in) {
  while (in.size() >= kHeaderSize) {
    for (uint32_t max_body : {kMaxControlBodyLen, kMaxBodyLen}) {
      auto h = DecodeHeader(in, max_body);
      if (h.has_value()) CheckHeader(in, *h, max_body);
    }
    auto h = DecodeHeader(in);
    if (!h.has_value()) return;
    Bytes rest = in.subspan(kHeaderSize);
    const size_t have = std::min<size_t>(rest.size(), h->body_len);
    if (h->opcode == static_cast<uint8_t>(Opcode::kBatch) && h->status == 0) {
      Batch(rest.first(have), h->body_len);
    }
    if (have < h->body_len) return;  // the rest of the frame has not arrived
    Body(*h, rest.first(have));
    in = rest.subspan(have);
  }
  (void)DecodeHeader(in);  // a short tail: must fail cleanly
}

// Reading 2: one decoder over the rest of the input; the first byte's low nibble picks the
// decoder, its high nibble is a parameter where one is needed (for 15: 1 = PARITY_ENCODE,
// 2 = GATHER_CELL, else the range check).
void Direct(Bytes in) {
  if (in.empty()) return;
  const uint8_t which = in[0];
  Bytes body = in.subspan(1);
  switch (which % 16) {
    case 0:
      return Hello(body);
    case 1:
      return HelloReplyBody(body);
    case 2:
      return Auth(body);
    case 3:
      return Stat(body);
    case 4:
      return Alloc(body);
    case 5:
      return AllocReplyBody(body);
    case 6:
      return Free(body);
    case 7:
      return Heartbeat(body);
    case 8:
      return Evict(body);
    case 9:
      return Data(body);
    case 10:  // body_len as a frame would claim it: what is here, or up to 8 bytes more or less
      return Batch(body, static_cast<uint32_t>(body.size() + (which >> 4) - 8));
    case 11:
      return Batch(body, static_cast<uint32_t>(body.size()));
    case 12:
      return ErrorBody(static_cast<uint16_t>(which >> 4), body);
    case 13:
      return RdmaTokenReplyBody(body);
    case 14:
      return RdmaPrivateData(body);
    default: {
      if ((which >> 4) == 1) return ParityEncodeBody(body);
      if ((which >> 4) == 2) return GatherCellBody(body);
      Reader r(body);
      const uint64_t a = r.U64(), b = r.U64(), c = r.U64();
      return Range(a, b, c);
    }
  }
}

}  // namespace
}  // namespace farmem::wire

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> in(data, size);
  farmem::wire::Stream(in);
  farmem::wire::Direct(in);
  return 0;
}
