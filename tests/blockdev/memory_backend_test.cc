#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "farmem/blockdev/block_backend.h"
#include "nbd_test_client.h"

namespace farmem::blockdev {
namespace {

using testing::Pattern;

TEST(MemoryBackend, RejectsSizesThatAreNotMultiplesOf512) {
  EXPECT_FALSE(MemoryBackend::Create(0).has_value());
  EXPECT_FALSE(MemoryBackend::Create(1000).has_value());
  EXPECT_EQ(MemoryBackend::Create(1000).error().code(), StatusCode::kInvalidArgument);
}

TEST(MemoryBackend, StartsZeroedAndReadsBackWrites) {
  auto b = MemoryBackend::Create(4u << 20);
  ASSERT_TRUE(b.has_value());
  MemoryBackend& mem = **b;
  EXPECT_EQ(mem.size(), 4u << 20);
  std::vector<uint8_t> buf(8192, 0xff);
  ASSERT_TRUE(mem.Read(0, buf).ok());
  EXPECT_EQ(buf, std::vector<uint8_t>(8192, 0));

  // Crosses a 1 MiB lock region boundary.
  const auto data = Pattern(3u << 20, 1);
  ASSERT_TRUE(mem.Write(512, data, /*fua=*/true).ok());
  std::vector<uint8_t> back(data.size());
  ASSERT_TRUE(mem.Read(512, back).ok());
  EXPECT_EQ(back, data);
}

TEST(MemoryBackend, TrimAndWriteZeroesReadBackAsZero) {
  auto b = MemoryBackend::Create(1u << 20);
  ASSERT_TRUE(b.has_value());
  MemoryBackend& mem = **b;
  ASSERT_TRUE(mem.Write(0, Pattern(1u << 20, 2), false).ok());
  ASSERT_TRUE(mem.WriteZeroes(4096, 4096, /*may_trim=*/false, false).ok());
  ASSERT_TRUE(mem.Trim(65536, 512, false).ok());
  std::vector<uint8_t> z(4096);
  ASSERT_TRUE(mem.Read(4096, z).ok());
  EXPECT_EQ(z, std::vector<uint8_t>(4096, 0));
  std::vector<uint8_t> t(512);
  ASSERT_TRUE(mem.Read(65536, t).ok());
  EXPECT_EQ(t, std::vector<uint8_t>(512, 0));
  std::vector<uint8_t> kept(512);
  ASSERT_TRUE(mem.Read(8192, kept).ok());
  EXPECT_NE(kept, std::vector<uint8_t>(512, 0));
}

TEST(MemoryBackend, OutOfRangeIsAnErrorNotACrash) {
  auto b = MemoryBackend::Create(1u << 20);
  ASSERT_TRUE(b.has_value());
  MemoryBackend& mem = **b;
  std::vector<uint8_t> buf(1024);
  EXPECT_EQ(mem.Read((1u << 20) - 512, buf).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(mem.Write(UINT64_MAX - 511, buf, false).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(mem.WriteZeroes(0, UINT64_MAX, true, false).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(mem.Trim(1u << 20, 1, false).code(), StatusCode::kOutOfRange);
}

TEST(MemoryBackend, ExecuteBatchRunsEveryOpAndReportsEach) {
  auto b = MemoryBackend::Create(1u << 20);
  ASSERT_TRUE(b.has_value());
  const auto data = Pattern(4096, 3);
  std::vector<uint8_t> out(4096);
  BlockOp ops[4];
  ops[0].kind = BlockOp::Kind::kWrite;
  ops[0].offset = 8192;
  ops[0].length = 4096;
  ops[0].data = data;
  ops[1].kind = BlockOp::Kind::kFlush;
  ops[2].kind = BlockOp::Kind::kRead;
  ops[2].offset = 1u << 20;  // out of range
  ops[2].length = 4096;
  ops[2].read_into = out;
  ops[3].kind = BlockOp::Kind::kWriteZeroes;
  ops[3].offset = 0;
  ops[3].length = 512;
  (*b)->ExecuteBatch(ops);
  EXPECT_TRUE(ops[0].status.ok());
  EXPECT_TRUE(ops[1].status.ok());
  EXPECT_EQ(ops[2].status.code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(ops[3].status.ok());
  ASSERT_TRUE((*b)->Read(8192, out).ok());
  EXPECT_EQ(out, data);
}

// Many threads writing and reading overlapping ranges: no crash, no data race (run under TSan
// with FARMEM_TSAN), and every 512-byte block holds one writer's whole block afterwards.
TEST(MemoryBackend, ConcurrentOverlappingAccessIsSafe) {
  auto b = MemoryBackend::Create(4u << 20);
  ASSERT_TRUE(b.has_value());
  MemoryBackend& mem = **b;
  std::atomic<bool> failed{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<uint8_t> block(512, static_cast<uint8_t>(t + 1));
      std::vector<uint8_t> buf(64 * 1024);
      for (int i = 0; i < 2000; ++i) {
        const uint64_t off = (static_cast<uint64_t>(i * 7919 + t) % 8192) * 512;
        if (!mem.Write(off, block, false).ok()) failed = true;
        if (!mem.Read((off / 65536) * 65536 % ((4u << 20) - 65536), buf).ok()) failed = true;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(failed.load());
  std::vector<uint8_t> all(4u << 20);
  ASSERT_TRUE(mem.Read(0, all).ok());
  for (size_t blk = 0; blk < all.size() / 512; ++blk) {
    const uint8_t first = all[blk * 512];
    for (size_t i = 1; i < 512; ++i) {
      ASSERT_EQ(all[blk * 512 + i], first) << "torn 512-byte block " << blk;
    }
  }
}

}  // namespace
}  // namespace farmem::blockdev
