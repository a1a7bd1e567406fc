/* Hugging Face model folders as kiln models: config.json read into a kiln_gpt_config,
 * the weights (model.safetensors, or the shards model.safetensors.index.json lists) mapped
 * onto kiln's parameters (docs/model.md) and widened to f32; and kiln models written as
 * such folders.
 *
 * The families are rows of src/nn/arch.c (LLaMA, Mistral, Qwen2, Qwen3, GPT-2): each gives
 * its model_type, its config keys and its tensor names, and the code below walks the row.
 * kiln's `bias` is one switch for every linear layer, so a model with biases on some
 * layers only (Qwen2's q/k/v) loads with zero biases on the others: the same model.
 * Nothing is guessed: a config field kiln cannot honour is an error naming it, and so is a
 * tensor of the files that no parameter takes. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/ops.h"
#include "kiln/tokenizer.h"
#include "core/file.h"
#include "io/json_file.h"
#include "nn/arch.h"
#include "nn/names.h"


/* ---- config.json ---- */

typedef struct {
    const char *file;
    json_t *root;
} hf_config;

/* An integer field; def when absent or null (required: an error instead). */
/* A JSON value as a short quote for an error message (a long one cut with "..."). */
static const char *quote(json_t *v, char *buf, size_t n)
{
    char *d = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!d) return snprintf(buf, n, "(a value)"), buf;
    if (strlen(d) + 1 > n && n > 4) snprintf(buf, n, "%.*s...", (int)n - 4, d);
    else snprintf(buf, n, "%s", d);
    free(d);
    return buf;
}

static kiln_status cfg_int(const hf_config *c, const char *key, bool required, int def, int lo, int *out)
{
    json_t *v = json_object_get(c->root, key);
    if (!v || json_is_null(v)) {
        if (required) return kiln_error(KILN_ERR_FORMAT, "%s: '%s' is missing", c->file, key);
        *out = def;
        return KILN_OK;
    }
    char q[48];
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > (1 << 30))
        return kiln_error(KILN_ERR_FORMAT, "%s: '%s' must be an integer from %d to %d, not %s", c->file, key, lo,
                          1 << 30, quote(v, q, sizeof q));
    *out = (int)json_integer_value(v);
    return KILN_OK;
}

static kiln_status cfg_num(const hf_config *c, json_t *obj, const char *key, double def, double *out)
{
    json_t *v = obj ? json_object_get(obj, key) : NULL;
    if (!v || json_is_null(v)) {
        *out = def;
        return KILN_OK;
    }
    char q[48];
    if (!json_is_number(v))
        return kiln_error(KILN_ERR_FORMAT, "%s: '%s' must be a number, not %s", c->file, key, quote(v, q, sizeof q));
    *out = json_number_value(v);
    return KILN_OK;
}

/* A boolean field: true or false (def when absent or null); "yes", 1 or any other
 * value is an error naming the key, not a guess. */
static kiln_status cfg_bool(const hf_config *c, const char *key, bool def, bool *out)
{
    json_t *v = json_object_get(c->root, key);
    char q[48];
    if (v && !json_is_null(v) && !json_is_boolean(v))
        return kiln_error(KILN_ERR_FORMAT, "%s: '%s' must be true or false, not %s", c->file, key, quote(v, q, sizeof q));
    *out = json_is_boolean(v) ? json_is_true(v) : def;
    return KILN_OK;
}

static const char *cfg_str(const hf_config *c, const char *key)
{
    return json_string_value(json_object_get(c->root, key));
}

/* A number of the rope object r that the scaling needs. */
static kiln_status rope_num(const hf_config *c, json_t *r, const char *key, double *out)
{
    if (!json_object_get(r, key) || json_is_null(json_object_get(r, key)))
        return kiln_error(KILN_ERR_FORMAT, "%s: rope scaling needs '%s'", c->file, key);
    return cfg_num(c, r, key, 0, out);
}

/* RoPE: its base and its scaling, from transformers 5's rope_parameters or the older
 * rope_theta and rope_scaling fields. kiln has the scalings that change only the
 * frequencies (linear, llama3); one that also depends on the sequence's length
 * (dynamic) or scales attention (yarn, longrope) is refused by name. */
