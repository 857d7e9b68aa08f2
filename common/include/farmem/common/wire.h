// The farmem wire protocol: one versioned binary framing for control and TCP data.
// The normative description is docs/wire-protocol.md; this header is its only implementation.
//
// Every frame is a fixed 24-byte little-endian FrameHeader followed by body_len bytes of body.
// Parsers here never trust a length: every count and size is checked against the bytes present
// and against the limits below before anything is allocated. All functions are pure (no I/O, no
// shared state) and may be called from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/common/status.h"

namespace farmem::wire {

inline constexpr uint32_t kMagic = 0x4D454D46;  // bytes 'F' 'M' 'E' 'M'
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kHeaderSize = 24;
// Largest payload of one READ/WRITE and largest total payload of one BATCH.
inline constexpr uint32_t kMaxDataLen = 16u << 20;
// Largest body of any frame: the biggest BATCH (descriptors + payload).
inline constexpr uint32_t kMaxOpsPerBatch = 1024;
inline constexpr uint32_t kBatchOpSize = 24;
// A BATCH request body and its reply body both start with `count u32, reserved u32`.
inline constexpr uint32_t kBatchCountSize = 8;
inline constexpr uint32_t kMaxBodyLen =
    kMaxDataLen + kBatchCountSize + kMaxOpsPerBatch * kBatchOpSize;
inline constexpr uint32_t kMaxControlBodyLen = 64u << 10;
inline constexpr uint32_t kMaxLeasesPerCall = 1024;
inline constexpr size_t kMaxErrorMessage = 1024;
inline constexpr size_t kMaxClientName = 64;
// An identity (the name a client authenticates as, docs/wire-protocol.md "Identities").
inline constexpr size_t kMaxIdentity = 64;
inline constexpr size_t kNonceSize = 32;
inline constexpr size_t kMacSize = 32;  // HMAC-SHA256
inline constexpr size_t kClientIdSize = 16;

enum class Opcode : uint8_t {
  kHello = 1,
  kAuth = 2,
  kStat = 3,
  kAlloc = 4,
  kFree = 5,
  kHeartbeat = 6,
  kRead = 7,
  kWrite = 8,
  kBatch = 9,
  kEvictNotice = 10,   // daemon -> client push: these leases will be evicted
  kRdmaToken = 11,     // a one-time token that admits one RDMA connection of this client
  kParityEncode = 12,  // parity offload: compute one parity cell from k data cells on peers
  kGatherCell = 13,    // compaction offload: build one cell from pieces of cells on peers
  kDrain = 14,         // operator: stop granting and notice every lease (or undo it)
};
const char* OpcodeName(uint8_t op);

enum FrameFlags : uint16_t {
  kFlagReply = 1u << 0,
  kFlagPush = 1u << 1,  // unsolicited daemon -> client frame
};
inline constexpr uint16_t kKnownFlags = kFlagReply | kFlagPush;

enum Features : uint32_t {
  kFeatureAuthRequired = 1u << 0,
  kFeatureVerbs = 1u << 1,
  // STAT only, the daemon's state rather than a feature: it grants nothing now.
  kStateDraining = 1u << 16,       // drained (farmemctl drain, or shutting down)
  kStateUnderPressure = 1u << 17,  // its host is short of memory (--reserve)
  // STAT: the reply carries client_free_slabs / client_max_slabs (the asking client's share).
  kFeatureClientShare = 1u << 2,
  // STAT and HELLO: the reply ends with the daemon's version string (in STAT after the
  // CLIENT_SHARE fields). In HELLO it also says the daemon takes the client's version in AUTH.
  kFeatureVersion = 1u << 3,
  // HELLO: HEARTBEAT requests may carry access reports (HeartbeatRequest): per-lease counts of
  // the client's one-sided RDMA operations, which the daemon's CPU never sees (victim choice).
  kFeatureAccessReports = 1u << 4,
};
// Longest version string a STAT or HELLO reply, or an AUTH request, may carry.
inline constexpr size_t kMaxVersionString = 128;
// The major version of a version string as --version prints it ("1.2.3 (git ...)" -> 1);
// nullopt when it does not start with a number (e.g. empty: the peer did not say).
std::optional<uint32_t> VersionMajor(std::string_view version);

struct FrameHeader {
  uint8_t version = kVersion;
  uint8_t opcode = 0;
  uint16_t flags = 0;
  uint64_t request_id = 0;
  uint32_t body_len = 0;
  uint16_t status = 0;  // StatusCode in replies, 0 in requests

