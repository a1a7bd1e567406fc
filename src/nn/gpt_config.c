/* The GPT model's config (docs/model.md): the families' defaults, the checks, the JSON
 * form, and the attention variant read as flex modifiers and as the paged path runs it. */
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

kiln_gpt_config kiln_gpt_config_gpt2(void)
{
    return (kiln_gpt_config){
#define KILN_GPT_FIELD(member, ctype, kind, def, ...) .member = def,
#define KILN_GPT_MEMBER(ctype, member, def) .member = def,
#define KILN_GPT_PART(...)
#include "kiln/gpt_config.def"
#undef KILN_GPT_FIELD
#undef KILN_GPT_MEMBER
#undef KILN_GPT_PART
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
kiln_status kiln__gpt_flex(const kiln_gpt_config *c, kiln_tensor_t *idx, bool keep_doc, kiln_flex_t **out)
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

/* A number of c's attention spec refused: the reason (the last error) after the spec. */
static kiln_status spec_error(const kiln_gpt_config *c)
{
    char why[512];
    snprintf(why, sizeof why, "%s", kiln_last_error());
    return kiln_error(KILN_ERR_ARG, "gpt: attention '%s': %s", c->attention, why);
}

/* The variant of config c as the paged serving path runs it (kiln_paged_variant):
 * causal, window:W (the narrowest, when several), softcap:C (one), alibi; doc:EOT is left
 * out, as with any KV cache (document ids are known only for the tokens of a call).
 * prefix:P is refused: a prompt prefilled in chunks cannot see keys not yet written. */
kiln_status kiln__gpt_paged_variant(const kiln_gpt_config *c, kiln_paged_variant *v)
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
    return m && kiln__gpt_paged_variant(&m->cfg, &v) == KILN_OK ? v.window : 0;
}

/* The config's fields, one row each (kiln/gpt_config.def): the checks and the JSON writer
 * and reader walk them. */
enum { F_INT, F_NUM, F_BOOL, F_ENUM, F_STR };
enum { W_ALWAYS, W_SET, W_ROPE, W_MLA, W_MOE }; /* which configs write the key (the .def's `when`) */
#define ABOVE_LO KILN__PARSE_ABOVE_LO
#define BELOW_HI KILN__PARSE_BELOW_HI
#define KILN_GPT_NAMES(...) {__VA_ARGS__}
static const struct {
    const char *name;
    int kind, when;
    size_t offset, size;
    double lo, hi; /* a number's range (F_INT, F_NUM); a PART's is checked by its member's check */
    unsigned flags; /* KILN__PARSE_ABOVE_LO, _BELOW_HI */
    bool checked;
    const char *values[4]; /* F_ENUM: the names of its values (NULL after the last), stored as an int */
} fields[] = {
#define KILN_GPT_FIELD(member, ctype, kind, def, lo, hi, flags, names, when, ...) \
    {#member, F_##kind, W_##when, offsetof(kiln_gpt_config, member), sizeof(ctype), lo, hi, flags, true, names},
#define KILN_GPT_MEMBER(...)
#define KILN_GPT_PART(key, path, kind, names, when) \
    {key, F_##kind, W_##when, offsetof(kiln_gpt_config, path), 0, 0, 0, 0, false, names},
#include "kiln/gpt_config.def"
#undef KILN_GPT_FIELD
#undef KILN_GPT_MEMBER
#undef KILN_GPT_PART
};
#undef KILN_GPT_NAMES
#undef ABOVE_LO
#undef BELOW_HI
#define NFIELDS (sizeof fields / sizeof fields[0])
_Static_assert(sizeof(kiln_norm_kind) == sizeof(int) && sizeof(kiln_mlp_kind) == sizeof(int) &&
               sizeof(kiln_pos_kind) == sizeof(int) && sizeof(kiln_rope_scaling_kind) == sizeof(int) &&
               sizeof(kiln_router_kind) == sizeof(int), "enums as int");

/* Field i's value in c is 0, false or "" (the default of a SET field). */
static bool field_unset(const kiln_gpt_config *c, size_t i)
{
    const char *p = (const char *)c + fields[i].offset;
    switch (fields[i].kind) {
    case F_INT:
    case F_ENUM: return *(const int *)p == 0;
    case F_NUM: return *(const double *)p == 0;
    case F_BOOL: return !*(const bool *)p;
    default: return !*p;
    }
}

/* Whether c's JSON has field i (its `when`). */
static bool field_written(const kiln_gpt_config *c, size_t i)
{
    switch (fields[i].when) {
    case W_SET: return !field_unset(c, i);
    case W_ROPE: return c->rope_scaling.kind != KILN_ROPE_SCALING_NONE;
    case W_MLA: return c->mla_kv_rank > 0;
    case W_MOE: return c->n_routed_experts > 0;
    default: return true;
    }
}

/* Field i within its range, or an error naming it and the range. */
static kiln_status field_check(const kiln_gpt_config *c, size_t i)
{
    const char *p = (const char *)c + fields[i].offset, *name = fields[i].name;
    char range[96];
    switch (fields[i].kind) {
    case F_INT: {
        int v = *(const int *)p;
        if (v < fields[i].lo || v > fields[i].hi)
            return kiln_error(KILN_ERR_ARG, "gpt config: %s = %d must be in %.0f..%.0f", name, v, fields[i].lo,
                              fields[i].hi);
        return KILN_OK;
    }
    case F_NUM: {
        double v = *(const double *)p;
        if (!(v >= fields[i].lo && v <= fields[i].hi) || ((fields[i].flags & KILN__PARSE_ABOVE_LO) && v == fields[i].lo) ||
            ((fields[i].flags & KILN__PARSE_BELOW_HI) && v == fields[i].hi)) {
            kiln__describe_f64(fields[i].lo, fields[i].hi, fields[i].flags, range, sizeof range);
            return kiln_error(KILN_ERR_ARG, "gpt config: %s = %g must be %s", name, v, range);
        }
        return KILN_OK;
    }
    case F_ENUM: {
        int v = *(const int *)p, n = 0;
        while (n < 4 && fields[i].values[n]) n++;
        if (v < 0 || v >= n) return kiln_error(KILN_ERR_ARG, "gpt config: unknown %s kind %d", name, v);
        return KILN_OK;
    }
    case F_STR:
        if (!memchr(p, 0, fields[i].size))
            return kiln_error(KILN_ERR_ARG, "gpt config: %s: not a string of under %zu characters", name, fields[i].size);
        return KILN_OK;
    default: return KILN_OK;
    }
}

kiln_status kiln_gpt_config_check(const kiln_gpt_config *c)
{
    if (!c) return kiln_error(KILN_ERR_ARG, "gpt config is NULL");
    /* each field on its own (the MoE fields only for a model with experts), then the
     * rules that join fields */
    for (size_t i = 0; i < NFIELDS; i++) {
        if (!fields[i].checked || (fields[i].when == W_MOE && !c->n_routed_experts)) continue;
        kiln_status s = field_check(c, i);
        if (s != KILN_OK) return s;
    }
#define NEED(cond, ...) \
    if (!(cond)) return kiln_error(KILN_ERR_ARG, "gpt config: " __VA_ARGS__)
    NEED(c->n_embd % c->n_head == 0, "n_embd = %d must be a multiple of n_head = %d", c->n_embd, c->n_head);
    NEED(c->n_head % c->n_kv_head == 0, "n_kv_head = %d must divide n_head = %d", c->n_kv_head, c->n_head);
    NEED(c->pos != KILN_POS_ROPE || (c->n_embd / c->n_head) % 2 == 0, "rope needs an even head size, got %d",
         c->n_embd / c->n_head);
    NEED(c->pos == KILN_POS_ROPE || c->rope_scaling.kind == KILN_ROPE_SCALING_NONE,
         "rope_scaling needs pos = rope");
    kiln_status rs = kiln_rope_scaling_check(&c->rope_scaling); /* its message names the field */
    if (rs != KILN_OK) return rs;
    if (c->attention[0]) { /* the spec builds */
        kiln_flex_t *f = NULL;
        kiln_status fs = kiln__gpt_flex(c, NULL, true, &f);
        kiln_flex_free(f);
        if (fs != KILN_OK) return fs;
    }
    NEED(!c->qk_norm || c->mla_kv_rank == 0, "qk_norm needs standard attention (mla_kv_rank = 0)");
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
    if (c->n_routed_experts > 0) {
        NEED(c->mlp == KILN_MLP_SWIGLU, "n_routed_experts = %d needs mlp = swiglu (the experts are SwiGLU)",
             c->n_routed_experts);
        NEED(c->moe_top_k <= c->n_routed_experts, "moe_top_k = %d must be in 1..%d", c->moe_top_k,
             c->n_routed_experts);
        NEED(c->n_dense_layers < c->n_layer,
             "n_dense_layers = %d must be in 0..n_layer - 1 = %d (else no block has experts)", c->n_dense_layers,
             c->n_layer - 1);
        NEED(c->n_routed_experts % c->moe_n_group == 0 &&
                 (c->moe_n_group == 1 || c->n_routed_experts / c->moe_n_group >= 2),
             "moe_n_group = %d must divide n_routed_experts = %d into groups of at least 2 (1: no groups)",
             c->moe_n_group, c->n_routed_experts);
        NEED(c->moe_n_group == 1 || (c->moe_topk_group <= c->moe_n_group &&
                                     c->moe_top_k <= c->moe_topk_group * (c->n_routed_experts / c->moe_n_group)),
             "moe_topk_group = %d must be in 1..moe_n_group = %d, with moe_top_k = %d experts in its groups",
             c->moe_topk_group, c->moe_n_group, c->moe_top_k);
    }
#undef NEED
    return KILN_OK;
}

char *kiln_gpt_config_to_json(const kiln_gpt_config *c)
{
    json_t *o = json_object();
    for (size_t i = 0; o && i < NFIELDS; i++) {
        if (!field_written(c, i)) continue;
        const void *p = (const char *)c + fields[i].offset;
        int k = fields[i].kind;
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
        } else if (k == F_STR && json_is_string(v) && strlen(json_string_value(v)) < fields[i].size) {
            snprintf((char *)p, fields[i].size, "%s", json_string_value(v));
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

