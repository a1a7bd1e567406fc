/* The GPT model of docs/model.md: GPT-2 style and LLaMA style from one config. */
#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/parse.h"
#include "core/util.h"
#include "kiln/dist.h"
#include "kiln/flex.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/optim.h"
#include "nn/gpt_impl.h"
#include "core/opts.h"
#include "nn/moe.h"
#include "nn/names.h"

typedef kiln__gpt_layer layer;

kiln_gpt_config kiln_gpt_config_gpt2(void)
{
    return (kiln_gpt_config){
        .n_layer = 4, .n_head = 4, .n_kv_head = 4, .n_embd = 256, .block_size = 128, .vocab_size = 256,
        .ffn_hidden = 0, .norm = KILN_NORM_LAYERNORM, .pos = KILN_POS_LEARNED, .mlp = KILN_MLP_GELU,
        .bias = true, .tied = true, .norm_eps = 1e-5, .rope_theta = 10000.0, .dropout = 0.0,
        .moe_top_k = 2, .moe_router = KILN_ROUTER_SOFTMAX, .moe_norm_topk = true, .moe_scale = 1.0,
        .moe_n_group = 1, .moe_topk_group = 1,
        .moe_bias_speed = 0.001,
    };
}

kiln_gpt_config kiln_gpt_config_llama(void)
{
    kiln_gpt_config c = kiln_gpt_config_gpt2();
    c.n_kv_head = 2;
    c.norm = KILN_NORM_RMSNORM;
    c.pos = KILN_POS_ROPE;
    c.mlp = KILN_MLP_SWIGLU;
    c.bias = false;
    c.tied = false;
    return c;
}

int kiln_gpt_ffn_hidden(const kiln_gpt_config *c)
{
    if (c->ffn_hidden > 0) return c->ffn_hidden;
    if (c->mlp == KILN_MLP_GELU) return 4 * c->n_embd;
    int f = (8 * c->n_embd + 2) / 3;
    return (f + 63) / 64 * 64;
}

int kiln_gpt_moe_ffn(const kiln_gpt_config *c)
{
    return c->moe_ffn > 0 ? c->moe_ffn : (kiln_gpt_ffn_hidden(c) / 4 + 7) / 8 * 8;
}

/* The attention variant of config c as flex modifiers (kiln/flex.h): its presets, a
 * doc:EOT part made the preset doc over the document ids of idx (B, T) (a document ends
 * at each EOT token; idx NULL: a placeholder, to check the spec; keep_doc false: the
 * part left out, checked only), causal added unless a window or prefix part says how the
 * model is causal. */
static kiln_status model_flex(const kiln_gpt_config *c, kiln_tensor_t *idx, bool keep_doc, kiln_flex_t **out)
{
    char spec[160] = "";
    bool causal = false, doc = false;
    long long eot = -1;
    for (const char *p = c->attention; *p;) {
        size_t n = strcspn(p, "+");
        char part[64];
        if (n >= sizeof part)
            return kiln_error(KILN_ERR_ARG, "gpt config: attention '%s': a part of %zu characters, at most 63",
                              c->attention, n);
        snprintf(part, sizeof part, "%.*s", (int)n, p);
        if (!strncmp(part, "doc", 3)) {
            int64_t v = -1;
            if (part[3] != ':' || kiln__parse_i64(part + 4, 0, (int64_t)c->vocab_size - 1, "EOT", &v) != KILN_OK)
                return kiln_error(KILN_ERR_ARG, "gpt config: attention '%s': doc takes the end-of-text token, doc:EOT "
                                  "with 0 <= EOT < vocab_size %d", c->attention, c->vocab_size);
            eot = v;
            doc = true;
        } else {
            causal |= !strcmp(part, "causal") || !strncmp(part, "window:", 7) || !strncmp(part, "prefix:", 7);
            snprintf(spec + strlen(spec), sizeof spec - strlen(spec), "%s%s", *spec ? "+" : "", part);
        }
        p += n + (p[n] == '+');
    }
    if (!causal) snprintf(spec + strlen(spec), sizeof spec - strlen(spec), "%scausal", *spec ? "+" : "");
    doc &= keep_doc;
    if (doc) strncat(spec, "+doc", sizeof spec - strlen(spec) - 1);
    kiln_flex_inputs in = {.heads = c->n_head};
    kiln_tensor_t *ids = NULL;
    if (doc && idx) {
        /* ids[b, t]: the EOT tokens before t in row b, with kiln's ops (so that a captured
         * step computes them from each batch): the end marks shifted right by one, times
         * the upper triangle of ones (a running count; exact in f32 below 2^24) */
        int64_t B = kiln_tensor_dim(idx, 0), T = kiln_tensor_dim(idx, 1), col[2] = {B, 1}, tt[2] = {T, T};
        kiln_tensor_t *ends = kiln_cast(kiln_eq(kiln_cast(idx, KILN_DTYPE_I64), kiln_scalar((double)eot, KILN_DTYPE_I64)),
                                        KILN_DTYPE_F32);
        kiln_tensor_t *parts[2] = {kiln_zeros(col, 2, KILN_DTYPE_F32), T > 1 && ends ? kiln_narrow(ends, 1, 0, T - 1) : NULL};
        kiln_tensor_t *shifted = T > 1 ? kiln_cat(parts, 2, 1) : parts[0];
        ids = kiln_cast(kiln_matmul(shifted, kiln_triu(kiln_ones(tt, 2, KILN_DTYPE_F32), 0)), KILN_DTYPE_I64);
        if (!ids) return kiln_last_status();
        in.doc_ids = ids;
    } else if (doc) { /* a placeholder: the spec is being checked */
        int64_t one[2] = {1, 1};
        if (!(ids = kiln_zeros(one, 2, KILN_DTYPE_I64))) return kiln_last_status();
        in.doc_ids = ids;
    }
    kiln_status s = kiln_flex_preset(spec, &in, out);
    if (s != KILN_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", kiln_last_error());
        return kiln_error(s, "gpt config: attention '%s': %s", c->attention, why);
    }
    return KILN_OK;
}

