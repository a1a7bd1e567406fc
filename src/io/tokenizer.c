/* Tokenizer objects: construction, encode/decode, and HuggingFace tokenizer.json. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/util.h"
#include "io/tokenizer_impl.h"

/* ---- construction --------------------------------------------------------------------- */

kiln_tokenizer_t *kiln__tokenizer_alloc(int n_vocab, size_t nbytes, int n_merges, int n_special)
{
    kiln_tokenizer_t *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->n_vocab = n_vocab;
    t->n_merges = n_merges;
    t->n_special = n_special;
    t->tok_bytes = malloc(nbytes ? nbytes : 1);
    t->tok_off = malloc(((size_t)n_vocab + 1) * sizeof *t->tok_off);
    size_t nm = n_merges ? (size_t)n_merges : 1;
    t->merge_a = malloc(nm * sizeof *t->merge_a);
    t->merge_b = malloc(nm * sizeof *t->merge_b);
    t->merge_id = malloc(nm * sizeof *t->merge_id);
    t->special_id = malloc((n_special ? (size_t)n_special : 1) * sizeof *t->special_id);
    if (!t->tok_bytes || !t->tok_off || !t->merge_a || !t->merge_b || !t->merge_id || !t->special_id) {
        kiln_tokenizer_free(t);
        return NULL;
    }
    return t;
}

bool kiln__tokenizer_index_merges(kiln_tokenizer_t *t)
{
    for (int r = 0; r < t->n_merges; r++)
        if (!kiln__u64map_put(&t->merge_rank, kiln__pair_key(t->merge_a[r], t->merge_b[r]), r))
            return false;
    return true;
}

void kiln_tokenizer_free(kiln_tokenizer_t *t)
{
    if (!t)
        return;
    kiln__u64map_clear(&t->merge_rank);
    kiln__regex_free(t->split);
    KILN__FREE(t->tok_bytes, t->tok_off, t->merge_a, t->merge_b, t->merge_id, t->special_id, t);
}

kiln_tokenizer_t *kiln_tokenizer_byte(void)
{
    kiln_tokenizer_t *t = kiln__tokenizer_alloc(256, 256, 0, 0);
    if (!t) {
        kiln_error(KILN_ERR_OOM, "kiln_tokenizer_byte: out of memory");
        return NULL;
    }
    t->is_byte = true;
    for (int i = 0; i < 256; i++) {
        t->tok_bytes[i] = (uint8_t)i;
        t->tok_off[i] = (size_t)i;
        t->byte_id[i] = i;
    }
    t->tok_off[256] = 256;
    return t;
}

int kiln_tokenizer_vocab_size(const kiln_tokenizer_t *t) { return t ? t->n_vocab : 0; }

const char *kiln_tokenizer_kind(const kiln_tokenizer_t *t) { return t && t->is_byte ? "byte" : "bpe"; }

static const uint8_t *tok_ptr(const kiln_tokenizer_t *t, int32_t id) { return t->tok_bytes + t->tok_off[id]; }
static size_t tok_len(const kiln_tokenizer_t *t, int32_t id) { return t->tok_off[id + 1] - t->tok_off[id]; }

static bool token_is(const kiln_tokenizer_t *t, int32_t id, const char *s)
{
    size_t n = strlen(s);
    return t->tok_off[id + 1] - t->tok_off[id] == n && memcmp(t->tok_bytes + t->tok_off[id], s, n) == 0;
}

int32_t kiln_tokenizer_eot(const kiln_tokenizer_t *t)
{
    for (int k = 0; t && k < t->n_special; k++)
        if (token_is(t, t->special_id[k], KILN__EOT_TEXT))
            return t->special_id[k];
    return -1;
}

/* ---- encode / decode ------------------------------------------------------------------ */

typedef struct {
    int32_t *ids;
    size_t cap, n;
} id_sink;

static inline void sink_put(id_sink *s, int32_t id)
{
    if (s->n < s->cap)
        s->ids[s->n] = id;
    s->n++;
}

