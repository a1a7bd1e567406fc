/* Running a compiled program: its steps in order, each either one op through dispatch
 * (as the graph interpreter runs it) or a generated kernel on freshly allocated
 * outputs: launched over the thread pool on the cpu, through the backend's launch on a
 * device (a work-item per task). A value is freed after the last step that reads
 * it; the graph's outputs and leaf gradients are kept. */
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/threadpool.h"
#include "core/util.h"

typedef struct {
    void (*fn)(char *const *b, const int64_t *sz, int64_t t0, int64_t t1);
    char *const *b;
    const int64_t *sz;
} launch_ctx;

static void launch_range(void *ctx, int64_t t0, int64_t t1)
{
    const launch_ctx *l = ctx;
    l->fn(l->b, l->sz, t0, t1);
}

/* A device kernel's arguments: each buffer (the backend passes its own form of the
 * address), then the task count, then, for OpenCL with symbolic sizes, the device copy
 * of its sizes (p->dsz; the C reads them from sz[]); one work-item per task. Shared
 * with eager.c. */
kiln_status kiln__device_launch(const kiln__program *p, const kc_kernel *k, char *const *b)
{
    void *dsz = p->dsz ? p->dsz[k - p->k] : NULL;
    int na = k->n_buf + 1 + (dsz != NULL);
    kiln__karg args[66], *a = args;
    if (na > 66 && !(a = malloc(sizeof *a * (size_t)na))) return kiln__err(KILN_ERR_OOM, "compile: out of memory");
    for (int i = 0; i < k->n_buf; i++) a[i] = (kiln__karg){KILN__KARG_BUF, b[i], 0, 0};
    a[k->n_buf] = (kiln__karg){KILN__KARG_I64, NULL, k->tasks, 0};
    if (dsz) a[k->n_buf + 1] = (kiln__karg){KILN__KARG_BUF, dsz, 0, 0};
    size_t grid = (size_t)k->tasks;
    kiln_status s = kiln__be_launch(p->be, p->kern[k - p->k], a, na, &grid, NULL, 1);
    if (a != args) free(a);
    return s;
}

/* Kernel k on buffers b: on the device, or over the thread pool. */
kiln_status kiln__program_launch(const kiln__program *p, const kc_kernel *k, char *const *b)
{
    if (p->kern) return kiln__device_launch(p, k, b);
    launch_ctx l = {k->fn, b, k->sz};
    kiln__parallel_for(k->tasks, k->grain, launch_range, &l);
    return KILN_OK;
}

/* A launch as a replay being recorded keeps it: the kernel and its buffers' addresses,
 * which the recording's pool keeps in place (src/graph/replay.c). The program must
 * outlive the replay, as everything else the recorded function touched. */
typedef struct {
    const kiln__program *p;
    const kc_kernel *k;
    char *b[];
} saved_launch;

static kiln_status run_saved(void *ctx)
{
    const saved_launch *l = ctx;
    return kiln__program_launch(l->p, l->k, l->b);
}

void kiln__program_note_launch(const kiln__program *p, const kc_kernel *k, char *const *b)
{
    saved_launch *l = malloc(sizeof *l + sizeof(char *) * (size_t)k->n_buf);
    if (!l) return kiln__replay_note_call(p->be, NULL, NULL, NULL); /* the recording fails: out of memory */
    l->p = p;
    l->k = k;
    memcpy(l->b, b, sizeof(char *) * (size_t)k->n_buf);
    kiln__replay_note_call(p->be, run_saved, l, free);
}

