/*
 * Paged attention for the CPU, reading KV blocks where they lie: decode rows, prefill
 * chunks and multi-token (draft-verification) queries in one call.
 *
 * Every query row r (one token) attends over the first kv_len[r] key/value slots of its
 * sequence, found block by block through that sequence's block table; with
 * kv_len[r] = position + 1 this is causal attention over a cached prefix plus the new
 * tokens up to r itself. With a sliding window w > 0 row r sees only the last w of them, keys
 * kv_len[r] - w <= j < kv_len[r] (a query at position p attends p - w < j <= p: Beltagy et al.
 * 2020, arXiv 2004.05150; Mistral, Gemma 3), and the blocks wholly before a tile's window are
 * not read at all, so their block-table entries may point anywhere valid (a freed block's
 * placeholder). Work comes in tiles: a tile is up to a few consecutive rows of
 * one sequence, and a task is (tile, KV head), so the K/V of a block are read once for
 * all the tile's rows and for the G query heads of a GQA group (Ainslie et al. 2023,
 * arXiv 2305.13245). The softmax is computed online, one sub-block of VL keys at a time,
 * with a running maximum and sum per query (FlashAttention, Dao et al. 2022,
 * arXiv 2205.14135), so nothing is gathered, padded or materialised.
 *
 * Layouts (contiguous unless a stride is given):
 *   q            rows [T] of stride ldq floats; head j of row r at q + r * ldq + j * D
 *   k/v_cache    [Hkv, S, D] fp32, S = num_blocks * block_size slots (head-major); or
 *                int8 rows [Hkv, S, D + 4]: D codes and the row's fp32 scale (value =
 *                code * scale; engine/attention/torch_quant_kv.py's layout); or [Hkv, S, D]
 *                fp16, widened to fp32 as they are loaded (the arithmetic is fp32 throughout); or
 *                [Hkv, S, D] bf16 in groups of 16 slots (TM_KV_BF16, tm_cpu.h), read in place on
 *                AMX-BF16 tiles where the CPU has them, else on VDPBF16PS where the build has
 *                AVX512-BF16 (attn_task_bf16)
 *   block_tables [num_seqs, max_blocks] int32
 *   row_seq      [T] int32, the block-table row of each query row (NULL: row r -> r)
 *   kv_len       [T] int64, keys visible to each row (>= 1): its position + 1
 *   window       the sliding window in tokens, 0 for none
 *   tiles        [num_tiles, 2] int64 (first row, rows), rows of one sequence in order
 *   out          rows [T] of stride ldo floats, laid out as q
 *
 * With AVX-512 (D a multiple of 16) or AVX2 + FMA (D a multiple of 8) keys are taken in
 * chunks of up to 64 (whole blocks): the scores of VL keys are formed as VL partial
 * vectors reduced together, one vectorised online-softmax update per query and chunk,
 * then acc += p V with the outputs of a group of queries (up to 6) in registers and each V row
 * loaded once per group;
 * other shapes (and -DTM_GENERIC builds) take a plain-C path. Measured, one layer of a
 * batch-64 decode step (contexts ~130, SmolLM2's 9/3 heads, 2 threads): 92 us with KV in
 * cache; over the 30 layers' pools in turn (cold, as in the engine) about 0.28 ms.
 */
#include "tm_cpu.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define TM_MAX_G 16
#define TM_MAX_D 256
#define TM_MAX_BS 64
#define TM_MAX_QG 16 /* query vectors (rows x heads) per task */
#define TM_CHUNK 64  /* keys per online-softmax update (several blocks of one sequence) */

typedef struct {
    const float *q;
    int64_t ldq;
    const void *k_cache, *v_cache;
    int kv; /* TM_KV_F32, TM_KV_I8 or TM_KV_F16 rows (tm_cpu.h) */
    const int32_t *block_tables;
    int64_t max_blocks;
    const int32_t *row_seq;
    const int64_t *kv_len;
    const int64_t *tiles;
    int64_t num_tiles;
    float *out;
    int64_t ldo;
    int64_t hq, hkv, d, s, block_size;
    float scale;
    int64_t window; /* sliding window in tokens, 0: none */
    int amx;        /* a TM_KV_BF16 cache on AMX-BF16 tiles (TM_ATTN_AMX) */
} tm_attn;

/* The first key a row that sees `len` keys attends: len - window under a window, else 0. */
static inline int64_t win_lo(const tm_attn *j, int64_t len) {
    return j->window > 0 && len > j->window ? len - j->window : 0;
}

/* Row r's visible keys [lo, lim) (lim: its position + 1), and a task's span over its rows widened to them. */
static inline void query_span(const tm_attn *j, int64_t r, int64_t *lim, int64_t *lo, int64_t *maxlen, int64_t *minlo) {
    *lim = j->kv_len[r];
    *lo = win_lo(j, *lim);
    if (*lim > *maxlen) *maxlen = *lim;
    if (*lo < *minlo) *minlo = *lo;
}

static inline float row_scale(const char *row, int64_t d) {
    float sc;
    memcpy(&sc, row + d, sizeof sc);
    return sc;
}

/* ---------------------------------------------------------------- plain C */

static void attn_task_generic(const tm_attn *j, int64_t tile, int64_t h) {
    const int64_t r0 = j->tiles[2 * tile], nr = j->tiles[2 * tile + 1];
    const int64_t g_n = j->hq / j->hkv, d = j->d, bs = j->block_size;
    const int64_t rb = tm_kv_row_bytes(j->kv, d);
    const char *kh = (const char *)j->k_cache + h * j->s * rb;
    const char *vh = (const char *)j->v_cache + h * j->s * rb;
    float acc[TM_MAX_D];
    for (int64_t r = r0; r < r0 + nr; ++r) {
        const int64_t seq = j->row_seq ? j->row_seq[r] : r, len = j->kv_len[r];
        const int32_t *table = j->block_tables + seq * j->max_blocks;
        for (int64_t g = 0; g < g_n; ++g) {
            const float *q = j->q + r * j->ldq + (h * g_n + g) * d;
            float m = -INFINITY, l = 0.0f;
            memset(acc, 0, sizeof(float) * d);
            for (int64_t t = win_lo(j, len); t < len; ++t) {
                const int64_t slot = (int64_t)table[t / bs] * bs + t % bs;
                const char *kr = kh + slot * rb, *vr = vh + slot * rb;
                float sc = 0.0f;
                if (j->kv == TM_KV_BF16) { /* the group layout: values found one by one */
                    for (int64_t i = 0; i < d; ++i) sc += q[i] * tm_bf16_to_float(((const uint16_t *)kh)[tm_bf16_k_at(slot, i, d)]);
                } else if (j->kv == TM_KV_I8) {
                    for (int64_t i = 0; i < d; ++i) sc += q[i] * (float)((const int8_t *)kr)[i];
                    sc *= row_scale(kr, d);
                } else if (j->kv == TM_KV_F16) {
                    for (int64_t i = 0; i < d; ++i) sc += q[i] * tm_half_to_float(((const uint16_t *)kr)[i]);
                } else {
                    for (int64_t i = 0; i < d; ++i) sc += q[i] * ((const float *)kr)[i];
                }
                sc *= j->scale;
                const float m_new = sc > m ? sc : m;
                const float corr = tm_expf(m - m_new), p = tm_expf(sc - m_new);
                l = l * corr + p;
                m = m_new;
                if (j->kv == TM_KV_BF16) {
                    for (int64_t i = 0; i < d; ++i)
                        acc[i] = acc[i] * corr + p * tm_bf16_to_float(((const uint16_t *)vh)[tm_bf16_v_at(slot, i, d)]);
                } else if (j->kv == TM_KV_I8) {
                    const float w = p * row_scale(vr, d);
                    for (int64_t i = 0; i < d; ++i) acc[i] = acc[i] * corr + w * (float)((const int8_t *)vr)[i];
                } else if (j->kv == TM_KV_F16) {
                    for (int64_t i = 0; i < d; ++i)
                        acc[i] = acc[i] * corr + p * tm_half_to_float(((const uint16_t *)vr)[i]);
                } else {
                    for (int64_t i = 0; i < d; ++i) acc[i] = acc[i] * corr + p * ((const float *)vr)[i];
                }
            }
            float *o = j->out + r * j->ldo + (h * g_n + g) * d;
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (int64_t i = 0; i < d; ++i) o[i] = acc[i] * inv;
        }
    }
}

/* ---------------------------------------------------------------- SIMD */

