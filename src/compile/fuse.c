/* Scheduling and fusion: the graph's ops become steps, each either one op run through
 * dispatch (matmul, attention, indexing, views, in-place updates, ...) or a generated
 * kernel that fuses a run of pointwise ops and last-dim reductions.
 *
 * Ops are taken in program order. A fusible op joins the open group (kernel) of one of
 * its operands when its result fits that group's index space (the same shape, or one
 * value per row); failing that, an open group with the same index space (horizontal
 * fusion of siblings); else it starts a group. A group is launched where its last op
 * stood, so it must not be read early: it closes as soon as an op outside it reads one
 * of its values, at every in-place op, and at the size limit. That rule keeps the steps
 * in a valid order without reordering anything. A value of a group is stored only if
 * something outside the group reads it (or the graph returns it). */
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/dtype.h"
#include "core/util.h"

enum { F_FULL, F_ROWK, F_ROWN, F_NONE }; /* the value's place in a group's index space */

typedef enum { L_NONE, L_PW, L_REDUCE, L_GEN, L_ALIAS } lower_kind;

static bool loadable(kiln_dtype dt)
{
    return dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_F64 || dt == KILN_DTYPE_I64 || dt == KILN_DTYPE_I32 ||
           dt == KILN_DTYPE_BOOL || dt == KILN_DTYPE_U8 || kiln__is_half(dt);
}


/* How op lowers, given its inputs' dtypes in[0..n_in) and its output's o: arithmetic and
 * the ops of include/kiln/pointwise.def in f32, bf16 and f16 (mixed with f32 as
 * promotion gives) and f64 (kmath.h has both forms), reductions in f32 and f64; GELU in
 * f32, bf16 and f16 (its generated forms are float code). */
/* (f32-like ones, kiln__f32_or_half, are computed in f32 and rounded where the eager op
 * rounds: kmath.h's km_round_bf16 / km_round_f16, as the cpu's eager kernels compute.) */
static lower_kind lower_op(kiln__op_id op, const kiln_dtype *in, int n_in, kiln_dtype o)
{
    bool f32_in = true, f64_in = true, like_in = true;
    for (int i = 0; i < n_in; i++) {
        f32_in &= in[i] == KILN_DTYPE_F32;
        f64_in &= in[i] == KILN_DTYPE_F64;
        like_in &= kiln__f32_or_half(in[i]);
    }
    bool same_float = (f32_in && o == KILN_DTYPE_F32) || (f64_in && o == KILN_DTYPE_F64);
    bool float_pw = same_float || (like_in && kiln__f32_or_half(o));
    if (kiln__op_math[op].name) return float_pw ? L_PW : L_NONE;
    if (kiln__op_is_custom(op)) /* an expression of float values, of at most 3 operands as every lowered op */
        return kiln__custom_expr(op) && n_in <= 3 && like_in && kiln__f32_or_half(o) ? L_PW : L_NONE;
    switch (op) {
    case KILN_OP_ADD: case KILN_OP_SUB: case KILN_OP_MUL: case KILN_OP_DIV: case KILN_OP_POW:
    case KILN_OP_MAXIMUM: case KILN_OP_MINIMUM:
        return float_pw ? L_PW : L_NONE;
    case KILN_OP_GELU: case KILN_OP_GELU_BACKWARD:
        return like_in && kiln__f32_or_half(o) ? L_PW : L_NONE;
    case KILN_OP_EQ: case KILN_OP_NE: case KILN_OP_LT: case KILN_OP_LE: case KILN_OP_GT: case KILN_OP_GE:
        return loadable(in[0]) && in[0] == in[1] && o == KILN_DTYPE_BOOL ? L_PW : L_NONE;
    case KILN_OP_WHERE:
        return loadable(in[0]) && in[1] == o && in[2] == o && kiln__f32_or_half(o) ? L_PW : L_NONE;
    case KILN_OP_CAST: case KILN_OP_CONTIGUOUS:
        /* to bf16 through float: only from what float holds exactly (f64 or a wide
         * integer would be rounded twice; the cpu's copy rounds them once) */
        if (kiln__is_half(o) && !kiln__f32_or_half(in[0]) && in[0] != KILN_DTYPE_BOOL &&
            in[0] != KILN_DTYPE_U8)
            return L_NONE;
        return loadable(in[0]) && loadable(o) ? L_PW : L_NONE;
    case KILN_OP_SUM: case KILN_OP_MAX: /* bf16/f16 ones stay eager (docs/perf-log.md: slower generated) */
        return same_float ? L_REDUCE : L_NONE;
    case KILN_OP_FULL: case KILN_OP_ARANGE: /* a 16-bit one from its double value on dispatch: rounded once */
        return loadable(o) && !kiln__is_half(o) ? L_GEN : L_NONE;
    case KILN_OP_VIEW:
        return L_ALIAS;
    default:
        return L_NONE;
    }
}

/* How node n lowers for backend be: as lower_op says, unless be's can_fuse hook keeps it
 * out of generated kernels (a view is only a relabelling, and always taken). */
