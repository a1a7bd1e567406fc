/* kiln/flex.h — flex attention: attention whose scores and mask are modified by two
 * small expressions, as PyTorch's flex_attention's score_mod and mask_mod are.
 *
 *     kiln_flex_t *f;
 *     kiln_flex_preset("causal+softcap:30", NULL, &f);          // or kiln_flex_new(...)
 *     kiln_tensor_t *lse, *y = kiln_flex_attention(q, k, v, f, NULL, 0, &lse);
 *     kiln_flex_free(f);
 *
 * Modifiers. A score modifier is an expression of the value `score` (a query's scaled
 * dot product with a key) and the indices `b` (batch row), `h` (query head), `q_idx`,
 * `kv_idx` (positions), the lengths `q_len` and `kv_len`, and captured tensors `c0`..`c7`
 * read at indices (`c0[h]`, `c1[b, q_idx]`); it gives the new score. A mask modifier is
 * an expression of the same names but `score`, true where the query may see the key.
 * The language is C's expressions: numbers (integers, or floats with a '.' or an
 * exponent), + - * / (a division is a float's), comparisons, && || !, ?:, parentheses
 * and the functions tanh, exp, log, abs, sqrt, min, max. Integer indices stay
 * integers; a float anywhere makes the operation a float one (the scores' type).
 *
 * Presets (kiln_flex_preset), joined with '+' (both: masks and-ed, score modifiers
 * applied in turn, left first):
 *   causal       q_idx + kv_len - q_len >= kv_idx (a query sees its own position and
 *                those before; as kiln_attention's causal)
 *   window:W     causal, and at most W keys back: q_idx + kv_len - q_len - kv_idx < W
 *   prefix:P     prefix-LM: the first P keys seen by every query, causal after them
 *   doc          document masking for packed sequences: a query sees the keys of its own
 *                document; in->doc_ids (B, T) integers (with causal: "doc+causal")
 *   alibi        ALiBi: score + slope[h] * (kv_idx - (q_idx + kv_len - q_len)), the distance from the
 *                query's position among the keys; in->alibi_slopes (H), else
 *                the standard slopes 2^(-8 (h + 1) / H) for in->heads heads
 *   softcap:C    tanh soft-capping (Gemma 2): C * tanh(score / C)
 * kiln_flex_and / kiln_flex_or join two modifiers (score modifiers in turn; masks
 * and-ed or or-ed).
 *
 * Errors name the expression and the position: an unknown name, a captured tensor that
 * is not given, indices that do not match its dims, `score` in a mask, a syntax error.
 *
 * The computation: fused kernels generated from the modifiers (tiles of an online
 * softmax over the block mask's listed blocks, forward and backward; on the cpu, OpenCL
 * and CUDA: docs/flex.md), or densely with kiln's ops — the (B, H, Tq, Tk) scores, the
 * modifiers evaluated over broadcast index tensors, the masked softmax — which is the
 * reference the fused kernels are checked against, and is taken where they do not run
 * (more than 2 captured tensors, a captured tensor that wants a gradient,
 * KILN_OPT_FLEX_FUSED=0). A query that sees no key gives zeros and a log-sum-exp of
 * -inf, as PyTorch's flex_attention does. */
#ifndef KILN_FLEX_H
#define KILN_FLEX_H

#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_flex kiln_flex_t;

/* score_mod and mask_mod (NULL: none) over captured[0..n_captured) (referenced, kept
 * until kiln_flex_free; at most 8). An expression nests at most KILN_FLEX_MAX_DEPTH
 * parentheses, calls, indices, ?: branches and unary operators deep (its tree is then
 * walked without fear for the stack), and its literals are finite floats. */
#define KILN_FLEX_MAX_DEPTH 256
kiln_status kiln_flex_new(const char *score_mod, const char *mask_mod, kiln_tensor_t *const *captured,
                          int n_captured, kiln_flex_t **out);
void kiln_flex_free(kiln_flex_t *f); /* NULL is fine */

/* What the presets read. */
typedef struct {
    kiln_tensor_t *doc_ids;      /* doc: (B, T) integer document ids */
    kiln_tensor_t *alibi_slopes; /* alibi: (H) slopes; NULL: the standard ones for `heads` */
    int64_t heads;               /* alibi without slopes: the number of query heads */
} kiln_flex_inputs;

/* A preset spec ("causal", "window:256+softcap:30", ...; above); in may be NULL when it
 * names no doc or alibi. */
