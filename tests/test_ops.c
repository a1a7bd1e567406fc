/* Forward ops against plain C references computed here in double, on small random
 * inputs: broadcasting, strided (transposed, sliced) inputs, keepdim and negative dims.
 * Tolerances: f32 results |got - want| <= 1e-5 * (1 + |want|) (f32 rounding of inputs
 * and results, with sums accumulated in double by the kernels); f64 results 1e-12 *
 * (1 + |want|) unless a test says otherwise. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln/ops.h"

#define TOL32 1e-5
#define TOL64 1e-12

#include "test_util.h"

/* ---- helpers ---- */

static uint64_t rng_state = 88172645463325252ULL;
static double urand(void) /* xorshift64, [0, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1p-53;
}

static void fill(double *v, int64_t n, double lo, double hi)
{
    for (int64_t i = 0; i < n; i++) v[i] = lo + (hi - lo) * urand();
    /* Round to f32 so f32 and f64 inputs hold the same values. */
    for (int64_t i = 0; i < n; i++) v[i] = (float)v[i];
}

static int64_t numel(int nd, const int64_t *sh)
{
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= sh[i];
    return n;
}

enum { CONTIG, TRANSPOSED, STRIDED, HEADS };

/* A tensor of logical shape sh holding v (row-major) in dtype dt. TRANSPOSED: a
 * transpose view of a base whose last two dims are swapped; STRIDED: every other
 * element of a base twice as wide in the last dim; HEADS (4-D only): dims 1 and 2
 * swapped and each last-dim row padded by one element, the way attention sees the
 * heads of a fused projection (rows contiguous, no dim in order). */
static kiln_tensor_t *make(const double *v, int nd, const int64_t *sh, kiln_dtype dt, int layout)
{
    int64_t n = numel(nd, sh);
    if (layout == CONTIG || nd == 0 || (layout == TRANSPOSED && nd < 2))
        return kiln_cast(kiln_from_data(v, sh, nd, KILN_DTYPE_F64), dt);
    int64_t bs[KILN_MAX_DIMS];
    memcpy(bs, sh, sizeof(int64_t) * (size_t)nd);
    int64_t c = sh[nd - 1];
    double *b;
    kiln_tensor_t *base, *r;
    if (layout == HEADS) {
        assert_int_equal(nd, 4);
        int64_t hb[4] = {sh[0], sh[2], sh[1], c + 1};
        b = malloc(sizeof(double) * (size_t)(numel(4, hb) ? numel(4, hb) : 1));
        for (int64_t i0 = 0; i0 < sh[0]; i0++)
            for (int64_t i1 = 0; i1 < sh[1]; i1++)
                for (int64_t i2 = 0; i2 < sh[2]; i2++)
                    for (int64_t i3 = 0; i3 <= c; i3++)
                        b[((i0 * sh[2] + i2) * sh[1] + i1) * (c + 1) + i3] =
                            i3 < c ? v[((i0 * sh[1] + i1) * sh[2] + i2) * c + i3] : 999;
        base = kiln_cast(kiln_from_data(b, hb, 4, KILN_DTYPE_F64), dt);
        r = kiln_transpose(kiln_narrow(base, 3, 0, c), 1, 2);
    } else if (layout == TRANSPOSED) {
        int64_t rr = sh[nd - 2];
        bs[nd - 2] = c;
        bs[nd - 1] = rr;
        b = malloc(sizeof(double) * (size_t)(n ? n : 1));
        for (int64_t m = 0; m < (rr * c > 0 ? n / (rr * c) : 0); m++)
            for (int64_t i = 0; i < rr; i++)
                for (int64_t j = 0; j < c; j++) b[m * rr * c + j * rr + i] = v[m * rr * c + i * c + j];
        base = kiln_cast(kiln_from_data(b, bs, nd, KILN_DTYPE_F64), dt);
        r = kiln_transpose(base, -1, -2);
    } else {
        bs[nd - 1] = 2 * c;
        b = malloc(sizeof(double) * (size_t)(n > 0 ? 2 * n : 1));
        for (int64_t i = 0; i < n; i++) {
            b[2 * i] = v[i];
            b[2 * i + 1] = 999;
        }
        base = kiln_cast(kiln_from_data(b, bs, nd, KILN_DTYPE_F64), dt);
        r = kiln_slice(base, -1, 0, 2 * c, 2);
    }
    free(b);
    assert_non_null(r);
    return r;
}

static void read_f64(kiln_tensor_t *t, double *out)
{
    if (!t) fail_msg("op returned NULL: %s", kiln_last_error());
    kiln_tensor_t *c = kiln_cast(t, KILN_DTYPE_F64);
    assert_non_null(c);
    assert_int_equal(kiln_tensor_to_host(c, out, kiln_tensor_nbytes(c)), KILN_OK);
}

static void expect_shape(const kiln_tensor_t *t, int nd, const int64_t *sh)
{
    if (!t) fail_msg("op returned NULL: %s", kiln_last_error());
    assert_int_equal(kiln_tensor_ndim(t), nd);
    for (int i = 0; i < nd; i++)
        if (kiln_tensor_shape(t)[i] != sh[i])
            fail_msg("dim %d is %lld, want %lld", i, (long long)kiln_tensor_shape(t)[i], (long long)sh[i]);
}

static void expect_close(const char *what, const double *got, const double *want, int64_t n, double tol)
{
    for (int64_t i = 0; i < n; i++) {
        bool ok = (isnan(want[i]) && isnan(got[i])) || fabs(got[i] - want[i]) <= tol * (1 + fabs(want[i]));
        if (!ok) fail_msg("%s: element %lld is %.17g, want %.17g", what, (long long)i, got[i], want[i]);
    }
}

/* Reads t (checking its shape) and compares with want. */
static void check(const char *what, kiln_tensor_t *t, int nd, const int64_t *sh, const double *want, double tol)
{
    expect_shape(t, nd, sh);
    int64_t n = numel(nd, sh);
    double *got = malloc(sizeof(double) * (size_t)(n ? n : 1));
    read_f64(t, got);
    expect_close(what, got, want, n, tol);
    free(got);
}

/* Flat index into a right-aligned broadcast input of shape is for flat index f of os. */
static int64_t bidx(int64_t f, int ond, const int64_t *os, int ind, const int64_t *is)
{
    int64_t off = 0, mul = 1;
    for (int d = ond - 1; d >= 0; d--) {
        int64_t i = f % os[d];
        f /= os[d];
        int k = d - (ond - ind);
        if (k >= 0) {
            if (is[k] != 1) off += i * mul;
            mul *= is[k];
        }
    }
    return off;
}

static double tol_of(kiln_dtype dt) { return dt == KILN_DTYPE_F64 ? TOL64 : TOL32; }

/* ---- pointwise unary ---- */

typedef struct {
    const char *name;
    kiln_tensor_t *(*fn)(kiln_tensor_t *);
    double (*ref)(double);
    double lo, hi;
} unary_case;

static double r_neg(double x) { return -x; }
static double r_abs(double x) { return fabs(x); }
static double r_sqrt(double x) { return sqrt(x); }
static double r_rsqrt(double x) { return 1 / sqrt(x); }
static double r_square(double x) { return x * x; }
static double r_sigmoid(double x) { return 1 / (1 + exp(-x)); }
static double r_relu(double x) { return x > 0 ? x : 0; }
static double r_silu(double x) { return x / (1 + exp(-x)); }
/* PyTorch's softplus (torch.nn.functional.softplus, beta 1, threshold 20): log1p(exp(x)),
 * and x itself above the threshold. */
