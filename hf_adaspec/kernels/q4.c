/* Block-quantized weights times 8-bit activations: the GGUF file's own Q4_K, Q6_K and Q8_0 blocks, on AVX2 and up.

Weights come in kinds, each a superblock of 256 input features of one output row: Q4K (8 groups of 32,
w = d*sc*q - dmin*m, q in 0..15, 6-bit sc and m, fp16 d and dmin: llama.cpp's Q4_K), Q6K (16 groups of 16,
w = d*sc*(q - 32), q in 0..63, int8 sc, fp16 d: llama.cpp's Q6_K) and Q80 (8 groups of 32, w = d*q, int8 q, fp16 d:
llama.cpp's Q8_0, 8 blocks side by side). Every value of the file is kept; only the order of the codes changes
(``blocks.py`` writes these layouts). Activations are quantized per 256 features to int8 with one float scale dx
(x = qx * dx) and the sums of qx per group of 32 (xblock, llama.cpp's Q8_K in our order).

The order (ours, not the file's: it saves the madds counted below): in each 32-byte vector j (j = 0..7) of a
superblock, 4-byte lane l holds elements 4j .. 4j + 3 of group l (group = 32 features), for weights and activations
alike. _mm256_maddubs_epi16 of a weight vector with an activation vector leaves group l's partial sums in int16 lanes
2l, 2l + 1, so the products of several vectors add up lane by lane in int16 and one _mm256_madd_epi16 with the groups'
scales (int16, lane pair l = group l's) finishes a superblock: per activation row, Q4K costs 8 maddubs and 1 madd per
256 weights (the natural order needs a madd per 32). Q4K's 4-bit codes times int8 sum to at most 8 * 2 * 15 * 127 =
30480 over the 8 vectors; Q6K's codes are made signed (q - 32, |q - 32| <= 32) and multiplied by the sign trick (|w|
times x with w's sign), 4 vectors (the first or second 16 of each group of 32) summing to at most 4 * 2 * 32 * 127 =
32512, one madd with the even and one with the odd 16-group scales; Q80 (|w| <= 128) takes a madd per vector. A
superblock's dot product is then integer sums times one float: dx * (d * sum_g sc_g * S_g - dmin * sum_g m_g * X_g)
for Q4K (X_g the activations' group sum), dx * d * sum sc * S for Q6K, dx * sum_g d_g * S_g for Q80.

The AVX-VNNI path (the 256-bit, VEX-encoded vpdpbusd: flag avx_vnni, Intel since Alder Lake with or without
AVX-512, AMD since Zen 5) is the AVX2 path's loops (ROWS256) with vpdpbusd in place of each maddubs-and-add: group
l's sum lands in int32 lane l exactly, then one mullo by the groups' int32 scales gives the integer the AVX2 path's
madd gives, so both paths give the same result bit for bit.

A matrix is a list of segments (consecutive output rows of one kind), so fused layers whose rows differ in kind
(a Q4_K query beside a Q6_K value) are one call. Each weight superblock is decoded once per R <= 4 activation
rows on the 256-bit paths (verification multiplies up to k + 1 rows). Output rows are split over threads; each thread requests its
weights a few kilobytes ahead of the superblock it multiplies (PREFETCH).

The VNNI path (AVX512F/BW/VL + AVX512-VNNI: Xeon since Cascade Lake, Zen 4 and later) multiplies with vpdpbusd,
which sums four u8 x s8 products into an int32 lane in one instruction, on 512-bit vectors: a zmm holds vectors
p and p + 4 of a superblock (lanes 0..7 group l's elements 4p..4p+3, lanes 8..15 its elements 16+4p..16+4p+3), so
4 vpdpbusd per row leave group l's sums in int32 lanes l and 8 + l, one scale vector per superblock ([d sc_l] twice
for Q4K, [d sce_l, d sco_l] for Q6K, [d_l] twice for Q80) finishes it in float. Activations are stored in that
pair order for this path (``pairs`` in quantize_block). vpdpbusd takes unsigned weights: Q6K's codes stay 0..63 and
Q80's are offset by 128, and each activation block carries its half-group sums (hs, 16 per 256 features) so that
32 hs (Q6K) or 128 hs (Q80) is subtracted per row: one int32 vector operation, no sign trick. Rows are taken 8
at a time (verification multiplies k + 1 <= 9 rows), so a weight superblock is decoded once per 8 activation rows.

The vector kernels are compiled by function attribute and run only where the CPU has their instructions
(q4_cpu_flags, checked once; NEEDS); the paths are numbered 0 plain C, 1 AVX2 (+ FMA + F16C), 2 AVX-VNNI, 3 VNNI
(AVX512), q4_isa() is the best this CPU runs, and q4_linear runs the fastest path at most its isa argument that the
CPU runs, so one CPU reproduces the older paths. Elsewhere (other CPUs, other architectures) the
same integer arithmetic runs in plain C, slowly; every path gives the same result up to the order of float
additions.

q4_linear is the one entry: it reads float32 or bfloat16 activations, quantizes them into a scratch buffer,
multiplies, adds the bias and writes float32 or bfloat16 (rounded to nearest even, as torch rounds), all in one
call: a layer's step costs one foreign call and no tensor operations around it. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"
#if defined(__x86_64__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c")))
/* AVX-VNNI (VEX vpdpbusd) needs gcc 11 or clang 12; an older compiler builds the other paths only. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define HAVE_AVXVNNI 1
#define AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#endif
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
/* inlined into each row count's caller, so that R is a constant and acc[] stays in registers */
#define VNNI_INLINE VNNI __attribute__((always_inline))
#endif

enum { Q4K = 0, Q6K = 1, Q80 = 2, KINDS = 3 };

/* Position of element t (0..31) of group l (0..7) in a superblock's 256 codes: vector t / 4, lane l. */
#define AT(l, t) (32 * ((t) / 4) + 4 * (l) + (t) % 4)
/* The VNNI path's activation order: vector j = t / 4 stored in slot 2 (j % 4) + j / 4, so vectors p and p + 4 are
   one 64-byte load. */
#define AT_PAIRS(l, t) (32 * (2 * (((t) / 4) % 4) + (t) / 16) + 4 * (l) + (t) % 4)
/* 256 weights: the code at position 32p + b (p = 0..3) is the low nibble of qs[32p + b], at 32(p + 4) + b its
   high nibble; group l has scale d * sc[l] and minimum dmin * mn[l]. */
typedef struct { uint16_t d, dmin; uint8_t sc[8], mn[8]; uint8_t qs[128]; } q4k_block;
/* 256 weights, codes 0..63: position 32j + b has low 4 bits from ql as Q4K's qs (p = j % 4, high nibble for
   j >= 4) and high 2 bits at bits 2(j / 2) of qh[32(j % 2) + b]; the first 16 of group l have scale d * sce[l],
   the second 16 d * sco[l]. */
typedef struct { uint8_t ql[128], qh[64]; int8_t sce[8], sco[8]; uint16_t d; } q6k_block;
/* 256 weights: position AT(l, t) holds d[l] * qs[AT(l, t)]. */
typedef struct { uint16_t d[8]; int8_t qs[256]; } q80_block;
/* 256 activations: x = qs * d in the positions above (AT_PAIRS on the VNNI path); bsum[l] = the sum of group l's
   qs, dsum[l] = d * bsum[l]; hs[l] and hs[8 + l] the sums of its first and second 16. */
typedef struct { int8_t qs[256]; int32_t hs[16]; float dsum[8]; int16_t bsum[8]; float d; } xblock;

