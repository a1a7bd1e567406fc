/* The environment table (src/core/env.def, env.c): every KILN_* variable kiln reads is
 * one row, read through one accessor family; kiln doctor --env prints the table and
 * docs/env.md is that listing; no getenv("KILN_...") is left elsewhere in src/ or
 * tools/; the compiler's stages are switches beside the optimization switches. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include "core/env.h"
#include "core/opts.h"
#include "kiln/dist.h"
#include "test_util.h"

/* Runs a shell command; its exit status, and its stdout (stderr too with "2>&1" in cmd). */
static int run(char *out, size_t n, const char *cmd)
{
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t got = fread(out, 1, n - 1, p);
    out[got] = 0;
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {
    }
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static const char *tool(void)
{
    const char *t = kiln__env_text(KILN__ENV_TOOL);
    return t ? t : "./kiln";
}

/* Every row: a unique name starting with KILN_, a meaning, and a default that is a value
 * of its type within its range (or none, or a description in parentheses); the public
 * listing is the same table; the switches are rows, the compiler's stages last. */
static void every_row_is_named_once_and_its_default_parses(void **state)
{
    assert_int_equal(kiln_env_count(), KILN__ENV_COUNT);
    for (int i = 0; i < KILN__ENV_COUNT; i++) {
        const kiln__env_row *r = kiln__env_row_at(i);
        assert_non_null(r);
        if (strncmp(r->name, "KILN_", 5)) fail_msg("row %d: %s does not start with KILN_", i, r->name);
        if (!r->help || strlen(r->help) < 10) fail_msg("%s: no meaning", r->name);
        for (int j = 0; j < i; j++)
            if (!strcmp(kiln__env_row_at(j)->name, r->name)) fail_msg("%s is in the table twice", r->name);
        assert_int_equal(kiln__env_find(r->name), i);
        kiln_env_var v;
        assert_true(kiln_env_var_at(i, &v));
        assert_string_equal(v.name, r->name);
        if (r->type == KILN__ENVT_INT || r->type == KILN__ENVT_NUM)
            if (!(r->lo < r->hi)) fail_msg("%s: empty range [%g, %g]", r->name, r->lo, r->hi);
        if (!*r->dflt || *r->dflt == '(') {
            /* described defaults: paths, strings, and the switches decided at run time */
            bool auto_opt = !strncmp(r->name, "KILN_OPT_", 9) && !strcmp(r->dflt, "(auto)");
            if (*r->dflt == '(' && (r->type != KILN__ENVT_PATH && r->type != KILN__ENVT_STRING) && !auto_opt)
                fail_msg("%s: a described default on a %s", r->name, kiln__env_type_name(r->type));
            continue;
        }
        char *was = getenv(r->name) ? strdup(getenv(r->name)) : NULL;
        test_setenv(r->name, r->dflt, 1);
        if (kiln__env_check((kiln__env_id)i) != KILN_OK) fail_msg("%s: default %s: %s", r->name, r->dflt, kiln_last_error());
        if (was) test_setenv(r->name, was, 1);
        else test_unsetenv(r->name);
        free(was);
    }
    assert_null(kiln__env_row_at(KILN__ENV_COUNT));
    assert_false(kiln_env_var_at(KILN__ENV_COUNT, &(kiln_env_var){0}));
    for (int o = 0; o < KILN__OPT_COUNT; o++) {
        char want[80];
        snprintf(want, sizeof want, "KILN_OPT_%s", kiln_opt_name(o));
        assert_string_equal(kiln__env_row_at(KILN__ENV_OPT(o))->name, want);
        bool stage = !strncmp(kiln_opt_name(o), "COMPILE_", 8);
        if (stage != (o >= KILN__OPT_FIRST_STAGE)) fail_msg("switch %s: the compiler's stages come last, and only they", want);
    }
    assert_int_equal(KILN__OPT_COUNT - KILN__OPT_FIRST_STAGE, 15); /* decompose ... reuse, epilogue */
}

/* Each type parses, and an unset (or empty) variable is its default. */
static void accessors_parse_types_and_defaults(void **state)
{
    test_unsetenv("KILN_RECOMPILE_LIMIT");
    assert_int_equal(kiln__env_int(KILN__ENV_RECOMPILE_LIMIT), 8);
    test_setenv("KILN_RECOMPILE_LIMIT", "3", 1);
    assert_int_equal(kiln__env_int(KILN__ENV_RECOMPILE_LIMIT), 3);
    test_setenv("KILN_RECOMPILE_LIMIT", "", 1);
    assert_int_equal(kiln__env_int(KILN__ENV_RECOMPILE_LIMIT), 8);
    test_unsetenv("KILN_RECOMPILE_LIMIT");

    assert_true(kiln__env_num(KILN__ENV_COMPILE_BUCKET_MB) == 4);
    test_setenv("KILN_COMPILE_BUCKET_MB", "0.5", 1);
    assert_true(kiln__env_num(KILN__ENV_COMPILE_BUCKET_MB) == 0.5);
    test_unsetenv("KILN_COMPILE_BUCKET_MB");

    static const char *const yes[] = {"1", "true", "ON", "yes"}, *const no[] = {"0", "false", "off", "No"};
    for (int i = 0; i < 4; i++) {
        test_setenv("KILN_DIST_DEBUG", yes[i], 1);
        assert_true(kiln__env_bool(KILN__ENV_DIST_DEBUG));
        test_setenv("KILN_DIST_DEBUG", no[i], 1);
        assert_false(kiln__env_bool(KILN__ENV_DIST_DEBUG));
    }
    test_unsetenv("KILN_DIST_DEBUG");
    assert_false(kiln__env_bool(KILN__ENV_DIST_DEBUG));
    assert_true(kiln__env_bool(KILN__ENV_OPT(KILN__OPT_COMPILE_FUSION))); /* switches default to their row's */

    test_unsetenv("KILN_CC");
    assert_null(kiln__env_str(KILN__ENV_CC));
    assert_string_equal(kiln__env_text(KILN__ENV_CC), "cc");
    test_setenv("KILN_CC", "clang", 1);
    assert_string_equal(kiln__env_str(KILN__ENV_CC), "clang");
    assert_string_equal(kiln__env_text(KILN__ENV_CC), "clang");
    test_unsetenv("KILN_CC");
    char *cache = strdup(getenv("KILN_CACHE_DIR") ? getenv("KILN_CACHE_DIR") : "");
    test_unsetenv("KILN_CACHE_DIR");
    assert_null(kiln__env_text(KILN__ENV_CACHE_DIR)); /* a described default is no value */
    if (*cache) test_setenv("KILN_CACHE_DIR", cache, 1);
    free(cache);

    test_setenv("KILN_LOGS", "graph,,fusion", 1);
    assert_true(kiln__env_list_has(KILN__ENV_LOGS, "fusion"));
    assert_true(kiln__log_on("graph"));
    assert_false(kiln__log_on("fus"));
    assert_false(kiln__log_on("code"));
    test_setenv("KILN_LOGS", "all", 1);
    assert_true(kiln__log_on("code"));
    test_unsetenv("KILN_LOGS");
    assert_false(kiln__log_on("code"));

    /* the public lookup, by name: a name not in the table is an error that names it */
    test_setenv("KILN_DATA", "corpus.txt", 1);
    assert_string_equal(kiln_env("KILN_DATA"), "corpus.txt");
    test_unsetenv("KILN_DATA");
    assert_null(kiln_env("KILN_DATA"));
    assert_string_equal(kiln_env_or_default("KILN_DATA"), "data/kjv.txt");
    kiln_clear_error();
    assert_null(kiln_env("KILN_NO_SUCH_THING"));
    assert_non_null(strstr(kiln_last_error(), "KILN_NO_SUCH_THING"));
}

/* A value that is not of its type or range is said once on stderr, naming the variable,
 * the value and what it should be, and the default is used; kiln__env_check makes it an
 * error instead, which the process group's readers return. */
static void bad_value_is_said_once_and_the_default_used(void **state)
{
    char err[2048];
    test_stderr cap;
    test_setenv("KILN_COMPILE_MAX_FUSE", "many", 1);
    assert_true(test_stderr_begin(&cap));
    int64_t a = kiln__env_int(KILN__ENV_COMPILE_MAX_FUSE), b = kiln__env_int(KILN__ENV_COMPILE_MAX_FUSE);
    test_stderr_end(&cap, err, sizeof err);
    test_unsetenv("KILN_COMPILE_MAX_FUSE");
    assert_int_equal(a, 48);
    assert_int_equal(b, 48);
    const char *want = "kiln: KILN_COMPILE_MAX_FUSE='many' is not a whole number from 1 to 100000; using 48\n";
    if (!strstr(err, want)) fail_msg("stderr: %s", err);
    if (strstr(strstr(err, want) + strlen(want), "KILN_COMPILE_MAX_FUSE")) fail_msg("said twice: %s", err);

    test_setenv("KILN_LOCAL_WORLD_SIZE", "0", 1); /* out of range */
    assert_true(test_stderr_begin(&cap));
    assert_int_equal(kiln__env_int(KILN__ENV_LOCAL_WORLD_SIZE), 1);
    test_stderr_end(&cap, err, sizeof err);
    test_unsetenv("KILN_LOCAL_WORLD_SIZE");
    if (!strstr(err, "KILN_LOCAL_WORLD_SIZE='0' is not a whole number from 1 to")) fail_msg("stderr: %s", err);

    test_setenv("KILN_OPT_COMPILE_HOIST", "maybe", 1);
    assert_true(test_stderr_begin(&cap));
    bool on = kiln__opt(KILN__OPT_COMPILE_HOIST);
    test_stderr_end(&cap, err, sizeof err);
    test_unsetenv("KILN_OPT_COMPILE_HOIST");
    assert_true(on); /* the default */
    if (!strstr(err, "KILN_OPT_COMPILE_HOIST='maybe' is not 0 or 1")) fail_msg("stderr: %s", err);

    test_setenv("KILN_DIST_TIMEOUT", "soon", 1);
    assert_int_equal(kiln__env_check(KILN__ENV_DIST_TIMEOUT), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "KILN_DIST_TIMEOUT='soon' is not a number above 0"));
    kiln_clear_error();
    kiln_pg_t *pg = NULL;
    assert_int_equal(kiln_pg_new_from_env(&pg), KILN_ERR_ARG);
    assert_null(pg);
    assert_non_null(strstr(kiln_last_error(), "KILN_DIST_TIMEOUT='soon'"));
    test_setenv("KILN_DIST_TIMEOUT", "-3", 1);
    assert_int_equal(kiln_pg_new_from_env(&pg), KILN_ERR_ARG);
    test_unsetenv("KILN_DIST_TIMEOUT");
    kiln_clear_error();
}

