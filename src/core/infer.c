/* Shape and dtype inference, one function per op in ops.def. Each names the op, the
 * shapes and the dtypes when it refuses. */
#include <math.h>
#include <string.h>
#include "kiln/ops.h"
#include "core/dtype.h"
#include "core/op_table.h"

#define SHP(t) kiln__shape_text(t)
/* An op's inference, kiln__infer_<name>; INFER_BY(name, rule): a row for an op that
 * shares its rule with others, rule(op name, in, n, a, out). */
#define INFER(name) kiln_status kiln__infer_##name(kiln_tensor_t *const *in, int n, const kiln__attrs *a, kiln__meta *out)
#define INFER_BY(name, rule) INFER(name) { return rule(#name, in, n, a, out); }

/* Eight buffers used in turn, so that one message can name several shapes. */
const char *kiln__shape_text(const kiln_tensor_t *t)
{
    static _Thread_local char ring[8][96];
    static _Thread_local unsigned next;
    return kiln__shape_str(t, ring[next++ % 8], sizeof ring[0]);
}

static void meta_shape(kiln__meta *m, kiln_dtype dt, int ndim, const int64_t *shape)
{
    m->dtype = dt;
    m->ndim = ndim;
    for (int i = 0; i < ndim; i++) m->shape[i] = shape[i];
}

static void meta_like(const kiln_tensor_t *t, kiln_dtype dt, kiln__meta *m) { meta_shape(m, dt, t->ndim, t->shape); }

int kiln__norm_dim(int dim, int ndim)
{
    if (dim < 0) dim += ndim;
    return dim >= 0 && dim < (ndim > 0 ? ndim : 1) ? dim : -1;
}

static kiln_status bad_dim(const char *op, int dim, const kiln_tensor_t *t)
{
    return kiln__err(KILN_ERR_INDEX, "%s: dim %d is out of range for %s", op, dim, SHP(t));
}

/* Saved statistics (mean, rstd, logsumexp) are f64 for f64 inputs, f32 otherwise. */
static kiln_dtype stat_dtype(kiln_dtype dt) { return dt == KILN_DTYPE_F64 ? KILN_DTYPE_F64 : KILN_DTYPE_F32; }

static kiln_status need_float(const char *op, const kiln_tensor_t *t)
{
    if (kiln_dtype_is_float(t->dtype)) return KILN_OK;
    return kiln__err(KILN_ERR_DTYPE, "%s: %s is not a float tensor (cast it with kiln_cast first)", op, SHP(t));
}

static kiln_status need_index(const char *op, const kiln_tensor_t *t)
{
    if (t->dtype == KILN_DTYPE_I32 || t->dtype == KILN_DTYPE_I64) return KILN_OK;
    return kiln__err(KILN_ERR_DTYPE, "%s: index tensor %s must be i32 or i64", op, SHP(t));
}

static int rank(kiln_dtype dt)
{
    static const int r[KILN_DTYPE_COUNT] = {
        [KILN_DTYPE_BOOL] = 0, [KILN_DTYPE_U8] = 1, [KILN_DTYPE_I32] = 2, [KILN_DTYPE_I64] = 3,
        [KILN_DTYPE_BF16] = 4, [KILN_DTYPE_F16] = 5, [KILN_DTYPE_F32] = 6, [KILN_DTYPE_F64] = 7,
    };
    return r[dt];
}

kiln_dtype kiln__promote(kiln_dtype a, kiln_dtype b)
{
    if ((a == KILN_DTYPE_F16 && b == KILN_DTYPE_BF16) || (a == KILN_DTYPE_BF16 && b == KILN_DTYPE_F16))
        return KILN_DTYPE_F32;
    return rank(a) >= rank(b) ? a : b;
}

kiln_status kiln__broadcast_shapes(const char *op, int n, kiln_tensor_t *const *ts, kiln__meta *out)
{
    int nd = 0;
    for (int i = 0; i < n; i++)
        if (ts[i]->ndim > nd) nd = ts[i]->ndim;
    out->ndim = nd;
    for (int d = 0; d < nd; d++) {
        int64_t s = 1;
        for (int i = 0; i < n; i++) {
            int k = d - (nd - ts[i]->ndim);
            if (k < 0) continue;
            int64_t v = ts[i]->shape[k];
            if (v == s || v == 1) continue;
            if (s == 1) {
                s = v;
                continue;
            }
            return kiln__err(KILN_ERR_SHAPE, "%s: shapes %s and %s do not broadcast (dim %d: %lld vs %lld)", op,
                             SHP(ts[0]), SHP(ts[n > 1 ? 1 : 0]), d, (long long)s, (long long)v);
        }
        out->shape[d] = s;
    }
    return KILN_OK;
}

/* A binary pointwise op (src/core/binary.def): broadcast shapes; the promoted dtype
 * (B_FLOAT: which must be a float), or bool for a comparison. */
enum { B_ANY, B_FLOAT, B_BOOL };
static kiln_status binary(const char *op, kiln_tensor_t *const *in, kiln__meta *out, int kind)
{
    kiln_status s = kiln__broadcast_shapes(op, 2, in, out);
    out->dtype = kind == B_BOOL ? KILN_DTYPE_BOOL : kiln__promote(in[0]->dtype, in[1]->dtype);
    if (s == KILN_OK && kind == B_FLOAT && !kiln_dtype_is_float(out->dtype)) return need_float(op, in[0]);
    return s;
}

