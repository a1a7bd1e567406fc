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
#include <sys/wait.h>
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
    assert_string_equal(cmd, "cc -std=c11 -fPIC -Werror=implicit-function-declaration -O2 -MD -MF 'out/a.o.d' -I'/inc' -c 'my op'\\''s.c' -o 'out/a.o'");
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
                            "prev=$a; done\necho \"args: $*\" > \"$(dirname \"$out\")/args.txt\"\ncc -x c -c /dev/null -o \"$out\"\n");
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
    assert_true(test_read_text(path_in("out/args.txt"), text, sizeof text));
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
    char a_c[256], b_c[256]; /* path_in's buffers are reused */
    snprintf(a_c, sizeof a_c, "%s", path_in("a.c"));
    snprintf(b_c, sizeof b_c, "%s", path_in("b.c"));
    const char *src[2] = {a_c, b_c};
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
    struct timespec earlier[2] = {{.tv_sec = time(NULL) - 100}, {.tv_sec = time(NULL) - 100}};
    assert_int_equal(utimensat(AT_FDCWD, path_in("inc.h"), earlier, 0), 0); /* back in the past: stable again */
    /* the stamp is the command's and the source's content: other flags, or a source
     * rewritten with the same time, compile again */
    kiln_ext_lang *c_lang = (kiln_ext_lang *)find(t, "a.c");
    const char *flags = c_lang->flags;
    c_lang->flags = "-O1";
    assert_int_equal(kiln_ext_build(t, src, 2, path_in("mod"), "demo", ".", &mod, &rebuilt), KILN_OK);
    assert_int_equal(rebuilt, 2);
    free(mod);
    c_lang->flags = flags;
    struct stat before;
    assert_int_equal(stat(path_in("a.c"), &before), 0);
    if (kiln_ext_build(t, src, 2, path_in("mod"), "demo", ".", &mod, &rebuilt) != KILN_OK) fail_msg("%s", kiln_last_error());
    free(mod);
    write_file("a.c", "int answer(void) { return 43; }\n");
    struct timespec same[2] = {before.st_atim, before.st_mtim};
    assert_int_equal(utimensat(AT_FDCWD, path_in("a.c"), same, 0), 0);
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

/* The compiles of one build run at once: each stand-in compiler marks that it started
 * and waits (up to 10 s) for the other's mark, so that one run alone (one after the
 * other) says so. Two builds of one folder at once (two processes) both succeed and
 * leave a module that loads. A language's link flags reach the link, {compiler_dir}
 * filled in. */
