/* gradtx's block-wise code books (quantize_state's 8- and 4-bit state) of float32 values, each in
 * one pass, with the numbers of the ATen ops of gradtx/quantization/kernels.py.
 *
 * A piece is `rows` rows of `columns` values (row-major); its first column lies `lead` values into
 * its first block of `block_size`; each row has `blocks` blocks and one float32 scale per block
 * (`scales`, rows x blocks): the block's absmax, its sign bit set where the block uses the signed
 * map. Blocks are independent, so OpenMP splits the (row, block) pairs among threads.
 *
 * absmax: max |x| over a block's values (NaN if it holds one).
 * codes:  x / (absmax > 0 ? absmax : 1), its bit pattern's magnitude names a cell, `first[cell]`
 *         the lowest code it can round to, one comparison with the midpoint above finishes it; a
 *         signed block mirrors negative values below `zero`. Integer operations and one correctly
 *         rounded division: the nearest value, as `bucketize` on the midpoints finds it.
 * values: joint[code (+ size for an unsigned block)] * absmax: one correctly rounded product.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* The columns of block `b` of a row that this piece holds: [*start, *stop). */
static inline void block_columns(int64_t b, int64_t lead, int64_t block_size, int64_t columns, int64_t *start,
                                 int64_t *stop) {
    int64_t begin = b * block_size - lead, end = begin + block_size;
    *start = begin < 0 ? 0 : begin;
    *stop = end > columns ? columns : end;
}

void gradtx_absmax_f32(const float *x, int64_t rows, int64_t columns, int64_t lead, int64_t block_size,
                       int64_t blocks, float *out, int threads) {
    const int64_t pairs = rows * blocks;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * columns >= 65536)
    for (int64_t k = 0; k < pairs; k++) {
        const int64_t r = k / blocks, b = k % blocks;
        int64_t start, stop;
        block_columns(b, lead, block_size, columns, &start, &stop);
        const int32_t *row = (const int32_t *)(x + r * columns);
        /* |x|'s bit patterns order as its values, and a NaN's lies above infinity's: an integer max */
        int32_t most = 0;
        for (int64_t c = start; c < stop; c++) {
            const int32_t magnitude = row[c] & 0x7FFFFFFF;
            most = magnitude > most ? magnitude : most;
        }
        out[k] = float_of(most);
    }
}

#define CHUNK 256

/* Per map (signed, unsigned), per cell of a magnitude's bit pattern (pattern >> shift, at most
 * `last`, less `low`, at least 0): how many of the map's midpoints lie below the cell's start (low
 * 8 bits), and above them the low `shift` bits of the pattern of the one midpoint inside the cell
 * (the float32 at or below the exact one), or all ones where none is. Within a cell, non-negative
 * floats order as the low bits of their patterns: one table read and one integer comparison. */
void gradtx_table_codes_f32(const float *x, int64_t rows, int64_t columns, int64_t lead, int64_t block_size,
                            int64_t blocks, const float *scales, const int32_t *table_signed,
                            const int32_t *table_unsigned, int32_t shift, int32_t low, int32_t last, int32_t zero,
                            uint8_t *out, int threads) {
    const int64_t pairs = rows * blocks;
    const int32_t within = (1 << shift) - 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * columns >= 65536)
    for (int64_t k = 0; k < pairs; k++) {
        const int64_t r = k / blocks, b = k % blocks;
        int64_t start, stop;
        block_columns(b, lead, block_size, columns, &start, &stop);
        const float scale = scales[k];
        const int in_signed = bits_of(scale) < 0;
        const float absmax = fabsf(scale);
        const float divisor = absmax > 0.0f ? absmax : 1.0f;
        const int32_t *table = in_signed ? table_signed : table_unsigned;
        const float *row = x + r * columns;
        uint8_t *codes = out + r * columns;
        int32_t bits[CHUNK], cell[CHUNK];
        uint8_t index[CHUNK];
        for (int64_t c0 = start; c0 < stop; c0 += CHUNK) {
            const int n = (int)(stop - c0 < CHUNK ? stop - c0 : CHUNK);
            for (int i = 0; i < n; i++) { /* vectorized: the quotient and its cell */
                const int32_t q = bits_of(row[c0 + i] / divisor);
                int32_t at = (q & 0x7FFFFFFF) >> shift;
                at = at > last ? last : at;
                at -= low;
                bits[i] = q;
                cell[i] = at > 0 ? at : 0;
            }
            for (int i = 0; i < n; i++) { /* the table reads */
                const int32_t entry = table[cell[i]];
                index[i] = (uint8_t)((entry & 0xFF) + ((bits[i] & within) > (entry >> 8)));
            }
            if (in_signed) {
                for (int i = 0; i < n; i++)
                    codes[c0 + i] = (uint8_t)(bits[i] < 0 ? zero - 1 - index[i] : zero + index[i]);
            } else {
                for (int i = 0; i < n; i++)
                    codes[c0 + i] = index[i];
            }
        }
    }
}

void gradtx_table_values_f32(const uint8_t *codes, int64_t rows, int64_t columns, int64_t lead, int64_t block_size,
                             int64_t blocks, const float *scales, const float *joint, int32_t size, float *out,
                             int threads) {
    const int64_t pairs = rows * blocks;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * columns >= 65536)
    for (int64_t k = 0; k < pairs; k++) {
        const int64_t r = k / blocks, b = k % blocks;
        int64_t start, stop;
        block_columns(b, lead, block_size, columns, &start, &stop);
        const float scale = scales[k];
        const float absmax = fabsf(scale);
        const float *table = joint + (bits_of(scale) < 0 ? 0 : size);
        const uint8_t *row = codes + r * columns;
        float *values = out + r * columns;
        for (int64_t c = start; c < stop; c++)
            values[c] = table[row[c]] * absmax;
    }
}
