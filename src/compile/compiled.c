/* A captured function with guards (kiln_compiled_*): each graph is kept with what it
 * assumed: its inputs' dtype, shape and device, grad mode, which of the tensors it
 * captured required gradients, and the bytes of the attributes the caller declared
 * (kiln_compiled_guard); a call that matches one reuses it, and one that breaks every
 * guard captures again, up to a limit, after which the function runs eagerly. KILN_LOGS (a comma list) prints the stages: "graph" each
 * captured graph, "guards" what it assumes, "recompiles" why a call captured again,
 * with the old and the new value. KILN_DEBUG_DIR=DIR writes one folder per captured
 * graph, DIR/<name>-<n>/: the graph as captured, after the passes, and its guards. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/env.h"
#include "kiln/ops.h"

#define MAX_ATTRS 8
#define ATTR_BYTES 64

/* An attribute the caller declared: n bytes at ptr, read at every call. */
typedef struct {
    char name[32];
    const void *ptr;
    size_t n;
} attr;

typedef struct {
    int n;
    kiln__meta m[KILN_GRAPH_MAX_IN]; /* dtype and shape */
    const void *device[KILN_GRAPH_MAX_IN];
    bool grad_mode;
    unsigned char attr[MAX_ATTRS][ATTR_BYTES]; /* each declared attribute's bytes */
    /* The tensors the graph captured (retained) and whether each required gradients
     * then: a graph computes gradients for exactly those that did. Empty in a call's
     * guards, which are checked against each graph's list. */
    kiln_tensor_t **cap;
    bool *cap_rg; /* in cap's block */
    int n_cap;
} guards;

struct kiln_compiled {
    kiln_graph_fn fn;
    void *ctx;
    char name[64];
    int limit, n_graphs;
    struct {
        kiln_graph_t *graph;
        kiln__program *prog; /* NULL where the graph is interpreted */
        guards g;
    } *graphs;
    attr attrs[MAX_ATTRS];
    int n_attrs;
    bool warned;
    uint64_t calls, hits, recompiles;
};

static void guards_of(const kiln_compiled_t *c, kiln_tensor_t *const *in, int n, guards *g)
{
    *g = (guards){.n = n, .grad_mode = kiln_grad_enabled()};
    for (int i = 0; i < n; i++) {
        kiln__meta_of(in[i], &g->m[i]);
        g->device[i] = in[i]->st->be;
    }
    for (int i = 0; i < c->n_attrs; i++) memcpy(g->attr[i], c->attrs[i].ptr, c->attrs[i].n);
}

static void guards_free(guards *gd)
{
    for (int i = 0; i < gd->n_cap; i++) kiln_tensor_free(gd->cap[i]);
    free(gd->cap); /* and cap_rg, in the same block */
}

/* Records in gd the tensors graph gr captured, and which of them require gradients. */
static kiln_status capture_guards(const kiln_graph_t *gr, guards *gd)
{
    int n = 0;
    for (int i = 1; i < gr->n_v; i++) n += gr->v[i].kind == V_CONST && gr->v[i].t;
    if (!(gd->cap = calloc((size_t)(n ? n : 1), sizeof *gd->cap + sizeof *gd->cap_rg)))
        return kiln__err(KILN_ERR_OOM, "compiled_call: out of memory");
    gd->cap_rg = (bool *)(gd->cap + (n ? n : 1));
    for (int i = 1; i < gr->n_v; i++)
        if (gr->v[i].kind == V_CONST && gr->v[i].t) {
            gd->cap[gd->n_cap] = kiln_tensor_retain(gr->v[i].t);
            gd->cap_rg[gd->n_cap++] = kiln_tensor_requires_grad(gr->v[i].t);
        }
    return KILN_OK;
}

/* An attribute's bytes as a reader wants them: an integer for 1, 2, 4 or 8 bytes (8
 * bytes as a double when they read as a normal double and as an integer beyond 2^53,
 * which an integer attribute is not), else hex. */
