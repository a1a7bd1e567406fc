/* kiln/tensor.h — status codes, dtypes, tensors, scopes and the random generator.
 *
 * A worked example:
 *
 *     kiln_scope_begin();                       // tensors made from here are released
 *     int64_t shape[2] = {2, 3};                //   by the matching kiln_scope_end()
 *     kiln_tensor_t *x = kiln_randn(shape, 2, KILN_DTYPE_F32);
 *     kiln_tensor_t *y = kiln_sum(kiln_mul(x, x), NULL, 0, false);
 *     double v;
 *     if (!y || kiln_tensor_item(y, &v) != KILN_OK)
 *         fprintf(stderr, "kiln: %s\n", kiln_last_error());
 *     kiln_scope_end();
 *
 * Ownership. Every function that returns a kiln_tensor_t* returns a new reference.
 * While a scope is open the innermost scope holds that reference and drops it at
 * kiln_scope_end(); kiln_keep() takes it out of the scope for the caller to own. With
 * no scope open the caller owns it and drops it with kiln_tensor_free(). The exceptions
 * are accessors that say "borrowed" (kiln_tensor_grad, kiln_gpt_param,
 * kiln_optim_state): they return a tensor the object keeps.
 *
 * Errors. Functions return kiln_status (0 ok, negative failure) or a tensor, NULL on
 * failure. The message — op, shapes, dtypes and a hint — is kept per thread and read
 * with kiln_last_error(). An op given a NULL input returns NULL and keeps the first
 * error, so a chain of ops can be checked once at its end.
 */
#ifndef KILN_TENSOR_H
#define KILN_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_MAX_DIMS 8

typedef enum {
    KILN_OK = 0,
    KILN_ERR_ARG = -1,         /* a bad argument: NULL, out of range, wrong count */
    KILN_ERR_SHAPE = -2,       /* shapes that do not fit together */
    KILN_ERR_DTYPE = -3,       /* a dtype the op does not take */
    KILN_ERR_INDEX = -4,       /* an index outside its dimension */
    KILN_ERR_OOM = -5,         /* out of memory, on the host or a device */
    KILN_ERR_IO = -6,          /* a file could not be read or written */
    KILN_ERR_FORMAT = -7,      /* a file or request that is malformed */
    KILN_ERR_UNSUPPORTED = -8, /* not supported by this backend or build */
    KILN_ERR_DEVICE = -9,      /* a missing device, or tensors on two devices */
    KILN_ERR_AUTOGRAD = -10,   /* a gradient that cannot be computed as asked */
    KILN_ERR_INTERNAL = -11,   /* a broken invariant in kiln itself: please report */
    KILN_ERR_BUSY = -12,       /* a queue or pool that is full: try again later */
    KILN_ERR_CANCELLED = -13,  /* work stopped because its caller asked */
    KILN_ERR_DIST = -14,       /* a collective that failed, timed out, or ran in another order on another rank */
    KILN_ERR_COMPILE = -15,    /* generated code that the system C compiler refused (source and log kept) */
} kiln_status;

typedef enum {
    KILN_DTYPE_F32,
    KILN_DTYPE_F64,
    KILN_DTYPE_F16,
    KILN_DTYPE_BF16,
    KILN_DTYPE_I32,
    KILN_DTYPE_I64,
    KILN_DTYPE_U8,
    KILN_DTYPE_BOOL,
    KILN_DTYPE_COUNT
} kiln_dtype;

typedef struct kiln_tensor kiln_tensor_t;

/* The calling thread's last error message; never NULL. */
const char *kiln_last_error(void);
/* The calling thread's last status, KILN_OK after kiln_clear_error(). */
kiln_status kiln_last_status(void);
void kiln_clear_error(void);
/* Sets the calling thread's last error and returns s: for code built on kiln (layers,
 * tools, extensions) that reports its own errors the same way. */
