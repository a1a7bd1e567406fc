/* The cpu code generator: one C function per kernel, named after the ops it fused,
 * with a comment listing them. A function runs tasks [t0, t1) of its kernel (a task is
 * a row, or a piece of one); the runtime spreads the tasks over kiln's thread pool.
 * Sizes and strides are the function's sz[] argument (compile_impl.h), so a kernel's
 * text does not change when only the sizes it runs on do; OpenCL kernels read them from
 * a device buffer argument (the CUDA dialect and KILN_COMPILE_DISABLE=symbolic write
 * them in).
 * Inner loops are written so that GCC vectorizes them: loads and stores at constant
 * strides, selects instead of branches, a polynomial exp, and reductions kept in 16
 * partial accumulators that are combined in a fixed order at the end of the row. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/dtype.h"
#include "core/opts.h"
#include "core/util.h"

typedef kiln__sbuf sbuf;
#define put kiln__sbuf_put

/* A buffer's element type; vtype: the type its values are computed in (a bf16 value is
 * the float it equals, kmath.h's km_round_bf16). */
static const char *ctype(kiln_dtype dt)
{
    static const char *const name[KILN_DTYPE_COUNT] = {
        [KILN_DTYPE_F32] = "float", [KILN_DTYPE_F64] = "double", [KILN_DTYPE_I64] = "int64_t",
        [KILN_DTYPE_I32] = "int32_t", [KILN_DTYPE_BF16] = "uint16_t", [KILN_DTYPE_F16] = "uint16_t"};
    return name[dt] ? name[dt] : "uint8_t";
}

static const char *vtype(kiln_dtype dt) { return kiln__is_half(dt) ? "float" : ctype(dt); }
/* kmath.h's helper for a half type: km_<what>_bf16 or km_<what>_f16. */
static const char *half_sfx(kiln_dtype dt) { return dt == KILN_DTYPE_BF16 ? "bf16" : "f16"; }

/* Every generated file starts with its dialect's header (below), then the text of
 * src/core/kmath.h, embedded at build time: the same helpers the cpu backend's kernels
 * inline, so that compiled and eager results agree to rounding. */
extern const char kiln__kmath_source[];

/* C for the system compiler. */
static const char header_c[] =
    "#include <math.h>\n#include <stdint.h>\n#include <string.h>\n\n"
    "#define KM_FN static inline\n"
    "static inline float km_bits(int32_t b)\n{\n    float f;\n    memcpy(&f, &b, 4);\n    return f;\n}\n"
    "static inline int32_t km_fbits(float f)\n{\n    int32_t b;\n    memcpy(&b, &f, 4);\n    return b;\n}\n";

/* OpenCL C (src/backends/opencl compiles it): the builtins are overloaded, so the C
 * library's f-suffixed names map onto them. */
static const char header_cl[] =
    "#ifdef cl_khr_fp64\n#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n#else\n#define KM_NO_F64\n#endif\n"
    "typedef long int64_t;\ntypedef int int32_t;\ntypedef uchar uint8_t;\ntypedef ushort uint16_t;\n"
    "#define expf exp\n#define logf log\n#define sqrtf sqrt\n#define powf pow\n#define fabsf fabs\n"
    "#define tanhf tanh\n#define erff erf\n#define log1pf log1p\n"
    "#define KM_FN inline\n#define km_bits(b) as_float(b)\n#define km_fbits(f) as_int(f)\n\n";

/* CUDA C for NVRTC (src/backends/cuda compiles it): device functions, CUDA's own math. */
static const char header_cuda[] =
    "typedef long long int64_t;\ntypedef int int32_t;\ntypedef unsigned char uint8_t;\ntypedef unsigned short uint16_t;\n"
    "#define INFINITY __int_as_float(0x7f800000)\n"
    "#define KM_FN __device__ inline\n#define km_bits(b) __int_as_float(b)\n#define km_fbits(f) __float_as_int(f)\n\n";

