/* The compiler's driver: graph passes, then fusion into kernels, C generation, the
 * system compiler and the cache, each stage logged (KILN_LOGS=graph,fusion,code,perf)
 * and, with KILN_DEBUG_DIR, written beside the captured graph. */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/file.h"
#include "core/env.h"
#include "core/util.h"

static const char *ekind_name[] = {"load", "const", "index", "op", "acc"};

/* "[x0, x1, ...]" */
static void dims_print(FILE *f, const int64_t *x, int n)
{
    fputc('[', f);
    for (int d = 0; d < n; d++) fprintf(f, "%s%lld", d ? ", " : "", (long long)x[d]);
    fputc(']', f);
}

/* The loop IR of each kernel, one expression per line. */
static void ir_print(const kiln__program *p, FILE *f)
{
    for (int i = 0; i < p->n_k; i++) {
        const kc_kernel *k = &p->k[i];
        fprintf(f, "kernel %s: %s\n  domain ", k->name, k->ops);
        dims_print(f, k->dom, k->ndim);
        fprintf(f, ", %lld task(s), grain %lld\n", (long long)k->tasks, (long long)k->grain);
        for (int b = 0; b < k->n_buf; b++)
            fprintf(f, "  buf %d = %%%d %s %s\n", b, k->buf[b].value, kiln_dtype_name(k->buf[b].dt),
                    k->buf[b].inplace ? "in+out (in place)" : k->buf[b].output ? "out" : "in");
        for (int j = 0; j < k->n_e; j++) {
            const kc_expr *e = &k->e[j];
            fprintf(f, "  e%d = %s", j, ekind_name[e->kind]);
            if (e->kind == E_OP) {
                fprintf(f, " %s(", kiln__ops[e->op].name);
                for (int a = 0; a < e->n_arg; a++) fprintf(f, "%se%d", a ? ", " : "", e->arg[a]);
                fprintf(f, ")");
            } else if (e->kind == E_LOAD || e->kind == E_INDEX) {
                if (e->kind == E_LOAD) fprintf(f, " buf %d", e->buf);
                fprintf(f, " strides ");
                dims_print(f, e->st, k->ndim);
            } else if (e->kind == E_ACC) {
                fprintf(f, " %s(e%d) over the inner dim", kiln__ops[k->acc[e->buf].op].name, k->acc[e->buf].expr);
            } else {
                fprintf(f, " %g", e->kind == E_INDEX ? e->attrs.op.source.start : e->attrs.op.source.value);
            }
            fprintf(f, " %s%s phase %d\n", kiln_dtype_name(e->dt), e->row ? " row" : "", e->phase);
        }
        for (int s = 0; s < k->n_st; s++) {
            fprintf(f, "  store e%d -> buf %d strides ", k->st[s].expr, k->st[s].buf);
            dims_print(f, k->st[s].st, k->ndim);
            fprintf(f, "\n");
        }
    }
}

FILE *kiln__debug_open(const char *dir, const char *file)
{
    if (!dir || !*dir) return NULL;
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    /* (a FIFO there would block the compile; a link or a device is not ours to write) */
    if (kiln__file_check_target(path, "KILN_DEBUG_DIR") != KILN_OK) {
        fprintf(stderr, "kiln: %s\n", kiln_last_error());
        return NULL;
    }
    FILE *f = fopen(path, "w");
    if (!f) fprintf(stderr, "kiln: KILN_DEBUG_DIR: cannot write %s: %s\n", path, strerror(errno));
    return f;
}

void kiln__debug_dump(const char *dir, const char *file, const char *text, const kiln_graph_t *g,
                      const kiln__program *p)
{
    FILE *f = kiln__debug_open(dir, file);
    if (!f) return;
    if (text) fputs(text, f);
    if (g) kiln_graph_print(g, f);
    if (p) {
        kiln__program_print(p, f);
        ir_print(p, f);
    }
    fclose(f);
}

static atomic_bool warned_decompose; /* said once per process */

/* The stages are switches (KILN_OPT_COMPILE_<STAGE>, or KILN_COMPILE_DISABLE naming
 * them: src/core/opts.h), read at each compile, as are the sizes below. */
