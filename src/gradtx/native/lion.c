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

void gradtx_lion_f32(const float *g, const float *m, const float *p, float *mo, float *uo, int64_t n,
                     float w1, float w2, int decay, float factor, float step, int scaled, float gscale,
                     int threads) {
    const int small1 = fabsf(w1) < 0.5f, small2 = fabsf(w2) < 0.5f;
    const float c1 = small1 ? w1 : w1 - 1.0f, c2 = small2 ? w2 : w2 - 1.0f;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const float gi = scaled ? g[i] * gscale : g[i], mi = m[i];
        const float x = fmaf(c1, mi - gi, small1 ? gi : mi); /* lerp(g, m, b1) */
        const float s = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
        float u = s;
        if (decay == 1) u = fmaf(p[i], factor, s);
        else if (decay == 2) u = s + p[i] * factor;
        uo[i] = u * step;
        mo[i] = fmaf(c2, gi - mi, small2 ? mi : gi); /* lerp(m, g, 1 - b2) */
    }
}
