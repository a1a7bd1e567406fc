/* The graph passes (kiln/graph.h): dead-code and common-subexpression elimination,
 * constant folding, saved-or-recomputed activations, decomposition, coalescing of
 * allreduces, sinking of views and hoisting of siblings. Each works on the graph IR of
 * graph.c in place; the ones that record ops in another form go through its rewrite
 * (kiln__graph_rewrite), which replays the graph in capture mode. docs/compile.md says
 * what each does to a training step. */
#include <stdlib.h>
#include <string.h>
#include "core/tensor_impl.h"
#include "core/util.h"
#include "kiln/graph.h"
#include "kiln/ops.h"
#include "ops/registry.h"

#include "graph/graph_impl.h"

kiln_status kiln_graph_dce(kiln_graph_t *g, int *removed)
{
    if (!g) return kiln__err(KILN_ERR_ARG, "graph_dce: NULL graph");
    bool *used = calloc((size_t)g->n_v + (size_t)g->n_nd + 1, sizeof *used);
    if (!used) return kiln__err(KILN_ERR_OOM, "graph_dce: out of memory");
    bool *drop = used + g->n_v;
    kiln__graph_mark_results(g, used);
    for (int k = g->n_nd - 1; k >= 0; k--) {
        node *n = &g->nd[k];
        /* A random op whose results nothing reads still takes its counters, as the eager
         * call did, so that the draws after it stay eager's. */
        bool live = kiln__ops[n->op].is_inplace || kiln__graph_random(n->op, &n->attrs);
        for (int j = 0; j < n->n_out; j++) live |= used[n->out[j]];
        drop[k] = !live;
        if (live)
            for (int i = 0; i < n->n_in; i++) used[n->in[i]] = true;
    }
    /* Values keep their numbers; each op output is re-pointed at its node's new place. */
    int dropped = kiln__graph_drop(g, drop);
    free(used);
    if (removed) *removed = dropped;
    return KILN_OK;
}

/* Common-subexpression elimination: an op with the same attributes on the same values
 * as an earlier one gives the earlier one's results, unless an in-place op between
 * them wrote the memory one of those values lives in (directly or through a view).
 * Memory is tracked per op result, per captured storage (captured tensors on one
 * storage are one memory) and for the arguments as one memory (a run refuses an
 * argument that shares memory with a captured tensor either side writes, in
 * graph.c's check_inputs). In-place and random ops are never merged (random ones
 * already differ in their counters). Candidates are found through a hash of (op,
 * attributes, inputs). */
static uint64_t node_hash(const node *n)
{
    uint64_t h = 1469598103934665603ULL;
    const unsigned char *a = (const unsigned char *)&n->attrs;
    for (size_t i = 0; i < sizeof n->attrs; i++) h = (h ^ a[i]) * 1099511628211ULL;
    h = (h ^ (uint64_t)n->op) * 1099511628211ULL;
    for (int i = 0; i < n->n_in; i++) h = (h ^ (uint64_t)(uint32_t)n->in[i]) * 1099511628211ULL;
    return h;
}

