/* HuggingFace tokenizer.json: writing a kiln tokenizer as one, and reading the shapes
 * kiln honours (byte-level BPE as GPT-2, LLaMA-3 and Qwen2 ship it; char-level BPE with
 * byte fallback as LLaMA-2 and Mistral do). What a file declares that kiln cannot do is
 * refused with the field's name, never read as a different tokenizer. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/file.h"
#include "core/util.h"
#include "io/tokenizer_impl.h"
#include "kiln/gguf.h"

static const uint8_t *tok_ptr(const kiln_tokenizer_t *t, int32_t id) { return t->tok_bytes + t->tok_off[id]; }
static size_t tok_len(const kiln_tokenizer_t *t, int32_t id) { return t->tok_off[id + 1] - t->tok_off[id]; }

static const char *const prepend_names[] = {"always", "first", "never"};

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

static json_t *metaspace_object(const kiln__metaspace *ms)
{
    return json_pack("{s:s, s:s, s:s, s:b}", "type", "Metaspace", "replacement", ms->rep, "prepend_scheme",
                     prepend_names[ms->prepend], "split", ms->split);
}

/* char-level: Metaspace or none; byte-level: ByteLevel with its GPT-2 pattern, or a
 * Split on the tokenizer's own pattern before a ByteLevel without one. */
static json_t *pre_tokenizer_object(const kiln_tokenizer_t *t)
{
    if (t->char_level) return t->metaspace ? metaspace_object(&t->ms) : json_null();
    if (!t->split) return byte_level_object(false);
    return json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]}", "type", "Sequence", "pretokenizers",
                     "type", "Split", "pattern", "Regex", kiln__regex_pattern(t->split), "behavior", "Isolated",
                     "invert", 0, "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1, "use_regex", 0);
}

static json_t *replace_object(const kiln__norm *z)
{
    return json_pack("{s:s, s:{s:s}, s:s}", "type", "Replace", "pattern", "String", z->pattern, "content", z->content);
}

static json_t *norm_object(const kiln__norm *z)
{
    if (z->kind == KILN__NORM_PREPEND) return json_pack("{s:s, s:s}", "type", "Prepend", "prepend", z->content);
    if (z->kind == KILN__NORM_REPLACE) return replace_object(z);
    return json_pack("{s:s}", "type", kiln__norm_names[z->kind]);
}

/* NULL when out of memory. */
static json_t *normalizer_object(const kiln_tokenizer_t *t)
{
    if (t->n_norm == 0 && !t->norm_seq) return json_null();
    if (t->n_norm == 1 && !t->norm_seq) return norm_object(&t->norm[0]);
    json_t *list = json_array();
    for (int i = 0; list && i < t->n_norm; i++)
        if (json_array_append_new(list, norm_object(&t->norm[i]))) {
            json_decref(list);
            return NULL;
        }
    return list ? json_pack("{s:s, s:o}", "type", "Sequence", "normalizers", list) : NULL;
}

static json_t *decoder_object(const kiln_tokenizer_t *t)
{
    const kiln__decoder *d = &t->dec;
    if (!t->char_level) return byte_level_object(true);
    if (d->is_metaspace) return metaspace_object(&d->ms);
    json_t *list = json_array();
    bool ok = list != NULL;
    for (int i = 0; ok && i < d->n_replace; i++)
        ok = json_array_append_new(list, replace_object(&d->replace[i])) == 0;
    if (ok && d->byte_fallback) ok = json_array_append_new(list, json_pack("{s:s}", "type", "ByteFallback")) == 0;
    if (ok && d->fuse) ok = json_array_append_new(list, json_pack("{s:s}", "type", "Fuse")) == 0;
    if (ok && d->strip >= 0)
        ok = json_array_append_new(list, json_pack("{s:s, s:s, s:i, s:i}", "type", "Strip", "content", d->strip_char,
                                                   "start", d->strip, "stop", 0)) == 0;
    if (!ok) {
        json_decref(list);
        return NULL;
    }
    return json_pack("{s:s, s:o}", "type", "Sequence", "decoders", list);
}

/* Room for any token's name in the file, with its NUL. */
static size_t name_room(const kiln_tokenizer_t *t)
{
    size_t max_len = 0;
    for (int i = 0; i < t->n_vocab; i++) {
        size_t l = t->char_level ? t->str_off[i + 1] - t->str_off[i] : 2 * tok_len(t, i);
        if (l > max_len) max_len = l;
    }
    return max_len + 1;
}

/* Token id's name in the file's vocab, NUL-terminated, in buf (name_room bytes). */
static const char *token_name(const kiln_tokenizer_t *t, int32_t id, char *buf)
{
    if (t->char_level) {
        size_t n = t->str_off[id + 1] - t->str_off[id];
        memcpy(buf, t->tok_str + t->str_off[id], n);
        buf[n] = '\0';
    } else {
        bytes_to_symbols(tok_ptr(t, id), tok_len(t, id), buf);
    }
    return buf;
}

