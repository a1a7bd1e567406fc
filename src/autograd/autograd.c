/* Reverse-mode autograd: recording nodes at dispatch, and the backward engine. */
#include <stdlib.h>
#include <string.h>
#include "kiln/ops.h"
#include "autograd/autograd.h"
#include "core/intercept.h"
#include "core/opts.h"
#include "core/tensor_impl.h"
#include "core/util.h"
#include "ops/autocast.h"

/* Autograd's state on a tensor (its extension slot), made when the tensor first takes
 * part: set to require a gradient, or made by a recorded op. */
typedef struct {
    bool requires_grad;     /* a leaf that wants a gradient */
    kiln_tensor_t *grad;    /* accumulated gradient of a leaf */
    kiln__node *grad_fn;    /* the op that made a non-leaf, or NULL */
    int out_index;          /* which output of grad_fn this is */
    int grad_pending;       /* during backward: edges still to bring this leaf gradient */
} ag_state;

static int ag_slot = -1;

static ag_state *ag(const kiln_tensor_t *t) { return kiln__ext(t, ag_slot); }

/* t's state, made when missing (NULL when out of memory, with the error set). */
static ag_state *ag_make(kiln_tensor_t *t)
{
    if (ag_slot < 0) return kiln__err(KILN_ERR_INTERNAL, "autograd: no extension slot was left for it"), NULL;
    ag_state *s = ag(t);
    if (!s && !(s = t->ext[ag_slot] = calloc(1, sizeof *s))) kiln__err(KILN_ERR_OOM, "autograd: out of memory");
    return s;
}

bool kiln__tracks(const kiln_tensor_t *t)
{
    const ag_state *s = t ? ag(t) : NULL;
    return s && (s->requires_grad || s->grad_fn);
}

/* Drops a node's saved tensors and gradient buffers, keeping its edges. */
static void node_clear(kiln__node *n)
{
    for (int i = 0; i < n->n_in; i++) {
        kiln_tensor_free(n->saved_in[i]);
        n->saved_in[i] = NULL;
    }
    for (int j = 0; j < n->n_out; j++) {
        kiln_tensor_free(n->saved_out[j]);
        kiln_tensor_free(n->grad_out[j]);
        n->saved_out[j] = n->grad_out[j] = NULL;
    }
}

/* Iterative, so that freeing a deep graph cannot overflow the stack. */
static void node_release(kiln__node *root)
{
    /* Nodes whose last reference went are linked through their own release_next, so that
     * freeing a graph needs no memory of its own (it runs when memory has run out too). */
    kiln__node *list = NULL;
    if (root && atomic_fetch_sub(&root->refcount, 1) == 1) root->release_next = NULL, list = root;
    while (list) {
        kiln__node *cur = list;
        list = cur->release_next;
        for (int i = 0; i < cur->n_in; i++) {
            kiln__node *in = cur->next[i];
            if (in && atomic_fetch_sub(&in->refcount, 1) == 1) in->release_next = list, list = in;
            kiln_tensor_free(cur->leaf[i]);
        }
        node_clear(cur);
        free(cur); /* and its per-input arrays, in the same block */
    }
}

