/* Process groups. One process is the world_size = 1 group, whose collectives change
 * nothing but still count; several processes launched by mpirun or srun form an MPI
 * group (Open MPI from Debian), whose collectives are MPI's on host buffers. Open MPI
 * because it is the well-kept, packaged implementation of the standard that every
 * cluster launcher speaks; kiln adds what MPI leaves out, not another transport:
 *
 * - every collective has a sequence number and a signature (op, dtype, count, reduce
 *   op, tag); a running hash of the signatures is compared across ranks once per step
 *   (kiln_pg_check_step), and before every collective with KILN_DIST_DEBUG=1, so that
 *   collectives issued in different orders are an error that names each rank's
 *   signature rather than a hang or a silently wrong sum;
 * - every collective runs as MPI's nonblocking form polled against a deadline
 *   (KILN_DIST_TIMEOUT seconds, default 300); at the deadline the rank writes its ring
 *   buffer of recent collectives to a file, asks the other ranks where they are (over
 *   a second communicator that a rank waiting in a collective keeps answering), and
 *   fails with an error that names the ranks that lag or do not answer.
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
#include <unistd.h>
#include "core/tensor_impl.h"
#include "core/cache.h"
#include "core/env.h"
#include "core/opts.h"
#include "core/util.h"
#include "dist/nccl.h"
#include "kiln/graph.h"
#include "ops/registry.h"
#include "kiln/dist.h"
#include "kiln/ops.h"
#ifdef KILN_HAVE_MPI
#include <mpi.h>
#endif

enum { OP_ALLREDUCE = 1, OP_BROADCAST, OP_BARRIER, OP_ALLGATHER, OP_REDUCE_SCATTER, OP_COUNT };
static const char *const op_names[OP_COUNT] = {"?", "allreduce", "broadcast", "barrier", "allgather", "reduce_scatter"};

/* What a collective is, as every rank must agree on it. */
typedef struct {
    uint64_t seq, count;
    uint32_t op, dtype, reduce, tag; /* reduce: kiln_reduce_op, or the root of a broadcast */
} sig;

#define RING 64

struct kiln_pg {
    int rank, world;
    uint64_t seq, hash;
    bool mpi, mpi_started, debug;
    bool broken; /* a collective failed or ran out of order: the group takes no more */
    bool left;   /* and a request was left posted: MPI_Finalize would wait for it */
    double timeout;
    pthread_mutex_t mu; /* one collective at a time in this process */
    sig ring[RING];
    double ring_t[RING];
#ifdef KILN_HAVE_MPI
    MPI_Comm comm, mon; /* collectives; the where-are-you queries at a deadline */
#endif
    void *nccl;             /* the NCCL communicator, made on the first collective on a cuda tensor */
    kiln__backend *nccl_be; /* its device */
    bool tcp;               /* formed by the TCP rendezvous: every collective goes through NCCL */
    unsigned char nccl_id[KILN__NCCL_ID_BYTES]; /* rank 0's, as the rendezvous carried it */
};

struct kiln_pg_work {
    kiln_pg_t *pg;
    sig s;
    kiln_tensor_t *t; /* scaled after the sum, for an average */
    bool avg, done;
    kiln_status status;
#ifdef KILN_HAVE_MPI
    MPI_Request req;
#endif
};

/* A count from the environment: kiln's own variable (id; -1 for none) when set, else the
 * first launcher variable of names that is set, else dflt. */
