// Backends for tests: one that records what the server asked for (to check that NBD flags such as
// FUA and NO_HOLE arrive), fails on demand (to check error replies) and, if asked, reports every
// op of a batch early through the BatchListener, as the remote page store does.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "farmem/blockdev/block_backend.h"

namespace farmem::blockdev::testing {

struct RecordedOp {
  BlockOp::Kind kind;
  uint64_t offset;
  uint64_t length;
  bool fua;
  bool may_trim;
};

// Forwards to a MemoryBackend and records every call. Thread-safe.
class RecordingBackend : public BlockBackend {
 public:
  explicit RecordingBackend(std::unique_ptr<MemoryBackend> inner) : inner_(std::move(inner)) {}

  uint64_t size() const override { return inner_->size(); }
  Status Read(uint64_t offset, std::span<uint8_t> buf) override {
    Record({BlockOp::Kind::kRead, offset, buf.size(), false, false});
    return Fail() ? IoError("injected read failure") : inner_->Read(offset, buf);
  }
  Status Write(uint64_t offset, std::span<const uint8_t> data, bool fua) override {
    Record({BlockOp::Kind::kWrite, offset, data.size(), fua, false});
    return Fail() ? IoError("injected write failure") : inner_->Write(offset, data, fua);
  }
  Status Flush() override {
    Record({BlockOp::Kind::kFlush, 0, 0, false, false});
    return Fail() ? IoError("injected flush failure") : inner_->Flush();
  }
  Status Trim(uint64_t offset, uint64_t length, bool fua) override {
    Record({BlockOp::Kind::kTrim, offset, length, fua, false});
    return Fail() ? IoError("injected trim failure") : inner_->Trim(offset, length, fua);
  }
  Status WriteZeroes(uint64_t offset, uint64_t length, bool may_trim, bool fua) override {
    Record({BlockOp::Kind::kWriteZeroes, offset, length, fua, may_trim});
    return Fail() ? IoError("injected zero failure")
                  : inner_->WriteZeroes(offset, length, may_trim, fua);
  }
  bool can_flush() const override { return true; }
  bool can_fua() const override { return true; }
  bool can_trim() const override { return true; }
  bool can_write_zeroes() const override { return true; }
  bool can_multi_conn() const override { return multi_conn_; }

  void ExecuteBatch(std::span<BlockOp> ops, BatchListener* listener = nullptr) override {
    if (report_early_ && listener != nullptr) {
      for (size_t i = 0; i < ops.size(); ++i) {
        BlockBackend::ExecuteBatch(ops.subspan(i, 1));
        listener->OpDone(i);
        listener->Progress();
      }
    } else {
      BlockBackend::ExecuteBatch(ops, listener);
    }
    batches_finished_.fetch_add(1);
  }
  // Each op of a batch is reported (OpDone + Progress) as soon as it is done.
  void set_report_early(bool v) { report_early_ = v; }
  uint64_t batches_finished() const { return batches_finished_.load(); }

  void set_fail(bool fail) {
    std::lock_guard lock(mu_);
    fail_ = fail;
    succeed_before_fail_ = -1;
  }
  // The next `n` calls succeed, every later one fails (until set_fail(false)): a failure in the
  // middle of a request served in pieces.
  void set_fail_after(int n) {
    std::lock_guard lock(mu_);
    fail_ = false;
    succeed_before_fail_ = n;
  }
  void set_multi_conn(bool v) { multi_conn_ = v; }
  std::vector<RecordedOp> ops() {
    std::lock_guard lock(mu_);
    return ops_;
  }
  void clear() {
    std::lock_guard lock(mu_);
    ops_.clear();
  }

 private:
  void Record(const RecordedOp& op) {
    std::lock_guard lock(mu_);
    ops_.push_back(op);
  }
  bool Fail() {
    std::lock_guard lock(mu_);
    if (succeed_before_fail_ == 0) fail_ = true;
    if (succeed_before_fail_ >= 0) --succeed_before_fail_;
    return fail_;
  }

  std::unique_ptr<MemoryBackend> inner_;
  bool multi_conn_ = true;
  bool report_early_ = false;
  std::atomic<uint64_t> batches_finished_{0};
  std::mutex mu_;
  std::vector<RecordedOp> ops_;   // guarded by mu_
  bool fail_ = false;             // guarded by mu_
  int succeed_before_fail_ = -1;  // guarded by mu_; -1: fail_ alone decides
};

}  // namespace farmem::blockdev::testing