static double r_softplus(double x) { return x > 20 ? x : log1p(exp(x)); }
static double r_gelu_erf(double x) { return 0.5 * x * (1 + erf(x / sqrt(2.0))); }
static double r_gelu_tanh(double x)
{
    return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
static kiln_tensor_t *gelu_erf(kiln_tensor_t *a) { return kiln_gelu(a, false); }
static kiln_tensor_t *gelu_tanh(kiln_tensor_t *a) { return kiln_gelu(a, true); }

static const unary_case unary_cases[] = {
    {"neg", kiln_neg, r_neg, -3, 3},
    {"abs", kiln_abs, r_abs, -3, 3},
    {"exp", kiln_exp, exp, -3, 3},
    {"log", kiln_log, log, 0.1, 3},
    {"sqrt", kiln_sqrt, r_sqrt, 0.1, 3},
    {"rsqrt", kiln_rsqrt, r_rsqrt, 0.1, 3},
    {"square", kiln_square, r_square, -3, 3},
    {"tanh", kiln_tanh, tanh, -3, 3},
    {"sigmoid", kiln_sigmoid, r_sigmoid, -5, 5},
    {"relu", kiln_relu, r_relu, -3, 3},
    {"silu", kiln_silu, r_silu, -5, 5},
    {"softplus", kiln_softplus, r_softplus, -30, 30}, /* both sides of its threshold at 20 */
    {"gelu_erf", gelu_erf, r_gelu_erf, -4, 4},
    {"gelu_tanh", gelu_tanh, r_gelu_tanh, -4, 4},
};

static void run_unary(kiln_dtype dt, int layout)
{
    int64_t sh[3] = {2, 3, 5};
    double x[30], want[30];
    for (size_t k = 0; k < sizeof unary_cases / sizeof unary_cases[0]; k++) {
        const unary_case *c = &unary_cases[k];
        fill(x, 30, c->lo, c->hi);
        for (int i = 0; i < 30; i++) want[i] = c->ref(x[i]);
        char what[64];
        snprintf(what, sizeof what, "%s %s layout %d", c->name, kiln_dtype_name(dt), layout);
        check(what, c->fn(make(x, 3, sh, dt, layout)), 3, sh, want, tol_of(dt));
    }
}

static void test_unary_ops_match_reference_f32(void **state) { run_unary(KILN_DTYPE_F32, CONTIG); }
static void test_unary_ops_match_reference_f64(void **state) { run_unary(KILN_DTYPE_F64, CONTIG); }
static void test_unary_ops_match_reference_on_transposed_input(void **state) { run_unary(KILN_DTYPE_F32, TRANSPOSED); }
static void test_unary_ops_match_reference_on_strided_input_f64(void **state) { run_unary(KILN_DTYPE_F64, STRIDED); }

static void test_neg_abs_relu_keep_integer_dtypes(void **state)
{
    int64_t n = 4;
    int32_t v[4] = {-3, 0, 2, -1};
    kiln_tensor_t *a = kiln_from_data(v, &n, 1, KILN_DTYPE_I32);
    kiln_tensor_t *r = kiln_relu(a), *ab = kiln_abs(a), *ng = kiln_neg(a);
    assert_int_equal(kiln_tensor_dtype(r), KILN_DTYPE_I32);
    const double wr[4] = {0, 0, 2, 0}, wa[4] = {3, 0, 2, 1}, wn[4] = {3, 0, -2, 1};
    check("relu i32", r, 1, &n, wr, 0);
    check("abs i32", ab, 1, &n, wa, 0);
    check("neg i32", ng, 1, &n, wn, 0);
}

/* ---- pointwise binary ---- */

typedef struct {
    const char *name;
    kiln_tensor_t *(*fn)(kiln_tensor_t *, kiln_tensor_t *);
    double (*ref)(double, double);
    double lo, hi; /* range of the first operand */
} binary_case;

static double r_add(double x, double y) { return x + y; }
static double r_sub(double x, double y) { return x - y; }
static double r_mul(double x, double y) { return x * y; }
static double r_div(double x, double y) { return x / y; }
static double r_max(double x, double y) { return x > y ? x : y; }
static double r_min(double x, double y) { return x < y ? x : y; }

static const binary_case binary_cases[] = {
    {"add", kiln_add, r_add, -3, 3},      {"sub", kiln_sub, r_sub, -3, 3},
    {"mul", kiln_mul, r_mul, -3, 3},      {"div", kiln_div, r_div, -3, 3},
    {"pow", kiln_pow, pow, 0.2, 3},       {"maximum", kiln_maximum, r_max, -3, 3},
    {"minimum", kiln_minimum, r_min, -3, 3},
};

/* a (2,3,4) op b (3,1), and (4) op (2,1,4): both sides broadcast. */
static void run_binary(kiln_dtype dt, int la, int lb)
{
    struct {
        int na, nb, no;
        int64_t sa[3], sb[3], so[3];
    } shapes[3] = {
        {3, 2, 3, {2, 3, 4}, {3, 1}, {2, 3, 4}},
        {1, 3, 3, {4}, {2, 1, 4}, {2, 1, 4}},
        {2, 2, 2, {3, 4}, {3, 4}, {3, 4}},
    };
    double a[24], b[24], want[24];
    for (size_t k = 0; k < sizeof binary_cases / sizeof binary_cases[0]; k++) {
        const binary_case *c = &binary_cases[k];
        for (int s = 0; s < 3; s++) {
            int64_t nA = numel(shapes[s].na, shapes[s].sa), nB = numel(shapes[s].nb, shapes[s].sb);
            int64_t nO = numel(shapes[s].no, shapes[s].so);
            fill(a, nA, c->lo, c->hi);
            fill(b, nB, 0.5, 2.5);
            for (int i = 0; i < nB; i++)
                if (urand() < 0.5 && c->ref != pow) b[i] = -b[i];
            for (int64_t i = 0; i < nO; i++)
                want[i] = c->ref(a[bidx(i, shapes[s].no, shapes[s].so, shapes[s].na, shapes[s].sa)],
                                 b[bidx(i, shapes[s].no, shapes[s].so, shapes[s].nb, shapes[s].sb)]);
            kiln_tensor_t *A = make(a, shapes[s].na, shapes[s].sa, dt, la);
            kiln_tensor_t *B = make(b, shapes[s].nb, shapes[s].sb, dt, lb);
            char what[80];
            snprintf(what, sizeof what, "%s %s shapes %d layouts %d,%d", c->name, kiln_dtype_name(dt), s, la, lb);
            check(what, c->fn(A, B), shapes[s].no, shapes[s].so, want, tol_of(dt));
        }
    }
}

static void test_binary_ops_broadcast_and_match_reference_f32(void **state) { run_binary(KILN_DTYPE_F32, CONTIG, CONTIG); }
static void test_binary_ops_broadcast_and_match_reference_f64(void **state) { run_binary(KILN_DTYPE_F64, CONTIG, CONTIG); }
static void test_binary_ops_on_strided_operands(void **state)
{
    run_binary(KILN_DTYPE_F32, TRANSPOSED, STRIDED);
    run_binary(KILN_DTYPE_F64, STRIDED, TRANSPOSED);
}

static void test_binary_ops_promote_mixed_dtypes(void **state)
{
    int64_t n = 3;
    const double a[3] = {1.5, -2, 3}, b[3] = {2, 3, -1};
    kiln_tensor_t *r = kiln_add(make(a, 1, &n, KILN_DTYPE_F32, CONTIG), make(b, 1, &n, KILN_DTYPE_F64, CONTIG));
    assert_int_equal(kiln_tensor_dtype(r), KILN_DTYPE_F64);
    const double w[3] = {3.5, 1, 2};
    check("f32 + f64", r, 1, &n, w, 0);
    kiln_tensor_t *ri = kiln_mul(make(b, 1, &n, KILN_DTYPE_I32, CONTIG), make(a, 1, &n, KILN_DTYPE_F32, CONTIG));
    assert_int_equal(kiln_tensor_dtype(ri), KILN_DTYPE_F32);
    kiln_tensor_t *ii = kiln_add(make(b, 1, &n, KILN_DTYPE_I32, CONTIG), make(b, 1, &n, KILN_DTYPE_I64, CONTIG));
    assert_int_equal(kiln_tensor_dtype(ii), KILN_DTYPE_I64);
}

static void test_scalar_ops_match_reference(void **state)
{
    int64_t sh[2] = {3, 4};
    double x[12], w1[12], w2[12], w3[12];
    fill(x, 12, 0.1, 3);
    for (int i = 0; i < 12; i++) {
        w1[i] = x[i] + 1.25;
        w2[i] = x[i] * -3;
        w3[i] = pow(x[i], 1.5);
    }
    for (int dti = 0; dti < 2; dti++) {
        kiln_dtype dt = dti ? KILN_DTYPE_F64 : KILN_DTYPE_F32;
        kiln_tensor_t *X = make(x, 2, sh, dt, TRANSPOSED);
        check("add_scalar", kiln_add_scalar(X, 1.25), 2, sh, w1, tol_of(dt));
        check("mul_scalar", kiln_mul_scalar(X, -3), 2, sh, w2, tol_of(dt));
        check("pow_scalar", kiln_pow_scalar(X, 1.5), 2, sh, w3, tol_of(dt));
        assert_int_equal(kiln_tensor_dtype(kiln_mul_scalar(X, 2)), dt);
    }
}

static void test_maximum_propagates_nan(void **state)
{
    int64_t n = 2;
    const double a[2] = {NAN, 1}, b[2] = {0, NAN};
    const double w[2] = {NAN, NAN};
    check("maximum nan", kiln_maximum(make(a, 1, &n, KILN_DTYPE_F32, CONTIG), make(b, 1, &n, KILN_DTYPE_F32, CONTIG)),
          1, &n, w, 0);
    check("minimum nan", kiln_minimum(make(a, 1, &n, KILN_DTYPE_F64, CONTIG), make(b, 1, &n, KILN_DTYPE_F64, CONTIG)),
          1, &n, w, 0);
}

/* ---- comparisons and where ---- */

static void test_comparisons_broadcast_and_give_bool(void **state)
{
    int64_t sa[2] = {3, 4}, sb[1] = {4};
    double a[12], b[4];
    for (int i = 0; i < 12; i++) a[i] = (double)(int)(urand() * 3);
    for (int i = 0; i < 4; i++) b[i] = (double)(int)(urand() * 3);
    kiln_tensor_t *A = make(a, 2, sa, KILN_DTYPE_F32, TRANSPOSED), *B = make(b, 1, sb, KILN_DTYPE_F64, CONTIG);
    kiln_tensor_t *(*fns[6])(kiln_tensor_t *, kiln_tensor_t *) = {kiln_eq, kiln_ne, kiln_lt, kiln_le, kiln_gt, kiln_ge};
    const char *names[6] = {"eq", "ne", "lt", "le", "gt", "ge"};
    for (int k = 0; k < 6; k++) {
        double want[12];
        for (int i = 0; i < 12; i++) {
            double x = a[i], y = b[i % 4];
            bool r = k == 0 ? x == y : k == 1 ? x != y : k == 2 ? x < y : k == 3 ? x <= y : k == 4 ? x > y : x >= y;
            want[i] = r;
        }
        kiln_tensor_t *r = fns[k](A, B);
        assert_non_null(r);
        assert_int_equal(kiln_tensor_dtype(r), KILN_DTYPE_BOOL);
        check(names[k], r, 2, sa, want, 0);
    }
}

static void test_where_broadcasts_all_three_operands(void **state)
{
    int64_t sc[3] = {2, 1, 4}, sa[2] = {3, 4}, sb[3] = {2, 3, 1}, so[3] = {2, 3, 4};
    double c[8], a[12], b[6], want[24];
    for (int i = 0; i < 8; i++) c[i] = urand() < 0.5;
    fill(a, 12, -3, 3);
    fill(b, 6, -3, 3);
    for (int i = 0; i < 24; i++)
        want[i] = c[bidx(i, 3, so, 3, sc)] ? a[bidx(i, 3, so, 2, sa)] : b[bidx(i, 3, so, 3, sb)];
    kiln_tensor_t *r = kiln_where(make(c, 3, sc, KILN_DTYPE_BOOL, CONTIG), make(a, 2, sa, KILN_DTYPE_F32, TRANSPOSED),
                                  make(b, 3, sb, KILN_DTYPE_F64, CONTIG));
    assert_non_null(r);
    assert_int_equal(kiln_tensor_dtype(r), KILN_DTYPE_F64);
    check("where", r, 3, so, want, 0);
}

/* ---- cast ---- */

static void test_cast_truncates_floats_to_integers(void **state)
{
    int64_t n = 5;
    const double v[5] = {1.7, -1.7, 0.2, -0.2, 42};
    const double w[5] = {1, -1, 0, 0, 42};
    kiln_tensor_t *i = kiln_cast(make(v, 1, &n, KILN_DTYPE_F32, CONTIG), KILN_DTYPE_I32);
    assert_int_equal(kiln_tensor_dtype(i), KILN_DTYPE_I32);
    check("f32->i32", i, 1, &n, w, 0);
    check("f64->i64", kiln_cast(make(v, 1, &n, KILN_DTYPE_F64, STRIDED), KILN_DTYPE_I64), 1, &n, w, 0);
}

static void test_cast_to_bool_is_nonzero(void **state)
{
    int64_t n = 4;
    const double v[4] = {0, -0.5, 3, 0};
    const double w[4] = {0, 1, 1, 0};
    kiln_tensor_t *b = kiln_cast(make(v, 1, &n, KILN_DTYPE_F32, CONTIG), KILN_DTYPE_BOOL);
    assert_int_equal(kiln_tensor_dtype(b), KILN_DTYPE_BOOL);
    unsigned char raw[4];
    assert_int_equal(kiln_tensor_to_host(b, raw, 4), KILN_OK);
    for (int i = 0; i < 4; i++) assert_int_equal(raw[i], (int)w[i]);
    check("bool->f32", kiln_cast(b, KILN_DTYPE_F32), 1, &n, w, 0);
}

static void test_cast_between_floats_rounds_to_target(void **state)
{
    int64_t n = 3;
    const double v[3] = {0.1, 1.0 / 3, -2.5e-3};
    double w[3];
    for (int i = 0; i < 3; i++) w[i] = (float)v[i];
    kiln_tensor_t *x = kiln_from_data(v, &n, 1, KILN_DTYPE_F64);
    check("f64->f32", kiln_cast(x, KILN_DTYPE_F32), 1, &n, w, 0);
    int64_t big = 3;
    int64_t iv[3] = {-5, 7, 1LL << 40};
    const double wi[3] = {-5, 7, (double)(1LL << 40)};
    check("i64->f64", kiln_cast(kiln_from_data(iv, &big, 1, KILN_DTYPE_I64), KILN_DTYPE_F64), 1, &big, wi, 0);
}

/* ---- reductions ---- */

/* Reference reduction of x (shape sh) over the dims in red[]: kind 0 sum, 1 max,
 * 2 mean, 3 logsumexp; the output is keepdim-shaped (row-major over kept dims). */
static void ref_reduce(const double *x, int nd, const int64_t *sh, const bool *red, int kind, double *out,
                       int64_t *nout)
{
    int64_t osh[KILN_MAX_DIMS];
    for (int d = 0; d < nd; d++) osh[d] = red[d] ? 1 : sh[d];
    int64_t no = numel(nd, osh), n = numel(nd, sh);
    double *m = malloc(sizeof(double) * (size_t)no), *cnt = calloc((size_t)no, sizeof(double));
    for (int64_t o = 0; o < no; o++) {
        out[o] = kind == 1 || kind == 3 ? -INFINITY : 0;
        m[o] = -INFINITY;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t o = bidx(i, nd, sh, nd, osh);
        if (x[i] > m[o]) m[o] = x[i];
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t o = bidx(i, nd, sh, nd, osh);
        cnt[o]++;
        if (kind == 0 || kind == 2) out[o] += x[i];
        else if (kind == 1) out[o] = x[i] > out[o] ? x[i] : out[o];
        else out[o] = out[o] == -INFINITY ? exp(x[i] - m[o]) : out[o] + exp(x[i] - m[o]);
    }
    for (int64_t o = 0; o < no; o++) {
        if (kind == 2) out[o] /= cnt[o];
        if (kind == 3) out[o] = m[o] + log(out[o]);
    }
    *nout = no;
    free(m);
    free(cnt);
}

static void out_shape(int nd, const int64_t *sh, const bool *red, bool keepdim, int *ond, int64_t *osh)
{
    *ond = 0;
    for (int d = 0; d < nd; d++) {
        if (!red[d]) osh[(*ond)++] = sh[d];
        else if (keepdim) osh[(*ond)++] = 1;
    }
}

typedef kiln_tensor_t *(*reduce_fn)(kiln_tensor_t *, const int *, int, bool);

static void run_reduction(const char *name, reduce_fn fn, int kind, kiln_dtype dt)
{
    int64_t sh[3] = {3, 4, 5};
    double x[60], want[60];
    fill(x, 60, -3, 3);
    struct {
        int dims[3], nd;
    } sets[5] = {{{0, 2}, 2}, {{-1}, 1}, {{1}, 1}, {{0}, 0}, {{-3, -2, -1}, 3}};
    for (int s = 0; s < 5; s++) {
        bool red[3] = {sets[s].nd == 0, sets[s].nd == 0, sets[s].nd == 0};
        for (int k = 0; k < sets[s].nd; k++) red[(sets[s].dims[k] + 3) % 3] = true;
        int64_t no;
        ref_reduce(x, 3, sh, red, kind, want, &no);
        for (int keep = 0; keep < 2; keep++) {
            for (int layout = 0; layout < 3; layout++) {
                int ond;
                int64_t osh[3];
                out_shape(3, sh, red, keep, &ond, osh);
                char what[96];
                snprintf(what, sizeof what, "%s %s set %d keepdim %d layout %d", name, kiln_dtype_name(dt), s, keep, layout);
                kiln_tensor_t *r = fn(make(x, 3, sh, dt, layout), sets[s].nd ? sets[s].dims : NULL, sets[s].nd, keep);
                check(what, r, ond, osh, want, tol_of(dt));
            }
        }
    }
}

static kiln_tensor_t *logsumexp_fn(kiln_tensor_t *a, const int *d, int n, bool k) { return kiln_logsumexp(a, d, n, k); }

static void test_sum_matches_reference(void **state)
{
    run_reduction("sum", kiln_sum, 0, KILN_DTYPE_F32);
    run_reduction("sum", kiln_sum, 0, KILN_DTYPE_F64);
}

/* Sums over the rows of tall f32 matrices (bias gradients), which the cpu backend
 * splits into fixed chunks of rows: more rows than one chunk, a ragged last chunk, few
 * columns, and two leading dims reduced together; and over a middle dim with rows wider
 * than the cpu's 256-column blocks (an MoE block's top-k combine, KILN_OPT_SUM_MIDDLE)
 * (oracle: the double reference). */
static void test_column_sums_of_tall_matrices_match_reference(void **state)
{
    (void)state;
    struct {
        int64_t sh[3];
        int nd, dims[2], nred;
    } cases[] = {{{1300, 70, 1}, 2, {0}, 1}, {{700, 3, 1}, 2, {0}, 1}, {{3, 300, 33}, 3, {0, 1}, 2},
                 {{5, 3, 300}, 3, {1}, 1}};
    for (int c = 0; c < 4; c++) {
        int nd = cases[c].nd;
        int64_t n = numel(nd, cases[c].sh), no;
        double *x = malloc(sizeof(double) * (size_t)n), *want = malloc(sizeof(double) * (size_t)n);
        fill(x, n, -2, 2);
        bool red[3] = {false, false, false};
        for (int k = 0; k < cases[c].nred; k++) red[cases[c].dims[k]] = true;
        ref_reduce(x, nd, cases[c].sh, red, 0, want, &no);
        int ond;
        int64_t osh[3];
        out_shape(nd, cases[c].sh, red, false, &ond, osh);
        char what[64];
        snprintf(what, sizeof what, "column sum case %d", c);
        check(what, kiln_sum(make(x, nd, cases[c].sh, KILN_DTYPE_F32, CONTIG), cases[c].dims, cases[c].nred, false),
              ond, osh, want, tol_of(KILN_DTYPE_F32));
        free(x);
        free(want);
    }
}

static void test_max_matches_reference(void **state)
{
    run_reduction("max", kiln_max, 1, KILN_DTYPE_F32);
    run_reduction("max", kiln_max, 1, KILN_DTYPE_F64);
}

static void test_mean_matches_reference(void **state)
{
    run_reduction("mean", kiln_mean, 2, KILN_DTYPE_F32);
    run_reduction("mean", kiln_mean, 2, KILN_DTYPE_F64);
}

static void test_logsumexp_matches_reference(void **state)
{
    run_reduction("logsumexp", logsumexp_fn, 3, KILN_DTYPE_F32);
    run_reduction("logsumexp", logsumexp_fn, 3, KILN_DTYPE_F64);
}

static void test_sum_of_integers_is_i64(void **state)
{
    int64_t n = 4;
    int32_t v[4] = {1, -2, 30, 4};
    kiln_tensor_t *s = kiln_sum(kiln_from_data(v, &n, 1, KILN_DTYPE_I32), NULL, 0, false);
    assert_int_equal(kiln_tensor_dtype(s), KILN_DTYPE_I64);
    double r;
    assert_int_equal(kiln_tensor_item(s, &r), KILN_OK);
    assert_true(r == 33);
}

/* var over dim 1 of (3,6) and over all, Bessel correction 0 and 1. */
static void test_var_matches_reference_with_correction(void **state)
{
    int64_t sh[2] = {3, 6};
    double x[18];
    fill(x, 18, -2, 2);
    for (int corr = 0; corr < 2; corr++) {
        double w[3], all = 0, mu_all = 0;
        for (int i = 0; i < 18; i++) mu_all += x[i] / 18;
        for (int i = 0; i < 18; i++) all += (x[i] - mu_all) * (x[i] - mu_all) / (18 - corr);
        for (int r = 0; r < 3; r++) {
            double mu = 0, v = 0;
            for (int j = 0; j < 6; j++) mu += x[r * 6 + j] / 6;
            for (int j = 0; j < 6; j++) v += (x[r * 6 + j] - mu) * (x[r * 6 + j] - mu);
            w[r] = v / (6 - corr);
        }
        int dim = -1;
        int64_t kd[2] = {3, 1}, nd1[1] = {3};
        check("var dim -1 keepdim", kiln_var(make(x, 2, sh, KILN_DTYPE_F64, TRANSPOSED), &dim, 1, corr, true), 2, kd, w, TOL64);
        check("var dim -1", kiln_var(make(x, 2, sh, KILN_DTYPE_F32, CONTIG), &dim, 1, corr, false), 1, nd1, w, TOL32);
        check("var all", kiln_var(make(x, 2, sh, KILN_DTYPE_F64, STRIDED), NULL, 0, corr, false), 0, NULL, &all, TOL64);
    }
}

static void test_argmax_picks_the_first_of_ties(void **state)
{
    int64_t sh[2] = {3, 4};
    const double x[12] = {1, 5, 5, 2, /**/ 7, 0, 7, 7, /**/ 7, 5, -2, -1};
    const double w_last[3] = {1, 0, 0}, w_first[4] = {1, 0, 1, 1};
    kiln_tensor_t *a = kiln_argmax(make(x, 2, sh, KILN_DTYPE_F32, TRANSPOSED), -1, false);
    assert_int_equal(kiln_tensor_dtype(a), KILN_DTYPE_I64);
    int64_t s3[1] = {3}, s4[1] = {4}, k14[2] = {1, 4};
    check("argmax dim -1", a, 1, s3, w_last, 0);
    check("argmax dim 0", kiln_argmax(make(x, 2, sh, KILN_DTYPE_F64, CONTIG), 0, false), 1, s4, w_first, 0);
    check("argmax dim 0 keepdim", kiln_argmax(make(x, 2, sh, KILN_DTYPE_F64, STRIDED), 0, true), 2, k14, w_first, 0);
}

static void test_argmax_matches_reference_on_random_input(void **state)
{
    int64_t sh[3] = {2, 5, 3}, osh[2] = {2, 3};
    double x[30], w[6];
    fill(x, 30, -3, 3);
    for (int b = 0; b < 2; b++)
        for (int k = 0; k < 3; k++) {
            int best = 0;
            for (int j = 1; j < 5; j++)
                if (x[(b * 5 + j) * 3 + k] > x[(b * 5 + best) * 3 + k]) best = j;
            w[b * 3 + k] = best;
        }
    check("argmax dim 1", kiln_argmax(make(x, 3, sh, KILN_DTYPE_F32, TRANSPOSED), 1, false), 2, osh, w, 0);
}

/* ---- softmax ---- */

static void ref_softmax(const double *x, int64_t outer, int64_t L, int64_t inner, bool lg, double *y)
{
    for (int64_t o = 0; o < outer; o++)
        for (int64_t in = 0; in < inner; in++) {
            double m = -INFINITY, s = 0;
            for (int64_t j = 0; j < L; j++) m = fmax(m, x[(o * L + j) * inner + in]);
            for (int64_t j = 0; j < L; j++) s += exp(x[(o * L + j) * inner + in] - m);
            for (int64_t j = 0; j < L; j++) {
                double v = x[(o * L + j) * inner + in] - m;
                y[(o * L + j) * inner + in] = lg ? v - log(s) : exp(v) / s;
            }
        }
}

static void test_softmax_and_log_softmax_match_reference(void **state)
{
    int64_t sh[3] = {2, 5, 3};
    double x[30], w[30];
    fill(x, 30, -4, 4);
    for (int lg = 0; lg < 2; lg++) {
        for (int dti = 0; dti < 2; dti++) {
            kiln_dtype dt = dti ? KILN_DTYPE_F64 : KILN_DTYPE_F32;
            kiln_tensor_t *(*fn)(kiln_tensor_t *, int) = lg ? kiln_log_softmax : kiln_softmax;
            ref_softmax(x, 2, 5, 3, lg, w);
            check(lg ? "log_softmax dim 1" : "softmax dim 1", fn(make(x, 3, sh, dt, TRANSPOSED), 1), 3, sh, w, tol_of(dt));
            ref_softmax(x, 10, 3, 1, lg, w);
            check(lg ? "log_softmax dim -1" : "softmax dim -1", fn(make(x, 3, sh, dt, STRIDED), -1), 3, sh, w, tol_of(dt));
            ref_softmax(x, 1, 2, 15, lg, w);
            check(lg ? "log_softmax dim 0" : "softmax dim 0", fn(make(x, 3, sh, dt, CONTIG), 0), 3, sh, w, tol_of(dt));
        }
    }
}

static void test_softmax_is_stable_for_large_logits(void **state)
{
    int64_t n = 3;
    const double x[3] = {1000, 1000, -1000};
    const double w[3] = {0.5, 0.5, 0};
    check("softmax large", kiln_softmax(make(x, 1, &n, KILN_DTYPE_F32, CONTIG), 0), 1, &n, w, TOL32);
}

/* ---- matmul ---- */

/* c (batch, M, N) = a (batch_a, M, K) @ b (batch_b, K, N) with broadcast batch. */
static void ref_matmul(const double *a, const double *b, double *c, int nbd, const int64_t *bo, const int64_t *ba, int nba,
                       const int64_t *bb, int nbb, int64_t M, int64_t K, int64_t N)
{
    int64_t nb = numel(nbd, bo);
    for (int64_t t = 0; t < nb; t++) {
        int64_t ia = bidx(t, nbd, bo, nba, ba), ib = bidx(t, nbd, bo, nbb, bb);
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double s = 0;
                for (int64_t k = 0; k < K; k++) s += a[(ia * M + i) * K + k] * b[(ib * K + k) * N + j];
                c[(t * M + i) * N + j] = s;
            }
    }
}

