/* Private layout of tensors and storage. */
#ifndef KILN_CORE_TENSOR_IMPL_H
#define KILN_CORE_TENSOR_IMPL_H
#include <string.h>

#include <stdatomic.h>
#include "kiln/tensor.h"
#include "core/backend.h"

#define KILN__EXT_SLOTS 4

typedef struct {
    atomic_int refcount;
    kiln__backend *be;
    void *data;
    size_t nbytes;
    bool meta; /* a traced tensor (captured into a graph): shape and dtype, no data */
    struct kiln__pool *pool; /* allocated while a replay was being recorded (src/core/alloc.c) */
    /* memory of someone else's (kiln_tensor_wrap): handed back by release(release_ctx)
     * when the last reference goes, instead of to the cache */
    void (*release)(void *ctx);
    void *release_ctx;
    bool wrapped;
} kiln__storage;

/* A replay's private memory (src/core/alloc.c). While this thread records a replay
 * (kiln__pool_begin), every storage it frees is kept by the pool instead of going back
 * to the shared cache, and its allocations reuse those first, so the recorded kernels'
 * buffers stay theirs, in the order they were used, until the pool is released. */
typedef struct kiln__pool kiln__pool;
kiln__pool *kiln__pool_new(void);
void kiln__pool_begin(kiln__pool *p); /* this thread records into p */
void kiln__pool_end(void);
/* The replay is gone: the pool's blocks go back to the cache, and storages from it
 * released later go there too. */
void kiln__pool_release(kiln__pool *p);

struct kiln_tensor {
    atomic_int refcount;
    kiln__storage *st;
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    int64_t stride[KILN_MAX_DIMS]; /* in elements */
    int64_t offset;                /* in elements */
    /* One pointer per room that keeps state on tensors (src/core/intercept.h): autograd's
     * gradient state, the graph value a captured tensor stands for. */
    void *ext[KILN__EXT_SLOTS];
};

/* Shape and dtype of a tensor before it exists (used by shape inference). */
typedef struct {
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    int64_t stride[KILN_MAX_DIMS]; /* views only */
    int64_t offset;                /* views only */
} kiln__meta;

/* Are two shapes the same (rank and sizes)? */
static inline bool kiln__same_shape(int na, const int64_t *a, int nb, const int64_t *b)
{
    return na == nb && !memcmp(a, b, sizeof(int64_t) * (size_t)na);
}

/* m = t's dtype, shape, strides and offset (zero past ndim). */
void kiln__meta_of(const kiln_tensor_t *t, kiln__meta *m);
/* A new tensor with fresh contiguous storage on be (uninitialised). */
kiln_tensor_t *kiln__tensor_alloc(kiln__backend *be, kiln_dtype dt, const int64_t *shape, int ndim);
/* A new tensor header sharing st (which gains a reference). */
kiln_tensor_t *kiln__tensor_alias(kiln__storage *st, kiln_dtype dt, int ndim, const int64_t *shape,
                                  const int64_t *stride, int64_t offset);
/* Registers a new reference with the innermost scope, if any; returns t. */
kiln_tensor_t *kiln__scoped(kiln_tensor_t *t);
/* Where every reference to t is the innermost scope's, takes them all out of it and
 * leaves t with one, the caller's; else false, nothing changed. */
bool kiln__scope_take_all(kiln_tensor_t *t);
int64_t kiln__numel(int ndim, const int64_t *shape);
void kiln__contiguous_strides(int ndim, const int64_t *shape, int64_t *stride);
bool kiln__is_contiguous(const kiln_tensor_t *t);
/* Do two tensors' elements share bytes (of one storage)? */
bool kiln__tensors_overlap(const kiln_tensor_t *a, const kiln_tensor_t *b);
/* Do two views of one storage with this shape and these strides (elements), at offsets
 * off_a and off_b, share an element? Exact when the strides nest (each larger than the
 * span of the smaller ones, as in any slice of a dense tensor), else true. */
bool kiln__strided_overlap(int ndim, const int64_t *shape, const int64_t *stride, int64_t off_a, int64_t off_b);
/* Do two views of one storage (shapes, strides, offsets in elements) share an element?
 * Exact for one shape and one set of nesting strides (kiln__strided_overlap), else true. */
bool kiln__views_overlap(int nda, const int64_t *shape_a, const int64_t *stride_a, int64_t off_a, int ndb,
                         const int64_t *shape_b, const int64_t *stride_b, int64_t off_b);
/* May two elements of one view share an address (an expand's stride 0, or strides that
 * do not nest)? */
bool kiln__strided_overlap_self(int ndim, const int64_t *shape, const int64_t *stride);
void kiln__storage_release(kiln__storage *st);
/* Pointer to the first element of t (host-addressable backends only). */
static inline void *kiln__data(const kiln_tensor_t *t)
{
    return (char *)t->st->data + t->offset * (int64_t)kiln_dtype_size(t->dtype);
}
/* "f32[2,3]" */
const char *kiln__shape_str(const kiln_tensor_t *t, char *buf, size_t n);
const char *kiln__meta_str(const kiln__meta *m, char *buf, size_t n);

/* Errors: set the thread's last error and return status (the public kiln_error, under
 * the library's internal name). */
#define kiln__err kiln_error

/* For a NULL tensor argument: keeps the error that made it NULL (ops return NULL on
 * failure, so chains pass it along), else reports "op: a tensor argument is NULL". */
kiln_status kiln__null_arg(const char *op);

/* n bytes from address src on sbe to dst on dbe (through the host between devices). */
kiln_status kiln__copy_across(kiln__backend *dbe, void *dst, kiln__backend *sbe, const void *src, size_t n);

/* Library state. */
void kiln__ensure_init(void);

#endif
