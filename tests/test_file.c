/* core/file.c: reads open regular files only and never block; saves are atomic, refuse
 * a target that is not a regular file, and leave the old file whole on any failure;
 * io/json_file.c reads JSON through the same check. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/file.h"
#include "io/json_file.h"

static char dir[64];

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kiln_file_XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

static const char *in_dir(const char *name)
{
    static char p[4][160];
    static int k;
    k = (k + 1) % 4;
    snprintf(p[k], sizeof p[k], "%s/%s", dir, name);
    return p[k];
}

static void put(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
}

/* The whole file as a string (static). */
static const char *get(const char *path)
{
    static char buf[4096];
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* The number of entries of the test's folder (no temporary left behind). */
static int entries(void)
{
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

static void has(const char *what) { assert_non_null(strstr(kiln_last_error(), what)); }

/* ---- reading ---- */

static void test_open_read_gives_a_regular_file_and_its_size(void **state)
{
    (void)state;
    put(in_dir("a"), "hello");
    int64_t size = -1;
    int fd = kiln__file_open_read(in_dir("a"), "t", &size);
    assert_true(fd >= 0);
    assert_int_equal(size, 5);
    assert_int_equal(fcntl(fd, F_GETFL) & O_NONBLOCK, 0); /* blocking again for the reader */
    char buf[8];
    assert_int_equal(read(fd, buf, sizeof buf), 5);
    close(fd);
}

static void test_open_read_refuses_a_fifo_without_blocking(void **state)
{
    (void)state;
    assert_int_equal(mkfifo(in_dir("fifo"), 0600), 0);
    alarm(10); /* a blocking open would end the test here */
    assert_int_equal(kiln__file_open_read(in_dir("fifo"), "t", NULL), -1);
    alarm(0);
    has("is a FIFO, not a regular file");
    has(in_dir("fifo"));
    assert_null(kiln__file_fopen_read(in_dir("fifo"), "t"));
}

static void test_open_read_names_a_directory_and_a_device(void **state)
{
    (void)state;
    assert_int_equal(kiln__file_open_read(dir, "t", NULL), -1);
    has("is a directory");
    assert_int_equal(kiln__file_open_read("/dev/null", "t", NULL), -1);
    has("is a character device");
    assert_int_equal(kiln__file_open_read(in_dir("missing"), "who", NULL), -1);
    has("who: cannot open");
    has("No such file or directory");
}

static void test_check_regular_passes_missing_and_regular_files_only(void **state)
{
    (void)state;
    put(in_dir("a"), "x");
    assert_int_equal(kiln__file_check_regular(in_dir("a"), "t"), KILN_OK);
    assert_int_equal(kiln__file_check_regular(in_dir("missing"), "t"), KILN_OK);
    assert_int_equal(kiln__file_check_regular(dir, "t"), KILN_ERR_IO);
}

static void test_json_load_refuses_a_fifo_and_reports_bad_json_with_its_line(void **state)
{
    (void)state;
    assert_int_equal(mkfifo(in_dir("c.json"), 0600), 0);
    json_error_t err;
    alarm(10);
    assert_null(kiln__json_load(in_dir("c.json"), 0, &err, "cfg"));
    alarm(0);
    assert_int_equal(err.line, -1);
    assert_non_null(strstr(err.text, "FIFO"));
    has("cfg: ");
    put(in_dir("bad.json"), "{\n\"a\": }");
    assert_null(kiln__json_load(in_dir("bad.json"), 0, &err, "cfg"));
    assert_int_equal(err.line, 2);
    has("line 2");
    put(in_dir("ok.json"), "{\"a\": 1}");
    json_t *j = kiln__json_load(in_dir("ok.json"), 0, NULL, "cfg");
    assert_non_null(j);
    assert_int_equal(json_integer_value(json_object_get(j, "a")), 1);
    json_decref(j);
}

/* ---- writing ---- */

static void test_write_atomic_creates_and_replaces_leaving_no_temporary(void **state)
{
    (void)state;
    assert_int_equal(kiln__file_write_atomic(in_dir("out"), "one", 3, "t"), KILN_OK);
    assert_string_equal(get(in_dir("out")), "one");
    assert_int_equal(kiln__file_write_atomic(in_dir("out"), "two!", 4, "t"), KILN_OK);
    assert_string_equal(get(in_dir("out")), "two!");
    assert_int_equal(entries(), 1);
}

static void test_streamed_writes_commit_and_abort(void **state)
{
    (void)state;
    put(in_dir("out"), "old");
    kiln__afile a;
    assert_int_equal(kiln__afile_begin(&a, in_dir("out"), "t"), KILN_OK);
    assert_int_equal(kiln__afile_write(&a, "ne", 2), KILN_OK);
    assert_int_equal(kiln__afile_write(&a, "w", 1), KILN_OK);
    assert_string_equal(get(in_dir("out")), "old"); /* nothing shows before the commit */
    assert_int_equal(entries(), 2);
    kiln__afile_abort(&a);
    assert_string_equal(get(in_dir("out")), "old");
    assert_int_equal(entries(), 1);
    assert_int_equal(kiln__afile_begin(&a, in_dir("out"), "t"), KILN_OK);
    assert_int_equal(kiln__afile_write(&a, "new", 3), KILN_OK);
    assert_int_equal(kiln__afile_commit(&a), KILN_OK);
    assert_string_equal(get(in_dir("out")), "new");
    assert_int_equal(entries(), 1);
}

static void test_targets_that_are_not_regular_files_are_refused_and_kept(void **state)
{
    (void)state;
    put(in_dir("secret"), "keep me");
    assert_int_equal(symlink("secret", in_dir("link")), 0);
    assert_int_equal(mkfifo(in_dir("fifo"), 0600), 0);
    assert_int_equal(mkdir(in_dir("folder"), 0700), 0);
    assert_int_equal(kiln__file_write_atomic(in_dir("link"), "x", 1, "t"), KILN_ERR_IO);
    has("symbolic link");
    assert_int_equal(kiln__file_write_atomic(in_dir("fifo"), "x", 1, "t"), KILN_ERR_IO);
    has("it is a FIFO, not a regular file");
    assert_int_equal(kiln__file_write_atomic(in_dir("folder"), "x", 1, "t"), KILN_ERR_IO);
    has("it is a directory");
    /* a device of the test's own where it may make one (as root: a regression then
     * breaks that node, not the machine's /dev/full); else /dev/full, which a user who
     * cannot make nodes cannot replace either */
    struct stat full;
    assert_int_equal(stat("/dev/full", &full), 0);
    const char *dev = mknod(in_dir("full"), S_IFCHR | 0600, full.st_rdev) == 0 ? in_dir("full") : "/dev/full";
    if (dev[1] == 'd' && access("/dev", W_OK) == 0) skip();
    assert_int_equal(kiln__file_write_atomic(dev, "x", 1, "t"), KILN_ERR_IO);
    has("it is a character device");
    struct stat st;
    assert_int_equal(lstat(in_dir("link"), &st), 0);
    assert_true(S_ISLNK(st.st_mode));
    assert_string_equal(get(in_dir("secret")), "keep me");
    assert_int_equal(lstat(dev, &st), 0);
    assert_true(S_ISCHR(st.st_mode));
    assert_int_equal(entries(), 4 + (dev[1] != 'd')); /* no temporary beside any of them */
}

static void test_a_failed_write_keeps_the_old_file_and_names_the_error(void **state)
{
    (void)state;
    put(in_dir("out"), "old");
    static char big[64 * 1024];
    memset(big, 'x', sizeof big);
    struct rlimit saved, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &saved), 0);
    lim = saved;
    lim.rlim_cur = 16 * 1024;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN); /* EFBIG instead of the signal */
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    kiln_status s = kiln__file_write_atomic(in_dir("out"), big, sizeof big, "t");
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &saved), 0);
    signal(SIGXFSZ, prev);
    assert_int_equal(s, KILN_ERR_IO);
    has("t: cannot write");
    has(in_dir("out"));
    has("File too large");
    assert_string_equal(get(in_dir("out")), "old");
    assert_int_equal(entries(), 1);
}