typedef struct {
    int na, nb;
    int64_t sa[4], sb[4];
    int no;
    int64_t so[4];
} mm_case;

static void run_matmul(const mm_case *c, kiln_dtype dt, int la, int lb)
{
    int64_t nA = numel(c->na, c->sa), nB = numel(c->nb, c->sb), nO = numel(c->no, c->so);
    double *a = malloc(sizeof(double) * (size_t)nA), *b = malloc(sizeof(double) * (size_t)nB);
    double *w = malloc(sizeof(double) * (size_t)(nO ? nO : 1));
    fill(a, nA, -1, 1);
    fill(b, nB, -1, 1);
    /* Promote 1-D operands to matrices for the reference. */
    int64_t M = c->na == 1 ? 1 : c->sa[c->na - 2], K = c->sa[c->na - 1], N = c->nb == 1 ? 1 : c->sb[c->nb - 1];
    int nba = c->na > 2 ? c->na - 2 : 0, nbb = c->nb > 2 ? c->nb - 2 : 0, nbo = nba > nbb ? nba : nbb;
    int64_t bo[4];
    for (int d = 0; d < nbo; d++) {
        int ia = d - (nbo - nba), ib = d - (nbo - nbb);
        int64_t x = ia >= 0 ? c->sa[ia] : 1, y = ib >= 0 ? c->sb[ib] : 1;
        bo[d] = x > y ? x : y;
    }
    ref_matmul(a, b, w, nbo, bo, c->sa, nba, c->sb, nbb, M, K, N);
    kiln_tensor_t *r = kiln_matmul(make(a, c->na, c->sa, dt, la), make(b, c->nb, c->sb, dt, lb));
    char what[96];
    snprintf(what, sizeof what, "matmul %dD@%dD %s layouts %d,%d", c->na, c->nb, kiln_dtype_name(dt), la, lb);
    check(what, r, c->no, c->so, w, dt == KILN_DTYPE_F64 ? 1e-12 : 1e-5);
    free(a);
    free(b);
    free(w);
}

