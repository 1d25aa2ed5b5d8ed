/* GGUF block-format matmul for CPU verification: y[M, N] = x[M, K] @ W[N, K]^T, W read as stored; an AVX2 + FMA
 * path for every x86-64 CPU with them, and an AVX-512F path chosen at run time where the CPU has it.
 *
 * Why: a decode step reads every weight once per token; reading the 4-6.6-bit GGUF blocks instead of float32
 * copies cuts that traffic 5-7x, and verifying several draft rows per read turns it into compute. The
 * activations stay float32 (no 8-bit quantisation of x as in llama.cpp), so the product is exact up to float32
 * summation and the dequantised weights are bit-identical to gguf-py's (kernels/gguf_ref.py).
 *
 * Layout of the work (AVX2; the AVX-512 path below says how it differs): a thread owns a contiguous range of tiles of 4 output rows. For each chunk of KC = 256
 * values along K, the tile's 4 rows are dequantised into a 4 KB L1 scratch (each stored block is read once
 * per call, whatever M), then every group of up to 3 x rows is multiplied against it with 12 register
 * accumulators (lane-wise over k, kept in a small per-tile buffer between chunks). While a tile decodes a
 * chunk it prefetches the next tile's bytes of the same chunk (four streams in flight; -30% CPU time on a
 * whole-model pass, which is otherwise memory-latency bound).
 *
 * Exactness: this file is compiled with -ffp-contract=off, so a dequantisation's multiply and add/subtract
 * stay two roundings as in gguf-py (d * q - m, d * q + m); only the explicit _mm256_fmadd_ps of the x.w
 * accumulation is fused. (For these five formats a fused d * q - m would in fact give the same bits: the
 * products that precede an add, Q4_K's f16 x 6-bit x 4-bit and Q4_1's f16 x 4-bit, have at most 21
 * significant bits, so they are exact in float32 and only the add rounds. The flag keeps that from being
 * something to re-prove for each new format.)
 * Each output is the 8 lane-wise partial sums over k (k mod 8, in k order), then the fixed horizontal add
 * ((v0+v4)+(v1+v5)) + ((v2+v6)+(v3+v7)): the same bits for any M, group, or thread count.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define KC 256
#define TILE 4
#define MAX_ROWS 64
#define MIN_WORK_PER_THREAD (1L << 20) /* weights (x rows, up to 8) worth waking a thread for */

/* The block formats, written once (as llama.cpp's type_traits_cpu): GGML type id, values and bytes per block,
 * and the stem of their functions (deq_<stem> dequantises one block on the AVX2 path, b5_<stem> runs one block
 * step on the AVX-512 path). F32 and F16 have no blocks; they are read 8 values at a time. Everything else in
 * this file (the traits table, the tile geometry of both paths, gguf_supported, gguf_traits) derives from it. */
#define BLOCK_FORMATS(X)        \
    X(F32, f32, 0, 8, 32)       \
    X(F16, f16, 1, 8, 16)       \
    X(Q4_1, q4_1, 3, 32, 20)    \
    X(Q5_0, q5_0, 6, 32, 22)    \
    X(Q8_0, q8_0, 8, 32, 34)    \
    X(Q4_K, q4_k, 12, 256, 144) \
    X(Q6_K, q6_k, 14, 256, 210)
#define X_ENUM(N, stem, id, block, bytes) T_##N = id, BLOCK_##N = block, BYTES_##N = bytes,
enum { BLOCK_FORMATS(X_ENUM) T_LIMIT = 15 };
#undef X_ENUM

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m256i load8_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

static void deq_f32(const uint8_t *b, float *out) { memcpy(out, b, 32); }

static void deq_f16(const uint8_t *b, float *out) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)));
}

/* Q8_0 (34 bytes): f16 d, int8 q[32]; w = q * d. */
static void deq_q8_0(const uint8_t *b, float *out) {
    __m256 d = _mm256_set1_ps(f16(b));
    for (int g = 0; g < 4; g++) {
        __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * g)));
        _mm256_storeu_ps(out + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
    }
}

/* Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles (low nibbles are values 0-15, high 16-31); w = d*q + m. */
static void deq_q4_1(const uint8_t *b, float *out) {
    __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
    __m256i mask = _mm256_set1_epi32(15);
    for (int g = 0; g < 2; g++) {
        __m256i v = load8_u8(b + 4 + 8 * g);
        __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        _mm256_storeu_ps(out + 8 * g, _mm256_add_ps(_mm256_mul_ps(d, lo), m));
        _mm256_storeu_ps(out + 16 + 8 * g, _mm256_add_ps(_mm256_mul_ps(d, hi), m));
    }
}

