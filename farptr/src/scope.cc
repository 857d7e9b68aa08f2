// DerefScope bookkeeping: which threads are inside a scope, grace periods for the evictor, and
// the budget gate.
//
// Why this is safe (the store-buffering pattern, all seq_cst):
//   mutator: state := active (seq_cst store)   ...   w := entry.word (seq_cst load)
//   evictor: entry.word |= kEvacuating (seq_cst RMW)   ...   reads every thread's state
// In the single total order either the mutator's load sees kEvacuating (it takes the slow path
// and cancels the eviction under the span lock) or the evictor sees the mutator active and waits
// until its state changes (the scope ended). So an address handed out inside a scope is never
// moved before that scope ends. The state store at scope exit is a release and the evictor's
// loads acquire, so the mutator's writes to the object happen-before the evictor copies it.
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "heap.h"

namespace farmem::farptr_internal {

thread_local int tls_scope_depth = 0;

namespace {

struct ThreadRecord {
  // (sequence << 1) | inside-a-scope. The sequence grows at every outermost entry.
  std::atomic<uint64_t> state{0};
  std::atomic<bool> exited{false};
};

struct Registry {
  Mutex mu;
  std::vector<std::shared_ptr<ThreadRecord>> threads GUARDED_BY(mu);
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: threads may exit after main
  return *r;
}

struct ThreadSlot {
  std::shared_ptr<ThreadRecord> rec;
  ~ThreadSlot() {
    if (rec) rec->exited.store(true, std::memory_order_release);
  }
  ThreadRecord* get() {
    if (!rec) {
      rec = std::make_shared<ThreadRecord>();
      Registry& r = registry();
      MutexLock lock(&r.mu);
      std::erase_if(r.threads, [](const std::shared_ptr<ThreadRecord>& t) {
        return t->exited.load(std::memory_order_acquire);
      });
      r.threads.push_back(rec);
    }
    return rec.get();
  }
};
thread_local ThreadSlot tls_slot;

// The budget gate.
std::atomic<int> g_heaps_over_budget{0};
Mutex g_gate_mu;
CondVar g_gate_cv;
std::vector<Heap*> g_over_budget GUARDED_BY(g_gate_mu);
constexpr auto kMaxGateWait = std::chrono::milliseconds(1000);

void WaitAtGate() {
  // Direct reclaim first: this thread holds no scope and no lock, so it can run an eviction
  // round itself instead of waking the evictor and sleeping until it is done (two wake-ups
  // across cores, tens of µs each here). If the evictor (or another thread) is already
  // evicting, wait for it.
  std::vector<Heap*> heaps;
  {
    MutexLock lock(&g_gate_mu);
    heaps = g_over_budget;
  }
  bool reclaimed = false;
  for (Heap* h : heaps) reclaimed = h->TryReclaim() || reclaimed;
  if (reclaimed) return;
  // Nothing to give back: perhaps nothing is over any more (a flag left set by a race, see
  // Heap::RecheckOverBudget). Then the wait below returns at once instead of after kMaxGateWait.
  for (Heap* h : heaps) h->RecheckOverBudget();
  MutexLock lock(&g_gate_mu);
  g_gate_cv.WaitFor(&g_gate_mu, kMaxGateWait,
                    [] { return g_heaps_over_budget.load(std::memory_order_acquire) == 0; });
}

}  // namespace

void EnterScopeOutermost() {
  ThreadRecord* rec = tls_slot.get();
  // A thread that holds no scope holds no pins: the right place to wait for memory.
  if (g_heaps_over_budget.load(std::memory_order_relaxed) > 0) [[unlikely]] {
    WaitAtGate();
  }
  const uint64_t seq = (rec->state.load(std::memory_order_relaxed) >> 1) + 1;
  rec->state.store((seq << 1) | 1, std::memory_order_seq_cst);
}

void ExitScopeOutermost() {
  ThreadRecord* rec = tls_slot.get();
  const uint64_t s = rec->state.load(std::memory_order_relaxed);
  rec->state.store(s & ~uint64_t{1}, std::memory_order_release);
}

bool InScope() { return tls_scope_depth > 0; }

void WaitForScopesToDrain() { (void)WaitForScopesToDrainFor(std::chrono::nanoseconds::max()); }

bool WaitForScopesToDrainFor(std::chrono::nanoseconds limit) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::pair<std::shared_ptr<ThreadRecord>, uint64_t>> pending;
  {
    Registry& r = registry();
    MutexLock lock(&r.mu);
    for (auto& t : r.threads) {
      const uint64_t s = t->state.load(std::memory_order_seq_cst);
      if ((s & 1) != 0 && t.get() != tls_slot.rec.get()) pending.emplace_back(t, s);
    }
  }
  for (auto& [t, s] : pending) {
    int spins = 0;
    while (t->state.load(std::memory_order_acquire) == s &&
           !t->exited.load(std::memory_order_acquire)) {
      if (++spins < 64) {
        std::this_thread::yield();
      } else {
        if (std::chrono::steady_clock::now() - start >= limit) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }
  return true;
}

void SetOverBudget(Heap* heap, std::atomic<bool>& flag, bool over) {
  if (flag.exchange(over, std::memory_order_acq_rel) == over) return;
  if (over) {
    MutexLock lock(&g_gate_mu);
    g_over_budget.push_back(heap);
    g_heaps_over_budget.fetch_add(1, std::memory_order_acq_rel);
  } else {
    {
      MutexLock lock(&g_gate_mu);
      std::erase(g_over_budget, heap);
      g_heaps_over_budget.fetch_sub(1, std::memory_order_acq_rel);
    }
    g_gate_cv.SignalAll();
  }
}

}  // namespace farmem::farptr_internal
