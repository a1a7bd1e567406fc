/* Merging slice scatters (kiln_graph_merge_slices). The backward of a slice is a
 * zero tensor of the input's shape with the gradient copied into the slice; an input
 * read through several slices (a fused q|k|v projection split three ways) then gets
 * its gradient as the sum of several such tensors, each mostly zeros:
 *
 *     %a = full(0) [S]; %sa = slice(%a) ...; copy_(%sa, %dq)
 *     %b = full(0) [S]; %sb = slice(%b) ...; copy_(%sb, %dk)
 *     %c = add(%a, %b)
 *
 * When the slices of %a and of %b cover disjoint ranges of one dim, %c is %a with %dk
 * copied into its range too: the slices of %b are re-pointed at %a, %c's readers read %a,
 * and dead-code elimination drops the add and %b's fill. A chain of such adds merges
 * into one zero fill and one copy per slice. */
#include <stdlib.h>
#include <string.h>
#include "core/util.h"
#include "graph/graph_impl.h"

/* Where the slices of a base value write: one dim, and up to 16 ranges on it. */
typedef struct {
    int dim, n;
    int64_t lo[16], hi[16];
    int first; /* the first node that slices the base */
} region;

/* The pass so far: repl[v] is what value v now is (an add merged away is its first
 * operand), dead[k] marks the adds merged away, res[v] the values the graph returns or
 * gives a leaf as its gradient (kept true through merges). */
typedef struct {
    kiln_graph_t *g;
    int *repl;
    bool *dead, *res;
} pass;

/* Is value v read only by copy_ as its destination, before node `before`? */
static bool only_copied_into(const pass *c, int v, int before)
{
    if (c->res[v]) return false;
    for (int k = 0; k < c->g->n_nd; k++) {
        const node *n = &c->g->nd[k];
        for (int i = 0; i < n->n_in && !c->dead[k]; i++)
            if (c->repl[n->in[i]] == v && (n->op != KILN_OP_COPY_ || i != 0 || k > before)) return false;
    }
    return true;
}

/* Is value v a zero fill (of out's shape and dtype) that, apart from node `add`, is
 * only sliced (step 1, one dim), each slice only copied into, all before `add`? Fills r
 * with the ranges. */
static bool zero_scatter(const pass *c, int v, int add, const kiln__meta *out, region *r)
{
    const kiln_graph_t *g = c->g;
    const value *x = &g->v[v];
    if (x->kind != V_OP || c->res[v]) return false;
    const node *f = &g->nd[x->index];
    const kiln__meta *m = &x->meta;
    if (f->op != KILN_OP_FULL || f->attrs.op.source.value != 0 || m->dtype != out->dtype || m->ndim != out->ndim ||
        memcmp(m->shape, out->shape, sizeof(int64_t) * (size_t)m->ndim))
        return false;
    r->n = 0;
    r->dim = -1;
    r->first = -1;
    for (int k = 0; k < g->n_nd; k++) {
        const node *n = &g->nd[k];
        for (int i = 0; i < n->n_in; i++) {
            if (c->repl[n->in[i]] != v || k == add || c->dead[k]) continue;
            if (n->op != KILN_OP_SLICE || n->attrs.op.slice.step != 1 || r->n == 16 || k > add) return false;
            int d = (int)n->attrs.op.slice.dim;
            if (r->dim >= 0 && d != r->dim) return false;
            if (!only_copied_into(c, n->out[0], add)) return false;
            r->dim = d;
            r->lo[r->n] = n->attrs.op.slice.start;
            r->hi[r->n++] = n->attrs.op.slice.start + n->attrs.op.slice.length;
            if (r->first < 0) r->first = k;
        }
    }
    return r->n > 0;
}

static bool disjoint(const region *a, const region *b)
{
    if (a->dim != b->dim) return false;
    for (int i = 0; i < a->n; i++)
        for (int j = 0; j < b->n; j++)
            if (a->lo[i] < b->hi[j] && b->lo[j] < a->hi[i]) return false;
    return true;
}

kiln_status kiln_graph_merge_slices(kiln_graph_t *g, int *merged)
{
    if (!g) return kiln__err(KILN_ERR_ARG, "graph_merge_slices: NULL graph");
    int *repl = malloc(sizeof(int) * (size_t)g->n_v);
    bool *res = calloc((size_t)g->n_v + (size_t)g->n_nd + 1, sizeof *res), *dead = res ? res + g->n_v : NULL;
    if (!repl || !res) {
        KILN__FREE(repl, res);
        return kiln__err(KILN_ERR_OOM, "graph_merge_slices: out of memory");
    }
    kiln__graph_mark_results(g, res);
    pass c = {g, repl, dead, res};
    for (int v = 0; v < g->n_v; v++) repl[v] = v;
    int done = 0;
    for (int k = 0; k < g->n_nd; k++) {
        node *n = &g->nd[k];
        for (int i = 0; i < n->n_in; i++) n->in[i] = repl[n->in[i]];
        if (n->op != KILN_OP_ADD || n->in[0] == n->in[1]) continue;
        const kiln__meta *out = &g->v[n->out[0]].meta;
        region ra, rb;
        int a = n->in[0], b = n->in[1];
        if (!zero_scatter(&c, a, k, out, &ra) || !zero_scatter(&c, b, k, out, &rb) || !disjoint(&ra, &rb)) continue;
        /* b's slices become a's: a must exist before the first of them. */
        if (g->v[a].index > rb.first) {
            int t = a;
            a = b;
            b = t;
            rb = ra;
        }
        if (g->v[a].index > rb.first) continue;
        for (int j = 0; j < k; j++)
            if (g->nd[j].op == KILN_OP_SLICE && g->nd[j].in[0] == b) g->nd[j].in[0] = a;
        repl[n->out[0]] = a;
        res[a] |= res[n->out[0]];
        dead[k] = true;
        done++;
    }
    for (int j = 0; j < g->n_outs; j++) g->outs[j] = repl[g->outs[j]];
    for (int j = 0; j < g->n_lg; j++) g->lg[j].value = repl[g->lg[j].value];
    KILN__FREE(repl, res); /* and dead */
    if (merged) *merged = done;
    return KILN_OK;
}
