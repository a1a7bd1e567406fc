/* Running a compiled program: its steps in order, each either one op through dispatch
 * (as the graph interpreter runs it) or a generated kernel launched over the thread
 * pool on freshly allocated outputs. A value is freed after the last step that reads
 * it; the graph's outputs and leaf gradients are kept. */
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/threadpool.h"
#include "kiln/ops.h"

typedef struct {
    void (*fn)(char *const *b, int64_t t0, int64_t t1);
    char *const *b;
} launch_ctx;

static void launch_range(void *ctx, int64_t t0, int64_t t1)
{
    const launch_ctx *l = ctx;
    l->fn(l->b, t0, t1);
}

void kiln__compile_options(kc_options *o)
{
    *o = (kc_options){true, true, true, true, true, 48};
    const char *off = getenv("KILN_COMPILE_DISABLE");
    for (const char *p = off; p && *p;) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
#define OFF(name) \
    if (n == strlen(#name) && !strncmp(p, #name, n)) o->name = false;
        OFF(decompose)
        OFF(cse)
        OFF(dce)
        OFF(fusion)
        OFF(codegen)
#undef OFF
        p += n + (e ? 1 : 0);
    }
    const char *mf = getenv("KILN_COMPILE_MAX_FUSE");
    if (mf && atoi(mf) > 0) o->max_fuse = atoi(mf);
}

static kiln_status run_kernel(kiln__program *p, const kc_kernel *k, kiln_tensor_t **rt)
{
    kiln_graph_t *g = p->g;
    char *bufs[64], **b = bufs;
    if (k->n_buf > 64 && !(b = malloc(sizeof *b * (size_t)k->n_buf))) return kiln__err(KILN_ERR_OOM, "compile: out of memory");
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < k->n_buf; i++) {
        const kc_buf *kb = &k->buf[i];
        const kiln__meta *m = &g->v[kb->value].meta;
        if (kb->output) {
            rt[kb->value] = kiln__tensor_alloc(kiln__backend_default(), m->dtype, m->shape, m->ndim);
            if (!rt[kb->value]) s = kiln_last_status();
            else b[i] = kiln__data(rt[kb->value]);
            continue;
        }
        kiln_tensor_t *t = rt[kb->value];
        if (!t) {
            s = kiln__err(KILN_ERR_INTERNAL, "compile: kernel %s reads value %%%d before it exists", k->name, kb->value);
            break;
        }
        /* The strides the kernel was generated for must be the tensor's (dims of size 1
         * are never stepped over). */
        for (int d = 0; d < t->ndim; d++)
            if (t->shape[d] != 1 && t->stride[d] != kb->st[d]) {
                s = kiln__err(KILN_ERR_INTERNAL, "compile: kernel %s input %%%d has stride %lld in dim %d, generated for "
                              "%lld", k->name, kb->value, (long long)t->stride[d], d, (long long)kb->st[d]);
                break;
            }
        b[i] = kiln__data(t);
    }
    if (s == KILN_OK && k->tasks > 0) {
        launch_ctx l = {k->fn, b};
        kiln__parallel_for(k->tasks, k->grain, launch_range, &l);
    }
    if (b != bufs) free(b);
    return s;
}

