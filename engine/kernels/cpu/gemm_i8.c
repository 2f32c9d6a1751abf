/*
 * W8A8 linear layers: int8 weights (per output channel) times int8 activations (per
 * token and per group of gs input columns, quantized dynamically each step), accumulated
 * exactly in int32 within each group, then scaled to fp32:
 *     y[m, n] = sw[n] * sum_g sa[m, g] * (sum_{k in g} qa[m, k] qw[n, k])
 * (W8A8 as in SmoothQuant, Xiao et al. 2022, arXiv 2211.10438, with the activations'
 * scales per token-group as llama.cpp's Q8 activation blocks: per-token scales lose
 * noticeably more perplexity than groups of 64; benchmarks/quality.py measures it).
 *
 * Integer dot products by instruction set. Activations are stored offset by +128
 * (u8 = q + 128, in [1, 255]); the offset's contribution, 128 * sum_k qw[n, k], is
 * taken off by starting each group's int32 sums at its negation.
 *   VNNI (AVX512-VNNI, or AVX-VNNI on 256-bit vectors): vpdpbusd multiplies the unsigned
 *     activation bytes by signed weight bytes and adds groups of 4 into int32 lanes.
 *   AVX2 (and AVX-512 without VNNI): vpmaddubsw on the same unsigned bytes and the signed
 *     weights, then vpmaddwd with ones into int32. vpmaddubsw adds each pair of products in
 *     saturating int16, so the weights' codes are limited to [-64, 64] (tm_pack_w8a8 refuses
 *     others): a pair is then at most 2 * 255 * 64 = 32640 < 32767 and never saturates.
 *     This form takes 3 vector operations per 32 multiply-adds; the signed form (vpsign on
 *     both operands so that codes in [-127, 127] fit) took 4-5 (python -m benchmarks.w8a8_ab
 *     compares the two; benchmarks/results/epyc-zen3-avx2/w8a8_ab.json). After SmoothQuant
 *     smoothing the narrower weight range costs no measurable perplexity
 *     (benchmarks/results/epyc-zen3-avx2/quality-w8a8.json).
 *   AMX (AMX-TILE + AMX-INT8: Xeon since Sapphire Rapids): TDPBUSD is vpdpbusd's product on tiles,
 *     C[16 rows][16 int32] += A[16 rows][64 unsigned bytes] . B[16 rows of 4 k x 16 columns, signed],
 *     16 x 16 x 64 multiply-adds per instruction (Intel 64 and IA-32 Architectures Software
 *     Developer's Manual, vol. 1, "Programming with Intel AMX", and vol. 2: LDTILECFG, TILELOADD,
 *     TDPBUSD, TILESTORED; and the Intel AMX chapter of the Optimization Reference Manual). A panel's
 *     code rows are already B's layout, so both operands are tile-loaded in place: B = 16 code rows
 *     (64 k) at a stride of TM_NR * 4 bytes, their first 64 bytes for columns 0-15, the next 64 for
 *     16-31; A = 16 activation rows of 64 bytes at a stride of kp. A block is 32 rows x one panel:
 *     C tiles 2 x 2, two A and two B tiles (all eight; each loaded tile feeds two TDPBUSD). With gs = 64 a group is one
 *     TDPBUSD per C tile; its int32 sums are stored (TILESTORED) and scaled by the same vector steps
 *     as the VNNI kernel (the offset's comp subtracted, converted, one fma with the row's scale into
 *     the running fp32 sum, group after group), so both paths give the same bits and a row's result
 *     does not depend on which path its batch took. Pipelined: the lower C tiles of group g - 1 are
 *     stored while the upper ones of g compute, and g - 1 is scaled after g's tiles are issued. Used
 *     for gs a multiple of 64 (the engine's 64) on the whole 16-row tiles of a call of 16 rows or
 *     more (the rest and smaller calls: vpdpbusd), where the build has AMX (__AMX_TILE__,
 *     __AMX_INT8__ with AVX512-VNNI), the CPU reports it and Linux grants the process the tile state
 *     (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once); each chunk loads the tile
 *     configuration on the thread that runs it (the pool's workers and the caller) and releases it
 *     after. TOKENMILL_AMX=0 or tm_w8a8_amx(0) keeps the vpdpbusd path.
 *     The next panel's rows of y are prefetched for writing: where y outgrows the caches (the LM
 *     head) a block's rows came out in one burst of write-allocate misses.
 *     Fewer than 16 rows would leave a tile part empty, so M = 16 is the threshold. 16x the
 *     multiply-adds per instruction do not make 16x: each 64 k of int32 sums must leave the tiles
 *     for the fp32 group scaling, and those tile stores, conversions and fmas cost more than the
 *     TDPBUSDs and do not overlap with the tile work. The measurements (AMX against vpdpbusd per
 *     M, and the block timings behind this) are in benchmarks/results/xeon-amx/w8a8_ab.json.
 *   plain C: int32 loops.
 * All give the same int32 sums, so the paths agree up to the fp32 epilogue (and the AVX-512 and
 * AMX paths in it).
 *
 * Layouts:
 *   activations: [m, kp] bytes (kp = k rounded up to 4), from tm_quantize_act; scales
 *     [m, ng] with ng = ceil(kp / gs) (gs a multiple of 4; the last group may be short).
 *   packed weights, per panel of TM_NR columns: float sw[TM_NR]; int32 comp[ng][TM_NR]
 *     (the activation offset times each group's column sums); then kp / 4 rows of
 *     TM_NR x 4 bytes (column j's 4 consecutive k codes together), the operand layout
 *     of vpdpbusd / vpmaddubsw.
 */
