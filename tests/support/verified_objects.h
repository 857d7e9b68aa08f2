// A far_ptr workload that checks itself, for tests that run faults or maintenance under load:
// `count` objects of `size` bytes, each holding FillObject(id, version). Fill() writes version 1
// and evicts everything; the writer thread (StartWriter) rewrites every seventh object — checking
// the version it replaces — and evicts everything again, round after round, until Stop().
#pragma once

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "farmem/far_ptr.h"
#include "farmem/runtime.h"
#include "support/object_pattern.h"

namespace farmem::testing {

class VerifiedFarObjects {
 public:
  // `during`: what the writer runs alongside, for its error messages ("during the drain").
  VerifiedFarObjects(Runtime& rt, size_t count, size_t size, std::string during)
      : rt_(rt), count_(count), size_(size), during_(std::move(during)) {}
  ~VerifiedFarObjects() { Stop(); }

  Status Fill() { return Add(count_); }

  // `more` objects after those there are, written as Fill() writes them (and everything evicted);
  // for a test that needs the runtime to hold a lease somewhere. Before StartWriter() only.
  Status Add(size_t more) {
    for (size_t n = 0; n < more; ++n) {
      const size_t i = objs_.size();
      far_bytes b = make_far_bytes_in(rt_, size_);
      {
        DerefScope s;
        FillObject(b.deref_mut(s), i, 1);
      }
      objs_.push_back(std::move(b));
      versions_.push_back(1);
    }
    return rt_.EvictUntil(0);
  }

  size_t size() const { return objs_.size(); }

  void StartWriter() {
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        for (size_t i = 0; i < objs_.size() && !stop_.load(); i += 7) {
          DerefScope s;
          auto got = objs_[i].try_deref_mut(s);
          if (!got) {
            error_ = "object " + std::to_string(i) + ": " + got.error().ToString();
            return;
          }
          std::vector<std::byte> want(got->size());
          FillObject(want, i, versions_[i]);
          if (std::memcmp(want.data(), got->data(), want.size()) != 0) {
            error_ = "object " + std::to_string(i) + " came back wrong " + during_;
            return;
          }
          FillObject(*got, i, ++versions_[i]);
        }
        if (Status e = rt_.EvictUntil(0); !e.ok() && e.code() != StatusCode::kResourceExhausted) {
          error_ = "evicting " + during_ + ": " + e.ToString();
          return;
        }
        rounds_.fetch_add(1);
      }
    });
  }

  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

  // Writer rounds done so far.
  uint64_t rounds() const { return rounds_.load(); }
  // After Stop(): the writer's error ("" when it found none).
  const std::string& error() const { return error_; }

  // After Stop(): "" when every object reads back as last written, else the first that does not.
  std::string Check() const {
    for (size_t i = 0; i < objs_.size(); ++i) {
      DerefScope s;
      auto got = objs_[i].try_deref(s);
      if (!got) return "far object " + std::to_string(i) + ": " + got.error().ToString();
      std::vector<std::byte> want(got->size());
      FillObject(want, i, versions_[i]);
      if (std::memcmp(want.data(), got->data(), want.size()) != 0) {
        return "far object " + std::to_string(i) + " LOST or wrong " + during_;
      }
    }
    return "";
  }

 private:
  Runtime& rt_;
  const size_t count_, size_;
  const std::string during_;
  std::vector<far_bytes> objs_;
  std::vector<uint64_t> versions_;  // the writer's; read by Check() after Stop()
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> rounds_{0};
  std::string error_;
};

}  // namespace farmem::testing
