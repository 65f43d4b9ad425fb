/* gradtx's eager Lion step (sgd's sibling in gradtx.lion) of one float32 tensor in one pass over
 * memory, with ATen's numbers.
 *
 * Per element, as chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate) computes it:
 * x = lerp(g, m, b1), its sign (a NaN's is 0, as torch.sign's); plus p * factor (decay 1: ATen's
 * add(alpha=), one fused multiply-add; decay 2: a tensor factor, the product rounded first); times
 * `step` (-learning_rate, ATen's mul); and m' = lerp(m, g, 1 - b2). ATen's lerp(a, b, w) is
 * a + w (b - a) for |w| < 0.5, else b - (1 - w)(b - a), one fused multiply-add. Compiled with
 * -ffp-contract=off, so the compiler fuses nothing else. Outputs may be the inputs' own buffers
 * (mo == m, uo == g): each element is read before it is written. Where `scaled`, the step takes
 * g * gscale (one rounded product) in place of g: a global-norm clip's scaling.
 */
#include <math.h>
#include <stdint.h>

#include "streams.h"

/* sign(x) as torch.sign gives it: +1, -1, or +0 for a zero or a NaN (branch-free: vectorized) */
static inline float sign_of(float x) { return (float)((x > 0.0f) - (x < 0.0f)); }

/* One element's step: the update into *uo and m' into *mo. */
static inline __attribute__((always_inline)) void lion_one(
    float gr, float mi, const float *p, int64_t i, float *mo, float *uo, int small1, float c1, int small2, float c2,
    const int decay, float factor, float step, int scaled, float gscale) {
    const float gi = scaled ? gr * gscale : gr;
    const float s = sign_of(fmaf(c1, mi - gi, small1 ? gi : mi)); /* lerp(g, m, b1) */
    const float u = decay == 1 ? fmaf(p[i], factor, s) : decay == 2 ? s + p[i] * factor : s;
    *uo = u * step;
    *mo = fmaf(c2, gi - mi, small2 ? mi : gi); /* lerp(m, g, 1 - b2) */
}

/* The loop for one kind of decay, a constant once inlined: no branch, and no read of p, in it.
 * Into new buffers (`stream`), a block at a time through scratch arrays and non-temporal stores. */
static inline __attribute__((always_inline)) void lion_range(
    const float *g, const float *m, const float *p, float *mo, float *uo, int64_t n, int small1, float c1,
    int small2, float c2, const int decay, float factor, float step, int scaled, float gscale, int threads,
    int stream) {
    if (!stream) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n >= 65536)
        for (int64_t i = 0; i < n; i++)
            lion_one(g[i], m[i], p, i, mo + i, uo + i, small1, c1, small2, c2, decay, factor, step, scaled, gscale);
        return;
    }
    const int64_t blocks = (n + STREAM_BLOCK - 1) / STREAM_BLOCK;
#pragma omp parallel num_threads(threads) if (threads > 1 && n >= 65536)
    {
        float ms[STREAM_BLOCK] __attribute__((aligned(32))), us[STREAM_BLOCK] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t s = b * STREAM_BLOCK;
            const int len = (int)(n - s < STREAM_BLOCK ? n - s : STREAM_BLOCK);
            for (int j = 0; j < len; j++)
                lion_one(g[s + j], m[s + j], p, s + j, ms + j, us + j, small1, c1, small2, c2, decay, factor, step, scaled, gscale);
            stream_copy(mo + s, ms, len);
            stream_copy(uo + s, us, len);
        }
        stream_fence();
    }
}

void gradtx_lion_f32(const float *g, const float *m, const float *p, float *mo, float *uo, int64_t n,
                     float w1, float w2, int decay, float factor, float step, int scaled, float gscale,
                     int threads) {
    const int small1 = fabsf(w1) < 0.5f, small2 = fabsf(w2) < 0.5f;
    const float c1 = small1 ? w1 : w1 - 1.0f, c2 = small2 ? w2 : w2 - 1.0f;
    /* new buffers (a pure step's): non-temporal stores (streams.h) */
    const int stream = stream_aligned(mo) && stream_aligned(uo) && mo != m && mo != g && uo != g && uo != m && uo != p;
    if (decay == 1)
        lion_range(g, m, p, mo, uo, n, small1, c1, small2, c2, 1, factor, step, scaled, gscale, threads, stream);
    else if (decay == 2)
        lion_range(g, m, p, mo, uo, n, small1, c1, small2, c2, 2, factor, step, scaled, gscale, threads, stream);
    else
        lion_range(g, m, p, mo, uo, n, small1, c1, small2, c2, 0, factor, step, scaled, gscale, threads, stream);
}
