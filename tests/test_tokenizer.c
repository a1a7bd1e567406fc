/* Tokenizers: byte, byte-level BPE and char-level (SentencePiece-style) BPE,
 * encode/decode, tokenizer.json save/load. */
#include <jansson.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "io/tokenizer_impl.h"
#include "kiln/kiln.h"
#include "kiln/tokenizer.h"
#include "test_sp_json.h" /* SP, sp_first, sp_decoder, sp_json */

static const char corpus[] =
    "In the beginning the engine had no tokens, only bytes. The bytes were many and the\n"
    "tokens were few; and the trainer counted the pairs, and merged the pair that was seen\n"
    "most often, and then the next, until the vocabulary was full.\n\n"
    "It's a naïve café in Zürich — they're serving crème brûlée, and we've 42 of them.\n"
    "日本語のテキストも、バイトとしてはただのバイトです。\n"
    "\tTabs,  double  spaces,   and trailing spaces   \n"
    "Numbers: 3.14159, 2718, 1000000; symbols: <=> != && || ... ?!\n"
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again.\n"
    "the the the then there these those thin thing things thinking\n";

/* A path for a scratch file, unique to this process and name. */
static const char *tmp_path(const char *name)
{
    static char buf[4096];
    const char *dir = getenv("KILN_BINARY_DIR");
    snprintf(buf, sizeof buf, "%s/test_tokenizer_%ld_%s", dir ? dir : "/tmp", (long)getpid(), name);
    return buf;
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    fclose(f);
}

static kiln_tokenizer_t *train(int vocab)
{
    kiln_tokenizer_t *t = NULL;
    assert_int_equal(kiln_tokenizer_train_bpe(corpus, sizeof corpus - 1, vocab, &t), KILN_OK);
    assert_non_null(t);
    return t;
}

/* Encodes s, decodes the ids and checks the bytes come back exactly; returns the count. */
static size_t round_trip(const kiln_tokenizer_t *t, const char *s, size_t len)
{
    size_t cap = len + 1, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    assert_non_null(ids);
    assert_int_equal(kiln_tokenizer_encode(t, s, len, ids, cap, &n), KILN_OK);
    char *back = NULL;
    assert_int_equal(kiln_tokenizer_decode(t, ids, n, &back), KILN_OK);
    assert_memory_equal(back, s, len);
    assert_int_equal(back[len], '\0');
    free(back);
    free(ids);
    return n;
}

static void test_byte_round_trips_all_256_bytes(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = kiln_tokenizer_byte();
    assert_non_null(t);
    char all[256];
    for (int i = 0; i < 256; i++)
        all[i] = (char)i;
    int32_t ids[256];
    size_t n = 0;
    assert_int_equal(kiln_tokenizer_encode(t, all, 256, ids, 256, &n), KILN_OK);
    assert_int_equal(n, 256);
    for (int i = 0; i < 256; i++)
        assert_int_equal(ids[i], i);
    assert_int_equal(round_trip(t, all, 256), 256);
    kiln_tokenizer_free(t);
}

static void test_byte_kind_has_256_ids(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = kiln_tokenizer_byte();
    assert_string_equal(kiln_tokenizer_kind(t), "byte");
    assert_int_equal(kiln_tokenizer_vocab_size(t), 256);
    assert_int_equal(kiln_tokenizer_eot(t), -1);
    kiln_tokenizer_free(t);
}

static void test_bpe_has_the_vocab_size_asked(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(400);
    assert_string_equal(kiln_tokenizer_kind(t), "bpe");
    assert_int_equal(kiln_tokenizer_vocab_size(t), 400);
    assert_int_equal(kiln_tokenizer_eot(t), 399);
    assert_int_equal(kiln_tokenizer_bos(t), 399); /* GPT-2 starts a text with its end-of-text */
    kiln_tokenizer_free(t);
}

/* kiln_tokenizer_encode_new makes room for whatever a text makes: NFKC turns each
 * 3-byte "㌀" into the 12 bytes of "アパート", so 30 of them (90 bytes) make more ids
 * than a byte each (the first pass's room) and are encoded again at the size it found;
 * the ids are kiln_tokenizer_encode's with room to spare, and extra more fit after. */
static kiln_tokenizer_t *load_text(const char *name, const char *text);

static void test_encode_new_makes_room_for_a_text_that_grows(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(300);
    char *json = kiln_tokenizer_to_json(t);
    assert_non_null(json);
    char *at = strstr(json, "\"normalizer\": null");
    assert_non_null(at);
    char *edited = malloc(strlen(json) + 64);
    sprintf(edited, "%.*s\"normalizer\": {\"type\": \"NFKC\"}%s", (int)(at - json), json, at + strlen("\"normalizer\": null"));
    kiln_tokenizer_t *u = load_text("nfkc.json", edited);
    char text[91] = "";
    for (int i = 0; i < 30; i++) strcat(text, "\xe3\x8c\x80");
    int32_t big[2048];
    size_t want = 0, got = 0;
    assert_int_equal(kiln_tokenizer_encode(u, text, 90, big, 2048, &want), KILN_OK);
    assert_true(want > 90 + 16);
    int32_t *ids = NULL;
    assert_int_equal(kiln_tokenizer_encode_new(u, text, 90, 5, &ids, &got), KILN_OK);
    assert_int_equal(got, want);
    assert_memory_equal(ids, big, want * sizeof *ids);
    for (int k = 0; k < 5; k++) ids[want + (size_t)k] = k; /* the extra room is there (ASan checks) */
    free(ids);
    free(edited);
    free(json);
    kiln_tokenizer_free(u);
    kiln_tokenizer_free(t);
}

