/* kiln/nn.h — layers and the GPT model (GPT-2 style and LLaMA style from one config).
 *
 * A worked example (one training step; see tools/train.c for the whole loop):
 *
 *     kiln_gpt_config cfg = kiln_gpt_config_gpt2();
 *     cfg.vocab_size = 256;
 *     kiln_gpt_t *m;
 *     if (kiln_gpt_new(&cfg, 1234, &m) != KILN_OK) die(kiln_last_error());
 *     kiln_scope_begin();
 *     kiln_tensor_t *loss;
 *     kiln_gpt_forward(m, idx, targets, true, &loss);    // idx, targets (B,T) i64
 *     kiln_backward(loss);                               // grads on kiln_gpt_param(m, i)
 *     kiln_scope_end();
 *
 * The model's exact definition (names, shapes, formulas) is docs/model.md.
 */
#ifndef KILN_NN_H
#define KILN_NN_H

#include "kiln/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y = x @ w^T + b for x (..., in), w (out, in), b (out) or NULL. Leading dims are
 * flattened so that the whole batch is one GEMM. */
kiln_tensor_t *kiln_linear(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *b);

typedef enum { KILN_NORM_LAYERNORM, KILN_NORM_RMSNORM } kiln_norm_kind;
typedef enum { KILN_POS_LEARNED, KILN_POS_ROPE } kiln_pos_kind;
typedef enum { KILN_MLP_GELU, KILN_MLP_SWIGLU } kiln_mlp_kind;
typedef enum { KILN_ROUTER_SOFTMAX, KILN_ROUTER_SIGMOID } kiln_router_kind;

/* A string field of the config (its attention variant): under 64 characters. */
typedef char kiln_gpt_spec[64];

/* The model's configuration: one member per row of kiln/gpt_config.def, which says what
 * each means, its default and range, and its JSON key and `kiln train` option. */
typedef struct {
#define KILN_GPT_FIELD(member, ctype, ...) ctype member;
#define KILN_GPT_MEMBER(ctype, member, ...) ctype member;
#define KILN_GPT_PART(...)
#include "kiln/gpt_config.def"
#undef KILN_GPT_FIELD
#undef KILN_GPT_MEMBER
#undef KILN_GPT_PART
} kiln_gpt_config;

kiln_gpt_config kiln_gpt_config_gpt2(void);  /* GPT-2 style defaults, 4 layers, C = 256 */
kiln_gpt_config kiln_gpt_config_llama(void); /* LLaMA style defaults */
/* Checks the config; the message names the first field that is wrong. */
kiln_status kiln_gpt_config_check(const kiln_gpt_config *c);
/* The config as JSON (malloc'd; caller frees) and back. Unknown keys are an error. */
char *kiln_gpt_config_to_json(const kiln_gpt_config *c);
kiln_status kiln_gpt_config_from_json(const char *json, kiln_gpt_config *out);
int kiln_gpt_ffn_hidden(const kiln_gpt_config *c);
int kiln_gpt_moe_ffn(const kiln_gpt_config *c); /* an expert's width, moe_ffn resolved */

typedef struct kiln_gpt kiln_gpt_t;

/* A new model initialised from seed (the global RNG is left as it was). */
kiln_status kiln_gpt_new(const kiln_gpt_config *cfg, uint64_t seed, kiln_gpt_t **out);
/* A model whose parameters are given rather than drawn: fill(name, shape, ndim, ctx) is
 * called for each parameter in kiln_gpt_param's order and returns a contiguous f32
 * tensor of that shape, which the model keeps (a reference: the open scope or the
 * fill's caller keeps its own), or NULL with the error set, which stops the build and
 * is returned. On the device the model is made on (kiln_device) the tensor is taken as
 * it is, not copied: a loader hands over tensors over a mapped file this way
 * (kiln_hf_load); one on another device is copied there. */
