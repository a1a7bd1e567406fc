/* The public op functions: each fills the attributes and dispatches. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/ops.h"
#include "core/dtype.h"
#include "core/intercept.h"
#include "core/quant.h"
#include "core/rng.h"
#include "ops/registry.h"

static kiln_tensor_t *call1(kiln__op_id op, kiln_tensor_t *a) { return kiln__call(op, &a, 1, &(kiln__attrs){0}); }

static kiln_tensor_t *call2(kiln__op_id op, kiln_tensor_t *a, kiln_tensor_t *b)
{
    kiln_tensor_t *in[2] = {a, b};
    return kiln__call(op, in, 2, &(kiln__attrs){0});
}

static kiln_tensor_t *null_arg(const char *op) { return kiln__null_arg(op), NULL; }

/* dim normalized for a (0 .. ndim - 1, or 0 for a 0-dim a where scalar_ok), or -1 with
 * the error set. */
static int dim_of(const char *op, kiln_tensor_t *a, int dim, bool scalar_ok)
{
    int d = kiln__norm_dim(dim, a->ndim);
    if (d >= 0 && (scalar_ok || d < a->ndim)) return d;
    return kiln__err(KILN_ERR_INDEX, "%s: dim %d is out of range for %s", op, dim, kiln__shape_text(a)), -1;
}

/* The rows of src/core/binary.def. */
#define KILN_BINARY(ID, name, ...) kiln_tensor_t *kiln_##name(kiln_tensor_t *a, kiln_tensor_t *b) { return call2(KILN_OP_##ID, a, b); }
#include "core/binary.def"
#undef KILN_BINARY

/* A scalar operand: a 0-d tensor of a's dtype, broadcast by the binary op. */
static kiln_tensor_t *scalar_like(kiln_tensor_t *a, double s)
{
    if (!a) return NULL;
    bool prev = kiln_set_grad_enabled(false);
    kiln__backend *was = kiln__backend_here(a->st->be); /* on a's device */
    kiln_tensor_t *t = kiln_scalar(s, kiln_dtype_is_float(a->dtype) ? a->dtype : KILN_DTYPE_F64);
    kiln__backend_here(was);
    kiln_set_grad_enabled(prev);
    return t;
}

kiln_tensor_t *kiln_add_scalar(kiln_tensor_t *a, double s) { return a ? kiln_add(a, scalar_like(a, s)) : null_arg("add_scalar"); }
kiln_tensor_t *kiln_mul_scalar(kiln_tensor_t *a, double s) { return a ? kiln_mul(a, scalar_like(a, s)) : null_arg("mul_scalar"); }
kiln_tensor_t *kiln_pow_scalar(kiln_tensor_t *a, double p) { return a ? kiln_pow(a, scalar_like(a, p)) : null_arg("pow_scalar"); }
kiln_tensor_t *kiln_square(kiln_tensor_t *a) { return kiln_mul(a, a); }

/* The rows of include/kiln/pointwise.def. */
#define KILN_PW(ID, name, ...) \
    kiln_tensor_t *kiln_##name(kiln_tensor_t *a) { return call1(KILN_OP_##ID, a); }
#include "kiln/pointwise.def"
#undef KILN_PW
kiln_tensor_t *kiln_contiguous(kiln_tensor_t *a)
{
    if (a && kiln__is_contiguous(a)) return kiln__scoped(kiln_tensor_retain(a));
    return call1(KILN_OP_CONTIGUOUS, a);
}
kiln_tensor_t *kiln_clone(kiln_tensor_t *a) { return call1(KILN_OP_CONTIGUOUS, a); }

kiln_tensor_t *kiln_detach(kiln_tensor_t *a)
{
    if (!a) return null_arg("detach");
    return kiln__scoped(kiln__tensor_detach(a)); /* a captured tensor's alias stands for the same value */
}

kiln_tensor_t *kiln_gelu(kiln_tensor_t *a, bool approximate)
{
    return kiln__call(KILN_OP_GELU, &a, 1, &(kiln__attrs){.op.gelu.tanh = approximate});
}

kiln_tensor_t *kiln_where(kiln_tensor_t *cond, kiln_tensor_t *a, kiln_tensor_t *b)
{
    kiln_tensor_t *in[3] = {cond, a, b};
    return kiln__call(KILN_OP_WHERE, in, 3, &(kiln__attrs){0});
}

kiln_tensor_t *kiln_cast(kiln_tensor_t *a, kiln_dtype dt)
{
    if (a && a->dtype == dt) return kiln__scoped(kiln_tensor_retain(a));
    return kiln__call(KILN_OP_CAST, &a, 1, &(kiln__attrs){.op.cast.dtype = dt});
}