#include "tm_cpu.h"

#include <math.h>
#include <string.h>

#if defined(TM_AVX512)
#define VLI 16 /* int32 lanes per vector */
#define TM_NR 32
#if defined(__AVX512VNNI__)
#define TM_VNNI 1
#endif
#define TM_MR_I8 6 /* 12 int32 + 12 fp32 accumulators in the 32 registers */
#elif defined(TM_AVX2)
#define VLI 8
#define TM_NR 16
#if defined(__AVXVNNI__)
#define TM_VNNI 1
#endif
#define TM_MR_I8 4 /* the fp32 accumulators live in L1 between groups */
#else
#define TM_NR 16
#define TM_MR_I8 4
#endif

#define TM_ACT_OFFSET 128 /* unsigned activation codes: the u8 operand of vpdpbusd and vpmaddubsw */
#define TM_W8A8_WMAX 64   /* largest |weight code|: no int16 saturation in vpmaddubsw (see above) */
#define TM_MC_BYTES (256 * 1024)

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The byte added to activation codes (128 in every build). */
int tm_w8a8_act_offset(void) { return TM_ACT_OFFSET; }

/* The largest |weight code| tm_pack_w8a8 accepts (64 in every build). */
int tm_w8a8_weight_max(void) { return TM_W8A8_WMAX; }

/* ---------------------------------------------------------------- activations */

typedef struct {
    const float *x;
    int64_t ldx, m, k, kp, gs;
    unsigned char *codes;
    float *scales;
} quant_ctx;

static void quant_group(const float *x, int64_t n, unsigned char *q, float *scale_out) {
    const float amax = tm_absmax(x, n);
    *scale_out = amax / 127.0f;
    /* through a volatile: with -fassociative-math the compiler could otherwise fold
     * x * (127 / amax) into (x * 127) / amax, whose rounding differs in the last bit */
    volatile float inv_v = amax > 0.0f ? 127.0f / amax : 0.0f;
    const float inv = inv_v;
    int64_t i = 0;
#if defined(TM_AVX512)
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv)); /* round to even */
        v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
        v = _mm512_add_epi32(v, _mm512_set1_epi32(TM_ACT_OFFSET));
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(v));
    }
#endif
    for (; i < n; ++i) {
        float v = rintf(x[i] * inv);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[i] = (unsigned char)((int)v + TM_ACT_OFFSET);
    }
}

