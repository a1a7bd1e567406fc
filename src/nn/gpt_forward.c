/* The GPT model's blocks and forward (docs/model.md): one pass through the blocks shared
 * by training, the KV cache and the paged serving path (gpt_kv.c), which differ only in how
 * they attend and multiply. */
#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/opts.h"
#include "core/parse.h"
#include "core/util.h"
#include "kiln/dist.h"
#include "kiln/flex.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/optim.h"
#include "nn/gpt_impl.h"
#include "nn/moe.h"
#include "nn/names.h"

typedef kiln__gpt_layer layer;

/* ---- forward ---- */

kiln_tensor_t *kiln__gpt_norm(const kiln_gpt_t *m, kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *b)
{
    return m->cfg.norm == KILN_NORM_LAYERNORM ? kiln_layer_norm(x, w, b, m->cfg.norm_eps)
                                              : kiln_rms_norm(x, w, m->cfg.norm_eps);
}

/* (B,T,n*hs) -> (B,n,T,hs) */
static kiln_tensor_t *heads(kiln_tensor_t *x, int64_t B, int64_t T, int64_t n, int64_t hs)
{
    int64_t shape[4] = {B, T, n, hs};
    return kiln_transpose(kiln_reshape(x, shape, 4), 1, 2);
}

kiln_tensor_t *kiln__gpt_heads(const kiln_gpt_t *m, kiln_tensor_t *x, int64_t B, int64_t T, int64_t n, int64_t hs,
                               kiln_tensor_t *w)
{
    if (T == 0) { /* the paged pass's rows */
        int64_t rows[3] = {B, n, hs};
        x = kiln_reshape(x, rows, 3);
        return w ? kiln_rms_norm(x, w, m->cfg.norm_eps) : x;
    }
    if (!w) return heads(x, B, T, n, hs);
    int64_t shape[4] = {B, T, n, hs};
    return kiln_transpose(kiln_rms_norm(kiln_reshape(x, shape, 4), w, m->cfg.norm_eps), 1, 2);
}

/* x w^T + b through w's packed copy wp (n = w's rows): rows that do not depend on each
 * other (kiln_matmul_rows). */
kiln_tensor_t *kiln__gpt_linear_rows(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *wp, kiln_tensor_t *b)
{
    kiln_tensor_t *y = kiln_matmul_rows_packed(x, wp, kiln_tensor_dim(w, 0));
    return b ? kiln_add(y, b) : y;
}

/* Layer i's linear layer `which` (PK_*) with weight w and bias b, as the pass runs it. */
static kiln_tensor_t *linear(const pass *ps, int i, int which, kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *b)
{
    return ps->pk ? kiln__gpt_linear_rows(x, w, ps->pk[i][which], b) : kiln_linear(x, w, b);
}


/* Transformer block i on x (B,T,C) or (N,C): x + attention(norm1(x)), then
 * x + mlp(norm2(x)). */
