/* Dispatch: every op call goes through here. It checks inputs, infers output shapes,
 * allocates outputs on the inputs' backend, and runs the call through the first kernel
 * provider that has it (the backend's own kernel, a generated one, the cpu with copies).
 * The rooms above watch through interceptors (src/core/intercept.h): autograd records
 * the call after it ran; graph capture takes it instead of running it, giving meta
 * outputs (autograd records it all the same, so a backward inside the capture is
 * captured too); a replay being recorded notes the launch; autocast rewrites a call as
 * casts and the op in the type its precision policy names. Dispatch knows none of them. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/ops.h"
#include "core/dtype.h"
#include "core/tensor_impl.h"
#include "core/intercept.h"

/* Grad mode: whether autograd's interceptor records (per thread). It lives here, below
 * every room, because the rooms under autograd turn it off for work that must not be
 * recorded (a scalar made for an op, a shift constant in logsumexp). */
static _Thread_local bool grad_disabled;

bool kiln_grad_enabled(void) { return !grad_disabled; }

bool kiln_set_grad_enabled(bool on)
{
    bool prev = !grad_disabled;
    grad_disabled = !on;
    return prev;
}

/* A host copy of device tensor t: contiguous bytes, or for a strided view its whole
 * storage under the same view. */
static kiln_tensor_t *host_copy(kiln__backend *cpu, kiln_tensor_t *t, bool *whole)
{
    size_t es = kiln_dtype_size(t->dtype);
    *whole = !kiln__is_contiguous(t);
    if (*whole) {
        int64_t n = (int64_t)(t->st->nbytes / es);
        kiln_tensor_t *all = kiln__tensor_alloc(cpu, t->dtype, &n, 1);
        if (!all) return NULL;
        kiln_tensor_t *v = NULL;
        if (kiln__be_copy_d2h(t->st->be, all->st->data, t->st->data, (size_t)n * es) == KILN_OK)
            v = kiln__tensor_alias(all->st, t->dtype, t->ndim, t->shape, t->stride, t->offset);
        kiln_tensor_free(all);
        return v;
    }
    kiln_tensor_t *h = kiln__tensor_alloc(cpu, t->dtype, t->shape, t->ndim);
    if (h && kiln__be_copy_d2h(t->st->be, kiln__data(h), kiln__data(t), kiln_tensor_nbytes(t)) != KILN_OK) {
        kiln_tensor_free(h);
        return NULL;
    }
    return h;
}

/* How often each backend (by its place, the first 16) ran each op on the cpu with copies. */
static atomic_uint_fast64_t fallbacks[16][KILN__OP_MAX];

uint64_t kiln__cpu_fallbacks(const kiln__backend *be, int op)
{
    for (int bi = 0; bi < 16 && op >= 0 && op < KILN__OP_MAX; bi++)
        if (kiln__backend_at(bi) == be) return atomic_load(&fallbacks[bi][op]);
    return 0;
}

/* An op the backend has no kernel for runs on the cpu: inputs copied to the host, the
 * cpu kernel, outputs (and an in-place destination) copied back. Said once per backend
 * and op, so that a new backend can grow op by op and show what it still lacks. */
kiln_status kiln__cpu_fallback(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                               kiln_tensor_t *const *out, int n_out)
{
    kiln__backend *cpu = kiln__backend_at(0);
    const kiln__op_def *d = &kiln__ops[op];
    kiln__kernel_fn k = kiln__be_kernel(cpu, op);
    if (!k) return kiln__err(KILN_ERR_UNSUPPORTED, "op %s is not supported by backend %s", d->name, be->name);
    int bi = 0;
    while (bi < 16 && kiln__backend_at(bi) != be) bi++;
    if (bi < 16 && atomic_fetch_add(&fallbacks[bi][op], 1) == 0)
        fprintf(stderr, "kiln: %s runs %s on the cpu with copies: no kernel of its own for it, or for these dtypes and "
                "layouts (said once per op; `kiln doctor --ops %s` lists its kernels)\n", be->name, d->name, be->name);
    kiln_tensor_t *stack[16], **h = n_in + n_out > 16 ? calloc((size_t)(n_in + n_out), sizeof *h) : stack;
    bool whole[4] = {false}, w;
    if (!h) return kiln__err(KILN_ERR_OOM, "%s: out of memory", d->name);
    memset(h, 0, sizeof *h * (size_t)(n_in + n_out));
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < n_in; i++) {
        h[i] = host_copy(cpu, in[i], i < 4 ? &whole[i] : &w);
        if (!h[i]) s = kiln_last_status() ? kiln_last_status() : kiln__err(KILN_ERR_OOM, "%s: out of memory", d->name);
    }
    for (int j = 0; s == KILN_OK && j < n_out; j++)
        if (!(h[n_in + j] = kiln__tensor_alloc(cpu, out[j]->dtype, out[j]->shape, out[j]->ndim))) s = kiln_last_status();
    if (s == KILN_OK) s = k(cpu, h, n_in, a, h + n_in, n_out);
    for (int j = 0; s == KILN_OK && j < n_out; j++)
        s = kiln__be_copy_h2d(be, kiln__data(out[j]), kiln__data(h[n_in + j]), kiln_tensor_nbytes(out[j]));
    unsigned mutated = kiln__written_inputs(op);
    for (int i = 0; s == KILN_OK && i < 4 && i < n_in; i++)
        if (mutated >> i & 1)
            s = whole[i] ? kiln__be_copy_h2d(be, in[i]->st->data, h[i]->st->data, in[i]->st->nbytes)
                         : kiln__be_copy_h2d(be, kiln__data(in[i]), kiln__data(h[i]), kiln_tensor_nbytes(in[i]));
    for (int i = 0; i < n_in + n_out; i++) kiln_tensor_free(h[i]);
    if (h != stack) free(h);
    return s;
}

