// The encoders and decoders of every frame body (docs/wire-protocol.md), the one implementation
// of the wire format. Over 600 lines on purpose: each frame's encoder and decoder stand next to
// each other, written out field by field, so that one file can be read against the protocol doc;
// splitting it by opcode would scatter the shared bounds checks.
#include "farmem/common/wire.h"

#include <fmt/format.h>

namespace farmem::wire {

const char* OpcodeName(uint8_t op) {
  switch (static_cast<Opcode>(op)) {
    case Opcode::kHello:
      return "HELLO";
    case Opcode::kAuth:
      return "AUTH";
    case Opcode::kStat:
      return "STAT";
    case Opcode::kAlloc:
      return "ALLOC";
    case Opcode::kFree:
      return "FREE";
    case Opcode::kHeartbeat:
      return "HEARTBEAT";
    case Opcode::kRead:
      return "READ";
    case Opcode::kWrite:
      return "WRITE";
    case Opcode::kBatch:
      return "BATCH";
    case Opcode::kEvictNotice:
      return "EVICT_NOTICE";
    case Opcode::kRdmaToken:
      return "RDMA_TOKEN";
    case Opcode::kParityEncode:
      return "PARITY_ENCODE";
    case Opcode::kGatherCell:
      return "GATHER_CELL";
    case Opcode::kDrain:
      return "DRAIN";
  }
  return "UNKNOWN";
}

namespace {

// Writer's fields into a fixed buffer the caller sized (the data path's frame headers and
// descriptors: encoding one allocates nothing, which farmem-nbd's swap safety needs).
class FixedWriter {
 public:
  explicit FixedWriter(uint8_t* out) : p_(out) {}
  void U8(uint8_t v) { *p_++ = v; }
  void U16(uint16_t v) { Put(&v, 2); }
  void U32(uint32_t v) { Put(&v, 4); }
  void U64(uint64_t v) { Put(&v, 8); }
  void Bytes(std::span<const uint8_t> b) { Put(b.data(), b.size()); }
  void Zeros(size_t n) {
    std::memset(p_, 0, n);
    p_ += n;
  }

