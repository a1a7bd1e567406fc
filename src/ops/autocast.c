/* Autocast (kiln/ops.h): an interceptor on this thread's stack while a region is open,
 * which rewrites a call whose op's precision policy (ops.def's amp column) wants other
 * types than its inputs have into casts and the same op on the cast inputs. Those are
 * ordinary dispatches, so autograd, capture and replay see them as the user's own casts;
 * the op's second dispatch finds its inputs already in place and is not rewritten. */
#include <string.h>
#include "core/dtype.h"
#include "core/tensor_impl.h"
#include "core/intercept.h"
#include "ops/autocast.h"

#define MAX_DEPTH 8

/* This thread's open regions, innermost last, and whether a backward paused them. */
static _Thread_local struct {
    kiln_dtype dt[MAX_DEPTH];
    int n;
    bool paused;
} regions;

/* Process-wide overrides of the op table's column, set before work starts:
 * 0 for none, else the policy + 1. */
static unsigned char override[KILN__OP_MAX];

kiln_amp_policy kiln_op_amp_policy(int op)
{
    if (op < 0 || op >= kiln__op_total()) return KILN_AMP_ANY;
    return override[op] ? (kiln_amp_policy)(override[op] - 1) : kiln__ops[op].amp;
}

const char *kiln_amp_policy_name(kiln_amp_policy p)
{
    return p == KILN_AMP_LOW ? "low" : p == KILN_AMP_F32 ? "f32" : p == KILN_AMP_ANY ? "any" : "?";
}

/* Ops autocast never casts for: cast itself (its inputs' casts would be rewritten
 * again, without end), and the ops that write or alias their inputs (an update of a
 * cast copy would be lost). */
static bool castable(int op)
{
    const kiln__op_def *d = &kiln__ops[op];
    return op != KILN_OP_CAST && !d->is_view && !d->is_inplace && !d->writes;
}

kiln_status kiln_op_set_amp_policy(const char *op, kiln_amp_policy p)
{
    if (p != KILN_AMP_ANY && p != KILN_AMP_LOW && p != KILN_AMP_F32)
        return kiln__err(KILN_ERR_ARG, "op_set_amp_policy: %d is not a policy (KILN_AMP_ANY, _LOW or _F32)", (int)p);
    int i = kiln__op_by_name(op);
    if (i >= 0) {
        if (p != KILN_AMP_ANY && !castable(i))
            return kiln__err(KILN_ERR_ARG, "op_set_amp_policy: %s %s; autocast leaves it as it is", op,
                             i == KILN_OP_CAST ? "is the cast autocast makes" : "writes or aliases its inputs");
        override[i] = (unsigned char)(p + 1);
        return KILN_OK;
    }
    return kiln__err(KILN_ERR_ARG, "op_set_amp_policy: no op is named '%s' (kiln doctor --ops lists them)",
                     op ? op : "(null)");
}

/* Whether autocast to `want` under policy p casts t. */
static bool casts(const kiln_tensor_t *t, kiln_amp_policy p, kiln_dtype want)
{
    kiln_dtype dt = t->dtype;
    if (!kiln_dtype_is_float(dt) || dt == KILN_DTYPE_F64 || dt == want) return false;
    return p == KILN_AMP_LOW || kiln__is_half(dt);
}

/* Casts t to `want` in the order its elements lie in memory: a permuted view of a
 * contiguous tensor (kiln_linear's transpose(w)) is cast as the tensor it views and
 * permuted back. The cast then runs over contiguous memory (a transposed cast walks
 * down columns, and in a compiled graph that is a strided gather), its gradient's cast
 * too, and the product reads the weight as it is stored. */