/* Q5_0 (22 bytes): f16 d, uint32 qh (bit j is value j's fifth bit), 16 bytes of nibbles; w = d * (q - 16). */
static void deq_q5_0(const uint8_t *b, float *out) {
    __m256 d = _mm256_set1_ps(f16(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    __m256i h = _mm256_set1_epi32((int)qh), mask = _mm256_set1_epi32(15), bit4 = _mm256_set1_epi32(16);
    __m256i shl = _mm256_setr_epi32(4, 3, 2, 1, 0, 0, 0, 0), shr = _mm256_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3);
    __m256 c16 = _mm256_set1_ps(16.0f);
    for (int g = 0; g < 4; g++) {
        __m256i v = load8_u8(b + 6 + 8 * (g & 1));
        __m256i lo = g < 2 ? _mm256_and_si256(v, mask) : _mm256_srli_epi32(v, 4);
        /* bit 8g + i of qh moved to bit 4 of lane i */
        __m256i hb = _mm256_srlv_epi32(_mm256_sllv_epi32(_mm256_srli_epi32(h, 8 * g), shl), shr);
        __m256i q = _mm256_or_si256(lo, _mm256_and_si256(hb, bit4));
        _mm256_storeu_ps(out + 8 * g, _mm256_mul_ps(d, _mm256_sub_ps(_mm256_cvtepi32_ps(q), c16)));
    }
}

/* Q4_K (144 bytes, 256 values): f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins for 8 sub-blocks of
 * 32, 128 bytes of nibbles (bytes 32c..32c+31 hold sub-block 2c in low and 2c+1 in high nibbles);
 * w = (d * sc) * q - (dmin * m). */
static void deq_q4_k(const uint8_t *b, float *out) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    float ds[8], dm[8];
    for (int j = 0; j < 8; j++) {
        int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
        ds[j] = d * (float)sc;
        dm[j] = dmin * (float)mn;
    }
    __m256i mask = _mm256_set1_epi32(15);
    for (int c = 0; c < 4; c++) {
        __m256 d0 = _mm256_set1_ps(ds[2 * c]), m0 = _mm256_set1_ps(dm[2 * c]);
        __m256 d1 = _mm256_set1_ps(ds[2 * c + 1]), m1 = _mm256_set1_ps(dm[2 * c + 1]);
        for (int g = 0; g < 4; g++) {
            __m256i v = load8_u8(qs + 32 * c + 8 * g);
            __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
            _mm256_storeu_ps(out + 64 * c + 8 * g, _mm256_sub_ps(_mm256_mul_ps(d0, lo), m0));
            _mm256_storeu_ps(out + 64 * c + 32 + 8 * g, _mm256_sub_ps(_mm256_mul_ps(d1, hi), m1));
        }
    }
}

/* Q6_K (210 bytes, 256 values): ql[128] low nibbles, qh[64] 2-bit high parts, int8 scales[16] (one per 16
 * values), f16 d. Value h*128 + s*32 + l (h < 2, s < 4, l < 32): ql[h*64 + (s&1)*32 + l] nibble s>>1, high bits
 * (qh[h*32 + l] >> 2s) & 3; w = (d * scale) * (q - 32). */
static void deq_q6_k(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16(b + 208), ds[16];
    for (int i = 0; i < 16; i++) ds[i] = d * (float)sc[i];
    __m256i m15 = _mm256_set1_epi32(15), m30 = _mm256_set1_epi32(0x30);
    __m256 c32 = _mm256_set1_ps(32.0f);
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 4; g++) {
            int l = 8 * g, e = h * 128 + l;
            __m256i a = load8_u8(ql + h * 64 + l), c = load8_u8(ql + h * 64 + 32 + l), x = load8_u8(qh + h * 32 + l);
            __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(a, m15), _mm256_and_si256(_mm256_slli_epi32(x, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(c, m15), _mm256_and_si256(_mm256_slli_epi32(x, 2), m30)),
                _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_and_si256(x, m30)),
                _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_and_si256(_mm256_srli_epi32(x, 2), m30)),
            };
            for (int s = 0; s < 4; s++) {
                __m256 v = _mm256_sub_ps(_mm256_cvtepi32_ps(q[s]), c32);
                _mm256_storeu_ps(out + e + 32 * s, _mm256_mul_ps(_mm256_broadcast_ss(ds + (e + 32 * s) / 16), v));
            }
        }
}

typedef struct {
    const char *name;
    long block, bytes;                          /* values and bytes per block */
    void (*deq)(const uint8_t *b, float *out);  /* one block to float32, gguf-py's values bit for bit */
} traits_t;

#define X_TRAITS(N, stem, id, block, bytes) [id] = {#N, block, bytes, deq_##stem},
static const traits_t TRAITS[T_LIMIT] = {BLOCK_FORMATS(X_TRAITS)};
#undef X_TRAITS

/* Values [k0, k0 + len) of one stored row into out (len a multiple of the block size, and of 8). A case per
 * format, so that each one's block function is a direct call the compiler can inline. */
static void deq_chunk(int qtype, const uint8_t *row, long k0, long len, float *out) {
#define X_DEQ(N, stem, id, block, bytes) \
    case T_##N: for (long i = 0; i < len; i += block) deq_##stem(row + (k0 + i) / block * bytes, out + i); return;
    switch (qtype) { BLOCK_FORMATS(X_DEQ) }
#undef X_DEQ
}

int gguf_supported(int qtype) { return qtype >= 0 && qtype < T_LIMIT && TRAITS[qtype].deq; }

/* The table as the kernel sees it: values and bytes per block of `qtype`, and its name; -1 if unsupported. */
int gguf_traits(int qtype, long *block, long *bytes, const char **name) {
    if (!gguf_supported(qtype)) return -1;
    *block = TRAITS[qtype].block, *bytes = TRAITS[qtype].bytes, *name = TRAITS[qtype].name;
    return 0;
}

