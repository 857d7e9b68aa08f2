#include "page_store.h"

#include <fmt/format.h>
#include <poll.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cstring>
#include <string_view>

#include "page_store_round.h"

namespace farmem::blockdev {

namespace pagestore {

// Room for the ciphertext of a batch's aligned writes that each worker gets at start: what one
// batch of farmem-nbd carries at most (a connection takes 256 KiB of write data per batch,
// nbd_connection.h). Under --swap-safe it is locked memory, 4 workers' worth at idle (the
// request workers; the rebuild thread's never seals).
// A worker's ciphertext buffer (with encryption): the aligned writes of one group of a batch
// (ExecuteBatch), allocated at start and never grown.
constexpr size_t kSealedReserve = 256u << 10;
// The ops of one group: what the worker's per-op vectors are reserved for (Worker::Reserve).
constexpr size_t kBatchOps = 256;

const std::vector<uint8_t>& ZeroBuffer() {
  static const std::vector<uint8_t> zeros(kMaxPiece, 0);
  return zeros;
}

LogEvery& DegradedMapLog() {
  static LogEvery log(std::chrono::seconds(10));
  return log;
}
LogEvery& RebuildFailLog() {
  static LogEvery log(std::chrono::seconds(10));
  return log;
}
LogEvery& RequestErrorLog() {
  static LogEvery log(std::chrono::seconds(5));
  return log;
}

LogEvery& StillDegradedLog() {
  static LogEvery log(std::chrono::seconds(30));
  return log;
}

}  // namespace pagestore

using namespace pagestore;

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
// Setup

PageStore::PageStore(client::Cluster* cluster, PageStoreOptions options)
    : cluster_(cluster), options_(std::move(options)) {}

Status CheckBusyPoll(std::chrono::microseconds busy_poll) {
  if (busy_poll.count() < 0 || busy_poll > client::ChannelSet::kMaxBusyPoll) {
    return InvalidArgument(fmt::format("busy poll of {} µs: give 0 (off) to {} µs",
                                       busy_poll.count(),
                                       client::ChannelSet::kMaxBusyPoll.count()));
  }
  return Status::Ok();
}

Result<std::unique_ptr<PageStore>> PageStore::Create(client::Cluster* cluster,
                                                     PageStoreOptions options) {
  if (options.size == 0 || options.size % kPage != 0) {
    return Err(InvalidArgument(
        fmt::format("export size {} must be a non-zero multiple of 4096", options.size)));
  }
  FARMEM_RETURN_IF_ERROR(CheckBusyPoll(options.busy_poll));
  std::unique_ptr<PageStore> ps(new PageStore(cluster, std::move(options)));
  FARMEM_RETURN_IF_ERROR(ps->Init());
  return ps;
}

Status PageStore::Init() {
  const Resilience& res = options_.resilience;
  FARMEM_RETURN_IF_ERROR(Resilience::Check(res));
  if (res.mode == Resilience::Mode::kErasure) {
    FARMEM_ASSIGN_OR_RETURN(codec_, ec::ReedSolomon::Create(res.k, res.r));
    // Every degraded read's decode plan now, not on the request path (swap safety).
    if (Result<size_t> plans = codec_->PrepareReconstructPlans(); !plans) {
      spdlog::warn("page store: {}", plans.error().message());
    }
    frag_size_ = static_cast<uint32_t>(kPage / static_cast<uint64_t>(res.k));
  }
  if (options_.encrypt) {
    aead::Key key{};
    if (options_.data_key) {
      key = *options_.data_key;
    } else {
      FARMEM_ASSIGN_OR_RETURN(key, aead::GenerateKey());
    }
    FARMEM_ASSIGN_OR_RETURN(crypto_,
                            PageCrypto::Create(key, options_.size / kPage, options_.seal_observer));
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
  // ec: a piece must fit one round's staging (kRoundBytes); the other modes stage nothing.
  max_piece_ = res.mode == Resilience::Mode::kErasure ? kRoundBytes : kMaxPiece;
  round_params_ = std::make_unique<RoundParams>(RoundParams{
      res, codec_.get(), frag_size_, options_.op_timeout, crypto_.get(), extent_bytes_ / kPage});
  const uint64_t n = (options_.size + extent_bytes_ - 1) / extent_bytes_;
  extents_.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    auto e = std::make_unique<Extent>();
    e->pages = std::min(extent_bytes_, options_.size - i * extent_bytes_) / kPage;
    e->written = std::make_unique<std::atomic<uint64_t>[]>(e->words());
    e->lost = std::make_unique<std::atomic<uint64_t>[]>(e->words());
    e->dirty = std::make_unique<std::atomic<uint64_t>[]>(e->words());
    extents_.push_back(std::move(e));
  }
  if (!options_.backup_path.empty()) {
    FARMEM_ASSIGN_OR_RETURN(backup_, BackupFile::Open(options_.backup_path, options_.size));
  }
  const size_t stage = static_cast<size_t>(kRoundBytes / kPage) * static_cast<size_t>(frag_size_) *
                       static_cast<size_t>(res.group_size());
  std::vector<std::unique_ptr<Worker>> workers;
  for (size_t i = 0; i < options_.workers + 1; ++i) {  // +1: the rebuild thread's
    auto w = std::make_unique<Worker>(cluster_, options_.op_timeout);
    if (i == options_.workers) {
      // The rebuild thread's: its copies and moves post ciphertext read from the members with
      // ops of their own (RunCopyOps) and never seal, open, stage or split a request into
      // pieces, so it has no cipher and none of the request path's buffers (456 KiB less).
      w->channels.Reserve(cluster_->node_count());
      workers.push_back(std::move(w));
      break;
    }
    w->channels.SetBusyPoll(options_.busy_poll);
    if (res.mode == Resilience::Mode::kErasure) w->staging.resize(stage);
    w->Reserve(cluster_->node_count(), static_cast<size_t>(res.group_size()));
    if (crypto_) {
      FARMEM_ASSIGN_OR_RETURN(aead::Cipher c, crypto_->NewCipher());
      w->cipher.emplace(std::move(c));
      w->sealed.resize(kSealedReserve);  // ExecuteBatch's groups fit: never grown
    }
    workers.push_back(std::move(w));
  }
  workers_.Init(std::move(workers));
  subscription_ = cluster_->Subscribe([this](const client::Event& ev) { OnClusterEvent(ev); });
  rebuild_thread_ = std::thread([this] { RebuildLoop(); });
  spdlog::info("page store: {} export, {}, {} extents of {} (slabs of {}){}, {}",
               FormatSize(options_.size), res.ToString(), n, FormatSize(extent_bytes_),
               FormatSize(slab_size_), backup_ ? ", backup " + backup_->path() : "",
               crypto_ ? "pages encrypted (AES-256-GCM)" : "pages NOT encrypted");
  return Status::Ok();
}

PageStore::~PageStore() {
  cluster_->Unsubscribe(subscription_);
  {
    MutexLock lock(&rebuild_mu_);
    stopping_ = true;
  }
  rebuild_cv_.SignalAll();
  members_cv_.SignalAll();
  if (rebuild_thread_.joinable()) rebuild_thread_.join();
  FlushLostPages(/*force=*/true);  // no lost page goes unnamed
  std::vector<client::Lease> leases;
  for (auto& e : extents_) {
    if (!e->mapped.load()) continue;
    for (const client::Lease& l : HeldLeases(e->members)) leases.push_back(l);
  }
  if (!leases.empty()) {
    if (Status s = cluster_->Free(leases); !s.ok()) spdlog::warn("page store: {}", s.ToString());
  }
}

PageStoreStats PageStore::stats() const {
  bool running = false;
  uint64_t queued = 0;
  {
    MutexLock lock(&rebuild_mu_);
    running = rebuilding_;
    queued = rebuild_queue_.size() + lost_leases_.size();
  }
  MutexLock lock(&stats_mu_);
  PageStoreStats s = stats_;
  s.rebuild_running = running || queued > 0;
  s.rebuild_queued = queued;
  s.episode_reprotected_extents = episode_extents_;
  const auto now = Clock::now();
  auto ms = [&](Clock::time_point since) -> uint64_t {
    if (since == Clock::time_point::max() || since > now) return 0;
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count());
  };
  s.episode_reprotect_ms = ms(reprotect_since_);
  s.episode_degraded_ms = ms(degraded_since_);
  s.extents_mapped = 0;
  s.degraded_extents = 0;
  for (auto& e : extents_) {
    const bool mapped = e->mapped.load();
    s.extents_mapped += mapped ? 1 : 0;
    s.degraded_extents += mapped && e->failed.load() != 0 ? 1 : 0;
  }
  return s;
}

