/* The elementwise Adam step of one float32 tensor in one pass over memory, with ATen's numbers.
 *
 * Each operation is the one ATen's CPU kernels perform for gradtx's eager Adam step, rounded the
 * same way: lerp and addcmul and add(alpha=) as fused multiply-adds, the square root by the
 * function torch's own sqrt kernel calls (passed in; NULL for sqrtf). Compiled with
 * -ffp-contract=off, so the compiler fuses nothing else. gradtx checks the result against the
 * ATen ops before it uses this code (gradtx/native/adam.py).
 *
 * Outputs may be the inputs' own buffers (mo == m, vo == v, uo == g): each element is read before
 * it is written, and never again.
 *
 * A gradient may come with a factor (`scaled`, `gscale`): the step then takes g * gscale, one
 * rounded product as ATen's mul makes it, in place of g: a global-norm clip's scaling, done where
 * the step reads g instead of in a pass of its own.
 */
#include <math.h>
#include <stdint.h>

#include <stdlib.h>
#if defined(__FMA__)
#include <immintrin.h>
#endif

#include "codebook.h"
#include "extremes.h"
#include "squares.h"
#include "streams.h"

typedef void (*vector_sqrt)(int n, const float *in, float *out, long long mode);
/* MKL's mkl_set_num_threads_local (Fortran-style int pointer): a vector call on a thread of ours
 * would otherwise fork MKL's own threads, once per block. */
typedef int (*set_local_threads)(const int *n);

#define BLOCK 2048
_Static_assert(BLOCK == SQUARES_BLOCK, "the tally sums the blocks squares.h sums");
_Static_assert(BLOCK == STREAM_BLOCK, "blocks stream out aligned");

/* add(u, p, alpha=factor) of u = m / (root + eps) * step: p factor + u, one rounding */
static inline float decayed_update(float p, float m, float root, float eps, float step, float factor) {
    return fmaf(p, factor, (m / (root + eps)) * step);
}

/* The update of a block whose new moments mo, vo are made: u = mo / (sqrt(vo) + eps) * step, and
 * the decay and tally adam_block describes. */
static void adam_update(const float *mo, const float *vo, const float *p, float *uo, int len, float eps, float step,
                        float factor, int decay, vector_sqrt vsqrt, long long mode, double *sums, const float *const *ahead);

/* The update's loop goes a cache line of values at a time (LINE), asking at each for the line at the
 * same place of the next block's inputs (`ahead`: g, m, v and, for AMSGrad, the running maximum; or
 * NULL): their reads start while this block's division keeps the core busy, where the first loop
 * of the next block would wait for them. */
#define LINE 16
#define AHEAD 4
static inline void fetch_ahead(const float *const *ahead, int i) {
    if (ahead) {
        __builtin_prefetch(ahead[0] + i);
        __builtin_prefetch(ahead[1] + i);
        __builtin_prefetch(ahead[2] + i);
        if (ahead[3]) __builtin_prefetch(ahead[3] + i);
    }
}

/* m' = lerp(m, g, w): m + w (g - m) for |w| < 0.5 (`small`, coeff = w), else g - (1 - w)(g - m)
 * (coeff = w - 1); v' = addcmul(v * b2, g, g, value=c2): (c2 g) g + v b2. */
static inline __attribute__((always_inline)) float first_moment(float g, float m, int small, float coeff) {
    return fmaf(coeff, g - m, small ? m : g);
}

static inline __attribute__((always_inline)) float second_moment(float g, float v, float b2, float c2) {
    return fmaf(c2 * g, g, v * b2);
}

static void adam_block(const float *g, const float *m, const float *v, const float *p, float *mo,
                       float *vo, float *uo, int len, int small, float coeff, float b2, float c2,
                       float eps, float step, float factor, int decay, int scaled, float gscale,
                       vector_sqrt vsqrt, long long mode, double *sums, uint32_t *top, int64_t *bad,
                       const float *const *ahead) {
    uint32_t block_max = 0;
#pragma GCC ivdep
    for (int i = 0; i < len; i++) {
        if (top) { /* the raw gradient's largest magnitude, in the loop that reads it */
            const uint32_t bits = magnitude_bits(g[i]);
            block_max = bits > block_max ? bits : block_max;
        }
        const float gi = scaled ? g[i] * gscale : g[i];
        mo[i] = first_moment(gi, m[i], small, coeff);
        vo[i] = second_moment(gi, v[i], b2, c2);
    }
    if (top) { /* counted before uo, which may be g's own buffer, is written */
        if (block_max >= EXTREMES_INFINITY) *bad += block_nonfinite(g, len);
        *top = block_max > *top ? block_max : *top;
    }
    adam_update(mo, vo, p, uo, len, eps, step, factor, decay, vsqrt, mode, sums, ahead);
}