/* The model's merges: "a b" strings, which every version of `tokenizers` reads, unless a
 * token holds a space (byte-level symbols never do: a space is spelled U+0120); then
 * ["a", "b"] pairs (tokenizers 0.20 and later). NULL when out of memory. */
static json_t *merges_array(const kiln_tokenizer_t *t, char *buf, char *buf2)
{
    bool pairs = false;
    for (int r = 0; t->char_level && !pairs && r < t->n_merges; r++)
        pairs = strchr(token_name(t, t->merge_a[r], buf), ' ') || strchr(token_name(t, t->merge_b[r], buf), ' ');
    json_t *merges = json_array();
    for (int r = 0; merges && r < t->n_merges; r++) {
        token_name(t, t->merge_a[r], buf);
        token_name(t, t->merge_b[r], buf2);
        json_t *m;
        if (pairs) {
            m = json_pack("[s, s]", buf, buf2);
        } else {
            size_t la = strlen(buf);
            buf[la] = ' ';
            strcpy(buf + la + 1, buf2);
            m = json_string(buf);
        }
        if (json_array_append_new(merges, m)) {
            json_decref(merges);
            return NULL;
        }
    }
    return merges;
}

/* Builds the tokenizer.json tree; NULL with the error set on failure. */
static json_t *tokenizer_json(const kiln_tokenizer_t *t, const char *path)
{
    byte_map_init();
    size_t room = name_room(t);
    char *buf = malloc(2 * room + 1), *buf2 = malloc(room);
    json_t *root = NULL, *added = json_array(), *vocab = json_object(), *merges = NULL;
    kiln_status st = KILN_OK;
    if (!buf || !buf2 || !added || !vocab)
        st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: %s: out of memory", path);
    for (int k = 0; st == KILN_OK && k < t->n_special; k++) {
        int32_t id = t->special_id[k];
        size_t n;
        const uint8_t *text = kiln__token_text(t, id, &n);
        memcpy(buf, text, n);
        buf[n] = '\0';
        json_t *o = json_pack("{s:I, s:s, s:b, s:b, s:b, s:b, s:b}", "id", (json_int_t)id, "content", buf,
                              "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special",
                              t->special_flag[k]);
        if (!o || json_array_append_new(added, o))
            st = kiln_error(KILN_ERR_FORMAT, "kiln_tokenizer_save: %s: special token %d is not valid UTF-8", path, id);
    }
    /* Every id goes into the model's vocab, the special ones too (as GPT-2's and
     * LLaMA-2's files have them), so `tokenizers` gives each the id kiln does. */
    for (int i = 0; st == KILN_OK && i < t->n_vocab; i++) {
        token_name(t, i, buf);
        if (json_object_get(vocab, buf))
            st = kiln_error(KILN_ERR_UNSUPPORTED, "kiln_tokenizer_save: %s: tokens %d and %d have the same bytes",
                           path, (int)json_integer_value(json_object_get(vocab, buf)), i);
        else if (json_object_set_new(vocab, buf, json_integer(i)))
            st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: %s: out of memory", path);
    }
    if (st == KILN_OK && !(merges = merges_array(t, buf, buf2)))
        st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: %s: out of memory", path);
    json_t *unk = st == KILN_OK && t->unk_id >= 0 ? json_string(token_name(t, t->unk_id, buf))
                                                                   : json_null();
    /* The post-processor is not written: kiln's ids are the text's alone (no BOS added). */
    if (st == KILN_OK &&
        !(root = json_pack("{s:s, s:n, s:n, s:O, s:o, s:o, s:n, s:o, "
                           "s:{s:s, s:n, s:O, s:n, s:n, s:b, s:b, s:b, s:O, s:O}}",
                           "version", "1.0", "truncation", "padding", "added_tokens", added, "normalizer",
                           normalizer_object(t), "pre_tokenizer", pre_tokenizer_object(t), "post_processor",
                           "decoder", decoder_object(t), "model", "type", "BPE", "dropout", "unk_token", unk,
                           "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                           t->fuse_unk, "byte_fallback", t->char_level && t->byte_fallback,
                           "ignore_merges", 0, "vocab", vocab, "merges", merges)))
        st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: %s: out of memory", path);
    json_decref(unk);
    json_decref(added);
    json_decref(vocab);
    json_decref(merges);
    KILN__FREE(buf, buf2);
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
    /* Written whole beside the target and renamed, so a reader never sees half a
     * tokenizer (core/file.h). */
    char *text = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    kiln_status st = text ? kiln__file_write_atomic(path, text, strlen(text), NULL)
                          : kiln_error(KILN_ERR_OOM, "kiln_tokenizer_save: out of memory");
    free(text);
    json_decref(root);
    return st;
}

/* ---- load ----------------------------------------------------------------------------- */