kiln_status kiln_graph_cse(kiln_graph_t *g, int *removed)
{
    if (!g) return kiln__err(KILN_ERR_ARG, "graph_cse: NULL graph");
    int nb = 64, nv = g->n_v;
    while (nb < 2 * g->n_nd) nb *= 2;
    int *repl = malloc(sizeof(int) * (3 * (size_t)nv + (size_t)nb));
    bool *drop = calloc((size_t)g->n_nd + 1, sizeof *drop);
    if (!repl || !drop) {
        KILN__FREE(repl, drop);
        return kiln__err(KILN_ERR_OOM, "graph_cse: out of memory");
    }
    /* repl[v]: the value v now is; mem[v]: the memory value v lives in, named by a value
     * number (0: the arguments); wrote[m]: 1 + the kept op that last wrote memory m, 0 if
     * none did; slot: the kept ops by hash. */
    int *mem = repl + nv, *wrote = mem + nv, *slot = wrote + nv;
    for (int i = 0; i < nv; i++) {
        repl[i] = i;
        wrote[i] = 0;
        mem[i] = g->v[i].kind == V_ARG ? 0 : i;
        for (int j = 1; j < i && g->v[i].kind == V_CONST; j++)
            if (g->v[j].kind == V_CONST && g->v[j].t->st == g->v[i].t->st) {
                mem[i] = j;
                break;
            }
    }
    for (int b = 0; b < nb; b++) slot[b] = -1;
    for (int k = 0; k < g->n_nd; k++) {
        node *n = &g->nd[k];
        for (int i = 0; i < n->n_in; i++) n->in[i] = repl[n->in[i]];
        const kiln__op_def *d = &kiln__ops[n->op];
        int same = -1;
        uint64_t h = node_hash(n);
        if (!d->is_inplace && !kiln__graph_random(n->op, &n->attrs)) { /* two draws are two draws */
            int since = 0; /* the merge target must come after the last write to its inputs */
            for (int i = 0; i < n->n_in; i++) {
                int t = wrote[mem[n->in[i]]];
                if (t > since) since = t;
            }
            for (int b = (int)(h & (uint64_t)(nb - 1)); slot[b] >= 0 && same < 0; b = (b + 1) & (nb - 1)) {
                const node *o = &g->nd[slot[b]];
                bool ok = slot[b] >= since && o->op == n->op && o->n_in == n->n_in &&
                          !memcmp(&o->attrs, &n->attrs, sizeof n->attrs) &&
                          !memcmp(o->in, n->in, sizeof(int) * (size_t)n->n_in);
                /* ... and its results must not have been written since it made them */
                for (int j = 0; ok && j < o->n_out; j++) ok = wrote[mem[o->out[j]]] <= slot[b];
                if (ok) same = slot[b];
            }
        }
        if (same >= 0) {
            for (int j = 0; j < n->n_out; j++) repl[n->out[j]] = g->nd[same].out[j];
            drop[k] = true;
        } else if (d->is_inplace) {
            for (int i = 0; i < n->n_in && i < 4; i++)
                if (kiln__written_inputs(n->op) >> i & 1) wrote[mem[n->in[i]]] = k + 1;
        } else {
            for (int j = 0; j < n->n_out; j++) mem[n->out[j]] = d->is_view && n->n_in ? mem[n->in[0]] : n->out[j];
            int b = (int)(h & (uint64_t)(nb - 1));
            while (slot[b] >= 0) b = (b + 1) & (nb - 1);
            slot[b] = k;
        }
    }
    for (int j = 0; j < g->n_outs; j++) g->outs[j] = repl[g->outs[j]];
    for (int j = 0; j < g->n_lg; j++) g->lg[j].value = repl[g->lg[j].value];
    int dropped = kiln__graph_drop(g, drop);
    KILN__FREE(repl, drop);
    if (removed) *removed = dropped;
    return KILN_OK;
}

/* Constant folding: an op all of whose inputs are constants of the graph (results of
 * full/arange, or of ops folded before) is computed now, through the same kernels a run
 * would use, and its small results (<= KILN__FOLD_MAX elements: a large constant is
 * cheaper as the inline value a kernel computes than as memory it reads) become
 * captured tensors. Captured tensors are not constants (a run sees their contents at
 * that time); random and in-place ops never fold, nor does a value that an in-place op
 * updates, directly or through a view. The ops that made only folded values are left to
 * dead-code elimination. */
#define KILN__FOLD_MAX 4096

/* Is v read after position k, and only by ops that a generated kernel never takes in
 * (not an elementwise op, a reduction, or a view, which such ops then read through)? */
static bool read_by_backend_kernels_only(const kiln_graph_t *g, int v, int k)
{
    bool read = false;
    for (int q = k + 1; q < g->n_nd; q++) {
        const node *n = &g->nd[q];
        for (int i = 0; i < n->n_in; i++) {
            if (n->in[i] != v) continue;
            if (kiln__graph_elementwise(n->op) || n->op == KILN_OP_SUM || n->op == KILN_OP_MAX ||
                kiln__ops[n->op].is_view)
                return false;
            read = true;
        }
    }
    return read;
}

