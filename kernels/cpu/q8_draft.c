/* Lossy 8-bit products for a drafter: int8 weights in 32-element blocks with a float32 scale each, times
 * activations quantised per call the same way (llama.cpp's Q8_0 x Q8_0 dot product). A drafter only
 * proposes tokens that the target verifies, so its products need not be exact; they need to be cheap.
 * A 1-row product reads ~1.1 bytes a weight and does its multiply-adds in integers: AVX2 (maddubs) on
 * every AVX2 CPU, AVX-512 VNNI (vpdpbusd) where the CPU has it. The 4-bit variant (Q4_0, float16 scales)
 * reads ~0.56 bytes a weight, for drafters whose acceptance survives it.
 *
 * 8-bit layout: w[N][K] int8 (K a multiple of 32, values in [-127, 127]), d[N][K/32] float32; x[M][K] float32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define PREFETCH_ROWS 16 /* weight rows ahead of the VNNI 4-bit loop that it prefetches */

/* Rows of float32 values into int8 blocks: d = max|v| / 127, q = round(v / d) (0 where the block is 0). */
void q8_quantize(const float *v, long rows, long k, int8_t *q, float *d) {
    for (long r = 0; r < rows; r++) {
        for (long b = 0; b < k / QK; b++) {
            const float *src = v + r * k + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(src[i]));
            float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            d[r * (k / QK) + b] = scale;
            for (int i = 0; i < QK; i++) {
                float t = nearbyintf(src[i] * inv);
                q[r * k + b * QK + i] = (int8_t)(t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t);
            }
        }
    }
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 32 int8 products summed pairwise into 8 int32 lanes (the sign trick keeps maddubs' int16 from saturating). */
static inline __m256 block_dot(const int8_t *w, const int8_t *x) {
    __m256i wv = _mm256_loadu_si256((const __m256i *)w), xv = _mm256_loadu_si256((const __m256i *)x);
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* y[r][n] for n in [n0, n1) and every x row r (a weight row stays in L1 across the x rows). */
static void rows_avx2(const int8_t *w, const float *d, long k, long n0, long n1, const int8_t *xqs,
                      const float *xds, long m, long ldy, float *ys) {
    long nb = k / QK;
    for (long n = n0; n < n1; n++) for (long r = 0; r < m; r++) {
        const int8_t *xq = xqs + r * k;
        const float *xd = xds + r * nb;
        const int8_t *wr = w + n * k;
        const float *dr = d + n * nb;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        long b = 0;
        for (; b + 1 < nb; b += 2) {
            acc0 = _mm256_fmadd_ps(block_dot(wr + b * QK, xq + b * QK), _mm256_set1_ps(dr[b] * xd[b]), acc0);
            acc1 = _mm256_fmadd_ps(block_dot(wr + (b + 1) * QK, xq + (b + 1) * QK),
                                   _mm256_set1_ps(dr[b + 1] * xd[b + 1]), acc1);
        }
        if (b < nb) acc0 = _mm256_fmadd_ps(block_dot(wr + b * QK, xq + b * QK), _mm256_set1_ps(dr[b] * xd[b]), acc0);
        ys[r * ldy + n] = hsum8(_mm256_add_ps(acc0, acc1));
    }
}

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))

/* The same with 64 int8 products (two blocks) per vpdpbusd; the two blocks' scales fill the lane halves. */
VNNI static void rows_vnni(const int8_t *w, const float *d, long k, long n0, long n1, const int8_t *xqs,
                           const float *xds, long m, long ldy, float *ys) {
    long nb = k / QK, pairs = nb / 2;
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (long n = n0; n < n1; n++) for (long r = 0; r < m; r++) {
        const int8_t *xq = xqs + r * k;
        const float *xd = xds + r * nb;
        const int8_t *wr = w + n * k;
        const float *dr = d + n * nb;
        __m512 acc = _mm512_setzero_ps();
        for (long c = 0; c < pairs; c++) {
            __m512i wv = _mm512_loadu_si512(wr + c * 64), xv = _mm512_loadu_si512(xq + c * 64);
            __mmask64 neg = _mm512_movepi8_mask(wv);
            __m512i sx = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), sx);
            __m128 two = _mm_mul_ps(_mm_castpd_ps(_mm_load_sd((const double *)(dr + 2 * c))),
                                    _mm_castpd_ps(_mm_load_sd((const double *)(xd + 2 * c))));
            __m512 scale = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(two));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc);
        }
        float tail = 0.0f;
        if (nb % 2) {
            long b = nb - 1;
            tail = hsum8(_mm256_mul_ps(block_dot(wr + b * QK, xq + b * QK), _mm256_set1_ps(dr[b] * xd[b])));
        }
        ys[r * ldy + n] = _mm512_reduce_add_ps(acc) + tail;
    }
}


