/* The GPT model's key/value storage: the KV cache of incremental decoding and the paged
 * KV pool of the serving engine, with the paged pass through the blocks. */
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

static bool zeros_n(kiln_tensor_t **t, int n, const int64_t *shape, int nd, kiln_dtype dtype)
{
    bool ok = true;
    kiln_scope_begin();
    for (int i = 0; i < n; i++) ok &= (t[i] = kiln_keep(kiln_zeros(shape, nd, dtype))) != NULL;
    kiln_scope_end();
    return ok;
}

kiln_status kiln_kv_cache_new(const kiln_gpt_t *m, int batch, kiln_kv_cache_t **out)
{
    if (!m || batch < 1) return kiln_error(KILN_ERR_ARG, "kv_cache_new: model is NULL or batch %d < 1", batch);
    kiln_kv_cache_t *c = calloc(1, sizeof *c);
    int L = m->cfg.n_layer;
    if (!c || !(c->k = calloc(2 * (size_t)L, sizeof *c->k))) { /* the keys, then the values */
        free(c);
        return kiln_error(KILN_ERR_OOM, "kv_cache_new: out of memory");
    }
    c->v = c->k + L;
    c->batch = batch;
    c->n_layer = L;
    const kiln_gpt_config *cf = &m->cfg;
    int64_t hs = cf->n_embd / cf->n_head, shape[4] = {batch, cf->n_kv_head, cf->block_size, hs};
    if (cf->mla_kv_rank > 0) /* every head's keys and values (padded) of the query size */
        shape[1] = cf->n_head, shape[3] = (cf->mla_nope_dim ? cf->mla_nope_dim : hs) + cf->mla_rope_dim;
    if (!zeros_n(c->k, 2 * L, shape, 4, KILN_DTYPE_F32)) {
        kiln_kv_cache_free(c);
        return kiln_error(KILN_ERR_OOM, "kv_cache_new: out of memory for %d layers", L);
    }
    *out = c;
    return KILN_OK;
}

void kiln_kv_cache_free(kiln_kv_cache_t *c)
{
    if (!c) return;
    for (int i = 0; i < 2 * c->n_layer; i++) kiln_tensor_free(c->k[i]);
    KILN__FREE(c->k, c);
}

int kiln_kv_cache_len(const kiln_kv_cache_t *c) { return c ? c->len : 0; }
void kiln_kv_cache_reset(kiln_kv_cache_t *c)
{
    if (c) c->len = 0;
}

kiln_tensor_t *kiln_gpt_forward_cached(kiln_gpt_t *m, kiln_kv_cache_t *c, kiln_tensor_t *idx)
{
    if (!m || !c) return kiln_error(KILN_ERR_ARG, "gpt_forward_cached: model or cache is NULL"), NULL;
    if (kiln__gpt_check_idx(m, idx, c->len, "gpt_forward_cached") != KILN_OK) return NULL;
    if (kiln_tensor_dim(idx, 0) != c->batch)
        return kiln_error(KILN_ERR_SHAPE, "gpt_forward_cached: batch %lld, the cache holds %d",
                         (long long)kiln_tensor_dim(idx, 0), c->batch), NULL;
    bool prev = kiln_set_grad_enabled(false);
    bool open = kiln__gpt_precision_begin(m);
    kiln_tensor_t *logits = open ? kiln__gpt_run(m, idx, c->len, c, false, NULL) : NULL;
    if (open) kiln__gpt_precision_end(m);
    kiln_set_grad_enabled(prev);
    if (logits) c->len += (int)kiln_tensor_dim(idx, 1);
    return logits;
}

/* ---- paged decoding (the serving engine) ---- */

