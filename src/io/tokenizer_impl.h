/* Private layout of tokenizers, shared by tokenizer.c (API, encode, decode),
 * tokenizer_json.c (tokenizer.json), bpe.c (merge application, training) and pretok.c
 * (pre-tokenizers, normalizers). */
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

/* One normalizer step: a Unicode normal form, Prepend(content) (put before a text
 * that is not empty) or Replace(pattern -> content) of a literal pattern. */
enum {
    KILN__NORM_NONE,
    KILN__NORM_NFC,
    KILN__NORM_NFD,
    KILN__NORM_NFKC,
    KILN__NORM_NFKD,
    KILN__NORM_PREPEND,
    KILN__NORM_REPLACE,
    KILN__NORM_COUNT
};
extern const char *const kiln__norm_names[KILN__NORM_COUNT]; /* "", "NFC", ..., "Prepend", "Replace" */
typedef struct {
    int kind;
    char *pattern; /* Replace */
    char *content; /* Prepend, Replace */
} kiln__norm;

/* Metaspace (pre-tokenizer or decoder): spaces become `rep` (one character, as UTF-8);
 * rep is put before a text that does not start with it always, only before the text
 * that starts at the input's first byte (first: not after a special token), or never;
 * with split, each rep starts a new word. */
enum { KILN__PREPEND_ALWAYS, KILN__PREPEND_FIRST, KILN__PREPEND_NEVER };
typedef struct {
    char rep[5];
    int prepend;
    bool split;
} kiln__metaspace;

/* A char-level tokenizer's decoder: Metaspace (ms), or a Sequence of Replace steps,
 * ByteFallback, Fuse and Strip(strip_char, strip, 0), in that order. */
typedef struct {
    bool is_metaspace;
    kiln__metaspace ms;
    kiln__norm *replace; /* KILN__NORM_REPLACE steps, in order */
    int n_replace;
    bool byte_fallback, fuse;
    int strip; /* how many leading strip_char the decoded text loses; -1: no Strip */
    char strip_char[5];
} kiln__decoder;

struct kiln_tokenizer {
    bool is_byte;
    int n_vocab;
    /* Token id -> the bytes it decodes to: tok_bytes[tok_off[i] .. tok_off[i+1]). */
    uint8_t *tok_bytes;
    size_t *tok_off;
    /* Byte-level: the single-byte token for each byte, -1 where the vocab has none (such
     * a byte becomes unk_id or nothing: bpe.c). Char-level: the byte-fallback token
     * "<0xXX>" of each byte, -1 where the vocab has none. */
    int32_t byte_id[256];
    /* Merges in rank order; merge r joins merge_a[r], merge_b[r] into merge_id[r]. */
    int n_merges;
    int32_t *merge_a, *merge_b, *merge_id;
    kiln__u64map merge_rank; /* pair_key(a, b) -> rank */
    /* Special tokens, matched literally in the text before pre-tokenization. */
    int n_special;
    int32_t *special_id;
    bool *special_flag; /* per special_id: the file's "special" (false: a plain added token) */
    /* Byte-level: the pre-tokenizer's pattern (a Split before a ByteLevel without its
     * own regex), or NULL for ByteLevel's GPT-2 pattern. */
    struct kiln__regex *split;
    /* The normalizer: steps applied in order to the text between special tokens (a
     * Sequence in the file, unless norm_seq is false and there is one step). */
    kiln__norm *norm;
    int n_norm;
    bool norm_seq;
    /* Char-level (SentencePiece-style) BPE, as LLaMA-2 and Mistral ship it: the vocab's
     * strings are text; a word's symbols are its characters, looked up in char_id; a
     * character the vocab lacks becomes its bytes' "<0xXX>" tokens (byte_fallback),
     * else unk_id (one for a run of them with fuse_unk), else nothing. tok_str holds
     * each id's string as the file spells it (tok_str[str_off[i] .. str_off[i+1])),
     * tok_bytes what the decoder makes of it. */
    bool char_level;
    uint8_t *tok_str;
    size_t *str_off;
    kiln__u64map char_id; /* kiln__char_key(character) -> id */
    int32_t unk_id;       /* -1: none */
    bool fuse_unk, byte_fallback;
    bool metaspace;       /* pre-tokenizer Metaspace (ms); else none: a segment is one word */
    kiln__metaspace ms;
    /* A character (UTF-8; "" none) before which a word may be cut, where it follows
     * another character, without changing the ids: no merge can join across such a
     * place (tokenizer_json.c checks the vocab). What keeps a LLaMA-2 text from being
     * one word of its own length. */
    char cut[5];
    kiln__decoder dec;
    /* The end and start of a text as the file names them (a GGUF file's eos and bos
     * token ids); -1: found by their names among the special tokens (tokenizer.c). */
    int32_t eot_id, bos_id;
    bool add_bos; /* kiln_tokenizer_adds_bos */
};

