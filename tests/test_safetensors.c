/* safetensors: round trips of every dtype and layout, the exact bytes written, atomic
 * saves, one test per malformed-file rule, truncations, and a seeded mutation fuzz. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kiln/io.h"
#include "kiln/ops.h"

#include "test_util.h"

/* ---- helpers ---- */

/* A fresh empty file under /tmp; path must hold 64 bytes. */
static void temp_path(char *path)
{
    snprintf(path, 64, "/tmp/kiln_st_XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
}

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    if (n) assert_int_equal(fwrite(data, 1, n, fp), n);
    assert_int_equal(fclose(fp), 0);
}

/* The whole file, malloc'd; *n gets its size. */
static unsigned char *read_bytes(const char *path, size_t *n)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, 0, SEEK_END), 0);
    long size = ftell(fp);
    assert_true(size >= 0);
    rewind(fp);
    unsigned char *buf = malloc((size_t)size + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)size, fp), (size_t)size);
    fclose(fp);
    *n = (size_t)size;
    return buf;
}

/* 8-byte little-endian length, the header text as given, then data. */
static unsigned char *build_file(const char *header, const void *data, size_t ndata, size_t *n)
{
    size_t h = strlen(header);
    *n = 8 + h + ndata;
    unsigned char *b = malloc(*n);
    assert_non_null(b);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    if (ndata) memcpy(b + 8 + h, data, ndata);
    return b;
}

/* Loading these bytes must fail with status and a message holding substr. */
static void expect_bytes_fail(const unsigned char *bytes, size_t n, kiln_status status, const char *substr)
{
    char path[64];
    temp_path(path);
    write_bytes(path, bytes, n);
    kiln_safetensors_t *f = (kiln_safetensors_t *)(uintptr_t)1;
    kiln_status s = kiln_safetensors_load(path, &f);
    if (s != status || !strstr(kiln_last_error(), substr) || !strstr(kiln_last_error(), path))
        print_error("status %d, message: %s\nwanted status %d with '%s'\n", s, kiln_last_error(), status, substr);
    assert_int_equal(s, status);
    assert_null(f);
    assert_non_null(strstr(kiln_last_error(), substr));
    assert_non_null(strstr(kiln_last_error(), path)); /* the message names the file */
    unlink(path);
}

static void expect_header_fail(const char *header, const void *data, size_t ndata, const char *substr)
{
    size_t n;
    unsigned char *b = build_file(header, data, ndata, &n);
    expect_bytes_fail(b, n, KILN_ERR_FORMAT, substr);
    free(b);
}

static kiln_safetensors_t *load_ok(const char *path)
{
    kiln_safetensors_t *f = NULL;
    kiln_status s = kiln_safetensors_load(path, &f);
    if (s != KILN_OK) print_error("%s\n", kiln_last_error());
    assert_int_equal(s, KILN_OK);
    assert_non_null(f);
    return f;
}

static void assert_tensor_bytes(kiln_tensor_t *t, kiln_dtype dt, int ndim, const int64_t *shape, const void *bytes)
{
    assert_non_null(t);
    assert_int_equal(kiln_tensor_dtype(t), dt);
    assert_int_equal(kiln_tensor_ndim(t), ndim);
    for (int i = 0; i < ndim; i++) assert_int_equal(kiln_tensor_dim(t, i), shape[i]);
    size_t nb = kiln_tensor_nbytes(t);
    unsigned char *got = malloc(nb ? nb : 1);
    assert_non_null(got);
    assert_int_equal(kiln_tensor_to_host(t, got, nb), KILN_OK);
    assert_memory_equal(got, bytes, nb);
    free(got);
}

/* Deterministic bytes for a dtype; bools stay 0/1. */
static void fill_pattern(unsigned char *p, size_t n, kiln_dtype dt, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = dt == KILN_DTYPE_BOOL ? (unsigned char)((i + seed) % 2) : (unsigned char)(i * 37 + seed * 11 + 5);
}

static bool dir_is_empty_but(const char *dir, const char *keep)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    bool ok = true;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (!keep || strcmp(e->d_name, keep) != 0) {
            print_error("unexpected file %s/%s\n", dir, e->d_name);
            ok = false;
        }
    }
    closedir(d);
    return ok;
}

/* ---- round trips ---- */

