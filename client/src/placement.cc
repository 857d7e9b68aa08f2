#include "farmem/client/placement.h"

#include <algorithm>

namespace farmem::client {

std::vector<NodeId> SampleDistinct(std::span<const NodeId> candidates, size_t d,
                                   std::mt19937_64& rng) {
  std::vector<NodeId> pool(candidates.begin(), candidates.end());
  const size_t k = std::min(d, pool.size());
  for (size_t i = 0; i < k; ++i) {
    std::uniform_int_distribution<size_t> pick(i, pool.size() - 1);
    std::swap(pool[i], pool[pick(rng)]);
  }
  pool.resize(k);
  return pool;
}

std::vector<NodeId> RankByFreeSlabs(std::span<const PlacementChoice> choices) {
  std::vector<PlacementChoice> usable;
  for (const PlacementChoice& c : choices) {
    if (c.reachable && c.free_slabs > 0) usable.push_back(c);
  }
  std::stable_sort(usable.begin(), usable.end(),
                   [](const PlacementChoice& a, const PlacementChoice& b) {
                     return a.free_slabs > b.free_slabs;
                   });
  std::vector<NodeId> order;
  order.reserve(usable.size());
  for (const PlacementChoice& c : usable) order.push_back(c.node);
  return order;
}

}  // namespace farmem::client