static void adam_update(const float *mo, const float *vo, const float *p, float *uo, int len, float eps, float step,
                        float factor, int decay, vector_sqrt vsqrt, long long mode, double *sums, const float *const *ahead) {
    float root[BLOCK];
    if (vsqrt) {
        vsqrt(len, vo, root, mode);
    } else {
#pragma GCC ivdep
        for (int i = 0; i < len; i++) root[i] = sqrtf(vo[i]);
    }
    if (decay == 1 && sums) { /* as below, with both sums of squares in the same loop */
        float su[SQUARES_LANES] = {0}, sp[SQUARES_LANES] = {0};
        int i = 0;
#if defined(__FMA__) && defined(__AVX__) && SQUARES_LANES == 16
        /* decayed_update eight values at a time (the width of the loop without the tally: the
         * division's throughput sets this loop's pace), the running sums in registers, lane j in
         * su8[j / 8][j % 8]: the lanes and bits of squares.h */
        const __m256 e8 = _mm256_set1_ps(eps), s8 = _mm256_set1_ps(step), f8 = _mm256_set1_ps(factor);
        __m256 su8[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 sp8[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (; i + SQUARES_LANES <= len; i += SQUARES_LANES) {
            fetch_ahead(ahead, i);
#pragma GCC unroll 2
            for (int k = 0; k < 2; k++) {
                const int at = i + 8 * k;
                const __m256 pk = _mm256_loadu_ps(p + at);
                const __m256 q = _mm256_mul_ps(_mm256_div_ps(_mm256_loadu_ps(mo + at), _mm256_add_ps(_mm256_loadu_ps(root + at), e8)), s8);
                const __m256 u = _mm256_fmadd_ps(pk, f8, q);
                _mm256_storeu_ps(uo + at, u);
                su8[k] = _mm256_fmadd_ps(u, u, su8[k]);
                sp8[k] = _mm256_fmadd_ps(pk, pk, sp8[k]);
            }
        }
        for (int k = 0; k < 2; k++) {
            _mm256_storeu_ps(su + 8 * k, su8[k]);
            _mm256_storeu_ps(sp + 8 * k, sp8[k]);
        }
#else
        for (; i + SQUARES_LANES <= len; i += SQUARES_LANES) {
            fetch_ahead(ahead, i);
#pragma GCC ivdep
            for (int j = 0; j < SQUARES_LANES; j++) {
                const float pi = p[i + j], ui = decayed_update(pi, mo[i + j], root[i + j], eps, step, factor);
                uo[i + j] = ui;
                su[j] = fmaf(ui, ui, su[j]);
                sp[j] = fmaf(pi, pi, sp[j]);
            }
        }
#endif
        for (int j = 0; i < len; i++, j++) {
            const float pi = p[i], ui = decayed_update(pi, mo[i], root[i], eps, step, factor);
            uo[i] = ui;
            su[j] = fmaf(ui, ui, su[j]);
            sp[j] = fmaf(pi, pi, sp[j]);
        }
        sums[0] = lanes_total(su);
        sums[1] = lanes_total(sp);
    } else if (decay == 1) {
        int i = 0;
        for (; i + LINE <= len; i += LINE) {
            fetch_ahead(ahead, i);
#pragma GCC ivdep
            for (int j = i; j < i + LINE; j++) uo[j] = decayed_update(p[j], mo[j], root[j], eps, step, factor);
        }
        for (; i < len; i++) uo[i] = decayed_update(p[i], mo[i], root[i], eps, step, factor);
    } else if (decay == 2) { /* add(u, mul(p, factor)): a tensor factor, two roundings */
        int i = 0;
        for (; i + LINE <= len; i += LINE) {
            fetch_ahead(ahead, i);
#pragma GCC ivdep
            for (int j = i; j < i + LINE; j++) uo[j] = (mo[j] / (root[j] + eps)) * step + p[j] * factor;
        }
        for (; i < len; i++) uo[i] = (mo[i] / (root[i] + eps)) * step + p[i] * factor;
    } else {
        int i = 0;
        for (; i + LINE <= len; i += LINE) {
            fetch_ahead(ahead, i);
#pragma GCC ivdep
            for (int j = i; j < i + LINE; j++) uo[j] = (mo[j] / (root[j] + eps)) * step;
        }
        for (; i < len; i++) uo[i] = (mo[i] / (root[i] + eps)) * step;
    }
}

/* Whether the outputs take non-temporal stores (streams.h): new buffers, as a pure step's are. */
static int streams(const float *g, const float *m, const float *v, const float *p, const float *mo, const float *vo,
                   const float *uo) {
    return stream_aligned(mo) && stream_aligned(vo) && stream_aligned(uo) && mo != m && vo != v && uo != g && uo != m
           && uo != v && uo != p && mo != g && vo != g;
}

/* m' = lerp(m, g, w1); v' = addcmul(v * b2, g, g, value=c2); u = m' / (sqrt(v') + eps) * step,
 * plus p * factor for decay 1 (one rounding) and 2 (the product rounded first), with g * gscale
 * in place of g where `scaled`. p is read for the decay, and for the tally. With `sums` (else
 * NULL), the tally: sums[0] = sum of u^2 and sums[1] = sum of p^2 (0 without p), in float64, in
 * squares.h's order (gradtx.observe's statistics, read in this same pass); -1 in sums[0] where the
 * tally could not be taken. With `largest` (else NULL), the raw gradient's max |g| (NaN where it
 * holds one, 0 if empty, as aminmax gives it) and, in `nonfinite`, its count of NaN and infinite
 * values, read in the same pass (the same numbers as observed.c's scaling pass). */
void gradtx_adam_f32(const float *g, const float *m, const float *v, const float *p, float *mo,
                     float *vo, float *uo, int64_t n, float w1, float b2, float c2, float eps,
                     float step, float factor, int decay, int scaled, float gscale, vector_sqrt vsqrt,
                     long long mode, set_local_threads set_local, int threads, double *sums, float *largest,
                     int64_t *nonfinite) {
    const int small = fabsf(w1) < 0.5f;
    const float coeff = small ? w1 : w1 - 1.0f;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    double *partial = sums && blocks ? malloc(sizeof(double) * 2 * (size_t)blocks) : 0;
    const int stream = streams(g, m, v, p, mo, vo, uo);
    uint32_t top = 0;
    int64_t bad = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && n >= 65536) reduction(max : top) reduction(+ : bad)
    {
        const int one = 1;
        const int before = set_local ? set_local(&one) : 0;
        uint32_t *want = largest ? &top : 0; /* this thread's (reduction(max)) */
        /* streaming: a block's outputs are made here, in cache, then stored past it (streams.h) */
        float scratch[3][BLOCK] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t s = b * BLOCK;
            const int len = (int)(n - s < BLOCK ? n - s : BLOCK);
            float *mb = stream ? scratch[0] : mo + s, *vb = stream ? scratch[1] : vo + s, *ub = stream ? scratch[2] : uo + s;
            const float *following[AHEAD] = {g + s + BLOCK, m + s + BLOCK, v + s + BLOCK, 0};
            const float *const *ahead = n - s >= 2 * BLOCK ? following : 0; /* a whole block follows */
            if (partial && decay == 1) { /* the sums in the update's own loop */
                double both[2];
                adam_block(g + s, m + s, v + s, p + s, mb, vb, ub, len, small, coeff, b2, c2, eps,
                           step, factor, decay, scaled, gscale, vsqrt, mode, both, want, &bad, ahead);
                partial[b] = both[0];
                partial[blocks + b] = both[1];
            } else {
                adam_block(g + s, m + s, v + s, decay ? p + s : 0, mb, vb, ub, len, small,
                           coeff, b2, c2, eps, step, factor, decay, scaled, gscale, vsqrt, mode, 0, want, &bad, ahead);
                if (partial) {
                    partial[b] = block_squares(ub, len);
                    partial[blocks + b] = p ? block_squares(p + s, len) : 0.0;
                }
            }
            if (stream) {
                stream_copy(mo + s, mb, len);
                stream_copy(vo + s, vb, len);
                stream_copy(uo + s, ub, len);
            }
        }
        if (stream) stream_fence();
        if (set_local) set_local(&before);
    }
    if (sums) {
        sums[0] = partial ? blocks_total(partial, blocks) : (blocks ? -1.0 : 0.0);
        sums[1] = partial ? blocks_total(partial + blocks, blocks) : 0.0;
        free(partial);
    }
    if (largest) {
        store_top(top, largest);
        *nonfinite = bad;
    }
}