kiln_status kiln_graph_fold(kiln_graph_t *g, int *folded)
{
    if (!g) return kiln__err(KILN_ERR_ARG, "graph_fold: NULL graph");
    if (kiln_graph_capturing()) return kiln__err(KILN_ERR_ARG, "graph_fold: a capture is running on this thread");
    size_t nv = (size_t)g->n_v;
    bool *cst = calloc(3 * nv + (size_t)g->n_nd + 1, sizeof *cst);
    if (!cst) return kiln__err(KILN_ERR_OOM, "graph_fold: out of memory");
    bool *mut = cst + nv, *res_of = mut + nv, *drop = res_of + nv;
    kiln__graph_mutated(g, mut);
    kiln__graph_mark_results(g, res_of); /* a graph's result is a new tensor every run */
    bool prev = kiln_set_grad_enabled(false);
    for (int k = 0; k < g->n_nd; k++) {
        node *n = &g->nd[k];
        const kiln__op_def *d = &kiln__ops[n->op];
        if (d->is_inplace || n->op == KILN_OP_RAND || n->op == KILN_OP_DROPOUT) continue;
        bool source = n->n_in == 0, all = true;
        for (int i = 0; i < n->n_in && all; i++) all = cst[n->in[i]];
        for (int j = 0; j < n->n_out && all; j++) all = !mut[n->out[j]];
        if (!all) continue;
        /* full, arange: constants, kept as the ops they are where a generated kernel may
         * take them in as inline values; one that only backend kernels read (the seed
         * gradient of a loss, read by cross_entropy_backward) is folded into a captured
         * tensor, so that no run spends a step filling it. */
        if (source && (res_of[n->out[0]] || !read_by_backend_kernels_only(g, n->out[0], k))) {
            for (int j = 0; j < n->n_out; j++) cst[n->out[j]] = true;
            continue;
        }
        bool small = true;
        for (int j = 0; j < n->n_out && small; j++) {
            const kiln__meta *m = &g->v[n->out[j]].meta;
            small = kiln__numel(m->ndim, m->shape) <= KILN__FOLD_MAX;
        }
        if (!small) continue;
        /* Evaluate: the inputs' tensors, made by running the ops that give them. */
        kiln_tensor_t *ins[64], *res[KILN__MAX_OUT] = {0};
        if (n->n_in > 64) continue;
        bool ok = true;
        kiln_scope_begin();
        for (int i = 0; i < n->n_in && ok; i++) {
            const value *v = &g->v[n->in[i]];
            if (v->kind == V_CONST) ins[i] = v->t;
            else { /* a source op's result: run it */
                const node *src = &g->nd[v->index];
                kiln_tensor_t *r[KILN__MAX_OUT] = {0};
                ok = kiln__dispatch(src->op, NULL, 0, &src->attrs, r) == KILN_OK;
                ins[i] = ok ? kiln__scoped(r[v->out]) : NULL;
                for (int j = 0; ok && j < src->n_out; j++)
                    if (j != v->out) kiln_tensor_free(r[j]);
            }
        }
        ok = ok && kiln__dispatch(n->op, n->n_in ? ins : NULL, n->n_in, &n->attrs, res) == KILN_OK;
        kiln_scope_end();
        if (!ok) { /* an op that fails on its constants fails in every run: leave it to say so */
            for (int j = 0; j < n->n_out; j++) kiln_tensor_free(res[j]);
            kiln_clear_error();
            continue;
        }
        for (int j = 0; j < n->n_out; j++) {
            value *v = &g->v[n->out[j]];
            v->kind = V_CONST;
            v->index = 0;
            v->out = 0;
            v->t = res[j];
            kiln__meta_of(res[j], &v->meta);
            cst[n->out[j]] = true;
        }
        drop[k] = true; /* it computes nothing now */
    }
    kiln_set_grad_enabled(prev);
    int count = kiln__graph_drop(g, drop);
    free(cst);
    if (folded) *folded = count;
    return KILN_OK;
}

/* Saved or recomputed: a pointwise result read early (forward) and again much later
 * (backward) is not kept alive between the two; the late reads get a copy computed
 * again, just before the first of them, from values that are alive there anyway (the
 * graph's arguments and constants, values read at or after that point), itself rebuilt
 * the same way through up to RC_DEPTH pointwise producers (or views, which cost
 * nothing). So layer norm's output, or GELU's, is recomputed before the weight-gradient matmul from what its backward keeps,
 * and the recomputed chain fuses into one kernel. Only results of at least RC_MIN
 * elements are worth it, and only across a gap of RC_GAP ops or more; values updated in
 * place (or read through views of such) are never recomputed, nor are the graph's
 * outputs. Runs after CSE (which would merge the copies back). */
#define RC_GAP 32
#define RC_MIN 1024
#define RC_DEPTH 6

/* The differentiable pointwise ops but pow and where (and the copy contiguous), and
 * the views. */
static bool recomputable(kiln__op_id op)
{
    if (kiln__ops[op].is_view && !kiln__ops[op].is_inplace) return true; /* free: a new view of the copy */
    return kiln__ops[op].kind == KILN__KIND_POINTWISE && kiln__ops[op].has_grad && op != KILN_OP_POW &&
           op != KILN_OP_WHERE && op != KILN_OP_CONTIGUOUS;
}

typedef struct {
    kiln_graph_t *g;
    const bool *keep, *mut;
    int map_from[64], map_to[64], n_map; /* what this rebuild has cloned so far */
} rc_ctx;

