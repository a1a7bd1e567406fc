/* The model families, one row each (src/nn/arch.h says what each column means). A row
 * is read by hf.c (Hugging Face folders in and out) and gguf.c (GGUF files out); the
 * blocks it names are built by gpt.c and run by gpt_forward.c. */
#include <string.h>
#include "nn/arch.h"

/* ---- tensor names: kiln's parameters (docs/model.md) against the other formats' ---- */

/* Hugging Face LLaMA, Mistral, Qwen2 and Qwen3; their q/k/v (kiln's one qkv) are the
 * row's hf_qkv. */
static const kiln__name_pair hf_llama[] = {
    {"tok_emb.weight", "model.embed_tokens.weight", false}, {"norm_f.weight", "model.norm.weight", false},
    {"lm_head.weight", "lm_head.weight", false}, {"norm1.weight", "model.layers.%d.input_layernorm.weight", false},
    {"norm2.weight", "model.layers.%d.post_attention_layernorm.weight", false},
    {"attn.proj.weight", "model.layers.%d.self_attn.o_proj.weight", false},
    {"attn.proj.bias", "model.layers.%d.self_attn.o_proj.bias", false},
    {"mlp.gate.weight", "model.layers.%d.mlp.gate_proj.weight", false}, {"mlp.gate.bias", "model.layers.%d.mlp.gate_proj.bias", false},
    {"mlp.up.weight", "model.layers.%d.mlp.up_proj.weight", false}, {"mlp.up.bias", "model.layers.%d.mlp.up_proj.bias", false},
    {"mlp.down.weight", "model.layers.%d.mlp.down_proj.weight", false}, {"mlp.down.bias", "model.layers.%d.mlp.down_proj.bias", false},
};

/* Qwen3's per-head norms of q and k */
static const kiln__name_pair hf_qk_norm[] = {
    {"attn.q_head_norm.weight", "model.layers.%d.self_attn.q_norm.weight", false},
    {"attn.k_head_norm.weight", "model.layers.%d.self_attn.k_norm.weight", false},
};

/* GPT-2 (without the "transformer." prefix of GPT2LMHeadModel's files, which lm_head
 * lacks); its Conv1D weights are stored (in, out) */
static const kiln__name_pair hf_gpt2[] = {
    {"tok_emb.weight", "wte.weight", false}, {"pos_emb.weight", "wpe.weight", false},
    {"norm_f.weight", "ln_f.weight", false}, {"norm_f.bias", "ln_f.bias", false},
    {"norm1.weight", "h.%d.ln_1.weight", false}, {"norm1.bias", "h.%d.ln_1.bias", false},
    {"norm2.weight", "h.%d.ln_2.weight", false}, {"norm2.bias", "h.%d.ln_2.bias", false},
    {"attn.qkv.weight", "h.%d.attn.c_attn.weight", true}, {"attn.qkv.bias", "h.%d.attn.c_attn.bias", false},
    {"attn.proj.weight", "h.%d.attn.c_proj.weight", true}, {"attn.proj.bias", "h.%d.attn.c_proj.bias", false},
    {"mlp.fc.weight", "h.%d.mlp.c_fc.weight", true}, {"mlp.fc.bias", "h.%d.mlp.c_fc.bias", false},
    {"mlp.proj.weight", "h.%d.mlp.c_proj.weight", true}, {"mlp.proj.bias", "h.%d.mlp.c_proj.bias", false},
    {"lm_head.weight", "lm_head.weight", false},
};

/* llama.cpp's llama architecture (q, k and v apart: the row's gguf_qkv) */
static const kiln__name_pair gguf_llama[] = {
    {"tok_emb.weight", "token_embd.weight", false},   {"norm_f.weight", "output_norm.weight", false},
    {"lm_head.weight", "output.weight", false},       {"norm1.weight", "blk.%d.attn_norm.weight", false},
    {"norm2.weight", "blk.%d.ffn_norm.weight", false}, {"attn.proj.weight", "blk.%d.attn_output.weight", false},
    {"mlp.gate.weight", "blk.%d.ffn_gate.weight", false}, {"mlp.up.weight", "blk.%d.ffn_up.weight", false},
    {"mlp.down.weight", "blk.%d.ffn_down.weight", false},
};

