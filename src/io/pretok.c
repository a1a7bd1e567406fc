/* Pre-tokenizers and normalizers: Metaspace, the normalizer steps (Unicode forms by
 * utf8proc, Prepend, Replace of a string), and the regular expressions of byte-level
 * pre-tokenizers.
 *
 * The regular expressions are matched by PCRE2 (Debian's libpcre2) with Unicode
 * character properties, as the `tokenizers` library matches them: \p{L}, \p{N} and \s
 * are Unicode's classes, not ASCII's. A pre-token is a match, or the text between two
 * matches (the "Isolated" split of `tokenizers`, which keeps both).
 *
 * Text need not be UTF-8. It is matched a valid run at a time: each run's end is found
 * once (the scan moves forward with the pieces, so a text is scanned once in all), the
 * pattern sees only the run (PCRE2_NO_UTF_CHECK, so PCRE2 does not check the rest of the
 * text again on every call, which made the interpreter quadratic where JIT is not
 * allowed), and each byte of an invalid sequence is a piece of its own. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>
#include <stdatomic.h>
#include <utf8proc.h>
#include <stdlib.h>
#include <string.h>
#include "io/tokenizer_impl.h"

struct kiln__regex {
    pcre2_code *re;
    char *pattern; /* as given, for tokenizer.json */
};

/* GPT-2's pre-tokenizer (ByteLevel with use_regex, in `tokenizers`' spelling). */
const char *const kiln__gpt2_pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