/* x's shape and dtype: a float one (unary_float), or any (unary_any; for a pointwise
 * backward op (x, g), the gradient's). */
static kiln_status unary_float(const char *op, kiln_tensor_t *const *in, int n, const kiln__attrs *a, kiln__meta *out)
{
    kiln_status s = need_float(op, in[0]);
    meta_like(in[0], in[0]->dtype, out);
    return s;
}

static kiln_status unary_any(const char *op, kiln_tensor_t *const *in, int n, const kiln__attrs *a, kiln__meta *out)
{
    meta_like(in[0], in[0]->dtype, out);
    return KILN_OK;
}

#define KILN_BINARY(ID, name, dtypes, ...) INFER(name) { return binary(#name, in, out, B_##dtypes); }
#include "core/binary.def"
#undef KILN_BINARY

INFER_BY(gelu, unary_float)
INFER_BY(gelu_backward, unary_any)
INFER_BY(contiguous, unary_any)
/* The rows of include/kiln/pointwise.def: FLOAT or ANY, and the backward op's (x, g). */
#define UNARY_FLOAT(name) INFER_BY(name, unary_float)
#define UNARY_ANY(name) INFER_BY(name, unary_any)
#define KILN_PW(ID, name, dtypes, grad, fast) UNARY_##dtypes(name) KILN__PW_IF_OP(grad, UNARY_ANY(name##_backward))
#include "kiln/pointwise.def"
#undef KILN_PW

INFER(where)
{
    kiln_status s = kiln__broadcast_shapes("where", 3, in, out);
    out->dtype = kiln__promote(in[1]->dtype, in[2]->dtype);
    return s;
}

INFER(cast)
{
    if ((uint64_t)a->op.cast.dtype >= KILN_DTYPE_COUNT) return kiln__err(KILN_ERR_DTYPE, "cast: unknown dtype %lld", (long long)a->op.cast.dtype);
    meta_like(in[0], (kiln_dtype)a->op.cast.dtype, out);
    return KILN_OK;
}

/* Reductions keep a dim list in a->shape; an empty list means all dims. */
static kiln_status reduce_shape(const char *op, const kiln_tensor_t *t, const kiln__attrs *a, kiln__meta *out)
{
    bool red[KILN_MAX_DIMS] = {0};
    for (int k = 0; k < a->ndim; k++) {
        int d = (int)a->shape[k];
        if (d < 0 || d >= t->ndim) return bad_dim(op, d, t);
        red[d] = true;
    }
    out->ndim = 0;
    for (int d = 0; d < t->ndim; d++) {
        bool r = a->ndim == 0 || red[d];
        if (!r) out->shape[out->ndim++] = t->shape[d];
        else if (a->keepdim) out->shape[out->ndim++] = 1;
    }
    return KILN_OK;
}

INFER(sum)
{
    out->dtype = kiln_dtype_is_float(in[0]->dtype) ? in[0]->dtype : KILN_DTYPE_I64;
    return reduce_shape("sum", in[0], a, out);
}

INFER(max)
{
    out->dtype = in[0]->dtype;
    if (kiln__numel(in[0]->ndim, in[0]->shape) == 0)
        return kiln__err(KILN_ERR_SHAPE, "max: the input has no elements");
    return reduce_shape("max", in[0], a, out);
}

INFER(argmax)
{
    out->dtype = KILN_DTYPE_I64;
    if (in[0]->ndim == 0 || in[0]->shape[a->op.dim.dim] == 0)
        return kiln__err(KILN_ERR_SHAPE, "argmax: the input has no elements along dim %lld", (long long)a->op.dim.dim);
    kiln__attrs r = *a;
    r.ndim = 1;
    r.shape[0] = a->op.dim.dim;
    return reduce_shape("argmax", in[0], &r, out);
}

/* The softmaxes: a float x, along one of its dims (dim 0 of a 0-dim x). */
static kiln_status along_dim(const char *op, kiln_tensor_t *const *in, int n, const kiln__attrs *a, kiln__meta *out)
{
    if (a->op.dim.dim < 0 || a->op.dim.dim >= (in[0]->ndim ? in[0]->ndim : 1)) return bad_dim(op, (int)a->op.dim.dim, in[0]);
    return unary_float(op, in, n, a, out);
}

INFER_BY(softmax, along_dim)
INFER_BY(log_softmax, along_dim)

