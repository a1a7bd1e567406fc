/* The graph IR and capture (kiln/graph.h). A graph is a list of op calls in program
 * order over numbered values; a value is an argument of the captured function, a real
 * tensor it used (captured by reference), or an output of an earlier op. Capture hooks
 * the one dispatch point (src/core/dispatch.c): in capture mode an op is inferred as
 * usual, then recorded here instead of launched, and its outputs are meta tensors
 * (storage without data) that carry their value number. A run replays the calls through
 * dispatch, so views, in-place updates and every kernel behave exactly as in eager
 * code. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "autograd/autograd.h"
#include "core/intercept.h"
#include "core/rng.h"
#include "core/tensor_impl.h"
#include "core/util.h"
#include "kiln/graph.h"
#include "kiln/ops.h"
#include "ops/registry.h"

#include "graph/graph_impl.h"

static _Thread_local kiln_graph_t *capturing;

/* The value a captured (meta) tensor stands for, kept in the tensor's extension slot
 * for the graph; a detached alias keeps it (autograd saves aliases of outputs). */
static int value_slot = -1;

static int graph_value(const kiln_tensor_t *t) { return (int)(intptr_t)kiln__ext(t, value_slot); }

KILN__REGISTER(register_graph_slot) { value_slot = kiln__ext_register("graph value", NULL, true); }

/* What a capture of g on this thread holds: its interceptor and autograd's leaf sink. */
typedef struct {
    kiln_graph_t *g;
    kiln__interceptor ic;
    kiln__leaf_sink sink;
    const kiln__leaf_sink *sink_was;
} capture_frame;

static int add_value(kiln_graph_t *g, int kind, int index, int out, const kiln__meta *m, kiln_tensor_t *t)
{
    void *tmp;
    if (!KILN__GROW(g->v, g->n_v, &g->cap_v, 64, tmp)) return -1;
    g->v[g->n_v] = (value){kind, index, out, *m, t, NULL};
    return g->n_v++;
}

/* A new graph, its value 0 (unused) made; NULL when out of memory, the error naming who. */
static kiln_graph_t *graph_new(const char *who)
{
    kiln_graph_t *g = calloc(1, sizeof *g);
    kiln__meta none = {0};
    if (g && add_value(g, V_ARG, -1, 0, &none, NULL) == 0) return g;
    free(g);
    return kiln__err(KILN_ERR_OOM, "%s: out of memory", who), NULL;
}

/* A tensor header with no data, shaped by m, standing for value num. */
static kiln_tensor_t *meta_tensor(kiln__backend *be, kiln__storage *share, size_t nbytes, const kiln__meta *m, bool view,
                                  int num)
{
    kiln__storage *st = share;
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st) return kiln__err(KILN_ERR_OOM, "graph capture: out of memory"), NULL;
        atomic_init(&st->refcount, 1);
        st->be = be;
        st->meta = true;
        st->nbytes = nbytes;
    }
    int64_t stride[KILN_MAX_DIMS];
    if (view) memcpy(stride, m->stride, sizeof stride);
    else kiln__contiguous_strides(m->ndim, m->shape, stride);
    kiln_tensor_t *t = kiln__tensor_alias(st, m->dtype, m->ndim, m->shape, stride, view ? m->offset : 0);
    if (!share) kiln__storage_release(st); /* the header holds it now */
    if (t) t->ext[value_slot] = (void *)(intptr_t)num;
    return t;
}

/* Argument `index` of the captured function, shaped by m (contiguous): a new value and
 * the meta tensor that stands for it in *t. */
static kiln_status add_arg(kiln_graph_t *g, int index, const kiln__meta *m, kiln__backend *be, kiln_tensor_t **t)
{
    int num = add_value(g, V_ARG, index, 0, m, NULL);
    if (num < 0) return kiln__err(KILN_ERR_OOM, "graph capture: out of memory");
    g->v[num].be = be;
    /* The elements the strides reach (all of them when contiguous). */
    int64_t extent = kiln__numel(m->ndim, m->shape) ? 1 : 0;
    bool contiguous = true;
    int64_t cs[KILN_MAX_DIMS];
    kiln__contiguous_strides(m->ndim, m->shape, cs);
    for (int d = 0; d < m->ndim; d++) {
        if (m->shape[d] > 0) extent += (m->shape[d] - 1) * m->stride[d];
        contiguous &= m->shape[d] == 1 || m->stride[d] == cs[d];
    }
    size_t nb = (size_t)extent * kiln_dtype_size(m->dtype);
    *t = meta_tensor(be, NULL, nb, m, !contiguous, num);
    return *t ? KILN_OK : kiln_last_status();
}

/* The value number of an op's input: its own if it is being captured, else the real
 * tensor is captured by reference (once). */
