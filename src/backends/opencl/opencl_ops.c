/* The OpenCL backend's op kernels, host side: each checks the layouts its kernel takes,
 * runs it, and leaves the rest to the cpu with copies (kiln__cpu_fallback). The kernels
 * themselves are kernels.cl, built per device on first use. Ops in neither this table
 * nor the compiler's lowering run on the cpu (src/core/dispatch.c). */
#ifdef KILN_HAVE_OPENCL
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "backends/opencl/opencl_impl.h"
#include "core/dtype.h"
#include "core/opts.h"
#include "core/tensor_impl.h"
#include "kiln/ops.h"
#include "core/intercept.h"

#define BK_ENTRY(name) "kiln_" #name,
static const char *const bk_names[N_BK] = {BUILTINS(BK_ENTRY)};
static cl_kernel bk[MAX_CL_DEVICES][N_BK];

cl_kernel kiln__opencl_builtin(kiln__backend *be, int which)
{
    static pthread_mutex_t bk_lock = PTHREAD_MUTEX_INITIALIZER;
    static bool said;
    cl_dev *d = be->ctx;
    int di = d->index;
    pthread_mutex_lock(&bk_lock);
    if (!bk[di][which]) {
        void *k = NULL;
        if (kiln__opencl_compile_kernel(be, kiln__opencl_kernel_source, bk_names[which], &k) == KILN_OK)
            bk[di][which] = k;
        else {
            if (!said) fprintf(stderr, "kiln: %s: its own kernels do not build (%s); those ops run on the cpu\n",
                               d->name, kiln_last_error());
            said = true;
            kiln_clear_error();
        }
    }
    cl_kernel k = bk[di][which];
    pthread_mutex_unlock(&bk_lock);
    return k;
}

static cl_kernel builtin(kiln__backend *be, int which) { return kiln__opencl_builtin(be, which); }
static kiln__karg ptr_arg(const void *p) { return kiln__opencl_ptr_arg(p); }
static kiln__karg buf_arg(const kiln_tensor_t *t) { return ptr_arg(kiln__data(t)); }
static kiln__karg i64_arg(int64_t v) { return kiln__opencl_i64_arg(v); }
static kiln__karg f_arg(kiln__karg_kind k, double v) { return kiln__opencl_f_arg(k, v); }

static kiln_status ocl_matmul(KILN__KERNEL_ARGS)
{
    const kiln_tensor_t *x = in[0], *y = in[1], *o = out[0];
    bool tiles = kiln__opt(KILN__OPT_CL_MATMUL_TILES);
    /* bf16 and f16: the tiled kernel on 16-bit values (no cl_khr_fp16 needed) */
    int which = x->dtype == KILN_DTYPE_BF16 ? (tiles ? BK_matmul_bf16 : -1)
              : x->dtype == KILN_DTYPE_F16  ? (tiles ? BK_matmul_f16 : -1)
              : x->dtype == KILN_DTYPE_F32  ? (tiles ? BK_matmul : BK_matmul_simple)
                                            : -1;
    cl_kernel k = which >= 0 && o->ndim <= 6 ? builtin(be, which) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_MATMUL, in, n_in, a, out, n_out);
    int nb = o->ndim - 2;
    int64_t M = o->shape[nb], N = o->shape[nb + 1], K = x->shape[x->ndim - 1];
    int64_t dsh[4] = {1, 1, 1, 1}, as[4] = {0, 0, 0, 0}, bs[4] = {0, 0, 0, 0};
    for (int d = 0; d < nb; d++) { /* batch dims right-aligned into 4; broadcast ones step 0 */
        int slot = 4 - nb + d, i = d - (nb - (x->ndim - 2)), j = d - (nb - (y->ndim - 2));
        dsh[slot] = o->shape[d];
        as[slot] = i >= 0 && x->shape[i] != 1 ? x->stride[i] : 0;
        bs[slot] = j >= 0 && y->shape[j] != 1 ? y->stride[j] : 0;
    }
    int64_t batch = dsh[0] * dsh[1] * dsh[2] * dsh[3];
    if (!M || !N || !batch) return KILN_OK;
    if (!K) return be->memset(be, kiln__data(o), 0, kiln_tensor_nbytes(o));
    kiln__karg args[] = {buf_arg(x), buf_arg(y), buf_arg(o), i64_arg(M), i64_arg(N), i64_arg(K),
                         i64_arg(x->stride[x->ndim - 2]), i64_arg(x->stride[x->ndim - 1]),
                         i64_arg(y->stride[y->ndim - 2]), i64_arg(y->stride[y->ndim - 1]), i64_arg(dsh[1]),
                         i64_arg(dsh[2]), i64_arg(dsh[3]), i64_arg(as[0]), i64_arg(as[1]), i64_arg(as[2]),
                         i64_arg(as[3]), i64_arg(bs[0]), i64_arg(bs[1]), i64_arg(bs[2]), i64_arg(bs[3])};
    /* 64x64 (or 16x16) tiles of the output per 16x16 work-group. */
    int64_t tile = tiles ? 64 : 16;
    size_t grid[3] = {(size_t)((N + tile - 1) / tile * 16), (size_t)((M + tile - 1) / tile * 16), (size_t)batch},
           block[3] = {16, 16, 1};
    return kiln__opencl_launch(be, k, args, (int)(sizeof args / sizeof args[0]), grid, block, 3);
}