INFER(matmul)
{
    const kiln_tensor_t *x = in[0], *y = in[1];
    if (x->ndim < 2 || y->ndim < 2)
        return kiln__err(KILN_ERR_SHAPE, "matmul: %s @ %s needs at least 2 dims each", SHP(x), SHP(y));
    if (x->dtype != y->dtype || !kiln_dtype_is_float(x->dtype))
        return kiln__err(KILN_ERR_DTYPE, "matmul: %s @ %s: both must be of one float type (f32, f64, f16 or bf16)",
                         SHP(x), SHP(y));
    int64_t k1 = x->shape[x->ndim - 1], k2 = y->shape[y->ndim - 2];
    if (k1 != k2)
        return kiln__err(KILN_ERR_SHAPE, "matmul: %s @ %s: inner dims %lld and %lld differ", SHP(x), SHP(y),
                         (long long)k1, (long long)k2);
    /* Broadcast the batch dims. */
    int bx = x->ndim - 2, by = y->ndim - 2, nb = bx > by ? bx : by;
    for (int d = 0; d < nb; d++) {
        int i = d - (nb - bx), j = d - (nb - by);
        int64_t sx = i >= 0 ? x->shape[i] : 1, sy = j >= 0 ? y->shape[j] : 1;
        if (sx != sy && sx != 1 && sy != 1)
            return kiln__err(KILN_ERR_SHAPE, "matmul: batch dims of %s and %s do not broadcast", SHP(x), SHP(y));
        out->shape[d] = sx > sy ? sx : sy;
    }
    out->ndim = nb + 2;
    out->shape[nb] = x->shape[x->ndim - 2];
    out->shape[nb + 1] = y->shape[y->ndim - 1];
    out->dtype = x->dtype;
    return KILN_OK;
}

INFER(embedding)
{
    if (in[0]->ndim != 2) return kiln__err(KILN_ERR_SHAPE, "embedding: weight %s must be (V, C)", SHP(in[0]));
    kiln_status s = need_index("embedding", in[1]);
    if (s != KILN_OK) return s;
    if (in[1]->ndim >= KILN_MAX_DIMS) return kiln__err(KILN_ERR_SHAPE, "embedding: index has too many dims");
    meta_like(in[1], in[0]->dtype, out);
    out->shape[out->ndim++] = in[0]->shape[1];
    return KILN_OK;
}

INFER(index_select)
{
    kiln_status s = need_index("index_select", in[1]);
    if (s != KILN_OK) return s;
    if (in[1]->ndim != 1) return kiln__err(KILN_ERR_SHAPE, "index_select: index %s must be 1-D", SHP(in[1]));
    if (a->op.dim.dim < 0 || a->op.dim.dim >= in[0]->ndim) return bad_dim("index_select", (int)a->op.dim.dim, in[0]);
    meta_like(in[0], in[0]->dtype, out);
    out->shape[a->op.dim.dim] = in[1]->shape[0];
    return KILN_OK;
}

/* gather's and scatter_add's index: the input's dims, and no larger than it but along dim
 * (a wider index would address elements outside the output). */
static kiln_status index_fits(const char *op, kiln_tensor_t *const *in, int64_t dim)
{
    if (in[1]->ndim != in[0]->ndim)
        return kiln__err(KILN_ERR_SHAPE, "%s: index %s must have the dims of the input %s", op, SHP(in[1]), SHP(in[0]));
    if (dim < 0 || dim >= in[0]->ndim) return bad_dim(op, (int)dim, in[0]);
    for (int d = 0; d < in[0]->ndim; d++)
        if (d != dim && in[1]->shape[d] > in[0]->shape[d])
            return kiln__err(KILN_ERR_SHAPE, "%s: index %s is larger than the input %s in dim %d", op, SHP(in[1]),
                             SHP(in[0]), d);
    return KILN_OK;
}

INFER(gather)
{
    kiln_status s = need_index("gather", in[1]);
    if (s == KILN_OK) s = index_fits("gather", in, a->op.dim.dim);
    meta_like(in[1], in[0]->dtype, out);
    return s;
}

INFER(scatter_add)
{
    kiln_status s = need_index("scatter_add", in[1]);
    if (s != KILN_OK) return s;
    if (in[1]->ndim != in[2]->ndim || memcmp(in[1]->shape, in[2]->shape, sizeof(int64_t) * (size_t)in[1]->ndim))
        return kiln__err(KILN_ERR_SHAPE, "scatter_add: index %s and source %s must have one shape", SHP(in[1]), SHP(in[2]));
    if ((s = index_fits("scatter_add", in, a->op.dim.dim)) != KILN_OK) return s;
    if (in[2]->dtype != in[0]->dtype)
        return kiln__err(KILN_ERR_DTYPE, "scatter_add: source %s and input %s dtypes differ", SHP(in[2]), SHP(in[0]));
    return unary_any("scatter_add", in, n, a, out);
}

/* x (..., C) with n - 1 per-channel parameters (C); as many statistics (...), in f32
 * (layer_norm: w, b; mean, rstd. rms_norm: w; rstd). */
static kiln_status norm(const char *op, kiln_tensor_t *const *in, int n, const kiln__attrs *a, kiln__meta *out)
{
    const kiln_tensor_t *x = in[0];
    kiln_status s = need_float(op, x);
    if (s != KILN_OK) return s;
    if (x->ndim < 1) return kiln__err(KILN_ERR_SHAPE, "%s: input %s needs at least 1 dim", op, SHP(x));
    int64_t c = x->shape[x->ndim - 1];
    for (int p = 1; p < n; p++)
        if (in[p]->ndim != 1 || in[p]->shape[0] != c || in[p]->dtype != x->dtype)
            return kiln__err(KILN_ERR_SHAPE, "%s: parameter %s must be %s[%lld] for input %s", op, SHP(in[p]),
                             kiln_dtype_name(x->dtype), (long long)c, SHP(x));
    meta_like(x, x->dtype, &out[0]);
    for (int k = 1; k < n; k++) meta_shape(&out[k], stat_dtype(x->dtype), x->ndim - 1, x->shape);
    return KILN_OK;
}