static kiln_status cfg_rope(const hf_config *c, double *theta, kiln_rope_scaling *scaling)
{
    json_t *p = json_object_get(c->root, "rope_parameters"), *s = json_object_get(c->root, "rope_scaling");
    json_t *r = json_is_object(p) ? p : json_is_object(s) ? s : NULL;
    *scaling = (kiln_rope_scaling){0};
    char q[48];
    if (p && !json_is_null(p) && !json_is_object(p))
        return kiln_error(KILN_ERR_FORMAT, "%s: 'rope_parameters' must be an object or null, not %s", c->file,
                          quote(p, q, sizeof q));
    if (s && !json_is_null(s) && !json_is_object(s))
        return kiln_error(KILN_ERR_FORMAT, "%s: 'rope_scaling' must be an object or null, not %s", c->file,
                          quote(s, q, sizeof q));
    kiln_status st = cfg_num(c, c->root, "rope_theta", 10000.0, theta);
    if (st == KILN_OK && r) st = cfg_num(c, r, "rope_theta", *theta, theta);
    if (st == KILN_OK && !(*theta > 0)) return kiln_error(KILN_ERR_FORMAT, "%s: rope_theta must be > 0", c->file);
    double partial = 1;
    if (st == KILN_OK) st = cfg_num(c, c->root, "partial_rotary_factor", 1, &partial);
    if (st == KILN_OK && r) st = cfg_num(c, r, "partial_rotary_factor", partial, &partial);
    if (st == KILN_OK && partial != 1)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: partial_rotary_factor %g is not supported (kiln rotates whole heads)",
                          c->file, partial);
    json_t *kind = r ? json_object_get(r, "rope_type") : NULL;
    if (r && !kind) kind = json_object_get(r, "type");
    const char *k = json_string_value(kind);
    if (st != KILN_OK || !kind || json_is_null(kind)) return st;
    if (!k) return kiln_error(KILN_ERR_FORMAT, "%s: the rope type must be a string", c->file);
    if (!strcmp(k, "default")) return KILN_OK;
    if (!strcmp(k, "linear") || !strcmp(k, "llama3")) {
        scaling->kind = !strcmp(k, "linear") ? KILN_ROPE_SCALING_LINEAR : KILN_ROPE_SCALING_LLAMA3;
        st = rope_num(c, r, "factor", &scaling->factor);
        double ctx = 0;
        if (st == KILN_OK && scaling->kind == KILN_ROPE_SCALING_LLAMA3) {
            st = rope_num(c, r, "low_freq_factor", &scaling->low_freq_factor);
            if (st == KILN_OK) st = rope_num(c, r, "high_freq_factor", &scaling->high_freq_factor);
            if (st == KILN_OK) st = rope_num(c, r, "original_max_position_embeddings", &ctx);
            if (st == KILN_OK && !(ctx >= 1 && ctx <= (1 << 30) && ctx == (double)(int)ctx))
                return kiln_error(KILN_ERR_FORMAT, "%s: original_max_position_embeddings must be a positive integer",
                                  c->file);
            scaling->original_context = (int)ctx;
        }
        if (st == KILN_OK && kiln_rope_scaling_check(scaling) != KILN_OK) {
            char why[256]; /* the message, before the buffer that holds it is written again */
            snprintf(why, sizeof why, "%s", kiln_last_error());
            return kiln_error(KILN_ERR_FORMAT, "%s: %s", c->file, why);
        }
        return st;
    }
    return kiln_error(KILN_ERR_UNSUPPORTED, "%s: rope scaling '%s' is not supported (kiln has linear and llama3)",
                      c->file, k);
}

