#include "farmem/common/status.h"

#include <cstring>

namespace farmem {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kOutOfRange:
      return "OutOfRange";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kUnauthenticated:
      return "Unauthenticated";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kDeadlineExceeded:
      return "DeadlineExceeded";
    case StatusCode::kExpired:
      return "Expired";
    case StatusCode::kDataLoss:
      return "DataLoss";
    case StatusCode::kProtocolError:
      return "ProtocolError";
    case StatusCode::kIoError:
      return "IoError";
    case StatusCode::kAborted:
      return "Aborted";
    case StatusCode::kUnimplemented:
      return "Unimplemented";
    case StatusCode::kInternal:
      return "Internal";
    case StatusCode::kRemoteAccessError:
      return "RemoteAccessError";
  }
  return "Unknown";
}

StatusCode StatusCodeFromWire(uint16_t raw) {
  if (raw > static_cast<uint16_t>(StatusCode::kRemoteAccessError)) return StatusCode::kInternal;
  return static_cast<StatusCode>(raw);
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string msg(context);
  msg += ": ";
  msg += message_;
  return Status(code_, std::move(msg));
}

Status ErrnoStatus(StatusCode code, std::string_view what, int err) {
  std::string msg(what);
  msg += ": ";
  msg += std::strerror(err);
  return Status(code, std::move(msg));
}

}  // namespace farmem
