/*
 * tokenmill's CPU kernel library: shared declarations.
 *
 * The library is compiled on first use for the CPU it runs on (-march=native) by
 * engine/kernels/cpu/__init__.py. One source serves three instruction sets, picked
 * at compile time:
 *   TM_AVX512  AVX-512 F/BW/VL (and VNNI for int8 dot products where present)
 *   TM_AVX2    AVX2 + FMA (and AVX-VNNI where present)
 *   neither    plain C that the compiler vectorizes (also forced with -DTM_GENERIC,
 *              so the tests can check it on any machine)
 */
#ifndef TM_CPU_H
#define TM_CPU_H

#include <stddef.h>
#include <stdint.h>

#if !defined(TM_GENERIC) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TM_AVX512 1
#elif !defined(TM_GENERIC) && defined(__AVX2__) && defined(__FMA__)
#define TM_AVX2 1
#endif

#if defined(TM_AVX512) || defined(TM_AVX2)
#include <immintrin.h>
#endif

#define TM_INLINE static inline __attribute__((always_inline))
#define TM_MAX_THREADS 64

/* ---------------------------------------------------------------- thread pool (pool.c)
 * tm_parallel_for runs fn(ctx, chunk) for every chunk in [0, nchunks) on the pool's
 * threads and the caller, handing chunks out one at a time from a shared counter (so a
 * thread slowed down by another process simply takes fewer chunks), and returns when
 * all are done. Calls from inside a chunk run serially on the calling thread. */
typedef void (*tm_chunk_fn)(void *ctx, int64_t chunk);
void tm_parallel_for(int64_t nchunks, tm_chunk_fn fn, void *ctx);
int tm_get_num_threads(void);

#endif