static kiln__node *record(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                          kiln_tensor_t **out, int n_out)
{
    const kiln__op_def *d = &kiln__ops[op];
    /* The node and its per-input arrays in one block, the most aligned first. */
    size_t k = n_in > 0 ? (size_t)n_in : 1;
    kiln__node *n = calloc(1, sizeof *n + k * (sizeof *n->in_meta + sizeof *n->saved_in + sizeof *n->next +
                                               sizeof *n->leaf + sizeof *n->next_out + sizeof *n->needs_grad));
    if (!n) return kiln__err(KILN_ERR_OOM, "%s: out of memory recording for autograd", d->name), NULL;
    n->in_meta = (kiln__meta *)(n + 1);
    n->saved_in = (kiln_tensor_t **)(n->in_meta + k);
    n->next = (kiln__node **)(n->saved_in + k);
    n->leaf = (kiln_tensor_t **)(n->next + k);
    n->next_out = (int *)(n->leaf + k);
    n->needs_grad = (bool *)(n->next_out + k);
    atomic_init(&n->refcount, 0);
    n->op = op;
    n->attrs = *a;
    n->n_in = n_in;
    n->n_out = n_out;
    for (int i = 0; i < n_in; i++) {
        kiln__meta_of(in[i], &n->in_meta[i]);
        n->needs_grad[i] = kiln__tracks(in[i]);
        const ag_state *st = ag(in[i]);
        if (st && st->grad_fn) {
            n->next[i] = st->grad_fn;
            atomic_fetch_add(&n->next[i]->refcount, 1);
            n->next_out[i] = st->out_index;
        } else if (st && st->requires_grad) {
            n->leaf[i] = kiln_tensor_retain(in[i]);
        }
        if (d->save & KILN__SI(i)) n->saved_in[i] = kiln__tensor_detach(in[i]);
    }
    for (int j = 0; j < n_out; j++) {
        kiln__meta_of(out[j], &n->out_meta[j]);
        if (d->save & KILN__SO(j)) n->saved_out[j] = kiln__tensor_detach(out[j]);
    }
    /* What backward needs must all be there, and every visible output's state made,
     * before an output points at the node: running out of memory leaves none pointing
     * at a half-made one. */
    bool saved = true;
    for (int i = 0; i < n_in; i++) saved &= !(d->save & KILN__SI(i)) || n->saved_in[i];
    for (int j = 0; j < n_out; j++) saved &= !(d->save & KILN__SO(j)) || n->saved_out[j];
    if (!saved) kiln__err(KILN_ERR_OOM, "%s: out of memory saving tensors for autograd", d->name);
    ag_state *os[KILN__MAX_OUT] = {0};
    for (int j = 0; j < d->n_visible; j++)
        if (!saved || !(os[j] = ag_make(out[j]))) {
            atomic_fetch_add(&n->refcount, 1);
            node_release(n);
            return NULL;
        }
    for (int j = 0; j < d->n_visible; j++) {
        os[j]->grad_fn = n;
        os[j]->out_index = j;
        atomic_fetch_add(&n->refcount, 1);
    }
    return n;
}

static _Thread_local const kiln__leaf_sink *sink;

const kiln__leaf_sink *kiln__autograd_set_leaf_sink(const kiln__leaf_sink *s)
{
    const kiln__leaf_sink *was = sink;
    sink = s;
    return was;
}

kiln_tensor_t *kiln__autograd_grad(const kiln_tensor_t *t)
{
    const ag_state *s = t ? ag(t) : NULL;
    return s ? s->grad : NULL;
}

kiln_status kiln__autograd_set_grad(kiln_tensor_t *t, kiln_tensor_t *g)
{
    ag_state *s = ag(t);
    if (!s && !g) return KILN_OK;
    if (!s && !(s = ag_make(t))) {
        kiln_tensor_free(g);
        return kiln_last_status();
    }
    kiln_tensor_free(s->grad);
    s->grad = g;
    return KILN_OK;
}

void kiln_tensor_set_requires_grad(kiln_tensor_t *t, bool on)
{
    if (!t || (ag(t) && ag(t)->grad_fn) || (!on && !ag(t))) return;
    ag_state *s = ag_make(t);
    if (s) s->requires_grad = on;
}

bool kiln_tensor_requires_grad(const kiln_tensor_t *t) { return kiln__tracks(t); }
kiln_tensor_t *kiln_tensor_grad(const kiln_tensor_t *t)
{
    if (t && sink && !t->st->meta) return sink->grad_of(sink->ctx, t);
    return kiln__autograd_grad(t);
}

void kiln_tensor_zero_grad(kiln_tensor_t *t)
{
    if (t && sink && !t->st->meta) sink->zero_grad(sink->ctx, t);
    else if (t) kiln__autograd_set_grad(t, NULL);
}

static _Thread_local kiln_grad_ready_fn ready_fn;
static _Thread_local void *ready_ctx;

void kiln_set_grad_ready_hook(kiln_grad_ready_fn fn, void *ctx)
{
    ready_fn = fn;
    ready_ctx = ctx;
}

/* g, a gradient for a leaf, is one of the node's gradients `alone` when no other input
 * of the node gets the same tensor (which another node would then hold, and read after
 * the leaf's gradient had grown in place). */
