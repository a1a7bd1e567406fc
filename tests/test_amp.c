/* Mixed precision (autocast, kiln/ops.h): the op table's policy column, what a region
 * casts, gradients through it, and the numerics of bf16 and f16 kernels. Oracles are
 * computed here in float64 from the reduced-precision values themselves, with bf16
 * (8 significant bits) and f16 (11) rounding written out below; the tolerances are
 * stated beside each check. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln/nn.h"
#include "kiln/ops.h"
#include "kiln/optim.h"
#include "kiln/graph.h"
#include "kiln/dist.h"
#include "test_util.h"

/* Every test starts and ends with no region open and no policy overridden. */
static int amp_teardown(void **state)
{
    while (kiln_autocast_end() == KILN_OK) {
    }
    kiln_op_set_amp_policy("gelu", KILN_AMP_ANY);
    kiln_clear_error();
    return teardown(state);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static double urand(double lo, double hi) /* xorshift64 */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return lo + (hi - lo) * (double)(rng_state >> 11) * 0x1p-53;
}

/* x rounded to p significant bits, to nearest even (p = 8: bf16, 11: f16, 24: f32);
 * the exponent range is ignored, the values here stay far inside it. */
static double round_to(double x, int p)
{
    int e;
    double m = frexp(x, &e);
    return ldexp(nearbyint(ldexp(m, p)), e - p);
}

static void fill(double *v, int64_t n, int p, double lo, double hi)
{
    for (int64_t i = 0; i < n; i++) v[i] = round_to(urand(lo, hi), p);
}

/* v (exactly representable in dt) as a tensor of dtype dt. */
static kiln_tensor_t *tensor(const double *v, int nd, const int64_t *sh, kiln_dtype dt)
{
    kiln_tensor_t *t = kiln_cast(kiln_from_data(v, sh, nd, KILN_DTYPE_F64), dt);
    if (!t) fail_msg("tensor: %s", kiln_last_error());
    return t;
}

/* A macro, so that a failure names the caller's line. */
#define expect_dtype(t, dt) expect_dtype_at(t, dt, __LINE__)
static void expect_dtype_at(const kiln_tensor_t *t, kiln_dtype dt, int line)
{
    if (!t) fail_msg("line %d: op returned NULL: %s", line, kiln_last_error());
    if (kiln_tensor_dtype(t) != dt)
        fail_msg("line %d: dtype %s, want %s", line, kiln_dtype_name(kiln_tensor_dtype(t)), kiln_dtype_name(dt));
}

static void read_f64(kiln_tensor_t *t, double *out)
{
    kiln_tensor_t *c = kiln_cast(t, KILN_DTYPE_F64);
    if (!c) fail_msg("read: %s", kiln_last_error());
    assert_int_equal(kiln_tensor_to_host(c, out, kiln_tensor_nbytes(c)), KILN_OK);
}

static int op_id(const char *name)
{
    for (int i = 0; i < kiln_op_count(); i++)
        if (!strcmp(kiln_op_name(i), name)) return i;
    fail_msg("no op named %s", name);
    return -1;
}