static void quant_rows(void *vctx, int64_t chunk) {
    const quant_ctx *c = (const quant_ctx *)vctx;
    const int64_t r0 = chunk * 16, r1 = r0 + 16 < c->m ? r0 + 16 : c->m;
    const int64_t ng = cdiv(c->kp, c->gs);
    for (int64_t r = r0; r < r1; ++r) {
        const float *x = c->x + r * c->ldx;
        unsigned char *q = c->codes + r * c->kp;
        for (int64_t g = 0; g < ng; ++g) {
            const int64_t k0 = g * c->gs, k1 = k0 + c->gs < c->k ? k0 + c->gs : c->k;
            if (k1 > k0)
                quant_group(x + k0, k1 - k0, q + k0, c->scales + r * ng + g);
            else
                c->scales[r * ng + g] = 0.0f;
        }
        for (int64_t i = c->k; i < c->kp; ++i) q[i] = (unsigned char)TM_ACT_OFFSET; /* value 0 */
    }
}

/* Symmetric int8 per row and group of gs columns: scale = max|x| / 127 over the group,
 * q = round(x / scale) in [-127, 127] (round half to even), stored as q +
 * tm_w8a8_act_offset() bytes in [m, kp]; scales [m, ceil(kp / gs)]. gs % 4 == 0. */
void tm_quantize_act(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int64_t gs,
                     unsigned char *codes, float *scales) {
    quant_ctx c = {.x = x, .ldx = ldx, .m = m, .k = k, .kp = kp, .gs = gs, .codes = codes, .scales = scales};
    tm_parallel_for(cdiv(m, 16), quant_rows, &c);
}

/* ---------------------------------------------------------------- weights */

static inline int64_t panel_bytes(int64_t kp, int64_t gs) {
    return TM_NR * 4 + cdiv(kp, gs) * TM_NR * 4 + (kp / 4) * TM_NR * 4;
}

int64_t tm_pack_w8a8_size(int64_t n, int64_t k, int64_t gs) {
    const int64_t kp = cdiv(k, 4) * 4;
    return cdiv(n, TM_NR) * panel_bytes(kp, gs);
}

/* int8 codes [n, k] (row stride ldq) in [-64, 64] and per-row scales [n] -> packed panels for
 * activation groups of gs columns (gs % 4 == 0). Returns 0, -1 for a bad gs, or -2 for a code
 * outside [-64, 64] (nothing is written then). */