/* May values a and b live in the same memory (one base, two captured tensors on one
 * storage, or two arguments: a caller may pass one buffer twice, as CSE assumes too)? */
static bool same_memory(const kiln_graph_t *g, int a, int b)
{
    int ra = kiln__graph_root(g, a), rb = kiln__graph_root(g, b);
    const value *xa = &g->v[ra], *xb = &g->v[rb];
    return ra == rb || (xa->kind == V_ARG && xb->kind == V_ARG) ||
           (xa->kind == V_CONST && xb->kind == V_CONST && xa->t->st == xb->t->st);
}

/* Does a node in [from, to) write value x's memory in place? */
static bool written_between(const kiln_graph_t *g, int x, int from, int to)
{
    for (int q = from; q < to && q < g->n_nd; q++) {
        const node *n = &g->nd[q];
        unsigned w = kiln__written_inputs(n->op);
        for (int i = 0; i < n->n_in && i < 4; i++)
            if ((w >> i & 1) && same_memory(g, n->in[i], x)) return true;
    }
    return false;
}

/* Is value x there at position late without being computed again? So it is when read
 * at or after late, or when a view of it is (the view keeps its storage), other than
 * one node skip makes (-1: none). */
static bool alive_but(const rc_ctx *c, int x, int late, int skip)
{
    const kiln_graph_t *g = c->g;
    if (g->v[x].kind != V_OP || c->keep[x]) return true;
    for (int q = late; q < g->n_nd; q++)
        for (int i = 0; i < g->nd[q].n_in; i++)
            if (g->nd[q].in[i] == x) return true;
    for (int q = g->v[x].index + 1; q < g->n_nd; q++) {
        const node *n = &g->nd[q];
        if (q != skip && kiln__ops[n->op].is_view && n->n_in && n->in[0] == x && n->n_out == 1 &&
            alive_but(c, n->out[0], late, skip))
            return true;
    }
    return false;
}

/* *budget: how many more copies the chain may make (rebuild keeps at most 64). */
static bool rebuildable(const rc_ctx *c, int x, int late, int depth, int *budget)
{
    const kiln_graph_t *g = c->g;
    /* Alive there, and holding at late what it held when first read (not written in
     * place since it was made, or at all for an argument or captured tensor: an update,
     * a collective). */
    if (alive_but(c, x, late, -1)) return !written_between(g, x, g->v[x].kind == V_OP ? g->v[x].index + 1 : 0, late);
    if (depth >= RC_DEPTH || c->mut[x]) return false;
    const node *n = &g->nd[g->v[x].index];
    if (!recomputable(n->op) || n->n_out != 1 || n->n_in > 8 || --*budget < 0) return false;
    for (int i = 0; i < n->n_in; i++)
        if (!rebuildable(c, n->in[i], late, depth + 1, budget)) return false;
    return true;
}

/* A copy of node k (one output, n_in <= KILN_OP_MAX_IN) on its inputs as of position late, inserted
 * at *at after what those need, *at moving past it; *out: the copy's value. Nodes before
 * late keep their places (insertions are at or after it). */
static kiln_status rebuild(rc_ctx *c, int x, int late, int *at, int *out);

static kiln_status clone_at(rc_ctx *c, int k, int late, int *at, int *out)
{
    int ins[KILN_OP_MAX_IN];
    if (c->g->nd[k].n_in > KILN_OP_MAX_IN) return kiln__err(KILN_ERR_INTERNAL, "graph_recompute: a node too wide");
    for (int i = 0; i < c->g->nd[k].n_in; i++) {
        kiln_status s = rebuild(c, c->g->nd[k].in[i], late, at, &ins[i]);
        if (s != KILN_OK) return s;
    }
    node n = c->g->nd[k]; /* insertions may have moved the array */
    n.in = ins;
    kiln_status s = kiln__graph_insert_node(c->g, *at, &n, out);
    if (s == KILN_OK) (*at)++;
    return s;
}

/* x as of position *at: itself where alive, else a copy of its producer (on rebuilt
 * inputs) inserted at *at, which moves past it. */
