/* Tensors: creation, host round trips per dtype, views and storage sharing, scopes,
 * the Philox generator, and error reporting. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kiln/ops.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/tensor_impl.h"
#include "backends/cpu/gemm.h"

#include "test_util.h"

static void read_f64(kiln_tensor_t *t, double *out)
{
    assert_non_null(t);
    kiln_tensor_t *c = kiln_cast(t, KILN_DTYPE_F64);
    assert_non_null(c);
    assert_int_equal(kiln_tensor_to_host(c, out, kiln_tensor_nbytes(c)), KILN_OK);
}

static void assert_shape(const kiln_tensor_t *t, int ndim, const int64_t *shape)
{
    assert_non_null(t);
    assert_int_equal(kiln_tensor_ndim(t), ndim);
    for (int i = 0; i < ndim; i++) assert_int_equal(kiln_tensor_shape(t)[i], shape[i]);
}

/* ---- creation ---- */

/* kiln_tensor_wrap: the caller's memory, read and written in place; release runs once,
 * when the last reference goes (a view outlives the tensor), and never on an error (a
 * misaligned pointer, a bad shape), where the memory stays the caller's. */
static int wrap_released;
static void wrap_release(void *ctx) { wrap_released += *(int *)ctx; }

static void test_wrap_uses_the_callers_memory_and_releases_it_once(void **state)
{
    float mem[7] = {0, 1, 2, 3, 4, 5, 6};
    int one = 1;
    wrap_released = 0;
    int64_t sh[2] = {2, 3};
    kiln_tensor_t *t = kiln_keep(kiln_tensor_wrap(mem + 1, sh, 2, KILN_DTYPE_F32, wrap_release, &one));
    assert_non_null(t);
    kiln_tensor_t *row = kiln_keep(kiln_narrow(t, 0, 1, 1));
    double v[3];
    read_f64(row, v);
    assert_true(v[0] == 4 && v[1] == 5 && v[2] == 6);
    assert_int_equal(kiln_fill_(t, 9.0), KILN_OK);
    assert_true(mem[0] == 0 && mem[1] == 9 && mem[6] == 9);
    kiln_tensor_free(t);
    assert_int_equal(wrap_released, 0);
    kiln_tensor_free(row);
    assert_int_equal(wrap_released, 1);
    assert_null(kiln_tensor_wrap((char *)mem + 2, sh, 2, KILN_DTYPE_F32, wrap_release, &one));
    assert_non_null(strstr(kiln_last_error(), "aligned"));
    int64_t bad[1] = {-1};
    assert_null(kiln_tensor_wrap(mem, bad, 1, KILN_DTYPE_F32, wrap_release, &one));
    assert_int_equal(wrap_released, 1);
    kiln_clear_error();
}

static void test_zeros_ones_full_fill_every_element(void **state)
{
    int64_t shape[3] = {2, 3, 4};
    double v[24];
    kiln_tensor_t *z = kiln_zeros(shape, 3, KILN_DTYPE_F32);
    assert_shape(z, 3, shape);
    read_f64(z, v);
    for (int i = 0; i < 24; i++) assert_true(v[i] == 0.0);
    read_f64(kiln_ones(shape, 3, KILN_DTYPE_I32), v);
    for (int i = 0; i < 24; i++) assert_true(v[i] == 1.0);
    kiln_tensor_t *f = kiln_full(shape, 3, -2.5, KILN_DTYPE_F64);
    assert_int_equal(kiln_tensor_dtype(f), KILN_DTYPE_F64);
    read_f64(f, v);
    for (int i = 0; i < 24; i++) assert_true(v[i] == -2.5);
}

static void test_scalar_is_zero_dim_with_one_element(void **state)
{
    kiln_tensor_t *s = kiln_scalar(3.25, KILN_DTYPE_F32);
    assert_non_null(s);
    assert_int_equal(kiln_tensor_ndim(s), 0);
    assert_int_equal(kiln_tensor_numel(s), 1);
    double v;
    assert_int_equal(kiln_tensor_item(s, &v), KILN_OK);
    assert_true(v == 3.25);
}

static void test_arange_counts_like_numpy(void **state)
{
    double v[8];
    kiln_tensor_t *a = kiln_arange(0, 5, 1, KILN_DTYPE_I64);
    assert_int_equal(kiln_tensor_numel(a), 5);
    read_f64(a, v);
    for (int i = 0; i < 5; i++) assert_true(v[i] == i);
    /* 0, 0.3, 0.6, 0.9: the end is exclusive and a partial step still counts. */
    kiln_tensor_t *b = kiln_arange(0, 1, 0.3, KILN_DTYPE_F64);
    assert_int_equal(kiln_tensor_numel(b), 4);
    read_f64(b, v);
    for (int i = 0; i < 4; i++) assert_true(fabs(v[i] - 0.3 * i) < 1e-12);
    kiln_tensor_t *c = kiln_arange(3, -1, -2, KILN_DTYPE_F32);
    assert_int_equal(kiln_tensor_numel(c), 2);
    read_f64(c, v);
    assert_true(v[0] == 3 && v[1] == 1);
}

static void test_arange_refuses_a_step_pointing_away(void **state)
{
    assert_null(kiln_arange(0, 5, -1, KILN_DTYPE_F32));
    assert_int_equal(kiln_last_status(), KILN_ERR_ARG);
    kiln_clear_error();
    assert_null(kiln_arange(0, 5, 0, KILN_DTYPE_F32));
    assert_int_equal(kiln_last_status(), KILN_ERR_ARG);
}

/* Uniform in [0, 1) in every float dtype, including the narrow ones where rounding of
 * a value just below 1 could reach 1. Mean of 100k U(0,1) has sd 0.29/316 ~ 1e-3;
 * tolerance 5e-3 (5 sd). */
static void test_rand_is_in_unit_interval_for_each_float_dtype(void **state)
{
    const kiln_dtype dts[4] = {KILN_DTYPE_F32, KILN_DTYPE_F64, KILN_DTYPE_F16, KILN_DTYPE_BF16};
    int64_t n = 100000;
    double *v = malloc(sizeof(double) * (size_t)n);
    assert_non_null(v);
    for (int k = 0; k < 4; k++) {
        kiln_manual_seed(7 + (uint64_t)k);
        kiln_tensor_t *r = kiln_rand(&n, 1, dts[k]);
        assert_int_equal(kiln_tensor_dtype(r), dts[k]);
        read_f64(r, v);
        double mean = 0;
        for (int64_t i = 0; i < n; i++) {
            if (!(v[i] >= 0.0 && v[i] < 1.0)) fail_msg("rand %s: element %lld = %.9g is outside [0, 1)",
                                                      kiln_dtype_name(dts[k]), (long long)i, v[i]);
            mean += v[i];
        }
        mean /= (double)n;
        assert_true(fabs(mean - 0.5) < 5e-3);
    }
    free(v);
}

/* randn over 100k samples: the sample mean has sd 1/316 ~ 3.2e-3 and the sample
 * variance sd sqrt(2/n) ~ 4.5e-3; tolerances 0.02 for both (over 4 sd). */
