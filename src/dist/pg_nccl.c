/* The process group's NCCL transport (NCCL opened at run time, nccl.c). Collectives on
 * cuda tensors run through the group's NCCL communicator, made on first use. Ranks
 * started by a scheduler without an MPI launcher form the group over the TCP
 * rendezvous instead; every collective of such a group runs through NCCL, and one on
 * host buffers (cpu tensors, a barrier) is staged through the rank's device. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "core/cache.h"
#include "core/opts.h"
#include "core/util.h"
#include "dist/pg_impl.h"

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
kiln_status kiln__pg_tcp_group(kiln_pg_t *pg)
{
    kiln_rdzv_opts o;
    kiln_status s = kiln_rdzv_opts_from_env(&o);
    if (s != KILN_OK) return s;
    tcp_hello me = {0}, *all = calloc((size_t)pg->world, sizeof me);
    if (!all) return kiln_error(KILN_ERR_OOM, "process group: out of memory");
    gethostname(me.host, sizeof me.host - 1);
    kiln__backend *be = kiln__backend_default();
    if (!kiln__pg_is_cuda(be)) be = kiln__backend_find("cuda");
    if (!kiln__nccl_available()) snprintf(me.why, sizeof me.why, "no NCCL (%s)", kiln__nccl_status());
    else if (!kiln__pg_is_cuda(be)) snprintf(me.why, sizeof me.why, "no cuda device (%s)", kiln_cuda_status());
    else if (!kiln__be_native_stream(be)) snprintf(me.why, sizeof me.why, "%s has no stream", be->name);
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
            else if (!kiln__pg_mpi_bcast_bytes(pg, id, sizeof id))
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
    kiln__pg_sig_str(what, w, sizeof w);
    if (!timed_out) return kiln_error(KILN_ERR_DIST, "collective %s failed on rank %d of %d: %s", w, pg->rank, pg->world, why);
    kiln__pg_dump_ring(pg, what->seq, path, sizeof path);
    return kiln_error(KILN_ERR_DIST, "collective timeout: rank %d of %d waited %g s (KILN_DIST_TIMEOUT) in %s on NCCL "
                      "(%s), which was aborted; a rank that lags or has gone is not named (NCCL has no side channel); its "
                      "recent collectives are in %s", pg->rank, pg->world, pg->timeout, w, pg->nccl_be->name, path);
}

static const int nccl_op[OP_COUNT] = {0, KILN__NCCL_ALLREDUCE, KILN__NCCL_BROADCAST, KILN__NCCL_ALLREDUCE,
                                      KILN__NCCL_ALLGATHER, KILN__NCCL_REDUCE_SCATTER};

/* A collective through NCCL on device buffers din/dout (nin and nout elements): numbered
 * and recorded as any other. A barrier is an allreduce of one float. */