/* Normalises a dim list into at->shape, sorted and without repeats. */
static bool dims_attr(const char *op, kiln_tensor_t *a, const int *dims, int ndims, bool keepdim, kiln__attrs *at)
{
    memset(at, 0, sizeof *at);
    at->keepdim = keepdim;
    if (!dims || ndims <= 0) return true;
    bool on[KILN_MAX_DIMS] = {0};
    for (int k = 0; k < ndims; k++) {
        int d = dim_of(op, a, dims[k], false);
        if (d < 0) return false;
        on[d] = true;
    }
    for (int d = 0; d < a->ndim; d++)
        if (on[d]) at->shape[at->ndim++] = d;
    return true;
}

static kiln_tensor_t *reduce(kiln__op_id op, kiln_tensor_t *a, const int *dims, int ndims, bool keepdim)
{
    kiln__attrs at;
    if (!a) return null_arg(kiln__ops[op].name);
    if (!dims_attr(kiln__ops[op].name, a, dims, ndims, keepdim, &at)) return NULL;
    return kiln__call(op, &a, 1, &at);
}

kiln_tensor_t *kiln_sum(kiln_tensor_t *a, const int *dims, int ndims, bool keepdim) { return reduce(KILN_OP_SUM, a, dims, ndims, keepdim); }
kiln_tensor_t *kiln_max(kiln_tensor_t *a, const int *dims, int ndims, bool keepdim) { return reduce(KILN_OP_MAX, a, dims, ndims, keepdim); }

/* How many elements of a each result element of a reduction over dims takes, or -1 with
 * the error set. */
static int64_t reduced_count(const char *op, kiln_tensor_t *a, const int *dims, int ndims)
{
    kiln__attrs at;
    if (!a) return kiln__null_arg(op), -1;
    if (!dims_attr(op, a, dims, ndims, false, &at)) return -1;
    if (at.ndim == 0) return kiln__numel(a->ndim, a->shape);
    int64_t n = 1;
    for (int k = 0; k < at.ndim; k++) n *= a->shape[at.shape[k]];
    return n;
}

kiln_tensor_t *kiln_mean(kiln_tensor_t *a, const int *dims, int ndims, bool keepdim)
{
    int64_t n = reduced_count("mean", a, dims, ndims);
    if (n < 0) return NULL;
    return kiln_mul_scalar(kiln_sum(a, dims, ndims, keepdim), n ? 1.0 / (double)n : NAN);
}

kiln_tensor_t *kiln_var(kiln_tensor_t *a, const int *dims, int ndims, int correction, bool keepdim)
{
    int64_t n = reduced_count("var", a, dims, ndims);
    if (n < 0) return NULL;
    kiln_tensor_t *mu = kiln_mean(a, dims, ndims, true);
    kiln_tensor_t *d = kiln_sub(a, mu);
    double denom = (double)(n - correction);
    return kiln_mul_scalar(kiln_sum(kiln_mul(d, d), dims, ndims, keepdim), denom > 0 ? 1.0 / denom : NAN);
}

kiln_tensor_t *kiln_logsumexp(kiln_tensor_t *a, const int *dims, int ndims, bool keepdim)
{
    if (!a) return null_arg("logsumexp");
    /* The max is a constant shift: no gradient flows through it. */
    bool prev = kiln_set_grad_enabled(false);
    kiln_tensor_t *m = kiln_max(a, dims, ndims, true);
    kiln_set_grad_enabled(prev);
    kiln_tensor_t *s = kiln_log(kiln_sum(kiln_exp(kiln_sub(a, m)), dims, ndims, true));
    kiln_tensor_t *r = kiln_add(s, m);
    if (keepdim || !r) return r;
    kiln__attrs at;
    dims_attr("logsumexp", a, dims, ndims, false, &at);
    int64_t shape[KILN_MAX_DIMS];
    int nd = 0;
    for (int d = 0; d < a->ndim; d++) {
        bool red = at.ndim == 0;
        for (int k = 0; k < at.ndim; k++) red |= at.shape[k] == d;
        if (!red) shape[nd++] = a->shape[d];
    }
    return kiln_reshape(r, shape, nd);
}

static kiln_tensor_t *dim_op(kiln__op_id op, kiln_tensor_t *a, int dim, bool keepdim)
{
    if (!a) return null_arg(kiln__ops[op].name);
    int d = dim_of(kiln__ops[op].name, a, dim, true);
    return d < 0 ? NULL : kiln__call(op, &a, 1, &(kiln__attrs){.op.dim.dim = d, .keepdim = keepdim});
}

