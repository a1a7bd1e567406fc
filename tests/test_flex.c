/* Flex attention (kiln/flex.h): every preset, their joins and two user-written modifiers
 * against an oracle written here in plain C in double precision (the masks and score
 * changes coded by hand, not through kiln's expressions: an independent reading of the
 * same definitions), f64 to 1e-12 and f32 to 2e-5 (relative to the largest output);
 * gradients of q, k, v and of a captured tensor (ALiBi slopes) against central finite
 * differences in f64 (step 1e-6, tolerance 1e-6); the fused backward in f32 against the
 * oracle's gradients (1e-5 relative to each tensor's largest; measured 2.9e-7), and that
 * it ran (the device's own kernel, no (T, T) matrix held); PyTorch's flex_attention on
 * the same inputs (tests/reference/golden_flex.safetensors, written by
 * tests/reference/flex_ref.py with PyTorch 2.x; forward and log-sum-exp, 5e-6; measured
 * 7.2e-7); the block mask's classification; and bad modifiers, each a clear error. The
 * fused kernels run (src/flex/flex_gen.c, forward and backward) on the cpu and, in f32,
 * on OpenCL (test_flex_opencl: the generated OpenCL C) and CUDA, but for captured
 * tensors that want a gradient (the dense path; f64 on a device too); the test runs
 * again with KILN_OPT_FLEX_FUSED=0 (test_flex_dense: the dense path throughout). The
 * CUDA C compiles with NVRTC here; it has not run on a GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include "kiln/kiln.h"
#include "test_util.h"
#include "core/backend.h"
#include "flex/flex_impl.h"
#include "backends/cpu/gemm.h"

typedef struct {
    int64_t B, H, Hkv, Tq, Tk, D;
} dims;

/* The oracle's modifiers, one per case, by hand. */
typedef struct {
    const double *slopes;   /* alibi */
    const int64_t *docs;    /* doc: (B, Tk) */
    const int64_t *prefix;  /* per-row prefix: (B) */
    double cap;             /* softcap C, 0: none */
    int64_t window, pre;    /* window W, prefix P (-1: none) */
    bool causal, alibi, doc, user_score, user_mask, rows, or_prefix_window, empty;
    bool late; /* the first 2 queries see no key (half a block of 4) */
} oracle;

static bool ref_mask(const oracle *o, const dims *d, int64_t b, int64_t h, int64_t i, int64_t j)
{
    int64_t qpos = i + d->Tk - d->Tq;
    bool m = true;
    if (o->causal) m &= qpos >= j;
    if (o->window > 0) m &= qpos >= j && qpos - j < o->window;
    if (o->pre >= 0) m &= j < o->pre || qpos >= j;
    if (o->doc) m &= o->docs[b * d->Tk + qpos] == o->docs[b * d->Tk + j];
    if (o->user_mask) m &= i - j < 5 && j <= i + 2;
    if (o->rows) m &= j < o->prefix[b] || j <= i;
    if (o->or_prefix_window) m = (j < 3 || qpos >= j) || (qpos >= j && qpos - j < 2);
    if (o->empty) m = j > i + 1000;
    if (o->late) m &= qpos >= 2;
    return m;
}

static double ref_score(const oracle *o, const dims *d, int64_t b, int64_t h, int64_t i, int64_t j, double s)
{
    /* ALiBi's distance from the query's position among the keys (i + Tk - Tq) */
    if (o->alibi) s = s + o->slopes[h] * (double)(j - (i + d->Tk - d->Tq));
    if (o->cap > 0) s = o->cap * tanh(s / o->cap);
    if (o->user_score) s = s * 0.5 + (double)(i - j) * 0.01;
    return s;
}

/* y (B, H, Tq, D) and lse (B, H, Tq) by the definition, in double. */
static void reference(const oracle *o, const dims *d, const double *q, const double *k, const double *v, double *y,
                      double *lse)
{
    double scale = 1 / sqrt((double)d->D);
    double *s = malloc(sizeof(double) * (size_t)d->Tk);
    for (int64_t b = 0; b < d->B; b++)
        for (int64_t h = 0; h < d->H; h++)
            for (int64_t i = 0; i < d->Tq; i++) {
                int64_t hk = h / (d->H / d->Hkv);
                const double *qi = q + ((b * d->H + h) * d->Tq + i) * d->D;
                double mx = -INFINITY;
                for (int64_t j = 0; j < d->Tk; j++) {
                    const double *kj = k + ((b * d->Hkv + hk) * d->Tk + j) * d->D;
                    double dot = 0;
                    for (int64_t c = 0; c < d->D; c++) dot += qi[c] * kj[c];
                    s[j] = ref_mask(o, d, b, h, i, j) ? ref_score(o, d, b, h, i, j, dot * scale) : -INFINITY;
                    if (s[j] > mx) mx = s[j];
                }
                double *yi = y + ((b * d->H + h) * d->Tq + i) * d->D, sum = 0;
                for (int64_t c = 0; c < d->D; c++) yi[c] = 0;
                for (int64_t j = 0; j < d->Tk && mx > -INFINITY; j++) sum += exp(s[j] - mx);
                lse[(b * d->H + h) * d->Tq + i] = mx > -INFINITY ? mx + log(sum) : -INFINITY;
                for (int64_t j = 0; j < d->Tk && mx > -INFINITY; j++) {
                    double p = exp(s[j] - mx) / sum;
                    const double *vj = v + ((b * d->Hkv + hk) * d->Tk + j) * d->D;
                    for (int64_t c = 0; c < d->D; c++) yi[c] += p * vj[c];
                }
            }
    free(s);
}

/* d score' / d score of ref_score's changes, in turn (the chain rule by hand). */
static double ref_dscore(const oracle *o, const dims *d, int64_t h, int64_t i, int64_t j, double s)
{
    double g = 1;
    if (o->alibi) s = s + o->slopes[h] * (double)(j - (i + d->Tk - d->Tq));
    if (o->cap > 0) {
        double t = tanh(s / o->cap);
        g *= 1 - t * t;
        s = o->cap * t;
    }
    if (o->user_score) g *= 0.5;
    return g;
}

/* dq (B, H, Tq, D), dk and dv (B, Hkv, Tk, D) of loss = sum(y w) + sum(lse) by the
 * definition, in double (every row seeing a key): with p the row's probabilities,
 * dv += p w, ds = p (w . v - w . y + 1) d score'/d score, dq += scale ds k, dk += scale ds q. */
static void reference_grads(const oracle *o, const dims *d, const double *q, const double *k, const double *v,
                            const double *w, double *dq, double *dk, double *dv)
{
    double scale = 1 / sqrt((double)d->D);
    int64_t qn = d->B * d->H * d->Tq * d->D, kn = d->B * d->Hkv * d->Tk * d->D;
    memset(dq, 0, sizeof(double) * (size_t)qn);
    memset(dk, 0, sizeof(double) * (size_t)kn);
    memset(dv, 0, sizeof(double) * (size_t)kn);
    double *s = malloc(sizeof(double) * (size_t)d->Tk), *m = malloc(sizeof(double) * (size_t)d->Tk);
    double *dp = malloc(sizeof(double) * (size_t)d->Tk);
    for (int64_t b = 0; b < d->B; b++)
        for (int64_t h = 0; h < d->H; h++)
            for (int64_t i = 0; i < d->Tq; i++) {
                int64_t hk = h / (d->H / d->Hkv), row = (b * d->H + h) * d->Tq + i;
                const double *qi = q + row * d->D, *wi = w + row * d->D;
                const double *K = k + (b * d->Hkv + hk) * d->Tk * d->D, *V = v + (b * d->Hkv + hk) * d->Tk * d->D;
                double mx = -INFINITY, sum = 0, wy = 0;
                for (int64_t j = 0; j < d->Tk; j++) {
                    double dot = 0;
                    for (int64_t c = 0; c < d->D; c++) dot += qi[c] * K[j * d->D + c];
                    bool on = ref_mask(o, d, b, h, i, j);
                    s[j] = on ? ref_score(o, d, b, h, i, j, dot * scale) : -INFINITY;
                    m[j] = on ? ref_dscore(o, d, h, i, j, dot * scale) : 0;
                    mx = fmax(mx, s[j]);
                    dp[j] = 0;
                    for (int64_t c = 0; c < d->D; c++) dp[j] += wi[c] * V[j * d->D + c];
                }
                if (mx == -INFINITY) continue;
                for (int64_t j = 0; j < d->Tk; j++) sum += exp(s[j] - mx);
                for (int64_t j = 0; j < d->Tk; j++) wy += exp(s[j] - mx) / sum * dp[j];
                for (int64_t j = 0; j < d->Tk; j++) {
                    double p = exp(s[j] - mx) / sum, ds = p * (dp[j] - wy + 1) * m[j] * scale;
                    for (int64_t c = 0; c < d->D; c++) {
                        dq[row * d->D + c] += ds * K[j * d->D + c];
                        dk[((b * d->Hkv + hk) * d->Tk + j) * d->D + c] += ds * qi[c];
                        dv[((b * d->Hkv + hk) * d->Tk + j) * d->D + c] += p * wi[c];
                    }
                }
            }
    free(s), free(m), free(dp);
}

static double *randoms(int64_t n, uint64_t seed)
{
    double *x = malloc(sizeof(double) * (size_t)n);
    uint64_t st = seed * 0x9E3779B97F4A7C15ULL + 1;
    for (int64_t i = 0; i < n; i++) {
        st ^= st << 13, st ^= st >> 7, st ^= st << 17;
        x[i] = ((double)(st >> 11) / 9007199254740992.0) * 2 - 1;
    }
    return x;
}

static kiln_tensor_t *tensor(const double *x, const int64_t *shape, int nd, kiln_dtype dt)
{
    kiln_tensor_t *t = kiln_from_data(x, shape, nd, KILN_DTYPE_F64);
    return dt == KILN_DTYPE_F64 ? t : kiln_cast(t, dt);
}

static double *host(kiln_tensor_t *t)
{
    if (!t) fail_msg("%s", kiln_last_error());
    kiln_tensor_t *d = kiln_cast(t, KILN_DTYPE_F64);
    double *x = malloc(sizeof(double) * (size_t)kiln_tensor_numel(t));
    assert_int_equal(kiln_tensor_to_host(d, x, sizeof(double) * (size_t)kiln_tensor_numel(t)), KILN_OK);
    return x;
}

typedef struct {
    const char *name, *spec, *score, *mask; /* spec: a preset; else score and mask */
    oracle o;
} flex_case;

