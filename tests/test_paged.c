/* The serving ops and the paged forward: rope_at, index_copy_, paged_attention and
 * kiln_gpt_forward_paged, each against an oracle that kiln already checks against
 * PyTorch (kiln_rope, kiln_attention, kiln_gpt_forward), plus batch invariance, and
 * models with attention variants (window, softcap, alibi) against their full forward. */
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
#include "test_util.h"

static float *to_host(kiln_tensor_t *t)
{
    size_t n = (size_t)kiln_tensor_numel(t);
    float *p = malloc(sizeof *p * n);
    assert_non_null(p);
    assert_int_equal(kiln_tensor_to_host(t, p, sizeof *p * n), KILN_OK);
    return p;
}

static kiln_tensor_t *randn(const int64_t *shape, int ndim, uint64_t seed)
{
    kiln_manual_seed(seed);
    return kiln_randn(shape, ndim, KILN_DTYPE_F32);
}

static void assert_close(const float *a, const float *b, int64_t n, double tol, const char *what)
{
    for (int64_t i = 0; i < n; i++)
        if (!(fabs((double)a[i] - b[i]) <= tol * (1 + fabs((double)b[i]))))
            fail_msg("%s: element %lld is %.9g, the oracle says %.9g (tolerance %g)", what, (long long)i, a[i], b[i], tol);
}

/* Oracle: kiln_rope on (1,H,T,D) at positions 0..T-1; rope_at gets the rows shuffled.
 * Also with each rope scaling: kiln_rope_at_scaled against kiln_rope_scaled. */
static void rope_at_matches_rope(void **state)
{
    const kiln_rope_scaling scalings[3] = {{0},
                                           {.kind = KILN_ROPE_SCALING_LINEAR, .factor = 3},
                                           {.kind = KILN_ROPE_SCALING_LLAMA3, .factor = 4, .low_freq_factor = 1,
                                            .high_freq_factor = 4, .original_context = 16}};
    for (int sc = 0; sc < 3; sc++) {
        int64_t H = 2, T = 7, D = 8, s4[4] = {1, H, T, D};
        kiln_tensor_t *x = randn(s4, 4, 1);
        float *want = to_host(kiln_rope_scaled(x, 0, 10000.0, &scalings[sc]));
        float *xh = to_host(x);
        /* Row n of the (N,H,D) input is position perm[n]. */
        int32_t perm[7] = {3, 0, 6, 1, 5, 2, 4};
        float *xr = malloc(sizeof(float) * (size_t)(T * H * D));
        for (int n = 0; n < T; n++)
            for (int h = 0; h < H; h++)
                memcpy(xr + (n * H + h) * D, xh + (h * T + perm[n]) * D, sizeof(float) * (size_t)D);
        int64_t s3[3] = {T, H, D};
        kiln_tensor_t *pos = kiln_from_data(perm, &T, 1, KILN_DTYPE_I32);
        float *got =
            to_host(kiln_rope_at_scaled(kiln_from_data(xr, s3, 3, KILN_DTYPE_F32), pos, 10000.0, &scalings[sc]));
        for (int n = 0; n < T; n++)
            for (int h = 0; h < H; h++)
                assert_close(got + (n * H + h) * D, want + (h * T + perm[n]) * D, D, 0, "rope_at (bitwise)");
        free(want);
        free(xh);
        free(xr);
        free(got);
    }
}

/* Oracle: kiln_matmul (the BLAS), within a tolerance that grows with K; row m alone
 * equals row m of the whole; and kiln_matmul_rows (which packs w on each call) gives
 * bitwise what kiln_matmul_rows_packed gives with w packed once. */
static void matmul_rows_matches_matmul_and_is_row_invariant(void **state)
{
    const int64_t shapes[3][3] = {{13, 19, 37}, {14, 19, 37}, {45, 9, 1550}};
    for (int c = 0; c < 3; c++) {
        int64_t M = shapes[c][0], N = shapes[c][1], K = shapes[c][2], as[2] = {M, K}, ws[2] = {N, K};
        kiln_tensor_t *a = randn(as, 2, 8), *w = randn(ws, 2, 9);
        float *want = to_host(kiln_matmul(a, kiln_transpose(w, 0, 1)));
        float *got = to_host(kiln_matmul_rows(a, w));
        /* Two f32 sums of K products of unit normals, in different orders: their
         * rounding grows with K, so the tolerance does (1e-5 up to K = 64). */
        assert_close(got, want, M * N, 1e-5 * (K > 64 ? (double)K / 64 : 1), "matmul_rows vs matmul");
        float *packed = to_host(kiln_matmul_rows_packed(a, kiln_matmul_rows_pack(w), N));
        assert_memory_equal(packed, got, sizeof(float) * (size_t)(M * N));
        free(packed);
        for (int64_t m = 0; m < M; m += 4) {
            float *one = to_host(kiln_matmul_rows(kiln_narrow(a, 0, m, 1), w));
            assert_memory_equal(one, got + m * N, sizeof(float) * (size_t)N);
            free(one);
        }
        free(want);
        free(got);
    }
    int64_t as[2] = {3, 5}, ws[2] = {2, 4};
    assert_null(kiln_matmul_rows(randn(as, 2, 1), randn(ws, 2, 2)));
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    kiln_clear_error();
}