int tm_pack_w8a8(const int8_t *q, int64_t ldq, const float *scale, int64_t n, int64_t k, int64_t gs, void *out) {
    if (gs <= 0 || gs % 4) return -1;
    for (int64_t r = 0; r < n; ++r)
        for (int64_t kk = 0; kk < k; ++kk)
            if (q[r * ldq + kk] > TM_W8A8_WMAX || q[r * ldq + kk] < -TM_W8A8_WMAX) return -2;
    const int64_t kp = cdiv(k, 4) * 4, np = cdiv(n, TM_NR), pb = panel_bytes(kp, gs), ng = cdiv(kp, gs);
    for (int64_t p = 0; p < np; ++p) {
        char *dst = (char *)out + p * pb;
        float *sw = (float *)dst;
        int32_t *comp = (int32_t *)(dst + TM_NR * 4);
        int8_t *codes = (int8_t *)(dst + TM_NR * 4 + ng * TM_NR * 4);
        for (int64_t j = 0; j < TM_NR; ++j) {
            const int64_t col = p * TM_NR + j;
            for (int64_t g = 0; g < ng; ++g) comp[g * TM_NR + j] = 0;
            for (int64_t kk = 0; kk < kp; ++kk) {
                const int8_t v = (col < n && kk < k) ? q[col * ldq + kk] : 0;
                codes[(kk / 4) * TM_NR * 4 + j * 4 + kk % 4] = v;
                comp[(kk / gs) * TM_NR + j] += TM_ACT_OFFSET * v;
            }
            sw[j] = col < n ? scale[col] : 0.0f;
        }
    }
    return 0;
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
/* a: unsigned activation bytes, b: signed weight bytes in [-64, 64] */
#define VI_DOT(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), ones))
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
/* a: unsigned activation bytes, b: signed weight bytes in [-64, 64] */
#define VI_DOT(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones))
#endif
#endif

#if defined(TM_AVX512)
typedef __m512 vff;
#define VF_ZERO() _mm512_setzero_ps()
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VF_SET1(x) _mm512_set1_ps(x)
#define VF_STORE(p, v) _mm512_storeu_ps(p, v)
#define VI_CVT(v) _mm512_cvtepi32_ps(v)
#define VI_SUB(a, b) _mm512_sub_epi32(a, b)
#elif defined(TM_AVX2)
typedef __m256 vff;
#define VF_ZERO() _mm256_setzero_ps()
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VF_SET1(x) _mm256_set1_ps(x)
#define VF_STORE(p, v) _mm256_storeu_ps(p, v)
#define VI_CVT(v) _mm256_cvtepi32_ps(v)
#define VI_SUB(a, b) _mm256_sub_epi32(a, b)
#endif

#if defined(TM_AVX512) || defined(TM_AVX2)
/* fp32 tile [mr][TM_NR] = sum over groups of sa[r, g] * (int32 sums of the group, offset removed),
 * for activation rows a (stride lda bytes, scales sa with row stride ng) times one packed panel */
TM_INLINE void ukr_i8(const int mr, int64_t kp, int64_t gs, const unsigned char *restrict a, int64_t lda,
                      const float *restrict sa, int64_t ng, const int8_t *restrict b, const int32_t *restrict comp,
                      float *restrict tile, const char *pf, int64_t pf_len) {
    /* this tile's share of the next panel (pf_len bytes), spread evenly over the groups */
    const int64_t pf_per_group = ((pf_len + ng - 1) / ng + 63) / 64 * 64;
    int64_t pf_off = 0;
#if !defined(TM_VNNI)
#if defined(TM_AVX512)
    const __m512i ones = _mm512_set1_epi16(1);
#else
    const __m256i ones = _mm256_set1_epi16(1);
#endif
#endif
    vff facc[TM_MR_I8][2];
#pragma GCC unroll 12
    for (int r = 0; r < mr; ++r) facc[r][0] = facc[r][1] = VF_ZERO();
    for (int64_t g0 = 0, g = 0; g0 < kp; g0 += gs, ++g) {
        const int64_t g1 = g0 + gs < kp ? g0 + gs : kp;
        for (const int64_t end = pf_off + pf_per_group; pf_off < end && pf_off < pf_len; pf_off += 64)
            __builtin_prefetch(pf + pf_off, 0, 2);
        /* the int32 sums start at minus the offset's contribution (so no subtraction after) */
        const vi c0 = VI_SUB(VI_ZERO(), VI_LOAD(comp + g * TM_NR)), c1 = VI_SUB(VI_ZERO(), VI_LOAD(comp + g * TM_NR + VLI));
        vi acc[TM_MR_I8][2];
#pragma GCC unroll 12
        for (int r = 0; r < mr; ++r) {
            acc[r][0] = c0;
            acc[r][1] = c1;
        }
        for (int64_t kk = g0; kk < g1; kk += 4) {
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
            const vff sc = VF_SET1(sa[r * ng + g]);
            facc[r][0] = VF_FMA(VI_CVT(acc[r][0]), sc, facc[r][0]);
            facc[r][1] = VF_FMA(VI_CVT(acc[r][1]), sc, facc[r][1]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; ++r) {
        VF_STORE(tile + r * TM_NR, facc[r][0]);
        VF_STORE(tile + r * TM_NR + VLI, facc[r][1]);
    }
}
#else
static void ukr_i8(const int mr, int64_t kp, int64_t gs, const unsigned char *restrict a, int64_t lda,
                   const float *restrict sa, int64_t ng, const int8_t *restrict b, const int32_t *restrict comp,
                   float *restrict tile, const char *pf, int64_t pf_len) {
    (void)pf;
    (void)pf_len;
    float facc[TM_MR_I8][TM_NR];
    int32_t acc[TM_MR_I8][TM_NR];
    memset(facc, 0, sizeof facc);
    for (int64_t g0 = 0, g = 0; g0 < kp; g0 += gs, ++g) {
        const int64_t g1 = g0 + gs < kp ? g0 + gs : kp;
        memset(acc, 0, sizeof acc);
        for (int64_t kk = g0; kk < g1; kk += 4) {
            const int8_t *bk = b + kk * TM_NR;
            for (int r = 0; r < mr; ++r) {
                const unsigned char *ar = a + r * lda + kk;
                /* unsigned codes times signed weights, as vpdpbusd; comp removes the offset */
                for (int j = 0; j < TM_NR; ++j)
                    acc[r][j] += ar[0] * bk[j * 4] + ar[1] * bk[j * 4 + 1] + ar[2] * bk[j * 4 + 2] + ar[3] * bk[j * 4 + 3];
            }
        }
        for (int r = 0; r < mr; ++r)
            for (int j = 0; j < TM_NR; ++j) facc[r][j] += (float)(acc[r][j] - comp[g * TM_NR + j]) * sa[r * ng + g];
    }
    memcpy(tile, facc, sizeof(float) * mr * TM_NR);
}
#endif

/* ---------------------------------------------------------------- AMX tiles (see the header) */

#if defined(TM_HAVE_AMX) && defined(TM_VNNI) && defined(__AMX_INT8__)
#define TM_AMX 1
#endif

#define TM_AMX_MIN_M 16 /* rows in whole tiles of 16; the rest (and calls with fewer) take vpdpbusd */

#if defined(TM_AMX)
#include <stdatomic.h>

#define AMX_ISUM (32 * TM_NR + 16 * 21) /* int32 per buffer of a group's sums: 32 x 32, then 1344 bytes so
                                          that two buffers' rows differ modulo 4 KB (no 4K aliasing) */

static _Atomic int amx_state = -1; /* -1 until the first call decides (TOKENMILL_AMX), then 0 or 1 */
static _Atomic int64_t amx_blocks; /* blocks of 16 rows x one panel computed on tiles (tm_w8a8_amx_blocks) */

/* Tiles (tm_tiles_16x64): tmm0-3 the int32 sums C[i][j] (rows 16 i.., columns 16 j.. of a 32 x 32
 * block), tmm4-5 two A tiles (16 activation rows x 64 bytes), tmm6-7 two B tiles (16 rows of 64
 * bytes: 16 columns x 4 k). */

/* fp32 rows [rows][TM_NR] += group g's int32 sums isum [rows][TM_NR] (offset removed, and the group's
 * last k short of 64 added by vpdpbusd) converted and times the rows' scales, as ukr_i8 does it. */
TM_INLINE void amx_group_epilogue(const int rows, int64_t g, int64_t kt, int64_t g1, const int32_t *restrict isum,
                                  const unsigned char *restrict a, int64_t lda, const float *restrict sa, int64_t ng,
                                  const int8_t *restrict b, const int32_t *restrict comp, float *restrict facc) {
    const __m512i c0 = _mm512_loadu_si512(comp + g * TM_NR), c1 = _mm512_loadu_si512(comp + g * TM_NR + 16);
    for (int r = 0; r < rows; ++r) {
        __m512i v0 = _mm512_sub_epi32(_mm512_load_si512(isum + r * TM_NR), c0);
        __m512i v1 = _mm512_sub_epi32(_mm512_load_si512(isum + r * TM_NR + 16), c1);
        for (int64_t kk = kt; kk < g1; kk += 4) {
            const __m512i x = VI_BCAST32(a + r * lda + kk);
            v0 = _mm512_dpbusd_epi32(v0, x, VI_LOAD(b + kk * TM_NR));
            v1 = _mm512_dpbusd_epi32(v1, x, VI_LOAD(b + kk * TM_NR + 64));
        }
        const __m512 sc = _mm512_set1_ps(sa[r * ng + g]);
        float *f = facc + r * TM_NR;
        _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), sc, _mm512_load_ps(f)));
        _mm512_store_ps(f + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), sc, _mm512_load_ps(f + 16)));
    }
}

