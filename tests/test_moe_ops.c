/* The mixture-of-experts routing ops: kiln_topk, kiln_moe_sort, kiln_grouped_matmul.
 *
 * Oracles, written here in plain C over doubles:
 *   topk        per row, the stable ranking (larger first, NaN above every number, of
 *               equal values the lower index first) by repeated selection; values and
 *               indices compared exactly (a value is copied, never computed). Not
 *               torch.topk: it promises no order among ties, so its golden values would
 *               test nothing about the rule kiln states.
 *   moe_sort    per expert, the assignments in ascending order; compared exactly.
 *   grouped     per row, the sum over K in double; |got - want| <= tol (1 + |want|),
 *               tol 1e-5 for f32, 1e-12 for f64, 2e-2 for bf16 and f16 (rounded inputs
 *               and result).
 *   gradients   central finite differences in f64 of L = sum(out * R), eps 1e-6, as
 *               tests/test_gradcheck.c (tolerance 1e-6 + 1e-6 |fd|); topk's inputs are
 *               distinct by far more than eps, so the choice does not move.
 * Bad inputs are errors with a message that names the op, never a crash. A compiled
 * function (sort + grouped matmul) runs one graph for calls whose per-expert counts
 * differ. On a device (KILN_DEVICE, tests/on_device.sh) every tensor is made there; on
 * OpenCL the four ops must run on the device's own kernels (never the cpu with copies),
 * and bad experts and offsets in a step captured as a command buffer are errors of the
 * run that met them. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/kiln.h"
#include "kiln/graph.h"
#include "test_util.h"
#include "core/backend.h"

static uint64_t rng = 0x2545F4914F6CDD1DULL;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1p-53;
}

static kiln_tensor_t *from_f64(const double *v, int nd, const int64_t *sh, kiln_dtype dt)
{
    kiln_tensor_t *t = kiln_cast(kiln_from_data(v, sh, nd, KILN_DTYPE_F64), dt);
    assert_non_null(t);
    return t;
}

static kiln_tensor_t *from_i64(const int64_t *v, int nd, const int64_t *sh)
{
    kiln_tensor_t *t = kiln_from_data(v, sh, nd, KILN_DTYPE_I64);
    assert_non_null(t);
    return t;
}

/* The f64 leaf x's elements set to h, outside autograd. */
static void set_values(kiln_tensor_t *x, const double *h)
{
    kiln_scope_begin();
    bool prev = kiln_set_grad_enabled(false);
    assert_int_equal(kiln_tensor_copy_(x, from_f64(h, kiln_tensor_ndim(x), kiln_tensor_shape(x), KILN_DTYPE_F64)),
                     KILN_OK);
    kiln_set_grad_enabled(prev);
    kiln_scope_end();
}

/* t's elements as doubles (n of them), in a new buffer. */
static double *read_f64(kiln_tensor_t *t)
{
    assert_non_null(t);
    int64_t n = kiln_tensor_numel(t);
    double *v = malloc(sizeof *v * (size_t)(n ? n : 1));
    assert_int_equal(kiln_tensor_to_host(kiln_cast(t, KILN_DTYPE_F64), v, sizeof *v * (size_t)n), KILN_OK);
    return v;
}

static int64_t *read_i64(kiln_tensor_t *t)
{
    assert_non_null(t);
    assert_int_equal(kiln_tensor_dtype(t), KILN_DTYPE_I64);
    int64_t n = kiln_tensor_numel(t);
    int64_t *v = malloc(sizeof *v * (size_t)(n ? n : 1));
    assert_int_equal(kiln_tensor_to_host(t, v, sizeof *v * (size_t)n), KILN_OK);
    return v;
}

/* The error of the last call names `what`. */
static void assert_error(kiln_status s, kiln_status want, const char *what)
{
    if (s == KILN_OK) fail_msg("expected an error naming '%s', got success", what);
    if (want != KILN_OK && s != want) fail_msg("status %d, expected %d: %s", (int)s, (int)want, kiln_last_error());
    if (!strstr(kiln_last_error(), what)) fail_msg("the error does not name '%s': %s", what, kiln_last_error());
    kiln_clear_error();
}

/* ---- topk ---- */

static bool ranks_before(double a, double b) { return (isnan(a) && !isnan(b)) || a > b; }

/* Row by row: k times, the first element (lowest index) that no unchosen one ranks
 * before. */
static void topk_oracle(const double *x, int64_t rows, int64_t E, int64_t k, int64_t *idx)
{
    bool *taken = malloc(sizeof *taken * (size_t)E);
    for (int64_t r = 0; r < rows; r++) {
        const double *row = x + r * E;
        memset(taken, 0, sizeof *taken * (size_t)E);
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t i = 0; i < E; i++)
                if (!taken[i] && (best < 0 || ranks_before(row[i], row[best]))) best = i;
            taken[best] = true;
            idx[r * k + j] = best;
        }
    }
    free(taken);
}