typedef kiln_tensor_t *(*kiln_gpt_param_fn)(const char *name, const int64_t *shape, int ndim, void *ctx);
kiln_status kiln_gpt_new_from(const kiln_gpt_config *cfg, kiln_gpt_param_fn fill, void *ctx, kiln_gpt_t **out);
void kiln_gpt_free(kiln_gpt_t *m);
const kiln_gpt_config *kiln_gpt_get_config(const kiln_gpt_t *m);
/* Parameters in a fixed order; borrowed. */
int kiln_gpt_num_params(const kiln_gpt_t *m);
kiln_tensor_t *kiln_gpt_param(const kiln_gpt_t *m, int i, const char **name);
kiln_tensor_t *kiln_gpt_find_param(const kiln_gpt_t *m, const char *name);
int64_t kiln_gpt_param_elements(const kiln_gpt_t *m);
/* Copies every parameter from a safetensors file (names and shapes must match). */
kiln_status kiln_gpt_load_weights(kiln_gpt_t *m, const char *path);

/* The type kiln_gpt_forward computes in (not saved with the model): KILN_DTYPE_F32 (the
 * default), or KILN_DTYPE_BF16 / KILN_DTYPE_F16 for mixed precision: forward runs under
 * kiln_autocast_begin (kiln/ops.h), so the linear layers and attention run in that
 * type while the parameters, norms, loss and gradients stay f32. */
kiln_status kiln_gpt_set_precision(kiln_gpt_t *m, kiln_dtype dt);
kiln_dtype kiln_gpt_precision(const kiln_gpt_t *m);
/* Stores the linear layers' weights (and an untied head) as dt, each rounded once:
 * bf16 or f16 hold them in half the memory (for serving; an f32 checkpoint stays the
 * master copy), and the model's precision becomes dt so that its forward casts its
 * activations to match. The embeddings, norms and biases stay f32. Not for training:
 * an optimizer made before keeps the old f32 tensors (it holds references, so nothing
 * dangles, but its updates no longer reach the model), and one made after refuses
 * the bf16 parameters. */
kiln_status kiln_gpt_store_linear(kiln_gpt_t *m, kiln_dtype dt);

/* Logits (B,T,V) for idx (B,T) i32/i64 with T <= block_size. With targets (B,T) the
 * mean cross-entropy (ignore_index -1) is returned in *loss. train turns dropout on.
 * The logits are in the model's precision, the loss f32. */
kiln_tensor_t *kiln_gpt_forward(kiln_gpt_t *m, kiln_tensor_t *idx, kiln_tensor_t *targets, bool train,
                                kiln_tensor_t **loss);
/* A training step's gradients: the forward (train mode) on in[0] = idx and in[1] =
 * targets, then backward, which adds into every parameter's gradient; out[0] = the loss.
 * Shaped as a kiln_graph_fn with the model as ctx, so that
 * kiln_compiled_new(kiln_gpt_loss_backward, m, ...) compiles it. */
kiln_status kiln_gpt_loss_backward(void *model, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out);

/* A whole training step, also a kiln_graph_fn (ctx: a kiln_gpt_step), so that one graph
 * holds forward, loss, backward, gradient clipping and the optimizer update: in = (idx,
 * targets, lr), lr a one-element f32/f64 tensor, and the loss scale after them when
 * the step is scaled (below); out = (loss, gradient norm before
 * clipping). The gradients are zeroed at the end (inside a graph they never reach the
 * parameters), so they must be empty when it is called. With accum = A > 1, idx and
 * targets are (A, B, T): A micro-batches, each forward and backward on its loss / A (the
 * gradients add up), then one update; the loss given is the micro-batches' mean. With
 * a process group, every gradient is averaged over it (kiln_pg_allreduce, captured
 * into the graph too) before the norm and the update: data-parallel training where
 * each rank passes its own share of the batch. With zero (ZeRO-1 over the group), the
 * update is kiln_zero1_step_t instead (reduce-scatter, norm, sharded AdamW,
 * allgather; opt only zeroes the gradients, pg is not used). */