void kiln__compile_options(kc_options *o)
{
    int64_t bucket = (int64_t)(kiln__env_num(KILN__ENV_COMPILE_BUCKET_MB) * (1 << 20));
    *o = (kc_options){
        .decompose = kiln__opt(KILN__OPT_COMPILE_DECOMPOSE),
        .fold = kiln__opt(KILN__OPT_COMPILE_FOLD),
        .cse = kiln__opt(KILN__OPT_COMPILE_CSE),
        .dce = kiln__opt(KILN__OPT_COMPILE_DCE),
        .fusion = kiln__opt(KILN__OPT_COMPILE_FUSION),
        .codegen = kiln__opt(KILN__OPT_COMPILE_CODEGEN),
        .recompute = kiln__opt(KILN__OPT_COMPILE_RECOMPUTE),
        .symbolic = kiln__opt(KILN__OPT_COMPILE_SYMBOLIC),
        .slices = kiln__opt(KILN__OPT_COMPILE_SLICES),
        .coalesce = kiln__opt(KILN__OPT_COMPILE_COALESCE),
        .views = kiln__opt(KILN__OPT_COMPILE_VIEWS),
        .hoist = kiln__opt(KILN__OPT_COMPILE_HOIST),
        .overlap = kiln__opt(KILN__OPT_COMPILE_OVERLAP),
        .reuse = kiln__opt(KILN__OPT_COMPILE_REUSE),
        .epilogue = kiln__opt(KILN__OPT_COMPILE_EPILOGUE),
        .max_fuse = (int)kiln__env_int(KILN__ENV_COMPILE_MAX_FUSE),
        .bucket_bytes = bucket > 0 ? bucket : 1,
        .target = kiln__backend_at(0),
    };
    const char *dec = kiln__env_text(KILN__ENV_COMPILE_DECOMPOSE);
    if (!strcmp(dec, "all")) o->decompose_all = true;
    else if (strcmp(dec, "default") && !atomic_exchange(&warned_decompose, true))
        fprintf(stderr, "kiln: KILN_COMPILE_DECOMPOSE='%s' is not all or default; using default\n", dec);
}

/* The graph passes the options leave on, then the graph as they left it, into DIR and
 * the graph log. */
static kiln_status run_passes(kiln_graph_t *g, const kc_options *o, const char *dir, const char *name, int index)
{
    int dec = 0, folded = 0, merged = 0, scatters = 0, sunk = 0, removed = 0, reductions = 0, recomputed = 0, hoisted = 0;
    kiln_status s = KILN_OK;
    if (o->decompose) s = kiln__graph_decompose(g, o->decompose_all, &dec);
    if (s == KILN_OK && o->fold) s = kiln_graph_fold(g, &folded);
    if (s == KILN_OK && o->cse) s = kiln_graph_cse(g, &merged);
    if (s == KILN_OK && o->slices) s = kiln_graph_merge_slices(g, &scatters);
    if (s == KILN_OK && o->views) s = kiln_graph_sink_views(g, &sunk);
    if (s == KILN_OK && o->dce) s = kiln_graph_dce(g, &removed);
    if (s == KILN_OK && o->coalesce) s = kiln_graph_coalesce_allreduce(g, o->bucket_bytes, &reductions);
    if (s == KILN_OK && o->recompute) s = kiln_graph_recompute(g, &recomputed); /* after CSE, which would undo it */
    if (s == KILN_OK && o->hoist) s = kiln_graph_hoist_siblings(g, &hoisted); /* after recompute, whose copies it pairs */
    if (s != KILN_OK) return s;
    kiln__debug_dump(dir, "after_passes.txt", NULL, g, NULL);
    if (kiln__log_on("graph")) {
        fprintf(stderr, "kiln [graph] %s graph %d (%d ops after %d decomposed, %d folded, %d repeated merged, %d slice "
                "scatters merged, %d views sunk, %d dead removed, %d allreduces coalesced, %d recomputed, %d "
                "hoisted):\n", name, index, kiln_graph_num_ops(g), dec, folded, merged, scatters, sunk, removed,
                reductions, recomputed, hoisted);
        kiln_graph_print(g, stderr);
    }
    return KILN_OK;
}

