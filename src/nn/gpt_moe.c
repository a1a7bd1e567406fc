/* The GPT model's mixture-of-experts blocks as a whole (docs/model.md, "Mixture of
 * experts"): the balancing biases' update and the router statistics, and expert
 * parallelism, where each rank of a group holds a share of every block's routed experts
 * and the blocks exchange rows with the ranks that hold theirs (moe.c). */
#include <stdlib.h>
#include <string.h>
#include "kiln/dist.h"
#include "kiln/ops.h"
#include "nn/gpt_impl.h"

kiln_status kiln_gpt_moe_update(kiln_gpt_t *m, kiln_pg_t *pg)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "gpt_moe_update: model is NULL");
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < m->cfg.n_layer; i++) {
        kiln__moe *e = m->layers[i].moe;
        if (!e) continue;
        if (pg) s = kiln_pg_allreduce(pg, e->load, KILN_REDUCE_SUM); /* every rank's rows, and dropped ones */
        if (s == KILN_OK) s = kiln__moe_update(&m->cfg, e);
    }
    return s;
}

bool kiln_gpt_moe_stats(const kiln_gpt_t *m, int layer, float *load, float *bias, double *dropped)
{
    if (!m || layer < 0 || layer >= m->cfg.n_layer || !m->layers[layer].moe) return false;
    const kiln__moe *e = m->layers[layer].moe;
    int E = m->cfg.n_routed_experts;
    float *counters = malloc(sizeof *counters * (size_t)(E + 1)); /* the experts' rows, then the dropped ones */
    bool ok = counters && kiln_tensor_to_host(e->last_load, counters, sizeof *counters * (size_t)(E + 1)) == KILN_OK &&
              (!bias || kiln_tensor_to_host(e->router_b, bias, sizeof *bias * (size_t)E) == KILN_OK);
    if (ok && load) memcpy(load, counters, sizeof *load * (size_t)E);
    if (ok && dropped) *dropped = counters[E];
    free(counters);
    return ok;
}

/* Is t one of the routed experts' weights, sharded over m->ep? */
bool kiln__gpt_expert_shard(const kiln_gpt_t *m, const kiln_tensor_t *t)
{
    for (int i = 0; m->ep && i < m->cfg.n_layer; i++) {
        const kiln__moe *e = m->layers[i].moe;
        if (e && (t == e->gate || t == e->up || t == e->down)) return true;
    }
    return false;
}

kiln_status kiln_gpt_shard_experts(kiln_gpt_t *m, kiln_pg_t *pg)
{
    if (!m || !pg) return kiln_error(KILN_ERR_ARG, "gpt_shard_experts: NULL model or group");
    int W = kiln_pg_world_size(pg), r = kiln_pg_rank(pg), E = m->cfg.n_routed_experts;
    if (m->ep) return kiln_error(KILN_ERR_ARG, "gpt_shard_experts: the model's experts are sharded already");
    if (E == 0 || m->cfg.n_dense_layers >= m->cfg.n_layer)
        return kiln_error(KILN_ERR_ARG, "gpt_shard_experts: the model has no mixture-of-experts block to shard");
    if (E % W)
        return kiln_error(KILN_ERR_ARG, "gpt_shard_experts: %d routed experts do not split evenly over %d ranks; pick a "
                          "multiple of the world size", E, W);
    int64_t El = E / W;
    int L = m->cfg.n_layer;
    kiln_tensor_t **mine = calloc((size_t)L * 3, sizeof *mine); /* every shard made before any is put in */
    if (!mine) return kiln_error(KILN_ERR_OOM, "gpt_shard_experts: out of memory");
    bool grad = kiln_set_grad_enabled(false);
    kiln_status s = KILN_OK;
    kiln_scope_begin();
    for (int i = 0; s == KILN_OK && i < L; i++) {
        kiln__moe *e = m->layers[i].moe;
        kiln_tensor_t *whole[3] = {e ? e->gate : NULL, e ? e->up : NULL, e ? e->down : NULL};
        for (int j = 0; e && s == KILN_OK && j < 3; j++)
            if (!(mine[3 * i + j] = kiln_keep(kiln_clone(kiln_narrow(whole[j], 0, r * El, El))))) s = kiln_last_status();
    }
    kiln_scope_end();
    kiln_set_grad_enabled(grad);
    for (int i = 0; i < L; i++) {
        kiln__moe *e = m->layers[i].moe;
        kiln_tensor_t **part[3] = {e ? &e->gate : NULL, e ? &e->up : NULL, e ? &e->down : NULL};
        for (int j = 0; e && j < 3; j++) {
            kiln_tensor_t *t = mine[3 * i + j];
            if (s != KILN_OK) { /* the model stays whole */
                kiln_tensor_free(t);
                continue;
            }
            kiln_tensor_set_requires_grad(t, true);
            if (!kiln_tensor_requires_grad(t)) {
                s = kiln_error(KILN_ERR_OOM, "gpt: out of memory marking an expert's weight for gradients");
                kiln_tensor_free(t);
                continue;
            }
            for (int k = 0; k < m->n; k++)
                if (m->params[k] == *part[j]) m->params[k] = t;
            kiln_tensor_free(*part[j]); /* the model's reference */
            *part[j] = t;
        }
        if (e && s == KILN_OK) e->ep = pg;
    }
    free(mine);
    if (s == KILN_OK) m->ep = pg;
    return s;
}

