/* gradtx's eager momentum step (trace) of one float32 tensor in one pass, with ATen's numbers.
 *
 * t' = t * decay + g (ATen's mul, then add: two roundings); the update is t' itself, or
 * g + decay * t' with Nesterov's momentum (ATen's add(alpha=): one fused multiply-add).
 * Compiled with -ffp-contract=off, so the compiler fuses nothing else. Outputs may be the inputs'
 * own buffers (to == t, uo == g): each element is read before it is written. Where `scaled`, the
 * step takes g * gscale (one rounded product, as ATen's mul) in place of g: a global-norm clip's
 * scaling, done where the step reads g. Where `stepped`, the update is multiplied by `step` (one
 * rounded product, as ATen's mul): the learning rate of sgd, folded into the same pass.
 */
#include <math.h>
#include <stdint.h>

#include "streams.h"

static inline __attribute__((always_inline)) void trace_one(float gr, float ti, float *to, float *uo, float decay,
                                                              int nesterov, int scaled, float gscale, int stepped, float step) {
    const float gi = scaled ? gr * gscale : gr;
    const float tn = ti * decay + gi;
    *to = tn;
    const float u = nesterov ? fmaf(tn, decay, gi) : tn;
    *uo = stepped ? u * step : u;
}

void gradtx_trace_f32(const float *g, const float *t, float *to, float *uo, int64_t n, float decay,
                      int nesterov, int scaled, float gscale, int stepped, float step, int threads) {
    /* new buffers (a pure step's): a block at a time, out by non-temporal stores (streams.h) */
    if (!(stream_aligned(to) && stream_aligned(uo) && to != t && to != g && uo != g && uo != t)) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n >= 65536)
        for (int64_t i = 0; i < n; i++) trace_one(g[i], t[i], to + i, uo + i, decay, nesterov, scaled, gscale, stepped, step);
        return;
    }
    const int64_t blocks = (n + STREAM_BLOCK - 1) / STREAM_BLOCK;
#pragma omp parallel num_threads(threads) if (threads > 1 && n >= 65536)
    {
        float ts[STREAM_BLOCK] __attribute__((aligned(32))), us[STREAM_BLOCK] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t s = b * STREAM_BLOCK;
            const int len = (int)(n - s < STREAM_BLOCK ? n - s : STREAM_BLOCK);
            for (int j = 0; j < len; j++) trace_one(g[s + j], t[s + j], ts + j, us + j, decay, nesterov, scaled, gscale, stepped, step);
            stream_copy(to + s, ts, len);
            stream_copy(uo + s, us, len);
        }
        stream_fence();
    }
}
