/* A GGUF file's tokenizer (kiln_gguf_tokenizer, kiln/gguf.h). llama.cpp stores the
 * vocabulary as arrays (tokenizer.ggml.tokens, token_type, merges or scores) and names
 * the pre-tokenizer (tokenizer.ggml.pre); kiln's tokenizers are described by
 * tokenizer.json documents, so the metadata is turned into the document that
 * `transformers` would have saved for the same tokenizer and loaded by the same code
 * (kiln__tokenizer_from_json): one tokenizer, one loader.
 *
 * - "gpt2" (byte-level BPE): the vocabulary in id order, the merges as listed, the
 *   pre-tokenizer the name stands for (GPT-2's ByteLevel regex, or the Split patterns of
 *   LLaMA-3 and Qwen2), control and user-defined tokens as added tokens.
 * - "llama" (SentencePiece's BPE, LLaMA-2 and Mistral): scores instead of merges.
 *   llama.cpp joins, again and again, the adjacent pair whose joined text is the token
 *   with the highest score; BPE with the merges "every split of a token into two
 *   tokens, ranked by the token's score" does the same, and is what transformers'
 *   converter writes for such a model. Metaspace with the "▁" prefix when
 *   add_space_prefix (default true), byte fallback to the "<0xXX>" tokens.
 * The eos and bos ids come from the file, not from the tokens' names. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include "io/gguf_pre.h"
#include "io/tokenizer_impl.h"
#include "kiln/gguf.h"

/* llama.cpp's token types (tokenizer.ggml.token_type). */
enum { T_NORMAL = 1, T_UNKNOWN = 2, T_CONTROL = 3, T_USER = 4, T_UNUSED = 5, T_BYTE = 6 };

/* The pre-tokenizers kiln has, by llama.cpp's names for them (the first name of a
 * pattern is the one kiln's GGUF export writes: kiln__gguf_pre_name). */
#define LLAMA3_SPLIT                                                                                                   \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"          \
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define QWEN2_SPLIT                                                                                                    \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"              \
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
static const struct {
    const char *name;
    const char *split; /* a Split pattern before a ByteLevel without its own regex; NULL: GPT-2's ByteLevel */
} pres[] = {
    {"gpt-2", NULL}, {"gpt2", NULL}, {"llama-bpe", LLAMA3_SPLIT}, {"llama3", LLAMA3_SPLIT}, {"qwen2", QWEN2_SPLIT},
};

const char *kiln__gguf_pre_name(const char *split)
{
    for (size_t k = 0; k < sizeof pres / sizeof pres[0]; k++)
        if (split ? pres[k].split && !strcmp(split, pres[k].split) : !pres[k].split) return pres[k].name;
    return NULL;
}

static json_t *byte_level(bool regex)
{
    return json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
                     "use_regex", regex);
}

static json_t *pre_tokenizer(const char *pre)
{
    for (size_t k = 0; k < sizeof pres / sizeof pres[0]; k++) {
        if (strcmp(pre, pres[k].name)) continue;
        if (!pres[k].split) return byte_level(true);
        return json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, o]}", "type", "Sequence", "pretokenizers", "type",
                         "Split", "pattern", "Regex", pres[k].split, "behavior", "Isolated", "invert", 0,
                         byte_level(false));
    }
    return NULL;
}

