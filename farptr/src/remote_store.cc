// RemoteStore setup, row/group bookkeeping and failure recovery. The data path (WriteSet,
// ReadSpan, RunOps) is in remote_store_io.cc.
#include "remote_store.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>

namespace farmem::farptr_internal {

RemoteStore::RemoteStore(client::Cluster* cluster, SpanResilience res, uint32_t span_size,
                         std::chrono::milliseconds op_timeout)
    : cluster_(cluster), res_(res), span_size_(span_size), op_timeout_(op_timeout) {}

Result<std::unique_ptr<RemoteStore>> RemoteStore::Create(client::Cluster* cluster,
                                                         SpanResilience res, uint32_t span_size,
                                                         std::chrono::milliseconds op_timeout) {
  std::unique_ptr<RemoteStore> s(new RemoteStore(cluster, res, span_size, op_timeout));
  FARMEM_RETURN_IF_ERROR(s->Init());
  return s;
}

Status RemoteStore::Init() {
  if (res_.width() > kMaxSetWidth) {
    return InvalidArgument(
        fmt::format("resilience {} spreads a span set over {} daemons; at most "
                    "{} are supported",
                    res_.ToString(), res_.width(), kMaxSetWidth));
  }
  if (static_cast<size_t>(res_.width()) > cluster_->node_count()) {
    return InvalidArgument(fmt::format("resilience {} needs {} daemons, the cluster has {}",
                                       res_.ToString(), res_.width(), cluster_->node_count()));
  }
  if (res_.mode == SpanResilience::Mode::kErasure && res_.r > 0) {
    FARMEM_ASSIGN_OR_RETURN(codec_, ec::ReedSolomon::Create(res_.k, res_.r));
  }
  for (client::NodeId id = 0; id < cluster_->node_count() && slab_size_ == 0; ++id) {
    if (auto st = cluster_->Stat(id)) slab_size_ = st->slab_size;
  }
  if (slab_size_ == 0) return Unavailable("no daemon answered STAT: cannot learn the slab size");
  if (slab_size_ < span_size_) {
    return InvalidArgument(fmt::format("span size {} exceeds the daemons' slab size {}",
                                       FormatSize(span_size_), FormatSize(slab_size_)));
  }
  rows_per_group_ = static_cast<uint32_t>(slab_size_ / span_size_);
  zeros_.assign(span_size_, 0);
  subscription_ = cluster_->Subscribe([this](const client::Event& ev) { OnClusterEvent(ev); });
  recovery_thread_ = std::thread([this] { RecoveryLoop(); });
  return Status::Ok();
}

RemoteStore::~RemoteStore() { Shutdown(); }

void RemoteStore::Shutdown() {
  if (subscription_ != 0) {
    cluster_->Unsubscribe(subscription_);
    subscription_ = 0;
  }
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  recovery_cv_.notify_all();
  if (recovery_thread_.joinable()) recovery_thread_.join();
  std::vector<client::Lease> leases;
  {
    std::lock_guard lock(mu_);
    for (auto& g : groups_) {
      for (auto* set : g->rows) delete set;
      leases.insert(leases.end(), g->members.begin(), g->members.end());
    }
    groups_.clear();
    by_lease_.clear();
  }
  if (!leases.empty()) (void)cluster_->Free(leases);
}

// ---------------------------------------------------------------------------------------------
// Rows and groups

Result<SpanSet*> RemoteStore::ReserveRow(std::vector<client::Lease>* members, uint64_t* epoch) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      std::lock_guard lock(mu_);
      Group* best = nullptr;
      for (auto& g : groups_) {
        if (g->failed_mask != 0 || g->lost_mask != 0 || g->rebuilding) continue;
        if (g->used_rows >= rows_per_group_) continue;
        if (best == nullptr || g->used_rows > best->used_rows) best = g.get();
      }
      if (best != nullptr) {
        uint32_t row = 0;
        while (best->rows[row] != nullptr) ++row;
        auto* set = new SpanSet;
        set->group = best;
        set->row = row;
        set->id = next_set_id_++;
        best->rows[row] = set;
        ++best->used_rows;
        ++sets_;
        *members = best->members;
        *epoch = best->epoch;
        return set;
      }
    }
    // No room: one thread allocates a group while the others wait and then look again.
    std::unique_lock alloc(alloc_mu_, std::try_to_lock);
    if (!alloc.owns_lock()) {
      alloc.lock();
      continue;
    }
    FARMEM_ASSIGN_OR_RETURN(std::vector<client::Lease> leases,
                            cluster_->AllocateGroup(static_cast<size_t>(res_.width())));
    std::lock_guard lock(mu_);
    auto g = std::make_unique<Group>();
    g->id = next_group_id_++;
    g->members = std::move(leases);
    g->rows.assign(rows_per_group_, nullptr);
    for (size_t m = 0; m < g->members.size(); ++m) {
      by_lease_[g->members[m].id()] = {g.get(), static_cast<int>(m)};
    }
    groups_.push_back(std::move(g));
    attempt = -1;  // the new group has room: take a row from it
  }
  return Err(Internal("no span-set row after allocating a group"));
}

