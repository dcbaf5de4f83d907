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

/* rows (≤ 6) input rows against block b (its 16 × in weights at blk); writes y[m * out + b * 16 + j]
 * for the block's real columns */
static void block_rows(const float *x, const float *blk, float *y, long rows, long in, long out, long b) {
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
            block_rows(x + m * in, blocked + b * in * 16, y + m * out, rows - m < 6 ? rows - m : 6, in, out, b);
}

/* ---- Float32 products over a GGUF's blocks (blocks.py says when a weight has them) ----
 * A weight that is a GGUF quantization dequantized is streamed as its blocks. Q4_1: every group of
 * 32 inputs of an output is w = d·q + m (d, m fp16, q 4 bits: float32 holds d·q exactly and rounds
 * once in + m, as fma rounds), 0.625 bytes a weight against float32's 4. Q8_0: w = d·q (d fp16,
 * q int8: exact in float32), 1.0625 bytes a weight. Layout per 16-output block b and 32-input
 * group g (groups = in / 32):
 *   Q4_1 nib[(b·groups + g)·256 + 8k + j] = q[16b + j, 32g + k] | q[16b + j + 8, 32g + k] << 4   (j < 8)
 *        dm[(b·groups + g)·32 + j] = d[16b + j, g],  dm[(b·groups + g)·32 + 16 + j] = m[16b + j, g]   (fp16)
 *   Q8_0 qs[(b·groups + g)·512 + 16k + j] = q[16b + j, 32g + k];  dm[(b·groups + g)·16 + j] = d[16b + j, g]
 * (the bf16 products read the paired layout of each: see below). Up to 2 rows take a whole block at
 * once (two chains a row: one chain a row waits on the FMA's latency); more take each half (8
 * outputs) with up to 8 rows' accumulators. Either way a column's weights are made in registers
 * and multiplied with the float32 kernel's FMA chain (acc = w·x + acc, inputs in order): the
 * outputs are bit for bit the float32 kernel's over the dequantized weight. */
#define BLOCK_ROWS 8
#define FULL_ROWS 2
#define CVTPH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))

/* a group's scales, then a column's weights (w0, w1: outputs 0-7, 8-15; w: this half's 8) */
#define Q4_FULL_SETUP() const uint16_t *s = dm + (b * groups + g) * 32;                                 \
    const __m256 d0 = CVTPH(s), d1 = CVTPH(s + 8), m0 = CVTPH(s + 16), m1 = CVTPH(s + 24);           \
    const uint8_t *col = data + (b * groups + g) * 256;
#define Q4_FULL_W() __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(col + kk * 8)));     \
    __m256 w0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_and_si256(q, low)), m0);               \
    __m256 w1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m1);
#define Q4_HALF_SETUP() const uint16_t *s = dm + (b * groups + g) * 32 + half * 8;                      \
    const __m256 d = CVTPH(s), mm = CVTPH(s + 16);                                                    \
    const uint8_t *col = data + (b * groups + g) * 256;
#define Q4_HALF_W() __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(col + kk * 8)));     \
    __m256 w = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(q, shift), low)), mm);
#define Q8_FULL_SETUP() const __m256 d0 = CVTPH(dm + (b * groups + g) * 16), d1 = CVTPH(dm + (b * groups + g) * 16 + 8); \
    const int8_t *col = (const int8_t *)data + (b * groups + g) * 512;
#define Q8_FULL_W()                                                                                       \
    __m256 w0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(col + kk * 16))))); \
    __m256 w1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(col + kk * 16 + 8)))));
#define Q8_HALF_SETUP() const __m256 d = CVTPH(dm + (b * groups + g) * 16 + half * 8);                  \
    const int8_t *col = (const int8_t *)data + (b * groups + g) * 512 + half * 8;
#define Q8_HALF_W()                                                                                       \
    __m256 w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(col + kk * 16)))));

#define COLUMNS(SETUP, W, BODY) for (long g = 0; g < groups; g++) { SETUP()                             \
        for (long kk = 0; kk < 32; kk++) { long k = g * 32 + kk; W() BODY } }
#define HROW(r) acc[r] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + (r) * in + k), acc[r]);
#define FROW(r) { __m256 xb = _mm256_broadcast_ss(x + (r) * in + k);                                  \
                  acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]); acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]); }

