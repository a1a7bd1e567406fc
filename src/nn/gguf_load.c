/* A GGUF file as a kiln model (kiln_gguf_load, kiln/io.h): the family is the row of
 * src/nn/arch.c whose gguf_arch is the file's general.architecture, the config comes
 * from the architecture's keys, each parameter from the tensor the row names (any type
 * kiln reads, turned into f32: kiln/gguf.h), and the tokenizer and chat template from the
 * file's metadata. What the file holds that kiln's model would not compute the same (a
 * tensor with no place, another rope, a head size of its own, experts) is refused by name.
 *
 * llama.cpp's llama architecture rotates adjacent pairs where kiln rotates the two halves
 * of a head, so its converter reorders q and k rows within each head (gguf.c does the
 * same on export: kiln row (half h, i) is the file's row 2 i + h); here the order is
 * undone. Its qwen2 and qwen3 rotate halves, as kiln does. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/gguf.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/ops.h"
#include "kiln/tokenizer.h"
#include "nn/arch.h"

typedef struct {
    const kiln_gguf_t *g;
    const kiln__arch *fam;
    const kiln_gpt_config *cfg;
    const char *path;
    bool *used; /* per tensor of the file */
} source;

static const kiln__arch *family_of(const char *arch)
{
    size_t n;
    const kiln__arch *all = kiln__arch_all(&n);
    for (size_t i = 0; i < n; i++)
        if (all[i].gguf_arch && !strcmp(all[i].gguf_arch, arch)) return &all[i];
    return NULL;
}

/* ARCH.suffix as an integer: *out kept when the key is absent and !need. */
static kiln_status arch_int(const kiln_gguf_t *g, const char *arch, const char *suffix, bool need, int64_t lo,
                            int64_t hi, int64_t *out)
{
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, suffix);
    if (kiln_gguf_find_key(g, k) < 0) {
        if (!need) return KILN_OK;
        return kiln_error(KILN_ERR_FORMAT, "%s: the file has no key '%s'", kiln_gguf_path(g), k);
    }
    int64_t v;
    kiln_status s = kiln_gguf_get_int(g, k, &v);
    if (s != KILN_OK) return s;
    if (v < lo || v > hi)
        return kiln_error(KILN_ERR_FORMAT, "%s: %s is %lld, outside %lld to %lld", kiln_gguf_path(g), k, (long long)v,
                          (long long)lo, (long long)hi);
    *out = v;
    return KILN_OK;
}

static kiln_status arch_real(const kiln_gguf_t *g, const char *arch, const char *suffix, bool need, double *out)
{
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, suffix);
    if (kiln_gguf_find_key(g, k) < 0)
        return need ? kiln_error(KILN_ERR_FORMAT, "%s: the file has no key '%s'", kiln_gguf_path(g), k) : KILN_OK;
    kiln_status s = kiln_gguf_get_real(g, k, out);
    if (s == KILN_OK && !(isfinite(*out) && *out > 0))
        s = kiln_error(KILN_ERR_FORMAT, "%s: %s is %g, not a number above 0", kiln_gguf_path(g), k, *out);
    return s;
}

/* A key whose presence means a model kiln's would not compute the same. */
static kiln_status refuse_key(const kiln_gguf_t *g, const char *arch, const char *suffix, const char *what)
{
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, suffix);
    if (kiln_gguf_find_key(g, k) < 0) return KILN_OK;
    return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s (%s) is not read yet", kiln_gguf_path(g), what, k);
}

/* Whether the frequencies of sc give exactly the divisors div (plain / scaled, within
 * f32 rounding). */
static bool gives(const kiln_gpt_config *c, int64_t D, const kiln_rope_scaling *sc, const float *plain, const float *div,
                  float *scaled)
{
    if (kiln_rope_frequencies(c->rope_theta, D, sc, scaled) != KILN_OK) {
        kiln_clear_error();
        return false;
    }
    for (int64_t i = 0; i < D / 2; i++)
        if (!(fabsf(plain[i] / scaled[i] - div[i]) <= 2e-5f * fabsf(div[i]))) return false;
    return true;
}

/* LLaMA 3.1's rope scaling, which llama.cpp stores as rope_freqs.weight, each frequency's
 * divisor: frequencies below a first threshold are divided by factor, those above a
 * second are kept, those between blend linearly in the frequency. The published settings
 * are tried first (3.1's and 3.2's, bit for bit); else the settings are read off the
 * divisors: factor is the largest, the thresholds come from the blended ones (or lie
 * between the divided and the kept), and original_context is fixed at 8192, since only
 * its ratios to the two factors count. Those that do not give the divisors back are
 * refused. */
