#include "page_store.h"

#include <fmt/format.h>
#include <poll.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <string_view>

namespace farmem::blockdev {

namespace {
constexpr uint64_t kPage = 4096;
// A piece moves at most this much export data; a round at most kRoundBytes.
constexpr uint64_t kMaxPiece = 1 << 20;
constexpr uint64_t kRoundBytes = 2 << 20;
constexpr int kMaxRetries = 3;
// While ops are in flight, how often to check whether their daemon was declared down meanwhile.
constexpr std::chrono::milliseconds kDownCheck{50};
const std::vector<uint8_t>& ZeroBuffer() {
  static const std::vector<uint8_t> zeros(kMaxPiece, 0);
  return zeros;
}

// A member of a group mapped degraded that never had a lease (no daemon could take it): lease
// id 0 (daemons never grant it), on no node. It is marked failed, so nothing is ever posted to it.
constexpr client::NodeId kNoNode = ~client::NodeId{0};
bool IsVacant(const client::Lease& l) { return l.grant.lease_id == 0; }

// At most one log line per `period` for one kind of message, saying how many were left out:
// conditions that persist (a store that stays degraded, a cluster short of room) are re-checked
// every few seconds and must not flood the log.
class LogEvery {
 public:
  explicit LogEvery(std::chrono::seconds period) : period_(period) {}
  // Whether to log now; *suppressed is set to the number of lines left out since the last one.
  bool Allow(uint64_t* suppressed) {
    std::lock_guard lock(mu_);
    const auto now = Clock::now();
    if (last_ != Clock::time_point{} && now - last_ < period_) {
      ++suppressed_;
      return false;
    }
    last_ = now;
    *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  std::mutex mu_;
  const std::chrono::seconds period_;
  Clock::time_point last_{};
  uint64_t suppressed_ = 0;
};

std::string Suppressed(uint64_t n) {
  return n == 0 ? std::string() : fmt::format(" ({} similar lines left out)", n);
}

LogEvery& DegradedMapLog() {
  static LogEvery log(std::chrono::seconds(10));
  return log;
}
LogEvery& RebuildFailLog() {
  static LogEvery log(std::chrono::seconds(10));
  return log;
}
LogEvery& StillDegradedLog() {
  static LogEvery log(std::chrono::seconds(30));
  return log;
}
LogEvery& CapacityLog() {
  static LogEvery log(std::chrono::seconds(60));
  return log;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Resilience

Result<Resilience> Resilience::Parse(std::string_view text) {
  FARMEM_ASSIGN_OR_RETURN(client::Resilience parsed, client::Resilience::Parse(text));
  FARMEM_RETURN_IF_ERROR(Check(parsed));
  return Resilience(parsed);
}

Status Resilience::Check(const client::Resilience& res) {
  if (kPage % static_cast<uint64_t>(res.k) != 0) {
    return InvalidArgument(
        fmt::format("'{}': the page store cuts a 4 KiB page into k fragments, so k must divide "
                    "4096 (1, 2, 4, 8, 16, 32)",
                    res.ToString()));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Internal structures

struct PageStore::Extent {
  std::shared_mutex mu;
  std::atomic<bool> mapped{false};
  // Set under mu exclusive; read under mu shared.
  std::vector<client::Lease> members;
  std::atomic<uint32_t> failed{0};  // bit j: member j's copy is gone
  uint64_t pages = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> written;  // page has data
  std::unique_ptr<std::atomic<uint64_t>[]> lost;     // page's data is gone for good

  size_t words() const { return static_cast<size_t>((pages + 63) / 64); }
  bool Test(const std::unique_ptr<std::atomic<uint64_t>[]>& bits, uint64_t p) const {
    return (bits[p / 64].load(std::memory_order_acquire) >> (p % 64)) & 1;
  }
  void Set(std::unique_ptr<std::atomic<uint64_t>[]>& bits, uint64_t p, bool v) {
    const uint64_t m = uint64_t{1} << (p % 64);
    if (v) {
      bits[p / 64].fetch_or(m, std::memory_order_acq_rel);
    } else {
      bits[p / 64].fetch_and(~m, std::memory_order_acq_rel);
    }
  }
  bool Any() const {
    for (size_t i = 0; i < words(); ++i) {
      if (written[i].load(std::memory_order_acquire) != 0) return true;
    }
    return false;
  }
  uint32_t live_mask() const {
    const uint32_t all = members.size() >= 32 ? ~0u : ((1u << members.size()) - 1);
    return all & ~failed.load(std::memory_order_acquire);
  }
};

// One piece: whole pages of one extent.
struct PageStore::Piece {
  Extent* extent = nullptr;
  uint64_t index = 0;       // extent index
  uint64_t first_page = 0;  // within the extent
  uint64_t npages = 0;
  bool write = false;
  size_t op = 0;             // index of the BlockOp it came from
  uint8_t* buf = nullptr;    // export bytes: destination (read) or source (write)
  uint8_t* stage = nullptr;  // ec: (k+r) fragment arrays of npages*frag bytes
  uint32_t ok_mask = 0;      // members whose op completed OK
  uint32_t fail_mask = 0;    // members whose op failed
  uint32_t posted_mask = 0;
  int8_t order[32] = {};  // ec read: members in arrival order
  int arrived = 0;
  bool settled = false;  // its success was handled while the round still waited (early)
  Status first_error;
};

// What RunPieces needs to report ops early (ExecuteBatch with a listener).
struct PageStore::Early {
  BatchListener* listener = nullptr;
  std::span<BlockOp> ops;
  // Per op: pieces not yet settled, or 0 if the op is not reported early (not split into pieces,
  // or a FUA write that must wait for the backup file's flush).
  std::span<uint32_t> pieces_left;
};

// The remote operations of one round (see Round).
struct PageStore::RemoteOp {
  client::NodeId node = 0;
  transport::Op op;
  size_t piece = 0;
  int member = 0;
  bool posted = false;
  bool done = false;
  Status status;
};

struct PageStore::Worker {
  std::vector<std::unique_ptr<transport::Channel>> channels;  // by NodeId, opened lazily
  std::vector<uint64_t> channel_daemon;  // by NodeId: the daemon (HELLO node id) it was opened to
  std::vector<uint8_t> staging;
  std::vector<transport::Completion> comps;
  std::vector<pollfd> pfds;
  std::vector<client::NodeId> pfd_nodes;
  // Scratch of the request path, reserved up front and reused (cleared, never shrunk), so that
  // serving a batch does not allocate: the pieces and statuses of ExecuteBatch, the extent locks
  // of a round, and the round's remote operations.
  std::vector<Piece> pieces;
  std::vector<Status> status;
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  std::vector<Extent*> locked;
  std::vector<RemoteOp> round_ops;
  std::vector<uint32_t> per_node;
  std::vector<uint32_t> pieces_left;  // per op of the batch (Early)

  void Reserve(size_t nodes, size_t group_size) {
    pieces.reserve(1024);
    status.reserve(256);
    pieces_left.reserve(256);
    locks.reserve(32);
    locked.reserve(32);
    round_ops.reserve(64 * group_size);  // a round: at most 64 pieces, one op per member
    per_node.reserve(nodes);
    pfds.reserve(nodes);
    pfd_nodes.reserve(nodes);
  }
};

// ---------------------------------------------------------------------------------------------
// Setup

PageStore::PageStore(client::Cluster* cluster, PageStoreOptions options)
    : cluster_(cluster), options_(std::move(options)) {}

Result<std::unique_ptr<PageStore>> PageStore::Create(client::Cluster* cluster,
                                                     PageStoreOptions options) {
  if (options.size == 0 || options.size % kPage != 0) {
    return Err(InvalidArgument(
        fmt::format("export size {} must be a non-zero multiple of 4096", options.size)));
  }
  std::unique_ptr<PageStore> ps(new PageStore(cluster, std::move(options)));
  FARMEM_RETURN_IF_ERROR(ps->Init());
  return ps;
}

Status PageStore::Init() {
  const Resilience& res = options_.resilience;
  FARMEM_RETURN_IF_ERROR(Resilience::Check(res));
  if (res.mode == Resilience::Mode::kErasure) {
    FARMEM_ASSIGN_OR_RETURN(codec_, ec::ReedSolomon::Create(res.k, res.r));
    frag_size_ = static_cast<uint32_t>(kPage / static_cast<uint64_t>(res.k));
  }
  // Daemons named in --peers are nodes even while down; with --peers-dns more may join later.
  const size_t nodes = cluster_->node_count();
  if (static_cast<size_t>(res.group_size()) > nodes && cluster_->options().peers_dns.empty()) {
    return InvalidArgument(fmt::format("resilience {} needs {} daemons, the cluster has {}",
                                       res.ToString(), res.group_size(), nodes));
  }
  // Daemons may still be starting (prefaulting their pools): wait a bounded time for the fewest
  // that can hold data; fewer than the whole group is fine (extents are mapped degraded and
  // re-protected when the others come up).
  const Deadline wait_until = DeadlineIn(options_.startup_wait);
  while (cluster_->alive_count() < static_cast<size_t>(MinMembers())) {
    if (Clock::now() >= wait_until) {
      std::string down;
      for (const client::NodeInfo& n : cluster_->nodes()) {
        if (!n.alive) down += (down.empty() ? "" : ", ") + n.endpoint.ToString();
      }
      return Unavailable(fmt::format(
          "resilience {} needs at least {} live daemons, but only {} of {} are up after {} ms "
          "(down: {})",
          res.ToString(), MinMembers(), cluster_->alive_count(), cluster_->node_count(),
          options_.startup_wait.count(), down));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // polls state, with a deadline
  }
  if (cluster_->alive_count() < static_cast<size_t>(res.group_size())) {
    spdlog::warn(
        "page store: only {} of the {} daemons a {} group needs are up: new extents are mapped "
        "degraded and re-protected as daemons come up",
        cluster_->alive_count(), res.group_size(), res.ToString());
  }
  for (client::NodeId id = 0; id < cluster_->node_count() && slab_size_ == 0; ++id) {
    if (auto st = cluster_->Stat(id)) slab_size_ = st->slab_size;
  }
  if (slab_size_ == 0) return Unavailable("no daemon answered STAT: cannot learn the slab size");
  extent_bytes_ = slab_size_ / frag_size_ * kPage;  // pages per slab * page size
  const uint64_t n = (options_.size + extent_bytes_ - 1) / extent_bytes_;
  extents_.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    auto e = std::make_unique<Extent>();
    e->pages = std::min(extent_bytes_, options_.size - i * extent_bytes_) / kPage;
    e->written = std::make_unique<std::atomic<uint64_t>[]>(e->words());
    e->lost = std::make_unique<std::atomic<uint64_t>[]>(e->words());
    extents_.push_back(std::move(e));
  }
  if (!options_.backup_path.empty()) {
    FARMEM_ASSIGN_OR_RETURN(backup_, BackupFile::Open(options_.backup_path, options_.size));
  }
  const size_t stage = static_cast<size_t>(kRoundBytes / kPage) * static_cast<size_t>(frag_size_) *
                       static_cast<size_t>(res.group_size());
  for (size_t i = 0; i < options_.workers + 1; ++i) {  // +1: the rebuild thread's
    auto w = std::make_unique<Worker>();
    if (res.mode == Resilience::Mode::kErasure) w->staging.resize(stage);
    w->comps.resize(256);
    w->Reserve(cluster_->node_count(), static_cast<size_t>(res.group_size()));
    all_workers_.push_back(std::move(w));
  }
  for (size_t i = 0; i < options_.workers; ++i) free_workers_.push_back(all_workers_[i].get());
  subscription_ = cluster_->Subscribe([this](const client::Event& ev) { OnClusterEvent(ev); });
  rebuild_thread_ = std::thread([this] { RebuildLoop(); });
  spdlog::info("page store: {} export, {}, {} extents of {} (slabs of {}){}",
               FormatSize(options_.size), res.ToString(), n, FormatSize(extent_bytes_),
               FormatSize(slab_size_), backup_ ? ", backup " + backup_->path() : "");
  return Status::Ok();
}

PageStore::~PageStore() {
  cluster_->Unsubscribe(subscription_);
  {
    std::lock_guard lock(rebuild_mu_);
    stopping_ = true;
  }
  rebuild_cv_.notify_all();
  if (rebuild_thread_.joinable()) rebuild_thread_.join();
  std::vector<client::Lease> leases;
  for (auto& e : extents_) {
    if (!e->mapped.load()) continue;
    for (const client::Lease& l : HeldLeases(e->members)) leases.push_back(l);
  }
  if (!leases.empty()) {
    if (Status s = cluster_->Free(leases); !s.ok()) spdlog::warn("page store: {}", s.ToString());
  }
}

PageStore::Worker* PageStore::Checkout() {
  std::unique_lock lock(workers_mu_);
  workers_cv_.wait(lock, [&] { return !free_workers_.empty(); });
  Worker* w = free_workers_.back();
  free_workers_.pop_back();
  return w;
}

void PageStore::Return(Worker* w) {
  {
    std::lock_guard lock(workers_mu_);
    free_workers_.push_back(w);
  }
  workers_cv_.notify_one();
}

PageStoreStats PageStore::stats() const {
  std::lock_guard lock(stats_mu_);
  PageStoreStats s = stats_;
  s.extents_mapped = 0;
  s.degraded_extents = 0;
  for (auto& e : extents_) {
    const bool mapped = e->mapped.load();
    s.extents_mapped += mapped ? 1 : 0;
    s.degraded_extents += mapped && e->failed.load() != 0 ? 1 : 0;
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Rounds: many pieces' remote operations posted together, one doorbell per daemon, one wait.

class PageStore::Round {
 public:
  Round(PageStore* ps, Worker* w, std::span<Status> op_status, Early* early)
      : ps_(ps),
        w_(w),
        op_status_(op_status),
        early_(early),
        ops_(w->round_ops),
        per_node_(w->per_node) {
    ops_.clear();
    per_node_.clear();
  }

  // Whether the piece's operations fit this round's windows and staging.
  bool Fits(const Piece& p) const {
    if (count_ == kMaxPieces) return false;
    if (ps_->codec_ && stage_used_ + StageBytes(p) > w_->staging.size()) return false;
    for (const client::Lease& m : p.extent->members) {
      if (m.node < per_node_.size() && per_node_[m.node] + 1 > 48) return false;
    }
    return true;
  }
  size_t StageBytes(const Piece& p) const {
    return static_cast<size_t>(p.npages * ps_->frag_size_) * p.extent->members.size();
  }
  bool empty() const { return count_ == 0; }
  size_t size() const { return count_; }
  Piece& piece(size_t i) { return pieces_[i]; }

  // Adds a piece and prepares its operations (encodes parity for ec writes).
  Status Add(Piece p) {
    if (ps_->codec_) {
      p.stage = w_->staging.data() + stage_used_;
      stage_used_ += StageBytes(p);
    }
    pieces_[count_] = p;
    Piece& q = pieces_[count_];
    const size_t pi = count_++;
    const Resilience& res = ps_->options_.resilience;
    const uint32_t live = q.extent->live_mask();
    const uint64_t len = q.npages * kPage;
    const uint32_t f = ps_->frag_size_;
    if (res.mode == Resilience::Mode::kErasure) {
      const size_t flen = static_cast<size_t>(q.npages) * f;
      const int n = res.k + res.r;
      if (q.write) {
        // Fragment j of page p: bytes [j*f, (j+1)*f) of the page, gathered into stage array j.
        for (uint64_t pg = 0; pg < q.npages; ++pg) {
          for (int j = 0; j < res.k; ++j) {
            std::memcpy(q.stage + static_cast<size_t>(j) * flen + pg * f,
                        q.buf + pg * kPage + static_cast<uint64_t>(j) * f, f);
          }
        }
        const uint8_t* data[32];
        uint8_t* parity[32];
        for (int j = 0; j < res.k; ++j) data[j] = q.stage + static_cast<size_t>(j) * flen;
        for (int j = 0; j < res.r; ++j) parity[j] = q.stage + static_cast<size_t>(res.k + j) * flen;
        FARMEM_RETURN_IF_ERROR(ps_->codec_->Encode({data, static_cast<size_t>(res.k)},
                                                   {parity, static_cast<size_t>(res.r)}, flen));
      }
      for (int j = 0; j < n; ++j) {
        if (!((live >> j) & 1)) continue;
        Post(pi, j, q.write, q.first_page * f, q.stage + static_cast<size_t>(j) * flen,
             static_cast<uint32_t>(flen));
      }
      return Status::Ok();
    }
    const uint64_t off = q.first_page * kPage;
    if (q.write) {
      for (size_t j = 0; j < q.extent->members.size(); ++j) {
        if ((live >> j) & 1)
          Post(pi, static_cast<int>(j), true, off, q.buf, static_cast<uint32_t>(len));
      }
    } else {
      // One replica, spread over the live ones by page.
      const int nm = static_cast<int>(q.extent->members.size());
      for (int t = 0; t < nm; ++t) {
        const int j =
            static_cast<int>((q.first_page + static_cast<uint64_t>(t)) % static_cast<uint64_t>(nm));
        if ((live >> j) & 1) {
          Post(pi, j, false, off, q.buf, static_cast<uint32_t>(len));
          break;
        }
      }
    }
    return Status::Ok();
  }

  // Sends everything and waits: for writes and plain reads until every op completed, for ec reads
  // until each piece has k fragments (stragglers stay outstanding; DrainStragglers reaps them).
  void Run() {
    for (size_t i = 0; i < ops_.size(); ++i) {
      RemoteOp& r = ops_[i];
      transport::Channel* ch = ps_->ChannelFor(*w_, r.node, &r.status);
      if (ch == nullptr) {
        Complete(i, r.status);
        continue;
      }
      r.op.user_data = i;
      Status s = ch->Post(r.op);
      if (!s.ok()) {
        Complete(i, s);
        continue;
      }
      r.posted = true;
    }
    for (client::NodeId n = 0; n < w_->channels.size(); ++n) {
      if (w_->channels[n] && w_->channels[n]->outstanding() > 0) {
        (void)w_->channels[n]->Flush();  // a failure completes the ops with errors
      }
    }
    const Deadline deadline = DeadlineIn(ps_->options_.op_timeout);
    while (!Satisfied()) {
      if (early_ != nullptr) SettleEarly();
      // Wait in slices: a daemon declared down while our ops to it are in flight (a gray failure:
      // SIGSTOP, a partition) must not hold this round, and the extent locks, for op_timeout.
      const Deadline slice = std::min(deadline, DeadlineIn(kDownCheck));
      if (!ps_->PollChannels(*w_, slice, [&](const transport::Completion& c) {
            Complete(static_cast<size_t>(c.user_data), c.status);
          })) {
        if (Clock::now() < deadline) {
          FailOpsOnDownNodes();
          continue;
        }
        // Timed out: whatever is still missing failed.
        for (size_t i = 0; i < ops_.size(); ++i) {
          if (!ops_[i].done) Complete(i, DeadlineExceeded("daemon did not answer in time"));
        }
        ps_->ResetStuckChannels(*w_);
        break;
      }
    }
  }

 private:
  static constexpr size_t kMaxPieces = 64;

  // Ops still waiting on a daemon the cluster has declared down fail now (Unavailable); its
  // channel is dropped with them, so nothing can land in our buffers later.
  void FailOpsOnDownNodes() {
    for (client::NodeId n = 0; n < w_->channels.size(); ++n) {
      auto& ch = w_->channels[n];
      if (!ch || ch->outstanding() == 0 || ps_->cluster_->node(n).alive) continue;
      for (size_t i = 0; i < ops_.size(); ++i) {
        if (!ops_[i].done && ops_[i].node == n) {
          Complete(i, Unavailable(fmt::format("{} was declared down while the op was in flight",
                                              ps_->cluster_->node(n).endpoint.ToString())));
        }
      }
      ch.reset();
    }
  }

  void Post(size_t piece, int member, bool write, uint64_t offset, uint8_t* local, uint32_t len) {
    Piece& p = pieces_[piece];
    const client::Lease& m = p.extent->members[static_cast<size_t>(member)];
    RemoteOp r;
    r.node = m.node;
    r.op = {write ? transport::OpType::kWrite : transport::OpType::kRead,
            m.slab(),
            offset,
            local,
            len,
            nullptr,
            0};
    r.piece = piece;
    r.member = member;
    if (per_node_.size() <= m.node) per_node_.resize(m.node + 1, 0);
    ++per_node_[m.node];
    p.posted_mask |= 1u << member;
    ops_.push_back(std::move(r));
  }

  void Complete(size_t i, const Status& s) {
    RemoteOp& r = ops_[i];
    if (r.done) return;
    r.done = true;
    Piece& p = pieces_[r.piece];
    if (s.ok()) {
      p.ok_mask |= 1u << r.member;
      if (p.arrived < 32) p.order[p.arrived++] = static_cast<int8_t>(r.member);
    } else {
      p.fail_mask |= 1u << r.member;
      if (p.first_error.ok()) {
        p.first_error = s.WithContext(
            fmt::format("lease {:#x} on {}", p.extent->members[static_cast<size_t>(r.member)].id(),
                        ps_->cluster_->node(r.node).endpoint.ToString()));
      }
      ps_->cluster_->ReportFailure(r.node, s);
    }
  }

  // Settles the pieces that succeeded completely and reports the ops all of whose pieces are
  // settled. Anything short of complete success is left to RunPieces after the round.
  void SettleEarly() {
    bool reported = false;
    const int k = ps_->options_.resilience.k;
    for (size_t i = 0; i < count_; ++i) {
      Piece& p = pieces_[i];
      if (p.settled || p.posted_mask == 0 || !op_status_[p.op].ok()) continue;
      if (early_->pieces_left[p.op] == 0) continue;  // not reported early
      if (p.write) {
        if (p.ok_mask != p.posted_mask) continue;
        ps_->MarkWritten(p);
      } else {
        const bool enough = ps_->codec_ ? std::popcount(p.ok_mask) >= k : p.ok_mask != 0;
        if (!enough || p.fail_mask != 0) continue;
        if (!ps_->FinishRead(p).ok()) continue;  // RunPieces reports it
      }
      p.settled = true;
      if (--early_->pieces_left[p.op] == 0) {
        early_->ops[p.op].status = Status::Ok();
        early_->listener->OpDone(p.op);
        reported = true;
      }
    }
    if (reported) early_->listener->Progress();
  }

  bool Satisfied() const {
    const bool ec_read_early = ps_->codec_ != nullptr;
    for (const RemoteOp& r : ops_) {
      if (r.done) continue;
      const Piece& p = pieces_[r.piece];
      if (ec_read_early && !p.write && std::popcount(p.ok_mask) >= ps_->options_.resilience.k) {
        continue;  // late binding: this piece has its k fragments
      }
      if (ec_read_early && !p.write &&
          std::popcount(p.posted_mask & ~p.fail_mask) < ps_->options_.resilience.k) {
        continue;  // can never reach k: no point waiting for the rest
      }
      return false;
    }
    return true;
  }

  PageStore* ps_;
  Worker* w_;
  std::span<Status> op_status_;
  Early* early_;
  Piece pieces_[kMaxPieces];
  size_t count_ = 0;
  size_t stage_used_ = 0;
  std::vector<RemoteOp>& ops_;       // the worker's, reused
  std::vector<uint32_t>& per_node_;  // ops per daemon in this round
};

transport::Channel* PageStore::ChannelFor(Worker& w, client::NodeId node, Status* error) {
  if (w.channels.size() <= node) w.channels.resize(node + 1);
  auto& ch = w.channels[node];
  if (ch && ch->broken() && ch->outstanding() > 0) {
    transport::Completion c[64];
    while (ch->outstanding() > 0) {
      auto n = ch->Poll(c, std::chrono::milliseconds(0));
      if (!n || *n == 0) break;
    }
  }
  if (w.channel_daemon.size() <= node) w.channel_daemon.resize(node + 1, 0);
  // A channel to an earlier incarnation of the daemon (it restarted on the same address) is dead
  // even if no error was seen on it yet: EnsureChannel replaces it instead of failing an op on it.
  return cluster_->EnsureChannel(ch, node, error, &w.channel_daemon[node]);
}

template <typename Fn>
bool PageStore::PollChannels(Worker& w, Deadline deadline, Fn&& on_completion) {
  w.pfds.clear();
  w.pfd_nodes.clear();
  bool any = false;
  for (client::NodeId n = 0; n < w.channels.size(); ++n) {
    auto& ch = w.channels[n];
    if (!ch || ch->outstanding() == 0) continue;
    // A TCP channel keeps nothing unreaped between Poll calls (each receives one reply frame and
    // hands out all its completions), so its socket turning readable is exactly "a reply is
    // there": leave it to the one poll(2) below instead of probing every socket with a recv
    // first (that probe was about a quarter of the system calls of an ec:4+2 batch). Other channels
    // (verbs: a completion may land before the event fd is armed; broken ones) are reaped first.
    if (ch->wait_fd() >= 0 && std::string_view(ch->kind()) == "tcp") {
      w.pfds.push_back({ch->wait_fd(), POLLIN, 0});
      w.pfd_nodes.push_back(n);
      continue;
    }
    auto got = ch->Poll(w.comps, std::chrono::milliseconds(0));
    if (got && *got > 0) {
      for (size_t i = 0; i < *got; ++i) on_completion(w.comps[i]);
      any = true;
      continue;
    }
    w.pfds.push_back({ch->wait_fd(), POLLIN, 0});
    w.pfd_nodes.push_back(n);
  }
  if (any) return true;
  if (w.pfds.empty()) return true;  // nothing outstanding: the caller re-checks its condition
  const bool pollable =
      std::all_of(w.pfds.begin(), w.pfds.end(), [](const pollfd& p) { return p.fd >= 0; });
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (pollable) {
    // Past the deadline, still look (without waiting) before giving up: if this thread was held
    // up (descheduled, a slow listener) the replies may have been waiting here all along, and a
    // daemon that answered in time must not be blamed for our own stall.
    const int rc =
        ::poll(w.pfds.data(), w.pfds.size(), static_cast<int>(std::max<int64_t>(0, left.count())));
    if (rc == 0) return false;
  } else if (left.count() <= 0) {
    return false;  // the channels without a pollable fd were reaped (without waiting) above
  }
  for (size_t i = 0; i < w.pfds.size(); ++i) {
    if (pollable && w.pfds[i].revents == 0) continue;
    auto& ch = w.channels[w.pfd_nodes[i]];
    // The reply has begun to arrive: receiving the rest of it may take up to the operation
    // timeout. (A fixed value: a channel sets its socket's receive timeout only when it changes.)
    auto got = ch->Poll(w.comps, pollable ? options_.op_timeout : std::chrono::milliseconds(0));
    if (got) {
      for (size_t j = 0; j < *got; ++j) on_completion(w.comps[j]);
    }
  }
  return true;
}

void PageStore::ResetStuckChannels(Worker& w) {
  for (auto& ch : w.channels) {
    if (ch && ch->outstanding() > 0) ch.reset();  // its buffers are ours; nothing can land now
  }
}

void PageStore::DrainStragglers(Worker& w) {
  const Deadline deadline = DeadlineIn(options_.op_timeout);
  for (;;) {
    bool any = false;
    for (auto& ch : w.channels) any = any || (ch && ch->outstanding() > 0);
    if (!any) return;
    if (!PollChannels(w, std::min(deadline, DeadlineIn(kDownCheck)),
                      [](const transport::Completion&) {})) {
      if (Clock::now() >= deadline) {
        ResetStuckChannels(w);
        return;
      }
      // Stragglers on a daemon declared down are not worth waiting for (see Round::Run).
      for (client::NodeId n = 0; n < w.channels.size(); ++n) {
        if (w.channels[n] && w.channels[n]->outstanding() > 0 && !cluster_->node(n).alive) {
          w.channels[n].reset();
        }
      }
    }
  }
}

void PageStore::CountStat(uint64_t PageStoreStats::*field, uint64_t n) {
  std::lock_guard lock(stats_mu_);
  stats_.*field += n;
}

// ---------------------------------------------------------------------------------------------
// Mapping

Status PageStore::MapExtent(uint64_t index) {
  Extent& e = *extents_[index];
  std::lock_guard lock(map_mu_);  // a leaf lock: never wait on an extent lock while holding it
  if (e.mapped.load(std::memory_order_acquire)) return Status::Ok();
  const Resilience& res = options_.resilience;
  const size_t n = static_cast<size_t>(res.group_size());
  const size_t min = static_cast<size_t>(MinMembers());
  auto context = [&] {
    return fmt::format("mapping extent {} (export bytes {}..{})", index, index * extent_bytes_,
                       index * extent_bytes_ + e.pages * kPage);
  };
  // Member by member on distinct daemons (two-choices each, as AllocateGroup). When fewer daemons
  // than the group size can take a slab (down, still starting, full), the group is mapped
  // degraded on those that can, provided the mode can still read it back; the missing members
  // are placeholders marked failed, re-protected as soon as daemons can take them.
  std::vector<client::Lease> leases;
  std::vector<client::NodeId> used;
  Status why;
  while (leases.size() < n) {
    Result<client::Lease> l = cluster_->AllocateExcluding(used);
    if (!l) {
      why = l.error();
      break;
    }
    used.push_back(l->node);
    leases.push_back(*l);
  }
  if (leases.size() < min) {
    if (!leases.empty()) (void)cluster_->Free(leases);
    return Status(why.code(),
                  fmt::format("{}: resilience {} needs at least {} daemons that can take a slab, "
                              "{} could ({})",
                              context(), res.ToString(), min, leases.size(), why.message()));
  }
  uint32_t vacant = 0;
  for (size_t j = leases.size(); j < n; ++j) {
    client::Lease none;
    none.node = kNoNode;
    leases.push_back(none);  // the parity positions (ec): reads need no decoding
    vacant |= 1u << j;
  }
  e.members = std::move(leases);
  e.failed.store(vacant, std::memory_order_release);
  e.mapped.store(true, std::memory_order_release);
  if (vacant != 0) {
    CountStat(&PageStoreStats::degraded_maps);
    NoteDegraded();
    if (uint64_t left_out = 0; DegradedMapLog().Allow(&left_out)) {
      spdlog::warn(
          "page store: {}: mapped degraded on {} of {} daemons ({} survives {} missing), "
          "re-protected as soon as daemons can take the rest: {}{}",
          context(), n - static_cast<size_t>(std::popcount(vacant)), n, res.ToString(), n - min,
          why.ToString(), Suppressed(left_out));
    }
  }
  spdlog::debug("extent {} mapped to {} lease(s)", index, n);
  return Status::Ok();
}

int PageStore::MinMembers() const {
  // With a backup file every write is in the file first, so an extent no daemon can take is
  // mapped with every member vacant: its writes stand in the file, its reads come from there, and
  // re-protection gives it remote members (from the file) once daemons have room (Infiniswap).
  if (!options_.backup_path.empty()) return 0;
  return options_.resilience.mode == Resilience::Mode::kErasure ? options_.resilience.k : 1;
}

std::vector<client::Lease> PageStore::HeldLeases(std::span<const client::Lease> members) {
  std::vector<client::Lease> out;
  for (const client::Lease& l : members) {
    if (!IsVacant(l)) out.push_back(l);
  }
  return out;
}

void PageStore::UnmapIfEmpty(uint64_t index) {
  Extent& e = *extents_[index];
  std::vector<client::Lease> freed;
  {
    std::unique_lock ex(e.mu);
    std::lock_guard lock(map_mu_);
    if (!e.mapped.load() || e.Any()) return;
    e.mapped.store(false, std::memory_order_release);
    freed = HeldLeases(e.members);
    e.members.clear();
    e.failed.store(0);
  }
  spdlog::debug("extent {} holds no data any more: its {} lease(s) go back", index, freed.size());
  if (Status s = cluster_->Free(freed); !s.ok()) spdlog::warn("page store: {}", s.ToString());
  // The leases freed may be what a degraded extent was waiting for.
  if (CountDegraded() > 0) RequestReconcile();
}

// ---------------------------------------------------------------------------------------------
// Request paths

void PageStore::SplitPieces(uint64_t offset, uint64_t len, uint8_t* buf, bool write, size_t op,
                            std::vector<Piece>* out) {
  uint64_t done = 0;
  while (done < len) {
    const uint64_t at = offset + done;
    const uint64_t index = at / extent_bytes_;
    const uint64_t in_extent = at % extent_bytes_;
    const uint64_t n = std::min({len - done, extent_bytes_ - in_extent, kMaxPiece});
    Piece p;
    p.extent = extents_[index].get();
    p.index = index;
    p.first_page = in_extent / kPage;
    p.npages = n / kPage;
    p.write = write;
    p.op = op;
    p.buf = buf + done;
    out->push_back(p);
    done += n;
  }
}

void PageStore::MarkWritten(Piece& p) {
  for (uint64_t pg = 0; pg < p.npages; ++pg) {
    p.extent->Set(p.extent->written, p.first_page + pg, true);
    p.extent->Set(p.extent->lost, p.first_page + pg, false);
  }
}

Status PageStore::FinishRead(Piece& p) {
  if (codec_) {
    const int k = options_.resilience.k;
    const size_t flen = static_cast<size_t>(p.npages) * frag_size_;
    const uint32_t data_mask = (1u << k) - 1;
    uint8_t* frags[32];
    for (size_t j = 0; j < p.extent->members.size(); ++j) frags[j] = p.stage + j * flen;
    // Decode when a data fragment is not among the first k to arrive.
    uint32_t first_k = 0;
    for (int t = 0; t < k; ++t) first_k |= 1u << p.order[t];
    if ((first_k & data_mask) != data_mask) {
      int present[32];
      for (int t = 0; t < k; ++t) present[t] = p.order[t];
      FARMEM_RETURN_IF_ERROR(codec_->ReconstructData({frags, p.extent->members.size()},
                                                     {present, static_cast<size_t>(k)}, flen));
      CountStat(&PageStoreStats::degraded_reads);
    }
    for (uint64_t pg = 0; pg < p.npages; ++pg) {
      for (int j = 0; j < k; ++j) {
        std::memcpy(p.buf + pg * kPage + static_cast<uint64_t>(j) * frag_size_,
                    frags[j] + pg * frag_size_, frag_size_);
      }
    }
  }
  for (uint64_t pg = 0; pg < p.npages; ++pg) {
    if (!p.extent->Test(p.extent->written, p.first_page + pg)) {
      std::memset(p.buf + pg * kPage, 0, kPage);
    }
  }
  return Status::Ok();
}

void PageStore::RunPieces(Worker& w, std::vector<Piece>& pieces, std::span<Status> op_status,
                          int attempt, Early* early) {
  std::vector<Piece> retry;
  std::vector<uint64_t> rebuild_now;
  size_t next = 0;
  while (next < pieces.size()) {
    DrainStragglers(w);  // the staging memory of the last round is about to be reused
    Round round(this, &w, op_status, early);
    // Unlocked at the end of this round (cleared below): the worker's vectors are reused.
    std::vector<std::shared_lock<std::shared_mutex>>& locks = w.locks;
    std::vector<Extent*>& locked = w.locked;
    locks.clear();
    locked.clear();
    while (next < pieces.size()) {
      Piece& p = pieces[next];
      if (!op_status[p.op].ok()) {  // an earlier piece of this op failed for good
        ++next;
        continue;
      }
      if (p.write && !p.extent->mapped.load(std::memory_order_acquire)) {
        if (Status s = MapExtent(p.index); !s.ok()) {
          op_status[p.op] = s;
          ++next;
          continue;
        }
      }
      if (std::find(locked.begin(), locked.end(), p.extent) == locked.end()) {
        if (!round.empty() && locked.size() >= 16) break;
        locks.emplace_back(p.extent->mu);
        locked.push_back(p.extent);
      }
      if (p.write && !p.extent->mapped.load(std::memory_order_acquire)) {
        continue;  // unmapped by a trim in between: map again (we hold it shared: fine)
      }
      if (!p.write) {
        // Pages never written read as zeroes; lost pages are errors.
        bool any = false;
        for (uint64_t pg = 0; pg < p.npages; ++pg) {
          const uint64_t page = p.first_page + pg;
          if (p.extent->Test(p.extent->lost, page)) {
            op_status[p.op] = IoError(fmt::format(
                "export page {} (offset {}) was lost with its daemon and has not been written "
                "since",
                (p.index * extent_bytes_) / kPage + page, p.index * extent_bytes_ + page * kPage));
            spdlog::error("page store: {}", op_status[p.op].message());
          }
          any = any || p.extent->Test(p.extent->written, page);
        }
        if (!any || !p.extent->mapped.load(std::memory_order_acquire) || !op_status[p.op].ok()) {
          if (op_status[p.op].ok()) std::memset(p.buf, 0, p.npages * kPage);
          ++next;
          continue;
        }
      }
      if (p.extent->live_mask() == 0 ||
          (codec_ && std::popcount(p.extent->live_mask()) < options_.resilience.k)) {
        // No remote copy can serve or take this piece.
        if (!p.write && backup_) {
          op_status[p.op] = backup_->Read(p.index * extent_bytes_ + p.first_page * kPage,
                                          {p.buf, p.npages * kPage});
          CountStat(&PageStoreStats::backup_reads);
          CountStat(&PageStoreStats::degraded_reads);
        } else if (p.write && backup_) {
          // The data is in the backup file (DoWrite wrote it first): the write stands there.
          for (uint64_t pg = 0; pg < p.npages; ++pg) {
            p.extent->Set(p.extent->written, p.first_page + pg, true);
            p.extent->Set(p.extent->lost, p.first_page + pg, false);
          }
        } else {
          op_status[p.op] = IoError(fmt::format(
              "export bytes {}..{}: every daemon holding them failed and there is no backup file",
              p.index * extent_bytes_ + p.first_page * kPage,
              p.index * extent_bytes_ + (p.first_page + p.npages) * kPage));
          spdlog::error("page store: {}", op_status[p.op].message());
        }
        ++next;
        continue;
      }
      if (!round.Fits(p)) break;
      if (Status s = round.Add(p); !s.ok()) {
        op_status[p.op] = s;
      }
      ++next;
    }
    if (round.empty()) {
      locks.clear();
      continue;
    }
    round.Run();
    // Outcomes, still under the extent locks.
    const int k = options_.resilience.k;
    for (size_t i = 0; i < round.size(); ++i) {
      Piece& p = round.piece(i);
      if (p.fail_mask != 0) {  // also a straggler of a piece settled early
        p.extent->failed.fetch_or(p.fail_mask, std::memory_order_acq_rel);
        NoteDegraded();
        QueueRebuild(p.index);
      }
      if (p.settled) continue;
      const bool ec = codec_ != nullptr;
      if (p.write) {
        const int ok = std::popcount(p.ok_mask);
        const bool recoverable = ec ? ok >= k : ok >= 1;
        if (recoverable || backup_) {
          MarkWritten(p);
          if (p.fail_mask != 0) rebuild_now.push_back(p.index);
        } else {
          retry.push_back(p);
        }
        continue;
      }
      // Reads.
      if (!ec) {
        if (p.ok_mask != 0) {
          if (p.fail_mask != 0) CountStat(&PageStoreStats::degraded_reads);
        } else {
          retry.push_back(p);
          continue;
        }
      } else if (std::popcount(p.ok_mask) < k) {
        retry.push_back(p);
        continue;
      }
      if (Status s = FinishRead(p); !s.ok()) op_status[p.op] = s;
    }
    locks.clear();  // the round is over: its extents may be taken exclusively again
  }
  // Writes that lost redundancy: make the group whole again before acknowledging, when a daemon
  // is there to take the lost members (otherwise the group runs degraded, said in the log).
  std::sort(rebuild_now.begin(), rebuild_now.end());
  rebuild_now.erase(std::unique(rebuild_now.begin(), rebuild_now.end()), rebuild_now.end());
  for (uint64_t index : rebuild_now) (void)RebuildExtent(w, index);
  if (!retry.empty()) {
    CountStat(&PageStoreStats::write_retries, retry.size());
    if (attempt + 1 >= kMaxRetries) {
      for (const Piece& p : retry) {
        if (op_status[p.op].ok()) {
          op_status[p.op] =
              IoError(fmt::format("export bytes {}..{}: {} failed on too many daemons ({})",
                                  p.index * extent_bytes_ + p.first_page * kPage,
                                  p.index * extent_bytes_ + (p.first_page + p.npages) * kPage,
                                  p.write ? "write" : "read", p.first_error.ToString()));
          spdlog::error("page store: {}", op_status[p.op].message());
        }
      }
      return;
    }
    for (Piece& p : retry) {
      p.ok_mask = p.fail_mask = p.posted_mask = 0;
      p.arrived = 0;
      p.first_error = Status();
    }
    for (const Piece& p : retry) (void)RebuildExtent(w, p.index);
    RunPieces(w, retry, op_status, attempt + 1, early);
  }
}

Status PageStore::PartialPage(Worker& w, uint64_t page_offset, uint64_t at,
                              std::span<uint8_t> read_into, std::span<const uint8_t> write_from) {
  uint8_t page[kPage];
  Status st;
  std::vector<Piece> pieces;
  SplitPieces(page_offset, kPage, page, false, 0, &pieces);
  if (write_from.empty()) {
    RunPieces(w, pieces, {&st, 1}, 0);
    FARMEM_RETURN_IF_ERROR(st);
    std::memcpy(read_into.data(), page + (at - page_offset), read_into.size());
    return Status::Ok();
  }
  // Read-modify-write. Partial writes are serialized so that two of them to different bytes of
  // one page cannot lose each other's update (overlapping writes are unspecified in NBD anyway).
  std::lock_guard plock(partial_mu_);
  RunPieces(w, pieces, {&st, 1}, 0);
  FARMEM_RETURN_IF_ERROR(st);
  std::memcpy(page + (at - page_offset), write_from.data(), write_from.size());
  pieces.clear();
  SplitPieces(page_offset, kPage, page, true, 0, &pieces);
  RunPieces(w, pieces, {&st, 1}, 0);
  return st;
}

Status PageStore::DoRead(Worker& w, uint64_t offset, std::span<uint8_t> buf) {
  std::vector<Piece> pieces;
  Status st;
  uint64_t at = offset, left = buf.size();
  uint8_t* out = buf.data();
  if (at % kPage != 0 || left < kPage) {  // head of a page
    const uint64_t page = at / kPage * kPage;
    const uint64_t n = std::min(left, page + kPage - at);
    FARMEM_RETURN_IF_ERROR(PartialPage(w, page, at, {out, n}, {}));
    at += n, out += n, left -= n;
  }
  const uint64_t middle = left / kPage * kPage;
  if (middle > 0) {
    SplitPieces(at, middle, out, false, 0, &pieces);
    RunPieces(w, pieces, {&st, 1}, 0);
    FARMEM_RETURN_IF_ERROR(st);
    at += middle, out += middle, left -= middle;
  }
  if (left > 0) FARMEM_RETURN_IF_ERROR(PartialPage(w, at, at, {out, left}, {}));
  return Status::Ok();
}

Status PageStore::DoWrite(Worker& w, uint64_t offset, std::span<const uint8_t> data, bool fua) {
  if (backup_) FARMEM_RETURN_IF_ERROR(backup_->Write(offset, data));
  Status st;
  uint64_t at = offset, left = data.size();
  const uint8_t* in = data.data();
  if (at % kPage != 0 || left < kPage) {
    const uint64_t page = at / kPage * kPage;
    const uint64_t n = std::min(left, page + kPage - at);
    FARMEM_RETURN_IF_ERROR(PartialPage(w, page, at, {}, {in, n}));
    at += n, in += n, left -= n;
  }
  const uint64_t middle = left / kPage * kPage;
  if (middle > 0) {
    std::vector<Piece> pieces;
    SplitPieces(at, middle, const_cast<uint8_t*>(in), true, 0, &pieces);
    RunPieces(w, pieces, {&st, 1}, 0);
    FARMEM_RETURN_IF_ERROR(st);
    at += middle, in += middle, left -= middle;
  }
  if (left > 0) FARMEM_RETURN_IF_ERROR(PartialPage(w, at, at, {}, {in, left}));
  if (fua && backup_) FARMEM_RETURN_IF_ERROR(backup_->Flush());
  return Status::Ok();
}

Status PageStore::DoZero(Worker& w, uint64_t offset, uint64_t length, bool may_trim, bool fua) {
  // Whole pages: clear their bits (they read as zeroes from then on) when allowed to deallocate;
  // otherwise, and for partial pages, write real zeroes.
  const uint64_t first_full = (offset + kPage - 1) / kPage * kPage;
  const uint64_t end = offset + length;
  const uint64_t last_full = end / kPage * kPage;
  auto write_zeros = [&](uint64_t from, uint64_t to) -> Status {
    for (uint64_t at = from; at < to;) {
      const uint64_t n = std::min<uint64_t>(to - at, kMaxPiece);
      FARMEM_RETURN_IF_ERROR(DoWrite(w, at, {ZeroBuffer().data(), static_cast<size_t>(n)}, false));
      at += n;
    }
    return Status::Ok();
  };
  if (!may_trim || first_full >= last_full) {
    FARMEM_RETURN_IF_ERROR(write_zeros(offset, end));
  } else {
    FARMEM_RETURN_IF_ERROR(write_zeros(offset, first_full));
    FARMEM_RETURN_IF_ERROR(write_zeros(last_full, end));
    std::vector<uint64_t> emptied;
    for (uint64_t at = first_full; at < last_full;) {
      const uint64_t index = at / extent_bytes_;
      Extent& e = *extents_[index];
      const uint64_t stop = std::min(last_full, (index + 1) * extent_bytes_);
      {
        std::shared_lock lock(e.mu);
        for (uint64_t p = at; p < stop; p += kPage) {
          e.Set(e.written, (p % extent_bytes_) / kPage, false);
          e.Set(e.lost, (p % extent_bytes_) / kPage, false);
        }
        if (e.mapped.load() && !e.Any()) emptied.push_back(index);
      }
      at = stop;
    }
    if (backup_) FARMEM_RETURN_IF_ERROR(backup_->Zero(first_full, last_full - first_full));
    for (uint64_t index : emptied) UnmapIfEmpty(index);
  }
  if (fua && backup_) FARMEM_RETURN_IF_ERROR(backup_->Flush());
  return Status::Ok();
}

Status PageStore::Read(uint64_t offset, std::span<uint8_t> buf) {
  BlockOp op;
  op.kind = BlockOp::Kind::kRead;
  op.offset = offset;
  op.length = buf.size();
  op.read_into = buf;
  ExecuteBatch({&op, 1});
  return op.status;
}

Status PageStore::Write(uint64_t offset, std::span<const uint8_t> data, bool fua) {
  BlockOp op;
  op.kind = BlockOp::Kind::kWrite;
  op.offset = offset;
  op.length = data.size();
  op.data = data;
  op.fua = fua;
  ExecuteBatch({&op, 1});
  return op.status;
}

Status PageStore::Flush() {
  if (backup_) return backup_->Flush();
  return Status::Ok();  // remote writes are acknowledged only once they are on the daemons
}

Status PageStore::Trim(uint64_t offset, uint64_t length, bool fua) {
  BlockOp op;
  op.kind = BlockOp::Kind::kTrim;
  op.offset = offset;
  op.length = length;
  op.fua = fua;
  ExecuteBatch({&op, 1});
  return op.status;
}

Status PageStore::WriteZeroes(uint64_t offset, uint64_t length, bool may_trim, bool fua) {
  BlockOp op;
  op.kind = BlockOp::Kind::kWriteZeroes;
  op.offset = offset;
  op.length = length;
  op.may_trim = may_trim;
  op.fua = fua;
  ExecuteBatch({&op, 1});
  return op.status;
}

void PageStore::ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener) {
  Worker* w = Checkout();
  // Aligned reads and writes of the whole batch go out together; the rest one by one.
  std::vector<Piece>& pieces = w->pieces;
  std::vector<Status>& status = w->status;
  pieces.clear();
  status.assign(ops.size(), Status::Ok());
  w->pieces_left.assign(ops.size(), 0);
  bool any_fua = false;
  for (size_t i = 0; i < ops.size(); ++i) {
    BlockOp& op = ops[i];
    if (op.offset > options_.size || op.length > options_.size - op.offset) {
      status[i] = OutOfRange(fmt::format("{} bytes at {} pass the end of the {}-byte export",
                                         op.length, op.offset, options_.size));
      continue;
    }
    const bool aligned = op.offset % kPage == 0 && op.length % kPage == 0;
    switch (op.kind) {
      case BlockOp::Kind::kRead:
        if (aligned) {
          SplitPieces(op.offset, op.length, op.read_into.data(), false, i, &pieces);
        } else {
          status[i] = DoRead(*w, op.offset, op.read_into);
        }
        break;
      case BlockOp::Kind::kWrite:
        if (aligned) {
          if (backup_) status[i] = backup_->Write(op.offset, op.data);
          if (status[i].ok()) {
            SplitPieces(op.offset, op.length, const_cast<uint8_t*>(op.data.data()), true, i,
                        &pieces);
          }
          any_fua = any_fua || op.fua;
        } else {
          status[i] = DoWrite(*w, op.offset, op.data, op.fua);
        }
        break;
      case BlockOp::Kind::kFlush:
        status[i] = Flush();
        break;
      case BlockOp::Kind::kTrim:
        // Trimmed contents are unspecified: deallocate whole pages, leave partial ones alone.
        if (const uint64_t from = (op.offset + kPage - 1) / kPage * kPage,
            to = (op.offset + op.length) / kPage * kPage;
            from < to) {
          status[i] = DoZero(*w, from, to - from, /*may_trim=*/true, op.fua);
        }
        break;
      case BlockOp::Kind::kWriteZeroes:
        status[i] = DoZero(*w, op.offset, op.length, op.may_trim, op.fua);
        break;
    }
  }
  if (!pieces.empty()) {
    Early early{listener, ops, w->pieces_left};
    if (listener != nullptr) {
      for (const Piece& p : pieces) ++w->pieces_left[p.op];
      for (size_t i = 0; i < ops.size(); ++i) {
        // A FUA write with a backup file is done only after the file's flush below.
        if (ops[i].kind == BlockOp::Kind::kWrite && ops[i].fua && backup_) w->pieces_left[i] = 0;
      }
    }
    RunPieces(*w, pieces, status, 0, listener != nullptr ? &early : nullptr);
  }
  if (any_fua && backup_) {
    Status s = backup_->Flush();
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind == BlockOp::Kind::kWrite && ops[i].fua && status[i].ok()) status[i] = s;
    }
  }
  for (size_t i = 0; i < ops.size(); ++i) ops[i].status = status[i];
  Return(w);
}

// ---------------------------------------------------------------------------------------------
// Failures and rebuild

void PageStore::OnClusterEvent(const client::Event& ev) {
  if (ev.type == client::EventType::kNodeUp) {
    // A daemon returned, restarted empty, or joined: it may take what degraded extents miss.
    RequestReconcile();
    return;
  }
  if (ev.lease_ids.empty()) return;
  if (ev.type != client::EventType::kNodeDown && ev.type != client::EventType::kLeasesLost &&
      ev.type != client::EventType::kEvictNotice) {
    return;
  }
  {
    std::lock_guard lock(rebuild_mu_);
    for (uint64_t id : ev.lease_ids) lost_leases_.push_back({ev.node, id});
  }
  rebuild_cv_.notify_all();
}

void PageStore::MarkLost(std::span<const LostLease> lost) {
  for (uint64_t index = 0; index < extents_.size(); ++index) {
    Extent& e = *extents_[index];
    std::shared_lock lock(e.mu);
    if (!e.mapped.load()) continue;
    uint32_t bits = 0;
    for (size_t j = 0; j < e.members.size(); ++j) {
      const client::Lease& m = e.members[j];
      // Lease ids are the daemon's: match the node too.
      if (std::any_of(lost.begin(), lost.end(),
                      [&](const LostLease& l) { return l.node == m.node && l.id == m.id(); })) {
        bits |= 1u << j;
      }
    }
    if (bits != 0) {
      e.failed.fetch_or(bits);
      NoteDegraded();
      std::lock_guard q(rebuild_mu_);
      rebuild_queue_.push_back(index);
    }
  }
}

void PageStore::QueueRebuild(uint64_t index) {
  {
    std::lock_guard lock(rebuild_mu_);
    rebuild_queue_.push_back(index);
  }
  rebuild_cv_.notify_all();
}

void PageStore::RequestReconcile() {
  {
    std::lock_guard lock(rebuild_mu_);
    reconcile_requested_ = true;
  }
  rebuild_cv_.notify_all();
}

void PageStore::WaitForRebuilds() {
  std::unique_lock lock(rebuild_mu_);
  rebuild_cv_.wait(lock, [&] {
    return stopping_ || (rebuild_queue_.empty() && lost_leases_.empty() && !reconcile_requested_ &&
                         !rebuilding_);
  });
}

void PageStore::RebuildLoop() {
  Worker& w = *all_workers_.back();
  std::unique_lock lock(rebuild_mu_);
  Clock::time_point next_reconcile = Clock::now() + options_.reconcile_interval;
  for (;;) {
    rebuild_cv_.wait_until(lock, next_reconcile, [&] {
      return stopping_ || !rebuild_queue_.empty() || !lost_leases_.empty() || reconcile_requested_;
    });
    if (stopping_) return;
    const bool periodic = Clock::now() >= next_reconcile;
    const bool all = periodic || reconcile_requested_;
    reconcile_requested_ = false;
    rebuilding_ = true;
    std::vector<LostLease> lost;
    lost.swap(lost_leases_);
    lock.unlock();
    if (!lost.empty()) MarkLost(lost);
    lock.lock();
    std::vector<uint64_t> todo(rebuild_queue_.begin(), rebuild_queue_.end());
    rebuild_queue_.clear();
    lock.unlock();
    Reprotect(w, std::move(todo), all);
    if (periodic) {
      CheckCapacity();
      next_reconcile = Clock::now() + options_.reconcile_interval;
    }
    lock.lock();
    rebuilding_ = false;
    rebuild_cv_.notify_all();
  }
}

// ---------------------------------------------------------------------------------------------
// Re-protection

uint64_t PageStore::CountDegraded() const {
  uint64_t n = 0;
  for (const auto& e : extents_) n += e->mapped.load() && e->failed.load() != 0 ? 1 : 0;
  return n;
}

void PageStore::NoteDegraded() {
  std::lock_guard lock(stats_mu_);
  if (degraded_since_ == Clock::time_point::max()) degraded_since_ = Clock::now();
}

void PageStore::NoteRebuilt(uint64_t bytes, bool extent_whole, Clock::time_point started) {
  std::lock_guard lock(stats_mu_);
  stats_.rebuilds += 1;
  stats_.rebuilt_bytes += bytes;
  stats_.reprotected_extents += extent_whole ? 1 : 0;
  episode_bytes_ += bytes;
  episode_extents_ += extent_whole ? 1 : 0;
  reprotect_since_ = std::min(reprotect_since_, started);
}

void PageStore::Reprotect(Worker& w, std::vector<uint64_t> todo, bool all) {
  if (all) {
    for (uint64_t i = 0; i < extents_.size(); ++i) {
      if (extents_[i]->mapped.load() && extents_[i]->failed.load() != 0) todo.push_back(i);
    }
  }
  std::sort(todo.begin(), todo.end());
  todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
  if (!todo.empty()) {
    // A member can only go to a daemon that is up and holds no other member of its group. Ask
    // only where one exists, and, within this pass, not again where every such daemon said full.
    const std::vector<client::NodeInfo> nodes = cluster_->nodes();
    std::vector<bool> full(nodes.size(), false);
    std::vector<client::NodeId> candidates;
    for (uint64_t index : todo) {
      {
        std::lock_guard lock(rebuild_mu_);
        if (stopping_) return;  // shutting down: do not start another rebuild
      }
      Extent& e = *extents_[index];
      candidates.clear();
      {
        std::shared_lock lock(e.mu);
        const uint32_t failed = e.failed.load();
        if (!e.mapped.load() || failed == 0) continue;
        for (const client::NodeInfo& n : nodes) {
          if (!n.alive || full[n.id]) continue;
          bool member = false;
          for (size_t j = 0; j < e.members.size(); ++j) {
            member = member || (!((failed >> j) & 1) && e.members[j].node == n.id);
          }
          if (!member) candidates.push_back(n.id);
        }
      }
      if (candidates.empty()) continue;  // stays degraded; a node-up event or the next pass retries
      Status s = RebuildExtent(w, index);
      if (s.code() == StatusCode::kResourceExhausted) {
        for (client::NodeId id : candidates) full[id] = true;
      }
    }
  }
  // Whole again? End the episode: say how long it was degraded and how long re-protecting took.
  if (const uint64_t degraded = CountDegraded(); degraded != 0) {
    uint64_t missing = 0;
    for (const auto& e : extents_) {
      if (e->mapped.load()) missing += static_cast<uint64_t>(std::popcount(e->failed.load()));
    }
    if (uint64_t left_out = 0; StillDegradedLog().Allow(&left_out)) {
      spdlog::warn(
          "page store: {} extents run degraded ({} members missing, {}): they are re-protected "
          "as soon as a daemon that is up, has room and holds none of their members is "
          "reachable{}",
          degraded, missing, options_.resilience.ToString(), Suppressed(left_out));
    }
    return;
  }
  std::lock_guard lock(stats_mu_);
  if (degraded_since_ == Clock::time_point::max()) return;
  const auto now = Clock::now();
  auto ms = [&](Clock::time_point since) {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count());
  };
  stats_.last_degraded_ms = ms(degraded_since_);
  stats_.last_reprotect_ms =
      reprotect_since_ == Clock::time_point::max() ? 0 : ms(reprotect_since_);
  stats_.last_reprotect_bytes = episode_bytes_;
  if (episode_extents_ > 0) {
    spdlog::info(
        "page store: every extent is whole again: {} extents re-protected, {} written to new "
        "members in {} ms (degraded for {} ms)",
        episode_extents_, FormatSize(episode_bytes_), stats_.last_reprotect_ms,
        stats_.last_degraded_ms);
  }
  degraded_since_ = reprotect_since_ = Clock::time_point::max();
  episode_bytes_ = episode_extents_ = 0;
}

void PageStore::CheckCapacity() {
  const uint64_t group = static_cast<uint64_t>(options_.resilience.group_size());
  uint64_t unmapped = 0, missing = 0;
  for (const auto& e : extents_) {
    if (!e->mapped.load()) {
      ++unmapped;
    } else {
      missing += static_cast<uint64_t>(std::popcount(e->failed.load()));
    }
  }
  const uint64_t needed = unmapped * group + missing;
  uint64_t free_slabs = 0;
  size_t live = 0;
  if (needed > 0) {
    for (const client::NodeInfo& n : cluster_->nodes()) {
      if (!n.alive) continue;
      if (auto st = cluster_->Stat(n.id)) {
        free_slabs += st->free_slabs;
        ++live;
      }
    }
  }
  {
    std::lock_guard lock(stats_mu_);
    stats_.cluster_free_slabs = free_slabs;
    stats_.slabs_needed = needed;
  }
  if (needed == 0 || free_slabs >= needed) return;
  if (uint64_t left_out = 0; CapacityLog().Allow(&left_out)) {
    spdlog::warn(
        "page store: the cluster is short of room for this export: {} live daemons have {} free "
        "slabs ({}), but it still needs {} ({}): {} unmapped extents x {} slabs at {} plus {} "
        "members to re-protect. Writes to unmapped space fail with ENOSPC once the room is gone: "
        "add daemons, free memory on them, or trim/discard unused space{}",
        live, free_slabs, FormatSize(free_slabs * slab_size_), needed,
        FormatSize(needed * slab_size_), unmapped, group, options_.resilience.ToString(), missing,
        Suppressed(left_out));
  }
}

Status PageStore::ReadMembers(Worker& w, Extent& e, std::span<const int> which, uint64_t offset,
                              uint8_t* base, size_t len) {
  Status first;
  std::vector<transport::Channel*> posted;  // the rebuild path may allocate
  for (int m : which) {
    const client::Lease& lease = e.members[static_cast<size_t>(m)];
    Status cs;
    transport::Channel* ch = ChannelFor(w, lease.node, &cs);
    if (ch == nullptr) {
      first = cs;
      break;
    }
    const transport::Op op{transport::OpType::kRead,
                           lease.slab(),
                           offset,
                           base + static_cast<size_t>(m) * len,
                           static_cast<uint32_t>(len),
                           nullptr,
                           static_cast<uint64_t>(m)};
    if (Status ps = ch->Post(op); !ps.ok()) {
      first = ps;
      break;
    }
    (void)ch->Flush();  // a failure completes the op with an error below
    posted.push_back(ch);
  }
  const Deadline deadline = DeadlineIn(options_.op_timeout);
  transport::Completion c[8];
  for (transport::Channel* ch : posted) {
    while (ch->outstanding() > 0) {
      auto got = ch->Poll(c, options_.op_timeout);
      if (!got) {
        if (first.ok()) first = got.error();
        break;
      }
      for (size_t i = 0; i < *got; ++i) {
        if (!c[i].status.ok() && first.ok()) first = c[i].status;
      }
      if (*got == 0 && Clock::now() >= deadline) {
        if (first.ok()) first = DeadlineExceeded("a surviving member did not answer in time");
        break;
      }
    }
  }
  if (!first.ok()) ResetStuckChannels(w);  // nothing may land in `base` after we return
  return first;
}

Status PageStore::RebuildExtent(Worker& w, uint64_t index) {
  const Clock::time_point started = Clock::now();
  DrainStragglers(w);  // the synchronous reads below need idle channels
  Extent& e = *extents_[index];
  std::unique_lock ex(e.mu);
  const uint32_t failed = e.failed.load();
  if (!e.mapped.load() || failed == 0) return Status::Ok();
  const Resilience& res = options_.resilience;
  const size_t n = e.members.size();
  std::vector<client::NodeId> used;
  for (size_t j = 0; j < n; ++j) {
    if (!((failed >> j) & 1)) used.push_back(e.members[j].node);
  }
  const uint32_t live = e.live_mask();
  const bool can_read = codec_ ? std::popcount(live) >= res.k : live != 0;
  Status result;
  for (size_t j = 0; j < n; ++j) {
    if (!((failed >> j) & 1)) continue;
    Result<client::Lease> fresh = cluster_->AllocateExcluding(used);
    if (!fresh) {
      // Retried when a daemon comes up and every reconcile_interval: say so once in a while.
      if (uint64_t left_out = 0; RebuildFailLog().Allow(&left_out)) {
        spdlog::warn(
            "page store: extent {} runs degraded ({} of {} members) until a daemon that holds "
            "none of its members can take a slab: {}{}",
            index, std::popcount(e.live_mask()), n, fresh.error().ToString(), Suppressed(left_out));
      }
      result = fresh.error();
      continue;
    }
    uint64_t written_bytes = 0;
    // Rebuild member j's contents for every written page, a run of pages at a time.
    Status s;
    const uint64_t run_pages = std::max<uint64_t>(1, kMaxPiece / kPage / 4);
    std::vector<uint8_t> frag_buf;  // rebuild path: allocating here is fine (not a request path)
    for (uint64_t p = 0; p < e.pages && s.ok(); p += run_pages) {
      const uint64_t np = std::min(run_pages, e.pages - p);
      bool any = false;
      for (uint64_t q = p; q < p + np; ++q) any = any || e.Test(e.written, q);
      if (!any) continue;
      const uint64_t member_off = p * frag_size_;
      const size_t flen = static_cast<size_t>(np) * frag_size_;
      frag_buf.assign(flen * n, 0);
      if (!can_read) {
        if (!backup_) {
          s = DataLoss("no surviving copy and no backup file");
          break;
        }
        // none (or every copy gone): the backup file has the export bytes.
        std::vector<uint8_t> pagebuf(np * kPage);
        s = backup_->Read(index * extent_bytes_ + p * kPage, pagebuf);
        if (!s.ok()) break;
        if (codec_) {
          // Re-encode the pages into fragment j.
          for (uint64_t pg = 0; pg < np; ++pg) {
            for (int d = 0; d < res.k; ++d) {
              std::memcpy(frag_buf.data() + static_cast<size_t>(d) * flen + pg * frag_size_,
                          pagebuf.data() + pg * kPage + static_cast<uint64_t>(d) * frag_size_,
                          frag_size_);
            }
          }
          const uint8_t* data[32];
          uint8_t* parity[32];
          for (int d = 0; d < res.k; ++d) data[d] = frag_buf.data() + static_cast<size_t>(d) * flen;
          for (int d = 0; d < res.r; ++d) {
            parity[d] = frag_buf.data() + static_cast<size_t>(res.k + d) * flen;
          }
          s = codec_->Encode({data, static_cast<size_t>(res.k)},
                             {parity, static_cast<size_t>(res.r)}, flen);
        } else {
          std::memcpy(frag_buf.data() + j * flen, pagebuf.data(), flen);
        }
      } else if (codec_) {
        std::vector<int> present;
        for (size_t m = 0; m < n && static_cast<int>(present.size()) < res.k; ++m) {
          if (!((live >> m) & 1)) continue;
          present.push_back(static_cast<int>(m));
        }
        s = ReadMembers(w, e, present, member_off, frag_buf.data(), flen);
        if (!s.ok()) break;
        uint8_t* frags[32];
        for (size_t m = 0; m < n; ++m) frags[m] = frag_buf.data() + m * flen;
        const int erased[1] = {static_cast<int>(j)};
        // Decode reads the first k fragments that are not erased: make sure those are the ones
        // we read by erasing, for the decoder, every member we did not read.
        std::vector<int> not_read;
        for (size_t m = 0; m < n; ++m) {
          if (std::find(present.begin(), present.end(), static_cast<int>(m)) == present.end()) {
            not_read.push_back(static_cast<int>(m));
          }
        }
        (void)erased;
        if (static_cast<int>(not_read.size()) > res.r) {
          s = DataLoss("fewer than k members survive");
          break;
        }
        s = codec_->Decode({frags, n}, not_read, flen);
      } else {
        // A surviving replica has the bytes.
        for (size_t m = 0; m < n; ++m) {
          if (!((live >> m) & 1)) continue;
          Status cs;
          transport::Channel* ch = ChannelFor(w, e.members[m].node, &cs);
          s = ch == nullptr
                  ? cs
                  : ch->Read(e.members[m].slab(), member_off, {frag_buf.data() + j * flen, flen});
          if (s.ok()) break;
        }
      }
      if (!s.ok()) break;
      Status cs;
      transport::Channel* ch = ChannelFor(w, fresh->node, &cs);
      s = ch == nullptr ? cs
                        : ch->Write(fresh->slab(), member_off, {frag_buf.data() + j * flen, flen});
      if (s.ok()) written_bytes += flen;
    }
    if (!s.ok()) {
      if (!can_read && !backup_) {
        // Nothing can bring the pages back: say which, and let new writes use the fresh lease.
        uint64_t count = 0;
        for (uint64_t q = 0; q < e.pages; ++q) {
          if (e.Test(e.written, q)) {
            e.Set(e.lost, q, true);
            e.Set(e.written, q, false);
            ++count;
          }
        }
        spdlog::error(
            "page store: {} pages of extent {} (export bytes {}..{}) are LOST: their "
            "daemon failed, resilience {} keeps no other copy and there is no backup "
            "file",
            count, index, index * extent_bytes_, index * extent_bytes_ + e.pages * kPage,
            res.ToString());
      } else {
        spdlog::warn("page store: rebuilding member {} of extent {} failed: {}", j, index,
                     s.ToString());
        (void)cluster_->Free({&*fresh, 1});
        result = s;
        continue;
      }
    }
    const client::Lease old = e.members[j];
    e.members[j] = *fresh;
    e.failed.fetch_and(~(1u << j));
    used.push_back(fresh->node);
    if (!IsVacant(old)) (void)cluster_->Free({&old, 1});
    NoteRebuilt(written_bytes, e.failed.load() == 0, started);
    spdlog::info("page store: extent {} member {} rebuilt on {} ({})", index, j,
                 cluster_->node(fresh->node).endpoint.ToString(), FormatSize(written_bytes));
  }
  // A rebuild on a request path: let the rebuild thread see whether the store is whole again.
  if (&w != all_workers_.back().get() && e.failed.load() == 0) RequestReconcile();
  return result;
}

}  // namespace farmem::blockdev