/* config.json as a model of family a (its row's keys, defaults and refusals). */
static kiln_status config_family(const hf_config *c, const kiln__arch *a, kiln_gpt_config *g)
{
    kiln__arch_config(a, g);
    int head_dim = 0, window = 0;
    kiln_status s = cfg_int(c, a->hf.n_embd, true, 0, 1, &g->n_embd);
    if (s == KILN_OK) s = cfg_int(c, a->hf.n_layer, true, 0, 1, &g->n_layer);
    if (s == KILN_OK) s = cfg_int(c, a->hf.n_head, true, 0, 1, &g->n_head);
    g->n_kv_head = g->n_head; /* (a family without the key: as many as the query heads) */
    if (s == KILN_OK && a->hf.n_kv_head) s = cfg_int(c, a->hf.n_kv_head, false, g->n_head, 1, &g->n_kv_head);
    if (s == KILN_OK) s = cfg_int(c, a->hf.ffn, a->ffn_required, 0, 1, &g->ffn_hidden);
    if (s == KILN_OK) s = cfg_int(c, a->hf.vocab, true, 0, 1, &g->vocab_size);
    if (s == KILN_OK) s = cfg_int(c, a->hf.context, true, 0, 1, &g->block_size);
    if (s == KILN_OK && a->hf.head_dim) s = cfg_int(c, a->hf.head_dim, false, 0, 1, &head_dim);
    if (s == KILN_OK && a->hf.window) s = cfg_int(c, a->hf.window, false, 0, 0, &window);
    if (s == KILN_OK) s = cfg_num(c, c->root, a->hf.eps, a->eps_default, &g->norm_eps);
    if (s == KILN_OK && a->pos == KILN_POS_ROPE) s = cfg_rope(c, &g->rope_theta, &g->rope_scaling);
    if (s != KILN_OK) return s;
    const char *act = cfg_str(c, a->hf.act);
    bool act_ok = !act;
    for (int k = 0; k < 3 && a->act_ok[k] && !act_ok; k++) act_ok = !strcmp(act, a->act_ok[k]);
    if (!act_ok)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s '%s' is not supported (%s)", c->file, a->hf.act, act, a->act_why);
    if (g->n_head > 0 && head_dim && (g->n_embd % g->n_head || head_dim != g->n_embd / g->n_head))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: head_dim %d is not hidden_size / num_attention_heads = %d", c->file,
                          head_dim, g->n_embd / g->n_head);
    for (int k = 0; k < 2 && a->must[k].key; k++) { /* a key kiln honours with one value only */
        const kiln__hf_must *m = &a->must[k];
        int v = m->want;
        bool b = m->want;
        s = m->is_bool ? cfg_bool(c, m->key, b, &b) : cfg_int(c, m->key, false, m->want, 1, &v);
        if (s != KILN_OK) return s;
        if (m->is_bool ? b != (bool)m->want : v != m->want)
            return m->is_bool ? kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s %s is not supported", c->file, m->key,
                                           b ? "true" : "false")
                              : kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s %d is not supported", c->file, m->key, v);
    }
    s = cfg_bool(c, "tie_word_embeddings", a->tied, &g->tied);
    for (int k = 0; s == KILN_OK && k < 2 && a->bias_keys[k]; k++) {
        bool on = false;
        s = cfg_bool(c, a->bias_keys[k], false, &on);
        g->bias |= on;
    }
    bool use_window = false;
    if (s == KILN_OK && a->hf.window_switch) s = cfg_bool(c, a->hf.window_switch, false, &use_window);
    if (s != KILN_OK) return s;
    /* A sliding window as long as the context or longer is full attention; a shorter
     * one would change the model past it, so the context stops there (exact below). */
    bool sliding = a->hf.window_switch ? use_window : window > 0;
    if (sliding && window > 0 && window < g->block_size) g->block_size = window;
    return KILN_OK;
}

static kiln_status read_config(const char *dir, kiln_gpt_config *g, const kiln__arch **fam)
{
    char file[4200];
    snprintf(file, sizeof file, "%s/config.json", dir);
    hf_config c = {file, NULL};
    if (!kiln__path_exists(file))
        return kiln_error(KILN_ERR_IO, "%s: no such file: not a Hugging Face model folder", file);
    if (!(c.root = kiln__json_load(file, JSON_REJECT_DUPLICATES, NULL, NULL))) return kiln_last_status();
    kiln_status s = KILN_OK;
    char q[48];
    const char *type = cfg_str(&c, "model_type");
    if (!json_is_object(c.root)) s = kiln_error(KILN_ERR_FORMAT, "%s: not a JSON object", file);
    else if (!json_object_get(c.root, "model_type")) s = kiln_error(KILN_ERR_FORMAT, "%s: 'model_type' is missing", file);
    else if (!type)
        s = kiln_error(KILN_ERR_FORMAT, "%s: 'model_type' must be a string, not %s", file,
                       quote(json_object_get(c.root, "model_type"), q, sizeof q));
    else if ((*fam = kiln__arch_by_type(type)))
        s = config_family(&c, *fam, g);
    else {
        char list[256] = "";
        size_t n;
        const kiln__arch *all = kiln__arch_all(&n);
        for (size_t i = 0; i < n; i++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? (i + 1 < n ? ", " : " and ") : "",
                     all[i].name);
        s = kiln_error(KILN_ERR_UNSUPPORTED, "%s: model_type '%s' is not supported (%s are)", file, type, list);
    }
    if (s == KILN_OK && kiln_gpt_config_check(g) != KILN_OK) {
        char why[512]; /* (the message is formatted into the buffer it is read from) */
        snprintf(why, sizeof why, "%s", kiln_last_error());
        s = kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s", file, why);
    }
    json_decref(c.root);
    return s;
}

/* ---- the weights ---- */

#define MAX_FILES 256

typedef struct {
    const char *dir;
    const kiln_gpt_config *cfg;
    kiln_safetensors_t *f[MAX_FILES];
    bool *used[MAX_FILES];
    int n;
    char refused[320]; /* why weight() refused a tensor it found (its type), else empty */
} hf_weights;

static void weights_free(hf_weights *w)
{
    for (int i = 0; i < w->n; i++) {
        kiln_safetensors_free(w->f[i]);
        free(w->used[i]);
    }
}

static kiln_status weights_add(hf_weights *w, const char *name)
{
    if (strchr(name, '/') || !strcmp(name, "..") || w->n == MAX_FILES)
        return kiln_error(KILN_ERR_FORMAT, "%s: shard '%s' is not a file of the folder (or too many shards)", w->dir, name);
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", w->dir, name);
    kiln_status s = kiln_safetensors_load(path, &w->f[w->n]);
    if (s != KILN_OK) return s;
    w->used[w->n] = calloc((size_t)kiln_safetensors_count(w->f[w->n]) + 1, sizeof(bool));
    w->n++;
    return w->used[w->n - 1] ? KILN_OK : kiln_error(KILN_ERR_OOM, "hf: out of memory");
}

