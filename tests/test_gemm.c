/* kiln's own GEMM (src/backends/cpu/gemm.h) against a float64 reference.
 *
 * Oracle: C = A B summed in double over the same operand values (bf16-rounded where
 * the product is formed in bf16, since that rounding is the definition of the bf16
 * GEMM). Tolerance: the standard bound for a sum of K products in f32,
 * |error| <= 2 K u sum_k |a_ik b_kj| with u = 2^-24, which grows with K as it should.
 * Every micro-kernel this processor runs is checked, on shapes around the tile sizes
 * (1, 7, 63, 65, ...), with K over several KC blocks and odd K, in the layouts training
 * uses (A B, A B^T, A^T B), with padded leading dimensions, and accumulating into C.
 * Then bitwise: a row's result does not depend on the other rows, nor a column's on
 * the other columns (so not on how the threads split the work either), and a bf16
 * result is the same sums rounded once. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/opts.h"
#include "kiln/kiln.h"
#include "backends/cpu/cpu.h"
#include "backends/cpu/gemm.h"
#include "core/threadpool.h"

static const kiln__gemm_isa ISAS[] = {KILN__GEMM_ISA_C, KILN__GEMM_ISA_AVX2, KILN__GEMM_ISA_AVX512,
                                      KILN__GEMM_ISA_AVX512BF16, KILN__GEMM_ISA_AMX, KILN__GEMM_ISA_AUTO};
static const char *const ISA_NAMES[] = {"c", "avx2", "avx512", "avx512-bf16", "amx", "auto"};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float uniform(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

/* A rows x cols matrix stored with row stride rs and column stride cs (one of them 1,
 * the other at least the matrix's width), in f32 or in bf16. */
typedef struct {
    int64_t rows, cols, rs, cs;
    kiln__gemm_type type;
    void *data;
} mat;

static mat mat_new(int64_t rows, int64_t cols, bool transposed, int64_t pad, kiln__gemm_type type)
{
    mat m = {rows, cols, transposed ? 1 : cols + pad, transposed ? rows + pad : 1, type, NULL};
    size_t n = (size_t)(transposed ? cols * (rows + pad) : rows * (cols + pad));
    m.data = calloc(n ? n : 1, type == KILN__GEMM_F32 ? 4 : 2);
    assert_non_null(m.data);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            float v = uniform();
            if (type == KILN__GEMM_F32) ((float *)m.data)[i * m.rs + j * m.cs] = v;
            else if (type == KILN__GEMM_F16) ((uint16_t *)m.data)[i * m.rs + j * m.cs] = kiln__f32_to_f16(v);
            else ((uint16_t *)m.data)[i * m.rs + j * m.cs] = kiln__f32_to_bf16(v);
        }
    return m;
}

static double at(const mat *m, int64_t i, int64_t j, bool round_bf16)
{
    int64_t o = i * m->rs + j * m->cs;
    const uint16_t *h = m->data;
    float v = m->type == KILN__GEMM_F32    ? ((float *)m->data)[o]
              : m->type == KILN__GEMM_F16 ? kiln__f16_to_f32(h[o])
                                          : kiln__bf16_to_f32(h[o]);
    return round_bf16 ? kiln__bf16_to_f32(kiln__f32_to_bf16(v)) : v;
}

static kiln__gemm_operand operand(const mat *m) { return (kiln__gemm_operand){m->data, m->type, m->rs, m->cs}; }

/* Checks one product against the double reference; returns false when this processor
 * lacks the kernel. */
static bool check(kiln__gemm_isa isa, const char *isa_name, int64_t M, int64_t N, int64_t K, bool at_, bool bt,
                  kiln__gemm_type in_type, kiln__gemm_type compute, bool accumulate)
{
    mat A = mat_new(M, K, at_, 3, in_type), B = mat_new(K, N, bt, 5, in_type);
    int64_t ldc = N + 2;
    float *C = malloc(sizeof(float) * (size_t)(M * ldc + 1));
    double *C0 = malloc(sizeof(double) * (size_t)(M * ldc + 1));
    assert_non_null(C);
    assert_non_null(C0);
    for (int64_t i = 0; i < M * ldc; i++) C0[i] = C[i] = uniform();
    bool ran = kiln__gemm_with(isa, M, N, K, operand(&A), operand(&B), C, ldc, accumulate, compute);
    if (ran) {
        bool rb = compute == KILN__GEMM_BF16;
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double ref = accumulate ? C0[i * ldc + j] : 0.0, mag = fabs(ref);
                for (int64_t k = 0; k < K; k++) {
                    double p = at(&A, i, k, rb) * at(&B, k, j, rb);
                    ref += p;
                    mag += fabs(p);
                }
                double tol = 2.0 * (double)(K + 1) * 0x1p-24 * mag + 1e-30;
                if (!(fabs(C[i * ldc + j] - ref) <= tol))
                    fail_msg("%s %s M=%lld N=%lld K=%lld A%s B%s acc=%d: C[%lld,%lld] = %.9g, reference %.9g, "
                             "tolerance %.3g", isa_name, rb ? "bf16" : "f32", (long long)M, (long long)N,
                             (long long)K, at_ ? "^T" : "", bt ? "^T" : "", accumulate, (long long)i, (long long)j,
                             C[i * ldc + j], ref, tol);
            }
        /* The padding between rows of C is not written. */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = N; j < ldc; j++) assert_true(C[i * ldc + j] == (float)C0[i * ldc + j]);
    }
    free(A.data);
    free(B.data);
    free(C);
    free(C0);
    return ran;
}