static const int BLOCK_BYTES[KINDS] = {(int)sizeof(q4k_block), (int)sizeof(q6k_block), (int)sizeof(q80_block)};

/* The instructions the paths need, one bit each (q4.py's FLAGS, in this order), and each path's (PATHS: 0 plain C,
   1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI). */
enum { F_AVX2 = 1, F_FMA = 2, F_F16C = 4, F_AVXVNNI = 8, F_AVX512F = 16, F_AVX512BW = 32, F_AVX512VL = 64,
       F_AVX512VNNI = 128, F_BASE = F_AVX2 | F_FMA | F_F16C, PATHS = 4 };
static const int NEEDS[PATHS] = {0, F_BASE, F_BASE | F_AVXVNNI,
                                 F_BASE | F_AVX512F | F_AVX512BW | F_AVX512VL | F_AVX512VNNI};

/* The FLAGS bits this CPU has (checked once; avx_vnni only where this compiler builds its path; 0 off x86-64). */
int q4_cpu_flags(void) {
#if defined(__x86_64__)
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        int have = (!!__builtin_cpu_supports("avx2")) * F_AVX2 | (!!__builtin_cpu_supports("fma")) * F_FMA
                   | (!!__builtin_cpu_supports("f16c")) * F_F16C | (!!__builtin_cpu_supports("avx512f")) * F_AVX512F
                   | (!!__builtin_cpu_supports("avx512bw")) * F_AVX512BW
                   | (!!__builtin_cpu_supports("avx512vl")) * F_AVX512VL
                   | (!!__builtin_cpu_supports("avx512vnni")) * F_AVX512VNNI;
#if HAVE_AVXVNNI
        have |= (!!__builtin_cpu_supports("avxvnni")) * F_AVXVNNI;
#endif
        known = have;
    }
    return known;
#else
    return 0;
#endif
}

/* The fastest path at most isa whose instructions this CPU has (the paths are not nested: a CPU may have AVX512-VNNI
   and not AVX-VNNI). */
static int runnable(int isa) {
    int have = q4_cpu_flags(), p = isa < PATHS - 1 ? isa : PATHS - 1;
    while (p > 0 && (have & NEEDS[p]) != NEEDS[p]) p--;
    return p;
}

/* The best path this CPU runs (PATHS' numbering). */
int q4_isa(void) { return runnable(PATHS - 1); }

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
   value times 127 / max|v| rounded to nearest even (lrintf, as _mm256_cvtps_epi32 rounds); in pair order (AT_PAIRS)
   where pairs. */
static void quantize_block(const float *v, xblock *o, int pairs) {
    float amax = 0.f;
    for (int j = 0; j < 256; j++) amax = fmaxf(amax, fabsf(v[j]));
    float id = amax > 0.f ? 127.f / amax : 0.f;
    for (int l = 0; l < 8; l++) {
        int s[2] = {0, 0};
        for (int t = 0; t < 32; t++) {
            int q = (int)lrintf(v[32 * l + t] * id);
            o->qs[pairs ? AT_PAIRS(l, t) : AT(l, t)] = (int8_t)q;
            s[t / 16] += q;
        }
        o->hs[l] = s[0], o->hs[8 + l] = s[1];
        o->bsum[l] = (int16_t)(s[0] + s[1]);
    }
    o->d = amax / 127.f;
    for (int l = 0; l < 8; l++) o->dsum[l] = o->d * (float)o->bsum[l];
}

#if defined(__x86_64__)
/* quantize_block on AVX2: the same scale, codes (_mm256_cvtps_epi32 rounds to nearest even, as lrintf does under
   the default rounding mode) and sums for finite v. A group's 32 codes are packed to bytes in its natural order,
   then each 4-byte unit is stored where AT (or AT_PAIRS) puts it. */
AVX2 static void quantize_block_avx2(const float *v, xblock *o, int pairs) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < 256; j += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + j), magnitude), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    float id = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 scale = _mm256_set1_ps(id);
    const __m256i natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* the packs' unit order, undone */
    for (int l = 0; l < 8; l++) {
        const float *g = v + 32 * l;
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(g + 8 * i), scale));
        __m256i sums = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        sums = _mm256_hadd_epi32(sums, sums); /* per 128-bit lane: [first 16, second 16] of its halves */
        int32_t s[8];
        _mm256_storeu_si256((__m256i *)s, sums);
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        uint32_t unit[8];
        _mm256_storeu_si256((__m256i *)unit, _mm256_permutevar8x32_epi32(bytes, natural));
        for (int j = 0; j < 8; j++) memcpy(o->qs + (pairs ? AT_PAIRS(l, 4 * j) : AT(l, 4 * j)), unit + j, 4);
        o->hs[l] = s[0] + s[4], o->hs[8 + l] = s[1] + s[5];
        o->bsum[l] = (int16_t)(o->hs[l] + o->hs[8 + l]);
    }
    o->d = amax / 127.f;
    for (int l = 0; l < 8; l++) o->dsum[l] = o->d * (float)o->bsum[l];
}
#endif

/* x [M, K_in] (float32, or bfloat16 where bf16) -> out [M, K/256] blocks; features K_in .. K are zeros. The
   vector paths (path >= 1) quantize with AVX2, the VNNI path (3) in pair order. */
static void q8_blocks(const void *x, int bf16, int64_t M, int64_t K_in, int64_t K, xblock *out, int path,
                      int threads) {
    int64_t nb = K / 256, n = M * nb;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 64)
    for (int64_t i = 0; i < n; i++) {
        int64_t row = i / nb, first = (i % nb) * 256, valid = K_in - first < 256 ? K_in - first : 256;
        float v[256];
        if (bf16)
            for (int64_t j = 0; j < valid; j++) v[j] = bf16_to_float(((const uint16_t *)x)[row * K_in + first + j]);
        else
            memcpy(v, (const float *)x + row * K_in + first, (size_t)(valid > 0 ? valid : 0) * sizeof(float));
        for (int64_t j = valid > 0 ? valid : 0; j < 256; j++) v[j] = 0.f;
#if defined(__x86_64__)
        if (path >= 1) {
            quantize_block_avx2(v, out + i, path == 3);
            continue;
        }
#endif
        quantize_block(v, out + i, path == 3);
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

/* Code at position i of a Q4K or Q6K superblock. */
static int code_q4k(const q4k_block *w, int i) {
    uint8_t byte = w->qs[32 * ((i / 32) % 4) + i % 32];
    return i < 128 ? byte & 15 : byte >> 4;
}

static int code_q6k(const q6k_block *w, int i) {
    int j = i / 32, b = i % 32;
    uint8_t byte = w->ql[32 * (j % 4) + b];
    return (j < 4 ? byte & 15 : byte >> 4) | (((w->qh[32 * (j % 2) + b] >> (2 * (j / 2))) & 3) << 4);
}

static float dot_q4k(const q4k_block *w, const xblock *x) {
    int32_t sum = 0, mins = 0;
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int t = 0; t < 32; t++) s += code_q4k(w, AT(l, t)) * x->qs[AT(l, t)];
        sum += w->sc[l] * s;
        mins += w->mn[l] * x->bsum[l];
    }
    return x->d * (half_to_float(w->d) * (float)sum - half_to_float(w->dmin) * (float)mins);
}

static float dot_q6k(const q6k_block *w, const xblock *x) {
    int32_t sum = 0;
    for (int l = 0; l < 8; l++)
        for (int t = 0; t < 32; t++)
            sum += (t < 16 ? w->sce[l] : w->sco[l]) * (code_q6k(w, AT(l, t)) - 32) * x->qs[AT(l, t)];
    return x->d * half_to_float(w->d) * (float)sum;
}

