/* Custom ops (kiln/op.h): ops defined at run time, each a row of the op table from
 * KILN_OP_COUNT up (src/core/op_table.c) whose columns call what its declaration gave:
 * the shape function as its inference, one kernel for every backend it has a kernel
 * for (a C function, or source the backend builds once per device), the backward and
 * the decomposition through adapters that hand them kiln_op_args. The op's id rides in
 * its attributes (kiln__attrs.op.custom.op), so that the table's fixed signatures find
 * their op. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "core/dtype.h"
#include "core/util.h"
#include "kiln/ops.h"
#include "ops/registry.h"

#define MAX_ATTRS 8
#define MAX_BUILT 8

typedef struct {
    char *device, *source, *entry;
    kiln_op_kernel_fn fn;
    kiln_op_grid grid;
    /* source: the kernel each backend built from it */
    struct {
        kiln__backend *be;
        void *kernel;
    } built[MAX_BUILT];
} kernel;

typedef struct {
    kiln_op_decl d; /* its strings are the copies below */
    char *name, *expr;
    int n_attr;
    char attr_name[MAX_ATTRS][32];
    bool attr_int[MAX_ATTRS];
    kernel *kernels;
    pthread_mutex_t lock; /* built[] */
} custom;

static custom ops[KILN__CUSTOM_MAX];

static custom *of(int op) { return kiln__op_is_custom(op) && op < kiln__op_total() ? &ops[op - KILN_OP_COUNT] : NULL; }

static kiln_op_args args_of(const custom *c, int op, kiln_tensor_t *const *in, kiln_tensor_t *const *out,
                            const kiln__attrs *a)
{
    return (kiln_op_args){.op = op, .in = in, .n_in = c->d.n_in, .out = out, .n_out = out ? c->d.n_out : 0,
                          .attr = a->op.custom.v, .n_attr = c->n_attr, .user = c->d.user};
}

/* An error this thread had before a call into the op's own code, put aside so that the
 * call's own error (or none) can be told apart, and put back when the call succeeded:
 * a chain of ops checked once at its end keeps its first error. */
typedef struct {
    kiln_status s;
    char msg[512];
} held_error;

static void hold_error(held_error *h)
{
    h->s = kiln_last_status();
    if (h->s == KILN_OK) return; /* the common case: nothing to keep */
    snprintf(h->msg, sizeof h->msg, "%s", kiln_last_error());
    kiln_clear_error();
}

static void restore_error(const held_error *h)
{
    if (h->s != KILN_OK) kiln__err(h->s, "%s", h->msg);
}

/* The inference column: the declaration's shape function (or, for an expression with
 * none, the inputs broadcast in f32), its answer checked. */