static void test_every_kernel_matches_double_reference(void **state)
{
    (void)state;
    static const int64_t sizes[][3] = {{1, 1, 1},   {7, 7, 7},    {1, 65, 63},  {63, 65, 7},   {65, 63, 64},
                                       {13, 33, 1}, {24, 64, 256}, {37, 100, 600}, {130, 70, 65}, {5, 300, 257},
                                       /* K-outer items (KILN_OPT_GEMM_K_OUTER) at up to 2 threads: 5 K
                                        * blocks, a last short one, partial panels, edge rows */
                                       {150, 70, 1100},
                                       /* B wider than a round (KILN_OPT_GEMM_NARROW_ROUNDS: 1024 f32
                                        * or 2048 bf16 packed columns), a short last round */
                                       {9, 2200, 70},
                                       /* K-outer with B wider than A is tall: at 2-3 threads its
                                        * panels split between them (KILN_OPT_GEMM_K_OUTER_PANELS) */
                                       {150, 300, 1100}};
    for (size_t s = 0; s < sizeof ISAS / sizeof ISAS[0]; s++) {
        int ran = 0, cases = 0;
        for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++)
            for (int layout = 0; layout < 3; layout++)
                for (int ty = 0; ty < 3; ty++) { /* f32, bf16, f16 operands with f32 products */
                    int64_t M = sizes[z][0], N = sizes[z][1], K = sizes[z][2];
                    bool a_t = layout == 2, b_t = layout == 1, acc = (z + (size_t)layout) % 2 == 1;
                    kiln__gemm_type compute = ty == 1 ? KILN__GEMM_BF16 : KILN__GEMM_F32;
                    kiln__gemm_type in = ty == 2 ? KILN__GEMM_F16 : ty && z % 2 ? KILN__GEMM_BF16 : KILN__GEMM_F32;
                    ran += check(ISAS[s], ISA_NAMES[s], M, N, K, a_t, b_t, in, compute, acc);
                    cases++;
                }
        printf("kernel %s: %d of %d cases ran here\n", ISA_NAMES[s], ran, cases);
        /* The plain C kernels and the best available one run everywhere. */
        if (ISAS[s] == KILN__GEMM_ISA_C || ISAS[s] == KILN__GEMM_ISA_AUTO) assert_int_equal(ran, cases);
    }
}

static void test_zero_k_and_empty(void **state)
{
    (void)state;
    float C[6] = {1, 2, 3, 4, 5, 6}, A[1] = {0}, B[1] = {0};
    kiln__gemm_operand a = {A, KILN__GEMM_F32, 1, 1}, b = {B, KILN__GEMM_F32, 1, 1};
    assert_true(kiln__gemm(2, 3, 0, a, b, C, 3, true, KILN__GEMM_F32));
    assert_true(C[0] == 1 && C[5] == 6); /* C += nothing */
    assert_true(kiln__gemm(2, 3, 0, a, b, C, 3, false, KILN__GEMM_F32));
    for (int i = 0; i < 6; i++) assert_true(C[i] == 0.0f);
    assert_true(kiln__gemm(0, 3, 5, a, b, C, 3, false, KILN__GEMM_F32));
}

/* Row i of one GEMM over M rows equals, bit for bit, the GEMM of row i alone, and a
 * block of columns equals the GEMM over just those columns. */
static void test_rows_and_columns_do_not_depend_on_the_rest(void **state)
{
    (void)state;
    const int64_t M = 41, N = 150, K = 300;
    for (size_t s = 0; s < sizeof ISAS / sizeof ISAS[0]; s++)
        for (int ty = 0; ty < 2; ty++) {
            kiln__gemm_type compute = ty ? KILN__GEMM_BF16 : KILN__GEMM_F32;
            mat A = mat_new(M, K, false, 0, KILN__GEMM_F32), B = mat_new(K, N, true, 0, KILN__GEMM_F32);
            float *C = calloc((size_t)(M * N), sizeof(float)), *R = calloc((size_t)N, sizeof(float));
            assert_non_null(C);
            assert_non_null(R);
            if (!kiln__gemm_with(ISAS[s], M, N, K, operand(&A), operand(&B), C, N, false, compute)) goto next;
            for (int64_t i = 0; i < M; i++) {
                kiln__gemm_operand row = {(float *)A.data + i * A.rs, KILN__GEMM_F32, A.rs, A.cs};
                assert_true(kiln__gemm_with(ISAS[s], 1, N, K, row, operand(&B), R, N, false, compute));
                if (memcmp(R, C + i * N, sizeof(float) * (size_t)N))
                    fail_msg("%s %s: row %lld alone differs from the batch", ISA_NAMES[s], ty ? "bf16" : "f32",
                             (long long)i);
            }
            for (int64_t j0 = 0; j0 < N; j0 += 37) {
                int64_t w = N - j0 < 37 ? N - j0 : 37;
                float *P = calloc((size_t)(M * w), sizeof(float));
                assert_non_null(P);
                kiln__gemm_operand cols = {(float *)B.data + j0 * B.cs, KILN__GEMM_F32, B.rs, B.cs};
                assert_true(kiln__gemm_with(ISAS[s], M, w, K, operand(&A), cols, P, w, false, compute));
                for (int64_t i = 0; i < M; i++)
                    if (memcmp(P + i * w, C + i * N + j0, sizeof(float) * (size_t)w))
                        fail_msg("%s: columns %lld.. alone differ from the full product", ISA_NAMES[s],
                                 (long long)j0);
                free(P);
            }
        next:
            free(A.data);
            free(B.data);
            free(C);
            free(R);
        }
}

