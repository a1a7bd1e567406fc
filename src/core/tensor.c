/* Tensor headers, reference counting, scopes, and the data-moving entry points. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/dtype.h"
#include "kiln/ops.h"
#include "core/tensor_impl.h"
#include "core/intercept.h"
#include "core/rng.h"
#include "core/util.h"

int64_t kiln__numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

void kiln__contiguous_strides(int ndim, const int64_t *shape, int64_t *stride)
{
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        s *= shape[i] > 0 ? shape[i] : 1;
    }
}

bool kiln__is_contiguous(const kiln_tensor_t *t)
{
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s) return false;
        s *= t->shape[i];
    }
    return true;
}

void kiln__meta_of(const kiln_tensor_t *t, kiln__meta *m)
{
    *m = (kiln__meta){.dtype = t->dtype, .ndim = t->ndim, .offset = t->offset};
    memcpy(m->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    memcpy(m->stride, t->stride, sizeof(int64_t) * (size_t)t->ndim);
}

kiln_tensor_t *kiln__tensor_alias(kiln__storage *st, kiln_dtype dt, int ndim, const int64_t *shape,
                                  const int64_t *stride, int64_t offset)
{
    kiln_tensor_t *t = malloc(sizeof *t);
    if (!t) return kiln__err(KILN_ERR_OOM, "out of memory allocating a tensor header"), NULL;
    *t = (kiln_tensor_t){.refcount = 1, .st = st, .dtype = dt, .ndim = ndim, .offset = offset};
    atomic_fetch_add(&st->refcount, 1);
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        t->stride[i] = stride[i];
    }
    return t;
}

kiln_tensor_t *kiln_tensor_retain(kiln_tensor_t *t)
{
    if (t) atomic_fetch_add(&t->refcount, 1);
    return t;
}

void kiln_tensor_free(kiln_tensor_t *t)
{
    if (!t || atomic_fetch_sub(&t->refcount, 1) != 1) return;
    kiln__ext_release_all(t);
    kiln__storage_release(t->st);
    free(t);
}

/* Scopes: a per-thread stack of growable lists of references. */
typedef struct {
    kiln_tensor_t **items;
    int n;
    size_t cap;
} scope;

/* The first FIXED_SCOPES levels live in the thread's own array, so that opening a scope
 * never fails there; deeper ones in a heap array. A scope that cannot be opened for want
 * of memory is counted in lost_scopes (and said as an error): what it would have held
 * goes to the scope around it, and its end is a no-op. */
#define FIXED_SCOPES 16
static _Thread_local scope fixed_scopes[FIXED_SCOPES];
static _Thread_local scope *scopes = NULL; /* fixed_scopes or a heap array; NULL at depth 0 */
static _Thread_local int n_scopes, lost_scopes;
static _Thread_local size_t cap_scopes;

void kiln_scope_begin(void)
{
    if (!scopes) scopes = fixed_scopes, cap_scopes = FIXED_SCOPES;
    if ((size_t)n_scopes == cap_scopes) {
        size_t cap = cap_scopes * 2;
        scope *grown = scopes == fixed_scopes ? malloc(cap * sizeof *grown) : realloc(scopes, cap * sizeof *grown);
        if (!grown) {
            lost_scopes++;
            kiln__err(KILN_ERR_OOM, "out of memory opening a scope %d deep: its tensors go to the one around it",
                      n_scopes + 1);
            return;
        }
        if (scopes == fixed_scopes) memcpy(grown, fixed_scopes, sizeof fixed_scopes);
        scopes = grown, cap_scopes = cap;
    }
    scopes[n_scopes++] = (scope){0};
}

void kiln_scope_end(void)
{
    if (lost_scopes > 0) {
        lost_scopes--;
        return;
    }
    if (n_scopes == 0) return;
    scope *s = &scopes[--n_scopes];
    for (int i = s->n; i-- > 0;) kiln_tensor_free(s->items[i]);
    free(s->items);
    if (n_scopes == 0) { /* the outermost scope: a thread that ends now leaves nothing behind */
        if (scopes != fixed_scopes) free(scopes);
        scopes = NULL;
        cap_scopes = 0;
    }
}