static kiln_status check_no_duplicates(const hf_weights *w);

/* model.safetensors, or every shard the index names (each once). */
static kiln_status weights_open(hf_weights *w)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", w->dir);
    struct stat st;
    if (stat(path, &st) != 0) return weights_add(w, "model.safetensors");
    json_t *root = kiln__json_load(path, JSON_REJECT_DUPLICATES, NULL, NULL);
    if (!root) return kiln_last_status();
    json_t *map = json_object_get(root, "weight_map");
    kiln_status s = json_is_object(map) ? KILN_OK : kiln_error(KILN_ERR_FORMAT, "%s: no 'weight_map' object", path);
    const char *key;
    json_t *v;
    /* the distinct shard names, in the order first met */
    const char *names[MAX_FILES];
    int nn = 0;
    json_object_foreach(map, key, v)
    {
        const char *file = json_string_value(v);
        if (s != KILN_OK) break;
        if (!file) {
            s = kiln_error(KILN_ERR_FORMAT, "%s: weight_map['%s'] is not a file name", path, key);
            break;
        }
        bool dup = false;
        for (int i = 0; i < nn && !dup; i++) dup = !strcmp(names[i], file);
        if (!dup && nn == MAX_FILES) s = kiln_error(KILN_ERR_FORMAT, "%s: more than %d shards", path, MAX_FILES);
        else if (!dup) names[nn++] = file;
    }
    for (int i = 0; s == KILN_OK && i < nn; i++) s = weights_add(w, names[i]);
    json_decref(root);
    return s == KILN_OK ? check_no_duplicates(w) : s;
}

/* The tensor called name as the file holds it (in the open scope), marked as used;
 * NULL when no file has it (no error set: the caller says what it needed), or when it
 * is not of a floating-point type (w->refused says so: an integer weight converted by
 * value would be a different model). */
static kiln_tensor_t *weight(hf_weights *w, const char *name)
{
    for (int i = 0; i < w->n; i++)
        for (int j = 0; j < kiln_safetensors_count(w->f[i]); j++)
            if (!strcmp(kiln_safetensors_name(w->f[i], j), name)) {
                w->used[i][j] = true;
                kiln_tensor_t *t = kiln_safetensors_view(w->f[i], name);
                kiln_dtype dt = t ? kiln_tensor_dtype(t) : KILN_DTYPE_F32;
                if (dt != KILN_DTYPE_F32 && dt != KILN_DTYPE_BF16 && dt != KILN_DTYPE_F16 && dt != KILN_DTYPE_F64) {
                    snprintf(w->refused, sizeof w->refused, "tensor '%s' is %s: a weight must be f32, bf16, f16 or f64",
                             name, kiln_dtype_name(dt));
                    return NULL;
                }
                return t;
            }
    return NULL;
}

static int by_name(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* No tensor is stored twice (in two shards): which copy is the model's is not ours to
 * guess. */
static kiln_status check_no_duplicates(const hf_weights *w)
{
    size_t total = 0, k = 0;
    for (int i = 0; i < w->n; i++) total += (size_t)kiln_safetensors_count(w->f[i]);
    const char **names = malloc((total + 1) * sizeof *names);
    if (!names) return kiln_error(KILN_ERR_OOM, "hf: out of memory");
    for (int i = 0; i < w->n; i++)
        for (int j = 0; j < kiln_safetensors_count(w->f[i]); j++) names[k++] = kiln_safetensors_name(w->f[i], j);
    qsort(names, total, sizeof *names, by_name);
    kiln_status s = KILN_OK;
    for (size_t i = 1; s == KILN_OK && i < total; i++)
        if (!strcmp(names[i - 1], names[i]))
            s = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s' is stored twice (in two of the model's files)", w->dir,
                           names[i]);
    free(names);
    return s;
}

/* The Hugging Face name of an entry: its layer filled in, GPT-2's prefix put before all
 * but lm_head. */
static void hf_name(const kiln__name_pair *e, const char *prefix, int layer, char *out, size_t n)
{
    char fmt[160];
    snprintf(fmt, sizeof fmt, "%s%s", strcmp(e->kiln, "lm_head.weight") ? prefix : "", e->other);
    snprintf(out, n, fmt, layer);
}

/* What parameter `name` of the kiln model (of this shape) is made of; need gets the
 * name it looked for. */
