/* Skinny GEMM for CPU verification: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32, AVX2 + FMA, one thread.
 *
 * Speculative verification multiplies a few rows (1 to a few dozen tree nodes) by every weight matrix, so the
 * step is bounded by reading the weights, not by arithmetic. Generic BLAS kernels are tuned for large M and
 * read such matrices at a fraction of the memory bandwidth. Here W is packed once into panels of 4 rows whose
 * k-blocks of 8 are interleaved, so a panel is one sequential stream; each panel is read from memory once and
 * stays in L1 while every group of 3 x rows is multiplied against it (12 accumulators). With one group the
 * software prefetch runs a little ahead in the same panel; with several, the groups share the prefetch of the
 * first panel at least 12 KB ahead, each its slice, so that memory keeps streaming at an even rate while they compute
 * from L1 (otherwise the two take turns: 20-30% on 12 rows of the demo's matrices, cycled past the cache).
 *
 * Packed layout (K padded to a multiple of 8, N to a multiple of 4, padding zero), block = (n/4)*(Kp/8) + k/8:
 *   float32: p[block * 32 + (n % 4) * 8 + k % 8] = W[n, k]
 *   bfloat16, when every weight is a bfloat16 value (a bf16 checkpoint, loaded in either dtype):
 *            p[block * 32 + (n % 4) / 2 * 16 + (k % 8) * 2 + n % 2] = high 16 bits of W[n, k]
 * so a 256-bit load holds two weight rows' k-block, one in the low and one in the high half of each 32-bit
 * word, widened exactly by a shift and an AND: the products and sums are the float32 kernel's bit for bit
 * while the weights take half the bytes (and may then fit in the cache).
 * Summation order: each output is 8 lane-wise partial sums over k (k mod 8), then a fixed horizontal add
 * ((v0+v4)+(v1+v5)) + ((v2+v6)+(v3+v7)), whatever group its row is in.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_BLOCKS 16
#define PREFETCH_AHEAD_BYTES 12288
#define PREFETCH_SHARERS 4

/* w: float32 [n_rows, k]; p: float32 or (bf16 != 0) uint16 panels. bf16 keeps the high half of each float,
 * which is exact for the weights the caller checked are bfloat16 values. */
void skinny_pack(const float *w, void *p, long n_rows, long k, long kp, int bf16) {
    long np = (n_rows + 3) / 4 * 4;
    for (long n = 0; n < np; n++)
        for (long j = 0; j < kp; j++) {
            float v = (n < n_rows && j < k) ? w[n * k + j] : 0.0f;
            long block = ((n / 4) * (kp / 8) + j / 8) * 32;
            if (bf16) {
                uint32_t bits;
                memcpy(&bits, &v, 4);
                ((uint16_t *)p)[block + (n % 4) / 2 * 16 + (j % 8) * 2 + n % 2] = (uint16_t)(bits >> 16);
            } else {
                ((float *)p)[block + (n % 4) * 8 + j % 8] = v;
            }
        }
}

/* The two weight vectors at `at` and `at + 8` of a bf16 panel block: 32-bit word i holds vector 0's value i in
 * its low half and vector 1's in its high half, so one 256-bit load and two single-cycle operations (a shift,
 * an AND) widen both exactly. */
static inline __attribute__((always_inline)) void widen2(const uint16_t *p, long at, __m256 *v0, __m256 *v1) {
    __m256i h = _mm256_loadu_si256((const __m256i *)(p + at));
    *v0 = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    *v1 = _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32((int)0xFFFF0000u)));
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

/* R (1-3) x rows times one panel (4 weight rows): R x 4 accumulators. The R x vectors of a k-block are loaded
 * first, then each weight vector (a bf16 pair) is loaded, widened and used R times right away, so no
 * accumulator spills to the stack (holding all four weight vectors at once needs 17 registers at R = 3). */