#if defined(TM_AVX512) || defined(TM_AVX2)
#if defined(TM_AVX512)
#define VL 16
typedef __m512 vf;
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_SET1(x) _mm512_set1_ps(x)
#define V_ZERO() _mm512_setzero_ps()
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define _mm_max_helper(a, b) _mm512_max_ps(a, b)
#define V_HMAX(v) _mm512_reduce_max_ps(v)
#define V_HSUM(v) _mm512_reduce_add_ps(v)
/* VL values of a K/V row from element i, as fp32: int8 codes (unscaled), halves or floats */
TM_INLINE vf load_row(const char *row, int64_t i, int kv) {
    if (kv == TM_KV_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
    if (kv == TM_KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    return _mm512_loadu_ps((const float *)row + i);
}
/* lanes >= n of v replaced by `fill` */
TM_INLINE vf keep_first(vf v, int64_t n, float fill) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), m, v);
}
/* p * 2**n for integral n */
#define V_SCALE2(p, n) _mm512_scalef_ps(p, n)
#define V_ROUND(t) _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#else
#define VL 8
typedef __m256 vf;
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_SET1(x) _mm256_set1_ps(x)
#define V_ZERO() _mm256_setzero_ps()
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define _mm_max_helper(a, b) _mm256_max_ps(a, b)
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#define V_HMAX(v) hmax8(v)
#define V_HSUM(v) hsum8(v)
TM_INLINE vf load_row(const char *row, int64_t i, int kv) {
    if (kv == TM_KV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
    if (kv == TM_KV_F16) {
#if defined(__F16C__)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
#else
        float t[8];
        for (int u = 0; u < 8; ++u) t[u] = tm_half_to_float(((const uint16_t *)row)[i + u]);
        return _mm256_loadu_ps(t);
#endif
    }
    return _mm256_loadu_ps((const float *)row + i);
}
TM_INLINE vf keep_first(vf v, int64_t n, float fill) {
    const __m256 idx = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_cmp_ps(idx, _mm256_set1_ps((float)n), _CMP_LT_OQ);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, keep);
}
TM_INLINE vf scale2_avx2(vf p, vf n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#define V_SCALE2(p, n) scale2_avx2(p, n)
#define V_ROUND(t) _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#endif
/* e**x, x >= -87: 2**n * e**r with n = round(x / ln 2), r = x - n ln 2, e**r by its degree-6 Taylor polynomial
   (Horner) */
TM_INLINE vf vexp(vf x) {
    x = _mm_max_helper(x, V_SET1(-87.0f));
    const vf t = V_MUL(x, V_SET1(1.44269504088896341f));
    const vf n = V_ROUND(t);
    const vf r = V_MUL(V_SUB(t, n), V_SET1(0.69314718055994531f));
    vf p = V_SET1(0.0013888889f);
    p = V_FMA(p, r, V_SET1(0.0083333338f));
    p = V_FMA(p, r, V_SET1(0.041666668f));
    p = V_FMA(p, r, V_SET1(0.16666667f));
    p = V_FMA(p, r, V_SET1(0.5f));
    p = V_FMA(p, r, V_SET1(1.0f));
    p = V_FMA(p, r, V_SET1(1.0f));
    return V_SCALE2(p, n);
}


/* Horizontal sums of 8 vectors of 8 lanes: lane u = sum of the lanes of v[u]. */
static inline __m256 reduce8(const __m256 v[8]) {
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* VL partial vectors -> one vector whose lane u is the sum of part[u]'s lanes */
TM_INLINE vf reduce_vl(const vf part[VL]) {
#if defined(TM_AVX512)
    __m256 h[16];
    for (int u = 0; u < 16; ++u)
        h[u] = _mm256_add_ps(_mm512_castps512_ps256(part[u]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(part[u]), 1)));
    const __m256 lo = reduce8(h), hi = reduce8(h + 8);
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
#else
    return reduce8(part);
#endif
}

/* acc[x] += sum_u p[x][u0 + u] V[u] over `seg` keys, for QG queries (compile-time), D/VL vectors
 * each, all held in registers: each V row is loaded once for every query. With AVX2 (16 vector
 * registers) the sums are kept for CS of the D / VL vectors at a time instead (QG * CS <= 12, with
 * one register for the V vector and one for the broadcast weight: no spills) and the keys swept once
 * per slice; the slices are disjoint, so each V vector is still loaded (and widened) once, and every
 * sum takes the same FMAs in the same order as with all D / VL in registers. Three queries (a GQA
 * group of 3 over head_dim 64, SmolLM2's decode tiles) take slices of 4 vectors: an fp16 row's
 * cache line, or half an fp32 row, per sweep. Measured with benchmarks/attention_ab.py on a 2-core
 * Zen 3 (AVX2): prefill (slices of 2 then), fp16 cache 533 -> 382 ms, fp32 454 -> 430 ms; decode,
 * batch 64 over a cold cache, against all 24 sums in registers (which spilled): fp16 16.3 -> 14.7
 * and 20.1 -> 16.3 ms, int8 14.7-16.4 -> 12.6-14.1 ms, fp32 20.5-22.8 -> 20.1-21.9 ms. */
TM_INLINE void pv_regs(const int QG, const int D, const int kv, float (*acc)[TM_MAX_D],
                       const float (*p)[TM_CHUNK + VL], int64_t u0, const char *vb, int64_t rb, int64_t seg) {
#if !defined(TM_AVX512)
    const int CS0 = QG == 1 ? 8 : (QG <= 3 ? 4 : (QG == 4 ? 2 : 1));
    const int CS = CS0 < D / VL ? CS0 : D / VL;
#pragma GCC unroll 1
    for (int c0 = 0; c0 < D / VL; c0 += CS) {
        vf a[6][8];
#pragma GCC unroll 6
        for (int x = 0; x < QG; ++x)
#pragma GCC unroll 8
            for (int c = 0; c < CS; ++c) a[x][c] = V_LOAD(acc[x] + (c0 + c) * VL);
        for (int64_t u = 0; u < seg; ++u) {
            const char *vr = vb + u * rb;
#pragma GCC unroll 8
            for (int c = 0; c < CS; ++c) {
                const vf v = load_row(vr, (c0 + c) * VL, kv);
#pragma GCC unroll 6
                for (int x = 0; x < QG; ++x) a[x][c] = V_FMA(V_SET1(p[x][u0 + u]), v, a[x][c]);
            }
        }
#pragma GCC unroll 6
        for (int x = 0; x < QG; ++x)
#pragma GCC unroll 8
            for (int c = 0; c < CS; ++c) V_STORE(acc[x] + (c0 + c) * VL, a[x][c]);
    }
#else
    vf a[6][TM_MAX_D / VL];
#pragma GCC unroll 6
    for (int x = 0; x < QG; ++x)
#pragma GCC unroll 16
        for (int c = 0; c < D / VL; ++c) a[x][c] = V_LOAD(acc[x] + c * VL);
    for (int64_t u = 0; u < seg; ++u) {
        const char *vr = vb + u * rb;
        vf v[TM_MAX_D / VL];
#pragma GCC unroll 16
        for (int c = 0; c < D / VL; ++c) v[c] = load_row(vr, c * VL, kv);
#pragma GCC unroll 6
        for (int x = 0; x < QG; ++x) {
            const vf w = V_SET1(p[x][u0 + u]);
#pragma GCC unroll 16
            for (int c = 0; c < D / VL; ++c) a[x][c] = V_FMA(w, v[c], a[x][c]);
        }
    }
#pragma GCC unroll 6
    for (int x = 0; x < QG; ++x)
#pragma GCC unroll 16
        for (int c = 0; c < D / VL; ++c) V_STORE(acc[x] + c * VL, a[x][c]);
#endif
}

/* The same, one query at a time (any count and head_dim), skipping queries that see none of
 * these keys; probabilities past a row's position are 0. */
static inline void pv_loop(int64_t qg, int64_t d, const int kv, float (*acc)[TM_MAX_D],
                           const float (*p)[TM_CHUNK + VL], int64_t u0, const char *vb, int64_t rb, int64_t seg,
                           const int64_t *lim, int64_t pos0) {
    for (int64_t x = 0; x < qg; ++x) {
        if (lim[x] <= pos0 + u0) continue;
        const int64_t vis = lim[x] - pos0 - u0 < seg ? lim[x] - pos0 - u0 : seg;
        for (int64_t i = 0; i < d; i += VL) {
            vf a0 = V_LOAD(acc[x] + i);
            for (int64_t u = 0; u < vis; ++u)
                a0 = V_FMA(V_SET1(p[x][u0 + u]),
                           kv == TM_KV_I8 ? load_row(vb + u * rb, i, TM_KV_I8)
                                          : (kv == TM_KV_F16 ? load_row(vb + u * rb, i, TM_KV_F16)
                                                             : load_row(vb + u * rb, i, TM_KV_F32)),
                           a0);
            V_STORE(acc[x] + i, a0);
        }
    }
}

#if defined(TM_AVX512)
/* int8 caches in integer arithmetic (AVX-512 BW, VNNI where present). A query is rounded to
 * int16 codes with one scale (its largest magnitude / 32767: a relative step of 3e-5, far below
 * the cache's own int8 step of 1/254), a K row's codes are widened to int16, and vpdpwssd sums
 * pairs of products into int32, exactly; the probabilities times V's row scale are rounded to
 * int16 the same way, per query and chunk, and pairs of V rows are interleaved so that one
 * vpdpwssd adds two keys' contributions. Sums stay below 2^31: D <= 256 products (or 64 keys) of
 * |code| <= 127 by |q| <= 32767. The fp32 path converts every code and spends an FMA per
 * product; this one does half the instructions per key or less. */
TM_INLINE __m512i dp16(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* 16 int32 vectors -> one whose lane u is the sum of p[u]'s lanes (exact). */
TM_INLINE __m512i reduce16_i32(const __m512i p[16]) {
    __m512i a[8], b[4];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) /* per 128-bit block: p0 lanes 0+2, p1 0+2, p0 1+3, p1 1+3 */
        a[u] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * u], p[2 * u + 1]),
                                _mm512_unpackhi_epi32(p[2 * u], p[2 * u + 1]));
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) /* per 128-bit block: the block's sums of p[4u .. 4u + 3] */
        b[u] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * u], a[2 * u + 1]),
                                _mm512_unpackhi_epi64(a[2 * u], a[2 * u + 1]));
    /* add the four 128-bit blocks: output block i = the sums of b[i]'s blocks */
    const __m512i d01 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i d23 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(d01, d23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(d01, d23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* int32 dot products of one int16 query (D codes) with cnt <= 16 consecutive int8 K rows. */
TM_INLINE __m512i scores_i8(const int D, const int16_t *q16, const char *kb, int64_t rb, int64_t cnt) {
    __m512i qv[TM_MAX_D / 32], part[16];
#pragma GCC unroll 8
    for (int c = 0; c < D / 32; ++c) qv[c] = _mm512_loadu_si512((const void *)(q16 + c * 32));
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) {
        __m512i a = _mm512_setzero_si512();
        if (u < cnt) {
            const char *kr = kb + u * rb;
#pragma GCC unroll 8
            for (int c = 0; c < D / 32; ++c)
                a = dp16(a, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(kr + c * 32))), qv[c]);
        }
        part[u] = a;
    }
    return reduce16_i32(part);
}

