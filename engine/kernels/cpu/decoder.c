/*
 * The decoder layers of a Llama-family model in one call: the same kernels the Python layer
 * loop calls (RMSNorm, the linear layers, RoPE, the KV write, paged attention, SiLU * up), in
 * the same order on the same buffers, so the result is bit for bit what that loop computes (SwiGLU
 * in the gate/up GEMM's epilogue where the layer allows it, as the layers' silu_mul decides);
 * only the interpreter's dispatch between kernels (about 300 calls per step for 30 layers) is
 * gone, which is what a small batch pays for.
 *
 * A model is described once by a flat int64 array, TM_DEC_LAYER_WORDS words per layer:
 *   [0]  attn_norm weight pointer     [1] mlp_norm weight pointer
 *   [2]  k cache pointer              [3] v cache pointer
 *   then four linear layers (qkv, o, gate_up, down), TM_DEC_LIN_WORDS words each:
 *   kind (TM_DEC_F32 | TM_DEC_Q | TM_DEC_W8A8 | TM_DEC_BF16), weight format (TM_W_Q8 / TM_W_Q4 for Q),
 *   has_min, n, k, kpad (Q) or kp (W8A8), group size, packed weight pointer, bias pointer (or 0).
 *
 * With timing on (tm_decoder_set_timing), the wall time of every kernel call is added to one of
 * TM_DEC_NCAT counters (seconds, CLOCK_MONOTONIC; about 20 ns per call, 11 calls per layer), so a
 * benchmark can split a driver step without leaving the driver: linear layers (W8A8's activation
 * quantization included), attention, KV write, RMSNorm, RoPE, SiLU * up.
 */
#include "tm_cpu.h"

#include <string.h>
#include <time.h>

#define TM_DEC_F32 0
#define TM_DEC_Q 1
#define TM_DEC_W8A8 2
#define TM_DEC_BF16 3
#define TM_DEC_LIN_WORDS 9
#define TM_DEC_LAYER_WORDS (4 + 4 * TM_DEC_LIN_WORDS)

void tm_rms_norm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t m, int64_t k,
                 float eps);
void tm_rope(float *x, int64_t ldx, int64_t t, int64_t heads, int64_t d, const int64_t *positions,
             const float *cos_t, const float *sin_t);
void tm_silu_mul(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t m, int64_t n);
void tm_kv_write(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t t, int64_t hkv, int64_t d,
                 const int64_t *slots, void *k_cache, void *v_cache, int64_t s, int kv);
int tm_paged_attention(const float *q, int64_t ldq, const void *k_cache, const void *v_cache, int kv,
                       const int32_t *block_tables, int64_t max_blocks, const int32_t *row_seq,
                       const int64_t *kv_len, const int64_t *tiles, int64_t num_tiles, float *out, int64_t ldo,
                       int64_t hq, int64_t hkv, int64_t d, int64_t s, int64_t block_size, float scale,
                       int64_t window);
void tm_gemm_f32(const float *x, int64_t ldx, const float *w_packed, const float *bias, float *y, int64_t ldy,
                 int64_t m, int64_t n, int64_t k, int accumulate);
int tm_gemm_q(int kind, int has_min, const float *x, int64_t ldx, const void *w_packed, const float *bias, float *y,
              int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t kpad, int64_t gs, int accumulate);
int tm_gemm_f32_silu(const float *x, int64_t ldx, const float *w_packed, const float *bias, float *y, int64_t ldy,
                     int64_t m, int64_t inter, int64_t k);
int tm_gemm_q_silu(int kind, int has_min, const float *x, int64_t ldx, const void *w_packed, const float *bias,
                   float *y, int64_t ldy, int64_t m, int64_t inter, int64_t k, int64_t kpad, int64_t gs);
int tm_gemm_bf16(const float *x, int64_t ldx, const void *w_packed, const float *bias, float *y, int64_t ldy,
                 int64_t m, int64_t n, int64_t k, int accumulate);
int tm_gemm_bf16_silu(const float *x, int64_t ldx, const void *w_packed, const float *bias, float *y, int64_t ldy,
                      int64_t m, int64_t inter, int64_t k);
int tm_gemm_nr(void);
void tm_quantize_act(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int64_t gs,
                     unsigned char *codes, float *scales);
int tm_gemm_w8a8(const unsigned char *a, const float *sa, int64_t kp, int64_t gs, const void *w_packed,
                 const float *bias, float *y, int64_t ldy, int64_t m, int64_t n, int accumulate);