/* Pre-tokenizes seg[0..n) and appends the BPE ids of each pre-token. */
static kiln_status encode_segment(const kiln_tokenizer_t *t, kiln__bpe_scratch *sc, kiln__pretok *pt,
                                  const uint8_t *seg, size_t n, id_sink *out)
{
    uint8_t *norm = NULL; /* the segment normalized first, when the tokenizer says so */
    if (t->normalizer && n) {
        kiln_status st = kiln__normalize(t->normalizer, seg, n, &norm, &n);
        if (st != KILN_OK) return st;
        seg = norm;
    }
    kiln__pretok_restart(pt);
    kiln_status st = KILN_OK;
    for (size_t i = 0; i < n && st == KILN_OK;) {
        size_t j = kiln__pretok_next(pt, seg, n, i);
        if (j - i == 1) {
            sink_put(out, t->byte_id[seg[i]]);
        } else if (j - i > INT32_MAX) {
            st = kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode: a pre-token of %zu bytes is too long", j - i);
        } else {
            long k = kiln__bpe_word(t, sc, seg + i, j - i);
            if (k < 0) st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_encode: out of memory for a %zu-byte word", j - i);
            for (long m = 0; m < k; m++)
                sink_put(out, sc->sym[m]);
        }
        i = j;
    }
    free(norm);
    return st;
}

kiln_status kiln_tokenizer_encode(const kiln_tokenizer_t *t, const char *text, size_t len, int32_t *ids,
                                  size_t cap, size_t *n_out)
{
    if (!t || !n_out || (!text && len) || (!ids && cap))
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode: NULL tokenizer, text, ids or n_out");
    const uint8_t *s = (const uint8_t *)text;
    id_sink out = {ids, cap, 0};
    kiln_status st = KILN_OK;
    if (t->is_byte) {
        for (size_t i = 0; i < len; i++)
            sink_put(&out, (int32_t)s[i]);
    } else {
        /* Special tokens are cut out first, as `tokenizers` does; among hits at the same
         * place the longest wins. next_hit caches each token's next place, SIZE_MAX none. */
        size_t next_hit[8], *hits = t->n_special <= 8 ? next_hit : malloc((size_t)t->n_special * sizeof *hits);
        if (!hits)
            return kiln_error(KILN_ERR_OOM, "kiln_tokenizer_encode: out of memory");
        for (int k = 0; k < t->n_special; k++) {
            int32_t id = t->special_id[k];
            const uint8_t *h = tok_len(t, id) ? kiln__find_bytes(s, len, tok_ptr(t, id), tok_len(t, id)) : NULL;
            hits[k] = h ? (size_t)(h - s) : SIZE_MAX;
        }
        kiln__bpe_scratch sc = {0};
        kiln__pretok pt = kiln__pretok_begin(t->split ? t->split : kiln__regex_gpt2());
        if (!pt.md) st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_encode: out of memory for the pre-tokenizer");
        size_t pos = 0;
        while (st == KILN_OK && pos < len) {
            size_t best = len, best_len = 0;
            int32_t best_id = -1;
            for (int k = 0; k < t->n_special; k++) {
                int32_t id = t->special_id[k];
                size_t tl = tok_len(t, id);
                if (hits[k] != SIZE_MAX && hits[k] < pos) {
                    const uint8_t *h = kiln__find_bytes(s + pos, len - pos, tok_ptr(t, id), tl);
                    hits[k] = h ? (size_t)(h - s) : SIZE_MAX;
                }
                if (hits[k] != SIZE_MAX && (hits[k] < best || (hits[k] == best && tl > best_len))) {
                    best = hits[k];
                    best_len = tl;
                    best_id = id;
                }
            }
            st = encode_segment(t, &sc, &pt, s + pos, best - pos, &out);
            if (best_id >= 0)
                sink_put(&out, best_id);
            pos = best + best_len;
        }
        if (st == KILN_OK && pt.error) {
            char why[128];
            st = kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode: the pre-tokenizer's pattern failed: %s",
                            kiln__pretok_error(&pt, why, sizeof why));
        }
        kiln__bpe_scratch_free(&sc);
        kiln__pretok_end(&pt);
        if (hits != next_hit)
            free(hits);
    }
    *n_out = out.n;
    if (st != KILN_OK)
        return st;
    if (out.n > cap)
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode: %zu ids do not fit in cap %zu", out.n, cap);
    return KILN_OK;
}

