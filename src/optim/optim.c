/* AdamW and SGD over a list of parameters, gradient clipping, LR schedules. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/util.h"
#include "kiln/optim.h"
#include "kiln/graph.h"

typedef enum { OPT_ADAMW, OPT_SGD } opt_kind;

struct kiln_optim {
    opt_kind kind;
    int n;
    kiln_tensor_t **params; /* borrowed */
    bool *decay;
    kiln_tensor_t **slot[2]; /* AdamW m, v; SGD momentum in slot 0 */
    double beta1, beta2, eps, wd, momentum;
    /* One-element tensors, so that a captured step reads and advances them on every run:
     * the step count (f64), 1 (f64, its increment), 1 (f32, the gradient scale when none
     * is given) and the learning rate kiln_optim_step was given (f64). */
    kiln_tensor_t *step, *one, *unit, *lr;
};

/* Optimizer state, kept: a real tensor of v on like's device even while a step is being
 * captured; one element of dt, or (as_like) zeros shaped like like. */
static kiln_tensor_t *state_new(const kiln_tensor_t *like, double v, kiln_dtype dt, bool as_like)
{
    void *cap = kiln_graph_suspend();
    kiln_scope_begin();
    int64_t one = 1;
    kiln_tensor_t *t = kiln_keep(as_like ? kiln_full_like(like, 0, KILN_DTYPE_F32)
                                         : kiln_tensor_to(kiln_full(&one, 1, v, dt), kiln_tensor_device(like)));
    kiln_scope_end();
    kiln_graph_resume(cap);
    return t;
}


static kiln_status opt_new(opt_kind kind, kiln_tensor_t *const *params, int n, const bool *decay, kiln_optim_t **out)
{
    if (!params || n < 1 || !out) return kiln_error(KILN_ERR_ARG, "optimizer: no parameters given");
    for (int i = 0; i < n; i++)
        if (!params[i] || kiln_tensor_dtype(params[i]) != KILN_DTYPE_F32)
            return kiln_error(KILN_ERR_ARG, "optimizer: parameter %d is NULL or not f32", i);
    kiln_optim_t *o = calloc(1, sizeof *o);
    if (o) {
        o->params = malloc(sizeof *o->params * (size_t)n);
        o->decay = malloc(sizeof *o->decay * (size_t)n);
        o->slot[0] = calloc((size_t)n, sizeof(kiln_tensor_t *));
        o->slot[1] = calloc((size_t)n, sizeof(kiln_tensor_t *));
    }
    if (o) {
        o->step = state_new(params[0], 0, KILN_DTYPE_F64, false);
        o->one = state_new(params[0], 1, KILN_DTYPE_F64, false);
        o->unit = state_new(params[0], 1, KILN_DTYPE_F32, false);
        o->lr = state_new(params[0], 0, KILN_DTYPE_F64, false);
    }
    if (!o || !o->params || !o->decay || !o->slot[0] || !o->slot[1] || !o->step || !o->one || !o->unit || !o->lr) {
        kiln_optim_free(o);
        return kiln_error(KILN_ERR_OOM, "optimizer: out of memory");
    }
    o->kind = kind;
    o->n = n;
    for (int i = 0; i < n; i++) {
        o->params[i] = kiln_tensor_retain(params[i]); /* held: a parameter the model drops stays valid */
        o->decay[i] = decay ? decay[i] : kiln_tensor_ndim(params[i]) >= 2;
    }
    *out = o;
    return KILN_OK;
}

kiln_status kiln_adamw_new(kiln_tensor_t *const *params, int n, const bool *decay, double beta1, double beta2,
                           double eps, double weight_decay, kiln_optim_t **out)
{
    if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1 && eps > 0 && weight_decay >= 0))
        return kiln_error(KILN_ERR_ARG, "adamw: betas must be in [0,1), eps > 0, weight decay >= 0 (got %g, %g, %g, %g)",
                          beta1, beta2, eps, weight_decay);
    kiln_status s = opt_new(OPT_ADAMW, params, n, decay, out);
    if (s != KILN_OK) return s;
    (*out)->beta1 = beta1;
    (*out)->beta2 = beta2;
    (*out)->eps = eps;
    (*out)->wd = weight_decay;
    return KILN_OK;
}

