/* Private layout of tokenizers, shared by tokenizer.c (API, tokenizer.json) and bpe.c
 * (pre-tokenizer, merge application, training). */
#ifndef KILN_IO_TOKENIZER_IMPL_H
#define KILN_IO_TOKENIZER_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kiln/tokenizer.h"

#define KILN__EOT_TEXT "<|endoftext|>"

/* Open-addressing map from a 64-bit key to an int32 value; the key ~0 is reserved. */
typedef struct {
    uint64_t *keys;
    int32_t *vals;
    size_t cap; /* a power of two, or 0 */
    size_t count;
} kiln__u64map;

bool kiln__u64map_put(kiln__u64map *m, uint64_t key, int32_t val); /* false when out of memory */
int32_t kiln__u64map_get(const kiln__u64map *m, uint64_t key);     /* -1 when absent */
void kiln__u64map_clear(kiln__u64map *m);

static inline uint64_t kiln__pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

struct kiln_tokenizer {
    bool is_byte;
    int n_vocab;
    /* Token id -> its bytes: tok_bytes[tok_off[i] .. tok_off[i+1]). */
    uint8_t *tok_bytes;
    size_t *tok_off;
    int32_t byte_id[256]; /* the single-byte token for each byte */
    /* Merges in rank order; merge r joins merge_a[r], merge_b[r] into merge_id[r]. */
    int n_merges;
    int32_t *merge_a, *merge_b, *merge_id;
    kiln__u64map merge_rank; /* pair_key(a, b) -> rank */
    /* Special tokens, matched literally in the text before pre-tokenization. */
    int n_special;
    int32_t *special_id;
    /* The pre-tokenizer's pattern (a Split before a ByteLevel without its own regex),
     * or NULL for ByteLevel's GPT-2 pattern. */
    struct kiln__regex *split;
    /* Unicode normalization of the text before pre-tokenization (the tokenizer.json's
     * normalizer): KILN__NORM_NONE, or one of the four forms. */
    int normalizer;
};

enum { KILN__NORM_NONE, KILN__NORM_NFC, KILN__NORM_NFD, KILN__NORM_NFKC, KILN__NORM_NFKD };
extern const char *const kiln__norm_names[5]; /* "", "NFC", "NFD", "NFKC", "NFKD" */
/* s[0..n) in normal form `form` (utf8proc): a new buffer in *out (*out_n bytes; the
 * caller frees). Runs that are not UTF-8 are kept as they are. */
kiln_status kiln__normalize(int form, const uint8_t *s, size_t n, uint8_t **out, size_t *out_n);
/* The length of the valid UTF-8 character at s[i], or 0 when none starts there. */
size_t kiln__utf8_len(const uint8_t *s, size_t n, size_t i);

/* A compiled pre-tokenizer pattern (pretok.c, PCRE2 with Unicode properties). */
typedef struct kiln__regex kiln__regex;
extern const char *const kiln__gpt2_pattern;
/* what names the pattern's owner in the message when it does not compile. */
kiln_status kiln__regex_new(const char *pattern, const char *what, kiln__regex **out);
void kiln__regex_free(kiln__regex *r);
const char *kiln__regex_pattern(const kiln__regex *r);
/* GPT-2's pattern, compiled once (NULL only when out of memory). */
const kiln__regex *kiln__regex_gpt2(void);

/* Pre-tokenizing one text: a pattern and its match state (one per thread at a time). */
typedef struct {
    const kiln__regex *re;
    void *md;        /* pcre2_match_data */
    int error;       /* a PCRE2 error that stopped it (the match limit, memory), or 0 */
    const uint8_t *text;
    size_t n, run_from, run_end; /* the valid UTF-8 run of text last matched in */
    size_t match_from, match_to; /* the match after the last gap returned (match_to 0: none) */
} kiln__pretok;
kiln__pretok kiln__pretok_begin(const kiln__regex *r);
void kiln__pretok_end(kiln__pretok *p);
/* Before a new text: what was found in the last one (its runs, a match past a gap) is
 * forgotten, even if the new text lies at the same address (a buffer freed and made
 * again). */
void kiln__pretok_restart(kiln__pretok *p);
/* The end of the pre-token that starts at s[i] (i < n): the pattern's match there, or
 * the text up to its next match. */
size_t kiln__pretok_next(kiln__pretok *p, const uint8_t *s, size_t n, size_t i);
/* After a p->error: PCRE2's message for it, in buf. */
const char *kiln__pretok_error(const kiln__pretok *p, char *buf, size_t n);

/* The first occurrence of needle[0..m) (m > 0) in hay[0..n), or NULL. */
const uint8_t *kiln__find_bytes(const uint8_t *hay, size_t n, const uint8_t *needle, size_t m);

/* Scratch space for kiln__bpe_word, reused across words to avoid a malloc per word. */
typedef struct {
    int32_t *sym, *prev, *next;
    uint64_t *heap; /* (rank << 32 | pos), a min-heap */
    size_t cap, heap_len;
} kiln__bpe_scratch;

/* Applies t's merges to the pre-token w[0..n) (n > 0): writes its ids to the front of
 * s->sym and returns how many; -1 when out of memory. */
long kiln__bpe_word(const kiln_tokenizer_t *t, kiln__bpe_scratch *s, const uint8_t *w, size_t n);
void kiln__bpe_scratch_free(kiln__bpe_scratch *s);

/* A new, empty tokenizer with room for n_vocab tokens whose bytes total nbytes. */
kiln_tokenizer_t *kiln__tokenizer_alloc(int n_vocab, size_t nbytes, int n_merges, int n_special);
/* Fills merge_rank from merge_a/merge_b; of two equal pairs the later wins, as in
 * `tokenizers`. False when out of memory. */
bool kiln__tokenizer_index_merges(kiln_tokenizer_t *t);

#endif