kiln_tensor_t *kiln__scoped(kiln_tensor_t *t)
{
    if (!t || n_scopes == 0) return t;
    scope *s = &scopes[n_scopes - 1];
    void *tmp;
    if (!KILN__GROW(s->items, s->n, &s->cap, 64, tmp)) {
        kiln_tensor_free(t);
        return kiln__err(KILN_ERR_OOM, "out of memory growing a scope"), NULL;
    }
    s->items[s->n++] = t;
    return t;
}

bool kiln__scope_take_all(kiln_tensor_t *t)
{
    scope *s = n_scopes ? &scopes[n_scopes - 1] : NULL;
    int held = 0;
    for (int i = 0; s && i < s->n; i++) held += s->items[i] == t;
    if (held == 0 || held != atomic_load(&t->refcount)) return false;
    for (int i = s->n; i-- > 0;)
        if (s->items[i] == t) s->items[i] = s->items[--s->n];
    atomic_fetch_sub(&t->refcount, held - 1);
    return true;
}

kiln_tensor_t *kiln_keep(kiln_tensor_t *t)
{
    if (!t) return NULL;
    for (int k = n_scopes - 1; k >= 0; k--) {
        scope *s = &scopes[k];
        for (int i = s->n; i-- > 0;) {
            if (s->items[i] == t) {
                s->items[i] = s->items[--s->n];
                return t;
            }
        }
    }
    return t; /* not in a scope: the caller owned it already */
}

kiln_status kiln__check_indices(const char *op, const void *idx, kiln_dtype dt, int64_t n, int64_t limit,
                                const int64_t *ignore, int64_t *count)
{
    size_t sz = kiln_dtype_size(dt);
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = kiln__load_index((const char *)idx + i * (int64_t)sz, dt);
        if (ignore && v == *ignore) continue;
        if (v >= 0 && v < limit) {
            c++;
            continue;
        }
        if (ignore)
            return kiln__err(KILN_ERR_INDEX, "%s: target %lld at row %lld is outside [0, %lld) (and is not "
                             "ignore_index %lld)", op, (long long)v, (long long)i, (long long)limit, (long long)*ignore);
        return kiln__err(KILN_ERR_INDEX, "%s: index %lld at position %lld is outside [0, %lld)", op, (long long)v,
                         (long long)i, (long long)limit);
    }
    if (count) *count = c;
    return KILN_OK;
}

kiln_status kiln__check_offsets(const char *op, const int64_t *off, int64_t n, int64_t M)
{
    const char *hint = "offsets must rise from 0 or more to at most M, x's rows, as kiln_moe_sort makes them";
    for (int64_t i = 0; i < n; i++) {
        if (off[i] < 0)
            return kiln__err(KILN_ERR_INDEX, "%s: offsets[%lld] = %lld is negative (%s)", op, (long long)i,
                             (long long)off[i], hint);
        if (i > 0 && off[i] < off[i - 1])
            return kiln__err(KILN_ERR_INDEX, "%s: offsets[%lld] = %lld is below offsets[%lld] = %lld (%s)", op,
                             (long long)i, (long long)off[i], (long long)(i - 1), (long long)off[i - 1], hint);
        if (off[i] > M)
            return kiln__err(KILN_ERR_INDEX, "%s: offsets[%lld] = %lld is beyond M = %lld (%s)", op, (long long)i,
                             (long long)off[i], (long long)M, hint);
    }
    return KILN_OK;
}

/* Properties. */
int kiln_tensor_ndim(const kiln_tensor_t *t) { return t ? t->ndim : 0; }
const int64_t *kiln_tensor_shape(const kiln_tensor_t *t) { return t ? t->shape : NULL; }
const int64_t *kiln_tensor_strides(const kiln_tensor_t *t) { return t ? t->stride : NULL; }
int64_t kiln_tensor_numel(const kiln_tensor_t *t) { return t ? kiln__numel(t->ndim, t->shape) : 0; }
size_t kiln_tensor_nbytes(const kiln_tensor_t *t)
{
    return t ? (size_t)kiln_tensor_numel(t) * kiln_dtype_size(t->dtype) : 0;
}
kiln_dtype kiln_tensor_dtype(const kiln_tensor_t *t) { return t ? t->dtype : KILN_DTYPE_F32; }
bool kiln_tensor_is_contiguous(const kiln_tensor_t *t) { return t && kiln__is_contiguous(t); }