/* Numbers in the environment are read by core/parse.h's strict reader: the whole value,
 * decimal, in int64 (an int) or finite (a number); hex, an exponent for an int, a space
 * or '+' around it, inf and nan are not values: said, and the default used. A thread
 * count past the row's range (KILN_NUM_THREADS=1000000) is one of them. */
static void numbers_are_read_strictly(void **state)
{
    char err[2048];
    test_stderr cap;
    const char *bad[] = {"0x10", "1e1", " 5", "5 ", "+5", "5.0", "99999999999999999999", "inf"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        test_setenv("KILN_RECOMPILE_LIMIT", bad[i], 1);
        assert_false(kiln__env_valid(KILN__ENV_RECOMPILE_LIMIT));
        assert_int_equal(kiln__env_check(KILN__ENV_RECOMPILE_LIMIT), KILN_ERR_ARG);
        if (!strstr(kiln_last_error(), "is not a whole number")) fail_msg("'%s': %s", bad[i], kiln_last_error());
    }
    test_setenv("KILN_RECOMPILE_LIMIT", "5", 1);
    assert_int_equal(kiln__env_int(KILN__ENV_RECOMPILE_LIMIT), 5);
    test_unsetenv("KILN_RECOMPILE_LIMIT");
    const char *badnum[] = {"nan", "inf", "-inf", "1e400", "0x10", " 1", "1,5"};
    for (size_t i = 0; i < sizeof badnum / sizeof badnum[0]; i++) {
        test_setenv("KILN_DIST_TIMEOUT", badnum[i], 1);
        if (kiln__env_valid(KILN__ENV_DIST_TIMEOUT)) fail_msg("KILN_DIST_TIMEOUT='%s' taken", badnum[i]);
    }
    test_setenv("KILN_DIST_TIMEOUT", "2.5e1", 1);
    assert_true(kiln__env_num(KILN__ENV_DIST_TIMEOUT) == 25);
    test_unsetenv("KILN_DIST_TIMEOUT");
    test_setenv("KILN_NUM_THREADS", "1000000", 1);
    assert_true(test_stderr_begin(&cap));
    int64_t n = kiln__env_int(KILN__ENV_NUM_THREADS);
    test_stderr_end(&cap, err, sizeof err);
    test_unsetenv("KILN_NUM_THREADS");
    assert_int_equal(n, 0); /* the default: one per core */
    if (!strstr(err, "KILN_NUM_THREADS='1000000' is not a whole number from 0 to 1024")) fail_msg("stderr: %s", err);
    kiln_clear_error();
}

