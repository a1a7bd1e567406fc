/* The extension languages (kiln/ext.h, src/ext/lang.c): the built-in rows, a user's
 * file adding and replacing rows, the default file under $XDG_CONFIG_HOME, malformed
 * entries refused by name, command expansion with quoting, and `kiln ext build`
 * routing a made-up suffix to a stand-in compiler with the flags its entry names. */
#include <dlfcn.h>
#include <fcntl.h>
#include <setjmp.h>
#include <time.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cmocka.h>

#include "kiln/kiln.h"
#include "test_util.h"

static char dir[] = "/tmp/kiln-ext-test-XXXXXX";

static const char *path_in(const char *name)
{
    static char p[8][256];
    static int i;
    i = (i + 1) % 8;
    snprintf(p[i], sizeof p[i], "%s/%s", dir, name);
    return p[i];
}

static void write_file(const char *name, const char *text)
{
    FILE *f = fopen(path_in(name), "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static const kiln_ext_lang *find(const kiln_ext_langs_t *t, const char *src)
{
    const kiln_ext_lang *l = kiln_ext_langs_find(t, src);
    if (!l) fail_msg("%s: %s", src, kiln_last_error());
    return l;
}

/* Built-ins: .c, .cpp and .cu compiled into shared objects, .cl handed to OpenCL. */
static void builtins_are_c_cpp_cl_cu(void **state)
{
    test_setenv("XDG_CONFIG_HOME", path_in("none"), 1); /* no user file there */
    kiln_ext_langs_t *t;
    assert_int_equal(kiln_ext_langs_load(NULL, &t), KILN_OK);
    assert_int_equal(kiln_ext_langs_count(t), 4);
    assert_string_equal(find(t, "a.c")->load, "shared");
    assert_non_null(strstr(find(t, "a.cpp")->command, "c++"));
    assert_non_null(strstr(find(t, "a.cu")->command, "nvcc"));
    const kiln_ext_lang *cl = find(t, "k.cl");
    assert_string_equal(cl->load, "backend");
    assert_string_equal(cl->backend, "opencl");
    assert_string_equal(cl->origin, "built-in");
    assert_null(kiln_ext_langs_at(t, 4));
    kiln_ext_langs_free(t);
}

/* A file adds .asc and replaces .c; the longest suffix wins; the user's default file is
 * read from $XDG_CONFIG_HOME/kiln/languages.json. */
static void a_file_adds_and_replaces_rows(void **state)
{
    const char *json = "{\"languages\": [{\"suffix\": \".asc\", \"command\": \"bisheng -x asc {flags} -I{include} -c "
                       "{src} -o {out}\", \"flags\": \"-O3\"}, {\"suffix\": \".c\", \"command\": \"clang {flags} -c "
                       "{src} -o {out}\", \"flags\": \"-O1\", \"depfile\": \"\"}, {\"suffix\": \".tar.asc\", \"command\": "
                       "\"x {src} {out}\"}]}";
    write_file("langs.json", json);
    kiln_ext_langs_t *t;
    assert_int_equal(kiln_ext_langs_load(path_in("langs.json"), &t), KILN_OK);
    assert_int_equal(kiln_ext_langs_count(t), 6);
    const kiln_ext_lang *asc = find(t, "dir/op.asc");
    assert_string_equal(asc->object, ".o"); /* the default */
    assert_string_equal(asc->load, "shared");
    assert_string_equal(asc->origin, path_in("langs.json"));
    assert_string_equal(find(t, "x.tar.asc")->suffix, ".tar.asc");
    assert_string_equal(find(t, "m.c")->flags, "-O1");
    assert_string_equal(find(t, "m.c")->origin, path_in("langs.json"));
    assert_null(kiln_ext_langs_find(t, "m.zz"));
    assert_non_null(strstr(kiln_last_error(), "m.zz: no extension language"));
    assert_non_null(strstr(kiln_last_error(), ".asc"));
    kiln_ext_langs_free(t);
    /* the default file */
    mkdir(path_in("cfg"), 0755);
    mkdir(path_in("cfg/kiln"), 0755);
    write_file("cfg/kiln/languages.json", json);
    test_setenv("XDG_CONFIG_HOME", path_in("cfg"), 1);
    assert_int_equal(kiln_ext_langs_load(NULL, &t), KILN_OK);
    assert_int_equal(kiln_ext_langs_count(t), 6);
    kiln_ext_langs_free(t);
    test_unsetenv("XDG_CONFIG_HOME");
    kiln_clear_error();
}

/* Each malformed file is refused with a message naming the file, the entry and what
 * is wrong, and no table is made. */
static void malformed_entries_are_refused_by_name(void **state)
{
    static const struct {
        const char *json, *says;
    } bad[] = {
        {"{\"languages\": [{\"command\": \"cc {src} -o {out}\"}]}", "'suffix' must be a file suffix"},
        {"{\"languages\": [{\"suffix\": \"asc\", \"command\": \"cc {src} -o {out}\"}]}", "'suffix' must be"},
        {"{\"languages\": [{\"suffix\": \".asc\", \"command\": \"cc {src}\"}]}", "needs a 'command' with {src} and {out}"},
        {"{\"languages\": [{\"suffix\": \".asc\", \"command\": \"cc {src} -o {out} {optimize}\"}]}",
         "'command' has {optimize}"},
        {"{\"languages\": [{\"suffix\": \".asc\", \"command\": \"cc {src} -o {out}\", \"load\": \"dlopen\"}]}",
         "'load' is \"dlopen\""},
        {"{\"languages\": [{\"suffix\": \".asc\", \"load\": \"backend\"}]}", "names its 'backend'"},
        {"{\"languages\": [{\"suffix\": \".asc\", \"command\": \"cc {src} -o {out}\", \"colour\": \"red\"}]}",
         "unknown field 'colour'"},
        {"{\"languages\": [{\"suffix\": \".asc\", \"command\": 7}]}", "'command' must be a string"},
        {"{\"languages\": [3]}", "languages[0] is not an object"},
        {"{\"langs\": []}", "want {\"languages\": [...]}"},
        {"{\"languages\": [", "line 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_file("bad.json", bad[i].json);
        kiln_ext_langs_t *t = (kiln_ext_langs_t *)1;
        assert_int_equal(kiln_ext_langs_load(path_in("bad.json"), &t), KILN_ERR_FORMAT);
        assert_null(t);
        if (!strstr(kiln_last_error(), bad[i].says) || !strstr(kiln_last_error(), "bad.json"))
            fail_msg("entry %zu: '%s', wanted '%s'", i, kiln_last_error(), bad[i].says);
    }
    kiln_ext_langs_t *t;
    assert_int_equal(kiln_ext_langs_load(path_in("missing.json"), &t), KILN_ERR_IO);
    assert_non_null(strstr(kiln_last_error(), "missing.json: cannot read it"));
    kiln_clear_error();
}

/* {src}, {out}, {include} and {dep} quoted for the shell (a space, a quote), {flags}
 * the flags then the dependency-file flags; a backend language has no command. */
static void commands_quote_paths_and_put_the_flags(void **state)
{
    test_setenv("XDG_CONFIG_HOME", path_in("none"), 1);
    kiln_ext_langs_t *t;
    assert_int_equal(kiln_ext_langs_load(NULL, &t), KILN_OK);
    char *cmd;
    assert_int_equal(kiln_ext_command(find(t, "a.c"), "my op's.c", "out/a.o", "/inc", &cmd), KILN_OK);
    assert_string_equal(cmd, "cc -std=c11 -fPIC -O2 -MD -MF 'out/a.o.d' -I'/inc' -c 'my op'\\''s.c' -o 'out/a.o'");
    free(cmd);
    assert_int_equal(kiln_ext_command(find(t, "k.cl"), "k.cl", "o", NULL, &cmd), KILN_ERR_UNSUPPORTED);
    assert_null(cmd);
    assert_non_null(strstr(kiln_last_error(), "handed to the opencl backend"));
    kiln_ext_langs_free(t);
    test_unsetenv("XDG_CONFIG_HOME");
    kiln_clear_error();
}

/* `kiln ext build` sends a made-up suffix to the stand-in compiler its row names, with
 * that row's flags (the stand-in writes its arguments into the object), copies an
 * OpenCL source, and on a compiler that fails names the source, the command and the
 * compiler's output, with a non-zero exit. */
static void build_routes_a_new_language_to_its_compiler(void **state)
{
    const char *tool = getenv("KILN_TOOL");
    if (!tool) skip(); /* run by ctest, which sets it */
    /* (it also makes a real, empty object, for the module's link) */
    write_file("fakecc.sh", "#!/bin/sh\nout=\"\"; prev=\"\"\nfor a in \"$@\"; do [ \"$prev\" = \"-o\" ] && out=$a; "
                            "prev=$a; done\necho \"args: $*\" > \"$out.args\"\ncc -x c -c /dev/null -o \"$out\"\n");
    write_file("failcc.sh", "#!/bin/sh\necho 'boom: no NPU here' >&2\nexit 3\n");
    chmod(path_in("fakecc.sh"), 0755);
    chmod(path_in("failcc.sh"), 0755);
    char json[2048];
    snprintf(json, sizeof json,
             "{\"languages\": [{\"suffix\": \".asc\", \"command\": \"%s -x asc {flags} -c {src} -o {out}\", "
             "\"flags\": \"-O3 --npu\", \"object\": \".obj\"}, {\"suffix\": \".bad\", \"command\": \"%s {src} -o "
             "{out}\"}]}",
             path_in("fakecc.sh"), path_in("failcc.sh"));
    write_file("l.json", json);
    /* kiln doctor's check: the stand-in is there (a path), a made-up compiler is not */
    kiln_ext_langs_t *t;
    assert_int_equal(kiln_ext_langs_load(path_in("l.json"), &t), KILN_OK);
    char found[512];
    assert_true(kiln_ext_compiler_found(find(t, "a.asc"), found, sizeof found));
    assert_string_equal(found, path_in("fakecc.sh"));
    assert_false(kiln_ext_compiler_found(find(t, "k.cl"), found, sizeof found));
    kiln_ext_lang missing = *find(t, "a.asc");
    missing.command = "kiln-no-such-compiler-xyz {src} -o {out}";
    assert_false(kiln_ext_compiler_found(&missing, found, sizeof found));
    assert_string_equal(found, "kiln-no-such-compiler-xyz");
    missing.command = "sh {src} -o {out}"; /* found on $PATH */
    assert_true(kiln_ext_compiler_found(&missing, found, sizeof found));
    assert_non_null(strstr(found, "/sh"));
    kiln_ext_langs_free(t);
    write_file("op.asc", "kernel\n");
    write_file("k.cl", "__kernel void f(void) {}\n");
    write_file("x.bad", "x\n");
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' ext build '%s' '%s' --out '%s' --languages '%s' > /dev/null 2>&1", tool,
             path_in("op.asc"), path_in("k.cl"), path_in("out"), path_in("l.json"));
    assert_int_equal(system(cmd), 0);
    char text[1024];
    assert_true(test_read_text(path_in("out/op.obj.args"), text, sizeof text));
    assert_non_null(strstr(text, "-x asc -O3 --npu -c")); /* no depfile flags: the row names none */
    assert_non_null(strstr(text, "op.asc -o"));
    assert_true(test_read_text(path_in("out/k.cl"), text, sizeof text));
    assert_string_equal(text, "__kernel void f(void) {}\n");
    snprintf(cmd, sizeof cmd, "'%s' ext build '%s' --out '%s' --languages '%s' 2> '%s'", tool, path_in("x.bad"),
             path_in("out"), path_in("l.json"), path_in("err.txt"));
    assert_int_not_equal(system(cmd), 0);
    assert_true(test_read_text(path_in("err.txt"), text, sizeof text));
    if (!strstr(text, "x.bad: the .bad compiler failed") || !strstr(text, "command: ") ||
        !strstr(text, "failcc.sh") || !strstr(text, "boom: no NPU here"))
        fail_msg("stderr: %s", text);
}

/* kiln_ext_build: two C sources into a module that loads and runs (dlopen); built
 * again, nothing is compiled; a header one of them includes made newer, only that one
 * is; a source with an error is named with its command and the compiler's output. */
static void build_is_incremental_and_links_a_module(void **state)
{
    test_setenv("XDG_CONFIG_HOME", path_in("none"), 1);
    kiln_ext_langs_t *t;
    assert_int_equal(kiln_ext_langs_load(NULL, &t), KILN_OK);
    write_file("inc.h", "#define SEVEN 7\n");
    write_file("a.c", "int answer(void) { return 42; }\n");
    write_file("b.c", "#include \"inc.h\"\nint seven(void) { return SEVEN; }\n");
    const char *src[2] = {path_in("a.c"), path_in("b.c")};
    char *mod = NULL;
    int rebuilt = -1;
    if (kiln_ext_build(t, src, 2, path_in("mod"), "demo", ".", &mod, &rebuilt) != KILN_OK) fail_msg("%s", kiln_last_error());
    assert_int_equal(rebuilt, 2);
    assert_string_equal(mod, path_in("mod/libdemo.so"));
    void *so = dlopen(mod, RTLD_NOW | RTLD_LOCAL);
    if (!so) fail_msg("dlopen: %s", dlerror());
    int (*answer)(void) = (int (*)(void))dlsym(so, "answer");
    int (*seven)(void) = (int (*)(void))dlsym(so, "seven");
    assert_true(answer && seven && answer() == 42 && seven() == 7);
    dlclose(so);
    free(mod);
    assert_int_equal(kiln_ext_build(t, src, 2, path_in("mod"), "demo", ".", &mod, &rebuilt), KILN_OK);
    assert_int_equal(rebuilt, 0);
    free(mod);
    struct timespec later[2] = {{.tv_sec = time(NULL) + 100}, {.tv_sec = time(NULL) + 100}};
    assert_int_equal(utimensat(AT_FDCWD, path_in("inc.h"), later, 0), 0);
    assert_int_equal(kiln_ext_build(t, src, 2, path_in("mod"), "demo", ".", &mod, &rebuilt), KILN_OK);
    assert_int_equal(rebuilt, 1);
    free(mod);
    write_file("c.c", "int broken(void) { return }\n");
    const char *bad[1] = {path_in("c.c")};
    assert_int_equal(kiln_ext_build(t, bad, 1, path_in("mod"), "bad", ".", &mod, &rebuilt), KILN_ERR_IO);
    assert_null(mod);
    const char *e = kiln_last_error();
    if (!strstr(e, "c.c: the .c compiler failed") || !strstr(e, "command: cc ") || !strstr(e, "error"))
        fail_msg("%s", e);
    kiln_ext_langs_free(t);
    test_unsetenv("XDG_CONFIG_HOME");
    kiln_clear_error();
}

int main(void)
{
    assert_non_null(mkdtemp(dir));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(builtins_are_c_cpp_cl_cu),
        cmocka_unit_test(a_file_adds_and_replaces_rows),
        cmocka_unit_test(malformed_entries_are_refused_by_name),
        cmocka_unit_test(commands_quote_paths_and_put_the_flags),
        cmocka_unit_test(build_routes_a_new_language_to_its_compiler),
        cmocka_unit_test(build_is_incremental_and_links_a_module),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char rm[300];
    snprintf(rm, sizeof rm, "rm -rf '%s'", dir);
    if (system(rm) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