/* Dequantise rows ids[0..count) (all K values) into out [count, k], straight into place, rows shared among
 * `threads` of the process's OpenMP team (a prompt's slabs: this runs once per weight per prompt). */
void gguf_dequant_rows(const uint8_t *w, long row_bytes, int qtype, long k, const long *ids, long count, float *out,
                       int threads) {
    if (threads > count) threads = (int)count;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long i = 0; i < count; i++)
        for (long k0 = 0; k0 < k; k0 += KC) deq_chunk(qtype, w + ids[i] * row_bytes, k0, k - k0 < KC ? k - k0 : KC,
                                                      out + i * k + k0);
}

/* G (1-3) x rows against the 4 scratch rows over len values: acc[(g*4 + r)*8 ..] += lane-wise x.w. */
static inline __attribute__((always_inline)) void micro(const float *w, const float *x, long ldx, float *acc, long len,
                                                        const int G) {
    __m256 a[3][TILE];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < TILE; r++) a[g][r] = _mm256_load_ps(acc + (g * TILE + r) * 8);
    for (long j = 0; j < len; j += 8) {
        __m256 xv[3];
        for (int g = 0; g < G; g++) xv[g] = _mm256_loadu_ps(x + g * ldx + j);
        for (int r = 0; r < TILE; r++) {
            __m256 wv = _mm256_load_ps(w + r * KC + j);
            for (int g = 0; g < G; g++) a[g][r] = _mm256_fmadd_ps(wv, xv[g], a[g][r]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < TILE; r++) _mm256_store_ps(acc + (g * TILE + r) * 8, a[g][r]);
}

static inline float hsum(const float *v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

typedef struct {
    const float *x;
    const uint8_t *w;
    float *y;
    long m, ldx, n, k, row_bytes, ldy, tile_lo, tile_hi;
    int qtype, part; /* part: PART_ALL, or one part of the AVX-512 path's work alone (gguf_matmul_part) */
} job_t;

enum { PART_ALL = 0, PART_READ = 1, PART_DEQUANT = 2, PART_FMA = 3 };

static void run_tiles(const job_t *j) {
    long block = TRAITS[j->qtype].block, bsize = TRAITS[j->qtype].bytes;
    float scratch[TILE * KC] __attribute__((aligned(32)));
    float acc[MAX_ROWS * TILE * 8] __attribute__((aligned(32)));
    for (long t = j->tile_lo; t < j->tile_hi; t++) {
        long n0 = t * TILE;
        memset(acc, 0, sizeof(float) * j->m * TILE * 8);
        for (long k0 = 0; k0 < j->k; k0 += KC) {
            long len = j->k - k0 < KC ? j->k - k0 : KC;
            long at = k0 / block * bsize, span = len / block * bsize;
            for (int r = 0; r < TILE; r++) {
                /* the next tile's bytes of this chunk, one tile ahead: four streams in flight, not just one */
                const char *next = (const char *)j->w + (n0 + TILE + r) * j->row_bytes + at;
                if (n0 + TILE + r < j->n)
                    for (long b = 0; b < span; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
                if (n0 + r < j->n)
                    deq_chunk(j->qtype, j->w + (n0 + r) * j->row_bytes, k0, len, scratch + r * KC);
                else
                    memset(scratch + r * KC, 0, sizeof(float) * KC);
            }
            long i = 0;
            for (; i + 3 <= j->m; i += 3) micro(scratch, j->x + i * j->ldx + k0, j->ldx, acc + i * TILE * 8, len, 3);
            if (j->m - i == 2) micro(scratch, j->x + i * j->ldx + k0, j->ldx, acc + i * TILE * 8, len, 2);
            if (j->m - i == 1) micro(scratch, j->x + i * j->ldx + k0, j->ldx, acc + i * TILE * 8, len, 1);
        }
        for (long i = 0; i < j->m; i++)
            for (int r = 0; r < TILE && n0 + r < j->n; r++) j->y[i * j->ldy + n0 + r] = hsum(acc + (i * TILE + r) * 8);
    }
}

/* ---- AVX-512 path: up to 8 x rows, dequantise 16 values in registers straight into the FMAs; from 9, once
 * per chunk into an L1 scratch that every group of 8 x rows reuses. ----
 * A 4-bit (or Q5_0's 5-bit) code indexes a 16-entry table of its sub-block's exact float32 weights
 * (t[q] = d*q - m, computed in gguf-py's order), so one vpermps turns 16 codes into 16 weights; Q8_0 and Q6_K
 * convert and scale directly. Each output's sum is 16 lane-wise partial sums over k (k mod 16, in k order),
 * then a fixed tree: the same bits for any M, group, path or thread count, though not the AVX2 path's bits. */
#define A512 __attribute__((target("avx512f,fma,f16c")))
#define KC5 512
/* the values and bytes of one AVX-512 block step of format N: its block, or 16 values of F32 and F16 */
#define STEP5(N) (BLOCK_##N < 16 ? 16 : BLOCK_##N)
#define BYTES5(N) (BYTES_##N * STEP5(N) / BLOCK_##N)

/* W[r] (r < RB, the same 16 values of RB stored rows): acc[r * G + g] += W[r] * x[g][off .. off + 16) for the G x
 * rows; with RB > 1 each x vector is loaded once for the RB rows (the compiler would otherwise fold a load into
 * every FMA). G = 0 stores W[r] at dst + r * KC5 + off instead: the scratch of the many-row path below. */
#define FMA_RW(W, off)                                                                                        \
    do {                                                                                                      \
        if (G == 0)                                                                                           \
            for (int r_ = 0; r_ < RB; r_++) _mm512_store_ps(dst + r_ * KC5 + (off), (W)[r_]);                \
        for (int g = 0; g < G; g++) {                                                                         \
            __m512 x_ = _mm512_loadu_ps(x + g * ldx + (off));                                                 \
            if (RB > 1) __asm__("" : "+v"(x_));                                                               \
            for (int r_ = 0; r_ < RB; r_++) acc[r_ * G + g] = _mm512_fmadd_ps((W)[r_], x_, acc[r_ * G + g]);  \
        }                                                                                                     \
    } while (0)
#define INL static inline __attribute__((always_inline)) A512
/* the arguments of every block function: RB blocks (b[r], one per stored row), x at the blocks' first value */
#define BLOCK_ARGS const uint8_t *const *b, const float *x, long ldx, __m512 *acc, float *dst, const int RB, const int G

INL __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
/* 16 int8 at p sign-extended, from memory (the compiler would keep a stored scratch in registers and extract
 * each quarter with one more shuffle) */
INL __m512i i8x16(const int8_t *p) {
    __m512i r;
    __asm__("vpmovsxbd %1, %0" : "=v"(r) : "m"(*(const __m128i *)p));
    return r;
}
/* v * *p with *p as an embedded broadcast, not a shuffle of a register */
INL __m512 mul_bcast(__m512 v, const float *p) {
    __asm__("vmulps %1%{1to16%}, %0, %0" : "+v"(v) : "m"(*p));
    return v;
}
INL __m512 iota16(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
/* {q * *a - *b : q < 16}, rounded once like the reference's multiply then subtract (q * *a is exact), with both
 * scalars as embedded broadcasts of the arithmetic's memory operand: a vbroadcastss of its own takes an FP pipe */
INL __m512 table16(const float *a, const float *b) {
    __m512 t;
    __asm__("vmulps %1%{1to16%}, %2, %0" : "=v"(t) : "m"(*a), "v"(iota16()));
    __asm__("vsubps %1%{1to16%}, %0, %0" : "+v"(t) : "m"(*b));
    return t;
}

INL void b5_f32(BLOCK_ARGS) {
    __m512 w[2];
    for (int r = 0; r < RB; r++) w[r] = _mm512_loadu_ps((const float *)b[r]);
    FMA_RW(w, 0);
}

INL void b5_f16(BLOCK_ARGS) {
    __m512 w[2];
    for (int r = 0; r < RB; r++) w[r] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b[r]));
    FMA_RW(w, 0);
}

/* Q4_K's 8 six-bit scales and 8 mins (12 bytes at b + 4) as 16 dword lanes [sc 0-7, m 0-7], unpacked in an
 * xmm: built by scalar stores and reloaded as one vector, they would wait on a failed store forward. */
INL __m512i q4k_scales(const uint8_t *b) {
    __m128i v = _mm_loadu_si128((const __m128i *)(b + 4)); /* u0, u1, u2 (and 4 bytes of codes, unused) */
    __m128i lo6 = _mm_and_si128(v, _mm_set1_epi32(0x3f3f3f3f));                                   /* sm0, sm2 */
    __m128i u2 = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 2, 2)), _mm_setr_epi32(0, 4, 0, 4));
    __m128i top = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(v, 6), _mm_set1_epi32(0x03030303)), 4);
    __m128i hi6 = _mm_or_si128(_mm_and_si128(u2, _mm_set1_epi32(0x0f0f0f0f)), top);              /* sm1, sm3 */
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi32(lo6, hi6));
}