/* Oracle: kiln_matmul (the BLAS), within a tolerance that grows with K; and row m alone
 * equals row m of the whole, bit for bit. The shapes cover row tiles of 8, 4, 2 and 1
 * (M = 13, 14, 17, 45) and panel groups of three, two and one (N = 50, 19, 9, 300). */
/* Packed f32 weights, and packed bf16 and f16 ones (oracle: the f32 product with the
 * weights rounded to that type first, which the 16-bit kernels widen exactly). */
static void rows_packed_case(kiln_dtype wt)
{
    const int64_t shapes[5][3] = {{13, 50, 37}, {14, 19, 64}, {17, 300, 384}, {45, 9, 1550}, {1, 50, 8}};
    for (int c = 0; c < 5; c++) {
        int64_t M = shapes[c][0], N = shapes[c][1], K = shapes[c][2], as[2] = {M, K}, ws[2] = {N, K};
        kiln_tensor_t *a = randn(as, 2, 10 + c), *w = kiln_cast(kiln_cast(randn(ws, 2, 20 + c), wt), KILN_DTYPE_F32);
        kiln_tensor_t *wp = kiln_matmul_rows_pack(kiln_cast(w, wt));
        assert_non_null(wp);
        assert_int_equal(kiln_tensor_dtype(wp), wt);
        assert_int_equal(kiln_tensor_dim(wp, 0), (N + 15) / 16);
        float *want = to_host(kiln_matmul(a, kiln_transpose(w, 0, 1)));
        float *got = to_host(kiln_matmul_rows_packed(a, wp, N));
        assert_close(got, want, M * N, 1e-5 * (K > 64 ? (double)K / 64 : 1), "matmul_rows_packed vs matmul");
        for (int64_t m = 0; m < M; m += 3) {
            float *one = to_host(kiln_matmul_rows_packed(kiln_narrow(a, 0, m, 1), wp, N));
            assert_memory_equal(one, got + m * N, sizeof(float) * (size_t)N);
            free(one);
        }
        free(want);
        free(got);
    }
}

static void matmul_rows_packed_matches_matmul_and_is_row_invariant(void **state)
{
    rows_packed_case(KILN_DTYPE_F32);
    rows_packed_case(KILN_DTYPE_BF16);
    rows_packed_case(KILN_DTYPE_F16);
    int64_t as[2] = {3, 5}, ws[2] = {20, 5}, w4[2] = {20, 4};
    kiln_tensor_t *wp = kiln_matmul_rows_pack(randn(ws, 2, 2));
    assert_null(kiln_matmul_rows_packed(randn(as, 2, 1), wp, 33)); /* more columns than the panels hold */
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    kiln_clear_error();
    assert_null(kiln_matmul_rows_packed(randn(as, 2, 1), kiln_matmul_rows_pack(randn(w4, 2, 3)), 20)); /* K differs */
    assert_int_equal(kiln_last_status(), KILN_ERR_SHAPE);
    kiln_clear_error();
}

static void index_copy_writes_the_named_rows(void **state)
{
    int64_t ds[2] = {5, 2}, ss[2] = {2, 2}, n = 2;
    float src[4] = {1, 2, 3, 4};
    int32_t idx[2] = {4, 1};
    kiln_tensor_t *dst = kiln_zeros(ds, 2, KILN_DTYPE_F32);
    assert_int_equal(kiln_index_copy_(dst, kiln_from_data(idx, &n, 1, KILN_DTYPE_I32),
                                      kiln_from_data(src, ss, 2, KILN_DTYPE_F32)), KILN_OK);
    float *d = to_host(dst);
    const float want[10] = {0, 0, 3, 4, 0, 0, 0, 0, 1, 2};
    assert_memory_equal(d, want, sizeof want);
    free(d);
    int32_t bad[2] = {4, 5};
    assert_int_equal(kiln_index_copy_(dst, kiln_from_data(bad, &n, 1, KILN_DTYPE_I32),
                                      kiln_from_data(src, ss, 2, KILN_DTYPE_F32)), KILN_ERR_INDEX);
    assert_non_null(strstr(kiln_last_error(), "index_copy_"));
    kiln_clear_error();
}

/* Oracle: causal kiln_attention over (1,H,T,D) queries and (1,Hkv,T,D) keys/values.
 * The pages hold the same keys in scattered blocks, with other sequences' garbage.
 * D = 8 takes the scalar value path, 64 the 32-lane one, 40 both. */
