// WriteCache (write_cache.h): planning a batch against the cache, the backend ops it needs, and
// the write-backs.
//
// A cached page knows which of its 512-byte sectors it holds (`valid`): a write smaller than a
// page to a page not cached takes a slot and holds just the sectors written, without reading
// anything. The rest of the page is read from the backend only when the page goes back (then all
// the pages of a write-back batch that need it are read together, merged, and written), and not at
// all when later writes filled the page (sequential small writes). A read of sectors a page does
// not hold reads the backend and lays the page's sectors over it (the page is pinned meanwhile).
//
// A batch runs as one or more sub-batches. Planning (under mu_) walks the ops in order: what the
// cache can serve now is copied now; what is not cached becomes backend ops. When an op would have
// to wait (a page going back, a pinned page a discard would drop) or needs pages while none is free
// or clean, planning stops: the planned part runs first, then the op is retried. The backend ops
// of a sub-batch run as one backend batch, outside mu_.
//
// Why one file of ~830 lines (longer than the ~600 lines a file keeps to): the planner and the
// write-back are two halves of one state machine over one slot table, two LRU lists and mu_, and
// the types they share (Slot, Scratch, Translator) are private to this file; a split would move
// them into a private header and make each half harder to read without the other.
#include "farmem/blockdev/write_cache.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

namespace farmem::blockdev {

using SteadyClock = std::chrono::steady_clock;

struct WriteCache::Slot {
  enum class State : uint8_t { kFree, kReady };
  uint64_t page = 0;
  int32_t hash_next = -1;
  int32_t prev = -1, next = -1;  // in clean_ or dirty_ (ready pages only)
  State state = State::kFree;
  bool dirty = false;
  bool writeback = false;  // its bytes are being written to the backend
  bool failed = false;     // its last write-back failed (still dirty)
  uint8_t valid = 0;       // the 512-byte sectors the page holds (all of them unless dirty)
  uint16_t pins = 0;  // reads that will lay this page over backend data: not evicted or dropped
  uint64_t dirty_seq = 0;  // when it became dirty (dirty_seq_)
  uint64_t flush_epoch = 0;
  SteadyClock::time_point dirty_since{};
  SteadyClock::time_point retry_at{};  // after a failed write-back: not before
};

namespace {
constexpr int32_t kNone = -1;
constexpr uint8_t kAllSectors = 0xff;

uint8_t SectorMask(uint64_t from, uint64_t to) {  // bytes [from, to) of a page, 512-aligned
  uint8_t m = 0;
  for (uint64_t s = from / 512; s < (to + 511) / 512; ++s) m = static_cast<uint8_t>(m | (1u << s));
  return m;
}
}  // namespace

// Per request of a batch.
struct OpState {
  uint32_t backend_ops = 0;  // not finished yet
  bool cache_work = false;   // touched cached pages (done after the sub-batch, not by the backend)
  bool reported = false;     // the listener was told
  bool flush = false;
};

// A read that got bytes of a pinned page from the backend: the page's valid sectors are laid over
// them once the backend read is done.
struct Overlay {
  size_t op;
  int32_t slot;
  uint32_t at, len;  // within the page
  uint8_t* to;       // the read's destination
};

struct WriteCache::Scratch {
  std::vector<OpState> state;
  std::vector<BlockOp> backend;
  std::vector<uint32_t> backend_op;  // request of each backend op, or kFillOp
  std::vector<uint8_t> backend_done;
  std::vector<Overlay> overlays;
  std::vector<int32_t> wb;
  size_t need = 0;  // pages the op that got kNeedSlots needs
  // Made at a thread's first request and sized then for the largest batch the NBD server hands
  // over (256 requests, a backend op and an overlay for each of a 1 MiB request's pages), so
  // that later requests do not allocate (swap safety, docs/nbd.md); kept, never shrunk.
  Scratch() {
    constexpr size_t kOps = 256, kPages = 256;
    state.reserve(kOps);
    backend.reserve(kOps + kPages);
    backend_op.reserve(kOps + kPages);
    backend_done.reserve(kOps + kPages);
    overlays.reserve(kPages);
    wb.reserve(kPages);
  }
  bool empty() const { return backend.empty() && overlays.empty(); }
  void ClearSub() {
    backend.clear();
    backend_op.clear();
    overlays.clear();
  }
};

// Reports requests whose backend ops all finished (and that touch no cached page) to the
// connection as the backend finishes them.
class WriteCache::Translator final : public BatchListener {
 public:
  Translator(std::span<BlockOp> ops, Scratch& s, BatchListener* outer)
      : ops_(ops), s_(s), outer_(outer) {}
  void OpDone(size_t bi) override {
    if (s_.backend_done[bi] != 0) return;
    s_.backend_done[bi] = 1;
    const uint32_t i = s_.backend_op[bi];
    OpState& st = s_.state[i];
    if (!s_.backend[bi].status.ok() && ops_[i].status.ok()) ops_[i].status = s_.backend[bi].status;
    if (--st.backend_ops == 0 && !st.cache_work && !st.reported && outer_ != nullptr) {
      st.reported = true;
      outer_->OpDone(i);
    }
  }
  void Progress() override {
    if (outer_ != nullptr) outer_->Progress();
  }

