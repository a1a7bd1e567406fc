/* The OpenCL backend: one registered backend per OpenCL device ("opencl:0", ...),
 * through the ICD loader, so any installed platform works (PoCL on these machines).
 *
 * Memory. The core addresses a tensor as its storage's pointer plus a byte offset, and
 * the contract's copies take such addresses. An OpenCL buffer has no address, so each
 * one is given a range of the host's address space, reserved and never accessible
 * (mmap PROT_NONE, no memory behind it): pointer arithmetic inside a tensor then works
 * as on the cpu, and an address maps back to (buffer, offset) by a look-up in the sorted
 * table of ranges. Reading such an address on the host faults at once instead of
 * reading garbage. Buffers are OpenCL 1.2 objects, so no shared virtual memory is
 * needed from the platform.
 *
 * Work goes to one in-order command queue per device (the "stream"); copies to the host
 * block, the rest is enqueued. Kernels come from source (compile_kernel): the compiler
 * generates OpenCL C for the ops it lowers (src/compile/eager.c); each program is built
 * once per process and its binary kept in the kernel cache ($KILN_CACHE_DIR/opencl),
 * keyed by a hash of the source, the device and its driver, so a later process loads
 * it without building. An op neither the backend's own kernels nor the compiler covers
 * runs on the cpu with copies (src/core/dispatch.c).
 *
 * Graph capture, where the platform has cl_khr_command_buffer (PoCL 3.1 does, at the
 * extension's provisional 0.9.0): between capture_begin and capture_end every kernel,
 * device copy and fill goes into a command buffer instead of the queue, each waiting on
 * the one before; a replay enqueues the buffer. A copy to or from the host cannot be
 * recorded and fails the capture. */
#ifdef KILN_HAVE_OPENCL
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <CL/cl_ext.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "core/cache.h"
#include "core/dtype.h"
#include "kiln/ops.h"
#include "core/opts.h"
#include "core/tensor_impl.h"
#include "ops/registry.h"

#define MAX_CL_DEVICES 4

typedef struct {
    uintptr_t base;
    size_t n;
    cl_mem mem;
} cl_range;

typedef struct {
    cl_context ctx;
    cl_command_queue q;
    cl_device_id dev;
    char name[24];       /* "opencl:N" */
    char description[160];
    size_t memory;
    int units;
    pthread_mutex_t lock; /* guards the ranges */
    cl_range *r;
    int n_r, cap_r;
    pthread_mutex_t prog_lock; /* guards the programs and kernel launches (argument setting) */
    struct cl_prog *progs;
    char driver[128];
    /* cl_khr_command_buffer, where the platform has it (the capture entries). */
    clCreateCommandBufferKHR_fn cb_create;
    clCommandNDRangeKernelKHR_fn cb_kernel;
    clCommandCopyBufferKHR_fn cb_copy;
    clCommandFillBufferKHR_fn cb_fill;
    clFinalizeCommandBufferKHR_fn cb_finalize;
    clEnqueueCommandBufferKHR_fn cb_enqueue;
    clReleaseCommandBufferKHR_fn cb_release;
    bool cb_simultaneous; /* a buffer may be enqueued again while it is still pending */
    struct cl_graph *cap; /* being recorded: work goes into it instead of the queue */
    void *err; /* the error word: kernels raise a bad index in it where the host cannot check */
    uint64_t *ran; /* launches run before, by hash of kernel and sizes: first_run() (under prog_lock) */
    int n_ran;
} cl_dev;

/* A captured command buffer and what it holds: a kernel object per recorded launch
 * (arguments stay with the kernel object, and some platforms read them when the buffer
 * runs rather than when the command is recorded, so none is ever set again), and the
 * buffers freed while recording, kept until the graph goes (the commands name them). */
typedef struct cl_graph {
    cl_command_buffer_khr cb;
    cl_sync_point_khr last;
    bool any;
    const char *failed; /* the first thing that could not be recorded */
    cl_kernel *k;
    int n_k, cap_k;
    cl_range *freed;
    int n_freed, cap_freed;
    cl_event pending; /* the last run, where the buffer cannot run twice at once */
    bool ran; /* replayed before: the first replay is waited for (first_run()) */
} cl_graph;

/* A built program, by the hash of its source. */
typedef struct cl_prog {
    uint64_t hash;
    cl_program p;
    struct cl_prog *next;
} cl_prog;

static cl_dev devs[MAX_CL_DEVICES];
static kiln__backend cl_backends[MAX_CL_DEVICES];

static kiln_status cl_fail(const cl_dev *d, const char *what, cl_int err)
{
    return kiln__err(KILN_ERR_DEVICE, "%s: %s failed with OpenCL error %d", d->name, what, (int)err);
}

/* The range holding address p, or NULL. Called with the lock held. */
static cl_range *find_range(cl_dev *d, uintptr_t p)
{
    int lo = 0, hi = d->n_r - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        cl_range *r = &d->r[mid];
        if (p < r->base) hi = mid - 1;
        else if (p >= r->base + r->n) lo = mid + 1;
        else return r;
    }
    return NULL;
}

/* (buffer, offset) of the n bytes at address p, all inside one buffer. */
static kiln_status resolve(cl_dev *d, const void *p, size_t n, cl_mem *mem, size_t *off)
{
    pthread_mutex_lock(&d->lock);
    cl_range *r = find_range(d, (uintptr_t)p);
    bool ok = r && (uintptr_t)p + n <= r->base + r->n;
    if (ok) {
        *mem = r->mem;
        *off = (size_t)((uintptr_t)p - r->base);
    }
    pthread_mutex_unlock(&d->lock);
    return ok ? KILN_OK
              : kiln__err(KILN_ERR_INTERNAL, "%s: address %p (+%zu bytes) is not inside one of its buffers", d->name, p, n);
}

static kiln_status ocl_device_info(kiln__backend *be, kiln__device_info *out)
{
    cl_dev *d = be->ctx;
    out->name = d->name;
    out->description = d->description;
    out->total_memory = d->memory;
    out->compute_units = d->units;
    return KILN_OK;
}

static void *cl_alloc(kiln__backend *be, size_t nbytes)
{
    cl_dev *d = be->ctx;
    size_t n = nbytes ? nbytes : 64;
    void *addr = mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (addr == MAP_FAILED) return NULL;
    cl_int err;
    cl_mem mem = clCreateBuffer(d->ctx, CL_MEM_READ_WRITE, n, NULL, &err);
    if (err != CL_SUCCESS) {
        munmap(addr, n);
        return NULL;
    }
    pthread_mutex_lock(&d->lock);
    if (d->n_r == d->cap_r) {
        int cap = d->cap_r ? 2 * d->cap_r : 64;
        cl_range *r = realloc(d->r, sizeof *r * (size_t)cap);
        if (!r) {
            pthread_mutex_unlock(&d->lock);
            clReleaseMemObject(mem);
            munmap(addr, n);
            return NULL;
        }
        d->r = r;
        d->cap_r = cap;
    }
    int at = d->n_r;
    while (at > 0 && d->r[at - 1].base > (uintptr_t)addr) at--;
    memmove(&d->r[at + 1], &d->r[at], sizeof *d->r * (size_t)(d->n_r - at));
    d->r[at] = (cl_range){(uintptr_t)addr, n, mem};
    d->n_r++;
    pthread_mutex_unlock(&d->lock);
    return addr;
}

static void release_range(cl_range r)
{
    clReleaseMemObject(r.mem);
    munmap((void *)r.base, r.n);
}

static void cl_free(kiln__backend *be, void *ptr, size_t nbytes)
{
    cl_dev *d = be->ctx;
    if (!ptr) return;
    pthread_mutex_lock(&d->lock);
    cl_range *r = find_range(d, (uintptr_t)ptr);
    cl_range gone = r ? *r : (cl_range){0};
    if (r) {
        int at = (int)(r - d->r);
        memmove(r, r + 1, sizeof *r * (size_t)(d->n_r - at - 1));
        d->n_r--;
    }
    cl_graph *g = d->cap;
    bool kept = false;
    if (gone.mem && g) { /* a recorded command may name it: kept until the graph goes */
        if (g->n_freed == g->cap_freed) {
            int cap = g->cap_freed ? 2 * g->cap_freed : 16;
            cl_range *f = realloc(g->freed, sizeof *f * (size_t)cap);
            if (f) {
                g->freed = f;
                g->cap_freed = cap;
            }
        }
        if (g->n_freed < g->cap_freed) {
            g->freed[g->n_freed++] = gone;
            kept = true;
        } else if (!g->failed) {
            g->failed = "out of memory keeping a freed buffer";
            kept = true; /* leaked rather than released under a recorded command */
        }
    }
    pthread_mutex_unlock(&d->lock);
    if (gone.mem && !kept) release_range(gone);
}

