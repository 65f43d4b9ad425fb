/* gradtx's block-wise code books (quantize_state's 8- and 4-bit state) of float32 values, each in
 * one pass, with the numbers of the ATen ops of gradtx/quantization/kernels.py (codebook.h).
 *
 * A piece is `rows` rows of `columns` values (row-major); its first column lies `lead` values into
 * its first block of `block_size`; each row has `blocks` blocks and one float32 scale per block
 * (`scales`, rows x blocks): the block's absmax, its sign bit set where the block uses the signed
 * map. Blocks are independent, so OpenMP splits the (row, block) pairs among threads.
 */
#include "codebook.h"

#define EACH_BLOCK(body)                                                                                     \
    const int64_t pairs = rows * blocks;                                                                     \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * columns >= 65536)") \
    for (int64_t k = 0; k < pairs; k++) {                                                                    \
        const int64_t r = k / blocks, b = k % blocks;                                                        \
        int64_t start, stop;                                                                                 \
        block_columns(b, lead, block_size, columns, &start, &stop);                                          \
        const int64_t at = r * columns + start, n = stop - start;                                            \
        body;                                                                                                \
    }

void gradtx_absmax_f32(const float *x, int64_t rows, int64_t columns, int64_t lead, int64_t block_size,
                       int64_t blocks, float *out, int threads) {
    EACH_BLOCK(out[k] = block_absmax(x + at, n))
}

void gradtx_table_codes_f32(const float *x, int64_t rows, int64_t columns, int64_t lead, int64_t block_size,
                            int64_t blocks, const float *scales, const int32_t *table_signed,
                            const int32_t *table_unsigned, int32_t shift, int32_t low, int32_t last, int32_t zero,
                            uint8_t *out, int threads) {
    const codebook_lookup book = {table_signed, table_unsigned, shift, low, last, zero};
    EACH_BLOCK(block_codes(x + at, n, scales[k], &book, out + at))
}

void gradtx_table_codes_stochastic_f32(const float *x, int64_t rows, int64_t columns, int64_t lead,
                                       int64_t block_size, int64_t blocks, const float *scales,
                                       const int32_t *table_signed, const int32_t *table_unsigned, int32_t shift,
                                       int32_t low, int32_t last, int32_t zero, const float *magnitudes, int32_t offset,
                                       int32_t count, uint64_t key, const int64_t *index, int64_t first_index,
                                       uint8_t *out, int threads) {
    const codebook_lookup book = {table_signed, table_unsigned, shift, low, last, zero};
    EACH_BLOCK(block_codes_stochastic(x + at, n, scales[k], &book, magnitudes, offset, count, key,
                                      index ? index + at : 0, first_index + at, out + at))
}

void gradtx_table_values_f32(const uint8_t *codes, int64_t rows, int64_t columns, int64_t lead, int64_t block_size,
                             int64_t blocks, const float *scales, const float *joint, int32_t size, float *out,
                             int threads) {
    EACH_BLOCK(block_values(codes + at, n, scales[k], joint, size, out + at))
}

/* 4-bit codes two per byte along the last dim (gradtx/quantization/blocks.py, pack_nibbles):
 * logical columns 2j and 2j + 1 share byte j, low nibble first; a piece at an odd offset (`lead`
 * 1) starts with a high nibble, and the missing halves are zero. */
void gradtx_pack_nibbles(const uint8_t *codes, int64_t rows, int64_t columns, int64_t lead, uint8_t *out,
                         int64_t packed_columns) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = codes + r * columns;
        uint8_t *packed = out + r * packed_columns;
        for (int64_t j = 0; j < packed_columns; j++) {
            const int64_t low = 2 * j - lead, high = low + 1;
            const uint8_t a = low >= 0 && low < columns ? row[low] : 0;
            const uint8_t b = high >= 0 && high < columns ? row[high] : 0;
            packed[j] = (uint8_t)(a | (b << 4));
        }
    }
}

/* The inverse: `columns` codes per row from `packed_columns` bytes, the first at nibble `lead`. */
void gradtx_unpack_nibbles(const uint8_t *packed, int64_t rows, int64_t packed_columns, int64_t columns, int64_t lead,
                           uint8_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = packed + r * packed_columns;
        uint8_t *codes = out + r * columns;
        for (int64_t c = 0; c < columns; c++) {
            const int64_t at = c + lead;
            codes[c] = (uint8_t)((row[at >> 1] >> ((at & 1) * 4)) & 0x0F);
        }
    }
}