#define LOAD_ERR(status, ...) kiln_error(status, __VA_ARGS__)
#define LOAD_FAIL(status, ...) (st = LOAD_ERR(status, __VA_ARGS__))

/* A JSON boolean field, or dflt when absent or null; -1 when it is something else. */
static int json_flag(const json_t *o, const char *key, bool dflt)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v))
        return dflt;
    return json_is_boolean(v) ? json_is_true(v) : -1;
}

static const char *type_of(const json_t *o)
{
    const char *s = json_string_value(json_object_get(o, "type"));
    return s ? s : "?";
}

/* s is one character (what `tokenizers` reads into a Rust char). */
static bool one_char(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    return n && kiln__utf8_len((const uint8_t *)s, n, 0) == n;
}

/* What a file declares around its model, read before the model. */
typedef struct {
    bool char_level;
    const char *split; /* byte-level: the Split's pattern, NULL for ByteLevel's own */
    kiln__norm *norm;
    int n_norm;
    bool norm_seq;
    bool metaspace;
    kiln__metaspace ms;
    kiln__decoder dec;
} pipeline;

static void pipeline_free(pipeline *p)
{
    kiln__norm_free(p->norm, p->n_norm);
    kiln__norm_free(p->dec.replace, p->dec.n_replace);
    p->norm = p->dec.replace = NULL;
    p->n_norm = p->dec.n_replace = 0;
}

/* Appends a step to *steps (*n of them); false when out of memory. pattern and content
 * are copied. */
static bool add_step(kiln__norm **steps, int *n, int kind, const char *pattern, const char *content)
{
    kiln__norm *s = realloc(*steps, ((size_t)*n + 1) * sizeof *s);
    if (!s) return false;
    *steps = s;
    s[*n] = (kiln__norm){.kind = kind};
    s[*n].pattern = pattern ? strdup(pattern) : NULL;
    s[*n].content = content ? strdup(content) : NULL;
    (*n)++;
    return (!pattern || s[*n - 1].pattern) && (!content || s[*n - 1].content);
}

/* A Replace's literal pattern; NULL with the error set for a Regex or a malformed one.
 * what: "normalizer" or "decoder". */
static const char *replace_pattern(const json_t *o, const char *path, const char *what)
{
    const json_t *pat = json_object_get(o, "pattern");
    const char *s = json_string_value(json_object_get(pat, "String"));
    if (json_object_get(pat, "Regex"))
        LOAD_ERR(KILN_ERR_UNSUPPORTED, "%s: %s Replace with a Regex pattern is not supported (a String is)", path, what);
    else if (!s || !*s || !json_is_string(json_object_get(o, "content")))
        LOAD_ERR(KILN_ERR_FORMAT, "%s: %s Replace needs a non-empty \"pattern\": {\"String\": ...} and a string "
                 "\"content\"", path, what);
    else
        return s;
    return NULL;
}

/* One normalizer (a Sequence's flattened) appended to p->norm. */
static kiln_status parse_normalizer(const json_t *n, const char *path, pipeline *p, int depth)
{
    kiln_status st = KILN_OK;
    const char *type = type_of(n);
    int form = KILN__NORM_NONE;
    for (int k = 1; k < KILN__NORM_PREPEND; k++)
        if (!strcmp(type, kiln__norm_names[k])) form = k;
    bool ok = true;
    if (!strcmp(type, "Sequence") && depth < 8) {
        const json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list)) return LOAD_FAIL(KILN_ERR_FORMAT, "%s: a normalizer Sequence needs a "
                                                   "\"normalizers\" array", path);
        for (size_t i = 0; st == KILN_OK && i < json_array_size(list); i++)
            st = parse_normalizer(json_array_get(list, i), path, p, depth + 1);
        return st;
    } else if (form) {
        ok = add_step(&p->norm, &p->n_norm, form, NULL, NULL);
    } else if (!strcmp(type, "Prepend")) {
        const char *c = json_string_value(json_object_get(n, "prepend"));
        if (!c) return LOAD_FAIL(KILN_ERR_FORMAT, "%s: normalizer Prepend needs a string \"prepend\"", path);
        ok = add_step(&p->norm, &p->n_norm, KILN__NORM_PREPEND, NULL, c);
    } else if (!strcmp(type, "Replace")) {
        const char *pat = replace_pattern(n, path, "normalizer");
        if (!pat) return kiln_last_status();
        ok = add_step(&p->norm, &p->n_norm, KILN__NORM_REPLACE, pat, json_string_value(json_object_get(n, "content")));
    } else {
        return LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: normalizer \"%s\" is not supported (NFC, NFD, NFKC, NFKD, "
                         "Prepend, Replace of a String and Sequences of them are)", path, type);
    }
    return ok ? KILN_OK : LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory", path);
}

/* A Metaspace (pre-tokenizer or decoder, `what`), read as `tokenizers` reads it:
 * prepend_scheme "always" when absent, and the older add_prefix_space false only with
 * prepend_scheme "never". */
