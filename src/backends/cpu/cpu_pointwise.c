/* Pointwise kernels. Every op has an f32 row loop (contiguous rows are plain loops the
 * compiler vectorizes; the AVX2/FMA clone is picked at load time), which f16 and bf16
 * operands reach widened, and a generic row loop that reads and writes any dtype
 * through double. */
#include <math.h>
#include <string.h>
#include "backends/cpu/cpu.h"
#include "core/opts.h"
#include "core/rng.h"


#define SQRT_2_OVER_PI 0.7978845608028654
#define GELU_C 0.044715

static inline double gelu_d(double x, bool tanh_form)
{
    if (tanh_form) return 0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x)));
    return 0.5 * x * (1.0 + erf(x * 0.7071067811865476));
}

static inline float gelu_f(float x, bool tanh_form) { return tanh_form ? km_gelu_tanh(x) : km_gelu_erf(x); }

static inline double gelu_grad_d(double x, bool tanh_form)
{
    if (tanh_form) {
        double u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x), t = tanh(u);
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
    }
    return 0.5 * (1.0 + erf(x * 0.7071067811865476)) + x * exp(-0.5 * x * x) * 0.3989422804014327;
}

static inline float gelu_grad_f(float x, bool tanh_form) { return tanh_form ? km_gelu_grad_tanh(x) : km_gelu_grad_erf(x); }

typedef struct {
    kiln_dtype dt[CPU_MAX_OPS];
    const kiln__attrs *a;
} pw_ctx;

/* ---- unary: y = f(x) ---- */
typedef void (*row_fn)(void *c, char **p, const int64_t *s, int64_t n);

/* f16 and bf16 operands (with f32 ones) run the f32 row loop on chunks widened to f32,
 * and the result is rounded to its type once (to nearest even), as PyTorch computes
 * its reduced-precision pointwise ops: the double loop would be exact too, but several
 * times slower where autocast puts a model's gelu and bias adds in bf16. */
#define HALF_CHUNK 256

typedef struct {
    row_fn f32;
    const pw_ctx *pc;
    int nops;
} half_ctx;

/* Whether operands dt[0..n) (output first) take the widened f32 loop. */
static bool half_rows_fit(const kiln_dtype *dt, int n)
{
    bool half = false;
    for (int k = 0; k < n; k++) {
        if (!kiln__is_half(dt[k]) && dt[k] != KILN_DTYPE_F32) return false;
        half |= kiln__is_half(dt[k]);
    }
    return half;
}

static void half_rows(void *c, char **p, const int64_t *s, int64_t n)
{
    const half_ctx *h = c;
    float buf[CPU_MAX_OPS][HALF_CHUNK];
    for (int64_t i0 = 0; i0 < n; i0 += HALF_CHUNK) {
        int64_t m = n - i0 < HALF_CHUNK ? n - i0 : HALF_CHUNK;
        char *q[CPU_MAX_OPS];
        int64_t qs[CPU_MAX_OPS];
        for (int k = 0; k < h->nops; k++) {
            kiln_dtype dt = h->pc->dt[k];
            char *at = p[k] + i0 * s[k] * (int64_t)kiln_dtype_size(dt);
            q[k] = kiln__is_half(dt) ? (char *)buf[k] : at;
            qs[k] = kiln__is_half(dt) ? (s[k] == 0 ? 0 : 1) : s[k];
            if (k > 0 && kiln__is_half(dt)) cpu_widen_row(buf[k], at, s[k], s[k] == 0 ? 1 : m, dt);
        }
        h->f32((void *)h->pc, q, qs, m);
        if (kiln__is_half(h->pc->dt[0])) cpu_narrow_row(p[0] + i0 * s[0] * 2, s[0], buf[0], m, h->pc->dt[0]);
    }
}

/* Runs the row loop for operands ops[0..n) (output first): f32 when all are f32, the
 * widened f32 loop for f16/bf16 with f32 (unless `exact`: an op with a double attribute,
 * which the f32 loop would round to float first and then to the 16-bit type), else any
 * (through double). */
static void run_rows(kiln_tensor_t *const *ops, int n, row_fn f32, row_fn any, const pw_ctx *pc, bool f32_ok,
                     bool exact)
{
    cpu_iter it;
    cpu_iter_init(&it, n, ops);
    bool all32 = true;
    for (int k = 0; k < n; k++) all32 &= pc->dt[k] == KILN_DTYPE_F32;
    half_ctx h = {f32, pc, n};
    if (f32_ok && all32) cpu_iter_run(&it, f32, (void *)pc);
    else if (f32_ok && !exact && half_rows_fit(pc->dt, n)) cpu_iter_run(&it, half_rows, &h);
    else cpu_iter_run(&it, any, (void *)pc);
}

