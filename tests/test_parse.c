/* core/parse.h, the one strict reader of numbers (options, KILN_* variables, attention
 * specs, config fields, checkpoint metadata): the whole text is the number, decimal and
 * finite, in range, or it is refused with the thing named first and the text quoted
 * (issue 51, class 2). Also the thread cap (core/threadpool.h) and the excerpt that
 * messages quote long input with. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <string.h>
#include <unistd.h>
#include "core/parse.h"
#include "core/threadpool.h"
#include "kiln/kiln.h"

static void expect_refused_i64(const char *s, int64_t lo, int64_t hi)
{
    int64_t v = 12345;
    kiln_clear_error();
    if (kiln__parse_i64(s, lo, hi, "--thing", &v) == KILN_OK) fail_msg("'%s' was taken as %lld", s, (long long)v);
    assert_int_equal(v, 12345); /* untouched */
    const char *e = kiln_last_error();
    if (strncmp(e, "--thing must be a whole number", 30)) fail_msg("'%s': %s", s, e);
    if (s && strlen(s) < 40 && !strstr(e, s)) fail_msg("'%s' not quoted: %s", s, e);
}

static void expect_refused_f64(const char *s, double lo, double hi, unsigned flags)
{
    double v = 7;
    kiln_clear_error();
    if (kiln__parse_f64(s, lo, hi, flags, "--thing", &v) == KILN_OK) fail_msg("'%s' was taken as %g", s, v);
    assert_true(v == 7);
    const char *e = kiln_last_error();
    if (strncmp(e, "--thing must be a ", 18)) fail_msg("'%s': %s", s, e);
}

/* Whole numbers: digits after an optional '-', the whole text, inside int64 and the range. */
static void whole_numbers_are_the_whole_text_and_in_range(void **state)
{
    (void)state;
    int64_t v;
    assert_int_equal(kiln__parse_i64("0", 0, 10, "x", &v), KILN_OK);
    assert_int_equal(v, 0);
    assert_int_equal(kiln__parse_i64("-7", -10, 10, "x", &v), KILN_OK);
    assert_int_equal(v, -7);
    assert_int_equal(kiln__parse_i64("007", 0, 10, "x", &v), KILN_OK);
    assert_int_equal(v, 7);
    assert_int_equal(kiln__parse_i64("9223372036854775807", INT64_MIN, INT64_MAX, "x", &v), KILN_OK);
    assert_true(v == INT64_MAX);
    assert_int_equal(kiln__parse_i64("-9223372036854775808", INT64_MIN, INT64_MAX, "x", &v), KILN_OK);
    assert_true(v == INT64_MIN);
    const char *bad[] = {"", " 5", "5 ", "+5", "5x", "0x10", "1e1", "1.0", "10.", "inf", "nan", "-", "--5", "٣",
                         "9223372036854775808", "-9223372036854775809", "99999999999999999999", "1 000", "5\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) expect_refused_i64(bad[i], INT64_MIN, INT64_MAX);
    expect_refused_i64(NULL, 0, 1);
    /* the range, and its words */
    expect_refused_i64("-5", 0, 1024);
    assert_string_equal(kiln_last_error(), "--thing must be a whole number from 0 to 1024, got '-5'");
    expect_refused_i64("2000000", 0, 1024);
    expect_refused_i64("0", 1, INT64_MAX);
    assert_string_equal(kiln_last_error(), "--thing must be a whole number >= 1, got '0'");
    assert_int_equal(kiln__parse_i64("1024", 0, 1024, "x", &v), KILN_OK);
    /* a long text is quoted short, the reason whole */
    char long_text[300];
    memset(long_text, '7', sizeof long_text - 1);
    long_text[sizeof long_text - 1] = 0;
    expect_refused_i64(long_text, 0, 10);
    assert_non_null(strstr(kiln_last_error(), "…'"));
    assert_true(strlen(kiln_last_error()) < 120);
    /* unsigned: the RNG's words */
    uint64_t u;
    assert_int_equal(kiln__parse_u64("18446744073709551615", "x", &u), KILN_OK);
    assert_true(u == UINT64_MAX);
    assert_int_not_equal(kiln__parse_u64("18446744073709551616", "x", &u), KILN_OK);
    assert_int_not_equal(kiln__parse_u64("-1", "x", &u), KILN_OK);
    assert_int_not_equal(kiln__parse_u64("", "x", &u), KILN_OK);
    kiln_clear_error();
}

/* Reals: C's decimal syntax without hex, inf or nan; finite (an overflow refused, an
 * underflow the tiny value it is); in range, with either end excluded on request. */
static void reals_are_finite_decimal_and_in_range(void **state)
{
    (void)state;
    double v;
    const struct {
        const char *s;
        double want;
    } good[] = {{"0", 0}, {"1.5", 1.5}, {".5", 0.5}, {"5.", 5}, {"-2e-3", -2e-3}, {"1E3", 1000}, {"1e+3", 1000},
                {"1e-320", 1e-320}, {"1.7976931348623157e308", DBL_MAX}};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        assert_int_equal(kiln__parse_f64(good[i].s, -DBL_MAX, DBL_MAX, 0, "x", &v), KILN_OK);
        assert_true(v == good[i].want);
    }
    const char *bad[] = {"",     " 1",   "1 ",     "+1",  "1e",  "e5",  ".",     "-",    "0x10", "0x1p3",
                         "inf",  "-inf", "nan",    "NAN", "1e400", "1e309", "-1e999", "1,5",  "1.5f", "infinity"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) expect_refused_f64(bad[i], -DBL_MAX, DBL_MAX, 0);
    assert_non_null(strstr(kiln_last_error(), "a finite number"));
    expect_refused_f64("-1", 0, DBL_MAX, KILN__PARSE_ABOVE_LO);
    assert_string_equal(kiln_last_error(), "--thing must be a number above 0, got '-1'");
    expect_refused_f64("0", 0, DBL_MAX, KILN__PARSE_ABOVE_LO);
    expect_refused_f64("2", 0, 1, KILN__PARSE_ABOVE_LO);
    assert_string_equal(kiln_last_error(), "--thing must be a number above 0 and at most 1, got '2'");
    expect_refused_f64("1", 0, 1, KILN__PARSE_BELOW_HI);
    assert_string_equal(kiln_last_error(), "--thing must be a number >= 0 and below 1, got '1'");
    expect_refused_f64("1e-320", FLT_MIN, FLT_MAX, 0); /* a subnormal softcap */
    assert_int_equal(kiln__parse_f64("1", 0, 1, KILN__PARSE_ABOVE_LO, "x", &v), KILN_OK);
    assert_int_equal(kiln__parse_f64("0", 0, 1, KILN__PARSE_BELOW_HI, "x", &v), KILN_OK);
    kiln_clear_error();
}