static const kiln__name_pair gguf_qk_norm[] = {
    {"attn.q_head_norm.weight", "blk.%d.attn_q_norm.weight", false},
    {"attn.k_head_norm.weight", "blk.%d.attn_k_norm.weight", false},
};

/* llama.cpp's gpt2 architecture, which has kiln's fused qkv, biases and learned positions */
static const kiln__name_pair gguf_gpt2[] = {
    {"tok_emb.weight", "token_embd.weight", false},     {"pos_emb.weight", "position_embd.weight", false},
    {"norm_f.weight", "output_norm.weight", false},     {"norm_f.bias", "output_norm.bias", false},
    {"lm_head.weight", "output.weight", false},         {"norm1.weight", "blk.%d.attn_norm.weight", false},
    {"norm1.bias", "blk.%d.attn_norm.bias", false},     {"attn.qkv.weight", "blk.%d.attn_qkv.weight", false},
    {"attn.qkv.bias", "blk.%d.attn_qkv.bias", false},   {"attn.proj.weight", "blk.%d.attn_output.weight", false},
    {"attn.proj.bias", "blk.%d.attn_output.bias", false}, {"norm2.weight", "blk.%d.ffn_norm.weight", false},
    {"norm2.bias", "blk.%d.ffn_norm.bias", false},      {"mlp.fc.weight", "blk.%d.ffn_up.weight", false},
    {"mlp.fc.bias", "blk.%d.ffn_up.bias", false},       {"mlp.proj.weight", "blk.%d.ffn_down.weight", false},
    {"mlp.proj.bias", "blk.%d.ffn_down.bias", false},
};

/* ---- the families ---- */

/* What LLaMA, Mistral, Qwen2 and Qwen3 share: RMSNorm, RoPE, SwiGLU, the same config keys
 * (the sliding window turned on by switch_key, or NULL: by its size) and tensor names. */
#define LLAMA_LIKE(switch_key)                                                                                       \
    .norm = KILN_NORM_RMSNORM, .pos = KILN_POS_ROPE, .mlp = KILN_MLP_SWIGLU,                                         \
    .hf = {.n_embd = "hidden_size", .n_layer = "num_hidden_layers", .n_head = "num_attention_heads",                 \
           .n_kv_head = "num_key_value_heads", .head_dim = "head_dim", .ffn = "intermediate_size",                  \
           .vocab = "vocab_size", .context = "max_position_embeddings", .eps = "rms_norm_eps", .act = "hidden_act",   \
           .window = "sliding_window", .window_switch = switch_key},                                                 \
    .ffn_required = true, .eps_default = 1e-6, .act_ok = {"silu"}, .act_why = "kiln's SwiGLU uses silu",             \
    .bias_keys = {"attention_bias", "mlp_bias"}, .must = {{"pretraining_tp", false, 1}},                             \
    .hf_qkv = "model.layers.%d.self_attn.%c_proj.%s", .hf_missing_bias_zero = true,                                  \
    .gguf_qkv = "blk.%d.attn_%c.weight", .gguf_eps = "attention.layer_norm_rms_epsilon"