static void paged_attention_case(int64_t D)
{
    int64_t H = 4, Hkv = 2, T = 11, bl = 4, nblk = 8;
    int64_t qs[4] = {1, H, T, D}, ks[4] = {1, Hkv, T, D}, ps[3] = {nblk * bl, Hkv, D};
    kiln_tensor_t *q = randn(qs, 4, 2), *k = randn(ks, 4, 3), *v = randn(ks, 4, 4);
    float *want = to_host(kiln_attention(q, k, v, true, 0.0));
    float *qh = to_host(q), *kh = to_host(k), *vh = to_host(v);
    float *kp = to_host(randn(ps, 3, 5)), *vp = to_host(randn(ps, 3, 6));
    int32_t table[2][4] = {{6, 1, 4, 0}, {2, 3, 5, 7}}; /* sequence 1 is the one queried */
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = table[1][t / bl] * bl + t % bl;
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(kp + (slot * Hkv + h) * D, kh + (h * T + t) * D, sizeof(float) * (size_t)D);
            memcpy(vp + (slot * Hkv + h) * D, vh + (h * T + t) * D, sizeof(float) * (size_t)D);
        }
    }
    float *qr = malloc(sizeof(float) * (size_t)(T * H * D));
    int32_t sp[11][2];
    for (int64_t t = 0; t < T; t++) {
        sp[t][0] = 1;
        sp[t][1] = (int32_t)t;
        for (int64_t h = 0; h < H; h++) memcpy(qr + (t * H + h) * D, qh + (h * T + t) * D, sizeof(float) * (size_t)D);
    }
    int64_t q3[3] = {T, H, D}, bts[2] = {2, 4}, sps[2] = {T, 2};
    kiln_tensor_t *bt = kiln_from_data(table, bts, 2, KILN_DTYPE_I32);
    kiln_tensor_t *spt = kiln_from_data(sp, sps, 2, KILN_DTYPE_I32);
    kiln_tensor_t *out = kiln_paged_attention(kiln_from_data(qr, q3, 3, KILN_DTYPE_F32),
                                              kiln_from_data(kp, ps, 3, KILN_DTYPE_F32),
                                              kiln_from_data(vp, ps, 3, KILN_DTYPE_F32), bt, spt, bl, 0.0);
    assert_non_null(out);
    float *got = to_host(out);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++)
            assert_close(got + (t * H + h) * D, want + (h * T + t) * D, D, 1e-5, "paged_attention vs attention");
    /* One row alone (its heads then split across threads) gives that row's result bit
     * for bit: the oracle is the batched call above. */
    for (int64_t t = 0; t < T; t += T - 1) {
        int64_t q1[3] = {1, H, D}, sp1s[2] = {1, 2};
        kiln_tensor_t *one = kiln_paged_attention(kiln_from_data(qr + t * H * D, q1, 3, KILN_DTYPE_F32),
                                                  kiln_from_data(kp, ps, 3, KILN_DTYPE_F32),
                                                  kiln_from_data(vp, ps, 3, KILN_DTYPE_F32), bt,
                                                  kiln_from_data(sp[t], sp1s, 2, KILN_DTYPE_I32), bl, 0.0);
        assert_non_null(one);
        float *g1 = to_host(one);
        assert_memory_equal(g1, got + t * H * D, sizeof(float) * (size_t)(H * D));
        free(g1);
    }
    /* The zero variant is kiln_paged_attention bit for bit; a bad one is an error. */
    kiln_paged_variant none = {0}, neg = {.window = -1}, nan_cap = {.softcap = NAN};
    float *g0 = to_host(kiln_paged_attention_variant(kiln_from_data(qr, q3, 3, KILN_DTYPE_F32),
                                                     kiln_from_data(kp, ps, 3, KILN_DTYPE_F32),
                                                     kiln_from_data(vp, ps, 3, KILN_DTYPE_F32), bt, spt, bl, 0.0, &none));
    assert_memory_equal(g0, got, sizeof(float) * (size_t)(T * H * D));
    free(g0);
    for (int i = 0; i < 2; i++) {
        assert_null(kiln_paged_attention_variant(kiln_from_data(qr, q3, 3, KILN_DTYPE_F32),
                                                 kiln_from_data(kp, ps, 3, KILN_DTYPE_F32),
                                                 kiln_from_data(vp, ps, 3, KILN_DTYPE_F32), bt, spt, bl, 0.0,
                                                 i ? &nan_cap : &neg));
        assert_int_equal(kiln_last_status(), KILN_ERR_ARG);
        assert_non_null(strstr(kiln_last_error(), i ? "softcap" : "window"));
        kiln_clear_error();
    }
    /* f16 and bf16 pages. Oracle: attention over the keys and values rounded to that
     * type and widened back, so only the kernel's f32 arithmetic is compared (1e-5). */
    for (int d = 0; d < 2; d++) {
        kiln_dtype dt = d ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
        float *want_h = to_host(kiln_attention(q, kiln_cast(kiln_cast(k, dt), KILN_DTYPE_F32),
                                               kiln_cast(kiln_cast(v, dt), KILN_DTYPE_F32), true, 0.0));
        kiln_tensor_t *oh = kiln_paged_attention(kiln_from_data(qr, q3, 3, KILN_DTYPE_F32),
                                                 kiln_cast(kiln_from_data(kp, ps, 3, KILN_DTYPE_F32), dt),
                                                 kiln_cast(kiln_from_data(vp, ps, 3, KILN_DTYPE_F32), dt), bt, spt, bl, 0.0);
        assert_non_null(oh);
        float *got_h = to_host(oh);
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                assert_close(got_h + (t * H + h) * D, want_h + (h * T + t) * D, D, 1e-5,
                             d ? "paged_attention, bf16 pages" : "paged_attention, f16 pages");
        free(want_h);
        free(got_h);
    }
    assert_null(kiln_paged_attention(kiln_from_data(qr, q3, 3, KILN_DTYPE_F32),
                                     kiln_cast(kiln_from_data(kp, ps, 3, KILN_DTYPE_F32), KILN_DTYPE_F16),
                                     kiln_from_data(vp, ps, 3, KILN_DTYPE_F32), bt, spt, bl, 0.0));
    assert_int_equal(kiln_last_status(), KILN_ERR_DTYPE);
    kiln_clear_error();
    /* A block id outside the pool is an error that names it, not a read out of bounds. */
    table[1][2] = 99;
    kiln_tensor_t *bad = kiln_paged_attention(kiln_from_data(qr, q3, 3, KILN_DTYPE_F32),
                                              kiln_from_data(kp, ps, 3, KILN_DTYPE_F32),
                                              kiln_from_data(vp, ps, 3, KILN_DTYPE_F32),
                                              kiln_from_data(table, bts, 2, KILN_DTYPE_I32), spt, bl, 0.0);
    assert_null(bad);
    assert_int_equal(kiln_last_status(), KILN_ERR_INDEX);
    assert_non_null(strstr(kiln_last_error(), "99"));
    kiln_clear_error();
    free(want); free(qh); free(kh); free(vh); free(kp); free(vp); free(qr); free(got);
}