kiln_tensor_t *kiln_argmax(kiln_tensor_t *a, int dim, bool keepdim) { return dim_op(KILN_OP_ARGMAX, a, dim, keepdim); }
kiln_tensor_t *kiln_softmax(kiln_tensor_t *a, int dim) { return dim_op(KILN_OP_SOFTMAX, a, dim, false); }
kiln_tensor_t *kiln_log_softmax(kiln_tensor_t *a, int dim) { return dim_op(KILN_OP_LOG_SOFTMAX, a, dim, false); }

kiln_tensor_t *kiln_matmul(kiln_tensor_t *a, kiln_tensor_t *b)
{
    if (!a || !b) return null_arg("matmul");
    if (a->ndim == 0 || b->ndim == 0)
        return kiln__err(KILN_ERR_SHAPE, "matmul: %s @ %s: scalars cannot be multiplied as matrices",
                         kiln__shape_text(a), kiln__shape_text(b)), NULL;
    bool va = a->ndim == 1, vb = b->ndim == 1;
    kiln_tensor_t *x = va ? kiln_unsqueeze(a, 0) : a, *y = vb ? kiln_unsqueeze(b, 1) : b;
    kiln_tensor_t *r = call2(KILN_OP_MATMUL, x, y);
    if (!r || (!va && !vb)) return r;
    if (va) r = kiln_squeeze(r, r->ndim - 2);
    if (vb && r) r = kiln_squeeze(r, r->ndim - 1);
    return r;
}

static kiln_tensor_t *indexed(kiln__op_id op, kiln_tensor_t *a, int dim, kiln_tensor_t *idx, kiln_tensor_t *src)
{
    if (!a || !idx) return null_arg(kiln__ops[op].name);
    int d = dim_of(kiln__ops[op].name, a, dim, false);
    kiln_tensor_t *in[3] = {a, idx, src};
    return d < 0 ? NULL : kiln__call(op, in, src ? 3 : 2, &(kiln__attrs){.op.dim.dim = d});
}

kiln_tensor_t *kiln_embedding(kiln_tensor_t *w, kiln_tensor_t *idx) { return call2(KILN_OP_EMBEDDING, w, idx); }
kiln_tensor_t *kiln_index_select(kiln_tensor_t *a, int dim, kiln_tensor_t *idx) { return indexed(KILN_OP_INDEX_SELECT, a, dim, idx, NULL); }
kiln_tensor_t *kiln_gather(kiln_tensor_t *a, int dim, kiln_tensor_t *idx) { return indexed(KILN_OP_GATHER, a, dim, idx, NULL); }
kiln_tensor_t *kiln_scatter_add(kiln_tensor_t *a, int dim, kiln_tensor_t *idx, kiln_tensor_t *src)
{
    return src ? indexed(KILN_OP_SCATTER_ADD, a, dim, idx, src) : null_arg("scatter_add");
}

static kiln_tensor_t *param_or(kiln_tensor_t *p, kiln_tensor_t *x, double v)
{
    if (p) return p;
    int64_t c = x->ndim ? x->shape[x->ndim - 1] : 1;
    bool prev = kiln_set_grad_enabled(false);
    kiln_tensor_t *t = kiln_full(&c, 1, v, x->dtype);
    kiln_set_grad_enabled(prev);
    return t;
}

kiln_tensor_t *kiln_layer_norm(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *b, double eps)
{
    if (!x) return null_arg("layer_norm");
    kiln_tensor_t *in[3] = {x, param_or(w, x, 1.0), param_or(b, x, 0.0)};
    return kiln__call(KILN_OP_LAYER_NORM, in, 3, &(kiln__attrs){.op.norm.eps = eps});
}

kiln_tensor_t *kiln_rms_norm(kiln_tensor_t *x, kiln_tensor_t *w, double eps)
{
    if (!x) return null_arg("rms_norm");
    kiln_tensor_t *in[2] = {x, param_or(w, x, 1.0)};
    return kiln__call(KILN_OP_RMS_NORM, in, 2, &(kiln__attrs){.op.norm.eps = eps});
}

kiln_tensor_t *kiln_cross_entropy(kiln_tensor_t *logits, kiln_tensor_t *targets, int64_t ignore_index)
{
    kiln_tensor_t *in[2] = {logits, targets};
    return kiln__call(KILN_OP_CROSS_ENTROPY, in, 2, &(kiln__attrs){.op.cross_entropy.ignore_index = ignore_index});
}

kiln_tensor_t *kiln_dropout(kiln_tensor_t *a, double p, bool train)
{
    if (!a) return null_arg("dropout");
    if (!train || p == 0) return kiln__scoped(kiln_tensor_retain(a));
    kiln__attrs at = {.op.dropout.p = p};
    at.u[1] = kiln__rng_take((uint64_t)kiln__numel(a->ndim, a->shape), &at.u[0]);
    return kiln__call(KILN_OP_DROPOUT, &a, 1, &at);
}

