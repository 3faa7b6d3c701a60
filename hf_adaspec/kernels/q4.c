/* Block-quantized weights times 8-bit activations: the GGUF file's own Q4_K, Q6_K and Q8_0 blocks, on AVX2.

Weights come in kinds, each a superblock of 256 input features of one output row (layouts below): Q4K (8 groups
of 32, w = d*sc*q - dmin*m, q in 0..15, 6-bit sc and m, fp16 d and dmin: llama.cpp's Q4_K with its scales
unpacked), Q6K (16 groups of 16, w = d*sc*(q - 32), q in 0..63, int8 sc, fp16 d: llama.cpp's Q6_K byte for byte)
and Q80 (8 groups of 32, w = d*q, int8 q, fp16 d: llama.cpp's Q8_0, 8 blocks side by side). Activations are
quantized per 256 features to int8 with one float scale dx (x = qx * dx) and the sums of qx per 16 (xblock, as
llama.cpp's Q8_K). A superblock's dot product is then integer arithmetic times one float: for Q4K,
dx * (d * sum_g sc_g * sum(q * qx) - dmin * sum_g m_g * sum_g(qx)); for Q6K, dx * d * (sum_g sc_g * sum(q * qx)
- 32 * sum_g sc_g * sum_g(qx)); for Q80 a float per group of 32. The integer products run on _mm256_maddubs_epi16
(unsigned 4/6-bit codes times signed int8; Q80 by the sign trick), scaled by _mm256_madd_epi16 with the group's
scale, so no weight is ever dequantized and no bit of the file is dropped.

A matrix is a list of segments (consecutive output rows of one kind), so fused layers whose rows differ in kind
(a Q4_K query beside a Q6_K value) are one call. Each weight superblock is loaded once per R <= 4 activation rows
(verification multiplies up to k + 1 rows). Output rows are split over threads.

The AVX2 kernels are compiled for AVX2, FMA and F16C by function attribute and run only where the CPU has them
(q4_avx2(), checked once); elsewhere (other CPUs, other architectures) the same integer arithmetic runs in plain C,
slowly, and gives the same result up to the order of float additions.

q4_linear is the one entry: it reads float32 or bfloat16 activations, quantizes them into a scratch buffer,
multiplies, adds the bias and writes float32 or bfloat16 (rounded to nearest even, as torch rounds), all in one
call: a layer's step costs one foreign call and no tensor operations around it. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

enum { Q4K = 0, Q6K = 1, Q80 = 2, KINDS = 3 };

/* 256 weights: qs[32c + j] holds element 64c + j in its low nibble and 64c + 32 + j in its high one (c = 0..3);
   group g (elements 32g .. 32g + 31) has scale d * sc[g] and minimum dmin * mn[g]. */
typedef struct { uint16_t d, dmin; uint8_t sc[8], mn[8]; uint8_t qs[128]; } q4k_block;
/* 256 weights in two halves of 128 (h = 0, 1): for l = 0..31, element 128h + l is the low nibble of ql[64h + l]
   with bits 0-1 of qh[32h + l] above it; + 32: ql[64h + 32 + l] and bits 2-3; + 64: the high nibble of
   ql[64h + l] and bits 4-5; + 96: the high nibble of ql[64h + 32 + l] and bits 6-7. Group g of 16 has d * sc[g]. */
typedef struct { uint8_t ql[128], qh[64]; int8_t sc[16]; uint16_t d; } q6k_block;
/* 256 weights: element 32g + j is d[g] * qs[32g + j]. */
typedef struct { uint16_t d[8]; int8_t qs[256]; } q80_block;
/* 256 activations: x = qs * d; bsums[j] = the sum of qs[16j .. 16j + 15]. */
typedef struct { int8_t qs[256]; int16_t bsums[16]; float d; } xblock;

static const int BLOCK_BYTES[KINDS] = {(int)sizeof(q4k_block), (int)sizeof(q6k_block), (int)sizeof(q80_block)};

/* 1 where the AVX2 kernels run on this CPU, else 0. */
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

/* Bytes of one superblock of ``kind`` (-1 for an unknown kind); of an activation block where kind is -1. */
int q4_block_bytes(int kind) {
    if (kind == -1) return (int)sizeof(xblock);
    return kind >= 0 && kind < KINDS ? BLOCK_BYTES[kind] : -1;
}

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

static float half_to_float(uint16_t h) {
    int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f = exp == 0 ? ldexpf((float)man, -24)
              : exp == 31 ? (man ? NAN : INFINITY) : ldexpf((float)(man | 0x400), exp - 25);
    return (h >> 15) ? -f : f;
}