static void test_bpe_stops_when_the_corpus_runs_out_of_pairs(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = NULL;
    /* "abab abab": pairs ab, ba, then abab, then " abab" — few merges exist. */
    assert_int_equal(kiln_tokenizer_train_bpe("abab abab", 9, 1000, &t), KILN_OK);
    assert_true(kiln_tokenizer_vocab_size(t) < 1000);
    assert_true(kiln_tokenizer_vocab_size(t) > 257);
    kiln_tokenizer_free(t);
}

static void test_bpe_rejects_a_vocab_below_257(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = (kiln_tokenizer_t *)1;
    assert_int_equal(kiln_tokenizer_train_bpe(corpus, sizeof corpus - 1, 256, &t), KILN_ERR_ARG);
    assert_null(t);
    assert_non_null(strstr(kiln_last_error(), "256"));
}

static void test_bpe_round_trips_the_corpus_in_fewer_ids(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(512);
    size_t n = round_trip(t, corpus, sizeof corpus - 1);
    assert_true(n < (sizeof corpus - 1) / 2);
    kiln_tokenizer_free(t);
}

static void test_bpe_round_trips_unseen_utf8_and_newlines(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(512);
    const char *cases[] = {
        "Grüße aus Köln — ünïcödé\n\n\n",
        "\r\n\r\nwindows lines\r\n",
        "   leading and trailing   ",
        "emoji 🙂🚀 and 中文字符",
        "'s't're've'm'll'd 'S 'X don't",
        "\n",
        " ",
        "x",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        round_trip(t, cases[i], strlen(cases[i]));
    kiln_tokenizer_free(t);
}

static void test_bpe_round_trips_invalid_utf8_and_nul_bytes(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(512);
    char junk[1000];
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof junk; i++) {
        x = x * 1664525u + 1013904223u; /* a fixed LCG, so the test is repeatable */
        junk[i] = (char)(x >> 24);
    }
    round_trip(t, junk, sizeof junk);
    kiln_tokenizer_free(t);
}

static void test_bpe_encodes_the_empty_string_to_no_ids(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(300);
    size_t n = 99;
    assert_int_equal(kiln_tokenizer_encode(t, "", 0, NULL, 0, &n), KILN_OK);
    assert_int_equal(n, 0);
    char *s = NULL;
    assert_int_equal(kiln_tokenizer_decode(t, NULL, 0, &s), KILN_OK);
    assert_string_equal(s, "");
    free(s);
    kiln_tokenizer_free(t);
}

static void test_bpe_training_is_deterministic(void **state)
{
    (void)state;
    kiln_tokenizer_t *a = train(450), *b = train(450);
    assert_int_equal(a->n_merges, b->n_merges);
    assert_memory_equal(a->merge_a, b->merge_a, (size_t)a->n_merges * sizeof(int32_t));
    assert_memory_equal(a->merge_b, b->merge_b, (size_t)a->n_merges * sizeof(int32_t));
    kiln_tokenizer_free(a);
    kiln_tokenizer_free(b);
}

static void test_bpe_first_merge_is_the_most_frequent_pair(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = NULL;
    /* "aa" x3 beats "b c" pairs; ties between equal counts go to the smaller ids. */
    assert_int_equal(kiln_tokenizer_train_bpe("aa aa aa bc", 11, 258, &t), KILN_OK);
    assert_int_equal(t->n_merges, 1);
    /* Pairs: (a,a) x3, (' ',a) x2, (' ',b) x1, (b,c) x1. */
    assert_int_equal(t->merge_a[0], 'a');
    assert_int_equal(t->merge_b[0], 'a');
    kiln_tokenizer_free(t);
}

static void test_bpe_ties_go_to_the_smaller_pair(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = NULL;
    /* Every pair occurs once, and (' ', c) has the smallest ids. */
    assert_int_equal(kiln_tokenizer_train_bpe("xy cd", 5, 258, &t), KILN_OK);
    assert_int_equal(t->merge_a[0], ' ');
    assert_int_equal(t->merge_b[0], 'c');
    kiln_tokenizer_free(t);
}

static void test_bpe_encodes_the_literal_eot_to_its_id(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(300);
    const char *s = "one<|endoftext|>two";
    int32_t ids[64];
    size_t n = 0;
    assert_int_equal(kiln_tokenizer_encode(t, s, strlen(s), ids, 64, &n), KILN_OK);
    size_t hits = 0;
    for (size_t i = 0; i < n; i++)
        hits += ids[i] == kiln_tokenizer_eot(t);
    assert_int_equal(hits, 1);
    round_trip(t, s, strlen(s));
    kiln_tokenizer_free(t);
}

/* How many of ids[0..n) are id. */
static size_t count_id(const int32_t *ids, size_t n, int32_t id)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ids[i] == id;
    return k;
}

/* Inside a plain span the special token's text is text: its bytes' ids, never its own
 * id; outside the span (and in a span that only touches it) it is still the token. The
 * oracle is the byte tokenizer's view of the same bytes: the ids decode back to them. */
/* A post_processor's template that puts a special token before the text marks the
 * tokenizer as one whose prompts start with it (LLaMA's TemplateProcessing, alone and in
 * a Sequence as LLaMA 3 has it); none, or one that starts with the text, does not.
 * Oracle: the documents written out here. */
