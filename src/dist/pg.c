/* Process groups. One process is the world_size = 1 group, whose collectives change
 * nothing but still count; several processes launched by mpirun or srun form an MPI
 * group (Open MPI from Debian), whose collectives are MPI's on host buffers (pg_mpi.c);
 * ranks that meet over the TCP rendezvous form a group whose collectives run through
 * NCCL (pg_nccl.c), as do collectives on cuda tensors. kiln adds what the transports
 * leave out, not another transport: every collective is numbered and signed, and the
 * order guard (pg_guard.c) turns collectives issued in different orders into an error
 * that names each rank's, rather than a hang or a silently wrong sum. pg_impl.h lists
 * the files.
 *
 * Collectives are serialized per process (MPI_THREAD_SERIALIZED): two threads may
 * issue them, and their order is what the guard checks.
 *
 * MPI is used only when the build found it (KILN_HAVE_MPI) and the process was
 * launched by an MPI launcher; a world size above 1 without one is a clear error, as
 * is asking for it in a build without MPI. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/dtype.h"
#include "core/env.h"
#include "core/parse.h"
#include "core/util.h"
#include "kiln/graph.h"
#include "ops/registry.h"
#include "kiln/ops.h"
#include "dist/pg_impl.h"

/* A count from the environment: kiln's own variable (id; -1 for none) when set, else the
 * first launcher variable of names that is set, else dflt. */
static int env_int(int id, const char *const *names, int dflt)
{
    if (id >= 0 && kiln__env_str((kiln__env_id)id)) return (int)kiln__env_int((kiln__env_id)id);
    for (int i = 0; names[i]; i++) {
        const char *v = getenv(names[i]);
        if (!v || !*v) continue;
        /* Slurm writes counts per node as "4(x2)" (4 tasks on each of 2 nodes) or "4,2":
         * the first count is this machine's; the rest must be a whole number in range */
        char head[32];
        int64_t n;
        snprintf(head, sizeof head, "%.*s", (int)strcspn(v, "(,"), v);
        if (kiln__scan_i64(head, &n) && n >= 0 && n <= 1 << 20) return (int)n;
        fprintf(stderr, "kiln: %s='%s' is not a whole number from 0 to %d; ignored\n", names[i], v, 1 << 20);
    }
    return dflt;
}

static const char *const mpi_world_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", NULL};
static const char *const world_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", NULL};
static const char *const rank_vars[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", NULL};
static const char *const local_vars[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE",
                                         "SLURM_STEP_TASKS_PER_NODE", NULL};

/* Whether an MPI launcher started this process: mpirun sets a world size; srun
 * --mpi=pmix sets only PMIx's namespace and rank (the size is SLURM_NTASKS). */
static bool mpi_launched(void)
{
    return env_int(-1, mpi_world_vars, 0) > 1 || (getenv("PMIX_NAMESPACE") && getenv("PMIX_RANK"));
}

int kiln_pg_local_size_from_env(void)
{
    int n = env_int(KILN__ENV_LOCAL_WORLD_SIZE, local_vars, 1);
    return n >= 1 ? n : 1;
}

kiln_status kiln_pg_new_from_env(kiln_pg_t **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "process group: out is NULL");
    *out = NULL;
    static const kiln__env_id checked[] = {KILN__ENV_WORLD_SIZE, KILN__ENV_RANK, KILN__ENV_DIST_TIMEOUT};
    for (size_t i = 0; i < sizeof checked / sizeof checked[0]; i++)
        if (kiln__env_check(checked[i]) != KILN_OK) return KILN_ERR_ARG; /* the message names the variable */
    int world = env_int(KILN__ENV_WORLD_SIZE, world_vars, 1), rank = env_int(KILN__ENV_RANK, rank_vars, 0);
    if (world < 1 || rank < 0 || rank >= world)
        return kiln_error(KILN_ERR_ARG, "process group: rank %d and world size %d from the environment do not fit", rank, world);
    double timeout = kiln__env_num(KILN__ENV_DIST_TIMEOUT);
    kiln_pg_t *pg = calloc(1, sizeof *pg);
    if (!pg) return kiln_error(KILN_ERR_OOM, "process group: out of memory");
    pg->rank = rank;
    pg->world = world;
    pg->timeout = timeout;
    pg->debug = kiln__env_bool(KILN__ENV_DIST_DEBUG);
    pthread_mutex_init(&pg->mu, NULL);
    kiln_status s = KILN_OK;
    if (world > 1) {
        bool launched_by_mpi = mpi_launched();
        if (!launched_by_mpi && kiln__env_str(KILN__ENV_MASTER_ADDR)) s = kiln__pg_tcp_group(pg);
#ifdef KILN_HAVE_MPI
        else if (launched_by_mpi) s = kiln__pg_mpi_start(pg, world, rank);
        else
            s = kiln_error(KILN_ERR_UNSUPPORTED, "process group: world size %d from KILN_WORLD_SIZE/SLURM, but not launched "
                           "by mpirun or srun --mpi=pmix, and no KILN_MASTER_ADDR/KILN_MASTER_PORT for the TCP rendezvous; cpu "
                           "collectives need MPI (mpirun -np %d kiln ...)", world, world);
#else
        else
            s = kiln_error(KILN_ERR_UNSUPPORTED, "process group: world size %d asked for%s, but this kiln was built "
                           "without MPI (apt-get install libopenmpi-dev openmpi-bin, then rebuild), and no "
                           "KILN_MASTER_ADDR/KILN_MASTER_PORT for the TCP rendezvous that NCCL ranks can use", world,
                           launched_by_mpi ? " by an MPI launcher" : "");
#endif
    }
    if (s == KILN_OK) *out = pg;
    else kiln_pg_free(pg);
    return s;
}

