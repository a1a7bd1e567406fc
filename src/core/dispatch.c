/* Dispatch: every op call goes through here. It checks inputs, infers output shapes,
 * allocates outputs on the inputs' backend, launches that backend's kernel through the
 * contract, and records the call for autograd. In capture mode (src/graph/) the call is
 * recorded into the graph instead of launched, with meta outputs; autograd records it
 * all the same, so a backward inside the capture is captured too. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/ops.h"
#include "core/dtype.h"
#include "core/tensor_impl.h"
#include "ops/registry.h"

kiln__node *kiln__record(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                         kiln_tensor_t **out, int n_out);
bool kiln__tracks(const kiln_tensor_t *t);
/* src/graph/graph.c: in capture mode, records the call and gives meta outputs. */
kiln_status kiln__graph_record(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                               const kiln__meta *meta, kiln__backend *be, kiln_tensor_t **out);

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
        if (t->st->be->copy_d2h(t->st->be, all->st->data, t->st->data, (size_t)n * es) == KILN_OK)
            v = kiln__tensor_alias(all->st, t->dtype, t->ndim, t->shape, t->stride, t->offset);
        kiln_tensor_free(all);
        return v;
    }
    kiln_tensor_t *h = kiln__tensor_alloc(cpu, t->dtype, t->shape, t->ndim);
    if (h && t->st->be->copy_d2h(t->st->be, kiln__data(h), kiln__data(t), kiln_tensor_nbytes(t)) != KILN_OK) {
        kiln_tensor_free(h);
        return NULL;
    }
    return h;
}

/* An op the backend has no kernel for runs on the cpu: inputs copied to the host, the
 * cpu kernel, outputs (and an in-place destination) copied back. Said once per backend
 * and op, so that a new backend can grow op by op and show what it still lacks. */
kiln_status kiln__cpu_fallback(kiln__backend *be, int op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                               kiln_tensor_t *const *out, int n_out)
{
    static atomic_bool said[16][KILN_OP_COUNT];
    kiln__backend *cpu = kiln__backend_at(0);
    const kiln__op_def *d = &kiln__ops[op];
    if (!cpu->kernels[op]) return kiln__err(KILN_ERR_UNSUPPORTED, "op %s is not supported by backend %s", d->name, be->name);
    int bi = 0;
    while (bi < 16 && kiln__backend_at(bi) != be) bi++;
    if (bi < 16 && !atomic_exchange(&said[bi][op], true))
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
    if (s == KILN_OK) s = cpu->kernels[op](cpu, h, n_in, a, h + n_in, n_out);
    for (int j = 0; s == KILN_OK && j < n_out; j++)
        s = be->copy_h2d(be, kiln__data(out[j]), kiln__data(h[n_in + j]), kiln_tensor_nbytes(out[j]));
    unsigned mutated = kiln__written_inputs(op);
    for (int i = 0; s == KILN_OK && i < 4 && i < n_in; i++)
        if (mutated >> i & 1)
            s = whole[i] ? be->copy_h2d(be, in[i]->st->data, h[i]->st->data, in[i]->st->nbytes)
                         : be->copy_h2d(be, kiln__data(in[i]), kiln__data(h[i]), kiln_tensor_nbytes(in[i]));
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
    return be->fill(be, kiln__data(t), pat, kiln_dtype_size(t->dtype), kiln_tensor_nbytes(t));
}

static kiln_status generic_full(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                kiln_tensor_t *const *out, int n_out)
{
    return fill_value(be, out[0], a->f[0]);
}

static kiln_status generic_fill_(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                 kiln_tensor_t *const *out, int n_out)
{
    if (!kiln__is_contiguous(in[0])) return kiln__cpu_fallback(be, KILN_OP_FILL_, in, n_in, a, out, n_out);
    return fill_value(be, in[0], a->f[0]);
}

static kiln_status generic_copy_(kiln__backend *be, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                 kiln_tensor_t *const *out, int n_out)
{
    kiln_tensor_t *dst = in[0], *src = in[1];
    if (dst->dtype != src->dtype || !kiln__is_contiguous(dst) || kiln_tensor_numel(dst) != kiln_tensor_numel(src) ||
        src->st->be != be)
        return kiln__cpu_fallback(be, KILN_OP_COPY_, in, n_in, a, out, n_out);
    if (kiln__is_contiguous(src)) return be->copy_d2d(be, kiln__data(dst), kiln__data(src), kiln_tensor_nbytes(dst));
    /* A strided source: made dense on the device first (unrecorded: this launch stands
     * for it in a replay), then copied. */
    kiln__attrs none = {0};
    kiln_tensor_t *c = NULL;
    bool prev = kiln_set_grad_enabled(false);
    void *rec = kiln__replay_pause();
    kiln_status s = kiln__dispatch(KILN_OP_CONTIGUOUS, &src, 1, &none, &c);
    kiln__replay_unpause(rec);
    kiln_set_grad_enabled(prev);
    if (s == KILN_OK) s = be->copy_d2d(be, kiln__data(dst), kiln__data(c), kiln_tensor_nbytes(dst));
    kiln_tensor_free(c);
    return s;
}

