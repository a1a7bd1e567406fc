/* The backend contract. A backend is a versioned table of function pointers plus a
 * context pointer, registered by name. The core reaches a device only through it.
 * Required entries must be set; optional ones may be NULL, and the core then falls
 * back or reports KILN_ERR_UNSUPPORTED naming the backend. */
#ifndef KILN_CORE_BACKEND_H
#define KILN_CORE_BACKEND_H

#include <stddef.h>
#include "kiln/tensor.h"
#include "core/attrs.h"

#define KILN_BACKEND_ABI_VERSION 5

typedef struct kiln__backend kiln__backend;
typedef struct kiln__event kiln__event;

/* One op's kernel on one backend. in[i] and out[j] are device tensors whose storage
 * belongs to this backend; outputs are allocated, contiguous, and uninitialised. */
typedef kiln_status (*kiln__kernel_fn)(kiln__backend *be, kiln_tensor_t *const *in, int n_in,
                                       const kiln__attrs *a, kiln_tensor_t *const *out, int n_out);
/* Those parameters, for defining a kernel: kiln_status my_kernel(KILN__KERNEL_ARGS). */
#define KILN__KERNEL_ARGS \
    kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t *const *out, int n_out

/* An argument of a launched kernel: a device address in this backend's memory (the
 * backend passes it in its language's form, e.g. an OpenCL buffer and offset), or a
 * 64-bit integer. */
typedef enum { KILN__KARG_BUF, KILN__KARG_I64, KILN__KARG_F32, KILN__KARG_F64 } kiln__karg_kind;
typedef struct {
    kiln__karg_kind kind;
    const void *ptr; /* BUF */
    int64_t i64;     /* I64 */
    double f;        /* F32 (passed as float), F64 */
} kiln__karg;

typedef struct {
    const char *name;        /* "cpu", "opencl", ... */
    const char *description; /* for kiln doctor */
    size_t total_memory;     /* bytes, 0 if unknown */
    int compute_units;
} kiln__device_info;

struct kiln__backend {
    int abi_version; /* KILN_BACKEND_ABI_VERSION */
    const char *name;
    void *ctx;

    /* Required. */
    kiln_status (*device_info)(kiln__backend *be, kiln__device_info *out);
    void *(*alloc)(kiln__backend *be, size_t nbytes); /* NULL when out of memory */
    void (*free)(kiln__backend *be, void *ptr, size_t nbytes);
    kiln_status (*copy_h2d)(kiln__backend *be, void *dst, const void *src, size_t n);
    kiln_status (*copy_d2h)(kiln__backend *be, void *dst, const void *src, size_t n);
    kiln_status (*copy_d2d)(kiln__backend *be, void *dst, const void *src, size_t n);
    kiln_status (*memset)(kiln__backend *be, void *dst, int byte, size_t n);
    kiln__event *(*event_record)(kiln__backend *be); /* a marker after the work queued so far */
    kiln_status (*event_wait)(kiln__backend *be, kiln__event *e);
    void (*event_free)(kiln__backend *be, kiln__event *e);
    kiln_status (*synchronize)(kiln__backend *be);
    /* One kernel per op id; NULL where the backend lacks that op. */
    const kiln__kernel_fn *kernels;