/* rows (≤ 8) input rows against half `half` of block b: y[r·out + 16b + 8·half + j] */
#define HALF_BLOCK(NAME, SETUP, W)                                                                      \
static void NAME(const float *x, const uint8_t *data, const uint16_t *dm, float *y, long rows, long in, long out, \
                 long b, int half) {                                                                    \
    long groups = in / 32;                                                                              \
    const __m256i low = _mm256_set1_epi32(15);                                                          \
    const __m128i shift = _mm_cvtsi32_si128(4 * half);                                                  \
    (void)low; (void)shift;                                                                             \
    __m256 acc[BLOCK_ROWS];                                                                             \
    for (int r = 0; r < BLOCK_ROWS; r++) acc[r] = _mm256_setzero_ps();                                  \
    switch (rows) {  /* one loop per row count: the accumulators stay in registers */                   \
    case 1: COLUMNS(SETUP, W, HROW(0)) break;                                                           \
    case 2: COLUMNS(SETUP, W, HROW(0) HROW(1)) break;                                                   \
    case 3: COLUMNS(SETUP, W, HROW(0) HROW(1) HROW(2)) break;                                           \
    case 4: COLUMNS(SETUP, W, HROW(0) HROW(1) HROW(2) HROW(3)) break;                                   \
    case 5: COLUMNS(SETUP, W, HROW(0) HROW(1) HROW(2) HROW(3) HROW(4)) break;                           \
    case 6: COLUMNS(SETUP, W, HROW(0) HROW(1) HROW(2) HROW(3) HROW(4) HROW(5)) break;                   \
    case 7: COLUMNS(SETUP, W, HROW(0) HROW(1) HROW(2) HROW(3) HROW(4) HROW(5) HROW(6)) break;           \
    default: COLUMNS(SETUP, W, HROW(0) HROW(1) HROW(2) HROW(3) HROW(4) HROW(5) HROW(6) HROW(7)) break;  \
    }                                                                                                   \
    float tmp[BLOCK_ROWS][8];  /* stored at constant indices: the accumulators stay in registers */     \
    for (int r = 0; r < BLOCK_ROWS; r++) _mm256_storeu_ps(tmp[r], acc[r]);                              \
    long first = b * 16 + half * 8, width = out - first < 8 ? out - first : 8;                          \
    for (long r = 0; r < rows && width > 0; r++) memcpy(y + r * out + first, tmp[r], sizeof(float) * width); \
}

/* 1-2 rows against a whole block, both halves at once (with room for 3 rows here, 2 rows ran ~30% slower
 * and 3 no faster than the halves: results/profile/q4_products/float32_avx2_native) */