static void test_randn_has_mean_zero_and_unit_variance(void **state)
{
    int64_t shape[2] = {400, 250};
    kiln_manual_seed(1234);
    kiln_tensor_t *r = kiln_randn(shape, 2, KILN_DTYPE_F32);
    assert_shape(r, 2, shape);
    double *v = malloc(sizeof(double) * 100000);
    assert_non_null(v);
    read_f64(r, v);
    double mean = 0, var = 0;
    for (int i = 0; i < 100000; i++) mean += v[i];
    mean /= 100000;
    for (int i = 0; i < 100000; i++) var += (v[i] - mean) * (v[i] - mean);
    var /= 99999;
    free(v);
    assert_true(fabs(mean) < 0.02);
    assert_true(fabs(var - 1.0) < 0.02);
}

static void test_rand_refuses_integer_dtypes(void **state)
{
    int64_t n = 4;
    assert_null(kiln_randn(&n, 1, KILN_DTYPE_I32));
    assert_int_equal(kiln_last_status(), KILN_ERR_DTYPE);
    assert_non_null(strstr(kiln_last_error(), "randn"));
}

/* ---- host round trips ---- */

static void test_from_data_to_host_round_trips_every_dtype_bitwise(void **state)
{
    unsigned char src[64], dst[64];
    for (int i = 0; i < 64; i++) src[i] = (unsigned char)(i * 37 + 11);
    for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++) {
        size_t es = kiln_dtype_size((kiln_dtype)dt);
        int64_t shape[2] = {2, (int64_t)(32 / es)};
        const unsigned char *data = src;
        unsigned char boolsrc[64];
        if (dt == KILN_DTYPE_BOOL) { /* bools are 0 or 1 bytes */
            for (int i = 0; i < 64; i++) boolsrc[i] = src[i] & 1;
            data = boolsrc;
        }
        kiln_tensor_t *t = kiln_from_data(data, shape, 2, (kiln_dtype)dt);
        assert_non_null(t);
        assert_int_equal(kiln_tensor_nbytes(t), 2 * 32 / es * es);
        memset(dst, 0, sizeof dst);
        assert_int_equal(kiln_tensor_to_host(t, dst, kiln_tensor_nbytes(t)), KILN_OK);
        if (memcmp(data, dst, kiln_tensor_nbytes(t)))
            fail_msg("dtype %s did not round trip", kiln_dtype_name((kiln_dtype)dt));
    }
}

static void test_to_host_refuses_a_wrong_byte_count(void **state)
{
    int64_t n = 4;
    float buf[4];
    kiln_tensor_t *t = kiln_zeros(&n, 1, KILN_DTYPE_F32);
    assert_int_equal(kiln_tensor_to_host(t, buf, 12), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "to_host"));
}

static void test_from_data_with_null_data_fails_without_leaking(void **state)
{
    /* Outside any scope: a leak here would be reported by LeakSanitizer at exit. */
    kiln_scope_end();
    int64_t n = 4;
    size_t before = kiln_memory_allocated();
    assert_null(kiln_from_data(NULL, &n, 1, KILN_DTYPE_F32));
    assert_int_equal(kiln_last_status(), KILN_ERR_ARG);
    assert_int_equal(kiln_memory_allocated(), before);
    kiln_scope_begin();
}

static uint16_t f32_to_half_bits(float x, kiln_dtype dt)
{
    int64_t n = 1;
    uint16_t h;
    kiln_tensor_t *t = kiln_cast(kiln_from_data(&x, &n, 1, KILN_DTYPE_F32), dt);
    assert_non_null(t);
    assert_int_equal(kiln_tensor_to_host(t, &h, 2), KILN_OK);
    return h;
}

static uint16_t f64_to_half_bits(double x, kiln_dtype dt)
{
    int64_t n = 1;
    uint16_t h;
    kiln_tensor_t *t = kiln_cast(kiln_from_data(&x, &n, 1, KILN_DTYPE_F64), dt);
    assert_non_null(t);
    assert_int_equal(kiln_tensor_to_host(t, &h, 2), KILN_OK);
    return h;
}

/* binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. At 1.0 the spacing is
 * 2^-10, so 1 + 2^-11 is exactly halfway between 0x3C00 and 0x3C01 and goes to the
 * even mantissa 0x3C00; 1 + 3*2^-11 goes to 0x3C02. The smallest subnormal is 2^-24
 * (0x0001); 2^-25 is a tie with 0 and goes to 0; 3*2^-25 is a tie between 1 and 2 and
 * goes to 2. 65520 lies halfway between the largest finite 65504 (0x7BFF, odd) and
 * 65536, which overflows: it rounds to infinity. */
static void test_f32_to_f16_rounds_to_nearest_even(void **state)
{
    const kiln_dtype H = KILN_DTYPE_F16;
    assert_int_equal(f32_to_half_bits(1.0f, H), 0x3C00);
    assert_int_equal(f32_to_half_bits(-2.0f, H), 0xC000);
    assert_int_equal(f32_to_half_bits(1.0f + 0x1p-11f, H), 0x3C00);
    assert_int_equal(f32_to_half_bits(1.0f + 3 * 0x1p-11f, H), 0x3C02);
    assert_int_equal(f32_to_half_bits(1.0f + 0x1p-11f + 0x1p-20f, H), 0x3C01);
    assert_int_equal(f32_to_half_bits(65504.0f, H), 0x7BFF);
    assert_int_equal(f32_to_half_bits(65519.0f, H), 0x7BFF);
    assert_int_equal(f32_to_half_bits(65520.0f, H), 0x7C00);
    assert_int_equal(f32_to_half_bits(0x1p-14f, H), 0x0400);
    assert_int_equal(f32_to_half_bits(0x1p-24f, H), 0x0001);
    assert_int_equal(f32_to_half_bits(0x1p-25f, H), 0x0000);
    assert_int_equal(f32_to_half_bits(3 * 0x1p-25f, H), 0x0002);
    assert_int_equal(f32_to_half_bits(0x1p-26f, H), 0x0000);
    assert_int_equal(f32_to_half_bits(-INFINITY, H), 0xFC00);
    uint16_t nan = f32_to_half_bits(NAN, H);
    assert_true((nan & 0x7C00) == 0x7C00 && (nan & 0x03FF) != 0);
}

/* bfloat16 is the top half of binary32: 8 exponent bits, 7 mantissa bits. At 1.0 the
 * spacing is 2^-7; 1 + 2^-8 is a tie and goes to 0x3F80, 1 + 3*2^-8 to 0x3F82. The
 * largest finite f32 (0x7F7FFFFF) lies above the last bf16 midpoint: infinity. */