/* Each recorded command waits on the one before: *prev gets that one's sync point and
 * the count (0 for the first) is returned. The wait list goes as NULL when the count is
 * 0 (PoCL 3.1 crashes on a non-NULL list of 0). */
static cl_uint after_last(const cl_graph *g, cl_sync_point_khr *prev)
{
    *prev = g->last;
    return g->any ? 1 : 0;
}

/* While recording, the first thing that cannot go into a command buffer fails the
 * capture (and is what capture_end reports). */
static kiln_status not_recordable(cl_dev *d, const char *what)
{
    if (!d->cap->failed) d->cap->failed = what;
    return kiln__err(KILN_ERR_UNSUPPORTED, "%s: %s cannot be recorded into a command buffer", d->name, what);
}

/* n bytes between the host and the device address dev, blocking: written to the
 * device (write), or read from it. */
static kiln_status transfer(kiln__backend *be, const void *dev, void *host, size_t n, bool write)
{
    cl_dev *d = be->ctx;
    cl_mem mem;
    size_t off;
    kiln_status s = n ? resolve(d, dev, n, &mem, &off) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    if (d->cap) return not_recordable(d, write ? "a copy from the host" : "a copy to the host");
    cl_int err = write ? clEnqueueWriteBuffer(d->q, mem, CL_TRUE, off, n, host, 0, NULL, NULL)
                       : clEnqueueReadBuffer(d->q, mem, CL_TRUE, off, n, host, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : cl_fail(d, write ? "clEnqueueWriteBuffer" : "clEnqueueReadBuffer", err);
}

static kiln_status cl_copy_h2d(kiln__backend *be, void *dst, const void *src, size_t n)
{
    return transfer(be, dst, (void *)src, n, true);
}

static kiln_status cl_copy_d2h(kiln__backend *be, void *dst, const void *src, size_t n)
{
    return transfer(be, src, dst, n, false);
}

static kiln_status cl_copy_d2d(kiln__backend *be, void *dst, const void *src, size_t n)
{
    cl_dev *d = be->ctx;
    cl_mem md, ms;
    size_t od, os;
    kiln_status s = KILN_OK;
    if (!n) return KILN_OK;
    if ((s = resolve(d, dst, n, &md, &od)) != KILN_OK || (s = resolve(d, src, n, &ms, &os)) != KILN_OK) return s;
    if (md == ms && od == os) return KILN_OK; /* onto itself */
    if (md == ms && (od < os + n && os < od + n)) { /* OpenCL forbids overlapping copies: through a device buffer */
        void *tmp = cl_alloc(be, n);
        if (!tmp) return kiln__err(KILN_ERR_OOM, "%s: out of device memory for an overlapping copy", d->name);
        s = cl_copy_d2d(be, tmp, src, n);
        if (s == KILN_OK) s = cl_copy_d2d(be, dst, tmp, n);
        cl_free(be, tmp, n); /* in-order queue: after the copies */
        return s;
    }
    cl_int err;
    if (d->cap) {
        cl_graph *g = d->cap;
        cl_sync_point_khr prev;
        err = d->cb_copy(g->cb, NULL, ms, md, os, od, n, after_last(g, &prev), g->any ? &prev : NULL, &g->last, NULL);
        g->any |= err == CL_SUCCESS;
        return err == CL_SUCCESS ? KILN_OK : cl_fail(d, "clCommandCopyBufferKHR", err);
    }
    err = clEnqueueCopyBuffer(d->q, ms, md, os, od, n, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : cl_fail(d, "clEnqueueCopyBuffer", err);
}

/* A fill enqueued, or recorded while capturing. */
static kiln_status fill_mem(cl_dev *d, cl_mem mem, const void *pattern, size_t size, size_t off, size_t n)
{
    cl_int err;
    if (d->cap) {
        cl_graph *g = d->cap;
        cl_sync_point_khr prev;
        err = d->cb_fill(g->cb, NULL, mem, pattern, size, off, n, after_last(g, &prev), g->any ? &prev : NULL, &g->last,
                         NULL);
        g->any |= err == CL_SUCCESS;
        return err == CL_SUCCESS ? KILN_OK : cl_fail(d, "clCommandFillBufferKHR", err);
    }
    err = clEnqueueFillBuffer(d->q, mem, pattern, size, off, n, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : cl_fail(d, "clEnqueueFillBuffer", err);
}

static kiln_status cl_memset(kiln__backend *be, void *dst, int byte, size_t n)
{
    cl_dev *d = be->ctx;
    cl_mem mem;
    size_t off;
    kiln_status s = n ? resolve(d, dst, n, &mem, &off) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    unsigned char pattern = (unsigned char)byte;
    return fill_mem(d, mem, &pattern, 1, off, n);
}

/* One in-order queue per device: a stream is that queue, an event a marker on it. */
static kiln__stream *cl_stream_new(kiln__backend *be) { return (kiln__stream *)((cl_dev *)be->ctx)->q; }
static void cl_stream_free(kiln__backend *be, kiln__stream *s) {}

static kiln__event *cl_event_record(kiln__backend *be, kiln__stream *s)
{
    cl_event e = NULL;
    return clEnqueueMarkerWithWaitList(((cl_dev *)be->ctx)->q, 0, NULL, &e) == CL_SUCCESS ? (kiln__event *)e : NULL;
}

static kiln_status cl_event_wait(kiln__backend *be, kiln__event *e)
{
    cl_event ev = (cl_event)e;
    cl_int err = e ? clWaitForEvents(1, &ev) : CL_SUCCESS;
    return err == CL_SUCCESS ? KILN_OK : cl_fail(be->ctx, "clWaitForEvents", err);
}

static kiln_status cl_event_query(kiln__backend *be, kiln__event *e, bool *done)
{
    cl_int state = CL_COMPLETE, err = e ? clGetEventInfo((cl_event)e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof state,
                                                         &state, NULL)
                                        : CL_SUCCESS;
    if (err == CL_SUCCESS && state < 0) err = state; /* the command failed */
    *done = state == CL_COMPLETE;
    return err == CL_SUCCESS ? KILN_OK : cl_fail(be->ctx, "clGetEventInfo", err);
}

static void cl_event_free(kiln__backend *be, kiln__event *e)
{
    if (e) clReleaseEvent((cl_event)e);
}

static kiln_status cl_synchronize(kiln__backend *be)
{
    cl_int err = clFinish(((cl_dev *)be->ctx)->q);
    return err == CL_SUCCESS ? KILN_OK : cl_fail(be->ctx, "clFinish", err);
}

static uint64_t source_hash(const cl_dev *d, const char *src)
{
    uint64_t h = kiln__fnv(KILN__FNV_SEED, src, strlen(src));
    h = kiln__fnv(h, d->description, strlen(d->description));
    h = kiln__fnv(h, d->driver, strlen(d->driver));
    return kiln__fnv(h, KILN_VERSION, strlen(KILN_VERSION));
}

/* Writes n bytes to path through a temporary name, so a reader sees all or nothing. */
static void write_whole(const char *path, const void *p, size_t n)
{
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return;
    bool ok = fwrite(p, 1, n, f) == n;
    ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path) != 0) remove(tmp);
}

/* The program built from src: from this process's table, the cache's binary, or built
 * now (its binary then saved). */
static kiln_status get_program(cl_dev *d, const char *src, const char *entry, cl_program *out)
{
    uint64_t h = source_hash(d, src);
    for (cl_prog *q = d->progs; q; q = q->next)
        if (q->hash == h) {
            *out = q->p;
            return KILN_OK;
        }
    char dir[1024], path[1100];
    if (kiln__cache_dir("opencl", dir, sizeof dir) != KILN_OK) return kiln_last_status();
    snprintf(path, sizeof path, "%s/%016llx.bin", dir, (unsigned long long)h);
    cl_int err = CL_SUCCESS, st = CL_SUCCESS;
    cl_program p = NULL;
    FILE *f = fopen(path, "rb");
    if (f) { /* a binary from an earlier run; if the driver refuses it, build from source */
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        unsigned char *bin = n > 0 ? malloc((size_t)n) : NULL;
        if (bin && fread(bin, 1, (size_t)n, f) == (size_t)n) {
            size_t len = (size_t)n;
            const unsigned char *bp = bin;
            p = clCreateProgramWithBinary(d->ctx, 1, &d->dev, &len, &bp, &st, &err);
            if (err != CL_SUCCESS || st != CL_SUCCESS || clBuildProgram(p, 1, &d->dev, "", NULL, NULL) != CL_SUCCESS) {
                if (p) clReleaseProgram(p);
                p = NULL;
            }
        }
        free(bin);
        fclose(f);
    }
    if (!p) {
        p = clCreateProgramWithSource(d->ctx, 1, &src, NULL, &err);
        if (err != CL_SUCCESS) return cl_fail(d, "clCreateProgramWithSource", err);
        err = clBuildProgram(p, 1, &d->dev, "-cl-std=CL1.2", NULL, NULL);
        if (err != CL_SUCCESS) { /* keep the source and the build log for the message */
            char sp[1100], lp[1100];
            snprintf(sp, sizeof sp, "%s/%016llx.cl", dir, (unsigned long long)h);
            snprintf(lp, sizeof lp, "%s/%016llx.log", dir, (unsigned long long)h);
            write_whole(sp, src, strlen(src));
            size_t ln = 0;
            clGetProgramBuildInfo(p, d->dev, CL_PROGRAM_BUILD_LOG, 0, NULL, &ln);
            char *log = malloc(ln + 1);
            if (log && clGetProgramBuildInfo(p, d->dev, CL_PROGRAM_BUILD_LOG, ln, log, NULL) == CL_SUCCESS)
                write_whole(lp, log, strlen(log));
            free(log);
            clReleaseProgram(p);
            return kiln__err(KILN_ERR_COMPILE, "%s: the OpenCL compiler failed on kernel %s (error %d); source kept at "
                             "%s, the build log at %s", d->name, entry, (int)err, sp, lp);
        }
        size_t bn = 0;
        if (clGetProgramInfo(p, CL_PROGRAM_BINARY_SIZES, sizeof bn, &bn, NULL) == CL_SUCCESS && bn > 0) {
            unsigned char *bin = malloc(bn);
            if (bin && clGetProgramInfo(p, CL_PROGRAM_BINARIES, sizeof bin, &bin, NULL) == CL_SUCCESS)
                write_whole(path, bin, bn);
            free(bin);
        }
    }
    cl_prog *q = malloc(sizeof *q);
    if (!q) {
        clReleaseProgram(p);
        return kiln__err(KILN_ERR_OOM, "%s: out of memory", d->name);
    }
    *q = (cl_prog){h, p, d->progs};
    d->progs = q;
    *out = p;
    return KILN_OK;
}

static kiln_status cl_compile_kernel(kiln__backend *be, const char *source, const char *entry, void **kernel_out)
{
    cl_dev *d = be->ctx;
    cl_program p;
    pthread_mutex_lock(&d->prog_lock);
    kiln_status s = get_program(d, source, entry, &p);
    cl_int err = CL_SUCCESS;
    cl_kernel k = s == KILN_OK ? clCreateKernel(p, entry, &err) : NULL;
    pthread_mutex_unlock(&d->prog_lock);
    if (s != KILN_OK) return s;
    if (err != CL_SUCCESS) return cl_fail(d, "clCreateKernel", err);
    *kernel_out = k;
    return KILN_OK;
}

static void cl_kernel_free(kiln__backend *be, void *kernel)
{
    if (kernel) clReleaseKernel((cl_kernel)kernel);
}

/* While recording: a new kernel object for the same function, owned by the graph, to take
 * this launch's arguments. */
static kiln_status recording_kernel(cl_dev *d, cl_kernel k, cl_kernel *out)
{
    cl_graph *g = d->cap;
    cl_program prog;
    char name[128] = "";
    cl_int err = clGetKernelInfo(k, CL_KERNEL_PROGRAM, sizeof prog, &prog, NULL);
    if (err == CL_SUCCESS) err = clGetKernelInfo(k, CL_KERNEL_FUNCTION_NAME, sizeof name - 1, name, NULL);
    cl_kernel nk = err == CL_SUCCESS ? clCreateKernel(prog, name, &err) : NULL;
    if (err != CL_SUCCESS) return cl_fail(d, "clCreateKernel (recording)", err);
    if (g->n_k == g->cap_k) {
        int cap = g->cap_k ? 2 * g->cap_k : 256;
        cl_kernel *ks = realloc(g->k, sizeof *ks * (size_t)cap);
        if (!ks) {
            clReleaseKernel(nk);
            return kiln__err(KILN_ERR_OOM, "%s: out of memory recording a command buffer", d->name);
        }
        g->k = ks;
        g->cap_k = cap;
    }
    g->k[g->n_k++] = nk;
    *out = nk;
    return KILN_OK;
}

/* Each buffer argument goes as (cl_mem, byte offset into it): the generated kernels take
 * them in pairs. */
/* Whether this is the first run of a kernel at these sizes, which the caller then waits
 * for. PoCL generates a kernel's machine code for each work-group size when it first
 * runs, on its own threads. Left queued until the process exits (an update nobody read
 * back), that code generation runs from our atexit handler, after LLVM's own exit-time
 * destructors, and crashes (PoCL 3.1 on Debian 12, whenever its kernel cache is cold).
 * Waiting once per kernel and size costs a sync per new shape, nothing in a steady loop. */
enum { RAN_CAP = 4096 };

static bool first_run(cl_dev *d, cl_kernel k, const size_t *grid, const size_t *block, int dims)
{
    uint64_t h = kiln__fnv(KILN__FNV_SEED, &k, sizeof k);
    h = kiln__fnv(h, grid, (size_t)dims * sizeof *grid);
    if (block) h = kiln__fnv(h, block, (size_t)dims * sizeof *block);
    h |= 1; /* 0 marks an empty slot */
    if (!d->ran && !(d->ran = calloc(RAN_CAP, sizeof *d->ran))) return true;
    if (d->n_ran >= RAN_CAP / 2) { /* full: forget them all (each is waited for once more) */
        memset(d->ran, 0, RAN_CAP * sizeof *d->ran);
        d->n_ran = 0;
    }
    size_t i = h & (RAN_CAP - 1);
    while (d->ran[i] && d->ran[i] != h) i = (i + 1) & (RAN_CAP - 1);
    if (d->ran[i]) return false;
    d->ran[i] = h;
    d->n_ran++;
    return true;
}

static kiln_status cl_launch(kiln__backend *be, void *kernel, const kiln__karg *args, int nargs, const size_t *grid,
                             const size_t *block, int grid_dims)
{
    cl_dev *d = be->ctx;
    cl_kernel k = kernel;
    kiln_status s = KILN_OK;
    cl_uint ai = 0;
    cl_int err = CL_SUCCESS;
    pthread_mutex_lock(&d->prog_lock);
    if (d->cap && (s = recording_kernel(d, kernel, &k)) != KILN_OK) {
        pthread_mutex_unlock(&d->prog_lock);
        return s;
    }
    for (int i = 0; s == KILN_OK && err == CL_SUCCESS && i < nargs; i++) {
        if (args[i].kind == KILN__KARG_I64) {
            cl_long v = args[i].i64;
            err = clSetKernelArg(k, ai++, sizeof v, &v);
            continue;
        }
        if (args[i].kind == KILN__KARG_F32) {
            cl_float v = (cl_float)args[i].f;
            err = clSetKernelArg(k, ai++, sizeof v, &v);
            continue;
        }
        if (args[i].kind == KILN__KARG_F64) {
            cl_double v = args[i].f;
            err = clSetKernelArg(k, ai++, sizeof v, &v);
            continue;
        }
        cl_mem mem;
        size_t off;
        if ((s = resolve(d, args[i].ptr, 0, &mem, &off)) != KILN_OK) break;
        cl_ulong o = off;
        err = clSetKernelArg(k, ai++, sizeof mem, &mem);
        if (err == CL_SUCCESS) err = clSetKernelArg(k, ai++, sizeof o, &o);
    }
    if (s == KILN_OK && err != CL_SUCCESS) s = cl_fail(d, "clSetKernelArg", err);
    if (s == KILN_OK && d->cap) {
        cl_graph *g = d->cap;
        cl_sync_point_khr prev;
        err = d->cb_kernel(g->cb, NULL, NULL, k, (cl_uint)grid_dims, NULL, grid, block, after_last(g, &prev),
                           g->any ? &prev : NULL, &g->last, NULL);
        g->any |= err == CL_SUCCESS;
        if (err != CL_SUCCESS) s = cl_fail(d, "clCommandNDRangeKernelKHR", err);
    } else if (s == KILN_OK) {
        err = clEnqueueNDRangeKernel(d->q, k, (cl_uint)grid_dims, NULL, grid, block, 0, NULL, NULL);
        if (err != CL_SUCCESS) s = cl_fail(d, "clEnqueueNDRangeKernel", err);
        else if (first_run(d, k, grid, block, grid_dims) && (err = clFinish(d->q)) != CL_SUCCESS)
            s = cl_fail(d, "clFinish", err);
    }
    pthread_mutex_unlock(&d->prog_lock);
    return s;
}

/* ---- the backend's own kernels: what the compiler's lowering does not cover ---- */
/* Written by hand in kernels.cl (a tiled matmul, the in-place updates and the rest the
 * lowering leaves out), embedded at build time (cmake/embed.cmake). */
extern const char kiln__opencl_kernel_source[];

enum {
    BK_MATMUL, BK_MATMUL_SIMPLE, BK_ADD_, BK_SCALE_, BK_ADAMW_, BK_EMB, BK_EMB_BWD, BK_CE, BK_CE_BWD,
    BK_ATT, BK_ATT_DQ, BK_ATT_DKV, BK_NORM_DX, BK_NORM_DWB, BK_ADD_F64_, BK_CE_MEAN, BK_CE_SCALE, BK_COPY_ND, N_BK
};
static const char *const bk_names[N_BK] = {"kiln_matmul",       "kiln_matmul_simple", "kiln_add_",
                                           "kiln_scale_",       "kiln_adamw_",        "kiln_embedding",
                                           "kiln_embedding_backward", "kiln_ce_rows", "kiln_ce_backward",
                                           "kiln_attention",    "kiln_attention_dq",  "kiln_attention_dkv",
                                           "kiln_norm_dx",      "kiln_norm_dwb",      "kiln_add_f64_",      "kiln_ce_mean",       "kiln_ce_scale",      "kiln_copy_nd"};
static cl_kernel bk[MAX_CL_DEVICES][N_BK];

/* Builtin kernel `which` of the device, built on first use; NULL (with a message said
 * once) if the device cannot build it, and the op then runs on the cpu. */
static cl_kernel builtin(kiln__backend *be, int which)
{
    static pthread_mutex_t bk_lock = PTHREAD_MUTEX_INITIALIZER;
    static bool said;
    cl_dev *d = be->ctx;
    int di = (int)(d - devs);
    pthread_mutex_lock(&bk_lock);
    if (!bk[di][which]) {
        void *k = NULL;
        if (cl_compile_kernel(be, kiln__opencl_kernel_source, bk_names[which], &k) == KILN_OK) bk[di][which] = k;
        else {
            if (!said) fprintf(stderr, "kiln: %s: its own kernels do not build (%s); those ops run on the cpu\n",
                               d->name, kiln_last_error());
            said = true;
            kiln_clear_error();
        }
    }
    cl_kernel k = bk[di][which];
    pthread_mutex_unlock(&bk_lock);
    return k;
}

static kiln__karg buf_arg(const kiln_tensor_t *t) { return (kiln__karg){KILN__KARG_BUF, kiln__data(t), 0, 0}; }
static kiln__karg i64_arg(int64_t v) { return (kiln__karg){KILN__KARG_I64, NULL, v, 0}; }
static kiln__karg f_arg(kiln__karg_kind k, double v) { return (kiln__karg){k, NULL, 0, v}; }

static kiln_status ocl_matmul(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                              kiln_tensor_t *const *out, int n_out)
{
    const kiln_tensor_t *x = in[0], *y = in[1], *o = out[0];
    bool tiles = kiln__opt(KILN__OPT_CL_MATMUL_TILES);
    cl_kernel k = x->dtype == KILN_DTYPE_F32 && o->ndim <= 6 ? builtin(be, tiles ? BK_MATMUL : BK_MATMUL_SIMPLE) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_MATMUL, in, n_in, a, out, n_out);
    int nb = o->ndim - 2;
    int64_t M = o->shape[nb], N = o->shape[nb + 1], K = x->shape[x->ndim - 1];
    int64_t dsh[4] = {1, 1, 1, 1}, as[4] = {0, 0, 0, 0}, bs[4] = {0, 0, 0, 0};
    for (int d = 0; d < nb; d++) { /* batch dims right-aligned into 4; broadcast ones step 0 */
        int slot = 4 - nb + d, i = d - (nb - (x->ndim - 2)), j = d - (nb - (y->ndim - 2));
        dsh[slot] = o->shape[d];
        as[slot] = i >= 0 && x->shape[i] != 1 ? x->stride[i] : 0;
        bs[slot] = j >= 0 && y->shape[j] != 1 ? y->stride[j] : 0;
    }
    int64_t batch = dsh[0] * dsh[1] * dsh[2] * dsh[3];
    if (!M || !N || !batch) return KILN_OK;
    if (!K) return be->memset(be, kiln__data(o), 0, kiln_tensor_nbytes(o));
    kiln__karg args[] = {buf_arg(x), buf_arg(y), buf_arg(o), i64_arg(M), i64_arg(N), i64_arg(K),
                         i64_arg(x->stride[x->ndim - 2]), i64_arg(x->stride[x->ndim - 1]),
                         i64_arg(y->stride[y->ndim - 2]), i64_arg(y->stride[y->ndim - 1]), i64_arg(dsh[1]),
                         i64_arg(dsh[2]), i64_arg(dsh[3]), i64_arg(as[0]), i64_arg(as[1]), i64_arg(as[2]),
                         i64_arg(as[3]), i64_arg(bs[0]), i64_arg(bs[1]), i64_arg(bs[2]), i64_arg(bs[3])};
    /* 64x64 (or 16x16) tiles of the output per 16x16 work-group. */
    int64_t tile = tiles ? 64 : 16;
    size_t grid[3] = {(size_t)((N + tile - 1) / tile * 16), (size_t)((M + tile - 1) / tile * 16), (size_t)batch},
           block[3] = {16, 16, 1};
    return cl_launch(be, k, args, (int)(sizeof args / sizeof args[0]), grid, block, 3);
}