static void test_policy_table_and_override(void **state)
{
    (void)state;
    static const struct {
        const char *op;
        kiln_amp_policy p;
    } want[] = {
        {"matmul", KILN_AMP_LOW},      {"attention", KILN_AMP_LOW}, {"softmax", KILN_AMP_F32},
        {"log_softmax", KILN_AMP_F32}, {"layer_norm", KILN_AMP_F32}, {"rms_norm", KILN_AMP_F32},
        {"cross_entropy", KILN_AMP_F32}, {"sum", KILN_AMP_F32},      {"add", KILN_AMP_ANY},
        {"gelu", KILN_AMP_ANY},        {"cast", KILN_AMP_ANY},      {"embedding", KILN_AMP_ANY},
        {"grouped_matmul", KILN_AMP_LOW}, {"topk", KILN_AMP_ANY},   {"moe_sort", KILN_AMP_ANY},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (kiln_op_amp_policy(op_id(want[i].op)) != want[i].p)
            fail_msg("%s: policy %s, want %s", want[i].op, kiln_amp_policy_name(kiln_op_amp_policy(op_id(want[i].op))),
                     kiln_amp_policy_name(want[i].p));

    /* Overriding gelu to LOW makes it run in bf16 under a bf16 region. */
    int64_t sh[1] = {5};
    double v[5] = {-1, -0.5, 0, 0.5, 1};
    kiln_tensor_t *x = tensor(v, 1, sh, KILN_DTYPE_F32);
    assert_int_equal(kiln_autocast_begin(KILN_DTYPE_BF16), KILN_OK);
    expect_dtype(kiln_gelu(x, false), KILN_DTYPE_F32);
    assert_int_equal(kiln_op_set_amp_policy("gelu", KILN_AMP_LOW), KILN_OK);
    assert_int_equal(kiln_op_amp_policy(op_id("gelu")), KILN_AMP_LOW);
    expect_dtype(kiln_gelu(x, false), KILN_DTYPE_BF16);
    assert_int_equal(kiln_op_set_amp_policy("gelu", KILN_AMP_ANY), KILN_OK);
    assert_int_equal(kiln_op_amp_policy(op_id("gelu")), KILN_AMP_ANY);
    expect_dtype(kiln_gelu(x, false), KILN_DTYPE_F32);
    assert_int_equal(kiln_autocast_end(), KILN_OK);

    assert_int_equal(kiln_op_set_amp_policy("no_such_op", KILN_AMP_LOW), KILN_ERR_ARG);
    if (!strstr(kiln_last_error(), "no_such_op")) fail_msg("error does not name the op: %s", kiln_last_error());
}

static void test_region_casts_by_policy(void **state)
{
    (void)state;
    int64_t sh[2] = {3, 3};
    double v[9];
    fill(v, 9, 8, -1, 1);
    kiln_tensor_t *f = tensor(v, 2, sh, KILN_DTYPE_F32), *d = tensor(v, 2, sh, KILN_DTYPE_F64);
    kiln_tensor_t *h = tensor(v, 2, sh, KILN_DTYPE_BF16);

    assert_int_equal(kiln_autocast_dtype(), KILN_DTYPE_F32);
    expect_dtype(kiln_matmul(f, f), KILN_DTYPE_F32);

    assert_int_equal(kiln_autocast_begin(KILN_DTYPE_BF16), KILN_OK);
    assert_int_equal(kiln_autocast_dtype(), KILN_DTYPE_BF16);
    expect_dtype(kiln_matmul(f, f), KILN_DTYPE_BF16);
    int64_t s4[4] = {1, 1, 3, 3};
    kiln_tensor_t *f4 = kiln_reshape(f, s4, 4);
    expect_dtype(kiln_attention(f4, f4, f4, true, 0), KILN_DTYPE_BF16);
    expect_dtype(kiln_softmax(h, -1), KILN_DTYPE_F32);
    expect_dtype(kiln_add(h, f), KILN_DTYPE_F32); /* ANY: promoted as always */
    expect_dtype(kiln_matmul(d, d), KILN_DTYPE_F64);
    /* An f32 region inside casts nothing; ending it returns to bf16. */
    assert_int_equal(kiln_autocast_begin(KILN_DTYPE_F32), KILN_OK);
    assert_int_equal(kiln_autocast_dtype(), KILN_DTYPE_F32);
    expect_dtype(kiln_matmul(f, f), KILN_DTYPE_F32);
    expect_dtype(kiln_softmax(h, -1), KILN_DTYPE_BF16);
    assert_int_equal(kiln_autocast_end(), KILN_OK);
    assert_int_equal(kiln_autocast_dtype(), KILN_DTYPE_BF16);
    expect_dtype(kiln_matmul(f, f), KILN_DTYPE_BF16);
    assert_int_equal(kiln_autocast_end(), KILN_OK);

    assert_int_equal(kiln_autocast_begin(KILN_DTYPE_F16), KILN_OK);
    expect_dtype(kiln_matmul(f, f), KILN_DTYPE_F16);
    assert_int_equal(kiln_autocast_end(), KILN_OK);
    assert_int_equal(kiln_autocast_dtype(), KILN_DTYPE_F32);
    expect_dtype(kiln_matmul(f, f), KILN_DTYPE_F32);

    assert_int_equal(kiln_autocast_end(), KILN_ERR_ARG);
    assert_int_equal(kiln_autocast_begin(KILN_DTYPE_I32), KILN_ERR_DTYPE);
    assert_int_equal(kiln_autocast_dtype(), KILN_DTYPE_F32);
    /* Eight levels open, a ninth refused; eight ends close them all. */
    for (int i = 0; i < 8; i++) assert_int_equal(kiln_autocast_begin(i % 2 ? KILN_DTYPE_F16 : KILN_DTYPE_BF16), KILN_OK);
    assert_true(kiln_autocast_begin(KILN_DTYPE_BF16) < 0);
    assert_int_equal(kiln_autocast_dtype(), KILN_DTYPE_F16);
    for (int i = 0; i < 8; i++) assert_int_equal(kiln_autocast_end(), KILN_OK);
    assert_int_equal(kiln_autocast_end(), KILN_ERR_ARG);
    expect_dtype(kiln_matmul(f, f), KILN_DTYPE_F32);
}

/* The autocast type seen while backward runs, recorded by the grad-ready hook. */
static kiln_status record_dtype(void *ctx, kiln_tensor_t *leaf)
{
    (void)leaf;
    *(kiln_dtype *)ctx = kiln_autocast_dtype();
    return KILN_OK;
}

enum { GM = 6, GK = 40, GN = 9 };

/* grads of sum(cast(a @ w in a bf16 region, f32)) for f32 leaves holding va, vw;
 * backward inside the region or after it. */
static void amp_grads(const double *va, const double *vw, bool inside, double *ga, double *gw)
{
    int64_t sa[2] = {GM, GK}, sw[2] = {GK, GN};
    kiln_tensor_t *a = tensor(va, 2, sa, KILN_DTYPE_F32), *w = tensor(vw, 2, sw, KILN_DTYPE_F32);
    kiln_tensor_set_requires_grad(a, true);
    kiln_tensor_set_requires_grad(w, true);
    assert_int_equal(kiln_autocast_begin(KILN_DTYPE_BF16), KILN_OK);
    kiln_tensor_t *p = kiln_matmul(a, w);
    expect_dtype(p, KILN_DTYPE_BF16);
    kiln_tensor_t *y = kiln_sum(kiln_cast(p, KILN_DTYPE_F32), NULL, 0, false);
    if (!inside) assert_int_equal(kiln_autocast_end(), KILN_OK);
    kiln_dtype seen = KILN_DTYPE_COUNT;
    kiln_set_grad_ready_hook(record_dtype, &seen);
    kiln_status s = kiln_backward(y);
    kiln_set_grad_ready_hook(NULL, NULL);
    if (s != KILN_OK) fail_msg("backward: %s", kiln_last_error());
    assert_int_equal(seen, KILN_DTYPE_F32); /* paused during backward */
    if (inside) {
        assert_int_equal(kiln_autocast_dtype(), KILN_DTYPE_BF16); /* and resumed after */
        assert_int_equal(kiln_autocast_end(), KILN_OK);
    }
    expect_dtype(kiln_tensor_grad(a), KILN_DTYPE_F32);
    expect_dtype(kiln_tensor_grad(w), KILN_DTYPE_F32);
    read_f64(kiln_tensor_grad(a), ga);
    read_f64(kiln_tensor_grad(w), gw);
}

/* Oracle: the upstream grad is ones (bf16), so grad_a = round_bf16(ones @ round_bf16(w)^T)
 * and grad_w = round_bf16(round_bf16(a)^T @ ones), sums of n terms in float64 here. kiln
 * sums in f32 and rounds once: |got - exact| <= 2^-8 |exact| + 1.01 n 2^-24 sum|terms|. */
static void test_grads_through_autocast_match_the_bf16_oracle(void **state)
{
    (void)state;
    double va[GM * GK], vw[GK * GN], ga[GM * GK], gw[GK * GN], ga2[GM * GK], gw2[GK * GN];
    fill(va, GM * GK, 24, -2, 2); /* f32 values, rounded to bf16 by the region's cast */
    fill(vw, GK * GN, 24, -2, 2);
    amp_grads(va, vw, false, ga, gw);
    double worst = 0;
    for (int k = 0; k < GK; k++) {
        double s = 0, sm = 0, t = 0, tm = 0; /* grad_a[., k] and grad_w[k, .] with their sum|terms| */
        for (int n = 0; n < GN; n++) s += round_to(vw[k * GN + n], 8), sm += fabs(round_to(vw[k * GN + n], 8));
        for (int i = 0; i < GM; i++) t += round_to(va[i * GK + k], 8), tm += fabs(round_to(va[i * GK + k], 8));
        for (int i = 0; i < GM; i++) {
            double e = fabs(ga[i * GK + k] - s) / (0x1p-8 * fabs(s) + 1.01 * GN * 0x1p-24 * sm);
            if (!(e <= 1)) fail_msg("grad_a[%d,%d] = %.9g, oracle %.9g", i, k, ga[i * GK + k], s);
            worst = fmax(worst, e);
        }
        for (int n = 0; n < GN; n++) {
            double e = fabs(gw[k * GN + n] - t) / (0x1p-8 * fabs(t) + 1.01 * GM * 0x1p-24 * tm);
            if (!(e <= 1)) fail_msg("grad_w[%d,%d] = %.9g, oracle %.9g", k, n, gw[k * GN + n], t);
            worst = fmax(worst, e);
        }
    }
    printf("# grads through a bf16 matmul: worst error %.3f of the tolerance\n", worst);
    amp_grads(va, vw, true, ga2, gw2);
    assert_memory_equal(ga, ga2, sizeof ga);
    assert_memory_equal(gw, gw2, sizeof gw);
}

/* a (B,M,K) or (M,K) when B = 0, b (K,N), each built transposed (a view of the other
 * layout) when ta/tb; values rounded to p bits and matmul run in dt, on dt tensors, or
 * with amp on f32 tensors inside a dt region. Oracle: the float64 sum of the products
 * of those values (exact products; its own rounding, < K 2^-53, is negligible). kiln
 * sums in f32 and rounds once to dt: |got - exact| <= 2^-p |exact| + 1.01 K 2^-24
 * sum|a_i b_i| (+ 2^-25 for f16's subnormal spacing). Returns the worst error / tol. */
static double check_matmul(int64_t B, int64_t M, int64_t K, int64_t N, bool ta, bool tb, kiln_dtype dt, bool amp)
{
    int p = dt == KILN_DTYPE_BF16 ? 8 : 11;
    int64_t nb = B ? B : 1, na = nb * M * K;
    /* a, b, the result, and room for a transposed copy of a or b */
    double *a = malloc(sizeof(double) * (size_t)(na + K * N + nb * M * N + (na > K * N ? na : K * N)));
    double *b = a + na, *c = b + K * N, *at = c + nb * M * N;
    fill(a, na, p, -2, 2);
    fill(b, K * N, p, -2, 2);
    kiln_dtype made = amp ? KILN_DTYPE_F32 : dt;
    kiln_tensor_t *ta_t, *tb_t;
    if (ta) { /* store a^T, view it back as a */
        for (int64_t q = 0; q < nb; q++)
            for (int64_t i = 0; i < M; i++)
                for (int64_t k = 0; k < K; k++) at[(q * K + k) * M + i] = a[(q * M + i) * K + k];
        int64_t sh[3] = {nb, K, M};
        ta_t = kiln_transpose(tensor(at, B ? 3 : 2, B ? sh : sh + 1, made), -1, -2);
    } else {
        int64_t sh[3] = {nb, M, K};
        ta_t = tensor(a, B ? 3 : 2, B ? sh : sh + 1, made);
    }
    if (tb) {
        for (int64_t k = 0; k < K; k++)
            for (int64_t n = 0; n < N; n++) at[n * K + k] = b[k * N + n];
        int64_t sh[2] = {N, K};
        tb_t = kiln_transpose(tensor(at, 2, sh, made), 0, 1);
    } else {
        int64_t sh[2] = {K, N};
        tb_t = tensor(b, 2, sh, made);
    }
    if (amp) assert_int_equal(kiln_autocast_begin(dt), KILN_OK);
    kiln_tensor_t *y = kiln_matmul(ta_t, tb_t);
    if (amp) assert_int_equal(kiln_autocast_end(), KILN_OK);
    expect_dtype(y, dt);
    assert_int_equal(kiln_tensor_numel(y), nb * M * N);
    read_f64(y, c);
    double worst = 0;
    for (int64_t q = 0; q < nb; q++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < N; n++) {
                double s = 0, m = 0;
                for (int64_t k = 0; k < K; k++) {
                    double t = a[(q * M + i) * K + k] * b[k * N + n];
                    s += t;
                    m += fabs(t);
                }
                double tol = ldexp(fabs(s), -p) + 1.01 * (double)K * 0x1p-24 * m + (p == 11 ? 0x1p-25 : 0);
                double got = c[(q * M + i) * N + n], e = fabs(got - s) / tol;
                if (!(e <= 1))
                    fail_msg("%s matmul %lldx%lldx%lldx%lld [%lld,%lld,%lld] = %.9g, oracle %.9g", kiln_dtype_name(dt),
                             (long long)B, (long long)M, (long long)K, (long long)N, (long long)q, (long long)i,
                             (long long)n, got, s);
                worst = fmax(worst, e);
            }
    free(a);
    return worst;
}

static void test_half_matmul_is_the_rounded_exact_product(void **state)
{
    (void)state;
    static const struct {
        int64_t B, M, K, N;
        bool ta, tb, amp;
    } cases[] = {
        {0, 1, 64, 33, false, false, false}, {0, 37, 53, 29, false, false, false}, {0, 37, 53, 29, false, false, true},
        {0, 9, 300, 17, false, false, false}, {0, 16, 600, 48, false, false, false}, {3, 7, 45, 11, false, false, false},
        {0, 13, 70, 21, true, false, false}, {0, 13, 70, 21, false, true, false}, {2, 5, 300, 6, true, true, true},
    };
    static const kiln_dtype dts[2] = {KILN_DTYPE_BF16, KILN_DTYPE_F16};
    for (int d = 0; d < 2; d++) {
        double worst = 0;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            worst = fmax(worst, check_matmul(cases[i].B, cases[i].M, cases[i].K, cases[i].N, cases[i].ta, cases[i].tb,
                                             dts[d], cases[i].amp));
        printf("# %s matmul: worst error %.3f of the tolerance\n", kiln_dtype_name(dts[d]), worst);
    }
}

/* got and want hold the same 16-bit bits (bf16 unless said). */
#define expect_same_bits(what, got, want) expect_same_bits_as(what, got, want, KILN_DTYPE_BF16)
static void expect_same_bits_as(const char *what, kiln_tensor_t *got, kiln_tensor_t *want, kiln_dtype dt)
{
    expect_dtype(got, dt);
    expect_dtype(want, dt);
    int64_t n = kiln_tensor_numel(got);
    assert_int_equal(n, kiln_tensor_numel(want));
    uint16_t *g = malloc(sizeof(uint16_t) * (size_t)n * 2), *w = g + n;
    assert_int_equal(kiln_tensor_to_host(got, g, sizeof(uint16_t) * (size_t)n), KILN_OK);
    assert_int_equal(kiln_tensor_to_host(want, w, sizeof(uint16_t) * (size_t)n), KILN_OK);
    for (int64_t i = 0; i < n; i++)
        if (g[i] != w[i]) fail_msg("%s: element %lld is 0x%04x, want 0x%04x", what, (long long)i, g[i], w[i]);
    free(g);
}

#define F32(t) kiln_cast(t, KILN_DTYPE_F32)
#define BF16(t) kiln_cast(t, KILN_DTYPE_BF16)

/* The f32-only kernels take bf16 by widening: their documented result is
 * round_bf16(the f32 kernel on the widened values), so kiln's own f32 kernel on the same
 * values, rounded, is the oracle and the match is bitwise. The softmax rows are also
 * checked against float64, so that kiln is not only compared with itself. */
static void test_widened_kernels_round_the_f32_kernel(void **state)
{
    (void)state;
    enum { R = 6, C = 37 };
    double vx[R * C], vw[C], vb[C];
    fill(vx, R * C, 8, -4, 4);
    fill(vw, C, 8, 0.5, 1.5);
    fill(vb, C, 8, -1, 1);
    int64_t sx[2] = {R, C}, sc[1] = {C};
    kiln_tensor_t *x = tensor(vx, 2, sx, KILN_DTYPE_BF16), *w = tensor(vw, 1, sc, KILN_DTYPE_BF16);
    kiln_tensor_t *b = tensor(vb, 1, sc, KILN_DTYPE_BF16);

    kiln_tensor_t *sm = kiln_softmax(x, -1);
    expect_same_bits("softmax", sm, BF16(kiln_softmax(F32(x), -1)));
    expect_same_bits("layer_norm", kiln_layer_norm(x, w, b, 1e-5),
                     BF16(kiln_layer_norm(F32(x), F32(w), F32(b), 1e-5)));
    expect_same_bits("rms_norm", kiln_rms_norm(x, w, 1e-6), BF16(kiln_rms_norm(F32(x), F32(w), 1e-6)));
    /* Attention (forward): f16 everywhere, and bf16 on devices; the cpu's bf16 attention
     * rounds P as well (test_bf16_attention_matches_float64 checks it, and every
     * device's gradients, against float64). */
    for (int h = 0; h < 2; h++) {
        kiln_dtype dt = h ? KILN_DTYPE_F16 : KILN_DTYPE_BF16;
        if (dt == KILN_DTYPE_BF16 && !strcmp(kiln_device(), "cpu")) continue;
        double vq[3 * 80];
        fill(vq, 3 * 80, 8, -1, 1);
        int64_t sq[4] = {1, 2, 5, 8};
        kiln_tensor_t *q = tensor(vq, 4, sq, dt), *k = tensor(vq + 80, 4, sq, dt), *v = tensor(vq + 160, 4, sq, dt);
        expect_same_bits_as("attention", kiln_attention(q, k, v, true, 0),
                            kiln_cast(kiln_attention(F32(q), F32(k), F32(v), true, 0), dt), dt);
    }

    /* float64 softmax: the f32 kernel is within 2^-18 |exact| (a few dozen f32 ulps),
     * and one rounding to bf16 adds at most 2^-8 |value|. */
    double got[R * C], worst = 0;
    read_f64(sm, got);
    for (int r = 0; r < R; r++) {
        double mx = -INFINITY, z = 0;
        for (int c = 0; c < C; c++) mx = fmax(mx, vx[r * C + c]);
        for (int c = 0; c < C; c++) z += exp(vx[r * C + c] - mx);
        for (int c = 0; c < C; c++) {
            double want = exp(vx[r * C + c] - mx) / z, e = fabs(got[r * C + c] - want) / ((0x1p-8 + 0x1p-17) * want);
            if (!(e <= 1)) fail_msg("softmax[%d,%d] = %.9g, float64 %.9g", r, c, got[r * C + c], want);
            worst = fmax(worst, e);
        }
    }
    printf("# bf16 softmax against float64: worst error %.3f of the tolerance\n", worst);
}

/* bf16 attention, forward and backward, against float64 on the same bf16 inputs. kiln
 * forms its products from bf16 values with f32 sums and rounds P = softmax(s Q K^T) and
 * dS = P (dP - rowsum(dO O)) to bf16 before multiplying them, as PyTorch's bf16
 * attention does; the oracle computes everything exactly. Tolerances, from those
 * roundings (2^-8 each, relative): O[i,d] within 2^-7 sum_j P_ij |V_jd| + 2^-8 |O| +
 * 2^-20; each gradient within 2^-5 of its largest element (P and dS rounded, then the
 * result; sums of up to 70 terms). Shapes: grouped heads (H 4, Hkv 2), causal and not,
 * Tq 70 > the kernel's 64-row tiles. */
static void attention_f64(const double *q, const double *k, const double *v, const double *g, int H, int Hkv, int T,
                          int D, bool causal, double *o, double *dq, double *dk, double *dv)
{
    double scale = 1.0 / sqrt(D), p[70], dp[70];
    memset(dk, 0, sizeof(double) * (size_t)(Hkv * T * D));
    memset(dv, 0, sizeof(double) * (size_t)(Hkv * T * D));
    for (int h = 0; h < H; h++) {
        int hk = h / (H / Hkv);
        const double *Q = q + h * T * D, *K = k + hk * T * D, *V = v + hk * T * D, *G = g + h * T * D;
        for (int i = 0; i < T; i++) {
            int nk = causal ? i + 1 : T;
            double mx = -INFINITY, z = 0, di = 0;
            for (int j = 0; j < nk; j++) {
                double sc = 0;
                for (int d = 0; d < D; d++) sc += Q[i * D + d] * K[j * D + d];
                p[j] = sc * scale;
                mx = fmax(mx, p[j]);
            }
            for (int j = 0; j < nk; j++) z += (p[j] = exp(p[j] - mx));
            for (int j = 0; j < nk; j++) p[j] /= z;
            for (int d = 0; d < D; d++) {
                double acc = 0;
                for (int j = 0; j < nk; j++) acc += p[j] * V[j * D + d];
                o[(h * T + i) * D + d] = acc;
                di += acc * G[i * D + d];
            }
            for (int j = 0; j < nk; j++) {
                double acc = 0;
                for (int d = 0; d < D; d++) acc += G[i * D + d] * V[j * D + d];
                dp[j] = p[j] * (acc - di);
                for (int d = 0; d < D; d++) {
                    dv[(hk * T + j) * D + d] += p[j] * G[i * D + d];
                    dk[(hk * T + j) * D + d] += scale * dp[j] * Q[i * D + d];
                }
            }
            for (int d = 0; d < D; d++) {
                double acc = 0;
                for (int j = 0; j < nk; j++) acc += dp[j] * K[j * D + d];
                dq[(h * T + i) * D + d] = scale * acc;
            }
        }
    }
}

static void expect_close_normwise(const char *what, const double *got, const double *want, int64_t n, double rel)
{
    double big = 0, worst = 0;
    for (int64_t i = 0; i < n; i++) big = fmax(big, fabs(want[i]));
    for (int64_t i = 0; i < n; i++) {
        if (!(fabs(got[i] - want[i]) <= rel * big))
            fail_msg("%s[%lld] = %.9g, float64 %.9g (tolerance %.3g)", what, (long long)i, got[i], want[i], rel * big);
        worst = fmax(worst, fabs(got[i] - want[i]) / (rel * big));
    }
    printf("# bf16 attention %s: worst error %.3f of the tolerance\n", what, worst);
}

static void test_bf16_attention_matches_float64(void **state)
{
    (void)state;
    enum { H = 4, HKV = 2, T = 70, D = 16 };
    static double vq[H * T * D], vk[HKV * T * D], vv[HKV * T * D], vg[H * T * D], o[H * T * D], dq[H * T * D],
        dk[HKV * T * D], dv[HKV * T * D], got[H * T * D];
    fill(vq, H * T * D, 8, -2, 2);
    fill(vk, HKV * T * D, 8, -2, 2);
    fill(vv, HKV * T * D, 8, -1, 1);
    fill(vg, H * T * D, 8, -1, 1);
    for (int causal = 0; causal < 2; causal++) {
        int64_t sq[4] = {1, H, T, D}, sk[4] = {1, HKV, T, D};
        kiln_tensor_t *q = tensor(vq, 4, sq, KILN_DTYPE_BF16), *k = tensor(vk, 4, sk, KILN_DTYPE_BF16);
        kiln_tensor_t *v = tensor(vv, 4, sk, KILN_DTYPE_BF16), *g = tensor(vg, 4, sq, KILN_DTYPE_BF16);
        kiln_tensor_set_requires_grad(q, true);
        kiln_tensor_set_requires_grad(k, true);
        kiln_tensor_set_requires_grad(v, true);
        kiln_tensor_t *y = kiln_attention(q, k, v, causal, 0);
        expect_dtype(y, KILN_DTYPE_BF16);
        attention_f64(vq, vk, vv, vg, H, HKV, T, D, causal, o, dq, dk, dv);
        read_f64(y, got);
        double worst = 0, scale = 1.0 / sqrt(D);
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                /* sum_j P_ij |V_jd| <= max_j |V_jd| */
                int nk = causal ? i + 1 : T;
                for (int d = 0; d < D; d++) {
                    double vmax = 0;
                    for (int j = 0; j < nk; j++) vmax = fmax(vmax, fabs(vv[((h / 2) * T + j) * D + d]));
                    int64_t at = (h * T + i) * D + d;
                    double tol = 0x1p-7 * vmax + 0x1p-8 * fabs(o[at]) + 0x1p-20, e = fabs(got[at] - o[at]) / tol;
                    if (!(e <= 1))
                        fail_msg("attention (causal %d) O[%d,%d,%d] = %.9g, float64 %.9g", causal, h, i, d, got[at],
                                 o[at]);
                    worst = fmax(worst, e);
                }
            }
        printf("# bf16 attention (causal %d, scale %.3f): worst error %.3f of the tolerance\n", causal, scale, worst);
        kiln_tensor_t *loss = kiln_sum(kiln_cast(kiln_mul(y, g), KILN_DTYPE_F32), NULL, 0, false);
        if (kiln_backward(loss) != KILN_OK) fail_msg("backward: %s", kiln_last_error());
        expect_dtype(kiln_tensor_grad(q), KILN_DTYPE_BF16);
        read_f64(kiln_tensor_grad(q), got);
        expect_close_normwise("dq", got, dq, H * T * D, 0x1p-5);
        read_f64(kiln_tensor_grad(k), got);
        expect_close_normwise("dk", got, dk, HKV * T * D, 0x1p-5);
        read_f64(kiln_tensor_grad(v), got);
        expect_close_normwise("dv", got, dv, HKV * T * D, 0x1p-5);
    }
}

