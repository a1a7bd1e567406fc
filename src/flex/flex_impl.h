/* Private pieces of flex attention (kiln/flex.h) shared by flex.c (the expressions, the
 * presets, the block mask, the dense computation) and flex_gen.c (the fused kernels
 * generated from the expressions). */
#ifndef KILN_FLEX_IMPL_H
#define KILN_FLEX_IMPL_H

#include <stdbool.h>
#include <stdint.h>
#include "core/op_table.h"
#include "kiln/flex.h"

#define MAX_CAPTURED 8
#define MAX_NODES 512

/* ---- the expression tree ---- */

typedef enum { A_NUM, A_NAME, A_CAP, A_NEG, A_NOT, A_BIN, A_TERN, A_CALL } akind;
typedef enum { V_SCORE, V_B, V_H, V_Q, V_KV, V_QLEN, V_KVLEN, N_VARS } var;
extern const char *const kiln__flex_var_names[N_VARS];
typedef enum { F_TANH, F_EXP, F_LOG, F_ABS, F_SQRT, F_MIN, F_MAX, N_FNS } fn;
extern const char *const kiln__flex_fn_names[N_FNS];
/* binary operators, by their text */
typedef enum { B_ADD, B_SUB, B_MUL, B_DIV, B_LT, B_LE, B_GT, B_GE, B_EQ, B_NE, B_AND, B_OR } binop;

typedef struct {
    akind kind;
    int op;        /* A_NAME: var; A_CAP: captured index; A_BIN: binop; A_CALL: fn */
    double num;
    bool integer;  /* A_NUM written without '.' or exponent */
    int n_arg, arg[4];
} anode;

typedef struct {
    anode n[MAX_NODES];
    int count, root;
    const char *text, *p, *what; /* what: "score_mod" or "mask_mod" */
    int depth;                   /* the parser's nesting, at most KILN_FLEX_MAX_DEPTH */
    kiln_status err;
} parser;

/* The language's type of a captured tensor's elements: 0 bool, 1 integer, 2 float. */
static inline int kiln__flex_elem_type(kiln_dtype dt)
{
    return dt == KILN_DTYPE_BOOL ? 0 : kiln_dtype_is_float(dt) ? 2 : 1;
}

struct kiln_flex {
    char *score, *mask; /* "" when absent */
    parser *ps[2];      /* their trees (NULL when absent) */
    kiln_tensor_t *cap[MAX_CAPTURED];
    int n_cap;
    bool vars[2][N_VARS], caps[2][MAX_CAPTURED];
};

struct kiln_block_mask {
    int64_t B, H, Tq, Tk, block, kv_block, nq, nk; /* B, H: 1 when the mask reads no b (h) */
    int64_t full, partial, empty, seen;  /* counts, and the (query, key) pairs let through */
    /* for each (b, h, qb): its full key blocks then its partial ones, at row[r]...;
     * n_full[r], n_partial[r] */
    int32_t *n_full, *n_partial;
    int64_t *start, *kv;
};


/* Flex attention of f fused (flex_gen.c), where it runs: on the cpu, OpenCL or CUDA (f32
 * rows of up to 256 there), with at most 2 captured tensors, none wanting a gradient.
 * Through two custom ops (the forward and its backward, each with a kernel for the three),
 * so autograd records it; y and lse (scoped) filled and *ran true. *ran
 * false: not taken (the dense path runs); an error is a failure of a kernel's build or
 * of a captured index. */
kiln_status kiln__flex_fused(const kiln_flex_t *f, kiln_tensor_t *mask, kiln_tensor_t *q, kiln_tensor_t *k,
                             kiln_tensor_t *v, double scale, kiln_tensor_t **y, kiln_tensor_t **lse, bool *ran);

/* The block mask as a tensor (kiln_flex_block_mask): KILN__MASK_HEAD words at the head
 * of each row (full and partial counts, block, kv_block), then its key blocks. pack
 * writes m's rows into w; unpack reads rows of a tensor of this shape for a call's
 * sizes into a new mask, checking every word (an error names the first bad one). */
#define KILN__MASK_HEAD 4
kiln_status kiln__block_mask_pack(const kiln_block_mask_t *m, int64_t *w);
kiln_status kiln__block_mask_unpack(const int64_t *w, const int64_t *shape, int64_t B, int64_t H, int64_t Tq,
                                    int64_t Tk, kiln_block_mask_t **out);

/* The block mask's counts from a generated classifier (flex_gen.c), where it runs (the
 * cpu, FLEX_FUSED, at most 2 captured tensors): on[((b * mH + h) * nq + qb) * nk + kb]
 * the pairs of each block the mask lets through, in O(blocks) memory; *ran false: not
 * taken. */
kiln_status kiln__flex_classify(const kiln_flex_t *f, int64_t mB, int64_t mH, int64_t Tq, int64_t Tk, int64_t block,
                                int64_t kv_block, int64_t *on, bool *ran);

/* The source of f's fused kernels for a device (f32): OpenCL C, or CUDA C (cuda); the
 * forward's (flex_fwd_dev), or the backward's (backward: flex_bwd_dq_dev and
 * flex_bwd_dkv_dev). A new string (the caller frees it); NULL when out of memory. */
char *kiln__flex_device_source(const kiln_flex_t *f, bool cuda, bool backward);

#endif
