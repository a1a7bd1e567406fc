/* BPE: applying merges to a word (byte-level, or char-level with byte fallback), and
 * training byte-level merges. */
#include <stdlib.h>
#include <string.h>
#include "io/tokenizer_impl.h"
#include "core/util.h"

/* ---- u64 -> int32 map ---------------------------------------------------------------- */

#define U64MAP_EMPTY UINT64_MAX

static size_t hash_u64(uint64_t k) { return (size_t)kiln__mix64(k); }

static bool u64map_grow(kiln__u64map *m)
{
    size_t cap = m->cap ? m->cap * 2 : 64;
    uint64_t *keys = malloc(cap * sizeof *keys);
    int32_t *vals = malloc(cap * sizeof *vals);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return false;
    }
    memset(keys, 0xff, cap * sizeof *keys);
    for (size_t i = 0; i < m->cap; i++) {
        if (m->keys[i] == U64MAP_EMPTY)
            continue;
        size_t j = hash_u64(m->keys[i]) & (cap - 1);
        while (keys[j] != U64MAP_EMPTY)
            j = (j + 1) & (cap - 1);
        keys[j] = m->keys[i];
        vals[j] = m->vals[i];
    }
    free(m->keys);
    free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap = cap;
    return true;
}

bool kiln__u64map_put(kiln__u64map *m, uint64_t key, int32_t val)
{
    /* Keep the load under 1/2 so probes stay short. */
    if ((m->count + 1) * 2 > m->cap && !u64map_grow(m))
        return false;
    size_t j = hash_u64(key) & (m->cap - 1);
    while (m->keys[j] != U64MAP_EMPTY && m->keys[j] != key)
        j = (j + 1) & (m->cap - 1);
    if (m->keys[j] == U64MAP_EMPTY)
        m->count++;
    m->keys[j] = key;
    m->vals[j] = val;
    return true;
}

int32_t kiln__u64map_get(const kiln__u64map *m, uint64_t key)
{
    if (!m->cap)
        return -1;
    size_t j = hash_u64(key) & (m->cap - 1);
    while (m->keys[j] != U64MAP_EMPTY) {
        if (m->keys[j] == key)
            return m->vals[j];
        j = (j + 1) & (m->cap - 1);
    }
    return -1;
}

void kiln__u64map_clear(kiln__u64map *m)
{
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

const uint8_t *kiln__find_bytes(const uint8_t *hay, size_t n, const uint8_t *needle, size_t m)
{
    /* memchr for the first byte does the skipping; memmem is not in POSIX 2008. */
    const uint8_t *p = hay, *end = hay + n;
    while (m <= (size_t)(end - p)) {
        p = memchr(p, needle[0], (size_t)(end - p) - m + 1);
        if (!p)
            return NULL;
        if (memcmp(p, needle, m) == 0)
            return p;
        p++;
    }
    return NULL;
}

/* ---- applying merges ------------------------------------------------------------------ */

static bool scratch_reserve(kiln__bpe_scratch *s, size_t n)
{
    if (n <= s->cap)
        return true;
    size_t cap = n < 64 ? 64 : n;
    void *tmp;
    /* Each merge pushes at most two pairs, on top of the n - 1 first ones. */
    if (!KILN__RESIZE(s->sym, cap, tmp) || !KILN__RESIZE(s->prev, cap, tmp) || !KILN__RESIZE(s->next, cap, tmp) ||
        !KILN__RESIZE(s->heap, 3 * cap, tmp))
        return false;
    s->cap = cap;
    return true;
}

void kiln__bpe_scratch_free(kiln__bpe_scratch *s)
{
    KILN__FREE(s->sym, s->prev, s->next, s->heap);
    memset(s, 0, sizeof *s);
}

static void minheap_push(kiln__bpe_scratch *s, uint64_t v)
{
    size_t i = s->heap_len++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (s->heap[p] <= v)
            break;
        s->heap[i] = s->heap[p];
        i = p;
    }
    s->heap[i] = v;
}

static uint64_t minheap_pop(kiln__bpe_scratch *s)
{
    uint64_t top = s->heap[0], v = s->heap[--s->heap_len];
    size_t i = 0, n = s->heap_len;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && s->heap[c + 1] < s->heap[c])
            c++;
        if (v <= s->heap[c])
            break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n)
        s->heap[i] = v;
    return top;
}

