/* Dispatch: every op call goes through here. It checks inputs, infers output shapes,
 * allocates outputs on the inputs' backend, launches that backend's kernel through the
 * contract, and records the call for autograd. In capture mode (src/graph/) the call is
 * recorded into the graph instead of launched, with meta outputs; autograd records it
 * all the same, so a backward inside the capture is captured too. */
#include <stdlib.h>
#include <string.h>
#include "kiln/ops.h"
#include "core/tensor_impl.h"
#include "ops/registry.h"

kiln__node *kiln__record(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                         kiln_tensor_t **out, int n_out);
bool kiln__tracks(const kiln_tensor_t *t);
/* src/graph/graph.c: in capture mode, records the call and gives meta outputs. */
kiln_status kiln__graph_record(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                               const kiln__meta *meta, kiln__backend *be, kiln_tensor_t **out);

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
        kiln__kernel_fn k = be->kernels[op];
        s = k ? k(be, in, n_in, a, outs, d->n_out)
              : kiln__err(KILN_ERR_UNSUPPORTED, "op %s is not supported by backend %s", d->name, be->name);
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
