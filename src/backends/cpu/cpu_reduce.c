/* Reductions over any set of dims: sum, max, argmax. Each output element is reduced
 * in a fixed order (by one thread, or for a whole-tensor sum in fixed chunks added in
 * order), so results never depend on the thread count. */
#include <math.h>
#include <stdlib.h>
#include "backends/cpu/cpu.h"
#include "core/opts.h"

typedef struct {
    kiln_tensor_t *x, *o;
    int nk, nr;                                   /* kept and reduced dims */
    int64_t kshape[KILN_MAX_DIMS], kstride[KILN_MAX_DIMS];
    int64_t rshape[KILN_MAX_DIMS], rstride[KILN_MAX_DIMS];
    int64_t rcount;
    int kind; /* 0 sum, 1 max, 2 argmax */
} red_ctx;

static void red_setup(red_ctx *r, kiln_tensor_t *x, kiln_tensor_t *o, const int64_t *dims, int ndims, int kind)
{
    *r = (red_ctx){.x = x, .o = o, .rcount = 1, .kind = kind};
    bool red[KILN_MAX_DIMS] = {0};
    for (int k = 0; k < ndims; k++) red[dims[k]] = true;
    for (int d = 0; d < x->ndim; d++) {
        if (ndims == 0 || red[d]) {
            r->rshape[r->nr] = x->shape[d];
            r->rstride[r->nr++] = x->stride[d];
            r->rcount *= x->shape[d];
        } else {
            r->kshape[r->nk] = x->shape[d];
            r->kstride[r->nk++] = x->stride[d];
        }
    }
}

static void red_range(void *c, int64_t b, int64_t e)
{
    const red_ctx *r = c;
    kiln_dtype dt = r->x->dtype;
    size_t sz = kiln_dtype_size(dt), osz = kiln_dtype_size(r->o->dtype);
    char *xb = kiln__data(r->x), *ob = kiln__data(r->o);
    bool f32 = dt == KILN_DTYPE_F32;
    int64_t inner_n = r->nr ? r->rshape[r->nr - 1] : 1, inner_s = r->nr ? r->rstride[r->nr - 1] : 0;
    int64_t outer_n = inner_n ? r->rcount / inner_n : 0;
    for (int64_t oi = b; oi < e; oi++) {
        int64_t off = 0, rem = oi;
        for (int d = r->nk - 1; d >= 0; d--) {
            off += (rem % r->kshape[d]) * r->kstride[d];
            rem /= r->kshape[d];
        }
        double acc = r->kind == 0 ? 0.0 : -INFINITY;
        int64_t best = 0, flat = 0;
        bool nan = false;
        for (int64_t q = 0; q < outer_n; q++) {
            int64_t roff = off, rr = q;
            for (int d = r->nr - 2; d >= 0; d--) {
                roff += (rr % r->rshape[d]) * r->rstride[d];
                rr /= r->rshape[d];
            }
            if (r->kind == 0 && f32) {
                const float *p = (const float *)xb + roff;
                double s = 0;
                if (inner_s == 1)
                    for (int64_t i = 0; i < inner_n; i++) s += p[i];
                else
                    for (int64_t i = 0; i < inner_n; i++) s += p[i * inner_s];
                acc += s;
                continue;
            }
            for (int64_t i = 0; i < inner_n; i++, flat++) {
                double v = kiln__load(xb + (roff + i * inner_s) * (int64_t)sz, dt);
                if (r->kind == 0) {
                    acc += v;
                } else if (v != v) {
                    if (!nan) best = flat;
                    nan = true;
                    acc = v;
                } else if (!nan && v > acc) {
                    acc = v;
                    best = flat;
                }
            }
        }
        if (r->kind == 2) *(int64_t *)(ob + oi * 8) = best;
        else kiln__store(ob + oi * (int64_t)osz, r->o->dtype, acc);
    }
}

/* Sums of a contiguous f32 or bf16 (rows, cols) over its rows (bias gradients; bf16
 * ones under autocast): each task owns a block of columns and adds the rows in order,
 * in double. A bf16 result is the f32 one rounded, as the widened copy would give. */
typedef struct {
    const void *x;
    void *o;
    int64_t rows, cols;
    bool bf16;
} colsum_ctx;

/* acc[0..n) = the sums of columns c0 .. c0 + n - 1 over rows [r0, r1) of x (cols wide),
 * added in row order. */
static inline void add_rows(const void *xv, bool bf16, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t n,
                            double *acc)
{
    for (int64_t j = 0; j < n; j++) acc[j] = 0;
    if (bf16) {
        for (int64_t r = r0; r < r1; r++) {
            const uint16_t *row = (const uint16_t *)xv + r * cols + c0;
            for (int64_t j = 0; j < n; j++) acc[j] += kiln__bf16_to_f32(row[j]);
        }
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const float *row = (const float *)xv + r * cols + c0;
        for (int64_t j = 0; j < n; j++) acc[j] += row[j];
    }
}

static void put_sum(void *o, bool bf16, int64_t j, double v)
{
    if (bf16) ((uint16_t *)o)[j] = kiln__f32_to_bf16((float)v);
    else ((float *)o)[j] = (float)v;
}

