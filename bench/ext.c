/* bench/ext: what a custom op costs (issue 28), in one run.
 *
 * 1. The example extension (examples/ext/rmsnorm_residual.c and .cl) built and loaded:
 *    kiln_ext_build into an empty folder (cold), again with nothing changed (warm), and
 *    kiln_ext_load in a fresh child process after each (the first load of a process;
 *    with --device opencl the OpenCL device is opened first, so the load builds the .cl
 *    kernel too: after the cold build with empty kernel caches, after the warm one with
 *    the user's).
 * 2. Dispatch: the same add of two 16-element f32 tensors as a custom op (kiln_op_call,
 *    a C kernel) and as the built-in kiln_add (the peer), interleaved over ROUNDS rounds
 *    of N calls, both through the public API with the same scope bookkeeping: medians
 *    in ns per call and their ratio (custom / built-in).
 * Prints one JSON line.
 *   build/bench_ext [--calls N] [--rounds R] [--device opencl] [--source-dir DIR] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "bench.h"
#include "kiln/kiln.h"

static kiln_status add_shape(const kiln_op_args *a, kiln_op_meta *out)
{
    out->dtype = KILN_DTYPE_F32;
    out->ndim = kiln_tensor_ndim(a->in[0]);
    memcpy(out->shape, kiln_tensor_shape(a->in[0]), sizeof(int64_t) * (size_t)out->ndim);
    return KILN_OK;
}

static kiln_status add_cpu(const kiln_op_args *a)
{
    const float *x = kiln_op_data(a->in[0]), *y = kiln_op_data(a->in[1]);
    float *o = kiln_op_data(a->out[0]);
    for (int64_t i = 0, n = kiln_tensor_numel(a->out[0]); i < n; i++) o[i] = x[i] + y[i];
    return KILN_OK;
}

/* The seconds a fresh process takes to load the module (-1 on failure); cache, when
 * given, is an empty folder for the kernel caches (kiln's and PoCL's), so that a source
 * kernel is built from nothing. */
static double load_in_child(const char *mod, const char *device, const char *cache)
{
    int fd[2];
    if (pipe(fd) != 0) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        if (cache && (setenv("KILN_CACHE_DIR", cache, 1) != 0 || setenv("POCL_CACHE_DIR", cache, 1) != 0)) _exit(1);
        if (device && kiln_set_device(device) != KILN_OK) _exit(1);
        double t0 = bench_now_s();
        kiln_status s = kiln_ext_load(mod, NULL);
        double dt = bench_now_s() - t0;
        if (s != KILN_OK) fprintf(stderr, "bench_ext: %s\n", kiln_last_error());
        if (s == KILN_OK && write(fd[1], &dt, sizeof dt) != sizeof dt) _exit(1);
        _exit(s == KILN_OK ? 0 : 1);
    }
    close(fd[1]);
    double dt = -1;
    if (read(fd[0], &dt, sizeof dt) != sizeof dt) dt = -1;
    close(fd[0]);
    int st;
    waitpid(pid, &st, 0);
    return dt;
}

int main(int argc, char **argv)
{
    int calls = 200000, rounds = 7;
    const char *device = NULL, *root = ".";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--calls")) calls = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--device")) device = argv[i + 1];
        else if (!strcmp(argv[i], "--source-dir")) root = argv[i + 1];
        else break;
    }
    if (calls < 1 || rounds < 1 || rounds > 64 || (argc - 1) % 2) {
        fprintf(stderr, "usage: bench_ext [--calls N] [--rounds 1..64] [--device opencl] [--source-dir DIR]\n");
        return 2;
    }
    kiln_init(1);
    /* 1. build and load */
    char dir[] = "/tmp/kiln-bench-ext-XXXXXX", src_c[1024], src_cl[1024], include[1024];
    if (!mkdtemp(dir)) return 1;
    snprintf(src_c, sizeof src_c, "%s/examples/ext/rmsnorm_residual.c", root);
    snprintf(src_cl, sizeof src_cl, "%s/examples/ext/rmsnorm_residual.cl", root);
    snprintf(include, sizeof include, "%s/include", root);
    const char *srcs[2] = {src_c, src_cl};
    kiln_ext_langs_t *langs;
    if (kiln_ext_langs_load(NULL, &langs) != KILN_OK) {
        fprintf(stderr, "bench_ext: %s\n", kiln_last_error());
        return 1;
    }
    double build_s[2], load_s[2];
    char *mod = NULL;
    for (int warm = 0; warm < 2; warm++) {
        free(mod);
        mod = NULL;
        double t0 = bench_now_s();
        if (kiln_ext_build(langs, srcs, 2, dir, "rmsnorm", include, &mod, NULL) != KILN_OK) {
            fprintf(stderr, "bench_ext: %s (--source-dir names kiln's source tree)\n", kiln_last_error());
            return 1;
        }
        build_s[warm] = bench_now_s() - t0;
        char cache[64];
        snprintf(cache, sizeof cache, "%s/cache", dir);
        load_s[warm] = load_in_child(mod, device, warm ? NULL : cache);
    }
    kiln_ext_langs_free(langs);
    /* 2. dispatch */
    int id;
    const kiln_op_kernel k[] = {{.device = "cpu", .fn = add_cpu}};
    if (kiln_op_define(&(kiln_op_decl){.name = "bench_add", .n_in = 2, .n_out = 1, .shape = add_shape, .kernels = k,
                                       .n_kernels = 1},
                       &id) != KILN_OK) {
        fprintf(stderr, "bench_ext: %s\n", kiln_last_error());
        return 1;
    }
    int64_t shape[1] = {16};
    kiln_tensor_t *in[2] = {kiln_keep(kiln_ones(shape, 1, KILN_DTYPE_F32)), kiln_keep(kiln_ones(shape, 1, KILN_DTYPE_F32))};
    double custom[64], builtin[64];
    for (int r = 0; r < rounds; r++)
        for (int which = 0; which < 2; which++) {
            double t0 = bench_now_s();
            kiln_scope_begin();
            for (int i = 0; i < calls; i++) {
                if (i % 1024 == 0) { /* the scope emptied now and then, as a training step would */
                    kiln_scope_end();
                    kiln_scope_begin();
                }
                if (which) kiln_add(in[0], in[1]);
                else kiln_op_call(id, in, 2, NULL, 0);
            }
            kiln_scope_end();
            (which ? builtin : custom)[r] = (bench_now_s() - t0) / calls * 1e9;
        }
    qsort(custom, (size_t)rounds, sizeof(double), bench_cmp_double);
    qsort(builtin, (size_t)rounds, sizeof(double), bench_cmp_double);
    double c = custom[rounds / 2], b = builtin[rounds / 2];
    printf("{\"bench\":\"ext\",\"module\":\"rmsnorm_residual (.c + .cl)\",\"device\":\"%s\",\"build_cold_s\":%.3f,"
           "\"build_warm_s\":%.4f,\"load_after_cold_s\":%.4f,\"load_after_warm_s\":%.4f,\"op\":\"add f32[16]\","
           "\"calls\":%d,\"rounds\":%d,\"custom_ns\":%.1f,\"builtin_ns\":%.1f,\"custom_over_builtin\":%.3f}\n",
           device ? device : "cpu", build_s[0], build_s[1], load_s[0], load_s[1], calls, rounds, c, b, c / b);
    kiln_tensor_free(in[0]);
    kiln_tensor_free(in[1]);
    free(mod);
    char rm[256];
    snprintf(rm, sizeof rm, "rm -rf '%s'", dir);
    return system(rm) == 0 ? 0 : 1;
}
