/* The OpenCL devices (opencl_impl.h says what the backend is): opening and registering
 * every one found, buffers and the addresses that stand for them, copies and fills, the
 * queue as the stream, events.
 *
 * Memory. The core addresses a tensor as its storage's pointer plus a byte offset, and
 * the contract's copies take such addresses. An OpenCL buffer has no address, so each
 * one is given a range of the host's address space, reserved and never accessible
 * (mmap PROT_NONE, no memory behind it): pointer arithmetic inside a tensor then works
 * as on the cpu, and an address maps back to (buffer, offset) by a look-up in the sorted
 * table of ranges (under the device's lock). Reading such an address on the host faults
 * at once instead of reading garbage. Buffers are OpenCL 1.2 objects, so no shared
 * virtual memory is needed from the platform.
 *
 * Work goes to one in-order command queue per device (the "stream"); copies to the host
 * block, the rest is enqueued, or recorded while a capture is (opencl_capture.c). */
#ifdef KILN_HAVE_OPENCL
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include "backends/opencl/opencl_impl.h"
#include "kiln/tensor.h"

kiln_status kiln__opencl_fail(const cl_dev *d, const char *what, cl_int err)
{
    return kiln__err(KILN_ERR_DEVICE, "%s: %s failed with OpenCL error %d", d->name, what, (int)err);
}

/* Opens device dev of platform plat as "opencl:index" into d; its command buffers,
 * where the platform has them, too. */
static kiln_status open_device(cl_dev *d, cl_platform_id plat, cl_device_id dev, int index)
{
    cl_int err;
    d->dev = dev;
    d->plat = plat;
    d->index = index;
    snprintf(d->name, sizeof d->name, "opencl:%d", index);
    char pname[64] = "", dname[64] = "";
    clGetPlatformInfo(plat, CL_PLATFORM_NAME, sizeof pname - 1, pname, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof dname - 1, dname, NULL);
    snprintf(d->description, sizeof d->description, "OpenCL %s on %s", dname, pname);
    cl_ulong mem = 0;
    cl_uint units = 0;
    clGetDeviceInfo(dev, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof mem, &mem, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof units, &units, NULL);
    d->info = (kiln__device_info){d->name, d->description, (size_t)mem, (int)units};
    d->ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
    if (err != CL_SUCCESS) return kiln__opencl_fail(d, "clCreateContext", err);
    d->q = clCreateCommandQueue(d->ctx, dev, 0, &err);
    if (err != CL_SUCCESS) {
        clReleaseContext(d->ctx);
        return kiln__opencl_fail(d, "clCreateCommandQueue", err);
    }
    pthread_mutex_init(&d->lock, NULL);
    pthread_mutex_init(&d->prog_lock, NULL);
    clGetDeviceInfo(dev, CL_DRIVER_VERSION, sizeof d->driver - 1, d->driver, NULL);
    kiln__opencl_find_command_buffers(d, plat);
    if (d->cb_create) { /* kiln doctor says whether a replay can be the device's own graph */
        size_t n = strlen(d->description);
        snprintf(d->description + n, sizeof d->description - n, " (command buffers)");
    }
    return KILN_OK;
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
kiln_status kiln__opencl_resolve(cl_dev *d, const void *p, size_t n, cl_mem *mem, size_t *off)
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
    *out = ((cl_dev *)be->ctx)->info;
    return KILN_OK;
}

static void *ocl_alloc(kiln__backend *be, size_t nbytes)
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
    void *tmp;
    pthread_mutex_lock(&d->lock);
    if (!KILN__GROW(d->r, d->n_r, &d->cap_r, 64, tmp)) {
        pthread_mutex_unlock(&d->lock);
        clReleaseMemObject(mem);
        munmap(addr, n);
        return NULL;
    }
    int at = d->n_r;
    while (at > 0 && d->r[at - 1].base > (uintptr_t)addr) at--;
    memmove(&d->r[at + 1], &d->r[at], sizeof *d->r * (size_t)(d->n_r - at));
    d->r[at] = (cl_range){(uintptr_t)addr, n, mem};
    d->n_r++;
    pthread_mutex_unlock(&d->lock);
    return addr;
}

void kiln__opencl_release_range(cl_range r)
{
    clReleaseMemObject(r.mem);
    munmap((void *)r.base, r.n);
}

