/* Skinny GEMM for CPU verification: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32, AVX2 + FMA, one thread.
 *
 * Speculative verification multiplies a few rows (1 to a few dozen tree nodes) by every weight matrix, so the
 * step is bounded by reading the weights, not by arithmetic. Generic BLAS kernels are tuned for large M and
 * read such matrices at a fraction of the memory bandwidth. Here W is packed once into panels of 4 rows whose
 * k-blocks of 8 are interleaved, so a panel is one sequential stream (the hardware prefetcher sees a single
 * stream, and a software prefetch runs ahead of it); each panel is read from memory once and stays in L1
 * while every group of 3 x rows is multiplied against it (12 accumulators + 4 weight registers).
 *
 * Packed layout (K padded to a multiple of 8, N to a multiple of 4, padding zero):
 *   p[((n / 4) * (Kp / 8) + k / 8) * 32 + (n % 4) * 8 + k % 8] = W[n, k]
 * Panels hold float32, or bfloat16 when every weight is a bfloat16 value (a bf16 checkpoint, loaded in
 * either dtype): the kernel widens bf16 to float32 exactly (a 16-bit shift), so the products and sums are
 * the float32 kernel's bit for bit while the weights take half the bytes (and may then fit in the cache).
 * Summation order: each output is 8 lane-wise partial sums over k (k mod 8), then a fixed horizontal add
 * ((v0+v4)+(v1+v5)) + ((v2+v6)+(v3+v7)).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_BLOCKS 16

/* w: float32 [n_rows, k]; p: float32 or (bf16 != 0) uint16 panels. bf16 keeps the high half of each float,
 * which is exact for the weights the caller checked are bfloat16 values. */
void skinny_pack(const float *w, void *p, long n_rows, long k, long kp, int bf16) {
    long np = (n_rows + 3) / 4 * 4;
    for (long n = 0; n < np; n++)
        for (long j = 0; j < kp; j++) {
            float v = (n < n_rows && j < k) ? w[n * k + j] : 0.0f;
            long at = ((n / 4) * (kp / 8) + j / 8) * 32 + (n % 4) * 8 + j % 8;
            if (bf16) {
                uint32_t bits;
                memcpy(&bits, &v, 4);
                ((uint16_t *)p)[at] = (uint16_t)(bits >> 16);
            } else {
                ((float *)p)[at] = v;
            }
        }
}

static inline __attribute__((always_inline)) __m256 load_w(const void *p, long at, int bf16) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + at);
}

/* y[0..3] = the four accumulators' sums (+ b[n..n+3]) in the header's order, four outputs per pair of
 * horizontal adds (half the instructions of four one-at-a-time sums, same bits; 1-7% on a hot GEMM). */
static inline void store4(float *y, const float *b, long n, long n_rows, __m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
    __m128 t1 = _mm_add_ps(_mm256_castps256_ps128(a1), _mm256_extractf128_ps(a1, 1));
    __m128 t2 = _mm_add_ps(_mm256_castps256_ps128(a2), _mm256_extractf128_ps(a2, 1));
    __m128 t3 = _mm_add_ps(_mm256_castps256_ps128(a3), _mm256_extractf128_ps(a3, 1));
    __m128 s = _mm_hadd_ps(_mm_hadd_ps(t0, t1), _mm_hadd_ps(t2, t3));
    if (n + 4 <= n_rows) {
        if (b) s = _mm_add_ps(s, _mm_loadu_ps(b + n));
        _mm_storeu_ps(y, s);
        return;
    }
    float out[4];
    _mm_storeu_ps(out, s);
    for (long j = 0; n + j < n_rows; j++) y[j] = b ? out[j] + b[n + j] : out[j];
}

