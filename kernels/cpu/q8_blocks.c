/* The q8 product on GGUF blocks: y[M, N] = x_q[M, K] . W[N, K] in llama.cpp's arithmetic, bit for bit the
 * oracle kernels/reference/q8_ref.py (8-bit activations per 256 values, exact integer sums per weight block,
 * one float combination per block, the blocks of a row summed in order from 0.0).
 *
 * Why: a decode or verify step reads every weight once; multiplying 8-bit activations by the blocks' integer
 * codes makes the arithmetic as cheap as the read, and the integers are exact, so a row's result never depends
 * on how many rows share a call, how they are grouped or how the output rows are split over threads.
 *
 * Layout of the work, as ik_llama.cpp's few-row kernels: a thread owns a range of tiles of 16 weight rows (8 on
 * the AVX2 path). For each chunk of 256 values along K (a Q4_K/Q6_K superblock, or eight 32-blocks) the tile's
 * blocks are unpacked ONCE, transposed so that one vector holds 4 consecutive codes of each row (an int32 lane
 * per weight row): from a repacked copy stored that way where the format has one (q8_repack, below), the others
 * transposed into an L1 scratch. Then every activation row, up to 8 at a time, runs the same sequence: one
 * dpbusd per 4 values takes the row's 4 activations broadcast against the tile's codes, so the integer sum of
 * each weight row's sub-block builds up in its own lane, with no horizontal sums at all; the sub-block scales
 * multiply lane-wise (int32) and the float combination runs on the tile's rows at once, each lane doing exactly
 * the scalar operations of the oracle. Up to 16 activation rows share a pass; more take further passes.
 * Measured on a Zen 5 core: vpdpbusd, vpmulld, vpdpwssd and vmulps share two pipes, so an activation row costs
 * about 40 cycles per 16 x 256 chunk (64 vpdpbusd, 8 vpmulld, ...): a 1-row pass reads at memory speed, and
 * more rows add compute.
 *
 * Three instruction sets give the same bits (the integers are exact and the float steps are the same IEEE
 * operations lane by lane): AVX-512 VNNI (vpdpbusd) where the CPU has it, chosen at run time, and AVX2
 * (vpmaddubsw + vpmaddwd, whose 16-bit pair sums cannot saturate for these codes) everywhere else, both generated
 * from one text (this file includes itself once per instruction set, Q8_ISA); and on a Xeon with AMX, for products
 * of AMX_MIN_ROWS rows or more (a prompt's prefill, a wide verify), int8 tiles (tdpbsud) that multiply 16
 * activation rows by 16 weight rows at once, each tile's chunk decoded once for every row (the AMX path, below).
 * Codes are fed unsigned (vpdpbusd multiplies unsigned by signed bytes) and activations signed: Q8_0's codes
 * are stored + 128 and Q5_0's and Q6_K's as their unsigned fields, the offsets coming back exactly through
 * the activations' block sums (the dot of a sub-block starts from -offset * bsum instead of 0).
 * Compiled with -ffp-contract=off: no multiply and add in the float combination may fuse.
 */
#ifndef Q8_ISA /* ---------------- common part ---------------- */
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The block formats q8 multiplies (GGML type id, values and bytes per block), as gguf_blocks.c's table. */
#define Q8_FORMATS(X)           \
    X(Q4_1, q4_1, 3, 32, 20)    \
    X(Q5_0, q5_0, 6, 32, 22)    \
    X(Q8_0, q8_0, 8, 32, 34)    \
    X(Q4_K, q4_k, 12, 256, 144) \
    X(Q6_K, q6_k, 14, 256, 210)
#define X_ENUM(N, stem, id, block, bytes) T_##N = id, BYTES_##N = bytes,
enum { Q8_FORMATS(X_ENUM) T_LIMIT = 15 };
#undef X_ENUM

#define QA 256           /* activation values per scale; also the K chunk a tile decodes at a time */
#define KG (QA / 4)      /* 4-value groups in a chunk */
#define PASS 16          /* activation rows per pass over the weights */
#define PREFETCH_AHEAD 32 /* chunks ahead of the decoder that are prefetched, into L2: the hardware prefetchers
                           * alone halve a 1-row pass's bandwidth, even on the repacked copy's single stream, and
                           * 8 chunks ahead into L1 (a 32 KiB L1d on Zen 4) evict the activations and scratch and
                           * ran a 1-row pass at a third of the read floor there */
#define MIN_WORK_PER_THREAD (1L << 20) /* weights x rows worth waking a thread for */
#define AMX_MIN_ROWS 16  /* activation rows from which a product takes the AMX tiles where the CPU has them: below, building
                         * the tiles' codes costs more than the VNNI dots (1.5B target, one Xeon core: equal at 16 rows,
                         * 1.3x faster at 32, 1.5x at 128) */
#define TAIL_ROWS 4      /* on the AMX path, rows past a whole group of PASS that take the VNNI dots on the chunk the tiles
                          * decoded rather than start another group, whose tile products cost the same for 1 row as for
                          * 16 (one Xeon core, 1.5B target: 17 rows cost 1.20x 16 on a second group, 1.08x so; break-even
                          * at 5) */
#define STRETCH_ROWS 8   /* on the other paths, rows past a whole pass that stretch it rather than start another pass over
                          * the weights (17 rows were two passes, 1.30x 16, and are one, 1.07x) */

typedef struct {
    const char *name;
    long block, bytes;
} traits_t;
#define X_TRAITS(N, stem, id, block, bytes) [id] = {#N, block, bytes},
static const traits_t TRAITS[T_LIMIT] = {Q8_FORMATS(X_TRAITS)};
#undef X_TRAITS

/* a lane per weight row of a tile: 16 on the AVX-512 path, 8 on the AVX2 path */
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));

/* One activation row as the dot kernels read it: its codes, its 256-block scales, and a per-format table
 * (act_tables) of offset terms built from its block sums. */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *aux;
} xrow_t;

typedef struct {
    const xrow_t *x;
    long m, k, chunks;
    const uint8_t *w;
    long n, row_bytes, chunk_bytes;
    const uint8_t *rp; /* the repacked blocks of the first rp_tiles tiles of 16 rows (q8_repack), or NULL */
    long rp_tiles, rp_chunk;
    int qtype;
    float *y;
    long ldy, tile_lo, tile_hi;
    int amx;          /* the pass runs on AMX tiles (uses_amx) */
    const int8_t *xt; /* AMX: the activations tile by tile (amx_layout) */
    long mt;          /* AMX: the rows on the tiles (the first mt; the rest, TAIL_ROWS at most, take the VNNI dots) */
} job_t;

int q8_supported(int qtype) { return qtype >= 0 && qtype < T_LIMIT && TRAITS[qtype].name; }

/* The table as the kernel sees it: values and bytes per block of `qtype`, and its name; -1 if unsupported. */
int q8_traits(int qtype, long *block, long *bytes, const char **name) {
    if (!q8_supported(qtype)) return -1;
    *block = TRAITS[qtype].block, *bytes = TRAITS[qtype].bytes, *name = TRAITS[qtype].name;
    return 0;
}

/* ---- activation quantisation (AVX2; q8_ref.quantize step by step) ---- */

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* The value of largest magnitude in x[0..len) (len a multiple of 8), the first one if several tie. */
static float signed_max(const float *x, long len) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps();
    for (long i = 0; i < len; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    __m256 amax = _mm256_broadcastss_ps(m);
    for (long i = 0; i < len; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), amax, _CMP_EQ_OQ));
        if (hit) return x[i + __builtin_ctz(hit)];
    }
    return 0.0f;
}

/* min(127, nearest_even(iscale * x)) of 8 values: the product rounded to float first, as q8_ref does */
static inline __m256i quantize8(__m256 iscale, const float *x) {
    __m256 v = _mm256_mul_ps(iscale, _mm256_loadu_ps(x));
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(v, _mm256_set1_ps(127.0f)));
}

/* One activation block of len values (a multiple of 32): q = min(127, nearest_even(iscale * x)) with
 * iscale = -127 / max, d = 1 / iscale; all zero when max is 0. bs gets the sums of each 16 q. */
static void quantize_block(const float *x, long len, int8_t *q, float *d, int32_t *bs) {
    float mx = signed_max(x, len);
    if (mx == 0.0f) {
        memset(q, 0, len);
        memset(bs, 0, sizeof(int32_t) * (len / 16));
        *d = 0.0f;
        return;
    }
    float iscale = -127.0f / mx;
    const __m256 is = _mm256_set1_ps(iscale);
    const __m256i ones = _mm256_set1_epi16(1);
    for (long i = 0; i < len; i += 16) {
        __m256i a = quantize8(is, x + i), b = quantize8(is, x + i + 8);
        __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8); /* 16 int16 in order */
        _mm_storeu_si128((__m128i *)(q + i),
                         _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
        bs[i / 16] = hsum8i(_mm256_madd_epi16(w, ones));
    }
    *d = 1.0f / iscale;
}

/* x [m, k] (row stride ldx, k a multiple of 32) -> q int8 [m, k], d float [m, ceil(k / 256)], bsums int32
 * [m, k / 16]: q8_ref.quantize. */
void q8_quantize(const float *x, long m, long k, long ldx, int8_t *q, float *d, int32_t *bsums) {
    long nblk = (k + QA - 1) / QA;
    for (long i = 0; i < m; i++)
        for (long b = 0; b < nblk; b++) {
            long len = k - b * QA < QA ? k - b * QA : QA;
            quantize_block(x + i * ldx + b * QA, len, q + i * k + b * QA, d + i * nblk + b,
                           bsums + i * (k / 16) + b * (QA / 16));
        }
}

/* The offsets the dot kernels start from, per activation row (k / 16 int32 at most), from its block sums:
 * Q4_K: the pairs (bsum of sub-block 2i, of 2i+1) of 32-value sums as int16 pairs, 4 a superblock, for the
 * mins; Q6_K: -32 * bsum of each 16 (its codes are q + 32); Q5_0: -16 * the 32-sum (codes q + 16); Q8_0:
 * -128 * the 32-sum (codes q + 128); Q4_1: the 32-sums as float, for its m term. */
