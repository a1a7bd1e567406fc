/* Kernels from source and their launches. The compiler generates OpenCL C for the ops it
 * lowers (src/compile/eager.c), and the backend's own kernels are kernels.cl; each
 * program is built once per process and its binary kept in the kernel cache
 * ($KILN_CACHE_DIR/opencl), keyed by a hash of the source, the device and its driver,
 * so a later process loads it without building. A launch sets its kernel's arguments
 * and enqueues it, or records it while a capture is (opencl_capture.c). */
#ifdef KILN_HAVE_OPENCL
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "backends/opencl/opencl_impl.h"
#include "core/cache.h"
#include "kiln/tensor.h"

/* A built program, by the hash of its source: a list per device, under its prog_lock. */
typedef struct cl_prog {
    uint64_t hash;
    cl_program p;
    struct cl_prog *next;
} cl_prog;

static uint64_t source_hash(const cl_dev *d, const char *src)
{
    uint64_t h = kiln__fnv(KILN__FNV_SEED, src, strlen(src));
    h = kiln__fnv(h, d->description, strlen(d->description));
    h = kiln__fnv(h, d->driver, strlen(d->driver));
    return kiln__fnv(h, KILN_VERSION, strlen(KILN_VERSION));
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
        if (err != CL_SUCCESS) return kiln__opencl_fail(d, "clCreateProgramWithSource", err);
        err = clBuildProgram(p, 1, &d->dev, "-cl-std=CL1.2", NULL, NULL);
        if (err != CL_SUCCESS) { /* keep the source and the build log for the message */
            char sp[1100], lp[1100];
            snprintf(sp, sizeof sp, "%s/%016llx.cl", dir, (unsigned long long)h);
            snprintf(lp, sizeof lp, "%s/%016llx.log", dir, (unsigned long long)h);
            (void)kiln__write_whole(sp, src, strlen(src));
            size_t ln = 0;
            clGetProgramBuildInfo(p, d->dev, CL_PROGRAM_BUILD_LOG, 0, NULL, &ln);
            char *log = malloc(ln + 1);
            if (log && clGetProgramBuildInfo(p, d->dev, CL_PROGRAM_BUILD_LOG, ln, log, NULL) == CL_SUCCESS)
                (void)kiln__write_whole(lp, log, strlen(log));
            free(log);
            clReleaseProgram(p);
            return kiln__err(KILN_ERR_COMPILE, "%s: the OpenCL compiler failed on kernel %s (error %d); source kept at "
                             "%s, the build log at %s", d->name, entry, (int)err, sp, lp);
        }
        size_t bn = 0;
        if (clGetProgramInfo(p, CL_PROGRAM_BINARY_SIZES, sizeof bn, &bn, NULL) == CL_SUCCESS && bn > 0) {
            unsigned char *bin = malloc(bn);
            if (bin && clGetProgramInfo(p, CL_PROGRAM_BINARIES, sizeof bin, &bin, NULL) == CL_SUCCESS)
                (void)kiln__write_whole(path, bin, bn);
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

kiln_status kiln__opencl_compile_kernel(kiln__backend *be, const char *source, const char *entry, void **kernel_out)
{
    cl_dev *d = be->ctx;
    cl_program p;
    pthread_mutex_lock(&d->prog_lock);
    kiln_status s = get_program(d, source, entry, &p);
    cl_int err = CL_SUCCESS;
    cl_kernel k = s == KILN_OK ? clCreateKernel(p, entry, &err) : NULL;
    pthread_mutex_unlock(&d->prog_lock);
    if (s != KILN_OK) return s;
    if (err != CL_SUCCESS) return kiln__opencl_fail(d, "clCreateKernel", err);
    *kernel_out = k;
    return KILN_OK;
}

void kiln__opencl_kernel_free(kiln__backend *be, void *kernel)
{
    if (kernel) clReleaseKernel((cl_kernel)kernel);
}

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

/* Each buffer argument goes as (cl_mem, byte offset into it): the generated kernels take
 * them in pairs. */
kiln_status kiln__opencl_launch(kiln__backend *be, void *kernel, const kiln__karg *args, int nargs, const size_t *grid,
                                const size_t *block, int grid_dims)
{
    cl_dev *d = be->ctx;
    cl_kernel k = kernel;
    kiln_status s = KILN_OK;
    cl_uint ai = 0;
    cl_int err = CL_SUCCESS;
    pthread_mutex_lock(&d->prog_lock);
    if (d->cap && (s = kiln__opencl_record_kernel(d, kernel, &k)) != KILN_OK) {
        pthread_mutex_unlock(&d->prog_lock);
        return s;
    }
    for (int i = 0; s == KILN_OK && err == CL_SUCCESS && i < nargs; i++) {
        cl_long l = args[i].i64;
        cl_float f = (cl_float)args[i].f;
        cl_double g = args[i].f;
        cl_mem mem;
        size_t off;
        cl_ulong o;
        switch (args[i].kind) {
        case KILN__KARG_I64: err = clSetKernelArg(k, ai++, sizeof l, &l); break;
        case KILN__KARG_F32: err = clSetKernelArg(k, ai++, sizeof f, &f); break;
        case KILN__KARG_F64: err = clSetKernelArg(k, ai++, sizeof g, &g); break;
        case KILN__KARG_BUF:
            if ((s = kiln__opencl_resolve(d, args[i].ptr, 0, &mem, &off)) != KILN_OK) break;
            o = off;
            err = clSetKernelArg(k, ai++, sizeof mem, &mem);
            if (err == CL_SUCCESS) err = clSetKernelArg(k, ai++, sizeof o, &o);
        }
    }
    if (s == KILN_OK && err != CL_SUCCESS) s = kiln__opencl_fail(d, "clSetKernelArg", err);
    if (s == KILN_OK && d->cap) {
        s = kiln__opencl_record_launch(d, k, grid_dims, grid, block);
    } else if (s == KILN_OK) {
        err = clEnqueueNDRangeKernel(d->q, k, (cl_uint)grid_dims, NULL, grid, block, 0, NULL, NULL);
        if (err != CL_SUCCESS) s = kiln__opencl_fail(d, "clEnqueueNDRangeKernel", err);
        else if (first_run(d, k, grid, block, grid_dims) && (err = clFinish(d->q)) != CL_SUCCESS)
            s = kiln__opencl_fail(d, "clFinish", err);
    }
    pthread_mutex_unlock(&d->prog_lock);
    return s;
}
#endif