static bool contiguous_f32(const kiln_tensor_t *t) { return t->dtype == KILN_DTYPE_F32 && kiln__is_contiguous(t); }

static bool contiguous_as(const kiln_tensor_t *t, kiln_dtype dt) { return t->dtype == dt && kiln__is_contiguous(t); }

static kiln_status ocl_add_(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                            kiln_tensor_t *const *out, int n_out)
{
    int64_t n = kiln_tensor_numel(in[0]);
    kiln_dtype dt = in[0]->dtype;
    bool ok = (dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_F64) && contiguous_as(in[0], dt) && contiguous_as(in[1], dt) &&
              kiln_tensor_numel(in[1]) == n;
    cl_kernel k = ok ? builtin(be, dt == KILN_DTYPE_F64 ? BK_ADD_F64_ : BK_ADD_) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_ADD_, in, n_in, a, out, n_out);
    if (!n) return KILN_OK;
    kiln__karg args[] = {buf_arg(in[0]), buf_arg(in[1]), f_arg(dt == KILN_DTYPE_F64 ? KILN__KARG_F64 : KILN__KARG_F32, a->f[0]),
                         i64_arg(n)};
    size_t grid = (size_t)n;
    return cl_launch(be, k, args, 4, &grid, NULL, 1);
}

/* copy_: contiguous to contiguous as one device copy, other layouts of the same shape
 * (a source of as many elements is read as laid out like the destination when
 * contiguous) by kiln_copy_nd; broadcasts, dtype changes and other devices on the cpu. */
