/* The process group's MPI transport (Open MPI from Debian: the well-kept, packaged
 * implementation of the standard that every cluster launcher speaks). Every collective
 * runs as MPI's nonblocking form polled against a deadline (KILN_DIST_TIMEOUT seconds,
 * default 300); at the deadline the rank writes its ring buffer of recent collectives
 * to a file, asks the other ranks where they are (over a second communicator that a
 * rank waiting in a collective keeps answering), and fails with an error that names the
 * ranks that lag or do not answer. Collectives are serialized per process
 * (MPI_THREAD_SERIALIZED). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "core/util.h"
#include "dist/pg_impl.h"

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

#ifdef KILN_HAVE_MPI
enum { TAG_QUERY = 7001, TAG_ANSWER = 7002 };

static kiln_status mpi_fail(kiln_pg_t *pg, const sig *s, int code)
{
    char msg[MPI_MAX_ERROR_STRING] = "", what[160];
    int len = 0;
    MPI_Error_string(code, msg, &len);
    kiln__pg_sig_str(s, what, sizeof what);
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
        KILN__FREE(reqs, ans, got);
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
            kiln__pg_sig_str(&s, w, sizeof w);
            used += (size_t)snprintf(msg + used, n - used, "; rank %d waits in %s%s", r, w,
                                     s.seq < cur->seq ? " (behind: it lags)" : s.seq > cur->seq ? " (ahead)" : "");
        } else {
            used += (size_t)snprintf(msg + used, n - used, "; rank %d did not answer in 2 s (it lags: busy outside a "
                                     "collective, stuck, or gone)", r);
            MPI_Cancel(&reqs[r]);
        }
    }
    KILN__FREE(reqs, ans, got);
}

kiln_status kiln__pg_mpi_wait(kiln_pg_t *pg, MPI_Request *req, const sig *s)
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
                kiln__pg_dump_ring(pg, s->seq, path, sizeof path);
                ask_peers(pg, s, who, sizeof who);
                kiln__pg_sig_str(s, what, sizeof what);
                pg->broken = pg->left = true; /* the request stays posted */
                return kiln_error(KILN_ERR_DIST, "collective timeout: rank %d of %d waited %g s (KILN_DIST_TIMEOUT) in %s%s; "
                                  "its recent collectives are in %s", pg->rank, pg->world, pg->timeout, what, who, path);
            }
            if (spins > 100000) usleep(50);
        }
    }
}

kiln_status kiln__pg_mpi_start(kiln_pg_t *pg, int want_world, int want_rank)
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

void kiln__pg_mpi_stop(kiln_pg_t *pg)
{
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
}

kiln_status kiln__pg_mpi_post(kiln_pg_t *pg, const sig *s, void *din, void *dout, int64_t nin, int64_t nout,
                              kiln_dtype dt, MPI_Request *req)
{
    int rc = MPI_SUCCESS;
    MPI_Datatype ty = s->op == OP_BARRIER ? MPI_BYTE : mpi_type(dt);
    switch (s->op) {
    case OP_ALLREDUCE: rc = MPI_Iallreduce(MPI_IN_PLACE, din, (int)nin, ty, MPI_SUM, pg->comm, req); break;
    case OP_BROADCAST: rc = MPI_Ibcast(din, (int)nin, ty, (int)s->reduce, pg->comm, req); break;
    case OP_BARRIER: rc = MPI_Ibarrier(pg->comm, req); break;
    case OP_ALLGATHER: rc = MPI_Iallgather(din, (int)nin, ty, dout, (int)nin, ty, pg->comm, req); break;
    case OP_REDUCE_SCATTER:
        rc = MPI_Ireduce_scatter_block(din, dout, (int)nout, ty, MPI_SUM, pg->comm, req);
        break;
    }
    return rc != MPI_SUCCESS ? mpi_fail(pg, s, rc) : KILN_OK;
}

/* Any dtype's elements, moved as they are: 16-bit floats as 16-bit words. */
static MPI_Datatype mpi_any_type(kiln_dtype dt)
{
    switch (dt) {
    case KILN_DTYPE_F64: return MPI_DOUBLE;
    case KILN_DTYPE_I64: return MPI_INT64_T;
    case KILN_DTYPE_I32: return MPI_INT32_T;
    case KILN_DTYPE_F32: return MPI_FLOAT;
    default: return kiln_dtype_size(dt) == 2 ? MPI_UINT16_T : MPI_BYTE;
    }
}

kiln_status kiln__pg_mpi_alltoallv(kiln_pg_t *pg, const sig *s, const void *din, const int *scount, const int *sdispl,
                                   void *dout, const int *rcount, const int *rdispl, kiln_dtype dt)
{
    MPI_Request req;
    MPI_Datatype ty = mpi_any_type(dt);
    int rc = MPI_Ialltoallv(din, scount, sdispl, ty, dout, rcount, rdispl, ty, pg->comm, &req);
    return rc == MPI_SUCCESS ? kiln__pg_mpi_wait(pg, &req, s) : mpi_fail(pg, s, rc);
}

kiln_status kiln__pg_mpi_test(struct kiln_pg_work *w, bool *done)
{
    int flag = 0;
    pthread_mutex_lock(&w->pg->mu);
    int rc = MPI_Test(&w->req, &flag, MPI_STATUS_IGNORE);
    pthread_mutex_unlock(&w->pg->mu);
    if (rc != MPI_SUCCESS) return mpi_fail(w->pg, &w->s, rc);
    *done = flag;
    return KILN_OK;
}

kiln_status kiln__pg_mpi_allgather_u64(kiln_pg_t *pg, const uint64_t *mine, int k, uint64_t *all, const sig *chk)
{
    MPI_Request req;
    int rc = MPI_Iallgather(mine, k, MPI_UINT64_T, all, k, MPI_UINT64_T, pg->comm, &req);
    return rc == MPI_SUCCESS ? kiln__pg_mpi_wait(pg, &req, chk) : mpi_fail(pg, chk, rc);
}

bool kiln__pg_mpi_bcast_bytes(kiln_pg_t *pg, void *buf, size_t n)
{
    return MPI_Bcast(buf, (int)n, MPI_BYTE, 0, pg->comm) == MPI_SUCCESS;
}
#endif