kiln_tensor_t *kiln__gpt_block(const pass *ps, int i, kiln_tensor_t *x)
{
    const kiln_gpt_t *m = ps->m;
    const kiln_gpt_config *c = &m->cfg;
    const layer *L = &m->layers[i];
    int64_t H = c->n_head, Hk = c->n_kv_head, hs = c->n_embd / H;
    kiln_tensor_t *h1 = kiln__gpt_norm(m, x, L->n1w, L->n1b), *y;
    if (L->kv_a) {
        y = ps->latent(ps, i, h1);
    } else {
        kiln_tensor_t *qkv = linear(ps, i, PK_QKV, h1, L->qkv_w, L->qkv_b);
        kiln_tensor_t *part[3];
        int64_t sizes[3] = {H * hs, Hk * hs, Hk * hs};
        if (!qkv || kiln_split(qkv, sizes, 3, -1, part) != KILN_OK) return NULL;
        y = ps->attend(ps, i, part[0], part[1], part[2]);
    }
    y = kiln_dropout(linear(ps, i, PK_PROJ, y, L->proj_w, L->proj_b), ps->p, ps->train);
    x = kiln_add(x, y);
    kiln_tensor_t *h = kiln__gpt_norm(m, x, L->n2w, L->n2b), *mo;
    if (L->moe) { /* over the rows: (B, T, C) flattened, or the paged pass's (N, C) */
        bool flat = kiln_tensor_ndim(h) == 2;
        int64_t rows[2] = {-1, c->n_embd};
        mo = kiln__moe_forward(c, L->moe, flat ? h : kiln_reshape(h, rows, 2), flat ? 0 : ps->B, ps->train,
                               ps->moe_pk ? &ps->moe_pk[i] : NULL, ps->balance);
        if (mo && !flat) mo = kiln_reshape(mo, kiln_tensor_shape(h), 3);
    } else if (c->mlp == KILN_MLP_GELU)
        mo = linear(ps, i, PK_OUT, kiln_gelu(linear(ps, i, PK_FC, h, L->fc_w, L->fc_b), true), L->out_w, L->out_b);
    else
        mo = linear(ps, i, PK_OUT,
                    kiln_mul(kiln_silu(linear(ps, i, PK_FC, h, L->fc_w, L->fc_b)),
                             linear(ps, i, PK_UP, h, L->up_w, L->up_b)),
                    L->out_w, L->out_b);
    return kiln_add(x, kiln_dropout(mo, ps->p, ps->train));
}

/* Causal attention over B sequences of T new positions from pos0; with a cache, keys and
 * values are appended to it and attention sees all cached positions. */
/* Attention of q (B,H,T,D) over k, v (B,Hk,T,D) of T new positions from pos0, through
 * the cache (appended to it) if any: (B,H,T,D). */
static kiln_tensor_t *attend_heads(const pass *ps, int i, kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v)
{
    int64_t T = ps->T, pos0 = ps->pos0;
    kiln_kv_cache_t *cache = ps->cache;
    if (cache) {
        kiln_tensor_t *kd = kiln_narrow(cache->k[i], 2, pos0, T), *vd = kiln_narrow(cache->v[i], 2, pos0, T);
        if (kiln_tensor_copy_(kd, k) != KILN_OK || kiln_tensor_copy_(vd, v) != KILN_OK) return NULL;
        k = kiln_narrow(cache->k[i], 2, 0, pos0 + T);
        v = kiln_narrow(cache->v[i], 2, 0, pos0 + T);
    }
    return ps->flex ? kiln_flex_attention_masked(q, k, v, ps->flex, ps->mask, 0, NULL) : kiln_attention(q, k, v, true, 0.0);
}

static kiln_tensor_t *attend_full(const pass *ps, int i, kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v)
{
    const kiln_gpt_config *c = &ps->m->cfg;
    int64_t B = ps->B, T = ps->T, pos0 = ps->pos0, C = c->n_embd, H = c->n_head, Hk = c->n_kv_head, hs = C / H;
    const layer *L = &ps->m->layers[i];
    q = kiln__gpt_heads(ps->m, q, B, T, H, hs, L->q_hn); /* (qk_norm: each head normed before RoPE) */
    k = kiln__gpt_heads(ps->m, k, B, T, Hk, hs, L->k_hn);
    v = heads(v, B, T, Hk, hs);
    if (c->pos == KILN_POS_ROPE) {
        q = kiln_rope_scaled(q, pos0, c->rope_theta, &c->rope_scaling);
        k = kiln_rope_scaled(k, pos0, c->rope_theta, &c->rope_scaling);
    }
    int64_t bt[3] = {B, T, C};
    return kiln_reshape(kiln_transpose(attend_heads(ps, i, q, k, v), 1, 2), bt, 3);
}

/* Multi-head latent attention of layer i on h (B,T,C) (docs/model.md): queries through
 * their latent (or directly), keys and values through theirs, each head's query and key
 * a part of its own and a rotary part (the keys' one shared by the heads), values padded
 * with zeros to the query size for the attention and cut back after it: (B,T,H dv). */