static kiln_status ocl_copy_(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                             kiln_tensor_t *const *out, int n_out)
{
    kiln_tensor_t *dst = in[0], *src = in[1];
    int64_t n = kiln_tensor_numel(dst);
    bool same_shape = src->ndim == dst->ndim && !memcmp(src->shape, dst->shape, sizeof(int64_t) * (size_t)dst->ndim);
    bool strided = !kiln__is_contiguous(dst) || !kiln__is_contiguous(src);
    if (dst->dtype != src->dtype || src->st->be != be || kiln_tensor_numel(src) != n || dst->ndim > 6 ||
        (!same_shape && !kiln__is_contiguous(src)) || (strided && dst->st == src->st)) /* one buffer: the cpu orders it */
        return kiln__cpu_fallback(be, KILN_OP_COPY_, in, n_in, a, out, n_out);
    if (!n) return KILN_OK;
    if (kiln__is_contiguous(dst) && kiln__is_contiguous(src))
        return cl_copy_d2d(be, kiln__data(dst), kiln__data(src), kiln_tensor_nbytes(dst));
    cl_kernel k = builtin(be, BK_COPY_ND);
    if (!k) return kiln__cpu_fallback(be, KILN_OP_COPY_, in, n_in, a, out, n_out);
    int64_t rs[KILN_MAX_DIMS];
    if (same_shape) memcpy(rs, src->stride, sizeof(int64_t) * (size_t)dst->ndim);
    else kiln__contiguous_strides(dst->ndim, dst->shape, rs);
    kiln__karg args[25] = {buf_arg(dst), buf_arg(src), i64_arg(n), i64_arg((int64_t)kiln_dtype_size(dst->dtype)),
                           i64_arg(dst->ndim)};
    for (int d = 0; d < 6; d++) {
        args[5 + d] = i64_arg(d < dst->ndim ? dst->shape[d] : 1);
        args[11 + d] = i64_arg(d < dst->ndim ? dst->stride[d] : 0);
        args[17 + d] = i64_arg(d < dst->ndim ? rs[d] : 0);
    }
    size_t grid = (size_t)n;
    return cl_launch(be, k, args, 23, &grid, NULL, 1);
}