/* d*sc and dmin*m of one Q4_K block, 16 floats at s */
INL void q4k_prep(const uint8_t *b, float *s) {
    __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16(b)), _mm512_set1_ps(f16(b + 2)));
    _mm512_store_ps(s, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(q4k_scales(b))));
}

/* s: the RB blocks' q4k_prep, which EACH_ROW_PREP computes ahead */
INL void b5_q4_k(BLOCK_ARGS, const float (*s)[16]) {
    for (int c = 0; c < 4; c++) {
        __m512 t0[2], t1[2], w[2];
        __m512i v0[2], v1[2];
        for (int r = 0; r < RB; r++) {
            t0[r] = table16(s[r] + 2 * c, s[r] + 8 + 2 * c);
            t1[r] = table16(s[r] + 2 * c + 1, s[r] + 9 + 2 * c);
            v0[r] = u8x16(b[r] + 16 + 32 * c);
            v1[r] = u8x16(b[r] + 16 + 32 * c + 16);
        }
        for (int r = 0; r < RB; r++) w[r] = _mm512_permutexvar_ps(v0[r], t0[r]);
        FMA_RW(w, 64 * c);
        for (int r = 0; r < RB; r++) w[r] = _mm512_permutexvar_ps(v1[r], t0[r]);
        FMA_RW(w, 64 * c + 16);
        for (int r = 0; r < RB; r++) w[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(v0[r], 4), t1[r]);
        FMA_RW(w, 64 * c + 32);
        for (int r = 0; r < RB; r++) w[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(v1[r], 4), t1[r]);
        FMA_RW(w, 64 * c + 48);
    }
}

