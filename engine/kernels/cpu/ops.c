/*
 * The small per-layer ops of a decoder step, each one pass over its data:
 *   tm_rms_norm   y = x / sqrt(mean(x^2) + eps) * w        (Zhang & Sennrich 2019, arXiv 1910.07467)
 *   tm_rope       rotary embedding in place, "rotate half" pairs (i, i + D/2)
 *                 (Su et al. 2021, arXiv 2104.09864), angles from cos/sin tables
 *   tm_silu_mul   out = silu(g) * u for a fused [g | u] row  (SwiGLU, Shazeer 2020, arXiv 2002.05202)
 *   tm_kv_write   new K/V rows into the paged cache at their slots, fp32, int8 or fp16 rows
 *                 (D codes + the fp32 scale max|x| / 127, as engine/attention/torch_quant_kv.py;
 *                 with AVX-512 a row is coded in vectors, the same max, division and rounding)
 *   tm_argmax_rows  the index of each row's largest value (greedy sampling), the first on ties
 * Rows are shared out over the thread pool in chunks when there are many of them.
 */
#include "tm_cpu.h"

#include <math.h>
#include <string.h>

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* rows per chunk: at most about 32k elements, and 2 chunks per thread where there are rows for it
 * (64 rows of 576 in chunks of 56 left one thread 8 rows and the other 56: 60 RMSNorms of a batch-64
 * decode step took 0.59-0.63 ms, in chunks of 16 rows 0.42-0.45, on a 2-core Xeon) */
static inline int64_t rows_per_chunk(int64_t cols, int64_t rows) {
    int64_t r = 32768 / (cols > 0 ? cols : 1);
    const int64_t per = 2 * (int64_t)tm_get_num_threads(), even = (rows + per - 1) / per;
    if (even < r) r = even;
    return r < 1 ? 1 : r;
}

/* ---------------------------------------------------------------- RMSNorm */

typedef struct {
    const float *x, *w;
    float *y;
    int64_t ldx, ldy, m, k, rpc;
    float eps;
} norm_ctx;

static void norm_chunk(void *vctx, int64_t chunk) {
    const norm_ctx *c = (const norm_ctx *)vctx;
    const int64_t r0 = chunk * c->rpc, r1 = r0 + c->rpc < c->m ? r0 + c->rpc : c->m;
    for (int64_t r = r0; r < r1; ++r) {
        const float *x = c->x + r * c->ldx;
        float *y = c->y + r * c->ldy;
        float ss = 0.0f;
        for (int64_t i = 0; i < c->k; ++i) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)c->k + c->eps);
        for (int64_t i = 0; i < c->k; ++i) y[i] = c->w[i] * (x[i] * inv);
    }
}

void tm_rms_norm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t m, int64_t k,
                 float eps) {
    norm_ctx c = {.x = x, .w = w, .y = y, .ldx = ldx, .ldy = ldy, .m = m, .k = k, .rpc = rows_per_chunk(k, m),
                  .eps = eps};
    tm_parallel_for(cdiv(m, c.rpc), norm_chunk, &c);
}

/* ---------------------------------------------------------------- RoPE */

typedef struct {
    float *x;
    int64_t ldx, t, heads, d, rpc;
    const int64_t *pos;
    const float *cos_t, *sin_t; /* [max_pos, d / 2] */
} rope_ctx;

static void rope_chunk(void *vctx, int64_t chunk) {
    const rope_ctx *c = (const rope_ctx *)vctx;
    const int64_t half = c->d / 2;
    const int64_t r0 = chunk * c->rpc, r1 = r0 + c->rpc < c->t ? r0 + c->rpc : c->t;
    for (int64_t r = r0; r < r1; ++r) {
        const float *cs = c->cos_t + c->pos[r] * half, *sn = c->sin_t + c->pos[r] * half;
        for (int64_t h = 0; h < c->heads; ++h) {
            float *restrict x1 = c->x + r * c->ldx + h * c->d;
            float *restrict x2 = x1 + half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * cs[i] - b * sn[i];
                x2[i] = b * cs[i] + a * sn[i];
            }
        }
    }
}

/* x: [t, heads * d] rows of stride ldx (e.g. the q and k heads at the start of a fused qkv row). */
void tm_rope(float *x, int64_t ldx, int64_t t, int64_t heads, int64_t d, const int64_t *positions,
             const float *cos_t, const float *sin_t) {
    rope_ctx c = {.x = x, .ldx = ldx, .t = t, .heads = heads, .d = d, .rpc = rows_per_chunk(heads * d, t),
                  .pos = positions, .cos_t = cos_t, .sin_t = sin_t};
    tm_parallel_for(cdiv(t, c.rpc), rope_chunk, &c);
}

/* ---------------------------------------------------------------- SiLU * up */

typedef struct {
    const float *gu;
    float *out;
    int64_t ldg, ldo, m, n, rpc;
} silu_ctx;

