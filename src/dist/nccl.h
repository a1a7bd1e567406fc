/* NCCL, opened at run time (src/dist/nccl.c), for the process group's cuda tensors. */
#ifndef KILN_DIST_NCCL_H
#define KILN_DIST_NCCL_H

#include "core/tensor_impl.h"

enum { KILN__NCCL_ALLREDUCE, KILN__NCCL_BROADCAST, KILN__NCCL_ALLGATHER, KILN__NCCL_REDUCE_SCATTER };
#define KILN__NCCL_ID_BYTES 128 /* sizeof(ncclUniqueId) */

const char *kiln__nccl_status(void); /* "NCCL 2.x.y", or why not */
bool kiln__nccl_available(void);
kiln_status kiln__nccl_unique_id(void *id, size_t n);
kiln_status kiln__nccl_comm_new(kiln__backend *be, const void *id, int world, int rank, void **comm);
void kiln__nccl_comm_free(void *comm);
/* Enqueues op (a sum for the reductions; f32, f64 or i64) on be's stream and waits for
 * it until deadline (kiln__now_s() seconds). On a failure or at the deadline (then
 * *timed_out) the communicator is aborted and *comm set to NULL. */
kiln_status kiln__nccl_collective(void **comm, kiln__backend *be, int op, const void *in, void *out, size_t count,
                                  kiln_dtype dt, int root, double deadline, bool *timed_out);

#endif
