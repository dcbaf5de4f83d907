/* Few-row float32 products y = x · Wᵀ for AVX2 + FMA (draftheads/heads/fewrow.py says why).
 *
 * The weight (out, in) is re-laid out once into blocks of 16 output features:
 *   blocked[(b * in + k) * 16 + j] = W[b * 16 + j, k]   (zero rows pad the last block)
 * so one block streams contiguously while up to 6 input rows accumulate into 12 AVX registers:
 * the weight is read once per call whatever the row count (up to 6; more rows re-read each
 * block from cache), which is what a verification step of a few tree nodes needs.
 * Threads: OpenMP over blocks, in the runtime torch already loaded (libgomp.so.1).
 *
 * The bfloat16 kernel (draftheads_fewrow_bf16, AVX512-BF16 only: fewrow.py calls it where torch
 * reports native bf16) is the same idea with VDPBF16PS: the weight is blocked into 16 output
 * features × pairs of inputs, one 64-byte load per pair of inputs, every product exact in float32
 * and summed in one float32 chain per output (the order is the input's, whatever the output
 * count), rounded to bf16 once at the end, to nearest even, as F.linear rounds. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

void draftheads_block16(const float *w, float *blocked, long out, long in) {
    long blocks = (out + 15) / 16;
    memset(blocked, 0, sizeof(float) * blocks * 16 * in);
    for (long o = 0; o < out; o++)
        for (long k = 0; k < in; k++)
            blocked[((o / 16) * in + k) * 16 + (o % 16)] = w[o * in + k];
}

#define ROW(m) { __m256 xb = _mm256_broadcast_ss(x + (m) * in + k); \
                 acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]); acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]); }

/* rows (≤ 6) input rows against block b; writes y[m * out + b * 16 + j] for the block's real columns */
static void block_rows(const float *x, const float *blocked, float *y, long rows, long in, long out, long b) {
    const float *blk = blocked + b * in * 16;
    __m256 acc[6][2];
    for (int m = 0; m < 6; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    switch (rows) {  /* one loop per row count: the accumulators stay in registers */
    case 1: for (long k = 0; k < in; k++) { __m256 w0 = _mm256_loadu_ps(blk + k * 16), w1 = _mm256_loadu_ps(blk + k * 16 + 8); ROW(0) } break;
    case 2: for (long k = 0; k < in; k++) { __m256 w0 = _mm256_loadu_ps(blk + k * 16), w1 = _mm256_loadu_ps(blk + k * 16 + 8); ROW(0) ROW(1) } break;
    case 3: for (long k = 0; k < in; k++) { __m256 w0 = _mm256_loadu_ps(blk + k * 16), w1 = _mm256_loadu_ps(blk + k * 16 + 8); ROW(0) ROW(1) ROW(2) } break;
    case 4: for (long k = 0; k < in; k++) { __m256 w0 = _mm256_loadu_ps(blk + k * 16), w1 = _mm256_loadu_ps(blk + k * 16 + 8); ROW(0) ROW(1) ROW(2) ROW(3) } break;
    case 5: for (long k = 0; k < in; k++) { __m256 w0 = _mm256_loadu_ps(blk + k * 16), w1 = _mm256_loadu_ps(blk + k * 16 + 8); ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) } break;
    default: for (long k = 0; k < in; k++) { __m256 w0 = _mm256_loadu_ps(blk + k * 16), w1 = _mm256_loadu_ps(blk + k * 16 + 8); ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) } break;
    }
    long width = out - b * 16 < 16 ? out - b * 16 : 16;
    for (long m = 0; m < rows; m++) {
        float *dst = y + m * out + b * 16;
        if (width == 16) {
            _mm256_storeu_ps(dst, acc[m][0]);
            _mm256_storeu_ps(dst + 8, acc[m][1]);
        } else {
            float tmp[16];
            _mm256_storeu_ps(tmp, acc[m][0]);
            _mm256_storeu_ps(tmp + 8, acc[m][1]);
            memcpy(dst, tmp, sizeof(float) * width);
        }
    }
}

void draftheads_fewrow(const float *x, const float *blocked, float *y, long rows, long in, long out, int threads) {
    long blocks = (out + 15) / 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++)
        for (long m = 0; m < rows; m += 6)
            block_rows(x + m * in, blocked, y + m * out, rows - m < 6 ? rows - m : 6, in, out, b);
}

/* bf16 (as uint16) weight (out, in), in even → blocked[(b * in/2 + p) * 32 + 2j + e] = W[b*16 + j, 2p + e] */
void draftheads_block16_bf16(const uint16_t *w, uint16_t *blocked, long out, long in) {
    long blocks = (out + 15) / 16, pairs = in / 2;
    memset(blocked, 0, sizeof(uint16_t) * blocks * 16 * in);
    for (long o = 0; o < out; o++)
        for (long k = 0; k < in; k++)
            blocked[((o / 16) * pairs + k / 2) * 32 + (o % 16) * 2 + k % 2] = w[o * in + k];
}

#define BF16_BLOCKS 4  /* 16-feature blocks per tile: 4 weight loads feed 6 rows × 4 accumulators */

