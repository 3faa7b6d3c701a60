/* 4-bit weights times 8-bit activations on AVX2 (the Q4_1 x Q8_1 scheme of llama.cpp, in a layout of our own).

Weights: per output row, K/256 blocks of 8 groups of 32 input features; w = q * d + m, q in 0..15, with a
scale d and a minimum m (fp16) per group. Activations are quantized per group of 32 to int8 with a scale
dx (x = qx * dx) and sx = dx * sum(qx). A group's dot product is then d * dx * sum(q * qx) + m * sx, with the
integer sum on _mm256_maddubs_epi16. The layouts (see wblock / xblock) interleave a block's 8 groups: in each
32-byte vector, 4-byte lane l holds 4 elements of group l, so the 8 products' vectors of a block add up lane by lane
(int16 sums stay below 8 * 2 * 15 * 127 = 30480) and one _mm256_madd_epi16 leaves group l's sum in lane l, beside
its scales: no horizontal adds until a row's end.

The AVX2 kernel is compiled for AVX2, FMA and F16C by function attribute and runs only where the CPU has them
(q4_avx2(), checked once), so no caller executes an instruction its CPU lacks; elsewhere (other CPUs, other
architectures) the same integer arithmetic runs in plain C, slowly.

q4_linear is the one entry: it reads float32 or bfloat16 activations, quantizes them into a scratch buffer, multiplies,
adds the bias and writes float32 or bfloat16 (rounded to nearest even, as torch rounds), all in one call: a layer's
step costs one foreign call and no tensor operations around it. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

/* 256 weights: byte 4l + e of qs[32p:32p+32] (p = 0..3) holds element 4p + e of group l in its low nibble and
   element 16 + 4p + e in its high nibble. d, m per group. */
typedef struct { uint8_t qs[128]; uint16_t d[8]; uint16_t m[8]; } wblock;
/* 256 activations: qs[32j + 4l + e] is element 4j + e of group l (j = 0..7); d, s per group. */
typedef struct { int8_t qs[256]; float d[8]; float s[8]; } xblock;

/* 1 where the AVX2 kernel runs on this CPU, else 0. */
int q4_avx2(void) {
#if defined(__x86_64__)
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return known;
#else
    return 0;
#endif
}

int q4_wblock_bytes(void) { return (int)sizeof(wblock); }
int q4_xblock_bytes(void) { return (int)sizeof(xblock); }

static float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* torch's float -> bfloat16: round to nearest even, NaN to 0x7FC0. */
static uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* x [M, K_in] (float32, or bfloat16 where bf16) -> out [M, K/256] blocks; features K_in .. K are zeros. */
static void q8_blocks(const void *x, int bf16, int64_t M, int64_t K_in, int64_t K, xblock *out, int threads) {
    int64_t nb = K / 256, n = M * nb;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 64)
    for (int64_t i = 0; i < n; i++) {
        int64_t row = i / nb, first = (i % nb) * 256;
        float v[256];
        for (int j = 0; j < 256; j++) {
            int64_t c = first + j, at = row * K_in + c;
            v[j] = c >= K_in ? 0.f : bf16 ? bf16_to_float(((const uint16_t *)x)[at]) : ((const float *)x)[at];
        }
        xblock *o = out + i;
        for (int g = 0; g < 8; g++) {
            const float *u = v + g * 32;
            float amax = 0.f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(u[j]));
            float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                int t = (int)lrintf(u[j] * id);
                sum += t;
                o->qs[32 * (j / 4) + 4 * g + j % 4] = (int8_t)t;
            }
            o->d[g] = d;
            o->s[g] = d * (float)sum;
        }
    }
}

/* Where a result goes: y [M, N] float32, or bfloat16 where bf16; plus bias [N] (float32) when given. */
typedef struct { void *y; int bf16; const float *bias; int64_t N; } sink;

static inline void put(const sink *o, int64_t r, int64_t n, float v) {
    if (o->bias) v += o->bias[n];
    if (o->bf16) ((uint16_t *)o->y)[r * o->N + n] = float_to_bf16(v);
    else ((float *)o->y)[r * o->N + n] = v;
}

#if defined(__x86_64__)
AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* int16 [16]: the 8 vectors' products of a block with one row's codes; lanes 2l, 2l+1 belong to group l. */
#define PRODUCT(j) _mm256_maddubs_epi16(w[j], _mm256_loadu_si256((const __m256i *)(xb->qs + 32 * (j))))

