/* Recorded replay: one real run of a function, with every kernel it launches written
 * down (kernel, attributes, and its tensors' headers as they were), then replayed
 * without dispatch — no checks, shape inference, allocation, autograd or reference
 * counting, only the kernels in order on the same buffers. The buffers stay put
 * because the recording run allocates from a private pool that keeps every block it
 * frees (src/core/alloc.c). Works on every backend through the contract: a replayed
 * step is the backend's own kernels, the compiler's generated ones, or the cpu
 * fallback, exactly as recorded.
 *
 * When every launch went to one device whose backend has the capture entries, the list
 * is then captured once more as that device's own graph: capture_begin, the list
 * launched again (recorded by the backend, not run), capture_end. What the kernels
 * allocate for themselves meanwhile comes from a second private pool, which lives as
 * long as the graph: the recording's pool cannot serve it, since its free blocks may be
 * ones the list itself names. A run then enqueues the graph. What the backend cannot record
 * (a copy through the host, a kernel that reads a value back) fails that capture, and
 * the launch list stays, with the reason kept for kiln_replay_native. */
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include "core/intercept.h"
#include "core/opts.h"
#include "core/tensor_impl.h"
#include "core/util.h"
#include "graph/graph_impl.h"
#include "kiln/graph.h"
#include "kiln/ops.h"
#include "ops/registry.h"

/* A launch: an op as the provider that ran it runs it, or a call noted from outside
 * dispatch (a compiled program's generated kernel). */
typedef enum { LAUNCH_OP, LAUNCH_CALL } launch_kind;

typedef struct {
    launch_kind kind;
    int op;
    kiln__backend *be;
    const kiln__provider *provider; /* LAUNCH_OP: who ran it */
    kiln__attrs a;
    int n_in, n_out;
    kiln_tensor_t *t;   /* n_in + n_out header copies (the block that holds st and p too) */
    kiln__storage *st;  /* their storages' copies */
    kiln_tensor_t **p;  /* pointers to t[] */
    kiln_status (*call)(void *ctx); /* LAUNCH_CALL: what runs, on call_ctx */
    void *call_ctx;
    void (*call_free)(void *ctx);
} launch;

struct kiln_replay {
    kiln__pool *pool;
    launch *l;
    int n_l;
    size_t cap_l;
    int n_in, n_out;
    kiln_tensor_t *in[KILN_GRAPH_MAX_IN];   /* the recorded inputs (retained): the buffers later inputs are copied to */
    kiln_tensor_t *out[KILN_GRAPH_MAX_OUT]; /* the recorded outputs (retained), rewritten by every replay */
    kiln_status failed;
    kiln__backend *native_be; /* the device whose own graph runs, or NULL */
    void *native;
    kiln__pool *native_pool; /* what the kernels allocated while it was captured */
    char why[256];
};

static _Thread_local kiln_replay_t *rec;

bool kiln_replay_recording(void) { return rec != NULL; }

/* kiln_graph_suspend: state made now (optimizer moments) is real and not recorded. */
static void replay_suspend(void *ctx)
{
    kiln__pool_end();
    rec = NULL;
}

static void replay_resume(void *ctx)
{
    rec = ctx;
    kiln__pool_begin(rec->pool);
}

/* Room for one more launch; false (and the recording failed) when there is none. */
static bool room(kiln_replay_t *r)
{
    void *tmp;
    if (!r->failed && !KILN__GROW(r->l, r->n_l, &r->cap_l, 256, tmp)) r->failed = KILN_ERR_OOM;
    return !r->failed;
}

/* Notes a launch dispatch made (c->ran ran it); never fails the call: a recording that
 * ran out of memory says so when it ends. */