bool kiln_gpt_param_sharded(const kiln_gpt_t *m, int i)
{
    return m && i >= 0 && i < m->n && kiln__gpt_expert_shard(m, m->params[i]);
}

kiln_tensor_t *kiln_gpt_gather_param(kiln_gpt_t *m, int i, kiln_tensor_t *t)
{
    if (!m || !t || i < 0 || i >= m->n) return kiln_error(KILN_ERR_ARG, "gpt_gather_param: NULL model or tensor, or no "
                                                          "parameter %d", i), NULL;
    if (!kiln_gpt_param_sharded(m, i)) return t;
    const kiln_tensor_t *p = m->params[i];
    int nd = kiln_tensor_ndim(p);
    if (kiln_tensor_ndim(t) != nd || memcmp(kiln_tensor_shape(t), kiln_tensor_shape(p), sizeof(int64_t) * (size_t)nd)) {
        char a[96], b[96];
        return kiln_error(KILN_ERR_SHAPE, "gpt_gather_param: %s is not shaped like parameter %s %s",
                          kiln_tensor_describe(t, a, sizeof a), m->names[i], kiln_tensor_describe(p, b, sizeof b)), NULL;
    }
    int64_t full[KILN_MAX_DIMS];
    memcpy(full, kiln_tensor_shape(p), sizeof(int64_t) * (size_t)nd);
    full[0] *= kiln_pg_world_size(m->ep);
    kiln_tensor_t *out = kiln_zeros(full, nd, kiln_tensor_dtype(t)), *in = kiln_contiguous(t);
    if (!out || !in || kiln_pg_allgather(m->ep, in, out) != KILN_OK) return NULL;
    return out;
}

kiln_tensor_t *kiln_gpt_shard_param(const kiln_gpt_t *m, int i, kiln_tensor_t *full)
{
    if (!m || !full || i < 0 || i >= m->n) return kiln_error(KILN_ERR_ARG, "gpt_shard_param: NULL model or tensor, or no "
                                                             "parameter %d", i), NULL;
    if (!kiln_gpt_param_sharded(m, i)) return full;
    int64_t El = kiln_tensor_dim(m->params[i], 0), W = kiln_pg_world_size(m->ep);
    if (kiln_tensor_ndim(full) != kiln_tensor_ndim(m->params[i]) || kiln_tensor_dim(full, 0) != El * W) {
        char a[96];
        return kiln_error(KILN_ERR_SHAPE, "gpt_shard_param: %s for %s must hold all %lld experts in its first dim",
                          kiln_tensor_describe(full, a, sizeof a), m->names[i], (long long)(El * W)), NULL;
    }
    return kiln_narrow(full, 0, kiln_pg_rank(m->ep) * El, El);
}
