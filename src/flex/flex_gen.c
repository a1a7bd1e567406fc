/* Flex attention's fused kernels, the kernels of two custom ops per modifiers (the
 * forward and its backward). On the cpu, the forward: one task per (b, h, query block),
 * the scores of the block's rows against the key blocks the block mask lists (empty ones
 * never), side by side in a tile buffer, each a GEMM (kiln__cpu_sgemm: the BLAS or kiln's
 * own); the modifiers applied
 * to the tile by a generated function (the expressions' trees written as C: the score
 * modifier on every score, the mask only in the partial blocks); the row softmax; and
 * O = P V, a GEMM per block. No (Tq, Tk) matrix is held: a tile is one query block's
 * rows. The generated functions are built through the compiler's kernel cache
 * (src/compile/jit.c) once per modifiers, dtype and captured tensors' dtypes. The
 * backward: one task per (b, kv head), the tiles again (FLEX_BACKWARD). On OpenCL and
 * CUDA (f32): OpenCL C or CUDA C from one generator (kiln__flex_device_source), one
 * work-item per query row for the forward and dQ, one per key row for dK and dV. A call
 * whose captured tensors want a gradient takes the dense path (flex.c). */
#include <cblas.h>
#include <dlfcn.h>
#include <stdatomic.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "backends/cpu/cpu.h"
#include "compile/compile_impl.h"
#include "core/cache.h"
#include "core/dtype.h"
#include "core/intercept.h"
#include "core/opts.h"
#include "core/threadpool.h"
#include "flex/flex_impl.h"
#include "kiln/op.h"
#include "kiln/ops.h"

/* The kernel's arguments: the same text compiles into kiln and into the generated
 * source, so the two agree on the layout. */
#define FLEX_ARGS                                                                                           \
    typedef struct {                                                                                        \
        const void *q, *k, *v;                                                                              \
        void *y, *lse;                                                                                      \
        const void *cap[8];                                                                                 \
        int64_t cap_dim[8][4];                                                                              \
        int64_t B, H, Hkv, Tq, Tk, D, mB, mH, nq, block, kv_block;                                          \
        double scale;                                                                                       \
        const int32_t *n_full, *n_partial;                                                                  \
        const int64_t *start, *kv;                                                                          \
        int32_t *bad;                                                                                       \
    } flex_args;
FLEX_ARGS
#define STR_(...) #__VA_ARGS__
#define STR(...) STR_(__VA_ARGS__)


/* The generated tile modifier (float or double scores): the mask on the partial blocks
 * and the score modifier, in place; and the same followed by each row's softmax and
 * log-sum-exp (KILN_OPT_ATT_ROW_EXP off). */
typedef void (*flex_tile_fn)(const flex_args *a, void *S, int64_t ld, int64_t b, int64_t h, int64_t q0, int64_t rows,
                             const int64_t *kvl, int64_t nf, int64_t nb);
typedef void (*flex_tile_softmax_fn)(const flex_args *a, void *S, int64_t ld, int64_t b, int64_t h, int64_t q0,
                                     int64_t rows, const int64_t *kvl, int64_t nf, int64_t nb, void *L);

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

/* Each node's type, found once: emitting a binary node asks its operands' types, and
 * asking by emitting them again would take time exponential in the tree's depth (a
 * sum of 250 terms never finished). t[i] is the type + 1, 0 while unknown; for ps's
 * nodes only. */
typedef struct {
    const void *ps;
    unsigned char t[MAX_NODES];
} gmemo;

typedef struct {
    const kiln_flex_t *f;
    gmemo *memo; /* NULL: types found by emitting again */
    const parser *ps;
    bool f64;
    int which; /* 0: score_mod, 1: mask_mod */
    bool cl;   /* OpenCL C or CUDA C: captured tensors in GLOBAL memory (the dialect's macro) */
} gen;

static const char *ct(const gen *g, gtype t) { return t == G_FLOAT ? (g->f64 ? "double" : "float") : t == G_INT ? "int64_t" : "int"; }

/* Node i as C in b; its type. */
static gtype emit(const gen *g, int i, sbuf *b);