static void builds_run_compiles_at_once_and_share_a_folder_safely(void **state)
{
    write_file("paircc.sh", "#!/bin/sh\nout=''; prev=''\nfor a in \"$@\"; do [ \"$prev\" = '-o' ] && out=$a; "
                            "prev=$a; [ \"${a%.par}\" != \"$a\" ] && src=$a; done\n"
                            "me=$(basename \"$src\" .par); d=$(dirname \"$src\"); touch \"$d/started.$me\"\n"
                            "other=a; [ \"$me\" = a ] && other=b\nseen=alone\n"
                            "for i in $(seq 100); do [ -e \"$d/started.$other\" ] && { seen=together; break; }; "
                            "sleep 0.1; done\necho $seen > \"$d/seen.$me\"\ncc -x c -c /dev/null -o \"$out\"\n");
    chmod(path_in("paircc.sh"), 0755);
    char json[1024];
    snprintf(json, sizeof json,
             "{\"languages\": [{\"suffix\": \".par\", \"command\": \"%s {src} -o {out}\"}, {\"suffix\": \".lnk\", "
             "\"command\": \"%s {src} -o {out}\", \"link\": \"-L{compiler_dir}/nolib -lkiln_no_such_lib\"}]}",
             path_in("paircc.sh"), path_in("paircc.sh"));
    write_file("par.json", json);
    write_file("a.par", "a\n");
    write_file("b.par", "b\n");
    kiln_ext_langs_t *t;
    assert_int_equal(kiln_ext_langs_load(path_in("par.json"), &t), KILN_OK);
    char a_par[256], b_par[256], two_c[256];
    snprintf(a_par, sizeof a_par, "%s", path_in("a.par"));
    snprintf(b_par, sizeof b_par, "%s", path_in("b.par"));
    const char *src[2] = {a_par, b_par};
    char *mod = NULL, text[64];
    if (kiln_ext_build(t, src, 2, path_in("par"), "par", ".", &mod, NULL) != KILN_OK) fail_msg("%s", kiln_last_error());
    free(mod);
    for (int i = 0; i < 2; i++) {
        assert_true(test_read_text(path_in(i ? "seen.b" : "seen.a"), text, sizeof text));
        assert_string_equal(text, "together\n");
    }
    /* two processes building the same folder from nothing */
    write_file("two.c", "int two(void) { return 2; }\n");
    snprintf(two_c, sizeof two_c, "%s", path_in("two.c"));
    const char *two[1] = {two_c};
    kiln_ext_langs_t *builtin;
    test_setenv("XDG_CONFIG_HOME", path_in("none"), 1);
    assert_int_equal(kiln_ext_langs_load(NULL, &builtin), KILN_OK);
    for (int round = 0; round < 3; round++) {
        char rm[512];
        snprintf(rm, sizeof rm, "rm -rf '%s'", path_in("shared"));
        assert_int_equal(system(rm), 0);
        pid_t child = fork();
        if (child == 0) {
            char *m = NULL;
            _exit(kiln_ext_build(builtin, two, 1, path_in("shared"), "two", ".", &m, NULL) == KILN_OK ? 0 : 1);
        }
        kiln_status mine = kiln_ext_build(builtin, two, 1, path_in("shared"), "two", ".", &mod, NULL);
        int st = -1;
        assert_int_equal(waitpid(child, &st, 0), child);
        if (mine != KILN_OK) fail_msg("%s", kiln_last_error());
        assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        void *so = dlopen(mod, RTLD_NOW | RTLD_LOCAL);
        if (!so) fail_msg("dlopen: %s", dlerror());
        int (*f)(void) = (int (*)(void))dlsym(so, "two");
        assert_true(f && f() == 2);
        dlclose(so);
        free(mod);
    }
    kiln_ext_langs_free(builtin);
    test_unsetenv("XDG_CONFIG_HOME");
    /* a compiler that is not there: named, with the command and the shell's word */
    kiln_ext_lang *par = (kiln_ext_lang *)find(t, "a.par");
    const char *was = par->command;
    par->command = "kiln-no-such-compiler-xyz {src} -o {out}";
    assert_int_equal(kiln_ext_build(t, src, 1, path_in("nocc"), "nocc", ".", &mod, NULL), KILN_ERR_IO);
    if (!strstr(kiln_last_error(), "a.par: the .par compiler was not found (exit status 127)") ||
        !strstr(kiln_last_error(), "command: kiln-no-such-compiler-xyz"))
        fail_msg("%s", kiln_last_error());
    par->command = was;
    /* the link flags, with the compiler's folder */
    write_file("a.lnk", "a\n");
    const char *lnk[1] = {path_in("a.lnk")};
    assert_int_equal(kiln_ext_build(t, lnk, 1, path_in("lnk"), "lnk", ".", &mod, NULL), KILN_ERR_IO);
    char want[600];
    snprintf(want, sizeof want, "-L'%s'/nolib -lkiln_no_such_lib", dir);
    if (!strstr(kiln_last_error(), "the module's link failed") || !strstr(kiln_last_error(), want))
        fail_msg("%s (wanted %s)", kiln_last_error(), want);
    kiln_ext_langs_free(t);
    kiln_clear_error();
}

/* The include folder and the example's folder in the source tree. */
static const char *src_path(const char *rel)
{
    static char p[4][512];
    static int i;
    i = (i + 1) % 4;
    const char *root = getenv("KILN_SOURCE_DIR");
    snprintf(p[i], sizeof p[i], "%s/%s", root ? root : ".", rel);
    return p[i];
}

/* Builds sources (in dir, or the example's when from_example) into dir/<name>/lib<name>.so. */
static char *build_module(const char *name, const char *const *srcs, int n)
{
    kiln_ext_langs_t *t;
    test_setenv("XDG_CONFIG_HOME", path_in("none"), 1);
    assert_int_equal(kiln_ext_langs_load(NULL, &t), KILN_OK);
    char *mod = NULL;
    kiln_status s = kiln_ext_build(t, srcs, n, path_in(name), name, src_path("include"), &mod, NULL);
    kiln_ext_langs_free(t);
    test_unsetenv("XDG_CONFIG_HOME");
    if (s != KILN_OK) fail_msg("%s", kiln_last_error());
    return mod;
}

