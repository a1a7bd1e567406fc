/* Flex attention's fused forward on the cpu. One task per (b, h, query block): the
 * scores of the block's rows against the key blocks the block mask lists (empty ones
 * never), side by side in a tile buffer, each a GEMM on the BLAS; the modifiers applied
 * to the tile by a generated function (the expressions' trees written as C: the score
 * modifier on every score, the mask only in the partial blocks); the row softmax; and
 * O = P V, a GEMM per block. No (Tq, Tk) matrix is held: a tile is one query block's
 * rows. The generated function is built through the compiler's kernel cache
 * (src/compile/jit.c) once per modifiers, dtype and captured tensors' dtypes. A call
 * that needs gradients takes the dense path (flex.c). */
#include <cblas.h>
#include <dlfcn.h>
#include <stdatomic.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/opts.h"
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
        int64_t B, H, Hkv, Tq, Tk, D, mB, mH, nq, block, kv_block;                                     \
        double scale;                                                                                  \
        const int32_t *n_full, *n_partial;                                                             \
        const int64_t *start, *kv;                                                                     \
        int32_t *bad;                                                                                  \
    } flex_args;
FLEX_ARGS
#define STR_(...) #__VA_ARGS__
#define STR(...) STR_(__VA_ARGS__)


/* The generated tile modifier (float or double scores). */
typedef void (*flex_tile_fn)(const flex_args *a, void *S, int64_t ld, int64_t b, int64_t h, int64_t q0, int64_t rows,
                             const int64_t *kvl, int64_t nf, int64_t nb, void *L);

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

/* The kernel's source for f in f32 or f64: flex_tile applies the modifiers to a tile of
 * scores S (rows from query q0, ld apart), whose columns are the key blocks kvl[0..nb)
 * side by side: the score modifier on every score, the mask only in the partial blocks
 * (n >= nf), a masked score made -inf; then each row's softmax in place and its
 * log-sum-exp in L[i] (a row that sees no key: zeros and -inf). Compiled with the
 * kernel cache's flags (-O3 -march=native), its loops vectorize. */
