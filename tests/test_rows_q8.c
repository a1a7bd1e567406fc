/* matmul_rows_packed on q8_0 weights (kiln_matmul_rows_pack_q8_0): the packed bytes are
 * ggml's q8_0 blocks of each row in the layout kiln/ops.h describes, weights that come
 * from q8_0 blocks re-pack to the same blocks, and the product is bit for bit the plain
 * C reference written here (a quantized per row to q8_0, an int32 dot per block, blocks
 * summed in order as acc = fmaf(dot, d_w * d_a, acc)) whatever M, the rows it is called
 * with, the thread count (ctest runs it at 1 and 2 threads) and the kernel (ctest runs it
 * with KILN_OPT_ROWS_Q8_SIMD=0: the plain C kernel; else AVX2 where the CPU has it); a
 * Q8_0 GGUF file's matrices re-pack to the file's own blocks; and
 * within a stated tolerance of the f32 product of the dequantized weights. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "kiln/kiln.h"
#include "kiln/gguf.h"
#include "core/dtype.h"
#include "test_util.h"

enum { QK = 32, BLK = 34 };

static float *to_host(kiln_tensor_t *t)
{
    size_t n = (size_t)kiln_tensor_numel(t);
    float *p = malloc(sizeof *p * n);
    assert_non_null(p);
    assert_int_equal(kiln_tensor_to_host(t, p, sizeof *p * n), KILN_OK);
    return p;
}

static float *randn_host(int64_t n, uint64_t seed)
{
    kiln_manual_seed(seed);
    int64_t s[1] = {n};
    kiln_scope_begin();
    float *p = to_host(kiln_randn(s, 1, KILN_DTYPE_F32));
    kiln_scope_end();
    return p;
}

/* ggml's quantize_row_q8_0_ref, written out: per 32 values d = amax/127 (stored as f16),
 * q = roundf(x / d) with 1/d taken from the f32 d. */
static void q8_row(const float *x, int64_t K, uint8_t *out)
{
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = kiln__f32_to_f16(d);
        memcpy(out + b * BLK, &h, 2);
        for (int j = 0; j < QK; j++) out[b * BLK + 2 + j] = (uint8_t)(int8_t)roundf(xb[j] * id);
    }
}

static float blk_d(const uint8_t *b)
{
    uint16_t h;
    memcpy(&h, b, 2);
    return kiln__f16_to_f32(h);
}

/* The reference product: out[m][n] from the q8_0 blocks of a's row m and w's row n. */
static void reference(const float *a, const float *w, int64_t M, int64_t N, int64_t K, float *out)
{
    int64_t KB = K / QK;
    uint8_t *qa = malloc((size_t)(M * KB * BLK)), *qw = malloc((size_t)(N * KB * BLK));
    assert_true(qa && qw);
    for (int64_t m = 0; m < M; m++) q8_row(a + m * K, K, qa + m * KB * BLK);
    for (int64_t n = 0; n < N; n++) q8_row(w + n * K, K, qw + n * KB * BLK);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < KB; b++) {
                const uint8_t *x = qa + (m * KB + b) * BLK, *y = qw + (n * KB + b) * BLK;
                int32_t s = 0;
                for (int j = 0; j < QK; j++) s += (int32_t)(int8_t)x[2 + j] * (int8_t)y[2 + j];
                float d = blk_d(y) * blk_d(x);
                acc = fmaf((float)s, d, acc);
            }
            out[m * N + n] = acc;
        }
    free(qa);
    free(qw);
}

