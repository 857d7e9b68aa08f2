// Status and Result<T>: the one error model. Codes are stable wire values; messages carry
// context; the macros return early from functions of either return type.
#include "farmem/common/status.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

namespace farmem {
namespace {

using ::testing::HasSubstr;

TEST(StatusCode, WireValuesAreStable) {
  // These numbers travel in reply frames (docs/wire-protocol.md): they may never change.
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kOk), 0);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kInvalidArgument), 1);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kNotFound), 2);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kOutOfRange), 3);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kResourceExhausted), 4);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kPermissionDenied), 5);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kUnauthenticated), 6);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kUnavailable), 7);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kDeadlineExceeded), 8);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kExpired), 9);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kDataLoss), 10);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kProtocolError), 11);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kIoError), 12);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kAborted), 13);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kUnimplemented), 14);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kInternal), 15);
  EXPECT_EQ(static_cast<uint16_t>(StatusCode::kRemoteAccessError), 16);
}

TEST(StatusCode, NamesAndWireMapping) {
  const char* names[] = {"OK",
                         "InvalidArgument",
                         "NotFound",
                         "OutOfRange",
                         "ResourceExhausted",
                         "PermissionDenied",
                         "Unauthenticated",
                         "Unavailable",
                         "DeadlineExceeded",
                         "Expired",
                         "DataLoss",
                         "ProtocolError",
                         "IoError",
                         "Aborted",
                         "Unimplemented",
                         "Internal",
                         "RemoteAccessError"};
  for (uint16_t raw = 0; raw <= 16; ++raw) {
    EXPECT_EQ(StatusCodeFromWire(raw), static_cast<StatusCode>(raw)) << raw;
    EXPECT_EQ(StatusCodeName(static_cast<StatusCode>(raw)), names[raw]) << raw;
  }
  for (uint16_t raw : {uint16_t{17}, uint16_t{255}, uint16_t{0xffff}}) {
    EXPECT_EQ(StatusCodeFromWire(raw), StatusCode::kInternal) << raw;
  }
  EXPECT_EQ(StatusCodeName(static_cast<StatusCode>(999)), "Unknown");
}

TEST(Status, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(Status::Ok().ok());
}

