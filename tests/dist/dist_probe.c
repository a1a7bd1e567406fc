/* The process group's collectives and guards under mpirun, one scenario per run (the
 * test that drives it is tests/dist/test_dist_collectives.py):
 *   values   allreduce sum/avg, broadcast, allgather, reduce_scatter (sum, avg) and
 *            their async forms (four in flight at once) on rank-dependent values, each checked against the
 *            closed-form result; prints "values ok"
 *   order    two threads issue allreduce(10 floats) and allreduce(20 floats), rank 0
 *            in one order and the others in the other; prints the error each rank gets
 *   step     rank 0 sums where the others average (the same MPI traffic, different
 *            signatures); prints kiln_pg_check_step's error
 *   lag      rank 1 sleeps LAG seconds before its two allreduces (async); prints rank 0's
 *            error for the first, then how soon the second failed and its error
 *   graph    allreduces inside a compiled function (kiln compile), started early and
 *            finished late (src/compile/overlap.c), on rank-dependent values, with reads
 *            of the value before the allreduce that must see it unreduced; three runs,
 *            each checked against the closed-form result; prints "graph ok"
 * Exit status: 0 when the scenario's expected outcome happened on this rank, else 1. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "kiln/kiln.h"

static kiln_pg_t *pg;
static int rank, world;

static kiln_tensor_t *filled(int64_t n, double v)
{
    return kiln_full(&n, 1, v, KILN_DTYPE_F32);
}

static int expect(kiln_tensor_t *t, int64_t n, double (*want)(int64_t), const char *what)
{
    float *h = malloc(sizeof(float) * (size_t)n);
    kiln_tensor_to_host(t, h, sizeof(float) * (size_t)n);
    int bad = 0;
    for (int64_t i = 0; i < n && !bad; i++)
        if (fabs(h[i] - want(i)) > 1e-6 * (1 + fabs(want(i)))) {
            fprintf(stderr, "rank %d: %s: element %lld is %g, want %g\n", rank, what, (long long)i, h[i], want(i));
            bad = 1;
        }
    free(h);
    return bad;
}

/* Rank r contributes r + 1 everywhere, so the sum is W(W+1)/2. */
static double w_sum(int64_t i) { (void)i; return world * (world + 1) / 2.0; }
static double w_avg(int64_t i) { (void)i; return (world + 1) / 2.0; }
static double root_val(int64_t i) { (void)i; return 7; }
static double gathered(int64_t i) { return (double)(i / 3) + 1; } /* block r holds r + 1 */

static int values(void)
{
    int bad = 0;
    kiln_tensor_t *t = filled(1000, rank + 1);
    bad |= kiln_pg_allreduce(pg, t, KILN_REDUCE_SUM) != KILN_OK || expect(t, 1000, w_sum, "allreduce sum");
    t = filled(1000, rank + 1);
    bad |= kiln_pg_allreduce(pg, t, KILN_REDUCE_AVG) != KILN_OK || expect(t, 1000, w_avg, "allreduce avg");
    t = filled(50, rank ? -1 : 7);
    bad |= kiln_pg_broadcast(pg, t, 0) != KILN_OK || expect(t, 50, root_val, "broadcast");
    kiln_tensor_t *g = filled(3 * world, 0);
    t = filled(3, rank + 1);
    bad |= kiln_pg_allgather(pg, t, g) != KILN_OK || expect(g, 3 * world, gathered, "allgather");
    kiln_tensor_t *big = filled(4 * world, rank + 1), *mine = filled(4, 0);
    bad |= kiln_pg_reduce_scatter(pg, big, mine, KILN_REDUCE_SUM) != KILN_OK || expect(mine, 4, w_sum, "reduce_scatter sum");
    bad |= kiln_pg_reduce_scatter(pg, big, mine, KILN_REDUCE_AVG) != KILN_OK || expect(mine, 4, w_avg, "reduce_scatter avg");
    kiln_pg_work_t *w;
    t = filled(100000, rank + 1);
    bad |= kiln_pg_allreduce_async(pg, t, KILN_REDUCE_AVG, &w) != KILN_OK;
    bool done = false;
    if (!bad) bad |= kiln_pg_work_test(w, &done) != KILN_OK;
    if (!bad) bad |= kiln_pg_work_wait(w) != KILN_OK || expect(t, 100000, w_avg, "async allreduce avg");
    /* The other async forms, four in flight at once, waited for in another order. */
    kiln_pg_work_t *wb, *wg, *wr, *wbar;
    kiln_tensor_t *bt = filled(50, rank ? -1 : 7), *g2 = filled(3 * world, 0), *t3 = filled(3, rank + 1);
    kiln_tensor_t *mine2 = filled(4, 0);
    bad |= kiln_pg_broadcast_async(pg, bt, 0, &wb) != KILN_OK;
    bad |= kiln_pg_allgather_async(pg, t3, g2, &wg) != KILN_OK;
    bad |= kiln_pg_reduce_scatter_async(pg, big, mine2, KILN_REDUCE_AVG, &wr) != KILN_OK;
    bad |= kiln_pg_barrier_async(pg, &wbar) != KILN_OK;
    if (!bad) {
        bad |= kiln_pg_work_wait(wbar) != KILN_OK;
        bad |= kiln_pg_work_wait(wr) != KILN_OK || expect(mine2, 4, w_avg, "async reduce_scatter avg");
        bad |= kiln_pg_work_wait(wg) != KILN_OK || expect(g2, 3 * world, gathered, "async allgather");
        bad |= kiln_pg_work_wait(wb) != KILN_OK || expect(bt, 50, root_val, "async broadcast");
    }
    bad |= kiln_pg_check_step(pg) != KILN_OK;
    /* A wrong-sized output is refused on this rank before anything is sent. */
    kiln_status s = kiln_pg_allgather(pg, t, mine);
    bad |= s != KILN_ERR_SHAPE;
    if (bad) fprintf(stderr, "rank %d: %s\n", rank, kiln_last_error());
    else printf("rank %d: values ok\n", rank);
    return bad;
}

