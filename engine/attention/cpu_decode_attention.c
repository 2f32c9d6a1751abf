/*
 * Paged decode attention for the CPU, reading KV blocks where they lie.
 *
 * One query token per sequence attends over that sequence's KV, found block by
 * block through its block table, with an online softmax (running max and
 * running sum, as in FlashAttention, arXiv 2205.14135, and its split form for
 * decoding). Nothing is gathered or padded: each (sequence, KV head) task reads
 * its blocks in place and serves the G query heads of its group (GQA) with
 * one pass over K and V.
 *
 * Layout (contiguous):
 *   q            [B, Hq, D] fp32
 *   k/v_cache    [Hkv, S, D] fp32, S = num_blocks * block_size slots (head-major);
 *                or, for the int8 cache, [Hkv, S, D + 4] bytes: D int8 codes and the
 *                row's fp32 scale (value = code * scale; the layout of torch_quant_kv.py)
 *   block_tables [B, max_blocks] int32
 *   seq_lens     [B] int64     KV length of each sequence (its new token included)
 *   out          [B, Hq, D]
 *
 * With AVX2 and FMA (and head_dim a multiple of 8) the task runs an explicit-SIMD
 * version: scores of 8 tokens summed across lanes together, output accumulators
 * kept in registers over a block's tokens, the next block prefetched; otherwise a
 * plain-C version the compiler vectorizes (also built with -DTM_GENERIC, for the tests).
 *
 * Threads: the (sequence, KV head) tasks are cut into num_threads contiguous
 * ranges of about equal KV length; the calling thread runs the last range.
 * Built by engine/attention/cpu_kernel.py with -O3 -march=native.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define TM_MAX_G 16
#define TM_MAX_D 256
#define TM_MAX_BS 64
#define TM_MAX_THREADS 64

/* exp(x) for x <= 0, vectorizable: 2^(x log2 e) = 2^n * 2^f with n = round,
 * |f| <= 0.5, 2^f from its degree-6 Taylor polynomial in f ln 2 (relative
 * error below 2e-7 on that interval). Inputs below -87 give 0. */
static inline float tm_exp_nonpos(float x) {
    if (x < -87.0f) x = -87.0f;
    float t = x * 1.44269504088896341f;
    float n = __builtin_rintf(t);
    float r = (t - n) * 0.69314718055994531f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.0083333338f + r * 0.0013888889f)))));
    union { float f; int32_t i; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

static inline float tm_dot(const float *restrict a, const float *restrict b, int64_t d) {
    float s = 0.0f;
    for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
    return s;
}

static inline float tm_dot_i8(const float *restrict a, const int8_t *restrict b, int64_t d) {
    float s = 0.0f;
    for (int64_t i = 0; i < d; ++i) s += a[i] * (float)b[i];
    return s;
}

static inline float tm_row_scale(const int8_t *row, int64_t d) {
    float sc;
    memcpy(&sc, row + d, sizeof sc);
    return sc;
}

/* One block's online-softmax step for one query head: p[0..n) holds scaled scores and becomes
 * exp(score - new max); m and l (running max and sum) are updated; returns the factor that
 * rescales the accumulator, exp(old max - new max) (0 on the first block). */
static inline float tm_softmax_block(float *p, int64_t n, float *m, float *l) {
    float mb = -INFINITY;
    for (int64_t t = 0; t < n; ++t) mb = p[t] > mb ? p[t] : mb;
    const float m_new = mb > *m ? mb : *m;
    const float corr = tm_exp_nonpos(*m - m_new);
    float sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) {
        p[t] = tm_exp_nonpos(p[t] - m_new);
        sum += p[t];
    }
    *l = *l * corr + sum;
    *m = m_new;
    return corr;
}

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    int is_int8;
    const int32_t *block_tables;
    const int64_t *seq_lens;
    float *out;
    int64_t hq, hkv, d, s, max_blocks, block_size;
    float scale;
    int64_t task_begin, task_end;
} tm_job;