/* A product wider than one round of packed columns (KILN_OPT_GEMM_NARROW_ROUNDS: a K
 * block of a round's B at most 1 MiB, 1024 f32 or 2048 bf16 columns; else 4096) sums
 * each element as a narrow product does, bit for bit: blocks of columns that straddle
 * the rounds' edges (1024, 2048, 4096), computed alone in one round, against the same
 * columns of the 4400-column product, on every kernel, f32 and bf16, B as itself and
 * transposed, K over two blocks. */
static void test_wide_products_sum_as_their_column_blocks(void **state)
{
    (void)state;
    const int64_t M = 20, N = 4400, K = 300;
    const int64_t blocks[][2] = {{1000, 50}, {2030, 40}, {4090, 300}};
    for (size_t s = 0; s < sizeof ISAS / sizeof ISAS[0]; s++)
        for (int ty = 0; ty < 2; ty++)
            for (int bt = 0; bt < 2; bt++) {
                kiln__gemm_type compute = ty ? KILN__GEMM_BF16 : KILN__GEMM_F32;
                mat A = mat_new(M, K, false, 0, KILN__GEMM_F32), B = mat_new(K, N, bt, 0, KILN__GEMM_F32);
                float *C = malloc(sizeof(float) * (size_t)(M * N));
                assert_non_null(C);
                if (kiln__gemm_with(ISAS[s], M, N, K, operand(&A), operand(&B), C, N, false, compute))
                    for (int b = 0; b < 3; b++) {
                        int64_t j0 = blocks[b][0], w = blocks[b][1];
                        float *P = malloc(sizeof(float) * (size_t)(M * w));
                        assert_non_null(P);
                        kiln__gemm_operand cols = {(float *)B.data + j0 * B.cs, KILN__GEMM_F32, B.rs, B.cs};
                        assert_true(kiln__gemm_with(ISAS[s], M, w, K, operand(&A), cols, P, w, false, compute));
                        for (int64_t i = 0; i < M; i++)
                            if (memcmp(P + i * w, C + i * N + j0, sizeof(float) * (size_t)w))
                                fail_msg("%s %s B%s: columns %lld..%lld alone differ from the %lld-column product",
                                         ISA_NAMES[s], ty ? "bf16" : "f32", bt ? "^T" : "", (long long)j0,
                                         (long long)(j0 + w), (long long)N);
                        free(P);
                    }
                free(A.data);
                free(B.data);
                free(C);
            }
}

/* The K-outer items (few rows, many K blocks: each packs its K block of B itself) sum as
 * the row blocks over B packed whole do, bit for bit: rows of a product with M above
 * K/2 (the usual path) against the same rows alone: 100 of them on the calling thread
 * (kiln__gemm_f32_serial, K-outer at any pool size, alpha 1 and 0.5) and 72 a pool
 * thread over the pool (K-outer with kernels of up to 12 rows), on every f32 kernel, A
 * as itself, transposed, and with rows 6 KiB apart (copied row by row); N 4200 is two
 * rounds of columns, and groups of panels. The result buffer starts as NaNs. */