static void push_pair(const kiln_tokenizer_t *t, kiln__bpe_scratch *s, int32_t pos)
{
    int32_t r = kiln__u64map_get(&t->merge_rank, kiln__pair_key(s->sym[pos], s->sym[s->next[pos]]));
    if (r >= 0)
        minheap_push(s, (uint64_t)r << 32 | (uint32_t)pos);
}

/* A char-level word's symbols, as `tokenizers`' BPE makes them (merge_word in its
 * models/bpe/model.rs): each character's id in the vocab; for one the vocab lacks, its
 * bytes' "<0xXX>" ids when byte_fallback is on and all of them exist, else the unk id
 * (a run of unknown characters makes one with fuse_unk), else nothing. A byte that
 * starts no valid UTF-8 character is a character of its own, which no vocab string
 * is. Returns the number of symbols in s->sym (at most n). */
static int32_t char_symbols(const kiln_tokenizer_t *t, kiln__bpe_scratch *s, const uint8_t *w, size_t n)
{
    int32_t len = 0;
    bool unk = false; /* an unk symbol not yet written, as `tokenizers` holds it */
    for (size_t i = 0; i < n;) {
        size_t k = kiln__utf8_len(w, n, i);
        int32_t id = k ? kiln__u64map_get(&t->char_id, kiln__char_key(w + i, k)) : -1;
        if (!k) k = 1;
        if (id >= 0) {
            if (unk) s->sym[len++] = t->unk_id, unk = false;
            s->sym[len++] = id;
        } else {
            bool bytes = t->byte_fallback;
            for (size_t j = 0; bytes && j < k; j++)
                bytes = t->byte_id[w[i + j]] >= 0;
            if (bytes) {
                /* written before a pending unk, as `tokenizers` does */
                for (size_t j = 0; j < k; j++)
                    s->sym[len++] = t->byte_id[w[i + j]];
            } else if (t->unk_id >= 0) {
                if (unk && !t->fuse_unk) s->sym[len++] = t->unk_id;
                unk = true;
            }
        }
        i += k;
    }
    if (unk) s->sym[len++] = t->unk_id;
    return len;
}

/* A byte-level word's symbols: each byte's single-byte token. A vocab may lack some
 * bytes (StarCoder's and its descendants' leave out those UTF-8 text never holds, 0xC0,
 * 0xC1, 0xF5-0xFF, and some control bytes); `tokenizers` then writes the unk token for
 * such a byte (one for a run of them with fuse_unk) or, with none, nothing, and the
 * bytes either side become neighbours that may merge. So here. */
static int32_t byte_symbols(const kiln_tokenizer_t *t, kiln__bpe_scratch *s, const uint8_t *w, size_t n)
{
    int32_t len = 0;
    bool unk = false;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[w[i]];
        if (id >= 0) {
            if (unk) s->sym[len++] = t->unk_id, unk = false;
            s->sym[len++] = id;
        } else if (t->unk_id >= 0) {
            if (unk && !t->fuse_unk) s->sym[len++] = t->unk_id;
            unk = true;
        }
    }
    if (unk) s->sym[len++] = t->unk_id;
    return len;
}

long kiln__bpe_word(const kiln_tokenizer_t *t, kiln__bpe_scratch *s, const uint8_t *w, size_t n)
{
    if (!scratch_reserve(s, n))
        return -1;
    int32_t len = (int32_t)n;
    if (t->char_level) len = char_symbols(t, s, w, n);
    else len = byte_symbols(t, s, w, n);
    int32_t end = len;
    for (int32_t i = 0; i < len; i++) {
        s->prev[i] = i - 1;
        s->next[i] = i + 1;
    }
    /* The lowest rank merges first and, among equal ranks, the leftmost: the order
     * `tokenizers` uses, so both give the same ids. sym[i] < 0 marks a symbol that
     * was merged into its left neighbour. */
    s->heap_len = 0;
    for (int32_t i = 0; i + 1 < len; i++)
        push_pair(t, s, i);
    while (s->heap_len) {
        uint64_t top = minheap_pop(s);
        int32_t r = (int32_t)(top >> 32), i = (int32_t)(uint32_t)top;
        if (s->sym[i] < 0 || s->next[i] == end)
            continue;
        int32_t j = s->next[i];
        if (s->sym[i] != t->merge_a[r] || s->sym[j] != t->merge_b[r])
            continue; /* stale: a neighbour changed since this pair was pushed */
        s->sym[i] = t->merge_id[r];
        s->sym[j] = -1;
        s->next[i] = s->next[j];
        if (s->next[i] != end)
            s->prev[s->next[i]] = i;
        if (s->prev[i] >= 0)
            push_pair(t, s, s->prev[i]);
        if (s->next[i] != end)
            push_pair(t, s, i);
    }
    long k = 0;
    for (int32_t i = 0; i != end; i = s->next[i])
        s->sym[k++] = s->sym[i];
    return k;
}