static kiln_status replay_after(void *ctx, const kiln__call_info *c)
{
    kiln_replay_t *r = ctx;
    if (!c->ran || !room(r)) return KILN_OK;
    int n = c->n_in + c->n_out;
    launch *L = &r->l[r->n_l];
    *L = (launch){.kind = LAUNCH_OP, .op = c->op, .be = c->be, .provider = c->ran, .a = *c->a, .n_in = c->n_in,
                  .n_out = c->n_out,
                  .t = calloc((size_t)(n ? n : 1), sizeof(kiln_tensor_t) + sizeof(kiln__storage) + sizeof(kiln_tensor_t *))};
    if (!L->t) {
        r->failed = KILN_ERR_OOM;
        return KILN_OK;
    }
    L->st = (kiln__storage *)(L->t + n);
    L->p = (kiln_tensor_t **)(L->st + n);
    for (int i = 0; i < n; i++) {
        const kiln_tensor_t *src = i < c->n_in ? c->in[i] : c->out[i - c->n_in];
        L->st[i] = *src->st;
        atomic_init(&L->st[i].refcount, 1);
        L->st[i].pool = NULL;
        L->t[i] = *src;
        atomic_init(&L->t[i].refcount, 1);
        L->t[i].st = &L->st[i];
        memset(L->t[i].ext, 0, sizeof L->t[i].ext); /* a bare header: no room's state */
        L->p[i] = &L->t[i];
    }
    r->n_l++;
    return KILN_OK;
}

/* Random ops draw a fresh stream each time they run; a replay would repeat one. */
static kiln_status replay_before(void *ctx, const kiln__call_info *c)
{
    if (kiln__graph_random(c->op, c->a))
        return kiln__err(KILN_ERR_UNSUPPORTED, "%s while recording a replay: its random stream would be frozen and every "
                         "replay would draw the same numbers; record without it (dropout 0)", kiln__ops[c->op].name);
    return KILN_OK;
}

/* What the host reads or writes is not a launch: the replay would not repeat it. */
static kiln_status replay_data_access(void *ctx, const kiln_tensor_t *t, const char *what)
{
    if (!strcmp(what, "from_host"))
        return kiln__err(KILN_ERR_UNSUPPORTED, "from_host while recording a replay: a write from host memory is not a "
                         "launch and would not be replayed; make the tensor before recording and pass it in");
    if (!strcmp(what, "tensor_to"))
        return kiln__err(KILN_ERR_UNSUPPORTED, "tensor_to while recording a replay: a copy between devices is not a "
                         "launch and would not be replayed; move it before recording");
    return kiln__err(KILN_ERR_UNSUPPORTED, "%s while recording a replay: the replay could not take a decision made on "
                     "this value again; read it after the recorded function returns", what);
}

void kiln__replay_note_call(kiln__backend *be, kiln_status (*call)(void *ctx), void *ctx, void (*free_ctx)(void *ctx))
{
    kiln_replay_t *r = rec;
    if (!call) r->failed = KILN_ERR_OOM;
    if (!room(r)) {
        if (free_ctx) free_ctx(ctx);
        return;
    }
    r->l[r->n_l++] = (launch){.kind = LAUNCH_CALL, .op = -1, .be = be, .call = call, .call_ctx = ctx,
                              .call_free = free_ctx};
}

/* What launch L is, for a message. */
static const char *launch_name(const launch *L)
{
    return L->kind == LAUNCH_CALL ? "a generated kernel" : kiln__ops[L->op].name;
}

/* The launches, in order, on the recorded tensors; *at (at not NULL) gets the one that failed. */
static kiln_status run_list(kiln_replay_t *r, int *at)
{
    kiln_status s = KILN_OK;
    bool prev = kiln_set_grad_enabled(false);
    for (int k = 0; s == KILN_OK && k < r->n_l; k++) {
        const launch *L = &r->l[k];
        kiln_tensor_t *const *ins = L->p, *const *outs = L->p + L->n_in;
        bool handled = true;
        if (L->kind == LAUNCH_CALL) {
            s = L->call(L->call_ctx);
        } else {
            s = L->provider->run(L->be, L->op, ins, L->n_in, &L->a, outs, L->n_out, &handled);
            if (s == KILN_OK && !handled)
                s = kiln__err(KILN_ERR_INTERNAL, "replay_run: the %s kernel of %s is gone", L->provider->name,
                              kiln__ops[L->op].name);
        }
        if (s != KILN_OK && at) *at = k;
    }
    kiln_set_grad_enabled(prev);
    return s;
}

