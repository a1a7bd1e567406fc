/* Data-parallel gradient reduction in buckets, overlapped with backward. The
 * parameters are taken in reverse order (backward reaches the last layers first) and
 * packed into buckets: a small first one, so that communication starts early, then
 * buckets of about bucket_bytes. The autograd hook (kiln_set_grad_ready_hook) reports
 * each gradient as soon as it is whole; when every gradient of a bucket is in, the
 * bucket is copied into its flat buffer and its allreduce (average) is started, in
 * bucket-index order on every rank (a bucket that fills early waits for the ones
 * before it), and every hook call tests the collectives in flight so that MPI makes
 * progress while backward computes. kiln_ddp_finish starts what is left, waits for
 * all in order and copies the averages back into the gradients. */
#include <stdlib.h>
#include <string.h>
#include "core/util.h"
#include "dist/flat.h"
#include "kiln/dist.h"
#include "kiln/ops.h"

typedef struct {
    int first, count;    /* params order[first .. first + count) */
    int ready;           /* of them whole */
    int64_t elems;
    kiln_tensor_t *flat; /* (elems) f32 */
    kiln_pg_work_t *work;
} bucket;

typedef struct {
    kiln_tensor_t *t;
    int bucket;
    int64_t off; /* in its bucket */
    bool whole;  /* this step */
} param;

struct kiln_ddp {
    kiln_pg_t *pg;
    param *p;         /* per caller index */
    int n, nb, next;  /* next: the first bucket not started */
    int *order;       /* params in bucket order (reverse of the caller's) */
    bucket *b;
    bool active;
};

kiln_status kiln_ddp_new(kiln_pg_t *pg, kiln_tensor_t *const *params, int n, int64_t first_bucket_bytes,
                         int64_t bucket_bytes, kiln_ddp_t **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "ddp_new: out is NULL");
    *out = NULL;
    if (!pg || !params || n < 1 || first_bucket_bytes < 1 || bucket_bytes < 1)
        return kiln_error(KILN_ERR_ARG, "ddp_new: needs a group, parameters and bucket sizes >= 1 byte");
    kiln_ddp_t *d = calloc(1, sizeof *d);
    if (!d) return kiln_error(KILN_ERR_OOM, "ddp_new: out of memory");
    d->pg = pg;
    d->n = n;
    d->p = calloc((size_t)n, sizeof *d->p);
    d->order = malloc(sizeof *d->order * (size_t)n);
    d->b = calloc((size_t)n, sizeof *d->b);
    kiln_status s = d->p && d->order && d->b ? KILN_OK : kiln_error(KILN_ERR_OOM, "ddp_new: out of memory");
    for (int k = 0; s == KILN_OK && k < n; k++) {
        int i = n - 1 - k;
        d->p[i].t = params[i];
        d->order[k] = i;
        if (kiln_tensor_dtype(params[i]) != KILN_DTYPE_F32)
            s = kiln_error(KILN_ERR_DTYPE, "ddp_new: parameter %d is %s; buckets take f32", i,
                           kiln_dtype_name(kiln_tensor_dtype(params[i])));
        int64_t bytes = kiln_tensor_numel(params[i]) * 4;
        if (d->nb == 0) d->b[d->nb++].first = k;
        int64_t cap = d->nb == 1 ? first_bucket_bytes : bucket_bytes;
        if (d->b[d->nb - 1].count > 0 && d->b[d->nb - 1].elems * 4 + bytes > cap) d->b[d->nb++].first = k;
        bucket *bk = &d->b[d->nb - 1];
        d->p[i].bucket = d->nb - 1;
        d->p[i].off = bk->elems;
        bk->count++;
        bk->elems += kiln_tensor_numel(params[i]);
    }
    kiln_scope_begin();
    for (int j = 0; s == KILN_OK && j < d->nb; j++)
        if (!(d->b[j].flat = kiln_keep(kiln_zeros(&d->b[j].elems, 1, KILN_DTYPE_F32)))) s = kiln_last_status();
    kiln_scope_end();
    if (s == KILN_OK) *out = d;
    else kiln_ddp_free(d);
    return s;
}