static void test_a_template_before_the_text_means_prompts_start_with_it(void **state)
{
    (void)state;
    static const char *head = "{\"version\":\"1.0\",\"added_tokens\":[{\"id\":256,\"content\":\"<s>\",\"special\":true}],"
                              "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false},"
                              "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{";
    const char *pps[] = {
        "{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},"
        "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[256],"
        "\"tokens\":[\"<s>\"]}}}",
        "{\"type\":\"Sequence\",\"processors\":[{\"type\":\"ByteLevel\"},{\"type\":\"TemplateProcessing\","
        "\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],"
        "\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[256],\"tokens\":[\"<s>\"]}}}]}",
        "{\"type\":\"TemplateProcessing\",\"single\":[{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"special_tokens\":{}}",
        "null",
    };
    const bool want[] = {true, true, false, false};
    char *doc = malloc(1 << 16);
    assert_non_null(doc);
    for (size_t k = 0; k < sizeof pps / sizeof pps[0]; k++) {
        size_t o = (size_t)snprintf(doc, 1 << 16, "%s", head);
        /* the vocabulary: GPT-2's 256 byte characters (printable Latin-1 as itself, the rest
         * from U+0100 up in byte order), each written as a \\u escape */
        for (int b = 0, extra = 0; b < 256; b++) {
            bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            int cp = keep ? b : 256 + extra++;
            o += (size_t)snprintf(doc + o, (1 << 16) - o, "%s\"\\u%04x\":%d", b ? "," : "", cp, b);
        }
        o += (size_t)snprintf(doc + o, (1 << 16) - o, "},\"merges\":[]},\"post_processor\":%s}", pps[k]);
        write_file(tmp_path("bos.json"), doc);
        kiln_tokenizer_t *t = NULL;
        if (kiln_tokenizer_load(tmp_path("bos.json"), &t) != KILN_OK) fail_msg("case %zu: %s", k, kiln_last_error());
        assert_int_equal(kiln_tokenizer_adds_bos(t), want[k]);
        if (want[k]) assert_int_equal(kiln_tokenizer_bos(t), 256);
        kiln_tokenizer_free(t);
    }
    free(doc);
    remove(tmp_path("bos.json"));
}

static void test_plain_spans_keep_special_text_as_text(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(300);
    const char *s = "a<|endoftext|>b<|endoftext|>c";
    int32_t eot = kiln_tokenizer_eot(t), *ids = NULL;
    size_t n = 0;
    /* the first token's text lies wholly in the span [1, 14); the second is outside */
    kiln_text_span sp[1] = {{1, 14}};
    assert_int_equal(kiln_tokenizer_encode_plain_new(t, s, strlen(s), sp, 1, 0, &ids, &n), KILN_OK);
    assert_int_equal(count_id(ids, n, eot), 1);
    assert_true(n > 4); /* the first one's 13 bytes made text ids */
    char *back = NULL;
    assert_int_equal(kiln_tokenizer_decode(t, ids, n, &back), KILN_OK);
    assert_string_equal(back, s);
    free(back);
    free(ids);
    /* a span that only overlaps the token's last byte still keeps it from being taken */
    kiln_text_span tail[1] = {{13, 15}};
    assert_int_equal(kiln_tokenizer_encode_plain_new(t, s, strlen(s), tail, 1, 0, &ids, &n), KILN_OK);
    assert_int_equal(count_id(ids, n, eot), 1);
    free(ids);
    /* a span that ends where the token begins does not */
    kiln_text_span before[1] = {{0, 1}};
    assert_int_equal(kiln_tokenizer_encode_plain_new(t, s, strlen(s), before, 1, 0, &ids, &n), KILN_OK);
    assert_int_equal(count_id(ids, n, eot), 2);
    free(ids);
    /* spans out of order or past the text are refused */
    kiln_text_span bad[2] = {{5, 9}, {2, 3}};
    assert_int_equal(kiln_tokenizer_encode_plain_new(t, s, strlen(s), bad, 2, 0, &ids, &n), KILN_ERR_ARG);
    kiln_text_span past[1] = {{5, 99}};
    assert_int_equal(kiln_tokenizer_encode_plain_new(t, s, strlen(s), past, 1, 0, &ids, &n), KILN_ERR_ARG);
    kiln_tokenizer_free(t);
}

/* The pieces the GPT-2 pattern cuts s[0..n) into are want[0..k). */
static void pieces_are(const char *s, size_t n, const char *const *want, size_t k_want)
{
    kiln__pretok pt = kiln__pretok_begin(kiln__regex_gpt2());
    assert_non_null(pt.md);
    size_t i = 0, k = 0;
    while (i < n) {
        size_t j = kiln__pretok_next(&pt, (const uint8_t *)s, n, i);
        if (k >= k_want || j - i != strlen(want[k]) || memcmp(s + i, want[k], j - i))
            fail_msg("piece %zu is '%.*s', want '%s'", k, (int)(j - i), s + i, k < k_want ? want[k] : "(none)");
        i = j;
        k++;
    }
    assert_int_equal(k, k_want);
    kiln__pretok_end(&pt);
}

static void test_pretokenizer_follows_the_gpt2_split(void **state)
{
    (void)state;
    const char *s = "Hello world's  big\n\n 123 !? don't\tx   ";
    /* A space run gives its last space to the next word; "\n\n " gives " " to "123". */
    const char *want[] = {"Hello", " world", "'s", " ", " big", "\n\n", " 123", " !?", " don", "'t", "\t", "x", "   "};
    pieces_are(s, strlen(s), want, sizeof want / sizeof want[0]);
}

