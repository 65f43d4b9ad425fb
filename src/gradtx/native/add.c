/* apply_updates' sum of one float32 tensor, out = p + u (one rounding, as ATen's add), into a new
 * buffer by non-temporal stores (streams.h): a pure step's new params are written without first
 * reading the buffer's old contents in. Where `out` is not 32-byte aligned, ordinary stores.
 */
#include <stdint.h>

#include "streams.h"

void gradtx_add_f32(const float *p, const float *u, float *out, int64_t n, int threads) {
    const int64_t blocks = (n + STREAM_BLOCK - 1) / STREAM_BLOCK;
    const int stream = stream_aligned(out);
#pragma omp parallel num_threads(threads) if (threads > 1 && n >= 65536)
    {
        float sums[STREAM_BLOCK] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t s = b * STREAM_BLOCK;
            const int len = (int)(n - s < STREAM_BLOCK ? n - s : STREAM_BLOCK);
            float *into = stream ? sums : out + s;
            for (int j = 0; j < len; j++) into[j] = p[s + j] + u[s + j];
            if (stream) stream_copy(out + s, sums, len);
        }
        if (stream) stream_fence();
    }
}