static kiln_status ocl_scale_(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                              kiln_tensor_t *const *out, int n_out)
{
    int64_t n = kiln_tensor_numel(in[0]);
    cl_kernel k = contiguous_f32(in[0]) ? builtin(be, BK_SCALE_) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_SCALE_, in, n_in, a, out, n_out);
    if (!n) return KILN_OK;
    kiln__karg args[] = {buf_arg(in[0]), f_arg(KILN__KARG_F32, a->f[0]), i64_arg(n)};
    size_t grid = (size_t)n;
    return cl_launch(be, k, args, 3, &grid, NULL, 1);
}

static kiln_status ocl_adamw_(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                              kiln_tensor_t *const *out, int n_out)
{
    cl_kernel k = builtin(be, BK_ADAMW_); /* shapes and layouts were checked by inference */
    if (!k) return kiln__cpu_fallback(be, KILN_OP_ADAMW_, in, n_in, a, out, n_out);
    int64_t n = kiln_tensor_numel(in[0]);
    if (!n) return KILN_OK;
    double b1, b2, eps;
    memcpy(&b1, &a->shape[0], 8);
    memcpy(&b2, &a->shape[1], 8);
    memcpy(&eps, &a->shape[2], 8);
    int64_t f64s = (in[4]->dtype == KILN_DTYPE_F64) | (in[5]->dtype == KILN_DTYPE_F64) << 1 |
                   (in[6]->dtype == KILN_DTYPE_F64) << 2;
    kiln__karg args[] = {buf_arg(in[0]), buf_arg(in[1]), buf_arg(in[2]), buf_arg(in[3]), buf_arg(in[4]),
                         buf_arg(in[5]), buf_arg(in[6]), i64_arg(f64s), f_arg(KILN__KARG_F32, a->f[0]),
                         f_arg(KILN__KARG_F64, b1), f_arg(KILN__KARG_F64, b2), f_arg(KILN__KARG_F32, eps), i64_arg(n)};
    size_t grid = (size_t)n;
    return cl_launch(be, k, args, (int)(sizeof args / sizeof args[0]), &grid, NULL, 1);
}

static kiln_status cl_fill(kiln__backend *be, void *dst, const void *pattern, size_t size, size_t n);

static bool index_layout(const kiln_tensor_t *idx)
{
    return kiln__is_contiguous(idx) && (idx->dtype == KILN_DTYPE_I64 || idx->dtype == KILN_DTYPE_I32);
}

/* The device's error word (one int, 0 until a kernel raises it), made on first use:
 * eager code always runs before a capture, so it exists by the time one is recorded. */
static void *err_word(kiln__backend *be)
{
    cl_dev *d = be->ctx;
    if (d->err) return d->err;
    if (d->cap) {
        not_recordable(d, "the first use of the error word");
        return NULL;
    }
    int zero[16] = {0};
    void *p = cl_alloc(be, sizeof zero);
    if (!p) {
        kiln__err(KILN_ERR_OOM, "%s: out of device memory", d->name);
        return NULL;
    }
    if (cl_copy_h2d(be, p, zero, sizeof zero) != KILN_OK) {
        cl_free(be, p, sizeof zero);
        return NULL;
    }
    return d->err = p;
}

/* The indices on the host, checked as the cpu checks them (an index outside [0, limit)
 * is an error that names it), before an eager launch. While a capture is recorded there
 * is no host in between: the kernels check them into the error word instead. */
static kiln_status check_indices(kiln__backend *be, const char *op, const kiln_tensor_t *idx, int64_t limit)
{
    if (((cl_dev *)be->ctx)->cap) return KILN_OK;
    int64_t n = kiln_tensor_numel(idx);
    size_t sz = kiln_dtype_size(idx->dtype);
    char *h = malloc(sz * (size_t)(n ? n : 1));
    if (!h) return kiln__err(KILN_ERR_OOM, "%s: out of memory", op);
    kiln_status s = cl_copy_d2h(be, h, kiln__data(idx), sz * (size_t)n);
    for (int64_t i = 0; s == KILN_OK && i < n; i++) {
        int64_t v = kiln__load_index(h + i * (int64_t)sz, idx->dtype);
        if (v < 0 || v >= limit)
            s = kiln__err(KILN_ERR_INDEX, "%s: index %lld at position %lld is outside [0, %lld)", op, (long long)v,
                          (long long)i, (long long)limit);
    }
    free(h);
    return s;
}

static kiln_status ocl_embedding(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                 kiln_tensor_t *const *out, int n_out)
{
    const kiln_tensor_t *w = in[0], *idx = in[1];
    cl_kernel k = contiguous_f32(w) && index_layout(idx) ? builtin(be, BK_EMB) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_EMBEDDING, in, n_in, a, out, n_out);
    int64_t V = w->shape[0], C = w->shape[1], n = kiln_tensor_numel(idx);
    kiln_status s = check_indices(be, "embedding", idx, V);
    if (s != KILN_OK || !n || !C) return s;
    void *err = err_word(be);
    if (!err) return kiln_last_status();
    kiln__karg args[] = {buf_arg(w),  buf_arg(idx), buf_arg(out[0]), i64_arg(C), i64_arg(n),
                         i64_arg(idx->dtype == KILN_DTYPE_I64), i64_arg(V), {KILN__KARG_BUF, err, 0, 0}};
    size_t grid = (size_t)(n * C);
    return cl_launch(be, k, args, 8, &grid, NULL, 1);
}

static kiln_status ocl_embedding_backward(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                          kiln_tensor_t *const *out, int n_out)
{
    const kiln_tensor_t *g = in[0], *idx = in[1], *o = out[0];
    int64_t V = o->shape[0], C = o->shape[1];
    cl_kernel k = contiguous_f32(g) && o->dtype == KILN_DTYPE_F32 && index_layout(idx) ? builtin(be, BK_EMB_BWD) : NULL;
    if (!k) return kiln__cpu_fallback(be, KILN_OP_EMBEDDING_BACKWARD, in, n_in, a, out, n_out);
    kiln_status s = check_indices(be, "embedding backward", idx, V);
    if (s != KILN_OK || !C || !V) return s;
    void *err = err_word(be);
    if (!err) return kiln_last_status();
    kiln__karg args[] = {buf_arg(g), buf_arg(idx), buf_arg(o), i64_arg(C), i64_arg(kiln_tensor_numel(idx)), i64_arg(V),
                         i64_arg(idx->dtype == KILN_DTYPE_I64), {KILN__KARG_BUF, err, 0, 0}};
    size_t grid = (size_t)C;
    return cl_launch(be, k, args, 8, &grid, NULL, 1);
}

/* Cross-entropy targets on the host before an eager launch: each in [0, V) or the
 * ignore index, as the cpu checks them (while recording, the kernels do). */
static kiln_status ce_targets(kiln__backend *be, const kiln_tensor_t *t, int64_t V, int64_t ignore)
{
    if (((cl_dev *)be->ctx)->cap) return KILN_OK;
    int64_t n = kiln_tensor_numel(t);
    size_t sz = kiln_dtype_size(t->dtype);
    char *h = malloc(sz * (size_t)(n ? n : 1));
    if (!h) return kiln__err(KILN_ERR_OOM, "cross_entropy: out of memory");
    kiln_status s = cl_copy_d2h(be, h, kiln__data(t), sz * (size_t)n);
    for (int64_t i = 0; s == KILN_OK && i < n; i++) {
        int64_t v = kiln__load_index(h + i * (int64_t)sz, t->dtype);
        if (v != ignore && (v < 0 || v >= V))
            s = kiln__err(KILN_ERR_INDEX, "cross_entropy: target %lld at row %lld is outside [0, %lld) (and is not "
                          "ignore_index %lld)", (long long)v, (long long)i, (long long)V, (long long)ignore);
    }
    free(h);
    return s;
}