/* autocast casts a permuted view of a contiguous tensor (kiln_linear's transpose(w)) as
 * the tensor it views and permutes the cast back. Oracle: the same product with the
 * casts written out by hand, outside any region: equal bitwise, and so are the
 * gradients of the f32 leaves (a wrong permutation would move elements). */
static void test_autocast_casts_views_as_stored_bitwise(void **state)
{
    (void)state;
    double vx[2 * 5 * 24], vw[2 * 9 * 24];
    fill(vx, 2 * 5 * 24, 24, -1, 1);
    fill(vw, 2 * 9 * 24, 24, -1, 1);
    int64_t sx[3] = {2, 5, 24}, sw[3] = {9, 2, 24};
    double got[2][2 * 5 * 9 + 2 * 9 * 24];
    for (int by_hand = 0; by_hand < 2; by_hand++) {
        kiln_tensor_t *x = tensor(vx, 3, sx, KILN_DTYPE_F32), *w = tensor(vw, 3, sw, KILN_DTYPE_F32);
        kiln_tensor_set_requires_grad(x, true);
        kiln_tensor_set_requires_grad(w, true);
        /* w (9, 2, 24) viewed as (2, 24, 9): a permutation of a contiguous tensor */
        kiln_tensor_t *wv = kiln_permute(w, (int[]){1, 2, 0}, 3), *y;
        if (by_hand) {
            y = kiln_matmul(kiln_cast(x, KILN_DTYPE_BF16), kiln_contiguous(kiln_cast(wv, KILN_DTYPE_BF16)));
        } else {
            assert_int_equal(kiln_autocast_begin(KILN_DTYPE_BF16), KILN_OK);
            y = kiln_matmul(x, wv);
            assert_int_equal(kiln_autocast_end(), KILN_OK);
        }
        expect_dtype(y, KILN_DTYPE_BF16);
        read_f64(y, got[by_hand]);
        kiln_tensor_t *loss = kiln_sum(kiln_cast(kiln_mul(y, y), KILN_DTYPE_F32), NULL, 0, false);
        if (kiln_backward(loss) != KILN_OK) fail_msg("backward: %s", kiln_last_error());
        read_f64(kiln_tensor_grad(w), got[by_hand] + 2 * 5 * 9);
    }
    assert_memory_equal(got[0], got[1], sizeof(double) * (2 * 5 * 9 + 2 * 9 * 24));
}

