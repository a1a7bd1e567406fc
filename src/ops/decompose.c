/* Decompositions: composite ops written with primitive ones, for the compiler, which
 * fuses the primitives (src/compile/). Each gives the op's outputs (hidden ones too, with
 * the shapes inference gives them) as new references in out[]; an in-place op ends
 * with the copy_ of each new value into the tensor it updates. Called in capture mode
 * by kiln_graph_decompose, so the kiln ops below are recorded, not run.
 *
 * Which are used (kiln__decomposition): softmax, log_softmax and the norms always;
 * adamw_ on the cpu. cross_entropy and attention, which every backend here has as one
 * fused kernel that beats their primitives, only where the tensors' backend has no
 * kernel of its own for them (a new device that has the primitives), or when asked for
 * every decomposition (KILN_COMPILE_DECOMPOSE=all); gelu, which every code generator
 * emits as one expression, only when asked, and in its tanh form (there is no erf
 * primitive). The backward ops stay fused kernels: a decomposed forward gives them the
 * hidden outputs they read (lse). */
#include <math.h>
#include <string.h>
#include "core/backend.h"
#include "core/dtype.h"
#include "core/tensor_impl.h"
#include "kiln/ops.h"
#include "ops/registry.h"

static kiln_status give(kiln_tensor_t **out, int n, kiln_tensor_t *const *res)
{
    for (int j = 0; j < n; j++)
        if (!res[j]) return kiln_last_status();
    for (int j = 0; j < n; j++) out[j] = kiln_tensor_retain(res[j]);
    return KILN_OK;
}

/* Along dim, with the max kept: softmax e / s, log_softmax (x - max) - log(s), where
 * e = exp(x - max) and s = sum(e). */
static kiln_status softmaxes(kiln_tensor_t *const *in, const kiln__attrs *a, kiln_tensor_t **out, bool log)
{
    int dim = kiln__norm_dim((int)a->op.dim.dim, in[0]->ndim);
    kiln_tensor_t *shifted = kiln_sub(in[0], kiln_max(in[0], &dim, 1, true));
    kiln_tensor_t *e = kiln_exp(shifted), *s = kiln_sum(e, &dim, 1, true);
    kiln_tensor_t *y = log ? kiln_sub(shifted, kiln_log(s)) : kiln_div(e, s);
    return give(out, 1, &y);
}

static kiln_status dec_softmax(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    return softmaxes(in, a, out, false);
}

static kiln_status dec_log_softmax(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    return softmaxes(in, a, out, true);
}

/* The statistics of the norms have the input's shape without its last dim. */
static kiln_tensor_t *drop_last(kiln_tensor_t *t)
{
    if (!t) return NULL;
    int nd = kiln_tensor_ndim(t);
    return kiln_view(t, kiln_tensor_shape(t), nd - 1);
}

/* layer_norm(x, w, b) along the last dim: y = (x - mean) * rstd * w + b, with the
 * biased variance; also mean and rstd, which backward reads. */
static kiln_status dec_layer_norm(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    kiln_tensor_t *x = in[0];
    int d = kiln_tensor_ndim(x) - 1;
    kiln_dtype dt = kiln_tensor_dtype(x);
    kiln_tensor_t *inv_c = kiln_scalar(1.0 / (double)kiln_tensor_shape(x)[d], dt);
    kiln_tensor_t *mean = kiln_mul(kiln_sum(x, &d, 1, true), inv_c);
    kiln_tensor_t *xc = kiln_sub(x, mean);
    kiln_tensor_t *var = kiln_mul(kiln_sum(kiln_mul(xc, xc), &d, 1, true), inv_c);
    kiln_tensor_t *rstd = kiln_rsqrt(kiln_add(var, kiln_scalar(a->op.norm.eps, dt)));
    kiln_tensor_t *res[3] = {kiln_add(kiln_mul(kiln_mul(xc, rstd), in[1]), in[2]), drop_last(mean), drop_last(rstd)};
    return give(out, 3, res);
}