static kiln_status rebuild(rc_ctx *c, int x, int late, int *at, int *out)
{
    kiln_graph_t *g = c->g;
    for (int i = 0; i < c->n_map; i++)
        if (c->map_from[i] == x) {
            *out = c->map_to[i];
            return KILN_OK;
        }
    if (alive_but(c, x, late, -1)) {
        *out = x;
        return KILN_OK;
    }
    if (g->nd[g->v[x].index].n_in > KILN_OP_MAX_IN || c->n_map == 64)
        return kiln__err(KILN_ERR_INTERNAL, "graph_recompute: chain too wide");
    kiln_status s = clone_at(c, g->v[x].index, late, at, out);
    if (s != KILN_OK) return s;
    c->map_from[c->n_map] = x;
    c->map_to[c->n_map++] = *out;
    return KILN_OK;
}

kiln_status kiln_graph_recompute(kiln_graph_t *g, int *recomputed)
{
    if (!g) return kiln__err(KILN_ERR_ARG, "graph_recompute: NULL graph");
    /* The copies add values and nodes, as many of each: flags for up to cap_v values,
     * and room to list the readers of one among all the nodes there can be. */
    int n_v0 = g->n_v, cap_v = n_v0 * 4 + 64;
    bool *keep = calloc(2 * (size_t)cap_v, sizeof *keep), *mut = keep ? keep + cap_v : NULL;
    int *uses = malloc(sizeof(int) * ((size_t)g->n_nd + (size_t)cap_v));
    if (!keep || !uses) {
        KILN__FREE(keep, uses);
        return kiln__err(KILN_ERR_OOM, "graph_recompute: out of memory");
    }
    kiln__graph_mark_results(g, keep);
    kiln__graph_mutated(g, mut);
    kiln_status s = KILN_OK;
    int count = 0;
    for (int k = g->n_nd - 1; k >= 0; k--) {
        const node *n = &g->nd[k];
        if (!recomputable(n->op) || n->n_out != 1 || n->n_in > 8) continue;
        int v = n->out[0];
        if (v >= n_v0 || keep[v] || mut[v]) continue;
        const kiln__meta *m = &g->v[v].meta;
        if (kiln__numel(m->ndim, m->shape) < RC_MIN) continue;
        int n_uses = 0; /* clones made so far count as readers too */
        for (int q = k + 1; q < g->n_nd; q++)
            for (int i = 0; i < g->nd[q].n_in; i++)
                if (g->nd[q].in[i] == v) {
                    uses[n_uses++] = q;
                    break;
                }
        int late = -1;
        for (int i = 0; i + 1 < n_uses && late < 0; i++)
            if (uses[i + 1] - uses[i] >= RC_GAP) late = uses[i + 1];
        if (late < 0) continue;
        rc_ctx c = {g, keep, mut, {0}, {0}, 0};
        bool ok = true;
        int budget = 48;
        for (int i = 0; i < n->n_in && ok; i++) ok = !mut[n->in[i]] && rebuildable(&c, n->in[i], late, 1, &budget);
        /* A view owns no memory: one is worth recomputing only for the storage behind it
         * (a view of GELU's output, say), when that is not alive late anyway. */
        if (ok && kiln__ops[n->op].is_view) ok = !alive_but(&c, n->in[0], late, k);
        if (!ok) continue;
        if (g->n_v + 64 > cap_v) break; /* the flags cover the values made so far (a chain makes <= 49) */
        /* v's own copy (v is read at late, so rebuild would hand back v itself). */
        int at = late, nv = 0;
        if ((s = clone_at(&c, k, late, &at, &nv)) != KILN_OK) break;
        /* The late reads (now from at on) take the copy. */
        for (int q = at; q < g->n_nd; q++)
            for (int i = 0; i < g->nd[q].n_in; i++)
                if (g->nd[q].in[i] == v) g->nd[q].in[i] = nv;
        count++;
    }
    KILN__FREE(keep, uses);
    if (recomputed) *recomputed = count;
    return s;
}

/* Decomposition: each op with a decomposition (src/ops/decompose.c) recorded as its
 * primitives. */
static kiln_status decompose_rule(const kiln_graph_t *g, int k, kiln_tensor_t **ins, kiln_tensor_t **map, void *ctx,
                                  int *used)
{
    const node *n = &g->nd[k];
    kiln__decompose_fn dec = kiln__decomposition(n->op, ins, n->n_in, &n->attrs, *(const bool *)ctx);
    if (!dec) return KILN_OK;
    kiln_tensor_t *res[KILN__MAX_OUT] = {0};
    kiln_status s = dec(ins, n->n_in, &n->attrs, res);
    for (int j = 0; s == KILN_OK && j < n->n_out; j++) map[n->out[j]] = res[j];
    *used = 1;
    return s;
}

kiln_status kiln__graph_decompose(kiln_graph_t *g, bool all, int *decomposed)
{
    return kiln__graph_rewrite(g, "graph_decompose", decompose_rule, &all, decomposed);
}

