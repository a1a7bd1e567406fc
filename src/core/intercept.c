/* Interceptors, kernel providers and extension slots: the registration side of
 * src/core/intercept.h. Registrations happen before main (constructors), so the tables
 * are plain arrays read without locks afterwards. */
#include <stdatomic.h>
#include <string.h>
#include "core/intercept.h"

#define MAX_GLOBAL 4
#define MAX_STACK 8
#define MAX_PROVIDERS 8

static const kiln__interceptor *global_ics[MAX_GLOBAL];
static int n_global;

typedef struct {
    const kiln__interceptor *ic[MAX_STACK];
    int n;
} ic_stack;
static _Thread_local ic_stack stack;

static const kiln__provider *providers[MAX_PROVIDERS];
static int n_providers;

typedef struct {
    const char *name;
    void (*release)(void *value);
    bool kept_by_detach;
} ext_slot;
static ext_slot slots[KILN__EXT_SLOTS];
static int n_slots;

/* Inserts item into list (n entries) by its order, after those of the same order (the
 * interceptors' lists and the providers'). */
#define INSERT_ORDERED(list, n, item)                                                      \
    do {                                                                                   \
        int at_ = (n);                                                                     \
        for (; at_ > 0 && (list)[at_ - 1]->order > (item)->order; at_--) (list)[at_] = (list)[at_ - 1]; \
        (list)[at_] = (item);                                                              \
    } while (0)

kiln_status kiln__intercept_register(const kiln__interceptor *ic)
{
    if (!ic || !ic->name) return kiln__err(KILN_ERR_ARG, "intercept_register: interceptor or its name is NULL");
    if (n_global == MAX_GLOBAL)
        return kiln__err(KILN_ERR_ARG, "intercept_register: %s: at most %d process-wide interceptors", ic->name, MAX_GLOBAL);
    INSERT_ORDERED(global_ics, n_global++, ic);
    return KILN_OK;
}

kiln_status kiln__intercept_push(const kiln__interceptor *ic)
{
    if (!ic || !ic->name) return kiln__err(KILN_ERR_ARG, "intercept_push: interceptor or its name is NULL");
    if (stack.n == MAX_STACK)
        return kiln__err(KILN_ERR_UNSUPPORTED, "%s: this thread already has %d interceptors (captures and recordings "
                         "nested that deep)", ic->name, MAX_STACK);
    INSERT_ORDERED(stack.ic, stack.n++, ic);
    return KILN_OK;
}

void kiln__intercept_pop(const kiln__interceptor *ic)
{
    for (int i = stack.n - 1; i >= 0; i--)
        if (stack.ic[i] == ic) {
            memmove(&stack.ic[i], &stack.ic[i + 1], sizeof stack.ic[0] * (size_t)(stack.n - i - 1));
            stack.n--;
            return;
        }
}

const kiln__interceptor *kiln__intercept_find(const char *name)
{
    for (int i = stack.n - 1; i >= 0; i--)
        if (!strcmp(stack.ic[i]->name, name)) return stack.ic[i];
    return NULL;
}

/* Suspensions nest; each keeps the stack it took off. */
#define MAX_SUSPENDED 32
static _Thread_local ic_stack suspended[MAX_SUSPENDED];
static _Thread_local int n_suspended;

void *kiln__intercept_suspend(void)
{
    if (!stack.n || n_suspended == MAX_SUSPENDED) return NULL;
    ic_stack *sp = &suspended[n_suspended++];
    *sp = stack;
    stack.n = 0;
    for (int i = sp->n - 1; i >= 0; i--)
        if (sp->ic[i]->suspend) sp->ic[i]->suspend(sp->ic[i]->ctx);
    return sp;
}

void kiln__intercept_resume(void *saved)
{
    if (!saved) return;
    ic_stack *sp = saved;
    stack = *sp;
    n_suspended = (int)(sp - suspended);
    for (int i = 0; i < stack.n; i++)
        if (stack.ic[i]->resume) stack.ic[i]->resume(stack.ic[i]->ctx);
}