int64_t kiln_tensor_dim(const kiln_tensor_t *t, int i)
{
    if (!t) return 0;
    if (i < 0) i += t->ndim;
    return i >= 0 && i < t->ndim ? t->shape[i] : 0;
}

static const char *shape_str(kiln_dtype dt, int ndim, const int64_t *shape, char *buf, size_t n)
{
    size_t k = (size_t)snprintf(buf, n, "%s[", kiln_dtype_name(dt));
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

const char *kiln__shape_str(const kiln_tensor_t *t, char *buf, size_t n)
{
    return t ? shape_str(t->dtype, t->ndim, t->shape, buf, n) : "(null)";
}

const char *kiln__meta_str(const kiln__meta *m, char *buf, size_t n)
{
    return shape_str(m->dtype, m->ndim, m->shape, buf, n);
}

const char *kiln_tensor_describe(const kiln_tensor_t *t, char *buf, size_t n)
{
    return kiln__shape_str(t, buf, n);
}

/* Creation through the op table, so that every backend makes its own constants. */
static kiln_status check_shape(const char *op, const int64_t *shape, int ndim, kiln_dtype dt)
{
    if (ndim < 0 || ndim > KILN_MAX_DIMS)
        return kiln__err(KILN_ERR_ARG, "%s: ndim %d is outside 0..%d", op, ndim, KILN_MAX_DIMS);
    if (ndim > 0 && !shape) return kiln__err(KILN_ERR_ARG, "%s: shape is NULL", op);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0) return kiln__err(KILN_ERR_SHAPE, "%s: dim %d has negative size %lld", op, i, (long long)shape[i]);
    if ((unsigned)dt >= KILN_DTYPE_COUNT) return kiln__err(KILN_ERR_DTYPE, "%s: unknown dtype %d", op, (int)dt);
    return KILN_OK;
}

static kiln_tensor_t *creation(kiln__op_id op, const char *name, const int64_t *shape, int ndim,
                               kiln_dtype dt, kiln__attrs *a)
{
    if (check_shape(name, shape, ndim, dt) != KILN_OK) return NULL;
    a->ndim = ndim;
    for (int i = 0; i < ndim; i++) a->shape[i] = shape[i];
    a->op.source.dtype = dt;
    return kiln__call(op, NULL, 0, a);
}

kiln_tensor_t *kiln_empty(const int64_t *shape, int ndim, kiln_dtype dt)
{
    kiln__ensure_init();
    if (check_shape("empty", shape, ndim, dt) != KILN_OK) return NULL;
    return kiln__scoped(kiln__tensor_alloc(kiln__backend_default(), dt, shape, ndim));
}

kiln_tensor_t *kiln_full(const int64_t *shape, int ndim, double value, kiln_dtype dt)
{
    kiln__attrs a = {.op.source.value = value};
    return creation(KILN_OP_FULL, "full", shape, ndim, dt, &a);
}

kiln_tensor_t *kiln_full_like(const kiln_tensor_t *t, double value, kiln_dtype dt)
{
    if (!t) return kiln__null_arg("full_like"), NULL;
    kiln__backend *was = kiln__backend_here(t->st->be);
    kiln_tensor_t *r = kiln_full(t->shape, t->ndim, value, dt);
    kiln__backend_here(was);
    return r;
}

kiln_tensor_t *kiln_zeros(const int64_t *shape, int ndim, kiln_dtype dt) { return kiln_full(shape, ndim, 0, dt); }
kiln_tensor_t *kiln_ones(const int64_t *shape, int ndim, kiln_dtype dt) { return kiln_full(shape, ndim, 1, dt); }
kiln_tensor_t *kiln_scalar(double value, kiln_dtype dt) { return kiln_full(NULL, 0, value, dt); }

kiln_tensor_t *kiln_arange(double start, double end, double step, kiln_dtype dt)
{
    if (step == 0 || (end - start) / step < 0)
        return kiln__err(KILN_ERR_ARG, "arange: step %g cannot go from %g to %g", step, start, end), NULL;
    kiln__attrs a = {.op.source.start = start, .op.source.step = step};
    int64_t n = (int64_t)((end - start) / step);
    if (start + (double)n * step != end && (end - start) / step > (double)n) n++;
    return creation(KILN_OP_ARANGE, "arange", &n, 1, dt, &a);
}

