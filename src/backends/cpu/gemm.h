/* kiln's own GEMM: C = A B (or C += A B) for f32, bf16 and f16 operands with f32
 * accumulation, packed and blocked as in the BLIS papers (Van Zee and van de Geijn,
 * "BLIS: A Framework for Rapidly Instantiating BLAS Functionality", 2015), with
 * register-tiled micro-kernels for AMX (bf16), AVX-512, AVX512-BF16 and AVX2+FMA
 * chosen at run time, and a plain C fallback.
 *
 * Operands are read through their strides (row stride rs, column stride cs, in
 * elements), so A B, A B^T and A^T B are all the same call. Packing copies each block
 * into the micro-kernel's order and converts it to the kernel's type, so an f32
 * operand can feed the bf16 kernel (rounded to nearest even as it is packed).
 *
 * Every element of C is summed over K in the same order — KILN__GEMM_KC-long blocks in
 * turn, each in k order inside the micro-kernel — whatever M, the thread count or the
 * element's place in its tile, so a row's result does not depend on the other rows
 * (the serving engine's batches rely on this, bitwise). */
#ifndef KILN_CPU_GEMM_H
#define KILN_CPU_GEMM_H
#include <stdbool.h>
#include <stdint.h>
#include "core/backend.h" /* kiln__epilogue */
#include "core/dtype.h"   /* kiln__f32_to_bf16, kiln__bf16_to_f32 */

typedef enum { KILN__GEMM_F32, KILN__GEMM_BF16, KILN__GEMM_F16 } kiln__gemm_type;

/* An operand: its first element, element type (KILN__GEMM_F32: float, KILN__GEMM_BF16:
 * uint16_t holding bf16, KILN__GEMM_F16: uint16_t holding f16) and strides in
 * elements. f16 is an operand type only: its products are exact in f32, so f16
 * operands are multiplied with compute KILN__GEMM_F32, widened as they are packed. */
typedef struct {
    const void *p;
    kiln__gemm_type type;
    int64_t rs, cs;
} kiln__gemm_operand;

typedef enum {
    KILN__GEMM_ISA_AUTO, /* the best this processor runs */
    KILN__GEMM_ISA_C,
    KILN__GEMM_ISA_AVX2,
    KILN__GEMM_ISA_AVX512,
    KILN__GEMM_ISA_AVX512BF16, /* vdpbf16ps (bf16 compute only) */
    KILN__GEMM_ISA_AMX,
} kiln__gemm_isa;

/* Sums over K in blocks of this many (bf16: pairs are kept whole, the block is even). */
#define KILN__GEMM_KC 256

/* C (M x N, row stride ldc) = A (M x K) B (K x N), or C += A B with `accumulate`.
 * `compute` is the type the products are formed in: KILN__GEMM_F32 (exact f32 products)
 * or KILN__GEMM_BF16 (both operands rounded to bf16, products summed in f32). Runs over
 * kiln's thread pool. Returns false only when memory for the packed blocks ran out
 * (C is then partly written). */
bool kiln__gemm(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B, float *C, int64_t ldc,
                bool accumulate, kiln__gemm_type compute);

/* C = alpha A B + beta C (beta 0 or 1) in f32 on the calling thread alone, as a
 * single-threaded BLAS runs inside a pool task: its sums do not depend on the pool or on
 * the thread that calls (attention's tiles, through kiln__cpu_sgemm). With alpha 1 the
 * sums start from C; otherwise the product is formed first, then scaled or added.
 * Returns false, with C as it was, only when memory ran out. */
bool kiln__gemm_f32_serial(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B, float alpha,
                           float beta, float *C, int64_t ldc);

/* B packed once for many products with it on the calling thread (attention's K^T and V,
 * packed once per head and read by every tile of query rows): the f32 micro-kernel's
 * panels of `nr` columns, each holding B's K rows in order, so that a product may read
 * any run of B's rows and any run of whole panels in place. Start from {0}; init
 * (re)sizes the memory for K x N (false when out of it), pack fills it, free frees it. */