static void test_round_trip_keeps_every_dtype_bit_exact(void **state)
{
    const char *names[KILN_DTYPE_COUNT] = {"f32", "f64", "f16", "bf16", "i32", "i64", "u8", "bool"};
    kiln_tensor_t *ts[KILN_DTYPE_COUNT];
    unsigned char bytes[KILN_DTYPE_COUNT][6 * 8];
    int64_t shape[2] = {2, 3};
    for (int d = 0; d < KILN_DTYPE_COUNT; d++) {
        fill_pattern(bytes[d], 6 * kiln_dtype_size((kiln_dtype)d), (kiln_dtype)d, (unsigned)d);
        ts[d] = kiln_from_data(bytes[d], shape, 2, (kiln_dtype)d);
        assert_non_null(ts[d]);
    }
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, ts, KILN_DTYPE_COUNT, NULL), KILN_OK);
    kiln_safetensors_t *f = load_ok(path);
    assert_int_equal(kiln_safetensors_count(f), KILN_DTYPE_COUNT);
    for (int d = 0; d < KILN_DTYPE_COUNT; d++)
        assert_tensor_bytes(kiln_safetensors_get(f, names[d]), (kiln_dtype)d, 2, shape, bytes[d]);
    kiln_safetensors_free(f);
    unlink(path);
}

static void test_round_trip_keeps_0d_and_empty_tensors(void **state)
{
    double pi = 3.25;
    int64_t zero_shape[2] = {0, 4};
    kiln_tensor_t *ts[2] = {kiln_from_data(&pi, NULL, 0, KILN_DTYPE_F64), kiln_zeros(zero_shape, 2, KILN_DTYPE_F32)};
    const char *names[2] = {"scalar", "empty"};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, ts, 2, NULL), KILN_OK);
    kiln_safetensors_t *f = load_ok(path);
    assert_tensor_bytes(kiln_safetensors_get(f, "scalar"), KILN_DTYPE_F64, 0, NULL, &pi);
    kiln_tensor_t *e = kiln_safetensors_get(f, "empty");
    assert_tensor_bytes(e, KILN_DTYPE_F32, 2, zero_shape, "");
    assert_int_equal(kiln_tensor_numel(e), 0);
    kiln_safetensors_free(f);
    unlink(path);
}

static void test_round_trip_writes_transposed_tensor_in_row_major_order(void **state)
{
    int64_t shape[2] = {3, 4};
    kiln_tensor_t *a = kiln_reshape(kiln_arange(0, 12, 1, KILN_DTYPE_F32), shape, 2);
    kiln_tensor_t *t = kiln_transpose(a, 0, 1); /* (4,3), a view with strides (1,4) */
    assert_non_null(t);
    assert_false(kiln_tensor_is_contiguous(t));
    char path[64];
    temp_path(path);
    const char *names[1] = {"t"};
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, NULL), KILN_OK);
    float want[12];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) want[i * 3 + j] = (float)(j * 4 + i);
    kiln_safetensors_t *f = load_ok(path);
    int64_t tshape[2] = {4, 3};
    assert_tensor_bytes(kiln_safetensors_get(f, "t"), KILN_DTYPE_F32, 2, tshape, want);
    kiln_safetensors_free(f);
    unlink(path);
}

static void test_metadata_round_trips_and_missing_key_is_null(void **state)
{
    kiln_tensor_t *t = kiln_ones((int64_t[]){2}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"w"};
    const char *meta[] = {"format", "pt", "step", "1200", "note", "h\xc3\xa9 \"quoted\"", NULL};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, meta), KILN_OK);
    kiln_safetensors_t *f = load_ok(path);
    assert_string_equal(kiln_safetensors_meta(f, "format"), "pt");
    assert_string_equal(kiln_safetensors_meta(f, "step"), "1200");
    assert_string_equal(kiln_safetensors_meta(f, "note"), "h\xc3\xa9 \"quoted\"");
    assert_null(kiln_safetensors_meta(f, "missing"));
    kiln_safetensors_free(f);
    unlink(path);
}

static void test_file_without_metadata_has_no_meta(void **state)
{
    kiln_tensor_t *t = kiln_ones((int64_t[]){2}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"w"};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, NULL), KILN_OK);
    kiln_safetensors_t *f = load_ok(path);
    assert_null(kiln_safetensors_meta(f, "format"));
    kiln_safetensors_free(f);
    unlink(path);
}

static void test_names_follow_data_order_largest_element_first(void **state)
{
    kiln_tensor_t *ts[4] = {kiln_ones((int64_t[]){3}, 1, KILN_DTYPE_U8), kiln_ones((int64_t[]){1}, 1, KILN_DTYPE_F32),
                            kiln_ones((int64_t[]){1}, 1, KILN_DTYPE_F64), kiln_ones((int64_t[]){1}, 1, KILN_DTYPE_I32)};
    const char *names[4] = {"u8", "f32", "f64", "i32"};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, ts, 4, NULL), KILN_OK);
    kiln_safetensors_t *f = load_ok(path);
    const char *want[4] = {"f64", "f32", "i32", "u8"};
    for (int i = 0; i < 4; i++) assert_string_equal(kiln_safetensors_name(f, i), want[i]);
    assert_null(kiln_safetensors_name(f, 4));
    assert_null(kiln_safetensors_name(f, -1));
    kiln_safetensors_free(f);
    unlink(path);
}