static void k_outer_case(size_t s, int at_, int64_t N, int64_t pad, float alpha)
{
    const int64_t M = 600, K = 1100, pooled = 72 * (kiln__pool_size() > 0 ? kiln__pool_size() : 1);
    mat A = mat_new(M, K, at_, pad, KILN__GEMM_F32), B = mat_new(K, N, false, 3, KILN__GEMM_F32);
    float *C = calloc((size_t)(M * N), sizeof(float)), *R = malloc(sizeof(float) * (size_t)(M * N));
    assert_true(C && R);
    bool serial = ISAS[s] == KILN__GEMM_ISA_AUTO; /* kiln__gemm_f32_serial runs the chosen kernel */
    bool ran = serial ? kiln__gemm_f32_serial(M, N, K, operand(&A), operand(&B), alpha, 0, C, N)
                      : alpha == 1 && kiln__gemm_with(ISAS[s], M, N, K, operand(&A), operand(&B), C, N, false,
                                                      KILN__GEMM_F32);
    const int64_t parts[][2] = {{0, pooled}, {300, 100}, {500, 100}};
    for (int f = 0; ran && f < 3; f++) {
        int64_t first = parts[f][0], rows = parts[f][1];
        if (rows == pooled && (pooled > K / 2 || alpha != 1)) continue; /* a pool too large to take K-outer */
        if (rows != pooled && !serial) continue;
        for (int64_t x = 0; x < rows * N; x++) R[x] = NAN;
        kiln__gemm_operand part = {(float *)A.data + first * A.rs, KILN__GEMM_F32, A.rs, A.cs};
        if (rows == pooled) assert_true(kiln__gemm_with(ISAS[s], rows, N, K, part, operand(&B), R, N, false, KILN__GEMM_F32));
        else assert_true(kiln__gemm_f32_serial(rows, N, K, part, operand(&B), alpha, 0, R, N));
        if (memcmp(R, C + first * N, sizeof(float) * (size_t)(rows * N)))
            fail_msg("%s A%s (row stride %lld) N %lld alpha %g: rows %lld.. (%lld of them, K-outer) differ from the "
                     "same rows of the %lld-row product", ISA_NAMES[s], at_ ? "^T" : "", (long long)(at_ ? A.cs : A.rs),
                     (long long)N, alpha, (long long)first, (long long)rows, (long long)M);
    }
    free(A.data);
    free(B.data);
    free(C);
    free(R);
}

static void test_k_outer_sums_as_the_row_blocks(void **state)
{
    (void)state;
    for (size_t s = 0; s < sizeof ISAS / sizeof ISAS[0]; s++)
        for (int at_ = 0; at_ < 2; at_++) k_outer_case(s, at_, 100, 2, 1.0f);
    size_t auto_ = sizeof ISAS / sizeof ISAS[0] - 1;
    k_outer_case(auto_, 0, 4200, 2, 1.0f);
    k_outer_case(auto_, 0, 800, 1536 - 1100, 1.0f); /* rows 6 KiB apart */
    k_outer_case(auto_, 1, 800, 2, 0.5f);
}

/* The oracle's f32 copy of an f16 matrix (kiln__f16_to_f32 of each element). */
static mat widened(const mat *m)
{
    mat w = *m;
    w.type = KILN__GEMM_F32;
    size_t n = (size_t)(m->rs == 1 ? m->cols * m->cs : m->rows * m->rs);
    w.data = malloc(sizeof(float) * (n ? n : 1));
    assert_non_null(w.data);
    for (size_t i = 0; i < n; i++) ((float *)w.data)[i] = kiln__f16_to_f32(((uint16_t *)m->data)[i]);
    return w;
}

/* A 16-bit result is, bit for bit, the f32 GEMM's sums rounded once: bf16
 * (kiln__gemm_bf16) the sums of the bf16 kernel on the same operands (checked against
 * double above); f16 (kiln__gemm_f16, f16 operands widened as they are packed) the sums
 * of the f32 path on the operands' f32 widenings. For every kernel that runs, on shapes
 * whose rows or columns are split among work items and threads, A, B or neither
 * transposed, with a padded row stride whose padding stays untouched; K = 0 gives
 * zeros. */
static void half_results(kiln__gemm_type half)
{
    static const int64_t sizes[][3] = {{1, 1, 1},     {7, 65, 63},   {65, 63, 300}, {3, 700, 70},
                                       {300, 40, 33}, {70, 5000, 40}, {96, 70, 64},  {64, 33, 544}};
    const uint16_t marker = half == KILN__GEMM_BF16 ? 0x7fc1 : 0x7e01; /* NaNs */
    for (size_t s = 0; s < sizeof ISAS / sizeof ISAS[0]; s++)
        for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++)
            for (int layout = 0; layout < 3; layout++) {
                int64_t M = sizes[z][0], N = sizes[z][1], K = sizes[z][2], ldc = N + 3;
                mat A = mat_new(M, K, layout == 2, 1, half), B = mat_new(K, N, layout == 1, 2, half);
                bool f16 = half == KILN__GEMM_F16;
                mat A32 = f16 ? widened(&A) : A, B32 = f16 ? widened(&B) : B;
                float *C = malloc(sizeof(float) * (size_t)(M * N));
                uint16_t *H = malloc(sizeof(uint16_t) * (size_t)(M * ldc));
                assert_non_null(C);
                assert_non_null(H);
                for (int64_t i = 0; i < M * ldc; i++) H[i] = marker;
                if (kiln__gemm_with(ISAS[s], M, N, K, operand(&A32), operand(&B32), C, N, false, f16 ? KILN__GEMM_F32 : half)) {
                    for (int q = 0; q < 2; q++) { /* K, then 0 */
                        int k = q ? 0 : (int)K;
                        assert_true(f16 ? kiln__gemm_f16_with(ISAS[s], M, N, k, operand(&A), operand(&B), H, ldc)
                                        : kiln__gemm_bf16_with(ISAS[s], M, N, k, operand(&A), operand(&B), H, ldc));
                        for (int64_t i = 0; i < M; i++)
                            for (int64_t j = 0; j < ldc; j++) {
                                uint16_t want = j >= N ? marker : k == 0 ? 0
                                                : f16   ? kiln__f32_to_f16(C[i * N + j])
                                                        : kiln__f32_to_bf16(C[i * N + j]);
                                if (H[i * ldc + j] != want)
                                    fail_msg("%s %s M=%lld N=%lld K=%d layout %d: C[%lld,%lld] = 0x%04x, want 0x%04x",
                                             f16 ? "f16" : "bf16", ISA_NAMES[s], (long long)M, (long long)N, k, layout,
                                             (long long)i, (long long)j, H[i * ldc + j], want);
                            }
                    }
                }
                if (f16) {
                    free(A32.data);
                    free(B32.data);
                }
                free(A.data);
                free(B.data);
                free(C);
                free(H);
            }
}