static bool same_double(double a, double b) { return (isnan(a) && isnan(b)) || (a == b && signbit(a) == signbit(b)); }

/* topk of x (rows, E) in dt against the oracle on x as dt holds it. */
static void check_topk(const double *v, int64_t rows, int64_t E, int64_t k, kiln_dtype dt)
{
    kiln_scope_begin();
    int64_t sh[2] = {rows, E};
    kiln_tensor_t *x = from_f64(v, 2, sh, dt), *val, *idx;
    double *xs = read_f64(x); /* the values as rounded to dt */
    if (kiln_topk(x, k, &val, &idx) != KILN_OK) fail_msg("topk: %s", kiln_last_error());
    assert_int_equal(kiln_tensor_dtype(val), dt);
    assert_int_equal(kiln_tensor_ndim(val), 2);
    assert_int_equal(kiln_tensor_shape(val)[1], k);
    assert_int_equal(kiln_tensor_shape(idx)[0], rows);
    int64_t *want = malloc(sizeof *want * (size_t)(rows * k)), *got = read_i64(idx);
    double *gv = read_f64(val);
    topk_oracle(xs, rows, E, k, want);
    for (int64_t i = 0; i < rows * k; i++) {
        if (got[i] != want[i])
            fail_msg("topk (%s, %lldx%lld, k %lld): row %lld slot %lld chose %lld, the oracle %lld", kiln_dtype_name(dt),
                     (long long)rows, (long long)E, (long long)k, (long long)(i / k), (long long)(i % k),
                     (long long)got[i], (long long)want[i]);
        if (!same_double(gv[i], xs[(i / k) * E + want[i]])) fail_msg("topk: value %lld is %g", (long long)i, gv[i]);
    }
    free(want);
    free(got);
    free(gv);
    free(xs);
    kiln_scope_end();
}

/* Values from a few levels, so that most rows have ties; k = 1, a middle k and k = E. */
static void topk_matches_the_oracle_with_ties_broken_by_the_lower_index(void **state)
{
    static const struct {
        int64_t rows, E;
    } sh[] = {{1, 8}, {7, 8}, {65, 16}, {3, 1}, {5, 33}};
    const kiln_dtype dts[] = {KILN_DTYPE_F32, KILN_DTYPE_F64, KILN_DTYPE_BF16, KILN_DTYPE_F16};
    for (size_t s = 0; s < sizeof sh / sizeof sh[0]; s++) {
        int64_t n = sh[s].rows * sh[s].E;
        double *v = malloc(sizeof *v * (size_t)n);
        for (int64_t i = 0; i < n; i++) v[i] = floor(urand() * 4) - 1.5; /* 4 levels */
        int64_t ks[3] = {1, (sh[s].E + 1) / 2, sh[s].E};
        for (int d = 0; d < 4; d++)
            for (int j = 0; j < 3; j++) check_topk(v, sh[s].rows, sh[s].E, ks[j], dts[d]);
        for (int64_t i = 0; i < n; i++) v[i] = urand() * 2 - 1; /* distinct */
        for (int j = 0; j < 3; j++) check_topk(v, sh[s].rows, sh[s].E, ks[j], KILN_DTYPE_F32);
        free(v);
    }
}

/* All equal: the first k indices in order. NaN above +inf; -0 and +0 tie. */
static void topk_orders_all_equal_rows_nan_and_signed_zeros_by_the_rule(void **state)
{
    const double row[4][6] = {{2, 2, 2, 2, 2, 2},
                              {1, NAN, INFINITY, NAN, -1, 3},
                              {-0.0, 0.0, -0.0, -1, 0.0, -2},
                              {-INFINITY, -5, -INFINITY, -5, -7, -5}};
    const int64_t want[4][3] = {{0, 1, 2}, {1, 3, 2}, {0, 1, 2}, {1, 3, 5}};
    kiln_tensor_t *val, *idx;
    assert_int_equal(kiln_topk(from_f64(&row[0][0], 2, (int64_t[]){4, 6}, KILN_DTYPE_F32), 3, &val, &idx), KILN_OK);
    int64_t *got = read_i64(idx);
    double *gv = read_f64(val);
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 3; j++) {
            if (got[r * 3 + j] != want[r][j])
                fail_msg("row %d slot %d: index %lld, want %lld", r, j, (long long)got[r * 3 + j], (long long)want[r][j]);
            assert_true(same_double(gv[r * 3 + j], row[r][want[r][j]]));
        }
    free(got);
    free(gv);
    check_topk(&row[0][0], 4, 6, 6, KILN_DTYPE_F64);
}