/* The kernels are generated for the one backend the graph's tensors live on: C on the
 * cpu, the backend's own language (OpenCL C) on a device that compiles and launches
 * kernels. Tensors on two backends, or on a device without a kernel language, leave the
 * graph interpreted through the backends' kernels: NULL then, and the fusion log says
 * why. */
static kiln__backend *codegen_target(const kiln_graph_t *g, kiln__codegen_fn *gen, const char *name, int index)
{
    kiln__backend *cpu = kiln__backend_at(0), *dev = NULL;
    const char *why = NULL;
    for (int i = 1; i < g->n_v && !why; i++) {
        const value *v = &g->v[i];
        kiln__backend *be = v->kind == V_ARG ? v->be : v->kind == V_CONST ? v->t->st->be : NULL;
        if (!be) continue;
        if (!dev) dev = be;
        else if (be != dev) why = "tensors on two devices";
    }
    if (!dev) dev = cpu;
    *gen = dev == cpu ? kiln__codegen_c : kiln__codegen_for(dev);
    if (!why && dev != cpu && (!*gen || !kiln__be_can_compile(dev)))
        why = "a device without a kernel language the compiler generates";
    /* The CUDA dialect runs eager.c's one-op kernels on GPUs; whole graphs in it wait for
     * a GPU run of tests/test_compile.c (bench/gpu.sh) before they are switched on. */
    if (!why && *gen == kiln__codegen_cuda) why = "tensors on a CUDA device, where whole graphs are not generated yet";
    if (why && kiln__log_on("fusion"))
        fprintf(stderr, "kiln [fusion] %s graph %d: %s; the graph is interpreted through their kernels\n", name, index,
                why);
    return why ? NULL : dev;
}

kiln_status kiln__compile_graph(kiln_graph_t *g, const char *dir, const char *name, int index, kiln__program **out)
{
    *out = NULL;
    kc_options o;
    kiln__compile_options(&o);
    double t0 = kiln__now_s();
    kiln_status s = run_passes(g, &o, dir, name, index);
    if (s != KILN_OK) return s;
    double t1 = kiln__now_s();
    kiln__codegen_fn gen;
    if (!o.codegen || !(o.target = codegen_target(g, &gen, name, index))) return KILN_OK; /* interpreted */
    if (dir) { /* the loop IR before fusion: every fusible op its own kernel */
        kc_options one = o;
        one.fusion = false;
        kiln__program *p1;
        if (kiln__program_build(g, &one, &p1) == KILN_OK) kiln__debug_dump(dir, "loop_ir_before_fusion.txt", NULL, NULL, p1);
        if (p1) kiln__program_free(p1);
    }
    kiln__program *p;
    if ((s = kiln__program_build(g, &o, &p)) != KILN_OK) return s;
    double t2 = kiln__now_s();
    kiln__debug_dump(dir, "loop_ir_after_fusion.txt", NULL, NULL, p);
    if (kiln__log_on("fusion")) {
        fprintf(stderr, "kiln [fusion] %s graph %d: ", name, index);
        kiln__program_print(p, stderr);
    }
    char *src = NULL;
    if ((s = gen(p, &src)) == KILN_OK) {
        if (kiln__log_on("code")) fprintf(stderr, "kiln [code] %s graph %d:\n%s", name, index, src);
        s = o.target == kiln__backend_at(0) ? kiln__jit_load(p, src, dir) : kiln__device_load(p, src, dir);
        free(src);
    }
    if (s != KILN_OK) {
        kiln__program_free(p);
        return s;
    }
    double t3 = kiln__now_s();
    if (kiln__log_on("perf"))
        fprintf(stderr, "kiln [perf] %s graph %d: passes %.1f ms, fusion %.1f ms, codegen+compile+load %.1f ms; %d kernels, "
                "intermediates planned peak %.2f MiB vs eager %.2f MiB\n", name, index, 1e3 * (t1 - t0), 1e3 * (t2 - t1),
                1e3 * (t3 - t2), p->n_k, (double)p->planned_peak / 1048576.0, (double)p->eager_peak / 1048576.0);
    *out = p;
    return KILN_OK;
}