static kiln_tensor_t *randn(const int64_t *shape, int nd, uint64_t seed)
{
    kiln_manual_seed(seed);
    return kiln_randn(shape, nd, KILN_DTYPE_F32);
}

static void assert_close(kiln_tensor_t *a, kiln_tensor_t *b, double tol, const char *what)
{
    char why[256];
    if (!test_close(a, b, tol, why, sizeof why)) fail_msg("%s: %s", what, why);
}

/* A two-block residual model: each block h, y = norm(h + d), d = y W. With the
 * example's fused op (fused) or kiln's add and rms_norm. in: x, W0, W1, w0, w1. */
typedef struct {
    bool fused;
    int op;
} model;

static kiln_tensor_t *block(const model *m, kiln_tensor_t *h, kiln_tensor_t *d, kiln_tensor_t *w, kiln_tensor_t **h_out)
{
    if (!m->fused) {
        *h_out = kiln_add(h, d);
        return kiln_rms_norm(*h_out, w, 1e-5);
    }
    kiln_tensor_t *in[3] = {h, d, w}, *out[2] = {0};
    if (kiln_op_run(m->op, in, 3, &(kiln_op_value){.f = 1e-5}, 1, out) != KILN_OK) return NULL;
    *h_out = out[1];
    return out[0];
}