static lower_kind lowering(const kiln_graph_t *g, const node *n, kiln__backend *be)
{
    kiln_dtype in[4]; /* an op that lowers has at most 3 inputs (where) */
    if (n->n_in > 4) return L_NONE;
    for (int i = 0; i < n->n_in; i++) in[i] = g->v[n->in[i]].meta.dtype;
    kiln_dtype out = n->n_out ? g->v[n->out[0]].meta.dtype : KILN_DTYPE_F32;
    lower_kind l = lower_op(n->op, in, n->n_in, out);
    if (l == L_NONE || l == L_ALIAS || !be) return l;
    return kiln__be_can_fuse(be, n->op, in, n->n_in, out) ? l : L_NONE;
}

typedef struct {
    int ndim;
    int64_t dom[KILN_MAX_DIMS];
    int last, n_ops;
    bool open;
} group;

/* Where a value of this shape sits in a group's index space. */
static int frame_of(const group *gr, const kiln__meta *m)
{
    int k = gr->ndim;
    if (kiln__same_shape(m->ndim, m->shape, k, gr->dom)) return F_FULL;
    if (k == 0) return F_NONE;
    bool outer = true;
    for (int d = 0; d < k - 1 && d < m->ndim; d++) outer &= m->shape[d] == gr->dom[d];
    if (m->ndim == k && outer && m->shape[k - 1] == 1) return F_ROWK;
    if (m->ndim == k - 1 && outer) return F_ROWN;
    return F_NONE;
}

/* Can a value of form fu feed an op evaluated in frame fn? A row value broadcasts along
 * the inner dim with keepdim (or when there is one row dim fewer and no rows at all). */
static bool feeds(int fu, int fn, int k)
{
    return fu == fn || (fu == F_ROWK && fn == F_FULL) || (fu == F_ROWN && fn == F_FULL && k == 1);
}

static bool reduces_last(const node *n, const kiln__meta *in)
{
    if (in->ndim == 0) return false;
    if (n->attrs.ndim == 0) return in->ndim == 1;
    return n->attrs.ndim == 1 && kiln__norm_dim((int)n->attrs.shape[0], in->ndim) == in->ndim - 1;
}

/* The form node n's result would take in open group G, or F_NONE if n cannot join it.
 * horizontal: n reads none of G's values (a sibling over the same index space). */
static int join_form(const kiln_graph_t *g, const group *gr, int G, const node *n, lower_kind l, const int *vgrp,
                     const int *form, bool horizontal, int max_fuse)
{
    if (!gr[G].open || gr[G].n_ops >= max_fuse) return F_NONE;
    const kiln__meta *om = &g->v[n->out[0]].meta, *im = &g->v[n->in[0]].meta;
    if (l == L_REDUCE)
        return frame_of(&gr[G], im) == F_FULL && reduces_last(n, im) ? (n->attrs.keepdim ? F_ROWK : F_ROWN) : F_NONE;
    int f = frame_of(&gr[G], om);
    if (f == F_NONE) return F_NONE;
    if (l == L_ALIAS) /* a view that only relabels one of G's row values (kept dim or not) */
        return !horizontal && vgrp[n->in[0]] == G && f != F_FULL && form[n->in[0]] != F_FULL ? f : F_NONE;
    if (horizontal && f != F_FULL) return F_NONE;
    for (int i = 0; i < n->n_in; i++)
        if (vgrp[n->in[i]] == G && !feeds(form[n->in[i]], f, gr[G].ndim)) return F_NONE;
    return f;
}

/* The element strides of value v as the graph left it: views keep the strides their
 * inference gave, arguments those they were captured with (contiguous, by guard, for
 * kiln_compiled; the eager ops' one-op graphs keep their inputs'), everything else is
 * contiguous. */
void kiln__compile_value_strides(const kiln_graph_t *g, int v, int64_t *st)
{
    const value *x = &g->v[v];
    if (x->kind != V_OP || kiln__ops[g->nd[x->index].op].is_view)
        memcpy(st, x->meta.stride, sizeof(int64_t) * KILN_MAX_DIMS);
    else
        kiln__contiguous_strides(x->meta.ndim, x->meta.shape, st);
}

/* Strides over the domain of a kernel for a value (shape m, strides vs) read in frame f. */
static void embed(const group *gr, const kiln__meta *m, const int64_t *vs, int f, int64_t *out)
{
    int k = gr->ndim, fk = f == F_ROWN ? k - 1 : k;
    memset(out, 0, sizeof(int64_t) * KILN_MAX_DIMS);
    for (int i = 0; i < fk; i++) {
        int j = i - (fk - m->ndim);
        out[i] = j < 0 || m->shape[j] == 1 ? 0 : vs[j];
    }
    if (f != F_FULL) out[k - 1] = 0;
}

static bool is_view_value(const kiln_graph_t *g, int v)
{
    return g->v[v].kind == V_OP && kiln__ops[g->nd[g->v[v].index].op].is_view;
}

/* May value u's memory overlap that of dst (a copy_'s destination)? Views of one root do
 * when they share an element; captured tensors over the same bytes do; an argument
 * does not (a run refuses one that shares memory with a captured tensor the graph
 * writes, graph.c's check_inputs), nor do two intermediates. */