struct kiln_kv_pool {
    int num_blocks, block_len, n_layer;
    kiln_dtype dtype;
    kiln_tensor_t **k, **v; /* per layer (num_blocks * block_len, Hkv, hs) */
    /* The model's linear weights packed for kiln_matmul_rows_packed, per layer (NULL
     * where the model has no such weight), and the head's. */
    kiln_tensor_t *(*pk)[PK_N];
    kiln_tensor_t *pk_head;
    kiln__moe_packed *moe_pk; /* per layer: an MoE block's weights packed (E 0 for the others) */
    /* per layer with latent attention, mla_stride = 3 + 2 H of them: q_a (or NULL), q_b (or
     * q), kv_a, then each head's key part of kv_b transposed (r_kv, dn) and value part
     * (dv, r_kv), packed */
    kiln_tensor_t **mla_pk;
    int64_t mla_stride;
};

static kiln_tensor_t *const *pool_mla(const kiln_kv_pool_t *p, int i) { return p->mla_pk + i * p->mla_stride; }

/* w packed for kiln_matmul_rows_packed: in q8_0 blocks where quant says so and its
 * input width allows, else as weights. */
static kiln_tensor_t *pack_w(kiln_tensor_t *w, kiln_dtype weights, kiln_weight_quant quant)
{
    if (quant == KILN_WEIGHT_QUANT_Q8_0 && kiln_tensor_dim(w, 1) % KILN_ROWS_Q8_BLOCK == 0)
        return kiln_matmul_rows_pack_q8_0(w);
    return kiln_matmul_rows_pack(kiln_cast(w, weights));
}

/* Layer ly's latent attention weights packed into pk (mla_stride slots) as weights. */
static bool pack_mla(const kiln_gpt_config *c, const layer *ly, kiln_dtype weights, kiln_weight_quant quant,
                     kiln_tensor_t **pk)
{
    int64_t H = c->n_head, hs = c->n_embd / H, dn = c->mla_nope_dim ? c->mla_nope_dim : hs;
    int64_t dv = c->mla_v_dim ? c->mla_v_dim : hs, rkv = c->mla_kv_rank;
    kiln_tensor_t *w[3] = {ly->q_a, ly->q_b, ly->kv_a};
    for (int j = 0; j < 3; j++)
        if (w[j] && !(pk[j] = kiln_keep(pack_w(w[j], weights, quant)))) return false;
    kiln_tensor_t *kvb = kiln_reshape(ly->kv_b, (int64_t[]){H, dn + dv, rkv}, 3);
    for (int64_t x = 0; x < H; x++) {
        kiln_tensor_t *head = kiln_squeeze(kiln_narrow(kvb, 0, x, 1), 0);
        kiln_tensor_t *wk = kiln_contiguous(kiln_transpose(kiln_narrow(head, 0, 0, dn), 0, 1));
        kiln_tensor_t *wv = kiln_contiguous(kiln_narrow(head, 0, dn, dv));
        if (!(pk[3 + x] = kiln_keep(pack_w(wk, weights, quant))) ||
            !(pk[3 + H + x] = kiln_keep(pack_w(wv, weights, quant))))
            return false;
    }
    return true;
}

int64_t kiln_kv_pool_block_bytes(const kiln_gpt_t *m, int block_len, kiln_dtype dtype)
{
    if (!m) return 0;
    const kiln_gpt_config *c = &m->cfg;
    if (c->mla_kv_rank > 0) /* the latent and the rotary key part, once */
        return (int64_t)c->n_layer * block_len * (c->mla_kv_rank + c->mla_rope_dim) * (int64_t)kiln_dtype_size(dtype);
    return (int64_t)2 * c->n_layer * block_len * c->n_kv_head * (c->n_embd / c->n_head) *
           (int64_t)kiln_dtype_size(dtype);
}

kiln_status kiln_kv_pool_new(const kiln_gpt_t *m, int num_blocks, int block_len, kiln_dtype dtype,
                             kiln_kv_pool_t **out)
{
    return kiln_kv_pool_new_typed(m, num_blocks, block_len, dtype, KILN_DTYPE_F32, out);
}