/* Under a bf16 region kiln_linear's product is bf16 and its f32 bias is cast to bf16, so
 * the layer is bf16. Oracle: float64 x w^T + b of the bf16-rounded values; two roundings
 * to bf16 (product, then sum) and f32 accumulation: |got - exact| <= 1.01 2^-7
 * (|xw| + |b|) + 1.01 K 2^-24 sum|x_i w_i|. */
static void test_linear_under_bf16_is_bf16_with_an_f32_bias(void **state)
{
    (void)state;
    enum { M = 4, K = 24, N = 5 };
    double vx[M * K], vw[N * K], vb[N], got[M * N];
    fill(vx, M * K, 24, -1, 1);
    fill(vw, N * K, 24, -1, 1);
    fill(vb, N, 24, -1, 1);
    int64_t sx[2] = {M, K}, sw[2] = {N, K}, sb[1] = {N};
    kiln_tensor_t *x = tensor(vx, 2, sx, KILN_DTYPE_F32), *w = tensor(vw, 2, sw, KILN_DTYPE_F32);
    kiln_tensor_t *b = tensor(vb, 1, sb, KILN_DTYPE_F32);
    expect_dtype(kiln_linear(x, w, b), KILN_DTYPE_F32);
    assert_int_equal(kiln_autocast_begin(KILN_DTYPE_BF16), KILN_OK);
    kiln_tensor_t *y = kiln_linear(x, w, b);
    assert_int_equal(kiln_autocast_end(), KILN_OK);
    expect_dtype(y, KILN_DTYPE_BF16);
    assert_int_equal(kiln_tensor_numel(y), M * N);
    read_f64(y, got);
    for (int i = 0; i < M; i++)
        for (int n = 0; n < N; n++) {
            double s = 0, m = 0, bb = round_to(vb[n], 8);
            for (int k = 0; k < K; k++) {
                double t = round_to(vx[i * K + k], 8) * round_to(vw[n * K + k], 8);
                s += t;
                m += fabs(t);
            }
            double tol = 1.01 * 0x1p-7 * (fabs(s) + fabs(bb)) + 1.01 * K * 0x1p-24 * m;
            if (!(fabs(got[i * N + n] - (s + bb)) <= tol))
                fail_msg("linear[%d,%d] = %.9g, oracle %.9g", i, n, got[i * N + n], s + bb);
        }
}