static char *source(const kiln_flex_t *f, bool f64)
{
    sbuf b = {0};
    const char *T = f64 ? "double" : "float";
    put(&b, "/* Generated by kiln %s: flex attention's tile modifier (%s).\n   score_mod: %s\n   mask_mod: %s */\n",
        KILN_VERSION, T, *f->score ? f->score : "(none)", *f->mask ? f->mask : "(none)");
    put(&b, "%s\n%s\n", kiln__codegen_prelude_c(), STR(FLEX_ARGS));
    put(&b, "static inline int64_t flex_at(int64_t i, int64_t n, int32_t *bad, int32_t which)\n"
            "{\n    if (i < 0 || i >= n) {\n        *bad = which;\n        return 0;\n    }\n    return i;\n}\n"
            "static inline int64_t flex_imin(int64_t x, int64_t y) { return x < y ? x : y; }\n"
            "static inline int64_t flex_imax(int64_t x, int64_t y) { return x > y ? x : y; }\n"
            "static inline int64_t flex_iabs(int64_t x) { return x < 0 ? -x : x; }\n\n");
    put(&b, "void flex_tile(const flex_args *a, %s *S, int64_t ld, int64_t b, int64_t h, int64_t q0, int64_t rows,\n"
            "               const int64_t *kvl, int64_t nf, int64_t nb, %s *L)\n{\n", T, T);
    put(&b, "    typedef %s T;\n    const int64_t q_len = a->Tq, kv_len = a->Tk, blk = a->kv_block;\n"
            "    (void)q_len, (void)b, (void)h;\n", T);
    put(&b, "    for (int64_t i = 0; i < rows; i++) {\n        const int64_t q_idx = q0 + i;\n"
            "        T *row = S + i * ld;\n        int64_t off = 0;\n        (void)q_idx;\n"
            "        for (int64_t n = 0; n < nb; n++) {\n"
            "            const int64_t k0 = kvl[n] * blk, w = k0 + blk < kv_len ? blk : kv_len - k0;\n"
            "            T *s = row + off;\n            off += w;\n");
    gen g = {.f = f, .f64 = f64};
    if (f->ps[1]) {
        g.ps = f->ps[1];
        put(&b, "            if (n >= nf) {\n                for (int64_t j = 0; j < w; j++) {\n"
                "                    const int64_t kv_idx = k0 + j;\n                    const T score = s[j];\n"
                "                    s[j] = (");
        emit(&g, f->ps[1]->root, &b);
        put(&b, ") ? (T)(");
        if (f->ps[0]) {
            g.ps = f->ps[0];
            emit(&g, f->ps[0]->root, &b);
        } else {
            put(&b, "score");
        }
        put(&b, ") : (T)-INFINITY;\n                }\n                continue;\n            }\n");
    }
    if (f->ps[0]) {
        g.ps = f->ps[0];
        put(&b, "            for (int64_t j = 0; j < w; j++) {\n                const int64_t kv_idx = k0 + j;\n"
                "                const T score = s[j];\n                s[j] = (T)(");
        emit(&g, f->ps[0]->root, &b);
        put(&b, ");\n            }\n");
    }
    /* the row's softmax, in lanes the vectorizer takes (max and sum in 16 and 8
     * independent lanes; the sum in double) */
    put(&b, "        }\n"
            "        T mx[16];\n        for (int l = 0; l < 16; l++) mx[l] = (T)-INFINITY;\n"
            "        int64_t j = 0;\n"
            "        for (; j + 16 <= ld; j += 16)\n"
            "            for (int l = 0; l < 16; l++) mx[l] = row[j + l] > mx[l] ? row[j + l] : mx[l];\n"
            "        T m = (T)-INFINITY;\n        for (int l = 0; l < 16; l++) m = mx[l] > m ? mx[l] : m;\n"
            "        for (; j < ld; j++) m = row[j] > m ? row[j] : m;\n"
            "        if (!(m > (T)-INFINITY)) { /* no key seen */\n"
            "            for (j = 0; j < ld; j++) row[j] = 0;\n            L[i] = (T)-INFINITY;\n            continue;\n"
            "        }\n"
            "        for (j = 0; j < ld; j++) row[j] = %s(row[j] - m);\n"
            "        double acc[8] = {0}, sum = 0;\n"
            "        for (j = 0; j + 8 <= ld; j += 8)\n            for (int l = 0; l < 8; l++) acc[l] += row[j + l];\n"
            "        for (; j < ld; j++) sum += row[j];\n"
            "        for (int l = 0; l < 8; l++) sum += acc[l];\n"
            "        const T inv = (T)(1 / sum);\n"
            "        for (j = 0; j < ld; j++) row[j] *= inv;\n"
            "        L[i] = (T)((double)m + log(sum));\n"
            "    }\n}\n", f64 ? "exp" : "km_exp_fast");
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
    flex_tile_fn fn;
    struct built *next;
} built;
static built *kernels;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static kiln_status kernel_for(const kiln_flex_t *f, bool f64, flex_tile_fn *out)
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
        flex_tile_fn fn = NULL;
        if (s == KILN_OK && !(*(void **)&fn = dlsym(lib, "flex_tile")))
            s = kiln_error(KILN_ERR_IO, "flex: the built kernel has no flex_tile (a stale kernel cache? remove it)");
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
    flex_tile_fn fn;
    const flex_args *a;
    atomic_int oom;
} run_ctx;

/* One task per (b, h, query block): the scores of its rows against the listed key
 * blocks, side by side in S (a GEMM each, A B^T on K's rows), the tile modifier, the
 * softmax of each row, and O = P V (a GEMM each, summed). R is float or double. */