static int value_of(kiln_graph_t *g, kiln_tensor_t *t)
{
    if (t->st->meta) return graph_value(t);
    for (int i = 1; i < g->n_v; i++)
        if (g->v[i].kind == V_CONST && g->v[i].t == t) return i;
    kiln__meta m;
    kiln__meta_of(t, &m);
    int num = add_value(g, V_CONST, 0, 0, &m, t);
    if (num >= 0) kiln_tensor_retain(t);
    return num;
}

static kiln_status graph_record(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                               const kiln__meta *meta, kiln__backend *be, kiln_tensor_t **out)
{
    kiln_graph_t *g = capturing;
    const kiln__op_def *d = &kiln__ops[op];
    for (int i = 0; i < n_in; i++)
        if (in[i]->st->meta && (graph_value(in[i]) <= 0 || graph_value(in[i]) >= g->n_v))
            return kiln__err(KILN_ERR_ARG, "%s: input %d belongs to another graph's capture", d->name, i);
    void *tmp;
    if (!KILN__GROW(g->nd, g->n_nd, &g->cap_nd, 64, tmp)) return kiln__err(KILN_ERR_OOM, "graph capture: out of memory");
    node *n = &g->nd[g->n_nd];
    *n = (node){.op = op, .attrs = *a, .n_in = n_in, .n_out = d->n_out};
    n->in = malloc(sizeof(int) * (size_t)(n_in ? n_in : 1));
    if (!n->in) return kiln__err(KILN_ERR_OOM, "graph capture: out of memory");
    for (int i = 0; i < n_in; i++)
        if ((n->in[i] = value_of(g, in[i])) < 0) {
            free(n->in);
            return kiln__err(KILN_ERR_OOM, "graph capture: out of memory");
        }
    kiln_tensor_t *outs[KILN__MAX_OUT] = {0};
    for (int j = 0; j < d->n_out; j++) {
        int num = add_value(g, V_OP, g->n_nd, j, &meta[j], NULL);
        kiln__storage *share = d->is_view && in[0]->st->meta ? in[0]->st : NULL;
        size_t nbytes = d->is_view ? in[0]->st->nbytes
                                   : (size_t)kiln__numel(meta[j].ndim, meta[j].shape) * kiln_dtype_size(meta[j].dtype);
        if (num < 0 || !(outs[j] = meta_tensor(be, share, nbytes, &meta[j], d->is_view, num))) {
            for (int k = 0; k < j; k++) kiln_tensor_free(outs[k]);
            free(n->in);
            return num < 0 ? kiln__err(KILN_ERR_OOM, "graph capture: out of memory") : kiln_last_status();
        }
        n->out[j] = num;
    }
    g->n_nd++;
    for (int j = 0; j < d->n_out; j++) out[j] = outs[j];
    return KILN_OK;
}

/* The first error of a hook that cannot return one; kiln_graph_capture reports it. */
__attribute__((format(printf, 3, 4))) static void fail_later(kiln_graph_t *g, kiln_status code, const char *fmt, ...)
{
    if (g->failed) return;
    g->failed = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->failed_msg, sizeof g->failed_msg, fmt, ap);
    va_end(ap);
}

static leaf_grad *find_leaf(kiln_graph_t *g, const kiln_tensor_t *leaf)
{
    for (int i = 0; i < g->n_lg; i++)
        if (g->lg[i].leaf == leaf) return &g->lg[i];
    return NULL;
}

/* leaf's entry, made (dropped, value 0) if it has none; NULL when out of memory. */
static leaf_grad *leaf_entry(kiln_graph_t *g, kiln_tensor_t *leaf)
{
    leaf_grad *e = find_leaf(g, leaf);
    if (e) return e;
    void *tmp;
    if (!KILN__GROW(g->lg, g->n_lg, &g->cap_lg, 16, tmp)) return NULL;
    e = &g->lg[g->n_lg++];
    *e = (leaf_grad){kiln_tensor_retain(leaf), 0, NULL, false, true, false};
    return e;
}

static kiln_status sink_accumulate(void *ctx, kiln_tensor_t *leaf, kiln_tensor_t *g)
{
    kiln_graph_t *gr = ctx;
    leaf_grad *e = leaf_entry(gr, leaf);
    if (!e) return kiln__err(KILN_ERR_OOM, "graph capture: out of memory");
    e->dropped = false;
    /* As eager backward sums them: the first part, then each next one added (a run
     * gives the leaf a tensor of its own, add_leaf_grads). */
    kiln_tensor_t *sum = e->acc ? kiln_add(e->acc, g) : kiln__scoped(kiln_tensor_retain(g));
    if (!sum) return kiln_last_status();
    kiln_tensor_free(e->acc);
    e->acc = kiln_keep(sum);
    e->value = graph_value(sum);
    return KILN_OK;
}

