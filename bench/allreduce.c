/* bench/allreduce: kiln_pg_allreduce against MPI_Allreduce called directly, on the same
 * buffer sizes in the same run (1 KiB to 64 MiB of f32), interleaved: the cost of
 * kiln's layer over MPI (argument checks, the sequence count, and for the average the
 * scaling pass). Both reduce the same buffer, one after the other. Prints, on rank 0, the median microseconds of each and the algorithm
 * bandwidth (bytes / time).
 *
 *   mpirun --allow-run-as-root --oversubscribe -np 2 build/bench_allreduce [--reps N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "core/tensor_impl.h"
#include "kiln/kiln.h"
#if __has_include(<mpi.h>)
#include <mpi.h>
#define HAVE_MPI 1
#else
#define HAVE_MPI 0
#endif

#if HAVE_MPI
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return v[n / 2];
}
#endif

int main(int argc, char **argv)
{
#if !HAVE_MPI
    (void)argc;
    (void)argv;
    fprintf(stderr, "bench_allreduce: built without MPI (apt-get install libopenmpi-dev, then rebuild)\n");
    return 1;
#else
    int reps = 21;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: mpirun -np N bench_allreduce [--reps N]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > 1000) reps = 21;
    kiln_init(1);
    kiln_pg_t *pg;
    if (kiln_pg_new_from_env(&pg) != KILN_OK) {
        fprintf(stderr, "bench_allreduce: %s\n", kiln_last_error());
        return 1;
    }
    int rank = kiln_pg_rank(pg), world = kiln_pg_world_size(pg);
    if (world < 2) {
        fprintf(stderr, "bench_allreduce: run it under mpirun with 2 or more ranks\n");
        kiln_pg_free(pg);
        return 1;
    }
    if (rank == 0) {
        printf("allreduce of f32, %d ranks, median of %d runs each (two blocks, ABC then CBA)\n", world, reps);
        printf("%10s %12s %12s %12s %10s %10s %8s\n", "bytes", "MPI us", "kiln sum us", "kiln avg us", "MPI GB/s",
               "kiln GB/s", "sum/MPI");
    }
    double *tm = malloc(sizeof(double) * (size_t)reps), *ts = malloc(sizeof(double) * (size_t)reps),
           *ta = malloc(sizeof(double) * (size_t)reps);
    for (int64_t bytes = 1024; bytes <= (int64_t)64 << 20; bytes *= 4) {
        int64_t n = bytes / 4;
        kiln_scope_begin();
        kiln_tensor_t *t = kiln_ones(&n, 1, KILN_DTYPE_F32);
        float *raw = kiln__data(t); /* MPI direct on the same memory, so cache state is alike */
        /* Each way in a block of reps calls, the blocks in the order MPI, sum, avg and
         * then again backwards (each block fills half its samples): the same call had
         * position-dependent times when the three were interleaved one by one. */
        for (int half = 0; half < 2; half++)
            for (int j = 0; j < 3; j++) {
                int which = half ? 2 - j : j;
                for (int r = half * (reps / 2); r < (half ? reps : reps / 2); r++) {
                    MPI_Barrier(MPI_COMM_WORLD);
                    double t0 = bench_now_s();
                    kiln_status s = KILN_OK;
                    if (which == 0) MPI_Allreduce(MPI_IN_PLACE, raw, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                    else s = kiln_pg_allreduce(pg, t, which == 1 ? KILN_REDUCE_SUM : KILN_REDUCE_AVG);
                    double us = (bench_now_s() - t0) * 1e6;
                    if (s != KILN_OK) {
                        fprintf(stderr, "bench_allreduce: %s\n", kiln_last_error());
                        return 1;
                    }
                    (which == 0 ? tm : which == 1 ? ts : ta)[r] = us;
                }
            }
        double m = median(tm, reps), su = median(ts, reps), av = median(ta, reps);
        if (rank == 0)
            printf("%10lld %12.1f %12.1f %12.1f %10.2f %10.2f %8.2f\n", (long long)bytes, m, su, av,
                   (double)bytes / m / 1e3, (double)bytes / su / 1e3, su / m);
        kiln_scope_end();
    }
    free(tm);
    free(ts);
    free(ta);
    kiln_pg_free(pg);
    return 0;
#endif
}