kiln_status kiln__regex_new(const char *pattern, const char *what, kiln__regex **out)
{
    *out = NULL;
    int code;
    PCRE2_SIZE at;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP, &code, &at, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return kiln_error(KILN_ERR_FORMAT, "%s: the pattern does not compile at offset %zu: %s", what, (size_t)at,
                          (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* interpreted when JIT is not there */
    kiln__regex *r = calloc(1, sizeof *r);
    if (r) r->pattern = strdup(pattern);
    if (!r || !r->pattern) {
        pcre2_code_free(re);
        free(r);
        return kiln_error(KILN_ERR_OOM, "%s: out of memory", what);
    }
    r->re = re;
    *out = r;
    return KILN_OK;
}

void kiln__regex_free(kiln__regex *r)
{
    if (!r) return;
    pcre2_code_free(r->re);
    free(r->pattern);
    free(r);
}

const char *kiln__regex_pattern(const kiln__regex *r) { return r->pattern; }

/* Compiled on first use and kept; a compile that fails (out of memory) is tried again
 * at the next use rather than remembered, as pthread_once would. */
static _Atomic(kiln__regex *) gpt2;
static pthread_mutex_t gpt2_lock = PTHREAD_MUTEX_INITIALIZER;

const kiln__regex *kiln__regex_gpt2(void)
{
    kiln__regex *r = atomic_load(&gpt2);
    if (r) return r;
    pthread_mutex_lock(&gpt2_lock);
    if (!(r = atomic_load(&gpt2)) && kiln__regex_new(kiln__gpt2_pattern, "GPT-2 pre-tokenizer", &r) == KILN_OK)
        atomic_store(&gpt2, r);
    pthread_mutex_unlock(&gpt2_lock);
    return atomic_load(&gpt2);
}

kiln__pretok kiln__pretok_begin(const kiln__regex *r)
{
    return (kiln__pretok){.re = r, .md = r ? (void *)pcre2_match_data_create_from_pattern(r->re, NULL) : NULL};
}

void kiln__pretok_restart(kiln__pretok *p) { p->text = NULL, p->match_to = 0; }

void kiln__pretok_end(kiln__pretok *p)
{
    pcre2_match_data_free((pcre2_match_data *)p->md);
    p->md = NULL;
}

/* The length of the valid UTF-8 character at s[i] (as PCRE2 takes it: no overlong
 * forms, no surrogates, nothing above U+10FFFF), or 0 when none starts there. */
size_t kiln__utf8_len(const uint8_t *s, size_t n, size_t i)
{
    uint8_t c = s[i];
    if (c < 0x80) return 1;
    size_t k = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    if (!k || i + k > n) return 0;
    for (size_t j = 1; j < k; j++)
        if ((s[i + j] & 0xc0) != 0x80) return 0;
    uint8_t d = s[i + 1];
    if ((c == 0xe0 && d < 0xa0) || (c == 0xed && d > 0x9f) || (c == 0xf0 && d < 0x90) || (c == 0xf4 && d > 0x8f))
        return 0;
    return k;
}

size_t kiln__pretok_next(kiln__pretok *p, const uint8_t *s, size_t n, size_t i)
{
    if (!p->md || p->error) return n;
    /* the valid run i lies in, [i, run_end) (found once as the pieces move on) */
    if (p->text != s || p->n != n || i >= p->run_end || i < p->run_from) {
        size_t k = kiln__utf8_len(s, n, i);
        if (!k) return i + 1; /* a byte of an invalid sequence: a piece of its own */
        size_t e = i;
        while (e < n && (k = kiln__utf8_len(s, n, e))) e += k;
        p->text = s, p->n = n, p->run_from = i, p->run_end = e, p->match_to = 0;
    }
    /* the match found past the gap that the last call ended at */
    if (p->match_to > i && p->match_from == i) return p->match_to;
    int rc = pcre2_match(p->re->re, (PCRE2_SPTR)s, p->run_end, i, PCRE2_NO_UTF_CHECK, (pcre2_match_data *)p->md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) return p->run_end; /* no match to the run's end: one gap */
    if (rc < 0) { /* the match limit, memory: an error for the caller, never a silent split */
        p->error = rc;
        return n;
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer((pcre2_match_data *)p->md);
    if (ov[0] > i) { /* the gap before the next match, which the next call takes */
        p->match_from = ov[0], p->match_to = ov[1];
        return ov[0];
    }
    if (ov[1] > i) return ov[1];
    return i + kiln__utf8_len(s, n, i); /* an empty match: one character on its own */
}

const char *kiln__pretok_error(const kiln__pretok *p, char *buf, size_t n)
{
    pcre2_get_error_message(p->error, (PCRE2_UCHAR *)buf, n);
    return buf;
}

/* ---- normalizers ---- */

const char *const kiln__norm_names[KILN__NORM_COUNT] = {"", "NFC", "NFD", "NFKC", "NFKD", "Prepend", "Replace"};

kiln_status kiln__normalize(int form, const uint8_t *s, size_t n, uint8_t **out, size_t *out_n)
{
    static const utf8proc_option_t opts[KILN__NORM_PREPEND] = {
        0, UTF8PROC_STABLE | UTF8PROC_COMPOSE, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE,
        UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT};
    size_t cap = n + 16, len = 0;
    uint8_t *d = malloc(cap);
    if (!d) return kiln_error(KILN_ERR_OOM, "tokenizer: out of memory normalizing %zu bytes", n);
    for (size_t i = 0; i < n;) {
        size_t e = i, k;
        while (e < n && (k = kiln__utf8_len(s, n, e))) e += k;
        uint8_t *m = NULL;
        utf8proc_ssize_t got = e > i ? utf8proc_map(s + i, (utf8proc_ssize_t)(e - i), &m, opts[form]) : 0;
        if (got < 0) {
            free(d);
            return kiln_error(KILN_ERR_ARG, "tokenizer: %s normalization failed: %s", kiln__norm_names[form],
                              utf8proc_errmsg(got));
        }
        size_t more = (size_t)got + (e < n ? 1 : 0);
        if (len + more > cap) {
            while (len + more > cap) cap *= 2;
            uint8_t *t = realloc(d, cap);
            if (!t) {
                free(m);
                free(d);
                return kiln_error(KILN_ERR_OOM, "tokenizer: out of memory normalizing %zu bytes", n);
            }
            d = t;
        }
        if (got) memcpy(d + len, m, (size_t)got);
        len += (size_t)got;
        free(m);
        if (e < n) d[len++] = s[e]; /* a byte of an invalid sequence, as it is */
        i = e < n ? e + 1 : e;
    }
    *out = d;
    *out_n = len;
    return KILN_OK;
}

uint8_t *kiln__replace_all(const uint8_t *s, size_t n, const char *pat, size_t pn, const char *rep, size_t rn,
                           size_t *out_n)
{
    size_t hits = 0;
    for (const uint8_t *p = s, *h; (h = kiln__find_bytes(p, n - (size_t)(p - s), (const uint8_t *)pat, pn));
         p = h + pn)
        hits++;
    size_t len = n - hits * pn + hits * rn, o = 0;
    uint8_t *d = malloc(len ? len : 1);
    if (!d) return NULL;
    const uint8_t *p = s, *h;
    while ((h = kiln__find_bytes(p, n - (size_t)(p - s), (const uint8_t *)pat, pn))) {
        memcpy(d + o, p, (size_t)(h - p));
        o += (size_t)(h - p);
        memcpy(d + o, rep, rn);
        o += rn;
        p = h + pn;
    }
    memcpy(d + o, p, n - (size_t)(p - s));
    *out_n = len;
    return d;
}

kiln_status kiln__normalize_all(const kiln__norm *norm, int k, const uint8_t *s, size_t n, uint8_t **out,
                                size_t *out_n)
{
    uint8_t *cur = NULL; /* the text so far, once a step has made a copy */
    for (int i = 0; i < k; i++) {
        const kiln__norm *z = &norm[i];
        uint8_t *next = NULL;
        size_t m = n;
        if (z->kind < KILN__NORM_PREPEND) {
            kiln_status st = kiln__normalize(z->kind, s, n, &next, &m);
            if (st != KILN_OK) {
                free(cur);
                return st;
            }
        } else if (z->kind == KILN__NORM_PREPEND) {
            if (!n) continue; /* `tokenizers` prepends to a text that is not empty only */
            size_t c = strlen(z->content);
            if ((next = malloc(n + c))) {
                memcpy(next, z->content, c);
                memcpy(next + c, s, n);
                m = n + c;
            }
        } else {
            next = kiln__replace_all(s, n, z->pattern, strlen(z->pattern), z->content, strlen(z->content), &m);
        }
        if (!next) {
            free(cur);
            return kiln_error(KILN_ERR_OOM, "tokenizer: out of memory normalizing %zu bytes", n);
        }
        free(cur);
        cur = next;
        s = cur;
        n = m;
    }
    if (!cur && !(cur = malloc(n ? n : 1)))
        return kiln_error(KILN_ERR_OOM, "tokenizer: out of memory normalizing %zu bytes", n);
    if (s != cur) memcpy(cur, s, n);
    *out = cur;
    *out_n = n;
    return KILN_OK;
}

void kiln__norm_free(kiln__norm *norm, int k)
{
    for (int i = 0; norm && i < k; i++) {
        free(norm[i].pattern);
        free(norm[i].content);
    }
    free(norm);
}

/* ---- Metaspace ---- */

kiln_status kiln__metaspace_apply(const kiln__metaspace *ms, const uint8_t *s, size_t n, bool at_start,
                                  uint8_t **out, size_t *out_n)
{
    size_t rn = strlen(ms->rep), m;
    uint8_t *d = kiln__replace_all(s, n, " ", 1, ms->rep, rn, &m);
    if (!d) return kiln_error(KILN_ERR_OOM, "tokenizer: out of memory for Metaspace on %zu bytes", n);
    /* The check looks at the text after its spaces became rep, as `tokenizers` does. */
    bool has = m >= rn && memcmp(d, ms->rep, rn) == 0;
    if (!has && (ms->prepend == KILN__PREPEND_ALWAYS || (ms->prepend == KILN__PREPEND_FIRST && at_start))) {
        uint8_t *e = realloc(d, m + rn);
        if (!e) {
            free(d);
            return kiln_error(KILN_ERR_OOM, "tokenizer: out of memory for Metaspace on %zu bytes", n);
        }
        memmove(e + rn, e, m);
        memcpy(e, ms->rep, rn);
        d = e;
        m += rn;
    }
    *out = d;
    *out_n = m;
    return KILN_OK;
}
