/* Batch-invariant attention for the q8 numerics: a query row's output is a function of its q vector and the
 * SEQUENCE of (k, v) vectors it sees, in slot order, and of nothing else: not of the slot numbers they sit
 * at, the other rows of the call (batch, chain, tree, prompt), nor the thread count. Speculative decoding
 * then gives the bits plain decoding gives. kernels/reference/attention_ref.py is the same arithmetic in
 * plain PyTorch (the oracle this file must equal bit for bit); its docstring is the definition.
 *
 * Per query row (b, h, t), with g = h / (H / Hkv):
 *   1. idx: the visible slots in slot order (all of 0..S-1 without a mask); n of them. Everything below is
 *      indexed by the compacted i = 0..n-1, never by slot.
 *   2. dot_i = q . k_idx[i]: 16 lanes (lane l holds d = 16c + l), acc = q_0*k_0, then acc = acc + q_c*k_c for
 *      c = 1..D/16-1 (each product and sum rounded: no FMA), then the fixed tree (l + l+8, l + l+4, l + l+2,
 *      l0 + l1).
 *   3. m = max_i dot_i; x_i = (dot_i - m) * cs with cs = f32(scale) * f32(log2 e); p_i = exp2(x_i) (below).
 *   4. l: 16 lane sums of p_i (lane i mod 16, chunks in order from 0), then the same tree.
 *   5. o[d] = (...((0 + p_0*v_0[d]) + p_1*v_1[d]) + ...) + p_{n-1}*v_{n-1}[d]; out[d] = o[d] / l.
 * exp2(x), x <= 0: xc = max(x, -126), n = rint(xc), f = xc - n, Horner of the degree-6 polynomial below
 * (c6*f + c5, * f + c4, ...; every op rounded), times 2^n built from bits; 0 where x < -125.
 *
 * One source, two builds: -mavx512f (a vector is one zmm) and -mavx2 (a vector is two ymm). Both compute the
 * arithmetic above on 16-lane vectors, so the two builds give the same bits. Compiled with -ffp-contract=off:
 * the compiler must not fuse a multiply and an add.
 *
 * Work items are (b, t, kv head, block of that group's heads); OpenMP threads take whole items. D must be a
 * multiple of 16 (the binding zero-pads other head sizes); strides are in floats, the last dim contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* 2^f on [-0.5, 0.5], c0..c6 (kernels/reference/attention_ref.EXP2_COEFFS; <= 1.2 ulp with float32 Horner) */
#define C0 0x1.000000p+0f
#define C1 0x1.62e430p-1f
#define C2 0x1.ebfbdcp-3f
#define C3 0x1.c6aee8p-5f
#define C4 0x1.3b2d4cp-7f
#define C5 0x1.5f3e54p-10f
#define C6 0x1.41fbbep-13f

#define HB_MAX 8 /* heads of one kv group scored per pass over its keys */