static kiln_status parse_metaspace(const json_t *o, const char *path, const char *what, kiln__metaspace *ms)
{
    kiln_status st = KILN_OK;
    const char *rep = json_string_value(json_object_get(o, "replacement"));
    const json_t *scheme = json_object_get(o, "prepend_scheme");
    const char *sc = json_string_value(scheme);
    int prepend = scheme ? -1 : KILN__PREPEND_ALWAYS;
    for (int k = 0; sc && k < 3; k++)
        if (!strcmp(sc, prepend_names[k])) prepend = k;
    if (!one_char(rep))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: %s Metaspace needs a \"replacement\" of one character", path, what);
    else if (prepend < 0)
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: %s Metaspace prepend_scheme must be \"always\", \"first\" or \"never\"", path,
                  what);
    else if (json_flag(o, "add_prefix_space", true) == 0 && prepend != KILN__PREPEND_NEVER)
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: %s Metaspace add_prefix_space false does not match prepend_scheme \"%s\"",
                  path, what, prepend_names[prepend]);
    else if (json_flag(o, "add_prefix_space", true) < 0 || json_flag(o, "split", true) < 0)
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: %s Metaspace add_prefix_space and split must be booleans", path, what);
    if (st != KILN_OK) return st;
    snprintf(ms->rep, sizeof ms->rep, "%s", rep);
    ms->prepend = prepend;
    ms->split = json_flag(o, "split", true);
    return KILN_OK;
}

/* A char-level decoder: Metaspace, or a Sequence (or one step) of Replace with a String,
 * ByteFallback, Fuse and Strip(c, n, 0), in that order, a Strip only after a Fuse (a
 * Strip before it would strip every token). */
static kiln_status parse_decoder(const json_t *d, const char *path, kiln__decoder *dec)
{
    kiln_status st = KILN_OK;
    static const char *const steps[] = {"Replace", "ByteFallback", "Fuse", "Strip"};
    const char *type = type_of(d);
    dec->strip = -1;
    if (!d || json_is_null(d))
        return LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: \"decoder\" null is not supported without ByteLevel "
                         "(`tokenizers` joins such tokens with spaces)", path);
    if (!strcmp(type, "Metaspace")) {
        dec->is_metaspace = true;
        return parse_metaspace(d, path, "decoder", &dec->ms);
    }
    const json_t *list = json_object_get(d, "decoders");
    bool seq = !strcmp(type, "Sequence");
    if (seq && !json_is_array(list))
        return LOAD_FAIL(KILN_ERR_FORMAT, "%s: a decoder Sequence needs a \"decoders\" array", path);
    size_t n = seq ? json_array_size(list) : 1;
    int stage = 0; /* the index in steps[] of the last step read */
    for (size_t i = 0; st == KILN_OK && i < n; i++) {
        const json_t *s = seq ? json_array_get(list, i) : d;
        const char *st_type = type_of(s);
        int k = 0;
        while (k < 4 && strcmp(st_type, steps[k])) k++;
        if (k == 4)
            return LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: decoder \"%s\" is not supported (ByteLevel, Metaspace, or a "
                             "Sequence of Replace, ByteFallback, Fuse and Strip are)", path, st_type);
        if (k < stage || (k == stage && k > 0 && i > 0))
            return LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: decoder %s after %s is not supported (Replace, ByteFallback, "
                             "Fuse and Strip, in that order, are)", path, st_type, steps[stage]);
        stage = k;
        if (k == 0) {
            const char *pat = replace_pattern(s, path, "decoder");
            if (!pat) return kiln_last_status();
            if (!add_step(&dec->replace, &dec->n_replace, KILN__NORM_REPLACE, pat,
                          json_string_value(json_object_get(s, "content"))))
                return LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory", path);
        } else if (k == 1) {
            dec->byte_fallback = true;
        } else if (k == 2) {
            dec->fuse = true;
        } else {
            const char *c = json_string_value(json_object_get(s, "content"));
            const json_t *start = json_object_get(s, "start"), *stop = json_object_get(s, "stop");
            if (!one_char(c) || !json_is_integer(start) || !json_is_integer(stop) || json_integer_value(start) < 0 ||
                json_integer_value(start) > 1000000)
                LOAD_FAIL(KILN_ERR_FORMAT, "%s: decoder Strip needs a one-character \"content\" and integers "
                          "\"start\" and \"stop\"", path);
            else if (json_integer_value(stop) != 0)
                LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: decoder Strip with stop %lld is not supported (0 is)", path,
                          (long long)json_integer_value(stop));
            else if (!dec->fuse)
                LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: decoder Strip without a Fuse before it is not supported", path);
            else {
                dec->strip = (int)json_integer_value(start);
                snprintf(dec->strip_char, sizeof dec->strip_char, "%s", c);
            }
        }
    }
    return st;
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
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: a pre_tokenizer Sequence is supported as [Split, ByteLevel] or "
                  "[Metaspace] only", path);
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

