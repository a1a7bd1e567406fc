/* Graph capture into cl_khr_command_buffer, where the platform has it (PoCL 3.1 does, at
 * the extension's provisional 0.9.0): between capture_begin and capture_end every
 * kernel, device copy and fill goes into a command buffer instead of the queue, each
 * waiting on the one before; a replay enqueues the buffer. A copy to or from the host
 * cannot be recorded and fails the capture. opencl_device.c and opencl_program.c send
 * their work here while d->cap is set. */
#ifdef KILN_HAVE_OPENCL
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "backends/opencl/opencl_impl.h"
#include "kiln/tensor.h"

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
    cl_range *freed;
    int n_k, n_freed;
    size_t cap_k, cap_freed;
    cl_event pending; /* the last run, where the buffer cannot run twice at once */
    bool ran; /* replayed before: the first replay is waited for (first_run() in opencl_program.c) */
} cl_graph;

void kiln__opencl_find_command_buffers(cl_dev *d, cl_platform_id plat)
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

/* Each recorded command waits on the one before: *prev gets that one's sync point and
 * the count (0 for the first) is returned. The wait list goes as NULL when the count is
 * 0 (PoCL 3.1 crashes on a non-NULL list of 0). */
static cl_uint after_last(const cl_graph *g, cl_sync_point_khr *prev)
{
    *prev = g->last;
    return g->any ? 1 : 0;
}

kiln_status kiln__opencl_not_recordable(cl_dev *d, const char *what)
{
    if (!d->cap->failed) d->cap->failed = what;
    return kiln__err(KILN_ERR_UNSUPPORTED, "%s: %s cannot be recorded into a command buffer", d->name, what);
}

bool kiln__opencl_keep_freed(cl_dev *d, cl_range r)
{
    cl_graph *g = d->cap;
    void *tmp;
    if (KILN__GROW(g->freed, g->n_freed, &g->cap_freed, 16, tmp)) {
        g->freed[g->n_freed++] = r;
        return true;
    }
    if (!g->failed) {
        g->failed = "out of memory keeping a freed buffer";
        return true; /* leaked rather than released under a recorded command */
    }
    return false;
}

/* What a command's recording returned (err from the call what), noted on the graph. */
static kiln_status recorded(cl_dev *d, cl_int err, const char *what)
{
    d->cap->any |= err == CL_SUCCESS;
    return err == CL_SUCCESS ? KILN_OK : kiln__opencl_fail(d, what, err);
}

kiln_status kiln__opencl_record_copy(cl_dev *d, cl_mem src, cl_mem dst, size_t src_off, size_t dst_off, size_t n)
{
    cl_graph *g = d->cap;
    cl_sync_point_khr prev;
    cl_int err = d->cb_copy(g->cb, NULL, src, dst, src_off, dst_off, n, after_last(g, &prev), g->any ? &prev : NULL,
                            &g->last, NULL);
    return recorded(d, err, "clCommandCopyBufferKHR");
}

kiln_status kiln__opencl_record_fill(cl_dev *d, cl_mem mem, const void *pattern, size_t size, size_t off, size_t n)
{
    cl_graph *g = d->cap;
    cl_sync_point_khr prev;
    cl_int err = d->cb_fill(g->cb, NULL, mem, pattern, size, off, n, after_last(g, &prev), g->any ? &prev : NULL,
                            &g->last, NULL);
    return recorded(d, err, "clCommandFillBufferKHR");
}

kiln_status kiln__opencl_record_launch(cl_dev *d, cl_kernel k, int dims, const size_t *grid, const size_t *block)
{
    cl_graph *g = d->cap;
    cl_sync_point_khr prev;
    cl_int err = d->cb_kernel(g->cb, NULL, NULL, k, (cl_uint)dims, NULL, grid, block, after_last(g, &prev),
                              g->any ? &prev : NULL, &g->last, NULL);
    return recorded(d, err, "clCommandNDRangeKernelKHR");
}