/* rms_norm(x, w): y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps). */
static kiln_status dec_rms_norm(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    kiln_tensor_t *x = in[0];
    int d = kiln_tensor_ndim(x) - 1;
    kiln_dtype dt = kiln_tensor_dtype(x);
    kiln_tensor_t *ms = kiln_mul(kiln_sum(kiln_mul(x, x), &d, 1, true), kiln_scalar(1.0 / (double)kiln_tensor_shape(x)[d], dt));
    kiln_tensor_t *rstd = kiln_rsqrt(kiln_add(ms, kiln_scalar(a->op.norm.eps, dt)));
    kiln_tensor_t *res[2] = {kiln_mul(kiln_mul(x, rstd), in[1]), drop_last(rstd)};
    return give(out, 2, res);
}

/* A one-element tensor (an AdamW scalar) as a 0-dim one of dtype dt, so that it
 * broadcasts against any shape. */
static kiln_tensor_t *scalar_of(kiln_tensor_t *t, kiln_dtype dt)
{
    return kiln_cast(kiln_view(t, NULL, 0), dt);
}

/* adamw_(p, g, m, v, lr, step, gscale): the cpu backend's update (adam_range in
 * src/backends/cpu/cpu_pointwise.c) op for op, in the same f32 order and with the bias
 * corrections 1 - beta^t in f64 then rounded, so that compiled and eager agree to
 * rounding:
 *   g' = g * gscale; m' = b1 m + (1 - b1) g'; v' = b2 v + (1 - b2) g' g'
 *   p' = p (1 - lr wd) - lr (m' / c1) / (sqrt(v' / c2) + eps)
 * then m, v and p take m', v' and p' (copy_; the fused kernel stores them in place).
 * The step count goes through check_min, so a step < 1 is the same error as eagerly
 * instead of weights divided by zero. A gscale that is not finite skips the update as
 * the kernel does: m, v and p take their own values again, and the check reads 1 in
 * place of the step count. The scalars are shared by every parameter's update once CSE
 * has run. */
static kiln_status dec_adamw(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    double b1 = a->op.adamw.beta1, b2 = a->op.adamw.beta2, eps = a->op.adamw.eps;
    const kiln_dtype F = KILN_DTYPE_F32, D = KILN_DTYPE_F64;
    float b1f = (float)b1, b2f = (float)b2;
    kiln_tensor_t *p = in[0], *g = in[1], *m = in[2], *v = in[3];
    kiln_tensor_t *lr = scalar_of(in[4], F), *gs0 = kiln_view(in[6], NULL, 0), *step = kiln_view(in[5], NULL, 0);
    kiln_tensor_t *gscale = kiln_cast(gs0, F);
    kiln_tensor_t *taken = gs0 ? kiln_lt(kiln_abs(gs0), kiln_scalar(INFINITY, gs0->dtype)) : NULL;
    step = step ? kiln_where(taken, step, kiln_scalar(1, step->dtype)) : NULL;
    kiln__attrs ca = {0};
    ca.op.check = (kiln__check_attrs){.min = 1, .what = KILN__CHECK_ADAMW_STEP};
    kiln_tensor_t *t = step ? kiln__call(KILN_OP_CHECK_MIN, &step, 1, &ca) : NULL;
    t = kiln_cast(t, D);
    kiln_tensor_t *one = kiln_scalar(1, D);
    kiln_tensor_t *c1 = kiln_cast(kiln_sub(one, kiln_pow(kiln_scalar(b1, D), t)), F);
    kiln_tensor_t *c2 = kiln_cast(kiln_sub(one, kiln_pow(kiln_scalar(b2, D), t)), F);
    kiln_tensor_t *decay = kiln_sub(kiln_scalar(1, F), kiln_mul(lr, kiln_scalar((float)a->op.adamw.weight_decay, F)));
    kiln_tensor_t *gs = kiln_mul(g, gscale);
    kiln_tensor_t *m1 = kiln_add(kiln_mul(kiln_scalar(b1f, F), m), kiln_mul(kiln_scalar(1.0f - b1f, F), gs));
    kiln_tensor_t *v1 = kiln_add(kiln_mul(kiln_scalar(b2f, F), v), kiln_mul(kiln_mul(kiln_scalar(1.0f - b2f, F), gs), gs));
    kiln_tensor_t *den = kiln_add(kiln_sqrt(kiln_div(v1, c2)), kiln_scalar((float)eps, F));
    kiln_tensor_t *p1 = kiln_sub(kiln_mul(p, decay), kiln_div(kiln_mul(lr, kiln_div(m1, c1)), den));
    m1 = kiln_where(taken, m1, m);
    v1 = kiln_where(taken, v1, v);
    p1 = kiln_where(taken, p1, p);
    if (!p1 || !m1 || !v1) return kiln_last_status();
    kiln_status s = kiln_tensor_copy_(m, m1);
    if (s == KILN_OK) s = kiln_tensor_copy_(v, v1);
    return s == KILN_OK ? kiln_tensor_copy_(p, p1) : s;
}