static bool ce_layout(const kiln_tensor_t *x, const kiln_tensor_t *t)
{
    return contiguous_f32(x) && index_layout(t);
}

/* The rows on the device, then their mean over the rows that count by one work-item in
 * row order (as the cpu sums): no value comes back to the host. */
static kiln_status ocl_cross_entropy(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                     kiln_tensor_t *const *out, int n_out)
{
    const kiln_tensor_t *x = in[0], *t = in[1];
    cl_kernel k = ce_layout(x, t) && out[1]->dtype == KILN_DTYPE_F32 ? builtin(be, BK_CE) : NULL;
    cl_kernel km = k ? builtin(be, BK_CE_MEAN) : NULL;
    if (!km) return kiln__cpu_fallback(be, KILN_OP_CROSS_ENTROPY, in, n_in, a, out, n_out);
    int64_t N = x->shape[0], V = x->shape[1], t64 = t->dtype == KILN_DTYPE_I64;
    kiln_status s = ce_targets(be, t, V, a->i[0]);
    if (s != KILN_OK) return s;
    if (!N) { /* no rows: the mean of nothing */
        float nan = NAN;
        return cl_fill(be, kiln__data(out[0]), &nan, sizeof nan, sizeof nan);
    }
    void *err = err_word(be), *dloss = err ? cl_alloc(be, sizeof(double) * (size_t)N) : NULL;
    if (!err) return kiln_last_status();
    if (!dloss) return kiln__err(KILN_ERR_OOM, "cross_entropy: out of device memory");
    kiln__karg args[] = {buf_arg(x), buf_arg(t), buf_arg(out[1]), {KILN__KARG_BUF, dloss, 0, 0}, i64_arg(N),
                         i64_arg(V), i64_arg(a->i[0]), i64_arg(t64), {KILN__KARG_BUF, err, 0, 0}};
    size_t grid = (size_t)N, one = 1;
    s = cl_launch(be, k, args, 9, &grid, NULL, 1);
    kiln__karg margs[] = {{KILN__KARG_BUF, dloss, 0, 0}, buf_arg(t), buf_arg(out[0]), i64_arg(N), i64_arg(V),
                          i64_arg(a->i[0]), i64_arg(t64), {KILN__KARG_BUF, err, 0, 0}};
    if (s == KILN_OK) s = cl_launch(be, km, margs, 8, &one, NULL, 1);
    cl_free(be, dloss, sizeof(double) * (size_t)N); /* in-order queue: after the kernels that read it */
    return s;
}

static kiln_status ocl_cross_entropy_backward(kiln__backend *be, kiln_tensor_t *const *in, int n_in,
                                              const kiln__attrs *a, kiln_tensor_t *const *out, int n_out)
{
    const kiln_tensor_t *g = in[0], *x = in[1], *t = in[2], *lse = in[3];
    bool ok = ce_layout(x, t) && contiguous_f32(lse) && g->dtype == KILN_DTYPE_F32;
    cl_kernel k = ok ? builtin(be, BK_CE_BWD) : NULL, ks = k ? builtin(be, BK_CE_SCALE) : NULL;
    if (!ks) return kiln__cpu_fallback(be, KILN_OP_CROSS_ENTROPY_BACKWARD, in, n_in, a, out, n_out);
    int64_t N = x->shape[0], V = x->shape[1], t64 = t->dtype == KILN_DTYPE_I64;
    kiln_status s = ce_targets(be, t, V, a->i[0]);
    if (s != KILN_OK || !N || !V) return s;
    void *err = err_word(be), *gs = err ? cl_alloc(be, sizeof(double)) : NULL;
    if (!err) return kiln_last_status();
    if (!gs) return kiln__err(KILN_ERR_OOM, "cross_entropy backward: out of device memory");
    kiln__karg sargs[] = {buf_arg(t), buf_arg(g), {KILN__KARG_BUF, gs, 0, 0}, i64_arg(N), i64_arg(V), i64_arg(a->i[0]),
                          i64_arg(t64), {KILN__KARG_BUF, err, 0, 0}};
    size_t one = 1, grid = (size_t)(N * V);
    s = cl_launch(be, ks, sargs, 8, &one, NULL, 1);
    kiln__karg args[] = {buf_arg(x), buf_arg(t), buf_arg(lse), buf_arg(out[0]), i64_arg(N), i64_arg(V), i64_arg(a->i[0]),
                         i64_arg(t64), {KILN__KARG_BUF, gs, 0, 0}, {KILN__KARG_BUF, err, 0, 0}};
    if (s == KILN_OK) s = cl_launch(be, k, args, 10, &grid, NULL, 1);
    cl_free(be, gs, sizeof(double));
    return s;
}

/* t itself when contiguous, else a contiguous copy on its device (through dispatch,
 * unrecorded: the kernel's own launch is what a replay repeats); a new reference. */
static kiln_tensor_t *dense(kiln_tensor_t *t)
{
    if (kiln__is_contiguous(t)) return kiln_tensor_retain(t);
    kiln__attrs a = {0};
    kiln_tensor_t *c = NULL;
    bool prev = kiln_set_grad_enabled(false);
    void *rec = kiln__replay_pause();
    kiln__dispatch(KILN_OP_CONTIGUOUS, &t, 1, &a, &c);
    kiln__replay_unpause(rec);
    kiln_set_grad_enabled(prev);
    return c;
}

/* q (B,H,Tq,D), k and v (B,Hkv,Tk,D), all f32, D within the kernels' rows. */
static bool att_layout(kiln_tensor_t *const *t, int n, int64_t D)
{
    for (int i = 0; i < n; i++)
        if (t[i]->dtype != KILN_DTYPE_F32) return false;
    return D <= 128;
}

/* 16 work-items a group, the grid rounded up to it (the kernels skip the spare ones). */
static size_t att_grid(int64_t n) { return (size_t)((n + 15) / 16 * 16); }
static const size_t att_block = 16;

/* Dense copies of t[0..n) into d (NULL where one failed); freed by undense. */
static bool densify(kiln_tensor_t *const *t, int n, kiln_tensor_t **d)
{
    bool ok = true;
    for (int i = 0; i < n; i++) ok &= (d[i] = dense(t[i])) != NULL;
    return ok;
}

static void undense(kiln_tensor_t **d, int n)
{
    for (int i = 0; i < n; i++) kiln_tensor_free(d[i]);
}

static kiln_status ocl_attention(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                 kiln_tensor_t *const *out, int n_out)
{
    const kiln_tensor_t *q = in[0], *k = in[1];
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], D = q->shape[3], Hkv = k->shape[1], Tk = k->shape[2];
    cl_kernel kern = att_layout(in, 3, D) && out[1]->dtype == KILN_DTYPE_F32 ? builtin(be, BK_ATT) : NULL;
    if (!kern) return kiln__cpu_fallback(be, KILN_OP_ATTENTION, in, n_in, a, out, n_out);
    kiln_tensor_t *c[3];
    kiln_status s = densify(in, 3, c) ? KILN_OK : kiln_last_status();
    size_t grid = att_grid(B * H * Tq);
    if (s == KILN_OK && grid) {
        kiln__karg args[] = {buf_arg(c[0]), buf_arg(c[1]), buf_arg(c[2]), buf_arg(out[0]), buf_arg(out[1]), i64_arg(B),
                             i64_arg(H), i64_arg(Hkv), i64_arg(Tq), i64_arg(Tk), i64_arg(D),
                             f_arg(KILN__KARG_F32, a->f[0]), i64_arg(a->i[0])};
        s = cl_launch(be, kern, args, 13, &grid, &att_block, 1);
    }
    undense(c, 3);
    return s;
}

