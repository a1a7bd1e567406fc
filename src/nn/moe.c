/* A mixture-of-experts block's feed-forward (moe.h; docs/model.md, "Mixture of
 * experts"), written with kiln's ops so that autograd, capture and every backend see it
 * as any other part of the model. The rows of all experts go through one grouped GEMM
 * each for gate, up and down: the tokens sorted by expert (kiln_moe_sort), each
 * expert's run of rows multiplied by its weights in one op whose per-expert counts are
 * data, so a captured step does not capture again when they change; the rows are put
 * back in token order and each token's k rows weighted and summed. */
#include <math.h>
#include <stdlib.h>
#include "kiln/ops.h"
#include "nn/moe.h"

/* (rows cols) i64, the (rows, cols) grid flattened, each element its row index (dim 0)
 * or its column index (dim 1), made with ops (no host data, so that a step records as a
 * device's command buffer). Dim 0 of (N, k): the token of each of N k assignments; dim 1
 * of (W, El): expert x's index among its rank's El, x mod El. */
static kiln_tensor_t *grid_index(int64_t rows, int64_t cols, int dim)
{
    int64_t n = rows * cols, shape[2] = {rows, cols};
    kiln_tensor_t *line = kiln_unsqueeze(kiln_arange(0, (double)shape[dim], 1, KILN_DTYPE_I64), 1 - dim);
    return kiln_reshape(kiln_contiguous(kiln_expand(line, shape, 2)), &n, 1);
}

/* The inverse of the permutation order (n): inv[order[i]] = i, a scatter of n integers. */
static kiln_tensor_t *inverse(kiln_tensor_t *order)
{
    int64_t n = kiln_tensor_numel(order);
    return kiln_scatter_add(kiln_zeros(&n, 1, KILN_DTYPE_I64), 0, order, kiln_arange(0, (double)n, 1, KILN_DTYPE_I64));
}

/* x w^T for w (out, in) (n rows): a GEMM, or each row alone on w packed (wp: the
 * serving pool's kiln_matmul_rows_pack). */
static kiln_tensor_t *lin(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *wp, int64_t n)
{
    return wp ? kiln_matmul_rows_packed(x, wp, n) : kiln_linear(x, w, NULL);
}

/* x (N, C) through a SwiGLU of weights (out, in) of width W: down(silu(gate x) * up x);
 * on their packed copies where given. */
static kiln_tensor_t *swiglu(kiln_tensor_t *x, kiln_tensor_t *const w[3], kiln_tensor_t *const wp[3], int64_t W,
                             int64_t C)
{
    return lin(kiln_mul(kiln_silu(lin(x, w[0], wp[0], W)), lin(x, w[1], wp[1], W)), w[2], wp[2], C);
}

/* (out, in) = w^T packed in dt. */
static kiln_tensor_t *pack_t(kiln_tensor_t *w, kiln_dtype dt)
{
    return kiln_keep(kiln_matmul_rows_pack(kiln_cast(kiln_contiguous(kiln_transpose(w, 0, 1)), dt)));
}

kiln_status kiln__moe_pack(const kiln_gpt_config *c, const kiln__moe *e, kiln_dtype weights, kiln__moe_packed *out)
{
    int E = c->n_routed_experts;
    *out = (kiln__moe_packed){.E = E};
    out->gate = calloc((size_t)E * 3, sizeof *out->gate);
    if (!out->gate) return kiln_error(KILN_ERR_OOM, "moe: out of memory");
    out->up = out->gate + E, out->down = out->up + E;
    bool ok = (out->router = kiln_keep(kiln_matmul_rows_pack(kiln_cast(e->router_w, weights)))) != NULL;
    for (int x = 0; ok && x < E; x++) {
        kiln_tensor_t *w[3] = {e->gate, e->up, e->down}, **to[3] = {&out->gate[x], &out->up[x], &out->down[x]};
        for (int j = 0; ok && j < 3; j++) ok = (*to[j] = pack_t(kiln_squeeze(kiln_narrow(w[j], 0, x, 1), 0), weights)) != NULL;
    }
    if (ok && e->sg)
        ok = (out->sg = kiln_keep(kiln_matmul_rows_pack(kiln_cast(e->sg, weights)))) &&
             (out->su = kiln_keep(kiln_matmul_rows_pack(kiln_cast(e->su, weights)))) &&
             (out->sd = kiln_keep(kiln_matmul_rows_pack(kiln_cast(e->sd, weights))));
    return ok ? KILN_OK : kiln_last_status();
}