static kiln_tensor_t *source(hf_weights *w, const kiln__arch *fam, const char *prefix, const char *name,
                             const int64_t *shape, int nd, char *need, size_t nn)
{
    int i;
    const char *rest;
    const kiln__name_pair *e = kiln__arch_lookup(fam->hf_names, name, &i, &rest);
    if (e) {
        hf_name(e, prefix, i, need, nn);
        kiln_tensor_t *t = weight(w, need);
        /* a bias the model does not have: zero, the same model */
        if (!t && fam->hf_missing_bias_zero && strstr(e->kiln, ".bias"))
            t = kiln_zeros(shape, nd, KILN_DTYPE_F32);
        return t && e->transposed ? kiln_transpose(t, 0, 1) : t;
    }
    if (fam->hf_qkv && i >= 0 && (!strcmp(rest, "attn.qkv.weight") || !strcmp(rest, "attn.qkv.bias"))) {
        const char *what = strstr(rest, "bias") ? "bias" : "weight";
        kiln_tensor_t *p[3];
        const char *qkv = "qkv";
        for (int k = 0; k < 3; k++) {
            char n3[128];
            snprintf(n3, sizeof n3, fam->hf_qkv, i, qkv[k], what);
            p[k] = weight(w, n3);
        }
        char all[128];
        snprintf(all, sizeof all, fam->hf_qkv, i, '*', what);
        char *star = strchr(all, '*');
        if (star) snprintf(need, nn, "%.*s{q,k,v}%s", (int)(star - all), all, star + 1);
        else snprintf(need, nn, "%s", all);
        /* each part its own shape: (heads x head size[, C]), so that a short q and a
         * long k cannot pass as one qkv */
        const kiln_gpt_config *c = w->cfg;
        int64_t hs = c->n_embd / c->n_head, rows[3] = {c->n_head * hs, c->n_kv_head * hs, c->n_kv_head * hs};
        bool bias = !strcmp(what, "bias");
        for (int k = 0; k < 3 && p[0] && p[1] && p[2]; k++)
            if (kiln_tensor_ndim(p[k]) != (bias ? 1 : 2) || kiln_tensor_shape(p[k])[0] != rows[k] ||
                (!bias && kiln_tensor_shape(p[k])[1] != c->n_embd)) {
                char d[96], n3[128];
                snprintf(n3, sizeof n3, fam->hf_qkv, i, qkv[k], what);
                snprintf(need, nn, "%s of %lld rows (it is %s)", n3, (long long)rows[k],
                         kiln_tensor_describe(p[k], d, sizeof d));
                return NULL;
            }
        if (p[0] && p[1] && p[2]) return kiln_cat(p, 3, 0);
        if (!p[0] && !p[1] && !p[2] && !strcmp(what, "bias"))
            return kiln_zeros(shape, nd, KILN_DTYPE_F32);
        return NULL;
    }
    snprintf(need, nn, "(no Hugging Face name for %s)", name);
    return NULL;
}

/* Tensors the files may hold that are not parameters: GPT-2's attention masks and
 * the rotary inverse frequencies some LLaMA checkpoints carry. */
static bool is_buffer(const char *name)
{
    const char *tails[] = {".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq"};
    size_t n = strlen(name);
    for (size_t k = 0; k < sizeof tails / sizeof tails[0]; k++) {
        size_t t = strlen(tails[k]);
        if (n >= t && !strcmp(name + n - t, tails[k])) return true;
    }
    return false;
}

/* Whether the file's tensor `name` holds exactly the model's token embedding. */
static bool same_as_embedding(const kiln_gpt_t *m, const kiln_safetensors_t *f, const char *name)
{
    kiln_tensor_t *e = kiln_gpt_find_param(m, "tok_emb.weight");
    kiln_scope_begin();
    kiln_tensor_t *t = kiln_safetensors_get(f, name);
    if (t && kiln_tensor_dtype(t) != KILN_DTYPE_F32) t = kiln_cast(t, KILN_DTYPE_F32);
    bool same = t && e && kiln_tensor_numel(t) == kiln_tensor_numel(e);
    if (same) {
        kiln_tensor_t *d = kiln_sum(kiln_abs(kiln_sub(kiln_reshape(t, kiln_tensor_shape(e), kiln_tensor_ndim(e)), e)),
                                    NULL, 0, false);
        double v = 1;
        same = d && kiln_tensor_item(d, &v) == KILN_OK && v == 0;
    }
    kiln_scope_end();
    kiln_clear_error();
    return same;
}

/* What kiln_gpt_new_from asks for: parameter `name` of this shape, from the files. A
 * tensor the files hold as it is (f32, kiln's layout) is the file's mapped bytes
 * (kiln_safetensors_view), so that loading copies nothing and serving brings in only
 * the pages it reads; one that must change (a 16-bit file widened, GPT-2's transposed
 * weights, LLaMA's q, k and v stacked) is a new tensor. */