static kiln_tensor_t *attend_mla(const pass *ps, int i, kiln_tensor_t *h)
{
    const kiln_gpt_config *c = &ps->m->cfg;
    const layer *L = &ps->m->layers[i];
    int64_t B = ps->B, T = ps->T, H = c->n_head, hs = c->n_embd / H, dr = c->mla_rope_dim;
    int64_t dn = c->mla_nope_dim ? c->mla_nope_dim : hs, dv = c->mla_v_dim ? c->mla_v_dim : hs, D = dn + dr;
    int64_t rkv = c->mla_kv_rank;
    double eps = c->norm_eps;
    kiln_tensor_t *q = L->q_a ? kiln_linear(kiln_rms_norm(kiln_linear(h, L->q_a, NULL), L->q_norm, eps), L->q_b, NULL)
                              : kiln_linear(h, L->q_b, NULL);
    q = heads(q, B, T, H, D);
    kiln_tensor_t *ckv = kiln_linear(h, L->kv_a, NULL); /* (B, T, rkv + dr) */
    kiln_tensor_t *kv = kiln_linear(kiln_rms_norm(kiln_narrow(ckv, 2, 0, rkv), L->kv_norm, eps), L->kv_b, NULL);
    kv = heads(kv, B, T, H, dn + dv);
    kiln_tensor_t *qp = kiln_rope_scaled(kiln_contiguous(kiln_narrow(q, 3, dn, dr)), ps->pos0, c->rope_theta,
                                         &c->rope_scaling);
    kiln_tensor_t *kp = kiln_rope_scaled(kiln_contiguous(heads(kiln_narrow(ckv, 2, rkv, dr), B, T, 1, dr)), ps->pos0,
                                         c->rope_theta, &c->rope_scaling);
    int64_t bhtr[4] = {B, H, T, dr}, pad[4] = {B, H, T, D - dv}, out[3] = {B, T, H * dv};
    kiln_tensor_t *qs[2] = {kiln_narrow(q, 3, 0, dn), qp}, *ks[2] = {kiln_narrow(kv, 3, 0, dn), kiln_expand(kp, bhtr, 4)};
    kiln_tensor_t *v = kiln_narrow(kv, 3, dn, dv);
    if (dv < D) v = kiln_cat((kiln_tensor_t *[2]){v, kiln_zeros(pad, 4, kiln_tensor_dtype(kv ? kv : h))}, 2, 3);
    kiln_tensor_t *y = attend_heads(ps, i, kiln_cat(qs, 2, 3), kiln_cat(ks, 2, 3), v);
    return kiln_reshape(kiln_transpose(kiln_narrow(y, 3, 0, dv), 1, 2), out, 3);
}

/* Logits of T new positions of B sequences from pos0, through the cache if any. */
kiln_tensor_t *kiln__gpt_run(kiln_gpt_t *m, kiln_tensor_t *idx, int64_t pos0, kiln_kv_cache_t *cache, bool train,
                          kiln_tensor_t **balance)
{
    const kiln_gpt_config *c = &m->cfg;
    int64_t T = kiln_tensor_dim(idx, 1);
    pass ps = {.attend = attend_full, .latent = attend_mla, .m = m, .p = train ? c->dropout : 0.0, .train = train,
               .B = kiln_tensor_dim(idx, 0), .T = T, .pos0 = pos0, .cache = cache, .balance = balance};
    /* a flex variant's modifiers, once for every layer; document ids are known only for
     * the tokens of this call, so with a cache the doc part is left out */
    kiln_flex_t *flex = NULL;
    if (kiln__gpt_has_variant(c) && kiln__gpt_flex(c, idx, !cache && !pos0, &flex) != KILN_OK) return NULL;
    ps.flex = flex;
    /* its block mask once for every layer: from this batch's document ids (an op, so a
     * compiled step computes it from each batch), or kept for these sizes */
    if (flex && kiln__opt(KILN__OPT_FLEX_FUSED) &&
        !(ps.mask = kiln_flex_block_mask(flex, ps.B, c->n_head, T, pos0 + T, KILN_FLEX_BLOCK, KILN_FLEX_BLOCK))) {
        kiln_flex_free(flex);
        return NULL;
    }
    kiln_tensor_t *x = kiln_embedding(m->tok_emb, idx);
    if (c->pos == KILN_POS_LEARNED) x = kiln_add(x, kiln_narrow(m->pos_emb, 0, pos0, T));
    for (int i = 0; x && i < c->n_layer; i++) x = kiln__gpt_block(&ps, i, x);
    kiln_flex_free(flex);
    if (!x) return NULL;
    x = kiln__gpt_norm(m, x, m->nfw, m->nfb);
    return kiln_linear(x, c->tied ? m->tok_emb : m->lm_head, NULL);
}