static kiln_status rope_freqs(const kiln_gguf_t *g, int64_t t, kiln_gpt_config *c)
{
    kiln_gguf_tensor info;
    kiln_gguf_tensor_at(g, t, &info);
    int64_t D = c->n_embd / c->n_head, h = D / 2;
    if (info.elements != h)
        return kiln_error(KILN_ERR_FORMAT, "%s: rope_freqs.weight has %lld values, not the %lld of a head's half",
                          kiln_gguf_path(g), (long long)info.elements, (long long)h);
    float *div = malloc(sizeof(float) * (size_t)(3 * h));
    if (!div) return kiln_error(KILN_ERR_OOM, "%s: out of memory", kiln_gguf_path(g));
    float *plain = div + h, *scaled = div + 2 * h;
    kiln_status s = kiln_gguf_read_f32(g, t, div, h);
    if (s == KILN_OK) s = kiln_rope_frequencies(c->rope_theta, D, NULL, plain);
    kiln_rope_scaling try[3] = {
        {.kind = KILN_ROPE_SCALING_LLAMA3, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4, .original_context = 8192},
        {.kind = KILN_ROPE_SCALING_LLAMA3, .factor = 32, .low_freq_factor = 1, .high_freq_factor = 4, .original_context = 8192},
        {.kind = KILN_ROPE_SCALING_LLAMA3, .original_context = 8192},
    };
    /* the third, read off the divisors (plain[] falls with i: divided first, then blended, then kept) */
    double factor = 1, f_div = 0, f_keep = 0, fa = 0, sa = 0, fb = 0, sb = 0;
    int n_mid = 0;
    for (int64_t i = 0; s == KILN_OK && i < h; i++) factor = div[i] > factor ? div[i] : factor;
    for (int64_t i = 0; s == KILN_OK && i < h; i++) {
        double f = plain[i], d = div[i];
        if (fabs(d - factor) <= 1e-5 * factor) f_div = f_div ? fmax(f_div, f) : f;
        else if (fabs(d - 1) <= 1e-5) f_keep = f_keep ? fmin(f_keep, f) : f;
        else {
            double sm = (1 / d - 1 / factor) / (1 - 1 / factor); /* the blend, 0 to 1 */
            if (!n_mid++) fa = f, sa = sm;
            fb = f, sb = sm;
        }
    }
    double t1 = 0, t2 = 0; /* the thresholds, in frequency */
    if (n_mid >= 2 && fa != fb) {
        double slope = (sb - sa) / (fb - fa);
        t1 = fa - sa / slope, t2 = t1 + 1 / slope;
    } else if (n_mid == 0 && f_div > 0 && f_keep > f_div) {
        t1 = f_div + (f_keep - f_div) / 3, t2 = f_div + 2 * (f_keep - f_div) / 3;
    } else if (n_mid == 1 && sa > 0) { /* one blended: a line through it whose ends fall among the others */
        static const double at[] = {0.5, 0.75, 0.9, 0.25, 0.1};
        for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
            t1 = f_div + (fa - f_div) * at[k], t2 = t1 + (fa - t1) / sa;
            if (!f_keep || t2 < f_keep) break;
        }
    }
    try[2].factor = factor;
    try[2].low_freq_factor = 8192 * t1 / (2 * M_PI);
    try[2].high_freq_factor = 8192 * t2 / (2 * M_PI);
    bool found = false;
    for (int k = 0; s == KILN_OK && !found && k < 3; k++)
        if ((found = gives(c, D, &try[k], plain, div, scaled))) c->rope_scaling = try[k];
    free(div);
    if (s == KILN_OK && !found)
        s = kiln_error(KILN_ERR_UNSUPPORTED, "%s: rope_freqs.weight holds divisors that are no LLaMA 3.1-style rope "
                       "scaling", kiln_gguf_path(g));
    return s;
}