/* The scaler's rule, as torch.amp.GradScaler's (its update_scale): an inf or NaN norm
 * skips the step and multiplies the scale by backoff; `interval` finite ones in a row
 * multiply it by growth. */
static void test_loss_scaler_backs_off_and_grows(void **state)
{
    kiln_loss_scaler s = kiln_loss_scaler_default();
    assert_true(s.scale == 65536.0 && s.growth == 2.0 && s.backoff == 0.5 && s.interval == 2000);
    s.interval = 3;
    assert_false(kiln_loss_scaler_update(&s, INFINITY));
    assert_true(s.scale == 32768.0);
    assert_false(kiln_loss_scaler_update(&s, NAN));
    assert_true(s.scale == 16384.0 && s.skipped == 2);
    assert_true(kiln_loss_scaler_update(&s, 1.0));
    assert_true(kiln_loss_scaler_update(&s, 1.0));
    assert_true(s.scale == 16384.0);
    assert_true(kiln_loss_scaler_update(&s, 1.0)); /* the third good step in a row */
    assert_true(s.scale == 32768.0 && s.good == 0);
    assert_true(kiln_loss_scaler_update(&s, 1.0));
    assert_false(kiln_loss_scaler_update(&s, INFINITY)); /* an overflow restarts the count */
    assert_true(s.scale == 16384.0 && s.good == 0 && s.skipped == 3);
}