kiln_status kiln_tokenizer_decode(const kiln_tokenizer_t *t, const int32_t *ids, size_t n, char **out)
{
    if (!out)
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_decode: out is NULL");
    *out = NULL;
    if (!t || (!ids && n))
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_decode: NULL tokenizer or ids");
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return kiln_error(KILN_ERR_INDEX, "kiln_tokenizer_decode: id %d at position %zu is outside [0, %d)",
                             ids[i], i, t->n_vocab);
        total += t->tok_off[ids[i] + 1] - t->tok_off[ids[i]];
    }
    char *s = malloc(total + 1);
    if (!s)
        return kiln_error(KILN_ERR_OOM, "kiln_tokenizer_decode: out of memory for %zu bytes", total);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        size_t a = t->tok_off[ids[i]], l = t->tok_off[ids[i] + 1] - a;
        memcpy(s + o, t->tok_bytes + a, l);
        o += l;
    }
    s[o] = '\0';
    *out = s;
    return KILN_OK;
}

const char *kiln_tokenizer_token_bytes(const kiln_tokenizer_t *t, int32_t id, size_t *len)
{
    if (len) *len = 0;
    if (!t || id < 0 || id >= t->n_vocab) return NULL;
    if (len) *len = t->tok_off[id + 1] - t->tok_off[id];
    return (const char *)t->tok_bytes + t->tok_off[id];
}

/* ---- GPT-2's byte <-> unicode mapping ------------------------------------------------- */

/* Byte-level BPE files spell each byte as one printable code point: the printable
 * Latin-1 bytes stand for themselves and the other 68 are moved to U+0100.. in byte
 * order (GPT-2's bytes_to_unicode). */
static uint16_t byte_cp[256];
static int16_t cp_byte[256 + 68];

static void byte_map_init(void)
{
    if (byte_cp['!'])
        return; /* idempotent, and every call writes the same values, so races are benign */
    int n = 0;
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        uint16_t cp = keep ? (uint16_t)b : (uint16_t)(256 + n++);
        cp_byte[cp] = (int16_t)b;
        byte_cp[b] = cp;
    }
}

/* Writes the byte-level spelling of b[0..n) to dst (room for 2n + 1) as UTF-8. */
static void bytes_to_symbols(const uint8_t *b, size_t n, char *dst)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t cp = byte_cp[b[i]];
        if (cp < 0x80) {
            dst[o++] = (char)cp;
        } else {
            dst[o++] = (char)(0xC0 | (cp >> 6));
            dst[o++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    dst[o] = '\0';
}

/* Reads a byte-level spelling back into dst (room for strlen(s)); returns the number of
 * bytes, or -1 if s holds a character outside the 256 byte symbols. */
static long symbols_to_bytes(const char *s, uint8_t *dst)
{
    const uint8_t *p = (const uint8_t *)s;
    long o = 0;
    while (*p) {
        unsigned cp;
        if (p[0] < 0x80) {
            cp = p[0];
            p += 1;
        } else if ((p[0] & 0xE0) == 0xC0 && (p[1] & 0xC0) == 0x80) {
            cp = (unsigned)(p[0] & 0x1F) << 6 | (p[1] & 0x3F);
            p += 2;
        } else {
            return -1;
        }
        if (cp >= sizeof cp_byte / sizeof cp_byte[0] || byte_cp[cp_byte[cp]] != cp)
            return -1;
        dst[o++] = (uint8_t)cp_byte[cp];
    }
    return o;
}

/* ---- save ----------------------------------------------------------------------------- */


static json_t *byte_level_object(bool add_prefix_space)
{
    return json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", add_prefix_space,
                     "trim_offsets", 1, "use_regex", 1);
}

