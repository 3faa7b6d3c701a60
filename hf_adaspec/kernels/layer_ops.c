/* The small operations of a decoder layer around its matrix products, one foreign call each: rms_norm, rope_split,
attention and add (each described where it is defined). kernels/decoder.c calls them in a layer's order.

rms_norm: y = w * (x * rsqrt(mean(x^2) + eps)) per row (Zhang & Sennrich 2019, eq. 4), rounded as transformers'
Llama-family RMSNorm rounds it: x in float32, the mean of squares and the scaling in float32, the normalized row
rounded to the activations' dtype, then the product with the weight rounded to it. Rows are independent, so a
row's output does not depend on how many rows are computed with it. The sum of squares is taken in 16 partial
sums (torch's reduction order differs, so its last bit can differ). bfloat16 rounds to nearest even, as torch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

/* A function compiled once per vector width (with GCC on x86-64), the widest this CPU has chosen when the library
is loaded: the same arithmetic in each (C11 mode contracts no multiply-add). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif
/* A helper of a VECTOR_CLONES function, inlined into each clone so that it is compiled for the clone's vectors. */
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

static inline float bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_of(f);
  uint32_t nan = (u >> 16) | 0x40u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);  /* NaN stays NaN; no branch: vectorizes */
}

static float inverse_rms(const float *x, int64_t h, float eps) {
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= h; i += 16)
    for (int j = 0; j < 16; j++) part[j] += x[i + j] * x[i + j];
  for (; i < h; i++) part[i & 15] += x[i] * x[i];
  float s = 0.0f;
  for (int j = 0; j < 16; j++) s += part[j];
  return 1.0f / sqrtf(s / (float)h + eps);
}

/* One row x, y [h] and w [h], all bfloat16 (bf16 != 0) or all float32; a bfloat16 row's float32 copy lives on
   the stack. */
VECTOR_CLONES static void rms_row(const void *x, const void *w, int64_t h, float eps, void *y, int bf16) {
  if (bf16) {
    float row[h];
    const uint16_t *xr = (const uint16_t *)x, *wr = (const uint16_t *)w;
    uint16_t *yr = (uint16_t *)y;
    for (int64_t i = 0; i < h; i++) row[i] = bf16_to_f32(xr[i]);
    float inv = inverse_rms(row, h, eps);
    for (int64_t i = 0; i < h; i++) yr[i] = f32_to_bf16(bf16_to_f32(wr[i]) * bf16_to_f32(f32_to_bf16(row[i] * inv)));
  } else {
    const float *xr = (const float *)x, *wr = (const float *)w;
    float *yr = (float *)y;
    float inv = inverse_rms(xr, h, eps);
    for (int64_t i = 0; i < h; i++) yr[i] = wr[i] * (xr[i] * inv);
  }
}

/* x, y [m, h] and w [h], all bfloat16 (bf16 != 0) or all float32. Returns 1 for a width the stack copy refuses,
   else 0. */
int ops_rms_norm(const void *x, const void *w, int64_t m, int64_t h, float eps, void *y, int bf16, int threads) {
  if (h <= 0 || h > 65536) return 1;
  int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (m >= 32)
  for (int64_t r = 0; r < m; r++) rms_row((const char *)x + r * h * size, w, h, eps, (char *)y + r * h * size, bf16);
  return 0;
}

/* rope_split: a fused query/key/value projection's output qkv [t, (h + 2 hkv) d] (t = b n tokens, row-major) to
q [b, h, n, d] and k rotated by the rotary position embedding (Su et al. 2021, RoFormer, eq. 34, in
transformers' rotate-half layout: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[d/2:], x[:d/2])) and
v copied, k and v [b, hkv, columns, d] written at columns first .. first + n - 1 (columns = n, first = 0: tensors
of their own; a KV cache's buffers otherwise). cos and sin [b or 1, n, d] (cos_batch_stride 0: one row of positions for every batch
row). Each product and the sum round to the activations' dtype as torch's three operations do (no fused
multiply-add: C11 mode contracts nothing). All tensors bfloat16 (bf16 != 0) or all float32. */
static inline float rope_bf16(float x, float c, float rot, float s) {
  return bf16_to_f32(f32_to_bf16(bf16_to_f32(f32_to_bf16(x * c)) + bf16_to_f32(f32_to_bf16(rot * s))));
}