typedef struct {
    hf_weights *w;
    const kiln__arch *fam;
    const char *prefix; /* GPT-2 files saved from GPT2LMHeadModel prefix the body with "transformer." */
} hf_source;

static kiln_tensor_t *hf_param(const char *name, const int64_t *shape, int nd, void *ctx)
{
    hf_source *h = ctx;
    char need[256];
    kiln_tensor_t *src = source(h->w, h->fam, h->prefix, name, shape, nd, need, sizeof need);
    if (!src && *h->w->refused) {
        kiln_error(KILN_ERR_FORMAT, "%s: %s", h->w->dir, h->w->refused);
        return NULL;
    }
    if (!src) {
        if (strstr(need, " rows (it is ")) kiln_error(KILN_ERR_FORMAT, "%s: %s", h->w->dir, need);
        else kiln_error(KILN_ERR_FORMAT, "%s: no tensor %s for kiln's %s", h->w->dir, need, name);
        return NULL;
    }
    if (kiln_tensor_ndim(src) != nd || memcmp(kiln_tensor_shape(src), shape, sizeof(int64_t) * (size_t)nd)) {
        char a[96], b[96];
        snprintf(b, sizeof b, nd == 2 ? "(%lld, %lld)" : "(%lld)", (long long)shape[0], (long long)shape[nd - 1]);
        kiln_error(KILN_ERR_FORMAT, "%s: %s is %s, but the config makes kiln's %s f32 %s", h->w->dir, need,
                   kiln_tensor_describe(src, a, sizeof a), name, b);
        return NULL;
    }
    /* 16-bit and f64 weights widened or narrowed to kiln's f32 here, after the shape
     * check, so that its message names the type the file holds */
    if (kiln_tensor_dtype(src) != KILN_DTYPE_F32) src = kiln_cast(src, KILN_DTYPE_F32);
    return !src || kiln_tensor_is_contiguous(src) ? src : kiln_contiguous(src);
}

/* Every tensor of the files has found its place, or the model is refused. */
static kiln_status check_all_used(const kiln_gpt_t *m, const hf_weights *w)
{
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < w->n; i++)
        for (int j = 0; s == KILN_OK && j < kiln_safetensors_count(w->f[i]); j++) {
            const char *name = kiln_safetensors_name(w->f[i], j);
            /* a tied model's files may hold the head as a copy of the embedding: taken
             * only when it is one */
            bool tied_head = kiln_gpt_get_config(m)->tied && !strcmp(name, "lm_head.weight") &&
                             same_as_embedding(m, w->f[i], name);
            if (!w->used[i][j] && !is_buffer(name) && !tied_head)
                s = kiln_error(KILN_ERR_UNSUPPORTED, "%s: tensor '%s' has no place in kiln's model: not loaded, since "
                               "the model would not be the same without it", w->dir, name);
        }
    return s;
}

kiln_status kiln_hf_load(const char *dir, kiln_gpt_t **model)
{
    if (!dir || !model) return kiln_error(KILN_ERR_ARG, "hf_load: dir and model must not be NULL");
    *model = NULL;
    kiln_gpt_config cfg;
    const kiln__arch *fam = NULL;
    kiln_status s = read_config(dir, &cfg, &fam);
    kiln_gpt_t *m = NULL;
    hf_weights w = {.dir = dir, .cfg = &cfg};
    hf_source h = {&w, fam, ""};
    if (s == KILN_OK) s = weights_open(&w);
    for (int i = 0; s == KILN_OK && fam->hf_body_prefix && i < w.n; i++)
        for (int j = 0; j < kiln_safetensors_count(w.f[i]); j++)
            if (!strncmp(kiln_safetensors_name(w.f[i], j), fam->hf_body_prefix, strlen(fam->hf_body_prefix)))
                h.prefix = fam->hf_body_prefix;
    if (s == KILN_OK) s = kiln_gpt_new_from(&cfg, hf_param, &h, &m);
    if (s == KILN_OK) s = check_all_used(m, &w);
    weights_free(&w);
    if (s != KILN_OK) {
        kiln_gpt_free(m);
        return s;
    }
    *model = m;
    return KILN_OK;
}

/* ---- out ---- */

/* The Hugging Face family a kiln config is exported as, or an error naming what fits none. */
static kiln_status family_of(const kiln_gpt_config *c, const kiln__arch **fam)
{
    if ((*fam = kiln__arch_of(c))) return KILN_OK;
    return kiln_error(KILN_ERR_UNSUPPORTED, "hf export: this model (%s, %s positions, %s MLP, bias %s, %d of %d heads "
                      "for keys%s) is neither a LLaMA (rmsnorm, rope, swiglu), a Qwen3 (a LLaMA with q/k norms) nor a "
                      "GPT-2 (layernorm, learned, gelu, biases, as many key heads as query heads)",
                      c->norm == KILN_NORM_RMSNORM ? "rmsnorm" : "layernorm", c->pos == KILN_POS_ROPE ? "rope" : "learned",
                      c->mlp == KILN_MLP_SWIGLU ? "swiglu" : "gelu", c->bias ? "on" : "off", c->n_kv_head, c->n_head,
                      c->qk_norm ? ", q/k norms" : "");
}