static void topk_bad_arguments_are_errors(void **state)
{
    kiln_tensor_t *x = kiln_zeros((int64_t[]){3, 4}, 2, KILN_DTYPE_F32), *val, *idx;
    assert_error(kiln_topk(x, 0, &val, &idx), KILN_ERR_ARG, "topk: k 0 is outside 1..4");
    assert_null(val);
    assert_error(kiln_topk(x, 5, &val, &idx), KILN_ERR_ARG, "topk: k 5");
    assert_error(kiln_topk(kiln_zeros((int64_t[]){3, 4}, 2, KILN_DTYPE_I64), 1, &val, &idx), KILN_ERR_DTYPE,
                 "topk");
    assert_error(kiln_topk(kiln_scalar(1, KILN_DTYPE_F32), 1, &val, &idx), KILN_ERR_SHAPE, "topk");
    assert_error(kiln_topk(NULL, 1, &val, &idx), KILN_OK, "topk");
    assert_error(kiln_topk(x, 1, NULL, &idx), KILN_ERR_ARG, "topk");
}

/* ---- moe_sort ---- */

static void check_sort(const int64_t *ind, int64_t N, int64_t k, int64_t E, kiln_dtype idt)
{
    kiln_scope_begin();
    kiln_tensor_t *t = kiln_cast(from_i64(ind, 2, (int64_t[]){N, k}), idt), *order, *offsets;
    if (kiln_moe_sort(t, E, &order, &offsets) != KILN_OK) fail_msg("moe_sort: %s", kiln_last_error());
    assert_int_equal(kiln_tensor_numel(order), N * k);
    assert_int_equal(kiln_tensor_numel(offsets), E + 1);
    int64_t *o = read_i64(order), *off = read_i64(offsets), at = 0;
    for (int64_t e = 0; e < E; e++) {
        if (off[e] != at) fail_msg("moe_sort: offsets[%lld] = %lld, want %lld", (long long)e, (long long)off[e], (long long)at);
        for (int64_t a = 0; a < N * k; a++)
            if (ind[a] == e) {
                if (o[at] != a) fail_msg("moe_sort: order[%lld] = %lld, want %lld (expert %lld)", (long long)at,
                                         (long long)o[at], (long long)a, (long long)e);
                at++;
            }
    }
    assert_int_equal(off[E], N * k);
    free(o);
    free(off);
    kiln_scope_end();
}

/* Random choices (experts 2 and 5 never chosen: zero tokens), k = 1, 2 and E. */
static void moe_sort_is_stable_and_counts_every_expert(void **state)
{
    const int64_t E = 8, Ns[] = {1, 7, 65};
    for (int s = 0; s < 3; s++)
        for (int kk = 0; kk < 3; kk++) {
            int64_t N = Ns[s], k = kk == 0 ? 1 : kk == 1 ? 2 : E;
            int64_t *ind = malloc(sizeof *ind * (size_t)(N * k));
            for (int64_t a = 0; a < N * k; a++) {
                int64_t e;
                do e = (int64_t)(urand() * (double)E);
                while (e == 2 || e == 5);
                ind[a] = e;
            }
            check_sort(ind, N, k, E, KILN_DTYPE_I64);
            check_sort(ind, N, k, E, KILN_DTYPE_I32);
            check_sort(ind, N, k, 12, KILN_DTYPE_I64); /* more experts than chosen: trailing empties */
            free(ind);
        }
}

static void moe_sort_bad_indices_are_errors(void **state)
{
    const int64_t bad[2][4] = {{0, 3, 1, 4}, {2, -1, 0, 0}};
    kiln_tensor_t *order, *offsets;
    assert_error(kiln_moe_sort(from_i64(bad[0], 2, (int64_t[]){2, 2}), 4, &order, &offsets), KILN_ERR_INDEX,
                 "moe_sort: index 4 at position 3 is outside [0, 4)");
    assert_error(kiln_moe_sort(from_i64(bad[1], 2, (int64_t[]){2, 2}), 4, &order, &offsets), KILN_ERR_INDEX,
                 "index -1 at position 1");
    assert_error(kiln_moe_sort(from_i64(bad[1], 2, (int64_t[]){2, 2}), 0, &order, &offsets), KILN_ERR_ARG,
                 "moe_sort: n_experts 0");
    assert_error(kiln_moe_sort(kiln_zeros((int64_t[]){2, 2}, 2, KILN_DTYPE_F32), 4, &order, &offsets), KILN_ERR_DTYPE,
                 "moe_sort");
}

/* ---- grouped_matmul ---- */

/* y (M, N) from x (M, K), w (E, K, N) in double; rows outside the offsets zero. */
static void grouped_oracle(const double *x, const double *w, const int64_t *off, int64_t M, int64_t K, int64_t E,
                           int64_t N, double *y)
{
    memset(y, 0, sizeof *y * (size_t)(M * N));
    for (int64_t e = 0; e < E; e++)
        for (int64_t m = off[e]; m < off[e + 1]; m++)
            for (int64_t n = 0; n < N; n++) {
                double s = 0;
                for (int64_t k = 0; k < K; k++) s += x[m * K + k] * w[(e * K + k) * N + n];
                y[m * N + n] = s;
            }
}