/* in: g, q, k, v, o, lse -> dq, dk, dv */
static kiln_status ocl_attention_backward(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                          kiln_tensor_t *const *out, int n_out)
{
    const kiln_tensor_t *q = in[1], *k = in[2];
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], D = q->shape[3], Hkv = k->shape[1], Tk = k->shape[2];
    cl_kernel kq = att_layout(in, 6, D) ? builtin(be, BK_ATT_DQ) : NULL, kkv = kq ? builtin(be, BK_ATT_DKV) : NULL;
    if (!kq || !kkv) return kiln__cpu_fallback(be, KILN_OP_ATTENTION_BACKWARD, in, n_in, a, out, n_out);
    kiln__karg dims[] = {i64_arg(B), i64_arg(H), i64_arg(Hkv), i64_arg(Tq), i64_arg(Tk), i64_arg(D),
                         f_arg(KILN__KARG_F32, a->f[0]), i64_arg(a->i[0])};
    kiln_tensor_t *c[6];
    if (!densify(in, 6, c)) {
        undense(c, 6);
        return kiln_last_status();
    }
    kiln__karg aq[15], akv[16];
    for (int i = 0; i < 6; i++) aq[i] = akv[i] = buf_arg(c[i]);
    aq[6] = buf_arg(out[0]);
    akv[6] = buf_arg(out[1]);
    akv[7] = buf_arg(out[2]);
    memcpy(aq + 7, dims, sizeof dims);
    memcpy(akv + 8, dims, sizeof dims);
    size_t gq = att_grid(B * H * Tq), gkv = att_grid(B * Hkv * Tk);
    kiln_status s = gq ? cl_launch(be, kq, aq, 15, &gq, &att_block, 1) : KILN_OK;
    if (s == KILN_OK && gkv) s = cl_launch(be, kkv, akv, 16, &gkv, &att_block, 1);
    undense(c, 6);
    return s;
}

/* in: g, x, w, [mean,] rstd -> dx, dw, [db]: rows of C = the last dim. */
static kiln_status norm_backward(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                 kiln_tensor_t *const *out, int n_out)
{
    bool rms = op == KILN_OP_RMS_NORM_BACKWARD, ok = true;
    for (int i = 0; i < n_in; i++) ok &= in[i]->dtype == KILN_DTYPE_F32;
    cl_kernel kx = ok ? builtin(be, BK_NORM_DX) : NULL, kw = kx ? builtin(be, BK_NORM_DWB) : NULL;
    if (!kx || !kw) return kiln__cpu_fallback(be, op, in, n_in, a, out, n_out);
    kiln_tensor_t *c[5] = {NULL};
    if (!densify(in, n_in, c)) {
        undense(c, n_in);
        return kiln_last_status();
    }
    const kiln_tensor_t *x = c[1], *mean = c[3], *rstd = c[rms ? 3 : 4]; /* RMS: mean is not read */
    int64_t C = x->shape[x->ndim - 1], N = C ? kiln_tensor_numel(x) / C : 0;
    kiln__karg ax[] = {buf_arg(c[0]), buf_arg(x), buf_arg(c[2]), buf_arg(mean), buf_arg(rstd), buf_arg(out[0]),
                       i64_arg(N), i64_arg(C), i64_arg(rms)};
    kiln__karg aw[] = {buf_arg(c[0]), buf_arg(x), buf_arg(mean), buf_arg(rstd), buf_arg(out[1]),
                       buf_arg(rms ? out[1] : out[2]), i64_arg(N), i64_arg(C), i64_arg(rms)};
    size_t gn = (size_t)N, gc = (size_t)C;
    kiln_status s = gn && gc ? cl_launch(be, kx, ax, 9, &gn, NULL, 1) : KILN_OK;
    if (s == KILN_OK && gc) s = cl_launch(be, kw, aw, 9, &gc, NULL, 1);
    undense(c, n_in);
    return s;
}

static kiln_status ocl_layer_norm_backward(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                           kiln_tensor_t *const *out, int n_out)
{
    return norm_backward(be, KILN_OP_LAYER_NORM_BACKWARD, in, n_in, a, out, n_out);
}

static kiln_status ocl_rms_norm_backward(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                         kiln_tensor_t *const *out, int n_out)
{
    return norm_backward(be, KILN_OP_RMS_NORM_BACKWARD, in, n_in, a, out, n_out);
}

/* The contract's fill: the enqueued fill command (full, fill_ and copy_ are made from it
 * and copy_d2d by dispatch). */
static kiln_status cl_fill(kiln__backend *be, void *dst, const void *pattern, size_t size, size_t n)
{
    cl_dev *d = be->ctx;
    cl_mem mem;
    size_t off;
    kiln_status s = n ? resolve(d, dst, n, &mem, &off) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    if (off % size || n % size) return kiln__err(KILN_ERR_INTERNAL, "%s: a fill not aligned to its pattern", d->name);
    return fill_mem(d, mem, pattern, size, off, n);
}

/* ---- graph capture: cl_khr_command_buffer ---- */

static void graph_free(cl_dev *d, cl_graph *g)
{
    if (!g) return;
    if (g->pending) clReleaseEvent(g->pending);
    if (g->cb) d->cb_release(g->cb);
    for (int i = 0; i < g->n_k; i++) clReleaseKernel(g->k[i]);
    for (int i = 0; i < g->n_freed; i++) release_range(g->freed[i]);
    free(g->k);
    free(g->freed);
    free(g);
}

/* From here to capture_end the queue's work (kernels, device copies, fills) is recorded,
 * not run; anything else (a copy to or from the host) fails the capture. */
static kiln_status cl_capture_begin(kiln__backend *be)
{
    cl_dev *d = be->ctx;
    if (!d->cb_create)
        return kiln__err(KILN_ERR_UNSUPPORTED, "%s: the platform has no cl_khr_command_buffer", d->name);
    if (d->cap) return kiln__err(KILN_ERR_ARG, "%s: a capture is already being recorded", d->name);
    cl_graph *g = calloc(1, sizeof *g);
    if (!g) return kiln__err(KILN_ERR_OOM, "%s: out of memory", d->name);
    cl_int err;
    cl_command_buffer_properties_khr props[] = {CL_COMMAND_BUFFER_FLAGS_KHR, CL_COMMAND_BUFFER_SIMULTANEOUS_USE_KHR, 0};
    g->cb = d->cb_create(1, &d->q, d->cb_simultaneous ? props : NULL, &err);
    if (err != CL_SUCCESS) {
        free(g);
        return cl_fail(d, "clCreateCommandBufferKHR", err);
    }
    pthread_mutex_lock(&d->lock);
    d->cap = g;
    pthread_mutex_unlock(&d->lock);
    return KILN_OK;
}

static kiln_status cl_capture_end(kiln__backend *be, void **graph_out)
{
    cl_dev *d = be->ctx;
    *graph_out = NULL;
    pthread_mutex_lock(&d->lock);
    cl_graph *g = d->cap;
    d->cap = NULL;
    pthread_mutex_unlock(&d->lock);
    if (!g) return kiln__err(KILN_ERR_ARG, "%s: no capture is being recorded", d->name);
    kiln_status s = KILN_OK;
    if (g->failed) s = kiln__err(KILN_ERR_UNSUPPORTED, "%s: %s cannot be recorded into a command buffer", d->name, g->failed);
    cl_int err = s == KILN_OK ? d->cb_finalize(g->cb) : CL_SUCCESS;
    if (s == KILN_OK && err != CL_SUCCESS) s = cl_fail(d, "clFinalizeCommandBufferKHR", err);
    if (s != KILN_OK) {
        graph_free(d, g);
        return s;
    }
    *graph_out = g;
    return KILN_OK;
}

static kiln_status cl_replay(kiln__backend *be, void *graph)
{
    cl_dev *d = be->ctx;
    cl_graph *g = graph;
    if (g->pending) { /* a buffer without simultaneous use must have finished its last run */
        cl_int err = clWaitForEvents(1, &g->pending);
        clReleaseEvent(g->pending);
        g->pending = NULL;
        if (err != CL_SUCCESS) return cl_fail(d, "clWaitForEvents", err);
    }
    cl_int err = d->cb_enqueue(0, NULL, g->cb, 0, NULL, d->cb_simultaneous ? NULL : &g->pending);
    if (err != CL_SUCCESS) return cl_fail(d, "clEnqueueCommandBufferKHR", err);
    if (!g->ran) { /* its kernels' first runs: see first_run() */
        g->ran = true;
        if ((err = clFinish(d->q)) != CL_SUCCESS) return cl_fail(d, "clFinish", err);
    }
    if (!d->err) return KILN_OK;
    /* What the host checks before an eager launch the kernels checked: a bad index or
     * target makes this run's results meaningless, and is said. */
    int word = 0;
    kiln_status s = cl_copy_d2h(be, &word, d->err, sizeof word);
    if (s != KILN_OK || !word) return s;
    word = 0;
    if ((s = cl_copy_h2d(be, d->err, &word, sizeof word)) != KILN_OK) return s;
    return kiln__err(KILN_ERR_INDEX, "%s: an index or target outside its range (embedding or cross_entropy) in a "
                     "replayed step: its results are not valid (run the step eagerly to see which)", d->name);
}