/* The kernel dispatch uses for op on be: its own, or the contract-made one, or NULL. */
static kiln__kernel_fn kernel_for(const kiln__backend *be, int op)
{
    if (be->kernels[op]) return be->kernels[op];
    if (!be->fill) return NULL;
    return op == KILN_OP_FULL ? generic_full : op == KILN_OP_FILL_ ? generic_fill_ : op == KILN_OP_COPY_ ? generic_copy_
                                                                                                            : NULL;
}

kiln_status kiln__dispatch(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                           kiln_tensor_t **out)
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
    if (kiln__replay_recording() && (op == KILN_OP_RAND || (op == KILN_OP_DROPOUT && a->f[0] > 0)))
        return kiln__err(KILN_ERR_UNSUPPORTED, "%s while recording a replay: its random stream would be frozen and every "
                         "replay would draw the same numbers; record without it (dropout 0)", d->name);
    if (d->is_inplace && kiln_grad_enabled() && kiln__tracks(in[0]))
        return kiln__err(KILN_ERR_AUTOGRAD, "%s: the destination is tracked by autograd; update it with grad mode off",
                         d->name);

    kiln__meta meta[KILN__MAX_OUT];
    memset(meta, 0, sizeof meta);
    kiln_status s = d->infer(in, n_in, a, meta);
    if (s != KILN_OK) return s;
    kiln_tensor_t *outs[KILN__MAX_OUT] = {0};
    bool captured = kiln__graph_capturing();
    if (captured && (s = kiln__graph_record(op, in, n_in, a, meta, be, outs)) != KILN_OK) return s;
    int64_t out_elems = 0;
    for (int j = 0; !captured && j < d->n_out; j++) {
        outs[j] = d->is_view ? kiln__tensor_alias(in[0]->st, meta[j].dtype, meta[j].ndim, meta[j].shape,
                                                   meta[j].stride, meta[j].offset)
                             : kiln__tensor_alloc(be, meta[j].dtype, meta[j].shape, meta[j].ndim);
        if (!outs[j]) {
            for (int k = 0; k < j; k++) kiln_tensor_free(outs[k]);
            return kiln_last_status();
        }
        out_elems += kiln__numel(meta[j].ndim, meta[j].shape);
    }
    if (!captured && !d->is_view && (out_elems > 0 || d->is_inplace)) {
        kiln__kernel_fn k = kernel_for(be, op);
        bool handled = false;
        kiln__launch_kind how = KILN__LAUNCH_KERNEL;
        if (k) s = k(be, in, n_in, a, outs, d->n_out);
        else if ((s = kiln__eager_compiled(be, op, in, n_in, a, outs, d->n_out, &handled)) == KILN_OK && !handled) {
            s = kiln__cpu_fallback(be, op, in, n_in, a, outs, d->n_out);
            how = KILN__LAUNCH_ON_CPU;
        } else {
            how = KILN__LAUNCH_COMPILED;
        }
        if (s == KILN_OK && kiln__replay_recording()) kiln__replay_note(how, op, be, k, in, n_in, a, outs, d->n_out);
        if (s != KILN_OK) {
            for (int j = 0; j < d->n_out; j++) kiln_tensor_free(outs[j]);
            return s;
        }
    }
    if (d->backward && kiln_grad_enabled()) {
        bool any = false;
        for (int i = 0; i < n_in; i++) any |= kiln__tracks(in[i]);
        if (any && !kiln__record(op, in, n_in, a, outs, d->n_out)) {
            for (int j = 0; j < d->n_out; j++) kiln_tensor_free(outs[j]);
            return kiln_last_status();
        }
    }
    for (int j = 0; j < d->n_out; j++) out[j] = outs[j];
    return KILN_OK;
}

kiln_tensor_t *kiln__call(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a)
{
    kiln_tensor_t *out[KILN__MAX_OUT] = {0};
    if (kiln__dispatch(op, in, n_in, a, out) != KILN_OK) return NULL;
    for (int j = 1; j < kiln__ops[op].n_out; j++) kiln_tensor_free(out[j]);
    return kiln__scoped(out[0]);
}

int kiln_op_count(void) { return KILN_OP_COUNT; }

const char *kiln_op_name(int i) { return i >= 0 && i < KILN_OP_COUNT ? kiln__ops[i].name : NULL; }

kiln_op_support kiln_device_op_support(const char *device, int op)
{
    kiln__backend *be = kiln__backend_find(device), *cpu = kiln__backend_at(0);
    if (!be || op < 0 || op >= KILN_OP_COUNT) return KILN_OP_NONE;
    if (kiln__ops[op].is_view) return KILN_OP_NATIVE; /* views alias storage on every device */
    if (kernel_for(be, op)) return KILN_OP_NATIVE;
    return cpu->kernels[op] ? KILN_OP_ON_CPU : KILN_OP_NONE;
}