static gtype typed(const gen *g, int i)
{
    gmemo *m = g->memo;
    if (m && m->ps != (const void *)g->ps) memset(m->t, 0, sizeof m->t), m->ps = g->ps;
    if (m && i >= 0 && i < MAX_NODES && m->t[i]) return (gtype)(m->t[i] - 1);
    sbuf scratch = {0};
    gtype t = emit(g, i, &scratch);
    free(scratch.s);
    if (m && i >= 0 && i < MAX_NODES) m->t[i] = (unsigned char)(t + 1);
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
        bool half = kiln__is_half(dt);
        const char *raw = dt == KILN_DTYPE_F32 ? "float" : dt == KILN_DTYPE_F64 ? "double" : dt == KILN_DTYPE_I64 ? "int64_t"
                        : dt == KILN_DTYPE_I32 ? "int32_t" : half ? "uint16_t" : "uint8_t";
        gtype t = (gtype)kiln__flex_elem_type(dt);
        /* a 16-bit float widened from its bits, as the generated kernels load them */
        put(b, "((%s)%s((%sconst %s *)a->cap[%d])[", ct(g, t),
            half ? (dt == KILN_DTYPE_BF16 ? "km_from_bf16(" : "km_from_f16(") : "", g->cl ? "GLOBAL " : "", raw, a->op);
        /* ((i0 * d1 + i1) * d2 + i2) ... */
        for (int d = 1; d < a->n_arg; d++) put(b, "(");
        for (int d = 0; d < a->n_arg; d++) {
            if (d) put(b, " * a->cap_dim[%d][%d] + ", a->op, d);
            put(b, "flex_at(");
            emit_as(g, a->arg[d], G_INT, b);
            put(b, ", a->cap_dim[%d][%d], a->bad, %d)", a->op, d, a->op + 1);
            if (d) put(b, ")");
        }
        put(b, half ? "]))" : "])");
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

/* d(node i)/d(score) as a C expression of the float type: the chain rule over the tree
 * (a comparison, a logical operator or an index has none: 0). */
static void emit_d(const gen *g, int i, sbuf *b)
{
    const anode *a = &g->ps->n[i];
    const char *T = ct(g, G_FLOAT);
    switch (a->kind) {
    case A_NUM: case A_CAP: case A_NOT:
        put(b, "((%s)0)", T);
        return;
    case A_NAME:
        put(b, "((%s)%d)", T, a->op == V_SCORE);
        return;
    case A_NEG:
        put(b, "(-");
        emit_d(g, a->arg[0], b);
        put(b, ")");
        return;
    case A_TERN:
        put(b, "((");
        emit(g, a->arg[0], b);
        put(b, ") ? ");
        emit_d(g, a->arg[1], b);
        put(b, " : ");
        emit_d(g, a->arg[2], b);
        put(b, ")");
        return;
    case A_CALL:
        if (a->op == F_MIN || a->op == F_MAX) { /* the derivative of the one chosen */
            put(b, "((");
            emit_as(g, a->arg[0], G_FLOAT, b);
            put(b, a->op == F_MIN ? " <= " : " >= ");
            emit_as(g, a->arg[1], G_FLOAT, b);
            put(b, ") ? ");
            emit_d(g, a->arg[0], b);
            put(b, " : ");
            emit_d(g, a->arg[1], b);
            put(b, ")");
            return;
        }
        put(b, "(");
        emit_d(g, a->arg[0], b);
        put(b, " * ");
        switch (a->op) {
        case F_TANH:
            put(b, "((%s)1 - %s(", T, libm(g, F_TANH));
            emit_as(g, a->arg[0], G_FLOAT, b);
            put(b, ") * %s(", libm(g, F_TANH));
            emit_as(g, a->arg[0], G_FLOAT, b);
            put(b, "))");
            break;
        case F_EXP:
            put(b, "%s(", libm(g, F_EXP));
            emit_as(g, a->arg[0], G_FLOAT, b);
            put(b, ")");
            break;
        case F_LOG:
            put(b, "((%s)1 / ", T);
            emit_as(g, a->arg[0], G_FLOAT, b);
            put(b, ")");
            break;
        case F_ABS:
            put(b, "(");
            emit_as(g, a->arg[0], G_FLOAT, b);
            put(b, " < 0 ? (%s)-1 : (%s)1)", T, T);
            break;
        default: /* sqrt */
            put(b, "((%s)0.5 / %s(", T, libm(g, F_SQRT));
            emit_as(g, a->arg[0], G_FLOAT, b);
            put(b, "))");
            break;
        }
        put(b, ")");
        return;
    case A_BIN:
        break;
    }
    binop op = (binop)a->op;
    if (op >= B_LT) {
        put(b, "((%s)0)", T);
        return;
    }
    put(b, "(");
    if (op == B_ADD || op == B_SUB) {
        emit_d(g, a->arg[0], b);
        put(b, op == B_ADD ? " + " : " - ");
        emit_d(g, a->arg[1], b);
    } else if (op == B_MUL) {
        emit_d(g, a->arg[0], b);
        put(b, " * ");
        emit_as(g, a->arg[1], G_FLOAT, b);
        put(b, " + ");
        emit_as(g, a->arg[0], G_FLOAT, b);
        put(b, " * ");
        emit_d(g, a->arg[1], b);
    } else { /* (da b - a db) / b^2 */
        put(b, "(");
        emit_d(g, a->arg[0], b);
        put(b, " * ");
        emit_as(g, a->arg[1], G_FLOAT, b);
        put(b, " - ");
        emit_as(g, a->arg[0], G_FLOAT, b);
        put(b, " * ");
        emit_d(g, a->arg[1], b);
        put(b, ") / (");
        emit_as(g, a->arg[1], G_FLOAT, b);
        put(b, " * ");
        emit_as(g, a->arg[1], G_FLOAT, b);
        put(b, ")");
    }
    put(b, ")");
}

/* The forward tile functions' opening and row loop: in each row of S (ld apart, the
 * listed key blocks side by side), the mask in the partial blocks (-inf where it says
 * no) and the score modifier, in place; leaves the row loop open, `row` the row. */
static void tile_modifiers(sbuf *b, const kiln_flex_t *f, bool f64)
{
    put(b, "    typedef %s T;\n    const int64_t q_len = a->Tq, kv_len = a->Tk, blk = a->kv_block;\n"
           "    (void)q_len, (void)b, (void)h;\n", f64 ? "double" : "float");
    put(b, "    for (int64_t i = 0; i < rows; i++) {\n        const int64_t q_idx = q0 + i;\n"
           "        T *row = S + i * ld;\n        int64_t off = 0;\n        (void)q_idx;\n"
           "        for (int64_t n = 0; n < nb; n++) {\n"
           "            const int64_t k0 = kvl[n] * blk, w = k0 + blk < kv_len ? blk : kv_len - k0;\n"
           "            T *s = row + off;\n            off += w;\n");
    gmemo memo = {0};
    gen g = {.f = f, .memo = &memo, .f64 = f64};
    if (f->ps[1]) {
        g.ps = f->ps[1];
        put(b, "            if (n >= nf) {\n                for (int64_t j = 0; j < w; j++) {\n"
               "                    const int64_t kv_idx = k0 + j;\n                    const T score = s[j];\n"
               "                    s[j] = (");
        emit(&g, f->ps[1]->root, b);
        put(b, ") ? (T)(");
        if (f->ps[0]) {
            g.ps = f->ps[0];
            emit(&g, f->ps[0]->root, b);
        } else {
            put(b, "score");
        }
        put(b, ") : (T)-INFINITY;\n                }\n                continue;\n            }\n");
    }
    if (f->ps[0]) {
        g.ps = f->ps[0];
        put(b, "            for (int64_t j = 0; j < w; j++) {\n                const int64_t kv_idx = k0 + j;\n"
               "                const T score = s[j];\n                s[j] = (T)(");
        emit(&g, f->ps[0]->root, b);
        put(b, ");\n            }\n");
    }
    put(b, "        }\n");
}

/* The kernel's source for f in f32 or f64: flex_tile applies the modifiers to a tile of
 * scores S (rows from query q0, ld apart), whose columns are the key blocks kvl[0..nb)
 * side by side: the score modifier on every score, the mask only in the partial blocks
 * (n >= nf), a masked score made -inf; flex_tile_softmax does the same, then each row's
 * softmax in place and its log-sum-exp in L[i] (a row that sees no key: zeros and
 * -inf); then the backward's tiles. Compiled with the kernel cache's flags (-O3
 * -march=native), its loops vectorize. */
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
    /* the forward's tile: the modifiers alone (the softmax is the caller's,
     * kiln__cpu_att_row_exp), and with KILN_OPT_ATT_ROW_EXP off the modifiers and the
     * row's softmax in lanes the vectorizer takes (max and sum in 16 and 8 independent
     * lanes, the sum in double), as the forward ran until 2026-12-07 */
    put(&b, "void flex_tile(const flex_args *a, %s *S, int64_t ld, int64_t b, int64_t h, int64_t q0, int64_t rows,\n"
            "               const int64_t *kvl, int64_t nf, int64_t nb)\n{\n", T);
    tile_modifiers(&b, f, f64);
    put(&b, "    }\n}\n\n");
    put(&b, "void flex_tile_softmax(const flex_args *a, %s *S, int64_t ld, int64_t b, int64_t h, int64_t q0,\n"
            "                       int64_t rows, const int64_t *kvl, int64_t nf, int64_t nb, %s *L)\n{\n", T, T);
    tile_modifiers(&b, f, f64);
    put(&b, "        T mx[16];\n        for (int l = 0; l < 16; l++) mx[l] = (T)-INFINITY;\n"
            "        int64_t j = 0;\n"
            "        for (; j + 16 <= ld; j += 16)\n"
            "            for (int l = 0; l < 16; l++) mx[l] = row[j + l] > mx[l] ? row[j + l] : mx[l];\n"
            "        T m = (T)-INFINITY;\n        for (int l = 0; l < 16; l++) m = mx[l] > m ? mx[l] : m;\n"
            "        for (; j < ld; j++) m = row[j] > m ? row[j] : m;\n"
            "        if (!(m > (T)-INFINITY)) { /* no key seen, or only NaN: zeros, or NaN as the dense path */\n"
            "            int nan = 0;\n            for (j = 0; j < ld; j++) nan |= row[j] != row[j];\n"
            "            for (j = 0; j < ld; j++) row[j] = nan ? (T)NAN : 0;\n"
            "            L[i] = nan ? (T)NAN : (T)-INFINITY;\n            continue;\n"
            "        }\n"
            "        for (j = 0; j < ld; j++) row[j] = %s(row[j] - m);\n"
            "        double acc[8] = {0}, sum = 0;\n"
            "        for (j = 0; j + 8 <= ld; j += 8)\n            for (int l = 0; l < 8; l++) acc[l] += row[j + l];\n"
            "        for (; j < ld; j++) sum += row[j];\n"
            "        for (int l = 0; l < 8; l++) sum += acc[l];\n"
            "        const T inv = (T)(1 / sum);\n"
            "        for (j = 0; j < ld; j++) row[j] *= inv;\n"
            "        L[i] = (T)((double)m + log(sum));\n"
            "    }\n}\n\n", f64 ? "exp" : "km_exp_fast");
    gmemo memo = {0};
    gen g = {.f = f, .memo = &memo, .f64 = f64};
    /* the backward's tile: P = exp(score' - L) in S (0 where masked or the row sees no
     * key) and, with a score modifier, M = d score' / d score beside it. The mask and
     * the modifier in one pass over the tile, the exponentials in a second over each
     * whole row, so that both vectorize (a masked score is -inf, whose exp is 0). */
    put(&b, "void flex_tile_bwd(const flex_args *a, %s *S, %s *M, int64_t ld, int64_t b, int64_t h, int64_t q0,\n"
            "                   int64_t rows, const int64_t *kvl, int64_t nf, int64_t nb, const %s *L)\n{\n", T, T, T);
    put(&b, "    typedef %s T;\n    const int64_t q_len = a->Tq, kv_len = a->Tk, blk = a->kv_block;\n"
            "    (void)q_len, (void)b, (void)h, (void)nf, (void)M;\n"
            "    for (int64_t i = 0; i < rows; i++) {\n        const int64_t q_idx = q0 + i;\n"
            "        const T Li = L[i];\n        T *row = S + i * ld, *mrow = M + i * ld;\n"
            "        (void)q_idx, (void)mrow;\n"
            "        if (Li == (T)-INFINITY) { /* the row sees no key: P 0, and M too (dS reads it); a NaN L\n"
            "                                   * (a NaN score) goes on, NaN, as the dense path's gradients */\n"
            "            for (int64_t j = 0; j < ld; j++) row[j] = 0;\n%s            continue;\n        }\n"
            "        int64_t off = 0;\n"
            "        for (int64_t n = 0; n < nb; n++) {\n"
            "            const int64_t k0 = kvl[n] * blk, w = k0 + blk < kv_len ? blk : kv_len - k0;\n"
            "            T *s = row + off, *md = mrow + off;\n            off += w;\n            (void)md;\n", T,
        f->ps[0] ? "            for (int64_t j = 0; j < ld; j++) mrow[j] = 0;\n" : "");
    if (f->ps[1]) { /* a partial block: the mask, and the modifier where it lets through */
        put(&b, "            if (n >= nf) {\n                for (int64_t j = 0; j < w; j++) {\n"
                "                    const int64_t kv_idx = k0 + j;\n                    const T score = s[j];\n"
                "                    const int ok = (");
        g.ps = f->ps[1];
        emit(&g, f->ps[1]->root, &b);
        put(&b, ") != 0;\n");
        if (f->ps[0]) {
            g.ps = f->ps[0];
            /* the modifier only where the mask lets through: it may index a captured
             * tensor by positions that only the mask keeps in range */
            put(&b, "                    md[j] = ok ? (T)(");
            emit_d(&g, f->ps[0]->root, &b);
            put(&b, ") : 0;\n                    s[j] = ok ? (T)(");
            emit(&g, f->ps[0]->root, &b);
            put(&b, ") : (T)-INFINITY;\n");
        } else {
            put(&b, "                    s[j] = ok ? score : (T)-INFINITY;\n");
        }
        put(&b, "                }\n                continue;\n            }\n");
    }
    if (f->ps[0]) {
        g.ps = f->ps[0];
        put(&b, "            for (int64_t j = 0; j < w; j++) {\n                const int64_t kv_idx = k0 + j;\n"
                "                const T score = s[j];\n                (void)kv_idx;\n                const T sp = (T)(");
        emit(&g, f->ps[0]->root, &b);
        put(&b, ");\n                md[j] = (T)(");
        emit_d(&g, f->ps[0]->root, &b);
        put(&b, ");\n                s[j] = sp;\n            }\n");
    }
    put(&b, "        }\n        for (int64_t j = 0; j < ld; j++) row[j] = %s(row[j] - Li);\n    }\n}\n\n",
        f64 ? "exp" : "km_exp_fast");
    /* scale dS = scale P (dP - Dm) M in place in dP (without a score modifier M is 1 and
     * not read): scaled here, so that the accumulating products of dQ and dK have alpha 1 */
    put(&b, "void flex_tile_ds(const %s *P, %s *dP, const %s *M, int64_t ld, int64_t rows, const %s *Dm, double scale)\n{\n"
            "    (void)M;\n    const %s sc = (%s)scale;\n    for (int64_t i = 0; i < rows; i++) {\n"
            "        const %s *p = P + i * ld, *m = M + i * ld, d = Dm[i];\n        %s *g = dP + i * ld;\n"
            "        (void)m;\n        for (int64_t j = 0; j < ld; j++) g[j] = p[j] * (g[j] - d)%s * sc;\n    }\n}\n\n",
        T, T, T, T, T, T, T, T, f->ps[0] ? " * m[j]" : "");
    /* the block mask's classifier: how many of block (qb, kb)'s pairs the mask lets
     * through, for the key blocks kb0..kb1 of one (b, h, qb), into on[] */
    put(&b, "void flex_blocks(const flex_args *a, int64_t b, int64_t h, int64_t qb, int64_t kb0, int64_t kb1, int64_t *on)\n"
            "{\n    const int64_t q_len = a->Tq, kv_len = a->Tk, qblk = a->block, kvb = a->kv_block;\n"
            "    (void)q_len, (void)b, (void)h;\n"
            "    const int64_t q0 = qb * qblk, q1 = q0 + qblk < q_len ? q0 + qblk : q_len;\n"
            "    for (int64_t kb = kb0; kb < kb1; kb++) {\n"
            "        const int64_t k0 = kb * kvb, k1 = k0 + kvb < kv_len ? k0 + kvb : kv_len;\n"
            "        int64_t n = 0;\n"
            "        for (int64_t q_idx = q0; q_idx < q1; q_idx++)\n"
            "            for (int64_t kv_idx = k0; kv_idx < k1; kv_idx++) n += (");
    if (f->ps[1]) {
        g.ps = f->ps[1];
        emit(&g, f->ps[1]->root, &b);
    } else {
        put(&b, "1");
    }
    put(&b, ") != 0;\n        on[kb - kb0] = n;\n    }\n}\n");
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

/* ---- OpenCL and CUDA: one work-item per query row (the forward, dQ) or key row (dK, dV) ---- */

/* The dialects' words, as macros at the top of the source. */
static const char cl_words[] =
    "#define GLOBAL __global\n#define LONG long\n#define ULONG ulong\n#define UCHAR uchar\n"
    "#define GID ((LONG)get_global_id(0))\n#define KERNEL __kernel void\n#define FN inline\n"
    "#define EXPF exp\n#define LOGF log\n";
static const char cuda_words[] =
    "#define GLOBAL\n#define LONG long long\n#define ULONG unsigned long long\n#define UCHAR unsigned char\n"
    "#define GID ((LONG)blockIdx.x * blockDim.x + threadIdx.x)\n#define KERNEL extern \"C\" __global__ void\n"
    "#define FN __device__ inline\n#define EXPF expf\n#define LOGF logf\n";

/* A kernel's opening: its name and own buffers, then what every kernel takes (a block
 * list: counts of full and partial blocks, starts and block indices; the captured
 * tensors; the bad flag; the sizes, nblk being the list's blocks per (b, h); the scale;
 * the captured tensors' dims), and the captured tensors set up for the expressions. */
static void dev_open(sbuf *b, const char *name, const char *bufs)
{
    put(b, "KERNEL %s(%s,\n"
           "    GLOBAL int *nfull, ULONG nfo, GLOBAL int *npart, ULONG npo, GLOBAL LONG *start, ULONG sto,\n"
           "    GLOBAL LONG *list, ULONG lso, GLOBAL UCHAR *c0, ULONG c0o, GLOBAL UCHAR *c1, ULONG c1o, GLOBAL int *bad, ULONG bo,\n"
           "    LONG B, LONG H, LONG Hkv, LONG q_len, LONG kv_len, LONG D, LONG mB, LONG mH, LONG nblk, LONG blk, LONG kvb,\n"
           "    float scale, LONG c00, LONG c01, LONG c02, LONG c03, LONG c10, LONG c11, LONG c12, LONG c13)\n{\n"
           "    flex_args A;\n    flex_args *a = &A;\n    (void)a;\n"
           "    A.cap[0] = c0 + c0o;\n    A.cap[1] = c1 + c1o;\n"
           "    A.cap_dim[0][0] = c00, A.cap_dim[0][1] = c01, A.cap_dim[0][2] = c02, A.cap_dim[0][3] = c03;\n"
           "    A.cap_dim[1][0] = c10, A.cap_dim[1][1] = c11, A.cap_dim[1][2] = c12, A.cap_dim[1][3] = c13;\n"
           "    A.bad = AT(int, bad, bo);\n", name, bufs);
}

/* `if (the block is partial and the mask says no) continue;` (nothing without a mask). */
static void dev_mask_skip(sbuf *b, gen *g, const char *ind)
{
    if (!g->f->ps[1]) return;
    g->ps = g->f->ps[1];
    put(b, "%sif (n >= nf && !(", ind);
    emit(g, g->f->ps[1]->root, b);
    put(b, ")) continue;\n");
}

/* The backward's pair (qi, kj): the score, sp = score_mod(score), md = d sp / d score,
 * p = exp(sp - L) (a masked score skipped), dp = dO . v, ds = p (dp - Dm) md scale. */
static void dev_pair_bwd(sbuf *b, gen *g, const char *ind)
{
    put(b, "%sfloat score = 0;\n%sfor (LONG d = 0; d < D; d++) score += qi[d] * kj[d];\n%sscore *= scale;\n", ind, ind,
        ind);
    put(b, "%sconst float sp = (float)(", ind);
    if (g->f->ps[0]) {
        g->ps = g->f->ps[0];
        emit(g, g->f->ps[0]->root, b);
    } else {
        put(b, "score");
    }
    put(b, ");\n%sconst float md = (float)(", ind);
    if (g->f->ps[0]) emit_d(g, g->f->ps[0]->root, b);
    else put(b, "1");
    put(b, ");\n%sif (sp == -INFINITY) continue;\n%sconst float p = EXPF(sp - L);\n", ind, ind);
    put(b, "%sfloat dp = 0;\n%sfor (LONG d = 0; d < D; d++) dp += doi[d] * vj[d];\n"
           "%sconst float ds = p * (dp - Dm) * md * scale;\n", ind, ind, ind);
}

/* The source of f's fused kernels (f32) in OpenCL C (cuda false) or CUDA C, rows of up to
 * 256. The forward (backward false), flex_fwd_dev: each work-item one query row (b, h,
 * q_idx), walking its block's listed key blocks with an online softmax. The backward
 * (backward true), two kernels that each own what they write (no atomics):
 * flex_bwd_dq_dev, one work-item per query row over the same key blocks, dQ = sum of
 * ds K; flex_bwd_dkv_dev, one work-item per key row (b, kv head, kv_idx) over the query
 * heads of its group and the query blocks that list its key block (the block mask
 * transposed), dV = sum of p dO and dK = sum of ds Q. Each buffer argument is a
 * (pointer, byte offset) pair, as both backends pass them. */
char *kiln__flex_device_source(const kiln_flex_t *f, bool cuda, bool backward)
{
    sbuf b = {0};
    put(&b, "/* Generated by kiln %s: flex attention's %s (%s, f32).\n   score_mod: %s\n   mask_mod: %s */\n",
        KILN_VERSION, backward ? "backward" : "forward", cuda ? "CUDA C" : "OpenCL C", *f->score ? f->score : "(none)",
        *f->mask ? f->mask : "(none)");
    put(&b, "%s\n%s\n", cuda ? kiln__codegen_prelude_cuda() : kiln__codegen_prelude_cl(), cuda ? cuda_words : cl_words);
    put(&b, "typedef struct {\n    GLOBAL const void *cap[8];\n    LONG cap_dim[8][4];\n    GLOBAL int *bad;\n} flex_args;\n"
            "FN LONG flex_at(LONG i, LONG n, GLOBAL int *bad, int which)\n"
            "{\n    if (i < 0 || i >= n) {\n        *bad = which;\n        return 0;\n    }\n    return i;\n}\n"
            "FN LONG flex_imin(LONG x, LONG y) { return x < y ? x : y; }\n"
            "FN LONG flex_imax(LONG x, LONG y) { return x > y ? x : y; }\n"
            "FN LONG flex_iabs(LONG x) { return x < 0 ? -x : x; }\n"
            "#define AT(T, p, o) ((GLOBAL T *)((GLOBAL UCHAR *)(p) + (o)))\n\n");
    gmemo memo = {0};
    gen g = {.f = f, .memo = &memo, .f64 = false, .cl = true};
    /* a query row's listed key blocks: r its row of the block mask, kl[0..nb) its blocks */
    static const char query_row[] =
        "    const LONG q_idx = gid % q_len, bh = gid / q_len, b = bh / H, h = bh % H, hk = h / (H / Hkv);\n"
        "    const LONG r = ((mB == 1 ? 0 : b) * mH + (mH == 1 ? 0 : h)) * nblk + q_idx / blk;\n"
        "    const LONG nf = AT(int, nfull, nfo)[r], nb = nf + AT(int, npart, npo)[r];\n"
        "    GLOBAL const LONG *kl = AT(LONG, list, lso) + AT(LONG, start, sto)[r];\n"
        "    GLOBAL const float *qi = AT(float, q, qo) + gid * D;\n"
        "    GLOBAL const float *K = AT(float, k, ko) + (b * Hkv + hk) * kv_len * D;\n"
        "    GLOBAL const float *V = AT(float, v, vo) + (b * Hkv + hk) * kv_len * D;\n";
    static const char key_blocks[] =
        "        const LONG k0 = kl[n] * kvb, k1 = k0 + kvb < kv_len ? k0 + kvb : kv_len;\n"
        "        for (LONG kv_idx = k0; kv_idx < k1; kv_idx++) {\n";
    if (!backward) {
        dev_open(&b, "flex_fwd_dev", "GLOBAL float *q, ULONG qo, GLOBAL float *k, ULONG ko, GLOBAL float *v, ULONG vo,\n"
                                     "    GLOBAL float *y, ULONG yo, GLOBAL float *lse, ULONG lo");
        put(&b, "    const LONG gid = GID;\n    if (gid >= B * H * q_len) return;\n%s"
                "    float m = -INFINITY, l = 0, acc[256], nan = 0;\n"
                "    int seen_nan = 0;\n"
                "    for (LONG d = 0; d < D; d++) acc[d] = 0;\n"
                "    for (LONG n = 0; n < nb; n++) {\n%s", query_row, key_blocks);
        dev_mask_skip(&b, &g, "            ");
        put(&b, "            float score = 0;\n"
                "            for (LONG d = 0; d < D; d++) score += qi[d] * K[kv_idx * D + d];\n"
                "            score *= scale;\n");
        if (f->ps[0]) {
            g.ps = f->ps[0];
            put(&b, "            score = (float)(");
            emit(&g, f->ps[0]->root, &b);
            put(&b, ");\n");
        }
        /* a NaN score makes the row NaN, as the dense path and the cpu's kernels (the
         * online maximum would pass over it) */
        put(&b, "            if (score != score) {\n                seen_nan = 1, nan = score;\n                continue;\n"
                "            }\n"
                "            if (!(score > -INFINITY)) continue;\n"
                "            if (score > m) {\n                const float c = EXPF(m - score);\n                l *= c;\n"
                "                for (LONG d = 0; d < D; d++) acc[d] *= c;\n                m = score;\n            }\n"
                "            const float p = EXPF(score - m);\n            l += p;\n"
                "            for (LONG d = 0; d < D; d++) acc[d] += p * V[kv_idx * D + d];\n"
                "        }\n    }\n"
                "    GLOBAL float *yi = AT(float, y, yo) + gid * D;\n"
                "    if (l != l) seen_nan = 1, nan = l; /* +inf scores: inf - inf, as the dense path */\n"
                "    for (LONG d = 0; d < D; d++) yi[d] = seen_nan ? nan : l > 0 ? acc[d] / l : 0;\n"
                "    AT(float, lse, lo)[gid] = seen_nan ? nan : l > 0 ? m + LOGF(l) : -INFINITY;\n}\n");
    } else {
        static const char bwd_bufs[] =
            "GLOBAL float *dO, ULONG dOo, GLOBAL float *q, ULONG qo, GLOBAL float *k, ULONG ko,\n"
            "    GLOBAL float *v, ULONG vo, GLOBAL float *lse, ULONG lo, GLOBAL float *dm, ULONG dmo";
        char bufs[512];
        snprintf(bufs, sizeof bufs, "%s,\n    GLOBAL float *dq, ULONG dqo", bwd_bufs);
        dev_open(&b, "flex_bwd_dq_dev", bufs);
        put(&b, "    const LONG gid = GID;\n    if (gid >= B * H * q_len) return;\n%s"
                "    GLOBAL const float *doi = AT(float, dO, dOo) + gid * D;\n"
                "    const float L = AT(float, lse, lo)[gid], Dm = AT(float, dm, dmo)[gid];\n"
                "    float acc[256];\n    for (LONG d = 0; d < D; d++) acc[d] = 0;\n"
                "    for (LONG n = 0; n < nb && L != -INFINITY; n++) { /* a NaN L goes on, NaN */\n%s", query_row,
                key_blocks);
        dev_mask_skip(&b, &g, "            ");
        put(&b, "            GLOBAL const float *kj = K + kv_idx * D, *vj = V + kv_idx * D;\n");
        dev_pair_bwd(&b, &g, "            ");
        put(&b, "            for (LONG d = 0; d < D; d++) acc[d] += ds * kj[d];\n        }\n    }\n"
                "    GLOBAL float *dqi = AT(float, dq, dqo) + gid * D;\n"
                "    for (LONG d = 0; d < D; d++) dqi[d] = acc[d];\n}\n\n");
        snprintf(bufs, sizeof bufs, "%s,\n    GLOBAL float *dk, ULONG dko, GLOBAL float *dv, ULONG dvo", bwd_bufs);
        dev_open(&b, "flex_bwd_dkv_dev", bufs);
        put(&b, "    const LONG gid = GID;\n    if (gid >= B * Hkv * kv_len) return;\n"
                "    const LONG kv_idx = gid %% kv_len, bk = gid / kv_len, b = bk / Hkv, hk = bk %% Hkv, G = H / Hkv;\n"
                "    GLOBAL const float *kj = AT(float, k, ko) + gid * D, *vj = AT(float, v, vo) + gid * D;\n"
                "    float ak[256], av[256];\n    for (LONG d = 0; d < D; d++) ak[d] = av[d] = 0;\n"
                "    for (LONG h = hk * G; h < hk * G + G; h++) {\n"
                "        const LONG r = ((mB == 1 ? 0 : b) * mH + (mH == 1 ? 0 : h)) * nblk + kv_idx / kvb;\n"
                "        const LONG nf = AT(int, nfull, nfo)[r], nb = nf + AT(int, npart, npo)[r];\n"
                "        GLOBAL const LONG *ql = AT(LONG, list, lso) + AT(LONG, start, sto)[r];\n"
                "        for (LONG n = 0; n < nb; n++) {\n"
                "            const LONG q0 = ql[n] * blk, q1 = q0 + blk < q_len ? q0 + blk : q_len;\n"
                "            for (LONG q_idx = q0; q_idx < q1; q_idx++) {\n");
        dev_mask_skip(&b, &g, "                ");
        put(&b, "                const LONG row = (b * H + h) * q_len + q_idx;\n"
                "                const float L = AT(float, lse, lo)[row], Dm = AT(float, dm, dmo)[row];\n"
                "                if (L == -INFINITY) continue;\n"
                "                GLOBAL const float *qi = AT(float, q, qo) + row * D, *doi = AT(float, dO, dOo) + row * D;\n");
        dev_pair_bwd(&b, &g, "                ");
        put(&b, "                for (LONG d = 0; d < D; d++) av[d] += p * doi[d], ak[d] += ds * qi[d];\n"
                "            }\n        }\n    }\n"
                "    GLOBAL float *dki = AT(float, dk, dko) + gid * D, *dvi = AT(float, dv, dvo) + gid * D;\n"
                "    for (LONG d = 0; d < D; d++) dki[d] = ak[d], dvi[d] = av[d];\n}\n");
    }
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

/* ---- the fused op ---- */

/* The generated functions, for float or double scores. */
typedef void (*flex_tile_bwd_fn)(const flex_args *a, void *S, void *M, int64_t ld, int64_t b, int64_t h, int64_t q0,
                                 int64_t rows, const int64_t *kvl, int64_t nf, int64_t nb, const void *L);
typedef void (*flex_tile_ds_fn)(const void *P, void *dP, const void *M, int64_t ld, int64_t rows, const void *Dm,
                                double scale);

/* One per modifiers (their text and the captured tensors' dtypes and dims): a template
 * flex over placeholder captured tensors of those dtypes and dims (what the code
 * generator reads), its built functions per float type, and its two custom ops
 * (kiln/op.h): the forward (q, k, v, captured... -> y, lse) and its backward (dO, q, k,
 * v, lse, Dm, captured... -> dq, dk, dv), so that autograd, capture and replay see
 * flex attention as they see any op. */
/* A block mask made and kept for one device and sizes (mB, mH: B and H where the mask
 * reads b and h, else 1). */
typedef struct {
    kiln__backend *be;
    int64_t mB, mH, Tq, Tk, block, kv_block;
    kiln_tensor_t *t;
} kept_mask;

typedef struct entry {
    char *key;
    kiln_flex_t *tmpl;
    flex_tile_fn tile[2];
    flex_tile_softmax_fn tile_softmax[2];
    flex_tile_bwd_fn tile_bwd[2];
    flex_tile_ds_fn tile_ds[2];
    void (*blocks)(const flex_args *a, int64_t b, int64_t h, int64_t qb, int64_t kb0, int64_t kb1, int64_t *on);
    struct {
        kiln__backend *be;
        void *kernel[3]; /* flex_fwd_dev, flex_bwd_dq_dev, flex_bwd_dkv_dev, each built on first use */
    } cl[4]; /* the OpenCL or CUDA kernels, per device */
    int op_fwd, op_bwd, op_mask; /* op_mask: with captured tensors, their block mask; -1: not defined yet */
    bool ready;                  /* tmpl and the ops are all there (entry_for) */
    kept_mask masks[8]; /* without captured tensors, the block masks made (per device and sizes) */
    int n_masks;
    struct entry *next;
} entry;
static entry *entries;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* e's functions for float (f64 false) or double scores, built once. Under lock. */
static kiln_status built(entry *e, bool f64)
{
    if (e->tile[f64]) return KILN_OK;
    char *src = source(e->tmpl, f64);
    void *lib = NULL;
    kiln_status s = src ? kiln__jit_open(src, NULL, &lib) : kiln_error(KILN_ERR_OOM, "flex: out of memory for a kernel");
    free(src);
    if (s != KILN_OK) return s;
    *(void **)&e->tile[f64] = dlsym(lib, "flex_tile");
    *(void **)&e->tile_softmax[f64] = dlsym(lib, "flex_tile_softmax");
    *(void **)&e->tile_bwd[f64] = dlsym(lib, "flex_tile_bwd");
    *(void **)&e->tile_ds[f64] = dlsym(lib, "flex_tile_ds");
    if (!e->blocks) *(void **)&e->blocks = dlsym(lib, "flex_blocks");
    if (!e->tile[f64] || !e->tile_softmax[f64] || !e->tile_bwd[f64] || !e->tile_ds[f64] || !e->blocks) {
        e->tile[f64] = NULL;
        return kiln_error(KILN_ERR_IO, "flex: a built kernel lacks flex_tile, flex_tile_softmax, flex_tile_bwd, "
                                       "flex_tile_ds or flex_blocks (a stale kernel cache? remove it)");
    }
    return KILN_OK;
}

typedef struct {
    flex_tile_fn fn;
    flex_tile_softmax_fn softmax;
    flex_tile_bwd_fn bwd;
    flex_tile_ds_fn ds;
    const flex_args *a;
    atomic_int oom;
} run_ctx;

/* The listed key blocks' width in all (the tile's columns). */
static int64_t cols_of(const int64_t *kvl, int64_t nb, int64_t kvb, int64_t Tk)
{
    int64_t cols = 0;
    for (int64_t n = 0; n < nb; n++) cols += kvl[n] * kvb + kvb < Tk ? kvb : Tk - kvl[n] * kvb;
    return cols;
}

/* dst (D, T) = src (T, D)^T: the cpu backend's, attention's own */
static void transpose_f32(float *dst, const float *src, int64_t T, int64_t D) { kiln__cpu_transpose_f32(dst, src, T, D, D); }
static void transpose_f64(double *dst, const double *src, int64_t T, int64_t D) { kiln__cpu_transpose_f64(dst, src, T, D, D); }

/* S (rows, cols) = alpha A X^T over the listed key blocks side by side, X being K or V
 * (Tk, D) and A the query block's Q or dO (rows, D): on X^T's panels (xt) where they
 * were taken, else on Xt, X transposed (D, Tk), for the BLAS; a run of adjacent blocks
 * one GEMM. Where the panels were taken but a product on them fails (out of memory), Xt
 * is NULL, never made: that product reads X transposed. R is float or double. */
#define FLEX_ABT(SFX, R, GEMM)                                                                              \
    static void abt_##SFX(const flex_args *a, const R *A, const R *X, const R *Xt, const kiln__gemm_panels *xt, \
                          R alpha, R *S, const int64_t *kvl, int64_t nb, int64_t rows, int64_t cols)        \
    {                                                                                                       \
        const int D = (int)a->D;                                                                            \
        for (int64_t n = 0, off = 0, e; n < nb; n = e) {                                                    \
            int64_t k0 = kvl[n] * a->kv_block, w = run_width(kvl, nb, n, a->kv_block, a->Tk, &e);           \
            if (!kiln__cpu_att_gemm_##SFX(rows, w, D, A, D, xt, 0, k0, alpha, 0, S + off, cols)) {          \
                if (Xt)                                                                                     \
                    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)w, D, alpha, A, D, Xt + k0, \
                         (int)a->Tk, 0, S + off, (int)cols);                                                \
                else                                                                                        \
                    GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)w, D, alpha, A, D, X + k0 * D, \
                         D, 0, S + off, (int)cols);                                                         \
            }                                                                                               \
            off += w;                                                                                       \
        }                                                                                                   \
    }