/* What one kernel's generation needs: the kernel, whether sizes are symbolic and fast
 * math on, and which size slots its text reads (each becomes a local z<N> = sz[N] at
 * the top, so that no store through a char-typed buffer makes the compiler reload it). */
typedef struct {
    const kc_kernel *k;
    bool sym, fast;
    bool *used;
} gen;

/* Size slot n as C: z<n> when sizes are symbolic, else its value. */
static void num(sbuf *b, const gen *G, int n)
{
    if (!G->sym) {
        put(b, "%lld", (long long)G->k->sz[n]);
        return;
    }
    G->used[n] = true;
    put(b, "z%d", n);
}

/* " + jj * stride" for the inner-dim stride in slot n: nothing for 0, no product for 1. */
static void inner_step(sbuf *b, const gen *G, int n)
{
    int64_t st = G->k->sz[n];
    if (st == 0) return;
    if (st == 1) {
        put(b, " + jj");
        return;
    }
    put(b, " + jj * ");
    num(b, G, n);
}

/* The ops that are one C expression of their operands, in order, in every dialect and
 * dtype. */
static const char *const infix[KILN_OP_COUNT] = {
    [KILN_OP_ADD] = "%s + %s", [KILN_OP_SUB] = "%s - %s", [KILN_OP_MUL] = "%s * %s", [KILN_OP_DIV] = "%s / %s",
    [KILN_OP_WHERE] = "%s ? %s : %s", [KILN_OP_CONTIGUOUS] = "%s", [KILN_OP_EQ] = "(uint8_t)(%s == %s)",
    [KILN_OP_NE] = "(uint8_t)(%s != %s)", [KILN_OP_LT] = "(uint8_t)(%s < %s)", [KILN_OP_LE] = "(uint8_t)(%s <= %s)",
    [KILN_OP_GT] = "(uint8_t)(%s > %s)", [KILN_OP_GE] = "(uint8_t)(%s >= %s)",
};

/* One expression as C, its operands being named e<N>; a bf16 one computed as f32 (its
 * value rounded by expr_c). */