 private:
  std::span<BlockOp> ops_;
  Scratch& s_;
  BatchListener* outer_;
};

WriteCache::Scratch* WriteCache::ThreadScratch() {
  thread_local Scratch scratch;  // keeps its capacity: the request path does not allocate
  return &scratch;
}

// ---------------------------------------------------------------------------------------------
// Setup

WriteCache::WriteCache(std::unique_ptr<BlockBackend> inner, WriteCacheOptions options)
    : inner_(std::move(inner)),
      options_(std::move(options)),
      pages_in_export_(inner_->size() / kPage),
      ahead_dirty_pages_(
          std::max(options_.pages / 2,
                   options_.pages - std::min(options_.pages, 2 * options_.writeback_batch))) {}

Result<std::unique_ptr<WriteCache>> WriteCache::Create(std::unique_ptr<BlockBackend> inner,
                                                       WriteCacheOptions options) {
  if (inner == nullptr) return Err(InvalidArgument("write cache: no backend"));
  if (inner->size() % kPage != 0) {
    return Err(InvalidArgument(
        fmt::format("write cache: the export size {} is not a multiple of 4096", inner->size())));
  }
  if (options.pages < kMinPages || options.pages > (1u << 24)) {
    return Err(
        InvalidArgument(fmt::format("write cache: {} pages: give 0 (no cache) or {} to {} pages",
                                    options.pages, kMinPages, 1u << 24)));
  }
  if (options.max_dirty_age.count() <= 0) {
    return Err(InvalidArgument("write cache: the maximum dirty age must be positive"));
  }
  options.writeback_batch = std::clamp<size_t>(options.writeback_batch, 1, options.pages / 2);
  options.writeback_multiple = std::max<size_t>(options.writeback_multiple, 1);
  if (options.writeback_batch >= options.writeback_multiple) {  // whole groups a batch
    options.writeback_batch -= options.writeback_batch % options.writeback_multiple;
  }
  // An op held whole must find its pages: at most a quarter of the cache.
  options.absorb_writes_below_pages =
      std::min(options.absorb_writes_below_pages, options.pages / 4);
  std::unique_ptr<WriteCache> c(new WriteCache(std::move(inner), std::move(options)));
  const size_t n = c->options_.pages;
  c->buffers_ = std::make_unique<uint8_t[]>(n * kPage);
  size_t buckets = 1;
  while (buckets < 2 * n) buckets <<= 1;
  {
    MutexLock lock(&c->mu_);
    c->slots_.resize(n);
    c->buckets_.assign(buckets, kNone);
    c->bucket_mask_ = buckets - 1;
    c->free_.reserve(n);
    for (size_t i = n; i-- > 0;) c->free_.push_back(static_cast<int32_t>(i));
    c->stats_.pages = n;
  }
  if (c->options_.flusher_thread) c->flusher_ = std::thread([p = c.get()] { p->FlusherLoop(); });
  return c;
}

WriteCache::~WriteCache() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  flusher_cv_.SignalAll();
  if (flusher_.joinable()) flusher_.join();
  if (Status s = Flush(); !s.ok()) {
    MutexLock lock(&mu_);
    std::string pages;
    size_t n = 0;
    for (int32_t i = dirty_.head; i != kNone; i = slots_[i].next, ++n) {
      if (n < 16) pages += fmt::format("{}{}", pages.empty() ? "" : ", ", slots_[i].page * kPage);
    }
    spdlog::error(
        "write cache: at shutdown {} dirty pages could not be written back and are LOST (offsets "
        "{}{}): {}",
        n, pages, n > 16 ? ", ..." : "", s.ToString());
  }
}

SteadyClock::time_point WriteCache::Now() const {
  return options_.now ? options_.now() : SteadyClock::now();
}

WriteCacheStats WriteCache::stats() const {
  MutexLock lock(&mu_);
  WriteCacheStats s = stats_;
  s.cached = clean_.size + dirty_.size;
  s.dirty = dirty_.size;
  return s;
}