/* The variant of config c as the paged serving path runs it (kiln_paged_variant):
 * causal, window:W (the narrowest, when several), softcap:C (one), alibi; doc:EOT is left
 * out, as with any KV cache (document ids are known only for the tokens of a call).
 * prefix:P is refused: a prompt prefilled in chunks cannot see keys not yet written. */
/* A number of c's attention spec refused: the reason (the last error) after the spec. */
static kiln_status spec_error(const kiln_gpt_config *c)
{
    char why[512];
    snprintf(why, sizeof why, "%s", kiln_last_error());
    return kiln_error(KILN_ERR_ARG, "gpt: attention '%s': %s", c->attention, why);
}

static kiln_status paged_variant(const kiln_gpt_config *c, kiln_paged_variant *v)
{
    *v = (kiln_paged_variant){0};
    for (const char *p = c->attention; *p;) {
        size_t n = strcspn(p, "+");
        char part[64];
        if (n >= sizeof part)
            return kiln_error(KILN_ERR_ARG, "gpt: attention '%s': a part of %zu characters, at most 63", c->attention, n);
        snprintf(part, sizeof part, "%.*s", (int)n, p);
        /* The numbers as the flex presets read them (src/flex/flex.c preset(): the same
         * parser and ranges), so that serving takes what training took, with its value. */
        if (!strncmp(part, "window:", 7)) {
            int64_t w;
            if (kiln__parse_i64(part + 7, 1, INT32_MAX, "W of window:W", &w) != KILN_OK) return spec_error(c);
            v->window = v->window && v->window < w ? v->window : w;
        } else if (!strncmp(part, "softcap:", 8)) {
            if (v->softcap > 0)
                return kiln_error(KILN_ERR_UNSUPPORTED, "gpt: the paged serving path takes one softcap part; '%s' has "
                                  "more (kiln sample runs it)", c->attention);
            double cap;
            if (kiln__parse_f64(part + 8, FLT_MIN, FLT_MAX, 0, "C of softcap:C (a normal positive float)", &cap) !=
                KILN_OK)
                return spec_error(c);
            v->softcap = cap;
        } else if (!strncmp(p, "alibi", 5)) {
            v->alibi = true;
            v->alibi_after_softcap = v->softcap > 0;
        } else if (!strncmp(p, "prefix", 6)) {
            return kiln_error(KILN_ERR_UNSUPPORTED, "gpt: the paged serving path cannot run '%s': a prefix-LM prompt "
                              "is prefilled in chunks, and its bidirectional prefix would see keys not yet written "
                              "(kiln sample runs it)", c->attention);
        }
        p += n + (p[n] == '+');
    }
    return KILN_OK;
}

int64_t kiln_gpt_kv_window(const kiln_gpt_t *m)
{
    kiln_paged_variant v;
    return m && paged_variant(&m->cfg, &v) == KILN_OK ? v.window : 0;
}