static float dot_q80(const q80_block *w, const xblock *x) {
    float acc = 0.f;
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int t = 0; t < 32; t++) s += w->qs[AT(l, t)] * x->qs[AT(l, t)];
        acc += half_to_float(w->d[l]) * (float)s;
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

/* Each thread reads its output rows' weights as one forward stream, and a product over few activation rows waits on
   that stream: every superblock's bytes AHEAD bytes further on are requested into L2 (_MM_HINT_T1) as it is
   multiplied, which the hardware prefetcher alone does not keep up with. */
#define AHEAD 4096
#define PREFETCH(wb) do { for (int o_ = 0; o_ < (int)sizeof(*(wb)); o_ += 64) \
    _mm_prefetch((const char *)(wb) + AHEAD + o_, _MM_HINT_T1); } while (0)

/* int16 [16]: v[0..7] each twice (lane pair l holds v[l]), zero- or sign-extended. */
AVX2 static inline __m256i pairs_u8(const uint8_t *v) {
    __m128i b = _mm_loadl_epi64((const __m128i *)v);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b, b));
}
AVX2 static inline __m256i pairs_i8(const int8_t *v) {
    __m128i b = _mm_loadl_epi64((const __m128i *)v);
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b, b));
}

/* ---- AVX2 and AVX-VNNI: 256-bit vectors, activations in position order, up to 4 rows a pass ----

   One set of loops (ROWS256, written out once per path with its target attribute and suffix) over each path's
   helpers, which sum a superblock's u8 x s8 products into its groups' int32 lanes times their scales:
   - AVX2 (_avx2): _mm256_maddubs_epi16 into int16 lane pairs, added in int16 (exact: the bounds above), one
     _mm256_madd_epi16 with the groups' scales as int16 pairs; Q6K and Q80 by the sign trick.
   - AVX-VNNI (_avxvnni; VEX-encoded 256-bit vpdpbusd, flag avx_vnni: Intel since Alder Lake, AMD since Zen 5, also
     where AVX-512 is absent): _mm256_dpbusd_avx_epi32 sums four products into each int32 lane, so group l's sum
     lands in lane l without an int16 step (no saturation bound to keep), then one _mm256_mullo_epi32 with the
     int32 scales. Q6K's codes stay unsigned (0..63) and 32 hs of the half is subtracted, no sign trick; Q80 keeps
     the sign trick (|q| <= 128 is a u8).
   Both give each lane the same integer sc_l S_l and apply the same float operations to it, so the two paths'
   results are equal bit for bit. */

#define XV(xb, j) _mm256_loadu_si256((const __m256i *)((xb)->qs + 32 * (j)))
#define AVX2_INLINE AVX2 __attribute__((always_inline))

/* A Q4K superblock's codes, q[j] those of vector j. */
AVX2_INLINE static inline void q4k_codes(const q4k_block *wb, __m256i q[8]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * p));
        q[p] = _mm256_and_si256(raw, low);
        q[p + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
}

/* A Q6K superblock's codes 0..63 of vectors 4 half .. 4 half + 3 (the first or second 16 of each group), c[p] those
   of vector 4 half + p: its high 2 bits at bits 2 (2 half + p / 2) of qh[32 (p % 2) + .], moved to bits 4, 5. */
AVX2_INLINE static inline void q6k_codes(const q6k_block *wb, int half, __m256i c[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    for (int p = 0; p < 4; p++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(wb->ql + 32 * p));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(wb->qh + 32 * (p % 2)));
        int at = 4 * half + 2 * (p / 2);
        __m256i high = at == 0 ? _mm256_slli_epi16(qh, 4) : at == 2 ? _mm256_slli_epi16(qh, 2)
                       : at == 4 ? qh : _mm256_srli_epi16(qh, 2);
        __m256i nib = half ? _mm256_srli_epi16(raw, 4) : raw;
        c[p] = _mm256_or_si256(_mm256_and_si256(nib, low), _mm256_and_si256(high, top));
    }
}

/* AVX2: int32 [8], lane l sc_l times group l's sum of q[j] x[j] (scales: pairs_u8 of sc). */
AVX2_INLINE static inline __m256i q4k_dot_avx2(const __m256i q[8], const xblock *xb, __m256i sc) {
    __m256i s[4];
    for (int i = 0; i < 4; i++)
        s[i] = _mm256_add_epi16(_mm256_maddubs_epi16(q[2 * i], XV(xb, 2 * i)),
                                _mm256_maddubs_epi16(q[2 * i + 1], XV(xb, 2 * i + 1)));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(s[0], s[1]), _mm256_add_epi16(s[2], s[3])), sc);
}

/* AVX2: Q6K vectors 4 half .. 4 half + 3 prepared once per superblock: c[p] signed (q - 32), u[p] = |c[p]|. */
AVX2_INLINE static inline void q6k_prep_avx2(__m256i c[4], __m256i u[4]) {
    for (int p = 0; p < 4; p++) c[p] = _mm256_sub_epi8(c[p], _mm256_set1_epi8(32)), u[p] = _mm256_abs_epi8(c[p]);
}

/* AVX2: int32 [8], lane l sc_l times the sum of (q - 32) x over the half's 16 elements of group l (sign trick). */
AVX2_INLINE static inline __m256i q6k_dot_avx2(const __m256i c[4], const __m256i u[4], const xblock *xb, int half,
                                               __m256i sc) {
    __m256i s[4];
    for (int p = 0; p < 4; p++) s[p] = _mm256_maddubs_epi16(u[p], _mm256_sign_epi8(XV(xb, 4 * half + p), c[p]));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(s[0], s[1]), _mm256_add_epi16(s[2], s[3])), sc);
}

/* AVX2: sum + per int32 lane the four products |q| * (x with q's sign). */
AVX2_INLINE static inline __m256i q80_add_avx2(__m256i sum, __m256i aq, __m256i sx) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), _mm256_set1_epi16(1)));
}

/* AVX2: group scales (int8 or uint8 v[0..7], signed where sign) as int16 lane pairs, madd's second operand. */
AVX2_INLINE static inline __m256i scales_avx2(const void *v, const int sign) {
    return sign ? pairs_i8((const int8_t *)v) : pairs_u8((const uint8_t *)v);
}

#if HAVE_AVXVNNI
#define AVXVNNI_INLINE AVXVNNI __attribute__((always_inline))

/* AVX-VNNI: as q4k_dot_avx2, the group sums exact in int32 (scales: int32). */
AVXVNNI_INLINE static inline __m256i q4k_dot_avxvnni(const __m256i q[8], const xblock *xb, __m256i sc) {
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  /* two chains: vectors 0..3 and 4..7 */
    for (int j = 0; j < 4; j++)
        s[0] = _mm256_dpbusd_avx_epi32(s[0], q[j], XV(xb, j)), s[1] = _mm256_dpbusd_avx_epi32(s[1], q[j + 4], XV(xb, j + 4));
    return _mm256_mullo_epi32(_mm256_add_epi32(s[0], s[1]), sc);
}

/* AVX-VNNI: codes stay unsigned; u = c. */
AVXVNNI_INLINE static inline void q6k_prep_avxvnni(__m256i c[4], __m256i u[4]) {
    for (int p = 0; p < 4; p++) u[p] = c[p];
}