void kiln_pg_free(kiln_pg_t *pg)
{
    if (!pg) return;
#ifdef KILN_HAVE_MPI
    kiln__pg_mpi_stop(pg);
#endif
    kiln__nccl_comm_free(pg->nccl);
    pthread_mutex_destroy(&pg->mu);
    free(pg);
}

int kiln_pg_rank(const kiln_pg_t *pg) { return pg ? pg->rank : 0; }
int kiln_pg_world_size(const kiln_pg_t *pg) { return pg ? pg->world : 1; }
uint64_t kiln_pg_seq(const kiln_pg_t *pg) { return pg ? pg->seq : 0; }

/* The host buffer of a contiguous f32 or f64 tensor, or an error that says why not. */
static kiln_status host_buffer(const char *op, kiln_tensor_t *t, int world, void **data, int64_t *n)
{
    if (!t) return kiln_error(KILN_ERR_ARG, "%s: NULL tensor", op);
    if (t->st->meta)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: the tensor is being captured into a graph, and of the collectives "
                          "only allreduce, reduce_scatter and allgather are captured; run this one outside the "
                          "captured function", op);
    if (t->dtype != KILN_DTYPE_F32 && t->dtype != KILN_DTYPE_F64)
        return kiln_error(KILN_ERR_DTYPE, "%s: %s tensors are not supported (f32 or f64)", op, kiln_dtype_name(t->dtype));
    if (!kiln__is_contiguous(t)) return kiln_error(KILN_ERR_ARG, "%s: the tensor must be contiguous", op);
    if (world > 1 && t->st->be != kiln__backend_at(0))
        return kiln_error(KILN_ERR_DEVICE, "%s: the tensor is on %s, and MPI moves host memory (NCCL takes cuda tensors, "
                          "nothing yet takes others'): reduce a copy made with kiln_tensor_to(t, \"cpu\")", op,
                          t->st->be->name);
    *data = kiln__data(t);
    *n = kiln_tensor_numel(t);
#ifdef KILN_HAVE_MPI
    if (*n > 2147483647) return kiln_error(KILN_ERR_ARG, "%s: %lld elements is over MPI's int count", op, (long long)*n);
#endif
    return KILN_OK;
}

kiln_status kiln__pg_check_counts(const kiln_pg_t *pg, const sig *s, int64_t nin, int64_t nout)
{
    if (s->op == OP_ALLGATHER && nout != nin * pg->world)
        return kiln_error(KILN_ERR_SHAPE, "allgather: out holds %lld elements, not world %d x in %lld", (long long)nout,
                          pg->world, (long long)nin);
    if (s->op == OP_REDUCE_SCATTER && nin != nout * pg->world)
        return kiln_error(KILN_ERR_SHAPE, "reduce_scatter: in holds %lld elements, not world %d x out %lld", (long long)nin,
                          pg->world, (long long)nout);
    return KILN_OK;
}

