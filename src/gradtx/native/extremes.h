/* A block's largest gradient magnitude and its count of NaN and infinite values, shared by
 * observed.c (in a clip's scaling pass) and adam.c (in the Adam step's pass): whichever reads them,
 * the numbers are the same, those of aminmax and isfinite.
 *
 * Magnitudes order as their bit patterns with the sign bit cleared (a NaN's above infinity's), so
 * the maximum is an integer maximum; the count is taken only in a block whose maximum is not finite.
 */
#ifndef GRADTX_EXTREMES_H
#define GRADTX_EXTREMES_H

#include <stdint.h>
#include <string.h>

#define EXTREMES_INFINITY 0x7f800000u

/* The magnitude bits of x. */
static inline uint32_t magnitude_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits & 0x7fffffffu;
}

static inline int32_t block_nonfinite(const float *x, int len) {
    int32_t bad = 0;
    for (int i = 0; i < len; i++) bad += magnitude_bits(x[i]) >= EXTREMES_INFINITY;
    return bad;
}

/* The largest magnitude as a float from its bits: any NaN as the one quiet NaN. */
static inline void store_top(uint32_t top, float *largest) {
    if (top > EXTREMES_INFINITY) top = 0x7fc00000u;
    memcpy(largest, &top, sizeof top);
}

#endif
