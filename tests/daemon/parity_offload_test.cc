// Compaction offload (docs/wire-protocol.md) against real farmemd processes.
// PARITY_ENCODE: the parity a daemon computes from data cells on other daemons is byte for byte
// what farmem::ec computes; after a data cell changes, offloading again gives the re-encoded
// parity; lost data cells decode from offloaded parity. GATHER_CELL: the cell a daemon assembles
// is exactly the named pieces over zeros. Every bad request gets the documented error reply and
// leaves the target cell alone, without hurting the daemon.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "daemon_client.h"
#include "farmem/common/auth.h"
#include "farmem/ec/reed_solomon.h"
#include "support/daemon_fixture.h"

namespace farmem::testing {
namespace {

constexpr int kK = 4;
constexpr int kR = 2;
constexpr uint32_t kCell = 64 << 10;
constexpr uint64_t kRowOffset = 3 * kCell;  // a row in the middle of the slab

class ParityOffloadTest : public ::testing::Test {
 protected:
  void SetUp() override { SetUpAs(""); }
  // `identity` empty: the client authenticates with the cluster secret.
  void SetUpAs(const std::string& identity) {
    daemons_ = std::make_unique<DaemonSet>(DaemonConfig{
        .capacity = "8M", .slab_size = "1M", .log_level = "warn", .extra_args = {"--no-mlock"}});
    ASSERT_TRUE(daemons_->Start(kK + kR).ok());
    id_ = RandomClientId();  // one client, as far as every daemon is concerned
    for (int m = 0; m < kK + kR; ++m) {
      auto c = DaemonClient::Connect((*daemons_)[m].endpoint(),
                                     auth::ClientKey(daemons_->secret(), identity), id_, identity);
      ASSERT_TRUE(c.has_value()) << c.error().ToString();
      clients_.push_back(std::make_unique<DaemonClient>(std::move(*c)));
      auto grants = clients_.back()->Alloc(1);
      ASSERT_TRUE(grants.has_value()) << grants.error().ToString();
      slabs_.push_back(transport::RemoteSlab::From((*grants)[0]));
      auto ch = clients_.back()->OpenChannel();
      ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
      channels_.push_back(std::move(*ch));
    }
    auto codec = ec::ReedSolomon::Create(kK, kR);
    ASSERT_TRUE(codec.has_value());
    codec_ = std::move(*codec);
    std::mt19937_64 rng(11);
    data_.assign(kK, std::vector<uint8_t>(kCell));
    for (auto& d : data_) {
      for (auto& b : d) b = static_cast<uint8_t>(rng());
    }
  }

  Status WriteData() {
    for (int m = 0; m < kK; ++m) {
      FARMEM_RETURN_IF_ERROR(channels_[m]->Write(slabs_[m], kRowOffset, data_[m]));
    }
    return Status::Ok();
  }

  wire::ParityEncodeRequest Request(int parity) {
    wire::ParityEncodeRequest req;
    req.lease_id = slabs_[kK + parity].lease_id;
    req.offset = kRowOffset;
    req.length = kCell;
    req.k = kK;
    req.r = kR;
    req.parity_index = static_cast<uint8_t>(parity);
    req.timeout_ms = 3000;
    for (int m = 0; m < kK; ++m) {
      const Endpoint ep = (*daemons_)[m].endpoint();
      req.sources.push_back({ep.host, ep.port, slabs_[m].lease_id, kRowOffset});
    }
    return req;
  }

  Status Offload(int parity, const wire::ParityEncodeRequest& req) {
    std::vector<uint8_t> body;
    wire::EncodeParityEncode(req, &body);
    return SendRaw(parity, body);
  }
  Status SendRaw(int parity, std::span<const uint8_t> body) {
    auto reply =
        clients_[kK + parity]->control().Call(wire::Opcode::kParityEncode, body, kCallTimeout);
    if (!reply.has_value()) return reply.error();
    if (!reply->empty()) return ProtocolError("PARITY_ENCODE reply has a body");
    return Status::Ok();
  }