typedef struct kiln_optim kiln_optim_t;
typedef struct kiln_pg kiln_pg_t;
typedef struct kiln_zero1 kiln_zero1_t;
typedef struct {
    kiln_gpt_t *model;
    kiln_optim_t *opt;
    kiln_tensor_t *const *params; /* the optimizer's, for the norm */
    int n_params;
    double clip; /* max gradient norm; <= 0: no clipping */
    int accum;   /* micro-batches per step; 0 or 1: one */
    kiln_pg_t *pg; /* data parallel: average the gradients over it; NULL: one process */
    kiln_zero1_t *zero; /* or NULL: the sharded update in place of pg's allreduce and opt's step */
    /* f16 training, dynamic loss scaling (kiln/optim.h): the step takes a fourth
     * input, the loss scale (a one-element float tensor: the scaler's current scale).
     * Backward runs on loss * scale, the update divides it out, and a step whose
     * gradients hold an inf or a NaN is skipped inside the step (no update; the
     * optimizer's state and step count stay as they were); the norm given back is the
     * unscaled one, not finite on a skipped step. Nothing is read on the host, so the
     * step captures and compiles, with zero too; after each call the caller updates its
     * scaler from that norm (kiln_loss_scaler_update) for the next step's scale. */
    bool scaled;
} kiln_gpt_step;
kiln_status kiln_gpt_train_step(void *step, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out);

/* Training checkpoints: the files of a kiln run folder (`kiln train --out DIR`), from which
 * a resumed run repeats the losses of an uninterrupted one bit for bit.
 *   DIR/model.safetensors: every parameter whole (sharded experts gathered), metadata
 *     format "kiln-gpt-1", config (kiln_gpt_config_to_json), tokenizer (its kind: "byte",
 *     or "bpe" for DIR/tokenizer.json), step, and chat_template when given;
 *   DIR/train_state.safetensors: the optimizer's state, tensor "opt.SLOT.NAME" for slot
 *     SLOT of parameter NAME, metadata format "kiln-train-state-1", step, rng_seed and
 *     rng_offset (the global RNG), optimizer, data_seed, optim_steps (the optimizer's own
 *     count, below step by the skipped f16 steps), precision, and with a loss scaler
 *     loss_scale, loss_scale_good, loss_scale_skipped;
 *   DIR/train_state.prev.safetensors: the state before, kept until the new pair is
 *     written, so that a save cut off between the two files leaves a state that matches
 *     the model file (the one kiln_checkpoint_load takes then). */
#define KILN_CHECKPOINT_MODEL "model.safetensors"
#define KILN_CHECKPOINT_STATE "train_state.safetensors"
#define KILN_CHECKPOINT_STATE_PREV "train_state.prev.safetensors"
typedef struct kiln_loss_scaler kiln_loss_scaler;
typedef struct {
    int64_t step;              /* optimizer steps done (load: read) */
    const char *tokenizer;     /* the model file's tokenizer kind (NULL: "byte") */
    const char *chat_template; /* the model file's chat template, or NULL: none written */
    const char *optimizer;     /* the optimizer's name ("adamw", "sgd"): recorded; load refuses a state of another */
    int64_t data_seed;         /* the batches' seed: recorded; load refuses a state of another */
    kiln_dtype precision;      /* recorded (the training's compute type) */
    kiln_loss_scaler *scaler;  /* f16's loss scaler: saved; loaded where the state has one; NULL: none */
} kiln_checkpoint_info;
/* The model file alone (info's step, tokenizer and chat template), into dir (which must
 * exist); written atomically. A model whose experts are sharded is gathered first: every
 * rank of its group calls it (see kiln_gpt_gather_param). */
kiln_status kiln_checkpoint_save_model(const char *dir, kiln_gpt_t *m, const kiln_checkpoint_info *info);
/* The training state, then the model file, of model m and optimizer opt at info->step,
 * with the global RNG's state. With sharded experts every rank calls it (the shards are
 * gathered) and only the one with write set writes. */
kiln_status kiln_checkpoint_save(const char *dir, kiln_gpt_t *m, kiln_optim_t *opt, const kiln_checkpoint_info *info,
                                 bool write);
/* A checkpoint of dir back into m (its weights) and opt (its state; opt made for m's
 * parameters as they were saved), the global RNG set as saved; info->step is set and,
 * where the state holds one and info->scaler is given, the scaler. info->optimizer and
 * info->data_seed must be the saved ones (an error naming both otherwise), and so must
 * the two files' steps. */
kiln_status kiln_checkpoint_load(const char *dir, kiln_gpt_t *m, kiln_optim_t *opt, kiln_checkpoint_info *info);