void PageStore::CountStat(uint64_t PageStoreStats::*field, uint64_t n) {
  MutexLock lock(&stats_mu_);
  stats_.*field += n;
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
    const uint64_t n = std::min({len - done, extent_bytes_ - in_extent, max_piece_});
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

Status PageStore::PartialPage(Worker& w, uint64_t page_offset, uint64_t at,
                              std::span<uint8_t> read_into, std::span<const uint8_t> write_from) {
  uint8_t page[kPage];
  Status st;
  std::vector<Piece>& pieces = w.side_pieces;  // DoRead / DoWrite are done with it meanwhile
  pieces.clear();
  SplitPieces(page_offset, kPage, page, false, 0, &pieces);
  if (write_from.empty()) {
    RunPieces(w, pieces, {&st, 1}, 0);
    FARMEM_RETURN_IF_ERROR(st);
    std::memcpy(read_into.data(), page + (at - page_offset), read_into.size());
    return Status::Ok();
  }
  // Read-modify-write. Partial writes are serialized so that two of them to different bytes of
  // one page cannot lose each other's update (overlapping writes are unspecified in NBD anyway).
  MutexLock plock(&partial_mu_);
  RunPieces(w, pieces, {&st, 1}, 0);
  FARMEM_RETURN_IF_ERROR(st);
  std::memcpy(page + (at - page_offset), write_from.data(), write_from.size());
  pieces.clear();
  if (crypto_) {
    // A new counter for the whole page (never the old one: its nonce must not be reused).
    FARMEM_RETURN_IF_ERROR(SealPages(w, page_offset, page, kPage, page));
  }
  SplitPieces(page_offset, kPage, page, true, 0, &pieces);
  RunPieces(w, pieces, {&st, 1}, 0);
  if (crypto_) EndWrites(page_offset, kPage, st.ok());
  return st;
}

Status PageStore::DoRead(Worker& w, uint64_t offset, std::span<uint8_t> buf) {
  std::vector<Piece>& pieces = w.side_pieces;
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
    pieces.clear();
    SplitPieces(at, middle, out, false, 0, &pieces);
    RunPieces(w, pieces, {&st, 1}, 0);
    FARMEM_RETURN_IF_ERROR(st);
    at += middle, out += middle, left -= middle;
  }
  if (left > 0) FARMEM_RETURN_IF_ERROR(PartialPage(w, at, at, {out, left}, {}));
  return Status::Ok();
}