// ---------------------------------------------------------------------------------------------
// The map and the lists

int32_t WriteCache::Lookup(uint64_t page) const {
  for (int32_t i = buckets_[BucketOf(page)]; i != kNone; i = slots_[i].hash_next) {
    if (slots_[i].page == page) return i;
  }
  return kNone;
}

void WriteCache::Insert(int32_t slot) {
  int32_t& head = buckets_[BucketOf(slots_[slot].page)];
  slots_[slot].hash_next = head;
  head = slot;
}

void WriteCache::Erase(int32_t slot) {
  int32_t* at = &buckets_[BucketOf(slots_[slot].page)];
  while (*at != slot) at = &slots_[*at].hash_next;
  *at = slots_[slot].hash_next;
  slots_[slot].hash_next = kNone;
}

void WriteCache::PushFront(List& l, int32_t slot) {
  Slot& s = slots_[slot];
  s.prev = kNone;
  s.next = l.head;
  if (l.head != kNone) slots_[l.head].prev = slot;
  l.head = slot;
  if (l.tail == kNone) l.tail = slot;
  ++l.size;
}

void WriteCache::PushBack(List& l, int32_t slot) {
  Slot& s = slots_[slot];
  s.next = kNone;
  s.prev = l.tail;
  if (l.tail != kNone) slots_[l.tail].next = slot;
  l.tail = slot;
  if (l.head == kNone) l.head = slot;
  ++l.size;
}

void WriteCache::Unlink(List& l, int32_t slot) {
  Slot& s = slots_[slot];
  (s.prev != kNone ? slots_[s.prev].next : l.head) = s.next;
  (s.next != kNone ? slots_[s.next].prev : l.tail) = s.prev;
  s.prev = s.next = kNone;
  --l.size;
}

WriteCache::List& WriteCache::ListOf(const Slot& s) { return s.dirty ? dirty_ : clean_; }

void WriteCache::Touch(int32_t slot) {
  List& l = ListOf(slots_[slot]);
  if (l.head == slot) return;
  Unlink(l, slot);
  PushFront(l, slot);
}

void WriteCache::MarkDirty(int32_t slot) {
  Slot& s = slots_[slot];
  if (s.dirty) {
    Touch(slot);
    return;
  }
  if (s.state == Slot::State::kReady) Unlink(clean_, slot);
  s.dirty = true;
  s.failed = false;
  s.dirty_seq = ++dirty_seq_;
  s.dirty_since = Now();
  s.retry_at = {};
  PushFront(dirty_, slot);
  if (dirty_.size == 1 || dirty_.size == ahead_dirty_pages_) flusher_cv_.Signal();
}

void WriteCache::Drop(int32_t slot) {
  Slot& s = slots_[slot];
  Unlink(ListOf(s), slot);
  Erase(slot);
  s = Slot{};
  free_.push_back(slot);
}

int32_t WriteCache::AllocSlot(uint64_t lo, uint64_t hi) {
  int32_t slot = kNone;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    for (int32_t i = clean_.tail; i != kNone; i = slots_[i].prev) {
      if ((slots_[i].page >= lo && slots_[i].page <= hi) || slots_[i].pins > 0) continue;
      Unlink(clean_, i);
      Erase(i);
      slot = i;
      break;
    }
    if (slot == kNone) return kNone;
  }
  slots_[slot] = Slot{};
  return slot;
}

// ---------------------------------------------------------------------------------------------
// The request path

WriteCache::Plan WriteCache::PlanOp(BlockOp& op, size_t i, Scratch& s) {
  if (op.offset > size() || op.length > size() - op.offset) {
    op.status = OutOfRange(fmt::format("{} bytes at {} pass the end of the {}-byte export",
                                       op.length, op.offset, size()));
    return Plan::kPlanned;
  }
  if (op.length == 0) return Plan::kPlanned;
  switch (op.kind) {
    case BlockOp::Kind::kRead:
    case BlockOp::Kind::kWrite:
      return PlanReadWrite(op, i, s);
    case BlockOp::Kind::kTrim:
    case BlockOp::Kind::kWriteZeroes:
      return PlanZero(op, i, s);
    case BlockOp::Kind::kFlush:
      break;
  }
  return Plan::kPlanned;
}

