/* kiln models written as GGUF files that llama.cpp loads (the architecture, keys and
 * tensor names of the model's family, a row of src/nn/arch.c: "llama" for rmsnorm, rope,
 * swiglu; "qwen3" for those with q/k norms; "gpt2" for layernorm, learned positions, gelu,
 * biases),
 * with the weights in f32, f16, bf16 or q8_0 and the tokenizer as llama.cpp's
 * byte-level BPE ("gpt2") vocabulary.
 *
 * The layout (GGUF version 3, little-endian): the header (magic "GGUF", version,
 * tensor count, key/value count), the key/value pairs (a string key, a type, a value;
 * arrays carry their element type and count), one info per tensor (name, dims with the
 * innermost first, type, offset into the data), padding to the alignment (32), then
 * the data, each tensor aligned. llama.cpp's llama rope rotates adjacent pairs where
 * kiln's (as Hugging Face LLaMA's) rotates the two halves of a head, so for it q and k
 * rows are reordered within each head, as llama.cpp's own converter does for HF
 * checkpoints: row (half h, i) of a head goes to 2 i + h (a row's gguf_rope_pairs; its
 * qwen3 rotates halves, as kiln does). q8_0 stores blocks of 32 values as an f16
 * scale d = max|x| / 127 and 32 signed bytes round(x / d). */
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/ops.h"
#include "kiln/tokenizer.h"
#include "core/file.h"
#include "core/quant.h"
#include "io/gguf_pre.h"
#include "nn/arch.h"
#include "nn/names.h"

enum { G_U32 = 4, G_I32 = 5, G_F32 = 6, G_BOOL = 7, G_STR = 8, G_ARR = 9 };  /* GGUF value types */
enum { T_F32 = KILN__GGML_F32 }; /* ggml tensor types: core/quant.h */
#define ALIGN 32

/* A growing byte buffer; `failed` once memory ran out. */
typedef struct {
    unsigned char *p;
    size_t n, cap;
    bool failed;
} buf;