/* The stored step's first loop: each moment read back from its code (joint table entry times the
 * block's absmax, block_values' product), stepped as adam_block's first loop steps it, and the new
 * moments' largest magnitude bits taken on the way (block_absmax's). */
static void stored_moments_block(const float *g, const uint8_t *mc, const uint8_t *vc, const float *m_table,
                                 float m_scale, const float *v_table, float v_scale, float *mo, float *vo, int len,
                                 int small, float coeff, float b2, float c2, int scaled, float gscale,
                                 int32_t *m_top, int32_t *v_top) {
    int32_t m_most = 0, v_most = 0;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 ma = _mm256_set1_ps(m_scale), va = _mm256_set1_ps(v_scale), w = _mm256_set1_ps(coeff);
    const __m256 beta = _mm256_set1_ps(b2), c = _mm256_set1_ps(c2), gs = _mm256_set1_ps(gscale);
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m8 = _mm256_setzero_si256(), v8 = _mm256_setzero_si256();
    for (; i + 8 <= len; i += 8) {
        const __m256 mi = _mm256_mul_ps(
            _mm256_i32gather_ps(m_table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mc + i))), 4), ma);
        const __m256 vi = _mm256_mul_ps(
            _mm256_i32gather_ps(v_table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(vc + i))), 4), va);
        __m256 gi = _mm256_loadu_ps(g + i);
        if (scaled) gi = _mm256_mul_ps(gi, gs);
        const __m256 mn = _mm256_fmadd_ps(w, _mm256_sub_ps(gi, mi), small ? mi : gi);
        const __m256 vn = _mm256_fmadd_ps(_mm256_mul_ps(c, gi), gi, _mm256_mul_ps(vi, beta));
        _mm256_storeu_ps(mo + i, mn);
        _mm256_storeu_ps(vo + i, vn);
        m8 = _mm256_max_epi32(m8, _mm256_and_si256(_mm256_castps_si256(mn), magnitude));
        v8 = _mm256_max_epi32(v8, _mm256_and_si256(_mm256_castps_si256(vn), magnitude));
    }
    int32_t lanes[2][8];
    _mm256_storeu_si256((__m256i *)lanes[0], m8);
    _mm256_storeu_si256((__m256i *)lanes[1], v8);
    for (int j = 0; j < 8; j++) {
        m_most = lanes[0][j] > m_most ? lanes[0][j] : m_most;
        v_most = lanes[1][j] > v_most ? lanes[1][j] : v_most;
    }
