/* Flex attention's fused kernels on the cpu: the modifiers' trees written as C
 * expressions and put inside a kernel that walks each query row over the key blocks
 * the block mask lists (full ones without evaluating the mask, partial ones with it,
 * empty ones never), with an online softmax, so that no (Tq, Tk) matrix is held; built
 * through the compiler's kernel cache (src/compile/jit.c) once per modifiers, dtype
 * and captured tensors' dtypes, and run over kiln's thread pool, one task per (b, h,
 * query block). This stage is the forward; a call that needs gradients takes the dense
 * path (flex.c). */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/threadpool.h"
#include "flex/flex_impl.h"
#include "kiln/ops.h"

/* The kernel's arguments: the same text compiles into kiln and into the generated
 * source, so the two agree on the layout. */
#define FLEX_ARGS                                                                                      \
    typedef struct {                                                                                   \
        const void *q, *k, *v;                                                                         \
        void *y, *lse;                                                                                 \
        const void *cap[8];                                                                            \
        int64_t cap_dim[8][4];                                                                         \
        int64_t B, H, Hkv, Tq, Tk, D, mB, mH, nq, block;                                               \
        double scale;                                                                                  \
        const int32_t *n_full, *n_partial;                                                             \
        const int64_t *start, *kv;                                                                     \
        int32_t *bad;                                                                                  \
    } flex_args;
FLEX_ARGS
#define STR_(...) #__VA_ARGS__
#define STR(...) STR_(__VA_ARGS__)

#define MAX_D 512

typedef void (*flex_fwd_fn)(const flex_args *a, int64_t t0, int64_t t1);

/* ---- the expressions as C ---- */

typedef struct {
    char *s;
    size_t n, cap;
    bool oom;
} sbuf;

static void put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    for (int tries = 0; tries < 2 && !b->oom; tries++) {
        va_start(ap, fmt);
        int n = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if (b->s && b->n + (size_t)n < b->cap) {
            b->n += (size_t)n;
            return;
        }
        size_t cap = (b->cap + (size_t)n + 1) * 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->s = p, b->cap = cap;
    }
}

typedef enum { G_BOOL, G_INT, G_FLOAT } gtype;

typedef struct {
    const kiln_flex_t *f;
    const parser *ps;
    bool f64;
    int which; /* 0: score_mod, 1: mask_mod */
} gen;

static const char *ct(const gen *g, gtype t) { return t == G_FLOAT ? (g->f64 ? "double" : "float") : t == G_INT ? "int64_t" : "int"; }

/* Node i as C in b; its type. */
static gtype emit(const gen *g, int i, sbuf *b);

static gtype typed(const gen *g, int i)
{
    sbuf scratch = {0};
    gtype t = emit(g, i, &scratch);
    free(scratch.s);
    return t;
}

/* Node i converted to type t. */
static void emit_as(const gen *g, int i, gtype t, sbuf *b)
{
    put(b, "((%s)(", ct(g, t));
    emit(g, i, b);
    put(b, "))");
}

static const char *libm(const gen *g, int f) /* libm's float or double form of tanh .. sqrt */
{
    static const char *const f32[] = {"tanhf", "expf", "logf", "fabsf", "sqrtf"};
    static const char *const f64[] = {"tanh", "exp", "log", "fabs", "sqrt"};
    return (g->f64 ? f64 : f32)[f];
}

