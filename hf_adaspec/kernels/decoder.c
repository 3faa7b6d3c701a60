/* decoder_layers: a stack of decoder layers of the Llama formula over a block of new tokens, as one foreign call:

    per layer: x = x + o(attention(rope(qkv(norm1(x))), cache)); x = x + down(swiglu(gate_up(norm2(x))))

This file holds only the order of the calls. Each operation is a function of the package's other libraries, passed in
``ops`` (q4.c's q4_linear and q4_swiglu, layer_ops.c's rms_norm, rope_split, attention and add), so each value is the
one those functions give when called one at a time from Python (``flat_forward``'s loop), to the bit. The new keys and
values are written into each layer's cache buffers at columns held .. held + n - 1 (the caller opened them). x [b, n,
hidden] is updated in place; the scratch holds one layer's intermediate values (in the activations' dtype; its parts
in ``parts_of``). Returns 0, or the first nonzero code of an operation (the stack stops there). */
#include <stdint.h>

typedef int (*q4_fn)(const uint8_t *, const int32_t *, const int64_t *, int, int64_t, int64_t, const float *, int,
                     const void *, int, int64_t, void *, int, int);
typedef int (*norm_fn)(const void *, const void *, int64_t, int64_t, float, void *, int, int);
typedef int (*rope_fn)(const void *, const void *, const void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       void *, void *, void *, int64_t, int64_t, int);
typedef int (*attention_fn)(const void *, const void *, const void *, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, float, void *, int, int);
typedef void (*add_fn)(void *, const void *, int64_t, int);

typedef struct {
  q4_fn linear, swiglu;
  norm_fn norm;
  rope_fn rope;
  attention_fn attention;
  add_fn add;
} ops;

/* A q4 matrix: q4_linear's leading arguments, and its output width. */
typedef struct {
  const uint8_t *w;
  const int32_t *kinds;
  const int64_t *rows;
  int64_t segments, k_in, k, out;
  const float *bias;
  int64_t isa;
} matrix;

typedef struct {
  const void *norm1, *norm2; /* the norms' weights [hidden] */
  float eps1, eps2, scale;
  matrix qkv, o, gate_up, down;
} layer;

typedef struct {
  void *k, *v; /* [b, kv_heads, columns, d] */
  int64_t columns;
} cache;

/* One call's block: x [b, n, hidden], cos and sin [b or 1, n, d] (cos_stride: n d, or 0 for one row of positions),
   the scratch. */
typedef struct {
  void *x;
  const void *cos, *sin;
  void *scratch;
  int64_t b, n, hidden, heads, kv_heads, d, held, cos_stride;
  int64_t bf16, threads;
} block;

static int product(q4_fn f, const matrix *m, const void *x, int64_t rows, void *y, const block *s) {
  return f(m->w, m->kinds, m->rows, (int)m->segments, m->k_in, m->k, m->bias, (int)m->isa, x, (int)s->bf16, rows, y,
           (int)s->bf16, (int)s->threads);
}

/* The scratch's parts, t = b n: the normalized input [t, hidden], qkv [t, qkv.out], the queries [t, heads d], the
   attention's output [t, heads d], a projection's output [t, hidden] and the SwiGLU's [t, gate_up.out / 2]. */
typedef struct {
  char *normed, *qkv, *queries, *attended, *projected, *gated;
} parts;

static parts parts_of(const layer *l, const block *s) {
  int64_t t = s->b * s->n, size = s->bf16 ? 2 : 4, heads = t * s->heads * s->d * size;
  parts p;
  p.normed = (char *)s->scratch;
  p.qkv = p.normed + t * s->hidden * size;
  p.queries = p.qkv + t * l->qkv.out * size;
  p.attended = p.queries + heads;
  p.projected = p.attended + heads;
  p.gated = p.projected + t * s->hidden * size;
  return p;
}

static int one_layer(const ops *f, const layer *l, const cache *c, const block *s) {
  int64_t t = s->b * s->n;
  int bf16 = (int)s->bf16, threads = (int)s->threads, rc;
  parts p = parts_of(l, s);
  if ((rc = f->norm(s->x, l->norm1, t, s->hidden, l->eps1, p.normed, bf16, threads))) return rc;
  if ((rc = product(f->linear, &l->qkv, p.normed, t, p.qkv, s))) return rc;
  if ((rc = f->rope(p.qkv, s->cos, s->sin, s->cos_stride, s->b, s->n, s->heads, s->kv_heads, s->d, p.queries, c->k,
                    c->v, c->columns, s->held, bf16)))
    return rc;
  if ((rc = f->attention(p.queries, c->k, c->v, s->b, s->n, s->heads, s->kv_heads, s->d, c->columns, s->held,
                         l->scale, p.attended, bf16, threads)))
    return rc;
  if ((rc = product(f->linear, &l->o, p.attended, t, p.projected, s))) return rc;
  f->add(s->x, p.projected, t * s->hidden, bf16);
  if ((rc = f->norm(s->x, l->norm2, t, s->hidden, l->eps2, p.normed, bf16, threads))) return rc;
  if ((rc = product(f->swiglu, &l->gate_up, p.normed, t, p.gated, s))) return rc;
  if ((rc = product(f->linear, &l->down, p.gated, t, p.projected, s))) return rc;
  f->add(s->x, p.projected, t * s->hidden, bf16);
  return 0;
}

int decoder_layers(const ops *f, const layer *layers, const cache *caches, int64_t count, const block *s) {
  for (int64_t i = 0; i < count; i++) {
    int rc = one_layer(f, layers + i, caches + i, s);
    if (rc) return rc;
  }
  return 0;
}
