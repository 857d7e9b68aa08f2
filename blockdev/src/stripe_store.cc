// StripeStore (stripe_store.h): setup, the batch path (lock, read, write, release), compaction.
#include "stripe_store.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cassert>
#include <cstring>

#include "export_capacity.h"
#include "farmem/common/cpu_time.h"
#include "farmem/ec/crc32c.h"

namespace farmem::blockdev {

using spanstore::SpanOwner;
using spanstore::SpanSet;

struct StripeStore::Worker {
  std::unique_ptr<spanstore::IoContext> io;
  std::optional<aead::Cipher> cipher;
  std::vector<PageIo> pages;
  std::vector<Status> op_status;
  std::vector<uint8_t> scratch;                 // partial pages (and the compactor's pages)
  std::vector<uint8_t> sealed;                  // ciphertext of the pages being written
  std::vector<std::pair<uint32_t, bool>> held;  // stripes held (ascending), exclusive?
  // ReadSpans / WriteSet arguments.
  std::vector<SpanSet*> sets;
  std::vector<int> members;
  std::vector<uint8_t*> dsts;
  std::vector<Status> results;
  std::vector<size_t> which;
  std::vector<size_t> rmw;  // MergePartialWrites' scratch
  std::vector<const uint8_t*> data;
  std::vector<SpanOwner*> owners;
  std::vector<std::span<const uint8_t* const>> set_data;
  std::vector<std::span<SpanOwner* const>> set_owners;
  std::vector<Result<SpanSet*>> written;
  std::vector<uint32_t> crcs;     // each written page's cell CRC-32C (compaction offload)
  std::vector<SpanOwner*> cands;  // the compactor's: a pass's candidates
  size_t capacity = 0;            // pages: what every vector above was sized for (Reserve)