kiln_status kiln__program_bind(kiln__program *p, const kc_kernel *k, kiln_tensor_t **rt, char **b, int pending)
{
    kiln_graph_t *g = p->g;
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < k->n_buf; i++) {
        if (k->buf[i].value == pending && !k->buf[i].output) {
            b[i] = NULL;
            continue;
        }
        const kc_buf *kb = &k->buf[i];
        const kiln__meta *m = &g->v[kb->value].meta;
        if (kb->output && !kb->inplace) {
            /* The buffer of an input read for the last time here (planned in fuse.c),
             * when this run's rt holds the only reference to it and to its storage. */
            kiln_tensor_t *d = kb->reuse ? rt[kb->reuse] : NULL;
            if (d && atomic_load(&d->refcount) == 1 && atomic_load(&d->st->refcount) == 1 && d->offset == 0 &&
                kiln__is_contiguous(d)) {
                rt[kb->value] = kiln_tensor_retain(d);
                b[i] = kiln__data(d);
                continue;
            }
            rt[kb->value] = kiln__tensor_alloc(p->be, m->dtype, m->shape, m->ndim);
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
    /* A tensor written in place must share no bytes with another buffer of the kernel
     * (an argument can be any tensor, even one the graph captured). */
    for (int i = 0; s == KILN_OK && i < k->n_buf; i++) {
        if (!k->buf[i].inplace) continue;
        for (int j = 0; s == KILN_OK && j < k->n_buf; j++)
            if (j != i && kiln__tensors_overlap(rt[k->buf[i].value], rt[k->buf[j].value]))
                s = kiln__err(KILN_ERR_UNSUPPORTED, "compile: kernel %s writes %%%d in place but %%%d shares its memory "
                              "(an argument that is also a captured tensor?); run it eagerly", k->name,
                              k->buf[i].value, k->buf[j].value);
    }
    return s;
}

static kiln_status run_kernel(kiln__program *p, const kc_kernel *k, kiln_tensor_t **rt)
{
    char *bufs[64], **b = bufs;
    if (k->n_buf > 64 && !(b = malloc(sizeof *b * (size_t)k->n_buf))) return kiln__err(KILN_ERR_OOM, "compile: out of memory");
    kiln_status s = kiln__program_bind(p, k, rt, b, 0);
    if (s == KILN_OK && k->tasks > 0) s = kiln__program_launch(p, k, b);
    if (s == KILN_OK && k->tasks > 0 && kiln_replay_recording()) kiln__program_note_launch(p, k, b);
    if (b != bufs) free(b);
    return s;
}

/* A collective in flight (kc_step.until): its work, and its tensor held until it is
 * finished, whatever the liveness says. */
typedef struct {
    void *work;
    const kiln__collective_ops *ops;
    kiln_tensor_t *t;
    int until;
} in_flight;

static kiln_status start_collective(const kiln_graph_t *g, const kc_step *st, kiln__graph_frame *f, in_flight *fl,
                                    int *n_fl)
{
    const node *n = &g->nd[st->index];
    const kiln__collective_ops *c = n->attrs.op.collective.ops;
    kiln_tensor_t *t = f->rt[n->in[0]];
    if (!t) return kiln__err(KILN_ERR_INTERNAL, "compile: allreduce_ of value %%%d before it exists", n->in[0]);
    void *w = NULL;
    kiln_status s = c->start(n->attrs.op.collective.group, t, n->attrs.op.collective.reduce, &w);
    if (w) fl[(*n_fl)++] = (in_flight){w, c, kiln_tensor_retain(t), st->until};
    return s;
}

/* Finishes those due before step t (all of them for t < 0), in the order they started;
 * the first failure, and its message, are kept. A collective left posted by a failed
 * group keeps its tensor (MPI may still write it). */
static kiln_status finish_collectives(in_flight *fl, int *n_fl, int t, kiln_status s)
{
    char first[512] = "";
    if (s != KILN_OK) snprintf(first, sizeof first, "%s", kiln_last_error());
    int kept = 0;
    for (int i = 0; i < *n_fl; i++) {
        if (t >= 0 && fl[i].until != t) {
            fl[kept++] = fl[i];
            continue;
        }
        bool posted = false;
        kiln_status w = fl[i].ops->finish(fl[i].work, &posted);
        if (!posted) kiln_tensor_free(fl[i].t);
        if (s == KILN_OK && w != KILN_OK) snprintf(first, sizeof first, "%s", kiln_last_error());
        if (s == KILN_OK) s = w;
    }
    *n_fl = kept;
    if (s != KILN_OK) kiln__err(s, "%s", first); /* a later failure may have replaced it */
    return s;
}

kiln_status kiln__program_run(kiln__program *p, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out,
                              int max_out, int *n_out)
{
    kiln_graph_t *g = p->g;
    kiln__graph_frame f;
    kiln_status s = kiln__graph_frame_begin(g, in, n_in, out, max_out, n_out, &f);
    /* The profile leaves the first run out: it pays for first-touch page faults. */
    bool want_prof = kiln__log_on("profile");
    if (want_prof && !p->prof && !(p->prof = calloc((size_t)p->n_steps, sizeof *p->prof))) want_prof = false;
    bool timed = want_prof && p->prof_runs > 0;
    in_flight fl_stack[16], *fl = fl_stack;
    int n_fl = 0;
    if (p->n_overlapped > 16 && !(fl = malloc(sizeof *fl * (size_t)p->n_overlapped)))
        s = kiln__err(KILN_ERR_OOM, "compile: out of memory");
    for (int t = 0; s == KILN_OK && t < p->n_steps; t++) {
        const kc_step *st = &p->steps[t];
        double t0 = timed ? kiln__now_s() : 0;
        if (n_fl) {
            s = finish_collectives(fl, &n_fl, t, s);
            if (timed) { /* the wait is its own line in the profile, not the step's */
                double t1 = kiln__now_s();
                p->prof_wait += t1 - t0;
                t0 = t1;
            }
        }
        if (s != KILN_OK) break;
        if (st->until) {
            s = start_collective(g, st, &f, fl, &n_fl);
            if (s == KILN_OK) kiln__graph_release(g, &f, g->nd[st->index].in[0], p->last, t + 1);
        } else if (st->kind == STEP_OP && st->epi) {
            s = kiln__program_run_epilogue(p, t, &f); /* and the next step's kernel */
        } else if (st->kind == STEP_OP) {
            s = kiln__graph_run_node(g, st->index, &f, p->last, t + 1);
        } else {
            const kc_kernel *k = &p->k[st->index];
            if (t == 0 || !p->steps[t - 1].epi) s = run_kernel(p, k, f.rt); /* else it ran with the matmul */
            for (int i = 0; s == KILN_OK && i < k->n_buf; i++)
                if (!k->buf[i].output || k->buf[i].inplace) /* a view written in place holds its root */
                    kiln__graph_release(g, &f, k->buf[i].value, p->last, t + 1);
        }
        /* Those in flight advance between steps (MPI moves data only inside its calls). */
        for (int i = 0; s == KILN_OK && i < n_fl; i++) s = fl[i].ops->progress(fl[i].work);
        if (timed) p->prof[t] += kiln__now_s() - t0;
    }
    double t0 = timed ? kiln__now_s() : 0;
    s = finish_collectives(fl, &n_fl, -1, s);
    if (timed) p->prof_wait += kiln__now_s() - t0;
    if (fl != fl_stack) free(fl);
    if (want_prof && s == KILN_OK) p->prof_runs++;
    return f.rt ? kiln__graph_frame_end(g, &f, s, out, n_out) : s;
}

void kiln__program_print(const kiln__program *p, FILE *f)
{
    const kiln_graph_t *g = p->g;
    int ops = 0;
    for (int t = 0; t < p->n_steps; t++) ops += p->steps[t].kind == STEP_OP;
    fprintf(f, "%d steps: %d kernels, %d ops through dispatch; intermediates planned peak %.2f MiB, eager %.2f MiB",
            p->n_steps, p->n_k, ops, (double)p->planned_peak / 1048576.0, (double)p->eager_peak / 1048576.0);
    if (p->n_overlapped)
        fprintf(f, "; %d collective(s) overlapped with the steps after them, %d moved up", p->n_overlapped, p->n_hoisted);
    if (p->n_epilogues) fprintf(f, "; %d kernel(s) as matmul epilogues", p->n_epilogues);
    fprintf(f, "\n");
    for (int t = 0; t < p->n_steps; t++) {
        const kc_step *st = &p->steps[t];
        if (st->kind == STEP_OP) {
            const node *n = &g->nd[st->index];
            fprintf(f, "  op     %s ->", kiln__ops[n->op].name);
            for (int j = 0; j < n->n_out; j++) fprintf(f, " %%%d", n->out[j]);
            if (st->epi) fprintf(f, " (the next kernel runs inside its GEMM, an epilogue)");
            if (st->until == p->n_steps) fprintf(f, " (started; finished at the end)");
            else if (st->until) fprintf(f, " (started; finished before step %d)", st->until);
            fprintf(f, "\n");
            continue;
        }
        const kc_kernel *k = &p->k[st->index];
        fprintf(f, "  kernel %s [%d ops: %s] reads", k->name, k->n_ops, k->ops);
        for (int i = 0; i < k->n_buf; i++)
            if (!k->buf[i].output) fprintf(f, " %%%d", k->buf[i].value);
        fprintf(f, " writes");
        for (int i = 0; i < k->n_buf; i++)
            if (k->buf[i].output) {
                fprintf(f, " %%%d%s", k->buf[i].value, k->buf[i].inplace ? " (in place)" : "");
                if (k->buf[i].reuse) fprintf(f, " (over %%%d)", k->buf[i].reuse);
            }
        fprintf(f, "\n");
    }
}

static const char *step_name(const kiln__program *p, int t)
{
    const kc_step *st = &p->steps[t];
    return st->kind == STEP_OP ? kiln__ops[p->g->nd[st->index].op].name : p->k[st->index].name;
}

/* Matmul steps of one shape: batch x M x N x K, whether each operand is read down its
 * columns (A^T, B^T: its last dim not the contiguous one), and the type. */
typedef struct {
    int64_t b, m, n, k;
    bool at, bt;
    kiln_dtype dt;
    double s;
    int count;
} mm_shape;

static bool read_transposed(const kiln_graph_t *g, int v)
{
    int64_t st[KILN_MAX_DIMS];
    kiln__compile_value_strides(g, v, st);
    int d = g->v[v].meta.ndim;
    return d >= 2 && st[d - 1] != 1 && st[d - 2] == 1;
}

/* The matmul steps totalled by shape, the slowest first (at most 15): where a step's
 * GEMM time goes, to compare one GEMM with another in the step itself
 * (bench/step_gemms.sh). */
static void profile_matmuls(const kiln__program *p, double runs, double total, FILE *f)
{
    mm_shape *sh = malloc(sizeof *sh * (size_t)(p->n_steps > 0 ? p->n_steps : 1));
    int n = 0;
    if (!sh) return;
    for (int t = 0; t < p->n_steps; t++) {
        if (p->steps[t].kind != STEP_OP) continue;
        const node *nd = &p->g->nd[p->steps[t].index];
        if (nd->op != KILN_OP_MATMUL || nd->n_in < 2) continue;
        const kiln__meta *a = &p->g->v[nd->in[0]].meta, *b = &p->g->v[nd->in[1]].meta,
                         *c = &p->g->v[nd->out[0]].meta;
        if (a->ndim < 2 || b->ndim < 2 || c->ndim < 2) continue;
        mm_shape x = {1, c->shape[c->ndim - 2], c->shape[c->ndim - 1], a->shape[a->ndim - 1],
                      read_transposed(p->g, nd->in[0]), read_transposed(p->g, nd->in[1]), a->dtype, p->prof[t], 1};
        for (int i = 0; i < c->ndim - 2; i++) x.b *= c->shape[i]; /* the broadcast batch */
        int i = 0;
        while (i < n && !(sh[i].b == x.b && sh[i].m == x.m && sh[i].n == x.n && sh[i].k == x.k && sh[i].at == x.at &&
                          sh[i].bt == x.bt && sh[i].dt == x.dt))
            i++;
        if (i == n) sh[n++] = x;
        else sh[i].s += x.s, sh[i].count++;
    }
    int top = n < 15 ? n : 15;
    if (top) fprintf(f, "kiln [profile]   matmuls by shape (batch x M x N x K), the %d slowest:\n", top);
    for (int i = 0; i < top; i++) {
        for (int j = i + 1; j < n; j++)
            if (sh[j].s > sh[i].s) {
                mm_shape y = sh[i];
                sh[i] = sh[j];
                sh[j] = y;
            }
        char dims[96];
        snprintf(dims, sizeof dims, "%lldx%lldx%lldx%lld %s %s %s", (long long)sh[i].b, (long long)sh[i].m,
                 (long long)sh[i].n, (long long)sh[i].k, sh[i].at ? "A^T" : "A", sh[i].bt ? "B^T" : "B",
                 kiln_dtype_name(sh[i].dt));
        fprintf(f, "kiln [profile]   matmul %-36s x%-4d %8.2f ms %5.1f%%\n", dims, sh[i].count, 1e3 * sh[i].s / runs,
                100 * sh[i].s / total);
    }
    free(sh);
}

void kiln__program_profile_print(const kiln__program *p, FILE *f)
{
    double total = 0, kern = 0, runs = (double)(p->prof_runs - 1); /* the first is not timed */
    for (int t = 0; t < p->n_steps; t++) {
        total += p->prof[t];
        if (p->steps[t].kind == STEP_KERNEL) kern += p->prof[t];
    }
    total += p->prof_wait;
    if (total <= 0) return;
    fprintf(f, "kiln [profile] %d steps, %lld runs after the first: %.2f ms a run; generated kernels %.2f ms (%.1f%%)%s\n",
            p->n_steps, (long long)p->prof_runs - 1, 1e3 * total / runs, 1e3 * kern / runs, 100 * kern / total,
            p->kern ? " (device launches are asynchronous: a step's time is its enqueue plus any wait)" : "");
    if (p->n_overlapped)
        fprintf(f, "kiln [profile]   waiting for %d overlapped collective(s) to finish %8.2f ms %5.1f%%\n",
                p->n_overlapped, 1e3 * p->prof_wait / runs, 100 * p->prof_wait / total);
    /* Ops through dispatch, totalled by op. */
    double by_op[KILN__OP_MAX] = {0};
    int n_by_op[KILN__OP_MAX] = {0};
    for (int t = 0; t < p->n_steps; t++)
        if (p->steps[t].kind == STEP_OP) {
            int op = (int)p->g->nd[p->steps[t].index].op;
            by_op[op] += p->prof[t];
            n_by_op[op]++;
        }
    for (int op = 0; op < kiln__op_total(); op++)
        if (n_by_op[op])
            fprintf(f, "kiln [profile]   op %-24s x%-4d %8.2f ms %5.1f%%\n", kiln__ops[op].name, n_by_op[op],
                    1e3 * by_op[op] / runs, 100 * by_op[op] / total);
    profile_matmuls(p, runs, total, f);
    int *ord = malloc(sizeof *ord * (size_t)p->n_steps);
    if (!ord) return;
    /* Twice: the slowest steps of any kind, then the slowest generated kernels. */
    for (int pass = 0; pass < 2; pass++) {
        int n = 0;
        for (int t = 0; t < p->n_steps; t++)
            if (pass == 0 || p->steps[t].kind == STEP_KERNEL) ord[n++] = t;
        int top = n < 15 ? n : 15;
        for (int i = 0; i < top; i++) /* the top few by selection: no need to sort them all */
            for (int j = i + 1; j < n; j++)
                if (p->prof[ord[j]] > p->prof[ord[i]]) {
                    int x = ord[i];
                    ord[i] = ord[j];
                    ord[j] = x;
                }
        if (top) fprintf(f, "kiln [profile]   the %d slowest %s:\n", top, pass ? "generated kernels" : "steps");
        for (int i = 0; i < top; i++)
            fprintf(f, "kiln [profile]   step %-4d %-48.48s %8.3f ms %5.1f%%\n", ord[i], step_name(p, ord[i]),
                    1e3 * p->prof[ord[i]] / runs, 100 * p->prof[ord[i]] / total);
    }
    free(ord);
}