/* ---- training ------------------------------------------------------------------------- */

/* A pair of adjacent symbols across all words: its weighted count and the words it may
 * occur in (a superset: entries go stale as words change, and are checked on use). */
typedef struct {
    int32_t a, b;
    int64_t count;
    int64_t before; /* count at the start of the current merge, when stamp == step */
    int32_t stamp, n_words;
    int32_t *words;
    size_t cap_words;
} train_pair;

typedef struct {
    int64_t count;
    int32_t pair;
} heap_entry;

typedef struct {
    /* Distinct pre-tokens: symbols sym[off[w] .. off[w] + len[w]), seen cnt[w] times. */
    int32_t *sym;
    size_t *off;
    int32_t *len;
    int64_t *cnt;
    int32_t *wstamp;
    int32_t n_words;
    train_pair *pairs;
    int32_t n_pairs;
    size_t cap_pairs;
    kiln__u64map pair_index;
    heap_entry *heap;
    size_t heap_len, heap_cap;
    int32_t *dirty;
    int32_t n_dirty;
    size_t cap_dirty;
    int32_t step;
} trainer;

/* Heap order: larger count first, then the smaller (a, b), so training is deterministic. */
static bool entry_before(const trainer *tr, heap_entry x, heap_entry y)
{
    if (x.count != y.count)
        return x.count > y.count;
    const train_pair *p = &tr->pairs[x.pair], *q = &tr->pairs[y.pair];
    if (p->a != q->a)
        return p->a < q->a;
    return p->b < q->b;
}

static bool heap_push(trainer *tr, int32_t pair)
{
    heap_entry *h = kiln__grow(tr->heap, tr->heap_len, &tr->heap_cap, 1024, sizeof *h);
    if (!h)
        return false;
    tr->heap = h;
    heap_entry e = {tr->pairs[pair].count, pair};
    size_t i = tr->heap_len++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!entry_before(tr, e, tr->heap[p]))
            break;
        tr->heap[i] = tr->heap[p];
        i = p;
    }
    tr->heap[i] = e;
    return true;
}

static heap_entry heap_pop(trainer *tr)
{
    heap_entry top = tr->heap[0], v = tr->heap[--tr->heap_len];
    size_t i = 0, n = tr->heap_len;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && entry_before(tr, tr->heap[c + 1], tr->heap[c]))
            c++;
        if (!entry_before(tr, tr->heap[c], v))
            break;
        tr->heap[i] = tr->heap[c];
        i = c;
    }
    if (n)
        tr->heap[i] = v;
    return top;
}

/* Adds delta occurrences of (a, b) in word w; returns false when out of memory. */
static bool pair_add(trainer *tr, int32_t a, int32_t b, int64_t delta, int32_t w, bool note_word)
{
    uint64_t key = kiln__pair_key(a, b);
    int32_t p = kiln__u64map_get(&tr->pair_index, key);
    if (p < 0) {
        train_pair *np = kiln__grow(tr->pairs, (size_t)tr->n_pairs, &tr->cap_pairs, 4096, sizeof *np);
        if (!np)
            return false;
        tr->pairs = np;
        p = tr->n_pairs;
        if (!kiln__u64map_put(&tr->pair_index, key, p))
            return false;
        tr->n_pairs++;
        tr->pairs[p] = (train_pair){.a = a, .b = b, .stamp = -1};
    }
    train_pair *q = &tr->pairs[p];
    if (q->stamp != tr->step) {
        int32_t *d = kiln__grow(tr->dirty, (size_t)tr->n_dirty, &tr->cap_dirty, 1024, sizeof *d);
        if (!d)
            return false;
        tr->dirty = d;
        tr->dirty[tr->n_dirty++] = p;
        q->stamp = tr->step;
        q->before = q->count;
    }
    q->count += delta;
    if (note_word && (q->n_words == 0 || q->words[q->n_words - 1] != w)) {
        int32_t *nw = kiln__grow(q->words, (size_t)q->n_words, &q->cap_words, 4, sizeof *nw);
        if (!nw)
            return false;
        q->words = nw;
        q->words[q->n_words++] = w;
    }
    return true;
}

