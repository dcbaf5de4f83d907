/* A tree step's whole decoder body in one call (body_call.py says where it runs and why): per layer
 * the q/k/v products, the step's rotation, cache write and attention (draftheads_step_attention), the
 * o product, the residual add and the norm after it, the gate/up products, the SiLU gate, the down
 * product and the residual add with the next norm — the calls direct.py makes one by one, in the same
 * order over the same kernels of fewrow.c, so each layer's states are those of that path, bit for bit
 * (the SiLU gate is the one step computed here: silu(g)·u as torch computes it, exp aside). */
/* Included at the end of fewrow.c (one library, one translation unit): its kernels, exp256 and the
 * bf16 conversions are this file's. */
#include <time.h>

/* ---- The SiLU gate: out (rows, inter) = silu(gate) · up, gate and up rows `stride` apart ----
 * As torch computes it in the dtype: silu(x) = x / (1 + exp(−x)) in float32 (bf16 widened, the result
 * rounded to bf16), then the product with up rounded to the dtype. exp is Cephes' polynomial (~1 ulp,
 * as torch's vectorized one has its own): the gate lands within a rounding of torch's (fused.py checks). */
static inline __m256 silu8(__m256 x) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* float32 → bf16 to nearest even (NaN kept a NaN), 8 at a time, as c10 rounds */
static inline __m128i round8_bf16(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline void gate8(const float *g, const float *u, float *o) {
    _mm256_storeu_ps(o, _mm256_mul_ps(silu8(_mm256_loadu_ps(g)), _mm256_loadu_ps(u)));
}
static inline void gate8_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o) {
    __m128i s = round8_bf16(silu8(LOAD8_BF16(g)));  /* silu rounded to bf16, then the product */
    __m256 silu = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(s), 16));
    _mm_storeu_si128((__m128i *)o, round8_bf16(_mm256_mul_ps(silu, LOAD8_BF16(u))));
}

#define SILU_MUL(NAME, T, GATE8)                                                                        \
void NAME(const T *gate, const T *up, long stride, T *out, long rows, long inter) {                   \
    _Pragma("omp parallel for schedule(static) if (rows * inter >= PARALLEL_ELEMENTS)")                \
    for (long r = 0; r < rows; r++) {                                                                  \
        const T *g = gate + r * stride, *u = up + r * stride;                                          \
        T *o = out + r * inter;                                                                        \
        long i = 0;                                                                                    \
        for (; i + 8 <= inter; i += 8) GATE8(g + i, u + i, o + i);                                     \
        if (i < inter) {  /* the tail through the same vector code, padded */                          \
            T gt[8] = {0}, ut[8] = {0}, ot[8];                                                         \
            memcpy(gt, g + i, sizeof(T) * (inter - i));                                                \
            memcpy(ut, u + i, sizeof(T) * (inter - i));                                                \
            GATE8(gt, ut, ot);                                                                         \
            memcpy(o + i, ot, sizeof(T) * (inter - i));                                                \
        }                                                                                              \
    }                                                                                                  \
}
SILU_MUL(draftheads_silu_mul, float, gate8)
SILU_MUL(draftheads_silu_mul_bf16, uint16_t, gate8_bf16)

/* ---- The body ----
 * table (layers, BODY_FIELDS) int64, per layer: seven products q, k, v, o, gate, up, down as (kind, data,
 * scales) — kind 0 the few-row kernel's blocked copy, 1 Q4_1 blocks, 2 Q8_0 blocks, STACKED for k and v
 * (gate and up) when q's (gate's) product is the stacked one of all three (both) —, then the post-attention
 * norm's and the next norm's weights, the cache's key and value buffers (batch, kv_heads, cap, dim), cap,
 * the first new slot, and where to copy the residual stream after the layer (0: nowhere).
 * hidden (rows, d) is updated in place; normed (rows, d): the first layer's normed input on entry, the
 * last norm's output on return. clock (3 doubles, or NULL): seconds added to products, attention, rest. */