/* rows (≤ 6) input rows (as pairs of bf16) against blocks b0 .. b0 + nb − 1 (nb ≤ BF16_BLOCKS) */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void bf16_tile(const uint32_t *x, const uint16_t *blocked, uint16_t *y, long rows, long pairs, long out,
                      long b0, long nb) {
    __m512 acc[6][BF16_BLOCKS];
    for (int m = 0; m < 6; m++)
        for (int j = 0; j < BF16_BLOCKS; j++) acc[m][j] = _mm512_setzero_ps();
    const uint16_t *tile = blocked + b0 * pairs * 32;
    for (long p = 0; p < pairs; p++) {
        __m512i w[BF16_BLOCKS];
        for (int j = 0; j < BF16_BLOCKS; j++)
            w[j] = j < nb ? _mm512_loadu_si512(tile + (j * pairs + p) * 32) : _mm512_setzero_si512();
        for (int m = 0; m < 6 && m < rows; m++) {
            __m512i xm = _mm512_set1_epi32((int)x[m * pairs + p]);
            for (int j = 0; j < BF16_BLOCKS; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xm, (__m512bh)w[j]);
        }
    }
    for (long m = 0; m < rows; m++)
        for (long j = 0; j < nb; j++) {
            long b = b0 + j, width = out - b * 16 < 16 ? out - b * 16 : 16;
            uint16_t rounded[16];
            _mm256_storeu_si256((__m256i *)rounded, (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
            memcpy(y + m * out + b * 16, rounded, sizeof(uint16_t) * width);
        }
}

void draftheads_fewrow_bf16(const uint16_t *x, const uint16_t *blocked, uint16_t *y, long rows, long in, long out,
                            int threads) {
    long blocks = (out + 15) / 16, pairs = in / 2, tiles = (blocks + BF16_BLOCKS - 1) / BF16_BLOCKS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tiles; t++) {
        long nb = blocks - t * BF16_BLOCKS < BF16_BLOCKS ? blocks - t * BF16_BLOCKS : BF16_BLOCKS;
        for (long m = 0; m < rows; m += 6)
            bf16_tile((const uint32_t *)(x + m * in), blocked, y + m * out, rows - m < 6 ? rows - m : 6, pairs, out,
                      t * BF16_BLOCKS, nb);
    }
}

/* ---- The elementwise steps of a Llama-form layer (fused.py says why and how they are checked) ----
 * Each computes what transformers' modules compute, operation by operation, in the same dtype
 * steps: bf16 values widened to float32, every intermediate torch rounds to bf16 rounded here to
 * bf16 (to nearest even, as c10 rounds), no fused multiply-add (-ffp-contract=off). Only RMSNorm's
 * sum of squares may land one rounding away (torch sums in another order). Rows are shared among
 * the OpenMP threads (torch's count) once there are enough of them to pay for waking the others. */
#include <math.h>

#define PARALLEL_ELEMENTS 32768

static inline float bf2f(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
    uint32_t u;
    if (f != f) return 0x7FC0;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
#define F32_LOAD(p, i) ((p)[i])
#define F32_ROUND(x) (x)
#define BF16_LOAD(p, i) bf2f((p)[i])
#define BF16_ROUND(x) bf2f(f2bf(x))
#define BF16_STORE(x) f2bf(x)
#define F32_STORE(x) (x)

/* hidden (rows, d) += delta (when given), then out = weight · norm(hidden) as LlamaRMSNorm:
 * h·(1/√(mean(h²) + eps)) in float32, rounded to the dtype, times the weight in the dtype. */
#define ADD_RMS_NORM(NAME, T, LOAD, ROUND, STORE)                                                      \
void NAME(T *hidden, const T *delta, const T *weight, T *out, long rows, long d, float eps) {          \
    _Pragma("omp parallel for schedule(static) if (rows * d >= PARALLEL_ELEMENTS)")                    \
    for (long r = 0; r < rows; r++) {                                                                  \
        T *h = hidden + r * d;                                                                         \
        if (delta) for (long i = 0; i < d; i++) h[i] = STORE(LOAD(h, i) + LOAD(delta + r * d, i));     \
        float sum = 0.0f;                                                                              \
        for (long i = 0; i < d; i++) { float v = LOAD(h, i); sum += v * v; }                           \
        float scale = 1.0f / sqrtf(sum / (float)d + eps);                                              \
        for (long i = 0; i < d; i++) out[r * d + i] = STORE(LOAD(weight, i) * ROUND(LOAD(h, i) * scale)); \
    }                                                                                                  \
}
ADD_RMS_NORM(draftheads_add_rms_norm, float, F32_LOAD, F32_ROUND, F32_STORE)
ADD_RMS_NORM(draftheads_add_rms_norm_bf16, uint16_t, BF16_LOAD, BF16_ROUND, BF16_STORE)

/* In place on x (rows, heads·dim) with rows `stride` apart: each head rotated as
 * q·cos + rotate_half(q)·sin, rotate_half(q) = (−q[half:], q[:half]); cos/sin (cos_rows, dim),
 * row r reading cos row r % cos_rows. */
#define ROPE(NAME, T, LOAD, ROUND, STORE)                                                              \
void NAME(T *x, long rows, long stride, long heads, long dim, const T *cos, const T *sin, long cos_rows) { \
    long half = dim / 2;                                                                               \
    _Pragma("omp parallel for schedule(static) if (rows * heads * dim >= PARALLEL_ELEMENTS)")          \
    for (long r = 0; r < rows; r++) {                                                                  \
        float tmp[1024];                                                                               \
        const T *c = cos + (r % cos_rows) * dim, *s = sin + (r % cos_rows) * dim;                      \
        for (long h = 0; h < heads; h++) {                                                             \
            T *v = x + r * stride + h * dim;                                                           \
            for (long i = 0; i < dim; i++) tmp[i] = LOAD(v, i);                                        \
            for (long i = 0; i < dim; i++) {                                                           \
                float rotated = i < half ? -tmp[i + half] : tmp[i - half];                             \
                v[i] = STORE(ROUND(tmp[i] * LOAD(c, i)) + ROUND(rotated * LOAD(s, i)));                \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
}
ROPE(draftheads_rope, float, F32_LOAD, F32_ROUND, F32_STORE)
ROPE(draftheads_rope_bf16, uint16_t, BF16_LOAD, BF16_ROUND, BF16_STORE)
