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

#include "kiln/optim.h"
#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { KILN_REDUCE_SUM, KILN_REDUCE_AVG } kiln_reduce_op;
typedef struct kiln_pg kiln_pg_t;
typedef struct kiln_pg_work kiln_pg_work_t; /* a collective in flight */

/* world_size and rank from KILN_WORLD_SIZE / KILN_RANK or an MPI launcher's variables;
 * 1 and 0 when none is set. Launched by mpirun (or srun --mpi) with more than one
 * rank, the group is MPI's world (builds with MPI only); a world size above 1 without
 * an MPI launcher is an error for now (the TCP rendezvous is not built yet). */
kiln_status kiln_pg_new_from_env(kiln_pg_t **out);
/* Ranks on this machine, from the launcher (KILN_LOCAL_WORLD_SIZE,
 * OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE); 1 if none says:
 * what to divide the cores by, so that N ranks do not oversubscribe them. */
int kiln_pg_local_size_from_env(void);
/* The MPI library this kiln was built with, into buf ("Open MPI v4.1.4, ..."'s first
 * line); false when it was built without MPI. */
bool kiln_dist_mpi_version(char *buf, size_t n);
/* The NCCL library found at run time ("NCCL 2.30.7"), which takes the collectives on
 * cuda tensors, into buf; false (and why, in buf) when there is none. */
bool kiln_dist_nccl_version(char *buf, size_t n);
void kiln_pg_free(kiln_pg_t *pg);
int kiln_pg_rank(const kiln_pg_t *pg);
int kiln_pg_world_size(const kiln_pg_t *pg);
/* Collectives over every rank, on contiguous f32 or f64 cpu tensors. Each carries a
 * sequence number and a signature (op, dtype, count, reduce op); each waits at most
 * KILN_DIST_TIMEOUT seconds (default 300), then fails with KILN_ERR_DIST naming the
 * ranks that lag, and writes this rank's recent collectives to
 * $KILN_DIST_DUMP_DIR/kiln-dist-rank<R>.txt. With KILN_DIST_DEBUG=1 the ranks compare
 * each signature before it runs. After any such error the group takes no more. Calls
 * from several threads are serialized. */
kiln_status kiln_pg_allreduce(kiln_pg_t *pg, kiln_tensor_t *t, kiln_reduce_op op); /* in place */
kiln_status kiln_pg_broadcast(kiln_pg_t *pg, kiln_tensor_t *t, int root);
kiln_status kiln_pg_barrier(kiln_pg_t *pg);
/* out (world x in's elements) = every rank's in, in rank order. */
kiln_status kiln_pg_allgather(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out);
/* out (in's elements / world) = rank r's block of the reduction of every rank's in. */
kiln_status kiln_pg_reduce_scatter(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out, kiln_reduce_op op);
/* All-to-all of rows, the exchange of expert parallelism. x (R, ...) holds, in rank
 * order, send_counts[d] rows for each rank d (send_counts: (world) i32/i64, each >= 0,
 * adding up to at most R; the rows after them are not sent). *y (out_rows, ...) gets
 * from every rank s, in rank order, the rows s sent here, then zeros; *recv_counts
 * (world) i64 says how many came from each. out_rows must bound what this rank
 * receives (world x the most rows a rank sends always does; ranks may pass different
 * ones), and every rank passes the same row shape and dtype. Any dtype. pg is borrowed:
 * autograd's record and a captured graph keep it, so it must outlive them.
 * Both results are new tensors handed to the scope, as an op's are. Differentiable in
 * x: the gradient goes back by the same exchange the other way. While capturing it is
 * recorded in the graph with the counts as data, so a graph runs with any counts. The
 * ranks first share their counts and out_rows, so a rank's bad counts or too small an
 * out_rows fail every rank, naming it.
 * Over MPI or one process; not in a group formed over the TCP rendezvous. */
kiln_status kiln_pg_all_to_all(kiln_pg_t *pg, kiln_tensor_t *x, kiln_tensor_t *send_counts, int64_t out_rows,
                               kiln_tensor_t **y, kiln_tensor_t **recv_counts);
/* The time this process spent inside the group's blocking calls of collective op
 * ("allreduce", "broadcast", "barrier", "allgather", "reduce_scatter", "all_to_all";
 * graphs' allreduces included when not overlapped, the _async forms not), waiting for
 * the other ranks included, and how many there were, since the group was made. */
kiln_status kiln_pg_time_in(kiln_pg_t *pg, const char *op, uint64_t *calls, double *seconds);
/* The same collectives started now and finished by kiln_pg_work_wait (which frees
 * work; an average is scaled there); kiln_pg_work_test says whether one has finished,
 * without waiting. Their tensors must not be touched until then. Each is numbered when
 * it starts, so every rank must start them in the same order. Once a collective of the
 * group has failed, waiting for the others fails at once; those are left posted (MPI
 * may still write their tensors, so keep them allocated). */
kiln_status kiln_pg_allreduce_async(kiln_pg_t *pg, kiln_tensor_t *t, kiln_reduce_op op, kiln_pg_work_t **work);
kiln_status kiln_pg_broadcast_async(kiln_pg_t *pg, kiln_tensor_t *t, int root, kiln_pg_work_t **work);
kiln_status kiln_pg_barrier_async(kiln_pg_t *pg, kiln_pg_work_t **work);
kiln_status kiln_pg_allgather_async(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out, kiln_pg_work_t **work);
kiln_status kiln_pg_reduce_scatter_async(kiln_pg_t *pg, kiln_tensor_t *in, kiln_tensor_t *out, kiln_reduce_op op,
                                         kiln_pg_work_t **work);