static void act_table(int qtype, const int32_t *bs, long k, int32_t *aux) {
    for (long i = 0; i < k / 32; i++) {
        int32_t s = bs[2 * i] + bs[2 * i + 1];
        switch (qtype) {
        case T_Q4_K:
            if (i % 2) aux[i / 2] |= (int32_t)((uint32_t)(uint16_t)s << 16);
            else aux[i / 2] = (uint16_t)s;
            break;
        case T_Q6_K: aux[2 * i] = -32 * bs[2 * i], aux[2 * i + 1] = -32 * bs[2 * i + 1]; break;
        case T_Q5_0: aux[i] = -16 * s; break;
        case T_Q8_0: aux[i] = -128 * s; break;
        case T_Q4_1: {
            float f = (float)s;
            memcpy(aux + i, &f, 4);
            break;
        }
        }
    }
}

/* ---- the repacked layout (Q4_K, Q6_K) ----
 * Each chunk of 16 rows (a superblock of each) is stored as its dwords transposed, dword w of the 16 rows in
 * bytes 64w..64w+63 (row r at 4r), a Q6_K chunk's last 2 bytes (d) as 16 float16 after them, padded to whole
 * cache lines; the chunks of a tile follow each other, then the next tile's. The same bytes as the blocks, but
 * a product reads them in one stream as the vectors it multiplies, with no transposing and no 16 row streams
 * to prefetch (a 1-row pass over the 1.5B's linears, one Zen 5 core: 42 -> 30 ms, the read floor 25). Rows past
 * the last whole tile of 16 stay in the blocks as stored. */

/* Bytes of one repacked chunk of `qtype`, 0 if it has no repacked layout. */
static long rp_chunk(int qtype) {
    long b;
    if (qtype == T_Q4_K || qtype == T_Q6_K) b = TRAITS[qtype].bytes;
    else if (qtype == T_Q5_0 || qtype == T_Q8_0) b = TRAITS[qtype].bytes * (QA / 32); /* eight 32-blocks */
    else return 0;
    return (b / 4 * 64 + b % 4 * 16 + 63) / 64 * 64;
}

/* Bytes q8_repack writes for n rows of k values of `qtype`; 0 where there is nothing to repack. The 32-block
 * formats take k a multiple of 32, a last partial chunk padded with zeros to the chunk's size. */
long q8_repack_bytes(int qtype, long n, long k) {
    long c = rp_chunk(qtype);
    if (!c || k <= 0 || n < 16) return 0;
    if (qtype == T_Q5_0 || qtype == T_Q8_0) return k % 32 == 0 ? n / 16 * ((k + QA - 1) / QA) * c : 0;
    return k % QA == 0 ? n / 16 * (k / QA) * c : 0;
}

/* Where a repacked 32-block chunk keeps its 8 blocks' f16 d (16 rows each, 32 bytes a block), in 64-byte
 * vectors: Q5_0 after 32 nibble dwords and 8 high-bit dwords, Q8_0 after 64 code dwords. */
#define RP_D_Q5_0 40
#define RP_D_Q8_0 64

/* One 16-row tile's chunk c of a 32-block format (Q5_0, Q8_0), repacked: vector v lane r = a dword of row r.
 * Q8_0: v = 8b + i the code dword i of block b, stored + 128 (xor 0x80 per byte: the unsigned codes the dots
 * take). Q5_0: v = 4b + i its nibble dword i as stored, v = 32 + b its qh with bit 4G + i moved to bit 8i + G
 * (so that group G's fifth bits land on bit 4 of each byte with one shift and one mask). Then the d. */
static void repack_b32(const uint8_t *w, long k, int qtype, long tc, long chunks, uint8_t *dst) {
    long bsz = TRAITS[qtype].bytes, nblk = k / 32, row_bytes = nblk * bsz, t = tc / chunks, c = tc % chunks;
    long dv = qtype == T_Q5_0 ? RP_D_Q5_0 : RP_D_Q8_0;
    for (int r = 0; r < 16; r++)
        for (long b = 0; b < 8 && 8 * c + b < nblk; b++) {
            const uint8_t *src = w + (t * 16 + r) * row_bytes + (8 * c + b) * bsz;
            memcpy(dst + 64 * dv + 32 * b + 2 * r, src, 2);
            if (qtype == T_Q8_0) {
                for (int i = 0; i < 8; i++) {
                    uint32_t v;
                    memcpy(&v, src + 2 + 4 * i, 4);
                    v ^= 0x80808080u;
                    memcpy(dst + 64 * (8 * b + i) + 4 * r, &v, 4);
                }
            } else {
                uint32_t h, hp = 0;
                memcpy(&h, src + 2, 4);
                for (int g = 0; g < 8; g++)
                    for (int i = 0; i < 4; i++) hp |= ((h >> (4 * g + i)) & 1u) << (8 * i + g);
                memcpy(dst + 64 * (32 + b) + 4 * r, &hp, 4);
                for (int i = 0; i < 4; i++) memcpy(dst + 64 * (4 * b + i) + 4 * r, src + 6 + 4 * i, 4);
            }
        }
}

/* The repacked layout of the first n / 16 * 16 rows of W (n rows of k values of `qtype`) into out
 * (q8_repack_bytes of them). Returns 0, or -1 for a format or shape without one. */
int q8_repack(const uint8_t *w, long n, long k, int qtype, uint8_t *out, int threads) {
    long cb = rp_chunk(qtype), bytes = q8_repack_bytes(qtype, n, k);
    if (!bytes) return -1;
    long size = TRAITS[qtype].bytes, chunks = k / QA, row_bytes = chunks * size, words = size / 4;
    if (threads < 1) threads = 1;
    if (qtype == T_Q5_0 || qtype == T_Q8_0) {
        chunks = (k + QA - 1) / QA;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (long tc = 0; tc < n / 16 * chunks; tc++) {
            memset(out + tc * cb, 0, cb);
            repack_b32(w, k, qtype, tc, chunks, out + tc * cb);
        }
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long tc = 0; tc < n / 16 * chunks; tc++) {
        uint8_t *dst = out + tc * cb;
        memset(dst, 0, cb);
        for (int r = 0; r < 16; r++) {
            const uint8_t *src = w + (tc / chunks * 16 + r) * row_bytes + tc % chunks * size;
            for (long i = 0; i < words; i++) memcpy(dst + 64 * i + 4 * r, src + 4 * i, 4);
            memcpy(dst + 64 * words + size % 4 * r, src + 4 * words, size % 4);
        }
    }
    return 0;
}

/* The prefetch stream of a job, PREFETCH_AHEAD chunks ahead of the decoder along the job's order (a tile's
 * chunks, then the next tile's): the lines at 0, 64, .. of each row-chunk (a chunk's last line is mostly the
 * next one's first). Prefetching never faults, so a short last chunk may ask past its row. */
typedef struct {
    long t, c;              /* the tile and chunk it asks for next */
    const char *base[16];   /* that tile's rows */
} pf_t;

/* Always inlined, like pf_step: out of line GCC finds a function that only prefetches free of side effects and
 * deletes its calls. */
static inline __attribute__((always_inline)) void pf_tile(pf_t *p, const job_t *j, long t, int lanes) {
    p->t = t, p->c = 0;
    for (int r = 0; r < lanes; r++)
        p->base[r] = (const char *)j->w + (t * lanes + r < j->n ? t * lanes + r : j->n - 1) * j->row_bytes;
}

/* cb: the format's chunk bytes, a constant where each format's chunk function calls it (unrolled lines) */
static inline __attribute__((always_inline)) void pf_step(pf_t *p, const job_t *j, int lanes, const long cb) {
    if (p->t >= j->tile_hi) return;
    long at = p->c * cb;
    for (int r = 0; r < lanes; r++)
        _Pragma("GCC unroll 8") for (long b = 0; b < cb; b += 64) _mm_prefetch(p->base[r] + at + b, _MM_HINT_T1);
    if (++p->c == j->chunks) pf_tile(p, j, p->t + 1, lanes);
}

/* ---- the product, once per instruction set ---- */
#define Q8_ISA 512
#include __FILE__
#undef Q8_ISA
#define Q8_ISA 256
#include __FILE__
#undef Q8_ISA

/* -1 undecided, 0 the AVX2 path, 1 the AVX-512 VNNI path, 2 AMX tiles for passes of AMX_MIN_ROWS rows or more
 * and VNNI below (each where the CPU has it) */
static int isa = -1;

static int has_vnni512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* AMX-TILE and AMX-INT8 (CPUID.7.0:EDX bits 24, 25), and Linux's leave to use the tile data (granted per
 * process, once; a kernel without AMX support refuses it) */
static int has_amx(void) {
    static int known = -1;
    unsigned a, b, c, d;
    if (known < 0)
        known = has_vnni512() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 3) == 3 &&
                syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return known;
}

/* Select the path (want 0: AVX2, 1: AVX-512 VNNI, 2: AMX, each where supported, else the best below it; -1:
 * only report); returns the one in use. */
int q8_isa(int want) {
    int best = has_amx() ? 2 : has_vnni512() ? 1 : 0;
    if (want >= 0) isa = want < best ? want : best;
    if (isa < 0) isa = best;
    return isa;
}

/* Whether a product of m activation rows runs on AMX tiles: on the AMX path, from AMX_MIN_ROWS rows, for every
 * format but Q4_1. Such a product is one pass over the weights, whatever m: each tile's chunk is decoded once and
 * dotted with every activation row, 16 at a time (a prompt's prefill reads the weights once, not m / 16 times). */
static int uses_amx(long m, int qtype) { return q8_isa(-1) == 2 && m >= AMX_MIN_ROWS && qtype != T_Q4_1; }

/* The activations q [m, k] as the AMX path's tiles take them: per chunk of QA values, per group of PASS rows, a
 * PASS x QA block, rows QA bytes apart (rows past m and values past k zero). A tile then reads 1 KiB in one run,
 * not 16 rows k bytes apart (a stride that ran the tile loads from L2 at half the speed of the products). */
static int8_t *amx_layout(const int8_t *q, long m, long k) {
    long groups = (m + PASS - 1) / PASS, chunks = (k + QA - 1) / QA;
    int8_t *xt = calloc(chunks * groups * PASS, QA);
    if (!xt) return NULL;
    for (long i = 0; i < m; i++)
        for (long c = 0; c < chunks; c++)
            memcpy(xt + ((c * groups + i / PASS) * PASS + i % PASS) * QA, q + i * k + c * QA,
                   k - c * QA < QA ? k - c * QA : QA);
    return xt;
}

/* One pass: m activation rows (PASS + STRETCH_ROWS at most, any number on AMX: xt the amx_layout of the first mt,
 * else NULL) against every weight row, the tiles shared among `threads`. Returns 0, or -1 out of memory. */