static void test_empty_file_with_no_tensors_loads(void **state)
{
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, NULL, NULL, 0, NULL), KILN_OK);
    kiln_safetensors_t *f = load_ok(path);
    assert_int_equal(kiln_safetensors_count(f), 0);
    kiln_safetensors_free(f);
    unlink(path);
}

/* ---- the bytes on disk ---- */

static void test_written_file_matches_the_spec_byte_for_byte(void **state)
{
    float a[2] = {1.0f, -2.5f};
    unsigned char b[3] = {7, 8, 9};
    kiln_tensor_t *ts[2] = {kiln_from_data(b, (int64_t[]){3}, 1, KILN_DTYPE_U8),
                            kiln_from_data(a, (int64_t[]){1, 2}, 2, KILN_DTYPE_F32)};
    const char *names[2] = {"b", "a"};
    const char *meta[] = {"k", "v", NULL};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, ts, 2, meta), KILN_OK);
    size_t n;
    unsigned char *bytes = read_bytes(path, &n);
    /* The f32 tensor goes first (larger element); the metadata first in the header. */
    const char *json = "{\"__metadata__\":{\"k\":\"v\"},"
                       "\"a\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[0,8]},"
                       "\"b\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[8,11]}}";
    size_t jlen = strlen(json), hlen = (jlen + 7) / 8 * 8;
    assert_true(n >= 8);
    uint64_t got_hlen = 0;
    for (int i = 7; i >= 0; i--) got_hlen = got_hlen << 8 | bytes[i];
    assert_int_equal(got_hlen, hlen);
    assert_int_equal(got_hlen % 8, 0);
    assert_int_equal(n, 8 + hlen + 11);
    assert_memory_equal(bytes + 8, json, jlen);
    for (size_t i = jlen; i < hlen; i++) assert_int_equal(bytes[8 + i], ' ');
    const unsigned char data[11] = {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x20, 0xc0, 7, 8, 9}; /* LE 1.0f, -2.5f */
    assert_memory_equal(bytes + 8 + hlen, data, 11);
    free(bytes);
    unlink(path);
}

/* ---- atomic saves ---- */

static void test_save_leaves_only_the_target_file(void **state)
{
    char dir[] = "/tmp/kiln_st_dir_XXXXXX", path[128];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
    kiln_tensor_t *t = kiln_ones((int64_t[]){4}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"w"};
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, NULL), KILN_OK);
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, NULL), KILN_OK); /* replaces */
    assert_true(dir_is_empty_but(dir, "ckpt.safetensors"));
    unlink(path);
    rmdir(dir);
}

static void test_save_into_missing_directory_fails_with_io(void **state)
{
    kiln_tensor_t *t = kiln_ones((int64_t[]){4}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"w"};
    assert_int_equal(kiln_safetensors_save("/tmp/kiln_no_such_dir_9f3e/x.safetensors", names, &t, 1, NULL),
                     KILN_ERR_IO);
    assert_non_null(strstr(kiln_last_error(), "No such file or directory"));
    assert_non_null(strstr(kiln_last_error(), "/tmp/kiln_no_such_dir_9f3e/x.safetensors"));
}

/* A write that fails half way (the file-size limit stands in for a full disk) must
 * leave the old checkpoint as it was and no temporary file behind. */
static void test_failed_write_keeps_the_old_file(void **state)
{
    char dir[] = "/tmp/kiln_st_dir_XXXXXX", path[128];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
    kiln_tensor_t *small = kiln_ones((int64_t[]){4}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"w"};
    assert_int_equal(kiln_safetensors_save(path, names, &small, 1, NULL), KILN_OK);
    size_t n_old;
    unsigned char *old = read_bytes(path, &n_old);

    kiln_tensor_t *big = kiln_ones((int64_t[]){64 * 1024}, 1, KILN_DTYPE_F32); /* 256 KiB */
    struct rlimit saved, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &saved), 0);
    lim = saved;
    lim.rlim_cur = 16 * 1024;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN); /* get EFBIG instead of a signal */
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    kiln_status s = kiln_safetensors_save(path, names, &big, 1, NULL);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &saved), 0);
    signal(SIGXFSZ, prev);

    assert_int_equal(s, KILN_ERR_IO);
    assert_non_null(strstr(kiln_last_error(), "File too large"));
    size_t n_now;
    unsigned char *now = read_bytes(path, &n_now);
    assert_int_equal(n_now, n_old);
    assert_memory_equal(now, old, n_old);
    assert_true(dir_is_empty_but(dir, "ckpt.safetensors"));
    free(old);
    free(now);
    unlink(path);
    rmdir(dir);
}

