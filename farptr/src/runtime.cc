// Runtime setup: options, size classes, connecting, background threads, statistics.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>

#include "heap.h"

namespace farmem {

// ---------------------------------------------------------------------------------------------
// SpanResilience

Result<SpanResilience> SpanResilience::Parse(std::string_view text) {
  FARMEM_ASSIGN_OR_RETURN(client::Resilience parsed, client::Resilience::Parse(text, kMaxWidth));
  return SpanResilience(parsed);
}

// ---------------------------------------------------------------------------------------------
// Runtime

namespace {
Mutex g_default_mu;
Runtime* g_default GUARDED_BY(g_default_mu) = nullptr;
}  // namespace

Runtime::Runtime(RuntimeOptions options)
    : heap_(std::make_unique<farptr_internal::Heap>(this, std::move(options))) {}

Result<std::unique_ptr<Runtime>> Runtime::Create(RuntimeOptions options) {
  const bool make_default = options.make_default;
  std::unique_ptr<Runtime> rt(new Runtime(std::move(options)));
  FARMEM_RETURN_IF_ERROR(rt->heap_->Start());
  if (make_default) {
    MutexLock lock(&g_default_mu);
    g_default = rt.get();
  }
  return rt;
}

Runtime* Runtime::Default() {
  MutexLock lock(&g_default_mu);
  return g_default;
}

Runtime::~Runtime() {
  {
    MutexLock lock(&g_default_mu);
    if (g_default == this) g_default = nullptr;
  }
  heap_->Stop();
}

const RuntimeOptions& Runtime::options() const { return heap_->options(); }
const SpanResilience& Runtime::resilience() const { return heap_->resilience(); }
RuntimeStats Runtime::stats() const { return heap_->stats(); }
client::Cluster& Runtime::cluster() { return heap_->cluster(); }
std::vector<std::vector<Endpoint>> Runtime::span_set_layout() const { return heap_->GroupLayout(); }
Status Runtime::EvictUntil(uint64_t target_bytes) { return heap_->EvictUntil(target_bytes); }
Status Runtime::Compact() { return heap_->Compact(); }
Status Runtime::WaitForRecovery(std::chrono::milliseconds timeout) {
  if (heap_->WaitForRecovery(timeout)) return Status::Ok();
  return DeadlineExceeded(
      fmt::format("span-set members still wait for re-protection or a move off a daemon that asked "
                  "its memory back after {} ms",
                  timeout.count()));
}

namespace farptr_internal {

// ---------------------------------------------------------------------------------------------
// Heap setup

Heap::Heap(Runtime* rt, RuntimeOptions options) : rt_(rt), options_(std::move(options)) {}

Status Heap::Start() {
  FARMEM_ASSIGN_OR_RETURN(res_, SpanResilience::Parse(options_.resilience));
  span_size_ = options_.span_size;
  if (span_size_ < 4096 || span_size_ > (1u << 20) || !std::has_single_bit(span_size_)) {
    return InvalidArgument(
        fmt::format("span_size {} must be a power of two from 4 KiB to 1 MiB", span_size_));
  }
  if (!(options_.low_watermark > 0 && options_.low_watermark < options_.high_watermark &&
        options_.high_watermark <= 1.0)) {
    const RuntimeOptions defaults;
    return InvalidArgument(fmt::format(
        "watermarks must satisfy 0 < low ({}) < high ({}) <= 1: set both "
        "(RuntimeOptions::low_watermark and high_watermark; the defaults are {} and {})",
        options_.low_watermark, options_.high_watermark, defaults.low_watermark,
        defaults.high_watermark));
  }
  base_frames_ = static_cast<size_t>(options_.local_budget / span_size_);
  if (base_frames_ < 4) {
    return InvalidArgument(fmt::format("local budget {} holds fewer than 4 spans of {}",
                                       FormatSize(options_.local_budget), FormatSize(span_size_)));
  }
  // Frames kept resident while free (heap.h, frames_mu_): at most 256 KiB, for the frames a miss
  // borrows and gives back at once and the refill after an eviction burst.
  warm_limit_ = std::clamp<size_t>((256u << 10) / span_size_, 1, 64);
  UpdateFrameLimits();

  // Size classes: multiples of 16 up to 256, then about 12.5% apart (rounded to 16), then the
  // largest slot sizes that still fit 8, 7, ..., 1 objects in a span. With encryption the
  // 16-byte steps go on to 272, so that a 256-byte object has room for its GCM tag in its slot
  // (span_crypto.h; Heap::ClassForObject) without taking a 288-byte one. (Shifting every larger
  // class by 16 bytes as well made kv_bench's buckets take 5% more slot bytes.)
  const uint32_t tag = options_.encrypt ? static_cast<uint32_t>(aead::kTagBytes) : 0;
  std::vector<uint32_t> sizes;
  for (uint32_t s = 16; s <= 256 + tag; s += 16) sizes.push_back(s);
  for (uint32_t s = 256; s < span_size_ / 8;) {
    s = (s + s / 8 + 15) & ~15u;
    if (s <= span_size_ / 8 && s > sizes.back()) sizes.push_back(s);
  }
  for (uint32_t n = 8; n >= 1; --n) {
    const uint32_t s = (span_size_ / n) & ~15u;
    if (s > sizes.back()) sizes.push_back(s);
  }
  for (uint32_t s : sizes) {
    auto c = std::make_unique<SizeClass>();
    c->index = static_cast<uint32_t>(classes_.size());
    c->size = s;
    c->slots = span_size_ / s;
    classes_.push_back(std::move(c));
  }
  class_of_.assign(span_size_ / 16 + 1, 0);
  size_t ci = 0;
  for (size_t q = 0; q < class_of_.size(); ++q) {
    while (classes_[ci]->size < q * 16) ++ci;
    class_of_[q] = static_cast<uint16_t>(ci);
  }

  if (options_.encrypt) {
    aead::Key key{};
    if (!options_.data_key_file.empty()) {
      bool created = false;
      FARMEM_ASSIGN_OR_RETURN(key, aead::LoadOrCreateDataKeyFile(options_.data_key_file, &created));
      if (created) spdlog::info("far memory: new data key in {}", options_.data_key_file);
    } else if (options_.data_key) {
      key = *options_.data_key;
      // Only the derived key is kept: options() no longer shows the data key.
      options_.data_key->fill(0);
      options_.data_key.reset();
    } else {
      FARMEM_ASSIGN_OR_RETURN(key, aead::GenerateKey());
    }
    Result<std::unique_ptr<SpanCrypto>> crypto = SpanCrypto::Create(key);
    std::fill(key.begin(), key.end(), uint8_t{0});
    if (!crypto) return crypto.error().WithContext("far memory encryption");
    crypto_ = std::move(*crypto);
    spdlog::info("far memory: {}", aead::DescribeChosenImpl());
  } else {
    spdlog::warn(
        "far memory: encryption is OFF (RuntimeOptions::encrypt = false): objects sit in "
        "plaintext in the lenders' memory, readable by their root, and corruption there is not "
        "detected. Use this for benchmarks only");
  }

  client::ClusterOptions co;
  co.peers = options_.peers;
  co.peers_dns = options_.peers_dns;
  co.secret = options_.secret;
  co.identity = options_.identity;
  co.client_name = fmt::format("farptr-{}", ::getpid());
  co.heartbeat_interval = options_.heartbeat_interval;
  co.failure_timeout = options_.failure_timeout;
  co.op_timeout = options_.op_timeout;
  co.fault_injector = options_.fault_injector;
  co.data_transport = options_.data_transport;
  FARMEM_ASSIGN_OR_RETURN(cluster_, client::Cluster::Connect(std::move(co)));
  FARMEM_ASSIGN_OR_RETURN(store_,
                          RemoteStore::Create(cluster_.get(), res_, span_size_, options_.op_timeout,
                                              options_.reconcile_interval, options_.lease_ahead));
  evictor_ = std::thread([this] { EvictorLoop(); });
  for (int i = 0; i < options_.prefetch_threads; ++i) {
    prefetchers_.emplace_back([this] { PrefetchLoop(); });
  }
  spdlog::info(
      "far memory: {} local budget, spans of {}, {} size classes, resilience {}, encryption {}",
      FormatSize(options_.local_budget), FormatSize(span_size_), classes_.size(), res_.ToString(),
      crypto_ ? "on (AES-256-GCM per object)" : "OFF");
  return Status::Ok();
}

void Heap::Stop() {
  {
    MutexLock lock(&evict_mu_);
    if (stopping_ && !evictor_.joinable()) return;
    stopping_ = true;
  }
  evict_cv_.SignalAll();
  {
    MutexLock lock(&prefetch_mu_);
    prefetch_queue_.clear();
  }
  prefetch_cv_.SignalAll();
  if (evictor_.joinable()) evictor_.join();
  for (auto& t : prefetchers_) t.join();
  prefetchers_.clear();
  if (store_) store_->Shutdown();
  if (cluster_) (void)cluster_->Close();
  SetOverBudget(this, over_budget_, false);
  std::vector<Span*> all;
  {
    MutexLock lock(&spans_mu_);
    for (auto& s : spans_) all.push_back(s.get());
  }
  for (Span* s : all) {
    MutexLock sl(&s->mu);
    s->frame = nullptr;  // its chunk is unmapped below
  }
  MutexLock flock(&frames_mu_);
  warm_frames_.clear();
  cold_frames_.clear();
  for (auto [p, len] : frame_chunks_) ::munmap(p, len);
  frame_chunks_.clear();
}

Heap::~Heap() { Stop(); }

uint64_t Heap::MetadataBytes() const {
  return entry_bytes_.load(std::memory_order_relaxed) + (crypto_ ? crypto_->SideTagBytes() : 0) +
         span_structs_.load(std::memory_order_relaxed) * sizeof(Span) +
         slot_table_bytes_.load(std::memory_order_relaxed) +
         static_cast<uint64_t>(warm_limit_) * span_size_;
}

void Heap::UpdateFrameLimits() {
  size_t frames = base_frames_;
  if (options_.budget_includes_metadata) {
    const uint64_t meta = MetadataBytes();
    const uint64_t left = options_.local_budget > meta ? options_.local_budget - meta : 0;
    frames = std::max<size_t>(4, left / span_size_);
    if (left / span_size_ < 4 && !metadata_warned_.exchange(true)) {
      spdlog::warn(
          "far memory: metadata ({} for {} objects) leaves less than 4 spans of the {} local "
          "budget for object data; running with 4 (raise local_budget)",
          FormatSize(meta), objects_.load(), FormatSize(options_.local_budget));
    }
  }
  if (frames == budget_frames_.load(std::memory_order_relaxed)) return;
  budget_frames_.store(frames, std::memory_order_relaxed);
  high_frames_.store(std::max<size_t>(2, static_cast<size_t>(frames * options_.high_watermark)),
                     std::memory_order_relaxed);
  low_frames_.store(std::max<size_t>(1, static_cast<size_t>(frames * options_.low_watermark)),
                    std::memory_order_relaxed);
  const size_t high = high_frames_.load(std::memory_order_relaxed);
  prefetch_frames_.store(high + (std::max(frames, high) - high) / 2, std::memory_order_relaxed);
}

RuntimeStats Heap::stats() const {
  RuntimeStats s;
  s.objects = objects_.load();
  s.object_bytes = object_bytes_.load();
  s.remote_object_bytes = remote_object_bytes_.load();
  s.copy_object_bytes = copy_object_bytes_.load();
  s.clean_evictions = clean_evictions_.load();
  s.copies_dropped = copies_dropped_.load();
  s.local_budget = options_.local_budget;
  s.local_bytes = frames_in_use_.load() * static_cast<uint64_t>(span_size_);
  {
    MutexLock lock(&frames_mu_);
    s.frame_cache_bytes = warm_frames_.size() * static_cast<uint64_t>(span_size_);
  }
  s.entry_bytes = entry_bytes_.load() + (crypto_ ? crypto_->SideTagBytes() : 0);
  s.span_meta_bytes = span_structs_.load() * sizeof(Span) + slot_table_bytes_.load();
  s.frame_budget_bytes = budget_frames_.load() * static_cast<uint64_t>(span_size_);
  s.resident_spans = resident_spans_.load();
  s.remote_spans = remote_spans_.load();
  const RemoteStoreStats rs = store_->stats();
  s.span_sets = rs.sets;
  s.remote_set_bytes = rs.set_bytes;
  s.remote_leased_bytes = rs.leased_bytes;
  s.degraded_reads = rs.degraded_reads;
  s.members_reprotected = rs.members_reprotected;
  s.degraded_span_sets = rs.degraded_sets;
  s.unrecoverable_span_sets = rs.unrecoverable_sets;
  s.degraded_sets_written = rs.degraded_sets_written;
  s.reprotect_last_ms = rs.reprotect_last_ms;
  s.reprotect_max_ms = rs.reprotect_max_ms;
  s.members_failed = rs.members_failed;
  s.members_moved = rs.members_moved;
  s.move_last_ms = rs.move_last_ms;
  s.move_max_ms = rs.move_max_ms;
  s.move_min_slack_ms = rs.move_min_slack_ms;
  s.moves_pending = rs.moves_pending;
  s.swap_ins = swap_ins_.load();
  s.prefetches = prefetches_.load();
  s.spans_evicted = spans_evicted_.load();
  s.sets_written = sets_written_.load();
  s.eviction_cancels = eviction_cancels_.load();
  s.objects_relocated = objects_relocated_.load();
  s.objects_gathered = objects_gathered_.load();
  s.spans_lost = spans_lost_.load();
  s.compactions = compactions_.load();
  s.compaction_spans_in = compaction_spans_in_.load();
  s.compaction_spans_out = compaction_spans_out_.load();
  s.compaction_client_bytes = compaction_client_bytes_.load();
  s.compaction_client_bytes_sent = compaction_bytes_sent_.load();
  s.compaction_client_bytes_received = compaction_bytes_received_.load();
  s.compaction_cpu_ns = compaction_cpu_ns_.load();
  s.compaction_offloaded_sets = compaction_offloaded_sets_.load();
  s.compaction_offload_fallbacks = compaction_offload_fallbacks_.load();
  s.compaction_corrupt_cells = compaction_corrupt_cells_.load();
  s.auth_failures = auth_failures_.load();
  s.auth_failed_objects = auth_failed_objects_.load();
  s.auth_lost_objects = auth_lost_objects_.load();
  s.bytes_read = bytes_read_.load();
  s.bytes_written = bytes_written_.load();
  return s;
}

}  // namespace farptr_internal
}  // namespace farmem