/* cross_entropy(logits (N,V), targets (N)) with ignore_index: per row lse = max +
 * log(sum(exp(x - max))), the mean over the rows that count of lse - x[target] (NaN
 * when none does, as the kernel gives), and lse, which backward reads. A target outside
 * [0, V) that is not ignore_index is the same kind of error as eagerly: the index goes
 * through two check_min before the gather reads it. */
static kiln_status dec_cross_entropy(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    kiln_tensor_t *x = in[0], *t = in[1];
    kiln_dtype F = x->dtype, I = t->dtype;
    int64_t N = x->shape[0], V = x->shape[1], col[2] = {N, 1};
    int dim = 1;
    kiln_tensor_t *m = kiln_max(x, &dim, 1, true);
    kiln_tensor_t *lse = kiln_add(m, kiln_log(kiln_sum(kiln_exp(kiln_sub(x, m)), &dim, 1, true))); /* (N, 1) */
    kiln_tensor_t *valid = kiln_ne(t, kiln_scalar((double)a->op.cross_entropy.ignore_index, I));
    kiln_tensor_t *idx = kiln_where(valid, t, kiln_scalar(0, I)), *top = kiln_scalar((double)(V - 1), I);
    kiln__attrs ca = {0};
    ca.op.check.what = KILN__CHECK_CE_TARGET;
    ca.op.check.classes = V;
    idx = idx ? kiln__call(KILN_OP_CHECK_MIN, &idx, 1, &ca) : NULL; /* >= 0 */
    kiln_tensor_t *rev = kiln_sub(top, idx);
    rev = rev ? kiln__call(KILN_OP_CHECK_MIN, &rev, 1, &ca) : NULL; /* <= V - 1 */
    idx = kiln_reshape(kiln_sub(top, rev), col, 2);
    kiln_tensor_t *picked = kiln_gather(x, 1, idx);
    kiln_tensor_t *vcol = kiln_reshape(valid, col, 2);
    kiln_tensor_t *per = kiln_where(vcol, kiln_sub(lse, picked), kiln_scalar(0, F));
    kiln_tensor_t *count = kiln_sum(kiln_cast(valid, F), NULL, 0, false);
    kiln_tensor_t *res[2] = {kiln_div(kiln_sum(per, NULL, 0, false), count), kiln_reshape(lse, &N, 1)};
    return give(out, 2, res);
}

/* attention(q (B,H,Tq,D), k, v (B,Hkv,Tk,D)): query head h reads kv head h / (H / Hkv);
 * s = q k^T * scale, masked causally to keys j <= i + Tk - Tq, p = softmax(s), o = p v,
 * and lse = max + log(sum(exp(s - max))) (B,H,Tq), which backward reads. */