/* AVX-VNNI: as q6k_dot_avx2, from unsigned codes: sum q x - 32 hs (the half's activation sums). */
AVXVNNI_INLINE static inline __m256i q6k_dot_avxvnni(const __m256i c[4], const __m256i u[4], const xblock *xb,
                                                     int half, __m256i sc) {
    (void)c;
    __m256i s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u[0], XV(xb, 4 * half));
    for (int p = 1; p < 4; p++) s = _mm256_dpbusd_avx_epi32(s, u[p], XV(xb, 4 * half + p));
    __m256i hs = _mm256_loadu_si256((const __m256i *)(xb->hs + 8 * half));
    return _mm256_mullo_epi32(_mm256_sub_epi32(s, _mm256_slli_epi32(hs, 5)), sc);
}

AVXVNNI_INLINE static inline __m256i q80_add_avxvnni(__m256i sum, __m256i aq, __m256i sx) {
    return _mm256_dpbusd_avx_epi32(sum, aq, sx);
}

/* AVX-VNNI: group scales as int32 [8]. */
AVXVNNI_INLINE static inline __m256i scales_avxvnni(const void *v, const int sign) {
    __m128i b = _mm_loadl_epi64((const __m128i *)v);
    return sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}
#endif

/* The 256-bit loops of path SFX (ATTR: its target attribute; its helpers above carry the suffix):
   rows_q4k, rows_q6k, rows_q80 SFX: acc[r] += weight row w ([B] blocks) . activation row r (x [R, B]), per lane;
   rows SFX: results (r0 + r, n), r < R, of weight row w (kind); row SFX: results (0 .. M - 1, n), 4 rows a pass. */
#define ROWS256(SFX, ATTR) \
ATTR __attribute__((always_inline)) static inline void rows_q4k##SFX(const q4k_block *w, const xblock *x, int64_t B, \
                                                                    __m256 *acc, const int R) { \
    for (int64_t b = 0; b < B; b++) { \
        const q4k_block *wb = w + b; \
        PREFETCH(wb); \
        __m256i q[8], sc = scales##SFX(wb->sc, 0); \
        q4k_codes(wb, q); \
        __m128i mn = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)wb->mn));  /* int16 m_0 .. m_7 */ \
        __m256 d = _mm256_set1_ps(_cvtsh_ss(wb->d)), dmin = _mm256_set1_ps(_cvtsh_ss(wb->dmin)); \
        for (int r = 0; r < R; r++) { \
            const xblock *xb = x + r * B + b; \
            __m128i m = _mm_madd_epi16(mn, _mm_loadu_si128((const __m128i *)xb->bsum));  /* sum: sum m_l X_l */ \
            __m256 dx = _mm256_set1_ps(xb->d); \
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(q4k_dot##SFX(q, xb, sc)), acc[r]); \
            acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), \
                                      _mm256_cvtepi32_ps(_mm256_set_m128i(_mm_setzero_si128(), m)), acc[r]); \
        } \
    } \
} \
ATTR __attribute__((always_inline)) static inline void rows_q6k##SFX(const q6k_block *w, const xblock *x, int64_t B, \
                                                                    __m256 *acc, const int R) { \
    for (int64_t b = 0; b < B; b++) { \
        const q6k_block *wb = w + b; \
        PREFETCH(wb); \
        __m256 d = _mm256_set1_ps(_cvtsh_ss(wb->d)); \
        for (int half = 0; half < 2; half++) { \
            __m256i c[4], u[4], sc = scales##SFX(half ? wb->sco : wb->sce, 1); \
            q6k_codes(wb, half, c); \
            q6k_prep##SFX(c, u); \
            for (int r = 0; r < R; r++) { \
                __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x[r * B + b].d)); \
                __m256i s = q6k_dot##SFX(c, u, x + r * B + b, half, sc); \
                acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc[r]); \
            } \
        } \
    } \
} \
ATTR __attribute__((always_inline)) static inline void rows_q80##SFX(const q80_block *w, const xblock *x, int64_t B, \
                                                                    __m256 *acc, const int R) { \
    for (int64_t b = 0; b < B; b++) { \
        const q80_block *wb = w + b; \
        PREFETCH(wb); \
        __m256i sum[4]; \
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256(); \
        for (int j = 0; j < 8; j++) { \
            __m256i q = _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * j)), aq = _mm256_abs_epi8(q); \
            for (int r = 0; r < R; r++) \
                sum[r] = q80_add##SFX(sum[r], aq, _mm256_sign_epi8(XV(x + r * B + b, j), q)); \
        } \
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wb->d));  /* lane l: group l's scale */ \
        for (int r = 0; r < R; r++) \
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x[r * B + b].d)), _mm256_cvtepi32_ps(sum[r]), \
                                     acc[r]); \
    } \
} \
ATTR __attribute__((always_inline)) static inline void rows##SFX(int kind, const uint8_t *w, const xblock *x, \
                                                                int64_t B, const sink *o, int64_t r0, int64_t n, \
                                                                const int R) { \
    __m256 acc[4]; \
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(); \
    switch (kind) { \
    case Q4K: rows_q4k##SFX((const q4k_block *)w, x, B, acc, R); break; \
    case Q6K: rows_q6k##SFX((const q6k_block *)w, x, B, acc, R); break; \
    default: rows_q80##SFX((const q80_block *)w, x, B, acc, R); \
    } \
    for (int r = 0; r < R; r++) put(o, r0 + r, n, hsum(acc[r])); \
} \
ATTR static void row##SFX(int kind, const uint8_t *w, const xblock *x, int64_t M, int64_t B, const sink *o, \
                          int64_t n) { \
    int64_t r = 0; \
    for (; r + 4 <= M; r += 4) rows##SFX(kind, w, x + r * B, B, o, r, n, 4); \
    switch (M - r) { \
    case 3: rows##SFX(kind, w, x + r * B, B, o, r, n, 3); break; \
    case 2: rows##SFX(kind, w, x + r * B, B, o, r, n, 2); break; \
    case 1: rows##SFX(kind, w, x + r * B, B, o, r, n, 1); break; \
    } \
}

ROWS256(_avx2, AVX2)
#if HAVE_AVXVNNI
ROWS256(_avxvnni, AVXVNNI)
#endif

/* ---- VNNI: 512-bit vpdpbusd, activations in pair order, up to 8 rows a pass ---- */

#define XP(r, p) _mm512_loadu_si512((const void *)(x[(r) * B + b].qs + 64 * (p)))

/* The 32 bytes v[0..31] in both halves, the upper copy shifted right by 4 bits per byte, both masked to 4 bits: the
   low nibbles (vector p) in the lower half, the high nibbles (vector p + 4) in the upper. */
VNNI_INLINE static inline __m512i nibbles(const uint8_t *v) {
    const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)v));
    return _mm512_and_si512(_mm512_srlv_epi64(raw, shift), _mm512_set1_epi8(0x0F));
}

/* float [16]: the uint8 v[0..7] twice, times d. */
VNNI_INLINE static inline __m512 twice(const uint8_t *v, float d) {
    __m128i b = _mm_loadl_epi64((const __m128i *)v);
    return _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(b, b))));
}

VNNI_INLINE static inline __m512i dot4(const __m512i *q, const xblock *x, int64_t B, int64_t b, int r) {
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], XP(r, 0));
    s = _mm512_dpbusd_epi32(s, q[1], XP(r, 1));
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s, q[2], XP(r, 2)), q[3], XP(r, 3));
}

/* acc[r] += weight row w ([B] Q4K blocks) . activation row r, per lane; mins[r] += its minimum terms (dmin m_l
   times the activations' d X_l, lane l). */