static kiln_status model_fn(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    const model *m = ctx;
    kiln_tensor_t *h = in[0], *d = kiln_mul_scalar(in[0], 0.5), *y = NULL;
    for (int l = 0; l < 2 && d; l++) {
        y = block(m, h, d, in[3 + l], &h);
        d = y ? kiln_matmul(y, in[1 + l]) : NULL;
    }
    out[0] = d && h ? kiln_sum(kiln_mul(kiln_add(d, h), in[0]), NULL, 0, false) : NULL;
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

/* The example module (examples/ext/rmsnorm_residual.c and .cl) built, loaded and used
 * by a model, eager and compiled, against the same model on kiln's add and rms_norm
 * (oracle; tolerance 1e-5 relative, f32 sums in another order): its loss and the
 * gradients of every input. On OpenCL (test_ext_opencl) its .cl kernel runs, on CUDA
 * (test_ext_cuda) its .cu one. */
static void the_example_module_trains_like_the_builtin_ops(void **state)
{
    /* on a CUDA device (test_ext_cuda, bench/gpu.sh) its CUDA kernel too */
    bool cuda = !strncmp(kiln_device(), "cuda", 4);
    const char *srcs[3] = {src_path("examples/ext/rmsnorm_residual.c"), src_path("examples/ext/rmsnorm_residual.cl"),
                           src_path("examples/ext/rmsnorm_residual.cu")};
    char *mod = build_module("rmsnorm", srcs, cuda ? 3 : 2);
    int n_ops = -1;
    if (kiln_ext_load(mod, &n_ops) != KILN_OK) fail_msg("%s", kiln_last_error());
    assert_int_equal(n_ops, 1);
    assert_int_equal(kiln_ext_load(mod, &n_ops), KILN_OK); /* loaded already: nothing again */
    assert_int_equal(n_ops, 0);
    free(mod);
    int op = kiln_op_find("rmsnorm_residual");
    assert_true(op >= 0);
    if (cuda || !strncmp(kiln_device(), "opencl", 6))
        assert_int_equal(kiln_device_op_support(kiln_device(), op), KILN_OP_NATIVE);
    int64_t xs[2] = {12, 32}, ws[2] = {32, 32}, vs[1] = {32};
    kiln_tensor_t *in[5] = {randn(xs, 2, 1), kiln_mul_scalar(randn(ws, 2, 2), 0.2), kiln_mul_scalar(randn(ws, 2, 3), 0.2),
                            kiln_add_scalar(randn(vs, 1, 4), 1), kiln_add_scalar(randn(vs, 1, 5), 1)};
    kiln_tensor_t *grads[2][5], *losses[3];
    for (int fused = 0; fused < 2; fused++) {
        model m = {fused, op};
        kiln_tensor_t *p[5];
        for (int i = 0; i < 5; i++) {
            p[i] = kiln_detach(in[i]);
            kiln_tensor_set_requires_grad(p[i], true);
        }
        int n;
        assert_int_equal(model_fn(&m, p, 5, &losses[fused], &n), KILN_OK);
        assert_int_equal(kiln_backward(losses[fused]), KILN_OK);
        for (int i = 0; i < 5; i++) grads[fused][i] = kiln_tensor_grad(p[i]);
    }
    assert_close(losses[1], losses[0], 1e-5, "loss");
    static const char *names[5] = {"dx", "dW0", "dW1", "dw0", "dw1"};
    for (int i = 0; i < 5; i++) assert_close(grads[1][i], grads[0][i], 1e-4, names[i]);
    /* compiled: the op a step of its own between the generated kernels */
    model m = {true, op};
    kiln_compiled_t *c;
    assert_int_equal(kiln_compiled_new(model_fn, &m, "fused_model", &c), KILN_OK);
    int n;
    assert_int_equal(kiln_compiled_call(c, in, 5, &losses[2], 1, &n), KILN_OK);
    assert_close(losses[2], losses[0], 1e-5, "compiled loss");
    kiln_compiled_free(c);
}

/* The CUDA kernel of the example builds into the module where nvcc is (it runs where a
 * GPU is: bench/gpu.sh); skipped, not passed, where the toolkit is not. */
static void the_cuda_example_builds_where_nvcc_is(void **state)
{
    kiln_ext_langs_t *t;
    test_setenv("XDG_CONFIG_HOME", path_in("none"), 1);
    assert_int_equal(kiln_ext_langs_load(NULL, &t), KILN_OK);
    char found[1024];
    bool nvcc = kiln_ext_compiler_found(find(t, "k.cu"), found, sizeof found);
    kiln_ext_langs_free(t);
    test_unsetenv("XDG_CONFIG_HOME");
    if (!nvcc) {
        print_message("skipped: no nvcc on this machine (%s)\n", found);
        skip();
    }
    const char *srcs[2] = {src_path("examples/ext/rmsnorm_residual.c"), src_path("examples/ext/rmsnorm_residual.cu")};
    char *mod = build_module("rmsnorm_cuda", srcs, 2);
    void *so = dlopen(mod, RTLD_NOW | RTLD_LOCAL);
    if (!so) fail_msg("dlopen: %s", dlerror());
    assert_non_null(dlsym(so, "rmsnorm_residual_cuda"));
    assert_non_null(dlsym(so, "kiln_ext_init"));
    dlclose(so);
    free(mod);
}

/* kiln ext load lists what a module defined and how each device runs it; KILN_EXT
 * loads modules before any command (kiln doctor --ops lists their ops), and a module
 * there that cannot be loaded stops the command with its error (kiln ext and kiln
 * doctor say so and go on). */
static void the_tool_loads_modules(void **state)
{
    const char *tool = getenv("KILN_TOOL");
    if (!tool) skip(); /* run by ctest, which sets it */
    const char *srcs[1] = {src_path("examples/ext/rmsnorm_residual.c")};
    char *mod = build_module("tool", srcs, 1);
    char cmd[2048], text[4096];
    snprintf(cmd, sizeof cmd, "'%s' ext load '%s' > '%s' 2>&1", tool, mod, path_in("load.txt"));
    assert_int_equal(system(cmd), 0);
    assert_true(test_read_text(path_in("load.txt"), text, sizeof text));
    if (!strstr(text, ": 1 op(s)") || !strstr(text, "rmsnorm_residual") || !strstr(text, "cpu: native"))
        fail_msg("%s", text);
    snprintf(cmd, sizeof cmd, "KILN_EXT='%s' '%s' doctor --ops cpu > '%s' 2>&1", mod, tool, path_in("ops.txt"));
    assert_int_equal(system(cmd), 0);
    assert_true(test_read_text(path_in("ops.txt"), text, sizeof text));
    char *row = strstr(text, "rmsnorm_residual");
    if (!row || strncmp(row + strcspn(row, " "), "           native", 17)) fail_msg("%s", row ? row : text);
    snprintf(cmd, sizeof cmd, "KILN_EXT='%s/nope.so' '%s' sample --help > '%s' 2>&1", dir, tool, path_in("bad.txt"));
    assert_int_not_equal(system(cmd), 0);
    assert_true(test_read_text(path_in("bad.txt"), text, sizeof text));
    if (!strstr(text, "kiln: KILN_EXT: ") || !strstr(text, "nope.so")) fail_msg("%s", text);
    /* ...but the commands that diagnose or rebuild it go on */
    snprintf(cmd, sizeof cmd, "KILN_EXT='%s/nope.so' '%s' doctor --ops cpu > '%s' 2>&1", dir, tool, path_in("bad.txt"));
    assert_int_equal(system(cmd), 0);
    assert_true(test_read_text(path_in("bad.txt"), text, sizeof text));
    if (!strstr(text, "nope.so") || !strstr(text, "(going on without it)")) fail_msg("%s", text);
    free(mod);
}

/* A module that is not one, or not a good one: each a clear error naming it. */
static void bad_modules_are_clear_errors(void **state)
{
    assert_int_equal(kiln_ext_load(path_in("no/such/libx.so"), NULL), KILN_ERR_IO);
    assert_non_null(strstr(kiln_last_error(), "no/such/libx.so"));
    write_file("notso.so", "not an ELF file\n");
    assert_int_equal(kiln_ext_load(path_in("notso.so"), NULL), KILN_ERR_FORMAT);
    assert_non_null(strstr(kiln_last_error(), "is not a module this program can load"));
    static const struct {
        const char *name, *code, *want;
    } cases[] = {
        {"noabi", "int kiln_ext_init(void) { return 0; }\n", "has no kiln_ext_abi"},
        {"oldabi", "const int kiln_ext_abi = 99;\nint kiln_ext_init(void) { return 0; }\n",
         "built for kiln's module version 99"},
        {"noinit", "#include \"kiln/ext.h\"\nKILN_EXT_MODULE;\n", "has no kiln_ext_init"},
        {"undef", "#include \"kiln/ext.h\"\nKILN_EXT_MODULE;\nint kiln_not_there(void);\n"
                  "kiln_status kiln_ext_init(const kiln_ext_module *m) { return kiln_not_there(); }\n",
         "undefined symbol: kiln_not_there"},
        {"fails", "#include \"kiln/ext.h\"\nKILN_EXT_MODULE;\n"
                  "kiln_status kiln_ext_init(const kiln_ext_module *m)\n"
                  "{ return m->source(m, \"missing.cl\") ? KILN_OK : kiln_last_status(); }\n",
         "kiln_ext_init failed: "},
        {"nested", "#include \"kiln/ext.h\"\nKILN_EXT_MODULE;\n"
                   "kiln_status kiln_ext_init(const kiln_ext_module *m) { return kiln_ext_load(m->path, 0); }\n",
         "called from a module's kiln_ext_init"},
        {"clash", "#include \"kiln/ext.h\"\nKILN_EXT_MODULE;\n"
                  "static kiln_status k(const kiln_op_args *a) { return KILN_OK; }\n"
                  "static kiln_status sh(const kiln_op_args *a, kiln_op_meta *o) { return KILN_OK; }\n"
                  "kiln_status kiln_ext_init(const kiln_ext_module *m) {\n"
                  "  kiln_op_kernel ks[1] = {{.device = \"cpu\", .fn = k}}; int id;\n"
                  "  return kiln_op_define(&(kiln_op_decl){.name = \"matmul\", .n_in = 1, .n_out = 1, .shape = sh,\n"
                  "                        .kernels = ks, .n_kernels = 1}, &id); }\n",
         "matmul: a built-in op has that name"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char file[64];
        snprintf(file, sizeof file, "%s.c", cases[i].name);
        write_file(file, cases[i].code);
        const char *src[1] = {path_in(file)};
        char *mod = build_module(cases[i].name, src, 1);
        assert_int_not_equal(kiln_ext_load(mod, NULL), KILN_OK);
        if (!strstr(kiln_last_error(), cases[i].want) || !strstr(kiln_last_error(), mod))
            fail_msg("%s: %s (wanted '%s')", cases[i].name, kiln_last_error(), cases[i].want);
        if (strstr(cases[i].want, "kiln_ext_init failed")) { /* its init is not run twice */
            assert_int_not_equal(kiln_ext_load(mod, NULL), KILN_OK);
            if (!strstr(kiln_last_error(), "was loaded before and its kiln_ext_init failed")) fail_msg("%s", kiln_last_error());
        }
        free(mod);
        kiln_clear_error();
    }
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
        cmocka_unit_test(builds_run_compiles_at_once_and_share_a_folder_safely),
        cmocka_unit_test_setup_teardown(the_example_module_trains_like_the_builtin_ops, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_modules_are_clear_errors, setup, teardown),
        cmocka_unit_test(the_cuda_example_builds_where_nvcc_is),
        cmocka_unit_test(the_tool_loads_modules),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char rm[300];
    snprintf(rm, sizeof rm, "rm -rf '%s'", dir);
    if (system(rm) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