static void test_f32_to_bf16_rounds_to_nearest_even(void **state)
{
    const kiln_dtype B = KILN_DTYPE_BF16;
    assert_int_equal(f32_to_half_bits(1.0f, B), 0x3F80);
    assert_int_equal(f32_to_half_bits(1.0f + 0x1p-8f, B), 0x3F80);
    assert_int_equal(f32_to_half_bits(1.0f + 3 * 0x1p-8f, B), 0x3F82);
    assert_int_equal(f32_to_half_bits(1.0f + 0x1p-8f + 0x1p-23f, B), 0x3F81);
    assert_int_equal(f32_to_half_bits(-1.5f, B), 0xBFC0);
    uint32_t maxbits = 0x7F7FFFFFu;
    float maxf;
    memcpy(&maxf, &maxbits, 4);
    assert_int_equal(f32_to_half_bits(maxf, B), 0x7F80);
    uint16_t nan = f32_to_half_bits(NAN, B);
    assert_true((nan & 0x7F80) == 0x7F80 && (nan & 0x007F) != 0);
}

/* From f64 the rounding must be done once: 1 + 2^-11 + 2^-40 is above the f16 midpoint
 * 1 + 2^-11, but rounding it to f32 first lands on the midpoint and a second rounding
 * would go to even (0x3C00). The correct result is 0x3C01; likewise for bf16. */
static void test_f64_to_half_rounds_once(void **state)
{
    assert_int_equal(f64_to_half_bits(1.0 + 0x1p-11 + 0x1p-40, KILN_DTYPE_F16), 0x3C01);
    assert_int_equal(f64_to_half_bits(1.0 + 0x1p-8 + 0x1p-40, KILN_DTYPE_BF16), 0x3F81);
    assert_int_equal(f64_to_half_bits(1.0 + 0x1p-11, KILN_DTYPE_F16), 0x3C00);
    assert_int_equal(f64_to_half_bits(-(1.0 + 3 * 0x1p-8), KILN_DTYPE_BF16), 0xBF82);
}

static void test_f16_and_bf16_widen_exactly(void **state)
{
    uint16_t h[5] = {0x0001, 0x03FF, 0x7BFF, 0xFC00, 0x3555};
    uint16_t b[3] = {0x3F81, 0x0001, 0xC2F7};
    int64_t n5 = 5, n3 = 3;
    double v[5];
    read_f64(kiln_from_data(h, &n5, 1, KILN_DTYPE_F16), v);
    assert_true(v[0] == 0x1p-24);
    assert_true(v[1] == 1023 * 0x1p-24);
    assert_true(v[2] == 65504.0);
    assert_true(isinf(v[3]) && v[3] < 0);
    assert_true(v[4] == (1.0 + 0x155 / 1024.0) * 0x1p-2);
    read_f64(kiln_from_data(b, &n3, 1, KILN_DTYPE_BF16), v);
    assert_true(v[0] == 1.0 + 0x1p-7);
    assert_true(v[1] == 0x1p-133);
    assert_true(v[2] == -(1.0 + 0x77 / 128.0) * 0x1p6);
}

/* ---- views ---- */

static kiln_tensor_t *iota(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return kiln_reshape(kiln_arange(0, (double)n, 1, KILN_DTYPE_F32), shape, ndim);
}

/* Writes 100 through a copy_ into the view and reads the base. */
static double poke_and_read(kiln_tensor_t *view, kiln_tensor_t *base, int64_t base_index)
{
    kiln_tensor_t *hundred = kiln_full(kiln_tensor_shape(view), kiln_tensor_ndim(view), 100, KILN_DTYPE_F32);
    assert_int_equal(kiln_tensor_copy_(view, hundred), KILN_OK);
    double *v = malloc(sizeof(double) * (size_t)kiln_tensor_numel(base));
    read_f64(base, v);
    double r = v[base_index];
    free(v);
    return r;
}

static void test_reshape_and_view_share_storage(void **state)
{
    int64_t s23[2] = {2, 3}, s6[1] = {6}, s32[2] = {3, 2};
    kiln_tensor_t *a = iota(2, s23);
    kiln_tensor_t *v = kiln_view(a, s6, 1);
    assert_shape(v, 1, s6);
    kiln_tensor_t *r = kiln_reshape(a, s32, 2);
    assert_shape(r, 2, s32);
    double x[6];
    read_f64(r, x);
    for (int i = 0; i < 6; i++) assert_true(x[i] == i);
    kiln_tensor_t *v4 = kiln_narrow(v, 0, 4, 1);
    assert_true(poke_and_read(v4, a, 4) == 100);
    kiln_tensor_t *r1 = kiln_narrow(r, 0, 0, 1); /* row 0 of (3,2): elements 0, 1 */
    assert_true(poke_and_read(r1, a, 1) == 100);
}

static void test_view_infers_one_dim(void **state)
{
    int64_t s[3] = {2, 3, 4}, want[2] = {6, 4}, ask[2] = {-1, 4};
    kiln_tensor_t *v = kiln_view(iota(3, s), ask, 2);
    assert_shape(v, 2, want);
}

static void test_permute_and_transpose_are_strided_views(void **state)
{
    int64_t s[3] = {2, 3, 4};
    kiln_tensor_t *a = iota(3, s);
    int order[3] = {2, 0, 1};
    kiln_tensor_t *p = kiln_permute(a, order, 3);
    int64_t ps[3] = {4, 2, 3};
    assert_shape(p, 3, ps);
    assert_false(kiln_tensor_is_contiguous(p));
    assert_int_equal(kiln_tensor_strides(p)[0], 1);
    assert_int_equal(kiln_tensor_strides(p)[1], 12);
    assert_int_equal(kiln_tensor_strides(p)[2], 4);
    double v[24];
    read_f64(p, v);
    /* p[k][i][j] = a[i][j][k] = 12i + 4j + k */
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 3; j++) assert_true(v[(k * 2 + i) * 3 + j] == 12 * i + 4 * j + k);
    kiln_tensor_t *t = kiln_transpose(a, -1, 0); /* (4,3,2) */
    kiln_tensor_t *t_elem = kiln_narrow(kiln_narrow(kiln_narrow(t, 0, 3, 1), 1, 2, 1), 2, 1, 1);
    assert_true(poke_and_read(t_elem, a, 12 * 1 + 4 * 2 + 3) == 100);
}

static void test_slice_with_step_views_every_other_element(void **state)
{
    int64_t s[2] = {3, 10};
    kiln_tensor_t *a = iota(2, s);
    kiln_tensor_t *sl = kiln_slice(a, 1, 1, 8, 3); /* columns 1, 4, 7 */
    int64_t want[2] = {3, 3};
    assert_shape(sl, 2, want);
    assert_int_equal(kiln_tensor_strides(sl)[1], 3);
    double v[9];
    read_f64(sl, v);
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) assert_true(v[i * 3 + j] == 10 * i + 1 + 3 * j);
    /* Negative bounds count from the end. */
    kiln_tensor_t *tail = kiln_slice(a, -1, -2, 10, 1);
    assert_int_equal(kiln_tensor_dim(tail, 1), 2);
    kiln_tensor_t *e = kiln_narrow(kiln_narrow(sl, 0, 2, 1), 1, 1, 1);
    assert_true(poke_and_read(e, a, 24) == 100);
}

