/* The backend contract as the rest of kiln calls it (src/core/backend.h): one function
 * per entry, with the default for an optional entry a backend leaves NULL, in the way
 * SQLite's os.c stands between the core and a VFS. */
#include "core/backend.h"
#include "core/tensor_impl.h"

static kiln_status unsupported(const kiln__backend *be, const char *what)
{
    return kiln__err(KILN_ERR_UNSUPPORTED, "backend %s has no %s", be->name, what);
}

kiln_status kiln__be_device_info(kiln__backend *be, kiln__device_info *out) { return be->device_info(be, out); }
void *kiln__be_alloc(kiln__backend *be, size_t nbytes) { return be->alloc(be, nbytes); }
void kiln__be_free(kiln__backend *be, void *ptr, size_t nbytes) { be->free(be, ptr, nbytes); }
kiln_status kiln__be_copy_h2d(kiln__backend *be, void *dst, const void *src, size_t n) { return be->copy_h2d(be, dst, src, n); }
kiln_status kiln__be_copy_d2h(kiln__backend *be, void *dst, const void *src, size_t n) { return be->copy_d2h(be, dst, src, n); }
kiln_status kiln__be_copy_d2d(kiln__backend *be, void *dst, const void *src, size_t n) { return be->copy_d2d(be, dst, src, n); }
kiln_status kiln__be_memset(kiln__backend *be, void *dst, int byte, size_t n) { return be->memset(be, dst, byte, n); }
kiln_status kiln__be_synchronize(kiln__backend *be) { return be->synchronize(be); }

kiln__stream *kiln__be_stream_new(kiln__backend *be) { return be->stream_new ? be->stream_new(be) : NULL; }

void kiln__be_stream_free(kiln__backend *be, kiln__stream *s)
{
    if (s && be->stream_free) be->stream_free(be, s);
}

kiln__event *kiln__be_event_record(kiln__backend *be, kiln__stream *s)
{
    if (be->event_record) return be->event_record(be, s);
    be->synchronize(be); /* the work before it is done: nothing is left to wait for */
    return NULL;
}

kiln_status kiln__be_event_wait(kiln__backend *be, kiln__event *e)
{
    return e && be->event_wait ? be->event_wait(be, e) : KILN_OK;
}

void kiln__be_event_free(kiln__backend *be, kiln__event *e)
{
    if (e && be->event_free) be->event_free(be, e);
}

kiln_status kiln__be_event_query(kiln__backend *be, kiln__event *e, bool *done)
{
    if (e && be->event_query) return be->event_query(be, e, done);
    *done = true;
    return kiln__be_event_wait(be, e);
}

kiln_status kiln__be_fill(kiln__backend *be, void *dst, const void *pattern, size_t size, size_t n)
{
    return be->fill ? be->fill(be, dst, pattern, size, n) : unsupported(be, "fill");
}

kiln_status kiln__be_compile_kernel(kiln__backend *be, const char *source, const char *entry, void **kernel_out)
{
    return be->compile_kernel ? be->compile_kernel(be, source, entry, kernel_out) : unsupported(be, "kernel compiler");
}

void kiln__be_kernel_free(kiln__backend *be, void *kernel)
{
    if (kernel && be->kernel_free) be->kernel_free(be, kernel);
}

kiln_status kiln__be_launch(kiln__backend *be, void *kernel, const kiln__karg *args, int nargs, const size_t *grid,
                            const size_t *block, int grid_dims)
{
    return be->launch ? be->launch(be, kernel, args, nargs, grid, block, grid_dims) : unsupported(be, "kernel launch");
}

void *kiln__be_native_stream(kiln__backend *be) { return be->native_stream ? be->native_stream(be) : NULL; }

kiln_status kiln__be_host_register(kiln__backend *be, void *ptr, size_t n)
{
    return be->host_register ? be->host_register(be, ptr, n) : KILN_OK;
}

kiln_status kiln__be_host_unregister(kiln__backend *be, void *ptr)
{
    return be->host_unregister ? be->host_unregister(be, ptr) : KILN_OK;
}

kiln_status kiln__be_capture_begin(kiln__backend *be)
{
    return be->capture_begin ? be->capture_begin(be) : unsupported(be, "graph capture");
}

kiln_status kiln__be_capture_end(kiln__backend *be, void **graph_out)
{
    return be->capture_end ? be->capture_end(be, graph_out) : unsupported(be, "graph capture");
}

kiln_status kiln__be_replay(kiln__backend *be, void *graph)
{
    return be->replay ? be->replay(be, graph) : unsupported(be, "graph replay");
}

kiln_status kiln__be_capture_reset(kiln__backend *be, void *graph)
{
    return be->capture_reset ? be->capture_reset(be, graph) : unsupported(be, "graph capture");
}

bool kiln__be_can_fuse(kiln__backend *be, int op, const kiln_dtype *in, int n_in, kiln_dtype out)
{
    return !be->can_fuse || be->can_fuse(be, op, in, n_in, out);
}

bool kiln__be_has_kernel(const kiln__backend *be, int op) { return be->kernels[op] != NULL; }

bool kiln__be_can_compile(const kiln__backend *be) { return be->language && be->compile_kernel && be->launch; }

bool kiln__be_can_capture(const kiln__backend *be)
{
    return be->capture_begin && be->capture_end && be->replay && be->capture_reset;
}