#endif
    for (; i < len; i++) {
        const float mi = m_table[mc[i]] * m_scale, vi = v_table[vc[i]] * v_scale;
        const float gi = scaled ? g[i] * gscale : g[i];
        mo[i] = first_moment(gi, mi, small, coeff);
        vo[i] = second_moment(gi, vi, b2, c2);
        const int32_t mb = bits_of(mo[i]) & 0x7FFFFFFF, vb = bits_of(vo[i]) & 0x7FFFFFFF;
        m_most = mb > m_most ? mb : m_most;
        v_most = vb > v_most ? vb : v_most;
    }
    *m_top = m_most;
    *v_top = v_most;
}

/* Asks for the cache lines of `bytes` bytes from `at`, ahead of their use. */
static inline void prefetch_lines(const void *at, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)at + i);
}

/* The same step on moments stored block-wise in 8 bits (quantize_state): per block of each row,
 * the moments are read back from their codes (`mc`, `vc`, uint8, laid out as g) and scales (`ms`,
 * `vs`, rows x blocks), stepped as above, and stored again: each block's absmax becomes its scale,
 * negated where the moment's map is the signed one (`m_signed`, `v_signed`), and its values are
 * encoded under it. The numbers of reading back, stepping with gradtx_adam_f32 and encoding; no
 * moment ever exists in float32 outside a block. Blocks of at most BLOCK values. With g * gscale
 * in place of g where `scaled`, as gradtx_adam_f32 takes it. The new codes, and the update unless
 * it is written into g's own buffer, leave each block by non-temporal stores (streams.h). */