 private:
  void Put(const void* p, size_t n) {  // little-endian, as Writer
    std::memcpy(p_, p, n);
    p_ += n;
  }
  uint8_t* p_;
};

}  // namespace

void EncodeHeader(const FrameHeader& h, uint8_t out[kHeaderSize]) {
  FixedWriter w(out);
  w.U32(kMagic);
  w.U8(h.version);
  w.U8(h.opcode);
  w.U16(h.flags);
  w.U64(h.request_id);
  w.U32(h.body_len);
  w.U16(h.status);
  w.U16(0);
}

Result<FrameHeader> DecodeHeader(std::span<const uint8_t> bytes, uint32_t max_body) {
  if (bytes.size() < kHeaderSize) {
    return Err(ProtocolError(
        fmt::format("frame header truncated: {} of {} bytes", bytes.size(), kHeaderSize)));
  }
  Reader r(bytes.first(kHeaderSize));
  const uint32_t magic = r.U32();
  FrameHeader h;
  h.version = r.U8();
  h.opcode = r.U8();
  h.flags = r.U16();
  h.request_id = r.U64();
  h.body_len = r.U32();
  h.status = r.U16();
  const uint16_t reserved = r.U16();
  if (magic != kMagic) {
    return Err(
        ProtocolError(fmt::format("bad frame magic {:#010x} (expected {:#010x}): not a "
                                  "farmem peer, or the stream is out of sync",
                                  magic, kMagic)));
  }
  if (h.version != kVersion) {
    return Err(ProtocolError(fmt::format("unsupported protocol version {} (this build speaks {})",
                                         h.version, kVersion)));
  }
  if (reserved != 0 || (h.flags & ~kKnownFlags) != 0) {
    return Err(ProtocolError(fmt::format(
        "reserved header bits set (flags {:#06x}, reserved {:#06x})", h.flags, reserved)));
  }
  if (h.body_len > max_body) {
    return Err(ResourceExhausted(fmt::format("{} frame body of {} bytes exceeds the limit of {}",
                                             OpcodeName(h.opcode), h.body_len, max_body)));
  }
  return h;
}

namespace {

Status Malformed(const char* what, std::span<const uint8_t> body) {
  return ProtocolError(fmt::format("malformed {} body ({} bytes)", what, body.size()));
}

template <size_t N>
void ReadArray(Reader& r, std::array<uint8_t, N>* out) {
  auto b = r.Bytes(N);
  if (b.size() == N) std::memcpy(out->data(), b.data(), N);
}

// A version string field (STAT and HELLO replies, AUTH): `version_len u16, version`, at most
// kMaxVersionString bytes (longer strings are cut).
void PutVersion(Writer& w, std::string_view v) {
  const size_t n = std::min(v.size(), kMaxVersionString);
  w.U16(static_cast<uint16_t>(n));
  w.Bytes({reinterpret_cast<const uint8_t*>(v.data()), n});
}

// False when the length is over kMaxVersionString or the bytes are not all there. For display,
// anything but printable ASCII becomes '?'.
bool GetVersion(Reader& r, std::string* out) {
  const uint16_t n = r.U16();
  if (n > kMaxVersionString) return false;
  std::span<const uint8_t> v = r.Bytes(n);
  if (!r.ok()) return false;
  out->clear();
  out->reserve(n);
  for (uint8_t c : v) *out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  return true;
}

}  // namespace

std::optional<uint32_t> VersionMajor(std::string_view version) {
  uint32_t major = 0;
  size_t i = 0;
  for (; i < version.size() && i < 9 && version[i] >= '0' && version[i] <= '9'; ++i) {
    major = major * 10 + static_cast<uint32_t>(version[i] - '0');
  }
  if (i == 0) return std::nullopt;
  return major;
}

void EncodeHello(const HelloRequest& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U8(m.min_version);
  w.U8(m.max_version);
  w.U16(static_cast<uint16_t>(std::min(m.client_name.size(), kMaxClientName)));
  w.Bytes(m.client_id);
  w.Bytes(m.client_nonce);
  w.Bytes({reinterpret_cast<const uint8_t*>(m.client_name.data()),
           std::min(m.client_name.size(), kMaxClientName)});
  if (!m.identity.empty()) {  // optional trailer: u8 length, then the name
    const size_t n = std::min(m.identity.size(), kMaxIdentity);
    w.U8(static_cast<uint8_t>(n));
    w.Bytes({reinterpret_cast<const uint8_t*>(m.identity.data()), n});
  }
}

Result<HelloRequest> DecodeHello(std::span<const uint8_t> body) {
  Reader r(body);
  HelloRequest m;
  m.min_version = r.U8();
  m.max_version = r.U8();
  const uint16_t name_len = r.U16();
  ReadArray(r, &m.client_id);
  ReadArray(r, &m.client_nonce);
  if (!r.ok() || name_len > kMaxClientName || r.remaining() < name_len) {
    return Err(Malformed("HELLO", body));
  }
  auto name = r.Bytes(name_len);
  m.client_name.assign(reinterpret_cast<const char*>(name.data()), name.size());
  for (char& c : m.client_name) {
    if (c < 0x20 || c > 0x7e) c = '?';  // names end up in logs
  }
  if (r.remaining() > 0) {  // the identity trailer: u8 length (1..kMaxIdentity), the name
    const uint8_t id_len = r.U8();
    if (id_len == 0 || id_len > kMaxIdentity || r.remaining() != id_len) {
      return Err(Malformed("HELLO", body));
    }
    auto id = r.Bytes(id_len);
    m.identity.assign(reinterpret_cast<const char*>(id.data()), id.size());
  }
  if (m.min_version > m.max_version) {
    return Err(ProtocolError(
        fmt::format("HELLO version range {}..{} is empty", m.min_version, m.max_version)));
  }
  return m;
}

void EncodeHelloReply(const HelloReply& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U8(m.version);
  w.Zeros(3);
  w.U32(m.features);
  w.U64(m.node_id);
  w.Bytes(m.server_nonce);
  if ((m.features & kFeatureVersion) != 0) PutVersion(w, m.daemon_version);
}

Result<HelloReply> DecodeHelloReply(std::span<const uint8_t> body) {
  Reader r(body);
  HelloReply m;
  m.version = r.U8();
  r.Skip(3);
  m.features = r.U32();
  m.node_id = r.U64();
  ReadArray(r, &m.server_nonce);
  if (!r.ok()) return Err(Malformed("HELLO reply", body));
  // Trailers, in the order of their feature bits; bytes past those this build knows are ignored.
  if ((m.features & kFeatureVersion) != 0 && !GetVersion(r, &m.daemon_version)) {
    return Err(Malformed("HELLO reply", body));
  }
  return m;
}

void EncodeAuth(const AuthRequest& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.Bytes(m.client_mac);
  if (!m.client_version.empty()) PutVersion(w, m.client_version);  // optional trailer
}

Result<AuthRequest> DecodeAuth(std::span<const uint8_t> body) {
  Reader r(body);
  AuthRequest m;
  ReadArray(r, &m.client_mac);
  if (!r.ok()) return Err(Malformed("AUTH", body));
  // The version trailer, if any: 1..kMaxVersionString bytes that end the body exactly.
  if (r.remaining() > 0 &&
      (!GetVersion(r, &m.client_version) || m.client_version.empty() || r.remaining() != 0)) {
    return Err(Malformed("AUTH", body));
  }
  return m;
}

void EncodeAuthReply(const AuthReply& m, std::vector<uint8_t>* out) {
  Writer(out).Bytes(m.server_mac);
}

Result<AuthReply> DecodeAuthReply(std::span<const uint8_t> body) {
  if (body.size() != kMacSize) return Err(Malformed("AUTH reply", body));
  AuthReply m;
  std::memcpy(m.server_mac.data(), body.data(), kMacSize);
  return m;
}

void EncodeStatReply(const StatReply& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U64(m.node_id);
  w.U64(m.capacity);
  w.U64(m.slab_size);
  w.U32(m.total_slabs);
  w.U32(m.free_slabs);
  w.U32(m.clients);
  w.U32(m.features);
  w.U64(m.ops);
  w.U64(m.bytes_read);
  w.U64(m.bytes_written);
  w.U16(m.rdma_port);
  w.Zeros(6);
  if ((m.features & kFeatureClientShare) != 0) {
    w.U32(m.client_free_slabs);
    w.U32(m.client_max_slabs);
  }
  if ((m.features & kFeatureVersion) != 0) PutVersion(w, m.version);
}

// Newer daemons may append fields: anything past what this build knows is ignored.
Result<StatReply> DecodeStatReply(std::span<const uint8_t> body) {
  Reader r(body);
  StatReply m;
  m.node_id = r.U64();
  m.capacity = r.U64();
  m.slab_size = r.U64();
  m.total_slabs = r.U32();
  m.free_slabs = r.U32();
  m.clients = r.U32();
  m.features = r.U32();
  m.ops = r.U64();
  m.bytes_read = r.U64();
  m.bytes_written = r.U64();
  m.rdma_port = r.U16();
  r.Skip(6);
  if (!r.ok()) return Err(Malformed("STAT reply", body));
  // Appended later: a daemon that predates them sends none (and no kFeatureClientShare).
  if ((m.features & kFeatureClientShare) != 0) {
    m.client_free_slabs = r.U32();
    m.client_max_slabs = r.U32();
    if (!r.ok()) return Err(Malformed("STAT reply", body));
  }
  if ((m.features & kFeatureVersion) != 0 && !GetVersion(r, &m.version)) {
    return Err(Malformed("STAT reply", body));
  }
  return m;
}

void EncodeAlloc(const AllocRequest& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U32(m.count);
  w.U32(0);
}

Result<AllocRequest> DecodeAlloc(std::span<const uint8_t> body) {
  Reader r(body);
  AllocRequest m;
  m.count = r.U32();
  r.U32();
  if (!r.ok() || r.remaining() != 0) return Err(Malformed("ALLOC", body));
  if (m.count == 0 || m.count > kMaxLeasesPerCall) {
    return Err(InvalidArgument(
        fmt::format("ALLOC of {} slabs: ask for 1 to {} per call", m.count, kMaxLeasesPerCall)));
  }
  return m;
}

void EncodeAllocReply(const AllocReply& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U32(static_cast<uint32_t>(m.leases.size()));
  w.U32(0);
  for (const LeaseGrant& l : m.leases) {
    w.U64(l.lease_id);
    w.U64(l.length);
    w.U64(l.remote_addr);
    w.U32(l.rkey);
    w.U32(0);
  }
}

Result<AllocReply> DecodeAllocReply(std::span<const uint8_t> body) {
  Reader r(body);
  const uint32_t count = r.U32();
  r.U32();
  if (!r.ok() || count > kMaxLeasesPerCall || r.remaining() != size_t{count} * kLeaseGrantSize) {
    return Err(Malformed("ALLOC reply", body));
  }
  AllocReply m;
  m.leases.resize(count);
  for (LeaseGrant& l : m.leases) {
    l.lease_id = r.U64();
    l.length = r.U64();
    l.remote_addr = r.U64();
    l.rkey = r.U32();
    r.U32();
  }
  return m;
}

namespace {
void EncodeIdList(const std::vector<uint64_t>& ids, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U32(static_cast<uint32_t>(ids.size()));
  w.U32(0);
  for (uint64_t id : ids) w.U64(id);
}

Result<std::vector<uint64_t>> DecodeIdList(const char* what, std::span<const uint8_t> body) {
  Reader r(body);
  const uint32_t count = r.U32();
  r.U32();
  if (!r.ok() || count > kMaxLeasesPerCall || r.remaining() != size_t{count} * 8) {
    return Err(Malformed(what, body));
  }
  std::vector<uint64_t> ids(count);
  for (uint64_t& id : ids) id = r.U64();
  return ids;
}
}  // namespace

void EncodeFree(const FreeRequest& m, std::vector<uint8_t>* out) { EncodeIdList(m.lease_ids, out); }

Result<FreeRequest> DecodeFree(std::span<const uint8_t> body) {
  FARMEM_ASSIGN_OR_RETURN(auto ids, DecodeIdList("FREE", body));
  return FreeRequest{std::move(ids)};
}

void EncodeHeartbeat(const HeartbeatRequest& m, std::vector<uint8_t>* out) {
  if (m.reports.empty()) return;
  Writer w(out);
  w.U32(static_cast<uint32_t>(m.reports.size()));
  w.U32(0);
  for (const AccessReport& a : m.reports) {
    w.U64(a.lease_id);
    w.U64(a.accesses);
  }
}

Result<HeartbeatRequest> DecodeHeartbeat(std::span<const uint8_t> body) {
  HeartbeatRequest m;
  if (body.empty()) return m;
  Reader r(body);
  const uint32_t count = r.U32();
  r.U32();
  if (!r.ok() || count == 0 || count > kMaxLeasesPerCall || r.remaining() != size_t{count} * 16) {
    return Err(Malformed("HEARTBEAT access report", body));
  }
  m.reports.resize(count);
  for (AccessReport& a : m.reports) {
    a.lease_id = r.U64();
    a.accesses = r.U64();
  }
  return m;
}

void EncodeHeartbeatReply(const HeartbeatReply& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U32(m.leases_held);
  w.U32(0);
  w.U64(m.lease_ttl_ms);
  if (m.noticed.empty()) return;
  w.U32(static_cast<uint32_t>(m.noticed.size()));
  w.U32(0);
  for (const NoticedLease& n : m.noticed) {
    w.U64(n.lease_id);
    w.U32(n.grace_left_ms);
    w.U32(0);
  }
}

Result<HeartbeatReply> DecodeHeartbeatReply(std::span<const uint8_t> body) {
  Reader r(body);
  HeartbeatReply m;
  m.leases_held = r.U32();
  r.U32();
  m.lease_ttl_ms = r.U64();
  if (!r.ok()) return Err(Malformed("HEARTBEAT reply", body));
  if (r.remaining() == 0) return m;  // no lease under notice (or a daemon that predates it)
  const uint32_t count = r.U32();
  r.U32();
  if (!r.ok() || count == 0 || count > kMaxLeasesPerCall || r.remaining() < size_t{count} * 16) {
    return Err(Malformed("HEARTBEAT reply's noticed leases", body));
  }
  m.noticed.resize(count);
  for (NoticedLease& n : m.noticed) {
    n.lease_id = r.U64();
    n.grace_left_ms = r.U32();
    r.U32();
  }
  return m;
}

void EncodeEvictNotice(const EvictNotice& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U32(m.grace_ms);
  w.U32(0);
  EncodeIdList(m.lease_ids, out);
}

Result<EvictNotice> DecodeEvictNotice(std::span<const uint8_t> body) {
  if (body.size() < 8) return Err(Malformed("EVICT_NOTICE", body));
  Reader r(body.first(8));
  EvictNotice m;
  m.grace_ms = r.U32();
  FARMEM_ASSIGN_OR_RETURN(m.lease_ids, DecodeIdList("EVICT_NOTICE", body.subspan(8)));
  return m;
}

void EncodeDrain(const DrainRequest& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U32(m.drain ? 1 : 0);
  w.U32(m.grace_ms);
}

Result<DrainRequest> DecodeDrain(std::span<const uint8_t> body) {
  if (body.size() != 8) return Err(Malformed("DRAIN", body));
  Reader r(body);
  const uint32_t mode = r.U32();
  DrainRequest m;
  m.grace_ms = r.U32();
  if (mode > 1)
    return Err(InvalidArgument(fmt::format("DRAIN mode {} (0 undrain, 1 drain)", mode)));
  m.drain = mode == 1;
  return m;
}

void EncodeDrainReply(const DrainReply& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U32(m.leases_noticed);
  w.U32(m.leases_held);
}

Result<DrainReply> DecodeDrainReply(std::span<const uint8_t> body) {
  if (body.size() < 8) return Err(Malformed("DRAIN reply", body));
  Reader r(body);
  DrainReply m;
  m.leases_noticed = r.U32();
  m.leases_held = r.U32();
  return m;
}

void EncodeRdmaTokenReply(const RdmaTokenReply& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.Bytes(m.token);
  w.U16(m.rdma_port);
  w.U16(0);
  w.U32(m.valid_ms);
}

Result<RdmaTokenReply> DecodeRdmaTokenReply(std::span<const uint8_t> body) {
  Reader r(body);
  RdmaTokenReply m;
  ReadArray(r, &m.token);
  m.rdma_port = r.U16();
  r.U16();
  m.valid_ms = r.U32();
  if (!r.ok()) return Err(Malformed("RDMA_TOKEN reply", body));
  if (m.rdma_port == 0) return Err(ProtocolError("RDMA_TOKEN reply names rdma port 0"));
  return m;
}

void EncodeRdmaConnectData(const RdmaToken& token, uint8_t out[kRdmaConnectDataSize]) {
  FixedWriter w(out);
  w.U32(kRdmaMagic);
  w.U8(kVersion);
  w.Zeros(3);
  w.Bytes(token);
}

Result<RdmaToken> DecodeRdmaConnectData(std::span<const uint8_t> data) {
  Reader r(data);
  const uint32_t magic = r.U32();
  const uint8_t version = r.U8();
  r.Skip(3);
  RdmaToken token{};
  ReadArray(r, &token);
  if (!r.ok() || magic != kRdmaMagic) {
    return Err(Unauthenticated(fmt::format(
        "RDMA connect request without a farmem token ({} bytes of private data)", data.size())));
  }
  if (version != kVersion) {
    return Err(
        ProtocolError(fmt::format("RDMA connect request of protocol version {} (this build "
                                  "speaks {})",
                                  version, kVersion)));
  }
  return token;
}

void EncodeRdmaRejectData(StatusCode why, uint8_t out[kRdmaRejectDataSize]) {
  FixedWriter w(out);
  w.U32(kRdmaMagic);
  w.U8(kVersion);
  w.U8(0);
  w.U16(static_cast<uint16_t>(why));
}

StatusCode DecodeRdmaRejectData(std::span<const uint8_t> data) {
  Reader r(data);
  const uint32_t magic = r.U32();
  r.Skip(2);
  const uint16_t why = r.U16();
  if (!r.ok() || magic != kRdmaMagic) return StatusCode::kInternal;
  return StatusCodeFromWire(why);
}

void EncodeDataOp(const DataOp& m, uint8_t out[kDataOpSize]) {
  FixedWriter w(out);
  w.U64(m.lease_id);
  w.U64(m.offset);
  w.U32(m.length);
  w.U32(0);
}

Result<DataOp> DecodeDataOp(std::span<const uint8_t> fixed) {
  if (fixed.size() < kDataOpSize) return Err(Malformed("data operation", fixed));
  Reader r(fixed.first(kDataOpSize));
  DataOp m;
  m.lease_id = r.U64();
  m.offset = r.U64();
  m.length = r.U32();
  if (r.U32() != 0) return Err(ProtocolError("reserved field of a data operation is not zero"));
  if (m.length == 0 || m.length > kMaxDataLen) {
    return Err(InvalidArgument(
        fmt::format("data operation of {} bytes: must be 1 to {}", m.length, kMaxDataLen)));
  }
  return m;
}

namespace {
void EncodePeerCell(Writer& w, const PeerCell& c) {
  const size_t host_len = std::min(c.host.size(), kMaxPeerHost);
  w.U64(c.lease_id);
  w.U64(c.offset);
  w.U16(c.port);
  w.U16(static_cast<uint16_t>(host_len));
  w.U32(0);
  w.Bytes({reinterpret_cast<const uint8_t*>(c.host.data()), host_len});
}

Status DecodePeerCell(Reader& r, const char* what, size_t i, uint32_t length,
                      std::span<const uint8_t> body, PeerCell* c) {
  c->lease_id = r.U64();
  c->offset = r.U64();
  c->port = r.U16();
  const uint16_t host_len = r.U16();
  const uint32_t reserved = r.U32();
  if (!r.ok()) return Malformed(what, body);
  if (reserved != 0) {
    return ProtocolError(fmt::format("{} source {}: reserved field not zero", what, i));
  }
  if (host_len == 0 || host_len > kMaxPeerHost || c->port == 0) {
    return InvalidArgument(
        fmt::format("{} source {}: host of {} bytes, port {}: need 1 to {} bytes and a port", what,
                    i, host_len, c->port, kMaxPeerHost));
  }
  auto host = r.Bytes(host_len);
  if (!r.ok()) return Malformed(what, body);
  c->host.assign(reinterpret_cast<const char*>(host.data()), host.size());
  for (char ch : c->host) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                    (ch >= '0' && ch <= '9') || ch == '.' || ch == '-' || ch == ':' || ch == '_' ||
                    ch == '%';
    if (!ok) {
      return InvalidArgument(
          fmt::format("{} source {}: host contains a byte {:#04x} that is not in a host name or "
                      "address",
                      what, i, static_cast<uint8_t>(ch)));
    }
  }
  if (!RangeFits(c->offset, length, ~uint64_t{0})) {
    return InvalidArgument(
        fmt::format("{} source {}: offset {} + {} overflows", what, i, c->offset, length));
  }
  return Status::Ok();
}
}  // namespace