KILN_SIMD static void colsum_range(void *c, int64_t b, int64_t e)
{
    const colsum_ctx *k = c;
    double acc[256];
    for (int64_t blk = b; blk < e; blk++) {
        int64_t c0 = blk * 256, n = k->cols - c0 < 256 ? k->cols - c0 : 256;
        add_rows(k->x, k->bf16, k->cols, 0, k->rows, c0, n, acc);
        for (int64_t j = 0; j < n; j++) put_sum(k->o, k->bf16, c0 + j, acc[j]);
    }
}

/* The same sums, for at least 2 COLSUM_ROWS rows and at most 4096 columns, by chunks of
 * COLSUM_ROWS whole rows (KILN_OPT_COLSUM_ROWS): a task adds
 * its chunk's rows in order into its own row of double partials, reading memory in one
 * stream (a block of columns reads a short piece of every row, one stream per row in
 * flight), then each column adds the chunks in order. Chunks are fixed by the shape, so
 * the result does not depend on the thread count. */
enum { COLSUM_ROWS = 256 };

typedef struct {
    const void *x;
    double *part; /* (chunks, cols) */
    int64_t rows, cols;
    bool bf16;
} rowsum_ctx;

KILN_SIMD static void rowchunk_range(void *c, int64_t b, int64_t e)
{
    const rowsum_ctx *k = c;
    for (int64_t t = b; t < e; t++) {
        int64_t r1 = (t + 1) * COLSUM_ROWS < k->rows ? (t + 1) * COLSUM_ROWS : k->rows;
        add_rows(k->x, k->bf16, k->cols, t * COLSUM_ROWS, r1, 0, k->cols, k->part + t * k->cols);
    }
}

static kiln_status colsum_by_rows(const void *x, void *o, bool bf16, int64_t rows, int64_t cols)
{
    int64_t chunks = (rows + COLSUM_ROWS - 1) / COLSUM_ROWS;
    double *part = malloc(sizeof(double) * (size_t)(chunks * cols));
    if (!part) return kiln__err(KILN_ERR_OOM, "sum: out of memory for partial sums");
    rowsum_ctx k = {x, part, rows, cols, bf16};
    kiln__parallel_for(chunks, 1, rowchunk_range, &k);
    for (int64_t j = 0; j < cols; j++) {
        double s = 0;
        for (int64_t t = 0; t < chunks; t++) s += part[t * cols + j];
        put_sum(o, bf16, j, s);
    }
    free(part);
    return KILN_OK;
}

/* A sum of all of a contiguous f32 tensor (a gradient's squares, for the norm): fixed
 * chunks of FULLSUM_CHUNK elements, each summed by one task in 16 double lanes (lane l
 * takes elements l, l + 16, ...), then the chunks added in order. The chunks are fixed
 * by the size, never by the thread count, so the sum is the same with any number of
 * threads; one task per output would leave every other thread idle. */
enum { FULLSUM_CHUNK = 1 << 16 };

typedef struct {
    const float *x;
    int64_t n;
    double *part;
} fullsum_ctx;

KILN_SIMD static void fullsum_range(void *c, int64_t b, int64_t e)
{
    const fullsum_ctx *k = c;
    for (int64_t t = b; t < e; t++) {
        int64_t lo = t * FULLSUM_CHUNK, hi = lo + FULLSUM_CHUNK < k->n ? lo + FULLSUM_CHUNK : k->n, i = lo;
        double acc[16] = {0}, s = 0;
        for (; i + 16 <= hi; i += 16)
            for (int l = 0; l < 16; l++) acc[l] += k->x[i + l];
        for (int l = 0; l < 16; l++) s += acc[l];
        for (; i < hi; i++) s += k->x[i];
        k->part[t] = s;
    }
}

/* Are the reduced dims a leading run of a contiguous tensor? */
static bool leading_dims(const kiln_tensor_t *x, const int64_t *dims, int ndims, int64_t *rows, int64_t *cols)
{
    if (ndims == 0 || !kiln__is_contiguous(x)) return false;
    for (int k = 0; k < ndims; k++)
        if (dims[k] != k) return false;
    *rows = kiln__numel(ndims, x->shape);
    *cols = kiln__numel(x->ndim - ndims, x->shape + ndims);
    return *cols > 1;
}

/* Is the one reduced dim d in the middle of a contiguous tensor, (outer, R, inner) with
 * outer > 1 and inner > 1 (a leading dim is leading_dims')? */
static bool middle_dim(const kiln_tensor_t *x, int d, int64_t *outer, int64_t *R, int64_t *inner)
{
    if (d <= 0 || d >= x->ndim - 1 || !kiln__is_contiguous(x)) return false;
    *outer = kiln__numel(d, x->shape);
    *R = x->shape[d];
    *inner = kiln__numel(x->ndim - d - 1, x->shape + d + 1);
    return *outer > 1 && *inner > 1;
}