kiln_status kiln__opencl_record_kernel(cl_dev *d, cl_kernel k, cl_kernel *out)
{
    cl_graph *g = d->cap;
    cl_program prog;
    char name[128] = "";
    cl_int err = clGetKernelInfo(k, CL_KERNEL_PROGRAM, sizeof prog, &prog, NULL);
    if (err == CL_SUCCESS) err = clGetKernelInfo(k, CL_KERNEL_FUNCTION_NAME, sizeof name - 1, name, NULL);
    cl_kernel nk = err == CL_SUCCESS ? clCreateKernel(prog, name, &err) : NULL;
    if (err != CL_SUCCESS) return kiln__opencl_fail(d, "clCreateKernel (recording)", err);
    void *tmp;
    if (!KILN__GROW(g->k, g->n_k, &g->cap_k, 256, tmp)) {
        clReleaseKernel(nk);
        return kiln__err(KILN_ERR_OOM, "%s: out of memory recording a command buffer", d->name);
    }
    g->k[g->n_k++] = nk;
    *out = nk;
    return KILN_OK;
}

static void graph_free(cl_dev *d, cl_graph *g)
{
    if (!g) return;
    if (g->pending) clReleaseEvent(g->pending);
    if (g->cb) d->cb_release(g->cb);
    for (int i = 0; i < g->n_k; i++) clReleaseKernel(g->k[i]);
    for (int i = 0; i < g->n_freed; i++) kiln__opencl_release_range(g->freed[i]);
    free(g->k);
    free(g->freed);
    free(g);
}

/* From here to capture_end the queue's work (kernels, device copies, fills) is recorded,
 * not run; anything else (a copy to or from the host) fails the capture. */
kiln_status kiln__opencl_capture_begin(kiln__backend *be)
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
        return kiln__opencl_fail(d, "clCreateCommandBufferKHR", err);
    }
    pthread_mutex_lock(&d->lock);
    d->cap = g;
    pthread_mutex_unlock(&d->lock);
    return KILN_OK;
}

kiln_status kiln__opencl_capture_end(kiln__backend *be, void **graph_out)
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
    if (s == KILN_OK && err != CL_SUCCESS) s = kiln__opencl_fail(d, "clFinalizeCommandBufferKHR", err);
    if (s != KILN_OK) {
        graph_free(d, g);
        return s;
    }
    *graph_out = g;
    return KILN_OK;
}

kiln_status kiln__opencl_replay(kiln__backend *be, void *graph)
{
    cl_dev *d = be->ctx;
    cl_graph *g = graph;
    if (g->pending) { /* a buffer without simultaneous use must have finished its last run */
        cl_int err = clWaitForEvents(1, &g->pending);
        clReleaseEvent(g->pending);
        g->pending = NULL;
        if (err != CL_SUCCESS) return kiln__opencl_fail(d, "clWaitForEvents", err);
    }
    cl_int err = d->cb_enqueue(0, NULL, g->cb, 0, NULL, d->cb_simultaneous ? NULL : &g->pending);
    if (err != CL_SUCCESS) return kiln__opencl_fail(d, "clEnqueueCommandBufferKHR", err);
    if (!g->ran) { /* its kernels' first runs: see first_run() in opencl_program.c */
        g->ran = true;
        if ((err = clFinish(d->q)) != CL_SUCCESS) return kiln__opencl_fail(d, "clFinish", err);
    }
    if (!d->err) return KILN_OK;
    /* What the host checks before an eager launch the kernels checked: a bad index or
     * target makes this run's results meaningless, and is said. */
    int word = 0, zero = 0;
    kiln_status s = kiln__be_copy_d2h(be, &word, d->err, sizeof word);
    if (s != KILN_OK || !word) return s;
    if ((s = kiln__be_copy_h2d(be, d->err, &zero, sizeof zero)) != KILN_OK) return s;
    /* the word's bits (KILN__CL_ERR_*), each what the kernels that raise it read */
    static const char *const what[3] = {"an index or target outside its range (embedding or cross_entropy)",
                                        "an expert index outside [0, n_experts) (moe_sort)",
                                        "offsets that do not rise from 0 to at most M (grouped_matmul)"};
    char said[320] = "";
    for (int b = 0; b < 3; b++)
        if (word >> b & 1)
            snprintf(said + strlen(said), sizeof said - strlen(said), "%s%s", *said ? "; " : "", what[b]);
    return kiln__err(KILN_ERR_INDEX, "%s: %s in a replayed step: its results are not valid (run the step eagerly to "
                     "see which)", d->name, said);
}

kiln_status kiln__opencl_capture_reset(kiln__backend *be, void *graph)
{
    cl_dev *d = be->ctx;
    clFinish(d->q); /* the buffer may still be running */
    graph_free(d, graph);
    return KILN_OK;
}
#endif