static void silu_chunk(void *vctx, int64_t chunk) {
    const silu_ctx *c = (const silu_ctx *)vctx;
    const int64_t r0 = chunk * c->rpc, r1 = r0 + c->rpc < c->m ? r0 + c->rpc : c->m;
    for (int64_t r = r0; r < r1; ++r) {
        const float *restrict g = c->gu + r * c->ldg;
        const float *restrict u = g + c->n;
        float *restrict o = c->out + r * c->ldo;
        for (int64_t i = 0; i < c->n; ++i) o[i] = tm_silu_mul1(g[i], u[i]);
    }
}

/* gu: [m, 2n] rows [gate | up] of stride ldg; out: [m, n] of stride ldo. */
void tm_silu_mul(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t m, int64_t n) {
    silu_ctx c = {.gu = gu, .out = out, .ldg = ldg, .ldo = ldo, .m = m, .n = n, .rpc = rows_per_chunk(3 * n, m)};
    tm_parallel_for(cdiv(m, c.rpc), silu_chunk, &c);
}

/* ---------------------------------------------------------------- KV write */

typedef struct {
    const float *k, *v;
    int64_t ldk, ldv, t, hkv, d, s, rpc;
    const int64_t *slots;
    void *kc, *vc;
    int kv; /* TM_KV_* (tm_cpu.h) */
} kvw_ctx;

static void write_row(const float *src, void *cache, int64_t h, int64_t slot, int64_t s, int64_t d, int kv,
                      int is_v) {
    if (kv == TM_KV_BF16) { /* the group layout (tm_cpu.h): K pairs strided by the group, V values by 2 */
        uint16_t *grp = (uint16_t *)cache + (h * s + slot / TM_KV_GROUP * TM_KV_GROUP) * d;
        const int64_t o = slot % TM_KV_GROUP;
        uint16_t *dst = is_v ? grp + (o / 2) * d * 2 + o % 2 : grp + o * 2; /* dim 0's place */
        const int64_t step = is_v ? 4 : 2 * TM_KV_GROUP;                     /* from one pair of dims to the next */
        int64_t e = 0;
#if defined(TM_AVX512) && defined(__AVX512BF16__)
        if (is_v) { /* 16 dims at a time: each value in its half of a pair, one masked store */
            const __mmask32 half = o % 2 ? 0xAAAAAAAAu : 0x55555555u;
            for (; e + 16 <= d; e += 16) {
                const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + e));
                __m512i w = _mm512_cvtepu16_epi32(b);
                if (o % 2) w = _mm512_slli_epi32(w, 16);
                _mm512_mask_storeu_epi16(dst - o % 2 + 2 * e, half, w);
            }
        } else { /* the pairs of 32 dims, one 32-bit store each, a group's pair row apart */
            for (; e + 32 <= d; e += 32) {
                uint32_t b[16];
                _mm512_storeu_si512((void *)b, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + e + 16),
                                                                            _mm512_loadu_ps(src + e)));
                for (int i = 0; i < 16; ++i) memcpy(dst + (e / 2 + i) * step, &b[i], 4);
            }
        }