static void run_case(const flex_case *c, const dims *d, kiln_dtype dt, double tol)
{
    int64_t qn = d->B * d->H * d->Tq * d->D, kn = d->B * d->Hkv * d->Tk * d->D;
    double *q = randoms(qn, 1), *k = randoms(kn, 2), *v = randoms(kn, 3);
    double *y = malloc(sizeof(double) * (size_t)qn), *lse = malloc(sizeof(double) * (size_t)(qn / d->D));
    reference(&c->o, d, q, k, v, y, lse);
    int64_t qs[4] = {d->B, d->H, d->Tq, d->D}, ks[4] = {d->B, d->Hkv, d->Tk, d->D};
    kiln_tensor_t *qt = tensor(q, qs, 4, dt), *kt = tensor(k, ks, 4, dt), *vt = tensor(v, ks, 4, dt);
    kiln_flex_t *f = NULL;
    int64_t docs_shape[2] = {d->B, d->Tk}, H = d->H;
    kiln_tensor_t *docs = c->o.docs ? kiln_from_data(c->o.docs, docs_shape, 2, KILN_DTYPE_I64) : NULL;
    kiln_tensor_t *slopes = c->o.slopes ? tensor(c->o.slopes, &H, 1, dt) : NULL;
    kiln_tensor_t *pre = c->o.prefix ? kiln_from_data(c->o.prefix, &d->B, 1, KILN_DTYPE_I64) : NULL;
    kiln_status s;
    if (c->spec) {
        kiln_flex_inputs in = {.doc_ids = docs, .alibi_slopes = slopes, .heads = d->H};
        s = kiln_flex_preset(c->spec, &in, &f);
    } else {
        s = kiln_flex_new(c->score, c->mask, &pre, pre ? 1 : 0, &f);
    }
    if (s != KILN_OK) fail_msg("%s: %s", c->name, kiln_last_error());
    /* twice: without gradients, and with q tracked by autograd (recorded for a backward) */
    for (int tracked = 0; tracked < 2; tracked++) {
        kiln_tensor_set_requires_grad(qt, tracked);
        kiln_tensor_t *l = NULL, *out = kiln_flex_attention(qt, kt, vt, f, NULL, 0, &l);
        if (!out) fail_msg("%s: %s", c->name, kiln_last_error());
        const char *path = tracked ? "q tracked" : "untracked";
        double *got = host(out), *got_l = host(l), big = 0;
        for (int64_t i = 0; i < qn; i++) big = fmax(big, fabs(y[i]));
        for (int64_t i = 0; i < qn; i++)
            if (fabs(got[i] - y[i]) > tol * (big > 0 ? big : 1))
                fail_msg("%s (%s, %s): y[%lld] %.17g, the oracle %.17g", c->name, kiln_dtype_name(dt), path,
                         (long long)i, got[i], y[i]);
        for (int64_t i = 0; i < qn / d->D; i++)
            if (!(got_l[i] == lse[i] || fabs(got_l[i] - lse[i]) <= tol * (1 + fabs(lse[i]))))
                fail_msg("%s (%s, %s): lse[%lld] %.17g, the oracle %.17g", c->name, kiln_dtype_name(dt), path,
                         (long long)i, got_l[i], lse[i]);
        free(got), free(got_l);
    }
    kiln_flex_free(f);
    free(q), free(k), free(v), free(y), free(lse);
}

static const int64_t docs[2 * 12] = {0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 1, 1, 3, 3, 3, 3, 3};
static const int64_t prefix_rows[2] = {3, 7};
static const double slopes[4] = {0.5, 0.25, 0.125, 0.0625};

static const flex_case cases[] = {
    {"none", "", NULL, NULL, {.window = -1, .pre = -1}},
    {"causal", "causal", NULL, NULL, {.causal = true, .window = -1, .pre = -1}},
    {"window:4", "window:4", NULL, NULL, {.window = 4, .pre = -1}},
    {"prefix:5", "prefix:5", NULL, NULL, {.window = -1, .pre = 5}},
    {"doc+causal", "doc+causal", NULL, NULL, {.doc = true, .docs = docs, .causal = true, .window = -1, .pre = -1}},
    {"alibi+causal", "alibi+causal", NULL, NULL, {.alibi = true, .slopes = slopes, .causal = true, .window = -1, .pre = -1}},
    {"softcap:2", "softcap:2", NULL, NULL, {.cap = 2, .window = -1, .pre = -1}},
    {"causal+alibi+softcap:1.5", "causal+alibi+softcap:1.5", NULL, NULL,
     {.causal = true, .alibi = true, .slopes = slopes, .cap = 1.5, .window = -1, .pre = -1}},
    {"user score and mask", NULL, "score * 0.5 + (q_idx - kv_idx) * 0.01", "q_idx - kv_idx < 5 && kv_idx <= q_idx + 2",
     {.user_score = true, .user_mask = true, .window = -1, .pre = -1}},
    {"a prefix per row (captured)", NULL, NULL, "kv_idx < c0[b] || kv_idx <= q_idx",
     {.rows = true, .prefix = prefix_rows, .window = -1, .pre = -1}},
    {"no key seen", NULL, NULL, "kv_idx > q_idx + 1000", {.empty = true, .window = -1, .pre = -1}},
};

static void presets_and_user_modifiers_match_the_definition(void **state)
{
    dims sq = {2, 4, 2, 12, 12, 8}, dec = {2, 4, 2, 5, 12, 8}; /* Tq = Tk, and 5 queries at the end of 12 keys */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        flex_case c = cases[i];
        if (!c.spec && !c.score && !c.mask) continue;
        if (c.spec && !*c.spec) c.spec = NULL;
        run_case(&c, &sq, KILN_DTYPE_F64, 1e-12);
        run_case(&c, &sq, KILN_DTYPE_F32, 2e-5);
        if (!c.o.user_mask && !c.o.rows && !c.o.doc) run_case(&c, &dec, KILN_DTYPE_F64, 1e-12);
    }
    /* no modifier at all: plain attention, as kiln_attention computes it */
    kiln_flex_t *f;
    assert_int_equal(kiln_flex_new(NULL, NULL, NULL, 0, &f), KILN_OK);
    int64_t qs[4] = {2, 4, 7, 8}, ks[4] = {2, 2, 7, 8};
    kiln_manual_seed(5);
    kiln_tensor_t *q = kiln_randn(qs, 4, KILN_DTYPE_F64), *k = kiln_randn(ks, 4, KILN_DTYPE_F64),
                  *v = kiln_randn(ks, 4, KILN_DTYPE_F64);
    double *a = host(kiln_flex_attention(q, k, v, f, NULL, 0, NULL)), *b = host(kiln_attention(q, k, v, false, 0));
    for (int i = 0; i < 2 * 4 * 7 * 8; i++) assert_true(fabs(a[i] - b[i]) < 1e-12);
    free(a), free(b);
    kiln_flex_free(f);
}

/* d loss / d x by central differences against autograd, f64: loss = sum(y * w) + sum of
 * the finite lse. */
static double loss_of(kiln_tensor_t *const *in, const kiln_flex_t *f, kiln_tensor_t *w)
{
    kiln_tensor_t *l = NULL, *y = kiln_flex_attention(in[0], in[1], in[2], f, NULL, 0, &l);
    double v;
    assert_int_equal(kiln_tensor_item(kiln_add(kiln_sum(kiln_mul(y, w), NULL, 0, false), kiln_sum(l, NULL, 0, false)),
                                      &v),
                     KILN_OK);
    return v;
}

/* Checks the gradients of in[0..n) against finite differences. */
static void check_fd(kiln_tensor_t *const *in, int n, const kiln_flex_t *f, kiln_tensor_t *w, const char *what)
{
    for (int t = 0; t < 3; t++) kiln_tensor_set_requires_grad(in[t], true);
    kiln_tensor_t *l = NULL, *y = kiln_flex_attention(in[0], in[1], in[2], f, NULL, 0, &l);
    if (!y) fail_msg("%s: %s", what, kiln_last_error());
    assert_int_equal(kiln_backward(kiln_add(kiln_sum(kiln_mul(y, w), NULL, 0, false), kiln_sum(l, NULL, 0, false))),
                     KILN_OK);
    bool was = kiln_set_grad_enabled(false);
    static const char *names[4] = {"q", "k", "v", "c0"};
    for (int t = 0; t < n; t++) {
        double *g = host(kiln_tensor_grad(in[t]));
        int64_t nel = kiln_tensor_numel(in[t]);
        double *x = host(in[t]);
        for (int64_t i = 0; i < nel; i += (nel > 24 ? 7 : 1)) {
            double keep = x[i], fd[2];
            for (int side = 0; side < 2; side++) {
                x[i] = keep + (side ? -1e-6 : 1e-6);
                assert_int_equal(kiln_tensor_from_host_(in[t], x, sizeof(double) * (size_t)nel), KILN_OK);
                fd[side] = loss_of(in, f, w);
            }
            x[i] = keep;
            assert_int_equal(kiln_tensor_from_host_(in[t], x, sizeof(double) * (size_t)nel), KILN_OK);
            double num = (fd[0] - fd[1]) / 2e-6;
            if (fabs(num - g[i]) > 1e-6 * (1 + fabs(num)))
                fail_msg("%s: d/d%s[%lld]: autograd %.12g, finite differences %.12g", what, names[t], (long long)i, g[i],
                         num);
        }
        free(g), free(x);
    }
    kiln_set_grad_enabled(was);
}

/* Gradients of q, k, v (and of captured ALiBi slopes, which the dense path gives)
 * against finite differences, f64, with grouped-query heads: the fused backward on the
 * cpu (its score modifiers' derivatives generated from their trees: tanh, division,
 * abs, min, max, exp, log, sqrt, ?:) and the dense path when the slopes want a
 * gradient. */
static void gradients_match_finite_differences(void **state)
{
    int64_t qs[4] = {1, 4, 6, 4}, ks[4] = {1, 2, 6, 4}, H = 4, ds[2] = {1, 6};
    static const int64_t doc6[6] = {0, 0, 1, 1, 1, 2};
    kiln_manual_seed(11);
    kiln_tensor_t *in[4] = {kiln_randn(qs, 4, KILN_DTYPE_F64), kiln_randn(ks, 4, KILN_DTYPE_F64),
                            kiln_randn(ks, 4, KILN_DTYPE_F64), kiln_from_data(slopes, &H, 1, KILN_DTYPE_F64)};
    kiln_tensor_t *w = kiln_randn(qs, 4, KILN_DTYPE_F64), *docs6 = kiln_from_data(doc6, ds, 2, KILN_DTYPE_I64);
    kiln_flex_inputs fi = {.alibi_slopes = in[3], .doc_ids = docs6};
    static const struct {
        const char *spec, *score, *mask;
        bool slopes_grad;
    } cases[] = {
        {"alibi+window:4+softcap:3", NULL, NULL, true},
        {"alibi+window:4+softcap:3", NULL, NULL, false},
        {"doc+causal", NULL, NULL, false},
        {NULL, "score * 0.5 + (q_idx - kv_idx) * 0.01", "q_idx - kv_idx < 5 && kv_idx <= q_idx + 2", false},
        {NULL, "score / (1 + abs(score)) + min(score, 0.5) - max(score * 0.1, -1.0)", NULL, false},
        {NULL, "log(1 + exp(score)) + sqrt(score * score + 1) + (q_idx > kv_idx ? score * 2 : -score)", NULL, false},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        kiln_flex_t *f;
        kiln_status s = cases[c].spec ? kiln_flex_preset(cases[c].spec, &fi, &f)
                                      : kiln_flex_new(cases[c].score, cases[c].mask, NULL, 0, &f);
        if (s != KILN_OK) fail_msg("%s", kiln_last_error());
        kiln_tensor_t *fresh[4];
        for (int i = 0; i < 4; i++) fresh[i] = kiln_detach(in[i]); /* no gradient left from the last case */
        if (cases[c].spec && strstr(cases[c].spec, "alibi")) {
            fi.alibi_slopes = fresh[3];
            kiln_flex_free(f);
            if (cases[c].slopes_grad) kiln_tensor_set_requires_grad(fresh[3], true);
            assert_int_equal(kiln_flex_preset(cases[c].spec, &fi, &f), KILN_OK);
        }
        char what[256];
        snprintf(what, sizeof what, "%s%s", cases[c].spec ? cases[c].spec : cases[c].score,
                 cases[c].slopes_grad ? " (slopes too: dense)" : "");
        check_fd(fresh, cases[c].slopes_grad ? 4 : 3, f, w, what);
        kiln_flex_free(f);
    }
    /* the fused backward ran where it should: its op is in the table */
    bool fused = false;
    for (int i = 0; i < kiln_op_count(); i++) fused |= !strncmp(kiln_op_name(i), "flex_attention_backward_", 24);
    if (!strcmp(kiln_device(), "cpu")) assert_int_equal(fused, test_opt_on("FLEX_FUSED"));
}