/* Pushes a fresh heap entry for every pair whose count grew in this step; entries of
 * pairs that shrank are left stale and corrected when they reach the top. */
static bool flush_dirty(trainer *tr)
{
    for (int32_t k = 0; k < tr->n_dirty; k++) {
        int32_t p = tr->dirty[k];
        if (tr->pairs[p].count > tr->pairs[p].before && !heap_push(tr, p))
            return false;
    }
    tr->n_dirty = 0;
    return true;
}

/* Replaces each (a, b) in word w by x, updating the pair counts. */
static bool merge_word(trainer *tr, int32_t w, int32_t a, int32_t b, int32_t x)
{
    int32_t *s = tr->sym + tr->off[w], n = tr->len[w];
    int64_t c = tr->cnt[w];
    int32_t i = 0;
    while (i + 1 < n && !(s[i] == a && s[i + 1] == b))
        i++;
    if (i + 1 >= n)
        return true; /* a stale entry in the pair's word list */
    /* Words are short, so taking all of the word's pairs out and putting the new ones
     * back is simpler than patching neighbours, and as fast. */
    for (int32_t k = 0; k + 1 < n; k++)
        if (!pair_add(tr, s[k], s[k + 1], -c, w, false))
            return false;
    int32_t m = 0;
    for (int32_t k = 0; k < n; k++) {
        if (k + 1 < n && s[k] == a && s[k + 1] == b) {
            s[m++] = x;
            k++;
        } else {
            s[m++] = s[k];
        }
    }
    tr->len[w] = m;
    for (int32_t k = 0; k + 1 < m; k++)
        if (!pair_add(tr, s[k], s[k + 1], c, w, s[k] == x || s[k + 1] == x))
            return false;
    return true;
}

/* String -> word index, for counting distinct pre-tokens. */
typedef struct {
    const uint8_t **key;
    size_t *klen;
    int32_t *word;
    size_t cap, count;
} word_table;

static size_t hash_bytes(const uint8_t *p, size_t n)
{
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ULL;
    return (size_t)(h ^ (h >> 29));
}

static bool word_table_grow(word_table *wt)
{
    size_t cap = wt->cap ? wt->cap * 2 : 1024;
    const uint8_t **key = calloc(cap, sizeof *key);
    size_t *klen = malloc(cap * sizeof *klen);
    int32_t *word = malloc(cap * sizeof *word);
    if (!key || !klen || !word) {
        KILN__FREE(key, klen, word);
        return false;
    }
    for (size_t i = 0; i < wt->cap; i++) {
        if (!wt->key[i])
            continue;
        size_t j = hash_bytes(wt->key[i], wt->klen[i]) & (cap - 1);
        while (key[j])
            j = (j + 1) & (cap - 1);
        key[j] = wt->key[i];
        klen[j] = wt->klen[i];
        word[j] = wt->word[i];
    }
    KILN__FREE(wt->key, wt->klen, wt->word);
    wt->key = key;
    wt->klen = klen;
    wt->word = word;
    wt->cap = cap;
    return true;
}

/* The word index of p[0..n), adding it as word next_word if new; -1 on OOM. */
static int32_t word_table_find(word_table *wt, const uint8_t *p, size_t n, int32_t next_word, bool *added)
{
    if ((wt->count + 1) * 2 > wt->cap && !word_table_grow(wt))
        return -1;
    size_t j = hash_bytes(p, n) & (wt->cap - 1);
    while (wt->key[j]) {
        if (wt->klen[j] == n && memcmp(wt->key[j], p, n) == 0) {
            *added = false;
            return wt->word[j];
        }
        j = (j + 1) & (wt->cap - 1);
    }
    wt->key[j] = p;
    wt->klen[j] = n;
    wt->word[j] = next_word;
    wt->count++;
    *added = true;
    return next_word;
}

static void word_table_free(word_table *wt)
{
    KILN__FREE(wt->key, wt->klen, wt->word);
}

static void trainer_free(trainer *tr)
{
    KILN__FREE(tr->sym, tr->off, tr->len, tr->cnt, tr->wstamp);
    for (int32_t p = 0; p < tr->n_pairs; p++)
        free(tr->pairs[p].words);
    free(tr->pairs);
    kiln__u64map_clear(&tr->pair_index);
    free(tr->heap);
    free(tr->dirty);
}

/* Splits text into its distinct pre-tokens (also splitting at the special token, which
 * is never learned across) and fills tr's words with their bytes as symbols. */