static kiln_status accumulate_leaf(kiln_tensor_t *leaf, kiln_tensor_t *g, bool alone)
{
    /* Backward inside a capture: the gradient of a real leaf is a value of the graph,
     * added to the leaf's gradient on each run, not now. */
    if (sink && !leaf->st->meta) return sink->accumulate(sink->ctx, leaf, g);
    kiln_tensor_t *held = kiln__autograd_grad(leaf);
    if (held) return kiln_add_(held, g, 1.0);
    /* g itself where nothing else can see it (as PyTorch steals a gradient it alone
     * holds): dense memory of kiln's own that no other tensor shares, every reference
     * to it in this node's scope (so not another node's gradient, nor a formula's input
     * handed back), and no other input of the node given it */
    if (alone && kiln__opt(KILN__OPT_STEAL_GRAD) && atomic_load(&g->st->refcount) == 1 && !g->st->meta &&
        !g->st->release && !g->st->wrapped && g->offset == 0 && kiln__is_contiguous(g) &&
        kiln_tensor_nbytes(g) == g->st->nbytes && kiln__scope_take_all(g))
        return kiln__autograd_set_grad(leaf, g);
    /* Else a fresh copy: g may be shared with another gradient or be a broadcast view. */
    kiln_tensor_t *c = kiln_clone(g);
    return c ? kiln__autograd_set_grad(leaf, kiln_keep(c)) : kiln_last_status();
}

static kiln_status accumulate(kiln_tensor_t **slot, kiln_tensor_t *g)
{
    if (!*slot) {
        *slot = kiln_tensor_retain(g); /* the scope keeps its own reference */
        return KILN_OK;
    }
    kiln_tensor_t *sum = kiln_add(*slot, g);
    if (!sum) return kiln_last_status();
    kiln_tensor_free(*slot);
    *slot = kiln_keep(sum);
    return KILN_OK;
}

static kiln_status check_grad(kiln__node *n, int i, kiln_tensor_t *g)
{
    const kiln__meta *m = &n->in_meta[i];
    bool ok = g->ndim == m->ndim;
    for (int d = 0; ok && d < m->ndim; d++) ok = g->shape[d] == m->shape[d];
    if (ok) return KILN_OK;
    char a[96], b[96];
    return kiln__err(KILN_ERR_INTERNAL, "%s backward: gradient of input %d is %s, the input is %s",
                     kiln__ops[n->op].name, i, kiln__shape_str(g, a, sizeof a), kiln__meta_str(m, b, sizeof b));
}

/* The nodes top's gradient reaches (top first) into *out, each with `pending` the edges
 * in this graph that reach it. */
static kiln_status collect(kiln__node *top, kiln__node ***out, int *count)
{
    int n = 0;
    size_t cap = 0;
    kiln__node **all = NULL;
    void *tmp;
    kiln_status s = KILN__GROW(all, n, &cap, 256, tmp) ? KILN_OK : kiln__err(KILN_ERR_OOM, "backward: out of memory");
    if (s == KILN_OK) all[n++] = top;
    top->visited = true;
    top->pending = 0;
    for (int k = 0; s == KILN_OK && k < n; k++) {
        kiln__node *cur = all[k];
        for (int i = 0; s == KILN_OK && i < cur->n_in; i++) {
            kiln__node *nx = cur->next[i];
            if (!nx || !cur->needs_grad[i]) continue;
            if (!nx->visited && nx->spent)
                s = kiln__err(KILN_ERR_AUTOGRAD, "backward: part of this graph (%s) was freed by an earlier backward; "
                              "run the forward pass again", kiln__ops[nx->op].name);
            else if (!nx->visited && !KILN__GROW(all, n, &cap, 256, tmp))
                s = kiln__err(KILN_ERR_OOM, "backward: out of memory");
            else if (!nx->visited) {
                nx->visited = true;
                nx->pending = 0;
                all[n++] = nx;
            }
            nx->pending++;
        }
    }
    top->visited = false;
    for (int k = 0; k < n; k++) all[k]->visited = false;
    if (s != KILN_OK) free(all);
    *out = s == KILN_OK ? all : NULL;
    *count = n;
    return s;
}