static const mm_case mm_cases[] = {
    {2, 2, {3, 4}, {4, 5}, 2, {3, 5}},
    {3, 3, {2, 3, 4}, {2, 4, 5}, 3, {2, 3, 5}},
    {4, 3, {2, 1, 3, 4}, {3, 4, 5}, 4, {2, 3, 3, 5}},
    {3, 2, {2, 3, 4}, {4, 5}, 3, {2, 3, 5}}, /* weight without batch dims: one stacked GEMM */
    {2, 3, {3, 4}, {2, 4, 5}, 3, {2, 3, 5}},
    {1, 2, {4}, {4, 5}, 1, {5}},
    {2, 1, {3, 4}, {4}, 1, {3}},
    {1, 1, {4}, {4}, 0, {0}},
    {1, 3, {4}, {2, 4, 5}, 2, {2, 5}},
};

static void test_matmul_matches_reference_for_every_shape_kind(void **state)
{
    for (size_t k = 0; k < sizeof mm_cases / sizeof mm_cases[0]; k++) {
        run_matmul(&mm_cases[k], KILN_DTYPE_F32, CONTIG, CONTIG);
        run_matmul(&mm_cases[k], KILN_DTYPE_F64, CONTIG, CONTIG);
    }
}

static void test_matmul_of_transposed_and_sliced_operands(void **state)
{
    for (size_t k = 0; k < 5; k++) {
        for (int la = 0; la < 3; la++)
            for (int lb = 0; lb < 3; lb++) {
                run_matmul(&mm_cases[k], KILN_DTYPE_F32, la, lb);
                run_matmul(&mm_cases[k], KILN_DTYPE_F64, la, lb);
            }
    }
}

/* Rows of a taken from a wider base: the row stride is larger than K. */
static void test_matmul_of_column_narrowed_batched_operand(void **state)
{
    int64_t sbase[3] = {2, 3, 7}, sb[2] = {4, 2}, so[3] = {2, 3, 2};
    double base[42], b[8], w[12];
    fill(base, 42, -1, 1);
    fill(b, 8, -1, 1);
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 2; j++) {
                double s = 0;
                for (int k = 0; k < 4; k++) s += base[(t * 3 + i) * 7 + 1 + k] * b[k * 2 + j];
                w[(t * 3 + i) * 2 + j] = s;
            }
    kiln_tensor_t *A = kiln_narrow(make(base, 3, sbase, KILN_DTYPE_F64, CONTIG), 2, 1, 4);
    check("matmul narrowed", kiln_matmul(A, make(b, 2, sb, KILN_DTYPE_F64, CONTIG)), 3, so, w, 1e-12);
}

static void test_matmul_refuses_mixed_dtypes(void **state)
{
    int64_t s[2] = {2, 2};
    assert_null(kiln_matmul(kiln_zeros(s, 2, KILN_DTYPE_F32), kiln_zeros(s, 2, KILN_DTYPE_F64)));
    assert_int_equal(kiln_last_status(), KILN_ERR_DTYPE);
    assert_non_null(strstr(kiln_last_error(), "matmul"));
}

/* ---- indexing ---- */

static void test_embedding_picks_rows(void **state)
{
    int64_t ws[2] = {5, 3}, is[2] = {2, 2}, os[3] = {2, 2, 3};
    double w[15], want[12];
    fill(w, 15, -1, 1);
    int32_t idx[4] = {4, 0, 2, 4};
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 3; c++) want[i * 3 + c] = w[idx[i] * 3 + c];
    kiln_tensor_t *I = kiln_from_data(idx, is, 2, KILN_DTYPE_I32);
    check("embedding", kiln_embedding(make(w, 2, ws, KILN_DTYPE_F32, TRANSPOSED), I), 3, os, want, 0);
}

static void test_index_select_picks_along_a_dim(void **state)
{
    int64_t sh[3] = {2, 4, 3}, n = 3, os[3] = {2, 3, 3};
    double x[24], want[18];
    fill(x, 24, -1, 1);
    int64_t idx[3] = {3, 0, 3};
    for (int a = 0; a < 2; a++)
        for (int j = 0; j < 3; j++)
            for (int c = 0; c < 3; c++) want[(a * 3 + j) * 3 + c] = x[(a * 4 + idx[j]) * 3 + c];
    kiln_tensor_t *I = kiln_from_data(idx, &n, 1, KILN_DTYPE_I64);
    check("index_select dim 1", kiln_index_select(make(x, 3, sh, KILN_DTYPE_F64, STRIDED), 1, I), 3, os, want, 0);
    check("index_select dim -2", kiln_index_select(make(x, 3, sh, KILN_DTYPE_F32, CONTIG), -2, I), 3, os, want, 0);
}

static void test_gather_follows_the_index_along_dim(void **state)
{
    int64_t sh[2] = {3, 4}, is[2] = {3, 2}, is0[2] = {2, 4};
    double x[12], w1[6], w0[8];
    fill(x, 12, -1, 1);
    int64_t i1[6] = {3, 0, 1, 1, 0, 2};
    int32_t i0[8] = {2, 0, 1, 2, 0, 0, 2, 1};
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < 2; j++) w1[r * 2 + j] = x[r * 4 + i1[r * 2 + j]];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) w0[r * 4 + j] = x[i0[r * 4 + j] * 4 + j];
    check("gather dim 1", kiln_gather(make(x, 2, sh, KILN_DTYPE_F32, TRANSPOSED), 1, kiln_from_data(i1, is, 2, KILN_DTYPE_I64)),
          2, is, w1, 0);
    check("gather dim 0", kiln_gather(make(x, 2, sh, KILN_DTYPE_F64, CONTIG), 0, kiln_from_data(i0, is0, 2, KILN_DTYPE_I32)),
          2, is0, w0, 0);
}

static void test_scatter_add_accumulates_repeated_indices(void **state)
{
    int64_t sh[2] = {3, 4}, is[2] = {2, 4};
    double x[12], src[8], want[12];
    fill(x, 12, -1, 1);
    fill(src, 8, -1, 1);
    int64_t idx[8] = {0, 2, 2, 0, 0, 2, 1, 0}; /* dim 0: rows */
    memcpy(want, x, sizeof want);
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) want[idx[r * 4 + j] * 4 + j] += src[r * 4 + j];
    kiln_tensor_t *X = make(x, 2, sh, KILN_DTYPE_F64, TRANSPOSED);
    kiln_tensor_t *r = kiln_scatter_add(X, 0, kiln_from_data(idx, is, 2, KILN_DTYPE_I64), make(src, 2, is, KILN_DTYPE_F64, CONTIG));
    check("scatter_add dim 0", r, 2, sh, want, TOL64);
    /* The input is left as it was. */
    check("scatter_add input", X, 2, sh, x, 0);
}

static void test_scatter_add_along_the_last_dim(void **state)
{
    int64_t sh[2] = {2, 3}, is[2] = {2, 4};
    double x[6] = {0}, src[8], want[6] = {0};
    fill(src, 8, -1, 1);
    int32_t idx[8] = {0, 1, 1, 2, 2, 2, 0, 1};
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) want[r * 3 + idx[r * 4 + j]] += src[r * 4 + j];
    kiln_tensor_t *r = kiln_scatter_add(make(x, 2, sh, KILN_DTYPE_F32, CONTIG), -1, kiln_from_data(idx, is, 2, KILN_DTYPE_I32),
                                        make(src, 2, is, KILN_DTYPE_F32, STRIDED));
    check("scatter_add dim -1", r, 2, sh, want, TOL32);
}

/* An index wider than the input in a dim other than `dim` would address elements
 * outside the output. */
static void test_scatter_add_refuses_an_index_larger_than_the_input(void **state)
{
    int64_t sh[2] = {2, 3}, is[2] = {2, 5};
    int64_t idx[10] = {0};
    kiln_tensor_t *r = kiln_scatter_add(kiln_zeros(sh, 2, KILN_DTYPE_F32), 0, kiln_from_data(idx, is, 2, KILN_DTYPE_I64),
                                        kiln_ones(is, 2, KILN_DTYPE_F32));
    assert_null(r);
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "scatter_add"));
}

static void test_gather_with_an_out_of_range_index_is_an_index_error(void **state)
{
    int64_t sh[2] = {2, 3};
    int64_t idx[6] = {0, 1, 2, 3, 0, 0};
    assert_null(kiln_gather(kiln_zeros(sh, 2, KILN_DTYPE_F32), 1, kiln_from_data(idx, sh, 2, KILN_DTYPE_I64)));
    assert_int_equal(kiln_last_status(), KILN_ERR_INDEX);
    assert_non_null(strstr(kiln_last_error(), "gather"));
}

static void test_index_tensor_of_float_dtype_is_a_dtype_error(void **state)
{
    int64_t ws[2] = {4, 2}, n = 2;
    assert_null(kiln_embedding(kiln_zeros(ws, 2, KILN_DTYPE_F32), kiln_zeros(&n, 1, KILN_DTYPE_F32)));
    assert_int_equal(kiln_last_status(), KILN_ERR_DTYPE);
}

/* ---- norms ---- */

static void ref_norm(const double *x, const double *w, const double *b, int64_t N, int64_t C, double eps, bool rms,
                     double *y)
{
    for (int64_t n = 0; n < N; n++) {
        double mu = 0, var = 0;
        if (!rms) {
            for (int64_t i = 0; i < C; i++) mu += x[n * C + i];
            mu /= (double)C;
        }
        for (int64_t i = 0; i < C; i++) var += (x[n * C + i] - mu) * (x[n * C + i] - mu);
        var /= (double)C;
        for (int64_t i = 0; i < C; i++)
            y[n * C + i] = (x[n * C + i] - mu) / sqrt(var + eps) * (w ? w[i] : 1) + (b ? b[i] : 0);
    }
}

