/* A mixture-of-experts block's feed-forward (docs/model.md, "Mixture of experts"): the
 * router, the routed experts through the token-routing ops (kiln_topk, kiln_moe_sort,
 * kiln_grouped_matmul), the shared experts, the balance loss and the balancing bias.
 * The GPT model (gpt.c) keeps one per MoE block. */
#ifndef KILN_NN_MOE_H
#define KILN_NN_MOE_H
#include "kiln/dist.h"
#include "kiln/nn.h"

typedef struct {
    kiln_tensor_t *router_w, *router_b;     /* (E, C); (E) the balancing bias, no gradient */
    kiln_tensor_t *gate, *up, *down;        /* (E, C, Fe), (E, C, Fe), (E, Fe, C) */
    kiln_tensor_t *sg, *su, *sd;            /* the shared experts' SwiGLU, or NULL */
    /* (E + 1) f32: the rows routed to each expert since the last update, then the rows
     * the capacity dropped (one tensor, so that ranks sum them in one allreduce); and the
     * same at the last update */
    kiln_tensor_t *load, *last_load;
    /* expert parallelism (kiln_gpt_shard_experts): the group whose rank r holds experts
     * [r E / W, (r + 1) E / W), gate, up and down being those only; NULL: all here */
    kiln_pg_t *ep;
} kiln__moe;

/* An MoE block's weights packed for kiln_matmul_rows_packed (the serving pool's, made
 * once): the router, each expert's gate, up and down as (out, in), the shared experts'.
 * In the weights' dtype (f32, bf16 or f16). */
typedef struct {
    kiln_tensor_t *router, *sg, *su, *sd;
    kiln_tensor_t **gate, **up, **down; /* E each */
    int E;
} kiln__moe_packed;
kiln_status kiln__moe_pack(const kiln_gpt_config *c, const kiln__moe *e, kiln_dtype weights, kiln__moe_packed *out);
void kiln__moe_packed_free(kiln__moe_packed *p); /* its tensors; p itself is the caller's */

/* The block's output for the rows x (N, C) of B sequences (N = B T; B 0: rows of no
 * sequence, no balance loss). With balance non-NULL and moe_balance_loss > 0, the block's
 * balance loss is added to *balance (NULL: it becomes it). In training the rows each
 * expert got are added into e->load. rows (the serving engine's paged pass, no
 * gradients): every product through kiln_matmul_rows, on the weights packed in pk, so
 * that a row's result does not depend on the other rows of the batch, bit for bit. */
kiln_tensor_t *kiln__moe_forward(const kiln_gpt_config *c, const kiln__moe *e, kiln_tensor_t *x, int64_t B, bool train,
                                 const kiln__moe_packed *pk, kiln_tensor_t **balance);

/* After an optimizer step: router_b += moe_bias_speed * sign(mean(load) - load) (with a
 * speed), and load kept as last_load and cleared. */
kiln_status kiln__moe_update(const kiln_gpt_config *c, kiln__moe *e);

#endif