void kiln__moe_packed_free(kiln__moe_packed *p)
{
    if (!p) return;
    for (int x = 0; p->gate && x < 3 * p->E; x++) kiln_tensor_free(p->gate[x]);
    kiln_tensor_free(p->router), kiln_tensor_free(p->sg), kiln_tensor_free(p->su), kiln_tensor_free(p->sd);
    free(p->gate);
    *p = (kiln__moe_packed){0};
}

/* Group-limited routing (DeepSeek-V3): the E experts in G groups of E / G; a group's
 * score the sum of its two best choice values; the choices outside each row's
 * moe_topk_group best groups set to -inf (not 0: a choice is a score plus a bias that
 * goes below 0 for an overloaded expert, which a 0 outside the groups would beat). */
static kiln_tensor_t *limit_to_groups(const kiln_gpt_config *c, kiln_tensor_t *choice)
{
    int64_t N = kiln_tensor_dim(choice, 0), E = c->n_routed_experts, G = c->moe_n_group;
    int64_t grouped[3] = {N, G, E / G}, ng[2] = {N, G}, ntg[2] = {N, c->moe_topk_group}, ne[2] = {N, E};
    int last = 2;
    kiln_tensor_t *top2 = NULL, *ti = NULL, *gi = NULL, *gv = NULL;
    if (kiln_topk(kiln_reshape(choice, grouped, 3), 2, &top2, &ti) != KILN_OK) return NULL;
    if (kiln_topk(kiln_sum(top2, &last, 1, false), c->moe_topk_group, &gv, &gi) != KILN_OK) return NULL;
    kiln_tensor_t *keep = kiln_scatter_add(kiln_zeros(ng, 2, KILN_DTYPE_F32), 1, gi, kiln_ones(ntg, 2, KILN_DTYPE_F32));
    keep = kiln_reshape(kiln_contiguous(kiln_expand(kiln_unsqueeze(keep, 2), grouped, 3)), ne, 2);
    return kiln_where(kiln_gt(keep, kiln_scalar(0, KILN_DTYPE_F32)), choice, kiln_scalar(-INFINITY, KILN_DTYPE_F32));
}

/* The routed experts' rows in expert order (order, offsets of kiln_moe_sort) each
 * alone: expert e's rows gathered and multiplied by its packed weights through
 * kiln_matmul_rows_packed, the experts' results concatenated. For serving, where a
 * row's result must not depend on the batch (a grouped GEMM's blocks would). */
static kiln_tensor_t *experts_by_rows(const kiln_gpt_config *c, const kiln__moe_packed *pk, kiln_tensor_t *xs,
                                      kiln_tensor_t *offsets, int64_t E)
{
    int64_t *off = malloc(sizeof *off * (size_t)(E + 1));
    if (!off || kiln_tensor_to_host(offsets, off, sizeof *off * (size_t)(E + 1)) != KILN_OK) {
        free(off);
        return kiln_last_status() ? NULL : (kiln_error(KILN_ERR_OOM, "moe: out of memory"), NULL);
    }
    kiln_tensor_t *parts[4096];
    int n = 0;
    int64_t Fe = kiln_gpt_moe_ffn(c), C = kiln_tensor_dim(xs, 1);
    for (int64_t x = 0; x < E; x++) {
        if (off[x + 1] == off[x]) continue;
        kiln_tensor_t *r = kiln_narrow(xs, 0, off[x], off[x + 1] - off[x]);
        kiln_tensor_t *const w[3] = {NULL, NULL, NULL}, *const wp[3] = {pk->gate[x], pk->up[x], pk->down[x]};
        parts[n++] = swiglu(kiln_contiguous(r), w, wp, Fe, C);
    }
    free(off);
    return n == 1 ? parts[0] : kiln_cat(parts, n, 0);
}

