/* A captured function with guards (kiln_compiled_*): each graph is kept with what it
 * assumed about its inputs (dtype, shape, device); a call whose inputs match one reuses
 * it, and one that breaks every guard captures again, up to a limit, after which the
 * function runs eagerly. KILN_LOGS (a comma list) prints the stages: "graph" each
 * captured graph, "guards" what it assumes, "recompiles" why a call captured again,
 * with the old and the new value. KILN_DEBUG_DIR=DIR writes one folder per captured
 * graph, DIR/<name>-<n>/: the graph as captured, after the passes, and its guards. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"

typedef struct {
    int n;
    kiln__meta m[KILN_GRAPH_MAX_IN]; /* dtype and shape */
    const void *device[KILN_GRAPH_MAX_IN];
} guards;

struct kiln_compiled {
    kiln_graph_fn fn;
    void *ctx;
    char name[64];
    int limit, n_graphs;
    kiln_graph_t **graphs;
    kiln__program **progs; /* NULL where the graph is interpreted */
    guards *g;
    bool warned;
    uint64_t calls, hits, recompiles;
};

static void guards_of(kiln_tensor_t *const *in, int n, guards *g)
{
    memset(g, 0, sizeof *g);
    g->n = n;
    for (int i = 0; i < n; i++) {
        g->m[i].dtype = in[i]->dtype;
        g->m[i].ndim = in[i]->ndim;
        memcpy(g->m[i].shape, in[i]->shape, sizeof g->m[i].shape);
        g->device[i] = in[i]->st->be;
    }
}

/* The first guard of old that now fails, described into why; false if all hold. */
static bool broken(const guards *old, const guards *now, char *why, size_t n)
{
    if (old->n != now->n) {
        snprintf(why, n, "the number of inputs changed: %d -> %d", old->n, now->n);
        return true;
    }
    for (int i = 0; i < now->n; i++) {
        char a[96], b[96];
        if (old->device[i] != now->device[i]) {
            snprintf(why, n, "input %d moved to another device", i);
            return true;
        }
        const kiln__meta *o = &old->m[i], *w = &now->m[i];
        bool same = o->dtype == w->dtype && o->ndim == w->ndim &&
                    !memcmp(o->shape, w->shape, sizeof(int64_t) * (size_t)w->ndim);
        if (!same) {
            snprintf(why, n, "input %d %s changed: %s -> %s", i, o->dtype != w->dtype ? "dtype" : "shape",
                     kiln__meta_str(o, a, sizeof a), kiln__meta_str(w, b, sizeof b));
            return true;
        }
    }
    return false;
}

/* One line per guard, each after prefix. */
static void print_guards(FILE *f, const char *prefix, const guards *gd)
{
    for (int i = 0; i < gd->n; i++) {
        char b[96];
        fprintf(f, "%sinput %d is %s\n", prefix, i, kiln__meta_str(&gd->m[i], b, sizeof b));
    }
}

kiln_status kiln_compiled_new(kiln_graph_fn fn, void *ctx, const char *name, kiln_compiled_t **out)
{
    if (!out) return kiln__err(KILN_ERR_ARG, "compiled_new: out is NULL");
    *out = NULL;
    if (!fn) return kiln__err(KILN_ERR_ARG, "compiled_new: no function");
    kiln_compiled_t *c = calloc(1, sizeof *c);
    if (!c) return kiln__err(KILN_ERR_OOM, "compiled_new: out of memory");
    c->fn = fn;
    c->ctx = ctx;
    snprintf(c->name, sizeof c->name, "%s", name && *name ? name : "function");
    const char *lim = getenv("KILN_RECOMPILE_LIMIT");
    c->limit = lim && *lim ? atoi(lim) : 8;
    if (c->limit < 1) c->limit = 1;
    c->graphs = calloc((size_t)c->limit, sizeof *c->graphs);
    c->g = calloc((size_t)c->limit, sizeof *c->g);
    c->progs = calloc((size_t)c->limit, sizeof *c->progs);
    if (!c->graphs || !c->g || !c->progs) {
        kiln_compiled_free(c);
        return kiln__err(KILN_ERR_OOM, "compiled_new: out of memory");
    }
    *out = c;
    return KILN_OK;
}

void kiln_compiled_free(kiln_compiled_t *c)
{
    if (!c) return;
    for (int i = 0; c->graphs && i < c->n_graphs; i++) {
        kiln__program_free(c->progs[i]);
        kiln_graph_free(c->graphs[i]);
    }
    free(c->graphs);
    free(c->progs);
    free(c->g);
    free(c);
}