WriteCache::Plan WriteCache::PlanReadWrite(BlockOp& op, size_t i, Scratch& s) {
  const bool write = op.kind == BlockOp::Kind::kWrite;
  const uint64_t end = op.offset + op.length;
  const uint64_t first = op.offset / kPage, last = (end - 1) / kPage;
  // Whole pages of this write are held too if it is small (absorb_writes_below_pages).
  const uint64_t op_pages = last - first + 1;
  const bool absorb = write && op_pages < options_.absorb_writes_below_pages;
  // Pass 1: can the op go ahead without waiting, and are there pages enough?
  size_t need = 0, clean_in_range = 0;
  for (uint64_t p = first; p <= last; ++p) {
    const int32_t slot = Lookup(p);
    const bool whole = op.offset <= p * kPage && end >= (p + 1) * kPage;
    if (slot == kNone) {
      if (write && (!whole || absorb)) ++need;
      continue;
    }
    const Slot& sl = slots_[slot];
    if (write && sl.writeback) return Plan::kWait;
    if (!sl.dirty) ++clean_in_range;
  }
  if (need > 0 && need + clean_in_range + pinned_ > free_.size() + clean_.size) {
    s.need = need;
    return Plan::kNeedSlots;
  }

  // Pass 2. Runs of bytes the cache does not hold become backend ops.
  OpState& st = s.state[i];
  uint64_t run_from = 0, run_to = 0;
  auto end_run = [&] {
    if (run_to == run_from) return;
    BlockOp b;
    b.kind = op.kind;
    b.fua = op.fua;
    b.offset = run_from;
    b.length = run_to - run_from;
    const uint64_t at = run_from - op.offset;
    if (write) {
      b.data = op.data.subspan(at, b.length);
    } else {
      b.read_into = op.read_into.subspan(at, b.length);
    }
    s.backend.push_back(b);
    s.backend_op.push_back(static_cast<uint32_t>(i));
    ++st.backend_ops;
    run_from = run_to = 0;
  };
  auto add_to_run = [&](uint64_t from, uint64_t to) {
    if (run_to != from) end_run();
    if (run_to == run_from) run_from = from;
    run_to = to;
  };
  for (uint64_t p = first; p <= last; ++p) {
    const uint64_t from = std::max(op.offset, p * kPage), to = std::min(end, (p + 1) * kPage);
    const uint64_t at = from - op.offset;  // in the op's buffer
    const uint32_t in_page = static_cast<uint32_t>(from - p * kPage);
    const uint32_t len = static_cast<uint32_t>(to - from);
    const uint8_t mask = SectorMask(in_page, in_page + len);
    int32_t slot = Lookup(p);
    if (slot == kNone && write && (len < kPage || absorb)) {
      slot = AllocSlot(first, last);  // pass 1 made sure there is one
      Slot& sl = slots_[slot];
      sl.page = p;
      sl.state = Slot::State::kReady;
      Insert(slot);
      PushFront(clean_, slot);  // MarkDirty below moves it
    }
    if (slot == kNone) {  // straight to the backend
      add_to_run(from, to);
      continue;
    }
    st.cache_work = true;
    Slot& sl = slots_[slot];
    if (write) {
      end_run();
      std::memcpy(Buf(slot) + in_page, op.data.data() + at, len);
      sl.valid = static_cast<uint8_t>(sl.valid | mask);
      MarkDirty(slot);
    } else if ((mask & ~sl.valid) == 0) {
      end_run();
      std::memcpy(op.read_into.data() + at, Buf(slot) + in_page, len);
      Touch(slot);
    } else {  // the page holds some of these sectors: the backend's, then the page's over them
      add_to_run(from, to);
      if (sl.valid != 0) {
        if (sl.pins++ == 0) ++pinned_;
        s.overlays.push_back({i, slot, in_page, len, op.read_into.data() + at});
      }
    }
  }
  end_run();
  return Plan::kPlanned;
}