kiln_status kiln_gpt_config_check(const kiln_gpt_config *c)
{
    if (!c) return kiln_error(KILN_ERR_ARG, "gpt config is NULL");
#define NEED(cond, ...) \
    if (!(cond)) return kiln_error(KILN_ERR_ARG, "gpt config: " __VA_ARGS__)
    NEED(c->n_layer >= 1 && c->n_layer <= 1024, "n_layer = %d must be in 1..1024", c->n_layer);
    NEED(c->n_head >= 1 && c->n_head <= 1 << 16, "n_head = %d must be in 1..65536", c->n_head);
    NEED(c->n_embd >= 1 && c->n_embd <= 1 << 20 && c->n_embd % c->n_head == 0,
         "n_embd = %d must be a multiple of n_head = %d, at most 2^20", c->n_embd, c->n_head);
    NEED(c->n_kv_head >= 1 && c->n_head % c->n_kv_head == 0, "n_kv_head = %d must divide n_head = %d", c->n_kv_head,
         c->n_head);
    NEED(c->pos != KILN_POS_ROPE || (c->n_embd / c->n_head) % 2 == 0, "rope needs an even head size, got %d",
         c->n_embd / c->n_head);
    NEED(c->block_size >= 1 && c->block_size <= 1 << 20, "block_size = %d must be in 1..2^20", c->block_size);
    NEED(c->vocab_size >= 1 && c->vocab_size <= 1 << 24, "vocab_size = %d must be in 1..2^24", c->vocab_size);
    NEED(c->ffn_hidden >= 0 && c->ffn_hidden <= 1 << 22, "ffn_hidden = %d must be in 0..2^22", c->ffn_hidden);
    NEED(c->norm_eps > 0, "norm_eps = %g must be positive", c->norm_eps);
    NEED(c->rope_theta > 0, "rope_theta = %g must be positive", c->rope_theta);
    NEED(c->pos == KILN_POS_ROPE || c->rope_scaling.kind == KILN_ROPE_SCALING_NONE,
         "rope_scaling needs pos = rope");
    kiln_status rs = kiln_rope_scaling_check(&c->rope_scaling); /* its message names the field */
    if (rs != KILN_OK) return rs;
    NEED(c->dropout >= 0 && c->dropout < 1, "dropout = %g must be in [0, 1)", c->dropout);
    NEED(memchr(c->attention, 0, sizeof c->attention), "attention: not a string of under 64 characters");
    if (c->attention[0]) { /* the spec builds */
        kiln_flex_t *f = NULL;
        kiln_status fs = model_flex(c, NULL, true, &f);
        kiln_flex_free(f);
        if (fs != KILN_OK) return fs;
    }
    NEED((unsigned)c->norm <= KILN_NORM_RMSNORM && (unsigned)c->pos <= KILN_POS_ROPE &&
         (unsigned)c->mlp <= KILN_MLP_SWIGLU, "unknown norm, pos or mlp kind");
    NEED(c->mla_kv_rank >= 0 && c->mla_q_rank >= 0 && c->mla_rope_dim >= 0 && c->mla_nope_dim >= 0 &&
             c->mla_v_dim >= 0,
         "the mla_ sizes must be >= 0");
    if (c->mla_kv_rank > 0) {
        int hs = c->n_embd / c->n_head, dn = c->mla_nope_dim ? c->mla_nope_dim : hs,
            dv = c->mla_v_dim ? c->mla_v_dim : hs;
        NEED(c->pos == KILN_POS_ROPE && !c->bias, "mla_kv_rank = %d needs pos = rope and bias = false",
             c->mla_kv_rank);
        NEED(c->mla_rope_dim > 0 && c->mla_rope_dim % 2 == 0, "mla_rope_dim = %d must be even and > 0",
             c->mla_rope_dim);
        NEED(dv <= dn + c->mla_rope_dim, "mla_v_dim = %d must be at most the query and key size %d", dv,
             dn + c->mla_rope_dim);
    }
    NEED(c->n_routed_experts >= 0 && c->n_routed_experts <= 4096, "n_routed_experts = %d must be in 0..4096",
         c->n_routed_experts);
    if (c->n_routed_experts > 0) {
        NEED(c->mlp == KILN_MLP_SWIGLU, "n_routed_experts = %d needs mlp = swiglu (the experts are SwiGLU)",
             c->n_routed_experts);
        NEED(c->moe_top_k >= 1 && c->moe_top_k <= c->n_routed_experts, "moe_top_k = %d must be in 1..%d",
             c->moe_top_k, c->n_routed_experts);
        NEED(c->n_shared_experts >= 0 && c->n_shared_experts <= 64, "n_shared_experts = %d must be in 0..64",
             c->n_shared_experts);
        NEED(c->moe_ffn >= 0 && c->moe_ffn <= 1 << 20, "moe_ffn = %d must be in 0..2^20", c->moe_ffn);
        NEED(c->n_dense_layers >= 0 && c->n_dense_layers < c->n_layer,
             "n_dense_layers = %d must be in 0..n_layer - 1 = %d (else no block has experts)", c->n_dense_layers,
             c->n_layer - 1);
        NEED((unsigned)c->moe_router <= KILN_ROUTER_SIGMOID, "unknown moe_router");
        NEED(c->moe_n_group >= 1 && c->n_routed_experts % c->moe_n_group == 0 &&
                 (c->moe_n_group == 1 || c->n_routed_experts / c->moe_n_group >= 2),
             "moe_n_group = %d must divide n_routed_experts = %d into groups of at least 2 (1: no groups)",
             c->moe_n_group, c->n_routed_experts);
        NEED(c->moe_n_group == 1 || (c->moe_topk_group >= 1 && c->moe_topk_group <= c->moe_n_group &&
                                     c->moe_top_k <= c->moe_topk_group * (c->n_routed_experts / c->moe_n_group)),
             "moe_topk_group = %d must be in 1..moe_n_group = %d, with moe_top_k = %d experts in its groups",
             c->moe_topk_group, c->moe_n_group, c->moe_top_k);
        NEED(c->moe_scale > 0 && isfinite(c->moe_scale), "moe_scale = %g must be positive", c->moe_scale);
        NEED(c->moe_bias_speed >= 0 && isfinite(c->moe_bias_speed), "moe_bias_speed = %g must be >= 0",
             c->moe_bias_speed);
        NEED(c->moe_balance_loss >= 0 && isfinite(c->moe_balance_loss), "moe_balance_loss = %g must be >= 0",
             c->moe_balance_loss);
        NEED(c->moe_capacity >= 0 && isfinite(c->moe_capacity), "moe_capacity = %g must be >= 0 (0: dropless)",
             c->moe_capacity);
    }
#undef NEED
    return KILN_OK;
}

