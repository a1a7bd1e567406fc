/* The GPT model of docs/model.md: its parameters (drawn, given, or read from a kiln model
 * file), their list and names, and how they are stored. The forward is gpt_forward.c, the
 * KV cache, pool and paged pass gpt_kv.c, the training step gpt_train.c. */
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

static kiln_tensor_t *add_param_nd(kiln_gpt_t *m, const char *name, const int64_t *shape, int nd, double std)
{
    kiln_tensor_t *t;
    if (m->fill) {
        if (!(t = m->fill(name, shape, nd, m->fill_ctx))) return NULL;
        if (kiln_tensor_dtype(t) != KILN_DTYPE_F32 || !kiln_tensor_is_contiguous(t) || kiln_tensor_ndim(t) != nd ||
            memcmp(kiln_tensor_shape(t), shape, sizeof(int64_t) * (size_t)nd)) {
            char a[96], want[64] = "(";
            for (int d = 0; d < nd; d++)
                snprintf(want + strlen(want), sizeof want - strlen(want), "%lld%s", (long long)shape[d],
                         d + 1 < nd ? ", " : ")");
            kiln_error(KILN_ERR_SHAPE, "gpt: parameter %s was given as %s; it is a contiguous f32 %s", name,
                       kiln_tensor_describe(t, a, sizeof a), want);
            return NULL;
        }
        /* on the device the model is made on, as a drawn parameter is (a mapped file's
         * tensor is the cpu's; on the cpu it is taken as it is) */
        if (!(t = kiln_tensor_to(t, kiln_device()))) return NULL;
    } else {
        t = std > 0 ? kiln_contiguous(kiln_mul_scalar(kiln_randn(shape, nd, KILN_DTYPE_F32), std))
                    : kiln_full(shape, nd, std < 0 ? 1.0 : 0.0, KILN_DTYPE_F32);
        if (!t) return NULL;
        t = kiln_clone(t); /* a fresh tensor of its own, not a view into a temporary */
        if (!t) return NULL;
    }
    if (m->n == m->cap) {
        int cap = m->cap ? m->cap * 2 : 32;
        void *tmp;
        if (!KILN__RESIZE(m->params, cap, tmp) || !KILN__RESIZE(m->names, cap, tmp)) {
            kiln_error(KILN_ERR_OOM, "gpt: out of memory for the parameter list");
            return NULL;
        }
        m->cap = cap;
    }
    if (!(m->names[m->n] = strdup(name))) {
        kiln_error(KILN_ERR_OOM, "gpt: out of memory for a parameter name");
        return NULL;
    }
    /* a drawn tensor leaves the build's scope for the model; a given one gets a
     * reference of the model's own (its giver, or the scope, keeps theirs) */
    m->params[m->n++] = m->fill ? kiln_tensor_retain(t) : kiln_keep(t);
    kiln_tensor_set_requires_grad(t, true);
    if (!kiln_tensor_requires_grad(t)) { /* (its autograd state could not be made) */
        kiln_error(KILN_ERR_OOM, "gpt: out of memory marking %s for gradients", name);
        return NULL;
    }
    return t;
}

static kiln_tensor_t *add_param(kiln_gpt_t *m, const char *name, int64_t d0, int64_t d1, double std)
{
    int64_t shape[2] = {d0, d1};
    return add_param_nd(m, name, shape, d1 > 0 ? 2 : 1, std);
}

/* Block i's MoE parameters (docs/model.md) and its load counters, into L->moe. */
static kiln_status build_moe(kiln_gpt_t *m, int i, layer *L, double std, double rstd)
{
    const kiln_gpt_config *c = &m->cfg;
    int64_t C = c->n_embd, E = c->n_routed_experts, Fe = kiln_gpt_moe_ffn(c), W = (int64_t)c->n_shared_experts * Fe;
    kiln__moe *e = L->moe = calloc(1, sizeof *e);
    if (!e) return kiln_error(KILN_ERR_OOM, "gpt: out of memory");
    char nm[96];
    int64_t in_out[3] = {E, C, Fe}, out_in[3] = {E, Fe, C};
#define NAME(part) (snprintf(nm, sizeof nm, "blocks.%d.mlp.%s", i, part), nm)
    if (!(e->router_w = add_param(m, NAME("router.weight"), E, C, std)) ||
        !(e->router_b = add_param(m, NAME("router.bias"), E, 0, 0)) ||
        !(e->gate = add_param_nd(m, NAME("experts.gate"), in_out, 3, std)) ||
        !(e->up = add_param_nd(m, NAME("experts.up"), in_out, 3, std)) ||
        !(e->down = add_param_nd(m, NAME("experts.down"), out_in, 3, rstd)))
        return kiln_last_status();
    if (W > 0 && (!(e->sg = add_param(m, NAME("shared.gate.weight"), W, C, std)) ||
                  !(e->su = add_param(m, NAME("shared.up.weight"), W, C, std)) ||
                  !(e->sd = add_param(m, NAME("shared.down.weight"), C, W, rstd))))
        return kiln_last_status();
#undef NAME
    kiln_tensor_set_requires_grad(e->router_b, false); /* moved by the balancing rule, not by gradients */
    int64_t counters = E + 1; /* the experts' rows, then the dropped ones */
    if (!(e->load = kiln_keep(kiln_zeros(&counters, 1, KILN_DTYPE_F32))) ||
        !(e->last_load = kiln_keep(kiln_zeros(&counters, 1, KILN_DTYPE_F32))))
        return kiln_last_status();
    return KILN_OK;
}