kiln_status kiln_graph_decompose(kiln_graph_t *g, int *decomposed) { return kiln__graph_decompose(g, false, decomposed); }

/* Coalescing allreduces: a run of consecutive ALLREDUCE_ nodes with one group, reduce
 * op, dtype and device (the gradients of a step, one tensor each) becomes, bucket by
 * bucket, the tensors flattened into one buffer, one allreduce of it, and each tensor
 * read from its range from there on: one collective's latency and one rank-to-rank wait
 * per bucket instead of per tensor. A tensor whose storage something else reads later
 * (another view of it, its base) is copied back into instead, which the other readers
 * then see. A run stops at a tensor that shares storage with one already in it (an
 * allreduce of overlapping views, twice over, is not one of their union). */
typedef struct {
    int64_t bucket_bytes;
    int merged;
    int *last; /* kiln__graph_last_use of the graph rewritten */
} coalesce_ctx;

static bool same_collective(const node *a, const node *b, const kiln_tensor_t *ta, const kiln_tensor_t *tb)
{
    return b->op == KILN_OP_ALLREDUCE_ && a->attrs.op.collective.group == b->attrs.op.collective.group && a->attrs.op.collective.ops == b->attrs.op.collective.ops &&
           a->attrs.op.collective.reduce == b->attrs.op.collective.reduce && ta->dtype == tb->dtype && ta->st->be == tb->st->be;
}

/* Must v's new contents be written into its storage: is v an argument or captured
 * tensor (whose real buffer takes the update), or does another value made before node
 * `end` share its storage and get read from `end` on (or returned), or is it one? */
static bool aliased_later(const kiln_graph_t *g, kiln_tensor_t **map, const int *last, int v, int end)
{
    /* A view of an argument or captured tensor (whose meta storage is its own when the
     * base is a real tensor) writes into that tensor. */
    if (g->v[kiln__graph_root(g, v)].kind != V_OP) return true;
    for (int x = 1; x < g->n_v; x++)
        if (x != v && map[x] && (map[x]->st == map[v]->st || same_memory(g, x, v)) &&
            (last[x] > end || g->v[x].kind != V_OP))
            return true;
    return false;
}

static kiln_status coalesce_rule(const kiln_graph_t *g, int k, kiln_tensor_t **ins, kiln_tensor_t **map, void *ctx,
                                 int *used)
{
    coalesce_ctx *c = ctx;
    const node *n = &g->nd[k];
    if (n->op != KILN_OP_ALLREDUCE_ || n->n_in != 1) return KILN_OK;
    enum { MAX_RUN = 1024 };
    kiln_tensor_t *ts[MAX_RUN];
    int vs[MAX_RUN];
    ts[0] = ins[0];
    vs[0] = n->in[0];
    int64_t bytes = (int64_t)kiln_tensor_nbytes(ins[0]);
    int m = 1;
    for (; k + m < g->n_nd && m < MAX_RUN; m++) {
        const node *b = &g->nd[k + m];
        if (b->n_in != 1) break;
        kiln_tensor_t *t = map[b->in[0]];
        if (!t || !same_collective(n, b, ins[0], t) || bytes + (int64_t)kiln_tensor_nbytes(t) > c->bucket_bytes) break;
        bool shared = false;
        for (int i = 0; i < m && !shared; i++) shared = ts[i]->st == t->st || same_memory(g, vs[i], b->in[0]);
        if (shared) break;
        ts[m] = t;
        vs[m] = b->in[0];
        bytes += (int64_t)kiln_tensor_nbytes(t);
    }
    if (m < 2) return KILN_OK;
    kiln_tensor_t *flat[MAX_RUN], *buf;
    for (int i = 0; i < m; i++) {
        int64_t numel = kiln_tensor_numel(ts[i]);
        if (!(flat[i] = kiln_reshape(ts[i], &numel, 1))) return kiln_last_status();
    }
    if (!(buf = kiln_cat(flat, m, 0))) return kiln_last_status();
    kiln_status s = kiln__dispatch(KILN_OP_ALLREDUCE_, &buf, 1, &n->attrs, NULL);
    int64_t off = 0;
    for (int i = 0; s == KILN_OK && i < m; i++) {
        int64_t numel = kiln_tensor_numel(ts[i]);
        kiln_tensor_t *part = kiln_reshape(kiln_narrow(buf, 0, off, numel), ts[i]->shape, ts[i]->ndim);
        off += numel;
        if (!part) {
            s = kiln_last_status();
        } else if (aliased_later(g, map, c->last, vs[i], k + m)) {
            s = kiln_tensor_copy_(ts[i], part);
        } else { /* the readers from here on read the range */
            kiln_tensor_free(map[vs[i]]);
            map[vs[i]] = kiln_tensor_retain(part);
        }
    }
    c->merged += m - 1;
    *used = m;
    return s;
}

