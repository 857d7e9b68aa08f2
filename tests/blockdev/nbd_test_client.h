// A small NBD client for tests, written from doc/proto.md independently of the server's code
// paths (it shares only the constants of nbd_protocol.h). It can negotiate normally and also send
// arbitrary bytes, so tests can both use the server and abuse it.
//
// One NbdTestClient is used by one thread at a time. It remembers the requests it sent so that it
// can parse simple replies (whose length depends on the request) and reassemble structured ones.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "farmem/blockdev/nbd_protocol.h"
#include "farmem/common/socket.h"
#include "farmem/common/status.h"

namespace farmem::blockdev::testing {

struct ClientOptions {
  bool fixed_newstyle = true;
  bool no_zeroes = true;
  bool structured_replies = true;
  bool use_go = true;  // false: NBD_OPT_EXPORT_NAME
  std::string export_name;
  std::chrono::milliseconds timeout{10000};
};

struct NbdReply {
  uint64_t handle = 0;
  uint32_t error = 0;
  std::string message;        // structured error chunks only
  std::vector<uint8_t> data;  // READ: the data (reassembled from chunks)
  bool structured = false;
  int chunks = 0;
};

// Connects to a Unix socket; the fd is blocking.
Result<Socket> ConnectUnix(const std::string& path);

class NbdTestClient {
 public:
  // Runs the handshake on an already connected socket.
  static Result<NbdTestClient> Handshake(Socket socket, const ClientOptions& options = {});
  static Result<NbdTestClient> Connect(const std::string& unix_path,
                                       const ClientOptions& options = {});

  uint64_t size() const { return size_; }
  uint16_t transmission_flags() const { return flags_; }
  bool structured() const { return structured_; }
  int fd() const { return socket_.fd(); }

  // Sends one request (header + payload for WRITE) without waiting.
  Status Send(uint16_t type, uint16_t flags, uint64_t handle, uint64_t offset, uint32_t length,
              std::span<const uint8_t> payload = {});
  // Reads the next complete reply (all chunks of a structured one).
  Result<NbdReply> Receive();
  // Send + Receive.
  Result<NbdReply> Call(uint16_t type, uint16_t flags, uint64_t offset, uint32_t length,
                        std::span<const uint8_t> payload = {});

  // Conveniences that fail (Status) on a transport error or an NBD error.
  Status Write(uint64_t offset, std::span<const uint8_t> data, uint16_t flags = 0);
  Result<std::vector<uint8_t>> Read(uint64_t offset, uint32_t length, uint16_t flags = 0);
  Status Disconnect();  // NBD_CMD_DISC, then waits for the server to close

  // Registers a request sent by hand (SendRaw), so that Receive() can parse its reply. Lets a
  // test register a whole pipeline, send it from another thread and receive on this one.
  void Expect(uint16_t type, uint64_t handle, uint64_t offset, uint32_t length) {
    in_flight_[handle] = Sent{type, offset, length};
  }

  // Raw access for malformed traffic. SendRaw may run on a second thread while this one is in
  // Receive() (they touch nothing shared but the socket).
  Status SendRaw(std::span<const uint8_t> bytes);
  Status RecvRaw(std::span<uint8_t> out);
  // True if the server closed the connection (reads EOF) within the timeout.
  bool WaitForClose(std::chrono::milliseconds timeout);

 private:
  struct Sent {
    uint16_t type;
    uint64_t offset;
    uint32_t length;
  };
  explicit NbdTestClient(Socket s, std::chrono::milliseconds timeout)
      : socket_(std::move(s)), timeout_(timeout) {}

  Socket socket_;
  std::chrono::milliseconds timeout_;
  uint64_t size_ = 0;
  uint16_t flags_ = 0;
  bool structured_ = false;
  uint64_t next_handle_ = 1;
  std::unordered_map<uint64_t, Sent> in_flight_;
};

// ---- building option traffic by hand ----
std::vector<uint8_t> OptionBytes(uint32_t option, std::span<const uint8_t> data);
std::vector<uint8_t> GoData(std::string_view name, std::span<const uint16_t> infos);
std::vector<uint8_t> RequestBytes(uint16_t type, uint16_t flags, uint64_t handle, uint64_t offset,
                                  uint32_t length);

struct OptionReply {
  uint32_t option = 0;
  uint32_t type = 0;
  std::vector<uint8_t> data;
};
// Reads one option reply from fd.
Result<OptionReply> ReadOptionReply(int fd, std::chrono::milliseconds timeout);

// Deterministic test data.
std::vector<uint8_t> Pattern(size_t n, uint64_t seed);

}  // namespace farmem::blockdev::testing