#define FULL_BLOCK(NAME, SETUP, W)                                                                      \
static void NAME(const float *x, const uint8_t *data, const uint16_t *dm, float *y, long rows, long in, long out, \
                 long b) {                                                                              \
    long groups = in / 32;                                                                              \
    const __m256i low = _mm256_set1_epi32(15);                                                          \
    (void)low;                                                                                          \
    __m256 acc[FULL_ROWS][2];                                                                           \
    for (int r = 0; r < FULL_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                    \
    if (rows == 1) COLUMNS(SETUP, W, FROW(0))                                                           \
    else COLUMNS(SETUP, W, FROW(0) FROW(1))                                                             \
    float tmp[FULL_ROWS][16];  /* every accumulator stored at a constant index */                      \
    for (int r = 0; r < FULL_ROWS; r++) {                                                               \
        _mm256_storeu_ps(tmp[r], acc[r][0]);                                                            \
        _mm256_storeu_ps(tmp[r] + 8, acc[r][1]);                                                        \
    }                                                                                                   \
    long width = out - b * 16 < 16 ? out - b * 16 : 16;                                                 \
    for (long r = 0; r < rows; r++) memcpy(y + r * out + b * 16, tmp[r], sizeof(float) * width);        \
}

/* y (rows, out) = x (rows, in) · Wᵀ for W given as blocks; in a multiple of 32 */
#define BLOCKS_PRODUCT(NAME, FULL, HALF)                                                                \
void NAME(const float *x, const uint8_t *data, const uint16_t *dm, float *y, long rows, long in, long out, int threads) { \
    long blocks = (out + 15) / 16;                                                                      \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                   \
    for (long b = 0; b < blocks; b++) {                                                                 \
        if (rows <= FULL_ROWS) {                                                                        \
            FULL(x, data, dm, y, rows, in, out, b);                                                     \
            continue;                                                                                   \
        }                                                                                               \
        for (int half = 0; half < 2; half++)                                                            \
            for (long r = 0; r < rows; r += BLOCK_ROWS)                                                 \
                HALF(x + r * in, data, dm, y + r * out, rows - r < BLOCK_ROWS ? rows - r : BLOCK_ROWS, in, out, b, half); \
    }                                                                                                   \
}

HALF_BLOCK(q4_half, Q4_HALF_SETUP, Q4_HALF_W)
FULL_BLOCK(q4_full, Q4_FULL_SETUP, Q4_FULL_W)
BLOCKS_PRODUCT(draftheads_fewrow_q4, q4_full, q4_half)
HALF_BLOCK(q8_half, Q8_HALF_SETUP, Q8_HALF_W)
FULL_BLOCK(q8_full, Q8_FULL_SETUP, Q8_FULL_W)
BLOCKS_PRODUCT(draftheads_fewrow_q8, q8_full, q8_half)

/* Q4_1: q (out, in) uint8 < 16, d and m (out, in / 32) fp16 as uint16 → nib, dm as above (zero rows pad the
 * last block); `paired` (the bf16 product's layout): within each 16 bytes of a pair of columns (2p, 2p + 1),
 * byte 2j + e holds column 2p + e's outputs j and j + 8 instead of byte 8e + j */
void draftheads_q4_layout(const uint8_t *q, const uint16_t *d, const uint16_t *m, uint8_t *nib, uint16_t *dm,
                          long out, long in, int paired) {
    long blocks = (out + 15) / 16, groups = in / 32;
    memset(nib, 0, (size_t)blocks * 16 * in / 2);
    memset(dm, 0, sizeof(uint16_t) * blocks * groups * 32);
    for (long o = 0; o < out; o++) {
        long b = o / 16, j = o % 16;
        for (long g = 0; g < groups; g++) {
            dm[(b * groups + g) * 32 + j] = d[o * groups + g];
            dm[(b * groups + g) * 32 + 16 + j] = m[o * groups + g];
            for (long k = 0; k < 32; k++)
                nib[(b * groups + g) * 256 + (paired ? (k / 2) * 16 + 2 * (j % 8) + k % 2 : k * 8 + j % 8)] |=
                    (uint8_t)(q[o * in + g * 32 + k] << (j < 8 ? 0 : 4));
        }
    }
}

/* Q8_0: q (out, in) int8, d (out, in / 32) fp16 as uint16 → qs, dm as above; `paired`: within each 32 bytes
 * of a pair of columns, byte 2j + e holds column 2p + e's output j */
void draftheads_q8_layout(const int8_t *q, const uint16_t *d, int8_t *qs, uint16_t *dm, long out, long in,
                          int paired) {
    long blocks = (out + 15) / 16, groups = in / 32;
    memset(qs, 0, (size_t)blocks * 16 * in);
    memset(dm, 0, sizeof(uint16_t) * blocks * groups * 16);
    for (long o = 0; o < out; o++) {
        long b = o / 16, j = o % 16;
        for (long g = 0; g < groups; g++) {
            dm[(b * groups + g) * 16 + j] = d[o * groups + g];
            for (long k = 0; k < 32; k++)
                qs[(b * groups + g) * 512 + (paired ? (k / 2) * 32 + 2 * j + k % 2 : k * 16 + j)] = q[o * in + g * 32 + k];
        }
    }
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

/* 16 float32 sums of block b rounded to bf16 (to nearest even, as F.linear rounds) into y_row[16b ...] */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static inline void store_bf16(__m512 acc, uint16_t *y_row, long out, long b) {
    long width = out - b * 16 < 16 ? out - b * 16 : 16;
    uint16_t rounded[16];
    _mm256_storeu_si256((__m256i *)rounded, (__m256i)_mm512_cvtneps_pbh(acc));
    memcpy(y_row + b * 16, rounded, sizeof(uint16_t) * width);
}

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
        for (long j = 0; j < nb; j++) store_bf16(acc[m][j], y + m * out, out, b0 + j);
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

/* ---- bfloat16 products over a GGUF's blocks (AVX512-BF16; the paired layouts) ----
 * A bfloat16 weight that is a GGUF quantization dequantized and rounded to bf16 (as torch rounds a
 * float32 weight: to nearest even) is rebuilt in registers: a pair of input columns (2p, 2p + 1) of
 * the paired layout — lane 2j + e of its low part holds output j's input 2p + e, of its high part
 * output j + 8's (Q4_1: low and high nibbles of 16 bytes; Q8_0: the two 16-byte halves of 32) —
 * dequantized in float32 and rounded to bf16 pairs, which lands them in VDPBF16PS's order (output
 * j's inputs 2p, 2p + 1 side by side); then the bf16 kernel's own chain (one VDPBF16PS per pair of
 * inputs, in order, rounded once at the end): the outputs are bit for bit the bf16 kernel's over
 * the rounded weight. */
#define BF16_TILE_BLOCKS 2  /* 16-output blocks per tile: 2 × 6 rows of accumulators */

/* lane 2j + e of a pair's low part is output j: its scales */
static const int32_t LOW_LANES[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};

/* a group's scales for tile block j, then a pair's weights */
#define Q4_PAIR_SETUP(j) const uint16_t *s = dm + (blk * groups + g) * 32;                            \
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));                               \
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 16)));                        \
    dl[j] = _mm512_permutexvar_ps(low_lanes, d), dh[j] = _mm512_permutexvar_ps(high_lanes, d);        \
    ml[j] = _mm512_permutexvar_ps(low_lanes, m), mh[j] = _mm512_permutexvar_ps(high_lanes, m);