static double *randv(int64_t n)
{
    double *v = malloc(sizeof *v * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) v[i] = urand() * 2 - 1;
    return v;
}

/* grouped_matmul in dt (or f32 inputs under autocast to dt) against the oracle on the
 * inputs as dt holds them. */
static void check_grouped(int64_t M, int64_t K, int64_t E, int64_t N, const int64_t *off, kiln_dtype dt, bool amp)
{
    kiln_scope_begin();
    double *xv = randv(M * K), *wv = randv(E * K * N), *want = malloc(sizeof *want * (size_t)(M * N + 1));
    kiln_dtype in_dt = amp ? KILN_DTYPE_F32 : dt;
    kiln_tensor_t *x = from_f64(xv, 2, (int64_t[]){M, K}, in_dt), *w = from_f64(wv, 3, (int64_t[]){E, K, N}, in_dt);
    /* the oracle reads what the product reads: the inputs rounded to dt */
    double *xr = read_f64(kiln_cast(x, dt)), *wr = read_f64(kiln_cast(w, dt));
    grouped_oracle(xr, wr, off, M, K, E, N, want);
    if (amp) assert_int_equal(kiln_autocast_begin(dt), KILN_OK);
    kiln_tensor_t *y = kiln_grouped_matmul(x, w, from_i64(off, 1, (int64_t[]){E + 1}));
    if (amp) assert_int_equal(kiln_autocast_end(), KILN_OK);
    if (!y) fail_msg("grouped_matmul: %s", kiln_last_error());
    assert_int_equal(kiln_tensor_dtype(y), dt);
    assert_int_equal(kiln_tensor_shape(y)[0], M);
    assert_int_equal(kiln_tensor_shape(y)[1], N);
    double *got = read_f64(y), tol = dt == KILN_DTYPE_F64 ? 1e-12 : dt == KILN_DTYPE_F32 ? 1e-5 : 2e-2;
    for (int64_t i = 0; i < M * N; i++)
        if (!(fabs(got[i] - want[i]) <= tol * (1 + fabs(want[i]))))
            fail_msg("grouped_matmul (%s%s, M %lld K %lld E %lld N %lld): element %lld is %.9g, want %.9g",
                     kiln_dtype_name(dt), amp ? " by autocast" : "", (long long)M, (long long)K, (long long)E,
                     (long long)N, (long long)i, got[i], want[i]);
    free(xv);
    free(wv);
    free(xr);
    free(wr);
    free(want);
    free(got);
    kiln_scope_end();
}

/* Offsets for M rows over E experts: random cut points, so experts with zero rows turn
 * up; with `unrouted`, some rows before the first and after the last expert. */
static void random_offsets(int64_t M, int64_t E, bool unrouted, int64_t *off)
{
    int64_t lo = unrouted && M > 2 ? 1 : 0, hi = unrouted && M > 2 ? M - 1 : M;
    for (int64_t e = 0; e <= E; e++) off[e] = lo + (int64_t)(urand() * (double)(hi - lo + 1));
    for (int64_t i = 1; i <= E; i++) /* sorted */
        for (int64_t j = i; j > 0 && off[j] < off[j - 1]; j--) {
            int64_t t = off[j];
            off[j] = off[j - 1];
            off[j - 1] = t;
        }
    off[0] = lo;
    off[E] = hi;
}

static void grouped_matmul_matches_the_oracle(void **state)
{
    const int64_t Ms[] = {1, 7, 65}, E = 4;
    const struct {
        int64_t K, N;
    } kn[] = {{5, 3}, {33, 17}, {64, 128}};
    for (int m = 0; m < 3; m++)
        for (int s = 0; s < 3; s++)
            for (int u = 0; u < 2; u++) {
                int64_t off[5];
                random_offsets(Ms[m], E, u, off);
                check_grouped(Ms[m], kn[s].K, E, kn[s].N, off, KILN_DTYPE_F32, false);
                check_grouped(Ms[m], kn[s].K, E, kn[s].N, off, KILN_DTYPE_F64, false);
            }
    /* every row to one expert, the others empty; every expert empty (all rows zero) */
    check_grouped(65, 33, E, 17, (const int64_t[]){0, 0, 0, 65, 65}, KILN_DTYPE_F32, false);
    check_grouped(7, 5, E, 3, (const int64_t[]){3, 3, 3, 3, 3}, KILN_DTYPE_F32, false);
    check_grouped(7, 5, 1, 3, (const int64_t[]){0, 7}, KILN_DTYPE_F64, false);
}