/* The forward. One task per (b, h, query block): the scores of its rows against the
 * listed key blocks, side by side in S (runs of adjacent blocks one GEMM each, on K^T
 * packed into kiln's GEMM's panels once per kv head, else on K transposed once per kv
 * head for the BLAS), the modifiers in the generated function, each row's
 * exponentials and log-sum-exp (kiln__cpu_att_row_exp), and O = E V by GEMM with E's rows
 * normalized afterwards in O (D values a row, not the row's keys). R is float or double. */
#define FLEX_FORWARD(SFX, R, GEMM)                                                                          \
    static void fwd_##SFX(void *ctx, int64_t t0, int64_t t1)                                                \
    {                                                                                                       \
        run_ctx *rc = ctx;                                                                                  \
        const flex_args *a = rc->a;                                                                         \
        const int64_t H = a->H, G = a->H / a->Hkv, Tq = a->Tq, Tk = a->Tk, D = a->D, blk = a->block;        \
        const int64_t kvb = a->kv_block;                                                                    \
        R *S = malloc(sizeof(R) * (size_t)(blk * (Tk + kvb) + D * Tk + blk));                               \
        if (!S) {                                                                                           \
            atomic_store(&rc->oom, 1);                                                                      \
            return;                                                                                         \
        }                                                                                                   \
        R *Kt = S + blk * (Tk + kvb), *inv = Kt + D * Tk;                                                   \
        int64_t kt_of = -1;                                                                                 \
        /* the f32 products on K^T and V packed into kiln's GEMM's panels once per kv head */              \
        kiln__cpu_att_panels kp = {0};                                                                      \
        const bool want = kiln__cpu_att_panels_wanted_##SFX(kvb), vec = kiln__opt(KILN__OPT_ATT_ROW_EXP);   \
        bool pan = false;                                                                                   \
        for (int64_t t = t0; t < t1; t++) {                                                                 \
            const int64_t qb = t % a->nq, bh = t / a->nq, b = bh / H, h = bh % H, hk = h / G;               \
            const int64_t r = ((a->mB == 1 ? 0 : b) * a->mH + (a->mH == 1 ? 0 : h)) * a->nq + qb;           \
            const int64_t nf = a->n_full[r], nb = nf + a->n_partial[r], *kvl = a->kv + a->start[r];         \
            const int64_t q0 = qb * blk, rows = q0 + blk < Tq ? blk : Tq - q0;                              \
            const R *Q = (const R *)a->q + ((b * H + h) * Tq + q0) * D;                                     \
            const R *K = (const R *)a->k + (b * a->Hkv + hk) * Tk * D;                                      \
            const R *V = (const R *)a->v + (b * a->Hkv + hk) * Tk * D;                                      \
            R *O = (R *)a->y + ((b * H + h) * Tq + q0) * D, *L = (R *)a->lse + (b * H + h) * Tq + q0;       \
            const int64_t cols = cols_of(kvl, nb, kvb, Tk);                                                 \
            if (cols == 0) {                                                                                \
                memset(O, 0, sizeof(R) * (size_t)(rows * D));                                               \
                for (int64_t i = 0; i < rows; i++) L[i] = (R)-INFINITY;                                     \
                continue;                                                                                   \
            }                                                                                               \
            if (kt_of != b * a->Hkv + hk) { /* K^T and V in panels, else K^T in Kt */                       \
                pan = want && kiln__cpu_att_pack_fwd_##SFX(&kp, K, D, V, D, Tk, D);                         \
                if (!pan) transpose_##SFX(Kt, K, Tk, D);                                                    \
                kt_of = b * a->Hkv + hk;                                                                    \
            }                                                                                               \
            abt_##SFX(a, Q, K, pan ? NULL : Kt, pan ? &kp.kt : NULL, (R)a->scale, S, kvl, nb, rows, cols); \
            if (vec) { /* the modifiers, then each row's exponentials, normalized in O below */              \
                rc->fn(a, S, cols, b, h, q0, rows, kvl, nf, nb);                                            \
                for (int64_t i = 0; i < rows; i++) {                                                        \
                    R m;                                                                                    \
                    double sum = kiln__cpu_att_row_exp_##SFX(S + i * cols, cols, &m, true);                 \
                    L[i] = sum == 0 ? (R)-INFINITY : (R)((double)m + log(sum)); /* NaN stays */             \
                    inv[i] = sum == 0 ? 0 : (R)(1 / sum);                                                   \
                }                                                                                           \
            } else { /* the modifiers and the softmax in the generated function */                         \
                rc->softmax(a, S, cols, b, h, q0, rows, kvl, nf, nb, L);                                    \
            }                                                                                               \
            for (int64_t n = 0, off = 0, e; n < nb; n = e) {                                                \
                int64_t k0 = kvl[n] * kvb, w = run_width(kvl, nb, n, kvb, Tk, &e);                          \
                if (!kiln__cpu_att_gemm_##SFX(rows, D, w, S + off, cols, pan ? &kp.v : NULL, k0, 0, 1, off ? 1 : 0, O, D)) \
                    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)D, (int)w, 1, S + off,  \
                         (int)cols, V + k0 * D, (int)D, off ? 1 : 0, O, (int)D);                            \
                off += w;                                                                                   \
            }                                                                                               \
            for (int64_t i = 0; vec && i < rows; i++)                                                       \
                for (int64_t d = 0; d < D; d++) O[i * D + d] *= inv[i];                                     \
        }                                                                                                   \
        kiln__cpu_att_panels_free(&kp);                                                                     \
        free(S);                                                                                            \
    }