/* KILN_OPT_COMPILE_<STAGE>=0 and KILN_COMPILE_DISABLE=<stage> turn the same switch off,
 * for every stage, read again at each ask (tests/test_compile.c checks what a compile
 * then does); a stage runs when neither turns it off; a name that is no stage is said
 * once and ignored. */
static void stage_switch_and_alias_turn_off_the_same_stage(void **state)
{
    bool dflt[KILN__OPT_COUNT]; /* each stage as nothing sets it (EPILOGUE is off) */
    test_unsetenv("KILN_COMPILE_DISABLE");
    for (int s = KILN__OPT_FIRST_STAGE; s < KILN__OPT_COUNT; s++) {
        char var[80];
        snprintf(var, sizeof var, "KILN_OPT_%s", kiln_opt_name(s));
        test_unsetenv(var); /* whatever the caller's environment set */
        dflt[s] = kiln__opt((kiln__opt_id)s);
    }
    assert_false(dflt[KILN__OPT_COMPILE_EPILOGUE]);
    assert_true(dflt[KILN__OPT_COMPILE_FUSION]);
    for (int s = KILN__OPT_FIRST_STAGE; s < KILN__OPT_COUNT; s++) {
        const char *name = kiln_opt_name(s), *stage = name + strlen("COMPILE_");
        char var[80], lower[40];
        snprintf(var, sizeof var, "KILN_OPT_%s", name);
        size_t i = 0;
        for (; stage[i] && i < sizeof lower - 1; i++) lower[i] = (char)tolower(stage[i]);
        lower[i] = 0;
        test_setenv(var, "0", 1);
        if (kiln__opt((kiln__opt_id)s)) fail_msg("%s=0 left it on", var);
        assert_false(kiln_opt_enabled(s));
        test_setenv(var, "1", 1);
        assert_true(kiln__opt((kiln__opt_id)s));
        test_unsetenv(var);
        char list[80];
        snprintf(list, sizeof list, "fold,%s", lower);
        test_setenv("KILN_COMPILE_DISABLE", list, 1);
        if (kiln__opt((kiln__opt_id)s)) fail_msg("KILN_COMPILE_DISABLE=%s left %s on", list, name);
        for (int t = KILN__OPT_FIRST_STAGE; t < KILN__OPT_COUNT; t++)
            if (t != s && t != KILN__OPT_COMPILE_FOLD && kiln__opt((kiln__opt_id)t) != dflt[t])
                fail_msg("KILN_COMPILE_DISABLE=%s turned %s off too", list, kiln_opt_name(t));
        test_setenv(var, "1", 1); /* either one turns a stage off */
        assert_false(kiln__opt((kiln__opt_id)s));
        test_unsetenv(var);
        test_unsetenv("KILN_COMPILE_DISABLE");
        assert_int_equal(kiln__opt((kiln__opt_id)s), dflt[s]);
    }
    char err[2048];
    test_stderr cap;
    test_setenv("KILN_COMPILE_DISABLE", "fusoin,reuse", 1);
    assert_true(test_stderr_begin(&cap));
    bool fusion = kiln__opt(KILN__OPT_COMPILE_FUSION), reuse = kiln__opt(KILN__OPT_COMPILE_REUSE);
    test_stderr_end(&cap, err, sizeof err);
    test_unsetenv("KILN_COMPILE_DISABLE");
    assert_true(fusion);
    assert_false(reuse);
    const char *want = "kiln: KILN_COMPILE_DISABLE: no stage 'fusoin' (the stages: decompose, fold, cse, slices, views, "
                       "dce, coalesce, recompute, hoist, fusion, codegen, symbolic, overlap, reuse, epilogue); ignored\n";
    if (!strstr(err, want)) fail_msg("stderr: %s", err);
    if (strstr(strstr(err, want) + strlen(want), "fusoin")) fail_msg("said twice: %s", err);
}