#define FLEX_FORWARD(SFX, R, GEMM)                                                                \
    static void fwd_##SFX(void *ctx, int64_t t0, int64_t t1)                                              \
    {                                                                                                       \
        run_ctx *rc = ctx;                                                                                  \
        const flex_args *a = rc->a;                                                                         \
        const int64_t H = a->H, G = a->H / a->Hkv, Tq = a->Tq, Tk = a->Tk, D = a->D, blk = a->block;       \
        const int64_t kvb = a->kv_block;                                                                    \
        /* S: the tile; Kt: K of the (b, kv head) the tasks are at, transposed (D, Tk), so that    \
         * Q K^T is an NN GEMM (the BLAS runs it faster than NT: cpu_fused_impl.h) */               \
        R *S = malloc(sizeof(R) * (size_t)(blk * (Tk + kvb) + D * Tk));                                    \
        if (!S) {                                                                                           \
            atomic_store(&rc->oom, 1);                                                                      \
            return;                                                                                         \
        }                                                                                                   \
        R *Kt = S + blk * (Tk + kvb);                                                                       \
        int64_t kt_of = -1;                                                                                 \
        for (int64_t t = t0; t < t1; t++) {                                                                 \
            const int64_t qb = t % a->nq, bh = t / a->nq, b = bh / H, h = bh % H, hk = h / G;              \
            const int64_t r = ((a->mB == 1 ? 0 : b) * a->mH + (a->mH == 1 ? 0 : h)) * a->nq + qb;          \
            const int64_t nf = a->n_full[r], nb = nf + a->n_partial[r], *kvl = a->kv + a->start[r];        \
            const int64_t q0 = qb * blk, rows = q0 + blk < Tq ? blk : Tq - q0;                             \
            const R *Q = (const R *)a->q + ((b * H + h) * Tq + q0) * D;                                     \
            const R *K = (const R *)a->k + (b * a->Hkv + hk) * Tk * D;                                      \
            const R *V = (const R *)a->v + (b * a->Hkv + hk) * Tk * D;                                      \
            R *O = (R *)a->y + ((b * H + h) * Tq + q0) * D, *L = (R *)a->lse + (b * H + h) * Tq + q0;      \
            int64_t cols = 0;                                                                               \
            for (int64_t n = 0; n < nb; n++) {                                                              \
                int64_t k0 = kvl[n] * kvb, w = k0 + kvb < Tk ? kvb : Tk - k0;                               \
                cols += w;                                                                                  \
            }                                                                                               \
            if (cols == 0) {                                                                                \
                memset(O, 0, sizeof(R) * (size_t)(rows * D));                                              \
                for (int64_t i = 0; i < rows; i++) L[i] = (R)-INFINITY;                                    \
                continue;                                                                                   \
            }                                                                                               \
            if (kt_of != b * a->Hkv + hk) {                                                                 \
                for (int64_t j0 = 0; j0 < Tk; j0 += 16)                                                     \
                    for (int64_t d0 = 0; d0 < D; d0 += 16)                                                  \
                        for (int64_t j = j0; j < j0 + 16 && j < Tk; j++)                                    \
                            for (int64_t d = d0; d < d0 + 16 && d < D; d++) Kt[d * Tk + j] = K[j * D + d];  \
                kt_of = b * a->Hkv + hk;                                                                    \
            }                                                                                               \
            /* a run of listed blocks that follow each other in K: one GEMM */                         \
            for (int64_t n = 0, off = 0, e; n < nb; n = e) {                                                \
                int64_t k0 = kvl[n] * kvb, w = 0;                                                           \
                for (e = n; e < nb && kvl[e] == kvl[n] + (e - n); e++)                                      \
                    w += kvl[e] * kvb + kvb < Tk ? kvb : Tk - kvl[e] * kvb;                                 \
                GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)w, (int)D, (R)a->scale, Q, (int)D, \
                     Kt + k0, (int)Tk, 0, S + off, (int)cols);                                              \
                off += w;                                                                                   \
            }                                                                                               \
            rc->fn(a, S, cols, b, h, q0, rows, kvl, nf, nb, L); /* modifiers, softmax, L */          \
            for (int64_t n = 0, off = 0, e; n < nb; n = e) {                                                \
                int64_t k0 = kvl[n] * kvb, w = 0;                                                           \
                for (e = n; e < nb && kvl[e] == kvl[n] + (e - n); e++)                                      \
                    w += kvl[e] * kvb + kvb < Tk ? kvb : Tk - kvl[e] * kvb;                                 \
                GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)D, (int)w, 1, S + off, (int)cols, \
                     V + k0 * D, (int)D, off ? 1 : 0, O, (int)D);                                            \
                off += w;                                                                                   \
            }                                                                                               \
        }                                                                                                   \
        free(S);                                                                                            \
    }