  bool is_reply() const { return flags & kFlagReply; }
};

void EncodeHeader(const FrameHeader& h, uint8_t out[kHeaderSize]);
// Checks magic, version, reserved bits, flags and body_len <= max_body. A failure means the
// byte stream can no longer be trusted: answer ProtocolError and close the connection.
Result<FrameHeader> DecodeHeader(std::span<const uint8_t> bytes, uint32_t max_body = kMaxBodyLen);

// ---- bounded little-endian encoding ----

class Writer {
 public:
  explicit Writer(std::vector<uint8_t>* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(v); }
  void U16(uint16_t v) { Put(&v, 2); }
  void U32(uint32_t v) { Put(&v, 4); }
  void U64(uint64_t v) { Put(&v, 8); }
  void Bytes(std::span<const uint8_t> b) { Put(b.data(), b.size()); }
  void Zeros(size_t n) { out_->insert(out_->end(), n, 0); }

 private:
  void Put(const void* p, size_t n) {  // x86-64 / aarch64 are little-endian
    const auto* b = static_cast<const uint8_t*>(p);
    out_->insert(out_->end(), b, b + n);
  }
  std::vector<uint8_t>* out_;
};

// Reads fields off a span; any read past the end sets a sticky failure and yields zeros.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  uint8_t U8() {
    uint8_t v = 0;
    Get(&v, 1);
    return v;
  }
  uint16_t U16() {
    uint16_t v = 0;
    Get(&v, 2);
    return v;
  }
  uint32_t U32() {
    uint32_t v = 0;
    Get(&v, 4);
    return v;
  }
  uint64_t U64() {
    uint64_t v = 0;
    Get(&v, 8);
    return v;
  }
  std::span<const uint8_t> Bytes(size_t n) {
    if (!ok_ || n > in_.size() - pos_) {
      ok_ = false;
      return {};
    }
    auto s = in_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  void Skip(size_t n) { (void)Bytes(n); }
  bool ok() const { return ok_; }
  size_t remaining() const { return ok_ ? in_.size() - pos_ : 0; }
  size_t position() const { return pos_; }

 private:
  void Get(void* p, size_t n) {
    if (!ok_ || n > in_.size() - pos_) {
      ok_ = false;
      return;
    }
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// ---- message bodies ----

using ClientId = std::array<uint8_t, kClientIdSize>;
using Nonce = std::array<uint8_t, kNonceSize>;
using Mac = std::array<uint8_t, kMacSize>;

struct HelloRequest {
  uint8_t min_version = kVersion;
  uint8_t max_version = kVersion;
  ClientId client_id{};
  Nonce client_nonce{};
  std::string client_name;  // for logs only, <= kMaxClientName bytes
  // The name the client authenticates as (AUTH proves it holds that name's key). Empty: not sent,
  // which means the built-in name "cluster" (the cluster secret itself). Not sanitized here:
  // auth::ValidateIdentity decides what a name may be.
  std::string identity;
};
struct HelloReply {
  uint8_t version = kVersion;
  uint32_t features = 0;
  uint64_t node_id = 0;  // random per daemon start: a restart is a different node
  Nonce server_nonce{};  // the challenge
  // With kFeatureVersion (a trailer; empty from daemons without it): "0.1.0 (git ...)".
  std::string daemon_version;
};
struct AuthRequest {
  Mac client_mac{};
  // The client's version, an optional trailer: sent only to a daemon whose HELLO reply has
  // kFeatureVersion (older daemons take exactly the proof). Empty: not sent.
  std::string client_version;
};
struct AuthReply {
  Mac server_mac{};  // proves the daemon knows the secret too
};

struct StatReply {
  uint64_t node_id = 0;
  uint64_t capacity = 0;
  uint64_t slab_size = 0;
  uint32_t total_slabs = 0;
  uint32_t free_slabs = 0;
  uint32_t clients = 0;
  uint32_t features = 0;
  uint64_t ops = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint16_t rdma_port = 0;  // rdma_cm port when kFeatureVerbs is set
  // With kFeatureClientShare (appended fields; 0 from daemons without it): how many slabs the
  // client asking may still take (free_slabs capped by its --max-client-share), and that cap.
  uint32_t client_free_slabs = 0;
  uint32_t client_max_slabs = 0;
  // With kFeatureVersion (appended last; empty from daemons without it): "0.1.0 (git ...)".
  std::string version;
};

// The slabs the client that asked may still lease: free_slabs capped by the daemon's
// --max-client-share, or free_slabs from a daemon that does not say (no kFeatureClientShare).
inline uint32_t FreeForClient(const StatReply& m) {
  return (m.features & kFeatureClientShare) != 0 ? m.client_free_slabs : m.free_slabs;
}

// A lease as the daemon hands it out. lease_id = (epoch << 32) | slab index.
struct LeaseGrant {
  uint64_t lease_id = 0;
  uint64_t length = 0;
  uint64_t remote_addr = 0;  // for verbs: where the slab is registered
  uint32_t rkey = 0;         // for verbs: the slab's memory region key
};
inline constexpr size_t kLeaseGrantSize = 32;

struct AllocRequest {
  uint32_t count = 0;
};
struct AllocReply {
  std::vector<LeaseGrant> leases;
};
struct FreeRequest {
  std::vector<uint64_t> lease_ids;
};
// HEARTBEAT request: empty, or — to a daemon whose HELLO reply set kFeatureAccessReports — how
// many one-sided (RDMA) reads and writes the client made on each of its leases there since its
// previous report. At most kMaxLeasesPerCall leases per heartbeat.
struct AccessReport {
  uint64_t lease_id = 0;
  uint64_t accesses = 0;
};
struct HeartbeatRequest {
  std::vector<AccessReport> reports;
};
// A lease of the heartbeating client that is under an eviction notice, with the grace left.
struct NoticedLease {
  uint64_t lease_id = 0;
  uint32_t grace_left_ms = 0;
  bool operator==(const NoticedLease&) const = default;
};
// HEARTBEAT reply. `noticed`: the client's leases here under an EVICT_NOTICE (at most
// kMaxLeasesPerCall, the soonest deadlines first), so that a notice pushed on a connection that
// has since closed (a restarted process re-adopting its leases, a reconnect) still reaches the
// client. Sent as a trailer only when not empty; older readers ignore it.
struct HeartbeatReply {
  uint32_t leases_held = 0;
  uint64_t lease_ttl_ms = 0;
  std::vector<NoticedLease> noticed;
};
struct EvictNotice {
  std::vector<uint64_t> lease_ids;
  uint32_t grace_ms = 0;
};
// DRAIN request: drain (notice every lease with grace_ms, grant nothing) or undrain.
struct DrainRequest {
  bool drain = true;
  uint32_t grace_ms = 0;
};
struct DrainReply {
  uint32_t leases_noticed = 0;  // by this request (a repeated DRAIN notices nothing new)
  uint32_t leases_held = 0;     // leases the daemon still holds
};

// RDMA_TOKEN reply: the token a client puts in its rdma_cm connect request (docs/rdma.md).
inline constexpr size_t kRdmaTokenSize = 32;
using RdmaToken = std::array<uint8_t, kRdmaTokenSize>;
struct RdmaTokenReply {
  RdmaToken token{};
  uint16_t rdma_port = 0;  // where the daemon's rdma_cm listens (same host as its TCP port)
  uint32_t valid_ms = 0;   // the token admits one connection within this time
};

// rdma_cm private data. Connect request (client -> daemon), 40 bytes: magic u32, version u8,
// reserved [3], token [32]. Reject (daemon -> client), 8 bytes: magic u32, version u8, reserved
// u8, status u16 (why). Transports may pad private data: readers ignore bytes past these.
inline constexpr uint32_t kRdmaMagic = 0x43524D46;  // bytes 'F' 'M' 'R' 'C'
inline constexpr size_t kRdmaConnectDataSize = 40;
inline constexpr size_t kRdmaRejectDataSize = 8;

// Fixed part of READ and WRITE bodies; WRITE's payload follows it.
struct DataOp {
  uint64_t lease_id = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
};
inline constexpr size_t kDataOpSize = 24;

// One descriptor of a BATCH body.
struct BatchOp {
  Opcode op = Opcode::kRead;  // kRead or kWrite
  uint32_t length = 0;
  uint64_t lease_id = 0;
  uint64_t offset = 0;
};

void EncodeHello(const HelloRequest& m, std::vector<uint8_t>* out);
Result<HelloRequest> DecodeHello(std::span<const uint8_t> body);
void EncodeHelloReply(const HelloReply& m, std::vector<uint8_t>* out);
Result<HelloReply> DecodeHelloReply(std::span<const uint8_t> body);
void EncodeAuth(const AuthRequest& m, std::vector<uint8_t>* out);
Result<AuthRequest> DecodeAuth(std::span<const uint8_t> body);
void EncodeAuthReply(const AuthReply& m, std::vector<uint8_t>* out);
Result<AuthReply> DecodeAuthReply(std::span<const uint8_t> body);
void EncodeStatReply(const StatReply& m, std::vector<uint8_t>* out);
Result<StatReply> DecodeStatReply(std::span<const uint8_t> body);
void EncodeAlloc(const AllocRequest& m, std::vector<uint8_t>* out);
Result<AllocRequest> DecodeAlloc(std::span<const uint8_t> body);
void EncodeAllocReply(const AllocReply& m, std::vector<uint8_t>* out);
Result<AllocReply> DecodeAllocReply(std::span<const uint8_t> body);
void EncodeFree(const FreeRequest& m, std::vector<uint8_t>* out);
Result<FreeRequest> DecodeFree(std::span<const uint8_t> body);
// No reports: an empty body (what every daemon accepts).
void EncodeHeartbeat(const HeartbeatRequest& m, std::vector<uint8_t>* out);
Result<HeartbeatRequest> DecodeHeartbeat(std::span<const uint8_t> body);
void EncodeHeartbeatReply(const HeartbeatReply& m, std::vector<uint8_t>* out);
Result<HeartbeatReply> DecodeHeartbeatReply(std::span<const uint8_t> body);
void EncodeEvictNotice(const EvictNotice& m, std::vector<uint8_t>* out);
Result<EvictNotice> DecodeEvictNotice(std::span<const uint8_t> body);
void EncodeDrain(const DrainRequest& m, std::vector<uint8_t>* out);
Result<DrainRequest> DecodeDrain(std::span<const uint8_t> body);
void EncodeDrainReply(const DrainReply& m, std::vector<uint8_t>* out);
Result<DrainReply> DecodeDrainReply(std::span<const uint8_t> body);

void EncodeRdmaTokenReply(const RdmaTokenReply& m, std::vector<uint8_t>* out);
Result<RdmaTokenReply> DecodeRdmaTokenReply(std::span<const uint8_t> body);
void EncodeRdmaConnectData(const RdmaToken& token, uint8_t out[kRdmaConnectDataSize]);
Result<RdmaToken> DecodeRdmaConnectData(std::span<const uint8_t> data);
void EncodeRdmaRejectData(StatusCode why, uint8_t out[kRdmaRejectDataSize]);
// The status a daemon gave for rejecting a connection; Internal when `data` is not ours.
StatusCode DecodeRdmaRejectData(std::span<const uint8_t> data);

void EncodeDataOp(const DataOp& m, uint8_t out[kDataOpSize]);
Result<DataOp> DecodeDataOp(std::span<const uint8_t> fixed);  // exactly the first kDataOpSize bytes

// PARITY_ENCODE (parity offload, docs/wire-protocol.md): the daemon reads k data cells of one
// span set from their daemons (connecting to them as the caller, with the shared secret), computes
// parity fragment k + parity_index of RS(k, r) (farmem::ec's Cauchy code) and stores it at
// [offset, offset + length) of lease_id, which the caller holds on this daemon.
inline constexpr size_t kParityEncodeFixedSize = 32;
inline constexpr size_t kMaxPeerHost = 255;
inline constexpr uint32_t kMaxParityTimeoutMs = 60000;
inline constexpr int kMaxParityFragments = 32;  // k + r, as farmem::ec
struct PeerCell {
  std::string host;  // as the caller reaches that daemon; 1..kMaxPeerHost bytes
  uint16_t port = 0;
  uint64_t lease_id = 0;
  uint64_t offset = 0;
};
struct ParityEncodeRequest {
  uint64_t lease_id = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
  uint8_t k = 0;
  uint8_t r = 0;
  uint8_t parity_index = 0;       // 0..r-1: this cell is fragment k + parity_index
  uint32_t timeout_ms = 0;        // how long the daemon may spend reading the sources
  std::vector<PeerCell> sources;  // exactly k: data fragment i is sources[i]
};
void EncodeParityEncode(const ParityEncodeRequest& m, std::vector<uint8_t>* out);
// Checks every count, index, length and host; the body must be exactly what the fields describe.
Result<ParityEncodeRequest> DecodeParityEncode(std::span<const uint8_t> body);

// GATHER_CELL (compaction offload, docs/wire-protocol.md): the daemon reads whole source cells
// from their daemons (as the caller), and stores at [offset, offset + length) of lease_id a cell
// that is zero except for the copies, applied in order.
inline constexpr size_t kGatherFixedSize = 32;
inline constexpr size_t kGatherCopySize = 16;
inline constexpr uint32_t kMaxGatherSources = 32;
inline constexpr uint64_t kMaxGatherSourceBytes = 32ull << 20;  // sources * length
struct GatherCopy {
  uint16_t source = 0;  // index into sources
  uint32_t src_offset = 0;
  uint32_t dst_offset = 0;
  uint32_t length = 0;
};
struct GatherCellRequest {
  uint64_t lease_id = 0;
  uint64_t offset = 0;
  uint32_t length = 0;  // of the target cell and of every source cell
  uint32_t timeout_ms = 0;
  std::vector<PeerCell> sources;
  std::vector<GatherCopy> copies;
};
void EncodeGatherCell(const GatherCellRequest& m, std::vector<uint8_t>* out);
Result<GatherCellRequest> DecodeGatherCell(std::span<const uint8_t> body);

void EncodeBatchOp(const BatchOp& m, uint8_t out[kBatchOpSize]);
// Decodes the descriptor table of a BATCH body: count, then count descriptors. Checks each op
// code and length and that the write payloads add up to exactly what follows in the body.
struct BatchDescriptors {
  std::vector<BatchOp> ops;
  size_t payload_offset = 0;  // where write payloads start within the body
  uint64_t write_bytes = 0;
  uint64_t read_bytes = 0;
};
// `body` must hold at least the count and the whole descriptor table; body_len is the frame's.
Result<BatchDescriptors> DecodeBatch(std::span<const uint8_t> body, uint32_t body_len);

// The table a BATCH request starts with: count, reserved, `count` descriptors.
inline constexpr size_t BatchRequestTableSize(size_t count) {
  return kBatchCountSize + count * kBatchOpSize;
}
// Writes the count and reserved word; the caller puts the descriptors (EncodeBatchOp) after them.
void EncodeBatchCount(uint32_t count, uint8_t out[kBatchCountSize]);

// The table a BATCH reply starts with: count, reserved, one u32 status per descriptor (the low
// 16 bits a status code); the data of the reads whose status is 0 follow it, in order.
inline constexpr size_t BatchReplyTableSize(size_t count) { return kBatchCountSize + count * 4; }
// Writes a table of `count` statuses, all 0 (BatchReplyTableSize(count) bytes at `out`).
void EncodeBatchReplyTable(uint32_t count, uint8_t* out);
// Sets status i of a table written by EncodeBatchReplyTable.
void SetBatchReplyStatus(uint8_t* table, size_t i, uint16_t code);
// Reads a reply table of codes.size() statuses (table must be BatchReplyTableSize(codes.size())
// bytes). ProtocolError when it is not, or when its count is not codes.size().
Status DecodeBatchReplyTable(std::span<const uint8_t> table, std::span<uint16_t> codes);

// Error replies carry the Status message as body (truncated to kMaxErrorMessage).
void EncodeError(const Status& s, std::vector<uint8_t>* out);
Status DecodeError(uint16_t status, std::span<const uint8_t> body);

// Checks offset/length against a lease's length without overflowing 64 bits.
inline bool RangeFits(uint64_t offset, uint64_t length, uint64_t limit) {
  return offset <= limit && length <= limit - offset;
}

inline uint32_t LeaseSlab(uint64_t lease_id) { return static_cast<uint32_t>(lease_id); }
inline uint32_t LeaseEpoch(uint64_t lease_id) { return static_cast<uint32_t>(lease_id >> 32); }
inline uint64_t MakeLeaseId(uint32_t epoch, uint32_t slab) {
  return (static_cast<uint64_t>(epoch) << 32) | slab;
}

}  // namespace farmem::wire