static void test_save_over_a_directory_is_refused_and_leaves_nothing(void **state)
{
    char dir[] = "/tmp/kiln_st_dir_XXXXXX", target[128];
    assert_non_null(mkdtemp(dir));
    snprintf(target, sizeof target, "%s/occupied", dir);
    assert_int_equal(mkdir(target, 0700), 0);
    char inner[160];
    snprintf(inner, sizeof inner, "%s/keep", target); /* a non-empty directory is never replaced */
    write_bytes(inner, "x", 1);
    kiln_tensor_t *t = kiln_ones((int64_t[]){4}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"w"};
    assert_int_equal(kiln_safetensors_save(target, names, &t, 1, NULL), KILN_ERR_IO);
    assert_non_null(strstr(kiln_last_error(), "is a directory, not a regular file"));
    assert_true(dir_is_empty_but(dir, "occupied"));
    unlink(inner);
    rmdir(target);
    rmdir(dir);
}

/* ---- save arguments ---- */

static void test_save_rejects_duplicate_names(void **state)
{
    kiln_tensor_t *t = kiln_ones((int64_t[]){1}, 1, KILN_DTYPE_F32);
    kiln_tensor_t *ts[2] = {t, t};
    const char *names[2] = {"w", "w"};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, ts, 2, NULL), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "'w' appears twice"));
    unlink(path);
}

static void test_save_rejects_the_reserved_metadata_name(void **state)
{
    kiln_tensor_t *t = kiln_ones((int64_t[]){1}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"__metadata__"};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, NULL), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "reserved"));
    unlink(path);
}

static void test_save_rejects_meta_key_without_value(void **state)
{
    kiln_tensor_t *t = kiln_ones((int64_t[]){1}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"w"};
    const char *meta[] = {"lonely", NULL};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, meta), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "'lonely' has no value"));
    unlink(path);
}

static void test_save_of_a_failed_op_keeps_its_error(void **state)
{
    kiln_tensor_t *bad = kiln_matmul(kiln_ones((int64_t[]){2, 3}, 2, KILN_DTYPE_F32),
                                     kiln_ones((int64_t[]){2, 3}, 2, KILN_DTYPE_F32));
    assert_null(bad);
    kiln_status first = kiln_last_status();
    const char *names[1] = {"w"};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, &bad, 1, NULL), first);
    assert_int_equal(kiln_last_status(), first);
    unlink(path);
}

/* ---- reading ---- */

static void test_get_of_unknown_name_is_an_arg_error(void **state)
{
    kiln_tensor_t *t = kiln_ones((int64_t[]){1}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"w"};
    char path[64], want[128];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, NULL), KILN_OK);
    kiln_safetensors_t *f = load_ok(path);
    assert_null(kiln_safetensors_get(f, "nope"));
    assert_int_equal(kiln_last_status(), KILN_ERR_ARG);
    snprintf(want, sizeof want, "no tensor named 'nope' in %s", path);
    assert_non_null(strstr(kiln_last_error(), want));
    kiln_safetensors_free(f);
    unlink(path);
}

static void test_get_registers_the_tensor_with_the_open_scope(void **state)
{
    kiln_tensor_t *t = kiln_ones((int64_t[]){1024}, 1, KILN_DTYPE_F32);
    const char *names[1] = {"w"};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, &t, 1, NULL), KILN_OK);
    kiln_safetensors_t *f = load_ok(path);
    size_t before = kiln_memory_allocated();
    kiln_scope_begin();
    assert_non_null(kiln_safetensors_get(f, "w"));
    assert_true(kiln_memory_allocated() >= before + 4096);
    kiln_scope_end();
    assert_int_equal(kiln_memory_allocated(), before);
    kiln_safetensors_free(f);
    unlink(path);
}

/* kiln_safetensors_view: the bytes of every dtype as kiln_safetensors_get gives them,
 * without a copy (kiln's allocator counts nothing for it; with KILN_OPT_MMAP=0, a copy), alive after the file handle
 * is freed; a write into it changes this process's copy only: the file on disk, read
 * again, is as it was. */
