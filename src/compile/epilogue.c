/* Matmul epilogues on the cpu: a generated kernel that reads a bf16 matmul's result row
 * by row (the bias add and GELU after a linear layer, GELU's backward after the matmul
 * that makes its incoming gradient) runs inside the GEMM, on each work item's block of
 * rows as soon as it is rounded, while those rows are still in cache
 * (kiln__gemm_bf16_epilogue), instead of reading the whole result back from memory
 * after the matmul. The kernel computes what it would have computed after the matmul,
 * on the same rounded values: the results are the same bits.
 *
 * At build time (kiln__program_epilogues) the matmul step moves down to just before its
 * kernel, across the kernels and views between them (none of which reads the matmul's
 * result or writes in place, and a view reads no memory, so none can see the move),
 * and is marked. At run time
 * (kiln__program_run_epilogue) the kernel's buffers are bound first, the result's slot
 * left for the GEMM to fill; the GEMM runs the kernel's tasks for each block of rows;
 * when it cannot (columns in more than one round, too few rows for the threads, a
 * recorded replay, another backend), the kernel runs after the matmul as before. */
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/util.h"

/* The kernel's tasks per row of the result when kernel k reads value v (a contiguous
 * rows x cols result) row by row through every slot that holds it: case A, a domain
 * whose last dim is cols and whose outer dims make rows, each row `chunks` tasks; case
 * B, a 1-d domain of rows x cols split into pieces (no accumulators), which can be
 * split again into one task a row (the split is read from the sizes, so only with
 * symbolic sizes). 0 when neither, or when v is read in any other way. */
static int64_t tasks_per_row(const kiln__program *p, const kc_kernel *k, int v, int64_t rows, int64_t cols, int *slot)
{
    *slot = -1;
    if (k->n_buf > 64) return 0; /* epi_rows copies the buffers on its stack */
    int slots = 0; /* that hold v: one, or it is read in another way too */
    for (int i = 0; i < k->n_buf; i++) {
        if (k->buf[i].inplace) return 0;
        if (k->buf[i].value == v) *slot = i, slots++;
    }
    if (slots != 1 || k->buf[*slot].output) return 0;
    int nd = k->ndim;
    int64_t outer = 1, want[KILN_MAX_DIMS], step = 1;
    for (int d = 0; d + 1 < nd; d++) outer *= k->dom[d];
    for (int d = nd - 1; d >= 0; d--) {
        want[d] = k->dom[d] == 1 ? 0 : step; /* a dim of size 1 is never stepped over */
        step *= k->dom[d];
    }
    for (int i = 0; i < k->n_e; i++) {
        const kc_expr *e = &k->e[i];
        if (e->kind != E_LOAD || e->buf != *slot) continue;
        for (int d = 0; d < nd; d++)
            if (e->st[d] != want[d] && k->dom[d] != 1) return 0;
    }
    if (nd >= 2 && k->dom[nd - 1] == cols && outer == rows) return k->chunks;
    if (nd == 1 && k->dom[0] == rows * cols && !k->n_acc && p->symbolic) return 1;
    return 0;
}

/* Kernel k split into one task per row of cols elements (case B above). */
static void split_by_rows(kc_kernel *k, int64_t rows, int64_t cols)
{
    k->chunks = rows;
    k->tasks = rows;
    k->grain = cols >= 16384 ? 1 : 16384 / cols;
    k->sz[KC_SZ_CHUNKS] = rows;
    k->sz[KC_SZ_PER] = cols;
}