static gtype emit(const gen *g, int i, sbuf *b)
{
    const anode *a = &g->ps->n[i];
    switch (a->kind) {
    case A_NUM:
        if (a->integer) put(b, "((int64_t)%.0f)", a->num);
        else put(b, "((%s)%.17g)", ct(g, G_FLOAT), a->num);
        return a->integer ? G_INT : G_FLOAT;
    case A_NAME:
        put(b, "%s", kiln__flex_var_names[a->op]);
        return a->op == V_SCORE ? G_FLOAT : G_INT;
    case A_NEG: {
        gtype t = typed(g, a->arg[0]);
        if (t == G_BOOL) t = G_INT;
        put(b, "(-");
        emit_as(g, a->arg[0], t, b);
        put(b, ")");
        return t;
    }
    case A_NOT:
        put(b, "(!(");
        emit(g, a->arg[0], b);
        put(b, "))");
        return G_BOOL;
    case A_TERN: {
        gtype l = typed(g, a->arg[1]), r = typed(g, a->arg[2]), t = l > r ? l : r;
        put(b, "((");
        emit(g, a->arg[0], b);
        put(b, ") ? ");
        emit_as(g, a->arg[1], t, b);
        put(b, " : ");
        emit_as(g, a->arg[2], t, b);
        put(b, ")");
        return t;
    }
    case A_CALL: {
        gtype t = typed(g, a->arg[0]);
        if (a->op == F_MIN || a->op == F_MAX) {
            gtype r = typed(g, a->arg[1]);
            t = t > r ? t : r;
            if (t == G_BOOL) t = G_INT;
            if (t == G_FLOAT) put(b, "km_%s%s(", a->op == F_MIN ? "min" : "max", g->f64 ? "d" : "");
            else put(b, "flex_%s(", a->op == F_MIN ? "imin" : "imax");
            emit_as(g, a->arg[0], t, b);
            put(b, ", ");
            emit_as(g, a->arg[1], t, b);
            put(b, ")");
            return t;
        }
        if (a->op == F_ABS && t != G_FLOAT) {
            put(b, "flex_iabs(");
            emit_as(g, a->arg[0], G_INT, b);
            put(b, ")");
            return G_INT;
        }
        put(b, "%s(", libm(g, a->op));
        emit_as(g, a->arg[0], G_FLOAT, b);
        put(b, ")");
        return G_FLOAT;
    }
    case A_CAP: { /* the captured tensor's element at the row-major index, each index checked */
        kiln_dtype dt = kiln_tensor_dtype(g->f->cap[a->op]);
        const char *raw = dt == KILN_DTYPE_F32 ? "float" : dt == KILN_DTYPE_F64 ? "double" : dt == KILN_DTYPE_I64 ? "int64_t"
                        : dt == KILN_DTYPE_I32 ? "int32_t" : "uint8_t";
        gtype t = dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_F64 ? G_FLOAT : dt == KILN_DTYPE_BOOL ? G_BOOL : G_INT;
        put(b, "((%s)((const %s *)a->cap[%d])[", ct(g, t), raw, a->op);
        for (int d = 0; d < a->n_arg; d++) {
            if (d) put(b, " * a->cap_dim[%d][%d] + ", a->op, d);
            put(b, "flex_at(");
            emit_as(g, a->arg[d], G_INT, b);
            put(b, ", a->cap_dim[%d][%d], a->bad, %d)", a->op, d, a->op + 1);
        }
        put(b, "])");
        return t;
    }
    case A_BIN:
        break;
    }
    binop op = (binop)a->op;
    gtype l = typed(g, a->arg[0]), r = typed(g, a->arg[1]), t = l > r ? l : r;
    if (op == B_AND || op == B_OR) {
        put(b, "((");
        emit(g, a->arg[0], b);
        put(b, ") %s (", op == B_AND ? "&&" : "||");
        emit(g, a->arg[1], b);
        put(b, "))");
        return G_BOOL;
    }
    if (t == G_BOOL || op == B_DIV) t = op == B_DIV ? G_FLOAT : G_INT;
    static const char *const text[] = {"+", "-", "*", "/", "<", "<=", ">", ">=", "==", "!="};
    put(b, "(");
    emit_as(g, a->arg[0], t, b);
    put(b, " %s ", text[op]);
    emit_as(g, a->arg[1], t, b);
    put(b, ")");
    return op >= B_LT ? G_BOOL : t;
}