kiln_status kiln__intercept_end(const kiln__interceptor *ic, kiln_status s, const char *who, const char *what)
{
    kiln__intercept_pop(ic);
    for (int k = n_suspended - 1; k >= 0; k--)
        for (int i = 0; i < suspended[k].n; i++)
            if (suspended[k].ic[i] == ic) {
                n_suspended = k;
                if (s != KILN_OK) return s;
                return kiln__err(KILN_ERR_ARG, "%s: the function suspended the %s (kiln_graph_suspend) and returned "
                                 "without resuming it (kiln_graph_resume)", who, what);
            }
    return s;
}

/* Whether an interceptor on this thread's stack traces (traces true) or records. */
static bool stack_any(bool traces)
{
    for (int i = 0; i < stack.n; i++)
        if (traces ? stack.ic[i]->traces : stack.ic[i]->records) return true;
    return false;
}

bool kiln__dispatch_tracing(void) { return stack_any(true); }
bool kiln__dispatch_recording(void) { return stack_any(false); }

/* The active interceptors in order: this thread's stack merged with the process-wide
 * ones (both already sorted). Returns how many, at most MAX_GLOBAL + MAX_STACK. */
int kiln__intercept_active(const kiln__interceptor **out)
{
    int i = 0, j = 0, n = 0;
    while (i < stack.n || j < n_global) {
        if (j == n_global || (i < stack.n && stack.ic[i]->order <= global_ics[j]->order)) out[n++] = stack.ic[i++];
        else out[n++] = global_ics[j++];
    }
    return n;
}

kiln_status kiln__intercept_data_access(const kiln_tensor_t *t, const char *what)
{
    for (int i = stack.n - 1; i >= 0; i--) {
        const kiln__interceptor *ic = stack.ic[i];
        kiln_status s = ic->data_access ? ic->data_access(ic->ctx, t, what) : KILN_OK;
        if (s != KILN_OK) return s;
    }
    if (t->st->meta)
        return kiln__err(KILN_ERR_UNSUPPORTED, "%s: the tensor has no data: it stands for a value of a graph capture "
                         "that has ended; use the graph's outputs instead", what);
    return KILN_OK;
}

kiln_status kiln__provider_register(const kiln__provider *p)
{
    if (!p || !p->name || !p->run) return kiln__err(KILN_ERR_ARG, "provider_register: provider, name or run is NULL");
    if (n_providers == MAX_PROVIDERS) return kiln__err(KILN_ERR_ARG, "provider_register: at most %d", MAX_PROVIDERS);
    INSERT_ORDERED(providers, n_providers++, p);
    return KILN_OK;
}

kiln_status kiln__provider_run(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                               kiln_tensor_t *const *out, int n_out, const kiln__provider **ran)
{
    *ran = NULL;
    for (int i = 0; i < n_providers; i++) {
        bool handled = false;
        kiln_status s = providers[i]->run(be, op, in, n_in, a, out, n_out, &handled);
        if (handled || s != KILN_OK) {
            if (handled) *ran = providers[i];
            return s;
        }
    }
    return kiln__err(KILN_ERR_UNSUPPORTED, "op %s is not supported by backend %s", kiln__ops[op].name, be->name);
}

kiln_op_support kiln__provider_offering(const kiln__backend *be, int op)
{
    for (int i = 0; i < n_providers; i++)
        if (providers[i]->offers && providers[i]->offers(be, op)) return providers[i]->support;
    return KILN_OP_NONE;
}

int kiln__ext_register(const char *name, void (*release)(void *value), bool kept_by_detach)
{
    if (n_slots == KILN__EXT_SLOTS || (release && kept_by_detach)) return -1; /* a copied value has no owner */
    slots[n_slots] = (ext_slot){name, release, kept_by_detach};
    return n_slots++;
}

void kiln__ext_release_all(kiln_tensor_t *t)
{
    for (int i = 0; i < n_slots; i++)
        if (t->ext[i] && slots[i].release) slots[i].release(t->ext[i]);
}

kiln_tensor_t *kiln__tensor_detach(const kiln_tensor_t *t)
{
    kiln_tensor_t *d = kiln__tensor_alias(t->st, t->dtype, t->ndim, t->shape, t->stride, t->offset);
    for (int i = 0; d && i < n_slots; i++)
        if (slots[i].kept_by_detach) d->ext[i] = t->ext[i];
    return d;
}