/* Two V rows (D codes each; v1 NULL: zeros) as D / 16 vectors of (row 0, row 1) int16 pairs.
 * Pair vector 2c (2c + 1) holds, in its 128-bit block L, dims 32c + 8L + 0..3 (+ 4..7). */
TM_INLINE void v_pairs(const int D, const char *v0, const char *v1, __m512i *pr) {
#pragma GCC unroll 8
    for (int c = 0; c < D / 32; ++c) {
        const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(v0 + c * 32)));
        const __m512i b = v1 ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(v1 + c * 32)))
                             : _mm512_setzero_si512();
        pr[2 * c] = _mm512_unpacklo_epi16(a, b);
        pr[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
}

/* acc[x] += sw[x] * sum_u w16[x][u] V[u] for NQ queries over one block segment of seg keys
 * starting at chunk key u0 (w16 rows hold the chunk's int16 weights, an even count); acc is
 * kept in v_pairs' dim order. */
TM_INLINE void pv_i8(const int NQ, const int D, float (*acc)[TM_MAX_D], const int16_t (*w16)[TM_CHUNK + 2],
                     const float *sw, int64_t u0, const char *vb, int64_t rb, int64_t seg) {
    __m512i ai[4][TM_MAX_D / 16];
#pragma GCC unroll 4
    for (int x = 0; x < NQ; ++x)
#pragma GCC unroll 16
        for (int c = 0; c < D / 16; ++c) ai[x][c] = _mm512_setzero_si512();
    for (int64_t u = 0; u < seg; u += 2) {
        __m512i pr[TM_MAX_D / 16];
        const int both = u + 1 < seg;
        v_pairs(D, vb + u * rb, both ? vb + (u + 1) * rb : NULL, pr);
#pragma GCC unroll 4
        for (int x = 0; x < NQ; ++x) {
            int32_t wp;
            memcpy(&wp, &w16[x][u0 + u], sizeof wp);
            if (!both) wp &= 0xFFFF;
            const __m512i w = _mm512_set1_epi32(wp);
#pragma GCC unroll 16
            for (int c = 0; c < D / 16; ++c) ai[x][c] = dp16(ai[x][c], pr[c], w);
        }
    }
#pragma GCC unroll 4
    for (int x = 0; x < NQ; ++x) {
        const __m512 s = _mm512_set1_ps(sw[x]);
#pragma GCC unroll 16
        for (int c = 0; c < D / 16; ++c)
            _mm512_storeu_ps(acc[x] + c * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[x][c]), s,
                                                              _mm512_loadu_ps(acc[x] + c * 16)));
    }
}

/* chunk-relative weights of query x (n values, >= 0) -> int16 codes and their scale */
TM_INLINE float quantize_w16(const float *p, int64_t n, int16_t *w16) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t u = 0; u < n; u += 16) mx = _mm512_max_ps(mx, keep_first(_mm512_loadu_ps(p + u), n - u, 0.0f));
    const float wmax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(wmax > 0.0f ? 32767.0f / wmax : 0.0f);
    for (int64_t u = 0; u < n; u += 16) {
        const __m512 v = keep_first(_mm512_loadu_ps(p + u), n - u, 0.0f);
        _mm256_storeu_si256((__m256i *)(w16 + u), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv))));
    }
    w16[(n + 15) / 16 * 16] = 0; /* the partner of an odd last key */
    return wmax / 32767.0f;
}

/* storage position of dim i in v_pairs' order (D a multiple of 32) */
static inline int64_t pair_pos(int64_t i) {
    const int64_t c = i / 32, r = i % 32, blk = r / 8, hi = (r % 8) / 4, j = r % 4;
    return (2 * c + hi) * 16 + blk * 4 + j;
}
#endif

/* A range of keys still to fetch (K and V rows of one KV head), issued a few lines at a time
 * between pieces of work, so the fetches overlap the arithmetic instead of stalling it in one
 * burst of hundreds of prefetches. */
typedef struct {
    const char *kh, *vh;
    const int32_t *table;
    int64_t bs, rb, p, end, off;
} pf_cursor;

static inline void pf_set(pf_cursor *c, const char *kh, const char *vh, const int32_t *table, int64_t bs, int64_t rb,
                          int64_t from, int64_t count) {
    c->kh = kh;
    c->vh = vh;
    c->table = table;
    c->bs = bs;
    c->rb = rb;
    c->p = from;
    c->end = from + count;
    c->off = 0;
}

/* fetch up to `lines` more lines of K and of V (lines < 0: all that is left) */
static inline void pf_advance(pf_cursor *c, int64_t lines) {
    while (lines != 0 && c->p < c->end) {
        const int64_t boff = c->p % c->bs, cnt = c->bs - boff < c->end - c->p ? c->bs - boff : c->end - c->p;
        const int64_t at = ((int64_t)c->table[c->p / c->bs] * c->bs + boff) * c->rb, bytes = cnt * c->rb;
        for (; c->off < bytes && lines != 0; c->off += 64, --lines) {
            __builtin_prefetch(c->kh + at + c->off, 0, 3);
            __builtin_prefetch(c->vh + at + c->off, 0, 3);
        }
        if (c->off >= bytes) {
            c->p += cnt;
            c->off = 0;
        }
    }
}

#ifndef TM_PF_TILE
#define TM_PF_TILE 1
#endif
/* The first chunk of KV head 0 of tile t (if any): fetched at the end of an earlier tile, so a
 * thread's next task does not start on cold blocks (tiles are handed out in order). */
static inline void prefetch_next_tile(const tm_attn *j, int64_t t, int64_t chunk, pf_cursor *c) {
    if (t >= j->num_tiles) {
        c->p = c->end = 0;
        return;
    }
    const int64_t r0 = j->tiles[2 * t], nr = j->tiles[2 * t + 1];
    const int64_t seq = j->row_seq ? j->row_seq[r0] : r0, len = j->kv_len[r0 + nr - 1];
    const int64_t first = win_lo(j, j->kv_len[r0]) / j->block_size * j->block_size;
    const int64_t rb = tm_kv_row_bytes(j->kv, j->d);
    pf_set(c, (const char *)j->k_cache, (const char *)j->v_cache, j->block_tables + seq * j->max_blocks,
           j->block_size, rb, first, len - first < chunk ? len - first : chunk);
}

/* One (tile, KV head) task; D is 0 for a runtime head_dim (j->d), or a compile-time 64 / 128.
 * Keys are taken in chunks of up to TM_CHUNK: the scores of every query over the chunk are
 * formed sub-block by sub-block (VL keys: VL partial vectors reduced together), then one
 * online-softmax update per query and chunk, then acc += p V for all queries at once. */
