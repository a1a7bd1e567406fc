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
