/* The CUDA backend: one registered backend per GPU ("cuda:0", ...). cuBLAS does the
 * GEMMs; NVRTC compiles CUDA C (the compiler's generated kernels for eager ops, and this
 * file's own in-place updates) to PTX, loaded and launched through the driver API; one
 * stream per device; pinned host memory through cudaHostRegister.
 *
 * The toolkit's libraries (cudart, cuBLAS, NVRTC) and the driver (libcuda.so.1) are
 * opened with dlopen when kiln starts, not linked: the same kiln binary then runs on a
 * machine without a GPU or driver (it just has no cuda devices, and `kiln doctor` says
 * which library or call was missing), and builds anywhere the toolkit's headers are.
 * Device pointers are real addresses in one unified space, so a tensor's data pointer
 * plus offset is what kernels and copies take.
 *
 * Graph capture is CUDA graphs: capture_begin starts capturing the device's stream
 * (relaxed mode, so that a kernel's own temporaries may still be allocated), the work
 * issued until capture_end becomes a graph, instantiated once and launched by replay. A
 * copy to or from the host cannot be captured and fails the capture; buffers freed
 * meanwhile are kept until the graph goes (cudaFree would synchronize, and the graph's
 * nodes name them). Written against the CUDA 12/13 runtime; not yet run on a GPU. */
#ifdef KILN_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nvrtc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/cache.h"
#include "core/dtype.h"
#include "core/tensor_impl.h"
#include "core/intercept.h"
#include "core/util.h"

#define MAX_CUDA_DEVICES 8

/* The entry points used, looked up by name. */
#define CUDART_FNS(X)                                                                                        \
    X(cudaGetDeviceCount) X(cudaSetDevice) X(cudaMalloc) X(cudaFree) X(cudaMemcpy) X(cudaMemcpyAsync)        \
    X(cudaMemsetAsync) X(cudaMemGetInfo) X(cudaStreamCreate) X(cudaStreamSynchronize) X(cudaEventCreate)      \
    X(cudaEventRecord) X(cudaEventSynchronize) X(cudaEventQuery) X(cudaEventDestroy) X(cudaDeviceGetAttribute)                 \
    X(cudaHostRegister) X(cudaHostUnregister) X(cudaGetErrorString) X(cudaRuntimeGetVersion)                 \
    X(cudaStreamBeginCapture) X(cudaStreamEndCapture) X(cudaGraphInstantiate) X(cudaGraphLaunch)             \
    X(cudaGraphExecDestroy) X(cudaGraphDestroy)
#define DRIVER_FNS(X)                                                                                         \
    X(cuInit) X(cuDeviceGet) X(cuDeviceGetName) X(cuModuleLoadData) X(cuModuleGetFunction) X(cuModuleUnload)  \
    X(cuLaunchKernel)
#define CUBLAS_FNS(X) X(cublasCreate_v2) X(cublasSetStream_v2) X(cublasSetMathMode) X(cublasSgemm_v2) X(cublasGemmEx)
#define NVRTC_FNS(X)                                                                                          \
    X(nvrtcCreateProgram) X(nvrtcCompileProgram) X(nvrtcGetPTXSize) X(nvrtcGetPTX) X(nvrtcGetProgramLogSize) \
    X(nvrtcGetProgramLog) X(nvrtcDestroyProgram) X(nvrtcVersion)

#define DECLARE(f) static __typeof__(f) *p_##f;
CUDART_FNS(DECLARE) DRIVER_FNS(DECLARE) CUBLAS_FNS(DECLARE) NVRTC_FNS(DECLARE)
#undef DECLARE

static char why_none[256] = "not probed";

typedef struct {
    int ordinal;
    char name[24];
    char description[160];
    kiln__device_info info; /* names the two above */
    int cc_major, cc_minor;
    cudaStream_t stream;
    cublasHandle_t blas;
    pthread_mutex_t lock; /* the builtin kernels, made once */
    CUfunction builtin[4];
    struct cu_graph *cap; /* being captured */
} cuda_dev;

/* A captured graph: the executable one, and the buffers freed while it was captured. */
typedef struct cu_graph {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    const char *failed;
    void **freed;
    int n_freed;
    size_t cap_freed;
} cu_graph;

static cuda_dev devs[MAX_CUDA_DEVICES];
static kiln__backend cuda_backends[MAX_CUDA_DEVICES];

static void *open_first(const char *const *names)
{
    for (int i = 0; names[i]; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (h) return h;
    }
    return NULL;
}