static kiln_status collect_words(trainer *tr, const uint8_t *text, size_t len)
{
    word_table wt = {0};
    size_t cap_words = 0, n_sym = 0;
    kiln_status st = KILN_OK;
    const size_t eot_len = strlen(KILN__EOT_TEXT);
    kiln__pretok pt = kiln__pretok_begin(kiln__regex_gpt2());
    if (!pt.md) st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_train_bpe: out of memory for the pre-tokenizer");
    size_t seg = 0;
    while (seg < len && st == KILN_OK) {
        const uint8_t *hit = kiln__find_bytes(text + seg, len - seg, (const uint8_t *)KILN__EOT_TEXT, eot_len);
        size_t seg_end = hit ? (size_t)(hit - text) : len;
        kiln__pretok_restart(&pt);
        for (size_t i = seg; i < seg_end;) {
            size_t j = kiln__pretok_next(&pt, text + seg, seg_end - seg, i - seg) + seg;
            if ((size_t)tr->n_words == cap_words) {
                size_t cap = cap_words ? cap_words * 2 : 1024;
                void *tmp;
                if (cap > INT32_MAX || !KILN__RESIZE(tr->off, cap, tmp) || !KILN__RESIZE(tr->len, cap, tmp) ||
                    !KILN__RESIZE(tr->cnt, cap, tmp)) {
                    st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_train_bpe: out of memory counting words");
                    break;
                }
                cap_words = cap;
            }
            if (j - i > INT32_MAX) {
                st = kiln_error(KILN_ERR_ARG, "kiln_tokenizer_train_bpe: a pre-token of %zu bytes is too long",
                               j - i);
                break;
            }
            bool added;
            int32_t w = word_table_find(&wt, text + i, j - i, tr->n_words, &added);
            if (w < 0) {
                st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_train_bpe: out of memory counting words");
                break;
            }
            if (added) {
                tr->off[w] = n_sym;
                tr->len[w] = (int32_t)(j - i);
                tr->cnt[w] = 0;
                n_sym += j - i;
                tr->n_words++;
            }
            tr->cnt[w]++;
            i = j;
        }
        seg = hit ? seg_end + eot_len : len;
    }
    if (st == KILN_OK) {
        tr->sym = malloc((n_sym ? n_sym : 1) * sizeof *tr->sym);
        tr->wstamp = calloc(tr->n_words ? (size_t)tr->n_words : 1, sizeof *tr->wstamp);
        if (!tr->sym || !tr->wstamp)
            st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_train_bpe: out of memory for %zu symbols", n_sym);
    }
    /* The table's keys point into text, so the bytes are copied from there. */
    for (size_t i = 0; st == KILN_OK && i < wt.cap; i++) {
        if (!wt.key[i])
            continue;
        int32_t w = wt.word[i];
        for (size_t k = 0; k < wt.klen[i]; k++)
            tr->sym[tr->off[w] + k] = wt.key[i][k];
    }
    if (st == KILN_OK && pt.error) {
        char why[128];
        st = kiln_error(KILN_ERR_ARG, "kiln_tokenizer_train_bpe: the pre-tokenizer failed: %s",
                        kiln__pretok_error(&pt, why, sizeof why));
    }
    word_table_free(&wt);
    kiln__pretok_end(&pt);
    return st;
}