/* Starts a collective: checks, numbers it, and (with MPI) posts it; w gets the work,
 * with the tensor an average is taken in (the reduced one, of an allreduce or a
 * reduce_scatter with KILN_REDUCE_AVG). */
static kiln_status start(kiln_pg_t *pg, sig *s, kiln_tensor_t *in, kiln_tensor_t *out, struct kiln_pg_work *w)
{
    bool reduces = s->op == OP_ALLREDUCE || s->op == OP_REDUCE_SCATTER;
    *w = (struct kiln_pg_work){.pg = pg, .t = reduces && s->reduce == KILN_REDUCE_AVG ? (out ? out : in) : NULL};
    w->avg = w->t != NULL;
    if (pg->broken)
        return kiln_error(KILN_ERR_DIST, "process group: an earlier collective failed on rank %d; the group cannot be used",
                          pg->rank);
    if (s->op != OP_BARRIER && in && !in->st->meta && kiln__pg_is_cuda(in->st->be) && kiln__nccl_available())
        return kiln__pg_nccl_start(pg, s, in, out, w);
    void *din = NULL, *dout = NULL;
    int64_t nin = 0, nout = 0;
    kiln_status st = KILN_OK;
    const char *op = kiln__pg_op_names[s->op];
    if (s->op != OP_BARRIER) st = host_buffer(op, in, pg->world, &din, &nin);
    if (st == KILN_OK && out && out != in) st = host_buffer(op, out, pg->world, &dout, &nout);
    if (st != KILN_OK) return st;
    if (out && out != in && out->dtype != in->dtype)
        return kiln_error(KILN_ERR_DTYPE, "%s: in is %s, out %s", op, kiln_dtype_name(in->dtype), kiln_dtype_name(out->dtype));
    kiln_status st0;
    if ((st0 = kiln__pg_check_counts(pg, s, nin, nout)) != KILN_OK) return st0;
    if (pg->tcp)
        return kiln__pg_staged(pg, s, din, dout ? dout : din, nin, dout ? nout : nin, in ? in->dtype : KILN_DTYPE_F32, w);
    s->count = (uint64_t)nin;
    s->dtype = s->op == OP_BARRIER ? 0 : (uint32_t)in->dtype;
    kiln__pg_record(pg, s);
    w->s = *s;
    if (!pg->mpi) { /* one rank: the data is already where it goes (on whichever device) */
        if (dout && dout != din)
            st = kiln__copy_across(out->st->be, dout, in->st->be, din, (size_t)nin * kiln_dtype_size(in->dtype));
        w->done = true;
        return st;
    }
#ifdef KILN_HAVE_MPI
    if (pg->debug && (st = kiln__pg_check_sig(pg, s)) != KILN_OK) return st;
    return kiln__pg_mpi_post(pg, s, din, dout, nin, nout, in ? in->dtype : KILN_DTYPE_F32, &w->req);
#else
    return KILN_OK;
#endif
}

/* Waits for w. On a group that an earlier collective broke it fails at once rather than
 * waiting out another deadline; a request that did not complete stays posted (w->done
 * stays false, pg->left is set), and MPI may still write its buffers. */
static kiln_status finish(struct kiln_pg_work *w)
{
    kiln_status st = KILN_OK;
#ifdef KILN_HAVE_MPI
    if (!w->done && w->pg->broken) {
        char what[160];
        kiln__pg_sig_str(&w->s, what, sizeof what);
        w->pg->left = true;
        return kiln_error(KILN_ERR_DIST, "process group: an earlier collective failed on rank %d; %s is left unfinished",
                          w->pg->rank, what);
    }
    if (!w->done && (st = kiln__pg_mpi_wait(w->pg, &w->req, &w->s)) != KILN_OK) return st;
#endif
    w->done = true;
    if (w->avg && w->pg->world > 1) st = kiln_mul_scalar_(w->t, 1.0 / w->pg->world);
    return st;
}