/* bf16 and f16 operands, given or made by autocast (the op's policy is matmul's). */
static void grouped_matmul_runs_in_bf16_and_f16(void **state)
{
    const int64_t off[5] = {0, 20, 20, 50, 65};
    const kiln_dtype dts[2] = {KILN_DTYPE_BF16, KILN_DTYPE_F16};
    for (int d = 0; d < 2; d++) {
        check_grouped(65, 33, 4, 17, off, dts[d], false);
        check_grouped(65, 33, 4, 17, off, dts[d], true);
    }
}

static void grouped_matmul_bad_offsets_and_shapes_are_errors(void **state)
{
    kiln_tensor_t *x = kiln_zeros((int64_t[]){6, 3}, 2, KILN_DTYPE_F32), *w = kiln_zeros((int64_t[]){2, 3, 4}, 3, KILN_DTYPE_F32);
    const int64_t falling[3] = {0, 4, 2}, beyond[3] = {0, 3, 7}, negative[3] = {-1, 2, 6};
    assert_null(kiln_grouped_matmul(x, w, from_i64(falling, 1, (int64_t[]){3})));
    assert_error(kiln_last_status(), KILN_ERR_INDEX, "grouped_matmul: offsets[2] = 2 is below offsets[1] = 4");
    assert_null(kiln_grouped_matmul(x, w, from_i64(beyond, 1, (int64_t[]){3})));
    assert_error(kiln_last_status(), KILN_ERR_INDEX, "offsets[2] = 7 is beyond M = 6");
    assert_null(kiln_grouped_matmul(x, w, from_i64(negative, 1, (int64_t[]){3})));
    assert_error(kiln_last_status(), KILN_ERR_INDEX, "offsets[0] = -1 is negative");
    assert_null(kiln_grouped_matmul(x, w, from_i64(falling, 1, (int64_t[]){2})));
    assert_error(kiln_last_status(), KILN_ERR_SHAPE, "grouped_matmul: x f32[6,3], w f32[2,3,4], offsets i64[2]");
    assert_null(kiln_grouped_matmul(x, kiln_zeros((int64_t[]){2, 4, 4}, 3, KILN_DTYPE_F32),
                                    from_i64(beyond, 1, (int64_t[]){3})));
    assert_error(kiln_last_status(), KILN_ERR_SHAPE, "grouped_matmul");
    assert_null(kiln_grouped_matmul(x, kiln_zeros((int64_t[]){2, 3, 4}, 3, KILN_DTYPE_F64),
                                    from_i64(beyond, 1, (int64_t[]){3})));
    assert_error(kiln_last_status(), KILN_ERR_DTYPE, "grouped_matmul");
    assert_null(kiln_grouped_matmul(x, w, kiln_zeros((int64_t[]){3}, 1, KILN_DTYPE_F32)));
    assert_error(kiln_last_status(), KILN_ERR_DTYPE, "grouped_matmul");
    assert_null(kiln_grouped_matmul(x, NULL, NULL));
    assert_error(kiln_last_status(), KILN_OK, "grouped_matmul");
}

/* ---- gradients against finite differences (f64) ---- */

typedef kiln_tensor_t *(*fwd_fn)(kiln_tensor_t *const *x, const void *ctx);

static double loss(fwd_fn f, const void *ctx, kiln_tensor_t *const *x, const double *R)
{
    bool prev = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    kiln_tensor_t *y = f(x, ctx);
    assert_non_null(y);
    kiln_tensor_t *r = from_f64(R, kiln_tensor_ndim(y), kiln_tensor_shape(y), KILN_DTYPE_F64);
    double v;
    assert_int_equal(kiln_tensor_item(kiln_sum(kiln_mul(y, r), NULL, 0, false), &v), KILN_OK);
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    return v;
}

/* The gradient of every input of x[0..n) that requires one against central
 * differences. */
static void gradcheck(const char *what, fwd_fn f, const void *ctx, int n, kiln_tensor_t *const *x)
{
    const double eps = 1e-6, tol = 1e-6;
    kiln_scope_begin();
    kiln_tensor_t *y = f(x, ctx);
    if (!y) fail_msg("%s: %s", what, kiln_last_error());
    int64_t ny = kiln_tensor_numel(y);
    double *R = randv(ny);
    kiln_tensor_t *r = from_f64(R, kiln_tensor_ndim(y), kiln_tensor_shape(y), KILN_DTYPE_F64);
    if (kiln_backward(kiln_sum(kiln_mul(y, r), NULL, 0, false)) != KILN_OK)
        fail_msg("%s: backward: %s", what, kiln_last_error());
    for (int i = 0; i < n; i++) {
        if (!kiln_tensor_requires_grad(x[i])) continue;
        kiln_tensor_t *g = kiln_tensor_grad(x[i]);
        if (!g) fail_msg("%s: input %d got no gradient", what, i);
        int64_t m = kiln_tensor_numel(x[i]);
        double *h = read_f64(x[i]), *ga = read_f64(g);
        for (int64_t j = 0; j < m; j++) {
            double keep = h[j], l[2];
            for (int side = 0; side < 2; side++) {
                h[j] = keep + (side ? -eps : eps);
                set_values(x[i], h);
                l[side] = loss(f, ctx, x, R);
            }
            h[j] = keep;
            double fd = (l[0] - l[1]) / (2 * eps);
            if (!(fabs(ga[j] - fd) <= tol + tol * fabs(fd)))
                fail_msg("%s: d/d input %d [%lld]: backward %.12g, finite difference %.12g", what, i, (long long)j,
                         ga[j], fd);
        }
        set_values(x[i], h);
        free(h);
        free(ga);
    }
    free(R);
    kiln_scope_end();
}