/* One block of 256 activations (v, features past the input already zero) to int8: scale max|v| / 127, each
   value times 127 / max|v| rounded to nearest even (lrintf, as _mm256_cvtps_epi32 rounds). */
static void quantize_block(const float *v, xblock *o) {
    float amax = 0.f;
    for (int j = 0; j < 256; j++) amax = fmaxf(amax, fabsf(v[j]));
    float id = amax > 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < 256; j++) o->qs[j] = (int8_t)lrintf(v[j] * id);
    for (int j = 0; j < 16; j++) {
        int s = 0;
        for (int e = 0; e < 16; e++) s += o->qs[16 * j + e];
        o->bsums[j] = (int16_t)s;
    }
    o->d = amax / 127.f;
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
        quantize_block(v, out + i);
    }
}

/* Where a result goes: y [M, N] float32, or bfloat16 where bf16; plus bias [N] (float32) when given. */
typedef struct { void *y; int bf16; const float *bias; int64_t N; } sink;

static inline void put(const sink *o, int64_t r, int64_t n, float v) {
    if (o->bias) v += o->bias[n];
    if (o->bf16) ((uint16_t *)o->y)[r * o->N + n] = float_to_bf16(v);
    else ((float *)o->y)[r * o->N + n] = v;
}

/* ---- plain C: one superblock of one weight row with one activation row ---- */

static float dot_q4k(const q4k_block *w, const xblock *x) {
    int32_t sum = 0, mins = 0;
    for (int g = 0; g < 8; g++) {
        int32_t s = 0;
        for (int j = 0; j < 32; j++) {
            uint8_t byte = w->qs[32 * (g / 2) + j];
            s += (g % 2 ? byte >> 4 : byte & 15) * x->qs[32 * g + j];
        }
        sum += w->sc[g] * s;
        mins += w->mn[g] * (x->bsums[2 * g] + x->bsums[2 * g + 1]);
    }
    return x->d * (half_to_float(w->d) * (float)sum - half_to_float(w->dmin) * (float)mins);
}

static float dot_q6k(const q6k_block *w, const xblock *x) {
    int32_t sum = 0, offset = 0;
    for (int e = 0; e < 256; e++) {
        int h = e / 128, l = e % 32, quarter = (e % 128) / 32;
        uint8_t low = w->ql[64 * h + 32 * (quarter % 2) + l];
        int q = (quarter < 2 ? low & 15 : low >> 4) | (((w->qh[32 * h + l] >> (2 * quarter)) & 3) << 4);
        sum += w->sc[e / 16] * q * x->qs[e];
    }
    for (int g = 0; g < 16; g++) offset += w->sc[g] * x->bsums[g];
    return x->d * half_to_float(w->d) * (float)(sum - 32 * offset);
}

static float dot_q80(const q80_block *w, const xblock *x) {
    float acc = 0.f;
    for (int g = 0; g < 8; g++) {
        int32_t s = 0;
        for (int j = 0; j < 32; j++) s += w->qs[32 * g + j] * x->qs[32 * g + j];
        acc += half_to_float(w->d[g]) * (float)s;
    }
    return x->d * acc;
}

static float dot_portable(int kind, const uint8_t *w, const xblock *x, int64_t B) {
    float acc = 0.f;
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *wb = w + b * BLOCK_BYTES[kind];
        acc += kind == Q4K ? dot_q4k((const q4k_block *)wb, x + b)
               : kind == Q6K ? dot_q6k((const q6k_block *)wb, x + b) : dot_q80((const q80_block *)wb, x + b);
    }
    return acc;
}

#if defined(__x86_64__)
AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define XQ(r, off) _mm256_loadu_si256((const __m256i *)(x[(r) * B + b].qs + (off)))

/* acc[r] += weight row w ([B] Q4K blocks) . activation row r (x [R, B] blocks), per lane. */
AVX2 static inline void rows_q4k(const q4k_block *w, const xblock *x, int64_t B, __m256 *acc, const int R) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < B; b++) {
        const q4k_block *wb = w + b;
        __m256i sum[4];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        __m256i sc = _mm256_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)wb->sc));  /* [16]: 8 scales, 8 zeros */
        __m256i scales = _mm256_permute2x128_si256(sc, sc, 0);  /* both halves: sc[0..7] as int16 */
        for (int c = 0; c < 4; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * c));
            __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            /* int16 sc[2c], sc[2c + 1] in every lane: shuffle bytes 4c, 4c + 1 (and 4c + 2, 4c + 3) everywhere */
            __m256i s_lo = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * c + 1) << 8 | 4 * c)));
            __m256i s_hi = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * c + 3) << 8 | (4 * c + 2))));
            for (int r = 0; r < R; r++) {
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, XQ(r, 64 * c)), s_lo);
                p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, XQ(r, 64 * c + 32)), s_hi));
                sum[r] = _mm256_add_epi32(sum[r], p);
            }
        }
        /* minima: m_g against the sums of 16 activations 2g and 2g + 1 */
        __m128i mn = _mm_loadl_epi64((const __m128i *)wb->mn);
        __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn));  /* [16]: m0 m0 m1 m1 ... */
        __m256 d = _mm256_set1_ps(_cvtsh_ss(wb->d)), dmin = _mm256_set1_ps(_cvtsh_ss(wb->dmin));
        for (int r = 0; r < R; r++) {
            const xblock *xb = x + r * B + b;
            __m256 dx = _mm256_set1_ps(xb->d);
            __m256i m = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)xb->bsums));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sum[r]), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(m), acc[r]);
        }
    }
}

