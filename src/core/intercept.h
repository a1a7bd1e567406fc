/* How the rooms above dispatch plug into it, so that dispatch knows nothing above it.
 *
 * - An interceptor watches op calls: autograd's tape, graph capture, replay recording;
 *   or rewrites them: autocast.
 *   Autograd's is process-wide (registered once); capture and replay push theirs on the
 *   calling thread's stack while they run. Dispatch calls every active interceptor in
 *   increasing `order`: `before` (may refuse the call), then `take` (may run the call in
 *   its own way instead: capture records it and gives meta outputs), then, after the
 *   kernel ran, `after` (a replay notes the launch, autograd records the node).
 * - A kernel provider runs an op on a backend: the backend's own kernel, a kernel the
 *   compiler generates, the cpu with copies. Dispatch asks them in increasing `order`
 *   until one has it.
 * - An extension slot gives a room a pointer of its own in every tensor (autograd's
 *   gradient state, the value a captured tensor stands for).
 * - A backend provider makes and registers a backend: at start-up (the cpu), or when a
 *   device is first named or listed (OpenCL, CUDA).
 *
 * Registration is for start-up: each room registers from a constructor
 * (KILN__REGISTER below), before main, and nothing is unregistered. */
#ifndef KILN_CORE_INTERCEPT_H
#define KILN_CORE_INTERCEPT_H

#include "core/op_table.h"

/* Runs fn before main: the registrations of a room. The library is linked whole (one
 * object in the static archive, or the shared library), so every room's registrations
 * are present whatever the program calls first. */
#define KILN__REGISTER(fn) __attribute__((constructor)) static void fn(void)

typedef struct kiln__provider kiln__provider;

/* One op call as the interceptors see it. */
typedef struct {
    kiln__op_id op;
    kiln__backend *be; /* the inputs' backend (or the default one for an op without inputs) */
    kiln_tensor_t *const *in;
    int n_in;
    const kiln__attrs *a;
    const kiln__meta *meta;  /* the inferred outputs (zeros in `before`: inference comes after it) */
    kiln_tensor_t **out;     /* [n_out] set before `after` (and by a `take`) */
    int n_out;
    const kiln__provider *ran; /* who ran it; NULL when no kernel ran (a view, no elements, taken) */
} kiln__call_info;

/* The orders of kiln's own interceptors: capture takes a call before the replay notes
 * what ran, and autograd records last, whichever of them ran it. */
enum { KILN__ORDER_CAPTURE = 10, KILN__ORDER_REPLAY = 20, KILN__ORDER_AUTOGRAD = 50 };

typedef struct kiln__interceptor {
    const char *name;
    int order; /* lower first */
    /* Outputs that hold no data while this interceptor is on the stack (graph capture):
     * kiln__dispatch_tracing says so to code that must act differently then. */
    bool traces;
    /* Calls are recorded to be run again later (capture, replay): values read or chosen
     * now would be frozen (kiln__dispatch_recording). */
    bool records;
    /* Runs the call as other calls instead, before any interceptor sees it (autocast
     * casts the inputs and calls the op again, so that what watches ops sees the casts
     * and the op, never the call it replaced); *done says whether it did, and c->out
     * then holds the outputs. c->meta is not yet inferred. */
    kiln_status (*rewrite)(void *ctx, kiln__call_info *c, bool *done);
    kiln_status (*before)(void *ctx, const kiln__call_info *c);
    /* Runs the call in its own way and fills c->out; *taken says whether it did. */
    kiln_status (*take)(void *ctx, kiln__call_info *c, bool *taken);
    kiln_status (*after)(void *ctx, const kiln__call_info *c);
    /* A host read or write of t's data (what: "to_host", "item", ...): may refuse it. */
    kiln_status (*data_access)(void *ctx, const kiln_tensor_t *t, const char *what);
    /* Called when kiln__intercept_suspend takes it off the stack and when it is put back:
     * its room's own per-thread state pauses with it. */
    void (*suspend)(void *ctx);
    void (*resume)(void *ctx);
    void *ctx;
} kiln__interceptor;

/* A process-wide interceptor (autograd): active on every thread. */
kiln_status kiln__intercept_register(const kiln__interceptor *ic);
/* Pushes ic (borrowed until popped) on this thread's stack; pops it. At most 8 deep. */
kiln_status kiln__intercept_push(const kiln__interceptor *ic);
void kiln__intercept_pop(const kiln__interceptor *ic);
/* This thread's interceptor of that name on the stack (the innermost), or NULL. */
const kiln__interceptor *kiln__intercept_find(const char *name);
/* Takes this thread's whole stack off (returns it; NULL when empty) and puts it back:
 * what a graph suspension does for state made outside the recorded function. */
void *kiln__intercept_suspend(void);
void kiln__intercept_resume(void *saved);
/* Pops ic at the end of its capture or recording (what) that has status s so far, and
 * then fails, naming who, when ic sits in a suspension that was never resumed (its
 * function suspended it and returned); that suspension and those taken after it are
 * forgotten, so that no resume puts ic back. */
kiln_status kiln__intercept_end(const kiln__interceptor *ic, kiln_status s, const char *who, const char *what);
bool kiln__dispatch_tracing(void);
bool kiln__dispatch_recording(void);
/* Asks this thread's interceptors whether t's data may be read or written on the host;
 * a tensor without data (a traced placeholder) is refused in any case. */
kiln_status kiln__intercept_data_access(const kiln_tensor_t *t, const char *what);

struct kiln__provider {
    const char *name;
    int order;   /* lower first */
    bool on_cpu; /* runs on the cpu with copies (a device graph cannot hold it) */
    kiln_op_support support; /* how kiln doctor --ops names what it runs */
    /* Whether it would take op on be (for kiln doctor --ops); NULL: never asked. */
    bool (*offers)(const kiln__backend *be, int op);
    /* Runs op on be; *handled false: not this provider's (nothing was run). */
    kiln_status (*run)(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                       kiln_tensor_t *const *out, int n_out, bool *handled);
};
kiln_status kiln__provider_register(const kiln__provider *p);
/* How the first provider that offers op on be runs it (KILN_OP_NONE: none does). */
kiln_op_support kiln__provider_offering(const kiln__backend *be, int op);
/* The provider that runs op on be for these arguments, asked in order (NULL: none). */
kiln_status kiln__provider_run(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                               kiln_tensor_t *const *out, int n_out, const kiln__provider **ran);

/* Extension slots (at most 4). release, when not NULL, frees a tensor's slot value when
 * the tensor header is freed; kept_by_detach copies the value into a detached alias
 * (kiln__tensor_detach). Returns the slot's index, or -1 when there is none left. */
int kiln__ext_register(const char *name, void (*release)(void *value), bool kept_by_detach);
static inline void *kiln__ext(const kiln_tensor_t *t, int slot) { return slot >= 0 ? t->ext[slot] : NULL; }
/* A new header over t's storage and view, with the slots marked kept_by_detach (only
 * slots without release may be: the copy owns nothing). */
kiln_tensor_t *kiln__tensor_detach(const kiln_tensor_t *t);

/* Backend providers: make(nthreads) registers the backends it finds (returns how many).
 * at_init: made by kiln_init (the cpu); otherwise probed on first need. */
kiln_status kiln__backend_provider_register(const char *name, int (*make)(int nthreads), bool at_init);


/* Core's own: dispatch's walk over the active interceptors (at most 12, in order), and
 * the release of a freed tensor's slots (src/core/tensor.c). */
int kiln__intercept_active(const kiln__interceptor **out);
void kiln__ext_release_all(kiln_tensor_t *t);

#endif
