/* The op table's schema columns, rendered from ops.def, and the rows of the ops
 * defined at run time. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include "core/op_table.h"

#define KILN__GRAD_Y true
#define KILN__GRAD_N false

kiln__op_def kiln__ops[KILN__OP_MAX] = {
#define KILN_OP(ID, nm, kd, nin, nout, nvis, wr, grad, sv, pol)                                                   \
    [KILN_OP_##ID] = {                                                                               \
        .name = #nm,                                                                                 \
        .kind = KILN__KIND_##kd,                                                                     \
        .n_in = nin,                                                                                 \
        .writes = wr,                                                                                 \
        .n_out = nout,                                                                               \
        .n_visible = nvis,                                                                           \
        .save = sv,                                                                                  \
        .has_grad = KILN__GRAD_##grad,                                                               \
        .is_view = KILN__KIND_##kd == KILN__KIND_VIEW,                                               \
        .is_inplace = (nout) == 0,                                                                   \
        .amp = KILN_AMP_##pol,                                                                       \
        .infer = kiln__infer_##nm,                                                                   \
    },
#include "core/ops.def"
#undef KILN_OP
};

const kiln__op_math_t kiln__op_math[KILN__OP_MAX] = {
#define KILN_PW(ID, nm, dtypes, grad, fast)                       \
    [KILN_OP_##ID] = {#nm, false, KILN__PW_##fast},               \
    KILN__PW_IF_OP(grad, [KILN_OP_##ID##_BACKWARD] = {#nm, true, KILN__PW_##fast}, )
#include "kiln/pointwise.def"
#undef KILN_PW
};

/* The custom ops' kernels: one kernel (src/ops/custom.c's, which finds the op's own for
 * the backend) and the backends it serves. */
typedef struct {
    kiln__kernel_fn kernel;
    char devices[8][32];
    int n_devices;
} custom_kernels;

static custom_kernels customs[KILN__CUSTOM_MAX];
static atomic_int n_total = KILN_OP_COUNT;
static pthread_mutex_t add_lock = PTHREAD_MUTEX_INITIALIZER;

int kiln__op_total(void) { return atomic_load_explicit(&n_total, memory_order_acquire); }

int kiln__op_by_name(const char *name)
{
    for (int i = 0, n = kiln__op_total(); name && i < n; i++)
        if (!strcmp(kiln__ops[i].name, name)) return i;
    return -1;
}

kiln_status kiln__op_add(const kiln__op_def *row, kiln__kernel_fn kernel, const char *const *devices, int n_devices,
                         int *id)
{
    if (n_devices > 8) return kiln__err(KILN_ERR_ARG, "op %s: kernels for %d backends, at most 8", row->name, n_devices);
    pthread_mutex_lock(&add_lock);
    int n = atomic_load(&n_total), taken = kiln__op_by_name(row->name);
    kiln_status s = KILN_OK;
    if (taken >= 0)
        s = kiln__err(KILN_ERR_ARG, "op %s: %s op has that name already; choose another", row->name,
                      taken < KILN_OP_COUNT ? "a built-in" : "a custom");
    if (s == KILN_OK && n == KILN__OP_MAX)
        s = kiln__err(KILN_ERR_ARG, "op %s: %d custom ops are defined already, the most there can be", row->name,
                      KILN__CUSTOM_MAX);
    for (int i = 0; s == KILN_OK && i < n_devices; i++)
        if (strlen(devices[i]) >= sizeof customs[0].devices[0])
            s = kiln__err(KILN_ERR_ARG, "op %s: the backend name '%.40s...' is too long", row->name, devices[i]);
    if (s == KILN_OK) {
        custom_kernels *c = &customs[n - KILN_OP_COUNT];
        c->kernel = kernel;
        c->n_devices = n_devices;
        for (int i = 0; i < n_devices; i++) strcpy(c->devices[i], devices[i]);
        kiln__ops[n] = *row;
        *id = n;
        atomic_store_explicit(&n_total, n + 1, memory_order_release);
    }
    pthread_mutex_unlock(&add_lock);
    return s;
}

kiln__kernel_fn kiln__be_kernel(const kiln__backend *be, int op)
{
    if (op < KILN_OP_COUNT) return op >= 0 ? be->kernels[op] : NULL;
    if (op >= kiln__op_total()) return NULL;
    const custom_kernels *c = &customs[op - KILN_OP_COUNT];
    for (int i = 0; i < c->n_devices; i++)
        if (kiln__backend_is(be, c->devices[i])) return c->kernel;
    return NULL;
}