/* fp32 tile [16 mt][TM_NR] for 16 mt activation rows (mt = 1 or 2) times one packed panel: the values
 * ukr_i8 computes, by the same fp32 operations in the same order (each group's exact int32 sums
 * converted, times the row's scale, added to the running sum by one fma). Each 64 k of a group is one
 * TDPBUSD per C tile, read in place: A from the activation rows (stride lda), B from the panel's code
 * rows (16 rows of k / 4 at a stride of TM_NR * 4 bytes, the first or second 64 bytes of each). The
 * last group's k short of a multiple of 64 (where kp is not one; the driver takes only gs a multiple
 * of 64) go through vpdpbusd. Software-pipelined: group g's tiles are computed before group g - 1's sums are scaled (from the
 * other of two buffers), and with two tile rows the lower C tiles of g - 1 are stored while the upper
 * ones of g compute. The thread's tiles must be configured with tm_tiles_16x64. */
TM_INLINE void amx_block(const int mt, int64_t kp, int64_t gs, const unsigned char *restrict a, int64_t lda,
                         const float *restrict sa, int64_t ng, const int8_t *restrict b, const int32_t *restrict comp,
                         float *restrict facc, int32_t *restrict isum, const char *pf, int64_t pf_len) {
    const int rows = 16 * mt;
    const int64_t pf_per_group = ((pf_len + ng - 1) / ng + 63) / 64 * 64;
    int64_t pf_off = 0;
    for (int r = 0; r < rows; ++r) {
        _mm512_store_ps(facc + r * TM_NR, _mm512_setzero_ps());
        _mm512_store_ps(facc + r * TM_NR + 16, _mm512_setzero_ps());
    }
    for (int64_t g = 0; g <= ng; ++g) {
        int32_t *cur = isum + (g & 1) * AMX_ISUM, *prev = isum + ((g + 1) & 1) * AMX_ISUM;
        if (g < ng) {
            const int64_t g0 = g * gs, g1 = g0 + gs < kp ? g0 + gs : kp, kt = g0 + (g1 - g0) / 64 * 64;
            for (const int64_t end = pf_off + pf_per_group; pf_off < end && pf_off < pf_len; pf_off += 64)
                __builtin_prefetch(pf + pf_off, 0, 2);
            if (kt - g0 == 64) { /* one TDPBUSD per C tile: the lower ones start once g - 1's are stored */
                _tile_loadd(6, b + g0 * TM_NR, TM_NR * 4);
                _tile_loadd(7, b + g0 * TM_NR + 64, TM_NR * 4);
                _tile_loadd(4, a + g0, lda);
                _tile_zero(0);
                _tile_zero(1);
                _tile_dpbusd(0, 4, 6);
                _tile_dpbusd(1, 4, 7);
                if (mt == 2) {
                    if (g > 0) {
                        _tile_stored(2, prev + 16 * TM_NR, TM_NR * 4);
                        _tile_stored(3, prev + 16 * TM_NR + 16, TM_NR * 4);
                    }
                    _tile_loadd(5, a + 16 * lda + g0, lda);
                    _tile_zero(2);
                    _tile_zero(3);
                    _tile_dpbusd(2, 5, 6);
                    _tile_dpbusd(3, 5, 7);
                }
            } else {
                if (mt == 2 && g > 0) {
                    _tile_stored(2, prev + 16 * TM_NR, TM_NR * 4);
                    _tile_stored(3, prev + 16 * TM_NR + 16, TM_NR * 4);
                }
                _tile_zero(0);
                _tile_zero(1);
                if (mt == 2) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int64_t kk = g0; kk < kt; kk += 64) {
                    _tile_loadd(6, b + kk * TM_NR, TM_NR * 4);
                    _tile_loadd(7, b + kk * TM_NR + 64, TM_NR * 4);
                    _tile_loadd(4, a + kk, lda);
                    _tile_dpbusd(0, 4, 6);
                    _tile_dpbusd(1, 4, 7);
                    if (mt == 2) {
                        _tile_loadd(5, a + 16 * lda + kk, lda);
                        _tile_dpbusd(2, 5, 6);
                        _tile_dpbusd(3, 5, 7);
                    }
                }
            }
            _tile_stored(0, cur, TM_NR * 4);
            _tile_stored(1, cur + 16, TM_NR * 4);
        } else if (mt == 2) {
            _tile_stored(2, prev + 16 * TM_NR, TM_NR * 4);
            _tile_stored(3, prev + 16 * TM_NR + 16, TM_NR * 4);
        }
        if (g > 0) {
            const int64_t h0 = (g - 1) * gs, h1 = h0 + gs < kp ? h0 + gs : kp;
            amx_group_epilogue(rows, g - 1, h0 + (h1 - h0) / 64 * 64, h1, prev, a, lda, sa, ng, b, comp, facc);
        }
    }
}
#endif

