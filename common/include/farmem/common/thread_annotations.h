// Clang thread-safety annotations (-Wthread-safety), as LevelDB's port/thread_annotations.h and
// Abseil's thread_annotations.h do. They state which lock guards which member and which locks a
// function needs; a clang build with -Werror=thread-safety (FARMEM_THREAD_SAFETY=ON: the ASan
// tree of tests/run --asan, in CI, and tests/run --thread-safety) checks them. On GCC they expand
// to nothing.
//
// They only mean something on a lock type clang knows as a capability: use farmem::Mutex and
// farmem::SharedMutex (common/mutex.h), not std::mutex, for any member that guards others.
#pragma once

#if defined(__clang__)
#define FARMEM_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define FARMEM_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) FARMEM_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY FARMEM_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) FARMEM_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) FARMEM_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) FARMEM_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) FARMEM_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) FARMEM_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) FARMEM_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
#define ACQUIRE(...) FARMEM_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) FARMEM_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) FARMEM_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) FARMEM_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define RELEASE_GENERIC(...) FARMEM_THREAD_ANNOTATION(release_generic_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) FARMEM_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define TRY_ACQUIRE_SHARED(...) FARMEM_THREAD_ANNOTATION(try_acquire_shared_capability(__VA_ARGS__))
#define EXCLUDES(...) FARMEM_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) FARMEM_THREAD_ANNOTATION(assert_capability(x))
#define ASSERT_SHARED_CAPABILITY(x) FARMEM_THREAD_ANNOTATION(assert_shared_capability(x))
#define RETURN_CAPABILITY(x) FARMEM_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS FARMEM_THREAD_ANNOTATION(no_thread_safety_analysis)