/* Whether x (n values) is within tol of the oracle's want, relative to want's largest;
 * else fails naming what and where. */
static void near_oracle(const double *x, const double *want, int64_t n, double tol, const char *what, const char *name)
{
    double big = 0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(want[i])) big = fmax(big, fabs(want[i]));
    for (int64_t i = 0; i < n; i++) /* an infinite value (a row that sees no key: lse) only as itself */
        if (!(x[i] == want[i] || fabs(x[i] - want[i]) <= tol * (big > 0 ? big : 1)))
            fail_msg("%s: %s[%lld] %.9g, the oracle %.9g (largest %.3g)", what, name, (long long)i, x[i], want[i], big);
}

/* One case of the fused kernels against the f64 reference: q random from qseed, k, v and
 * the upstream gradient w from kseed, kseed + 1, kseed + 2; the block mask at
 * block x kv_block, the captured document ids docs (B, Tk) and ALiBi slopes (H; NULL:
 * none given); y, lse and the gradients of q, k, v to 1e-5 of each tensor's largest.
 * With `classify`, the mask must have partial blocks (and full ones, but for the user's
 * mask), and the call runs over heap memory full of NaNs. */
static void fused_case(const flex_case *cs, const dims *d, const int64_t *docs, const double *slopes_or_null,
                       int64_t block, int64_t kv_block, uint64_t qseed, uint64_t kseed, bool classify)
{
    flex_case c = *cs;
    if (c.o.doc) c.o.docs = docs;
    int64_t qn = d->B * d->H * d->Tq * d->D, kn = d->B * d->Hkv * d->Tk * d->D, H = d->H, ds[2] = {d->B, d->Tk};
    double *q = randoms(qn, qseed), *k = randoms(kn, kseed), *v = randoms(kn, kseed + 1), *w = randoms(qn, kseed + 2);
    double *y = malloc(sizeof(double) * (size_t)qn), *lse = malloc(sizeof(double) * (size_t)(qn / d->D));
    double *dq = malloc(sizeof(double) * (size_t)qn), *dk = malloc(sizeof(double) * (size_t)kn),
           *dv = malloc(sizeof(double) * (size_t)kn);
    reference(&c.o, d, q, k, v, y, lse);
    reference_grads(&c.o, d, q, k, v, w, dq, dk, dv);
    int64_t qs[4] = {d->B, d->H, d->Tq, d->D}, ks[4] = {d->B, d->Hkv, d->Tk, d->D};
    kiln_tensor_t *in[3] = {tensor(q, qs, 4, KILN_DTYPE_F32), tensor(k, ks, 4, KILN_DTYPE_F32),
                            tensor(v, ks, 4, KILN_DTYPE_F32)};
    kiln_tensor_t *wt = tensor(w, qs, 4, KILN_DTYPE_F32);
    kiln_flex_inputs fi = {.doc_ids = kiln_from_data(docs, ds, 2, KILN_DTYPE_I64),
                           .alibi_slopes = slopes_or_null ? tensor(slopes_or_null, &H, 1, KILN_DTYPE_F32) : NULL};
    kiln_flex_t *f;
    kiln_block_mask_t *bm;
    kiln_status st = c.spec ? kiln_flex_preset(c.spec, &fi, &f) : kiln_flex_new(c.score, c.mask, NULL, 0, &f);
    if (st == KILN_OK) st = kiln_block_mask_new(f, d->B, d->H, d->Tq, d->Tk, block, kv_block, &bm);
    if (st != KILN_OK) fail_msg("%s: %s", c.name, kiln_last_error());
    if (classify) {
        int64_t full, partial, empty;
        double density;
        kiln_block_mask_stats(bm, &full, &partial, &empty, &density);
        assert_true(partial > 0);
        if (!c.o.user_mask) assert_true(full > 0); /* the user's mask has none at blocks of 4 */
    }
    for (int i = 0; i < 3; i++) kiln_tensor_set_requires_grad(in[i], true);
    if (classify) {
        /* freed heap memory full of NaNs, as a long-running process has: a kernel that
         * reads a tile buffer it never wrote (the derivative of a row that sees no key)
         * gives NaN gradients, where fresh pages would have hidden it */
        void *poison[64];
        for (int i = 0; i < 64; i++)
            if ((poison[i] = malloc((size_t)(1024 + 96 * i)))) memset(poison[i], 0xff, (size_t)(1024 + 96 * i));
        for (int i = 0; i < 64; i++) free(poison[i]);
    }
    kiln_tensor_t *l = NULL, *out = kiln_flex_attention(in[0], in[1], in[2], f, bm, 0, &l);
    if (!out) fail_msg("%s: %s", c.name, kiln_last_error());
    if (kiln_backward(kiln_add(kiln_sum(kiln_mul(out, wt), NULL, 0, false), kiln_sum(l, NULL, 0, false))) != KILN_OK)
        fail_msg("%s: backward: %s", c.name, kiln_last_error());
    double *got[5] = {host(out), host(l), host(kiln_tensor_grad(in[0])), host(kiln_tensor_grad(in[1])),
                      host(kiln_tensor_grad(in[2]))};
    const double *want[5] = {y, lse, dq, dk, dv};
    static const char *names[5] = {"y", "lse", "dq", "dk", "dv"};
    const int64_t n[5] = {qn, qn / d->D, qn, kn, kn};
    for (int i = 0; i < 5; i++) {
        near_oracle(got[i], want[i], n[i], 1e-5, c.name, names[i]);
        free(got[i]);
    }
    kiln_block_mask_free(bm);
    kiln_flex_free(f);
    free(q), free(k), free(v), free(w), free(y), free(lse), free(dq), free(dk), free(dv);
}

/* The fused backward in f32 on the test's device (on OpenCL and CUDA the generated
 * flex_bwd_dq_dev and flex_bwd_dkv_dev, on the cpu its tiles): y, lse, dq, dk and dv of
 * sum(y w) + sum(lse) against the oracle's, with block masks of 4 query rows and 4 or 3
 * keys (full and partial blocks; the key blocks not the query blocks' size),
 * grouped-query heads (4 over 2), score modifiers with a derivative (softcap, ALiBi, a
 * user's), captured tensors on the device (slopes, document ids, given a block mask)
 * and queries at the end of the keys. Tolerances relative to each tensor's largest: 2e-5
 * for y and lse, 5e-5 for the gradients (f32 sums of 24 keys). Then that it was the fused
 * path, where it is on: the backward op has this device's own kernel, and one causal
 * forward and backward at T 1024 with 8 heads held less than one (B, H, T, T) f32 matrix
 * beyond its inputs (32 MiB; measured 4.3 MB fused, 415 MB dense). Its 8192 key rows
 * also crashed PoCL when work-groups were left to it (4096 work-items' private rows
 * overflowed a thread's stack). */
