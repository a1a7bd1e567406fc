/* ZeRO stage 1: AdamW whose moments are sharded across the ranks. The parameters are
 * split in two flat groups (weight-decayed or not), each padded to a multiple of the
 * world size; rank r owns elements [r * shard, (r + 1) * shard) of each. A step
 * reduce-scatters the gradients into the owned shard (averaged), clips by the global
 * norm (the shards' squared norms summed over ranks), runs the fused AdamW update on
 * the shard, and all-gathers the updated shards back into every rank's parameters.
 * Each element sees exactly the update kiln_adamw_new's optimizer would give it, so
 * the losses match the replicated optimizer within float reassociation; the moments
 * take 1/world of the memory. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/dist.h"
#include "kiln/optim.h"

typedef struct {
    int n;        /* parameters in the group */
    int *idx;     /* their indices in the caller's list */
    int64_t *off; /* offset of each in the flat group */
    int64_t total, shard;
    kiln_tensor_t *flat; /* (shard * world): gradients in, then parameters out */
    kiln_tensor_t *p, *g, *m, *v; /* (shard): this rank's master copy, gradient, moments */
    bool decay;
} group;

struct kiln_zero1 {
    kiln_pg_t *pg;
    kiln_tensor_t **params;
    int n;
    double beta1, beta2, eps, wd;
    int64_t steps;
    group gr[2];
};

static kiln_tensor_t *flat_of(kiln_tensor_t *t)
{
    int64_t n = kiln_tensor_numel(t);
    return kiln_reshape(t, &n, 1);
}

/* Copies the group's parameters (or, with slot >= 0, their optimizer slot from full,
 * zeros where it has none) into flat. */
static kiln_status gather_local(kiln_zero1_t *z, group *g, kiln_optim_t *full, int slot)
{
    kiln_status s = kiln_fill_(g->flat, 0);
    for (int k = 0; s == KILN_OK && k < g->n; k++) {
        kiln_tensor_t *src = slot < 0 ? z->params[g->idx[k]] : full ? kiln_optim_state(full, g->idx[k], slot) : NULL;
        if (!src) continue;
        s = kiln_tensor_copy_(kiln_narrow(g->flat, 0, g->off[k], kiln_tensor_numel(src)), flat_of(src));
    }
    return s;
}

kiln_status kiln_zero1_new(kiln_pg_t *pg, kiln_tensor_t *const *params, int n, const bool *decay, double beta1,
                           double beta2, double eps, double weight_decay, kiln_optim_t *resume_from, kiln_zero1_t **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "zero1_new: out is NULL");
    *out = NULL;
    if (!pg || !params || n < 1) return kiln_error(KILN_ERR_ARG, "zero1_new: needs a group and parameters");
    kiln_zero1_t *z = calloc(1, sizeof *z);
    if (!z) return kiln_error(KILN_ERR_OOM, "zero1_new: out of memory");
    bool prev = kiln_set_grad_enabled(false);
    z->pg = pg;
    z->n = n;
    z->beta1 = beta1, z->beta2 = beta2, z->eps = eps, z->wd = weight_decay;
    z->steps = resume_from ? kiln_optim_steps(resume_from) : 0;
    z->params = malloc(sizeof *z->params * (size_t)n);
    kiln_status s = z->params ? KILN_OK : kiln_error(KILN_ERR_OOM, "zero1_new: out of memory");
    int world = kiln_pg_world_size(pg), rank = kiln_pg_rank(pg);
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        group *g = &z->gr[gi];
        g->decay = gi == 0;
        g->idx = malloc(sizeof *g->idx * (size_t)n);
        g->off = malloc(sizeof *g->off * (size_t)n);
        if (!g->idx || !g->off) s = kiln_error(KILN_ERR_OOM, "zero1_new: out of memory");
        for (int i = 0; s == KILN_OK && i < n; i++) {
            z->params[i] = params[i];
            bool d = decay ? decay[i] : kiln_tensor_ndim(params[i]) >= 2;
            if (kiln_tensor_dtype(params[i]) != KILN_DTYPE_F32)
                s = kiln_error(KILN_ERR_DTYPE, "zero1_new: parameter %d is %s; ZeRO-1 takes f32", i,
                               kiln_dtype_name(kiln_tensor_dtype(params[i])));
            if (s != KILN_OK || d != g->decay) continue;
            g->idx[g->n] = i;
            g->off[g->n++] = g->total;
            g->total += kiln_tensor_numel(params[i]);
        }
        if (s != KILN_OK) break;
        g->shard = (g->total + world - 1) / world;
        if (g->shard == 0) continue;
        int64_t all = g->shard * world, sh = g->shard;
        kiln_scope_begin();
        g->flat = kiln_keep(kiln_zeros(&all, 1, KILN_DTYPE_F32));
        g->g = kiln_keep(kiln_zeros(&sh, 1, KILN_DTYPE_F32));
        g->p = kiln_keep(kiln_zeros(&sh, 1, KILN_DTYPE_F32));
        g->m = kiln_keep(kiln_zeros(&sh, 1, KILN_DTYPE_F32));
        g->v = kiln_keep(kiln_zeros(&sh, 1, KILN_DTYPE_F32));
        if (!g->flat || !g->g || !g->p || !g->m || !g->v) s = kiln_last_status();
        kiln_tensor_t *mine[3] = {g->p, g->m, g->v};
        for (int k = 0; s == KILN_OK && k < 3; k++) {
            s = gather_local(z, g, resume_from, k - 1);
            if (s == KILN_OK) s = kiln_tensor_copy_(mine[k], kiln_narrow(g->flat, 0, rank * sh, sh));
        }
        kiln_scope_end();
    }
    kiln_set_grad_enabled(prev);
    if (s != KILN_OK) {
        kiln_zero1_free(z);
        return s;
    }
    *out = z;
    return KILN_OK;
}