static void test_narrow_outside_the_dim_is_an_index_error(void **state)
{
    int64_t s[2] = {3, 4};
    assert_null(kiln_narrow(iota(2, s), 1, 2, 3));
    assert_int_equal(kiln_last_status(), KILN_ERR_INDEX);
    assert_non_null(strstr(kiln_last_error(), "narrow"));
    assert_non_null(strstr(kiln_last_error(), "f32[3,4]"));
}

static void test_expand_broadcasts_with_zero_strides(void **state)
{
    int64_t s[2] = {3, 1}, to[3] = {2, 3, 4};
    kiln_tensor_t *a = iota(2, s);
    kiln_tensor_t *e = kiln_expand(a, to, 3);
    assert_shape(e, 3, to);
    assert_int_equal(kiln_tensor_strides(e)[0], 0);
    assert_int_equal(kiln_tensor_strides(e)[2], 0);
    double v[24];
    read_f64(e, v);
    for (int i = 0; i < 24; i++) assert_true(v[i] == (i / 4) % 3);
    /* One element of the expanded view is element 2 of the base. */
    kiln_tensor_t *one = kiln_narrow(kiln_narrow(kiln_narrow(e, 0, 1, 1), 1, 2, 1), 2, 3, 1);
    assert_true(poke_and_read(one, a, 2) == 100);
}

static void test_expand_of_a_non_unit_dim_is_a_shape_error(void **state)
{
    int64_t s[1] = {3}, to[1] = {4};
    assert_null(kiln_expand(iota(1, s), to, 1));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "expand"));
}

static void test_squeeze_and_unsqueeze_share_storage(void **state)
{
    int64_t s[3] = {2, 1, 3}, sq[2] = {2, 3}, un[3] = {2, 3, 1};
    kiln_tensor_t *a = iota(3, s);
    kiln_tensor_t *q = kiln_squeeze(a, 1);
    assert_shape(q, 2, sq);
    kiln_tensor_t *u = kiln_unsqueeze(q, -1);
    assert_shape(u, 3, un);
    kiln_tensor_t *e = kiln_narrow(kiln_narrow(u, 0, 1, 1), 1, 2, 1);
    assert_true(poke_and_read(e, a, 5) == 100);
    assert_null(kiln_squeeze(a, 0));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
}

static void test_unsqueeze_of_a_transpose_stays_a_view(void **state)
{
    int64_t s[2] = {2, 3};
    kiln_tensor_t *a = iota(2, s);
    kiln_tensor_t *u = kiln_unsqueeze(kiln_transpose(a, 0, 1), 0); /* (1,3,2) */
    kiln_tensor_t *e = kiln_narrow(kiln_narrow(u, 1, 2, 1), 2, 1, 1); /* u[0][2][1] = a[1][2] */
    assert_true(poke_and_read(e, a, 5) == 100);
}

static void test_contiguous_copies_a_strided_view_and_clone_always_copies(void **state)
{
    int64_t s[2] = {2, 3};
    kiln_tensor_t *a = iota(2, s);
    kiln_tensor_t *t = kiln_transpose(a, 0, 1);
    kiln_tensor_t *c = kiln_contiguous(t);
    assert_true(kiln_tensor_is_contiguous(c));
    double v[6];
    read_f64(c, v);
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 2; j++) assert_true(v[i * 2 + j] == 3 * j + i);
    /* Writing into the copy leaves the base alone. */
    assert_true(poke_and_read(kiln_narrow(c, 0, 0, 1), a, 0) == 0);
    kiln_tensor_t *k = kiln_clone(a);
    assert_true(poke_and_read(k, a, 3) == 3);
    /* contiguous() of a contiguous tensor is the same storage. */
    kiln_tensor_t *same = kiln_contiguous(a);
    assert_true(poke_and_read(kiln_narrow(same, 1, 2, 1), a, 5) == 100);
}

/* Copies of permuted views, made contiguous or cast, element by element against the
 * index arithmetic on the host data (the oracle), with the scalar conversions of
 * core/dtype.h for the casts (bitwise). The shapes have edges that are not whole
 * 32 x 32 tiles, and the 3-d ones put the source's contiguous dim first, in the middle
 * or last, as the tiled transposing copy meets them. */
static void test_copies_of_permuted_views_match_the_index_arithmetic(void **state)
{
    const struct {
        int ndim;
        int64_t shape[3];
        int order[3];
    } cases[] = {
        {2, {37, 70}, {1, 0}},  {2, {64, 64}, {1, 0}},    {2, {8, 9}, {1, 0}},
        {2, {1, 40}, {1, 0}},   {3, {3, 33, 41}, {0, 2, 1}}, {3, {33, 5, 41}, {2, 1, 0}},
        {3, {9, 40, 17}, {2, 0, 1}},
    };
    const kiln_dtype pairs[][2] = {{KILN_DTYPE_F32, KILN_DTYPE_F32}, {KILN_DTYPE_F32, KILN_DTYPE_BF16},
                                   {KILN_DTYPE_F32, KILN_DTYPE_F16},  {KILN_DTYPE_BF16, KILN_DTYPE_F32},
                                   {KILN_DTYPE_BF16, KILN_DTYPE_BF16}, {KILN_DTYPE_F64, KILN_DTYPE_F32},
                                   {KILN_DTYPE_I64, KILN_DTYPE_I64}};
    enum { MAXN = 33 * 5 * 41 };
    static float vals[MAXN];
    static unsigned char src[MAXN * 8], got[MAXN * 8];
    for (int i = 0; i < MAXN; i++) vals[i] = (float)((i * 7919 % 2003) - 1001) / 37.0f;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
            kiln_dtype st = pairs[p][0], dt = pairs[p][1];
            int nd = cases[c].ndim;
            int64_t n = kiln__numel(nd, cases[c].shape);
            for (int64_t i = 0; i < n; i++) {
                if (st == KILN_DTYPE_F32) ((float *)src)[i] = vals[i];
                else if (st == KILN_DTYPE_BF16) ((uint16_t *)src)[i] = kiln__f32_to_bf16(vals[i]);
                else if (st == KILN_DTYPE_F64) ((double *)src)[i] = vals[i] * (1.0 + 1e-9);
                else ((int64_t *)src)[i] = i * 1000003 - 77;
            }
            kiln_tensor_t *a = kiln_from_data(src, cases[c].shape, nd, st);
            kiln_tensor_t *v = kiln_permute(a, cases[c].order, nd);
            kiln_tensor_t *o = dt == st ? kiln_contiguous(v) : kiln_cast(v, dt);
            assert_non_null(o);
            assert_true(kiln_tensor_is_contiguous(o));
            assert_int_equal(kiln_tensor_to_host(o, got, kiln_tensor_nbytes(o)), KILN_OK);
            int64_t vs[3], ss[3] = {0}; /* the view's shape and its strides into src */
            for (int d = 0; d < nd; d++) {
                vs[d] = cases[c].shape[cases[c].order[d]];
                int64_t st_d = 1;
                for (int e = cases[c].order[d] + 1; e < nd; e++) st_d *= cases[c].shape[e];
                ss[d] = st_d;
            }
            for (int64_t i = 0; i < n; i++) {
                int64_t rem = i, at = 0;
                for (int d = nd - 1; d >= 0; d--) {
                    at += rem % vs[d] * ss[d];
                    rem /= vs[d];
                }
                bool ok;
                if (st == KILN_DTYPE_I64) ok = ((int64_t *)got)[i] == ((int64_t *)src)[at];
                else if (st == KILN_DTYPE_F64) ok = ((float *)got)[i] == (float)((double *)src)[at];
                else {
                    float x = st == KILN_DTYPE_F32 ? ((float *)src)[at] : kiln__bf16_to_f32(((uint16_t *)src)[at]);
                    if (dt == KILN_DTYPE_F32) ok = ((float *)got)[i] == x;
                    else if (dt == KILN_DTYPE_BF16) ok = ((uint16_t *)got)[i] == kiln__f32_to_bf16(x);
                    else ok = ((uint16_t *)got)[i] == kiln__f32_to_f16(x);
                }
                if (!ok)
                    fail_msg("case %zu (%s -> %s): element %lld differs", c, kiln_dtype_name(st), kiln_dtype_name(dt),
                             (long long)i);
            }
        }
}