/* Reads the parts around the model into p. A ByteLevel pre-tokenizer (alone, or after a
 * Split) makes a byte-level tokenizer; Metaspace (alone or as a one-step Sequence) or
 * none a char-level one. */
static kiln_status check_pipeline(const json_t *root, const char *path, pipeline *p)
{
    kiln_status st = KILN_OK;
    const json_t *norm = json_object_get(root, "normalizer");
    const json_t *pre = json_object_get(root, "pre_tokenizer");
    const json_t *dec = json_object_get(root, "decoder");
    const char *pre_type = type_of(pre);
    const json_t *list = json_object_get(pre, "pretokenizers");
    const json_t *ms = NULL;
    if (!strcmp(pre_type, "Metaspace"))
        ms = pre;
    else if (!strcmp(pre_type, "Sequence") && json_array_size(list) == 1 &&
             !strcmp(type_of(json_array_get(list, 0)), "Metaspace"))
        ms = json_array_get(list, 0);
    if (norm && !json_is_null(norm)) {
        p->norm_seq = !strcmp(type_of(norm), "Sequence");
        st = parse_normalizer(norm, path, p, 0);
    }
    if (st != KILN_OK) return st;
    if (!pre || json_is_null(pre) || ms) {
        p->char_level = true;
        p->metaspace = ms != NULL;
        if (ms) st = parse_metaspace(ms, path, "pre_tokenizer", &p->ms);
        if (st == KILN_OK && !strcmp(type_of(dec), "ByteLevel"))
            return LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: decoder ByteLevel is supported only after a ByteLevel "
                             "pre_tokenizer", path);
        return st == KILN_OK ? parse_decoder(dec, path, &p->dec) : st;
    }
    if (!strcmp(pre_type, "Sequence"))
        st = check_sequence(pre, path, &p->split);
    else if (!json_is_object(pre) || strcmp(pre_type, "ByteLevel") != 0)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: pre_tokenizer \"%s\" is not supported (ByteLevel, Metaspace, "
                  "Sequence[Split, ByteLevel] or none are)", path, pre_type);
    /* ByteLevel's own defaults are add_prefix_space=true and use_regex=true. */
    else if (json_flag(pre, "add_prefix_space", true) != 0)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: ByteLevel with add_prefix_space other than false is not supported",
                  path);
    else if (json_flag(pre, "use_regex", true) != 1)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: ByteLevel with use_regex other than true is not supported", path);
    /* No decoder is read as ByteLevel's: bytes, which is what such files mean. */
    if (st == KILN_OK && dec && !json_is_null(dec) && strcmp(type_of(dec), "ByteLevel"))
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: decoder \"%s\" is not supported with a ByteLevel pre_tokenizer (ByteLevel "
                  "is)", path, type_of(dec));
    return st;
}

/* The model's fields. unk_token and fuse_unk count in both kinds (a byte-level vocab may
 * lack some bytes); byte_fallback only in char-level ones, where "<0xXX>" tokens exist. */
static kiln_status check_model(const json_t *model, const char *path, bool char_level)
{
    kiln_status st = KILN_OK;
    const json_t *type = json_object_get(model, "type");
    const json_t *dropout = json_object_get(model, "dropout");
    const json_t *unk = json_object_get(model, "unk_token");
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
    else if (json_flag(model, "fuse_unk", false) < 0 || (char_level && json_flag(model, "byte_fallback", false) < 0))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: model fuse_unk and byte_fallback must be booleans", path);
    else if (unk && !json_is_null(unk) && !json_is_string(unk))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: model unk_token must be a string or null", path);
    else if (json_is_string(unk) && !json_object_get(json_object_get(model, "vocab"), json_string_value(unk)))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: model unk_token \"%s\" is not in the vocab", path, json_string_value(unk));
    return st;
}

/* A "<0xXX>" token as `tokenizers`' ByteFallback decoder reads it (Rust's
 * u8::from_str_radix on its two middle characters, which also takes "+X"): its byte,
 * or -1. */
static int byte_token(const uint8_t *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        int c = s[i], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                        : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0 && !(i == 3 && c == '+')) return -1;
        v = d < 0 ? 0 : v * 16 + d;
    }
    return v;
}

/* What a char-level decoder makes of the token named s in the middle of a text (the
 * per-token steps: Metaspace's rep -> " ", or the Replace steps then ByteFallback): a
 * new buffer of *n bytes, NULL when out of memory. */