void gradtx_adam_stored_f32(const float *g, const float *p, const uint8_t *mc, const float *ms, const uint8_t *vc,
                            const float *vs, uint8_t *mco, float *mso, uint8_t *vco, float *vso, float *uo,
                            int64_t rows, int64_t columns, int64_t block_size, int64_t blocks, float w1, float b2,
                            float c2, float eps, float step, float factor, int decay, int scaled, float gscale,
                            const float *joint, int32_t size,
                            int m_signed, int v_signed, const int32_t *table_signed, const int32_t *table_unsigned,
                            int32_t shift, int32_t low, int32_t last, int32_t zero, vector_sqrt vsqrt, long long mode,
                            set_local_threads set_local, int threads) {
    const int small = fabsf(w1) < 0.5f;
    const float coeff = small ? w1 : w1 - 1.0f;
    const codebook_lookup book = {table_signed, table_unsigned, shift, low, last, zero};
    const int64_t pairs = rows * blocks;
    const int stream_update = STREAMS && uo != g && uo != p;
    const int stream_codes = STREAMS && mco != mc && vco != vc;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * columns >= 65536)
    {
        const int one = 1;
        const int before = set_local ? set_local(&one) : 0;
        float mn[BLOCK], vn[BLOCK], u[BLOCK];
        uint8_t codes[2][BLOCK];
#pragma omp for schedule(static)
        for (int64_t k = 0; k < pairs; k++) {
            const int64_t r = k / blocks, b = k % blocks;
            int64_t start, stop;
            block_columns(b, 0, block_size, columns, &start, &stop);
            const int64_t at = r * columns + start;
            const int len = (int)(stop - start);
            /* the next block's inputs are fetched while this one is worked on, a stream between
             * each two phases (a burst of them all would stall on the line fill buffers) */
            int64_t next = 0, count = 0;
            if (k + 1 < pairs) {
                int64_t next_start, next_stop;
                block_columns((k + 1) % blocks, 0, block_size, columns, &next_start, &next_stop);
                next = (k + 1) / blocks * columns + next_start;
                count = next_stop - next_start;
            }
            prefetch_lines(mc + next, count);
            prefetch_lines(vc + next, count);
            int32_t m_top, v_top;
            stored_moments_block(g + at, mc + at, vc + at, joint + (bits_of(ms[k]) < 0 ? 0 : size), fabsf(ms[k]),
                                 joint + (bits_of(vs[k]) < 0 ? 0 : size), fabsf(vs[k]), mn, vn, len, small, coeff, b2,
                                 c2, scaled, gscale, &m_top, &v_top);
            prefetch_lines(g + next, count * (int64_t)sizeof(float));
            adam_update(mn, vn, decay ? p + at : 0, stream_update ? u : uo + at, len, eps, step, factor, decay, vsqrt, mode, 0, 0);
            if (stream_update) stream_copy_any(uo + at, u, len);
            const float m_absmax = float_of(m_top), v_absmax = float_of(v_top);
            mso[k] = m_signed ? -m_absmax : m_absmax;
            vso[k] = v_signed ? -v_absmax : v_absmax;
            if (decay) prefetch_lines(p + next, count * (int64_t)sizeof(float));
            block_codes(mn, len, mso[k], &book, stream_codes ? codes[0] : mco + at);
            block_codes(vn, len, vso[k], &book, stream_codes ? codes[1] : vco + at);
            if (stream_codes) {
                stream_copy_bytes(mco + at, codes[0], len);
                stream_copy_bytes(vco + at, codes[1], len);
            }
        }
        if (stream_update || stream_codes) stream_fence();
        if (set_local) set_local(&before);
    }
}

