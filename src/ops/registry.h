/* The op registry: one entry per op in ops.def. */
#ifndef KILN_OPS_REGISTRY_H
#define KILN_OPS_REGISTRY_H

#include "core/tensor_impl.h"
#include "ops/attrs.h"

#define KILN__SI(i) (1u << (i))
#define KILN__SO(j) (1u << (8 + (j)))
#define KILN__MAX_OUT 4

typedef enum {
#define KILN_OP(ID, name, nin, nout, nvis, grad, save) KILN_OP_##ID,
#include "ops/ops.def"
#undef KILN_OP
    KILN_OP_COUNT
} kiln__op_id;

/* Fills out[0..n_out) with the output shapes and dtypes, or returns an error that names
 * the op, the shapes and dtypes. View ops also fill stride and offset (relative to
 * input 0's storage). */
typedef kiln_status (*kiln__infer_fn)(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                      kiln__meta *out);

/* A recorded op, kept for backward. */
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

typedef struct {
    const char *name;
    int n_in, n_out, n_visible;
    unsigned save;
    bool is_view;
    bool is_inplace;
    kiln__infer_fn infer;
    kiln__backward_fn backward;
} kiln__op_def;

extern const kiln__op_def kiln__ops[KILN_OP_COUNT];
/* The op's decomposition into primitives (src/ops/decompose.c), or NULL: for a
 * primitive, and for an op best left whole on these inputs (all: every op that has a
 * decomposition takes it, KILN_COMPILE_DECOMPOSE=all). */
kiln__decompose_fn kiln__decomposition(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                       bool all);

/* The inputs an op writes, as a bit mask: none for an out-of-place op, the destination
 * (input 0) for an in-place one, and for adamw_ the two moments (inputs 2, 3) too. */
static inline unsigned kiln__written_inputs(kiln__op_id op)
{
    return !kiln__ops[op].is_inplace ? 0u : op == KILN_OP_ADAMW_ ? 0xDu : 1u;
}

/* ALLREDUCE_'s u[1]: the group's entries for it (the group is u[0], the reduce op
 * i[0]), in place on t. run returns when it is done. start begins it and hands out
 * *work (NULL when it already ran to the end), which progress lets advance without
 * waiting and finish waits for and frees: a compiled program starts the collective
 * where its input is ready and finishes it before the first step that touches that
 * memory again (src/compile/overlap.c). finish is called once for every work handed
 * out, also after an error; *posted then says whether the collective was left
 * unfinished (a failed group), so that t must outlive the process's use of it. */
typedef struct {
    kiln_status (*run)(void *group, kiln_tensor_t *t, int op);
    kiln_status (*start)(void *group, kiln_tensor_t *t, int op, void **work);
    kiln_status (*progress)(void *work);
    kiln_status (*finish)(void *work, bool *posted);
} kiln__collective_ops;

/* REDUCE_SCATTER_'s and ALLGATHER_'s u[1]: runs the collective on group from src into dst. */
typedef kiln_status (*kiln__collective2_fn)(void *group, kiln_tensor_t *dst, kiln_tensor_t *src, int op);

/* What a CHECK_MIN checks (its i[0]), naming it in the error. */
enum { KILN__CHECK_VALUE, KILN__CHECK_ADAMW_STEP, KILN__CHECK_CE_TARGET /* f[1] = V */ };

#define KILN_OP(ID, name, nin, nout, nvis, grad, save)                                 \
    kiln_status kiln__infer_##name(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, \
                                   kiln__meta *out);                                    \
    kiln_status kiln__bw_##name(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin);
#include "ops/ops.def"
#undef KILN_OP

/* Runs op on its inputs' backend: checks, infers, allocates, launches, records for
 * autograd. out[] receives n_out new references (the caller keeps or frees them). */
kiln_status kiln__dispatch(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                           kiln_tensor_t **out);
/* Dispatch returning the first output registered with the scope (NULL on error);
 * hidden outputs are dropped. */
kiln_tensor_t *kiln__call(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a);

/* Shape helpers shared by inference and backward. */
kiln_status kiln__broadcast_shapes(const char *op, int n, kiln_tensor_t *const *ts, kiln__meta *out);
int kiln__norm_dim(int dim, int ndim);
/* Sums g down to shape (undoing broadcasting); a new scoped tensor. */
kiln_tensor_t *kiln__sum_to(kiln_tensor_t *g, const int64_t *shape, int ndim);
kiln_dtype kiln__promote(kiln_dtype a, kiln_dtype b);

#endif