kiln_tensor_t *kiln_cat(kiln_tensor_t *const *ts, int n, int dim)
{
    if (!ts || n < 1) return kiln__err(KILN_ERR_ARG, "cat: no tensors given"), NULL;
    for (int i = 0; i < n; i++)
        if (!ts[i]) return null_arg("cat");
    int d = kiln__norm_dim(dim, ts[0]->ndim);
    return kiln__call(KILN_OP_CAT, ts, n, &(kiln__attrs){.op.dim.dim = d < 0 ? dim : d});
}

kiln_tensor_t *kiln_stack(kiln_tensor_t *const *ts, int n, int dim)
{
    if (!ts || n < 1 || n > 4096) return kiln__err(KILN_ERR_ARG, "stack: give between 1 and 4096 tensors"), NULL;
    kiln_tensor_t *u[4096];
    for (int i = 0; i < n; i++) {
        if (!ts[i]) return null_arg("stack");
        int d = dim < 0 ? dim + ts[i]->ndim + 1 : dim;
        u[i] = kiln_unsqueeze(ts[i], d);
        if (!u[i]) return NULL;
    }
    return kiln_cat(u, n, dim < 0 ? dim + ts[0]->ndim + 1 : dim);
}

kiln_status kiln_split(kiln_tensor_t *a, const int64_t *sizes, int n, int dim, kiln_tensor_t **out)
{
    if (!a || !sizes || !out || n < 1) return kiln__err(KILN_ERR_ARG, "split: NULL argument or no sizes");
    int d = kiln__norm_dim(dim, a->ndim);
    if (d < 0 || d >= a->ndim) return kiln__err(KILN_ERR_INDEX, "split: dim %d is out of range", dim);
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += sizes[i];
    if (total != a->shape[d])
        return kiln__err(KILN_ERR_SHAPE, "split: sizes add up to %lld, dim %d has %lld", (long long)total, dim,
                         (long long)a->shape[d]);
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        out[i] = kiln_narrow(a, d, at, sizes[i]);
        if (!out[i]) {
            /* Nothing is returned on failure: drop the pieces made so far. */
            for (int k = 0; k < i; k++) {
                kiln_tensor_free(kiln_keep(out[k]));
                out[k] = NULL;
            }
            return kiln_last_status();
        }
        at += sizes[i];
    }
    return KILN_OK;
}

static kiln_tensor_t *tri(kiln_tensor_t *a, int64_t k, bool upper)
{
    return kiln__call(KILN_OP_TRI, &a, 1, &(kiln__attrs){.op.tri = {.k = k, .upper = upper}});
}

kiln_tensor_t *kiln_tril(kiln_tensor_t *a, int64_t k) { return tri(a, k, false); }
kiln_tensor_t *kiln_triu(kiln_tensor_t *a, int64_t k) { return tri(a, k, true); }

kiln_tensor_t *kiln_rope(kiln_tensor_t *x, int64_t pos0, double theta) { return kiln_rope_scaled(x, pos0, theta, NULL); }

kiln_tensor_t *kiln_rope_scaled(kiln_tensor_t *x, int64_t pos0, double theta, const kiln_rope_scaling *s)
{
    kiln__attrs a = {.op.rope = {.theta = theta, .pos0 = pos0}};
    if (s) a.op.rope.scaling = *s;
    return kiln__call(KILN_OP_ROPE, &x, 1, &a);
}

kiln_tensor_t *kiln_attention(kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v, bool causal, double scale)
{
    if (!q || !k || !v) return null_arg("attention");
    kiln__attrs at = {.op.attention = {.causal = causal}};
    at.op.attention.scale = scale > 0 ? scale : 1.0 / sqrt((double)(q->ndim == 4 ? q->shape[3] : 1));
    kiln_tensor_t *in[3] = {q, k, v};
    return kiln__call(KILN_OP_ATTENTION, in, 3, &at);
}

kiln_tensor_t *kiln_matmul_rows(kiln_tensor_t *a, kiln_tensor_t *w)
{
    if (!a || !w) return null_arg("matmul_rows");
    if (a->ndim != 2 || w->ndim != 2 || a->shape[1] != w->shape[1])
        return kiln__err(KILN_ERR_SHAPE, "matmul_rows: a %s and w %s must be (M,K) and (N,K)",
                         kiln__shape_text(a), kiln__shape_text(w)), NULL;
    return kiln_matmul_rows_packed(a, kiln_matmul_rows_pack(w), w->shape[0]);
}