kiln_status kiln_sgd_new(kiln_tensor_t *const *params, int n, const bool *decay, double momentum, double weight_decay,
                         kiln_optim_t **out)
{
    if (!(momentum >= 0 && momentum < 1 && weight_decay >= 0))
        return kiln_error(KILN_ERR_ARG, "sgd: momentum must be in [0,1) and weight decay >= 0");
    kiln_status s = opt_new(OPT_SGD, params, n, decay, out);
    if (s != KILN_OK) return s;
    (*out)->momentum = momentum;
    (*out)->wd = weight_decay;
    return KILN_OK;
}

void kiln_optim_free(kiln_optim_t *o)
{
    if (!o) return;
    for (int k = 0; k < 2; k++) {
        for (int i = 0; o->slot[k] && i < o->n; i++) kiln_tensor_free(o->slot[k][i]);
        free(o->slot[k]);
    }
    kiln_tensor_free(o->step);
    kiln_tensor_free(o->one);
    kiln_tensor_free(o->unit);
    kiln_tensor_free(o->lr);
    for (int i = 0; o->params && i < o->n; i++) kiln_tensor_free(o->params[i]);
    KILN__FREE(o->params, o->decay, o);
}

static kiln_status check_one_element(const char *what, const kiln_tensor_t *t)
{
    kiln_dtype dt = kiln_tensor_dtype(t);
    if (kiln_tensor_numel(t) != 1 || (dt != KILN_DTYPE_F32 && dt != KILN_DTYPE_F64)) {
        char b[96];
        return kiln_error(KILN_ERR_SHAPE, "%s %s must be a one-element f32 or f64 tensor", what,
                          kiln_tensor_describe(t, b, sizeof b));
    }
    return KILN_OK;
}

/* Whether a one-element gscale is finite (a bool scalar): an update at one that is not
 * is skipped (kiln_optim_step_t). */
static kiln_tensor_t *finite_of(kiln_tensor_t *gscale)
{
    kiln_tensor_t *x = kiln_view(gscale, NULL, 0);
    return x ? kiln_lt(kiln_abs(x), kiln_scalar(INFINITY, kiln_tensor_dtype(x))) : NULL;
}

/* The slots parameter i needs, made if missing. */
static kiln_status ensure_slots(kiln_optim_t *o, int i)
{
    int nslots = o->kind == OPT_ADAMW ? 2 : (o->momentum > 0 ? 1 : 0);
    for (int k = 0; k < nslots; k++)
        if (!o->slot[k][i] && !(o->slot[k][i] = state_new(o->params[i], 0, KILN_DTYPE_F32, true)))
            return kiln_last_status();
    return KILN_OK;
}