/* The 6-bit codes are assembled 32 at a time in byte lanes (ymm logic, which does not compete with the
 * 512-bit FMAs for port 0), stored as q - 32 in int8, then sign-extended 16 at a time from that scratch. */
INL void b5_q6_k(BLOCK_ARGS) {
    float ds[2][16] __attribute__((aligned(64)));
    int8_t q[2][128] __attribute__((aligned(64)));
    const __m256i m0f = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
    for (int r = 0; r < RB; r++)
        _mm512_store_ps(ds[r], _mm512_mul_ps(_mm512_set1_ps(f16(b[r] + 208)), _mm512_cvtepi32_ps(
                                   _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b[r] + 192))))));
    for (int h = 0; h < 2; h++) {
        for (int r = 0; r < RB; r++) {
            const uint8_t *ql = b[r] + h * 64, *qh = b[r] + 128 + h * 32;
            __m256i a = _mm256_loadu_si256((const __m256i *)ql), c = _mm256_loadu_si256((const __m256i *)(ql + 32)),
                    xh = _mm256_loadu_si256((const __m256i *)qh);
            __m256i a4 = _mm256_and_si256(_mm256_srli_epi16(a, 4), m0f),
                    c4 = _mm256_and_si256(_mm256_srli_epi16(c, 4), m0f);
            /* value h*128 + 32s + l: low four bits from a (s even) or c (s odd), bits 4-5 from xh bits 2s, 2s+1 */
            _mm256_store_si256((__m256i *)q[r], _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(a, m0f),
                                                _mm256_and_si256(_mm256_slli_epi16(xh, 4), m30)), c32));
            _mm256_store_si256((__m256i *)(q[r] + 32), _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(c, m0f),
                                                       _mm256_and_si256(_mm256_slli_epi16(xh, 2), m30)), c32));
            _mm256_store_si256((__m256i *)(q[r] + 64),
                               _mm256_sub_epi8(_mm256_or_si256(a4, _mm256_and_si256(xh, m30)), c32));
            _mm256_store_si256((__m256i *)(q[r] + 96), _mm256_sub_epi8(_mm256_or_si256(c4,
                                                       _mm256_and_si256(_mm256_srli_epi16(xh, 2), m30)), c32));
        }
        for (int v = 0; v < 8; v++) {
            int e = h * 128 + 16 * v;
            __m512 w[2];
            for (int r = 0; r < RB; r++) w[r] = mul_bcast(_mm512_cvtepi32_ps(i8x16(q[r] + 16 * v)), ds[r] + e / 16);
            FMA_RW(w, e);
        }
    }
}

INL void b5_q8_0(BLOCK_ARGS) {
    for (int h = 0; h < 2; h++) {
        __m512 w[2];
        for (int r = 0; r < RB; r++)
            w[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b[r] + 2 + 16 * h)))),
                                 _mm512_set1_ps(f16(b[r])));
        FMA_RW(w, 16 * h);
    }
}

INL void b5_q5_0(BLOCK_ARGS) {
    __m512 lo[2], hi[2], w[2];
    __m512i v[2];
    uint32_t qh[2];
    for (int r = 0; r < RB; r++) {
        __m512 d = _mm512_set1_ps(f16(b[r]));
        memcpy(&qh[r], b[r] + 2, 4);
        lo[r] = _mm512_mul_ps(d, _mm512_sub_ps(iota16(), _mm512_set1_ps(16.0f))); /* q < 16: d * (q - 16) */
        hi[r] = _mm512_mul_ps(d, iota16());                                       /* q >= 16 */
        v[r] = u8x16(b[r] + 6);
    }
    for (int r = 0; r < RB; r++)
        w[r] = _mm512_mask_blend_ps((__mmask16)qh[r], _mm512_permutexvar_ps(v[r], lo[r]), _mm512_permutexvar_ps(v[r], hi[r]));
    FMA_RW(w, 0);
    for (int r = 0; r < RB; r++) {
        __m512i v4 = _mm512_srli_epi32(v[r], 4);
        w[r] = _mm512_mask_blend_ps((__mmask16)(qh[r] >> 16), _mm512_permutexvar_ps(v4, lo[r]),
                                    _mm512_permutexvar_ps(v4, hi[r]));
    }
    FMA_RW(w, 16);
}

INL void b5_q4_1(BLOCK_ARGS) {
    __m512 t[2], w[2];
    __m512i v[2];
    for (int r = 0; r < RB; r++) {
        t[r] = _mm512_fmadd_ps(_mm512_set1_ps(f16(b[r])), iota16(), _mm512_set1_ps(f16(b[r] + 2)));
        v[r] = u8x16(b[r] + 4);
    }
    for (int r = 0; r < RB; r++) w[r] = _mm512_permutexvar_ps(v[r], t[r]);
    FMA_RW(w, 0);
    for (int r = 0; r < RB; r++) w[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(v[r], 4), t[r]);
    FMA_RW(w, 16);
}

