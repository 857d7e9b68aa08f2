// The pure half of power-of-two-choices placement (Infiniswap, after Mitzenmacher): sample d
// distinct candidates at random, then prefer the one with the most free slabs. Cluster does the
// network part (STAT, ALLOC, fallbacks); keeping the choice itself free of I/O lets tests check
// it exhaustively. Stateless functions; the caller owns (and serializes use of) the RNG.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace farmem::client {

// Index into a Cluster's node table. Stable for the Cluster's life; never reused.
using NodeId = uint32_t;

// One sampled node and what its STAT said.
struct PlacementChoice {
  NodeId node = 0;
  uint32_t free_slabs = 0;
  bool reachable = true;  // false: its STAT failed (it is not a choice)
};

// min(d, candidates.size()) distinct elements of `candidates`, uniformly at random, in random
// order (a partial Fisher-Yates shuffle).
std::vector<NodeId> SampleDistinct(std::span<const NodeId> candidates, size_t d,
                                   std::mt19937_64& rng);

// The order to try ALLOC in: reachable choices with free slabs, most free first. Ties keep their
// input order, which SampleDistinct made random, so equal daemons share the load.
std::vector<NodeId> RankByFreeSlabs(std::span<const PlacementChoice> choices);

}  // namespace farmem::client