/* The config's fields, one row each: the JSON writer and reader walk them. */
enum { F_INT, F_NUM, F_BOOL, F_ENUM, F_STR };
#define FIELD_AT(key, member, kind, ...) {key, kind, offsetof(kiln_gpt_config, member), {__VA_ARGS__}}
#define FIELD(name, kind, ...) FIELD_AT(#name, name, kind, __VA_ARGS__)
static const struct {
    const char *name;
    int kind;
    size_t offset;
    const char *values[4]; /* F_ENUM: the names of its values (NULL after the last), stored as an int */
} fields[] = {
    FIELD(n_layer, F_INT),    FIELD(n_head, F_INT),     FIELD(n_kv_head, F_INT),  FIELD(n_embd, F_INT),
    FIELD(block_size, F_INT), FIELD(vocab_size, F_INT), FIELD(ffn_hidden, F_INT), FIELD(bias, F_BOOL),
    FIELD(tied, F_BOOL),      FIELD(norm_eps, F_NUM),   FIELD(rope_theta, F_NUM), FIELD(dropout, F_NUM),
    FIELD(norm, F_ENUM, "layernorm", "rmsnorm"), FIELD(pos, F_ENUM, "learned", "rope"),
    FIELD(mlp, F_ENUM, "gelu", "swiglu"),
    FIELD_AT("rope_scaling", rope_scaling.kind, F_ENUM, "none", "linear", "llama3"),
    FIELD_AT("rope_factor", rope_scaling.factor, F_NUM),
    FIELD_AT("rope_low_freq_factor", rope_scaling.low_freq_factor, F_NUM),
    FIELD_AT("rope_high_freq_factor", rope_scaling.high_freq_factor, F_NUM),
    FIELD_AT("rope_original_context", rope_scaling.original_context, F_INT),
    FIELD(attention, F_STR),
    /* multi-head latent attention: written only with mla_kv_rank > 0 */
    FIELD(mla_kv_rank, F_INT), FIELD(mla_q_rank, F_INT), FIELD(mla_rope_dim, F_INT), FIELD(mla_nope_dim, F_INT),
    FIELD(mla_v_dim, F_INT),
    /* the mixture of experts: written only with n_routed_experts > 0, from here on */
    FIELD(n_routed_experts, F_INT), FIELD(n_shared_experts, F_INT), FIELD(moe_top_k, F_INT),
    FIELD(moe_ffn, F_INT), FIELD(n_dense_layers, F_INT), FIELD(moe_router, F_ENUM, "softmax", "sigmoid"),
    FIELD(moe_norm_topk, F_BOOL), FIELD(moe_scale, F_NUM), FIELD(moe_bias_speed, F_NUM),
    FIELD(moe_balance_loss, F_NUM), FIELD(moe_n_group, F_INT), FIELD(moe_topk_group, F_INT),
    FIELD(moe_capacity, F_NUM),
};
#undef FIELD
#undef FIELD_AT
#define NFIELDS (sizeof fields / sizeof fields[0])
_Static_assert(sizeof(kiln_norm_kind) == sizeof(int) && sizeof(kiln_mlp_kind) == sizeof(int) &&
               sizeof(kiln_rope_scaling_kind) == sizeof(int) && sizeof(kiln_router_kind) == sizeof(int),
               "enums as int");