static void tm_run_task(const tm_job *j, int64_t task) {
    const int64_t b = task / j->hkv, h = task % j->hkv;
    const int64_t g_n = j->hq / j->hkv, d = j->d, bs = j->block_size;
    const int64_t len = j->seq_lens[b];
    const float *q = j->q + (b * j->hq + h * g_n) * d;
    const int64_t row = j->is_int8 ? d + 4 : d * 4; /* bytes per (head, slot) row */
    const char *kh = (const char *)j->k_cache + h * j->s * row;
    const char *vh = (const char *)j->v_cache + h * j->s * row;
    const int32_t *table = j->block_tables + b * j->max_blocks;
    float acc[TM_MAX_G][TM_MAX_D];
    float m[TM_MAX_G], l[TM_MAX_G], p[TM_MAX_G][TM_MAX_BS];
    for (int64_t g = 0; g < g_n; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        memset(acc[g], 0, sizeof(float) * d);
    }
    const int64_t nblk = (len + bs - 1) / bs;
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t n = (blk == nblk - 1) ? len - blk * bs : bs;
        const int64_t slot = (int64_t)table[blk] * bs;
        const char *kb = kh + slot * row, *vb = vh + slot * row;
        for (int64_t g = 0; g < g_n; ++g) {
            const float *qg = q + g * d;
            for (int64_t t = 0; t < n; ++t) {
                const char *kr = kb + t * row;
                if (j->is_int8)
                    p[g][t] = tm_dot_i8(qg, (const int8_t *)kr, d) * tm_row_scale((const int8_t *)kr, d) * j->scale;
                else
                    p[g][t] = tm_dot(qg, (const float *)kr, d) * j->scale;
            }
            const float corr = tm_softmax_block(p[g], n, &m[g], &l[g]);
            float *restrict a = acc[g];
            if (corr != 1.0f)
                for (int64_t i = 0; i < d; ++i) a[i] *= corr;
            for (int64_t t = 0; t < n; ++t) {
                const char *vrow = vb + t * row;
                if (j->is_int8) {
                    const int8_t *restrict vr = (const int8_t *)vrow;
                    const float w = p[g][t] * tm_row_scale(vr, d);
                    for (int64_t i = 0; i < d; ++i) a[i] += w * (float)vr[i];
                } else {
                    const float *restrict vr = (const float *)vrow;
                    const float w = p[g][t];
                    for (int64_t i = 0; i < d; ++i) a[i] += w * vr[i];
                }
            }
        }
    }
    for (int64_t g = 0; g < g_n; ++g) {
        float *o = j->out + (b * j->hq + h * g_n + g) * d;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t i = 0; i < d; ++i) o[i] = acc[g][i] * inv;
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(TM_GENERIC)
#include <immintrin.h>
#define TM_HAVE_AVX2 1

/* 8 consecutive K/V values of a row as fp32 (int8 codes widened; the row scale is applied
 * by the caller). `is_int8` is a constant at each call site, so the branch folds away. */
