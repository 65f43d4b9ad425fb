/* One block of gradtx's block-wise code books (quantize_state's 8- and 4-bit state), shared by
 * codebook.c (the code books alone) and adam.c (an Adam step on stored moments), with the numbers
 * of the ATen ops of gradtx/quantization/kernels.py.
 *
 * absmax: max |x| over a block's values (NaN if it holds one).
 * codes:  x / (absmax > 0 ? absmax : 1), its bit pattern's magnitude names a cell, the cell's
 *         table entry the lowest code it can round to, one comparison with the midpoint inside the
 *         cell finishes it; a signed block mirrors negative values below `zero`. Integer operations
 *         and one correctly rounded division: the nearest value, as `bucketize` on the midpoints.
 * values: joint[code (+ size for an unsigned block)] * absmax: one correctly rounded product.
 */
#ifndef GRADTX_CODEBOOK_H
#define GRADTX_CODEBOOK_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define CODEBOOK_CHUNK 256

static inline int32_t bits_of(float x) {
    int32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

static inline float float_of(int32_t b) {
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* The columns of block `b` of a row that a piece starting `lead` values into its first block
 * holds: [*start, *stop). */
static inline void block_columns(int64_t b, int64_t lead, int64_t block_size, int64_t columns, int64_t *start,
                                 int64_t *stop) {
    int64_t begin = b * block_size - lead, end = begin + block_size;
    *start = begin < 0 ? 0 : begin;
    *stop = end > columns ? columns : end;
}

/* |x|'s bit patterns order as its values, and a NaN's lies above infinity's: an integer max. */
static inline float block_absmax(const float *x, int64_t n) {
    const int32_t *bits = (const int32_t *)x;
    int32_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        const int32_t magnitude = bits[i] & 0x7FFFFFFF;
        most = magnitude > most ? magnitude : most;
    }
    return float_of(most);
}

/* The tables of a code book's nearest-value lookup. Per map (signed, unsigned), per cell of a
 * magnitude's bit pattern (pattern >> shift, at most `last`, less `low`, at least 0): how many of
 * the map's midpoints lie below the cell's start (low 8 bits), and above them the low `shift`
 * bits of the pattern of the one midpoint inside the cell (the float32 at or below the exact
 * one), or all ones where none is. Within a cell, non-negative floats order as the low bits of
 * their patterns: one table read and one integer comparison per value. */
typedef struct {
    const int32_t *table_signed, *table_unsigned;
    int32_t shift, low, last, zero;
} codebook_lookup;

/* A block under its scale: whether it uses the signed map, what its values are divided by, its
 * map's table. */
typedef struct {
    int in_signed;
    float divisor;
    const int32_t *table;
} codebook_block;

static inline codebook_block block_of(float scale, const codebook_lookup *book) {
    const float absmax = fabsf(scale);
    const int in_signed = bits_of(scale) < 0;
    const codebook_block block = {in_signed, absmax > 0.0f ? absmax : 1.0f,
                                  in_signed ? book->table_signed : book->table_unsigned};
    return block;
}

/* Vectorized: the bit pattern of each of m values over the divisor, and its cell in the tables. */
static inline void quotients_and_cells(const float *x, int m, float divisor, const codebook_lookup *book,
                                       int32_t *bits, int32_t *cell) {
    const int32_t shift = book->shift, low = book->low, last = book->last;
    for (int i = 0; i < m; i++) {
        /* the quotient's magnitude with x's own sign (kernels.py: inf / inf is a NaN of either sign) */
        const int32_t q = (bits_of(x[i] / divisor) & 0x7FFFFFFF) | (bits_of(x[i]) & INT32_MIN);
        int32_t at = (q & 0x7FFFFFFF) >> shift;
        at = at > last ? last : at;
        at -= low;
        bits[i] = q;
        cell[i] = at > 0 ? at : 0;
    }
}

/* The codes of n values under their block's scale (its sign bit names the map). */
static inline void block_codes(const float *x, int64_t n, float scale, const codebook_lookup *book,
                               uint8_t *codes) {
    const codebook_block block = block_of(scale, book);
    const int in_signed = block.in_signed;
    const int32_t *table = block.table;
    const int32_t zero = book->zero, within = (1 << book->shift) - 1;
    int32_t bits[CODEBOOK_CHUNK], cell[CODEBOOK_CHUNK];
    uint8_t index[CODEBOOK_CHUNK];
    for (int64_t c0 = 0; c0 < n; c0 += CODEBOOK_CHUNK) {
        const int m = (int)(n - c0 < CODEBOOK_CHUNK ? n - c0 : CODEBOOK_CHUNK);
        quotients_and_cells(x + c0, m, block.divisor, book, bits, cell);
        for (int i = 0; i < m; i++) { /* the table reads */
            const int32_t entry = table[cell[i]];
            index[i] = (uint8_t)((entry & 0xFF) + ((bits[i] & within) > (entry >> 8)));
        }
        if (in_signed) {
            for (int i = 0; i < m; i++)
                codes[c0 + i] = (uint8_t)(bits[i] < 0 ? zero - 1 - index[i] : zero + index[i]);
        } else {
            for (int i = 0; i < m; i++)
                codes[c0 + i] = index[i];
        }
    }
}

/* gradtx.transforms.low_precision.quick_draws: an integer uniform in [0, 2**24) per element, a
 * bijective mix of its leaf's key and its logical index (xorshift-multiply, 32 bits). */
static inline uint32_t quick_draw(uint64_t key, uint64_t index) {
    uint32_t x = (uint32_t)((key ^ index ^ (index >> 32)) & 0xFFFFFFFFu);
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x5BD1E995u;
    x ^= x >> 16;
    return x >> 8;
}

/* The codes of n values rounded stochastically: each takes the code of the lower or the upper of
 * the two map magnitudes around it, the upper iff (|x| - lo) * 2**24 > draw * (hi - lo), so the
 * value read back is unbiased (gradtx/quantization/kernels.py, table_codes_stochastic).
 * `magnitudes`: the signed map's non-negative half, then from `offset` the unsigned map, `count` in
 * all; `index`: the values' logical indices (NULL: first_index, first_index + 1, ...). */
static inline void block_codes_stochastic(const float *x, int64_t n, float scale, const codebook_lookup *book,
                                          const float *magnitudes, int32_t offset, int32_t count, uint64_t key,
                                          const int64_t *index, int64_t first_index, uint8_t *codes) {
    const codebook_block block = block_of(scale, book);
    const int in_signed = block.in_signed;
    const int32_t *table = block.table;
    const int32_t zero = book->zero, within = (1 << book->shift) - 1;
    const int32_t base = in_signed ? 0 : offset, start = base, end = in_signed ? offset - 1 : count - 1;
    int32_t bits[CODEBOOK_CHUNK], cell[CODEBOOK_CHUNK], nearest[CODEBOOK_CHUNK], other[CODEBOOK_CHUNK];
    float draw[CODEBOOK_CHUNK], here[CODEBOOK_CHUNK], beside[CODEBOOK_CHUNK];
    for (int64_t c0 = 0; c0 < n; c0 += CODEBOOK_CHUNK) {
        const int m = (int)(n - c0 < CODEBOOK_CHUNK ? n - c0 : CODEBOOK_CHUNK);
        quotients_and_cells(x + c0, m, block.divisor, book, bits, cell);
        for (int i = 0; i < m; i++) { /* vectorized: the draws */
            const uint64_t element = index ? (uint64_t)index[c0 + i] : (uint64_t)(first_index + c0 + i);
            draw[i] = (float)quick_draw(key, element);
        }
        for (int i = 0; i < m; i++) { /* the table reads: the nearest magnitude and the one beside it */
            const int32_t pattern = bits[i] & 0x7FFFFFFF;
            const int32_t entry = table[cell[i]];
            const int32_t j = base + (entry & 0xFF) + ((pattern & within) > (entry >> 8));
            const float at = magnitudes[j];
            const int above = at > float_of(pattern); /* the nearest value is the upper neighbour */
            int32_t k = j + 1 - 2 * above;
            k = k < start ? start : k; /* itself at a table's end */
            k = k > end ? end : k;
            nearest[i] = j;
            other[i] = k;
            here[i] = at;
            beside[i] = magnitudes[k];
        }
        for (int i = 0; i < m; i++) { /* vectorized: lower or upper, and the code */
            const float magnitude = float_of(bits[i] & 0x7FFFFFFF);
            const int above = here[i] > magnitude;
            const float lo = above ? beside[i] : here[i], hi = above ? here[i] : beside[i];
            const int away = (magnitude - lo) * 16777216.0f > draw[i] * (hi - lo);
            const int32_t chosen = (away == above ? nearest[i] : other[i]) - base;
            const int32_t code = in_signed ? (bits[i] < 0 ? zero - 1 - chosen : zero + chosen) : chosen;
            codes[c0 + i] = (uint8_t)code;
        }
    }
}

/* The values of n codes under their block's scale: `joint` holds the signed map, then from
 * `size` the unsigned one. */
static inline void block_values(const uint8_t *codes, int64_t n, float scale, const float *joint, int32_t size,
                                float *values) {
    const float absmax = fabsf(scale);
    const float *table = joint + (bits_of(scale) < 0 ? 0 : size);
    int64_t i = 0;
#if defined(__AVX2__)
    /* eight table reads in one gather: faster than the compiler's loads one at a time */
    const __m256 times = _mm256_set1_ps(absmax);
    for (; i + 8 <= n; i += 8) {
        const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i)));
        _mm256_storeu_ps(values + i, _mm256_mul_ps(_mm256_i32gather_ps(table, index, 4), times));
    }
#endif
    for (; i < n; i++)
        values[i] = table[codes[i]] * absmax;
}

#endif