INFER_BY(layer_norm, norm)
INFER_BY(rms_norm, norm)

INFER(cross_entropy)
{
    kiln_status s = need_float("cross_entropy", in[0]);
    if (s == KILN_OK) s = need_index("cross_entropy", in[1]);
    if (s != KILN_OK) return s;
    if (in[0]->ndim != 2 || in[1]->ndim != 1 || in[1]->shape[0] != in[0]->shape[0])
        return kiln__err(KILN_ERR_SHAPE, "cross_entropy: logits %s must be (N, V) and targets %s (N)", SHP(in[0]),
                         SHP(in[1]));
    meta_shape(&out[0], in[0]->dtype, 0, NULL);
    meta_shape(&out[1], stat_dtype(in[0]->dtype), 1, in[0]->shape);
    return KILN_OK;
}

INFER(dropout)
{
    double p = a->op.dropout.p;
    if (!(p >= 0 && p < 1)) return kiln__err(KILN_ERR_ARG, "dropout: p = %g is outside [0, 1)", p);
    kiln_status s = unary_float("dropout", in, n, a, out);
    meta_like(in[0], KILN_DTYPE_U8, &out[1]);
    return s;
}

INFER(cat)
{
    if (n < 1) return kiln__err(KILN_ERR_ARG, "cat: no tensors given");
    int dim = (int)a->op.dim.dim;
    if (dim < 0 || dim >= in[0]->ndim) return bad_dim("cat", dim, in[0]);
    meta_like(in[0], in[0]->dtype, out);
    out->shape[dim] = 0;
    for (int i = 0; i < n; i++) {
        bool ok = in[i]->ndim == in[0]->ndim && in[i]->dtype == in[0]->dtype;
        for (int d = 0; ok && d < in[0]->ndim; d++) ok = d == dim || in[i]->shape[d] == in[0]->shape[d];
        if (!ok)
            return kiln__err(KILN_ERR_SHAPE, "cat: tensor %d %s does not fit tensor 0 %s along dim %d", i, SHP(in[i]),
                             SHP(in[0]), dim);
        out->shape[dim] += in[i]->shape[dim];
    }
    return KILN_OK;
}

INFER(tri)
{
    if (in[0]->ndim < 2) return kiln__err(KILN_ERR_SHAPE, "tril/triu: %s needs at least 2 dims", SHP(in[0]));
    return unary_any("tri", in, n, a, out);
}

/* theta and the scaling, checked where the op is called rather than in its kernels */
static kiln_status rope_attrs_check(const char *op, const kiln__attrs *a)
{
    if (!(a->op.rope.theta > 0))
        return kiln__err(KILN_ERR_ARG, "%s: theta = %g must be positive", op, a->op.rope.theta);
    return kiln_rope_scaling_check(&a->op.rope.scaling);
}

INFER(rope)
{
    if (in[0]->ndim < 2 || in[0]->shape[in[0]->ndim - 1] % 2)
        return kiln__err(KILN_ERR_SHAPE, "rope: input %s must be (..., T, D) with D even", SHP(in[0]));
    kiln_status s = rope_attrs_check("rope", a);
    return s != KILN_OK ? s : unary_float("rope", in, n, a, out);
}

INFER(attention)
{
    const kiln_tensor_t *q = in[0], *k = in[1], *v = in[2];
    bool ok = q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && q->shape[0] == k->shape[0] &&
              k->shape[0] == v->shape[0] && k->shape[1] == v->shape[1] && k->shape[2] == v->shape[2] &&
              q->shape[3] == k->shape[3] && k->shape[3] == v->shape[3] && k->shape[1] > 0 &&
              q->shape[1] % k->shape[1] == 0 && (!a->op.attention.causal || q->shape[2] <= k->shape[2]);
    if (!ok)
        return kiln__err(KILN_ERR_SHAPE, "attention: q %s, k %s, v %s must be (B,H,Tq,D), (B,Hkv,Tk,D), (B,Hkv,Tk,D) with "
                         "H a multiple of Hkv (and Tq <= Tk when causal)", SHP(q), SHP(k), SHP(v));
    if (q->dtype != k->dtype || k->dtype != v->dtype || !kiln_dtype_is_float(q->dtype))
        return kiln__err(KILN_ERR_DTYPE, "attention: q %s, k %s, v %s must be of one float type (f32, f64, f16 or bf16)",
                         SHP(q), SHP(k), SHP(v));
    meta_like(q, q->dtype, &out[0]);
    meta_shape(&out[1], stat_dtype(q->dtype), 3, q->shape);
    return KILN_OK;
}