kiln_status kiln_kv_pool_new_typed(const kiln_gpt_t *m, int num_blocks, int block_len, kiln_dtype dtype,
                                   kiln_dtype weights, kiln_kv_pool_t **out)
{
    return kiln_kv_pool_new_quant(m, num_blocks, block_len, dtype, weights, KILN_WEIGHT_QUANT_NONE, out);
}

kiln_status kiln_kv_pool_new_quant(const kiln_gpt_t *m, int num_blocks, int block_len, kiln_dtype dtype,
                                   kiln_dtype weights, kiln_weight_quant quant, kiln_kv_pool_t **out)
{
    if (!kiln_dtype_is_f32_or_half(weights))
        return kiln_error(KILN_ERR_DTYPE, "kv_pool_new: weights packed as %s; they are f32, bf16 or f16",
                          kiln_dtype_name(weights));
    if (quant != KILN_WEIGHT_QUANT_NONE && (quant != KILN_WEIGHT_QUANT_Q8_0 || weights != KILN_DTYPE_F32))
        return kiln_error(KILN_ERR_ARG, "kv_pool_new: weight quantization %d with weights %s; q8_0 (%d) is made "
                          "from f32", (int)quant, kiln_dtype_name(weights), (int)KILN_WEIGHT_QUANT_Q8_0);
    if (!m || !out) return kiln_error(KILN_ERR_ARG, "kv_pool_new: model or out is NULL");
    if (m->ep)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kv_pool_new: the model's experts are sharded over ranks "
                          "(kiln_gpt_shard_experts); serve a checkpoint with all of them (kiln_gpt_gather_param)");
    if (!kiln_dtype_is_f32_or_half(dtype))
        return kiln_error(KILN_ERR_DTYPE, "kv_pool_new: a KV cache of %s; it must be f32, f16 or bf16",
                          kiln_dtype_name(dtype));
    if (num_blocks < 1 || block_len < 1 || (int64_t)num_blocks * block_len > INT32_MAX)
        return kiln_error(KILN_ERR_ARG, "kv_pool_new: %d blocks of %d positions: both must be >= 1 and their product "
                          "fit in 31 bits", num_blocks, block_len);
    kiln_kv_pool_t *p = calloc(1, sizeof *p);
    int L = m->cfg.n_layer;
    if (p) {
        p->k = calloc(2 * (size_t)L, sizeof *p->k); /* the keys, then the values */
        p->pk = calloc((size_t)L, sizeof *p->pk);
        p->moe_pk = calloc((size_t)L, sizeof *p->moe_pk);
        p->mla_stride = m->cfg.mla_kv_rank > 0 ? 3 + 2 * (int64_t)m->cfg.n_head : 0;
        if (p->mla_stride) p->mla_pk = calloc((size_t)(L * p->mla_stride), sizeof *p->mla_pk);
    }
    if (!p || !p->k || !p->pk || !p->moe_pk || (p->mla_stride && !p->mla_pk)) {
        if (p) KILN__FREE(p->k, p->pk, p->moe_pk, p->mla_pk, p);
        return kiln_error(KILN_ERR_OOM, "kv_pool_new: out of memory");
    }
    p->v = p->k + L;
    p->num_blocks = num_blocks;
    p->block_len = block_len;
    p->n_layer = L;
    p->dtype = dtype;
    int64_t shape[3] = {(int64_t)num_blocks * block_len, m->cfg.n_kv_head, m->cfg.n_embd / m->cfg.n_head};
    bool mla = m->cfg.mla_kv_rank > 0; /* one latent "head" a position, keys and values the same pages */
    if (mla) shape[1] = 1, shape[2] = m->cfg.mla_kv_rank + m->cfg.mla_rope_dim;
    if (!zeros_n(p->k, mla ? L : 2 * L, shape, 3, dtype)) {
        kiln_kv_pool_free(p);
        return kiln_error(KILN_ERR_OOM, "kv_pool_new: out of memory for %d blocks of %lld bytes", num_blocks,
                          (long long)kiln_kv_pool_block_bytes(m, block_len, dtype));
    }
    for (int i = 0; mla && i < L; i++) p->v[i] = kiln_tensor_retain(p->k[i]);
    kiln_scope_begin();
    bool packed = true, grad = kiln_set_grad_enabled(false);
    for (int i = 0; i < L; i++) {
        const layer *ly = &m->layers[i];
        kiln_tensor_t *w[PK_N] = {ly->qkv_w, ly->proj_w, ly->fc_w, ly->up_w, ly->out_w};
        for (int j = 0; j < PK_N; j++)
            if (w[j] && !(p->pk[i][j] = kiln_keep(pack_w(w[j], weights, quant)))) packed = false;
        if (ly->moe && kiln__moe_pack(&m->cfg, ly->moe, weights, &p->moe_pk[i]) != KILN_OK) packed = false;
        if (ly->kv_a && !pack_mla(&m->cfg, ly, weights, quant, p->mla_pk + i * p->mla_stride)) packed = false;
    }
    kiln_tensor_t *head = m->cfg.tied ? m->tok_emb : m->lm_head;
    if (!(p->pk_head = kiln_keep(pack_w(head, weights, quant)))) packed = false;
    kiln_set_grad_enabled(grad);
    kiln_scope_end();
    if (!packed) {
        kiln_kv_pool_free(p);
        return kiln_error(KILN_ERR_OOM, "kv_pool_new: out of memory for the packed weights");
    }
    *out = p;
    return KILN_OK;
}