static void test_bf16_result_is_the_sums_rounded_once(void **state) { half_results(KILN__GEMM_BF16); }
static void test_f16_result_is_the_widened_sums_rounded_once(void **state) { half_results(KILN__GEMM_F16); }

/* The epilogue of kiln__gemm_bf16_epilogue: each call's rows are already rounded (the
 * same bits as kiln__gemm_bf16's), and every row comes exactly once, when an item holds
 * whole rows (N within one round, M with rows for every thread; a product with an
 * epilogue keeps one round up to 4096 columns, where one without takes rounds of 1024);
 * with N above 4096 it is not called and done stays false. */
typedef struct {
    const uint16_t *want;
    int64_t N;
    int *seen;
    bool bad;
} epi_probe;

static void epi_check(const kiln__epilogue *e, int64_t r0, int64_t r1)
{
    epi_probe *p = e->ctx;
    const uint16_t *C = e->out;
    for (int64_t r = r0; r < r1; r++) {
        __atomic_add_fetch(&p->seen[r], 1, __ATOMIC_RELAXED);
        if (memcmp(C + r * p->N, p->want + r * p->N, 2 * (size_t)p->N)) p->bad = true; /* set only, never cleared */
    }
}

static void test_bf16_epilogue_sees_each_rounded_row_once(void **state)
{
    int64_t nt = kiln_num_threads() > 0 ? kiln_num_threads() : 1;
    /* (3000 columns, K 300: one round, as an epilogue needs, where a product without one
     * takes three of 1024) */
    const int64_t shapes[][3] = {{512 * nt, 96, 40}, {512 * nt, 1000, 70}, {64 * nt, 3000, 300}, {64 * nt, 4100, 16}};
    for (int z = 0; z < 4; z++) {
        int64_t M = shapes[z][0], N = shapes[z][1], K = shapes[z][2];
        mat A = mat_new(M, K, false, 3, KILN__GEMM_BF16), B = mat_new(K, N, true, 4, KILN__GEMM_BF16);
        uint16_t *want = malloc(2 * (size_t)(M * N)), *got = malloc(2 * (size_t)(M * N));
        int *seen = calloc((size_t)M, sizeof *seen);
        assert_true(want && got && seen);
        assert_true(kiln__gemm_bf16(M, N, K, operand(&A), operand(&B), want, N));
        epi_probe p = {want, N, seen, false};
        kiln__epilogue e = {.rows = M, .cols = N, .fn = epi_check, .ctx = &p, .out = got};
        assert_true(kiln__gemm_bf16_epilogue(M, N, K, operand(&A), operand(&B), got, N, &e));
        assert_memory_equal(got, want, 2 * (size_t)(M * N));
        if (N > 4096) {
            assert_false(e.done);
            for (int64_t r = 0; r < M; r++) assert_int_equal(seen[r], 0);
        } else {
            assert_true(e.done);
            for (int64_t r = 0; r < M; r++) assert_int_equal(seen[r], 1);
            assert_false(p.bad);
        }
        free(A.data);
        free(B.data);
        free(want);
        free(got);
        free(seen);
    }
}

/* kiln__cpu_sgemm, the f32 product of attention's tiles, is cblas_sgemm's C = alpha op(A)
 * op(B) + beta C (row-major, beta 0 or 1, padded leading dims), against the double
 * reference with the bound above (over |alpha| sum |a b| + |beta c|); bitwise the same
 * whether called from a pool task or outside one (its sums do not depend on the pool);
 * and bitwise the product of the GEMM the switches name: kiln__gemm_f32_serial where
 * KILN_OPT_OWN_GEMM and KILN_OPT_POOL_GEMM are on, cblas_sgemm otherwise. */
typedef struct {
    enum CBLAS_TRANSPOSE ta, tb;
    int M, N, K, lda, ldb, ldc;
    float alpha, beta;
    const float *A, *B;
    float *C;
} sgemm_call;