INFER(matmul_rows_packed)
{
    const kiln_tensor_t *x = in[0], *w = in[1];
    int64_t cols = a->op.rows_packed.cols;
    if (w->dtype == KILN_DTYPE_U8) { /* q8_0 blocks: (ceil(n/16), K/32, KILN_ROWS_Q8_BYTES) */
        if (x->ndim != 2 || w->ndim != 3 || x->shape[1] != w->shape[1] * KILN_ROWS_Q8_BLOCK ||
            w->shape[2] != KILN_ROWS_Q8_BYTES || cols < 1 || cols > w->shape[0] * KILN_ROWS_PANEL ||
            cols <= (w->shape[0] - 1) * KILN_ROWS_PANEL)
            return kiln__err(KILN_ERR_SHAPE, "matmul_rows_packed: a %s and q8_0 packed w %s for %lld columns must be "
                             "(M,K) and (ceil(n/%d),K/%d,%d)", SHP(x), SHP(w), (long long)cols, KILN_ROWS_PANEL,
                             KILN_ROWS_Q8_BLOCK, KILN_ROWS_Q8_BYTES);
        if (x->dtype != KILN_DTYPE_F32)
            return kiln__err(KILN_ERR_DTYPE, "matmul_rows_packed: a %s must be f32", SHP(x));
        int64_t shape[2] = {x->shape[0], cols};
        meta_shape(&out[0], KILN_DTYPE_F32, 2, shape);
        return KILN_OK;
    }
    if (x->ndim != 2 || w->ndim != 3 || x->shape[1] != w->shape[1] || w->shape[2] != KILN_ROWS_PANEL || cols < 1 ||
        cols > w->shape[0] * KILN_ROWS_PANEL || cols <= (w->shape[0] - 1) * KILN_ROWS_PANEL)
        return kiln__err(KILN_ERR_SHAPE, "matmul_rows_packed: a %s and packed w %s for %lld columns must be (M,K) and "
                         "(ceil(n/%d),K,%d)", SHP(x), SHP(w), (long long)cols, KILN_ROWS_PANEL, KILN_ROWS_PANEL);
    if (x->dtype != KILN_DTYPE_F32 || !kiln__f32_or_half(w->dtype))
        return kiln__err(KILN_ERR_DTYPE, "matmul_rows_packed: a %s must be f32 and w %s f32, bf16, f16 or u8 (q8_0)", SHP(x),
                         SHP(w));
    int64_t shape[2] = {x->shape[0], cols};
    meta_shape(&out[0], KILN_DTYPE_F32, 2, shape);
    return KILN_OK;
}

INFER(rope_at)
{
    const kiln_tensor_t *x = in[0], *pos = in[1];
    if (x->ndim != 3 || x->shape[2] % 2 || pos->ndim != 1 || pos->shape[0] != x->shape[0])
        return kiln__err(KILN_ERR_SHAPE, "rope_at: x %s must be (N,H,D) with D even and pos %s must be (N)", SHP(x),
                         SHP(pos));
    kiln_status s = need_index("rope_at", pos);
    if (s == KILN_OK) s = rope_attrs_check("rope_at", a);
    return s != KILN_OK ? s : unary_float("rope_at", in, n, a, out);
}

INFER(paged_attention)
{
    const kiln_tensor_t *q = in[0], *k = in[1], *v = in[2], *bt = in[3], *sp = in[4];
    bool ok = q->ndim == 3 && k->ndim == 3 && v->ndim == 3 && bt->ndim == 2 && sp->ndim == 2 && sp->shape[1] == 2 &&
              sp->shape[0] == q->shape[0] && k->shape[0] == v->shape[0] && k->shape[1] == v->shape[1] &&
              k->shape[1] > 0 && q->shape[1] % k->shape[1] == 0 && q->shape[2] == k->shape[2] &&
              k->shape[2] == v->shape[2] && a->op.paged_attention.block_len >= 1 && k->shape[0] % a->op.paged_attention.block_len == 0;
    if (!ok)
        return kiln__err(KILN_ERR_SHAPE, "paged_attention: q %s, k_pages %s, v_pages %s, block_table %s, seq_pos %s must "
                         "be (N,H,D), (S,Hkv,D), (S,Hkv,D), (n_seqs,max_blocks), (N,2) with H a multiple of Hkv and S a "
                         "multiple of block_len %lld", SHP(q), SHP(k), SHP(v), SHP(bt), SHP(sp),
                         (long long)a->op.paged_attention.block_len);
    bool kv_ok = k->dtype == v->dtype &&
                 (k->dtype == KILN_DTYPE_F32 || k->dtype == KILN_DTYPE_F16 || k->dtype == KILN_DTYPE_BF16);
    if (q->dtype != KILN_DTYPE_F32 || !kv_ok)
        return kiln__err(KILN_ERR_DTYPE, "paged_attention: q %s must be f32, and k_pages %s and v_pages %s one type of "
                         "f32, f16 or bf16", SHP(q), SHP(k), SHP(v));
    if (bt->dtype != KILN_DTYPE_I32 || sp->dtype != KILN_DTYPE_I32)
        return kiln__err(KILN_ERR_DTYPE, "paged_attention: block_table %s and seq_pos %s must be i32", SHP(bt), SHP(sp));
    const kiln_paged_variant *var = &a->op.paged_attention.v;
    if (var->window < 0 || !(var->softcap >= 0) || isinf(var->softcap))
        return kiln__err(KILN_ERR_ARG, "paged_attention: window %lld must be >= 0 (0: every position) and softcap %g a "
                         "finite number >= 0 (0: none)", (long long)var->window, var->softcap);
    return unary_any("paged_attention", in, n, a, out);
}