static kiln_tensor_t *leaf(int nd, const int64_t *sh)
{
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= sh[d];
    double *v = randv(n);
    kiln_tensor_t *t = from_f64(v, nd, sh, KILN_DTYPE_F64);
    free(v);
    kiln_tensor_set_requires_grad(t, true);
    return t;
}

static kiln_tensor_t *f_topk(kiln_tensor_t *const *x, const void *ctx)
{
    kiln_tensor_t *val, *idx;
    return kiln_topk(x[0], *(const int64_t *)ctx, &val, &idx) == KILN_OK ? val : NULL;
}

static kiln_tensor_t *f_grouped(kiln_tensor_t *const *x, const void *ctx)
{
    return kiln_grouped_matmul(x[0], x[1], (kiln_tensor_t *)ctx);
}

static void topk_and_grouped_matmul_gradients_match_finite_differences(void **state)
{
    const int64_t ks[3] = {1, 3, 8};
    for (int i = 0; i < 3; i++) {
        char what[64];
        snprintf(what, sizeof what, "topk (7, 8) k %lld", (long long)ks[i]);
        gradcheck(what, f_topk, &ks[i], 1, (kiln_tensor_t *[]){leaf(2, (int64_t[]){7, 8})});
    }
    const int64_t Ms[3] = {1, 7, 65}, E = 4;
    for (int m = 0; m < 3; m++)
        for (int u = 0; u < 2; u++) {
            int64_t off[5], M = Ms[m];
            random_offsets(M, E, u, off);
            char what[96];
            snprintf(what, sizeof what, "grouped_matmul M %lld offsets %lld %lld %lld %lld %lld", (long long)M,
                     (long long)off[0], (long long)off[1], (long long)off[2], (long long)off[3], (long long)off[4]);
            kiln_tensor_t *offsets = from_i64(off, 1, (int64_t[]){E + 1});
            gradcheck(what, f_grouped, offsets, 2,
                      (kiln_tensor_t *[]){leaf(2, (int64_t[]){M, 3}), leaf(3, (int64_t[]){E, 3, 5})});
        }
}

/* ---- compiled: the counts are data ---- */

#define CE 4
typedef struct {
    kiln_tensor_t *w; /* (CE, 6, 5), captured */
} moe_ctx;

/* in: x (N*k, 6) rows per assignment, indices (N, k): the rows grouped by expert, then
 * each group times its expert's weight; results y, order, offsets. */
static kiln_status routed(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    const moe_ctx *c = ctx;
    kiln_tensor_t *order, *offsets;
    kiln_status s = kiln_moe_sort(in[1], CE, &order, &offsets);
    if (s != KILN_OK) return s;
    kiln_tensor_t *y = kiln_grouped_matmul(kiln_index_select(in[0], 0, order), c->w, offsets);
    if (!y) return kiln_last_status();
    out[0] = y;
    out[1] = order;
    out[2] = offsets;
    *n_out = 3;
    return KILN_OK;
}

static void compiled_sort_and_grouped_matmul_do_not_recompile_when_counts_change(void **state)
{
    double *wv = randv(CE * 6 * 5), *xv = randv(10 * 6);
    moe_ctx c = {from_f64(wv, 3, (int64_t[]){CE, 6, 5}, KILN_DTYPE_F32)};
    kiln_tensor_t *x = from_f64(xv, 2, (int64_t[]){10, 6}, KILN_DTYPE_F32);
    const int64_t calls[3][10] = {{0, 1, 2, 3, 0, 1, 2, 3, 0, 1}, /* counts 3 3 2 2 */
                                  {3, 3, 3, 0, 3, 3, 0, 3, 3, 3}, /* 2 0 0 8 */
                                  {1, 1, 1, 1, 1, 1, 1, 1, 1, 1}};
    kiln_compiled_t *cf;
    assert_int_equal(kiln_compiled_new(routed, &c, "moe_routed", &cf), KILN_OK);
    for (int k = 0; k < 3; k++) {
        kiln_scope_begin();
        kiln_tensor_t *in[2] = {x, from_i64(calls[k], 2, (int64_t[]){5, 2})}, *got[3], *want[3];
        int n_got = 0, n_want = 0;
        if (kiln_compiled_call(cf, in, 2, got, 3, &n_got) != KILN_OK) fail_msg("call %d: %s", k, kiln_last_error());
        assert_int_equal(routed(&c, in, 2, want, &n_want), KILN_OK);
        assert_int_equal(n_got, 3);
        char why[128];
        for (int j = 0; j < 3; j++)
            if (!test_close(got[j], want[j], j ? 0 : 1e-6, why, sizeof why))
                fail_msg("call %d, result %d differs from eager: %s", k, j, why);
        kiln_scope_end();
    }
    uint64_t n_calls, hits, recompiles;
    int graphs;
    kiln_compiled_stats(cf, &n_calls, &hits, &recompiles, &graphs);
    kiln_compiled_free(cf);
    assert_int_equal(n_calls, 3);
    assert_int_equal(graphs, 1);
    assert_int_equal(recompiles, 0);
    assert_int_equal(hits, 2);
    free(wv);
    free(xv);
}