static void fused_gradients_match_the_oracle(void **state)
{
    dims sq = {2, 4, 2, 24, 24, 8}, dec = {2, 4, 2, 10, 24, 8};
    int64_t docs24[2 * 24];
    for (int j = 0; j < 24; j++) docs24[j] = j / 7, docs24[24 + j] = j < 3 ? 0 : j < 17 ? 1 : 2;
    static const struct {
        flex_case c;
        bool dec;
        int64_t kv_block;
    } cases[] = {
        {{"causal", "causal", NULL, NULL, {.causal = true, .window = -1, .pre = -1}}, false, 4},
        {{"window:6+softcap:3", "window:6+softcap:3", NULL, NULL, {.window = 6, .cap = 3, .pre = -1}}, false, 3},
        {{"causal+alibi+softcap:1.5", "causal+alibi+softcap:1.5", NULL, NULL,
          {.causal = true, .alibi = true, .slopes = slopes, .cap = 1.5, .window = -1, .pre = -1}}, false, 4},
        {{"doc+causal", "doc+causal", NULL, NULL, {.doc = true, .causal = true, .window = -1, .pre = -1}}, false, 4},
        {{"user score and mask", NULL, "score * 0.5 + (q_idx - kv_idx) * 0.01", "q_idx - kv_idx < 5 && kv_idx <= q_idx + 2",
          {.user_score = true, .user_mask = true, .window = -1, .pre = -1}}, false, 3},
        {{"causal, 10 queries at the end of 24 keys", "causal", NULL, NULL, {.causal = true, .window = -1, .pre = -1}},
         true, 4},
        {{"a user's score, the first 2 queries seeing no key", NULL, "score * 0.5 + (q_idx - kv_idx) * 0.01",
          "q_idx >= 2 && kv_idx <= q_idx", {.user_score = true, .causal = true, .late = true, .window = -1, .pre = -1}},
         false, 4},
        {{"window:6+softcap:3, 10 queries at the end", "window:6+softcap:3", NULL, NULL,
          {.window = 6, .cap = 3, .pre = -1}}, true, 3},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        fused_case(&cases[ci].c, cases[ci].dec ? &dec : &sq, docs24, slopes, 4, cases[ci].kv_block, 41 + ci, 42,
                   true);
    if (!test_opt_on("FLEX_FUSED")) return;
    /* the fused path ran: the backward op's own kernel on this device ... */
    int64_t qs[4] = {1, 8, 1024, 16}, ks[4] = {1, 8, 1024, 16};
    kiln_manual_seed(45);
    kiln_tensor_t *q = kiln_randn(qs, 4, KILN_DTYPE_F32), *k = kiln_randn(ks, 4, KILN_DTYPE_F32),
                  *v = kiln_randn(ks, 4, KILN_DTYPE_F32);
    kiln__backend *be = kiln__backend_find(kiln_tensor_device(q));
    int ops = 0;
    for (int i = 0; i < kiln_op_count(); i++)
        if (!strncmp(kiln_op_name(i), "flex_attention_backward_", 24)) {
            if (!kiln__be_has_kernel(be, i)) fail_msg("%s has no kernel of its own on %s", kiln_op_name(i), kiln_device());
            ops++;
        }
    assert_true(ops > 0);
    /* ... and no (T, T) matrix: the peak of one causal forward and backward (8 x 1024 key rows) */
    kiln_flex_t *f;
    kiln_block_mask_t *bm;
    assert_int_equal(kiln_flex_preset("causal", NULL, &f), KILN_OK);
    assert_int_equal(kiln_block_mask_new(f, 1, 8, 1024, 1024, 64, 0, &bm), KILN_OK);
    kiln_memory_reset_peak();
    size_t before = kiln_memory_peak();
    kiln_scope_begin();
    kiln_tensor_t *in[3];
    for (int i = 0; i < 3; i++) {
        in[i] = kiln_detach(i == 0 ? q : i == 1 ? k : v);
        kiln_tensor_set_requires_grad(in[i], true);
    }
    kiln_tensor_t *y = kiln_flex_attention(in[0], in[1], in[2], f, bm, 0, NULL);
    assert_int_equal(kiln_backward(kiln_sum(y, NULL, 0, false)), KILN_OK);
    assert_non_null(kiln_tensor_grad(in[1]));
    kiln_scope_end();
    size_t peak = kiln_memory_peak() - before, matrix = 8 * 1024 * 1024 * sizeof(float);
    if (peak >= matrix) fail_msg("one forward and backward held %zu bytes on %s: a (T, T) matrix is %zu", peak, kiln_device(), matrix);
    kiln_block_mask_free(bm);
    kiln_flex_free(f);
}

/* Long rows of keys in blocks of 64: T 1100, so that a query
 * block's row of scores spans up to 17 key blocks, runs of adjacent blocks are one GEMM
 * and the last block is short. Causal; a window of 700 with soft-capping (partial blocks
 * at both ends of a row); documents 0-299, 300-899, 900- with causal (rows of the block
 * across 900 see no key in most of its listed blocks). Against the f64 reference: y and
 * lse to 1e-5 of the largest, the gradients to 1e-5 (the other oracle tests run T 24). */
static void long_rows_of_keys_match_the_oracle(void **state)
{
    (void)state;
    dims d = {1, 2, 1, 1100, 1100, 8};
    static int64_t docs[1100];
    for (int j = 0; j < 1100; j++) docs[j] = j < 300 ? 0 : j < 900 ? 1 : 2;
    static const flex_case cases[] = {
        {"causal", "causal", NULL, NULL, {.causal = true, .window = -1, .pre = -1}},
        {"window:700+softcap:3", "window:700+softcap:3", NULL, NULL, {.window = 700, .cap = 3, .pre = -1}},
        {"doc+causal", "doc+causal", NULL, NULL, {.doc = true, .causal = true, .window = -1, .pre = -1}},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        fused_case(&cases[ci], &d, docs, NULL, 64, 64, 61 + ci, 62, false);
}

/* Key blocks of 32, whole panels of kiln's GEMM: with KILN_OPT_ATT_PANELS the products
 * read K^T, V, V^T and K packed once per kv head (kiln__cpu_att_panels), here with a
 * head size of 40 (a last panel 8 wide), 100 keys (the last block short), grouped
 * heads, fewer queries than keys, and heap memory full of NaNs; forward and gradients
 * against the f64 reference at 1e-5 of the largest, as above. */
static void panel_sized_blocks_match_the_oracle(void **state)
{
    (void)state;
    dims d = {2, 4, 2, 100, 100, 40}, dec = {2, 4, 2, 30, 100, 40};
    static int64_t docs[2 * 100];
    for (int j = 0; j < 100; j++) docs[j] = j < 70 ? 0 : 1, docs[100 + j] = j < 10 ? 0 : j < 80 ? 1 : 2;
    static const flex_case cases[] = {
        {"causal", "causal", NULL, NULL, {.causal = true, .window = -1, .pre = -1}},
        {"window:70+softcap:3", "window:70+softcap:3", NULL, NULL, {.window = 70, .cap = 3, .pre = -1}},
        {"doc+causal", "doc+causal", NULL, NULL, {.doc = true, .causal = true, .window = -1, .pre = -1}},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        fused_case(&cases[ci], &d, docs, NULL, 32, 32, 71 + ci, 72, true);
        if (!cases[ci].o.doc) fused_case(&cases[ci], &dec, docs, NULL, 32, 32, 81 + ci, 82, false);
    }
}

/* Where K and V were packed into kiln's GEMM's panels but a product on them then runs
 * out of memory (kiln__gemm_refuse_buffers: every per-thread buffer refused), the
 * product falls back to the BLAS on K and V themselves, the transposed copies never
 * having been made: flex's forward and backward on blocks of 32 still match the f64
 * oracle (1e-5 of each tensor's largest), and kiln's dense attention gives what it gives
 * with its panels' products (1e-5; test_ops checks those against PyTorch). */
static void panel_products_out_of_memory_fall_back(void **state)
{
    (void)state;
    dims d = {2, 4, 2, 100, 100, 40};
    static int64_t docs[2 * 100];
    static const flex_case cs = {"causal", "causal", NULL, NULL, {.causal = true, .window = -1, .pre = -1}};
    kiln__gemm_refuse_buffers(true);
    fused_case(&cs, &d, docs, NULL, 32, 32, 91, 92, true);
    kiln__gemm_refuse_buffers(false);
    int64_t qn = d.B * d.H * d.Tq * d.D, kn = d.B * d.Hkv * d.Tk * d.D;
    int64_t qs[4] = {d.B, d.H, d.Tq, d.D}, ks[4] = {d.B, d.Hkv, d.Tk, d.D};
    double *x[4] = {randoms(qn, 93), randoms(kn, 94), randoms(kn, 95), randoms(qn, 96)}, *got[2][4];
    for (int refuse = 1; refuse >= 0; refuse--) {
        kiln_tensor_t *in[3] = {tensor(x[0], qs, 4, KILN_DTYPE_F32), tensor(x[1], ks, 4, KILN_DTYPE_F32),
                                tensor(x[2], ks, 4, KILN_DTYPE_F32)};
        for (int i = 0; i < 3; i++) kiln_tensor_set_requires_grad(in[i], true);
        kiln__gemm_refuse_buffers(refuse);
        kiln_tensor_t *y = kiln_attention(in[0], in[1], in[2], true, 0);
        assert_non_null(y);
        assert_int_equal(kiln_backward_with(y, tensor(x[3], qs, 4, KILN_DTYPE_F32)), KILN_OK);
        kiln__gemm_refuse_buffers(false);
        got[refuse][0] = host(y);
        for (int i = 0; i < 3; i++) got[refuse][i + 1] = host(kiln_tensor_grad(in[i]));
    }
    static const char *names[4] = {"y", "dq", "dk", "dv"};
    const int64_t n[4] = {qn, qn, kn, kn};
    for (int i = 0; i < 4; i++) {
        near_oracle(got[1][i], got[0][i], n[i], 1e-5, "kiln_attention, products refused", names[i]);
        free(got[0][i]), free(got[1][i]), free(x[i]);
    }
}

/* bf16 and f16 q, k, v (what the linear layers give under mixed precision), inside an
 * autocast region of their type as a model runs them, and a bf16 q over f32 k and v (a
 * cache): computed in f32 and each output rounded once to its type. The oracle is the f64 reference
 * on the 16-bit values themselves (q, k, v and the upstream gradient w as the tensors hold
 * them), so the only differences allowed are the final rounding, half a unit in the last
 * place of the value (2^-8 of it for bf16, 2^-11 for f16), and the f32 sums' error (1e-5
 * of the tensor's largest); rounding any intermediate (the scores, P) to 16 bits would
 * miss it on the small values. y, dq, dk, dv are in the inputs' type and the log-sum-exp
 * f32 (2e-5). Block masks of 4: full, partial and empty blocks; grouped-query heads. */
static void sixteen_bit_inputs_match_the_oracle(void **state)
{
    dims d = {2, 4, 2, 24, 24, 8};
    static const flex_case cases[] = {
        {"causal", "causal", NULL, NULL, {.causal = true, .window = -1, .pre = -1}},
        {"window:6+softcap:3", "window:6+softcap:3", NULL, NULL, {.window = 6, .cap = 3, .pre = -1}},
        {"causal+alibi", "causal+alibi", NULL, NULL, {.causal = true, .alibi = true, .slopes = slopes, .window = -1, .pre = -1}},
    };
    static const kiln_dtype types[2] = {KILN_DTYPE_BF16, KILN_DTYPE_F16};
    int64_t qn = d.B * d.H * d.Tq * d.D, kn = d.B * d.Hkv * d.Tk * d.D, H = d.H;
    int64_t qs[4] = {d.B, d.H, d.Tq, d.D}, ks[4] = {d.B, d.Hkv, d.Tk, d.D};
    for (int ti = 0; ti < 3; ti++) /* bf16, f16, then a bf16 q over f32 k and v */
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            kiln_dtype dt = types[ti % 2], kvt = ti < 2 ? dt : KILN_DTYPE_F32;
            const flex_case *c = &cases[ci];
            double *x[4] = {randoms(qn, 61 + ci), randoms(kn, 62), randoms(kn, 63), randoms(qn, 64)};
            kiln_tensor_t *in[4] = {tensor(x[0], qs, 4, dt), tensor(x[1], ks, 4, kvt), tensor(x[2], ks, 4, kvt),
                                    tensor(x[3], qs, 4, dt)};
            double *r[4]; /* the values the 16-bit tensors hold */
            for (int i = 0; i < 4; i++) r[i] = host(in[i]);
            double *y = malloc(sizeof(double) * (size_t)qn), *lse = malloc(sizeof(double) * (size_t)(qn / d.D));
            double *dq = malloc(sizeof(double) * (size_t)qn), *dk = malloc(sizeof(double) * (size_t)kn),
                   *dv = malloc(sizeof(double) * (size_t)kn);
            reference(&c->o, &d, r[0], r[1], r[2], y, lse);
            reference_grads(&c->o, &d, r[0], r[1], r[2], r[3], dq, dk, dv);
            kiln_flex_inputs fi = {.alibi_slopes = tensor(slopes, &H, 1, KILN_DTYPE_F32)};
            kiln_flex_t *f;
            kiln_block_mask_t *bm;
            kiln_status s = kiln_flex_preset(c->spec, &fi, &f);
            if (s == KILN_OK) s = kiln_block_mask_new(f, d.B, d.H, d.Tq, d.Tk, 4, 4, &bm);
            if (s != KILN_OK) fail_msg("%s: %s", c->name, kiln_last_error());
            for (int i = 0; i < 3; i++) kiln_tensor_set_requires_grad(in[i], true);
            assert_int_equal(kiln_autocast_begin(dt), KILN_OK);
            kiln_tensor_t *l = NULL, *out = kiln_flex_attention(in[0], in[1], in[2], f, bm, 0, &l);
            assert_int_equal(kiln_autocast_end(), KILN_OK);
            if (!out) fail_msg("%s (%s): %s", c->name, kiln_dtype_name(dt), kiln_last_error());
            assert_int_equal(kiln_tensor_dtype(out), dt);
            assert_int_equal(kiln_tensor_dtype(l), KILN_DTYPE_F32);
            /* sum(y w) + sum(lse), y's gradient w as the 16-bit tensor holds it */
            kiln_tensor_t *loss = kiln_add(kiln_sum(kiln_mul(kiln_cast(out, KILN_DTYPE_F32), kiln_cast(in[3], KILN_DTYPE_F32)),
                                                    NULL, 0, false),
                                           kiln_sum(l, NULL, 0, false));
            if (kiln_backward(loss) != KILN_OK) fail_msg("%s: backward: %s", c->name, kiln_last_error());
            kiln_tensor_t *got_t[5] = {out, l, kiln_tensor_grad(in[0]), kiln_tensor_grad(in[1]), kiln_tensor_grad(in[2])};
            const double *want[5] = {y, lse, dq, dk, dv};
            static const char *names[5] = {"y", "lse", "dq", "dk", "dv"};
            const int64_t n[5] = {qn, qn / d.D, qn, kn, kn};
            double half_ulp = dt == KILN_DTYPE_BF16 ? 0x1p-8 : 0x1p-11;
            for (int i = 0; i < 5; i++) {
                kiln_dtype want_t = i == 1 ? KILN_DTYPE_F32 : i >= 3 ? kvt : dt;
                assert_int_equal(kiln_tensor_dtype(got_t[i]), want_t);
                double *got = host(got_t[i]), big = 0;
                for (int64_t e = 0; e < n[i]; e++)
                    if (isfinite(want[i][e])) big = fmax(big, fabs(want[i][e]));
                for (int64_t e = 0; e < n[i]; e++) {
                    double tol = want_t == KILN_DTYPE_F32 ? 2e-5 * (i == 1 ? 1 + fabs(want[i][e]) : big)
                                                          : 1.01 * half_ulp * fabs(want[i][e]) + 1e-5 * big;
                    if (!(got[e] == want[i][e] || fabs(got[e] - want[i][e]) <= tol))
                        fail_msg("%s (%s on %s): %s[%lld] %.9g, the oracle %.9g (allowed %.3g)", c->name,
                                 kiln_dtype_name(dt), kiln_device(), names[i], (long long)e, got[e], want[i][e], tol);
                }
                free(got);
            }
            kiln_block_mask_free(bm);
            kiln_flex_free(f);
            for (int i = 0; i < 4; i++) free(x[i]), free(r[i]);
            free(y), free(lse), free(dq), free(dk), free(dv);
        }
}

/* PyTorch 2.x's flex_attention on the same inputs (the golden file), forward and lse. */
static void matches_pytorch_flex_attention(void **state)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/reference/golden_flex.safetensors",
             getenv("KILN_SOURCE_DIR") ? getenv("KILN_SOURCE_DIR") : ".");
    kiln_safetensors_t *g;
    if (kiln_safetensors_load(path, &g) != KILN_OK) fail_msg("%s", kiln_last_error());
    kiln_tensor_t *q = kiln_safetensors_get(g, "q"), *k = kiln_safetensors_get(g, "k"), *v = kiln_safetensors_get(g, "v");
    kiln_flex_inputs in = {.doc_ids = kiln_safetensors_get(g, "doc_ids"), .alibi_slopes = kiln_safetensors_get(g, "slopes")};
    kiln_tensor_t *pre = kiln_safetensors_get(g, "prefix_rows");
    static const struct {
        const char *key, *spec, *score, *mask;
    } rows[] = {
        {"causal", "causal", NULL, NULL}, {"window8", "window:8", NULL, NULL}, {"prefix5", "prefix:5", NULL, NULL},
        {"doc_causal", "doc+causal", NULL, NULL}, {"alibi_causal", "alibi+causal", NULL, NULL},
        {"softcap5_causal", "softcap:5+causal", NULL, NULL},
        {"user", NULL, "score * 0.5 + (q_idx - kv_idx) * 0.01", "q_idx - kv_idx < 5 && kv_idx <= q_idx + 2"},
        {"rows", NULL, NULL, "kv_idx < c0[b] || kv_idx <= q_idx"},
    };
    int checked = 0;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        char yk[64], lk[64];
        snprintf(yk, sizeof yk, "%s.out", rows[i].key);
        snprintf(lk, sizeof lk, "%s.lse", rows[i].key);
        kiln_tensor_t *want = kiln_safetensors_get(g, yk), *want_l = kiln_safetensors_get(g, lk);
        if (!want || !want_l) fail_msg("%s: %s", yk, kiln_last_error());
        kiln_flex_t *f;
        kiln_status s = rows[i].spec ? kiln_flex_preset(rows[i].spec, &in, &f)
                                     : kiln_flex_new(rows[i].score, rows[i].mask, &pre, 1, &f);
        if (s != KILN_OK) fail_msg("%s: %s", rows[i].key, kiln_last_error());
        kiln_tensor_t *l = NULL, *y = kiln_flex_attention(q, k, v, f, NULL, 0, &l);
        double *a = host(y), *b = host(want), *la = host(l), *lb = host(want_l);
        for (int64_t j = 0; j < kiln_tensor_numel(y); j++)
            if (fabs(a[j] - b[j]) > 5e-6) fail_msg("%s: out[%lld] %.9g, PyTorch %.9g", rows[i].key, (long long)j, a[j], b[j]);
        for (int64_t j = 0; j < kiln_tensor_numel(l); j++)
            if (fabs(la[j] - lb[j]) > 5e-6 * (1 + fabs(lb[j])))
                fail_msg("%s: lse[%lld] %.9g, PyTorch %.9g", rows[i].key, (long long)j, la[j], lb[j]);
        free(a), free(b), free(la), free(lb);
        kiln_flex_free(f);
        checked++;
    }
    assert_int_equal(checked, 8);
    kiln_safetensors_free(g);
}