int tm_decoder_layer_words(void) { return TM_DEC_LAYER_WORDS; }

#define TM_DEC_NCAT 6
enum { T_LINEAR, T_ATTENTION, T_KV_WRITE, T_NORM, T_ROPE, T_SILU };
static volatile int dec_timing;
static double dec_seconds[TM_DEC_NCAT];

static inline double dec_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* timing on (1) or off (0); either way the counters restart at 0 */
void tm_decoder_set_timing(int on) {
    memset(dec_seconds, 0, sizeof dec_seconds);
    dec_timing = on;
}

int tm_decoder_num_timers(void) { return TM_DEC_NCAT; }

/* out [TM_DEC_NCAT]: seconds so far per category (see the header) */
void tm_decoder_timings(double *out) { memcpy(out, dec_seconds, sizeof dec_seconds); }

#define TIMED(cat, stmt)                              \
    do {                                              \
        if (dec_timing) {                             \
            const double t0_ = dec_now();             \
            stmt;                                     \
            dec_seconds[cat] += dec_now() - t0_;      \
        } else {                                      \
            stmt;                                     \
        }                                             \
    } while (0)

/* y [m, n] (+)= x [m, k] W^T for one described linear layer; codes / scales: W8A8 scratch. */
static int linear(const int64_t *l, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t m, int accumulate,
                  unsigned char *codes, float *scales) {
    const int64_t kind = l[0], fmt = l[1], has_min = l[2], n = l[3], k = l[4], kpad = l[5], gs = l[6];
    const void *w = (const void *)(intptr_t)l[7];
    const float *bias = (const float *)(intptr_t)l[8];
    if (kind == TM_DEC_F32) {
        tm_gemm_f32(x, ldx, (const float *)w, bias, y, ldy, m, n, k, accumulate);
        return 0;
    }
    if (kind == TM_DEC_Q)
        return tm_gemm_q((int)fmt, (int)has_min, x, ldx, w, bias, y, ldy, m, n, k, kpad, gs, accumulate);
    if (kind == TM_DEC_BF16) return tm_gemm_bf16(x, ldx, w, bias, y, ldy, m, n, k, accumulate);
    if (kind == TM_DEC_W8A8) {
        tm_quantize_act(x, ldx, m, k, kpad, gs, codes, scales);
        return tm_gemm_w8a8(codes, scales, kpad, gs, w, bias, y, ldy, m, n, accumulate);
    }
    return -1;
}

/* Whether the gate/up layer l takes SwiGLU in its GEMM epilogue (fp32, bf16 or Q weights, inter a multiple
 * of the panel width): the same rule as the Python layers' silu_mul, so both paths run the same kernels. */
static int silu_fused(const int64_t *l, int64_t inter) {
    return (l[0] == TM_DEC_F32 || l[0] == TM_DEC_Q || l[0] == TM_DEC_BF16) && inter % tm_gemm_nr() == 0;
}

/* act [m, inter] = silu(x Wg^T) * (x Wu^T) for a fused gate/up layer (silu_fused). */
static int linear_silu(const int64_t *l, const float *x, int64_t ldx, float *act, int64_t inter, int64_t m) {
    const int64_t kind = l[0], fmt = l[1], has_min = l[2], k = l[4], kpad = l[5], gs = l[6];
    const void *w = (const void *)(intptr_t)l[7];
    const float *bias = (const float *)(intptr_t)l[8];
    if (kind == TM_DEC_F32) return tm_gemm_f32_silu(x, ldx, (const float *)w, bias, act, inter, m, inter, k);
    if (kind == TM_DEC_BF16) return tm_gemm_bf16_silu(x, ldx, w, bias, act, inter, m, inter, k);
    return tm_gemm_q_silu((int)fmt, (int)has_min, x, ldx, w, bias, act, inter, m, inter, k, kpad, gs);
}

/*
 * Every decoder layer over t tokens, in place on the residual stream h [t, hidden].
 *
 * dims: hidden, q heads, kv heads, head_dim, intermediate, kv slots (s), block size, the KV cache's row
 * format (TM_KV_F32, TM_KV_I8 or TM_KV_F16).
 * positions [t] int64; cos/sin [max_pos, head_dim / 2] fp32; slots [t] int64 (KV write targets);
 * block_tables [rows, max_blocks] int32, row_seq [t] int32 or NULL, kv_len [t] int64, tiles
 * [num_tiles, 2] int64 (the attention plan, as tm_paged_attention takes it).
 * windows [num_layers] int64 or NULL: each layer's sliding window in tokens (0: full attention; NULL:
 * every layer full). The sliding-window layers write and read their KV through w_slots [t] int64 and
 * w_block_tables [rows, w_max_blocks] int32 (the KV cache's sliding-window group: the same rows,
 * positions and tiles, other blocks) where those are given, else through slots and block_tables.
 * Scratch: x [t, hidden], qkv [t, (hq + 2 hkv) d], a [t, hq d], gu [t, 2 inter], act [t, inter];
 * codes / scales: W8A8 activation scratch for the widest layer input (may be NULL without W8A8).
 * Returns 0, or the 1-based index of the layer a kernel refused.
 */