/* acc[r] += weight row w ([B] Q6K blocks) . activation row r, per lane. */
AVX2 static inline void rows_q6k(const q6k_block *w, const xblock *x, int64_t B, __m256 *acc, const int R) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    for (int64_t b = 0; b < B; b++) {
        const q6k_block *wb = w + b;
        __m256i sum[4];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        __m128i sc = _mm_loadu_si128((const __m128i *)wb->sc);
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(wb->ql + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(wb->ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(wb->qh + 32 * h));
            for (int v = 0; v < 4; v++) {
                __m256i q;  /* codes of elements 128h + 32v .. + 31 (0..63) */
                switch (v) {
                case 0: q = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two)); break;
                case 1: q = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two)); break;
                case 2: q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, two)); break;
                default: q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), two));
                }
                int g = 8 * h + 2 * v;  /* int16 sc[g] in lanes 0-7, sc[g + 1] in lanes 8-15 */
                __m128i pick = _mm_unpacklo_epi64(_mm_set1_epi8((char)g), _mm_set1_epi8((char)(g + 1)));
                __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, pick));
                for (int r = 0; r < R; r++)
                    sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, XQ(r, 128 * h + 32 * v)), s));
            }
        }
        __m256i sc16 = _mm256_cvtepi8_epi16(sc);
        __m256 d = _mm256_set1_ps(_cvtsh_ss(wb->d));
        for (int r = 0; r < R; r++) {
            const xblock *xb = x + r * B + b;
            __m256i offset = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)xb->bsums));
            __m256i s = _mm256_sub_epi32(sum[r], _mm256_slli_epi32(offset, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb->d)), _mm256_cvtepi32_ps(s), acc[r]);
        }
    }
}

/* acc[r] += weight row w ([B] Q80 blocks) . activation row r, per lane. */
AVX2 static inline void rows_q80(const q80_block *w, const xblock *x, int64_t B, __m256 *acc, const int R) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < B; b++) {
        const q80_block *wb = w + b;
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wb->d));
        __m256 part[4];
        for (int r = 0; r < R; r++) part[r] = _mm256_setzero_ps();
        for (int g = 0; g < 8; g++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * g)), aq = _mm256_abs_epi8(q);
            __m256 dg = _mm256_permutevar8x32_ps(dw, _mm256_set1_epi32(g));
            for (int r = 0; r < R; r++) {
                __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(XQ(r, 32 * g), q));
                part[r] = _mm256_fmadd_ps(dg, _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), part[r]);
            }
        }
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * B + b].d), part[r], acc[r]);
    }
}

/* Results (r0 + r, n), r < R: weight row w (kind, [B] blocks) . activation rows x [R, B]. */
AVX2 static inline void rows_avx2(int kind, const uint8_t *w, const xblock *x, int64_t B, const sink *o, int64_t r0,
                                  int64_t n, const int R) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    switch (kind) {
    case Q4K: rows_q4k((const q4k_block *)w, x, B, acc, R); break;
    case Q6K: rows_q6k((const q6k_block *)w, x, B, acc, R); break;
    default: rows_q80((const q80_block *)w, x, B, acc, R);
    }
    for (int r = 0; r < R; r++) put(o, r0 + r, n, hsum(acc[r]));
}

AVX2 static void row_avx2(int kind, const uint8_t *w, const xblock *x, int64_t M, int64_t B, const sink *o, int64_t n) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) rows_avx2(kind, w, x + r * B, B, o, r, n, 4);
    switch (M - r) {
    case 3: rows_avx2(kind, w, x + r * B, B, o, r, n, 3); break;
    case 2: rows_avx2(kind, w, x + r * B, B, o, r, n, 2); break;
    case 1: rows_avx2(kind, w, x + r * B, B, o, r, n, 1); break;
    }
}
#endif