Status PageStore::DoWrite(Worker& w, uint64_t offset, std::span<const uint8_t> data, bool fua) {
  // With encryption the backup file gets the sealed pages (SealPages), not these bytes.
  if (backup_ && !crypto_) FARMEM_RETURN_IF_ERROR(backup_->Write(offset, data));
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
    std::vector<Piece>& pieces = w.side_pieces;
    pieces.clear();
    // Allocated here: an unaligned write with whole pages inside reaches the page store only
    // without the write cache (--write-cache-pages 0), which takes partial pages otherwise.
    std::vector<uint8_t> sealed;  // not the worker's: a batch's pieces may point into that
    uint8_t* src = const_cast<uint8_t*>(in);
    if (crypto_) {
      sealed.resize(middle);
      FARMEM_RETURN_IF_ERROR(SealPages(w, at, in, middle, sealed.data()));
      src = sealed.data();
    }
    SplitPieces(at, middle, src, true, 0, &pieces);
    RunPieces(w, pieces, {&st, 1}, 0);
    if (crypto_) EndWrites(at, middle, st.ok());
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
        ReaderLock lock(&e.mu);
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

Status PageStore::Flush() {
  if (backup_) return backup_->Flush();
  return Status::Ok();  // remote writes are acknowledged only once they are on the daemons
}

namespace {
// Reports a group's ops to the batch's listener by their index in the whole batch.
class OffsetListener final : public BatchListener {
 public:
  OffsetListener(BatchListener* outer, size_t base) : outer_(outer), base_(base) {}
  void OpDone(size_t i) override { outer_->OpDone(base_ + i); }
  void Progress() override { outer_->Progress(); }

 private:
  BatchListener* outer_;
  size_t base_;
};

// The ciphertext an op needs in the worker's sealed buffer (aligned writes, with encryption).
uint64_t SealedBytesOf(const BlockOp& op) {
  const bool aligned = op.offset % kPage == 0 && op.length % kPage == 0;
  return op.kind == BlockOp::Kind::kWrite && aligned ? op.length : 0;
}
}  // namespace

size_t PageStore::MaxPiecesOf(const BlockOp& op) const {
  const bool aligned = op.offset % kPage == 0 && op.length % kPage == 0;
  if (!aligned || (op.kind != BlockOp::Kind::kRead && op.kind != BlockOp::Kind::kWrite)) return 0;
  // SplitPieces: every piece but the last is max_piece_ long or ends at an extent's end.
  return static_cast<size_t>(op.length / max_piece_ + op.length / extent_bytes_) + 2;
}

void PageStore::ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener) {
  Worker* w = workers_.Checkout();
  // In groups that fit what the worker's buffers were sized for at start (kBatchOps ops,
  // Worker::kGroupPieces pieces, and with encryption kSealedReserve bytes of ciphertext), so
  // that the request path never allocates (swap safety). The NBD server hands over at most 256 ops
  // and 1 MiB of data, so only a batch of more than 256 KiB of aligned writes with encryption is
  // split; an aligned write larger than that alone goes in ranges of kSealedReserve. The ops of a
  // batch are concurrent (NBD): running its groups one after the other is an order the client
  // allows.
  size_t from = 0;
  while (from < ops.size()) {
    size_t to = from;
    uint64_t sealed = 0;
    size_t npieces = 0;
    while (to < ops.size() && to - from < kBatchOps) {
      const uint64_t need = crypto_ ? SealedBytesOf(ops[to]) : 0;
      if (sealed + need > kSealedReserve) break;
      // An op too large for the pieces vector on its own (hundreds of MiB: not from the NBD
      // server, whose batches carry at most 1 MiB) goes alone and grows it.
      const size_t np = MaxPiecesOf(ops[to]);
      if (to > from && npieces + np > Worker::kGroupPieces) break;
      sealed += need;
      npieces += np;
      ++to;
    }
    if (to > from) {
      if (listener != nullptr && (from > 0 || to < ops.size())) {
        OffsetListener l(listener, from);
        ExecuteGroup(*w, ops.subspan(from, to - from), &l);
      } else {
        ExecuteGroup(*w, ops.subspan(from, to - from), listener);
      }
      from = to;
      continue;
    }
    BlockOp& op = ops[from++];  // an aligned write of more than kSealedReserve, with encryption
    op.status = Status::Ok();
    for (uint64_t at = op.offset; at < op.offset + op.length;) {
      const uint64_t n = std::min<uint64_t>(op.offset + op.length - at, kSealedReserve);
      BlockOp piece[1];
      piece[0].kind = op.kind;
      piece[0].fua = op.fua;
      piece[0].offset = at;
      piece[0].length = n;
      piece[0].data = op.data.subspan(at - op.offset, n);
      ExecuteGroup(*w, piece, nullptr);
      if (!piece[0].status.ok()) {
        op.status = std::move(piece[0].status);
        break;
      }
      at += n;
    }
  }
  workers_.Return(w);
}

