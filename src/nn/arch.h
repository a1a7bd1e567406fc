/* The model families as rows (src/nn/arch.c): for each, the blocks kiln builds it from,
 * its Hugging Face model_type, config keys and tensor names (hf.c reads and writes them),
 * and its GGUF architecture, keys and tensor names (gguf.c). hf.c and gguf.c walk a row;
 * no family is an if-chain there. docs/architecture.md, "Add a model family", says what a
 * new row takes. */
#ifndef KILN_NN_ARCH_H
#define KILN_NN_ARCH_H
#include "kiln/nn.h"
#include "nn/names.h"

/* A list of name pairs (names.h); a family's names are up to three such lists, the
 * first NULL-paired one ending them (a family adds its own pairs to a shared list). */
typedef struct {
    const kiln__name_pair *pairs;
    size_t n;
} kiln__name_table;
#define KILN__NAME_TABLE(t) {t, sizeof t / sizeof t[0]}

/* A config.json key that must hold this value for kiln to load the model the same
 * (LLaMA's pretraining_tp 1, GPT-2's scale_attn_weights true). */
typedef struct {
    const char *key;
    bool is_bool;
    int want; /* the integer, or the boolean as 0 / 1 */
} kiln__hf_must;

typedef struct {
    const char *name;  /* kiln's name for the family, and its Hugging Face model_type */
    const char *title; /* for messages: "LLaMA" */
    /* ---- the blocks (kiln_gpt_config's fields; docs/model.md) ---- */
    kiln_norm_kind norm;
    kiln_pos_kind pos;
    kiln_mlp_kind mlp;
    bool bias;     /* biases on every linear layer (Qwen2's q/k/v have them: kiln's bias is one switch, the
                      others loaded as zeros); else only where the config's bias keys say */
    bool qk_norm;  /* per-head RMSNorm of q and k before RoPE (Qwen3) */
    bool tied;     /* tie_word_embeddings' default */
    bool kv_equal; /* as many key heads as query heads (GPT-2) */
    bool exports;  /* a kiln model of these blocks is exported as this family (one row per set of blocks) */
    /* ---- Hugging Face: config.json ---- */
    const char *hf_class; /* architectures[0] written on export */
    struct {
        const char *n_embd, *n_layer, *n_head, *n_kv_head, *head_dim, *ffn, *vocab, *context, *eps, *act;
        const char *window;        /* the sliding window's size, or NULL */
        const char *window_switch; /* a key that turns the window on (Qwen2's use_sliding_window); NULL: any
                                      window > 0 is on */
    } hf;
    bool ffn_required;
    double eps_default;
    const char *act_ok[3]; /* the activation's accepted values (the first is written on export) */
    const char *act_why;   /* why others are refused */
    const char *bias_keys[2]; /* keys that turn biases on (any true), or NULL */
    kiln__hf_must must[2];
    const char *hf_zero_keys[3]; /* written as 0.0 on export (GPT-2's dropouts) */
    /* ---- Hugging Face: the tensors ---- */
    kiln__name_table hf_names[3];
    /* kiln's attn.qkv as three tensors of this name ("%d" the layer, "%c" q, k or v,
     * "%s" weight or bias), each of its own shape; NULL: a pair of hf_names holds it */
    const char *hf_qkv;
    bool hf_missing_bias_zero; /* a bias the files lack is zeros (the family's bias keys off) */
    const char *hf_body_prefix; /* a prefix the files may put before all but lm_head ("transformer."), or NULL */
    /* ---- GGUF (llama.cpp) ---- */
    const char *gguf_arch; /* general.architecture; NULL: not exported */
    kiln__name_table gguf_names[3];
    const char *gguf_qkv;  /* q, k and v apart ("blk.%d.attn_%c.weight"), or NULL: a pair holds attn.qkv */
    bool gguf_rope_pairs;  /* llama.cpp's rope rotates adjacent pairs for this architecture: q and k rows are
                              reordered within each head (kiln's, as Hugging Face's, rotates halves) */
    bool gguf_rope_freqs;  /* LLaMA 3.1's scaling as rope_freqs.weight */
    bool gguf_bias;        /* llama.cpp's architecture takes kiln's biases */
    const char *gguf_eps;  /* the norm's epsilon key after "ARCH." */
} kiln__arch;

/* Every family, in the order messages list them; *n gets their count. */
const kiln__arch *kiln__arch_all(size_t *n);
/* The family whose Hugging Face model_type is type, or NULL. */
const kiln__arch *kiln__arch_by_type(const char *type);
/* The family a kiln config is exported as (its blocks match an exporting row), or NULL. */
const kiln__arch *kiln__arch_of(const kiln_gpt_config *c);
/* The family's defaults: kiln_gpt_config_gpt2 with the row's blocks. */
void kiln__arch_config(const kiln__arch *a, kiln_gpt_config *c);
/* The pair of a family's lists t (hf_names or gguf_names) for kiln's parameter `name`,
 * as kiln__name_lookup. */
const kiln__name_pair *kiln__arch_lookup(const kiln__name_table *t, const char *name, int *layer, const char **rest);

#endif