/* The GPT-2 pattern's classes are Unicode's (PCRE2 with UCP), as `tokenizers` matches
 * them: accented and Arabic letters are \p{L}, CJK punctuation and emoji are not, an
 * Arabic-Indic digit is \p{N}, a no-break space is \s. Each byte of a sequence that is
 * not UTF-8 is a piece of its own (a truncated one at the end too), and nothing is read
 * past the text. */
static void test_pretokenizer_uses_unicode_classes(void **state)
{
    (void)state;
    const char *s = " naïve 日本語。 مرحبا ٣٤ 😀!\xc2\xa0x";
    const char *want[] = {" naïve", " 日本語", "。", " مرحبا", " ٣٤", " 😀!", "\xc2\xa0", "x"};
    pieces_are(s, strlen(s), want, sizeof want / sizeof want[0]);
    const char bad[] = {'a', 'b', (char)0xff, 'c', ' ', (char)0xe6, (char)0x97};
    const char *want_bad[] = {"ab", "\xff", "c", " ", "\xe6", "\x97"}; /* each invalid byte on its own */
    pieces_are(bad, sizeof bad, want_bad, sizeof want_bad / sizeof want_bad[0]);
}

static void encodings_match(const kiln_tokenizer_t *a, const kiln_tokenizer_t *b, const char *s)
{
    size_t len = strlen(s), na = 0, nb = 0;
    int32_t *ia = malloc((len + 1) * sizeof *ia), *ib = malloc((len + 1) * sizeof *ib);
    assert_int_equal(kiln_tokenizer_encode(a, s, len, ia, len + 1, &na), KILN_OK);
    assert_int_equal(kiln_tokenizer_encode(b, s, len, ib, len + 1, &nb), KILN_OK);
    assert_int_equal(na, nb);
    assert_memory_equal(ia, ib, na * sizeof *ia);
    free(ia);
    free(ib);
}

static void test_save_then_load_gives_identical_encodings(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(500), *u = NULL;
    const char *path = tmp_path("bpe.json");
    assert_int_equal(kiln_tokenizer_save(t, path), KILN_OK);
    assert_int_equal(kiln_tokenizer_load(path, &u), KILN_OK);
    assert_string_equal(kiln_tokenizer_kind(u), "bpe");
    assert_int_equal(kiln_tokenizer_vocab_size(u), 500);
    assert_int_equal(kiln_tokenizer_eot(u), 499);
    encodings_match(t, u, corpus);
    encodings_match(t, u, "Unseen text: ÄÖÜ, <|endoftext|> and\n\nmore 12345!");
    remove(path);
    kiln_tokenizer_free(t);
    kiln_tokenizer_free(u);
}

static void test_save_then_load_keeps_the_byte_kind(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = kiln_tokenizer_byte(), *u = NULL;
    const char *path = tmp_path("byte.json");
    assert_int_equal(kiln_tokenizer_save(t, path), KILN_OK);
    assert_int_equal(kiln_tokenizer_load(path, &u), KILN_OK);
    assert_string_equal(kiln_tokenizer_kind(u), "byte");
    encodings_match(t, u, "bytes \x01\x7f\xff stay bytes");
    remove(path);
    kiln_tokenizer_free(t);
    kiln_tokenizer_free(u);
}

/* Loads text as a tokenizer.json; checks it fails with status and a message naming the
 * file and containing problem. */
static void load_fails(const char *name, const char *text, kiln_status status, const char *problem)
{
    const char *p = tmp_path(name);
    char path[4096];
    snprintf(path, sizeof path, "%s", p);
    write_file(path, text);
    kiln_tokenizer_t *t = (kiln_tokenizer_t *)1;
    kiln_status got = kiln_tokenizer_load(path, &t);
    if (got != status || !strstr(kiln_last_error(), path) || !strstr(kiln_last_error(), problem))
        fail_msg("want status %d and \"%s\", got %d: %s", status, problem, got, got ? kiln_last_error() : "");
    assert_null(t);
    remove(path);
}

static void test_load_rejects_bad_json(void **state)
{
    (void)state;
    load_fails("bad.json", "{\"model\": {\"vocab\": {", KILN_ERR_FORMAT, "bad JSON");
}

static void test_load_rejects_a_file_without_model(void **state)
{
    (void)state;
    load_fails("nomodel.json", "{\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false}}",
               KILN_ERR_FORMAT, "missing \"model\"");
}

static void test_load_rejects_a_merge_of_an_unknown_token(void **state)
{
    (void)state;
    /* A valid byte tokenizer file with one merge naming a token that is not in the vocab. */
    kiln_tokenizer_t *t = kiln_tokenizer_byte();
    const char *path = tmp_path("base.json");
    assert_int_equal(kiln_tokenizer_save(t, path), KILN_OK);
    kiln_tokenizer_free(t);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    remove(path);
    text[n] = '\0';
    char *m = strstr(text, "\"merges\": []");
    assert_non_null(m);
    static char edited[1 << 16];
    snprintf(edited, sizeof edited, "%.*s\"merges\": [\"a zzz\"]%s", (int)(m - text), text,
             m + strlen("\"merges\": []"));
    load_fails("unknown.json", edited, KILN_ERR_FORMAT, "unknown token \"zzz\"");
}

static void test_load_of_a_missing_file_is_an_io_error(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = NULL;
    assert_int_equal(kiln_tokenizer_load("/nonexistent/dir/tokenizer.json", &t), KILN_ERR_IO);
    assert_non_null(strstr(kiln_last_error(), "/nonexistent/dir/tokenizer.json"));
}

