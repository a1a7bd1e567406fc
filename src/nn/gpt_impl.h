/* The GPT model's pieces for the rest of the nn room: its struct (gpt.c builds and runs
 * it, gpt_moe.c keeps its experts' balance and sharding) and model_load.c's entry. */
#ifndef KILN_NN_GPT_IMPL_H
#define KILN_NN_GPT_IMPL_H
#include "kiln/io.h"
#include "kiln/flex.h"
#include "kiln/nn.h"
#include "nn/moe.h"

typedef struct {
    kiln_tensor_t *n1w, *n1b, *qkv_w, *qkv_b, *proj_w, *proj_b, *n2w, *n2b;
    kiln_tensor_t *q_hn, *k_hn; /* qk_norm: each head's RMSNorm weights (hs) of q and k, or NULL */
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


/* ---- shared by the model's files (gpt.c, gpt_config.c, gpt_forward.c, gpt_kv.c, gpt_train.c) ---- */

struct kiln_kv_cache {
    int batch, len, n_layer;
    kiln_tensor_t **k, **v; /* per layer (B, Hkv, block_size, hs) */
};

/* The linear layers of a block, in the order of the packed copies a KV pool keeps. */
enum { PK_QKV, PK_PROJ, PK_FC, PK_UP, PK_OUT, PK_N };

/* One pass through the blocks: training and forward over (B,T) tokens, or paged decoding
 * over N rows of a batch of sequences. kiln__gpt_block() is the same for both; the pass says how
 * it attends and how it multiplies by a linear layer's weights. */
typedef struct kiln__gpt_pass pass;
struct kiln__gpt_pass {
    /* Attention of layer i from the q, k, v parts of its qkv projection: (B,T,H*hs),
     * (B,T,Hk*hs) x2 or (N,H*hs), (N,Hk*hs) x2; returns (B,T,C) or (N,C). */
    kiln_tensor_t *(*attend)(const pass *ps, int i, kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v);
    /* Multi-head latent attention of layer i on its normed input h: (B,T,H dv) or (N,H dv). */
    kiln_tensor_t *(*latent)(const pass *ps, int i, kiln_tensor_t *h);
    const kiln_gpt_t *m;
    kiln_tensor_t *(*pk)[PK_N]; /* packed weights per layer (kiln_matmul_rows_packed), or NULL: kiln_linear */
    double p;                   /* dropout on the attention and MLP outputs, in training */
    bool train;
    /* full causal attention: positions pos0.. of B sequences of T, the cache if any, and
     * a flex variant's modifiers (NULL: kiln_attention) */
    int64_t B, T, pos0;
    const kiln_flex_t *flex;
    kiln_tensor_t *mask; /* flex's block mask, made once for every layer (NULL: none) */
    kiln_kv_cache_t *cache;
    /* paged attention: the pool, and the rows' positions, slots, (seq, pos) and block table */
    kiln_kv_pool_t *pool;
    kiln_tensor_t *pos, *slot, *seq_pos, *block_table;
    kiln_paged_variant variant;
    const kiln__moe_packed *moe_pk; /* the paged pass's MoE weights packed, per layer (NULL: none) */
    kiln_tensor_t **balance; /* MoE blocks add their balance losses here (NULL: none wanted) */
};

/* Config c's attention variant as flex modifiers (gpt_config.c): its presets, a doc:EOT
 * part made the preset doc over the document ids of idx (NULL: a placeholder, to check the
 * spec; keep_doc false: left out). */
kiln_status kiln__gpt_flex(const kiln_gpt_config *c, kiln_tensor_t *idx, bool keep_doc, kiln_flex_t **out);
/* The variant as the paged serving path runs it, or an error naming what it cannot run. */
kiln_status kiln__gpt_paged_variant(const kiln_gpt_config *c, kiln_paged_variant *v);
/* x (..., n * hs) as (B, n, T, hs) heads, each through an RMSNorm of weight w (hs) first
 * when w is given (qk_norm; w NULL: none): (B,T,n*hs) -> (B,n,T,hs), or (N,n*hs) ->
 * (N,n,hs) with T = 0. */
kiln_tensor_t *kiln__gpt_heads(const kiln_gpt_t *m, kiln_tensor_t *x, int64_t B, int64_t T, int64_t n, int64_t hs,
                               kiln_tensor_t *w);
/* The model's norm (layer or RMS, by its config) of x with weight w and bias b. */
kiln_tensor_t *kiln__gpt_norm(const kiln_gpt_t *m, kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *b);
/* x w^T + b through w's packed copy wp: rows that do not depend on each other. */
kiln_tensor_t *kiln__gpt_linear_rows(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *wp, kiln_tensor_t *b);
/* Transformer block i on x (B,T,C) or (N,C), as the pass attends and multiplies. */
kiln_tensor_t *kiln__gpt_block(const pass *ps, int i, kiln_tensor_t *x);
/* Logits of T new positions of B sequences from pos0, through the cache if any. */
kiln_tensor_t *kiln__gpt_run(kiln_gpt_t *m, kiln_tensor_t *idx, int64_t pos0, kiln_kv_cache_t *cache, bool train,
                            kiln_tensor_t **balance);
/* idx is (B, T) of i32/i64 and positions pos0.. fit the context, else an error naming what. */
kiln_status kiln__gpt_check_idx(const kiln_gpt_t *m, kiln_tensor_t *idx, int64_t pos0, const char *what);
/* The model's autocast region around a forward (none in f32); false with the error set. */
bool kiln__gpt_precision_begin(const kiln_gpt_t *m);
void kiln__gpt_precision_end(const kiln_gpt_t *m);

#endif