/* The row loop over f32 x (fn_f32), and over any dtypes through double (fn_any). */
#define UNARY_F32(fn, EXPR_F)                                                                       \
    KILN_SIMD static void fn(void *c, char **p, const int64_t *s, int64_t n)                        \
    {                                                                                               \
        const pw_ctx *pc = c;                                                                       \
        (void)pc;                                                                                   \
        float *o = (float *)p[0];                                                                   \
        const float *in = (const float *)p[1];                                                      \
        if (s[0] == 1 && s[1] == 1) {                                                               \
            for (int64_t i = 0; i < n; i++) { float x = in[i]; o[i] = (EXPR_F); }                   \
        } else {                                                                                    \
            for (int64_t i = 0; i < n; i++) { float x = in[i * s[1]]; o[i * s[0]] = (EXPR_F); }     \
        }                                                                                           \
    }
#define UNARY_ANY(fn, EXPR_D)                                                                       \
    static void fn(void *c, char **p, const int64_t *s, int64_t n)                                  \
    {                                                                                               \
        const pw_ctx *pc = c;                                                                       \
        size_t so = kiln_dtype_size(pc->dt[0]), si = kiln_dtype_size(pc->dt[1]);                   \
        for (int64_t i = 0; i < n; i++) {                                                           \
            double x = kiln__load(p[1] + i * s[1] * (int64_t)si, pc->dt[1]);                        \
            kiln__store(p[0] + i * s[0] * (int64_t)so, pc->dt[0], (EXPR_D));                        \
        }                                                                                           \
    }

static kiln_status unary(row_fn f32, row_fn any, kiln_tensor_t *x, kiln_tensor_t *y, const kiln__attrs *a, bool exact)
{
    kiln_tensor_t *ops[2] = {y, x};
    pw_ctx pc = {{y->dtype, x->dtype}, a};
    run_rows(ops, 2, f32, any, &pc, true, exact);
    return KILN_OK;
}

/* kiln__cpu_<name>: EXPR_F over f32, EXPR_D over any dtype, into out[0] (or, for an
 * in-place op, which has no outputs, into in[0]); UNARY_FAST: EXPR_FAST instead of
 * EXPR_F when FAST holds (the fast-exp switch). UNARY_PICK: F32 is the f32 row loop. */