static void expr_val(sbuf *b, const gen *G, int i)
{
    const kc_kernel *k = G->k;
    bool fast = G->fast;
    const kc_expr *e = &k->e[i];
    const char *T = vtype(e->dt);
    char a[3][16] = {"", "", ""};
    for (int j = 0; j < e->n_arg; j++) snprintf(a[j], sizeof a[j], "e%d", e->arg[j]);
    switch (e->kind) {
    case E_LOAD:
    case E_INDEX:
        if (e->kind == E_LOAD && kiln__is_half(k->buf[e->buf].dt)) put(b, "km_from_%s(in%d[o%d", half_sfx(k->buf[e->buf].dt), e->buf, i);
        else if (e->kind == E_LOAD) put(b, "in%d[o%d", e->buf, i);
        else put(b, "(%s)(%.17g + %.17g * (double)(o%d", T, e->attrs.op.source.start, e->attrs.op.source.step, i);
        if (k->ndim) inner_step(b, G, kc_sz_load(k, i, k->ndim - 1));
        put(b, "%s", e->kind != E_LOAD ? "))" : kiln__is_half(k->buf[e->buf].dt) ? "])" : "]");
        return;
    case E_CONST: /* %g writes inf and nan as words; INFINITY is there in every dialect */
        if (isinf(e->attrs.op.source.value)) put(b, "(%s)(%sINFINITY)", T, e->attrs.op.source.value < 0 ? "-" : "");
        else if (isnan(e->attrs.op.source.value)) put(b, "(%s)km_bits(0x7fc00000)", T);
        else put(b, "(%s)%.17g", T, e->attrs.op.source.value);
        return;
    case E_ACC:
        put(b, "a%d", e->buf);
        return;
    case E_OP:
        break;
    }
    /* f64 takes the double forms: km_<name>d, pow, km_maxd; no fast forms */
    bool f64 = e->dt == KILN_DTYPE_F64;
    const kiln__op_math_t *m = &kiln__op_math[e->op];
    if (m->name) { /* km_<name>(x), or g * km_<name>_dx(x) for its backward op; d or _fast forms */
        bool fast_form = !f64 && (m->fast == KILN__PW_GEN || (m->fast == KILN__PW_SWITCH && fast));
        const char *form = f64 ? "d" : fast_form ? "_fast" : "";
        if (m->dx) put(b, "%s * km_%s_dx%s(%s)", a[1], m->name, form, a[0]);
        else put(b, "km_%s%s(%s)", m->name, form, a[0]);
        return;
    }
    if (kiln__op_is_custom(e->op)) { /* its expression, x<i> its operands, a<k> its attributes' values */
        const char *names[3] = {a[0], a[1], a[2]};
        char *text = kiln__custom_expr_text(e->op, names, e->n_arg, &e->attrs);
        put(b, "(%s)", text ? text : "0 /* out of memory */");
        free(text);
        return;
    }
    if (infix[e->op]) {
        put(b, infix[e->op], a[0], a[1], a[2]);
        return;
    }
    /* the union's gelu member is GELU's and GELU_BACKWARD's alone; GELU is f32 only */
    bool tanh_form = (e->op == KILN_OP_GELU || e->op == KILN_OP_GELU_BACKWARD) && e->attrs.op.gelu.tanh;
    const char *gelu = !tanh_form ? "erf" : fast ? "fast" : "tanh";
    switch (e->op) {
    case KILN_OP_POW: put(b, "pow%s(%s, %s)", f64 ? "" : "f", a[0], a[1]); break;
    case KILN_OP_MAXIMUM: put(b, "km_max%s(%s, %s)", f64 ? "d" : "", a[0], a[1]); break;
    case KILN_OP_MINIMUM: put(b, "km_min%s(%s, %s)", f64 ? "d" : "", a[0], a[1]); break;
    case KILN_OP_GELU: put(b, "km_gelu_%s(%s)", gelu, a[0]); break;
    case KILN_OP_GELU_BACKWARD: put(b, "%s * km_gelu_grad_%s(%s)", a[1], gelu, a[0]); break;
    case KILN_OP_CAST:
        if (e->dt == KILN_DTYPE_BOOL) put(b, "(uint8_t)(%s != 0)", a[0]);
        else put(b, "(%s)%s", T, a[0]);
        break;
    default: put(b, "0 /* %s: not lowerable */", kiln__ops[e->op].name); break;
    }
}

/* Whether expression i passes on or picks among values already of its 16-bit type (a
 * copy, a same-type cast, a select), which rounding would leave as they are: the
 * copies of bf16 tensors into a new layout were 4% of a compiled bf16 step, most of it
 * rounding exact values again. */
static bool exact_already(const kc_kernel *k, const kc_expr *e)
{
    if (e->kind != E_OP || (e->op != KILN_OP_CONTIGUOUS && e->op != KILN_OP_CAST && e->op != KILN_OP_WHERE))
        return false;
    for (int j = e->op == KILN_OP_WHERE ? 1 : 0; j < e->n_arg; j++)
        if (k->e[e->arg[j]].dt != e->dt) return false;
    return true;
}

/* One expression as C: a bf16 or f16 result is rounded as the eager op's is (a load is
 * exact already, and so is a copy of an exact value). */
static void expr_c(sbuf *b, const gen *G, int i)
{
    const kc_expr *e = &G->k->e[i];
    bool round = kiln__is_half(e->dt) && e->kind != E_LOAD && !exact_already(G->k, e);
    if (round) put(b, "km_round_%s(", half_sfx(e->dt));
    expr_val(b, G, i);
    if (round) put(b, ")");
}

