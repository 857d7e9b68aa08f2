// Whether this test was built under a sanitizer, for the tests that adapt to one (timers stretched,
// memory bounds raised, /proc/PID/mem scans or VmLck checks skipped). The one place that asks:
// gcc defines __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__, clang defines neither and answers
// __has_feature(address_sanitizer) / __has_feature(thread_sanitizer) instead (tests/run --asan
// builds with clang-16, --tsan with gcc: docs/testing.md).
//
//   FARMEM_UNDER_ASAN, FARMEM_UNDER_TSAN, FARMEM_SANITIZED: 1 or 0, for #if
//   farmem::testing::kUnderAsan, kUnderTsan, kSanitized: the same, for `if constexpr` and C++
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define FARMEM_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FARMEM_UNDER_ASAN 1
#endif
#endif
#ifndef FARMEM_UNDER_ASAN
#define FARMEM_UNDER_ASAN 0
#endif

#if defined(__SANITIZE_THREAD__)
#define FARMEM_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FARMEM_UNDER_TSAN 1
#endif
#endif
#ifndef FARMEM_UNDER_TSAN
#define FARMEM_UNDER_TSAN 0
#endif

#define FARMEM_SANITIZED (FARMEM_UNDER_ASAN || FARMEM_UNDER_TSAN)

namespace farmem::testing {

inline constexpr bool kUnderAsan = FARMEM_UNDER_ASAN;
inline constexpr bool kUnderTsan = FARMEM_UNDER_TSAN;
inline constexpr bool kSanitized = FARMEM_SANITIZED;

}  // namespace farmem::testing