static kiln_tensor_t *random_tensor(const int64_t *shape, int ndim, kiln_dtype dt, bool normal)
{
    if (!kiln_dtype_is_float(dt))
        return kiln__err(KILN_ERR_DTYPE, "%s: dtype %s is not a float dtype", normal ? "randn" : "rand",
                         kiln_dtype_name(dt)), NULL;
    if (check_shape("rand", shape, ndim, dt) != KILN_OK) return NULL;
    kiln__attrs a = {.op.source.normal = normal};
    a.u[1] = kiln__rng_take((uint64_t)kiln__numel(ndim, shape), &a.u[0]);
    return creation(KILN_OP_RAND, "rand", shape, ndim, dt, &a);
}

kiln_tensor_t *kiln_rand(const int64_t *shape, int ndim, kiln_dtype dt) { return random_tensor(shape, ndim, dt, false); }
kiln_tensor_t *kiln_randn(const int64_t *shape, int ndim, kiln_dtype dt) { return random_tensor(shape, ndim, dt, true); }

kiln_tensor_t *kiln_from_data(const void *data, const int64_t *shape, int ndim, kiln_dtype dt)
{
    kiln__ensure_init();
    if (check_shape("from_data", shape, ndim, dt) != KILN_OK) return NULL;
    /* Filled before it joins a scope, so that a failed copy can free it. */
    kiln_tensor_t *t = kiln__tensor_alloc(kiln__backend_default(), dt, shape, ndim);
    if (!t) return NULL;
    if (kiln_tensor_from_host_(t, data, kiln_tensor_nbytes(t)) != KILN_OK) {
        kiln_tensor_free(t);
        return NULL;
    }
    return kiln__scoped(t);
}

kiln_tensor_t *kiln_tensor_wrap(void *data, const int64_t *shape, int ndim, kiln_dtype dt, void (*release)(void *ctx),
                                void *ctx)
{
    kiln__ensure_init();
    if (check_shape("tensor_wrap", shape, ndim, dt) != KILN_OK) return NULL;
    if (!data || (uintptr_t)data % kiln_dtype_size(dt))
        return kiln__err(KILN_ERR_ARG, "tensor_wrap: data %p must be non-NULL and aligned to %zu bytes", data,
                         kiln_dtype_size(dt)), NULL;
    kiln__storage *st = malloc(sizeof *st);
    if (!st) return kiln__err(KILN_ERR_OOM, "tensor_wrap: out of memory"), NULL;
    *st = (kiln__storage){.be = kiln__backend_find("cpu"), .data = data, .wrapped = true,
                          .nbytes = (size_t)kiln__numel(ndim, shape) * kiln_dtype_size(dt)};
    atomic_init(&st->refcount, 0);
    int64_t stride[KILN_MAX_DIMS];
    kiln__contiguous_strides(ndim, shape, stride);
    kiln_tensor_t *t = kiln__tensor_alias(st, dt, ndim, shape, stride, 0); /* the storage's one reference */
    if (!t) free(st);
    /* the release only once the tensor stands (a failing scope frees it): on an error
     * it is not called, and the memory stays the caller's */
    if (t && (t = kiln__scoped(t))) {
        st->release = release;
        st->release_ctx = ctx;
    }
    return t;
}

/* What a copy between t and host memory at ptr checks first (write: into t). */
static kiln_status host_copy_check(const kiln_tensor_t *t, const void *ptr, size_t nbytes, bool write)
{
    const char *what = write ? "from_host" : "to_host";
    if (!t) return kiln__null_arg(what);
    kiln_status s = kiln__intercept_data_access(t, what);
    if (s != KILN_OK) return s;
    if (nbytes != kiln_tensor_nbytes(t))
        return kiln__err(KILN_ERR_ARG, "%s: %zu bytes %s, the tensor holds %zu", what, nbytes, write ? "given" : "of room",
                         kiln_tensor_nbytes(t));
    if (nbytes && !ptr) return kiln__err(KILN_ERR_ARG, "%s: %s is NULL", what, write ? "source" : "destination");
    return KILN_OK;
}

kiln_status kiln_tensor_from_host_(kiln_tensor_t *t, const void *src, size_t nbytes)
{
    kiln_status s = host_copy_check(t, src, nbytes, true);
    if (s != KILN_OK) return s;
    if (!kiln__is_contiguous(t))
        return kiln__err(KILN_ERR_ARG, "from_host: the tensor is not contiguous (write into a contiguous copy)");
    return nbytes ? kiln__be_copy_h2d(t->st->be, kiln__data(t), src, nbytes) : KILN_OK;
}

