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

void gradtx_trace_f32(const float *g, const float *t, float *to, float *uo, int64_t n, float decay,
                      int nesterov, int scaled, float gscale, int stepped, float step, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const float gi = scaled ? g[i] * gscale : g[i];
        const float tn = t[i] * decay + gi;
        to[i] = tn;
        const float u = nesterov ? fmaf(tn, decay, gi) : tn;
        uo[i] = stepped ? u * step : u;
    }
}