int tm_decoder_forward(const int64_t *desc, int64_t num_layers, const int64_t *dims, float eps, float scale,
                       float *h, int64_t t, const int64_t *positions, const float *cos_t, const float *sin_t,
                       const int64_t *slots, const int32_t *block_tables, int64_t max_blocks, const int32_t *row_seq,
                       const int64_t *kv_len, const int64_t *tiles, int64_t num_tiles, float *x, float *qkv,
                       float *a, float *gu, float *act, unsigned char *codes, float *scales, const int64_t *windows,
                       const int64_t *w_slots, const int32_t *w_block_tables, int64_t w_max_blocks) {
    const int64_t hidden = dims[0], hq = dims[1], hkv = dims[2], d = dims[3], inter = dims[4], s = dims[5];
    const int64_t bs = dims[6];
    const int kv = (int)dims[7];
    const int64_t q_size = hq * d, kv_size = hkv * d, ldqkv = q_size + 2 * kv_size;
    for (int64_t i = 0; i < num_layers; ++i) {
        const int64_t *L = desc + i * TM_DEC_LAYER_WORDS;
        const int64_t *lin = L + 4;
        void *kc = (void *)(intptr_t)L[2], *vc = (void *)(intptr_t)L[3];
        const int64_t window = windows ? windows[i] : 0;
        const int own = window > 0 && w_block_tables; /* the sliding-window group's blocks */
        const int64_t *sl = own ? w_slots : slots;
        const int32_t *bt = own ? w_block_tables : block_tables;
        const int64_t mb = own ? w_max_blocks : max_blocks;
        int rc = 0;
        TIMED(T_NORM, tm_rms_norm(h, hidden, (const float *)(intptr_t)L[0], x, hidden, t, hidden, eps));
        TIMED(T_LINEAR, rc = linear(lin, x, hidden, qkv, ldqkv, t, 0, codes, scales));
        if (rc) return (int)i + 1;
        TIMED(T_ROPE, tm_rope(qkv, ldqkv, t, hq + hkv, d, positions, cos_t, sin_t));
        TIMED(T_KV_WRITE,
              tm_kv_write(qkv + q_size, ldqkv, qkv + q_size + kv_size, ldqkv, t, hkv, d, sl, kc, vc, s, kv));
        TIMED(T_ATTENTION, rc = tm_paged_attention(qkv, ldqkv, kc, vc, kv, bt, mb, row_seq, kv_len, tiles,
                                                   num_tiles, a, q_size, hq, hkv, d, s, bs, scale, window));
        if (rc) return (int)i + 1;
        TIMED(T_LINEAR, rc = linear(lin + TM_DEC_LIN_WORDS, a, q_size, h, hidden, t, 1, codes, scales));
        if (rc) return (int)i + 1;
        TIMED(T_NORM, tm_rms_norm(h, hidden, (const float *)(intptr_t)L[1], x, hidden, t, hidden, eps));
        if (silu_fused(lin + 2 * TM_DEC_LIN_WORDS, inter)) { /* SwiGLU in the gate/up GEMM's epilogue */
            TIMED(T_LINEAR, rc = linear_silu(lin + 2 * TM_DEC_LIN_WORDS, x, hidden, act, inter, t));
            if (rc) return (int)i + 1;
        } else {
            TIMED(T_LINEAR, rc = linear(lin + 2 * TM_DEC_LIN_WORDS, x, hidden, gu, 2 * inter, t, 0, codes, scales));
            if (rc) return (int)i + 1;
            TIMED(T_SILU, tm_silu_mul(gu, 2 * inter, act, inter, t, inter));
        }
        TIMED(T_LINEAR, rc = linear(lin + 3 * TM_DEC_LIN_WORDS, act, inter, h, hidden, t, 1, codes, scales));
        if (rc) return (int)i + 1;
    }
    return 0;
}