static void test_a_commit_after_a_failed_write_fails_and_cleans_up(void **state)
{
    (void)state;
    put(in_dir("out"), "old");
    static char big[64 * 1024];
    struct rlimit saved, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &saved), 0);
    lim = saved;
    lim.rlim_cur = 1024;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    kiln__afile a;
    assert_int_equal(kiln__afile_begin(&a, in_dir("out"), "t"), KILN_OK);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    kiln_status w = kiln__afile_write(&a, big, sizeof big);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &saved), 0);
    signal(SIGXFSZ, prev);
    assert_int_equal(w, KILN_ERR_IO);
    kiln_clear_error();
    assert_int_equal(kiln__afile_commit(&a), KILN_ERR_IO); /* the caller that commits anyway */
    has("File too large");
    assert_string_equal(get(in_dir("out")), "old");
    assert_int_equal(entries(), 1);
}

static void test_a_missing_folder_is_named(void **state)
{
    (void)state;
    assert_int_equal(kiln__file_write_atomic(in_dir("nope/out"), "x", 1, "t"), KILN_ERR_IO);
    has("nope/out");
    has("No such file or directory");
}

static void test_place_refuses_a_folder_and_removes_the_temporary(void **state)
{
    (void)state;
    put(in_dir("tmp"), "built");
    assert_int_equal(mkdir(in_dir("folder"), 0700), 0);
    assert_int_equal(kiln__file_place(in_dir("tmp"), in_dir("folder"), "t"), KILN_ERR_IO);
    assert_int_equal(access(in_dir("tmp"), F_OK), -1);
    put(in_dir("tmp"), "built");
    assert_int_equal(kiln__file_place(in_dir("tmp"), in_dir("mod.so"), "t"), KILN_OK);
    assert_string_equal(get(in_dir("mod.so")), "built");
}