/* A blocking collective: start and finish under the lock. */
static kiln_status run(kiln_pg_t *pg, sig s, kiln_tensor_t *in, kiln_tensor_t *out)
{
    struct kiln_pg_work w;
    pthread_mutex_lock(&pg->mu);
    double t0 = kiln__now_s();
    kiln_status st = start(pg, &s, in, out, &w);
    if (st == KILN_OK) st = finish(&w);
    pg->secs[s.op] += kiln__now_s() - t0;
    pg->calls[s.op]++;
    pthread_mutex_unlock(&pg->mu);
    return st;
}

/* The arguments of collective s from the entry point name, as every entry point checks
 * them: a group, the tensors the op takes (in and out distinct), a known reduce op, a
 * root in the group. */
static kiln_status check_args(const char *name, kiln_pg_t *pg, const sig *s, kiln_tensor_t *in, kiln_tensor_t *out)
{
    bool two = s->op == OP_ALLGATHER || s->op == OP_REDUCE_SCATTER, barrier = s->op == OP_BARRIER;
    if (!pg || (!barrier && !in) || (two && !out))
        return kiln_error(KILN_ERR_ARG, "%s: NULL group%s", name, barrier ? "" : " or tensor");
    if (two && in == out) return kiln_error(KILN_ERR_ARG, "%s: in and out must be different tensors", name);
    if ((s->op == OP_ALLREDUCE || s->op == OP_REDUCE_SCATTER) && s->reduce != KILN_REDUCE_SUM &&
        s->reduce != KILN_REDUCE_AVG)
        return kiln_error(KILN_ERR_ARG, "%s: unknown reduce op %d", name, (int)s->reduce);
    if (s->op == OP_BROADCAST && ((int)s->reduce < 0 || (int)s->reduce >= pg->world))
        return kiln_error(KILN_ERR_ARG, "%s: root %d outside the group", name, (int)s->reduce);
    return KILN_OK;
}

/* In place; a strided tensor (a gradient that a graph left as a view) through a
 * contiguous copy. */
static kiln_status allreduce_now(void *group, kiln_tensor_t *t, int op)
{
    kiln_scope_begin();
    kiln_tensor_t *c = kiln__is_contiguous(t) ? t : kiln_contiguous(t);
    kiln_status s = c ? run(group, (sig){0, 0, OP_ALLREDUCE, 0, (uint32_t)op, 0}, c, NULL) : kiln_last_status();
    if (s == KILN_OK && c != t) s = kiln_tensor_copy_(t, c);
    kiln_scope_end();
    return s;
}

/* The entries a compiled program overlaps it through: a strided tensor runs to the end
 * at once (through its contiguous copy), a contiguous one is started. */
static kiln_status allreduce_start(void *group, kiln_tensor_t *t, int op, void **work)
{
    *work = NULL;
    if (!kiln__is_contiguous(t)) return allreduce_now(group, t, op);
    kiln_pg_work_t *w;
    kiln_status s = kiln_pg_allreduce_async(group, t, (kiln_reduce_op)op, &w);
    if (s == KILN_OK) *work = w;
    return s;
}

static kiln_status work_progress(void *w)
{
    bool done;
    return kiln_pg_work_test(w, &done);
}

static kiln_status work_finish(void *work, bool *posted)
{
    struct kiln_pg_work *w = work;
    pthread_mutex_lock(&w->pg->mu);
    kiln_status st = finish(w);
    *posted = !w->done;
    pthread_mutex_unlock(&w->pg->mu);
    free(w);
    return st;
}

static const kiln__collective_ops allreduce_ops = {allreduce_now, allreduce_start, work_progress, work_finish};

kiln_status kiln_pg_allreduce(kiln_pg_t *pg, kiln_tensor_t *t, kiln_reduce_op op)
{
    kiln_status st = check_args("allreduce", pg, &(sig){0, 0, OP_ALLREDUCE, 0, (uint32_t)op, 0}, t, NULL);
    if (st != KILN_OK) return st;
    if (kiln_graph_capturing()) { /* recorded: the graph runs it in its place, through allreduce_ops */
        kiln__attrs a = {0};
        a.op.collective = (kiln__collective_attrs){.group = pg, .ops = &allreduce_ops, .reduce = op};
        return kiln__dispatch(KILN_OP_ALLREDUCE_, &t, 1, &a, NULL);
    }
    return allreduce_now(pg, t, op);
}