/* Values [k0, k0 + len) of R stored rows against G x rows (x at value k0), accumulating into acc_r[G][16]
 * (acc_r = accp + r * MAX_ROWS * 16), RB (1 or 2) stored rows per block step. R = 4 rows interleaved block by
 * block give a few-row product 4 independent FMA chains instead of one latency-bound chain; for 5-8 x rows
 * 2 rows go through each block step together, sharing every x load (8 rows: 16 FMAs for 10 loads, not 18).
 * Every (row, x row) keeps its own accumulator and takes its FMAs in k order, so R and RB change the speed
 * and never the bits. */
INL void rows5(int qtype, const uint8_t *const *rows, long k0, long len, const float *x0, long ldx, float *accp,
               float *scratch, const int R, const int RB, const int G) {
    __m512 a[16];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) a[r * G + g] = _mm512_load_ps(accp + (r * MAX_ROWS + g) * 16);
/* one block step of every stored row, RB at a time (an optional last argument: the rows' prepared scales) */
#define ROWS_STEP(STEP, BYTES, FN, ...)                                                                       \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r += RB) {                                                 \
        const uint8_t *blk[2];                                                                                \
        for (int r_ = 0; r_ < RB; r_++) blk[r_] = rows[r + r_] + (k0 + i) / STEP * BYTES;                     \
        FN(blk, G ? x0 + i : NULL, ldx, a + r * G, G ? NULL : scratch + r * KC5 + i, RB, G, ##__VA_ARGS__);   \
    }
#define EACH_ROW(STEP, BYTES, FN) for (long i = 0; i < len; i += STEP) ROWS_STEP(STEP, BYTES, FN)
/* the same, with every block's scales in the chunk computed first by PREP (16 floats a block): a block's
 * scales are a long chain of dependent steps, and computed just before its products they hold up the FMAs */
#define EACH_ROW_PREP(STEP, BYTES, PREP, FN)                                                                  \
    {                                                                                                         \
        float sc_[KC5 / STEP][4][16] __attribute__((aligned(64)));                                            \
        for (long i = 0; i < len; i += STEP)                                                                  \
            for (int r = 0; r < R; r++) PREP(rows[r] + (k0 + i) / STEP * BYTES, sc_[i / STEP][r]);            \
        for (long i = 0; i < len; i += STEP) ROWS_STEP(STEP, BYTES, FN, (const float(*)[16])sc_[i / STEP][r]) \
    }
    switch (qtype) {
    case T_F32: EACH_ROW(STEP5(F32), BYTES5(F32), b5_f32) break;
    case T_F16: EACH_ROW(STEP5(F16), BYTES5(F16), b5_f16) break;
    case T_Q4_1: EACH_ROW(STEP5(Q4_1), BYTES5(Q4_1), b5_q4_1) break;
    case T_Q5_0: EACH_ROW(STEP5(Q5_0), BYTES5(Q5_0), b5_q5_0) break;
    case T_Q8_0: EACH_ROW(STEP5(Q8_0), BYTES5(Q8_0), b5_q8_0) break;
    case T_Q4_K: EACH_ROW_PREP(STEP5(Q4_K), BYTES5(Q4_K), q4k_prep, b5_q4_k) break;
    case T_Q6_K: EACH_ROW(STEP5(Q6_K), BYTES5(Q6_K), b5_q6_k) break;
    }
#undef ROWS_STEP
#undef EACH_ROW
#undef EACH_ROW_PREP
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) _mm512_store_ps(accp + (r * MAX_ROWS + g) * 16, a[r * G + g]);
}

typedef void (*rows5_fn)(int, const uint8_t *const *, long, long, const float *, long, float *);
#define ROWS5_FN(R_, RB_, G_)                                                                                 \
    static A512 void rows5_##R_##_##G_(int q, const uint8_t *const *r, long k0, long len, const float *x,      \
                                       long ldx, float *a) {                                                  \
        rows5(q, r, k0, len, x, ldx, a, NULL, R_, RB_, G_);                                                   \
    }
ROWS5_FN(4, 1, 1) ROWS5_FN(4, 1, 2) ROWS5_FN(4, 1, 3) ROWS5_FN(4, 1, 4)
ROWS5_FN(2, 2, 5) ROWS5_FN(2, 2, 6) ROWS5_FN(2, 2, 7) ROWS5_FN(2, 2, 8)
/* by x rows (more take the scratch path): up to 4 take a tile's 4 stored rows at once, 5-8 two at a time */
static const rows5_fn ROWS5[9] = {NULL,      rows5_4_1, rows5_4_2, rows5_4_3, rows5_4_4,
                                  rows5_2_5, rows5_2_6, rows5_2_7, rows5_2_8};

/* The many-row path: a tile's TILE stored rows are dequantised once per chunk into an L1 scratch (the same
 * exact weights, by the same code), then R scratch rows x G x rows run as R * G register accumulators, each
 * x vector loaded once for R rows and each weight vector once for G rows. Every (row, x row) accumulator still
 * takes its FMAs in k order at the same 16-lane offsets, so the bits equal the in-register path's. */
static A512 void deq5_tile(int q, const uint8_t *const *r, long k0, long len, float *scratch) {
    rows5(q, r, k0, len, NULL, 0, NULL, scratch, TILE, 1, 0);
}