/* An f16 training step whose scaled loss overflows f16 (scale 2^40: the gradients of the
 * f16 matmuls become inf) is skipped inside the step: the parameters and the
 * optimizer's step count stay as they were, the norm given back is not finite and the
 * scaler, updated from it, halves its scale; the next step at a scale that fits is
 * taken, as the first step (bias corrections of step 1). The same in the four ways a
 * step runs: eager, compiled (the skip is data in the graph, nothing read on the host),
 * and each with ZeRO-1's sharded update over a world of one. Oracle for the taken step:
 * the eager step's parameters; compiled within 1e-5 relative, ZeRO-1 within 1e-4 (its
 * norm is summed in another order); a step that counted the skipped one would take
 * step 2's bias corrections, about 3/4 of step 1's update (lr 1e-2: off by ~2.6e-3). */
static void test_f16_step_skipped_on_overflow(void **state)
{
    kiln_gpt_config c = kiln_gpt_config_gpt2();
    c.n_layer = 1;
    c.n_embd = 32;
    c.block_size = 8;
    c.vocab_size = 16;
    kiln_pg_t *pg;
    assert_int_equal(kiln_pg_new_from_env(&pg), KILN_OK);
    float want[32];
    for (int mode = 0; mode < 4; mode++) {
        bool compiled = mode & 1, zero = mode & 2;
        kiln_gpt_t *m;
        assert_int_equal(kiln_gpt_new(&c, 7, &m), KILN_OK);
        assert_int_equal(kiln_gpt_set_precision(m, KILN_DTYPE_F16), KILN_OK);
        int np = kiln_gpt_num_params(m);
        kiln_tensor_t *ps[64];
        assert_true(np <= 64);
        for (int i = 0; i < np; i++) ps[i] = kiln_gpt_param(m, i, NULL);
        kiln_optim_t *opt;
        kiln_zero1_t *z = NULL;
        assert_int_equal(kiln_adamw_new(ps, np, NULL, 0.9, 0.95, 1e-8, 0.1, &opt), KILN_OK);
        if (zero) assert_int_equal(kiln_zero1_new(pg, ps, np, NULL, 0.9, 0.95, 1e-8, 0.1, NULL, &z), KILN_OK);
        kiln_loss_scaler sc = kiln_loss_scaler_default();
        sc.scale = 0x1p40;
        kiln_gpt_step st = {.model = m, .opt = opt, .params = ps, .n_params = np, .clip = 1.0, .zero = z, .scaled = true};
        kiln_compiled_t *cs = NULL;
        if (compiled) assert_int_equal(kiln_compiled_new(kiln_gpt_train_step, &st, "f16_step", &cs), KILN_OK);
        int64_t ids[2 * 8];
        for (int i = 0; i < 16; i++) ids[i] = (i * 5 + 3) % 16;
        float w0[32], w1[32];
        kiln_scope_begin();
        kiln_tensor_t *x = kiln_from_data(ids, (int64_t[]){2, 8}, 2, KILN_DTYPE_I64);
        kiln_tensor_t *w = kiln_narrow(kiln_reshape(ps[0], (int64_t[]){-1}, 1), 0, 0, 32);
        double lr = 1e-2;
        kiln_tensor_t *in[4] = {x, x, kiln_from_data(&lr, (int64_t[]){1}, 1, KILN_DTYPE_F64),
                                kiln_scalar(sc.scale, KILN_DTYPE_F64)}, *out[2];
        assert_int_equal(kiln_tensor_to_host(w, w0, sizeof w0), KILN_OK);
        for (int k = 0; k < 2; k++) {
            int n;
            kiln_status s = compiled ? kiln_compiled_call(cs, in, 4, out, 2, &n) : kiln_gpt_train_step(&st, in, 4, out, &n);
            if (s != KILN_OK) fail_msg("mode %d step %d: %s", mode, k, kiln_last_error());
            double norm;
            assert_int_equal(kiln_tensor_item(out[1], &norm), KILN_OK);
            assert_null(kiln_tensor_grad(ps[0])); /* zeroed for the next step */
            assert_int_equal(kiln_tensor_to_host(w, w1, sizeof w1), KILN_OK);
            if (k == 0) { /* skipped */
                assert_false(isfinite(norm));
                assert_false(kiln_loss_scaler_update(&sc, norm));
                assert_true(sc.scale == 0x1p39 && sc.skipped == 1);
                if (!zero) assert_int_equal(kiln_optim_steps(opt), 0);
                if (memcmp(w0, w1, sizeof w0)) fail_msg("mode %d: the skipped step changed the weights", mode);
                sc.scale = 1024;
                assert_int_equal(kiln_fill_(in[3], sc.scale), KILN_OK);
            } else { /* taken */
                assert_true(isfinite(norm) && norm > 0);
                assert_true(kiln_loss_scaler_update(&sc, norm));
                assert_true(sc.skipped == 1 && sc.good == 1);
                if (!zero) assert_int_equal(kiln_optim_steps(opt), 1);
                if (!memcmp(w0, w1, sizeof w0)) fail_msg("mode %d: the taken step left the weights", mode);
                if (mode == 0) memcpy(want, w1, sizeof want);
                double a[32], b[32], tol = zero ? 1e-4 : 1e-5;
                for (int i = 0; i < 32; i++) a[i] = w1[i], b[i] = want[i];
                double e = test_max_rel_err(a, b, 32);
                if (!(e <= tol)) fail_msg("mode %d: weights after the taken step off the eager ones by %g", mode, e);
            }
        }
        kiln_scope_end();
        kiln_compiled_free(cs);
        kiln_zero1_free(z);
        kiln_optim_free(opt);
        kiln_gpt_free(m);
    }
    kiln_pg_free(pg);
}