/* ---- 4-bit weights: w = d * (q - 8) with q in [0, 15] per 32-block (llama.cpp's Q4_0), d in float16 ----
 * Layout: q[N][K/2] bytes, block b's bytes 16b..16b+15 hold its weights 0..15 in the low nibbles and 16..31 in
 * the high ones; d[N][K/32] float16. The -8 is folded into the integer dot: each block's dot starts at
 * -8 * (sum of the block's int8 x values), computed once per call. */
void q4_quantize(const float *v, long rows, long k, uint8_t *q, uint16_t *d) {
    long nb = k / QK;
    for (long r = 0; r < rows; r++) {
        for (long b = 0; b < nb; b++) {
            const float *src = v + r * k + b * QK;
            float big = 0.0f;
            for (int i = 0; i < QK; i++)
                if (fabsf(src[i]) > fabsf(big)) big = src[i];
            uint16_t dh = _cvtss_sh(big / -8.0f, 0);
            float scale = _cvtsh_ss(dh), inv = scale != 0.0f ? 1.0f / scale : 0.0f;
            d[r * nb + b] = dh;
            uint8_t *dst = q + r * (k / 2) + b * (QK / 2);
            for (int i = 0; i < QK / 2; i++) {
                float a = nearbyintf(src[i] * inv) + 8.0f, c = nearbyintf(src[i + QK / 2] * inv) + 8.0f;
                int ia = a < 0.0f ? 0 : a > 15.0f ? 15 : (int)a, ic = c < 0.0f ? 0 : c > 15.0f ? 15 : (int)c;
                dst[i] = (uint8_t)(ia | (ic << 4));
            }
        }
    }
}

/* one 4-bit block's codes times its x bytes: 8 int32 lanes whose sum is sum(q * x) */
static inline __m256i q4_codes_dot(const uint8_t *w, __m256i xv) {
    __m128i v = _mm_loadu_si128((const __m128i *)w), mask = _mm_set1_epi8(0x0F);
    __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), _mm256_set1_epi16(1));
}

/* one 4-bit block times its x bytes: 8 int32 lanes whose sum is sum(q * x) - 8 * sum(x) */
static inline __m256 q4_block_dot(const uint8_t *w, const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    __m256i xs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), xv), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(q4_codes_dot(w, xv), xs));
}

/* the same from the block's -8 * x sum precomputed per call (`init`: 8 lanes, the first holding it) */
static inline __m256 q4_block_dot_init(const uint8_t *w, const int8_t *x, const int32_t *init) {
    __m256i p = q4_codes_dot(w, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(p, _mm256_loadu_si256((const __m256i *)init)));
}

static void q4_rows_avx2(const uint8_t *w, const uint16_t *d, long k, long n0, long n1, const int8_t *xqs,
                         const float *xds, const int32_t *inits, long m, long ldy, float *ys) {
    long nb = k / QK, pairs = nb / 2;
    for (long n = n0; n < n1; n++) for (long r = 0; r < m; r++) {
        const uint8_t *wr = w + n * (k / 2);
        const uint16_t *dr = d + n * nb;
        const int8_t *xq = xqs + r * k;
        const float *xd = xds + r * nb;
        const int32_t *init = inits + r * pairs * 16;  /* block b's at (b / 2) * 16 + (b % 2) * 8 */
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        long b = 0;
        for (; b + 1 < nb; b += 2) {
            acc0 = _mm256_fmadd_ps(q4_block_dot_init(wr + b * 16, xq + b * QK, init + b * 8),
                                   _mm256_set1_ps(_cvtsh_ss(dr[b]) * xd[b]), acc0);
            acc1 = _mm256_fmadd_ps(q4_block_dot_init(wr + (b + 1) * 16, xq + (b + 1) * QK, init + b * 8 + 8),
                                   _mm256_set1_ps(_cvtsh_ss(dr[b + 1]) * xd[b + 1]), acc1);
        }
        if (b < nb) acc0 = _mm256_fmadd_ps(q4_block_dot(wr + b * 16, xq + b * QK), _mm256_set1_ps(_cvtsh_ss(dr[b]) * xd[b]), acc0);
        ys[r * ldy + n] = hsum8(_mm256_add_ps(acc0, acc1));
    }
}