    /* Optional. A kernel from source in the backend's language (language names it:
     * "opencl-c", "cuda-c"), kept until kernel_free; launched over grid[0..grid_dims)
     * work-items with its arguments in order. The compiler's eager path uses these for
     * the ops a backend has no kernel of its own for (src/compile/eager.c). */
    const char *language;
    kiln_status (*compile_kernel)(kiln__backend *be, const char *source, const char *entry,
                                  void **kernel_out);
    void (*kernel_free)(kiln__backend *be, void *kernel);
    kiln_status (*launch)(kiln__backend *be, void *kernel, const kiln__karg *args, int nargs,
                          const size_t *grid, const size_t *block, int grid_dims); /* block NULL: any */
    /* Fills n bytes at dst with a pattern of size bytes (1, 2, 4 or 8) repeated: with
     * copy_d2d it gives every backend full, fill_ and copy_ (src/core/dispatch.c). */
    kiln_status (*fill)(kiln__backend *be, void *dst, const void *pattern, size_t size, size_t n);
    /* Makes the device current on this thread and gives its native stream (a
     * cudaStream_t, a cl_command_queue): what a communication library (NCCL) enqueues on. */
    void *(*native_stream)(kiln__backend *be);
    /* Whether the work before event e has finished, without waiting: what a collective
     * on the device polls against its deadline (src/dist/nccl.c). */
    kiln_status (*event_query)(kiln__backend *be, kiln__event *e, bool *done);
    kiln_status (*host_register)(kiln__backend *be, void *ptr, size_t n);
    kiln_status (*host_unregister)(kiln__backend *be, void *ptr);
    kiln_status (*capture_begin)(kiln__backend *be);
    kiln_status (*capture_end)(kiln__backend *be, void **graph_out);
    kiln_status (*replay)(kiln__backend *be, void *graph);
    kiln_status (*capture_reset)(kiln__backend *be, void *graph);
    /* Whether the compiler may take op (with these input and output dtypes) into a fused
     * kernel it generates for this backend; NULL: every op its lowering knows. An op
     * refused runs as its own step through the backend's kernel, and the fused kernels
     * around it split there (a backend whose generator lacks a form, or whose own kernel
     * for the op is better, says so here). */
    bool (*can_fuse)(kiln__backend *be, int op, const kiln_dtype *in, int n_in, kiln_dtype out);
};

/* Runs op on the cpu for backend be: inputs copied to the host, outputs and updated
 * inputs copied back (src/core/dispatch.c). What dispatch does for an op a backend lacks;
 * a backend kernel calls it for the layouts it does not take. */
kiln_status kiln__cpu_fallback(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                               kiln_tensor_t *const *out, int n_out);
/* How many times op has run on the cpu with copies for be in this process: a test's way
 * to see that a device ran an op with its own kernel. */
uint64_t kiln__cpu_fallbacks(const kiln__backend *be, int op);
/* Checks the n indices of dtype dt at idx (host memory) before any is used: each in
 * [0, limit), or for cross-entropy targets (ignore given) the ignore index; an index
 * outside is an error that names it (op, or the target's row). *count, when given,
 * gets how many are not ignored (src/core/tensor.c). */
kiln_status kiln__check_indices(const char *op, const void *idx, kiln_dtype dt, int64_t n, int64_t limit,
                                const int64_t *ignore, int64_t *count);
/* Checks a grouped matmul's n offsets (host memory, as int64): they rise from 0 or more
 * to at most M; else an error that names the first that does not (src/core/tensor.c). */
kiln_status kiln__check_offsets(const char *op, const int64_t *off, int64_t n, int64_t M);

/* Registration and look-up by name. Backends are made by the backend providers
 * registered with kiln__backend_provider_register (src/core/intercept.h): the cpu at
 * kiln_init, the devices on first need. */
kiln_status kiln__backend_register(kiln__backend *be);
kiln__backend *kiln__backend_find(const char *name);
/* Whether be is a device of the backend kind ("opencl" for "opencl:1"): its name up to
 * a ':'. */
bool kiln__backend_is(const kiln__backend *be, const char *kind);
kiln__backend *kiln__backend_default(void);
/* Until called again with what it returns, this thread's new tensors (and ops without
 * inputs) go to be instead of the default device: scalars made next to a tensor. */
kiln__backend *kiln__backend_here(kiln__backend *be);
int kiln__backend_count(void);
kiln__backend *kiln__backend_at(int i);

/* A matmul epilogue (src/compile/epilogue.c): work a compiled program hands to the next
 * matmul this thread runs, to do on the rows of its result while they are still in
 * cache. A backend whose matmul of a rows x cols result can (the cpu's bf16 GEMM, when
 * one work item makes whole rows) takes it with kiln__epilogue_take, sets out to the
 * result's data, calls fn(e, r0, r1) once for every block of rows [r0, r1) as soon as
 * those rows are final (from any thread of the pool, blocks in any order, each row
 * once), and sets done when it has covered all the rows. Anything else leaves done
 * false, and the program runs the work after the matmul instead. */
typedef struct kiln__epilogue {
    int64_t rows, cols;
    void (*fn)(const struct kiln__epilogue *e, int64_t r0, int64_t r1);
    void *ctx, *out;
    bool done;
} kiln__epilogue;
/* Offers e (NULL: withdraws the offer) to this thread's next matmul. */
void kiln__epilogue_offer(kiln__epilogue *e);
/* The offer, when it is for a result of rows x cols; it is withdrawn either way. */
kiln__epilogue *kiln__epilogue_take(int64_t rows, int64_t cols);