static int run_pass(const xrow_t *x, const int8_t *xt, long m, long mt, long k, const uint8_t *w, const uint8_t *rp,
                    long n, long row_bytes, int qtype, float *y, long ldy, int threads) {
    int wide = xt || q8_isa(-1) >= 1;
    long lanes = wide ? 16 : 8, tiles = (n + lanes - 1) / lanes, block = TRAITS[qtype].block;
    long chunk_bytes = TRAITS[qtype].bytes * (QA / block);
    long per_thread = MIN_WORK_PER_THREAD / m + 1;
    if (threads > n * k / per_thread) threads = (int)(n * k / per_thread);
    if (threads > tiles) threads = (int)tiles;
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    job_t jobs[64];
    int rc[64];
    for (int t = 0; t < threads; t++)
        jobs[t] = (job_t){x, m, k, (k + QA - 1) / QA, w, n, row_bytes, chunk_bytes, rp, rp ? n / 16 : 0,
                          rp_chunk(qtype), qtype, y, ldy, tiles * t / threads, tiles * (t + 1) / threads,
                          xt != NULL, xt, mt};
    int (*body)(const job_t *) = wide ? run_tiles_512 : run_tiles_256;
    /* on the process's OpenMP team: torch's own threads, as gguf_blocks.c does */
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; t++) rc[t] = body(&jobs[t]);
    for (int t = 0; t < threads; t++)
        if (rc[t]) return -1;
    return 0;
}

/* y[m, n] (row stride ldy) = the q8 product of quantised activations (q [m, k], d [m, ceil(k / 256)], bsums
 * [m, k / 16], as q8_quantize writes them) and W, n stored rows of row_bytes in format qtype; rp: W's
 * repacked layout (q8_repack) or NULL. Neither is written. Rows past PASS take further passes, but for a last
 * STRETCH_ROWS or fewer, which join the pass before them (on AMX, every row is one pass: whole groups of PASS rows on
 * the tiles, and a last TAIL_ROWS or fewer on the VNNI dots).
 * Returns 0, or -1 for bad arguments or no memory. */
int q8_matmul(const int8_t *q, const float *d, const int32_t *bsums, long m, long k, const uint8_t *w,
              const uint8_t *rp, long n, long row_bytes, int qtype, float *y, long ldy, int threads) {
    if (!q8_supported(qtype) || m < 0 || n < 0 || k <= 0 || k % 32 || k % TRAITS[qtype].block ||
        row_bytes != k / TRAITS[qtype].block * TRAITS[qtype].bytes || (rp && !q8_repack_bytes(qtype, n, k)))
        return -1;
    if (m == 0 || n == 0) return 0;
    int amx = uses_amx(m, qtype); /* decided once: another thread may change the path meanwhile */
    long nblk = (k + QA - 1) / QA, pass = amx ? m : PASS + STRETCH_ROWS; /* AMX: every row in one pass */
    long tail = m % PASS, mt = amx && m > PASS && tail <= TAIL_ROWS ? m - tail : m;
    int32_t *aux = malloc(sizeof(int32_t) * m * (k / 16));
    xrow_t *x = malloc(sizeof(xrow_t) * pass);
    int8_t *xt = amx ? amx_layout(q, mt, k) : NULL;
    int rc = aux && x && (xt || !amx) ? 0 : -1;
    for (long m0 = 0, rows; m0 < m && !rc; m0 += rows) {
        rows = amx || m - m0 <= PASS + STRETCH_ROWS ? m - m0 : PASS;
        for (long i = 0; i < rows; i++) {
            act_table(qtype, bsums + (m0 + i) * (k / 16), k, aux + (m0 + i) * (k / 16));
            x[i] = (xrow_t){q + (m0 + i) * k, d + (m0 + i) * nblk, aux + (m0 + i) * (k / 16)};
        }
        rc = run_pass(x, xt, rows, amx ? mt : rows, k, w, rp, n, row_bytes, qtype, y + m0 * ldy, ldy, threads);
    }
    free(aux);
    free(x);
    free(xt);
    return rc;
}

/* q8_quantize then q8_matmul in one call (one foreign call per product for a caller with float rows). */
int q8_linear(const float *x, long m, long k, long ldx, const uint8_t *w, const uint8_t *rp, long n, long row_bytes,
              int qtype, float *y, long ldy, int threads) {
    if (k <= 0 || k % 32 || m < 0) return -1;
    long nblk = (k + QA - 1) / QA;
    int8_t *q = malloc(m * k + sizeof(float) * m * nblk + sizeof(int32_t) * m * (k / 16) + 64);
    if (!q) return -1;
    float *d = (float *)(((uintptr_t)(q + m * k) + 63) & ~(uintptr_t)63);
    int32_t *bs = (int32_t *)(d + m * nblk);
    q8_quantize(x, m, k, ldx, q, d, bs);
    int rc = q8_matmul(q, d, bs, m, k, w, rp, n, row_bytes, qtype, y, ldy, threads);
    free(q);
    return rc;
}

/* A read of `bytes` bytes at p, 64-byte line by line, nothing else (the floor a product's pass over its blocks
 * cannot beat): returns a value folded from every byte so that the loads cannot be dropped. */
long q8_read(const uint8_t *p, long bytes) {
    __m256i acc = _mm256_setzero_si256();
    long i = 0;
    for (; i + 64 <= bytes; i += 64)
        acc = _mm256_add_epi64(acc, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + i)),
                                                     _mm256_loadu_si256((const __m256i *)(p + i + 32))));
    long s = _mm256_extract_epi64(acc, 0) + _mm256_extract_epi64(acc, 1) + _mm256_extract_epi64(acc, 2) +
             _mm256_extract_epi64(acc, 3);
    for (; i < bytes; i++) s += p[i];
    return s;
}

#else /* ---------------- per-instruction-set part: Q8_ISA 512 or 256 ---------------- */
#pragma GCC push_options
#if Q8_ISA == 512
#pragma GCC target("avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")
#define SFX(f) f##_512
#define LANES 16 /* weight rows per tile */
#define GROUP 8  /* activation rows that go through a decoded chunk together (registers: 8 sums + 8 chains) */
#define vi v16i
#define vu v16u
#define vf v16f
#else
#pragma GCC target("avx2,f16c")
#define SFX(f) f##_256
#define LANES 8
#define GROUP 4 /* 16 ymm registers */
#define vi v8i
#define vu v8u
#define vf v8f
#endif
#define INL static inline __attribute__((always_inline))
/* every name below exists once per instruction set */
#define scratch_t SFX(scratch_t)
#define dot4 SFX(dot4)
#define dot4w SFX(dot4w)
#define dot2 SFX(dot2)
#define f16lo SFX(f16lo)
#define f16hi SFX(f16hi)
#define tr16 SFX(tr16)
#define tr4 SFX(tr4)
#define gather SFX(gather)
#define spread4 SFX(spread4)
#define to_f SFX(to_f)
#define dec_q4_k SFX(dec_q4_k)
#define dec_q6_k SFX(dec_q6_k)
#define q6_code SFX(q6_code)
#define dec_q8_0 SFX(dec_q8_0)
#define dec_q4_1 SFX(dec_q4_1)
#define dec_q5_0 SFX(dec_q5_0)
#define rp_q8_0 SFX(rp_q8_0)
#define rp_q5_0 SFX(rp_q5_0)
#define rp_q4_1 SFX(rp_q4_1)
#define put SFX(put)
#define q5_code SFX(q5_code)
#define dot_q4_k SFX(dot_q4_k)
#define dot_q6_k SFX(dot_q6_k)
#define dot_b32 SFX(dot_b32)
#define vload SFX(vload)
#define vreg SFX(vreg)
#define hdr_q4_k SFX(hdr_q4_k)
#define rp_q4_k SFX(rp_q4_k)
#define rp_q6_k SFX(rp_q6_k)
#define q6_scales SFX(q6_scales)
#define f16v SFX(f16v)

/* One tile's chunk, decoded: everything an activation row needs, one int32 or float lane per weight row.
 * Transposed dwords are vectors 64 bytes apart, as in the repacked layout (the AVX2 path reads half of each). */
typedef struct {
    const char *nib; /* Q4_K, Q4_1, Q6_K: the packed nibble dwords, transposed (each dot unpacks them: stores are
                      * dear), in nibbuf or the repacked chunk */
    const char *qh;  /* Q6_K: the dwords of high bits, likewise */
    char nibbuf[32 * 64] __attribute__((aligned(64))), qhbuf[16 * 64] __attribute__((aligned(64)));
    const char *cp; /* Q8_0, Q5_0: vector g (VEC) lane r = the 4 unsigned codes of values 4g..4g+3 of row r, in
                     * codes or a repacked Q8_0 chunk */
    char codes[KG * 64] __attribute__((aligned(64)));
    const char *q5; /* a repacked Q5_0 chunk's vectors (this path's half), whose codes the dots build in registers;
                     * NULL elsewhere */
    vi sc[16];    /* sub-block scales (Q4_K: 8 of 32 values, Q6_K: 16 of 16) */
    vi mn[4];     /* Q4_K: the mins of sub-blocks 2i and 2i+1 as two int16 */
    vf d[8], m[8]; /* per 32-block d and Q4_1's m; a superblock's d and (Q4_K) dmin in d[0], m[0] */
#if Q8_ISA == 512
    char bt[12288] __attribute__((aligned(64))); /* AMX: codes built for the tiles (amx_q4_k's B_lo and B_hi,
                                                  * amx_q6_k's three parts) */
    int32_t cbuf[2 * 4 * 256] __attribute__((aligned(64))); /* AMX: two units' sums, C[m][r] (amx4) */
#endif
} scratch_t;

/* ---- the primitives that differ by instruction set ---- */
#if Q8_ISA == 512
/* acc += per lane the 4 unsigned code bytes times the 4 signed activation bytes at x (broadcast) */
INL vi dot4(vi acc, vi codes, const int8_t *x) {
    int32_t xw;
    memcpy(&xw, x, 4);
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)codes, _mm512_set1_epi32(xw));
}
/* the same for codes up to 255 (Q8_0's q + 128): vpdpbusd has no 16-bit step to saturate */
INL vi dot4w(vi acc, vi codes, const int8_t *x) { return dot4(acc, codes, x); }
/* acc += per lane the two int16 products of a's pair and the int16 pair at p (broadcast) */
INL vi dot2(vi acc, vi a, const int32_t *p) {
    return (vi)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, _mm512_set1_epi32(*p));
}