static kiln_status infer_custom(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln__meta *out)
{
    int op = a->op.custom.op;
    custom *c = of(op);
    if (!c) return kiln__err(KILN_ERR_INTERNAL, "custom op: id %d is not one", op);
    if (!c->d.shape) {
        kiln_status s = kiln__broadcast_shapes(c->name, n_in, in, &out[0]);
        out[0].dtype = KILN_DTYPE_F32;
        for (int i = 0; s == KILN_OK && i < n_in; i++)
            if (in[i]->dtype != KILN_DTYPE_F32)
                s = kiln__err(KILN_ERR_DTYPE, "%s: input %d is %s; the op takes f32", c->name, i, kiln__shape_text(in[i]));
        return s;
    }
    kiln_op_meta m[KILN__MAX_OUT];
    memset(m, 0, sizeof m);
    kiln_op_args x = args_of(c, op, in, NULL, a);
    held_error held;
    hold_error(&held);
    kiln_status s = c->d.shape(&x, m);
    if (s == KILN_OK) restore_error(&held);
    if (s != KILN_OK) {
        if (kiln_last_status() == KILN_OK) return kiln__err(s, "%s: its shape function refused the call", c->name);
        char why[512];
        snprintf(why, sizeof why, "%s", kiln_last_error()); /* the message is rewritten below */
        return kiln__err(s, "%s: %s", c->name, why);
    }
    for (int j = 0; j < c->d.n_out; j++) {
        if (m[j].ndim < 0 || m[j].ndim > KILN_MAX_DIMS || (unsigned)m[j].dtype >= KILN_DTYPE_COUNT)
            return kiln__err(KILN_ERR_INTERNAL, "%s: its shape function gave output %d %d dims and dtype %d", c->name, j,
                             m[j].ndim, (int)m[j].dtype);
        out[j].dtype = m[j].dtype;
        out[j].ndim = m[j].ndim;
        for (int d = 0; d < m[j].ndim; d++) {
            if (m[j].shape[d] < 0)
                return kiln__err(KILN_ERR_INTERNAL, "%s: its shape function gave output %d a size %lld in dim %d",
                                 c->name, j, (long long)m[j].shape[d], d);
            out[j].shape[d] = m[j].shape[d];
        }
    }
    if (c->expr) { /* a pointwise op's output is its inputs broadcast: its kernels read them so */
        kiln__meta b = {0};
        if ((s = kiln__broadcast_shapes(c->name, n_in, in, &b)) != KILN_OK) return s;
        if (!kiln__same_shape(b.ndim, b.shape, out[0].ndim, out[0].shape))
            return kiln__err(KILN_ERR_INTERNAL, "%s: its shape function gave the output another shape than its inputs "
                             "broadcast (%s first); an op with an expression is pointwise", c->name,
                             kiln__shape_text(in[0]));
    }
    return KILN_OK;
}

/* k's source built on be, once (the built kernel kept for the process). */
static kiln_status built_on(custom *c, kernel *k, kiln__backend *be, void **out)
{
    pthread_mutex_lock(&c->lock);
    kiln_status s = KILN_OK;
    int i = 0;
    while (i < MAX_BUILT && k->built[i].be && k->built[i].be != be) i++;
    if (i == MAX_BUILT) s = kiln__err(KILN_ERR_UNSUPPORTED, "%s: built on %d devices already", c->name, MAX_BUILT);
    else if (!k->built[i].be) {
        void *kn = NULL;
        s = kiln__be_compile_kernel(be, k->source, k->entry, &kn);
        char why[1024];
        snprintf(why, sizeof why, "%s", kiln_last_error());
        if (s == KILN_OK) k->built[i].be = be, k->built[i].kernel = kn;
        else s = kiln__err(s, "%s: its %s kernel %s does not build on %s: %s", c->name, k->device, k->entry, be->name,
                           why);
    }
    if (s == KILN_OK) *out = k->built[i].kernel;
    pthread_mutex_unlock(&c->lock);
    return s;
}

static kiln_status launch(custom *c, kernel *k, kiln__backend *be, kiln_tensor_t *const *in, const kiln__attrs *a,
                          kiln_tensor_t *const *out)
{
    void *kn;
    kiln_status s = built_on(c, k, be, &kn);
    if (s != KILN_OK) return s;
    kiln__karg args[8 + KILN__MAX_OUT + 2 + MAX_ATTRS];
    int n = 0;
    for (int i = 0; i < c->d.n_in; i++) args[n++] = (kiln__karg){KILN__KARG_BUF, kiln__data(in[i]), 0, 0};
    for (int j = 0; j < c->d.n_out; j++) args[n++] = (kiln__karg){KILN__KARG_BUF, kiln__data(out[j]), 0, 0};
    const kiln_tensor_t *o = out[0];
    int64_t cols = o->ndim ? o->shape[o->ndim - 1] : 1, numel = kiln_tensor_numel(o);
    int64_t items = k->grid == KILN_OP_GRID_ROWS ? (cols ? numel / cols : 0) : numel;
    args[n++] = (kiln__karg){KILN__KARG_I64, NULL, items, 0};
    args[n++] = (kiln__karg){KILN__KARG_I64, NULL, cols, 0};
    for (int i = 0; i < c->n_attr; i++)
        args[n++] = c->attr_int[i] ? (kiln__karg){KILN__KARG_I64, NULL, a->op.custom.v[i].i, 0}
                                   : (kiln__karg){KILN__KARG_F32, NULL, 0, a->op.custom.v[i].f};
    size_t grid = (size_t)items;
    return grid ? kiln__be_launch(be, kn, args, n, &grid, NULL, 1) : KILN_OK;
}