#endif
        for (; e < d; ++e) dst[e / 2 * step + (e % 2) * (is_v ? 2 : 1)] = tm_float_to_bf16(src[e]);
        return;
    }
    if (kv == TM_KV_F32) {
        memcpy((float *)cache + (h * s + slot) * d, src, sizeof(float) * d);
        return;
    }
    if (kv == TM_KV_F16) { /* round to nearest even, as torch's .to(torch.float16) */
        uint16_t *row = (uint16_t *)cache + (h * s + slot) * d;
        int64_t i = 0;
#if defined(TM_AVX512)
        for (; i + 16 <= d; i += 16)
            _mm256_storeu_si256((__m256i *)(row + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(TM_AVX2) && defined(__F16C__)
        for (; i + 8 <= d; i += 8)
            _mm_storeu_si128((__m128i *)(row + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
        for (; i < d; ++i) row[i] = tm_float_to_half(src[i]);
        return;
    }
    int8_t *row = (int8_t *)cache + (h * s + slot) * (d + 4);
#if defined(TM_AVX512)
    if (d % 16 == 0) { /* the same arithmetic in vectors: the max skips a NaN as below, x / scale, rint */
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(src + i)), vmax);
        float scale = _mm512_reduce_max_ps(vmax) / 127.0f;
        if (scale < 1e-12f) scale = 1e-12f;
        const __m512 vs = _mm512_set1_ps(scale), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
        for (int64_t i = 0; i < d; i += 16) {
            __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(src + i), vs),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_max_ps(_mm512_min_ps(q, hi), lo);
            _mm_storeu_si128((__m128i *)(row + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
        }
        memcpy(row + d, &scale, sizeof scale);
        return;
    }
#endif
    const float amax = tm_absmax(src, d);
    float scale = amax / 127.0f;
    if (scale < 1e-12f) scale = 1e-12f;
    for (int64_t i = 0; i < d; ++i) {
        float q = rintf(src[i] / scale);
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        row[i] = (int8_t)q;
    }
    memcpy(row + d, &scale, sizeof scale);
}

/* Ask for the lines a token's bf16 group write touches, for writing: D / 2 lines of K (one per pair
 * row) and D / 16 of V per KV head. A decode step's tokens land in groups far apart, usually out of
 * cache, and each of those partial-line stores waited for its own line; issued two tokens ahead, the
 * lines arrive together. */
#define KVW_AHEAD 2
static void prefetch_bf16_slot(const kvw_ctx *c, int64_t slot) {
    const int64_t o = slot % TM_KV_GROUP;
    for (int64_t h = 0; h < c->hkv; ++h) {
        const int64_t base = (h * c->s + slot / TM_KV_GROUP * TM_KV_GROUP) * c->d;
        const char *k = (const char *)((uint16_t *)c->kc + base + o * 2);
        const char *v = (const char *)((uint16_t *)c->vc + base + (o / 2) * c->d * 2);
        for (int64_t i = 0; i < c->d / 2; ++i) __builtin_prefetch(k + i * 4 * TM_KV_GROUP, 1, 3);
        for (int64_t b = 0; b < c->d * 4; b += 64) __builtin_prefetch(v + b, 1, 3);
    }
}

static void kvw_chunk(void *vctx, int64_t chunk) {
    const kvw_ctx *c = (const kvw_ctx *)vctx;
    const int64_t r0 = chunk * c->rpc, r1 = r0 + c->rpc < c->t ? r0 + c->rpc : c->t;
    if (c->kv == TM_KV_BF16)
        for (int64_t r = r0; r < r0 + KVW_AHEAD && r < r1; ++r) prefetch_bf16_slot(c, c->slots[r]);
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t slot = c->slots[r];
        if (c->kv == TM_KV_BF16 && r + KVW_AHEAD < r1) prefetch_bf16_slot(c, c->slots[r + KVW_AHEAD]);
        for (int64_t h = 0; h < c->hkv; ++h) {
            write_row(c->k + r * c->ldk + h * c->d, c->kc, h, slot, c->s, c->d, c->kv, 0);
            write_row(c->v + r * c->ldv + h * c->d, c->vc, h, slot, c->s, c->d, c->kv, 1);
        }
    }
}

/* k, v: [t, hkv * d] rows (strides ldk, ldv); caches [hkv, s, d] fp32 (kv = TM_KV_F32), fp16
 * (TM_KV_F16) or bf16 in groups of 16 slots (TM_KV_BF16), or [hkv, s, d + 4] int8 rows (TM_KV_I8);
 * row r goes to slot slots[r]. */
void tm_kv_write(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t t, int64_t hkv, int64_t d,
                 const int64_t *slots, void *k_cache, void *v_cache, int64_t s, int kv) {
    /* 8 tokens a chunk: even shares; a group of a bf16 cache spreads each token over D / 2 lines of its K,
       so consecutive tokens go to one thread, 32 at a time (two threads writing one line take turns) */
    kvw_ctx c = {.k = k, .v = v, .ldk = ldk, .ldv = ldv, .t = t, .hkv = hkv, .d = d, .s = s,
                 .rpc = kv == TM_KV_BF16 ? 2 * TM_KV_GROUP : 8, .slots = slots, .kc = k_cache, .vc = v_cache,
                 .kv = kv};
    tm_parallel_for(cdiv(t, c.rpc), kvw_chunk, &c);
}

/* ---------------------------------------------------------------- argmax */

typedef struct {
    const float *x;
    int64_t ldx, n;
    int64_t *out;
} argmax_ctx;

static void argmax_chunk(void *vctx, int64_t r) {
    const argmax_ctx *c = (const argmax_ctx *)vctx;
    const float *x = c->x + r * c->ldx;
    const int64_t n = c->n;
    float best = -INFINITY;
    int64_t best_i = 0, i = 0;
#if defined(TM_AVX512)
    if (n >= 16) { /* per lane the first maximum, then the lowest index among the lanes that hold it */
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __m512i vidx = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        for (; i + 16 <= n; i += 16, cur = _mm512_add_epi32(cur, step)) {
            const __m512 v = _mm512_loadu_ps(x + i);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
            vmax = _mm512_mask_mov_ps(vmax, gt, v);
            vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
        }
        best = _mm512_reduce_max_ps(vmax);
        const __mmask16 eq = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_i = _mm512_mask_reduce_min_epi32(eq, vidx);
    }
#endif
    for (; i < n; ++i)
        if (x[i] > best) {
            best = x[i];
            best_i = i;
        }
    c->out[r] = best_i;
}

/* out[r] = the index of the largest value of row r of x [m, n] (row stride ldx), the first one on
 * ties, as torch.argmax; a NaN is never chosen, and a row with nothing above -inf gives 0. */
void tm_argmax_rows(const float *x, int64_t ldx, int64_t m, int64_t n, int64_t *out) {
    argmax_ctx c = {.x = x, .ldx = ldx, .n = n, .out = out};
    tm_parallel_for(m, argmax_chunk, &c);
}