VNNI_INLINE static inline void vrows_q4k(const q4k_block *w, const xblock *x, int64_t B, __m512 *acc, __m256 *mins,
                                  const int R) {
    for (int64_t b = 0; b < B; b++) {
        const q4k_block *wb = w + b;
        PREFETCH(wb);
        __m512i q[4];
        for (int p = 0; p < 4; p++) q[p] = nibbles(wb->qs + 32 * p);
        __m512 scale = twice(wb->sc, _cvtsh_ss(wb->d));
        __m256 dm = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(wb->dmin)),  /* dmin m_0 .. dmin m_7 */
                                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)wb->mn))));
        for (int r = 0; r < R; r++) {
            const xblock *xb = x + r * B + b;
            __m512i s = dot4(q, x, B, b, r);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(xb->d)), acc[r]);
            mins[r] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xb->dsum), mins[r]);
        }
    }
}

/* acc[r] += weight row w ([B] Q6K blocks) . activation row r, per lane: codes 0..63 unsigned, 32 hs subtracted. */
VNNI_INLINE static inline void vrows_q6k(const q6k_block *w, const xblock *x, int64_t B, __m512 *acc, const int R) {
    const __m512i top = _mm512_set1_epi8(0x30);
    for (int64_t b = 0; b < B; b++) {
        const q6k_block *wb = w + b;
        PREFETCH(wb);
        __m512i q[4];
        for (int p = 0; p < 4; p++) {  /* vector j's high 2 bits: bits 2 (j / 2) of qh[32 (j % 2) + .] */
            const __m512i shift = _mm512_set_epi64(2 * (p / 2) + 4, 2 * (p / 2) + 4, 2 * (p / 2) + 4, 2 * (p / 2) + 4,
                                                   2 * (p / 2), 2 * (p / 2), 2 * (p / 2), 2 * (p / 2));
            __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wb->qh + 32 * (p % 2))));
            __m512i high = _mm512_and_si512(_mm512_slli_epi64(_mm512_srlv_epi64(qh, shift), 4), top);
            q[p] = _mm512_or_si512(nibbles(wb->ql + 32 * p), high);
        }
        __m512 scale = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(wb->d)),  /* sce_0..7, sco_0..7 */
                                     _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)wb->sce))));
        for (int r = 0; r < R; r++) {
            const xblock *xb = x + r * B + b;
            __m512i s = _mm512_sub_epi32(dot4(q, x, B, b, r), _mm512_slli_epi32(_mm512_loadu_si512(xb->hs), 5));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(xb->d)), acc[r]);
        }
    }
}

/* acc[r] += weight row w ([B] Q80 blocks) . activation row r, per lane: codes offset to unsigned, 128 hs
   subtracted. */
VNNI_INLINE static inline void vrows_q80(const q80_block *w, const xblock *x, int64_t B, __m512 *acc, const int R) {
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < B; b++) {
        const q80_block *wb = w + b;
        PREFETCH(wb);
        __m512i q[4];
        for (int p = 0; p < 4; p++)
            q[p] = _mm512_xor_si512(offset, _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wb->qs + 32 * p))),
                _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * (p + 4))), 1));
        __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wb->d));
        __m512 scale = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(d8)));  /* d_0..7 twice */
        for (int r = 0; r < R; r++) {
            const xblock *xb = x + r * B + b;
            __m512i s = _mm512_sub_epi32(dot4(q, x, B, b, r), _mm512_slli_epi32(_mm512_loadu_si512(xb->hs), 7));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(xb->d)), acc[r]);
        }
    }
}

VNNI_INLINE static inline void rows_vnni(int kind, const uint8_t *w, const xblock *x, int64_t B, const sink *o, int64_t r0,
                                  int64_t n, const int R) {
    __m512 acc[8];
    __m256 mins[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), mins[r] = _mm256_setzero_ps();
    switch (kind) {
    case Q4K: vrows_q4k((const q4k_block *)w, x, B, acc, mins, R); break;
    case Q6K: vrows_q6k((const q6k_block *)w, x, B, acc, R); break;
    default: vrows_q80((const q80_block *)w, x, B, acc, R);
    }
    for (int r = 0; r < R; r++) put(o, r0 + r, n, _mm512_reduce_add_ps(acc[r]) - hsum(mins[r]));
}

VNNI static void row_vnni(int kind, const uint8_t *w, const xblock *x, int64_t M, int64_t B, const sink *o, int64_t n) {
    int64_t r = 0;
    for (; r + 8 <= M; r += 8) rows_vnni(kind, w, x + r * B, B, o, r, n, 8);
    switch (M - r) {
    case 7: rows_vnni(kind, w, x + r * B, B, o, r, n, 7); break;
    case 6: rows_vnni(kind, w, x + r * B, B, o, r, n, 6); break;
    case 5: rows_vnni(kind, w, x + r * B, B, o, r, n, 5); break;
    case 4: rows_vnni(kind, w, x + r * B, B, o, r, n, 4); break;
    case 3: rows_vnni(kind, w, x + r * B, B, o, r, n, 3); break;
    case 2: rows_vnni(kind, w, x + r * B, B, o, r, n, 2); break;
    case 1: rows_vnni(kind, w, x + r * B, B, o, r, n, 1); break;
    }
}
#endif

/* One superblock of kind to 256 floats in feature order, each computed as gguf.quants computes it:
   (d * sc) * q - dmin * m for Q4K, (d * sc) * (q - 32) for Q6K, d * q for Q80 (float32, no fused multiply-add:
   -std=c11 contracts nothing). */
static void dequant_block(int kind, const uint8_t *w, float *v) {
    for (int l = 0; l < 8; l++) {  /* a group's scale and minimum once, its 32 codes after */
        if (kind == Q4K) {
            const q4k_block *b = (const q4k_block *)w;
            float scale = half_to_float(b->d) * (float)b->sc[l], minimum = half_to_float(b->dmin) * (float)b->mn[l];
            for (int t = 0; t < 32; t++) v[32 * l + t] = scale * (float)code_q4k(b, AT(l, t)) - minimum;
        } else if (kind == Q6K) {
            const q6k_block *b = (const q6k_block *)w;
            float d = half_to_float(b->d), even = d * (float)b->sce[l], odd = d * (float)b->sco[l];
            for (int t = 0; t < 32; t++) v[32 * l + t] = (t < 16 ? even : odd) * (float)(code_q6k(b, AT(l, t)) - 32);
        } else {
            const q80_block *b = (const q80_block *)w;
            float d = half_to_float(b->d[l]);
            for (int t = 0; t < 32; t++) v[32 * l + t] = d * (float)b->qs[AT(l, t)];
        }
    }
}

#if defined(__x86_64__)
/* ---- AVX2 dequantization: the same floats as dequant_block, 8 at a time ---- */

/* Rows of 8 32-bit units transposed: unit l of r[j] becomes unit j of r[l]. Applied to a superblock's codes in
   position order (vector j, unit l: group l's elements 4j..4j+3) it leaves group l's 32 codes in order in r[l]. */
AVX2 static inline void transpose8(__m256i r[8]) {
    __m256 a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[2 * i]), _mm256_castsi256_ps(r[2 * i + 1]));
        a[2 * i + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[2 * i]), _mm256_castsi256_ps(r[2 * i + 1]));
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            b[4 * i + 2 * h] = _mm256_shuffle_ps(a[4 * i + h], a[4 * i + 2 + h], 0x44);
            b[4 * i + 2 * h + 1] = _mm256_shuffle_ps(a[4 * i + h], a[4 * i + 2 + h], 0xEE);
        }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(b[i], b[4 + i], 0x20));
        r[4 + i] = _mm256_castps_si256(_mm256_permute2f128_ps(b[i], b[4 + i], 0x31));
    }
}