/* Marks in need[] the non-row expressions the roots need (row ones are already named
 * at row scope). */
static void mark(const kc_kernel *k, int i, bool *need)
{
    if (need[i] || k->e[i].row) return;
    need[i] = true;
    if (k->e[i].kind == E_OP)
        for (int j = 0; j < k->e[i].n_arg; j++) mark(k, k->e[i].arg[j], need);
}

static void body(sbuf *b, const gen *G, const bool *need, const char *ind)
{
    const kc_kernel *k = G->k;
    for (int i = 0; i < k->n_e; i++)
        if (need[i]) {
            put(b, "%sconst %s e%d = ", ind, vtype(k->e[i].dt), i);
            expr_c(b, G, i);
            put(b, ";\n");
        }
}

/* Store i's value as its buffer holds it: the bits of a bf16 or f16 value (already
 * rounded), else the value itself. */
static void stored_value(sbuf *b, const kc_kernel *k, int i)
{
    kiln_dtype dt = k->buf[k->st[i].buf].dt;
    if (kiln__is_half(dt)) put(b, "km_to_%s(e%d)", half_sfx(dt), k->st[i].expr);
    else put(b, "e%d", k->st[i].expr);
}

static const char *maxfn(const kc_kernel *k, int a)
{
    return k->e[k->acc[a].expr].dt == KILN_DTYPE_F64 ? "km_maxd" : "km_max";
}

/* One kernel. In C it runs tasks [t0, t1) given its buffers in b[] and its sizes in
 * sz[]; in OpenCL C (cl) each work-item runs one task, its buffers passed as (buffer,
 * byte offset) pairs and the number of tasks last. The body is the same text: the row
 * coordinates c<d> of the first task, then per task its accesses' offsets, the passes
 * over the row, the stores, and a step of the coordinates to the next row (no division
 * per row). */
enum { D_C, D_OPENCL, D_CUDA };

/* "const int64_t <p><i> = 0 + c<d> * <stride>...;": an access's offset at the row, its
 * outer strides st read from the size slots from `slot` on. */
static void row_offset(sbuf *b, const gen *G, char p, int i, const int64_t *st, int slot)
{
    put(b, "        const int64_t %c%d = 0", p, i);
    for (int d = 0; d + 1 < G->k->ndim; d++)
        if (st[d]) {
            put(b, " + c%d * ", d);
            num(b, G, slot + d);
        }
    put(b, ";\n");
}

