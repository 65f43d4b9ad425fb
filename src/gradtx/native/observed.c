/* The passes gradtx.observe makes over a float32 tensor, each fused into one pass over memory.
 *
 * gradtx_scale_observed_f32: out = x * c (one rounded product, as ATen's mul), with max |x| (NaN
 *   if x holds a NaN, 0 if empty: aminmax's max(|min|, |max|)) and the count of NaN or infinite
 *   values of x, read in the same pass (a block's values counted, from cache, only where its
 *   maximum is not finite): a leading clip's scaling and the gradient statistics.
 *   In place (out == x) the count reads the products: only for a finite |c| <= 1 (a clip's
 *   coefficient), where x * c is non-finite exactly where x is.
 * gradtx_squares_f64: the sum of squares in squares.h's order (float32 within blocks, float64
 *   across them; the Adam step's tally gives the same bits).
 * gradtx_squares_extremes_f32: that sum, max |x| and the non-finite count of x in one pass (a
 *   block's values read again from cache for the maximum): the statistics of a sharded gradient,
 *   which must all be ready for the one all-reduce before the step's own passes.
 * out may be x itself: each value is read before it is written (see the count above).
 */
#include <stdint.h>
#include <stdlib.h>

#include "extremes.h"
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
        for (int i = 0; i < len; i++) { /* the maximum and the products in one loop */
            const float v = x[s + i];
            const uint32_t bits = magnitude_bits(v);
            block_top = bits > block_top ? bits : block_top;
            out[s + i] = v * c;
        }
        /* a NaN or an infinity here: count them (read again, from cache) */
        if (block_top >= EXTREMES_INFINITY) bad += block_nonfinite(x + s, len);
        top = block_top > top ? block_top : top;
    }
    store_top(top, largest);
    *nonfinite = bad;
}

/* gradtx_scale_observed_f32 over `count` tensors (xs[k], outs[k], ns[k]) by one call: each one's
 * max |x| into largest[k] and its count into nonfinite[k]. */
void gradtx_scale_observed_list_f32(const float *const *xs, float c, float *const *outs, const int64_t *ns, int64_t count,
                                    float *largest, int64_t *nonfinite, int threads) {
    for (int64_t k = 0; k < count; k++)
        gradtx_scale_observed_f32(xs[k], c, outs[k], ns[k], largest + k, nonfinite + k, threads);
}

/* x's sum of squares in squares.h's order into *sum (-1 where no memory was had for the blocks'
 * sums); with `extremes`, also its largest magnitude's bits into *top and its non-finite count into
 * *bad, read in the same pass (each block's values again, from cache). */
static void squares_of(const float *x, int64_t n, int threads, int extremes, double *sum, uint32_t *top, int64_t *bad) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    double one = 0.0;
    double *partial = blocks <= 1 ? &one : malloc(sizeof(double) * (size_t)blocks);
    uint32_t largest = 0;
    int64_t count = 0;
    if (!partial) {
        *sum = -1.0; /* never a sum of squares: the caller falls back */
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 65536) reduction(max : largest) reduction(+ : count)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t s = b * BLOCK;
        const int len = (int)(n - s < BLOCK ? n - s : BLOCK);
        partial[b] = block_squares(x + s, len);
        if (extremes) {
            uint32_t block_top = 0;
            for (int i = 0; i < len; i++) {
                const uint32_t bits = magnitude_bits(x[s + i]);
                block_top = bits > block_top ? bits : block_top;
            }
            if (block_top >= EXTREMES_INFINITY) count += block_nonfinite(x + s, len);
            largest = block_top > largest ? block_top : largest;
        }
    }
    *sum = blocks <= 1 ? one : blocks_total(partial, blocks);
    if (blocks > 1) free(partial);
    if (extremes) {
        *top = largest;
        *bad = count;
    }
}

double gradtx_squares_f64(const float *x, int64_t n, int threads) {
    double sum;
    squares_of(x, n, threads, 0, &sum, 0, 0);
    return sum;
}

/* The sum of squares (as gradtx_squares_f64), max |x| and the non-finite count (as
 * gradtx_scale_observed_f32) of `count` tensors (xs[k] of ns[k] values), by one call: into
 * sums[k], largest[k] and nonfinite[k]; sums[k] is -1 where no memory was had for the blocks' sums. */
void gradtx_squares_extremes_list_f32(const float *const *xs, const int64_t *ns, int64_t count, double *sums, float *largest,
                                      int64_t *nonfinite, int threads) {
    for (int64_t k = 0; k < count; k++) {
        uint32_t top = 0;
        nonfinite[k] = 0;
        squares_of(xs[k], ns[k], threads, 1, sums + k, &top, nonfinite + k);
        store_top(top, largest + k);
    }
}