/* A superblock's 256 codes in position order, 32 a vector (Q6K's 0..63, Q80's as int8 bytes). */
AVX2 static inline void codes_avx2(int kind, const uint8_t *w, __m256i c[8]) {
    const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
    for (int p = 0; p < 4; p++) {
        if (kind == Q80) {
            c[p] = _mm256_loadu_si256((const __m256i *)(((const q80_block *)w)->qs + 32 * p));
            c[p + 4] = _mm256_loadu_si256((const __m256i *)(((const q80_block *)w)->qs + 32 * (p + 4)));
            continue;
        }
        const uint8_t *qs = kind == Q4K ? ((const q4k_block *)w)->qs : ((const q6k_block *)w)->ql;
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        c[p] = _mm256_and_si256(v, low);
        c[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if (kind != Q6K) return;
    const uint8_t *qh = ((const q6k_block *)w)->qh;
    for (int j = 0; j < 8; j++) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * (j % 2)));
        h = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * (j / 2))), two);
        c[j] = _mm256_or_si256(c[j], _mm256_slli_epi16(h, 4));
    }
}

/* One superblock of kind to 256 floats in feature order: dequant_block's values (multiply, then subtract). */
AVX2 static void dequant_block_avx2(int kind, const uint8_t *w, float *v) {
    __m256i c[8];
    codes_avx2(kind, w, c);
    transpose8(c);
    for (int l = 0; l < 8; l++) {
        float scale[2], minimum = 0.f;
        if (kind == Q4K) {
            const q4k_block *b = (const q4k_block *)w;
            scale[0] = scale[1] = half_to_float(b->d) * (float)b->sc[l];
            minimum = half_to_float(b->dmin) * (float)b->mn[l];
        } else if (kind == Q6K) {
            const q6k_block *b = (const q6k_block *)w;
            float d = half_to_float(b->d);
            scale[0] = d * (float)b->sce[l], scale[1] = d * (float)b->sco[l];
        } else {
            scale[0] = scale[1] = half_to_float(((const q80_block *)w)->d[l]);
        }
        __m128i half[2] = {_mm256_castsi256_si128(c[l]), _mm256_extracti128_si256(c[l], 1)};
        for (int q = 0; q < 4; q++) {  /* elements 8q..8q+7 */
            __m128i bytes = q % 2 ? _mm_srli_si128(half[q / 2], 8) : half[q / 2];
            __m256i n = kind == Q80 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
            if (kind == Q6K) n = _mm256_sub_epi32(n, _mm256_set1_epi32(32));
            __m256 f = _mm256_mul_ps(_mm256_set1_ps(scale[q / 2]), _mm256_cvtepi32_ps(n));
            _mm256_storeu_ps(v + 32 * l + 8 * q, _mm256_sub_ps(f, _mm256_set1_ps(minimum)));
        }
    }
}

/* 8 floats to bfloat16 as float_to_bf16 rounds (nearest even, NaN to 0x7FC0). */
AVX2 static inline void put_bf16x8(const float *v, uint16_t *out) {
    __m256 f = _mm256_loadu_ps(v);
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)out, _mm256_castsi256_si128(packed));
}

AVX2 static void dequant_row_avx2(int kind, const uint8_t *w, int64_t B, int64_t K_out, void *out, int bf16) {
    float v[256];
    for (int64_t b = 0; b < B && b * 256 < K_out; b++) {
        dequant_block_avx2(kind, w + b * BLOCK_BYTES[kind], v);
        int64_t e = 0, first = b * 256, end = K_out - first < 256 ? K_out - first : 256;
        for (; e + 8 <= end; e += 8) {
            if (bf16) put_bf16x8(v + e, (uint16_t *)out + first + e);
            else _mm256_storeu_ps((float *)out + first + e, _mm256_loadu_ps(v + e));
        }
        for (; e < end; e++) {
            if (bf16) ((uint16_t *)out)[first + e] = float_to_bf16(v[e]);
            else ((float *)out)[first + e] = v[e];
        }
    }
}
#endif

/* out [N, K_out] (float32, or bfloat16 where bf16, rounded to nearest even) = the first K_out features of N rows of
   kind (K/256 blocks each); with AVX2 where the CPU has it and isa (q4_isa's numbering) is at least 1, the same
   values. Returns 0, or -2 for an unknown kind. */
int q4_dequantize(int kind, const uint8_t *w, int64_t N, int64_t K, int64_t K_out, void *out, int bf16, int isa,
                  int threads) {
    if (kind < 0 || kind >= KINDS) return -2;
    int64_t B = K / 256;
    int vector = runnable(isa) >= 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * B * BLOCK_BYTES[kind];
        void *row = bf16 ? (void *)((uint16_t *)out + n * K_out) : (void *)((float *)out + n * K_out);
#if defined(__x86_64__)
        if (vector) {
            dequant_row_avx2(kind, wn, B, K_out, row, bf16);
            continue;
        }
#endif
        float v[256];
        for (int64_t b = 0; b < B; b++) {
            dequant_block(kind, wn + b * BLOCK_BYTES[kind], v);
            for (int e = 0; e < 256 && b * 256 + e < K_out; e++) {
                if (bf16) ((uint16_t *)row)[b * 256 + e] = float_to_bf16(v[e]);
                else ((float *)row)[b * 256 + e] = v[e];
            }
        }
    }
    return 0;
}

/* ---- GGUF blocks to the kernel's layouts (blocks.py's description), every bit kept ---- */

/* Element x of a superblock (group x / 32, its element x % 32) sits at position POS(x). */
#define POS(x) AT((x) / 32, (x) % 32)

/* Where the code at each position p of a converted superblock comes from in its GGUF block (set once, when the
   library loads): POS_OF[x] = POS(x); Q4_K's code from byte Q4K_FROM[p] of qs, shifted right by Q4K_SHIFT[p]; Q6_K's
   low 4 bits from ql[Q6K_LOW_FROM[p]] >> Q6K_LOW_SHIFT[p], its high 2 from qh[Q6K_HIGH_FROM[p]] >> Q6K_HIGH_SHIFT[p].
   (GGUF Q4_K: element 64c + i the low nibble of byte 32c + i, 64c + 32 + i its high nibble; Q6_K: element
   128h + 32s + i has low 4 bits from ql[64h + 32(s % 2) + i] (high nibble for s >= 2), high 2 bits at bits 2s of
   qh[32h + i].) */
static uint8_t POS_OF[256], Q4K_FROM[256], Q4K_SHIFT[256];
static uint8_t Q6K_LOW_FROM[256], Q6K_LOW_SHIFT[256], Q6K_HIGH_FROM[256], Q6K_HIGH_SHIFT[256];

__attribute__((constructor)) static void conversion_tables(void) {
    for (int x = 0; x < 256; x++) {
        int p = POS(x), r = x % 64, h = x / 128, s = (x % 128) / 32, i = x % 32;
        POS_OF[x] = (uint8_t)p;
        Q4K_FROM[p] = (uint8_t)(32 * (x / 64) + r % 32), Q4K_SHIFT[p] = r < 32 ? 0 : 4;
        Q6K_LOW_FROM[p] = (uint8_t)(64 * h + 32 * (s % 2) + i), Q6K_LOW_SHIFT[p] = (uint8_t)(4 * (s / 2));
        Q6K_HIGH_FROM[p] = (uint8_t)(32 * h + i), Q6K_HIGH_SHIFT[p] = (uint8_t)(2 * s);
    }
}