  // Sizes every buffer for `pages` pages (`partials` of them partial: scratch) at start, so that
  // the request path never allocates (swap safety: docs/nbd.md "Swap safety").
  void Reserve(size_t pages_max, size_t writes, size_t partials, bool sealing) {
    capacity = pages_max;
    pages.reserve(pages_max);
    op_status.reserve(pages_max);
    scratch.resize(partials * kPage);
    if (sealing) sealed.resize(writes * kPage);
    held.reserve(pages_max);
    sets.reserve(pages_max);
    members.reserve(pages_max);
    dsts.reserve(pages_max);
    results.reserve(pages_max);
    which.reserve(pages_max);
    rmw.reserve(pages_max);
    data.reserve(pages_max);
    owners.reserve(pages_max);
    set_data.reserve(pages_max);
    set_owners.reserve(pages_max);
    written.reserve(pages_max);
    crcs.reserve(pages_max);
    cands.reserve(pages_max);
  }
  // A piece never holds more than the buffers were sized for: none of them grew (which would be
  // an allocation on the request path).
  void CheckCapacity() const {
    assert(pages.capacity() == capacity && op_status.capacity() == capacity &&
           held.capacity() == capacity && sets.capacity() == capacity &&
           which.capacity() == capacity && data.capacity() == capacity &&
           written.capacity() == capacity);
  }
};

StripeStore::StripeStore(client::Cluster* cluster, StripeStoreOptions options)
    : cluster_(cluster), options_(std::move(options)) {}

Result<std::unique_ptr<StripeStore>> StripeStore::Create(client::Cluster* cluster,
                                                         StripeStoreOptions options) {
  if (options.size == 0 || options.size % kPage != 0) {
    return Err(InvalidArgument(
        fmt::format("export size {} must be a non-zero multiple of 4096", options.size)));
  }
  FARMEM_RETURN_IF_ERROR(CheckResilience(options.resilience));
  FARMEM_RETURN_IF_ERROR(CheckBusyPoll(options.busy_poll));
  std::unique_ptr<StripeStore> s(new StripeStore(cluster, std::move(options)));
  FARMEM_RETURN_IF_ERROR(s->Init());
  return s;
}

Status StripeStore::CheckResilience(const client::Resilience& res) {
  if (res.mode != client::Resilience::Mode::kErasure) {
    return InvalidArgument(fmt::format(
        "the stripe layout is for ec:k+r resilience, not {} (none and replicate keep whole pages "
        "already)",
        res.ToString()));
  }
  if (res.group_size() > spanstore::kMaxSetWidth) {
    return InvalidArgument(fmt::format(
        "{}: the stripe layout spreads a stripe over at most {} daemons (k + r): give a smaller "
        "k + r, or use the split layout (farmem-nbd --ec-layout split, k + r up to {})",
        res.ToString(), spanstore::kMaxSetWidth, client::Resilience::kMaxGroupSize));
  }
  return Status::Ok();
}

Status StripeStore::Init() {
  static_assert(sizeof(PageEntry) == 16, "the page table's 16 bytes per page (header comment)");
  const client::Resilience& res = options_.resilience;
  pages_ = options_.size / kPage;
  if (options_.encrypt) {
    aead::Key key{};
    if (options_.data_key) {
      key = *options_.data_key;
    } else {
      FARMEM_ASSIGN_OR_RETURN(key, aead::GenerateKey());
    }
    FARMEM_ASSIGN_OR_RETURN(crypto_, PageCrypto::Create(key, pages_, options_.seal_observer));
  }
  if (!options_.backup_path.empty()) {
    FARMEM_ASSIGN_OR_RETURN(backup_, BackupFile::Open(options_.backup_path, options_.size));
  }
  // Daemons may still be starting: wait a bounded time for the k a stripe needs at least.
  const Deadline wait_until = DeadlineIn(options_.startup_wait);
  while (cluster_->alive_count() < static_cast<size_t>(res.k)) {
    if (Clock::now() >= wait_until) {
      return Unavailable(fmt::format(
          "resilience {} needs at least {} live daemons, but only {} of {} are up after {} ms",
          res.ToString(), res.k, cluster_->alive_count(), cluster_->node_count(),
          options_.startup_wait.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // polls state, with a deadline
  }
  FARMEM_ASSIGN_OR_RETURN(
      remote_, spanstore::RemoteStore::Create(cluster_, res, static_cast<uint32_t>(kPage),
                                              options_.op_timeout, options_.reconcile_interval,
                                              options_.lease_ahead));
  table_ = std::make_unique<PageEntry[]>(pages_);
  locks_ = std::make_unique<SharedMutex[]>(kLockStripes);
  remote_->SetLostObserver([this](uint32_t group, std::span<spanstore::SpanOwner* const> spans) {
    LogLostPages(group, spans);
  });
  std::vector<std::unique_ptr<Worker>> workers;
  for (size_t i = 0; i < options_.workers + 1; ++i) {  // +1: the compactor's
    auto w = std::make_unique<Worker>();
    if (i < options_.workers) {
      w->Reserve(kPiecePages, kPieceWrites, kPiecePartials, crypto_ != nullptr);
    } else {  // the compactor's: one pass's candidates, every one read and written whole
      const size_t n = kCompactSets * static_cast<size_t>(res.k);
      w->Reserve(n, n, n, crypto_ != nullptr);
    }
    w->io = remote_->NewIoContext();
    if (i < options_.workers) w->io->channels.SetBusyPoll(options_.busy_poll);
    if (crypto_) {
      FARMEM_ASSIGN_OR_RETURN(aead::Cipher c, crypto_->NewCipher());
      w->cipher.emplace(std::move(c));
    }
    workers.push_back(std::move(w));
  }
  workers_.Init(std::move(workers));
  compact_thread_ = std::thread([this] { CompactLoop(); });
  spdlog::info("stripe store: {} export, {} in stripes of {} pages + {} parity, {}{}",
               FormatSize(options_.size), res.ToString(), res.k, res.r,
               crypto_ ? "pages encrypted (AES-256-GCM)" : "pages NOT encrypted",
               backup_ ? ", backup " + backup_->path() : "");
  return Status::Ok();
}

StripeStore::~StripeStore() {
  {
    MutexLock lock(&compact_mu_);
    stopping_ = true;
  }
  compact_cv_.SignalAll();
  if (compact_thread_.joinable()) compact_thread_.join();
  if (remote_) remote_->Shutdown();  // frees the groups' leases
}

// ---------------------------------------------------------------------------------------------
// Page locks

void StripeStore::LockPages(Worker& w, std::span<const PageIo> pages) {
  w.held.clear();
  for (const PageIo& p : pages) {
    w.held.emplace_back(static_cast<uint32_t>(p.page % kLockStripes), p.write || p.release);
  }
  std::sort(w.held.begin(), w.held.end());
  // One entry per stripe, exclusive if any page of it changes (sorted: the exclusive one last).
  size_t out = 0;
  for (size_t i = 0; i < w.held.size(); ++i) {
    if (out > 0 && w.held[out - 1].first == w.held[i].first) {
      w.held[out - 1].second = w.held[out - 1].second || w.held[i].second;
    } else {
      w.held[out++] = w.held[i];
    }
  }
  w.held.resize(out);
  for (const auto& [stripe, exclusive] : w.held) {
    if (exclusive) {
      locks_[stripe].Lock();
    } else {
      locks_[stripe].LockShared();
    }
  }
}

void StripeStore::UnlockPages(Worker& w) {
  for (auto it = w.held.rbegin(); it != w.held.rend(); ++it) {
    if (it->second) {
      locks_[it->first].Unlock();
    } else {
      locks_[it->first].UnlockShared();
    }
  }
  w.held.clear();
}

// ---------------------------------------------------------------------------------------------
// The batch path

namespace {
// What op `op` takes of a worker's piece: pages (an upper bound), pages written (sealed), and
// partial pages (scratch). Ops the store rejects (beyond the export) take nothing.
struct OpCost {
  uint64_t pages = 0, writes = 0, partials = 0;
};
OpCost CostOf(const BlockOp& op, uint64_t size) {
  constexpr uint64_t kPage = StripeStore::kPage;
  if (op.kind == BlockOp::Kind::kFlush || op.length == 0) return {};
  if (op.offset > size || op.length > size - op.offset) return {};
  const uint64_t end = op.offset + op.length;
  OpCost c;
  c.pages = (end - 1) / kPage - op.offset / kPage + 1;
  if (op.kind != BlockOp::Kind::kTrim) {
    c.partials = (op.offset % kPage != 0 ? 1 : 0) + (end % kPage != 0 ? 1 : 0);
  }
  if (op.kind == BlockOp::Kind::kWrite) c.writes = c.pages;
  if (op.kind == BlockOp::Kind::kWriteZeroes) c.writes = c.partials;  // whole pages: released
  return c;
}
}  // namespace

void StripeStore::ExecuteBatch(std::span<BlockOp> ops, BatchListener* /*listener*/) {
  Worker* w = workers_.Checkout();
  // In pieces of at most kPiecePages pages (kPieceWrites written, kPiecePartials partial), what
  // the worker's buffers were sized for at start: consecutive ops that fit together, and an op
  // larger than a piece alone, a range at a time. The ops of a batch are concurrent (NBD), so
  // running its pieces one after the other is one of the orders the client allows.
  size_t from = 0;
  while (from < ops.size()) {
    size_t to = from;
    OpCost sum;
    while (to < ops.size() && to - from < kPiecePages) {
      const OpCost c = CostOf(ops[to], options_.size);
      if (sum.pages + c.pages > kPiecePages || sum.writes + c.writes > kPieceWrites ||
          sum.partials + c.partials > kPiecePartials) {
        break;
      }
      sum.pages += c.pages;
      sum.writes += c.writes;
      sum.partials += c.partials;
      ++to;
    }
    if (to > from) {
      ExecutePiece(*w, ops.subspan(from, to - from));
      from = to;
      continue;
    }
    // One op larger than a piece: ranges of at most kPieceWrites pages, aligned to that size
    // (each touches at most two partial pages), each run as a batch of one.
    BlockOp& op = ops[from++];
    constexpr uint64_t kRange = kPieceWrites * kPage;
    op.status = Status::Ok();
    for (uint64_t at = op.offset; at < op.offset + op.length;) {
      const uint64_t n = std::min(op.offset + op.length, (at / kRange + 1) * kRange) - at;
      BlockOp piece[1];
      piece[0].kind = op.kind;
      piece[0].fua = op.fua;
      piece[0].may_trim = op.may_trim;
      piece[0].offset = at;
      piece[0].length = n;
      if (op.kind == BlockOp::Kind::kRead)
        piece[0].read_into = op.read_into.subspan(at - op.offset, n);
      if (op.kind == BlockOp::Kind::kWrite) piece[0].data = op.data.subspan(at - op.offset, n);
      ExecutePiece(*w, piece);
      if (!piece[0].status.ok()) {
        op.status = std::move(piece[0].status);
        break;
      }
      at += n;
    }
  }
  workers_.Return(w);
}

void StripeStore::ExecutePiece(Worker& worker, std::span<BlockOp> ops) {
  Worker* w = &worker;
  std::vector<PageIo>& pages = w->pages;
  pages.clear();
  w->op_status.assign(ops.size(), Status::Ok());
  uint8_t* scratch = w->scratch.data();
  for (size_t i = 0; i < ops.size(); ++i) {
    const BlockOp& op = ops[i];
    if (op.kind == BlockOp::Kind::kFlush || op.length == 0) continue;
    if (op.offset > options_.size || op.length > options_.size - op.offset) {
      w->op_status[i] = OutOfRange(fmt::format("{} bytes at {} lie beyond the export's {} bytes",
                                               op.length, op.offset, options_.size));
      continue;
    }
    const uint64_t end = op.offset + op.length;
    for (uint64_t pg = op.offset / kPage; pg * kPage < end; ++pg) {
      const uint64_t start = pg * kPage;
      const uint64_t lo = std::max(op.offset, start);
      const uint64_t hi = std::min(end, start + kPage);
      const bool whole = hi - lo == kPage;
      PageIo p;
      p.page = pg;
      p.op = i;
      p.patch_at = static_cast<uint32_t>(lo - start);
      p.patch_len = static_cast<uint32_t>(hi - lo);
      switch (op.kind) {
        case BlockOp::Kind::kRead:
          p.read = true;
          if (whole) {
            p.buf = op.read_into.data() + (lo - op.offset);
          } else {
            p.buf = scratch;
            scratch += kPage;
            p.copy_to = op.read_into.data() + (lo - op.offset);
          }
          break;
        case BlockOp::Kind::kWrite:
        case BlockOp::Kind::kWriteZeroes: {
          const bool zero = op.kind == BlockOp::Kind::kWriteZeroes;
          if (whole && zero) {
            p.release = true;
          } else if (whole) {
            p.write = true;
            p.src = op.data.data() + (lo - op.offset);
          } else {  // read-modify-write of the page, under its exclusive lock
            p.read = p.write = true;
            p.buf = scratch;
            scratch += kPage;
            p.src = p.buf;
            p.patch = zero ? nullptr : op.data.data() + (lo - op.offset);
          }
          break;
        }
        case BlockOp::Kind::kTrim:
          if (!whole) continue;  // contents after a trim are unspecified: leave it
          p.release = true;
          break;
        case BlockOp::Kind::kFlush:
          break;
      }
      pages.push_back(p);
    }
  }
  MergePartialWrites(*w);
  // A worker first used under load (a second connection, a flush beside a request) would
  // otherwise connect to the daemons under its pages' locks.
  remote_->OpenChannels(*w->io);
  LockPages(*w, pages);
  ReadPages(*w, pages, w->op_status);
  for (PageIo& p : pages) {
    const size_t base_op = p.primary == kNoPrimary ? p.op : pages[p.primary].op;
    if (!w->op_status[p.op].ok() || !w->op_status[base_op].ok()) continue;
    if (p.copy_to != nullptr) std::memcpy(p.copy_to, p.buf + p.patch_at, p.patch_len);
    if ((p.read && p.write) || p.primary != kNoPrimary) {
      if (p.patch != nullptr) {
        std::memcpy(p.buf + p.patch_at, p.patch, p.patch_len);
      } else {
        std::memset(p.buf + p.patch_at, 0, p.patch_len);
      }
    }
  }
  WritePages(*w, pages, w->op_status);
  for (size_t i = 0; i < pages.size(); ++i) {
    const PageIo& p = pages[i];
    if (p.release && w->op_status[p.op].ok()) {
      ReleaseCell(p.page);
      // The backup file reads as zeroes there too: one Zero per run of consecutive pages.
      const bool run_ends = i + 1 == pages.size() || !pages[i + 1].release ||
                            pages[i + 1].op != p.op || pages[i + 1].page != p.page + 1;
      if (backup_ && run_ends) {
        size_t first = i;
        while (first > 0 && pages[first - 1].release && pages[first - 1].op == p.op &&
               pages[first - 1].page + 1 == pages[first].page) {
          --first;
        }
        const uint64_t from = pages[first].page * kPage;
        if (Status z = backup_->Zero(from, (p.page + 1) * kPage - from); !z.ok()) {
          w->op_status[p.op] = z.WithContext("zeroing the backup file");
        }
      }
    }
    // A patch merged into another op's page landed only if that page was written.
    if (p.primary != kNoPrimary && w->op_status[p.op].ok() &&
        !w->op_status[pages[p.primary].op].ok()) {
      w->op_status[p.op] = w->op_status[pages[p.primary].op];
    }
  }
  UnlockPages(*w);
  if (backup_) {
    // FLUSH, and FUA writes / trims / write-zeroes: durable in the backup file before the reply.
    bool flush = false;
    for (const BlockOp& op : ops) flush = flush || op.kind == BlockOp::Kind::kFlush || op.fua;
    if (flush) {
      if (Status f = backup_->Flush(); !f.ok()) {
        for (size_t i = 0; i < ops.size(); ++i) {
          if ((ops[i].kind == BlockOp::Kind::kFlush || ops[i].fua) && w->op_status[i].ok()) {
            w->op_status[i] = f.WithContext("flushing the backup file " + backup_->path());
          }
        }
      }
    }
  }
  for (size_t i = 0; i < ops.size(); ++i) ops[i].status = std::move(w->op_status[i]);
  w->CheckCapacity();
}

void StripeStore::MergePartialWrites(Worker& w) {
  std::vector<PageIo>& pages = w.pages;
  w.rmw.clear();
  for (size_t i = 0; i < pages.size(); ++i) {
    if (pages[i].read && pages[i].write) w.rmw.push_back(i);
  }
  if (w.rmw.size() < 2) return;
  std::stable_sort(w.rmw.begin(), w.rmw.end(),
                   [&](size_t a, size_t b) { return pages[a].page < pages[b].page; });
  size_t first = w.rmw[0];
  for (size_t j = 1; j < w.rmw.size(); ++j) {
    PageIo& p = pages[w.rmw[j]];
    if (p.page != pages[first].page) {
      first = w.rmw[j];
      continue;
    }
    p.primary = first;
    p.read = p.write = false;
    p.buf = pages[first].buf;
  }
}

void StripeStore::ReadPages(Worker& w, std::span<PageIo> pages, std::span<Status> op_status) {
  w.sets.clear();
  w.members.clear();
  w.dsts.clear();
  w.which.clear();
  for (size_t i = 0; i < pages.size(); ++i) {
    PageIo& p = pages[i];
    if (!p.read || !op_status[p.op].ok()) continue;
    const PageEntry& e = table_[p.page];
    if (e.set == nullptr) {
      std::memset(p.buf, 0, kPage);
      continue;
    }
    if (crypto_) crypto_->Prefetch(p.page, 1);
    w.sets.push_back(e.set);
    w.members.push_back(e.member);
    w.dsts.push_back(p.buf);
    w.which.push_back(i);
  }
  if (w.sets.empty()) return;
  w.results.assign(w.sets.size(), Status::Ok());
  // ReadSpans posts up to kMaxReadRound reads together (one round, one doorbell per daemon) and
  // would read the rest one at a time: hand it that many at once.
  constexpr size_t kBatch = spanstore::kMaxReadRound;
  const size_t total = w.sets.size();
  for (size_t i = 0; i < total; i += kBatch) {
    const size_t n = std::min(kBatch, total - i);
    remote_->ReadSpans(*w.io, {w.sets.data() + i, n}, {w.members.data() + i, n},
                       {w.dsts.data() + i, n}, {w.results.data() + i, n});
  }
  for (size_t j = 0; j < w.sets.size(); ++j) {
    PageIo& p = pages[w.which[j]];
    Status st = std::move(w.results[j]);
    if (st.ok() && crypto_) {
      st = crypto_->Open(*w.cipher, p.page, p.buf);
      if (!st.ok()) st = RecoverCell(w, p.page, w.sets[j], w.members[j], p.buf);
    } else if (!st.ok()) {
      // Lost cells (members given up) are counted by RemoteStore when it gives them up.
      st = st.WithContext(fmt::format("reading export page {} (bytes {}..{})", p.page,
                                      p.page * kPage, (p.page + 1) * kPage));
      if (backup_) {
        Status b = ReadBackup(w, p.page, p.buf);
        st = b.ok() ? b : st.WithContext("and from the backup file: " + b.ToString());
      }
    }
    if (!st.ok() && op_status[p.op].ok()) op_status[p.op] = std::move(st);
  }
}

Status StripeStore::RecoverCell(Worker& w, uint64_t page, SpanSet* set, int member, uint8_t* buf) {
  integrity_failures_.fetch_add(1, std::memory_order_relaxed);
  const Status why = DataLoss(fmt::format("export page {} failed authentication", page));
  if (remote_->ReportCorrupt(set, member, why)) {
    Status st = remote_->ReadSpan(*w.io, set, member, buf);
    if (st.ok()) st = crypto_->Open(*w.cipher, page, buf);
    if (st.ok()) {
      spdlog::warn(
          "stripe store: export page {} failed authentication on its daemon (changed there or in "
          "transit); served rebuilt from the other members, its member is re-protected",
          page);
      return Status::Ok();
    }
  }
  if (backup_ && ReadBackup(w, page, buf).ok()) {
    spdlog::warn(
        "stripe store: export page {} failed authentication on its daemon and no other member "
        "could produce a copy that opens: served from the backup file {}",
        page, backup_->path());
    return Status::Ok();
  }
  if (!table_[page].lost_counted.exchange(true, std::memory_order_relaxed)) {
    lost_pages_.fetch_add(1, std::memory_order_relaxed);
  }
  spdlog::error(
      "stripe store: export page {} (bytes {}..{}) failed authentication and no other "
      "member could produce a copy that opens: the read fails",
      page, page * kPage, (page + 1) * kPage);
  return DataLoss(
      fmt::format("export page {} (bytes {}..{}) failed authentication and cannot be "
                  "rebuilt from the other members",
                  page, page * kPage, (page + 1) * kPage));
}

Status StripeStore::ReadBackup(Worker& w, uint64_t page, uint8_t* buf) {
  FARMEM_RETURN_IF_ERROR(backup_->Read(page * kPage, {buf, static_cast<size_t>(kPage)}));
  if (crypto_) FARMEM_RETURN_IF_ERROR(crypto_->Open(*w.cipher, page, buf));
  backup_reads_.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

void StripeStore::LogLostPages(uint32_t group, std::span<spanstore::SpanOwner* const> spans) {
  // The owner is the page's table entry: its page is where it sits in the table (no lock needed,
  // nothing of the entry is read).
  std::vector<uint64_t> pages;
  pages.reserve(spans.size());
  for (spanstore::SpanOwner* o : spans) {
    pages.push_back(static_cast<uint64_t>(static_cast<PageEntry*>(o) - table_.get()));
  }
  std::ranges::sort(pages);
  // Contiguous pages as export byte ranges, a bounded number per line (a group of a 64 GiB
  // export can hold hundreds of thousands of scattered pages).
  constexpr size_t kRangesPerLine = 64;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [first, last] pages
  for (uint64_t p : pages) {
    if (!ranges.empty() && ranges.back().second + 1 >= p) {
      ranges.back().second = std::max(ranges.back().second, p);
    } else {
      ranges.emplace_back(p, p);
    }
  }
  for (size_t i = 0; i < ranges.size(); i += kRangesPerLine) {
    const size_t end = std::min(ranges.size(), i + kRangesPerLine);
    std::string list;
    uint64_t n = 0;
    for (size_t j = i; j < end; ++j) {
      if (!list.empty()) list += ", ";
      list += fmt::format("{}..{}", ranges[j].first * kPage, (ranges[j].second + 1) * kPage);
      n += ranges[j].second - ranges[j].first + 1;
    }
    if (backup_) {
      spdlog::warn(
          "stripe store: {} pages of slab group {} lost their cells (export bytes {}): more of "
          "its members were given up than {} survives; they are read from the backup file {} "
          "until written again",
          n, group, list, options_.resilience.ToString(), backup_->path());
    } else {
      spdlog::error(
          "stripe store: {} pages of slab group {} are LOST (export bytes {}): more of its "
          "members were given up than {} survives; reads of them fail (EIO) until they are "
          "written again",
          n, group, list, options_.resilience.ToString());
    }
  }
}

void StripeStore::WritePages(Worker& w, std::span<PageIo> pages, std::span<Status> op_status) {
  w.which.clear();
  for (size_t i = 0; i < pages.size(); ++i) {
    if (pages[i].write && op_status[pages[i].op].ok()) w.which.push_back(i);
  }
  if (w.which.empty()) return;
  if (crypto_) {
    assert(w.sealed.size() >= w.which.size() * kPage);  // sized at start (Reserve)
    size_t kept = 0;
    for (size_t j = 0; j < w.which.size(); ++j) {
      PageIo& p = pages[w.which[j]];
      uint8_t* out = w.sealed.data() + kept * kPage;
      if (Status s = crypto_->Seal(*w.cipher, p.page, p.src, out); !s.ok()) {
        crypto_->EndWrite(p.page, /*ok=*/false);
        if (op_status[p.op].ok()) op_status[p.op] = s;
        continue;
      }
      p.src = out;  // what goes out is the ciphertext
      w.which[kept++] = w.which[j];
    }
    w.which.resize(kept);
  }
  // k pages a set, every set of the batch written together (RemoteStore::WriteSets).
  const size_t k = static_cast<size_t>(options_.resilience.k);
  const size_t nsets = (w.which.size() + k - 1) / k;
  w.data.resize(w.which.size());
  w.owners.resize(w.which.size());
  const bool keep_crc = options_.compaction_offload;
  if (keep_crc) w.crcs.resize(w.which.size());
  w.set_data.resize(nsets);
  w.set_owners.resize(nsets);
  w.written.resize(nsets);
  for (size_t j = 0; j < w.which.size(); ++j) {
    const PageIo& p = pages[w.which[j]];
    w.data[j] = p.src;
    w.owners[j] = &table_[p.page];
    if (keep_crc) w.crcs[j] = ec::Crc32c({p.src, static_cast<size_t>(kPage)});
  }
  for (size_t i = 0; i < nsets; ++i) {
    const size_t n = std::min(k, w.which.size() - i * k);
    w.set_data[i] = {w.data.data() + i * k, n};
    w.set_owners[i] = {w.owners.data() + i * k, n};
  }
  remote_->WriteSets(*w.io, w.set_data, w.set_owners, w.written);
  for (size_t i = 0; i < nsets; ++i) {
    const Result<SpanSet*>& set = w.written[i];
    const size_t n = w.set_data[i].size();
    if (set) {
      sets_written_.fetch_add(1, std::memory_order_relaxed);
      if (n < k) short_sets_.fetch_add(1, std::memory_order_relaxed);
    }
    for (size_t j = 0; j < n; ++j) {
      const PageIo& p = pages[w.which[i * k + j]];
      if (!set) {
        if (crypto_) crypto_->EndWrite(p.page, /*ok=*/false);
        if (op_status[p.op].ok()) {
          op_status[p.op] =
              set.error().WithContext(fmt::format("writing export page {} (bytes {}..{})", p.page,
                                                  p.page * kPage, (p.page + 1) * kPage));
        }
        continue;
      }
      PageEntry& e = table_[p.page];
      if (e.set != nullptr) {
        remote_->Release(e.set, e.member);  // the old cell becomes a hole
      } else {
        live_pages_.fetch_add(1, std::memory_order_relaxed);
      }
      e.set = *set;
      e.member = static_cast<int16_t>(j);
      e.cell_crc = keep_crc ? w.crcs[i * k + j] : 0;
      e.lost_counted.store(false, std::memory_order_relaxed);
      if (crypto_) crypto_->EndWrite(p.page, /*ok=*/true);
      // The same bytes as the cell (ciphertext when encrypted), at the page's export offset.
      if (backup_) {
        if (Status b = backup_->Write(p.page * kPage, {p.src, static_cast<size_t>(kPage)});
            !b.ok() && op_status[p.op].ok()) {
          op_status[p.op] = b.WithContext("writing the backup file " + backup_->path());
        }
      }
    }
  }
}

void StripeStore::ReleaseCell(uint64_t page) {
  PageEntry& e = table_[page];
  if (e.set == nullptr) return;
  remote_->Release(e.set, e.member);
  e.set = nullptr;
  e.member = 0;
  e.lost_counted.store(false, std::memory_order_relaxed);
  live_pages_.fetch_sub(1, std::memory_order_relaxed);
}

std::vector<std::pair<client::Lease, uint64_t>> StripeStore::PagePlaces(uint64_t page) {
  if (page >= pages_) return {};
  ReaderLock lock(&locks_[page % kLockStripes]);
  const PageEntry& e = table_[page];
  if (e.set == nullptr) return {};
  return remote_->CellPlaces(e.set, e.member);
}

// ---------------------------------------------------------------------------------------------
// Compaction: the live cells of the emptiest sets become full sets, under the pages' exclusive
// locks; their old cells become holes and the emptied rows and groups go back to the daemons.
// With offload the daemons copy the cells (CompactOffloaded); without it, or when that fails,
// they are read (and opened: a corrupted cell is caught here, not moved) and written again
// through the batch path's own ReadPages and WritePages.

Status StripeStore::CompactOnce(uint64_t* moved) {
  *moved = 0;
  MutexLock pass(&compact_pass_mu_);
  const size_t k = static_cast<size_t>(options_.resilience.k);
  Worker* w = &workers_.background();  // the compactor's own (one pass at a time)
  std::vector<SpanOwner*>& cands = w->cands;
  remote_->CompactionCandidates(kCompactSets * k, &cands);
  if (cands.empty()) return Status::Ok();
  // What compaction costs the client: this thread's CPU, and the bytes of its I/O context.
  ThreadCpuMeter cpu(compaction_cpu_ns_);
  const spanstore::IoContext& io = *w->io;
  const uint64_t received0 = io.bytes_read + io.offload_bytes_received;
  const uint64_t sent0 = io.bytes_written + io.offload_bytes_sent;
  // Before the pages are locked: the first pass of this thread's I/O context (or one after a
  // group was placed on a daemon it has no channel to) would otherwise connect under the locks.
  remote_->OpenChannels(*w->io);
  std::vector<PageIo>& pages = w->pages;
  pages.clear();
  assert(w->scratch.size() >= cands.size() * kPage);  // sized at start (Reserve)
  for (size_t i = 0; i < cands.size(); ++i) {
    PageIo p;
    p.page = static_cast<uint64_t>(static_cast<PageEntry*>(cands[i]) - table_.get());
    p.op = i;
    p.read = p.write = true;
    p.buf = w->scratch.data() + i * kPage;
    p.src = p.buf;
    pages.push_back(p);
  }
  LockPages(*w, pages);
  // The candidates are a snapshot: a page trimmed since has nothing to move.
  for (PageIo& p : pages) {
    if (table_[p.page].set == nullptr) p.read = p.write = false;
  }
  w->op_status.assign(pages.size(), Status::Ok());
  const bool offloaded =
      options_.compaction_offload && options_.resilience.r > 0 && CompactOffloaded(*w, pages);
  if (!offloaded) {
    ReadPages(*w, pages, w->op_status);
    WritePages(*w, pages, w->op_status);
  }
  UnlockPages(*w);
  compaction_bytes_received_.fetch_add(io.bytes_read + io.offload_bytes_received - received0,
                                       std::memory_order_relaxed);
  compaction_bytes_sent_.fetch_add(io.bytes_written + io.offload_bytes_sent - sent0,
                                   std::memory_order_relaxed);
  Status first;
  for (size_t i = 0; i < pages.size(); ++i) {
    if (!pages[i].write) continue;
    if (w->op_status[i].ok()) {
      ++*moved;
    } else if (first.ok()) {
      first = w->op_status[i];
    }
  }
  if (*moved > 0) {
    compactions_.fetch_add(1, std::memory_order_relaxed);
    pages_compacted_.fetch_add(*moved, std::memory_order_relaxed);
  }
  return first;
}

bool StripeStore::CompactOffloaded(Worker& w, std::span<PageIo> pages) {
  const size_t k = static_cast<size_t>(options_.resilience.k);
  w.which.clear();
  for (size_t i = 0; i < pages.size(); ++i) {
    if (pages[i].write) w.which.push_back(i);
  }
  const size_t n = w.which.size();
  if (n == 0) return true;
  // The plan: moved page j becomes data member j % k of new set j / k, copied whole from where
  // it is (one piece per cell: a page is a cell).
  using GatherPiece = spanstore::RemoteStore::GatherPiece;
  std::vector<std::vector<GatherPiece>> cells(n);
  w.owners.resize(n);
  w.crcs.assign(n, 0);
  for (size_t j = 0; j < n; ++j) {
    PageEntry& e = table_[pages[w.which[j]].page];
    cells[j].push_back({e.set, e.member, e.cell_crc, 0, 0, static_cast<uint32_t>(kPage)});
    w.owners[j] = &e;
  }
  std::vector<SpanSet*> written;
  std::vector<std::pair<SpanSet*, int>> corrupt;
  Status error;
  for (size_t i = 0; i < n; i += k) {
    const size_t m = std::min(k, n - i);
    Result<SpanSet*> set = remote_->WriteSetGathered(
        *w.io, {cells.data() + i, m}, {w.owners.data() + i, m}, {w.crcs.data() + i, m}, &corrupt);
    if (!set) {
      error = set.error();
      break;
    }
    written.push_back(*set);
  }
  // Sources the gathering daemons read with another checksum than they were written with: their
  // members are re-protected, and the fallback below reads them rebuilt.
  for (const auto& [set, member] : corrupt) {
    integrity_failures_.fetch_add(1, std::memory_order_relaxed);
    uint64_t page = ~uint64_t{0};
    for (size_t j = 0; j < n; ++j) {
      const PageEntry& e = table_[pages[w.which[j]].page];
      if (e.set == set && e.member == member) page = pages[w.which[j]].page;
    }
    const Status why = DataLoss(fmt::format(
        "the cell of export page {} failed its checksum (CRC-32C) on the daemon gathering it "
        "for compaction: its bytes on the daemon were corrupted",
        page));
    const bool repair = remote_->ReportCorrupt(set, member, why);
    spdlog::warn("stripe store: {}; {}", why.message(),
                 repair ? "its member is re-protected and the page is read rebuilt"
                        : "nothing else holds it");
  }
  if (!error.ok()) {
    // Nothing changes: the sets written so far are undone, and the pass moves the bytes itself.
    for (size_t s = 0; s < written.size(); ++s) {
      for (size_t j = 0; j < k && s * k + j < n; ++j) {
        remote_->Release(written[s], static_cast<int>(j));
      }
    }
    compaction_offload_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    const Clock::time_point now = Clock::now();
    if (now - last_offload_log_ >= std::chrono::seconds(5)) {
      last_offload_log_ = now;
      spdlog::warn(
          "stripe store: compaction offload failed, the client moves the pages ({} such passes "
          "so far; logged at most every 5 s): {}",
          compaction_offload_fallbacks_.load(std::memory_order_relaxed), error.ToString());
    }
    return false;
  }
  // Committed: the old cells become holes, the entries point at the new ones. The ciphertext is
  // the same bytes (its recorded seal opens it; the backup file already holds it).
  for (size_t j = 0; j < n; ++j) {
    PageEntry& e = table_[pages[w.which[j]].page];
    remote_->Release(e.set, e.member);
    e.set = written[j / k];
    e.member = static_cast<int16_t>(j % k);
    e.cell_crc = w.crcs[j];
  }
  compaction_offloaded_sets_.fetch_add(written.size(), std::memory_order_relaxed);
  return true;
}

bool StripeStore::CompactionWanted() const {
  if (options_.compact_trigger <= 0) return false;
  const client::Resilience& res = options_.resilience;
  const spanstore::RemoteStoreStats rs = remote_->stats();
  const double packed = static_cast<double>(live_pages_.load(std::memory_order_relaxed)) * kPage *
                        res.group_size() / res.k;
  // One group's worth of slack: a small store is not compacted for rounding.
  return static_cast<double>(rs.set_bytes) >
         options_.compact_trigger * packed + static_cast<double>(res.group_size()) * kPage * 64;
}

void StripeStore::CheckCapacity() {
  const client::Resilience& res = options_.resilience;
  const spanstore::RemoteStoreStats rs = remote_->stats();
  const uint64_t group = static_cast<uint64_t>(res.group_size());
  const uint64_t slab_size = remote_->slab_size();
  // Held groups count whole: their missing members are in members_missing. A store with holes
  // holds more groups than a packed one (up to compact_trigger x): then 0 new groups.
  const uint64_t export_slabs = ExportSlabs(options_.size, res, slab_size);
  const uint64_t held_slabs = rs.groups * group;
  const uint64_t unleased = export_slabs > held_slabs ? (export_slabs - held_slabs) / group : 0;
  const uint64_t needed = unleased * group + rs.members_missing;
  const uint64_t free_slabs =
      CheckRunningCapacity(*cluster_, "stripe store", needed, slab_size, [&] {
        return fmt::format(
            "{} slab groups not leased yet x {} slabs at {} plus {} members to re-protect",
            unleased, group, res.ToString(), rs.members_missing);
      });
  cluster_free_slabs_.store(free_slabs, std::memory_order_relaxed);
  slabs_needed_.store(needed, std::memory_order_relaxed);
}

void StripeStore::CompactLoop() {
  Clock::time_point next_capacity_check = Clock::now();
  for (;;) {
    if (Clock::now() >= next_capacity_check) {
      CheckCapacity();
      next_capacity_check = Clock::now() + options_.reconcile_interval;
    }
    {
      MutexLock lock(&compact_mu_);
      // Compaction polls the store's fill (a cheap look at the set counts), every 50 ms.
      compact_cv_.WaitFor(&compact_mu_, std::chrono::milliseconds(50), [&] {
        compact_mu_.AssertHeld();
        return stopping_;
      });
      if (stopping_) return;
    }
    while (CompactionWanted()) {
      uint64_t moved = 0;
      Status s = CompactOnce(&moved);
      if (!s.ok()) spdlog::warn("stripe store: compaction: {}", s.ToString());
      if (moved == 0) break;
      MutexLock lock(&compact_mu_);
      if (stopping_) return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Stats

PageStoreStats StripeStore::stats() const {
  const spanstore::RemoteStoreStats rs = remote_->stats();
  PageStoreStats s;
  s.extents_mapped = rs.groups;
  s.degraded_reads = rs.degraded_reads;
  s.rebuilds = rs.members_reprotected;
  s.degraded_extents = rs.degraded_sets + rs.unrecoverable_sets;
  s.degraded_maps = rs.degraded_sets_written;
  s.degraded_episodes = rs.degraded_episodes;
  s.moved_members = rs.members_moved;
  s.moved_bytes = rs.moved_bytes;
  // Per moved member (the split layout's are per burst of notices: docs/nbd.md "Stripe layout").
  s.last_move_ms = rs.move_last_ms;
  s.last_move_bytes = rs.move_last_bytes;
  s.last_degraded_ms = rs.last_episode_degraded_ms;
  s.last_reprotect_ms = rs.last_episode_reprotect_ms;
  s.last_reprotect_bytes = rs.last_episode_rebuilt_bytes;
  s.episode_degraded_ms = rs.episode_degraded_ms;
  s.episode_reprotect_ms = rs.episode_reprotect_ms;
  s.episode_reprotected_extents = rs.episode_sets_reprotected;
  s.revalidated_members = rs.members_revalidated;
  s.write_retries = write_retries_.load(std::memory_order_relaxed);
  s.integrity_failures = integrity_failures_.load(std::memory_order_relaxed);
  // Once per page, not per read: cells on members given up (RemoteStore), and cells that failed
  // authentication with no redundancy left to rebuild them.
  // With a backup file the cells given up are read from it: not lost.
  s.lost_bytes =
      (backup_ ? 0 : rs.lost_bytes) + lost_pages_.load(std::memory_order_relaxed) * kPage;
  s.backup_reads = backup_reads_.load(std::memory_order_relaxed);
  s.rebuilt_bytes = rs.rebuilt_bytes;
  s.reprotected_extents = rs.sets_reprotected;
  s.rebuild_running = rs.degraded_sets > 0 || rs.moves_pending > 0;
  s.rebuild_queued = rs.moves_pending;
  s.moves_missed = rs.moves_missed;
  s.copies_abandoned = rs.copies_abandoned;
  s.cluster_free_slabs = cluster_free_slabs_.load(std::memory_order_relaxed);
  s.slabs_needed = slabs_needed_.load(std::memory_order_relaxed);
  return s;
}

StripeStoreStats StripeStore::stripe_stats() const {
  const spanstore::RemoteStoreStats rs = remote_->stats();
  StripeStoreStats s;
  s.live_pages = live_pages_.load(std::memory_order_relaxed);
  s.sets = rs.sets;
  s.set_bytes = rs.set_bytes;
  s.leased_bytes = rs.leased_bytes;
  s.groups_leased_ahead = rs.groups_leased_ahead;
  s.groups_leased_by_writers = rs.groups_leased_by_writers;
  s.sets_written = sets_written_.load(std::memory_order_relaxed);
  s.short_sets = short_sets_.load(std::memory_order_relaxed);
  s.compactions = compactions_.load(std::memory_order_relaxed);
  s.pages_compacted = pages_compacted_.load(std::memory_order_relaxed);
  s.compaction_offloaded_sets = compaction_offloaded_sets_.load(std::memory_order_relaxed);
  s.compaction_offload_fallbacks = compaction_offload_fallbacks_.load(std::memory_order_relaxed);
  s.compaction_bytes_sent = compaction_bytes_sent_.load(std::memory_order_relaxed);
  s.compaction_bytes_received = compaction_bytes_received_.load(std::memory_order_relaxed);
  s.compaction_cpu_ns = compaction_cpu_ns_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace farmem::blockdev