/* the float16 in the low half of each lane, widened */
INL vf f16lo(vi v) { return (vf)_mm512_cvtph_ps(_mm512_cvtepi32_epi16((__m512i)v)); }

/* vector w at out + 64w (64-byte aligned), lane r = dword w of the 32 bytes at rows[r] + a (w < 8) and at
 * rows[r] + b (w >= 8): a 16 x 16 transpose, two 4 x 4 stages within 128-bit lanes and two across them */
INL void tr16(const uint8_t *const *rows, long a, long b, char *out) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = b == a + 32 ? _mm512_loadu_si512(rows[i] + a)
                           : _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const void *)(rows[i] + a))),
                                                _mm256_loadu_si256((const void *)(rows[i] + b)), 1);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + e] lane L: rows 4i..4i+3 of dword 4L + e */
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        __m512i c0 = _mm512_shuffle_i32x4(r[e], r[4 + e], _MM_SHUFFLE(1, 0, 1, 0));
        __m512i c1 = _mm512_shuffle_i32x4(r[e], r[4 + e], _MM_SHUFFLE(3, 2, 3, 2));
        __m512i c2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], _MM_SHUFFLE(1, 0, 1, 0));
        __m512i c3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], _MM_SHUFFLE(3, 2, 3, 2));
        _mm512_store_si512(out + 64 * e, _mm512_shuffle_i32x4(c0, c2, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_store_si512(out + 64 * (4 + e), _mm512_shuffle_i32x4(c0, c2, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm512_store_si512(out + 64 * (8 + e), _mm512_shuffle_i32x4(c1, c3, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_store_si512(out + 64 * (12 + e), _mm512_shuffle_i32x4(c1, c3, _MM_SHUFFLE(3, 1, 3, 1)));
    }
}

/* out[w] lane r = dword w of the 16 bytes at rows[r] + a: row 4L + i into 128-bit lane L of input i, then a
 * 4 x 4 transpose within the lanes */
INL void tr4(const uint8_t *const *rows, long a, vi *out) {
    __m512i z[4];
    for (int i = 0; i < 4; i++) {
        z[i] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[i] + a)));
        for (int l = 1; l < 4; l++)
            z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128((const __m128i *)(rows[4 * l + i] + a)), l);
    }
    __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = (vi)_mm512_unpacklo_epi64(t0, t2), out[1] = (vi)_mm512_unpackhi_epi64(t0, t2);
    out[2] = (vi)_mm512_unpacklo_epi64(t1, t3), out[3] = (vi)_mm512_unpackhi_epi64(t1, t3);
}

/* lane r = the dword at rows[r] + a (offs[r] = rows[r] - rows[0]) */
INL vi gather(const uint8_t *const *rows, vi offs, long a) {
    return (vi)_mm512_i32gather_epi32((__m512i)offs, rows[0] + a, 1);
}

/* 16 float16 at p, widened */
INL vf f16v(const char *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

#else /* AVX2 */
/* maddubs' 16-bit pair sums stay within 2 * 63 * 127 for codes below 64 */
INL vi dot4(vi acc, vi codes, const int8_t *x) {
    int32_t xw;
    memcpy(&xw, x, 4);
    __m256i p = _mm256_maddubs_epi16((__m256i)codes, _mm256_set1_epi32(xw));
    return acc + (vi)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
/* codes up to 255 would saturate a pair sum: bits 0-6 and bit 7 go through maddubs separately */
INL vi dot4w(vi acc, vi codes, const int8_t *x) {
    int32_t xw;
    memcpy(&xw, x, 4);
    __m256i xb = _mm256_set1_epi32(xw), b7 = _mm256_set1_epi8((char)0x80), one = _mm256_set1_epi16(1);
    __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_andnot_si256(b7, (__m256i)codes), xb), one);
    __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(b7, (__m256i)codes), xb), one);
    return acc + (vi)lo + (vi)hi;
}
INL vi dot2(vi acc, vi a, const int32_t *p) { return acc + (vi)_mm256_madd_epi16((__m256i)a, _mm256_set1_epi32(*p)); }

INL vf f16lo(vi v) {
    __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32((__m256i)(v & 0xffff), _mm256_setzero_si256()), 0x08);
    return (vf)_mm256_cvtph_ps(_mm256_castsi256_si128(w));
}

/* 8 x 8 dword transpose: vector w at out + 64w, lane i = dword w of r[i] */
INL void tr8x8(const __m256i *r, char *out) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        _mm256_store_si256((__m256i *)(out + 64 * e), _mm256_permute2x128_si256(u[e], u[4 + e], 0x20));
        _mm256_store_si256((__m256i *)(out + 64 * (4 + e)), _mm256_permute2x128_si256(u[e], u[4 + e], 0x31));
    }
}

INL void tr16(const uint8_t *const *rows, long a, long b, char *out) {
    __m256i r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(rows[i] + a));
    tr8x8(r, out);
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(rows[i] + b));
    tr8x8(r, out + 64 * 8);
}

INL void tr4(const uint8_t *const *rows, long a, vi *out) {
    __m256i z[4];
    for (int i = 0; i < 4; i++)
        z[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rows[i] + a))),
                                       _mm_loadu_si128((const __m128i *)(rows[4 + i] + a)), 1);
    __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    out[0] = (vi)_mm256_unpacklo_epi64(t0, t2), out[1] = (vi)_mm256_unpackhi_epi64(t0, t2);
    out[2] = (vi)_mm256_unpacklo_epi64(t1, t3), out[3] = (vi)_mm256_unpackhi_epi64(t1, t3);
}

INL vi gather(const uint8_t *const *rows, vi offs, long a) {
    return (vi)_mm256_i32gather_epi32((const int *)(rows[0] + a), (__m256i)offs, 1);
}