void kiln_kv_pool_free(kiln_kv_pool_t *p)
{
    if (!p) return;
    for (int i = 0; i < 2 * p->n_layer; i++) kiln_tensor_free(p->k[i]);
    for (int i = 0; i < p->n_layer; i++) {
        for (int j = 0; j < PK_N; j++) kiln_tensor_free(p->pk[i][j]);
        if (p->moe_pk) kiln__moe_packed_free(&p->moe_pk[i]);
    }
    for (int64_t j = 0; j < p->n_layer * p->mla_stride; j++) kiln_tensor_free(p->mla_pk[j]);
    kiln_tensor_free(p->pk_head);
    KILN__FREE(p->k, p->pk, p->moe_pk, p->mla_pk, p);
}

int kiln_kv_pool_num_blocks(const kiln_kv_pool_t *p) { return p ? p->num_blocks : 0; }
int kiln_kv_pool_block_len(const kiln_kv_pool_t *p) { return p ? p->block_len : 0; }

kiln_status kiln_kv_pool_copy_block(kiln_kv_pool_t *p, int dst, int src)
{
    if (!p || dst < 0 || src < 0 || dst >= p->num_blocks || src >= p->num_blocks)
        return kiln_error(KILN_ERR_ARG, "kv_pool_copy_block: blocks %d <- %d outside [0, %d)", dst, src,
                          p ? p->num_blocks : 0);
    if (dst == src) return KILN_OK;
    kiln_status s = KILN_OK;
    kiln_scope_begin();
    for (int i = 0; i < 2 * p->n_layer && s == KILN_OK; i++) {
        kiln_tensor_t *t = p->k[i]; /* every layer's keys, then every layer's values (v = k + L) */
        s = kiln_tensor_copy_(kiln_narrow(t, 0, (int64_t)dst * p->block_len, p->block_len),
                              kiln_narrow(t, 0, (int64_t)src * p->block_len, p->block_len));
    }
    kiln_scope_end();
    return s;
}