/* The rows xs (M, C) in expert order through the experts gate, up, down (rows
 * offsets[e] .. offsets[e + 1] - 1 by expert e): one grouped GEMM each; rows after the
 * last expert's come out zero. */
static kiln_tensor_t *experts_grouped(const kiln__moe *e, kiln_tensor_t *xs, kiln_tensor_t *offsets)
{
    kiln_tensor_t *h = kiln_mul(kiln_silu(kiln_grouped_matmul(xs, e->gate, offsets)),
                                kiln_grouped_matmul(xs, e->up, offsets));
    return kiln_grouped_matmul(h, e->down, offsets);
}

/* Expert parallelism (docs/model.md): the rows xs (R, C) in expert order (offsets, and
 * each row's expert) sent to the ranks that hold their experts, rank d's run being
 * experts d El .. (d + 1) El - 1; each rank's received rows (in rank order, each rank's
 * in expert order) sorted again by local expert, stably, through its experts, put back
 * and sent home, where they arrive in xs's order. The receiving buffers are sized for
 * the worst case, every rank's rows to one rank (W R rows), and the counts are data, so
 * a captured step runs whatever the routing. (Sized eagerly by the rows that come, the
 * peak memory rose: docs/perf-log.md.) Each row goes through the same products as on
 * one rank. */
static kiln_tensor_t *experts_parallel(const kiln_gpt_config *c, const kiln__moe *e, kiln_tensor_t *xs,
                                       kiln_tensor_t *offsets, kiln_tensor_t *expert)
{
    int64_t W = kiln_pg_world_size(e->ep), E = c->n_routed_experts, El = E / W, R = kiln_tensor_dim(xs, 0);
    kiln_tensor_t *bounds = kiln_index_select(offsets, 0, kiln_arange(0, (double)E + 1, (double)El, KILN_DTYPE_I64));
    kiln_tensor_t *send = kiln_sub(kiln_narrow(bounds, 0, 1, W), kiln_narrow(bounds, 0, 0, W)); /* (W) rows per rank */
    int64_t M = W * R; /* the worst case: every rank's rows here */
    kiln_tensor_t *lr, *xr, *rc, *ys, *back;
    if (kiln_pg_all_to_all(e->ep, kiln_index_select(grid_index(W, El, 1), 0, expert), send, M, &lr, &rc) != KILN_OK ||
        kiln_pg_all_to_all(e->ep, xs, send, M, &xr, &rc) != KILN_OK)
        return NULL;
    /* the rows after the received ones are no expert's: El, sorted last, outside the offsets */
    kiln_tensor_t *got = kiln_sum(kiln_cast(rc, KILN_DTYPE_F64), NULL, 0, false);
    kiln_tensor_t *valid = kiln_lt(kiln_arange(0, (double)M, 1, KILN_DTYPE_F64), got);
    kiln_tensor_t *order = NULL, *off = NULL;
    if (kiln_moe_sort(kiln_where(valid, lr, kiln_scalar((double)El, KILN_DTYPE_I64)), El + 1, &order, &off) != KILN_OK)
        return NULL;
    kiln_tensor_t *yg = experts_grouped(e, kiln_index_select(xr, 0, order), kiln_narrow(off, 0, 0, El + 1));
    if (kiln_pg_all_to_all(e->ep, kiln_index_select(yg, 0, inverse(order)), rc, R, &ys, &back) != KILN_OK) return NULL;
    return ys;
}

/* The sequence-wise balance loss of B sequences of T rows (docs/model.md): alpha times
 * the mean over sequences of sum_e f_e P_e, f from the choices (no gradient), P from the
 * scores normalised per row. */