void kiln_zero1_free(kiln_zero1_t *z)
{
    if (!z) return;
    for (int gi = 0; gi < 2; gi++) {
        group *g = &z->gr[gi];
        free(g->idx);
        free(g->off);
        kiln_tensor_free(g->flat);
        kiln_tensor_free(g->p);
        kiln_tensor_free(g->g);
        kiln_tensor_free(g->m);
        kiln_tensor_free(g->v);
    }
    free(z->params);
    free(z);
}

int64_t kiln_zero1_state_bytes(const kiln_zero1_t *z)
{
    int64_t b = 0;
    for (int gi = 0; z && gi < 2; gi++) b += z->gr[gi].shard * 3 * (int64_t)sizeof(float); /* p, m, v */
    return b;
}

kiln_status kiln_zero1_step(kiln_zero1_t *z, double lr, double max_norm, double *norm)
{
    if (!z) return kiln_error(KILN_ERR_ARG, "zero1_step: NULL");
    bool prev = kiln_set_grad_enabled(false);
    kiln_status s = KILN_OK;
    kiln_scope_begin();
    /* Gradients in, averaged over the ranks, this rank's shard out. */
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        group *g = &z->gr[gi];
        if (!g->shard) continue;
        s = kiln_fill_(g->flat, 0);
        for (int k = 0; s == KILN_OK && k < g->n; k++) {
            kiln_tensor_t *gr = kiln_tensor_grad(z->params[g->idx[k]]);
            if (gr) s = kiln_tensor_copy_(kiln_narrow(g->flat, 0, g->off[k], kiln_tensor_numel(gr)), flat_of(gr));
        }
        if (s == KILN_OK) s = kiln_pg_reduce_scatter(z->pg, g->flat, g->g, KILN_REDUCE_AVG);
    }
    /* The global norm: every shard's squared norm, summed over the ranks. */
    double sq = 0;
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        double v = 0;
        if (z->gr[gi].shard) s = kiln_tensor_item(kiln_sum(kiln_mul(z->gr[gi].g, z->gr[gi].g), NULL, 0, false), &v);
        sq += v;
    }
    if (s == KILN_OK) {
        int64_t one = 1;
        kiln_tensor_t *t = kiln_from_data(&sq, &one, 1, KILN_DTYPE_F64);
        s = t ? kiln_pg_allreduce(z->pg, t, KILN_REDUCE_SUM) : kiln_last_status();
        if (s == KILN_OK) s = kiln_tensor_to_host(t, &sq, sizeof sq);
    }
    double nrm = sqrt(sq);
    if (norm) *norm = nrm;
    int64_t t = z->steps + 1;
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        group *g = &z->gr[gi];
        if (!g->shard) continue;
        if (max_norm > 0 && nrm > max_norm) s = kiln_mul_scalar_(g->g, max_norm / (nrm + 1e-6)); /* as clip_grad_norm */
        if (s == KILN_OK)
            s = kiln_adamw_(g->p, g->g, g->m, g->v, lr, z->beta1, z->beta2, z->eps, g->decay ? z->wd : 0.0, t);
        /* Every rank's updated shard, back into every rank's parameters. */
        if (s == KILN_OK) s = kiln_pg_allgather(z->pg, g->p, g->flat);
        for (int k = 0; s == KILN_OK && k < g->n; k++) {
            kiln_tensor_t *p = z->params[g->idx[k]];
            s = kiln_tensor_copy_(flat_of(p), kiln_narrow(g->flat, 0, g->off[k], kiln_tensor_numel(p)));
        }
    }
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    if (s == KILN_OK) z->steps = t;
    return s;
}

kiln_status kiln_zero1_gather_state(kiln_zero1_t *z, kiln_optim_t *full)
{
    if (!z || !full) return kiln_error(KILN_ERR_ARG, "zero1_gather_state: NULL");
    if (kiln_optim_num_slots(full) != 2) return kiln_error(KILN_ERR_ARG, "zero1_gather_state: the optimizer is not AdamW");
    kiln_status s = KILN_OK;
    bool prev = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        group *g = &z->gr[gi];
        if (!g->shard) continue;
        kiln_tensor_t *mine[2] = {g->m, g->v};
        for (int slot = 0; s == KILN_OK && slot < 2; slot++) {
            s = kiln_pg_allgather(z->pg, mine[slot], g->flat);
            for (int k = 0; s == KILN_OK && k < g->n; k++) {
                kiln_tensor_t *p = z->params[g->idx[k]];
                kiln_tensor_t *part = kiln_narrow(g->flat, 0, g->off[k], kiln_tensor_numel(p));
                s = kiln_optim_set_state(full, z->steps, g->idx[k], slot,
                                         kiln_reshape(part, kiln_tensor_shape(p), kiln_tensor_ndim(p)));
            }
        }
    }
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    return s;
}