TEST(Status, NamedConstructorsCarryTheirCode) {
  EXPECT_EQ(InvalidArgument("x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(NotFound("x").code(), StatusCode::kNotFound);
  EXPECT_EQ(OutOfRange("x").code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ResourceExhausted("x").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(PermissionDenied("x").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(Unauthenticated("x").code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(Unavailable("x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(DeadlineExceeded("x").code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(Expired("x").code(), StatusCode::kExpired);
  EXPECT_EQ(DataLoss("x").code(), StatusCode::kDataLoss);
  EXPECT_EQ(ProtocolError("x").code(), StatusCode::kProtocolError);
  EXPECT_EQ(IoError("x").code(), StatusCode::kIoError);
  EXPECT_EQ(Aborted("x").code(), StatusCode::kAborted);
  EXPECT_EQ(Unimplemented("x").code(), StatusCode::kUnimplemented);
  EXPECT_EQ(Internal("x").code(), StatusCode::kInternal);
  EXPECT_EQ(RemoteAccessError("x").code(), StatusCode::kRemoteAccessError);
  EXPECT_FALSE(Internal("x").ok());
}

TEST(Status, ToStringNamesCodeAndMessage) {
  EXPECT_EQ(PermissionDenied("wrong secret for 127.0.0.1:7000").ToString(),
            "PermissionDenied: wrong secret for 127.0.0.1:7000");
}

TEST(Status, WithContextPrefixesAndKeepsCode) {
  const Status s = Expired("lease 17 expired").WithContext("reading lease 17 on 10.0.0.3:7000");
  EXPECT_EQ(s.code(), StatusCode::kExpired);
  EXPECT_EQ(s.message(), "reading lease 17 on 10.0.0.3:7000: lease 17 expired");
  const Status twice = s.WithContext("page 9");
  EXPECT_EQ(twice.message(), "page 9: reading lease 17 on 10.0.0.3:7000: lease 17 expired");
  // OK stays OK, without a message.
  const Status ok = Status::Ok().WithContext("anything");
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.message(), "");
}

TEST(Status, EqualityComparesCodesOnly) {
  EXPECT_EQ(NotFound("a"), NotFound("b"));
  EXPECT_FALSE(NotFound("a") == Expired("a"));
  EXPECT_EQ(Status(), Status::Ok());
}

TEST(Status, ErrnoStatusNamesTheCallAndTheError) {
  const Status s = ErrnoStatus(StatusCode::kUnavailable, "connect 127.0.0.1:7000", ECONNREFUSED);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), std::string("connect 127.0.0.1:7000: ") + std::strerror(ECONNREFUSED));
}

TEST(Result, ErrWorksAsStatusAndAsResult) {
  Status s = Err(StatusCode::kNotFound, "no lease 4");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "no lease 4");
  Result<int> r = Err(OutOfRange("past the end"));
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kOutOfRange);
  Result<std::unique_ptr<int>> move_only = std::make_unique<int>(5);
  ASSERT_TRUE(move_only.has_value());
  EXPECT_EQ(**move_only, 5);
}

// ---------------------------------------------------------------- macros

int g_evaluations = 0;

Status StatusOf(StatusCode code) {
  ++g_evaluations;
  return code == StatusCode::kOk ? Status::Ok() : Status(code, "from StatusOf");
}

Result<int> ResultOf(StatusCode code, int value) {
  ++g_evaluations;
  if (code != StatusCode::kOk) return Err(code, "from ResultOf");
  return value;
}

Result<std::unique_ptr<std::string>> MoveOnly(bool ok) {
  if (!ok) return Err(DataLoss("gone"));
  return std::make_unique<std::string>("payload");
}

// A Status function that uses both macros over both kinds of expression.
Status StatusFunction(StatusCode first, StatusCode second, int* reached) {
  *reached = 0;
  FARMEM_RETURN_IF_ERROR(StatusOf(first));
  *reached = 1;
  FARMEM_RETURN_IF_ERROR(ResultOf(second, 1));
  *reached = 2;
  FARMEM_ASSIGN_OR_RETURN(int v, ResultOf(second, 41));
  *reached = v + 1;
  return Status::Ok();
}

// The same in a Result<T> function, plus assignment to an existing variable and move-only values.
Result<std::string> ResultFunction(StatusCode first, StatusCode second, bool move_ok) {
  FARMEM_RETURN_IF_ERROR(StatusOf(first));
  int v = 0;
  FARMEM_ASSIGN_OR_RETURN(v, ResultOf(second, 7));
  FARMEM_ASSIGN_OR_RETURN(auto p, MoveOnly(move_ok));
  return *p + std::to_string(v);
}

TEST(StatusMacros, ReturnIfErrorInStatusFunction) {
  int reached = -1;
  g_evaluations = 0;
  Status s = StatusFunction(StatusCode::kOk, StatusCode::kOk, &reached);
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(reached, 42);
  EXPECT_EQ(g_evaluations, 3);  // each expression evaluated exactly once

  s = StatusFunction(StatusCode::kExpired, StatusCode::kOk, &reached);
  EXPECT_EQ(s.code(), StatusCode::kExpired);
  EXPECT_EQ(s.message(), "from StatusOf");
  EXPECT_EQ(reached, 0);

  s = StatusFunction(StatusCode::kOk, StatusCode::kNotFound, &reached);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "from ResultOf");
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacros, AssignOrReturnInResultFunction) {
  g_evaluations = 0;
  Result<std::string> r = ResultFunction(StatusCode::kOk, StatusCode::kOk, true);
  ASSERT_TRUE(r.has_value()) << r.error().ToString();
  EXPECT_EQ(*r, "payload7");
  EXPECT_EQ(g_evaluations, 2);

  r = ResultFunction(StatusCode::kPermissionDenied, StatusCode::kOk, true);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kPermissionDenied);

  r = ResultFunction(StatusCode::kOk, StatusCode::kOutOfRange, true);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(r.error().message(), "from ResultOf");

  r = ResultFunction(StatusCode::kOk, StatusCode::kOk, false);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
}

Result<int> TwoOnOneFunction(bool fail_second) {
  FARMEM_ASSIGN_OR_RETURN(int a, ResultOf(StatusCode::kOk, 1));
  FARMEM_ASSIGN_OR_RETURN(int b, ResultOf(fail_second ? StatusCode::kAborted : StatusCode::kOk, 2));
  return a + b;
}

TEST(StatusMacros, SeveralAssignmentsInOneScope) {
  EXPECT_EQ(TwoOnOneFunction(false).value_or(-1), 3);
  EXPECT_EQ(TwoOnOneFunction(true).error().code(), StatusCode::kAborted);
}

TEST(StatusMacros, WorkInsideUnbracedIf) {
  auto f = [](bool fail) -> Status {
    if (fail)
      FARMEM_RETURN_IF_ERROR(Internal("inside if"));
    else
      FARMEM_RETURN_IF_ERROR(Status::Ok());
    return NotFound("fell through");
  };
  EXPECT_EQ(f(true).code(), StatusCode::kInternal);
  EXPECT_EQ(f(false).code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace farmem