static kiln_tensor_t *sink_grad_of(void *ctx, const kiln_tensor_t *leaf)
{
    kiln_graph_t *g = ctx;
    leaf_grad *e = find_leaf(g, leaf);
    /* Until the function zeroes it, a leaf's gradient at run time is whatever it holds
     * when the run starts plus what the graph adds; the graph cannot follow the former
     * (a gradient tensor is replaced between calls), so it must be empty. */
    bool old_counts = !e || !e->clear;
    if (old_counts && kiln__autograd_grad(leaf)) {
        char b[96];
        fail_later(g, KILN_ERR_UNSUPPORTED, "graph capture: the function reads the gradient of a parameter %s that "
                   "already held one when the capture began; a graph cannot follow a gradient that is replaced between "
                   "calls: zero the gradients before calling it (kiln_optim_zero_grad)",
                   kiln__shape_str(leaf, b, sizeof b));
        return NULL;
    }
    if (!e && !(e = leaf_entry(g, (kiln_tensor_t *)leaf))) {
        fail_later(g, KILN_ERR_OOM, "graph capture: out of memory");
        return NULL;
    }
    /* Read (even before any backward made it): the leaf must hold no gradient when a run
     * starts, or the graph would not see it. */
    if (old_counts) e->read = true;
    return e->acc;
}

static void sink_zero_grad(void *ctx, kiln_tensor_t *leaf)
{
    kiln_graph_t *g = ctx;
    leaf_grad *e = leaf_entry(g, leaf);
    if (!e) {
        fail_later(g, KILN_ERR_OOM, "graph capture: out of memory");
        return;
    }
    kiln_tensor_free(e->acc);
    e->acc = NULL;
    e->value = 0;
    e->dropped = e->clear = true;
}

bool kiln_graph_capturing(void) { return capturing != NULL; }

/* A suspension pauses every interceptor of this thread (the graph capture and the
 * replay recording, both); they nest, up to 32 deep (deeper, nothing more is paused: no
 * caller comes close). */
void *kiln_graph_suspend(void) { return kiln__intercept_suspend(); }

void kiln_graph_resume(void *token) { kiln__intercept_resume(token); }

/* A read or write of a tensor that is being captured: there is no data to give, and the
 * graph could not replay a value read now; the error names the op that made it. */
static kiln_status capture_data_access(void *ctx, const kiln_tensor_t *t, const char *what)
{
    kiln_graph_t *g = ((capture_frame *)ctx)->g;
    if (!t->st->meta) return KILN_OK;
    const char *op = "an argument of the captured function";
    int v = graph_value(t);
    if (v > 0 && v < g->n_v && g->v[v].kind == V_OP) op = kiln__ops[g->nd[g->v[v].index].op].name;
    return kiln__err(KILN_ERR_UNSUPPORTED, "%s: a data-dependent read during graph capture, of the result of %s: a "
                     "captured tensor has no value yet, and a graph cannot replay a decision taken on one; move the read "
                     "out of the captured function (capture the part before it and the part after it as two graphs)",
                     what, op);
}

/* Capture as dispatch sees it: every call is recorded here instead of run. */
static kiln_status capture_take(void *ctx, kiln__call_info *c, bool *taken)
{
    *taken = true;
    return graph_record(c->op, c->in, c->n_in, c->a, c->meta, c->be, c->out);
}

static void capture_suspend(void *ctx)
{
    capturing = NULL;
    kiln__autograd_set_leaf_sink(NULL);
}

static void capture_resume(void *ctx)
{
    capture_frame *f = ctx;
    capturing = f->g;
    kiln__autograd_set_leaf_sink(&f->sink);
}

static kiln_status capture_begin(capture_frame *f, kiln_graph_t *g)
{
    f->g = g;
    f->ic = (kiln__interceptor){.name = "capture", .order = KILN__ORDER_CAPTURE, .traces = true, .records = true,
                                .take = capture_take, .data_access = capture_data_access,
                                .suspend = capture_suspend, .resume = capture_resume, .ctx = f};
    f->sink = (kiln__leaf_sink){.grad_of = sink_grad_of, .zero_grad = sink_zero_grad, .accumulate = sink_accumulate,
                                .ctx = g};
    kiln_status s = kiln__intercept_push(&f->ic);
    if (s != KILN_OK) return s;
    capturing = g;
    f->sink_was = kiln__autograd_set_leaf_sink(&f->sink);
    return KILN_OK;
}

static kiln_status capture_end(capture_frame *f, kiln_status s)
{
    kiln__autograd_set_leaf_sink(f->sink_was);
    capturing = NULL;
    return kiln__intercept_end(&f->ic, s, "graph_capture", "capture");
}