static void test_view_maps_the_file_without_copying_it(void **state)
{
    const char *names[KILN_DTYPE_COUNT] = {"f32", "f64", "f16", "bf16", "i32", "i64", "u8", "bool"};
    kiln_tensor_t *ts[KILN_DTYPE_COUNT];
    unsigned char bytes[KILN_DTYPE_COUNT][6 * 8];
    int64_t shape[2] = {2, 3};
    for (int d = 0; d < KILN_DTYPE_COUNT; d++) {
        fill_pattern(bytes[d], 6 * kiln_dtype_size((kiln_dtype)d), (kiln_dtype)d, (unsigned)d + 7);
        ts[d] = kiln_from_data(bytes[d], shape, 2, (kiln_dtype)d);
    }
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, ts, KILN_DTYPE_COUNT, NULL), KILN_OK);
    kiln_safetensors_t *f = load_ok(path);
    size_t before = kiln_memory_allocated();
    kiln_tensor_t *v[KILN_DTYPE_COUNT];
    for (int d = 0; d < KILN_DTYPE_COUNT; d++) {
        v[d] = kiln_keep(kiln_safetensors_view(f, names[d]));
        assert_tensor_bytes(v[d], (kiln_dtype)d, 2, shape, bytes[d]);
    }
    bool mapped = test_opt_on("MMAP"); /* on unless the environment turns it off: then copies */
    if (mapped) assert_int_equal(kiln_memory_allocated(), before); /* mapped, not allocated */
    else assert_true(kiln_memory_allocated() > before);
    kiln_safetensors_free(f);
    float ones[6] = {1, 1, 1, 1, 1, 1};
    assert_int_equal(kiln_tensor_from_host_(v[0], ones, sizeof ones), KILN_OK);
    assert_tensor_bytes(v[0], KILN_DTYPE_F32, 2, shape, ones);
    for (int d = 0; d < KILN_DTYPE_COUNT; d++) kiln_tensor_free(v[d]);
    f = load_ok(path);
    assert_tensor_bytes(kiln_safetensors_get(f, "f32"), KILN_DTYPE_F32, 2, shape, bytes[0]);
    kiln_safetensors_free(f);
    unlink(path);
}

/* This process's resident bytes (/proc/self/statm), or 0 where it cannot be read. */
static size_t resident_bytes(void)
{
    FILE *fp = fopen("/proc/self/statm", "r");
    long size = 0, rss = 0;
    if (!fp) return 0;
    int n = fscanf(fp, "%ld %ld", &size, &rss);
    fclose(fp);
    return n == 2 ? (size_t)rss * (size_t)sysconf(_SC_PAGESIZE) : 0;
}

/* With the file mapped: when a tensor's last view is freed while the file handle and
 * other views keep the mapping, the pages it read stop counting against the process (a
 * model serving 16-bit copies of its f32 weights held them all); the other views keep
 * their values, written ones included; viewed or copied again through the same
 * mapping, the freed tensor reads as the file has it. */
static void test_freed_view_gives_its_pages_back(void **state)
{
    (void)state;
    if (!test_opt_on("MMAP") || !resident_bytes()) skip(); /* copies, or no /proc: nothing to see */
    enum { N = 4 << 20, S = 1024 }; /* floats: 16 MiB, and 4 KiB */
    const char *names[2] = {"big", "small"};
    int64_t shape[1] = {N}, small_shape[1] = {S};
    float *data = malloc(sizeof(float) * N), *copy = malloc(sizeof(float) * N);
    assert_non_null(data);
    assert_non_null(copy);
    for (int64_t i = 0; i < N; i++) data[i] = (float)(i % 977), copy[i] = 0;
    kiln_tensor_t *ts[2] = {kiln_from_data(data, shape, 1, KILN_DTYPE_F32),
                            kiln_from_data(data, small_shape, 1, KILN_DTYPE_F32)};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, ts, 2, NULL), KILN_OK);
    kiln_safetensors_t *f = load_ok(path); /* open throughout: its reference keeps the mapping too */
    /* kept out of the test's scope, so that freeing big drops its last reference */
    kiln_tensor_t *big = kiln_keep(kiln_safetensors_view(f, "big")), *small = kiln_keep(kiln_safetensors_view(f, "small"));
    float written[S];
    for (int i = 0; i < S; i++) written[i] = data[i] + 1;
    assert_int_equal(kiln_tensor_from_host_(small, written, sizeof written), KILN_OK); /* copy-on-write pages */
    assert_int_equal(kiln_tensor_to_host(big, copy, sizeof(float) * N), KILN_OK); /* every page read */
    assert_memory_equal(copy, data, sizeof(float) * N);
    size_t touched = resident_bytes();
    kiln_tensor_free(big);
    size_t after = resident_bytes();
    if (!(touched > after && touched - after >= (size_t)N * sizeof(float) * 9 / 10))
        fail_msg("freeing the view gave back %zu of its %zu bytes", touched > after ? touched - after : 0,
                 (size_t)N * sizeof(float));
    float got[S];
    assert_int_equal(kiln_tensor_to_host(small, got, sizeof got), KILN_OK);
    assert_memory_equal(got, written, sizeof got);
    /* big again through the same mapping: its pages read from the file again */
    memset(copy, 0, sizeof(float) * N);
    assert_int_equal(kiln_tensor_to_host(kiln_safetensors_view(f, "big"), copy, sizeof(float) * N), KILN_OK);
    assert_memory_equal(copy, data, sizeof(float) * N);
    assert_int_equal(kiln_tensor_to_host(kiln_safetensors_get(f, "big"), copy, sizeof(float) * N), KILN_OK);
    assert_memory_equal(copy, data, sizeof(float) * N);
    kiln_safetensors_free(f);
    kiln_tensor_free(small);
    free(data);
    free(copy);
    unlink(path);
}