kiln_status kiln_optim_step_t(kiln_optim_t *o, kiln_tensor_t *lr, kiln_tensor_t *gscale)
{
    if (!o || !lr) return kiln_error(KILN_ERR_ARG, "optim_step_t: optimizer or learning rate is NULL");
    if (kiln_graph_capturing() == false && strcmp(kiln_tensor_device(lr), kiln_tensor_device(o->step))) {
        kiln_scope_begin(); /* a learning rate made on another device than the parameters': moved */
        kiln_tensor_t *moved = kiln_tensor_to(lr, kiln_tensor_device(o->step));
        kiln_status s = moved ? kiln_optim_step_t(o, moved, gscale) : kiln_last_status();
        kiln_scope_end();
        return s;
    }
    kiln_status s = check_one_element("optim_step_t: lr", lr);
    if (s == KILN_OK && gscale) s = check_one_element("optim_step_t: gscale", gscale);
    if (s != KILN_OK) return s;
    bool prev = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    /* A skipped step is not counted: the count goes up by 1 or 0 (AdamW's update does
     * not read it when it skips). */
    kiln_tensor_t *taken = gscale ? finite_of(gscale) : NULL;
    kiln_tensor_t *inc = taken ? kiln_cast(taken, KILN_DTYPE_F64) : o->one;
    s = inc ? kiln_add_(o->step, inc, 1.0) : kiln_last_status();
    kiln_tensor_t *lr32 = o->kind == OPT_SGD ? kiln_cast(lr, KILN_DTYPE_F32) : NULL;
    kiln_tensor_t *gs32 = o->kind == OPT_SGD && gscale ? kiln_cast(gscale, KILN_DTYPE_F32) : NULL;
    if (s == KILN_OK && o->kind == OPT_SGD && (!lr32 || (gscale && !gs32))) s = kiln_last_status();
    for (int i = 0; s == KILN_OK && i < o->n; i++) {
        kiln_tensor_t *p = o->params[i], *g = kiln_tensor_grad(p);
        if (!g) continue;
        if ((s = ensure_slots(o, i)) != KILN_OK) break;
        double wd = o->decay[i] ? o->wd : 0.0;
        if (o->kind == OPT_ADAMW) {
            /* Inside a graph the gradient may still be the transposed view backward made
             * (eager copies it into the leaf). */
            if (!(g = kiln_contiguous(g))) {
                s = kiln_last_status();
                break;
            }
            s = kiln_adamw_step_(p, g, o->slot[0][i], o->slot[1][i], lr, o->step, gscale ? gscale : o->unit, o->beta1,
                                 o->beta2, o->eps, wd);
            continue;
        }
        /* SGD out of place, the gradient left as it is: d = gscale*g + wd*p; with
         * momentum buf = momentum*buf + d, d = buf; p -= lr*d (each kept as it was on
         * a skipped step). */
        kiln_tensor_t *d = gs32 ? kiln_mul(g, gs32) : g, *buf = o->slot[0][i];
        if (d && wd > 0) d = kiln_add(d, kiln_mul_scalar(p, wd));
        if (d && o->momentum > 0) {
            d = kiln_add(kiln_mul_scalar(buf, o->momentum), d);
            s = d ? kiln_tensor_copy_(buf, taken ? kiln_where(taken, d, buf) : d) : kiln_last_status();
        }
        kiln_tensor_t *p1 = d ? kiln_sub(p, kiln_mul(d, lr32)) : NULL;
        if (s == KILN_OK) s = p1 ? kiln_tensor_copy_(p, taken ? kiln_where(taken, p1, p) : p1) : kiln_last_status();
    }
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    return s;
}

kiln_status kiln_optim_step(kiln_optim_t *o, double lr)
{
    if (!o) return kiln_error(KILN_ERR_ARG, "optim_step: optimizer is NULL");
    if (kiln_graph_capturing() || kiln_replay_recording())
        return kiln_error(KILN_ERR_UNSUPPORTED, "optim_step during graph capture or replay recording: a learning rate "
                          "given as a number would be frozen; give it as a tensor with kiln_optim_step_t");
    if (o->kind == OPT_ADAMW) {
        kiln_status s = kiln_fill_(o->lr, lr);
        return s == KILN_OK ? kiln_optim_step_t(o, o->lr, NULL) : s;
    }
    /* SGD at a number: in place as it always was (g += wd*p; p -= lr*g). */
    bool prev = kiln_set_grad_enabled(false);
    kiln_status s = kiln_add_(o->step, o->one, 1.0);
    for (int i = 0; s == KILN_OK && i < o->n; i++) {
        kiln_tensor_t *p = o->params[i], *g = kiln_tensor_grad(p);
        if (!g) continue;
        if ((s = ensure_slots(o, i)) != KILN_OK) break;
        double wd = o->decay[i] ? o->wd : 0.0;
        if (wd > 0) s = kiln_add_(g, p, wd); /* L2: g += wd * p */
        if (s == KILN_OK && o->momentum > 0) {
            s = kiln_mul_scalar_(o->slot[0][i], o->momentum);
            if (s == KILN_OK) s = kiln_add_(o->slot[0][i], g, 1.0);
            g = o->slot[0][i];
        }
        if (s == KILN_OK) s = kiln_add_(p, g, -lr);
    }
    kiln_set_grad_enabled(prev);
    return s;
}