INL void micro5(const float *w, const float *x, long ldx, float *accp, long len, const int R, const int G) {
    __m512 a[16];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) a[r * G + g] = _mm512_load_ps(accp + (r * MAX_ROWS + g) * 16);
    for (long j = 0; j < len; j += 16) {
        __m512 wv[4];
        for (int r = 0; r < R; r++) wv[r] = _mm512_load_ps(w + r * KC5 + j);
        for (int g = 0; g < G; g++) {
            __m512 xv = _mm512_loadu_ps(x + g * ldx + j);
            __asm__("" : "+v"(xv)); /* one load for the R rows (the compiler would fold a load into each FMA) */
            for (int r = 0; r < R; r++) a[r * G + g] = _mm512_fmadd_ps(wv[r], xv, a[r * G + g]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) _mm512_store_ps(accp + (r * MAX_ROWS + g) * 16, a[r * G + g]);
}

typedef void (*micro5_fn)(const float *, const float *, long, float *, long);
#define MICRO5_FN(R_, G_)                                                                                     \
    static A512 void micro5_##R_##_##G_(const float *w, const float *x, long ldx, float *a, long len) {      \
        micro5(w, x, ldx, a, len, R_, G_);                                                                    \
    }
MICRO5_FN(4, 1) MICRO5_FN(4, 2) MICRO5_FN(4, 3) MICRO5_FN(4, 4)
MICRO5_FN(2, 5) MICRO5_FN(2, 6) MICRO5_FN(2, 7) MICRO5_FN(2, 8)
/* by group size (at most 8 x rows): 4 scratch rows at once up to 4 x rows, 2 at a time for 5-8 */
static const micro5_fn MICRO5[9] = {NULL,       micro5_4_1, micro5_4_2, micro5_4_3, micro5_4_4,
                                    micro5_2_5, micro5_2_6, micro5_2_7, micro5_2_8};


/* From this many x rows the AVX-512 path dequantises each chunk once into scratch and runs them 8 at a time
 * over it, rather than dequantising in registers for every group of up to 16 (1.5B, 16 rows: 1271 -> 1048
 * ms; at 5-8 rows the in-register path with its shared x loads is as fast or faster). Speed only: same bits. */
#define SCRATCH_FROM 9

/* hsum16 of 16 accumulators at once, each output by the very same additions in the same tree (lanes i and
 * i + 8, then i and i + 4, then (0 + 2) + (1 + 3)), as 15 vector adds over shuffled halves rather than 240
 * scalar ones: at 8 x rows the scalar sums were a sixth of a pass. */