static bool may_alias(const kiln_graph_t *g, int u, int dst)
{
    int r = kiln__graph_root(g, u), rd = kiln__graph_root(g, dst);
    const value *x = &g->v[r], *d = &g->v[rd];
    const kiln__meta *a = &g->v[u].meta, *b = &g->v[dst].meta;
    if (r == rd) /* two views of one intermediate: by their elements (exact for views of one
                  * shape and strides of a dense tensor: slices on one dim do not share one) */
        return !(x->kind == V_OP && is_view_value(g, u) && is_view_value(g, dst)) ||
               kiln__views_overlap(a->ndim, a->shape, a->stride, a->offset, b->ndim, b->shape, b->stride, b->offset);
    return x->kind == V_CONST && d->kind == V_CONST && kiln__tensors_overlap(x->t, d->t);
}

/* util.h's KILN__GROW from 16: the array keeps its block when out of memory (the kernel
 * still owns and frees it). */
#define GROW(arr, n, cap) KILN__GROW(arr, n, &(cap), 16, grow_tmp)

typedef struct {
    kiln_graph_t *g;
    kc_kernel *kr;
    group *gr;
    int *memo; /* per value: its expression in this kernel, -1 */
    int *form;
    const bool *mutated;
} lower_ctx;

static int new_expr(kc_kernel *k, const kc_expr *e)
{
    void *grow_tmp;
    if (!GROW(k->e, k->n_e, k->cap_e)) return -1;
    k->e[k->n_e] = *e;
    return k->n_e++;
}

static int buf_slot(kc_kernel *k, int value, bool output, kiln_dtype dt, const int64_t *st)
{
    for (int b = 0; b < k->n_buf; b++)
        if (k->buf[b].value == value && (k->buf[b].output == output || k->buf[b].inplace)) return b;
    void *grow_tmp;
    if (!GROW(k->buf, k->n_buf, k->cap_buf)) return -1;
    k->buf[k->n_buf] = (kc_buf){.value = value, .output = output, .dt = dt};
    memcpy(k->buf[k->n_buf].st, st, sizeof k->buf[0].st);
    return k->n_buf++;
}

/* The expression for value u read in frame f of the kernel being built. */
static int operand(lower_ctx *c, int u, int f)
{
    kc_kernel *k = c->kr;
    if (c->memo[u] >= 0) return c->memo[u];
    const value *x = &c->g->v[u];
    kc_expr e = {.kind = E_LOAD, .dt = x->meta.dtype};
    /* full and arange (not written in place later, else their buffer is read) are inline;
     * 16-bit ones are read from their buffer, made on dispatch from the double value
     * (inline, it would be rounded to float first, then to 16 bits) */
    const node *prod = x->kind == V_OP && !c->mutated[u] && !kiln__is_half(x->meta.dtype) ? &c->g->nd[x->index] : NULL;
    int64_t vs[KILN_MAX_DIMS] = {1};
    if (prod && (prod->op == KILN_OP_FULL || prod->op == KILN_OP_ARANGE)) {
        e.kind = prod->op == KILN_OP_FULL ? E_CONST : E_INDEX;
        e.attrs.op.source = prod->attrs.op.source;
    } else {
        kiln__compile_value_strides(c->g, u, vs);
        if ((e.buf = buf_slot(k, u, false, x->meta.dtype, vs)) < 0) return -1;
    }
    if (e.kind != E_CONST) embed(c->gr, &x->meta, vs, f, e.st);
    /* Loads are shared only when read the same way (memo is per value, and a value is
     * read in one frame within a kernel in practice; recompute if not). */
    int id = new_expr(k, &e);
    if (id >= 0 && f == F_FULL) c->memo[u] = id;
    return id;
}

static void name_append(kc_kernel *k, const char *op)
{
    size_t n = strlen(k->ops);
    snprintf(k->ops + n, sizeof k->ops - n, "%s%s", n ? ", " : "", op);
    k->n_ops++;
}

static kiln_status oom(void) { return kiln__err(KILN_ERR_OOM, "compile: out of memory"); }

/* A store of expression x into value v's buffer (an output; in place for a copy_'s
 * destination), v laid out with strides cs and read in frame f. */
static kiln_status add_store(lower_ctx *c, int x, int v, const int64_t *cs, int f)
{
    kc_kernel *kr = c->kr;
    void *grow_tmp;
    if (!GROW(kr->st, kr->n_st, kr->cap_st)) return oom();
    kc_store *s = &kr->st[kr->n_st];
    s->expr = x;
    embed(c->gr, &c->g->v[v].meta, cs, f, s->st);
    if ((s->buf = buf_slot(kr, v, true, c->g->v[v].meta.dtype, cs)) < 0) return oom();
    kr->n_st++;
    return KILN_OK;
}