uint32_t RemoteStore::DataCells(std::span<const uint8_t* const> data, const uint8_t** cells) const {
  uint32_t live = 0;
  for (int m = 0; m < res_.k; ++m) {
    const uint8_t* d =
        static_cast<size_t>(m) < data.size() ? data[static_cast<size_t>(m)] : nullptr;
    cells[m] = d != nullptr ? d : zeros_.data();
    if (d != nullptr) live |= 1u << m;
  }
  return live;
}

void RemoteStore::FreeRowLocked(SpanSet* set) {
  Group* g = set->group;
  g->rows[set->row] = nullptr;
  --g->used_rows;
  --sets_;
  delete set;
}

void RemoteStore::Release(SpanSet* set, int member) {
  std::vector<client::Lease> to_free;
  {
    std::lock_guard lock(mu_);
    set->live_mask &= ~(1u << member);
    set->spans[static_cast<size_t>(member)] = nullptr;
    if (set->live_mask != 0) return;
    Group* g = set->group;
    FreeRowLocked(set);
    if (g->used_rows != 0 || g->rebuilding) return;
    to_free = g->members;
    for (const auto& l : g->members) by_lease_.erase(l.id());
    std::erase_if(recovery_queue_, [g](Group* q) { return q == g; });
    std::erase_if(groups_, [g](const std::unique_ptr<Group>& p) { return p.get() == g; });
  }
  if (Status s = cluster_->Free(to_free); !s.ok()) {
    spdlog::debug("far memory: freeing an empty slab group: {}", s.ToString());
  }
}

bool RemoteStore::Healthy(const SpanSet* set) const {
  std::lock_guard lock(mu_);
  const Group* g = set->group;
  return g->failed_mask == 0 && g->lost_mask == 0 && !g->rebuilding;
}

std::vector<Span*> RemoteStore::CompactionCandidates(size_t max_spans) {
  std::lock_guard lock(mu_);
  std::vector<SpanSet*> holed;
  uint64_t used_rows = 0;
  for (auto& g : groups_) {
    used_rows += g->used_rows;
    for (SpanSet* set : g->rows) {
      if (set != nullptr && std::popcount(set->live_mask) < res_.k) holed.push_back(set);
    }
  }
  std::sort(holed.begin(), holed.end(), [](SpanSet* a, SpanSet* b) {
    return std::popcount(a->live_mask) < std::popcount(b->live_mask);
  });
  std::vector<Span*> out;
  auto take = [&](SpanSet* set) {
    for (int m = 0; m < res_.k && out.size() < max_spans; ++m) {
      if (set->spans[static_cast<size_t>(m)] != nullptr) {
        out.push_back(set->spans[static_cast<size_t>(m)]);
      }
    }
  };
  for (SpanSet* set : holed) {
    if (out.size() >= max_spans) break;
    take(set);
  }
  // Whole groups are what the daemons get back: if the rows in use would fit in fewer groups,
  // empty the emptiest one.
  const uint64_t needed = (used_rows + rows_per_group_ - 1) / rows_per_group_;
  if (groups_.size() > needed && out.size() < max_spans) {
    Group* emptiest = nullptr;
    for (auto& g : groups_) {
      if (g->rebuilding || g->used_rows == 0) continue;
      if (emptiest == nullptr || g->used_rows < emptiest->used_rows) emptiest = g.get();
    }
    if (emptiest != nullptr) {
      for (SpanSet* set : emptiest->rows) {
        if (set != nullptr && std::popcount(set->live_mask) == res_.k) take(set);
      }
    }
  }
  return out;
}

std::vector<std::vector<Endpoint>> RemoteStore::GroupLayout() const {
  std::vector<std::vector<client::NodeId>> nodes;
  {
    std::lock_guard lock(mu_);
    for (auto& g : groups_) {
      nodes.emplace_back();
      for (auto& m : g->members) nodes.back().push_back(m.node);
    }
  }
  std::vector<std::vector<Endpoint>> out;
  for (auto& g : nodes) {
    out.emplace_back();
    for (client::NodeId n : g) out.back().push_back(cluster_->node(n).endpoint);
  }
  return out;
}

