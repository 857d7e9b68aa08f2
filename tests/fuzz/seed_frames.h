// The seed corpus of fuzz_frame_parser: one valid frame (or short stream of frames) of every type
// and direction, built with the real encoders. make_seed_corpus writes them to tests/fuzz/corpus/;
// fuzz_frame_parser_replay_test checks that the committed files still match what the encoders
// produce, so a change to the wire format shows up as a corpus to regenerate.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "farmem/common/wire.h"

namespace farmem::fuzz {

using SeedFrames = std::vector<std::pair<std::string, std::vector<uint8_t>>>;

inline void AppendFrame(std::vector<uint8_t>* out, wire::Opcode op, uint16_t flags,
                        uint64_t request_id, const std::vector<uint8_t>& body,
                        uint16_t status = 0) {
  wire::FrameHeader h;
  h.opcode = static_cast<uint8_t>(op);
  h.flags = flags;
  h.request_id = request_id;
  h.body_len = static_cast<uint32_t>(body.size());
  h.status = status;
  const size_t at = out->size();
  out->resize(at + wire::kHeaderSize);
  wire::EncodeHeader(h, out->data() + at);
  out->insert(out->end(), body.begin(), body.end());
}

inline std::vector<uint8_t> Frame(wire::Opcode op, uint16_t flags, uint64_t request_id,
                                  const std::vector<uint8_t>& body, uint16_t status = 0) {
  std::vector<uint8_t> out;
  AppendFrame(&out, op, flags, request_id, body, status);
  return out;
}

inline std::vector<uint8_t> DataOpBytes(uint64_t lease, uint64_t offset, uint32_t length) {
  std::vector<uint8_t> out(wire::kDataOpSize);
  wire::EncodeDataOp({lease, offset, length}, out.data());
  return out;
}

inline SeedFrames MakeSeedFrames() {
  using wire::Opcode;
  constexpr uint16_t kReply = wire::kFlagReply;
  const uint64_t lease = wire::MakeLeaseId(0x1a2b, 3);
  wire::RdmaToken token_bytes{};
  for (size_t i = 0; i < token_bytes.size(); ++i) token_bytes[i] = static_cast<uint8_t>(0x11 * i);
  SeedFrames seeds;
  std::vector<uint8_t> b;

  wire::HelloRequest hello;
  for (size_t i = 0; i < hello.client_id.size(); ++i)
    hello.client_id[i] = static_cast<uint8_t>(i + 1);
  for (size_t i = 0; i < hello.client_nonce.size(); ++i)
    hello.client_nonce[i] = static_cast<uint8_t>(0x40 + i);
  hello.client_name = "blockdev@node-3";
  b.clear();
  wire::EncodeHello(hello, &b);
  const std::vector<uint8_t> hello_body = b;
  seeds.emplace_back("hello_request", Frame(Opcode::kHello, 0, 1, b));
  {  // with the identity trailer (a client authenticating as a name)
    wire::HelloRequest named = hello;
    named.identity = "tenant-a";
    std::vector<uint8_t> nb;
    wire::EncodeHello(named, &nb);
    seeds.emplace_back("hello_request_identity", Frame(Opcode::kHello, 0, 1, nb));
  }

  wire::HelloReply hello_reply;
  hello_reply.features = wire::kFeatureAuthRequired;
  hello_reply.node_id = 0x0123456789abcdef;
  for (size_t i = 0; i < hello_reply.server_nonce.size(); ++i) {
    hello_reply.server_nonce[i] = static_cast<uint8_t>(0x80 + i);
  }
  b.clear();
  wire::EncodeHelloReply(hello_reply, &b);
  seeds.emplace_back("hello_reply", Frame(Opcode::kHello, kReply, 1, b));
  {  // with the daemon's version (kFeatureVersion)
    wire::HelloReply versioned = hello_reply;
    versioned.features |= wire::kFeatureVersion;
    versioned.daemon_version = "0.1.0 (git v0.1.0-7-gabcdef0)";
    std::vector<uint8_t> vb;
    wire::EncodeHelloReply(versioned, &vb);
    seeds.emplace_back("hello_reply_version", Frame(Opcode::kHello, kReply, 1, vb));
  }

  wire::AuthRequest auth;
  for (size_t i = 0; i < auth.client_mac.size(); ++i)
    auth.client_mac[i] = static_cast<uint8_t>(3 * i);
  b.clear();
  wire::EncodeAuth(auth, &b);
  const std::vector<uint8_t> auth_body = b;
  seeds.emplace_back("auth_request", Frame(Opcode::kAuth, 0, 2, b));
  seeds.emplace_back("auth_reply", Frame(Opcode::kAuth, kReply, 2, b));
  {  // with the client's version trailer
    wire::AuthRequest versioned = auth;
    versioned.client_version = "0.1.0";
    std::vector<uint8_t> vb;
    wire::EncodeAuth(versioned, &vb);
    seeds.emplace_back("auth_request_version", Frame(Opcode::kAuth, 0, 2, vb));
  }

  seeds.emplace_back("stat_request", Frame(Opcode::kStat, 0, 3, {}));
  wire::StatReply stat{7, 1ull << 30, 64ull << 20, 16, 5, 2, 1, 1000, 4096, 8192, 4791, 0, 0, {}};
  b.clear();
  wire::EncodeStatReply(stat, &b);
  seeds.emplace_back("stat_reply", Frame(Opcode::kStat, kReply, 3, b));

  b.clear();
  wire::EncodeAlloc({3}, &b);
  seeds.emplace_back("alloc_request", Frame(Opcode::kAlloc, 0, 4, b));
  wire::AllocReply alloc;
  for (uint32_t i = 0; i < 3; ++i) {
    alloc.leases.push_back({wire::MakeLeaseId(100 + i, i), 64ull << 20, 0x7f0000000000ull + i, i});
  }
  b.clear();
  wire::EncodeAllocReply(alloc, &b);
  seeds.emplace_back("alloc_reply", Frame(Opcode::kAlloc, kReply, 4, b));

  b.clear();
  wire::EncodeFree({{lease, wire::MakeLeaseId(9, 1)}}, &b);
  seeds.emplace_back("free_request", Frame(Opcode::kFree, 0, 5, b));
  seeds.emplace_back("free_reply", Frame(Opcode::kFree, kReply, 5, {}));

  seeds.emplace_back("heartbeat_request", Frame(Opcode::kHeartbeat, 0, 6, {}));
  b.clear();
  wire::EncodeHeartbeatReply({2, 10000}, &b);
  seeds.emplace_back("heartbeat_reply", Frame(Opcode::kHeartbeat, kReply, 6, b));
  b.clear();
  wire::EncodeHeartbeatReply({3, 10000, {{lease, 59000}, {wire::MakeLeaseId(9, 1), 1}}}, &b);
  seeds.emplace_back("heartbeat_reply_noticed", Frame(Opcode::kHeartbeat, kReply, 6, b));

  seeds.emplace_back("read_request", Frame(Opcode::kRead, 0, 7, DataOpBytes(lease, 4096, 16)));
  seeds.emplace_back("read_reply", Frame(Opcode::kRead, kReply, 7, std::vector<uint8_t>(16, 0xab)));
  b = DataOpBytes(lease, (64ull << 20) - 8, 8);
  b.insert(b.end(), 8, 0xcd);
  seeds.emplace_back("write_request", Frame(Opcode::kWrite, 0, 8, b));
  seeds.emplace_back("write_reply", Frame(Opcode::kWrite, kReply, 8, {}));

  // BATCH: two writes, two reads; the reply has one status per op and the OK reads' data.
  const std::vector<wire::BatchOp> ops = {{Opcode::kWrite, 4, lease, 0},
                                          {Opcode::kRead, 8, lease, 100},
                                          {Opcode::kWrite, 2, lease, 200},
                                          {Opcode::kRead, 3, wire::MakeLeaseId(1, 0), 0}};
  b.clear();
  wire::Writer w(&b);
  w.U32(static_cast<uint32_t>(ops.size()));
  w.U32(0);
  for (const wire::BatchOp& op : ops) {
    const size_t at = b.size();
    b.resize(at + wire::kBatchOpSize);
    wire::EncodeBatchOp(op, b.data() + at);
  }
  const std::vector<uint8_t> batch_table = b;
  b.insert(b.end(), {1, 2, 3, 4, 5, 6});
  seeds.emplace_back("batch_request", Frame(Opcode::kBatch, 0, 9, b));
  b.clear();
  wire::Writer r(&b);
  r.U32(4);
  r.U32(0);
  for (uint32_t code : {0u, 0u, 0u, static_cast<uint32_t>(StatusCode::kExpired)}) r.U32(code);
  b.insert(b.end(), 8, 0xee);
  seeds.emplace_back("batch_reply", Frame(Opcode::kBatch, kReply, 9, b));

  seeds.emplace_back("rdma_token_request", Frame(Opcode::kRdmaToken, 0, 11, {}));
  b.clear();
  wire::EncodeRdmaTokenReply({token_bytes, 7412, 5000}, &b);
  seeds.emplace_back("rdma_token_reply", Frame(Opcode::kRdmaToken, kReply, 11, b));

  b.clear();
  wire::EncodeEvictNotice({{lease, wire::MakeLeaseId(5, 6)}, 2000}, &b);
  seeds.emplace_back("evict_notice_push", Frame(Opcode::kEvictNotice, wire::kFlagPush, 0, b));

  b.clear();
  wire::EncodeError(Expired("lease 0x1a2b00000003 is not held (freed, expired or evicted)"), &b);
  seeds.emplace_back("error_reply", Frame(Opcode::kRead, kReply, 10, b,
                                          static_cast<uint16_t>(StatusCode::kExpired)));

  // What a client sends first, back to back.
  std::vector<uint8_t> stream;
  AppendFrame(&stream, Opcode::kHello, 0, 1, hello_body);
  AppendFrame(&stream, Opcode::kAuth, 0, 2, auth_body);
  AppendFrame(&stream, Opcode::kStat, 0, 3, {});
  AppendFrame(&stream, Opcode::kRead, 0, 4, DataOpBytes(lease, 0, 1));
  seeds.emplace_back("stream_hello_auth_stat_read", stream);

  // Reading 2 of the target: selector byte, then a body.
  auto direct = [](uint8_t selector, std::vector<uint8_t> body) {
    body.insert(body.begin(), selector);
    return body;
  };
  // Selector 0xEA: decoder 0xA (BATCH) with body_len = the table + (0xE - 8) = 6 bytes, exactly
  // its write payload.
  seeds.emplace_back("direct_batch_table", direct(0xEA, batch_table));
  std::vector<uint8_t> range(24, 0xff);
  seeds.emplace_back("direct_range", direct(15, range));
  wire::RdmaToken token{};
  for (size_t i = 0; i < token.size(); ++i) token[i] = static_cast<uint8_t>(0xc0 + i);
  std::vector<uint8_t> connect(wire::kRdmaConnectDataSize);
  wire::EncodeRdmaConnectData(token, connect.data());
  connect.resize(56, 0);  // rdma_cm pads private data
  seeds.emplace_back("direct_rdma_connect_data", direct(14, connect));
  std::vector<uint8_t> reject(wire::kRdmaRejectDataSize);
  wire::EncodeRdmaRejectData(StatusCode::kUnauthenticated, reject.data());
  seeds.emplace_back("direct_rdma_reject_data", direct(14, reject));

  // Compaction offload requests (a daemon dials the hosts they name).
  wire::ParityEncodeRequest parity;
  parity.lease_id = lease;
  parity.offset = 65536;
  parity.length = 4096;
  parity.k = 2;
  parity.r = 1;
  parity.timeout_ms = 1000;
  parity.sources = {{"127.0.0.1", 7411, lease + 1, 0}, {"node-b.example", 7412, lease + 2, 4096}};
  std::vector<uint8_t> parity_body;
  wire::EncodeParityEncode(parity, &parity_body);
  seeds.emplace_back("parity_encode_request", Frame(Opcode::kParityEncode, 0, 12, parity_body));
  seeds.emplace_back("direct_parity_encode", direct(0x1F, parity_body));
  wire::GatherCellRequest gather;
  gather.lease_id = lease;
  gather.offset = 0;
  gather.length = 4096;
  gather.timeout_ms = 1000;
  gather.sources = parity.sources;
  gather.copies = {{0, 0, 0, 128}, {1, 256, 128, 64}, {0, 4000, 4000, 96}};
  std::vector<uint8_t> gather_body;
  wire::EncodeGatherCell(gather, &gather_body);
  seeds.emplace_back("gather_cell_request", Frame(Opcode::kGatherCell, 0, 13, gather_body));
  seeds.emplace_back("direct_gather_cell", direct(0x2F, gather_body));
  return seeds;
}

}  // namespace farmem::fuzz