/* One superblock of kind to 256 floats, each computed as gguf.quants computes it: (d * sc) * q - dmin * m for
   Q4K, (d * sc) * (q - 32) for Q6K, d * q for Q80 (float32, no fused multiply-add: -std=c11 contracts nothing). */
static void dequant_block(int kind, const uint8_t *w, float *v) {
    if (kind == Q4K) {
        const q4k_block *b = (const q4k_block *)w;
        float d = half_to_float(b->d), dmin = half_to_float(b->dmin);
        for (int e = 0; e < 256; e++) {
            int g = e / 32;
            uint8_t byte = b->qs[32 * (g / 2) + e % 32];
            float scale = d * (float)b->sc[g], minimum = dmin * (float)b->mn[g];
            v[e] = scale * (float)(g % 2 ? byte >> 4 : byte & 15) - minimum;
        }
    } else if (kind == Q6K) {
        const q6k_block *b = (const q6k_block *)w;
        float d = half_to_float(b->d);
        for (int e = 0; e < 256; e++) {
            int h = e / 128, l = e % 32, quarter = (e % 128) / 32;
            uint8_t low = b->ql[64 * h + 32 * (quarter % 2) + l];
            int q = (quarter < 2 ? low & 15 : low >> 4) | (((b->qh[32 * h + l] >> (2 * quarter)) & 3) << 4);
            v[e] = d * (float)b->sc[e / 16] * (float)(q - 32);
        }
    } else {
        const q80_block *b = (const q80_block *)w;
        for (int e = 0; e < 256; e++) v[e] = half_to_float(b->d[e / 32]) * (float)b->qs[e];
    }
}

/* out [N, K_out] (float32, or bfloat16 where bf16, rounded to nearest even) = the first K_out features of N rows of
   kind (K/256 blocks each). Returns 0, or -2 for an unknown kind. */
int q4_dequantize(int kind, const uint8_t *w, int64_t N, int64_t K, int64_t K_out, void *out, int bf16, int threads) {
    if (kind < 0 || kind >= KINDS) return -2;
    int64_t B = K / 256;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float v[256];
        for (int64_t b = 0; b < B; b++) {
            dequant_block(kind, w + (n * B + b) * BLOCK_BYTES[kind], v);
            for (int e = 0; e < 256 && b * 256 + e < K_out; e++) {
                int64_t at = n * K_out + b * 256 + e;
                if (bf16) ((uint16_t *)out)[at] = float_to_bf16(v[e]);
                else ((float *)out)[at] = v[e];
            }
        }
    }
    return 0;
}

/* y [M, N] = x [M, K_in] @ W.T (+ bias [N] float32, or NULL). W: nseg segments, segment s holding rows[s] output
   rows of kinds[s] (K/256 blocks each, K a multiple of 256, K_in <= K), stored one after another from w.
   x float32, or bfloat16 where x_bf16; y float32, or bfloat16 where y_bf16. The AVX2 kernels where the CPU has
   them and portable is 0, else plain C. Returns 0; -1 where the scratch buffer cannot be allocated; -2 for an
   unknown kind. */
int q4_linear(const uint8_t *w, const int32_t *kinds, const int64_t *rows, int nseg, const void *x, int x_bf16,
              int64_t M, int64_t K_in, int64_t K, const float *bias, void *y, int y_bf16, int portable, int threads) {
    enum { MAX_SEG = 16 };
    int64_t B = K / 256, first[MAX_SEG + 1], N = 0;
    const uint8_t *base[MAX_SEG];
    if (nseg < 1 || nseg > MAX_SEG) return -2;
    for (int s = 0; s < nseg; s++) {
        if (kinds[s] < 0 || kinds[s] >= KINDS) return -2;
        first[s] = N, base[s] = w;
        N += rows[s];
        w += rows[s] * B * BLOCK_BYTES[kinds[s]];
    }
    first[nseg] = N;
    xblock *xq = malloc((size_t)(M * B) * sizeof(xblock));
    if (!xq) return -1;
    q8_blocks(x, x_bf16, M, K_in, K, xq, threads);
    sink o = {y, y_bf16, bias, N};
    int fast = 0;
#if defined(__x86_64__)
    fast = q4_avx2() && !portable;
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int s = 0;
        while (n >= first[s + 1]) s++;
        int kind = kinds[s];
        const uint8_t *wn = base[s] + (n - first[s]) * B * BLOCK_BYTES[kind];
#if defined(__x86_64__)
        if (fast) {
            row_avx2(kind, wn, xq, M, B, &o, n);
            continue;
        }
#endif
        for (int64_t r = 0; r < M; r++) put(&o, r, n, dot_portable(kind, wn, xq + r * B, B));
    }
    free(xq);
    return 0;
}