static void ocl_free(kiln__backend *be, void *ptr, size_t nbytes)
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
    bool kept = gone.mem && d->cap && kiln__opencl_keep_freed(d, gone);
    pthread_mutex_unlock(&d->lock);
    if (gone.mem && !kept) kiln__opencl_release_range(gone);
}

/* n bytes between the host and the device address dev, blocking: written to the
 * device (write), or read from it. */
static kiln_status transfer(kiln__backend *be, const void *dev, void *host, size_t n, bool write)
{
    cl_dev *d = be->ctx;
    cl_mem mem;
    size_t off;
    kiln_status s = n ? kiln__opencl_resolve(d, dev, n, &mem, &off) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    if (d->cap) return kiln__opencl_not_recordable(d, write ? "a copy from the host" : "a copy to the host");
    cl_int err = write ? clEnqueueWriteBuffer(d->q, mem, CL_TRUE, off, n, host, 0, NULL, NULL)
                       : clEnqueueReadBuffer(d->q, mem, CL_TRUE, off, n, host, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(d, write ? "clEnqueueWriteBuffer" : "clEnqueueReadBuffer", err);
}

static kiln_status ocl_copy_h2d(kiln__backend *be, void *dst, const void *src, size_t n)
{
    return transfer(be, dst, (void *)src, n, true);
}

static kiln_status ocl_copy_d2h(kiln__backend *be, void *dst, const void *src, size_t n)
{
    return transfer(be, src, dst, n, false);
}

static kiln_status ocl_copy_d2d(kiln__backend *be, void *dst, const void *src, size_t n)
{
    cl_dev *d = be->ctx;
    cl_mem md, ms;
    size_t od, os;
    kiln_status s = KILN_OK;
    if (!n) return KILN_OK;
    if ((s = kiln__opencl_resolve(d, dst, n, &md, &od)) != KILN_OK ||
        (s = kiln__opencl_resolve(d, src, n, &ms, &os)) != KILN_OK)
        return s;
    if (md == ms && od == os) return KILN_OK; /* onto itself */
    if (md == ms && (od < os + n && os < od + n)) { /* OpenCL forbids overlapping copies: through a device buffer */
        void *tmp = ocl_alloc(be, n);
        if (!tmp) return kiln__err(KILN_ERR_OOM, "%s: out of device memory for an overlapping copy", d->name);
        s = ocl_copy_d2d(be, tmp, src, n);
        if (s == KILN_OK) s = ocl_copy_d2d(be, dst, tmp, n);
        ocl_free(be, tmp, n); /* in-order queue: after the copies */
        return s;
    }
    if (d->cap) return kiln__opencl_record_copy(d, ms, md, os, od, n);
    cl_int err = clEnqueueCopyBuffer(d->q, ms, md, os, od, n, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(d, "clEnqueueCopyBuffer", err);
}

/* One in-order queue per device (the core's one stream): an event is a marker on it. */

static kiln__event *ocl_event_record(kiln__backend *be)
{
    cl_event e = NULL;
    return clEnqueueMarkerWithWaitList(((cl_dev *)be->ctx)->q, 0, NULL, &e) == CL_SUCCESS ? (kiln__event *)e : NULL;
}

static kiln_status ocl_event_wait(kiln__backend *be, kiln__event *e)
{
    cl_event ev = (cl_event)e;
    cl_int err = e ? clWaitForEvents(1, &ev) : CL_SUCCESS;
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(be->ctx, "clWaitForEvents", err);
}

static kiln_status ocl_event_query(kiln__backend *be, kiln__event *e, bool *done)
{
    cl_int state = CL_COMPLETE, err = e ? clGetEventInfo((cl_event)e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof state,
                                                         &state, NULL)
                                        : CL_SUCCESS;
    if (err == CL_SUCCESS && state < 0) err = state; /* the command failed */
    *done = state == CL_COMPLETE;
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(be->ctx, "clGetEventInfo", err);
}

static void ocl_event_free(kiln__backend *be, kiln__event *e)
{
    if (e) clReleaseEvent((cl_event)e);
}

static kiln_status ocl_synchronize(kiln__backend *be)
{
    cl_int err = clFinish(((cl_dev *)be->ctx)->q);
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(be->ctx, "clFinish", err);
}

/* The contract's fill: the enqueued fill command, or recorded while capturing (full,
 * fill_ and copy_ are made from it and copy_d2d by dispatch). */
static kiln_status ocl_fill(kiln__backend *be, void *dst, const void *pattern, size_t size, size_t n)
{
    cl_dev *d = be->ctx;
    cl_mem mem;
    size_t off;
    kiln_status s = n ? kiln__opencl_resolve(d, dst, n, &mem, &off) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    if (off % size || n % size) return kiln__err(KILN_ERR_INTERNAL, "%s: a fill not aligned to its pattern", d->name);
    if (d->cap) return kiln__opencl_record_fill(d, mem, pattern, size, off, n);
    cl_int err = clEnqueueFillBuffer(d->q, mem, pattern, size, off, n, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(d, "clEnqueueFillBuffer", err);
}

static kiln_status ocl_memset(kiln__backend *be, void *dst, int byte, size_t n)
{
    unsigned char pattern = (unsigned char)byte;
    return ocl_fill(be, dst, &pattern, 1, n);
}

/* ---- registration ---- */

static cl_dev devs[MAX_CL_DEVICES];
static kiln__backend cl_backends[MAX_CL_DEVICES];

static int n_open;

/* At exit, every queue is finished first: work still queued (an in-place update nobody
 * read back) would otherwise be running, or being compiled by the platform's threads,
 * while the process tears down the platform's compiler under them (PoCL crashes so). */
static void finish_all(void)
{
    for (int i = 0; i < n_open; i++) clFinish(devs[i].q);
}

/* Registers every OpenCL device found; none (no platform, no ICD) is not an error. */
static int opencl_register(int nthreads)
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
            /* Capture where the platform has command buffers; not yet: pinned host memory. */
            bool cb = devs[n].cb_create != NULL;
            *be = (kiln__backend){
                .abi_version = KILN_BACKEND_ABI_VERSION,
                .name = devs[n].name,
                .ctx = &devs[n],
                .device_info = ocl_device_info,
                .alloc = ocl_alloc,
                .free = ocl_free,
                .copy_h2d = ocl_copy_h2d,
                .copy_d2h = ocl_copy_d2h,
                .copy_d2d = ocl_copy_d2d,
                .memset = ocl_memset,
                .event_record = ocl_event_record,
                .event_wait = ocl_event_wait,
                .event_free = ocl_event_free,
                .synchronize = ocl_synchronize,
                .kernels = kiln__opencl_kernels,
                .language = "opencl-c",
                .compile_kernel = kiln__opencl_compile_kernel,
                .kernel_free = kiln__opencl_kernel_free,
                .launch = kiln__opencl_launch,
                .fill = ocl_fill,
                .event_query = ocl_event_query,
                .capture_begin = cb ? kiln__opencl_capture_begin : NULL,
                .capture_end = cb ? kiln__opencl_capture_end : NULL,
                .replay = cb ? kiln__opencl_replay : NULL,
                .capture_reset = cb ? kiln__opencl_capture_reset : NULL,
            };
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
KILN__REGISTER(register_opencl) { kiln__backend_provider_register("opencl", opencl_register, false); }

int kiln_opencl_platforms(kiln_opencl_platform *out, int max)
{
    kiln_device_count(); /* the devices are opened when first listed */
    cl_platform_id plats[8];
    cl_uint np = 0;
    if (clGetPlatformIDs(8, plats, &np) != CL_SUCCESS) return 0;
    for (int p = 0; p < (int)np && p < max; p++) {
        kiln_opencl_platform *o = &out[p];
        memset(o, 0, sizeof *o);
        clGetPlatformInfo(plats[p], CL_PLATFORM_NAME, sizeof o->name - 1, o->name, NULL);
        clGetPlatformInfo(plats[p], CL_PLATFORM_VERSION, sizeof o->version - 1, o->version, NULL);
        for (int i = 0; i < n_open; i++)
            if (devs[i].plat == plats[p]) o->devices++, o->command_buffers += devs[i].cb_create != NULL;
    }
    return (int)np;
}
#else
#include "kiln/tensor.h"
int kiln_opencl_platforms(kiln_opencl_platform *out, int max)
{
    (void)out, (void)max;
    return -1;
}
#endif
