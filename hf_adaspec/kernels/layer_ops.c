/* The small operations of a decoder layer around its matrix products, one foreign call each (a q4 1.5B's
1-token step spent 13.5 of its 60 ms outside the kernel, RMSNorm 3.0 of it).

rms_norm: y = w * (x * rsqrt(mean(x^2) + eps)) per row (Zhang & Sennrich 2019, eq. 4), rounded as transformers'
Llama-family RMSNorm rounds it: x in float32, the mean of squares and the scaling in float32, the normalized row
rounded to the activations' dtype, then the product with the weight rounded to it. Rows are independent, so a
row's output does not depend on how many rows are computed with it. The sum of squares is taken in 16 partial
sums (torch's reduction order differs, so its last bit can differ). bfloat16 rounds to nearest even, as torch. */
#include <math.h>
#include <stdint.h>
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