/* Every index of a paged batch, checked before the model touches it. */
static kiln_status check_paged(const kiln_gpt_t *m, const kiln_kv_pool_t *p, const kiln_paged_batch *b)
{
#define NEED(cond, ...) \
    if (!(cond)) return kiln_error(KILN_ERR_ARG, "gpt_forward_paged: " __VA_ARGS__)
    NEED(b->n_tokens >= 1 && b->tokens && b->seq && b->pos, "needs n_tokens >= 1 (got %d) with tokens, seq, pos",
         b->n_tokens);
    NEED(b->n_seqs >= 1 && b->max_blocks >= 1 && b->block_table, "needs n_seqs, max_blocks >= 1 and a block_table");
    NEED(b->n_logits >= 0 && (b->n_logits == 0 || b->logit_rows), "n_logits = %d needs logit_rows", b->n_logits);
    for (int i = 0; i < b->n_tokens; i++) {
        NEED(b->tokens[i] >= 0 && b->tokens[i] < m->cfg.vocab_size, "token %d at row %d is outside the vocabulary of %d",
             b->tokens[i], i, m->cfg.vocab_size);
        NEED(b->seq[i] >= 0 && b->seq[i] < b->n_seqs, "row %d names sequence %d of %d", i, b->seq[i], b->n_seqs);
        NEED(b->pos[i] >= 0 && b->pos[i] < m->cfg.block_size && b->pos[i] < b->max_blocks * p->block_len,
             "row %d position %d is outside the context (%d) or the block table (%d blocks of %d)", i, b->pos[i],
             m->cfg.block_size, b->max_blocks, p->block_len);
        int blk = b->block_table[b->seq[i] * b->max_blocks + b->pos[i] / p->block_len];
        NEED(blk >= 0 && blk < p->num_blocks, "row %d maps to block %d of %d", i, blk, p->num_blocks);
    }
    for (int i = 0; i < b->n_logits; i++)
        NEED(b->logit_rows[i] >= 0 && b->logit_rows[i] < b->n_tokens, "logit row %d is outside [0, %d)",
             b->logit_rows[i], b->n_tokens);
#undef NEED
    return KILN_OK;
}

/* Paged attention of N rows: each row's key and value written into its slot of the pool,
 * then the row attends to positions 0..pos of its sequence through the block table. */
static kiln_tensor_t *attend_paged(const pass *ps, int i, kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v)
{
    const kiln_gpt_config *c = &ps->m->cfg;
    kiln_kv_pool_t *p = ps->pool;
    int64_t N = kiln_tensor_dim(q, 0), C = c->n_embd, H = c->n_head, Hk = c->n_kv_head, hs = C / H;
    int64_t ks[3] = {N, Hk, hs}, nc[2] = {N, C};
    const layer *L = &ps->m->layers[i];
    q = kiln__gpt_heads(ps->m, q, N, 0, H, hs, L->q_hn); /* (qk_norm: each head normed before RoPE) */
    k = kiln__gpt_heads(ps->m, k, N, 0, Hk, hs, L->k_hn);
    v = kiln_reshape(v, ks, 3);
    if (c->pos == KILN_POS_ROPE) {
        q = kiln_rope_at_scaled(q, ps->pos, c->rope_theta, &c->rope_scaling);
        k = kiln_rope_at_scaled(k, ps->pos, c->rope_theta, &c->rope_scaling);
    }
    if (p->dtype != KILN_DTYPE_F32) {
        k = kiln_cast(k, p->dtype);
        v = kiln_cast(v, p->dtype);
    }
    if (kiln_index_copy_(p->k[i], ps->slot, k) != KILN_OK || kiln_index_copy_(p->v[i], ps->slot, v) != KILN_OK)
        return NULL;
    kiln_tensor_t *y = kiln_paged_attention_variant(q, p->k[i], p->v[i], ps->block_table, ps->seq_pos, p->block_len,
                                                    0.0, &ps->variant);
    return kiln_reshape(y, nc, 2);
}

/* Multi-head latent attention of N rows through the paged latent cache (docs/model.md):
 * each row's normalised latent and rotary key part, r_kv + dr numbers a layer, written
 * into its slot (one "head" of keys, the values the same pages); each head's query
 * absorbed into the latent (q_nope kv_b's key part, then the rotary part), paged
 * attention of the heads over the one latent head, each head's weighted latent times
 * kv_b's value part. Every product row by row (kiln_matmul_rows), so a row does not
 * depend on the batch: (N, H dv). */