static A512 void hsum16x16(const float *const *v, float *const *out) {
    __m512 t[8], s[4], z[2];
    for (int p = 0; p < 8; p++) {
        __m512 a = _mm512_load_ps(v[2 * p]), b = _mm512_load_ps(v[2 * p + 1]);
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int q = 0; q < 4; q++)
        s[q] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int q = 0; q < 2; q++)
        z[q] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * q], s[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(s[2 * q], s[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane 4L + e now holds output 4e + L */
    r = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
    float res[16] __attribute__((aligned(64)));
    _mm512_store_ps(res, r);
    for (int i = 0; i < 16; i++) *out[i] = res[i];
}

/* Every output of a tile from its accumulators, 16 at a time (a short last group repeats its last one). */
static void sum_tile(const job_t *j, const float *acc, long n0) {
    const float *src[16];
    float *dst[16];
    int c = 0;
    for (long i = 0; i < j->m; i++)
        for (int r = 0; r < TILE && n0 + r < j->n; r++) {
            src[c] = acc + (r * MAX_ROWS + i) * 16;
            dst[c] = j->y + i * j->ldy + n0 + r;
            if (++c == 16) {
                hsum16x16(src, dst);
                c = 0;
            }
        }
    if (c) {
        for (int i = c; i < 16; i++) src[i] = src[c - 1], dst[i] = dst[c - 1];
        hsum16x16(src, dst);
    }
}

/* Every x row against a tile's dequantised chunk in the L1 scratch, 8 x rows at a time. */
static void scratch_fmas(const job_t *j, const float *scratch, long k0, long len, float *acc) {
    for (long g0 = 0; g0 < j->m; g0 += 8) {
        long g = j->m - g0 < 8 ? j->m - g0 : 8;
        const float *x = j->x + g0 * j->ldx + k0;
        if (g <= 4)
            MICRO5[g](scratch, x, j->ldx, acc + g0 * 16, len);
        else
            for (int r = 0; r < TILE; r += 2)
                MICRO5[g](scratch + r * KC5, x, j->ldx, acc + (r * MAX_ROWS + g0) * 16, len);
    }
}

/* One part of a chunk's work alone, for `--parts` of the CPU bench: where the time of a pass goes.
 * PART_READ loads every byte of the tile's blocks (with the same prefetch) and does nothing else; PART_DEQUANT
 * also dequantises them into the L1 scratch (the many-row path's code, whose work the in-register path does
 * once per chunk too); PART_FMA runs only the x rows' FMAs against a scratch already in L1 (no block read).
 * Each folds a value into the accumulators, so the compiler cannot drop the work. */
static A512 void one_part(const job_t *j, const uint8_t *const *rows, long k0, long len, long at, long span,
                          float *scratch, float *acc) {
    if (j->part == PART_READ) {
        __m512i v = _mm512_setzero_si512();
        for (int r = 0; r < TILE; r++)
            for (long b = 0; b + 64 <= span; b += 64) v = _mm512_xor_si512(v, _mm512_loadu_si512(rows[r] + at + b));
        acc[0] += (float)_mm512_reduce_add_epi32(v);
    } else if (j->part == PART_DEQUANT) {
        deq5_tile(j->qtype, rows, k0, len, scratch);
        acc[0] += scratch[len - 1];
    } else {
        scratch_fmas(j, scratch, k0, len, acc);
    }
}

static void run_tiles5(const job_t *j) {
    const traits_t *f = &TRAITS[j->qtype];
    long block = f->block < 16 ? 16 : f->block, bsize = f->bytes * block / f->block; /* STEP5, BYTES5 */
    static __thread float acc[TILE * MAX_ROWS * 16] __attribute__((aligned(64)));
    float scratch[TILE * KC5] __attribute__((aligned(64)));
    if (j->part == PART_FMA) memset(scratch, 0, sizeof scratch);
    for (long t = j->tile_lo; t < j->tile_hi; t++) {
        long n0 = t * TILE;
        for (int r = 0; r < TILE; r++) memset(acc + r * MAX_ROWS * 16, 0, sizeof(float) * j->m * 16);
        for (long k0 = 0; k0 < j->k; k0 += KC5) {
            long len = j->k - k0 < KC5 ? j->k - k0 : KC5;
            long at = k0 / block * bsize, span = len / block * bsize;
            const uint8_t *rows[TILE];
            for (int r = 0; r < TILE; r++) {
                const char *next = (const char *)j->w + (n0 + TILE + r) * j->row_bytes + at;
                if (n0 + TILE + r < j->n)
                    for (long b = 0; b < span; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
                rows[r] = j->w + (n0 + r < j->n ? n0 + r : n0) * j->row_bytes; /* past the end: recomputed, unused */
            }
            if (j->part) {
                one_part(j, rows, k0, len, at, span, scratch, acc);
            } else if (j->m >= SCRATCH_FROM) {
                deq5_tile(j->qtype, rows, k0, len, scratch);
                scratch_fmas(j, scratch, k0, len, acc);
            } else if (j->m <= 4) {
                ROWS5[j->m](j->qtype, rows, k0, len, j->x + k0, j->ldx, acc);
            } else { /* two stored rows at a time: 10-16 independent FMA chains, each x load shared by both */
                for (int r = 0; r < TILE; r += 2)
                    ROWS5[j->m](j->qtype, rows + r, k0, len, j->x + k0, j->ldx, acc + r * MAX_ROWS * 16);
            }
        }
        sum_tile(j, acc, n0);
    }
}


/* -1 undecided, 0 the AVX2 path, 1 the AVX-512 path (where the CPU has it) */
static int isa = -1;

/* Select the path (want 0: AVX2, 1: AVX-512 where supported, -1: only report); returns the one in use. */
int gguf_isa(int want) {
    int has512 = __builtin_cpu_supports("avx512f");
    if (want >= 0) isa = want && has512;
    if (isa < 0) isa = has512;
    return isa;
}

/* gguf_matmul with only one part of the AVX-512 path's work (PART_READ, PART_DEQUANT or PART_FMA; y is then
 * meaningless), or all of it (PART_ALL). Returns -1 for a part without the AVX-512 path. */
int gguf_matmul_part(const float *x, long m, long ldx, const uint8_t *w, long n, long k, long row_bytes, int qtype,
                     float *y, long ldy, int threads, int part) {
    if (m < 1 || m > MAX_ROWS || k % 8 || !gguf_supported(qtype) || part < PART_ALL || part > PART_FMA) return -1;
    if (part && !(gguf_isa(-1) && k % 16 == 0)) return -1;
    long tiles = (n + TILE - 1) / TILE;
    long per_thread = MIN_WORK_PER_THREAD / (m < 8 ? m : 8) + 1; /* weights per thread worth waking it */
    if (threads > n * k / per_thread) threads = (int)(n * k / per_thread);
    if (threads < 1) threads = 1;
    if (threads > tiles) threads = (int)(tiles ? tiles : 1);
    job_t jobs[64];
    if (threads > 64) threads = 64;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){x, w, y, m, ldx, n, k, row_bytes, ldy, tiles * t / threads, tiles * (t + 1) / threads, qtype,
                          part};
    }
    void (*body)(const job_t *) = gguf_isa(-1) && k % 16 == 0 ? run_tiles5 : run_tiles;
    /* on the process's OpenMP team: torch's own threads, already running, rather than a second set that
     * would compete with them for the cores while they spin after torch's last parallel op */
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; t++) body(&jobs[t]);
    return 0;
}

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ W^T, W n stored rows of row_bytes; 1 <= m <= 64,
 * k a multiple of the block size and of 8. Returns 0, or -1 for bad arguments. */
int gguf_matmul(const float *x, long m, long ldx, const uint8_t *w, long n, long k, long row_bytes, int qtype, float *y,
                long ldy, int threads) {
    return gguf_matmul_part(x, m, ldx, w, n, k, row_bytes, qtype, y, ldy, threads, PART_ALL);
}