/* ByteLevel with its GPT-2 pattern, or a Split on the tokenizer's own pattern before a
 * ByteLevel without one. */
static json_t *pre_tokenizer_object(const kiln_tokenizer_t *t)
{
    if (!t->split) return byte_level_object(false);
    return json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]}", "type", "Sequence", "pretokenizers",
                     "type", "Split", "pattern", "Regex", kiln__regex_pattern(t->split), "behavior", "Isolated",
                     "invert", 0, "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1, "use_regex", 0);
}

/* Builds the tokenizer.json tree; NULL with the error set on failure. */
static json_t *tokenizer_json(const kiln_tokenizer_t *t, const char *path)
{
    byte_map_init();
    size_t max_len = 0;
    for (int i = 0; i < t->n_vocab; i++)
        if (tok_len(t, i) > max_len)
            max_len = tok_len(t, i);
    char *buf = malloc(4 * max_len + 2);
    json_t *root = NULL, *added = json_array(), *vocab = json_object(), *merges = json_array();
    kiln_status st = KILN_OK;
    if (!buf || !added || !vocab || !merges)
        st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: %s: out of memory", path);
    for (int k = 0; st == KILN_OK && k < t->n_special; k++) {
        int32_t id = t->special_id[k];
        memcpy(buf, tok_ptr(t, id), tok_len(t, id));
        buf[tok_len(t, id)] = '\0';
        json_t *o = json_pack("{s:I, s:s, s:b, s:b, s:b, s:b, s:b}", "id", (json_int_t)id, "content", buf,
                              "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special", 1);
        if (!o || json_array_append_new(added, o))
            st = kiln_error(KILN_ERR_FORMAT, "kiln_tokenizer_save: %s: special token %d is not valid UTF-8", path, id);
    }
    /* Every id goes into the model's vocab, the special ones too (as GPT-2's file has it),
     * so `tokenizers` gives each the id kiln does. */
    for (int i = 0; st == KILN_OK && i < t->n_vocab; i++) {
        bytes_to_symbols(tok_ptr(t, i), tok_len(t, i), buf);
        if (json_object_get(vocab, buf))
            st = kiln_error(KILN_ERR_UNSUPPORTED, "kiln_tokenizer_save: %s: tokens %d and %d have the same bytes",
                           path, (int)json_integer_value(json_object_get(vocab, buf)), i);
        else if (json_object_set_new(vocab, buf, json_integer(i)))
            st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: %s: out of memory", path);
    }
    /* "a b" strings: byte-level symbols never hold a space (it is spelled U+0120), and
     * every version of `tokenizers` reads this form. */
    for (int r = 0; st == KILN_OK && r < t->n_merges; r++) {
        int32_t a = t->merge_a[r], b = t->merge_b[r];
        bytes_to_symbols(tok_ptr(t, a), tok_len(t, a), buf);
        size_t la = strlen(buf);
        buf[la] = ' ';
        bytes_to_symbols(tok_ptr(t, b), tok_len(t, b), buf + la + 1);
        if (json_array_append_new(merges, json_string(buf)))
            st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: %s: out of memory", path);
    }
    if (st == KILN_OK &&
        !(root = json_pack("{s:s, s:n, s:n, s:O, s:o, s:o, s:n, s:o, "
                           "s:{s:s, s:n, s:n, s:n, s:n, s:b, s:b, s:b, s:O, s:O}}", "version", "1.0", "truncation", "padding", "added_tokens", added, "normalizer",
                           t->normalizer ? json_pack("{s:s}", "type", kiln__norm_names[t->normalizer]) : json_null(),
                           "pre_tokenizer", pre_tokenizer_object(t), "post_processor", "decoder",
                           byte_level_object(true), "model", "type", "BPE", "dropout", "unk_token",
                           "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", 0, "byte_fallback", 0,
                           "ignore_merges", 0, "vocab", vocab, "merges", merges)))
        st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: %s: out of memory", path);
    json_decref(added);
    json_decref(vocab);
    json_decref(merges);
    free(buf);
    return root;
}

