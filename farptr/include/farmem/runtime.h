// Runtime: one program's far-memory heap. It owns the local memory budget, the spans objects live
// in, the evictor that moves cold spans out to farmem daemons as erasure-coded span sets
// (Carbink), the remote store those span sets live in, and the compactor that keeps remote usage
// close to the live data.
//
//   farmem::RuntimeOptions opts;
//   opts.peers = {...};  opts.secret = "...";
//   opts.local_budget = 64 << 20;  opts.resilience = "ec:4+2";
//   auto rt = farmem::Runtime::Create(opts);           // Result<std::unique_ptr<Runtime>>
//   farmem::far_ptr<Point> p = farmem::make_far<Point>(1, 2);   // see far_ptr.h
//
// Ownership: a Runtime owns a client::Cluster (its leases and connections), every span (local
// frames and remote span sets) and three background threads (evictor, prefetcher, recovery).
// Every far_ptr made from a Runtime must be destroyed before the Runtime.
//
// Threads: every method may be called from any thread. far_ptrs of one Runtime may be used by
// many threads at once (each object by one writer at a time, as with plain memory; see
// docs/farptr.md for the exact rules).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/client/resilience.h"
#include "farmem/common/aead.h"
#include "farmem/common/config.h"
#include "farmem/common/status.h"

namespace farmem::transport {
class FaultInjector;
class Transport;
}  // namespace farmem::transport

namespace farmem {

namespace client {
class Cluster;
}
namespace farptr_internal {
class Heap;
}

// How swapped-out spans are protected: client::Resilience, the one parser and meaning of none /
// replicate:N / ec:k+r shared with the page store (k = 1, r = N - 1 for replicate), plus one rule
// of far_ptr's own: a span set is spread over at most kMaxWidth daemons (k + r <= 16; its members
// are kept in fixed arrays on the request path).
struct SpanResilience : client::Resilience {
  static constexpr int kMaxWidth = 16;