kiln_tensor_t *kiln_matmul_rows_pack(kiln_tensor_t *w)
{
    if (!w) return null_arg("matmul_rows_pack");
    if (w->ndim != 2 || w->shape[0] < 1 || !kiln__f32_or_half(w->dtype))
        return kiln__err(KILN_ERR_SHAPE, "matmul_rows_pack: w %s must be a non-empty (N,K) f32, bf16 or f16 matrix",
                         kiln__shape_text(w)), NULL;
    /* (N,K), padded with zero rows to P*16, as (P,16,K), then panel by panel (P,K,16). */
    int64_t N = w->shape[0], K = w->shape[1], P = (N + KILN_ROWS_PANEL - 1) / KILN_ROWS_PANEL;
    int64_t pad[2] = {P * KILN_ROWS_PANEL - N, K}, s3[3] = {P, KILN_ROWS_PANEL, K};
    kiln_tensor_t *full = w;
    if (pad[0]) full = kiln_cat((kiln_tensor_t *[2]){w, kiln_zeros(pad, 2, w->dtype)}, 2, 0);
    return kiln_contiguous(kiln_transpose(kiln_reshape(full, s3, 3), 1, 2));
}

kiln_tensor_t *kiln_matmul_rows_pack_q8_0(kiln_tensor_t *w)
{
    if (!w) return null_arg("matmul_rows_pack_q8_0");
    if (w->ndim != 2 || w->shape[0] < 1 || w->shape[1] < 1 || w->shape[1] % KILN_ROWS_Q8_BLOCK ||
        !kiln__f32_or_half(w->dtype))
        return kiln__err(KILN_ERR_SHAPE, "matmul_rows_pack_q8_0: w %s must be a non-empty (N,K) f32, bf16 or f16 "
                         "matrix with K a multiple of %d", kiln__shape_text(w), KILN_ROWS_Q8_BLOCK), NULL;
    int64_t N = w->shape[0], K = w->shape[1], P = (N + KILN_ROWS_PANEL - 1) / KILN_ROWS_PANEL;
    int64_t KB = K / KILN_ROWS_Q8_BLOCK, shape[3] = {P, KB, KILN_ROWS_Q8_BYTES};
    size_t es = kiln_dtype_size(w->dtype), pbytes = (size_t)(P * KB * KILN_ROWS_Q8_BYTES);
    void *host = malloc(es * (size_t)(N * K));
    float *row = malloc(sizeof(float) * (size_t)K);
    uint8_t *q = malloc((size_t)(KB * 34)), *pk = calloc(pbytes, 1);
    kiln_tensor_t *out = NULL;
    if (!host || !row || !q || !pk) {
        kiln__err(KILN_ERR_OOM, "matmul_rows_pack_q8_0: out of memory for w %s", kiln__shape_text(w));
    } else if (kiln_tensor_to_host(w, host, es * (size_t)(N * K)) == KILN_OK) {
        /* Each row quantized as ggml's q8_0 (kiln__quant_quant), then its blocks' scales
         * and values scattered into the panel layout of kiln/ops.h; rows past N stay 0. */
        for (int64_t n = 0; n < N; n++) {
            for (int64_t k = 0; k < K; k++) {
                size_t i = (size_t)(n * K + k);
                row[k] = w->dtype == KILN_DTYPE_F32    ? ((const float *)host)[i]
                         : w->dtype == KILN_DTYPE_BF16 ? kiln__bf16_to_f32(((const uint16_t *)host)[i])
                                                       : kiln__f16_to_f32(((const uint16_t *)host)[i]);
            }
            kiln__quant_quant(KILN__GGML_Q8_0, row, q, K);
            uint8_t *panel = pk + (size_t)((n / KILN_ROWS_PANEL) * KB * KILN_ROWS_Q8_BYTES);
            int j = (int)(n % KILN_ROWS_PANEL);
            for (int64_t b = 0; b < KB; b++) {
                uint8_t *blk = panel + b * KILN_ROWS_Q8_BYTES;
                const uint8_t *src = q + b * 34;
                memcpy(blk + 2 * j, src, 2);
                for (int g = 0; g < KILN_ROWS_Q8_BLOCK / 4; g++)
                    memcpy(blk + 2 * KILN_ROWS_PANEL + g * 4 * KILN_ROWS_PANEL + 4 * j, src + 2 + 4 * g, 4);
            }
        }
        out = kiln_from_data(pk, shape, 3, KILN_DTYPE_U8);
    }
    free(host);
    free(row);
    free(q);
    free(pk);
    return out;
}

kiln_tensor_t *kiln_matmul_rows_packed(kiln_tensor_t *a, kiln_tensor_t *wp, int64_t n)
{
    if (!a || !wp) return null_arg("matmul_rows_packed");
    kiln_tensor_t *in[2] = {a, wp};
    return kiln__call(KILN_OP_MATMUL_ROWS_PACKED, in, 2, &(kiln__attrs){.op.rows_packed.cols = n});
}