static void paged_attention_matches_attention(void **state)
{
    paged_attention_case(8);
    paged_attention_case(64);
    paged_attention_case(40);
}

static bool tiny_qk_norm; /* tiny(true) with Qwen3's q/k norms */

static kiln_gpt_config tiny(bool llama)
{
    kiln_gpt_config c = llama ? kiln_gpt_config_llama() : kiln_gpt_config_gpt2();
    c.qk_norm = llama && tiny_qk_norm;
    c.n_layer = 2;
    c.n_head = 4;
    c.n_kv_head = llama ? 2 : 4;
    c.n_embd = 32;
    c.block_size = 24;
    c.vocab_size = 50;
    return c;
}

/* Oracle: the training forward over the whole sequence. The paged forward gets the
 * prompt in two chunks (prefill 0..8, then 9..T-1 one token per step), in blocks that
 * are not in order, alongside another sequence. */
/* With an f16 or bf16 pool, keys and values are rounded to 11 or 8 significant bits
 * as they are stored; the tolerance is a few of those units on logits of order one. */
static void paged_forward_matches_full_forward(bool llama, kiln_dtype kv, kiln_dtype weights, double tol)
{
    kiln_gpt_config c = tiny(llama);
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 7, &m), KILN_OK);
    enum { T = 14, BL = 4 };
    int32_t toks[T], other[T];
    for (int i = 0; i < T; i++) {
        toks[i] = (i * 7 + 3) % c.vocab_size;
        other[i] = (i * 11 + 5) % c.vocab_size;
    }
    int64_t ts[2] = {1, T};
    float *want = to_host(kiln_gpt_forward(m, kiln_from_data(toks, ts, 2, KILN_DTYPE_I32), NULL, false, NULL));
    kiln_kv_pool_t *p;
    assert_int_equal(kiln_kv_pool_new_typed(m, 12, BL, kv, weights, &p), KILN_OK);
    int32_t table[2 * 6] = {9, 2, 7, 0, 11, 4, 1, 3, 5, 6, 8, 10};
    float *got = malloc(sizeof(float) * (size_t)(T * c.vocab_size));
    int t = 0;
    while (t < T) {
        int n = t == 0 ? 9 : 1, rows = 0;
        int32_t tk[2 * T], sq[2 * T], ps[2 * T], lr[2 * T];
        for (int i = 0; i < n; i++, rows++) {
            tk[rows] = toks[t + i];
            sq[rows] = 0;
            ps[rows] = t + i;
            lr[i] = rows;
        }
        for (int i = 0; i < n; i++, rows++) { /* the other sequence, interleaved */
            tk[rows] = other[t + i];
            sq[rows] = 1;
            ps[rows] = t + i;
        }
        kiln_paged_batch b = {rows, tk, sq, ps, 2, 6, table, n, lr};
        kiln_tensor_t *lg = kiln_gpt_forward_paged(m, p, &b);
        assert_non_null(lg);
        assert_int_equal(kiln_tensor_dim(lg, 0), n);
        float *h = to_host(lg);
        memcpy(got + (size_t)t * c.vocab_size, h, sizeof(float) * (size_t)(n * c.vocab_size));
        free(h);
        t += n;
    }
    char what[64];
    snprintf(what, sizeof what, "paged forward (%s, %s KV cache, %s weights)", llama ? "llama" : "gpt2",
             kiln_dtype_name(kv), kiln_dtype_name(weights));
    assert_close(got, want, (int64_t)T * c.vocab_size, tol, what);
    free(got);
    free(want);
    kiln_kv_pool_free(p);
    kiln_gpt_free(m);
}

static void paged_forward_matches_full_forward_gpt2(void **state)
{
    paged_forward_matches_full_forward(false, KILN_DTYPE_F32, KILN_DTYPE_F32, 2e-5);
    paged_forward_matches_full_forward(false, KILN_DTYPE_F16, KILN_DTYPE_F32, 4 * 0x1p-11);
    paged_forward_matches_full_forward(false, KILN_DTYPE_BF16, KILN_DTYPE_F32, 4 * 0x1p-8);
    paged_forward_matches_full_forward(false, KILN_DTYPE_F32, KILN_DTYPE_BF16, 4 * 0x1p-8);
    paged_forward_matches_full_forward(false, KILN_DTYPE_F32, KILN_DTYPE_F16, 4 * 0x1p-11);
}
static void paged_forward_matches_full_forward_llama(void **state)
{
    paged_forward_matches_full_forward(true, KILN_DTYPE_F32, KILN_DTYPE_F32, 2e-5);
    paged_forward_matches_full_forward(true, KILN_DTYPE_F16, KILN_DTYPE_F32, 4 * 0x1p-11);
    paged_forward_matches_full_forward(true, KILN_DTYPE_BF16, KILN_DTYPE_F32, 4 * 0x1p-8);
    paged_forward_matches_full_forward(true, KILN_DTYPE_F32, KILN_DTYPE_BF16, 4 * 0x1p-8);
    paged_forward_matches_full_forward(true, KILN_DTYPE_F32, KILN_DTYPE_F16, 4 * 0x1p-11);
}