static bool contiguous_as(const kiln_tensor_t *t, kiln_dtype dt) { return t->dtype == dt && kiln__is_contiguous(t); }
static bool contiguous_f32(const kiln_tensor_t *t) { return contiguous_as(t, KILN_DTYPE_F32); }

static kiln_status ocl_add_(KILN__KERNEL_ARGS)
{
    int64_t n = kiln_tensor_numel(in[0]);
    kiln_dtype dt = in[0]->dtype;
    bool ok = (dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_F64) && contiguous_as(in[0], dt) && contiguous_as(in[1], dt) &&
              kiln_tensor_numel(in[1]) == n;
    cl_kernel k = ok ? builtin(be, dt == KILN_DTYPE_F64 ? BK_add_f64_ : BK_add_) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_ADD_, in, n_in, a, out, n_out);
    if (!n) return KILN_OK;
    kiln__karg args[] = {buf_arg(in[0]), buf_arg(in[1]), f_arg(dt == KILN_DTYPE_F64 ? KILN__KARG_F64 : KILN__KARG_F32, a->op.scalar.value),
                         i64_arg(n)};
    size_t grid = (size_t)n;
    return kiln__opencl_launch(be, k, args, 4, &grid, NULL, 1);
}

/* copy_: contiguous to contiguous as one device copy, other layouts of the same shape
 * (a source of as many elements is read as laid out like the destination when
 * contiguous) by kiln_copy_nd; broadcasts, dtype changes and other devices on the cpu. */
static kiln_status ocl_copy_(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *dst = in[0], *src = in[1];
    int64_t n = kiln_tensor_numel(dst);
    bool same_shape = kiln__same_shape(src->ndim, src->shape, dst->ndim, dst->shape);
    bool strided = !kiln__is_contiguous(dst) || !kiln__is_contiguous(src);
    if (dst->dtype != src->dtype || src->st->be != be || kiln_tensor_numel(src) != n || dst->ndim > 6 ||
        (!same_shape && !kiln__is_contiguous(src)) || (strided && dst->st == src->st)) /* one buffer: the cpu orders it */
        return kiln__cpu_fallback(be, KILN_OP_COPY_, in, n_in, a, out, n_out);
    if (!n) return KILN_OK;
    if (kiln__is_contiguous(dst) && kiln__is_contiguous(src))
        return kiln__be_copy_d2d(be, kiln__data(dst), kiln__data(src), kiln_tensor_nbytes(dst));
    cl_kernel k = builtin(be, BK_copy_nd);
    if (!k) return kiln__cpu_fallback(be, KILN_OP_COPY_, in, n_in, a, out, n_out);
    int64_t rs[KILN_MAX_DIMS];
    if (same_shape) memcpy(rs, src->stride, sizeof(int64_t) * (size_t)dst->ndim);
    else kiln__contiguous_strides(dst->ndim, dst->shape, rs);
    kiln__karg args[25] = {buf_arg(dst), buf_arg(src), i64_arg(n), i64_arg((int64_t)kiln_dtype_size(dst->dtype)),
                           i64_arg(dst->ndim)};
    for (int d = 0; d < 6; d++) {
        args[5 + d] = i64_arg(d < dst->ndim ? dst->shape[d] : 1);
        args[11 + d] = i64_arg(d < dst->ndim ? dst->stride[d] : 0);
        args[17 + d] = i64_arg(d < dst->ndim ? rs[d] : 0);
    }
    size_t grid = (size_t)n;
    return kiln__opencl_launch(be, k, args, 23, &grid, NULL, 1);
}

