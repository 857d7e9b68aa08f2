// The TCP channel's reply parsing against a real farmemd: the one-shot receive of an expected
// success, and everything that is not one (failed ops inside a BATCH, error frames, several frames
// in flight), each checked op by op, with the channel still working afterwards.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "daemon_client.h"
#include "support/daemon_fixture.h"

namespace farmem::testing {
namespace {

using transport::Channel;
using transport::Completion;
using transport::Op;
using transport::OpType;
using transport::RemoteSlab;

constexpr uint32_t kSlab = 1u << 20;

class TcpChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemons_ = std::make_unique<DaemonSet>(
        DaemonConfig{.capacity = "4M", .slab_size = "1M", .extra_args = {"--no-mlock"}});
    ASSERT_TRUE(daemons_->Start(1).ok()) << daemons_->Logs();
    auto c = DaemonClient::Connect((*daemons_)[0].endpoint(), daemons_->secret(), RandomClientId());
    ASSERT_TRUE(c.has_value()) << c.error().ToString();
    client_ = std::make_unique<DaemonClient>(std::move(*c));
    auto grants = client_->Alloc(2);
    ASSERT_TRUE(grants.has_value()) << grants.error().ToString();
    for (const wire::LeaseGrant& g : *grants) slabs_.push_back(RemoteSlab::From(g));
    auto ch = client_->OpenChannel(2048);
    ASSERT_TRUE(ch.has_value()) << ch.error().ToString();
    channel_ = std::move(*ch);
    ASSERT_STREQ(channel_->kind(), "tcp");
    // Known contents: slab s byte i = f(s, i).
    std::vector<uint8_t> buf(kSlab);
    for (size_t s = 0; s < slabs_.size(); ++s) {
      for (uint32_t i = 0; i < kSlab; ++i) buf[i] = Pattern(s, i);
      ASSERT_TRUE(RunOne({OpType::kWrite, slabs_[s], 0, buf.data(), kSlab}).ok());
    }
  }

  static uint8_t Pattern(size_t slab, uint32_t i) {
    return static_cast<uint8_t>((i * 2654435761u >> 13) ^ (slab * 77));
  }

