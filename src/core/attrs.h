/* Attributes of one op call: a fixed-size plain struct so that it can be copied into an
 * autograd node, compared and hashed (zero it before filling it). */
#ifndef KILN_OPS_ATTRS_H
#define KILN_OPS_ATTRS_H

#include <stdbool.h>
#include <stdint.h>
#include "kiln/tensor.h"

/* Typed attributes, one struct per op that has them (in kiln__attrs.op); the other ops
 * still use the positional slots that ops.def's comment lists. */
typedef struct {
    double weight_decay, beta1, beta2, eps;
} kiln__adamw_attrs; /* ADAMW_ */

typedef struct {
    double scale; /* of the scores, q.k * scale */
    bool causal;
} kiln__attention_attrs; /* ATTENTION, ATTENTION_BACKWARD */

typedef struct {
    double theta;   /* the frequencies' base */
    int64_t pos0;   /* ROPE: the position of the first row */
    bool inverse;   /* ROPE: rotate backwards (its backward) */
} kiln__rope_attrs; /* ROPE, ROPE_AT */

typedef struct {
    double eps;
} kiln__norm_attrs; /* LAYER_NORM, RMS_NORM and their backward ops */

typedef struct {
    int64_t ignore_index;
} kiln__cross_entropy_attrs; /* CROSS_ENTROPY, CROSS_ENTROPY_BACKWARD */

typedef struct {
    double p; /* the probability of zeroing (the random stream is u[0..1], as RAND's) */
} kiln__dropout_attrs; /* DROPOUT */

typedef struct {
    int64_t dim; /* normalized: 0 .. ndim - 1 */
} kiln__dim_attrs; /* SOFTMAX, LOG_SOFTMAX, ARGMAX, INDEX_SELECT, GATHER, SCATTER_ADD, CAT */

typedef struct {
    kiln_dtype dtype;
} kiln__cast_attrs; /* CAST */

typedef struct {
    int64_t k; /* the diagonal: 0 the main one, > 0 above */
    bool upper;
} kiln__tri_attrs; /* TRI */

typedef struct {
    int64_t dim, start, step, length;
} kiln__slice_attrs; /* SLICE */

typedef struct {
    bool tanh; /* the tanh approximation, else the erf form */
} kiln__gelu_attrs; /* GELU, GELU_BACKWARD */

typedef struct {
    int64_t shape[KILN_MAX_DIMS]; /* a shape, or a list of dims */
    int ndim;                     /* entries used in shape */
    int64_t i[4];                 /* op-specific integers (see ops.def) */
    double f[2];                  /* op-specific reals */
    uint64_t u[2];                /* random seed and counter offset */
    bool keepdim;
    union {
        kiln__adamw_attrs adamw;
        kiln__attention_attrs attention;
        kiln__rope_attrs rope;
        kiln__norm_attrs norm;
        kiln__cross_entropy_attrs cross_entropy;
        kiln__dropout_attrs dropout;
        kiln__dim_attrs dim;
        kiln__cast_attrs cast;
        kiln__tri_attrs tri;
        kiln__slice_attrs slice;
        kiln__gelu_attrs gelu;
    } op;
} kiln__attrs;

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

#endif