static kiln_status read_config(const kiln_gguf_t *g, const kiln__arch *fam, kiln_gpt_config *c)
{
    const char *arch = fam->gguf_arch;
    kiln__arch_config(fam, c);
    int64_t n_layer = 0, n_embd = 0, n_head = 0, n_kv = -1, ffn = 0, ctx = 0, key_len = -1, rope_dim = -1;
    kiln_status s = arch_int(g, arch, "block_count", true, 1, 1024, &n_layer);
    if (s == KILN_OK) s = arch_int(g, arch, "embedding_length", true, 1, 1 << 20, &n_embd);
    if (s == KILN_OK) s = arch_int(g, arch, "attention.head_count", true, 1, 1 << 16, &n_head);
    if (s == KILN_OK) s = arch_int(g, arch, "attention.head_count_kv", false, 1, 1 << 16, &n_kv);
    if (s == KILN_OK) s = arch_int(g, arch, "feed_forward_length", true, 1, 1 << 24, &ffn);
    if (s == KILN_OK) s = arch_int(g, arch, "context_length", true, 1, 1 << 24, &ctx);
    if (s == KILN_OK) s = arch_int(g, arch, "attention.key_length", false, 1, 1 << 16, &key_len);
    if (s == KILN_OK) s = arch_int(g, arch, "rope.dimension_count", false, 1, 1 << 16, &rope_dim);
    if (s == KILN_OK) s = refuse_key(g, arch, "expert_count", "a mixture-of-experts GGUF model");
    if (s == KILN_OK) s = refuse_key(g, arch, "attention.sliding_window", "a sliding window");
    if (s != KILN_OK) return s;
    c->n_layer = (int)n_layer, c->n_embd = (int)n_embd, c->n_head = (int)n_head;
    c->n_kv_head = (int)(n_kv > 0 ? n_kv : n_head);
    c->ffn_hidden = (int)ffn, c->block_size = (int)ctx;
    if (n_embd % n_head)
        return kiln_error(KILN_ERR_FORMAT, "%s: %lld heads do not divide the width %lld", kiln_gguf_path(g),
                          (long long)n_head, (long long)n_embd);
    int64_t hs = n_embd / n_head;
    if (key_len > 0 && key_len != hs)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s.attention.key_length is %lld, not the width over the heads "
                          "(%lld): kiln has no head size of its own yet", kiln_gguf_path(g), arch, (long long)key_len,
                          (long long)hs);
    if (c->pos == KILN_POS_ROPE && rope_dim > 0 && rope_dim != hs)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s.rope.dimension_count is %lld: rope over part of a head (of %lld) "
                          "is not read yet", kiln_gguf_path(g), arch, (long long)rope_dim, (long long)hs);
    char k[128];
    if ((s = arch_real(g, arch, fam->gguf_eps, true, &c->norm_eps)) != KILN_OK) return s;
    if (c->pos == KILN_POS_ROPE) {
        c->rope_theta = 10000.0;
        if ((s = arch_real(g, arch, "rope.freq_base", false, &c->rope_theta)) != KILN_OK) return s;
        snprintf(k, sizeof k, "%s.rope.scaling.type", arch);
        const char *type = "none";
        if (kiln_gguf_find_key(g, k) >= 0 && (s = kiln_gguf_get_str(g, k, &type)) != KILN_OK) return s;
        if (!strcmp(type, "linear")) {
            c->rope_scaling.kind = KILN_ROPE_SCALING_LINEAR;
            if ((s = arch_real(g, arch, "rope.scaling.factor", true, &c->rope_scaling.factor)) != KILN_OK) return s;
        } else if (strcmp(type, "none")) {
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s is '%s': kiln reads no rope scaling but linear and LLaMA "
                              "3.1's", kiln_gguf_path(g), k, type);
        }
        int64_t f = kiln_gguf_find_tensor(g, "rope_freqs.weight");
        if (f >= 0 && (!fam->gguf_rope_freqs || (s = rope_freqs(g, f, c)) != KILN_OK))
            return s != KILN_OK ? s : kiln_error(KILN_ERR_UNSUPPORTED, "%s: rope_freqs.weight in a %s file", kiln_gguf_path(g), arch);
    }
    int64_t emb = kiln_gguf_find_tensor(g, "token_embd.weight");
    kiln_gguf_tensor t;
    if (emb < 0) return kiln_error(KILN_ERR_FORMAT, "%s: no tensor token_embd.weight", kiln_gguf_path(g));
    kiln_gguf_tensor_at(g, emb, &t);
    if (t.ndim != 2 || t.shape[1] != n_embd)
        return kiln_error(KILN_ERR_FORMAT, "%s: token_embd.weight is not (vocabulary, %lld)", kiln_gguf_path(g),
                          (long long)n_embd);
    c->vocab_size = (int)t.shape[0];
    c->tied = kiln_gguf_find_tensor(g, "output.weight") < 0;
    return kiln_gpt_config_check(c);
}

