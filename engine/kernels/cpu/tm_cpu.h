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

/* ---------------------------------------------------------------- AMX tiles (pool.c)
 * tm_amx_usable(): TM_AMX_UNIT_INT8 | TM_AMX_UNIT_BF16 for the tile units this process may use: the CPU has
 * AMX-TILE and the unit (CPUID.(EAX=7, ECX=0):EDX bit 24, and bit 25 for INT8, 22 for BF16) and Linux
 * grants the process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; without
 * it the first tile instruction raises SIGILL). Asked once per process; the grant holds for all its
 * threads and forked children (Linux's Documentation/arch/x86/xstate.rst). 0 off x86-64 Linux.
 * TM_HAVE_AMX: the build emits tile instructions (AVX-512, AMX-TILE, x86-64 Linux); tm_tilecfg is
 * LDTILECFG's 64-byte operand, tm_tiles_16x64 palette 1 with tmm0-7 all 16 rows of 64 bytes (Intel
 * SDM vol. 2, LDTILECFG). A thread loads it before its tile work and releases the tiles after
 * (TILERELEASE), so that context switches need not save them. */
#define TM_AMX_UNIT_INT8 1
#define TM_AMX_UNIT_BF16 2
int tm_amx_usable(void);
/* An AMX path's on/off state (*state: -1 until decided, then 0 or 1): mode >= 0 sets it (on only where
 * tm_amx_usable() has `unit`); mode < 0 asks, deciding on first use: on where usable unless the
 * environment has TOKENMILL_AMX=0. Returns the state now. */
int tm_amx_switch(_Atomic int *state, int mode, int unit);
/* gemm.c: whether bf16 products run on AMX-BF16 tiles (mode < 0 asks, 0 off, 1 on where possible); the bf16
 * GEMM and the attention over a TM_KV_BF16 cache follow it */
int tm_bf16_amx(int mode);
#if defined(TM_AVX512) && defined(__AMX_TILE__) && defined(__x86_64__) && defined(__linux__)
#define TM_HAVE_AMX 1
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tm_tilecfg;
static const tm_tilecfg tm_tiles_16x64 __attribute__((aligned(64), unused)) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
#endif

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

/* ---------------------------------------------------------------- KV cache rows
 * The row formats of a paged KV cache [Hkv, S, row] (tm_kv_write, tm_paged_attention):
 *   TM_KV_F32  D fp32 values
 *   TM_KV_I8   D int8 codes, then the row's fp32 scale (value = code * scale)
 *   TM_KV_F16  D IEEE 754 binary16 values (llama.cpp's default KV type), widened to fp32 on
 *              load; written from fp32 rounding to nearest, ties to even, as torch's
 *              .to(torch.float16) and vcvtps2ph do, so both write the same bits
 *   TM_KV_BF16 bf16 values (tm_float_to_bf16) laid out for the bf16 dot-product unit in groups of
 *              TM_KV_GROUP consecutive slots, D * TM_KV_GROUP values each (slot / 16 picks the group;
 *              a KV block must hold whole groups): the group's K as [D / 2][16] pairs, pair
 *              i * 16 + o holding dims 2i, 2i + 1 of slot o (the keys of a pair row are the 16 lanes
 *              of a vector); its V as [8][D] pairs, pair t * D + e holding dim e of slots 2t, 2t + 1
 *              (tm_bf16_k_at, tm_bf16_v_at) */
#define TM_KV_F32 0
#define TM_KV_I8 1
#define TM_KV_F16 2
#define TM_KV_BF16 3
#define TM_KV_GROUP 16

static inline int64_t tm_kv_row_bytes(int kv, int64_t d) {
    return kv == TM_KV_I8 ? d + 4 : (kv == TM_KV_F16 || kv == TM_KV_BF16 ? 2 * d : 4 * d);
}

/* Index, in bf16 values from the start of a KV head's [S, D] region of a TM_KV_BF16 cache, of K
 * (tm_bf16_k_at) or V (tm_bf16_v_at) dim e of a slot. */
static inline int64_t tm_bf16_k_at(int64_t slot, int64_t e, int64_t d) {
    return slot / TM_KV_GROUP * TM_KV_GROUP * d + ((e / 2) * TM_KV_GROUP + slot % TM_KV_GROUP) * 2 + e % 2;
}
static inline int64_t tm_bf16_v_at(int64_t slot, int64_t e, int64_t d) {
    return slot / TM_KV_GROUP * TM_KV_GROUP * d + ((slot % TM_KV_GROUP / 2) * d + e) * 2 + slot % 2;
}

/* fp32 -> bf16 bits as VCVTNE2PS2BF16 defines it: round to nearest even, a denormal to a zero of
 * its sign, a NaN kept quiet, infinities kept */
static inline uint16_t tm_float_to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float tm_bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* binary16 bits -> fp32 (exact: every half is a float) */
static inline float tm_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    float f;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (man << 13); /* inf, NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13); /* rebias 15 -> 127 */
    } else {
        f = (float)man * 0x1p-24f; /* zero or subnormal: man units of 2^-24, exact */
        __builtin_memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* fp32 -> binary16 bits, rounding to nearest, ties to even; beyond the largest half (65504)
 * by half a step or more -> inf; NaN stays a (quiet) NaN */
static inline uint16_t tm_float_to_half(float f) {
    uint32_t x;
    __builtin_memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x1FFu));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* 65520 and up, inf */
    if (ax < 0x38800000u) { /* below 2^-14: a multiple of 2^-24 (1024 of them: the least normal) */
        float a;
        __builtin_memcpy(&a, &ax, sizeof a);
        return (uint16_t)(sign | (uint16_t)__builtin_rintf(a * 0x1p24f)); /* exact scaling, then RNE */
    }
    uint32_t r = ax - 0x38000000u;     /* exponent rebias 127 -> 15 */
    r += 0x0FFFu + ((r >> 13) & 1u); /* round the 13 dropped bits, ties to even (a carry bumps the exponent) */
    return (uint16_t)(sign | (r >> 13));
}

/* SwiGLU's silu(g) * u, as tm_silu_mul and the gate/up GEMM's fused epilogue compute it */
static inline float tm_silu_mul1(float g, float u) { return g / (1.0f + tm_expf(-g)) * u; }

#endif
