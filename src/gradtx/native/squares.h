/* Sums of squares, in one fixed order, shared by observed.c (gradtx.observe's own pass) and adam.c
 * (the Adam step's tally of the params it reads and the updates it writes): whichever computes a
 * tensor's sum, the bits are the same.
 *
 * The order: blocks of SQUARES_BLOCK values; within a block SQUARES_LANES float32 running sums
 * (value i into sum i % SQUARES_LANES, by fused multiply-adds: at most 128 terms each, as vector
 * lanes add them), added in lane order in float64; the blocks' sums added in float64 in block
 * order, whatever the number of threads.
 */
#ifndef GRADTX_SQUARES_H
#define GRADTX_SQUARES_H

#include <math.h>
#include <stdint.h>
#if defined(__FMA__)
#include <immintrin.h>
#endif

#define SQUARES_BLOCK 2048
#define SQUARES_LANES 16 /* two vectors of running sums: chains of additions in flight beside the step's own */

/* The lanes' running sums added in lane order, in float64. */
static inline double lanes_total(const float *acc) {
    double sum = 0.0;
    for (int j = 0; j < SQUARES_LANES; j++) sum += (double)acc[j];
    return sum;
}

/* One block's sum (a loop that computes its values, as adam.c's, may add them the same way). With
 * FMA (which x86 CPUs have only with AVX) the 16 lanes are two vectors held in registers, lane j
 * in vector j / 8, element j % 8: as an array GCC leaves them scalar, one fused multiply-add at a
 * time. The same order and bits. */
static inline double block_squares(const float *x, int len) {
    float acc[SQUARES_LANES] = {0};
    int i = 0;
#if defined(__FMA__) && defined(__AVX__) && SQUARES_LANES == 16
    __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* lane j in vector j / 8, element j % 8 */
    for (; i + SQUARES_LANES <= len; i += SQUARES_LANES)
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) {
            const __m256 values = _mm256_loadu_ps(x + i + 8 * k);
            lanes[k] = _mm256_fmadd_ps(values, values, lanes[k]);
        }
    for (int k = 0; k < 2; k++) _mm256_storeu_ps(acc + 8 * k, lanes[k]);
#else
    for (; i + SQUARES_LANES <= len; i += SQUARES_LANES)
        for (int j = 0; j < SQUARES_LANES; j++) acc[j] = fmaf(x[i + j], x[i + j], acc[j]);
#endif
    for (int j = 0; i < len; i++, j++) acc[j] = fmaf(x[i], x[i], acc[j]);
    return lanes_total(acc);
}

/* The blocks' sums (`partial`, one per block) added in block order. */
static inline double blocks_total(const double *partial, int64_t blocks) {
    double sum = 0.0;
    for (int64_t b = 0; b < blocks; b++) sum += partial[b];
    return sum;
}

#endif