/* config.json of a kiln config as family a writes it (the row's keys). */
static json_t *config_json(const kiln_gpt_config *c, const kiln__arch *a, kiln_dtype dt)
{
    const char *dtype = dt == KILN_DTYPE_BF16 ? "bfloat16" : dt == KILN_DTYPE_F16 ? "float16" : "float32";
    json_t *o = json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:s, s:b, s:s}", "architectures",
                          a->hf_class, "model_type", a->name, a->hf.n_embd, c->n_embd, a->hf.ffn, kiln_gpt_ffn_hidden(c),
                          a->hf.n_layer, c->n_layer, a->hf.n_head, c->n_head, a->hf.context, c->block_size, a->hf.vocab,
                          c->vocab_size, a->hf.eps, c->norm_eps, a->hf.act, a->act_ok[0], "tie_word_embeddings",
                          c->tied, "torch_dtype", dtype);
    bool ok = o != NULL;
    if (ok && a->hf.n_kv_head) ok = !json_object_set_new(o, a->hf.n_kv_head, json_integer(c->n_kv_head));
    if (ok && a->hf.head_dim) ok = !json_object_set_new(o, a->hf.head_dim, json_integer(c->n_embd / c->n_head));
    for (int k = 0; ok && k < 2 && a->bias_keys[k]; k++) ok = !json_object_set_new(o, a->bias_keys[k], json_boolean(c->bias));
    for (int k = 0; ok && k < 3 && a->hf_zero_keys[k]; k++) ok = !json_object_set_new(o, a->hf_zero_keys[k], json_real(0));
    if (ok && a->pos == KILN_POS_ROPE) {
        ok = !json_object_set_new(o, "rope_theta", json_real(c->rope_theta));
        /* the older rope_scaling field, which transformers 4 reads and 5 converts */
        const kiln_rope_scaling *r = &c->rope_scaling;
        json_t *rs = r->kind == KILN_ROPE_SCALING_LINEAR ? json_pack("{s:s, s:f}", "rope_type", "linear", "factor", r->factor)
                   : r->kind == KILN_ROPE_SCALING_LLAMA3
                       ? json_pack("{s:s, s:f, s:f, s:f, s:i}", "rope_type", "llama3", "factor", r->factor,
                                   "low_freq_factor", r->low_freq_factor, "high_freq_factor", r->high_freq_factor,
                                   "original_max_position_embeddings", r->original_context)
                       : NULL;
        if (ok && r->kind != KILN_ROPE_SCALING_NONE) ok = json_object_set_new(o, "rope_scaling", rs) == 0;
    }
    if (!ok) {
        json_decref(o);
        o = NULL;
    }
    return o;
}

/* What an earlier model left in dir that kiln_hf_load would read instead of (or beside)
 * the new files: a shard index and the shards it names, and a tokenizer.json when the
 * new model comes without one. */
static kiln_status remove_stale(const char *dir, bool new_tokenizer)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    json_t *root = kiln__json_load(path, 0, NULL, NULL); /* none, or not one: nothing to follow */
    if (!root) kiln_clear_error();
    const char *key;
    json_t *v;
    json_object_foreach(json_object_get(root, "weight_map"), key, v)
    {
        const char *file = json_string_value(v);
        char shard[4200];
        if (!file || strchr(file, '/') || !strcmp(file, "model.safetensors")) continue;
        snprintf(shard, sizeof shard, "%s/%s", dir, file);
        unlink(shard);
    }
    json_decref(root);
    if (unlink(path) != 0 && errno != ENOENT)
        return kiln_error(KILN_ERR_IO, "cannot remove the old %s: %s", path, strerror(errno));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (!new_tokenizer && unlink(path) != 0 && errno != ENOENT)
        return kiln_error(KILN_ERR_IO, "cannot remove the old %s: %s", path, strerror(errno));
    return KILN_OK;
}