kiln_status kiln_tensor_to_host(const kiln_tensor_t *t, void *dst, size_t nbytes)
{
    kiln_status s = host_copy_check(t, dst, nbytes, false);
    if (s != KILN_OK) return s;
    if (!nbytes) return KILN_OK;
    kiln_tensor_t *c = kiln__dense((kiln_tensor_t *)t);
    s = c ? kiln__be_copy_d2h(c->st->be, dst, kiln__data(c), nbytes) : kiln_last_status();
    kiln_tensor_free(c);
    return s;
}

const char *kiln_tensor_device(const kiln_tensor_t *t) { return t ? t->st->be->name : NULL; }

/* n bytes from one backend's address to another's, through the host unless one side is
 * the host itself (the cpu backend). */
kiln_status kiln__copy_across(kiln__backend *dbe, void *dst, kiln__backend *sbe, const void *src, size_t n)
{
    kiln__backend *cpu = kiln__backend_at(0);
    if (!n) return KILN_OK;
    if (dbe == sbe) return kiln__be_copy_d2d(dbe, dst, src, n);
    if (sbe == cpu) return kiln__be_copy_h2d(dbe, dst, src, n);
    if (dbe == cpu) return kiln__be_copy_d2h(sbe, dst, src, n);
    void *tmp = malloc(n);
    if (!tmp) return kiln__err(KILN_ERR_OOM, "copy from %s to %s: out of host memory for %zu bytes", sbe->name, dbe->name, n);
    kiln_status s = kiln__be_copy_d2h(sbe, tmp, src, n);
    if (s == KILN_OK) s = kiln__be_copy_h2d(dbe, dst, tmp, n);
    free(tmp);
    return s;
}

kiln_tensor_t *kiln_tensor_to(kiln_tensor_t *t, const char *device)
{
    if (!t) return kiln__null_arg("tensor_to"), NULL;
    kiln__backend *be = kiln__backend_find(device);
    if (!be) return kiln_set_device(device), NULL; /* the error that lists the devices */
    if (t->st->meta)
        return kiln__err(KILN_ERR_UNSUPPORTED, "tensor_to: moving a tensor that is being captured into a graph; move it "
                         "before the captured function"), NULL;
    if (t->st->be == be) return kiln__scoped(kiln_tensor_retain(t));
    if (kiln__intercept_data_access(t, "tensor_to") != KILN_OK) return NULL;
    kiln_tensor_t *c = kiln__dense(t), *out = c ? kiln__tensor_alloc(be, t->dtype, t->shape, t->ndim) : NULL;
    bool ok = out && kiln__copy_across(be, kiln__data(out), c->st->be, kiln__data(c), kiln_tensor_nbytes(c)) == KILN_OK;
    kiln_tensor_free(c);
    if (!ok) {
        kiln_tensor_free(out);
        return NULL;
    }
    return kiln__scoped(out);
}

kiln_status kiln_tensor_item(const kiln_tensor_t *t, double *out)
{
    if (!t) return kiln__null_arg("item");
    kiln_status st = kiln__intercept_data_access(t, "item");
    if (st != KILN_OK) return st;
    char buf[96];
    if (kiln_tensor_numel(t) != 1)
        return kiln__err(KILN_ERR_SHAPE, "item: tensor %s has %lld elements, not 1", kiln__shape_str(t, buf, sizeof buf),
                         (long long)kiln_tensor_numel(t));
    unsigned char v[8];
    kiln_status s = kiln__be_copy_d2h(t->st->be, v, kiln__data(t), kiln_dtype_size(t->dtype));
    if (s == KILN_OK) *out = kiln__load(v, t->dtype);
    return s;
}

kiln_status kiln_tensor_copy_(kiln_tensor_t *dst, const kiln_tensor_t *src)
{
    if (!dst || !src) return kiln__null_arg("copy_");
    kiln_tensor_t *in[2] = {dst, (kiln_tensor_t *)src};
    return kiln__dispatch(KILN_OP_COPY_, in, 2, &(kiln__attrs){0}, NULL);
}