/* Qwen3's q/k norms: each head's query and key normed before RoPE, in the paged pass as
 * in the full forward */
static void paged_forward_matches_full_forward_qk_norm(void **state)
{
    tiny_qk_norm = true;
    paged_forward_matches_full_forward(true, KILN_DTYPE_F32, KILN_DTYPE_F32, 2e-5);
    paged_forward_matches_full_forward(true, KILN_DTYPE_BF16, KILN_DTYPE_F32, 4 * 0x1p-8);
    tiny_qk_norm = false;
}

/* Models with an attention variant through the paged path. Oracle: the training
 * forward over the whole sequence, whose flex attention test_flex checks against a
 * hand-written reference and PyTorch's flex_attention. The prompt is prefilled in a
 * chunk of 9, then one token per step; after each step the block table entries of the
 * blocks wholly behind the window are set to -1, which paged attention refuses if it
 * reads them (what the serving engine relies on to reuse them). */
static void paged_variant_case(bool llama, const char *attention, int64_t window)
{
    kiln_gpt_config c = tiny(llama);
    snprintf(c.attention, sizeof c.attention, "%s", attention);
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 9, &m), KILN_OK);
    assert_int_equal(kiln_gpt_kv_window(m), window);
    enum { T = 20, BL = 4, MB = 5 };
    int32_t toks[T];
    for (int i = 0; i < T; i++) toks[i] = (i * 7 + 3) % c.vocab_size;
    int64_t ts[2] = {1, T};
    float *want = to_host(kiln_gpt_forward(m, kiln_from_data(toks, ts, 2, KILN_DTYPE_I32), NULL, false, NULL));
    kiln_kv_pool_t *p;
    assert_int_equal(kiln_kv_pool_new(m, 8, BL, KILN_DTYPE_F32, &p), KILN_OK);
    int32_t table[MB] = {6, 2, 7, 0, 4};
    float *got = malloc(sizeof(float) * (size_t)(T * c.vocab_size));
    for (int t = 0; t < T;) {
        int n = t == 0 ? 9 : 1;
        int32_t ps[9], lr[9], sq[9] = {0};
        for (int i = 0; i < n; i++) ps[i] = t + i, lr[i] = i;
        kiln_paged_batch b = {n, toks + t, sq, ps, 1, MB, table, n, lr};
        kiln_scope_begin();
        kiln_tensor_t *lg = kiln_gpt_forward_paged(m, p, &b);
        assert_non_null(lg);
        float *h = to_host(lg);
        kiln_scope_end();
        memcpy(got + (size_t)t * c.vocab_size, h, sizeof(float) * (size_t)(n * c.vocab_size));
        free(h);
        t += n;
        for (int j = 0; window && (j + 1) * BL <= t - window + 1; j++) table[j] = -1;
    }
    char what[96];
    snprintf(what, sizeof what, "paged forward, attention %s (%s)", attention, llama ? "llama" : "gpt2");
    assert_close(got, want, (int64_t)T * c.vocab_size, 2e-5, what);
    if (window) assert_int_equal(table[0], -1); /* the test did free blocks */
    free(got);
    free(want);
    kiln_kv_pool_free(p);
    kiln_gpt_free(m);
}

/* A mixture-of-experts model (every block 4 experts, top-2, a shared one), and one with
 * multi-head latent attention too, through the paged path: its logits against its full
 * forward (the oracle test_alignment checks against PyTorch; 2e-5, and 1e-4 for the
 * latent attention, whose queries are absorbed into the latent, another rounding of the
 * same sums), and a decoding row's logits bitwise the same alone and batched with others
 * (every product row by row, kiln_matmul_rows). The latent cache holds r_kv + dr = 14
 * numbers a position a layer, against 2 Hkv hs = 32 for the same model without it. */