static kiln_tensor_t *balance_loss(const kiln_gpt_config *c, kiln_tensor_t *s, kiln_tensor_t *idx, int64_t B)
{
    int64_t N = kiln_tensor_dim(s, 0), E = kiln_tensor_dim(s, 1), k = kiln_tensor_dim(idx, 1), T = N / B;
    int last = 1, seq = 1;
    kiln_tensor_t *sp = kiln_div(s, kiln_sum(s, &last, 1, true));
    kiln_tensor_t *P = kiln_mean(kiln_reshape(sp, (int64_t[]){B, T, E}, 3), &seq, 1, false); /* (B, E) */
    int64_t ne[2] = {N, E}, nk[2] = {N, k};
    kiln_tensor_t *chosen = kiln_scatter_add(kiln_zeros(ne, 2, KILN_DTYPE_F32), 1, idx, kiln_ones(nk, 2, KILN_DTYPE_F32));
    kiln_tensor_t *f = kiln_mul_scalar(kiln_sum(kiln_reshape(chosen, (int64_t[]){B, T, E}, 3), &seq, 1, false),
                                       (double)E / (double)(k * T));
    kiln_tensor_t *per_seq = kiln_sum(kiln_mul(kiln_detach(f), P), &last, 1, false); /* (B) */
    return kiln_mul_scalar(kiln_mean(per_seq, NULL, 0, false), c->moe_balance_loss);
}