/* Whether tm_gemm_w8a8 runs its tiles of 16 or more rows on AMX: mode < 0 asks, 0 turns it off, 1 on
 * (where the CPU and the kernel allow it). Until set, on unless TOKENMILL_AMX=0. Returns the state
 * now (0 in builds without AMX). */
int tm_w8a8_amx(int mode) {
#if defined(TM_AMX)
    return tm_amx_switch(&amx_state, mode, TM_AMX_UNIT_INT8);
#else
    (void)mode;
    return 0;
#endif
}

/* Blocks of 16 activation rows x one panel of TM_NR columns that tm_gemm_w8a8 has computed on AMX
 * tiles in this process (so tests can tell that the path ran; 0 in builds without AMX). */
int64_t tm_w8a8_amx_blocks(void) {
#if defined(TM_AMX)
    return atomic_load_explicit(&amx_blocks, memory_order_relaxed);
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------- driver */

typedef struct {
    const unsigned char *a;
    const float *sa;
    const char *w;
    const float *bias;
    float *y;
    int64_t lda, ldy, m, n, kp, gs, ng, pb;
    int64_t mc, npanels, group, ngroups;
    int accumulate;
    int amx; /* row blocks of 16 run on AMX tiles */
} i8_ctx;

/* y rows [r, r + rows), columns [n0, n0 + ncols) from an fp32 tile [rows][TM_NR]: tile * sw (+ bias) (+ y).
 * One copy (noinline) for every path, so that the compiler's contraction of these operations is the
 * same wherever a row was computed. */
static __attribute__((noinline)) void store_rows(const i8_ctx *c, const float *tile, int64_t r, int rows, int64_t n0,
                                                 int ncols, const float *sw) {
    for (int i = 0; i < rows; ++i) {
        float *yr = c->y + (r + i) * c->ldy + n0;
        const float *t = tile + i * TM_NR;
        for (int j = 0; j < ncols; ++j) {
            float v = t[j] * sw[j];
            if (c->bias) v += c->bias[n0 + j];
            if (c->accumulate) v += yr[j];
            yr[j] = v;
        }
    }
}

#define I8_CASE(MR)                                                                                \
    case MR:                                                                                       \
        ukr_i8(MR, c->kp, c->gs, a, c->lda, c->sa + r * c->ng, c->ng, codes, comp, tile, pf, pf_len); \
        break;

static void i8_chunk(void *vctx, int64_t chunk) {
    const i8_ctx *c = (const i8_ctx *)vctx;
    const int64_t mb = chunk / c->ngroups, grp = chunk % c->ngroups;
    const int64_t m0 = mb * c->mc, m1 = m0 + c->mc < c->m ? m0 + c->mc : c->m;
    const int64_t p0 = grp * c->group, p1 = p0 + c->group < c->npanels ? p0 + c->group : c->npanels;
    /* rows [m0, m16) in AMX blocks of 32 (and one of 16), the rest in vpdpbusd tiles of TM_MR_I8 */
    const int64_t m16 = c->amx ? m0 + (m1 - m0) / 16 * 16 : m0;
    float tile[32 * TM_NR] __attribute__((aligned(64)));
#if defined(TM_AMX)
    int32_t isum[2 * AMX_ISUM] __attribute__((aligned(64)));
    if (m16 > m0) _tile_loadconfig(&tm_tiles_16x64); /* per chunk: the pool's threads and the caller each run chunks */
#endif
    for (int64_t p = p0; p < p1; ++p) {
        const char *pp = c->w + p * c->pb;
        const float *sw = (const float *)pp;
        const int32_t *comp = (const int32_t *)(pp + TM_NR * 4);
        const int8_t *codes = (const int8_t *)(pp + TM_NR * 4 + c->ng * TM_NR * 4);
        const int64_t n0 = p * TM_NR;
        const int ncols = c->n - n0 < TM_NR ? (int)(c->n - n0) : TM_NR;
        /* each tile of this panel prefetches its share of the chunk's next panel (as gemm.c's
         * gemm_chunk), so that panel's first tile finds it in cache instead of waiting on memory */
        const int64_t ntiles = (m16 - m0 + 31) / 32 + (m1 - m16 + TM_MR_I8 - 1) / TM_MR_I8;
        const int64_t share = (c->pb + ntiles - 1) / ntiles;
        const int64_t pf_len = p + 1 < p1 ? share : 0;
        int64_t r = m0, t = 0;
#if defined(TM_AMX)
        for (; r < m16; ++t) {
            const int mt = m16 - r >= 32 ? 2 : 1;
            const unsigned char *a = c->a + r * c->lda;
            const float *sa = c->sa + r * c->ng;
            /* these rows' y of the next panel, for writing: a block's 16-32 rows of y come out in one
             * burst, and where y is larger than the caches their write-allocate misses stalled it
             * (LM head, M = 128: 409 -> 249 ns a block of 32 x 32 x 64) */
            if (p + 1 < p1)
                for (int i = 0; i < 16 * mt; ++i) {
                    const float *yn = c->y + (r + i) * c->ldy + n0 + TM_NR;
                    __builtin_prefetch(yn, 1, 3);
                    __builtin_prefetch(yn + TM_NR - 1, 1, 3);
                }
            if (mt == 2)
                amx_block(2, c->kp, c->gs, a, c->lda, sa, c->ng, codes, comp, tile, isum, pp + c->pb + t * share, pf_len);
            else
                amx_block(1, c->kp, c->gs, a, c->lda, sa, c->ng, codes, comp, tile, isum, pp + c->pb + t * share, pf_len);
            store_rows(c, tile, r, 16 * mt, n0, ncols, sw);
            r += 16 * mt;
        }
#endif
        for (; r < m1; r += TM_MR_I8, ++t) {
            const int mr = m1 - r < TM_MR_I8 ? (int)(m1 - r) : TM_MR_I8;
            const char *pf = pp + c->pb + t * share;
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
                default:
                    break;
            }
            store_rows(c, tile, r, mr, n0, ncols, sw);
        }
    }
#if defined(TM_AMX)
    if (m16 > m0) {
        _tile_release(); /* back to the init state: context switches need not save the tiles */
        atomic_fetch_add_explicit(&amx_blocks, (m16 - m0) / 16 * (p1 - p0), memory_order_relaxed);
    }
#endif
}