static kiln_status cast_as_stored(kiln_tensor_t *t, kiln_dtype want, kiln_tensor_t **out)
{
    const kiln__attrs cast = {.op.cast.dtype = want};
    int nd = t->ndim, order[KILN_MAX_DIMS];
    for (int i = 0; i < nd; i++) order[i] = i;
    for (int i = 1; i < nd; i++) /* dims by falling stride, ties in order */
        for (int k = i; k > 0 && t->stride[order[k]] > t->stride[order[k - 1]]; k--) {
            int x = order[k];
            order[k] = order[k - 1];
            order[k - 1] = x;
        }
    bool permuted = false, dense = true;
    int64_t expect = 1;
    for (int d = nd - 1; d >= 0; d--) {
        permuted |= order[d] != d;
        if (t->shape[order[d]] != 1 && t->stride[order[d]] != expect) dense = false;
        expect *= t->shape[order[d]];
    }
    if (!permuted || !dense || kiln__is_contiguous(t)) return kiln__dispatch(KILN_OP_CAST, &t, 1, &cast, out);
    kiln__attrs fwd = {.ndim = nd}, back = {.ndim = nd};
    for (int i = 0; i < nd; i++) {
        fwd.shape[i] = order[i];
        back.shape[order[i]] = i;
    }
    kiln_tensor_t *base = NULL, *low = NULL;
    kiln_status s = kiln__dispatch(KILN_OP_PERMUTE, &t, 1, &fwd, &base);
    if (s == KILN_OK) s = kiln__dispatch(KILN_OP_CAST, &base, 1, &cast, &low);
    if (s == KILN_OK) s = kiln__dispatch(KILN_OP_PERMUTE, &low, 1, &back, out);
    kiln_tensor_free(base);
    kiln_tensor_free(low);
    return s;
}

static kiln_status rewrite(void *ctx, kiln__call_info *c, bool *done)
{
    *done = false;
    kiln_dtype to = regions.n ? regions.dt[regions.n - 1] : KILN_DTYPE_F32;
    kiln_amp_policy p = kiln_op_amp_policy(c->op);
    if (regions.paused || to == KILN_DTYPE_F32 || p == KILN_AMP_ANY || !castable(c->op)) return KILN_OK;
    if (c->n_in > 8) /* only cat takes a list, and its policy is ANY */
        return kiln__err(KILN_ERR_UNSUPPORTED, "autocast: %s has %d inputs, at most 8 are cast", kiln__ops[c->op].name,
                         c->n_in);
    kiln_dtype want = p == KILN_AMP_LOW ? to : KILN_DTYPE_F32;
    kiln_tensor_t *in[8];
    bool any = false;
    for (int i = 0; i < c->n_in; i++) any |= casts(c->in[i], p, want);
    if (!any) return KILN_OK;
    kiln_status s = KILN_OK;
    int made = 0;
    for (; made < c->n_in && s == KILN_OK; made++) {
        in[made] = c->in[made];
        if (casts(in[made], p, want))
            s = cast_as_stored(c->in[made], want, &in[made]);
        else
            kiln_tensor_retain(in[made]);
        if (s != KILN_OK) in[made] = NULL;
    }
    if (s == KILN_OK) s = kiln__dispatch(c->op, in, c->n_in, c->a, c->out);
    for (int i = 0; i < made; i++) kiln_tensor_free(in[i]);
    *done = s == KILN_OK;
    return s;
}

static const kiln__interceptor autocast = {.name = "autocast", .order = 0, .rewrite = rewrite};

kiln_status kiln_autocast_begin(kiln_dtype dt)
{
    if (dt != KILN_DTYPE_BF16 && dt != KILN_DTYPE_F16 && dt != KILN_DTYPE_F32)
        return kiln__err(KILN_ERR_DTYPE, "autocast_begin: dtype %s: autocast runs in bf16, f16 or f32",
                         kiln_dtype_name(dt));
    if (regions.n == MAX_DEPTH)
        return kiln__err(KILN_ERR_UNSUPPORTED, "autocast_begin: regions nest at most %d deep", MAX_DEPTH);
    if (regions.n == 0) {
        kiln_status s = kiln__intercept_push(&autocast);
        if (s != KILN_OK) return s;
    }
    regions.dt[regions.n++] = dt;
    return KILN_OK;
}

kiln_status kiln_autocast_end(void)
{
    if (regions.n == 0) return kiln__err(KILN_ERR_ARG, "autocast_end: no autocast region is open on this thread");
    if (--regions.n == 0) kiln__intercept_pop(&autocast);
    return KILN_OK;
}

kiln_dtype kiln_autocast_dtype(void)
{
    return regions.n && !regions.paused ? regions.dt[regions.n - 1] : KILN_DTYPE_F32;
}

bool kiln__autocast_pause(void)
{
    bool was = regions.paused;
    regions.paused = true;
    return was;
}

void kiln__autocast_resume(bool was) { regions.paused = was; }
