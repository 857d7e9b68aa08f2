// Clang thread-safety annotations (-Wthread-safety), as LevelDB's port/thread_annotations.h does.
// They document which lock guards which member; on GCC they expand to nothing.
#pragma once

#if defined(__clang__)
#define FARMEM_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define FARMEM_THREAD_ANNOTATION(x)
#endif

#ifndef GUARDED_BY
#define GUARDED_BY(x) FARMEM_THREAD_ANNOTATION(guarded_by(x))
#endif
#ifndef PT_GUARDED_BY
#define PT_GUARDED_BY(x) FARMEM_THREAD_ANNOTATION(pt_guarded_by(x))
#endif
#ifndef ACQUIRED_BEFORE
#define ACQUIRED_BEFORE(...) FARMEM_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#endif
#ifndef ACQUIRED_AFTER
#define ACQUIRED_AFTER(...) FARMEM_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#endif
#ifndef REQUIRES
#define REQUIRES(...) FARMEM_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#endif
#ifndef EXCLUDES
#define EXCLUDES(...) FARMEM_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#endif
