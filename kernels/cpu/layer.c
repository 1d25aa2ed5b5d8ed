/* One Llama-family decoder layer per call, float32, AVX2 + FMA, one thread (runtime.linear = "fused").
 *
 * With the skinny kernel a verify forward of the demo target spends about as long outside its weight
 * products as in them: some 25 small torch ops per layer (norms, RoPE, cache scatter, masked attention,
 * SiLU, residual adds), each a few to a hundred microseconds of dispatch and allocation for a few rows.
 * Here the whole layer runs in C on caller-owned buffers, calling skinny_gemm for its four products:
 *
 *   h = rmsnorm(x) * attn_norm; qkv = h Wqkv (+ b); per-head q/k norm (Qwen3); RoPE on q and k;
 *   k, v -> cache slots base + offset + t; attn = softmax(q k^T * scale + tree mask) v (GQA);
 *   x += attn Wo; h = rmsnorm(x) * mlp_norm; [g | u] = h Wgu; x += (silu(g) * u) Wdown
 *
 * Ragged steps: with `sizes`, only each row's real tree tokens are computed (padding of a batch's smaller
 * trees costs nothing), so a step costs its total tokens, not rows x the widest tree.
 *
 * Visibility is the engine's (StepInputs): a query of row b sees every slot below base[b] and the tree
 * slots base[b] + j (j < A) where ancestors[b, t, j]; without ancestors, every slot below `span`.
 * Same operations as the torch path, in float32; only summation order and the exp approximation (Cephes
 * polynomial, within 1 ulp of float32 exp on [-87, 0], measured) differ, so greedy output can differ at
 * floating-point near-ties only.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

void skinny_gemm(const float *x, const void *p, const float *b, float *y, long m_rows, long n_rows, long kp, int bf16);

typedef struct {
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm, *qkv_bias; /* q_norm, k_norm, qkv_bias may be NULL */
    const void *qkv, *o, *gate_up, *down;                           /* skinny panels */
    long qkv_bits, o_bits, gate_up_bits, down_bits;                 /* 16 (bf16 panels) or 32 */
} LayerParams;

typedef struct {
    long B, T, E, H, Hkv, D, I;
    long pitch_e, pitch_a, pitch_i; /* row pitch of the GEMM inputs (E, H*D, I rounded up to 8, zero padded) */
    double eps, scale;
    const float *cos, *sin;         /* [positions, D] */
    const long *positions;          /* [B, T] */
    const long *base;               /* [B] */
    long offset;
    const uint8_t *ancestors;       /* [B, T, A] or NULL */
    long A, span;
    long cache_row_stride, max_len; /* the layer's cache is [rows, Hkv, max_len, D], rows cache_row_stride apart */
    float *h, *qkv, *attn, *gu, *act, *tmp, *scores; /* workspace: [R, pitch_e], [R, (H+2Hkv)D], [R, pitch_a],
                                                        [R, 2I], [R, pitch_i], [R, E], [12 * span] */
    long products;                  /* 0: every weight product outputs zeros (the dispatch measurement) */
    const long *sizes;              /* [B] real tokens per row (a prefix of its T), or NULL: all T. Rows are
                                       packed: x and the workspace hold only the real tokens, row by row */
} StepParams;

static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

static inline float exp1(float x) {
    float in[8] = {x}, out[8];
    _mm256_storeu_ps(out, exp256(_mm256_loadu_ps(in)));
    return out[0];
}

static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_hadd_ps(a, a);
    a = _mm_hadd_ps(a, a);
    return _mm_cvtss_f32(a);
}