kiln_status kiln_hf_save(const kiln_gpt_t *m, const kiln_tokenizer_t *tok, const char *dir, kiln_dtype dt)
{
    if (!m || !dir) return kiln_error(KILN_ERR_ARG, "hf_save: model and dir must not be NULL");
    if (!kiln_dtype_is_f32_or_half(dt))
        return kiln_error(KILN_ERR_ARG, "hf_save: weights are written as f32, bf16 or f16, not %s", kiln_dtype_name(dt));
    const kiln_gpt_config *c = kiln_gpt_get_config(m);
    const kiln__arch *fam = NULL;
    kiln_status s = kiln__gpt_exportable(c, "hf_save", "transformers' LLaMA, Qwen3 and GPT-2");
    if (s == KILN_OK) s = family_of(c, &fam);
    if (s != KILN_OK) return s;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return kiln_error(KILN_ERR_IO, "cannot make the folder %s: %s", dir, strerror(errno));
    if ((s = remove_stale(dir, tok != NULL)) != KILN_OK) return s;
    int np = kiln_gpt_num_params(m), n = 0, cap = np + 4 * c->n_layer; /* qkv weight and bias: 3 each */
    const char **names = calloc((size_t)cap, sizeof *names);
    char **owned = calloc((size_t)cap, sizeof *owned);
    kiln_tensor_t **ts = calloc((size_t)cap, sizeof *ts);
    if (!names || !owned || !ts) s = kiln_error(KILN_ERR_OOM, "hf_save: out of memory");
    kiln_scope_begin();
    const char *prefix = fam->hf_body_prefix ? fam->hf_body_prefix : "";
    for (int k = 0; s == KILN_OK && k < np; k++) {
        const char *name;
        kiln_tensor_t *p = kiln_gpt_param(m, k, &name);
        int layer;
        const char *rest;
        const kiln__name_pair *e = kiln__arch_lookup(fam->hf_names, name, &layer, &rest);
        int parts = e ? 1 : 3; /* the family's q, k and v apart */
        int64_t hs = c->n_embd / c->n_head, rows[3] = {c->n_head * hs, c->n_kv_head * hs, c->n_kv_head * hs}, at = 0;
        if (!e && (!fam->hf_qkv || layer < 0 || strncmp(rest, "attn.qkv.", 9))) {
            s = kiln_error(KILN_ERR_INTERNAL, "hf_save: no Hugging Face name for %s", name);
            break;
        }
        for (int q = 0; q < parts && s == KILN_OK; q++) {
            char hn[256];
            kiln_tensor_t *t = p;
            if (e) {
                hf_name(e, prefix, layer, hn, sizeof hn);
                if (e->transposed) t = kiln_transpose(p, 0, 1);
            } else {
                snprintf(hn, sizeof hn, fam->hf_qkv, layer, "qkv"[q], strstr(name, "bias") ? "bias" : "weight");
                t = kiln_narrow(p, 0, at, rows[q]);
                at += rows[q];
            }
            t = kiln_cast(t, dt); /* (saved in any layout) */
            if (!t || !(owned[n] = strdup(hn))) {
                s = t ? kiln_error(KILN_ERR_OOM, "hf_save: out of memory") : kiln_last_status();
                break;
            }
            names[n] = owned[n];
            ts[n++] = t;
        }
    }
    char path[4200];
    const char *meta[] = {"format", "pt", NULL};
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (s == KILN_OK) s = kiln_safetensors_save(path, names, ts, n, meta);
    kiln_scope_end();
    json_t *cj = s == KILN_OK ? config_json(c, fam, dt) : NULL;
    /* the start and end of a text, where the tokenizer has them (GPT2Config's default,
     * 50256, is outside most vocabularies) */
    int32_t eot = tok ? kiln_tokenizer_eot(tok) : -1, bos = tok ? kiln_tokenizer_bos(tok) : -1;
    if (cj) {
        json_object_set_new(cj, "bos_token_id", bos >= 0 ? json_integer(bos) : json_null());
        json_object_set_new(cj, "eos_token_id", eot >= 0 ? json_integer(eot) : json_null());
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = s == KILN_OK && cj ? json_dumps(cj, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
    if (s == KILN_OK && !text) s = kiln_error(KILN_ERR_OOM, "hf_save: out of memory for %s", path);
    if (s == KILN_OK) s = kiln__file_write_atomic(path, text, strlen(text), NULL);
    free(text);
    json_decref(cj);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (s == KILN_OK && tok) s = kiln_tokenizer_save(tok, path);
    for (int i = 0; owned && i < n; i++) free(owned[i]);
    free(owned);
    free(names);
    free(ts);
    return s;
}

bool kiln_hf_is_folder(const char *path)
{
    /* (kiln's run folders hold no config.json: the config is in the model file) */
    char file[4200];
    struct stat st;
    if (!path || stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) return false;
    snprintf(file, sizeof file, "%s/config.json", path);
    if (!kiln__path_exists(file)) return false;
    /* A config.json of Hugging Face's names a model_type (one of `kiln train`'s option
     * files does not). One that cannot be read or parsed is taken as Hugging Face's too,
     * so that loading it reports what is wrong with it rather than a missing checkpoint
     * (an option file beside a kiln checkpoint is never a broken one that matters). */
    json_t *root = kiln__json_load(file, 0, NULL, NULL);
    bool hf = !root || !json_is_object(root) || json_object_get(root, "model_type") ||
              json_object_get(root, "architectures");
    json_decref(root);
    kiln_clear_error();
    return hf;
}
