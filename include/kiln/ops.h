/* kiln/ops.h — tensor operations and reverse-mode autograd.
 *
 * A worked example (one gradient step on a linear model):
 *
 *     kiln_tensor_set_requires_grad(w, true);
 *     kiln_scope_begin();
 *     kiln_tensor_t *pred = kiln_matmul(x, w);                 // (N,K) @ (K,1)
 *     kiln_tensor_t *loss = kiln_mean(kiln_square(kiln_sub(pred, y)), NULL, 0, false);
 *     if (kiln_backward(loss) != KILN_OK) fprintf(stderr, "%s\n", kiln_last_error());
 *     kiln_scope_end();
 *     // kiln_tensor_grad(w) now holds d loss / d w
 *
 * Every op returns a new tensor (see the ownership rule in kiln/tensor.h) or NULL with
 * the reason in kiln_last_error(). Binary ops broadcast like NumPy. Dims may be
 * negative (counted from the end). Views (reshape, permute, slice, expand, ...) share
 * storage with their input.
 */
#ifndef KILN_OPS_H
#define KILN_OPS_H

#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Pointwise. */
kiln_tensor_t *kiln_add(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_sub(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_mul(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_div(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_pow(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_maximum(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_minimum(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_add_scalar(kiln_tensor_t *a, double s);
kiln_tensor_t *kiln_mul_scalar(kiln_tensor_t *a, double s);
kiln_tensor_t *kiln_pow_scalar(kiln_tensor_t *a, double p);
kiln_tensor_t *kiln_square(kiln_tensor_t *a);
/* approximate = true: the tanh form; false: the exact erf form. */
kiln_tensor_t *kiln_gelu(kiln_tensor_t *a, bool approximate);
/* The pointwise ops defined by their math (kiln/pointwise.def lists them: neg, abs, exp,
 * log, sqrt, rsqrt, tanh, sigmoid, relu, silu, softplus): kiln_<name>(x). */
#define KILN_PW(ID, name, ...) kiln_tensor_t *kiln_##name(kiln_tensor_t *a);
#include "kiln/pointwise.def"
#undef KILN_PW
kiln_tensor_t *kiln_where(kiln_tensor_t *cond, kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_cast(kiln_tensor_t *a, kiln_dtype dt);

/* Mixed precision (autocast), as PyTorch's torch.autocast: between kiln_autocast_begin(dt)
 * and kiln_autocast_end() on this thread, each op runs in the type its precision policy
 * (a column of the op table) names, and its float inputs are cast to it first:
 *   KILN_AMP_LOW  in dt (bf16 or f16): matmul (and so kiln_linear), grouped_matmul and
 *                 attention; their f32, f16 and bf16 inputs are cast to dt, products
 *                 summed in f32;
 *   KILN_AMP_F32  in f32: softmax, log_softmax, layer_norm, rms_norm, cross_entropy and
 *                 sum (and so mean, var, logsumexp); f16 and bf16 inputs are cast up;
 *   KILN_AMP_ANY  in its inputs' types, promoted as always (everything else).
 * f64 inputs are never cast. The casts are ops like any other: autograd records them
 * (a gradient comes back in its input's type, so f32 weights get f32 gradients), graph
 * capture records them. kiln_backward runs without autocast, as PyTorch's does. Regions
 * nest (at most 8 deep); kiln_autocast_begin(KILN_DTYPE_F32) starts one that casts
 * nothing. Errors: a dt other than bf16, f16 or f32 (KILN_ERR_DTYPE); a region 9 deep
 * (KILN_ERR_UNSUPPORTED); an end without a begin (KILN_ERR_ARG). */
typedef enum { KILN_AMP_ANY, KILN_AMP_LOW, KILN_AMP_F32 } kiln_amp_policy;
kiln_status kiln_autocast_begin(kiln_dtype dt);
kiln_status kiln_autocast_end(void);
/* This thread's autocast type; KILN_DTYPE_F32 outside any region. */
kiln_dtype kiln_autocast_dtype(void);
/* Op i's policy (i < kiln_op_count(); KILN_AMP_ANY for another i), and a process-wide
 * override of an op's policy by its name (kiln_op_name); an unknown name is an error
 * that names it, and so is LOW or F32 for cast or for an op that writes or aliases its
 * inputs. Overrides are set-up: make them before other threads run ops. */
kiln_amp_policy kiln_op_amp_policy(int op);
kiln_status kiln_op_set_amp_policy(const char *op, kiln_amp_policy p);
const char *kiln_amp_policy_name(kiln_amp_policy p); /* "low", "f32", "any" */

/* Comparisons give bool tensors. */
kiln_tensor_t *kiln_eq(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_ne(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_lt(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_le(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_gt(kiln_tensor_t *a, kiln_tensor_t *b);
kiln_tensor_t *kiln_ge(kiln_tensor_t *a, kiln_tensor_t *b);

/* Reductions over dims (dims = NULL or ndims = 0: over all dims). */
kiln_tensor_t *kiln_sum(kiln_tensor_t *a, const int *dims, int ndims, bool keepdim);
kiln_tensor_t *kiln_mean(kiln_tensor_t *a, const int *dims, int ndims, bool keepdim);
kiln_tensor_t *kiln_max(kiln_tensor_t *a, const int *dims, int ndims, bool keepdim);
/* Variance with Bessel's correction `correction` (0: population, 1: sample). */
kiln_tensor_t *kiln_var(kiln_tensor_t *a, const int *dims, int ndims, int correction, bool keepdim);
kiln_tensor_t *kiln_logsumexp(kiln_tensor_t *a, const int *dims, int ndims, bool keepdim);
/* Index of the largest element along dim (i64); the first one on ties. */
kiln_tensor_t *kiln_argmax(kiln_tensor_t *a, int dim, bool keepdim);
kiln_tensor_t *kiln_softmax(kiln_tensor_t *a, int dim);
kiln_tensor_t *kiln_log_softmax(kiln_tensor_t *a, int dim);

/* (..., M, K) @ (..., K, N) -> (..., M, N), batch dims broadcast; 1-D operands are
 * treated as a row (a) or a column (b) vector and that dim is dropped, as in NumPy. */
kiln_tensor_t *kiln_matmul(kiln_tensor_t *a, kiln_tensor_t *b);

/* Indexing. Index tensors are i32 or i64; an index out of range is KILN_ERR_INDEX. */
kiln_tensor_t *kiln_embedding(kiln_tensor_t *weight, kiln_tensor_t *idx); /* (V,C),(...) -> (...,C) */
kiln_tensor_t *kiln_index_select(kiln_tensor_t *a, int dim, kiln_tensor_t *idx);
kiln_tensor_t *kiln_gather(kiln_tensor_t *a, int dim, kiln_tensor_t *idx);
/* A copy of a with src added at idx along dim (out[..idx[i]..] += src[..i..]). */
kiln_tensor_t *kiln_scatter_add(kiln_tensor_t *a, int dim, kiln_tensor_t *idx, kiln_tensor_t *src);

/* Normalisation over the last dim. weight and bias may be NULL. */
kiln_tensor_t *kiln_layer_norm(kiln_tensor_t *x, kiln_tensor_t *weight, kiln_tensor_t *bias, double eps);
kiln_tensor_t *kiln_rms_norm(kiln_tensor_t *x, kiln_tensor_t *weight, double eps);

/* Mean cross-entropy of logits (N,V) against class targets (N) (i32/i64); targets equal
 * to ignore_index are left out of the mean. Fused: softmax is never returned. */
kiln_tensor_t *kiln_cross_entropy(kiln_tensor_t *logits, kiln_tensor_t *targets, int64_t ignore_index);
/* Zeroes each element with probability p and scales the rest by 1/(1-p); identity when
 * train is false or p is 0. */
kiln_tensor_t *kiln_dropout(kiln_tensor_t *a, double p, bool train);

/* Joining and splitting. */
kiln_tensor_t *kiln_cat(kiln_tensor_t *const *ts, int n, int dim);
kiln_tensor_t *kiln_stack(kiln_tensor_t *const *ts, int n, int dim);
/* Splits into n pieces of sizes[i] along dim; out[i] are views. */
kiln_status kiln_split(kiln_tensor_t *a, const int64_t *sizes, int n, int dim, kiln_tensor_t **out);
/* Lower / upper triangle of the last two dims, diagonal k. */
kiln_tensor_t *kiln_tril(kiln_tensor_t *a, int64_t k);
kiln_tensor_t *kiln_triu(kiln_tensor_t *a, int64_t k);

/* Rotary position embedding of x (B,H,T,D), D even, rotating pairs (i, i + D/2) by
 * (pos0 + t) * theta^(-2i/D), as in GPT-NeoX and LLaMA. */
kiln_tensor_t *kiln_rope(kiln_tensor_t *x, int64_t pos0, double theta);

/* RoPE scaling: frequencies changed so that a model reaches past the context it was
 * first trained on, as Hugging Face's rope_scaling names them. LINEAR divides every
 * frequency by factor (positions interpolated). LLAMA3 (LLaMA 3.1) divides the low
 * frequencies, whose wavelength 2pi/f is longer than original_context /
 * low_freq_factor, by factor, keeps the high ones, shorter than original_context /
 * high_freq_factor, and blends between: f * ((1 - s) / factor + s) with s =
 * (original_context / wavelength - low_freq_factor) / (high_freq_factor -
 * low_freq_factor). A zeroed struct is NONE. */
typedef enum { KILN_ROPE_SCALING_NONE, KILN_ROPE_SCALING_LINEAR, KILN_ROPE_SCALING_LLAMA3 } kiln_rope_scaling_kind;
typedef struct {
    kiln_rope_scaling_kind kind;
    double factor;                            /* LINEAR, LLAMA3: > 0 */
    double low_freq_factor, high_freq_factor; /* LLAMA3: 0 < low < high */
    int original_context;                     /* LLAMA3: > 0 */
} kiln_rope_scaling;
/* Checks the fields the kind uses; the message names the first that is wrong. NULL is
 * NONE. */
kiln_status kiln_rope_scaling_check(const kiln_rope_scaling *s);
/* The D/2 frequencies of pairs i = 0..D/2-1: theta^(-2i/D), then scaled. Computed in
 * f32 as LLaMA's and transformers' references do. */
kiln_status kiln_rope_frequencies(double theta, int64_t D, const kiln_rope_scaling *s, float *freq);
/* kiln_rope with scaled frequencies (s NULL: none). Differentiable like kiln_rope. */
kiln_tensor_t *kiln_rope_scaled(kiln_tensor_t *x, int64_t pos0, double theta, const kiln_rope_scaling *s);
/* Scaled dot-product attention: q (B,H,Tq,D), k and v (B,Hkv,Tk,D) with H a multiple of
 * Hkv (grouped-query heads). causal: query i sees keys j <= i + (Tk - Tq). scale <= 0
 * means 1/sqrt(D). One op: the (B,H,Tq,Tk) scores are never held in memory at once. */
kiln_tensor_t *kiln_attention(kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v, bool causal,
                              double scale);

/* Mixture-of-experts routing: choose experts per token, group the tokens by expert, and
 * multiply each group by its expert's weight in one op. A top-k MoE FFN reads:
 *
 *     kiln_topk(router_logits, k, &val, &idx);     // (N,E) -> (N,k), (N,k) i64
 *     kiln_moe_sort(idx, E, &order, &offsets);     // (N*k) i64, (E+1) i64
 *     xs = kiln_index_select(xk, 0, order);        // xk (N*k,C): row n*k+j is x[n]
 *     h  = kiln_grouped_matmul(xs, w1, offsets);   // (N*k,C) x (E,C,F) -> (N*k,F)
 *
 * kiln_topk: the k largest elements along the last dim of a float tensor x (..., E)
 * (1 <= k <= E), in descending order: values (..., k) of x's dtype, indices (..., k) i64.
 * Ties are broken by the lower index first, on every backend and in every process: of
 * equal values the one at the lower index comes first, and is chosen when only one of
 * them fits. NaN counts as larger than every number (as PyTorch's); -0 equals +0.
 * Differentiable in x: the gradient of values goes to the chosen positions, zero
 * elsewhere. (torch.topk does not promise an order for ties: compare against a
 * reference with this rule, not against it.)
 *
 * kiln_moe_sort: a stable grouping of the assignments in indices (N, k) (i32 or i64,
 * read in row-major order: assignment a = n*k + j chose expert indices[n][j]) by expert:
 * order (N*k) i64 lists the assignment numbers a expert by expert, expert 0 first, each
 * expert's in ascending order of a; offsets (E+1) i64 holds the running counts
 * (offsets[0] = 0, offsets[E] = N*k), so expert e's assignments are order[offsets[e] ..
 * offsets[e+1]-1]. An index outside [0, E) is KILN_ERR_INDEX naming it. Not
 * differentiable.
 *
 * kiln_grouped_matmul: x (M, K) and w (E, K, N) of one float type, offsets (E+1) i32 or
 * i64: rows offsets[e] .. offsets[e+1]-1 of x times w[e], (M, N); rows before offsets[0]
 * or from offsets[E] on (no expert's) are zero. One op for all the experts: offsets is
 * read when the kernel runs, so the counts are data, not shapes, and a compiled graph
 * runs again without recompiling when they change. Offsets that fall, or leave [0, M],
 * are KILN_ERR_INDEX when it runs. Differentiable in x and w; under autocast it runs in
 * the reduced type as matmul does. */
kiln_status kiln_topk(kiln_tensor_t *x, int64_t k, kiln_tensor_t **values, kiln_tensor_t **indices);
kiln_status kiln_moe_sort(kiln_tensor_t *indices, int64_t n_experts, kiln_tensor_t **order, kiln_tensor_t **offsets);
kiln_tensor_t *kiln_grouped_matmul(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *offsets);

/* Serving (inference only, not differentiable).
 * kiln_rope_at: rope of x (N,H,D) where row n sits at position pos[n] (pos (N) i32/i64),
 * the same rotation as kiln_rope.
 * kiln_paged_attention: attention of each new token over its own sequence's keys and
 * values, kept in pages. q (N,H,D); k_pages, v_pages (S,Hkv,D) where slot s holds one
 * position (slot = block * block_len + offset); block_table (n_seqs, max_blocks) i32;
 * seq_pos (N,2) i32 gives each query row's sequence and position p: the row attends to
 * positions 0..p of its sequence, found at slot block_table[seq][j / block_len] *
 * block_len + j % block_len. scale <= 0 means 1/sqrt(D). Result (N,H,D); each row is
 * computed alone, so it does not depend on which other rows share the call. */
/* kiln_matmul_rows: a (M,K) times w (N,K) transposed, (M,N), f32, where every element is
 * one chain of multiply-adds over k = 0..K-1 in order: row m depends on a[m] and w
 * alone, never on M or on the other rows (a BLAS picks other kernels for other M, which
 * round differently). The serving engine's linear layers use it so that a request's
 * tokens do not depend on what it is batched with. It packs w on every call; to use w
 * again, pack it once (kiln_matmul_rows_pack: panels of 16 of its rows, each stored
 * k-major, (ceil(N/16), K, 16), zero-padded) and call kiln_matmul_rows_packed, with n =
 * w's row count N. The results are the same bits either way. */
kiln_tensor_t *kiln_matmul_rows(kiln_tensor_t *a, kiln_tensor_t *w);
#define KILN_ROWS_PANEL 16
kiln_tensor_t *kiln_matmul_rows_pack(kiln_tensor_t *w);
/* w (N,K) kept in ggml's q8_0 blocks (K a multiple of 32): each row quantized exactly as
 * llama.cpp's quantizer does (per 32 values d = amax/127 stored as f16, q = round(x/d)),
 * so weights that came from a Q8_0 GGUF file re-pack to the file's own blocks. Layout, a
 * u8 tensor (ceil(N/16), K/32, KILN_ROWS_Q8_BYTES): per panel of 16 rows and k-block of
 * 32, the 16 rows' f16 scales (32 bytes), then for each group g of 4 k (8 of them) the
 * 16 rows' 4 int8 values (64 bytes): row j's values k = 4g..4g+3 at 32 + 64 g + 4 j.
 * 1.0625 bytes a weight. kiln_matmul_rows_packed on it quantizes each row of a once to
 * q8_0 blocks (d = amax/127, roundf) and sums per block an exact int32 dot product,
 * then over the blocks in order in f32, acc = fmaf((float)dot, d_w * d_a, acc): the same
 * bits whatever M, the thread split or the kernel (plain C, AVX2). */
#define KILN_ROWS_Q8_BLOCK 32
#define KILN_ROWS_Q8_BYTES (KILN_ROWS_PANEL * (2 + KILN_ROWS_Q8_BLOCK))
kiln_tensor_t *kiln_matmul_rows_pack_q8_0(kiln_tensor_t *w);
kiln_tensor_t *kiln_matmul_rows_packed(kiln_tensor_t *a, kiln_tensor_t *w_packed, int64_t n);
kiln_tensor_t *kiln_rope_at(kiln_tensor_t *x, kiln_tensor_t *pos, double theta);
kiln_tensor_t *kiln_rope_at_scaled(kiln_tensor_t *x, kiln_tensor_t *pos, double theta, const kiln_rope_scaling *s);
kiln_tensor_t *kiln_paged_attention(kiln_tensor_t *q, kiln_tensor_t *k_pages, kiln_tensor_t *v_pages,
                                    kiln_tensor_t *block_table, kiln_tensor_t *seq_pos, int64_t block_len,
                                    double scale);
/* The same with a model's attention variant, as the flex presets of kiln/flex.h define
 * them: a row at position p sees positions max(0, p - window + 1)..p (window 0: all);
 * its scores s (after the scale) become softcap tanh(s / softcap) (softcap 0: none); with
 * alibi, head h adds slope_h (j - p), slope_h = 2^(-8 (h + 1) / H), before the soft cap
 * or after it (alibi_after_softcap). Only the window's positions are read: block table
 * entries of the blocks wholly before it are not looked at (the serving engine frees
 * them). A zero variant is kiln_paged_attention, bit for bit. */
typedef struct {
    int64_t window;
    double softcap;
    bool alibi, alibi_after_softcap;
} kiln_paged_variant;
kiln_tensor_t *kiln_paged_attention_variant(kiln_tensor_t *q, kiln_tensor_t *k_pages, kiln_tensor_t *v_pages,
                                            kiln_tensor_t *block_table, kiln_tensor_t *seq_pos, int64_t block_len,
                                            double scale, const kiln_paged_variant *variant);

/* Views. reshape/view take -1 for one inferred dim; reshape copies when a view cannot
 * express the result, view fails instead. */
kiln_tensor_t *kiln_reshape(kiln_tensor_t *a, const int64_t *shape, int ndim);
kiln_tensor_t *kiln_view(kiln_tensor_t *a, const int64_t *shape, int ndim);
kiln_tensor_t *kiln_permute(kiln_tensor_t *a, const int *order, int ndim);
kiln_tensor_t *kiln_transpose(kiln_tensor_t *a, int d0, int d1);
kiln_tensor_t *kiln_slice(kiln_tensor_t *a, int dim, int64_t start, int64_t end, int64_t step);
kiln_tensor_t *kiln_narrow(kiln_tensor_t *a, int dim, int64_t start, int64_t length);
kiln_tensor_t *kiln_expand(kiln_tensor_t *a, const int64_t *shape, int ndim);
kiln_tensor_t *kiln_squeeze(kiln_tensor_t *a, int dim);
kiln_tensor_t *kiln_unsqueeze(kiln_tensor_t *a, int dim);
kiln_tensor_t *kiln_contiguous(kiln_tensor_t *a);
/* A new tensor with the same data that is not part of any autograd graph. */
kiln_tensor_t *kiln_detach(kiln_tensor_t *a);
kiln_tensor_t *kiln_clone(kiln_tensor_t *a);

/* In-place updates, for optimizers and gradient bookkeeping. They refuse a tensor
 * that autograd is tracking while grad mode is on. */
kiln_status kiln_add_(kiln_tensor_t *dst, kiln_tensor_t *src, double alpha); /* dst += alpha*src */
kiln_status kiln_mul_scalar_(kiln_tensor_t *dst, double s);
kiln_status kiln_fill_(kiln_tensor_t *dst, double value);
/* dst[index[i]] = src[i] along dim 0 (index (n) i32/i64, src (n, ...) like dst's rows). */
kiln_status kiln_index_copy_(kiln_tensor_t *dst, kiln_tensor_t *index, kiln_tensor_t *src);
/* One AdamW step on p with gradient g and moments m, v (all f32, same shape):
 * bias-corrected with step t >= 1; decoupled weight decay wd. Not inside a graph
 * capture (lr and t would be frozen into it): use kiln_adamw_step_ there. */
kiln_status kiln_adamw_(kiln_tensor_t *p, kiln_tensor_t *g, kiln_tensor_t *m, kiln_tensor_t *v,
                        double lr, double beta1, double beta2, double eps, double wd, int64_t t);
/* The same with the per-step values in one-element f32/f64 tensors, read when the update
 * runs, so that a captured graph takes them afresh each run: learning rate lr, step
 * count step (>= 1) and gscale, by which the gradient is multiplied first (a clipping
 * coefficient, kiln_clip_coef; a tensor holding 1 for none). */
kiln_status kiln_adamw_step_(kiln_tensor_t *p, kiln_tensor_t *g, kiln_tensor_t *m, kiln_tensor_t *v, kiln_tensor_t *lr,
                             kiln_tensor_t *step, kiln_tensor_t *gscale, double beta1, double beta2, double eps,
                             double wd);

/* Autograd. */
void kiln_tensor_set_requires_grad(kiln_tensor_t *t, bool on);
/* (Tracking a tensor gives it autograd's state; out of memory, it stays untracked and
 * kiln_last_error says so.) */
bool kiln_tensor_requires_grad(const kiln_tensor_t *t);
/* The accumulated gradient of a leaf, or NULL; borrowed. */
kiln_tensor_t *kiln_tensor_grad(const kiln_tensor_t *t);
void kiln_tensor_zero_grad(kiln_tensor_t *t); /* drops the gradient */
/* Gradients of the one-element tensor `root` flow into every leaf that requires grad,
 * adding to what those leaves already hold. The graph is freed afterwards. */
kiln_status kiln_backward(kiln_tensor_t *root);
/* Same, seeded with grad (the shape of root) instead of 1. */
kiln_status kiln_backward_with(kiln_tensor_t *root, kiln_tensor_t *grad);
/* Called during this thread's kiln_backward as soon as a leaf's gradient is whole (every
 * edge of the graph that reaches it has added its part), with that leaf; a non-OK
 * status stops the backward. NULL removes the hook. Data-parallel training starts each
 * gradient bucket's reduction from here while backward goes on. */
typedef kiln_status (*kiln_grad_ready_fn)(void *ctx, kiln_tensor_t *leaf);
void kiln_set_grad_ready_hook(kiln_grad_ready_fn fn, void *ctx);
bool kiln_grad_enabled(void);
/* Sets grad mode for this thread and returns the previous mode. */
bool kiln_set_grad_enabled(bool on);

#ifdef __cplusplus
}
#endif
#endif