/* One panel (4 weight rows) times every x row: x [m_rows, kp] float32 (K zero padded to kp), writes
 * y[:, n:n+4] (y is [m_rows, n_rows]), adds b[n:n+4] when b is not NULL. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, const void *q0, const float *b, float *y,
                                                             long m_rows, long n, long n_rows, long kp, int bf16,
                                                             int prefetch) {
    long kb_count = kp / 8, size = bf16 ? 2 : 4;
    const char *pf = (const char *)q0 + 32 * PREFETCH_BLOCKS * size;
    long m = 0;
    for (; m + 3 <= m_rows; m += 3) {
        const float *x0 = x + m * kp, *x1 = x0 + kp, *x2 = x1 + kp;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
        __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
        for (long kb = 0; kb < kb_count; kb++) {
            long at = kb * 32;
            if (prefetch) {
                _mm_prefetch(pf + at * size, _MM_HINT_T0);
                _mm_prefetch(pf + (at + 16) * size, _MM_HINT_T0);
            }
            __m256 v0 = load_w(q0, at, bf16), v1 = load_w(q0, at + 8, bf16);
            __m256 v2 = load_w(q0, at + 16, bf16), v3 = load_w(q0, at + 24, bf16);
            __m256 u = _mm256_loadu_ps(x0 + kb * 8);
            a00 = _mm256_fmadd_ps(u, v0, a00); a01 = _mm256_fmadd_ps(u, v1, a01);
            a02 = _mm256_fmadd_ps(u, v2, a02); a03 = _mm256_fmadd_ps(u, v3, a03);
            u = _mm256_loadu_ps(x1 + kb * 8);
            a10 = _mm256_fmadd_ps(u, v0, a10); a11 = _mm256_fmadd_ps(u, v1, a11);
            a12 = _mm256_fmadd_ps(u, v2, a12); a13 = _mm256_fmadd_ps(u, v3, a13);
            u = _mm256_loadu_ps(x2 + kb * 8);
            a20 = _mm256_fmadd_ps(u, v0, a20); a21 = _mm256_fmadd_ps(u, v1, a21);
            a22 = _mm256_fmadd_ps(u, v2, a22); a23 = _mm256_fmadd_ps(u, v3, a23);
        }
        store4(y + m * n_rows + n, b, n, n_rows, a00, a01, a02, a03);
        store4(y + (m + 1) * n_rows + n, b, n, n_rows, a10, a11, a12, a13);
        store4(y + (m + 2) * n_rows + n, b, n, n_rows, a20, a21, a22, a23);
    }
    for (; m < m_rows; m++) {
        const float *x0 = x + m * kp;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long kb = 0; kb < kb_count; kb++) {
            long at = kb * 32;
            if (prefetch) {
                _mm_prefetch(pf + at * size, _MM_HINT_T0);
                _mm_prefetch(pf + (at + 16) * size, _MM_HINT_T0);
            }
            __m256 u = _mm256_loadu_ps(x0 + kb * 8);
            a0 = _mm256_fmadd_ps(u, load_w(q0, at, bf16), a0);
            a1 = _mm256_fmadd_ps(u, load_w(q0, at + 8, bf16), a1);
            a2 = _mm256_fmadd_ps(u, load_w(q0, at + 16, bf16), a2);
            a3 = _mm256_fmadd_ps(u, load_w(q0, at + 24, bf16), a3);
        }
        store4(y + m * n_rows + n, b, n, n_rows, a0, a1, a2, a3);
    }
}

#define WIDEN_MAX_KP 16384
#define WIDEN_MIN_ROWS 10

/* x: [m_rows, kp] float32 row-major (K zero padded to kp), y: [m_rows, n_rows], b: [n_rows] or NULL.
 * A bf16 panel multiplied by WIDEN_MIN_ROWS rows or more is first widened into a float32 scratch that stays
 * in L1, so the widening is paid once per panel, not once per group of 3 rows (same values, same order);
 * below that, widening in registers while streaming is faster (measured). */
void skinny_gemm(const float *x, const void *p, const float *b, float *y, long m_rows, long n_rows, long kp, int bf16) {
    long panel_values = kp / 8 * 32;
    int widen = bf16 && m_rows >= WIDEN_MIN_ROWS && kp <= WIDEN_MAX_KP;
    float scratch[widen ? panel_values : 1] __attribute__((aligned(32)));
    for (long n = 0; n < n_rows; n += 4) {
        long start = (n / 4) * panel_values;
        if (!bf16) {
            panel_rows(x, (const float *)p + start, b, y, m_rows, n, n_rows, kp, 0, 1);
        } else if (widen) {
            const uint16_t *q = (const uint16_t *)p + start;
            for (long i = 0; i < panel_values; i += 8) {
                _mm_prefetch((const char *)(q + i + 32 * PREFETCH_BLOCKS), _MM_HINT_T0);
                _mm256_store_ps(scratch + i, load_w(q, i, 1));
            }
            panel_rows(x, scratch, b, y, m_rows, n, n_rows, kp, 0, 0);
        } else {
            panel_rows(x, (const uint16_t *)p + start, b, y, m_rows, n, n_rows, kp, 1, 1);
        }
    }
}