typedef struct {
    float *p;
    size_t cap;
    int64_t K, N, nr;
} kiln__gemm_panels;
bool kiln__gemm_panels_init(kiln__gemm_panels *P, int64_t K, int64_t N);
void kiln__gemm_panels_pack(kiln__gemm_panels *P, kiln__gemm_operand B); /* B: f32, K x N */
void kiln__gemm_panels_free(kiln__gemm_panels *P);
/* The panels' width: the f32 micro-kernel's NR (0 where there is none). */
int64_t kiln__gemm_panel_width(void);

/* kiln__gemm_f32_serial with B rows [k0, k0 + K) and columns [c0, c0 + N) of packed
 * panels (c0 a multiple of the width): the same sums, bitwise, as that call on the same
 * part of the unpacked B. false, with C as it was, when alpha is not 1 and beta is (the
 * caller then does it another way), or the part lies outside the panels. */
bool kiln__gemm_f32_serial_panels(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, const kiln__gemm_panels *B,
                                  int64_t k0, int64_t c0, float alpha, float beta, float *C, int64_t ldc);

/* The same with the micro-kernel chosen (tests and bench/gemm compare them); false
 * also when this processor cannot run that one. */
bool kiln__gemm_with(kiln__gemm_isa isa, int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B,
                    float *C, int64_t ldc, bool accumulate, kiln__gemm_type compute);

/* C (bf16, M x N, row stride ldc) = A B with bf16 products summed in f32 as kiln__gemm
 * sums them, each element rounded once to bf16 (nearest even) when its sum is whole.
 * The sums never fill an M x N f32 buffer: each work item keeps its block of them in
 * a per-thread buffer and rounds it there, while it is in cache. */
bool kiln__gemm_bf16(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B, uint16_t *C,
                     int64_t ldc);
bool kiln__gemm_bf16_with(kiln__gemm_isa isa, int64_t M, int64_t N, int64_t K, kiln__gemm_operand A,
                          kiln__gemm_operand B, uint16_t *C, int64_t ldc);
/* kiln__gemm_bf16 that runs epi (core/backend.h) on each work item's rows as soon as
 * they are rounded, while they are in cache, and sets epi->done, when its items hold
 * whole rows (N at most one round of packed columns, and rows enough for the threads);
 * otherwise as kiln__gemm_bf16, epi->done left false. epi->out is not touched. */
bool kiln__gemm_bf16_epilogue(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B,
                              uint16_t *C, int64_t ldc, kiln__epilogue *epi);

/* C (f16) = A B with exact f32 products (f16 or f32 operands) summed as kiln__gemm sums
 * them, each element rounded once to f16 (nearest even) while its block is in cache. */
bool kiln__gemm_f16(int64_t M, int64_t N, int64_t K, kiln__gemm_operand A, kiln__gemm_operand B, uint16_t *C,
                    int64_t ldc);
bool kiln__gemm_f16_with(kiln__gemm_isa isa, int64_t M, int64_t N, int64_t K, kiln__gemm_operand A,
                         kiln__gemm_operand B, uint16_t *C, int64_t ldc);

/* n contiguous values between f32 and bf16, rounded as kiln__f32_to_bf16 rounds (the
 * packers' conversion, vectorized where the processor has AVX-512). */
void kiln__f32_to_bf16_n(const float *src, uint16_t *dst, int64_t n);
void kiln__bf16_to_f32_n(const uint16_t *src, float *dst, int64_t n);
/* The same between f32 and f16, bitwise as kiln__f16_to_f32 and kiln__f32_to_f16 give
 * them (F16C where the processor has it: half.c). */
void kiln__f16_to_f32_n(const uint16_t *src, float *dst, int64_t n);
void kiln__f32_to_f16_n(const float *src, uint16_t *dst, int64_t n);
/* Tests: the widest code the f16 conversions may take, 0 (one at a time), 1 (AVX2) or
 * 2 (AVX-512). */
void kiln__half_limit(int level);

/* Tests: while set, every call's per-thread packing buffers are refused, as when memory
 * runs out (the products then return false, and their callers take their other path;
 * kiln__gemm_panels_init still allocates). */
void kiln__gemm_refuse_buffers(bool refuse);

/* The name of the micro-kernel kiln__gemm would use for `compute` ("avx512", ...). */
const char *kiln__gemm_kernel_name(kiln__gemm_type compute);
/* Its instruction set (KILN__GEMM_ISA_AUTO where there is none). */
kiln__gemm_isa kiln__gemm_kernel_isa(kiln__gemm_type compute);

#endif