/* The tokenizer a tokenizer.json's document describes (root, a json_t; what names it in
 * messages): the loader behind kiln_tokenizer_load, and the GGUF reader's, which builds
 * such a document from a file's metadata (gguf_tokenizer.c). */
struct json_t;
kiln_status kiln__tokenizer_from_json(const struct json_t *root, const char *what, kiln_tokenizer_t **out);

/* A character of k bytes (1 to 4) as a u64map key. */
static inline uint64_t kiln__char_key(const uint8_t *s, size_t k)
{
    uint64_t v = k;
    for (size_t i = 0; i < k; i++)
        v |= (uint64_t)s[i] << (8 + 8 * i);
    return v;
}

/* s[0..n) in normal form `form` (utf8proc): a new buffer in *out (*out_n bytes; the
 * caller frees). Runs that are not UTF-8 are kept as they are. */
kiln_status kiln__normalize(int form, const uint8_t *s, size_t n, uint8_t **out, size_t *out_n);
/* s[0..n) after the steps norm[0..k) in order: a new buffer in *out (*out_n bytes; the
 * caller frees). */
kiln_status kiln__normalize_all(const kiln__norm *norm, int k, const uint8_t *s, size_t n, uint8_t **out,
                                size_t *out_n);
/* s[0..n) (n > 0) as Metaspace rewrites it (at_start: s starts at the input's first
 * byte): a new buffer in *out (*out_n bytes; the caller frees). */
kiln_status kiln__metaspace_apply(const kiln__metaspace *ms, const uint8_t *s, size_t n, bool at_start,
                                  uint8_t **out, size_t *out_n);
/* s[0..n) with every occurrence of pat[0..pn) (pn > 0), left to right and not
 * overlapping, replaced by rep[0..rn): a new buffer (*out_n bytes), NULL when out of
 * memory. */
uint8_t *kiln__replace_all(const uint8_t *s, size_t n, const char *pat, size_t pn, const char *rep, size_t rn,
                           size_t *out_n);
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
 * s->sym and returns how many; -1 when out of memory. The word's symbols are its bytes
 * (byte-level) or its characters (char-level: vocab, byte fallback, unk). */
long kiln__bpe_word(const kiln_tokenizer_t *t, kiln__bpe_scratch *s, const uint8_t *w, size_t n);
void kiln__bpe_scratch_free(kiln__bpe_scratch *s);

/* A new, empty tokenizer with room for n_vocab tokens whose bytes total nbytes. */
kiln_tokenizer_t *kiln__tokenizer_alloc(int n_vocab, size_t nbytes, int n_merges, int n_special);
/* The text a special token is matched by: its string in the file. */
const uint8_t *kiln__token_text(const kiln_tokenizer_t *t, int32_t id, size_t *len);
/* Frees a normalizer's (or decoder's) steps norm[0..k) and the array. */
void kiln__norm_free(kiln__norm *norm, int k);
/* Fills merge_rank from merge_a/merge_b; of two equal pairs the later wins, as in
 * `tokenizers`. False when out of memory. */
bool kiln__tokenizer_index_merges(kiln_tokenizer_t *t);

#endif