static void block_masks_classify_blocks(void **state)
{
    kiln_flex_t *f;
    assert_int_equal(kiln_flex_preset("causal", NULL, &f), KILN_OK);
    kiln_block_mask_t *m;
    assert_int_equal(kiln_block_mask_new(f, 2, 4, 10, 10, 4, 0, &m), KILN_OK);
    int64_t full, partial, empty, kv[8], nf, np;
    double density;
    kiln_block_mask_stats(m, &full, &partial, &empty, &density);
    /* one (b, h) kept (causal reads neither): query blocks {0-3, 4-7, 8-9} */
    assert_int_equal(full, 3);
    assert_int_equal(partial, 3);
    assert_int_equal(empty, 3);
    assert_true(fabs(density - 55.0 / 100) < 1e-12);
    assert_true(kiln_block_mask_row(m, 1, 3, 2, kv, 8, &nf, &np)); /* any b, h */
    assert_int_equal(nf, 2);
    assert_int_equal(np, 1);
    assert_int_equal(kv[0], 0);
    assert_int_equal(kv[1], 1);
    assert_int_equal(kv[2], 2);
    assert_false(kiln_block_mask_row(m, 0, 0, 3, kv, 8, &nf, &np));
    kiln_block_mask_free(m);
    kiln_flex_free(f);
    /* a mask that reads b keeps each row: documents */
    int64_t ds[2] = {2, 12};
    kiln_tensor_t *d = kiln_from_data(docs, ds, 2, KILN_DTYPE_I64);
    assert_int_equal(kiln_flex_preset("doc", &(kiln_flex_inputs){.doc_ids = d}, &f), KILN_OK);
    assert_int_equal(kiln_block_mask_new(f, 2, 4, 12, 12, 3, 0, &m), KILN_OK);
    kiln_block_mask_stats(m, &full, &partial, &empty, &density);
    assert_int_equal(full + partial + empty, 2 * 4 * 4); /* b kept, h not: 2 x 4 x 4 blocks */
    /* row 0: documents [0 0 0][1 1 1][1 2 2][2 2 2]: query block 0 sees key block 0 whole */
    assert_true(kiln_block_mask_row(m, 0, 0, 0, kv, 8, &nf, &np));
    assert_int_equal(nf, 1);
    assert_int_equal(np, 0);
    kiln_block_mask_free(m);
    kiln_flex_free(f);
    /* a block mask for other sizes is refused by flex_attention */
    assert_int_equal(kiln_flex_preset("causal", NULL, &f), KILN_OK);
    assert_int_equal(kiln_block_mask_new(f, 1, 1, 8, 8, 4, 0, &m), KILN_OK);
    int64_t qs[4] = {1, 2, 6, 4};
    kiln_tensor_t *q = kiln_randn(qs, 4, KILN_DTYPE_F32);
    assert_null(kiln_flex_attention(q, q, q, f, m, 0, NULL));
    assert_non_null(strstr(kiln_last_error(), "the block mask is for"));
    kiln_clear_error();
    kiln_block_mask_free(m);
    kiln_flex_free(f);
}

/* Flex attention inside a compiled function and a recorded replay: the fused op is a
 * step of the compiled program (its block mask made from the call's own captured
 * tensors, so new document ids are read, not frozen), against eager (1e-6). */
typedef struct {
    const char *spec;
} fn_ctx;