/* y[m, n] (+)= dequant(a) dequant(W)^T (+ bias), a and sa from tm_quantize_act (row stride kp
 * bytes, groups of gs), W from tm_pack_w8a8 with the same gs. Returns 0, or -1 for a bad gs. */
int tm_gemm_w8a8(const unsigned char *a, const float *sa, int64_t kp, int64_t gs, const void *w_packed,
                 const float *bias, float *y, int64_t ldy, int64_t m, int64_t n, int accumulate) {
    if (gs <= 0 || gs % 4 || kp % 4) return -1;
    if (m <= 0 || n <= 0) return 0;
    i8_ctx c = {.a = a, .sa = sa, .w = (const char *)w_packed, .bias = bias, .y = y, .lda = kp, .ldy = ldy,
                .m = m, .n = n, .kp = kp, .gs = gs, .ng = cdiv(kp, gs), .pb = panel_bytes(kp, gs),
                .accumulate = accumulate};
    c.amx = m >= TM_AMX_MIN_M && gs % 64 == 0 && tm_w8a8_amx(-1);
    const int threads = tm_get_num_threads();
    const int64_t mr = c.amx ? 32 : TM_MR_I8; /* rows per tile */
    int64_t mc = TM_MC_BYTES / (kp > 0 ? kp : 1);
    mc = mc < mr ? mr : mc - mc % mr;
    if (mc > m) mc = m;
    const int64_t mblocks = cdiv(m, mc);
    c.mc = mc;
    c.npanels = cdiv(n, TM_NR);
    const int64_t target = threads > 1 ? 8 * threads : 1;
    c.group = tm_panel_group(c.npanels, mblocks, target, threads, c.npanels);
    c.ngroups = cdiv(c.npanels, c.group);
    tm_parallel_for(mblocks * c.ngroups, i8_chunk, &c);
    return 0;
}