static kiln_tensor_t *attend_paged_mla(const pass *ps, int i, kiln_tensor_t *h)
{
    const kiln_gpt_config *c = &ps->m->cfg;
    const layer *L = &ps->m->layers[i];
    kiln_kv_pool_t *p = ps->pool;
    int64_t N = kiln_tensor_dim(h, 0), H = c->n_head, hs = c->n_embd / H, dr = c->mla_rope_dim;
    int64_t dn = c->mla_nope_dim ? c->mla_nope_dim : hs, dv = c->mla_v_dim ? c->mla_v_dim : hs, D = dn + dr;
    int64_t rkv = c->mla_kv_rank;
    double eps = c->norm_eps;
    kiln_tensor_t *const *pk = pool_mla(p, i); /* q_a, q_b, kv_a, then the heads' W_k^T and W_v */
    if (H > 256) return kiln_error(KILN_ERR_UNSUPPORTED, "gpt: paged latent attention of %lld heads (256 at most)",
                                   (long long)H), NULL;
    kiln_tensor_t *q = L->q_a ? kiln_matmul_rows_packed(kiln_rms_norm(kiln_matmul_rows_packed(h, pk[0], c->mla_q_rank),
                                                                      L->q_norm, eps),
                                                        pk[1], H * D)
                              : kiln_matmul_rows_packed(h, pk[1], H * D);
    q = kiln_reshape(q, (int64_t[]){N, H, D}, 3);
    kiln_tensor_t *qp = kiln_rope_at_scaled(kiln_contiguous(kiln_narrow(q, 2, dn, dr)), ps->pos, c->rope_theta,
                                            &c->rope_scaling);
    kiln_tensor_t *ckv = kiln_matmul_rows_packed(h, pk[2], rkv + dr); /* (N, rkv + dr) */
    kiln_tensor_t *lat = kiln_rms_norm(kiln_contiguous(kiln_narrow(ckv, 1, 0, rkv)), L->kv_norm, eps);
    kiln_tensor_t *kp = kiln_rope_at_scaled(kiln_reshape(kiln_contiguous(kiln_narrow(ckv, 1, rkv, dr)), (int64_t[]){N, 1, dr}, 3),
                                            ps->pos, c->rope_theta, &c->rope_scaling);
    kiln_tensor_t *entry = kiln_cat((kiln_tensor_t *[2]){kiln_reshape(lat, (int64_t[]){N, 1, rkv}, 3), kp}, 2, 2);
    if (entry && p->dtype != KILN_DTYPE_F32) entry = kiln_cast(entry, p->dtype);
    if (!entry || kiln_index_copy_(p->k[i], ps->slot, entry) != KILN_OK) return NULL; /* v is the same pages */
    kiln_tensor_t *qa[256], *ys[256];
    for (int64_t x = 0; x < H; x++) { /* q_nope of head x absorbed: q_nope W_k[x], W_k (dn, rkv) */
        kiln_tensor_t *qn = kiln_contiguous(kiln_narrow(kiln_squeeze(kiln_narrow(q, 1, x, 1), 1), 1, 0, dn));
        qa[x] = kiln_unsqueeze(kiln_matmul_rows_packed(qn, pk[3 + x], rkv), 1);
    }
    kiln_tensor_t *qfull = kiln_cat((kiln_tensor_t *[2]){kiln_cat(qa, (int)H, 1), qp}, 2, 2); /* (N, H, rkv + dr) */
    kiln_tensor_t *o = kiln_paged_attention_variant(qfull, p->k[i], p->v[i], ps->block_table, ps->seq_pos, p->block_len,
                                                    1.0 / sqrt((double)D), &ps->variant);
    for (int64_t x = 0; x < H; x++) /* head x's weighted latent times W_v[x] (dv, rkv) */
        ys[x] = kiln_matmul_rows_packed(kiln_contiguous(kiln_narrow(kiln_squeeze(kiln_narrow(o, 1, x, 1), 1), 1, 0, rkv)),
                                        pk[3 + H + x], dv);
    return kiln_cat(ys, (int)H, 1);
}