/* AMSGrad (gradtx.scale_by_amsgrad, then the learning rate where `stepped`), per block: m' and v'
 * as the Adam step's, nu_max' = maximum(nu_max, v' * ibc2) (v' where not `corrected`; NaN where
 * either is NaN, else the larger, the second on a tie: torch.maximum's vector kernel), then
 * u = m' / (sqrt(nu_max') + eps) * hat, times `step`. With g * gscale in place of g where `scaled`. */
static void amsgrad_block(const float *g, const float *m, const float *v, const float *vm, float *mo, float *vo,
                          float *vmo, float *uo, int len, int small, float coeff, float b2, float c2, int corrected,
                          float ibc2, float eps, float hat, int stepped, float step, int scaled, float gscale,
                          vector_sqrt vsqrt, long long mode, const float *const *ahead) {
    float root[BLOCK];
#pragma GCC ivdep
    for (int i = 0; i < len; i++) {
        const float gi = scaled ? g[i] * gscale : g[i];
        mo[i] = first_moment(gi, m[i], small, coeff);
        const float vn = second_moment(gi, v[i], b2, c2);
        vo[i] = vn;
        const float c = corrected ? vn * ibc2 : vn, a = vm[i];
        vmo[i] = (a != a || c != c) ? NAN : (a > c ? a : c);
    }
    if (vsqrt) {
        vsqrt(len, vmo, root, mode);
    } else {
#pragma GCC ivdep
        for (int i = 0; i < len; i++) root[i] = sqrtf(vmo[i]);
    }
    int i = 0;
    for (; i + LINE <= len; i += LINE) {
        fetch_ahead(ahead, i);
#pragma GCC ivdep
        for (int j = i; j < i + LINE; j++) {
            const float q = (mo[j] / (root[j] + eps)) * hat;
            uo[j] = stepped ? q * step : q;
        }
    }
    for (; i < len; i++) {
        const float q = (mo[i] / (root[i] + eps)) * hat;
        uo[i] = stepped ? q * step : q;
    }
}

void gradtx_amsgrad_f32(const float *g, const float *m, const float *v, const float *vm, float *mo, float *vo,
                        float *vmo, float *uo, int64_t n, float w1, float b2, float c2, int corrected, float ibc2,
                        float eps, float hat, int stepped, float step, int scaled, float gscale, vector_sqrt vsqrt,
                        long long mode, set_local_threads set_local, int threads) {
    const int small = fabsf(w1) < 0.5f;
    const float coeff = small ? w1 : w1 - 1.0f;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    /* new buffers (a pure step's): made a block at a time in scratch, out by non-temporal stores */
    const int stream = streams(g, m, v, vm, mo, vo, uo) && stream_aligned(vmo) && vmo != vm && vmo != g && uo != vm;
#pragma omp parallel num_threads(threads) if (threads > 1 && n >= 65536)
    {
        const int one = 1;
        const int before = set_local ? set_local(&one) : 0;
        float scratch[4][BLOCK] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t s = b * BLOCK;
            const int len = (int)(n - s < BLOCK ? n - s : BLOCK);
            float *mb = stream ? scratch[0] : mo + s, *vb = stream ? scratch[1] : vo + s;
            float *vmb = stream ? scratch[2] : vmo + s, *ub = stream ? scratch[3] : uo + s;
            const float *following[AHEAD] = {g + s + BLOCK, m + s + BLOCK, v + s + BLOCK, vm + s + BLOCK};
            amsgrad_block(g + s, m + s, v + s, vm + s, mb, vb, vmb, ub, len, small, coeff, b2, c2, corrected, ibc2,
                          eps, hat, stepped, step, scaled, gscale, vsqrt, mode, n - s >= 2 * BLOCK ? following : 0);
            if (stream) {
                stream_copy(mo + s, mb, len);
                stream_copy(vo + s, vb, len);
                stream_copy(vmo + s, vmb, len);
                stream_copy(uo + s, ub, len);
            }
        }
        if (stream) stream_fence();
        if (set_local) set_local(&before);
    }
}
