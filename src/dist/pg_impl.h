/* The process group's private parts, shared by its files:
 *
 *   pg.c        the front end: the group from the environment, the collectives' API
 *               (blocking, async, recorded into a graph), start and finish of one
 *   pg_guard.c  the ordering guard: signatures, their running hash and ring buffer,
 *               the per-collective (KILN_DIST_DEBUG) and per-step checks
 *   pg_mpi.c    the MPI transport: start and stop, posting, polling against the
 *               deadline, asking the other ranks where they are
 *   pg_nccl.c   the NCCL transport: the group formed over the TCP rendezvous, the
 *               communicator, collectives on device buffers, host buffers staged
 *
 * Everything here runs under pg->mu unless it says otherwise. */
#ifndef KILN_DIST_PG_IMPL_H
#define KILN_DIST_PG_IMPL_H

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include "core/tensor_impl.h"
#include "dist/nccl.h"
#include "kiln/dist.h"
#ifdef KILN_HAVE_MPI
#include <mpi.h>
#endif

enum { OP_ALLREDUCE = 1, OP_BROADCAST, OP_BARRIER, OP_ALLGATHER, OP_REDUCE_SCATTER, OP_ALL_TO_ALL, OP_COUNT };
extern const char *const kiln__pg_op_names[OP_COUNT];

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
    double secs[OP_COUNT];  /* time inside the blocking collectives of each kind (kiln_pg_time_in) */
    uint64_t calls[OP_COUNT];
    unsigned char nccl_id[KILN__NCCL_ID_BYTES]; /* rank 0's, as the rendezvous carried it */
};

struct kiln_pg_work {
    kiln_pg_t *pg;
    sig s;
    kiln_tensor_t *t; /* scaled after the sum, for an average */
    bool avg, done;
#ifdef KILN_HAVE_MPI
    MPI_Request req;
#endif
};

static inline bool kiln__pg_is_cuda(const kiln__backend *be)
{
    return be && be->language && !strcmp(be->language, "cuda-c");
}

/* ---- pg.c ---- */

/* The element counts a gathering or scattering collective needs: out = world x in, or
 * in = world x out. */
kiln_status kiln__pg_check_counts(const kiln_pg_t *pg, const sig *s, int64_t nin, int64_t nout);

/* ---- pg_guard.c ---- */

/* "#12 allreduce f32 x 4096 sum" into buf. */
void kiln__pg_sig_str(const sig *s, char *buf, size_t n);
/* Numbers the collective and folds it into the step hash and the ring. */
void kiln__pg_record(kiln_pg_t *pg, sig *s);
/* The ring buffer of recent collectives to a file, the one waited for (its sequence
 * number) marked; path gets the file's name. */
void kiln__pg_dump_ring(kiln_pg_t *pg, uint64_t waiting, char *path, size_t n);
/* KILN_DIST_DEBUG: every rank shows the others the collective it is about to run. */
kiln_status kiln__pg_check_sig(kiln_pg_t *pg, const sig *s);

/* ---- pg_mpi.c (with KILN_HAVE_MPI) ---- */

#ifdef KILN_HAVE_MPI
kiln_status kiln__pg_mpi_start(kiln_pg_t *pg, int want_world, int want_rank);
/* Frees the communicators and finalizes MPI, unless a request was left posted. */
void kiln__pg_mpi_stop(kiln_pg_t *pg);
/* Posts s's nonblocking MPI collective on host buffers din/dout into *req. */
kiln_status kiln__pg_mpi_post(kiln_pg_t *pg, const sig *s, void *din, void *dout, int64_t nin, int64_t nout,
                              kiln_dtype dt, MPI_Request *req);
/* s's all-to-all: counts and displacements (elements) per rank, posted and waited for. */
kiln_status kiln__pg_mpi_alltoallv(kiln_pg_t *pg, const sig *s, const void *din, const int *scount, const int *sdispl,
                                   void *dout, const int *rcount, const int *rdispl, kiln_dtype dt);
/* Polls req until it completes or the deadline passes. */
kiln_status kiln__pg_mpi_wait(kiln_pg_t *pg, MPI_Request *req, const sig *s);
/* Whether w's request completed, without waiting; takes pg->mu itself. */
kiln_status kiln__pg_mpi_test(struct kiln_pg_work *w, bool *done);
/* k uint64 from every rank into all (world x k), outside the numbering. */
kiln_status kiln__pg_mpi_allgather_u64(kiln_pg_t *pg, const uint64_t *mine, int k, uint64_t *all, const sig *chk);
/* n bytes of buf from rank 0 to all; false on failure. */
bool kiln__pg_mpi_bcast_bytes(kiln_pg_t *pg, void *buf, size_t n);
#endif

/* ---- pg_nccl.c ---- */

/* Forms the group over the TCP rendezvous; its collectives then all run through NCCL. */
kiln_status kiln__pg_tcp_group(kiln_pg_t *pg);
/* A collective on cuda tensors, through NCCL. */
kiln_status kiln__pg_nccl_start(kiln_pg_t *pg, sig *s, kiln_tensor_t *in, kiln_tensor_t *out, struct kiln_pg_work *w);
/* In a group formed over TCP, a collective on host buffers, staged through the device. */
kiln_status kiln__pg_staged(kiln_pg_t *pg, sig *s, const void *hin, void *hout, int64_t nin, int64_t nout,
                            kiln_dtype dt, struct kiln_pg_work *w);
/* k uint64 from every rank into all (world x k), over NCCL, outside the numbering. */
kiln_status kiln__pg_nccl_allgather_u64(kiln_pg_t *pg, const uint64_t *mine, int k, uint64_t *all, const sig *chk);

#endif