static void test_encode_with_a_small_cap_reports_the_needed_count(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(300);
    size_t need = 0, n = 0;
    assert_int_equal(kiln_tokenizer_encode(t, corpus, sizeof corpus - 1, NULL, 0, &need), KILN_ERR_ARG);
    assert_true(need > 3);
    int32_t ids[3];
    assert_int_equal(kiln_tokenizer_encode(t, corpus, sizeof corpus - 1, ids, 3, &n), KILN_ERR_ARG);
    assert_int_equal(n, need);
    kiln_tokenizer_free(t);
}

static void test_decode_of_an_out_of_range_id_is_an_index_error(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = kiln_tokenizer_byte();
    int32_t ids[] = {65, 256};
    char *s = (char *)1;
    assert_int_equal(kiln_tokenizer_decode(t, ids, 2, &s), KILN_ERR_INDEX);
    assert_null(s);
    int32_t neg[] = {-1};
    assert_int_equal(kiln_tokenizer_decode(t, neg, 1, &s), KILN_ERR_INDEX);
    kiln_tokenizer_free(t);
}

/* ---- char-level (SentencePiece-style) BPE ------------------------------------------- */

static const char *const sp_always_split = "{\"type\": \"Metaspace\", \"replacement\": \"" SP "\", "
                                           "\"prepend_scheme\": \"always\", \"split\": true}";
static const char *const sp_legacy = "{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": "
                                     "\"" SP "\"}, {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, "
                                     "\"content\": \"" SP "\"}]}";

static kiln_tokenizer_t *load_text(const char *name, const char *text)
{
    const char *path = tmp_path(name);
    write_file(path, text);
    kiln_tokenizer_t *t = NULL;
    if (kiln_tokenizer_load(path, &t) != KILN_OK) fail_msg("%s", kiln_last_error());
    remove(path);
    return t;
}

/* s encodes to want[0..n) and decodes to back. */
static void encodes_to(const kiln_tokenizer_t *t, const char *s, const int32_t *want, size_t n, const char *back)
{
    int32_t ids[64];
    size_t got = 0;
    assert_int_equal(kiln_tokenizer_encode(t, s, strlen(s), ids, 64, &got), KILN_OK);
    if (got != n || memcmp(ids, want, n * sizeof *ids))
        fail_msg("'%s' gives %zu ids (first %d), want %zu (first %d)", s, got, got ? ids[0] : -1, n, n ? want[0] : -1);
    char *d = NULL;
    assert_int_equal(kiln_tokenizer_decode(t, ids, got, &d), KILN_OK);
    assert_string_equal(d, back);
    free(d);
}
#define ENCODES_TO(t, s, back, ...)                                                                                 \
    do {                                                                                                           \
        const int32_t want_[] = {__VA_ARGS__};                                                                     \
        encodes_to(t, s, want_, sizeof want_ / sizeof want_[0], back);                                             \
    } while (0)

/* Metaspace "first" (transformers' LlamaTokenizer today): a space before the text's
 * start only, not after a special token; bytes for what the vocab lacks; decode strips
 * the one leading space (Strip after Fuse). */
static void test_sp_metaspace_first_gives_tokenizers_ids(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = load_text("first.json", sp_json("null", sp_first, sp_decoder, "", ""));
    assert_string_equal(kiln_tokenizer_kind(t), "bpe");
    assert_int_equal(kiln_tokenizer_vocab_size(t), 272);
    assert_int_equal(kiln_tokenizer_eot(t), 2); /* </s> ends a text, <s> starts one */
    assert_int_equal(kiln_tokenizer_bos(t), 1);
    ENCODES_TO(t, "hello", "hello", 271, 270);
    ENCODES_TO(t, " hello", "hello", 271, 270);
    ENCODES_TO(t, "<s>hello", "<s>hello", 1, 265, 269, 270);
    ENCODES_TO(t, "a</s>b", "a</s>b", 259, 260, 2, 261);
    ENCODES_TO(t, "a </s> b", "a </s> b", 259, 260, 259, 2, 259, 261);
    ENCODES_TO(t, "\xe6\x97\xa5", "\xe6\x97\xa5", 259, 233, 154, 168); /* 日 as its three bytes */
    ENCODES_TO(t, "hello  hello", "hello  hello", 271, 270, 259, 271, 270);
    ENCODES_TO(t, "cab\tbad", "cab\tbad", 259, 262, 260, 261, 12, 261, 260, 263);
    kiln_tokenizer_free(t);
}

/* s with its first `from` replaced by `to` (a new string). */
static char *replaced(const char *s, const char *from, const char *to)
{
    const char *at = strstr(s, from);
    assert_non_null(at);
    char *out = malloc(strlen(s) + strlen(to) + 1);
    sprintf(out, "%.*s%s%s", (int)(at - s), s, to, at + strlen(from));
    return out;
}

/* An added token that is not special (tokenizers' AddedToken(special=False)) is still
 * cut out of the text as an added token, and saved back with "special": false. */