kiln_status kiln_flex_preset(const char *spec, const kiln_flex_inputs *in, kiln_flex_t **out);
kiln_status kiln_flex_and(const kiln_flex_t *a, const kiln_flex_t *b, kiln_flex_t **out);
kiln_status kiln_flex_or(const kiln_flex_t *a, const kiln_flex_t *b, kiln_flex_t **out);
/* The modifiers as text (for a message or a log): "" when absent. Borrowed. */
const char *kiln_flex_score_text(const kiln_flex_t *f);
const char *kiln_flex_mask_text(const kiln_flex_t *f);

/* The mask's blocks of block x kv_block (query rows, key columns; kv_block 0: block):
 * each (b, h, query block) has a list of its full key blocks and of its partial ones
 * (empty ones skipped); a mask that reads no b (or h) is kept once for every b (or h).
 * Built once and reused across layers and steps. Narrow key blocks waste less at a
 * mask's edges (a sliding window's); the fused kernel multiplies a query block's rows
 * by adjacent key blocks in one GEMM, so they cost no extra calls. */
typedef struct kiln_block_mask kiln_block_mask_t;
/* The block size kiln takes where none is given (a flex call without a block mask, the
 * GPT model's variants): 32 query rows by 32 keys, a whole panel of the cpu's GEMM on
 * AVX-512 (two on AVX2). On the cpu it wastes fewer keys at a mask's edges than 64 and costs no more elsewhere (a T/8
 * window 4-26% faster, causal the same or faster at T 128-4096: docs/perf-log.md). */
#define KILN_FLEX_BLOCK 32
kiln_status kiln_block_mask_new(const kiln_flex_t *f, int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t block,
                                int64_t kv_block, kiln_block_mask_t **out);
void kiln_block_mask_free(kiln_block_mask_t *m);
/* Counts of full, partial and empty blocks (over every b, h kept), and the fraction of
 * (query, key) pairs the mask lets through. */
void kiln_block_mask_stats(const kiln_block_mask_t *m, int64_t *full, int64_t *partial, int64_t *empty,
                           double *density);
/* The blocks of (b, h, query block qb): *n_full then *n_partial key-block indices in
 * kv (capacity cap); false when out of range. */
bool kiln_block_mask_row(const kiln_block_mask_t *m, int64_t b, int64_t h, int64_t qb, int64_t *kv, int64_t cap,
                         int64_t *n_full, int64_t *n_partial);

/* Attention of q (B, H, Tq, D) over k, v (B, Hkv, Tk, D), H a multiple of Hkv, f32 or
 * f64 (or bf16, f16 and f32: computed in f32, autocast or not, the output rounded once
 * to q's type, the log-sum-exp f32, gradients in each input's type), with f's modifiers; bm (may be NULL) must be f's mask for these sizes. scale <= 0
 * means 1/sqrt(D). *lse (may be NULL) gets the (B, H, Tq) log-sum-exp of the modified,
 * masked scores. Inside a captured function bm is a constant of the graph (its blocks
 * as they were at the capture): give the mask as a tensor instead (below). */
kiln_tensor_t *kiln_flex_attention(kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v, const kiln_flex_t *f,
                                   const kiln_block_mask_t *bm, double scale, kiln_tensor_t **lse);

/* The block mask as a tensor: i64 (mB, mH, nq, 4 + nk), mB and mH 1 where the mask reads
 * no b or h; row (b, h, query block) holds its counts of full and partial key blocks,
 * the block sizes, then its key blocks, full ones first. Its shape depends on the sizes
 * only and its blocks are data, so inside a captured or compiled function a new mask of
 * the same sizes runs the same graph (no capture again), and other sizes fail a shape
 * guard and capture again. kiln_flex_block_mask makes f's for these sizes (kv_block 0:
 * block): with captured tensors, by an op on them, so that a captured function computes
 * it from each call's values (document ids from each batch); without, once per sizes and
 * device, kept. It lives on the captured tensors' device (else the default device).
 * Make it once per step and pass it to every layer. kiln_block_mask_tensor writes an
 * existing mask as one (on the cpu). */
kiln_tensor_t *kiln_flex_block_mask(const kiln_flex_t *f, int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t block,
                                    int64_t kv_block);
kiln_tensor_t *kiln_block_mask_tensor(const kiln_block_mask_t *m);
/* Flex attention with the block mask given as such a tensor (NULL: f's, blocks of
 * KILN_FLEX_BLOCK);
 * it is moved to q's device if it is elsewhere (not inside a captured function). A mask
 * whose blocks do not fit the call's sizes is an error naming them. */
kiln_tensor_t *kiln_flex_attention_masked(kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v, const kiln_flex_t *f,
                                          kiln_tensor_t *mask, double scale, kiln_tensor_t **lse);

#ifdef __cplusplus
}
#endif
#endif
