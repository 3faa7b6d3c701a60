/* Float helpers shared by the package's C kernels (q4.c, layer_ops.c): a float's bits and back, and e^x for x <= 0
written so that a compiler vectorizes it. cbuild hashes this header into the name of every library that includes it,
so an edit rebuilds them. */
#ifndef HF_ADASPEC_VECTOR_MATH_H
#define HF_ADASPEC_VECTOR_MATH_H
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

static inline float float_of(uint32_t u) {
  float v;
  memcpy(&v, &u, 4);
  return v;
}

/* e^x for x <= 0 (below -87: e^-87) to a few units in the last place: x = k ln 2 + r with |r| <= ln 2 / 2, e^r by
   its degree-6 Taylor polynomial, 2^k from the exponent's bits (Cody & Waite 1980); k rounded to nearest by adding
   and subtracting 1.5 * 2^23. Selections on integers only, so that a vector unit without masks runs it (a float
   comparison may trap, and the compiler keeps it a branch). */
static inline float exp_neg(float x) {
  uint32_t ux = bits_of(x), floor_bits = 0xc2ae0000u; /* -87.0f; both negative: the larger bits, the lower */
  x = float_of(ux > floor_bits ? floor_bits : ux);
  float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666667e-1f + r * (4.16666667e-2f + r * (8.33333333e-3f +
            r * 1.38888889e-3f)))));
  return p * float_of((uint32_t)((int32_t)k + 127) << 23);
}
#endif
