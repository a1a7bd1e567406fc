/* Tokenizer objects: construction, encode and decode (tokenizer_json.c reads and writes
 * HuggingFace tokenizer.json). */
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
    t->unk_id = -1;
    t->eot_id = t->bos_id = -1;
    t->dec.strip = -1;
    t->n_merges = n_merges;
    t->n_special = n_special;
    t->tok_bytes = malloc(nbytes ? nbytes : 1);
    t->tok_off = malloc(((size_t)n_vocab + 1) * sizeof *t->tok_off);
    size_t nm = n_merges ? (size_t)n_merges : 1;
    t->merge_a = malloc(nm * sizeof *t->merge_a);
    t->merge_b = malloc(nm * sizeof *t->merge_b);
    t->merge_id = malloc(nm * sizeof *t->merge_id);
    t->special_id = malloc((n_special ? (size_t)n_special : 1) * sizeof *t->special_id);
    t->special_flag = malloc((n_special ? (size_t)n_special : 1) * sizeof *t->special_flag);
    if (!t->tok_bytes || !t->tok_off || !t->merge_a || !t->merge_b || !t->merge_id || !t->special_id ||
        !t->special_flag) {
        kiln_tokenizer_free(t);
        return NULL;
    }
    for (int k = 0; k < n_special; k++) t->special_flag[k] = true;
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
    kiln__u64map_clear(&t->char_id);
    kiln__regex_free(t->split);
    kiln__norm_free(t->norm, t->n_norm);
    kiln__norm_free(t->dec.replace, t->dec.n_replace);
    KILN__FREE(t->tok_bytes, t->tok_off, t->merge_a, t->merge_b, t->merge_id, t->special_id, t->special_flag, t->tok_str,
               t->str_off,
               t);
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

const uint8_t *kiln__token_text(const kiln_tokenizer_t *t, int32_t id, size_t *len)
{
    if (!t->char_level) {
        *len = tok_len(t, id);
        return tok_ptr(t, id);
    }
    *len = t->str_off[id + 1] - t->str_off[id];
    return t->tok_str + t->str_off[id];
}

static bool token_is(const kiln_tokenizer_t *t, int32_t id, const char *s)
{
    size_t n = strlen(s), l;
    const uint8_t *p = kiln__token_text(t, id, &l);
    return l == n && memcmp(p, s, n) == 0;
}

/* The first of names[] (a NULL-ended list, in order of preference) that is one of t's
 * special tokens: its id, or -1. */
static int32_t special_named(const kiln_tokenizer_t *t, const char *const *names)
{
    for (int n = 0; t && names[n]; n++)
        for (int k = 0; k < t->n_special; k++)
            if (token_is(t, t->special_id[k], names[n])) return t->special_id[k];
    return -1;
}

/* The names the tokenizers of the families kiln reads give their end and start of a
 * text: GPT-2's (and kiln's own), SentencePiece's (LLaMA-2, Mistral), LLaMA-3's. */
int32_t kiln_tokenizer_eot(const kiln_tokenizer_t *t)
{
    static const char *const names[] = {KILN__EOT_TEXT, "</s>", "<|end_of_text|>", NULL};
    return t && t->eot_id >= 0 ? t->eot_id : special_named(t, names);
}

bool kiln_tokenizer_adds_bos(const kiln_tokenizer_t *t) { return t && t->add_bos && t->bos_id >= 0; }

