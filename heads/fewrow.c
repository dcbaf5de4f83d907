/* Few-row float32 products y = x · Wᵀ for AVX2 + FMA (draftheads/heads/fewrow.py says why).
 *
 * The weight (out, in) is re-laid out once into blocks of 16 output features:
 *   blocked[(b * in + k) * 16 + j] = W[b * 16 + j, k]   (zero rows pad the last block)
 * so one block streams contiguously while up to 6 input rows accumulate into 12 AVX registers:
 * the weight is read once per call whatever the row count (up to 6; more rows re-read each
 * block from cache), which is what a verification step of a few tree nodes needs.
 * Threads: OpenMP over blocks, in the runtime torch already loaded (libgomp.so.1). */
#include <immintrin.h>
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