void EncodeParityEncode(const ParityEncodeRequest& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U64(m.lease_id);
  w.U64(m.offset);
  w.U32(m.length);
  w.U8(m.k);
  w.U8(m.r);
  w.U8(m.parity_index);
  w.U8(0);
  w.U32(m.timeout_ms);
  w.U32(0);
  for (const PeerCell& c : m.sources) EncodePeerCell(w, c);
}

Result<ParityEncodeRequest> DecodeParityEncode(std::span<const uint8_t> body) {
  Reader r(body);
  ParityEncodeRequest m;
  m.lease_id = r.U64();
  m.offset = r.U64();
  m.length = r.U32();
  m.k = r.U8();
  m.r = r.U8();
  m.parity_index = r.U8();
  const uint8_t reserved8 = r.U8();
  m.timeout_ms = r.U32();
  const uint32_t reserved32 = r.U32();
  if (!r.ok()) return Err(Malformed("PARITY_ENCODE", body));
  if (reserved8 != 0 || reserved32 != 0) {
    return Err(ProtocolError("reserved field of PARITY_ENCODE is not zero"));
  }
  if (m.k == 0 || m.r == 0 || int{m.k} + int{m.r} > kMaxParityFragments) {
    return Err(InvalidArgument(
        fmt::format("PARITY_ENCODE for RS({},{}): need k >= 1, r >= 1 and k + r <= {}", m.k, m.r,
                    kMaxParityFragments)));
  }
  if (m.parity_index >= m.r) {
    return Err(InvalidArgument(
        fmt::format("PARITY_ENCODE parity index {} is outside [0, {})", m.parity_index, m.r)));
  }
  if (m.length == 0 || m.length > kMaxDataLen) {
    return Err(InvalidArgument(
        fmt::format("PARITY_ENCODE cell of {} bytes: must be 1 to {}", m.length, kMaxDataLen)));
  }
  if (m.timeout_ms == 0 || m.timeout_ms > kMaxParityTimeoutMs) {
    return Err(InvalidArgument(fmt::format("PARITY_ENCODE timeout of {} ms: must be 1 to {}",
                                           m.timeout_ms, kMaxParityTimeoutMs)));
  }
  m.sources.resize(m.k);
  for (size_t i = 0; i < m.sources.size(); ++i) {
    FARMEM_RETURN_IF_ERROR(DecodePeerCell(r, "PARITY_ENCODE", i, m.length, body, &m.sources[i]));
  }
  if (r.remaining() != 0) {
    return Err(ProtocolError(
        fmt::format("PARITY_ENCODE body has {} bytes after its {} sources", r.remaining(), m.k)));
  }
  return m;
}