/* The 4-bit codes of positions d (low nibble) and d + 128 (high nibble) from src by the tables from, shift. */
static inline uint8_t gguf_nibbles(const uint8_t *src, const uint8_t *from, const uint8_t *shift, int d) {
    return (uint8_t)(((src[from[d]] >> shift[d]) & 15) | (((src[from[d + 128]] >> shift[d + 128]) & 15) << 4));
}

/* GGUF Q4_K (fp16 d, dmin; 12 bytes of 6-bit scales and minima; 128 bytes of codes) to q4k_block. */
static void from_q4k(const uint8_t *g, q4k_block *o) {
    const uint8_t *a = g + 4, *b = g + 8, *c = g + 12, *qs = g + 16;
    memcpy(&o->d, g, 2), memcpy(&o->dmin, g + 2, 2);
    for (int l = 0; l < 4; l++) {
        o->sc[l] = a[l] & 63, o->sc[4 + l] = (uint8_t)((c[l] & 15) | ((a[l] >> 6) << 4));
        o->mn[l] = b[l] & 63, o->mn[4 + l] = (uint8_t)((c[l] >> 4) | ((b[l] >> 6) << 4));
    }
    for (int d = 0; d < 128; d++) o->qs[d] = gguf_nibbles(qs, Q4K_FROM, Q4K_SHIFT, d);
}

/* GGUF Q6_K (ql 128, qh 64, int8 scales 16, fp16 d) to q6k_block: position p's high 2 bits at bits 2(j / 2) of
   qh[32(j % 2) + p % 32], j = p / 32, so byte q holds those of positions 32(2f + q / 32) + q % 32, f = 0..3. */
static void from_q6k(const uint8_t *g, q6k_block *o) {
    const uint8_t *ql = g, *qh = g + 128;
    const int8_t *scales = (const int8_t *)(g + 192);
    for (int d = 0; d < 128; d++) o->ql[d] = gguf_nibbles(ql, Q6K_LOW_FROM, Q6K_LOW_SHIFT, d);
    for (int q = 0; q < 64; q++) {
        int v = 0;
        for (int f = 0; f < 4; f++) {
            int p = 32 * (2 * f + q / 32) + q % 32;
            v |= ((qh[Q6K_HIGH_FROM[p]] >> Q6K_HIGH_SHIFT[p]) & 3) << (2 * f);
        }
        o->qh[q] = (uint8_t)v;
    }
    for (int l = 0; l < 8; l++) o->sce[l] = scales[2 * l], o->sco[l] = scales[2 * l + 1];
    memcpy(&o->d, g + 208, 2);
}

/* GGUF blocks of 32 read as Q8_0: Q8_0 (fp16 d, 32 int8), Q5_0 (fp16 d, 32 high bits little-endian, 16 bytes: element
   j the low nibble of byte j, j + 16 its high nibble; q - 16) and Q4_0 (fp16 d, 16 bytes as Q5_0's; q - 8). */
enum { SRC_Q80 = 2, SRC_Q50 = 3, SRC_Q40 = 4 };
static const int GROUP_BYTES[5] = {0, 0, 34, 22, 18};

static void group_codes(int src, const uint8_t *g, int8_t *q) {
    if (src == SRC_Q80) {
        memcpy(q, g + 2, 32);
        return;
    }
    const uint8_t *qs = g + (src == SRC_Q50 ? 6 : 2);
    for (int j = 0; j < 16; j++) q[j] = (int8_t)(qs[j] & 15), q[j + 16] = (int8_t)(qs[j] >> 4);
    if (src == SRC_Q40) {
        for (int j = 0; j < 32; j++) q[j] = (int8_t)(q[j] - 8);
        return;
    }
    uint32_t high;
    memcpy(&high, g + 2, 4);
    for (int j = 0; j < 32; j++) q[j] = (int8_t)((q[j] | (int)(((high >> j) & 1) << 4)) - 16);
}

/* Up to 8 GGUF blocks of 32 (src: SRC_Q80, SRC_Q50, SRC_Q40) to q80_block; missing ones are zero (d = 0). */
static void from_groups(int src, const uint8_t *g, int count, q80_block *o) {
    memset(o, 0, sizeof *o);
    for (int l = 0; l < count; l++, g += GROUP_BYTES[src]) {
        int8_t q[32];
        memcpy(&o->d[l], g, 2);
        group_codes(src, g, q);
        for (int t = 0; t < 32; t++) o->qs[POS_OF[32 * l + t]] = q[t];
    }
}

/* out [N, ceil(K / 256) superblocks] = N GGUF rows of K features of type src (0 Q4_K, 1 Q6_K: K / 256 blocks, to
   q4k / q6k; SRC_Q80, SRC_Q50, SRC_Q40: K / 32 blocks, to q80, the last superblock padded with zero blocks).
   Returns 0, or -2 for an unknown src. */
int q4_from_gguf(int src, const uint8_t *raw, int64_t N, int64_t K, uint8_t *out, int threads) {
    if (src < 0 || src > SRC_Q40) return -2;
    int kind = src < Q80 ? src : Q80;
    int64_t B = (K + 255) / 256, in_row = kind == Q80 ? K / 32 * GROUP_BYTES[src] : K / 256 * (kind == Q4K ? 144 : 210);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *g = raw + n * in_row;
        uint8_t *o = out + n * B * BLOCK_BYTES[kind];
        for (int64_t b = 0; b < B; b++, o += BLOCK_BYTES[kind]) {
            if (kind == Q4K) from_q4k(g + 144 * b, (q4k_block *)o);
            else if (kind == Q6K) from_q6k(g + 210 * b, (q6k_block *)o);
            else from_groups(src, g + GROUP_BYTES[src] * 8 * b, (int)(K / 32 - 8 * b < 8 ? K / 32 - 8 * b : 8),
                             (q80_block *)o);
        }
    }
    return 0;
}

/* y [M, N] = x [M, K_in] @ W.T (+ bias [N] float32, or NULL). W: nseg segments, segment s holding rows[s] output
   rows of kinds[s] (K/256 blocks each, K a multiple of 256, K_in <= K), stored one after another from w.
   x float32, or bfloat16 where x_bf16; y float32, or bfloat16 where y_bf16. The best path the CPU has, at most isa
   (q4_isa's numbering). The layer's arguments come first, the call's after (isa), so a caller can bind them once.
   Returns 0; -1 where the scratch buffer cannot be allocated; -2 for an unknown kind. */
/* A layer's row segments: segment s holds rows [first[s], first[s + 1]) of kind kinds[s] from base[s]. */
enum { MAX_SEG = 16 };
typedef struct { int64_t first[MAX_SEG + 1]; const uint8_t *base[MAX_SEG]; const int32_t *kinds; int nseg; } segs;

static int64_t segments(const uint8_t *w, const int32_t *kinds, const int64_t *rows, int nseg, int64_t B, segs *g) {
    int64_t N = 0;
    if (nseg < 1 || nseg > MAX_SEG) return -1;
    for (int s = 0; s < nseg; s++) {
        if (kinds[s] < 0 || kinds[s] >= KINDS) return -1;
        g->first[s] = N, g->base[s] = w;
        N += rows[s];
        w += rows[s] * B * BLOCK_BYTES[kinds[s]];
    }
    g->first[nseg] = N, g->kinds = kinds, g->nseg = nseg;
    return N;
}

