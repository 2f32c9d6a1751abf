/*
 * W8A8 linear layers: int8 weights (per output channel) times int8 activations (per
 * token, quantized dynamically each step), accumulated exactly in int32, then scaled to
 * fp32: y[m, n] = (sum_k qa[m, k] qw[n, k]) * sa[m] * sw[n]  (SmoothQuant's W8A8 with
 * per-token dynamic activation scales, Xiao et al. 2022, arXiv 2211.10438).
 *
 * Integer dot products by instruction set:
 *   VNNI (AVX512-VNNI, or AVX-VNNI on 256-bit vectors): vpdpbusd multiplies unsigned
 *     activation bytes by signed weight bytes and adds groups of 4 into int32 lanes. The
 *     activations are stored offset by +128 (u8 = q + 128); the offset's contribution,
 *     128 * sum_k qw[n, k], is subtracted per column in the epilogue.
 *   AVX2 (and AVX-512 without VNNI): vpmaddubsw on |qa| and qw carrying qa's sign
 *     (vpsign), then vpmaddwd with ones into int32. With codes in [-127, 127] a pair of
 *     products is at most 2 * 127 * 127 = 32258 and never saturates the int16 step.
 *   plain C: int32 loops.
 * All give the same int32 sums, so the paths agree up to the fp32 epilogue.
 *
 * Layouts:
 *   activations: [m, kp] bytes (kp = k rounded up to 4), from tm_quantize_act; scales [m].
 *   packed weights, per panel of TM_NR columns: float sw[TM_NR]; int32 colsum[TM_NR];
 *     then kp / 4 rows of TM_NR x 4 bytes (column j's 4 consecutive k codes together),
 *     the operand layout of vpdpbusd / vpmaddubsw.
 */
#include "tm_cpu.h"

#include <math.h>
#include <string.h>

#if defined(TM_AVX512)
#define VLI 16 /* int32 lanes per vector */
#define TM_NR 32
#if defined(__AVX512VNNI__)
#define TM_VNNI 1
#define TM_MR_I8 12
#else
#define TM_MR_I8 6
#endif
#elif defined(TM_AVX2)
#define VLI 8
#define TM_NR 16
#if defined(__AVXVNNI__)
#define TM_VNNI 1
#define TM_MR_I8 6
#else
#define TM_MR_I8 4
#endif
#else
#define TM_NR 16
#define TM_MR_I8 4
#endif

#if defined(TM_VNNI) || !(defined(TM_AVX512) || defined(TM_AVX2))
#define TM_ACT_OFFSET 128 /* unsigned codes: VNNI's operand, and the plain-C loops */
#else
#define TM_ACT_OFFSET 0 /* signed codes for the vpsign / vpmaddubsw form */
#endif
#define TM_MC_BYTES (256 * 1024)

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The byte added to activation codes by this build (128 with VNNI and in plain C, 0 for vpmaddubsw). */
int tm_w8a8_act_offset(void) { return TM_ACT_OFFSET; }

/* ---------------------------------------------------------------- activations */

typedef struct {
    const float *x;
    int64_t ldx, m, k, kp;
    unsigned char *codes;
    float *scales;
} quant_ctx;

static void quant_rows(void *vctx, int64_t chunk) {
    const quant_ctx *c = (const quant_ctx *)vctx;
    const int64_t r0 = chunk * 16, r1 = r0 + 16 < c->m ? r0 + 16 : c->m;
    for (int64_t r = r0; r < r1; ++r) {
        const float *x = c->x + r * c->ldx;
        unsigned char *q = c->codes + r * c->kp;
        float amax = 0.0f;
        for (int64_t i = 0; i < c->k; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const float scale = amax / 127.0f;
        /* through a volatile: with -fassociative-math the compiler could otherwise fold
         * x * (127 / amax) into (x * 127) / amax, whose rounding differs in the last bit */
        volatile float inv_v = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float inv = inv_v;
        c->scales[r] = scale;
        int64_t i = 0;
#if defined(TM_AVX512)
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; i + 16 <= c->k; i += 16) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv)); /* round to even */
            v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
            v = _mm512_add_epi32(v, _mm512_set1_epi32(TM_ACT_OFFSET));
            _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(v));
        }
#endif
        for (; i < c->k; ++i) {
            float v = rintf(x[i] * inv);
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            q[i] = (unsigned char)((int)v + TM_ACT_OFFSET);
        }
        for (; i < c->kp; ++i) q[i] = (unsigned char)TM_ACT_OFFSET; /* value 0 */
    }
}

/* Per-row symmetric int8 quantization: scale = max|x| / 127, q = round(x / scale) in
 * [-127, 127] (round half to even), stored as q + tm_w8a8_act_offset() bytes in [m, kp]. */
