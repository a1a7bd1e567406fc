/* An OpenCL device and its memory: opening it, buffers and the addresses that stand for
 * them, copies and fills, the queue as the stream, events.
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

/* Opens the device; its command buffers, where the platform has them, too. */
kiln_status kiln__opencl_open_device(cl_dev *d, cl_platform_id plat, cl_device_id dev, int index)
{
    cl_int err;
    d->dev = dev;
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

kiln_status kiln__opencl_device_info(kiln__backend *be, kiln__device_info *out)
{
    *out = ((cl_dev *)be->ctx)->info;
    return KILN_OK;
}

void *kiln__opencl_alloc(kiln__backend *be, size_t nbytes)
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

void kiln__opencl_release_range(cl_range r)
{
    clReleaseMemObject(r.mem);
    munmap((void *)r.base, r.n);
}

void kiln__opencl_free(kiln__backend *be, void *ptr, size_t nbytes)
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

kiln_status kiln__opencl_copy_h2d(kiln__backend *be, void *dst, const void *src, size_t n)
{
    return transfer(be, dst, (void *)src, n, true);
}

kiln_status kiln__opencl_copy_d2h(kiln__backend *be, void *dst, const void *src, size_t n)
{
    return transfer(be, src, dst, n, false);
}

kiln_status kiln__opencl_copy_d2d(kiln__backend *be, void *dst, const void *src, size_t n)
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
        void *tmp = kiln__opencl_alloc(be, n);
        if (!tmp) return kiln__err(KILN_ERR_OOM, "%s: out of device memory for an overlapping copy", d->name);
        s = kiln__opencl_copy_d2d(be, tmp, src, n);
        if (s == KILN_OK) s = kiln__opencl_copy_d2d(be, dst, tmp, n);
        kiln__opencl_free(be, tmp, n); /* in-order queue: after the copies */
        return s;
    }
    if (d->cap) return kiln__opencl_record_copy(d, ms, md, os, od, n);
    cl_int err = clEnqueueCopyBuffer(d->q, ms, md, os, od, n, 0, NULL, NULL);
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(d, "clEnqueueCopyBuffer", err);
}

kiln_status kiln__opencl_memset(kiln__backend *be, void *dst, int byte, size_t n)
{
    unsigned char pattern = (unsigned char)byte;
    return kiln__opencl_fill(be, dst, &pattern, 1, n);
}

/* One in-order queue per device (the core's one stream): an event is a marker on it. */

kiln__event *kiln__opencl_event_record(kiln__backend *be, kiln__stream *s)
{
    cl_event e = NULL;
    return clEnqueueMarkerWithWaitList(((cl_dev *)be->ctx)->q, 0, NULL, &e) == CL_SUCCESS ? (kiln__event *)e : NULL;
}

kiln_status kiln__opencl_event_wait(kiln__backend *be, kiln__event *e)
{
    cl_event ev = (cl_event)e;
    cl_int err = e ? clWaitForEvents(1, &ev) : CL_SUCCESS;
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(be->ctx, "clWaitForEvents", err);
}

kiln_status kiln__opencl_event_query(kiln__backend *be, kiln__event *e, bool *done)
{
    cl_int state = CL_COMPLETE, err = e ? clGetEventInfo((cl_event)e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof state,
                                                         &state, NULL)
                                        : CL_SUCCESS;
    if (err == CL_SUCCESS && state < 0) err = state; /* the command failed */
    *done = state == CL_COMPLETE;
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(be->ctx, "clGetEventInfo", err);
}

void kiln__opencl_event_free(kiln__backend *be, kiln__event *e)
{
    if (e) clReleaseEvent((cl_event)e);
}

kiln_status kiln__opencl_synchronize(kiln__backend *be)
{
    cl_int err = clFinish(((cl_dev *)be->ctx)->q);
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(be->ctx, "clFinish", err);
}

/* The contract's fill: the enqueued fill command, or recorded while capturing (full,
 * fill_ and copy_ are made from it and copy_d2d by dispatch). */
kiln_status kiln__opencl_fill(kiln__backend *be, void *dst, const void *pattern, size_t size, size_t n)
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
#endif