TM_INLINE void attn_task_simd(const tm_attn *j, int64_t tile, int64_t h, const int kv, const int D) {
    const int64_t r0 = j->tiles[2 * tile], nr = j->tiles[2 * tile + 1];
    const int64_t g_n = j->hq / j->hkv, d = D ? D : j->d, bs = j->block_size, qg = nr * g_n;
    const int64_t rb = tm_kv_row_bytes(kv, d);
    const int is_int8 = kv == TM_KV_I8;
    const char *kh = (const char *)j->k_cache + h * j->s * rb;
    const char *vh = (const char *)j->v_cache + h * j->s * rb;
    const int64_t seq = j->row_seq ? j->row_seq[r0] : r0;
    const int32_t *table = j->block_tables + seq * j->max_blocks;
    float qs[TM_MAX_QG][TM_MAX_D] __attribute__((aligned(64)));
    float acc[TM_MAX_QG][TM_MAX_D] __attribute__((aligned(64)));
    /* scores, then probabilities; a group of keys stores VL lanes, so VL more of room */
    float sb[TM_MAX_QG][TM_CHUNK + VL] __attribute__((aligned(64)));
    float ks[TM_CHUNK + VL], vs[TM_CHUNK + VL];
    /* fp16 K of a compile-time head_dim, several queries per task (GQA): the chunk's K rows are
     * widened once into kf and every query's scores read them as fp32 rows */
    const int use_kf = kv == TM_KV_F16 && D && qg > 1;
    float kf[TM_CHUNK * (D ? D : 1)] __attribute__((aligned(64)));
    float m[TM_MAX_QG], l[TM_MAX_QG];
    int64_t lim[TM_MAX_QG], lo[TM_MAX_QG];
    /* per chunk, the keys [vlo, vhi) of it that a query attends (chunk-relative; empty: none) */
    int64_t vlo[TM_MAX_QG], vhi[TM_MAX_QG];
    int64_t maxlen = 0, minlo = INT64_MAX;
    const vf scale8 = V_SET1(j->scale);
#if defined(TM_AVX512)
    /* int8 rows of a compile-time head_dim in integer arithmetic (whole VL-key groups per block) */
    const int use_i = is_int8 && D;
    int16_t q16[TM_MAX_QG][TM_MAX_D] __attribute__((aligned(64)));
    int16_t w16[TM_MAX_QG][TM_CHUNK + 2] __attribute__((aligned(64)));
    float sq[TM_MAX_QG], sw[TM_MAX_QG];
#endif
    for (int64_t x = 0; x < qg; ++x) {
        const int64_t r = r0 + x / g_n, g = x % g_n;
        const float *src = j->q + r * j->ldq + (h * g_n + g) * d;
        for (int64_t i = 0; i < d; i += VL) {
            V_STORE(qs[x] + i, V_MUL(V_LOAD(src + i), scale8));
            V_STORE(acc[x] + i, V_ZERO());
        }
        m[x] = -INFINITY;
        l[x] = 0.0f;
        query_span(j, r, &lim[x], &lo[x], &maxlen, &minlo);
#if defined(TM_AVX512)
        if (use_i) { /* the scaled query as int16 codes: qs = sq * q16 */
            vf mx = V_ZERO();
            for (int64_t i = 0; i < d; i += VL) mx = _mm512_max_ps(mx, _mm512_abs_ps(V_LOAD(qs[x] + i)));
            const float amax = _mm512_reduce_max_ps(mx);
            sq[x] = amax / 32767.0f;
            const vf inv = V_SET1(amax > 0.0f ? 32767.0f / amax : 0.0f);
            for (int64_t i = 0; i < d; i += VL)
                _mm256_storeu_si256((__m256i *)(q16[x] + i),
                                    _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(V_MUL(V_LOAD(qs[x] + i), inv))));
        }
#endif
    }
    const int64_t chunk = bs >= TM_CHUNK ? bs : TM_CHUNK - TM_CHUNK % bs; /* whole blocks */
    /* the block of the earliest key any row attends: the blocks before it are not read */
    const int64_t first = minlo / bs * bs;
    for (int64_t pos0 = first; pos0 < maxlen; pos0 += chunk) {
        const int64_t n = maxlen - pos0 < chunk ? maxlen - pos0 : chunk; /* keys some row may see */
        for (int64_t x = 0; x < qg; ++x) {
            vhi[x] = lim[x] - pos0 < n ? lim[x] - pos0 : n;
            vlo[x] = lo[x] > pos0 ? lo[x] - pos0 : 0;
        }
        /* the next chunk's blocks lie elsewhere: fetch them whole while this one is computed
         * (after a head's last chunk, the next head's first) */
        pf_cursor pfc;
        if (pos0 + chunk < maxlen) {
            const int64_t nn = maxlen - pos0 - chunk < chunk ? maxlen - pos0 - chunk : chunk;
            pf_set(&pfc, kh, vh, table, bs, rb, pos0 + chunk, nn);
        } else if (h + 1 < j->hkv) {
            pf_set(&pfc, kh + j->s * rb, vh + j->s * rb, table, bs, rb, first,
                   maxlen - first < chunk ? maxlen - first : chunk);
        } else {
            prefetch_next_tile(j, tile + TM_PF_TILE, chunk, &pfc);
        }
        /* spread over this chunk's pieces of work: its score groups and value segments */
        const int64_t pf_lines = (pfc.end - pfc.p) * rb / 64 + 1;
        const int64_t pf_quota = pf_lines / (qg * ((n + VL - 1) / VL) + (n + bs - 1) / bs + 1) + 1;
        pf_advance(&pfc, pf_quota);
        if (is_int8)
            for (int64_t u = 0; u < n;) { /* the rows' scales, block by block */
                const int64_t p = pos0 + u, off = p % bs, cnt = bs - off < n - u ? bs - off : n - u;
                const char *kr = kh + ((int64_t)table[p / bs] * bs + off) * rb;
                const char *vr = vh + ((int64_t)table[p / bs] * bs + off) * rb;
                for (int64_t e = 0; e < cnt; ++e) {
                    ks[u + e] = row_scale(kr + e * rb, d);
                    vs[u + e] = row_scale(vr + e * rb, d);
                }
                u += cnt;
            }
        if (use_kf)
            for (int64_t u = 0; u < n;) { /* block by block: the chunk's K rows, widened */
                const int64_t p = pos0 + u, off = p % bs, cnt = bs - off < n - u ? bs - off : n - u;
                const char *kr = kh + ((int64_t)table[p / bs] * bs + off) * rb;
                for (int64_t e = 0; e < cnt; ++e)
#pragma GCC unroll 16
                    for (int c = 0; c < D / VL; ++c)
                        V_STORE(kf + (u + e) * D + c * VL, load_row(kr + e * rb, c * VL, TM_KV_F16));
                u += cnt;
            }
        const int64_t rbk = use_kf ? (int64_t)D * 4 : rb; /* the score loop's K row stride */
        /* scores: sb[x][0..n) */
        for (int64_t x = 0; x < qg; ++x) {
            if (vlo[x] >= vhi[x]) continue; /* this row sees none of these keys */
            const int64_t vis = vhi[x];
            for (int64_t u0 = vlo[x], cnt = 0; u0 < vis; u0 += cnt) {
                pf_advance(&pfc, pf_quota);
                /* up to VL keys of one block (a block size that VL does not divide splits a group) */
                const int64_t p0 = pos0 + u0, off = p0 % bs;
                const char *kb = use_kf ? (const char *)(kf + u0 * D) : kh + ((int64_t)table[p0 / bs] * bs + off) * rb;
                cnt = vis - u0 < VL ? vis - u0 : VL;
                if (bs - off < cnt) cnt = bs - off;
                vf part[VL];
#if defined(TM_AVX512)
                if (use_i) {
                    const vf sc = V_MUL(_mm512_cvtepi32_ps(scores_i8(D, q16[x], kb, rb, cnt)), V_SET1(sq[x]));
                    V_STORE(sb[x] + u0, keep_first(V_MUL(sc, V_LOAD(ks + u0)), cnt, -INFINITY));
                    continue;
                }
#endif
                if (D) { /* the query's D / VL vectors stay in registers across the keys */
                    vf qv[TM_MAX_D / VL];
#pragma GCC unroll 16
                    for (int c = 0; c < D / VL; ++c) qv[c] = V_LOAD(qs[x] + c * VL);
#pragma GCC unroll 16
                    for (int u = 0; u < VL; ++u) {
                        vf a = V_ZERO();
                        if (u < cnt) {
                            const char *kr = kb + u * rbk;
                            if (use_kf) {
#pragma GCC unroll 16
                                for (int c = 0; c < D / VL; ++c) a = V_FMA(qv[c], V_LOAD((const float *)kr + c * VL), a);
                            } else {
#pragma GCC unroll 16
                                for (int c = 0; c < D / VL; ++c) a = V_FMA(qv[c], load_row(kr, c * VL, kv), a);
                            }
                        }
                        part[u] = a;
                    }
                } else {
                    for (int u = 0; u < VL; ++u) {
                        vf a = V_ZERO();
                        if (u < cnt) {
                            const char *kr = kb + u * rb;
                            for (int64_t i = 0; i < d; i += VL) a = V_FMA(V_LOAD(qs[x] + i), load_row(kr, i, kv), a);
                        }
                        part[u] = a;
                    }
                }
                vf sc = reduce_vl(part);
                if (is_int8) sc = V_MUL(sc, V_LOAD(ks + u0));
                V_STORE(sb[x] + u0, keep_first(sc, cnt, -INFINITY));
            }
        }
        /* one online-softmax update per query over the chunk; sb becomes p (times V's row scale) */
        for (int64_t x = 0; x < qg; ++x) {
            if (vlo[x] >= vhi[x]) continue;
            const int64_t vis = vhi[x], s0 = vlo[x];
            vf mx = V_SET1(-INFINITY);
            /* lanes past vis may hold an earlier chunk's scores (a group split at a block end
             * stores VL lanes but fills only its keys): mask them */
            for (int64_t u0 = s0; u0 < vis; u0 += VL)
                mx = _mm_max_helper(mx, keep_first(V_LOAD(sb[x] + u0), vis - u0, -INFINITY));
            const float mb = V_HMAX(mx);
            const float m_new = mb > m[x] ? mb : m[x];
            const float corr = tm_expf(m[x] - m_new);
            const vf mn = V_SET1(m_new);
            vf sum = V_ZERO();
            for (int64_t u0 = s0; u0 < vis; u0 += VL) {
                const int64_t cnt = vis - u0 < VL ? vis - u0 : VL;
                vf p = keep_first(vexp(V_SUB(V_LOAD(sb[x] + u0), mn)), cnt, 0.0f);
                sum = V_ADD(sum, p);
                if (is_int8) p = V_MUL(p, V_LOAD(vs + u0));
                V_STORE(sb[x] + u0, p);
            }
            for (int64_t u = vis; u < n; ++u) sb[x][u] = 0.0f; /* keys past this row's position */
            for (int64_t u = 0; u < s0; ++u) sb[x][u] = 0.0f;  /* and before its window */
            l[x] = l[x] * corr + V_HSUM(sum);
            m[x] = m_new;
            if (corr != 1.0f) {
                const vf c8 = V_SET1(corr);
                for (int64_t i = 0; i < d; i += VL) V_STORE(acc[x] + i, V_MUL(V_LOAD(acc[x] + i), c8));
            }
        }
#if defined(TM_AVX512)
        if (use_i) { /* acc += p V in int16 pairs, a block segment at a time, queries in groups */
            for (int64_t x = 0; x < qg; ++x) {
                if (vlo[x] < vhi[x]) {
                    sw[x] = quantize_w16(sb[x], n, w16[x]);
                } else {
                    sw[x] = 0.0f;
                    memset(w16[x], 0, sizeof w16[x]);
                }
            }
            const int64_t grp = D == 64 ? 4 : 2;
            for (int64_t u0 = 0; u0 < n;) {
                const int64_t p0 = pos0 + u0, off = p0 % bs;
                const int64_t seg = (bs - off < n - u0) ? bs - off : n - u0;
                const char *vb = vh + ((int64_t)table[p0 / bs] * bs + off) * rb;
                pf_advance(&pfc, pf_quota);
                for (int64_t x0 = 0; x0 < qg; x0 += grp) {
                    const int64_t nq = qg - x0 < grp ? qg - x0 : grp;
                    switch (nq) {
                        case 1: pv_i8(1, D, acc + x0, w16 + x0, sw + x0, u0, vb, rb, seg); break;
                        case 2: pv_i8(2, D, acc + x0, w16 + x0, sw + x0, u0, vb, rb, seg); break;
                        case 3: pv_i8(3, D, acc + x0, w16 + x0, sw + x0, u0, vb, rb, seg); break;
                        default: pv_i8(4, D, acc + x0, w16 + x0, sw + x0, u0, vb, rb, seg); break;
                    }
                }
                u0 += seg;
            }
            pf_advance(&pfc, -1);
            continue;
        }
#endif
        /* acc += p V, one block segment at a time, the queries in groups whose sums all fit in
         * registers (each V row loaded once per group). A query that sees none of these keys
         * gets a row of zero probabilities: adding 0 * v leaves its sums as they are (a -0 may
         * become +0), so every query's sums take the same steps in any group and any tile, as
         * they do one query at a time (pv_loop, which stops at each row's last key): a row's
         * output does not depend on its tile. One query at a time (as every tile of more than 6
         * queries ran before), each vector of a query's sums was one chain of dependent FMAs over
         * the keys. Measured with benchmarks/attention_ab.py --prefill (10 x 100 rows after 400
         * cached tokens, SmolLM2's 9 / 3 heads, 30 layers, 2 threads) on a 2-core Xeon: AVX-512
         * fp32 cache 280 -> 193 ms, fp16 286 -> 186 ms; the AVX2 build 415 -> 348 and 366 -> 310
         * ms; decode steps (tiles of 3 queries, grouped as before) unchanged. */
        const int64_t gmax = D ? (24 / (D / VL) < 6 ? 24 / (D / VL) : 6) : 0;
        const int64_t ngrp = gmax > 0 ? (qg + gmax - 1) / gmax : 0, gsz = ngrp > 0 ? (qg + ngrp - 1) / ngrp : 0;
        for (int64_t x = 0; x < qg; ++x) /* (pv_loop skips a row past its position, not one before its window) */
            if (vlo[x] >= vhi[x]) memset(sb[x], 0, sizeof(float) * (size_t)n);
        for (int64_t u0 = 0; u0 < n;) {
            const int64_t p0 = pos0 + u0, off = p0 % bs;
            const int64_t seg = (bs - off < n - u0) ? bs - off : n - u0;
            const char *vb = vh + ((int64_t)table[p0 / bs] * bs + off) * rb;
            pf_advance(&pfc, pf_quota);
            if (gsz > 0) {
                for (int64_t x0 = 0; x0 < qg; x0 += gsz) {
                    switch (qg - x0 < gsz ? qg - x0 : gsz) {
                        case 1: pv_regs(1, D, kv, acc + x0, sb + x0, u0, vb, rb, seg); break;
                        case 2: pv_regs(2, D, kv, acc + x0, sb + x0, u0, vb, rb, seg); break;
                        case 3: pv_regs(3, D, kv, acc + x0, sb + x0, u0, vb, rb, seg); break;
                        case 4: pv_regs(4, D, kv, acc + x0, sb + x0, u0, vb, rb, seg); break;
                        case 5: pv_regs(5, D, kv, acc + x0, sb + x0, u0, vb, rb, seg); break;
                        default: pv_regs(6, D, kv, acc + x0, sb + x0, u0, vb, rb, seg); break;
                    }
                }
            } else {
                pv_loop(qg, d, kv, acc, sb, u0, vb, rb, seg, lim, pos0);
            }
            u0 += seg;
        }
        pf_advance(&pfc, -1);
    }
    for (int64_t x = 0; x < qg; ++x) {
        const int64_t r = r0 + x / g_n, g = x % g_n;
        float *o = j->out + r * j->ldo + (h * g_n + g) * d;
#if defined(TM_AVX512)
        if (use_i) { /* acc is in v_pairs' dim order */
            const float inv1 = l[x] > 0.0f ? 1.0f / l[x] : 0.0f;
            for (int64_t i = 0; i < d; ++i) o[i] = acc[x][pair_pos(i)] * inv1;
            continue;
        }
#endif
        const vf inv = V_SET1(l[x] > 0.0f ? 1.0f / l[x] : 0.0f);
        for (int64_t i = 0; i < d; i += VL) V_STORE(o + i, V_MUL(V_LOAD(acc[x] + i), inv));
    }
}