static void test_layer_norm_matches_reference(void **state)
{
    int64_t sh[3] = {2, 3, 5}, c = 5;
    double x[30], w[5], b[5], want[30];
    fill(x, 30, -2, 3);
    fill(w, 5, 0.5, 1.5);
    fill(b, 5, -1, 1);
    for (int dti = 0; dti < 2; dti++) {
        kiln_dtype dt = dti ? KILN_DTYPE_F64 : KILN_DTYPE_F32;
        ref_norm(x, w, b, 6, 5, 1e-5, false, want);
        check("layer_norm", kiln_layer_norm(make(x, 3, sh, dt, TRANSPOSED), make(w, 1, &c, dt, CONTIG), make(b, 1, &c, dt, STRIDED), 1e-5),
              3, sh, want, tol_of(dt) * 10);
        ref_norm(x, NULL, NULL, 6, 5, 1e-5, false, want);
        check("layer_norm no params", kiln_layer_norm(make(x, 3, sh, dt, CONTIG), NULL, NULL, 1e-5), 3, sh, want, tol_of(dt) * 10);
    }
}

static void test_rms_norm_matches_reference(void **state)
{
    int64_t sh[2] = {4, 6}, c = 6;
    double x[24], w[6], want[24];
    fill(x, 24, -2, 3);
    fill(w, 6, 0.5, 1.5);
    for (int dti = 0; dti < 2; dti++) {
        kiln_dtype dt = dti ? KILN_DTYPE_F64 : KILN_DTYPE_F32;
        ref_norm(x, w, NULL, 4, 6, 1e-6, true, want);
        check("rms_norm", kiln_rms_norm(make(x, 2, sh, dt, STRIDED), make(w, 1, &c, dt, CONTIG), 1e-6), 2, sh, want, tol_of(dt) * 10);
        ref_norm(x, NULL, NULL, 4, 6, 1e-6, true, want);
        check("rms_norm no weight", kiln_rms_norm(make(x, 2, sh, dt, TRANSPOSED), NULL, 1e-6), 2, sh, want, tol_of(dt) * 10);
    }
}

static void test_layer_norm_refuses_a_weight_of_the_wrong_size(void **state)
{
    int64_t sh[2] = {2, 4}, c = 3;
    assert_null(kiln_layer_norm(kiln_zeros(sh, 2, KILN_DTYPE_F32), kiln_ones(&c, 1, KILN_DTYPE_F32), NULL, 1e-5));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "layer_norm"));
}

/* ---- cross-entropy ---- */

static void test_cross_entropy_leaves_out_ignored_targets(void **state)
{
    int64_t sh[2] = {4, 5}, n = 4;
    double x[20];
    fill(x, 20, -3, 3);
    int64_t t[4] = {1, -100, 4, 0};
    double sum = 0;
    int cnt = 0;
    for (int r = 0; r < 4; r++) {
        if (t[r] == -100) continue;
        double m = -INFINITY, s = 0;
        for (int v = 0; v < 5; v++) m = fmax(m, x[r * 5 + v]);
        for (int v = 0; v < 5; v++) s += exp(x[r * 5 + v] - m);
        sum += m + log(s) - x[r * 5 + t[r]];
        cnt++;
    }
    double want = sum / cnt;
    kiln_tensor_t *T = kiln_from_data(t, &n, 1, KILN_DTYPE_I64);
    check("cross_entropy f32", kiln_cross_entropy(make(x, 2, sh, KILN_DTYPE_F32, TRANSPOSED), T, -100), 0, NULL, &want, TOL32);
    check("cross_entropy f64", kiln_cross_entropy(make(x, 2, sh, KILN_DTYPE_F64, CONTIG), kiln_cast(T, KILN_DTYPE_I32), -100), 0,
          NULL, &want, TOL64);
}

static void test_cross_entropy_with_an_out_of_range_target_is_an_index_error(void **state)
{
    int64_t sh[2] = {2, 3}, n = 2;
    int64_t t[2] = {0, 3};
    assert_null(kiln_cross_entropy(kiln_zeros(sh, 2, KILN_DTYPE_F32), kiln_from_data(t, &n, 1, KILN_DTYPE_I64), -100));
    assert_int_equal(kiln_last_status(), KILN_ERR_INDEX);
    assert_non_null(strstr(kiln_last_error(), "cross_entropy"));
}

/* ---- dropout ---- */

/* 200k elements at p = 0.3: the zeroed fraction has sd sqrt(0.21 / 2e5) ~ 1e-3;
 * tolerance 5e-3. Survivors are exactly 1/(1-p) rounded to f32. */
static void test_dropout_zeroes_about_p_and_scales_survivors(void **state)
{
    int64_t n = 200000;
    kiln_manual_seed(99);
    kiln_tensor_t *y = kiln_dropout(kiln_ones(&n, 1, KILN_DTYPE_F32), 0.3, true);
    float *v = malloc(sizeof(float) * (size_t)n);
    assert_int_equal(kiln_tensor_to_host(y, v, sizeof(float) * (size_t)n), KILN_OK);
    int64_t zeros = 0;
    float keep = (float)(1.0 / 0.7);
    for (int64_t i = 0; i < n; i++) {
        if (v[i] == 0) zeros++;
        else if (v[i] != keep) fail_msg("survivor %lld is %g, want %g", (long long)i, v[i], keep);
    }
    free(v);
    assert_true(fabs((double)zeros / (double)n - 0.3) < 5e-3);
}

static void test_dropout_with_the_same_seed_gives_the_same_mask(void **state)
{
    int64_t sh[2] = {50, 40};
    double x[2000];
    fill(x, 2000, 0.5, 1.5);
    float a[2000], b[2000];
    kiln_tensor_t *X = make(x, 2, sh, KILN_DTYPE_F32, TRANSPOSED);
    kiln_manual_seed(3);
    assert_int_equal(kiln_tensor_to_host(kiln_dropout(X, 0.5, true), a, sizeof a), KILN_OK);
    kiln_manual_seed(3);
    assert_int_equal(kiln_tensor_to_host(kiln_dropout(X, 0.5, true), b, sizeof b), KILN_OK);
    assert_memory_equal(a, b, sizeof a);
    /* The next draw uses fresh counters: a different mask. */
    assert_int_equal(kiln_tensor_to_host(kiln_dropout(X, 0.5, true), b, sizeof b), KILN_OK);
    assert_memory_not_equal(a, b, sizeof a);
    /* Survivors are the (strided) input scaled by 2. */
    for (int i = 0; i < 2000; i++)
        if (a[i] != 0) assert_true(fabs(a[i] - 2 * x[i]) <= 1e-6 * fabs(2 * x[i]));
}

static void test_dropout_is_identity_in_eval_or_at_zero(void **state)
{
    int64_t n = 10;
    double x[10];
    fill(x, 10, -1, 1);
    kiln_tensor_t *X = make(x, 1, &n, KILN_DTYPE_F32, CONTIG);
    check("dropout eval", kiln_dropout(X, 0.5, false), 1, &n, x, 0);
    check("dropout p=0", kiln_dropout(X, 0.0, true), 1, &n, x, 0);
    assert_null(kiln_dropout(X, 1.0, true));
    assert_int_equal(kiln_last_status(), KILN_ERR_ARG);
}

/* ---- joining and splitting ---- */

static void test_cat_joins_along_a_dim(void **state)
{
    int64_t s1[2] = {2, 3}, s2[2] = {2, 1}, so[2] = {2, 4}, s3[2] = {1, 3}, so0[2] = {3, 3};
    double a[6], b[2], c[3], w[12];
    fill(a, 6, -1, 1);
    fill(b, 2, -1, 1);
    fill(c, 3, -1, 1);
    for (int r = 0; r < 2; r++) {
        for (int j = 0; j < 3; j++) w[r * 4 + j] = a[r * 3 + j];
        w[r * 4 + 3] = b[r];
    }
    kiln_tensor_t *ts[2] = {make(a, 2, s1, KILN_DTYPE_F32, TRANSPOSED), make(b, 2, s2, KILN_DTYPE_F32, CONTIG)};
    check("cat dim -1", kiln_cat(ts, 2, -1), 2, so, w, 0);
    double w0[9];
    memcpy(w0, a, sizeof a);
    memcpy(w0 + 6, c, sizeof c);
    kiln_tensor_t *us[2] = {ts[0], make(c, 2, s3, KILN_DTYPE_F32, STRIDED)};
    check("cat dim 0", kiln_cat(us, 2, 0), 2, so0, w0, 0);
}

static void test_cat_refuses_mismatched_shapes(void **state)
{
    int64_t s1[2] = {2, 3}, s2[2] = {3, 3};
    kiln_tensor_t *ts[2] = {kiln_zeros(s1, 2, KILN_DTYPE_F32), kiln_zeros(s2, 2, KILN_DTYPE_F32)};
    assert_null(kiln_cat(ts, 2, 1));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "cat"));
}

static void test_stack_adds_a_dim(void **state)
{
    int64_t sh[2] = {2, 3}, s0[3] = {2, 2, 3}, s2[3] = {2, 3, 2};
    double a[6], b[6], w0[12], w2[12];
    fill(a, 6, -1, 1);
    fill(b, 6, -1, 1);
    memcpy(w0, a, sizeof a);
    memcpy(w0 + 6, b, sizeof b);
    for (int i = 0; i < 6; i++) {
        w2[2 * i] = a[i];
        w2[2 * i + 1] = b[i];
    }
    kiln_tensor_t *ts[2] = {make(a, 2, sh, KILN_DTYPE_F64, CONTIG), make(b, 2, sh, KILN_DTYPE_F64, TRANSPOSED)};
    check("stack dim 0", kiln_stack(ts, 2, 0), 3, s0, w0, 0);
    check("stack dim -1", kiln_stack(ts, 2, -1), 3, s2, w2, 0);
}

static void test_split_gives_views_of_the_pieces(void **state)
{
    int64_t sh[2] = {2, 5}, sizes[3] = {1, 3, 1};
    double x[10];
    fill(x, 10, -1, 1);
    kiln_tensor_t *X = make(x, 2, sh, KILN_DTYPE_F32, CONTIG), *out[3];
    assert_int_equal(kiln_split(X, sizes, 3, -1, out), KILN_OK);
    int64_t s1[2] = {2, 3};
    double w[6];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 3; j++) w[r * 3 + j] = x[r * 5 + 1 + j];
    check("split middle", out[1], 2, s1, w, 0);
    assert_int_equal(kiln_fill_(out[2], 7), KILN_OK);
    double back[10];
    read_f64(X, back);
    assert_true(back[4] == 7 && back[9] == 7);
    int64_t bad[2] = {2, 2};
    assert_int_equal(kiln_split(X, bad, 2, 1, out), KILN_ERR_SHAPE);
}

static void test_tril_and_triu_keep_their_triangle(void **state)
{
    int64_t sh[3] = {2, 3, 4};
    double x[24], w[24];
    fill(x, 24, -1, 1);
    for (int upper = 0; upper < 2; upper++)
        for (int k = -1; k <= 1; k++) {
            for (int m = 0; m < 2; m++)
                for (int i = 0; i < 3; i++)
                    for (int j = 0; j < 4; j++) {
                        bool keep = upper ? j - i >= k : j - i <= k;
                        w[(m * 3 + i) * 4 + j] = keep ? x[(m * 3 + i) * 4 + j] : 0;
                    }
            kiln_tensor_t *X = make(x, 3, sh, KILN_DTYPE_F32, TRANSPOSED);
            char what[32];
            snprintf(what, sizeof what, "%s k=%d", upper ? "triu" : "tril", k);
            check(what, upper ? kiln_triu(X, k) : kiln_tril(X, k), 3, sh, w, 0);
        }
}

/* ---- rotary embedding ---- */

/* The kernel computes the frequencies theta^(-2i/D) in f32 (as LLaMA does); with
 * positions below 16 the angle error is under 1e-6, so tolerance 1e-5 for both dtypes. */
