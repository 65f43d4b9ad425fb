/* The passes gradtx.observe makes over a float32 tensor, each fused into one pass over memory.
 *
 * gradtx_scale_observed_f32: out = x * c (one rounded product, as ATen's mul), with max |x| (NaN
 *   if x holds a NaN, 0 if empty: aminmax's max(|min|, |max|)) and the count of NaN or infinite
 *   values of x, read in the same pass: a leading clip's scaling and the gradient statistics.
 * gradtx_squares_f64: the sum of squares in float64, in squares.h's order (the Adam step's tally
 *   gives the same bits).
 * out may be x itself: each value is read before it is written.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "squares.h"

#define BLOCK SQUARES_BLOCK

void gradtx_scale_observed_f32(const float *x, float c, float *out, int64_t n, float *largest, int64_t *nonfinite,
                               int threads) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    uint32_t top = 0;
    int64_t bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 65536) reduction(max : top) reduction(+ : bad)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t s = b * BLOCK;
        const int len = (int)(n - s < BLOCK ? n - s : BLOCK);
        uint32_t block_top = 0;
        int32_t block_bad = 0;
        for (int i = 0; i < len; i++) {
            const float v = x[s + i];
            uint32_t bits;
            memcpy(&bits, &v, sizeof bits);
            bits &= 0x7fffffffu;
            block_top = bits > block_top ? bits : block_top;
            block_bad += bits >= 0x7f800000u;
            out[s + i] = v * c;
        }
        top = block_top > top ? block_top : top;
        bad += block_bad;
    }
    /* magnitudes order as their bit patterns; a NaN's lie above infinity's */
    if (top > 0x7f800000u) top = 0x7fc00000u;
    memcpy(largest, &top, sizeof top);
    *nonfinite = bad;
}

double gradtx_squares_f64(const float *x, int64_t n, int threads) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    if (blocks <= 1) return block_squares(x, (int)n);
    double *partial = malloc(sizeof(double) * (size_t)blocks);
    if (!partial) return -1.0; /* never a sum of squares: the caller falls back */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t s = b * BLOCK;
        partial[b] = block_squares(x + s, (int)(n - s < BLOCK ? n - s : BLOCK));
    }
    const double sum = blocks_total(partial, blocks);
    free(partial);
    return sum;
}
