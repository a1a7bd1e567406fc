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
 * it without building. The kernel table itself is empty: an op neither it nor the
 * compiler covers runs on the cpu with copies (src/core/dispatch.c). */
#ifdef KILN_HAVE_OPENCL
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "core/cache.h"
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
    char name[16];       /* "opencl:N" */
    char description[160];
    size_t memory;
    int units;
    pthread_mutex_t lock; /* guards the ranges */
    cl_range *r;
    int n_r, cap_r;
    pthread_mutex_t prog_lock; /* guards the programs and kernel launches (argument setting) */
    struct cl_prog *progs;
    char driver[128];
} cl_dev;

/* A built program, by the hash of its source. */
typedef struct cl_prog {
    uint64_t hash;
    cl_program p;
    struct cl_prog *next;
} cl_prog;

static cl_dev devs[MAX_CL_DEVICES];
static kiln__backend cl_backends[MAX_CL_DEVICES];
static const kiln__kernel_fn cl_kernels[KILN_OP_COUNT]; /* none yet: the cpu runs them with copies */

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
    pthread_mutex_unlock(&d->lock);
    if (!gone.mem) return;
    clReleaseMemObject(gone.mem);
    munmap((void *)gone.base, gone.n);
}

static kiln_status cl_copy_h2d(kiln__backend *be, void *dst, const void *src, size_t n)
{
    cl_dev *d = be->ctx;
    cl_mem mem;
    size_t off;
    kiln_status s = n ? resolve(d, dst, n, &mem, &off) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    cl_int err = clEnqueueWriteBuffer(d->q, mem, CL_TRUE, off, n, src, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : cl_fail(d, "clEnqueueWriteBuffer", err);
}

static kiln_status cl_copy_d2h(kiln__backend *be, void *dst, const void *src, size_t n)
{
    cl_dev *d = be->ctx;
    cl_mem mem;
    size_t off;
    kiln_status s = n ? resolve(d, src, n, &mem, &off) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    cl_int err = clEnqueueReadBuffer(d->q, mem, CL_TRUE, off, n, dst, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : cl_fail(d, "clEnqueueReadBuffer", err);
}

static kiln_status cl_copy_d2d(kiln__backend *be, void *dst, const void *src, size_t n)
{
    cl_dev *d = be->ctx;
    cl_mem md, ms;
    size_t od, os;
    kiln_status s = KILN_OK;
    if (!n) return KILN_OK;
    if ((s = resolve(d, dst, n, &md, &od)) != KILN_OK || (s = resolve(d, src, n, &ms, &os)) != KILN_OK) return s;
    if (md == ms && (od < os + n && os < od + n)) { /* OpenCL forbids overlapping copies: go through the host */
        void *tmp = malloc(n);
        if (!tmp) return kiln__err(KILN_ERR_OOM, "%s: out of host memory for an overlapping copy", d->name);
        s = cl_copy_d2h(be, tmp, src, n);
        if (s == KILN_OK) s = cl_copy_h2d(be, dst, tmp, n);
        free(tmp);
        return s;
    }
    cl_int err = clEnqueueCopyBuffer(d->q, ms, md, os, od, n, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : cl_fail(d, "clEnqueueCopyBuffer", err);
}

static kiln_status cl_memset(kiln__backend *be, void *dst, int byte, size_t n)
{
    cl_dev *d = be->ctx;
    cl_mem mem;
    size_t off;
    kiln_status s = n ? resolve(d, dst, n, &mem, &off) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    unsigned char pattern = (unsigned char)byte;
    cl_int err = clEnqueueFillBuffer(d->q, mem, &pattern, 1, off, n, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : cl_fail(d, "clEnqueueFillBuffer", err);
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

/* Each buffer argument goes as (cl_mem, byte offset into it): the generated kernels take
 * them in pairs. */
static kiln_status cl_launch(kiln__backend *be, void *kernel, const kiln__karg *args, int nargs, const size_t *grid,
                             int grid_dims)
{
    cl_dev *d = be->ctx;
    cl_kernel k = kernel;
    kiln_status s = KILN_OK;
    cl_uint ai = 0;
    cl_int err = CL_SUCCESS;
    pthread_mutex_lock(&d->prog_lock);
    for (int i = 0; s == KILN_OK && err == CL_SUCCESS && i < nargs; i++) {
        if (args[i].kind == KILN__KARG_I64) {
            cl_long v = args[i].i64;
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
    if (s == KILN_OK) {
        err = clEnqueueNDRangeKernel(d->q, k, (cl_uint)grid_dims, NULL, grid, NULL, 0, NULL, NULL);
        if (err != CL_SUCCESS) s = cl_fail(d, "clEnqueueNDRangeKernel", err);
    }
    pthread_mutex_unlock(&d->prog_lock);
    return s;
}

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
    return KILN_OK;
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
                .event_free = cl_event_free, .synchronize = cl_synchronize, .kernels = cl_kernels,
                .language = "opencl-c", .compile_kernel = cl_compile_kernel, .kernel_free = cl_kernel_free,
                .launch = cl_launch,
                /* not yet: pinned host memory, graph capture */
            };
            if (kiln__backend_register(be) == KILN_OK) n++;
            else kiln_clear_error();
        }
    }
    return n;
}
#endif
