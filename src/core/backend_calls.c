/* The backend contract as the rest of kiln calls it (src/core/backend.h): one function
 * per entry, with the default for an optional entry a backend leaves NULL, in the way
 * SQLite's os.c stands between the core and a VFS. */
#include "core/backend.h"
#include "core/tensor_impl.h"
#include "core/op_table.h"

static kiln_status unsupported(const kiln__backend *be, const char *what)
{
    return kiln__err(KILN_ERR_UNSUPPORTED, "backend %s has no %s", be->name, what);
}
#define UNSUPPORTED(what) unsupported(be, what)

#define REQUIRED(type, entry, params, args) \
    type kiln__be_##entry params { return be->entry args; }
#define OPTIONAL(type, entry, params, args, dflt) \
    type kiln__be_##entry params { return be->entry ? be->entry args : dflt; }
KILN__BE_REQUIRED_CALLS(REQUIRED)
KILN__BE_OPTIONAL_CALLS(OPTIONAL)

void kiln__be_free(kiln__backend *be, void *ptr, size_t nbytes) { be->free(be, ptr, nbytes); }

kiln__event *kiln__be_event_record(kiln__backend *be)
{
    if (be->event_record) return be->event_record(be);
    be->synchronize(be); /* the work before it is done: nothing is left to wait for */
    return NULL;
}

void kiln__be_event_free(kiln__backend *be, kiln__event *e)
{
    if (e && be->event_free) be->event_free(be, e);
}

kiln_status kiln__be_event_query(kiln__backend *be, kiln__event *e, bool *done)
{
    if (e && be->event_query) return be->event_query(be, e, done);
    *done = true;
    return e && be->event_wait ? be->event_wait(be, e) : KILN_OK;
}

void kiln__be_kernel_free(kiln__backend *be, void *kernel)
{
    if (kernel && be->kernel_free) be->kernel_free(be, kernel);
}

bool kiln__be_can_fuse(kiln__backend *be, int op, const kiln_dtype *in, int n_in, kiln_dtype out)
{
    return !be->can_fuse || be->can_fuse(be, op, in, n_in, out);
}

bool kiln__be_has_kernel(const kiln__backend *be, int op) { return kiln__be_kernel(be, op) != NULL; }

bool kiln__be_can_compile(const kiln__backend *be) { return be->language && be->compile_kernel && be->launch; }

bool kiln__be_can_capture(const kiln__backend *be)
{
    return be->capture_begin && be->capture_end && be->replay && be->capture_reset;
}