/* The elements' byte range [lo, hi) of a tensor in its storage. */
static void byte_span(const kiln_tensor_t *t, int64_t *lo, int64_t *hi)
{
    int64_t sz = (int64_t)kiln_dtype_size(t->dtype), a = t->offset, b = t->offset;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] == 0) {
            *lo = *hi = 0;
            return;
        }
        int64_t e = (t->shape[d] - 1) * t->stride[d];
        if (e < 0) a += e;
        else b += e;
    }
    *lo = a * sz;
    *hi = (b + 1) * sz;
}

/* Is delta = sum k_i stride[ord[i]] for i >= i0 with |k_i| < shape? With nested strides
 * the smaller dims reach at most rest[i] either way, so only the two multiples of this
 * stride around delta can leave a remainder they reach. */
static bool offset_reachable(const int64_t *shape, const int64_t *stride, const int *ord, const int64_t *rest, int n,
                             int i, int64_t delta)
{
    if (i == n) return delta == 0;
    int64_t s = stride[ord[i]], sh = shape[ord[i]];
    int64_t k0 = delta >= 0 ? delta / s : -((-delta + s - 1) / s); /* floor */
    for (int64_t k = k0; k <= k0 + 1; k++) {
        int64_t r = delta - k * s;
        if (k > -sh && k < sh && r <= rest[i] && -r <= rest[i] &&
            offset_reachable(shape, stride, ord, rest, n, i + 1, r))
            return true;
    }
    return false;
}

/* The dims of a view that step, by stride, largest first, in ord[0..*n), and how far the
 * dims after each reach (rest). Returns 1 when the strides nest (each past the reach of
 * the smaller ones: every element at its own address), 0 when the view is empty, -1
 * otherwise (a stride 0 or below, or strides that interleave). */
static int nest_order(int ndim, const int64_t *shape, const int64_t *stride, int *ord, int64_t *rest, int *n)
{
    *n = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 0) return 0;
        if (shape[d] == 1) continue;
        if (stride[d] <= 0) return -1;
        int j = (*n)++;
        for (; j > 0 && stride[ord[j - 1]] < stride[d]; j--) ord[j] = ord[j - 1];
        ord[j] = d;
    }
    int64_t span = 0;
    for (int i = *n - 1; i >= 0; i--) {
        if (stride[ord[i]] <= span) return -1;
        rest[i] = span;
        span += (shape[ord[i]] - 1) * stride[ord[i]];
    }
    return 1;
}

bool kiln__strided_overlap(int ndim, const int64_t *shape, const int64_t *stride, int64_t off_a, int64_t off_b)
{
    int ord[KILN_MAX_DIMS], n;
    int64_t rest[KILN_MAX_DIMS];
    int k = nest_order(ndim, shape, stride, ord, rest, &n);
    if (k <= 0) return k < 0;
    /* An element of one is an element of the other when the offset between them is
     * whole steps, fewer than each dim's size either way. */
    return offset_reachable(shape, stride, ord, rest, n, 0, off_b - off_a);
}

bool kiln__strided_overlap_self(int ndim, const int64_t *shape, const int64_t *stride)
{
    int ord[KILN_MAX_DIMS], n;
    int64_t rest[KILN_MAX_DIMS];
    return nest_order(ndim, shape, stride, ord, rest, &n) < 0;
}

bool kiln__tensors_overlap(const kiln_tensor_t *a, const kiln_tensor_t *b)
{
    if (a->st != b->st) return false;
    int64_t alo, ahi, blo, bhi;
    byte_span(a, &alo, &ahi);
    byte_span(b, &blo, &bhi);
    if (!(alo < bhi && blo < ahi && alo < ahi && blo < bhi)) return false;
    /* Interleaved spans: two slices of one tensor on one dim share none. */
    return a->dtype != b->dtype || kiln__views_overlap(a->ndim, a->shape, a->stride, a->offset, b->ndim, b->shape,
                                                       b->stride, b->offset);
}

bool kiln__views_overlap(int nda, const int64_t *shape_a, const int64_t *stride_a, int64_t off_a, int ndb,
                         const int64_t *shape_b, const int64_t *stride_b, int64_t off_b)
{
    if (nda != ndb || memcmp(shape_a, shape_b, sizeof(int64_t) * (size_t)nda) ||
        memcmp(stride_a, stride_b, sizeof(int64_t) * (size_t)nda))
        return true;
    return kiln__strided_overlap(nda, shape_a, stride_a, off_a, off_b);
}