/* The launch list as the device's own graph, where it can be; r->why says what came of it. */
static void capture_native(kiln_replay_t *r)
{
    kiln__backend *be = r->n_l ? r->l[0].be : NULL;
    char no[256] = ""; /* why not */
    for (int k = 0; be && !*no && k < r->n_l; k++) {
        const launch *L = &r->l[k];
        if (L->kind == LAUNCH_OP && L->provider->on_cpu)
            snprintf(no, sizeof no, "launch %d (%s) runs on the cpu with copies", k, launch_name(L));
        else if (L->be != be)
            snprintf(no, sizeof no, "launches on %s and %s", be->name, L->be->name);
    }
    if (!*no && !be) snprintf(no, sizeof no, "nothing was launched");
    else if (!*no && !kiln__be_can_capture(be)) snprintf(no, sizeof no, "%s has no graph capture", be->name);
    else if (!*no && !kiln__opt(KILN__OPT_DEVICE_GRAPHS)) snprintf(no, sizeof no, "KILN_OPT_DEVICE_GRAPHS=0");
    else if (!*no && !(r->native_pool = kiln__pool_new())) snprintf(no, sizeof no, "out of memory");
    void *g = NULL;
    int at = -1;
    kiln_status s = *no ? KILN_OK : kiln__be_capture_begin(be);
    if (!*no && s == KILN_OK) {
        kiln__pool_begin(r->native_pool);
        kiln_status ran = run_list(r, &at);
        kiln__pool_end();
        s = kiln__be_capture_end(be, &g); /* ends the capture either way */
        if (ran != KILN_OK) s = ran;
    }
    if (s != KILN_OK) {
        char op[64] = "";
        if (at >= 0) snprintf(op, sizeof op, " at launch %d (%s)", at, launch_name(&r->l[at]));
        snprintf(no, sizeof no, "%s could not capture it%s: %s", be->name, op, kiln_last_error());
        kiln_clear_error();
    }
    if (*no) {
        snprintf(r->why, sizeof r->why, "a launch list: %.230s", no); /* why is as long as no */
        return;
    }
    r->native_be = be;
    r->native = g;
    snprintf(r->why, sizeof r->why, "%s's own graph of %d launches", be->name, r->n_l);
}

kiln_status kiln_replay_record(kiln_graph_fn fn, void *ctx, kiln_tensor_t *const *in, int n_in, kiln_replay_t **out_r,
                               kiln_tensor_t **out, int max_out, int *n_out)
{
    if (!out_r) return kiln__err(KILN_ERR_ARG, "replay_record: out is NULL");
    *out_r = NULL;
    if (!fn || n_in < 0 || n_in > KILN_GRAPH_MAX_IN || (n_in && !in) || !n_out || (max_out > 0 && !out))
        return kiln__err(KILN_ERR_ARG, "replay_record: needs a function, at most %d inputs and room for outputs",
                         KILN_GRAPH_MAX_IN);
    if (rec || kiln_graph_capturing())
        return kiln__err(KILN_ERR_ARG, "replay_record: a recording or graph capture is already running on this thread");
    for (int i = 0; i < n_in; i++)
        if (!in[i]) return kiln__null_arg("replay_record");
    kiln_replay_t *r = calloc(1, sizeof *r);
    if (!r || !(r->pool = kiln__pool_new())) {
        free(r);
        return kiln__err(KILN_ERR_OOM, "replay_record: out of memory");
    }
    r->n_in = n_in;
    for (int i = 0; i < n_in; i++) r->in[i] = kiln_tensor_retain(in[i]);
    kiln_tensor_t *res[KILN_GRAPH_MAX_OUT] = {0};
    int n = 0;
    kiln__interceptor ic = {.name = "replay", .order = KILN__ORDER_REPLAY, .records = true, .before = replay_before,
                            .after = replay_after, .data_access = replay_data_access, .suspend = replay_suspend,
                            .resume = replay_resume, .ctx = r};
    kiln_status s = kiln__intercept_push(&ic);
    if (s != KILN_OK) {
        kiln_replay_free(r);
        return s;
    }
    rec = r;
    kiln__pool_begin(r->pool);
    kiln_scope_begin();
    s = fn(ctx, in, n_in, res, &n);
    if (s == KILN_OK && (n < 0 || n > KILN_GRAPH_MAX_OUT || n > max_out))
        s = kiln__err(KILN_ERR_ARG, "replay_record: the function gave %d outputs (room for %d)", n, max_out);
    for (int j = 0; s == KILN_OK && j < n; j++)
        if (!res[j]) s = kiln__err(KILN_ERR_ARG, "replay_record: output %d is NULL", j);
        else r->out[j] = kiln_tensor_retain(res[j]);
    kiln_scope_end();
    kiln__pool_end();
    rec = NULL;
    s = kiln__intercept_end(&ic, s, "replay_record", "recording");
    if (s == KILN_OK && r->failed) s = kiln__err(r->failed, "replay_record: out of memory recording the launches");
    if (s != KILN_OK) {
        kiln_replay_free(r);
        return s;
    }
    r->n_out = n;
    capture_native(r);
    if (kiln__log_on("replay")) fprintf(stderr, "kiln [replay] %d launches, run as %s\n", r->n_l, r->why);
    for (int j = 0; j < n; j++) out[j] = kiln__scoped(kiln_tensor_retain(r->out[j]));
    *n_out = n;
    *out_r = r;
    return KILN_OK;
}