static inline __attribute__((always_inline)) __m256 tm_load8(const char *row, int64_t i, int is_int8) {
    if (is_int8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
    return _mm256_loadu_ps((const float *)row + i);
}

/* Horizontal sums of 8 vectors, as one vector: lane u = sum of the lanes of v[u]. */
static inline __m256 tm_reduce8(const __m256 v[8]) {
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
    /* a = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low/high 128-bit halves), b likewise for 4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* The same task as tm_run_task, for head_dim a multiple of 8, with scores of 8 tokens
 * reduced together (no per-dot horizontal sum) and the output accumulators of a 32-value
 * slice held in registers across the tokens of a block. */
static inline __attribute__((always_inline)) void tm_run_task_avx2_impl(const tm_job *j, int64_t task,
                                                                        int is_int8) {
    const int64_t b = task / j->hkv, h = task % j->hkv;
    const int64_t g_n = j->hq / j->hkv, d = j->d, bs = j->block_size;
    const int64_t len = j->seq_lens[b];
    const float *q = j->q + (b * j->hq + h * g_n) * d;
    const int64_t row = is_int8 ? d + 4 : d * 4;
    const char *kh = (const char *)j->k_cache + h * j->s * row;
    const char *vh = (const char *)j->v_cache + h * j->s * row;
    const int32_t *table = j->block_tables + b * j->max_blocks;
    float acc[TM_MAX_G][TM_MAX_D] __attribute__((aligned(32)));
    float m[TM_MAX_G], l[TM_MAX_G];
    float p[TM_MAX_G][TM_MAX_BS + 8] __attribute__((aligned(32)));
    float ks[TM_MAX_BS], vs[TM_MAX_BS];
    for (int64_t g = 0; g < g_n; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        memset(acc[g], 0, sizeof(float) * d);
    }
    const int64_t nblk = (len + bs - 1) / bs;
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t n = (blk == nblk - 1) ? len - blk * bs : bs;
        const int64_t slot = (int64_t)table[blk] * bs;
        const char *kb = kh + slot * row, *vb = vh + slot * row;
        if (blk + 1 < nblk) { /* the next block lies elsewhere: start fetching it now */
            const int64_t next = (int64_t)table[blk + 1] * bs * row, bytes = bs * row;
            for (int64_t off = 0; off < bytes; off += 64) {
                __builtin_prefetch(kh + next + off, 0, 3);
                __builtin_prefetch(vh + next + off, 0, 3);
            }
        }
        for (int64_t t = 0; t < n; ++t) {
            ks[t] = is_int8 ? tm_row_scale((const int8_t *)(kb + t * row), d) * j->scale : j->scale;
            vs[t] = is_int8 ? tm_row_scale((const int8_t *)(vb + t * row), d) : 1.0f;
        }
        for (int64_t g = 0; g < g_n; ++g) {
            const float *qg = q + g * d;
            float *pg = p[g];
            /* scores, 8 tokens at a time */
            for (int64_t t0 = 0; t0 < n; t0 += 8) {
                __m256 part[8];
                for (int u = 0; u < 8; ++u) {
                    __m256 sacc = _mm256_setzero_ps();
                    if (t0 + u < n) {
                        const char *kr = kb + (t0 + u) * row;
                        for (int64_t i = 0; i < d; i += 8)
                            sacc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), tm_load8(kr, i, is_int8), sacc);
                    }
                    part[u] = sacc;
                }
                _mm256_storeu_ps(pg + t0, tm_reduce8(part));
            }
            for (int64_t t = 0; t < n; ++t) pg[t] *= ks[t];
            const float corr = tm_softmax_block(pg, n, &m[g], &l[g]);
            for (int64_t t = 0; t < n; ++t) pg[t] *= vs[t];
            /* acc = acc * corr + sum_t p[t] v[t], 32 values at a time in registers */
            const __m256 c8 = _mm256_set1_ps(corr);
            float *a = acc[g];
            int64_t i = 0;
            for (; i + 32 <= d; i += 32) {
                __m256 r0 = _mm256_mul_ps(_mm256_load_ps(a + i), c8);
                __m256 r1 = _mm256_mul_ps(_mm256_load_ps(a + i + 8), c8);
                __m256 r2 = _mm256_mul_ps(_mm256_load_ps(a + i + 16), c8);
                __m256 r3 = _mm256_mul_ps(_mm256_load_ps(a + i + 24), c8);
                for (int64_t t = 0; t < n; ++t) {
                    const __m256 w = _mm256_set1_ps(pg[t]);
                    const char *vr = vb + t * row;
                    r0 = _mm256_fmadd_ps(w, tm_load8(vr, i, is_int8), r0);
                    r1 = _mm256_fmadd_ps(w, tm_load8(vr, i + 8, is_int8), r1);
                    r2 = _mm256_fmadd_ps(w, tm_load8(vr, i + 16, is_int8), r2);
                    r3 = _mm256_fmadd_ps(w, tm_load8(vr, i + 24, is_int8), r3);
                }
                _mm256_store_ps(a + i, r0);
                _mm256_store_ps(a + i + 8, r1);
                _mm256_store_ps(a + i + 16, r2);
                _mm256_store_ps(a + i + 24, r3);
            }
            for (; i < d; i += 8) {
                __m256 r0 = _mm256_mul_ps(_mm256_load_ps(a + i), c8);
                for (int64_t t = 0; t < n; ++t)
                    r0 = _mm256_fmadd_ps(_mm256_set1_ps(pg[t]), tm_load8(vb + t * row, i, is_int8), r0);
                _mm256_store_ps(a + i, r0);
            }
        }
    }
    for (int64_t g = 0; g < g_n; ++g) {
        float *o = j->out + (b * j->hq + h * g_n + g) * d;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t i = 0; i < d; ++i) o[i] = acc[g][i] * inv;
    }
}