#if defined(TM_AVX512) && defined(__AVX512BF16__)
#define TM_ATTN_BF16 1
/* ---------------------------------------------------------------- bf16 caches on VDPBF16PS
 * A TM_KV_BF16 cache is read in place by the bf16 dot-product unit: each query (times the softmax scale) is
 * rounded to bf16 once per task, and VDPBF16PS sums exact bf16 x bf16 products in fp32. A group's K pair
 * row i is one vector of 16 keys, so a query's scores over 16 keys are one chain of D / 2 VDPBF16PS
 * against the broadcast pair i of the query (4 queries x 4 groups of keys at a time). The online softmax
 * is the fp32 path's, one update per chunk and query; its probabilities are rounded to bf16 in pairs of
 * keys, and acc += p V is one VDPBF16PS per key pair and 16 dims, against a V pair row of the group. The
 * normaliser sums the probabilities before their rounding. Each score and each output is one chain in a
 * fixed order whatever else the tile holds, so a row's output does not depend on its tile. */

/* sb[x][16 v ..] = scores of NQ queries (pairs qp[x], stride TM_MAX_D / 2) against the key vectors kg[v],
 * v < nv <= 4 (group bases: pair row i at kg[v] + 32 i; past nv any valid group), dp pairs each; keys at
 * positions p0 + 16 v + lane outside [lo[x], lim[x]) score -inf. The sums stay in registers (every index
 * is a compile-time one). */
TM_INLINE void qk_bf16(const int NQ, const int DP, int64_t dp_rt, const uint32_t (*qp)[TM_MAX_D / 2],
                       const uint16_t *const kg[4], int64_t nv, int64_t p0, const int64_t *lim, const int64_t *lo,
                       float (*sb)[TM_CHUNK]) {
    const int64_t dp = DP ? DP : dp_rt;
    __m512 s[4][4];
#pragma GCC unroll 4
    for (int x = 0; x < NQ; ++x)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) s[x][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dp; ++i) {
        __m512bh k[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) k[v] = (__m512bh)_mm512_loadu_si512((const void *)(kg[v] + 32 * i));
#pragma GCC unroll 4
        for (int x = 0; x < NQ; ++x) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)qp[x][i]);