/* The backward. One task per (b, kv head), so that its dK and dV have one writer: for
 * every query head of the group and query block, the scores again, P = exp(score' - L)
 * and M = d score'/d score from the generated function, dV += P^T dO, dP = dO V^T,
 * dS = scale P (dP - Dm) M (Dm: the rows' sum of dO O, less the log-sum-exp's gradient;
 * the generated function again), dQ = dS K, dK += dS^T Q; runs of adjacent key
 * blocks one GEMM each, the products with K^T, V^T and K on their panels packed once per
 * kv head (else K^T and V^T on copies transposed once per kv head, NN GEMMs, as the
 * dense attention's backward). a->y is dO, a->lse L and a->v V;
 * dq, dk, dv and Dm in the context. */
typedef struct {
    void *dq, *dk, *dv;
    const void *dm, *dO;
} grads;

#define FLEX_BACKWARD(SFX, R, GEMM)                                                                         \
    static void bwd_##SFX(void *ctx, int64_t t0, int64_t t1)                                                \
    {                                                                                                       \
        run_ctx *rc = ctx;                                                                                  \
        const flex_args *a = rc->a;                                                                         \
        const grads *gr = (const grads *)a->y;                                                              \
        const int64_t H = a->H, G = a->H / a->Hkv, Tq = a->Tq, Tk = a->Tk, D = a->D, blk = a->block;        \
        const int64_t kvb = a->kv_block, tile = blk * (Tk + kvb);                                           \
        R *P = malloc(sizeof(R) * (size_t)(3 * tile + 2 * D * Tk));                                         \
        if (!P) {                                                                                           \
            atomic_store(&rc->oom, 1);                                                                      \
            return;                                                                                         \
        }                                                                                                   \
        R *M = P + tile, *dP = M + tile, *Kt = dP + tile, *Vt = Kt + D * Tk;                                \
        /* the f32 products on K^T, V^T and K packed into kiln's GEMM's panels once per kv head */         \
        kiln__cpu_att_panels kp = {0};                                                                      \
        const bool want = kiln__cpu_att_panels_wanted_##SFX(kvb);                                           \
        for (int64_t t = t0; t < t1; t++) {                                                                 \
            const int64_t b = t / a->Hkv, hk = t % a->Hkv;                                                  \
            const R *K = (const R *)a->k + t * Tk * D, *V = (const R *)a->v + t * Tk * D;                   \
            R *dK = (R *)gr->dk + t * Tk * D, *dV = (R *)gr->dv + t * Tk * D;                               \
            memset(dK, 0, sizeof(R) * (size_t)(Tk * D));                                                    \
            memset(dV, 0, sizeof(R) * (size_t)(Tk * D));                                                    \
            const bool pan = want && kiln__cpu_att_pack_bwd_##SFX(&kp, K, D, V, D, Tk, D);                  \
            if (!pan) { /* K^T and V^T for the BLAS */                                                      \
                transpose_##SFX(Kt, K, Tk, D);                                                              \
                transpose_##SFX(Vt, V, Tk, D);                                                              \
            }                                                                                               \
            for (int64_t h = hk * G; h < (hk + 1) * G; h++)                                                 \
                for (int64_t qb = 0; qb < a->nq; qb++) {                                                    \
                    const int64_t r = ((a->mB == 1 ? 0 : b) * a->mH + (a->mH == 1 ? 0 : h)) * a->nq + qb;   \
                    const int64_t nf = a->n_full[r], nb = nf + a->n_partial[r], *kvl = a->kv + a->start[r]; \
                    const int64_t q0 = qb * blk, rows = q0 + blk < Tq ? blk : Tq - q0;                      \
                    const int64_t base = (b * H + h) * Tq + q0;                                             \
                    const R *Q = (const R *)a->q + base * D, *dO = (const R *)gr->dO + base * D;            \
                    const R *L = (const R *)a->lse + base, *Dm = (const R *)gr->dm + base;                  \
                    R *dQ = (R *)gr->dq + base * D;                                                         \
                    const int64_t cols = cols_of(kvl, nb, kvb, Tk);                                         \
                    if (cols == 0) {                                                                        \
                        memset(dQ, 0, sizeof(R) * (size_t)(rows * D));                                      \
                        continue;                                                                           \
                    }                                                                                       \
                    abt_##SFX(a, Q, K, pan ? NULL : Kt, pan ? &kp.kt : NULL, (R)a->scale, P, kvl, nb, rows, cols); \
                    rc->bwd(a, P, M, cols, b, h, q0, rows, kvl, nf, nb, L);                                 \
                    abt_##SFX(a, dO, V, pan ? NULL : Vt, pan ? &kp.vt : NULL, 1, dP, kvl, nb, rows, cols); /* dP = dO V^T */ \
                    for (int64_t n = 0, off = 0, e; n < nb; n = e) { /* dV += P^T dO */                    \
                        int64_t k0 = kvl[n] * kvb, w = run_width(kvl, nb, n, kvb, Tk, &e);                  \
                        GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)w, (int)D, (int)rows, 1, P + off, (int)cols, \
                             dO, (int)D, 1, dV + k0 * D, (int)D);                                           \
                        off += w;                                                                           \
                    }                                                                                       \
                    rc->ds(P, dP, M, cols, rows, Dm, a->scale); /* scale dS */                              \
                    for (int64_t n = 0, off = 0, e; n < nb; n = e) {                                        \
                        int64_t k0 = kvl[n] * kvb, w = run_width(kvl, nb, n, kvb, Tk, &e);                  \
                        /* dQ (+)= (scale dS) K; dK += (scale dS)^T Q */                                    \
                        if (!kiln__cpu_att_gemm_##SFX(rows, D, w, dP + off, cols, pan ? &kp.k : NULL, k0, 0, 1, off ? 1 : 0, \
                                            dQ, D))                                                         \
                            GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)D, (int)w, 1,   \
                                 dP + off, (int)cols, K + k0 * D, (int)D, off ? 1 : 0, dQ, (int)D);         \
                        GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)w, (int)D, (int)rows, 1, dP + off, \
                             (int)cols, Q, (int)D, 1, dK + k0 * D, (int)D);                                 \
                        off += w;                                                                           \
                    }                                                                                       \
                }                                                                                           \
        }                                                                                                   \
        kiln__cpu_att_panels_free(&kp);                                                                     \
        free(P);                                                                                            \
    }