/* A chain of bf16 pointwise ops with an f32 operand: bf16 values, a promotion to f32,
 * casts both ways. */
static kiln_status half_chain(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    kiln_tensor_t *x = in[0], *y = in[1];
    kiln_dtype h16 = kiln_tensor_dtype(x);
    kiln_tensor_t *h = kiln_gelu(kiln_add(kiln_mul(x, x), kiln_cast(y, h16)), true);
    out[0] = kiln_add(kiln_sigmoid(h), y);
    out[1] = kiln_mul(h, kiln_neg(x));
    out[2] = kiln_cast(kiln_sub(y, kiln_cast(x, KILN_DTYPE_F32)), h16);
    out[3] = kiln_cast(in[2], h16); /* the rounding's edge cases */
    /* a constant whose rounding through float would differ: rounded once, from double */
    out[4] = kiln_add(x, kiln_scalar(1.0 + 0x1p-8 + 0x1p-30, h16));
    *n_out = 5;
    return out[0] && out[1] && out[2] && out[3] && out[4] ? KILN_OK : kiln_last_status();
}

/* Compiled, the chain runs as generated kernels only (bf16 or f16 loaded and stored by
 * them, no op through dispatch) and gives bitwise the eager results: a fused op rounds
 * its value where the eager one rounds its output (kmath.h's km_round_bf16 and
 * km_round_f16), subnormals, ties, overflow and NaN included. Oracle: the same function
 * eager. */