#define UNARY_PICK_X(name, EXPR_F, EXPR_D, F32, EXACT)                                              \
    UNARY_F32(u_##name##_f32, EXPR_F)                                                               \
    UNARY_ANY(u_##name##_any, EXPR_D)                                                               \
    kiln_status kiln__cpu_##name(KILN__KERNEL_ARGS)                                                 \
    {                                                                                               \
        return unary(F32, u_##name##_any, in[0], n_out ? out[0] : in[0], a, EXACT);                 \
    }
#define UNARY_PICK(name, EXPR_F, EXPR_D, F32) UNARY_PICK_X(name, EXPR_F, EXPR_D, F32, false)
#define UNARY(name, EXPR_F, EXPR_D) UNARY_PICK(name, EXPR_F, EXPR_D, u_##name##_f32)
/* An op with a double attribute: f16 and bf16 take the double loop (rounded once). */
#define UNARY_ATTR(name, EXPR_F, EXPR_D) UNARY_PICK_X(name, EXPR_F, EXPR_D, u_##name##_f32, true)
#define UNARY_FAST(name, EXPR_F, EXPR_FAST, EXPR_D, FAST)                                           \
    UNARY_F32(u_##name##_fast_f32, EXPR_FAST)                                                       \
    UNARY_PICK(name, EXPR_F, EXPR_D, (FAST) ? u_##name##_fast_f32 : u_##name##_f32)

#define AT (pc->a)
#define FAST_EXP kiln__opt(KILN__OPT_FAST_EXP)
#define FAST_GELU (kiln__opt(KILN__OPT_FAST_EXP) && a->op.gelu.tanh) /* GELU's fast form is the tanh one */
UNARY_FAST(gelu, gelu_f(x, AT->op.gelu.tanh), km_gelu_fast(x), gelu_d(x, AT->op.gelu.tanh), FAST_GELU)
UNARY_ATTR(scale_, x * (float)AT->op.scalar.value, x * AT->op.scalar.value)
UNARY_ATTR(fill_, ((void)x, (float)AT->op.scalar.value), ((void)x, AT->op.scalar.value))

/* ---- binary: z = f(x, y) ---- */
#define BINARY_F32(fn, EXPR_F)                                                                      \
    KILN_SIMD static void fn(void *c, char **p, const int64_t *s, int64_t n)                        \
    {                                                                                               \
        const pw_ctx *pc = c;                                                                       \
        (void)pc;                                                                                   \
        float *o = (float *)p[0];                                                                   \
        const float *A = (const float *)p[1], *B = (const float *)p[2];                             \
        if (s[0] == 1 && s[1] == 1 && s[2] == 1) {                                                  \
            for (int64_t i = 0; i < n; i++) { float x = A[i], y = B[i]; o[i] = (EXPR_F); }          \
        } else if (s[0] == 1 && s[1] == 1 && s[2] == 0) {                                           \
            float y = B[0];                                                                         \
            for (int64_t i = 0; i < n; i++) { float x = A[i]; o[i] = (EXPR_F); }                    \
        } else if (s[0] == 1 && s[1] == 0 && s[2] == 1) {                                           \
            float x = A[0];                                                                         \
            for (int64_t i = 0; i < n; i++) { float y = B[i]; o[i] = (EXPR_F); }                    \
        } else {                                                                                    \
            for (int64_t i = 0; i < n; i++) {                                                       \
                float x = A[i * s[1]], y = B[i * s[2]];                                             \
                o[i * s[0]] = (EXPR_F);                                                             \
            }                                                                                       \
        }                                                                                           \
    }
#define BINARY_ANY(fn, EXPR_D)                                                                      \
    static void fn(void *c, char **p, const int64_t *s, int64_t n)                                  \
    {                                                                                               \
        const pw_ctx *pc = c;                                                                       \
        size_t so = kiln_dtype_size(pc->dt[0]), sa = kiln_dtype_size(pc->dt[1]), sb = kiln_dtype_size(pc->dt[2]); \
        for (int64_t i = 0; i < n; i++) {                                                           \
            double x = kiln__load(p[1] + i * s[1] * (int64_t)sa, pc->dt[1]);                        \
            double y = kiln__load(p[2] + i * s[2] * (int64_t)sb, pc->dt[2]);                        \
            kiln__store(p[0] + i * s[0] * (int64_t)so, pc->dt[0], (EXPR_D));                        \
        }                                                                                           \
    }

/* A bool result (a comparison) always takes the any-dtype loop. */
static kiln_status binary(row_fn f32, row_fn any, kiln_tensor_t *const *in, kiln_tensor_t *z, const kiln__attrs *a,
                          bool out_is_bool, bool exact)
{
    kiln_tensor_t *ops[3] = {z, in[0], in[1]};
    pw_ctx pc = {{z->dtype, in[0]->dtype, in[1]->dtype}, a};
    run_rows(ops, 3, f32, any, &pc, !out_is_bool, exact);
    return KILN_OK;
}

#define BINARY_PICK_X(name, EXPR_F, EXPR_D, OUT_IS_BOOL, F32, EXACT)                              \
    BINARY_F32(b_##name##_f32, EXPR_F)                                                              \
    BINARY_ANY(b_##name##_any, EXPR_D)                                                              \
    kiln_status kiln__cpu_##name(KILN__KERNEL_ARGS)                                                 \
    {                                                                                               \
        return binary(F32, b_##name##_any, in, n_out ? out[0] : in[0], a, OUT_IS_BOOL, EXACT);      \
    }
#define BINARY_PICK(name, EXPR_F, EXPR_D, OUT_IS_BOOL, F32) BINARY_PICK_X(name, EXPR_F, EXPR_D, OUT_IS_BOOL, F32, false)
#define BINARY(name, EXPR_F, EXPR_D, OUT_IS_BOOL) BINARY_PICK(name, EXPR_F, EXPR_D, OUT_IS_BOOL, b_##name##_f32)
#define BINARY_FAST(name, EXPR_F, EXPR_FAST, EXPR_D, FAST)                                          \
    BINARY_F32(b_##name##_fast_f32, EXPR_FAST)                                                      \
    BINARY_PICK(name, EXPR_F, EXPR_D, false, (FAST) ? b_##name##_fast_f32 : b_##name##_f32)

/* The rows of src/core/binary.def; a BOOL one (a comparison) takes the any-dtype loop. */
#define IS_BOOL_ANY false
#define IS_BOOL_FLOAT false
#define IS_BOOL_BOOL true
#define KILN_BINARY(ID, name, dtypes, grad, save, f, d) BINARY(name, f, d, IS_BOOL_##dtypes)
#include "core/binary.def"
#undef KILN_BINARY
BINARY_FAST(gelu_backward, y * gelu_grad_f(x, AT->op.gelu.tanh), y * km_gelu_grad_fast(x),
            y * gelu_grad_d(x, AT->op.gelu.tanh), FAST_GELU)

/* The rows of include/kiln/pointwise.def: y = km_<name>(x) and the backward op's
 * g * km_<name>_dx(x); in any other dtype than f32 the d forms; by its fast column, the
 * _fast forms in f32 under the fast-exp switch (SWITCH), or never here (EXACT, and GEN,
 * whose fast form is the generated kernels'). */
#define PW_EXACT(name) UNARY(name, km_##name(x), km_##name##d(x))
#define PW_GEN PW_EXACT
#define PW_SWITCH(name) UNARY_FAST(name, km_##name(x), km_##name##_fast(x), km_##name##d(x), FAST_EXP)
#define PW_BW_EXACT(name) BINARY(name##_backward, y * km_##name##_dx(x), y * km_##name##_dxd(x), 0)
#define PW_BW_GEN PW_BW_EXACT
#define PW_BW_SWITCH(name) \
    BINARY_FAST(name##_backward, y * km_##name##_dx(x), y * km_##name##_dx_fast(x), y * km_##name##_dxd(x), FAST_EXP)
#define KILN_PW(ID, name, dtypes, grad, fast) PW_##fast(name) KILN__PW_IF_OP(grad, PW_BW_##fast(name))
#include "kiln/pointwise.def"
#undef KILN_PW

/* add_ (dst += alpha * src) is a binary op whose first operand is its destination. */
BINARY_PICK_X(add_, x + (float)AT->op.scalar.value * y, x + AT->op.scalar.value * y, false, b_add__f32, true)

kiln_status kiln__cpu_cast(KILN__KERNEL_ARGS)
{
    cpu_copy(out[0], in[0]);
    return KILN_OK;
}

kiln_status kiln__cpu_contiguous(KILN__KERNEL_ARGS) { return kiln__cpu_cast(be, in, n_in, a, out, n_out); } /* the same copy */

kiln_status kiln__cpu_copy_(KILN__KERNEL_ARGS)
{
    cpu_copy(in[0], in[1]);
    return KILN_OK;
}

/* A copy that fails on an element below the bound (or NaN); the message names what it
 * checks, as the op whose check it is would have. */
kiln_status kiln__cpu_check_min(KILN__KERNEL_ARGS)
{
    static const char *const what[] = {[KILN__CHECK_VALUE] = "check_min: value", [KILN__CHECK_ADAMW_STEP] = "adamw_: step"};
    cpu_copy(out[0], in[0]);
    const char *p = kiln__data(out[0]);
    size_t sz = kiln_dtype_size(out[0]->dtype);
    int64_t n = kiln__numel(out[0]->ndim, out[0]->shape);
    for (int64_t i = 0; i < n; i++) {
        double x = kiln__load(p + i * (int64_t)sz, out[0]->dtype);
        if (x >= a->op.check.min) continue;
        if (a->op.check.what == KILN__CHECK_CE_TARGET) /* a decomposed cross_entropy's index, or V - 1 minus it */
            return kiln__err(KILN_ERR_INDEX, "cross_entropy: the target at row %lld is outside [0, %lld) (and is not "
                             "ignore_index)", (long long)i, (long long)a->op.check.classes);
        return kiln__err(KILN_ERR_ARG, "%s %g must be >= %g", what[a->op.check.what == KILN__CHECK_ADAMW_STEP], x, a->op.check.min);
    }
    return KILN_OK;
}

/* A collective recorded in a graph: the process group's own function, which the op
 * carries, runs it (src/dist/pg.c). */
kiln_status kiln__cpu_allreduce_(KILN__KERNEL_ARGS)
{
    const kiln__collective_ops *c = a->op.collective.ops;
    return c->run(a->op.collective.group, in[0], a->op.collective.reduce);
}

kiln_status kiln__cpu_reduce_scatter_(KILN__KERNEL_ARGS)
{
    kiln__collective2_fn run = (kiln__collective2_fn)(uintptr_t)a->op.collective.ops;
    return run(a->op.collective.group, in[0], in[1], a->op.collective.reduce);
}

/* allgather_ is the same call: the op carries its function. */
kiln_status kiln__cpu_allgather_(KILN__KERNEL_ARGS) { return kiln__cpu_reduce_scatter_(be, in, n_in, a, out, n_out); }

static void where_row(void *c, char **p, const int64_t *s, int64_t n)
{
    const pw_ctx *w = c;
    size_t sz[4];
    for (int k = 0; k < 4; k++) sz[k] = kiln_dtype_size(w->dt[k]);
    for (int64_t i = 0; i < n; i++) {
        bool cond = kiln__load(p[1] + i * s[1] * (int64_t)sz[1], w->dt[1]) != 0;
        int k = cond ? 2 : 3;
        kiln__store(p[0] + i * s[0] * (int64_t)sz[0], w->dt[0], kiln__load(p[k] + i * s[k] * (int64_t)sz[k], w->dt[k]));
    }
}

kiln_status kiln__cpu_where(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *ops[4] = {out[0], in[0], in[1], in[2]};
    cpu_iter it;
    cpu_iter_init(&it, 4, ops);
    pw_ctx w = {{out[0]->dtype, in[0]->dtype, in[1]->dtype, in[2]->dtype}, a};
    cpu_iter_run(&it, where_row, &w);
    return KILN_OK;
}

/* ---- creation: outputs are contiguous, so the flat index is known ---- */
typedef struct {
    const kiln__attrs *a;
    kiln_tensor_t *t;
    int kind; /* 0 full, 1 arange, 2 rand */
} make_ctx;

/* The largest value below 1 in dt. A uniform draw above it would round to 1 when
 * stored (likely in f16/bf16), so it is clamped there to keep rand in [0, 1). */
static double below_one(kiln_dtype dt)
{
    switch (dt) {
    case KILN_DTYPE_F16: return 1.0 - 0x1p-11;
    case KILN_DTYPE_BF16: return 1.0 - 0x1p-8;
    case KILN_DTYPE_F32: return 1.0 - 0x1p-24;
    default: return 1.0 - 0x1p-53;
    }
}

static void make_range(void *c, int64_t b, int64_t e)
{
    const make_ctx *m = c;
    const kiln__attrs *a = m->a;
    kiln_dtype dt = m->t->dtype;
    char *base = kiln__data(m->t);
    size_t sz = kiln_dtype_size(dt);
    if (m->kind == 0 && dt == KILN_DTYPE_F32) {
        float v = (float)a->op.source.value, *o = (float *)base;
        for (int64_t i = b; i < e; i++) o[i] = v;
        return;
    }
    if (m->kind == 0 && kiln__is_half(dt)) { /* the value's bits once, then a 16-bit fill */
        uint16_t v, *o = (uint16_t *)base;
        kiln__store(&v, dt, a->op.source.value);
        for (int64_t i = b; i < e; i++) o[i] = v;
        return;
    }
    for (int64_t i = b; i < e; i++) {
        double v;
        if (m->kind == 0) v = a->op.source.value;
        else if (m->kind == 1) v = a->op.source.start + (double)i * a->op.source.step;
        else if (a->op.source.normal) v = kiln__rng_normal(a->u[0], a->u[1], (uint64_t)i);
        else v = fmin(kiln__rng_uniform(a->u[0], a->u[1], (uint64_t)i), below_one(dt));
        kiln__store(base + i * (int64_t)sz, dt, v);
    }
}

static kiln_status make(kiln_tensor_t *t, const kiln__attrs *a, int kind)
{
    make_ctx m = {a, t, kind};
    kiln__parallel_for(kiln__numel(t->ndim, t->shape), CPU_GRAIN, make_range, &m);
    return KILN_OK;
}

kiln_status kiln__cpu_full(KILN__KERNEL_ARGS) { return make(out[0], a, 0); }
kiln_status kiln__cpu_arange(KILN__KERNEL_ARGS) { return make(out[0], a, 1); }
kiln_status kiln__cpu_rand(KILN__KERNEL_ARGS) { return make(out[0], a, 2); }

/* ---- dropout: the mask is a pure function of (seed, counter, flat index) ---- */
typedef struct {
    const kiln__attrs *a;
    kiln_tensor_t *x, *y, *mask;
} drop_ctx;

static void drop_range(void *c, int64_t b, int64_t e)
{
    const drop_ctx *d = c;
    double p = d->a->op.dropout.p, scale = 1.0 / (1.0 - p);
    kiln_dtype dt = d->x->dtype;
    size_t sz = kiln_dtype_size(dt);
    char *x = kiln__data(d->x), *y = kiln__data(d->y);
    uint8_t *m = kiln__data(d->mask);
    for (int64_t i = b; i < e; i++) {
        bool keep = kiln__rng_uniform(d->a->u[0], d->a->u[1], (uint64_t)i) >= p;
        m[i] = keep;
        kiln__store(y + i * (int64_t)sz, dt, keep ? kiln__load(x + i * (int64_t)sz, dt) * scale : 0.0);
    }
}

kiln_status kiln__cpu_dropout(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *tmp, *x = cpu_contig(in[0], &tmp);
    if (!x) return kiln_last_status();
    drop_ctx d = {a, x, out[0], out[1]};
    kiln__parallel_for(kiln__numel(x->ndim, x->shape), CPU_GRAIN, drop_range, &d);
    kiln_tensor_free(tmp);
    return KILN_OK;
}

/* ---- tril / triu: copy, then zero the other triangle of every matrix ---- */
kiln_status kiln__cpu_tri(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *o = out[0];
    cpu_copy(o, in[0]);
    int64_t r = o->shape[o->ndim - 2], c = o->shape[o->ndim - 1], mats = kiln__numel(o->ndim - 2, o->shape);
    size_t sz = kiln_dtype_size(o->dtype);
    char *base = kiln__data(o);
    for (int64_t m = 0; m < mats; m++)
        for (int64_t i = 0; i < r; i++)
            for (int64_t j = 0; j < c; j++) {
                bool keep = a->op.tri.upper ? j - i >= a->op.tri.k : j - i <= a->op.tri.k;
                if (!keep) memset(base + ((m * r + i) * c + j) * (int64_t)sz, 0, sz);
            }
    return KILN_OK;
}

/* ---- AdamW, decoupled weight decay (Loshchilov & Hutter), bias-corrected ---- */
typedef struct {
    float *p, *g, *m, *v;
    float lr, wd, b1, b2, eps, c1, c2, gscale; /* gscale: each gradient is multiplied by it (clipping) */
} adam_ctx;

KILN_SIMD static void adam_range(void *c, int64_t b, int64_t e)
{
    const adam_ctx *k = c;
    for (int64_t i = b; i < e; i++) {
        float g = k->g[i] * k->gscale;
        float m = k->b1 * k->m[i] + (1.0f - k->b1) * g;
        float v = k->b2 * k->v[i] + (1.0f - k->b2) * g * g;
        k->m[i] = m;
        k->v[i] = v;
        float p = k->p[i] * (1.0f - k->lr * k->wd);
        k->p[i] = p - k->lr * (m / k->c1) / (sqrtf(v / k->c2) + k->eps);
    }
}

/* The value of a one-element f32 or f64 tensor (an AdamW scalar). */
static double one_value(const kiln_tensor_t *t)
{
    const char *p = kiln__data(t);
    return t->dtype == KILN_DTYPE_F64 ? *(const double *)p : (double)*(const float *)p;
}

kiln_status kiln__cpu_adamw_(KILN__KERNEL_ARGS)
{
    double lr = one_value(in[4]), t = one_value(in[5]), gs = one_value(in[6]), b1 = a->op.adamw.beta1,
           b2 = a->op.adamw.beta2;
    if (!isfinite(gs)) return KILN_OK; /* a skipped step (ops.def) */
    if (!(t >= 1)) return kiln__err(KILN_ERR_ARG, "adamw_: step %g must be >= 1", t);
    adam_ctx k = {kiln__data(in[0]), kiln__data(in[1]), kiln__data(in[2]), kiln__data(in[3]), (float)lr,
                  (float)a->op.adamw.weight_decay, (float)b1, (float)b2, (float)a->op.adamw.eps,
                  (float)(1.0 - pow(b1, t)), (float)(1.0 - pow(b2, t)), (float)gs};
    kiln__parallel_for(kiln__numel(in[0]->ndim, in[0]->shape), CPU_GRAIN, adam_range, &k);
    return KILN_OK;
}