static kiln_tensor_t *kv_heads(kiln_tensor_t *k, int64_t H)
{
    int64_t B = k->shape[0], Hkv = k->shape[1], T = k->shape[2], D = k->shape[3];
    if (Hkv == H) return k;
    int64_t one[5] = {B, Hkv, 1, T, D}, all[5] = {B, Hkv, H / Hkv, T, D}, heads[4] = {B, H, T, D};
    return kiln_reshape(kiln_contiguous(kiln_expand(kiln_reshape(k, one, 5), all, 5)), heads, 4);
}

static kiln_status dec_attention(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    kiln_tensor_t *q = in[0];
    kiln_dtype F = q->dtype;
    int64_t H = q->shape[1], Tq = q->shape[2], Tk = in[1]->shape[2];
    kiln_tensor_t *k = kv_heads(in[1], H), *v = kv_heads(in[2], H);
    kiln_tensor_t *s = kiln_mul(kiln_matmul(q, kiln_transpose(k, 2, 3)), kiln_scalar(a->op.attention.scale, F));
    if (a->op.attention.causal) {
        int64_t rows[2] = {Tq, 1}, cols[2] = {1, Tk};
        kiln_tensor_t *i = kiln_reshape(kiln_arange((double)(Tk - Tq), (double)Tk, 1, KILN_DTYPE_I64), rows, 2);
        kiln_tensor_t *j = kiln_reshape(kiln_arange(0, (double)Tk, 1, KILN_DTYPE_I64), cols, 2);
        s = kiln_where(kiln_le(j, i), s, kiln_scalar(-INFINITY, F));
    }
    int dim = 3;
    kiln_tensor_t *m = kiln_max(s, &dim, 1, true), *e = kiln_exp(kiln_sub(s, m)), *l = kiln_sum(e, &dim, 1, true);
    kiln_tensor_t *res[2] = {kiln_matmul(kiln_div(e, l), v), drop_last(kiln_add(m, kiln_log(l)))};
    return give(out, 2, res);
}

/* gelu, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
static kiln_status dec_gelu_tanh(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    kiln_tensor_t *x = in[0];
    kiln_dtype F = x->dtype;
    kiln_tensor_t *x3 = kiln_mul(kiln_mul(x, x), x);
    kiln_tensor_t *u = kiln_mul(kiln_scalar(0.7978845608028654, F), kiln_add(x, kiln_mul(kiln_scalar(0.044715, F), x3)));
    kiln_tensor_t *y = kiln_mul(kiln_mul(kiln_scalar(0.5, F), x), kiln_add(kiln_scalar(1, F), kiln_tanh(u)));
    return give(out, 1, &y);
}

/* Whether the tensors' backend runs op with a kernel of its own (else dispatch would
 * copy to the cpu for it). */
static bool has_kernel(const kiln_tensor_t *t, kiln__op_id op)
{
    return t->st->be && kiln__be_has_kernel(t->st->be, op);
}

/* When each decomposition is taken (all: KILN_COMPILE_DECOMPOSE=all). */
static bool adamw_when(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, bool all)
{
    /* Only on the cpu, where the primitives and their copy_ stores become one generated
     * kernel. A device already has the update as one hand-written kernel (and a CUDA
     * graph is interpreted, where one kernel beats fifteen launches), so there adamw_
     * stays whole. */
    return n_in == 7 && in[0]->st->be == kiln__backend_at(0);
}

static bool cross_entropy_when(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, bool all)
{
    return n_in == 2 && in[0]->shape[1] > 0 && (all || !has_kernel(in[0], KILN_OP_CROSS_ENTROPY));
}

static bool attention_when(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, bool all)
{
    /* no keys: the kernel's lse of -inf, left to it */
    return n_in == 3 && in[1]->shape[2] > 0 && (all || !has_kernel(in[0], KILN_OP_ATTENTION));
}