  SpanResilience() = default;
  SpanResilience(const client::Resilience& r) : client::Resilience(r) {}  // NOLINT: same value
  // client::Resilience::Parse with k + r <= kMaxWidth.
  static Result<SpanResilience> Parse(std::string_view text);
  int width() const { return group_size(); }  // daemons one span set is spread over
};

struct RuntimeOptions {
  // The daemons (client::ClusterOptions has the details).
  std::vector<Endpoint> peers;
  std::string peers_dns;
  // The key to authenticate with: the cluster secret (identity empty), or the key of `identity`
  // (auth::LoadClientKeyFile of a `farmemctl key issue` file; auth::LoadClientCredentials).
  std::string secret;
  std::string identity;
  // Local memory for object data. Objects beyond it live remote. Metadata (32 bytes per object,
  // ~0.3-0.8 KiB per span, up to 256 KiB of free frames kept for reuse) is not counted unless
  // budget_includes_metadata is set (docs/farptr.md, "Sizing the local budget").
  uint64_t local_budget = 256ull << 20;
  // Count the metadata above against local_budget too: object data then gets what it leaves
  // (at least 4 spans), so the process holds about local_budget plus its fixed overhead
  // (binary, libraries, threads, connections) however many objects it has.
  bool budget_includes_metadata = false;
  std::string resilience = "ec:4+2";
  // Bytes per span: a power of two from 4 KiB to 1 MiB, at most the daemons' slab size. The
  // largest object is one span.
  uint32_t span_size = 64u << 10;
  // The evictor starts when resident spans pass high_watermark * budget and stops at
  // low_watermark * budget; the prefetcher reads ahead up to halfway from the high watermark to
  // the budget. Threads entering an outermost DerefScope wait while the budget is exceeded (see
  // docs/farptr.md, "sizing the budget"). A narrow band keeps more of the budget in use: more
  // hot objects stay local (docs/benchmarks-farptr.md).
  double high_watermark = 0.93;
  double low_watermark = 0.88;
  // Background compaction starts when remote bytes leased exceed
  // (k + r) / k * remote live bytes * compact_trigger.
  bool auto_compact = true;
  double compact_trigger = 1.15;
  // Compaction offload: the daemons build the new span sets themselves — each data cell from
  // pieces of the old cells (farmemd's GATHER_CELL), each parity cell from the new data cells
  // (PARITY_ENCODE) — so no span crosses this process, only requests of a few KiB per set. If
  // that fails (a degraded source, daemons that predate it), the pass moves the bytes through
  // this process and still lets the daemons compute parity; failing that too, parity is computed
  // here. The daemons must reach each other at the addresses in `peers`. See docs/farptr.md.
  bool parity_offload = true;
  // Encryption and authentication of every object before it leaves this process (AES-256-GCM,
  // each object sealed on its own; docs/farptr.md, "Encryption", and docs/security.md).
  // The daemons only ever hold ciphertext; an object whose tag fails is read from the other
  // members of its span set, or is DataLoss — never wrong bytes. Off (for benchmarks) logs a
  // warning.
  bool encrypt = true;
  // The data key. With data_key_file set, the key in that file (aead::LoadOrCreateDataKeyFile:
  // created, mode 600, if it does not exist); else data_key if set; else a fresh random key. It
  // never leaves this process: each runtime derives its own key from it.
  std::optional<aead::Key> data_key;
  std::string data_key_file;
  // A miss on a small object (at least 8 per span) copies that object into its size class's hot
  // span, so the objects a program keeps coming back to end up together in spans that stay
  // local, and the span the miss read, left with nothing dereferenced, leaves at the next sweep
  // at no cost (its clean copy; docs/farptr.md, "Hot objects"). Off: the object stays in the
  // span read, as does the rest of that span (only the evictor's sweep separates hot objects).
  bool gather_on_miss = true;
  // Background prefetch threads (far_vector's sequential prefetch). 0 disables prefetching.
  int prefetch_threads = 1;
  // Failure detection and control calls (client::ClusterOptions).
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds failure_timeout{2000};
  std::chrono::milliseconds op_timeout{5000};
  // Span sets missing a member are re-protected as soon as the cluster reports a daemon up (or
  // one restarted); this is how often the remote store also looks on its own, for what events do
  // not announce (a daemon that freed memory, a missed event).
  std::chrono::milliseconds reconcile_interval{1000};
  // The next slab group is leased in the background when the current ones are half full
  // (spanstore::RemoteStore::Create), so an eviction rarely waits for k + r ALLOCs.
  bool lease_ahead = true;
  // Make this runtime the one make_far<T>(args...) without a runtime uses.
  bool make_default = true;
  // For tests of failure interleavings: faults injected into every data channel
  // (farmem/transport/fault_injection.h, client::ClusterOptions::fault_injector). Null: none.
  std::shared_ptr<transport::FaultInjector> fault_injector;
  // For tests on the fake in-process fabric (tests/support/fake_fabric.h): the transport of the
  // data channels (client::ClusterOptions::data_transport). Null: the cluster's own.
  std::shared_ptr<transport::Transport> data_transport;
};

struct RuntimeStats {
  // Objects.
  uint64_t objects = 0;              // live objects
  uint64_t object_bytes = 0;         // their size-class bytes
  uint64_t remote_object_bytes = 0;  // ... of those with their bytes in a remote span set
  uint64_t copy_object_bytes = 0;    // ... of those also local (clean spans keep their copy)
  // Local memory.
  uint64_t local_budget = 0;
  uint64_t local_bytes = 0;  // resident span frames (what local_budget bounds)
  // Local memory outside the budget (docs/farptr.md, "Sizing the local budget"):
  uint64_t frame_cache_bytes = 0;   // free frames kept resident for reuse (at most 256 KiB)
  uint64_t entry_bytes = 0;         // object entries (32 B each, allocated 4096 at a time)
  uint64_t span_meta_bytes = 0;     // span structs and their per-slot tables
  uint64_t frame_budget_bytes = 0;  // what the budget leaves for frames (budget_includes_metadata)
  uint64_t resident_spans = 0;
  uint64_t remote_spans = 0;
  // Remote memory.
  uint64_t span_sets = 0;
  uint64_t remote_set_bytes = 0;     // rows in use: span sets * (k + r) * span_size
  uint64_t remote_leased_bytes = 0;  // slabs held from daemons
  // Traffic and events since start.
  uint64_t swap_ins = 0;        // spans read back on a miss or prefetch
  uint64_t prefetches = 0;      // ... of those by the prefetcher
  uint64_t degraded_reads = 0;  // swap-ins that needed a decode / another replica
  uint64_t spans_evicted = 0;
  uint64_t clean_evictions = 0;  // ... of those that were clean: no write, the copy was kept
  uint64_t copies_dropped = 0;   // clean copies turned into holes (first write, compaction)
  uint64_t sets_written = 0;
  uint64_t eviction_cancels = 0;   // spans a deref pulled back while being evicted
  uint64_t objects_relocated = 0;  // hot objects moved out of cold spans
  uint64_t objects_gathered = 0;   // objects moved into a hot span by their own miss
  uint64_t members_reprotected = 0;
  // Re-protection (docs/farptr.md, "Resilience and failures").
  uint64_t degraded_span_sets = 0;       // now: sets with a member missing that can be rebuilt
  uint64_t unrecoverable_span_sets = 0;  // now: sets that lost more members than they survive
  uint64_t degraded_sets_written = 0;    // sets written while fewer than k + r daemons could take
                                         // them (members missing from the start)
  uint64_t reprotect_last_ms = 0;        // the last member re-protected: time from its loss (or its
                                         // set being written without it) until it was rebuilt
  uint64_t reprotect_max_ms = 0;         // ... the longest such time
  uint64_t members_failed = 0;           // span-set members given up as failed (their daemon
                                         // died, restarted, or a notice could not be met): each
                                         // starts a degraded episode (or a loss, without
                                         // redundancy)
  // Eviction notices (docs/farptr.md, "Eviction notices and drains").
  uint64_t members_moved = 0;      // members a daemon asked back, copied elsewhere in time
  uint64_t move_last_ms = 0;       // the last one: from the notice until the old slab was freed
  uint64_t move_max_ms = 0;        // ... the longest such time
  uint64_t move_min_slack_ms = 0;  // the least time that was left before a notice's deadline
  uint64_t moves_pending = 0;      // now: noticed members not moved yet
  uint64_t spans_lost = 0;
  uint64_t compactions = 0;
  uint64_t compaction_spans_in = 0;
  uint64_t compaction_spans_out = 0;
  uint64_t compaction_client_bytes = 0;       // bytes the client moved (read + written) compacting
  uint64_t compaction_client_bytes_sent = 0;  // ... of those sent (writes, requests)
  uint64_t compaction_client_bytes_received = 0;  // ... of those received (reads, replies)
  uint64_t compaction_cpu_ns = 0;                 // CPU time of the threads that compacted
  uint64_t compaction_offloaded_sets = 0;         // sets whose parity the daemons computed
                                                  // (and, unless after a fallback, data)
  uint64_t compaction_offload_fallbacks = 0;      // offload errors that sent the work back to
                                                  // this process (a pass, or a set's parity)
  // Encryption (docs/farptr.md, "Encryption").
  uint64_t auth_failures = 0;        // cells read back whose tags did not all verify (each then
                                     // read from the other members, or its objects lost)
  uint64_t auth_failed_objects = 0;  // objects whose tag failed on such a read (before any retry)
  uint64_t auth_lost_objects = 0;    // ... of those that could not be produced: DataLoss
  uint64_t compaction_corrupt_cells = 0;  // cells compaction was to move that failed their
                                          // checksum (CRC-32C): repaired first (compactor.cc)
  uint64_t bytes_read = 0;                // all remote reads
  uint64_t bytes_written = 0;             // all remote writes
};

class Runtime {
 public:
  // Connects to the daemons and starts the background threads. Fails if no daemon answers, if
  // the resilience needs more daemons than there are, or on a bad option (InvalidArgument).
  static Result<std::unique_ptr<Runtime>> Create(RuntimeOptions options);
  // The runtime make_far<T>(args...) uses: the last one created with make_default (null if
  // none is alive).
  static Runtime* Default();

  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const RuntimeOptions& options() const;
  const SpanResilience& resilience() const;
  RuntimeStats stats() const;
  // Where span sets live: each slab group's daemons in member order (k data members first,
  // then parity or copies). For tools and tests.
  std::vector<std::vector<Endpoint>> span_set_layout() const;
  client::Cluster& cluster();

  // Moves spans out until local usage is at most `target_bytes` (0: everything that is not
  // pinned by a live scope). For benchmarks and tests; the evictor does this on its own.
  Status EvictUntil(uint64_t target_bytes);
  // One compaction pass now (the background one runs when auto_compact is set).
  Status Compact();
  // Waits until no failed span-set member is waiting to be re-protected and no member a daemon
  // asked back (eviction notice) is waiting to be moved. DeadlineExceeded if some still are
  // after `timeout` (e.g. no daemon outside their group has room).
  Status WaitForRecovery(std::chrono::milliseconds timeout = std::chrono::seconds(30));

  farptr_internal::Heap* heap() const { return heap_.get(); }

 private:
  explicit Runtime(RuntimeOptions options);
  std::unique_ptr<farptr_internal::Heap> heap_;
};

}  // namespace farmem