/* The width of the run of adjacent key blocks from n (kvl[n], kvl[n] + 1, ...), its end
 * in *end. */
static inline int64_t run_width(const int64_t *kvl, int64_t nb, int64_t n, int64_t kvb, int64_t Tk, int64_t *end)
{
    int64_t w = 0, e = n;
    for (; e < nb && kvl[e] == kvl[n] + (e - n); e++) w += kvl[e] * kvb + kvb < Tk ? kvb : Tk - kvl[e] * kvb;
    *end = e;
    return w;
}

FLEX_ABT(f32, float, kiln__cpu_sgemm)
FLEX_ABT(f64, double, cblas_dgemm)
FLEX_FORWARD(f32, float, kiln__cpu_sgemm)
FLEX_FORWARD(f64, double, cblas_dgemm)
FLEX_BACKWARD(f32, float, kiln__cpu_sgemm)
FLEX_BACKWARD(f64, double, cblas_dgemm)

/* The arguments of a call: sizes, the block mask bm, the captured tensors' memory
 * (caps: contiguous cpu tensors). */
static void args_for(const kiln_block_mask_t *bm, kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *const *caps,
                     int n_cap, double scale, int32_t *bad, flex_args *a)
{
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], Tk = k->shape[2];
    *a = (flex_args){.B = B, .H = H, .Hkv = k->shape[1], .Tq = Tq, .Tk = Tk, .D = q->shape[3], .mB = bm->B, .mH = bm->H,
                     .nq = bm->nq, .block = bm->block, .kv_block = bm->kv_block, .scale = scale,
                     .n_full = bm->n_full, .n_partial = bm->n_partial, .start = bm->start, .kv = bm->kv, .bad = bad};
    for (int i = 0; i < n_cap; i++) {
        a->cap[i] = kiln__data(caps[i]);
        for (int d = 0; d < 4; d++) a->cap_dim[i][d] = d < caps[i]->ndim ? caps[i]->shape[d] : 1;
    }
}

/* The block mask of a call, read from its mask tensor (mask: on the cpu, or copied back
 * from a device), into *own (the caller frees it). */
static kiln_status mask_of_call(const kiln_tensor_t *mask, const kiln_tensor_t *q, const kiln_tensor_t *k,
                                kiln_block_mask_t **own)
{
    kiln__backend *be = mask->st->be;
    size_t bytes = (size_t)kiln_tensor_nbytes(mask);
    int64_t *w = be == kiln__backend_at(0) ? kiln__data((kiln_tensor_t *)mask) : malloc(bytes);
    kiln_status s = w ? KILN_OK : kiln_error(KILN_ERR_OOM, "flex_attention: out of memory");
    if (s == KILN_OK && be != kiln__backend_at(0)) s = kiln__be_copy_d2h(be, w, kiln__data((kiln_tensor_t *)mask), bytes);
    if (s == KILN_OK) s = kiln__block_mask_unpack(w, mask->shape, q->shape[0], q->shape[1], q->shape[2], k->shape[2], own);
    if (be != kiln__backend_at(0)) free(w);
    return s;
}

static kiln_status finish(const entry *e, run_ctx *r, kiln_block_mask_t *own, int32_t bad, kiln_tensor_t *const *caps)
{
    kiln_block_mask_free(own);
    if (atomic_load(&r->oom)) return kiln_error(KILN_ERR_OOM, "flex_attention: out of memory for a tile buffer");
    if (bad)
        return kiln_error(KILN_ERR_INDEX, "flex_attention: the modifiers read c%d outside its shape %s (%s / %s)", bad - 1,
                          kiln__shape_text(caps[bad - 1]), *e->tmpl->score ? e->tmpl->score : "-",
                          *e->tmpl->mask ? e->tmpl->mask : "-");
    return KILN_OK;
}

static void run(void (*fn)(void *, int64_t, int64_t), run_ctx *r, int64_t tasks)
{
    if (kiln__opt(KILN__OPT_POOL_GEMM)) kiln__parallel_for(tasks, 1, fn, r); /* a single-threaded BLAS */
    else fn(r, 0, tasks);
}

