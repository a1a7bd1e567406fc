/* The ops room's columns of the op table (src/core/ops.def): backward formulas and
 * decompositions, with the autograd node they read. The schema columns that dispatch
 * needs are in src/core/op_table.h. */
#ifndef KILN_OPS_REGISTRY_H
#define KILN_OPS_REGISTRY_H

#include "core/op_table.h"

/* A recorded op, kept for backward. */
typedef struct kiln__node kiln__node;
struct kiln__node {
    atomic_int refcount;
    kiln__op_id op;
    kiln__attrs attrs;
    int n_in, n_out;
    kiln__meta *in_meta;         /* [n_in] */
    kiln__meta out_meta[KILN__MAX_OUT];
    kiln_tensor_t **saved_in;    /* [n_in], detached aliases, or NULL if not saved */
    kiln_tensor_t *saved_out[KILN__MAX_OUT];
    bool *needs_grad;            /* [n_in] */
    kiln__node **next;           /* [n_in] the node that made input i, or NULL */
    int *next_out;               /* [n_in] which output of next[i] */
    kiln_tensor_t **leaf;        /* [n_in] input i if it is a leaf that wants a gradient */
    /* Used by the backward engine. */
    kiln_tensor_t *grad_out[KILN__MAX_OUT];
    int pending;
    bool visited;
    bool spent; /* backward ran and freed what it saved */
    kiln__node *release_next; /* the list of nodes being released (autograd.c), which needs no memory */
};

/* Computes gin[i] for each input with needs_grad[i] (others left NULL), from gout[j]
 * (NULL where output j got no gradient). Written with kiln ops. */
typedef kiln_status (*kiln__backward_fn)(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin);

/* The op written with simpler ops (for the compiler); NULL for primitives. */
typedef kiln_status (*kiln__decompose_fn)(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                          kiln_tensor_t **out);

/* Each op's backward formula (NULL for an op that is not differentiable), rendered
 * from ops.def's grad column (src/ops/registry.c). */
extern const kiln__backward_fn kiln__op_backward[KILN_OP_COUNT];
/* The custom ops' columns (src/ops/custom.c): the backward formula that calls the op's
 * own (NULL when it has none) and its decomposition (NULL when it gave none). */
kiln__backward_fn kiln__custom_backward(int op);
kiln__decompose_fn kiln__custom_decomposition(int op, kiln_tensor_t *const *in, int n_in, bool all);
/* The expression of a custom pointwise op (kiln/op.h's expr), NULL for any other op. */
const char *kiln__custom_expr(int op);
/* That expression as code: x<i> replaced by names[i], a<k> by the value of attribute k
 * in a (a float constant, or an integer for an i64 one). A new string (the caller frees
 * it); NULL when out of memory. */
char *kiln__custom_expr_text(int op, const char *const *names, int n_names, const kiln__attrs *a);
/* Op's backward formula, built-in or custom (NULL: not differentiable). */
static inline kiln__backward_fn kiln__backward_of(int op)
{
    return kiln__op_is_custom(op) ? kiln__custom_backward(op) : kiln__op_backward[op];
}

/* The op's decomposition into primitives (src/ops/decompose.c), or NULL: for a
 * primitive, and for an op best left whole on these inputs (all: every op that has a
 * decomposition takes it, KILN_COMPILE_DECOMPOSE=all). */
kiln__decompose_fn kiln__decomposition(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                       bool all);

#define KILN_OP(ID, name, kind, nin, nout, nvis, writes, grad, save, amp) \
    kiln_status kiln__bw_##name(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin);
#include "core/ops.def"
#undef KILN_OP

#endif