/* The packed bytes are each row's q8_0 blocks in the panel layout of kiln/ops.h. */
static void pack_q8_0_lays_out_ggml_blocks(void **state)
{
    (void)state;
    enum { N = 21, K = 96 };
    float *w = randn_host(N * K, 7);
    int64_t ws[2] = {N, K};
    kiln_scope_begin();
    kiln_tensor_t *wp = kiln_matmul_rows_pack_q8_0(kiln_from_data(w, ws, 2, KILN_DTYPE_F32));
    assert_non_null(wp);
    assert_int_equal(kiln_tensor_dtype(wp), KILN_DTYPE_U8);
    assert_int_equal(kiln_tensor_dim(wp, 0), 2);
    assert_int_equal(kiln_tensor_dim(wp, 1), K / QK);
    assert_int_equal(kiln_tensor_dim(wp, 2), KILN_ROWS_Q8_BYTES);
    size_t nb = (size_t)(2 * (K / QK) * KILN_ROWS_Q8_BYTES);
    uint8_t *got = malloc(nb), q[K / QK * BLK];
    assert_int_equal(kiln_tensor_to_host(wp, got, nb), KILN_OK);
    for (int n = 0; n < 32; n++) {
        if (n < N) q8_row(w + n * K, K, q);
        else memset(q, 0, sizeof q); /* padding rows: zero scales and values */
        for (int b = 0; b < K / QK; b++) {
            const uint8_t *blk = got + ((n / 16) * (K / QK) + b) * KILN_ROWS_Q8_BYTES;
            assert_memory_equal(blk + 2 * (n % 16), q + b * BLK, 2);
            for (int g = 0; g < 8; g++) assert_memory_equal(blk + 32 + 64 * g + 4 * (n % 16), q + b * BLK + 2 + 4 * g, 4);
        }
    }
    /* K not a multiple of 32, and non-matrices, are refused */
    int64_t bad[2] = {4, 40};
    assert_null(kiln_matmul_rows_pack_q8_0(kiln_zeros(bad, 2, KILN_DTYPE_F32)));
    kiln_scope_end();
    free(got);
    free(w);
}

/* Weights that are q8_0 values already (a GGUF Q8_0 file's, dequantized at load) pack to
 * the very blocks they came from: the round trip is exact. */
static void q8_0_weights_round_trip(void **state)
{
    (void)state;
    enum { N = 40, K = 256 };
    float *w = randn_host(N * K, 11);
    uint8_t q[N * (K / QK) * BLK];
    for (int n = 0; n < N; n++) q8_row(w + n * K, K, q + n * (K / QK) * BLK);
    /* blocks of every size: a zero block, one whose scale is an f16 subnormal, a large
     * one. (A scale below f16's smallest subnormal is stored as 0: such a block
     * dequantizes to zeros and re-packs as zeros, the same values.) */
    for (int j = 0; j < QK; j++) w[j] = 0.0f, w[K + j] *= 1e-3f, w[2 * K + j] *= 1e4f;
    for (int n = 0; n < 3; n++) q8_row(w + n * K, K, q + n * (K / QK) * BLK);
    for (int n = 0; n < N; n++)
        for (int b = 0; b < K / QK; b++) {
            const uint8_t *blk = q + (n * (K / QK) + b) * BLK;
            for (int j = 0; j < QK; j++) w[n * K + b * QK + j] = (float)(int8_t)blk[2 + j] * blk_d(blk);
        }
    int64_t ws[2] = {N, K};
    kiln_scope_begin();
    kiln_tensor_t *wp = kiln_matmul_rows_pack_q8_0(kiln_from_data(w, ws, 2, KILN_DTYPE_F32));
    assert_non_null(wp);
    size_t nb = (size_t)(3 * (K / QK) * KILN_ROWS_Q8_BYTES);
    uint8_t *got = malloc(nb);
    assert_int_equal(kiln_tensor_to_host(wp, got, nb), KILN_OK);
    for (int n = 0; n < N; n++)
        for (int b = 0; b < K / QK; b++) {
            const uint8_t *blk = got + ((n / 16) * (K / QK) + b) * KILN_ROWS_Q8_BYTES, *src = q + (n * (K / QK) + b) * BLK;
            assert_memory_equal(blk + 2 * (n % 16), src, 2);
            for (int g = 0; g < 8; g++) assert_memory_equal(blk + 32 + 64 * g + 4 * (n % 16), src + 2 + 4 * g, 4);
        }
    kiln_scope_end();
    free(got);
    free(w);
}

/* A Q8_0 GGUF file (kiln_gguf_write, llama.cpp's quantizer bit for bit): each of its
 * q8_0 matrices, read as f32 as kiln_gguf_load reads it, packs to the file's own blocks. */