static uint8_t *piece_bytes(const kiln__decoder *d, const char *s, size_t *n)
{
    size_t len = strlen(s);
    uint8_t *cur = d->is_metaspace ? kiln__replace_all((const uint8_t *)s, len, d->ms.rep, strlen(d->ms.rep), " ", 1, &len)
                                   : (uint8_t *)strdup(s);
    for (int i = 0; cur && !d->is_metaspace && i < d->n_replace; i++) {
        const kiln__norm *z = &d->replace[i];
        uint8_t *next = kiln__replace_all(cur, len, z->pattern, strlen(z->pattern), z->content, strlen(z->content), &len);
        free(cur);
        cur = next;
    }
    int b = cur && d->byte_fallback ? byte_token(cur, len) : -1;
    if (b >= 0) {
        cur[0] = (uint8_t)b;
        len = 1;
    }
    *n = len;
    return cur;
}

/* An added token with "normalized": true is matched by `tokenizers` in the normalized
 * text, kiln in the text before normalizing: the same only when the normalizer is
 * Unicode forms alone and leaves the token as it is. */
static kiln_status check_normalized(const pipeline *p, const json_t *a, const char *content, const char *path)
{
    kiln_status st = KILN_OK;
    if (json_flag(a, "normalized", false) != 1 || !p->n_norm) return KILN_OK;
    bool same = true;
    for (int i = 0; i < p->n_norm; i++)
        same = same && p->norm[i].kind < KILN__NORM_PREPEND;
    uint8_t *n = NULL;
    size_t nl = 0, cl = strlen(content);
    if (same && cl) {
        st = kiln__normalize_all(p->norm, p->n_norm, (const uint8_t *)content, cl, &n, &nl);
        same = st == KILN_OK && nl == cl && memcmp(n, content, cl) == 0;
        free(n);
    }
    if (st == KILN_OK && !same)
        LOAD_FAIL(KILN_ERR_UNSUPPORTED, "%s: added token \"%s\" has \"normalized\": true, which kiln honours only "
                  "when the normalizer is Unicode forms that leave it as it is", path, content);
    return st;
}

/* Sets t->cut to c (SentencePiece's "▁", or Metaspace's own) when a word may be cut
 * before each c that follows another character: c is in the vocab (so it never falls
 * back to bytes or joins a run of unk), and no merge makes a token in which c follows
 * another character. Then no merge joins the symbols on the two sides of such a place
 * (their join would hold that other character before c), so BPE gives each side the
 * ids it gives them together. LLaMA-2's "▁▁▁▁" tokens keep c after c, which is why a
 * cut is only after another character. */
static void set_cut(kiln_tokenizer_t *t, const char *c)
{
    size_t cn = strlen(c);
    if (kiln__u64map_get(&t->char_id, kiln__char_key((const uint8_t *)c, cn)) < 0) return;
    for (int r = 0; r < t->n_merges; r++) {
        size_t n;
        const uint8_t *s = kiln__token_text(t, t->merge_id[r], &n), *h;
        for (size_t from = 1; from < n && (h = kiln__find_bytes(s + from, n - from, (const uint8_t *)c, cn));
             from = (size_t)(h - s) + cn) {
            size_t at = (size_t)(h - s);
            if (at < cn || memcmp(s + at - cn, c, cn) != 0) return;
        }
    }
    memcpy(t->cut, c, cn + 1);
}

/* The tokenizer described by root; each id's bytes (and, char-level, its string) are
 * gathered first, then packed. */
/* The start-of-text token a post_processor puts before a text (kiln_tokenizer_adds_bos):
 * a TemplateProcessing, alone or in a Sequence, whose "single" template starts with a
 * SpecialToken; its id from "special_tokens". kiln's ids are the text's alone, so this
 * is only noted, for prompts (the rest of the template is not applied). */
static void start_token(const json_t *pp, kiln_tokenizer_t *t)
{
    const char *type = json_string_value(json_object_get(pp, "type"));
    if (type && !strcmp(type, "Sequence")) {
        size_t i;
        const json_t *e;
        json_array_foreach(json_object_get(pp, "processors"), i, e) start_token(e, t);
        return;
    }
    if (!type || strcmp(type, "TemplateProcessing")) return;
    const json_t *first = json_array_get(json_object_get(pp, "single"), 0);
    const char *name = json_string_value(json_object_get(json_object_get(first, "SpecialToken"), "id"));
    const json_t *ids = json_object_get(json_object_get(json_object_get(pp, "special_tokens"), name ? name : ""), "ids");
    json_int_t id = json_integer_value(json_array_get(ids, 0));
    if (name && json_is_integer(json_array_get(ids, 0)) && id >= 0 && id < t->n_vocab) {
        t->add_bos = true;
        t->bos_id = (int32_t)id;
    }
}

