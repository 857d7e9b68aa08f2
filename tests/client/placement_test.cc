// Power-of-two-choices, the pure part: sampling is uniform and distinct, ranking prefers free
// slabs, and together they keep equal daemons balanced.
#include "farmem/client/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

namespace farmem::client {
namespace {

TEST(SampleDistinct, ReturnsDistinctMembersOfTheCandidates) {
  std::mt19937_64 rng(1);
  const std::vector<NodeId> candidates = {3, 5, 8, 13, 21};
  for (int i = 0; i < 1000; ++i) {
    auto picks = SampleDistinct(candidates, 2, rng);
    ASSERT_EQ(picks.size(), 2u);
    EXPECT_NE(picks[0], picks[1]);
    for (NodeId p : picks) {
      EXPECT_NE(std::find(candidates.begin(), candidates.end(), p), candidates.end());
    }
  }
}

TEST(SampleDistinct, FewerCandidatesThanChoicesGivesThemAll) {
  std::mt19937_64 rng(2);
  const std::vector<NodeId> one = {7};
  EXPECT_EQ(SampleDistinct(one, 2, rng), one);
  EXPECT_TRUE(SampleDistinct(std::vector<NodeId>{}, 2, rng).empty());
  const std::vector<NodeId> three = {1, 2, 3};
  auto all = SampleDistinct(three, 5, rng);
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, three);
}

TEST(SampleDistinct, IsUniform) {
  std::mt19937_64 rng(3);
  const std::vector<NodeId> candidates = {0, 1, 2, 3, 4};
  std::map<NodeId, int> hits;
  std::map<NodeId, int> first;
  constexpr int kDraws = 50000;
  for (int i = 0; i < kDraws; ++i) {
    auto picks = SampleDistinct(candidates, 2, rng);
    ++first[picks[0]];
    for (NodeId p : picks) ++hits[p];
  }
  for (NodeId c : candidates) {
    EXPECT_NEAR(hits[c], kDraws * 2 / 5, kDraws * 2 / 5 / 20) << "node " << c;  // within 5%
    EXPECT_NEAR(first[c], kDraws / 5, kDraws / 5 / 20) << "node " << c;  // order is random too
  }
}

TEST(RankByFreeSlabs, MostFreeFirstSkippingFullAndUnreachable) {
  const std::vector<PlacementChoice> choices = {
      {.node = 0, .free_slabs = 3}, {.node = 1, .free_slabs = 0},
      {.node = 2, .free_slabs = 9}, {.node = 3, .free_slabs = 50, .reachable = false},
      {.node = 4, .free_slabs = 5},
  };
  EXPECT_EQ(RankByFreeSlabs(choices), (std::vector<NodeId>{2, 4, 0}));
}

TEST(RankByFreeSlabs, TiesKeepTheSampledOrder) {
  const std::vector<PlacementChoice> ab = {{.node = 4, .free_slabs = 2},
                                           {.node = 1, .free_slabs = 2}};
  EXPECT_EQ(RankByFreeSlabs(ab), (std::vector<NodeId>{4, 1}));
  const std::vector<PlacementChoice> ba = {{.node = 1, .free_slabs = 2},
                                           {.node = 4, .free_slabs = 2}};
  EXPECT_EQ(RankByFreeSlabs(ba), (std::vector<NodeId>{1, 4}));
}

TEST(RankByFreeSlabs, NothingFreeMeansNoChoice) {
  const std::vector<PlacementChoice> full = {{.node = 0, .free_slabs = 0},
                                             {.node = 1, .free_slabs = 0}};
  EXPECT_TRUE(RankByFreeSlabs(full).empty());
}

// The property the cluster relies on: with two choices the fullest daemon stays within a few slabs
// of the average (O(log log n)), where one random choice drifts like a random walk.
TEST(TwoChoices, KeepsEqualDaemonsBalanced) {
  for (size_t nodes : {2u, 3u, 5u, 8u}) {
    std::mt19937_64 rng(nodes);
    std::vector<NodeId> ids(nodes);
    for (NodeId i = 0; i < nodes; ++i) ids[i] = i;
    constexpr uint32_t kCapacity = 100000;
    constexpr int kSlabs = 20000;
    std::vector<uint32_t> two(nodes, 0);
    std::vector<uint32_t> one(nodes, 0);
    double worst_two = 0;
    double worst_one = 0;
    for (int slab = 1; slab <= kSlabs; ++slab) {
      std::vector<PlacementChoice> choices;
      for (NodeId p : SampleDistinct(ids, 2, rng)) choices.push_back({p, kCapacity - two[p]});
      const auto order = RankByFreeSlabs(choices);
      ASSERT_FALSE(order.empty());
      ++two[order.front()];
      ++one[SampleDistinct(ids, 1, rng).front()];
      const double average = static_cast<double>(slab) / nodes;
      worst_two = std::max(worst_two, *std::max_element(two.begin(), two.end()) - average);
      worst_one = std::max(worst_one, *std::max_element(one.begin(), one.end()) - average);
    }
    EXPECT_LE(worst_two, 4.0) << nodes << " nodes";
    EXPECT_GE(worst_one, 5 * worst_two) << nodes << " nodes: one choice should be far worse";
  }
}

}  // namespace
}  // namespace farmem::client