/* name.weight (d0, d1) drawn as add_param's std says and, with bias, name.bias (d0) of
 * zeros, into *w and *b. */
static bool add_pair(kiln_gpt_t *m, const char *name, int64_t d0, int64_t d1, double std, bool bias,
                     kiln_tensor_t **w, kiln_tensor_t **b)
{
    char nm[128];
    snprintf(nm, sizeof nm, "%s.weight", name);
    if (!(*w = add_param(m, nm, d0, d1, std))) return false;
    snprintf(nm, sizeof nm, "%s.bias", name);
    return !bias || (*b = add_param(m, nm, d0, 0, 0));
}

static kiln_status build(kiln_gpt_t *m)
{
    const kiln_gpt_config *c = &m->cfg;
    int64_t C = c->n_embd, hs = C / c->n_head, F = kiln_gpt_ffn_hidden(c);
    int64_t qkv = (int64_t)(c->n_head + 2 * c->n_kv_head) * hs;
    double std = 0.02, rstd = 0.02 / sqrt(2.0 * c->n_layer);
    bool ln = c->norm == KILN_NORM_LAYERNORM, gelu = c->mlp == KILN_MLP_GELU, bias = c->bias;
    char nm[64];
#define P(name, d0, d1, s, b, wp, bp) \
    if (!add_pair(m, (name), (d0), (d1), (s), (b), (wp), (bp))) return kiln_last_status()
    P("tok_emb", c->vocab_size, C, std, false, &m->tok_emb, NULL);
    if (c->pos == KILN_POS_LEARNED) P("pos_emb", c->block_size, C, std, false, &m->pos_emb, NULL);
    for (int i = 0; i < c->n_layer; i++) {
        layer *L = &m->layers[i];
#define BLK(part) (snprintf(nm, sizeof nm, "blocks.%d.%s", i, part), nm)
        P(BLK("norm1"), C, 0, -1, ln, &L->n1w, &L->n1b);
        if (c->mla_kv_rank > 0) { /* multi-head latent attention (docs/model.md) */
            int64_t H = c->n_head, dn = c->mla_nope_dim ? c->mla_nope_dim : hs, dv = c->mla_v_dim ? c->mla_v_dim : hs;
            int64_t D = dn + c->mla_rope_dim, rq = c->mla_q_rank, rkv = c->mla_kv_rank;
            if (rq > 0) {
                P(BLK("attn.q_a"), rq, C, std, false, &L->q_a, NULL);
                P(BLK("attn.q_norm"), rq, 0, -1, false, &L->q_norm, NULL);
                P(BLK("attn.q_b"), H * D, rq, std, false, &L->q_b, NULL);
            } else {
                P(BLK("attn.q"), H * D, C, std, false, &L->q_b, NULL);
            }
            P(BLK("attn.kv_a"), rkv + c->mla_rope_dim, C, std, false, &L->kv_a, NULL);
            P(BLK("attn.kv_norm"), rkv, 0, -1, false, &L->kv_norm, NULL);
            P(BLK("attn.kv_b"), H * (dn + dv), rkv, std, false, &L->kv_b, NULL);
            P(BLK("attn.proj"), C, H * dv, rstd, false, &L->proj_w, NULL);
        } else {
            P(BLK("attn.qkv"), qkv, C, std, bias, &L->qkv_w, &L->qkv_b);
            if (c->qk_norm) {
                P(BLK("attn.q_head_norm"), hs, 0, -1, false, &L->q_hn, NULL);
                P(BLK("attn.k_head_norm"), hs, 0, -1, false, &L->k_hn, NULL);
            }
            P(BLK("attn.proj"), C, C, rstd, bias, &L->proj_w, &L->proj_b);
        }
        P(BLK("norm2"), C, 0, -1, ln, &L->n2w, &L->n2b);
        if (c->n_routed_experts > 0 && i >= c->n_dense_layers) {
            kiln_status s = build_moe(m, i, L, std, rstd);
            if (s != KILN_OK) return s;
            continue;
        }
        P(BLK(gelu ? "mlp.fc" : "mlp.gate"), F, C, std, bias, &L->fc_w, &L->fc_b);
        if (!gelu) P(BLK("mlp.up"), F, C, std, bias, &L->up_w, &L->up_b);
        P(BLK(gelu ? "mlp.proj" : "mlp.down"), C, F, rstd, bias, &L->out_w, &L->out_b);
#undef BLK
    }
    P("norm_f", C, 0, -1, ln, &m->nfw, &m->nfb);
    if (!c->tied) P("lm_head", c->vocab_size, C, std, false, &m->lm_head, NULL);
#undef P
    return KILN_OK;
}