kiln_status kiln_graph_coalesce_allreduce(kiln_graph_t *g, int64_t bucket_bytes, int *merged)
{
    if (bucket_bytes < 1) return kiln__err(KILN_ERR_ARG, "graph_coalesce_allreduce: bucket of %lld bytes",
                                           (long long)bucket_bytes);
    if (!g) return kiln__err(KILN_ERR_ARG, "graph_coalesce_allreduce: NULL graph");
    coalesce_ctx c = {bucket_bytes, 0, calloc((size_t)g->n_v, sizeof(int))};
    if (!c.last) return kiln__err(KILN_ERR_OOM, "graph_coalesce_allreduce: out of memory");
    kiln__graph_last_use(g, c.last);
    kiln_status s = kiln__graph_rewrite(g, "graph_coalesce_allreduce", coalesce_rule, &c, NULL);
    free(c.last);
    if (merged) *merged = s == KILN_OK ? c.merged : 0;
    return s;
}

/* Sinking views below elementwise ops: an elementwise op all of whose inputs are
 * reshapes (view) of contiguous values of one shape S, to its own shape, is computed on
 * those values in S and its result reshaped after it: gelu(view(add(mm, b))) becomes
 * view(gelu(add(mm, b))), so that the add and the gelu are one index space and fuse
 * into one kernel (kiln_linear's 2-D matmul and bias inside a 3-D model). Elementwise
 * results do not depend on the shape they are computed in, only on which elements meet,
 * and a reshape of a contiguous value keeps every element's place in memory. Only where
 * a source is itself an elementwise result (whose kernel the op then joins), and not
 * for scalars. */
bool kiln__graph_elementwise(kiln__op_id op)
{
    /* contiguous is a copy in a layout, not arithmetic: nothing to sink a reshape past */
    return kiln__ops[op].kind == KILN__KIND_POINTWISE && op != KILN_OP_CONTIGUOUS;
}

/* copy_(dst, view(x)) becomes copy_(view(dst), x) when dst can be viewed in x's shape:
 * the copy then has the shape of the value it reads, so the kernel that computes x can
 * store it into dst itself (a gradient copied into its slice of a fused projection's). */
static kiln_status sink_copy(const kiln_graph_t *g, int k, kiln_tensor_t **ins, kiln_tensor_t **map, int *used)
{
    const node *n = &g->nd[k];
    const value *sv = &g->v[n->in[1]];
    if (sv->kind != V_OP || g->nd[sv->index].op != KILN_OP_VIEW) return KILN_OK;
    kiln_tensor_t *x = map[g->nd[sv->index].in[0]];
    if (!x || kiln__same_shape(x->ndim, x->shape, ins[1]->ndim, ins[1]->shape)) return KILN_OK;
    kiln_tensor_t *dv = kiln_view(ins[0], x->shape, x->ndim);
    if (!dv) {
        kiln_clear_error();
        return KILN_OK; /* dst's strides do not allow x's shape */
    }
    kiln_tensor_t *pair[2] = {dv, x};
    kiln_status s = kiln__dispatch(KILN_OP_COPY_, pair, 2, &n->attrs, NULL); /* dv is the scope's */
    if (s == KILN_OK) *used = 1;
    return s;
}