/* Lowers group gi's ops (members[0..n)) into kernel kr. */
static kiln_status lower_group(kiln_graph_t *g, group *gr, const int *members, int n, const bool *stored, int *form,
                               int *memo, const bool *mutated, kc_kernel *kr)
{
    lower_ctx c = {g, kr, gr, memo, form, mutated};
    kr->ndim = gr->ndim;
    memcpy(kr->dom, gr->dom, sizeof kr->dom);
    /* A copy_ absorbed into the kernel: its destination's buffer is bound first, so
     * that the kernel's loads of it go through the pointer it stores through. */
    for (int m = 0; m < n; m++) {
        const node *nd = &g->nd[members[m]];
        if (nd->op != KILN_OP_COPY_) continue;
        int64_t cs[KILN_MAX_DIMS];
        kiln__compile_value_strides(g, nd->in[0], cs);
        int b = buf_slot(kr, nd->in[0], true, g->v[nd->in[0]].meta.dtype, cs);
        if (b < 0) return oom();
        kr->buf[b].inplace = true;
    }
    for (int m = 0; m < n; m++) {
        const node *nd = &g->nd[members[m]];
        name_append(kr, kiln__ops[nd->op].name);
        if (nd->op == KILN_OP_COPY_) { /* the source's value stored into the destination */
            int64_t cs[KILN_MAX_DIMS];
            kiln__compile_value_strides(g, nd->in[0], cs);
            kiln_status s = add_store(&c, memo[nd->in[1]], nd->in[0], cs, F_FULL);
            if (s != KILN_OK) return s;
            continue;
        }
        int v = nd->out[0], f = form[v];
        if (nd->op == KILN_OP_VIEW) { /* relabels a value of this kernel (join_form) */
            memo[v] = memo[nd->in[0]];
            continue;
        }
        if (nd->op == KILN_OP_SUM || nd->op == KILN_OP_MAX) {
            int x = operand(&c, nd->in[0], F_FULL);
            void *grow_tmp;
            if (x < 0 || !GROW(kr->acc, kr->n_acc, kr->cap_acc)) return oom();
            kr->acc[kr->n_acc] = (kc_acc){nd->op, x, 0};
            if ((memo[v] = new_expr(kr, &(kc_expr){.kind = E_ACC, .buf = kr->n_acc++, .dt = g->v[v].meta.dtype})) < 0)
                return oom();
            continue;
        }
        kc_expr e = {.kind = E_OP, .op = nd->op, .attrs = nd->attrs, .dt = g->v[v].meta.dtype, .n_arg = nd->n_in};
        for (int i = 0; i < nd->n_in; i++)
            if ((e.arg[i] = operand(&c, nd->in[i], f)) < 0) return oom();
        if ((memo[v] = new_expr(kr, &e)) < 0) return oom();
    }
    /* Rows and phases, in evaluation order. */
    for (int i = 0; i < kr->n_e; i++) {
        kc_expr *e = &kr->e[i];
        int k = kr->ndim;
        if (e->kind == E_LOAD || e->kind == E_INDEX) e->row = k == 0 || e->st[k - 1] == 0;
        else if (e->kind == E_CONST) e->row = true;
        else if (e->kind == E_ACC) {
            kc_acc *a = &kr->acc[e->buf];
            a->phase = kr->e[a->expr].phase;
            e->row = true;
            e->phase = a->phase + 1;
        } else {
            e->row = true;
            for (int j = 0; j < e->n_arg; j++) {
                e->row &= kr->e[e->arg[j]].row;
                if (kr->e[e->arg[j]].phase > e->phase) e->phase = kr->e[e->arg[j]].phase;
            }
        }
    }
    /* Stores: every value another step reads. */
    for (int m = 0; m < n; m++) {
        const node *nd = &g->nd[members[m]];
        int v = nd->out[0];
        if (nd->op == KILN_OP_COPY_ || !stored[v]) continue;
        int64_t cs[KILN_MAX_DIMS];
        kiln__contiguous_strides(g->v[v].meta.ndim, g->v[v].meta.shape, cs);
        kiln_status s = add_store(&c, memo[v], v, cs, form[v]);
        if (s != KILN_OK) return s;
    }
    return KILN_OK;
}

/* The most bytes of intermediates alive at once over steps 1..n_t, each non-view op
 * result v from step born[v] (0: never made) to last[v]; -1 when out of memory. */
static int64_t peak_bytes(const kiln_graph_t *g, const int *born, const int *last, int n_t)
{
    int64_t *delta = calloc((size_t)n_t + 3, sizeof *delta), cur = 0, peak = 0;
    if (!delta) return -1;
    for (int v = 1; v < g->n_v; v++) {
        const value *x = &g->v[v];
        if (!born[v] || x->kind != V_OP || !kiln__graph_live(g, v) || kiln__ops[g->nd[x->index].op].is_view) continue;
        int end = last[v] > born[v] ? last[v] : born[v];
        int64_t bytes = kiln__numel(x->meta.ndim, x->meta.shape) * (int64_t)kiln_dtype_size(x->meta.dtype);
        delta[born[v]] += bytes;
        delta[end + 1] -= bytes;
    }
    for (int t = 0; t <= n_t + 2; t++) {
        cur += delta[t];
        if (cur > peak) peak = cur;
    }
    free(delta);
    return peak;
}

/* Does kernel k read buffer slot bi only where it stores slot bo, element for element
 * (every load of bi with the strides of bo's store), in a kernel without reductions (a
 * row kernel reads a row in several passes)? Then bo may be written over bi. */