/* The added_tokens of the document: control, unknown and user-defined tokens. */
static json_t *added_tokens(const char *const *tok, const int64_t *type, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++) {
        if (type[i] != T_CONTROL && type[i] != T_USER && type[i] != T_UNKNOWN) continue;
        json_t *e = json_pack("{s:I, s:s, s:b, s:b, s:b, s:b, s:b}", "id", (json_int_t)i, "content", tok[i],
                              "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", type[i] == T_USER, "special",
                              type[i] != T_USER);
        if (!e || json_array_append_new(a, e)) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

static json_t *vocab_object(const char *const *tok, size_t n)
{
    json_t *v = json_object();
    for (size_t i = 0; v && i < n; i++)
        if (!json_object_get(v, tok[i]) && json_object_set_new(v, tok[i], json_integer((json_int_t)i))) {
            json_decref(v);
            return NULL;
        }
    return v;
}

/* ---- SentencePiece's scores as merges ---- */

typedef struct {
    double score; /* of the joined token */
    int64_t id, a, b;
} pair;

static int by_score(const void *x, const void *y)
{
    const pair *p = x, *q = y;
    if (p->score != q->score) return p->score > q->score ? -1 : 1;
    if (p->id != q->id) return p->id < q->id ? -1 : 1;
    if (p->a != q->a) return p->a < q->a ? -1 : 1;
    return (p->b > q->b) - (p->b < q->b);
}

/* Every split of a normal token into two tokens of the vocabulary, ranked as above. */
static json_t *merges_from_scores(const char *const *tok, const int64_t *type, const double *score, size_t n,
                                  const json_t *vocab, kiln_status *st, const char *path)
{
    size_t cap = 1024, m = 0, left_cap = 0;
    pair *ps = malloc(cap * sizeof *ps);
    char *left = NULL;
    bool oom = !ps;
    for (size_t i = 0; !oom && i < n; i++) {
        if (type[i] != T_NORMAL && type[i] != T_USER) continue;
        size_t len = strlen(tok[i]);
        if (len + 1 > left_cap) {
            char *more = realloc(left, len + 1);
            if (!(oom = !more)) left = more, left_cap = len + 1;
        }
        for (size_t cut = 1; !oom && cut < len; cut++) {
            if (((unsigned char)tok[i][cut] & 0xC0) == 0x80) continue; /* inside a character */
            memcpy(left, tok[i], cut);
            left[cut] = '\0';
            const json_t *a = json_object_get(vocab, left), *b = json_object_get(vocab, tok[i] + cut);
            if (!a || !b) continue;
            if (m == cap) {
                pair *more = realloc(ps, cap * 2 * sizeof *ps);
                if ((oom = !more)) break;
                ps = more, cap *= 2;
            }
            ps[m++] = (pair){score[i], (int64_t)i, json_integer_value(a), json_integer_value(b)};
        }
    }
    json_t *out = oom ? NULL : json_array();
    if (out) qsort(ps, m, sizeof *ps, by_score);
    for (size_t k = 0; out && k < m; k++)
        if (json_array_append_new(out, json_pack("[s, s]", tok[ps[k].a], tok[ps[k].b]))) {
            json_decref(out);
            out = NULL;
        }
    free(ps);
    free(left);
    if (!out) *st = kiln_error(KILN_ERR_OOM, "%s: out of memory building the tokenizer's merges", path);
    return out;
}

/* ---- the document ---- */

static json_t *document(const kiln_gguf_t *g, const char *path, kiln_status *st)
{
    const char *model = NULL, *pre = "default";
    const char *const *tok = NULL;
    size_t n = 0, nt = 0, ns = 0;
    int64_t *type = NULL;
    double *score = NULL;
    json_t *doc = NULL, *vocab = NULL, *merges = NULL, *added = NULL, *pt = NULL;
    if ((*st = kiln_gguf_get_str(g, "tokenizer.ggml.model", &model)) != KILN_OK) return NULL;
    bool spm = !strcmp(model, "llama"), bpe = !strcmp(model, "gpt2");
    if (!spm && !bpe) {
        *st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model '%s' is not read (gpt2, byte-level BPE, and "
                         "llama, SentencePiece's, are)", path, model);
        return NULL;
    }
    if (bpe && kiln_gguf_find_key(g, "tokenizer.ggml.pre") >= 0 &&
        (*st = kiln_gguf_get_str(g, "tokenizer.ggml.pre", &pre)) != KILN_OK)
        return NULL;
    if ((*st = kiln_gguf_get_strs(g, "tokenizer.ggml.tokens", &tok, &n)) != KILN_OK) return NULL;
    if (n == 0 || n > INT32_MAX) {
        *st = kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.tokens holds %zu tokens", path, n);
        return NULL;
    }
    if (kiln_gguf_find_key(g, "tokenizer.ggml.token_type") >= 0) {
        if ((*st = kiln_gguf_get_ints(g, "tokenizer.ggml.token_type", &type, &nt)) != KILN_OK) goto done;
    } else if ((type = malloc(n * sizeof *type))) { /* none given: every token normal */
        for (size_t i = 0; i < n; i++) type[i] = T_NORMAL;
        nt = n;
    }
    if (!type) {
        *st = kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
        goto done;
    }
    if (nt != n) {
        *st = kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.token_type has %zu entries for %zu tokens", path, nt, n);
        goto done;
    }
    for (size_t i = 0; i < n; i++)
        if (type[i] < T_NORMAL || type[i] > T_BYTE) {
            *st = kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.token_type[%zu] is %lld, not 1 to 6", path, i,
                             (long long)type[i]);
            goto done;
        }
    vocab = vocab_object(tok, n);
    added = added_tokens(tok, type, n);
    if (!vocab || !added) {
        *st = kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
        goto done;
    }
    if (bpe) {
        if (!(pt = pre_tokenizer(pre))) {
            *st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: tokenizer.ggml.pre '%s' is a pre-tokenizer kiln does not have "
                             "(gpt-2, llama-bpe and qwen2 are)", path, pre);
            goto done;
        }
        const char *const *m = NULL;
        size_t nm = 0;
        if (kiln_gguf_find_key(g, "tokenizer.ggml.merges") >= 0 &&
            (*st = kiln_gguf_get_strs(g, "tokenizer.ggml.merges", &m, &nm)) != KILN_OK)
            goto done;
        if (!(merges = json_array())) *st = kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
        for (size_t k = 0; *st == KILN_OK && k < nm; k++)
            if (json_array_append_new(merges, json_string(m[k])))
                *st = kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
        if (*st != KILN_OK) goto done;
        doc = json_pack("{s:s, s:n, s:n, s:o, s:n, s:o, s:n, s:o, s:{s:s, s:n, s:n, s:n, s:n, s:b, s:b, s:b, "
                        "s:o, s:o}}", "version", "1.0", "truncation", "padding", "added_tokens", added, "normalizer",
                        "pre_tokenizer", pt, "post_processor", "decoder", byte_level(true), "model", "type", "BPE",
                        "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", 0,
                        "byte_fallback", 0, "ignore_merges", 0, "vocab", vocab, "merges", merges);
    } else {
        if ((*st = kiln_gguf_get_reals(g, "tokenizer.ggml.scores", &score, &ns)) != KILN_OK) goto done;
        if (ns != n) {
            *st = kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.scores has %zu entries for %zu tokens", path, ns, n);
            goto done;
        }
        bool prefix = true;
        if (kiln_gguf_find_key(g, "tokenizer.ggml.add_space_prefix") >= 0 &&
            (*st = kiln_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &prefix)) != KILN_OK)
            goto done;
        if (!(merges = merges_from_scores(tok, type, score, n, vocab, st, path))) goto done;
        json_t *unk = json_null();
        int64_t u = -1;
        if (kiln_gguf_find_key(g, "tokenizer.ggml.unknown_token_id") >= 0 &&
            (*st = kiln_gguf_get_int(g, "tokenizer.ggml.unknown_token_id", &u)) != KILN_OK)
            goto done;
        if (u >= 0 && (size_t)u < n) unk = json_string(tok[u]);
        /* the decoder transformers writes for such a model: "▁" back to a space, the byte tokens back
         * to bytes, and the prefix's space stripped */
        json_t *dec = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}, {s:s}]}", "type", "Sequence", "decoders", "type",
                                "Replace", "pattern", "String", "\xe2\x96\x81", "content", " ", "type", "ByteFallback",
                                "type", "Fuse");
        if (dec && prefix)
            json_array_append_new(json_object_get(dec, "decoders"),
                                  json_pack("{s:s, s:s, s:i, s:i}", "type", "Strip", "content", " ", "start", 1, "stop", 0));
        doc = json_pack("{s:s, s:n, s:n, s:o, s:n, s:{s:s, s:s, s:s, s:b}, s:n, s:o, "
                        "s:{s:s, s:n, s:o, s:n, s:n, s:b, s:b, s:b, s:o, s:o}}", "version", "1.0", "truncation",
                        "padding", "added_tokens", added, "normalizer", "pre_tokenizer", "type", "Metaspace",
                        "replacement", "\xe2\x96\x81", "prepend_scheme", prefix ? "first" : "never", "split", 0,
                        "post_processor", "decoder", dec, "model", "type", "BPE", "dropout", "unk_token", unk,
                        "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", 1, "byte_fallback", 1,
                        "ignore_merges", 0, "vocab", vocab, "merges", merges);
    }
    vocab = merges = added = pt = NULL; /* (json_pack's "o" took them, or freed them on failure) */
    if (!doc) *st = kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