void kiln_ddp_free(kiln_ddp_t *d)
{
    if (!d) return;
    if (d->active) kiln_set_grad_ready_hook(NULL, NULL);
    for (int j = 0; d->b && j < d->nb; j++) {
        if (d->b[j].work) kiln_pg_work_wait(d->b[j].work);
        kiln_tensor_free(d->b[j].flat);
    }
    KILN__FREE(d->p, d->order, d->b, d);
}

int kiln_ddp_num_buckets(const kiln_ddp_t *d) { return d ? d->nb : 0; }

/* Copies bucket j's gradients (zeros where a parameter has none) in and starts it. */
static kiln_status start_bucket(kiln_ddp_t *d, int j)
{
    bucket *bk = &d->b[j];
    kiln_status s = KILN_OK;
    kiln_scope_begin();
    for (int k = bk->first; s == KILN_OK && k < bk->first + bk->count; k++) {
        int i = d->order[k];
        kiln_tensor_t *g = kiln_tensor_grad(d->p[i].t), *dst = kiln_narrow(bk->flat, 0, d->p[i].off,
                                                                           kiln_tensor_numel(d->p[i].t));
        s = g ? kiln_tensor_copy_(dst, kiln__flat_of(g)) : kiln_fill_(dst, 0);
    }
    kiln_scope_end();
    if (s == KILN_OK) s = kiln_pg_allreduce_async(d->pg, bk->flat, KILN_REDUCE_AVG, &bk->work);
    return s;
}

/* Starts the buckets that are full, in order; tests those in flight. */
static kiln_status advance(kiln_ddp_t *d, bool all)
{
    kiln_status s = KILN_OK;
    while (s == KILN_OK && d->next < d->nb && (all || d->b[d->next].ready == d->b[d->next].count))
        s = start_bucket(d, d->next++);
    for (int j = 0; s == KILN_OK && j < d->next; j++) {
        bool done;
        if (d->b[j].work) s = kiln_pg_work_test(d->b[j].work, &done);
    }
    return s;
}

static kiln_status on_ready(void *ctx, kiln_tensor_t *leaf)
{
    kiln_ddp_t *d = ctx;
    for (int i = 0; i < d->n; i++)
        if (d->p[i].t == leaf) {
            if (d->p[i].whole) return KILN_OK;
            d->p[i].whole = true;
            d->b[d->p[i].bucket].ready++;
            return advance(d, false);
        }
    return KILN_OK; /* a leaf that is not one of ours */
}

kiln_status kiln_ddp_begin(kiln_ddp_t *d)
{
    if (!d) return kiln_error(KILN_ERR_ARG, "ddp_begin: NULL");
    if (d->active) return kiln_error(KILN_ERR_ARG, "ddp_begin: already begun; call kiln_ddp_finish first");
    for (int i = 0; i < d->n; i++) d->p[i].whole = false;
    for (int j = 0; j < d->nb; j++) d->b[j].ready = 0;
    d->next = 0;
    d->active = true;
    kiln_set_grad_ready_hook(on_ready, d);
    return KILN_OK;
}

kiln_status kiln_ddp_finish(kiln_ddp_t *d)
{
    if (!d) return kiln_error(KILN_ERR_ARG, "ddp_finish: NULL");
    if (!d->active) return kiln_error(KILN_ERR_ARG, "ddp_finish: kiln_ddp_begin was not called");
    kiln_set_grad_ready_hook(NULL, NULL);
    d->active = false;
    kiln_status s = advance(d, true);
    for (int j = 0; j < d->nb; j++) {
        if (!d->b[j].work) continue;
        kiln_status w = kiln_pg_work_wait(d->b[j].work);
        d->b[j].work = NULL;
        if (s == KILN_OK) s = w;
    }
    kiln_scope_begin();
    for (int i = 0; s == KILN_OK && i < d->n; i++) {
        kiln_tensor_t *g = kiln_tensor_grad(d->p[i].t);
        if (!g) continue; /* no rank's graph reached it (the same graph on every rank) */
        kiln_tensor_t *flat = d->b[d->p[i].bucket].flat;
        s = kiln_tensor_copy_(kiln__flat_of(g), kiln_narrow(flat, 0, d->p[i].off, kiln_tensor_numel(g)));
    }
    kiln_scope_end();
    return s;
}