void kiln_optim_zero_grad(kiln_optim_t *o)
{
    for (int i = 0; o && i < o->n; i++) kiln_tensor_zero_grad(o->params[i]);
}

int64_t kiln_optim_steps(const kiln_optim_t *o)
{
    double v = 0;
    if (!o || kiln_graph_capturing() || kiln_tensor_item(o->step, &v) != KILN_OK) return 0;
    return (int64_t)v;
}
int kiln_optim_num_slots(const kiln_optim_t *o) { return !o ? 0 : o->kind == OPT_ADAMW ? 2 : 1; }

kiln_tensor_t *kiln_optim_state(kiln_optim_t *o, int i, int slot)
{
    if (!o || i < 0 || i >= o->n || slot < 0 || slot >= kiln_optim_num_slots(o)) return NULL;
    return o->slot[slot][i];
}

kiln_status kiln_optim_set_state(kiln_optim_t *o, int64_t steps, int i, int slot, const kiln_tensor_t *value)
{
    if (!o || i < 0 || i >= o->n || slot < 0 || slot >= kiln_optim_num_slots(o) || steps < 0)
        return kiln_error(KILN_ERR_ARG, "optim_set_state: parameter %d slot %d is out of range", i, slot);
    kiln_status s = kiln_fill_(o->step, (double)steps);
    if (s != KILN_OK || !value) return s;
    kiln_tensor_t *p = o->params[i];
    if (kiln_tensor_ndim(value) != kiln_tensor_ndim(p) ||
        memcmp(kiln_tensor_shape(value), kiln_tensor_shape(p), sizeof(int64_t) * (size_t)kiln_tensor_ndim(p))) {
        char a[96], b[96];
        return kiln_error(KILN_ERR_SHAPE, "optimizer state %s for parameter %d does not match the parameter %s",
                          kiln_tensor_describe(value, a, sizeof a), i, kiln_tensor_describe(p, b, sizeof b));
    }
    if (!o->slot[slot][i] && !(o->slot[slot][i] = state_new(p, 0, KILN_DTYPE_F32, true))) return kiln_last_status();
    return kiln_tensor_copy_(o->slot[slot][i], value);
}

kiln_status kiln_grad_norm(kiln_tensor_t *const *params, int n, kiln_tensor_t **norm)
{
    if (!norm || (n > 0 && !params)) return kiln_error(KILN_ERR_ARG, "grad_norm: NULL parameters or result");
    *norm = NULL;
    bool prev = kiln_set_grad_enabled(false);
    kiln_tensor_t *total = NULL;
    bool failed = false;
    /* Each gradient's sum of squares in f32, the total over them in f64, in order (on
     * the gradients' device; 0 on the default one when none has a gradient). */
    for (int i = 0; !failed && i < n; i++) {
        kiln_tensor_t *g = params[i] ? kiln_tensor_grad(params[i]) : NULL;
        if (!g) continue;
        kiln_tensor_t *sq = kiln_cast(kiln_sum(kiln_mul(g, g), NULL, 0, false), KILN_DTYPE_F64);
        total = !sq || !total ? sq : kiln_add(total, sq);
        failed = !total;
    }
    if (!failed && !total) total = kiln_scalar(0, KILN_DTYPE_F64);
    kiln_set_grad_enabled(prev);
    if (!total || !(*norm = kiln_sqrt(total))) return kiln_last_status();
    return KILN_OK;
}