kiln_status kiln_tokenizer_train_bpe(const char *text, size_t len, int vocab_size, kiln_tokenizer_t **out)
{
    if (!out)
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_train_bpe: out is NULL");
    *out = NULL;
    if (!text && len)
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_train_bpe: text is NULL");
    if (vocab_size < 257)
        return kiln_error(KILN_ERR_ARG,
                         "kiln_tokenizer_train_bpe: vocab_size %d is below 257 (256 bytes + \"%s\")",
                         vocab_size, KILN__EOT_TEXT);
    trainer tr = {0};
    int max_merges = vocab_size - 257;
    int32_t *ma = NULL, *mb = NULL;
    kiln_status st = collect_words(&tr, (const uint8_t *)text, len);
    if (st == KILN_OK) {
        /* Each merge removes at least one symbol, so the text bounds the merges too. */
        size_t n_sym = 0;
        for (int32_t w = 0; w < tr.n_words; w++)
            n_sym += (size_t)tr.len[w];
        if ((size_t)max_merges > n_sym)
            max_merges = (int)n_sym;
        ma = malloc(((size_t)max_merges + 1) * sizeof *ma);
        mb = malloc(((size_t)max_merges + 1) * sizeof *mb);
        if (!ma || !mb)
            st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_train_bpe: out of memory for %d merges", max_merges);
    }
#define TRAIN_OOM() (st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_train_bpe: out of memory for pair counts"))
    for (int32_t w = 0; st == KILN_OK && w < tr.n_words; w++) {
        const int32_t *s = tr.sym + tr.off[w];
        for (int32_t k = 0; k + 1 < tr.len[w]; k++)
            if (!pair_add(&tr, s[k], s[k + 1], tr.cnt[w], w, true)) {
                TRAIN_OOM();
                break;
            }
    }
    if (st == KILN_OK && !flush_dirty(&tr))
        TRAIN_OOM();
    int n_merges = 0;
    while (st == KILN_OK && n_merges < max_merges && tr.heap_len) {
        heap_entry e = heap_pop(&tr);
        train_pair *p = &tr.pairs[e.pair];
        if (p->count <= 0)
            continue;
        if (e.count != p->count) {
            if (!heap_push(&tr, e.pair))
                TRAIN_OOM();
            continue;
        }
        int32_t a = p->a, b = p->b, x = 256 + n_merges;
        ma[n_merges] = a;
        mb[n_merges] = b;
        n_merges++;
        tr.step++;
        /* p->words is not appended to while merging: only pairs holding x gain words. */
        int32_t n_words = p->n_words;
        int32_t *words = p->words;
        for (int32_t k = 0; k < n_words && st == KILN_OK; k++) {
            int32_t w = words[k];
            if (tr.wstamp[w] == tr.step)
                continue;
            tr.wstamp[w] = tr.step;
            if (!merge_word(&tr, w, a, b, x))
                TRAIN_OOM();
        }
        p = &tr.pairs[e.pair]; /* pair_add may have moved the array */
        free(p->words);
        p->words = NULL;
        p->n_words = 0;
        p->cap_words = 0;
        if (st == KILN_OK && !flush_dirty(&tr))
            TRAIN_OOM();
    }
#undef TRAIN_OOM
    kiln_tokenizer_t *t = NULL;
    if (st == KILN_OK) {
        /* Token bytes: merges build on earlier tokens, so lengths fill in rank order. */
        int n_vocab = 256 + n_merges + 1;
        size_t *tlen = malloc((size_t)n_vocab * sizeof *tlen);
        size_t total = 0;
        if (tlen) {
            for (int i = 0; i < 256; i++)
                tlen[i] = 1;
            for (int r = 0; r < n_merges; r++)
                tlen[256 + r] = tlen[ma[r]] + tlen[mb[r]];
            tlen[n_vocab - 1] = strlen(KILN__EOT_TEXT);
            for (int i = 0; i < n_vocab; i++)
                total += tlen[i];
            t = kiln__tokenizer_alloc(n_vocab, total, n_merges, 1);
        }
        if (!t) {
            st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_train_bpe: out of memory for %d tokens", n_vocab);
        } else {
            size_t o = 0;
            for (int i = 0; i < n_vocab; i++) {
                t->tok_off[i] = o;
                if (i < 256) {
                    t->tok_bytes[o] = (uint8_t)i;
                } else if (i < n_vocab - 1) {
                    int32_t a = ma[i - 256], b = mb[i - 256];
                    memcpy(t->tok_bytes + o, t->tok_bytes + t->tok_off[a], tlen[a]);
                    memcpy(t->tok_bytes + o + tlen[a], t->tok_bytes + t->tok_off[b], tlen[b]);
                } else {
                    memcpy(t->tok_bytes + o, KILN__EOT_TEXT, tlen[i]);
                }
                o += tlen[i];
            }
            t->tok_off[n_vocab] = o;
            for (int i = 0; i < 256; i++)
                t->byte_id[i] = i;
            for (int r = 0; r < n_merges; r++) {
                t->merge_a[r] = ma[r];
                t->merge_b[r] = mb[r];
                t->merge_id[r] = 256 + r;
            }
            t->special_id[0] = n_vocab - 1;
            if (!kiln__tokenizer_index_merges(t)) {
                kiln_tokenizer_free(t);
                t = NULL;
                st = kiln_error(KILN_ERR_OOM, "kiln_tokenizer_train_bpe: out of memory indexing merges");
            }
        }
        free(tlen);
    }
    free(ma);
    free(mb);
    trainer_free(&tr);
    *out = t;
    return st;
}