  std::vector<uint8_t> ReadCell(int member) {
    std::vector<uint8_t> out(kCell);
    Status s = channels_[member]->Read(slabs_[member], kRowOffset, out);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return out;
  }

  std::vector<std::vector<uint8_t>> Expected() {
    std::vector<std::vector<uint8_t>> parity(kR, std::vector<uint8_t>(kCell));
    const uint8_t* in[kK];
    uint8_t* out[kR];
    for (int m = 0; m < kK; ++m) in[m] = data_[m].data();
    for (int j = 0; j < kR; ++j) out[j] = parity[j].data();
    EXPECT_TRUE(codec_->Encode(in, out, kCell).ok());
    return parity;
  }

  std::unique_ptr<DaemonSet> daemons_;
  wire::ClientId id_{};
  std::vector<std::unique_ptr<DaemonClient>> clients_;
  std::vector<transport::RemoteSlab> slabs_;
  std::vector<std::unique_ptr<transport::Channel>> channels_;
  std::unique_ptr<ec::ReedSolomon> codec_;
  std::vector<std::vector<uint8_t>> data_;
};

TEST_F(ParityOffloadTest, DaemonParityEqualsEncodeAndFollowsADataRewrite) {
  ASSERT_TRUE(WriteData().ok());
  // Stale bytes in the parity cells first: the offload overwrites, it does not accumulate.
  std::vector<uint8_t> junk(kCell, 0xA5);
  for (int j = 0; j < kR; ++j)
    ASSERT_TRUE(channels_[kK + j]->Write(slabs_[kK + j], kRowOffset, junk).ok());
  for (int j = 0; j < kR; ++j) {
    Status s = Offload(j, Request(j));
    ASSERT_TRUE(s.ok()) << s.ToString() << daemons_->Logs();
  }
  auto want = Expected();
  for (int j = 0; j < kR; ++j) EXPECT_TRUE(ReadCell(kK + j) == want[j]) << "parity " << j;

  // A data cell is rewritten: offloading again gives the parity of the new data.
  for (size_t i = 0; i < kCell; i += 7) data_[1][i] ^= static_cast<uint8_t>(i | 1);
  ASSERT_TRUE(channels_[1]->Write(slabs_[1], kRowOffset, data_[1]).ok());
  for (int j = 0; j < kR; ++j) ASSERT_TRUE(Offload(j, Request(j)).ok());
  want = Expected();
  for (int j = 0; j < kR; ++j) EXPECT_TRUE(ReadCell(kK + j) == want[j]) << "parity " << j;
}

TEST_F(ParityOffloadTest, LostDataCellDecodesFromOffloadedParity) {
  ASSERT_TRUE(WriteData().ok());
  for (int j = 0; j < kR; ++j) ASSERT_TRUE(Offload(j, Request(j)).ok());
  std::vector<std::vector<uint8_t>> frags(kK + kR, std::vector<uint8_t>(kCell));
  // Data members 0 and 2 die: r = 2 losses, rebuilt from members 1, 3 and both parities.
  (*daemons_)[0].Kill();
  (*daemons_)[2].Kill();
  const int present[] = {1, 3, 4, 5};
  for (int m : present) frags[m] = ReadCell(m);
  uint8_t* ptrs[kK + kR];
  for (int m = 0; m < kK + kR; ++m) ptrs[m] = frags[m].data();
  ASSERT_TRUE(codec_->ReconstructData(ptrs, present, kCell).ok());
  EXPECT_TRUE(frags[0] == data_[0]);
  EXPECT_TRUE(frags[2] == data_[2]);
}

TEST_F(ParityOffloadTest, BadRequestsGetErrorsAndLeaveTheCellAlone) {
  ASSERT_TRUE(WriteData().ok());
  ASSERT_TRUE(Offload(0, Request(0)).ok());
  const std::vector<uint8_t> good_parity = ReadCell(kK);
  std::vector<uint8_t> base;
  wire::EncodeParityEncode(Request(0), &base);
  struct Case {
    const char* what;
    std::function<void(std::vector<uint8_t>&)> mutate;
    StatusCode code;
  };
  auto set8 = [](size_t at, uint8_t v) { return [=](std::vector<uint8_t>& b) { b[at] = v; }; };
  auto set32 = [](size_t at, uint32_t v) {
    return [=](std::vector<uint8_t>& b) { std::memcpy(&b[at], &v, 4); };
  };
  auto set64 = [](size_t at, uint64_t v) {
    return [=](std::vector<uint8_t>& b) { std::memcpy(&b[at], &v, 8); };
  };
  const size_t src1 = wire::kParityEncodeFixedSize + 24 + (*daemons_)[0].endpoint().host.size();
  const std::vector<Case> cases = {
      {"k = 0", set8(20, 0), StatusCode::kInvalidArgument},
      {"r = 0", set8(21, 0), StatusCode::kInvalidArgument},
      {"k + r > 32", set8(21, 40), StatusCode::kInvalidArgument},
      {"parity index >= r", set8(22, 2), StatusCode::kInvalidArgument},
      {"reserved byte", set8(23, 1), StatusCode::kProtocolError},
      {"length 0", set32(16, 0), StatusCode::kInvalidArgument},
      {"length > 16 MiB", set32(16, (16u << 20) + 1), StatusCode::kInvalidArgument},
      {"timeout 0", set32(24, 0), StatusCode::kInvalidArgument},
      {"timeout > 60 s", set32(24, 60001), StatusCode::kInvalidArgument},
      {"truncated", [](std::vector<uint8_t>& b) { b.resize(b.size() - 3); },
       StatusCode::kProtocolError},
      {"trailing bytes", [](std::vector<uint8_t>& b) { b.push_back(0); },
       StatusCode::kProtocolError},
      {"only the fixed part", [](std::vector<uint8_t>& b) { b.resize(32); },
       StatusCode::kProtocolError},
      {"source host length 0", set8(wire::kParityEncodeFixedSize + 18, 0),
       StatusCode::kInvalidArgument},
      {"source host with a slash", set8(wire::kParityEncodeFixedSize + 24, '/'),
       StatusCode::kInvalidArgument},
      {"source port 0",
       [](std::vector<uint8_t>& b) {
         b[wire::kParityEncodeFixedSize + 16] = 0, b[wire::kParityEncodeFixedSize + 17] = 0;
       },
       StatusCode::kInvalidArgument},
      {"target lease not ours", set64(0, 0x12345678), StatusCode::kNotFound},
      {"target range past the slab", set64(8, (1u << 20) - 100), StatusCode::kOutOfRange},
      {"source lease unknown", set64(src1, 0x777), StatusCode::kUnavailable},
      {"source offset past its slab", set64(src1 + 8, 1u << 20), StatusCode::kUnavailable},
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> body = base;
    c.mutate(body);
    Status s = SendRaw(0, body);
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s.ToString();
    EXPECT_FALSE(s.message().empty()) << c.what;
  }
  // A source daemon that is down: Unavailable, naming it.
  const Endpoint dead = (*daemons_)[3].endpoint();
  (*daemons_)[3].Kill();
  Status s = Offload(0, Request(0));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find(dead.ToString()), std::string::npos) << s.ToString();
  // Nothing above touched the parity cell, and the daemon still serves.
  EXPECT_TRUE(ReadCell(kK) == good_parity);
  EXPECT_TRUE(ProcessAlive((*daemons_)[kK].pid())) << daemons_->Logs();
  auto st = clients_[kK]->Stat();
  EXPECT_TRUE(st.has_value());
}

// GATHER_CELL: the target becomes zeros plus the named pieces of the source cells, in order.
TEST_F(ParityOffloadTest, GatherBuildsACellFromPiecesOfOtherCells) {
  ASSERT_TRUE(WriteData().ok());
  const uint64_t target_off = kRowOffset + kCell;  // another row on daemon 2
  std::vector<uint8_t> junk(kCell, 0x5A);
  ASSERT_TRUE(channels_[2]->Write(slabs_[2], target_off, junk).ok());
  wire::GatherCellRequest req;
  req.lease_id = slabs_[2].lease_id;
  req.offset = target_off;
  req.length = kCell;
  req.timeout_ms = 3000;
  for (int m : {0, 1, 2}) {  // daemon 2 reads its own cell too, like any other
    const Endpoint ep = (*daemons_)[m].endpoint();
    req.sources.push_back({ep.host, ep.port, slabs_[m].lease_id, kRowOffset});
  }
  req.copies = {{0, 100, 0, 500},
                {1, 0, 1000, 4096},
                {2, 7, 9000, 300},
                {0, kCell - 10, kCell - 10, 10},
                {1, 50, 1000, 8}};  // the last overwrites
  std::vector<uint8_t> want(kCell, 0);
  for (const auto& c : req.copies) {
    std::memcpy(want.data() + c.dst_offset, data_[c.source].data() + c.src_offset, c.length);
  }
  std::vector<uint8_t> body;
  wire::EncodeGatherCell(req, &body);
  auto reply = clients_[2]->control().Call(wire::Opcode::kGatherCell, body, kCallTimeout);
  ASSERT_TRUE(reply.has_value()) << reply.error().ToString() << daemons_->Logs();
  std::vector<uint8_t> got(kCell);
  ASSERT_TRUE(channels_[2]->Read(slabs_[2], target_off, got).ok());
  EXPECT_TRUE(got == want);

  // Bad requests: the documented error, the cell stays as it is.
  struct Case {
    const char* what;
    std::function<void(wire::GatherCellRequest&)> mutate;
    StatusCode code;
  };
  const std::vector<Case> cases = {
      {"copy from a source that is not listed",
       [](wire::GatherCellRequest& r) { r.copies[0].source = 3; }, StatusCode::kInvalidArgument},
      {"copy past the end of the cell",
       [](wire::GatherCellRequest& r) { r.copies[1].dst_offset = kCell - 100; },
       StatusCode::kInvalidArgument},
      {"copy of 0 bytes", [](wire::GatherCellRequest& r) { r.copies[2].length = 0; },
       StatusCode::kInvalidArgument},
      {"33 sources",
       [](wire::GatherCellRequest& r) {
         while (r.sources.size() < 33) r.sources.push_back(r.sources[0]);
       },
       StatusCode::kInvalidArgument},
      {"source lease unknown", [](wire::GatherCellRequest& r) { r.sources[1].lease_id = 0x777; },
       StatusCode::kUnavailable},
      {"target range past the slab",
       [](wire::GatherCellRequest& r) { r.offset = (1u << 20) - 100; }, StatusCode::kOutOfRange},
      {"timeout 0", [](wire::GatherCellRequest& r) { r.timeout_ms = 0; },
       StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    wire::GatherCellRequest bad = req;
    c.mutate(bad);
    body.clear();
    wire::EncodeGatherCell(bad, &body);
    auto r = clients_[2]->control().Call(wire::Opcode::kGatherCell, body, kCallTimeout);
    ASSERT_FALSE(r.has_value()) << c.what;
    EXPECT_EQ(r.error().code(), c.code) << c.what << ": " << r.error().ToString();
  }
  // A copy count the body cannot hold, and a body cut short.
  body.clear();
  wire::EncodeGatherCell(req, &body);
  std::vector<uint8_t> lying = body;
  const uint32_t huge = 0x10000000;
  std::memcpy(&lying[28], &huge, 4);
  auto r = clients_[2]->control().Call(wire::Opcode::kGatherCell, lying, kCallTimeout);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kProtocolError) << r.error().ToString();
  body.resize(body.size() - 5);
  r = clients_[2]->control().Call(wire::Opcode::kGatherCell, body, kCallTimeout);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kProtocolError) << r.error().ToString();
  ASSERT_TRUE(channels_[2]->Read(slabs_[2], target_off, got).ok());
  EXPECT_TRUE(got == want) << "a failed GATHER_CELL changed the cell";