/* Runs node cur's backward formula and hands each input's gradient on, into a leaf or
 * to the node that made the input; each producer whose last consumer this was joins
 * ready[*tail]. */
static kiln_status run_node(kiln__node *cur, kiln__node **ready, int *tail)
{
    bool any = false;
    for (int j = 0; j < cur->n_out; j++) any |= cur->grad_out[j] != NULL;
    size_t k = (size_t)(cur->n_in > 0 ? cur->n_in : 1);
    kiln_tensor_t **gin = calloc(k, sizeof *gin);
    /* The edges counted by collect: a backward formula may clear needs_grad[i] for an
     * index input, and its producer must still be released below. */
    bool *counted = malloc(k * sizeof *counted);
    if (!gin || !counted) {
        free(gin);
        free(counted);
        return kiln__err(KILN_ERR_OOM, "backward: out of memory");
    }
    memcpy(counted, cur->needs_grad, sizeof *counted * (size_t)cur->n_in);
    kiln_status s = KILN_OK;
    kiln_scope_begin();
    if (any) {
        /* Tensors a formula makes (zeros to scatter into, scalars) go to the device of
         * the gradient it is given. */
        kiln_tensor_t *g0 = NULL;
        for (int j = 0; j < KILN__MAX_OUT && !g0; j++) g0 = cur->grad_out[j];
        kiln__backend *was = g0 && !g0->st->meta ? kiln__backend_here(g0->st->be) : NULL;
        s = kiln__backward_of(cur->op)(cur, cur->grad_out, gin);
        if (g0 && !g0->st->meta) kiln__backend_here(was);
    }
    for (int i = 0; s == KILN_OK && i < cur->n_in; i++) {
        if (!gin[i] || !cur->needs_grad[i]) continue;
        s = check_grad(cur, i, gin[i]);
        if (s == KILN_OK && cur->leaf[i]) {
            bool alone = true;
            for (int j = 0; j < cur->n_in; j++) alone &= j == i || gin[j] != gin[i];
            s = accumulate_leaf(cur->leaf[i], gin[i], alone);
            if (s == KILN_OK && ready_fn && --ag(cur->leaf[i])->grad_pending == 0) s = ready_fn(ready_ctx, cur->leaf[i]);
        } else if (s == KILN_OK && cur->next[i]) {
            s = accumulate(&cur->next[i]->grad_out[cur->next_out[i]], gin[i]);
        }
    }
    kiln_scope_end();
    free(gin);
    for (int j = 0; j < cur->n_out; j++) {
        kiln_tensor_free(cur->grad_out[j]);
        cur->grad_out[j] = NULL;
    }
    for (int i = 0; i < cur->n_in; i++)
        if (cur->next[i] && counted[i] && --cur->next[i]->pending == 0) ready[(*tail)++] = cur->next[i];
    free(counted);
    return s;
}

static kiln_status run_backward(kiln_tensor_t *root, kiln_tensor_t *seed)
{
    kiln__node *top = ag(root)->grad_fn, **all;
    if (top->spent)
        return kiln__err(KILN_ERR_AUTOGRAD, "backward: this graph was already run backward and freed; run the forward "
                         "pass again");
    int n, head = 0, tail = 0;
    kiln_status s = collect(top, &all, &n);
    if (s != KILN_OK) return s;
    /* Each leaf's edges in this graph, so that the hook hears when its gradient is whole. */
    for (int pass = 0; ready_fn && pass < 2; pass++)
        for (int k = 0; k < n; k++)
            for (int i = 0; i < all[k]->n_in; i++)
                if (all[k]->leaf[i] && all[k]->needs_grad[i]) {
                    ag_state *a = ag(all[k]->leaf[i]);
                    a->grad_pending = pass ? a->grad_pending + 1 : 0;
                }
    bool prev = kiln_set_grad_enabled(false);
    top->grad_out[ag(root)->out_index] = kiln_tensor_retain(seed);
    /* Kahn's order: a node runs once every consumer has handed it its gradient. */
    kiln__node **ready = malloc((size_t)n * sizeof *ready);
    if (!ready) s = kiln__err(KILN_ERR_OOM, "backward: out of memory");
    else ready[tail++] = top;
    while (s == KILN_OK && head < tail) s = run_node(ready[head++], ready, &tail);
    kiln_set_grad_enabled(prev);
    /* The graph is spent: free what it saved (a second backward is an error). */
    for (int k = 0; k < n; k++) {
        node_clear(all[k]);
        all[k]->spent = true;
    }
    free(ready);
    free(all);
    return s;
}