static void attr_str(const unsigned char *p, size_t n, char *b, size_t bn)
{
    union {
        int8_t i1;
        int16_t i2;
        int32_t i4;
        int64_t i8;
        double d;
    } u = {0};
    memcpy(&u, p, n < sizeof u ? n : sizeof u);
    bool wide = u.i8 > (1LL << 53) || u.i8 < -(1LL << 53);
    if (n == 1 || n == 2 || n == 4) snprintf(b, bn, "%lld", (long long)(n == 1 ? u.i1 : n == 2 ? u.i2 : u.i4));
    else if (n == 8 && isnormal(u.d) && wide) snprintf(b, bn, "%g", u.d);
    else if (n == 8) snprintf(b, bn, "%lld", (long long)u.i8);
    else
        for (size_t i = 0, k = 0; i < n && k + 3 < bn; i++) k += (size_t)snprintf(b + k, bn - k, "%02x", p[i]);
}

/* The first guard of old that now fails, described into why; false if all hold. */
static bool broken(const kiln_compiled_t *c, const guards *old, const guards *now, char *why, size_t n)
{
    if (old->n != now->n) {
        snprintf(why, n, "the number of inputs changed: %d -> %d", old->n, now->n);
        return true;
    }
    for (int i = 0; i < now->n; i++) {
        char a[96], b[96];
        if (old->device[i] != now->device[i]) {
            snprintf(why, n, "input %d moved to another device: %s -> %s", i,
                     ((const kiln__backend *)old->device[i])->name, ((const kiln__backend *)now->device[i])->name);
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
    if (old->grad_mode != now->grad_mode) {
        snprintf(why, n, "grad mode changed: %s -> %s", old->grad_mode ? "on" : "off", now->grad_mode ? "on" : "off");
        return true;
    }
    for (int i = 0; i < c->n_attrs; i++)
        if (memcmp(old->attr[i], now->attr[i], c->attrs[i].n)) {
            char a[2 * ATTR_BYTES + 4], b[2 * ATTR_BYTES + 4];
            attr_str(old->attr[i], c->attrs[i].n, a, sizeof a);
            attr_str(now->attr[i], c->attrs[i].n, b, sizeof b);
            snprintf(why, n, "attribute %s changed: %s -> %s", c->attrs[i].name, a, b);
            return true;
        }
    /* (with grad mode off no gradient is computed, whatever the tensors want) */
    for (int i = 0; i < old->n_cap && old->grad_mode; i++)
        if (kiln_tensor_requires_grad(old->cap[i]) != old->cap_rg[i]) {
            char b[96];
            snprintf(why, n, "captured tensor %d (%s) requires_grad changed: %s -> %s", i,
                     kiln__shape_str(old->cap[i], b, sizeof b), old->cap_rg[i] ? "true" : "false",
                     old->cap_rg[i] ? "false" : "true");
            return true;
        }
    return false;
}

/* One line per guard, each after prefix. */
static void print_guards(FILE *f, const char *prefix, const kiln_compiled_t *c, const guards *gd)
{
    char b[160];
    for (int i = 0; i < gd->n; i++)
        fprintf(f, "%sinput %d is %s on %s\n", prefix, i, kiln__meta_str(&gd->m[i], b, sizeof b),
                ((const kiln__backend *)gd->device[i])->name);
    fprintf(f, "%sgrad mode is %s\n", prefix, gd->grad_mode ? "on" : "off");
    for (int i = 0; i < c->n_attrs; i++) {
        attr_str(gd->attr[i], c->attrs[i].n, b, sizeof b);
        fprintf(f, "%sattribute %s is %s\n", prefix, c->attrs[i].name, b);
    }
    int rg = 0;
    for (int i = 0; i < gd->n_cap; i++) rg += gd->cap_rg[i];
    fprintf(f, "%s%d captured tensors, %d of them requiring gradients\n", prefix, gd->n_cap, rg);
}

kiln_status kiln_compiled_guard(kiln_compiled_t *c, const char *name, const void *ptr, size_t n)
{
    if (!c || !name || !ptr) return kiln__err(KILN_ERR_ARG, "compiled_guard: NULL argument");
    if (n < 1 || n > ATTR_BYTES)
        return kiln__err(KILN_ERR_ARG, "compiled_guard: attribute %s is %zu bytes (1..%d)", name, n, ATTR_BYTES);
    if (c->n_attrs == MAX_ATTRS)
        return kiln__err(KILN_ERR_ARG, "compiled_guard: %s already guards %d attributes, the most it can", c->name,
                         MAX_ATTRS);
    if (c->calls)
        return kiln__err(KILN_ERR_ARG, "compiled_guard: %s was already called; declare attribute %s before the first "
                         "call", c->name, name);
    attr *a = &c->attrs[c->n_attrs++];
    snprintf(a->name, sizeof a->name, "%s", name);
    a->ptr = ptr;
    a->n = n;
    return KILN_OK;
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
    c->limit = (int)kiln__env_int(KILN__ENV_RECOMPILE_LIMIT);
    if (!(c->graphs = calloc((size_t)c->limit, sizeof *c->graphs))) {
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
        kiln__program_free(c->graphs[i].prog);
        kiln_graph_free(c->graphs[i].graph);
        guards_free(&c->graphs[i].g);
    }
    free(c->graphs);
    free(c);
}

/* What a compiled graph cannot do for this call (the function run eagerly can). prog:
 * the program the call would run; NULL when it would capture and compile first (or
 * run an interpreted graph, for which capturing is false). */
static kiln_status refused(const kiln_compiled_t *c, kiln_tensor_t *const *in, int n_in, const kiln__program *prog,
                           bool capturing)
{
    /* A replay being recorded notes every launch, the program's generated kernels too
     * (program.c), but not a capture and compile (the folding pass runs ops of its own)
     * nor an overlapped collective, which the program starts and finishes itself. */
    if (kiln_replay_recording() && capturing)
        return kiln__err(KILN_ERR_UNSUPPORTED, "compiled_call: %s would capture and compile inside kiln_replay_record; "
                         "call it once on inputs of these shapes before recording", c->name);
    if (kiln_replay_recording() && prog && prog->n_overlapped)
        return kiln__err(KILN_ERR_UNSUPPORTED, "compiled_call: %s overlaps collectives, which a replay cannot hold; "
                         "record it with KILN_OPT_COMPILE_OVERLAP=0, or do not record it", c->name);
    /* A graph computes gradients only for the tensors it captures (autograd does not see
     * its arguments), so an argument that wants one would silently get none. */
    for (int i = 0; i < n_in && kiln_grad_enabled(); i++)
        if (kiln_tensor_requires_grad(in[i]))
            return kiln__err(KILN_ERR_UNSUPPORTED, "compiled_call: %s input %d requires gradients, which a compiled "
                             "graph computes only for the tensors the function reads itself (its parameters); pass "
                             "kiln_detach(x), or let the function read x as a captured tensor", c->name, i);
    return KILN_OK;
}

/* Past the limit: the function run eagerly (said once, with why no graph fits: all). */
static kiln_status call_eagerly(kiln_compiled_t *c, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out,
                                int max_out, int *n_out, const char *all)
{
    if (!c->warned) {
        fprintf(stderr, "kiln: %s was captured %d times (KILN_RECOMPILE_LIMIT); calls that match none of those graphs "
                "now run eagerly (%s)\n", c->name, c->limit, all);
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

/* Captures the function again for guards now (taken) and compiles it as graph number
 * c->n_graphs, with KILN_DEBUG_DIR's files under DIR/<name>-<n>/. */
static kiln_status capture_new(kiln_compiled_t *c, kiln_tensor_t *const *in, int n_in, guards *now)
{
    kiln_graph_t *g;
    kiln_status s = kiln_graph_capture(c->fn, c->ctx, in, n_in, &g);
    if (s == KILN_OK && (s = capture_guards(g, now)) != KILN_OK) kiln_graph_free(g);
    if (s != KILN_OK) return s;
    char dir[1024] = "";
    const char *dbg = kiln__env_str(KILN__ENV_DEBUG_DIR);
    if (dbg) {
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
        guards_free(now);
        kiln_graph_free(g);
        return s;
    }
    if (*dir && (f = kiln__debug_open(dir, "guards.txt"))) {
        print_guards(f, "", c, now);
        fclose(f);
    }
    if (kiln__log_on("guards")) {
        char prefix[128];
        snprintf(prefix, sizeof prefix, "kiln [guards] %s graph %d: ", c->name, c->n_graphs);
        print_guards(stderr, prefix, c, now);
    }
    c->graphs[c->n_graphs].prog = prog;
    c->graphs[c->n_graphs].graph = g;
    c->graphs[c->n_graphs++].g = *now;
    return KILN_OK;
}

/* Graph k (or its program) on in. */
static kiln_status run_graph(const kiln_compiled_t *c, int k, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out,
                             int max_out, int *n_out)
{
    return c->graphs[k].prog ? kiln__program_run(c->graphs[k].prog, in, n_in, out, max_out, n_out)
                             : kiln_graph_run(c->graphs[k].graph, in, n_in, out, max_out, n_out);
}

kiln_status kiln_compiled_call(kiln_compiled_t *c, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int max_out,
                               int *n_out)
{
    if (!c || !n_out || (n_in && !in)) return kiln__err(KILN_ERR_ARG, "compiled_call: NULL argument");
    if (n_in > KILN_GRAPH_MAX_IN)
        return kiln__err(KILN_ERR_ARG, "compiled_call: %d inputs, at most %d are guarded", n_in, KILN_GRAPH_MAX_IN);
    for (int i = 0; i < n_in; i++)
        if (!in[i]) return kiln__null_arg("compiled_call");
    c->calls++;
    guards now;
    guards_of(c, in, n_in, &now);
    /* Each graph, the newest first; why each did not fit goes into all, as far as the
     * message holds them. */
    char why[2 * (2 * ATTR_BYTES + 4) + 100] = "", all[1024] = "";
    for (int k = c->n_graphs - 1, len = 0; k >= 0; k--) {
        if (!broken(c, &c->graphs[k].g, &now, why, sizeof why)) {
            kiln_status r = refused(c, in, n_in, c->graphs[k].prog, false);
            if (r != KILN_OK) return r;
            c->hits++;
            return run_graph(c, k, in, n_in, out, max_out, n_out);
        }
        if (len < (int)sizeof all - 16)
            len += snprintf(all + len, sizeof all - (size_t)len, "%sgraph %d: %s", len ? "; " : "", k, why);
    }
    if (c->n_graphs == c->limit) return call_eagerly(c, in, n_in, out, max_out, n_out, all);
    if (c->n_graphs > 0) {
        c->recompiles++;
        if (kiln__log_on("recompiles")) fprintf(stderr, "kiln [recompiles] %s: capturing again: %s\n", c->name, all);
    }
    kiln_status s = refused(c, in, n_in, NULL, true);
    if (s == KILN_OK) s = capture_new(c, in, n_in, &now);
    return s == KILN_OK ? run_graph(c, c->n_graphs - 1, in, n_in, out, max_out, n_out) : s;
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
    const kiln__program *p = c->graphs[graph].prog;
    int n_ops = 0;
    for (int t = 0; p && t < p->n_steps; t++) n_ops += p->steps[t].kind == STEP_OP;
    if (kernels) *kernels = p ? p->n_k : 0;
    if (ops) *ops = n_ops;
    if (planned_peak) *planned_peak = p ? p->planned_peak : 0;
    if (eager_peak) *eager_peak = p ? p->eager_peak : 0;
    return KILN_OK;
}