void EncodeGatherCell(const GatherCellRequest& m, std::vector<uint8_t>* out) {
  Writer w(out);
  w.U64(m.lease_id);
  w.U64(m.offset);
  w.U32(m.length);
  w.U32(m.timeout_ms);
  w.U16(static_cast<uint16_t>(m.sources.size()));
  w.U16(0);
  w.U32(static_cast<uint32_t>(m.copies.size()));
  for (const PeerCell& c : m.sources) EncodePeerCell(w, c);
  for (const GatherCopy& c : m.copies) {
    w.U16(c.source);
    w.U16(0);
    w.U32(c.src_offset);
    w.U32(c.dst_offset);
    w.U32(c.length);
  }
}

Result<GatherCellRequest> DecodeGatherCell(std::span<const uint8_t> body) {
  Reader r(body);
  GatherCellRequest m;
  m.lease_id = r.U64();
  m.offset = r.U64();
  m.length = r.U32();
  m.timeout_ms = r.U32();
  const uint16_t nsources = r.U16();
  const uint16_t reserved = r.U16();
  const uint32_t ncopies = r.U32();
  if (!r.ok()) return Err(Malformed("GATHER_CELL", body));
  if (reserved != 0) return Err(ProtocolError("reserved field of GATHER_CELL is not zero"));
  if (m.length == 0 || m.length > kMaxDataLen) {
    return Err(InvalidArgument(
        fmt::format("GATHER_CELL cell of {} bytes: must be 1 to {}", m.length, kMaxDataLen)));
  }
  if (m.timeout_ms == 0 || m.timeout_ms > kMaxParityTimeoutMs) {
    return Err(InvalidArgument(fmt::format("GATHER_CELL timeout of {} ms: must be 1 to {}",
                                           m.timeout_ms, kMaxParityTimeoutMs)));
  }
  if (nsources > kMaxGatherSources || uint64_t{nsources} * m.length > kMaxGatherSourceBytes) {
    return Err(InvalidArgument(fmt::format(
        "GATHER_CELL with {} sources of {} bytes: at most {} sources and {} bytes of them",
        nsources, m.length, kMaxGatherSources, kMaxGatherSourceBytes)));
  }
  // Each copy takes kGatherCopySize bytes of the body: a count the body cannot hold is refused
  // before anything is allocated for it.
  if (ncopies > body.size() / kGatherCopySize) return Err(Malformed("GATHER_CELL", body));
  m.sources.resize(nsources);
  for (size_t i = 0; i < m.sources.size(); ++i) {
    FARMEM_RETURN_IF_ERROR(DecodePeerCell(r, "GATHER_CELL", i, m.length, body, &m.sources[i]));
  }
  m.copies.resize(ncopies);
  for (size_t i = 0; i < m.copies.size(); ++i) {
    GatherCopy& c = m.copies[i];
    c.source = r.U16();
    const uint16_t res = r.U16();
    c.src_offset = r.U32();
    c.dst_offset = r.U32();
    c.length = r.U32();
    if (!r.ok()) return Err(Malformed("GATHER_CELL", body));
    if (res != 0) {
      return Err(ProtocolError(fmt::format("GATHER_CELL copy {}: reserved field not zero", i)));
    }
    if (c.source >= nsources || c.length == 0 || !RangeFits(c.src_offset, c.length, m.length) ||
        !RangeFits(c.dst_offset, c.length, m.length)) {
      return Err(InvalidArgument(fmt::format(
          "GATHER_CELL copy {}: source {} (of {}), {} bytes from offset {} to offset {}: must "
          "name a source and lie within cells of {} bytes",
          i, c.source, nsources, c.length, c.src_offset, c.dst_offset, m.length)));
    }
  }
  if (r.remaining() != 0) {
    return Err(ProtocolError(
        fmt::format("GATHER_CELL body has {} bytes after its copies", r.remaining())));
  }
  return m;
}