static void kernel_body(sbuf *b, const gen *G)
{
    const kc_kernel *k = G->k;
    int nd = k->ndim;
    put(b, "    const int64_t kn = ");
    num(b, G, KC_SZ_INNER);
    put(b, ", kch = ");
    num(b, G, KC_SZ_CHUNKS);
    put(b, ", kper = ");
    num(b, G, KC_SZ_PER);
    put(b, ";\n    int64_t q = t0 %% kch, r = t0 / kch;\n");
    for (int d = nd - 2; d >= 1; d--) {
        put(b, "    int64_t c%d = r %% ", d);
        num(b, G, KC_SZ_DOM + d);
        put(b, ";\n    r /= ");
        num(b, G, KC_SZ_DOM + d);
        put(b, ";\n");
    }
    if (nd >= 2) put(b, "    int64_t c0 = r;\n");
    put(b, "    (void)r;\n");
    put(b, "    for (int64_t t = t0; t < t1; t++) {\n");
    put(b, "        const int64_t j0 = q * kper, j1 = j0 + kper < kn ? j0 + kper : kn;\n");
    put(b, "        (void)j0;\n        (void)j1;\n");
    /* Each access's offset at the row. */
    for (int i = 0; i < k->n_e; i++)
        if (k->e[i].kind == E_LOAD || k->e[i].kind == E_INDEX)
            row_offset(b, G, 'o', i, k->e[i].st, kc_sz_load(k, i, 0));
    for (int i = 0; i < k->n_st; i++) row_offset(b, G, 's', i, k->st[i].st, kc_sz_store(k, i, 0));
    bool *emitted = calloc(2 * ((size_t)k->n_e + 1), 1), *need = emitted ? emitted + k->n_e + 1 : NULL;
    if (!emitted) {
        b->failed = true;
        return;
    }
    int phases = 0;
    for (int a = 0; a < k->n_acc; a++)
        if (k->acc[a].phase + 1 > phases) phases = k->acc[a].phase + 1;
    for (int q = 0; q <= phases; q++) {
        /* Row expressions available before pass q. */
        for (int i = 0; i < k->n_e; i++)
            if (k->e[i].row && !emitted[i] && k->e[i].phase <= q) {
                put(b, "        const %s e%d = ", vtype(k->e[i].dt), i);
                expr_c(b, G, i);
                put(b, ";\n        (void)e%d;\n", i);
                emitted[i] = true;
            }
        if (q == phases) break;
        memset(need, 0, (size_t)k->n_e);
        for (int a = 0; a < k->n_acc; a++)
            if (k->acc[a].phase == q) mark(k, k->acc[a].expr, need);
        /* Each accumulator of this pass (a<N>) and its 16 partial sums (l<N>). */
        for (int a = 0; a < k->n_acc; a++)
            if (k->acc[a].phase == q)
                put(b, "        %s a%d, l%d[16];\n        for (int l = 0; l < 16; l++) l%d[l] = %s;\n",
                    vtype(k->e[k->acc[a].expr].dt), a, a, a, k->acc[a].op == KILN_OP_MAX ? "-INFINITY" : "0.0f");
        put(b, "        {\n        int64_t j = j0;\n");
        for (int tail = 0; tail < 2; tail++) {
            const char *ind = tail ? "            " : "                ";
            put(b, "%s", tail ? "        for (; j < j1; j++) {\n            const int l = 0;\n"
                                "            const int64_t jj = j;\n"
                              : "        for (; j + 16 <= j1; j += 16)\n            for (int l = 0; l < 16; l++) {\n"
                                "                const int64_t jj = j + l;\n");
            body(b, G, need, ind);
            for (int a = 0; a < k->n_acc; a++) {
                if (k->acc[a].phase != q) continue;
                if (k->acc[a].op == KILN_OP_MAX)
                    put(b, "%sl%d[l] = %s(e%d, l%d[l]);\n", ind, a, maxfn(k, a), k->acc[a].expr, a);
                else put(b, "%sl%d[l] += e%d;\n", ind, a, k->acc[a].expr);
            }
            put(b, "%s(void)jj;\n%s}\n", ind, ind + 4); /* the loop's closing brace one level out */
        }
        for (int a = 0; a < k->n_acc; a++) {
            if (k->acc[a].phase != q) continue;
            put(b, "        a%d = l%d[0];\n", a, a);
            if (k->acc[a].op == KILN_OP_MAX)
                put(b, "        for (int l = 1; l < 16; l++) a%d = %s(l%d[l], a%d);\n", a, maxfn(k, a), a, a);
            else put(b, "        for (int l = 1; l < 16; l++) a%d += l%d[l];\n", a, a);
        }
        put(b, "        }\n");
    }
    /* Stores along the row, then the stores of one value per row. */
    memset(need, 0, (size_t)k->n_e);
    bool any = false;
    for (int i = 0; i < k->n_st; i++)
        if (nd && k->st[i].st[nd - 1]) {
            mark(k, k->st[i].expr, need);
            any = true;
        }
    if (any) {
        put(b, "        for (int64_t jj = j0; jj < j1; jj++) {\n");
        body(b, G, need, "            ");
        for (int i = 0; i < k->n_st; i++)
            if (nd && k->st[i].st[nd - 1]) {
                put(b, "            in%d[s%d", k->st[i].buf, i);
                inner_step(b, G, kc_sz_store(k, i, nd - 1));
                put(b, "] = ");
                stored_value(b, k, i);
                put(b, ";\n");
            }
        put(b, "        }\n");
    }
    for (int i = 0; i < k->n_st; i++)
        if (!nd || !k->st[i].st[nd - 1]) {
            /* A row value: written once per row (by the row's first piece). */
            put(b, "        if (j0 == 0) in%d[s%d] = ", k->st[i].buf, i);
            stored_value(b, k, i);
            put(b, ";\n");
        }
    /* The next task: the next piece of the row, or the first of the next row. */
    if (nd >= 2) {
        put(b, "        if (++q == kch) {\n            q = 0;\n");
        int open = 0;
        for (int d = nd - 2; d >= 1; d--, open++) {
            put(b, "%*sif (++c%d == ", 12 + 4 * open, "", d);
            num(b, G, KC_SZ_DOM + d);
            put(b, ") {\n%*sc%d = 0;\n", 16 + 4 * open, "", d);
        }
        put(b, "%*sc0++;\n", 12 + 4 * open, "");
        for (int o = open - 1; o >= 0; o--) put(b, "%*s}\n", 12 + 4 * o, "");
        put(b, "        }\n");
    } else {
        put(b, "        if (++q == kch) q = 0;\n");
    }
    put(b, "    }\n}\n\n");
    free(emitted); /* and need */
}