/* Does any element of a sit where one of b does? By enumerating both (the oracle). */
static bool brute_overlap(const kiln_tensor_t *a, const kiln_tensor_t *b)
{
    int64_t na = kiln__numel(a->ndim, a->shape), nb = kiln__numel(b->ndim, b->shape);
    for (int64_t i = 0; i < na; i++) {
        int64_t oa = a->offset, r = i;
        for (int d = a->ndim - 1; d >= 0; d--) {
            oa += (r % a->shape[d]) * a->stride[d];
            r /= a->shape[d];
        }
        for (int64_t j = 0; j < nb; j++) {
            int64_t ob = b->offset, q = j;
            for (int d = b->ndim - 1; d >= 0; d--) {
                ob += (q % b->shape[d]) * b->stride[d];
                q /= b->shape[d];
            }
            if (oa == ob) return true;
        }
    }
    return false;
}

/* Two views of one tensor overlap when they share an element, not when their byte
 * ranges interleave: slices of one dim of a row-major tensor share none (the fused
 * q|k|v gradient written by one kernel). Random windows of a (6, 10) and a (4, 5, 6)
 * tensor, oracle: enumerating the elements; views of one shape and strides must match
 * it exactly, any others may only err towards overlapping. */
static void test_views_overlap_by_their_elements(void **state)
{
    (void)state;
    int64_t s2[2] = {6, 10}, s3[3] = {4, 5, 6};
    kiln_tensor_t *bases[2] = {kiln_zeros(s2, 2, KILN_DTYPE_F32), kiln_zeros(s3, 3, KILN_DTYPE_F32)};
    uint32_t seed = 12345;
    int exact = 0, apart = 0;
    for (int it = 0; it < 2000; it++) {
        kiln_tensor_t *base = bases[it % 2], *v[2];
        int dim = (int)((seed = seed * 1103515245u + 12345u) >> 16) % base->ndim;
        int64_t len = 1 + (int64_t)((seed = seed * 1103515245u + 12345u) >> 16) % base->shape[dim];
        for (int w = 0; w < 2; w++) {
            int64_t start = (int64_t)((seed = seed * 1103515245u + 12345u) >> 16) % (base->shape[dim] - len + 1);
            v[w] = kiln_narrow(base, dim, start, len);
            if (it % 3 == 0) v[w] = kiln_transpose(v[w], 0, 1); /* strides out of order */
        }
        bool want = brute_overlap(v[0], v[1]), got = kiln__tensors_overlap(v[0], v[1]);
        if (want) assert_true(got);
        else if (!got) apart++;
        exact += !want;
        if (!want) assert_false(got); /* same shape and strides here: exact */
    }
    assert_true(apart > 100); /* the cases did include disjoint, interleaved windows */
    assert_int_equal(apart, exact);
    /* Offsets reached only with steps of both signs: (3, 4) with strides (10, 1), 7 apart. */
    int64_t sh[2] = {3, 4}, st[2] = {10, 1};
    assert_true(kiln__strided_overlap(2, sh, st, 0, 7));
    assert_false(kiln__strided_overlap(2, sh, st, 0, 4));
    /* Strides that do not nest are taken to overlap. */
    int64_t st2[2] = {2, 1};
    assert_true(kiln__strided_overlap(2, sh, st2, 0, 100)); /* the test's scope frees the tensors */
}

static void test_view_of_a_transpose_fails_and_reshape_copies(void **state)
{
    int64_t s[2] = {2, 3}, flat[1] = {6};
    kiln_tensor_t *a = iota(2, s);
    kiln_tensor_t *t = kiln_transpose(a, 0, 1);
    assert_null(kiln_view(t, flat, 1));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "view"));
    kiln_clear_error();
    kiln_tensor_t *r = kiln_reshape(t, flat, 1);
    assert_non_null(r);
    double v[6];
    read_f64(r, v);
    const double want[6] = {0, 3, 1, 4, 2, 5};
    for (int i = 0; i < 6; i++) assert_true(v[i] == want[i]);
    /* A copy: writing it leaves a alone. */
    assert_true(poke_and_read(kiln_narrow(r, 0, 1, 1), a, 3) == 3);
}

static void test_view_with_the_wrong_element_count_is_a_shape_error(void **state)
{
    int64_t s[2] = {2, 3}, bad[1] = {5};
    assert_null(kiln_view(iota(2, s), bad, 1));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "f32[2,3]"));
}

static void test_from_host_refuses_a_strided_destination(void **state)
{
    int64_t s[2] = {2, 3};
    float buf[6] = {0};
    kiln_tensor_t *t = kiln_transpose(iota(2, s), 0, 1);
    assert_int_equal(kiln_tensor_from_host_(t, buf, sizeof buf), KILN_ERR_ARG);
}

/* ---- scopes ---- */

static void test_scope_end_frees_every_tensor_made_in_it(void **state)
{
    size_t base = kiln_memory_allocated();
    int64_t s[2] = {64, 64};
    kiln_scope_begin();
    kiln_tensor_t *a = kiln_randn(s, 2, KILN_DTYPE_F32);
    kiln_tensor_t *b = kiln_exp(kiln_add(a, a));
    assert_non_null(b);
    assert_true(kiln_memory_allocated() >= base + 3 * 64 * 64 * 4);
    kiln_scope_end();
    assert_int_equal(kiln_memory_allocated(), base);
}

static void test_kept_tensor_outlives_its_scope(void **state)
{
    size_t base = kiln_memory_allocated();
    int64_t n = 1000;
    kiln_scope_begin();
    kiln_tensor_t *k = kiln_keep(kiln_mul_scalar(kiln_ones(&n, 1, KILN_DTYPE_F32), 3));
    kiln_scope_end();
    assert_non_null(k);
    assert_true(kiln_memory_allocated() > base);
    double v[1000];
    kiln_scope_begin(); /* the f64 copy read_f64 makes goes here */
    read_f64(k, v);
    kiln_scope_end();
    assert_true(v[0] == 3 && v[999] == 3);
    kiln_tensor_free(k);
    assert_int_equal(kiln_memory_allocated(), base);
}