kiln_status kiln__gpt_check_idx(const kiln_gpt_t *m, kiln_tensor_t *idx, int64_t pos0, const char *what)
{
    char b[96];
    if (!idx) return kiln_last_status() ? kiln_last_status() : kiln_error(KILN_ERR_ARG, "%s: idx is NULL", what);
    kiln_dtype dt = kiln_tensor_dtype(idx);
    if (kiln_tensor_ndim(idx) != 2 || (dt != KILN_DTYPE_I32 && dt != KILN_DTYPE_I64))
        return kiln_error(KILN_ERR_SHAPE, "%s: idx %s must be (B, T) of i32 or i64", what, kiln_tensor_describe(idx, b, sizeof b));
    if (pos0 + kiln_tensor_dim(idx, 1) > m->cfg.block_size)
        return kiln_error(KILN_ERR_SHAPE, "%s: %lld positions exceed block_size %d", what,
                         (long long)(pos0 + kiln_tensor_dim(idx, 1)), m->cfg.block_size);
    return KILN_OK;
}

/* The model's autocast region around a forward (none in f32); false when it could not
 * be opened (the error is set). */
bool kiln__gpt_precision_begin(const kiln_gpt_t *m)
{
    return m->precision == KILN_DTYPE_F32 || kiln_autocast_begin(m->precision) == KILN_OK;
}

void kiln__gpt_precision_end(const kiln_gpt_t *m)
{
    if (m->precision != KILN_DTYPE_F32) kiln_autocast_end();
}

static kiln_tensor_t *forward(kiln_gpt_t *m, kiln_tensor_t *idx, kiln_tensor_t *targets, bool train, kiln_tensor_t **loss)
{
    kiln_tensor_t *balance = NULL; /* the MoE blocks' balance losses, summed */
    kiln_tensor_t *logits = kiln__gpt_run(m, idx, 0, NULL, train, targets && loss ? &balance : NULL);
    if (logits && targets && loss) {
        int64_t n = kiln_tensor_numel(idx), nv[2] = {n, m->cfg.vocab_size};
        if (kiln_tensor_numel(targets) != n) {
            char a[96], b[96];
            kiln_error(KILN_ERR_SHAPE, "gpt_forward: targets %s do not match idx %s",
                      kiln_tensor_describe(targets, a, sizeof a), kiln_tensor_describe(idx, b, sizeof b));
            return NULL;
        }
        *loss = kiln_cross_entropy(kiln_reshape(logits, nv, 2), kiln_reshape(targets, &n, 1), -1);
        if (*loss && balance) *loss = kiln_add(*loss, balance);
        if (!*loss) return NULL;
    }
    return logits;
}

kiln_tensor_t *kiln_gpt_forward(kiln_gpt_t *m, kiln_tensor_t *idx, kiln_tensor_t *targets, bool train,
                                kiln_tensor_t **loss)
{
    if (loss) *loss = NULL;
    if (!m) return kiln_error(KILN_ERR_ARG, "gpt_forward: model is NULL"), NULL;
    if (kiln__gpt_check_idx(m, idx, 0, "gpt_forward") != KILN_OK) return NULL;
    if (!kiln__gpt_precision_begin(m)) return NULL;
    kiln_tensor_t *logits = forward(m, idx, targets, train, loss);
    kiln__gpt_precision_end(m);
    return logits;
}

/* n zero tensors of shape into t, kept (their owner frees them); false when one could
 * not be made. */