static bool reads_only_where_it_writes(const kc_kernel *k, int bi, int bo)
{
    if (k->n_acc) return false;
    const kc_store *st = NULL;
    for (int i = 0; i < k->n_st; i++)
        if (k->st[i].buf == bo) {
            if (st) return false; /* stored twice */
            st = &k->st[i];
        }
    if (!st) return false;
    for (int e = 0; e < k->n_e; e++)
        if (k->e[e].kind == E_LOAD && k->e[e].buf == bi &&
            memcmp(k->e[e].st, st->st, sizeof(int64_t) * (size_t)k->ndim))
            return false;
    return true;
}

/* In-place reuse: an output of an elementwise kernel takes the buffer of an input the
 * kernel reads for the last time, of its dtype and shape, both contiguous, when the
 * input owns its memory (an op's result, not a view) and nothing else reads that memory
 * afterwards (no view of it is read later, and the kernel reads no other view of it).
 * The launch takes the buffer only if no one else holds it then (an argument or a
 * captured tensor that a dispatched op handed back as its result stays untouched).
 * plast gets the liveness the planned peak counts: the input ends a step earlier. */
static kiln_status plan_reuse(kiln__program *p, const kiln_graph_t *g, int *plast)
{
    /* root[v]: the value v's memory is; late[r]: the last step reading a view of r. */
    int *root = calloc(2 * (size_t)g->n_v, sizeof *root), *late = root ? root + g->n_v : NULL;
    if (!root) return oom();
    for (int w = 1; w < g->n_v; w++) {
        root[w] = kiln__graph_root(g, w);
        if (root[w] != w && kiln__graph_live(g, w) && p->last[w] > late[root[w]]) late[root[w]] = p->last[w];
    }
    for (int t = 0; t < p->n_steps; t++) {
        if (p->steps[t].kind != STEP_KERNEL) continue;
        kc_kernel *k = &p->k[p->steps[t].index];
        for (int bo = 0; bo < k->n_buf; bo++) {
            kc_buf *o = &k->buf[bo];
            if (!o->output || o->inplace) continue;
            const kiln__meta *mo = &g->v[o->value].meta;
            int64_t cs[KILN_MAX_DIMS];
            kiln__contiguous_strides(mo->ndim, mo->shape, cs);
            for (int bi = 0; bi < k->n_buf && !o->reuse; bi++) {
                const kc_buf *in = &k->buf[bi];
                int u = in->value;
                const value *x = &g->v[u];
                if (in->output || p->last[u] != t + 1 || late[u] > t + 1 || x->kind != V_OP ||
                    kiln__ops[g->nd[x->index].op].is_view || kiln__ops[g->nd[x->index].op].is_inplace)
                    continue;
                if (x->meta.dtype != mo->dtype || memcmp(in->st, cs, sizeof(int64_t) * (size_t)mo->ndim) ||
                    !kiln__same_shape(x->meta.ndim, x->meta.shape, mo->ndim, mo->shape))
                    continue;
                bool taken = false, other = false;
                for (int b = 0; b < k->n_buf; b++) {
                    taken |= k->buf[b].reuse == u;
                    other |= b != bi && root[k->buf[b].value] == u;
                }
                if (taken || other || !reads_only_where_it_writes(k, bi, bo)) continue;
                o->reuse = u;
                plast[u] = t;
            }
        }
    }
    free(root); /* and late */
    return KILN_OK;
}

/* Dim d of x[KILN_MAX_DIMS] merged into d + 1: its entry the next one's, the rest moving down. */
static void drop_dim(int64_t *x, int d)
{
    memmove(&x[d], &x[d + 1], sizeof(int64_t) * (size_t)(KILN_MAX_DIMS - d - 1));
}

/* Merges adjacent domain dims that every access walks as one (d's stride = the next
 * one's stride times its size); the inner dim merges too when nothing is reduced. */
static void collapse(kc_kernel *k)
{
    for (int d = k->ndim - 2; d >= 0; d--) {
        if (d == k->ndim - 2 && k->n_acc) continue;
        bool ok = true;
        for (int i = 0; i < k->n_e && ok; i++)
            if (k->e[i].kind == E_LOAD || k->e[i].kind == E_INDEX) ok = k->e[i].st[d] == k->e[i].st[d + 1] * k->dom[d + 1];
        for (int i = 0; i < k->n_st && ok; i++) ok = k->st[i].st[d] == k->st[i].st[d + 1] * k->dom[d + 1];
        if (!ok) continue;
        k->dom[d + 1] *= k->dom[d];
        drop_dim(k->dom, d);
        for (int i = 0; i < k->n_e; i++) drop_dim(k->e[i].st, d);
        for (int i = 0; i < k->n_st; i++) drop_dim(k->st[i].st, d);
        k->ndim--;
    }
}

/* Task split: rows of about 16k elements per task; a pointwise kernel whose rows are
 * long splits them into pieces too. */
static void split(kc_kernel *k)
{
    int64_t inner = k->ndim ? k->dom[k->ndim - 1] : 1, outer = 1;
    for (int d = 0; d + 1 < k->ndim; d++) outer *= k->dom[d];
    k->chunks = 1;
    if (!k->n_acc && inner > 32768) k->chunks = (inner + 16383) / 16384;
    k->tasks = outer * k->chunks;
    int64_t per = (inner + k->chunks - 1) / k->chunks;
    k->grain = per >= 16384 ? 1 : 16384 / (per ? per : 1);
}

