/* The GPT model's pieces for the rest of the nn room: its struct (gpt.c builds and runs
 * it, gpt_moe.c keeps its experts' balance and sharding) and model_load.c's entry. */
#ifndef KILN_NN_GPT_IMPL_H
#define KILN_NN_GPT_IMPL_H
#include "kiln/io.h"
#include "kiln/nn.h"
#include "nn/moe.h"

typedef struct {
    kiln_tensor_t *n1w, *n1b, *qkv_w, *qkv_b, *proj_w, *proj_b, *n2w, *n2b;
    kiln_tensor_t *fc_w, *fc_b, *out_w, *out_b; /* gelu: fc, proj; swiglu: gate, down */
    kiln_tensor_t *up_w, *up_b;                 /* swiglu only */
    kiln__moe *moe;                             /* an MoE block's (fc, out, up NULL), or NULL */
    /* multi-head latent attention (qkv NULL): q (no q latent) or q_a, q_norm, q_b; kv_a,
     * kv_norm, kv_b */
    kiln_tensor_t *q_a, *q_norm, *q_b, *kv_a, *kv_norm, *kv_b;
} kiln__gpt_layer; /* one block's parameters */

struct kiln_gpt {
    kiln_gpt_config cfg;
    int n, cap;
    kiln_tensor_t **params;
    char **names;
    kiln_tensor_t *tok_emb, *pos_emb, *nfw, *nfb, *lm_head;
    kiln__gpt_layer *layers;
    kiln_dtype precision; /* kiln_gpt_forward's autocast type (f32: none) */
    kiln_gpt_param_fn fill; /* while building: where the parameters come from (NULL: drawn) */
    void *fill_ctx;
    kiln_pg_t *ep; /* the group the routed experts are sharded over (kiln_gpt_shard_experts), or NULL */
};

/* Is t one of the routed experts' weights that m->ep shards (gpt_moe.c)? */
bool kiln__gpt_expert_shard(const kiln_gpt_t *m, const kiln_tensor_t *t);

/* A model of config cfg whose parameters are the tensors of the kiln model file f (read
 * from path, which messages name) of their names: over the mapped file where they are
 * f32 (kiln_safetensors_view: nothing copied, only the pages read brought in), else
 * widened. A tensor missing or of another shape is an error naming it. */
kiln_status kiln__gpt_new_from_file(const kiln_gpt_config *cfg, const kiln_safetensors_t *f, const char *path,
                                    kiln_gpt_t **out);

#endif