WriteCache::Plan WriteCache::PlanZero(BlockOp& op, size_t i, Scratch& s) {
  const uint64_t end = op.offset + op.length;
  const uint64_t first = op.offset / kPage, last = (end - 1) / kPage;
  // The cached pages in range: by lookup for short ranges, by walking the slots for long ones (a
  // discard of the whole device).
  auto for_each_cached = [&](auto&& fn) REQUIRES(mu_) {
    if (last - first < slots_.size()) {
      for (uint64_t p = first; p <= last; ++p) {
        if (const int32_t slot = Lookup(p); slot != kNone && !fn(slot)) return false;
      }
    } else {
      for (size_t j = 0; j < slots_.size(); ++j) {
        const Slot& sl = slots_[j];
        if (sl.state != Slot::State::kFree && sl.page >= first && sl.page <= last &&
            !fn(static_cast<int32_t>(j))) {
          return false;
        }
      }
    }
    return true;
  };
  // A page going back must get there first (its write-back must not land after the zeroes), and
  // a pinned page must stay until the reads that pinned it have it laid over their bytes.
  const bool idle = for_each_cached([&](int32_t slot) REQUIRES(mu_) {
    return !slots_[slot].writeback && slots_[slot].pins == 0;
  });
  if (!idle) return Plan::kWait;
  s.wb.clear();
  for_each_cached([&](int32_t slot) REQUIRES(mu_) {
    s.wb.push_back(slot);
    return true;
  });
  for (int32_t slot : s.wb) {
    const uint64_t p = slots_[slot].page;
    const uint64_t from = std::max(op.offset, p * kPage), to = std::min(end, (p + 1) * kPage);
    if (to - from == kPage) {
      Drop(slot);  // the backend's zeroes (or unspecified trimmed contents) supersede it
    } else if (op.kind == BlockOp::Kind::kWriteZeroes) {
      std::memset(Buf(slot) + (from - p * kPage), 0, to - from);
      slots_[slot].valid =
          static_cast<uint8_t>(slots_[slot].valid | SectorMask(from - p * kPage, to - p * kPage));
      MarkDirty(slot);
    }  // a partly trimmed page keeps its bytes: trimmed contents are unspecified
  }
  BlockOp b = op;
  b.status = Status::Ok();
  s.backend.push_back(b);
  s.backend_op.push_back(static_cast<uint32_t>(i));
  ++s.state[i].backend_ops;
  return Plan::kPlanned;
}

void WriteCache::FinishSubBatch(std::span<BlockOp> ops, Scratch& s) {
  for (const Overlay& o : s.overlays) {
    Slot& sl = slots_[o.slot];
    if (ops[o.op].status.ok()) {
      for (uint32_t sec = o.at / 512; sec < (o.at + o.len) / 512; ++sec) {
        if ((sl.valid & (1u << sec)) == 0) continue;
        std::memcpy(o.to + (sec * 512 - o.at), Buf(o.slot) + sec * 512, 512);
      }
    }
    if (--sl.pins == 0) --pinned_;
  }
  changed_.SignalAll();
}