static int env_int(int id, const char *const *names, int dflt)
{
    if (id >= 0 && kiln__env_str((kiln__env_id)id)) return (int)kiln__env_int((kiln__env_id)id);
    for (int i = 0; names[i]; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) return atoi(v);
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

bool kiln_dist_mpi_version(char *buf, size_t n)
{
    if (!buf || !n) return false;
#ifdef KILN_HAVE_MPI
    char v[MPI_MAX_LIBRARY_VERSION_STRING] = "";
    int len = 0;
    MPI_Get_library_version(v, &len); /* may be called before MPI_Init */
    v[strcspn(v, ",\n")] = 0;
    snprintf(buf, n, "%s", v);
    return true;
#else
    *buf = 0;
    return false;
#endif
}

int kiln_pg_local_size_from_env(void)
{
    int n = env_int(KILN__ENV_LOCAL_WORLD_SIZE, local_vars, 1);
    return n >= 1 ? n : 1;
}

static uint64_t sig_hash(const sig *s)
{
    uint64_t kind = ((uint64_t)s->op << 48) ^ ((uint64_t)s->dtype << 40) ^ ((uint64_t)s->reduce << 32) ^ s->tag;
    return kiln__mix64(s->count ^ kiln__mix64(kind));
}

static void sig_str(const sig *s, char *buf, size_t n)
{
    const char *op = s->op < OP_COUNT ? op_names[s->op] : "?";
    if (s->op == OP_BARRIER) snprintf(buf, n, "#%llu barrier", (unsigned long long)s->seq);
    else if (s->op == OP_BROADCAST)
        snprintf(buf, n, "#%llu broadcast %s x %llu from rank %u", (unsigned long long)s->seq,
                 kiln_dtype_name((kiln_dtype)s->dtype), (unsigned long long)s->count, s->reduce);
    else
        snprintf(buf, n, "#%llu %s %s x %llu %s%s", (unsigned long long)s->seq, op, kiln_dtype_name((kiln_dtype)s->dtype),
                 (unsigned long long)s->count, s->op == OP_ALLGATHER ? "" : s->reduce == KILN_REDUCE_AVG ? "avg" : "sum",
                 s->tag ? " (tagged)" : "");
}

/* Under pg->mu: numbers the collective and folds it into the step hash and the ring. */
static void record(kiln_pg_t *pg, sig *s)
{
    s->seq = ++pg->seq;
    pg->hash = kiln__mix64(pg->hash ^ sig_hash(s));
    pg->ring[s->seq % RING] = *s;
    pg->ring_t[s->seq % RING] = kiln__now_s();
}

/* The ring buffer of recent collectives, to DIR/kiln-dist-rank<R>.txt (KILN_DIST_DUMP_DIR,
 * default the working directory), the one waited for marked (`waiting`, its sequence
 * number: several may be in flight); path gets the file's name. */
static void dump_ring(kiln_pg_t *pg, uint64_t waiting, char *path, size_t n)
{
    const char *dir = kiln__env_text(KILN__ENV_DIST_DUMP_DIR);
    snprintf(path, n, "%s/kiln-dist-rank%d.txt", dir, pg->rank);
    FILE *f = fopen(path, "w");
    if (!f) {
        snprintf(path, n, "(not written: %s)", dir);
        return;
    }
    fprintf(f, "rank %d of %d: the last collectives, oldest first (t = seconds since the first listed)\n", pg->rank,
            pg->world);
    uint64_t first = pg->seq > RING ? pg->seq - RING + 1 : 1;
    double t0 = pg->ring_t[first % RING];
    for (uint64_t q = first; q <= pg->seq; q++) {
        char w[160];
        sig_str(&pg->ring[q % RING], w, sizeof w);
        fprintf(f, "%10.6f  %s%s\n", pg->ring_t[q % RING] - t0, w, q == waiting ? "   <- waiting here" : "");
    }
    fclose(f);
}

#ifdef KILN_HAVE_MPI
enum { TAG_QUERY = 7001, TAG_ANSWER = 7002 };

static kiln_status mpi_fail(kiln_pg_t *pg, const sig *s, int code)
{
    char msg[MPI_MAX_ERROR_STRING] = "", what[160];
    int len = 0;
    MPI_Error_string(code, msg, &len);
    sig_str(s, what, sizeof what);
    pg->broken = pg->left = true;
    return kiln_error(KILN_ERR_DIST, "collective %s failed on rank %d of %d: %s", what, pg->rank, pg->world, msg);
}

/* Answers other ranks' where-are-you queries with this rank's current collective. */
static void serve_queries(kiln_pg_t *pg, const sig *cur)
{
    for (;;) {
        int flag = 0;
        MPI_Status st;
        MPI_Iprobe(MPI_ANY_SOURCE, TAG_QUERY, pg->mon, &flag, &st);
        if (!flag) return;
        int dummy;
        MPI_Recv(&dummy, 1, MPI_INT, st.MPI_SOURCE, TAG_QUERY, pg->mon, MPI_STATUS_IGNORE);
        uint64_t ans[6] = {cur->seq, cur->count, cur->op, cur->dtype, cur->reduce, cur->tag};
        MPI_Send(ans, 6, MPI_UINT64_T, st.MPI_SOURCE, TAG_ANSWER, pg->mon);
    }
}

/* At the deadline: where is everyone? One line per other rank into msg. */
static void ask_peers(kiln_pg_t *pg, const sig *cur, char *msg, size_t n)
{
    int q = 0;
    MPI_Request *reqs = calloc((size_t)pg->world, sizeof *reqs);
    uint64_t(*ans)[6] = calloc((size_t)pg->world, sizeof *ans);
    bool *got = calloc((size_t)pg->world, sizeof *got);
    if (!reqs || !ans || !got) {
        snprintf(msg, n, " (out of memory asking the other ranks)");
        free(reqs), free(ans), free(got);
        return;
    }
    for (int r = 0; r < pg->world; r++)
        if (r != pg->rank) {
            MPI_Send(&q, 1, MPI_INT, r, TAG_QUERY, pg->mon);
            MPI_Irecv(ans[r], 6, MPI_UINT64_T, r, TAG_ANSWER, pg->mon, &reqs[r]);
        } else {
            reqs[r] = MPI_REQUEST_NULL;
        }
    double until = kiln__now_s() + 2.0;
    while (kiln__now_s() < until) {
        serve_queries(pg, cur);
        bool all = true;
        for (int r = 0; r < pg->world; r++) {
            if (r == pg->rank || got[r]) continue;
            int flag = 0;
            MPI_Test(&reqs[r], &flag, MPI_STATUS_IGNORE);
            got[r] = flag;
            all &= got[r];
        }
        if (all) break;
        usleep(1000);
    }
    size_t used = 0;
    for (int r = 0; r < pg->world && used < n; r++) {
        if (r == pg->rank) continue;
        char w[160];
        if (got[r]) {
            sig s = {ans[r][0], ans[r][1], (uint32_t)ans[r][2], (uint32_t)ans[r][3], (uint32_t)ans[r][4], (uint32_t)ans[r][5]};
            sig_str(&s, w, sizeof w);
            used += (size_t)snprintf(msg + used, n - used, "; rank %d waits in %s%s", r, w,
                                     s.seq < cur->seq ? " (behind: it lags)" : s.seq > cur->seq ? " (ahead)" : "");
        } else {
            used += (size_t)snprintf(msg + used, n - used, "; rank %d did not answer in 2 s (it lags: busy outside a "
                                     "collective, stuck, or gone)", r);
            MPI_Cancel(&reqs[r]);
        }
    }
    free(reqs), free(ans), free(got);
}

/* Polls req until it completes or the deadline passes. */
static kiln_status wait_req(kiln_pg_t *pg, MPI_Request *req, const sig *s)
{
    double deadline = kiln__now_s() + pg->timeout;
    for (unsigned spins = 0;; spins++) {
        int flag = 0;
        int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(pg, s, rc);
        if (flag) return KILN_OK;
        if ((spins & 255) == 255) {
            serve_queries(pg, s);
            if (kiln__now_s() > deadline) {
                char path[512], who[2048] = "", what[160];
                dump_ring(pg, s->seq, path, sizeof path);
                ask_peers(pg, s, who, sizeof who);
                sig_str(s, what, sizeof what);
                pg->broken = pg->left = true; /* the request stays posted */
                return kiln_error(KILN_ERR_DIST, "collective timeout: rank %d of %d waited %g s (KILN_DIST_TIMEOUT) in %s%s; "
                                  "its recent collectives are in %s", pg->rank, pg->world, pg->timeout, what, who, path);
            }
            if (spins > 100000) usleep(50);
        }
    }
}

static kiln_status mpi_start(kiln_pg_t *pg, int want_world, int want_rank)
{
    int inited = 0, provided = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        if (MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
            return kiln_error(KILN_ERR_DIST, "process group: MPI_Init_thread failed (launched by mpirun?)");
        pg->mpi_started = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &pg->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &pg->world);
    if (pg->world != want_world || pg->rank != want_rank)
        return kiln_error(KILN_ERR_ARG, "process group: the launcher's environment says rank %d of %d, MPI says rank %d of %d",
                          want_rank, want_world, pg->rank, pg->world);
    MPI_Comm_dup(MPI_COMM_WORLD, &pg->comm);
    MPI_Comm_dup(MPI_COMM_WORLD, &pg->mon);
    MPI_Comm_set_errhandler(pg->comm, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(pg->mon, MPI_ERRORS_RETURN);
    pg->mpi = true;
    return KILN_OK;
}

static MPI_Datatype mpi_type(kiln_dtype dt) { return dt == KILN_DTYPE_F64 ? MPI_DOUBLE : MPI_FLOAT; }
#endif

static bool is_cuda(const kiln__backend *be) { return be && be->language && !strcmp(be->language, "cuda-c"); }

/* What each rank tells the others at the TCP rendezvous. */
typedef struct {
    char host[64];
    char why[160]; /* empty when this rank can run NCCL on a cuda device */
    unsigned char has_id, id[KILN__NCCL_ID_BYTES];
} tcp_hello;

/* Ranks started by a scheduler: the TCP rendezvous forms the group and carries rank 0's
 * NCCL unique id to the others; every collective then runs through NCCL on the rank's
 * cuda device (the current device when it is one, else the first), cpu tensors staged
 * through it. A rank without NCCL or a cuda device refuses the group for everyone, each
 * such rank named with its reason: collectives on cpu tensors need MPI. */
static kiln_status tcp_group(kiln_pg_t *pg)
{
    kiln_rdzv_opts o;
    kiln_status s = kiln_rdzv_opts_from_env(&o);
    if (s != KILN_OK) return s;
    tcp_hello me = {0}, *all = calloc((size_t)pg->world, sizeof me);
    if (!all) return kiln_error(KILN_ERR_OOM, "process group: out of memory");
    gethostname(me.host, sizeof me.host - 1);
    kiln__backend *be = kiln__backend_default();
    if (!is_cuda(be)) be = kiln__backend_find("cuda");
    if (!kiln__nccl_available()) snprintf(me.why, sizeof me.why, "no NCCL (%s)", kiln__nccl_status());
    else if (!is_cuda(be)) snprintf(me.why, sizeof me.why, "no cuda device (%s)", kiln_cuda_status());
    else if (!be->native_stream || !be->native_stream(be)) snprintf(me.why, sizeof me.why, "%s has no stream", be->name);
    /* Rank 0 draws the id even where it cannot use it: the id is only a bootstrap address,
     * and KILN_LOGS=dist shows every rank the one it got. */
    if (pg->rank == 0 && kiln__nccl_available()) {
        me.has_id = kiln__nccl_unique_id(me.id, sizeof me.id) == KILN_OK;
        if (!me.has_id && !me.why[0]) snprintf(me.why, sizeof me.why, "%s", kiln_last_error());
    }
    double secs = 0;
    s = kiln_rendezvous(&o, &me, sizeof me, all, &secs);
    if (s != KILN_OK) {
        free(all);
        return s;
    }
    if (all[0].has_id) {
        memcpy(pg->nccl_id, all[0].id, sizeof pg->nccl_id);
        if (kiln__log_on("dist"))
            fprintf(stderr, "kiln dist: rank %d: NCCL unique id from rank 0 (%s), hash %016llx\n", pg->rank,
                    all[0].host, (unsigned long long)kiln__fnv(KILN__FNV_SEED, all[0].id, sizeof all[0].id));
    }
    char why[2048] = "";
    size_t used = 0;
    for (int r = 0; r < pg->world && used < sizeof why; r++)
        if (all[r].why[0])
            used += (size_t)snprintf(why + used, sizeof why - used, "%s rank %d (%.63s): %.159s", used ? ";" : "", r,
                                     all[r].host, all[r].why);
    bool has_id = all[0].has_id;
    free(all);
    if (used)
        return kiln_error(KILN_ERR_UNSUPPORTED, "process group: %d ranks met over TCP at %s:%d in %.3f s, but a group "
                          "formed there runs its collectives through NCCL on a cuda device per rank, and not every rank has one:%s. "
                          "Collectives on cpu "
                          "tensors need MPI: launch with mpirun -np %d (or srun --mpi=pmix)", pg->world, o.addr, o.port,
                          secs, why, pg->world);
    if (!has_id) return kiln_error(KILN_ERR_DIST, "process group: rank 0 sent no NCCL unique id");
    if (kiln__log_on("dist"))
        fprintf(stderr, "kiln dist: rank %d of %d: group formed over TCP at %s:%d in %.3f s; collectives through NCCL on "
                "%s\n", pg->rank, pg->world, o.addr, o.port, secs, be->name);
    pg->tcp = true;
    pg->nccl_be = be;
    return KILN_OK;
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
        if (!launched_by_mpi && kiln__env_str(KILN__ENV_MASTER_ADDR)) s = tcp_group(pg);
#ifdef KILN_HAVE_MPI
        else if (launched_by_mpi) s = mpi_start(pg, world, rank);
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
    if (s != KILN_OK) {
        kiln_pg_free(pg);
        return s;
    }
    *out = pg;
    return KILN_OK;
}

void kiln_pg_free(kiln_pg_t *pg)
{
    if (!pg) return;
#ifdef KILN_HAVE_MPI
    /* A group left with a collective posted (a timeout, an order error) cannot be shut
     * down cleanly: MPI_Finalize would wait for it. The process exits with its error
     * and the launcher stops the others. */
    if (pg->mpi && !pg->left) {
        MPI_Comm_free(&pg->comm);
        MPI_Comm_free(&pg->mon);
    }
    if (pg->mpi_started && !pg->left) {
        int done = 0;
        MPI_Finalized(&done);
        if (!done) MPI_Finalize();
    }
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

/* The element counts a gathering or scattering collective needs: out = world x in, or
 * in = world x out. */
static kiln_status check_counts(const kiln_pg_t *pg, const sig *s, int64_t nin, int64_t nout)
{
    if (s->op == OP_ALLGATHER && nout != nin * pg->world)
        return kiln_error(KILN_ERR_SHAPE, "allgather: out holds %lld elements, not world %d x in %lld", (long long)nout,
                          pg->world, (long long)nin);
    if (s->op == OP_REDUCE_SCATTER && nin != nout * pg->world)
        return kiln_error(KILN_ERR_SHAPE, "reduce_scatter: in holds %lld elements, not world %d x out %lld", (long long)nin,
                          pg->world, (long long)nout);
    return KILN_OK;
}

/* The group's NCCL communicator on be, made on first use over rank 0's unique id: the
 * one the TCP rendezvous carried, else one broadcast with MPI together with whether rank
 * 0 got it (so that a failure there reaches the others instead of leaving them
 * waiting); one rank needs no channel. */
static kiln_status nccl_comm(kiln_pg_t *pg, kiln__backend *be, const char *op)
{
    if (pg->nccl) {
        if (be == pg->nccl_be) return KILN_OK;
        return kiln_error(KILN_ERR_DEVICE, "%s: the group's NCCL communicator is on %s, the tensor on %s (one device per "
                          "rank)", op, pg->nccl_be->name, be->name);
    }
    if (pg->tcp && be != pg->nccl_be)
        return kiln_error(KILN_ERR_DEVICE, "%s: the group formed over TCP on %s, the tensor is on %s (one device per rank)",
                          op, pg->nccl_be->name, be->name);
    if (pg->broken) /* an aborted communicator is not made again: rank 0's id is spent */
        return kiln_error(KILN_ERR_DIST, "%s: an earlier collective failed on rank %d; the group cannot be used", op,
                          pg->rank);
    unsigned char id[KILN__NCCL_ID_BYTES + 1] = {0};
    kiln_status st = KILN_OK;
    if (pg->tcp) {
        memcpy(id, pg->nccl_id, KILN__NCCL_ID_BYTES);
        id[KILN__NCCL_ID_BYTES] = 1;
    } else {
        if (pg->rank == 0) id[KILN__NCCL_ID_BYTES] = kiln__nccl_unique_id(id, KILN__NCCL_ID_BYTES) == KILN_OK;
        if (pg->world > 1) {
#ifdef KILN_HAVE_MPI
            if (!pg->mpi) st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: NCCL's id goes over MPI; launch with mpirun", op);
            else if (MPI_Bcast(id, sizeof id, MPI_BYTE, 0, pg->comm) != MPI_SUCCESS)
                st = kiln_error(KILN_ERR_DIST, "%s: rank %d: could not receive NCCL's id from rank 0", op, pg->rank);
#else
            st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: NCCL's id goes over MPI, and this kiln has none", op);
#endif
        }
        if (st == KILN_OK && !id[KILN__NCCL_ID_BYTES])
            st = pg->rank == 0 ? kiln_last_status()
                               : kiln_error(KILN_ERR_DIST, "%s: rank 0 could not make NCCL's unique id", op);
    }
    if (st == KILN_OK) st = kiln__nccl_comm_new(be, id, pg->world, pg->rank, &pg->nccl);
    if (st != KILN_OK) {
        pg->broken = pg->tcp; /* a TCP group has no other way to run collectives */
        return st;
    }
    pg->nccl_be = be;
    return KILN_OK;
}

/* One NCCL collective on the group's device buffers, waited for against the group's
 * deadline; what is the signature it runs under, for the messages. A failure breaks the
 * group (the communicator is aborted). */
static kiln_status nccl_run(kiln_pg_t *pg, const sig *what, int nop, const void *din, void *dout, size_t count,
                            kiln_dtype dt, int root)
{
    bool timed_out = false;
    kiln_status st = kiln__nccl_collective(&pg->nccl, pg->nccl_be, nop, din, dout, count, dt, root,
                                           kiln__now_s() + pg->timeout, &timed_out);
    if (st == KILN_OK) return st;
    pg->broken = true;
    char why[512], w[160], path[512];
    snprintf(why, sizeof why, "%s", kiln_last_error());
    sig_str(what, w, sizeof w);
    if (!timed_out) return kiln_error(KILN_ERR_DIST, "collective %s failed on rank %d of %d: %s", w, pg->rank, pg->world, why);
    dump_ring(pg, what->seq, path, sizeof path);
    return kiln_error(KILN_ERR_DIST, "collective timeout: rank %d of %d waited %g s (KILN_DIST_TIMEOUT) in %s on NCCL "
                      "(%s), which was aborted; a rank that lags or has gone is not named (NCCL has no side channel); its "
                      "recent collectives are in %s", pg->rank, pg->world, pg->timeout, w, pg->nccl_be->name, path);
}

static const int nccl_op[OP_COUNT] = {0, KILN__NCCL_ALLREDUCE, KILN__NCCL_BROADCAST, KILN__NCCL_ALLREDUCE,
                                      KILN__NCCL_ALLGATHER, KILN__NCCL_REDUCE_SCATTER};

static kiln_status check_sig(kiln_pg_t *pg, const sig *s);

/* A collective through NCCL on device buffers din/dout (nin and nout elements): numbered
 * and recorded as any other. A barrier is an allreduce of one float. */
static kiln_status nccl_post(kiln_pg_t *pg, sig *s, kiln__backend *be, const void *din, void *dout, int64_t nin,
                             int64_t nout, kiln_dtype dt)
{
    const char *op = op_names[s->op];
    kiln_status st = nccl_comm(pg, be, op);
    if (st != KILN_OK) return st;
    s->count = s->op == OP_BARRIER ? 0 : (uint64_t)nin;
    s->dtype = s->op == OP_BARRIER ? 0 : (uint32_t)dt;
    record(pg, s);
    if (pg->debug && (st = check_sig(pg, s)) != KILN_OK) return st;
    void *tmp = NULL;
    if (s->op == OP_BARRIER) {
        static const float zero = 0;
        if (!(tmp = be->alloc(be, sizeof zero))) return kiln_error(KILN_ERR_OOM, "barrier: out of memory on %s", be->name);
        if ((st = be->copy_h2d(be, tmp, &zero, sizeof zero)) != KILN_OK) {
            be->free(be, tmp, sizeof zero);
            return st;
        }
        din = dout = tmp;
        nin = nout = 1;
        dt = KILN_DTYPE_F32;
    }
    /* NCCL's count: what each rank sends for allgather, what each receives for
     * reduce_scatter, the whole buffer otherwise. */
    size_t count = (size_t)(s->op == OP_REDUCE_SCATTER ? nout : nin);
    st = nccl_run(pg, s, nccl_op[s->op], din, dout ? dout : (void *)din, count, dt, (int)s->reduce);
    if (tmp) be->free(be, tmp, sizeof(float));
    return st;
}

/* A collective on cuda tensors, through NCCL. */
static kiln_status nccl_start(kiln_pg_t *pg, sig *s, kiln_tensor_t *in, kiln_tensor_t *out, struct kiln_pg_work *w)
{
    const char *op = op_names[s->op];
    kiln__backend *be = in->st->be;
    if ((in->dtype != KILN_DTYPE_F32 && in->dtype != KILN_DTYPE_F64) || !kiln__is_contiguous(in) ||
        (out && (!kiln__is_contiguous(out) || out->dtype != in->dtype || out->st->be != be)))
        return kiln_error(KILN_ERR_ARG, "%s: NCCL takes contiguous f32/f64 tensors on one device", op);
    int64_t nin = kiln_tensor_numel(in), nout = out ? kiln_tensor_numel(out) : nin;
    kiln_status st;
    if ((st = check_counts(pg, s, nin, nout)) != KILN_OK) return st;
    if ((s->op == OP_ALLREDUCE || s->op == OP_BROADCAST) && out && nout != nin)
        return kiln_error(KILN_ERR_SHAPE, "%s: out holds %lld elements, in %lld", op, (long long)nout, (long long)nin);
    st = nccl_post(pg, s, be, kiln__data(in), out ? kiln__data(out) : NULL, nin, nout, in->dtype);
    w->s = *s;
    w->done = true;
    return st;
}

/* In a group formed over TCP, a collective on host buffers (cpu tensors, a barrier)
 * goes through the group's device: copied there, run by NCCL, copied back. */
static kiln_status staged(kiln_pg_t *pg, sig *s, const void *hin, void *hout, int64_t nin, int64_t nout, kiln_dtype dt,
                          struct kiln_pg_work *w)
{
    kiln__backend *be = pg->nccl_be;
    size_t es = kiln_dtype_size(dt), bin = (size_t)nin * es, bout = hout && hout != hin ? (size_t)nout * es : 0;
    char *d = bin + bout ? be->alloc(be, bin + bout) : NULL;
    if (bin + bout && !d) return kiln_error(KILN_ERR_OOM, "%s: out of memory on %s staging %zu bytes", op_names[s->op],
                                            be->name, bin + bout);
    kiln_status st = bin ? be->copy_h2d(be, d, hin, bin) : KILN_OK;
    if (st != KILN_OK) pg->broken = true; /* this rank cannot take part: the others would wait for it */
    if (st == KILN_OK) st = nccl_post(pg, s, be, d, bout ? d + bin : NULL, nin, nout, dt);
    if (st == KILN_OK && bout) st = be->copy_d2h(be, hout, d + bin, bout);
    else if (st == KILN_OK && bin && s->op != OP_BARRIER) st = be->copy_d2h(be, (void *)hin, d, bin);
    if (d) be->free(be, d, bin + bout);
    w->s = *s;
    w->done = true;
    return st;
}

/* k uint64 from every rank into all (world x k), in rank order, outside the numbering:
 * how the guards compare ranks. */
static kiln_status gather_u64(kiln_pg_t *pg, const uint64_t *mine, int k, uint64_t *all, const sig *chk)
{
    if (pg->tcp) {
        kiln__backend *be = pg->nccl_be;
        size_t b = sizeof(uint64_t) * (size_t)k, ball = b * (size_t)pg->world;
        kiln_status st = nccl_comm(pg, be, "collective check");
        char *d = st == KILN_OK ? be->alloc(be, b + ball) : NULL;
        if (st == KILN_OK && !d) st = kiln_error(KILN_ERR_OOM, "collective check: out of memory on %s", be->name);
        if (st == KILN_OK) st = be->copy_h2d(be, d, mine, b);
        if (st == KILN_OK) st = nccl_run(pg, chk, KILN__NCCL_ALLGATHER, d, d + b, (size_t)k, KILN_DTYPE_I64, 0);
        if (st == KILN_OK) st = be->copy_d2h(be, all, d + b, ball);
        if (d) be->free(be, d, b + ball);
        return st;
    }
#ifdef KILN_HAVE_MPI
    MPI_Request req;
    int rc = MPI_Iallgather(mine, k, MPI_UINT64_T, all, k, MPI_UINT64_T, pg->comm, &req);
    return rc == MPI_SUCCESS ? wait_req(pg, &req, chk) : mpi_fail(pg, chk, rc);
#else
    return kiln_error(KILN_ERR_INTERNAL, "collective check: no transport");
#endif
}

/* KILN_DIST_DEBUG: every rank shows the others the collective it is about to run. */
static kiln_status check_sig(kiln_pg_t *pg, const sig *s)
{
    uint64_t mine[6] = {s->seq, s->count, s->op, s->dtype, s->reduce, s->tag};
    uint64_t *all = malloc(sizeof(uint64_t) * 6 * (size_t)pg->world);
    if (!all) return kiln_error(KILN_ERR_OOM, "collective check: out of memory");
    sig chk = {s->seq, 6, OP_ALLGATHER, KILN_DTYPE_I64, 0, 0xc4ec};
    kiln_status st = gather_u64(pg, mine, 6, all, &chk);
    bool same = true;
    for (int r = 1; st == KILN_OK && r < pg->world; r++) same &= !memcmp(all, all + 6 * r, sizeof mine);
    if (st == KILN_OK && !same) {
        char msg[2048];
        size_t used = 0;
        for (int r = 0; r < pg->world && used < sizeof msg; r++) {
            uint64_t *a = all + 6 * r;
            sig o = {a[0], a[1], (uint32_t)a[2], (uint32_t)a[3], (uint32_t)a[4], (uint32_t)a[5]};
            char w[160];
            sig_str(&o, w, sizeof w);
            used += (size_t)snprintf(msg + used, sizeof msg - used, "%s rank %d: %s", r ? ";" : "", r, w);
        }
        pg->broken = true;
        st = kiln_error(KILN_ERR_DIST, "collectives issued in different orders on communicator world, at collective "
                        "#%llu:%s", (unsigned long long)s->seq, msg);
    }
    free(all);
    return st;
}


/* Starts a collective: checks, numbers it, and (with MPI) posts it; w gets the work. */
static kiln_status start(kiln_pg_t *pg, sig *s, kiln_tensor_t *in, kiln_tensor_t *out, struct kiln_pg_work *w)
{
    memset(w, 0, sizeof *w);
    w->pg = pg;
    if (pg->broken)
        return kiln_error(KILN_ERR_DIST, "process group: an earlier collective failed on rank %d; the group cannot be used",
                          pg->rank);
    if (s->op != OP_BARRIER && in && !in->st->meta && is_cuda(in->st->be) && kiln__nccl_available())
        return nccl_start(pg, s, in, out, w);
    void *din = NULL, *dout = NULL;
    int64_t nin = 0, nout = 0;
    kiln_status st = KILN_OK;
    const char *op = op_names[s->op];
    if (s->op != OP_BARRIER) st = host_buffer(op, in, pg->world, &din, &nin);
    if (st == KILN_OK && out && out != in) st = host_buffer(op, out, pg->world, &dout, &nout);
    if (st != KILN_OK) return st;
    if (out && out != in && out->dtype != in->dtype)
        return kiln_error(KILN_ERR_DTYPE, "%s: in is %s, out %s", op, kiln_dtype_name(in->dtype), kiln_dtype_name(out->dtype));
    kiln_status st0;
    if ((st0 = check_counts(pg, s, nin, nout)) != KILN_OK) return st0;
    if (pg->tcp) return staged(pg, s, din, dout ? dout : din, nin, dout ? nout : nin, in ? in->dtype : KILN_DTYPE_F32, w);
    s->count = (uint64_t)nin;
    s->dtype = s->op == OP_BARRIER ? 0 : (uint32_t)in->dtype;
    record(pg, s);
    w->s = *s;
    if (!pg->mpi) { /* one rank: the data is already where it goes (on whichever device) */
        if (dout && dout != din)
            st = kiln__copy_across(out->st->be, dout, in->st->be, din, (size_t)nin * kiln_dtype_size(in->dtype));
        w->done = true;
        return st;
    }
#ifdef KILN_HAVE_MPI
    if (pg->debug && (st = check_sig(pg, s)) != KILN_OK) return st;
    int rc = MPI_SUCCESS;
    MPI_Datatype ty = s->op == OP_BARRIER ? MPI_BYTE : mpi_type(in->dtype);
    switch (s->op) {
    case OP_ALLREDUCE: rc = MPI_Iallreduce(MPI_IN_PLACE, din, (int)nin, ty, MPI_SUM, pg->comm, &w->req); break;
    case OP_BROADCAST: rc = MPI_Ibcast(din, (int)nin, ty, (int)s->reduce, pg->comm, &w->req); break;
    case OP_BARRIER: rc = MPI_Ibarrier(pg->comm, &w->req); break;
    case OP_ALLGATHER: rc = MPI_Iallgather(din, (int)nin, ty, dout, (int)nin, ty, pg->comm, &w->req); break;
    case OP_REDUCE_SCATTER:
        rc = MPI_Ireduce_scatter_block(din, dout, (int)nout, ty, MPI_SUM, pg->comm, &w->req);
        break;
    }
    if (rc != MPI_SUCCESS) return mpi_fail(pg, s, rc);
#endif
    return KILN_OK;
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
        sig_str(&w->s, what, sizeof what);
        w->pg->left = true;
        return kiln_error(KILN_ERR_DIST, "process group: an earlier collective failed on rank %d; %s is left unfinished",
                          w->pg->rank, what);
    }
    if (!w->done && (st = wait_req(w->pg, &w->req, &w->s)) != KILN_OK) return st;
#endif
    w->done = true;
    if (w->avg && w->pg->world > 1) st = kiln_mul_scalar_(w->t, 1.0 / w->pg->world);
    return st;
}

/* A blocking collective: start and finish under the lock. */
static kiln_status run(kiln_pg_t *pg, sig s, kiln_tensor_t *in, kiln_tensor_t *out, kiln_tensor_t *avg_of)
{
    struct kiln_pg_work w;
    pthread_mutex_lock(&pg->mu);
    kiln_status st = start(pg, &s, in, out, &w);
    if (st == KILN_OK) {
        w.t = avg_of;
        w.avg = avg_of != NULL;
        st = finish(&w);
    }
    pthread_mutex_unlock(&pg->mu);
    return st;
}

static kiln_status check_reduce(const char *op, kiln_reduce_op r)
{
    return r == KILN_REDUCE_SUM || r == KILN_REDUCE_AVG ? KILN_OK : kiln_error(KILN_ERR_ARG, "%s: unknown reduce op %d", op, r);
}

/* In place; a strided tensor (a gradient that a graph left as a view) through a
 * contiguous copy. */
static kiln_status allreduce_now(void *group, kiln_tensor_t *t, int op)
{
    kiln_scope_begin();
    kiln_tensor_t *c = kiln__is_contiguous(t) ? t : kiln_contiguous(t);
    kiln_status s = c ? run(group, (sig){0, 0, OP_ALLREDUCE, 0, (uint32_t)op, 0}, c, NULL, op == KILN_REDUCE_AVG ? c : NULL)
                      : kiln_last_status();
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
    if (!pg || !t) return kiln_error(KILN_ERR_ARG, "allreduce: NULL group or tensor");
    if (check_reduce("allreduce", op) != KILN_OK) return kiln_last_status();
    if (kiln_graph_capturing()) { /* recorded: the graph runs it in its place, through allreduce_ops */
        kiln__attrs a = {0};
        a.u[0] = (uint64_t)(uintptr_t)pg;
        a.u[1] = (uint64_t)(uintptr_t)&allreduce_ops;
        a.i[0] = op;
        return kiln__dispatch(KILN_OP_ALLREDUCE_, &t, 1, &a, NULL);
    }
    return allreduce_now(pg, t, op);
}

kiln_status kiln_pg_broadcast(kiln_pg_t *pg, kiln_tensor_t *t, int root)
{
    if (!pg || !t) return kiln_error(KILN_ERR_ARG, "broadcast: NULL group or tensor");
    if (root < 0 || root >= pg->world) return kiln_error(KILN_ERR_ARG, "broadcast: root %d outside the group", root);
    if (kiln_graph_capturing())
        return kiln_error(KILN_ERR_UNSUPPORTED, "broadcast inside a graph capture: of the collectives only allreduce, "
                          "reduce_scatter and allgather are recorded; broadcast outside the captured function");
    return run(pg, (sig){0, 0, OP_BROADCAST, 0, (uint32_t)root, 0}, t, NULL, NULL);
}

kiln_status kiln_pg_barrier(kiln_pg_t *pg)
{
    if (!pg) return kiln_error(KILN_ERR_ARG, "barrier: NULL group");
    if (kiln_graph_capturing())
        return kiln_error(KILN_ERR_UNSUPPORTED, "barrier inside a graph capture: it would run once, while capturing, "
                          "and never in the graph's runs; call it outside the captured function");
    return run(pg, (sig){0, 0, OP_BARRIER, 0, 0, 0}, NULL, NULL, NULL);
}

static kiln_status allgather_now(void *group, kiln_tensor_t *out, kiln_tensor_t *in, int op)
{
    (void)op;
    return run(group, (sig){0, 0, OP_ALLGATHER, 0, 0, 0}, in, out, NULL);
}

static kiln_status reduce_scatter_now(void *group, kiln_tensor_t *out, kiln_tensor_t *in, int op)
{
    return run(group, (sig){0, 0, OP_REDUCE_SCATTER, 0, (uint32_t)op, 0}, in, out, op == KILN_REDUCE_AVG ? out : NULL);
}

/* While capturing, a collective from in into out is recorded (out updated in place),
 * whether the tensors are the graph's values or real ones it captured (ZeRO-1's flat
 * buffers and shards); the graph runs it in its place. */
static kiln_status record2(kiln_pg_t *pg, kiln__op_id op, kiln__collective2_fn fn, kiln_tensor_t *out,
                           kiln_tensor_t *in, int reduce)
{
    kiln__attrs a = {0};
    a.u[0] = (uint64_t)(uintptr_t)pg;
    a.u[1] = (uint64_t)(uintptr_t)fn;
    a.i[0] = reduce;
    kiln_tensor_t *ts[2] = {out, in};
    return kiln__dispatch(op, ts, 2, &a, NULL);
}

kiln_status kiln_pg_allgather(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out)
{
    if (!pg || !in || !out) return kiln_error(KILN_ERR_ARG, "allgather: NULL group or tensor");
    if (in == out) return kiln_error(KILN_ERR_ARG, "allgather: in and out must be different tensors");
    if (kiln_graph_capturing()) return record2(pg, KILN_OP_ALLGATHER_, allgather_now, out, in, 0);
    return allgather_now(pg, out, in, 0);
}

kiln_status kiln_pg_reduce_scatter(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out, kiln_reduce_op op)
{
    if (!pg || !in || !out) return kiln_error(KILN_ERR_ARG, "reduce_scatter: NULL group or tensor");
    if (in == out) return kiln_error(KILN_ERR_ARG, "reduce_scatter: in and out must be different tensors");
    if (check_reduce("reduce_scatter", op) != KILN_OK) return kiln_last_status();
    if (kiln_graph_capturing()) return record2(pg, KILN_OP_REDUCE_SCATTER_, reduce_scatter_now, out, in, op);
    return reduce_scatter_now(pg, out, in, op);
}

/* A collective started now, its work handed out: finished by kiln_pg_work_wait. */
static kiln_status start_async(kiln_pg_t *pg, sig s, kiln_tensor_t *in, kiln_tensor_t *out, kiln_tensor_t *avg_of,
                               kiln_pg_work_t **work)
{
    kiln_pg_work_t *w = malloc(sizeof *w);
    if (!w) return kiln_error(KILN_ERR_OOM, "%s: out of memory", op_names[s.op]);
    pthread_mutex_lock(&pg->mu);
    kiln_status st = start(pg, &s, in, out, w);
    pthread_mutex_unlock(&pg->mu);
    if (st != KILN_OK) {
        free(w);
        return st;
    }
    w->t = avg_of;
    w->avg = avg_of != NULL;
    *work = w;
    return KILN_OK;
}

kiln_status kiln_pg_allreduce_async(kiln_pg_t *pg, kiln_tensor_t *t, kiln_reduce_op op, kiln_pg_work_t **work)
{
    if (!work) return kiln_error(KILN_ERR_ARG, "allreduce_async: work is NULL");
    *work = NULL;
    if (!pg || !t) return kiln_error(KILN_ERR_ARG, "allreduce_async: NULL group or tensor");
    if (check_reduce("allreduce_async", op) != KILN_OK) return kiln_last_status();
    return start_async(pg, (sig){0, 0, OP_ALLREDUCE, 0, op, 0}, t, NULL, op == KILN_REDUCE_AVG ? t : NULL, work);
}

kiln_status kiln_pg_broadcast_async(kiln_pg_t *pg, kiln_tensor_t *t, int root, kiln_pg_work_t **work)
{
    if (!work) return kiln_error(KILN_ERR_ARG, "broadcast_async: work is NULL");
    *work = NULL;
    if (!pg || !t) return kiln_error(KILN_ERR_ARG, "broadcast_async: NULL group or tensor");
    if (root < 0 || root >= pg->world) return kiln_error(KILN_ERR_ARG, "broadcast_async: root %d outside the group", root);
    return start_async(pg, (sig){0, 0, OP_BROADCAST, 0, (uint32_t)root, 0}, t, NULL, NULL, work);
}

kiln_status kiln_pg_barrier_async(kiln_pg_t *pg, kiln_pg_work_t **work)
{
    if (!work) return kiln_error(KILN_ERR_ARG, "barrier_async: work is NULL");
    *work = NULL;
    if (!pg) return kiln_error(KILN_ERR_ARG, "barrier_async: NULL group");
    return start_async(pg, (sig){0, 0, OP_BARRIER, 0, 0, 0}, NULL, NULL, NULL, work);
}

kiln_status kiln_pg_allgather_async(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out, kiln_pg_work_t **work)
{
    if (!work) return kiln_error(KILN_ERR_ARG, "allgather_async: work is NULL");
    *work = NULL;
    if (!pg || !in || !out) return kiln_error(KILN_ERR_ARG, "allgather_async: NULL group or tensor");
    if (in == out) return kiln_error(KILN_ERR_ARG, "allgather_async: in and out must be different tensors");
    return start_async(pg, (sig){0, 0, OP_ALLGATHER, 0, 0, 0}, in, out, NULL, work);
}

kiln_status kiln_pg_reduce_scatter_async(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out, kiln_reduce_op op,
                                         kiln_pg_work_t **work)
{
    if (!work) return kiln_error(KILN_ERR_ARG, "reduce_scatter_async: work is NULL");
    *work = NULL;
    if (!pg || !in || !out) return kiln_error(KILN_ERR_ARG, "reduce_scatter_async: NULL group or tensor");
    if (in == out) return kiln_error(KILN_ERR_ARG, "reduce_scatter_async: in and out must be different tensors");
    if (check_reduce("reduce_scatter_async", op) != KILN_OK) return kiln_last_status();
    return start_async(pg, (sig){0, 0, OP_REDUCE_SCATTER, 0, op, 0}, in, out, op == KILN_REDUCE_AVG ? out : NULL, work);
}

kiln_status kiln_pg_work_test(kiln_pg_work_t *w, bool *done)
{
    if (!w || !done) return kiln_error(KILN_ERR_ARG, "work_test: NULL work or done");
    *done = w->done;
#ifdef KILN_HAVE_MPI
    if (!w->done) {
        int flag = 0;
        pthread_mutex_lock(&w->pg->mu);
        int rc = MPI_Test(&w->req, &flag, MPI_STATUS_IGNORE);
        pthread_mutex_unlock(&w->pg->mu);
        if (rc != MPI_SUCCESS) return mpi_fail(w->pg, &w->s, rc);
        *done = flag;
        if (flag) {
            w->done = true;
            kiln_status st = w->avg ? kiln_mul_scalar_(w->t, 1.0 / w->pg->world) : KILN_OK;
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

kiln_status kiln_pg_check_step(kiln_pg_t *pg)
{
    if (!pg) return kiln_error(KILN_ERR_ARG, "check_step: NULL group");
    if (!pg->mpi && !pg->tcp) return KILN_OK;
    if (pg->broken)
        return kiln_error(KILN_ERR_DIST, "process group: an earlier collective failed on rank %d; the group cannot be used",
                          pg->rank);
    pthread_mutex_lock(&pg->mu);
    uint64_t mine[2] = {pg->seq, pg->hash}, *all = malloc(sizeof(uint64_t) * 2 * (size_t)pg->world);
    kiln_status st = all ? KILN_OK : kiln_error(KILN_ERR_OOM, "check_step: out of memory");
    sig chk = {pg->seq, 2, OP_ALLGATHER, KILN_DTYPE_I64, 0, 0x57e9};
    if (st == KILN_OK) st = gather_u64(pg, mine, 2, all, &chk);
    bool same = true;
    for (int r = 1; st == KILN_OK && r < pg->world; r++) same &= all[2 * r] == all[0] && all[2 * r + 1] == all[1];
    if (st == KILN_OK && !same) {
        char msg[2048], last[160];
        size_t used = 0;
        for (int r = 0; r < pg->world && used < sizeof msg; r++)
            used += (size_t)snprintf(msg + used, sizeof msg - used, "%s rank %d: %llu collectives, hash %016llx", r ? ";" : "",
                                     r, (unsigned long long)all[2 * r], (unsigned long long)all[2 * r + 1]);
        sig_str(&pg->ring[pg->seq % RING], last, sizeof last);
        pg->broken = true;
        st = kiln_error(KILN_ERR_DIST, "collectives ran in different orders or shapes on communicator world this step:%s "
                        "(rank %d's last: %s; KILN_DIST_DEBUG=1 checks each one as it is issued)", msg, pg->rank, last);
    }
    free(all);
    pthread_mutex_unlock(&pg->mu);
    return st;
}

bool kiln_dist_nccl_version(char *buf, size_t n)
{
    bool ok = kiln__nccl_available();
    if (buf && n) snprintf(buf, n, "%s", kiln__nccl_status());
    return ok;
}