done:
    json_decref(vocab);
    json_decref(merges);
    json_decref(added);
    json_decref(pt);
    free(type);
    free(score);
    return doc;
}

/* An id key of the file: -1 when absent; an error when present and not a token. */
static kiln_status token_id(const kiln_gguf_t *g, const char *key, int n, const char *path, int32_t *out)
{
    *out = -1;
    if (kiln_gguf_find_key(g, key) < 0) return KILN_OK;
    int64_t v;
    kiln_status s = kiln_gguf_get_int(g, key, &v);
    if (s != KILN_OK) return s;
    if (v < 0 || v >= n) return kiln_error(KILN_ERR_FORMAT, "%s: %s is %lld, not a token (0 to %d)", path, key, (long long)v, n - 1);
    *out = (int32_t)v;
    return KILN_OK;
}

kiln_status kiln_gguf_tokenizer(const kiln_gguf_t *g, kiln_tokenizer_t **out)
{
    if (!g || !out) return kiln_error(KILN_ERR_ARG, "kiln_gguf_tokenizer: g and out must not be NULL");
    *out = NULL;
    const char *path = kiln_gguf_path(g);
    kiln_status st = KILN_OK;
    json_t *doc = document(g, path, &st);
    kiln_tokenizer_t *t = NULL;
    if (st == KILN_OK) st = kiln__tokenizer_from_json(doc, path, &t);
    json_decref(doc);
    int32_t eos, bos;
    if (st == KILN_OK && (st = token_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, path, &eos)) == KILN_OK &&
        (st = token_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, path, &bos)) == KILN_OK) {
        t->eot_id = eos;
        t->bos_id = bos;
        /* a prompt starts with bos where the file says so; without the key, as llama.cpp
         * defaults: SentencePiece vocabularies yes, byte-level BPE no */
        const char *model = "";
        kiln_gguf_get_str(g, "tokenizer.ggml.model", &model);
        t->add_bos = !strcmp(model, "llama");
        if (kiln_gguf_find_key(g, "tokenizer.ggml.add_bos_token") >= 0)
            st = kiln_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos);
    }
    if (st != KILN_OK) {
        kiln_tokenizer_free(t);
        return st;
    }
    *out = t;
    return KILN_OK;
}