static inline float dot(const float *a, const float *b, long n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out = x * rsqrt(mean(x^2) + eps) * w, row by row (the same order as torch's rms_norm). */
static void rmsnorm(const float *x, long x_pitch, const float *w, float *out, long out_pitch, long rows, long n,
                    float eps) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * x_pitch;
        float *o = out + r * out_pitch;
        double ss = 0.0;
        for (long i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        float rstd = 1.0f / sqrtf((float)(ss / n) + eps);
        for (long i = 0; i < n; i++) o[i] = xr[i] * rstd * w[i];
    }
}

static void product(const StepParams *S, const float *x, const void *p, long bits, const float *b, float *y,
                    long rows, long n, long kp) {
    if (S->products)
        skinny_gemm(x, p, b, y, rows, n, kp, bits == 16);
    else
        memset(y, 0, sizeof(float) * rows * n);
}

/* RoPE on one head in place: v * cos + rotate_half(v) * sin, rotate_half(v) = [-v2, v1]. */
static void rope(float *v, const float *c, const float *s, long D) {
    long half = D / 2;
    float tmp[D];
    memcpy(tmp, v, sizeof(float) * D);
    for (long i = 0; i < half; i++) {
        float a = tmp[i] * c[i], b = -tmp[i + half] * s[i];
        v[i] = a + b;
    }
    for (long i = half; i < D; i++) {
        float a = tmp[i] * c[i], b = tmp[i - half] * s[i];
        v[i] = a + b;
    }
}

/* Keys and values are prefetched this many cache rows ahead by the first pass over them: each (row, kv head)
 * block of the cache is a short stream of its own (measured at batch 16: 4-30% less time outside the
 * products). */
#define KV_AHEAD 8
#define QB 12 /* queries per attention block: 4 groups of 3 for the scores and for the values */

/* Four horizontal sums at once: [sum(a0), sum(a1), sum(a2), sum(a3)]. */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* sc[i * n + j] = q[i] . k_j * scale for nq queries and n keys (k_j = kc + j * D); D % 8 == 0 takes blocks
 * of 3 queries x 4 keys (12 accumulators, each key chunk loaded once for 3 queries). */
static void scores(const float *const *q, long nq, const float *kc, long n, long D, float scale, float *sc) {
    long i = 0;
    if (D % 8 == 0) {
        __m128 vs = _mm_set1_ps(scale);
        for (; i + 3 <= nq; i += 3) {
            const float *q0 = q[i], *q1 = q[i + 1], *q2 = q[i + 2];
            long j = 0;
            for (; j + 4 <= n; j += 4) {
                const float *k0 = kc + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
                const char *ahead = (const char *)(k0 + KV_AHEAD * D);
                if (i == 0)
                    for (long l = 0; l < 4 * D * 4; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
                __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
                __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
                for (long d = 0; d < D; d += 8) {
                    __m256 v0 = _mm256_loadu_ps(k0 + d), v1 = _mm256_loadu_ps(k1 + d);
                    __m256 v2 = _mm256_loadu_ps(k2 + d), v3 = _mm256_loadu_ps(k3 + d);
                    __m256 u = _mm256_loadu_ps(q0 + d);
                    a00 = _mm256_fmadd_ps(u, v0, a00); a01 = _mm256_fmadd_ps(u, v1, a01);
                    a02 = _mm256_fmadd_ps(u, v2, a02); a03 = _mm256_fmadd_ps(u, v3, a03);
                    u = _mm256_loadu_ps(q1 + d);
                    a10 = _mm256_fmadd_ps(u, v0, a10); a11 = _mm256_fmadd_ps(u, v1, a11);
                    a12 = _mm256_fmadd_ps(u, v2, a12); a13 = _mm256_fmadd_ps(u, v3, a13);
                    u = _mm256_loadu_ps(q2 + d);
                    a20 = _mm256_fmadd_ps(u, v0, a20); a21 = _mm256_fmadd_ps(u, v1, a21);
                    a22 = _mm256_fmadd_ps(u, v2, a22); a23 = _mm256_fmadd_ps(u, v3, a23);
                }
                _mm_storeu_ps(sc + i * n + j, _mm_mul_ps(hsum4(a00, a01, a02, a03), vs));
                _mm_storeu_ps(sc + (i + 1) * n + j, _mm_mul_ps(hsum4(a10, a11, a12, a13), vs));
                _mm_storeu_ps(sc + (i + 2) * n + j, _mm_mul_ps(hsum4(a20, a21, a22, a23), vs));
            }
            for (; j < n; j++)
                for (long r = 0; r < 3; r++) sc[(i + r) * n + j] = dot(q[i + r], kc + j * D, D) * scale;
        }
    }
    for (; i < nq; i++)
        for (long j = 0; j < n; j++) sc[i * n + j] = dot(q[i], kc + j * D, D) * scale;
}

/* In place: masked scores -> softmax probabilities (masked entries exactly 0). Returns 0 if none visible. */
static int softmax_row(float *sc, long n, long base, const uint8_t *anc) {
    if (anc)
        for (long j = base; j < n; j++)
            if (!anc[j - base]) sc[j] = -INFINITY;
    float m = -INFINITY;
    for (long j = 0; j < n; j++)
        if (sc[j] > m) m = sc[j];
    if (m == -INFINITY) return 0;
    __m256 vm = _mm256_set1_ps(m), vsum = _mm256_setzero_ps(), ninf = _mm256_set1_ps(-INFINITY);
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 s = _mm256_loadu_ps(sc + j);
        __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(s, ninf, _CMP_EQ_OQ), exp256(_mm256_sub_ps(s, vm)));
        _mm256_storeu_ps(sc + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    for (; j < n; j++) {
        sc[j] = sc[j] == -INFINITY ? 0.0f : exp1(sc[j] - m);
        sum += sc[j];
    }
    float inv = 1.0f / sum;
    for (j = 0; j < n; j++) sc[j] *= inv;
    return 1;
}

/* out[i] = sum_j p[i, j] v_j for nq queries. Every output element is one FMA chain over j in key order,
 * whatever the blocking, so a query's result never depends on which others share its block. Blocks of 3
 * queries (a GQA group of 3 reads its values once) x 32 columns: 12 accumulators, 3 broadcast
 * probabilities and one value vector, 16 registers; columns past the last 32 take the scalar chain. */
static inline __attribute__((always_inline)) void values_block(const float *p, long nq, const float *vc, long n,
                                                               long D, long d, float *const *out) {
    __m256 a[3][4];
    for (long i = 0; i < 3; i++)
        for (long c = 0; c < 4; c++) a[i][c] = _mm256_setzero_ps();
    for (long j = 0; j < n; j++) {
        const float *v = vc + j * D + d;
        if (d == 0)
            for (long l = 0; l < D * 4; l += 64) _mm_prefetch((const char *)(v + KV_AHEAD * D) + l, _MM_HINT_T0);
        __m256 w0 = _mm256_broadcast_ss(p + j);
        __m256 w1 = nq > 1 ? _mm256_broadcast_ss(p + n + j) : w0;
        __m256 w2 = nq > 2 ? _mm256_broadcast_ss(p + 2 * n + j) : w0;
        for (long c = 0; c < 4; c++) {
            __m256 x = _mm256_loadu_ps(v + 8 * c);
            a[0][c] = _mm256_fmadd_ps(w0, x, a[0][c]);
            if (nq > 1) a[1][c] = _mm256_fmadd_ps(w1, x, a[1][c]);
            if (nq > 2) a[2][c] = _mm256_fmadd_ps(w2, x, a[2][c]);
        }
    }
    for (long i = 0; i < nq; i++)
        for (long c = 0; c < 4; c++) _mm256_storeu_ps(out[i] + d + 8 * c, a[i][c]);
}

static void weighted_values(const float *p, long nq, const float *vc, long n, long D, float *const *out) {
    for (long i = 0; i < nq; i += 3) {
        long m = nq - i < 3 ? nq - i : 3, d = 0;
        for (; d + 32 <= D; d += 32) {
            if (m == 3) values_block(p + i * n, 3, vc, n, D, d, out + i);
            else if (m == 2) values_block(p + i * n, 2, vc, n, D, d, out + i);
            else values_block(p + i * n, 1, vc, n, D, d, out + i);
        }
        for (long r = i; r < i + m; r++)
            for (long e = d; e < D; e++) {
                float s = 0.0f;
                for (long j = 0; j < n; j++) s = fmaf(p[r * n + j], vc[j * D + e], s);
                out[r][e] = s;
            }
    }
}

/* Attention of every query of row b (its tokens are rows first.. of the step) whose head reads kv head g
 * (GQA), QB queries at a time. A block reads keys only up to the last one any of its queries can see: past
 * it every probability is exactly 0, so a causal prefill does half the work of the full span. */
static void attend(const StepParams *S, long b, long first, long tokens, long g, const float *kc, const float *vc) {
    long T = S->T, D = S->D, group = S->H / S->Hkv, base = S->base[b];
    long nq_cols = (S->H + 2 * S->Hkv) * D, total = tokens * group;
    const float *q[QB];
    float *out[QB];
    for (long q0 = 0; q0 < total; q0 += QB) {
        long nq = total - q0 < QB ? total - q0 : QB, n = S->ancestors ? base : S->span;
        for (long i = 0; i < nq; i++) {
            long t = (q0 + i) / group, head = g * group + (q0 + i) % group, r = first + t;
            q[i] = S->qkv + r * nq_cols + head * D;
            out[i] = S->attn + r * S->pitch_a + head * D;
            if (S->ancestors && (i == 0 || (q0 + i) % group == 0)) {
                const uint8_t *anc = S->ancestors + (b * T + t) * S->A;
                long last = S->A;
                while (last > 0 && !anc[last - 1]) last--;
                if (base + last > n) n = base + last;
            }
        }
        scores(q, nq, kc, n, D, (float)S->scale, S->scores);
        for (long i = 0; i < nq; i++) {
            long t = (q0 + i) / group;
            const uint8_t *anc = S->ancestors ? S->ancestors + (b * T + t) * S->A : NULL;
            if (!softmax_row(S->scores + i * n, n, base, anc)) memset(S->scores + i * n, 0, sizeof(float) * n);
        }
        weighted_values(S->scores, nq, vc, n, D, out);
    }
}

static void silu_mul(const float *gu, float *act, long rows, long I, long pitch) {
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *a = act + r * pitch;
        long i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), x)));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(x, den), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) a[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

static void add_rows(float *x, const float *y, long n) {
    for (long i = 0; i < n; i++) x[i] += y[i];
}

static inline long row_tokens(const StepParams *S, long b) {
    return S->sizes ? S->sizes[b] : S->T;
}

/* x [R, E], R = the step's real tokens (the residual stream, updated in place); kc, vc: this layer's key and
 * value cache. */
void fused_layer(const LayerParams *L, const StepParams *S, float *x, float *kc, float *vc) {
    long B = S->B, T = S->T, R = 0, E = S->E, H = S->H, Hkv = S->Hkv, D = S->D, I = S->I;
    long nq = (H + 2 * Hkv) * D;
    float eps = (float)S->eps;
    for (long b = 0; b < B; b++) R += row_tokens(S, b);

    rmsnorm(x, E, L->attn_norm, S->h, S->pitch_e, R, E, eps);
    product(S, S->h, L->qkv, L->qkv_bits, L->qkv_bias, S->qkv, R, nq, S->pitch_e);
    for (long b = 0, r = 0; b < B; b++)
        for (long t = 0; t < row_tokens(S, b); t++, r++) {
            float *row = S->qkv + r * nq;
            if (L->q_norm) {
                rmsnorm(row, D, L->q_norm, row, D, H, D, eps);
                rmsnorm(row + H * D, D, L->k_norm, row + H * D, D, Hkv, D, eps);
            }
            long pos = S->positions[b * T + t];
            for (long head = 0; head < H + Hkv; head++) rope(row + head * D, S->cos + pos * D, S->sin + pos * D, D);
            long slot = S->base[b] + S->offset + t;
            for (long g = 0; g < Hkv; g++) {
                long at = b * S->cache_row_stride + (g * S->max_len + slot) * D;
                memcpy(kc + at, row + (H + g) * D, sizeof(float) * D);
                memcpy(vc + at, row + (H + Hkv + g) * D, sizeof(float) * D);
            }
        }
    for (long b = 0, first = 0; b < B; first += row_tokens(S, b), b++)
        for (long g = 0; g < Hkv; g++) {
            long at = b * S->cache_row_stride + g * S->max_len * D;
            attend(S, b, first, row_tokens(S, b), g, kc + at, vc + at);
        }
    product(S, S->attn, L->o, L->o_bits, NULL, S->tmp, R, E, S->pitch_a);
    add_rows(x, S->tmp, R * E);
    rmsnorm(x, E, L->mlp_norm, S->h, S->pitch_e, R, E, eps);
    product(S, S->h, L->gate_up, L->gate_up_bits, NULL, S->gu, R, 2 * I, S->pitch_e);
    silu_mul(S->gu, S->act, R, I, S->pitch_i);
    product(S, S->act, L->down, L->down_bits, NULL, S->tmp, R, E, S->pitch_i);
    add_rows(x, S->tmp, R * E);
}