#pragma GCC unroll 4
            for (int v = 0; v < 4; ++v) s[x][v] = _mm512_dpbf16_ps(s[x][v], k[v], w);
        }
    }
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 4
    for (int x = 0; x < NQ; ++x) {
        const __m512i limv = _mm512_set1_epi32((int32_t)lim[x]), lov = _mm512_set1_epi32((int32_t)lo[x]);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)
            if (v < nv) {
                const __m512i pv = _mm512_add_epi32(iota, _mm512_set1_epi32((int32_t)(p0 + 16 * v)));
                const __mmask16 vis = _mm512_cmplt_epi32_mask(pv, limv) & _mm512_cmpge_epi32_mask(pv, lov);
                _mm512_store_ps(sb[x] + 16 * v, _mm512_mask_mov_ps(ninf, vis, s[x][v]));
            }
    }
}

/* acc[x] += sum over key pairs t < npairs of V pair row vr[t] times (p[x][2t], p[x][2t + 1]) = pp[x][t],
 * for NQ queries, D dims (D / 16 vectors); the last pair's second key masked out when `odd` */
TM_INLINE void pv_bf16(const int NQ, const int D, float (*acc)[TM_MAX_D], const uint32_t (*pp)[TM_CHUNK / 2],
                       const uint16_t *const *vr, int64_t npairs, int odd) {
    __m512 a[6][TM_MAX_D / 16];
#pragma GCC unroll 6
    for (int x = 0; x < NQ; ++x)
#pragma GCC unroll 16
        for (int c = 0; c < D / 16; ++c) a[x][c] = _mm512_load_ps(acc[x] + c * 16);
    for (int64_t t = 0; t < npairs; ++t) {
        __m512bh w[6];
#pragma GCC unroll 6
        for (int x = 0; x < NQ; ++x) w[x] = (__m512bh)_mm512_set1_epi32((int)pp[x][t]);
        /* a pair whose second slot lies past the chunk's keys: that slot may hold anything, so keep only
           the first key's halves (its probability is 0, but 0 times a NaN is not) */
        const __m512i keep = _mm512_set1_epi32(odd && t + 1 == npairs ? 0x0000FFFF : -1);
#pragma GCC unroll 16
        for (int c = 0; c < D / 16; ++c) {
            const __m512bh v = (__m512bh)_mm512_and_si512(_mm512_loadu_si512((const void *)(vr[t] + c * 32)), keep);
#pragma GCC unroll 6
            for (int x = 0; x < NQ; ++x) a[x][c] = _mm512_dpbf16_ps(a[x][c], v, w[x]);
        }
    }
#pragma GCC unroll 6
    for (int x = 0; x < NQ; ++x)
#pragma GCC unroll 16
        for (int c = 0; c < D / 16; ++c) _mm512_store_ps(acc[x] + c * 16, a[x][c]);
}

#if defined(TM_HAVE_AMX) && defined(__AMX_BF16__)
#define TM_ATTN_AMX 1
/* ---------------------------------------------------------------- bf16 caches on AMX-BF16 tiles
 * Where the CPU has AMX-BF16 (and tm_bf16_amx allows it), a task's two products run on TDPBF16PS instead:
 * the task's queries (up to 16: the rows of one A tile) against a group's keys are one C tile of 16 x 16
 * scores, sum of D / 32 TDPBF16PS over A = 16 query rows x 16 pairs of dims (qp) and B = 16 pair rows of
 * the group's K (already B's layout: 16 keys x a pair of dims per row); and acc += p V takes, per group,
 * A = 16 rows x 8 pairs of keys of the probabilities (pp) and B = the group's 8 V pair rows (16 dims x a
 * pair of keys per row), acc's 16-dim columns loaded into the C tiles and stored back. The softmax
 * between them is the VDPBF16PS task's. Every tile, whatever its rows, runs this way, so a row's output
 * still does not depend on its tile (the unused rows of A only fill C rows nobody reads). The slots of a
 * chunk's last group past its keys may hold anything: that group's V is copied with them zeroed first
 * (their probability is 0, but 0 times a NaN is not). Tiles (attn_tiles): tmm0-3 C, 16 x 64 bytes;
 * tmm4 the queries, tmm5 K, 16 x 64; tmm6 the probabilities, 16 x 32; tmm7 V, 8 x 64. */
static const tm_tilecfg attn_tiles __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 32, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 8}};

#define QK_AMX_GROUP(T)                                        \
    if (nv > T) {                                              \
        _tile_loadd(5, kg[T] + s * 32, 64);                    \
        _tile_dpbf16ps(T, 4, 5);                               \
    }

/* sb[x][16 v ..] = the scores of query rows x < 16 of qp (dp pairs, a multiple of 16) against groups kg[v],
 * v < nv <= 4, unmasked. */
static inline void qk_amx(const uint32_t (*qp)[TM_MAX_D / 2], const uint16_t *const kg[4], int64_t nv, int64_t dp,
                          float (*sb)[TM_CHUNK]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < dp; s += 16) {
        _tile_loadd(4, qp[0] + s, TM_MAX_D / 2 * 4);
        QK_AMX_GROUP(0)
        QK_AMX_GROUP(1)
        QK_AMX_GROUP(2)
        QK_AMX_GROUP(3)
    }
    _tile_stored(0, sb[0], TM_CHUNK * 4);
    if (nv > 1) _tile_stored(1, sb[0] + 16, TM_CHUNK * 4);
    if (nv > 2) _tile_stored(2, sb[0] + 32, TM_CHUNK * 4);
    if (nv > 3) _tile_stored(3, sb[0] + 48, TM_CHUNK * 4);
}

#define PV_AMX_COL(T)                                              \
    if (nc > T) {                                                  \
        _tile_loadd(7, vg[v] + (c0 + T) * 32, 4 * d);              \
        _tile_dpbf16ps(T, 6, 7);                                   \
    }

/* acc[x][16 c ..] for rows x < 16 and columns c0 <= c < c0 + nc (nc <= 4) += sum over groups v < nv of
 * the probabilities pp[x][8 v .. 8 v + 8) (pairs of keys) times the group's V pair rows vg[v] (stride
 * 4 d bytes). */
static inline void pv_amx(float (*acc)[TM_MAX_D], const uint32_t (*pp)[TM_CHUNK / 2], const uint16_t *const vg[4],
                          int64_t nv, int64_t d, int64_t c0, int64_t nc) {
    _tile_loadd(0, acc[0] + 16 * c0, TM_MAX_D * 4);
    if (nc > 1) _tile_loadd(1, acc[0] + 16 * (c0 + 1), TM_MAX_D * 4);
    if (nc > 2) _tile_loadd(2, acc[0] + 16 * (c0 + 2), TM_MAX_D * 4);
    if (nc > 3) _tile_loadd(3, acc[0] + 16 * (c0 + 3), TM_MAX_D * 4);
    for (int64_t v = 0; v < nv; ++v) {
        _tile_loadd(6, pp[0] + 8 * v, TM_CHUNK / 2 * 4);
        PV_AMX_COL(0)
        PV_AMX_COL(1)
        PV_AMX_COL(2)
        PV_AMX_COL(3)
    }
    _tile_stored(0, acc[0] + 16 * c0, TM_MAX_D * 4);
    if (nc > 1) _tile_stored(1, acc[0] + 16 * (c0 + 1), TM_MAX_D * 4);
    if (nc > 2) _tile_stored(2, acc[0] + 16 * (c0 + 2), TM_MAX_D * 4);
    if (nc > 3) _tile_stored(3, acc[0] + 16 * (c0 + 3), TM_MAX_D * 4);
}
#endif

/* One (tile, KV head) task over a TM_KV_BF16 cache (see above); D is 0 for a runtime head_dim (a multiple
 * of 32, <= 256), or a compile-time 64 / 128. The block size is a multiple of TM_KV_GROUP. AMX: the products on tiles
 * (qk_amx, pv_amx; the thread's tiles configured with attn_tiles), else on VDPBF16PS. */
