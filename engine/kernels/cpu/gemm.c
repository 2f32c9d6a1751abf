/*
 * Linear layers on the CPU: y[M, N] (+)= x[M, K] W^T, with W pre-packed at load time.
 *
 * Weights are packed once into panels of TM_NR output features (TM_NR = 2 vectors:
 * 32 floats with AVX-512, 16 with AVX2 or plain C), each panel holding its K rows
 * contiguously, so a panel streams from memory in one pass with no per-call packing
 * (the cost that makes a BLAS call slow at small M). A register-blocked micro-kernel
 * (Goto & van de Geijn 2008, "Anatomy of high-performance matrix multiplication";
 * the BLIS micro-kernel design) keeps an MR x TM_NR tile of y in registers across a
 * slice of K: each step loads one panel row (2 vectors) and broadcasts MR values of x, for
 * 2 * MR fused multiply-adds. fp32 panels are walked in K slices that stay in L1 while every
 * tile of the row block runs over them (panel_rows), the tiles carrying their sums from slice
 * to slice. Every row sums over k in one order whatever the tile's height, so the GEMM is
 * batch-invariant: a row's result does not depend on the other rows of the call (see KSPLIT).
 * Rows are taken in blocks of up to TM_MC_MAX (quantized kinds: also within TM_MC_BYTES of x
 * in L2), and the work is cut into (row block, panel group) chunks handed out by the thread
 * pool; each panel prefetches the next one while it runs (lane_group).
 *
 * The LM head of a step whose rows are all plain greedy can end in an argmax epilogue instead of
 * the store (tm_gemm_f32_argmax, tm_gemm_q_argmax): each tile's values, the ones the store would
 * write, are compared against the running best of its rows, and the [m, vocab] logits (12.6 MB
 * for 64 rows of a 49,152-token vocabulary) are never written nor read back by a sampler.
 *
 * Weight formats (the `kind` of a packed matrix):
 *   TM_W_F32  fp32 values.
 *   TM_W_BF16 bf16 values in pairs of K: each call rounds x to bf16 once (round to nearest even,
 *             denormals to zero: VCVTNE2PS2BF16's definition) and sums the exact bf16 x bf16
 *             products in fp32. With AVX512-BF16 one VDPBF16PS takes a broadcast pair of x and
 *             a vector of weight pairs (two k of 16 columns); elsewhere the pairs are widened to
 *             fp32 in registers and run through FMAs (the same products, summed one k at a time).
 *             Panels hold cdiv(K, 2) pair rows of TM_NR columns, column-pairs contiguous, so one
 *             pair row takes as many bytes as one fp32 row and is walked in the same K slices.
 *             With AMX-BF16 (Xeon since Sapphire Rapids), a weight whose K is a multiple of 32 runs
 *             every call on tiles instead (amx_bf16_rows): a panel's pair rows are TDPBF16PS's B
 *             operand as they lie, x's bf16 rows its A, and the fp32 sums stay in the tiles over
 *             all of K (Intel SDM vol. 2, TDPBF16PS; Intel's Optimization Reference Manual, the AMX
 *             chapter, for the 2 x 2 blocking and interleaving loads with products).
 *   TM_W_Q8   int8 codes, a scale per (column, group of gs rows of K): w = q * s.
 *   TM_W_Q4   4-bit codes 0..15 with a scale and a min per group: w = q * s + m
 *             (GGUF Q4_0/Q4_1 and our int4; Q8 may carry a min too).
 * int8 codes are widened and scaled in registers inside the micro-kernel and never
 * written to memory as floats (as llama.cpp's CPU kernels do); codes are read in place,
 * so a step reads 1 (int8) or 0.5 (int4) bytes per weight plus the scales.
 *
 * 4-bit weights take integer arithmetic instead (the Q4 x Q8 dot product of llama.cpp's CPU
 * backend): each call quantizes x to int8 per row and group of gs columns (qa = round(x / sa),
 * sa = max|x| / 127 over the group), multiplies the unsigned 4-bit codes by the signed activation
 * codes exactly in int32 within a group (vpmaddubsw + vpmaddwd on AVX2, vpdpbusd with VNNI, int
 * loops in plain C), and scales once per group:
 *     y[r, n] = sum_g  s[n, g] sa[r, g] (sum_{k in g} q[n, k] qa[r, k])  +  m[n, g] sx[r, g]
 * where sx[r, g] is the fp32 sum of the group's x (the min's term is not rounded to int8).
 * One 256-bit vpmaddubsw does 32 multiplies where the fp32 path widens, converts and scales
 * every code before its FMA; the activations' rounding costs a little perplexity
 * (benchmarks/results/epyc-zen3-avx2/quality-gguf.json). A row's codes, scales and sums depend on
 * that row alone, so the result stays batch-invariant.
 *
 * Packed quantized panel layout, per panel of TM_NR columns, per group g:
 *   float s[TM_NR]; float m[TM_NR] (if has_min); codes for the group's gs rows of K:
 *   Q8: gs x TM_NR int8;  Q4: gs / 4 blocks of 4 rows of K, TM_NR * 2 bytes each: byte
 *   4 c + i of block t holds column c (low nibble) and column c + TM_NR/2 (high nibble) at
 *   k = 4 t + i, c < TM_NR/2, so one vector load, a mask and a shift give the 4 consecutive
 *   codes of each column that vpmaddubsw / vpdpbusd take per 32-bit lane.
 */
#include "tm_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TM_W_F32 0
#define TM_W_Q8 1
#define TM_W_Q4 2
#define TM_W_BF16 3

#if defined(TM_HAVE_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TM_AMX_BF16 1 /* TM_W_BF16 GEMMs on AMX-BF16 tiles (amx_bf16_rows) */
#include <stdatomic.h>
#endif

#if defined(TM_AVX512)
#define VL 16
typedef __m512 vf;
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_SET1(x) _mm512_set1_ps(x)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_ZERO() _mm512_setzero_ps()
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define TM_MR 12
#elif defined(TM_AVX2)
#define VL 8
typedef __m256 vf;
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_SET1(x) _mm256_set1_ps(x)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_ZERO() _mm256_setzero_ps()
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define TM_MR 6
#else
#define VL 8
#define TM_MR 4
#endif
#define TM_NR (2 * VL)
#define TM_MC_BYTES (256 * 1024) /* quantized kinds: a row block of x stays in L2 */
#define TM_MC_MAX 256            /* the tallest row block (rows of x per chunk) */
/* fp32: the K slice of a panel that stays in L1 beside a tile's rows of x (see panel_rows): 192 rows
 * of K with AVX-512 (L1 48 KB on the Xeons measured), 256 with AVX2 (32 KB on Zen 3) */
#if defined(TM_AVX512)
#define TM_KC_BYTES (24 * 1024)
#else
#define TM_KC_BYTES (16 * 1024)
#endif
#define TM_KC (TM_KC_BYTES / (TM_NR * (int)sizeof(float)))

int tm_gemm_nr(void) { return TM_NR; }
int tm_gemm_mr(void) { return TM_MR; }

/* Which instruction set this build's kernels use: 2 AVX-512, 1 AVX2, 0 plain C. */
int tm_isa(void) {
#if defined(TM_AVX512)
    return 2;
#elif defined(TM_AVX2)
    return 1;
#else
    return 0;
#endif
}

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---------------------------------------------------------------- packing */

int64_t tm_pack_f32_size(int64_t n, int64_t k) { return cdiv(n, TM_NR) * k * TM_NR * (int64_t)sizeof(float); }

/* w [n, k] row-major (ldw >= k) -> panels [ceil(n / NR)][k][NR], zero-padded columns. */
void tm_pack_f32(const float *w, int64_t ldw, int64_t n, int64_t k, float *out) {
    const int64_t np = cdiv(n, TM_NR);
    for (int64_t p = 0; p < np; ++p) {
        float *dst = out + p * k * TM_NR;
        for (int64_t j = 0; j < TM_NR; ++j) {
            const int64_t col = p * TM_NR + j;
            if (col < n) {
                const float *src = w + col * ldw;
                for (int64_t kk = 0; kk < k; ++kk) dst[kk * TM_NR + j] = src[kk];
            } else {
                for (int64_t kk = 0; kk < k; ++kk) dst[kk * TM_NR + j] = 0.0f;
            }
        }
    }
}

int64_t tm_pack_bf16_size(int64_t n, int64_t k) { return cdiv(n, TM_NR) * cdiv(k, 2) * TM_NR * 4; }

/* w [n, k] bf16 bits row-major (ldw >= k) -> panels [ceil(n / NR)][ceil(k / 2)][NR][2], zero-padded
 * columns and (odd k) a zero second half of the last pair. */
void tm_pack_bf16(const uint16_t *w, int64_t ldw, int64_t n, int64_t k, uint16_t *out) {
    const int64_t np = cdiv(n, TM_NR), kp = cdiv(k, 2);
    for (int64_t p = 0; p < np; ++p) {
        uint16_t *dst = out + p * kp * TM_NR * 2;
        for (int64_t j = 0; j < TM_NR; ++j) {
            const int64_t col = p * TM_NR + j;
            const uint16_t *src = col < n ? w + col * ldw : NULL;
            for (int64_t q = 0; q < kp; ++q) {
                dst[(q * TM_NR + j) * 2] = src ? src[2 * q] : 0;
                dst[(q * TM_NR + j) * 2 + 1] = src && 2 * q + 1 < k ? src[2 * q + 1] : 0;
            }
        }
    }
}

/* x [k] fp32 -> out [2 cdiv(k, 2)] bf16 bits, the last odd element's pair padded with 0 */
static void row_to_bf16(const float *x, int64_t k, uint16_t *out) {
    int64_t i = 0;
#if defined(TM_AVX512) && defined(__AVX512BF16__)
    for (; i + 32 <= k; i += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512((void *)(out + i), (__m512i)v);
    }
#endif
    for (; i < k; ++i) out[i] = tm_float_to_bf16(x[i]);
    if (k & 1) out[k] = 0;
}