static bool gelu_when(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, bool all)
{
    return all && a->op.gelu.tanh;
}

/* The ops room's decomposition column of the op table: the ops that have one, and when
 * it is taken (NULL: always; the others are primitives to the compiler). */
static const struct {
    kiln__decompose_fn fn;
    bool (*when)(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, bool all);
} decompositions[KILN_OP_COUNT] = {
    [KILN_OP_ADAMW_] = {dec_adamw, adamw_when},
    [KILN_OP_SOFTMAX] = {dec_softmax},
    [KILN_OP_LOG_SOFTMAX] = {dec_log_softmax},
    [KILN_OP_LAYER_NORM] = {dec_layer_norm},
    [KILN_OP_RMS_NORM] = {dec_rms_norm},
    [KILN_OP_CROSS_ENTROPY] = {dec_cross_entropy, cross_entropy_when},
    [KILN_OP_ATTENTION] = {dec_attention, attention_when},
    [KILN_OP_GELU] = {dec_gelu_tanh, gelu_when},
};

/* The composites the cpu computes in f32 for f16 and bf16 inputs (cpu_widened) are
 * decomposed the same way: the inputs cast to f32, the f32 decomposition, the visible
 * output cast back (the statistics are f32 already), so that a device or a compiled
 * graph rounds where eager does, once, not after every primitive. */
static kiln_status widened(kiln__decompose_fn fn, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                           kiln_tensor_t **out)
{
    kiln_tensor_t *w[8];
    kiln_dtype half = KILN_DTYPE_F32;
    for (int i = 0; i < n_in; i++) {
        w[i] = kiln__is_half(in[i]->dtype) ? kiln_cast(in[i], KILN_DTYPE_F32) : in[i];
        if (kiln__is_half(in[i]->dtype) && half == KILN_DTYPE_F32) half = in[i]->dtype;
        if (!w[i]) return kiln_last_status();
    }
    kiln_status s = fn(w, n_in, a, out);
    if (s != KILN_OK) return s;
    kiln_tensor_t *y = kiln_cast(out[0], half);
    kiln_tensor_free(out[0]);
    out[0] = y ? kiln_tensor_retain(y) : NULL;
    return y ? KILN_OK : kiln_last_status();
}

#define WIDENED_DEC(name)                                                                                \
    static kiln_status dec_##name##_widened(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,   \
                                            kiln_tensor_t **out)                                         \
    {                                                                                                    \
        return widened(dec_##name, in, n_in, a, out);                                                    \
    }
WIDENED_DEC(softmax)
WIDENED_DEC(log_softmax)
WIDENED_DEC(layer_norm)
WIDENED_DEC(rms_norm)
WIDENED_DEC(cross_entropy)
WIDENED_DEC(attention)

static const kiln__decompose_fn widened_fns[KILN_OP_COUNT] = {
    [KILN_OP_SOFTMAX] = dec_softmax_widened,         [KILN_OP_LOG_SOFTMAX] = dec_log_softmax_widened,
    [KILN_OP_LAYER_NORM] = dec_layer_norm_widened,   [KILN_OP_RMS_NORM] = dec_rms_norm_widened,
    [KILN_OP_CROSS_ENTROPY] = dec_cross_entropy_widened, [KILN_OP_ATTENTION] = dec_attention_widened,
};

kiln__decompose_fn kiln__decomposition(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                       bool all)
{
    if (kiln__op_is_custom(op)) return kiln__custom_decomposition(op, in, n_in, all);
    bool taken = decompositions[op].fn && (!decompositions[op].when || decompositions[op].when(in, n_in, a, all));
    if (!taken) return NULL;
    bool half = false;
    for (int i = 0; i < n_in && i < 8; i++) half |= kiln__is_half(in[i]->dtype);
    return half && widened_fns[op] ? widened_fns[op] : decompositions[op].fn;
}