/* A blocking collective that a graph does not record: refused while capturing, saying why. */
static kiln_status run_uncaptured(const char *name, kiln_pg_t *pg, sig s, kiln_tensor_t *t, const char *why)
{
    kiln_status st = check_args(name, pg, &s, t, NULL);
    if (st != KILN_OK) return st;
    if (kiln_graph_capturing()) return kiln_error(KILN_ERR_UNSUPPORTED, "%s inside a graph capture: %s", name, why);
    return run(pg, s, t, NULL);
}

kiln_status kiln_pg_broadcast(kiln_pg_t *pg, kiln_tensor_t *t, int root)
{
    return run_uncaptured("broadcast", pg, (sig){0, 0, OP_BROADCAST, 0, (uint32_t)root, 0}, t,
                          "of the collectives only allreduce, reduce_scatter and allgather are recorded; broadcast "
                          "outside the captured function");
}

kiln_status kiln_pg_barrier(kiln_pg_t *pg)
{
    return run_uncaptured("barrier", pg, (sig){0, 0, OP_BARRIER, 0, 0, 0}, NULL,
                          "it would run once, while capturing, and never in the graph's runs; call it outside the "
                          "captured function");
}

static kiln_status allgather_now(void *group, kiln_tensor_t *out, kiln_tensor_t *in, int op)
{
    (void)op;
    return run(group, (sig){0, 0, OP_ALLGATHER, 0, 0, 0}, in, out);
}

static kiln_status reduce_scatter_now(void *group, kiln_tensor_t *out, kiln_tensor_t *in, int op)
{
    return run(group, (sig){0, 0, OP_REDUCE_SCATTER, 0, (uint32_t)op, 0}, in, out);
}

/* While capturing, a collective from in into out is recorded (out updated in place),
 * whether the tensors are the graph's values or real ones it captured (ZeRO-1's flat
 * buffers and shards); the graph runs it in its place. */
static kiln_status record2(kiln_pg_t *pg, kiln__op_id op, kiln__collective2_fn fn, kiln_tensor_t *out,
                           kiln_tensor_t *in, int reduce)
{
    kiln__attrs a = {0};
    a.op.collective = (kiln__collective_attrs){.group = pg, .ops = (const void *)(uintptr_t)fn, .reduce = reduce};
    kiln_tensor_t *ts[2] = {out, in};
    return kiln__dispatch(op, ts, 2, &a, NULL);
}

kiln_status kiln_pg_allgather(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out)
{
    kiln_status st = check_args("allgather", pg, &(sig){0, 0, OP_ALLGATHER, 0, 0, 0}, in, out);
    if (st != KILN_OK) return st;
    if (kiln_graph_capturing()) return record2(pg, KILN_OP_ALLGATHER_, allgather_now, out, in, 0);
    return allgather_now(pg, out, in, 0);
}

kiln_status kiln_pg_reduce_scatter(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out, kiln_reduce_op op)
{
    kiln_status st = check_args("reduce_scatter", pg, &(sig){0, 0, OP_REDUCE_SCATTER, 0, (uint32_t)op, 0}, in, out);
    if (st != KILN_OK) return st;
    if (kiln_graph_capturing()) return record2(pg, KILN_OP_REDUCE_SCATTER_, reduce_scatter_now, out, in, op);
    return reduce_scatter_now(pg, out, in, op);
}

/* A collective started now, its work handed out: finished by kiln_pg_work_wait. */
static kiln_status start_async(const char *name, kiln_pg_t *pg, sig s, kiln_tensor_t *in, kiln_tensor_t *out,
                               kiln_pg_work_t **work)
{
    if (!work) return kiln_error(KILN_ERR_ARG, "%s: work is NULL", name);
    *work = NULL;
    kiln_status st = check_args(name, pg, &s, in, out);
    if (st != KILN_OK) return st;
    kiln_pg_work_t *w = malloc(sizeof *w);
    if (!w) return kiln_error(KILN_ERR_OOM, "%s: out of memory", kiln__pg_op_names[s.op]);
    pthread_mutex_lock(&pg->mu);
    st = start(pg, &s, in, out, w);
    pthread_mutex_unlock(&pg->mu);
    if (st != KILN_OK) {
        free(w);
        return st;
    }
    *work = w;
    return KILN_OK;
}

