/* Non-temporal stores for a pure step's outputs, shared by adam.c, lion.c and momentum.c.
 *
 * A pure step writes its new moments and updates into buffers it did not read: an ordinary store
 * to a line not in cache first reads it in (for ownership), a stream of memory traffic the step
 * does not need. A kernel makes a block of outputs in a scratch array (in cache) and copies it out
 * with non-temporal stores, which skip that read; the numbers are the same. Written in place, the
 * lines were just read into cache, and ordinary stores are the cheaper.
 */
#ifndef GRADTX_STREAMS_H
#define GRADTX_STREAMS_H

#include <stdint.h>

#define STREAM_BLOCK 2048 /* floats: 8 KiB, so every block of a 32-byte aligned buffer is aligned */

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#define STREAMS 1

/* n values from `from` to `to` (32-byte aligned) by non-temporal stores. */
static inline void stream_copy(float *to, const float *from, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_stream_ps(to + i, _mm256_loadu_ps(from + i));
    for (; i < n; i++) to[i] = from[i];
}

/* n values from `from` to `to` at any (float) alignment: ordinary stores up to `to`'s first
 * 32-byte boundary and past its last, non-temporal ones between (whole lines only). */
static inline void stream_copy_any(float *to, const float *from, int n) {
    int head = (int)(((32u - ((uintptr_t)to & 31u)) & 31u) / sizeof(float));
    head = head < n ? head : n;
    for (int i = 0; i < head; i++) to[i] = from[i];
    stream_copy(to + head, from + head, n - head);
}

/* n bytes from `from` to `to`, as stream_copy_any does with floats. */
static inline void stream_copy_bytes(uint8_t *to, const uint8_t *from, int n) {
    int i = (int)((32u - ((uintptr_t)to & 31u)) & 31u);
    i = i < n ? i : n;
    for (int j = 0; j < i; j++) to[j] = from[j];
    for (; i + 32 <= n; i += 32)
        _mm256_stream_si256((__m256i *)(to + i), _mm256_loadu_si256((const __m256i *)(from + i)));
    for (; i < n; i++) to[i] = from[i];
}

/* A thread's non-temporal stores, ordered before anything it does next (another thread reads them
 * only after the parallel region's barrier). */
static inline void stream_fence(void) { _mm_sfence(); }
#else
#define STREAMS 0
static inline void stream_copy(float *to, const float *from, int n) {
    for (int i = 0; i < n; i++) to[i] = from[i];
}
static inline void stream_copy_any(float *to, const float *from, int n) { stream_copy(to, from, n); }
static inline void stream_copy_bytes(uint8_t *to, const uint8_t *from, int n) {
    for (int i = 0; i < n; i++) to[i] = from[i];
}
static inline void stream_fence(void) {}
#endif

/* Whether an output at `p` takes non-temporal stores: the CPU has them and `p` is 32-byte aligned
 * (the caller checks that no output is an input). */
static inline int stream_aligned(const void *p) { return STREAMS && !((uintptr_t)p & 31u); }

#endif