void kiln_graph_free(kiln_graph_t *g)
{
    if (!g) return;
    for (int i = 1; i < g->n_v; i++)
        if (g->v[i].kind == V_CONST) kiln_tensor_free(g->v[i].t);
    for (int i = 0; i < g->n_lg; i++) {
        kiln_tensor_free(g->lg[i].leaf);
        kiln_tensor_free(g->lg[i].acc);
    }
    for (int i = 0; i < g->n_nd; i++) free(g->nd[i].in);
    KILN__FREE(g->lg, g->v, g->nd, g);
}

kiln_status kiln_graph_capture(kiln_graph_fn fn, void *ctx, kiln_tensor_t *const *example, int n_in, kiln_graph_t **out)
{
    return kiln__graph_capture_as(fn, ctx, example, n_in, false, out);
}

kiln_status kiln__graph_capture_as(kiln_graph_fn fn, void *ctx, kiln_tensor_t *const *example, int n_in, bool strided,
                                   kiln_graph_t **out)
{
    if (!out) return kiln__err(KILN_ERR_ARG, "graph_capture: out is NULL");
    *out = NULL;
    if (!fn || n_in < 0 || (n_in && !example)) return kiln__err(KILN_ERR_ARG, "graph_capture: needs a function and its examples");
    if (capturing) return kiln__err(KILN_ERR_ARG, "graph_capture: a capture is already running on this thread");
    for (int i = 0; i < n_in; i++)
        if (!example[i]) return kiln__null_arg("graph_capture");
    kiln__ensure_init();
    kiln_graph_t *g = graph_new("graph_capture");
    if (!g) return kiln_last_status();
    kiln_tensor_t **args = calloc((size_t)(n_in ? n_in : 1), sizeof *args);
    kiln_status s = args ? KILN_OK : kiln__err(KILN_ERR_OOM, "graph_capture: out of memory");
    for (int i = 0; s == KILN_OK && i < n_in; i++) {
        kiln__meta m;
        kiln__meta_of(example[i], &m);
        if (!strided) kiln__contiguous_strides(m.ndim, m.shape, m.stride);
        m.offset = 0;
        s = add_arg(g, i, &m, example[i]->st->be, &args[i]);
    }
    g->n_args = n_in;
    if (s == KILN_OK) {
        kiln_tensor_t *res[KILN_GRAPH_MAX_OUT] = {0};
        int n_out = 0;
        capture_frame cf;
        bool began = (s = capture_begin(&cf, g)) == KILN_OK;
        kiln_scope_begin();
        if (s == KILN_OK) s = fn(ctx, args, n_in, res, &n_out);
        if (s == KILN_OK && (n_out < 0 || n_out > KILN_GRAPH_MAX_OUT))
            s = kiln__err(KILN_ERR_ARG, "graph_capture: the function gave %d outputs (0..%d)", n_out, KILN_GRAPH_MAX_OUT);
        for (int j = 0; s == KILN_OK && j < n_out; j++) {
            if (!res[j]) s = kiln__err(KILN_ERR_ARG, "graph_capture: output %d is NULL", j);
            else if ((g->outs[j] = value_of(g, res[j])) < 0) s = kiln__err(KILN_ERR_OOM, "graph_capture: out of memory");
        }
        if (s == KILN_OK && g->failed) s = kiln__err(g->failed, "%s", g->failed_msg);
        g->n_outs = s == KILN_OK ? n_out : 0;
        for (int i = 0; i < g->n_lg; i++) { /* the meta sums are done with */
            kiln_tensor_free(g->lg[i].acc);
            g->lg[i].acc = NULL;
        }
        kiln_scope_end();
        if (began) s = capture_end(&cf, s);
    }
    for (int i = 0; args && i < n_in; i++) kiln_tensor_free(args[i]);
    free(args);
    if (s == KILN_OK) *out = g;
    else kiln_graph_free(g);
    return s;
}

int kiln_graph_num_ops(const kiln_graph_t *g) { return g ? g->n_nd : 0; }