static kiln_status nccl_post(kiln_pg_t *pg, sig *s, kiln__backend *be, const void *din, void *dout, int64_t nin,
                             int64_t nout, kiln_dtype dt)
{
    const char *op = kiln__pg_op_names[s->op];
    kiln_status st = nccl_comm(pg, be, op);
    if (st != KILN_OK) return st;
    s->count = s->op == OP_BARRIER ? 0 : (uint64_t)nin;
    s->dtype = s->op == OP_BARRIER ? 0 : (uint32_t)dt;
    kiln__pg_record(pg, s);
    if (pg->debug && (st = kiln__pg_check_sig(pg, s)) != KILN_OK) return st;
    void *tmp = NULL;
    if (s->op == OP_BARRIER) {
        static const float zero = 0;
        if (!(tmp = kiln__be_alloc(be, sizeof zero))) return kiln_error(KILN_ERR_OOM, "barrier: out of memory on %s", be->name);
        if ((st = kiln__be_copy_h2d(be, tmp, &zero, sizeof zero)) != KILN_OK) {
            kiln__be_free(be, tmp, sizeof zero);
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
    if (tmp) kiln__be_free(be, tmp, sizeof(float));
    return st;
}

kiln_status kiln__pg_nccl_start(kiln_pg_t *pg, sig *s, kiln_tensor_t *in, kiln_tensor_t *out, struct kiln_pg_work *w)
{
    const char *op = kiln__pg_op_names[s->op];
    kiln__backend *be = in->st->be;
    if ((in->dtype != KILN_DTYPE_F32 && in->dtype != KILN_DTYPE_F64) || !kiln__is_contiguous(in) ||
        (out && (!kiln__is_contiguous(out) || out->dtype != in->dtype || out->st->be != be)))
        return kiln_error(KILN_ERR_ARG, "%s: NCCL takes contiguous f32/f64 tensors on one device", op);
    int64_t nin = kiln_tensor_numel(in), nout = out ? kiln_tensor_numel(out) : nin;
    kiln_status st;
    if ((st = kiln__pg_check_counts(pg, s, nin, nout)) != KILN_OK) return st;
    if ((s->op == OP_ALLREDUCE || s->op == OP_BROADCAST) && out && nout != nin)
        return kiln_error(KILN_ERR_SHAPE, "%s: out holds %lld elements, in %lld", op, (long long)nout, (long long)nin);
    st = nccl_post(pg, s, be, kiln__data(in), out ? kiln__data(out) : NULL, nin, nout, in->dtype);
    w->s = *s;
    w->done = true;
    return st;
}

/* In a group formed over TCP, a collective on host buffers (cpu tensors, a barrier)
 * goes through the group's device: copied there, run by NCCL, copied back. */
kiln_status kiln__pg_staged(kiln_pg_t *pg, sig *s, const void *hin, void *hout, int64_t nin, int64_t nout,
                            kiln_dtype dt, struct kiln_pg_work *w)
{
    kiln__backend *be = pg->nccl_be;
    size_t es = kiln_dtype_size(dt), bin = (size_t)nin * es, bout = hout && hout != hin ? (size_t)nout * es : 0;
    char *d = bin + bout ? kiln__be_alloc(be, bin + bout) : NULL;
    if (bin + bout && !d)
        return kiln_error(KILN_ERR_OOM, "%s: out of memory on %s staging %zu bytes", kiln__pg_op_names[s->op], be->name,
                          bin + bout);
    kiln_status st = bin ? kiln__be_copy_h2d(be, d, hin, bin) : KILN_OK;
    if (st != KILN_OK) pg->broken = true; /* this rank cannot take part: the others would wait for it */
    if (st == KILN_OK) st = nccl_post(pg, s, be, d, bout ? d + bin : NULL, nin, nout, dt);
    if (st == KILN_OK && bout) st = kiln__be_copy_d2h(be, hout, d + bin, bout);
    else if (st == KILN_OK && bin && s->op != OP_BARRIER) st = kiln__be_copy_d2h(be, (void *)hin, d, bin);
    if (d) kiln__be_free(be, d, bin + bout);
    w->s = *s;
    w->done = true;
    return st;
}

kiln_status kiln__pg_nccl_allgather_u64(kiln_pg_t *pg, const uint64_t *mine, int k, uint64_t *all, const sig *chk)
{
    kiln__backend *be = pg->nccl_be;
    size_t b = sizeof(uint64_t) * (size_t)k, ball = b * (size_t)pg->world;
    kiln_status st = nccl_comm(pg, be, "collective check");
    char *d = st == KILN_OK ? kiln__be_alloc(be, b + ball) : NULL;
    if (st == KILN_OK && !d) st = kiln_error(KILN_ERR_OOM, "collective check: out of memory on %s", be->name);
    if (st == KILN_OK) st = kiln__be_copy_h2d(be, d, mine, b);
    if (st == KILN_OK) st = nccl_run(pg, chk, KILN__NCCL_ALLGATHER, d, d + b, (size_t)k, KILN_DTYPE_I64, 0);
    if (st == KILN_OK) st = kiln__be_copy_d2h(be, all, d + b, ball);
    if (d) kiln__be_free(be, d, b + ball);
    return st;
}

bool kiln_dist_nccl_version(char *buf, size_t n)
{
    bool ok = kiln__nccl_available();
    if (buf && n) snprintf(buf, n, "%s", kiln__nccl_status());
    return ok;
}
