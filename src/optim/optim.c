/* AdamW and SGD over a list of parameters, gradient clipping, LR schedules. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/optim.h"

typedef enum { OPT_ADAMW, OPT_SGD } opt_kind;

struct kiln_optim {
    opt_kind kind;
    int n;
    kiln_tensor_t **params; /* borrowed */
    bool *decay;
    kiln_tensor_t **slot[2]; /* AdamW m, v; SGD momentum in slot 0 */
    double beta1, beta2, eps, wd, momentum;
    int64_t steps;
};

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
    if (!o || !o->params || !o->decay || !o->slot[0] || !o->slot[1]) {
        kiln_optim_free(o);
        return kiln_error(KILN_ERR_OOM, "optimizer: out of memory");
    }
    o->kind = kind;
    o->n = n;
    for (int i = 0; i < n; i++) {
        o->params[i] = params[i];
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
    free(o->params);
    free(o->decay);
    free(o);
}

static kiln_tensor_t *zeros_like(kiln_tensor_t *p)
{
    kiln_scope_begin();
    kiln_tensor_t *z = kiln_keep(kiln_zeros(kiln_tensor_shape(p), kiln_tensor_ndim(p), KILN_DTYPE_F32));
    kiln_scope_end();
    return z;
}

kiln_status kiln_optim_step(kiln_optim_t *o, double lr)
{
    if (!o) return kiln_error(KILN_ERR_ARG, "optim_step: optimizer is NULL");
    bool prev = kiln_set_grad_enabled(false);
    kiln_status s = KILN_OK;
    int64_t t = o->steps + 1;
    for (int i = 0; s == KILN_OK && i < o->n; i++) {
        kiln_tensor_t *p = o->params[i], *g = kiln_tensor_grad(p);
        if (!g) continue;
        int nslots = o->kind == OPT_ADAMW ? 2 : (o->momentum > 0 ? 1 : 0);
        for (int k = 0; k < nslots; k++)
            if (!o->slot[k][i] && !(o->slot[k][i] = zeros_like(p))) s = kiln_last_status();
        if (s != KILN_OK) break;
        double wd = o->decay[i] ? o->wd : 0.0;
        if (o->kind == OPT_ADAMW) {
            s = kiln_adamw_(p, g, o->slot[0][i], o->slot[1][i], lr, o->beta1, o->beta2, o->eps, wd, t);
        } else {
            if (wd > 0) s = kiln_add_(g, p, wd); /* L2: g += wd * p */
            if (s == KILN_OK && o->momentum > 0) {
                s = kiln_mul_scalar_(o->slot[0][i], o->momentum);
                if (s == KILN_OK) s = kiln_add_(o->slot[0][i], g, 1.0);
                g = o->slot[0][i];
            }
            if (s == KILN_OK) s = kiln_add_(p, g, -lr);
        }
    }
    kiln_set_grad_enabled(prev);
    if (s == KILN_OK) o->steps = t;
    return s;
}

void kiln_optim_zero_grad(kiln_optim_t *o)
{
    for (int i = 0; o && i < o->n; i++) kiln_tensor_zero_grad(o->params[i]);
}

int64_t kiln_optim_steps(const kiln_optim_t *o) { return o ? o->steps : 0; }
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
    o->steps = steps;
    if (!value) return KILN_OK;
    kiln_tensor_t *p = o->params[i];
    if (kiln_tensor_ndim(value) != kiln_tensor_ndim(p) ||
        memcmp(kiln_tensor_shape(value), kiln_tensor_shape(p), sizeof(int64_t) * (size_t)kiln_tensor_ndim(p))) {
        char a[96], b[96];
        return kiln_error(KILN_ERR_SHAPE, "optimizer state %s for parameter %d does not match the parameter %s",
                          kiln_tensor_describe(value, a, sizeof a), i, kiln_tensor_describe(p, b, sizeof b));
    }
    if (!o->slot[slot][i] && !(o->slot[slot][i] = zeros_like(o->params[i]))) return kiln_last_status();
    return kiln_tensor_copy_(o->slot[slot][i], value);
}

kiln_status kiln_clip_grad_norm(kiln_tensor_t *const *params, int n, double max_norm, double *norm)
{
    bool prev = kiln_set_grad_enabled(false);
    double total = 0;
    kiln_status s = KILN_OK;
    kiln_scope_begin();
    for (int i = 0; s == KILN_OK && i < n; i++) {
        kiln_tensor_t *g = kiln_tensor_grad(params[i]);
        if (!g) continue;
        double v;
        s = kiln_tensor_item(kiln_sum(kiln_mul(g, g), NULL, 0, false), &v);
        total += v;
    }
    kiln_scope_end();
    double nrm = sqrt(total);
    if (norm) *norm = nrm;
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