INL vf f16v(const char *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* ---- decoding a tile's chunk into the scratch (the same text for both sets) ---- */

#define NIB 0x0f0f0f0fu
INL vf f16hi(vi v) { return f16lo((vi)((vu)v >> 16)); }
INL vi vload(const char *p) {
    vi v;
    memcpy(&v, p, sizeof v);
    return v;
}
/* transposed vector i of a buffer or repacked chunk (vectors 64 bytes apart) */
#define VEC(p, i) vload((p) + 64 * (i))
/* the same, loaded once into a register: GCC would otherwise fold the load into each of its uses, and the dots
 * are bound by loads as much as by multiply-adds */
INL vu vreg(const char *p, int i) {
    vu v = (vu)VEC(p, i);
    __asm__("" : "+v"(v));
    return v;
}

/* Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, then 128 bytes
 * of nibbles (bytes 32c..32c+31: values 64c.. in the low nibbles, 64c+32.. in the high), so nibble vector 8c + g
 * holds value group g of sub-block 2c in its low nibbles and of 2c + 1 in its high ones. h: the header's 4
 * dwords, transposed. */
INL void hdr_q4_k(const vi *h, scratch_t *s) {
    s->d[0] = f16lo(h[0]), s->m[0] = f16hi(h[0]);
    vu h1 = (vu)h[1], h2 = (vu)h[2], h3 = (vu)h[3];
    vi mn[8];
    for (int j = 0; j < 4; j++) {
        s->sc[j] = (vi)((h1 >> (8 * j)) & 63);
        mn[j] = (vi)((h2 >> (8 * j)) & 63);
        s->sc[4 + j] = (vi)(((h3 >> (8 * j)) & 15) | ((h1 >> (8 * j + 2)) & 0x30));
        mn[4 + j] = (vi)(((h3 >> (8 * j + 4)) & 15) | ((h2 >> (8 * j + 2)) & 0x30));
    }
    for (int i = 0; i < 4; i++) s->mn[i] = mn[2 * i] | (mn[2 * i + 1] << 16);
}

INL void dec_q4_k(const uint8_t *const *rows, long at, scratch_t *s) {
    vi h[4];
    tr4(rows, at, h);
    hdr_q4_k(h, s);
    tr16(rows, at + 16, at + 48, s->nibbuf);
    tr16(rows, at + 80, at + 112, s->nibbuf + 64 * 16);
    s->nib = s->nibbuf;
}

/* a repacked Q4_K chunk: the header's 4 dwords, then the 32 nibble dwords */
INL void rp_q4_k(const char *p, scratch_t *s) {
    vi h[4];
    for (int w = 0; w < 4; w++) h[w] = VEC(p, w);
    hdr_q4_k(h, s);
    s->nib = p + 64 * 4;
}

/* Q6_K (210 bytes): ql[128], qh[64], int8 scales[16], f16 d. Value 128h + 32s + l (h < 2, s < 4, l < 32):
 * nibble s >> 1 of ql[64h + 32(s & 1) + l], high bits (qh[32h + l] >> 2s) & 3. Kept transposed as stored. */
INL void q6_scales(const vi *h, scratch_t *s) {
    for (int j = 0; j < 16; j++) s->sc[j] = (vi)((vu)h[j / 4] << (24 - 8 * (j % 4))) >> 24; /* int8 -> int32 */
}

INL void dec_q6_k(const uint8_t *const *rows, vi offs, long at, scratch_t *s) {
    vi h[4];
    tr4(rows, at + 192, h);
    q6_scales(h, s);
    s->d[0] = f16hi(gather(rows, offs, at + 206));
    tr16(rows, at, at + 32, s->nibbuf);
    tr16(rows, at + 64, at + 96, s->nibbuf + 64 * 16);
    tr16(rows, at + 128, at + 160, s->qhbuf);
    s->nib = s->nibbuf, s->qh = s->qhbuf;
}

/* a repacked Q6_K chunk: 32 ql dwords, 16 qh dwords, 4 scale dwords, then the 16 rows' d (this half's at d) */
INL void rp_q6_k(const char *p, const char *d, scratch_t *s) {
    vi h[4];
    for (int w = 0; w < 4; w++) h[w] = VEC(p, 48 + w);
    q6_scales(h, s);
    s->d[0] = f16v(d);
    s->nib = p, s->qh = p + 64 * 32;
}

/* Q6_K's codes of values 128h + 32s + 4g .. + 3 (g < 8): from ql[s & 1], the nibble dwords 16h + 8(s & 1) + g,
 * nibble s >> 1, and bits 2s, 2s + 1 of qh, the high-bit dwords 8h + g */
INL vi q6_code(const vu *ql, vu qh, const int sb) {
    vu lo = sb < 2 ? ql[sb & 1] & NIB : (ql[sb & 1] >> 4) & NIB, hb = qh & (0x03030303u << 2 * sb);
    return (vi)(lo | (sb < 2 ? hb << (4 - 2 * sb) : hb >> (2 * sb - 4)));
}

/* code vector i of the scratch */
INL void put(scratch_t *s, int i, vi v) { memcpy(s->codes + 64 * i, &v, sizeof v); }

/* Q8_0 (34 bytes): f16 d, int8 q[32]; codes q + 128. `nb` blocks of 32 from byte `at`. */
INL void dec_q8_0(const uint8_t *const *rows, vi offs, long at, int nb, scratch_t *s) {
    char t[16 * 64] __attribute__((aligned(64)));
    for (int b = 0; b < nb; b += 2) {
        int b1 = b + 1 < nb ? b + 1 : b;
        tr16(rows, at + 34 * b + 2, at + 34 * b1 + 2, t);
        for (int g = 0; g < 16; g++) put(s, 8 * b + g, (vi)((vu)VEC(t, g) ^ 0x80808080u));
    }
    for (int b = 0; b < nb; b++) s->d[b] = f16lo(gather(rows, offs, at + 34 * b));
    s->cp = s->codes, s->q5 = NULL;
}

/* a repacked Q8_0 chunk at p (repack_b32; the AVX2 path's half of each 16-row vector): codes read in place */
INL void rp_q8_0(const char *p, int half, int nb, scratch_t *s) {
    for (int b = 0; b < nb; b++) s->d[b] = f16v(p + 64 * RP_D_Q8_0 + 32 * b + 2 * LANES * half);
    s->cp = p + 4 * LANES * half, s->q5 = NULL;
}

/* Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles (values 0-15 low, 16-31 high). */
INL void dec_q4_1(const uint8_t *const *rows, vi offs, long at, int nb, scratch_t *s) {
    for (int b = 0; b < nb; b++) {
        vi h = gather(rows, offs, at + 20 * b), t[4];
        s->d[b] = f16lo(h), s->m[b] = f16hi(h);
        tr4(rows, at + 20 * b + 4, t); /* value group w low, 4 + w high */
        for (int w = 0; w < 4; w++) memcpy(s->nibbuf + 64 * (4 * b + w), &t[w], sizeof t[w]);
    }
    s->nib = s->nibbuf;
}

/* bit i of x (i < 4) to bit 4 of byte i: the four shifted copies of x that the multiply adds never overlap */
INL vu spread4(vu x) { return ((x & 15) * 0x02040810u) & 0x10101010u; }

/* Q5_0 (22 bytes): f16 d, uint32 qh (bit j: value j's fifth bit), 16 bytes of nibbles; codes q + 16. */
INL void dec_q5_0(const uint8_t *const *rows, vi offs, long at, int nb, scratch_t *s) {
    for (int b = 0; b < nb; b++) {
        vi t[4];
        s->d[b] = f16lo(gather(rows, offs, at + 22 * b));
        vu qh = (vu)gather(rows, offs, at + 22 * b + 2);
        tr4(rows, at + 22 * b + 6, t);
        for (int w = 0; w < 4; w++) {
            put(s, 8 * b + w, (vi)(((vu)t[w] & NIB) | spread4(qh >> (4 * w))));
            put(s, 8 * b + 4 + w, (vi)((((vu)t[w] >> 4) & NIB) | spread4(qh >> (16 + 4 * w))));
        }
    }
    s->cp = s->codes, s->q5 = NULL;
}

/* a repacked Q5_0 chunk at p (repack_b32): group w's fifth bits are qh's permuted dword shifted to bit 4 */
INL void rp_q5_0(const char *p, int half, int nb, scratch_t *s) {
    for (int b = 0; b < nb; b++) s->d[b] = f16v(p + 64 * RP_D_Q5_0 + 32 * b + 2 * LANES * half);
    s->q5 = p + 4 * LANES * half;
}

/* code vector g (< 8) of block b of a repacked Q5_0 chunk: nibbles | fifth bits (see repack_b32) */
INL vi q5_code(const char *v, int b, const int g) {
    vu t = vreg(v, 4 * b + g % 4), qh = vreg(v, 32 + b);
    return (vi)(g < 4 ? (t & NIB) | ((qh << (4 - g)) & 0x10101010u) : ((t >> 4) & NIB) | ((qh >> (g - 4)) & 0x10101010u));
}

/* Q4_1 has no repacked layout (q8_repack_bytes is 0): never called */
INL void rp_q4_1(const char *p, int half, int nb, scratch_t *s) { (void)p, (void)half, (void)nb, (void)s; }

/* ---- the dot kernels: G activation rows against a decoded chunk (G a constant after inlining) ----
 * Each activation row has its own accumulators and runs the same sequence whatever G is; G only interleaves
 * rows so that the multiply-adds of several rows share each code load. A few rows take several sub-blocks
 * at once so that at least 8 independent dpbusd chains are in flight. */

#define UNROLL _Pragma("GCC unroll 16")
#define NO_UNROLL _Pragma("GCC unroll 1")
INL vf to_f(vi v) { return __builtin_convertvector(v, vf); }

/* Q4_K: t = (dx * d) * f(sum_j sc_j sum q.qx) - (dx * dmin) * f(sum_j m_j (bsum pair j)). Sub-blocks go two at
 * a time (the low and high nibbles of the same dwords), SP pairs in flight. */
INL void dot_q4_k(const scratch_t *s, const xrow_t *x, long c, vf *y, const int G) {
    const int SP = G == 1 ? 4 : G == 2 ? 2 : 1;
    const int8_t *xq[GROUP];
    vi isum[GROUP];
    UNROLL for (int r = 0; r < G; r++) xq[r] = x[r].q + QA * c, isum[r] = (vi){0};
    NO_UNROLL for (int p0 = 0; p0 < 4; p0 += SP) {
        vi acc[GROUP][8];
        UNROLL for (int r = 0; r < G; r++) UNROLL for (int j = 0; j < 2 * SP; j++) acc[r][j] = (vi){0};
        UNROLL for (int g = 0; g < 8; g++) UNROLL for (int p = 0; p < SP; p++) {
            vu raw = vreg(s->nib, 8 * (p0 + p) + g);
            vi lo = (vi)(raw & NIB), hi = (vi)((raw >> 4) & NIB);
            UNROLL for (int r = 0; r < G; r++) {
                const int8_t *xp = xq[r] + 64 * (p0 + p) + 4 * g;
                acc[r][2 * p] = dot4(acc[r][2 * p], lo, xp);
                acc[r][2 * p + 1] = dot4(acc[r][2 * p + 1], hi, xp + 32);
            }
        }
        UNROLL for (int r = 0; r < G; r++) UNROLL for (int j = 0; j < 2 * SP; j++)
            isum[r] += acc[r][j] * s->sc[2 * p0 + j];
    }
    UNROLL for (int r = 0; r < G; r++) {
        vi msum = {0};
        UNROLL for (int i = 0; i < 4; i++) msum = dot2(msum, s->mn[i], x[r].aux + 4 * c + i);
        float dx = x[r].d[c];
        y[r] = y[r] + ((dx * s->d[0]) * to_f(isum[r]) - (dx * s->m[0]) * to_f(msum));
    }
}

/* Q6_K: t = (dx * d) * f(sum_j sc_j sum (q - 32).qx), each sub-block of 16 starting from -32 * its bsum. A unit
 * u = 2h + half is the 4 sub-blocks 8h + 2s + half (s < 4) whose codes share the stored dwords of value groups
 * g = 4 half .. 4 half + 3; SU units are in flight, SS of their sub-blocks at a time (registers). */
INL void dot_q6_k(const scratch_t *s, const xrow_t *x, long c, vf *y, const int G) {
    const int SU = G == 1 ? 2 : 1, SS = G <= 5 ? 4 : 2;
    const int8_t *xq[GROUP];
    vi isum[GROUP];
    UNROLL for (int r = 0; r < G; r++) xq[r] = x[r].q + QA * c, isum[r] = (vi){0};
    UNROLL for (int s0 = 0; s0 < 4; s0 += SS) NO_UNROLL for (int u0 = 0; u0 < 4; u0 += SU) {
        vi acc[GROUP][8];
        int sb[8]; /* the sub-block of each chain */
        UNROLL for (int uu = 0; uu < SU; uu++) UNROLL for (int ss = 0; ss < SS; ss++)
            sb[SS * uu + ss] = 8 * ((u0 + uu) / 2) + 2 * (s0 + ss) + (u0 + uu) % 2;
        UNROLL for (int r = 0; r < G; r++) UNROLL for (int i = 0; i < SU * SS; i++)
            acc[r][i] = (vi){0} + x[r].aux[16 * c + sb[i]];
        UNROLL for (int gg = 0; gg < 4; gg++) UNROLL for (int uu = 0; uu < SU; uu++)
            UNROLL for (int ss = 0; ss < SS; ss++) {
            const int h = (u0 + uu) / 2, g = 4 * ((u0 + uu) % 2) + gg;
            const vu ql[2] = {vreg(s->nib, 16 * h + g), vreg(s->nib, 16 * h + 8 + g)};
            vi code = q6_code(ql, vreg(s->qh, 8 * h + g), s0 + ss);
            UNROLL for (int r = 0; r < G; r++)
                acc[r][SS * uu + ss] = dot4(acc[r][SS * uu + ss], code, xq[r] + 128 * h + 32 * (s0 + ss) + 4 * g);
        }
        UNROLL for (int r = 0; r < G; r++) UNROLL for (int i = 0; i < SU * SS; i++) isum[r] += acc[r][i] * s->sc[sb[i]];
    }
    UNROLL for (int r = 0; r < G; r++) {
        float dx = x[r].d[c];
        y[r] = y[r] + (dx * s->d[0]) * to_f(isum[r]);
    }
}

/* The 32-block formats, nb blocks of the chunk: Q8_0 and Q5_0 t = (dx * d) * f(sum (q - offset).qx), each
 * block's sum starting from -offset * its 32-sum; Q4_1 t = (dx * d) * f(sum q.qx) + (dx * m) * f(sum qx). The
 * blocks' terms join y one at a time in block order. */
INL void dot_b32(int qtype, const scratch_t *s, const xrow_t *x, long c, int nb, vf *y, const int G) {
    const int SB = G == 1 ? 8 : G == 2 ? 4 : G <= 4 ? 2 : 1;
    const int8_t *xq[GROUP];
    UNROLL for (int r = 0; r < G; r++) xq[r] = x[r].q + QA * c;
    NO_UNROLL for (int b0 = 0; b0 < nb; b0 += SB) {
        int n = nb - b0 < SB ? nb - b0 : SB;
        vi acc[GROUP][8];
        UNROLL for (int r = 0; r < G; r++) UNROLL for (int b = 0; b < SB; b++)
            acc[r][b] = (vi){0} + (qtype == T_Q4_1 || b >= n ? 0 : x[r].aux[8 * c + b0 + b]);
        UNROLL for (int g = 0; g < 8; g++) UNROLL for (int b = 0; b < SB; b++) {
            /* past the chunk's blocks: stale codes, never used */
            vi code = qtype == T_Q5_0 && s->q5 ? q5_code(s->q5, b0 + b, g)
                    : qtype != T_Q4_1 ? (vi)vreg(s->cp, 8 * (b0 + b) + g)
                    : (vi)(((vu)VEC(s->nib, 4 * (b0 + b) + g % 4) >> (g / 4 * 4)) & NIB);
            UNROLL for (int r = 0; r < G; r++) {
                const int8_t *p = xq[r] + 32 * (b0 + b) + 4 * g;
                acc[r][b] = qtype == T_Q8_0 ? dot4w(acc[r][b], code, p) : dot4(acc[r][b], code, p);
            }
        }
        UNROLL for (int b = 0; b < SB; b++) {
            if (b >= n) break;
            UNROLL for (int r = 0; r < G; r++) {
                float dx = x[r].d[c];
                vf t = (dx * s->d[b0 + b]) * to_f(acc[r][b]);
                if (qtype == T_Q4_1) {
                    float xs;
                    memcpy(&xs, x[r].aux + 8 * c + b0 + b, 4);
                    t = t + (dx * s->m[b0 + b]) * xs;
                }
                y[r] = y[r] + t;
            }
        }
    }
}

/* ---- a tile's chunk: decode once, then every activation row, GROUP at a time ---- */

#if GROUP == 8
#define WIDE_CASES(CALL) case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break;
#else
#define WIDE_CASES(CALL)
#endif
#define EACH_GROUP(CALL) EACH_GROUP_FROM(0, CALL)
#define EACH_GROUP_FROM(FIRST, CALL)                                                                           \
    for (long r0 = (FIRST); r0 < j->m; r0 += GROUP) {                                                          \
        const xrow_t *x = j->x + r0;                                                                           \
        vf *yy = y + r0;                                                                                       \
        switch (j->m - r0 < GROUP ? j->m - r0 : GROUP) {                                                       \
        case 1: CALL(1); break;                                                                                \
        case 2: CALL(2); break;                                                                                \
        case 3: CALL(3); break;                                                                                \
        WIDE_CASES(CALL)                                                                                       \
        default: CALL(GROUP); break;                                                                           \
        }                                                                                                      \
    }

/* Where a tile's blocks are: its rows as stored (and offs[r] = rows[r] - rows[0]), or its repacked chunks (this
 * path's half of each 16-row vector on the AVX2 path, which takes 8 rows a tile). */
typedef struct {
    const uint8_t *rows[LANES];
    vi offs;
    const char *rp;
    int half;
} SFX(tile_t);

typedef void (*SFX(chunk_fn))(const job_t *, const SFX(tile_t) *, long, scratch_t *, vf *, pf_t *);

/* A chunk of each format: its prefetch step and its decoding into the scratch (load_*), then every activation
 * row's dot (chunk_*), or on the AMX path the whole pass's rows in tiles (amx_*, below). */
INL void SFX(load_q4_k)(const job_t *j, const SFX(tile_t) *tl, long c, scratch_t *s, pf_t *pf) {
    if (tl->rp) {
        const char *p = tl->rp + c * j->rp_chunk;
        for (long b = 0; b < j->rp_chunk; b += 64) _mm_prefetch(p + PREFETCH_AHEAD * j->rp_chunk + b, _MM_HINT_T1);
        rp_q4_k(p + 4 * LANES * tl->half, s);
    } else {
        pf_step(pf, j, LANES, BYTES_Q4_K);
        dec_q4_k(tl->rows, c * j->chunk_bytes, s);
    }
}

INL void SFX(load_q6_k)(const job_t *j, const SFX(tile_t) *tl, long c, scratch_t *s, pf_t *pf) {
    if (tl->rp) {
        const char *p = tl->rp + c * j->rp_chunk;
        for (long b = 0; b < j->rp_chunk; b += 64) _mm_prefetch(p + PREFETCH_AHEAD * j->rp_chunk + b, _MM_HINT_T1);
        rp_q6_k(p + 4 * LANES * tl->half, p + 64 * 52 + 2 * LANES * tl->half, s);
    } else {
        pf_step(pf, j, LANES, BYTES_Q6_K);
        dec_q6_k(tl->rows, tl->offs, c * j->chunk_bytes, s);
    }
}

static void SFX(chunk_q4_k)(const job_t *j, const SFX(tile_t) *tl, long c, scratch_t *s, vf *y, pf_t *pf) {
    SFX(load_q4_k)(j, tl, c, s, pf);
#define CALL(G) dot_q4_k(s, x, c, yy, G)
    EACH_GROUP(CALL)
#undef CALL
}

static void SFX(chunk_q6_k)(const job_t *j, const SFX(tile_t) *tl, long c, scratch_t *s, vf *y, pf_t *pf) {
    SFX(load_q6_k)(j, tl, c, s, pf);
#define CALL(G) dot_q6_k(s, x, c, yy, G)
    EACH_GROUP(CALL)
#undef CALL
}

/* the chunk's blocks of a 32-block format (nb of them, fewer in a short last chunk), decoded */
#define LOAD_B32(stem, N)                                                                                      \
    INL int SFX(load_##stem)(const job_t *j, const SFX(tile_t) *tl, long c, scratch_t *s, pf_t *pf) {           \
        const int nb = (int)((j->k - QA * c < QA ? j->k - QA * c : QA) / 32);                                  \
        if (tl->rp) {                                                                                          \
            const char *p = tl->rp + c * j->rp_chunk;                                                          \
            for (long b = 0; b < j->rp_chunk; b += 64)                                                         \
                _mm_prefetch(p + PREFETCH_AHEAD * j->rp_chunk + b, _MM_HINT_T1);                               \
            rp_##stem(p, tl->half, nb, s);                                                                     \
        } else {                                                                                               \
            pf_step(pf, j, LANES, 8 * BYTES_##N);                                                              \
            dec_##stem(tl->rows, tl->offs, c * j->chunk_bytes, nb, s);                                         \
        }                                                                                                      \
        return nb;                                                                                             \
    }                                                                                                          \
    static void SFX(chunk_##stem)(const job_t *j, const SFX(tile_t) *tl, long c, scratch_t *s, vf *y,          \
                                  pf_t *pf) {                                                                  \
        const int qt = T_##N, nb = SFX(load_##stem)(j, tl, c, s, pf);                                          \
        EACH_GROUP(CALL_B32)                                                                                   \
    }
#define CALL_B32(G) dot_b32(qt, s, x, c, nb, yy, G)
LOAD_B32(q8_0, Q8_0)
LOAD_B32(q5_0, Q5_0)
LOAD_B32(q4_1, Q4_1)
#undef CALL_B32
#undef LOAD_B32

#if Q8_ISA == 512
/* ---- the AMX path: every activation row against a tile's chunk in int8 tiles ----
 * The transposed code dwords the VNNI dots read (vector i, lane r = 4 codes of weight row r) are, 16 rows of 64
 * bytes, exactly the layout of tdpbsud's second operand; the first is 16 activation rows as quantised (laid out
 * tile by tile, amx_layout). One tdpbsud per sub-block (a block, or a scale's values: 32 of them) gives its
 * integer sum for 16 activation rows and 16 weight rows at once, C[m][r], so row m of C is the vector that the
 * VNNI path's chain builds for activation row m: the integers are the same (exact), and each row then takes the
 * same scales and the same float steps in the same order, so the bits are the same. (Q4_K and Q6_K instead fold
 * their sub-block scales into the codes, amx_q4_k and amx_q6_k: the same integers, summed in the tiles.)
 * A chunk's work is a list of units (four sub-blocks of one group of 16 activation rows; for Q4_K two groups,
 * for Q6_K the whole chunk of one group); a last group of fewer rows is padded with zero rows (amx_layout), whose
 * sums are never read. Tiles: 0-3 a unit's sums, 4-5 activations, 6-7 codes (Q6_K: 0-2 sums, 4 activations, 5-7
 * codes). The sums go to memory; those of unit u are read after the tile products of unit u + 1 are issued,
 * from the other half of cbuf, so that no vector load waits on a tile store just issued (on the Xeon measured,
 * no faster: leaving either the products or the reads of their sums out saves what each costs alone). */
/* the thread's tile configuration (amx_config's m, kb, na) */
static __thread long amx_rows = -1;
static __thread int amx_kb = -1, amx_na = -1;

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

/* m activation rows, kb bytes of each that one product takes, na activation tiles from tile 4 (the rest to 7:
 * codes) */
static void amx_config(long m, int kb, int na) {
    amx_cfg_t cfg;
    if (m == amx_rows && kb == amx_kb && na == amx_na) return;
    amx_rows = m, amx_kb = kb, amx_na = na;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = (uint8_t)m, cfg.colsb[t] = 64;
    for (int t = 4; t < 4 + na; t++) cfg.rows[t] = (uint8_t)m, cfg.colsb[t] = (uint16_t)kb;
    for (int t = 4 + na; t < 8; t++) cfg.rows[t] = (uint8_t)(kb / 4), cfg.colsb[t] = 64;
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* GCC 12's ldtilecfg reads memory it does not declare: without
                                                     * this barrier it drops the stores of rows and colsb as dead */
    _tile_loadconfig(&cfg);
}

/* C of sub-blocks i < n (n <= 4): activations from xa + step * i (rows ldx apart) times codes at bb[i] (rows 64
 * bytes apart), stored at c + 256 i (row m at c + 256 i + 16 m). Tile numbers are immediates: written out. */
INL void amx4(const int8_t *xa, long step, long ldx, const char *const *bb, int n, int32_t *c) {
    _tile_zero(0);
    _tile_loadd(4, xa, ldx);
    _tile_loadd(6, bb[0], 64);
    _tile_dpbsud(0, 4, 6);
    if (n > 1) {
        _tile_zero(1);
        _tile_loadd(5, xa + step, ldx);
        _tile_loadd(7, bb[1], 64);
        _tile_dpbsud(1, 5, 7);
    }
    if (n > 2) {
        _tile_zero(2);
        _tile_loadd(4, xa + 2 * step, ldx);
        _tile_loadd(6, bb[2], 64);
        _tile_dpbsud(2, 4, 6);
    }
    if (n > 3) {
        _tile_zero(3);
        _tile_loadd(5, xa + 3 * step, ldx);
        _tile_loadd(7, bb[3], 64);
        _tile_dpbsud(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    if (n > 1) _tile_stored(1, c + 256, 64);
    if (n > 2) _tile_stored(2, c + 512, 64);
    if (n > 3) _tile_stored(3, c + 768, 64);
}

/* Group g of a job's activation rows: its first row m0 and its rows mr (the tiles' rows past them are zeros) */
typedef struct {
    long m0, mr;
} amx_group_t;

INL amx_group_t amx_group(const job_t *j, long g) {
    return (amx_group_t){g * PASS, j->mt - g * PASS < PASS ? j->mt - g * PASS : PASS};
}
/* row m of a group in the sums of sub-block i, stored at cb */
#define C_ROW(cb, i, m) vload((const char *)((cb) + 256 * (i) + 16 * (m)))
/* the activations of group g, chunk c, from value o of the chunk: a tile's rows, QA bytes apart (amx_layout) */
#define AMX_X(g, o) (j->xt + (c * GROUPS + (g)) * (PASS * QA) + (o))

/* The pipeline over a chunk's units: ISSUE(u, cb) runs the tile products of unit u into cb, FINISH(u, cb) reads
 * them, one unit later, from the other half of cbuf. */
#define AMX_PIPELINE(UNITS, ISSUE, FINISH)                                                                     \
    do {                                                                                                       \
        const long units = (UNITS);                                                                            \
        __asm__ volatile("" : : : "memory"); /* GCC 12's tileloadd does not declare the memory it reads: the    \
                                                codes just built must be stored before it */                   \
        for (long u = 0; u <= units; u++) {                                                                    \
            if (u < units) ISSUE(u, s->cbuf + 1024 * (u % 2));                                                 \
            if (u > 0) FINISH(u - 1, s->cbuf + 1024 * ((u - 1) % 2));                                          \
        }                                                                                                      \
    } while (0)
#define GROUPS ((j->mt + PASS - 1) / PASS)

/* a lane's 4 code bytes (each below 16) times the lane's factor f (below 16; f | f << 16 in each lane): the
 * products, each below 256, as bytes */
INL vi mul_codes(vi v, vi f) {
    __m512i even = _mm512_mullo_epi16((__m512i)(v & 0x00ff00ff), (__m512i)f);
    __m512i odd = _mm512_mullo_epi16((__m512i)((vi)((vu)v >> 8) & 0x00ff00ff), (__m512i)f);
    return (vi)even | (vi)((vu)(vi)odd << 8);
}

/* Q4_K: the sub-block scales go into the codes, in two parts (sc = 16 hi + lo, lo < 16, hi < 4), so that one
 * tdpbsud takes 64 values across two sub-blocks: codes times lo (below 256, unsigned bytes as tdpbsud takes them)
 * give C_lo, codes times hi give C_hi, and C_lo + 16 C_hi = sum_j sc_j sum q.qx, the integer dot_q4_k builds
 * (|C_lo| < 256 * 225 * 127, no overflow). A chunk's codes are multiplied once (B_lo, B_hi: four tiles of 64
 * values each) and serve every activation row; a unit is two groups of 16 rows, each tile of codes loaded once for
 * both. Then dot_q4_k's float step, row by row. */
static void amx_q4_k(const job_t *j, const tile_t_512 *tl, long c, scratch_t *s, vf *y, pf_t *pf) {
    load_q4_k_512(j, tl, c, s, pf);
    UNROLL for (int p = 0; p < 4; p++) {
        const vi f[4] = {(s->sc[2 * p] & 15) * 0x10001, (s->sc[2 * p] >> 4) * 0x10001,
                         (s->sc[2 * p + 1] & 15) * 0x10001, (s->sc[2 * p + 1] >> 4) * 0x10001};
        UNROLL for (int g = 0; g < 8; g++) {
            vu raw = vreg(s->nib, 8 * p + g);
            vi lo = (vi)(raw & NIB), hi = (vi)((raw >> 4) & NIB);
            vi b[4] = {mul_codes(lo, f[0]), mul_codes(lo, f[1]), mul_codes(hi, f[2]), mul_codes(hi, f[3])};
            memcpy(s->bt + 1024 * p + 64 * g, &b[0], 64);
            memcpy(s->bt + 4096 + 1024 * p + 64 * g, &b[1], 64);
            memcpy(s->bt + 1024 * p + 64 * (8 + g), &b[2], 64);
            memcpy(s->bt + 4096 + 1024 * p + 64 * (8 + g), &b[3], 64);
        }
    }
#define ISSUE(u, cb)                                                                                           \
    do {                                                                                                       \
        const int two = 2 * (u) + 1 < GROUPS;                                                                  \
        const int8_t *xa = AMX_X(2 * (u), 0), *xb = two ? AMX_X(2 * (u) + 1, 0) : xa;                          \
        _tile_zero(0);                                                                                         \
        _tile_zero(1);                                                                                         \
        _tile_zero(2);                                                                                         \
        _tile_zero(3);                                                                                         \
        UNROLL for (int p = 0; p < 4; p++) {                                                                   \
            _tile_loadd(6, s->bt + 1024 * p, 64);                                                              \
            _tile_loadd(7, s->bt + 4096 + 1024 * p, 64);                                                       \
            _tile_loadd(4, xa + 64 * p, QA);                                                                   \
            _tile_dpbsud(0, 4, 6);                                                                             \
            _tile_dpbsud(1, 4, 7);                                                                             \
            if (two) {                                                                                         \
                _tile_loadd(5, xb + 64 * p, QA);                                                               \
                _tile_dpbsud(2, 5, 6);                                                                         \
                _tile_dpbsud(3, 5, 7);                                                                         \
            }                                                                                                  \
        }                                                                                                      \
        _tile_stored(0, cb, 64);                                                                               \
        _tile_stored(1, cb + 256, 64);                                                                         \
        if (two) {                                                                                             \
            _tile_stored(2, cb + 512, 64);                                                                     \
            _tile_stored(3, cb + 768, 64);                                                                     \
        }                                                                                                      \
    } while (0)
#define FINISH(u, cb)                                                                                          \
    do {                                                                                                       \
        for (long g = 2 * (u); g < 2 * (u) + 2 && g < GROUPS; g++) {                                           \
            const amx_group_t a = amx_group(j, g);                                                             \
            const int32_t *cg = (cb) + 512 * (g - 2 * (u));                                                    \
            for (long m = 0; m < a.mr; m++) {                                                                  \
                const xrow_t *x = j->x + a.m0 + m;                                                             \
                vi isum = C_ROW(cg, 0, m) + C_ROW(cg, 1, m) * 16, msum = {0};                                  \
                UNROLL for (int i = 0; i < 4; i++) msum = dot2(msum, s->mn[i], x->aux + 4 * c + i);           \
                float dx = x->d[c];                                                                            \
                y[a.m0 + m] = y[a.m0 + m] + ((dx * s->d[0]) * to_f(isum) - (dx * s->m[0]) * to_f(msum));      \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)
    AMX_PIPELINE((GROUPS + 1) / 2, ISSUE, FINISH);
#undef ISSUE
#undef FINISH
}

/* The signed bytes of v times the lane's factor f (f as an int16 pair in each lane, each product within int8):
 * even and odd bytes widened to int16 (ev, od: sign-extended), multiplied, the low bytes put back */
INL vi mul_signed(vi ev, vi od, vi f) {
    __m512i e = _mm512_mullo_epi16((__m512i)ev, (__m512i)f), o = _mm512_mullo_epi16((__m512i)od, (__m512i)f);
    return (vi)_mm512_ternarylogic_epi32(_mm512_slli_epi16(o, 8), e, _mm512_set1_epi16(0xff), 0xf8);
}

/* a lane's int32 f in -3..4 as the int16 pair mul_signed takes */
INL vi pair16(vi f) { return (vi)(((vu)f & 0xffff) | ((vu)f << 16)); }

/* Q6_K: the values (code - 32, -32..31) and the sub-block scales (int8) go into the codes in three parts,
 * sc = 64 h + 8 m + l (l, m in -3..4, h in -2..2), so that every product of a value and a part fits a signed
 * byte (|v l| <= 128) and one tdpbssd takes 64 values across four sub-blocks: C_l + 8 C_m + 64 C_h =
 * sum_j sc_j sum (q - 32).qx, the integer dot_q6_k builds (offsets included; |C| < 2^27): twelve products a
 * superblock where one per sub-block took sixteen, and the sums leave the tiles once a chunk, not per sub-block.
 * Value group vg (values 4 vg..4 vg + 3, sub-block vg / 4) is q6_code(.., s) of groups 32h + 8s + g; its three
 * products go to bt + 4096 p + 64 vg, so round r's B tiles are 1 KB apart. Then dot_q6_k's float step. */
static void amx_q6_k(const job_t *j, const tile_t_512 *tl, long c, scratch_t *s, vf *y, pf_t *pf) {
    load_q6_k_512(j, tl, c, s, pf);
    UNROLL for (int h = 0; h < 2; h++) UNROLL for (int sb = 0; sb < 4; sb++) {
        vi f[2][3];
        UNROLL for (int k = 0; k < 2; k++) {
            const vi sc = s->sc[8 * h + 2 * sb + k], l = ((sc + 3) & 7) - 3, s1 = (sc - l) >> 3;
            const vi m = ((s1 + 3) & 7) - 3;
            f[k][0] = pair16(l), f[k][1] = pair16(m), f[k][2] = pair16((s1 - m) >> 3);
        }
        UNROLL for (int g = 0; g < 8; g++) {
            const vu ql[2] = {vreg(s->nib, 16 * h + g), vreg(s->nib, 16 * h + 8 + g)};
            const vi v = (vi)_mm512_sub_epi8((__m512i)q6_code(ql, vreg(s->qh, 8 * h + g), sb), _mm512_set1_epi8(32));
            const vi ev = (vi)_mm512_srai_epi16(_mm512_slli_epi16((__m512i)v, 8), 8);
            const vi od = (vi)_mm512_srai_epi16((__m512i)v, 8);
            UNROLL for (int p = 0; p < 3; p++) {
                vi b = mul_signed(ev, od, f[g / 4][p]);
                memcpy(s->bt + 4096 * p + 64 * (32 * h + 8 * sb + g), &b, 64);
            }
        }
    }
#define ISSUE(u, cb)                                                                                           \
    do {                                                                                                       \
        _tile_zero(0);                                                                                         \
        _tile_zero(1);                                                                                         \
        _tile_zero(2);                                                                                         \
        UNROLL for (int r = 0; r < 4; r++) {                                                                   \
            _tile_loadd(4, AMX_X(u, 64 * r), QA);                                                              \
            _tile_loadd(5, s->bt + 1024 * r, 64);                                                              \
            _tile_loadd(6, s->bt + 4096 + 1024 * r, 64);                                                       \
            _tile_loadd(7, s->bt + 8192 + 1024 * r, 64);                                                       \
            _tile_dpbssd(0, 4, 5);                                                                             \
            _tile_dpbssd(1, 4, 6);                                                                             \
            _tile_dpbssd(2, 4, 7);                                                                             \
        }                                                                                                      \
        _tile_stored(0, cb, 64);                                                                               \
        _tile_stored(1, cb + 256, 64);                                                                         \
        _tile_stored(2, cb + 512, 64);                                                                         \
    } while (0)
#define FINISH(u, cb)                                                                                          \
    do {                                                                                                       \
        const amx_group_t a = amx_group(j, u);                                                                 \
        for (long m = 0; m < a.mr; m++) {                                                                      \
            vi isum = C_ROW(cb, 0, m) + C_ROW(cb, 1, m) * 8 + C_ROW(cb, 2, m) * 64;                            \
            float dx = j->x[a.m0 + m].d[c];                                                                    \
            y[a.m0 + m] = y[a.m0 + m] + (dx * s->d[0]) * to_f(isum);                                           \
        }                                                                                                      \
    } while (0)
    AMX_PIPELINE(GROUPS, ISSUE, FINISH);
#undef ISSUE
#undef FINISH
}

/* Q8_0, Q5_0: block b's codes are the 8 vectors from cp + 512 b (a repacked Q5_0 chunk's are built first); each
 * block's sum starts from its offset, and the blocks' terms join y in block order, as in dot_b32. Rounds of four
 * blocks, two a group (one where the chunk is short). */
static void amx_b32(const job_t *j, const tile_t_512 *tl, long c, scratch_t *s, vf *y, pf_t *pf) {
    const int nb = j->qtype == T_Q8_0 ? load_q8_0_512(j, tl, c, s, pf) : load_q5_0_512(j, tl, c, s, pf);
    const char *cp = s->cp;
    if (j->qtype == T_Q5_0 && s->q5) {
        UNROLL for (int b = 0; b < 8; b++) UNROLL for (int g = 0; g < 8; g++) {
            vi code = q5_code(s->q5, b, g);
            memcpy(s->bt + 512 * b + 64 * g, &code, 64);
        }
        cp = s->bt;
    }
    const int rounds = (nb + 3) / 4;
#define ISSUE(u, cb)                                                                                           \
    do {                                                                                                       \
        const long r = (u) % rounds;                                                                           \
        const char *bb[4] = {cp + 2048 * r, cp + 2048 * r + 512, cp + 2048 * r + 1024, cp + 2048 * r + 1536};  \
        amx4(AMX_X((u) / rounds, 128 * r), 32, QA, bb,                                                         \
             nb - 4 * r < 4 ? nb - 4 * r : 4, cb);                                                             \
    } while (0)
#define FINISH(u, cb)                                                                                          \
    do {                                                                                                       \
        const long r = (u) % rounds;                                                                           \
        const amx_group_t a = amx_group(j, (u) / rounds);                                                                 \
        const int n = nb - 4 * (r) < 4 ? nb - 4 * (r) : 4;                                                     \
        for (long m = 0; m < a.mr; m++) {                                                                      \
            const xrow_t *x = j->x + a.m0 + m;                                                                 \
            float dx = x->d[c];                                                                                \
            vf acc = y[a.m0 + m];                                                                              \
            for (int i = 0; i < n; i++)                                                                        \
                acc = acc + (dx * s->d[4 * (r) + i]) * to_f(C_ROW(cb, i, m) + x->aux[8 * c + 4 * (r) + i]); \
            y[a.m0 + m] = acc;                                                                                 \
        }                                                                                                      \
    } while (0)
    AMX_PIPELINE(rounds * GROUPS, ISSUE, FINISH);
#undef ISSUE
#undef FINISH
}

/* The rows past the tiles' (j->mt on), on the VNNI dots, from the chunk the tile pass just decoded. Out of line:
 * inlined into the tile functions, it ran their 16-row passes 3-5% slower on the Xeon. */
static __attribute__((noinline)) void amx_tail(const job_t *j, long c, scratch_t *s, vf *y) {
    if (j->qtype == T_Q4_K) {
#define CALL(G) dot_q4_k(s, x, c, yy, G)
        EACH_GROUP_FROM(j->mt, CALL)
#undef CALL
    } else if (j->qtype == T_Q6_K) {
#define CALL(G) dot_q6_k(s, x, c, yy, G)
        EACH_GROUP_FROM(j->mt, CALL)
#undef CALL
    } else {
        const int qt = j->qtype, nb = (int)((j->k - QA * c < QA ? j->k - QA * c : QA) / 32);
#define CALL(G) dot_b32(qt, s, x, c, nb, yy, G)
        EACH_GROUP_FROM(j->mt, CALL)
#undef CALL
    }
}
#undef C_ROW
#undef AMX_X
#undef GROUPS
#endif

/* Tile t's blocks: repacked where the job has them, else its LANES rows as stored (past the last weight row,
 * the last again: computed, never stored), with the row prefetch stream started if it is not running. */
static void SFX(tile_at)(const job_t *j, long t, SFX(tile_t) *tl, pf_t *pf) {
    long t16 = t * LANES / 16;
    if (t16 < j->rp_tiles) {
        tl->rp = (const char *)j->rp + t16 * j->chunks * j->rp_chunk, tl->half = (int)(t % (16 / LANES));
        return;
    }
    tl->rp = NULL;
    for (int r = 0; r < LANES; r++) {
        long row = t * LANES + r < j->n ? t * LANES + r : j->n - 1;
        tl->rows[r] = j->w + row * j->row_bytes;
        tl->offs[r] = (int32_t)((row - t * LANES) * j->row_bytes);
    }
    if (pf->t < t) {
        pf_tile(pf, j, t, LANES);
        for (int i = 0; i < PREFETCH_AHEAD; i++) pf_step(pf, j, LANES, j->chunk_bytes);
    }
}

/* Every tile of the job, the chunks along K in order (so each output's block terms join in block order), each
 * stream (repacked, or the rows') prefetched PREFETCH_AHEAD chunks ahead. Returns 0, or -1 out of memory. */
static int SFX(run_tiles)(const job_t *j) {
    SFX(chunk_fn) fn = j->qtype == T_Q4_K ? SFX(chunk_q4_k) : j->qtype == T_Q6_K ? SFX(chunk_q6_k)
                     : j->qtype == T_Q8_0 ? SFX(chunk_q8_0) : j->qtype == T_Q5_0 ? SFX(chunk_q5_0)
                     : SFX(chunk_q4_1);
    scratch_t s;
    vf ybuf[PASS], *y = ybuf;
    if (j->m > PASS && !(y = aligned_alloc(64, sizeof(vf) * j->m))) return -1; /* an AMX job takes every row */
#if Q8_ISA == 512
    if (j->amx) {
        fn = j->qtype == T_Q4_K ? amx_q4_k : j->qtype == T_Q6_K ? amx_q6_k : amx_b32;
        amx_config(j->mt < PASS ? j->mt : PASS, j->qtype == T_Q4_K || j->qtype == T_Q6_K ? 64 : 32,
                   j->qtype == T_Q6_K ? 1 : 2);
    }
#endif
    pf_t pf = {.t = -1};
    SFX(tile_t) tl;
    for (long t = j->tile_lo; t < j->tile_hi; t++) {
        SFX(tile_at)(j, t, &tl, &pf);
        for (long i = 0; i < j->m; i++) y[i] = (vf){0};
        for (long c = 0; c < j->chunks; c++) {
            fn(j, &tl, c, &s, y, &pf);
#if Q8_ISA == 512
            if (j->amx && j->mt < j->m) amx_tail(j, c, &s, y);
#endif
        }
        if ((t + 1) * LANES <= j->n) /* a whole tile: one vector store a row (scalar ones cost 0.6 ms a row on
                                       * the 1.5B's head, its rows far apart) */
            for (long i = 0; i < j->m; i++) memcpy(j->y + i * j->ldy + t * LANES, &y[i], sizeof y[i]);
        else
            for (long i = 0; i < j->m; i++)
                for (int r = 0; t * LANES + r < j->n; r++) j->y[i * j->ldy + t * LANES + r] = y[i][r];
    }
    if (y != ybuf) free(y);
#if Q8_ISA == 512
    if (j->amx) {
        _tile_release();
        amx_rows = -1, amx_kb = -1, amx_na = -1;
    }
#endif
    return 0;
}

#undef INL
#undef SFX
#undef LANES
#undef GROUP
#undef vi
#undef vu
#undef vf
#undef UNROLL
#undef NO_UNROLL
#undef NIB
#undef WIDE_CASES
#undef EACH_GROUP
#undef EACH_GROUP_FROM
#undef scratch_t
#undef dot4
#undef dot4w
#undef dot2
#undef f16lo
#undef f16hi
#undef tr16
#undef tr4
#undef gather
#undef spread4
#undef to_f
#undef dec_q4_k
#undef dec_q6_k
#undef q6_code
#undef dec_q8_0
#undef dec_q4_1
#undef dec_q5_0
#undef rp_q8_0
#undef rp_q5_0
#undef rp_q4_1
#undef put
#undef q5_code
#undef dot_q4_k
#undef dot_q6_k
#undef dot_b32
#undef vload
#undef vreg
#undef hdr_q4_k
#undef rp_q4_k
#undef rp_q6_k
#undef q6_scales
#undef f16v
#undef VEC
#pragma GCC pop_options
#endif
