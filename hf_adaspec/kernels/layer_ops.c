/* The small operations of a decoder layer around its matrix products, one foreign call each (a q4 1.5B's
1-token step spent 13.5 of its 60 ms outside the kernel, RMSNorm 3.0 of it).

rms_norm: y = w * (x * rsqrt(mean(x^2) + eps)) per row (Zhang & Sennrich 2019, eq. 4), rounded as transformers'
Llama-family RMSNorm rounds it: x in float32, the mean of squares and the scaling in float32, the normalized row
rounded to the activations' dtype, then the product with the weight rounded to it. Rows are independent, so a
row's output does not depend on how many rows are computed with it. The sum of squares is taken in 16 partial
sums (torch's reduction order differs, so its last bit can differ). bfloat16 rounds to nearest even, as torch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A function compiled once per vector width (with GCC on x86-64), the widest this CPU has chosen when the library
is loaded: the same arithmetic in each (C11 mode contracts no multiply-add). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
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
q [b, h, n, d] and k [b, hkv, n, d] rotated by the rotary position embedding (Su et al. 2021, RoFormer, eq. 34, in
transformers' rotate-half layout: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[d/2:], x[:d/2])) and
v [b, hkv, n, d] copied. cos and sin [b or 1, n, d] (cos_batch_stride 0: one row of positions for every batch
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
                   int64_t n, int64_t h, int64_t hkv, int64_t d, void *q, void *k, void *v, int bf16) {
  if (d % 2) return 1;
  int64_t width = (h + 2 * hkv) * d, size = bf16 ? 2 : 4;
  for (int64_t r = 0; r < b; r++)
    for (int64_t i = 0; i < n; i++) {
      int64_t t = r * n + i, at = r * cos_batch_stride + i * d;
      const char *row = (const char *)qkv + t * width * size;
      for (int64_t head = 0; head < h + 2 * hkv; head++) {
        const char *x = row + head * d * size;
        char *out;
        if (head < h) out = (char *)q + ((r * h + head) * n + i) * d * size;
        else if (head < h + hkv) out = (char *)k + ((r * hkv + head - h) * n + i) * d * size;
        else {
          memcpy((char *)v + ((r * hkv + head - h - hkv) * n + i) * d * size, x, d * size);
          continue;
        }
        if (bf16) rope_head_bf16((const uint16_t *)x, (const uint16_t *)cos + at, (const uint16_t *)sin + at, d,
                                 (uint16_t *)out);
        else rope_head_f32((const float *)x, (const float *)cos + at, (const float *)sin + at, d, (float *)out);
      }
    }
  return 0;
}

/* attend: one layer's attention for n new tokens over its key/value cache, softmax(q k^T * scale + mask) v
(Vaswani et al. 2017, eq. 1), the new keys (rotated as rope_split rotates them) and values written into the cache
first. qkv [b, n, (h + 2 hkv) d] is the fused projection's output; cos and sin as rope_split's; kc and vc
[b, hkv, cap, d] are the cache's buffers, columns [0, held) filled and the n new ones written at [held, held + n);
mask: NULL (every column of [0, held + n) visible to every query) or booleans, column j of query i of batch row r
at mask[r * mask_batch + i * mask_row + j]; out [b, n, h, d]. Query head hh reads key/value head hh / (h / hkv).
One task per batch row, key/value head and position computes that head's group of query rows together, so each
key and value row is read once for the group. The scores, softmax and weighted sum are float32, over keys in
blocks of KEY_BLOCK with a running maximum (Milakov & Gimelshein 2018, online softmax, eq. 3-4), each block at the
same columns whatever n is: a query row's output does not depend on the rows computed with it. A row that sees no
column is zeros. */
#define KEY_BLOCK 64
#define WIDEST_HEAD 512

static inline __attribute__((always_inline)) float dot_f32(const float *restrict a, const float *restrict b,
                                                           int64_t d) {
  float part[16] = {0};
  int64_t t = 0;
  for (; t + 16 <= d; t += 16)
    for (int j = 0; j < 16; j++) part[j] += a[t + j] * b[t + j];
  for (; t < d; t++) part[t & 15] += a[t] * b[t];
  for (int j = 0; j < 8; j++) part[j] += part[j + 8];  /* a tree of sums, halves added: no chain of 16 */
  for (int j = 0; j < 4; j++) part[j] += part[j + 4];
  return (part[0] + part[2]) + (part[1] + part[3]);
}