static void test_views_keep_their_storage_alive(void **state)
{
    size_t base = kiln_memory_allocated();
    int64_t n = 1000;
    kiln_scope_begin();
    kiln_tensor_t *big = kiln_arange(0, (double)n, 1, KILN_DTYPE_F32);
    kiln_tensor_t *v = kiln_keep(kiln_narrow(big, 0, 998, 2));
    kiln_scope_end();
    double x[2];
    kiln_scope_begin();
    read_f64(v, x);
    kiln_scope_end();
    assert_true(x[0] == 998 && x[1] == 999);
    kiln_tensor_free(v);
    assert_int_equal(kiln_memory_allocated(), base);
}

static void test_nested_scopes_release_inner_first(void **state)
{
    size_t base = kiln_memory_allocated();
    int64_t n = 256;
    kiln_scope_begin();
    kiln_tensor_t *outer = kiln_ones(&n, 1, KILN_DTYPE_F32);
    size_t with_outer = kiln_memory_allocated();
    kiln_scope_begin();
    assert_non_null(kiln_add(outer, outer));
    kiln_scope_end();
    assert_int_equal(kiln_memory_allocated(), with_outer);
    kiln_scope_end();
    assert_int_equal(kiln_memory_allocated(), base);
}

/* ---- random generator ---- */

/* Random123's published known-answer vector for Philox4x32-10: counter 0, key 0. */
static void test_philox_matches_the_random123_known_answer(void **state)
{
    uint32_t w[4];
    kiln__philox(0, 0, w);
    assert_int_equal(w[0], 0x6627e8d5u);
    assert_int_equal(w[1], 0xe169c58du);
    assert_int_equal(w[2], 0xbc57ac4cu);
    assert_int_equal(w[3], 0x9b00dbd8u);
}

static void test_same_seed_gives_the_same_numbers(void **state)
{
    int64_t n = 5000;
    float a[5000], b[5000];
    kiln_manual_seed(42);
    kiln_tensor_t *x = kiln_randn(&n, 1, KILN_DTYPE_F32);
    kiln_tensor_t *y = kiln_rand(&n, 1, KILN_DTYPE_F32);
    assert_int_equal(kiln_tensor_to_host(x, a, sizeof a), KILN_OK);
    kiln_manual_seed(42);
    assert_int_equal(kiln_tensor_to_host(kiln_randn(&n, 1, KILN_DTYPE_F32), b, sizeof b), KILN_OK);
    assert_memory_equal(a, b, sizeof a);
    assert_int_equal(kiln_tensor_to_host(y, a, sizeof a), KILN_OK);
    assert_int_equal(kiln_tensor_to_host(kiln_rand(&n, 1, KILN_DTYPE_F32), b, sizeof b), KILN_OK);
    assert_memory_equal(a, b, sizeof a);
    /* A different seed gives different numbers. */
    kiln_manual_seed(43);
    assert_int_equal(kiln_tensor_to_host(kiln_randn(&n, 1, KILN_DTYPE_F32), b, sizeof b), KILN_OK);
    assert_memory_not_equal(a, b, sizeof a);
}

static void test_successive_draws_differ_and_state_restores_them(void **state)
{
    int64_t n = 100;
    float a[100], b[100], c[100];
    kiln_manual_seed(5);
    kiln_rng_state st = kiln_rng_get_state();
    assert_int_equal(kiln_tensor_to_host(kiln_randn(&n, 1, KILN_DTYPE_F32), a, sizeof a), KILN_OK);
    assert_int_equal(kiln_tensor_to_host(kiln_randn(&n, 1, KILN_DTYPE_F32), b, sizeof b), KILN_OK);
    assert_memory_not_equal(a, b, sizeof a);
    kiln_rng_set_state(st);
    assert_int_equal(kiln_tensor_to_host(kiln_randn(&n, 1, KILN_DTYPE_F32), c, sizeof c), KILN_OK);
    assert_memory_equal(a, c, sizeof a);
}

/* The child side: draw, hash the bytes, print the hash and the thread count. */
static int rng_child(void)
{
    kiln_scope_begin();
    kiln_manual_seed(2024);
    int64_t shape[2] = {1000, 1000};
    kiln_tensor_t *ts[3];
    ts[0] = kiln_randn(shape, 2, KILN_DTYPE_F32);
    ts[1] = kiln_rand(shape, 2, KILN_DTYPE_F64);
    ts[2] = kiln_dropout(kiln_ones(shape, 2, KILN_DTYPE_F32), 0.3, true);
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (int k = 0; k < 3; k++) {
        size_t nb = kiln_tensor_nbytes(ts[k]);
        unsigned char *buf = malloc(nb);
        if (!buf || kiln_tensor_to_host(ts[k], buf, nb) != KILN_OK) return 1;
        for (size_t i = 0; i < nb; i++) h = (h ^ buf[i]) * 1099511628211ULL;
        free(buf);
    }
    printf("%d %016llx\n", kiln_num_threads(), (unsigned long long)h);
    kiln_scope_end();
    return 0;
}

/* The child side for GEMMs and sums: the matmul shapes of a GPT step (rows x C by C x
 * 3C, the weight gradient's C x rows by rows x 4C, a transposed operand, a small M, a
 * batch, a skinny one whose blocks would reach the BLAS's small-matrix kernels), and a
 * whole-tensor sum of each product (chunked over the pool), hashed. */
static int matmul_child(void)
{
    kiln_scope_begin();
    kiln_manual_seed(77);
    struct {
        int64_t a[3], b[3];
        int nd;
        bool tb;
    } cases[] = {{{2048, 256}, {256, 768}, 2, false}, {{1024, 2048}, {2048, 256}, 2, false},
                 {{1000, 200}, {300, 200}, 2, true},  {{130, 640}, {640, 1500}, 2, false},
                 {{3, 384, 64}, {3, 64, 384}, 3, false}, {{1024, 512}, {512, 4}, 2, false}};
    uint64_t h = 1469598103934665603ULL;
    for (int c = 0; c < 6; c++) {
        kiln_tensor_t *a = kiln_randn(cases[c].a, cases[c].nd, KILN_DTYPE_F32);
        kiln_tensor_t *b = kiln_randn(cases[c].b, cases[c].nd, KILN_DTYPE_F32);
        kiln_tensor_t *y = kiln_matmul(a, cases[c].tb ? kiln_transpose(b, 0, 1) : b);
        size_t nb = y ? kiln_tensor_nbytes(y) : 0;
        unsigned char *buf = nb ? malloc(nb) : NULL;
        float total;
        int d0 = 0;
        kiln_tensor_t *cols = y ? kiln_sum(y, &d0, 1, false) : NULL; /* column sums: the bias gradient's sum */
        size_t nc = cols ? kiln_tensor_nbytes(cols) : 0;
        unsigned char *cbuf = nc ? malloc(nc) : NULL;
        if (!buf || !cbuf || kiln_tensor_to_host(y, buf, nb) != KILN_OK || kiln_tensor_to_host(cols, cbuf, nc) != KILN_OK ||
            kiln_tensor_to_host(kiln_sum(y, NULL, 0, false), &total, sizeof total) != KILN_OK) {
            free(buf);
            free(cbuf);
            return 1;
        }
        for (size_t i = 0; i < nb; i++) h = (h ^ buf[i]) * 1099511628211ULL;
        for (size_t i = 0; i < nc; i++) h = (h ^ cbuf[i]) * 1099511628211ULL;
        free(cbuf);
        for (size_t i = 0; i < sizeof total; i++) h = (h ^ ((unsigned char *)&total)[i]) * 1099511628211ULL;
        free(buf);
    }
    printf("%d %016llx\n", kiln_num_threads(), (unsigned long long)h);
    kiln_scope_end();
    return 0;
}