static void paged_moe_case(bool mla)
{
    kiln_gpt_config c = tiny(true);
    c.n_routed_experts = 4, c.moe_top_k = 2, c.n_shared_experts = 1, c.moe_ffn = 16;
    if (mla) {
        c.mla_kv_rank = 10, c.mla_q_rank = 12, c.mla_rope_dim = 4, c.mla_nope_dim = 6, c.mla_v_dim = 8;
        kiln_gpt_config plain = c;
        plain.mla_kv_rank = 0;
        kiln_gpt_t *a, *b;
        assert_int_equal(kiln_gpt_new(&c, 1, &a), KILN_OK);
        assert_int_equal(kiln_gpt_new(&plain, 1, &b), KILN_OK);
        assert_int_equal(kiln_kv_pool_block_bytes(a, 16, KILN_DTYPE_F32), 2 * 16 * 14 * 4);
        assert_int_equal(kiln_kv_pool_block_bytes(b, 16, KILN_DTYPE_F32), 2 * 16 * 2 * 2 * 8 * 4);
        kiln_gpt_free(a);
        kiln_gpt_free(b);
    }
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 13, &m), KILN_OK);
    enum { T = 12, BL = 4, MB = 3 };
    int32_t toks[T];
    for (int i = 0; i < T; i++) toks[i] = (i * 5 + 1) % c.vocab_size;
    int64_t ts[2] = {1, T};
    float *want = to_host(kiln_gpt_forward(m, kiln_from_data(toks, ts, 2, KILN_DTYPE_I32), NULL, false, NULL));
    kiln_kv_pool_t *p;
    assert_int_equal(kiln_kv_pool_new(m, 12, BL, KILN_DTYPE_F32, &p), KILN_OK);
    int32_t table[4 * MB] = {5, 2, 7, 0, 1, 3, 4, 6, 8, 9, 10, 11};
    int32_t sq[T] = {0}, ps[T], lr[T];
    for (int i = 0; i < T; i++) ps[i] = i, lr[i] = i;
    kiln_scope_begin();
    kiln_paged_batch b = {T, toks, sq, ps, 1, MB, table, T, lr};
    float *got = to_host(kiln_gpt_forward_paged(m, p, &b));
    kiln_scope_end();
    assert_close(got, want, (int64_t)T * c.vocab_size, mla ? 1e-4 : 2e-5,
                 mla ? "paged forward of an MLA + MoE model" : "paged forward of an MoE model");
    /* one more position of sequence 0 alone, then with sequences 1..3 prefilled beside it */
    for (int s = 1; s < 4; s++) {
        int32_t pt[T], psq[T];
        for (int i = 0; i < T; i++) pt[i] = (i * 3 + s) % c.vocab_size, psq[i] = s;
        kiln_scope_begin();
        kiln_paged_batch pre = {8, pt, psq, ps, 4, MB, table, 0, NULL};
        assert_non_null(kiln_gpt_forward_paged(m, p, &pre));
        kiln_scope_end();
    }
    float *alone = NULL;
    for (int n = 1; n <= 4; n++) {
        int32_t dt[4], ds[4], dp[4], one[1] = {0};
        for (int s = 0; s < n; s++) dt[s] = (s * 7 + 2) % c.vocab_size, ds[s] = s, dp[s] = s ? 8 : T - 1;
        kiln_scope_begin();
        kiln_paged_batch d = {n, dt, ds, dp, 4, MB, table, 1, one};
        float *h = to_host(kiln_gpt_forward_paged(m, p, &d));
        kiln_scope_end();
        if (!alone) alone = h;
        else {
            assert_memory_equal(h, alone, sizeof(float) * (size_t)c.vocab_size);
            free(h);
        }
    }
    free(alone), free(got), free(want);
    kiln_kv_pool_free(p);
    kiln_gpt_free(m);
}

static void paged_forward_runs_moe_models(void **state)
{
    paged_moe_case(false);
    paged_moe_case(true);
}

static void paged_forward_runs_attention_variants(void **state)
{
    paged_variant_case(false, "window:5", 5);
    paged_variant_case(true, "window:6", 6);
    paged_variant_case(true, "window:7+softcap:3", 7);
    paged_variant_case(false, "alibi+window:6+softcap:2", 6);
    paged_variant_case(false, "softcap:2+alibi", 0);
    paged_variant_case(true, "doc:5+window:8+window:5", 5); /* doc is left out, as with any KV cache */
    /* prefix-LM: refused, naming why */
    kiln_gpt_config c = tiny(false);
    snprintf(c.attention, sizeof c.attention, "prefix:3");
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 9, &m), KILN_OK);
    kiln_kv_pool_t *p;
    assert_int_equal(kiln_kv_pool_new(m, 4, 4, KILN_DTYPE_F32, &p), KILN_OK);
    int32_t tok[1] = {1}, zero[1] = {0}, table[4] = {0, 1, 2, 3};
    kiln_paged_batch b = {1, tok, zero, zero, 1, 4, table, 1, zero};
    assert_null(kiln_gpt_forward_paged(m, p, &b));
    assert_int_equal(kiln_last_status(), KILN_ERR_UNSUPPORTED);
    assert_non_null(strstr(kiln_last_error(), "prefix"));
    kiln_clear_error();
    kiln_kv_pool_free(p);
    kiln_gpt_free(m);
}

/* One decode step of sequence 0 alone, then the same step batched with 1..5 others at
 * other positions: its logits must be bitwise the same, with f32 and with bf16 weights. */