/* full, fill_ and copy_ for any backend with a fill entry, from the contract alone
 * (the layouts they do not take go to the cpu). */
static kiln_status fill_value(kiln__backend *be, kiln_tensor_t *t, double v)
{
    unsigned char pat[8];
    kiln__store(pat, t->dtype, v);
    return kiln__be_fill(be, kiln__data(t), pat, kiln_dtype_size(t->dtype), kiln_tensor_nbytes(t));
}

static kiln_status generic_full(KILN__KERNEL_ARGS)
{
    return fill_value(be, out[0], a->op.source.value);
}

static kiln_status generic_fill_(KILN__KERNEL_ARGS)
{
    if (!kiln__is_contiguous(in[0])) return kiln__cpu_fallback(be, KILN_OP_FILL_, in, n_in, a, out, n_out);
    return fill_value(be, in[0], a->op.scalar.value);
}

static kiln_status generic_copy_(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *dst = in[0], *src = in[1];
    if (dst->dtype != src->dtype || !kiln__is_contiguous(dst) || kiln_tensor_numel(dst) != kiln_tensor_numel(src) ||
        src->st->be != be)
        return kiln__cpu_fallback(be, KILN_OP_COPY_, in, n_in, a, out, n_out);
    /* A strided source is made dense on the device first (unwatched: this launch stands
     * for it in a replay), then copied. */
    kiln_tensor_t *c = kiln__dense(src);
    kiln_status s = c ? kiln__be_copy_d2d(be, kiln__data(dst), kiln__data(c), kiln_tensor_nbytes(dst)) : kiln_last_status();
    kiln_tensor_free(c);
    return s;
}

/* The kernel dispatch uses for op on be: its own, or the contract-made one, or NULL. */
static kiln__kernel_fn kernel_for(const kiln__backend *be, int op)
{
    kiln__kernel_fn own = kiln__be_kernel(be, op);
    if (own || !be->fill) return own;
    return op == KILN_OP_FULL ? generic_full : op == KILN_OP_FILL_ ? generic_fill_ : op == KILN_OP_COPY_ ? generic_copy_
                                                                                                            : NULL;
}

/* The backend's own kernel (or the contract-made one). */
static kiln_status run_kernel(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                              kiln_tensor_t *const *out, int n_out, bool *handled)
{
    kiln__kernel_fn k = kernel_for(be, op);
    *handled = k != NULL;
    return k ? k(be, in, n_in, a, out, n_out) : KILN_OK;
}

/* Last: the cpu with copies (an error naming the op where the cpu lacks it too). */
static kiln_status run_on_cpu(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                              kiln_tensor_t *const *out, int n_out, bool *handled)
{
    *handled = true;
    return kiln__cpu_fallback(be, op, in, n_in, a, out, n_out);
}

static bool has_kernel(const kiln__backend *be, int op) { return kernel_for(be, op) != NULL; }
static bool cpu_has(const kiln__backend *be, int op) { return kiln__be_kernel(kiln__backend_at(0), op) != NULL; }

static const kiln__provider kernel_provider = {
    .name = "kernel", .order = 0, .support = KILN_OP_NATIVE, .offers = has_kernel, .run = run_kernel};
static const kiln__provider cpu_provider = {
    .name = "cpu-copies", .order = 100, .on_cpu = true, .support = KILN_OP_ON_CPU, .offers = cpu_has, .run = run_on_cpu};

KILN__REGISTER(register_providers)
{
    kiln__provider_register(&kernel_provider);
    kiln__provider_register(&cpu_provider);
}

static void free_outs(kiln_tensor_t **outs, int n)
{
    for (int j = 0; j < n; j++) {
        kiln_tensor_free(outs[j]);
        outs[j] = NULL;
    }
}