void EncodeBatchOp(const BatchOp& m, uint8_t out[kBatchOpSize]) {
  FixedWriter w(out);
  w.U8(static_cast<uint8_t>(m.op));
  w.Zeros(3);
  w.U32(m.length);
  w.U64(m.lease_id);
  w.U64(m.offset);
}

Result<BatchDescriptors> DecodeBatch(std::span<const uint8_t> body, uint32_t body_len) {
  Reader r(body);
  const uint32_t count = r.U32();
  r.U32();
  if (!r.ok()) return Err(Malformed("BATCH", body));
  if (count == 0 || count > kMaxOpsPerBatch) {
    return Err(InvalidArgument(
        fmt::format("BATCH of {} operations: must be 1 to {}", count, kMaxOpsPerBatch)));
  }
  BatchDescriptors d;
  d.payload_offset = BatchRequestTableSize(count);
  if (d.payload_offset > body_len) return Err(Malformed("BATCH", body));
  if (body.size() < d.payload_offset) {
    return Err(Internal("DecodeBatch needs the whole descriptor table"));
  }
  d.ops.resize(count);
  for (BatchOp& op : d.ops) {
    const uint8_t code = r.U8();
    r.Skip(3);
    op.length = r.U32();
    op.lease_id = r.U64();
    op.offset = r.U64();
    if (code != static_cast<uint8_t>(Opcode::kRead) &&
        code != static_cast<uint8_t>(Opcode::kWrite)) {
      return Err(
          InvalidArgument(fmt::format("BATCH operation code {} is neither READ nor WRITE", code)));
    }
    op.op = static_cast<Opcode>(code);
    if (op.length == 0 || op.length > kMaxDataLen) {
      return Err(InvalidArgument(
          fmt::format("BATCH operation of {} bytes: must be 1 to {}", op.length, kMaxDataLen)));
    }
    (op.op == Opcode::kWrite ? d.write_bytes : d.read_bytes) += op.length;
  }
  if (d.write_bytes > kMaxDataLen || d.read_bytes > kMaxDataLen) {
    return Err(ResourceExhausted(
        fmt::format("BATCH moves {} bytes written / {} read: each direction is limited to {}",
                    d.write_bytes, d.read_bytes, kMaxDataLen)));
  }
  if (d.payload_offset + d.write_bytes != body_len) {
    return Err(
        ProtocolError(fmt::format("BATCH body is {} bytes but its descriptors account for {}",
                                  body_len, d.payload_offset + d.write_bytes)));
  }
  return d;
}