static void tm_run_task_avx2(const tm_job *j, int64_t task) {
    if (j->is_int8)
        tm_run_task_avx2_impl(j, task, 1);
    else
        tm_run_task_avx2_impl(j, task, 0);
}
#endif

static void *tm_run_range(void *arg) {
    const tm_job *j = (const tm_job *)arg;
#ifdef TM_HAVE_AVX2
    if (j->d % 8 == 0) {
        for (int64_t t = j->task_begin; t < j->task_end; ++t) tm_run_task_avx2(j, t);
        return NULL;
    }
#endif
    for (int64_t t = j->task_begin; t < j->task_end; ++t) tm_run_task(j, t);
    return NULL;
}

/* Returns 0 on success, -1 on a shape this build does not serve (the caller
 * falls back), -2 if a thread could not be started (work done serially). */
int tm_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int is_int8,
                              const int32_t *block_tables, const int64_t *seq_lens, float *out,
                              int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t s,
                              int64_t max_blocks, int64_t block_size, float scale, int64_t num_threads) {
    if (hkv <= 0 || hq % hkv != 0 || hq / hkv > TM_MAX_G || d > TM_MAX_D || block_size > TM_MAX_BS)
        return -1;
    const int64_t tasks = batch * hkv;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > TM_MAX_THREADS) num_threads = TM_MAX_THREADS;
    if (num_threads > tasks) num_threads = tasks > 0 ? tasks : 1;
    tm_job jobs[TM_MAX_THREADS];
    pthread_t threads[TM_MAX_THREADS];
    int started[TM_MAX_THREADS] = {0};
    /* Equal shares of total KV length (the work), cut at task boundaries. */
    int64_t total = 0;
    for (int64_t b = 0; b < batch; ++b) total += seq_lens[b] * hkv;
    int64_t task = 0, done = 0;
    for (int64_t th = 0; th < num_threads; ++th) {
        tm_job *j = &jobs[th];
        j->q = q; j->k_cache = k_cache; j->v_cache = v_cache; j->is_int8 = is_int8;
        j->block_tables = block_tables; j->seq_lens = seq_lens; j->out = out;
        j->hq = hq; j->hkv = hkv; j->d = d; j->s = s; j->max_blocks = max_blocks;
        j->block_size = block_size; j->scale = scale;
        j->task_begin = task;
        const int64_t target = total * (th + 1) / num_threads;
        while (task < tasks && (th == num_threads - 1 || done + seq_lens[task / hkv] <= target)) {
            done += seq_lens[task / hkv];
            ++task;
        }
        j->task_end = task;
    }
    int rc = 0;
    for (int64_t th = 0; th + 1 < num_threads; ++th) {
        if (jobs[th].task_begin == jobs[th].task_end) continue;
        if (pthread_create(&threads[th], NULL, tm_run_range, &jobs[th]) == 0) {
            started[th] = 1;
        } else {
            tm_run_range(&jobs[th]);
            rc = -2;
        }
    }
    tm_run_range(&jobs[num_threads - 1]);
    for (int64_t th = 0; th + 1 < num_threads; ++th)
        if (started[th]) pthread_join(threads[th], NULL);
    return rc;
}