/* kiln doctor --env prints every row, with the value set here and a note under a value
 * that is not valid; kiln doctor --switches lists every switch, the stages among them. */
static void doctor_prints_every_variable(void **state)
{
    static char out[1 << 16];
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "KILN_RECOMPILE_LIMIT=5 KILN_COMPILE_MAX_FUSE=zero %s doctor --env 2>&1", tool());
    int rc = run(out, sizeof out, cmd);
    if (rc != 0) fail_msg("kiln doctor --env: %d: %s", rc, out);
    for (int i = 0; i < KILN__ENV_COUNT; i++) {
        char line[128];
        snprintf(line, sizeof line, "\n%s ", kiln__env_row_at(i)->name);
        if (!strstr(out, line)) fail_msg("kiln doctor --env has no line for %s:\n%s", kiln__env_row_at(i)->name, out);
    }
    char line[512];
    snprintf(line, sizeof line, "%s", strstr(out, "\nKILN_RECOMPILE_LIMIT ") + 1);
    *strchr(line, '\n') = 0;
    if (!strstr(line, " int ") || !strstr(line, " 5 ") || !strstr(line, "(default 8;")) fail_msg("the line: %s", line);
    assert_non_null(strstr(out, "^ KILN_COMPILE_MAX_FUSE='zero' is not a whole number"));
    snprintf(cmd, sizeof cmd, "%s doctor --switches 2>&1", tool());
    assert_int_equal(run(out, sizeof out, cmd), 0);
    for (int o = 0; o < kiln_opt_count(); o++) {
        char line[128];
        snprintf(line, sizeof line, "\n  %s ", kiln_opt_name(o));
        if (!strstr(out, line)) fail_msg("kiln doctor does not list switch %s:\n%s", kiln_opt_name(o), out);
    }
    assert_non_null(strstr(out, "kiln doctor --env"));
    snprintf(cmd, sizeof cmd, "%s doctor --markdown 2>&1", tool());
    assert_int_equal(run(out, sizeof out, cmd), 1); /* --markdown goes with --env */
}

