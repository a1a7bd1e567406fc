/* Process groups. This build has the world_size = 1 group only; the MPI and NCCL
 * groups arrive with the dist work, behind this same interface. */
#include <stdlib.h>
#include <string.h>
#include "kiln/dist.h"

struct kiln_pg {
    int rank, world;
    uint64_t seq;
};

static int env_int(const char *const *names, int dflt)
{
    for (int i = 0; names[i]; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) return atoi(v);
    }
    return dflt;
}

kiln_status kiln_pg_new_from_env(kiln_pg_t **out)
{
    static const char *const world_vars[] = {"KILN_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", NULL};
    static const char *const rank_vars[] = {"KILN_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", NULL};
    int world = env_int(world_vars, 1), rank = env_int(rank_vars, 0);
    if (world < 1 || rank < 0 || rank >= world)
        return kiln_error(KILN_ERR_ARG, "process group: rank %d and world size %d from the environment do not fit", rank, world);
    if (world > 1)
        return kiln_error(KILN_ERR_UNSUPPORTED, "process group: world size %d asked for, but this build has only the "
                          "single-process group (multi-process training needs kiln's MPI backend)", world);
    kiln_pg_t *pg = calloc(1, sizeof *pg);
    if (!pg) return kiln_error(KILN_ERR_OOM, "process group: out of memory");
    pg->rank = rank;
    pg->world = world;
    *out = pg;
    return KILN_OK;
}

void kiln_pg_free(kiln_pg_t *pg) { free(pg); }
int kiln_pg_rank(const kiln_pg_t *pg) { return pg ? pg->rank : 0; }
int kiln_pg_world_size(const kiln_pg_t *pg) { return pg ? pg->world : 1; }
uint64_t kiln_pg_seq(const kiln_pg_t *pg) { return pg ? pg->seq : 0; }

/* With one rank, sum and average both leave the tensor as it is. */
kiln_status kiln_pg_allreduce(kiln_pg_t *pg, kiln_tensor_t *t, kiln_reduce_op op)
{
    if (!pg || !t) return kiln_error(KILN_ERR_ARG, "allreduce: NULL group or tensor");
    pg->seq++;
    return KILN_OK;
}

kiln_status kiln_pg_broadcast(kiln_pg_t *pg, kiln_tensor_t *t, int root)
{
    if (!pg || !t) return kiln_error(KILN_ERR_ARG, "broadcast: NULL group or tensor");
    if (root < 0 || root >= pg->world) return kiln_error(KILN_ERR_ARG, "broadcast: root %d outside the group", root);
    pg->seq++;
    return KILN_OK;
}

kiln_status kiln_pg_barrier(kiln_pg_t *pg)
{
    if (!pg) return kiln_error(KILN_ERR_ARG, "barrier: NULL group");
    pg->seq++;
    return KILN_OK;
}