static const kiln__arch families[] = {
    {.name = "llama", .title = "LLaMA", LLAMA_LIKE(NULL), .exports = true, .hf_class = "LlamaForCausalLM",
     .hf_names = {KILN__NAME_TABLE(hf_llama)}, .gguf_arch = "llama", .gguf_names = {KILN__NAME_TABLE(gguf_llama)},
     .gguf_rope_pairs = true, .gguf_rope_freqs = true},
    {.name = "mistral", .title = "Mistral", LLAMA_LIKE(NULL), .hf_names = {KILN__NAME_TABLE(hf_llama)}},
    {.name = "qwen2", .title = "Qwen2", LLAMA_LIKE("use_sliding_window"), .bias = true,
     .hf_names = {KILN__NAME_TABLE(hf_llama)}, .gguf_arch = "qwen2", .gguf_names = {KILN__NAME_TABLE(gguf_llama)}},
    {.name = "qwen3", .title = "Qwen3", LLAMA_LIKE("use_sliding_window"), .qk_norm = true, .exports = true,
     .hf_class = "Qwen3ForCausalLM", .hf_names = {KILN__NAME_TABLE(hf_llama), KILN__NAME_TABLE(hf_qk_norm)},
     .gguf_arch = "qwen3", .gguf_names = {KILN__NAME_TABLE(gguf_llama), KILN__NAME_TABLE(gguf_qk_norm)}},
    {.name = "gpt2", .title = "GPT-2", .norm = KILN_NORM_LAYERNORM, .pos = KILN_POS_LEARNED, .mlp = KILN_MLP_GELU,
     .bias = true, .tied = true, .kv_equal = true, .exports = true, .hf_class = "GPT2LMHeadModel",
     .hf = {.n_embd = "n_embd", .n_layer = "n_layer", .n_head = "n_head", .ffn = "n_inner", .vocab = "vocab_size",
            .context = "n_positions", .eps = "layer_norm_epsilon", .act = "activation_function"},
     .eps_default = 1e-5, .act_ok = {"gelu_new", "gelu_pytorch_tanh"},
     .act_why = "kiln's GELU is the tanh form, gelu_new",
     .must = {{"scale_attn_by_inverse_layer_idx", true, 0}, {"scale_attn_weights", true, 1}},
     .hf_zero_keys = {"attn_pdrop", "embd_pdrop", "resid_pdrop"}, .hf_names = {KILN__NAME_TABLE(hf_gpt2)},
     .hf_body_prefix = "transformer.", .gguf_arch = "gpt2", .gguf_names = {KILN__NAME_TABLE(gguf_gpt2)},
     .gguf_bias = true, .gguf_eps = "attention.layer_norm_epsilon"},
};

const kiln__arch *kiln__arch_all(size_t *n)
{
    *n = sizeof families / sizeof families[0];
    return families;
}

const kiln__arch *kiln__arch_by_type(const char *type)
{
    for (size_t i = 0; type && i < sizeof families / sizeof families[0]; i++)
        if (!strcmp(families[i].name, type)) return &families[i];
    return NULL;
}

const kiln__arch *kiln__arch_of(const kiln_gpt_config *c)
{
    for (size_t i = 0; i < sizeof families / sizeof families[0]; i++) {
        const kiln__arch *a = &families[i];
        if (a->exports && c->norm == a->norm && c->pos == a->pos && c->mlp == a->mlp && c->qk_norm == a->qk_norm &&
            (!a->kv_equal || (c->n_kv_head == c->n_head && c->bias)))
            return a;
    }
    return NULL;
}

void kiln__arch_config(const kiln__arch *a, kiln_gpt_config *c)
{
    *c = kiln_gpt_config_gpt2();
    c->norm = a->norm, c->pos = a->pos, c->mlp = a->mlp, c->qk_norm = a->qk_norm;
    c->bias = a->bias, c->tied = a->tied;
}

const kiln__name_pair *kiln__arch_lookup(const kiln__name_table *t, const char *name, int *layer, const char **rest)
{
    const kiln__name_pair *e = NULL;
    for (int k = 0; k < 3 && t[k].pairs && !e; k++) e = kiln__name_lookup(t[k].pairs, t[k].n, name, layer, rest);
    if (!e) kiln__name_lookup(t[0].pairs, 0, name, layer, rest); /* (the layer and rest, found or not) */
    return e;
}