TM_INLINE void attn_task_bf16(const tm_attn *j, int64_t tile, int64_t h, const int D, const int AMX) {
    const int64_t r0 = j->tiles[2 * tile], nr = j->tiles[2 * tile + 1];
    const int64_t g_n = j->hq / j->hkv, d = D ? D : j->d, bs = j->block_size, qg = nr * g_n, dp = d / 2;
    const int64_t rb = 2 * d;
    const uint16_t *kh = (const uint16_t *)j->k_cache + h * j->s * d;
    const uint16_t *vh = (const uint16_t *)j->v_cache + h * j->s * d;
    const int64_t seq = j->row_seq ? j->row_seq[r0] : r0;
    const int32_t *table = j->block_tables + seq * j->max_blocks;
    uint32_t qp[TM_MAX_QG][TM_MAX_D / 2] __attribute__((aligned(64)));
    float acc[TM_MAX_QG][TM_MAX_D] __attribute__((aligned(64)));
    float sb[TM_MAX_QG][TM_CHUNK] __attribute__((aligned(64))); /* scores, then probabilities */
    uint32_t pp[TM_MAX_QG][TM_CHUNK / 2] __attribute__((aligned(64)));
    float m[TM_MAX_QG] __attribute__((aligned(64))), l[TM_MAX_QG];
    int64_t lim[TM_MAX_QG], lo[TM_MAX_QG];
    int64_t maxlen = 0, minlo = INT64_MAX;
    const __m512 scv = _mm512_set1_ps(j->scale);
    for (int64_t x = 0; x < TM_MAX_QG; ++x) m[x] = -INFINITY; /* lanes past qg too: one vector of them */
    for (int64_t x = 0; x < qg; ++x) {
        const int64_t r = r0 + x / g_n, g = x % g_n;
        const float *src = j->q + r * j->ldq + (h * g_n + g) * d;
        for (int64_t i = 0; i < d; i += 32)
            _mm512_store_si512((void *)(qp[x] + i / 2),
                               (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + i + 16), scv),
                                                            _mm512_mul_ps(_mm512_loadu_ps(src + i), scv)));
        for (int64_t i = 0; i < d; i += 16) _mm512_store_ps(acc[x] + i, _mm512_setzero_ps());
        l[x] = 0.0f;
        query_span(j, r, &lim[x], &lo[x], &maxlen, &minlo);
    }
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const int64_t chunk = bs >= TM_CHUNK ? bs : TM_CHUNK - TM_CHUNK % bs; /* whole blocks */
    const int64_t first = minlo / bs * bs;
    const int64_t gmax = D ? (24 / (D / 16) < 6 ? 24 / (D / 16) : 6) : 0;
    const int64_t ngrp = gmax > 0 ? (qg + gmax - 1) / gmax : 0, gsz = ngrp > 0 ? (qg + ngrp - 1) / ngrp : 0;
    for (int64_t pos0 = first; pos0 < maxlen; pos0 += chunk) {
        const int64_t n = maxlen - pos0 < chunk ? maxlen - pos0 : chunk, nv = (n + 15) / 16;
        pf_cursor pfc;
        if (pos0 + chunk < maxlen) {
            const int64_t nn = maxlen - pos0 - chunk < chunk ? maxlen - pos0 - chunk : chunk;
            pf_set(&pfc, (const char *)kh, (const char *)vh, table, bs, rb, pos0 + chunk, nn);
        } else if (h + 1 < j->hkv) {
            pf_set(&pfc, (const char *)(kh + j->s * d), (const char *)(vh + j->s * d), table, bs, rb, first,
                   maxlen - first < chunk ? maxlen - first : chunk);
        } else {
            prefetch_next_tile(j, tile + TM_PF_TILE, chunk, &pfc);
        }
        const int64_t pf_quota = ((pfc.end - pfc.p) * rb / 64 + 1) / ((qg + 3) / 4 + qg + 2) + 1;
        /* the chunk's groups of 16 slots (a chunk holds whole blocks, a block whole groups); past nv the
           first group again, so that every load is of valid memory (its scores are never used) */
        const uint16_t *kg[TM_CHUNK / 16], *vg[TM_CHUNK / 16];
        for (int64_t v = 0; v < TM_CHUNK / 16; ++v) {
            const int64_t p = pos0 + 16 * (v < nv ? v : 0);
            const int64_t at = ((int64_t)table[p / bs] * bs + p % bs) * d;
            kg[v] = kh + at;
            vg[v] = vh + at;
        }
        /* scores sb[x][0..16 nv), keys the query does not see: -inf */
#if defined(TM_ATTN_AMX)
        if (AMX) {
            pf_advance(&pfc, pf_quota * ((qg + 3) / 4));
            qk_amx(qp, kg, nv, dp, sb);
            for (int64_t x = 0; x < qg; ++x) {
                const __m512i limv = _mm512_set1_epi32((int32_t)lim[x]), lov = _mm512_set1_epi32((int32_t)lo[x]);
                for (int64_t v = 0; v < nv; ++v) {
                    const __m512i pv = _mm512_add_epi32(iota, _mm512_set1_epi32((int32_t)(pos0 + 16 * v)));
                    const __mmask16 vis = _mm512_cmplt_epi32_mask(pv, limv) & _mm512_cmpge_epi32_mask(pv, lov);
                    _mm512_store_ps(sb[x] + 16 * v, _mm512_mask_mov_ps(ninf, vis, _mm512_load_ps(sb[x] + 16 * v)));
                }
            }
        }
#endif
        for (int64_t x0 = 0; x0 < qg && !AMX; x0 += 4) {
            pf_advance(&pfc, pf_quota);
            const int64_t nq = qg - x0 < 4 ? qg - x0 : 4;
            const int64_t *lx = lim + x0, *ox = lo + x0;
            float (*sx)[TM_CHUNK] = sb + x0;
            switch (nq * 4 + (D == 64 ? 1 : (D == 128 ? 2 : 0))) {
                case 5: qk_bf16(1, 32, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 9: qk_bf16(2, 32, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 13: qk_bf16(3, 32, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 17: qk_bf16(4, 32, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 6: qk_bf16(1, 64, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 10: qk_bf16(2, 64, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 14: qk_bf16(3, 64, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 18: qk_bf16(4, 64, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 4: qk_bf16(1, 0, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 8: qk_bf16(2, 0, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                case 12: qk_bf16(3, 0, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
                default: qk_bf16(4, 0, dp, qp + x0, kg, nv, pos0, lx, ox, sx); break;
            }
        }
        /* one online-softmax update per query over the chunk, the queries' maxima and corrections as the
           lanes of one vector; probabilities rounded to bf16 in key pairs */
        float mb[TM_MAX_QG] __attribute__((aligned(64))), corr[TM_MAX_QG] __attribute__((aligned(64)));
        for (int64_t x = 0; x < TM_MAX_QG; ++x) mb[x] = -INFINITY;
        for (int64_t x = 0; x < qg; ++x) {
            __m512 mx = ninf;
            for (int64_t v = 0; v < nv; ++v) mx = _mm512_max_ps(mx, _mm512_load_ps(sb[x] + 16 * v));
            mb[x] = _mm512_reduce_max_ps(mx);
        }
        {
            const __m512 mo = _mm512_load_ps(m), mn = _mm512_max_ps(mo, _mm512_load_ps(mb));
            const __mmask16 seen = _mm512_cmp_ps_mask(mn, ninf, _CMP_NEQ_OQ);
            _mm512_store_ps(corr, _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), seen, vexp(_mm512_sub_ps(mo, mn))));
            _mm512_store_ps(m, mn);
        }
        for (int64_t x = 0; x < qg; ++x) {
            if (m[x] == -INFINITY) { /* no key of this row so far */
                memset(pp[x], 0, sizeof pp[x]);
                continue;
            }
            const __m512 mn = _mm512_set1_ps(m[x]);
            __m512 sum = _mm512_setzero_ps(), p[TM_CHUNK / 16 + 1];
            for (int64_t v = 0; v < nv; ++v) {
                const __m512 sv = _mm512_load_ps(sb[x] + 16 * v);
                const __mmask16 vis = _mm512_cmp_ps_mask(sv, ninf, _CMP_NEQ_OQ);
                p[v] = _mm512_maskz_mov_ps(vis, vexp(_mm512_sub_ps(sv, mn)));
                sum = _mm512_add_ps(sum, p[v]);
            }
            p[nv] = _mm512_setzero_ps();
            for (int64_t v = 0; v < nv; v += 2)
                _mm512_store_si512((void *)(pp[x] + 8 * v), (__m512i)_mm512_cvtne2ps_pbh(p[v + 1], p[v]));
            l[x] = l[x] * corr[x] + _mm512_reduce_add_ps(sum);
            if (corr[x] != 1.0f) {
                const __m512 c = _mm512_set1_ps(corr[x]);
                for (int64_t i = 0; i < d; i += 16) _mm512_store_ps(acc[x] + i, _mm512_mul_ps(_mm512_load_ps(acc[x] + i), c));
            }
        }
        /* acc += p V over the chunk's key pairs, the queries in groups whose sums fit in registers */
        const int64_t npairs = (n + 1) / 2;
        const uint16_t *vr[TM_CHUNK / 2];
        for (int64_t t = 0; t < npairs; ++t) vr[t] = vg[t / 8] + (t % 8) * 2 * d;
        const int odd = (int)(n & 1);
        pf_advance(&pfc, -1);
#if defined(TM_ATTN_AMX)
        if (AMX) {
            uint32_t vlast[TM_KV_GROUP / 2 * TM_MAX_D] __attribute__((aligned(64)));
            const int64_t tail = n % TM_KV_GROUP;
            if (tail) { /* the last group's slots past the keys, zeroed (see above): whole pair rows copied,
                           the odd key's row keeps its first halves, the rest is zero */
                const uint32_t *src = (const uint32_t *)vg[nv - 1];
                const int64_t full = tail / 2;
                memcpy(vlast, src, sizeof(uint32_t) * (size_t)(full * d));
                int64_t t = full;
                if (tail & 1) {
                    for (int64_t e = 0; e < d; e += 16)
                        _mm512_store_si512((void *)(vlast + t * d + e), _mm512_and_si512(_mm512_loadu_si512((const void *)(src + t * d + e)),
                                                                                   _mm512_set1_epi32(0x0000FFFF)));
                    ++t;
                }
                memset(vlast + t * d, 0, sizeof(uint32_t) * (size_t)((TM_KV_GROUP / 2 - t) * d));
                vg[nv - 1] = (const uint16_t *)vlast;
            }
            for (int64_t c0 = 0; c0 < d / 16; c0 += 4) pv_amx(acc, pp, vg, nv, d, c0, d / 16 - c0 < 4 ? d / 16 - c0 : 4);
            continue;
        }
#endif
        if (gsz > 0) {
            for (int64_t x0 = 0; x0 < qg; x0 += gsz) {
                switch (qg - x0 < gsz ? qg - x0 : gsz) {
                    case 1: pv_bf16(1, D, acc + x0, pp + x0, vr, npairs, odd); break;
                    case 2: pv_bf16(2, D, acc + x0, pp + x0, vr, npairs, odd); break;
                    case 3: pv_bf16(3, D, acc + x0, pp + x0, vr, npairs, odd); break;
                    case 4: pv_bf16(4, D, acc + x0, pp + x0, vr, npairs, odd); break;
                    case 5: pv_bf16(5, D, acc + x0, pp + x0, vr, npairs, odd); break;
                    default: pv_bf16(6, D, acc + x0, pp + x0, vr, npairs, odd); break;
                }
            }
        } else {
            for (int64_t x = 0; x < qg; ++x)
                for (int64_t t = 0; t < npairs; ++t) {
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[x][t]);
                    const __m512i keep = _mm512_set1_epi32(odd && t + 1 == npairs ? 0x0000FFFF : -1);
                    for (int64_t i = 0; i < d; i += 16) {
                        const __m512bh v = (__m512bh)_mm512_and_si512(_mm512_loadu_si512((const void *)(vr[t] + 2 * i)), keep);
                        _mm512_store_ps(acc[x] + i, _mm512_dpbf16_ps(_mm512_load_ps(acc[x] + i), v, w));
                    }
                }
        }
    }
    for (int64_t x = 0; x < qg; ++x) {
        const int64_t r = r0 + x / g_n, g = x % g_n;
        float *o = j->out + r * j->ldo + (h * g_n + g) * d;
        const __m512 inv = _mm512_set1_ps(l[x] > 0.0f ? 1.0f / l[x] : 0.0f);
        for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_load_ps(acc[x] + i), inv));
    }
}
#endif
#endif

/* Start fetching the first lines of the blocks holding a tile's first TM_CHUNK keys, K and V,
 * for every KV head (the hardware streamer follows within a block): decode attention over
 * cold KV is bound by memory, so starting the loads early hides part of their latency
 * (benchmarks/results/epyc-zen5-avx512bf16/attention_bench.json). */
static void prefetch_tile(const tm_attn *j, int64_t tile) {
    const int64_t r0 = j->tiles[2 * tile], nr = j->tiles[2 * tile + 1];
    const int64_t seq = j->row_seq ? j->row_seq[r0] : r0;
    const int32_t *table = j->block_tables + seq * j->max_blocks;
    const int64_t len = j->kv_len[r0 + nr - 1], bs = j->block_size;
    const int64_t first = win_lo(j, j->kv_len[r0]) / bs * bs;
    const int64_t rb = tm_kv_row_bytes(j->kv, j->d);
    for (int64_t h = 0; h < j->hkv; ++h) {
        const char *kh = (const char *)j->k_cache + h * j->s * rb, *vh = (const char *)j->v_cache + h * j->s * rb;
        for (int64_t p = first; p < first + TM_CHUNK && p < len; p += bs) {
            const int64_t at = (int64_t)table[p / bs] * bs * rb, bytes = (len - p < bs ? len - p : bs) * rb;
            for (int64_t off = 0; off < bytes && off < 2 * 64; off += 64) { /* the streamer does the rest */
                __builtin_prefetch(kh + at + off, 0, 3);
                __builtin_prefetch(vh + at + off, 0, 3);
            }
        }
    }
}

static void attn_tile(const tm_attn *j, int64_t tile);

/* One pool chunk is one tile, all its KV heads in turn (its blocks fetched up front; the tiles configured
 * for the AMX task around it). */
static void attn_chunk(void *vctx, int64_t tile) {
    const tm_attn *j = (const tm_attn *)vctx;
#if defined(TM_ATTN_AMX)
    if (j->amx) _tile_loadconfig(&attn_tiles);
#endif
    attn_tile(j, tile);
#if defined(TM_ATTN_AMX)
    if (j->amx) _tile_release();
#endif
}

static void attn_tile(const tm_attn *j, int64_t tile) {
    prefetch_tile(j, tile);
    for (int64_t h = 0; h < j->hkv; ++h) {
        if (j->kv == TM_KV_BF16) {
#if defined(TM_ATTN_AMX)
            if (j->amx) {
                attn_task_bf16(j, tile, h, 0, 1);
                continue;
            }
#endif
#if defined(TM_ATTN_BF16)
            if (j->d == 64)
                attn_task_bf16(j, tile, h, 64, 0);
            else if (j->d == 128)
                attn_task_bf16(j, tile, h, 128, 0);
            else
                attn_task_bf16(j, tile, h, 0, 0);
#else
            attn_task_generic(j, tile, h); /* fp32 arithmetic over the bf16 values */
#endif
            continue;
        }
#if defined(TM_AVX512) || defined(TM_AVX2)
        if (j->d % VL == 0) {
            /* compile-time (row format, head_dim) pairs, so that the loads and loops specialise */
            const int kv = j->kv, d = (int)j->d;
            if (d == 64 && kv == TM_KV_I8)
                attn_task_simd(j, tile, h, TM_KV_I8, 64);
            else if (d == 64 && kv == TM_KV_F16)
                attn_task_simd(j, tile, h, TM_KV_F16, 64);
            else if (d == 64)
                attn_task_simd(j, tile, h, TM_KV_F32, 64);
            else if (d == 128 && kv == TM_KV_I8)
                attn_task_simd(j, tile, h, TM_KV_I8, 128);
            else if (d == 128 && kv == TM_KV_F16)
                attn_task_simd(j, tile, h, TM_KV_F16, 128);
            else if (d == 128)
                attn_task_simd(j, tile, h, TM_KV_F32, 128);
            else if (kv == TM_KV_I8)
                attn_task_simd(j, tile, h, TM_KV_I8, 0);
            else if (kv == TM_KV_F16)
                attn_task_simd(j, tile, h, TM_KV_F16, 0);
            else
                attn_task_simd(j, tile, h, TM_KV_F32, 0);
            continue;
        }
#endif
        attn_task_generic(j, tile, h);
    }
}

/* Rows a tile may hold for g query heads per KV head (a task serves rows x g <= 16 queries). */
int tm_attention_tile_rows(int64_t g) { return g >= TM_MAX_QG ? 1 : (int)(TM_MAX_QG / (g > 0 ? g : 1)); }

/* 1 if this build reads TM_KV_BF16 caches on VDPBF16PS (AVX-512 with AVX512-BF16), 0 if it widens their
 * values to fp32 one at a time (the plain-C task: correct, slow). */
int tm_attention_bf16(void) {
#if defined(TM_ATTN_BF16)
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, or -1 for a shape this build does not serve (G > 16, D > 256, block size > 64,
 * a tile of more rows than tm_attention_tile_rows allows, or a negative window; for a TM_KV_BF16
 * cache also a block size or slot count that is not a multiple of TM_KV_GROUP, or D not a multiple
 * of 32). */
int tm_paged_attention(const float *q, int64_t ldq, const void *k_cache, const void *v_cache, int kv,
                       const int32_t *block_tables, int64_t max_blocks, const int32_t *row_seq,
                       const int64_t *kv_len, const int64_t *tiles, int64_t num_tiles, float *out, int64_t ldo,
                       int64_t hq, int64_t hkv, int64_t d, int64_t s, int64_t block_size, float scale,
                       int64_t window) {
    if (window < 0) return -1;
    if (hkv <= 0 || hq % hkv != 0 || hq / hkv > TM_MAX_G || d > TM_MAX_D || block_size > TM_MAX_BS) return -1;
    if (kv != TM_KV_F32 && kv != TM_KV_I8 && kv != TM_KV_F16 && kv != TM_KV_BF16) return -1;
    if (kv == TM_KV_BF16 && (block_size % TM_KV_GROUP || s % TM_KV_GROUP || d % 32)) return -1;
    const int64_t rows_max = tm_attention_tile_rows(hq / hkv);
    for (int64_t t = 0; t < num_tiles; ++t)
        if (tiles[2 * t + 1] < 1 || tiles[2 * t + 1] > rows_max) return -1;
    tm_attn j = {.q = q, .ldq = ldq, .k_cache = k_cache, .v_cache = v_cache, .kv = kv,
                 .block_tables = block_tables, .max_blocks = max_blocks, .row_seq = row_seq, .kv_len = kv_len,
                 .tiles = tiles, .num_tiles = num_tiles, .out = out, .ldo = ldo, .hq = hq, .hkv = hkv, .d = d, .s = s,
                 .block_size = block_size, .scale = scale, .window = window};
#if defined(TM_ATTN_AMX)
    j.amx = kv == TM_KV_BF16 && tm_bf16_amx(-1);
#endif
    tm_parallel_for(num_tiles, attn_chunk, &j);
    return 0;
}