char *kiln_tokenizer_to_json(const kiln_tokenizer_t *t)
{
    if (!t) return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_to_json: NULL tokenizer"), NULL;
    json_t *root = tokenizer_json(t, "tokenizer.json");
    char *text = root ? json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER) : NULL;
    if (root && !text) kiln_error(KILN_ERR_OOM, "kiln_tokenizer_to_json: out of memory");
    json_decref(root);
    return text;
}

kiln_status kiln_tokenizer_save(const kiln_tokenizer_t *t, const char *path)
{
    if (!t || !path)
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_save: NULL tokenizer or path");
    json_t *root = tokenizer_json(t, path);
    if (!root)
        return kiln_last_status();
    /* Write a sibling file and rename it, so a reader never sees half a tokenizer. */
    size_t n = strlen(path) + 8;
    char *tmp = malloc(n);
    if (!tmp) {
        json_decref(root);
        return kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: out of memory");
    }
    snprintf(tmp, n, "%s.tmp", path);
    kiln_status st = KILN_OK;
    errno = 0;
    if (json_dump_file(root, tmp, JSON_INDENT(2) | JSON_PRESERVE_ORDER) != 0) {
        st = kiln_error(KILN_ERR_IO, "kiln_tokenizer_save: cannot write %s: %s", tmp,
                       errno ? strerror(errno) : "write failed");
        remove(tmp);
    } else if (rename(tmp, path) != 0) {
        st = kiln_error(KILN_ERR_IO, "kiln_tokenizer_save: cannot rename %s to %s: %s", tmp, path, strerror(errno));
        remove(tmp);
    }
    free(tmp);
    json_decref(root);
    return st;
}

/* ---- load ----------------------------------------------------------------------------- */

#define LOAD_FAIL(status, ...) (st = kiln_error(status, "kiln_tokenizer_load: " __VA_ARGS__))

/* A JSON boolean field, or dflt when absent or null; -1 when it is something else. */
static int json_flag(const json_t *o, const char *key, bool dflt)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v))
        return dflt;
    return json_is_boolean(v) ? json_is_true(v) : -1;
}

/* A Sequence of a Split on a regex (behavior Isolated, not inverted) and a ByteLevel
 * without its own regex, as LLaMA-3's and Qwen2's tokenizers have it: the Split's
 * pattern in *split. */
static kiln_status check_sequence(const json_t *pre, const char *path, const char **split)
{
    kiln_status st = KILN_OK;
    const json_t *list = json_object_get(pre, "pretokenizers");
    const json_t *sp = json_array_get(list, 0), *bl = json_array_get(list, 1);
    const char *sp_type = json_string_value(json_object_get(sp, "type"));
    const char *bl_type = json_string_value(json_object_get(bl, "type"));
    const char *behavior = json_string_value(json_object_get(sp, "behavior"));
    const char *regex = json_string_value(json_object_get(json_object_get(sp, "pattern"), "Regex"));
    if (!json_is_array(list) || json_array_size(list) != 2 || !sp_type || strcmp(sp_type, "Split") || !bl_type ||
        strcmp(bl_type, "ByteLevel"))
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: a pre_tokenizer Sequence is supported as [Split, ByteLevel] only", path);
    else if (!regex)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: the Split pre-tokenizer's pattern must be a Regex", path);
    else if (!behavior || strcmp(behavior, "Isolated") || json_flag(sp, "invert", false) != 0)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: Split with behavior \"%s\"%s is not supported, only Isolated", path,
                  behavior ? behavior : "?", json_flag(sp, "invert", false) != 0 ? " inverted" : "");
    else if (json_flag(bl, "add_prefix_space", true) != 0 || json_flag(bl, "use_regex", true) != 0)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: the ByteLevel after a Split must have add_prefix_space and use_regex "
                  "false", path);
    else
        *split = regex;
    return st;
}

/* Checks the parts around the model: kiln implements the byte-level pipeline, with
 * ByteLevel's own GPT-2 pattern or a Split's (*split, else NULL). */