/* The sums of (outer, R, inner) over R: a task per (outer row, block of 256 of inner),
 * adding the R rows in order in double, so each output gets red_range's sum of one
 * reduced dim: 0 + x0 + x1 + ... in double, rounded once. */
typedef struct {
    const float *x;
    float *o;
    int64_t R, inner, blocks;
} midsum_ctx;

KILN_SIMD static void midsum_range(void *c, int64_t b, int64_t e)
{
    const midsum_ctx *k = c;
    double acc[256];
    for (int64_t t = b; t < e; t++) {
        int64_t o = t / k->blocks, c0 = t % k->blocks * 256, n = k->inner - c0 < 256 ? k->inner - c0 : 256;
        const float *x = k->x + o * k->R * k->inner + c0;
        for (int64_t j = 0; j < n; j++) acc[j] = 0;
        for (int64_t r = 0; r < k->R; r++)
            for (int64_t j = 0; j < n; j++) acc[j] += x[r * k->inner + j];
        for (int64_t j = 0; j < n; j++) k->o[o * k->inner + c0 + j] = (float)acc[j];
    }
}

static kiln_status reduce(kiln_tensor_t *x, kiln_tensor_t *o, const int64_t *dims, int ndims, int kind)
{
    int64_t rows, cols, n = kiln__numel(x->ndim, x->shape);
    if (kind == 0 && x->dtype == KILN_DTYPE_F32 && ndims == 0 && n >= 2 * FULLSUM_CHUNK && kiln__is_contiguous(x) &&
        kiln__opt(KILN__OPT_FULLSUM_CHUNKS)) {
        int64_t chunks = (n + FULLSUM_CHUNK - 1) / FULLSUM_CHUNK;
        double *part = malloc(sizeof(double) * (size_t)chunks), s = 0;
        if (!part) return kiln__err(KILN_ERR_OOM, "sum: out of memory for partial sums");
        fullsum_ctx k = {kiln__data(x), n, part};
        kiln__parallel_for(chunks, 1, fullsum_range, &k);
        for (int64_t c = 0; c < chunks; c++) s += part[c];
        free(part);
        kiln__store(kiln__data(o), o->dtype, s);
        return KILN_OK;
    }
    bool bf16 = x->dtype == KILN_DTYPE_BF16 && o->dtype == KILN_DTYPE_BF16;
    if (kind == 0 && (x->dtype == KILN_DTYPE_F32 || bf16) && leading_dims(x, dims, ndims, &rows, &cols)) {
        /* Tall and not too wide: wider ones have column blocks enough for every thread. */
        if (rows >= 2 * COLSUM_ROWS && cols <= 16 * 256 && kiln__opt(KILN__OPT_COLSUM_ROWS))
            return colsum_by_rows(kiln__data(x), kiln__data(o), bf16, rows, cols);
        colsum_ctx k = {kiln__data(x), kiln__data(o), rows, cols, bf16};
        kiln__parallel_for((cols + 255) / 256, 1, colsum_range, &k);
        return KILN_OK;
    }
    int64_t outer, R, inner;
    if (kind == 0 && x->dtype == KILN_DTYPE_F32 && o->dtype == KILN_DTYPE_F32 && ndims == 1 &&
        middle_dim(x, (int)dims[0], &outer, &R, &inner) && kiln__opt(KILN__OPT_SUM_MIDDLE)) {
        midsum_ctx k = {kiln__data(x), kiln__data(o), R, inner, (inner + 255) / 256};
        kiln__parallel_for(outer * k.blocks, R * inner >= CPU_GRAIN ? 1 : CPU_GRAIN / (R * inner) + 1, midsum_range, &k);
        return KILN_OK;
    }
    red_ctx r;
    red_setup(&r, x, o, dims, ndims, kind);
    int64_t nout = kiln__numel(o->ndim, o->shape);
    int64_t grain = r.rcount >= CPU_GRAIN ? 1 : CPU_GRAIN / (r.rcount ? r.rcount : 1);
    kiln__parallel_for(nout, grain, red_range, &r);
    return KILN_OK;
}

/* bf16 column sums (bias gradients under autocast) read bf16 in place; other f16 and
 * bf16 sums are widened to f32, which takes the fast paths above. */
static bool bf16_colsum(const kiln_tensor_t *x, const kiln_tensor_t *o, const kiln__attrs *a)
{
    int64_t rows, cols;
    return x->dtype == KILN_DTYPE_BF16 && o->dtype == KILN_DTYPE_BF16 && leading_dims(x, a->shape, a->ndim, &rows, &cols);
}

kiln_status kiln__cpu_sum(KILN__KERNEL_ARGS)
{
    if (!bf16_colsum(in[0], out[0], a)) CPU_WIDEN(kiln__cpu_sum);
    return reduce(in[0], out[0], a->shape, a->ndim, 0);
}
kiln_status kiln__cpu_max(KILN__KERNEL_ARGS) { return reduce(in[0], out[0], a->shape, a->ndim, 1); }

kiln_status kiln__cpu_argmax(KILN__KERNEL_ARGS) { return reduce(in[0], out[0], &a->op.dim.dim, 1, 2); }