static void test_rope_rotates_pairs_half_a_head_apart(void **state)
{
    int64_t sh[4] = {2, 2, 3, 8};
    const int64_t T = 3, D = 8, h = 4, pos0 = 5;
    const double theta = 10000;
    double x[96], w[96];
    fill(x, 96, -1, 1);
    for (int64_t r = 0; r < 12; r++) {
        int64_t t = r % T;
        for (int64_t i = 0; i < h; i++) {
            double ang = (double)(pos0 + t) * pow(theta, -2.0 * (double)i / (double)D);
            double x1 = x[r * D + i], x2 = x[r * D + i + h];
            w[r * D + i] = x1 * cos(ang) - x2 * sin(ang);
            w[r * D + i + h] = x1 * sin(ang) + x2 * cos(ang);
        }
    }
    check("rope f32", kiln_rope(make(x, 4, sh, KILN_DTYPE_F32, TRANSPOSED), pos0, theta), 4, sh, w, 1e-5);
    check("rope f64", kiln_rope(make(x, 4, sh, KILN_DTYPE_F64, CONTIG), pos0, theta), 4, sh, w, 1e-5);
}

/* Scaled frequencies against the rules written out here in double (kiln/ops.h: linear
 * divides every frequency; llama3 keeps the short wavelengths, divides the long ones
 * and blends between), with theta 100 and D 8 so that llama3's three bands each hold
 * a frequency; the gradient is the inverse rotation, checked by rotating back. Bad
 * scalings are refused by name. Tolerance 1e-5 as above. */
static void test_rope_scaled_follows_the_scaling_rules(void **state)
{
    int64_t sh[4] = {1, 2, 5, 8};
    const int64_t T = 5, D = 8, h = 4, pos0 = 3;
    const double theta = 100;
    const kiln_rope_scaling lin = {.kind = KILN_ROPE_SCALING_LINEAR, .factor = 3};
    const kiln_rope_scaling l3 = {.kind = KILN_ROPE_SCALING_LLAMA3, .factor = 4, .low_freq_factor = 2,
                                  .high_freq_factor = 8, .original_context = 64};
    double x[80], w[80];
    fill(x, 80, -1, 1);
    for (int which = 0; which < 2; which++) {
        int bands[3] = {0};
        for (int64_t i = 0; i < h; i++) {
            double f = pow(theta, -2.0 * (double)i / (double)D), wl = 2 * M_PI / f, g = f / lin.factor;
            if (which == 1) {
                double s = (64 / wl - 2) / (8 - 2);
                int band = wl < 64.0 / 8 ? 0 : wl > 64.0 / 2 ? 2 : 1;
                bands[band]++;
                g = band == 0 ? f : band == 2 ? f / 4 : (1 - s) * f / 4 + s * f;
            }
            for (int64_t r = 0; r < 10; r++) {
                double ang = (double)(pos0 + r % T) * g, x1 = x[r * D + i], x2 = x[r * D + i + h];
                w[r * D + i] = x1 * cos(ang) - x2 * sin(ang);
                w[r * D + i + h] = x1 * sin(ang) + x2 * cos(ang);
            }
        }
        if (which == 1) assert_true(bands[0] == 1 && bands[1] == 1 && bands[2] == 2);
        const kiln_rope_scaling *sc = which ? &l3 : &lin;
        check(which ? "rope llama3" : "rope linear", kiln_rope_scaled(make(x, 4, sh, KILN_DTYPE_F32, CONTIG), pos0, theta, sc),
              4, sh, w, 1e-5);
        /* backward: the gradient of sum(rope(x) * g) is rope^-1(g); with g = rope(y) it is y */
        kiln_tensor_t *X = make(x, 4, sh, KILN_DTYPE_F32, CONTIG);
        kiln_tensor_set_requires_grad(X, true);
        kiln_tensor_t *G = make(w, 4, sh, KILN_DTYPE_F32, CONTIG);
        assert_int_equal(kiln_backward(kiln_sum(kiln_mul(kiln_rope_scaled(X, pos0, theta, sc), G), NULL, 0, false)),
                         KILN_OK);
        check("rope scaled grad", kiln_tensor_grad(X), 4, sh, x, 1e-5);
    }
    kiln_rope_scaling bad = l3;
    bad.high_freq_factor = 1;
    assert_null(kiln_rope_scaled(kiln_zeros(sh, 4, KILN_DTYPE_F32), 0, theta, &bad));
    assert_non_null(strstr(kiln_last_error(), "low_freq_factor (2) < high_freq_factor (1)"));
    bad = lin;
    bad.factor = 0;
    assert_null(kiln_rope_scaled(kiln_zeros(sh, 4, KILN_DTYPE_F32), 0, theta, &bad));
    assert_non_null(strstr(kiln_last_error(), "factor = 0 must be positive"));
    kiln_clear_error();
}

static void test_rope_refuses_an_odd_head_size(void **state)
{
    int64_t sh[4] = {1, 1, 2, 3};
    assert_null(kiln_rope(kiln_zeros(sh, 4, KILN_DTYPE_F32), 0, 10000));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "rope"));
}

/* ---- attention ---- */

/* o = softmax(q k^T * scale + mask) v, with kv head h / (H / Hkv) for query head h and
 * query i seeing keys j <= i + Tk - Tq when causal. */
static void ref_attention(const double *q, const double *k, const double *v, int64_t B, int64_t H, int64_t Hkv,
                          int64_t Tq, int64_t Tk, int64_t D, bool causal, double scale, double *o)
{
    double *s = malloc(sizeof(double) * (size_t)Tk);
    for (int64_t b = 0; b < B; b++)
        for (int64_t hh = 0; hh < H; hh++) {
            int64_t hk = hh / (H / Hkv);
            for (int64_t i = 0; i < Tq; i++) {
                const double *qi = q + ((b * H + hh) * Tq + i) * D;
                double m = -INFINITY, l = 0;
                for (int64_t j = 0; j < Tk; j++) {
                    const double *kj = k + ((b * Hkv + hk) * Tk + j) * D;
                    double d = 0;
                    for (int64_t c = 0; c < D; c++) d += qi[c] * kj[c];
                    s[j] = causal && j > i + Tk - Tq ? -INFINITY : d * scale;
                    m = fmax(m, s[j]);
                }
                for (int64_t j = 0; j < Tk; j++) l += exp(s[j] - m);
                for (int64_t c = 0; c < D; c++) {
                    double acc = 0;
                    for (int64_t j = 0; j < Tk; j++) acc += exp(s[j] - m) / l * v[((b * Hkv + hk) * Tk + j) * D + c];
                    o[((b * H + hh) * Tq + i) * D + c] = acc;
                }
            }
        }
    free(s);
}

static void run_attention(int64_t B, int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D, bool causal, double scale,
                          kiln_dtype dt, int layout)
{
    int64_t sq[4] = {B, H, Tq, D}, sk[4] = {B, Hkv, Tk, D};
    int64_t nq = numel(4, sq), nk = numel(4, sk);
    double *q = malloc(sizeof(double) * (size_t)nq), *k = malloc(sizeof(double) * (size_t)nk);
    double *v = malloc(sizeof(double) * (size_t)nk), *w = malloc(sizeof(double) * (size_t)nq);
    fill(q, nq, -1, 1);
    fill(k, nk, -1, 1);
    fill(v, nk, -1, 1);
    ref_attention(q, k, v, B, H, Hkv, Tq, Tk, D, causal, scale > 0 ? scale : 1 / sqrt((double)D), w);
    kiln_tensor_t *r = kiln_attention(make(q, 4, sq, dt, layout), make(k, 4, sk, dt, layout),
                                      make(v, 4, sk, dt, layout == HEADS ? HEADS : CONTIG), causal, scale);
    char what[96];
    snprintf(what, sizeof what, "attention H=%lld Hkv=%lld Tq=%lld Tk=%lld causal=%d %s", (long long)H, (long long)Hkv,
             (long long)Tq, (long long)Tk, causal, kiln_dtype_name(dt));
    check(what, r, 4, sq, w, dt == KILN_DTYPE_F64 ? 1e-12 : 1e-5);
    free(q);
    free(k);
    free(v);
    free(w);
}

static void test_attention_matches_naive_softmax_reference(void **state)
{
    for (int dti = 0; dti < 2; dti++) {
        kiln_dtype dt = dti ? KILN_DTYPE_F64 : KILN_DTYPE_F32;
        run_attention(2, 2, 2, 5, 5, 8, false, 0, dt, CONTIG);
        run_attention(2, 2, 2, 5, 5, 8, true, 0, dt, TRANSPOSED);
        run_attention(2, 3, 3, 5, 5, 8, true, 0, dt, HEADS);
        run_attention(2, 2, 2, 70, 70, 16, true, 0, dt, HEADS); /* past one 64-row tile */
    }
}

static void test_attention_with_grouped_query_heads(void **state)
{
    for (int dti = 0; dti < 2; dti++) {
        kiln_dtype dt = dti ? KILN_DTYPE_F64 : KILN_DTYPE_F32;
        run_attention(2, 4, 2, 4, 4, 4, false, 0.3, dt, STRIDED);
        run_attention(2, 4, 2, 4, 4, 4, true, 0, dt, CONTIG);
        run_attention(2, 4, 2, 4, 4, 4, false, 0, dt, HEADS);
        run_attention(1, 2, 1, 24, 40, 8, true, 0, dt, HEADS); /* sizes of 8s: the vector transpose of K */
    }
}

static void test_attention_causal_offset_when_fewer_queries_than_keys(void **state)
{
    run_attention(1, 4, 2, 3, 7, 4, true, 0, KILN_DTYPE_F64, CONTIG);
    run_attention(2, 4, 1, 1, 6, 8, true, 0, KILN_DTYPE_F32, TRANSPOSED);
    run_attention(2, 4, 1, 1, 6, 8, true, 0, KILN_DTYPE_F32, HEADS);
    run_attention(1, 2, 2, 3, 7, 4, false, 0, KILN_DTYPE_F64, CONTIG);
}

/* The gradients of sum(attention(q, k, v) * w) in double, written out: per query row
 * P = softmax(s), dP = w V^T, dS = P (dP - sum(P dP)), dq = scale dS K, and into the
 * row's kv head dk += scale dS^T q, dv += P^T w. */
static void ref_attention_backward(const double *q, const double *k, const double *v, const double *w, int64_t B,
                                   int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D, double scale, double *dq,
                                   double *dk, double *dv)
{
    double *p = malloc(sizeof(double) * (size_t)Tk), *dp = malloc(sizeof(double) * (size_t)Tk);
    memset(dk, 0, sizeof(double) * (size_t)(B * Hkv * Tk * D));
    memset(dv, 0, sizeof(double) * (size_t)(B * Hkv * Tk * D));
    for (int64_t b = 0; b < B; b++)
        for (int64_t hh = 0; hh < H; hh++) {
            int64_t hk = hh / (H / Hkv);
            const double *K = k + (b * Hkv + hk) * Tk * D, *V = v + (b * Hkv + hk) * Tk * D;
            double *dK = dk + (b * Hkv + hk) * Tk * D, *dV = dv + (b * Hkv + hk) * Tk * D;
            for (int64_t i = 0; i < Tq; i++) {
                const double *qi = q + ((b * H + hh) * Tq + i) * D, *wi = w + ((b * H + hh) * Tq + i) * D;
                int64_t nk = i + Tk - Tq + 1 < Tk ? i + Tk - Tq + 1 : Tk;
                double m = -INFINITY, l = 0, pdp = 0;
                for (int64_t j = 0; j < nk; j++) {
                    double d = 0;
                    for (int64_t c = 0; c < D; c++) d += qi[c] * K[j * D + c];
                    p[j] = d * scale;
                    m = fmax(m, p[j]);
                }
                for (int64_t j = 0; j < nk; j++) l += (p[j] = exp(p[j] - m));
                for (int64_t j = 0; j < nk; j++) {
                    p[j] /= l;
                    dp[j] = 0;
                    for (int64_t c = 0; c < D; c++) dp[j] += wi[c] * V[j * D + c];
                    pdp += p[j] * dp[j];
                }
                double *dqi = dq + ((b * H + hh) * Tq + i) * D;
                for (int64_t c = 0; c < D; c++) dqi[c] = 0;
                for (int64_t j = 0; j < nk; j++) {
                    double ds = p[j] * (dp[j] - pdp);
                    for (int64_t c = 0; c < D; c++) {
                        dqi[c] += scale * ds * K[j * D + c];
                        dK[j * D + c] += scale * ds * qi[c];
                        dV[j * D + c] += p[j] * wi[c];
                    }
                }
            }
        }
    free(p);
    free(dp);
}