/* x as a view of o's shape (x's dims aligned at the right, stride 0 where it has one
 * element or none). Made here, not by kiln_expand,
 * which would be an op call that the interceptors see from inside a kernel. */
static kiln_tensor_t *broadcast(kiln_tensor_t *x, const kiln_tensor_t *o)
{
    int64_t stride[KILN_MAX_DIMS];
    if (x->ndim > o->ndim) {
        kiln__err(KILN_ERR_INTERNAL, "custom op: input %s has more dims than the output", kiln__shape_text(x));
        return NULL;
    }
    for (int d = 0; d < o->ndim; d++) {
        int k = d - (o->ndim - x->ndim);
        if (k >= 0 && x->shape[k] != 1 && x->shape[k] != o->shape[d]) {
            kiln__err(KILN_ERR_INTERNAL, "custom op: input %s does not broadcast to the output", kiln__shape_text(x));
            return NULL;
        }
        stride[d] = k < 0 || x->shape[k] == 1 ? 0 : x->stride[k];
    }
    return kiln__tensor_alias(x->st, x->dtype, o->ndim, o->shape, stride, x->offset);
}

/* The kernel column: the op's kernel for be, given dense inputs (an expression op's
 * broadcast to the output's shape first). */
static kiln_status custom_kernel(KILN__KERNEL_ARGS)
{
    custom *c = of(a->op.custom.op);
    kernel *k = NULL;
    for (int i = 0; c && !k && i < c->d.n_kernels; i++)
        if (kiln__backend_is(be, c->kernels[i].device)) k = &c->kernels[i];
    if (!k) return kiln__err(KILN_ERR_INTERNAL, "custom op: no kernel for %s", be->name);
    /* dense[i]: input i itself when it is contiguous and of the output's shape (or the op
     * broadcasts nothing), else a dense copy of its view made here (owned[i]) */
    kiln_tensor_t *dense[KILN_OP_MAX_IN] = {0};
    bool owned[KILN_OP_MAX_IN] = {false};
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < n_in; i++) {
        bool same = !c->expr || (in[i]->ndim == out[0]->ndim &&
                                 !memcmp(in[i]->shape, out[0]->shape, sizeof(int64_t) * (size_t)in[i]->ndim));
        if (same && kiln__is_contiguous(in[i])) {
            dense[i] = in[i];
            continue;
        }
        kiln_tensor_t *x = same ? kiln_tensor_retain(in[i]) : broadcast(in[i], out[0]);
        dense[i] = x ? kiln__dense(x) : NULL;
        owned[i] = dense[i] != NULL;
        kiln_tensor_free(x);
        if (!dense[i]) s = kiln_last_status();
    }
    if (s == KILN_OK && k->fn) {
        kiln_op_args x = args_of(c, a->op.custom.op, dense, out, a);
        held_error held;
        hold_error(&held);
        s = k->fn(&x);
        if (s == KILN_OK) restore_error(&held);
        if (s != KILN_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", kiln_last_status() ? kiln_last_error() : "(it gave no message)");
            s = kiln__err(s, "%s: its %s kernel failed: %s", c->name, k->device, why);
        }
    } else if (s == KILN_OK) {
        s = launch(c, k, be, dense, a, out);
    }
    for (int i = 0; i < n_in; i++)
        if (owned[i]) kiln_tensor_free(dense[i]);
    return s;
}

