/* The process group's collective ordering guard. Every collective has a sequence
 * number and a signature (op, dtype, count, reduce op, tag); a running hash of the
 * signatures is compared across ranks once per step (kiln_pg_check_step), and before
 * every collective with KILN_DIST_DEBUG=1, so that collectives issued in different
 * orders are an error that names each rank's signature rather than a hang or a
 * silently wrong sum. The last RING signatures are kept for the file a rank writes at
 * a deadline. */
#include <stdio.h>
#include <stdlib.h>
#include "core/file.h"
#include "core/util.h"
#include "core/env.h"
#include "dist/pg_impl.h"

const char *const kiln__pg_op_names[OP_COUNT] = {"?", "allreduce", "broadcast", "barrier", "allgather", "reduce_scatter",
                                                     "all_to_all"};

static uint64_t sig_hash(const sig *s)
{
    uint64_t kind = ((uint64_t)s->op << 48) ^ ((uint64_t)s->dtype << 40) ^ ((uint64_t)s->reduce << 32) ^ s->tag;
    return kiln__mix64(s->count ^ kiln__mix64(kind));
}

void kiln__pg_sig_str(const sig *s, char *buf, size_t n)
{
    const char *op = s->op < OP_COUNT ? kiln__pg_op_names[s->op] : "?";
    if (s->op == OP_BARRIER) snprintf(buf, n, "#%llu barrier", (unsigned long long)s->seq);
    else if (s->op == OP_BROADCAST)
        snprintf(buf, n, "#%llu broadcast %s x %llu from rank %u", (unsigned long long)s->seq,
                 kiln_dtype_name((kiln_dtype)s->dtype), (unsigned long long)s->count, s->reduce);
    else if (s->op == OP_ALL_TO_ALL) /* the count every rank agrees on: a row's elements */
        snprintf(buf, n, "#%llu all_to_all %s rows of %llu", (unsigned long long)s->seq,
                 kiln_dtype_name((kiln_dtype)s->dtype), (unsigned long long)s->count);
    else
        snprintf(buf, n, "#%llu %s %s x %llu %s%s", (unsigned long long)s->seq, op, kiln_dtype_name((kiln_dtype)s->dtype),
                 (unsigned long long)s->count, s->op == OP_ALLGATHER ? "" : s->reduce == KILN_REDUCE_AVG ? "avg" : "sum",
                 s->tag ? " (tagged)" : "");
}

void kiln__pg_record(kiln_pg_t *pg, sig *s)
{
    s->seq = ++pg->seq;
    pg->hash = kiln__mix64(pg->hash ^ sig_hash(s));
    pg->ring[s->seq % RING] = *s;
    pg->ring_t[s->seq % RING] = kiln__now_s();
}

/* The ring buffer of recent collectives, to DIR/kiln-dist-rank<R>.txt (KILN_DIST_DUMP_DIR,
 * default the working directory), the one waited for marked (`waiting`, its sequence
 * number: several may be in flight); path gets the file's name. */
void kiln__pg_dump_ring(kiln_pg_t *pg, uint64_t waiting, char *path, size_t n)
{
    const char *dir = kiln__env_text(KILN__ENV_DIST_DUMP_DIR);
    snprintf(path, n, "%s/kiln-dist-rank%d.txt", dir, pg->rank);
    /* a regular file only: a FIFO there would block the rank that reports the hang */
    FILE *f = kiln__file_check_target(path, "KILN_DIST_DUMP_DIR") == KILN_OK ? fopen(path, "w") : NULL;
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
        kiln__pg_sig_str(&pg->ring[q % RING], w, sizeof w);
        fprintf(f, "%10.6f  %s%s\n", pg->ring_t[q % RING] - t0, w, q == waiting ? "   <- waiting here" : "");
    }
    fclose(f);
}

/* k uint64 from every rank into all (world x k), in rank order, outside the numbering:
 * how the guards compare ranks. */
static kiln_status gather_u64(kiln_pg_t *pg, const uint64_t *mine, int k, uint64_t *all, const sig *chk)
{
    if (pg->tcp) return kiln__pg_nccl_allgather_u64(pg, mine, k, all, chk);
#ifdef KILN_HAVE_MPI
    return kiln__pg_mpi_allgather_u64(pg, mine, k, all, chk);
#else
    return kiln_error(KILN_ERR_INTERNAL, "collective check: no transport");
#endif
}

kiln_status kiln__pg_check_sig(kiln_pg_t *pg, const sig *s)
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
            kiln__pg_sig_str(&o, w, sizeof w);
            used += (size_t)snprintf(msg + used, sizeof msg - used, "%s rank %d: %s", r ? ";" : "", r, w);
        }
        pg->broken = true;
        st = kiln_error(KILN_ERR_DIST, "collectives issued in different orders on communicator world, at collective "
                        "#%llu:%s", (unsigned long long)s->seq, msg);
    }
    free(all);
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
        kiln__pg_sig_str(&pg->ring[pg->seq % RING], last, sizeof last);
        pg->broken = true;
        st = kiln_error(KILN_ERR_DIST, "collectives ran in different orders or shapes on communicator world this step:%s "
                        "(rank %d's last: %s; KILN_DIST_DEBUG=1 checks each one as it is issued)", msg, pg->rank, last);
    }
    free(all);
    pthread_mutex_unlock(&pg->mu);
    return st;
}