kiln_status kiln_replay_run(kiln_replay_t *r, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int max_out,
                            int *n_out)
{
    if (!r || !n_out || (max_out > 0 && !out)) return kiln__err(KILN_ERR_ARG, "replay_run: NULL replay or outputs");
    if (n_in != r->n_in) return kiln__err(KILN_ERR_ARG, "replay_run: %d inputs given, recorded with %d", n_in, r->n_in);
    if (max_out < r->n_out) return kiln__err(KILN_ERR_ARG, "replay_run: room for %d outputs, it gives %d", max_out, r->n_out);
    if (rec || kiln_graph_capturing()) return kiln__err(KILN_ERR_ARG, "replay_run: inside a recording or capture");
    if (n_in > 0 && !in) return kiln__err(KILN_ERR_ARG, "replay_run: inputs are NULL");
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < n_in; i++) {
        kiln_tensor_t *want = r->in[i], *got = in[i];
        if (!got) return kiln__null_arg("replay_run");
        char a[96], b[96];
        if (got->dtype != want->dtype || !kiln__same_shape(got->ndim, got->shape, want->ndim, want->shape))
            return kiln__err(KILN_ERR_SHAPE, "replay_run: input %d is %s, the replay was recorded for %s; record it "
                             "again for the new shape", i, kiln__shape_str(got, a, sizeof a), kiln__shape_str(want, b, sizeof b));
        if (got == want) continue;
        /* The new contents into the recorded input's buffer. */
        kiln_scope_begin();
        kiln_tensor_t *src = got->st->be == want->st->be ? got : kiln_tensor_to(got, want->st->be->name);
        s = src ? kiln_tensor_copy_(want, src) : kiln_last_status();
        kiln_scope_end();
    }
    if (s == KILN_OK) s = r->native ? kiln__be_replay(r->native_be, r->native) : run_list(r, NULL);
    if (s != KILN_OK) return s;
    for (int j = 0; j < r->n_out; j++) out[j] = kiln__scoped(kiln_tensor_retain(r->out[j]));
    *n_out = r->n_out;
    return KILN_OK;
}

int kiln_replay_num_launches(const kiln_replay_t *r) { return r ? r->n_l : 0; }

bool kiln_replay_native(const kiln_replay_t *r, char *why, size_t n)
{
    if (why && n) snprintf(why, n, "%s", r ? r->why : "no replay");
    return r && r->native;
}

void kiln_replay_free(kiln_replay_t *r)
{
    if (!r) return;
    if (r->native) kiln__be_capture_reset(r->native_be, r->native); /* before the pools its commands name */
    kiln__pool_release(r->native_pool);
    for (int k = 0; k < r->n_l; k++) {
        free(r->l[k].t);
        if (r->l[k].call_free) r->l[k].call_free(r->l[k].call_ctx);
    }
    free(r->l);
    for (int i = 0; i < r->n_in; i++) kiln_tensor_free(r->in[i]);
    for (int j = 0; j < KILN_GRAPH_MAX_OUT; j++) kiln_tensor_free(r->out[j]);
    kiln__pool_release(r->pool);
    free(r);
}
