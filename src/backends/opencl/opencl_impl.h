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
 *   opencl_ops.c      the op kernels' host side (their device side is kernels.cl)
 *   opencl_moe.c      the same for the mixture-of-experts routing ops */
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

/* The kernels of kernels.cl that the ops launch: BK_<name>, entry point kiln_<name>;
 * built per device. */
#define BUILTINS(X)                                                                                     \
    X(matmul) X(matmul_bf16) X(matmul_f16) X(matmul_simple) X(add_) X(add_f64_) X(scale_) X(adamw_) X(embedding) X(embedding_backward) \
    X(ce_rows) X(ce_count) X(ce_backward) X(attention) X(attention_dq) X(attention_dkv) X(attention_bf16)         \
    X(attention_dq_bf16) X(attention_dkv_bf16) X(attention_f16) X(attention_dq_f16) X(attention_dkv_f16)       \
    X(norm_dx) X(norm_dwb) \
    X(copy_nd) \
    X(topk) X(moe_sort) X(grouped) X(grouped_f64) X(grouped_bf16) X(grouped_f16) X(grouped_dw) X(grouped_dw_f64) \
    X(grouped_dw_bf16) X(grouped_dw_f16)
#define BK_ENUM(name) BK_##name,
enum { BUILTINS(BK_ENUM) N_BK };

/* What a kernel raises in the device's error word, one bit each (kernels.cl's ERR_*), so
 * that the replay which reads the word can say what was wrong. */
enum { KILN__CL_ERR_INDEX = 1, KILN__CL_ERR_EXPERT = 2, KILN__CL_ERR_OFFSETS = 4 };

/* Builtin kernel `which` (BK_*) of the device, built on first use; NULL (with a message
 * said once) if the device cannot build it, and the op then runs on the cpu. */
cl_kernel kiln__opencl_builtin(kiln__backend *be, int which);
/* The device's error word (one int, 0 until a kernel raises it), made on first use:
 * eager code always runs before a capture, so it exists by the time one is recorded.
 * NULL, with the error set, when it cannot be made. */
void *kiln__opencl_err_word(kiln__backend *be);
/* The indices idx (contiguous) on the host, checked as the cpu checks them (an index
 * outside [0, limit) is an error that names it), before an eager launch; cross-entropy
 * targets (ignore given) may also be the ignore index. While a capture is recorded there
 * is no host in between: the kernels check them into the error word instead. */
kiln_status kiln__opencl_check_indices(kiln__backend *be, const char *op, const kiln_tensor_t *idx, int64_t limit,
                                      const int64_t *ignore);

/* Kernel arguments: a buffer (by its address), an integer, a float of the given kind. */
static inline kiln__karg kiln__opencl_ptr_arg(const void *p) { return (kiln__karg){KILN__KARG_BUF, p, 0, 0}; }
static inline kiln__karg kiln__opencl_i64_arg(int64_t v) { return (kiln__karg){KILN__KARG_I64, NULL, v, 0}; }
static inline kiln__karg kiln__opencl_f_arg(kiln__karg_kind k, double v) { return (kiln__karg){k, NULL, 0, v}; }

/* ---- opencl_moe.c ---- */

kiln_status kiln__opencl_topk(KILN__KERNEL_ARGS);
kiln_status kiln__opencl_moe_sort(KILN__KERNEL_ARGS);
kiln_status kiln__opencl_grouped_matmul(KILN__KERNEL_ARGS);
kiln_status kiln__opencl_grouped_matmul_backward(KILN__KERNEL_ARGS);

#endif
