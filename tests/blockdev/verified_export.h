// VerifiedExport: one farmem-nbd export under a verifying writer, for the tests where a lender
// asks its memory back (drain_two_clients_test, lender_pressure_test). Fill() writes the whole
// export through the repo's NBD client; StartWriter() then rewrites chunk after chunk (a new
// generation each time) and reads each write back, until Stop(); ExpectIntact() reads the whole
// export and checks it holds what was last written.
// Threads: Fill/StartWriter/Stop/ExpectIntact from the test's thread; the writer thread owns the
// client between StartWriter and Stop; rounds() from anywhere.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "nbd_test_client.h"
#include "test_process.h"

namespace farmem::blockdev::testing {

class VerifiedExport {
 public:
  VerifiedExport(std::string resilience, std::unique_ptr<FarmemNbd> nbd, uint64_t export_bytes,
                 uint32_t chunk = 256u << 10)
      : resilience_(std::move(resilience)),
        nbd_(std::move(nbd)),
        chunk_(chunk),
        chunks_(export_bytes / chunk) {}
  ~VerifiedExport() { Stop(); }

  Status Fill() {
    ClientOptions o;
    o.timeout = std::chrono::seconds(30);
    FARMEM_ASSIGN_OR_RETURN(NbdTestClient c, NbdTestClient::Connect(nbd_->socket_path(), o));
    client_.emplace(std::move(c));
    expected_.resize(chunks_);
    for (uint64_t i = 0; i < chunks_; ++i) {
      expected_[i] = Seed(i);
      FARMEM_RETURN_IF_ERROR(client_->Write(i * chunk_, Pattern(chunk_, expected_[i])));
    }
    return Status::Ok();
  }

  void StartWriter() {
    thread_ = std::thread([this] {
      for (uint64_t gen = 1; !stop_.load(); ++gen) {
        const uint64_t i = (gen * 7) % chunks_;
        const uint64_t seed = Seed(gen * chunks_ + i);
        const std::vector<uint8_t> data = Pattern(chunk_, seed);
        if (Status s = client_->Write(i * chunk_, data); !s.ok()) {
          error_ = "writing chunk " + std::to_string(i) + ": " + s.ToString();
          return;
        }
        expected_[i] = seed;
        auto back = client_->Read(i * chunk_, chunk_);
        if (!back.has_value()) {
          error_ = "reading chunk " + std::to_string(i) + ": " + back.error().ToString();
          return;
        }
        if (*back != data) {
          error_ = "chunk " + std::to_string(i) + " read back wrong right after its write";
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

  // After Stop(): the whole export holds what was last written.
  void ExpectIntact() {
    ASSERT_TRUE(error_.empty()) << resilience_ << ": " << error_ << "\n" << nbd_->log();
    for (uint64_t i = 0; i < chunks_; ++i) {
      auto back = client_->Read(i * chunk_, chunk_);
      ASSERT_TRUE(back.has_value())
          << resilience_ << ": chunk " << i << ": " << back.error().ToString();
      ASSERT_TRUE(*back == Pattern(chunk_, expected_[i]))
          << resilience_ << ": chunk " << i << " LOST or wrong";
    }
  }

  uint64_t rounds() const { return rounds_.load(); }
  const std::string& resilience() const { return resilience_; }
  std::string log() const { return nbd_->log(); }
  bool alive() { return nbd_->process().Alive(); }
  FarmemNbd& nbd() { return *nbd_; }

 private:
  uint64_t Seed(uint64_t n) const { return (resilience_.size() << 40) + n; }

  std::string resilience_;
  std::unique_ptr<FarmemNbd> nbd_;
  const uint32_t chunk_;
  const uint64_t chunks_;
  std::optional<NbdTestClient> client_;
  std::vector<uint64_t> expected_;  // the writer's; read by the test's thread after Stop()
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> rounds_{0};
  std::string error_;
};

}  // namespace farmem::blockdev::testing