kiln_status kiln_pg_work_test(kiln_pg_work_t *work, bool *done);
kiln_status kiln_pg_work_wait(kiln_pg_work_t *work);
/* Compares, across ranks, the number of collectives so far and a hash of their
 * signatures; a difference is KILN_ERR_DIST naming each rank's figures. kiln train
 * calls it once per step. */
kiln_status kiln_pg_check_step(kiln_pg_t *pg);
/* Gradient buckets for data-parallel training: a first bucket of first_bucket_bytes,
 * then about bucket_bytes each, over the parameters in reverse order. Between
 * kiln_ddp_begin and kiln_ddp_finish (around the backward whose gradients are to be
 * reduced, on this thread), each bucket's allreduce (average) starts as soon as its
 * gradients are whole, in bucket order, while backward goes on; finish starts the
 * rest, waits, and leaves every gradient averaged over the ranks. */
typedef struct kiln_ddp kiln_ddp_t;
kiln_status kiln_ddp_new(kiln_pg_t *pg, kiln_tensor_t *const *params, int n, int64_t first_bucket_bytes,
                         int64_t bucket_bytes, kiln_ddp_t **out);
kiln_status kiln_ddp_begin(kiln_ddp_t *d);
kiln_status kiln_ddp_finish(kiln_ddp_t *d);
int kiln_ddp_num_buckets(const kiln_ddp_t *d);
void kiln_ddp_free(kiln_ddp_t *d);

/* ZeRO stage 1: AdamW (the hyperparameters of kiln_adamw_new, decay as there) with the
 * moments sharded over the group's ranks: 1/world of their memory on each. A step
 * reduce-scatters the gradients (averaged), clips them to max_norm by their global
 * norm (<= 0: no clipping; *norm gets it), updates this rank's shard and all-gathers
 * the parameters back; every rank's parameters are then the same. resume_from (or
 * NULL) is an AdamW optimizer whose state, when it has some, starts the shards (a
 * replicated checkpoint resumed with ZeRO-1). */
typedef struct kiln_zero1 kiln_zero1_t;
kiln_status kiln_zero1_new(kiln_pg_t *pg, kiln_tensor_t *const *params, int n, const bool *decay, double beta1,
                           double beta2, double eps, double weight_decay, kiln_optim_t *resume_from, kiln_zero1_t **out);
kiln_status kiln_zero1_step(kiln_zero1_t *z, double lr, double max_norm, double *norm);
/* The same with the learning rate a one-element f32/f64 tensor and the norm given as an
 * f64 scalar tensor (in the caller's scope; norm may be NULL): what changes from step
 * to step is read when it runs and its collectives are recorded when capturing, so a
 * captured training step (kiln_gpt_step's zero) holds it. kiln_zero1_step is this,
 * eagerly, and an error inside a capture. With scale (a one-element tensor, or NULL),
 * the gradients are those of loss * scale (f16's loss scaling): they are unscaled in
 * the update, the norm given is the unscaled one, and a step whose norm is not finite
 * is skipped on every rank (kiln_loss_scale_coef, kiln/optim.h). */
kiln_status kiln_zero1_step_t(kiln_zero1_t *z, kiln_tensor_t *lr, kiln_tensor_t *scale, double max_norm,
                              kiln_tensor_t **norm);
int64_t kiln_zero1_state_bytes(const kiln_zero1_t *z); /* this rank's shard: parameters and moments */
/* Sharded checkpoints: every rank calls kiln_zero1_save (its shards to
 * DIR/zero1.step<S>.rank<R>.safetensors, then a barrier); rank 0 then calls
 * kiln_zero1_commit, which writes DIR/zero1.complete (step and world size) last and
 * removes prev_step's shards (-1: none). kiln_zero1_load reads the shards of the step
 * the marker names, from any world size, and refuses a step the marker does not name:
 * a save that did not finish is never loaded. */
kiln_status kiln_zero1_save(kiln_zero1_t *z, const char *dir, int64_t step);
kiln_status kiln_zero1_commit(const char *dir, int64_t step, int world, int64_t prev_step);
kiln_status kiln_zero1_load(kiln_zero1_t *z, const char *dir, int64_t step);
kiln_status kiln_zero1_read_marker(const char *dir, int64_t *step, int *world);
void kiln_zero1_free(kiln_zero1_t *z);

/* The TCP rendezvous for ranks that no MPI launcher started: rank 0 listens on
 * addr:port, the others connect (retrying with backoff and jitter) and check in with a
 * handshake (magic, version, job id, world size, rank); rank 0 refuses a mismatch or
 * a duplicate rank with a message the client reports. Each rank gives len bytes; all
 * receives every rank's, in rank order. One deadline (timeout seconds) covers it all:
 * past it rank 0 names the ranks that never checked in, and a client the address it
 * could not reach and why. *seconds gets the time it took. kiln_rdzv_opts_from_env
 * reads KILN_RANK, KILN_WORLD_SIZE, KILN_MASTER_ADDR, KILN_MASTER_PORT,
 * KILN_RENDEZVOUS_TIMEOUT (default 60) and KILN_JOB_ID; KILN_SOCKET_IFNAME chooses the
 * network interface. cpu collectives still need MPI; this is the bootstrap that NCCL
 * ranks will use to share their unique id. */
typedef struct {
    int rank, world;
    const char *addr; /* rank 0's address: numeric, or a name resolved once */
    int port;
    const char *job_id; /* NULL: "kiln" */
    double timeout;
} kiln_rdzv_opts;
kiln_status kiln_rdzv_opts_from_env(kiln_rdzv_opts *o);
kiln_status kiln_rendezvous(const kiln_rdzv_opts *o, const void *mine, size_t len, void *all, double *seconds);

/* Collectives issued so far. */
uint64_t kiln_pg_seq(const kiln_pg_t *pg);

#ifdef __cplusplus
}
#endif
#endif