/* The contract as the rooms above call it: every call to a backend goes through these
 * (src/core/backend_calls.c), which supply the default where an optional entry is NULL,
 * so that no caller re-checks the table by hand. The wrappers that only call through
 * (the required entries) or give a fixed default are rows of the two lists below,
 * X(return type, entry, (parameters), (arguments)[, default]), each declared as
 * kiln__be_<entry>; UNSUPPORTED(what) is KILN_ERR_UNSUPPORTED naming the backend.
 * The rest, by hand: event_record without the entry synchronizes, and the event is
 * NULL; event_free on NULL: nothing; event_query: waits, then done; kernel_free:
 * nothing; can_fuse: true. */
#define KILN__BE_REQUIRED_CALLS(X)                                                                   \
    X(kiln_status, device_info, (kiln__backend *be, kiln__device_info *out), (be, out))               \
    X(void *, alloc, (kiln__backend *be, size_t nbytes), (be, nbytes))                                \
    X(kiln_status, copy_h2d, (kiln__backend *be, void *dst, const void *src, size_t n), (be, dst, src, n)) \
    X(kiln_status, copy_d2h, (kiln__backend *be, void *dst, const void *src, size_t n), (be, dst, src, n)) \
    X(kiln_status, copy_d2d, (kiln__backend *be, void *dst, const void *src, size_t n), (be, dst, src, n)) \
    X(kiln_status, synchronize, (kiln__backend *be), (be))
#define KILN__BE_OPTIONAL_CALLS(X)                                                                   \
    X(kiln_status, fill, (kiln__backend *be, void *dst, const void *pattern, size_t size, size_t n),   \
      (be, dst, pattern, size, n), UNSUPPORTED("fill"))                                               \
    X(kiln_status, compile_kernel, (kiln__backend *be, const char *source, const char *entry, void **kernel_out), \
      (be, source, entry, kernel_out), UNSUPPORTED("kernel compiler"))                                \
    X(kiln_status, launch, (kiln__backend *be, void *kernel, const kiln__karg *args, int nargs, const size_t *grid, \
                            const size_t *block, int grid_dims),                                      \
      (be, kernel, args, nargs, grid, block, grid_dims), UNSUPPORTED("kernel launch"))                \
    X(void *, native_stream, (kiln__backend *be), (be), NULL)                                         \
    X(kiln_status, host_register, (kiln__backend *be, void *ptr, size_t n), (be, ptr, n), KILN_OK)     \
    X(kiln_status, host_unregister, (kiln__backend *be, void *ptr), (be, ptr), KILN_OK)               \
    X(kiln_status, capture_begin, (kiln__backend *be), (be), UNSUPPORTED("graph capture"))            \
    X(kiln_status, capture_end, (kiln__backend *be, void **graph_out), (be, graph_out), UNSUPPORTED("graph capture")) \
    X(kiln_status, replay, (kiln__backend *be, void *graph), (be, graph), UNSUPPORTED("graph replay")) \
    X(kiln_status, capture_reset, (kiln__backend *be, void *graph), (be, graph), UNSUPPORTED("graph capture"))
#define KILN__BE_DECLARE(type, entry, params, ...) type kiln__be_##entry params;
KILN__BE_REQUIRED_CALLS(KILN__BE_DECLARE)
KILN__BE_OPTIONAL_CALLS(KILN__BE_DECLARE)
#undef KILN__BE_DECLARE
void kiln__be_free(kiln__backend *be, void *ptr, size_t nbytes);
kiln__event *kiln__be_event_record(kiln__backend *be);
void kiln__be_event_free(kiln__backend *be, kiln__event *e);
kiln_status kiln__be_event_query(kiln__backend *be, kiln__event *e, bool *done);
void kiln__be_kernel_free(kiln__backend *be, void *kernel);
bool kiln__be_can_fuse(kiln__backend *be, int op, const kiln_dtype *in, int n_in, kiln_dtype out);
/* What a backend offers beyond the required entries. */
bool kiln__be_has_kernel(const kiln__backend *be, int op); /* its own kernel for op */
bool kiln__be_can_compile(const kiln__backend *be); /* language, compile_kernel and launch */
bool kiln__be_can_capture(const kiln__backend *be); /* all four capture entries */

#endif
