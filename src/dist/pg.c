/* Process groups. One process is the world_size = 1 group, whose collectives change
 * nothing but still count; several processes launched by mpirun or srun form an MPI
 * group (Open MPI from Debian), whose collectives are MPI's on host buffers. Open MPI
 * because it is the well-kept, packaged implementation of the standard that every
 * cluster launcher speaks; kiln adds the checks MPI leaves out (names in errors, the
 * sequence count), not another transport.
 *
 * MPI is used only when the build found it (KILN_HAVE_MPI) and the process was
 * launched by an MPI launcher; a world size above 1 without one is a clear error, as
 * is asking for it in a build without MPI. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "core/tensor_impl.h"
#include "kiln/dist.h"
#include "kiln/ops.h"
#ifdef KILN_HAVE_MPI
#include <mpi.h>
#endif

struct kiln_pg {
    int rank, world;
    uint64_t seq;
    bool mpi;         /* collectives go through MPI_COMM_WORLD */
    bool mpi_started; /* kiln called MPI_Init_thread, so it calls MPI_Finalize */
};

static int env_int(const char *const *names, int dflt)
{
    for (int i = 0; names[i]; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) return atoi(v);
    }
    return dflt;
}

static const char *const mpi_world_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", NULL};
static const char *const world_vars[] = {"KILN_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", NULL};
static const char *const rank_vars[] = {"KILN_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", NULL};
static const char *const local_vars[] = {"KILN_LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                                         "SLURM_NTASKS_PER_NODE", NULL};

int kiln_pg_local_size_from_env(void)
{
    int n = env_int(local_vars, 1);
    return n >= 1 ? n : 1;
}

#ifdef KILN_HAVE_MPI
/* An MPI failure as a kiln error that names the rank, the op and MPI's own words. */
static kiln_status mpi_fail(const kiln_pg_t *pg, const char *op, int code)
{
    char msg[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(code, msg, &len);
    return kiln_error(KILN_ERR_IO, "%s (collective %llu) failed on rank %d of %d: %s", op,
                      (unsigned long long)pg->seq, pg->rank, pg->world, msg);
}

static kiln_status mpi_start(kiln_pg_t *pg, int want_world, int want_rank)
{
    int inited = 0, provided = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
            return kiln_error(KILN_ERR_IO, "process group: MPI_Init_thread failed (launched by mpirun?)");
        pg->mpi_started = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &pg->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &pg->world);
    if (pg->world != want_world || pg->rank != want_rank)
        return kiln_error(KILN_ERR_ARG, "process group: the launcher's environment says rank %d of %d, MPI says rank %d of %d",
                          want_rank, want_world, pg->rank, pg->world);
    pg->mpi = true;
    return KILN_OK;
}
#endif

kiln_status kiln_pg_new_from_env(kiln_pg_t **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "process group: out is NULL");
    *out = NULL;
    int world = env_int(world_vars, 1), rank = env_int(rank_vars, 0);
    if (world < 1 || rank < 0 || rank >= world)
        return kiln_error(KILN_ERR_ARG, "process group: rank %d and world size %d from the environment do not fit", rank, world);
    kiln_pg_t *pg = calloc(1, sizeof *pg);
    if (!pg) return kiln_error(KILN_ERR_OOM, "process group: out of memory");
    pg->rank = rank;
    pg->world = world;
    kiln_status s = KILN_OK;
    if (world > 1) {
        bool launched_by_mpi = env_int(mpi_world_vars, 0) > 1;
#ifdef KILN_HAVE_MPI
        if (launched_by_mpi) s = mpi_start(pg, world, rank);
        else
            s = kiln_error(KILN_ERR_UNSUPPORTED, "process group: world size %d from KILN_WORLD_SIZE/SLURM, but not launched "
                           "by mpirun or srun --mpi; cpu collectives need MPI (mpirun -np %d kiln ...); the TCP rendezvous "
                           "is not built yet", world, world);
#else
        s = kiln_error(KILN_ERR_UNSUPPORTED, "process group: world size %d asked for%s, but this kiln was built without MPI "
                       "(apt-get install libopenmpi-dev openmpi-bin, then rebuild)", world,
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
    if (pg->mpi_started) {
        int done = 0;
        MPI_Finalized(&done);
        if (!done) MPI_Finalize();
    }
#endif
    free(pg);
}

int kiln_pg_rank(const kiln_pg_t *pg) { return pg ? pg->rank : 0; }
int kiln_pg_world_size(const kiln_pg_t *pg) { return pg ? pg->world : 1; }
uint64_t kiln_pg_seq(const kiln_pg_t *pg) { return pg ? pg->seq : 0; }

/* The host buffer of a contiguous f32 or f64 tensor, or an error that says why not. */
static kiln_status host_buffer(const char *op, kiln_tensor_t *t, void **data, int64_t *n, bool *f64)
{
    if (t->dtype != KILN_DTYPE_F32 && t->dtype != KILN_DTYPE_F64)
        return kiln_error(KILN_ERR_DTYPE, "%s: %s tensors are not supported (f32 or f64)", op, kiln_dtype_name(t->dtype));
    if (!kiln__is_contiguous(t))
        return kiln_error(KILN_ERR_ARG, "%s: the tensor must be contiguous (it is reduced in place)", op);
    *data = kiln__data(t);
    *n = kiln_tensor_numel(t);
    *f64 = t->dtype == KILN_DTYPE_F64;
    return KILN_OK;
}

kiln_status kiln_pg_allreduce(kiln_pg_t *pg, kiln_tensor_t *t, kiln_reduce_op op)
{
    if (!pg || !t) return kiln_error(KILN_ERR_ARG, "allreduce: NULL group or tensor");
    if (op != KILN_REDUCE_SUM && op != KILN_REDUCE_AVG) return kiln_error(KILN_ERR_ARG, "allreduce: unknown reduce op %d", op);
    void *data;
    int64_t n;
    bool f64;
    kiln_status s = host_buffer("allreduce", t, &data, &n, &f64);
    if (s != KILN_OK) return s;
    pg->seq++;
    if (!pg->mpi) return KILN_OK; /* one rank: sum and average leave it as it is */
#ifdef KILN_HAVE_MPI
    for (int64_t done = 0; done < n;) { /* MPI counts are int */
        int c = n - done > (1 << 30) ? 1 << 30 : (int)(n - done);
        char *p = (char *)data + done * (f64 ? 8 : 4);
        int rc = MPI_Allreduce(MPI_IN_PLACE, p, c, f64 ? MPI_DOUBLE : MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        if (rc != MPI_SUCCESS) return mpi_fail(pg, "allreduce", rc);
        done += c;
    }
    if (op == KILN_REDUCE_AVG) return kiln_mul_scalar_(t, 1.0 / pg->world);
#endif
    return KILN_OK;
}

kiln_status kiln_pg_broadcast(kiln_pg_t *pg, kiln_tensor_t *t, int root)
{
    if (!pg || !t) return kiln_error(KILN_ERR_ARG, "broadcast: NULL group or tensor");
    if (root < 0 || root >= pg->world) return kiln_error(KILN_ERR_ARG, "broadcast: root %d outside the group", root);
    void *data;
    int64_t n;
    bool f64;
    kiln_status s = host_buffer("broadcast", t, &data, &n, &f64);
    if (s != KILN_OK) return s;
    pg->seq++;
    if (!pg->mpi) return KILN_OK;
#ifdef KILN_HAVE_MPI
    for (int64_t done = 0; done < n;) {
        int c = n - done > (1 << 30) ? 1 << 30 : (int)(n - done);
        int rc = MPI_Bcast((char *)data + done * (f64 ? 8 : 4), c, f64 ? MPI_DOUBLE : MPI_FLOAT, root, MPI_COMM_WORLD);
        if (rc != MPI_SUCCESS) return mpi_fail(pg, "broadcast", rc);
        done += c;
    }
#endif
    return KILN_OK;
}

kiln_status kiln_pg_barrier(kiln_pg_t *pg)
{
    if (!pg) return kiln_error(KILN_ERR_ARG, "barrier: NULL group");
    pg->seq++;
#ifdef KILN_HAVE_MPI
    if (pg->mpi) {
        int rc = MPI_Barrier(MPI_COMM_WORLD);
        if (rc != MPI_SUCCESS) return mpi_fail(pg, "barrier", rc);
    }
#endif
    return KILN_OK;
}