/* The VNNI path's 4-bit pair (blocks 2c, 2c + 1: 64 weights) as 64 code bytes with no cross-lane shuffle: the
 * pair's 32 bytes are broadcast to both 256-bit halves, the upper half shifted by 4, and both masked, giving
 * [b0 w0-15, b1 w0-15, b0 w16-31, b1 w16-31]; the call's x bytes are permuted to that order once (`xp`), so
 * int32 lanes 0-3 and 8-11 hold block 2c's dot and 4-7, 12-15 block 2c + 1's. `init` holds -8 * each block's
 * x sum in lanes 0 and 4. */
VNNI static inline __m512 q4_pair(const uint8_t *w, const uint16_t *d, const int8_t *xp, const float *xd,
                                  const int32_t *init, __m512 acc) {
    const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0), mask = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w));
    __m512i p = _mm512_dpbusd_epi32(_mm512_loadu_si512(init), _mm512_and_si512(_mm512_srlv_epi64(v, shifts), mask),
                                    _mm512_loadu_si512(xp));
    __m128 two = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(*(const int *)d)),
                            _mm_castpd_ps(_mm_load_sd((const double *)xd)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(two)), acc);
}

/* the sums of four 16-lane vectors, in one 4-lane vector (shuffles of whole vectors, not four reductions) */
VNNI static inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    s = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s));
}

/* Four weight rows at a time (four independent accumulator chains, one 4-way horizontal sum); xps is x in the
 * pair order above, xqs the plain quantised x (for an odd last block). */