/* Mixture-of-experts routing. topk: x (..., E) float -> values (..., k) of x's dtype and
 * indices (..., k) i64. */
INFER(topk)
{
    const kiln_tensor_t *x = in[0];
    kiln_status s = need_float("topk", x);
    if (s != KILN_OK) return s;
    if (x->ndim < 1) return kiln__err(KILN_ERR_SHAPE, "topk: x %s needs at least 1 dim (..., E)", SHP(x));
    int64_t E = x->shape[x->ndim - 1], k = a->op.topk.k;
    if (k < 1 || k > E)
        return kiln__err(KILN_ERR_ARG, "topk: k %lld is outside 1..%lld, the last dim of x %s", (long long)k,
                         (long long)E, SHP(x));
    meta_like(x, x->dtype, &out[0]);
    out[0].shape[x->ndim - 1] = k;
    meta_like(x, KILN_DTYPE_I64, &out[1]);
    out[1].shape[x->ndim - 1] = k;
    return KILN_OK;
}

/* moe_sort: indices (N, k) (any shape, read in row-major order) i32/i64 -> order (N*k)
 * and offsets (E + 1), both i64. */
INFER(moe_sort)
{
    const kiln_tensor_t *idx = in[0];
    kiln_status s = need_index("moe_sort", idx);
    if (s != KILN_OK) return s;
    int64_t E = a->op.moe_sort.n_experts;
    if (E < 1) return kiln__err(KILN_ERR_ARG, "moe_sort: n_experts %lld must be at least 1", (long long)E);
    int64_t count = kiln__numel(idx->ndim, idx->shape), e1 = E + 1;
    meta_shape(&out[0], KILN_DTYPE_I64, 1, &count);
    meta_shape(&out[1], KILN_DTYPE_I64, 1, &e1);
    return KILN_OK;
}

/* grouped_matmul: x (M, K), w (E, K, N) of one float type, offsets (E + 1) i32/i64 ->
 * (M, N). The offsets' values are the kernel's to check (they are data). */
INFER(grouped_matmul)
{
    const kiln_tensor_t *x = in[0], *w = in[1], *off = in[2];
    if (x->ndim != 2 || w->ndim != 3 || off->ndim != 1 || x->shape[1] != w->shape[1] ||
        off->shape[0] != w->shape[0] + 1)
        return kiln__err(KILN_ERR_SHAPE, "grouped_matmul: x %s, w %s, offsets %s must be (M,K), (E,K,N) and (E+1)",
                         SHP(x), SHP(w), SHP(off));
    if (x->dtype != w->dtype || !kiln_dtype_is_float(x->dtype))
        return kiln__err(KILN_ERR_DTYPE, "grouped_matmul: x %s and w %s must be of one float type (f32, f64, f16 or "
                         "bf16)", SHP(x), SHP(w));
    kiln_status s = need_index("grouped_matmul", off);
    if (s != KILN_OK) return s;
    int64_t shape[2] = {x->shape[0], w->shape[2]};
    meta_shape(&out[0], x->dtype, 2, shape);
    return KILN_OK;
}

/* Views: strides and offset relative to the input's storage, starting from its own
 * (kiln__meta_of). */
/* Strides for viewing t as `shape` without a copy, if they exist: each run of merged
 * input dims must be contiguous with itself. */
INFER(view)
{
    const kiln_tensor_t *t = in[0];
    if (kiln__numel(a->ndim, a->shape) != kiln__numel(t->ndim, t->shape))
        return kiln__err(KILN_ERR_SHAPE, "view: cannot view %s (%lld elements) as %d dims of %lld elements", SHP(t),
                         (long long)kiln__numel(t->ndim, t->shape), a->ndim, (long long)kiln__numel(a->ndim, a->shape));
    kiln__meta_of(t, out);
    meta_shape(out, t->dtype, a->ndim, a->shape);
    if (t->ndim == 0 || kiln__numel(t->ndim, t->shape) == 0) {
        kiln__contiguous_strides(a->ndim, a->shape, out->stride);
        return KILN_OK;
    }
    int view_d = a->ndim - 1;
    int64_t base = t->stride[t->ndim - 1], tensor_numel = 1, view_numel = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        tensor_numel *= t->shape[d];
        if (d == 0 || (t->shape[d - 1] != 1 && t->stride[d - 1] != tensor_numel * base)) {
            while (view_d >= 0 && (view_numel < tensor_numel || a->shape[view_d] == 1)) {
                out->stride[view_d] = view_numel * base;
                view_numel *= a->shape[view_d];
                view_d--;
            }
            if (view_numel != tensor_numel)
                return kiln__err(KILN_ERR_SHAPE, "view: %s is not contiguous enough to view; use kiln_reshape", SHP(t));
            if (d > 0) {
                base = t->stride[d - 1];
                tensor_numel = view_numel = 1;
            }
        }
    }
    if (view_d != -1) return kiln__err(KILN_ERR_SHAPE, "view: %s cannot be viewed as asked; use kiln_reshape", SHP(t));
    return KILN_OK;
}