kiln_status kiln_compiled_call(kiln_compiled_t *c, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int max_out,
                               int *n_out)
{
    if (!c || !n_out || (n_in && !in)) return kiln__err(KILN_ERR_ARG, "compiled_call: NULL argument");
    if (n_in > KILN_GRAPH_MAX_IN)
        return kiln__err(KILN_ERR_ARG, "compiled_call: %d inputs, at most %d are guarded", n_in, KILN_GRAPH_MAX_IN);
    for (int i = 0; i < n_in; i++)
        if (!in[i]) return kiln__null_arg("compiled_call");
    /* A replay notes the launches made through dispatch; a compiled program launches
     * its generated kernels and its collectives itself, so a recording would leave them
     * out and every replay would skip them. */
    if (kiln__replay_recording())
        return kiln__err(KILN_ERR_UNSUPPORTED, "compiled_call: %s inside kiln_replay_record: the replay would not hold "
                         "its generated kernels; record the function itself, or call the compiled one, not both",
                         c->name);
    c->calls++;
    guards now;
    guards_of(in, n_in, &now);
    char why[256] = "";
    for (int k = c->n_graphs - 1; k >= 0; k--)
        if (!broken(&c->g[k], &now, why, sizeof why)) {
            c->hits++;
            return c->progs[k] ? kiln__program_run(c->progs[k], in, n_in, out, max_out, n_out)
                               : kiln_graph_run(c->graphs[k], in, n_in, out, max_out, n_out);
        }
    if (c->n_graphs > 0) broken(&c->g[c->n_graphs - 1], &now, why, sizeof why);
    if (c->n_graphs == c->limit) { /* past the limit: eager from here on for new guards */
        if (!c->warned) {
            fprintf(stderr, "kiln: %s was captured %d times (KILN_RECOMPILE_LIMIT); calls that match none of those "
                    "graphs now run eagerly (last reason: %s)\n", c->name, c->limit, why);
            c->warned = true;
        }
        kiln_tensor_t *res[KILN_GRAPH_MAX_OUT] = {0};
        int n = 0;
        kiln_status s = c->fn(c->ctx, in, n_in, res, &n);
        if (s == KILN_OK && n > max_out) s = kiln__err(KILN_ERR_ARG, "compiled_call: room for %d outputs, %d given", max_out, n);
        for (int j = 0; s == KILN_OK && j < n; j++) out[j] = res[j];
        *n_out = s == KILN_OK ? n : 0;
        return s;
    }
    if (c->n_graphs > 0) {
        c->recompiles++;
        if (kiln__log_on("recompiles")) fprintf(stderr, "kiln [recompiles] %s: capturing again: %s\n", c->name, why);
    }
    kiln_graph_t *g;
    kiln_status s = kiln_graph_capture(c->fn, c->ctx, in, n_in, &g);
    if (s != KILN_OK) return s;
    char dir[1024] = "";
    const char *dbg = getenv("KILN_DEBUG_DIR");
    if (dbg && *dbg) {
        snprintf(dir, sizeof dir, "%s/%s-%d", dbg, c->name, c->n_graphs);
        mkdir(dbg, 0755);
        if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "kiln: KILN_DEBUG_DIR: cannot make %s: %s\n", dir, strerror(errno));
            *dir = 0;
        }
    }
    FILE *f;
    if (*dir && (f = kiln__debug_open(dir, "captured.txt"))) {
        kiln_graph_print(g, f);
        fclose(f);
    }
    kiln__program *prog = NULL;
    s = kiln__compile_graph(g, *dir ? dir : NULL, c->name, c->n_graphs, &prog);
    if (s != KILN_OK) {
        kiln_graph_free(g);
        return s;
    }
    if (*dir && (f = kiln__debug_open(dir, "guards.txt"))) {
        print_guards(f, "", &now);
        fclose(f);
    }
    if (kiln__log_on("guards")) {
        char prefix[128];
        snprintf(prefix, sizeof prefix, "kiln [guards] %s graph %d: ", c->name, c->n_graphs);
        print_guards(stderr, prefix, &now);
    }
    c->progs[c->n_graphs] = prog;
    c->graphs[c->n_graphs] = g;
    c->g[c->n_graphs++] = now;
    return prog ? kiln__program_run(prog, in, n_in, out, max_out, n_out) : kiln_graph_run(g, in, n_in, out, max_out, n_out);
}

void kiln_compiled_stats(const kiln_compiled_t *c, uint64_t *calls, uint64_t *hits, uint64_t *recompiles, int *graphs)
{
    if (calls) *calls = c ? c->calls : 0;
    if (hits) *hits = c ? c->hits : 0;
    if (recompiles) *recompiles = c ? c->recompiles : 0;
    if (graphs) *graphs = c ? c->n_graphs : 0;
}

kiln_status kiln_compiled_plan(const kiln_compiled_t *c, int graph, int *kernels, int *ops, int64_t *planned_peak,
                               int64_t *eager_peak)
{
    if (!c || graph < 0 || graph >= c->n_graphs)
        return kiln__err(KILN_ERR_ARG, "compiled_plan: no graph %d (the function has %d)", graph, c ? c->n_graphs : 0);
    const kiln__program *p = c->progs[graph];
    int n_ops = 0;
    for (int t = 0; p && t < p->n_steps; t++) n_ops += p->steps[t].kind == STEP_OP;
    if (kernels) *kernels = p ? p->n_k : 0;
    if (ops) *ops = n_ops;
    if (planned_peak) *planned_peak = p ? p->planned_peak : 0;
    if (eager_peak) *eager_peak = p ? p->eager_peak : 0;
    return KILN_OK;
}