static void test_a_plain_added_token_stays_plain_when_saved(void **state)
{
    (void)state;
    const char *j = sp_json("null", sp_first, sp_decoder, "", "");
    const char *from = "\"content\": \"</s>\", \"special\": true";
    char *plain = replaced(j, from, "\"content\": \"</s>\", \"special\": false");
    char *odd = replaced(j, from, "\"content\": \"</s>\", \"special\": 0"); /* not a boolean: the default, special */
    kiln_tokenizer_t *t = load_text("plain.json", plain), *t0 = load_text("odd.json", odd);
    ENCODES_TO(t, "a</s>b", "a</s>b", 259, 260, 2, 261);
    char *out = kiln_tokenizer_to_json(t), *out0 = kiln_tokenizer_to_json(t0);
    assert_non_null(out);
    assert_non_null(out0);
    json_t *a = json_loads(out, 0, NULL), *a0 = json_loads(out0, 0, NULL);
    assert_non_null(a);
    assert_non_null(a0);
    for (int id = 0; id < 3; id++) {
        json_t *e = json_array_get(json_object_get(a, "added_tokens"), (size_t)id);
        json_t *e0 = json_array_get(json_object_get(a0, "added_tokens"), (size_t)id);
        assert_int_equal(json_integer_value(json_object_get(e, "id")), id);
        assert_int_equal(json_is_true(json_object_get(e, "special")), id != 2);
        assert_true(json_is_true(json_object_get(e0, "special")));
    }
    json_decref(a);
    json_decref(a0);
    free(out);
    free(out0);
    free(plain);
    free(odd);
    kiln_tokenizer_free(t);
    kiln_tokenizer_free(t0);
}

/* The older shape: Prepend and Replace normalizers, no pre-tokenizer. Prepend puts a
 * space before every text between special tokens, even one that starts with a space. */
static void test_sp_prepend_replace_normalizer_gives_tokenizers_ids(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = load_text("legacy.json", sp_json(sp_legacy, "null", sp_decoder, "", ""));
    ENCODES_TO(t, " hello", " hello", 259, 271, 270);
    ENCODES_TO(t, "<s> hello", "<s>  hello", 1, 259, 271, 270);
    ENCODES_TO(t, "a</s>b", "a</s> b", 259, 260, 2, 259, 261);
    ENCODES_TO(t, "  ", "  ", 259, 259, 259);
    kiln_tokenizer_free(t);
}

/* Metaspace "always" with split: every SP starts a word; the Metaspace decoder drops
 * the first token's SPs and spells the others' as spaces. */
static void test_sp_metaspace_split_and_its_decoder(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = load_text("split.json", sp_json("null", sp_always_split, sp_always_split, "", ""));
    ENCODES_TO(t, "hello  hello", "hello  hello", 271, 270, 259, 271, 270);
    ENCODES_TO(t, "<s>hello", "<s> hello", 1, 271, 270);
    ENCODES_TO(t, SP SP "a", " a", 259, 259, 260);
    kiln_tokenizer_free(t);
}

/* A merge that joins across a SP after another character ("o" + SP) keeps the segment
 * one word; "SP SP" does not need it. Either way the ids are tokenizers'. */
static void test_sp_merges_across_a_space_give_tokenizers_ids(void **state)
{
    (void)state;
    const char *extra[][2] = {{"o" SP, "[\"o\", \"" SP "\"]"}, {SP SP, "[\"" SP "\", \"" SP "\"]"}};
    const int32_t ho_hel[][4] = {{268, 272, 271, -1}, {268, 267, 259, 271}};
    for (int k = 0; k < 2; k++) {
        char text[1 << 15];
        snprintf(text, sizeof text, "%s", sp_json("null", sp_first, sp_decoder, "", ""));
        /* one more vocab entry (id 272) and one more merge, spliced in before the closings */
        char *v = strstr(text, "}, \"merges\"");
        char tail[1 << 15];
        snprintf(tail, sizeof tail, ", \"%s\": 272%.*s, %s]}}", extra[k][0], (int)(strlen(v) - 3), v, extra[k][1]);
        strcpy(v, tail);
        kiln_tokenizer_t *t = load_text("across.json", text);
        ENCODES_TO(t, "hello hello", "hello hello", 271, 270, 271, 270);
        ENCODES_TO(t, "hello  hello", "hello  hello", 271, 270, 259, 271, 270);
        encodes_to(t, "ho  hel", ho_hel[k], k ? 4 : 3, "ho  hel");
        kiln_tokenizer_free(t);
    }
}

/* A character the vocab lacks whose bytes are not all there is <unk>: one for a run of
 * them with fuse_unk, one each without; bytes that are there are written before an unk
 * still pending (`tokenizers`' order, recorded from it). */
static void test_sp_unknown_characters_become_unk_as_tokenizers_does(void **state)
{
    (void)state;
    static const char fmt[] = "{\"decoder\": {\"type\": \"ByteFallback\"}, \"model\": {\"type\": \"BPE\", "
                              "\"byte_fallback\": true, \"unk_token\": \"<unk>\", \"fuse_unk\": %s, \"vocab\": "
                              "{\"<unk>\": 0, \"a\": 1, \"<0x7A>\": 2}, \"merges\": []}}";
    char text[512];
    snprintf(text, sizeof text, fmt, "true");
    kiln_tokenizer_t *t = load_text("fused.json", text);
    ENCODES_TO(t, "qz", "z<unk>", 2, 0);
    ENCODES_TO(t, "zqqaqzq", "z<unk>az<unk>", 2, 0, 1, 2, 0);
    ENCODES_TO(t, "a\xc3\xa9" "a", "a<unk>a", 1, 0, 1);
    kiln_tokenizer_free(t);
    snprintf(text, sizeof text, fmt, "false");
    t = load_text("unfused.json", text);
    ENCODES_TO(t, "zqqaqzq", "z<unk><unk>az<unk><unk>", 2, 0, 0, 1, 2, 0, 0);
    kiln_tokenizer_free(t);
}

/* A token's bytes are what it decodes to after other tokens: SP is a space (the text's
 * leading one is stripped by decode only), "<0xE6>" the byte 0xE6. */