/* Checks in[0..n_in) against the graph's arguments (count, dtype, shape). */
static kiln_status check_inputs(const kiln_graph_t *g, kiln_tensor_t *const *in, int n_in, int max_out)
{
    if (capturing) return kiln__err(KILN_ERR_ARG, "graph_run: not inside a capture (run it after kiln_graph_capture)");
    if (n_in != g->n_args) return kiln__err(KILN_ERR_ARG, "graph_run: %d inputs given, the graph takes %d", n_in, g->n_args);
    if (max_out < g->n_outs) return kiln__err(KILN_ERR_ARG, "graph_run: room for %d outputs, the graph gives %d", max_out, g->n_outs);
    for (int i = 0; i < n_in; i++) {
        if (!in[i]) return kiln__null_arg("graph_run");
        const kiln__meta *m = &g->v[i + 1].meta;
        if (m->dtype != in[i]->dtype || m->ndim != in[i]->ndim ||
            memcmp(m->shape, in[i]->shape, sizeof(int64_t) * (size_t)m->ndim)) {
            char got[96], want[96];
            return kiln__err(KILN_ERR_SHAPE, "graph_run: input %d is %s, the graph was captured for %s", i,
                             kiln__shape_str(in[i], got, sizeof got), kiln__meta_str(m, want, sizeof want));
        }
    }
    /* The passes take arguments and captured tensors for separate memory where the graph
     * writes one of them in place (it may reorder and merge reads around the write). */
    bool shared = false; /* the usual case is none: then nothing more to look at */
    for (int i = 0; i < n_in && !shared; i++)
        for (int c = 1; c < g->n_v && !shared; c++) shared = g->v[c].kind == V_CONST && g->v[c].t->st == in[i]->st;
    bool *mut = shared ? calloc((size_t)g->n_v, sizeof *mut) : NULL;
    if (shared && !mut) return kiln__err(KILN_ERR_OOM, "graph_run: out of memory");
    if (shared) kiln__graph_mutated(g, mut);
    for (int i = 0; shared && i < n_in; i++)
        for (int c = 1; c < g->n_v; c++)
            if (g->v[c].kind == V_CONST && (mut[c] || mut[i + 1]) && kiln__tensors_overlap(in[i], g->v[c].t)) {
                const char *which = mut[c] ? "the captured tensor" : "the input";
                free(mut);
                return kiln__err(KILN_ERR_ARG, "graph_run: input %d shares memory with captured tensor %%%d, and the graph "
                                 "updates %s in place; pass a copy of it", i, c, which);
            }
    free(mut);
    for (int j = 0; j < g->n_lg; j++)
        if (g->lg[j].read && kiln__autograd_grad(g->lg[j].leaf)) {
            char b[96];
            return kiln__err(KILN_ERR_ARG, "graph_run: the graph reads the gradient of a parameter %s that holds one "
                             "from before the call; zero the gradients first (kiln_optim_zero_grad)",
                             kiln__shape_str(g->lg[j].leaf, b, sizeof b));
        }
    return KILN_OK;
}

/* Gradients into the real leaves (rt[value] each), as kiln_backward leaves them: a fresh
 * copy, or added to what a leaf already holds; a leaf without a gradient may take
 * rt[value] itself (then set to NULL). */
static kiln_status add_leaf_grads(const kiln_graph_t *g, kiln_tensor_t **rt)
{
    kiln_status s = KILN_OK;
    for (int j = 0; s == KILN_OK && j < g->n_lg; j++) {
        int v = g->lg[j].value;
        kiln_tensor_t *leaf = g->lg[j].leaf, *gv = rt[v];
        if (g->lg[j].clear) kiln__autograd_set_grad(leaf, NULL);
        if (g->lg[j].dropped) continue;
        kiln_tensor_t *held = kiln__autograd_grad(leaf);
        if (held) {
            s = kiln_add_(held, gv, 1.0);
            continue;
        }
        /* An intermediate that nothing else holds (not returned, not another leaf's,
         * no view of it alive) becomes the gradient itself; anything else is copied. */
        bool own = g->v[v].kind == V_OP && atomic_load(&gv->refcount) == 1 && atomic_load(&gv->st->refcount) == 1 &&
                   kiln__is_contiguous(gv) && gv->offset == 0;
        for (int k = 0; own && k < g->n_outs; k++) own = g->outs[k] != v;
        for (int k = 0; own && k < g->n_lg; k++) own = k == j || g->lg[k].value != v;
        if (own) {
            rt[v] = NULL;
            s = kiln__autograd_set_grad(leaf, gv);
        } else {
            kiln_tensor_t *c = kiln_clone(gv);
            s = c ? kiln__autograd_set_grad(leaf, kiln_keep(c)) : kiln_last_status();
        }
    }
    return s;
}

bool kiln__graph_random(const node *n) { return n->op == KILN_OP_RAND || (n->op == KILN_OP_DROPOUT && n->attrs.op.dropout.p > 0); }

/* Random ops take their counters from the generator when the graph runs, in program
 * order, as many as the eager calls would (capture took none: src/ops/api.c), so that
 * every run draws new numbers and a run draws what the function run eagerly from the
 * same generator state would have. */
static void draw_random(const kiln_graph_t *g)
{
    for (int k = 0; k < g->n_nd; k++) {
        node *n = &g->nd[k];
        if (!kiln__graph_random(n)) continue;
        const kiln__meta *m = &g->v[n->op == KILN_OP_RAND ? n->out[0] : n->in[0]].meta;
        n->attrs.u[1] = kiln__rng_take((uint64_t)kiln__numel(m->ndim, m->shape), &n->attrs.u[0]);
    }
}