static inline __attribute__((always_inline)) void rows_panel(const float *x, const void *q0, const float *b, float *y,
                                                             long n, long n_rows, long kp, int bf16, const char *pf,
                                                             long pf_step, const int R) {
    long kb_count = kp / 8;
    __m256 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (long kb = 0; kb < kb_count; kb++) {
        long at = kb * 32;
        if (pf) {
            _mm_prefetch(pf + kb * pf_step, _MM_HINT_T0);
            if (pf_step > 64) _mm_prefetch(pf + kb * pf_step + 64, _MM_HINT_T0);
        }
        __m256 u[3];
        for (int r = 0; r < R; r++) u[r] = _mm256_loadu_ps(x + r * kp + kb * 8);
        if (bf16) {
            for (int j = 0; j < 4; j += 2) {
                __m256 v0, v1;
                widen2((const uint16_t *)q0, at + 8 * j, &v0, &v1);
                for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(u[r], v0, acc[r][j]);
                for (int r = 0; r < R; r++) acc[r][j + 1] = _mm256_fmadd_ps(u[r], v1, acc[r][j + 1]);
            }
        } else {
            for (int j = 0; j < 4; j++) {
                __m256 v = _mm256_loadu_ps((const float *)q0 + at + 8 * j);
                for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(u[r], v, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++) store4(y + r * n_rows + n, b, n, n_rows, acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

/* One panel (4 weight rows) times every x row: x [m_rows, kp] float32 (K zero padded to kp), writes
 * y[:, n:n+4] (y is [m_rows, n_rows]), adds b[n:n+4] when b is not NULL. Rows go in groups of 3, and a
 * remainder of 1 is taken as two groups of 2 (a 1-row group does 4 FMAs per 4 weight loads). Every output
 * is the same sum in the same order whatever its group, so the grouping never changes a bit.
 * Prefetch: a single group runs PREFETCH_BLOCKS ahead in its own panel (q0's stream; the widen-once path
 * never has a single group); with several, the first PREFETCH_SHARERS groups share the prefetch of the panel
 * at `next` (next_size bytes per value), each taking its slice (rounded up, so the slices cover the panel),
 * so memory streams at an even rate while they compute. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, const void *q0, const float *b, float *y,
                                                             long m_rows, long n, long n_rows, long kp, int bf16,
                                                             const char *next, long next_size) {
    long threes = m_rows % 3 == 1 && m_rows > 1 ? m_rows / 3 - 1 : m_rows / 3;
    long groups = threes + (m_rows - 3 * threes + 1) / 2, kb_count = kp / 8;
    long share = groups < PREFETCH_SHARERS ? groups : PREFETCH_SHARERS, step = (32 * next_size + share - 1) / share;
    const char *pf = !next ? NULL : groups == 1 ? (const char *)q0 + 32 * PREFETCH_BLOCKS * (bf16 ? 2 : 4) : next;
    for (long g = 0, m = 0; m < m_rows; g++) {
        const char *slice = pf && g < share ? pf + g * kb_count * step : NULL;
        if (g < threes) {
            rows_panel(x + m * kp, q0, b, y + m * n_rows, n, n_rows, kp, bf16, slice, step, 3);
            m += 3;
        } else if (m + 2 <= m_rows) {
            rows_panel(x + m * kp, q0, b, y + m * n_rows, n, n_rows, kp, bf16, slice, step, 2);
            m += 2;
        } else {
            rows_panel(x + m * kp, q0, b, y + m * n_rows, n, n_rows, kp, bf16, slice, step, 1);
            m += 1;
        }
    }
}

#define WIDEN_MAX_KP 16384
#define WIDEN_MIN_ROWS 20

/* x: [m_rows, kp] float32 row-major (K zero padded to kp), y: [m_rows, n_rows], b: [n_rows] or NULL.
 * A bf16 panel multiplied by WIDEN_MIN_ROWS rows or more is first widened into a float32 scratch that stays
 * in L1, so the widening is paid once per panel, not once per group of 3 rows (same values, same order);
 * below that, widening in registers while streaming is faster (measured). */
void skinny_gemm(const float *x, const void *p, const float *b, float *y, long m_rows, long n_rows, long kp, int bf16) {
    if (m_rows <= 0 || n_rows <= 0) return;
    long panel_values = kp / 8 * 32;
    int widen = bf16 && m_rows >= WIDEN_MIN_ROWS && kp > 0 && kp <= WIDEN_MAX_KP;
    float scratch[widen ? panel_values : 1] __attribute__((aligned(32)));
    long size = bf16 ? 2 : 4, ahead = panel_values ? (PREFETCH_AHEAD_BYTES - 1) / (panel_values * size) + 1 : 0;
    for (long n = 0; n < n_rows; n += 4) {
        long start = (n / 4) * panel_values;
        const char *next = (const char *)p + (start + ahead * panel_values) * size;
        if (!bf16) {
            panel_rows(x, (const float *)p + start, b, y, m_rows, n, n_rows, kp, 0, next, 4);
        } else if (widen) {
            const uint16_t *q = (const uint16_t *)p + start;
            for (long i = 0; i < panel_values; i += 16) {
                __m256 v0, v1;
                widen2(q, i, &v0, &v1);
                _mm256_store_ps(scratch + i, v0);
                _mm256_store_ps(scratch + i + 8, v1);
            }
            panel_rows(x, scratch, b, y, m_rows, n, n_rows, kp, 0, next, 2);
        } else {
            panel_rows(x, (const uint16_t *)p + start, b, y, m_rows, n, n_rows, kp, 1, next, 2);
        }
    }
}
