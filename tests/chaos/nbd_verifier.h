// A verifying NBD workload for the chaos suite: several connections, each with several requests
// in flight, write and read an export while faults happen, and at the end every byte of it is
// read back and checked exactly.
//
// Every block written (4 KiB, or a 512-byte sector with `unit` 512) carries (block index,
// generation) in a header and a body derived from both, so a read can tell the right data from
// stale, misplaced or zeroed data. Each connection owns a contiguous region of the export and never
// has two requests on one block in flight, so the expected contents of every block are known
// exactly: the last generation whose write was acknowledged, or — after a write that failed — that
// one or the failed one.
//
// Outcomes per byte: verified (read back right), lost (the read failed: EIO), corrupt (the read
// succeeded with wrong data — must never happen).
//
// Threads: the object belongs to the driver's thread; Start() runs one thread per connection,
// Stop() joins them. Each thread touches only its connection and its region's state.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "farmem/common/status.h"

namespace farmem::chaos {

struct NbdWorkloadOptions {
  std::string socket_path;
  int connections = 4;
  int depth = 8;  // requests in flight per connection
  // Bytes per verified block: 4096 (whole pages), or 512 for sub-page traffic — requests of 1 to
  // max_request_blocks sectors at any sector, so 512 B and 1 KiB writes, pages written in part
  // (farmem-nbd's write cache holds the rest and reads it at write-back) and requests that cross
  // pages.
  uint32_t unit = 4096;
  uint32_t max_request_blocks = 16;  // 64 KiB (of 4 KiB units)
  int read_percent = 50;
  double ops_per_second = 0;  // all connections together; 0: as fast as it goes
  std::chrono::milliseconds request_timeout{120000};
  // Seeds each connection's choice of blocks, sizes and reads/writes (farmem_chaos --seed):
  // 0 is the fixed sequence CI runs.
  uint64_t seed = 0;
};

struct NbdWorkloadReport {
  uint64_t bytes_written = 0;    // acknowledged writes
  uint64_t bytes_verified = 0;   // reads that came back right (during the run and at the end)
  uint64_t bytes_lost = 0;       // final verification: blocks whose read failed
  uint64_t bytes_corrupt = 0;    // final verification and during the run: wrong data
  uint64_t failed_requests = 0;  // during the run (EIO on read or write)
  uint64_t requests = 0;
  double longest_stall_ms = 0;        // slowest single request
  uint32_t unit = 4096;               // bytes per block (NbdWorkloadOptions::unit)
  std::vector<uint64_t> lost_blocks;  // block indexes (final verification)
  std::vector<std::string> problems;  // corrupt samples, transport errors (first few)
  bool transport_failed = false;      // a connection broke: the run proves nothing
};

class NbdVerifier {
 public:
  explicit NbdVerifier(NbdWorkloadOptions options);
  ~NbdVerifier();
  NbdVerifier(const NbdVerifier&) = delete;
  NbdVerifier& operator=(const NbdVerifier&) = delete;

  // Connects every connection (the export must be up).
  Status Connect();
  // Writes every block once, all connections in parallel.
  Status Fill();
  // Random reads and writes on every connection until Stop().
  void Start();
  void Stop();
  // Reads every block and checks it. After Stop().
  Status VerifyAll();

  uint64_t completed() const { return completed_.load(std::memory_order_relaxed); }
  uint64_t export_size() const { return size_; }
  NbdWorkloadReport Report() const;

  struct Conn;  // nbd_verifier.cc

 private:
  NbdWorkloadOptions options_;
  uint64_t size_ = 0;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> completed_{0};
};

}  // namespace farmem::chaos