static void sgemm_in_task(void *ctx, int64_t b, int64_t e)
{
    const sgemm_call *c = ctx;
    for (int64_t i = b; i < e; i++)
        if (i == 0)
            kiln__cpu_sgemm(CblasRowMajor, c->ta, c->tb, c->M, c->N, c->K, c->alpha, c->A, c->lda, c->B, c->ldb,
                            c->beta, c->C, c->ldc);
}

static void test_cpu_sgemm_is_cblas_alike(void **state)
{
    (void)state;
    static const int shapes[][3] = {{1, 1, 1}, {7, 65, 300}, {64, 37, 64}, {13, 130, 5}, {40, 64, 576}};
    bool own = kiln__opt(KILN__OPT_OWN_GEMM) && kiln__opt(KILN__OPT_POOL_GEMM);
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
        for (int v = 0; v < 16; v++) {
            int M = shapes[sh][0], N = shapes[sh][1], K = shapes[sh][2];
            bool at_ = v & 1, bt = v & 2;
            float alpha = v & 4 ? 0.3f : 1.0f, beta = v & 8 ? 1.0f : 0.0f;
            mat A = mat_new(M, K, at_, 3, KILN__GEMM_F32), B = mat_new(K, N, bt, 5, KILN__GEMM_F32);
            int lda = (int)(at_ ? A.cs : A.rs), ldb = (int)(bt ? B.cs : B.rs), ldc = N + 2;
            size_t nc = (size_t)M * (size_t)ldc;
            float *C0 = malloc(sizeof(float) * nc), *C1 = malloc(sizeof(float) * nc), *C2 = malloc(sizeof(float) * nc),
                  *C3 = malloc(sizeof(float) * nc);
            assert_true(C0 && C1 && C2 && C3);
            for (size_t i = 0; i < nc; i++) C0[i] = uniform();
            memcpy(C1, C0, sizeof(float) * nc);
            memcpy(C2, C0, sizeof(float) * nc);
            memcpy(C3, C0, sizeof(float) * nc);
            enum CBLAS_TRANSPOSE ta = at_ ? CblasTrans : CblasNoTrans, tb = bt ? CblasTrans : CblasNoTrans;
            kiln__cpu_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A.data, lda, B.data, ldb, beta, C1, ldc);
            sgemm_call call = {ta, tb, M, N, K, lda, ldb, ldc, alpha, beta, A.data, B.data, C2};
            kiln__parallel_for(4, 1, sgemm_in_task, &call);
            if (own)
                assert_true(kiln__gemm_f32_serial(M, N, K, operand(&A), operand(&B), alpha, beta, C3, ldc));
            else
                cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A.data, lda, B.data, ldb, beta, C3, ldc);
            for (int i = 0; i < M; i++)
                for (int j = 0; j < ldc; j++) {
                    float got = C1[(size_t)i * ldc + j];
                    if (memcmp(&got, &C2[(size_t)i * ldc + j], sizeof got) ||
                        memcmp(&got, &C3[(size_t)i * ldc + j], sizeof got))
                        fail_msg("M=%d N=%d K=%d A%s B%s alpha %g beta %g: C[%d,%d] %.9g outside a task, %.9g in one, "
                                 "%.9g from %s", M, N, K, at_ ? "^T" : "", bt ? "^T" : "", alpha, beta, i, j, got,
                                 C2[(size_t)i * ldc + j], C3[(size_t)i * ldc + j],
                                 own ? "kiln__gemm_f32_serial" : "cblas_sgemm");
                    if (j >= N) { /* the padding between rows is not written */
                        assert_true(got == C0[(size_t)i * ldc + j]);
                        continue;
                    }
                    double ref = beta * (double)C0[(size_t)i * ldc + j], mag = fabs(ref), sum = 0, smag = 0;
                    for (int k = 0; k < K; k++) {
                        double p = at(&A, i, k, false) * at(&B, k, j, false);
                        sum += p;
                        smag += fabs(p);
                    }
                    ref += alpha * sum;
                    mag += alpha * smag;
                    double tol = 2.0 * (double)(K + 2) * 0x1p-24 * mag + 1e-30;
                    if (!(fabs(got - ref) <= tol))
                        fail_msg("M=%d N=%d K=%d A%s B%s alpha %g beta %g: C[%d,%d] = %.9g, reference %.9g, tolerance "
                                 "%.3g", M, N, K, at_ ? "^T" : "", bt ? "^T" : "", alpha, beta, i, j, got, ref, tol);
                }
            free(A.data);
            free(B.data);
            free(C0);
            free(C1);
            free(C2);
            free(C3);
        }
}

/* B packed once into panels (kiln__gemm_panels: attention's K^T and V, packed once per
 * head) gives bitwise the sums of kiln__gemm_f32_serial on the same part of the unpacked
 * B, which the tests above check against the double reference: B row-major and
 * transposed, partial last panels (N 37, 70), K over two KC blocks, parts that start
 * inside (k0, and c0 a multiple of the width), alpha 1 and 0.3, beta 0 and 1, padded
 * C whose padding is not written. A part outside the panels, or alpha not 1 with beta
 * 1, is refused with C as it was. */