/* ---- malformed files: one rule each ---- */

static void test_missing_file_is_an_io_error_with_strerror(void **state)
{
    kiln_safetensors_t *f = NULL;
    assert_int_equal(kiln_safetensors_load("/tmp/kiln_st_does_not_exist.safetensors", &f), KILN_ERR_IO);
    assert_null(f);
    assert_non_null(strstr(kiln_last_error(), "/tmp/kiln_st_does_not_exist.safetensors"));
    assert_non_null(strstr(kiln_last_error(), "No such file or directory"));
}

static void test_directory_is_an_io_error(void **state)
{
    kiln_safetensors_t *f = NULL;
    assert_int_equal(kiln_safetensors_load("/tmp", &f), KILN_ERR_IO);
    assert_non_null(strstr(kiln_last_error(), "not a regular file"));
}

static void test_file_shorter_than_8_bytes_is_rejected(void **state)
{
    expect_bytes_fail((const unsigned char *)"\x02\0\0\0\0", 5, KILN_ERR_FORMAT, "shorter than the 8-byte");
}

static void test_header_length_past_end_of_file_is_rejected(void **state)
{
    const unsigned char b[12] = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' '};
    expect_bytes_fail(b, sizeof b, KILN_ERR_FORMAT, "runs past the end");
}

static void test_absurd_header_length_is_rejected(void **state)
{
    const unsigned char b[10] = {0, 0, 0, 0, 0, 0, 0, 0x10, '{', '}'}; /* 2^60 */
    expect_bytes_fail(b, sizeof b, KILN_ERR_FORMAT, "absurd");
    const unsigned char c[10] = {0x01, 0xe1, 0xf5, 0x05, 0, 0, 0, 0, '{', '}'}; /* 100,000,001 */
    expect_bytes_fail(c, sizeof c, KILN_ERR_FORMAT, "absurd");
}

static void test_invalid_json_reports_line_and_column(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"F32\",,}}", NULL, 0, "not valid JSON (line 1, column");
}

static void test_header_not_starting_with_brace_is_rejected(void **state)
{
    expect_header_fail("[1, 2]", NULL, 0, "does not start with '{'");
}

static void test_entry_that_is_not_an_object_is_rejected(void **state)
{
    expect_header_fail("{\"a\": 5}", NULL, 0, "'a' is not a JSON object");
}

static void test_entry_missing_a_field_is_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", "abcd", 4, "missing \"dtype\"");
    expect_header_fail("{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", "abcd", 4, "missing \"shape\"");
    expect_header_fail("{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", "abcd", 4, "missing \"data_offsets\"");
}

static void test_fields_of_the_wrong_json_type_are_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": 5, \"shape\": [1], \"data_offsets\": [0, 4]}}", "abcd", 4,
                       "dtype of 'a' is not a string");
    expect_header_fail("{\"a\": {\"dtype\": \"F32\", \"shape\": 1, \"data_offsets\": [0, 4]}}", "abcd", 4,
                       "shape of 'a' is not an array");
    expect_header_fail("{\"a\": {\"dtype\": \"F32\", \"shape\": [1.0], \"data_offsets\": [0, 4]}}", "abcd", 4,
                       "dim 0 of 'a' is not an integer");
    expect_header_fail("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}", "abcd", 4,
                       "data_offsets of 'a' is not [begin, end]");
    expect_header_fail("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": {\"b\": 0}}}", "abcd", 4,
                       "data_offsets of 'a' is not [begin, end]");
    expect_header_fail("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}", "abcd", 4,
                       "data_offsets of 'a' is not [begin, end]");
}

static void test_unknown_dtype_is_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"I16\", \"shape\": [2], \"data_offsets\": [0, 4]}}", "abcd", 4,
                       "unknown dtype 'I16'");
}