#define Q4_PAIR_W(j) __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(data + (blk * groups + g) * 256 + kk * 16))); \
    __m512 lo = _mm512_fmadd_ps(dl[j], _mm512_cvtepi32_ps(_mm512_and_si512(q, low)), ml[j]);         \
    __m512 hi = _mm512_fmadd_ps(dh[j], _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), mh[j]);
#define Q8_PAIR_SETUP(j) __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + (blk * groups + g) * 16))); \
    dl[j] = _mm512_permutexvar_ps(low_lanes, d), dh[j] = _mm512_permutexvar_ps(high_lanes, d);
#define Q8_PAIR_W(j) const int8_t *pair = (const int8_t *)data + (blk * groups + g) * 512 + kk * 32;   \
    __m512 lo = _mm512_mul_ps(dl[j], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)pair)))); \
    __m512 hi = _mm512_mul_ps(dh[j], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pair + 16)))));

/* rows (≤ 6) input rows (as pairs of bf16) against blocks b0 .. b0 + nb − 1 (nb ≤ BF16_TILE_BLOCKS) */
#define PAIR_TILE(NAME, SETUP, W)                                                                       \
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))                                      \
static void NAME(const uint32_t *x, const uint8_t *data, const uint16_t *dm, uint16_t *y, long rows, long in, \
                 long out, long b0, long nb) {                                                          \
    long groups = in / 32, pairs = in / 2;                                                              \
    __m512 acc[6][BF16_TILE_BLOCKS];                                                                    \
    for (int m = 0; m < 6; m++)                                                                         \
        for (int j = 0; j < BF16_TILE_BLOCKS; j++) acc[m][j] = _mm512_setzero_ps();                     \
    const __m512i low = _mm512_set1_epi32(15), low_lanes = _mm512_loadu_si512(LOW_LANES);               \
    const __m512i high_lanes = _mm512_add_epi32(low_lanes, _mm512_set1_epi32(8));                       \
    (void)low;                                                                                          \
    for (long g = 0; g < groups; g++) {                                                                 \
        __m512 dl[BF16_TILE_BLOCKS], dh[BF16_TILE_BLOCKS], ml[BF16_TILE_BLOCKS], mh[BF16_TILE_BLOCKS];  \
        (void)ml; (void)mh;                                                                             \
        for (int j = 0; j < BF16_TILE_BLOCKS; j++) {                                                    \
            long blk = b0 + (j < nb ? j : 0);  /* past the last block: its first again, never stored */ \
            SETUP(j)                                                                                    \
        }                                                                                               \
        for (long kk = 0; kk < 16; kk++) {                                                              \
            long p = g * 16 + kk;                                                                       \
            __m512i w[BF16_TILE_BLOCKS];                                                                \
            for (int j = 0; j < BF16_TILE_BLOCKS; j++) {                                                \
                long blk = b0 + (j < nb ? j : 0);                                                       \
                W(j)                                                                                    \
                w[j] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);                                            \
            }                                                                                           \
            for (int m = 0; m < 6 && m < rows; m++) {                                                   \
                __m512i xm = _mm512_set1_epi32((int)x[m * pairs + p]);                                  \
                for (int j = 0; j < BF16_TILE_BLOCKS; j++)                                              \
                    acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xm, (__m512bh)w[j]);              \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    for (long m = 0; m < rows; m++)                                                                     \
        for (long j = 0; j < nb; j++) store_bf16(acc[m][j], y + m * out, out, b0 + j);                  \
}

/* y (rows, out) bf16 = x (rows, in) bf16 · Wᵀ for W as blocks rounded to bf16; in a multiple of 32 */
#define PAIR_PRODUCT(NAME, TILE)                                                                        \
void NAME(const uint16_t *x, const uint8_t *data, const uint16_t *dm, uint16_t *y, long rows, long in, long out, \
          int threads) {                                                                                \
    long blocks = (out + 15) / 16, tiles = (blocks + BF16_TILE_BLOCKS - 1) / BF16_TILE_BLOCKS;           \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                   \
    for (long t = 0; t < tiles; t++) {                                                                  \
        long nb = blocks - t * BF16_TILE_BLOCKS < BF16_TILE_BLOCKS ? blocks - t * BF16_TILE_BLOCKS : BF16_TILE_BLOCKS; \
        for (long m = 0; m < rows; m += 6)                                                              \
            TILE((const uint32_t *)(x + m * in), data, dm, y + m * out, rows - m < 6 ? rows - m : 6, in, out, \
                 t * BF16_TILE_BLOCKS, nb);                                                             \
    }                                                                                                   \
}

PAIR_TILE(q4_pair_tile, Q4_PAIR_SETUP, Q4_PAIR_W)
PAIR_PRODUCT(draftheads_fewrow_q4_bf16, q4_pair_tile)
PAIR_TILE(q8_pair_tile, Q8_PAIR_SETUP, Q8_PAIR_W)
PAIR_PRODUCT(draftheads_fewrow_q8_bf16, q8_pair_tile)

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

/* One head of dim values rotated as q·cos + rotate_half(q)·sin, rotate_half(q) = (−q[half:], q[:half]),
 * from src into dst (the same place or another). */
#define ROTATE_HEAD(NAME, T, LOAD, ROUND, STORE)                                                       \
static inline void NAME(const T *src, T *dst, const T *c, const T *s, long dim) {                      \
    float tmp[1024];                                                                                   \
    long half = dim / 2;                                                                               \
    for (long i = 0; i < dim; i++) tmp[i] = LOAD(src, i);                                              \
    for (long i = 0; i < dim; i++) {                                                                   \
        float rotated = i < half ? -tmp[i + half] : tmp[i - half];                                     \
        dst[i] = STORE(ROUND(tmp[i] * LOAD(c, i)) + ROUND(rotated * LOAD(s, i)));                      \
    }                                                                                                  \
}
ROTATE_HEAD(rotate_head, float, F32_LOAD, F32_ROUND, F32_STORE)
ROTATE_HEAD(rotate_head_bf16, uint16_t, BF16_LOAD, BF16_ROUND, BF16_STORE)

/* In place on x (rows, heads·dim) with rows `stride` apart: each head rotated (ROTATE_HEAD); cos/sin
 * (cos_rows, dim), row r reading cos row r % cos_rows. */
#define ROPE(NAME, T, HEAD)                                                                            \
void NAME(T *x, long rows, long stride, long heads, long dim, const T *cos, const T *sin, long cos_rows) { \
    _Pragma("omp parallel for schedule(static) if (rows * heads * dim >= PARALLEL_ELEMENTS)")          \
    for (long r = 0; r < rows; r++) {                                                                  \
        const T *c = cos + (r % cos_rows) * dim, *s = sin + (r % cos_rows) * dim;                      \
        for (long h = 0; h < heads; h++) HEAD(x + r * stride + h * dim, x + r * stride + h * dim, c, s, dim); \
    }                                                                                                  \
}
ROPE(draftheads_rope, float, rotate_head)
ROPE(draftheads_rope_bf16, uint16_t, rotate_head_bf16)

/* A tree step's q/k/v as attention takes them, in one pass: q (rows, heads·dim), k and v (rows,
 * kv_heads·dim), each row `q_stride`/`kv_stride` elements after the last (one stacked product's
 * columns, or three tensors), rows = batch·n (row b·n + j). Writes q rotated into q_out (batch,
 * heads, n, dim), k rotated and v as they are into the cache's buffers (batch, kv_heads, cap, dim)
 * at slots start … start + n − 1. The rotation is ROPE's (ROTATE_HEAD); the rest copies. */
#define ROPE_STORE(NAME, T, HEAD)                                                                      \
void NAME(const T *q, const T *k, const T *v, long q_stride, long kv_stride, long batch, long n,      \
          long heads, long kv_heads, long dim, const T *cos, const T *sin, long cos_rows,              \
          T *q_out, T *key, T *value, long cap, long start) {                                          \
    _Pragma("omp parallel for schedule(static) if (batch * n * heads * dim >= PARALLEL_ELEMENTS)")     \
    for (long r = 0; r < batch * n; r++) {                                                             \
        long b = r / n, j = r % n;                                                                     \
        const T *c = cos + (r % cos_rows) * dim, *s = sin + (r % cos_rows) * dim;                      \
        for (long h = 0; h < heads; h++)                                                               \
            HEAD(q + r * q_stride + h * dim, q_out + ((b * heads + h) * n + j) * dim, c, s, dim);    \
        for (long h = 0; h < kv_heads; h++) {                                                          \
            long slot = ((b * kv_heads + h) * cap + start + j) * dim;                                  \
            HEAD(k + r * kv_stride + h * dim, key + slot, c, s, dim);                                  \
            memcpy(value + slot, v + r * kv_stride + h * dim, dim * sizeof(T));                        \
        }                                                                                              \
    }                                                                                                  \
}
ROPE_STORE(draftheads_rope_store, float, rotate_head)
ROPE_STORE(draftheads_rope_store_bf16, uint16_t, rotate_head_bf16)

/* ---- A tree step's attention over the cache (direct.py's StepAttention says where it runs) ----
 * q (batch, heads, n, dim) as rope_store writes it; key/value the cache's buffers (batch, kv_heads, cap,
 * dim), slots 0 … length − 1 read; mask (batch, n, length) bytes, nonzero = may attend; query head h reads
 * kv head h / (heads / kv_heads). out (batch·n, heads·dim): each query row's softmax(q·kᵀ·scale)·v over
 * the keys it may see — scores, exponentials (a degree-5 polynomial, ~1 ulp, as torch's vectorized
 * softmax has its own) and sums in float32, rounded to the dtype once; a row that sees no key gets zeros.
 * dim a multiple of 8, at most 1024 (fused.py checks). Threads: over (row of the batch, head) pairs. */
#include <stdlib.h>

static inline __m256 exp256(__m256 x) {  /* Cephes' expf: e^x = 2^n · e^r, |r| ≤ ln2/2 */
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                             _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, r), r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define LOAD8_F32(p) _mm256_loadu_ps(p)
#define LOAD8_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

#define TREE_ATTENTION(NAME, T, LOAD8, LOAD, STORE)                                                    \
void NAME(const T *q, const T *key, const T *value, const uint8_t *mask, T *out, long batch, long n,    \
          long heads, long kv_heads, long dim, long cap, long length, float scale, int threads) {      \
    long group = heads / kv_heads;                                                                     \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                  \
    for (long bh = 0; bh < batch * heads; bh++) {                                                      \
        long b = bh / heads, h = bh % heads;                                                           \
        const T *keys = key + (b * kv_heads + h / group) * cap * dim;                                  \
        const T *values = value + (b * kv_heads + h / group) * cap * dim;                              \
        long padded = (length + 7) / 8 * 8;                                                            \
        float *s = malloc(sizeof(float) * padded);                                                     \
        float qf[1024], o[1024];                                                                       \
        for (long j = 0; j < n; j++) {                                                                 \
            const T *qr = q + ((b * heads + h) * n + j) * dim;                                         \
            const uint8_t *m = mask + (b * n + j) * length;                                            \
            T *dst = out + (b * n + j) * heads * dim + h * dim;                                        \
            for (long d = 0; d < dim; d++) { qf[d] = LOAD(qr, d); o[d] = 0.0f; }                       \
            float top = -INFINITY;                                                                     \
            for (long t = 0; t < length; t++) {                                                        \
                if (!m[t]) { s[t] = -INFINITY; continue; }                                             \
                __m256 acc = _mm256_setzero_ps();                                                      \
                for (long d = 0; d < dim; d += 8)                                                      \
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + d), LOAD8(keys + t * dim + d), acc);     \
                s[t] = hsum256(acc) * scale;                                                           \
                if (s[t] > top) top = s[t];                                                            \
            }                                                                                          \
            if (top == -INFINITY) { for (long d = 0; d < dim; d++) dst[d] = STORE(0.0f); continue; }   \
            __m256 total = _mm256_setzero_ps(), shift = _mm256_set1_ps(top), hidden = _mm256_set1_ps(-INFINITY); \
            for (long t = length; t < padded; t++) s[t] = -INFINITY;                                   \
            for (long t = 0; t < padded; t += 8) {  /* a hidden key's weight is 0, not exp's least */  \
                __m256 x = _mm256_loadu_ps(s + t);                                                     \
                __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(x, shift)), _mm256_cmp_ps(x, hidden, _CMP_GT_OQ)); \
                _mm256_storeu_ps(s + t, p);                                                            \
                total = _mm256_add_ps(total, p);                                                       \
            }                                                                                          \
            float sum = hsum256(total);                                                                \
            for (long t = 0; t < length; t++) {                                                        \
                if (!m[t]) continue;                                                                   \
                __m256 p = _mm256_set1_ps(s[t]);                                                       \
                for (long d = 0; d < dim; d += 8)                                                      \
                    _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p, LOAD8(values + t * dim + d), _mm256_loadu_ps(o + d))); \
            }                                                                                          \
            float inv = 1.0f / sum;                                                                    \
            for (long d = 0; d < dim; d++) dst[d] = STORE(o[d] * inv);                                 \
        }                                                                                              \
        free(s);                                                                                       \
    }                                                                                                  \
}
TREE_ATTENTION(draftheads_tree_attention, float, LOAD8_F32, F32_LOAD, F32_STORE)
TREE_ATTENTION(draftheads_tree_attention_bf16, uint16_t, LOAD8_BF16, BF16_LOAD, BF16_STORE)