static void test_panels_are_the_serial_gemm_bitwise(void **state)
{
    (void)state;
    int64_t nr = kiln__gemm_panel_width();
    assert_true(nr > 0);
    /* (4200 columns: five rounds of 1024 columns, or two of 4096 with
     * KILN_OPT_GEMM_NARROW_ROUNDS=0) */
    static const int64_t sizes[][2] = {{64, 37}, {300, 70}, {1, 1}, {520, 2 * 32}, {8, 4200}};
    kiln__gemm_panels P = {0};
    for (size_t sz = 0; sz < sizeof sizes / sizeof sizes[0]; sz++)
        for (int bt = 0; bt < 2; bt++) {
            int64_t KB = sizes[sz][0], NB = sizes[sz][1];
            mat B = mat_new(KB, NB, bt, 3, KILN__GEMM_F32);
            assert_true(kiln__gemm_panels_init(&P, KB, NB));
            kiln__gemm_panels_pack(&P, operand(&B));
            /* parts: (k0, K, c0, N) */
            const int64_t parts[][4] = {{0, KB, 0, NB}, {KB / 3, KB - KB / 3, 0, NB},
                                        {0, KB / 2 + 1, NB > nr ? nr : 0, NB > nr ? NB - nr : NB}};
            for (int pt = 0; pt < 3; pt++)
                for (int v = 0; v < 4; v++) {
                    int64_t k0 = parts[pt][0], K = parts[pt][1], c0 = parts[pt][2], N = parts[pt][3];
                    int64_t M = v & 1 ? 13 : 64, ldc = N + 2;
                    float alpha = v & 2 ? 0.3f : 1.0f, beta = v & 1 ? 1.0f : 0.0f;
                    if (alpha != 1 && beta != 0) beta = 0;
                    mat A = mat_new(M, K, false, 1, KILN__GEMM_F32);
                    size_t nc = (size_t)(M * ldc);
                    float *C1 = malloc(sizeof(float) * nc), *C2 = malloc(sizeof(float) * nc),
                          *C0 = malloc(sizeof(float) * nc);
                    assert_true(C0 && C1 && C2);
                    for (size_t i = 0; i < nc; i++) C0[i] = C1[i] = C2[i] = uniform();
                    kiln__gemm_operand sub = {(float *)B.data + k0 * B.rs + c0 * B.cs, KILN__GEMM_F32, B.rs, B.cs};
                    assert_true(kiln__gemm_f32_serial(M, N, K, operand(&A), sub, alpha, beta, C1, ldc));
                    assert_true(kiln__gemm_f32_serial_panels(M, N, K, operand(&A), &P, k0, c0, alpha, beta, C2, ldc));
                    if (memcmp(C1, C2, sizeof(float) * nc))
                        fail_msg("B %lldx%lld%s, part k0 %lld K %lld c0 %lld N %lld, M %lld alpha %g beta %g: the "
                                 "panels' product differs from kiln__gemm_f32_serial's", (long long)KB, (long long)NB,
                                 bt ? "^T" : "", (long long)k0, (long long)K, (long long)c0, (long long)N, (long long)M,
                                 alpha, beta);
                    for (int64_t i = 0; i < M; i++) /* the padding between rows is not written */
                        assert_memory_equal(C2 + i * ldc + N, C0 + i * ldc + N, sizeof(float) * 2);
                    /* refused: past the panels' rows or columns, a column not at a panel's start, alpha with beta 1 */
                    assert_false(kiln__gemm_f32_serial_panels(M, N, K + 1, operand(&A), &P, k0 + KB, c0, 1, 0, C2, ldc));
                    assert_false(kiln__gemm_f32_serial_panels(M, N, K, operand(&A), &P, k0, c0 + nr, 1, 0, C2, ldc));
                    if (N > 1)
                        assert_false(kiln__gemm_f32_serial_panels(M, N - 1, K, operand(&A), &P, k0, c0 + 1, 1, 0, C2, ldc));
                    assert_false(kiln__gemm_f32_serial_panels(M, N, K, operand(&A), &P, k0, c0, 0.5f, 1, C2, ldc));
                    assert_memory_equal(C1, C2, sizeof(float) * nc);
                    free(A.data);
                    free(C0);
                    free(C1);
                    free(C2);
                }
            free(B.data);
        }
    kiln__gemm_panels_free(&P);
    assert_null(P.p);
}

/* Attention's row exponentials (kiln__cpu_att_row_exp, flex attention's forward): oracle
 * exp in double of each entry less the row's largest, relative tolerance 2e-6 in f32
 * (the fast exp's 2 ulp, and the rounding of x - m at |x - m| <= 30), 1e-15 in f64;
 * the sum against the returned entries summed in double (1e-12); -inf entries and
 * entries more than 87 below the largest exactly 0, a NaN entry NaN (and the sum, also
 * where it is the row's only entry), a row of -inf zeros with the sum 0. Row lengths around the 16 and 32 lanes; f32 in
 * AVX-512 registers (where the processor has them) and in plain loops. */