int32_t kiln_tokenizer_bos(const kiln_tokenizer_t *t)
{
    static const char *const names[] = {"<s>", "<|begin_of_text|>", NULL};
    int32_t id = t && t->bos_id >= 0 ? t->bos_id : special_named(t, names);
    return id >= 0 ? id : kiln_tokenizer_eot(t);
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

/* The end of the word that starts at s[i] (i < n): the byte-level pre-tokenizer's next
 * piece; for char-level, the next place a Metaspace that splits or t->cut cuts at, else
 * the segment's end. */
static size_t next_word(const kiln_tokenizer_t *t, kiln__pretok *pt, const uint8_t *s, size_t n, size_t i)
{
    if (!t->char_level) return kiln__pretok_next(pt, s, n, i);
    bool split = t->metaspace && t->ms.split;
    const char *c = split ? t->ms.rep : t->cut;
    size_t cn = strlen(c);
    /* Each c starts a word (Metaspace's split, MergedWithNext), or, for a cut, each c
     * after another character. The search starts past s[i]: c is one character, and
     * none starts inside another (UTF-8). */
    for (size_t from = i + 1; cn && from < n;) {
        const uint8_t *h = kiln__find_bytes(s + from, n - from, (const uint8_t *)c, cn);
        if (!h) break;
        size_t at = (size_t)(h - s);
        if (split || at < cn || memcmp(s + at - cn, c, cn) != 0) return at;
        from = at + cn;
    }
    return n;
}

/* Normalizes and pre-tokenizes seg[0..n) (at_start: it starts the text) and appends the
 * BPE ids of each word. */
static kiln_status encode_segment(const kiln_tokenizer_t *t, kiln__bpe_scratch *sc, kiln__pretok *pt,
                                  const uint8_t *seg, size_t n, bool at_start, id_sink *out)
{
    uint8_t *norm = NULL, *ms = NULL; /* the segment rewritten, when the tokenizer says so */
    kiln_status st = KILN_OK;
    if (t->n_norm && n) {
        st = kiln__normalize_all(t->norm, t->n_norm, seg, n, &norm, &n);
        if (st != KILN_OK) return st;
        seg = norm;
    }
    /* A segment the normalizer left empty stays empty, as in `tokenizers`. */
    if (t->char_level && t->metaspace && n) {
        st = kiln__metaspace_apply(&t->ms, seg, n, at_start, &ms, &n);
        seg = ms;
    }
    if (!t->char_level) kiln__pretok_restart(pt);
    for (size_t i = 0; i < n && st == KILN_OK;) {
        size_t j = next_word(t, pt, seg, n, i);
        if (j - i == 1 && !t->char_level && t->byte_id[seg[i]] >= 0) {
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
    KILN__FREE(norm, ms);
    return st;
}

/* The first place at or after from where the special token tp[0..tl) occurs in s[0..len)
 * and overlaps none of the plain spans; SIZE_MAX when there is none. */
static size_t special_at(const uint8_t *s, size_t len, size_t from, const uint8_t *tp, size_t tl,
                         const kiln_text_span *plain, int n_plain)
{
    while (tl && from < len) {
        const uint8_t *h = kiln__find_bytes(s + from, len - from, tp, tl);
        if (!h) return SIZE_MAX;
        size_t at = (size_t)(h - s);
        int k = 0;
        while (k < n_plain && plain[k].end <= at) k++;
        if (k == n_plain || plain[k].begin >= at + tl) return at; /* (spans sorted: the first that may overlap) */
        from = at + 1;
    }
    return SIZE_MAX;
}

static kiln_status encode(const kiln_tokenizer_t *t, const char *text, size_t len, const kiln_text_span *plain,
                          int n_plain, int32_t *ids, size_t cap, size_t *n_out);

kiln_status kiln_tokenizer_encode(const kiln_tokenizer_t *t, const char *text, size_t len, int32_t *ids,
                                  size_t cap, size_t *n_out)
{
    return encode(t, text, len, NULL, 0, ids, cap, n_out);
}

static kiln_status encode(const kiln_tokenizer_t *t, const char *text, size_t len, const kiln_text_span *plain,
                          int n_plain, int32_t *ids, size_t cap, size_t *n_out)
{
    if (!t || !n_out || (!text && len) || (!ids && cap) || (!plain && n_plain))
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
            size_t tl;
            const uint8_t *tp = kiln__token_text(t, t->special_id[k], &tl);
            hits[k] = special_at(s, len, 0, tp, tl, plain, n_plain);
        }
        kiln__bpe_scratch sc = {0};
        kiln__pretok pt = {0}; /* char-level tokenizers match no pattern */
        if (!t->char_level) {
            pt = kiln__pretok_begin(t->split ? t->split : kiln__regex_gpt2());
            if (!pt.md) st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_encode: out of memory for the pre-tokenizer");
        }
        size_t pos = 0;
        while (st == KILN_OK && pos < len) {
            size_t best = len, best_len = 0;
            int32_t best_id = -1;
            for (int k = 0; k < t->n_special; k++) {
                int32_t id = t->special_id[k];
                size_t tl;
                const uint8_t *tp = kiln__token_text(t, id, &tl);
                if (hits[k] != SIZE_MAX && hits[k] < pos) hits[k] = special_at(s, len, pos, tp, tl, plain, n_plain);
                if (hits[k] != SIZE_MAX && (hits[k] < best || (hits[k] == best && tl > best_len))) {
                    best = hits[k];
                    best_len = tl;
                    best_id = id;
                }
            }
            st = encode_segment(t, &sc, &pt, s + pos, best - pos, pos == 0, &out);
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

kiln_status kiln_tokenizer_encode_new(const kiln_tokenizer_t *t, const char *text, size_t len, size_t extra,
                                      int32_t **ids, size_t *n_out)
{
    return kiln_tokenizer_encode_plain_new(t, text, len, NULL, 0, extra, ids, n_out);
}

kiln_status kiln_tokenizer_encode_plain_new(const kiln_tokenizer_t *t, const char *text, size_t len,
                                            const kiln_text_span *plain, int n_plain, size_t extra, int32_t **ids,
                                            size_t *n_out)
{
    if (!ids || !n_out) return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode_new: NULL ids or n_out");
    for (int k = 0; k < n_plain; k++)
        if (plain[k].begin > plain[k].end || plain[k].end > len || (k && plain[k].begin < plain[k - 1].end))
            return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode_plain_new: span %d [%zu, %zu) is not sorted, "
                              "apart from the others and within the %zu-byte text", k, plain[k].begin, plain[k].end, len);
    *ids = NULL;
    *n_out = 0;
    /* an id a byte is almost always enough; the rare text that makes more is encoded
     * again at the size the first pass found */
    size_t cap = len + 16, n = 0;
    if (len > SIZE_MAX / 2 / sizeof(int32_t) || extra > SIZE_MAX / 2 / sizeof(int32_t))
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode_new: %zu bytes and %zu more ids are too many", len, extra);
    for (int pass = 0; pass < 2; pass++) {
        int32_t *buf = malloc(sizeof *buf * (cap + extra));
        if (!buf) return kiln_error(KILN_ERR_OOM, "kiln_tokenizer_encode: out of memory for %zu ids", cap + extra);
        kiln_status s = encode(t, text, len, plain, n_plain, buf, cap, &n);
        if (s == KILN_OK) {
            *ids = buf;
            *n_out = n;
            return KILN_OK;
        }
        free(buf);
        if (s != KILN_ERR_ARG || n <= cap) return s;
        kiln_clear_error();
        cap = n;
    }
    return kiln_error(KILN_ERR_INTERNAL, "kiln_tokenizer_encode: the ids did not fit twice");
}

/* The first token as the Metaspace decoder writes it: its string in the file without
 * its reps (the prefix they stand for), where later tokens' reps are spaces. Writes to
 * dst (room for its string's length) and returns the count. */
static size_t metaspace_first(const kiln_tokenizer_t *t, int32_t id, char *dst)
{
    size_t n, rn = strlen(t->dec.ms.rep), o = 0;
    const uint8_t *p = kiln__token_text(t, id, &n);
    for (size_t k = 0; k < n;) {
        if (k + rn <= n && memcmp(p + k, t->dec.ms.rep, rn) == 0)
            k += rn;
        else
            dst[o++] = (char)p[k++];
    }
    return o;
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
    const kiln__decoder *d = &t->dec;
    bool ms_first = n && t->char_level && d->is_metaspace && d->ms.prepend != KILN__PREPEND_NEVER;
    size_t first_len = 0;
    if (ms_first) kiln__token_text(t, ids[0], &first_len);
    char *s = malloc(total + first_len + 1);
    if (!s)
        return kiln_error(KILN_ERR_OOM, "kiln_tokenizer_decode: out of memory for %zu bytes", total);
    size_t o = ms_first ? metaspace_first(t, ids[0], s) : 0;
    for (size_t i = ms_first ? 1 : 0; i < n; i++) {
        size_t a = t->tok_off[ids[i]], l = t->tok_off[ids[i] + 1] - a;
        memcpy(s + o, t->tok_bytes + a, l);
        o += l;
    }
    /* Strip after Fuse: the text loses up to dec.strip leading strip_char. */
    if (t->char_level && d->strip > 0) {
        size_t c = strlen(d->strip_char), from = 0;
        for (int k = 0; k < d->strip && from + c <= o && memcmp(s + from, d->strip_char, c) == 0; k++)
            from += c;
        memmove(s, s + from, o - from);
        o -= from;
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