char *kiln_gpt_config_to_json(const kiln_gpt_config *c)
{
    json_t *o = json_object();
    for (size_t i = 0; o && i < NFIELDS; i++) {
        const void *p = (const char *)c + fields[i].offset;
        /* no rope scaling: none of its keys, so that a build from before them reads the file */
        size_t rs = offsetof(kiln_gpt_config, rope_scaling);
        if (c->rope_scaling.kind == KILN_ROPE_SCALING_NONE && fields[i].offset >= rs &&
            fields[i].offset < rs + sizeof(kiln_rope_scaling))
            continue;
        int k = fields[i].kind;
        if (k == F_STR && !*(const char *)p) continue; /* the default: written only when set, as rope's keys */
        if (!c->n_routed_experts && fields[i].offset >= offsetof(kiln_gpt_config, n_routed_experts)) continue;
        if (!c->mla_kv_rank && !strncmp(fields[i].name, "mla_", 4)) continue;
        json_t *v = k == F_INT ? json_integer(*(const int *)p) : k == F_NUM ? json_real(*(const double *)p)
                  : k == F_BOOL ? json_boolean(*(const bool *)p) : k == F_STR ? json_string((const char *)p)
                  : json_string(fields[i].values[*(const int *)p]);
        if (json_object_set_new(o, fields[i].name, v) != 0) {
            json_decref(o);
            o = NULL;
        }
    }
    char *s = o ? json_dumps(o, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

kiln_status kiln_gpt_config_from_json(const char *text, kiln_gpt_config *out)
{
    json_error_t err;
    json_t *o = json_loads(text ? text : "", 0, &err);
    if (!o || !json_is_object(o)) {
        json_decref(o);
        return kiln_error(KILN_ERR_FORMAT, "gpt config: not a JSON object (%s)", o ? "wrong type" : err.text);
    }
    kiln_gpt_config c = kiln_gpt_config_gpt2();
    const char *key;
    json_t *v;
    kiln_status s = KILN_OK;
    json_object_foreach(o, key, v)
    {
        size_t i = 0;
        while (i < NFIELDS && strcmp(fields[i].name, key)) i++;
        void *p = i < NFIELDS ? (char *)&c + fields[i].offset : NULL;
        int k = p ? fields[i].kind : -1, e = 0;
        if (k == F_ENUM && json_is_string(v)) {
            while (e < 4 && fields[i].values[e] && strcmp(fields[i].values[e], json_string_value(v))) e++;
            if (e == 4 || !fields[i].values[e]) {
                s = kiln_error(KILN_ERR_FORMAT, "gpt config: unknown %s '%s'", key, json_string_value(v));
                break;
            }
            *(int *)p = e;
        } else if (k == F_INT && json_is_integer(v)) {
            *(int *)p = (int)json_integer_value(v);
        } else if (k == F_NUM && json_is_number(v)) {
            *(double *)p = json_number_value(v);
        } else if (k == F_BOOL && json_is_boolean(v)) {
            *(bool *)p = json_is_true(v);
        } else if (k == F_STR && json_is_string(v) && strlen(json_string_value(v)) < sizeof c.attention) {
            snprintf((char *)p, sizeof c.attention, "%s", json_string_value(v));
        } else {
            s = kiln_error(KILN_ERR_FORMAT, p ? "gpt config: key '%s' has the wrong type" : "gpt config: unknown key '%s'",
                           key);
            break;
        }
    }
    json_decref(o);
    if (s == KILN_OK) s = kiln_gpt_config_check(&c);
    if (s == KILN_OK) *out = c;
    return s;
}

/* std > 0: normal(0, std); std == 0: zeros; std < 0: ones. */
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

/* ---- forward ---- */

static kiln_tensor_t *norm(const kiln_gpt_t *m, kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *b)
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

struct kiln_kv_cache {
    int batch, len, n_layer;
    kiln_tensor_t **k, **v; /* per layer (B, Hkv, block_size, hs) */
};

/* The linear layers of a block, in the order of the packed copies a KV pool keeps. */
enum { PK_QKV, PK_PROJ, PK_FC, PK_UP, PK_OUT, PK_N };

/* One pass through the blocks: training and forward over (B,T) tokens, or paged decoding
 * over N rows of a batch of sequences. block() is the same for both; the pass says how
 * it attends and how it multiplies by a linear layer's weights. */
typedef struct pass pass;
struct pass {
    /* Attention of layer i from the q, k, v parts of its qkv projection: (B,T,H*hs),
     * (B,T,Hk*hs) x2 or (N,H*hs), (N,Hk*hs) x2; returns (B,T,C) or (N,C). */
    kiln_tensor_t *(*attend)(const pass *ps, int i, kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v);
    const kiln_gpt_t *m;
    kiln_tensor_t *(*pk)[PK_N]; /* packed weights per layer (kiln_matmul_rows_packed), or NULL: kiln_linear */
    double p;                   /* dropout on the attention and MLP outputs, in training */
    bool train;
    /* full causal attention: positions pos0.. of B sequences of T, the cache if any, and
     * a flex variant's modifiers (NULL: kiln_attention) */
    int64_t B, T, pos0;
    const kiln_flex_t *flex;
    kiln_tensor_t *mask; /* flex's block mask, made once for every layer (NULL: none) */
    kiln_kv_cache_t *cache;
    /* paged attention: the pool, and the rows' positions, slots, (seq, pos) and block table */
    kiln_kv_pool_t *pool;
    kiln_tensor_t *pos, *slot, *seq_pos, *block_table;
    kiln_paged_variant variant;
    kiln_tensor_t **balance; /* MoE blocks add their balance losses here (NULL: none wanted) */
};

/* x w^T + b through w's packed copy wp (n = w's rows): rows that do not depend on each
 * other (kiln_matmul_rows). */
static kiln_tensor_t *linear_rows(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *wp, kiln_tensor_t *b)
{
    kiln_tensor_t *y = kiln_matmul_rows_packed(x, wp, kiln_tensor_dim(w, 0));
    return b ? kiln_add(y, b) : y;
}

/* Layer i's linear layer `which` (PK_*) with weight w and bias b, as the pass runs it. */
static kiln_tensor_t *linear(const pass *ps, int i, int which, kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *b)
{
    return ps->pk ? linear_rows(x, w, ps->pk[i][which], b) : kiln_linear(x, w, b);
}

static kiln_tensor_t *attend_mla(const pass *ps, int i, kiln_tensor_t *h);
static kiln_tensor_t *attend_paged_mla(const pass *ps, int i, kiln_tensor_t *h);
static const kiln__moe_packed *pool_moe(const kiln_kv_pool_t *p, int i);

/* Transformer block i on x (B,T,C) or (N,C): x + attention(norm1(x)), then
 * x + mlp(norm2(x)). */
static kiln_tensor_t *block(const pass *ps, int i, kiln_tensor_t *x)
{
    const kiln_gpt_t *m = ps->m;
    const kiln_gpt_config *c = &m->cfg;
    const layer *L = &m->layers[i];
    int64_t H = c->n_head, Hk = c->n_kv_head, hs = c->n_embd / H;
    kiln_tensor_t *h1 = norm(m, x, L->n1w, L->n1b), *y;
    if (L->kv_a) {
        y = ps->pk ? attend_paged_mla(ps, i, h1) : attend_mla(ps, i, h1);
    } else {
        kiln_tensor_t *qkv = linear(ps, i, PK_QKV, h1, L->qkv_w, L->qkv_b);
        kiln_tensor_t *part[3];
        int64_t sizes[3] = {H * hs, Hk * hs, Hk * hs};
        if (!qkv || kiln_split(qkv, sizes, 3, -1, part) != KILN_OK) return NULL;
        y = ps->attend(ps, i, part[0], part[1], part[2]);
    }
    y = kiln_dropout(linear(ps, i, PK_PROJ, y, L->proj_w, L->proj_b), ps->p, ps->train);
    x = kiln_add(x, y);
    kiln_tensor_t *h = norm(m, x, L->n2w, L->n2b), *mo;
    if (L->moe) { /* over the rows: (B, T, C) flattened, or the paged pass's (N, C) */
        bool flat = kiln_tensor_ndim(h) == 2;
        int64_t rows[2] = {-1, c->n_embd};
        mo = kiln__moe_forward(c, L->moe, flat ? h : kiln_reshape(h, rows, 2), flat ? 0 : ps->B, ps->train,
                               ps->pool ? pool_moe(ps->pool, i) : NULL, ps->balance);
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
    q = heads(q, B, T, H, hs);
    k = heads(k, B, T, Hk, hs);
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
static kiln_tensor_t *run(kiln_gpt_t *m, kiln_tensor_t *idx, int64_t pos0, kiln_kv_cache_t *cache, bool train,
                          kiln_tensor_t **balance)
{
    const kiln_gpt_config *c = &m->cfg;
    int64_t T = kiln_tensor_dim(idx, 1);
    pass ps = {.attend = attend_full, .m = m, .p = train ? c->dropout : 0.0, .train = train,
               .B = kiln_tensor_dim(idx, 0), .T = T, .pos0 = pos0, .cache = cache, .balance = balance};
    /* a flex variant's modifiers, once for every layer; document ids are known only for
     * the tokens of this call, so with a cache the doc part is left out */
    kiln_flex_t *flex = NULL;
    if (kiln__gpt_has_variant(c) && model_flex(c, idx, !cache && !pos0, &flex) != KILN_OK) return NULL;
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
    for (int i = 0; x && i < c->n_layer; i++) x = block(&ps, i, x);
    kiln_flex_free(flex);
    if (!x) return NULL;
    x = norm(m, x, m->nfw, m->nfb);
    return kiln_linear(x, c->tied ? m->tok_emb : m->lm_head, NULL);
}

static kiln_status check_idx(const kiln_gpt_t *m, kiln_tensor_t *idx, int64_t pos0, const char *what)
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

/* The model's autocast region around a forward (none in f32); false when it could not
 * be opened (the error is set). */
static bool precision_begin(const kiln_gpt_t *m)
{
    return m->precision == KILN_DTYPE_F32 || kiln_autocast_begin(m->precision) == KILN_OK;
}

static void precision_end(const kiln_gpt_t *m)
{
    if (m->precision != KILN_DTYPE_F32) kiln_autocast_end();
}

static kiln_tensor_t *forward(kiln_gpt_t *m, kiln_tensor_t *idx, kiln_tensor_t *targets, bool train, kiln_tensor_t **loss)
{
    kiln_tensor_t *balance = NULL; /* the MoE blocks' balance losses, summed */
    kiln_tensor_t *logits = run(m, idx, 0, NULL, train, targets && loss ? &balance : NULL);
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
    if (check_idx(m, idx, 0, "gpt_forward") != KILN_OK) return NULL;
    if (!precision_begin(m)) return NULL;
    kiln_tensor_t *logits = forward(m, idx, targets, train, loss);
    precision_end(m);
    return logits;
}

/* n zero tensors of shape into t, kept (their owner frees them); false when one could
 * not be made. */
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
    if (check_idx(m, idx, c->len, "gpt_forward_cached") != KILN_OK) return NULL;
    if (kiln_tensor_dim(idx, 0) != c->batch)
        return kiln_error(KILN_ERR_SHAPE, "gpt_forward_cached: batch %lld, the cache holds %d",
                         (long long)kiln_tensor_dim(idx, 0), c->batch), NULL;
    bool prev = kiln_set_grad_enabled(false);
    bool open = precision_begin(m);
    kiln_tensor_t *logits = open ? run(m, idx, c->len, c, false, NULL) : NULL;
    if (open) precision_end(m);
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

static const kiln__moe_packed *pool_moe(const kiln_kv_pool_t *p, int i) { return &p->moe_pk[i]; }
static kiln_tensor_t *const *pool_mla(const kiln_kv_pool_t *p, int i) { return p->mla_pk + i * p->mla_stride; }

/* Layer ly's latent attention weights packed into pk (mla_stride slots) as weights. */
static bool pack_mla(const kiln_gpt_config *c, const layer *ly, kiln_dtype weights, kiln_tensor_t **pk)
{
    int64_t H = c->n_head, hs = c->n_embd / H, dn = c->mla_nope_dim ? c->mla_nope_dim : hs;
    int64_t dv = c->mla_v_dim ? c->mla_v_dim : hs, rkv = c->mla_kv_rank;
    kiln_tensor_t *w[3] = {ly->q_a, ly->q_b, ly->kv_a};
    for (int j = 0; j < 3; j++)
        if (w[j] && !(pk[j] = kiln_keep(kiln_matmul_rows_pack(kiln_cast(w[j], weights))))) return false;
    kiln_tensor_t *kvb = kiln_reshape(ly->kv_b, (int64_t[]){H, dn + dv, rkv}, 3);
    for (int64_t x = 0; x < H; x++) {
        kiln_tensor_t *head = kiln_squeeze(kiln_narrow(kvb, 0, x, 1), 0);
        kiln_tensor_t *wk = kiln_contiguous(kiln_transpose(kiln_narrow(head, 0, 0, dn), 0, 1));
        kiln_tensor_t *wv = kiln_contiguous(kiln_narrow(head, 0, dn, dv));
        if (!(pk[3 + x] = kiln_keep(kiln_matmul_rows_pack(kiln_cast(wk, weights)))) ||
            !(pk[3 + H + x] = kiln_keep(kiln_matmul_rows_pack(kiln_cast(wv, weights)))))
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
    if (!kiln_dtype_is_f32_or_half(weights))
        return kiln_error(KILN_ERR_DTYPE, "kv_pool_new: weights packed as %s; they are f32, bf16 or f16",
                          kiln_dtype_name(weights));
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
            if (w[j] && !(p->pk[i][j] = kiln_keep(kiln_matmul_rows_pack(kiln_cast(w[j], weights))))) packed = false;
        if (ly->moe && kiln__moe_pack(&m->cfg, ly->moe, weights, &p->moe_pk[i]) != KILN_OK) packed = false;
        if (ly->kv_a && !pack_mla(&m->cfg, ly, weights, p->mla_pk + i * p->mla_stride)) packed = false;
    }
    kiln_tensor_t *head = m->cfg.tied ? m->tok_emb : m->lm_head;
    if (!(p->pk_head = kiln_keep(kiln_matmul_rows_pack(kiln_cast(head, weights))))) packed = false;
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
    int64_t qs[3] = {N, H, hs}, ks[3] = {N, Hk, hs}, nc[2] = {N, C};
    q = kiln_reshape(q, qs, 3);
    k = kiln_reshape(k, ks, 3);
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
    if (paged_variant(c, &variant) != KILN_OK) return NULL;

    for (int64_t i = 0; i < N; i++) {
        slots[i] = b->block_table[b->seq[i] * b->max_blocks + b->pos[i] / bl] * (int32_t)bl + b->pos[i] % (int32_t)bl;
        seq_pos[2 * i] = b->seq[i];
        seq_pos[2 * i + 1] = b->pos[i];
    }
    int64_t n2[2] = {N, 2}, bts[2] = {b->n_seqs, b->max_blocks}, nl = b->n_logits;
    kiln_tensor_t *idx = kiln_from_data(b->tokens, &N, 1, KILN_DTYPE_I32);
    pass ps = {.attend = attend_paged, .m = m, .pk = p->pk, .pool = p, .variant = variant};
    ps.pos = kiln_from_data(b->pos, &N, 1, KILN_DTYPE_I32);
    ps.slot = kiln_from_data(slots, &N, 1, KILN_DTYPE_I32);
    ps.seq_pos = kiln_from_data(seq_pos, n2, 2, KILN_DTYPE_I32);
    ps.block_table = kiln_from_data(b->block_table, bts, 2, KILN_DTYPE_I32);
    kiln_tensor_t *rows = nl ? kiln_from_data(b->logit_rows, &nl, 1, KILN_DTYPE_I32) : NULL;
    kiln_tensor_t *x = kiln_embedding(m->tok_emb, idx);
    if (c->pos == KILN_POS_LEARNED) x = kiln_add(x, kiln_index_select(m->pos_emb, 0, ps.pos));
    for (int i = 0; i < c->n_layer; i++)
        if (!(x = block(&ps, i, x))) return NULL;
    /* Only the rows whose logits are wanted go through the last norm and the head (a
     * step that only prefills wants none). */
    if (!nl) {
        int64_t none[2] = {0, c->vocab_size};
        return x ? kiln_empty(none, 2, KILN_DTYPE_F32) : NULL;
    }
    x = norm(m, kiln_index_select(x, 0, rows), m->nfw, m->nfb);
    return linear_rows(x, c->tied ? m->tok_emb : m->lm_head, p->pk_head, NULL);
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

kiln_status kiln_gpt_loss_backward(void *model, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    if (!model || !in || n_in != 2 || !out || !n_out)
        return kiln_error(KILN_ERR_ARG, "gpt_loss_backward: needs the model, (idx, targets) and room for the loss");
    kiln_tensor_t *loss;
    if (!kiln_gpt_forward(model, in[0], in[1], true, &loss)) return kiln_last_status();
    kiln_status s = kiln_backward(loss);
    out[0] = loss;
    *n_out = 1;
    return s;
}

/* The gradient norm of a model whose experts are sharded: the replicated parameters'
 * squares, the same on every rank, plus the experts' squares summed over the ranks. */
static kiln_status sharded_norm(const kiln_gpt_step *st, kiln_tensor_t **norm)
{
    kiln_tensor_t **ps = malloc(sizeof *ps * (size_t)(st->n_params ? st->n_params : 1)), *nr, *ne;
    if (!ps) return kiln_error(KILN_ERR_OOM, "gpt_train_step: out of memory");
    int n = 0, k = st->n_params;
    for (int i = 0; i < st->n_params; i++) /* replicated from the front, shards from the back */
        if (kiln__gpt_expert_shard(st->model, st->params[i])) ps[--k] = st->params[i];
        else ps[n++] = st->params[i];
    kiln_status s = kiln_grad_norm(ps, n, &nr);
    if (s == KILN_OK) s = kiln_grad_norm(ps + k, st->n_params - k, &ne);
    free(ps);
    kiln_tensor_t *ne2 = s == KILN_OK ? kiln_mul(ne, ne) : NULL;
    if (s == KILN_OK && !ne2) s = kiln_last_status();
    if (s == KILN_OK && st->pg) s = kiln_pg_allreduce(st->pg, ne2, KILN_REDUCE_SUM);
    if (s == KILN_OK && !(*norm = kiln_sqrt(kiln_add(kiln_mul(nr, nr), ne2)))) s = kiln_last_status();
    return s;
}

kiln_status kiln_gpt_train_step(void *step, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    const kiln_gpt_step *st = step;
    if (!st || !st->model || !st->opt || !in || n_in != 3 + st->scaled || !out || !n_out)
        return kiln_error(KILN_ERR_ARG, "gpt_train_step: needs the model and optimizer, (idx, targets, lr%s) and room "
                          "for (loss, norm)", st && st->scaled ? ", loss scale" : "");
    kiln_tensor_t *loss = NULL, *norm = NULL, *scale = st->scaled ? in[3] : NULL;
    if (scale && (kiln_tensor_numel(scale) != 1 || !kiln_dtype_is_float(kiln_tensor_dtype(scale)))) {
        char b[96];
        return kiln_error(KILN_ERR_SHAPE, "gpt_train_step: the loss scale %s must be a one-element float tensor",
                          kiln_tensor_describe(scale, b, sizeof b));
    }
    kiln_status s = KILN_OK;
    kiln_pg_t *ep = st->model->ep;
    if (ep && kiln_pg_world_size(ep) > 1 && st->pg != ep)
        return kiln_error(KILN_ERR_ARG, "gpt_train_step: the model's experts are sharded over %d ranks, so it trains "
                          "data-parallel over that group: pass it as the step's pg", kiln_pg_world_size(ep));
    if (ep && st->zero)
        return kiln_error(KILN_ERR_UNSUPPORTED, "gpt_train_step: ZeRO-1 with sharded experts is not supported (its "
                          "shards assume every rank holds every parameter)");
    int A = st->accum > 1 ? st->accum : 1;
    /* Backward runs on loss * scale / A, the scale read when the step runs. */
    kiln_tensor_t *factor = scale ? kiln_mul_scalar(kiln_cast(kiln_view(scale, NULL, 0), KILN_DTYPE_F32), 1.0 / A) : NULL;
    if (scale && !factor) return kiln_last_status();
    if (A == 1) {
        if (!kiln_gpt_forward(st->model, in[0], in[1], true, &loss)) return kiln_last_status();
        s = kiln_backward(factor ? kiln_mul(loss, factor) : loss);
    } else {
        if (kiln_tensor_ndim(in[0]) != 3 || kiln_tensor_shape(in[0])[0] != A || kiln_tensor_ndim(in[1]) != 3 ||
            kiln_tensor_shape(in[1])[0] != A)
            return kiln_error(KILN_ERR_SHAPE, "gpt_train_step: accum %d takes idx and targets of shape (%d, B, T)", A, A);
        for (int k = 0; s == KILN_OK && k < A; k++) {
            kiln_tensor_t *x = kiln_squeeze(kiln_narrow(in[0], 0, k, 1), 0), *y = kiln_squeeze(kiln_narrow(in[1], 0, k, 1), 0);
            kiln_tensor_t *lk;
            if (!x || !y || !kiln_gpt_forward(st->model, x, y, true, &lk)) return kiln_last_status();
            s = kiln_backward(factor ? kiln_mul(lk, factor) : kiln_mul_scalar(lk, 1.0 / A));
            loss = s != KILN_OK ? NULL : loss ? kiln_add(loss, lk) : lk;
            if (s == KILN_OK && !loss) s = kiln_last_status();
        }
        if (s == KILN_OK && !(loss = kiln_mul_scalar(loss, 1.0 / A))) s = kiln_last_status();
    }
    if (st->zero) {
        if (s == KILN_OK) s = kiln_zero1_step_t(st->zero, in[2], scale, st->clip, &norm);
    } else {
        for (int i = 0; s == KILN_OK && st->pg && i < st->n_params; i++) {
            kiln_tensor_t *g = kiln_tensor_grad(st->params[i]);
            if (!g) continue;
            /* an expert shard's gradient is the sum over every rank's rows already */
            if (kiln__gpt_expert_shard(st->model, st->params[i]))
                s = kiln_mul_scalar_(g, 1.0 / kiln_pg_world_size(st->pg));
            else
                s = kiln_pg_allreduce(st->pg, g, KILN_REDUCE_AVG);
        }
        if (s == KILN_OK) s = st->model->ep ? sharded_norm(st, &norm) : kiln_grad_norm(st->params, st->n_params, &norm);
        /* (the gscale of a loss-scaled step unscales, and skips the update when the
         * gradients overflowed) */
        kiln_tensor_t *coef = s != KILN_OK ? NULL
                              : scale ? kiln_loss_scale_coef(norm, scale, st->clip, &norm)
                              : st->clip > 0 ? kiln_clip_coef(norm, st->clip) : NULL;
        if (s == KILN_OK && (scale || st->clip > 0) && !coef) s = kiln_last_status();
        if (s == KILN_OK) s = kiln_optim_step_t(st->opt, in[2], coef);
    }
    if (s == KILN_OK) s = kiln_gpt_moe_update(st->model, st->pg); /* the balancing biases, from every rank's loads */
    kiln_optim_zero_grad(st->opt);
    out[0] = loss;
    out[1] = norm;
    *n_out = 2;
    return s;
}