kiln_status kiln_pg_allreduce_async(kiln_pg_t *pg, kiln_tensor_t *t, kiln_reduce_op op, kiln_pg_work_t **work)
{
    return start_async("allreduce_async", pg, (sig){0, 0, OP_ALLREDUCE, 0, op, 0}, t, NULL, work);
}

kiln_status kiln_pg_broadcast_async(kiln_pg_t *pg, kiln_tensor_t *t, int root, kiln_pg_work_t **work)
{
    return start_async("broadcast_async", pg, (sig){0, 0, OP_BROADCAST, 0, (uint32_t)root, 0}, t, NULL, work);
}

kiln_status kiln_pg_barrier_async(kiln_pg_t *pg, kiln_pg_work_t **work)
{
    return start_async("barrier_async", pg, (sig){0, 0, OP_BARRIER, 0, 0, 0}, NULL, NULL, work);
}

kiln_status kiln_pg_allgather_async(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out, kiln_pg_work_t **work)
{
    return start_async("allgather_async", pg, (sig){0, 0, OP_ALLGATHER, 0, 0, 0}, in, out, work);
}

kiln_status kiln_pg_reduce_scatter_async(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out, kiln_reduce_op op,
                                         kiln_pg_work_t **work)
{
    return start_async("reduce_scatter_async", pg, (sig){0, 0, OP_REDUCE_SCATTER, 0, op, 0}, in, out, work);
}

kiln_status kiln_pg_work_test(kiln_pg_work_t *w, bool *done)
{
    if (!w || !done) return kiln_error(KILN_ERR_ARG, "work_test: NULL work or done");
    *done = w->done;
#ifdef KILN_HAVE_MPI
    if (!w->done) {
        kiln_status st = kiln__pg_mpi_test(w, done);
        if (st != KILN_OK) return st;
        if (*done) {
            w->done = true;
            st = w->avg ? kiln_mul_scalar_(w->t, 1.0 / w->pg->world) : KILN_OK;
            w->avg = false;
            if (st != KILN_OK) return st;
        }
    }
#endif
    return KILN_OK;
}

kiln_status kiln_pg_work_wait(kiln_pg_work_t *w)
{
    if (!w) return kiln_error(KILN_ERR_ARG, "work_wait: NULL work");
    kiln_pg_t *pg = w->pg;
    pthread_mutex_lock(&pg->mu);
    kiln_status st = finish(w);
    pthread_mutex_unlock(&pg->mu);
    free(w);
    return st;
}

/* ---- all-to-all: the rows of expert parallelism ---- */

/* What every rank holds after the first phase: rank s's row all[s (W + 1) ..] is the
 * rows it sends each rank d, then its out_rows; or -1 in each entry when its own counts
 * were bad (so that every rank fails together, naming it, instead of the others waiting
 * out a deadline in a second phase it never joins). */
static kiln_status check_matrix(const kiln_pg_t *pg, const int64_t *all, int64_t width)
{
    int W = pg->world;
    for (int s = 0; s < W; s++)
        if (all[(int64_t)s * (W + 1)] < 0)
            return kiln_error(KILN_ERR_ARG, "all_to_all: rank %d's send counts are negative or add up to more than its "
                              "rows of x (its own error says which)", s);
    /* each count is at most its rank's rows of x (checked there), so these sums do not
     * overflow; MPI counts elements in an int, which every rank checks for every rank */
    for (int d = 0; d < W; d++) {
        int64_t in = 0, out = 0, rows = all[(int64_t)d * (W + 1) + W];
        for (int s = 0; s < W; s++) in += all[(int64_t)s * (W + 1) + d], out += all[(int64_t)d * (W + 1) + s];
        if (in > rows)
            return kiln_error(KILN_ERR_SHAPE, "all_to_all: rank %d would receive %lld rows, more than its out_rows %lld; "
                              "out_rows must bound what the rank receives (world x the most rows a rank sends, at most)",
                              d, (long long)in, (long long)rows);
        if ((in > out ? in : out) > 2147483647 / (width ? width : 1))
            return kiln_error(KILN_ERR_ARG, "all_to_all: rank %d moves %lld rows of %lld elements, over MPI's int count",
                              d, (long long)(in > out ? in : out), (long long)width);
    }
    return KILN_OK;
}