static void q8_0_gguf_matrices_repack_to_their_blocks(void **state)
{
    (void)state;
    kiln_gpt_config c = kiln_gpt_config_llama();
    c.n_layer = 2, c.n_head = 4, c.n_kv_head = 2, c.n_embd = 128, c.block_size = 32, c.vocab_size = 256;
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 5, &m), KILN_OK);
    kiln_tokenizer_t *tok = kiln_tokenizer_byte();
    char dir[] = "/tmp/kiln_rows_q8_XXXXXX", path[64];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    if (kiln_gguf_write(m, tok, path, "q8_0") != KILN_OK) fail_msg("%s", kiln_last_error());
    kiln_gguf_t *g;
    assert_int_equal(kiln_gguf_open(path, &g), KILN_OK);
    int checked = 0;
    for (int64_t i = 0; i < kiln_gguf_n_tensors(g); i++) {
        kiln_gguf_tensor t;
        assert_int_equal(kiln_gguf_tensor_at(g, i, &t), KILN_OK);
        if (t.type != 8 || t.ndim != 2) continue; /* ggml's Q8_0 matrices */
        int64_t N = t.shape[0], K = t.shape[1], KB = K / QK;
        kiln_scope_begin();
        kiln_tensor_t *wp = kiln_matmul_rows_pack_q8_0(kiln_gguf_tensor_f32(g, i));
        assert_non_null(wp);
        size_t nb = (size_t)kiln_tensor_numel(wp);
        uint8_t *got = malloc(nb);
        assert_int_equal(kiln_tensor_to_host(wp, got, nb), KILN_OK);
        const uint8_t *file = t.data;
        for (int64_t n = 0; n < N; n++)
            for (int64_t b = 0; b < KB; b++) {
                const uint8_t *blk = got + ((n / 16) * KB + b) * KILN_ROWS_Q8_BYTES, *src = file + (n * KB + b) * BLK;
                if (memcmp(blk + 2 * (n % 16), src, 2))
                    fail_msg("%s row %lld block %lld: the scale differs from the file's", t.name, (long long)n, (long long)b);
                for (int q = 0; q < 8; q++)
                    if (memcmp(blk + 32 + 64 * q + 4 * (n % 16), src + 2 + 4 * q, 4))
                        fail_msg("%s row %lld block %lld: values differ from the file's", t.name, (long long)n,
                                 (long long)b);
            }
        free(got);
        kiln_scope_end();
        checked++;
    }
    assert_true(checked >= 2 * 7); /* every layer's q, k, v, o, gate, up and down at least */
    kiln_gguf_free(g);
    unlink(path);
    rmdir(dir);
    kiln_tokenizer_free(tok);
    kiln_gpt_free(m);
}

/* The product, bit for bit the reference for every M 1..17 (all rows at once and each
 * row alone), on shapes with N not a multiple of 16 and K up to 4096; and within the
 * activation rounding of the f32 product of the dequantized weights: each block of a
 * is off by at most d_a/2 a value, so |err| <= sum_b (d_a,b / 2) * sum_j |w_deq| (the
 * tolerance checked, with 1e-5 relative for the f32 sums). */