static kiln_status gpt_new(const kiln_gpt_config *cfg, uint64_t seed, kiln_gpt_param_fn fill, void *ctx,
                           kiln_gpt_t **out)
{
    kiln_status s = kiln_gpt_config_check(cfg);
    if (s != KILN_OK) return s;
    kiln_gpt_t *m = calloc(1, sizeof *m);
    if (!m || !(m->layers = calloc((size_t)cfg->n_layer, sizeof *m->layers))) {
        free(m);
        return kiln_error(KILN_ERR_OOM, "gpt: out of memory");
    }
    m->cfg = *cfg;
    m->fill = fill;
    m->fill_ctx = ctx;
    kiln_rng_state saved = kiln_rng_get_state();
    kiln_manual_seed(seed);
    bool prev = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    s = build(m);
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    kiln_rng_set_state(saved);
    m->fill = NULL;
    m->fill_ctx = NULL;
    if (s == KILN_OK) *out = m;
    else kiln_gpt_free(m);
    return s;
}

kiln_status kiln_gpt_new(const kiln_gpt_config *cfg, uint64_t seed, kiln_gpt_t **out)
{
    return gpt_new(cfg, seed, NULL, NULL, out);
}

kiln_status kiln_gpt_new_from(const kiln_gpt_config *cfg, kiln_gpt_param_fn fill, void *ctx, kiln_gpt_t **out)
{
    if (!fill || !out) return kiln_error(KILN_ERR_ARG, "gpt_new_from: fill and out must not be NULL");
    return gpt_new(cfg, 0, fill, ctx, out);
}

void kiln_gpt_free(kiln_gpt_t *m)
{
    if (!m) return;
    for (int i = 0; i < m->n; i++) {
        kiln_tensor_free(m->params[i]);
        free(m->names[i]);
    }
    for (int i = 0; m->layers && i < m->cfg.n_layer; i++)
        if (m->layers[i].moe) {
            kiln_tensor_free(m->layers[i].moe->load);
            kiln_tensor_free(m->layers[i].moe->last_load);
            free(m->layers[i].moe);
        }
    KILN__FREE(m->params, m->names, m->layers, m);
}

const kiln_gpt_config *kiln_gpt_get_config(const kiln_gpt_t *m) { return &m->cfg; }
int kiln_gpt_num_params(const kiln_gpt_t *m) { return m ? m->n : 0; }

kiln_tensor_t *kiln_gpt_param(const kiln_gpt_t *m, int i, const char **name)
{
    if (!m || i < 0 || i >= m->n) return NULL;
    if (name) *name = m->names[i];
    return m->params[i];
}

kiln_tensor_t *kiln_gpt_find_param(const kiln_gpt_t *m, const char *name)
{
    for (int i = 0; m && name && i < m->n; i++)
        if (!strcmp(m->names[i], name)) return m->params[i];
    return NULL;
}

int64_t kiln_gpt_param_elements(const kiln_gpt_t *m)
{
    int64_t n = 0;
    for (int i = 0; m && i < m->n; i++) n += kiln_tensor_numel(m->params[i]);
    return n;
}

/* The file's tensor `name` as an f32 parameter of this shape: over the mapped file where
 * it is f32, else widened; NULL with an error naming it (and path) when it is missing or
 * of another shape. */