enum { STACKED = -1, P_Q = 0, P_K = 3, P_V = 6, P_O = 9, P_GATE = 12, P_UP = 15, P_DOWN = 18, F_POST = 21,
       F_NEXT = 22, F_KEY = 23, F_VALUE = 24, F_CAP = 25, F_START = 26, F_TAP = 27, BODY_FIELDS = 28 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define LAP(slot) if (clock) { double t = now(); clock[slot] += t - mark; mark = t; }

#define PRODUCT(NAME, T, FEWROW, Q4, Q8)                                                                 \
static void NAME(const int64_t *p, const T *x, T *y, long rows, long in, long out, int threads, long work) { \
    int t = rows * in * out >= work ? threads : 1;                                                     \
    if (p[0] == 0) FEWROW(x, (const T *)p[1], y, rows, in, out, t);                                    \
    else if (p[0] == 1) Q4(x, (const uint8_t *)p[1], (const uint16_t *)p[2], y, rows, in, out, t);     \
    else Q8(x, (const uint8_t *)p[1], (const uint16_t *)p[2], y, rows, in, out, t);                    \
}
PRODUCT(product_f32, float, draftheads_fewrow, draftheads_fewrow_q4, draftheads_fewrow_q8)
PRODUCT(product_bf16, uint16_t, draftheads_fewrow_bf16, draftheads_fewrow_q4_bf16, draftheads_fewrow_q8_bf16)

#define BODY(NAME, T, PRODUCT_FN, STEP, NORM, GATE)                                                      \
void NAME(T *hidden, T *normed, const int64_t *table, long layers, long batch, long n, long d, long heads, \
          long kv_heads, long dim, long inter, const T *cos, const T *sin, long cos_rows, const uint8_t *mask, \
          float eps, float scale, int threads, int attention_threads, long work, double *clock) {       \
    long rows = batch * n, hd = heads * dim, kvd = kv_heads * dim;                                     \
    T *qkv = malloc(sizeof(T) * rows * (hd + 2 * kvd)), *att = malloc(sizeof(T) * rows * hd);          \
    T *delta = malloc(sizeof(T) * rows * d), *gu = malloc(sizeof(T) * rows * 2 * inter);               \
    T *act = malloc(sizeof(T) * rows * inter);                                                         \
    double mark = clock ? now() : 0.0;                                                                 \
    for (long l = 0; l < layers; l++) {                                                                \
        const int64_t *f = table + l * BODY_FIELDS;                                                    \
        const T *q = qkv, *k, *v;                                                                      \
        long q_stride, kv_stride;                                                                      \
        if (f[P_K] == STACKED) {                                                                       \
            PRODUCT_FN(f + P_Q, normed, qkv, rows, d, hd + 2 * kvd, threads, work);                    \
            k = qkv + hd, v = qkv + hd + kvd, q_stride = kv_stride = hd + 2 * kvd;                     \
        } else {                                                                                       \
            PRODUCT_FN(f + P_Q, normed, qkv, rows, d, hd, threads, work);                              \
            PRODUCT_FN(f + P_K, normed, qkv + rows * hd, rows, d, kvd, threads, work);                 \
            PRODUCT_FN(f + P_V, normed, qkv + rows * (hd + kvd), rows, d, kvd, threads, work);         \
            k = qkv + rows * hd, v = qkv + rows * (hd + kvd), q_stride = hd, kv_stride = kvd;          \
        }                                                                                              \
        LAP(0)                                                                                         \
        STEP(q, k, v, q_stride, kv_stride, batch, n, heads, kv_heads, dim, cos, sin, cos_rows,         \
             (T *)f[F_KEY], (T *)f[F_VALUE], f[F_CAP], f[F_START], mask, att, scale, attention_threads); \
        LAP(1)                                                                                         \
        PRODUCT_FN(f + P_O, att, delta, rows, hd, d, threads, work);                                   \
        LAP(0)                                                                                         \
        NORM(hidden, delta, (const T *)f[F_POST], normed, rows, d, eps);                               \
        LAP(2)                                                                                         \
        const T *gate = gu, *up;                                                                       \
        long stride;                                                                                   \
        if (f[P_UP] == STACKED) {                                                                      \
            PRODUCT_FN(f + P_GATE, normed, gu, rows, d, 2 * inter, threads, work);                     \
            up = gu + inter, stride = 2 * inter;                                                       \
        } else {                                                                                       \
            PRODUCT_FN(f + P_GATE, normed, gu, rows, d, inter, threads, work);                         \
            PRODUCT_FN(f + P_UP, normed, gu + rows * inter, rows, d, inter, threads, work);            \
            up = gu + rows * inter, stride = inter;                                                    \
        }                                                                                              \
        LAP(0)                                                                                         \
        GATE(gate, up, stride, act, rows, inter);                                                      \
        LAP(2)                                                                                         \
        PRODUCT_FN(f + P_DOWN, act, delta, rows, inter, d, threads, work);                             \
        LAP(0)                                                                                         \
        NORM(hidden, delta, (const T *)f[F_NEXT], normed, rows, d, eps);                               \
        if (f[F_TAP]) memcpy((T *)f[F_TAP], hidden, sizeof(T) * rows * d);                             \
        LAP(2)                                                                                         \
    }                                                                                                  \
    free(qkv); free(att); free(delta); free(gu); free(act);                                            \
}
BODY(draftheads_body, float, product_f32, draftheads_step_attention, draftheads_add_rms_norm, draftheads_silu_mul)
BODY(draftheads_body_bf16, uint16_t, product_bf16, draftheads_step_attention_bf16, draftheads_add_rms_norm_bf16,
     draftheads_silu_mul_bf16)