void PageStore::ExecuteGroup(Worker& worker, std::span<BlockOp> ops, BatchListener* listener) {
  Worker* w = &worker;
  // Aligned reads and writes of the whole batch go out together; the rest one by one.
  std::vector<Piece>& pieces = w->pieces;
  std::vector<Status>& status = w->status;
  pieces.clear();
  status.assign(ops.size(), Status::Ok());
  w->pieces_left.assign(ops.size(), 0);
  bool any_fua = false;
  // Ciphertext of the aligned writes: sized for the whole batch before any piece points into it.
  uint64_t sealed_at = 0;
  if (crypto_) {
    w->op_sealed.assign(ops.size(), 0);
    uint64_t need = 0;
    for (const BlockOp& op : ops) {
      if (op.kind == BlockOp::Kind::kWrite && op.offset % kPage == 0 && op.length % kPage == 0) {
        need += op.length;
      }
    }
    assert(need <= w->sealed.size());  // ExecuteBatch's groups fit (sized at start)
  }
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
          uint8_t* src = const_cast<uint8_t*>(op.data.data());
          if (crypto_) {
            src = w->sealed.data() + sealed_at;
            sealed_at += op.length;
            status[i] = SealPages(*w, op.offset, op.data.data(), op.length, src);  // + backup
            w->op_sealed[i] = status[i].ok() ? 1 : 0;
          } else if (backup_) {
            status[i] = backup_->Write(op.offset, op.data);
          }
          if (status[i].ok()) SplitPieces(op.offset, op.length, src, true, i, &pieces);
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
  if (crypto_) {
    // Their entries and locks were last touched before the round trip: load them all first.
    for (size_t i = 0; i < ops.size(); ++i) {
      if (w->op_sealed[i] != 0)
        crypto_->PrefetchEndWrite(ops[i].offset / kPage, ops[i].length / kPage);
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (w->op_sealed[i] != 0) EndWrites(ops[i].offset, ops[i].length, status[i].ok());
    }
  }
  for (size_t i = 0; i < ops.size(); ++i) ops[i].status = status[i];
}

}  // namespace farmem::blockdev