static void batch_invariant_case(kiln_dtype weights, kiln_weight_quant quant)
{
    kiln_gpt_config c = tiny(true);
    /* Wide enough that the BLAS's one-row (GEMV) path would round differently. */
    c.n_embd = 256;
    c.n_head = 4;
    c.vocab_size = 300;
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 3, &m), KILN_OK);
    kiln_kv_pool_t *p;
    enum { S = 6, BL = 4, MB = 6 };
    assert_int_equal(kiln_kv_pool_new_quant(m, S * MB, BL, KILN_DTYPE_F32, weights, quant, &p), KILN_OK);
    int32_t table[S * MB];
    for (int i = 0; i < S * MB; i++) table[i] = (i * 5) % (S * MB);
    /* Prefill 10 positions of every sequence. */
    int32_t tk[S * 10], sq[S * 10], ps[S * 10], lr[1] = {0};
    for (int s = 0; s < S; s++)
        for (int i = 0; i < 10; i++) {
            tk[s * 10 + i] = (s * 13 + i * 3) % c.vocab_size;
            sq[s * 10 + i] = s;
            ps[s * 10 + i] = i;
        }
    kiln_paged_batch pre = {S * 10, tk, sq, ps, S, MB, table, 1, lr};
    assert_non_null(kiln_gpt_forward_paged(m, p, &pre));
    float *alone = NULL;
    for (int n = 1; n <= S; n++) {
        int32_t dt[S], ds[S], dp[S], one[1] = {0};
        for (int s = 0; s < n; s++) {
            dt[s] = (s + 1) % c.vocab_size;
            ds[s] = s;
            dp[s] = 10;
        }
        kiln_scope_begin();
        kiln_paged_batch b = {n, dt, ds, dp, S, MB, table, 1, one};
        float *h = to_host(kiln_gpt_forward_paged(m, p, &b));
        kiln_scope_end();
        if (!alone) alone = h;
        else {
            assert_memory_equal(h, alone, sizeof(float) * (size_t)c.vocab_size);
            free(h);
        }
    }
    free(alone);
    kiln_kv_pool_free(p);
    kiln_gpt_free(m);
}

static void paged_forward_is_batch_invariant(void **state)
{
    batch_invariant_case(KILN_DTYPE_F32, KILN_WEIGHT_QUANT_NONE);
    batch_invariant_case(KILN_DTYPE_BF16, KILN_WEIGHT_QUANT_NONE);
    batch_invariant_case(KILN_DTYPE_F16, KILN_WEIGHT_QUANT_NONE);
    batch_invariant_case(KILN_DTYPE_F32, KILN_WEIGHT_QUANT_Q8_0);
}

/* A model whose linear weights are stored in bf16 or f16 (kiln_gpt_store_linear, what
 * kiln serve --weights bf16|f16 does) decodes bitwise as the f32 model through a pool of
 * weights packed in that type (the same rounding, once), and its full forward runs (in
 * that type, autocast) within its tolerance of the f32 model's. Oracle: the f32 model. */
static void stored_weights_case(kiln_dtype wt, double tol)
{
    kiln_gpt_config c = tiny(true);
    kiln_gpt_t *m, *h;
    assert_int_equal(kiln_gpt_new(&c, 5, &m), KILN_OK);
    assert_int_equal(kiln_gpt_new(&c, 5, &h), KILN_OK);
    int64_t before = 0, after = 0;
    for (int i = 0; i < kiln_gpt_num_params(h); i++) before += kiln_tensor_nbytes(kiln_gpt_param(h, i, NULL));
    assert_int_equal(kiln_gpt_store_linear(h, wt), KILN_OK);
    for (int i = 0; i < kiln_gpt_num_params(h); i++) after += kiln_tensor_nbytes(kiln_gpt_param(h, i, NULL));
    assert_true(after < before);
    assert_int_equal(kiln_gpt_precision(h), wt);
    assert_int_equal(kiln_tensor_dtype(kiln_gpt_find_param(h, "blocks.0.attn.qkv.weight")), wt);
    kiln_kv_pool_t *pm, *ph;
    assert_int_equal(kiln_kv_pool_new_typed(m, 8, 4, KILN_DTYPE_F32, wt, &pm), KILN_OK);
    assert_int_equal(kiln_kv_pool_new_typed(h, 8, 4, KILN_DTYPE_F32, wt, &ph), KILN_OK);
    enum { T = 6 };
    int32_t tk[T], sq[T], ps[T], lr[1] = {T - 1}, table[8] = {3, 1, 0, 2, 4, 5, 6, 7};
    for (int i = 0; i < T; i++) {
        tk[i] = (i * 5 + 1) % c.vocab_size;
        sq[i] = 0;
        ps[i] = i;
    }
    kiln_paged_batch b = {T, tk, sq, ps, 1, 8, table, 1, lr};
    float *a = to_host(kiln_gpt_forward_paged(m, pm, &b)), *g = to_host(kiln_gpt_forward_paged(h, ph, &b));
    assert_memory_equal(a, g, sizeof(float) * (size_t)c.vocab_size);
    int64_t ts[2] = {1, T};
    kiln_tensor_t *idx = kiln_from_data(tk, ts, 2, KILN_DTYPE_I32);
    float *want = to_host(kiln_cast(kiln_gpt_forward(m, idx, NULL, false, NULL), KILN_DTYPE_F32));
    float *got = to_host(kiln_cast(kiln_gpt_forward(h, idx, NULL, false, NULL), KILN_DTYPE_F32));
    assert_close(got, want, (int64_t)T * c.vocab_size, tol, "forward with 16-bit linear weights vs f32");
    kiln_kv_cache_t *kc; /* and the cached forward runs in the model's precision too */
    assert_int_equal(kiln_kv_cache_new(h, 1, &kc), KILN_OK);
    kiln_tensor_t *lc = kiln_gpt_forward_cached(h, kc, idx);
    if (!lc) fail_msg("forward_cached with %s linear weights: %s", kiln_dtype_name(wt), kiln_last_error());
    kiln_kv_cache_free(kc);
    free(a);
    free(g);
    free(want);
    free(got);
    kiln_kv_pool_free(pm);
    kiln_kv_pool_free(ph);
    kiln_gpt_free(m);
    kiln_gpt_free(h);
}