/* Each half in a loop of its own, so that the compiler vectorizes it. */
VECTOR_CLONES static void rope_head_bf16(const uint16_t *restrict x, const uint16_t *restrict c,
                                         const uint16_t *restrict s, int64_t d, uint16_t *restrict out) {
  int64_t half = d / 2;
  for (int64_t j = 0; j < half; j++) {
    float rot = -bf16_to_f32(x[j + half]);
    out[j] = f32_to_bf16(rope_bf16(bf16_to_f32(x[j]), bf16_to_f32(c[j]), rot, bf16_to_f32(s[j])));
  }
  for (int64_t j = half; j < d; j++) {
    float rot = bf16_to_f32(x[j - half]);
    out[j] = f32_to_bf16(rope_bf16(bf16_to_f32(x[j]), bf16_to_f32(c[j]), rot, bf16_to_f32(s[j])));
  }
}

static void rope_head_f32(const float *x, const float *c, const float *s, int64_t d, float *out) {
  int64_t half = d / 2;
  for (int64_t j = 0; j < half; j++) {
    float a = x[j], b = x[j + half];
    float p = a * c[j], q = -b * s[j];
    out[j] = p + q;
    float p2 = b * c[j + half], q2 = a * s[j + half];
    out[j + half] = p2 + q2;
  }
}

int ops_rope_split(const void *qkv, const void *cos, const void *sin, int64_t cos_batch_stride, int64_t b,
                   int64_t n, int64_t h, int64_t hkv, int64_t d, void *q, void *k, void *v, int64_t columns,
                   int64_t first, int bf16) {
  if (d % 2 || first < 0 || first + n > columns) return 1;
  int64_t width = (h + 2 * hkv) * d, size = bf16 ? 2 : 4;
  for (int64_t r = 0; r < b; r++)
    for (int64_t i = 0; i < n; i++) {
      int64_t t = r * n + i, at = r * cos_batch_stride + i * d;
      const char *row = (const char *)qkv + t * width * size;
      for (int64_t head = 0; head < h + 2 * hkv; head++) {
        const char *x = row + head * d * size;
        char *out;
        if (head < h) out = (char *)q + ((r * h + head) * n + i) * d * size;
        else if (head < h + hkv) out = (char *)k + ((r * hkv + head - h) * columns + first + i) * d * size;
        else {
          memcpy((char *)v + ((r * hkv + head - h - hkv) * columns + first + i) * d * size, x, d * size);
          continue;
        }
        if (bf16) rope_head_bf16((const uint16_t *)x, (const uint16_t *)cos + at, (const uint16_t *)sin + at, d,
                                 (uint16_t *)out);
        else rope_head_f32((const float *)x, (const float *)cos + at, (const float *)sin + at, d, (float *)out);
      }
    }
  return 0;
}