kiln_status kiln_error(kiln_status s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *kiln_status_name(kiln_status s);

/* Dtypes. */
const char *kiln_dtype_name(kiln_dtype dt);
size_t kiln_dtype_size(kiln_dtype dt);
bool kiln_dtype_is_float(kiln_dtype dt);
/* f32, bf16 or f16: the types of weights, mixed precision and KV caches. */
bool kiln_dtype_is_f32_or_half(kiln_dtype dt);
/* Parses "f32", "float32", "bf16", ...; returns KILN_ERR_DTYPE for an unknown name. */
kiln_status kiln_dtype_parse(const char *name, kiln_dtype *out);

/* Library set-up. kiln_init is called by the first kiln call that needs it; call it
 * yourself to set the thread count (0 = all cores). */
kiln_status kiln_init(int num_threads);
int kiln_num_threads(void);
const char *kiln_version(void);
/* How this library was built: BLAS, SIMD, sanitizers (one line, for kiln doctor). */
const char *kiln_build_info(void);
/* Optimization switches (KILN_OPT_<NAME>=0|1 in the environment, read once; the
 * compiler's stages, COMPILE_<STAGE>, read at each compile). */
int kiln_opt_count(void);
const char *kiln_opt_name(int i);
const char *kiln_opt_help(int i);
bool kiln_opt_enabled(int i);
/* Environment variables: every KILN_* variable kiln reads is one row of one table,
 * the switches above included (kiln doctor --env prints it; docs/env.md). */
typedef struct {
    const char *name;  /* "KILN_DEVICE" */
    const char *type;  /* bool, int, number, string, list or path */
    const char *who;   /* who reads it: library, kiln program or tests */
    const char *dflt;  /* what unset means: a value, "" (nothing) or "(a description)" */
    const char *help;  /* one line */
    const char *value; /* as set now; NULL when unset or empty (borrowed from the environment) */
} kiln_env_var;
int kiln_env_count(void);
/* Row i of the table into *out (copied); false past its end. */
bool kiln_env_var_at(int i, kiln_env_var *out);
/* The value of variable name as set, NULL when unset or empty; NULL with KILN_ERR_ARG
 * in kiln_last_error() when name is not in the table. */
const char *kiln_env(const char *name);
/* The same, but the table's default when unset and that default is a value. */
const char *kiln_env_or_default(const char *name);
/* KILN_OK when variable name is unset or holds a value of its type and range; else
 * KILN_ERR_ARG, saying what the value should be. */
kiln_status kiln_env_check(const char *name);
/* Registered devices (backends): "cpu" first. */
int kiln_device_count(void);
const char *kiln_device_name(int i);
/* One line describing device i (memory, compute units), or NULL. */
const char *kiln_device_describe(int i, char *buf, size_t n);
/* The device new tensors are made on (zeros, from_data, randn, ... and the ops that
 * take no tensor): "cpu" unless KILN_DEVICE or kiln_set_device said otherwise. Names:
 * "cpu", "opencl:N" ("opencl" = "opencl:0"), as kiln_device_name lists them. Ops follow
 * their inputs' device; code that makes tensors of its own as it runs (a model's
 * positions, a loss's targets) makes them here, so keep the model's device current
 * while it runs, as kiln train --device does. */
kiln_status kiln_set_device(const char *name);
const char *kiln_device(void);
/* The device a tensor lives on ("cpu", "opencl:0", ...). */
const char *kiln_tensor_device(const kiln_tensor_t *t);
/* A copy of t on `device` (t itself, one more reference, when it is already there), in
 * the caller's scope; not tracked by autograd: make parameters on their device
 * (kiln_set_device) rather than moving them. An op on tensors of two devices is an
 * error that says to move one with this. */
kiln_tensor_t *kiln_tensor_to(kiln_tensor_t *t, const char *device);
/* Pins n bytes of host memory at ptr (page-locked) for faster copies with device, where
 * its backend can (CUDA); *pinned says whether it did: false on a device without pinned
 * memory (cpu, OpenCL), and for a NULL ptr or n == 0 (nothing to pin), all KILN_OK.
 * Unpin with kiln_host_unpin before freeing the memory. */
kiln_status kiln_host_pin(const char *device, void *ptr, size_t n, bool *pinned);
kiln_status kiln_host_unpin(const char *device, void *ptr);
/* Waits until everything queued on device has run (work on a device is asynchronous;
 * copies to the host already wait): for timing. */
kiln_status kiln_device_synchronize(const char *device);
/* Why there are no cuda devices, or how many there are ("libcuda.so.1 (the driver) not
 * found", "no GPU (...)", "1 GPU(s)"): for kiln doctor. */
const char *kiln_cuda_status(void);
/* The CUDA versions kiln would pair, for kiln doctor, as CUDA writes them (12040 is
 * 12.4): the newest the driver supports (cuDriverGetVersion), the runtime's
 * (cudaRuntimeGetVersion) and NVRTC's, which writes the PTX the driver must load; 0
 * for a library that is not there (or a build without CUDA). */
void kiln_cuda_versions(int *driver, int *runtime, int *nvrtc);
/* The BLAS the cpu backend calls for f32 GEMMs, for kiln doctor. Strings are static. */
typedef struct {
    const char *name;   /* "OpenBLAS", "BLIS" or "none" */
    const char *config; /* the library's own line ("OpenBLAS 0.3.21 DYNAMIC_ARCH ..."), or "" */
    const char *core;   /* the kernels it picked for this processor ("Haswell"), or "" */
    bool generic_core;  /* core is an old generic one: the library did not recognise the processor */
} kiln_blas_info;
void kiln_blas_info_get(kiln_blas_info *out);
/* The processor's vector extensions that the cpu backend's kernels use, and the
 * kernels it picks from them, for kiln doctor. Strings are static. */
typedef struct {
    bool avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512bf16, amx_bf16;
    const char *clone;     /* the clone of the hot loops the loader picks: "x86-64-v4", "x86-64-v3",
                              or "default" (plain C) */
    const char *gemm_f32;  /* kiln's own GEMM's f32 micro-kernel: "avx512", "avx2" or "c" */
    const char *gemm_bf16; /* what bf16 GEMMs and attention run on */
} kiln_cpu_info;
void kiln_cpu_info_get(kiln_cpu_info *out);
/* An OpenCL platform the ICD loader found, for kiln doctor. */
typedef struct {
    char name[96];       /* CL_PLATFORM_NAME ("Portable Computing Language") */
    char version[160];   /* CL_PLATFORM_VERSION ("OpenCL 3.0 PoCL 3.1+debian ...") */
    int devices;         /* its devices that kiln opened */
    int command_buffers; /* of those, the ones whose command buffers kiln uses for replays */
} kiln_opencl_platform;
/* Up to max platforms into out; returns how many there are (0 for none), or -1 for a
 * build without OpenCL. Probes the devices as kiln_device_count does. */
int kiln_opencl_platforms(kiln_opencl_platform *out, int max);
/* The kernel cache's folder: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else
 * ~/.cache/kiln (neither made nor checked here). */
void kiln_cache_dir(char *buf, size_t n);
/* Op coverage (kiln doctor --ops): op i's name for i < kiln_op_count(), and how a
 * device runs it: with its own kernel, through a kernel kiln generates for it (the
 * dtypes and layouts the generator does not take go to the cpu), on the cpu with
 * copies to and fro, or not. */
typedef enum { KILN_OP_NONE, KILN_OP_ON_CPU, KILN_OP_NATIVE, KILN_OP_GENERATED } kiln_op_support;
int kiln_op_count(void);
const char *kiln_op_name(int i);
kiln_op_support kiln_device_op_support(const char *device, int op);

/* Scopes. */
void kiln_scope_begin(void);
void kiln_scope_end(void);
/* Takes t out of the innermost scope that holds it; the caller now owns that reference. */
kiln_tensor_t *kiln_keep(kiln_tensor_t *t);

/* Reference counting. */
kiln_tensor_t *kiln_tensor_retain(kiln_tensor_t *t); /* returns t with one more reference */
void kiln_tensor_free(kiln_tensor_t *t);             /* drops one reference; NULL is fine */

/* Creation. shape has ndim entries (0 <= ndim <= KILN_MAX_DIMS); ndim 0 is a scalar. */
kiln_tensor_t *kiln_empty(const int64_t *shape, int ndim, kiln_dtype dt);
kiln_tensor_t *kiln_zeros(const int64_t *shape, int ndim, kiln_dtype dt);
/* A cpu tensor over memory the caller provides, not copied: contiguous, of this shape
 * and dtype, data aligned to the dtype's size and holding all its elements. Reads and
 * writes go to that memory. release(ctx) is called once, when the last reference to it
 * (the tensor's, its views') goes; release NULL: nothing is called. On an error (a bad
 * shape, misaligned data, out of memory) the result is NULL and release is not called:
 * the memory stays the caller's. (kiln_safetensors_view maps files with it.) */
kiln_tensor_t *kiln_tensor_wrap(void *data, const int64_t *shape, int ndim, kiln_dtype dt, void (*release)(void *ctx),
                                void *ctx);
kiln_tensor_t *kiln_ones(const int64_t *shape, int ndim, kiln_dtype dt);
kiln_tensor_t *kiln_full(const int64_t *shape, int ndim, double value, kiln_dtype dt);
kiln_tensor_t *kiln_scalar(double value, kiln_dtype dt);
/* A tensor shaped like t, on t's device, filled with value. */
kiln_tensor_t *kiln_full_like(const kiln_tensor_t *t, double value, kiln_dtype dt);
kiln_tensor_t *kiln_arange(double start, double end, double step, kiln_dtype dt);
/* Uniform in [0, 1) and standard normal, from the global counter-based generator. */
kiln_tensor_t *kiln_rand(const int64_t *shape, int ndim, kiln_dtype dt);
kiln_tensor_t *kiln_randn(const int64_t *shape, int ndim, kiln_dtype dt);
/* Copies nbytes = numel * dtype size from host memory. */
kiln_tensor_t *kiln_from_data(const void *data, const int64_t *shape, int ndim, kiln_dtype dt);

/* Reading back. kiln_tensor_to_host copies the elements in row-major order into dst,
 * which must hold numel * dtype size bytes. */
kiln_status kiln_tensor_to_host(const kiln_tensor_t *t, void *dst, size_t nbytes);
/* Copies src's elements into dst (same shape; dtypes are converted). */
kiln_status kiln_tensor_copy_(kiln_tensor_t *dst, const kiln_tensor_t *src);
/* Writes host data into t (row-major, t's dtype). */
kiln_status kiln_tensor_from_host_(kiln_tensor_t *t, const void *src, size_t nbytes);
/* The value of a one-element tensor as a double. */
kiln_status kiln_tensor_item(const kiln_tensor_t *t, double *out);

/* Shape and properties. */
int kiln_tensor_ndim(const kiln_tensor_t *t);
int64_t kiln_tensor_dim(const kiln_tensor_t *t, int i); /* negative i counts from the end */
const int64_t *kiln_tensor_shape(const kiln_tensor_t *t);
const int64_t *kiln_tensor_strides(const kiln_tensor_t *t);
int64_t kiln_tensor_numel(const kiln_tensor_t *t);
size_t kiln_tensor_nbytes(const kiln_tensor_t *t);
kiln_dtype kiln_tensor_dtype(const kiln_tensor_t *t);
bool kiln_tensor_is_contiguous(const kiln_tensor_t *t);
/* "f32[2,3]" into buf; returns buf. */
const char *kiln_tensor_describe(const kiln_tensor_t *t, char *buf, size_t n);

/* The random generator: Philox4x32-10 keyed by a seed, with a counter that every draw
 * advances. Streams depend only on (seed, counter), never on the thread count. */
void kiln_manual_seed(uint64_t seed);
typedef struct { uint64_t seed, offset; } kiln_rng_state;
kiln_rng_state kiln_rng_get_state(void);
void kiln_rng_set_state(kiln_rng_state s);

/* Memory: bytes held by live tensors now, and the most held at once since the last reset. */
size_t kiln_memory_allocated(void);
size_t kiln_memory_peak(void);
void kiln_memory_reset_peak(void);
/* Returns cached free blocks to the system. */
void kiln_memory_empty_cache(void);

#ifdef __cplusplus
}
#endif
#endif
