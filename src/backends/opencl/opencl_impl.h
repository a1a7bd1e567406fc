/* What the OpenCL backend's files share: the device, its address ranges, and the
 * functions one file gives the others. Private to src/backends/opencl/.
 *
 * The backend is one registered backend per OpenCL device ("opencl:0", ...), through the
 * ICD loader, so any installed platform works (PoCL on these machines). Kernels come
 * from source: the compiler's generated ones and the backend's own (kernels.cl); an op
 * neither they nor the compiler cover runs on the cpu with copies (src/core/dispatch.c).
 *
 *   opencl_device.c   the devices: opening and registering every one found, the backend
 *                     table, memory (address ranges), copies, fills, events
 *   opencl_program.c  programs from source, the program cache, kernel launches
 *   opencl_capture.c  graph capture into cl_khr_command_buffer
 *   opencl_ops.c      the op kernels' host side (their device side is kernels.cl) */
#ifndef KILN_BACKENDS_OPENCL_IMPL_H
#define KILN_BACKENDS_OPENCL_IMPL_H

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <CL/cl_ext.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include "core/backend.h"
#include "core/intercept.h"
#include "core/util.h"

#define MAX_CL_DEVICES 4

/* A buffer and the range of host addresses that stands for it (opencl_device.c). */
typedef struct {
    uintptr_t base;
    size_t n;
    cl_mem mem;
} cl_range;

typedef struct {
    cl_context ctx;
    cl_command_queue q;
    cl_device_id dev;
    cl_platform_id plat; /* whose device it is (kiln doctor counts by platform) */
    int index;           /* N of "opencl:N" */
    char name[24];       /* "opencl:N" */
    char description[160];
    kiln__device_info info; /* names the two above */
    pthread_mutex_t lock; /* guards the ranges */
    cl_range *r;
    int n_r;
    size_t cap_r;
    pthread_mutex_t prog_lock; /* guards the programs and kernel launches (argument setting) */
    struct cl_prog *progs;     /* opencl_program.c */
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
    struct cl_graph *cap; /* being recorded: work goes into it instead of the queue (opencl_capture.c) */
    void *err; /* the error word: kernels raise a bad index in it where the host cannot check */
    uint64_t *ran; /* launches run before, by hash of kernel and sizes: first_run() (under prog_lock) */
    int n_ran;
} cl_dev;

/* The kernels' source, kernels.cl embedded at build time (cmake/embed.cmake). */
extern const char kiln__opencl_kernel_source[];

/* ---- opencl_device.c ---- */

/* A KILN_ERR_DEVICE naming the device, the call and the OpenCL error; returned. */
kiln_status kiln__opencl_fail(const cl_dev *d, const char *what, cl_int err);
/* (buffer, offset) of the n bytes at address p, all inside one buffer. */
kiln_status kiln__opencl_resolve(cl_dev *d, const void *p, size_t n, cl_mem *mem, size_t *off);
/* Releases a range's buffer and its addresses. */
void kiln__opencl_release_range(cl_range r);

/* ---- opencl_program.c ---- */

kiln_status kiln__opencl_compile_kernel(kiln__backend *be, const char *source, const char *entry, void **kernel_out);
void kiln__opencl_kernel_free(kiln__backend *be, void *kernel);
kiln_status kiln__opencl_launch(kiln__backend *be, void *kernel, const kiln__karg *args, int nargs, const size_t *grid,
                                const size_t *block, int grid_dims);

/* ---- opencl_capture.c ---- */

/* Finds the cl_khr_command_buffer entry points when the device lists the extension at a
 * revision these calls fit; d->cb_create stays NULL otherwise. */
void kiln__opencl_find_command_buffers(cl_dev *d, cl_platform_id plat);
/* While recording (d->cap set): the first thing that cannot go into a command buffer
 * fails the capture, and is what capture_end reports; returns the error. */
kiln_status kiln__opencl_not_recordable(cl_dev *d, const char *what);
/* While recording, with d->lock held: keeps a freed buffer's range until the graph goes
 * (a recorded command may name it). False when it was not kept and may be released. */
bool kiln__opencl_keep_freed(cl_dev *d, cl_range r);
/* While recording: a device copy, a fill, or a launch of k (its arguments set) as the
 * next command of the buffer, waiting on the one before. */
kiln_status kiln__opencl_record_copy(cl_dev *d, cl_mem src, cl_mem dst, size_t src_off, size_t dst_off, size_t n);
kiln_status kiln__opencl_record_fill(cl_dev *d, cl_mem mem, const void *pattern, size_t size, size_t off, size_t n);
kiln_status kiln__opencl_record_launch(cl_dev *d, cl_kernel k, int dims, const size_t *grid, const size_t *block);
/* While recording: a new kernel object for the same function as k, owned by the graph,
 * to take one launch's arguments. */
kiln_status kiln__opencl_record_kernel(cl_dev *d, cl_kernel k, cl_kernel *out);
/* The contract's capture entries. */
kiln_status kiln__opencl_capture_begin(kiln__backend *be);
kiln_status kiln__opencl_capture_end(kiln__backend *be, void **graph_out);
kiln_status kiln__opencl_replay(kiln__backend *be, void *graph);
kiln_status kiln__opencl_capture_reset(kiln__backend *be, void *graph);

/* ---- opencl_ops.c ---- */

/* The op kernels, by op id; NULL where the op is left to the compiler or the cpu. */
extern const kiln__kernel_fn kiln__opencl_kernels[KILN_OP_COUNT];

#endif