void EncodeBatchCount(uint32_t count, uint8_t out[kBatchCountSize]) {
  const uint32_t reserved = 0;
  std::memcpy(out, &count, 4);
  std::memcpy(out + 4, &reserved, 4);
}

void EncodeBatchReplyTable(uint32_t count, uint8_t* out) {
  EncodeBatchCount(count, out);
  std::memset(out + kBatchCountSize, 0, BatchReplyTableSize(count) - kBatchCountSize);
}

void SetBatchReplyStatus(uint8_t* table, size_t i, uint16_t code) {
  const uint32_t code32 = code;
  std::memcpy(table + kBatchCountSize + 4 * i, &code32, 4);
}

Status DecodeBatchReplyTable(std::span<const uint8_t> table, std::span<uint16_t> codes) {
  if (table.size() != BatchReplyTableSize(codes.size())) {
    return ProtocolError(
        fmt::format("BATCH reply table of {} bytes for {} operations", table.size(), codes.size()));
  }
  Reader r(table);
  const uint32_t count = r.U32();
  r.U32();
  if (count != codes.size()) {
    return ProtocolError(
        fmt::format("BATCH reply counts {} operations, the request had {}", count, codes.size()));
  }
  for (uint16_t& code : codes) code = static_cast<uint16_t>(r.U32());
  return Status::Ok();
}

void EncodeError(const Status& s, std::vector<uint8_t>* out) {
  const std::string& m = s.message();
  const size_t n = std::min(m.size(), kMaxErrorMessage);
  out->insert(out->end(), m.begin(), m.begin() + static_cast<ptrdiff_t>(n));
}

Status DecodeError(uint16_t status, std::span<const uint8_t> body) {
  StatusCode code = StatusCodeFromWire(status);
  if (code == StatusCode::kOk) code = StatusCode::kInternal;
  const size_t n = std::min(body.size(), kMaxErrorMessage);
  std::string msg(reinterpret_cast<const char*>(body.data()), n);
  for (char& c : msg) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return Status(code, std::move(msg));
}

}  // namespace farmem::wire
