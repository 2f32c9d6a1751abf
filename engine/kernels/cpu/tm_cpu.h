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

/* Panels per chunk of a GEMM cut into (row block, panel group) chunks: about `target` chunks over
 * the mblocks row blocks, at most `cap` groups per block, and, where the panels allow, a chunk
 * count that is a multiple of the threads, so that no thread is left with the last chunk alone
 * while the others wait. Measured with benchmarks/gemm_ab.py on a 2-core Xeon (AVX-512), fp32,
 * SmolLM2 shapes, cold: M = 512 (3 row blocks x 3 groups = 9 chunks before) +7-8%; M = 32-128 and
 * 1024, already even, unchanged. */
static inline int64_t tm_panel_group(int64_t npanels, int64_t mblocks, int64_t target, int threads, int64_t cap) {
    int64_t per_mb = (target + mblocks - 1) / mblocks;
    if (per_mb > npanels) per_mb = npanels;
    if (per_mb > cap) per_mb = cap;
    if (per_mb < 1) per_mb = 1;
    for (int64_t p = per_mb; threads > 1 && p <= npanels && p <= cap; ++p) {
        const int64_t group = (npanels + p - 1) / p, groups = (npanels + group - 1) / group;
        if ((mblocks * groups) % threads == 0) return group;
    }
    return (npanels + per_mb - 1) / per_mb;
}

/* ---------------------------------------------------------------- shared math */
/* exp(x) for |x| <= 88: 2^n * 2^f, f in [-0.5, 0.5], 2^f from a degree-6 polynomial in f ln 2
 * (relative error below 2e-7). */
static inline float tm_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504088896341f;
    const float n = __builtin_rintf(t);
    const float r = (t - n) * 0.69314718055994531f;
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.0083333338f +
                                                                                              r * 0.0013888889f)))));
    union {
        float f;
        int32_t i;
    } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

/* max |x[i]| over n floats, as a loop of fmaxf (a NaN is skipped; 0 for n == 0), 8 lanes at a time
 * where AVX2 is there (vmaxps returns its second operand when either is a NaN) */
static inline float tm_absmax(const float *x, int64_t n) {
    float amax = 0.0f;
    int64_t i = 0;
#if defined(TM_AVX512) || defined(TM_AVX2)
    if (n >= 8) {
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            m0 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m0);
            m1 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 8)), m1);
        }
        for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m0);
        m0 = _mm256_max_ps(m0, m1);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        amax = _mm_cvtss_f32(h);
    }
#endif
    for (; i < n; ++i) {
        const float a = __builtin_fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* SwiGLU's silu(g) * u, as tm_silu_mul and the gate/up GEMM's fused epilogue compute it */
static inline float tm_silu_mul1(float g, float u) { return g / (1.0f + tm_expf(-g)) * u; }

#endif