/* e^x for x <= 0 (below -87: e^-87) to a few units in the last place, in operations a vector unit runs: x = k ln 2
+ r with |r| <= ln 2 / 2, e^r by its degree-6 Taylor polynomial, 2^k from the exponent's bits (Cody & Waite 1980);
k is rounded to nearest by adding and subtracting 1.5 * 2^23. */
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666667e-1f + r * (4.16666667e-2f + r * (8.33333333e-3f +
            r * 1.38888889e-3f)))));
  int32_t bits = ((int32_t)k + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}

static inline __attribute__((always_inline)) const float *as_f32(const void *row, int64_t d, int bf16, float *tmp) {
  if (!bf16) return (const float *)row;
  for (int64_t t = 0; t < d; t++) tmp[t] = bf16_to_f32(((const uint16_t *)row)[t]);
  return tmp;
}

/* g query rows q [g, d] (float32) over cols columns of one key/value head (k, v: rows of d, dtype by bf16), mask
   NULL or [cols] → acc [g, d] (float32). s [g, KEY_BLOCK], m and l [g]: the caller's scratch. */
VECTOR_CLONES static void attend_group(const float *restrict q, int64_t g, const char *k, const char *v,
                                       int64_t cols, const uint8_t *mask, int64_t d, float scale, int bf16,
                                       float *restrict acc, float *restrict s, float *restrict m, float *restrict l) {
  float row[WIDEST_HEAD];
  int64_t size = bf16 ? 2 : 4;
  for (int64_t a = 0; a < g; a++) m[a] = -INFINITY, l[a] = 0.0f;
  for (int64_t t = 0; t < g * d; t++) acc[t] = 0.0f;
  for (int64_t j0 = 0; j0 < cols; j0 += KEY_BLOCK) {
    int64_t width = cols - j0 < KEY_BLOCK ? cols - j0 : KEY_BLOCK;
    for (int64_t j = 0; j < width; j++) {
      int visible = !mask || mask[j0 + j];
      const float *kr = visible ? as_f32(k + (j0 + j) * d * size, d, bf16, row) : NULL;
      for (int64_t a = 0; a < g; a++) s[a * KEY_BLOCK + j] = visible ? dot_f32(q + a * d, kr, d) * scale : -INFINITY;
    }
    for (int64_t a = 0; a < g; a++) {
      float *sa = s + a * KEY_BLOCK, top = -INFINITY;
      for (int64_t j = 0; j < width; j++) top = sa[j] > top ? sa[j] : top;
      float next = m[a] > top ? m[a] : top, c = next == -INFINITY ? 1.0f : exp_nonpositive(m[a] - next);
      for (int64_t j = 0; j < width; j++) sa[j] = sa[j] == -INFINITY ? 0.0f : exp_nonpositive(sa[j] - next);
      float sum = 0.0f;
      for (int64_t j = 0; j < width; j++) sum += sa[j];
      l[a] = l[a] * c + sum, m[a] = next;
      if (c != 1.0f)
        for (int64_t t = 0; t < d; t++) acc[a * d + t] *= c;
    }
    for (int64_t j = 0; j < width; j++) {
      if (mask && !mask[j0 + j]) continue;
      const float *vr = as_f32(v + (j0 + j) * d * size, d, bf16, row);
      for (int64_t a = 0; a < g; a++) {
        float p = s[a * KEY_BLOCK + j];
        float *restrict out = acc + a * d;
        for (int64_t t = 0; t < d; t++) out[t] += p * vr[t];
      }
    }
  }
  for (int64_t a = 0; a < g; a++) {
    float inv = l[a] > 0.0f ? 1.0f / l[a] : 0.0f;
    for (int64_t t = 0; t < d; t++) acc[a * d + t] *= inv;
  }
}