static void test_sp_token_bytes_are_the_decoded_bytes(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = load_text("bytes.json", sp_json("null", sp_first, sp_decoder, "", ""));
    size_t n;
    const char *b = kiln_tokenizer_token_bytes(t, 271, &n);
    assert_int_equal(n, 4);
    assert_memory_equal(b, " hel", 4);
    b = kiln_tokenizer_token_bytes(t, 3 + 0xE6, &n);
    assert_int_equal(n, 1);
    assert_int_equal((unsigned char)b[0], 0xE6);
    b = kiln_tokenizer_token_bytes(t, 1, &n);
    assert_int_equal(n, 3);
    assert_memory_equal(b, "<s>", 3);
    kiln_tokenizer_free(t);
}

/* Bytes that are not UTF-8 (which `tokenizers` cannot be given) fall back to their byte
 * tokens, so decoding gives them back; encoding never fails on any bytes. */
static void test_sp_round_trips_bytes_that_are_not_utf8(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = load_text("junk.json", sp_json("null", sp_first, sp_decoder, "", ""));
    char junk[1000];
    uint32_t x = 777;
    junk[0] = 'a'; /* not a space, which decode would strip */
    for (size_t i = 1; i < sizeof junk; i++) {
        x = x * 1664525u + 1013904223u;
        junk[i] = (char)(x >> 24);
        if (junk[i] == ' ' || (unsigned char)junk[i] == 0xe2) junk[i] = 'b'; /* no space, no SP */
    }
    round_trip(t, junk, sizeof junk);
    kiln_tokenizer_free(t);
}

/* Saved and loaded again: the same ids, and the same pipeline written. */
static void test_sp_save_then_load_gives_identical_encodings(void **state)
{
    (void)state;
    const char *pipelines[][3] = {{"null", sp_first, sp_decoder}, {sp_legacy, "null", sp_decoder},
                                  {"null", sp_always_split, sp_always_split}};
    const char *text = "<s>hello a</s>b  cab \xe6\x97\xa5 hello";
    for (int k = 0; k < 3; k++) {
        kiln_tokenizer_t *t = load_text("sp.json", sp_json(pipelines[k][0], pipelines[k][1], pipelines[k][2], "", ""));
        const char *path = tmp_path("sp_saved.json");
        assert_int_equal(kiln_tokenizer_save(t, path), KILN_OK);
        kiln_tokenizer_t *u = NULL;
        assert_int_equal(kiln_tokenizer_load(path, &u), KILN_OK);
        encodings_match(t, u, text);
        char *a = kiln_tokenizer_to_json(t), *b = kiln_tokenizer_to_json(u);
        assert_string_equal(a, b);
        json_t *j = json_loads(a, 0, NULL);
        assert_true(json_is_true(json_object_get(json_object_get(j, "model"), "byte_fallback")));
        assert_string_equal(json_string_value(json_object_get(json_object_get(j, "model"), "unk_token")), "<unk>");
        json_decref(j);
        free(a);
        free(b);
        remove(path);
        kiln_tokenizer_free(t);
        kiln_tokenizer_free(u);
    }
}

/* What a char-level file declares that kiln cannot honour, or that is malformed, is an
 * error naming the field. */