static void put(buf *b, const void *src, size_t n)
{
    if (b->failed) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        unsigned char *q = realloc(b->p, cap);
        if (!q) {
            b->failed = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void u64(buf *b, uint64_t v) { put(b, &v, 8); }
static void str(buf *b, const char *s, size_t n)
{
    u64(b, n);
    put(b, s, n);
}
static void key(buf *b, const char *k, uint32_t type)
{
    str(b, k, strlen(k));
    u32(b, type);
}
static void kv_u32(buf *b, int *n, const char *k, uint32_t v) { key(b, k, G_U32), u32(b, v), (*n)++; }
static void kv_f32(buf *b, int *n, const char *k, float v) { key(b, k, G_F32), put(b, &v, 4), (*n)++; }
static void kv_str(buf *b, int *n, const char *k, const char *v) { key(b, k, G_STR), str(b, v, strlen(v)), (*n)++; }
static void kv_bool(buf *b, int *n, const char *k, bool v)
{
    uint8_t x = v;
    key(b, k, G_BOOL), put(b, &x, 1), (*n)++;
}

/* llama.cpp's name for a tokenizer.json's pre-tokenizer (tokenizer.ggml.pre): GPT-2's
 * ByteLevel regex, or a Split pattern the GGUF reader knows (io/gguf_pre.h); NULL for
 * another, which llama.cpp would split differently. */
static const char *pre_name(json_t *root)
{
    json_t *pre = json_object_get(root, "pre_tokenizer");
    const char *type = json_string_value(json_object_get(pre, "type"));
    if (type && !strcmp(type, "ByteLevel")) return kiln__gguf_pre_name(NULL);
    json_t *split = json_array_get(json_object_get(pre, "pretokenizers"), 0);
    const char *re = json_string_value(json_object_get(json_object_get(split, "pattern"), "Regex"));
    return re ? kiln__gguf_pre_name(re) : NULL;
}

/* Whether a tokenizer.json is SentencePiece-style (LLaMA-2, Mistral: Metaspace, or the
 * older Prepend normalizer, over text; byte fallback): llama.cpp's "llama" vocabulary.
 * *prefix: whether it puts a "▁" before a text (llama.cpp's add_space_prefix). */
static bool sentencepiece_style(json_t *root, bool *prefix)
{
    json_t *pre = json_object_get(root, "pre_tokenizer"), *norm = json_object_get(root, "normalizer");
    if (json_is_array(json_object_get(pre, "pretokenizers"))) pre = json_array_get(json_object_get(pre, "pretokenizers"), 0);
    const char *type = json_string_value(json_object_get(pre, "type"));
    if (type && !strcmp(type, "Metaspace")) {
        const char *scheme = json_string_value(json_object_get(pre, "prepend_scheme"));
        *prefix = !scheme || strcmp(scheme, "never");
        return true;
    }
    json_t *steps = json_is_array(json_object_get(norm, "normalizers")) ? json_object_get(norm, "normalizers") : NULL;
    size_t i;
    json_t *v;
    const char *one = json_string_value(json_object_get(norm, "type"));
    *prefix = one && !strcmp(one, "Prepend"); /* a lone step, or a Sequence holding one */
    json_array_foreach(steps, i, v)
        if (json_string_value(json_object_get(v, "type")) && !strcmp(json_string_value(json_object_get(v, "type")), "Prepend"))
            *prefix = true;
    return *prefix || json_is_true(json_object_get(json_object_get(root, "model"), "byte_fallback"));
}

/* A SentencePiece-style tokenizer's token scores as llama.cpp's "llama" vocabulary
 * ranks merges: llama.cpp joins the adjacent pair whose joined token scores highest, so
 * a token made by merge r scores -r (the earlier merge first, as BPE applies them), and
 * a token no merge makes scores below every merge. (llama.cpp joins any pair whose
 * text is a token, BPE only the pairs listed: they agree where every split of a merged
 * token into two tokens is itself a merge, as in LLaMA-2's and Mistral's files.) */
static float *merge_scores(json_t *vocab, json_t *merges, int V)
{
    float *sc = malloc(sizeof *sc * (size_t)(V > 0 ? V : 1));
    size_t nm = json_array_size(merges), i;
    for (int id = 0; sc && id < V; id++) sc[id] = -(float)(nm + (size_t)id) - 1;
    json_t *m;
    char joined[1024];
    json_array_foreach(merges, i, m)
    {
        if (!sc) break;
        const char *a = json_string_value(json_array_get(m, 0)), *c = json_string_value(json_array_get(m, 1));
        const char *one = json_string_value(m), *sp = one ? strchr(one, ' ') : NULL;
        int w = one && sp ? snprintf(joined, sizeof joined, "%.*s%s", (int)(sp - one), one, sp + 1)
              : a && c    ? snprintf(joined, sizeof joined, "%s%s", a, c)
                          : -1;
        if (w < 0 || (size_t)w >= sizeof joined) continue; /* no such pair, or a token longer than any llama.cpp reads */
        json_int_t id = json_integer_value(json_object_get(vocab, joined));
        if (json_object_get(vocab, joined) && id >= 0 && id < V && sc[id] < -(float)nm) sc[id] = -(float)i;
    }
    return sc;
}

/* The tokenizer as llama.cpp's vocabulary: its tokenizer.json (the public form of its
 * vocabulary) read for the token strings in id order, and the merges and pre-tokenizer
 * (byte-level BPE, llama.cpp's "gpt2") or the scores and space prefix
 * (SentencePiece-style, its "llama"). */
static kiln_status put_tokenizer(buf *b, int *n, const kiln_tokenizer_t *tok)
{
    char *text = kiln_tokenizer_to_json(tok);
    if (!text) return kiln_last_status();
    json_error_t err;
    json_t *root = json_loads(text, 0, &err);
    free(text);
    kiln_status s = KILN_OK;
    bool prefix = false, spm = root && sentencepiece_style(root, &prefix);
    const char *pre = root && !spm ? pre_name(root) : NULL;
    if (root && !spm && !pre)
        s = kiln_error(KILN_ERR_UNSUPPORTED, "gguf: the tokenizer's pre-tokenizer pattern is none that "
                       "llama.cpp names (GPT-2's, LLaMA-3's or Qwen2's)");
    json_t *model = json_object_get(root, "model"), *vocab = json_object_get(model, "vocab");
    json_t *merges = json_object_get(model, "merges"), *added = json_object_get(root, "added_tokens");
    int V = kiln_tokenizer_vocab_size(tok);
    const char **tokens = calloc((size_t)V, sizeof *tokens);
    int32_t *types = calloc((size_t)V, sizeof *types);
    if (s != KILN_OK) {
    } else if (!root || !json_is_object(vocab) || !tokens || !types) {
        s = kiln_error(KILN_ERR_INTERNAL, "gguf: the tokenizer's vocabulary could not be read back");
    } else {
        const char *k;
        json_t *v;
        /* types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte */
        const char *unk = json_string_value(json_object_get(model, "unk_token"));
        json_object_foreach(vocab, k, v)
        {
            json_int_t id = json_integer_value(v);
            /* a byte token is exactly <0xHH>, two hex digits (sscanf's %2X also took a
             * space or a sign) */
            bool byte = spm && strlen(k) == 6 && !strncmp(k, "<0x", 3) && isxdigit((unsigned char)k[3]) &&
                        isxdigit((unsigned char)k[4]) && k[5] == '>';
            if (id >= 0 && id < V) tokens[id] = k, types[id] = byte ? 6 : spm && unk && !strcmp(k, unk) ? 2 : 1;
        }
        size_t i;
        json_array_foreach(added, i, v)
        {
            json_int_t id = json_integer_value(json_object_get(v, "id"));
            const char *c = json_string_value(json_object_get(v, "content"));
            if (id >= 0 && id < V && c && types[id] != 2)
                tokens[id] = c, types[id] = json_is_true(json_object_get(v, "special")) ? 3 : spm ? 4 : 1;
        }
        for (int id = 0; id < V && s == KILN_OK; id++)
            if (!tokens[id]) s = kiln_error(KILN_ERR_INTERNAL, "gguf: token %d has no string in the vocabulary", id);
    }
    float *scores = s == KILN_OK && spm ? merge_scores(vocab, merges, V) : NULL;
    if (s == KILN_OK && spm && !scores) s = kiln_error(KILN_ERR_OOM, "gguf: out of memory");
    if (s == KILN_OK) {
        kv_str(b, n, "tokenizer.ggml.model", spm ? "llama" : "gpt2");
        if (!spm) kv_str(b, n, "tokenizer.ggml.pre", pre);
        key(b, "tokenizer.ggml.tokens", G_ARR), u32(b, G_STR), u64(b, (uint64_t)V), (*n)++;
        for (int id = 0; id < V; id++) str(b, tokens[id], strlen(tokens[id]));
        key(b, "tokenizer.ggml.token_type", G_ARR), u32(b, G_I32), u64(b, (uint64_t)V), (*n)++;
        put(b, types, sizeof(int32_t) * (size_t)V);
        if (spm) {
            key(b, "tokenizer.ggml.scores", G_ARR), u32(b, G_F32), u64(b, (uint64_t)V), (*n)++;
            put(b, scores, sizeof(float) * (size_t)V);
            kv_bool(b, n, "tokenizer.ggml.add_space_prefix", prefix);
            for (int id = 0; id < V; id++)
                if (types[id] == 2) kv_u32(b, n, "tokenizer.ggml.unknown_token_id", (uint32_t)id);
        } else {
            size_t nm = json_array_size(merges), i;
            json_t *v;
            key(b, "tokenizer.ggml.merges", G_ARR), u32(b, G_STR), u64(b, nm), (*n)++;
            json_array_foreach(merges, i, v)
            {
                const char *m = json_string_value(v);
                str(b, m ? m : "", m ? strlen(m) : 0);
            }
        }
        int32_t eot = kiln_tokenizer_eot(tok), bos = kiln_tokenizer_bos(tok);
        if (bos >= 0) kv_u32(b, n, "tokenizer.ggml.bos_token_id", (uint32_t)bos);
        if (eot >= 0) kv_u32(b, n, "tokenizer.ggml.eos_token_id", (uint32_t)eot);
        kv_bool(b, n, "tokenizer.ggml.add_bos_token", kiln_tokenizer_adds_bos(tok));
    }
    free(scores);
    free(tokens);
    free(types);
    json_decref(root);
    return s;
}

/* One tensor: its GGUF name, its data in the file's type, and its dims (innermost first). */
typedef struct {
    char name[64];
    uint32_t type;
    int ndim;
    uint64_t ne[2];
    void *data;
    size_t bytes;
} gtensor;

/* A kiln parameter (rows x cols, or a vector) as a GGUF tensor of type `type` (vectors
 * always f32, as llama.cpp's norms are); perm: the rows reordered for llama.cpp's rope,
 * heads of hs rows. */
static kiln_status make_tensor(gtensor *g, const char *name, kiln_tensor_t *p, uint32_t type, int heads)
{
    if (!p) return kiln_last_status(); /* the view of qkv it was given could not be made */
    snprintf(g->name, sizeof g->name, "%s", name);
    int nd = kiln_tensor_ndim(p);
    const int64_t *sh = kiln_tensor_shape(p);
    int64_t rows = nd == 2 ? sh[0] : 1, cols = sh[nd - 1], n = rows * cols;
    int64_t be, bb;
    kiln__quant_block((int)type, &be, &bb);
    if (nd == 1 || cols % be) type = T_F32; /* (as llama.cpp keeps the norms, and rows blocks do not divide) */
    g->type = type;
    g->ndim = nd;
    g->ne[0] = (uint64_t)cols;
    g->ne[1] = (uint64_t)rows;
    float *f = malloc(sizeof(float) * (size_t)n);
    if (!f) return kiln_error(KILN_ERR_OOM, "gguf: out of memory");
    kiln_status s = kiln_tensor_to_host(p, f, sizeof(float) * (size_t)n);
    if (s == KILN_OK && heads > 0) {
        int64_t hs = rows / heads;
        float *t = malloc(sizeof(float) * (size_t)n);
        if (!t) s = kiln_error(KILN_ERR_OOM, "gguf: out of memory");
        for (int64_t h = 0; t && h < heads; h++)
            for (int64_t r = 0; r < hs; r++) {
                int64_t to = h * hs + (r % (hs / 2)) * 2 + r / (hs / 2);
                memcpy(t + to * cols, f + (h * hs + r) * cols, sizeof(float) * (size_t)cols);
            }
        if (t) {
            free(f);
            f = t;
        }
    }
    if (s != KILN_OK) {
        free(f);
        return s;
    }
    if (type == T_F32) {
        g->data = f;
        g->bytes = sizeof(float) * (size_t)n;
        return KILN_OK;
    }
    kiln__quant_block((int)type, &be, &bb);
    g->bytes = (size_t)(n / be * bb);
    g->data = malloc(g->bytes);
    if (!g->data) s = kiln_error(KILN_ERR_OOM, "gguf: out of memory");
    else kiln__quant_quant((int)type, f, g->data, n); /* (ggml's reference quantizers: core/quant.c) */
    free(f);
    return s;
}

/* LLaMA 3.1's rope scaling as llama.cpp takes it: rope_freqs.weight (D/2) f32, the
 * divisor of each unscaled frequency. */
static kiln_status rope_freqs_tensor(gtensor *g, const kiln_gpt_config *c)
{
    int64_t D = c->n_embd / c->n_head, h = D / 2;
    float *plain = malloc(sizeof(float) * (size_t)D);
    kiln_status s = plain ? kiln_rope_frequencies(c->rope_theta, D, NULL, plain)
                          : kiln_error(KILN_ERR_OOM, "gguf: out of memory");
    if (s == KILN_OK) s = kiln_rope_frequencies(c->rope_theta, D, &c->rope_scaling, plain + h);
    for (int64_t i = 0; s == KILN_OK && i < h; i++) plain[i] /= plain[h + i];
    kiln_tensor_t *t = s == KILN_OK ? kiln_empty(&h, 1, KILN_DTYPE_F32) : NULL;
    if (s == KILN_OK) s = t ? kiln_tensor_from_host_(t, plain, sizeof(float) * (size_t)h) : kiln_last_status();
    if (s == KILN_OK) s = make_tensor(g, "rope_freqs.weight", t, T_F32, 0);
    free(plain);
    return s;
}

/* The types kiln writes a model's matrices in, by name, and llama.cpp's general.file_type
 * for a file of each. */
typedef struct {
    const char *name;
    uint32_t type, file_type;
    int mix; /* llama.cpp's _M mixes: 4 (Q4_K_M) or 5 (Q5_K_M); 0 none */
} write_type;

static const write_type write_types[] = {
    {"f32", KILN__GGML_F32, 0, 0},    {"f16", KILN__GGML_F16, 1, 0},    {"bf16", KILN__GGML_BF16, 32, 0},
    {"q8_0", KILN__GGML_Q8_0, 7, 0},  {"q4_0", KILN__GGML_Q4_0, 2, 0},  {"q4_1", KILN__GGML_Q4_1, 3, 0},
    {"q5_0", KILN__GGML_Q5_0, 8, 0},  {"q5_1", KILN__GGML_Q5_1, 9, 0},  {"q4_K", KILN__GGML_Q4_K, 14, 0},
    {"q5_K", KILN__GGML_Q5_K, 16, 0}, {"q6_K", KILN__GGML_Q6_K, 18, 0}, {"q4_K_M", KILN__GGML_Q4_K, 15, 4},
    {"q5_K_M", KILN__GGML_Q5_K, 17, 5},
};

/* llama.cpp's rule for the layers that get more bits in the _M mixes: the first and the
 * last eighth, and every third between. */
static bool more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

/* The type of one matrix (GGUF name gn, of layer `layer` of n_layer, rows of `cols`
 * values) as llama.cpp's quantizer picks it for the file type: the K files' output (or
 * tied embedding) in Q6_K, the mixes' value projections and down projections of the
 * more_bits layers in Q6_K and a fused qkv one step up; a K type whose 256-value blocks
 * do not divide the rows falls back as llama.cpp's does (Q4_K to Q5_0, Q5_K to Q5_1,
 * Q6_K to Q8_0). The plain types are written as asked everywhere. */
static uint32_t matrix_type(const write_type *w, const char *gn, int layer, int n_layer, bool tied, int64_t cols)
{
    uint32_t t = w->type;
    bool k = t == KILN__GGML_Q4_K || t == KILN__GGML_Q5_K || t == KILN__GGML_Q6_K;
    if (k && (!strcmp(gn, "output.weight") || (tied && !strcmp(gn, "token_embd.weight")))) t = KILN__GGML_Q6_K;
    else if (w->mix && (strstr(gn, ".attn_v.weight") || strstr(gn, ".ffn_down.weight")) && more_bits(layer, n_layer))
        t = KILN__GGML_Q6_K;
    else if (w->mix && strstr(gn, ".attn_qkv.weight")) t = w->mix == 4 ? KILN__GGML_Q5_K : KILN__GGML_Q6_K;
    if (cols % 256 == 0) return t;
    return t == KILN__GGML_Q4_K ? KILN__GGML_Q5_0 : t == KILN__GGML_Q5_K ? KILN__GGML_Q5_1 : t == KILN__GGML_Q6_K ? KILN__GGML_Q8_0 : t;
}

kiln_status kiln_gguf_save(const kiln_gpt_t *m, const kiln_tokenizer_t *tok, const char *path, kiln_dtype dt,
                           bool q8_0_weights)
{
    if (!kiln_dtype_is_f32_or_half(dt))
        return kiln_error(KILN_ERR_ARG, "gguf_save: weights are written as f32, bf16, f16 or q8_0, not %s",
                          kiln_dtype_name(dt));
    return kiln_gguf_write(m, tok, path, q8_0_weights ? "q8_0" : kiln_dtype_name(dt));
}

kiln_status kiln_gguf_write(const kiln_gpt_t *m, const kiln_tokenizer_t *tok, const char *path, const char *type_name)
{
    if (!m || !tok || !path || !type_name)
        return kiln_error(KILN_ERR_ARG, "gguf_write: model, tokenizer, path and type must not be NULL");
    size_t wt = 0;
    while (wt < sizeof write_types / sizeof write_types[0] && strcmp(write_types[wt].name, type_name)) wt++;
    if (wt == sizeof write_types / sizeof write_types[0])
        return kiln_error(KILN_ERR_UNSUPPORTED, "gguf: type '%s' is not one kiln writes (f32, f16, bf16, q8_0, q4_0, "
                          "q4_1, q5_0, q5_1, q4_K, q5_K, q6_K, q4_K_M, q5_K_M)", type_name);
    const write_type *wtype = &write_types[wt];
    const kiln_gpt_config *c = kiln_gpt_get_config(m);
    kiln_status exportable = kiln__gpt_exportable(c, "gguf_save", "llama.cpp would");
    if (exportable != KILN_OK) return exportable;
    if (kiln_tokenizer_vocab_size(tok) != c->vocab_size)
        return kiln_error(KILN_ERR_ARG, "gguf_save: the model has %d tokens but its tokenizer %d", c->vocab_size,
                          kiln_tokenizer_vocab_size(tok));
    const kiln__arch *fam = kiln__arch_of(c);
    if (!fam || !fam->gguf_arch || (c->bias && !fam->gguf_bias))
        return kiln_error(KILN_ERR_UNSUPPORTED, "gguf export: llama.cpp's llama architecture takes LLaMA-style models "
                          "(rmsnorm, rope, swiglu, no biases), its qwen3 architecture those with q/k norms, and its gpt2 "
                          "architecture GPT-2 style ones (layernorm, learned positions, gelu, biases, as many key heads "
                          "as query heads); this model is neither");
    if (c->rope_scaling.kind == KILN_ROPE_SCALING_LLAMA3 && !fam->gguf_rope_freqs)
        return kiln_error(KILN_ERR_UNSUPPORTED, "gguf export: llama.cpp's %s architecture takes no llama3 rope scaling",
                          fam->gguf_arch);
    const char *arch = fam->gguf_arch;
    bool rope = c->pos == KILN_POS_ROPE;
    int np = kiln_gpt_num_params(m), cap = np + 2 * c->n_layer + 1, nt = 0;
    gtensor *ts = calloc((size_t)cap, sizeof *ts);
    kiln_status s = ts ? KILN_OK : kiln_error(KILN_ERR_OOM, "gguf: out of memory");
    kiln_scope_begin();
    int64_t hs = c->n_embd / c->n_head;
    for (int k = 0; s == KILN_OK && k < np; k++) {
        const char *name;
        kiln_tensor_t *p = kiln_gpt_param(m, k, &name);
        int i;
        const char *rest;
        const kiln__name_pair *e = kiln__arch_lookup(fam->gguf_names, name, &i, &rest);
        if (fam->gguf_qkv && i >= 0 && !strcmp(rest, "attn.qkv.weight")) { /* q, k (reordered for pair rope) and v */
            int64_t rows[3] = {c->n_head * hs, c->n_kv_head * hs, c->n_kv_head * hs}, at = 0;
            int heads[3] = {fam->gguf_rope_pairs ? c->n_head : 0, fam->gguf_rope_pairs ? c->n_kv_head : 0, 0};
            for (int q = 0; q < 3 && s == KILN_OK; q++) {
                char gn[64];
                snprintf(gn, sizeof gn, fam->gguf_qkv, i, "qkv"[q]);
                s = make_tensor(&ts[nt++], gn, kiln_narrow(p, 0, at, rows[q]),
                                matrix_type(wtype, gn, i, c->n_layer, c->tied, kiln_tensor_shape(p)[1]), heads[q]);
                at += rows[q];
            }
            continue;
        }
        if (!e) {
            s = kiln_error(KILN_ERR_INTERNAL, "gguf: no llama.cpp name for %s", name);
            break;
        }
        char gn[64];
        snprintf(gn, sizeof gn, e->other, i);
        s = make_tensor(&ts[nt++], gn, p,
                        matrix_type(wtype, gn, i, c->n_layer, c->tied, kiln_tensor_shape(p)[kiln_tensor_ndim(p) - 1]), 0);
    }
    if (s == KILN_OK && fam->gguf_rope_freqs && c->rope_scaling.kind == KILN_ROPE_SCALING_LLAMA3)
        s = rope_freqs_tensor(&ts[nt++], c);
    kiln_scope_end();
    buf b = {0};
    int nkv = 0;
    if (s == KILN_OK) {
        buf kv = {0};
        char k[96];
#define ARCH_KEY(suffix) (snprintf(k, sizeof k, "%s." suffix, arch), k)
        kv_str(&kv, &nkv, "general.architecture", arch);
        kv_str(&kv, &nkv, "general.name", "kiln");
        kv_u32(&kv, &nkv, "general.alignment", ALIGN);
        kv_u32(&kv, &nkv, "general.file_type", write_types[wt].file_type);
        kv_u32(&kv, &nkv, ARCH_KEY("context_length"), (uint32_t)c->block_size);
        kv_u32(&kv, &nkv, ARCH_KEY("embedding_length"), (uint32_t)c->n_embd);
        kv_u32(&kv, &nkv, ARCH_KEY("block_count"), (uint32_t)c->n_layer);
        kv_u32(&kv, &nkv, ARCH_KEY("feed_forward_length"), (uint32_t)kiln_gpt_ffn_hidden(c));
        kv_u32(&kv, &nkv, ARCH_KEY("attention.head_count"), (uint32_t)c->n_head);
        if (rope) {
            kv_u32(&kv, &nkv, ARCH_KEY("attention.head_count_kv"), (uint32_t)c->n_kv_head);
            kv_u32(&kv, &nkv, ARCH_KEY("rope.dimension_count"), (uint32_t)hs);
            kv_u32(&kv, &nkv, ARCH_KEY("vocab_size"), (uint32_t)c->vocab_size);
            kv_f32(&kv, &nkv, ARCH_KEY("rope.freq_base"), (float)c->rope_theta);
            if (c->rope_scaling.kind == KILN_ROPE_SCALING_LINEAR) {
                kv_str(&kv, &nkv, ARCH_KEY("rope.scaling.type"), "linear");
                kv_f32(&kv, &nkv, ARCH_KEY("rope.scaling.factor"), (float)c->rope_scaling.factor);
            }
        }
        snprintf(k, sizeof k, "%s.%s", arch, fam->gguf_eps);
        kv_f32(&kv, &nkv, k, (float)c->norm_eps);
#undef ARCH_KEY
        s = put_tokenizer(&kv, &nkv, tok);
        put(&b, "GGUF", 4);
        u32(&b, 3);
        u64(&b, (uint64_t)nt);
        u64(&b, (uint64_t)nkv);
        if (kv.failed) b.failed = true; /* (then kv.p may be NULL: put takes nothing from it) */
        put(&b, kv.p, kv.n);
        free(kv.p);
        uint64_t at = 0;
        for (int k = 0; k < nt; k++) {
            str(&b, ts[k].name, strlen(ts[k].name));
            u32(&b, (uint32_t)ts[k].ndim);
            for (int d = 0; d < ts[k].ndim; d++) u64(&b, ts[k].ne[d]);
            u32(&b, ts[k].type);
            u64(&b, at);
            at += (ts[k].bytes + ALIGN - 1) / ALIGN * ALIGN;
        }
        static const unsigned char zeros[ALIGN];
        put(&b, zeros, (ALIGN - b.n % ALIGN) % ALIGN);
        for (int k = 0; k < nt; k++) {
            put(&b, ts[k].data, ts[k].bytes);
            put(&b, zeros, (ALIGN - ts[k].bytes % ALIGN) % ALIGN);
        }
        if (s == KILN_OK && b.failed) s = kiln_error(KILN_ERR_OOM, "gguf: out of memory");
    }
    /* written whole to a temporary name, then renamed: the file is the old one or the new */
    if (s == KILN_OK) s = kiln__file_write_atomic(path, b.p, b.n, NULL);
    free(b.p);
    for (int k = 0; ts && k < nt; k++) free(ts[k].data);
    free(ts);
    return s;
}