static void att_row_exp(bool vec)
{
    const int64_t lens[] = {1, 5, 15, 16, 17, 31, 32, 33, 100, 544};
    uint64_t seed = 7;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        int64_t n = lens[li];
        float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
        double *xd = malloc(sizeof(double) * (size_t)n), *yd = malloc(sizeof(double) * (size_t)n);
        for (int poison = 0; poison < 2; poison++) {
            for (int64_t j = 0; j < n; j++) {
                seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
                double u = (double)(seed >> 11) / 9007199254740992.0; /* [0, 1) */
                x[j] = (float)(-25.0 + 30.0 * u);
                if (j % 7 == 3) x[j] = -INFINITY; /* masked */
                if (j % 11 == 5) x[j] = -200.0f;  /* far below: exactly 0 */
                xd[j] = x[j];
            }
            if (poison) x[n / 2] = NAN, xd[n / 2] = NAN;
            double m = -INFINITY;
            for (int64_t j = 0; j < n; j++) m = xd[j] > m ? xd[j] : m;
            memcpy(y, x, sizeof(float) * (size_t)n);
            memcpy(yd, xd, sizeof(double) * (size_t)n);
            float mf;
            double md, s = kiln__cpu_att_row_exp_f32(y, n, &mf, vec), sd = kiln__cpu_att_row_exp_f64(yd, n, &md, vec);
            if (!(m > -INFINITY)) { /* every entry masked (n 1 with x[0] -inf), or the NaN alone: NaN */
                if (poison) assert_true(mf != mf && md != md && s != s && sd != sd && y[0] != y[0] && yd[0] != yd[0]);
                else assert_true(mf == -INFINITY && md == -INFINITY && s == 0 && sd == 0 && y[0] == 0);
                continue;
            }
            assert_true(mf == (float)m && md == m);
            double sum = 0, sumd = 0;
            for (int64_t j = 0; j < n; j++) {
                sum += y[j], sumd += yd[j];
                if (x[j] != x[j]) {
                    assert_true(y[j] != y[j] && yd[j] != yd[j]);
                    continue;
                }
                double want = exp(xd[j] - m);
                if (xd[j] - m < -87) {
                    assert_true(y[j] == 0.0f);
                    assert_true(fabs(yd[j] - want) <= 1e-15 * want);
                    continue;
                }
                assert_true(fabs(y[j] - want) <= 2e-6 * want);
                assert_true(fabs(yd[j] - want) <= 1e-15 * want);
            }
            if (poison) {
                assert_true(s != s && sd != sd);
            } else {
                assert_true(fabs(s - sum) <= 1e-12 * sum);
                assert_true(fabs(sd - sumd) <= 1e-12 * sumd);
            }
        }
        /* a row of -inf: zeros, the sum 0 */
        for (int64_t j = 0; j < n; j++) y[j] = -INFINITY, yd[j] = -INFINITY;
        float mf;
        double md;
        assert_true(kiln__cpu_att_row_exp_f32(y, n, &mf, vec) == 0 && mf == -INFINITY);
        assert_true(kiln__cpu_att_row_exp_f64(yd, n, &md, vec) == 0 && md == -INFINITY);
        for (int64_t j = 0; j < n; j++) assert_true(y[j] == 0.0f && yd[j] == 0.0);
        free(x), free(y), free(xd), free(yd);
    }
}
static void test_att_row_exp_matches_double_reference(void **state)
{
    (void)state;
    att_row_exp(true);
    att_row_exp(false);
}

int main(void)
{
    kiln_init(0);
    printf("gemm kernels here: f32 %s, bf16 %s\n", kiln__gemm_kernel_name(KILN__GEMM_F32),
           kiln__gemm_kernel_name(KILN__GEMM_BF16));
    /* KILN_OPT_GEMM_DPBF16=0 (ctest's test_gemm_no_dpbf16): the bf16 GEMM never takes
     * vdpbf16ps of itself (it still runs when asked for by name, below) */
    if (!kiln__opt(KILN__OPT_GEMM_DPBF16) && !strcmp(kiln__gemm_kernel_name(KILN__GEMM_BF16), "avx512-bf16")) {
        fprintf(stderr, "test_gemm: KILN_OPT_GEMM_DPBF16=0, yet the bf16 GEMM picked avx512-bf16\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_kernel_matches_double_reference),
        cmocka_unit_test(test_zero_k_and_empty),
        cmocka_unit_test(test_rows_and_columns_do_not_depend_on_the_rest),
        cmocka_unit_test(test_k_outer_sums_as_the_row_blocks),
        cmocka_unit_test(test_wide_products_sum_as_their_column_blocks),
        cmocka_unit_test(test_bf16_result_is_the_sums_rounded_once),
        cmocka_unit_test(test_f16_result_is_the_widened_sums_rounded_once),
        cmocka_unit_test(test_bf16_epilogue_sees_each_rounded_row_once),
        cmocka_unit_test(test_cpu_sgemm_is_cblas_alike),
        cmocka_unit_test(test_panels_are_the_serial_gemm_bitwise),
        cmocka_unit_test(test_att_row_exp_matches_double_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
