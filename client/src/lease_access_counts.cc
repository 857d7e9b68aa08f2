// LeaseAccessCounts and the counting channel (lease_access_counts.h).
#include "lease_access_counts.h"

#include <algorithm>
#include <bit>

namespace farmem::client::internal {

void LeaseAccessCounts::Track(uint64_t lease_id) {
  MutexLock lock(&mu_);
  const uint32_t slab = wire::LeaseSlab(lease_id);
  const Table* cur = tables_.empty() ? nullptr : tables_.back().get();
  if (cur == nullptr || (slab >= cur->size && cur->size < kMaxSlots)) {
    const uint32_t want = slab >= kMaxSlots ? kMaxSlots : std::bit_ceil(slab + 1);
    const uint32_t size = std::max({want, uint32_t{16}, cur == nullptr ? 0u : 2 * cur->size});
    auto grown = std::make_unique<Table>(std::min(size, kMaxSlots));
    if (cur != nullptr) {
      for (uint32_t i = 0; i < cur->size; ++i) {
        const Slot& from = cur->slots[i];
        const uint64_t id = from.lease_id.load(std::memory_order_relaxed);
        if (id == 0) continue;
        Slot& to = grown->slots[wire::LeaseSlab(id) & (grown->size - 1)];
        to.count.store(from.count.load(std::memory_order_relaxed), std::memory_order_relaxed);
        to.reported = from.reported;
        to.lease_id.store(id, std::memory_order_relaxed);
      }
    }
    tables_.push_back(std::move(grown));
    cur = tables_.back().get();
    table_.store(cur, std::memory_order_release);
  }
  Slot& s = cur->slots[slab & (cur->size - 1)];
  // Untag first: an operation of the slot's previous lease racing with this must not land in the
  // new lease's count (one that read the old tag just before may still: harmless).
  s.lease_id.store(0, std::memory_order_relaxed);
  s.count.store(0, std::memory_order_relaxed);
  s.reported = 0;
  s.lease_id.store(lease_id, std::memory_order_release);
}

LeaseAccessCounts::Slot* LeaseAccessCounts::Find(uint64_t lease_id) {
  if (tables_.empty()) return nullptr;
  const Table& t = *tables_.back();
  Slot& s = t.slots[wire::LeaseSlab(lease_id) & (t.size - 1)];
  return s.lease_id.load(std::memory_order_relaxed) == lease_id ? &s : nullptr;
}

wire::HeartbeatRequest LeaseAccessCounts::Pending(std::span<const uint64_t> held, size_t max) {
  wire::HeartbeatRequest out;
  MutexLock lock(&mu_);
  for (uint64_t id : held) {
    const Slot* s = Find(id);
    if (s == nullptr) continue;
    const uint64_t now = s->count.load(std::memory_order_relaxed);
    if (now > s->reported) out.reports.push_back({id, now - s->reported});
  }
  if (out.reports.size() > max) {
    // The busiest first: they are the ones victim choice must not mistake for idle.
    std::ranges::nth_element(out.reports, out.reports.begin() + static_cast<ptrdiff_t>(max),
                             std::ranges::greater{}, &wire::AccessReport::accesses);
    out.reports.resize(max);
  }
  return out;
}

void LeaseAccessCounts::Commit(const wire::HeartbeatRequest& report) {
  uint64_t total = 0;
  MutexLock lock(&mu_);
  for (const wire::AccessReport& r : report.reports) {
    Slot* s = Find(r.lease_id);
    if (s == nullptr) continue;  // its slot went to a newer lease meanwhile
    s->reported += r.accesses;
    total += r.accesses;
  }
  reported_total_.fetch_add(total, std::memory_order_relaxed);
}

namespace {

class CountingChannel final : public transport::Channel {
 public:
  CountingChannel(std::unique_ptr<transport::Channel> inner,
                  std::shared_ptr<LeaseAccessCounts> counts)
      : inner_(std::move(inner)), counts_(std::move(counts)) {}

  Status Post(const transport::Op& op) override {
    Status s = inner_->Post(op);
    if (s.ok()) counts_->Count(op.slab.lease_id);
    return s;
  }
  Status Flush() override { return inner_->Flush(); }
  Result<size_t> Poll(std::span<transport::Completion> out,
                      std::chrono::milliseconds timeout) override {
    return inner_->Poll(out, timeout);
  }
  size_t outstanding() const override { return inner_->outstanding(); }
  size_t max_outstanding() const override { return inner_->max_outstanding(); }
  const char* kind() const override { return inner_->kind(); }
  std::string peer() const override { return inner_->peer(); }
  bool broken() const override { return inner_->broken(); }
  transport::ChannelStats stats() const override { return inner_->stats(); }
  int wait_fd() const override { return inner_->wait_fd(); }
  bool fd_readiness_is_exact() const override { return inner_->fd_readiness_is_exact(); }

 private:
  const std::unique_ptr<transport::Channel> inner_;
  const std::shared_ptr<LeaseAccessCounts> counts_;
};

}  // namespace

std::unique_ptr<transport::Channel> CountAccesses(std::unique_ptr<transport::Channel> channel,
                                                  std::shared_ptr<LeaseAccessCounts> counts) {
  return std::make_unique<CountingChannel>(std::move(channel), std::move(counts));
}

}  // namespace farmem::client::internal