/* What the three dialects write differently: the file's header; a buffer's address
 * space and restrict; a device kernel's declaration, the types of a buffer's byte
 * offset and of the task count, and the task a work-item runs. */
static const struct {
    const char *lang, *header, *space, *restr, *kernel, *offset, *tasks, *task;
} dialects[] = {
    [D_C] = {"C", header_c, "", "restrict "},
    [D_OPENCL] = {"OpenCL C", header_cl, "__global ", "restrict ", "__kernel void", "ulong", "long",
                  "get_global_id(0)"},
    [D_CUDA] = {"CUDA C", header_cuda, "", "__restrict__ ", "extern \"C\" __global__ void", "unsigned long long",
                "long long", "(int64_t)blockIdx.x * blockDim.x + threadIdx.x"},
};

static void kernel_c(sbuf *b, const kiln__program *p, const kc_kernel *k, bool fast, int dialect)
{
    int nd = k->ndim;
    gen G = {k, p->symbolic && dialect != D_CUDA, fast, calloc((size_t)k->n_sz + 1, 1)};
    sbuf text = {0};
    if (!G.used) {
        b->failed = true;
        return;
    }
    kernel_body(&text, &G);
    put(b, "/* %s: %s\n * over [", k->name, k->ops);
    for (int d = 0; d < nd; d++) {
        put(b, "%s", d ? ", " : "");
        int n = d == nd - 1 ? KC_SZ_INNER : KC_SZ_DOM + d;
        if (G.sym) put(b, "z%d", n); /* named, not read: the comment does not use it */
        else put(b, "%lld", (long long)k->sz[n]);
    }
    put(b, "], %d reduction(s), %d store(s) */\n", k->n_acc, k->n_st);
    /* The signature; then the buffers, typed (an output over an input's buffer,
     * kc_buf.reuse, is not restrict: it aliases one); then the task and the sizes. On a
     * device, OpenCL with symbolic sizes reads them from a device copy of k->sz, made when
     * the program was loaded. */
    const char *sp = dialects[dialect].space;
    if (dialect == D_C) {
        put(b, "void %s(char *const *b, const int64_t *sz, int64_t t0, int64_t t1)\n{\n", k->name);
    } else {
        put(b, "%s %s(", dialects[dialect].kernel, k->name);
        for (int i = 0; i < k->n_buf; i++) put(b, "%schar *g%d, %s go%d, ", sp, i, dialects[dialect].offset, i);
        put(b, "%s n_tasks%s)\n{\n", dialects[dialect].tasks, G.sym ? ", __global char *gsz, ulong gszo" : "");
    }
    for (int i = 0; i < k->n_buf; i++) {
        const char *c = k->buf[i].output ? "" : "const ", *T = ctype(k->buf[i].dt);
        put(b, "    %s%s%s *%sin%d = (%s%s%s *)", sp, c, T,
            k->buf[i].output && !k->buf[i].reuse ? dialects[dialect].restr : "", i, sp, c, T);
        if (dialect == D_C) put(b, "b[%d];\n", i);
        else put(b, "(g%d + go%d);\n", i, i);
    }
    if (dialect != D_C)
        put(b, "    const int64_t t0 = %s, t1 = t0 + 1;\n    if (t0 >= n_tasks) return;\n", dialects[dialect].task);
    if (dialect == D_OPENCL && G.sym) put(b, "    __global const long *sz = (__global const long *)(gsz + gszo);\n");
    bool any = false;
    for (int n = 0; n < k->n_sz; n++)
        if (G.used[n]) {
            put(b, "    const int64_t z%d = sz[%d];\n", n, n);
            any = true;
        }
    if (dialect == D_C && !any) put(b, "    (void)sz;\n");
    if (text.failed) b->failed = true;
    else put(b, "%s", text.s ? text.s : "");
    free(text.s);
    free(G.used);
}