static kiln_status dispatch(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                            kiln_tensor_t **out, bool watched)
{
    kiln__ensure_init();
    const kiln__op_def *d = &kiln__ops[op];
    for (int i = 0; i < n_in; i++)
        if (!in[i]) return kiln__null_arg(d->name);
    if (d->n_in >= 0 && n_in != d->n_in)
        return kiln__err(KILN_ERR_INTERNAL, "%s: called with %d inputs, takes %d", d->name, n_in, d->n_in);
    kiln__backend *be = n_in ? in[0]->st->be : kiln__backend_default();
    for (int i = 1; i < n_in; i++)
        if (in[i]->st->be != be)
            return kiln__err(KILN_ERR_DEVICE, "%s: input 0 is on %s but input %d is on %s (move one with kiln_tensor_to)",
                             d->name, be->name, i, in[i]->st->be->name);

    const kiln__interceptor *ics[16];
    int n_ics = watched ? kiln__intercept_active(ics) : 0;
    kiln__meta meta[KILN__MAX_OUT] = {0};
    kiln_tensor_t *outs[KILN__MAX_OUT] = {0};
    kiln__call_info c = {.op = op, .be = be, .in = in, .n_in = n_in, .a = a, .meta = meta, .out = outs,
                         .n_out = d->n_out};
    kiln_status s;
    for (int k = 0; k < n_ics; k++) {
        bool done = false;
        if (ics[k]->rewrite && (s = ics[k]->rewrite(ics[k]->ctx, &c, &done)) != KILN_OK) return s;
        for (int j = 0; done && j < d->n_out; j++) out[j] = outs[j];
        if (done) return KILN_OK;
    }
    for (int k = 0; k < n_ics; k++)
        if (ics[k]->before && (s = ics[k]->before(ics[k]->ctx, &c)) != KILN_OK) return s;
    if ((s = d->infer(in, n_in, a, meta)) != KILN_OK) return s;
    bool taken = false;
    for (int k = 0; k < n_ics && !taken; k++)
        if (ics[k]->take && (s = ics[k]->take(ics[k]->ctx, &c, &taken)) != KILN_OK) return s;
    int64_t out_elems = 0;
    for (int j = 0; !taken && j < d->n_out; j++) {
        outs[j] = d->is_view ? kiln__tensor_alias(in[0]->st, meta[j].dtype, meta[j].ndim, meta[j].shape,
                                                   meta[j].stride, meta[j].offset)
                             : kiln__tensor_alloc(be, meta[j].dtype, meta[j].shape, meta[j].ndim);
        if (!outs[j]) {
            free_outs(outs, j);
            return kiln_last_status();
        }
        out_elems += kiln__numel(meta[j].ndim, meta[j].shape);
    }
    if (!taken && !d->is_view && (out_elems > 0 || d->is_inplace) &&
        (s = kiln__provider_run(be, op, in, n_in, a, outs, d->n_out, &c.ran)) != KILN_OK) {
        free_outs(outs, d->n_out);
        return s;
    }
    for (int k = 0; k < n_ics; k++)
        if (ics[k]->after && (s = ics[k]->after(ics[k]->ctx, &c)) != KILN_OK) {
            free_outs(outs, d->n_out);
            return s;
        }
    for (int j = 0; j < d->n_out; j++) out[j] = outs[j];
    return KILN_OK;
}

kiln_status kiln__dispatch(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                           kiln_tensor_t **out)
{
    return dispatch(op, in, n_in, a, out, true);
}

kiln_status kiln__dispatch_quiet(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                 kiln_tensor_t **out)
{
    return dispatch(op, in, n_in, a, out, false);
}

kiln_tensor_t *kiln__dense(kiln_tensor_t *t)
{
    kiln_tensor_t *c = NULL;
    if (kiln__is_contiguous(t)) return kiln_tensor_retain(t);
    return kiln__dispatch_quiet(KILN_OP_CONTIGUOUS, &t, 1, &(kiln__attrs){0}, &c) == KILN_OK ? c : NULL;
}

kiln_tensor_t *kiln__call(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a)
{
    kiln_tensor_t *out[KILN__MAX_OUT] = {0};
    if (kiln__dispatch(op, in, n_in, a, out) != KILN_OK) return NULL;
    for (int j = 1; j < kiln__ops[op].n_out; j++) kiln_tensor_free(out[j]);
    return kiln__scoped(out[0]);
}

int kiln_op_count(void) { return kiln__op_total(); }

const char *kiln_op_name(int i) { return i >= 0 && i < kiln__op_total() ? kiln__ops[i].name : NULL; }

kiln_op_support kiln_device_op_support(const char *device, int op)
{
    kiln__backend *be = kiln__backend_find(device);
    if (!be || op < 0 || op >= kiln__op_total()) return KILN_OP_NONE;
    if (kiln__ops[op].is_view) return KILN_OP_NATIVE; /* views alias storage on every device */
    return kiln__provider_offering(be, op);
}