/* A KILN_* variable that the table lacks is said once, with the closest name it has. */
static void typo_guard_names_the_closest_variable(void **state)
{
    static char out[1 << 16];
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "KILN_DEVCE=cpu KILN_ZZZZZZZZZZZZ=1 %s doctor 2>&1 >/dev/null", tool());
    assert_int_equal(run(out, sizeof out, cmd), 0);
    if (!strstr(out, "kiln: KILN_DEVCE is set, but kiln reads no such variable; did you mean KILN_DEVICE?"))
        fail_msg("stderr: %s", out);
    if (!strstr(out, "kiln: KILN_ZZZZZZZZZZZZ is set, but kiln reads no such variable (kiln doctor --env lists them)"))
        fail_msg("stderr: %s", out);
    const char *first = strstr(out, "KILN_DEVCE is set");
    if (strstr(first + 1, "KILN_DEVCE is set")) fail_msg("said twice: %s", out);
    snprintf(cmd, sizeof cmd, "KILN_DEVICE=cpu KILN_OPT_FAST_EXP=1 %s doctor 2>&1 >/dev/null", tool());
    assert_int_equal(run(out, sizeof out, cmd), 0);
    if (strstr(out, "no such variable")) fail_msg("a known variable was taken for a typo: %s", out);
}

