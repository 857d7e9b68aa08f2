// Status and Result<T>: farmem's one error model.
//
// Every function that can fail returns [[nodiscard]] Status or Result<T> (std::expected<T,
// Status>). A Status carries a code (also sent on the wire, see docs/wire-protocol.md) and a
// message written for the person who reads the log: it names the node, lease, offset or option
// involved. Status is a value type; any thread may create, copy or read one.
#pragma once

#include <cstdint>
#include <expected>
#include <string>
#include <string_view>
#include <utility>

namespace farmem {

// Codes are stable: they travel in reply frames. Append only.
enum class StatusCode : uint16_t {
  kOk = 0,
  kInvalidArgument = 1,     // the caller asked for something malformed
  kNotFound = 2,            // no such lease / node / export
  kOutOfRange = 3,          // offset or length outside the object
  kResourceExhausted = 4,   // no free slabs, too many in flight, body too large
  kPermissionDenied = 5,    // wrong secret, lease owned by someone else
  kUnauthenticated = 6,     // operation before authentication
  kUnavailable = 7,         // peer unreachable, connection lost
  kDeadlineExceeded = 8,    // no answer in time
  kExpired = 9,             // lease expired or evicted (stale epoch)
  kDataLoss = 10,           // data cannot be reconstructed
  kProtocolError = 11,      // malformed frame, wrong magic/version
  kIoError = 12,            // local I/O failed
  kAborted = 13,            // cancelled by shutdown
  kUnimplemented = 14,      // unknown opcode / unsupported feature
  kInternal = 15,           // a bug: an invariant did not hold
  kRemoteAccessError = 16,  // the fabric refused the access (stale rkey, bad bounds)
};

std::string_view StatusCodeName(StatusCode code);
// Maps a code read off the wire; unknown values become kInternal (never trusted blindly).
StatusCode StatusCodeFromWire(uint16_t raw);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  // Lets `return Err(...)` and FARMEM_RETURN_IF_ERROR work in functions that return Status.
  Status(std::unexpected<Status> error)  // NOLINT(google-explicit-constructor)
      : Status(std::move(error).error()) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "PermissionDenied: wrong secret for 127.0.0.1:7000"
  std::string ToString() const;

  // Returns a copy whose message is prefixed with context: "reading lease 3: <message>".
  Status WithContext(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) { return a.code_ == b.code_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename T>
using Result = std::expected<T, Status>;

// Makes an error usable both as Status and as Result<T>.
inline std::unexpected<Status> Err(StatusCode code, std::string message) {
  return std::unexpected<Status>(Status(code, std::move(message)));
}
inline std::unexpected<Status> Err(Status status) {
  return std::unexpected<Status>(std::move(status));
}

// Short constructors, named after the code.
#define FARMEM_STATUS_CTOR(Name)                            \
  inline Status Name(std::string message) {                 \
    return Status(StatusCode::k##Name, std::move(message)); \
  }
FARMEM_STATUS_CTOR(InvalidArgument)
FARMEM_STATUS_CTOR(NotFound)
FARMEM_STATUS_CTOR(OutOfRange)
FARMEM_STATUS_CTOR(ResourceExhausted)
FARMEM_STATUS_CTOR(PermissionDenied)
FARMEM_STATUS_CTOR(Unauthenticated)
FARMEM_STATUS_CTOR(Unavailable)
FARMEM_STATUS_CTOR(DeadlineExceeded)
FARMEM_STATUS_CTOR(Expired)
FARMEM_STATUS_CTOR(DataLoss)
FARMEM_STATUS_CTOR(ProtocolError)
FARMEM_STATUS_CTOR(IoError)
FARMEM_STATUS_CTOR(Aborted)
FARMEM_STATUS_CTOR(Unimplemented)
FARMEM_STATUS_CTOR(Internal)
FARMEM_STATUS_CTOR(RemoteAccessError)
#undef FARMEM_STATUS_CTOR

// Status from errno: "connect 127.0.0.1:7000: Connection refused".
Status ErrnoStatus(StatusCode code, std::string_view what, int err);

namespace internal {
inline const Status& AsStatus(const Status& s) { return s; }
template <typename T>
inline Status AsStatus(const Result<T>& r) {
  return r.has_value() ? Status() : r.error();
}
}  // namespace internal

}  // namespace farmem

// Returns early with the error of a Status or Result expression.
#define FARMEM_RETURN_IF_ERROR(expr)                                      \
  do {                                                                    \
    auto&& farmem_status_ = (expr);                                       \
    if (!::farmem::internal::AsStatus(farmem_status_).ok())               \
      return ::farmem::Err(::farmem::internal::AsStatus(farmem_status_)); \
  } while (0)

#define FARMEM_CONCAT_INNER(a, b) a##b
#define FARMEM_CONCAT(a, b) FARMEM_CONCAT_INNER(a, b)

// FARMEM_ASSIGN_OR_RETURN(auto x, Foo()); returns the error if Foo() failed.
#define FARMEM_ASSIGN_OR_RETURN(lhs, expr) \
  FARMEM_ASSIGN_OR_RETURN_IMPL(FARMEM_CONCAT(farmem_result_, __LINE__), lhs, expr)
#define FARMEM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr)                  \
  auto tmp = (expr);                                                  \
  if (!tmp.has_value()) return ::farmem::Err(std::move(tmp).error()); \
  lhs = std::move(tmp).value()