/* The backward column: the op's own backward, given the call's inputs and outputs. */
static kiln_status custom_bw(kiln__node *n, kiln_tensor_t *const *gout, kiln_tensor_t **gin)
{
    custom *c = of(n->op);
    kiln_op_args x = args_of(c, n->op, n->saved_in, n->saved_out, &n->attrs);
    kiln_status s = c->d.backward(&x, gout, gin);
    if (s != KILN_OK) return kiln_last_status() ? s : kiln__err(s, "%s: its backward failed", c->name);
    for (int i = 0; i < n->n_in; i++) {
        if (!n->needs_grad[i]) continue;
        if (!gin[i])
            return kiln__err(KILN_ERR_AUTOGRAD, "%s: its backward gave no gradient for input %d, which needs one",
                             c->name, i);
        if (gin[i]->dtype != n->in_meta[i].dtype || (n->saved_in[i] && gin[i]->st->be != n->saved_in[i]->st->be))
            return kiln__err(KILN_ERR_AUTOGRAD, "%s: its backward gave input %d a gradient %s on %s; the input is %s on "
                             "%s", c->name, i, kiln__shape_text(gin[i]), gin[i]->st->be->name,
                             kiln_dtype_name(n->in_meta[i].dtype),
                             n->saved_in[i] ? n->saved_in[i]->st->be->name : "its device");
    }
    return KILN_OK;
}

kiln__backward_fn kiln__custom_backward(int op)
{
    custom *c = of(op);
    return c && c->d.backward ? custom_bw : NULL;
}

static kiln_status custom_dec(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, kiln_tensor_t **out)
{
    custom *c = of(a->op.custom.op);
    kiln_tensor_t *res[KILN__MAX_OUT] = {0};
    kiln_op_args x = args_of(c, a->op.custom.op, in, NULL, a);
    kiln_status s = c->d.decompose(&x, res);
    for (int j = 0; s == KILN_OK && j < c->d.n_out; j++)
        if (!res[j]) s = kiln__err(KILN_ERR_INTERNAL, "%s: its decomposition gave no output %d", c->name, j);
    if (s != KILN_OK) return kiln_last_status() ? kiln_last_status() : s;
    for (int j = 0; j < c->d.n_out; j++) out[j] = kiln_tensor_retain(res[j]);
    return KILN_OK;
}

kiln__decompose_fn kiln__custom_decomposition(int op, kiln_tensor_t *const *in, int n_in, bool all)
{
    custom *c = of(op);
    if (!c || !c->d.decompose) return NULL;
    /* Its own kernel is the fused form the author wrote: kept unless every decomposition
     * is asked for, or the device has none. */
    return all || n_in == 0 || !kiln__be_has_kernel(in[0]->st->be, op) ? custom_dec : NULL;
}

const char *kiln__custom_expr(int op)
{
    custom *c = of(op);
    return c ? c->expr : NULL;
}

/* The expression's tokens in turn: *kind 'x' an input x<i>, 'a' an attribute a<k> (the
 * index in *index), 'n' a number, 'w' another word, 'o' an operator character; *len
 * its length. 0 at the end. */
