/* NCCL for collectives on cuda tensors. The library is opened with dlopen, as the CUDA
 * backend's are, so a kiln without a GPU still runs; a group whose ranks hold cuda
 * tensors makes one NCCL communicator, on first use, over the unique id rank 0 draws and
 * the launcher's channel carries (MPI_Bcast under mpirun; nothing to carry for one rank),
 * and enqueues each collective on the device's stream. */
#include <dlfcn.h>
#include <unistd.h>
#include <stdio.h>
#include <string.h>
#include "core/util.h"
#include "dist/nccl.h"

#ifdef KILN_HAVE_NCCL
#include <nccl.h>

#define NCCL_FNS(X)                                                                                   \
    X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRank) X(ncclCommDestroy) X(ncclAllReduce)       \
    X(ncclBroadcast) X(ncclAllGather) X(ncclReduceScatter) X(ncclGetErrorString) X(ncclCommAbort)               \
    X(ncclCommGetAsyncError)
#define DECLARE(f) static __typeof__(f) *p_##f;
NCCL_FNS(DECLARE)
#undef DECLARE

static char status[160] = "not probed";

static bool load(void)
{
    static bool tried, ok;
    if (tried) return ok;
    tried = true;
    static const char *const names[] = {"libnccl.so.2", "libnccl.so", "/usr/local/cuda/lib64/libnccl.so.2", NULL};
    void *h = NULL;
    for (int i = 0; names[i] && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(status, sizeof status, "libnccl.so.2 not found");
        return false;
    }
#define LOAD(f)                                                                 \
    if (!(p_##f = (__typeof__(f) *)dlsym(h, #f))) {                             \
        snprintf(status, sizeof status, "libnccl lacks %s", #f);                \
        return false;                                                           \
    }
    NCCL_FNS(LOAD)
#undef LOAD
    int v = 0;
    p_ncclGetVersion(&v);
    snprintf(status, sizeof status, "NCCL %d.%d.%d", v / 10000, v / 100 % 100, v % 100);
    return ok = true;
}

const char *kiln__nccl_status(void)
{
    load();
    return status;
}

bool kiln__nccl_available(void) { return load(); }

kiln_status kiln__nccl_unique_id(void *id, size_t n)
{
    if (!load()) return kiln_error(KILN_ERR_UNSUPPORTED, "nccl: %s", status);
    if (n < sizeof(ncclUniqueId)) return kiln_error(KILN_ERR_INTERNAL, "nccl: %zu bytes for an id of %zu", n, sizeof(ncclUniqueId));
    ncclResult_t r = p_ncclGetUniqueId((ncclUniqueId *)id);
    return r == ncclSuccess ? KILN_OK : kiln_error(KILN_ERR_DIST, "nccl: ncclGetUniqueId: %s", p_ncclGetErrorString(r));
}

kiln_status kiln__nccl_comm_new(kiln__backend *be, const void *id, int world, int rank, void **comm)
{
    if (!load()) return kiln_error(KILN_ERR_UNSUPPORTED, "nccl: %s", status);
    if (!kiln__be_native_stream(be))
        return kiln_error(KILN_ERR_DEVICE, "nccl: %s has no native stream to enqueue on", be->name);
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclComm_t c;
    ncclResult_t r = p_ncclCommInitRank(&c, world, u, rank);
    if (r != ncclSuccess)
        return kiln_error(KILN_ERR_DIST, "nccl: rank %d of %d: ncclCommInitRank on %s: %s", rank, world, be->name,
                          p_ncclGetErrorString(r));
    *comm = c;
    return KILN_OK;
}

void kiln__nccl_comm_free(void *comm)
{
    if (comm && p_ncclCommDestroy) p_ncclCommDestroy((ncclComm_t)comm);
}

kiln_status kiln__nccl_collective(void **comm, kiln__backend *be, int op, const void *in, void *out, size_t count,
                                  kiln_dtype dt, int root, double deadline, bool *timed_out)
{
    *timed_out = false;
    ncclDataType_t ty = dt == KILN_DTYPE_F64 ? ncclFloat64 : dt == KILN_DTYPE_I64 ? ncclInt64 : ncclFloat32;
    cudaStream_t st = (cudaStream_t)kiln__be_native_stream(be);
    ncclComm_t c = *comm;
    ncclResult_t r;
    switch (op) {
    case KILN__NCCL_ALLREDUCE: r = p_ncclAllReduce(in, out, count, ty, ncclSum, c, st); break;
    case KILN__NCCL_BROADCAST: r = p_ncclBroadcast(in, out, count, ty, root, c, st); break;
    case KILN__NCCL_ALLGATHER: r = p_ncclAllGather(in, out, count, ty, c, st); break;
    case KILN__NCCL_REDUCE_SCATTER: r = p_ncclReduceScatter(in, out, count, ty, ncclSum, c, st); break;
    default: return kiln_error(KILN_ERR_INTERNAL, "nccl: op %d", op);
    }
    if (r != ncclSuccess) return kiln_error(KILN_ERR_DIST, "nccl: collective on %s: %s", be->name, p_ncclGetErrorString(r));
    /* The work handle completes when the device has done it. The wait polls an event
     * so that it can end: at the deadline, or when the communicator reports a peer's
     * failure, the communicator is aborted (which frees the device from the kernel that
     * waits for the others) rather than left to hang. */
    kiln__event *e = kiln__be_event_record(be);
    if (!e) return KILN_OK; /* a backend without events synchronized instead */
    kiln_status s = KILN_OK;
    for (unsigned k = 0;; k++) {
        bool done = false;
        if ((s = kiln__be_event_query(be, e, &done)) != KILN_OK || done) break;
        ncclResult_t ae = ncclSuccess;
        if (p_ncclCommGetAsyncError(c, &ae) == ncclSuccess && ae != ncclSuccess && ae != ncclInProgress) {
            s = kiln_error(KILN_ERR_DIST, "nccl: the communicator on %s failed: %s", be->name, p_ncclGetErrorString(ae));
            break;
        }
        if (kiln__now_s() > deadline) {
            *timed_out = true;
            s = kiln_error(KILN_ERR_DIST, "nccl: deadline passed on %s", be->name);
            break;
        }
        usleep(k < 1000 ? 5 : 200);
    }
    kiln__be_event_free(be, e);
    if (s != KILN_OK) {
        p_ncclCommAbort(c);
        *comm = NULL;
    }
    return s;
}
#else
const char *kiln__nccl_status(void) { return "not built (nccl.h was not found)"; }
bool kiln__nccl_available(void) { return false; }
kiln_status kiln__nccl_unique_id(void *id, size_t n) { return kiln_error(KILN_ERR_UNSUPPORTED, "nccl: not built"); }
kiln_status kiln__nccl_comm_new(kiln__backend *be, const void *id, int world, int rank, void **comm)
{
    return kiln_error(KILN_ERR_UNSUPPORTED, "nccl: not built");
}
void kiln__nccl_comm_free(void *comm) {}
kiln_status kiln__nccl_collective(void **comm, kiln__backend *be, int op, const void *in, void *out, size_t count,
                                  kiln_dtype dt, int root, double deadline, bool *timed_out)
{
    *timed_out = false;
    return kiln_error(KILN_ERR_UNSUPPORTED, "nccl: not built");
}
#endif
