/* One core's float32 FMA throughput, the floor of exact verification: every verified row of the 1.5B costs
 * 1.54 G float32 FMAs however the weights are stored. Build and run on an idle core:
 *   cc -O3 -mavx512f -mfma scripts/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 * (drop -mavx512f and the zmm half on a CPU without AVX-512). 12 independent accumulator chains, enough to
 * cover the FMA latency on the cores measured here. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define CHAINS 12
#define ITERS 200000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    float sink = 0;
#ifdef __AVX512F__
    __m512 a[CHAINS], b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_ps((float)i);
    double t0 = now();
    for (long i = 0; i < ITERS; i++)
#pragma GCC unroll 12
        for (int j = 0; j < CHAINS; j++) a[j] = _mm512_fmadd_ps(a[j], b, c);
    double t = now() - t0;
    for (int i = 0; i < CHAINS; i++) sink += _mm512_reduce_add_ps(a[i]);
    printf("zmm: %.1f G float32 FMA lanes/s\n", ITERS * CHAINS * 16 / t / 1e9);
#endif
    __m256 y[CHAINS], yb = _mm256_set1_ps(1.0000001f), yc = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++) y[i] = _mm256_set1_ps((float)i);
    double s0 = now();
    for (long i = 0; i < ITERS; i++)
#pragma GCC unroll 12
        for (int j = 0; j < CHAINS; j++) y[j] = _mm256_fmadd_ps(y[j], yb, yc);
    double s = now() - s0;
    float lanes[8];
    for (int i = 0; i < CHAINS; i++) {
        _mm256_storeu_ps(lanes, y[i]);
        for (int k = 0; k < 8; k++) sink += lanes[k];
    }
    printf("ymm: %.1f G float32 FMA lanes/s\n", ITERS * CHAINS * 8 / s / 1e9);
    return sink == 0.5f; /* keeps the chains live */
}