static kiln_status check_pipeline(const json_t *root, const char *path, const char **split, int *normalizer)
{
    kiln_status st = KILN_OK;
    *split = NULL;
    const json_t *norm = json_object_get(root, "normalizer");
    const json_t *pre = json_object_get(root, "pre_tokenizer");
    const char *pre_type = json_string_value(json_object_get(pre, "type"));
    const char *norm_type = json_string_value(json_object_get(norm, "type"));
    int form = KILN__NORM_NONE;
    for (int k = 1; norm_type && k < 5; k++)
        if (!strcmp(norm_type, kiln__norm_names[k])) form = k;
    if (norm && !json_is_null(norm) && !form)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: normalizer \"%s\" is not supported (NFC, NFD, NFKC and NFKD are)", path,
                  norm_type ? norm_type : "?");
    else if (pre_type && !strcmp(pre_type, "Sequence"))
        st = check_sequence(pre, path, split);
    else if (!json_is_object(pre))
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: \"pre_tokenizer\" must be ByteLevel", path);
    else if (!pre_type || strcmp(pre_type, "ByteLevel") != 0)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: pre_tokenizer \"%s\" is not supported, only ByteLevel", path,
                  pre_type ? pre_type : "?");
    /* ByteLevel's own defaults are add_prefix_space=true and use_regex=true. */
    else if (json_flag(pre, "add_prefix_space", true) != 0)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: ByteLevel with add_prefix_space other than false is not supported",
                  path);
    else if (json_flag(pre, "use_regex", true) != 1)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: ByteLevel with use_regex other than true is not supported", path);
    *normalizer = form;
    return st;
}

static kiln_status check_model(const json_t *model, const char *path)
{
    kiln_status st = KILN_OK;
    const json_t *type = json_object_get(model, "type");
    const json_t *dropout = json_object_get(model, "dropout");
    const char *prefix = json_string_value(json_object_get(model, "continuing_subword_prefix"));
    const char *suffix = json_string_value(json_object_get(model, "end_of_word_suffix"));
    if (type && (!json_is_string(type) || strcmp(json_string_value(type), "BPE") != 0))
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: model type \"%s\" is not supported, only BPE", path,
                  json_is_string(type) ? json_string_value(type) : "?");
    else if (dropout && !json_is_null(dropout) && json_number_value(dropout) != 0.0)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: BPE dropout is not supported", path);
    else if ((prefix && *prefix) || (suffix && *suffix))
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: continuing_subword_prefix and end_of_word_suffix are not supported",
                  path);
    else if (json_flag(model, "ignore_merges", false) != 0)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: ignore_merges other than false is not supported", path);
    else if (!json_is_object(json_object_get(model, "vocab")))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: model has no \"vocab\" object", path);
    else if (json_object_get(model, "merges") && !json_is_array(json_object_get(model, "merges")))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: model \"merges\" is not an array", path);
    return st;
}