static kiln_status sink_rule(const kiln_graph_t *g, int k, kiln_tensor_t **ins, kiln_tensor_t **map, void *ctx,
                             int *used)
{
    const node *n = &g->nd[k];
    if (n->op == KILN_OP_COPY_) return sink_copy(g, k, ins, map, used);
    if (!kiln__graph_elementwise(n->op) || n->n_out != 1 || n->n_in < 1 || n->n_in > 3) return KILN_OK;
    const kiln__meta *om = &g->v[n->out[0]].meta;
    kiln_tensor_t *src[3];
    bool joins = false; /* a source is an elementwise op's result, whose kernel the op can join */
    for (int i = 0; i < n->n_in; i++) {
        const value *x = &g->v[n->in[i]];
        if (x->kind != V_OP || g->nd[x->index].op != KILN_OP_VIEW) return KILN_OK;
        const value *sv = &g->v[g->nd[x->index].in[0]];
        joins |= sv->kind == V_OP && kiln__graph_elementwise(g->nd[sv->index].op);
        if (!kiln__same_shape(x->meta.ndim, x->meta.shape, om->ndim, om->shape)) return KILN_OK;
        src[i] = map[g->nd[x->index].in[0]];
        if (!src[i] || !kiln__is_contiguous(src[i]) ||
            (i > 0 && !kiln__same_shape(src[i]->ndim, src[i]->shape, src[0]->ndim, src[0]->shape)))
            return KILN_OK;
    }
    if (!joins || kiln__numel(om->ndim, om->shape) < 2 ||
        kiln__same_shape(src[0]->ndim, src[0]->shape, om->ndim, om->shape))
        return KILN_OK; /* nothing to fuse with, a scalar, or views that change no shape */
    kiln_tensor_t *res[KILN__MAX_OUT] = {0};
    kiln_status s = kiln__dispatch(n->op, src, n->n_in, &n->attrs, res);
    if (s != KILN_OK && kiln__op_is_custom(n->op)) { /* its shape function may refuse the sources' shape */
        kiln_clear_error();
        return KILN_OK;
    }
    if (s != KILN_OK) return s;
    kiln_tensor_t *out = kiln_reshape(res[0], om->shape, om->ndim);
    kiln_tensor_free(res[0]);
    if (!out) return kiln_last_status();
    map[n->out[0]] = kiln_tensor_retain(out);
    *used = 1;
    return KILN_OK;
}

kiln_status kiln_graph_sink_views(kiln_graph_t *g, int *sunk)
{
    int count = 0; /* the rewrite's count: how many it sank (left 0 on failure) */
    kiln_status s = kiln__graph_rewrite(g, "graph_sink_views", sink_rule, NULL, &count);
    if (sunk) *sunk = count;
    return s;
}

/* Hoisting siblings: an elementwise op moves up to just after an earlier elementwise op
 * of its shape that reads one of the same inputs, when all its inputs exist there and
 * nothing in between writes them, so that the two fuse into one kernel reading the
 * shared input once (a recomputed GELU and GELU's backward, both of the pre-activation,
 * on either side of the weight-gradient matmul). At most HOIST_REACH nodes up, which
 * bounds how much longer its result lives. */
enum { HOIST_REACH = 32 };

static bool shares_input(const node *a, const node *b)
{
    for (int i = 0; i < a->n_in; i++)
        for (int j = 0; j < b->n_in; j++)
            if (a->in[i] == b->in[j]) return true;
    return false;
}

/* Does a node in [from, to) write the memory of one of n's inputs? */
static bool inputs_written(const kiln_graph_t *g, const node *n, int from, int to)
{
    for (int j = 0; j < n->n_in; j++)
        if (written_between(g, n->in[j], from, to)) return true;
    return false;
}

kiln_status kiln_graph_hoist_siblings(kiln_graph_t *g, int *moved)
{
    if (!g) return kiln__err(KILN_ERR_ARG, "graph_hoist_siblings: NULL graph");
    int count = 0;
    for (int j = 1; j < g->n_nd; j++) {
        const node *n = &g->nd[j];
        if (!kiln__graph_elementwise(n->op) || n->n_out != 1 || kiln__graph_random(n->op, &n->attrs)) continue;
        int earliest = 0; /* where all of n's inputs exist */
        for (int i = 0; i < n->n_in; i++)
            if (g->v[n->in[i]].kind == V_OP && g->v[n->in[i]].index + 1 > earliest) earliest = g->v[n->in[i]].index + 1;
        const kiln__meta *om = &g->v[n->out[0]].meta;
        int to = -1;
        for (int i = j - 1; i >= 0 && i >= j - HOIST_REACH && i + 1 >= earliest; i--) {
            const node *s = &g->nd[i];
            const kiln__meta *sm = &g->v[s->out[0]].meta;
            if (kiln__graph_elementwise(s->op) && s->n_out == 1 &&
                kiln__same_shape(sm->ndim, sm->shape, om->ndim, om->shape) && shares_input(s, n)) {
                to = i + 1;
                break;
            }
        }
        if (to < 0 || to >= j || inputs_written(g, n, to, j)) continue;
        node tmp = g->nd[j];
        memmove(&g->nd[to + 1], &g->nd[to], sizeof *g->nd * (size_t)(j - to));
        g->nd[to] = tmp;
        kiln__graph_reindex(g, to, j + 1);
        count++;
    }
    if (moved) *moved = count;
    return KILN_OK;
}
