/* Shared test fixture: every test runs inside a scope with a clear error, so that
 * LeakSanitizer sees nothing left at exit. */
#ifndef KILN_TEST_UTIL_H
#define KILN_TEST_UTIL_H
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "kiln/ops.h"
#include "kiln/tensor.h"

/* The CUDA backend's compiler (src/backends/cuda): src's kernel `name` to PTX for sm_major.minor. */
kiln_status kiln__cuda_nvrtc(const char *src, const char *name, int major, int minor, char **ptx);

/* Skips the calling cmocka test (skipped, not passed) where NVRTC is not available, saying
 * so; a macro, since cmocka's skip() returns from the test. */
#define skip_without_nvrtc()                                                                              \
    do {                                                                                                  \
        char *probe_ = NULL;                                                                              \
        if (kiln__cuda_nvrtc("extern \"C\" __global__ void probe() {}", "probe", 9, 0, &probe_) != KILN_OK) { \
            print_message("skipped: NVRTC is not available here (%s)\n", kiln_last_error());             \
            kiln_clear_error();                                                                           \
            skip();                                                                                       \
        }                                                                                                 \
        free(probe_);                                                                                     \
    } while (0)

/* Whether the switch KILN_OPT_<name> is on in this process. */
static inline bool test_opt_on(const char *name)
{
    for (int i = 0; i < kiln_opt_count(); i++)
        if (!strcmp(kiln_opt_name(i), name)) return kiln_opt_enabled(i);
    return false;
}

static inline int setup(void **state)
{
    (void)state;
    kiln_clear_error();
    kiln_scope_begin();
    return 0;
}

static inline int teardown(void **state)
{
    (void)state;
    kiln_scope_end();
    return 0;
}
/* Whether tensors a and b (any float dtype, any device) hold as many elements, each
 * within tol relative to b's (|x - y| <= tol (1 + |y|)), read as f64; else what differs
 * in why (n bytes). */
static inline bool test_close(kiln_tensor_t *a, kiln_tensor_t *b, double tol, char *why, size_t n)
{
    if (!a || !b) {
        snprintf(why, n, "no tensor: %s", kiln_last_error());
        return false;
    }
    int64_t na = kiln_tensor_numel(a), nb = kiln_tensor_numel(b);
    if (na != nb) {
        snprintf(why, n, "%lld elements vs %lld", (long long)na, (long long)nb);
        return false;
    }
    double *x = malloc(sizeof(double) * (size_t)(na ? na : 1)), *y = malloc(sizeof(double) * (size_t)(na ? na : 1));
    kiln_scope_begin(); /* the f64 copies */
    bool ok = x && y && kiln_tensor_to_host(kiln_cast(a, KILN_DTYPE_F64), x, sizeof(double) * (size_t)na) == KILN_OK &&
              kiln_tensor_to_host(kiln_cast(b, KILN_DTYPE_F64), y, sizeof(double) * (size_t)na) == KILN_OK;
    kiln_scope_end();
    if (!ok) snprintf(why, n, "cannot read them: %s", kiln_last_error());
    for (int64_t i = 0; ok && i < na; i++)
        if (fabs(x[i] - y[i]) > tol * (1 + fabs(y[i]))) {
            snprintf(why, n, "element %lld: %g vs %g", (long long)i, x[i], y[i]);
            ok = false;
        }
    free(x);
    free(y);
    return ok;
}

/* Reads up to n - 1 bytes of the file at path into buf, NUL-terminated; false if the
 * file cannot be opened. */
static inline bool test_read_text(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    buf[fread(buf, 1, n - 1, f)] = 0;
    fclose(f);
    return true;
}
/* What this process writes to stderr between test_stderr_begin and test_stderr_end
 * goes to a temporary file, whose first n - 1 bytes end up in buf. */
typedef struct {
    int saved;
    FILE *log;
} test_stderr;

static inline bool test_stderr_begin(test_stderr *c)
{
    fflush(stderr);
    c->log = tmpfile();
    c->saved = c->log ? dup(2) : -1;
    return c->saved >= 0 && dup2(fileno(c->log), 2) >= 0;
}

static inline void test_stderr_end(test_stderr *c, char *buf, size_t n)
{
    fflush(stderr);
    dup2(c->saved, 2);
    close(c->saved);
    rewind(c->log);
    buf[fread(buf, 1, n - 1, c->log)] = 0;
    fclose(c->log);
}

/* |got - want| <= tol, failing on a NaN (cmocka's assert_float_equal lets a NaN pass:
 * its test is |a - b| > epsilon). */
#define assert_near(got, want, tol)                                                                    \
    do {                                                                                               \
        double got_ = (got), want_ = (want);                                                           \
        if (!(fabs(got_ - want_) <= (tol))) fail_msg("%s = %.9g, want %.9g within %g", #got, got_, want_, (double)(tol)); \
    } while (0)

/* Largest |a[i] - b[i]| / (1 + |b[i]|) over n values, b the reference; infinite when a
 * NaN or an infinity appears on either side (so that no such value passes a tolerance). */
static inline double test_max_rel_err(const double *a, const double *b, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]) / (1 + fabs(b[i]));
        if (d > m || d != d) m = d != d ? INFINITY : d;
    }
    return m;
}
/* setenv and unsetenv once every device registered so far has finished its queued
 * work: a device's worker threads (PoCL's) read the environment while they run, and
 * glibc's getenv is not safe against a concurrent setenv (a worker crashed in getenv
 * under ASan while test_compile set KILN_COMPILE_DECOMPOSE). Devices not yet probed are
 * left alone. */
int kiln__backend_count(void);
static inline void test_quiesce(void)
{
    for (int i = 0; i < kiln__backend_count(); i++) kiln_device_synchronize(kiln_device_name(i));
}
static inline int test_setenv(const char *name, const char *value, int overwrite)
{
    test_quiesce();
    return setenv(name, value, overwrite);
}
static inline int test_unsetenv(const char *name)
{
    test_quiesce();
    return unsetenv(name);
}
#endif