static kiln_status ocl_scale_(KILN__KERNEL_ARGS)
{
    int64_t n = kiln_tensor_numel(in[0]);
    cl_kernel k = contiguous_f32(in[0]) ? builtin(be, BK_scale_) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_SCALE_, in, n_in, a, out, n_out);
    if (!n) return KILN_OK;
    kiln__karg args[] = {buf_arg(in[0]), f_arg(KILN__KARG_F32, a->op.scalar.value), i64_arg(n)};
    size_t grid = (size_t)n;
    return kiln__opencl_launch(be, k, args, 3, &grid, NULL, 1);
}

static kiln_status ocl_adamw_(KILN__KERNEL_ARGS)
{
    cl_kernel k = builtin(be, BK_adamw_); /* shapes and layouts were checked by inference */
    if (!k) return kiln__cpu_fallback(be, KILN_OP_ADAMW_, in, n_in, a, out, n_out);
    int64_t n = kiln_tensor_numel(in[0]);
    if (!n) return KILN_OK;
    const kiln__adamw_attrs *h = &a->op.adamw;
    int64_t f64s = (in[4]->dtype == KILN_DTYPE_F64) | (in[5]->dtype == KILN_DTYPE_F64) << 1 |
                   (in[6]->dtype == KILN_DTYPE_F64) << 2;
    kiln__karg args[] = {buf_arg(in[0]), buf_arg(in[1]), buf_arg(in[2]), buf_arg(in[3]), buf_arg(in[4]),
                         buf_arg(in[5]), buf_arg(in[6]), i64_arg(f64s), f_arg(KILN__KARG_F32, h->weight_decay),
                         f_arg(KILN__KARG_F64, h->beta1), f_arg(KILN__KARG_F64, h->beta2), f_arg(KILN__KARG_F32, h->eps), i64_arg(n)};
    size_t grid = (size_t)n;
    return kiln__opencl_launch(be, k, args, (int)(sizeof args / sizeof args[0]), &grid, NULL, 1);
}

static bool index_layout(const kiln_tensor_t *idx)
{
    return kiln__is_contiguous(idx) && (idx->dtype == KILN_DTYPE_I64 || idx->dtype == KILN_DTYPE_I32);
}

void *kiln__opencl_err_word(kiln__backend *be)
{
    cl_dev *d = be->ctx;
    if (d->err) return d->err;
    if (d->cap) {
        kiln__opencl_not_recordable(d, "the first use of the error word");
        return NULL;
    }
    int zero[16] = {0};
    void *p = kiln__be_alloc(be, sizeof zero);
    if (!p) {
        kiln__err(KILN_ERR_OOM, "%s: out of device memory", d->name);
        return NULL;
    }
    if (kiln__be_copy_h2d(be, p, zero, sizeof zero) != KILN_OK) {
        kiln__be_free(be, p, sizeof zero);
        return NULL;
    }
    return d->err = p;
}

kiln_status kiln__opencl_check_indices(kiln__backend *be, const char *op, const kiln_tensor_t *idx, int64_t limit,
                                      const int64_t *ignore)
{
    if (((cl_dev *)be->ctx)->cap) return KILN_OK;
    size_t nb = kiln_tensor_nbytes(idx);
    char *h = malloc(nb ? nb : 1);
    if (!h) return kiln__err(KILN_ERR_OOM, "%s: out of memory", op);
    kiln_status s = kiln__be_copy_d2h(be, h, kiln__data(idx), nb);
    if (s == KILN_OK) s = kiln__check_indices(op, h, idx->dtype, kiln_tensor_numel(idx), limit, ignore, NULL);
    free(h);
    return s;
}

/* Embedding rows (w (V, C), idx -> out) or, bwd, their gradient (g, idx -> dW (V, C)):
 * a work-item an element of out, or a column of dW. */