/* What both cpu kernels do first: e's functions built for q's type, and the call's
 * arguments with q at in[qi], k after it, the block mask tensor at in[ci - 1] (read
 * into *own, which the caller frees; NULL on an error) and the captured tensors from
 * in[ci]. */
static kiln_status prepare(const kiln_op_args *x, int qi, int ci, bool *f64, flex_args *a, kiln_block_mask_t **own,
                           int32_t *bad)
{
    entry *e = x->user;
    kiln_tensor_t *q = x->in[qi];
    *f64 = q->dtype == KILN_DTYPE_F64;
    pthread_mutex_lock(&lock);
    kiln_status s = built(e, *f64);
    pthread_mutex_unlock(&lock);
    if (s == KILN_OK) s = mask_of_call(x->in[ci - 1], q, x->in[qi + 1], own);
    if (s == KILN_OK) args_for(*own, q, x->in[qi + 1], x->in + ci, x->n_in - ci, x->attr[0].f, bad, a);
    return s;
}

/* The forward op's cpu kernel: in q, k, v, the block mask tensor, captured...; out y,
 * lse; attribute scale. */
static kiln_status fwd_kernel(const kiln_op_args *x)
{
    entry *e = x->user;
    flex_args a;
    kiln_block_mask_t *own = NULL;
    int32_t bad = 0;
    bool f64;
    kiln_status s = prepare(x, 0, 4, &f64, &a, &own, &bad);
    if (s != KILN_OK) return s;
    a.q = kiln__data(x->in[0]), a.k = kiln__data(x->in[1]), a.v = kiln__data(x->in[2]);
    a.y = kiln__data(x->out[0]), a.lse = kiln__data(x->out[1]);
    run_ctx r = {.fn = e->tile[f64], .softmax = e->tile_softmax[f64], .a = &a};
    run(f64 ? fwd_f64 : fwd_f32, &r, a.B * a.H * a.nq);
    return finish(e, &r, own, bad, x->in + 4);
}

/* The backward op's cpu kernel: in dO, q, k, v, lse, Dm, the block mask tensor,
 * captured...; out dq, dk, dv. */
static kiln_status bwd_kernel(const kiln_op_args *x)
{
    entry *e = x->user;
    flex_args a;
    kiln_block_mask_t *own = NULL;
    int32_t bad = 0;
    bool f64;
    kiln_status s = prepare(x, 1, 7, &f64, &a, &own, &bad);
    if (s != KILN_OK) return s;
    kiln_tensor_t *q = x->in[1];
    grads g = {kiln__data(x->out[0]), kiln__data(x->out[1]), kiln__data(x->out[2]), kiln__data(x->in[5]),
               kiln__data(x->in[0])};
    a.q = kiln__data(q), a.k = kiln__data(x->in[2]), a.v = kiln__data(x->in[3]), a.lse = kiln__data(x->in[4]);
    a.y = &g;
    run_ctx r = {.bwd = e->tile_bwd[f64], .ds = e->tile_ds[f64], .a = &a};
    run(f64 ? bwd_f64 : bwd_f32, &r, a.B * a.Hkv);
    return finish(e, &r, own, bad, x->in + 7);
}

/* ---- the OpenCL and CUDA kernels of the two ops ---- */

static const char *const dev_names[3] = {"flex_fwd_dev", "flex_bwd_dq_dev", "flex_bwd_dkv_dev"};

/* e's device kernel `which` (0 the forward, 1 dQ, 2 dK and dV) on be, built on first use
 * from kiln__flex_device_source. */
static kiln_status dev_kernel(entry *e, kiln__backend *be, int which, void **out)
{
    pthread_mutex_lock(&lock);
    kiln_status s = KILN_OK;
    int slot = 0;
    while (slot < 4 && e->cl[slot].be && e->cl[slot].be != be) slot++;
    if (slot == 4) s = kiln_error(KILN_ERR_UNSUPPORTED, "flex_attention: built for 4 devices already");
    else if (!e->cl[slot].kernel[which]) {
        char *src = kiln__flex_device_source(e->tmpl, kiln__backend_is(be, "cuda"), which > 0);
        void *kn = NULL;
        s = src ? kiln__be_compile_kernel(be, src, dev_names[which], &kn) : kiln_error(KILN_ERR_OOM, "flex: out of memory");
        free(src);
        if (s == KILN_OK) e->cl[slot].be = be, e->cl[slot].kernel[which] = kn;
    }
    *out = s == KILN_OK ? e->cl[slot].kernel[which] : NULL;
    pthread_mutex_unlock(&lock);
    return s;
}

/* What both device kernels check first: f32 rows of up to 256 (kiln__flex_fused sends
 * nothing else here). */
static kiln_status dev_fits(const kiln_tensor_t *q)
{
    if (q->dtype == KILN_DTYPE_F32 && q->shape[3] <= 256) return KILN_OK;
    return kiln_error(KILN_ERR_UNSUPPORTED, "flex_attention on %s: f32 rows of up to 256 (the dense path takes the rest)",
                      q->st->be->name);
}


/* A list of blocks per row, as the block mask keeps it: row r's n_full[r] full blocks
 * then its n_partial[r] partial ones at list[start[r]...]. */
typedef struct {
    int64_t rows, n; /* n: the blocks listed in all */
    int32_t *n_full, *n_partial;
    int64_t *start, *list;
} block_list;

static block_list mask_list(const kiln_block_mask_t *bm)
{
    int64_t rows = bm->B * bm->H * bm->nq;
    return (block_list){rows, bm->start[rows - 1] + bm->n_full[rows - 1] + bm->n_partial[rows - 1], bm->n_full,
                        bm->n_partial, bm->start, bm->kv};
}

static void list_free(block_list *t)
{
    free(t->n_full), free(t->n_partial), free(t->start), free(t->list);
}

/* The block mask transposed, for the dK and dV kernel: for each (b, h, key block) of the
 * mask, the query blocks that list it, full ones then partial ones, each in ascending
 * order. A counting sort over the listed blocks: O(blocks). */
static kiln_status transposed(const kiln_block_mask_t *bm, block_list *t)
{
    const block_list m = mask_list(bm);
    const int64_t nq = bm->nq, nk = bm->nk;
    *t = (block_list){.rows = bm->B * bm->H * nk, .n = m.n};
    t->n_full = calloc((size_t)t->rows, sizeof *t->n_full);
    t->n_partial = calloc((size_t)t->rows, sizeof *t->n_partial);
    t->start = calloc((size_t)t->rows + 1, sizeof *t->start);
    t->list = malloc(sizeof *t->list * (size_t)(m.n > 0 ? m.n : 1));
    int64_t *fill = calloc((size_t)t->rows * 2, sizeof *fill); /* full, partial placed so far */
    if (!t->n_full || !t->n_partial || !t->start || !t->list || !fill) {
        list_free(t);
        free(fill);
        return kiln_error(KILN_ERR_OOM, "flex_attention: out of memory for the transposed block mask");
    }
    for (int64_t r = 0; r < m.rows; r++)
        for (int64_t j = 0, nf = m.n_full[r]; j < nf + m.n_partial[r]; j++)
            (j < nf ? t->n_full : t->n_partial)[r / nq * nk + m.list[m.start[r] + j]]++;
    for (int64_t r = 0; r < t->rows; r++) t->start[r + 1] = t->start[r] + t->n_full[r] + t->n_partial[r];
    for (int64_t r = 0; r < m.rows; r++)
        for (int64_t j = 0, nf = m.n_full[r]; j < nf + m.n_partial[r]; j++) {
            const int64_t c = r / nq * nk + m.list[m.start[r] + j];
            t->list[t->start[c] + (j < nf ? fill[2 * c]++ : t->n_full[c] + fill[2 * c + 1]++)] = r % nq;
        }
    free(fill);
    return KILN_OK;
}

/* A host array copied into a new tensor on be (no dispatch: this runs inside a kernel). */
static kiln_tensor_t *on_device(kiln__backend *be, const void *host, kiln_dtype dt, int64_t n)
{
    int64_t len = n > 0 ? n : 1;
    kiln_tensor_t *t = kiln__tensor_alloc(be, dt, &len, 1);
    if (t && n > 0 && kiln__be_copy_h2d(be, kiln__data(t), host, kiln_dtype_size(dt) * (size_t)n) != KILN_OK) {
        kiln_tensor_free(t);
        return NULL;
    }
    return t;
}

/* A block list copied to be: d[0..4) its counts of full and partial blocks, starts and
 * blocks (freed by the caller, NULL ones too). */
static kiln_status list_to_device(kiln__backend *be, const block_list *l, kiln_tensor_t *d[4])
{
    d[0] = on_device(be, l->n_full, KILN_DTYPE_I32, l->rows);
    d[1] = on_device(be, l->n_partial, KILN_DTYPE_I32, l->rows);
    d[2] = on_device(be, l->start, KILN_DTYPE_I64, l->rows + 1);
    d[3] = on_device(be, l->list, KILN_DTYPE_I64, l->n);
    if (d[0] && d[1] && d[2] && d[3]) return KILN_OK;
    return kiln_last_status() ? kiln_last_status() : kiln_error(KILN_ERR_OOM, "flex: out of memory");
}

/* Launches a generated kernel over `items` work-items, its arguments in the order
 * dev_open declares them: its own buffers bufs[0..nb), the block list on the device, the
 * captured tensors (the bad flag standing in for those absent), the bad flag, the sizes
 * (B, H, Hkv, Tq, Tk, D, then the block mask's mB, mH, the list's blocks per (b, h),
 * block, kv_block), the scale and the captured tensors' dims. */
static kiln_status dev_launch(kiln__backend *be, void *kernel, kiln_tensor_t *const *bufs, int nb,
                              kiln_tensor_t *const list[4], kiln_tensor_t *const *caps, int n_cap, kiln_tensor_t *bad,
                              const int64_t sizes[11], double scale, int64_t items)
{
    kiln__karg args[48];
    int n = 0;
    for (int i = 0; i < nb; i++) args[n++] = (kiln__karg){KILN__KARG_BUF, kiln__data(bufs[i]), 0, 0};
    for (int i = 0; i < 4; i++) args[n++] = (kiln__karg){KILN__KARG_BUF, kiln__data(list[i]), 0, 0};
    for (int c = 0; c < 2; c++) args[n++] = (kiln__karg){KILN__KARG_BUF, kiln__data(c < n_cap ? caps[c] : bad), 0, 0};
    args[n++] = (kiln__karg){KILN__KARG_BUF, kiln__data(bad), 0, 0};
    for (int i = 0; i < 11; i++) args[n++] = (kiln__karg){KILN__KARG_I64, NULL, sizes[i], 0};
    args[n++] = (kiln__karg){KILN__KARG_F32, NULL, 0, scale};
    for (int c = 0; c < 2; c++)
        for (int d = 0; d < 4; d++)
            args[n++] = (kiln__karg){KILN__KARG_I64, NULL, c < n_cap && d < caps[c]->ndim ? caps[c]->shape[d] : 1, 0};
    /* work-groups of 64: left to PoCL, they were 4096 work-items, whose private rows
     * (1 KiB each, 2 KiB in the dK and dV kernel) overflowed its thread's stack at T 1024;
     * the kernels skip the items past the end */
    size_t block = 64, grid = ((size_t)items + block - 1) / block * block;
    return items > 0 ? kiln__be_launch(be, kernel, args, n, &grid, &block, 1) : KILN_OK;
}