void tm_to_bf16(const float *x, int64_t ldx, int64_t m, int64_t k, uint16_t *out, int64_t ldo) {
    for (int64_t r = 0; r < m; ++r) row_to_bf16(x + r * ldx, k, out + r * ldo);
}

static inline int64_t q_group_bytes(int kind, int has_min, int64_t gs) {
    const int64_t codes = kind == TM_W_Q4 ? gs * TM_NR / 2 : gs * TM_NR;
    return (int64_t)sizeof(float) * TM_NR * (has_min ? 2 : 1) + codes;
}

int64_t tm_pack_q_size(int kind, int has_min, int64_t n, int64_t kpad, int64_t gs) {
    return cdiv(n, TM_NR) * (kpad / gs) * q_group_bytes(kind, has_min, gs);
}

/* Quantized weights in the layer's own layout -> packed panels (Q4: gs % 4 == 0).
 *   codes: Q8: int8 [n, kpad]; Q4: one code 0..15 per byte, uint8 [n, kpad] (the caller
 *          unpacks nibbles first, so the packing order here is independent of the source's).
 *   scale, min: float [n, kpad / gs] (min may be NULL).
 * Padding columns get scale 0 and min 0. Returns 0, or -1 if kpad % gs or (Q4) gs % 4. */
int tm_pack_q(int kind, const void *codes, const float *scale, const float *min, int64_t n, int64_t kpad,
              int64_t gs, void *out) {
    if (gs <= 0 || kpad % gs || (kind == TM_W_Q4 && gs % 4)) return -1;
    const int has_min = min != NULL;
    const int64_t np = cdiv(n, TM_NR), ng = kpad / gs, gb = q_group_bytes(kind, has_min, gs);
    for (int64_t p = 0; p < np; ++p) {
        for (int64_t g = 0; g < ng; ++g) {
            char *dst = (char *)out + (p * ng + g) * gb;
            float *s = (float *)dst;
            float *m = has_min ? s + TM_NR : NULL;
            unsigned char *c = (unsigned char *)(s + TM_NR * (has_min ? 2 : 1));
            for (int64_t j = 0; j < TM_NR; ++j) {
                const int64_t col = p * TM_NR + j;
                s[j] = col < n ? scale[col * ng + g] : 0.0f;
                if (m) m[j] = col < n ? min[col * ng + g] : 0.0f;
            }
            for (int64_t kk = 0; kk < gs; ++kk) {
                const int64_t kidx = g * gs + kk;
                if (kind == TM_W_Q8) {
                    for (int64_t j = 0; j < TM_NR; ++j) {
                        const int64_t col = p * TM_NR + j;
                        c[kk * TM_NR + j] = col < n ? ((const unsigned char *)codes)[col * kpad + kidx] : 0;
                    }
                } else {
                    for (int64_t j = 0; j < TM_NR / 2; ++j) {
                        const int64_t c0 = p * TM_NR + j, c1 = c0 + TM_NR / 2;
                        const unsigned char lo = c0 < n ? ((const unsigned char *)codes)[c0 * kpad + kidx] & 15 : 0;
                        const unsigned char hi = c1 < n ? ((const unsigned char *)codes)[c1 * kpad + kidx] & 15 : 0;
                        c[(kk / 4) * TM_NR * 2 + j * 4 + kk % 4] = (unsigned char)(lo | (hi << 4));
                    }
                }
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- epilogue */

/* tile [mr][TM_NR] -> y rows (ldy), ncols valid columns starting at column n0:
 * y = tile (+ bias[n0 + j]) (+ y if accumulate). */
static inline void store_tile(const float *tile, int mr, int ncols, float *y, int64_t ldy, const float *bias,
                              int accumulate) {
    for (int r = 0; r < mr; ++r) {
        float *yr = y + r * ldy;
        const float *t = tile + r * TM_NR;
#if defined(TM_AVX512) || defined(TM_AVX2)
        if (ncols == TM_NR) {
            for (int v = 0; v < 2; ++v) {
                vf val = V_LOAD(t + v * VL);
                if (bias) val = V_ADD(val, V_LOAD(bias + v * VL));
                if (accumulate) val = V_ADD(val, V_LOAD(yr + v * VL));
                V_STORE(yr + v * VL, val);
            }
            continue;
        }
#endif
        for (int j = 0; j < ncols; ++j) {
            float val = t[j];
            if (bias) val += bias[j];
            if (accumulate) val += yr[j];
            yr[j] = val;
        }
    }
}

/* tile [mr][TM_NR] of logits (columns n0.., ncols valid) -> each row's running best (value, column)
 * of this chunk; a column wins only if strictly greater, so the first of equal maxima is kept
 * (columns arrive in increasing order within a chunk) and a NaN never wins. */
static void argmax_tile(const float *tile, int mr, int ncols, int64_t n0, int64_t row0, const float *bias,
                        int64_t n_limit, const int64_t *ban, int64_t nban, float *best_val, int64_t *best_idx) {
    int64_t lim = n_limit - n0;
    if (lim > ncols) lim = ncols;
    if (lim <= 0) return;
    for (int r = 0; r < mr; ++r) {
        float v[TM_NR];
        const float *t = tile + r * TM_NR;
        for (int j = 0; j < TM_NR; ++j) v[j] = j < lim ? (bias ? t[j] + bias[j] : t[j]) : -INFINITY;
        if (nban) {
            const int64_t *b = ban + (row0 + r) * nban;
            for (int64_t i = 0; i < nban; ++i)
                if (b[i] >= n0 && b[i] < n0 + TM_NR) v[b[i] - n0] = -INFINITY;
        }
        float best = best_val[row0 + r];
        int64_t bi = -1;
        for (int j = 0; j < TM_NR; ++j)
            if (v[j] > best) {
                best = v[j];
                bi = j;
            }
        if (bi >= 0) {
            best_val[row0 + r] = best;
            best_idx[row0 + r] = n0 + bi;
        }
    }
}

/* ---------------------------------------------------------------- micro-kernels */

#if defined(TM_AVX512) || defined(TM_AVX2)

/* k accumulators per tile row. One for every tile height, so that a row's sum runs over k in the
 * same order whatever tile (and so whatever batch) it lands in: a token's output is bit for bit the
 * same in a 2-row decode step and in a 10-row verification step, which speculative decoding's
 * exact match with plain decoding rests on. Interleaved accumulators for short tiles (4 for one
 * row, 2 for two or three) changed the order with the tile height; measured on a 2-core Xeon
 * (AVX-512), 30 layers of SmolLM2 shapes, cold, M = 1-3, fp32, int8 and int4 weights: they gained
 * nothing there (these steps wait on memory, not on FMA latency). */
#define KSPLIT(mr) 1

/* An fp32 tile [mr][TM_NR] held as acc[mr][2] vectors: loaded from `tile` (load) or zeroed, and stored. */
#define TILE_LOAD(acc, mr, tile, load)                                                     \
    _Pragma("GCC unroll 12") for (int r_ = 0; r_ < (mr); ++r_) {                            \
        (acc)[r_][0] = (load) ? V_LOAD((tile) + r_ * TM_NR) : V_ZERO();                    \
        (acc)[r_][1] = (load) ? V_LOAD((tile) + r_ * TM_NR + VL) : V_ZERO();               \
    }
#define TILE_STORE(acc, mr, tile)                                                          \
    _Pragma("GCC unroll 12") for (int r_ = 0; r_ < (mr); ++r_) {                            \
        V_STORE((tile) + r_ * TM_NR, (acc)[r_][0]);                                        \
        V_STORE((tile) + r_ * TM_NR + VL, (acc)[r_][1]);                                   \
    }

/* A micro-kernel call's share of the next panel (pf_len bytes), spread over its `steps` steps of k:
 * runs of *seg steps, each after *per prefetched 64-byte lines, so that the steps' loop has no branch
 * but its own. Runs of at least 16 steps (benchmarks/gemm_ab.py measured shorter and longer runs,
 * and one line checked at every step, slower on a 2-core Xeon). */
TM_INLINE void prefetch_plan(int64_t pf_len, int64_t steps, int64_t *seg, int64_t *per) {
    const int64_t lines = (pf_len + 63) / 64;
    *seg = lines > 0 && steps / lines > 16 ? steps / lines : 16;
    *per = (lines * *seg + steps - 1) / (steps > 0 ? steps : 1);
}

/* tile [mr][TM_NR] = (tile if load, else 0) + rows a (stride lda) times k rows of panel b, the rows'
 * sums running over k in order (one FMA chain per tile element; see KSPLIT). panel_rows calls it on
 * one K slice at a time and carries the sums in the tile between slices: storing and reloading an
 * fp32 value is exact, so the slices give the same bits as one pass over K. */
TM_INLINE void ukr_f32(const int mr, int64_t k, const float *restrict a, int64_t lda, const float *restrict b,
                       float *restrict tile, const int load, const char *pf, int64_t pf_len) {
    vf acc[TM_MR][2];
    TILE_LOAD(acc, mr, tile, load);
    int64_t seg, per;
    prefetch_plan(pf_len, k, &seg, &per);
    int64_t kk = 0, off = 0;
    while (kk < k) {
        for (int64_t i = 0; i < per && off < pf_len; ++i, off += 64) __builtin_prefetch(pf + off, 0, 2);
        const int64_t kend = kk + seg < k ? kk + seg : k;
        for (; kk < kend; ++kk) {
            const float *bk = b + kk * TM_NR;
            const vf b0 = V_LOAD(bk), b1 = V_LOAD(bk + VL);
#pragma GCC unroll 12
            for (int r = 0; r < mr; ++r) {
                const vf x = V_BCAST(a + r * lda + kk);
                acc[r][0] = V_FMA(x, b0, acc[r][0]);
                acc[r][1] = V_FMA(x, b1, acc[r][1]);
            }
        }
    }
    TILE_STORE(acc, mr, tile);
}

/* bf16 panel: tile [mr][TM_NR] = (tile if load, else 0) + rows a (bf16 pairs, stride lda pairs) times
 * kp pair rows of panel b; one chain per tile element, in k order, as ukr_f32 (batch invariance). */
TM_INLINE void ukr_bf16(const int mr, int64_t kp, const uint32_t *restrict a, int64_t lda,
                        const uint16_t *restrict b, float *restrict tile, const int load, const char *pf,
                        int64_t pf_len) {
    vf acc[TM_MR][2];
    TILE_LOAD(acc, mr, tile, load);
    int64_t seg, per;
    prefetch_plan(pf_len, kp, &seg, &per);
    int64_t q = 0, off = 0;
    while (q < kp) {
        for (int64_t i = 0; i < per && off < pf_len; ++i, off += 64) __builtin_prefetch(pf + off, 0, 2);
        const int64_t qend = q + seg < kp ? q + seg : kp;
        for (; q < qend; ++q) {
            const uint16_t *bq = b + q * TM_NR * 2;
#if defined(TM_AVX512) && defined(__AVX512BF16__)
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)bq);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(bq + TM_NR));
#pragma GCC unroll 12
            for (int r = 0; r < mr; ++r) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[r * lda + q]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
            }
#else
            /* widen: the even k of a 32-bit pair is its low half, the odd k its high half */
#if defined(TM_AVX512)
            const __m512i w0 = _mm512_loadu_si512((const void *)bq), w1 = _mm512_loadu_si512((const void *)(bq + TM_NR));
            const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
            const vf e0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)), o0 = _mm512_castsi512_ps(_mm512_and_si512(w0, hi));
            const vf e1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)), o1 = _mm512_castsi512_ps(_mm512_and_si512(w1, hi));