kiln_tensor_t *kiln_rope_at(kiln_tensor_t *x, kiln_tensor_t *pos, double theta)
{
    return kiln_rope_at_scaled(x, pos, theta, NULL);
}

kiln_tensor_t *kiln_rope_at_scaled(kiln_tensor_t *x, kiln_tensor_t *pos, double theta, const kiln_rope_scaling *s)
{
    if (!x || !pos) return null_arg("rope_at");
    kiln_tensor_t *in[2] = {x, pos};
    kiln__attrs a = {.op.rope.theta = theta};
    if (s) a.op.rope.scaling = *s;
    return kiln__call(KILN_OP_ROPE_AT, in, 2, &a);
}

kiln_tensor_t *kiln_paged_attention(kiln_tensor_t *q, kiln_tensor_t *k_pages, kiln_tensor_t *v_pages,
                                    kiln_tensor_t *block_table, kiln_tensor_t *seq_pos, int64_t block_len,
                                    double scale)
{
    return kiln_paged_attention_variant(q, k_pages, v_pages, block_table, seq_pos, block_len, scale, NULL);
}

kiln_tensor_t *kiln_paged_attention_variant(kiln_tensor_t *q, kiln_tensor_t *k_pages, kiln_tensor_t *v_pages,
                                            kiln_tensor_t *block_table, kiln_tensor_t *seq_pos, int64_t block_len,
                                            double scale, const kiln_paged_variant *variant)
{
    if (!q || !k_pages || !v_pages || !block_table || !seq_pos) return null_arg("paged_attention");
    kiln__attrs at = {.op.paged_attention = {.block_len = block_len}};
    if (variant) { /* field by field: the attributes are compared as bytes, padding included */
        kiln_paged_variant *v = &at.op.paged_attention.v;
        v->window = variant->window;
        v->softcap = variant->softcap;
        v->alibi = variant->alibi;
        v->alibi_after_softcap = variant->alibi_after_softcap;
    }
    at.op.paged_attention.scale = scale > 0 ? scale : 1.0 / sqrt((double)(q->ndim == 3 ? q->shape[2] : 1));
    kiln_tensor_t *in[5] = {q, k_pages, v_pages, block_table, seq_pos};
    return kiln__call(KILN_OP_PAGED_ATTENTION, in, 5, &at);
}

/* Mixture-of-experts routing: two visible outputs, each handed to the scope. */
static kiln_status call_pair(kiln__op_id op, kiln_tensor_t *in, const kiln__attrs *a, kiln_tensor_t **o0,
                             kiln_tensor_t **o1)
{
    if (!o0 || !o1) return kiln__err(KILN_ERR_ARG, "%s: NULL output pointer", kiln__ops[op].name);
    *o0 = *o1 = NULL;
    if (!in) return kiln__null_arg(kiln__ops[op].name);
    kiln_tensor_t *out[KILN__MAX_OUT] = {0};
    kiln_status s = kiln__dispatch(op, &in, 1, a, out);
    if (s != KILN_OK) return s;
    *o0 = kiln__scoped(out[0]);
    *o1 = kiln__scoped(out[1]);
    return *o0 && *o1 ? KILN_OK : kiln_last_status();
}

kiln_status kiln_topk(kiln_tensor_t *x, int64_t k, kiln_tensor_t **values, kiln_tensor_t **indices)
{
    return call_pair(KILN_OP_TOPK, x, &(kiln__attrs){.op.topk.k = k}, values, indices);
}

kiln_status kiln_moe_sort(kiln_tensor_t *indices, int64_t n_experts, kiln_tensor_t **order, kiln_tensor_t **offsets)
{
    return call_pair(KILN_OP_MOE_SORT, indices, &(kiln__attrs){.op.moe_sort.n_experts = n_experts}, order, offsets);
}

kiln_tensor_t *kiln_grouped_matmul(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *offsets)
{
    if (!x || !w || !offsets) return null_arg("grouped_matmul");
    kiln_tensor_t *in[3] = {x, w, offsets};
    return kiln__call(KILN_OP_GROUPED_MATMUL, in, 3, &(kiln__attrs){0});
}