INFER(permute)
{
    const kiln_tensor_t *t = in[0];
    bool seen[KILN_MAX_DIMS] = {0};
    if (a->ndim != t->ndim) return kiln__err(KILN_ERR_ARG, "permute: %d dims given for %s", a->ndim, SHP(t));
    kiln__meta_of(t, out);
    for (int d = 0; d < t->ndim; d++) {
        int64_t s = a->shape[d];
        if (s < 0 || s >= t->ndim || seen[s]) return kiln__err(KILN_ERR_ARG, "permute: the order is not a permutation of %d dims", t->ndim);
        seen[s] = true;
        out->shape[d] = t->shape[s];
        out->stride[d] = t->stride[s];
    }
    return KILN_OK;
}

INFER(slice)
{
    const kiln_tensor_t *t = in[0];
    int dim = (int)a->op.slice.dim;
    if (dim < 0 || dim >= t->ndim) return bad_dim("slice", dim, t);
    kiln__meta_of(t, out);
    out->shape[dim] = a->op.slice.length;
    out->stride[dim] = t->stride[dim] * a->op.slice.step;
    out->offset = t->offset + a->op.slice.start * t->stride[dim];
    return KILN_OK;
}

INFER(expand)
{
    const kiln_tensor_t *t = in[0];
    if (a->ndim < t->ndim) return kiln__err(KILN_ERR_SHAPE, "expand: %s has more dims than the %d-dim target", SHP(t), a->ndim);
    kiln__meta_of(t, out);
    out->ndim = a->ndim;
    for (int d = 0; d < a->ndim; d++) {
        int k = d - (a->ndim - t->ndim);
        int64_t want = a->shape[d];
        if (k < 0) {
            out->shape[d] = want;
            out->stride[d] = 0;
        } else if (want == -1 || want == t->shape[k]) {
            out->shape[d] = t->shape[k];
            out->stride[d] = t->stride[k];
        } else if (t->shape[k] == 1) {
            out->shape[d] = want;
            out->stride[d] = 0;
        } else {
            return kiln__err(KILN_ERR_SHAPE, "expand: dim %d of %s is %lld, cannot expand to %lld", k, SHP(t),
                             (long long)t->shape[k], (long long)want);
        }
        if (out->shape[d] < 0) return kiln__err(KILN_ERR_SHAPE, "expand: negative size in dim %d", d);
    }
    return KILN_OK;
}

static kiln_status creation(const char *op, kiln_tensor_t *const *in, int n, const kiln__attrs *a, kiln__meta *out)
{
    meta_shape(out, a->op.source.dtype, a->ndim, a->shape);
    return KILN_OK;
}

INFER_BY(full, creation)
INFER_BY(arange, creation)
INFER_BY(rand, creation)

/* In-place ops: src must broadcast to dst; nothing is allocated. */
static kiln_status into(const char *op, kiln_tensor_t *const *in, int n, const kiln__attrs *a, kiln__meta *out)
{
    kiln__meta m;
    kiln_status s = kiln__broadcast_shapes(op, 2, in, &m);
    if (s != KILN_OK) return s;
    if (m.ndim != in[0]->ndim || memcmp(m.shape, in[0]->shape, sizeof(int64_t) * (size_t)m.ndim))
        return kiln__err(KILN_ERR_SHAPE, "%s: source %s does not broadcast to the destination %s", op, SHP(in[1]),
                         SHP(in[0]));
    return KILN_OK;
}

INFER_BY(add_, into)
INFER_BY(copy_, into)
INFER(index_copy_)
{
    const kiln_tensor_t *dst = in[0], *idx = in[1], *src = in[2];
    bool ok = dst->ndim >= 1 && idx->ndim == 1 && src->ndim == dst->ndim && src->shape[0] == idx->shape[0];
    for (int d = 1; ok && d < dst->ndim; d++) ok = src->shape[d] == dst->shape[d];
    if (!ok)
        return kiln__err(KILN_ERR_SHAPE, "index_copy_: dst %s, index %s, src %s: src must be (n, ...) with dst's row shape "
                         "and index (n)", SHP(dst), SHP(idx), SHP(src));
    if (src->dtype != dst->dtype)
        return kiln__err(KILN_ERR_DTYPE, "index_copy_: src %s and dst %s differ in dtype", SHP(src), SHP(dst));
    return need_index("index_copy_", idx);
}
INFER(scale_) { return KILN_OK; }
INFER(fill_) { return KILN_OK; }

INFER(adamw_)
{
    for (int i = 0; i < 4; i++) {
        if (in[i]->dtype != KILN_DTYPE_F32 || in[i]->ndim != in[0]->ndim ||
            memcmp(in[i]->shape, in[0]->shape, sizeof(int64_t) * (size_t)in[0]->ndim) || !kiln__is_contiguous(in[i]))
            return kiln__err(KILN_ERR_SHAPE, "adamw_: tensor %d %s must be contiguous f32 shaped like the parameter %s", i,
                             SHP(in[i]), SHP(in[0]));
    }
    static const char *const scalar[3] = {"lr", "step", "gscale"};
    for (int i = 4; i < 7; i++) {
        if ((in[i]->dtype != KILN_DTYPE_F32 && in[i]->dtype != KILN_DTYPE_F64) ||
            kiln__numel(in[i]->ndim, in[i]->shape) != 1)
            return kiln__err(KILN_ERR_SHAPE, "adamw_: %s %s must be a one-element f32 or f64 tensor", scalar[i - 4],
                             SHP(in[i]));
    }
    return KILN_OK;
}