static kiln_status flex_fn(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    const fn_ctx *c = ctx;
    kiln_flex_t *f;
    kiln_flex_inputs fi = {.doc_ids = in[3]};
    kiln_status s = kiln_flex_preset(c->spec, &fi, &f);
    if (s != KILN_OK) return s;
    out[0] = kiln_mul_scalar(kiln_flex_attention(kiln_add_scalar(in[0], 0.5), in[1], in[2], f, NULL, 0, NULL), 2);
    kiln_flex_free(f);
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

static void compiled_and_replayed_match_eager(void **state)
{
    int64_t qs[4] = {2, 4, 12, 8}, ks[4] = {2, 2, 12, 8}, ds[2] = {2, 12};
    static const int64_t docs2[24] = {0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2};
    kiln_manual_seed(21);
    kiln_tensor_t *in[4] = {kiln_randn(qs, 4, KILN_DTYPE_F32), kiln_randn(ks, 4, KILN_DTYPE_F32),
                            kiln_randn(ks, 4, KILN_DTYPE_F32), kiln_from_data(docs, ds, 2, KILN_DTYPE_I64)};
    fn_ctx c = {"doc+causal+softcap:4"};
    kiln_compiled_t *cf;
    assert_int_equal(kiln_compiled_new(flex_fn, &c, "flex", &cf), KILN_OK);
    kiln_replay_t *r = NULL;
    kiln_tensor_t *out[1];
    int n;
    for (int call = 0; call < 2; call++) {
        if (call) in[3] = kiln_from_data(docs2, ds, 2, KILN_DTYPE_I64); /* other documents, same shapes */
        kiln_tensor_t *eager[1];
        assert_int_equal(flex_fn(&c, in, 4, eager, &n), KILN_OK);
        double *want = host(eager[0]);
        if (kiln_compiled_call(cf, in, 4, out, 1, &n) != KILN_OK) fail_msg("%s", kiln_last_error());
        double *got = host(out[0]);
        for (int64_t i = 0; i < kiln_tensor_numel(eager[0]); i++)
            if (fabs(got[i] - want[i]) > 1e-6) fail_msg("compiled, call %d: [%lld] %g vs eager %g", call, (long long)i, got[i], want[i]);
        free(got);
        if (!r) assert_int_equal(kiln_replay_record(flex_fn, &c, in, 4, &r, out, 1, &n), KILN_OK);
        else assert_int_equal(kiln_replay_run(r, in, 4, out, 1, &n), KILN_OK);
        got = host(out[0]);
        for (int64_t i = 0; i < kiln_tensor_numel(eager[0]); i++)
            if (fabs(got[i] - want[i]) > 1e-6) fail_msg("replay, call %d: [%lld] %g vs eager %g", call, (long long)i, got[i], want[i]);
        free(got);
        free(want);
    }
    kiln_replay_free(r);
    kiln_compiled_free(cf);
}

/* The block mask as an input of a compiled function (kiln_flex_attention_masked): its
 * blocks are data, read at every call, and its sizes are guarded as an input's shape.
 * The function takes (q, k, v, mask) with a window of 8. Oracle: eager flex
 * attention (its own mask), 1e-6. Calls: the window's mask with blocks of 4 x 4; the same
 * mask with every full block listed as partial (other data, same shape: the same graph,
 * the same result); a mask that lists no block (same shape: the same graph, and every
 * row sees no key: zeros, where a graph that kept the first mask's blocks would give the
 * window's output); a mask of 4 x 2 blocks (another shape: a second graph). Then a mask
 * whose words are wrong is an error that names the mask. The dense path
 * (test_flex_dense) reads no block mask: there every call gives the window's output. */
static kiln_status masked_fn(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    out[0] = kiln_flex_attention_masked(in[0], in[1], in[2], ctx, in[3], 0, NULL);
    *n_out = 1;
    return out[0] ? KILN_OK : kiln_last_status();
}

/* A mask that reads h made for the call (no captured tensors: kept per sizes): a call
 * with 1 head, then with 4, then with 1 again; the 4-head call against the same call
 * given the mask kiln_block_mask_new makes for 4 heads (1e-6). A kept mask made for one
 * head must not serve four (head 0's blocks for every head). */
static void kept_masks_follow_the_heads(void **state)
{
    kiln_flex_t *f;
    assert_int_equal(kiln_flex_new(NULL, "kv_idx <= q_idx && (h == 0 || q_idx - kv_idx < 4)", NULL, 0, &f), KILN_OK);
    int64_t s1[4] = {1, 1, 128, 16}, s4[4] = {1, 4, 128, 16};
    kiln_manual_seed(8);
    kiln_tensor_t *q1 = kiln_randn(s1, 4, KILN_DTYPE_F32), *q4 = kiln_randn(s4, 4, KILN_DTYPE_F32);
    assert_non_null(kiln_flex_attention(q1, q1, q1, f, NULL, 0, NULL));
    kiln_block_mask_t *bm;
    assert_int_equal(kiln_block_mask_new(f, 1, 4, 128, 128, KILN_FLEX_BLOCK, KILN_FLEX_BLOCK, &bm), KILN_OK);
    double *want = host(kiln_flex_attention(q4, q4, q4, f, bm, 0, NULL)), *got = host(kiln_flex_attention(q4, q4, q4, f, NULL, 0, NULL));
    for (int64_t i = 0; i < 4 * 128 * 16; i++)
        if (fabs(got[i] - want[i]) > 1e-6) fail_msg("4 heads after 1: [%lld] %g, want %g", (long long)i, got[i], want[i]);
    assert_non_null(kiln_flex_attention(q1, q1, q1, f, NULL, 0, NULL));
    free(want), free(got);
    kiln_block_mask_free(bm);
    kiln_flex_free(f);
}

static void block_mask_tensor_is_a_guarded_graph_input(void **state)
{
    int64_t qs[4] = {2, 4, 16, 8}, ks[4] = {2, 2, 16, 8};
    kiln_manual_seed(5);
    kiln_tensor_t *in[4] = {kiln_randn(qs, 4, KILN_DTYPE_F32), kiln_randn(ks, 4, KILN_DTYPE_F32),
                            kiln_randn(ks, 4, KILN_DTYPE_F32), NULL};
    kiln_flex_t *f;
    assert_int_equal(kiln_flex_preset("window:8", NULL, &f), KILN_OK);
    kiln_tensor_t *eager = kiln_flex_attention(in[0], in[1], in[2], f, NULL, 0, NULL);
    double *want = host(eager);
    int64_t n = kiln_tensor_numel(eager);
    kiln_block_mask_t *m44, *m42;
    assert_int_equal(kiln_block_mask_new(f, 2, 4, 16, 16, 4, 4, &m44), KILN_OK);
    assert_int_equal(kiln_block_mask_new(f, 2, 4, 16, 16, 4, 2, &m42), KILN_OK);
    kiln_tensor_t *t44 = kiln_block_mask_tensor(m44), *t42 = kiln_block_mask_tensor(m42);
    assert_non_null(t44);
    assert_int_equal(kiln_tensor_ndim(t44), 4);
    assert_int_equal(kiln_tensor_dim(t44, 3), 4 + 4); /* the counts, the sizes, 4 key blocks */
    int64_t words = kiln_tensor_numel(t44), *w = malloc(sizeof *w * (size_t)words);
    assert_int_equal(kiln_tensor_to_host(t44, w, sizeof *w * (size_t)words), KILN_OK);
    int64_t *all_partial = malloc(sizeof *w * (size_t)words), *none = malloc(sizeof *w * (size_t)words);
    memcpy(all_partial, w, sizeof *w * (size_t)words);
    memcpy(none, w, sizeof *w * (size_t)words);
    int64_t moved = 0;
    for (int64_t r = 0; r < words / 8; r++) {
        moved += all_partial[r * 8];
        all_partial[r * 8 + 1] += all_partial[r * 8], all_partial[r * 8] = 0;
        none[r * 8] = none[r * 8 + 1] = 0;
    }
    assert_true(moved > 0); /* the window has full blocks to move */
    const char *dev = kiln_tensor_device(in[0]);
    kiln_tensor_t *masks[4] = {kiln_tensor_to(t44, dev),
                               kiln_tensor_to(kiln_from_data(all_partial, kiln_tensor_shape(t44), 4, KILN_DTYPE_I64), dev),
                               kiln_tensor_to(kiln_from_data(none, kiln_tensor_shape(t44), 4, KILN_DTYPE_I64), dev),
                               kiln_tensor_to(t42, dev)};
    kiln_compiled_t *cf;
    assert_int_equal(kiln_compiled_new(masked_fn, f, "flex_masked", &cf), KILN_OK);
    const int graphs_after[4] = {1, 1, 1, 2};
    /* the dense path (test_flex_dense) has no block mask: it evaluates f's mask */
    bool fused = test_opt_on("FLEX_FUSED");
    for (int call = 0; call < 4; call++) {
        in[3] = masks[call];
        kiln_tensor_t *out[1];
        int no;
        if (kiln_compiled_call(cf, in, 4, out, 1, &no) != KILN_OK) fail_msg("call %d: %s", call, kiln_last_error());
        double *got = host(out[0]);
        for (int64_t i = 0; i < n; i++) {
            double expect = call == 2 && fused ? 0 : want[i];
            if (fabs(got[i] - expect) > 1e-6) fail_msg("call %d: [%lld] %g, want %g", call, (long long)i, got[i], expect);
        }
        free(got);
        uint64_t calls, hits, recompiles;
        int graphs;
        kiln_compiled_stats(cf, &calls, &hits, &recompiles, &graphs);
        if (graphs != graphs_after[call]) fail_msg("after call %d: %d graphs, want %d", call, graphs, graphs_after[call]);
    }
    kiln_compiled_free(cf);
    /* a key block out of range, and a row whose block sizes differ: errors naming them */
    for (int bad = 0; bad < 2; bad++) {
        int64_t *x = malloc(sizeof *w * (size_t)words);
        memcpy(x, w, sizeof *w * (size_t)words);
        if (bad) x[8 + 2] = 3;
        else x[4] = 9;
        kiln_tensor_t *bt = kiln_tensor_to(kiln_from_data(x, kiln_tensor_shape(t44), 4, KILN_DTYPE_I64), dev);
        kiln_tensor_t *y = kiln_flex_attention_masked(in[0], in[1], in[2], f, bt, 0, NULL);
        if (fused) {
            assert_null(y);
            assert_non_null(strstr(kiln_last_error(), bad ? "row 1 holds" : "lists key block 9"));
            kiln_clear_error();
        }
        free(x);
    }
    if (fused) { /* a key block listed twice in a row */
        int64_t *x = malloc(sizeof *w * (size_t)words);
        memcpy(x, w, sizeof *w * (size_t)words);
        int64_t r = 3; /* a row with two blocks or more */
        while (x[r * 8] + x[r * 8 + 1] < 2) r++;
        x[r * 8 + 5] = x[r * 8 + 4];
        kiln_tensor_t *bt = kiln_tensor_to(kiln_from_data(x, kiln_tensor_shape(t44), 4, KILN_DTYPE_I64), dev);
        assert_null(kiln_flex_attention_masked(in[0], in[1], in[2], f, bt, 0, NULL));
        assert_non_null(strstr(kiln_last_error(), "twice"));
        kiln_clear_error();
        free(x);
    }
    int64_t three[3] = {1, 4, 8};
    assert_null(kiln_flex_attention_masked(in[0], in[1], in[2], f, kiln_zeros(three, 3, KILN_DTYPE_I64), 0, NULL));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "block mask tensor"));
    kiln_clear_error();
    free(w), free(all_partial), free(none), free(want);
    kiln_block_mask_free(m44);
    kiln_block_mask_free(m42);
    kiln_flex_free(f);
}

/* The fused kernels' CUDA C (the forward, and the backward's dQ and dK/dV kernels)
 * compiles with NVRTC, the compiler the CUDA backend builds it with (sm_90; no GPU
 * needed; it runs where one is: test_flex_cuda in bench/gpu.sh), for presets with and
 * without captured tensors and a user's modifiers; skipped, not passed, where NVRTC is
 * not. The OpenCL C of the same generator runs in test_flex_opencl. */
static void cuda_source_compiles_with_nvrtc(void **state)
{
    skip_without_nvrtc();
    char *ptx = NULL;
    int64_t ds[2] = {2, 12}, H = 4;
    kiln_flex_inputs in = {.doc_ids = kiln_from_data(docs, ds, 2, KILN_DTYPE_I64),
                           .alibi_slopes = kiln_from_data(slopes, &H, 1, KILN_DTYPE_F64)};
    static const char *specs[] = {"causal", "window:4+softcap:3", "doc+causal", "alibi+prefix:5"};
    for (int i = 0; i < 5; i++) {
        kiln_flex_t *f;
        kiln_status st = i < 4 ? kiln_flex_preset(specs[i], &in, &f)
                               : kiln_flex_new("score / (1 + abs(score)) - max(score, 0.5)", "kv_idx <= q_idx", NULL, 0, &f);
        assert_int_equal(st, KILN_OK);
        for (int backward = 0; backward < 2; backward++) { /* the forward, then the backward's two kernels */
            char *src = kiln__flex_device_source(f, true, backward);
            assert_non_null(src);
            if (kiln__cuda_nvrtc(src, backward ? "flex_bwd_dev" : "flex_fwd_dev", 9, 0, &ptx) != KILN_OK)
                fail_msg("%s (%s): %s\n%s", i < 4 ? specs[i] : "user", backward ? "backward" : "forward",
                         kiln_last_error(), src);
            assert_non_null(strstr(ptx, backward ? ".entry flex_bwd_dq_dev" : ".entry flex_fwd_dev"));
            if (backward) assert_non_null(strstr(ptx, ".entry flex_bwd_dkv_dev"));
            free(ptx);
            free(src);
        }
        kiln_flex_free(f);
    }
}

/* Captured tensors of any dtype give what their values in f64 give: ALiBi slopes in
 * bf16 and f16 (0.5 ... 0.0625, exact in both) and document ids in i32 against the same
 * in f64 and i64 (1e-6); and a captured tensor of three dims reads where the dense path
 * reads. */