/* After the launches: the bad flag read back (a captured index out of range names its
 * tensor), the call's device tensors freed. */
static kiln_status dev_finish(kiln_status s, kiln__backend *be, kiln_tensor_t *bad, kiln_tensor_t *const *caps,
                              kiln_tensor_t **tmp, int n_tmp, kiln_block_mask_t *own)
{
    int32_t flag = 0;
    if (s == KILN_OK) s = kiln__be_copy_d2h(be, &flag, kiln__data(bad), sizeof flag);
    if (s == KILN_OK && flag)
        s = kiln_error(KILN_ERR_INDEX, "flex_attention: the modifiers read c%d outside its shape %s", flag - 1,
                       kiln__shape_text(caps[flag - 1]));
    for (int i = 0; i < n_tmp; i++) kiln_tensor_free(tmp[i]);
    kiln_tensor_free(bad);
    kiln_block_mask_free(own);
    return s;
}

/* The forward op's OpenCL and CUDA kernel (f32, rows of up to 256, at most 2 captured
 * tensors): in q, k, v, captured...; out y, lse. One work-item per query row. */
static kiln_status fwd_kernel_dev(const kiln_op_args *x)
{
    entry *e = x->user;
    kiln_tensor_t *q = x->in[0], *k = x->in[1], *const *caps = x->in + 4;
    kiln__backend *be = q->st->be;
    int n_cap = x->n_in - 4;
    void *kernel;
    kiln_block_mask_t *bm = NULL;
    kiln_status s = dev_fits(q);
    if (s == KILN_OK) s = dev_kernel(e, be, 0, &kernel);
    if (s == KILN_OK) s = mask_of_call(x->in[3], q, k, &bm); /* bm stays NULL on an error */
    if (s != KILN_OK) return s;
    int32_t zero = 0;
    kiln_tensor_t *list[4] = {0}, *bad = on_device(be, &zero, KILN_DTYPE_I32, 1);
    const block_list l = mask_list(bm);
    s = bad ? list_to_device(be, &l, list) : kiln_last_status();
    if (s == KILN_OK) {
        kiln_tensor_t *bufs[5] = {q, k, x->in[2], x->out[0], x->out[1]};
        int64_t sizes[11] = {q->shape[0], q->shape[1], k->shape[1], q->shape[2], k->shape[2], q->shape[3],
                             bm->B, bm->H, bm->nq, bm->block, bm->kv_block};
        s = dev_launch(be, kernel, bufs, 5, list, caps, n_cap, bad, sizes, x->attr[0].f,
                       q->shape[0] * q->shape[1] * q->shape[2]);
    }
    return dev_finish(s, be, bad, caps, list, 4, bm);
}

/* The backward op's OpenCL and CUDA kernel: in dO, q, k, v, lse, Dm, captured...; out dq,
 * dk, dv. Two launches, each the only writer of what it writes: dQ per query row over the
 * block mask, dK and dV per key row over the block mask transposed (made here, O(blocks),
 * and copied with the mask as the forward copies it). */
static kiln_status bwd_kernel_dev(const kiln_op_args *x)
{
    entry *e = x->user;
    kiln_tensor_t *q = x->in[1], *k = x->in[2], *const *caps = x->in + 7;
    kiln__backend *be = q->st->be;
    int n_cap = x->n_in - 7;
    void *kq, *kkv;
    kiln_block_mask_t *bm = NULL;
    kiln_status s = dev_fits(q);
    if (s == KILN_OK) s = dev_kernel(e, be, 1, &kq);
    if (s == KILN_OK) s = dev_kernel(e, be, 2, &kkv);
    if (s == KILN_OK) s = mask_of_call(x->in[6], q, k, &bm);
    block_list t;
    if (s != KILN_OK || (s = transposed(bm, &t)) != KILN_OK) {
        kiln_block_mask_free(bm);
        return s;
    }
    int32_t zero = 0;
    kiln_tensor_t *list[8] = {0}, *bad = on_device(be, &zero, KILN_DTYPE_I32, 1);
    const block_list l = mask_list(bm);
    s = bad ? list_to_device(be, &l, list) : kiln_last_status();
    if (s == KILN_OK) s = list_to_device(be, &t, list + 4);
    list_free(&t);
    int64_t B = q->shape[0], H = q->shape[1], Hkv = k->shape[1], Tq = q->shape[2], Tk = k->shape[2];
    int64_t sizes[11] = {B, H, Hkv, Tq, Tk, q->shape[3], bm->B, bm->H, bm->nq, bm->block, bm->kv_block};
    kiln_tensor_t *bufs[8] = {x->in[0], q, k, x->in[3], x->in[4], x->in[5], x->out[0]};
    if (s == KILN_OK) s = dev_launch(be, kq, bufs, 7, list, caps, n_cap, bad, sizes, x->attr[0].f, B * H * Tq);
    bufs[6] = x->out[1], bufs[7] = x->out[2];
    sizes[8] = bm->nk;
    if (s == KILN_OK) s = dev_launch(be, kkv, bufs, 8, list + 4, caps, n_cap, bad, sizes, x->attr[0].f, B * Hkv * Tk);
    return dev_finish(s, be, bad, caps, list, 8, bm);
}

static void like(kiln_op_meta *m, const kiln_tensor_t *t)
{
    m->dtype = kiln_tensor_dtype(t);
    m->ndim = kiln_tensor_ndim(t);
    memcpy(m->shape, kiln_tensor_shape(t), sizeof(int64_t) * (size_t)m->ndim);
}

static kiln_status fwd_shape(const kiln_op_args *x, kiln_op_meta *out)
{
    like(&out[0], x->in[0]);
    like(&out[1], x->in[0]);
    out[1].ndim = 3; /* (B, H, Tq) */
    return KILN_OK;
}

static kiln_status bwd_shape(const kiln_op_args *x, kiln_op_meta *out)
{
    for (int j = 0; j < 3; j++) like(&out[j], x->in[1 + j]);
    return KILN_OK;
}

/* The forward's backward: Dm = rowsum(dO O) - dlse, then the backward op. The captured
 * tensors get no gradient here (a call whose captured tensors want one takes the dense
 * path). */
static kiln_status fwd_backward(const kiln_op_args *x, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    entry *e = x->user;
    kiln_tensor_t *y = x->out[0], *lse = x->out[1], *dO = gout[0];
    if (!dO) dO = kiln_zeros(kiln_tensor_shape(y), 4, kiln_tensor_dtype(y));
    int last = 3;
    kiln_tensor_t *dm = kiln_sum(kiln_mul(dO, y), &last, 1, false);
    if (dm && gout[1]) dm = kiln_sub(dm, gout[1]);
    kiln_tensor_t *in[9] = {dO, x->in[0], x->in[1], x->in[2], lse, dm};
    for (int i = 3; i < x->n_in; i++) in[3 + i] = x->in[i]; /* the block mask, the captured tensors */
    kiln_tensor_t *out[3] = {0};
    if (!dm) return kiln_last_status();
    kiln_status s = kiln_op_run(e->op_bwd, in, 3 + x->n_in, x->attr, 1, out);
    for (int i = 0; s == KILN_OK && i < 3; i++) gin[i] = out[i];
    return s;
}

/* The mask op's output: (mB, mH, nq, KILN__MASK_HEAD + nk) i64, for attributes B, H, Tq,
 * Tk, block, kv_block. */
static kiln_status mask_shape(const kiln_op_args *x, kiln_op_meta *out)
{
    const entry *e = x->user;
    int64_t B = x->attr[0].i, H = x->attr[1].i, Tq = x->attr[2].i, Tk = x->attr[3].i, bl = x->attr[4].i,
            kb = x->attr[5].i;
    out->dtype = KILN_DTYPE_I64;
    out->ndim = 4;
    out->shape[0] = e->tmpl->vars[1][V_B] ? B : 1;
    out->shape[1] = e->tmpl->vars[1][V_H] ? H : 1;
    out->shape[2] = (Tq + bl - 1) / bl;
    out->shape[3] = KILN__MASK_HEAD + (Tk + kb - 1) / kb;
    return KILN_OK;
}

/* The mask op's cpu kernel: the block mask of the modifiers over the captured tensors
 * in[0..n_in), classified (kiln_block_mask_new) and written as its tensor. */
static kiln_status mask_kernel(const kiln_op_args *x)
{
    const entry *e = x->user;
    kiln_flex_t *f = NULL;
    kiln_block_mask_t *m = NULL;
    kiln_status s = kiln_flex_new(e->tmpl->score, e->tmpl->mask, x->in, x->n_in, &f);
    if (s == KILN_OK)
        s = kiln_block_mask_new(f, x->attr[0].i, x->attr[1].i, x->attr[2].i, x->attr[3].i, x->attr[4].i, x->attr[5].i, &m);
    if (s == KILN_OK) s = kiln__block_mask_pack(m, kiln__data(x->out[0]));
    kiln_block_mask_free(m);
    kiln_flex_free(f);
    return s;
}

/* f's block mask classified on the host (kiln_block_mask_new) as a tensor on be, in the
 * open scope; NULL on an error. */
static kiln_tensor_t *mask_made(const kiln_flex_t *f, kiln__backend *be, int64_t B, int64_t H, int64_t Tq, int64_t Tk,
                                int64_t block, int64_t kv_block)
{
    kiln_block_mask_t *m;
    if (kiln_block_mask_new(f, B, H, Tq, Tk, block, kv_block, &m) != KILN_OK) return NULL;
    kiln_tensor_t *t = kiln_block_mask_tensor(m);
    kiln_block_mask_free(m);
    return t && be != kiln__backend_at(0) ? kiln_tensor_to(t, be->name) : t;
}

/* The block mask tensor of e's modifiers f (whose captured tensors are the call's) for
 * these sizes on be: with captured tensors, e's mask op on them (so that a captured
 * function computes it from each call's values); without, a tensor made once per device
 * and sizes and kept (8 at most; after that one is made for each call). */
static kiln_tensor_t *mask_for(entry *e, const kiln_flex_t *f, kiln__backend *be, int64_t B, int64_t H, int64_t Tq,
                               int64_t Tk, int64_t block, int64_t kv_block)
{
    if (f->n_cap > 0) {
        kiln_op_value at[6] = {{.i = B}, {.i = H}, {.i = Tq}, {.i = Tk}, {.i = block}, {.i = kv_block}};
        return kiln_op_call(e->op_mask, f->cap, f->n_cap, at, 6);
    }
    int64_t mB = f->vars[1][V_B] ? B : 1, mH = f->vars[1][V_H] ? H : 1; /* the mask's own sizes */
    pthread_mutex_lock(&lock);
    kiln_tensor_t *t = NULL;
    for (int i = 0; i < e->n_masks && !t; i++)
        if (e->masks[i].be == be && e->masks[i].mB == mB && e->masks[i].mH == mH && e->masks[i].Tq == Tq &&
            e->masks[i].Tk == Tk && e->masks[i].block == block && e->masks[i].kv_block == kv_block)
            t = e->masks[i].t;
    pthread_mutex_unlock(&lock);
    if (t) return kiln__scoped(kiln_tensor_retain(t));
    /* made outside any capture or recording on this thread: a constant of the graph */
    void *held = kiln__intercept_suspend();
    bool was = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    t = kiln_keep(mask_made(f, be, B, H, Tq, Tk, block, kv_block));
    kiln_scope_end();
    kiln_set_grad_enabled(was);
    kiln__intercept_resume(held);
    if (!t) return NULL;
    pthread_mutex_lock(&lock);
    bool kept = e->n_masks < 8;
    if (kept) e->masks[e->n_masks++] = (kept_mask){be, mB, mH, Tq, Tk, block, kv_block, t};
    pthread_mutex_unlock(&lock);
    return kiln__scoped(kept ? kiln_tensor_retain(t) : t);
}