#define LOAD(f)                                                                                  \
    if (!(p_##f = (__typeof__(f) *)dlsym(h, #f))) {                                              \
        snprintf(why_none, sizeof why_none, "%s lacks %s", lib, #f);                             \
        return false;                                                                            \
    }

/* NVRTC alone: a compiler, usable with no GPU or driver. */
static bool load_nvrtc(void)
{
    static const char *const nv[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so",
                                     "/usr/local/cuda/lib64/libnvrtc.so", NULL};
    if (p_nvrtcVersion) return true;
    void *h = open_first(nv);
    const char *lib = "libnvrtc";
    if (!h) {
        snprintf(why_none, sizeof why_none, "libnvrtc not found");
        return false;
    }
    NVRTC_FNS(LOAD)
    return true;
}

/* Loads every entry point; false with why_none set when a library or symbol is missing. */
static bool load_libraries(void)
{
    static const char *const rt[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so",
                                     "/usr/local/cuda/lib64/libcudart.so", NULL};
    static const char *const drv[] = {"libcuda.so.1", "libcuda.so", NULL};
    static const char *const bl[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so",
                                     "/usr/local/cuda/lib64/libcublas.so", NULL};
    /* The driver first: without it there is no GPU to use, and the toolkit's libraries
     * (cuBLAS alone is hundreds of MB) are not worth mapping into every process. */
    void *h_drv = open_first(drv);
    if (!h_drv) {
        snprintf(why_none, sizeof why_none, "libcuda.so.1 (the driver) not found");
        return false;
    }
    void *h_rt = open_first(rt), *h_bl = h_rt ? open_first(bl) : NULL;
    if (!h_rt || !h_bl) {
        snprintf(why_none, sizeof why_none, "%s not found (the CUDA toolkit's libraries)", !h_rt ? "libcudart" : "libcublas");
        return false;
    }
    if (!load_nvrtc()) return false;
    void *h = h_rt;
    const char *lib = "libcudart";
    CUDART_FNS(LOAD)
    h = h_drv, lib = "libcuda";
    DRIVER_FNS(LOAD)
    h = h_bl, lib = "libcublas";
    CUBLAS_FNS(LOAD)
    return true;
}

static kiln_status cu_fail(const cuda_dev *d, const char *what, cudaError_t e)
{
    return kiln__err(KILN_ERR_DEVICE, "%s: %s failed: %s", d->name, what, p_cudaGetErrorString(e));
}

static kiln_status use(const cuda_dev *d)
{
    cudaError_t e = p_cudaSetDevice(d->ordinal);
    return e == cudaSuccess ? KILN_OK : cu_fail(d, "cudaSetDevice", e);
}

static kiln_status cu_device_info(kiln__backend *be, kiln__device_info *out)
{
    *out = ((cuda_dev *)be->ctx)->info;
    return KILN_OK;
}

static void *cu_alloc(kiln__backend *be, size_t n)
{
    void *p = NULL;
    if (use(be->ctx) != KILN_OK) return NULL;
    return p_cudaMalloc(&p, n ? n : 256) == cudaSuccess ? p : NULL;
}

static void cu_free(kiln__backend *be, void *p, size_t n)
{
    cuda_dev *d = be->ctx;
    cu_graph *g = d->cap;
    void *tmp;
    if (p && g) { /* captured nodes may name it: kept until the graph goes */
        if (KILN__GROW(g->freed, g->n_freed, &g->cap_freed, 16, tmp)) g->freed[g->n_freed++] = p;
        else if (!g->failed) g->failed = "out of memory keeping a freed buffer"; /* leaked, not freed under a node */
        return;
    }
    if (p && use(d) == KILN_OK) p_cudaFree(p);
}

static kiln_status copy(kiln__backend *be, void *dst, const void *src, size_t n, enum cudaMemcpyKind kind)
{
    cuda_dev *d = be->ctx;
    kiln_status s = n ? use(d) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    if (d->cap && kind != cudaMemcpyDeviceToDevice) {
        const char *what = kind == cudaMemcpyHostToDevice ? "a copy from the host" : "a copy to the host";
        if (!d->cap->failed) d->cap->failed = what;
        return kiln__err(KILN_ERR_UNSUPPORTED, "%s: %s cannot be captured into a CUDA graph", d->name, what);
    }
    /* On the device's stream, so that it is ordered after the kernels before it (while
     * capturing, a node of the graph). A copy to the host then waits for it, and one from
     * the host too (src may go); only device copies are captured, and not waited for. */
    cudaError_t e = p_cudaMemcpyAsync(dst, src, n, kind, d->stream);
    if (e == cudaSuccess && kind != cudaMemcpyDeviceToDevice) e = p_cudaStreamSynchronize(d->stream);
    return e == cudaSuccess ? KILN_OK : cu_fail(d, d->cap ? "cudaMemcpyAsync (capturing)" : "cudaMemcpyAsync", e);
}

static kiln_status cu_h2d(kiln__backend *be, void *dst, const void *src, size_t n) { return copy(be, dst, src, n, cudaMemcpyHostToDevice); }
static kiln_status cu_d2h(kiln__backend *be, void *dst, const void *src, size_t n) { return copy(be, dst, src, n, cudaMemcpyDeviceToHost); }
static kiln_status cu_d2d(kiln__backend *be, void *dst, const void *src, size_t n) { return copy(be, dst, src, n, cudaMemcpyDeviceToDevice); }

static kiln_status cu_memset(kiln__backend *be, void *dst, int byte, size_t n)
{
    cuda_dev *d = be->ctx;
    kiln_status s = n ? use(d) : KILN_OK;
    if (s != KILN_OK || !n) return s;
    cudaError_t e = p_cudaMemsetAsync(dst, byte, n, d->stream);
    return e == cudaSuccess ? KILN_OK : cu_fail(d, "cudaMemsetAsync", e);
}

static kiln__event *cu_event_record(kiln__backend *be)
{
    cuda_dev *d = be->ctx;
    cudaEvent_t e;
    if (use(d) != KILN_OK || p_cudaEventCreate(&e) != cudaSuccess) return NULL;
    if (p_cudaEventRecord(e, d->stream) != cudaSuccess) {
        p_cudaEventDestroy(e);
        return NULL;
    }
    return (kiln__event *)e;
}

static kiln_status cu_event_wait(kiln__backend *be, kiln__event *e)
{
    cudaError_t r = e ? p_cudaEventSynchronize((cudaEvent_t)e) : cudaSuccess;
    return r == cudaSuccess ? KILN_OK : cu_fail(be->ctx, "cudaEventSynchronize", r);
}

static kiln_status cu_event_query(kiln__backend *be, kiln__event *e, bool *done)
{
    cudaError_t r = e ? p_cudaEventQuery((cudaEvent_t)e) : cudaSuccess;
    *done = r == cudaSuccess;
    return r == cudaSuccess || r == cudaErrorNotReady ? KILN_OK : cu_fail(be->ctx, "cudaEventQuery", r);
}

static void cu_event_free(kiln__backend *be, kiln__event *e)
{
    if (e) p_cudaEventDestroy((cudaEvent_t)e);
}

static kiln_status cu_synchronize(kiln__backend *be)
{
    cuda_dev *d = be->ctx;
    if (d->cap) return KILN_OK; /* nothing runs while the stream is captured */
    kiln_status s = use(d);
    cudaError_t e = s == KILN_OK ? p_cudaStreamSynchronize(d->stream) : cudaSuccess;
    return s != KILN_OK ? s : e == cudaSuccess ? KILN_OK : cu_fail(d, "cudaStreamSynchronize", e);
}

static void *cu_native_stream(kiln__backend *be)
{
    cuda_dev *d = be->ctx;
    return use(d) == KILN_OK ? (void *)d->stream : NULL;
}

static kiln_status cu_host_register(kiln__backend *be, void *ptr, size_t n)
{
    if (!ptr || !n) return KILN_OK; /* nothing to pin */
    cudaError_t e = p_cudaHostRegister(ptr, n, cudaHostRegisterDefault);
    return e == cudaSuccess ? KILN_OK : cu_fail(be->ctx, "cudaHostRegister", e);
}

static kiln_status cu_host_unregister(kiln__backend *be, void *ptr)
{
    if (!ptr) return KILN_OK;
    cudaError_t e = p_cudaHostUnregister(ptr);
    return e == cudaSuccess ? KILN_OK : cu_fail(be->ctx, "cudaHostUnregister", e);
}

/* CUDA C to PTX with NVRTC for compute capability major.minor; *ptx malloc'd. Usable
 * without a GPU (NVRTC is a compiler), which is how the tests check the generator. */
kiln_status kiln__cuda_nvrtc(const char *src, const char *name, int major, int minor, char **ptx)
{
    *ptx = NULL;
    if (!load_nvrtc()) return kiln__err(KILN_ERR_DEVICE, "cuda: NVRTC is not available (%s)", why_none);
    nvrtcProgram prog;
    if (p_nvrtcCreateProgram(&prog, src, name, 0, NULL, NULL) != NVRTC_SUCCESS)
        return kiln__err(KILN_ERR_OOM, "cuda: nvrtcCreateProgram failed for %s", name);
    char arch[40];
    snprintf(arch, sizeof arch, "--gpu-architecture=compute_%d%d", major, minor);
    const char *opts[] = {arch, "--std=c++17", "-default-device"};
    nvrtcResult r = p_nvrtcCompileProgram(prog, 3, opts);
    if (r != NVRTC_SUCCESS) {
        size_t n = 0;
        p_nvrtcGetProgramLogSize(prog, &n);
        char *log = malloc(n + 1);
        if (log) {
            log[0] = 0;
            p_nvrtcGetProgramLog(prog, log);
        }
        char dir[1024], sp[1100], lp[1100];
        uint64_t h = kiln__fnv(KILN__FNV_SEED, src, strlen(src));
        if (kiln__cache_dir("cuda", dir, sizeof dir) == KILN_OK) {
            snprintf(sp, sizeof sp, "%s/%016llx.cu", dir, (unsigned long long)h);
            snprintf(lp, sizeof lp, "%s/%016llx.log", dir, (unsigned long long)h);
            FILE *f = fopen(sp, "w");
            if (f) fputs(src, f), fclose(f);
            if (log && (f = fopen(lp, "w"))) fputs(log, f), fclose(f);
        } else {
            snprintf(sp, sizeof sp, "(not kept)");
            snprintf(lp, sizeof lp, "(not kept)");
        }
        free(log);
        p_nvrtcDestroyProgram(&prog);
        return kiln__err(KILN_ERR_COMPILE, "cuda: NVRTC failed on kernel %s; source kept at %s, its log at %s", name, sp, lp);
    }
    size_t n = 0;
    p_nvrtcGetPTXSize(prog, &n);
    *ptx = malloc(n + 1);
    if (*ptx) p_nvrtcGetPTX(prog, *ptx);
    p_nvrtcDestroyProgram(&prog);
    return *ptx ? KILN_OK : kiln__err(KILN_ERR_OOM, "cuda: out of memory for PTX");
}

static kiln_status cu_compile_kernel(kiln__backend *be, const char *source, const char *entry, void **kernel_out)
{
    cuda_dev *d = be->ctx;
    char *ptx;
    kiln_status s = use(d);
    if (s == KILN_OK) s = kiln__cuda_nvrtc(source, entry, d->cc_major, d->cc_minor, &ptx);
    if (s != KILN_OK) return s;
    CUmodule mod;
    CUfunction fn;
    CUresult r = p_cuModuleLoadData(&mod, ptx);
    free(ptx);
    if (r == CUDA_SUCCESS && (r = p_cuModuleGetFunction(&fn, mod, entry)) != CUDA_SUCCESS) p_cuModuleUnload(mod);
    if (r != CUDA_SUCCESS)
        return kiln__err(KILN_ERR_DEVICE, "%s: loading kernel %s failed (CUresult %d)", d->name, entry, (int)r);
    *kernel_out = fn;
    return KILN_OK;
}

/* Buffers go as (pointer, byte offset 0) pairs, as the generated kernels take them. */
static kiln_status cu_launch(kiln__backend *be, void *kernel, const kiln__karg *args, int nargs, const size_t *grid,
                             const size_t *block, int grid_dims)
{
    cuda_dev *d = be->ctx;
    union {
        void *p;
        unsigned long long u;
        long long i;
        float f;
        double g;
    } vals[130];
    void *params[130];
    int n = 0;
    for (int i = 0; i < nargs && n < 128; i++) {
        switch (args[i].kind) {
        case KILN__KARG_BUF:
            vals[n].p = (void *)args[i].ptr;
            params[n] = &vals[n];
            n++;
            vals[n].u = 0;
            break;
        case KILN__KARG_I64: vals[n].i = args[i].i64; break;
        case KILN__KARG_F32: vals[n].f = (float)args[i].f; break;
        case KILN__KARG_F64: vals[n].g = args[i].f; break;
        }
        params[n] = &vals[n];
        n++;
    }
    unsigned int bl[3] = {1, 1, 1}, gr[3] = {1, 1, 1};
    for (int k = 0; k < grid_dims && k < 3; k++) {
        bl[k] = block ? (unsigned)block[k] : k == 0 ? 256u : 1u;
        gr[k] = (unsigned)((grid[k] + bl[k] - 1) / bl[k]);
    }
    kiln_status s = use(d);
    if (s != KILN_OK) return s;
    CUresult r = p_cuLaunchKernel((CUfunction)kernel, gr[0], gr[1], gr[2], bl[0], bl[1], bl[2], 0, (CUstream)d->stream,
                                  params, NULL);
    return r == CUDA_SUCCESS ? KILN_OK : kiln__err(KILN_ERR_DEVICE, "%s: cuLaunchKernel failed (CUresult %d)", d->name, (int)r);
}

/* ---- the backend's own kernels ---- */

/* In-place updates and fills, the same formulas as the cpu's: kernels.cu, embedded at
 * build time (cmake/embed.cmake). */
extern const char kiln__cuda_kernel_source[];

const char *kiln__cuda_builtin_source(void) { return kiln__cuda_kernel_source; }

enum { CB_ADD_, CB_SCALE_, CB_ADAMW_, CB_FILL, N_CB };
static const char *const cb_names[N_CB] = {"kiln_add_", "kiln_scale_", "kiln_adamw_", "kiln_fill"};

static CUfunction builtin(kiln__backend *be, int which)
{
    cuda_dev *d = be->ctx;
    pthread_mutex_lock(&d->lock);
    if (!d->builtin[which]) {
        void *k = NULL;
        if (cu_compile_kernel(be, kiln__cuda_kernel_source, cb_names[which], &k) == KILN_OK) d->builtin[which] = k;
        else {
            fprintf(stderr, "kiln: %s: its own kernel %s does not build (%s); that op runs on the cpu\n", d->name,
                    cb_names[which], kiln_last_error());
            kiln_clear_error();
        }
    }
    pthread_mutex_unlock(&d->lock);
    return d->builtin[which];
}

static kiln__karg buf_arg(const kiln_tensor_t *t) { return (kiln__karg){KILN__KARG_BUF, kiln__data(t), 0, 0}; }
static kiln__karg i64_arg(int64_t v) { return (kiln__karg){KILN__KARG_I64, NULL, v, 0}; }
static kiln__karg f_arg(kiln__karg_kind k, double v) { return (kiln__karg){k, NULL, 0, v}; }
static bool contiguous_f32(const kiln_tensor_t *t) { return t->dtype == KILN_DTYPE_F32 && kiln__is_contiguous(t); }

static kiln_status run_1d(kiln__backend *be, int which, const kiln__karg *args, int n, int64_t items)
{
    CUfunction k = builtin(be, which);
    if (!k) return kiln__err(KILN_ERR_UNSUPPORTED, "%s lacks %s", be->name, cb_names[which]);
    size_t grid = (size_t)items;
    return items ? cu_launch(be, k, args, n, &grid, NULL, 1) : KILN_OK;
}

/* The contract's fill (full, fill_ and copy_ are made from it and copy_d2d by
 * dispatch): the fill kernel, a pattern of 1, 2, 4 or 8 bytes. */
static kiln_status cu_fill(kiln__backend *be, void *dst, const void *pattern, size_t size, size_t n)
{
    int64_t pat = 0;
    memcpy(&pat, pattern, size);
    int64_t items = (int64_t)(n / size);
    kiln__karg args[] = {{KILN__KARG_BUF, dst, 0, 0}, i64_arg(pat), i64_arg((int64_t)size), i64_arg(items)};
    return run_1d(be, CB_FILL, args, 4, items);
}

static kiln_status cu_add_(KILN__KERNEL_ARGS)
{
    int64_t n = kiln_tensor_numel(in[0]);
    if (!contiguous_f32(in[0]) || !contiguous_f32(in[1]) || kiln_tensor_numel(in[1]) != n)
        return kiln__cpu_fallback(be, KILN_OP_ADD_, in, n_in, a, out, n_out);
    kiln__karg args[] = {buf_arg(in[0]), buf_arg(in[1]), f_arg(KILN__KARG_F32, a->op.scalar.value), i64_arg(n)};
    return run_1d(be, CB_ADD_, args, 4, n);
}

static kiln_status cu_scale_(KILN__KERNEL_ARGS)
{
    int64_t n = kiln_tensor_numel(in[0]);
    if (!contiguous_f32(in[0])) return kiln__cpu_fallback(be, KILN_OP_SCALE_, in, n_in, a, out, n_out);
    kiln__karg args[] = {buf_arg(in[0]), f_arg(KILN__KARG_F32, a->op.scalar.value), i64_arg(n)};
    return run_1d(be, CB_SCALE_, args, 3, n);
}

static kiln_status cu_adamw_(KILN__KERNEL_ARGS)
{
    const kiln__adamw_attrs *h = &a->op.adamw;
    int64_t f64s = (in[4]->dtype == KILN_DTYPE_F64) | (in[5]->dtype == KILN_DTYPE_F64) << 1 |
                   (in[6]->dtype == KILN_DTYPE_F64) << 2;
    kiln__karg args[] = {buf_arg(in[0]), buf_arg(in[1]), buf_arg(in[2]), buf_arg(in[3]), buf_arg(in[4]),
                         buf_arg(in[5]), buf_arg(in[6]), i64_arg(f64s), f_arg(KILN__KARG_F32, h->weight_decay),
                         f_arg(KILN__KARG_F64, h->beta1), f_arg(KILN__KARG_F64, h->beta2), f_arg(KILN__KARG_F32, h->eps),
                         i64_arg(kiln_tensor_numel(in[0]))};
    return run_1d(be, CB_ADAMW_, args, (int)(sizeof args / sizeof args[0]), kiln_tensor_numel(in[0]));
}

/* A (rows, cols) matrix with strides (sr, sc) as cuBLAS sees it (column-major): its
 * transpose is column-major with leading dimension sr when sc == 1; it is itself
 * column-major with leading dimension sc when sr == 1. */
static bool blas_view(int64_t rows, int64_t cols, int64_t sr, int64_t sc, cublasOperation_t *op, int *ld)
{
    if (sc == 1 && (sr >= cols || rows == 1)) {
        *op = CUBLAS_OP_N;
        *ld = (int)(rows == 1 ? (cols > 0 ? cols : 1) : sr);
        return true;
    }
    if (sr == 1 && (sc >= rows || cols == 1)) {
        *op = CUBLAS_OP_T;
        *ld = (int)(cols == 1 ? (rows > 0 ? rows : 1) : sc);
        return true;
    }
    return false;
}

/* Row-major C = A B as cuBLAS's column-major C^T = B^T A^T, one GEMM per batch entry:
 * f32 with cublasSgemm; bf16 and f16 with cublasGemmEx, products summed in f32
 * (CUBLAS_COMPUTE_32F, the tensor cores where the GPU has them) and each result
 * rounded once to the operands' type, as the cpu's bf16 matmul does. */
static kiln_status cu_matmul(KILN__KERNEL_ARGS)
{
    cuda_dev *d = be->ctx;
    const kiln_tensor_t *x = in[0], *y = in[1], *o = out[0];
    int nb = o->ndim - 2;
    int64_t M = o->shape[nb], N = o->shape[nb + 1], K = x->shape[x->ndim - 1];
    cublasOperation_t opa, opb;
    int lda, ldb;
    kiln_dtype dt = x->dtype;
    bool half = kiln__is_half(dt);
    size_t es = kiln_dtype_size(dt);
    cudaDataType ct = dt == KILN_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F; /* (half's) */
    if (!kiln__f32_or_half(dt) || y->dtype != dt || o->dtype != dt || M > 1 << 30 || N > 1 << 30 ||
        K > 1 << 30 ||
        !blas_view(M, K, x->stride[x->ndim - 2], x->stride[x->ndim - 1], &opa, &lda) ||
        !blas_view(K, N, y->stride[y->ndim - 2], y->stride[y->ndim - 1], &opb, &ldb))
        return kiln__cpu_fallback(be, KILN_OP_MATMUL, in, n_in, a, out, n_out);
    int64_t batch = kiln__numel(nb, o->shape);
    if (!M || !N || !batch) return KILN_OK;
    if (!K) return cu_memset(be, kiln__data(o), 0, kiln_tensor_nbytes(o));
    kiln_status s = use(d);
    const float one = 1.0f, zero = 0.0f;
    for (int64_t bi = 0; s == KILN_OK && bi < batch; bi++) {
        int64_t rem = bi, ox = 0, oy = 0;
        for (int dd = nb - 1; dd >= 0; dd--) { /* broadcast batch dims: step 0 where the operand has 1 */
            int64_t idx = rem % o->shape[dd];
            rem /= o->shape[dd];
            int i = dd - (nb - (x->ndim - 2)), j = dd - (nb - (y->ndim - 2));
            if (i >= 0 && x->shape[i] != 1) ox += idx * x->stride[i];
            if (j >= 0 && y->shape[j] != 1) oy += idx * y->stride[j];
        }
        const char *A = (const char *)kiln__data(x) + ox * (int64_t)es, *B = (const char *)kiln__data(y) + oy * (int64_t)es;
        char *C = (char *)kiln__data(o) + bi * M * N * (int64_t)es;
        cublasStatus_t st =
            half ? p_cublasGemmEx(d->blas, opb, opa, (int)N, (int)M, (int)K, &one, B, ct, ldb, A, ct, lda, &zero, C, ct,
                                  (int)N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
                 : p_cublasSgemm_v2(d->blas, opb, opa, (int)N, (int)M, (int)K, &one, (const float *)B, ldb,
                                    (const float *)A, lda, &zero, (float *)C, (int)N);
        if (st != CUBLAS_STATUS_SUCCESS)
            s = kiln__err(KILN_ERR_DEVICE, "%s: %s failed (status %d)", d->name, half ? "cublasGemmEx" : "cublasSgemm",
                          (int)st);
    }
    return s;
}

/* ---- graph capture: CUDA graphs ---- */

static void graph_free(cuda_dev *d, cu_graph *g)
{
    if (!g) return;
    if (g->exec) p_cudaGraphExecDestroy(g->exec);
    if (g->g) p_cudaGraphDestroy(g->g);
    for (int i = 0; i < g->n_freed; i++) p_cudaFree(g->freed[i]);
    free(g->freed);
    free(g);
}

static kiln_status cu_capture_begin(kiln__backend *be)
{
    cuda_dev *d = be->ctx;
    if (d->cap) return kiln__err(KILN_ERR_ARG, "%s: a capture is already running", d->name);
    kiln_status s = use(d);
    if (s != KILN_OK) return s;
    cu_graph *g = calloc(1, sizeof *g);
    if (!g) return kiln__err(KILN_ERR_OOM, "%s: out of memory", d->name);
    cudaError_t e = p_cudaStreamSynchronize(d->stream); /* what came before is not part of it */
    if (e == cudaSuccess) e = p_cudaStreamBeginCapture(d->stream, cudaStreamCaptureModeRelaxed);
    if (e != cudaSuccess) {
        free(g);
        return cu_fail(d, "cudaStreamBeginCapture", e);
    }
    d->cap = g;
    return KILN_OK;
}

static kiln_status cu_capture_end(kiln__backend *be, void **graph_out)
{
    cuda_dev *d = be->ctx;
    *graph_out = NULL;
    cu_graph *g = d->cap;
    if (!g) return kiln__err(KILN_ERR_ARG, "%s: no capture is running", d->name);
    d->cap = NULL;
    cudaError_t e = p_cudaStreamEndCapture(d->stream, &g->g); /* ends it even when it was invalidated */
    kiln_status s = KILN_OK;
    if (g->failed) s = kiln__err(KILN_ERR_UNSUPPORTED, "%s: %s cannot be captured into a CUDA graph", d->name, g->failed);
    else if (e != cudaSuccess) s = cu_fail(d, "cudaStreamEndCapture", e);
    else if ((e = p_cudaGraphInstantiate(&g->exec, g->g, 0)) != cudaSuccess) s = cu_fail(d, "cudaGraphInstantiate", e);
    if (s != KILN_OK) {
        graph_free(d, g);
        return s;
    }
    *graph_out = g;
    return KILN_OK;
}

static kiln_status cu_replay(kiln__backend *be, void *graph)
{
    cuda_dev *d = be->ctx;
    kiln_status s = use(d);
    cudaError_t e = s == KILN_OK ? p_cudaGraphLaunch(((cu_graph *)graph)->exec, d->stream) : cudaSuccess;
    return s != KILN_OK ? s : e == cudaSuccess ? KILN_OK : cu_fail(d, "cudaGraphLaunch", e);
}

static kiln_status cu_capture_reset(kiln__backend *be, void *graph)
{
    cuda_dev *d = be->ctx;
    if (use(d) == KILN_OK) p_cudaStreamSynchronize(d->stream); /* it may still be running */
    graph_free(d, graph);
    return KILN_OK;
}

static const kiln__kernel_fn cuda_kernels[KILN_OP_COUNT] = {
    [KILN_OP_MATMUL] = cu_matmul, [KILN_OP_ADD_] = cu_add_, [KILN_OP_SCALE_] = cu_scale_, [KILN_OP_ADAMW_] = cu_adamw_,
};

const char *kiln_cuda_status(void) { return why_none; }

/* Looked up on their own, so that kiln doctor has the versions where a library of the
 * set is missing or there is no GPU; none of these calls needs cuInit. */
void kiln_cuda_versions(int *driver, int *runtime, int *nvrtc)
{
    static const char *const rt[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so",
                                     "/usr/local/cuda/lib64/libcudart.so", NULL};
    static const char *const drv[] = {"libcuda.so.1", "libcuda.so", NULL};
    int d = 0, r = 0, major = 0, minor = 0;
    void *h = open_first(drv);
    CUresult (*get_driver)(int *) = h ? (CUresult(*)(int *))dlsym(h, "cuDriverGetVersion") : NULL;
    if (get_driver && get_driver(&d) != CUDA_SUCCESS) d = 0;
    h = open_first(rt);
    cudaError_t (*get_runtime)(int *) = h ? (cudaError_t(*)(int *))dlsym(h, "cudaRuntimeGetVersion") : NULL;
    if (get_runtime && get_runtime(&r) != cudaSuccess) r = 0;
    static const char *const nv[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so",
                                     "/usr/local/cuda/lib64/libnvrtc.so", NULL};
    h = open_first(nv); /* not load_nvrtc: that would set why_none, kiln_cuda_status's answer */
    nvrtcResult (*get_nvrtc)(int *, int *) = h ? (nvrtcResult(*)(int *, int *))dlsym(h, "nvrtcVersion") : NULL;
    if (get_nvrtc && get_nvrtc(&major, &minor) != NVRTC_SUCCESS) major = minor = 0;
    if (driver) *driver = d;
    if (runtime) *runtime = r;
    if (nvrtc) *nvrtc = major * 1000 + minor * 10;
}

/* Registers every GPU found; none (no driver, no device, no toolkit) is not an error,
 * and kiln_cuda_status then says why. */
static int cuda_register(int nthreads)
{
    if (!load_libraries()) return 0;
    int count = 0;
    if (p_cuInit(0) != CUDA_SUCCESS) {
        snprintf(why_none, sizeof why_none, "the driver did not initialise (cuInit failed; is there a GPU?)");
        return 0;
    }
    cudaError_t e = p_cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        snprintf(why_none, sizeof why_none, "no GPU (%s)", e != cudaSuccess ? p_cudaGetErrorString(e) : "0 devices");
        return 0;
    }
    int n = 0, rtv = 0;
    p_cudaRuntimeGetVersion(&rtv);
    for (int i = 0; i < count && n < MAX_CUDA_DEVICES; i++) {
        cuda_dev *d = &devs[n];
        d->ordinal = i;
        snprintf(d->name, sizeof d->name, "cuda:%d", n);
        CUdevice cd;
        char gpu[96] = "GPU";
        if (p_cuDeviceGet(&cd, i) == CUDA_SUCCESS) p_cuDeviceGetName(gpu, sizeof gpu, cd);
        if (p_cudaSetDevice(i) != cudaSuccess || p_cudaStreamCreate(&d->stream) != cudaSuccess ||
            p_cublasCreate_v2(&d->blas) != CUBLAS_STATUS_SUCCESS || p_cublasSetStream_v2(d->blas, d->stream) != CUBLAS_STATUS_SUCCESS ||
            /* 16-bit GEMMs sum in f32 throughout: no reduced-precision split-K reductions */
            p_cublasSetMathMode(d->blas, CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION) !=
                CUBLAS_STATUS_SUCCESS)
            continue;
        size_t free_b = 0, total = 0;
        int units = 0;
        p_cudaMemGetInfo(&free_b, &total);
        p_cudaDeviceGetAttribute(&units, cudaDevAttrMultiProcessorCount, i);
        p_cudaDeviceGetAttribute(&d->cc_major, cudaDevAttrComputeCapabilityMajor, i);
        p_cudaDeviceGetAttribute(&d->cc_minor, cudaDevAttrComputeCapabilityMinor, i);
        d->info = (kiln__device_info){d->name, d->description, total, units};
        snprintf(d->description, sizeof d->description, "CUDA %s (sm_%d%d), runtime %d.%d", gpu, d->cc_major, d->cc_minor,
                 rtv / 1000, rtv % 1000 / 10);
        pthread_mutex_init(&d->lock, NULL);
        kiln__backend *be = &cuda_backends[n];
        /* Graph capture for CUDA 12+, whose cudaGraphInstantiate this calls. */
        bool graphs = rtv >= 12000;
        *be = (kiln__backend){
            .abi_version = KILN_BACKEND_ABI_VERSION,
            .name = d->name,
            .ctx = d,
            .device_info = cu_device_info,
            .alloc = cu_alloc,
            .free = cu_free,
            .copy_h2d = cu_h2d,
            .copy_d2h = cu_d2h,
            .copy_d2d = cu_d2d,
            .memset = cu_memset,
            .event_record = cu_event_record,
            .event_wait = cu_event_wait,
            .event_free = cu_event_free,
            .synchronize = cu_synchronize,
            .kernels = cuda_kernels,
            .language = "cuda-c",
            .compile_kernel = cu_compile_kernel,
            .kernel_free = NULL, /* modules live as long as the process */
            .launch = cu_launch,
            .fill = cu_fill,
            .native_stream = cu_native_stream,
            .event_query = cu_event_query,
            .host_register = cu_host_register,
            .host_unregister = cu_host_unregister,
            .capture_begin = graphs ? cu_capture_begin : NULL,
            .capture_end = graphs ? cu_capture_end : NULL,
            .replay = graphs ? cu_replay : NULL,
            .capture_reset = graphs ? cu_capture_reset : NULL,
        };
        if (kiln__backend_register(be) == KILN_OK) n++;
        else kiln_clear_error();
    }
    if (!n) snprintf(why_none, sizeof why_none, "%d GPU(s) found but none could be opened", count);
    else snprintf(why_none, sizeof why_none, "%d GPU(s)", n);
    return n;
}
KILN__REGISTER(register_cuda) { kiln__backend_provider_register("cuda", cuda_register, false); }
#else
#include "kiln/tensor.h"
const char *kiln_cuda_status(void) { return "not built (the CUDA toolkit's headers were not found)"; }
/* What the tests and the generators' checks call, without the toolkit: NVRTC is not here. */
kiln_status kiln__cuda_nvrtc(const char *src, const char *name, int major, int minor, char **ptx)
{
    (void)src, (void)major, (void)minor;
    *ptx = NULL;
    return kiln_error(KILN_ERR_UNSUPPORTED, "cuda: %s: NVRTC is not built in (the CUDA toolkit's headers were not "
                      "found)", name);
}
const char *kiln__cuda_builtin_source(void) { return ""; }
void kiln_cuda_versions(int *driver, int *runtime, int *nvrtc)
{
    if (driver) *driver = 0;
    if (runtime) *runtime = 0;
    if (nvrtc) *nvrtc = 0;
}
#endif