static void test_open_append_refuses_a_fifo_without_blocking_and_appends(void **state)
{
    (void)state;
    assert_int_equal(mkfifo(in_dir("fifo"), 0600), 0);
    alarm(10);
    assert_int_equal(kiln__file_open_append(in_dir("fifo"), "t"), -1);
    alarm(0);
    has("FIFO");
    put(in_dir("log"), "a\n");
    int fd = kiln__file_open_append(in_dir("log"), "t");
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "b\n", 2), 2);
    close(fd);
    assert_string_equal(get(in_dir("log")), "a\nb\n");
}

/* ---- identity ---- */

static void test_same_sees_through_links_and_spellings(void **state)
{
    (void)state;
    put(in_dir("a"), "x");
    put(in_dir("b"), "x");
    assert_int_equal(symlink("a", in_dir("l")), 0);
    assert_int_equal(mkdir(in_dir("d"), 0700), 0);
    assert_true(kiln__file_same(in_dir("a"), in_dir("l")));
    assert_true(kiln__file_same(in_dir("a"), in_dir("d/../a")));
    assert_true(kiln__file_same(dir, in_dir(".")));
    assert_false(kiln__file_same(in_dir("a"), in_dir("b")));
    assert_false(kiln__file_same(in_dir("a"), in_dir("missing")));
}

#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_open_read_gives_a_regular_file_and_its_size),
        T(test_open_read_refuses_a_fifo_without_blocking),
        T(test_open_read_names_a_directory_and_a_device),
        T(test_check_regular_passes_missing_and_regular_files_only),
        T(test_json_load_refuses_a_fifo_and_reports_bad_json_with_its_line),
        T(test_write_atomic_creates_and_replaces_leaving_no_temporary),
        T(test_streamed_writes_commit_and_abort),
        T(test_targets_that_are_not_regular_files_are_refused_and_kept),
        T(test_a_failed_write_keeps_the_old_file_and_names_the_error),
        T(test_a_commit_after_a_failed_write_fails_and_cleans_up),
        T(test_a_missing_folder_is_named),
        T(test_place_refuses_a_folder_and_removes_the_temporary),
        T(test_open_append_refuses_a_fifo_without_blocking_and_appends),
        T(test_same_sees_through_links_and_spellings),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