static void rows_q8_case(int64_t M, int64_t N, int64_t K, uint64_t seed)
{
    float *a = randn_host(M * K, seed), *w = randn_host(N * K, seed + 1000);
    float *want = malloc(sizeof(float) * (size_t)(M * N));
    assert_non_null(want);
    reference(a, w, M, N, K, want);
    int64_t as[2] = {M, K}, ws[2] = {N, K};
    kiln_scope_begin();
    kiln_tensor_t *at = kiln_from_data(a, as, 2, KILN_DTYPE_F32), *wt = kiln_from_data(w, ws, 2, KILN_DTYPE_F32);
    kiln_tensor_t *wp = kiln_matmul_rows_pack_q8_0(wt);
    assert_non_null(wp);
    float *got = to_host(kiln_matmul_rows_packed(at, wp, N));
    for (int64_t i = 0; i < M * N; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
            fail_msg("M %lld N %lld K %lld: element %lld is %.9g, the reference %.9g", (long long)M, (long long)N,
                     (long long)K, (long long)i, got[i], want[i]);
    for (int64_t m = 0; m < M; m += M > 4 ? 3 : 1) {
        float *one = to_host(kiln_matmul_rows_packed(kiln_narrow(at, 0, m, 1), wp, N));
        assert_memory_equal(one, want + m * N, sizeof(float) * (size_t)N);
        free(one);
    }
    /* against the f32 product of the dequantized weights */
    uint8_t *q = malloc((size_t)(K / QK * BLK));
    float *wd = malloc(sizeof(float) * (size_t)(N * K));
    assert_true(q && wd);
    for (int64_t n = 0; n < N; n++) {
        q8_row(w + n * K, K, q);
        for (int64_t k = 0; k < K; k++) wd[n * K + k] = (float)(int8_t)q[k / QK * BLK + 2 + k % QK] * blk_d(q + k / QK * BLK);
    }
    for (int64_t m = 0; m < M; m++) {
        q8_row(a + m * K, K, q);
        for (int64_t n = 0; n < N; n++) {
            double exact = 0, bound = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                exact += (double)a[m * K + k] * wd[n * K + k];
                bound += 0.5 * blk_d(q + k / QK * BLK) * fabs(wd[n * K + k]);
                mag += fabs((double)a[m * K + k] * wd[n * K + k]);
            }
            double err = fabs(got[m * N + n] - exact);
            if (err > bound + 1e-5 * mag)
                fail_msg("M %lld N %lld K %lld (%lld,%lld): %.6g vs the dequantized product %.6g, beyond %.3g",
                         (long long)M, (long long)N, (long long)K, (long long)m, (long long)n, got[m * N + n], exact,
                         bound + 1e-5 * mag);
        }
    }
    kiln_scope_end();
    free(q);
    free(wd);
    free(got);
    free(want);
    free(a);
    free(w);
}

static void rows_q8_matches_reference_for_every_m(void **state)
{
    (void)state;
    for (int64_t M = 1; M <= 17; M++) rows_q8_case(M, 37, 64, (uint64_t)M);
    rows_q8_case(5, 1, 32, 100);
    rows_q8_case(17, 100, 4096, 101);
    rows_q8_case(3, 250, 1024, 102);
    rows_q8_case(9, 16, 160, 103);
}

/* Shapes that do not fit are refused. */
static void rows_q8_refuses_bad_shapes(void **state)
{
    (void)state;
    int64_t ws[2] = {20, 64}, a1[2] = {2, 64}, a2[2] = {2, 96};
    kiln_scope_begin();
    kiln_tensor_t *wp = kiln_matmul_rows_pack_q8_0(kiln_zeros(ws, 2, KILN_DTYPE_F32));
    assert_non_null(wp);
    assert_non_null(kiln_matmul_rows_packed(kiln_zeros(a1, 2, KILN_DTYPE_F32), wp, 20));
    assert_null(kiln_matmul_rows_packed(kiln_zeros(a1, 2, KILN_DTYPE_F32), wp, 33)); /* more columns than panels */
    assert_null(kiln_matmul_rows_packed(kiln_zeros(a1, 2, KILN_DTYPE_F32), wp, 16)); /* a whole panel unused */
    assert_null(kiln_matmul_rows_packed(kiln_zeros(a2, 2, KILN_DTYPE_F32), wp, 20)); /* K differs */
    assert_null(kiln_matmul_rows_packed(kiln_zeros(a1, 2, KILN_DTYPE_F16), wp, 20)); /* a not f32 */
    kiln_scope_end();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(pack_q8_0_lays_out_ggml_blocks),
        cmocka_unit_test(q8_0_weights_round_trip),
        cmocka_unit_test(q8_0_gguf_matrices_repack_to_their_blocks),
        cmocka_unit_test(rows_q8_matches_reference_for_every_m),
        cmocka_unit_test(rows_q8_refuses_bad_shapes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