static void test_sp_load_refuses_what_it_cannot_honour(void **state)
{
    (void)state;
    const char *two = "{\"type\": \"Metaspace\", \"replacement\": \"__\"}";
    const char *bad_scheme = "{\"type\": \"Metaspace\", \"replacement\": \"" SP "\", \"prepend_scheme\": \"sometimes\"}";
    const char *mismatch = "{\"type\": \"Metaspace\", \"replacement\": \"" SP "\", \"add_prefix_space\": false}";
    const char *fuse_first = "{\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Fuse\"}, {\"type\": \"Replace\", "
                             "\"pattern\": {\"String\": \"" SP "\"}, \"content\": \" \"}]}";
    const char *strip_alone = "{\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}";
    const char *strip_stop = "{\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Fuse\"}, {\"type\": \"Strip\", "
                             "\"content\": \" \", \"start\": 0, \"stop\": 1}]}";
    const char *regex = "{\"type\": \"Replace\", \"pattern\": {\"Regex\": \" +\"}, \"content\": \"" SP "\"}";
    const struct {
        const char *norm, *pre, *dec, *model, *unk;
        kiln_status status;
        const char *problem;
    } cases[] = {
        {"null", two, sp_decoder, "", "", KILN_ERR_FORMAT, "replacement\" of one character"},
        {"null", bad_scheme, sp_decoder, "", "", KILN_ERR_FORMAT, "prepend_scheme must be"},
        {"null", mismatch, sp_decoder, "", "", KILN_ERR_FORMAT, "add_prefix_space false does not match"},
        {"null", sp_first, "null", "", "", KILN_ERR_UNSUPPORTED, "\"decoder\" null"},
        {"null", sp_first, "{\"type\": \"ByteLevel\"}", "", "", KILN_ERR_UNSUPPORTED, "decoder ByteLevel"},
        {"null", sp_first, "{\"type\": \"WordPiece\"}", "", "", KILN_ERR_UNSUPPORTED, "decoder \"WordPiece\""},
        {"null", sp_first, fuse_first, "", "", KILN_ERR_UNSUPPORTED, "decoder Replace after Fuse"},
        {"null", sp_first, strip_alone, "", "", KILN_ERR_UNSUPPORTED, "Strip without a Fuse"},
        {"null", sp_first, strip_stop, "", "", KILN_ERR_UNSUPPORTED, "Strip with stop 1"},
        {regex, "null", sp_decoder, "", "", KILN_ERR_UNSUPPORTED, "normalizer Replace with a Regex"},
        {"{\"type\": \"Lowercase\"}", "null", sp_decoder, "", "", KILN_ERR_UNSUPPORTED, "normalizer \"Lowercase\""},
        {"null", "{\"type\": \"Whitespace\"}", sp_decoder, "", "", KILN_ERR_UNSUPPORTED,
         "pre_tokenizer \"Whitespace\""},
        {"null", "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Digits\"}]}", sp_decoder, "", "",
         KILN_ERR_UNSUPPORTED, "pre_tokenizer Sequence"},
        {"null", sp_first, sp_decoder, ", \"dropout\": 0.1", "", KILN_ERR_UNSUPPORTED, "BPE dropout"},
        {"null", sp_first, sp_decoder, ", \"unk_token\": \"<nope>\"", "", KILN_ERR_FORMAT,
         "unk_token \"<nope>\" is not in the vocab"},
        {"null", sp_first, sp_decoder, ", \"fuse_unk\": \"yes\"", "", KILN_ERR_FORMAT, "must be booleans"},
        {"null", sp_first, sp_decoder, ", \"ignore_merges\": true", "", KILN_ERR_UNSUPPORTED, "ignore_merges"},
        {sp_legacy, "null", sp_decoder, "", ", \"normalized\": true", KILN_ERR_UNSUPPORTED,
         "\"<unk>\" has \"normalized\": true"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        load_fails("refused.json", sp_json(cases[k].norm, cases[k].pre, cases[k].dec, cases[k].model, cases[k].unk),
                   cases[k].status, cases[k].problem);
}

/* A byte-level file whose decoder is not ByteLevel is refused (kiln decodes to bytes). */
static void test_load_refuses_a_byte_level_file_with_another_decoder(void **state)
{
    (void)state;
    kiln_tokenizer_t *t = train(300);
    char *text = kiln_tokenizer_to_json(t);
    json_t *j = json_loads(text, 0, NULL);
    json_object_set_new(j, "decoder", json_pack("{s:s, s:s}", "type", "Metaspace", "replacement", SP));
    char *edited = json_dumps(j, 0);
    load_fails("bytelevel_dec.json", edited, KILN_ERR_UNSUPPORTED, "decoder \"Metaspace\" is not supported with a "
               "ByteLevel pre_tokenizer");
    json_decref(j);
    free(text);
    free(edited);
    kiln_tokenizer_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_byte_round_trips_all_256_bytes),
        cmocka_unit_test(test_byte_kind_has_256_ids),
        cmocka_unit_test(test_bpe_has_the_vocab_size_asked),
        cmocka_unit_test(test_encode_new_makes_room_for_a_text_that_grows),
        cmocka_unit_test(test_bpe_stops_when_the_corpus_runs_out_of_pairs),
        cmocka_unit_test(test_bpe_rejects_a_vocab_below_257),
        cmocka_unit_test(test_bpe_round_trips_the_corpus_in_fewer_ids),
        cmocka_unit_test(test_bpe_round_trips_unseen_utf8_and_newlines),
        cmocka_unit_test(test_bpe_round_trips_invalid_utf8_and_nul_bytes),
        cmocka_unit_test(test_bpe_encodes_the_empty_string_to_no_ids),
        cmocka_unit_test(test_bpe_training_is_deterministic),
        cmocka_unit_test(test_bpe_first_merge_is_the_most_frequent_pair),
        cmocka_unit_test(test_bpe_ties_go_to_the_smaller_pair),
        cmocka_unit_test(test_bpe_encodes_the_literal_eot_to_its_id),
        cmocka_unit_test(test_plain_spans_keep_special_text_as_text),
        cmocka_unit_test(test_a_template_before_the_text_means_prompts_start_with_it),
        cmocka_unit_test(test_pretokenizer_follows_the_gpt2_split),
        cmocka_unit_test(test_pretokenizer_uses_unicode_classes),
        cmocka_unit_test(test_save_then_load_gives_identical_encodings),
        cmocka_unit_test(test_save_then_load_keeps_the_byte_kind),
        cmocka_unit_test(test_load_rejects_bad_json),
        cmocka_unit_test(test_load_rejects_a_file_without_model),
        cmocka_unit_test(test_load_rejects_a_merge_of_an_unknown_token),
        cmocka_unit_test(test_load_of_a_missing_file_is_an_io_error),
        cmocka_unit_test(test_encode_with_a_small_cap_reports_the_needed_count),
        cmocka_unit_test(test_decode_of_an_out_of_range_id_is_an_index_error),
        cmocka_unit_test(test_sp_metaspace_first_gives_tokenizers_ids),
        cmocka_unit_test(test_a_plain_added_token_stays_plain_when_saved),
        cmocka_unit_test(test_sp_prepend_replace_normalizer_gives_tokenizers_ids),
        cmocka_unit_test(test_sp_metaspace_split_and_its_decoder),
        cmocka_unit_test(test_sp_merges_across_a_space_give_tokenizers_ids),
        cmocka_unit_test(test_sp_unknown_characters_become_unk_as_tokenizers_does),
        cmocka_unit_test(test_sp_token_bytes_are_the_decoded_bytes),
        cmocka_unit_test(test_sp_round_trips_bytes_that_are_not_utf8),
        cmocka_unit_test(test_sp_save_then_load_gives_identical_encodings),
        cmocka_unit_test(test_sp_load_refuses_what_it_cannot_honour),
        cmocka_unit_test(test_load_refuses_a_byte_level_file_with_another_decoder),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