INFER(check_min)
{
    kiln_dtype dt = in[0]->dtype;
    if (dt != KILN_DTYPE_F32 && dt != KILN_DTYPE_F64 && dt != KILN_DTYPE_I32 && dt != KILN_DTYPE_I64)
        return kiln__err(KILN_ERR_DTYPE, "check_min: %s must be f32, f64, i32 or i64", SHP(in[0]));
    return unary_any("check_min", in, n, a, out);
}

/* Collectives: an f32 or f64 tensor (and a source of its dtype) and a process group.
 * Sizes are the group's to check when it runs (the infer step knows no world size). */
static kiln_status collective(const char *op, kiln_tensor_t *const *in, int n, const kiln__attrs *a, kiln__meta *out)
{
    if (in[0]->dtype != KILN_DTYPE_F32 && in[0]->dtype != KILN_DTYPE_F64)
        return kiln__err(KILN_ERR_DTYPE, "%s: %s must be f32 or f64", op, SHP(in[0]));
    if (n > 1 && in[1]->dtype != in[0]->dtype)
        return kiln__err(KILN_ERR_DTYPE, "%s: source %s and destination %s differ in dtype", op, SHP(in[1]), SHP(in[0]));
    if (!a->op.collective.group || !a->op.collective.ops) return kiln__err(KILN_ERR_ARG, "%s: no process group", op);
    return KILN_OK;
}

INFER_BY(allreduce_, collective)
INFER_BY(reduce_scatter_, collective)
INFER_BY(allgather_, collective)

/* all_to_all: x (R, ...) of any dtype and send_counts (world) i32/i64 -> y (rows, ...)
 * of x's dtype and recv_counts (world) i64. The counts' values are the group's to check
 * when it runs (data, as a graph's). */
INFER(all_to_all)
{
    (void)n;
    const kiln_tensor_t *x = in[0], *sc = in[1];
    const kiln__collective_attrs *c = &a->op.collective;
    if (!c->group || !c->ops) return kiln__err(KILN_ERR_ARG, "all_to_all: no process group");
    if (x->ndim < 1) return kiln__err(KILN_ERR_SHAPE, "all_to_all: x %s needs a dim of rows", SHP(x));
    kiln_status s = need_index("all_to_all", sc);
    if (s != KILN_OK) return s;
    if (sc->ndim != 1 || sc->shape[0] != c->world)
        return kiln__err(KILN_ERR_SHAPE, "all_to_all: send_counts %s must hold one count per rank (%d)", SHP(sc),
                         c->world);
    if (c->rows < 0) return kiln__err(KILN_ERR_ARG, "all_to_all: out_rows %lld is negative", (long long)c->rows);
    meta_like(x, x->dtype, &out[0]);
    out[0].shape[0] = c->rows;
    int64_t w = c->world;
    meta_shape(&out[1], KILN_DTYPE_I64, 1, &w);
    return KILN_OK;
}

/* Backward ops. */
INFER(embedding_backward)
{
    int64_t shape[2] = {a->op.embedding_backward.vocab, in[0]->shape[in[0]->ndim - 1]};
    meta_shape(out, in[0]->dtype, 2, shape);
    return KILN_OK;
}

/* Output j shaped like input from[j]: the gradients of the forward op's inputs. */
static kiln_status like_inputs(kiln_tensor_t *const *in, int n_out, const int *from, kiln__meta *out)
{
    for (int j = 0; j < n_out; j++) meta_like(in[from[j]], in[from[j]]->dtype, &out[j]);
    return KILN_OK;
}

INFER(layer_norm_backward) { return like_inputs(in, 3, (const int[]){1, 2, 2}, out); } /* (g, x, w, ...): dx, dw, db */
INFER(rms_norm_backward) { return like_inputs(in, 2, (const int[]){1, 2}, out); }       /* (g, x, w, ...): dx, dw */
INFER(cross_entropy_backward) { return like_inputs(in, 1, (const int[]){1}, out); }     /* (g, logits, ...): dlogits */
/* (g (M,N), x (M,K), w (E,K,N), offsets): dx, dw. */
INFER(grouped_matmul_backward)
{
    const kiln_tensor_t *g = in[0], *x = in[1], *w = in[2];
    if (g->ndim != 2 || x->ndim != 2 || w->ndim != 3 || g->shape[0] != x->shape[0] || g->shape[1] != w->shape[2] ||
        g->dtype != x->dtype)
        return kiln__err(KILN_ERR_SHAPE, "grouped_matmul_backward: g %s, x %s, w %s must be (M,N), (M,K), (E,K,N) of "
                         "one type", SHP(g), SHP(x), SHP(w));
    kiln_status s = kiln__infer_grouped_matmul(in + 1, 3, a, out);
    return s != KILN_OK ? s : like_inputs(in, 2, (const int[]){1, 2}, out);
}
INFER(attention_backward) { return like_inputs(in, 3, (const int[]){1, 2, 3}, out); }   /* (g, q, k, v, ...): dq, dk, dv */