#ifdef KILN_HAVE_MPI
/* Rows as MPI's int counts and displacements of elements (check_matrix has checked that
 * every rank's totals fit an int). */
static void mpi_counts(const int64_t *rowsof, int W, int64_t width, int *count, int *displ)
{
    for (int r = 0, at = 0; r < W; at += count[r++]) {
        count[r] = (int)(rowsof[r] * width);
        displ[r] = at;
    }
}
#endif

/* Runs the exchange (kiln__all_to_all_fn), under the group's lock: the counts first (an
 * allgather of every rank's, outside the numbering, so that every rank checks the whole
 * matrix), then the rows (MPI_Ialltoallv against the deadline); the rows after the
 * received ones zeroed. One process copies its own rows. */
static kiln_status all_to_all_run(void *group, kiln_tensor_t *x, kiln_tensor_t *sc, kiln_tensor_t *y, kiln_tensor_t *rc)
{
    kiln_pg_t *pg = group;
    int W = pg->world;
    int64_t R = x->shape[0], rows = y->shape[0], xn = kiln_tensor_numel(x), yn = kiln_tensor_numel(y);
    int64_t width = R ? xn / R : rows ? yn / rows : 0;
    size_t es = kiln_dtype_size(x->dtype), isz = kiln_dtype_size(sc->dtype);
    if (pg->broken)
        return kiln_error(KILN_ERR_DIST, "process group: an earlier collective failed on rank %d; the group cannot be used",
                          pg->rank);
    if (pg->tcp)
        return kiln_error(KILN_ERR_UNSUPPORTED, "all_to_all: this group was formed over the TCP rendezvous, whose "
                          "collectives run through NCCL, and kiln has no NCCL all-to-all yet; launch with mpirun");
    if (x->st->be != kiln__backend_at(0) || sc->st->be != kiln__backend_at(0))
        return kiln_error(KILN_ERR_INTERNAL, "all_to_all: the kernel was handed device memory");
    int64_t *all = malloc(sizeof *all * ((size_t)W * (size_t)(W + 1) + 2 * (size_t)W)), *send = all + (int64_t)W * (W + 1);
    int *cnt = malloc(sizeof *cnt * 4 * (size_t)W);
    if (!all || !cnt) {
        KILN__FREE(all, cnt);
        return kiln_error(KILN_ERR_OOM, "all_to_all: out of memory for %d ranks' counts", W);
    }
    int64_t *recv = send + W, total = 0;
    kiln_status st = KILN_OK, mine = KILN_OK; /* mine: this rank's counts, which the others learn of */
    for (int d = 0; d < W; d++) send[d] = kiln__load_index((const char *)kiln__data(sc) + (size_t)d * isz, sc->dtype);
    for (int d = 0; d < W && mine == KILN_OK; d++) {
        if (send[d] < 0 || send[d] > R) /* (each at most R: the sum cannot overflow) */
            mine = kiln_error(KILN_ERR_ARG, "all_to_all: send_counts[%d] = %lld is negative or more than x's %lld rows",
                              d, (long long)send[d], (long long)R);
        total += send[d];
    }
    if (mine == KILN_OK && total > R)
        mine = kiln_error(KILN_ERR_ARG, "all_to_all: send_counts add up to %lld rows, x has %lld", (long long)total,
                          (long long)R);
    char why[256] = "";
    if (mine != KILN_OK) snprintf(why, sizeof why, "%s", kiln_last_error());
    pthread_mutex_lock(&pg->mu);
    double t0 = kiln__now_s();
    /* signed by the row: the out_rows of the ranks may differ, each its own receipt's */
    sig s = {0, (uint64_t)width, OP_ALL_TO_ALL, (uint32_t)x->dtype, 0, 0};
    kiln__pg_record(pg, &s);
    if (!pg->mpi) {
        memcpy(all, send, sizeof *all * (size_t)W);
        all[W] = rows;
        if (mine != KILN_OK) all[0] = -1;
    }
#ifdef KILN_HAVE_MPI
    else {
        uint64_t *u = malloc(sizeof *u * (size_t)(W + 1));
        if (!u) st = kiln_error(KILN_ERR_OOM, "all_to_all: out of memory");
        for (int d = 0; u && d < W; d++) u[d] = mine == KILN_OK ? (uint64_t)send[d] : (uint64_t)-1;
        if (u) u[W] = (uint64_t)rows;
        if (pg->debug && st == KILN_OK) st = kiln__pg_check_sig(pg, &s);
        if (st == KILN_OK) st = kiln__pg_mpi_allgather_u64(pg, u, W + 1, (uint64_t *)all, &s);
        if (!pg->left) free(u); /* (else still posted: MPI may yet read it) */
    }
#endif
    if (st == KILN_OK && mine != KILN_OK) st = kiln_error(mine, "%s", why);
    else if (st == KILN_OK) st = check_matrix(pg, all, width);
    int64_t got = 0;
    for (int r = 0; r < W; r++) got += recv[r] = all[(int64_t)r * (W + 1) + pg->rank];
    if (st == KILN_OK && !pg->mpi) memcpy(kiln__data(y), kiln__data(x), (size_t)(send[0] * width) * es);
#ifdef KILN_HAVE_MPI
    if (st == KILN_OK && pg->mpi) {
        mpi_counts(send, W, width, cnt, cnt + W);
        mpi_counts(recv, W, width, cnt + 2 * W, cnt + 3 * W);
        st = kiln__pg_mpi_alltoallv(pg, &s, kiln__data(x), cnt, cnt + W, kiln__data(y), cnt + 2 * W, cnt + 3 * W,
                                    x->dtype);
    }
#endif
    pg->secs[OP_ALL_TO_ALL] += kiln__now_s() - t0;
    pg->calls[OP_ALL_TO_ALL]++;
    bool left = pg->left;
    pthread_mutex_unlock(&pg->mu);
    if (st == KILN_OK) {
        memset((char *)kiln__data(y) + (size_t)(got * width) * es, 0, (size_t)((rows - got) * width) * es);
        memcpy(kiln__data(rc), recv, sizeof *recv * (size_t)W);
    }
    if (left) { /* a request left posted (a timeout): MPI may still read and write these, so they stay */
        kiln_tensor_retain(x);
        kiln_tensor_retain(y);
        return st;
    }
    KILN__FREE(all, cnt);
    return st;
}