void tm_quantize_act(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, unsigned char *codes,
                     float *scales) {
    quant_ctx c = {.x = x, .ldx = ldx, .m = m, .k = k, .kp = kp, .codes = codes, .scales = scales};
    tm_parallel_for(cdiv(m, 16), quant_rows, &c);
}

/* ---------------------------------------------------------------- weights */

static inline int64_t panel_bytes(int64_t kp) { return TM_NR * 8 + (kp / 4) * TM_NR * 4; }

int64_t tm_pack_w8a8_size(int64_t n, int64_t k) { return cdiv(n, TM_NR) * panel_bytes(cdiv(k, 4) * 4); }

/* int8 codes [n, k] (row stride ldq) and per-row scales [n] -> packed panels. */
void tm_pack_w8a8(const int8_t *q, int64_t ldq, const float *scale, int64_t n, int64_t k, void *out) {
    const int64_t kp = cdiv(k, 4) * 4, np = cdiv(n, TM_NR), pb = panel_bytes(kp);
    for (int64_t p = 0; p < np; ++p) {
        char *dst = (char *)out + p * pb;
        float *sw = (float *)dst;
        int32_t *colsum = (int32_t *)(dst + TM_NR * 4);
        int8_t *codes = (int8_t *)(dst + TM_NR * 8);
        for (int64_t j = 0; j < TM_NR; ++j) {
            const int64_t col = p * TM_NR + j;
            int32_t sum = 0;
            for (int64_t kk = 0; kk < kp; ++kk) {
                const int8_t v = (col < n && kk < k) ? q[col * ldq + kk] : 0;
                codes[(kk / 4) * TM_NR * 4 + j * 4 + kk % 4] = v;
                sum += v;
            }
            sw[j] = col < n ? scale[col] : 0.0f;
            colsum[j] = sum;
        }
    }
}

/* ---------------------------------------------------------------- micro-kernels */

#if defined(TM_AVX512)
typedef __m512i vi;
#define VI_ZERO() _mm512_setzero_si512()
#define VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VI_BCAST32(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define VI_STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#if defined(TM_VNNI)
#define VI_DOT(acc, a, b) _mm512_dpbusd_epi32(acc, a, b)
#else
#define VI_DOT(acc, a, b) \
    _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(a), sign512(b, a)), ones))
/* b with the sign of a applied (AVX-512BW has no vpsignb: negate where a < 0, zero where a == 0) */
static inline __m512i sign512(__m512i b, __m512i a) {
    const __mmask64 neg = _mm512_movepi8_mask(a), zero = _mm512_testn_epi8_mask(a, a);
    b = _mm512_mask_sub_epi8(b, neg, _mm512_setzero_si512(), b);
    return _mm512_maskz_mov_epi8(~zero, b);
}
#endif
#elif defined(TM_AVX2)
typedef __m256i vi;
#define VI_ZERO() _mm256_setzero_si256()
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_BCAST32(p) _mm256_set1_epi32(*(const int32_t *)(p))
#define VI_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#if defined(TM_VNNI)
#define VI_DOT(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#else
#define VI_DOT(acc, a, b) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)), ones))
#endif
#endif