static kiln_status embedding(KILN__KERNEL_ARGS, bool bwd)
{
    const kiln_tensor_t *idx = in[1], *w = bwd ? out[0] : in[0];
    int64_t V = w->shape[0], C = w->shape[1], n = kiln_tensor_numel(idx);
    bool ok = contiguous_f32(in[0]) && w->dtype == KILN_DTYPE_F32 && index_layout(idx);
    cl_kernel k = ok ? builtin(be, bwd ? BK_embedding_backward : BK_embedding) : NULL;
    if (!k) return kiln__cpu_fallback(be, bwd ? KILN_OP_EMBEDDING_BACKWARD : KILN_OP_EMBEDDING, in, n_in, a, out, n_out);
    kiln_status s = kiln__opencl_check_indices(be, bwd ? "embedding backward" : "embedding", idx, V, NULL);
    if (s != KILN_OK || !C || !(bwd ? V : n)) return s;
    void *err = kiln__opencl_err_word(be);
    if (!err) return kiln_last_status();
    kiln__karg args[] = {buf_arg(in[0]), buf_arg(idx), buf_arg(out[0]), i64_arg(C), i64_arg(n), i64_arg(V),
                         i64_arg(idx->dtype == KILN_DTYPE_I64), ptr_arg(err)};
    size_t grid = (size_t)(bwd ? C : n * C);
    return kiln__opencl_launch(be, k, args, 8, &grid, NULL, 1);
}

static kiln_status ocl_embedding(KILN__KERNEL_ARGS) { return embedding(be, in, n_in, a, out, n_out, false); }
static kiln_status ocl_embedding_backward(KILN__KERNEL_ARGS) { return embedding(be, in, n_in, a, out, n_out, true); }

/* Cross-entropy (in: logits x, targets t -> mean loss, lse) or, bwd, its backward (in:
 * g, x, t, lse -> dx), on the device: no value comes back to the host. The forward's
 * rows (their losses into a device buffer), then their mean over the rows that count
 * by one work-item in row order (as the cpu sums); the backward's g over that count
 * (into a device double), then the rows. */
static kiln_status cross_entropy(KILN__KERNEL_ARGS, bool bwd)
{
    const kiln_tensor_t *x = in[bwd], *t = in[bwd + 1];
    bool ok = contiguous_f32(x) && index_layout(t) &&
              (bwd ? contiguous_f32(in[3]) && in[0]->dtype == KILN_DTYPE_F32 : out[1]->dtype == KILN_DTYPE_F32);
    cl_kernel k = ok ? builtin(be, bwd ? BK_ce_backward : BK_ce_rows) : NULL, kc = k ? builtin(be, BK_ce_count) : NULL;
    if (!kc) return kiln__cpu_fallback(be, bwd ? KILN_OP_CROSS_ENTROPY_BACKWARD : KILN_OP_CROSS_ENTROPY, in, n_in, a, out, n_out);
    int64_t N = x->shape[0], V = x->shape[1], t64 = t->dtype == KILN_DTYPE_I64, ig = a->op.cross_entropy.ignore_index;
    kiln_status s = kiln__opencl_check_indices(be, "cross_entropy", t, V, &ig);
    if (s != KILN_OK || (bwd && (!N || !V))) return s;
    if (!N) { /* no rows: the mean of nothing */
        float nan = NAN;
        return kiln__be_fill(be, kiln__data(out[0]), &nan, sizeof nan, sizeof nan);
    }
    size_t nb = sizeof(double) * (size_t)(bwd ? 1 : N);
    void *err = kiln__opencl_err_word(be), *tmp = err ? kiln__be_alloc(be, nb) : NULL;
    if (!err) return kiln_last_status();
    if (!tmp) return kiln__err(KILN_ERR_OOM, bwd ? "cross_entropy backward: out of device memory"
                                                  : "cross_entropy: out of device memory");
    kiln__karg rows[] = {buf_arg(x), buf_arg(t), buf_arg(bwd ? in[3] : out[1]), bwd ? buf_arg(out[0]) : ptr_arg(tmp),
                         i64_arg(N), i64_arg(V), i64_arg(ig), i64_arg(t64), ptr_arg(err), ptr_arg(tmp)};
    kiln__karg count[] = {bwd ? buf_arg(in[0]) : ptr_arg(tmp), buf_arg(t), bwd ? ptr_arg(tmp) : buf_arg(out[0]),
                          i64_arg(N), i64_arg(V), i64_arg(ig), i64_arg(t64), ptr_arg(err), i64_arg(bwd)};
    size_t grid = (size_t)(bwd ? N * V : N), one = 1;
    if (bwd) s = kiln__opencl_launch(be, kc, count, 9, &one, NULL, 1);
    if (s == KILN_OK) s = kiln__opencl_launch(be, k, rows, 9 + bwd, &grid, NULL, 1);
    if (s == KILN_OK && !bwd) s = kiln__opencl_launch(be, kc, count, 9, &one, NULL, 1);
    kiln__be_free(be, tmp, nb); /* in-order queue: after the kernels that read it */
    return s;
}