/* Runs this binary as a child with KILN_NUM_THREADS=threads and the given mode; reads
 * its line. */
static void run_child_as(const char *mode, int threads, int *got_threads, unsigned long long *hash);
static void run_child(int threads, int *got_threads, unsigned long long *hash)
{
    run_child_as("--rng-child", threads, got_threads, hash);
}

static void run_child_as(const char *mode, int threads, int *got_threads, unsigned long long *hash)
{
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char env[32];
        snprintf(env, sizeof env, "%d", threads);
        test_setenv("KILN_NUM_THREADS", env, 1);
        dup2(fd[1], 1);
        close(fd[0]);
        close(fd[1]);
        execl("/proc/self/exe", "test_tensor", mode, (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    char line[128] = {0};
    size_t got = 0;
    ssize_t r;
    while (got < sizeof line - 1 && (r = read(fd[0], line + got, sizeof line - 1 - got)) > 0) got += (size_t)r;
    close(fd[0]);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    assert_int_equal(sscanf(line, "%d %llx", got_threads, hash), 2);
}

/* GEMMs split over the pool in one block per thread, whole-tensor sums in fixed chunks
 * and column sums in fixed row chunks: 1, 2, 3 and 4 threads give bitwise the same
 * products and sums (oracle: the
 * 1-thread run, one BLAS call per product). */
static void test_matmuls_do_not_depend_on_the_thread_count(void **state)
{
    int t[4];
    unsigned long long h[4];
    for (int i = 0; i < 4; i++) {
        run_child_as("--matmul-child", i + 1, &t[i], &h[i]);
        assert_int_equal(t[i], i + 1);
        if (h[i] != h[0]) fail_msg("matmuls on %d threads differ from 1 thread's", i + 1);
    }
}

static void test_random_streams_do_not_depend_on_the_thread_count(void **state)
{
    int t1, t4;
    unsigned long long h1, h4;
    run_child(1, &t1, &h1);
    run_child(4, &t4, &h4);
    assert_int_equal(t1, 1);
    assert_int_equal(t4, 4);
    assert_true(h1 == h4);
}

/* ---- errors ---- */

static void test_broadcast_mismatch_names_the_op_and_shapes(void **state)
{
    int64_t s1[2] = {2, 3}, s2[1] = {4};
    kiln_tensor_t *r = kiln_add(kiln_zeros(s1, 2, KILN_DTYPE_F32), kiln_zeros(s2, 1, KILN_DTYPE_F32));
    assert_null(r);
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    const char *m = kiln_last_error();
    assert_non_null(strstr(m, "add"));
    assert_non_null(strstr(m, "f32[2,3]"));
    assert_non_null(strstr(m, "f32[4]"));
}

static void test_matmul_inner_mismatch_names_both_shapes(void **state)
{
    int64_t s1[2] = {2, 3}, s2[2] = {4, 5};
    assert_null(kiln_matmul(kiln_zeros(s1, 2, KILN_DTYPE_F32), kiln_zeros(s2, 2, KILN_DTYPE_F32)));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "matmul"));
    assert_non_null(strstr(kiln_last_error(), "f32[2,3]"));
    assert_non_null(strstr(kiln_last_error(), "f32[4,5]"));
}

static void test_float_op_on_integers_is_a_dtype_error(void **state)
{
    int64_t n = 3;
    assert_null(kiln_exp(kiln_zeros(&n, 1, KILN_DTYPE_I32)));
    assert_int_equal(kiln_last_status(), KILN_ERR_DTYPE);
    assert_non_null(strstr(kiln_last_error(), "exp"));
    assert_non_null(strstr(kiln_last_error(), "i32[3]"));
}

static void test_out_of_range_index_is_an_index_error(void **state)
{
    int64_t ws[2] = {5, 2}, n = 3;
    int64_t idx[3] = {0, 5, 1};
    kiln_tensor_t *w = kiln_zeros(ws, 2, KILN_DTYPE_F32);
    assert_null(kiln_embedding(w, kiln_from_data(idx, &n, 1, KILN_DTYPE_I64)));
    assert_int_equal(kiln_last_status(), KILN_ERR_INDEX);
    assert_non_null(strstr(kiln_last_error(), "embedding"));
    assert_non_null(strstr(kiln_last_error(), "5"));
}

static void test_out_of_range_dim_is_an_index_error(void **state)
{
    int64_t s[2] = {2, 3};
    int dim = 2;
    assert_null(kiln_sum(kiln_zeros(s, 2, KILN_DTYPE_F32), &dim, 1, false));
    assert_int_equal(kiln_last_status(), KILN_ERR_INDEX);
    assert_non_null(strstr(kiln_last_error(), "sum"));
    assert_non_null(strstr(kiln_last_error(), "f32[2,3]"));
}

static void test_item_of_many_elements_is_a_shape_error(void **state)
{
    int64_t n = 2;
    double v;
    assert_int_equal(kiln_tensor_item(kiln_zeros(&n, 1, KILN_DTYPE_F32), &v), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "item"));
}

static void test_null_input_keeps_the_first_error(void **state)
{
    int64_t s1[1] = {2}, s2[1] = {3};
    kiln_tensor_t *bad = kiln_mul(kiln_zeros(s1, 1, KILN_DTYPE_F32), kiln_zeros(s2, 1, KILN_DTYPE_F32));
    kiln_tensor_t *r = kiln_sum(kiln_exp(kiln_neg(bad)), NULL, 0, false);
    assert_null(r);
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    assert_non_null(strstr(kiln_last_error(), "mul"));
    double v;
    assert_int_equal(kiln_tensor_item(r, &v), KILN_ERR_SHAPE);
}

static void test_negative_size_is_a_shape_error(void **state)
{
    int64_t s[2] = {2, -1};
    assert_null(kiln_zeros(s, 2, KILN_DTYPE_F32));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    kiln_clear_error();
    assert_null(kiln_zeros(s, KILN_MAX_DIMS + 1, KILN_DTYPE_F32));
    assert_int_equal(kiln_last_status(), KILN_ERR_ARG);
}