/* Whether kiln doctor, run with env before it, lists switch OWN_GEMM on; its stdout and
 * stderr together in out. */
static bool own_gemm_on(const char *env, char *out, size_t n)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "env -u KILN_OPT_OWN_GEMM KILN_DEVICE=cpu %s %s doctor --switches 2>&1", env, tool());
    int rc = run(out, n, cmd); /* 1 where a variable's value is bad: doctor fails that row */
    if (rc != 0 && rc != 1) fail_msg("%s: exit %d: %s", cmd, rc, out);
    const char *row = strstr(out, "\n  OWN_GEMM ");
    if (!row) fail_msg("kiln doctor lists no OWN_GEMM switch: %s", out);
    row += strlen("\n  OWN_GEMM ");
    while (*row == ' ') row++;
    if (strncmp(row, "on ", 3) && strncmp(row, "off", 3)) fail_msg("OWN_GEMM's row: %.80s", row);
    return !strncmp(row, "on ", 3);
}

/* KILN_OPT_OWN_GEMM is an auto switch: unset, f32 matmuls and attention run on kiln's own
 * GEMM exactly where the BLAS runs a generic core (OpenBLAS's Prescott kernels, forced
 * here with OPENBLAS_CORETYPE) and kiln's GEMM has vector kernels for the processor; set,
 * it is as set; set to no bool, that is said and it stays auto. The oracle is the
 * library's own report of the BLAS's core and kiln's f32 kernel. */
static void own_gemm_is_auto_where_the_blas_runs_a_generic_core(void **state)
{
    (void)state;
    assert_true(kiln__opt_is_auto(KILN__OPT_OWN_GEMM));
    assert_false(kiln__opt_is_auto(KILN__OPT_FAST_EXP));
    assert_string_equal(kiln__env_row_at(KILN__ENV_OPT(KILN__OPT_OWN_GEMM))->dflt, "(auto)");
    kiln_blas_info b;
    kiln_cpu_info c;
    kiln_blas_info_get(&b);
    kiln_cpu_info_get(&c);
    bool vector = strcmp(c.gemm_f32, "c") != 0;
    static char err[1 << 16];
    /* as this process's environment leaves the BLAS */
    assert_int_equal(own_gemm_on("", err, sizeof err), b.generic_core && vector);
    assert_true(own_gemm_on("KILN_OPT_OWN_GEMM=1", err, sizeof err));
    assert_false(own_gemm_on("KILN_OPT_OWN_GEMM=0", err, sizeof err));
    /* OPENBLAS_CORETYPE chooses the kernels only in an OpenBLAS built for every core */
    if (strcmp(b.name, "OpenBLAS") || !strstr(b.config, "DYNAMIC_ARCH")) {
        print_message("the BLAS is %s (%s), not OpenBLAS built with DYNAMIC_ARCH: the forced generic-core cases are "
                      "not run\n", b.name, b.config);
        return;
    }
    assert_int_equal(own_gemm_on("OPENBLAS_CORETYPE=Prescott", err, sizeof err), vector);
    assert_false(own_gemm_on("OPENBLAS_CORETYPE=Prescott KILN_OPT_OWN_GEMM=0", err, sizeof err));
    assert_int_equal(own_gemm_on("OPENBLAS_CORETYPE=Prescott KILN_OPT_OWN_GEMM=maybe", err, sizeof err), vector);
    if (!strstr(err, "KILN_OPT_OWN_GEMM='maybe' is not 0 or 1")) fail_msg("stderr: %s", err);
}