static kiln_status ocl_cross_entropy(KILN__KERNEL_ARGS) { return cross_entropy(be, in, n_in, a, out, n_out, false); }
static kiln_status ocl_cross_entropy_backward(KILN__KERNEL_ARGS)
{
    return cross_entropy(be, in, n_in, a, out, n_out, true);
}

/* Whether every tensor of t[0..n) is f32. */
static bool all_f32(kiln_tensor_t *const *t, int n)
{
    for (int i = 0; i < n; i++)
        if (t[i]->dtype != KILN_DTYPE_F32) return false;
    return true;
}

static void undense(kiln_tensor_t **d, int n)
{
    for (int i = 0; i < n; i++) kiln_tensor_free(d[i]);
}

/* Dense copies of t[0..n) into d (kiln__dense: unrecorded, the kernel's own launch is
 * what a replay repeats), freed by undense; none is left when one fails. */
static kiln_status densify(kiln_tensor_t *const *t, int n, kiln_tensor_t **d)
{
    bool ok = true;
    for (int i = 0; i < n; i++) ok &= (d[i] = kiln__dense(t[i])) != NULL;
    kiln_status s = ok ? KILN_OK : kiln_last_status();
    if (!ok) undense(d, n);
    return s;
}

/* Attention forward (in: q, k, v -> o, lse) or backward (in: g, q, k, v, o, lse -> dq,
 * dk, dv): q (B,H,Tq,D), k and v (B,Hkv,Tk,D), all f32, or all bf16 or all f16 but the
 * lse (f32: the 16-bit kernels compute on widened values and round each output once),
 * D within the kernels' rows. A
 * work-item per query row (forward, dq) or key row (dk, dv), 16 to a group, the grid
 * rounded up to it (the kernels skip the spare ones). Each kernel takes the dense inputs,
 * its outputs, then the sizes. */
static kiln_status ocl_attention(KILN__KERNEL_ARGS)
{
    static const size_t block = 16;
    bool bwd = n_in == 6;
    const kiln_tensor_t *q = in[bwd], *k = in[bwd + 1];
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], D = q->shape[3], Hkv = k->shape[1], Tk = k->shape[2];
    kiln_dtype dt = q->dtype;
    bool ok = D <= 128 && kiln__f32_or_half(dt);
    for (int i = 0; i < n_in + n_out; i++) { /* one type but the lse (the forward's out 1, the backward's in 5) */
        const kiln_tensor_t *t = i < n_in ? in[i] : out[i - n_in];
        bool lse = bwd ? i == 5 : i == n_in + 1;
        ok = ok && t->dtype == (lse ? KILN_DTYPE_F32 : dt);
    }
    int t = dt == KILN_DTYPE_BF16 ? 1 : dt == KILN_DTYPE_F16 ? 2 : 0;
    static const int fwd_k[3] = {BK_attention, BK_attention_bf16, BK_attention_f16};
    static const int dq_k[3] = {BK_attention_dq, BK_attention_dq_bf16, BK_attention_dq_f16};
    static const int dkv_k[3] = {BK_attention_dkv, BK_attention_dkv_bf16, BK_attention_dkv_f16};
    cl_kernel kq = ok ? builtin(be, bwd ? dq_k[t] : fwd_k[t]) : NULL;
    cl_kernel kkv = kq && bwd ? builtin(be, dkv_k[t]) : kq;
    if (!kkv) return kiln__cpu_fallback(be, bwd ? KILN_OP_ATTENTION_BACKWARD : KILN_OP_ATTENTION, in, n_in, a, out, n_out);
    kiln__karg dims[] = {i64_arg(B), i64_arg(H), i64_arg(Hkv), i64_arg(Tq), i64_arg(Tk), i64_arg(D),
                         f_arg(KILN__KARG_F32, a->op.attention.scale), i64_arg(a->op.attention.causal)};
    kiln_tensor_t *c[6];
    kiln_status s = densify(in, n_in, c);
    if (s != KILN_OK) return s;
    kiln__karg aq[16], akv[16];
    int nq = n_in + n_out - 2 * bwd; /* the forward's o and lse; dq */
    for (int i = 0; i < n_in; i++) aq[i] = akv[i] = buf_arg(c[i]);
    aq[n_in] = buf_arg(out[0]);
    aq[n_in + 1] = akv[n_in] = buf_arg(out[1]); /* the forward's lse; dk, and dq's sizes go over it */
    akv[n_in + 1] = buf_arg(out[n_out - 1]);
    memcpy(aq + nq, dims, sizeof dims);
    memcpy(akv + n_in + 2, dims, sizeof dims);
    size_t gq = (size_t)((B * H * Tq + 15) / 16 * 16), gkv = (size_t)((B * Hkv * Tk + 15) / 16 * 16);
    s = gq ? kiln__opencl_launch(be, kq, aq, nq + 8, &gq, &block, 1) : KILN_OK;
    if (s == KILN_OK && bwd && gkv) s = kiln__opencl_launch(be, kkv, akv, n_in + 10, &gkv, &block, 1);
    undense(c, n_in);
    return s;
}