/* The new columns into the cache: keys rotated, values copied. */
static void append_columns(const char *qkv, const char *cos, const char *sin, int64_t cos_batch_stride, int64_t b,
                           int64_t n, int64_t h, int64_t hkv, int64_t d, char *kc, char *vc, int64_t cap,
                           int64_t held, int bf16) {
  int64_t size = bf16 ? 2 : 4, width = (h + 2 * hkv) * d;
  for (int64_t r = 0; r < b; r++)
    for (int64_t i = 0; i < n; i++) {
      const char *x = qkv + ((r * n + i) * width + h * d) * size;
      int64_t at = (r * cos_batch_stride + i * d) * size;
      for (int64_t g = 0; g < hkv; g++) {
        int64_t column = ((r * hkv + g) * cap + held + i) * d * size;
        if (bf16)
          rope_head_bf16((const uint16_t *)(x + g * d * size), (const uint16_t *)(cos + at),
                         (const uint16_t *)(sin + at), d, (uint16_t *)(kc + column));
        else
          rope_head_f32((const float *)(x + g * d * size), (const float *)(cos + at), (const float *)(sin + at), d,
                        (float *)(kc + column));
        memcpy(vc + column, x + (hkv + g) * d * size, d * size);
      }
    }
}

/* Query head hh (of group g = hh / G) at position i of batch row r, rotated, as float32 into q [d]. */
static void rotated_query(const char *qkv, const char *cos, const char *sin, int64_t cos_batch_stride, int64_t r,
                          int64_t i, int64_t hh, int64_t n, int64_t width, int64_t d, int bf16, float *q) {
  int64_t size = bf16 ? 2 : 4, at = (r * cos_batch_stride + i * d) * size;
  const char *x = qkv + ((r * n + i) * width + hh * d) * size;
  if (bf16) {
    uint16_t q16[WIDEST_HEAD];
    rope_head_bf16((const uint16_t *)x, (const uint16_t *)(cos + at), (const uint16_t *)(sin + at), d, q16);
    for (int64_t j = 0; j < d; j++) q[j] = bf16_to_f32(q16[j]);
  } else {
    rope_head_f32((const float *)x, (const float *)(cos + at), (const float *)(sin + at), d, q);
  }
}

int ops_attend(const void *qkv, const void *cos, const void *sin, int64_t cos_batch_stride, int64_t b, int64_t n,
               int64_t h, int64_t hkv, int64_t d, void *kc, void *vc, int64_t cap, int64_t held, const uint8_t *mask,
               int64_t mask_batch, int64_t mask_row, float scale, void *out, int bf16, int threads) {
  if (d % 2 || d > WIDEST_HEAD || h % hkv || h / hkv > 64 || held + n > cap) return 1;
  int64_t size = bf16 ? 2 : 4, width = (h + 2 * hkv) * d, cols = held + n, tasks = b * hkv * n, group = h / hkv;
  append_columns((const char *)qkv, (const char *)cos, (const char *)sin, cos_batch_stride, b, n, h, hkv, d,
                 (char *)kc, (char *)vc, cap, held, bf16);
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks * group * cols * d >= 32768)
  for (int64_t task = 0; task < tasks; task++) {
    int64_t r = task / (hkv * n), g = task / n % hkv, i = task % n;
    float *q = malloc(sizeof(float) * (size_t)(group * (2 * d + KEY_BLOCK + 2)));
    float *acc = q + group * d, *s = acc + group * d, *m = s + group * KEY_BLOCK, *l = m + group;
    for (int64_t a = 0; a < group; a++)
      rotated_query((const char *)qkv, (const char *)cos, (const char *)sin, cos_batch_stride, r, i, g * group + a,
                    n, width, d, bf16, q + a * d);
    int64_t head = (r * hkv + g) * cap * d * size;
    attend_group(q, group, (const char *)kc + head, (const char *)vc + head, cols,
                 mask ? mask + r * mask_batch + i * mask_row : NULL, d, scale, bf16, acc, s, m, l);
    for (int64_t a = 0; a < group; a++) {
      char *o = (char *)out + ((r * n + i) * h + g * group + a) * d * size;  /* out [b, n, h, d] */
      for (int64_t j = 0; j < d; j++) {
        if (bf16) ((uint16_t *)o)[j] = f32_to_bf16(acc[a * d + j]);
        else ((float *)o)[j] = acc[a * d + j];
      }
    }
    free(q);
  }
  return 0;
}