kiln_status kiln__graph_frame_begin(const kiln_graph_t *g, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out,
                                    int max_out, int *n_out, kiln__graph_frame *f)
{
    memset(f, 0, sizeof *f);
    if (!g || !n_out || (max_out > 0 && !out)) return kiln__err(KILN_ERR_ARG, "graph_run: NULL graph or outputs");
    kiln_status s = check_inputs(g, in, n_in, max_out);
    if (s != KILN_OK) return s;
    if (!(f->rt = calloc((size_t)g->n_v, sizeof *f->rt))) return kiln__err(KILN_ERR_OOM, "graph_run: out of memory");
    draw_random(g);
    for (int i = 1; i < g->n_v; i++)
        if (g->v[i].kind == V_ARG) f->rt[i] = kiln_tensor_retain(in[g->v[i].index]);
        else if (g->v[i].kind == V_CONST) f->rt[i] = kiln_tensor_retain(g->v[i].t);
    f->grad_was = kiln_set_grad_enabled(false);
    return KILN_OK;
}

void kiln__graph_release(const kiln_graph_t *g, kiln__graph_frame *f, int v, const int *last, int now)
{
    if (last[v] == now && g->v[v].kind == V_OP) {
        kiln_tensor_free(f->rt[v]);
        f->rt[v] = NULL;
    }
}

/* Node n's input tensors from vals[], in stack (64 entries) or, for more, in a new
 * array (free it when it is not stack); NULL when out of memory. */
static kiln_tensor_t **gather(const node *n, kiln_tensor_t *const *vals, kiln_tensor_t **stack)
{
    kiln_tensor_t **ins = n->n_in > 64 ? malloc(sizeof *ins * (size_t)n->n_in) : stack;
    if (!ins) return kiln__err(KILN_ERR_OOM, "graph: out of memory"), NULL;
    for (int i = 0; i < n->n_in; i++) ins[i] = vals[n->in[i]];
    return ins;
}

kiln_status kiln__graph_run_node(const kiln_graph_t *g, int k, kiln__graph_frame *f, const int *last, int now)
{
    const node *n = &g->nd[k];
    kiln_tensor_t *ins[64], **insp = gather(n, f->rt, ins);
    if (!insp) return kiln_last_status();
    kiln_tensor_t *res[KILN__MAX_OUT] = {0};
    kiln_status s = kiln__dispatch(n->op, n->n_in ? insp : NULL, n->n_in, &n->attrs, n->n_out ? res : NULL);
    if (insp != ins) free(insp);
    if (s != KILN_OK) return s;
    for (int j = 0; j < n->n_out; j++) {
        if (last[n->out[j]] == 0) kiln_tensor_free(res[j]); /* a hidden output nothing reads */
        else f->rt[n->out[j]] = res[j];
    }
    for (int i = 0; i < n->n_in; i++) kiln__graph_release(g, f, n->in[i], last, now);
    return KILN_OK;
}

kiln_status kiln__graph_frame_end(const kiln_graph_t *g, kiln__graph_frame *f, kiln_status s, kiln_tensor_t **out,
                                  int *n_out)
{
    if (s == KILN_OK) s = add_leaf_grads(g, f->rt);
    kiln_set_grad_enabled(f->grad_was);
    for (int j = 0; s == KILN_OK && j < g->n_outs; j++) out[j] = kiln__scoped(kiln_tensor_retain(f->rt[g->outs[j]]));
    *n_out = s == KILN_OK ? g->n_outs : 0;
    for (int i = 0; i < g->n_v; i++) kiln_tensor_free(f->rt[i]);
    free(f->rt);
    f->rt = NULL;
    return s;
}

void kiln__graph_last_use(const kiln_graph_t *g, int *last)
{
    for (int k = 0; k < g->n_nd; k++)
        for (int i = 0; i < g->nd[k].n_in; i++) last[g->nd[k].in[i]] = k + 1;
    for (int j = 0; j < g->n_outs; j++) last[g->outs[j]] = g->n_nd + 1;
    for (int j = 0; j < g->n_lg; j++)
        if (!g->lg[j].dropped) last[g->lg[j].value] = g->n_nd + 1;
}

kiln_status kiln_graph_run(kiln_graph_t *g, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int max_out,
                           int *n_out)
{
    kiln__graph_frame f;
    kiln_status s = kiln__graph_frame_begin(g, in, n_in, out, max_out, n_out, &f);
    if (s != KILN_OK) return s;
    /* Each value is freed after its last use; outputs are kept. */
    int *last = calloc((size_t)g->n_v, sizeof *last);
    if (!last) s = kiln__err(KILN_ERR_OOM, "graph_run: out of memory");
    else kiln__graph_last_use(g, last);
    for (int k = 0; s == KILN_OK && k < g->n_nd; k++) s = kiln__graph_run_node(g, k, &f, last, k + 1);
    free(last);
    return kiln__graph_frame_end(g, &f, s, out, n_out);
}

