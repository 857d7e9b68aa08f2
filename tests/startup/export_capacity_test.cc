// The arithmetic of farmem-nbd's start-time capacity check (export_capacity.h): what an export
// needs at each resilience, that a group needs distinct daemons, and how down daemons count.
#include "export_capacity.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

namespace farmem::blockdev {
namespace {

using ::testing::HasSubstr;
using Verdict = ExportCapacity::Verdict;

constexpr uint64_t kMiB = 1 << 20;

Resilience Res(std::string_view text) { return Resilience::Parse(text).value(); }

std::vector<DaemonSpace> Daemons(std::vector<uint64_t> free_mib, uint64_t capacity_mib) {
  std::vector<DaemonSpace> out;
  for (size_t i = 0; i < free_mib.size(); ++i) {
    out.push_back(
        {{"10.0.0." + std::to_string(i + 1), 7411}, true, free_mib[i] * kMiB, capacity_mib * kMiB});
  }
  return out;
}

// The issue's case: 1 GiB at ec:4+2 on six daemons of 192 MiB in slabs of 64 MiB.
TEST(ExportCapacity, IssueCaseIsTooBigAndSaysWhatFits) {
  const auto c = CheckExportCapacity(1024 * kMiB, Res("ec:4+2"), 64 * kMiB,
                                     Daemons({192, 192, 192, 192, 192, 192}, 192));
  EXPECT_EQ(c.verdict, Verdict::kTooBig);
  EXPECT_EQ(c.needed_bytes, 1536 * kMiB);  // size * (k+r)/k
  EXPECT_EQ(c.free_bytes, 1152 * kMiB);
  EXPECT_EQ(c.largest_fitting, 768 * kMiB);
  EXPECT_THAT(c.Describe(), HasSubstr("an export of 1 GiB at ec:4+2 needs 1.5 GiB of daemon "
                                      "memory (24 slabs of 64 MiB); 6 of 6 daemons answered"));
  EXPECT_THAT(c.Describe(), HasSubstr("10.0.0.1:7411 192 MiB free of 192 MiB"));
}

TEST(ExportCapacity, NeedIsSizeTimesGroupOverDataWidthInWholeSlabs) {
  const auto daemons = Daemons({64, 64, 64, 64}, 64);
  EXPECT_EQ(CheckExportCapacity(10 * kMiB, Res("none"), kMiB, daemons).needed_bytes, 10 * kMiB);
  EXPECT_EQ(CheckExportCapacity(10 * kMiB, Res("replicate:3"), kMiB, daemons).needed_bytes,
            30 * kMiB);
  EXPECT_EQ(CheckExportCapacity(10 * kMiB, Res("ec:2+1"), kMiB, daemons).needed_bytes, 15 * kMiB);
  // A partial extent still takes whole slabs: 4 KiB at ec:2+2 maps one group of four.
  EXPECT_EQ(CheckExportCapacity(4096, Res("ec:2+2"), kMiB, daemons).needed_bytes, 4 * kMiB);
}

TEST(ExportCapacity, FitsExactlyAtTheBoundary) {
  const auto daemons = Daemons({16, 16, 16}, 16);
  EXPECT_EQ(CheckExportCapacity(32 * kMiB, Res("ec:2+1"), kMiB, daemons).verdict, Verdict::kFits);
  EXPECT_EQ(CheckExportCapacity(34 * kMiB, Res("ec:2+1"), kMiB, daemons).verdict, Verdict::kTooBig);
}

// Free memory on one daemon cannot hold two members of one group.
TEST(ExportCapacity, GroupsNeedDistinctDaemons) {
  const auto c = CheckExportCapacity(4 * kMiB, Res("ec:2+1"), kMiB, Daemons({30, 1, 1}, 30));
  EXPECT_EQ(c.free_bytes, 32 * kMiB);  // plenty in sum...
  EXPECT_EQ(c.needed_bytes, 6 * kMiB);
  EXPECT_EQ(c.verdict, Verdict::kTooBig);  // ...but only one group of three distinct daemons
  EXPECT_EQ(c.largest_fitting, 2 * kMiB);
}

TEST(ExportCapacity, DownDaemonsTurnARefusalIntoAWarningOnlyIfTheirReturnWouldDo) {
  auto daemons = Daemons({16, 16, 16}, 16);
  daemons[2] = {{"10.0.0.3", 7411}, false, 0, 0};
  const auto returns = CheckExportCapacity(20 * kMiB, Res("replicate:2"), kMiB, daemons);
  EXPECT_EQ(returns.verdict, Verdict::kFitsIfPeersReturn);
  EXPECT_EQ(returns.daemons_down, 1u);
  EXPECT_THAT(returns.Describe(), HasSubstr("2 of 3 daemons answered"));
  EXPECT_THAT(returns.Describe(), HasSubstr("10.0.0.3:7411 down"));
  EXPECT_EQ(CheckExportCapacity(40 * kMiB, Res("replicate:2"), kMiB, daemons).verdict,
            Verdict::kTooBig);
  EXPECT_EQ(CheckExportCapacity(16 * kMiB, Res("replicate:2"), kMiB, daemons).verdict,
            Verdict::kFits);
}

}  // namespace
}  // namespace farmem::blockdev