  // Posts every op, flushes once (as one or more frames), reaps all; statuses by op index.
  std::vector<Status> Run(std::vector<Op> ops) {
    for (size_t i = 0; i < ops.size(); ++i) {
      ops[i].user_data = i;
      Status s = channel_->Post(ops[i]);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    Status f = channel_->Flush();
    EXPECT_TRUE(f.ok()) << f.ToString();
    std::vector<Status> out(ops.size(), Internal("no completion"));
    size_t got = 0;
    Completion comps[64];
    while (got < ops.size()) {
      auto n = channel_->Poll(comps, std::chrono::milliseconds(2000));
      EXPECT_TRUE(n.has_value()) << n.error().ToString();
      if (!n.has_value()) break;
      for (size_t i = 0; i < *n; ++i) out[comps[i].user_data] = comps[i].status;
      got += *n;
    }
    return out;
  }
  Status RunOne(Op op) { return Run({op})[0]; }

  Op Read(size_t slab, uint32_t offset, uint8_t* dst, uint32_t len) {
    return {OpType::kRead, slabs_[slab], offset, dst, len};
  }
  bool Holds(size_t slab, uint32_t offset, const uint8_t* got, uint32_t len) {
    for (uint32_t i = 0; i < len; ++i) {
      if (got[i] != Pattern(slab, offset + i)) return false;
    }
    return true;
  }

  RemoteSlab Bogus() const {
    RemoteSlab b = slabs_[0];
    b.lease_id ^= 0x5a5a000000000000ull;  // no such lease
    return b;
  }

  std::unique_ptr<DaemonSet> daemons_;
  std::unique_ptr<DaemonClient> client_;
  std::vector<RemoteSlab> slabs_;
  std::unique_ptr<Channel> channel_;
};

TEST_F(TcpChannelTest, BatchOfReadsLandsEachInPlace) {
  std::vector<uint8_t> buf(16 * 4096);
  std::vector<Op> ops;
  for (uint32_t i = 0; i < 16; ++i) ops.push_back(Read(i % 2, i * 12288, &buf[i * 4096], 4096));
  for (const Status& s : Run(ops)) EXPECT_TRUE(s.ok()) << s.ToString();
  for (uint32_t i = 0; i < 16; ++i) EXPECT_TRUE(Holds(i % 2, i * 12288, &buf[i * 4096], 4096)) << i;
}

TEST_F(TcpChannelTest, FailedReadsInsideABatchFailAloneAndTheOthersGetTheirData) {
  std::vector<uint8_t> buf(8 * 4096);
  std::vector<Op> ops;
  for (uint32_t i = 0; i < 8; ++i) ops.push_back(Read(0, i * 4096, &buf[i * 4096], 4096));
  ops[2].slab = Bogus();
  ops[5].offset = kSlab - 100;  // past the end of the slab
  const std::vector<Status> st = Run(ops);
  for (uint32_t i = 0; i < 8; ++i) {
    if (i == 2 || i == 5) {
      EXPECT_FALSE(st[i].ok()) << i;
      EXPECT_NE(st[i].message().find("read of 4096 bytes"), std::string::npos) << st[i].ToString();
    } else {
      EXPECT_TRUE(st[i].ok()) << i << ": " << st[i].ToString();
      EXPECT_TRUE(Holds(0, i * 4096, &buf[i * 4096], 4096)) << i;
    }
  }
  // The stream is still in step.
  std::vector<uint8_t> one(4096);
  ASSERT_TRUE(RunOne(Read(1, 8192, one.data(), 4096)).ok());
  EXPECT_TRUE(Holds(1, 8192, one.data(), 4096));
}

TEST_F(TcpChannelTest, FailedWriteInsideABatchOfReadsAndWrites) {
  std::vector<uint8_t> buf(4 * 4096), data(4096, 0xee);
  std::vector<Op> ops = {Read(0, 0, &buf[0], 4096), Read(1, 4096, &buf[4096], 4096)};
  ops.push_back({OpType::kWrite, Bogus(), 0, data.data(), 4096});
  ops.push_back(Read(0, 65536, &buf[8192], 4096));
  const std::vector<Status> st = Run(ops);
  EXPECT_TRUE(st[0].ok() && st[1].ok() && st[3].ok());
  EXPECT_FALSE(st[2].ok());
  EXPECT_NE(st[2].message().find("write of 4096 bytes"), std::string::npos) << st[2].ToString();
  EXPECT_TRUE(Holds(0, 0, &buf[0], 4096));
  EXPECT_TRUE(Holds(1, 4096, &buf[4096], 4096));
  EXPECT_TRUE(Holds(0, 65536, &buf[8192], 4096));
}

TEST_F(TcpChannelTest, LoneOpErrorFrameThenTheChannelGoesOn) {
  std::vector<uint8_t> buf(4096);
  Status s = RunOne({OpType::kRead, Bogus(), 0, buf.data(), 4096});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.code(), StatusCode::kOk);
  std::vector<uint8_t> data(4096, 0x11);
  s = RunOne({OpType::kWrite, Bogus(), 0, data.data(), 4096});
  EXPECT_FALSE(s.ok());
  ASSERT_TRUE(RunOne(Read(1, 4096 * 7, buf.data(), 4096)).ok());
  EXPECT_TRUE(Holds(1, 4096 * 7, buf.data(), 4096));
}

TEST_F(TcpChannelTest, SeveralFramesInFlightWithFailuresMixedIn) {
  // More ops than one BATCH frame carries: the flush sends several frames back to back.
  std::mt19937 rng(7);
  const size_t n = 1500;
  std::vector<uint8_t> buf(n * 512);
  std::vector<Op> ops;
  std::vector<std::pair<size_t, uint32_t>> where;
  for (size_t i = 0; i < n; ++i) {
    const size_t slab = rng() % 2;
    const uint32_t off = (rng() % (kSlab / 512)) * 512;
    ops.push_back(Read(slab, off, &buf[i * 512], 512));
    where.push_back({slab, off});
    if (i % 97 == 3) ops.back().slab = Bogus();
  }
  const std::vector<Status> st = Run(ops);
  for (size_t i = 0; i < n; ++i) {
    if (i % 97 == 3) {
      EXPECT_FALSE(st[i].ok()) << i;
    } else {
      ASSERT_TRUE(st[i].ok()) << i << ": " << st[i].ToString();
      ASSERT_TRUE(Holds(where[i].first, where[i].second, &buf[i * 512], 512)) << i;
    }
  }
  EXPECT_FALSE(channel_->broken());
}

}  // namespace
}  // namespace farmem::testing