static void compiled_half_chain(kiln_dtype h16)
{
    const int64_t n = 1000, ne = 16 + 512;
    /* f16: a subnormal, the smallest, ties either way, 65504, just above it, a tie to
     * infinity, infinity, NaN, -0; bf16's ties and its largest; below bf16's range; then
     * a sweep through f16's subnormals (steps of 0.37 of their spacing, both signs) and
     * one up to f16's largest values */
    float edge[16 + 512] = {3e-6f, -5.96e-8f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 65504.0f, 65519.0f, 65520.0f,
                            INFINITY, NAN, -0.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 3.3895314e38f, 1e-40f,
                            -2.5e-5f, 0.1f};
    for (int i = 0; i < 256; i++) edge[16 + i] = (float)(i - 128) * 0.37f * 0x1p-24f * 17.0f;
    for (int i = 0; i < 256; i++) edge[16 + 256 + i] = 65000.0f + (float)i * 2.3f;
    kiln_scope_begin();
    kiln_tensor_t *x = kiln_cast(kiln_randn(&n, 1, KILN_DTYPE_F32), h16);
    kiln_tensor_t *e = kiln_from_data(edge, &ne, 1, KILN_DTYPE_F32);
    kiln_tensor_t *y = kiln_randn(&n, 1, KILN_DTYPE_F32), *in[3] = {x, y, e}, *want[5], *got[5];
    int nw, ng, kernels, ops;
    assert_int_equal(half_chain(NULL, in, 3, want, &nw), KILN_OK);
    kiln_compiled_t *c;
    assert_int_equal(kiln_compiled_new(half_chain, NULL, "half_chain", &c), KILN_OK);
    if (kiln_compiled_call(c, in, 3, got, 5, &ng) != KILN_OK) fail_msg("%s", kiln_last_error());
    assert_int_equal(ng, 5);
    assert_int_equal(kiln_compiled_plan(c, 0, &kernels, &ops, NULL, NULL), KILN_OK);
    printf("# %s chain compiled: %d generated kernel(s), %d op(s) through dispatch\n", kiln_dtype_name(h16), kernels,
           ops);
    assert_true(kernels > 0);
    assert_true(ops <= 1); /* the 16-bit constant is made on dispatch (rounded once from double) */
    kiln_dtype types[5] = {KILN_DTYPE_F32, h16, h16, h16, h16};
    for (int j = 0; j < 5; j++) {
        assert_int_equal(kiln_tensor_dtype(got[j]), types[j]);
        assert_int_equal(kiln_tensor_dtype(want[j]), types[j]);
        size_t bytes = (size_t)(j == 3 ? ne : n) * (j ? 2 : 4);
        char *a = malloc(bytes), *b = malloc(bytes);
        assert_int_equal(kiln_tensor_to_host(got[j], a, bytes), KILN_OK);
        assert_int_equal(kiln_tensor_to_host(want[j], b, bytes), KILN_OK);
        if (memcmp(a, b, bytes)) {
            for (size_t i = 0; j == 3 && i < (size_t)ne; i++)
                print_message("edge %g: compiled 0x%04x, eager 0x%04x\n", edge[i], ((uint16_t *)a)[i],
                              ((uint16_t *)b)[i]);
            fail_msg("compiled %s chain: result %d differs from eager's", kiln_dtype_name(h16), j);
        }
        free(a);
        free(b);
    }
    kiln_compiled_free(c);
    kiln_scope_end();
}

static void test_compiled_bf16_chain_is_fused_and_bitwise_eager(void **state) { compiled_half_chain(KILN_DTYPE_BF16); }

/* Ops autocast must leave alone refuse a policy (cast would cast its own input without
 * end; an in-place op would update a cast copy); the in-place ops with a double
 * attribute round it once into bf16 (1 + 2^-8 + 2^-30 is 0x3f81, not 1.0 through float). */
static void test_amp_refusals_and_attribute_rounding(void **state)
{
    assert_int_equal(kiln_op_set_amp_policy("cast", KILN_AMP_LOW), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "cast"));
    assert_int_equal(kiln_op_set_amp_policy("add_", KILN_AMP_LOW), KILN_ERR_ARG);
    assert_int_equal(kiln_op_set_amp_policy("view", KILN_AMP_F32), KILN_ERR_ARG);
    kiln_clear_error();
    const int64_t n = 4;
    kiln_scope_begin();
    kiln_tensor_t *t = kiln_zeros(&n, 1, KILN_DTYPE_BF16);
    assert_int_equal(kiln_fill_(t, 1.0 + 0x1p-8 + 0x1p-30), KILN_OK);
    uint16_t h[4];
    assert_int_equal(kiln_tensor_to_host(t, h, sizeof h), KILN_OK);
    assert_int_equal(h[0], 0x3f81);
    assert_int_equal(kiln_tensor_to_host(kiln_full(&n, 1, 1.0 + 0x1p-8 + 0x1p-30, KILN_DTYPE_BF16), h, sizeof h), KILN_OK);
    assert_int_equal(h[3], 0x3f81);
    kiln_scope_end();
}
static void test_compiled_f16_chain_is_fused_and_bitwise_eager(void **state) { compiled_half_chain(KILN_DTYPE_F16); }

#define T(f) cmocka_unit_test_setup_teardown(f, setup, amp_teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_policy_table_and_override),
        T(test_region_casts_by_policy),
        T(test_grads_through_autocast_match_the_bf16_oracle),
        T(test_half_matmul_is_the_rounded_exact_product),
        T(test_widened_kernels_round_the_f32_kernel),
        T(test_bf16_attention_matches_float64),
        T(test_autocast_casts_views_as_stored_bitwise),
        T(test_linear_under_bf16_is_bf16_with_an_f32_bias),
        T(test_loss_scaler_backs_off_and_grows),
        T(test_f16_step_skipped_on_overflow),
        T(test_compiled_bf16_chain_is_fused_and_bitwise_eager),
        T(test_compiled_f16_chain_is_fused_and_bitwise_eager),
        T(test_amp_refusals_and_attribute_rounding),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