static int token(const char *p, size_t *len, int *index)
{
    const char *q = p;
    if (!*p) return 0;
    if ((*p >= '0' && *p <= '9') || (*p == '.' && p[1] >= '0' && p[1] <= '9')) {
        for (q++; *q == '.' || (*q >= '0' && *q <= '9') || (*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') ||
                  ((*q == '-' || *q == '+') && (q[-1] == 'e' || q[-1] == 'E'));
             q++) {
        }
        *len = (size_t)(q - p);
        return 'n';
    }
    if (*p == '_' || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z')) {
        while (*q == '_' || (*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9')) q++;
        *len = (size_t)(q - p);
        bool digits = *len > 1 && *len < 4;
        for (size_t i = 1; i < *len; i++) digits &= p[i] >= '0' && p[i] <= '9';
        if (digits && (*p == 'x' || *p == 'a')) {
            *index = 0; /* one or two digits: no overflow */
            for (size_t i = 1; i < *len; i++) *index = *index * 10 + (p[i] - '0');
            return *p;
        }
        return 'w';
    }
    *len = 1;
    return 'o';
}

/* An expression may use its operands, its attributes, numbers, function names and C's
 * operators, nothing that would end it or start a statement. */
static kiln_status check_expr(const custom *c)
{
    size_t len;
    int k, index, depth = 0;
    for (const char *p = c->expr; (k = token(p, &len, &index)); p += len) {
        if ((k == 'x' && index >= c->d.n_in) || (k == 'a' && index >= c->n_attr))
            return kiln__err(KILN_ERR_ARG, "op %s: expr: %.*s names no %s (it has %d)", c->name, (int)len, p,
                             k == 'x' ? "input" : "attribute", k == 'x' ? c->d.n_in : c->n_attr);
        if (k == 'w') { /* a kmath function, called; or INFINITY */
            const char *q = p + len;
            while (*q == ' ') q++;
            bool call = len > 3 && !strncmp(p, "km_", 3) && *q == '(';
            if (!call && !(len == 8 && !strncmp(p, "INFINITY", 8)))
                return kiln__err(KILN_ERR_ARG, "op %s: expr: '%.*s' is not x<i>, a<k>, a number, INFINITY or a kmath "
                                 "function (km_exp, km_tanh, ...) called", c->name, (int)len, p);
        }
        bool comment = *p == '/' && (p[1] == '/' || p[1] == '*');
        if (k == 'o' && (!strchr(" +-*/%<>=!&|^~?:(),.", *p) || comment))
            return kiln__err(KILN_ERR_ARG, "op %s: expr: '%.*s' at %d is not part of an expression", c->name,
                             comment ? 2 : 1, p, (int)(p - c->expr));
        depth += *p == '(' ? 1 : *p == ')' ? -1 : 0;
        if (depth < 0) break;
    }
    if (depth) return kiln__err(KILN_ERR_ARG, "op %s: expr: unbalanced parentheses in \"%s\"", c->name, c->expr);
    return KILN_OK;
}

char *kiln__custom_expr_text(int op, const char *const *names, int n_names, const kiln__attrs *a)
{
    custom *c = of(op);
    if (!c || !c->expr) return NULL;
    size_t cap = strlen(c->expr) * 4 + 64, n = 0, len;
    char *out = malloc(cap);
    int k, index;
    for (const char *p = c->expr; out && (k = token(p, &len, &index)); p += len) {
        char num[48];
        const char *put = p;
        size_t m = len;
        if (k == 'x' && index < n_names) put = names[index], m = strlen(put);
        if (k == 'a') {
            double f = a->op.custom.v[index].f;
            if (c->attr_int[index]) snprintf(num, sizeof num, "(%lld)", (long long)a->op.custom.v[index].i);
            else if (isinf(f)) snprintf(num, sizeof num, "((float)(%sINFINITY))", f < 0 ? "-" : "");
            else if (isnan(f)) snprintf(num, sizeof num, "km_bits(0x7fc00000)");
            else snprintf(num, sizeof num, "((float)%.17g)", f);
            put = num, m = strlen(num);
        }
        if (n + m + 1 > cap) {
            char *grown = realloc(out, cap = 2 * (n + m + 1));
            if (!grown) free(out);
            out = grown;
            if (!out) break;
        }
        memcpy(out + n, put, m);
        n += m;
    }
    if (out) out[n] = 0;
    return out;
}

/* Parses "name:f64,name:i64" into c. */
static kiln_status parse_attrs(custom *c, const char *spec)
{
    for (const char *p = spec ? spec : ""; *p;) {
        const char *end = p + strcspn(p, ","), *colon = memchr(p, ':', (size_t)(end - p));
        size_t nl = colon ? (size_t)(colon - p) : 0, tl = colon ? (size_t)(end - colon - 1) : 0;
        bool ident = nl > 0 && !(*p >= '0' && *p <= '9');
        for (size_t i = 0; i < nl; i++)
            ident &= p[i] == '_' || (p[i] >= 'a' && p[i] <= 'z') || (p[i] >= 'A' && p[i] <= 'Z') || (p[i] >= '0' && p[i] <= '9');
        if (c->n_attr == MAX_ATTRS)
            return kiln__err(KILN_ERR_ARG, "op %s: attrs: more than %d attributes", c->name, MAX_ATTRS);
        if (!colon || !ident || nl >= sizeof c->attr_name[0] || tl != 3 ||
            (strncmp(colon + 1, "f64", 3) && strncmp(colon + 1, "i64", 3)))
            return kiln__err(KILN_ERR_ARG, "op %s: attrs: '%.*s' is not name:f64 or name:i64 (in \"%s\")", c->name,
                             (int)(end - p), p, spec);
        for (int i = 0; i < c->n_attr; i++)
            if (strlen(c->attr_name[i]) == nl && !strncmp(c->attr_name[i], p, nl))
                return kiln__err(KILN_ERR_ARG, "op %s: attrs: '%.*s' is named twice (in \"%s\")", c->name, (int)nl, p,
                                 spec);
        memcpy(c->attr_name[c->n_attr], p, nl);
        c->attr_name[c->n_attr][nl] = 0;
        c->attr_int[c->n_attr++] = colon[1] == 'i';
        if (*end && !end[1])
            return kiln__err(KILN_ERR_ARG, "op %s: attrs: a ',' ends \"%s\"", c->name, spec);
        p = *end ? end + 1 : end;
    }
    return KILN_OK;
}

static kiln_status check_decl(const kiln_op_decl *d)
{
    const char *nm = d->name;
    if (!nm || !*nm) return kiln__err(KILN_ERR_ARG, "op_define: the op has no name");
    for (const char *p = nm; *p; p++)
        if (!(*p == '_' || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (p > nm && *p >= '0' && *p <= '9')))
            return kiln__err(KILN_ERR_ARG, "op_define: the name '%s' is not an identifier (letters, digits, _)", nm);
    if (d->n_in < 1 || d->n_in > KILN_OP_MAX_IN)
        return kiln__err(KILN_ERR_ARG, "op %s: n_in %d (1 to %d)", nm, d->n_in, KILN_OP_MAX_IN);
    if (d->n_out < 1 || d->n_out > KILN__MAX_OUT)
        return kiln__err(KILN_ERR_ARG, "op %s: n_out %d (1 to %d)", nm, d->n_out, KILN__MAX_OUT);
    if (d->n_visible < 0 || d->n_visible > d->n_out)
        return kiln__err(KILN_ERR_ARG, "op %s: n_visible %d (0 for all, else 1 to n_out, %d)", nm, d->n_visible, d->n_out);
    if (!d->shape && !d->expr) return kiln__err(KILN_ERR_ARG, "op %s: no shape function (only an expr op may omit it)", nm);
    if (d->expr && (d->n_out != 1 || !*d->expr))
        return kiln__err(KILN_ERR_ARG, "op %s: expr: a pointwise op has one output and a non-empty expression", nm);
    if (d->n_kernels < 0 || (d->n_kernels && !d->kernels))
        return kiln__err(KILN_ERR_ARG, "op %s: n_kernels %d with kernels %s", nm, d->n_kernels, d->kernels ? "" : "NULL");
    bool cpu = false;
    for (int i = 0; i < d->n_kernels; i++) {
        const kiln_op_kernel *k = &d->kernels[i];
        if (!k->device || !*k->device) return kiln__err(KILN_ERR_ARG, "op %s: kernel %d names no device", nm, i);
        if (!k->fn == !k->source)
            return kiln__err(KILN_ERR_ARG, "op %s: the %s kernel gives %s (a C function, or a source and its entry)",
                             nm, k->device, k->fn ? "both fn and source" : "neither fn nor source");
        if (k->source && (!k->entry || !*k->entry))
            return kiln__err(KILN_ERR_ARG, "op %s: the %s kernel's source names no entry", nm, k->device);
        if (k->grid != KILN_OP_GRID_ELEMENTS && k->grid != KILN_OP_GRID_ROWS)
            return kiln__err(KILN_ERR_ARG, "op %s: the %s kernel's grid %d is not one", nm, k->device, (int)k->grid);
        for (int j = 0; j < i; j++)
            if (!strcmp(d->kernels[j].device, k->device))
                return kiln__err(KILN_ERR_ARG, "op %s: two kernels for %s", nm, k->device);
        cpu |= !strcmp(k->device, "cpu");
        if (!strcmp(k->device, "cpu") && !k->fn)
            return kiln__err(KILN_ERR_ARG, "op %s: the cpu kernel is a C function (fn), not source", nm);
    }
    if (!cpu)
        return kiln__err(KILN_ERR_ARG, "op %s: no cpu kernel; every op has one, the reference every device falls "
                         "back to", nm);
    return KILN_OK;
}

static void free_custom(custom *c)
{
    for (int i = 0; c->kernels && i < c->d.n_kernels; i++) {
        free(c->kernels[i].device);
        free(c->kernels[i].source);
        free(c->kernels[i].entry);
    }
    free(c->kernels);
    free(c->name);
    free(c->expr);
    memset(c, 0, sizeof *c);
}

/* The source kernels built now on every device of theirs already open: a kernel that
 * does not build is an error when the op is defined (loaded), not at its first call. */
static kiln_status build_now(custom *c)
{
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < c->d.n_kernels; i++)
        for (int b = 0; s == KILN_OK && c->kernels[i].source && b < kiln__backend_count(); b++) {
            kiln__backend *be = kiln__backend_at(b);
            void *kn;
            if (be && kiln__backend_is(be, c->kernels[i].device) && kiln__be_can_compile(be))
                s = built_on(c, &c->kernels[i], be, &kn);
        }
    return s;
}

static pthread_mutex_t define_lock = PTHREAD_MUTEX_INITIALIZER;

kiln_status kiln_op_define(const kiln_op_decl *d, int *id)
{
    kiln__ensure_init();
    if (!d || !id) return kiln__null_arg("op_define");
    kiln_status s = check_decl(d);
    if (s != KILN_OK) return s;
    pthread_mutex_lock(&define_lock);
    int slot = kiln__op_total() - KILN_OP_COUNT;
    if (slot >= KILN__CUSTOM_MAX) {
        pthread_mutex_unlock(&define_lock);
        return kiln__err(KILN_ERR_ARG, "op %s: %d custom ops are defined already, the most there can be", d->name,
                         KILN__CUSTOM_MAX);
    }
    custom *c = &ops[slot];
    memset(c, 0, sizeof *c);
    c->d = *d;
    c->name = strdup(d->name);
    c->expr = d->expr ? strdup(d->expr) : NULL;
    c->kernels = calloc((size_t)d->n_kernels + 1, sizeof *c->kernels);
    s = !c->name || (d->expr && !c->expr) || !c->kernels ? kiln__err(KILN_ERR_OOM, "op %s: out of memory", d->name)
                                                         : parse_attrs(c, d->attrs);
    const char *devices[8];
    if (s == KILN_OK && d->n_kernels > 8) s = kiln__err(KILN_ERR_ARG, "op %s: kernels for %d devices, at most 8", d->name, d->n_kernels);
    for (int i = 0; s == KILN_OK && i < d->n_kernels; i++) {
        const kiln_op_kernel *k = &d->kernels[i];
        kernel *o = &c->kernels[i];
        o->fn = k->fn;
        o->grid = k->grid;
        o->device = strdup(k->device);
        o->source = k->source ? strdup(k->source) : NULL;
        o->entry = k->entry ? strdup(k->entry) : NULL;
        if (!o->device || (k->source && (!o->source || !o->entry))) s = kiln__err(KILN_ERR_OOM, "op %s: out of memory", d->name);
        devices[i] = o->device;
    }
    c->d.name = c->name;
    c->d.expr = c->expr;
    c->d.attrs = NULL;
    pthread_mutex_init(&c->lock, NULL);
    /* saves every input and output for the backward: what it needs is its own affair */
    unsigned save = 0;
    for (int i = 0; i < d->n_in; i++) save |= KILN__SI(i);
    for (int j = 0; j < d->n_out; j++) save |= KILN__SO(j);
    kiln__op_def row = {.name = c->name, .kind = d->expr ? KILN__KIND_POINTWISE : KILN__KIND_COMPOSITE, .n_in = d->n_in,
                        .n_out = d->n_out, .n_visible = d->n_visible ? d->n_visible : d->n_out, .save = save,
                        .has_grad = d->backward != NULL, .amp = KILN_AMP_ANY, .infer = infer_custom};
    if (s == KILN_OK && c->expr) s = check_expr(c);
    if (s == KILN_OK) s = build_now(c);
    if (s == KILN_OK) s = kiln__op_add(&row, custom_kernel, devices, d->n_kernels, id);
    if (s != KILN_OK) {
        for (int i = 0; c->kernels && i < d->n_kernels; i++)
            for (int b = 0; b < MAX_BUILT && c->kernels[i].built[b].be; b++)
                kiln__be_kernel_free(c->kernels[i].built[b].be, c->kernels[i].built[b].kernel);
        pthread_mutex_destroy(&c->lock);
        free_custom(c);
    }
    pthread_mutex_unlock(&define_lock);
    return s;
}

int kiln_op_find(const char *name) { return kiln__op_by_name(name); }

kiln_status kiln_op_run(int id, kiln_tensor_t *const *in, int n_in, const kiln_op_value *attr, int n_attr,
                        kiln_tensor_t **out)
{
    custom *c = of(id);
    if (!c) {
        const char *nm = id >= 0 && id < kiln__op_total() ? kiln__ops[id].name : NULL;
        return nm ? kiln__err(KILN_ERR_ARG, "op_run: %s is a built-in op; call it through its own function", nm)
                  : kiln__err(KILN_ERR_ARG, "op_run: %d is not an op's id (kiln_op_find gives one)", id);
    }
    if (!in || !out) return kiln__null_arg(c->name);
    if (n_in != c->d.n_in) return kiln__err(KILN_ERR_ARG, "%s: %d inputs given, it takes %d", c->name, n_in, c->d.n_in);
    if (n_attr != c->n_attr || (n_attr && !attr))
        return kiln__err(KILN_ERR_ARG, "%s: %d attributes given, it takes %d", c->name, n_attr, c->n_attr);
    kiln__attrs a;
    memset(&a, 0, sizeof a);
    a.op.custom.op = id;
    a.op.custom.n = n_attr;
    if (n_attr) memcpy(a.op.custom.v, attr, sizeof *attr * (size_t)n_attr);
    kiln_tensor_t *res[KILN__MAX_OUT] = {0};
    kiln_status s = kiln__dispatch((kiln__op_id)id, in, n_in, &a, res);
    if (s != KILN_OK) return s;
    int vis = kiln__ops[id].n_visible;
    for (int j = 0; j < c->d.n_out; j++) {
        if (j < vis) out[j] = kiln__scoped(res[j]);
        else kiln_tensor_free(res[j]);
    }
    return KILN_OK;
}

kiln_tensor_t *kiln_op_call(int id, kiln_tensor_t *const *in, int n_in, const kiln_op_value *attr, int n_attr)
{
    kiln_tensor_t *out[KILN__MAX_OUT] = {0};
    return kiln_op_run(id, in, n_in, attr, n_attr, out) == KILN_OK ? out[0] : NULL;
}

void *kiln_op_data(const kiln_tensor_t *t) { return t ? kiln__data(t) : NULL; }

void *kiln_op_stream(const kiln_tensor_t *t) { return t ? kiln__be_native_stream(t->st->be) : NULL; }
