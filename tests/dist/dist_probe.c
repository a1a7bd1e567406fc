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
 *   alltoall kiln_pg_all_to_all of rows whose values say where they come from and go,
 *            checked against that closed form: the rows received, the zeros after
 *            them, the counts, the gradient that comes back (each row's gradient its
 *            place on the rank it went to); the same in a compiled function with two
 *            count patterns on one graph; bad counts on rank 1 and a too small out_rows
 *            failing on every rank, after which the group still works, also with
 *            each rank's out_rows just what it receives (different ones); the
 *            exchanges counted by kiln_pg_time_in; prints "alltoall ok"
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

/* Rows rank r sends rank d in count pattern p (some of them none). */
static int64_t sent(int p, int r, int d) { return (r + 2 * d + p) % 3; }

/* Rank r's x for pattern p: its rows for each rank d in turn, row j of them all
 * 100 r + 10 d + j (+ 0.001 k in column k), then rows it sends nowhere, up to 2 W + 1
 * rows whatever the pattern (one shape, so one graph); and the counts. */
static void a2a_inputs(int p, kiln_tensor_t **x, kiln_tensor_t **counts, int64_t *R)
{
    int64_t c[16], rows = 0;
    float v[64 * 3];
    for (int d = 0; d < world; d++) {
        c[d] = sent(p, rank, d);
        for (int64_t j = 0; j < c[d]; j++, rows++)
            for (int k = 0; k < 3; k++) v[rows * 3 + k] = (float)(100 * rank + 10 * d + j) + 0.001f * (float)k;
    }
    for (; rows < 2 * (int64_t)world + 1; rows++)
        for (int k = 0; k < 3; k++) v[rows * 3 + k] = -1; /* unsent */
    *R = rows;
    int64_t shape[2] = {rows, 3}, w = world;
    *x = kiln_from_data(v, shape, 2, KILN_DTYPE_F32);
    *counts = kiln_from_data(c, &w, 1, KILN_DTYPE_I64);
}

/* y (out_rows, 3) and recv (world) as rank `rank` must have them for pattern p. */
static int a2a_check(int p, kiln_tensor_t *y, kiln_tensor_t *recv, int64_t out_rows, const char *what)
{
    float h[64 * 3];
    int64_t rc[16];
    kiln_tensor_to_host(y, h, sizeof(float) * (size_t)(out_rows * 3));
    kiln_tensor_to_host(recv, rc, sizeof(int64_t) * (size_t)world);
    int64_t at = 0;
    for (int s = 0; s < world; s++) {
        if (rc[s] != sent(p, s, rank)) {
            fprintf(stderr, "rank %d: %s: %lld rows from rank %d, want %lld\n", rank, what, (long long)rc[s], s,
                    (long long)sent(p, s, rank));
            return 1;
        }
        for (int64_t j = 0; j < rc[s]; j++, at++)
            for (int k = 0; k < 3; k++)
                if (fabsf(h[at * 3 + k] - ((float)(100 * s + 10 * rank + j) + 0.001f * (float)k)) > 1e-4f) {
                    fprintf(stderr, "rank %d: %s: row %lld is %g, want rank %d's row %lld\n", rank, what,
                            (long long)at, h[at * 3 + k], s, (long long)j);
                    return 1;
                }
    }
    for (; at < out_rows; at++)
        if (h[at * 3] != 0 || h[at * 3 + 2] != 0) {
            fprintf(stderr, "rank %d: %s: row %lld after the received ones is %g, not 0\n", rank, what, (long long)at,
                    h[at * 3]);
            return 1;
        }
    return 0;
}

/* The compiled function: y and the counts received for (x, counts). */
static kiln_status exchanged(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    (void)n_in;
    kiln_status s = kiln_pg_all_to_all(ctx, in[0], in[1], (int64_t)world * 3, &out[0], &out[1]);
    *n_out = 2;
    return s;
}