#if defined(__AVX512F__)
#define ISA 1
#define NV_MAX 8 /* 16-float vectors of a head's output kept in registers (x 2 heads) */
typedef __m512 vf;
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_rint(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_pow2i(vf n) { /* 2^n for integral n in [-126, 0] */
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
}
static inline vf vf_zero_where_below(vf r, vf x, float lim) {
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, _mm512_set1_ps(lim), _CMP_LT_OQ), _mm512_setzero_ps());
}
static inline __m256 vf_fold(vf a) { /* lane l + lane l+8 */
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
static inline float vf_hmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vf_negabs(vf a) { /* -|a|: the sign bit set */
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u)));
}
static inline vf vf_select_below(vf x, float lim, vf lo, vf hi) { /* x < lim ? lo : hi */
    return _mm512_mask_mov_ps(hi, _mm512_cmp_ps_mask(x, _mm512_set1_ps(lim), _CMP_LT_OQ), lo);
}
#else
#define ISA 0
#define NV_MAX 4
typedef struct { __m256 lo, hi; } vf;
static inline vf vf_load(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline vf vf_set1(float x) { return (vf){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
#define VF_OP(name, op) \
    static inline vf name(vf a, vf b) { return (vf){op(a.lo, b.lo), op(a.hi, b.hi)}; }
VF_OP(vf_add, _mm256_add_ps)
VF_OP(vf_sub, _mm256_sub_ps)
VF_OP(vf_mul, _mm256_mul_ps)
VF_OP(vf_div, _mm256_div_ps)
VF_OP(vf_max, _mm256_max_ps)
static inline vf vf_rint(vf a) {
    return (vf){_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
static inline __m256 pow2i8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vf_pow2i(vf n) { return (vf){pow2i8(n.lo), pow2i8(n.hi)}; }
static inline vf vf_zero_where_below(vf r, vf x, float lim) {
    __m256 l = _mm256_set1_ps(lim);
    return (vf){_mm256_andnot_ps(_mm256_cmp_ps(x.lo, l, _CMP_LT_OQ), r.lo),
                _mm256_andnot_ps(_mm256_cmp_ps(x.hi, l, _CMP_LT_OQ), r.hi)};
}
static inline __m256 vf_fold(vf a) { return _mm256_add_ps(a.lo, a.hi); }
static inline vf vf_negabs(vf a) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    return (vf){_mm256_or_ps(a.lo, sign), _mm256_or_ps(a.hi, sign)};
}
static inline vf vf_select_below(vf x, float lim, vf lo, vf hi) {
    __m256 l = _mm256_set1_ps(lim);
    return (vf){_mm256_blendv_ps(hi.lo, lo.lo, _mm256_cmp_ps(x.lo, l, _CMP_LT_OQ)),
                _mm256_blendv_ps(hi.hi, lo.hi, _mm256_cmp_ps(x.hi, l, _CMP_LT_OQ))};
}
static inline float vf_hmax(vf a) {
    float t[16];
    vf_store(t, a);
    float m = t[0];
    for (int i = 1; i < 16; i++) m = t[i] > m ? t[i] : m;
    return m;
}
#endif

/* the fixed tree over 16 lanes: (l + l+8), (l + l+4), (l + l+2), l0 + l1 */
static inline float vf_hsum(vf a) {
    __m256 s8 = vf_fold(a);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline vf vf_exp2(vf x) {
    vf xc = vf_max(x, vf_set1(-126.0f));
    vf n = vf_rint(xc);
    vf f = vf_sub(xc, n);
    vf p = vf_add(vf_mul(vf_set1(C6), f), vf_set1(C5));
    p = vf_add(vf_mul(p, f), vf_set1(C4));
    p = vf_add(vf_mul(p, f), vf_set1(C3));
    p = vf_add(vf_mul(p, f), vf_set1(C2));
    p = vf_add(vf_mul(p, f), vf_set1(C1));
    p = vf_add(vf_mul(p, f), vf_set1(C0));
    return vf_zero_where_below(vf_mul(p, vf_pow2i(n)), x, -125.0f);
}

int attn_isa(void) { return ISA; }

/* y = exp2(x) elementwise as the kernel computes it (for tests) */
void attn_exp2(const float *x, float *y, long n) {
    long i = 0;
    for (; i + 16 <= n; i += 16) vf_store(y + i, vf_exp2(vf_load(x + i)));
    if (i < n) {
        float buf[16] = {0};
        for (long j = i; j < n; j++) buf[j - i] = x[j];
        vf_store(buf, vf_exp2(vf_load(buf)));
        for (long j = i; j < n; j++) y[j] = buf[j - i];
    }
}

/* scores of nh heads (rows qr[h]) against the n keys idx[] of kb: sc[h * ld + i] */
static inline __attribute__((always_inline)) void scores(const int C, int nh, const float *const *qr, const float *kb,
                                                         long kss, const int32_t *idx, long n, float *sc, long ld) {
    for (long i = 0; i < n; i++) {
        const float *kr = kb + (long)idx[i] * kss;
        for (int h = 0; h < nh; h++) {
            const float *q = qr[h];
            vf acc = vf_mul(vf_load(q), vf_load(kr));
            for (int c = 1; c < C; c++) acc = vf_add(acc, vf_mul(vf_load(q + 16 * c), vf_load(kr + 16 * c)));
            sc[h * ld + i] = vf_hsum(acc);
        }
    }
}

static void scores_any(int C, int nh, const float *const *qr, const float *kb, long kss, const int32_t *idx, long n,
                       float *sc, long ld) {
    switch (C) {
    case 4: scores(4, nh, qr, kb, kss, idx, n, sc, ld); break;
    case 8: scores(8, nh, qr, kb, kss, idx, n, sc, ld); break;
    default: scores(C, nh, qr, kb, kss, idx, n, sc, ld); break;
    }
}

/* NH (1 or 2) heads' outputs over NVC vectors of d from column d0: o = sum_i p[h][i] * v_idx[i] in i order,
 * then divided by l[h] into or[h] */
static inline __attribute__((always_inline)) void weighted(const int NH, const int NVC, const float *vb, long vss,
                                                           const int32_t *idx, long n, const float *const *p,
                                                           const float *l, float *const *orow, long d0) {
    vf a[2][NV_MAX];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NVC; c++) a[h][c] = vf_set1(0.0f);
    for (long i = 0; i < n; i++) {
        const float *vr = vb + (long)idx[i] * vss + d0;
        vf x[NV_MAX];
        for (int c = 0; c < NVC; c++) x[c] = vf_load(vr + 16 * c);
        for (int h = 0; h < NH; h++) {
            vf w = vf_set1(p[h][i]);
            for (int c = 0; c < NVC; c++) a[h][c] = vf_add(a[h][c], vf_mul(w, x[c]));
        }
    }
    for (int h = 0; h < NH; h++) {
        vf d = vf_set1(l[h]);
        for (int c = 0; c < NVC; c++) vf_store(orow[h] + d0 + 16 * c, vf_div(a[h][c], d));
    }
}

static void weighted_heads(int nh, int C, const float *vb, long vss, const int32_t *idx, long n,
                           const float *const *p, const float *l, float *const *orow) {
    for (int h = 0; h < nh; h += 2) {
        int two = h + 1 < nh;
        for (int c = 0; c < C;) {
            int left = C - c;
            long d0 = 16L * c;
            if (left >= NV_MAX) {
                if (two) weighted(2, NV_MAX, vb, vss, idx, n, p + h, l + h, orow + h, d0);
                else weighted(1, NV_MAX, vb, vss, idx, n, p + h, l + h, orow + h, d0);
                c += NV_MAX;
            } else if (left >= 4) {
                if (two) weighted(2, 4, vb, vss, idx, n, p + h, l + h, orow + h, d0);
                else weighted(1, 4, vb, vss, idx, n, p + h, l + h, orow + h, d0);
                c += 4;
            } else {
                if (two) weighted(2, 1, vb, vss, idx, n, p + h, l + h, orow + h, d0);
                else weighted(1, 1, vb, vss, idx, n, p + h, l + h, orow + h, d0);
                c += 1;
            }
        }
    }
}

/* out[b, h, t, :] for every row; see the top of this file. vis: uint8 [.., T, S] (strides visb, vist; the
 * slot stride 1) or NULL (every slot visible). cs = f32(scale) * f32(log2 e). Returns 0, -1 for bad arguments,
 * -2 when scratch memory cannot be had. */
int attn_forward(const float *q, long qsb, long qsh, long qst, const float *k, long ksb, long ksh, long kss,
                 const float *v, long vsb, long vsh, long vss, const uint8_t *vis, long visb, long vist, float *out,
                 long osb, long osh, long ost, long B, long H, long Hkv, long T, long S, long D, float cs,
                 int threads) {
    if (D <= 0 || D % 16 || Hkv <= 0 || H % Hkv || S < 0 || S > INT32_MAX - 16) return -1;
    const long G = H / Hkv, C = D / 16, S16 = (S + 15) / 16 * 16;
    long hb = G < HB_MAX ? G : HB_MAX;
    long groups = B * T * Hkv;
    if (threads < 1) threads = 1;
    /* fewer (b, t, kv head) items than threads (a 1-token step): split the group's heads further */
    while (groups * ((G + hb - 1) / hb) < threads && hb > 1) hb = (hb + 1) / 2;
    const long nblk = (G + hb - 1) / hb, items = groups * nblk;
    if (items < threads) threads = (int)(items ? items : 1);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int32_t *idx = malloc(sizeof(int32_t) * (S16 ? S16 : 1));
        float *sc = malloc(sizeof(float) * hb * (S16 ? S16 : 16));
        if (!idx || !sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            if (!idx || !sc) continue;
            long blk = it % nblk, g = (it / nblk) % Hkv, t = (it / (nblk * Hkv)) % T, b = it / (nblk * Hkv * T);
            long n = 0;
            if (vis) {
                const uint8_t *vr = vis + b * visb + t * vist;
                for (long s = 0; s < S; s++)
                    if (vr[s]) idx[n++] = (int32_t)s;
            } else {
                for (long s = 0; s < S; s++) idx[s] = (int32_t)s;
                n = S;
            }
            long h0 = g * G + blk * hb, nh = G - blk * hb < hb ? G - blk * hb : hb;
            const float *qr[HB_MAX], *pr[HB_MAX];
            float *orow[HB_MAX], l[HB_MAX];
            for (int h = 0; h < nh; h++) {
                qr[h] = q + b * qsb + (h0 + h) * qsh + t * qst;
                orow[h] = out + b * osb + (h0 + h) * osh + t * ost;
                pr[h] = sc + h * S16;
            }
            if (n == 0) { /* no visible slot: NaN, as softmax over nothing */
                for (int h = 0; h < nh; h++)
                    for (long d = 0; d < D; d++) orow[h][d] = NAN;
                continue;
            }
            const float *kb = k + b * ksb + g * ksh, *vb = v + b * vsb + g * vsh;
            scores_any((int)C, (int)nh, qr, kb, kss, idx, n, sc, S16);
            long n16 = (n + 15) / 16 * 16;
            for (int h = 0; h < nh; h++) {
                float *s = sc + h * S16;
                for (long i = n; i < n16; i++) s[i] = -INFINITY;
                vf mv = vf_load(s);
                for (long i = 16; i < n16; i += 16) mv = vf_max(mv, vf_load(s + i));
                vf m = vf_set1(vf_hmax(mv)), c = vf_set1(cs), sum = vf_set1(0.0f);
                for (long i = 0; i < n16; i += 16) {
                    vf p = vf_exp2(vf_mul(vf_sub(vf_load(s + i), m), c));
                    vf_store(s + i, p);
                    sum = vf_add(sum, p);
                }
                l[h] = vf_hsum(sum);
            }
            weighted_heads((int)nh, (int)C, vb, vss, idx, n, pr, l, orow);
        }
        free(idx);
        free(sc);
    }
    return failed ? -2 : 0;
}

/* ---- silu(gate) * up with one fixed arithmetic for every element (kernels/reference/attention_ref.silu_mul).
 * torch's F.silu computes a tensor's vectorised body and its scalar tail differently (about 4% of values differ
 * in the last bit), so a value's bits depend on where it falls in the call; here every value takes the same
 * 16-lane code (a row's last partial vector goes through a zero-padded buffer).
 * expneg(y), y <= 0: n = rint(y * log2 e); r = (y - n * LN2_HI) - n * LN2_LO; Horner of E0..E6; times 2^n;
 * 0 where y < -86.5. silu(x) = (x < 0 ? x * t : x) / (1 + t) with t = expneg(-|x|). */
#define LOG2E_F 0x1.715476p+0f
#define LN2_HI 0x1.62e400p-1f
#define LN2_LO 0x1.7f7d1cp-20f
#define E0 0x1.000000p+0f
#define E1 0x1.000000p+0f
#define E2 0x1.fffffcp-2f
#define E3 0x1.55541ap-3f
#define E4 0x1.555824p-5f
#define E5 0x1.1267b4p-7f
#define E6 0x1.6ae702p-10f

static inline vf vf_expneg(vf y) {
    vf yc = vf_max(y, vf_set1(-87.0f));
    vf n = vf_rint(vf_mul(yc, vf_set1(LOG2E_F)));
    vf r = vf_sub(yc, vf_mul(n, vf_set1(LN2_HI)));
    r = vf_sub(r, vf_mul(n, vf_set1(LN2_LO)));
    vf p = vf_add(vf_mul(vf_set1(E6), r), vf_set1(E5));
    p = vf_add(vf_mul(p, r), vf_set1(E4));
    p = vf_add(vf_mul(p, r), vf_set1(E3));
    p = vf_add(vf_mul(p, r), vf_set1(E2));
    p = vf_add(vf_mul(p, r), vf_set1(E1));
    p = vf_add(vf_mul(p, r), vf_set1(E0));
    return vf_zero_where_below(vf_mul(p, vf_pow2i(n)), y, -86.5f);
}

static inline vf vf_silu_mul(vf x, vf u) {
    vf t = vf_expneg(vf_negabs(x));
    vf d = vf_add(vf_set1(1.0f), t);
    return vf_mul(vf_div(vf_select_below(x, 0.0f, vf_mul(x, t), x), d), u);
}

/* o[m, :n] = silu(g[m, :n]) * u[m, :n] for m < rows (row strides gs, us, os; the last dim contiguous) */
void attn_silu_mul(const float *g, long gs, const float *u, long us, float *o, long os, long rows, long n,
                   int threads) {
    if (threads < 1 || rows * n < 65536) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long m = 0; m < rows; m++) {
        const float *gr = g + m * gs, *ur = u + m * us;
        float *orow = o + m * os;
        long i = 0;
        for (; i + 16 <= n; i += 16) vf_store(orow + i, vf_silu_mul(vf_load(gr + i), vf_load(ur + i)));
        if (i < n) {
            float gb[16] = {0}, ub[16] = {0};
            for (long j = i; j < n; j++) gb[j - i] = gr[j], ub[j - i] = ur[j];
            vf_store(gb, vf_silu_mul(vf_load(gb), vf_load(ub)));
            for (long j = i; j < n; j++) orow[j] = gb[j - i];
        }
    }
}