/* res[v]: value v is what a run gives back: an output, or a leaf's gradient. */
void kiln__graph_mark_results(const kiln_graph_t *g, bool *res)
{
    for (int j = 0; j < g->n_outs; j++) res[g->outs[j]] = true;
    for (int j = 0; j < g->n_lg; j++)
        if (!g->lg[j].dropped) res[g->lg[j].value] = true;
}

/* mut[v]: value v is updated in place, or, back through views, aliased by one that is. */
void kiln__graph_mutated(const kiln_graph_t *g, bool *mut)
{
    for (int k = g->n_nd - 1; k >= 0; k--) {
        const node *n = &g->nd[k];
        const kiln__op_def *d = &kiln__ops[n->op];
        for (int i = 0; i < n->n_in && i < 4; i++)
            if (kiln__written_inputs(n->op) >> i & 1) mut[n->in[i]] = true;
        if (d->is_view && n->n_in && mut[n->out[0]]) mut[n->in[0]] = true;
    }
}

bool kiln__graph_live(const kiln_graph_t *g, int v)
{
    const value *x = &g->v[v];
    if (x->kind != V_OP) return true;
    if (x->index < 0 || x->index >= g->n_nd) return false;
    const node *n = &g->nd[x->index];
    for (int j = 0; j < n->n_out; j++)
        if (n->out[j] == v) return true;
    return false;
}

int kiln__graph_root(const kiln_graph_t *g, int v)
{
    for (;;) {
        const value *x = &g->v[v];
        if (x->kind != V_OP || !kiln__graph_live(g, v)) return v;
        const node *n = &g->nd[x->index];
        if (!kiln__ops[n->op].is_view || !n->n_in) return v;
        v = n->in[0];
    }
}

void kiln__graph_reindex(kiln_graph_t *g, int from, int to)
{
    for (int k = from; k < to; k++)
        for (int j = 0; j < g->nd[k].n_out; j++) g->v[g->nd[k].out[j]].index = k;
}

int kiln__graph_drop(kiln_graph_t *g, const bool *drop)
{
    int w = 0, n = g->n_nd;
    for (int k = 0; k < n; k++) {
        if (!drop[k]) g->nd[w++] = g->nd[k];
        else free(g->nd[k].in);
    }
    g->n_nd = w;
    kiln__graph_reindex(g, 0, w);
    return n - w;
}

/* Inserts node copy at position at (the nodes from there move up one). */
kiln_status kiln__graph_insert_node(kiln_graph_t *g, int at, const node *n, int *out_value)
{
    void *tmp;
    if (!KILN__GROW(g->nd, g->n_nd, &g->cap_nd, 64, tmp)) return kiln__err(KILN_ERR_OOM, "graph_recompute: out of memory");
    node c = *n;
    kiln__meta m = g->v[n->out[0]].meta; /* add_value may move g->v */
    c.in = malloc(sizeof(int) * (size_t)(n->n_in ? n->n_in : 1));
    int v = c.in ? add_value(g, V_OP, at, 0, &m, NULL) : -1;
    if (v < 0) {
        free(c.in);
        return kiln__err(KILN_ERR_OOM, "graph_recompute: out of memory");
    }
    memcpy(c.in, n->in, sizeof(int) * (size_t)n->n_in);
    c.out[0] = v;
    memmove(&g->nd[at + 1], &g->nd[at], sizeof *g->nd * (size_t)(g->n_nd - at));
    g->nd[at] = c;
    g->n_nd++;
    kiln__graph_reindex(g, at, g->n_nd);
    *out_value = v;
    return KILN_OK;
}