/* ---- on an OpenCL device: the device's own kernels ---- */

static const char *const routing_ops[4] = {"topk", "moe_sort", "grouped_matmul", "grouped_matmul_backward"};

static int op_id(const char *name)
{
    for (int i = 0; i < kiln_op_count(); i++)
        if (!strcmp(kiln_op_name(i), name)) return i;
    fail_msg("no op %s", name);
    return -1;
}

/* The current device when it is an OpenCL one; else the test is skipped. */
#define opencl_or_skip()                                                                                  \
    do {                                                                                                  \
        if (strncmp(kiln_device(), "opencl", 6)) {                                                        \
            print_message("skipped: the device is %s; this checks OpenCL's kernels\n", kiln_device());     \
            skip();                                                                                       \
        }                                                                                                 \
    } while (0)

/* Oracle: dispatch's count of runs on the cpu with copies stays where it was (with
 * KILN_OPT_CL_MOE=0, the switch that sends them there, it grows instead). Every float
 * dtype, both index dtypes, forward and backward, a strided x. */
static void routing_ops_run_on_the_opencl_kernels_not_the_cpu(void **state)
{
    opencl_or_skip();
    kiln__backend *be = kiln__backend_find(kiln_device());
    assert_non_null(be);
    uint64_t before[4];
    for (int i = 0; i < 4; i++) {
        if (!kiln__be_has_kernel(be, op_id(routing_ops[i])))
            fail_msg("%s has no kernel of its own on %s", routing_ops[i], kiln_device());
        before[i] = kiln__cpu_fallbacks(be, op_id(routing_ops[i]));
    }
    const kiln_dtype dts[4] = {KILN_DTYPE_F32, KILN_DTYPE_F64, KILN_DTYPE_BF16, KILN_DTYPE_F16};
    const int64_t ind[8] = {2, 0, 1, 2, 0, 0, 3, 1};
    double *v = randv(6 * 4 * 5);
    for (int d = 0; d < 4; d++) {
        kiln_scope_begin();
        kiln_tensor_t *x = from_f64(v, 2, (int64_t[]){6, 4}, dts[d]), *w = from_f64(v, 3, (int64_t[]){4, 4, 5}, dts[d]);
        kiln_tensor_t *val, *idx, *order, *offsets;
        assert_int_equal(kiln_topk(kiln_transpose(w, 1, 2), 2, &val, &idx), KILN_OK);
        kiln_tensor_t *sel = kiln_cast(from_i64(ind, 2, (int64_t[]){4, 2}), d % 2 ? KILN_DTYPE_I32 : KILN_DTYPE_I64);
        assert_int_equal(kiln_moe_sort(sel, 4, &order, &offsets), KILN_OK);
        kiln_tensor_set_requires_grad(x, true);
        kiln_tensor_set_requires_grad(w, true);
        kiln_tensor_t *y = kiln_grouped_matmul(x, w, kiln_cast(from_i64((const int64_t[]){1, 2, 2, 4, 6}, 1,
                                                                        (int64_t[]){5}), KILN_DTYPE_I32));
        if (!y) fail_msg("grouped_matmul: %s", kiln_last_error());
        assert_int_equal(kiln_backward(kiln_sum(y, NULL, 0, false)), KILN_OK);
        kiln_scope_end();
    }
    free(v);
    bool own = test_opt_on("CL_MOE");
    for (int i = 0; i < 4; i++)
        if ((kiln__cpu_fallbacks(be, op_id(routing_ops[i])) != before[i]) == own)
            fail_msg("%s ran %s on %s", routing_ops[i], own ? "on the cpu with copies" : "on the device with the "
                     "switch off", kiln_device());
}

/* A step of sort and grouped matmul: in: x (8, 6) rows per assignment, indices (4, 2),
 * offsets (CE + 1) given apart (so that bad ones can be); out: order and y. */