static kiln_status cl_capture_reset(kiln__backend *be, void *graph)
{
    cl_dev *d = be->ctx;
    clFinish(d->q); /* the buffer may still be running */
    graph_free(d, graph);
    return KILN_OK;
}

/* The extension's entry points, when the device lists it. */
static void find_command_buffers(cl_dev *d, cl_platform_id plat)
{
    size_t n = 0;
    if (clGetDeviceInfo(d->dev, CL_DEVICE_EXTENSIONS, 0, NULL, &n) != CL_SUCCESS || !n) return;
    char *ext = malloc(n + 1);
    if (!ext) return;
    bool has = false;
    if (clGetDeviceInfo(d->dev, CL_DEVICE_EXTENSIONS, n, ext, NULL) == CL_SUCCESS) {
        ext[n] = 0;
        for (char *t = strtok(ext, " "); t && !has; t = strtok(NULL, " ")) has = !strcmp(t, "cl_khr_command_buffer");
    }
    free(ext);
    if (!has) return;
    /* The extension is provisional and its entry points changed after 0.9.4 (a properties
     * argument more): these calls are 0.9.0-0.9.4's. An OpenCL 3.0 platform says which
     * revision it has (CL_DEVICE_EXTENSIONS_WITH_VERSION, 0x1060); another is taken as one. */
    struct {
        cl_uint version;
        char name[64];
    } vers[256];
    size_t got = 0;
    if (clGetDeviceInfo(d->dev, 0x1060, sizeof vers, vers, &got) == CL_SUCCESS)
        for (size_t i = 0; i < got / sizeof vers[0]; i++)
            if (!strcmp(vers[i].name, "cl_khr_command_buffer")) {
                cl_uint v = vers[i].version, major = v >> 22, minor = (v >> 12) & 0x3ff, patch = v & 0xfff;
                if (major != 0 || minor != 9 || patch > 4) return; /* a revision these calls do not fit */
            }
#define GET(f, field) d->field = (f##_fn)clGetExtensionFunctionAddressForPlatform(plat, #f)
    GET(clCreateCommandBufferKHR, cb_create);
    GET(clCommandNDRangeKernelKHR, cb_kernel);
    GET(clCommandCopyBufferKHR, cb_copy);
    GET(clCommandFillBufferKHR, cb_fill);
    GET(clFinalizeCommandBufferKHR, cb_finalize);
    GET(clEnqueueCommandBufferKHR, cb_enqueue);
    GET(clReleaseCommandBufferKHR, cb_release);
#undef GET
    if (!d->cb_kernel || !d->cb_copy || !d->cb_fill || !d->cb_finalize || !d->cb_enqueue || !d->cb_release)
        d->cb_create = NULL; /* all or nothing */
    cl_bitfield caps = 0;
    clGetDeviceInfo(d->dev, CL_DEVICE_COMMAND_BUFFER_CAPABILITIES_KHR, sizeof caps, &caps, NULL);
    d->cb_simultaneous = (caps & CL_COMMAND_BUFFER_CAPABILITY_SIMULTANEOUS_USE_KHR) != 0;
}

static const kiln__kernel_fn cl_kernels[KILN_OP_COUNT] = {
    [KILN_OP_MATMUL] = ocl_matmul, [KILN_OP_ADD_] = ocl_add_,   [KILN_OP_SCALE_] = ocl_scale_, [KILN_OP_COPY_] = ocl_copy_,
    [KILN_OP_ADAMW_] = ocl_adamw_, [KILN_OP_EMBEDDING] = ocl_embedding, [KILN_OP_EMBEDDING_BACKWARD] = ocl_embedding_backward,
    [KILN_OP_CROSS_ENTROPY] = ocl_cross_entropy, [KILN_OP_CROSS_ENTROPY_BACKWARD] = ocl_cross_entropy_backward,
    [KILN_OP_ATTENTION] = ocl_attention, [KILN_OP_ATTENTION_BACKWARD] = ocl_attention_backward,
    [KILN_OP_LAYER_NORM_BACKWARD] = ocl_layer_norm_backward, [KILN_OP_RMS_NORM_BACKWARD] = ocl_rms_norm_backward,
};

static kiln_status open_device(cl_dev *d, cl_platform_id plat, cl_device_id dev, int index)
{
    cl_int err;
    d->dev = dev;
    snprintf(d->name, sizeof d->name, "opencl:%d", index);
    char pname[64] = "", dname[64] = "";
    clGetPlatformInfo(plat, CL_PLATFORM_NAME, sizeof pname - 1, pname, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof dname - 1, dname, NULL);
    snprintf(d->description, sizeof d->description, "OpenCL %s on %s", dname, pname);
    cl_ulong mem = 0;
    cl_uint units = 0;
    clGetDeviceInfo(dev, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof mem, &mem, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof units, &units, NULL);
    d->memory = (size_t)mem;
    d->units = (int)units;
    d->ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
    if (err != CL_SUCCESS) return cl_fail(d, "clCreateContext", err);
    d->q = clCreateCommandQueue(d->ctx, dev, 0, &err);
    if (err != CL_SUCCESS) {
        clReleaseContext(d->ctx);
        return cl_fail(d, "clCreateCommandQueue", err);
    }
    pthread_mutex_init(&d->lock, NULL);
    pthread_mutex_init(&d->prog_lock, NULL);
    clGetDeviceInfo(dev, CL_DRIVER_VERSION, sizeof d->driver - 1, d->driver, NULL);
    find_command_buffers(d, plat);
    if (d->cb_create) { /* kiln doctor says whether a replay can be the device's own graph */
        size_t n = strlen(d->description);
        snprintf(d->description + n, sizeof d->description - n, " (command buffers)");
    }
    return KILN_OK;
}

static int n_open;

/* At exit, every queue is finished first: work still queued (an in-place update nobody
 * read back) would otherwise be running, or being compiled by the platform's threads,
 * while the process tears down the platform's compiler under them (PoCL crashes so). */
static void finish_all(void)
{
    for (int i = 0; i < n_open; i++) clFinish(devs[i].q);
}

/* Registers every OpenCL device found; none (no platform, no ICD) is not an error. */
int kiln__opencl_register(void)
{
    cl_platform_id plats[8];
    cl_uint np = 0;
    if (clGetPlatformIDs(8, plats, &np) != CL_SUCCESS) return 0;
    int n = 0;
    for (cl_uint p = 0; p < np && n < MAX_CL_DEVICES; p++) {
        cl_device_id ids[MAX_CL_DEVICES];
        cl_uint nd = 0;
        if (clGetDeviceIDs(plats[p], CL_DEVICE_TYPE_ALL, MAX_CL_DEVICES, ids, &nd) != CL_SUCCESS) continue;
        for (cl_uint i = 0; i < nd && n < MAX_CL_DEVICES; i++) {
            if (open_device(&devs[n], plats[p], ids[i], n) != KILN_OK) {
                kiln_clear_error();
                continue;
            }
            kiln__backend *be = &cl_backends[n];
            *be = (kiln__backend){
                .abi_version = KILN_BACKEND_ABI_VERSION, .name = devs[n].name, .ctx = &devs[n],
                .device_info = ocl_device_info, .alloc = cl_alloc, .free = cl_free, .copy_h2d = cl_copy_h2d,
                .copy_d2h = cl_copy_d2h, .copy_d2d = cl_copy_d2d, .memset = cl_memset, .stream_new = cl_stream_new,
                .stream_free = cl_stream_free, .event_record = cl_event_record, .event_wait = cl_event_wait,
                .event_free = cl_event_free, .event_query = cl_event_query, .synchronize = cl_synchronize, .kernels = cl_kernels,
                .language = "opencl-c", .compile_kernel = cl_compile_kernel, .kernel_free = cl_kernel_free,
                .launch = cl_launch, .fill = cl_fill,
                /* not yet: pinned host memory */
            };
            if (devs[n].cb_create) {
                be->capture_begin = cl_capture_begin;
                be->capture_end = cl_capture_end;
                be->replay = cl_replay;
                be->capture_reset = cl_capture_reset;
            }
            if (kiln__backend_register(be) == KILN_OK) {
                n++;
                if (n_open++ == 0) atexit(finish_all);
                continue;
            }
            kiln_clear_error(); /* no room: the device is closed again */
            clReleaseCommandQueue(devs[n].q);
            clReleaseContext(devs[n].ctx);
        }
    }
    return n;
}
#endif
