/* The GPT model's training step as a graph function: forward, backward, the gradients
 * averaged over a group, clipping or loss scaling, and the optimizer's update. */
#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/opts.h"
#include "core/parse.h"
#include "core/util.h"
#include "kiln/dist.h"
#include "kiln/flex.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/optim.h"
#include "nn/gpt_impl.h"
#include "nn/moe.h"
#include "nn/names.h"

typedef kiln__gpt_layer layer;

kiln_status kiln_gpt_loss_backward(void *model, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    if (!model || !in || n_in != 2 || !out || !n_out)
        return kiln_error(KILN_ERR_ARG, "gpt_loss_backward: needs the model, (idx, targets) and room for the loss");
    kiln_tensor_t *loss;
    if (!kiln_gpt_forward(model, in[0], in[1], true, &loss)) return kiln_last_status();
    kiln_status s = kiln_backward(loss);
    out[0] = loss;
    *n_out = 1;
    return s;
}

/* The gradient norm of a model whose experts are sharded: the replicated parameters'
 * squares, the same on every rank, plus the experts' squares summed over the ranks. */
static kiln_status sharded_norm(const kiln_gpt_step *st, kiln_tensor_t **norm)
{
    kiln_tensor_t **ps = malloc(sizeof *ps * (size_t)(st->n_params ? st->n_params : 1)), *nr, *ne;
    if (!ps) return kiln_error(KILN_ERR_OOM, "gpt_train_step: out of memory");
    int n = 0, k = st->n_params;
    for (int i = 0; i < st->n_params; i++) /* replicated from the front, shards from the back */
        if (kiln__gpt_expert_shard(st->model, st->params[i])) ps[--k] = st->params[i];
        else ps[n++] = st->params[i];
    kiln_status s = kiln_grad_norm(ps, n, &nr);
    if (s == KILN_OK) s = kiln_grad_norm(ps + k, st->n_params - k, &ne);
    free(ps);
    kiln_tensor_t *ne2 = s == KILN_OK ? kiln_mul(ne, ne) : NULL;
    if (s == KILN_OK && !ne2) s = kiln_last_status();
    if (s == KILN_OK && st->pg) s = kiln_pg_allreduce(st->pg, ne2, KILN_REDUCE_SUM);
    if (s == KILN_OK && !(*norm = kiln_sqrt(kiln_add(kiln_mul(nr, nr), ne2)))) s = kiln_last_status();
    return s;
}

kiln_status kiln_gpt_train_step(void *step, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    const kiln_gpt_step *st = step;
    if (!st || !st->model || !st->opt || !in || n_in != 3 + st->scaled || !out || !n_out)
        return kiln_error(KILN_ERR_ARG, "gpt_train_step: needs the model and optimizer, (idx, targets, lr%s) and room "
                          "for (loss, norm)", st && st->scaled ? ", loss scale" : "");
    kiln_tensor_t *loss = NULL, *norm = NULL, *scale = st->scaled ? in[3] : NULL;
    if (scale && (kiln_tensor_numel(scale) != 1 || !kiln_dtype_is_float(kiln_tensor_dtype(scale)))) {
        char b[96];
        return kiln_error(KILN_ERR_SHAPE, "gpt_train_step: the loss scale %s must be a one-element float tensor",
                          kiln_tensor_describe(scale, b, sizeof b));
    }
    kiln_status s = KILN_OK;
    kiln_pg_t *ep = st->model->ep;
    if (ep && kiln_pg_world_size(ep) > 1 && st->pg != ep)
        return kiln_error(KILN_ERR_ARG, "gpt_train_step: the model's experts are sharded over %d ranks, so it trains "
                          "data-parallel over that group: pass it as the step's pg", kiln_pg_world_size(ep));
    if (ep && st->zero)
        return kiln_error(KILN_ERR_UNSUPPORTED, "gpt_train_step: ZeRO-1 with sharded experts is not supported (its "
                          "shards assume every rank holds every parameter)");
    int A = st->accum > 1 ? st->accum : 1;
    /* Backward runs on loss * scale / A, the scale read when the step runs. */
    kiln_tensor_t *factor = scale ? kiln_mul_scalar(kiln_cast(kiln_view(scale, NULL, 0), KILN_DTYPE_F32), 1.0 / A) : NULL;
    if (scale && !factor) return kiln_last_status();
    if (A == 1) {
        if (!kiln_gpt_forward(st->model, in[0], in[1], true, &loss)) return kiln_last_status();
        s = kiln_backward(factor ? kiln_mul(loss, factor) : loss);
    } else {
        if (kiln_tensor_ndim(in[0]) != 3 || kiln_tensor_shape(in[0])[0] != A || kiln_tensor_ndim(in[1]) != 3 ||
            kiln_tensor_shape(in[1])[0] != A)
            return kiln_error(KILN_ERR_SHAPE, "gpt_train_step: accum %d takes idx and targets of shape (%d, B, T)", A, A);
        for (int k = 0; s == KILN_OK && k < A; k++) {
            kiln_tensor_t *x = kiln_squeeze(kiln_narrow(in[0], 0, k, 1), 0), *y = kiln_squeeze(kiln_narrow(in[1], 0, k, 1), 0);
            kiln_tensor_t *lk;
            if (!x || !y || !kiln_gpt_forward(st->model, x, y, true, &lk)) return kiln_last_status();
            s = kiln_backward(factor ? kiln_mul(lk, factor) : kiln_mul_scalar(lk, 1.0 / A));
            loss = s != KILN_OK ? NULL : loss ? kiln_add(loss, lk) : lk;
            if (s == KILN_OK && !loss) s = kiln_last_status();
        }
        if (s == KILN_OK && !(loss = kiln_mul_scalar(loss, 1.0 / A))) s = kiln_last_status();
    }
    if (st->zero) {
        if (s == KILN_OK) s = kiln_zero1_step_t(st->zero, in[2], scale, st->clip, &norm);
    } else {
        for (int i = 0; s == KILN_OK && st->pg && i < st->n_params; i++) {
            kiln_tensor_t *g = kiln_tensor_grad(st->params[i]);
            if (!g) continue;
            /* an expert shard's gradient is the sum over every rank's rows already */
            if (kiln__gpt_expert_shard(st->model, st->params[i]))
                s = kiln_mul_scalar_(g, 1.0 / kiln_pg_world_size(st->pg));
            else
                s = kiln_pg_allreduce(st->pg, g, KILN_REDUCE_AVG);
        }
        if (s == KILN_OK) s = st->model->ep ? sharded_norm(st, &norm) : kiln_grad_norm(st->params, st->n_params, &norm);
        /* (the gscale of a loss-scaled step unscales, and skips the update when the
         * gradients overflowed) */
        kiln_tensor_t *coef = s != KILN_OK ? NULL
                              : scale ? kiln_loss_scale_coef(norm, scale, st->clip, &norm)
                              : st->clip > 0 ? kiln_clip_coef(norm, st->clip) : NULL;
        if (s == KILN_OK && (scale || st->clip > 0) && !coef) s = kiln_last_status();
        if (s == KILN_OK) s = kiln_optim_step_t(st->opt, in[2], coef);
    }
    if (s == KILN_OK) s = kiln_gpt_moe_update(st->model, st->pg); /* the balancing biases, from every rank's loads */
    kiln_optim_zero_grad(st->opt);
    out[0] = loss;
    out[1] = norm;
    *n_out = 2;
    return s;
}