/* attention: per query head, softmax(q k^T * scale) v over the columns its row sees (Vaswani et al. 2017, eq. 1),
causal over a block of n new rows without holes: row i sees columns 0 .. held + i. q [b, h, n, d] (rope_split's),
k and v [b, hkv, columns, d] (a cache's buffers: the first held + n columns are read); query head j reads key/value
head j / (h / hkv); d a multiple of 16. out [b, n, h, d]. The g = h / hkv heads' rows that share a key/value head
are computed by one thread, bfloat16 values widened to float32 once for all of them, the keys and values read in
blocks that all those rows go through in turn (a long context's cache does not fit a core's cache). Each row's arithmetic
is its own and in a fixed order, in float32: its scores (16 partial sums of the features t, t + 16, ..., added
pairwise), their maximum, exp_neg of each less it, their sum (16 partial sums, then in order), the values weighed
in column order, divided by the sum and rounded once to the dtype. So a row's output does not depend on the rows or
threads it is computed with; it differs from torch's SDPA in the last bits. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

INLINE v16 load16(const float *p) {
  v16 x;
  memcpy(&x, p, 64);
  return x;
}

/* The 16 partial sums added pairwise: lane c + 8 into c, then c + 4, c + 2, c + 1. */
INLINE float sum16(v16 p) {
  v8 a, b;
  memcpy(&a, &p, 32);
  memcpy(&b, (char *)&p + 32, 32);
  a += b;
  v4 c, e;
  memcpy(&c, &a, 16);
  memcpy(&e, (char *)&a + 16, 16);
  c += e;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

/* x [count] widened to float32 into out (bfloat16: exactly), or x itself (float32: no copy). */
INLINE const float *widened(const void *x, int64_t count, float *restrict out, int bf16) {
  if (!bf16) return (const float *)x;
  const uint16_t *xr = (const uint16_t *)x;
  for (int64_t i = 0; i < count; i++) out[i] = bf16_to_f32(xr[i]);
  return out;
}

/* s[j] = scale * (q . k_j) for the w keys k [w, d], four keys at a time (each key's sums its own). */
INLINE void scores(const float *restrict q, const float *restrict k, int64_t w, int64_t d, float scale,
                   float *restrict s) {
  int64_t j = 0;
  for (; j + 4 <= w; j += 4) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t t = 0; t < d; t += 16) {
      v16 x = load16(q + t);
      a0 += x * load16(k + j * d + t), a1 += x * load16(k + (j + 1) * d + t);
      a2 += x * load16(k + (j + 2) * d + t), a3 += x * load16(k + (j + 3) * d + t);
    }
    s[j] = sum16(a0) * scale, s[j + 1] = sum16(a1) * scale, s[j + 2] = sum16(a2) * scale;
    s[j + 3] = sum16(a3) * scale;
  }
  for (; j < w; j++) {
    v16 a = {0};
    for (int64_t t = 0; t < d; t += 16) a += load16(q + t) * load16(k + j * d + t);
    s[j] = sum16(a) * scale;
  }
}

/* s[0 .. w) replaced by e^(s - max); their sum returned (16 partial sums of j, j + 16, ..., then in order). */
INLINE float weights(float *restrict s, int64_t w) {
  float top = s[0], most[16], part[16] = {0}, sum = 0.0f;
  for (int c = 0; c < 16; c++) most[c] = s[0];
  int64_t i = 0;
  for (; i + 16 <= w; i += 16)
    for (int c = 0; c < 16; c++) most[c] = s[i + c] > most[c] ? s[i + c] : most[c];
  for (; i < w; i++) top = s[i] > top ? s[i] : top;
  for (int c = 0; c < 16; c++) top = most[c] > top ? most[c] : top;
  for (int64_t j = 0; j < w; j++) s[j] = exp_neg(s[j] - top);
  int64_t j = 0;
  for (; j + 16 <= w; j += 16)
    for (int c = 0; c < 16; c++) part[c] += s[j + c];
  for (; j < w; j++) part[j & 15] += s[j];
  for (int c = 0; c < 16; c++) sum += part[c];
  return sum;
}

/* acc [d] += p[j] v_j for the columns j in [from, to), in column order, eight at a time from a multiple of 8 (then
   one at a time): a row's sums are the same whichever blocks its columns are taken in, from and the blocks'
   bounds being multiples of 8 (a row's last block ends at its own width). */
INLINE void weighed(const float *restrict p, const float *restrict v, int64_t from, int64_t to, int64_t d,
                    float *restrict acc) {
  int64_t j = from;
  for (; j + 8 <= to; j += 8)
    for (int64_t t = 0; t < d; t += 16) {
      v16 a = load16(acc + t);
      for (int64_t c = j; c < j + 8; c++) a = a + p[c] * load16(v + c * d + t);
      memcpy(acc + t, &a, 64);
    }
  for (; j < to; j++)
    for (int64_t t = 0; t < d; t += 16) {
      v16 a = load16(acc + t) + p[j] * load16(v + j * d + t);
      memcpy(acc + t, &a, 64);
    }
}

/* Columns a block of keys and of values holds while all the group's rows read it from the core's cache
   (a multiple of 8: see weighed). */
#define ATTENTION_BLOCK 64

/* The g n rows of one key/value head: q [g, n, d] (row r: query head r / n of the group, position r % n, seeing
   held + r % n + 1 columns), k and v [columns, d] → row r at out + ((r % n) h + r / n) d. Keys and values are read
   in blocks of ATTENTION_BLOCK columns, each block by all the rows in turn; each row's arithmetic is that of the
   row alone (scores per column, weighed in column order). work: g n (2 d + held + n) + 2 (held + n) d floats
   (bfloat16 queries, keys and values are widened into it once for all the rows). */