  // No sources, no copies: a zero cell.
  wire::GatherCellRequest zero = req;
  zero.sources.clear();
  zero.copies.clear();
  body.clear();
  wire::EncodeGatherCell(zero, &body);
  ASSERT_TRUE(clients_[2]->control().Call(wire::Opcode::kGatherCell, body, kCallTimeout));
  ASSERT_TRUE(channels_[2]->Read(slabs_[2], target_off, got).ok());
  EXPECT_TRUE(got == std::vector<uint8_t>(kCell, 0));
  EXPECT_TRUE(ProcessAlive((*daemons_)[2].pid())) << daemons_->Logs();
}

}  // namespace
}  // namespace farmem::testing

namespace farmem::testing {
namespace {

// With identities (issue 16): the offloading daemon reads the source cells as the client's own
// identity (it derives the key from the cluster secret), so offload works for a named client —
// and a client of another name cannot use PARITY_ENCODE to have a daemon read someone else's
// cells into its own lease.
class ParityOffloadAsIdentityTest : public ParityOffloadTest {
 protected:
  void SetUp() override { SetUpAs("tenant-a"); }
};

TEST_F(ParityOffloadAsIdentityTest, OffloadWorksForANamedClient) {
  ASSERT_TRUE(WriteData().ok());
  for (int j = 0; j < kR; ++j) {
    Status s = Offload(j, Request(j));
    ASSERT_TRUE(s.ok()) << s.ToString() << daemons_->Logs();
  }
  auto want = Expected();
  for (int j = 0; j < kR; ++j) EXPECT_TRUE(ReadCell(kK + j) == want[j]) << "parity " << j;
}

TEST_F(ParityOffloadAsIdentityTest, AnotherNameCannotOffloadFromThisNamesCells) {
  ASSERT_TRUE(WriteData().ok());
  // "tenant-b", with tenant-a's client id, leases a target on the parity daemon and asks it to
  // encode tenant-a's data cells into it.
  const int target = kK;
  auto b = DaemonClient::Connect((*daemons_)[target].endpoint(),
                                 auth::ClientKey(daemons_->secret(), "tenant-b"), id_, "tenant-b");
  ASSERT_TRUE(b.has_value()) << b.error().ToString();
  auto grant = b->Alloc(1);
  ASSERT_TRUE(grant.has_value()) << grant.error().ToString();
  wire::ParityEncodeRequest req = Request(0);
  req.lease_id = (*grant)[0].lease_id;
  std::vector<uint8_t> body;
  wire::EncodeParityEncode(req, &body);
  auto reply = b->control().Call(wire::Opcode::kParityEncode, body, kCallTimeout);
  ASSERT_FALSE(reply.has_value()) << "tenant-b had tenant-a's cells encoded into its lease";
  // The source daemon refused the read (the offloading daemon reports its sources as
  // Unavailable: the client falls back to moving bytes itself).
  EXPECT_THAT(reply.error().message(), ::testing::HasSubstr("belongs to another client"))
      << reply.error().ToString();
  // What tenant-b can read back of its lease is zeros, not parity of tenant-a's data.
  auto ch = b->OpenChannel();
  ASSERT_TRUE(ch.has_value());
  std::vector<uint8_t> got(kCell);
  ASSERT_TRUE((*ch)->Read(transport::RemoteSlab::From((*grant)[0]), kRowOffset, got).ok());
  EXPECT_EQ(got, std::vector<uint8_t>(kCell, 0));
}

}  // namespace
}  // namespace farmem::testing
