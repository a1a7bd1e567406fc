/* kiln/dist.h — process groups. The training loop always has one: with one process
 * its collectives are no-ops, but the same calls run, so multi-process training later
 * changes no training code.
 *
 *     kiln_pg_t *pg;
 *     kiln_pg_new_from_env(&pg);                  // world_size 1 unless launched by a launcher
 *     kiln_pg_allreduce(pg, grad, KILN_REDUCE_AVG);
 *     kiln_pg_free(pg);
 */
#ifndef KILN_DIST_H
#define KILN_DIST_H

#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { KILN_REDUCE_SUM, KILN_REDUCE_AVG } kiln_reduce_op;
typedef struct kiln_pg kiln_pg_t;

/* world_size and rank from KILN_WORLD_SIZE / KILN_RANK or an MPI launcher's variables;
 * 1 and 0 when none is set. Launched by mpirun (or srun --mpi) with more than one
 * rank, the group is MPI's world (builds with MPI only); a world size above 1 without
 * an MPI launcher is an error for now (the TCP rendezvous is not built yet). */
kiln_status kiln_pg_new_from_env(kiln_pg_t **out);
/* Ranks on this machine, from the launcher (KILN_LOCAL_WORLD_SIZE,
 * OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE); 1 if none says:
 * what to divide the cores by, so that N ranks do not oversubscribe them. */
int kiln_pg_local_size_from_env(void);
void kiln_pg_free(kiln_pg_t *pg);
int kiln_pg_rank(const kiln_pg_t *pg);
int kiln_pg_world_size(const kiln_pg_t *pg);
/* In place over every rank. Each call carries a sequence number. */
kiln_status kiln_pg_allreduce(kiln_pg_t *pg, kiln_tensor_t *t, kiln_reduce_op op);
kiln_status kiln_pg_broadcast(kiln_pg_t *pg, kiln_tensor_t *t, int root);
kiln_status kiln_pg_barrier(kiln_pg_t *pg);
/* Collectives issued so far. */
uint64_t kiln_pg_seq(const kiln_pg_t *pg);

#ifdef __cplusplus
}
#endif
#endif