/* The tokenizer described by root; each id's bytes are gathered first, then packed. */
static kiln_status build_from_json(const json_t *root, const char *path, kiln_tokenizer_t **out)
{
    const char *split = NULL;
    int normalizer = KILN__NORM_NONE;
    kiln_status st = check_pipeline(root, path, &split, &normalizer);
    const json_t *model = json_object_get(root, "model");
    if (st == KILN_OK && !json_is_object(model))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: missing \"model\" object", path);
    if (st == KILN_OK)
        st = check_model(model, path);
    if (st != KILN_OK)
        return st;
    const json_t *vocab = json_object_get(model, "vocab");
    const json_t *merges = json_object_get(model, "merges");
    const json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_null(added) && !json_is_array(added))
        return LOAD_FAIL(KILN_ERR_FORMAT, "%s: \"added_tokens\" is not an array", path);
    size_t n_added = json_is_array(added) ? json_array_size(added) : 0;
    size_t n_merges = merges ? json_array_size(merges) : 0;
    /* Ids must be dense, so there are at most as many as there are entries. */
    size_t n_entries = json_object_size(vocab) + n_added;
    if (n_entries == 0 || n_entries > INT32_MAX || n_merges > INT32_MAX)
        return LOAD_FAIL(KILN_ERR_FORMAT, "%s: vocab has %zu entries", path, n_entries);
    uint8_t **bytes = calloc(n_entries, sizeof *bytes);
    size_t *blen = calloc(n_entries, sizeof *blen);
    bool *special = calloc(n_entries, sizeof *special);
    int32_t *special_ids = malloc((n_added ? n_added : 1) * sizeof *special_ids);
    kiln_tokenizer_t *t = NULL;
    int n_vocab = 0;
    if (!bytes || !blen || !special || !special_ids)
        LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory", path);
    for (size_t k = 0; st == KILN_OK && k < n_added; k++) {
        const json_t *a = json_array_get(added, k);
        const json_t *id = json_object_get(a, "id");
        const char *content = json_string_value(json_object_get(a, "content"));
        if (!json_is_integer(id) || !content)
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: added_tokens[%zu] needs an integer \"id\" and a string \"content\"",
                      path, k);
        else if (json_integer_value(id) < 0 || json_integer_value(id) >= (json_int_t)n_entries)
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: added token \"%s\" has id %lld, outside [0, %zu)", path, content,
                      (long long)json_integer_value(id), n_entries);
        else if (json_flag(a, "lstrip", false) || json_flag(a, "rstrip", false) ||
                 json_flag(a, "single_word", false))
            LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: added token \"%s\": lstrip, rstrip and single_word are not supported",
                      path, content);
        else if (special[json_integer_value(id)])
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: two added tokens have id %lld", path, (long long)json_integer_value(id));
        if (st != KILN_OK)
            break;
        size_t i = (size_t)json_integer_value(id), l = strlen(content);
        special[i] = true;
        special_ids[k] = (int32_t)i;
        bytes[i] = malloc(l ? l : 1);
        if (!bytes[i]) {
            LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory", path);
            break;
        }
        memcpy(bytes[i], content, l);
        blen[i] = l;
        if ((int)i + 1 > n_vocab)
            n_vocab = (int)i + 1;
    }
    const char *key;
    json_t *val;
    byte_map_init();
    json_object_foreach((json_t *)vocab, key, val)
    {
        if (st != KILN_OK)
            break;
        json_int_t id = json_integer_value(val);
        if (!json_is_integer(val) || id < 0 || id >= (json_int_t)n_entries) {
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: vocab entry \"%s\" has id %lld, outside [0, %zu)", path, key,
                      (long long)id, n_entries);
            break;
        }
        if (special[id])
            continue; /* an added token also in the vocab, as GPT-2 writes them */
        if (bytes[id]) {
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: vocab id %lld is given twice (\"%s\" is one)", path, (long long)id, key);
            break;
        }
        bytes[id] = malloc(strlen(key) + 1);
        if (!bytes[id]) {
            LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory", path);
            break;
        }
        long l = symbols_to_bytes(key, bytes[id]);
        if (l < 0) {
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: vocab entry \"%s\" is not in the byte-level alphabet", path, key);
            break;
        }
        blen[id] = (size_t)l;
        if ((int)id + 1 > n_vocab)
            n_vocab = (int)id + 1;
    }
    size_t total = 0;
    for (int i = 0; st == KILN_OK && i < n_vocab; i++) {
        if (!bytes[i])
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: no token has id %d (ids must run from 0 to %d)", path, i, n_vocab - 1);
        total += blen[i];
    }
    if (st == KILN_OK) {
        t = kiln__tokenizer_alloc(n_vocab, total, (int)n_merges, (int)n_added);
        if (!t)
            LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory for %d tokens", path, n_vocab);
    }
    if (st == KILN_OK) {
        size_t o = 0;
        for (int i = 0; i < n_vocab; i++) {
            t->tok_off[i] = o;
            memcpy(t->tok_bytes + o, bytes[i], blen[i]);
            o += blen[i];
        }
        t->tok_off[n_vocab] = o;
        memcpy(t->special_id, special_ids, n_added * sizeof *special_ids);
        for (int b = 0; b < 256; b++)
            t->byte_id[b] = -1;
        for (int i = n_vocab - 1; i >= 0; i--) /* downwards, so the lowest id wins */
            if (!special[i] && blen[i] == 1)
                t->byte_id[bytes[i][0]] = i;
        for (int b = 0; st == KILN_OK && b < 256; b++)
            if (t->byte_id[b] < 0)
                LOAD_FAIL(KILN_ERR_FORMAT, "%s: vocab has no token for byte 0x%02x", path, b);
    }
    /* Merges: "a b" or ["a", "b"]; both parts and their join must be in the vocab. */
    char *joined = NULL;
    for (size_t r = 0; st == KILN_OK && r < n_merges; r++) {
        const json_t *m = json_array_get(merges, r);
        const char *a = NULL, *b = NULL;
        char *split = NULL;
        if (json_is_string(m)) {
            const char *s = json_string_value(m), *sp = strchr(s, ' ');
            if (sp && !strchr(sp + 1, ' ') && (split = strdup(s))) {
                split[sp - s] = '\0';
                a = split;
                b = split + (sp - s) + 1;
            }
        } else if (json_is_array(m) && json_array_size(m) == 2) {
            a = json_string_value(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
        }
        const json_t *ia = a ? json_object_get(vocab, a) : NULL, *ib = b ? json_object_get(vocab, b) : NULL;
        const json_t *ij = NULL;
        if (!a || !b) {
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: merge %zu is not \"a b\" or [\"a\", \"b\"]", path, r);
        } else if (!ia || !ib) {
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: merge %zu (\"%s\" \"%s\") refers to unknown token \"%s\"", path, r, a, b,
                      ia ? b : a);
        } else {
            char *nj = realloc(joined, strlen(a) + strlen(b) + 1);
            if (!nj) {
                LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory", path);
            } else {
                joined = nj;
                strcpy(joined, a);
                strcat(joined, b);
                ij = json_object_get(vocab, joined);
                if (!ij)
                    LOAD_FAIL(KILN_ERR_FORMAT, "%s: merge %zu (\"%s\" \"%s\") makes \"%s\", which is not in the vocab",
                              path, r, a, b, joined);
            }
        }
        if (st == KILN_OK) {
            t->merge_a[r] = (int32_t)json_integer_value(ia);
            t->merge_b[r] = (int32_t)json_integer_value(ib);
            t->merge_id[r] = (int32_t)json_integer_value(ij);
        }
        free(split);
    }
    free(joined);
    if (st == KILN_OK && !kiln__tokenizer_index_merges(t))
        LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory indexing merges", path);
    if (st == KILN_OK) {
        bool identity = n_vocab == 256 && n_merges == 0 && n_added == 0;
        for (int b = 0; identity && b < 256; b++)
            identity = t->byte_id[b] == b;
        t->is_byte = identity;
    }
    if (st == KILN_OK && split) st = kiln__regex_new(split, path, &t->split);
    if (st == KILN_OK) t->normalizer = normalizer;
    for (size_t i = 0; bytes && i < n_entries; i++)
        free(bytes[i]);
    KILN__FREE(bytes, blen, special, special_ids);
    if (st != KILN_OK) {
        kiln_tokenizer_free(t);
        t = NULL;
    }
    *out = t;
    return st;
}

kiln_status kiln_tokenizer_load(const char *path, kiln_tokenizer_t **out)
{
    if (!out)
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_load: out is NULL");
    *out = NULL;
    if (!path)
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_load: path is NULL");
    kiln_status st = KILN_OK;
    FILE *f = fopen(path, "rb");
    if (!f)
        return LOAD_FAIL(KILN_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    json_error_t je;
    json_t *root = json_loadf(f, 0, &je);
    fclose(f);
    if (!root)
        return LOAD_FAIL(KILN_ERR_FORMAT, "%s:%d:%d: bad JSON: %s", path, je.line, je.column, je.text);
    if (!json_is_object(root))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: the top level is not a JSON object", path);
    else
        st = build_from_json(root, path, out);
    json_decref(root);
    return st;
}