kiln_status kiln_graph_print(const kiln_graph_t *g, FILE *f)
{
    if (!g || !f) return kiln__err(KILN_ERR_ARG, "graph_print: NULL graph or file");
    char b[96];
    for (int i = 1; i < g->n_v; i++) {
        const value *v = &g->v[i];
        if (v->kind == V_OP) continue;
        if (v->kind == V_ARG) fprintf(f, "%%%d = input %d %s\n", i, v->index, kiln__meta_str(&v->meta, b, sizeof b));
        else fprintf(f, "%%%d = captured %s\n", i, kiln__meta_str(&v->meta, b, sizeof b));
    }
    for (int k = 0; k < g->n_nd; k++) {
        const node *n = &g->nd[k];
        for (int j = 0; j < n->n_out; j++) fprintf(f, "%s%%%d", j ? ", " : "", n->out[j]);
        fprintf(f, "%s%s(", n->n_out ? " = " : "", kiln__ops[n->op].name);
        for (int i = 0; i < n->n_in; i++) fprintf(f, "%s%%%d", i ? ", " : "", n->in[i]);
        fprintf(f, ")");
        for (int j = 0; j < n->n_out; j++) fprintf(f, " %s", kiln__meta_str(&g->v[n->out[j]].meta, b, sizeof b));
        fprintf(f, "\n");
    }
    for (int j = 0; j < g->n_lg; j++) {
        int num = 0;
        for (int i = 1; i < g->n_v && !num; i++)
            if (g->v[i].kind == V_CONST && g->v[i].t == g->lg[j].leaf) num = i;
        const leaf_grad *e = &g->lg[j];
        char who[32] = "a captured leaf";
        if (num) snprintf(who, sizeof who, "%%%d", num);
        if (e->clear) fprintf(f, "grad(%s) = none\n", who);
        if (!e->dropped) fprintf(f, "grad(%s) += %%%d\n", who, e->value);
    }
    fprintf(f, "return");
    for (int j = 0; j < g->n_outs; j++) fprintf(f, "%s %%%d", j ? "," : "", g->outs[j]);
    fprintf(f, "\n");
    return KILN_OK;
}

kiln_status kiln__graph_rewrite(kiln_graph_t *g, const char *who, kiln__graph_rule rule, void *ctx, int *count)
{
    if (!g) return kiln__err(KILN_ERR_ARG, "%s: NULL graph", who);
    if (capturing) return kiln__err(KILN_ERR_ARG, "%s: a capture is running on this thread", who);
    kiln_graph_t *ng = graph_new(who);
    if (!ng) return kiln_last_status();
    kiln_tensor_t **map = calloc((size_t)g->n_v, sizeof *map);
    kiln_status s = map ? KILN_OK : kiln__err(KILN_ERR_OOM, "%s: out of memory", who);
    kiln__backend *be = kiln__backend_default();
    for (int i = 1; s == KILN_OK && i < g->n_v; i++) {
        const value *v = &g->v[i];
        if (v->kind == V_CONST) map[i] = v->t;
        if (v->kind != V_ARG) continue;
        s = add_arg(ng, v->index, &v->meta, v->be ? v->be : be, &map[i]);
    }
    ng->n_args = g->n_args;
    int n_rules = 0;
    capture_frame cf;
    if (s == KILN_OK) s = capture_begin(&cf, ng);
    bool began = s == KILN_OK;
    bool prev = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    for (int k = 0; s == KILN_OK && k < g->n_nd;) {
        const node *n = &g->nd[k];
        kiln_tensor_t *stack[64], **ins = gather(n, map, stack);
        if (!ins) {
            s = kiln_last_status();
            break;
        }
        int used = 0;
        s = rule(g, k, ins, map, ctx, &used);
        n_rules += s == KILN_OK && used > 0;
        if (s == KILN_OK && used == 0) {
            kiln_tensor_t *res[KILN__MAX_OUT] = {0};
            s = kiln__dispatch(n->op, n->n_in ? ins : NULL, n->n_in, &n->attrs, n->n_out ? res : NULL);
            for (int j = 0; s == KILN_OK && j < n->n_out; j++) map[n->out[j]] = res[j];
            used = 1;
        }
        if (ins != stack) free(ins);
        k += used;
    }
    for (int j = 0; s == KILN_OK && j < g->n_outs; j++)
        if ((ng->outs[j] = value_of(ng, map[g->outs[j]])) < 0) s = kiln__err(KILN_ERR_OOM, "%s: out of memory", who);
    ng->n_outs = s == KILN_OK ? g->n_outs : 0;
    if (s == KILN_OK && g->n_lg) {
        ng->lg = calloc((size_t)g->n_lg, sizeof *ng->lg);
        if (!ng->lg) s = kiln__err(KILN_ERR_OOM, "%s: out of memory", who);
        for (int j = 0; s == KILN_OK && j < g->n_lg; j++) {
            ng->lg[j] = g->lg[j];
            ng->lg[j].leaf = kiln_tensor_retain(g->lg[j].leaf);
            ng->lg[j].value = g->lg[j].dropped ? 0 : value_of(ng, map[g->lg[j].value]);
            ng->n_lg = ng->cap_lg = j + 1;
            if (ng->lg[j].value < 0) s = kiln__err(KILN_ERR_OOM, "%s: out of memory", who);
        }
    }
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    if (began) s = capture_end(&cf, s);
    for (int i = 1; map && i < g->n_v; i++)
        if (g->v[i].kind != V_CONST) kiln_tensor_free(map[i]);
    free(map);
    if (s != KILN_OK) {
        kiln_graph_free(ng);
        return s;
    }
    kiln_graph_t tmp = *g;
    *g = *ng;
    *ng = tmp;
    kiln_graph_free(ng);
    if (count) *count = n_rules;
    return KILN_OK;
}