RemoteStoreStats RemoteStore::stats() const {
  std::lock_guard lock(mu_);
  RemoteStoreStats s;
  s.sets = sets_;
  s.set_bytes = sets_ * static_cast<uint64_t>(res_.width()) * span_size_;
  s.groups = groups_.size();
  s.leased_bytes = groups_.size() * static_cast<uint64_t>(res_.width()) * slab_size_;
  s.degraded_reads = degraded_reads_;
  s.members_reprotected = reprotected_;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Failures

void RemoteStore::MarkFailed(Group* g, int m, uint64_t lease_id, const Status& why) {
  {
    std::lock_guard lock(mu_);
    auto it = by_lease_.find(lease_id);
    if (it == by_lease_.end() || it->second.first != g || it->second.second != m) return;
    const uint32_t bit = 1u << m;
    if ((g->failed_mask & bit) != 0 || (g->lost_mask & bit) != 0) return;
    g->failed_mask |= bit;
    recovery_queue_.push_back(g);
    spdlog::warn("far memory: slab group {} member {} ({}, lease {}) failed: {}", g->id, m,
                 cluster_->node(g->members[static_cast<size_t>(m)].node).endpoint.ToString(),
                 lease_id, why.ToString());
  }
  recovery_cv_.notify_all();
}

void RemoteStore::OnClusterEvent(const client::Event& ev) {
  if (ev.lease_ids.empty()) return;
  if (ev.type != client::EventType::kNodeDown && ev.type != client::EventType::kLeasesLost &&
      ev.type != client::EventType::kEvictNotice) {
    return;
  }
  const Status why = ev.reason.ok() ? Unavailable(client::EventTypeName(ev.type)) : ev.reason;
  struct Hit {
    Group* group;
    int member;
    uint64_t lease;
  };
  std::vector<Hit> hits;
  {
    std::lock_guard lock(mu_);
    for (uint64_t id : ev.lease_ids) {
      auto it = by_lease_.find(id);
      if (it != by_lease_.end()) hits.push_back({it->second.first, it->second.second, id});
    }
  }
  for (const Hit& h : hits) MarkFailed(h.group, h.member, h.lease, why);
}

bool RemoteStore::WaitForRecovery(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return recovery_cv_.wait_for(
      lock, timeout, [&] { return stopping_ || (recovery_queue_.empty() && !recovering_); });
}

void RemoteStore::RecoveryLoop() {
  IoContext io;
  std::unique_lock lock(mu_);
  for (;;) {
    recovery_cv_.wait(lock, [&] { return stopping_ || !recovery_queue_.empty(); });
    if (stopping_) return;
    Group* g = recovery_queue_.front();
    recovery_queue_.pop_front();
    if (g->failed_mask == 0) {
      recovery_cv_.notify_all();
      continue;
    }
    g->rebuilding = true;
    recovering_ = true;
    lock.unlock();
    Reprotect(io, g);
    lock.lock();
    if (g->failed_mask != 0 && !stopping_) {
      // Could not re-protect now (no daemon with room): back off and try again. g stays marked
      // rebuilding meanwhile, so nothing frees it under us.
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      lock.lock();
    }
    g->rebuilding = false;
    recovering_ = false;
    if (g->used_rows == 0) {
      std::vector<client::Lease> to_free = g->members;
      for (const auto& l : g->members) by_lease_.erase(l.id());
      std::erase_if(recovery_queue_, [g](Group* q) { return q == g; });
      std::erase_if(groups_, [g](const std::unique_ptr<Group>& p) { return p.get() == g; });
      lock.unlock();
      (void)cluster_->Free(to_free);
      lock.lock();
    } else if (g->failed_mask != 0 && !stopping_ &&
               std::find(recovery_queue_.begin(), recovery_queue_.end(), g) ==
                   recovery_queue_.end()) {
      recovery_queue_.push_back(g);
    }
    recovery_cv_.notify_all();
  }
}

// Rebuilds every failed member of `g` on a daemon the group does not use. Runs on the recovery
// thread with g->rebuilding set (no new rows are placed in g, g is not freed).
void RemoteStore::Reprotect(IoContext& io, Group* g) {
  const int n = res_.width();
  const size_t span = span_size_;
  if (io.scratch.size() < span * static_cast<size_t>(n)) io.scratch.resize(span * n);
  std::vector<client::Lease> members;
  uint32_t failed = 0;
  std::vector<uint32_t> rows;
  {
    std::lock_guard lock(mu_);
    members = g->members;
    failed = g->failed_mask;
    for (uint32_t r = 0; r < rows_per_group_; ++r) {
      if (g->rows[r] != nullptr && !g->rows[r]->writing) rows.push_back(r);
    }
  }
  const uint32_t all = n >= 32 ? ~0u : ((1u << n) - 1);
  const uint32_t live = all & ~failed & ~g->lost_mask;
  const bool recoverable = res_.mode == SpanResilience::Mode::kErasure
                               ? std::popcount(live) >= res_.k
                               : (res_.mode == SpanResilience::Mode::kReplicate && live != 0);
  if (!recoverable) {
    std::lock_guard lock(mu_);
    g->lost_mask |= failed;
    g->failed_mask = 0;
    spdlog::error(
        "far memory: slab group {} lost members {:#x}: {} span sets ({} rows) cannot be "
        "rebuilt with resilience {}; objects that were only there are LOST (deref says which)",
        g->id, failed, rows.size(), rows.size(), res_.ToString());
    return;
  }
  for (int j = 0; j < n; ++j) {
    if (((failed >> j) & 1) == 0) continue;
    std::vector<client::NodeId> exclude;
    for (const auto& m : members) exclude.push_back(m.node);
    Result<client::Lease> fresh = cluster_->AllocateExcluding(exclude);
    if (!fresh) {
      if (!g->degraded_logged) {
        g->degraded_logged = true;
        spdlog::warn("far memory: slab group {} runs degraded (member {} lost), retrying: {}",
                     g->id, j, fresh.error().ToString());
      }
      continue;
    }
    // Survivors to read: the first k live members (ec) or one live copy (replicate).
    std::vector<int> readers;
    for (int m = 0; m < n; ++m) {
      if (((live >> m) & 1) != 0) readers.push_back(m);
    }
    if (res_.mode == SpanResilience::Mode::kErasure)
      readers.resize(static_cast<size_t>(res_.k));
    else
      readers.resize(1);
    Status s;
    for (uint32_t row : rows) {
      const uint64_t off = static_cast<uint64_t>(row) * span;
      std::vector<transport::Op> ops;
      std::vector<client::NodeId> nodes;
      for (int m : readers) {
        const uint8_t* dst = io.scratch.data() + static_cast<size_t>(m) * span;
        ops.push_back({transport::OpType::kRead, members[static_cast<size_t>(m)].slab(), off,
                       const_cast<uint8_t*>(dst), static_cast<uint32_t>(span), nullptr, 0});
        nodes.push_back(members[static_cast<size_t>(m)].node);
      }
      std::vector<Status> results(ops.size());
      RunOps(io, ops, nodes, results);
      for (size_t i = 0; i < results.size() && s.ok(); ++i) s = results[i];
      if (!s.ok()) break;
      uint8_t* cell = io.scratch.data() + static_cast<size_t>(j) * span;
      if (res_.mode == SpanResilience::Mode::kErasure) {
        uint8_t* frags[kMaxSetWidth];
        std::vector<int> erased;
        for (int m = 0; m < n; ++m) {
          frags[m] = io.scratch.data() + static_cast<size_t>(m) * span;
          if (std::find(readers.begin(), readers.end(), m) == readers.end()) erased.push_back(m);
        }
        s = codec_->Decode({frags, static_cast<size_t>(n)}, erased, span);
      } else {
        std::memcpy(cell, io.scratch.data() + static_cast<size_t>(readers[0]) * span, span);
      }
      if (!s.ok()) break;
      transport::Op w{transport::OpType::kWrite,   fresh->slab(), off, cell,
                      static_cast<uint32_t>(span), nullptr,       0};
      client::NodeId wn = fresh->node;
      Status ws;
      RunOps(io, {&w, 1}, {&wn, 1}, {&ws, 1});
      s = ws;
      if (!s.ok()) break;
    }
    if (!s.ok()) {
      spdlog::warn("far memory: re-protecting slab group {} member {} failed: {}", g->id, j,
                   s.ToString());
      (void)cluster_->Free({&*fresh, 1});
      continue;
    }
    client::Lease old;
    {
      std::lock_guard lock(mu_);
      old = g->members[static_cast<size_t>(j)];
      by_lease_.erase(old.id());
      g->members[static_cast<size_t>(j)] = *fresh;
      by_lease_[fresh->id()] = {g, j};
      g->failed_mask &= ~(1u << j);
      g->degraded_logged = false;
      ++g->epoch;
      ++reprotected_;
    }
    (void)cluster_->Free({&old, 1});
    spdlog::info("far memory: slab group {} member {} re-protected on {} ({} span sets)", g->id, j,
                 cluster_->node(fresh->node).endpoint.ToString(), rows.size());
  }
}

}  // namespace farmem::farptr_internal
