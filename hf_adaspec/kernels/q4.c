/* 4-bit weights times 8-bit activations on AVX2 (the Q4_1 x Q8_1 scheme of llama.cpp, in a layout of our own).

Weights: per output row, K/256 blocks of 8 groups of 32 input features; w = q * d + m, q in 0..15, with a
scale d and a minimum m (fp16) per group. Activations are quantized per group of 32 to int8 with a scale
dx (x = qx * dx) and sx = dx * sum(qx). A group's dot product is then d * dx * sum(q * qx) + m * sx, with the
integer sum on _mm256_maddubs_epi16. Layouts (see wblock / xblock) put the 8 groups' sums of a block in one
vector, in the group order 0 2 4 6 1 3 5 7 that two rounds of _mm256_hadd_epi32 leave them in.

The AVX2 kernel is compiled for AVX2, FMA and F16C by function attribute and runs only where the CPU has them
(q4_avx2(), checked once), so no caller executes an instruction its CPU lacks; elsewhere (other CPUs, other
architectures) q4_matmul runs q4_matmul_portable: the same integer arithmetic in plain C, slowly. */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

/* 256 weights: pair p (groups 2p, 2p+1) is qs[32p:32p+32]; its byte j holds element j%16 of group 2p + j/16
   in the low nibble and element 16 + j%16 in the high nibble. d, m in group order 0 2 4 6 1 3 5 7. */
typedef struct { uint8_t qs[128]; uint16_t d[8]; uint16_t m[8]; } wblock;
/* 256 activations: pair p is qs[64p:64p+64] = g0[0:16] g1[0:16] g0[16:32] g1[16:32]; d, s in 0 2 4 6 1 3 5 7. */
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

/* x [M, K] float32, K a multiple of 256 -> out [M, K/256] blocks. */
void q8_blocks(const float *x, int64_t M, int64_t K, xblock *out, int threads) {
    int64_t n = M * (K / 256);
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 64)
    for (int64_t i = 0; i < n; i++) {
        const float *v = x + i * 256;
        xblock *o = out + i;
        for (int g = 0; g < 8; g++) {
            const float *u = v + g * 32;
            float amax = 0.f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(u[j]));
            float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int8_t *q = o->qs + (g / 2) * 64 + (g % 2) * 16;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                int t = (int)lrintf(u[j] * id);
                sum += t;
                q[(j / 16) * 32 + (j % 16)] = (int8_t)t;
            }
            int slot = (g % 2) * 4 + g / 2;
            o->d[slot] = d;
            o->s[slot] = d * (float)sum;
        }
    }
}

#if defined(__x86_64__)
AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* int32 [8]: lanes 0-3 sum to group 2p's dot product, lanes 4-7 to group 2p + 1's. */
AVX2 static inline __m256i pair_dot(__m256i lo, __m256i hi, const int8_t *x) {
    __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                                 _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* y[r * N] = row r of x (R <= 4 rows, [R, B] blocks) . one weight row ([B] blocks). */
AVX2 static inline void rows(const wblock *w, const xblock *x, int64_t B, int64_t N, float *y, const int R) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[4];  /* with lo[4], hi[4]: 16 vector registers at R = 4, all AVX2 has */
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const wblock *wb = w + b;
        __m256i lo[4], hi[4];
        for (int p = 0; p < 4; p++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * p));
            lo[p] = _mm256_and_si256(raw, low);
            hi[p] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wb->d));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wb->m));
        for (int r = 0; r < R; r++) {
            const xblock *xb = x + r * B + b;
            __m256i v0 = pair_dot(lo[0], hi[0], xb->qs), v1 = pair_dot(lo[1], hi[1], xb->qs + 64);
            __m256i v2 = pair_dot(lo[2], hi[2], xb->qs + 128), v3 = pair_dot(lo[3], hi[3], xb->qs + 192);
            __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_loadu_ps(xb->d)), _mm256_cvtepi32_ps(h), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xb->s), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * N] = hsum(acc[r]);
}

/* y [M, N] float32 = x @ W.T: w [N, K/256] blocks, x [M, K/256] blocks (q8_blocks); rows of W split over
   threads, 4 activation rows at a time per weight row. */
AVX2 static void q4_matmul_avx2(const wblock *w, const xblock *x, int64_t M, int64_t N, int64_t K, float *y,
                                int threads) {
    int64_t B = K / 256;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const wblock *wn = w + n * B;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) rows(wn, x + r * B, B, N, y + r * N + n, 4);
        switch (M - r) {
        case 3: rows(wn, x + r * B, B, N, y + r * N + n, 3); break;
        case 2: rows(wn, x + r * B, B, N, y + r * N + n, 2); break;
        case 1: rows(wn, x + r * B, B, N, y + r * N + n, 1); break;
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

/* What q4_matmul computes, one group at a time in plain C (any CPU). */
void q4_matmul_portable(const wblock *w, const xblock *x, int64_t M, int64_t N, int64_t K, float *y, int threads) {
    int64_t B = K / 256;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.f;
            for (int64_t b = 0; b < B; b++) {
                const wblock *wb = w + n * B + b;
                const xblock *xb = x + r * B + b;
                for (int g = 0; g < 8; g++) {
                    int p = g / 2, odd = g % 2, slot = odd * 4 + p, sum = 0;
                    for (int j = 0; j < 32; j++) {
                        uint8_t byte = wb->qs[32 * p + 16 * odd + j % 16];
                        sum += (j < 16 ? byte & 15 : byte >> 4) * xb->qs[64 * p + (j / 16) * 32 + 16 * odd + j % 16];
                    }
                    acc += half_to_float(wb->d[slot]) * xb->d[slot] * (float)sum
                           + half_to_float(wb->m[slot]) * xb->s[slot];
                }
            }
            y[r * N + n] = acc;
        }
    }
}

/* y [M, N] float32 = x @ W.T: the AVX2 kernel where the CPU has it, else the portable one. */
void q4_matmul(const wblock *w, const xblock *x, int64_t M, int64_t N, int64_t K, float *y, int threads) {
#if defined(__x86_64__)
    if (q4_avx2()) {
        q4_matmul_avx2(w, x, M, N, K, y, threads);
        return;
    }
#endif
    q4_matmul_portable(w, x, M, N, K, y, threads);
}