/* Attention's backward (causal) in f32 and f64 against ref_attention_backward: tiles
 * with masked softmax lanes, K and V transposed (in vector blocks for f32 at sizes of
 * 8s), more than one 64-row tile, grouped heads, fewer queries than keys, inputs read
 * through their strides. Tolerance 1e-4 relative for f32, 1e-10 for f64. */
static void test_attention_backward_matches_reference(void **state)
{
    (void)state;
    struct {
        int64_t B, H, Hkv, Tq, Tk, D;
        int layout;
    } cases[] = {{2, 4, 2, 72, 72, 16, HEADS}, {1, 2, 1, 40, 72, 8, CONTIG}};
    for (int c = 0; c < 2; c++) {
        int64_t sq[4] = {cases[c].B, cases[c].H, cases[c].Tq, cases[c].D};
        int64_t sk[4] = {cases[c].B, cases[c].Hkv, cases[c].Tk, cases[c].D};
        int64_t nq = numel(4, sq), nk = numel(4, sk);
        double *v[4], *want[3];
        for (int i = 0; i < 4; i++) {
            v[i] = malloc(sizeof(double) * (size_t)(i == 1 || i == 2 ? nk : nq));
            fill(v[i], i == 1 || i == 2 ? nk : nq, -1, 1);
        }
        for (int i = 0; i < 3; i++) want[i] = malloc(sizeof(double) * (size_t)(i ? nk : nq));
        ref_attention_backward(v[0], v[1], v[2], v[3], cases[c].B, cases[c].H, cases[c].Hkv, cases[c].Tq, cases[c].Tk,
                               cases[c].D, 1 / sqrt((double)cases[c].D), want[0], want[1], want[2]);
        for (int p = 0; p < 2; p++) {
            kiln_dtype dt = p ? KILN_DTYPE_F64 : KILN_DTYPE_F32;
            kiln_tensor_t *in[3];
            for (int i = 0; i < 3; i++) {
                in[i] = make(v[i], 4, i ? sk : sq, dt, cases[c].layout);
                kiln_tensor_set_requires_grad(in[i], true);
            }
            kiln_tensor_t *w = make(v[3], 4, sq, dt, CONTIG);
            kiln_tensor_t *loss = kiln_sum(kiln_mul(kiln_attention(in[0], in[1], in[2], true, 0), w), NULL, 0, false);
            assert_non_null(loss);
            assert_int_equal(kiln_backward(loss), KILN_OK);
            for (int i = 0; i < 3; i++) {
                char what[64];
                snprintf(what, sizeof what, "attention backward %s case %d input %d", kiln_dtype_name(dt), c, i);
                check(what, kiln_tensor_grad(in[i]), 4, i ? sk : sq, want[i], p ? 1e-10 : 1e-4);
            }
        }
        for (int i = 0; i < 4; i++) free(v[i]);
        for (int i = 0; i < 3; i++) free(want[i]);
    }
}

static void test_attention_refuses_heads_that_do_not_group(void **state)
{
    int64_t sq[4] = {1, 3, 2, 4}, sk[4] = {1, 2, 2, 4};
    kiln_tensor_t *q = kiln_zeros(sq, 4, KILN_DTYPE_F32), *k = kiln_zeros(sk, 4, KILN_DTYPE_F32);
    assert_null(kiln_attention(q, k, k, false, 0));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "attention"));
}

/* ---- in-place ---- */

static void test_add_inplace_broadcasts_src_with_alpha(void **state)
{
    int64_t sh[2] = {3, 4}, sb[1] = {4};
    double d[12], s[4], w[12];
    fill(d, 12, -1, 1);
    fill(s, 4, -1, 1);
    for (int i = 0; i < 12; i++) w[i] = d[i] - 0.5 * s[i % 4];
    kiln_tensor_t *D = make(d, 2, sh, KILN_DTYPE_F32, CONTIG);
    assert_int_equal(kiln_add_(D, make(s, 1, sb, KILN_DTYPE_F64, CONTIG), -0.5), KILN_OK);
    check("add_", D, 2, sh, w, TOL32);
    assert_int_equal(kiln_add_(make(s, 1, sb, KILN_DTYPE_F32, CONTIG), D, 1.0), KILN_ERR_SHAPE);
}

static void test_add_inplace_writes_through_a_strided_view(void **state)
{
    int64_t sh[2] = {2, 3};
    double d[6], s[6], w[6];
    fill(d, 6, -1, 1);
    fill(s, 6, -1, 1);
    for (int i = 0; i < 6; i++) w[i] = d[i] + 2 * s[i];
    kiln_tensor_t *D = make(d, 2, sh, KILN_DTYPE_F64, TRANSPOSED);
    assert_int_equal(kiln_add_(D, make(s, 2, sh, KILN_DTYPE_F64, STRIDED), 2.0), KILN_OK);
    check("add_ strided", D, 2, sh, w, TOL64);
}

static void test_mul_scalar_and_fill_inplace(void **state)
{
    int64_t sh[2] = {3, 4};
    double d[12], w[12];
    fill(d, 12, -1, 1);
    for (int i = 0; i < 12; i++) w[i] = d[i] * 2.5;
    kiln_tensor_t *D = make(d, 2, sh, KILN_DTYPE_F32, STRIDED);
    assert_int_equal(kiln_mul_scalar_(D, 2.5), KILN_OK);
    check("mul_scalar_", D, 2, sh, w, TOL32);
    kiln_tensor_t *col = kiln_narrow(D, 1, 1, 1);
    assert_int_equal(kiln_fill_(col, -4), KILN_OK);
    for (int r = 0; r < 3; r++) w[r * 4 + 1] = -4;
    check("fill_ column", D, 2, sh, w, TOL32);
    int64_t n = 3;
    kiln_tensor_t *I = kiln_zeros(&n, 1, KILN_DTYPE_I64);
    assert_int_equal(kiln_fill_(I, 9), KILN_OK);
    const double w9[3] = {9, 9, 9};
    check("fill_ i64", I, 1, &n, w9, 0);
}

/* AdamW (Loshchilov & Hutter) in double: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 * p = p (1 - lr wd) - lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps). The kernel runs
 * in f32: tolerance 1e-6 relative. */
static void test_adamw_step_matches_reference(void **state)
{
    int64_t n = 37;
    double p[37], g[37], m[37], v[37];
    fill(p, n, -1, 1);
    fill(g, n, -1, 1);
    fill(m, n, -0.1, 0.1);
    fill(v, n, 0, 0.01);
    kiln_tensor_t *P = make(p, 1, &n, KILN_DTYPE_F32, CONTIG), *G = make(g, 1, &n, KILN_DTYPE_F32, CONTIG);
    kiln_tensor_t *M = make(m, 1, &n, KILN_DTYPE_F32, CONTIG), *V = make(v, 1, &n, KILN_DTYPE_F32, CONTIG);
    const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    for (int64_t t = 1; t <= 3; t++) {
        assert_int_equal(kiln_adamw_(P, G, M, V, lr, b1, b2, eps, wd, t), KILN_OK);
        for (int i = 0; i < n; i++) {
            m[i] = b1 * m[i] + (1 - b1) * g[i];
            v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
            p[i] = p[i] * (1 - lr * wd) - lr * (m[i] / (1 - pow(b1, (double)t))) / (sqrt(v[i] / (1 - pow(b2, (double)t))) + eps);
        }
    }
    check("adamw p", P, 1, &n, p, 1e-6);
    check("adamw m", M, 1, &n, m, 1e-6);
    check("adamw v", V, 1, &n, v, 1e-6);
    /* A gscale that is not finite (an f16 step that overflowed) skips the update, at
     * any step count, even 0, which is then not read: p, m, v as they were (an update
     * through NaN or inf would leave no element finite). */
    int64_t one = 1;
    double lrv = lr, bad[2] = {NAN, INFINITY}, t0 = 0;
    for (int k = 0; k < 2; k++) {
        kiln_tensor_t *LR = make(&lrv, 1, &one, KILN_DTYPE_F64, CONTIG), *T = make(&t0, 1, &one, KILN_DTYPE_F64, CONTIG);
        kiln_tensor_t *GS = make(&bad[k], 1, &one, KILN_DTYPE_F32, CONTIG);
        assert_int_equal(kiln_adamw_step_(P, G, M, V, LR, T, GS, b1, b2, eps, wd), KILN_OK);
    }
    check("adamw p after skipped steps", P, 1, &n, p, 1e-6);
    check("adamw m after skipped steps", M, 1, &n, m, 1e-6);
    check("adamw v after skipped steps", V, 1, &n, v, 1e-6);
}

static void test_adamw_refuses_step_zero_and_f64(void **state)
{
    int64_t n = 2;
    kiln_tensor_t *a = kiln_zeros(&n, 1, KILN_DTYPE_F32);
    assert_int_equal(kiln_adamw_(a, a, a, a, 1e-3, 0.9, 0.999, 1e-8, 0, 0), KILN_ERR_ARG);
    kiln_tensor_t *d = kiln_zeros(&n, 1, KILN_DTYPE_F64);
    assert_int_equal(kiln_adamw_(d, d, d, d, 1e-3, 0.9, 0.999, 1e-8, 0, 1), KILN_ERR_SHAPE);
}

static void test_inplace_on_a_tracked_tensor_is_refused_while_grad_is_on(void **state)
{
    int64_t n = 3;
    kiln_tensor_t *w = kiln_ones(&n, 1, KILN_DTYPE_F32);
    kiln_tensor_set_requires_grad(w, true);
    assert_int_equal(kiln_mul_scalar_(w, 2), KILN_ERR_AUTOGRAD);
    assert_non_null(strstr(kiln_last_error(), "scale_"));
    assert_int_equal(kiln_fill_(w, 0), KILN_ERR_AUTOGRAD);
    assert_int_equal(kiln_add_(kiln_mul_scalar(w, 2), w, 1), KILN_ERR_AUTOGRAD); /* a non-leaf too */
    kiln_clear_error();
    bool prev = kiln_set_grad_enabled(false);
    assert_int_equal(kiln_mul_scalar_(w, 2), KILN_OK);
    kiln_set_grad_enabled(prev);
    const double w2[3] = {2, 2, 2};
    check("mul_scalar_ with grad off", w, 1, &n, w2, 0);
}

/* A leaf's first gradient is the formula's own tensor where nothing else holds it
 * (KILN_OPT_STEAL_GRAD): two leaves whose gradients are made fresh by mul's backward
 * raise the peak by those two gradients alone, not by copies of them too (with the
 * switch off, as ctest's *_blas run sets it, the copies add 2 x 4 MiB); and where add's backward hands one tensor to both leaves, or
 * the seed itself comes back, each leaf still gets its own: doubling one leaves the
 * other and the seed as they were. Oracle: the values by hand (exact in f32). */