/* docs/env.md's table is kiln doctor --env --markdown, so that the list is written once. */
static void docs_env_md_is_the_doctor_listing(void **state)
{
    const char *src = kiln__env_str(KILN__ENV_SOURCE_DIR);
    if (!src) skip();
    static char doc[1 << 17], out[1 << 16];
    char path[1024], cmd[1024];
    snprintf(path, sizeof path, "%s/docs/env.md", src);
    if (!test_read_text(path, doc, sizeof doc)) fail_msg("cannot read %s", path);
    snprintf(cmd, sizeof cmd, "%s doctor --env --markdown", tool());
    assert_int_equal(run(out, sizeof out, cmd), 0);
    const char *begin = "<!-- begin: kiln doctor --env --markdown -->\n", *end = "<!-- end -->";
    char *b = strstr(doc, begin), *e = b ? strstr(b, end) : NULL;
    if (!b || !e) fail_msg("%s: no table between \"%s\" and \"%s\"", path, begin, end);
    b += strlen(begin);
    *e = 0;
    if (strcmp(b, out))
        fail_msg("docs/env.md's table is not kiln doctor --env --markdown; regenerate it (docs/env.md says how). Now:\n%s", out);
}

/* No getenv of a KILN_* variable in src/ or tools/ outside the env module, and every
 * name that the kiln program looks up is a row. */
static void no_kiln_getenv_outside_the_env_module(void **state)
{
    const char *src = kiln__env_str(KILN__ENV_SOURCE_DIR);
    if (!src) skip();
    static char out[1 << 16];
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "cd '%s' && grep -rnE 'getenv *\\( *\"KILN_' src tools --include='*.c' --include='*.h' | "
             "grep -v '^src/core/env\\.def:'",
             src);
    run(out, sizeof out, cmd);
    if (*out) fail_msg("read KILN_* variables through src/core/env.h (kiln_env in tools/), not getenv:\n%s", out);
    snprintf(cmd, sizeof cmd, "cd '%s' && grep -rhoE 'kiln_env(_or_default|_check)?\\(\"KILN_[A-Z0-9_]*' tools src | "
             "sed 's/.*(\"//' | sort -u", src);
    run(out, sizeof out, cmd);
    int n = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"), n++)
        if (kiln__env_find(line) < 0) fail_msg("%s is looked up by name but is not in src/core/env.def", line);
    assert_true(n >= 3); /* KILN_DATA, KILN_DEVICE, KILN_NUM_THREADS, KILN_API_KEY */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(every_row_is_named_once_and_its_default_parses, setup, teardown),
        cmocka_unit_test_setup_teardown(accessors_parse_types_and_defaults, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_value_is_said_once_and_the_default_used, setup, teardown),
        cmocka_unit_test_setup_teardown(numbers_are_read_strictly, setup, teardown),
        cmocka_unit_test_setup_teardown(stage_switch_and_alias_turn_off_the_same_stage, setup, teardown),
        cmocka_unit_test_setup_teardown(doctor_prints_every_variable, setup, teardown),
        cmocka_unit_test_setup_teardown(typo_guard_names_the_closest_variable, setup, teardown),
        cmocka_unit_test_setup_teardown(own_gemm_is_auto_where_the_blas_runs_a_generic_core, setup, teardown),
        cmocka_unit_test_setup_teardown(docs_env_md_is_the_doctor_listing, setup, teardown),
        cmocka_unit_test_setup_teardown(no_kiln_getenv_outside_the_env_module, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