static void captured_dtypes_read_as_their_values(void **state)
{
    int64_t qs[4] = {2, 4, 12, 8}, ks[4] = {2, 2, 12, 8}, H = 4, ds[2] = {2, 12};
    kiln_manual_seed(31);
    kiln_tensor_t *q = kiln_randn(qs, 4, KILN_DTYPE_F32), *k = kiln_randn(ks, 4, KILN_DTYPE_F32),
                  *v = kiln_randn(ks, 4, KILN_DTYPE_F32);
    kiln_tensor_t *s64 = kiln_from_data(slopes, &H, 1, KILN_DTYPE_F64), *d64 = kiln_from_data(docs, ds, 2, KILN_DTYPE_I64);
    kiln_flex_t *f;
    assert_int_equal(kiln_flex_preset("alibi+doc+causal", &(kiln_flex_inputs){.alibi_slopes = s64, .doc_ids = d64}, &f),
                     KILN_OK);
    double *want = host(kiln_flex_attention(q, k, v, f, NULL, 0, NULL));
    kiln_flex_free(f);
    static const kiln_dtype sd[2] = {KILN_DTYPE_BF16, KILN_DTYPE_F16};
    for (int i = 0; i < 2; i++) {
        kiln_flex_inputs in = {.alibi_slopes = kiln_cast(s64, sd[i]), .doc_ids = kiln_cast(d64, KILN_DTYPE_I32)};
        assert_int_equal(kiln_flex_preset("alibi+doc+causal", &in, &f), KILN_OK);
        kiln_tensor_t *y = kiln_flex_attention(q, k, v, f, NULL, 0, NULL);
        if (!y) fail_msg("%s slopes: %s", kiln_dtype_name(sd[i]), kiln_last_error());
        double *got = host(y);
        for (int64_t j = 0; j < kiln_tensor_numel(y); j++)
            if (fabs(got[j] - want[j]) > 1e-6)
                fail_msg("%s slopes, i32 ids: [%lld] %g vs %g", kiln_dtype_name(sd[i]), (long long)j, got[j], want[j]);
        free(got);
        kiln_flex_free(f);
    }
    free(want);
    /* a captured tensor of three dims (a bias per row, head and key), read at three
     * indices: the fused kernel against the dense path (the tensor tracked), 1e-6 */
    int64_t bs[3] = {2, 4, 12};
    kiln_tensor_t *bias = kiln_randn(bs, 3, KILN_DTYPE_F32), *tracked = kiln_detach(bias);
    kiln_tensor_set_requires_grad(tracked, true);
    double *y[2];
    for (int dense = 0; dense < 2; dense++) {
        assert_int_equal(kiln_flex_new("score + c0[b, h, kv_idx]", "kv_idx <= q_idx", dense ? &tracked : &bias, 1, &f),
                         KILN_OK);
        y[dense] = host(kiln_flex_attention(q, k, v, f, NULL, 0, NULL));
        kiln_flex_free(f);
    }
    for (int64_t j = 0; j < 2 * 4 * 12 * 8; j++)
        if (fabs(y[0][j] - y[1][j]) > 1e-6) fail_msg("3-D captured: [%lld] %g vs dense %g", (long long)j, y[0][j], y[1][j]);
    free(y[0]);
    free(y[1]);
}

static void expect_error(const char *score, const char *mask, int n_cap, const char *want)
{
    int64_t n = 4;
    kiln_tensor_t *c = kiln_zeros(&n, 1, KILN_DTYPE_F32);
    kiln_flex_t *f = NULL;
    kiln_status s = kiln_flex_new(score, mask, &c, n_cap, &f);
    if (s == KILN_OK && f) { /* an error of evaluation: at the call */
        int64_t qs[4] = {1, 2, 4, 4};
        kiln_tensor_t *q = kiln_zeros(qs, 4, KILN_DTYPE_F32);
        kiln_tensor_t *y = kiln_flex_attention(q, q, q, f, NULL, 0, NULL);
        kiln_flex_free(f);
        if (y) fail_msg("%s / %s: no error (wanted '%s')", score, mask, want);
    }
    if (!strstr(kiln_last_error(), want)) fail_msg("%s / %s: %s (wanted '%s')", score, mask, kiln_last_error(), want);
    kiln_clear_error();
}

static void bad_modifiers_are_clear_errors(void **state)
{
    expect_error("score + bogus", NULL, 0, "flex score_mod: unknown name bogus, at column 9 of \"score + bogus\"");
    expect_error(NULL, "q_idx >= kv_idx &&", 0, "the expression ends too soon");
    expect_error(NULL, "score > 0", 0, "a mask reads no score");
    expect_error(NULL, "c1[h] > 0", 1, "c1 is read but 1 tensor(s) are captured");
    expect_error("score * c0", NULL, 1, "a captured tensor is read at indices");
    expect_error("score * c0[h, b]", NULL, 1, "c0 has 1 dims, read at 2 indices");
    expect_error("score * c0[score]", NULL, 1, "an index of c0 is a float");
    expect_error("tanh(score, 1)", NULL, 0, "too many arguments to tanh");
    expect_error(NULL, "c0[q_idx * 3] > 0", 1, "outside"); /* c0 has 4 elements; q_idx * 3 reaches 9 */
    expect_error("(score", NULL, 0, "')' expected");
    expect_error("score 2", NULL, 0, "unexpected text after the expression");
    kiln_flex_t *f;
    assert_int_not_equal(kiln_flex_preset("causal+wobble:3", NULL, &f), KILN_OK);
    assert_non_null(strstr(kiln_last_error(), "flex preset 'wobble:3': not one of"));
    assert_int_not_equal(kiln_flex_preset("window:0", NULL, &f), KILN_OK);
    assert_int_not_equal(kiln_flex_preset("doc", NULL, &f), KILN_OK);
    assert_non_null(strstr(kiln_last_error(), "give the (B, T) document ids"));
    assert_int_not_equal(kiln_flex_preset("alibi", NULL, &f), KILN_OK);
    assert_non_null(strstr(kiln_last_error(), "give the slopes or the number of heads"));
    kiln_clear_error();
    /* shapes and dtypes */
    assert_int_equal(kiln_flex_preset("causal", NULL, &f), KILN_OK);
    int64_t qs[4] = {1, 3, 4, 4}, ks[4] = {1, 2, 4, 4};
    kiln_tensor_t *q = kiln_zeros(qs, 4, KILN_DTYPE_F32), *k = kiln_zeros(ks, 4, KILN_DTYPE_F32);
    assert_null(kiln_flex_attention(q, k, k, f, NULL, 0, NULL));
    assert_non_null(strstr(kiln_last_error(), "H a multiple of Hkv"));
    kiln_clear_error();
    kiln_flex_free(f);
}

/* An expression nests at most KILN_FLEX_MAX_DEPTH levels (parentheses, calls, indices,
 * ?: branches, unary operators): deeper is an error naming the limit and the column,
 * not a stack overflow (10,000 parentheses or calls, 50,000 '-' overflowed it); at the
 * limit it parses. The message puts the reason first and quotes the long text short. */
static void deep_nesting_is_a_clear_error(void **state)
{
    (void)state;
    size_t n = 50000;
    char *t = malloc(6 * n + 64);
    assert_non_null(t);
    const struct {
        const char *open, *close;
        size_t count;
    } deep[] = {{"(", ")", 10000}, {"-", "", 50000}, {"!", "", 50000}, {"tanh(", ")", 10000}, {"abs(", ")", 10000},
                {"c0[", "]", 10000}, {"1 ? ", " : 0", 10000}};
    for (size_t c = 0; c < sizeof deep / sizeof deep[0]; c++) {
        t[0] = 0;
        char *p = t;
        for (size_t i = 0; i < deep[c].count; i++) p += sprintf(p, "%s", deep[c].open);
        p += sprintf(p, "score");
        for (size_t i = 0; i < deep[c].count; i++) p += sprintf(p, "%s", deep[c].close);
        int64_t one = 1;
        kiln_tensor_t *cap = kiln_zeros(&one, 1, KILN_DTYPE_I64);
        kiln_flex_t *f = NULL;
        kiln_clear_error();
        assert_int_not_equal(kiln_flex_new(t, NULL, &cap, 1, &f), KILN_OK);
        assert_null(f);
        const char *e = kiln_last_error();
        const char *want = "flex score_mod: nested more than KILN_FLEX_MAX_DEPTH (256) levels deep, at column ";
        if (strncmp(e, want, strlen(want))) fail_msg("%s...: %s", deep[c].open, e);
        assert_non_null(strstr(e, "…")); /* the text quoted short */
        assert_true(strlen(e) < 300);
    }
    /* at the limit: the root is one level, so 255 parentheses (and 255 '-') parse */
    for (int c = 0; c < 2; c++) {
        char *p = t;
        for (int i = 0; i < KILN_FLEX_MAX_DEPTH - 1; i++) *p++ = c ? '-' : '(';
        p += sprintf(p, "score");
        for (int i = 0; c == 0 && i < KILN_FLEX_MAX_DEPTH - 1; i++) *p++ = ')';
        *p = 0;
        kiln_flex_t *f = NULL;
        if (kiln_flex_new(t, NULL, NULL, 0, &f) != KILN_OK) fail_msg("%s", kiln_last_error());
        kiln_flex_free(f);
        p = t; /* one more is refused */
        for (int i = 0; i < KILN_FLEX_MAX_DEPTH; i++) *p++ = c ? '-' : '(';
        p += sprintf(p, "score");
        for (int i = 0; c == 0 && i < KILN_FLEX_MAX_DEPTH; i++) *p++ = ')';
        *p = 0;
        assert_int_not_equal(kiln_flex_new(t, NULL, NULL, 0, &f), KILN_OK);
    }
    free(t);
    kiln_clear_error();
}

/* A literal is a finite float: 1e400 (no C literal) and 1e39 (inf in the f32 kernels)
 * are parse errors naming the literal and its column, not "the C compiler failed"; a
 * whole number of 2^63 or more is a float, so the fused and dense paths (the oracle)
 * compute it the same. Preset numbers are read by core's strict parser: window:1e1,
 * 0x10, inf and 1e300 are refused (and the paged serving path refuses them the same
 * way, src/nn/gpt_config.c), as is a softcap that is not a normal positive float. */