/* The values of the kernel's size slots (compile_impl.h), which its generated code
 * reads from sz[] or has written in. */
static kiln_status bind_sizes(kc_kernel *k)
{
    int nd = k->ndim;
    k->n_sz = kc_sz_store(k, k->n_st, 0);
    if (!(k->sz = calloc((size_t)k->n_sz, sizeof *k->sz))) return oom();
    int64_t inner = nd ? k->dom[nd - 1] : 1;
    k->sz[KC_SZ_INNER] = inner;
    k->sz[KC_SZ_CHUNKS] = k->chunks;
    k->sz[KC_SZ_PER] = (inner + k->chunks - 1) / k->chunks;
    for (int d = 0; d + 1 < nd; d++) k->sz[KC_SZ_DOM + d] = k->dom[d];
    for (int i = 0; i < k->n_e; i++)
        for (int d = 0; d < nd; d++) k->sz[kc_sz_load(k, i, d)] = k->e[i].st[d];
    for (int i = 0; i < k->n_st; i++)
        for (int d = 0; d < nd; d++) k->sz[kc_sz_store(k, i, d)] = k->st[i].st[d];
    return KILN_OK;
}

/* The open group that copy_ node n (at position k) can join as a store into its
 * destination, or -1. The source must be a value of the group over its whole index
 * space; the destination a whole contiguous captured tensor on be, or a view of an
 * intermediate whose elements are distinct memory, of that shape and dtype, which the
 * group's ops read, if at all, only at the element being written (so that each element
 * is loaded before it is stored over, and no other is). */
static int absorbing_group(const kiln_graph_t *g, const node *n, int k, const group *gr, const int *grp,
                           const int *vgrp, const int *form, int max_fuse, const kiln__backend *be)
{
    int dst = n->in[0], src = n->in[1], G = vgrp[src];
    if (G < 0 || !gr[G].open || gr[G].n_ops >= max_fuse || form[src] != F_FULL) return -1;
    const value *d = &g->v[dst];
    const kiln__meta *sm = &g->v[src].meta;
    /* The destination: a captured tensor (a parameter, optimizer state), or a view of an
     * intermediate (a gradient's slice of a fused projection's), bound with its strides. */
    bool held = d->kind == V_CONST && kiln__is_contiguous(d->t) && d->t->st->be == be;
    /* (its elements all at different addresses: no stride 0 of an expand, strides that
     * nest; the kernel's tasks store to them in parallel) */
    const kiln__meta *dm = &d->meta;
    bool inner = kiln__opt(KILN__OPT_COPY_INTO_VIEWS) && is_view_value(g, dst) &&
                 g->v[kiln__graph_root(g, dst)].kind == V_OP &&
                 (kiln__numel(dm->ndim, dm->shape) < 2 || !kiln__strided_overlap_self(dm->ndim, dm->shape, dm->stride));
    if (!(held || inner) || d->meta.dtype != sm->dtype || !loadable(sm->dtype) || frame_of(&gr[G], &d->meta) != F_FULL ||
        frame_of(&gr[G], sm) != F_FULL)
        return -1;
    for (int q = 0; q < k; q++) {
        if (grp[q] != G) continue;
        const node *m = &g->nd[q];
        for (int i = 0; i < m->n_in; i++) {
            int u = m->in[i];
            if (!may_alias(g, u, dst)) continue;
            bool at_element = u == dst && !(m->op == KILN_OP_COPY_ && i == 0) &&
                              (m->op == KILN_OP_SUM || m->op == KILN_OP_MAX || (m->n_out && form[m->out[0]] == F_FULL));
            if (!at_element) return -1;
        }
    }
    return G;
}

