/* kiln/optim.h — optimizers, gradient clipping and learning-rate schedules.
 *
 *     kiln_optim_t *opt;
 *     kiln_adamw_new(params, n, decay_mask, 0.9, 0.95, 1e-8, 0.1, &opt);
 *     ... kiln_backward(loss) ...
 *     double norm;
 *     kiln_clip_grad_norm(params, n, 1.0, &norm);
 *     kiln_optim_step(opt, kiln_lr_cosine(step, 100, 5000, 6e-4, 6e-5));
 *     kiln_optim_zero_grad(opt);
 */
#ifndef KILN_OPTIM_H
#define KILN_OPTIM_H

#include "kiln/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_optim kiln_optim_t;

/* AdamW over n parameters (borrowed; they must outlive the optimizer). decay[i] says
 * whether parameter i gets weight decay (NULL: those with 2 or more dims). */
kiln_status kiln_adamw_new(kiln_tensor_t *const *params, int n, const bool *decay, double beta1, double beta2,
                           double eps, double weight_decay, kiln_optim_t **out);
/* SGD with momentum (0 = plain) and L2 weight decay on the decayed parameters. */
kiln_status kiln_sgd_new(kiln_tensor_t *const *params, int n, const bool *decay, double momentum,
                         double weight_decay, kiln_optim_t **out);
void kiln_optim_free(kiln_optim_t *o);
/* One update at learning rate lr; parameters without a gradient are skipped. */
kiln_status kiln_optim_step(kiln_optim_t *o, double lr);
void kiln_optim_zero_grad(kiln_optim_t *o);
int64_t kiln_optim_steps(const kiln_optim_t *o);
/* State for checkpoints: per parameter i, slot k (AdamW: 0 = m, 1 = v; SGD: 0 =
 * momentum) — borrowed, NULL before the first step or when unused. */
int kiln_optim_num_slots(const kiln_optim_t *o);
kiln_tensor_t *kiln_optim_state(kiln_optim_t *o, int i, int slot);
/* Restores state: step count and each slot tensor (copied). */
kiln_status kiln_optim_set_state(kiln_optim_t *o, int64_t steps, int i, int slot, const kiln_tensor_t *value);

/* Scales all gradients so that their global L2 norm is at most max_norm (<= 0: no
 * clipping); *norm receives the norm before clipping. */
kiln_status kiln_clip_grad_norm(kiln_tensor_t *const *params, int n, double max_norm, double *norm);

/* Linear warmup over `warmup` steps, then cosine from lr_max down to lr_min at `total`. */
double kiln_lr_cosine(int64_t step, int64_t warmup, int64_t total, double lr_max, double lr_min);

#ifdef __cplusplus
}
#endif
#endif
