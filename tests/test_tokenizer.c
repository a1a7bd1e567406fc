/* Tokenizers: byte and byte-level BPE, encode/decode, tokenizer.json save/load. */
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
    assert_int_equal(kiln_tokenizer_load(path, &t), status);
    assert_null(t);
    assert_non_null(strstr(kiln_last_error(), path));
    assert_non_null(strstr(kiln_last_error(), problem));
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_byte_round_trips_all_256_bytes),
        cmocka_unit_test(test_byte_kind_has_256_ids),
        cmocka_unit_test(test_bpe_has_the_vocab_size_asked),
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