static kiln_status generate(const kiln__program *p, int dialect, char **src)
{
    const char *lang = dialects[dialect].lang;
    sbuf b = {0};
    bool fast = kiln__opt(KILN__OPT_FAST_EXP);
    put(&b, "/* Generated by kiln %s: %d kernel(s) in %s. */\n", KILN_VERSION, p->n_k, lang);
    put(&b, "%s%s\n", dialects[dialect].header, kiln__kmath_source);
    for (int i = 0; i < p->n_k; i++) kernel_c(&b, p, &p->k[i], fast, dialect);
    if (b.failed) {
        free(b.s);
        return kiln__err(KILN_ERR_OOM, "compile: out of memory generating %s", lang);
    }
    *src = b.s;
    return KILN_OK;
}

kiln_status kiln__codegen_c(const kiln__program *p, char **src) { return generate(p, D_C, src); }

/* Each dialect's prelude, made on first use and kept; one that could not be made (out of
 * memory) is tried again at the next use, not remembered as missing. */
static _Atomic(char *) prelude[3];
static pthread_mutex_t prelude_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *prelude_of(int d)
{
    char *p = atomic_load(&prelude[d]);
    if (p) return p;
    const char *head[3] = {header_c, header_cl, header_cuda};
    pthread_mutex_lock(&prelude_lock);
    if (!(p = atomic_load(&prelude[d]))) {
        size_t n = strlen(head[d]) + strlen(kiln__kmath_source) + 2;
        if ((p = malloc(n))) {
            snprintf(p, n, "%s%s\n", head[d], kiln__kmath_source);
            atomic_store(&prelude[d], p);
        }
    }
    pthread_mutex_unlock(&prelude_lock);
    return p; /* NULL only when out of memory */
}

const char *kiln__codegen_prelude_c(void) { return prelude_of(0); }
const char *kiln__codegen_prelude_cl(void) { return prelude_of(1); }
const char *kiln__codegen_prelude_cuda(void) { return prelude_of(2); }
kiln_status kiln__codegen_opencl(const kiln__program *p, char **src) { return generate(p, D_OPENCL, src); }
kiln_status kiln__codegen_cuda(const kiln__program *p, char **src) { return generate(p, D_CUDA, src); }

kiln__codegen_fn kiln__codegen_for(const kiln__backend *be)
{
    if (!be->language) return NULL;
    if (!strcmp(be->language, "opencl-c")) return kiln__codegen_opencl;
    if (!strcmp(be->language, "cuda-c")) return kiln__codegen_cuda;
    return NULL;
}