/* The entry of f's modifiers, made (its template and ops) on first use. */
static kiln_status entry_for(const kiln_flex_t *f, entry **out)
{
    char caps[64] = "";
    for (int i = 0; i < f->n_cap; i++)
        snprintf(caps + strlen(caps), sizeof caps - strlen(caps), "%d.%d,", (int)kiln_tensor_dtype(f->cap[i]),
                 kiln_tensor_ndim(f->cap[i]));
    size_t kn = strlen(f->score) + strlen(f->mask) + 80;
    char *key = malloc(kn);
    if (!key) return kiln_error(KILN_ERR_OOM, "flex: out of memory");
    snprintf(key, kn, "%s|%s|%s", caps, f->score, f->mask);
    pthread_mutex_lock(&lock);
    kiln_status s = KILN_OK;
    entry *e = entries;
    while (e && strcmp(e->key, key)) e = e->next;
    /* An entry is listed at once and never freed: the ops defined for it hold it as their
     * user pointer, and the op table cannot take a row back. What a failure (out of
     * memory) left undone is done at the next call: e->ready says all is there. */
    if (!e && (e = calloc(1, sizeof *e))) {
        e->key = key, key = NULL;
        e->op_fwd = e->op_bwd = e->op_mask = -1;
        e->next = entries;
        entries = e;
    } else if (!e) s = kiln_error(KILN_ERR_OOM, "flex: out of memory");
    if (s == KILN_OK && !e->ready) {
        /* placeholders of the captured tensors' dtypes and dims, for the generator */
        kiln_tensor_t *ph[MAX_CAPTURED];
        if (!e->tmpl) {
            /* made outside any capture or recording on this thread: they are not the call's */
            void *held = kiln__intercept_suspend();
            bool was = kiln_set_grad_enabled(false);
            kiln_scope_begin();
            for (int i = 0; i < f->n_cap; i++) {
                int64_t ones[4] = {1, 1, 1, 1};
                ph[i] = kiln_zeros(ones, kiln_tensor_ndim(f->cap[i]), kiln_tensor_dtype(f->cap[i]));
            }
            s = kiln_flex_new(f->score, f->mask, ph, f->n_cap, &e->tmpl);
            kiln_scope_end();
            kiln_set_grad_enabled(was);
            kiln__intercept_resume(held);
        }
        char name[64];
        uint64_t h = kiln__fnv(KILN__FNV_SEED, e->key, strlen(e->key));
        const kiln_op_kernel kf[] = {{.device = "cpu", .fn = fwd_kernel}, {.device = "opencl", .fn = fwd_kernel_dev},
                             {.device = "cuda", .fn = fwd_kernel_dev}},
                             kb[] = {{.device = "cpu", .fn = bwd_kernel}, {.device = "opencl", .fn = bwd_kernel_dev},
                                     {.device = "cuda", .fn = bwd_kernel_dev}};
        snprintf(name, sizeof name, "flex_attention_%016llx", (unsigned long long)h);
        if (s == KILN_OK && e->op_fwd < 0)
            s = kiln_op_define(&(kiln_op_decl){.name = name, .n_in = 4 + f->n_cap, .n_out = 2, .attrs = "scale:f64",
                                               .shape = fwd_shape, .kernels = kf, .n_kernels = 3,
                                               .backward = fwd_backward, .user = e},
                               &e->op_fwd);
        snprintf(name, sizeof name, "flex_attention_backward_%016llx", (unsigned long long)h);
        if (s == KILN_OK && e->op_bwd < 0)
            s = kiln_op_define(&(kiln_op_decl){.name = name, .n_in = 7 + f->n_cap, .n_out = 3,
                                               .attrs = "scale:f64", .shape = bwd_shape, .kernels = kb,
                                               .n_kernels = 3, .user = e},
                               &e->op_bwd);
        snprintf(name, sizeof name, "flex_block_mask_%016llx", (unsigned long long)h);
        const kiln_op_kernel km[] = {{.device = "cpu", .fn = mask_kernel}};
        if (s == KILN_OK && f->n_cap > 0 && e->op_mask < 0)
            s = kiln_op_define(&(kiln_op_decl){.name = name, .n_in = f->n_cap, .n_out = 1,
                                               .attrs = "B:i64,H:i64,Tq:i64,Tk:i64,block:i64,kv_block:i64",
                                               .shape = mask_shape, .kernels = km, .n_kernels = 1, .user = e},
                               &e->op_mask);
        e->ready = s == KILN_OK;
    }
    pthread_mutex_unlock(&lock);
    free(key);
    if (s == KILN_OK) *out = e;
    return s;
}

kiln_status kiln__flex_fused(const kiln_flex_t *f, kiln_tensor_t *mask, kiln_tensor_t *q, kiln_tensor_t *k,
                             kiln_tensor_t *v, double scale, kiln_tensor_t **y, kiln_tensor_t **lse, bool *ran)
{
    *ran = false;
    kiln__backend *be = q->st->be;
    bool cpu = be == kiln__backend_at(0);
    /* OpenCL and CUDA: f32, rows of up to 256, the forward and (for autograd) the backward */
    bool cl = !cpu && (kiln__backend_is(be, "opencl") || kiln__backend_is(be, "cuda")) && q->dtype == KILN_DTYPE_F32 &&
              q->shape[3] <= 256;
    if ((!cpu && !cl) || k->st->be != be || v->st->be != be || f->n_cap > 2)
        return KILN_OK; /* the dense path: another device, or more captured tensors than the op has inputs for */
    for (int i = 0; i < f->n_cap; i++)
        if (f->cap[i]->st->be != be || (kiln_grad_enabled() && kiln_tensor_requires_grad(f->cap[i])))
            return KILN_OK; /* gradients of captured tensors: the dense path's */
    entry *e = NULL;
    kiln_status s = entry_for(f, &e);
    if (s != KILN_OK) return s;
    /* the block mask: given, or made for the call's sizes (from the captured tensors, or
     * kept), on q's device */
    if (!mask && !(mask = mask_for(e, f, be, q->shape[0], q->shape[1], q->shape[2], k->shape[2], KILN_FLEX_BLOCK,
                                      KILN_FLEX_BLOCK)))
        return kiln_last_status();
    if (mask->st->be != be && !(mask = kiln_tensor_to(mask, be->name))) return kiln_last_status();
    kiln_tensor_t *in[8] = {q, k, v, mask}, *out[2] = {0};
    for (int i = 0; i < f->n_cap; i++) in[4 + i] = f->cap[i];
    kiln_op_value attrs[1] = {{.f = scale}};
    if ((s = kiln_op_run(e->op_fwd, in, 4 + f->n_cap, attrs, 1, out)) != KILN_OK) return s;
    *y = out[0];
    *lse = out[1];
    *ran = true;
    return KILN_OK;
}

kiln_tensor_t *kiln_flex_block_mask(const kiln_flex_t *f, int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t block,
                                    int64_t kv_block)
{
    if (!f) return kiln_error(KILN_ERR_ARG, "flex_block_mask: NULL modifiers"), NULL;
    if (kv_block == 0) kv_block = block;
    if (B < 1 || H < 1 || Tq < 1 || Tk < 1 || block < 1 || kv_block < 1)
        return kiln_error(KILN_ERR_ARG, "flex_block_mask: sizes B %lld, H %lld, Tq %lld, Tk %lld, block %lld, kv_block "
                          "%lld must be >= 1", (long long)B, (long long)H, (long long)Tq, (long long)Tk, (long long)block,
                          (long long)kv_block), NULL;
    kiln__backend *be = f->n_cap ? f->cap[0]->st->be : kiln__backend_default();
    for (int i = 1; i < f->n_cap; i++)
        if (f->cap[i]->st->be != be)
            return kiln_error(KILN_ERR_DEVICE, "flex_block_mask: captured tensors on %s and %s", be->name,
                              f->cap[i]->st->be->name), NULL;
    if (f->n_cap > 2) { /* the mask op classifies with at most 2 (kiln__flex_classify): made here */
        if (kiln_graph_capturing())
            return kiln_error(KILN_ERR_UNSUPPORTED, "flex_block_mask: %d captured tensors inside a captured function; "
                              "the mask is computed there from at most 2", f->n_cap), NULL;
        return mask_made(f, be, B, H, Tq, Tk, block, kv_block);
    }
    entry *e = NULL;
    if (entry_for(f, &e) != KILN_OK) return NULL;
    return mask_for(e, f, be, B, H, Tq, Tk, block, kv_block);
}

typedef struct {
    const entry *e;
    const flex_args *a;
    int64_t nk, *on; /* on: nk counts per task */
} classify_ctx;

static void classify_range(void *ctx, int64_t t0, int64_t t1)
{
    const classify_ctx *c = ctx;
    for (int64_t t = t0; t < t1; t++) {
        int64_t qb = t % c->a->nq, bh = t / c->a->nq;
        c->e->blocks(c->a, bh / c->a->mH, bh % c->a->mH, qb, 0, c->nk, c->on + t * c->nk);
    }
}

kiln_status kiln__flex_classify(const kiln_flex_t *f, int64_t mB, int64_t mH, int64_t Tq, int64_t Tk, int64_t block,
                                int64_t kv_block, int64_t *on, bool *ran)
{
    *ran = false;
    kiln__backend *cpu = kiln__backend_at(0);
    if (!kiln__opt(KILN__OPT_FLEX_FUSED) || f->n_cap > 2) return KILN_OK;
    for (int i = 0; i < f->n_cap; i++)
        if (f->cap[i]->st->be != cpu) return KILN_OK;
    entry *e = NULL;
    kiln_status s = entry_for(f, &e);
    pthread_mutex_lock(&lock);
    if (s == KILN_OK) s = built(e, false);
    pthread_mutex_unlock(&lock);
    if (s != KILN_OK) return s;
    int32_t bad = 0;
    flex_args a = {.B = mB, .H = mH, .Tq = Tq, .Tk = Tk, .mB = mB, .mH = mH, .nq = (Tq + block - 1) / block,
                   .block = block, .kv_block = kv_block, .bad = &bad};
    /* dense copies made quietly (this may run inside a kernel, whose callers' scopes and
     * recordings must not see them), released below */
    kiln_tensor_t *caps[MAX_CAPTURED] = {0};
    for (int i = 0; i < f->n_cap && s == KILN_OK; i++) {
        caps[i] = kiln__dense(f->cap[i]);
        if (!caps[i]) s = kiln_last_status();
        else {
            a.cap[i] = kiln__data(caps[i]);
            for (int d = 0; d < 4; d++) a.cap_dim[i][d] = d < caps[i]->ndim ? caps[i]->shape[d] : 1;
        }
    }
    classify_ctx c = {e, &a, (Tk + kv_block - 1) / kv_block, on};
    if (s == KILN_OK) kiln__parallel_for(mB * mH * a.nq, 1, classify_range, &c);
    for (int i = 0; i < f->n_cap; i++) kiln_tensor_free(caps[i]);
    if (s != KILN_OK) return s;
    if (bad)
        return kiln_error(KILN_ERR_INDEX, "block_mask_new: the mask reads c%d outside its shape %s (%s)", bad - 1,
                          kiln__shape_text(f->cap[bad - 1]), f->mask);
    *ran = true;
    return KILN_OK;
}