/* A scanner's view: the length of the number at the start of a larger text. */
static void number_len_finds_a_literal_end(void **state)
{
    (void)state;
    bool integer;
    assert_int_equal(kiln__number_len("123 + x", &integer), 3);
    assert_true(integer);
    assert_int_equal(kiln__number_len("1.5f)", &integer), 3);
    assert_false(integer);
    assert_int_equal(kiln__number_len("2e10*", &integer), 4);
    assert_false(integer);
    assert_int_equal(kiln__number_len("2e*", &integer), 1); /* no exponent digits: not an exponent */
    assert_true(integer);
    assert_int_equal(kiln__number_len("0x10", &integer), 1);
    assert_int_equal(kiln__number_len(".x", &integer), 0);
    assert_int_equal(kiln__number_len("x", &integer), 0);
}

static bool valid_utf8(const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        int n = *p < 0x80 ? 0 : (*p & 0xE0) == 0xC0 ? 1 : (*p & 0xF0) == 0xE0 ? 2 : (*p & 0xF8) == 0xF0 ? 3 : -1;
        if (n < 0) return false;
        p++;
        for (int i = 0; i < n; i++, p++)
            if ((*p & 0xC0) != 0x80) return false;
    }
    return true;
}

/* A long input is quoted around the place in question, cut ends marked, never inside a
 * UTF-8 character. */
static void excerpt_quotes_long_input_short(void **state)
{
    (void)state;
    char buf[128];
    assert_string_equal(kiln__excerpt("short", 3, 40, buf, sizeof buf), "short");
    char s[1000];
    for (int i = 0; i < 999; i++) s[i] = (char)('a' + i % 26);
    s[999] = 0;
    kiln__excerpt(s, 500, 40, buf, sizeof buf);
    assert_true(!strncmp(buf, "…", strlen("…")));
    assert_non_null(strstr(buf, "…") + 1);
    assert_true(strlen(buf) <= 40 + 2 * strlen("…"));
    assert_non_null(strstr(buf, "ghijklmnop")); /* s[500..] is "ghij..." */
    kiln__excerpt(s, 0, 40, buf, sizeof buf);
    assert_true(!strncmp(buf, "abcdef", 6)); /* the start: no leading mark */
    /* 'é' is two bytes: no cut lands between them */
    char u[200] = "";
    for (int i = 0; i < 90; i++) strcat(u, "é");
    for (size_t at = 0; at < strlen(u); at += 7) {
        kiln__excerpt(u, at, 41, buf, sizeof buf);
        assert_true(valid_utf8(buf));
    }
}

/* A thread count past 8 per online core (or KILN__MAX_THREADS) is capped, with a word on
 * stderr; a sane count or 0 (one per core) is taken as it is. */
static void thread_counts_are_capped(void **state)
{
    (void)state;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int cap = (int)(online * KILN__MAX_THREADS_PER_CORE < KILN__MAX_THREADS ? online * KILN__MAX_THREADS_PER_CORE
                                                                           : KILN__MAX_THREADS);
    assert_int_equal(kiln__pool_threads(1, "test"), 1);
    assert_int_equal(kiln__pool_threads(0, "test"), online < KILN__MAX_THREADS ? online : KILN__MAX_THREADS);
    assert_int_equal(kiln__pool_threads(cap, "test"), cap);
    assert_int_equal(kiln__pool_threads(2000000, "test"), cap);
    assert_int_equal(kiln__pool_threads(cap + 1, "test"), cap);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(whole_numbers_are_the_whole_text_and_in_range),
        cmocka_unit_test(reals_are_finite_decimal_and_in_range),
        cmocka_unit_test(number_len_finds_a_literal_end),
        cmocka_unit_test(excerpt_quotes_long_input_short),
        cmocka_unit_test(thread_counts_are_capped),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