FLEX_FORWARD(f32, float, cblas_sgemm)
FLEX_FORWARD(f64, double, cblas_dgemm)

kiln_status kiln__flex_fused_forward(const kiln_flex_t *f, const kiln_block_mask_t *bm, kiln_tensor_t *q,
                                     kiln_tensor_t *k, kiln_tensor_t *v, double scale, kiln_tensor_t **y,
                                     kiln_tensor_t **lse, bool *ran)
{
    *ran = false;
    kiln__backend *cpu = kiln__backend_at(0);
    kiln_dtype F = q->dtype;
    if (q->st->be != cpu || k->st->be != cpu || v->st->be != cpu)
        return KILN_OK; /* the dense path on another device */
    for (int i = 0; i < f->n_cap; i++)
        if (f->cap[i]->st->be != cpu || kiln_tensor_ndim(f->cap[i]) > 4) return KILN_OK;
    flex_tile_fn fn = NULL;
    kiln_status s = kernel_for(f, F == KILN_DTYPE_F64, &fn);
    if (s != KILN_OK) return s;
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], D = q->shape[3], Tk = k->shape[2];
    kiln_block_mask_t *own = NULL;
    if (!bm) { /* one made for this call */
        int64_t block = 64;
        if ((s = kiln_block_mask_new(f, B, H, Tq, Tk, block, 0, &own)) != KILN_OK) return s;
        bm = own;
    }
    kiln_tensor_t *qc = kiln_contiguous(q), *kc = kiln_contiguous(k), *vc = kiln_contiguous(v);
    int64_t ls[3] = {B, H, Tq};
    kiln_tensor_t *yo = kiln_empty(q->shape, 4, F), *lo = kiln_empty(ls, 3, F);
    int32_t bad = 0;
    flex_args a = {.B = B, .H = H, .Hkv = k->shape[1], .Tq = Tq, .Tk = Tk, .D = D, .mB = bm->B, .mH = bm->H,
                   .nq = bm->nq, .block = bm->block, .kv_block = bm->kv_block, .scale = scale, .n_full = bm->n_full, .n_partial = bm->n_partial,
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
    run_ctx r = {fn, &a, 0};
    if (kiln__opt(KILN__OPT_POOL_GEMM)) /* a single-threaded BLAS: the tasks over the pool */
        kiln__parallel_for(B * H * bm->nq, 1, F == KILN_DTYPE_F64 ? fwd_f64 : fwd_f32, &r);
    else
        (F == KILN_DTYPE_F64 ? fwd_f64 : fwd_f32)(&r, 0, B * H * bm->nq);
    kiln_block_mask_free(own);
    if (atomic_load(&r.oom))
        return kiln_error(KILN_ERR_OOM, "flex_attention: out of memory for a tile buffer (%lld x %lld)",
                          (long long)bm->block, (long long)(Tk + bm->kv_block));
    if (bad)
        return kiln_error(KILN_ERR_INDEX, "flex_attention: the modifiers read c%d outside its shape %s (%s / %s)",
                          bad - 1, kiln__shape_text(f->cap[bad - 1]), *f->score ? f->score : "-",
                          *f->mask ? f->mask : "-");
    *y = yo;
    *lse = lo;
    *ran = true;
    return KILN_OK;
}
