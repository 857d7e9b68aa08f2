#include "export_capacity.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "farmem/common/log_every.h"
#include "farmem/common/mutex.h"

namespace farmem::blockdev {
namespace {

// The most groups of `g` slabs on distinct daemons that daemons with `free_slabs` can take.
uint64_t MaxGroups(std::span<const uint64_t> free_slabs, uint64_t g) {
  uint64_t total = 0;
  for (uint64_t f : free_slabs) total += f;
  // sum_i min(f_i, G) - g * G is concave in G: step down from the bound total / g.
  for (uint64_t groups = total / g; groups > 0; --groups) {
    uint64_t usable = 0;
    for (uint64_t f : free_slabs) usable += std::min(f, groups);
    if (usable >= g * groups) return groups;
  }
  return 0;
}

LogEvery& CapacityLog() {
  static LogEvery log(std::chrono::seconds(60));
  return log;
}

}  // namespace

uint64_t ExportSlabs(uint64_t size, const Resilience& resilience, uint64_t slab_size) {
  const uint64_t extent = slab_size * static_cast<uint64_t>(resilience.k);
  return (size + extent - 1) / extent * static_cast<uint64_t>(resilience.group_size());
}

ExportCapacity CheckExportCapacity(uint64_t size, const Resilience& resilience, uint64_t slab_size,
                                   std::span<const DaemonSpace> daemons) {
  ExportCapacity c;
  c.size = size;
  c.resilience = resilience;
  c.slab_size = slab_size;
  c.daemons.assign(daemons.begin(), daemons.end());
  const uint64_t k = static_cast<uint64_t>(resilience.k);
  const uint64_t g = static_cast<uint64_t>(resilience.group_size());
  const uint64_t extent = slab_size * k;
  const uint64_t groups = ExportSlabs(size, resilience, slab_size) / g;
  c.needed_bytes = groups * g * slab_size;

  std::vector<uint64_t> up_free;
  uint64_t up_capacity = 0;
  for (const DaemonSpace& d : daemons) {
    if (!d.up) {
      ++c.daemons_down;
      continue;
    }
    ++c.daemons_up;
    c.free_bytes += d.free_bytes;
    // A returning daemon is assumed to give this client as much as an up one would in all.
    up_capacity += d.client_limit != 0 ? std::min(d.capacity, d.client_limit) : d.capacity;
    up_free.push_back(d.free_bytes / slab_size);
  }
  const uint64_t fit_groups = MaxGroups(up_free, g);
  c.largest_fitting = fit_groups * extent;
  if (fit_groups >= groups) {
    c.verdict = ExportCapacity::Verdict::kFits;
    return c;
  }
  std::vector<uint64_t> all_free = up_free;
  if (c.daemons_down > 0 && c.daemons_up > 0) {
    const uint64_t typical_slabs = up_capacity / c.daemons_up / slab_size;
    all_free.insert(all_free.end(), c.daemons_down, typical_slabs);
  }
  c.verdict = MaxGroups(all_free, g) >= groups ? ExportCapacity::Verdict::kFitsIfPeersReturn
                                               : ExportCapacity::Verdict::kTooBig;
  return c;
}

std::string ExportCapacity::Describe() const {
  std::string s = fmt::format(
      "an export of {} at {} needs {} of daemon memory ({} slabs of {}); {} of {} daemons "
      "answered, with {} free",
      FormatSize(size), resilience.ToString(), FormatSize(needed_bytes), needed_bytes / slab_size,
      FormatSize(slab_size), daemons_up, daemons.size(), FormatSize(free_bytes));
  const char* sep = ": ";
  for (const DaemonSpace& d : daemons) {
    if (d.up) {
      s += fmt::format("{}{} {} free of {}", sep, d.endpoint.ToString(), FormatSize(d.free_bytes),
                       FormatSize(d.capacity));
      if (d.client_limit != 0 && d.client_limit < d.capacity) {
        s += fmt::format(" (--max-client-share: at most {} for this client)",
                         FormatSize(d.client_limit));
      }
    } else {
      s += fmt::format("{}{} down", sep, d.endpoint.ToString());
    }
    sep = ", ";
  }
  return s;
}

Result<ExportCapacity> SurveyExportCapacity(client::Cluster& cluster, uint64_t size,
                                            const Resilience& resilience,
                                            std::chrono::milliseconds wait) {
  // Wait on the cluster's own node-up events, not on a clock.
  Mutex mu;
  CondVar cv;
  const client::SubscriptionId sub = cluster.Subscribe([&](const client::Event& ev) {
    if (ev.type != client::EventType::kNodeUp) return;
    MutexLock lock(&mu);
    cv.SignalAll();
  });
  {
    MutexLock lock(&mu);
    cv.WaitFor(&mu, wait, [&] { return cluster.alive_count() == cluster.node_count(); });
  }
  cluster.Unsubscribe(sub);

  std::vector<DaemonSpace> daemons;
  uint64_t slab_size = 0;
  for (client::NodeId id = 0; id < cluster.node_count(); ++id) {
    DaemonSpace d;
    d.endpoint = cluster.node(id).endpoint;
    if (auto st = cluster.Stat(id)) {
      d.up = true;
      // What this client may still take: a daemon's --max-client-share keeps the rest of its
      // free memory for other clients.
      d.free_bytes = uint64_t{wire::FreeForClient(*st)} * st->slab_size;
      d.capacity = uint64_t{st->total_slabs} * st->slab_size;
      if ((st->features & wire::kFeatureClientShare) != 0) {
        d.client_limit = uint64_t{st->client_max_slabs} * st->slab_size;
      }
      if (slab_size == 0) slab_size = st->slab_size;
    }
    daemons.push_back(std::move(d));
  }
  if (slab_size == 0) {
    return Err(
        Unavailable(fmt::format("no daemon answered STAT within {} ms: cannot tell whether "
                                "the export fits",
                                wait.count())));
  }
  return CheckExportCapacity(size, resilience, slab_size, daemons);
}

uint64_t CheckRunningCapacity(client::Cluster& cluster, std::string_view store, uint64_t needed,
                              uint64_t slab_size, const std::function<std::string()>& breakdown) {
  if (needed == 0) return 0;
  uint64_t free_slabs = 0;
  size_t live = 0;
  for (const client::NodeInfo& n : cluster.nodes()) {
    if (!n.alive) continue;
    if (auto st = cluster.Stat(n.id)) {
      free_slabs += wire::FreeForClient(*st);  // what this client may take (its share)
      ++live;
    }
  }
  if (free_slabs >= needed) return free_slabs;
  if (uint64_t left_out = 0; CapacityLog().Allow(&left_out)) {
    spdlog::warn(
        "{}: the cluster is short of room for this export: {} live daemons have {} free slabs "
        "({}), but it still needs {} ({}): {}. Writes to space not held yet fail with ENOSPC once "
        "the room is gone: add daemons, free memory on them, or trim/discard unused space{}",
        store, live, free_slabs, FormatSize(free_slabs * slab_size), needed,
        FormatSize(needed * slab_size), breakdown(), Suppressed(left_out));
  }
  return free_slabs;
}

}  // namespace farmem::blockdev