static kiln_tensor_t *file_tensor(const kiln_safetensors_t *f, const char *path, const char *name,
                                  const int64_t *shape, int nd)
{
    kiln_tensor_t *t = kiln_safetensors_view(f, name);
    if (!t) return NULL;
    if (kiln_tensor_ndim(t) != nd || memcmp(kiln_tensor_shape(t), shape, sizeof(int64_t) * (size_t)nd)) {
        char a[96], b[96];
        size_t at = 0;
        for (int d = 0; d < nd && at < sizeof b; d++)
            at += (size_t)snprintf(b + at, sizeof b - at, "%s%lld", d ? ", " : "(", (long long)shape[d]);
        if (at < sizeof b) snprintf(b + at, sizeof b - at, ")");
        kiln_error(KILN_ERR_SHAPE, "%s: tensor '%s' is %s, the model expects %s", path, name,
                   kiln_tensor_describe(t, a, sizeof a), b);
        return NULL;
    }
    return kiln_tensor_dtype(t) == KILN_DTYPE_F32 ? t : kiln_cast(t, KILN_DTYPE_F32);
}

typedef struct {
    const kiln_safetensors_t *f;
    const char *path;
} file_source;

static kiln_tensor_t *file_param(const char *name, const int64_t *shape, int nd, void *ctx)
{
    const file_source *src = ctx;
    return file_tensor(src->f, src->path, name, shape, nd);
}

kiln_status kiln__gpt_new_from_file(const kiln_gpt_config *cfg, const kiln_safetensors_t *f, const char *path,
                                    kiln_gpt_t **out)
{
    file_source src = {f, path};
    return kiln_gpt_new_from(cfg, file_param, &src, out);
}

kiln_status kiln_gpt_load_weights(kiln_gpt_t *m, const char *path)
{
    kiln_safetensors_t *f;
    kiln_status s = kiln_safetensors_load(path, &f);
    if (s != KILN_OK) return s;
    bool prev = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    for (int i = 0; s == KILN_OK && i < m->n; i++) {
        kiln_tensor_t *p = m->params[i];
        int64_t shape[KILN_MAX_DIMS]; /* an expert shard's file tensor holds every rank's */
        memcpy(shape, kiln_tensor_shape(p), sizeof(int64_t) * (size_t)kiln_tensor_ndim(p));
        if (kiln_gpt_param_sharded(m, i)) shape[0] *= kiln_pg_world_size(m->ep);
        kiln_tensor_t *t = file_tensor(f, path, m->names[i], shape, kiln_tensor_ndim(p));
        if (t) t = kiln_gpt_shard_param(m, i, t);
        if (t) t = kiln_tensor_to(t, kiln_tensor_device(p)); /* the file's is the cpu's */
        s = t ? kiln_tensor_copy_(p, t) : kiln_last_status();
    }
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    kiln_safetensors_free(f);
    return s;
}

kiln_status kiln_gpt_set_precision(kiln_gpt_t *m, kiln_dtype dt)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "gpt_set_precision: model is NULL");
    if (!kiln_dtype_is_f32_or_half(dt))
        return kiln_error(KILN_ERR_DTYPE, "gpt_set_precision: %s: the precision is f32, bf16 or f16", kiln_dtype_name(dt));
    m->precision = dt;
    return KILN_OK;
}

kiln_dtype kiln_gpt_precision(const kiln_gpt_t *m) { return m ? m->precision : KILN_DTYPE_F32; }

/* t replaced by a copy in dt, in the layer or model field and in the parameter list. */
static kiln_status store_param(kiln_gpt_t *m, kiln_tensor_t **field, kiln_dtype dt)
{
    if (!*field || kiln_tensor_dtype(*field) == dt) return KILN_OK;
    kiln_tensor_t *t = kiln_keep(kiln_cast(*field, dt));
    if (!t) return kiln_last_status();
    for (int i = 0; i < m->n; i++)
        if (m->params[i] == *field) m->params[i] = t;
    kiln_tensor_free(*field);
    *field = t;
    return KILN_OK;
}

kiln_status kiln_gpt_store_linear(kiln_gpt_t *m, kiln_dtype dt)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "gpt_store_linear: model is NULL");
    if (!kiln_dtype_is_f32_or_half(dt))
        return kiln_error(KILN_ERR_DTYPE, "gpt_store_linear: %s: the linear weights are stored as f32, bf16 or f16",
                          kiln_dtype_name(dt));
    kiln_status s = KILN_OK;
    bool grad = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    for (int i = 0; s == KILN_OK && i < m->cfg.n_layer; i++) {
        layer *L = &m->layers[i];
        kiln_tensor_t **w[5] = {&L->qkv_w, &L->proj_w, &L->fc_w, &L->up_w, &L->out_w};
        for (int j = 0; s == KILN_OK && j < 5; j++) s = store_param(m, w[j], dt);
    }
    if (s == KILN_OK && !m->cfg.tied) s = store_param(m, &m->lm_head, dt);
    kiln_scope_end();
    kiln_set_grad_enabled(grad);
    if (s == KILN_OK) m->precision = dt;
    return s;
}