kiln_tensor_t *kiln__moe_forward(const kiln_gpt_config *c, const kiln__moe *e, kiln_tensor_t *x, int64_t B, bool train,
                                 const kiln__moe_packed *pk, kiln_tensor_t **balance)
{
    int64_t N = kiln_tensor_dim(x, 0), C = kiln_tensor_dim(x, 1), E = c->n_routed_experts, k = c->moe_top_k;
    int last = 1;
    /* the router: scores, the choice steered by the bias, the weights from the scores */
    kiln_tensor_t *logits = lin(x, e->router_w, pk ? pk->router : NULL, E);
    kiln_tensor_t *s = c->moe_router == KILN_ROUTER_SOFTMAX ? kiln_softmax(logits, 1) : kiln_sigmoid(logits);
    kiln_tensor_t *vals = NULL, *idx = NULL, *choice = s ? kiln_add(kiln_detach(s), e->router_b) : NULL;
    if (choice && c->moe_n_group > 1) choice = limit_to_groups(c, choice);
    if (!choice || kiln_topk(choice, k, &vals, &idx) != KILN_OK) return NULL;
    kiln_tensor_t *w = kiln_gather(s, 1, idx); /* (N, k) */
    if (c->moe_norm_topk) w = kiln_div(w, kiln_sum(w, &last, 1, true));
    if (c->moe_scale != 1.0) w = kiln_mul_scalar(w, c->moe_scale);
    /* the rows sorted by expert, through the experts in one grouped GEMM each */
    kiln_tensor_t *order = NULL, *offsets = NULL;
    if (kiln_moe_sort(idx, E, &order, &offsets) != KILN_OK) return NULL;
    int64_t nk = N * k, nkc[3] = {N, k, C}, nk1[2] = {N * k, 1};
    kiln_tensor_t *tok = kiln_index_select(grid_index(N, k, 0), 0, order); /* (N k) */
    kiln_tensor_t *xs = kiln_index_select(x, 0, tok);
    /* the expert of each sorted row, where the exchange or the capacity needs it */
    kiln_tensor_t *expert = e->ep || c->moe_capacity > 0 ? kiln_index_select(kiln_reshape(idx, &nk, 1), 0, order) : NULL;
    kiln_tensor_t *ys; /* (N k, C), sorted */
    if (pk) ys = experts_by_rows(c, pk, xs, offsets, E);
    else if (e->ep) ys = experts_parallel(c, e, xs, offsets, expert);
    else ys = experts_grouped(e, xs, offsets);
    /* back in assignment order by the inverse permutation (a scatter of N k integers,
     * where a scatter of the rows would move N k C numbers), then each token's k rows
     * weighted and summed */
    kiln_tensor_t *inv = inverse(order);
    kiln_tensor_t *wf = kiln_reshape(w, nk1, 2), *kept = NULL;
    if (c->moe_capacity > 0) { /* each expert's rows past its capacity, in token order, weighted 0 */
        double cap = ceil(c->moe_capacity * (double)nk / (double)E);
        kiln_tensor_t *ar = kiln_arange(0, (double)nk, 1, KILN_DTYPE_I64);
        kiln_tensor_t *rank = kiln_sub(ar, kiln_index_select(offsets, 0, expert)); /* its place in its run */
        kept = kiln_index_select(kiln_cast(kiln_lt(rank, kiln_scalar(cap, KILN_DTYPE_I64)), KILN_DTYPE_F32), 0, inv);
        wf = kiln_mul(wf, kiln_reshape(kept, nk1, 2));
    }
    kiln_tensor_t *yu = kiln_mul(kiln_index_select(ys, 0, inv), wf);
    kiln_tensor_t *y = kiln_sum(kiln_reshape(yu, nkc, 3), &last, 1, false);
    if (e->sg) {
        kiln_tensor_t *const w[3] = {e->sg, e->su, e->sd}, *const wp[3] = {pk ? pk->sg : NULL, pk ? pk->su : NULL,
                                                                           pk ? pk->sd : NULL};
        y = kiln_add(y, swiglu(x, w, wp, kiln_tensor_dim(e->sg, 0), C));
    }
    if (!y) return NULL;
    if (balance && B > 0 && c->moe_balance_loss > 0) {
        kiln_tensor_t *l = balance_loss(c, s, idx, B);
        if (!l) return NULL;
        *balance = *balance ? kiln_add(*balance, l) : l;
    }
    if (train) { /* the rows each expert got, for the next update and the statistics */
        bool grad = kiln_set_grad_enabled(false);
        kiln_tensor_t *counts = kiln_sub(kiln_narrow(offsets, 0, 1, E), kiln_narrow(offsets, 0, 0, E));
        int64_t one = 1; /* the rows dropped: N k less those kept */
        kiln_tensor_t *dropped = kept ? kiln_sub(kiln_scalar((double)nk, KILN_DTYPE_F32), kiln_sum(kept, NULL, 0, true))
                                      : kiln_zeros(&one, 1, KILN_DTYPE_F32);
        kiln_tensor_t *parts[2] = {kiln_cast(counts, KILN_DTYPE_F32), dropped};
        kiln_status st = kiln_tensor_copy_(e->load, kiln_add(e->load, kiln_cat(parts, 2, 0)));
        kiln_set_grad_enabled(grad);
        if (st != KILN_OK) return NULL;
    }
    return y;
}

kiln_status kiln__moe_update(const kiln_gpt_config *c, kiln__moe *e)
{
    bool grad = kiln_set_grad_enabled(false);
    kiln_status s = KILN_OK;
    if (c->moe_bias_speed > 0) { /* sign(mean - load) as (mean > load) - (mean < load) */
        kiln_tensor_t *load = kiln_narrow(e->load, 0, 0, c->n_routed_experts), *mean = kiln_mean(load, NULL, 0, true);
        kiln_tensor_t *sign = kiln_sub(kiln_cast(kiln_gt(mean, load), KILN_DTYPE_F32),
                                       kiln_cast(kiln_lt(mean, load), KILN_DTYPE_F32));
        s = kiln_tensor_copy_(e->router_b, kiln_add(e->router_b, kiln_mul_scalar(sign, c->moe_bias_speed)));
    }
    if (s == KILN_OK) s = kiln_tensor_copy_(e->last_load, e->load);
    if (s == KILN_OK) s = kiln_tensor_copy_(e->load, kiln_zeros(kiln_tensor_shape(e->load), 1, KILN_DTYPE_F32));
    kiln_set_grad_enabled(grad);
    return s;
}