kiln_status kiln__tokenizer_from_json(const json_t *root, const char *path, kiln_tokenizer_t **out)
{
    pipeline p = {0};
    kiln_status st = check_pipeline(root, path, &p);
    const json_t *model = json_object_get(root, "model");
    if (st == KILN_OK && !json_is_object(model))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: missing \"model\" object", path);
    if (st == KILN_OK)
        st = check_model(model, path, p.char_level);
    const json_t *vocab = json_object_get(model, "vocab");
    const json_t *merges = json_object_get(model, "merges");
    const json_t *added = json_object_get(root, "added_tokens");
    if (st == KILN_OK && added && !json_is_null(added) && !json_is_array(added))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: \"added_tokens\" is not an array", path);
    size_t n_added = json_is_array(added) ? json_array_size(added) : 0;
    size_t n_merges = merges ? json_array_size(merges) : 0;
    /* Ids must be dense, so there are at most as many as there are entries. */
    size_t n_entries = json_object_size(vocab) + n_added;
    if (st == KILN_OK && (n_entries == 0 || n_entries > INT32_MAX || n_merges > INT32_MAX))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: vocab has %zu entries", path, n_entries);
    if (st != KILN_OK) {
        pipeline_free(&p);
        return st;
    }
    uint8_t **bytes = calloc(n_entries, sizeof *bytes);
    char **strs = p.char_level ? calloc(n_entries, sizeof *strs) : NULL;
    size_t *blen = calloc(n_entries, sizeof *blen);
    bool *special = calloc(n_entries, sizeof *special);
    int32_t *special_ids = malloc((n_added ? n_added : 1) * sizeof *special_ids);
    bool *special_flags = malloc((n_added ? n_added : 1) * sizeof *special_flags);
    kiln_tokenizer_t *t = NULL;
    int n_vocab = 0;
    if (!bytes || !blen || !special || !special_ids || !special_flags || (p.char_level && !strs))
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
        else
            st = check_normalized(&p, a, content, path);
        if (st != KILN_OK)
            break;
        size_t i = (size_t)json_integer_value(id), l = strlen(content);
        special[i] = true;
        special_ids[k] = (int32_t)i;
        special_flags[k] = json_flag(a, "special", true) != 0;
        /* decoded as the decoder makes it, as `tokenizers` decodes added tokens too */
        if (p.char_level) {
            strs[i] = strdup(content);
            bytes[i] = strs[i] ? piece_bytes(&p.dec, content, &l) : NULL;
        } else if ((bytes[i] = malloc(l ? l : 1))) {
            memcpy(bytes[i], content, l);
        }
        if (!bytes[i]) {
            LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory", path);
            break;
        }
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
        if (p.char_level) {
            strs[id] = strdup(key);
            bytes[id] = strs[id] ? piece_bytes(&p.dec, key, &blen[id]) : NULL;
        } else {
            bytes[id] = malloc(strlen(key) + 1);
        }
        if (!bytes[id]) {
            LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory", path);
            break;
        }
        if (!p.char_level) {
            long l = symbols_to_bytes(key, bytes[id]);
            if (l < 0) {
                LOAD_FAIL(KILN_ERR_FORMAT, "%s: vocab entry \"%s\" is not in the byte-level alphabet", path, key);
                break;
            }
            blen[id] = (size_t)l;
        }
        if ((int)id + 1 > n_vocab)
            n_vocab = (int)id + 1;
    }
    size_t total = 0, total_str = 0;
    for (int i = 0; st == KILN_OK && i < n_vocab; i++) {
        if (!bytes[i])
            LOAD_FAIL(KILN_ERR_FORMAT, "%s: no token has id %d (ids must run from 0 to %d)", path, i, n_vocab - 1);
        total += blen[i];
        total_str += p.char_level && strs[i] ? strlen(strs[i]) : 0;
    }
    if (st == KILN_OK) {
        t = kiln__tokenizer_alloc(n_vocab, total, (int)n_merges, (int)n_added);
        if (t && p.char_level) {
            t->char_level = true;
            t->tok_str = malloc(total_str ? total_str : 1);
            t->str_off = malloc(((size_t)n_vocab + 1) * sizeof *t->str_off);
        }
        if (!t || (p.char_level && (!t->tok_str || !t->str_off)))
            LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory for %d tokens", path, n_vocab);
    }
    if (st == KILN_OK) {
        size_t o = 0, os = 0;
        for (int i = 0; i < n_vocab; i++) {
            t->tok_off[i] = o;
            memcpy(t->tok_bytes + o, bytes[i], blen[i]);
            o += blen[i];
            if (p.char_level) {
                size_t l = strlen(strs[i]);
                t->str_off[i] = os;
                memcpy(t->tok_str + os, strs[i], l);
                os += l;
            }
        }
        t->tok_off[n_vocab] = o;
        if (p.char_level) t->str_off[n_vocab] = os;
        memcpy(t->special_id, special_ids, n_added * sizeof *special_ids);
        memcpy(t->special_flag, special_flags, n_added * sizeof *special_flags);
        for (int b = 0; b < 256; b++)
            t->byte_id[b] = -1;
        if (!p.char_level) {
            for (int i = n_vocab - 1; i >= 0; i--) /* downwards, so the lowest id wins */
                if (!special[i] && blen[i] == 1)
                    t->byte_id[bytes[i][0]] = i;
            /* (a byte without a token is encoded as the unk token or not at all: bpe.c) */
            const char *unk = json_string_value(json_object_get(model, "unk_token"));
            t->unk_id = unk ? (int32_t)json_integer_value(json_object_get(vocab, unk)) : -1;
            t->fuse_unk = json_flag(model, "fuse_unk", false) == 1;
        }
    }
    if (st == KILN_OK && p.char_level) {
        /* The model's own lookups, by the vocab's strings as `tokenizers` makes them:
         * single characters, the "<0xXX>" byte tokens, the unk token. */
        json_object_foreach((json_t *)vocab, key, val)
        {
            size_t l = strlen(key);
            if (l <= 4 && kiln__utf8_len((const uint8_t *)key, l, 0) == l &&
                !kiln__u64map_put(&t->char_id, kiln__char_key((const uint8_t *)key, l), (int32_t)json_integer_value(val))) {
                LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory", path);
                break;
            }
        }
        for (int b = 0; b < 256; b++) {
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", b);
            const json_t *id = json_object_get(vocab, name);
            t->byte_id[b] = id ? (int32_t)json_integer_value(id) : -1;
        }
        const char *unk = json_string_value(json_object_get(model, "unk_token"));
        t->unk_id = unk ? (int32_t)json_integer_value(json_object_get(vocab, unk)) : -1;
        t->fuse_unk = json_flag(model, "fuse_unk", false) == 1;
        t->byte_fallback = json_flag(model, "byte_fallback", false) == 1;
    }
    /* Merges: "a b" or ["a", "b"]; both parts and their join must be in the vocab. */
    char *joined = NULL;
    for (size_t r = 0; st == KILN_OK && r < n_merges; r++) {
        const json_t *m = json_array_get(merges, r);
        const char *a = NULL, *b = NULL;
        char *halves = NULL;
        if (json_is_string(m)) {
            const char *s = json_string_value(m), *sp = strchr(s, ' ');
            if (sp && !strchr(sp + 1, ' ') && (halves = strdup(s))) {
                halves[sp - s] = '\0';
                a = halves;
                b = halves + (sp - s) + 1;
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
        free(halves);
    }
    free(joined);
    if (st == KILN_OK && !kiln__tokenizer_index_merges(t))
        LOAD_FAIL(KILN_ERR_OOM, "%s: out of memory indexing merges", path);
    if (st == KILN_OK && !p.char_level) {
        bool identity = n_vocab == 256 && n_merges == 0 && n_added == 0 && p.n_norm == 0 && !p.norm_seq;
        for (int b = 0; identity && b < 256; b++)
            identity = t->byte_id[b] == b;
        t->is_byte = identity;
    }
    if (st == KILN_OK && p.char_level) set_cut(t, p.metaspace ? p.ms.rep : "\xe2\x96\x81");
    if (st == KILN_OK) start_token(json_object_get(root, "post_processor"), t);
    if (st == KILN_OK && p.split) st = kiln__regex_new(p.split, path, &t->split);
    if (st == KILN_OK) { /* the pipeline's steps move into t */
        t->norm = p.norm, t->n_norm = p.n_norm, t->norm_seq = p.norm_seq;
        t->metaspace = p.metaspace, t->ms = p.ms, t->dec = p.dec;
        p.norm = p.dec.replace = NULL;
        p.n_norm = p.dec.n_replace = 0;
    }
    for (size_t i = 0; bytes && i < n_entries; i++)
        free(bytes[i]);
    for (size_t i = 0; strs && i < n_entries; i++)
        free(strs[i]);
    KILN__FREE(bytes, strs, blen, special, special_ids, special_flags);
    pipeline_free(&p);
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
    FILE *f = kiln__file_fopen_read(path, NULL); /* a regular file only */
    if (!f)
        return kiln_last_status();
    char magic[4];
    if (fread(magic, 1, 4, f) == 4 && !memcmp(magic, "GGUF", 4)) { /* a GGUF file's own tokenizer */
        fclose(f);
        kiln_gguf_t *g = NULL;
        if ((st = kiln_gguf_open(path, &g)) == KILN_OK) st = kiln_gguf_tokenizer(g, out);
        kiln_gguf_free(g);
        return st;
    }
    rewind(f);
    json_error_t je;
    json_t *root = json_loadf(f, 0, &je);
    fclose(f);
    if (!root)
        return LOAD_FAIL(KILN_ERR_FORMAT, "%s:%d:%d: bad JSON: %s", path, je.line, je.column, je.text);
    if (!json_is_object(root))
        LOAD_FAIL(KILN_ERR_FORMAT, "%s: the top level is not a JSON object", path);
    else
        st = kiln__tokenizer_from_json(root, path, out);
    json_decref(root);
    return st;
}