static void *issue(void *arg)
{
    int64_t n = (int64_t)(intptr_t)arg;
    kiln_tensor_t *t = filled(n, 1);
    kiln_status s = kiln_pg_allreduce(pg, t, KILN_REDUCE_SUM);
    if (s != KILN_OK) printf("rank %d: error: %s\n", rank, kiln_last_error());
    fflush(stdout);
    return (void *)(intptr_t)(s != KILN_OK);
}

static int order(void)
{
    /* One thread at a time, so that the order is exactly the one chosen here. */
    intptr_t first = rank ? 20 : 10, second = rank ? 10 : 20;
    pthread_t a, b;
    void *ra, *rb;
    pthread_create(&a, NULL, issue, (void *)first);
    pthread_join(a, &ra);
    pthread_create(&b, NULL, issue, (void *)second);
    pthread_join(b, &rb);
    return ra || rb ? 0 : 1; /* an error was the expected outcome */
}

static int step(void)
{
    kiln_tensor_t *t = filled(16, 1);
    if (kiln_pg_allreduce(pg, t, rank ? KILN_REDUCE_AVG : KILN_REDUCE_SUM) != KILN_OK) return 1;
    if (kiln_pg_check_step(pg) == KILN_OK) return 1;
    printf("rank %d: error: %s\n", rank, kiln_last_error());
    return 0;
}

/* Two allreduces started, then waited for: the first times out, and the second,
 * on the group that timeout broke, fails at once (not after a deadline of its own). */
static int lag(void)
{
    const char *v = getenv("LAG");
    if (rank == 1) sleep((unsigned)(v ? atoi(v) : 5));
    kiln_tensor_t *t = filled(16, 1), *u = filled(16, 1);
    kiln_pg_work_t *wt, *wu;
    if (kiln_pg_allreduce_async(pg, t, KILN_REDUCE_SUM, &wt) != KILN_OK ||
        kiln_pg_allreduce_async(pg, u, KILN_REDUCE_SUM, &wu) != KILN_OK)
        return 1;
    kiln_status s = kiln_pg_work_wait(wt);
    if (rank == 0) {
        if (s == KILN_OK) return 1;
        printf("rank 0: error: %s\n", kiln_last_error());
        fflush(stdout);
    }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    kiln_status s2 = kiln_pg_work_wait(wu);
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (rank == 0) {
        if (s2 == KILN_OK) return 1;
        printf("rank 0: then, after %.3f s: %s\n", (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec),
               kiln_last_error());
        fflush(stdout);
    }
    return 0;
}

/* On rank r, with x = r + 1 (1024 elements): g = 2x, its sum and its 32 x 32 matmul
 * with ones / 32 read before g's average is taken, q = 5x summed over the group, and
 * matmuls of y that touch neither, for the collectives to overlap with. */