/* Result (r0 + r, n) = row r of x (R <= 4 rows, [R, B] blocks) . weight row n ([B] blocks). */
AVX2 static inline void rows(const wblock *wr, const xblock *x, int64_t B, const sink *o, int64_t r0, int64_t n,
                             const int R) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[4];  /* with w[8]: 12 of AVX2's 16 vector registers at R = 4 */
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const wblock *wb = wr + b;
        __m256i w[8];  /* w[j]: codes of elements 4j .. 4j + 3 of every group, as xb->qs[32j:32j+32] */
        for (int p = 0; p < 4; p++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * p));
            w[p] = _mm256_and_si256(raw, low);
            w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wb->d));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wb->m));
        for (int r = 0; r < R; r++) {
            const xblock *xb = x + r * B + b;
            __m256i s = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_add_epi16(PRODUCT(0), PRODUCT(1)), _mm256_add_epi16(PRODUCT(2), PRODUCT(3))),
                _mm256_add_epi16(_mm256_add_epi16(PRODUCT(4), PRODUCT(5)), _mm256_add_epi16(PRODUCT(6), PRODUCT(7))));
            __m256 g = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));  /* [8]: group l's integer sum */
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_loadu_ps(xb->d)), g, acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xb->s), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) put(o, r0 + r, n, hsum(acc[r]));
}

/* x @ W.T into o: w [N, K/256] blocks, x [M, K/256] blocks (q8_blocks); rows of W split over threads, 4
   activation rows at a time per weight row. */
AVX2 static void q4_matmul_avx2(const wblock *w, const xblock *x, int64_t M, int64_t N, int64_t K, const sink *o,
                                int threads) {
    int64_t B = K / 256;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const wblock *wn = w + n * B;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) rows(wn, x + r * B, B, o, r, n, 4);
        switch (M - r) {
        case 3: rows(wn, x + r * B, B, o, r, n, 3); break;
        case 2: rows(wn, x + r * B, B, o, r, n, 2); break;
        case 1: rows(wn, x + r * B, B, o, r, n, 1); break;
        }
    }
}
#endif

static float half_to_float(uint16_t h) {
    int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f = exp == 0 ? ldexpf((float)man, -24)
              : exp == 31 ? (man ? NAN : INFINITY) : ldexpf((float)(man | 0x400), exp - 25);
    return (h >> 15) ? -f : f;
}

/* What q4_matmul_avx2 computes, one group at a time in plain C (any CPU). */
static void q4_matmul_portable(const wblock *w, const xblock *x, int64_t M, int64_t N, int64_t K, const sink *o,
                               int threads) {
    int64_t B = K / 256;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.f;
            for (int64_t b = 0; b < B; b++) {
                const wblock *wb = w + n * B + b;
                const xblock *xb = x + r * B + b;
                for (int g = 0; g < 8; g++) {
                    int sum = 0;
                    for (int j = 0; j < 32; j++) {
                        uint8_t byte = wb->qs[32 * ((j % 16) / 4) + 4 * g + j % 4];
                        sum += (j < 16 ? byte & 15 : byte >> 4) * xb->qs[32 * (j / 4) + 4 * g + j % 4];
                    }
                    acc += half_to_float(wb->d[g]) * xb->d[g] * (float)sum + half_to_float(wb->m[g]) * xb->s[g];
                }
            }
            put(o, r, n, acc);
        }
    }
}

/* y [M, N] = x [M, K_in] @ W.T (+ bias [N] float32, or NULL): w [N, K/256] blocks (K a multiple of 256, K_in <= K);
   x float32, or bfloat16 where x_bf16; y float32, or bfloat16 where y_bf16. The AVX2 kernel where the CPU has it
   and portable is 0, else the plain-C one. Returns 0, or -1 where the scratch buffer cannot be allocated. */
int q4_linear(const wblock *w, const void *x, int x_bf16, int64_t M, int64_t K_in, int64_t N, int64_t K,
              const float *bias, void *y, int y_bf16, int portable, int threads) {
    xblock *xq = malloc((size_t)(M * (K / 256)) * sizeof(xblock));
    if (!xq) return -1;
    q8_blocks(x, x_bf16, M, K_in, K, xq, threads);
    sink o = {y, y_bf16, bias, N};
#if defined(__x86_64__)
    if (q4_avx2() && !portable)
        q4_matmul_avx2(w, xq, M, N, K, &o, threads);
    else
#endif
        q4_matmul_portable(w, xq, M, N, K, &o, threads);
    free(xq);
    return 0;
}