#else
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)bq), w1 = _mm256_loadu_si256((const __m256i *)(bq + TM_NR));
            const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
            const vf e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, hi));
            const vf e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, hi));
#endif
#pragma GCC unroll 12
            for (int r = 0; r < mr; ++r) {
                const uint32_t pair = a[r * lda + q];
                const vf xe = V_SET1(tm_bf16_to_float((uint16_t)pair)), xo = V_SET1(tm_bf16_to_float((uint16_t)(pair >> 16)));
                acc[r][0] = V_FMA(xo, o0, V_FMA(xe, e0, acc[r][0]));
                acc[r][1] = V_FMA(xo, o1, V_FMA(xe, e1, acc[r][1]));
            }
#endif
        }
    }
    TILE_STORE(acc, mr, tile);
}

/* One row of int8 codes (TM_NR columns) widened to two fp32 vectors. */
TM_INLINE void load_q8(const unsigned char *c, vf *b0, vf *b1) {
#if defined(TM_AVX512)
    *b0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
    *b1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
#else
    const __m128i x = _mm_loadu_si128((const __m128i *)c);
    *b0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    *b1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
#endif
}

/* int8-code panel: groups of gs rows, each with its scale (and min) vectors; codes are
 * dequantized in registers, w = q * s (+ m), then used by all mr rows. k <= ng * gs is the
 * number of real rows of K (the last group may be padded). */
TM_INLINE void ukr_q8(const int has_min, const int mr, int64_t k, int64_t gs, const float *restrict a, int64_t lda,
                      const char *restrict b, float *restrict tile, const char *pf, int64_t pf_len) {
    const int ks = KSPLIT(mr);
    const int64_t row_bytes = TM_NR;
    const int64_t gb = q_group_bytes(TM_W_Q8, has_min, gs);
    vf acc[4][TM_MR][2];
#pragma GCC unroll 4
    for (int s = 0; s < ks; ++s)
#pragma GCC unroll 12
        for (int r = 0; r < mr; ++r) acc[s][r][0] = acc[s][r][1] = V_ZERO();
    for (int64_t g0 = 0; g0 < k; g0 += gs, b += gb) {
        const float *sc = (const float *)b;
        const vf s0 = V_LOAD(sc), s1 = V_LOAD(sc + VL);
        vf m0 = V_ZERO(), m1 = V_ZERO();
        if (has_min) {
            m0 = V_LOAD(sc + TM_NR);
            m1 = V_LOAD(sc + TM_NR + VL);
        }
        const unsigned char *codes = (const unsigned char *)(sc + TM_NR * (has_min ? 2 : 1));
        const int64_t n = k - g0 < gs ? k - g0 : gs;
        int64_t kk = 0;
        for (; kk + ks <= n; kk += ks) {
            const int64_t pk = (g0 + kk) * 32; /* half a line per step */
            if (pk < pf_len) __builtin_prefetch(pf + pk, 0, 2);
#pragma GCC unroll 4
            for (int s = 0; s < ks; ++s) {
                vf b0, b1;
                load_q8(codes + (kk + s) * row_bytes, &b0, &b1);
                if (has_min) {
                    b0 = V_FMA(b0, s0, m0);
                    b1 = V_FMA(b1, s1, m1);
                } else {
                    b0 = V_MUL(b0, s0);
                    b1 = V_MUL(b1, s1);
                }
                const float *ak = a + g0 + kk + s;
#pragma GCC unroll 12
                for (int r = 0; r < mr; ++r) {
                    const vf x = V_BCAST(ak + r * lda);
                    acc[s][r][0] = V_FMA(x, b0, acc[s][r][0]);
                    acc[s][r][1] = V_FMA(x, b1, acc[s][r][1]);
                }
            }
        }
        for (; kk < n; ++kk) {
            vf b0, b1;
            load_q8(codes + kk * row_bytes, &b0, &b1);
            if (has_min) {
                b0 = V_FMA(b0, s0, m0);
                b1 = V_FMA(b1, s1, m1);
            } else {
                b0 = V_MUL(b0, s0);
                b1 = V_MUL(b1, s1);
            }
            const float *ak = a + g0 + kk;
#pragma GCC unroll 12
            for (int r = 0; r < mr; ++r) {
                const vf x = V_BCAST(ak + r * lda);
                acc[0][r][0] = V_FMA(x, b0, acc[0][r][0]);
                acc[0][r][1] = V_FMA(x, b1, acc[0][r][1]);
            }
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; ++r) {
        vf t0 = acc[0][r][0], t1 = acc[0][r][1];
#pragma GCC unroll 4
        for (int s = 1; s < ks; ++s) {
            t0 = V_ADD(t0, acc[s][r][0]);
            t1 = V_ADD(t1, acc[s][r][1]);
        }
        V_STORE(tile + r * TM_NR, t0);
        V_STORE(tile + r * TM_NR + VL, t1);
    }
}

/* 4-bit codes times int8 activations (see the header). Vectors of TM_NR * 2 code bytes: 4 k of
 * TM_NR / 2 columns per nibble half. Without VNNI, two blocks' vpmaddubsw results (each pair
 * at most 2 * 15 * 127 = 3810) are added in int16 (at most 7620, no saturation) before one
 * vpmaddwd widens them to int32. */
#if defined(TM_AVX512)
typedef __m512i vq;
#define Q_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define Q_NIB_LO(v, m) _mm512_and_si512(v, m)
#define Q_NIB_HI(v, m) _mm512_and_si512(_mm512_srli_epi16(v, 4), m)
#define Q_SET8(x) _mm512_set1_epi8(x)
#define Q_SET16(x) _mm512_set1_epi16(x)
#define Q_SET32(x) _mm512_set1_epi32(x)
#define Q_ZERO() _mm512_setzero_si512()
#define Q_MADDUBS(w, x) _mm512_maddubs_epi16(w, x)
#define Q_ADD16(a, b) _mm512_add_epi16(a, b)
#define Q_MADD(a, b) _mm512_madd_epi16(a, b)
#define Q_ADD32(a, b) _mm512_add_epi32(a, b)
#define Q_CVT(v) _mm512_cvtepi32_ps(v)
#if defined(__AVX512VNNI__)
#define Q_VNNI 1
#define Q_DPBUSD(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#endif
#define TM_MR_Q4 4
#else
typedef __m256i vq;
#define Q_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define Q_NIB_LO(v, m) _mm256_and_si256(v, m)
#define Q_NIB_HI(v, m) _mm256_and_si256(_mm256_srli_epi16(v, 4), m)
#define Q_SET8(x) _mm256_set1_epi8(x)
#define Q_SET16(x) _mm256_set1_epi16(x)
#define Q_SET32(x) _mm256_set1_epi32(x)
#define Q_ZERO() _mm256_setzero_si256()
#define Q_MADDUBS(w, x) _mm256_maddubs_epi16(w, x)
#define Q_ADD16(a, b) _mm256_add_epi16(a, b)
#define Q_MADD(a, b) _mm256_madd_epi16(a, b)
#define Q_ADD32(a, b) _mm256_add_epi32(a, b)
#define Q_CVT(v) _mm256_cvtepi32_ps(v)
#if defined(__AVXVNNI__)
#define Q_VNNI 1
#define Q_DPBUSD(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#endif
#define TM_MR_Q4 4
#endif

/* 4 activation codes of a row as one 32-bit lane value, broadcast */
TM_INLINE vq bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return Q_SET32(v);
}

/* tile [mr][TM_NR] = x W^T for one Q4 panel b, from the rows' activation codes qa (stride ldq),
 * their group scales sa and group sums sx (stride ng); k real rows of K. */