static kiln_status backward_with(kiln_tensor_t *root, kiln_tensor_t *grad)
{
    char a[96], b[96];
    if (root->ndim != grad->ndim || memcmp(root->shape, grad->shape, sizeof(int64_t) * (size_t)root->ndim))
        return kiln__err(KILN_ERR_SHAPE, "backward: gradient %s does not match the root %s", kiln__shape_str(grad, a, sizeof a),
                         kiln__shape_str(root, b, sizeof b));
    if (!ag(root) || !ag(root)->grad_fn) {
        if (!kiln__tracks(root))
            return kiln__err(KILN_ERR_AUTOGRAD, "backward: the root %s does not require grad (no tracked input made it)",
                             kiln__shape_str(root, a, sizeof a));
        bool prev = kiln_set_grad_enabled(false);
        kiln_scope_begin();
        kiln_status s = accumulate_leaf(root, grad, false); /* the caller's tensor: copied */
        kiln_scope_end();
        kiln_set_grad_enabled(prev);
        return s;
    }
    return run_backward(root, grad);
}

/* Backward runs in the types forward chose: autocast is paused (as PyTorch's is). */
kiln_status kiln_backward_with(kiln_tensor_t *root, kiln_tensor_t *grad)
{
    if (!root || !grad) return kiln__null_arg("backward");
    bool ac = kiln__autocast_pause();
    kiln_status s = backward_with(root, grad);
    kiln__autocast_resume(ac);
    return s;
}

kiln_status kiln_backward(kiln_tensor_t *root)
{
    if (!root) return kiln__null_arg("backward");
    if (kiln_tensor_numel(root) != 1) {
        char a[96];
        return kiln__err(KILN_ERR_SHAPE, "backward: the root %s has more than one element; use kiln_backward_with",
                         kiln__shape_str(root, a, sizeof a));
    }
    bool prev = kiln_set_grad_enabled(false);
    kiln_tensor_t *one = kiln_full_like(root, 1.0, root->dtype); /* on the root's device */
    kiln_set_grad_enabled(prev);
    if (!one) return kiln_last_status();
    kiln_keep(one);
    kiln_status s = kiln_backward_with(root, one);
    kiln_tensor_free(one);
    return s;
}

/* Autograd as dispatch sees it: an in-place update of a tracked tensor is refused, and
 * a call with a tracked input is recorded once it ran (or was captured). */
static kiln_status ag_before(void *ctx, const kiln__call_info *c)
{
    if (kiln__ops[c->op].is_inplace && kiln_grad_enabled() && kiln__tracks(c->in[0]))
        return kiln__err(KILN_ERR_AUTOGRAD, "%s: the destination is tracked by autograd; update it with grad mode off",
                         kiln__ops[c->op].name);
    return KILN_OK;
}

static kiln_status ag_after(void *ctx, const kiln__call_info *c)
{
    if (!kiln__backward_of(c->op) || !kiln_grad_enabled()) return KILN_OK;
    bool any = false;
    for (int i = 0; i < c->n_in; i++) any |= kiln__tracks(c->in[i]);
    if (any && !record(c->op, c->in, c->n_in, c->a, c->out, c->n_out)) return kiln_last_status();
    return KILN_OK;
}

static void ag_release(void *v)
{
    ag_state *s = v;
    kiln_tensor_free(s->grad);
    if (s->grad_fn) node_release(s->grad_fn);
    free(s);
}

static const kiln__interceptor ag_interceptor = {
    .name = "autograd", .order = KILN__ORDER_AUTOGRAD, .before = ag_before, .after = ag_after,
};

KILN__REGISTER(register_autograd)
{
    ag_slot = kiln__ext_register("autograd", ag_release, false);
    kiln__intercept_register(&ag_interceptor);
}
