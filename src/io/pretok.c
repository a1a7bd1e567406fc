/* Pre-tokenizers' regular expressions, matched by PCRE2 (Debian's libpcre2) with Unicode
 * character properties, as the `tokenizers` library matches them: \p{L}, \p{N} and \s
 * are Unicode's classes, not ASCII's. A pre-token is a match, or the text between two
 * matches (the "Isolated" split of `tokenizers`, which keeps both). Text that is not
 * valid UTF-8 is matched all the same (PCRE2_MATCH_INVALID_UTF: an invalid byte matches
 * nothing, so it falls in a gap of its own), never read past its end. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>
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
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &code, &at, NULL);
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

static kiln__regex *gpt2;
static pthread_once_t gpt2_once = PTHREAD_ONCE_INIT;
static void gpt2_init(void) { kiln__regex_new(kiln__gpt2_pattern, "GPT-2 pre-tokenizer", &gpt2); }

const kiln__regex *kiln__regex_gpt2(void)
{
    pthread_once(&gpt2_once, gpt2_init);
    return gpt2;
}

kiln__pretok kiln__pretok_begin(const kiln__regex *r)
{
    return (kiln__pretok){r, r ? (void *)pcre2_match_data_create_from_pattern(r->re, NULL) : NULL};
}

void kiln__pretok_end(kiln__pretok *p)
{
    pcre2_match_data_free((pcre2_match_data *)p->md);
    p->md = NULL;
}

/* The length of the UTF-8 character at s[i] (1 for a byte that starts none). */
static size_t char_len(const uint8_t *s, size_t n, size_t i)
{
    size_t k = s[i] >= 0xf0 ? 4 : s[i] >= 0xe0 ? 3 : s[i] >= 0xc0 ? 2 : 1;
    return i + k <= n ? k : 1;
}

size_t kiln__pretok_next(kiln__pretok *p, const uint8_t *s, size_t n, size_t i)
{
    if (!p->md) return n; /* out of memory at begin: the rest as one piece */
    int rc = pcre2_match(p->re->re, (PCRE2_SPTR)s, n, i, 0, (pcre2_match_data *)p->md, NULL);
    if (rc < 0) return n; /* no match to the end: the rest is one gap */
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer((pcre2_match_data *)p->md);
    if (ov[0] > i) return ov[0]; /* the gap before the next match */
    if (ov[1] > i) return ov[1];
    return i + char_len(s, n, i); /* an empty match: one character on its own */
}