TM_INLINE void ukr_q4(const int has_min, const int mr, int64_t k, int64_t gs, const int8_t *restrict qa,
                      int64_t ldq, const float *restrict sa, const float *restrict sx, int64_t ng,
                      const char *restrict b, float *restrict tile, const char *pf, int64_t pf_len) {
    const int64_t gb = q_group_bytes(TM_W_Q4, has_min, gs), bb = TM_NR * 2;
    const vq m4 = Q_SET8(15);
#if !defined(Q_VNNI)
    const vq ones = Q_SET16(1);
#endif
    vf facc[TM_MR_Q4][2];
#pragma GCC unroll 4
    for (int r = 0; r < mr; ++r) facc[r][0] = facc[r][1] = V_ZERO();
    const int64_t ngk = (k + gs - 1) / gs;
    int64_t pf_off = 0;
    for (int64_t g = 0; g < ngk; ++g, b += gb) {
        const float *sc = (const float *)b;
        const unsigned char *codes = (const unsigned char *)(sc + TM_NR * (has_min ? 2 : 1));
        const int64_t g0 = g * gs, nb = ((k - g0 < gs ? k - g0 : gs) + 3) / 4; /* blocks holding real k */
        if (pf_off < pf_len) { /* a share of the next panel per group, as the fp32 kernel spreads it */
            __builtin_prefetch(pf + pf_off, 0, 2);
            __builtin_prefetch(pf + pf_off + 64, 0, 2);
            pf_off += 128;
        }
        vq acc[TM_MR_Q4][2];
#pragma GCC unroll 4
        for (int r = 0; r < mr; ++r) acc[r][0] = acc[r][1] = Q_ZERO();
        const int8_t *ag = qa + g0;
        int64_t t = 0;
#if defined(Q_VNNI)
        for (; t < nb; ++t) {
            const vq w = Q_LOAD(codes + t * bb), w0 = Q_NIB_LO(w, m4), w1 = Q_NIB_HI(w, m4);
#pragma GCC unroll 4
            for (int r = 0; r < mr; ++r) {
                const vq x = bcast4(ag + r * ldq + 4 * t);
                acc[r][0] = Q_DPBUSD(acc[r][0], w0, x);
                acc[r][1] = Q_DPBUSD(acc[r][1], w1, x);
            }
        }
#else
        for (; t + 2 <= nb; t += 2) {
            const vq wa = Q_LOAD(codes + t * bb), wb = Q_LOAD(codes + (t + 1) * bb);
            const vq wa0 = Q_NIB_LO(wa, m4), wa1 = Q_NIB_HI(wa, m4);
            const vq wb0 = Q_NIB_LO(wb, m4), wb1 = Q_NIB_HI(wb, m4);
#pragma GCC unroll 4
            for (int r = 0; r < mr; ++r) {
                const vq xa = bcast4(ag + r * ldq + 4 * t), xb = bcast4(ag + r * ldq + 4 * t + 4);
                acc[r][0] = Q_ADD32(acc[r][0], Q_MADD(Q_ADD16(Q_MADDUBS(wa0, xa), Q_MADDUBS(wb0, xb)), ones));
                acc[r][1] = Q_ADD32(acc[r][1], Q_MADD(Q_ADD16(Q_MADDUBS(wa1, xa), Q_MADDUBS(wb1, xb)), ones));
            }
        }
        if (t < nb) {
            const vq w = Q_LOAD(codes + t * bb), w0 = Q_NIB_LO(w, m4), w1 = Q_NIB_HI(w, m4);
#pragma GCC unroll 4
            for (int r = 0; r < mr; ++r) {
                const vq x = bcast4(ag + r * ldq + 4 * t);
                acc[r][0] = Q_ADD32(acc[r][0], Q_MADD(Q_MADDUBS(w0, x), ones));
                acc[r][1] = Q_ADD32(acc[r][1], Q_MADD(Q_MADDUBS(w1, x), ones));
            }
        }
#endif
        const vf s0 = V_LOAD(sc), s1 = V_LOAD(sc + VL);
#pragma GCC unroll 4
        for (int r = 0; r < mr; ++r) {
            const vf d = V_SET1(sa[r * ng + g]);
            facc[r][0] = V_FMA(Q_CVT(acc[r][0]), V_MUL(s0, d), facc[r][0]);
            facc[r][1] = V_FMA(Q_CVT(acc[r][1]), V_MUL(s1, d), facc[r][1]);
        }
        if (has_min) {
            const vf m0 = V_LOAD(sc + TM_NR), m1 = V_LOAD(sc + TM_NR + VL);
#pragma GCC unroll 4
            for (int r = 0; r < mr; ++r) {
                const vf xs = V_SET1(sx[r * ng + g]);
                facc[r][0] = V_FMA(m0, xs, facc[r][0]);
                facc[r][1] = V_FMA(m1, xs, facc[r][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; ++r) {
        V_STORE(tile + r * TM_NR, facc[r][0]);
        V_STORE(tile + r * TM_NR + VL, facc[r][1]);
    }
}

#else /* plain C: the compiler vectorizes the j loops. build.py compiles this path with
       * -fno-associative-math -ffp-contract=off: otherwise the vectorizer orders (and fuses) the k
       * sums differently for different tile heights, and a row's result depends on the batch */

static void ukr_f32(const int mr, int64_t k, const float *restrict a, int64_t lda, const float *restrict b,
                    float *restrict tile, const int load, const char *pf, int64_t pf_len) {
    (void)pf;
    (void)pf_len;
    float acc[TM_MR][TM_NR];
    if (load)
        memcpy(acc, tile, sizeof(float) * mr * TM_NR);
    else
        memset(acc, 0, sizeof acc);
    for (int64_t kk = 0; kk < k; ++kk) {
        const float *bk = b + kk * TM_NR;
        for (int r = 0; r < mr; ++r) {
            const float x = a[r * lda + kk];
            for (int j = 0; j < TM_NR; ++j) acc[r][j] += x * bk[j];
        }
    }
    memcpy(tile, acc, sizeof(float) * mr * TM_NR);
}

static void ukr_bf16(const int mr, int64_t kp, const uint32_t *restrict a, int64_t lda, const uint16_t *restrict b,
                     float *restrict tile, const int load, const char *pf, int64_t pf_len) {
    (void)pf;
    (void)pf_len;
    float acc[TM_MR][TM_NR];
    if (load)
        memcpy(acc, tile, sizeof(float) * mr * TM_NR);
    else
        memset(acc, 0, sizeof acc);
    for (int64_t q = 0; q < kp; ++q) {
        const uint16_t *bq = b + q * TM_NR * 2;
        for (int r = 0; r < mr; ++r) {
            const uint32_t pair = a[r * lda + q];
            const float xe = tm_bf16_to_float((uint16_t)pair), xo = tm_bf16_to_float((uint16_t)(pair >> 16));
            for (int j = 0; j < TM_NR; ++j) {
                acc[r][j] += xe * tm_bf16_to_float(bq[2 * j]);
                acc[r][j] += xo * tm_bf16_to_float(bq[2 * j + 1]);
            }
        }
    }
    memcpy(tile, acc, sizeof(float) * mr * TM_NR);
}

static void ukr_q8(const int has_min, const int mr, int64_t k, int64_t gs, const float *restrict a, int64_t lda,
                   const char *restrict b, float *restrict tile, const char *pf, int64_t pf_len) {
    (void)pf;
    (void)pf_len;
    float acc[TM_MR][TM_NR];
    float w[TM_NR];
    memset(acc, 0, sizeof acc);
    const int64_t gb = q_group_bytes(TM_W_Q8, has_min, gs);
    for (int64_t g0 = 0; g0 < k; g0 += gs, b += gb) {
        const float *s = (const float *)b;
        const float *m = has_min ? s + TM_NR : NULL;
        const signed char *codes = (const signed char *)(s + TM_NR * (has_min ? 2 : 1));
        const int64_t n = k - g0 < gs ? k - g0 : gs;
        for (int64_t kk = 0; kk < n; ++kk) {
            const signed char *c = codes + kk * TM_NR;
            for (int j = 0; j < TM_NR; ++j) w[j] = m ? (float)c[j] * s[j] + m[j] : (float)c[j] * s[j];
            for (int r = 0; r < mr; ++r) {
                const float x = a[r * lda + g0 + kk];
                for (int j = 0; j < TM_NR; ++j) acc[r][j] += x * w[j];
            }
        }
    }
    memcpy(tile, acc, sizeof(float) * mr * TM_NR);
}

#define TM_MR_Q4 4
/* the int32 sums of the SIMD kernel in int loops, then the same fp32 steps per group */
static void ukr_q4(const int has_min, const int mr, int64_t k, int64_t gs, const int8_t *restrict qa, int64_t ldq,
                   const float *restrict sa, const float *restrict sx, int64_t ng, const char *restrict b,
                   float *restrict tile, const char *pf, int64_t pf_len) {
    (void)pf;
    (void)pf_len;
    float facc[TM_MR_Q4][TM_NR];
    int32_t acc[TM_MR_Q4][TM_NR];
    memset(facc, 0, sizeof facc);
    const int64_t gb = q_group_bytes(TM_W_Q4, has_min, gs), ngk = (k + gs - 1) / gs;
    for (int64_t g = 0; g < ngk; ++g, b += gb) {
        const float *s = (const float *)b;
        const float *m = has_min ? s + TM_NR : NULL;
        const unsigned char *codes = (const unsigned char *)(s + TM_NR * (has_min ? 2 : 1));
        const int64_t g0 = g * gs, nb = ((k - g0 < gs ? k - g0 : gs) + 3) / 4;
        memset(acc, 0, sizeof acc);
        for (int64_t t = 0; t < nb; ++t) {
            const unsigned char *c = codes + t * TM_NR * 2;
            for (int r = 0; r < mr; ++r) {
                const int8_t *x = qa + r * ldq + g0 + 4 * t;
                for (int j = 0; j < TM_NR / 2; ++j)
                    for (int i = 0; i < 4; ++i) {
                        acc[r][j] += (c[j * 4 + i] & 15) * x[i];
                        acc[r][j + TM_NR / 2] += (c[j * 4 + i] >> 4) * x[i];
                    }
            }
        }
        for (int r = 0; r < mr; ++r) {
            const float d = sa[r * ng + g], xs = sx[r * ng + g];
            for (int j = 0; j < TM_NR; ++j) {
                facc[r][j] = fmaf((float)acc[r][j], s[j] * d, facc[r][j]);
                if (m) facc[r][j] = fmaf(m[j], xs, facc[r][j]);
            }
        }
    }
    memcpy(tile, facc, sizeof(float) * mr * TM_NR);
}
#endif

/* ---------------------------------------------------------------- driver */

typedef struct {
    int kind, has_min;
    const float *x;
    int64_t ldx;
    const char *w;
    const float *bias;
    float *y;
    int64_t ldy;
    int64_t m, n, k, gs, panel_bytes;
    int64_t mc, kc, npanels, group, ngroups, lanes;
    int accumulate;
    /* greedy argmax instead of a store (tm_gemm_*_argmax): columns >= n_limit and each row's
     * nban banned columns (ban [m, nban], -1 = none) are skipped; every chunk keeps its rows'
     * best (value, column) in best_val / best_idx [ngroups, m] */
    int64_t n_limit, nban;
    const int64_t *ban;
    float *best_val;
    int64_t *best_idx;
    /* SwiGLU (tm_gemm_*_silu): W is a fused [gate | up] weight of 2 * silu_inter rows, silu_inter a
     * multiple of TM_NR; gate panel p and up panel p + silu_inter / TM_NR are run on the same rows
     * and y[:, p * TM_NR + j] = silu(gate) * up is stored (the [m, 2 * inter] product never is) */
    int64_t silu_inter;
    /* Q4 weights: the rows' int8 activation codes qa [m, ldq], group scales sa and exact group sums
     * sx [m, ng] (quantize_rows); mr: the tallest tile (TM_MR, or TM_MR_Q4 for Q4) */
    const int8_t *qa;
    const float *sa, *sx;
    int64_t ldq, ng;
    int mr;
    /* bf16 weights: the rows of x rounded to bf16, as pairs [m, ldxb] (to_bf16_rows; on AMX, rows
     * up to a multiple of 16, the extra ones zero); amx: every row block runs on AMX-BF16 tiles */
    const uint32_t *xb;
    int64_t ldxb;
    int amx;
} gemm_ctx;

/* one `case` per micro-kernel height 1 .. TM_MR (CASE(MR) expands to a case label and its call) */
#if TM_MR > 4
#define TM_MR_CASES_5_6(CASE) CASE(5) CASE(6)
#else
#define TM_MR_CASES_5_6(CASE)
#endif
#if TM_MR > 6
#define TM_MR_CASES_7_12(CASE) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#else
#define TM_MR_CASES_7_12(CASE)
#endif
#define TM_MR_CASES(CASE) CASE(1) CASE(2) CASE(3) CASE(4) TM_MR_CASES_5_6(CASE) TM_MR_CASES_7_12(CASE)

#define UKR_CASE(MR)                                                                                   \
    case MR:                                                                                           \
        if (c->kind == TM_W_Q8 && c->has_min)                                                          \
            ukr_q8(1, MR, c->k, c->gs, a, c->ldx, bp, tile, pf, pf_len);                               \
        else if (c->kind == TM_W_Q8)                                                                   \
            ukr_q8(0, MR, c->k, c->gs, a, c->ldx, bp, tile, pf, pf_len);                               \
        else if (MR <= TM_MR_Q4 && c->has_min)                                                         \
            ukr_q4(1, MR <= TM_MR_Q4 ? MR : 1, c->k, c->gs, qa, c->ldq, sa, sx, c->ng, bp, tile, pf, pf_len); \
        else if (MR <= TM_MR_Q4)                                                                       \
            ukr_q4(0, MR <= TM_MR_Q4 ? MR : 1, c->k, c->gs, qa, c->ldq, sa, sx, c->ng, bp, tile, pf, pf_len); \
        break;

/* tile [mr][TM_NR] = rows r .. r + mr - 1 of x times quantized panel bp; pf / pf_len: the share of
 * the next panel this tile prefetches */
static void run_tile(const gemm_ctx *c, int mr, int64_t r, const char *bp, float *tile, const char *pf,
                     int64_t pf_len) {
    const float *a = c->x + r * c->ldx;
    const int8_t *qa = c->qa ? c->qa + r * c->ldq : NULL;
    const float *sa = c->sa ? c->sa + r * c->ng : NULL, *sx = c->sx ? c->sx + r * c->ng : NULL;
    switch (mr) {
        TM_MR_CASES(UKR_CASE)
        default:
            break;
    }
}

/* tile_g, tile_u [mr][TM_NR] (+ their bias) -> y = silu(g) * u, ncols valid columns */
static inline void store_silu(float *restrict tg, float *restrict tu, int mr, int ncols, float *y, int64_t ldy,
                              const float *bg, const float *bu) {
    for (int r = 0; r < mr; ++r) {
        float *restrict g = tg + r * TM_NR, *restrict u = tu + r * TM_NR;
        if (bg)
            for (int j = 0; j < ncols; ++j) {
                g[j] += bg[j];
                u[j] += bu[j];
            }
        /* a whole row in one fixed-length loop, which the compiler vectorizes as tm_silu_mul's */
        float o[TM_NR];
        for (int j = 0; j < TM_NR; ++j) o[j] = tm_silu_mul1(g[j], u[j]);
        memcpy(y + r * ldy, o, sizeof(float) * (size_t)ncols);
    }
}

/* The panel group of the j-th chunk of a row block. T threads take chunks in turn from the pool's
 * counter, so a thread's next chunk is usually j + T: chunk j goes to lane j % T, and each lane holds
 * a run of adjacent groups, so that such a thread walks adjacent panels and the last panel of a
 * chunk prefetches the first of the thread's next one (a chunk taken out of turn is still right,
 * only not prefetched). Measured with benchmarks/gemm_ab.py on a 2-core Xeon (AVX-512), 30 layers
 * of SmolLM2 shapes and the LM head, cold, with the K slices below: +1-4% at M = 32-128 over
 * groups in order. */
static inline int64_t lane_group(int64_t j, int64_t groups, int64_t lanes) {
    if (lanes <= 1) return j;
    const int64_t lane = j % lanes, pos = j / lanes;
    int64_t start = 0;
    for (int64_t l = 0; l < lane; ++l) start += (groups - l + lanes - 1) / lanes;
    return start + pos;
}

#define F32_CASE(MR)                                                                                  \
    case MR:                                                                                          \
        ukr_f32(MR, kc, a, lda, b, tile, load, pf, pf_len);                                          \
        break;

#define BF16_CASE(MR)                                                                                 \
    case MR:                                                                                          \
        ukr_bf16(MR, kc, a, lda, b, tile, load, pf, pf_len);                                         \
        break;

static void bf16_tile(int mr, int64_t kc, const uint32_t *a, int64_t lda, const uint16_t *b, float *tile, int load,
                      const char *pf, int64_t pf_len) {
    switch (mr) {
        TM_MR_CASES(BF16_CASE)
        default:
            break;
    }
}

static void f32_tile(int mr, int64_t kc, const float *a, int64_t lda, const float *b, float *tile, int load,
                     const char *pf, int64_t pf_len) {
    switch (mr) {
        TM_MR_CASES(F32_CASE)
        default:
            break;
    }
}

#if defined(TM_AMX_BF16)
/* acc [m1 - m0 rounded up to 16][TM_NR] = rows m0 .. m1 - 1 of the bf16 rows xb (stride ldxb pairs, rows
 * up to the next multiple of 16 readable) times the bf16 panel b of kp pair rows (kp a multiple of 16),
 * on AMX-BF16 tiles (tm_tiles_16x64 loaded): tmm0-3 the fp32 sums C[i][j] of a block of 32 rows
 * (rows 16 i.., columns 16 j..), tmm4-5 A = 16 rows x 16 pairs of xb read in place, tmm6-7 B = 16
 * pair rows of the panel at its stride of TM_NR pairs, columns 0-15 and 16-31: a panel's pair rows are
 * already TDPBF16PS's B layout (pairs of k per column). One TDPBF16PS per C tile per 32 k, in k order,
 * and the sums stay in the tiles over all of K, so a row's result is the same whichever block and tile
 * it lands in (the call's other rows only fill the other tile rows). Each 32 k's B tiles serve both
 * A tiles. pf / pf_len: the next panel, prefetched spread over the blocks' steps. */
static void amx_bf16_rows(const uint32_t *xb, int64_t ldxb, int64_t m0, int64_t m1, int64_t kp, const uint16_t *b,
                          float *acc, int64_t ldc, int init, const char *pf, int64_t pf_len) {
    const int64_t lda = ldxb * 4, nsteps = (m1 - m0 + 31) / 32 * (kp / 16);
    const int64_t per = ((pf_len + nsteps - 1) / (nsteps > 0 ? nsteps : 1) + 63) / 64 * 64;
    int64_t off = 0;
    for (int64_t r = m0; r < m1; r += 32) {
        const char *a = (const char *)(xb + r * ldxb);
        float *t = acc + (r - m0) * ldc;
        if (init) {
            _tile_loadd(0, t, ldc * 4);
            _tile_loadd(1, t + 16, ldc * 4);
        } else {
            _tile_zero(0);
            _tile_zero(1);
        }
        if (m1 - r > 16) {
            if (init) {
                _tile_loadd(2, t + 16 * ldc, ldc * 4);
                _tile_loadd(3, t + 16 * ldc + 16, ldc * 4);
            } else {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t q = 0; q < kp; q += 16) {
                for (const int64_t end = off + per; off < end && off < pf_len; off += 64) __builtin_prefetch(pf + off, 0, 2);
                if (q + 16 < kp)
                    for (int i = 0; i < 32; ++i) __builtin_prefetch(a + i * lda + (q + 16) * 4, 0, 3);
                _tile_loadd(4, a + q * 4, lda);
                _tile_loadd(6, b + q * TM_NR * 2, TM_NR * 4);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, b + q * TM_NR * 2 + 32, TM_NR * 4);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, a + 16 * lda + q * 4, lda);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(2, t + 16 * ldc, ldc * 4);
            _tile_stored(3, t + 16 * ldc + 16, ldc * 4);
        } else {
            for (int64_t q = 0; q < kp; q += 16) {
                for (const int64_t end = off + per; off < end && off < pf_len; off += 64) __builtin_prefetch(pf + off, 0, 2);
                _tile_loadd(6, b + q * TM_NR * 2, TM_NR * 4);
                _tile_loadd(7, b + q * TM_NR * 2 + 32, TM_NR * 4);
                _tile_loadd(4, a + q * 4, lda);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
        }
        _tile_stored(0, t, ldc * 4);
        _tile_stored(1, t + 16, ldc * 4);
    }
}

/* y[m0 .. m1)[0 .. TM_NR) of one whole panel without a bias, straight from the tiles: (y if accumulate, else
 * 0) + the products, summed in the tiles. The rows past the last whole 16 go through a staging tile, with
 * the same arithmetic, so a row's result does not depend on where its block ends. */
static void amx_bf16_to_y(const uint32_t *xb, int64_t ldxb, int64_t m0, int64_t m1, int64_t kp, const uint16_t *b,
                          float *y, int64_t ldy, int accumulate, const char *pf, int64_t pf_len) {
    const int64_t mfull = m0 + (m1 - m0) / 16 * 16;
    if (mfull > m0) amx_bf16_rows(xb, ldxb, m0, mfull, kp, b, y, ldy, accumulate, pf, pf_len);
    if (mfull < m1) {
        float stage[16 * TM_NR] __attribute__((aligned(64)));
        const int64_t rows = m1 - mfull;
        if (accumulate)
            for (int64_t r = 0; r < rows; ++r) memcpy(stage + r * TM_NR, y + (mfull - m0 + r) * ldy, TM_NR * sizeof(float));
        amx_bf16_rows(xb, ldxb, mfull, m1, kp, b, stage, TM_NR, accumulate, NULL, 0);
        for (int64_t r = 0; r < rows; ++r) memcpy(y + (mfull - m0 + r) * ldy, stage + r * TM_NR, TM_NR * sizeof(float));
    }
}
#endif

/* acc [m1 - m0][TM_NR] = rows m0 .. m1 - 1 of x times panel bp, over all of K; pf / pf_len: the next
 * panel this chunk runs, prefetched in shares spread over the panel's micro-kernel calls.
 *
 * fp32 panels are walked in K slices of at most TM_KC rows (TM_KC_BYTES of the panel), each slice
 * through every tile of the row block before the next: the slice is read from L2 (where the
 * prefetch put it) by the first tile and stays in L1 for the others, where a whole panel
 * (K x TM_NR floats, 72 KB at K = 576 with AVX-512) would be read from L2 by every tile (the loop
 * order of Goto & van de Geijn's GEMM, with the weights as its packed B). The tiles carry their
 * sums between slices (ukr_f32's load), so the result is bit for bit one pass over K. */
static void panel_rows(const gemm_ctx *c, int64_t m0, int64_t m1, const char *bp, float *acc, const char *pf,
                       int64_t pf_len) {
    const int mrt = c->mr;
    const int64_t ntiles = cdiv(m1 - m0, mrt);
#if defined(TM_AMX_BF16)
    if (c->amx) {
        amx_bf16_rows(c->xb, c->ldxb, m0, m1, c->k / 2, (const uint16_t *)bp, acc, TM_NR, 0, pf, pf_len);
        return;
    }
#endif
    if (c->kind == TM_W_BF16) { /* the same K slices, in pair rows (one pair row = one fp32 row's bytes) */
        const int64_t kp = cdiv(c->k, 2), nkc = cdiv(kp, c->kc);
        if (kp <= 0) {
            memset(acc, 0, sizeof(float) * (size_t)(m1 - m0) * TM_NR);
            return;
        }
        const int64_t share = (pf_len + ntiles * nkc - 1) / (ntiles * nkc);
        int64_t off = 0;
        for (int64_t q0 = 0; q0 < kp; q0 += c->kc) {
            const int64_t kc = kp - q0 < c->kc ? kp - q0 : c->kc;
            const uint16_t *b = (const uint16_t *)bp + q0 * TM_NR * 2;
            for (int64_t r = m0; r < m1; r += mrt, off += share) {
                const int64_t len = pf_len - off < share ? pf_len - off : share;
                bf16_tile(m1 - r < mrt ? (int)(m1 - r) : mrt, kc, c->xb + r * c->ldxb + q0, c->ldxb, b,
                          acc + (r - m0) * TM_NR, q0 > 0, pf + off, len > 0 ? len : 0);
            }
        }
        return;
    }
    if (c->kind != TM_W_F32) {
        const int64_t share = (pf_len + ntiles - 1) / ntiles;
        for (int64_t r = m0, t = 0; r < m1; r += mrt, ++t) {
            const int64_t off = t * share, len = pf_len - off < share ? pf_len - off : share;
            run_tile(c, m1 - r < mrt ? (int)(m1 - r) : mrt, r, bp, acc + (r - m0) * TM_NR, pf + off, len > 0 ? len : 0);
        }
        return;
    }
    const int64_t k = c->k, nkc = cdiv(k, c->kc);
    if (k <= 0) {
        memset(acc, 0, sizeof(float) * (size_t)(m1 - m0) * TM_NR);
        return;
    }
    const int64_t share = (pf_len + ntiles * nkc - 1) / (ntiles * nkc);
    int64_t off = 0;
    for (int64_t k0 = 0; k0 < k; k0 += c->kc) {
        const int64_t kc = k - k0 < c->kc ? k - k0 : c->kc;
        const float *b = (const float *)bp + k0 * TM_NR;
        for (int64_t r = m0; r < m1; r += mrt, off += share) {
            const int64_t len = pf_len - off < share ? pf_len - off : share;
            f32_tile(m1 - r < mrt ? (int)(m1 - r) : mrt, kc, c->x + r * c->ldx + k0, c->ldx, b,
                     acc + (r - m0) * TM_NR, k0 > 0, pf + off, len > 0 ? len : 0);
        }
    }
}

/* The (row block, panel group) of a chunk: row blocks outer, so that a block's rows of x stay in L2 while the
 * threads walk the panels; on AMX panel groups outer instead, so that a group's panels stay in L2 while the
 * row blocks (bf16 x, half the bytes) pass over them, and the weights come from memory once per call. */
static inline void chunk_at(const gemm_ctx *c, int64_t chunk, int64_t *mb, int64_t *grp) {
    const int64_t mblocks = cdiv(c->m, c->mc);
    if (c->amx && mblocks > 1) {
        *mb = chunk % mblocks;
        *grp = chunk / mblocks;
        return;
    }
    *mb = chunk / c->ngroups;
    *grp = lane_group(chunk % c->ngroups, c->ngroups, c->lanes);
}

/* SwiGLU: the gate panel's rows first (kept in gbuf, prefetching the up panel), then the up panel's
 * (prefetching the next gate panel), then silu(gate) * up stored */
static void gemm_chunk_silu(const gemm_ctx *c, int64_t chunk) {
    int64_t mb, grp;
    chunk_at(c, chunk, &mb, &grp);
    const int64_t m0 = mb * c->mc, m1 = m0 + c->mc < c->m ? m0 + c->mc : c->m;
    const int64_t p0 = grp * c->group, p1 = p0 + c->group < c->npanels ? p0 + c->group : c->npanels;
    const int64_t up = c->silu_inter / TM_NR; /* panel offset of the up half */
    float gbuf[TM_MC_MAX * TM_NR] __attribute__((aligned(64)));
    float ubuf[TM_MC_MAX * TM_NR] __attribute__((aligned(64)));
    for (int64_t p = p0; p < p1; ++p) {
        const char *bg = c->w + p * c->panel_bytes, *bu = c->w + (p + up) * c->panel_bytes;
        const int64_t n0 = p * TM_NR;
        const int ncols = c->silu_inter - n0 < TM_NR ? (int)(c->silu_inter - n0) : TM_NR;
        const float *biasg = c->bias ? c->bias + n0 : NULL, *biasu = c->bias ? c->bias + c->silu_inter + n0 : NULL;
        panel_rows(c, m0, m1, bg, gbuf, bu, c->panel_bytes);
        panel_rows(c, m0, m1, bu, ubuf, bg + c->panel_bytes, p + 1 < c->npanels ? c->panel_bytes : 0);
        store_silu(gbuf, ubuf, (int)(m1 - m0), ncols, c->y + m0 * c->ldy + n0, c->ldy, biasg, biasu);
    }
}

static void gemm_chunk_panels(const gemm_ctx *c, int64_t chunk) {
    int64_t mb, grp;
    chunk_at(c, chunk, &mb, &grp);
    const int64_t m0 = mb * c->mc, m1 = m0 + c->mc < c->m ? m0 + c->mc : c->m;
    const int64_t p0 = grp * c->group, p1 = p0 + c->group < c->npanels ? p0 + c->group : c->npanels;
    float acc[TM_MC_MAX * TM_NR] __attribute__((aligned(64)));
    float *bv = c->best_val ? c->best_val + grp * c->m : NULL;
    int64_t *bix = c->best_idx ? c->best_idx + grp * c->m : NULL;
    if (bv)
        for (int64_t r = m0; r < m1; ++r) {
            bv[r] = -INFINITY;
            bix[r] = 0;
        }
    for (int64_t p = p0; p < p1; ++p) {
        const char *bp = c->w + p * c->panel_bytes;
        const int64_t n0 = p * TM_NR;
        const int ncols = c->n - n0 < TM_NR ? (int)(c->n - n0) : TM_NR;
        const float *bias = c->bias ? c->bias + n0 : NULL;
#if defined(TM_AMX_BF16)
        if (c->amx && !bias && !bv && ncols == TM_NR) { /* whole panels without a bias: the tiles into y */
            amx_bf16_to_y(c->xb, c->ldxb, m0, m1, c->k / 2, (const uint16_t *)bp, c->y + m0 * c->ldy + n0, c->ldy,
                          c->accumulate, bp + c->panel_bytes, p + 1 < c->npanels ? c->panel_bytes : 0);
            continue;
        }
#endif
        /* the panel's calls prefetch the next panel (past the chunk's end too: see lane_group), so
         * that its first tile finds it in cache instead of waiting on memory */
        panel_rows(c, m0, m1, bp, acc, bp + c->panel_bytes, p + 1 < c->npanels ? c->panel_bytes : 0);
        if (bv)
            argmax_tile(acc, (int)(m1 - m0), ncols, n0, m0, bias, c->n_limit, c->ban, c->nban, bv, bix);
        else
            store_tile(acc, (int)(m1 - m0), ncols, c->y + m0 * c->ldy + n0, c->ldy, bias, c->accumulate);
    }
}

static void gemm_chunk(void *vctx, int64_t chunk) {
    const gemm_ctx *c = (const gemm_ctx *)vctx;
#if defined(TM_AMX_BF16)
    if (c->amx) _tile_loadconfig(&tm_tiles_16x64); /* per chunk: the pool's threads and the caller each run chunks */
#endif
    if (c->silu_inter)
        gemm_chunk_silu(c, chunk);
    else
        gemm_chunk_panels(c, chunk);
#if defined(TM_AMX_BF16)
    if (c->amx) _tile_release();
#endif
}

/* sum of x[0 .. n), added in index order. Kept out of the vectorizer: with -fassociative-math
 * its order can follow x's alignment (a peeled prologue), and x's address changes with a row's
 * place in the batch and with a tensor-parallel shard's offset. (An 8-lane sum, fixed by n alone,
 * flipped a greedy token of tests/test_tensor_parallel.py::test_quantized_weights_under_tp[int4],
 * whose TP = 2 run adds the row-parallel halves in another order than TP = 1; the sequential sum
 * is what that test was measured with, and a group is 32 adds.) */
__attribute__((optimize("no-tree-vectorize"))) static float group_sum(const float *x, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += x[i];
    return sum;
}

/* One row's int8 activation codes for Q4 weights, per group of gs columns (see the header):
 * sa = max|x| / 127, q = round(x / sa) (half to even) in [-127, 127], sx = the group's fp32 sum;
 * q [ngk * gs] is 0 past k, so the kernels may run whole 4-column blocks. */
static void quantize_row_q4(const float *x, int64_t k, int64_t gs, int64_t ngk, int8_t *q, float *sa, float *sx) {
    for (int64_t g = 0; g < ngk; ++g) {
        const int64_t k0 = g * gs, n = k - k0 < gs ? k - k0 : gs;
        const float *xg = x + k0;
        const float amax = tm_absmax(xg, n);
        sa[g] = amax / 127.0f;
        sx[g] = group_sum(xg, n);
        /* through a volatile, as gemm_i8.c's quant_group: x * (127 / amax), never (x * 127) / amax */
        volatile float inv_v = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float inv = inv_v;
        int8_t *qg = q + k0;
        for (int64_t i = 0; i < n; ++i) {
            float v = rintf(xg[i] * inv);
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            qg[i] = (int8_t)v;
        }
        for (int64_t i = n; i < gs; ++i) qg[i] = 0;
    }
}

static void quantize_rows_q4(void *vctx, int64_t chunk) {
    gemm_ctx *c = (gemm_ctx *)vctx;
    const int64_t r0 = chunk * 16, r1 = r0 + 16 < c->m ? r0 + 16 : c->m;
    for (int64_t r = r0; r < r1; ++r)
        quantize_row_q4(c->x + r * c->ldx, c->k, c->gs, c->ng, (int8_t *)c->qa + r * c->ldq, (float *)c->sa + r * c->ng,
                        (float *)c->sx + r * c->ng);
}

static void to_bf16_rows(void *vctx, int64_t chunk) {
    gemm_ctx *c = (gemm_ctx *)vctx;
    const int64_t r0 = chunk * 16, r1 = r0 + 16 < c->m ? r0 + 16 : c->m;
    for (int64_t r = r0; r < r1; ++r) row_to_bf16(c->x + r * c->ldx, c->k, (uint16_t *)(c->xb + r * c->ldxb));
}

/* per-thread scratch for a call's Q4 or bf16 activations, grown to the largest call (never shrunk) */
static __thread void *q4_scratch;
static __thread size_t q4_scratch_bytes;

static int grow_scratch(size_t need) {
    if (need <= q4_scratch_bytes) return 0;
    void *p = realloc(q4_scratch, need);
    if (!p) return -2;
    q4_scratch = p;
    q4_scratch_bytes = need;
    return 0;
}

/* Whether bf16 GEMMs (K a multiple of 32) run on AMX-BF16 tiles: mode < 0 asks, 0 turns them off, 1 on
 * (where the CPU, Linux and this build allow it). Until set, on unless TOKENMILL_AMX=0. Returns the
 * state now (0 in builds without AMX-BF16). */
#if defined(TM_AMX_BF16)
static _Atomic int bf16_amx_state = -1;
static _Atomic int64_t bf16_amx_calls;
#endif
int tm_bf16_amx(int mode) {
#if defined(TM_AMX_BF16)
    return tm_amx_switch(&bf16_amx_state, mode, TM_AMX_UNIT_BF16);
#else
    (void)mode;
    return 0;
#endif
}

/* GEMM calls that tm_gemm_bf16* ran on AMX tiles in this process (so tests can tell that the path ran) */
int64_t tm_bf16_amx_calls(void) {
#if defined(TM_AMX_BF16)
    return atomic_load_explicit(&bf16_amx_calls, memory_order_relaxed);
#else
    return 0;
#endif
}

static int gemm_run(gemm_ctx *c) {
    if (c->m <= 0 || c->n <= 0) return 0;
    c->mr = c->kind == TM_W_Q4 ? TM_MR_Q4 : TM_MR;
    if (c->kind == TM_W_BF16) {
        c->ldxb = cdiv(c->k, 2);
        /* AMX for every call of a weight with K a multiple of 32 (whole tiles of K), so that a row's
         * result never depends on the call's row count (batch invariance); the A tiles read 16 rows */
        c->amx = c->k % 32 == 0 && tm_bf16_amx(-1);
        const int64_t mpad = c->amx ? cdiv(c->m, 16) * 16 : c->m;
        if (grow_scratch((size_t)mpad * (size_t)c->ldxb * 4 + 64)) return -2;
        c->xb = (const uint32_t *)q4_scratch;
        memset((uint32_t *)c->xb + c->m * c->ldxb, 0, (size_t)(mpad - c->m) * (size_t)c->ldxb * 4);
        tm_parallel_for(cdiv(c->m, 16), to_bf16_rows, c);
        if (c->amx) c->mr = 16;
    }
    if (c->kind == TM_W_Q4) {
        c->ng = cdiv(c->k, c->gs);
        c->ldq = c->ng * c->gs;
        const size_t need = (size_t)c->m * ((size_t)c->ldq + 2 * sizeof(float) * (size_t)c->ng) + 64;
        if (grow_scratch(need)) return -2;
        c->sa = (const float *)q4_scratch;
        c->sx = c->sa + c->m * c->ng;
        c->qa = (const int8_t *)(c->sx + c->m * c->ng);
        tm_parallel_for(cdiv(c->m, 16), quantize_rows_q4, c);
    }
    const int mrt = c->mr;
    const int threads = tm_get_num_threads();
    /* row blocks: fp32 as tall as TM_MC_MAX allows (the K slices keep a block's share of x in L2,
     * and each block reads every weight once more); quantized kinds also within TM_MC_BYTES of x.
     * Blocks of equal height, multiples of the tile height. */
    int64_t mcmax = TM_MC_MAX - TM_MC_MAX % mrt;
    if (c->kind != TM_W_F32 && c->kind != TM_W_BF16) {
        const int64_t byk = TM_MC_BYTES / ((int64_t)sizeof(float) * (c->k > 0 ? c->k : 1));
        if (byk < mcmax) mcmax = byk < mrt ? mrt : byk - byk % mrt;
    }
    int64_t mc = cdiv(cdiv(c->m, cdiv(c->m, mcmax)), mrt) * mrt;
    if (mc > mcmax) mc = mcmax;
    if (mc > c->m) mc = c->m;
    const int64_t mblocks = cdiv(c->m, mc);
    c->mc = mc;
    c->kc = TM_KC;
    c->npanels = c->silu_inter ? c->silu_inter / TM_NR : cdiv(c->n, TM_NR);
    /* about 4 chunks per thread: enough for the dynamic scheduling to even out speed
     * differences, few enough that a chunk's panels prefetch one another */
    const int64_t target = threads > 1 ? 4 * threads : 1;
    /* the argmax partials hold at most 4 * TM_MAX_THREADS groups (tm_gemm_argmax_scratch) */
    c->group = tm_panel_group(c->npanels, mblocks, target, threads, 4 * TM_MAX_THREADS);
    c->ngroups = cdiv(c->npanels, c->group);
    c->lanes = threads;
    tm_parallel_for(mblocks * c->ngroups, gemm_chunk, c);
#if defined(TM_AMX_BF16)
    if (c->amx) atomic_fetch_add_explicit(&bf16_amx_calls, 1, memory_order_relaxed);
#endif
    return 0;
}

/* The greedy argmax of each row of x W^T (+ bias) without writing the logits: out[r] = the first
 * column < n_limit, not among row r's banned columns, with the largest value (0 if none is above
 * -inf); the values are the ones tm_gemm_f32 / tm_gemm_q would store, bit for bit. scratch: at
 * least tm_gemm_argmax_scratch(m) bytes. */
int64_t tm_gemm_argmax_scratch(int64_t m) {
    return 4 * TM_MAX_THREADS * m * (int64_t)(sizeof(float) + sizeof(int64_t));
}
static int gemm_run_argmax(gemm_ctx *c, int64_t n_limit, const int64_t *ban, int64_t nban, int64_t *out,
                           void *scratch) {
    if (c->m <= 0) return 0;
    c->n_limit = n_limit < c->n ? n_limit : c->n;
    c->ban = ban;
    c->nban = ban ? nban : 0;
    /* gemm_run sets the chunking; the partials need ngroups <= 4 * TM_MAX_THREADS (its target) */
    c->best_idx = (int64_t *)scratch;
    c->best_val = (float *)((int64_t *)scratch + 4 * TM_MAX_THREADS * c->m);
    for (int64_t r = 0; r < c->m; ++r) out[r] = 0;
    if (c->n <= 0 || c->n_limit <= 0) return 0;
    const int rc = gemm_run(c);
    if (rc) return rc;
    for (int64_t r = 0; r < c->m; ++r) {
        float best = -INFINITY;
        int64_t bi = 0;
        for (int64_t g = 0; g < c->ngroups; ++g)
            if (c->best_val[g * c->m + r] > best) {
                best = c->best_val[g * c->m + r];
                bi = c->best_idx[g * c->m + r];
            }
        out[r] = bi;
    }
    return 0;
}
void tm_gemm_f32_argmax(const float *x, int64_t ldx, const float *w_packed, const float *bias, int64_t m, int64_t n,
                        int64_t k, int64_t n_limit, const int64_t *ban, int64_t nban, int64_t *out, void *scratch) {
    gemm_ctx c = {.kind = TM_W_F32, .x = x, .ldx = ldx, .w = (const char *)w_packed, .bias = bias, .m = m, .n = n,
                  .k = k, .gs = k, .panel_bytes = k * TM_NR * (int64_t)sizeof(float)};
    gemm_run_argmax(&c, n_limit, ban, nban, out, scratch);
}
int tm_gemm_q_argmax(int kind, int has_min, const float *x, int64_t ldx, const void *w_packed, const float *bias,
                     int64_t m, int64_t n, int64_t k, int64_t kpad, int64_t gs, int64_t n_limit, const int64_t *ban,
                     int64_t nban, int64_t *out, void *scratch) {
    if ((kind != TM_W_Q8 && kind != TM_W_Q4) || gs <= 0 || kpad % gs || k > kpad || (kind == TM_W_Q4 && gs % 4)) return -1;
    gemm_ctx c = {.kind = kind, .has_min = has_min, .x = x, .ldx = ldx, .w = (const char *)w_packed, .bias = bias,
                  .m = m, .n = n, .k = k, .gs = gs, .panel_bytes = (kpad / gs) * q_group_bytes(kind, has_min, gs)};
    return gemm_run_argmax(&c, n_limit, ban, nban, out, scratch);
}

/* SwiGLU in the gate/up GEMM: y [m, inter] = silu(x Wg^T) * (x Wu^T) for W = [Wg | Wu] [2 inter, k]
 * packed by tm_pack_f32 (bias [2 inter] or NULL), each output the value tm_silu_mul gives on the
 * stored product. inter must be a multiple of tm_gemm_nr(): returns -1 otherwise (nothing done). */
int tm_gemm_f32_silu(const float *x, int64_t ldx, const float *w_packed, const float *bias, float *y, int64_t ldy,
                     int64_t m, int64_t inter, int64_t k) {
    if (inter <= 0 || inter % TM_NR) return -1;
    gemm_ctx c = {.kind = TM_W_F32, .x = x, .ldx = ldx, .w = (const char *)w_packed, .bias = bias, .y = y,
                  .ldy = ldy, .m = m, .n = 2 * inter, .k = k, .gs = k,
                  .panel_bytes = k * TM_NR * (int64_t)sizeof(float), .silu_inter = inter};
    gemm_run(&c);
    return 0;
}
int tm_gemm_q_silu(int kind, int has_min, const float *x, int64_t ldx, const void *w_packed, const float *bias,
                   float *y, int64_t ldy, int64_t m, int64_t inter, int64_t k, int64_t kpad, int64_t gs) {
    if ((kind != TM_W_Q8 && kind != TM_W_Q4) || gs <= 0 || kpad % gs || k > kpad || (kind == TM_W_Q4 && gs % 4) || inter <= 0 || inter % TM_NR)
        return -1;
    gemm_ctx c = {.kind = kind, .has_min = has_min, .x = x, .ldx = ldx, .w = (const char *)w_packed,
                  .bias = bias, .y = y, .ldy = ldy, .m = m, .n = 2 * inter, .k = k, .gs = gs,
                  .panel_bytes = (kpad / gs) * q_group_bytes(kind, has_min, gs), .silu_inter = inter};
    return gemm_run(&c);
}

/* y[m, n] (+)= x[m, k] W^T (+ bias) for W packed by tm_pack_f32.
 * x rows have stride ldx (>= k), y rows stride ldy (>= n); accumulate adds into y. */
void tm_gemm_f32(const float *x, int64_t ldx, const float *w_packed, const float *bias, float *y, int64_t ldy,
                 int64_t m, int64_t n, int64_t k, int accumulate) {
    gemm_ctx c = {.kind = TM_W_F32, .x = x, .ldx = ldx, .w = (const char *)w_packed, .bias = bias, .y = y,
                  .ldy = ldy, .m = m, .n = n, .k = k, .gs = k,
                  .panel_bytes = k * TM_NR * (int64_t)sizeof(float), .accumulate = accumulate};
    gemm_run(&c);
}

/* The same for quantized weights packed by tm_pack_q (kpad = k rounded up to gs). Returns 0, -1 for
 * a bad kind / gs / k (Q4: gs % 4 == 0), or -2 when the Q4 activation scratch cannot be allocated. */
int tm_gemm_q(int kind, int has_min, const float *x, int64_t ldx, const void *w_packed, const float *bias, float *y,
              int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t kpad, int64_t gs, int accumulate) {
    if ((kind != TM_W_Q8 && kind != TM_W_Q4) || gs <= 0 || kpad % gs || k > kpad || (kind == TM_W_Q4 && gs % 4)) return -1;
    gemm_ctx c = {.kind = kind, .has_min = has_min, .x = x, .ldx = ldx, .w = (const char *)w_packed,
                  .bias = bias, .y = y, .ldy = ldy, .m = m, .n = n, .k = k, .gs = gs,
                  .panel_bytes = (kpad / gs) * q_group_bytes(kind, has_min, gs), .accumulate = accumulate};
    return gemm_run(&c);
}

/* ---------------------------------------------------------------- bf16 weights (TM_W_BF16)
 * As tm_gemm_f32 / _silu / _argmax for W packed by tm_pack_bf16: x is rounded to bf16 once per call
 * (see the header). Return 0, or -2 when the call's bf16 scratch for x cannot be allocated. */
int tm_gemm_bf16(const float *x, int64_t ldx, const void *w_packed, const float *bias, float *y, int64_t ldy,
                 int64_t m, int64_t n, int64_t k, int accumulate) {
    gemm_ctx c = {.kind = TM_W_BF16, .x = x, .ldx = ldx, .w = (const char *)w_packed, .bias = bias, .y = y,
                  .ldy = ldy, .m = m, .n = n, .k = k, .gs = k, .panel_bytes = cdiv(k, 2) * TM_NR * 4,
                  .accumulate = accumulate};
    return gemm_run(&c);
}
int tm_gemm_bf16_silu(const float *x, int64_t ldx, const void *w_packed, const float *bias, float *y, int64_t ldy,
                      int64_t m, int64_t inter, int64_t k) {
    if (inter <= 0 || inter % TM_NR) return -1;
    gemm_ctx c = {.kind = TM_W_BF16, .x = x, .ldx = ldx, .w = (const char *)w_packed, .bias = bias, .y = y,
                  .ldy = ldy, .m = m, .n = 2 * inter, .k = k, .gs = k, .panel_bytes = cdiv(k, 2) * TM_NR * 4,
                  .silu_inter = inter};
    return gemm_run(&c);
}
int tm_gemm_bf16_argmax(const float *x, int64_t ldx, const void *w_packed, const float *bias, int64_t m, int64_t n,
                        int64_t k, int64_t n_limit, const int64_t *ban, int64_t nban, int64_t *out, void *scratch) {
    gemm_ctx c = {.kind = TM_W_BF16, .x = x, .ldx = ldx, .w = (const char *)w_packed, .bias = bias, .m = m, .n = n,
                  .k = k, .gs = k, .panel_bytes = cdiv(k, 2) * TM_NR * 4};
    return gemm_run_argmax(&c, n_limit, ban, nban, out, scratch);
}
/* 1 if this build's bf16 kernel runs on VDPBF16PS, 0 if it widens bf16 to fp32 for FMAs */
int tm_bf16_native(void) {
#if defined(TM_AVX512) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