static void test_clear_error_resets_the_status(void **state)
{
    int64_t n = 1;
    assert_null(kiln_exp(kiln_zeros(&n, 1, KILN_DTYPE_I64)));
    assert_int_not_equal(kiln_last_status(), KILN_OK);
    kiln_clear_error();
    assert_int_equal(kiln_last_status(), KILN_OK);
}

#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

/* The bulk f16 conversions (F16C where the processor has it, backends/cpu/half.c) give
 * the bits of the one-at-a-time functions (core/dtype.h), the oracle: all 65,536 f16
 * values widened; narrowed, every f16 value, the midpoints between neighbours (ties to
 * even), one f32 ulp either side of them, the overflow edge, f32 subnormals, NaNs of
 * both signs, quiet and signalling with payloads, and 2^20 random bit patterns. Odd
 * lengths and starts run the vector tails. */
static void f16_runs(void)
{
    enum { NH = 65536, NF = (1 << 20) + 8 * 65536 };
    uint16_t *h = malloc(sizeof *h * NH), *h2 = malloc(sizeof *h2 * NF);
    float *f = malloc(sizeof *f * NF);
    uint32_t *bits = malloc(sizeof *bits * NF);
    for (int i = 0; i < NH; i++) h[i] = (uint16_t)i;
    kiln__f16_to_f32_n(h, f, NH);
    for (int i = 0; i < NH; i++) {
        float want = kiln__f16_to_f32(h[i]);
        if (memcmp(&f[i], &want, 4)) fail_msg("f16 0x%04x widened to 0x%08x, the scalar rule 0x%08x", i, kiln__f32_bits(f[i]), kiln__f32_bits(want));
    }
    int64_t n = 0;
    for (int i = 0; i < NH; i++) {
        uint32_t b = kiln__f32_bits(kiln__f16_to_f32((uint16_t)i)), nb = kiln__f32_bits(kiln__f16_to_f32((uint16_t)(i + 1)));
        bits[n++] = b;
        if ((i & 0x7c00) == 0x7c00 || (i & 0x7fff) == 0x7bff) continue; /* NaN, inf, the largest: no next */
        uint32_t mid = b + (nb - b) / 2; /* same sign: the f32 between them, halfway in bits = in value */
        bits[n++] = mid;
        bits[n++] = mid + 1;
        bits[n++] = mid - 1;
    }
    const uint32_t edges[] = {0x477fefffu, 0x477ff000u, 0x477ff001u, 0x47800000u, 0xc77ff000u, 0x00000001u,
                              0x807fffffu, 0x7f800001u, 0xff800001u, 0x7fc00000u, 0xffc12345u, 0x7fbfffffu,
                              0x7f802000u, 0x33000000u, 0x33000001u, 0xb3000000u, 0x387fc000u, 0x38800000u};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++) bits[n++] = edges[i];
    uint64_t r = 12345;
    while (n < NF) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        bits[n++] = (uint32_t)(r >> 32);
    }
    memcpy(f, bits, sizeof(float) * (size_t)n);
    for (int64_t start = 0; start < 3; start++) {
        kiln__f32_to_f16_n(f + start, h2 + start, n - 2 * start);
        for (int64_t i = start; i < n - start; i++)
            if (h2[i] != kiln__f32_to_f16(f[i]))
                fail_msg("f32 0x%08x narrowed to 0x%04x, the scalar rule 0x%04x", bits[i], h2[i], kiln__f32_to_f16(f[i]));
    }
    kiln__f16_to_f32_n(h + 5, f, 37); /* a tail */
    for (int i = 0; i < 37; i++) assert_true(kiln__f32_bits(f[i]) == kiln__f32_bits(kiln__f16_to_f32(h[5 + i])));
    free(h);
    free(h2);
    free(f);
    free(bits);
}

static void test_f16_runs_convert_as_the_scalar_functions(void **state)
{
    for (int level = 2; level >= 1; level--) { /* AVX-512, AVX2: each where it runs */
        kiln__half_limit(level);
        f16_runs();
    }
    kiln__half_limit(2);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--rng-child")) return rng_child();
    if (argc > 1 && !strcmp(argv[1], "--matmul-child")) return matmul_child();
    const struct CMUnitTest tests[] = {
        T(test_wrap_uses_the_callers_memory_and_releases_it_once),
        T(test_zeros_ones_full_fill_every_element),
        T(test_scalar_is_zero_dim_with_one_element),
        T(test_arange_counts_like_numpy),
        T(test_arange_refuses_a_step_pointing_away),
        T(test_rand_is_in_unit_interval_for_each_float_dtype),
        T(test_randn_has_mean_zero_and_unit_variance),
        T(test_rand_refuses_integer_dtypes),
        T(test_from_data_to_host_round_trips_every_dtype_bitwise),
        T(test_to_host_refuses_a_wrong_byte_count),
        T(test_from_data_with_null_data_fails_without_leaking),
        T(test_f32_to_f16_rounds_to_nearest_even),
        T(test_f32_to_bf16_rounds_to_nearest_even),
        T(test_f64_to_half_rounds_once),
        T(test_f16_and_bf16_widen_exactly),
        T(test_reshape_and_view_share_storage),
        T(test_view_infers_one_dim),
        T(test_permute_and_transpose_are_strided_views),
        T(test_slice_with_step_views_every_other_element),
        T(test_narrow_outside_the_dim_is_an_index_error),
        T(test_expand_broadcasts_with_zero_strides),
        T(test_expand_of_a_non_unit_dim_is_a_shape_error),
        T(test_squeeze_and_unsqueeze_share_storage),
        T(test_unsqueeze_of_a_transpose_stays_a_view),
        T(test_contiguous_copies_a_strided_view_and_clone_always_copies),
        T(test_copies_of_permuted_views_match_the_index_arithmetic),
        T(test_view_of_a_transpose_fails_and_reshape_copies),
        T(test_views_overlap_by_their_elements),
        T(test_view_with_the_wrong_element_count_is_a_shape_error),
        T(test_from_host_refuses_a_strided_destination),
        T(test_scope_end_frees_every_tensor_made_in_it),
        T(test_kept_tensor_outlives_its_scope),
        T(test_views_keep_their_storage_alive),
        T(test_nested_scopes_release_inner_first),
        T(test_philox_matches_the_random123_known_answer),
        T(test_same_seed_gives_the_same_numbers),
        T(test_successive_draws_differ_and_state_restores_them),
        T(test_random_streams_do_not_depend_on_the_thread_count),
        T(test_matmuls_do_not_depend_on_the_thread_count),
        T(test_broadcast_mismatch_names_the_op_and_shapes),
        T(test_matmul_inner_mismatch_names_both_shapes),
        T(test_float_op_on_integers_is_a_dtype_error),
        T(test_out_of_range_index_is_an_index_error),
        T(test_out_of_range_dim_is_an_index_error),
        T(test_item_of_many_elements_is_a_shape_error),
        T(test_null_input_keeps_the_first_error),
        T(test_negative_size_is_a_shape_error),
        T(test_clear_error_resets_the_status),
        T(test_f16_runs_convert_as_the_scalar_functions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