/* Layer norm's and RMS norm's backward. in: g, x, w, [mean,] rstd -> dx, dw, [db]: rows
 * of C = the last dim; RMS norm has no mean and no db. */
static kiln_status ocl_norm_backward(KILN__KERNEL_ARGS)
{
    bool rms = n_in == 4;
    int op = rms ? KILN_OP_RMS_NORM_BACKWARD : KILN_OP_LAYER_NORM_BACKWARD;
    cl_kernel kx = all_f32(in, n_in) ? builtin(be, BK_norm_dx) : NULL, kw = kx ? builtin(be, BK_norm_dwb) : NULL;
    if (!kx || !kw) return kiln__cpu_fallback(be, op, in, n_in, a, out, n_out);
    kiln_tensor_t *c[5] = {NULL};
    kiln_status s = densify(in, n_in, c);
    if (s != KILN_OK) return s;
    const kiln_tensor_t *x = c[1], *mean = c[3], *rstd = c[rms ? 3 : 4]; /* RMS: mean is not read */
    int64_t C = x->shape[x->ndim - 1], N = C ? kiln_tensor_numel(x) / C : 0;
    kiln__karg ax[] = {buf_arg(c[0]), buf_arg(x), buf_arg(c[2]), buf_arg(mean), buf_arg(rstd), buf_arg(out[0]),
                       i64_arg(N), i64_arg(C), i64_arg(rms)};
    kiln__karg aw[] = {buf_arg(c[0]), buf_arg(x), buf_arg(mean), buf_arg(rstd), buf_arg(out[1]),
                       buf_arg(rms ? out[1] : out[2]), i64_arg(N), i64_arg(C), i64_arg(rms)};
    size_t gn = (size_t)N, gc = (size_t)C;
    s = gn && gc ? kiln__opencl_launch(be, kx, ax, 9, &gn, NULL, 1) : KILN_OK;
    if (s == KILN_OK && gc) s = kiln__opencl_launch(be, kw, aw, 9, &gc, NULL, 1);
    undense(c, n_in);
    return s;
}

/* The op kernels: X(op, the function ocl_<name> that runs it). */
#define OPS(X)                                                                                          \
    X(MATMUL, matmul) X(ADD_, add_) X(SCALE_, scale_) X(COPY_, copy_) X(ADAMW_, adamw_) X(EMBEDDING, embedding) \
    X(EMBEDDING_BACKWARD, embedding_backward) X(CROSS_ENTROPY, cross_entropy)                          \
    X(CROSS_ENTROPY_BACKWARD, cross_entropy_backward) X(ATTENTION, attention) X(ATTENTION_BACKWARD, attention) \
    X(LAYER_NORM_BACKWARD, norm_backward) X(RMS_NORM_BACKWARD, norm_backward)
#define OP_ROW(op, name) [KILN_OP_##op] = ocl_##name,
/* The mixture-of-experts routing ops, whose host side is opencl_moe.c: X(op, the function
 * kiln__opencl_<name> that runs it). */
#define MOE_OPS(X)                                                                                      \
    X(TOPK, topk) X(MOE_SORT, moe_sort) X(GROUPED_MATMUL, grouped_matmul)                                 \
    X(GROUPED_MATMUL_BACKWARD, grouped_matmul_backward)
#define MOE_ROW(op, name) [KILN_OP_##op] = kiln__opencl_##name,
const kiln__kernel_fn kiln__opencl_kernels[KILN_OP_COUNT] = {OPS(OP_ROW) MOE_OPS(MOE_ROW)};
#endif