void kiln__program_epilogues(kiln__program *p)
{
    const kiln_graph_t *g = p->g;
    if (p->kern || strcmp(p->be->name, "cpu")) return;
    for (int t = 0; t < p->n_steps; t++) {
        kc_step *st = &p->steps[t];
        if (st->epi || st->kind != STEP_OP || st->until || g->nd[st->index].op != KILN_OP_MATMUL) continue;
        int v = g->nd[st->index].out[0];
        const kiln__meta *m = &g->v[v].meta;
        if (m->dtype != KILN_DTYPE_BF16 || m->ndim < 2) continue;
        int64_t cols = m->shape[m->ndim - 1], rows = kiln__numel(m->ndim, m->shape) / (cols > 0 ? cols : 1);
        if (rows < 1 || cols < 1) continue;
        /* The first step after it that reads its result; those between must be kernels
         * that do not write in place (so that moving the matmul past them changes
         * nothing they see). */
        int u = t + 1;
        for (; u < p->n_steps; u++) {
            const kc_step *su = &p->steps[u];
            bool reads = false, inplace = false;
            if (su->kind == STEP_OP) {
                const node *n = &g->nd[su->index];
                for (int i = 0; i < n->n_in; i++) reads |= n->in[i] == v;
                if (!reads && (!kiln__ops[n->op].is_view || su->until)) break; /* an op between: the matmul stays */
            } else {
                const kc_kernel *k = &p->k[su->index];
                for (int i = 0; i < k->n_buf; i++) {
                    reads |= k->buf[i].value == v && !k->buf[i].output;
                    inplace |= k->buf[i].inplace;
                }
                if (!reads && inplace) break;
            }
            if (reads) break;
        }
        if (u >= p->n_steps || p->steps[u].kind != STEP_KERNEL || p->steps[u].until) continue;
        /* An overlapped collective finishes before a step index (src/compile/overlap.c):
         * none may wait at a step the move shifts, or at the kernel, which runs inside
         * the matmul, a step earlier. */
        bool waits = false;
        for (int q = 0; q < p->n_steps && !waits; q++) waits = p->steps[q].until > t && p->steps[q].until <= u;
        if (waits) continue;
        kc_kernel *k = &p->k[p->steps[u].index];
        int slot;
        int64_t per = tasks_per_row(p, k, v, rows, cols, &slot);
        if (per == 0) continue;
        if (k->ndim == 1) split_by_rows(k, rows, cols);
        kc_step mm = *st;
        memmove(&p->steps[t], &p->steps[t + 1], sizeof *p->steps * (size_t)(u - 1 - t));
        mm.epi = slot + 1;
        p->steps[u - 1] = mm;
        p->n_epilogues++;
        t--; /* the step now at t (the one after it before) is looked at too */
    }
}

/* What the GEMM's rows callback needs: the kernel, its bound buffers (the result's slot
 * to fill from the GEMM's output), its sizes and tasks per row. */
typedef struct {
    const kc_kernel *k;
    char *const *b;
    int slot;
    int64_t per;
} epi_ctx;

static void epi_rows(const kiln__epilogue *e, int64_t r0, int64_t r1)
{
    const epi_ctx *c = e->ctx;
    char *b[64]; /* the bound buffers with the result's filled in, each caller its own copy (n_buf <= 64) */
    memcpy(b, c->b, sizeof *b * (size_t)c->k->n_buf);
    b[c->slot] = e->out;
    c->k->fn(b, c->k->sz, r0 * c->per, r1 * c->per);
}

kiln_status kiln__program_run_epilogue(kiln__program *p, int t, kiln__graph_frame *f)
{
    kiln_graph_t *g = p->g;
    const kc_step *st = &p->steps[t];
    const kc_kernel *k = &p->k[p->steps[t + 1].index];
    int v = g->nd[st->index].out[0];
    char *bufs[64], **b = bufs;
    if (k->n_buf > 64 && !(b = malloc(sizeof *b * (size_t)k->n_buf))) return kiln__err(KILN_ERR_OOM, "compile: out of memory");
    const kiln__meta *m = &g->v[v].meta;
    int64_t cols = m->shape[m->ndim - 1];
    epi_ctx c = {k, b, st->epi - 1, k->ndim == 1 ? 1 : k->chunks};
    kiln__epilogue e = {.rows = kiln__numel(m->ndim, m->shape) / cols, .cols = cols, .fn = epi_rows, .ctx = &c};
    kiln_status s = kiln__program_bind(p, k, f->rt, b, v);
    /* A replay being recorded keeps the kernel's launch as a call of its own. */
    bool offer = s == KILN_OK && k->tasks > 0 && !kiln_replay_recording();
    if (offer) kiln__epilogue_offer(&e);
    if (s == KILN_OK) s = kiln__graph_run_node(g, st->index, f, p->last, t + 1);
    kiln__epilogue_offer(NULL);
    if (s == KILN_OK && !f->rt[v]) s = kiln__err(KILN_ERR_INTERNAL, "compile: matmul %%%d made no result", v);
    if (s == KILN_OK) b[c.slot] = kiln__data(f->rt[v]);
    if (s == KILN_OK && !e.done && k->tasks > 0) {
        s = kiln__program_launch(p, k, b);
        if (s == KILN_OK && kiln_replay_recording()) kiln__program_note_launch(p, k, b);
    }
    if (b != bufs) free(b);
    return s;
}