static void literals_and_preset_numbers_are_strict(void **state)
{
    (void)state;
    expect_error("score * 1e400", NULL, 0,
                 "flex score_mod: a literal that is not a finite float (at most 3.4e38): 1e400, at column 9 of \"score * 1e400\"");
    expect_error("score + 1e39", NULL, 0, "a literal that is not a finite float (at most 3.4e38): 1e39, at column 9");
    expect_error(NULL, "kv_idx < 1e400", 0, "flex mask_mod: a literal that is not a finite float");
    expect_error("score + 0x10", NULL, 0, "unexpected text after the expression, at column 10");
    kiln_flex_t *f;
    const char *bad[] = {"window:inf", "window:1e300", "window:99999999999999999999", "window:0x10", "window:1e1",
                         "window:0", "window:-3", "window: 4", "window:", "prefix:inf", "prefix:1e1", "prefix:-1",
                         "softcap:1e-320", "softcap:0", "softcap:nan", "softcap:inf", "softcap:1e400", "softcap:0x1p3",
                         "causal+window:1e1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kiln_clear_error();
        if (kiln_flex_preset(bad[i], NULL, &f) == KILN_OK) fail_msg("%s was taken", bad[i]);
        if (strncmp(kiln_last_error(), "flex preset", 11)) fail_msg("%s: %s", bad[i], kiln_last_error());
    }
    assert_int_not_equal(kiln_flex_preset("window:1e1", NULL, &f), KILN_OK);
    assert_string_equal(kiln_last_error(),
                        "flex preset: W of window:W must be a whole number from 1 to 2147483647, got '1e1'");
    assert_int_not_equal(kiln_flex_preset("softcap:1e-320", NULL, &f), KILN_OK);
    assert_non_null(strstr(kiln_last_error(), "C of softcap:C (a normal positive float) must be a number from"));
    const char *good[] = {"window:16", "prefix:0", "softcap:30", "softcap:1.5e-38", "softcap:3e38"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        if (kiln_flex_preset(good[i], NULL, &f) != KILN_OK) fail_msg("%s: %s", good[i], kiln_last_error());
        kiln_flex_free(f);
    }
    /* 2^63 as a literal: a float on both paths; the fused kernel (c0 plain) against the
     * dense path (c0 wanting a gradient), 1e-6 */
    int64_t qs[4] = {1, 2, 6, 4}, one = 1;
    kiln_manual_seed(5);
    kiln_tensor_t *q = kiln_randn(qs, 4, KILN_DTYPE_F32), *k = kiln_randn(qs, 4, KILN_DTYPE_F32),
                  *v = kiln_randn(qs, 4, KILN_DTYPE_F32), *c = kiln_zeros(&one, 1, KILN_DTYPE_F32), *tracked = kiln_detach(c);
    kiln_tensor_set_requires_grad(tracked, true);
    const char *score = "score + c0[0] + (9223372036854775808 > kv_idx ? 0 : 100) + 9223372036854775808 * 0",
               *mask = "kv_idx < 9223372036854775808 && kv_idx <= q_idx";
    double *y[2];
    for (int dense = 0; dense < 2; dense++) {
        assert_int_equal(kiln_flex_new(score, mask, dense ? &tracked : &c, 1, &f), KILN_OK);
        y[dense] = host(kiln_flex_attention(q, k, v, f, NULL, 0, NULL));
        kiln_flex_free(f);
    }
    kiln_flex_t *causal;
    assert_int_equal(kiln_flex_preset("causal", NULL, &causal), KILN_OK);
    double *want = host(kiln_flex_attention(q, k, v, causal, NULL, 0, NULL));
    kiln_flex_free(causal);
    for (int64_t j = 0; j < 2 * 6 * 4; j++)
        if (!(fabs(y[0][j] - y[1][j]) <= 1e-6 && fabs(y[1][j] - want[j]) <= 1e-6))
            fail_msg("2^63: [%lld] fused %g, dense %g, causal %g", (long long)j, y[0][j], y[1][j], want[j]);
    free(y[0]);
    free(y[1]);
    free(want);
    kiln_clear_error();
}

/* x and want (n values) agree: both NaN, equal, or within tol relative to want; else
 * fails naming what. */
static void same_or_both_nan(const double *x, const double *want, int64_t n, double tol, const char *what)
{
    for (int64_t i = 0; i < n; i++)
        if (!((isnan(x[i]) && isnan(want[i])) || x[i] == want[i] || fabs(x[i] - want[i]) <= tol * (1 + fabs(want[i]))))
            fail_msg("%s: [%lld] fused %g, dense %g", what, (long long)i, x[i], want[i]);
}

/* Edge scores, the fused kernels (c0 plain) against the dense path (c0 wanting a
 * gradient) as the oracle, f32 and f64, T 70 (three blocks of keys): a NaN score (at a
 * row's first key, at a later block's key, in place of a whole row, behind the mask) and
 * a NaN in q make the row's output and log-sum-exp NaN on both, and leave the other rows
 * equal (1e-5), as does a +inf score (inf - inf); a row whose every score is -inf from
 * the score modifier sees no key on both (zeros, log-sum-exp -inf, as a masked row, as
 * PyTorch's flex_attention), its gradients too. (On OpenCL, test_flex_opencl, the
 * device's kernels against the same oracle.) (Gradients under a NaN score are NaN on both paths but not at the same
 * positions: the dense path's where and softmax spread it to masked keys.) */
static void nan_and_infinite_scores_agree(void **state)
{
    (void)state;
    const struct {
        const char *score, *mask;
        bool nan_q, grads;
    } cases[] = {
        {"q_idx == 2 && kv_idx == 1 ? sqrt(-1.0) : score", NULL, false, false},
        {"kv_idx == 0 ? sqrt(-1.0) : score", "kv_idx <= q_idx", false, false},
        {"kv_idx == 40 ? sqrt(-1.0) : score", "kv_idx <= q_idx", false, false},
        {"q_idx == 3 ? sqrt(-1.0) : score", NULL, false, false},
        {"kv_idx > q_idx ? sqrt(-1.0) : score", "kv_idx <= q_idx", false, true},
        {"kv_idx == 5 ? 3e38 * 10 : score", NULL, false, false}, /* +inf (f32; f64: 3e39) */
        {"q_idx == 3 ? -3e38 * 10 : score", NULL, false, true}, /* -inf (f32) */
        {"q_idx == 3 ? -3e38 * 10 : score", "kv_idx <= q_idx", false, true},
        {"score", "kv_idx <= q_idx", true, false},
    };
    const int64_t T = 70, D = 8, qs[4] = {1, 2, T, D}, one = 1, n = 2 * T * D;
    for (int d = 0; d < 2; d++) {
        kiln_dtype dt = d ? KILN_DTYPE_F64 : KILN_DTYPE_F32;
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            /* -3e39 is no -inf in f64, and the fused backward's P = exp(s - L) loses a
             * row's log(Tk) against |L| that large: only f32's -inf is this case */
            if (dt == KILN_DTYPE_F64 && strstr(cases[c].score, "-3e38")) continue;
            kiln_manual_seed(5);
            kiln_tensor_t *q = kiln_randn(qs, 4, KILN_DTYPE_F64), *k = kiln_randn(qs, 4, KILN_DTYPE_F64),
                          *v = kiln_randn(qs, 4, KILN_DTYPE_F64);
            if (cases[c].nan_q) { /* q[0, 0, 3, 2] NaN: row 3's scores */
                double *x = host(q);
                x[3 * D + 2] = NAN;
                q = kiln_from_data(x, qs, 4, KILN_DTYPE_F64);
                free(x);
            }
            q = kiln_cast(q, dt), k = kiln_cast(k, dt), v = kiln_cast(v, dt);
            kiln_tensor_t *cap = kiln_zeros(&one, 1, dt), *tracked = kiln_detach(cap);
            kiln_tensor_set_requires_grad(tracked, true);
            char score[256], what[320];
            snprintf(score, sizeof score, "(%s) + c0[0]", cases[c].score);
            double *y[2], *l[2], *g[2][3];
            for (int dense = 0; dense < 2; dense++) {
                kiln_flex_t *f;
                if (kiln_flex_new(score, cases[c].mask, dense ? &tracked : &cap, 1, &f) != KILN_OK)
                    fail_msg("%s", kiln_last_error());
                kiln_tensor_t *in[3] = {kiln_detach(q), kiln_detach(k), kiln_detach(v)}, *lse;
                for (int i = 0; i < 3; i++) kiln_tensor_set_requires_grad(in[i], true);
                kiln_tensor_t *out = kiln_flex_attention(in[0], in[1], in[2], f, NULL, 0, &lse);
                y[dense] = host(out);
                l[dense] = host(lse);
                kiln_tensor_t *loss = kiln_add(kiln_sum(out, NULL, 0, false), kiln_sum(lse, NULL, 0, false));
                if (cases[c].grads && kiln_backward(loss) != KILN_OK) fail_msg("%s", kiln_last_error());
                for (int i = 0; i < 3; i++) g[dense][i] = cases[c].grads ? host(kiln_tensor_grad(in[i])) : NULL;
                kiln_flex_free(f);
            }
            snprintf(what, sizeof what, "%s | %s (%s)%s", cases[c].score, cases[c].mask ? cases[c].mask : "no mask",
                     kiln_dtype_name(dt), cases[c].nan_q ? ", a NaN in q" : "");
            char part[400];
            snprintf(part, sizeof part, "%s: y", what);
            same_or_both_nan(y[0], y[1], n, 1e-5, part);
            snprintf(part, sizeof part, "%s: lse", what);
            same_or_both_nan(l[0], l[1], 2 * T, 1e-5, part);
            bool any_nan = false;
            for (int64_t i = 0; i < 2 * T; i++) any_nan |= isnan(l[1][i]);
            if (strstr(cases[c].score, "sqrt(-1.0)") && !strstr(cases[c].score, "kv_idx > q_idx")) assert_true(any_nan);
            for (int i = 0; i < 3; i++) {
                snprintf(part, sizeof part, "%s: d%s", what, i == 0 ? "q" : i == 1 ? "k" : "v");
                if (g[0][i]) same_or_both_nan(g[0][i], g[1][i], n, 1e-5, part);
                free(g[0][i]);
                free(g[1][i]);
            }
            if (strstr(cases[c].score, "-3e38")) /* row 3 sees no key */
                for (int h = 0; h < 2; h++) {
                    assert_true(l[1][h * T + 3] == -INFINITY);
                    for (int64_t j = 0; j < D; j++) assert_true(y[1][(h * T + 3) * D + j] == 0);
                }
            for (int dense = 0; dense < 2; dense++) free(y[dense]), free(l[dense]);
        }
    }
    kiln_clear_error();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(presets_and_user_modifiers_match_the_definition, setup, teardown),
        cmocka_unit_test_setup_teardown(gradients_match_finite_differences, setup, teardown),
        cmocka_unit_test_setup_teardown(fused_gradients_match_the_oracle, setup, teardown),
        cmocka_unit_test_setup_teardown(long_rows_of_keys_match_the_oracle, setup, teardown),
        cmocka_unit_test_setup_teardown(panel_sized_blocks_match_the_oracle, setup, teardown),
        cmocka_unit_test_setup_teardown(panel_products_out_of_memory_fall_back, setup, teardown),
        cmocka_unit_test_setup_teardown(sixteen_bit_inputs_match_the_oracle, setup, teardown),
        cmocka_unit_test_setup_teardown(matches_pytorch_flex_attention, setup, teardown),
        cmocka_unit_test_setup_teardown(block_masks_classify_blocks, setup, teardown),
        cmocka_unit_test_setup_teardown(compiled_and_replayed_match_eager, setup, teardown),
        cmocka_unit_test_setup_teardown(block_mask_tensor_is_a_guarded_graph_input, setup, teardown),
        cmocka_unit_test_setup_teardown(kept_masks_follow_the_heads, setup, teardown),
        cmocka_unit_test_setup_teardown(cuda_source_compiles_with_nvrtc, setup, teardown),
        cmocka_unit_test_setup_teardown(captured_dtypes_read_as_their_values, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_modifiers_are_clear_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(deep_nesting_is_a_clear_error, setup, teardown),
        cmocka_unit_test_setup_teardown(literals_and_preset_numbers_are_strict, setup, teardown),
        cmocka_unit_test_setup_teardown(nan_and_infinite_scores_agree, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
