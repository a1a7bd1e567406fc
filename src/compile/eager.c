/* Eager ops on a backend that compiles kernels from source (OpenCL; CUDA next): an op
 * the backend has no kernel of its own for is captured as a one-op graph, lowered and
 * fused like any graph (so softmax or layer norm, decomposed, become one kernel), and
 * generated in the backend's language; the kernels are compiled once per (op,
 * attributes, input dtypes, shapes and strides, device) and kept for the process, the
 * backend keeping their binaries on disk. An op the lowering cannot take (matmul,
 * indexing, an in-place update) is reported as not handled, and dispatch then runs it
 * on the cpu with copies. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "compile/compile_impl.h"
#include "core/cache.h"
#include "core/intercept.h"
#include "core/opts.h"
#include "kiln/ops.h"

typedef struct entry {
    uint64_t hash;
    bool ok; /* false: the op does not lower; dispatch falls back */
    kiln_graph_t *g;
    kiln__program *p;
    struct entry *next;
    size_t key_n;
    unsigned char key[];
} entry;

#define N_BUCKETS 1024
static entry *buckets[N_BUCKETS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct {
    unsigned char b[2048];
    size_t n;
    bool overflow;
} keybuf;

static void key_add(keybuf *k, const void *p, size_t n)
{
    if (k->n + n > sizeof k->b) {
        k->overflow = true;
        return;
    }
    memcpy(k->b + k->n, p, n);
    k->n += n;
}

typedef struct {
    kiln__op_id op;
    const kiln__attrs *a;
} one_op;

static kiln_status one_op_fn(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    const one_op *o = ctx;
    kiln_tensor_t *res[KILN__MAX_OUT] = {0};
    kiln_status s = kiln__dispatch(o->op, in, n_in, o->a, res);
    int n = kiln__ops[o->op].n_out;
    for (int j = 0; j < n; j++) out[j] = s == KILN_OK ? kiln__scoped(res[j]) : NULL;
    *n_out = s == KILN_OK ? n : 0;
    return s;
}

/* Captures, lowers, generates and compiles; e->ok says whether all of it worked. */
static kiln_status build(entry *e, kiln__backend *be, kiln__op_id op, kiln_tensor_t *const *in, int n_in,
                         const kiln__attrs *a)
{
    one_op o = {op, a};
    kiln_status s = kiln__graph_capture_as(one_op_fn, &o, in, n_in, true, &e->g);
    if (s != KILN_OK) return s;
    kc_options opt;
    kiln__compile_options(&opt);
    opt.target = be;
    opt.reuse = false; /* eager's one-op programs allocate their outputs as dispatch does */
    if (opt.decompose && (s = kiln__graph_decompose(e->g, opt.decompose_all, NULL)) != KILN_OK) return s;
    if ((s = kiln__program_build(e->g, &opt, &e->p)) != KILN_OK) return s;
    const kiln__program *p = e->p;
    /* Only kernels (and views between them): anything else is not this path's. */
    for (int t = 0; t < p->n_steps; t++)
        if (p->steps[t].kind == STEP_OP && !kiln__ops[e->g->nd[p->steps[t].index].op].is_view) return KILN_OK;
    for (int j = 0; j < e->g->n_outs; j++) {
        bool written = false;
        for (int i = 0; i < p->n_k && !written; i++)
            for (int b = 0; b < p->k[i].n_buf && !written; b++)
                written = p->k[i].buf[b].output && p->k[i].buf[b].value == e->g->outs[j];
        if (!written) return KILN_OK;
    }
    kiln__codegen_fn gen = kiln__codegen_for(be);
    char *src = NULL;
    if (!gen) return KILN_OK; /* a language the compiler has no generator for */
    if ((s = gen(p, &src)) != KILN_OK) return s;
    if (kiln__log_on("code")) fprintf(stderr, "kiln [code] %s on %s:\n%s", kiln__ops[op].name, be->name, src);
    s = kiln__device_load(e->p, src, NULL); /* e->p->be is be: the options' target */
    free(src);
    e->ok = s == KILN_OK;
    return s;
}

static kiln_status run(const entry *e, kiln__backend *be, kiln_tensor_t *const *in, kiln_tensor_t *const *out)
{
    const kiln_graph_t *g = e->g;
    const kiln__program *p = e->p;
    kiln_tensor_t **rt = calloc((size_t)g->n_v, sizeof *rt + sizeof(bool));
    if (!rt) return kiln__err(KILN_ERR_OOM, "compile: out of memory");
    bool *mine = (bool *)(rt + g->n_v); /* made here, freed here */
    for (int i = 1; i < g->n_v; i++)
        if (g->v[i].kind == V_ARG) rt[i] = in[g->v[i].index];
        else if (g->v[i].kind == V_CONST) rt[i] = g->v[i].t;
    for (int j = 0; j < g->n_outs; j++) rt[g->outs[j]] = out[j];
    kiln_status s = KILN_OK;
    for (int t = 0; s == KILN_OK && t < p->n_steps; t++) {
        const kc_step *st = &p->steps[t];
        if (st->kind == STEP_OP) { /* a view */
            const node *n = &g->nd[st->index];
            kiln_tensor_t *ins[KILN_OP_MAX_IN], *res[KILN__MAX_OUT] = {0};
            for (int i = 0; i < n->n_in && i < KILN_OP_MAX_IN; i++) ins[i] = rt[n->in[i]];
            s = kiln__dispatch(n->op, ins, n->n_in, &n->attrs, res);
            for (int j = 0; s == KILN_OK && j < n->n_out; j++) {
                rt[n->out[j]] = res[j];
                mine[n->out[j]] = true;
            }
            continue;
        }
        const kc_kernel *k = &p->k[st->index];
        char *b[64];
        if (k->n_buf + 1 > 64) {
            s = kiln__err(KILN_ERR_UNSUPPORTED, "compile: kernel %s has %d buffers (at most 63 on a device)", k->name,
                          k->n_buf);
            break;
        }
        for (int i = 0; s == KILN_OK && i < k->n_buf; i++) {
            const kc_buf *kb = &k->buf[i];
            if (kb->output && !rt[kb->value]) {
                const kiln__meta *m = &g->v[kb->value].meta;
                if (!(rt[kb->value] = kiln__tensor_alloc(be, m->dtype, m->shape, m->ndim))) s = kiln_last_status();
                mine[kb->value] = true;
            }
            if (s == KILN_OK && !rt[kb->value])
                s = kiln__err(KILN_ERR_INTERNAL, "compile: kernel %s reads value %%%d before it exists", k->name, kb->value);
            if (s == KILN_OK) b[i] = kiln__data(rt[kb->value]);
        }
        if (s == KILN_OK && k->tasks > 0) s = kiln__device_launch(p, k, b);
    }
    for (int i = 0; i < g->n_v; i++)
        if (mine[i]) kiln_tensor_free(rt[i]);
    free(rt);
    return s;
}

/* The ops worth a try: what the lowering takes (pointwise, casts, copies, last-dim
 * reductions) and what decomposes into it. full and arange are left out on purpose:
 * their value is baked into the code, so each new constant would be a new program. */
static bool candidate(kiln__op_id op)
{
    return kiln__graph_elementwise(op) || op == KILN_OP_CONTIGUOUS || op == KILN_OP_SUM || op == KILN_OP_MAX ||
           op == KILN_OP_SOFTMAX || op == KILN_OP_LOG_SOFTMAX || op == KILN_OP_LAYER_NORM || op == KILN_OP_RMS_NORM;
}

/* A sum or max of a contiguous tensor over a leading or trailing run of its dims (or
 * all of them), other than the last dim alone: the lowering reduces only the last dim,
 * so such a reduction is handed to it over a two-dim header on the same buffer, [kept,
 * reduced], the reduced run merged into the last dim (strided, for a leading run).
 * False for anything else. */
static bool flat_reduction(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                           kiln_tensor_t *flat)
{
    if ((op != KILN_OP_SUM && op != KILN_OP_MAX) || n_in != 1 || !kiln__is_contiguous(in[0])) return false;
    const kiln_tensor_t *x = in[0];
    int nd = x->ndim;
    if (nd < 1 || nd > 31) return false;
    unsigned seen = 0;
    if (a->ndim == 0) seen = (1u << nd) - 1;
    for (int i = 0; i < a->ndim; i++) seen |= 1u << kiln__norm_dim((int)a->shape[i], nd);
    int k = __builtin_popcount(seen);
    bool all = seen == (1u << nd) - 1, lead = seen == (1u << k) - 1, trail = seen == ((1u << nd) - 1) - ((1u << (nd - k)) - 1);
    if (!k || (!all && !lead && !trail) || (nd == 1) || (trail && k == 1 && !all)) return false; /* the lowering's own cases */
    int64_t red = 1, kept = 1;
    for (int d = 0; d < nd; d++) {
        if (seen >> d & 1) red *= x->shape[d];
        else kept *= x->shape[d];
    }
    *flat = *x;
    flat->ndim = 2;
    flat->shape[0] = kept;
    flat->shape[1] = red;
    if (all || trail) flat->stride[0] = red, flat->stride[1] = 1;
    else flat->stride[0] = 1, flat->stride[1] = kept; /* leading run: column sums */
    return true;
}

/* Whether this path takes op on be at all (the dtypes and layouts it meets decide the
 * rest): what kiln doctor --ops is told, and the first test of every call. */
static bool generates(const kiln__backend *be, int op)
{
    return kiln__be_can_compile(be) && candidate((kiln__op_id)op) && kiln__opt(KILN__OPT_DEVICE_CODEGEN);
}

/* The provider's run: op through a generated kernel; *handled false when it does not
 * lower (the next provider is asked). */
static kiln_status eager_compiled(kiln__backend *be, int op_id, kiln_tensor_t *const *in, int n_in,
                                  const kiln__attrs *a, kiln_tensor_t *const *out, int n_out, bool *handled)
{
    kiln__op_id op = (kiln__op_id)op_id;
    *handled = false;
    if (!generates(be, op) || n_in > 16) return KILN_OK;
    kiln_tensor_t flat, *fp = &flat;
    if (flat_reduction(op, in, n_in, a, &flat)) {
        /* The header is only read here; out holds one element per kept one, contiguous,
         * whatever dims it keeps. */
        kiln__attrs a1 = *a;
        a1.ndim = 1;
        a1.shape[0] = 1;
        a1.keepdim = false;
        return eager_compiled(be, op, &fp, 1, &a1, out, n_out, handled);
    }
    keybuf k = {.n = 0};
    key_add(&k, &be, sizeof be);
    key_add(&k, &op, sizeof op);
    key_add(&k, a, sizeof *a);
    for (int i = 0; i < n_in; i++) {
        const kiln_tensor_t *t = in[i];
        key_add(&k, &t->dtype, sizeof t->dtype);
        key_add(&k, &t->ndim, sizeof t->ndim);
        key_add(&k, t->shape, sizeof(int64_t) * (size_t)t->ndim);
        key_add(&k, t->stride, sizeof(int64_t) * (size_t)t->ndim);
    }
    if (k.overflow) return KILN_OK;
    uint64_t h = kiln__fnv(KILN__FNV_SEED, k.b, k.n);
    pthread_mutex_lock(&lock);
    entry *e = buckets[h % N_BUCKETS];
    while (e && !(e->hash == h && e->key_n == k.n && !memcmp(e->key, k.b, k.n))) e = e->next;
    if (!e) {
        if (!(e = calloc(1, sizeof *e + k.n))) {
            pthread_mutex_unlock(&lock);
            return kiln__err(KILN_ERR_OOM, "compile: out of memory");
        }
        memcpy(e->key, k.b, k.n);
        e->key_n = k.n;
        e->hash = h;
        bool prev = kiln_set_grad_enabled(false);
        kiln__backend *was = kiln__backend_here(be); /* the decompositions' scalars on the op's device */
        kiln_status s = build(e, be, op, in, n_in, a);
        kiln__backend_here(was);
        kiln_set_grad_enabled(prev);
        if (s != KILN_OK) { /* a generator or driver limit, not the caller's error: say so once, run on the cpu */
            fprintf(stderr, "kiln: %s on %s: the generated kernel could not be built (%s); it runs on the cpu\n",
                    kiln__ops[op].name, be->name, kiln_last_error());
            kiln_clear_error();
        }
        if (!e->ok) { /* only the verdict is kept */
            kiln__program_free(e->p);
            kiln_graph_free(e->g);
            e->p = NULL;
            e->g = NULL;
        }
        e->next = buckets[h % N_BUCKETS];
        buckets[h % N_BUCKETS] = e;
    }
    pthread_mutex_unlock(&lock);
    if (!e->ok) return KILN_OK;
    *handled = true;
    return run(e, be, in, out);
}

/* The compiler as a kernel provider: after the backend's own kernels, before the cpu
 * with copies. */
static const kiln__provider generated_provider = {
    .name = "generated", .order = 50, .support = KILN_OP_GENERATED, .offers = generates, .run = eager_compiled};

KILN__REGISTER(register_generated) { kiln__provider_register(&generated_provider); }