static kiln_status reduced(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    kiln_tensor_t *g = kiln_mul(in[0], kiln_scalar(2, KILN_DTYPE_F32));
    kiln_tensor_t *q = kiln_mul(in[0], kiln_scalar(5, KILN_DTYPE_F32));
    kiln_tensor_t *s = kiln_sum(g, NULL, 0, false);
    kiln_tensor_t *m = kiln_matmul(kiln_reshape(g, (int64_t[]){32, 32}, 2), in[2]);
    kiln_tensor_t *h = kiln_matmul(kiln_matmul(in[1], in[1]), in[1]);
    if (!s || !m || !h) return kiln_last_status();
    kiln_status st = kiln_pg_allreduce(ctx, g, KILN_REDUCE_AVG);
    if (st == KILN_OK) st = kiln_pg_allreduce(ctx, q, KILN_REDUCE_SUM);
    if (st != KILN_OK) return st;
    out[0] = kiln_add(g, kiln_scalar(1, KILN_DTYPE_F32));
    out[1] = q, out[2] = s, out[3] = m, out[4] = h;
    *n_out = 5;
    return out[0] ? KILN_OK : kiln_last_status();
}

static double g_avg_plus_1(int64_t i) { (void)i; return world + 2.0; }     /* avg of 2(r + 1), + 1 */
static double q_sum(int64_t i) { (void)i; return 5.0 * world * (world + 1) / 2.0; }
static double g_local_sum(int64_t i) { (void)i; return 2.0 * (rank + 1) * 1024; }
static double g_local(int64_t i) { (void)i; return 2.0 * (rank + 1); } /* a row's mean */
static double y_cubed(int64_t i) { (void)i; return 64 * (64 * 0.25 * 0.25) * 0.25; } /* (Y^2)ij = 4 */

static int graph(void)
{
    kiln_tensor_t *in[3] = {filled(1024, rank + 1), kiln_full((int64_t[]){64, 64}, 2, 0.25, KILN_DTYPE_F32),
                            kiln_full((int64_t[]){32, 32}, 2, 1.0 / 32, KILN_DTYPE_F32)};
    kiln_compiled_t *c;
    int bad = kiln_compiled_new(reduced, pg, "probe", &c) != KILN_OK;
    for (int run = 0; run < 3 && !bad; run++) {
        kiln_tensor_t *out[5];
        int n = 0;
        bad |= kiln_compiled_call(c, in, 3, out, 5, &n) != KILN_OK || n != 5;
        if (bad) break;
        bad |= expect(out[0], 1024, g_avg_plus_1, "graph: g averaged") || expect(out[1], 1024, q_sum, "graph: q summed");
        bad |= expect(out[2], 1, g_local_sum, "graph: sum of g before its allreduce");
        bad |= expect(out[3], 1024, g_local, "graph: matmul of g before its allreduce");
        bad |= expect(out[4], 64 * 64, y_cubed, "graph: matmuls beside it");
    }
    int kernels = 0, ops = 0;
    if (!bad) bad |= kiln_compiled_plan(c, 0, &kernels, &ops, NULL, NULL) != KILN_OK || kernels < 1;
    kiln_compiled_free(c);
    bad |= kiln_pg_check_step(pg) != KILN_OK;
    if (bad) fprintf(stderr, "rank %d: %s\n", rank, kiln_last_error());
    else printf("rank %d: graph ok\n", rank);
    return bad;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: mpirun -np N dist_probe values|order|step|lag|graph\n");
        return 2;
    }
    kiln_init(1);
    if (kiln_pg_new_from_env(&pg) != KILN_OK) {
        fprintf(stderr, "dist_probe: %s\n", kiln_last_error());
        return 1;
    }
    rank = kiln_pg_rank(pg);
    world = kiln_pg_world_size(pg);
    kiln_scope_begin();
    int rc = !strcmp(argv[1], "values") ? values() : !strcmp(argv[1], "order") ? order()
             : !strcmp(argv[1], "step") ? step() : !strcmp(argv[1], "lag") ? lag()
             : !strcmp(argv[1], "graph") ? graph() : 2;
    kiln_scope_end();
    fflush(stdout);
    kiln_pg_free(pg); /* finalizes MPI unless a collective was left posted (a timeout) */
    return rc;
}