/* Views. */
static bool resolve_shape(const char *op, kiln_tensor_t *a, const int64_t *shape, int ndim, kiln__attrs *at)
{
    memset(at, 0, sizeof *at);
    if (ndim < 0 || ndim > KILN_MAX_DIMS || (ndim && !shape))
        return kiln__err(KILN_ERR_ARG, "%s: bad target shape (ndim %d)", op, ndim), false;
    int infer = -1;
    int64_t known = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == -1 && infer < 0) {
            infer = i;
        } else if (shape[i] < 0) {
            return kiln__err(KILN_ERR_SHAPE, "%s: bad size %lld in dim %d", op, (long long)shape[i], i), false;
        } else {
            known *= shape[i];
        }
        at->shape[i] = shape[i];
    }
    at->ndim = ndim;
    int64_t n = kiln__numel(a->ndim, a->shape);
    if (infer >= 0) {
        if (known == 0 || n % known)
            return kiln__err(KILN_ERR_SHAPE, "%s: cannot infer dim %d to reshape %s", op, infer, kiln__shape_text(a)), false;
        at->shape[infer] = n / known;
        known *= at->shape[infer];
    }
    if (known != n)
        return kiln__err(KILN_ERR_SHAPE, "%s: %s has %lld elements, the target shape %lld", op, kiln__shape_text(a),
                         (long long)n, (long long)known), false;
    return true;
}

kiln_tensor_t *kiln_view(kiln_tensor_t *a, const int64_t *shape, int ndim)
{
    kiln__attrs at;
    if (!a) return null_arg("view");
    if (!resolve_shape("view", a, shape, ndim, &at)) return NULL;
    return kiln__call(KILN_OP_VIEW, &a, 1, &at);
}

kiln_tensor_t *kiln_reshape(kiln_tensor_t *a, const int64_t *shape, int ndim)
{
    kiln__attrs at;
    if (!a) return null_arg("reshape");
    if (!resolve_shape("reshape", a, shape, ndim, &at)) return NULL;
    kiln__meta m;
    if (kiln__infer_view(&a, 1, &at, &m) != KILN_OK) {
        kiln_clear_error();
        a = kiln_contiguous(a);
        if (!a) return NULL;
    }
    return kiln__call(KILN_OP_VIEW, &a, 1, &at);
}

kiln_tensor_t *kiln_permute(kiln_tensor_t *a, const int *order, int ndim)
{
    if (!a || !order) return null_arg("permute");
    kiln__attrs at = {.ndim = ndim};
    for (int i = 0; i < ndim && i < KILN_MAX_DIMS; i++) {
        int d = kiln__norm_dim(order[i], a->ndim);
        at.shape[i] = d < 0 ? order[i] : d;
    }
    return kiln__call(KILN_OP_PERMUTE, &a, 1, &at);
}

kiln_tensor_t *kiln_transpose(kiln_tensor_t *a, int d0, int d1)
{
    if (!a) return null_arg("transpose");
    int n0 = kiln__norm_dim(d0, a->ndim), n1 = kiln__norm_dim(d1, a->ndim);
    if (n0 < 0 || n1 < 0 || n0 >= a->ndim || n1 >= a->ndim)
        return kiln__err(KILN_ERR_INDEX, "transpose: dims %d, %d are out of range for %s", d0, d1, kiln__shape_text(a)), NULL;
    int order[KILN_MAX_DIMS];
    for (int i = 0; i < a->ndim; i++) order[i] = i;
    order[n0] = n1;
    order[n1] = n0;
    return kiln_permute(a, order, a->ndim);
}

kiln_tensor_t *kiln_slice(kiln_tensor_t *a, int dim, int64_t start, int64_t end, int64_t step)
{
    if (!a) return null_arg("slice");
    int d = dim_of("slice", a, dim, false);
    if (d < 0) return NULL;
    if (step <= 0) return kiln__err(KILN_ERR_ARG, "slice: step %lld must be positive", (long long)step), NULL;
    int64_t n = a->shape[d];
    if (start < 0) start += n;
    if (end < 0) end += n;
    if (start < 0) start = 0;
    if (end > n) end = n;
    if (start > n) start = n;
    int64_t len = end > start ? (end - start + step - 1) / step : 0;
    return kiln__call(KILN_OP_SLICE, &a, 1, &(kiln__attrs){.op.slice = {.dim = d, .start = start, .step = step, .length = len}});
}

kiln_tensor_t *kiln_narrow(kiln_tensor_t *a, int dim, int64_t start, int64_t length)
{
    if (!a) return null_arg("narrow");
    int d = kiln__norm_dim(dim, a->ndim);
    if (d < 0 || d >= a->ndim || start < 0 || length < 0 || start + length > a->shape[d])
        return kiln__err(KILN_ERR_INDEX, "narrow: [%lld, %lld) along dim %d is outside %s", (long long)start,
                         (long long)(start + length), dim, kiln__shape_text(a)), NULL;
    return kiln_slice(a, d, start, start + length, 1);
}

kiln_tensor_t *kiln_expand(kiln_tensor_t *a, const int64_t *shape, int ndim)
{
    if (!a || (!shape && ndim)) return null_arg("expand");
    if (ndim < 0 || ndim > KILN_MAX_DIMS) return kiln__err(KILN_ERR_ARG, "expand: ndim %d is outside 0..%d", ndim, KILN_MAX_DIMS), NULL;
    kiln__attrs at = {.ndim = ndim};
    memcpy(at.shape, shape, sizeof(int64_t) * (size_t)ndim);
    return kiln__call(KILN_OP_EXPAND, &a, 1, &at);
}