kiln_status kiln_pg_all_to_all(kiln_pg_t *pg, kiln_tensor_t *x, kiln_tensor_t *send_counts, int64_t out_rows,
                               kiln_tensor_t **y, kiln_tensor_t **recv_counts)
{
    if (!y || !recv_counts) return kiln_error(KILN_ERR_ARG, "all_to_all: NULL output pointer");
    *y = *recv_counts = NULL;
    if (!pg || !x || !send_counts) return kiln_error(KILN_ERR_ARG, "all_to_all: NULL group or tensor");
    if (out_rows < 0 || out_rows > UINT32_MAX)
        return kiln_error(KILN_ERR_ARG, "all_to_all: out_rows %lld is outside 0..2^32-1", (long long)out_rows);
    kiln__attrs a = {0};
    a.op.collective = (kiln__collective_attrs){.group = pg, .ops = (const void *)(uintptr_t)all_to_all_run,
                                              .world = pg->world, .rows = out_rows};
    kiln_tensor_t *in[2] = {x, send_counts}, *out[KILN__MAX_OUT] = {0};
    kiln_status s = kiln__dispatch(KILN_OP_ALL_TO_ALL, in, 2, &a, out);
    if (s != KILN_OK) return s;
    *y = kiln__scoped(out[0]);
    *recv_counts = kiln__scoped(out[1]);
    return *y && *recv_counts ? KILN_OK : kiln_last_status();
}

kiln_status kiln_pg_time_in(kiln_pg_t *pg, const char *op, uint64_t *calls, double *seconds)
{
    if (!pg || !op) return kiln_error(KILN_ERR_ARG, "pg_time_in: NULL group or op");
    for (int k = 1; k < OP_COUNT; k++)
        if (!strcmp(op, kiln__pg_op_names[k])) {
            pthread_mutex_lock(&pg->mu);
            if (calls) *calls = pg->calls[k];
            if (seconds) *seconds = pg->secs[k];
            pthread_mutex_unlock(&pg->mu);
            return KILN_OK;
        }
    return kiln_error(KILN_ERR_ARG, "pg_time_in: unknown collective '%s' (allreduce, broadcast, barrier, allgather, "
                      "reduce_scatter, all_to_all)", op);
}