/* The kernel's source for f in f32 or f64. */
static char *source(const kiln_flex_t *f, bool f64)
{
    sbuf b = {0};
    const char *T = f64 ? "double" : "float";
    put(&b, "/* Generated by kiln %s: flex attention's forward (%s).\n   score_mod: %s\n   mask_mod: %s */\n",
        KILN_VERSION, T, *f->score ? f->score : "(none)", *f->mask ? f->mask : "(none)");
    put(&b, "%s\n%s\n", kiln__codegen_prelude_c(), STR(FLEX_ARGS));
    put(&b, "static inline int64_t flex_at(int64_t i, int64_t n, int32_t *bad, int32_t which)\n"
            "{\n    if (i < 0 || i >= n) {\n        *bad = which;\n        return 0;\n    }\n    return i;\n}\n"
            "static inline int64_t flex_imin(int64_t x, int64_t y) { return x < y ? x : y; }\n"
            "static inline int64_t flex_imax(int64_t x, int64_t y) { return x > y ? x : y; }\n"
            "static inline int64_t flex_iabs(int64_t x) { return x < 0 ? -x : x; }\n\n");
    put(&b, "void flex_fwd(const flex_args *a, int64_t t0, int64_t t1)\n{\n");
    put(&b, "    typedef %s T;\n", T);
    put(&b, "    const T *Q = a->q, *K = a->k, *V = a->v;\n    T *Y = a->y, *L = a->lse;\n"
            "    const int64_t H = a->H, Hkv = a->Hkv, Tq = a->Tq, Tk = a->Tk, D = a->D, G = H / Hkv, blk = a->block;\n"
            "    const int64_t nq = a->nq, q_len = Tq, kv_len = Tk;\n    const T scale = (T)a->scale;\n"
            "    T acc[%d];\n    (void)q_len, (void)kv_len;\n", MAX_D);
    put(&b, "    for (int64_t t = t0; t < t1; t++) {\n"
            "        const int64_t qb = t %% nq, bh = t / nq, b = bh / H, h = bh %% H, hk = h / G;\n"
            "        const int64_t r = ((a->mB == 1 ? 0 : b) * a->mH + (a->mH == 1 ? 0 : h)) * nq + qb;\n"
            "        const int64_t nf = a->n_full[r], nb = nf + a->n_partial[r];\n"
            "        const int64_t *kvl = a->kv + a->start[r];\n"
            "        const int64_t q1 = (qb + 1) * blk < Tq ? (qb + 1) * blk : Tq;\n"
            "        (void)b, (void)h;\n"
            "        for (int64_t q_idx = qb * blk; q_idx < q1; q_idx++) {\n"
            "            const T *qi = Q + ((b * H + h) * Tq + q_idx) * D;\n"
            "            T m = -INFINITY, l = 0;\n"
            "            for (int64_t d = 0; d < D; d++) acc[d] = 0;\n"
            "            for (int64_t n = 0; n < nb; n++) {\n"
            "                const int64_t k0 = kvl[n] * blk, k1 = k0 + blk < Tk ? k0 + blk : Tk;\n"
            "                for (int64_t kv_idx = k0; kv_idx < k1; kv_idx++) {\n");
    gen g = {.f = f, .f64 = f64};
    if (f->ps[1]) {
        g.ps = f->ps[1];
        put(&b, "                    if (n >= nf && !(");
        emit(&g, f->ps[1]->root, &b);
        put(&b, ")) continue;\n");
    }
    put(&b, "                    const T *kj = K + ((b * Hkv + hk) * Tk + kv_idx) * D;\n"
            "                    T score = 0;\n"
            "                    for (int64_t d = 0; d < D; d++) score += qi[d] * kj[d];\n"
            "                    score *= scale;\n");
    if (f->ps[0]) {
        g.ps = f->ps[0];
        put(&b, "                    score = (T)(");
        emit(&g, f->ps[0]->root, &b);
        put(&b, ");\n");
    }
    put(&b, "                    if (!(score > -INFINITY)) continue; /* a key scored out, or NaN */\n"
            "                    const T *vj = V + ((b * Hkv + hk) * Tk + kv_idx) * D;\n"
            "                    if (score > m) {\n"
            "                        const T c = %s(m - score);\n"
            "                        l *= c;\n"
            "                        for (int64_t d = 0; d < D; d++) acc[d] *= c;\n"
            "                        m = score;\n"
            "                    }\n"
            "                    const T p = %s(score - m);\n"
            "                    l += p;\n"
            "                    for (int64_t d = 0; d < D; d++) acc[d] += p * vj[d];\n"
            "                }\n            }\n"
            "            T *yi = Y + ((b * H + h) * Tq + q_idx) * D;\n"
            "            for (int64_t d = 0; d < D; d++) yi[d] = l > 0 ? acc[d] / l : 0;\n"
            "            L[(b * H + h) * Tq + q_idx] = l > 0 ? m + %s(l) : -INFINITY;\n"
            "        }\n    }\n}\n",
        f64 ? "exp" : "expf", f64 ? "exp" : "expf", f64 ? "log" : "logf");
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

/* The built kernels of every flex (by the text of its modifiers and captured dtypes,
 * so that two flex objects with the same expressions share them). */
typedef struct built {
    char *key;
    flex_fwd_fn fn;
    struct built *next;
} built;
static built *kernels;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static kiln_status kernel_for(const kiln_flex_t *f, bool f64, flex_fwd_fn *out)
{
    char caps[64] = "";
    for (int i = 0; i < f->n_cap; i++) caps[i] = (char)('a' + kiln_tensor_dtype(f->cap[i]));
    size_t kn = strlen(f->score) + strlen(f->mask) + 80;
    char *key = malloc(kn);
    if (!key) return kiln_error(KILN_ERR_OOM, "flex: out of memory");
    snprintf(key, kn, "%d|%s|%s|%s", f64, caps, f->score, f->mask);
    pthread_mutex_lock(&lock);
    kiln_status s = KILN_OK;
    built *k = kernels;
    while (k && strcmp(k->key, key)) k = k->next;
    if (!k) {
        char *src = source(f, f64);
        void *lib = NULL;
        s = src ? kiln__jit_open(src, NULL, &lib) : kiln_error(KILN_ERR_OOM, "flex: out of memory for the kernel's source");
        free(src);
        flex_fwd_fn fn = NULL;
        if (s == KILN_OK && !(*(void **)&fn = dlsym(lib, "flex_fwd")))
            s = kiln_error(KILN_ERR_IO, "flex: the built kernel has no flex_fwd (a stale kernel cache? remove it)");
        if (s == KILN_OK && (k = malloc(sizeof *k))) {
            *k = (built){key, fn, kernels};
            kernels = k;
            key = NULL;
        } else if (s == KILN_OK) {
            s = kiln_error(KILN_ERR_OOM, "flex: out of memory");
        }
    }
    if (s == KILN_OK) *out = k->fn;
    pthread_mutex_unlock(&lock);
    free(key);
    return s;
}

typedef struct {
    flex_fwd_fn fn;
    const flex_args *a;
} run_ctx;

static void run(void *ctx, int64_t t0, int64_t t1)
{
    const run_ctx *r = ctx;
    r->fn(r->a, t0, t1);
}

kiln_status kiln__flex_fused_forward(const kiln_flex_t *f, const kiln_block_mask_t *bm, kiln_tensor_t *q,
                                     kiln_tensor_t *k, kiln_tensor_t *v, double scale, kiln_tensor_t **y,
                                     kiln_tensor_t **lse, bool *ran)
{
    *ran = false;
    kiln__backend *cpu = kiln__backend_at(0);
    kiln_dtype F = q->dtype;
    if (q->st->be != cpu || k->st->be != cpu || v->st->be != cpu || q->shape[3] > MAX_D)
        return KILN_OK; /* the dense path: another device, or rows wider than the kernel's buffer */
    for (int i = 0; i < f->n_cap; i++)
        if (f->cap[i]->st->be != cpu || kiln_tensor_ndim(f->cap[i]) > 4) return KILN_OK;
    flex_fwd_fn fn = NULL;
    kiln_status s = kernel_for(f, F == KILN_DTYPE_F64, &fn);
    if (s != KILN_OK) return s;
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], D = q->shape[3], Tk = k->shape[2];
    kiln_block_mask_t *own = NULL;
    if (!bm) { /* one made for this call */
        int64_t block = 64;
        if ((s = kiln_block_mask_new(f, B, H, Tq, Tk, block, &own)) != KILN_OK) return s;
        bm = own;
    }
    kiln_tensor_t *qc = kiln_contiguous(q), *kc = kiln_contiguous(k), *vc = kiln_contiguous(v);
    int64_t ls[3] = {B, H, Tq};
    kiln_tensor_t *yo = kiln_empty(q->shape, 4, F), *lo = kiln_empty(ls, 3, F);
    int32_t bad = 0;
    flex_args a = {.B = B, .H = H, .Hkv = k->shape[1], .Tq = Tq, .Tk = Tk, .D = D, .mB = bm->B, .mH = bm->H,
                   .nq = bm->nq, .block = bm->block, .scale = scale, .n_full = bm->n_full, .n_partial = bm->n_partial,
                   .start = bm->start, .kv = bm->kv, .bad = &bad};
    kiln_tensor_t *caps[MAX_CAPTURED] = {0};
    for (int i = 0; i < f->n_cap; i++) {
        caps[i] = kiln_contiguous(f->cap[i]);
        if (!caps[i]) break;
        a.cap[i] = kiln__data(caps[i]);
        for (int d = 0; d < 4; d++) a.cap_dim[i][d] = d < caps[i]->ndim ? caps[i]->shape[d] : 1;
    }
    if (!qc || !kc || !vc || !yo || !lo || (f->n_cap && !caps[f->n_cap - 1])) {
        kiln_block_mask_free(own);
        return kiln_last_status();
    }
    a.q = kiln__data(qc), a.k = kiln__data(kc), a.v = kiln__data(vc), a.y = kiln__data(yo), a.lse = kiln__data(lo);
    run_ctx r = {fn, &a};
    kiln__parallel_for(B * H * bm->nq, 1, run, &r);
    kiln_block_mask_free(own);
    if (bad)
        return kiln_error(KILN_ERR_INDEX, "flex_attention: the modifiers read c%d outside its shape %s (%s / %s)",
                          bad - 1, kiln__shape_text(f->cap[bad - 1]), *f->score ? f->score : "-",
                          *f->mask ? f->mask : "-");
    *y = yo;
    *lse = lo;
    *ran = true;
    return KILN_OK;
}