static kiln_tensor_t *run_paged(kiln_gpt_t *m, kiln_kv_pool_t *p, const kiln_paged_batch *b, int32_t *slots,
                                int32_t *seq_pos)
{
    const kiln_gpt_config *c = &m->cfg;
    int64_t N = b->n_tokens, bl = p->block_len;
    kiln_paged_variant variant;
    if (kiln__gpt_paged_variant(c, &variant) != KILN_OK) return NULL;

    for (int64_t i = 0; i < N; i++) {
        slots[i] = b->block_table[b->seq[i] * b->max_blocks + b->pos[i] / bl] * (int32_t)bl + b->pos[i] % (int32_t)bl;
        seq_pos[2 * i] = b->seq[i];
        seq_pos[2 * i + 1] = b->pos[i];
    }
    int64_t n2[2] = {N, 2}, bts[2] = {b->n_seqs, b->max_blocks}, nl = b->n_logits;
    kiln_tensor_t *idx = kiln_from_data(b->tokens, &N, 1, KILN_DTYPE_I32);
    pass ps = {.attend = attend_paged, .latent = attend_paged_mla, .m = m, .pk = p->pk, .pool = p,
               .moe_pk = p->moe_pk, .variant = variant};
    ps.pos = kiln_from_data(b->pos, &N, 1, KILN_DTYPE_I32);
    ps.slot = kiln_from_data(slots, &N, 1, KILN_DTYPE_I32);
    ps.seq_pos = kiln_from_data(seq_pos, n2, 2, KILN_DTYPE_I32);
    ps.block_table = kiln_from_data(b->block_table, bts, 2, KILN_DTYPE_I32);
    kiln_tensor_t *rows = nl ? kiln_from_data(b->logit_rows, &nl, 1, KILN_DTYPE_I32) : NULL;
    kiln_tensor_t *x = kiln_embedding(m->tok_emb, idx);
    if (c->pos == KILN_POS_LEARNED) x = kiln_add(x, kiln_index_select(m->pos_emb, 0, ps.pos));
    for (int i = 0; i < c->n_layer; i++)
        if (!(x = kiln__gpt_block(&ps, i, x))) return NULL;
    /* Only the rows whose logits are wanted go through the last norm and the head (a
     * step that only prefills wants none). */
    if (!nl) {
        int64_t none[2] = {0, c->vocab_size};
        return x ? kiln_empty(none, 2, KILN_DTYPE_F32) : NULL;
    }
    x = kiln__gpt_norm(m, kiln_index_select(x, 0, rows), m->nfw, m->nfb);
    return kiln__gpt_linear_rows(x, c->tied ? m->tok_emb : m->lm_head, p->pk_head, NULL);
}

kiln_tensor_t *kiln_gpt_forward_paged(kiln_gpt_t *m, kiln_kv_pool_t *p, const kiln_paged_batch *b)
{
    if (!m || !p || !b) return kiln_error(KILN_ERR_ARG, "gpt_forward_paged: model, pool or batch is NULL"), NULL;
    if (p->n_layer != m->cfg.n_layer)
        return kiln_error(KILN_ERR_ARG, "gpt_forward_paged: the pool has %d layers, the model %d", p->n_layer,
                          m->cfg.n_layer), NULL;
    if (check_paged(m, p, b) != KILN_OK) return NULL;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)b->n_tokens * 3);
    if (!slots) return kiln_error(KILN_ERR_OOM, "gpt_forward_paged: out of memory"), NULL;
    bool prev = kiln_set_grad_enabled(false);
    kiln_tensor_t *logits = run_paged(m, p, b, slots, slots + b->n_tokens);
    kiln_set_grad_enabled(prev);
    free(slots);
    return logits;
}
