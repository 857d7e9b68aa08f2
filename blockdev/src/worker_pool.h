// WorkerPool: a page store's per-call state (channels, cipher, buffers), created once at start-up
// and checked out by each BlockBackend call for its duration. The last worker is not shared: it
// belongs to the store's background thread (the page store's rebuilds, the stripe store's
// compactor), which therefore never waits for a request to finish.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "farmem/common/mutex.h"

namespace farmem::blockdev {

template <typename W>
class WorkerPool {
 public:
  // `workers` holds the callers' workers followed by the background thread's own (at least one).
  // Called once, before any other thread uses the pool.
  void Init(std::vector<std::unique_ptr<W>> workers) EXCLUDES(mu_) {
    all_ = std::move(workers);
    MutexLock lock(&mu_);
    for (size_t i = 0; i + 1 < all_.size(); ++i) free_.push_back(all_[i].get());
  }

  // Blocks until a worker is free.
  W* Checkout() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    cv_.Wait(&mu_, [&] {
      mu_.AssertHeld();
      return !free_.empty();
    });
    W* w = free_.back();
    free_.pop_back();
    return w;
  }

  void Return(W* w) EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      free_.push_back(w);
    }
    cv_.Signal();
  }

  // The background thread's worker.
  W& background() const { return *all_.back(); }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<std::unique_ptr<W>> all_;  // immutable after Init
  std::vector<W*> free_ GUARDED_BY(mu_);
};

}  // namespace farmem::blockdev
