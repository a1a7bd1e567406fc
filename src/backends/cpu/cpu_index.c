/* Indexing kernels: embedding, index_select, gather, scatter_add, cat. Every index is
 * checked before it is used. */
#include <stdlib.h>
#include <string.h>
#include "backends/cpu/cpu.h"

typedef struct {
    const char *src;
    char *dst;
    const char *idx;
    kiln_dtype idt;
    size_t row_bytes;
    int64_t outer, n_idx, L; /* index_select: (outer, L, inner) -> (outer, n_idx, inner) */
} rows_ctx;

static void rows_range(void *c, int64_t b, int64_t e)
{
    const rows_ctx *k = c;
    size_t isz = kiln_dtype_size(k->idt);
    for (int64_t r = b; r < e; r++) {
        int64_t o = r / k->n_idx, j = r % k->n_idx;
        int64_t v = kiln__load_index(k->idx + j * (int64_t)isz, k->idt);
        memcpy(k->dst + r * (int64_t)k->row_bytes, k->src + (o * k->L + v) * (int64_t)k->row_bytes, k->row_bytes);
    }
}

/* Copies whole rows chosen by idx: out (outer, n_idx, row) from x (outer, L, row). */
static kiln_status select_rows(const char *op, kiln_tensor_t *x, kiln_tensor_t *idx, kiln_tensor_t *o, int dim)
{
    kiln_tensor_t *tx, *ti, *cx = cpu_contig(x, &tx), *ci = cpu_contig(idx, &ti);
    kiln_status s = cx && ci ? cpu_check_indices(op, ci, x->shape[dim], NULL, NULL) : kiln_last_status();
    if (s == KILN_OK) {
        int64_t inner = kiln__numel(x->ndim - dim - 1, x->shape + dim + 1);
        rows_ctx k = {kiln__data(cx), kiln__data(o), kiln__data(ci), ci->dtype,
                      (size_t)inner * kiln_dtype_size(x->dtype), kiln__numel(dim, x->shape),
                      kiln__numel(ci->ndim, ci->shape), x->shape[dim]};
        kiln__parallel_for(k.outer * k.n_idx, 64, rows_range, &k);
    }
    kiln_tensor_free(tx);
    kiln_tensor_free(ti);
    return s;
}

kiln_status kiln__cpu_embedding(KILN__KERNEL_ARGS) { return select_rows("embedding", in[0], in[1], out[0], 0); }
kiln_status kiln__cpu_index_select(KILN__KERNEL_ARGS) { return select_rows("index_select", in[0], in[1], out[0], (int)a->op.dim.dim); }

/* dW (V, C) from g (N, C), both of dtype dt: each task owns a range of columns for every
 * row, so the additions for one weight happen in row order whatever the thread count.
 * f32 adds natively, other dtypes through double. */
typedef struct {
    const char *g, *idx;
    char *dw;
    kiln_dtype dt, idt;
    int64_t N, C;
} emb_ctx;

static void emb_bwd_range(void *c, int64_t b, int64_t e)
{
    const emb_ctx *k = c;
    size_t isz = kiln_dtype_size(k->idt), sz = kiln_dtype_size(k->dt);
    int64_t c0 = b * 64, c1 = e * 64 < k->C ? e * 64 : k->C;
    for (int64_t n = 0; n < k->N; n++) {
        int64_t v = kiln__load_index(k->idx + n * (int64_t)isz, k->idt);
        const char *g = k->g + n * k->C * (int64_t)sz;
        char *d = k->dw + v * k->C * (int64_t)sz;
        if (k->dt == KILN_DTYPE_F32)
            for (int64_t j = c0; j < c1; j++) ((float *)d)[j] += ((const float *)g)[j];
        else
            for (int64_t j = c0; j < c1; j++) {
                char *q = d + j * (int64_t)sz;
                kiln__store(q, k->dt, kiln__load(q, k->dt) + kiln__load(g + j * (int64_t)sz, k->dt));
            }
    }
}

kiln_status kiln__cpu_embedding_backward(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *tg, *ti, *g = cpu_contig(in[0], &tg), *idx = cpu_contig(in[1], &ti);
    kiln_tensor_t *o = out[0];
    int64_t V = o->shape[0], C = o->shape[1], N = kiln__numel(idx ? idx->ndim : 0, idx ? idx->shape : NULL);
    kiln_status s = g && idx ? cpu_check_indices("embedding backward", idx, V, NULL, NULL) : kiln_last_status();
    if (s == KILN_OK) {
        memset(kiln__data(o), 0, kiln_dtype_size(o->dtype) * (size_t)(V * C));
        emb_ctx k = {kiln__data(g), kiln__data(idx), kiln__data(o), o->dtype, idx->dtype, N, C};
        kiln__parallel_for((C + 63) / 64, 1, emb_bwd_range, &k);
    }
    kiln_tensor_free(tg);
    kiln_tensor_free(ti);
    return s;
}

/* Offset in a contiguous tensor of `shape` of the flat position `flat` of another
 * contiguous tensor of `ishape`, with dim `dim` replaced by `v`. */