static void test_negative_dim_is_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"U8\", \"shape\": [-4], \"data_offsets\": [0, 4]}}", "abcd", 4,
                       "dim 0 of 'a' is not an integer >= 0");
}

static void test_too_many_dims_are_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"U8\", \"shape\": [1,1,1,1,1,1,1,1,4], \"data_offsets\": [0, 4]}}",
                       "abcd", 4, "has 9 dims, more than kiln's 8");
}

static void test_shape_that_overflows_is_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"U8\", \"shape\": [4294967296, 4294967296, 16], "
                       "\"data_offsets\": [0, 4]}}", "abcd", 4, "overflows 64 bits");
    /* no elements, yet the strides of the other dims would overflow */
    expect_header_fail("{\"a\": {\"dtype\": \"U8\", \"shape\": [0, 4294967296, 4294967296], "
                       "\"data_offsets\": [0, 0]}}", NULL, 0, "overflows 64 bits");
    /* numel fits but numel * 8 bytes does not */
    expect_header_fail("{\"a\": {\"dtype\": \"F64\", \"shape\": [4294967296, 1073741824], "
                       "\"data_offsets\": [0, 4]}}", "abcd", 4, "hold 4 bytes");
}

static void test_size_not_matching_shape_is_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", "abcd", 4,
                       "'a' has 2 F32 elements but data_offsets [0, 4] hold 4 bytes");
}

static void test_offsets_running_backwards_are_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [4, 0]}}", "abcd", 4,
                       "run backwards");
}

static void test_offsets_beyond_the_buffer_are_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", "abcd", 4,
                       "beyond the 4-byte data buffer");
}

static void test_overlapping_tensors_are_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [0, 4]},"
                       " \"b\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [2, 6]}}", "abcdef", 6,
                       "'a' [0, 4] and 'b' [2, 6] overlap");
}

static void test_gap_between_tensors_is_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0, 2]},"
                       " \"b\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [4, 6]}}", "abcdef", 6,
                       "bytes [2, 4) belong to no tensor");
}

static void test_trailing_bytes_after_the_last_tensor_are_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0, 2]}}", "abcdef", 6,
                       "bytes [2, 6) at its end belong to no tensor");
}

static void test_duplicate_names_are_rejected(void **state)
{
    expect_header_fail("{\"a\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0, 2]},"
                       " \"a\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [2, 4]}}", "abcd", 4,
                       "duplicate name");
}

static void test_malformed_metadata_is_rejected(void **state)
{
    expect_header_fail("{\"__metadata__\": [1]}", NULL, 0, "__metadata__ is not a JSON object");
    expect_header_fail("{\"__metadata__\": {\"step\": 12}}", NULL, 0, "__metadata__ value of 'step' is not a string");
}

/* ---- truncation and fuzzing ---- */

/* A small valid file with a few dtypes, shapes and metadata; *n gets its size. */
static unsigned char *valid_file_bytes(size_t *n)
{
    int64_t s2[2] = {2, 3};
    kiln_tensor_t *ts[4] = {kiln_arange(0, 6, 1, KILN_DTYPE_F32), kiln_ones(s2, 2, KILN_DTYPE_BF16),
                            kiln_scalar(7, KILN_DTYPE_I64), kiln_ones((int64_t[]){5}, 1, KILN_DTYPE_BOOL)};
    const char *names[4] = {"x", "y.weight", "step", "mask"};
    const char *meta[] = {"format", "pt", NULL};
    char path[64];
    temp_path(path);
    assert_int_equal(kiln_safetensors_save(path, names, ts, 4, meta), KILN_OK);
    unsigned char *b = read_bytes(path, n);
    unlink(path);
    return b;
}

static void test_truncated_copies_fail_cleanly(void **state)
{
    size_t n;
    unsigned char *b = valid_file_bytes(&n);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | b[i];
    size_t cuts[] = {0, 1, 7, 8, 9, 8 + hlen / 2, 8 + hlen - 1, 8 + hlen, 8 + hlen + 1, n - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        const char *why = cuts[i] < 8 ? "shorter than" : cuts[i] < 8 + hlen ? "runs past the end" : "beyond";
        expect_bytes_fail(b, cuts[i], KILN_ERR_FORMAT, why);
    }
    free(b);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_next(void) /* xorshift64*: reproducible without libc's rand */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}

/* 2,000 seeded mutations of a valid file; each must load or fail with FORMAT, and a
 * file that loads must hand out every tensor. ASan builds check for stray reads. */