/* ---- the parameters ---- */

/* The file's tensor for kiln's parameter `name` (q, k or v of a fused qkv: part q), into
 * gname; -1 when the row names none. */
static int64_t tensor_for(const source *src, const char *name, int part, char *gname, size_t n)
{
    int layer;
    const char *rest;
    const kiln__name_pair *e = kiln__arch_lookup(src->fam->gguf_names, name, &layer, &rest);
    if (part >= 0) {
        bool bias = !strcmp(rest, "attn.qkv.bias");
        char fmt[96];
        snprintf(fmt, sizeof fmt, "%s", src->fam->gguf_qkv);
        char *w = strstr(fmt, ".weight");
        if (bias && w) snprintf(w, sizeof fmt - (size_t)(w - fmt), ".bias");
        snprintf(gname, n, fmt, layer, "qkv"[part]);
    } else if (e) {
        snprintf(gname, n, e->other, layer);
    } else {
        snprintf(gname, n, "(none)");
        return -1;
    }
    return kiln_gguf_find_tensor(src->g, gname);
}

/* Rows [at, at + rows) of p (cols wide) from tensor i, q/k rows put back in halves order
 * (heads > 0). */
static kiln_status fill_rows(const source *src, int64_t i, const char *gname, float *p, int64_t rows, int64_t cols,
                             int heads)
{
    kiln_gguf_tensor t;
    kiln_gguf_tensor_at(src->g, i, &t);
    int64_t want_rows = cols ? rows : 1;
    bool vector = cols == 0;
    if ((vector && (t.ndim != 1 || t.shape[0] != rows)) ||
        (!vector && (t.ndim != 2 || t.shape[0] != want_rows || t.shape[1] != cols)))
        return kiln_error(KILN_ERR_FORMAT, "%s: %s is %lldx%lld, where kiln's config makes it %lldx%lld", src->path, gname,
                          (long long)t.shape[0], (long long)(t.ndim > 1 ? t.shape[1] : 1), (long long)rows,
                          (long long)(vector ? 1 : cols));
    src->used[i] = true;
    if (heads <= 0) return kiln_gguf_read_f32(src->g, i, p, t.elements);
    float *tmp = malloc(sizeof(float) * (size_t)t.elements);
    if (!tmp) return kiln_error(KILN_ERR_OOM, "%s: out of memory reading %s", src->path, gname);
    kiln_status s = kiln_gguf_read_f32(src->g, i, tmp, t.elements);
    int64_t hs = rows / heads, w = vector ? 1 : cols;
    for (int64_t h = 0; s == KILN_OK && h < heads; h++)
        for (int64_t r = 0; r < hs; r++) {
            int64_t from = h * hs + (r % (hs / 2)) * 2 + r / (hs / 2);
            memcpy(p + (h * hs + r) * w, tmp + from * w, sizeof(float) * (size_t)w);
        }
    free(tmp);
    return s;
}

static kiln_tensor_t *gguf_param(const char *name, const int64_t *shape, int nd, void *ctx)
{
    source *src = ctx;
    const kiln_gpt_config *c = src->cfg;
    int64_t rows = shape[0], cols = nd == 2 ? shape[1] : 0;
    float *p = calloc((size_t)(rows * (cols ? cols : 1)), sizeof(float)); /* (a bias the file lacks stays zero) */
    if (!p) {
        kiln_error(KILN_ERR_OOM, "%s: out of memory for %s", src->path, name);
        return NULL;
    }
    char gname[128];
    kiln_status s = KILN_OK;
    int layer;
    const char *rest;
    kiln__arch_lookup(src->fam->gguf_names, name, &layer, &rest);
    bool qkv = src->fam->gguf_qkv && layer >= 0 && (!strcmp(rest, "attn.qkv.weight") || !strcmp(rest, "attn.qkv.bias"));
    bool bias = strstr(rest, ".bias") != NULL;
    if (qkv) {
        int64_t hs = c->n_embd / c->n_head, part_rows[3] = {c->n_head * hs, c->n_kv_head * hs, c->n_kv_head * hs}, at = 0;
        int heads[3] = {src->fam->gguf_rope_pairs ? c->n_head : 0, src->fam->gguf_rope_pairs ? c->n_kv_head : 0, 0};
        for (int q = 0; q < 3 && s == KILN_OK; q++) {
            int64_t i = tensor_for(src, name, q, gname, sizeof gname);
            if (i >= 0) s = fill_rows(src, i, gname, p + at * (cols ? cols : 1), part_rows[q], cols, heads[q]);
            else if (!bias) s = kiln_error(KILN_ERR_FORMAT, "%s: no tensor %s for kiln's %s", src->path, gname, name);
            at += part_rows[q];
        }
    } else {
        int64_t i = tensor_for(src, name, -1, gname, sizeof gname);
        if (i >= 0) s = fill_rows(src, i, gname, p, rows, cols, 0);
        else if (!bias) s = kiln_error(KILN_ERR_FORMAT, "%s: no tensor %s for kiln's %s", src->path, gname, name);
    }
    /* the filled buffer becomes the tensor, not a copy of it (freed with its last reference) */
    kiln_tensor_t *out = s == KILN_OK ? kiln_tensor_wrap(p, shape, nd, KILN_DTYPE_F32, free, p) : NULL;
    if (!out) free(p);
    return out;
}