static int64_t remap(int64_t flat, int nd, const int64_t *ishape, const int64_t *shape, int dim, int64_t v)
{
    int64_t off = 0, mul = 1;
    for (int d = nd - 1; d >= 0; d--) {
        int64_t i = flat % ishape[d];
        flat /= ishape[d];
        off += (d == dim ? v : i) * mul;
        mul *= shape[d];
    }
    return off;
}

kiln_status kiln__cpu_gather(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *tx, *ti, *x = cpu_contig(in[0], &tx), *idx = cpu_contig(in[1], &ti);
    int dim = (int)a->op.dim.dim;
    kiln_status s = x && idx ? cpu_check_indices("gather", idx, in[0]->shape[dim], NULL, NULL) : kiln_last_status();
    if (s == KILN_OK) {
        size_t sz = kiln_dtype_size(x->dtype), isz = kiln_dtype_size(idx->dtype);
        const char *xp = kiln__data(x), *ip = kiln__data(idx);
        char *op = kiln__data(out[0]);
        int64_t n = kiln__numel(idx->ndim, idx->shape);
        for (int64_t i = 0; i < n; i++) {
            int64_t v = kiln__load_index(ip + i * (int64_t)isz, idx->dtype);
            memcpy(op + i * (int64_t)sz, xp + remap(i, x->ndim, idx->shape, x->shape, dim, v) * (int64_t)sz, sz);
        }
    }
    kiln_tensor_free(tx);
    kiln_tensor_free(ti);
    return s;
}

/* Serial on purpose: several sources may add into one element, and a fixed order keeps
 * the result the same on every run. */
kiln_status kiln__cpu_scatter_add(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *ti, *ts, *idx = cpu_contig(in[1], &ti), *src = cpu_contig(in[2], &ts);
    int dim = (int)a->op.dim.dim;
    kiln_tensor_t *o = out[0];
    kiln_status s =
        idx && src ? cpu_check_indices("scatter_add", idx, in[0]->shape[dim], NULL, NULL) : kiln_last_status();
    if (s == KILN_OK) {
        cpu_copy(o, in[0]);
        size_t sz = kiln_dtype_size(o->dtype), isz = kiln_dtype_size(idx->dtype);
        const char *ip = kiln__data(idx), *sp = kiln__data(src);
        char *op = kiln__data(o);
        int64_t n = kiln__numel(idx->ndim, idx->shape);
        for (int64_t i = 0; i < n; i++) {
            int64_t v = kiln__load_index(ip + i * (int64_t)isz, idx->dtype);
            char *q = op + remap(i, o->ndim, idx->shape, o->shape, dim, v) * (int64_t)sz;
            if (o->dtype == KILN_DTYPE_F32) *(float *)q += *(const float *)(sp + i * (int64_t)sz);
            else kiln__store(q, o->dtype, kiln__load(q, o->dtype) + kiln__load(sp + i * (int64_t)sz, o->dtype));
        }
    }
    kiln_tensor_free(ti);
    kiln_tensor_free(ts);
    return s;
}

kiln_status kiln__cpu_cat(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *o = out[0];
    int dim = (int)a->op.dim.dim;
    int64_t at = 0;
    for (int i = 0; i < n_in; i++) {
        kiln_tensor_t v;
        int64_t shape[KILN_MAX_DIMS];
        memcpy(shape, o->shape, sizeof shape);
        shape[dim] = in[i]->shape[dim];
        cpu_view(&v, o, o->ndim, shape, o->stride, o->offset + at * o->stride[dim]);
        if (shape[dim] > 0) cpu_copy(&v, in[i]);
        at += shape[dim];
    }
    return KILN_OK;
}

/* dst[index[i]] = src[i] along dim 0; dst is written in place, so it must be dense. */
kiln_status kiln__cpu_index_copy_(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *dst = in[0];
    if (!kiln__is_contiguous(dst))
        return kiln__err(KILN_ERR_UNSUPPORTED, "index_copy_: the destination must be contiguous on the cpu backend");
    kiln_tensor_t *ti, *ts, *ci = cpu_contig(in[1], &ti), *cs = cpu_contig(in[2], &ts);
    kiln_status s = ci && cs ? cpu_check_indices("index_copy_", ci, dst->shape[0], NULL, NULL) : kiln_last_status();
    if (s == KILN_OK) {
        size_t row = (size_t)kiln__numel(dst->ndim - 1, dst->shape + 1) * kiln_dtype_size(dst->dtype);
        size_t isz = kiln_dtype_size(ci->dtype);
        const char *ip = kiln__data(ci), *sp = kiln__data(cs);
        char *dp = kiln__data(dst);
        for (int64_t i = 0; i < ci->shape[0]; i++) {
            int64_t v = kiln__load_index(ip + i * (int64_t)isz, ci->dtype);
            memmove(dp + v * (int64_t)row, sp + i * (int64_t)row, row);
        }
    }
    kiln_tensor_free(ti);
    kiln_tensor_free(ts);
    return s;
}
