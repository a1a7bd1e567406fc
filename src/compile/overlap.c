/* Overlapping collectives with the steps after them. A training step calls its
 * gradients' allreduce after the whole backward, so that is where the captured graph
 * has it (coalesced into buckets: views of the gradients, their cat, one allreduce_ per
 * bucket); run there, every rank waits on the network with nothing left to compute.
 * This pass, on the program's steps after fusion, moves each allreduce_ step, with the
 * view and cat steps that gather its input, up to just after the last step it depends
 * on, and marks it to be started there and finished before the first later step that
 * touches its memory (kc_step.until): the collective then runs while the rest of
 * backward computes, as kiln_ddp does eagerly. The order of the collectives is the
 * same on every rank, since every rank builds the same program.
 *
 * A step moves above another only when neither touches what the other writes: not
 * above the step that makes a value it reads, not above one that writes in place into
 * memory it reads or writes, and, writing in place itself, not above one that reads or
 * writes that memory. Memory is compared by root value (a view is its root's memory);
 * an argument may be any memory, and so may overlap every argument and captured tensor. */
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/util.h"

typedef struct {
    int v;
    char how; /* 'r' read, 'w' written in place (and read), 'm' made */
} access;

/* Step t's accesses into a (room for the most any step has). */
static int accesses(const kiln__program *p, int t, access *a)
{
    const kiln_graph_t *g = p->g;
    const kc_step *st = &p->steps[t];
    int n = 0;
    if (st->kind == STEP_OP) {
        const node *nd = &g->nd[st->index];
        unsigned w = kiln__written_inputs(nd->op);
        for (int i = 0; i < nd->n_in; i++) a[n++] = (access){nd->in[i], i < 32 && (w >> i & 1) ? 'w' : 'r'};
        for (int j = 0; j < nd->n_out; j++) a[n++] = (access){nd->out[j], 'm'};
        return n;
    }
    const kc_kernel *k = &p->k[st->index];
    for (int b = 0; b < k->n_buf; b++)
        a[n++] = (access){k->buf[b].value, k->buf[b].inplace ? 'w' : k->buf[b].output ? 'm' : 'r'};
    return n;
}

static bool overlaps(const kiln_graph_t *g, int a, int b)
{
    int ra = kiln__graph_root(g, a), rb = kiln__graph_root(g, b);
    const value *xa = &g->v[ra], *xb = &g->v[rb];
    if (ra == rb) return true;
    if (xa->kind == V_OP || xb->kind == V_OP) return false;
    return xa->kind == V_ARG || xb->kind == V_ARG || xa->t->st == xb->t->st;
}

/* May a step with accesses s[0..ns) run before one with x[0..nx)? */
static bool may_pass(const kiln_graph_t *g, const access *s, int ns, const access *x, int nx)
{
    for (int i = 0; i < ns; i++)
        for (int j = 0; j < nx; j++) {
            if (x[j].how == 'm' && x[j].v == s[i].v) return false;
            if ((x[j].how == 'w' || s[i].how == 'w') && x[j].how != 'm' && s[i].how != 'm' &&
                overlaps(g, s[i].v, x[j].v))
                return false;
        }
    return true;
}

static bool is_collective(const kiln__program *p, int t)
{
    const kc_step *st = &p->steps[t];
    if (st->kind != STEP_OP) return false;
    const node *n = &p->g->nd[st->index];
    if (n->op != KILN_OP_ALLREDUCE_ || n->n_in != 1) return false;
    const kiln__collective_ops *c = n->attrs.op.collective.ops;
    return c && c->start;
}

/* Moves step t up as far as it may go; its new index. */
static int hoist(kiln__program *p, int t, access *s, access *x)
{
    int ns = accesses(p, t, s), i = t - 1;
    while (i >= 0 && may_pass(p->g, s, ns, x, accesses(p, i, x))) i--;
    if (i + 1 == t) return t;
    kc_step moved = p->steps[t];
    memmove(&p->steps[i + 2], &p->steps[i + 1], sizeof *p->steps * (size_t)(t - i - 1));
    p->steps[i + 1] = moved;
    return i + 1;
}

kiln_status kiln__program_overlap(kiln__program *p, int *moved)
{
    const kiln_graph_t *g = p->g;
    *moved = 0;
    int most = 1;
    for (int t = 0; t < p->n_steps; t++) {
        const kc_step *st = &p->steps[t];
        int n = st->kind == STEP_OP ? g->nd[st->index].n_in + g->nd[st->index].n_out : p->k[st->index].n_buf;
        if (n > most) most = n;
    }
    access *s = malloc(sizeof *s * 2 * (size_t)most), *x = s ? s + most : NULL;
    int *made_by = malloc(sizeof *made_by * 2 * (size_t)g->n_v), *work = made_by ? made_by + g->n_v : NULL;
    bool *chain = malloc((size_t)p->n_steps + 1);
    kiln_status st = s && made_by && chain ? KILN_OK : kiln__err(KILN_ERR_OOM, "compile: out of memory");
    for (int a = 0; st == KILN_OK && a < p->n_steps; a++) {
        if (!is_collective(p, a)) continue;
        /* The view and cat steps that gather its input, by walking back from it. */
        for (int v = 0; v < g->n_v; v++) made_by[v] = -1;
        for (int t = 0; t < a; t++) {
            int n = accesses(p, t, x);
            for (int i = 0; i < n; i++)
                if (x[i].how == 'm') made_by[x[i].v] = t;
        }
        memset(chain, 0, (size_t)p->n_steps);
        int n_work = 0;
        work[n_work++] = g->nd[p->steps[a].index].in[0];
        while (n_work > 0) {
            int t = made_by[work[--n_work]];
            if (t < 0 || chain[t] || p->steps[t].kind != STEP_OP) continue;
            const node *n = &g->nd[p->steps[t].index];
            if (!kiln__ops[n->op].is_view && n->op != KILN_OP_CAT) continue;
            chain[t] = true;
            for (int i = 0; i < n->n_in && n_work < g->n_v; i++) work[n_work++] = n->in[i];
        }
        /* Earliest first, so that each finds the ones it reads already moved; moving one
         * up shifts only steps before the next. */
        for (int t = 0; t < a; t++)
            if (chain[t]) hoist(p, t, s, x);
        if (hoist(p, a, s, x) < a) ++*moved;
    }
    /* Each is finished before the first later step that touches its memory (a view
     * makes no access; what reads through it does), else at the end. */
    for (int a = 0; st == KILN_OK && a < p->n_steps; a++) {
        if (!is_collective(p, a)) continue;
        int v = g->nd[p->steps[a].index].in[0];
        p->steps[a].until = p->n_steps;
        for (int t = a + 1; t < p->n_steps && p->steps[a].until == p->n_steps; t++) {
            if (p->steps[t].kind == STEP_OP && kiln__ops[g->nd[p->steps[t].index].op].is_view) continue;
            int n = accesses(p, t, x);
            for (int i = 0; i < n; i++)
                if (x[i].how != 'm' && overlaps(g, x[i].v, v)) {
                    p->steps[a].until = t;
                    break;
                }
        }
    }
    KILN__FREE(s, made_by, chain); /* and x, work */
    return st;
}