/* rope_store then tree_attention in one call, the rotated queries in a scratch of the call's own:
 * what direct.py's StepAttention runs per layer (out as tree_attention's, keys up to start + n). */
#define STEP_ATTENTION(NAME, T, STORE_FN, ATTEND_FN)                                                    \
void NAME(const T *q, const T *k, const T *v, long q_stride, long kv_stride, long batch, long n,       \
          long heads, long kv_heads, long dim, const T *cos, const T *sin, long cos_rows, T *key,      \
          T *value, long cap, long start, const uint8_t *mask, T *out, float scale, int threads) {     \
    T *rotated = malloc(sizeof(T) * batch * heads * n * dim);                                          \
    STORE_FN(q, k, v, q_stride, kv_stride, batch, n, heads, kv_heads, dim, cos, sin, cos_rows, rotated, \
             key, value, cap, start);                                                                  \
    ATTEND_FN(rotated, key, value, mask, out, batch, n, heads, kv_heads, dim, cap, start + n, scale, threads); \
    free(rotated);                                                                                     \
}
STEP_ATTENTION(draftheads_step_attention, float, draftheads_rope_store, draftheads_tree_attention)
STEP_ATTENTION(draftheads_step_attention_bf16, uint16_t, draftheads_rope_store_bf16, draftheads_tree_attention_bf16)

#include "body.c"  /* the whole body in one call, over the kernels above */