static int alltoall(void)
{
    int bad = 0;
    int64_t R, out_rows = (int64_t)world * 3; /* at most 2 rows from each rank */
    kiln_tensor_t *x, *counts, *y, *recv;
    /* values and the gradient: loss = sum_i (i + 1) y_i, so a row's gradient is 1 + its
     * place in the receiving rank's y */
    a2a_inputs(0, &x, &counts, &R);
    kiln_tensor_set_requires_grad(x, true);
    bad |= kiln_pg_all_to_all(pg, x, counts, out_rows, &y, &recv) != KILN_OK;
    if (!bad) bad |= a2a_check(0, y, recv, out_rows, "eager");
    if (!bad) {
        int64_t col[2] = {out_rows, 1};
        kiln_tensor_t *place = kiln_reshape(kiln_arange(1, (double)out_rows + 1, 1, KILN_DTYPE_F32), col, 2);
        bad |= kiln_backward(kiln_sum(kiln_mul(y, place), NULL, 0, false)) != KILN_OK;
        float g[64 * 3];
        if (!bad) kiln_tensor_to_host(kiln_tensor_grad(x), g, sizeof(float) * (size_t)(R * 3));
        int64_t row = 0;
        for (int d = 0; !bad && d < world; d++) {
            int64_t before = 0; /* rows rank d got from ranks below this one */
            for (int s = 0; s < rank; s++) before += sent(0, s, d);
            for (int64_t j = 0; j < sent(0, rank, d) && !bad; j++, row++)
                if (g[row * 3 + 1] != (float)(before + j + 1)) {
                    fprintf(stderr, "rank %d: gradient of row %lld is %g, want %lld (its place on rank %d)\n", rank,
                            (long long)row, g[row * 3 + 1], (long long)(before + j + 1), d);
                    bad = 1;
                }
        }
        for (; !bad && row < R; row++)
            if (g[row * 3] != 0) {
                fprintf(stderr, "rank %d: unsent row %lld's gradient is %g, not 0\n", rank, (long long)row, g[row * 3]);
                bad = 1;
            }
    }
    /* compiled: two count patterns, one graph */
    kiln_compiled_t *c = NULL;
    bad |= kiln_compiled_new(exchanged, pg, "alltoall", &c) != KILN_OK;
    for (int p = 0; p < 3 && !bad; p++) {
        kiln_tensor_t *in[2], *out[2];
        int n = 0;
        a2a_inputs(p % 2, &in[0], &in[1], &R);
        bad |= kiln_compiled_call(c, in, 2, out, 2, &n) != KILN_OK || n != 2;
        if (!bad) bad |= a2a_check(p % 2, out[0], out[1], out_rows, "compiled");
    }
    int graphs = 0;
    if (c) kiln_compiled_stats(c, NULL, NULL, NULL, &graphs);
    kiln_compiled_free(c);
    /* bad counts on rank 1 (negative) and then an out_rows too small: every rank fails,
     * naming it, and the group goes on */
    if (!bad) {
        a2a_inputs(0, &x, &counts, &R);
        int64_t neg[16] = {0}, w = world;
        neg[0] = -2;
        kiln_status s = kiln_pg_all_to_all(pg, x, rank == 1 ? kiln_from_data(neg, &w, 1, KILN_DTYPE_I64) : counts,
                                           out_rows, &y, &recv);
        printf("rank %d: bad counts: %s\n", rank, s == KILN_OK ? "no error" : kiln_last_error());
        bad |= s == KILN_OK;
        s = kiln_pg_all_to_all(pg, x, counts, 1, &y, &recv);
        printf("rank %d: small out_rows: %s\n", rank, s == KILN_OK ? "no error" : kiln_last_error());
        bad |= s == KILN_OK;
        bad |= kiln_pg_all_to_all(pg, x, counts, out_rows, &y, &recv) != KILN_OK ||
               a2a_check(0, y, recv, out_rows, "after the errors");
        /* each rank's out_rows just what it receives: they differ between the ranks */
        int64_t exact = 0;
        for (int r = 0; r < world; r++) exact += sent(0, r, rank);
        bad |= kiln_pg_all_to_all(pg, x, counts, exact, &y, &recv) != KILN_OK ||
               a2a_check(0, y, recv, exact, "out_rows of each rank's own");
    }
    /* 9 exchanges: forward and backward, 3 compiled calls, the 2 that failed, the last 2 */
    uint64_t calls = 0;
    double secs = 0;
    if (!bad && (kiln_pg_time_in(pg, "all_to_all", &calls, &secs) != KILN_OK || calls != 9 || !(secs > 0))) {
        fprintf(stderr, "rank %d: kiln_pg_time_in counts %llu all-to-alls in %g s, want 9 in some time\n", rank,
                (unsigned long long)calls, secs);
        bad = 1;
    }
    bad |= kiln_pg_check_step(pg) != KILN_OK;
    if (bad) fprintf(stderr, "rank %d: %s\n", rank, kiln_last_error());
    else printf("rank %d: alltoall ok, %d graph(s)\n", rank, graphs);
    return bad;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: mpirun -np N dist_probe values|order|step|lag|graph|alltoall\n");
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
             : !strcmp(argv[1], "graph") ? graph() : !strcmp(argv[1], "alltoall") ? alltoall() : 2;
    kiln_scope_end();
    fflush(stdout);
    kiln_pg_free(pg); /* finalizes MPI unless a collective was left posted (a timeout) */
    return rc;
}