/* Mixture of experts. kiln_gpt_moe_update: after an optimizer step, each MoE block's
 * balancing bias moves by moe_bias_speed * sign(mean load - load[e]), the loads being
 * the rows routed to each expert by the training forwards since the last call (summed
 * over pg's ranks when pg is given, so that every rank moves its bias alike), which are
 * then cleared (kiln_gpt_train_step calls it after its update; call it after your own
 * step otherwise). It is ops on the model's tensors, so a captured step holds it too;
 * for a model without MoE blocks it does nothing. kiln_gpt_moe_stats: block `layer`'s
 * loads as of the last update and its biases, n_routed_experts floats each, and the rows
 * its capacity dropped in those forwards (any may be NULL); false for a block without
 * experts. */
kiln_status kiln_gpt_moe_update(kiln_gpt_t *m, kiln_pg_t *pg);
bool kiln_gpt_moe_stats(const kiln_gpt_t *m, int layer, float *load, float *bias, double *dropped);

/* Expert parallelism. kiln_gpt_shard_experts: rank r of pg keeps, of every MoE block,
 * routed experts r E / W .. (r + 1) E / W - 1 (E a multiple of the world size W; the
 * others are freed), and the blocks send each row to the rank that holds its expert and
 * back (kiln_pg_all_to_all), so every forward, training or not, runs on all of pg's
 * ranks together. The experts' parameters (blocks.i.mlp.experts.*) become those
 * shards: (E / W, ...) tensors of the same names, in the same places of the parameter
 * list, and an optimizer must be made after this call. A shard's gradient holds the
 * sum over every rank's rows, so kiln_gpt_train_step (whose pg must then be this
 * group) divides it by W where it averages the other gradients over the ranks, and
 * takes the norm over every rank's shards. With W = 1 nothing is split and the
 * exchanges copy rows: the same path, one process. Every forward of a sharded model
 * (evaluation's, kiln_gpt_forward_cached's) runs the exchanges, so all of pg's ranks
 * make it together; kiln_kv_pool_new (the serving engine's) refuses one: gather it into
 * a checkpoint (below) and serve that. pg is borrowed: it must outlive the model, and
 * the gradients and graphs made from it. kiln_gpt_param_sharded: whether
 * parameter i is such a shard. kiln_gpt_gather_param: for a shard, t (shaped like it:
 * the parameter, its gradient, an optimizer's moment of it) gathered from every rank
 * into a new (E, ...) tensor handed to the scope, a collective every rank calls alike;
 * for another parameter t itself. kiln_gpt_shard_param: for a shard, this rank's part
 * of full (E, ...), a view; for another parameter full itself. */
kiln_status kiln_gpt_shard_experts(kiln_gpt_t *m, kiln_pg_t *pg);
bool kiln_gpt_param_sharded(const kiln_gpt_t *m, int i);
kiln_tensor_t *kiln_gpt_gather_param(kiln_gpt_t *m, int i, kiln_tensor_t *t);
kiln_tensor_t *kiln_gpt_shard_param(const kiln_gpt_t *m, int i, kiln_tensor_t *full);

/* Incremental decoding with a key/value cache of up to block_size positions. */
typedef struct kiln_kv_cache kiln_kv_cache_t;
kiln_status kiln_kv_cache_new(const kiln_gpt_t *m, int batch, kiln_kv_cache_t **out);
void kiln_kv_cache_free(kiln_kv_cache_t *c);
int kiln_kv_cache_len(const kiln_kv_cache_t *c);
void kiln_kv_cache_reset(kiln_kv_cache_t *c);
/* Logits (B,Tnew,V) for the next Tnew tokens; appends their keys and values. Only
 * models with rope positions or learned ones within block_size. Runs without grad. */
kiln_tensor_t *kiln_gpt_forward_cached(kiln_gpt_t *m, kiln_kv_cache_t *c, kiln_tensor_t *idx);

/* Paged key/value storage for many sequences at once (the serving engine's KV cache):
 * per layer, num_blocks blocks of block_len positions, stored as dtype (f32, or f16 or
 * bf16 for half the memory and the memory traffic; keys and values are rounded to it
 * as they are written, and attention reads them back widened to f32). Which blocks
 * hold a sequence is the caller's block table; the pool only stores them. The pool
 * also keeps the model's linear weights packed for kiln_matmul_rows_packed (as many
 * bytes again as those weights), so the model must not change while the pool lives. */
typedef struct kiln_kv_pool kiln_kv_pool_t;
kiln_status kiln_kv_pool_new(const kiln_gpt_t *m, int num_blocks, int block_len, kiln_dtype dtype,
                             kiln_kv_pool_t **out);