/* Weight row n of the layer times every activation row, into o's column out, on the path chosen. */
static void one_row(const segs *g, int path, int64_t n, const xblock *xq, int64_t M, int64_t B, const sink *o,
                    int64_t out) {
    int s = 0;
    while (n >= g->first[s + 1]) s++;
    int kind = g->kinds[s];
    const uint8_t *wn = g->base[s] + (n - g->first[s]) * B * BLOCK_BYTES[kind];
#if defined(__x86_64__)
    if (path == 3) {
        row_vnni(kind, wn, xq, M, B, o, out);
        return;
    }
#if HAVE_AVXVNNI
    if (path == 2) {
        row_avxvnni(kind, wn, xq, M, B, o, out);
        return;
    }
#endif
    if (path == 1) {
        row_avx2(kind, wn, xq, M, B, o, out);
        return;
    }
#endif
    for (int64_t r = 0; r < M; r++) put(o, r, out, dot_portable(kind, wn, xq + r * B, B));
}

/* Activation rows one pass over the weights takes: as many as fit in CHUNK_BYTES (about an L1 data cache), at least
   CHUNK_LEAST, a multiple of 8. A long prompt's rows then stay in cache while a weight row meets them (a pass over all
   M rows streams them from memory once per weight row where M rows outgrow L2). Each row's products are unchanged:
   only the order of the passes differs. */
enum { CHUNK_BYTES = 65536, CHUNK_LEAST = 24 };
static int64_t chunk_rows(int64_t B) {
    int64_t c = CHUNK_BYTES / (B * (int64_t)sizeof(xblock)) / 8 * 8;
    return c < CHUNK_LEAST ? CHUNK_LEAST : c;
}

/* The sink of rows [r0, ...) of o. */
static sink rows_from(const sink *o, int64_t r0) {
    sink s = *o;
    s.y = (char *)o->y + r0 * o->N * (o->bf16 ? 2 : 4);
    return s;
}

int q4_linear(const uint8_t *w, const int32_t *kinds, const int64_t *rows, int nseg, int64_t K_in, int64_t K,
              const float *bias, int isa, const void *x, int x_bf16, int64_t M, void *y, int y_bf16, int threads) {
    int64_t B = K / 256;
    segs g;
    int64_t N = segments(w, kinds, rows, nseg, B, &g);
    if (N < 0) return -2;
    xblock *xq = malloc((size_t)(M * B) * sizeof(xblock));
    if (!xq) return -1;
    int path = runnable(isa);
    q8_blocks(x, x_bf16, M, K_in, K, xq, path, threads);
    sink o = {y, y_bf16, bias, N};
    int64_t C = chunk_rows(B);
#pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), per = (N + T - 1) / T;
        int64_t lo = t * per < N ? t * per : N, hi = lo + per < N ? lo + per : N;
        for (int64_t r0 = 0; r0 < M; r0 += C) {
            sink part = rows_from(&o, r0);
            for (int64_t n = lo; n < hi; n++) one_row(&g, path, n, xq + r0 * B, M - r0 < C ? M - r0 : C, B, &part, n);
        }
    }
    free(xq);
    return 0;
}

/* q4_swiglu: a gated MLP's gate and up projections and its SwiGLU, y = silu(x G^T + b_G) * (x U^T + b_U) (Shazeer
2020, "GLU Variants Improve Transformer", eq. 6 with SiLU), for a layer whose rows are the I gate rows, then the I up
rows; y [M, I]. Each thread takes a range of features, multiplies its gate and up rows, and applies the product to
what it just computed (no thread reads another's results: on a CPU the first read of another core's writes costs
more than the arithmetic). The gate and up values are rounded to y's dtype, then silu(g) = g * sigmoid(g) is rounded
to it and multiplied by u, rounded again: torch's silu(g) * u on that dtype's tensors, sigmoid from exp_neg (a few
units in the last place from torch's). Elementwise, so a row's output does not depend on the rows computed with it. */
/* g * sigmoid(g), the sigmoid from e = e^-|g| (no overflow): e / (1 + e) for negative g, 1 / (1 + e) otherwise. */
static inline float silu(float g) {
    uint32_t ug = bits_of(g), negative = 0u - (ug >> 31);
    float e = exp_neg(float_of(ug | 0x80000000u));
    return g * (float_of((bits_of(e) & negative) | (bits_of(1.0f) & ~negative)) / (1.0f + e));
}

static inline float bf16_round(float v) { /* to the nearest bfloat16, ties to even, as float_to_bf16; NaN kept */
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, 4);
    return v;
}

/* One activation row's features: g and u [f] (float32, before the bias; the bias added in place), bias [2I] or NULL
   at feature j0 → y [f]. Branch-free loops, so that the compiler vectorizes them. */
__attribute__((target_clones("avx512f", "avx2", "default"))) static void swiglu_row(
    float *restrict g, float *restrict u, int64_t f, const float *bias, int64_t j0, int64_t I, void *y, int bf16) {
    if (bias)
        for (int64_t j = 0; j < f; j++) g[j] += bias[j0 + j], u[j] += bias[I + j0 + j];
    if (bf16) {
        for (int64_t j = 0; j < f; j++) g[j] = bf16_round(bf16_round(silu(bf16_round(g[j]))) * bf16_round(u[j]));
        for (int64_t j = 0; j < f; j++) ((uint16_t *)y)[j] = float_to_bf16(g[j]);
    } else {
        float *restrict out = (float *)y;
        for (int64_t j = 0; j < f; j++) out[j] = silu(g[j]) * u[j];
    }
}

int q4_swiglu(const uint8_t *w, const int32_t *kinds, const int64_t *rows, int nseg, int64_t K_in, int64_t K,
              const float *bias, int isa, const void *x, int x_bf16, int64_t M, void *y, int y_bf16, int threads) {
    int64_t B = K / 256;
    segs g;
    int64_t N = segments(w, kinds, rows, nseg, B, &g), I = N / 2, size = y_bf16 ? 2 : 4;
    if (N < 0 || N % 2) return -2;
    xblock *xq = malloc((size_t)(M * B) * sizeof(xblock));
    if (!xq) return -1;
    int path = runnable(isa), failed = 0;
    q8_blocks(x, x_bf16, M, K_in, K, xq, path, threads);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t per = ((I + T - 1) / T + 15) / 16 * 16, lo = t * per < I ? t * per : I;
        int64_t f = (lo + per < I ? lo + per : I) - lo;  /* features [lo, lo + f) */
        float *tmp = f ? malloc((size_t)(M * 2 * f) * sizeof(float)) : NULL;
        if (f && !tmp) failed = 1;
        if (tmp) {
            sink o = {tmp, 0, NULL, 2 * f};  /* row r: the gate values, then the up values */
            int64_t C = chunk_rows(B);
            for (int64_t r0 = 0; r0 < M; r0 += C) {
                sink part = rows_from(&o, r0);
                for (int64_t j = 0; j < f; j++) {
                    one_row(&g, path, lo + j, xq + r0 * B, M - r0 < C ? M - r0 : C, B, &part, j);
                    one_row(&g, path, I + lo + j, xq + r0 * B, M - r0 < C ? M - r0 : C, B, &part, f + j);
                }
            }
            for (int64_t r = 0; r < M; r++)
                swiglu_row(tmp + r * 2 * f, tmp + r * 2 * f + f, f, bias, lo, I, (char *)y + (r * I + lo) * size,
                           y_bf16);
            free(tmp);
        }
    }
    free(xq);
    return failed ? -1 : 0;
}
