/* bench/dispatch: the cost of reaching a kernel through the backend contract. The same
 * add of two 16-element f32 tensors three ways, in one run: the cpu backend's kernel
 * called directly on a preallocated output (the peer: no kiln in between), through
 * kiln__dispatch (checks, shape inference, output allocation from the caching
 * allocator, the kernel through the backend's table), and through the public kiln_add
 * (dispatch plus the scope bookkeeping). Prints one JSON line with the medians over
 * ROUNDS rounds of N calls each, in ns per op, and the overhead of dispatch over the
 * direct call (target < 1 us).
 *   build/bench_dispatch [N] [ROUNDS] */
#include <stdio.h>
#include <stdlib.h>
#include "bench.h"
#include "core/tensor_impl.h"
#include "kiln/kiln.h"
#include "ops/registry.h"

static int cmp(const void *a, const void *b) { return bench_cmp_double(a, b); }

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 200000, rounds = argc > 2 ? atoi(argv[2]) : 7;
    if (n < 1 || rounds < 1 || rounds > 64) {
        fprintf(stderr, "usage: bench_dispatch [N >= 1] [ROUNDS 1..64]\n");
        return 2;
    }
    kiln_init(1);
    int64_t shape[1] = {16};
    kiln_tensor_t *x = kiln_keep(kiln_ones(shape, 1, KILN_DTYPE_F32)), *y = kiln_keep(kiln_ones(shape, 1, KILN_DTYPE_F32));
    kiln_tensor_t *o = kiln_keep(kiln_zeros(shape, 1, KILN_DTYPE_F32));
    kiln__backend *cpu = kiln__backend_find("cpu");
    kiln__kernel_fn add = cpu->kernels[KILN_OP_ADD];
    kiln_tensor_t *in[2] = {x, y};
    kiln__attrs at = {0};
    double direct[64], disp[64], api[64];
    for (int r = 0; r < rounds; r++) {
        double t0 = bench_now_s();
        for (int i = 0; i < n; i++) add(cpu, in, 2, &at, &o, 1);
        double t1 = bench_now_s();
        for (int i = 0; i < n; i++) {
            kiln_tensor_t *res = NULL;
            kiln__dispatch(KILN_OP_ADD, in, 2, &at, &res);
            kiln_tensor_free(res);
        }
        double t2 = bench_now_s();
        kiln_scope_begin();
        for (int i = 0; i < n; i++) {
            if (i % 1024 == 0) { /* the scope is emptied now and then, as a training step would */
                kiln_scope_end();
                kiln_scope_begin();
            }
            kiln_add(x, y);
        }
        kiln_scope_end();
        double t3 = bench_now_s();
        direct[r] = (t1 - t0) / n * 1e9;
        disp[r] = (t2 - t1) / n * 1e9;
        api[r] = (t3 - t2) / n * 1e9;
    }
    qsort(direct, (size_t)rounds, sizeof(double), cmp);
    qsort(disp, (size_t)rounds, sizeof(double), cmp);
    qsort(api, (size_t)rounds, sizeof(double), cmp);
    double d = direct[rounds / 2], s = disp[rounds / 2], a = api[rounds / 2];
    printf("{\"bench\":\"dispatch\",\"op\":\"add f32[16]\",\"calls\":%d,\"rounds\":%d,\"direct_ns\":%.1f,"
           "\"dispatch_ns\":%.1f,\"api_ns\":%.1f,\"dispatch_overhead_ns\":%.1f,\"api_overhead_ns\":%.1f}\n",
           n, rounds, d, s, a, s - d, a - d);
    kiln_tensor_free(x);
    kiln_tensor_free(y);
    kiln_tensor_free(o);
    return 0;
}