static kiln_status sorts_and_groups(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    kiln_tensor_t *order, *offsets;
    kiln_status s = kiln_moe_sort(in[1], CE, &order, &offsets);
    if (s != KILN_OK) return s;
    out[0] = order;
    out[1] = kiln_grouped_matmul(in[0], ctx, in[2]);
    *n_out = 2;
    return out[1] ? KILN_OK : kiln_last_status();
}

/* Recorded as a command buffer (no host between its commands), the kernels check the
 * experts and the offsets into the device's error word: a bad one in a later run is
 * KILN_ERR_INDEX from that run naming the op, never a read outside a buffer; eagerly
 * the host names the value; a good run after it gives eager's results again. */
static void bad_experts_and_offsets_in_a_captured_step_are_errors(void **state)
{
    opencl_or_skip();
    double *wv = randv(CE * 6 * 5), *xv = randv(8 * 6);
    kiln_tensor_t *w = from_f64(wv, 3, (int64_t[]){CE, 6, 5}, KILN_DTYPE_F32);
    const int64_t good_i[8] = {0, 1, 2, 3, 3, 2, 1, 0}, bad_i[8] = {0, 1, 2, 7, 3, 2, 1, 0};
    const int64_t good_o[CE + 1] = {0, 2, 4, 6, 8}, bad_o[CE + 1] = {0, 5, 4, 6, 8};
    kiln_tensor_t *x = from_f64(xv, 2, (int64_t[]){8, 6}, KILN_DTYPE_F32);
    kiln_tensor_t *in[3] = {x, from_i64(good_i, 2, (int64_t[]){4, 2}), from_i64(good_o, 1, (int64_t[]){CE + 1})};
    kiln_tensor_t *out[2], *want[2];
    kiln_replay_t *r = NULL;
    int n;
    if (kiln_replay_record(sorts_and_groups, w, in, 3, &r, out, 2, &n) != KILN_OK)
        fail_msg("record: %s", kiln_last_error());
    char why[256];
    if (!kiln_replay_native(r, why, sizeof why)) fail_msg("not captured: %s", why);
    const struct {
        const int64_t *ind, *off;
        const char *replayed, *eager;
    } cases[2] = {{bad_i, good_o, "moe_sort", "moe_sort: index 7 at position 3 is outside [0, 4)"},
                  {good_i, bad_o, "grouped_matmul", "grouped_matmul: offsets[2] = 4 is below offsets[1] = 5"}};
    for (int c = 0; c < 2; c++) {
        kiln_scope_begin();
        kiln_tensor_t *bad[3] = {x, from_i64(cases[c].ind, 2, (int64_t[]){4, 2}),
                                 from_i64(cases[c].off, 1, (int64_t[]){CE + 1})};
        assert_error(kiln_replay_run(r, bad, 3, out, 2, &n), KILN_ERR_INDEX, "replayed step");
        assert_int_equal(kiln_replay_run(r, bad, 3, out, 2, &n), KILN_ERR_INDEX);
        assert_non_null(strstr(kiln_last_error(), cases[c].replayed));
        kiln_clear_error();
        assert_error(sorts_and_groups(w, bad, 3, want, &n), KILN_ERR_INDEX, cases[c].eager);
        kiln_scope_end();
    }
    /* (the runs above copied the bad values into the recorded inputs: good ones anew) */
    kiln_tensor_t *again[3] = {x, from_i64(good_i, 2, (int64_t[]){4, 2}), from_i64(good_o, 1, (int64_t[]){CE + 1})};
    assert_int_equal(kiln_replay_run(r, again, 3, out, 2, &n), KILN_OK);
    assert_int_equal(sorts_and_groups(w, again, 3, want, &n), KILN_OK);
    char diff[128];
    for (int j = 0; j < 2; j++)
        if (!test_close(out[j], want[j], 0, diff, sizeof diff)) fail_msg("result %d differs from eager: %s", j, diff);
    kiln_replay_free(r);
    free(wv);
    free(xv);
}

#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(topk_matches_the_oracle_with_ties_broken_by_the_lower_index),
        T(topk_orders_all_equal_rows_nan_and_signed_zeros_by_the_rule),
        T(topk_bad_arguments_are_errors),
        T(moe_sort_is_stable_and_counts_every_expert),
        T(moe_sort_bad_indices_are_errors),
        T(grouped_matmul_matches_the_oracle),
        T(grouped_matmul_runs_in_bf16_and_f16),
        T(grouped_matmul_bad_offsets_and_shapes_are_errors),
        T(topk_and_grouped_matmul_gradients_match_finite_differences),
        T(compiled_sort_and_grouped_matmul_do_not_recompile_when_counts_change),
        T(routing_ops_run_on_the_opencl_kernels_not_the_cpu),
        T(bad_experts_and_offsets_in_a_captured_step_are_errors),
    };
    if (getenv("KILN_TEST_FILTER")) cmocka_set_test_filter(getenv("KILN_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