VECTOR_CLONES static void attend_group(const void *q, int64_t g, int64_t n, int64_t h, const void *k, const void *v,
                                       int64_t held, int64_t d, float scale, float *work, void *out, int bf16) {
  int64_t rows = g * n, width = held + n, size = bf16 ? 2 : 4;
  float *qf = work, *s = qf + rows * d, *acc = s + rows * width, *kf = acc + rows * d, *vf = kf + width * d;
  const float *qs = widened(q, rows * d, qf, bf16), *ks = widened(k, width * d, kf, bf16);
  const float *vs = widened(v, width * d, vf, bf16);
  for (int64_t from = 0; from < width; from += ATTENTION_BLOCK)
    for (int64_t r = 0; r < rows; r++) {
      int64_t to = held + r % n + 1 < from + ATTENTION_BLOCK ? held + r % n + 1 : from + ATTENTION_BLOCK;
      if (to > from) scores(qs + r * d, ks + from * d, to - from, d, scale, s + r * width + from);
    }
  float *sums = qf;  /* the queries are read no more: row r's sum of weights at sums[r] */
  for (int64_t r = 0; r < rows; r++) {
    sums[r] = weights(s + r * width, held + r % n + 1);
    for (int64_t t = 0; t < d; t++) acc[r * d + t] = 0.0f;
  }
  for (int64_t from = 0; from < width; from += ATTENTION_BLOCK)
    for (int64_t r = 0; r < rows; r++) {
      int64_t to = held + r % n + 1 < from + ATTENTION_BLOCK ? held + r % n + 1 : from + ATTENTION_BLOCK;
      if (to > from) weighed(s + r * width, vs, from, to, d, acc + r * d);
    }
  for (int64_t r = 0; r < rows; r++) {
    char *o = (char *)out + ((r % n) * h + r / n) * d * size;
    if (bf16)
      for (int64_t t = 0; t < d; t++) ((uint16_t *)o)[t] = f32_to_bf16(acc[r * d + t] / sums[r]);
    else
      for (int64_t t = 0; t < d; t++) ((float *)o)[t] = acc[r * d + t] / sums[r];
  }
}

/* Returns 1 for heads that do not group evenly, columns that do not fit or d not a multiple of 16; 2 where the
   scratch could not be had. */
int ops_attention(const void *q, const void *k, const void *v, int64_t b, int64_t n, int64_t h, int64_t hkv, int64_t d,
                  int64_t columns, int64_t held, float scale, void *out, int bf16, int threads) {
  if (b <= 0 || hkv <= 0 || h % hkv || held < 0 || n <= 0 || held + n > columns || d <= 0 || d % 16) return 1;
  int64_t g = h / hkv, width = held + n, size = bf16 ? 2 : 4, work = g * n * (2 * d + width) + 2 * width * d;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (b * hkv > 1 && b * h * n * width * d >= (1 << 18)) reduction(| : failed)
  {
    float *scratch = malloc((size_t)work * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t group = 0; group < b * hkv; group++) {
      if (!scratch) {
        failed = 1;
        continue;
      }
      int64_t row = group / hkv, head = group % hkv;
      attend_group((const char *)q + group * g * n * d * size, g, n, h, (const char *)k + group * columns * d * size,
                   (const char *)v + group * columns * d * size, held, d, scale, scratch,
                   (char *)out + (row * n * h + head * g) * d * size, bf16);
    }
    free(scratch);
  }
  return failed ? 2 : 0;
}

/* add: x += y over count values, rounded as torch's x + y on the dtype (bfloat16: the float32 sum rounded to
nearest even). */
VECTOR_CLONES void ops_add(void *x, const void *y, int64_t count, int bf16) {
  if (bf16) {
    uint16_t *xr = (uint16_t *)x;
    const uint16_t *yr = (const uint16_t *)y;
    for (int64_t i = 0; i < count; i++) xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(yr[i]));
  } else {
    float *xr = (float *)x;
    const float *yr = (const float *)y;
    for (int64_t i = 0; i < count; i++) xr[i] += yr[i];
  }
}