kiln_status kiln__program_run(kiln__program *p, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out,
                              int max_out, int *n_out)
{
    kiln_graph_t *g = p->g;
    if (!n_out || (max_out > 0 && !out)) return kiln__err(KILN_ERR_ARG, "graph_run: NULL outputs");
    kiln_status s = kiln__graph_check_inputs(g, in, n_in, max_out);
    if (s != KILN_OK) return s;
    kiln_tensor_t **rt = calloc((size_t)g->n_v, sizeof *rt);
    if (!rt) return kiln__err(KILN_ERR_OOM, "graph_run: out of memory");
    for (int i = 1; i < g->n_v; i++)
        if (g->v[i].kind == V_ARG) rt[i] = kiln_tensor_retain(in[g->v[i].index]);
        else if (g->v[i].kind == V_CONST) rt[i] = kiln_tensor_retain(g->v[i].t);
    bool prev = kiln_set_grad_enabled(false);
    kiln_tensor_t *ins[64], **insp = ins;
    for (int t = 0; s == KILN_OK && t < p->n_steps; t++) {
        const kc_step *st = &p->steps[t];
        if (st->kind == STEP_KERNEL) {
            const kc_kernel *k = &p->k[st->index];
            s = run_kernel(p, k, rt);
            for (int i = 0; s == KILN_OK && i < k->n_buf; i++) {
                int v = k->buf[i].value;
                if (!k->buf[i].output && p->last[v] == t + 1 && g->v[v].kind == V_OP) {
                    kiln_tensor_free(rt[v]);
                    rt[v] = NULL;
                }
            }
            continue;
        }
        node *n = &g->nd[st->index];
        if (n->n_in > 64 && !(insp = malloc(sizeof *insp * (size_t)n->n_in))) {
            s = kiln__err(KILN_ERR_OOM, "graph_run: out of memory");
            break;
        }
        for (int i = 0; i < n->n_in; i++) insp[i] = rt[n->in[i]];
        kiln_tensor_t *res[KILN__MAX_OUT] = {0};
        s = kiln__dispatch(n->op, insp, n->n_in, &n->attrs, n->n_out ? res : NULL);
        for (int j = 0; s == KILN_OK && j < n->n_out; j++) {
            if (p->last[n->out[j]] == 0) kiln_tensor_free(res[j]); /* a hidden output nobody reads */
            else rt[n->out[j]] = res[j];
        }
        for (int i = 0; s == KILN_OK && i < n->n_in; i++) {
            int v = n->in[i];
            if (p->last[v] == t + 1 && g->v[v].kind == V_OP) {
                kiln_tensor_free(rt[v]);
                rt[v] = NULL;
            }
        }
        if (insp != ins) free(insp);
        insp = ins;
    }
    if (s == KILN_OK) s = kiln__graph_add_leaf_grads(g, rt);
    kiln_set_grad_enabled(prev);
    for (int j = 0; s == KILN_OK && j < g->n_outs; j++) out[j] = kiln__scoped(kiln_tensor_retain(rt[g->outs[j]]));
    *n_out = s == KILN_OK ? g->n_outs : 0;
    for (int i = 0; i < g->n_v; i++) kiln_tensor_free(rt[i]);
    free(rt);
    return s;
}

void kiln__program_print(const kiln__program *p, FILE *f)
{
    const kiln_graph_t *g = p->g;
    int ops = 0;
    for (int t = 0; t < p->n_steps; t++) ops += p->steps[t].kind == STEP_OP;
    fprintf(f, "%d steps: %d kernels, %d ops through dispatch; intermediates planned peak %.2f MiB, eager %.2f MiB\n",
            p->n_steps, p->n_k, ops, (double)p->planned_peak / 1048576.0, (double)p->eager_peak / 1048576.0);
    for (int t = 0; t < p->n_steps; t++) {
        const kc_step *st = &p->steps[t];
        if (st->kind == STEP_OP) {
            const node *n = &g->nd[st->index];
            fprintf(f, "  op     %s ->", kiln__ops[n->op].name);
            for (int j = 0; j < n->n_out; j++) fprintf(f, " %%%d", n->out[j]);
            fprintf(f, "\n");
            continue;
        }
        const kc_kernel *k = &p->k[st->index];
        fprintf(f, "  kernel %s [%d ops: %s] reads", k->name, k->n_ops, k->ops);
        for (int i = 0; i < k->n_buf; i++)
            if (!k->buf[i].output) fprintf(f, " %%%d", k->buf[i].value);
        fprintf(f, " writes");
        for (int i = 0; i < k->n_buf; i++)
            if (k->buf[i].output) fprintf(f, " %%%d", k->buf[i].value);
        fprintf(f, "\n");
    }
}