static void stored_16bit_weights_decode_as_packed(void **state)
{
    stored_weights_case(KILN_DTYPE_BF16, 8 * 0x1p-8);
    stored_weights_case(KILN_DTYPE_F16, 8 * 0x1p-11);
}

static void paged_forward_rejects_bad_batches(void **state)
{
    kiln_gpt_config c = tiny(false);
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 1, &m), KILN_OK);
    kiln_kv_pool_t *p;
    assert_int_equal(kiln_kv_pool_new(m, 4, 4, KILN_DTYPE_F32, &p), KILN_OK);
    int32_t table[2] = {0, 1}, tk[1] = {3}, sq[1] = {0}, ps[1] = {2}, lr[1] = {0};
    kiln_paged_batch b = {1, tk, sq, ps, 1, 2, table, 1, lr};
    assert_non_null(kiln_gpt_forward_paged(m, p, &b));
    tk[0] = 50;
    assert_null(kiln_gpt_forward_paged(m, p, &b));
    assert_non_null(strstr(kiln_last_error(), "vocabulary"));
    tk[0] = 3;
    ps[0] = 8; /* past the 2 blocks of the table */
    assert_null(kiln_gpt_forward_paged(m, p, &b));
    assert_non_null(strstr(kiln_last_error(), "position 8"));
    ps[0] = 2;
    table[0] = 4;
    assert_null(kiln_gpt_forward_paged(m, p, &b));
    assert_non_null(strstr(kiln_last_error(), "block 4"));
    kiln_clear_error();
    assert_int_equal(kiln_kv_pool_new(m, 0, 4, KILN_DTYPE_F32, &(kiln_kv_pool_t *){0}), KILN_ERR_ARG);
    kiln_clear_error();
    kiln_kv_pool_free(p);
    kiln_gpt_free(m);
}

/* copy_block duplicates every layer's block: the forward over the copy attends the same. */
static void copy_block_copies_keys_and_values(void **state)
{
    kiln_gpt_config c = tiny(true);
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 5, &m), KILN_OK);
    kiln_kv_pool_t *p;
    assert_int_equal(kiln_kv_pool_new(m, 4, 4, KILN_DTYPE_F32, &p), KILN_OK);
    int32_t tk[5] = {1, 2, 3, 4, 5}, sq[5] = {0, 0, 0, 0, 0}, ps[5] = {0, 1, 2, 3, 4}, lr[1] = {4};
    int32_t t0[2] = {0, 1}, t1[2] = {2, 3};
    kiln_paged_batch b = {5, tk, sq, ps, 1, 2, t0, 1, lr};
    float *a = to_host(kiln_gpt_forward_paged(m, p, &b));
    assert_int_equal(kiln_kv_pool_copy_block(p, 2, 0), KILN_OK);
    assert_int_equal(kiln_kv_pool_copy_block(p, 3, 1), KILN_OK);
    /* Recompute only the last position over the copied blocks. */
    int32_t lr0[1] = {0};
    kiln_paged_batch d = {1, tk + 4, sq, ps + 4, 1, 2, t1, 1, lr0};
    float *bb = to_host(kiln_gpt_forward_paged(m, p, &d));
    assert_memory_equal(a, bb, sizeof(float) * (size_t)c.vocab_size);
    assert_int_equal(kiln_kv_pool_copy_block(p, 4, 0), KILN_ERR_ARG);
    kiln_clear_error();
    free(a);
    free(bb);
    kiln_kv_pool_free(p);
    kiln_gpt_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(rope_at_matches_rope, setup, teardown),
        cmocka_unit_test_setup_teardown(matmul_rows_matches_matmul_and_is_row_invariant, setup, teardown),
        cmocka_unit_test_setup_teardown(matmul_rows_packed_matches_matmul_and_is_row_invariant, setup, teardown),
        cmocka_unit_test_setup_teardown(index_copy_writes_the_named_rows, setup, teardown),
        cmocka_unit_test_setup_teardown(paged_attention_matches_attention, setup, teardown),
        cmocka_unit_test_setup_teardown(paged_forward_matches_full_forward_gpt2, setup, teardown),
        cmocka_unit_test_setup_teardown(paged_forward_matches_full_forward_llama, setup, teardown),
        cmocka_unit_test_setup_teardown(paged_forward_matches_full_forward_qk_norm, setup, teardown),
        cmocka_unit_test_setup_teardown(paged_forward_runs_attention_variants, setup, teardown),
        cmocka_unit_test_setup_teardown(paged_forward_runs_moe_models, setup, teardown),
        cmocka_unit_test_setup_teardown(paged_forward_is_batch_invariant, setup, teardown),
        cmocka_unit_test_setup_teardown(stored_16bit_weights_decode_as_packed, setup, teardown),
        cmocka_unit_test_setup_teardown(paged_forward_rejects_bad_batches, setup, teardown),
        cmocka_unit_test_setup_teardown(copy_block_copies_keys_and_values, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