/* The same with the packed weights stored as `weights`: KILN_DTYPE_F32, or
 * KILN_DTYPE_BF16 or KILN_DTYPE_F16 (each weight rounded once, half the bytes held and
 * streamed per token; products and sums stay f32, and a row's result still does not
 * depend on the batch). kiln_kv_pool_new packs them as f32. */
kiln_status kiln_kv_pool_new_typed(const kiln_gpt_t *m, int num_blocks, int block_len, kiln_dtype dtype,
                                   kiln_dtype weights, kiln_kv_pool_t **out);
/* Linear weights kept in quantized blocks for decoding. q8_0 is not a kiln_dtype: it is
 * blocks of 32 values with an f16 scale, not an element type that tensor ops could take,
 * so it is a choice of its own beside the float type. KILN_WEIGHT_QUANT_Q8_0 packs every
 * linear weight whose input width is a multiple of 32 (the head included) in ggml's
 * q8_0 blocks (kiln_matmul_rows_pack_q8_0: 1.0625 bytes a weight, quantized as
 * llama.cpp's Q8_0 files are, so a Q8_0 GGUF model's weights come back as its own
 * blocks); the others, and a mixture of experts' weights, stay f32. Products then
 * quantize their activations to q8_0 too; a row's result still does not depend on the
 * batch. kiln_kv_pool_new_quant with KILN_WEIGHT_QUANT_NONE is kiln_kv_pool_new_typed;
 * with Q8_0, weights must be KILN_DTYPE_F32 (the blocks are made from the model's own
 * weights). */
typedef enum { KILN_WEIGHT_QUANT_NONE = 0, KILN_WEIGHT_QUANT_Q8_0 } kiln_weight_quant;
kiln_status kiln_kv_pool_new_quant(const kiln_gpt_t *m, int num_blocks, int block_len, kiln_dtype dtype,
                                   kiln_dtype weights, kiln_weight_quant quant, kiln_kv_pool_t **out);
void kiln_kv_pool_free(kiln_kv_pool_t *p); /* NULL is fine */
int kiln_kv_pool_num_blocks(const kiln_kv_pool_t *p);
int kiln_kv_pool_block_len(const kiln_kv_pool_t *p);
/* Bytes of keys and values one block holds over all layers, stored as dtype. */
int64_t kiln_kv_pool_block_bytes(const kiln_gpt_t *m, int block_len, kiln_dtype dtype);
/* Copies block src to block dst in every layer (copy-on-write of a shared block). */
kiln_status kiln_kv_pool_copy_block(kiln_kv_pool_t *p, int dst, int src);

/* One step of the serving engine: new tokens of several sequences together. */
typedef struct {
    int n_tokens;               /* new tokens, all sequences together */
    const int32_t *tokens;      /* [n_tokens] */
    const int32_t *seq;         /* [n_tokens] the block-table row of each token */
    const int32_t *pos;         /* [n_tokens] its position in that sequence */
    int n_seqs, max_blocks;
    const int32_t *block_table; /* [n_seqs * max_blocks]: position p of row s is in block
                                   block_table[s * max_blocks + p / block_len] */
    int n_logits;               /* rows whose logits are wanted (0: a prefill-only step) ... */
    const int32_t *logit_rows;  /* [n_logits] ... as indices into tokens */
} kiln_paged_batch;

/* Writes the keys and values of the new tokens into their slots, then attends each
 * token to positions 0..pos of its sequence (earlier steps' and this step's; those of
 * the window, for a model whose attention variant has one: kiln_gpt_kv_window), and
 * returns logits (n_logits, V) f32, in the caller's scope like an op's result (the
 * step's intermediates too: run it inside a scope). Runs without grad. A row's logits do not depend on
 * the other rows in the batch (bitwise). */
kiln_tensor_t *kiln_gpt_forward_paged(kiln_gpt_t *m, kiln_kv_pool_t *p, const kiln_paged_batch *b);
/* The positions a new token of m attends to in the paged path, the newest included:
 * its attention variant's window (0: every position). Blocks wholly before a
 * sequence's window are never read, so a server may free them. */
int64_t kiln_gpt_kv_window(const kiln_gpt_t *m);

#ifdef __cplusplus
}
#endif
#endif