void WriteCache::ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener) {
  Scratch& s = *ThreadScratch();
  s.state.assign(ops.size(), OpState{});
  for (BlockOp& op : ops) op.status = Status::Ok();
  bool flush = false;
  size_t next = 0;
  while (next < ops.size()) {
    s.ClearSub();
    const size_t start = next;
    {
      MutexLock lock(&mu_);
      while (next < ops.size()) {
        BlockOp& op = ops[next];
        if (op.kind == BlockOp::Kind::kFlush) {  // after the rest: it covers more than it must
          s.state[next++].flush = flush = true;
          continue;
        }
        const Plan plan = PlanOp(op, next, s);
        if (plan == Plan::kPlanned) {
          ++next;
          continue;
        }
        if (!s.empty()) break;  // run what is planned first: it may be what the op waits for
        if (plan == Plan::kWait) {
          ++stats_.waits;
          changed_.Wait(&mu_);
          continue;
        }
        lock.Unlock();
        Status st = Reclaim(op.offset / kPage, (op.offset + op.length - 1) / kPage, s.need);
        lock.Lock();
        if (!st.ok()) ops[next++].status = st;
      }
    }
    if (!s.backend.empty()) {
      // Requests the cache served whole are answered now, not after the backend ops of the
      // others (a large write passing through, a read of uncached pages): the client can send
      // its next requests meanwhile.
      bool early = false;
      for (size_t i = start; i < next && listener != nullptr; ++i) {
        OpState& st = s.state[i];
        if (st.flush || st.reported || st.backend_ops > 0) continue;
        if (ops[i].fua && st.cache_work && ops[i].status.ok()) continue;  // goes back first
        st.reported = early = true;
        listener->OpDone(i);
      }
      if (early) listener->Progress();
      s.backend_done.assign(s.backend.size(), 0);
      Translator t(ops, s, listener);
      inner_->ExecuteBatch(s.backend, &t);
      for (size_t bi = 0; bi < s.backend.size(); ++bi) t.OpDone(bi);  // those not reported
    }
    if (!s.overlays.empty()) {
      MutexLock lock(&mu_);
      FinishSubBatch(ops, s);
    }
    for (size_t i = start; i < next; ++i) {
      OpState& st = s.state[i];
      if (st.flush || st.reported) continue;
      if (ops[i].fua && st.cache_work && ops[i].status.ok()) {
        ops[i].status = WriteBackRange(ops[i].offset, ops[i].length);
      }
      if (listener != nullptr) {
        st.reported = true;
        listener->OpDone(i);
      }
    }
  }
  if (flush) {
    const Status st = Flush();
    for (size_t i = 0; i < ops.size(); ++i) {
      if (s.state[i].flush) ops[i].status = st;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Write-back

// Partly written pages whose other sectors one write-back reads from the backend at a time: the
// size of each thread's merge buffer (256 KiB). A whole write-back batch (writeback_batch, 64 by
// default) in one backend batch: one round to the daemons, not one per 16 pages (the stripe
// layout's ReadSpans takes as many, spanstore::kMaxReadRound).
constexpr size_t kMergePages = 64;

Status WriteCache::WriteBackSlots(std::span<const int32_t> slots, bool fua, bool to_lru_tail) {
  if (slots.empty()) return Status::Ok();
  // The caller's scratch holds `slots`; these are this function's own (capacity kept).
  thread_local std::vector<BlockOp> ops;
  thread_local std::vector<Status> result;
  thread_local std::vector<uint8_t> merge_buf;
  thread_local std::vector<size_t> merging;  // indexes into `slots`
  thread_local std::vector<uint64_t> page_of;
  thread_local std::vector<size_t> writing;  // indexes into `slots`
  if (result.capacity() < options_.pages) {
    // Once per thread: a write-back takes at most every page of the cache, so these never grow.
    ops.reserve(options_.pages);
    result.reserve(options_.pages);
    merging.reserve(options_.pages);
    page_of.reserve(options_.pages);
    writing.reserve(options_.pages);
  }
  ops.clear();
  merging.clear();
  result.assign(slots.size(), Status::Ok());
  page_of.clear();
  {
    MutexLock lock(&mu_);  // the pages' numbers and valid sectors are stable while going back
    for (size_t j = 0; j < slots.size(); ++j) {
      if (slots_[slots[j]].valid == kAllSectors) continue;
      merging.push_back(j);
      page_of.push_back(slots_[slots[j]].page);
    }
  }
  // Pages holding only some sectors: read the rest from the backend, kMergePages together (the
  // thread's merge buffer, sized once: not grown with the write-back, swap safety).
  if (!merging.empty() && merge_buf.size() < kMergePages * kPage) {
    merge_buf.resize(kMergePages * kPage);
  }
  for (size_t c0 = 0; c0 < merging.size(); c0 += kMergePages) {
    const size_t cn = std::min(kMergePages, merging.size() - c0);
    ops.clear();
    for (size_t m = 0; m < cn; ++m) {
      BlockOp b;
      b.kind = BlockOp::Kind::kRead;
      b.offset = page_of[c0 + m] * kPage;
      b.length = kPage;
      b.read_into = {merge_buf.data() + m * kPage, kPage};
      ops.push_back(b);
    }
    inner_->ExecuteBatch(ops);
    MutexLock lock(&mu_);
    stats_.fills += cn;
    for (size_t m = 0; m < cn; ++m) {
      const int32_t slot = slots[merging[c0 + m]];
      Slot& sl = slots_[slot];
      if (!ops[m].status.ok()) {
        result[merging[c0 + m]] = ops[m].status.WithContext(
            fmt::format("reading the rest of the page at {} to write it back", sl.page * kPage));
        continue;
      }
      for (uint32_t sec = 0; sec < kPage / 512; ++sec) {
        if ((sl.valid & (1u << sec)) != 0) continue;
        std::memcpy(Buf(slot) + sec * 512, merge_buf.data() + m * kPage + sec * 512, 512);
      }
      sl.valid = kAllSectors;
    }
  }
  ops.clear();
  writing.clear();
  {
    MutexLock lock(&mu_);
    for (size_t j = 0; j < slots.size(); ++j) {
      if (!result[j].ok()) continue;
      BlockOp b;
      b.kind = BlockOp::Kind::kWrite;
      b.fua = fua;
      b.offset = slots_[slots[j]].page * kPage;
      b.length = kPage;
      b.data = {Buf(slots[j]), kPage};
      ops.push_back(b);
      writing.push_back(j);
    }
  }
  if (!ops.empty()) inner_->ExecuteBatch(ops);
  for (size_t w = 0; w < writing.size(); ++w) result[writing[w]] = ops[w].status;
  Status first;
  {
    MutexLock lock(&mu_);
    const auto now = Now();
    for (size_t j = 0; j < slots.size(); ++j) {
      Slot& sl = slots_[slots[j]];
      sl.writeback = false;
      if (result[j].ok()) {
        ++stats_.writebacks;
        Unlink(dirty_, slots[j]);
        sl.dirty = false;
        sl.failed = false;
        if (to_lru_tail) {
          PushBack(clean_, slots[j]);
        } else {
          PushFront(clean_, slots[j]);
        }
        continue;
      }
      ++stats_.writeback_failures;
      sl.failed = true;
      sl.retry_at = now + options_.max_dirty_age;
      Status err = result[j].WithContext(
          fmt::format("write cache: writing back the page at {}", sl.page * kPage));
      if (first.ok()) first = err;
      if (latched_error_.ok()) latched_error_ = err;
      ++latched_failures_;
    }
  }
  changed_.SignalAll();
  if (!first.ok()) {
    spdlog::warn("{} (the page stays cached and dirty; it is retried, and the next flush fails)",
                 first.ToString());
  }
  return first;
}

Status WriteCache::Reclaim(uint64_t lo, uint64_t hi, size_t need) {
  Scratch& s = *ThreadScratch();
  s.wb.clear();
  {
    MutexLock lock(&mu_);
    // Enough pages free or clean now (someone freed some meanwhile)?
    size_t have = free_.size();
    for (int32_t i = clean_.tail; i != kNone && have < need; i = slots_[i].prev) {
      if ((slots_[i].page < lo || slots_[i].page > hi) && slots_[i].pins == 0) ++have;
    }
    if (have >= need) return Status::Ok();
    bool in_flight = false;
    for (int32_t i = dirty_.tail; i != kNone && s.wb.size() < options_.writeback_batch;
         i = slots_[i].prev) {
      Slot& sl = slots_[i];
      in_flight = in_flight || sl.writeback;
      if (sl.writeback || sl.failed) continue;
      sl.writeback = true;
      s.wb.push_back(i);
    }
    if (s.wb.empty()) {
      if (in_flight || pinned_ > 0) {  // pages going back, or pinned by reads in flight
        ++stats_.waits;
        changed_.Wait(&mu_);
        return Status::Ok();
      }
      return IoError(fmt::format(
          "write cache: all {} pages hold data whose write-back failed ({}); new writes that need "
          "a page fail until the backend takes them (--write-cache-pages)",
          slots_.size(), latched_error_.ok() ? "retried" : latched_error_.ToString()));
    }
  }
  (void)WriteBackSlots(s.wb, /*fua=*/false, /*to_lru_tail=*/true);  // failures: latched
  return Status::Ok();
}

Status WriteCache::WriteBackRange(uint64_t offset, uint64_t length) {
  const uint64_t first = offset / kPage, last = (offset + length - 1) / kPage;
  std::vector<int32_t> sel;  // few pages: a FUA write's (but not from the request's scratch)
  thread_local std::vector<int32_t> reuse;
  sel.swap(reuse);
  Status result;
  for (;;) {
    sel.clear();
    bool busy = false;
    {
      MutexLock lock(&mu_);
      for (uint64_t p = first; p <= last; ++p) {
        const int32_t slot = Lookup(p);
        if (slot == kNone || !slots_[slot].dirty) continue;
        if (slots_[slot].writeback || slots_[slot].state != Slot::State::kReady) {
          busy = true;
          continue;
        }
        slots_[slot].writeback = true;
        sel.push_back(slot);
      }
      if (sel.empty()) {
        if (!busy) break;
        ++stats_.waits;
        changed_.Wait(&mu_);
        continue;
      }
      TopUpLocked(sel);  // a held single page goes back in a full group with other dirty pages
    }
    if (Status st = WriteBackSlots(sel, /*fua=*/true, /*to_lru_tail=*/false); !st.ok()) {
      result = st;
      break;
    }
  }
  sel.swap(reuse);
  return result;
}

Status WriteCache::Flush() {
  thread_local std::vector<int32_t> sel;  // capacity kept: a flush does not allocate
  Status failed;
  uint64_t failed_pages = 0;
  {
    MutexLock lock(&mu_);
    const uint64_t snapshot = dirty_seq_;
    const uint64_t epoch = ++flush_epoch_;
    for (;;) {
      sel.clear();
      bool busy = false;
      for (int32_t i = dirty_.tail; i != kNone; i = slots_[i].prev) {
        Slot& sl = slots_[i];
        if (sl.dirty_seq > snapshot || sl.flush_epoch == epoch) continue;
        if (sl.writeback) {
          busy = true;
          continue;
        }
        if (sel.size() >= options_.writeback_batch) continue;
        sl.writeback = true;
        sl.flush_epoch = epoch;
        sel.push_back(i);
      }
      if (sel.empty()) {
        if (!busy) break;
        ++stats_.waits;
        changed_.Wait(&mu_);
        continue;
      }
      TopUpLocked(sel);
      lock.Unlock();
      (void)WriteBackSlots(sel, /*fua=*/false, /*to_lru_tail=*/false);
      lock.Lock();
    }
    for (int32_t i = dirty_.head; i != kNone; i = slots_[i].next) {
      if (slots_[i].dirty_seq <= snapshot) ++failed_pages;
    }
    if (!latched_error_.ok()) {
      failed = IoError(fmt::format(
          "write cache: {} page write-backs failed since the last flush (first: {}); {} pages "
          "written before this flush are still not in the backend (kept, and retried)",
          latched_failures_, latched_error_.ToString(), failed_pages));
      latched_error_ = Status::Ok();
      latched_failures_ = 0;
    }
  }
  Status inner = inner_->Flush();
  if (!failed.ok()) return failed;
  return inner;
}

Status WriteCache::WriteBackExpired() {
  thread_local std::vector<int32_t> sel;  // capacity kept: the flusher's pass does not allocate
  Status first;
  for (;;) {
    sel.clear();
    {
      MutexLock lock(&mu_);
      const auto now = Now();
      for (int32_t i = dirty_.tail; i != kNone && sel.size() < options_.writeback_batch;
           i = slots_[i].prev) {
        Slot& sl = slots_[i];
        if (sl.writeback || now < sl.dirty_since + options_.max_dirty_age || now < sl.retry_at) {
          continue;
        }
        sl.writeback = true;
        sel.push_back(i);
      }
      stats_.expired += sel.size();
      if (!sel.empty()) TopUpLocked(sel);
    }
    if (sel.empty()) return first;
    if (Status st = WriteBackSlots(sel, /*fua=*/false, /*to_lru_tail=*/false);
        !st.ok() && first.ok()) {
      first = st;
    }
  }
}

Status WriteCache::WriteBackAhead() {
  std::vector<int32_t> sel;
  Status first;
  for (;;) {
    sel.clear();
    {
      MutexLock lock(&mu_);
      SelectAheadLocked(sel);
    }
    if (sel.empty()) return first;
    if (Status st = WriteBackSlots(sel, /*fua=*/false, /*to_lru_tail=*/true);
        !st.ok() && first.ok()) {
      first = st;
    }
  }
}

void WriteCache::SelectAheadLocked(std::vector<int32_t>& sel) {
  if (dirty_.size < ahead_dirty_pages_) return;
  TakeLruDirtyLocked(sel, options_.writeback_batch);
  if (!sel.empty()) TopUpLocked(sel);
}

void WriteCache::TopUpLocked(std::vector<int32_t>& sel) {
  const size_t m = options_.writeback_multiple;
  TakeLruDirtyLocked(sel, (sel.size() + m - 1) / m * m);
}

void WriteCache::TakeLruDirtyLocked(std::vector<int32_t>& sel, size_t until) {
  for (int32_t i = dirty_.tail; i != kNone && sel.size() < until; i = slots_[i].prev) {
    Slot& sl = slots_[i];
    if (sl.writeback || sl.failed) continue;
    sl.writeback = true;
    sel.push_back(i);
  }
}

void WriteCache::FlusherLoop() {
  std::vector<int32_t> ahead;
  for (;;) {
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
      if (dirty_.size == 0) {
        flusher_cv_.Wait(&mu_);
        continue;
      }
      ahead.clear();
      SelectAheadLocked(ahead);
      if (!ahead.empty()) {  // ahead of need: the requests keep finding pages meanwhile
        lock.Unlock();
        (void)WriteBackSlots(ahead, /*fua=*/false, /*to_lru_tail=*/true);  // failures: latched
        continue;
      }
      // The earliest moment a dirty page is due (this thread runs on the real clock).
      SteadyClock::time_point due = SteadyClock::time_point::max();
      for (int32_t i = dirty_.head; i != kNone; i = slots_[i].next) {
        const Slot& sl = slots_[i];
        if (!sl.writeback)
          due = std::min(due, std::max(sl.dirty_since + options_.max_dirty_age, sl.retry_at));
      }
      if (due == SteadyClock::time_point::max()) due = Now() + options_.max_dirty_age;
      if (Now() < due) {
        flusher_cv_.WaitUntil(&mu_, due);
        continue;
      }
    }
    (void)WriteBackExpired();  // failures are latched for the next Flush
  }
}

}  // namespace farmem::blockdev