kiln_loss_scaler kiln_loss_scaler_default(void)
{
    return (kiln_loss_scaler){.scale = 65536.0, .growth = 2.0, .backoff = 0.5, .interval = 2000};
}

bool kiln_loss_scaler_update(kiln_loss_scaler *s, double norm)
{
    if (!s) return isfinite(norm);
    if (!isfinite(norm)) {
        s->scale *= s->backoff;
        s->good = 0;
        s->skipped++;
        return false;
    }
    if (++s->good >= s->interval) {
        s->scale *= s->growth;
        s->good = 0;
    }
    return true;
}

kiln_tensor_t *kiln_loss_scale_coef(kiln_tensor_t *norm, kiln_tensor_t *scale, double max_norm,
                                    kiln_tensor_t **unscaled)
{
    if (unscaled) *unscaled = NULL;
    if (!norm || !scale || !unscaled) return kiln_error(KILN_ERR_ARG, "loss_scale_coef: NULL norm, scale or result"), NULL;
    if (check_one_element("loss_scale_coef: the scale", scale) != KILN_OK) return NULL;
    bool prev = kiln_set_grad_enabled(false);
    kiln_tensor_t *inv = kiln_div(kiln_scalar(1, KILN_DTYPE_F64), kiln_cast(kiln_view(scale, NULL, 0), KILN_DTYPE_F64));
    kiln_tensor_t *un = kiln_mul(norm, inv);
    kiln_tensor_t *coef = kiln_mul(kiln_clip_coef(un, max_norm), kiln_cast(inv, KILN_DTYPE_F32));
    coef = kiln_where(finite_of(norm), coef, kiln_scalar(NAN, KILN_DTYPE_F32));
    kiln_set_grad_enabled(prev);
    if (!coef) return NULL;
    *unscaled = un;
    return coef;
}

kiln_tensor_t *kiln_clip_coef(kiln_tensor_t *norm, double max_norm)
{
    if (!norm) return NULL;
    if (!(max_norm > 0)) return kiln_scalar(1, KILN_DTYPE_F32);
    bool prev = kiln_set_grad_enabled(false);
    kiln_tensor_t *coef = kiln_div(kiln_full_like(norm, max_norm, KILN_DTYPE_F64), kiln_add_scalar(norm, 1e-6));
    coef = kiln_cast(kiln_minimum(coef, kiln_full_like(norm, 1, KILN_DTYPE_F64)), KILN_DTYPE_F32);
    kiln_set_grad_enabled(prev);
    return coef;
}

kiln_status kiln_clip_grad_norm(kiln_tensor_t *const *params, int n, double max_norm, double *norm)
{
    kiln_scope_begin();
    kiln_tensor_t *t;
    double nrm = 0;
    kiln_status s = kiln_grad_norm(params, n, &t);
    if (s == KILN_OK) s = kiln_tensor_item(t, &nrm);
    kiln_scope_end();
    if (norm) *norm = nrm;
    bool prev = kiln_set_grad_enabled(false);
    if (s == KILN_OK && max_norm > 0 && nrm > max_norm) {
        double scale = max_norm / (nrm + 1e-6);
        for (int i = 0; s == KILN_OK && i < n; i++) {
            kiln_tensor_t *g = kiln_tensor_grad(params[i]);
            if (g) s = kiln_mul_scalar_(g, scale);
        }
    }
    kiln_set_grad_enabled(prev);
    return s;
}

double kiln_lr_cosine(int64_t step, int64_t warmup, int64_t total, double lr_max, double lr_min)
{
    if (warmup > 0 && step < warmup) return lr_max * (double)(step + 1) / (double)warmup;
    if (step >= total || total <= warmup) return lr_min;
    double progress = (double)(step - warmup) / (double)(total - warmup);
    return lr_min + 0.5 * (lr_max - lr_min) * (1.0 + cos(M_PI * progress));
}