static void test_mutated_files_load_or_fail_cleanly(void **state)
{
    size_t n;
    unsigned char *orig = valid_file_bytes(&n);
    unsigned char *b = malloc(n);
    assert_non_null(b);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | orig[i];
    static const char json_chars[] = "{}[]\":,0123456789-.e \\u";
    char path[64];
    temp_path(path);
    int loaded = 0;
    for (int iter = 0; iter < 2000; iter++) {
        memcpy(b, orig, n);
        size_t len = n;
        int kind = (int)(rng_next() % 5);
        int count = 1 + (int)(rng_next() % 4);
        for (int k = 0; k < count; k++) {
            if (kind == 0) { /* flip a bit anywhere */
                size_t at = rng_next() % len;
                b[at] ^= (unsigned char)(1u << (rng_next() % 8));
            } else if (kind == 1) { /* a JSON-ish character in the header */
                size_t at = 8 + rng_next() % hlen;
                b[at] = (unsigned char)json_chars[rng_next() % (sizeof json_chars - 1)];
            } else if (kind == 2) { /* a new length field byte */
                b[rng_next() % 8] = (unsigned char)rng_next();
            } else if (kind == 4) { /* a bit in the data: should still load */
                size_t at = 8 + hlen + rng_next() % (n - 8 - hlen);
                b[at] ^= (unsigned char)(1u << (rng_next() % 8));
            }
        }
        if (kind == 3) len = rng_next() % n; /* truncate */
        write_bytes(path, b, len);
        kiln_safetensors_t *f = NULL;
        kiln_status s = kiln_safetensors_load(path, &f);
        if (s != KILN_OK && s != KILN_ERR_FORMAT) print_error("iteration %d: %s\n", iter, kiln_last_error());
        assert_true(s == KILN_OK || s == KILN_ERR_FORMAT);
        assert_true((s == KILN_OK) == (f != NULL));
        if (!f) continue;
        loaded++;
        kiln_scope_begin();
        for (int i = 0; i < kiln_safetensors_count(f); i++)
            assert_non_null(kiln_safetensors_get(f, kiln_safetensors_name(f, i)));
        kiln_safetensors_meta(f, "format");
        kiln_scope_end();
        kiln_safetensors_free(f);
    }
    print_message("fuzz: %d of 2000 mutated files still loaded\n", loaded);
    free(b);
    free(orig);
    unlink(path);
}

#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_round_trip_keeps_every_dtype_bit_exact),
        T(test_round_trip_keeps_0d_and_empty_tensors),
        T(test_round_trip_writes_transposed_tensor_in_row_major_order),
        T(test_metadata_round_trips_and_missing_key_is_null),
        T(test_file_without_metadata_has_no_meta),
        T(test_names_follow_data_order_largest_element_first),
        T(test_empty_file_with_no_tensors_loads),
        T(test_written_file_matches_the_spec_byte_for_byte),
        T(test_save_leaves_only_the_target_file),
        T(test_save_into_missing_directory_fails_with_io),
        T(test_failed_write_keeps_the_old_file),
        T(test_save_over_a_directory_is_refused_and_leaves_nothing),
        T(test_save_rejects_duplicate_names),
        T(test_save_rejects_the_reserved_metadata_name),
        T(test_save_rejects_meta_key_without_value),
        T(test_save_of_a_failed_op_keeps_its_error),
        T(test_get_of_unknown_name_is_an_arg_error),
        T(test_get_registers_the_tensor_with_the_open_scope),
        T(test_view_maps_the_file_without_copying_it),
        T(test_freed_view_gives_its_pages_back),
        T(test_missing_file_is_an_io_error_with_strerror),
        T(test_directory_is_an_io_error),
        T(test_file_shorter_than_8_bytes_is_rejected),
        T(test_header_length_past_end_of_file_is_rejected),
        T(test_absurd_header_length_is_rejected),
        T(test_invalid_json_reports_line_and_column),
        T(test_header_not_starting_with_brace_is_rejected),
        T(test_entry_that_is_not_an_object_is_rejected),
        T(test_entry_missing_a_field_is_rejected),
        T(test_fields_of_the_wrong_json_type_are_rejected),
        T(test_unknown_dtype_is_rejected),
        T(test_negative_dim_is_rejected),
        T(test_too_many_dims_are_rejected),
        T(test_shape_that_overflows_is_rejected),
        T(test_size_not_matching_shape_is_rejected),
        T(test_offsets_running_backwards_are_rejected),
        T(test_offsets_beyond_the_buffer_are_rejected),
        T(test_overlapping_tensors_are_rejected),
        T(test_gap_between_tensors_is_rejected),
        T(test_trailing_bytes_after_the_last_tensor_are_rejected),
        T(test_duplicate_names_are_rejected),
        T(test_malformed_metadata_is_rejected),
        T(test_truncated_copies_fail_cleanly),
        T(test_mutated_files_load_or_fail_cleanly),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
