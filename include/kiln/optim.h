/* kiln/optim.h — optimizers, gradient clipping and learning-rate schedules.
 *
 *     kiln_optim_t *opt;
 *     kiln_adamw_new(params, n, decay_mask, 0.9, 0.95, 1e-8, 0.1, &opt);
 *     ... kiln_backward(loss) ...
 *     double norm;
 *     kiln_clip_grad_norm(params, n, 1.0, &norm);
 *     kiln_optim_step(opt, kiln_lr_cosine(step, 100, 5000, 6e-4, 6e-5));
 *     kiln_optim_zero_grad(opt);
 *
 * Inside a function captured as a graph (kiln/graph.h), where nothing may read a value
 * or take a number that changes between steps, the same step is
 *     kiln_tensor_t *norm;
 *     kiln_grad_norm(params, n, &norm);
 *     kiln_optim_step_t(opt, lr_tensor, kiln_clip_coef(norm, 1.0));
 *     kiln_optim_zero_grad(opt);
 */
#ifndef KILN_OPTIM_H
#define KILN_OPTIM_H

#include "kiln/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_optim kiln_optim_t;

/* AdamW over n parameters (the optimizer holds a reference to each, so a parameter its
 * model drops stays valid until kiln_optim_free). decay[i] says
 * whether parameter i gets weight decay (NULL: those with 2 or more dims). */
kiln_status kiln_adamw_new(kiln_tensor_t *const *params, int n, const bool *decay, double beta1, double beta2,
                           double eps, double weight_decay, kiln_optim_t **out);
/* SGD with momentum (0 = plain) and L2 weight decay on the decayed parameters. */
kiln_status kiln_sgd_new(kiln_tensor_t *const *params, int n, const bool *decay, double momentum,
                         double weight_decay, kiln_optim_t **out);
void kiln_optim_free(kiln_optim_t *o);
/* One update at learning rate lr; parameters without a gradient are skipped. Not
 * inside a graph capture (lr would be frozen into it): use kiln_optim_step_t. */
kiln_status kiln_optim_step(kiln_optim_t *o, double lr);
/* The same with the learning rate in a one-element f32/f64 tensor, and each gradient
 * multiplied by gscale (one element, as lr; NULL: 1) on the way in — the clipping
 * coefficient of kiln_clip_coef, applied without touching the gradients. Everything
 * that changes from step to step (lr, gscale, the step count, which the optimizer keeps
 * in a tensor) is read when the update runs, so this works inside a captured training
 * step (kiln/graph.h) and every run of the graph takes a fresh step. A gscale that is
 * not finite (kiln_loss_scale_coef's, for gradients that overflowed) skips the step:
 * the parameters, the optimizer state and the step count stay as they are. */
kiln_status kiln_optim_step_t(kiln_optim_t *o, kiln_tensor_t *lr, kiln_tensor_t *gscale);
void kiln_optim_zero_grad(kiln_optim_t *o);
int64_t kiln_optim_steps(const kiln_optim_t *o);
/* State for checkpoints: per parameter i, slot k (AdamW: 0 = m, 1 = v; SGD: 0 =
 * momentum) — borrowed, NULL before the first step or when unused. */
int kiln_optim_num_slots(const kiln_optim_t *o);
kiln_tensor_t *kiln_optim_state(kiln_optim_t *o, int i, int slot);
/* Restores state: step count and each slot tensor (copied). */
kiln_status kiln_optim_set_state(kiln_optim_t *o, int64_t steps, int i, int slot, const kiln_tensor_t *value);

/* Scales all gradients so that their global L2 norm is at most max_norm (<= 0: no
 * clipping); *norm receives the norm before clipping. Reads the norm's value, so not
 * inside a graph capture: there use kiln_grad_norm, kiln_clip_coef, kiln_optim_step_t. */
kiln_status kiln_clip_grad_norm(kiln_tensor_t *const *params, int n, double max_norm, double *norm);
/* The global L2 norm of the parameters' gradients as an f64 scalar tensor (in the
 * caller's scope; 0 when none has a gradient). */
kiln_status kiln_grad_norm(kiln_tensor_t *const *params, int n, kiln_tensor_t **norm);
/* The clipping coefficient for a gradient norm: min(1, max_norm / (norm + 1e-6)) as an
 * f32 scalar tensor (1 when max_norm <= 0), for kiln_optim_step_t's gscale. */
kiln_tensor_t *kiln_clip_coef(kiln_tensor_t *norm, double max_norm);

/* Dynamic loss scaling for f16 mixed precision, as torch.amp.GradScaler does it: the
 * loss is multiplied by `scale` before backward so that small gradients survive f16's
 * range, and the update divides it out again. A step whose gradients hold an inf or a
 * NaN is skipped (no update, the optimizer state untouched) and the scale is multiplied
 * by `backoff`; after `interval` good steps in a row it is multiplied by `growth`.
 * kiln_loss_scaler_default() is GradScaler's default: 65536, x2 every 2000 good steps,
 * x0.5 on overflow. bf16 has f32's range and needs none. */
typedef struct kiln_loss_scaler {
    double scale, growth, backoff;
    int64_t interval;
    int64_t good;    /* good steps since the scale last changed */
    int64_t skipped; /* steps skipped in all */
} kiln_loss_scaler;
kiln_loss_scaler kiln_loss_scaler_default(void);
/* After a step's gradients were made from loss * s->scale and their global norm (of the
 * scaled gradients) is `norm`: true when the step is to be taken (norm finite); the
 * scale is updated either way. */
bool kiln_loss_scaler_update(kiln_loss_scaler *s, double norm);
/* The decision and the unscaling inside the step, with tensor ops only, so that a
 * loss-scaled step captures and compiles (the scaler itself is updated on the host
 * after the step, from the norm it gives back). From the norm of the gradients made
 * from loss * scale (an f64 scalar tensor) and the scale (a one-element f32/f64
 * tensor): the gscale for kiln_optim_step_t, kiln_clip_coef(norm / scale, max_norm) /
 * scale, or NaN where the norm is not finite, which skips the update; and in *unscaled
 * the norm / scale (not finite on a skipped step). Both in the caller's scope. */
kiln_tensor_t *kiln_loss_scale_coef(kiln_tensor_t *norm, kiln_tensor_t *scale, double max_norm,
                                    kiln_tensor_t **unscaled);

/* Linear warmup over `warmup` steps, then cosine from lr_max down to lr_min at `total`. */
double kiln_lr_cosine(int64_t step, int64_t warmup, int64_t total, double lr_max, double lr_min);

#ifdef __cplusplus
}
#endif
#endif