kiln_status kiln__program_build(kiln_graph_t *g, const kc_options *o, kiln__program **out)
{
    *out = NULL;
    int nn = g->n_nd, nv = g->n_v, n_gr = 0, n_pd = 0;
    size_t ni = (size_t)nn + 1;
    kiln__program *p = calloc(1, sizeof *p);
    int *grp = calloc(5 * ni + 6 * (size_t)nv, sizeof *grp);
    bool *stored = calloc(3 * (size_t)nv, sizeof *stored);
    group *gr = malloc(sizeof *gr * ni);
    lower_kind *lk = malloc(sizeof *lk * ni);
    if (!p || !grp || !stored || !gr || !lk) {
        KILN__FREE(grp, stored, gr, lk);
        kiln__program_free(p);
        return oom();
    }
    /* The scratch: per node, its group and the lowering it takes; per group, its kernel;
     * per value, its group, form, expression in the kernel being built (memo), the step
     * that makes it (born) and its last reads as the two peaks count them; whether a step
     * outside its group reads it (stored; outside: one that is not a kernel), and whether
     * an in-place op writes it, through any chain of views (a constant of that kind is not
     * a constant, and its op runs). pd_dst, pd_grp: the copies absorbed into a group that
     * has not launched yet, with that group: an op that may read the destination's memory
     * closes the group first, so that it runs after the store (and never inside the
     * group, before it). */
    int *pd_dst = grp + ni, *pd_grp = pd_dst + ni, *members = pd_grp + ni, *kernel_of = members + ni;
    int *vgrp = kernel_of + ni, *form = vgrp + nv, *memo = form + nv;
    int *born = memo + nv, *plast = born + nv, *elast = plast + nv;
    bool *outside = stored + nv, *mutated = outside + nv;
    p->symbolic = o->symbolic;
    p->be = o->target ? o->target : kiln__backend_at(0);
    for (int v = 0; v < nv; v++) {
        vgrp[v] = -1;
        form[v] = F_NONE;
    }
    kiln__graph_mutated(g, mutated);
    for (int k = 0; k < nn; k++) {
        node *n = &g->nd[k];
        lower_kind l = o->codegen ? lowering(g, n, o->target) : L_NONE;
        if (l == L_GEN && mutated[n->out[0]]) l = L_NONE;
        /* A view made inside a kernel is stored as a buffer of its own: of memory that an
         * in-place op writes later, it must stay a view (an op through dispatch), which
         * sees the write. */
        if (l == L_ALIAS && mutated[kiln__graph_root(g, n->in[0])]) l = L_NONE;
        lk[k] = l;
        grp[k] = -1;
        for (int q = 0; q < n_pd; q++) {
            bool hit = !gr[pd_grp[q]].open;
            bool reads = !kiln__ops[n->op].is_view; /* a view reads no memory; what reads through it does */
            for (int i = 0; i < n->n_in && !hit && reads; i++) hit = may_alias(g, n->in[i], pd_dst[q]);
            if (!hit) continue;
            gr[pd_grp[q]].open = false;
            pd_dst[q] = pd_dst[--n_pd];
            pd_grp[q--] = pd_grp[n_pd];
        }
        int absorb = n->op == KILN_OP_COPY_ && o->codegen && o->fusion
                         ? absorbing_group(g, n, k, gr, grp, vgrp, form, o->max_fuse, p->be) : -1;
        if (kiln__ops[n->op].is_inplace)
            for (int q = 0; q < n_gr; q++)
                if (q != absorb) gr[q].open = false;
        if (absorb >= 0) {
            grp[k] = absorb;
            gr[absorb].last = k;
            gr[absorb].n_ops++;
            pd_dst[n_pd] = n->in[0];
            pd_grp[n_pd++] = absorb;
        }
        if (l == L_PW || l == L_REDUCE || l == L_ALIAS) {
            const kiln__meta *om = &g->v[n->out[0]].meta, *im = &g->v[n->in[0]].meta;
            int chosen = -1, chosen_form = F_NONE;
            /* An operand's open group first, then any open group with this index space. */
            for (int i = 0; o->fusion && chosen < 0 && i < n->n_in; i++) {
                int G = vgrp[n->in[i]];
                if (G >= 0 && (chosen_form = join_form(g, gr, G, n, l, vgrp, form, false, o->max_fuse)) != F_NONE)
                    chosen = G;
            }
            for (int G = n_gr - 1; o->fusion && chosen < 0 && G >= 0; G--)
                if ((chosen_form = join_form(g, gr, G, n, l, vgrp, form, true, o->max_fuse)) != F_NONE) chosen = G;
            /* A new group, unless there is nothing to compute (left to dispatch). */
            const kiln__meta *dm = l == L_REDUCE ? im : om;
            if (chosen < 0 && l != L_ALIAS && !(l == L_REDUCE && !reduces_last(n, im)) &&
                kiln__numel(dm->ndim, dm->shape) > 0) {
                gr[n_gr] = (group){.ndim = dm->ndim, .open = true};
                memcpy(gr[n_gr].dom, dm->shape, sizeof gr[n_gr].dom);
                chosen = n_gr++;
                chosen_form = l == L_REDUCE ? (n->attrs.keepdim ? F_ROWK : F_ROWN) : F_FULL;
            }
            if (chosen >= 0) {
                grp[k] = chosen;
                gr[chosen].last = k;
                gr[chosen].n_ops++;
                vgrp[n->out[0]] = chosen;
                form[n->out[0]] = chosen_form;
            }
        }
        /* Whoever reads a group's value from outside it closes that group and makes the
         * value stored. */
        for (int i = 0; i < n->n_in; i++) {
            int u = n->in[i], G = vgrp[u];
            if (G >= 0 && G != grp[k]) {
                gr[G].open = false;
                stored[u] = true;
            }
            if (grp[k] < 0) outside[u] = true;
        }
    }
    kiln__graph_mark_results(g, stored);
    kiln__graph_mark_results(g, outside);
    /* Kernels, one per group, and the steps in program order. */
    p->k = calloc((size_t)n_gr + 1, sizeof *p->k);
    p->steps = malloc(sizeof *p->steps * ni);
    p->last = calloc((size_t)nv, sizeof *p->last);
    kiln_status s = p->k && p->steps && p->last ? KILN_OK : oom();
    for (int G = 0; s == KILN_OK && G < n_gr; G++) {
        int n = 0;
        for (int k = 0; k <= gr[G].last; k++)
            if (grp[k] == G) members[n++] = k;
        for (int v = 0; v < nv; v++) memo[v] = -1;
        kc_kernel *kr = &p->k[p->n_k];
        s = lower_group(g, &gr[G], members, n, stored, form, memo, mutated, kr);
        if (s != KILN_OK) { /* not yet counted in n_k, so kiln__program_free would miss its arrays */
            KILN__FREE(kr->e, kr->acc, kr->st, kr->buf, kr->sz);
            break;
        }
        collapse(kr);
        split(kr);
        /* Named after its ops: k<n>_ then each op once, in order, while they fit. */
        int w = snprintf(kr->name, sizeof kr->name, "k%d", p->n_k);
        for (int m = 0; m < n && w < (int)sizeof kr->name - 24; m++) {
            const char *opn = kiln__ops[g->nd[members[m]].op].name;
            bool seen = false;
            for (int q = 0; q < m && !seen; q++) seen = g->nd[members[q]].op == g->nd[members[m]].op;
            if (!seen) w += snprintf(kr->name + w, sizeof kr->name - (size_t)w, "_%s", opn);
        }
        kernel_of[G] = p->n_k++;
        s = bind_sizes(kr);
    }
    for (int k = 0; s == KILN_OK && k < nn; k++) {
        if (grp[k] >= 0) {
            if (gr[grp[k]].last == k) p->steps[p->n_steps++] = (kc_step){STEP_KERNEL, kernel_of[grp[k]], 0, 0};
            continue;
        }
        /* A constant or index that only kernels read is computed inside them. */
        if (lk[k] == L_GEN && !outside[g->nd[k].out[0]]) continue;
        p->steps[p->n_steps++] = (kc_step){STEP_OP, k, 0, 0};
    }
    if (s == KILN_OK && o->overlap) {
        p->g = g;
        s = kiln__program_overlap(p, &p->n_hoisted);
        for (int t = 0; t < p->n_steps; t++) p->n_overlapped += p->steps[t].until > 0;
    }
    if (s == KILN_OK && o->epilogue) {
        p->g = g;
        kiln__program_epilogues(p);
    }
    /* Liveness: the last step that reads each value, and the planned peak of
     * intermediates (each stored value from its step to its last read) against eager's
     * (every op result, including the ones fusion keeps in registers). */
    for (int t = 0; s == KILN_OK && t < p->n_steps; t++) {
        const kc_step *st = &p->steps[t];
        if (st->kind == STEP_OP) {
            const node *n = &g->nd[st->index];
            for (int i = 0; i < n->n_in; i++) p->last[n->in[i]] = t + 1;
            for (int j = 0; j < n->n_out; j++) born[n->out[j]] = t + 1;
        } else {
            const kc_kernel *kr = &p->k[st->index];
            for (int b = 0; b < kr->n_buf; b++) {
                if (kr->buf[b].inplace) p->last[kr->buf[b].value] = t + 1; /* made by an earlier step */
                else if (kr->buf[b].output) born[kr->buf[b].value] = t + 1;
                else p->last[kr->buf[b].value] = t + 1;
            }
        }
    }
    for (int j = 0; s == KILN_OK && j < g->n_outs; j++) p->last[g->outs[j]] = p->n_steps + 1;
    for (int j = 0; s == KILN_OK && j < g->n_lg; j++)
        if (!g->lg[j].dropped) p->last[g->lg[j].value] = p->n_steps + 1;
    if (s == KILN_OK) {
        memcpy(plast, p->last, sizeof *plast * (size_t)nv);
        if (o->reuse) s = plan_reuse(p, g, plast);
    }
    if (s == KILN_OK && (p->planned_peak = peak_bytes(g, born, plast, p->n_steps)) < 0) s = oom();
    /* Eager: every op result lives from its op to its last read. */
    if (s == KILN_OK) {
        kiln__graph_last_use(g, elast);
        for (int v = 1; v < nv; v++) born[v] = g->v[v].kind == V_OP && kiln__graph_live(g, v) ? g->v[v].index + 1 : 0;
        if ((p->eager_peak = peak_bytes(g, born, elast, nn)) < 0) s = oom();
    }
    KILN__FREE(grp, stored, gr, lk);
    if (s != KILN_OK) {
        kiln__program_free(p);
        return s;
    }
    p->g = g;
    *out = p;
    return KILN_OK;
}

void kiln__program_free(kiln__program *p)
{
    if (!p) return;
    if (p->prof && p->prof_runs > 1) kiln__program_profile_print(p, stderr);
    free(p->prof);
    for (int i = 0; p->dsz && i < p->n_k; i++) /* before p->k, whose sizes they were */
        if (p->dsz[i]) kiln__be_free(p->be, p->dsz[i], KC_SZ_BYTES(&p->k[i]));
    free(p->dsz);
    for (int i = 0; p->k && i < p->n_k; i++) KILN__FREE(p->k[i].e, p->k[i].acc, p->k[i].st, p->k[i].buf, p->k[i].sz);
    KILN__FREE(p->k, p->steps, p->last);
    if (p->so) {
        extern void kiln__jit_unload(void *so);
        kiln__jit_unload(p->so);
    }
    for (int i = 0; p->kern && i < p->n_k; i++)
        kiln__be_kernel_free(p->be, p->kern[i]);
    free(p->kern);
    free(p);
}
