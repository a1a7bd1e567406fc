/* Attributes of one op call: a fixed-size plain struct so that it can be copied into an
 * autograd node, compared and hashed (zero it before filling it). Each op's own
 * attributes are a typed struct in the union `op`; the shape-like ones (a reduction's
 * dims, a view's or a source op's shape) and a random op's stream are shared fields. */
#ifndef KILN_OPS_ATTRS_H
#define KILN_OPS_ATTRS_H

#include <stdbool.h>
#include <stdint.h>
#include "kiln/ops.h"
#include "kiln/op.h"

/* Typed attributes, one struct per op (or family of ops) that has them. */
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
    kiln_rope_scaling scaling;
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
    int op;                /* the custom op's id (its row, src/ops/custom.c) */
    int n;                 /* values given */
    kiln_op_value v[8];    /* in its declared order */
} kiln__custom_attrs; /* a custom op (kiln/op.h) */

/* The source ops' shape is kiln__attrs.shape/ndim; RAND's random stream is u[0..1]. */
typedef struct {
    kiln_dtype dtype;
    double value;       /* FULL */
    double start, step; /* ARANGE: element i is start + i * step */
    bool normal;        /* RAND: normal, else uniform in [0, 1) */
} kiln__source_attrs; /* FULL, ARANGE, RAND */

typedef struct {
    double value; /* ADD_'s alpha, SCALE_'s factor, FILL_'s value */
} kiln__scalar_attrs; /* ADD_, SCALE_, FILL_ */

typedef struct {
    double min;      /* an element below it (or NaN) fails */
    int what;        /* what is checked, for the message (KILN__CHECK_*) */
    int64_t classes; /* KILN__CHECK_CE_TARGET: the vocabulary size */
} kiln__check_attrs; /* CHECK_MIN */

typedef struct {
    int64_t vocab; /* rows of the gradient */
} kiln__embedding_backward_attrs; /* EMBEDDING_BACKWARD */

typedef struct {
    int64_t cols; /* n, the weight's rows before packing */
} kiln__rows_packed_attrs; /* MATMUL_ROWS_PACKED */

typedef struct {
    int64_t block_len;
    double scale;
    kiln_paged_variant v; /* window, soft-capping, ALiBi (kiln_paged_attention_variant) */
} kiln__paged_attention_attrs; /* PAGED_ATTENTION */

typedef struct {
    int64_t k; /* how many of the largest, 1 .. the last dim */
} kiln__topk_attrs; /* TOPK */

typedef struct {
    int64_t n_experts; /* E: indices lie in [0, E), offsets has E + 1 entries */
} kiln__moe_sort_attrs; /* MOE_SORT */

typedef struct {
    void *group;     /* the process group (the backends know nothing of groups) */
    const void *ops; /* ALLREDUCE_: its kiln__collective_ops; the others: a kiln__collective2_fn */
    int reduce;      /* the reduce op */
    int world;       /* ALL_TO_ALL: the group's size, the length of its counts */
    int64_t rows;    /* ALL_TO_ALL: the rows of its output */
} kiln__collective_attrs; /* ALLREDUCE_, REDUCE_SCATTER_, ALLGATHER_, ALL_TO_ALL */

typedef struct {
    int64_t shape[KILN_MAX_DIMS]; /* a shape, or a list of dims */
    int ndim;                     /* entries used in shape */
    uint64_t u[2];                /* RAND's and DROPOUT's random stream: seed and counter offset */
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
        kiln__source_attrs source;
        kiln__scalar_attrs scalar;
        kiln__check_attrs check;
        kiln__embedding_backward_attrs embedding_backward;
        kiln__rows_packed_attrs rows_packed;
        kiln__paged_attention_attrs paged_attention;
        kiln__collective_attrs collective;
        kiln__topk_attrs topk;
        kiln__moe_sort_attrs moe_sort;
        kiln__custom_attrs custom;
    } op;
} kiln__attrs;

/* ALLREDUCE_'s op.collective.ops: the group's entries for it (the group is
 * op.collective.group, the reduce op op.collective.reduce), in place on t. run returns when it is done. start begins it and hands out
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

/* REDUCE_SCATTER_'s and ALLGATHER_'s op.collective.ops: runs the collective on group
 * from src into dst. */
typedef kiln_status (*kiln__collective2_fn)(void *group, kiln_tensor_t *dst, kiln_tensor_t *src, int op);

/* ALL_TO_ALL's op.collective.ops: the exchange on group, x (R, ...) and send_counts
 * (world) i64 contiguous into y (rows, ...) and recv_counts (world) i64. */
typedef kiln_status (*kiln__all_to_all_fn)(void *group, kiln_tensor_t *x, kiln_tensor_t *send_counts, kiln_tensor_t *y,
                                           kiln_tensor_t *recv_counts);

/* What a CHECK_MIN checks (its op.check.what), naming it in the error. */
enum { KILN__CHECK_VALUE, KILN__CHECK_ADAMW_STEP, KILN__CHECK_CE_TARGET /* op.check.classes = V */ };

#endif