#if defined(TM_AVX512) || defined(TM_AVX2)
/* acc tile [mr][TM_NR] int32 of activation rows a (stride lda bytes) times one packed panel */
TM_INLINE void ukr_i8(const int mr, int64_t kp, const unsigned char *restrict a, int64_t lda,
                      const int8_t *restrict b, int32_t *restrict tile) {
#if !defined(TM_VNNI)
#if defined(TM_AVX512)
    const __m512i ones = _mm512_set1_epi16(1);
#else
    const __m256i ones = _mm256_set1_epi16(1);
#endif
#endif
    vi acc[TM_MR_I8][2];
#pragma GCC unroll 12
    for (int r = 0; r < mr; ++r) acc[r][0] = acc[r][1] = VI_ZERO();
    for (int64_t kk = 0; kk < kp; kk += 4) {
        const int8_t *bk = b + kk * TM_NR;
        const vi b0 = VI_LOAD(bk), b1 = VI_LOAD(bk + VLI * 4);
#pragma GCC unroll 12
        for (int r = 0; r < mr; ++r) {
            const vi x = VI_BCAST32(a + r * lda + kk);
            acc[r][0] = VI_DOT(acc[r][0], x, b0);
            acc[r][1] = VI_DOT(acc[r][1], x, b1);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; ++r) {
        VI_STORE(tile + r * TM_NR, acc[r][0]);
        VI_STORE(tile + r * TM_NR + VLI, acc[r][1]);
    }
}
#else
static void ukr_i8(const int mr, int64_t kp, const unsigned char *restrict a, int64_t lda, const int8_t *restrict b,
                   int32_t *restrict tile) {
    int32_t acc[TM_MR_I8][TM_NR];
    memset(acc, 0, sizeof acc);
    for (int64_t kk = 0; kk < kp; kk += 4) {
        const int8_t *bk = b + kk * TM_NR;
        for (int r = 0; r < mr; ++r) {
            const unsigned char *ar = a + r * lda + kk;
            for (int j = 0; j < TM_NR; ++j)
                /* unsigned codes times signed weights, as vpdpbusd; the epilogue removes the offset */
                acc[r][j] += ar[0] * bk[j * 4] + ar[1] * bk[j * 4 + 1] + ar[2] * bk[j * 4 + 2] + ar[3] * bk[j * 4 + 3];
        }
    }
    memcpy(tile, acc, sizeof(int32_t) * mr * TM_NR);
}
#endif

/* ---------------------------------------------------------------- driver */

typedef struct {
    const unsigned char *a;
    const float *sa;
    const char *w;
    const float *bias;
    float *y;
    int64_t lda, ldy, m, n, kp, pb;
    int64_t mc, npanels, group, ngroups;
    int accumulate;
} i8_ctx;

#define I8_CASE(MR)                                                  \
    case MR:                                                         \
        ukr_i8(MR, c->kp, a, c->lda, codes, tile);                   \
        break;

static void i8_chunk(void *vctx, int64_t chunk) {
    const i8_ctx *c = (const i8_ctx *)vctx;
    const int64_t mb = chunk / c->ngroups, grp = chunk % c->ngroups;
    const int64_t m0 = mb * c->mc, m1 = m0 + c->mc < c->m ? m0 + c->mc : c->m;
    const int64_t p0 = grp * c->group, p1 = p0 + c->group < c->npanels ? p0 + c->group : c->npanels;
    int32_t tile[TM_MR_I8 * TM_NR] __attribute__((aligned(64)));
    for (int64_t p = p0; p < p1; ++p) {
        const char *pp = c->w + p * c->pb;
        const float *sw = (const float *)pp;
        const int32_t *colsum = (const int32_t *)(pp + TM_NR * 4);
        const int8_t *codes = (const int8_t *)(pp + TM_NR * 8);
        const int64_t n0 = p * TM_NR;
        const int ncols = c->n - n0 < TM_NR ? (int)(c->n - n0) : TM_NR;
        for (int64_t r = m0; r < m1; r += TM_MR_I8) {
            const int mr = m1 - r < TM_MR_I8 ? (int)(m1 - r) : TM_MR_I8;
            const unsigned char *a = c->a + r * c->lda;
            switch (mr) {
                I8_CASE(1)
                I8_CASE(2)
                I8_CASE(3)
                I8_CASE(4)
#if TM_MR_I8 > 4
                I8_CASE(5)
                I8_CASE(6)
#endif
#if TM_MR_I8 > 6
                I8_CASE(7)
                I8_CASE(8)
                I8_CASE(9)
                I8_CASE(10)
                I8_CASE(11)
                I8_CASE(12)
#endif
                default:
                    break;
            }
            for (int i = 0; i < mr; ++i) {
                float *yr = c->y + (r + i) * c->ldy + n0;
                const float s = c->sa[r + i];
                const int32_t *t = tile + i * TM_NR;
                for (int j = 0; j < ncols; ++j) {
                    float v = ((float)(t[j] - TM_ACT_OFFSET * colsum[j]) * s) * sw[j];
                    if (c->bias) v += c->bias[n0 + j];
                    if (c->accumulate) v += yr[j];
                    yr[j] = v;
                }
            }
        }
    }
}

/* y[m, n] (+)= dequant(a) dequant(W)^T (+ bias), a from tm_quantize_act (row stride kp bytes),
 * W from tm_pack_w8a8. */
void tm_gemm_w8a8(const unsigned char *a, const float *sa, int64_t kp, const void *w_packed, const float *bias,
                  float *y, int64_t ldy, int64_t m, int64_t n, int accumulate) {
    if (m <= 0 || n <= 0) return;
    i8_ctx c = {.a = a, .sa = sa, .w = (const char *)w_packed, .bias = bias, .y = y, .lda = kp, .ldy = ldy,
                .m = m, .n = n, .kp = kp, .pb = panel_bytes(kp), .accumulate = accumulate};
    const int threads = tm_get_num_threads();
    int64_t mc = TM_MC_BYTES / (kp > 0 ? kp : 1);
    mc = mc < TM_MR_I8 ? TM_MR_I8 : mc - mc % TM_MR_I8;
    if (mc > m) mc = m;
    const int64_t mblocks = cdiv(m, mc);
    c.mc = mc;
    c.npanels = cdiv(n, TM_NR);
    const int64_t target = threads > 1 ? 8 * threads : 1;
    int64_t per_mb = cdiv(target, mblocks);
    if (per_mb > c.npanels) per_mb = c.npanels;
    c.group = cdiv(c.npanels, per_mb);
    c.ngroups = cdiv(c.npanels, c.group);
    tm_parallel_for(mblocks * c.ngroups, i8_chunk, &c);
}