static void test_leaf_gradients_are_taken_not_copied_and_never_shared(void **state)
{
    int64_t n = 1 << 20;
    size_t bytes = sizeof(float) * (size_t)n;
    kiln_scope_begin();
    kiln_tensor_t *x = kiln_full(&n, 1, 3, KILN_DTYPE_F32), *w = kiln_full(&n, 1, 5, KILN_DTYPE_F32);
    kiln_tensor_set_requires_grad(x, true);
    kiln_tensor_set_requires_grad(w, true);
    kiln_tensor_t *y = kiln_mul(x, w), *seed = kiln_full(&n, 1, 2, KILN_DTYPE_F32);
    assert_non_null(y);
    size_t before = kiln_memory_allocated();
    kiln_memory_reset_peak();
    assert_int_equal(kiln_backward_with(y, seed), KILN_OK);
    size_t rise = kiln_memory_peak() - before;
    if (test_opt_on("STEAL_GRAD"))
        assert_true(rise >= 2 * bytes && rise < 3 * bytes);
    else /* ctest's *_blas run: each gradient beside its copy */
        assert_true(rise >= 4 * bytes);
    double v;
    assert_int_equal(kiln_tensor_item(kiln_sum(kiln_tensor_grad(x), NULL, 0, false), &v), KILN_OK);
    assert_true(v == 10.0 * (double)n); /* 2 x 5 */
    assert_int_equal(kiln_tensor_item(kiln_sum(kiln_tensor_grad(w), NULL, 0, false), &v), KILN_OK);
    assert_true(v == 6.0 * (double)n); /* 2 x 3 */

    /* one gradient tensor for two leaves, and the seed handed straight back */
    int64_t m = 5;
    kiln_tensor_t *a = kiln_full(&m, 1, 1, KILN_DTYPE_F32), *b = kiln_full(&m, 1, 1, KILN_DTYPE_F32);
    kiln_tensor_set_requires_grad(a, true);
    kiln_tensor_set_requires_grad(b, true);
    kiln_tensor_t *s2 = kiln_full(&m, 1, 7, KILN_DTYPE_F32);
    assert_int_equal(kiln_backward_with(kiln_add(a, b), s2), KILN_OK);
    assert_int_equal(kiln_add_(kiln_tensor_grad(a), kiln_tensor_grad(a), 1), KILN_OK);
    const double g14[5] = {14, 14, 14, 14, 14}, g7[5] = {7, 7, 7, 7, 7};
    check("a's gradient, doubled", kiln_tensor_grad(a), 1, &m, g14, 0);
    check("b's gradient", kiln_tensor_grad(b), 1, &m, g7, 0);
    check("the seed", s2, 1, &m, g7, 0);

    /* add's gradient handed to a leaf and to a node that hands it on to two more, whose
     * gradients grow the leaf's in place: y = (x + (2x + 3x)) 7, dy/dx = 42 */
    kiln_tensor_t *x2 = kiln_full(&m, 1, 1, KILN_DTYPE_F32);
    kiln_tensor_set_requires_grad(x2, true);
    kiln_tensor_t *inner = kiln_add(kiln_mul_scalar(x2, 2), kiln_mul_scalar(x2, 3));
    kiln_tensor_t *y2 = kiln_mul_scalar(kiln_add(x2, inner), 7);
    assert_int_equal(kiln_backward(kiln_sum(y2, NULL, 0, false)), KILN_OK);
    const double g42[5] = {42, 42, 42, 42, 42};
    check("a gradient handed on twice", kiln_tensor_grad(x2), 1, &m, g42, 0);
    kiln_scope_end();
}

/* ---- sizes that reach the parallel paths ---- */

/* Rows longer than the cpu grain (16384) are split across threads; one length divides
 * into pieces and one does not. Reference in double, f32 tolerance. */
static void test_long_rows_split_across_threads_match_reference(void **state)
{
    const int64_t lens[2] = {65536, 50001};
    for (int k = 0; k < 2; k++) {
        int64_t n = lens[k];
        double *a = malloc(sizeof(double) * (size_t)n), *b = malloc(sizeof(double) * (size_t)n);
        double *w = malloc(sizeof(double) * (size_t)n);
        fill(a, n, -1, 1);
        fill(b, n, -1, 1);
        double sum = 0;
        for (int64_t i = 0; i < n; i++) {
            w[i] = a[i] * b[i] + b[i];
            sum += w[i];
        }
        kiln_tensor_t *A = make(a, 1, &n, KILN_DTYPE_F32, CONTIG), *B = make(b, 1, &n, KILN_DTYPE_F32, STRIDED);
        kiln_tensor_t *r = kiln_add(kiln_mul(A, B), B);
        check("long row", r, 1, &n, w, TOL32);
        /* The sum's tolerance grows with the count: each term carries f32 rounding. */
        double got;
        assert_int_equal(kiln_tensor_item(kiln_sum(r, NULL, 0, false), &got), KILN_OK);
        assert_true(fabs(got - sum) < 1e-6 * (double)n);
        free(a);
        free(b);
        free(w);
    }
}

static void test_many_rows_reduce_and_softmax_in_parallel(void **state)
{
    int64_t sh[2] = {3000, 17}, nr = 3000;
    double *x = malloc(sizeof(double) * 51000), *w = malloc(sizeof(double) * 51000), ws[3000];
    fill(x, 51000, -3, 3);
    for (int64_t r = 0; r < nr; r++) {
        ws[r] = 0;
        for (int j = 0; j < 17; j++) ws[r] += x[r * 17 + j];
    }
    ref_softmax(x, 3000, 17, 1, false, w);
    int dim = 1;
    check("row sums", kiln_sum(make(x, 2, sh, KILN_DTYPE_F64, CONTIG), &dim, 1, false), 1, &nr, ws, TOL64);
    check("softmax rows", kiln_softmax(make(x, 2, sh, KILN_DTYPE_F32, TRANSPOSED), -1), 2, sh, w, TOL32);
    free(x);
    free(w);
}

/* ---- narrow float dtypes and empty tensors ---- */

/* f16/bf16 arithmetic runs in double and rounds once to the output dtype, so the
 * result equals the reference rounded to that dtype, exactly. */
static void test_half_precision_add_rounds_the_exact_result(void **state)
{
    int64_t n = 64;
    double a[64], b[64];
    fill(a, n, -4, 4);
    fill(b, n, -4, 4);
    for (int k = 0; k < 2; k++) {
        kiln_dtype dt = k ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
        double ah[64], bh[64], w[64];
        read_f64(make(a, 1, &n, dt, CONTIG), ah);
        read_f64(make(b, 1, &n, dt, CONTIG), bh);
        for (int i = 0; i < 64; i++) w[i] = ah[i] + bh[i];
        read_f64(make(w, 1, &n, dt, CONTIG), w); /* the reference, rounded to dt */
        kiln_tensor_t *r = kiln_add(make(a, 1, &n, dt, CONTIG), make(b, 1, &n, dt, STRIDED));
        assert_int_equal(kiln_tensor_dtype(r), dt);
        check(k ? "bf16 add" : "f16 add", r, 1, &n, w, 0);
    }
}

static void test_ops_on_empty_tensors_give_empty_or_zero_results(void **state)
{
    int64_t sh[2] = {0, 3}, n3 = 3;
    kiln_tensor_t *e = kiln_zeros(sh, 2, KILN_DTYPE_F32);
    check("empty add", kiln_add(e, e), 2, sh, NULL, 0);
    int dim = 0;
    const double z[3] = {0, 0, 0};
    check("sum over an empty dim", kiln_sum(e, &dim, 1, false), 1, &n3, z, 0);
    int64_t s1[2] = {3, 0}, so[2] = {0, 0};
    const double zz[9] = {0};
    int64_t s33[2] = {3, 3};
    kiln_tensor_t *k0 = kiln_zeros(sh, 2, KILN_DTYPE_F32); /* (0,3) */
    check("matmul (3,0)@(0,3)", kiln_matmul(kiln_zeros(s1, 2, KILN_DTYPE_F32), k0), 2, s33, zz, 0);
    check("matmul (0,3)@(3,0)", kiln_matmul(e, kiln_zeros(s1, 2, KILN_DTYPE_F32)), 2, so, NULL, 0);
}

#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_unary_ops_match_reference_f32),
        T(test_unary_ops_match_reference_f64),
        T(test_unary_ops_match_reference_on_transposed_input),
        T(test_unary_ops_match_reference_on_strided_input_f64),
        T(test_neg_abs_relu_keep_integer_dtypes),
        T(test_binary_ops_broadcast_and_match_reference_f32),
        T(test_binary_ops_broadcast_and_match_reference_f64),
        T(test_binary_ops_on_strided_operands),
        T(test_binary_ops_promote_mixed_dtypes),
        T(test_scalar_ops_match_reference),
        T(test_maximum_propagates_nan),
        T(test_comparisons_broadcast_and_give_bool),
        T(test_where_broadcasts_all_three_operands),
        T(test_cast_truncates_floats_to_integers),
        T(test_cast_to_bool_is_nonzero),
        T(test_cast_between_floats_rounds_to_target),
        T(test_sum_matches_reference),
        T(test_column_sums_of_tall_matrices_match_reference),
        T(test_max_matches_reference),
        T(test_mean_matches_reference),
        T(test_logsumexp_matches_reference),
        T(test_sum_of_integers_is_i64),
        T(test_var_matches_reference_with_correction),
        T(test_argmax_picks_the_first_of_ties),
        T(test_argmax_matches_reference_on_random_input),
        T(test_softmax_and_log_softmax_match_reference),
        T(test_softmax_is_stable_for_large_logits),
        T(test_matmul_matches_reference_for_every_shape_kind),
        T(test_matmul_of_transposed_and_sliced_operands),
        T(test_matmul_of_column_narrowed_batched_operand),
        T(test_matmul_refuses_mixed_dtypes),
        T(test_embedding_picks_rows),
        T(test_index_select_picks_along_a_dim),
        T(test_gather_follows_the_index_along_dim),
        T(test_scatter_add_accumulates_repeated_indices),
        T(test_scatter_add_along_the_last_dim),
        T(test_scatter_add_refuses_an_index_larger_than_the_input),
        T(test_gather_with_an_out_of_range_index_is_an_index_error),
        T(test_index_tensor_of_float_dtype_is_a_dtype_error),
        T(test_layer_norm_matches_reference),
        T(test_rms_norm_matches_reference),
        T(test_layer_norm_refuses_a_weight_of_the_wrong_size),
        T(test_cross_entropy_leaves_out_ignored_targets),
        T(test_cross_entropy_with_an_out_of_range_target_is_an_index_error),
        T(test_dropout_zeroes_about_p_and_scales_survivors),
        T(test_dropout_with_the_same_seed_gives_the_same_mask),
        T(test_dropout_is_identity_in_eval_or_at_zero),
        T(test_cat_joins_along_a_dim),
        T(test_cat_refuses_mismatched_shapes),
        T(test_stack_adds_a_dim),
        T(test_split_gives_views_of_the_pieces),
        T(test_tril_and_triu_keep_their_triangle),
        T(test_rope_rotates_pairs_half_a_head_apart),
        T(test_rope_scaled_follows_the_scaling_rules),
        T(test_rope_refuses_an_odd_head_size),
        T(test_attention_matches_naive_softmax_reference),
        T(test_attention_with_grouped_query_heads),
        T(test_attention_causal_offset_when_fewer_queries_than_keys),
        T(test_attention_refuses_heads_that_do_not_group),
        T(test_attention_backward_matches_reference),
        T(test_add_inplace_broadcasts_src_with_alpha),
        T(test_add_inplace_writes_through_a_strided_view),
        T(test_mul_scalar_and_fill_inplace),
        T(test_adamw_step_matches_reference),
        T(test_adamw_refuses_step_zero_and_f64),
        T(test_inplace_on_a_tracked_tensor_is_refused_while_grad_is_on),
        T(test_leaf_gradients_are_taken_not_copied_and_never_shared),
        T(test_long_rows_split_across_threads_match_reference),
        T(test_many_rows_reduce_and_softmax_in_parallel),
        T(test_half_precision_add_rounds_the_exact_result),
        T(test_ops_on_empty_tensors_give_empty_or_zero_results),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