kiln_tensor_t *kiln_squeeze(kiln_tensor_t *a, int dim)
{
    if (!a) return null_arg("squeeze");
    int d = kiln__norm_dim(dim, a->ndim);
    if (d < 0 || d >= a->ndim || a->shape[d] != 1)
        return kiln__err(KILN_ERR_SHAPE, "squeeze: dim %d of %s is not of size 1", dim, kiln__shape_text(a)), NULL;
    int64_t shape[KILN_MAX_DIMS];
    int n = 0;
    for (int i = 0; i < a->ndim; i++)
        if (i != d) shape[n++] = a->shape[i];
    return kiln_reshape(a, shape, n);
}

kiln_tensor_t *kiln_unsqueeze(kiln_tensor_t *a, int dim)
{
    if (!a) return null_arg("unsqueeze");
    int d = dim < 0 ? dim + a->ndim + 1 : dim;
    if (d < 0 || d > a->ndim || a->ndim == KILN_MAX_DIMS)
        return kiln__err(KILN_ERR_INDEX, "unsqueeze: dim %d is out of range for %s", dim, kiln__shape_text(a)), NULL;
    int64_t shape[KILN_MAX_DIMS];
    int n = 0;
    for (int i = 0; i <= a->ndim; i++) {
        if (i == d) shape[n++] = 1;
        if (i < a->ndim) shape[n++] = a->shape[i];
    }
    return kiln_reshape(a, shape, n);
}

/* In-place. */
kiln_status kiln_add_(kiln_tensor_t *dst, kiln_tensor_t *src, double alpha)
{
    kiln_tensor_t *in[2] = {dst, src};
    return kiln__dispatch(KILN_OP_ADD_, in, 2, &(kiln__attrs){.op.scalar.value = alpha}, NULL);
}

kiln_status kiln_index_copy_(kiln_tensor_t *dst, kiln_tensor_t *index, kiln_tensor_t *src)
{
    kiln_tensor_t *in[3] = {dst, index, src};
    return kiln__dispatch(KILN_OP_INDEX_COPY_, in, 3, &(kiln__attrs){0}, NULL);
}

kiln_status kiln_mul_scalar_(kiln_tensor_t *dst, double s)
{
    return kiln__dispatch(KILN_OP_SCALE_, &dst, 1, &(kiln__attrs){.op.scalar.value = s}, NULL);
}

kiln_status kiln_fill_(kiln_tensor_t *dst, double value)
{
    return kiln__dispatch(KILN_OP_FILL_, &dst, 1, &(kiln__attrs){.op.scalar.value = value}, NULL);
}

kiln_status kiln_adamw_step_(kiln_tensor_t *p, kiln_tensor_t *g, kiln_tensor_t *m, kiln_tensor_t *v, kiln_tensor_t *lr,
                             kiln_tensor_t *step, kiln_tensor_t *gscale, double beta1, double beta2, double eps, double wd)
{
    kiln__attrs at = {.op.adamw = {.weight_decay = wd, .beta1 = beta1, .beta2 = beta2, .eps = eps}};
    kiln_tensor_t *in[7] = {p, g, m, v, lr, step, gscale};
    return kiln__dispatch(KILN_OP_ADAMW_, in, 7, &at, NULL);
}

kiln_status kiln_adamw_(kiln_tensor_t *p, kiln_tensor_t *g, kiln_tensor_t *m, kiln_tensor_t *v, double lr, double beta1,
                        double beta2, double eps, double wd, int64_t t)
{
    if (t < 1) return kiln__err(KILN_ERR_ARG, "adamw_: step %lld must be >= 1", (long long)t);
    if (kiln__dispatch_recording())
        return kiln__err(KILN_ERR_UNSUPPORTED, "adamw_ during graph capture or replay recording: its lr and step count "
                         "would be frozen; give them as tensors with kiln_adamw_step_ (kiln_optim_step_t does)");
    double vals[3] = {lr, (double)t, 1.0};
    int64_t one = 1;
    kiln_scope_begin();
    kiln_tensor_t *sc[3];
    for (int i = 0; i < 3; i++) sc[i] = kiln_from_data(&vals[i], &one, 1, KILN_DTYPE_F64);
    kiln_status s = sc[0] && sc[1] && sc[2] ? kiln_adamw_step_(p, g, m, v, sc[0], sc[1], sc[2], beta1, beta2, eps, wd)
                                            : kiln_last_status();
    kiln_scope_end();
    return s;
}