kiln_status kiln_gguf_load(const char *path, kiln_gpt_t **model, kiln_tokenizer_t **tok, char **chat_template)
{
    if (!path || !model) return kiln_error(KILN_ERR_ARG, "kiln_gguf_load: path and model must not be NULL");
    *model = NULL;
    if (tok) *tok = NULL;
    if (chat_template) *chat_template = NULL;
    kiln_gguf_t *g = NULL;
    kiln_status s = kiln_gguf_open(path, &g);
    const char *arch = NULL;
    if (s == KILN_OK) s = kiln_gguf_get_str(g, "general.architecture", &arch);
    const kiln__arch *fam = s == KILN_OK ? family_of(arch) : NULL;
    if (s == KILN_OK && !fam) {
        size_t n;
        const kiln__arch *all = kiln__arch_all(&n);
        char known[256] = "";
        for (size_t i = 0, o = 0; i < n; i++)
            if (all[i].gguf_arch) o += (size_t)snprintf(known + o, sizeof known - o, "%s%s", o ? ", " : "", all[i].gguf_arch);
        s = kiln_error(KILN_ERR_UNSUPPORTED, "%s: general.architecture '%s' is not one kiln runs (%s are)", path, arch,
                       known);
    }
    kiln_gpt_config cfg;
    if (s == KILN_OK) s = read_config(g, fam, &cfg);
    kiln_tokenizer_t *t = NULL;
    if (s == KILN_OK && tok) s = kiln_gguf_tokenizer(g, &t);
    if (s == KILN_OK && t && kiln_tokenizer_vocab_size(t) != cfg.vocab_size)
        s = kiln_error(KILN_ERR_FORMAT, "%s: token_embd.weight has %d rows but the tokenizer %d tokens", path,
                       cfg.vocab_size, kiln_tokenizer_vocab_size(t));
    char *tmpl = NULL;
    if (s == KILN_OK && chat_template && kiln_gguf_find_key(g, "tokenizer.chat_template") >= 0) {
        const char *ct;
        if ((s = kiln_gguf_get_str(g, "tokenizer.chat_template", &ct)) == KILN_OK && !(tmpl = strdup(ct)))
            s = kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
    }
    kiln_gpt_t *m = NULL;
    source src = {.g = g, .fam = fam, .cfg = &cfg, .path = path};
    if (s == KILN_OK && !(src.used = calloc((size_t)kiln_gguf_n_tensors(g) + 1, sizeof *src.used)))
        s = kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
    if (s == KILN_OK) {
        kiln_scope_begin();
        s = kiln_gpt_new_from(&cfg, gguf_param, &src, &m);
        kiln_scope_end();
    }
    for (int64_t i = 0; s == KILN_OK && i < kiln_gguf_n_tensors(g); i++) {
        kiln_gguf_tensor info;
        kiln_gguf_tensor_at(g, i, &info);
        if (!src.used[i] && strcmp(info.name, "rope_freqs.weight"))
            s = kiln_error(KILN_ERR_UNSUPPORTED, "%s: tensor '%s' has no place in kiln's %s model: not loaded, since the "
                           "model would not be the same without it", path, info.name, fam->title);
    }
    free(src.used);
    kiln_gguf_free(g);
    if (s != KILN_OK) {
        kiln_gpt_free(m);
        kiln_tokenizer_free(t);
        free(tmpl);
        return s;
    }
    *model = m;
    if (tok) *tok = t;
    if (chat_template) *chat_template = tmpl;
    return KILN_OK;
}