VNNI static void q4_rows_vnni(const uint8_t *w, const uint16_t *d, long k, long n0, long n1, const int8_t *xqs,
                              const int8_t *xps, const float *xds, const int32_t *inits, long m, long ldy, float *ys) {
    long nb = k / QK, pairs = nb / 2;
    for (long n = n0; n < n1; n += 4) {
        int g = n1 - n < 4 ? (int)(n1 - n) : 4;
        if (n + PREFETCH_ROWS + 4 <= n1) { /* the rows a few groups ahead, codes and scales */
            const char *next = (const char *)(w + (n + PREFETCH_ROWS) * (k / 2));
            for (long b = 0; b < 4 * (k / 2); b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
            for (long b = 0; b < 4 * nb * 2; b += 64) _mm_prefetch((const char *)(d + (n + PREFETCH_ROWS) * nb) + b, _MM_HINT_T0);
        }
        for (long r = 0; r < m; r++) {
            const int8_t *xp = xps + r * k, *xq = xqs + r * k;
            const float *xd = xds + r * nb;
            const int32_t *init = inits + r * pairs * 16;
            __m512 acc[4];
            for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
            for (long c = 0; c < pairs; c++)
                for (int i = 0; i < g; i++)
                    acc[i] = q4_pair(w + (n + i) * (k / 2) + c * 32, d + (n + i) * nb + 2 * c, xp + c * 64, xd + 2 * c,
                                     init + c * 16, acc[i]);
            float out[4];
            _mm_storeu_ps(out, hsum4x16(acc[0], acc[1], acc[2], acc[3]));
            for (int i = 0; i < g; i++) {
                float tail = 0.0f;
                if (nb % 2) {
                    long b = nb - 1;
                    tail = hsum8(_mm256_mul_ps(q4_block_dot(w + (n + i) * (k / 2) + b * 16, xq + b * QK),
                                               _mm256_set1_ps(_cvtsh_ss(d[(n + i) * nb + b]) * xd[b])));
                }
                ys[r * ldy + n + i] = out[i] + tail;
            }
        }
    }
}

typedef struct {
    const int8_t *w, *xq, *xp;
    const float *d, *xd;
    const int32_t *inits;
    const uint16_t *d4;  /* set for 4-bit weights (w then holds nibbles) */
    long k, n, m, n0, n1;
    float *y;
    int vnni;
} job_t;

static void run(const job_t *j) {
    if (j->d4 && j->vnni)
        q4_rows_vnni((const uint8_t *)j->w, j->d4, j->k, j->n0, j->n1, j->xq, j->xp, j->xd, j->inits, j->m, j->n, j->y);
    else if (j->d4)
        q4_rows_avx2((const uint8_t *)j->w, j->d4, j->k, j->n0, j->n1, j->xq, j->xd, j->inits, j->m, j->n, j->y);
    else
        (j->vnni ? rows_vnni : rows_avx2)(j->w, j->d, j->k, j->n0, j->n1, j->xq, j->xd, j->m, j->n, j->y);
}

/* 1 = the VNNI path is in use; want -1 = the best this CPU has, 0 = force AVX2, 1 = VNNI where supported. */
static int use_vnni = -1;
int q8_isa(int want) {
    int has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    use_vnni = want < 0 ? has : (want && has);
    return use_vnni;
}

static int matmul(const float *x, long m, const void *w, const float *d, const uint16_t *d4, long n, long k,
                  float *y, int threads) {
    if (k % QK || m < 1 || n < 1) return 1;
    if (use_vnni < 0) q8_isa(-1);
    long nb = k / QK, pairs = nb / 2;
    int8_t *xq = malloc((size_t)(m * k)), *xp = d4 && use_vnni ? malloc((size_t)(m * k)) : NULL;
    float *xd = malloc(sizeof(float) * (size_t)(m * nb));
    int32_t *inits = calloc((size_t)(m * pairs * 16 + 1), sizeof(int32_t));
    if (!xq || !xd || !inits || (d4 && use_vnni && !xp)) {
        free(xq);
        free(xp);
        free(xd);
        free(inits);
        return 2;
    }
    q8_quantize(x, m, k, xq, xd);
    /* -8 * each block's x sum, where its path's pair adds it: lanes 0 / 8 (AVX2) or 0 / 4 (VNNI) */
    for (long r = 0; r < m && d4; r++)
        for (long b = 0; b < 2 * pairs; b++) {
            int32_t s = 0;
            for (int j = 0; j < QK; j++) s += xq[r * k + b * QK + j];
            inits[r * pairs * 16 + (b / 2) * 16 + (b % 2) * (use_vnni ? 4 : 8)] = -8 * s;
        }
    for (long r = 0; xp && r < m; r++) /* the VNNI pair's byte order: b0 0-15, b1 0-15, b0 16-31, b1 16-31 */
        for (long c = 0; c < pairs; c++)
            for (int h = 0; h < 4; h++)
                memcpy(xp + r * k + c * 64 + 16 * h, xq + r * k + (2 * c + (h & 1)) * QK + 16 * (h >> 1), 16);
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > n) threads = (int)n;
    job_t jobs[64];
    for (int t = 0; t < threads; t++)
        jobs[t] = (job_t){w, xq, xp, d, xd, inits, d4, k, n, m, n * t / threads, n * (t + 1) / threads, y, use_vnni};
    /* on the process's OpenMP team (torch's threads), as in gguf_blocks.c */
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; t++) run(&jobs[t]);
    free(xq);
    free(xp);
    free(xd);
    free(inits);
    return 0;
}

/* y[M][N] = x[M][K] . w[N][K]^T, x quantised to int8 blocks first; threads split the output columns. */
int q8_matmul(const float *x, long m, const int8_t *w, const float *d, long n, long k, float *y, int threads) {
    return matmul(x, m, w, d, NULL, n, k, y, threads);
}

/* The same for 4-bit weights (q4_quantize's layout). */
int q4_matmul(const float *x, long m, const uint8_t *w, const uint16_t *d, long n, long k, float *y, int threads) {
    if (!d) return 1;
    return matmul(x, m, w, NULL, d, n, k, y, threads);
}
