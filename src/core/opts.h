/* Optimization switches: each fast path sits behind one, KILN_OPT_<NAME>=0|1 in the
 * environment, so its effect can be measured alone (DESIGN.md, "Performance
 * discipline"). kiln doctor lists them. */
#ifndef KILN_CORE_OPTS_H
#define KILN_CORE_OPTS_H
#include <stdbool.h>

#define KILN__OPTS(X)                                                                            \
    X(FAST_EXP, 1, "polynomial expf/tanhf (vectorized) in f32 GELU, SiLU, sigmoid, tanh, attention, cross-entropy")              \
    X(POOL_GEMM, 1, "single-threaded BLAS, GEMMs split into row/column blocks over kiln's thread pool")         \
    X(POOL_SPIN, 1, "pool threads poll for 200 us before sleeping, so back-to-back jobs skip the wake-up")     \
    X(ROWS_AVX512, 1, "matmul_rows (the serving engine's linear layers) in AVX-512 tiles where the CPU has them")  \
    X(F16C, 1, "f16 KV cache pages widened with F16C's vcvtph2ps where the CPU has it")                         \
    X(DEVICE_CODEGEN, 1, "eager ops a device lacks compiled from generated code (else run on the cpu with copies)") \
    X(CL_MATMUL_TILES, 1, "OpenCL matmul in 64x64 tiles with 4x4 outputs per work-item (else 16x16, one each)") \
    X(DEVICE_GRAPHS, 1, "a recorded replay captured as the device's own graph (OpenCL command buffer, CUDA graph)") \
    X(GEMM_THREAD_BLOCKS, 1, "pool GEMMs split into one block per thread (multiples of 128) instead of 128-row blocks") \
    X(FULLSUM_CHUNKS, 1, "a sum of a whole f32 tensor split into fixed 64K-element chunks over the pool (else one task)") \
    X(GRAD_LAYOUT, 1, "the gradient of a column-major matmul operand (a linear weight) computed in its layout, (G^T A)^T") \
    X(ATT_KT, 1, "attention's Q K^T and dO V^T as A B GEMMs on per-head transposed copies of K and V (not A B^T)") \
    X(COPY_INTO_VIEWS, 1, "a generated kernel stores a copy_ into a view of an intermediate itself (not a copy step after)") \
    X(COLSUM_ROWS, 1, "f32 sums over the rows of a tall matrix (bias gradients) in fixed 256-row chunks of whole rows")

typedef enum {
#define KILN__OPT_ENUM(name, dflt, help) KILN__OPT_##name,
    KILN__OPTS(KILN__OPT_ENUM)
#undef KILN__OPT_ENUM
    KILN__OPT_COUNT
} kiln__opt_id;

bool kiln__opt(kiln__opt_id id);
/* Whether KILN_LOGS names stage (graph, fusion, code, perf, dist, ...). */
bool kiln__log_on(const char *stage);
#endif
