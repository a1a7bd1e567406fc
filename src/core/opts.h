/* Optimization switches: each fast path sits behind one, KILN_OPT_<NAME>=0|1 in the
 * environment, so its effect can be measured alone (DESIGN.md, "Performance
 * discipline"). Each is a row of the environment table (env.h), read through it;
 * kiln doctor lists them. A default of -1 is "auto": unset, the switch takes what the
 * function a room registered for it says (kiln__opt_auto), off where none did. */
#ifndef KILN_CORE_OPTS_H
#define KILN_CORE_OPTS_H
#include <stdbool.h>

#define KILN__OPTS(X)                                                                            \
    X(FAST_EXP, 1, "polynomial expf/tanhf (vectorized) in f32 GELU, SiLU, sigmoid, tanh, attention, cross-entropy")              \
    X(POOL_GEMM, 1, "single-threaded BLAS, GEMMs split into row/column blocks over kiln's thread pool")         \
    X(POOL_SPIN, 1, "pool threads poll for 200 us before sleeping, so back-to-back jobs skip the wake-up")     \
    X(ROWS_AVX512, 1, "matmul_rows (the serving engine's linear layers) in AVX-512 tiles where the CPU has them")  \
    X(ROWS_Q8_SIMD, 1, "matmul_rows on q8_0 weights with integer dot products in AVX2 (maddubs) where the CPU has them (else the plain C kernel; the same bits either way)")  \
    X(F16C, 1, "f16 converted with F16C (vcvtph2ps, vcvtps2ph) where the CPU has it: KV cache pages, packed f16 weights, and the widening and rounding of f16 tensors for the cpu's f32 kernels")                         \
    X(DEVICE_CODEGEN, 1, "eager ops a device lacks compiled from generated code (else run on the cpu with copies)") \
    X(CL_MATMUL_TILES, 1, "OpenCL matmul in 64x64 tiles with 4x4 outputs per work-item (else 16x16, one each)") \
    X(CL_MOE, 1, "the mixture-of-experts routing ops (topk, moe_sort, grouped matmul) in OpenCL kernels of their own (else on the cpu with copies, faster on PoCL's cpu device: docs/perf-log.md)") \
    X(DEVICE_GRAPHS, 1, "a recorded replay captured as the device's own graph (OpenCL command buffer, CUDA graph)") \
    X(GEMM_THREAD_BLOCKS, 1, "pool GEMMs split into one block per thread (multiples of 128) instead of 128-row blocks") \
    X(FULLSUM_CHUNKS, 1, "a sum of a whole f32 tensor split into fixed 64K-element chunks over the pool (else one task)") \
    X(GRAD_LAYOUT, 1, "the gradient of a column-major matmul operand (a linear weight) computed in its layout, (G^T A)^T") \
    X(ATT_KT, 1, "attention's Q K^T and dO V^T as A B GEMMs on per-head transposed copies of K and V (not A B^T)") \
    X(COPY_INTO_VIEWS, 1, "a generated kernel stores a copy_ into a view of an intermediate itself (not a copy step after)") \
    X(COLSUM_ROWS, 1, "f32 sums over the rows of a tall matrix (bias gradients) in fixed 256-row chunks of whole rows") \
    X(OWN_GEMM, -1, "f32 matmuls and the attention f32 products KILN_OPT_ATT_PANELS does not take on kiln's own packed GEMM (src/backends/cpu/gemm.c) instead of the BLAS; unset, on only where the BLAS runs a generic core for this processor (OpenBLAS's SSE3 kernels on a CPU it does not know: 3x slower training, docs/perf-log.md)")   \
    X(ATT_BF16, 1, "bf16 attention's tiles on kiln's own GEMM (AMX), P and dS rounded to bf16 as PyTorch does (else widened to f32)") \
    X(MMAP, 1, "safetensors files mapped (mmap, copy-on-write) and model weights taken from the mapping where their dtype and layout allow (else read into memory and copied)") \
    X(GEMM_DPBF16, 1, "bf16 GEMMs on AVX512-BF16's vdpbf16ps where the processor has it but not AMX, if it measures at least 1.25x the f32 FMA kernel on bf16 values at first use (else, and off, that f32 kernel)") \
    X(GEMM_EVEN_BLOCKS, 1, "kiln's own GEMM's row blocks as many as a multiple of the threads, of equal tiles (the larger first), taken one at a time (else blocks of up to 20 tiles, the last one short, in the pool's chunks)") \
    X(ATT_PANELS, 1, "attention's and flex attention's f32 scores, P V, dO V^T and dS K on kiln's own GEMM with K^T, V, V^T and K packed into its panels once per kv head and read in place by every tile of query rows, where kiln's f32 kernel is the AVX-512 one, KILN_OPT_POOL_GEMM is on and flex's key blocks are whole panels (else, and dV and dK always, kiln__cpu_sgemm: the BLAS, or kiln's GEMM packing B on every tile, as KILN_OPT_OWN_GEMM says)") \
    X(GEMM_K_OUTER, 1, "kiln's own f32 GEMM with at least 4 K blocks and M at most half of K and 1024, and at least 6 row tiles a thread (weight gradients), in items of a block of rows a thread (or, with KILN_OPT_GEMM_K_OUTER_PANELS, every row) by at most 24 panels of B, each packing its K block of B and its rows of A just before it sums them (else B packed whole first and read back from memory by every row block)") \
    X(GEMM_K_OUTER_PANELS, 1, "kiln's own GEMM's K-outer items (KILN_OPT_GEMM_K_OUTER) split B's panels among the threads, each with every row, where B is wider than A is tall (each thread then packs all of A and its share of B; else its rows of A and all of B)") \
    X(GEMM_NARROW_ROUNDS, 1, "kiln's own GEMM packs B in rounds of as many columns as keep a K block of them within 1 MiB (1024 f32 columns), so that it stays in L2 while the row tiles pass (else rounds of 4096 columns)") \
    X(GEMM_EDGE_ROWS, 1, "kiln's own GEMM runs a last tile of at most 4 or 8 rows of A on a kernel for that many rows (else the whole 12-row kernel on a scratch tile)") \
    X(STEAL_GRAD, 1, "a leaf's first gradient of a backward is the tensor its formula made, where nothing else holds it or its memory (else a copy of it)") \
    X(PACK_TRANSPOSED, 1, "kiln's own GEMM packs an f32 operand whose K is contiguous (a transposed B: linear layers' W^T; attention's K^T and V^T, packed from K and V themselves) in 16 x 16 blocks transposed in AVX-512 registers (else an element at a time, and attention's K^T and V^T packed from transposed copies)") \
    X(ATT_ROW_EXP, 1, "flex attention's forward takes each row's maximum, exponentials and sum in one call of the cpu backend's (f32 in AVX-512 registers where the processor has them) and normalizes O's D values a row instead of the row's weights (else the generated function's own softmax loops, which normalize the weights before P V)") \
    X(OWN_GEMM_F16, 0, "f16 matmuls on kiln's own GEMM, f16 widened as it is packed and the result rounded in cache (else widened copies through the f32 matmul)") \
    X(FLEX_FUSED, 1, "flex attention on the cpu without gradients in one generated kernel over the block mask's blocks (else the dense reference: scores, modifiers and softmax as kiln ops)") \
    X(INDEX_ROWS_GRAD, 1, "the gradient of index_select over the rows of a matrix as whole rows added (embedding_backward; else an element scatter_add)") \
    X(SUM_MIDDLE, 1, "f32 sums over one middle dim of a contiguous tensor (an MoE block's top-k rows combined) as whole rows added, in double (else one output element at a time)")

/* The compiler's stages (src/compile/compile.c), each a switch of its own, on by
 * default but for EPILOGUE: KILN_OPT_COMPILE_FUSION=0 compiles without fusion, to find the stage that
 * changes a result. Unlike the switches above, which are read once, these are read each
 * time a graph is compiled. KILN_COMPILE_DISABLE=fusion,reuse,... (a comma list of the
 * names after COMPILE_, in lower case) is an alias that turns the named ones off; a
 * stage runs when neither turns it off. */
#define KILN__COMPILE_STAGES(X)                                                                  \
    X(COMPILE_DECOMPOSE, 1, "compiler stage: composite ops (softmax, layer_norm, AdamW, ...) decomposed into primitives") \
    X(COMPILE_FOLD, 1, "compiler stage: constant folding")                                       \
    X(COMPILE_CSE, 1, "compiler stage: common-subexpression elimination")                        \
    X(COMPILE_SLICES, 1, "compiler stage: the scatters of disjoint slices merged into one fill and copies") \
    X(COMPILE_VIEWS, 1, "compiler stage: views sunk below elementwise ops, so that both sides fuse") \
    X(COMPILE_DCE, 1, "compiler stage: dead-code elimination")                                   \
    X(COMPILE_COALESCE, 1, "compiler stage: a run of in-graph allreduces coalesced into buckets") \
    X(COMPILE_RECOMPUTE, 1, "compiler stage: pointwise results read late in backward recomputed there, not kept") \
    X(COMPILE_HOIST, 1, "compiler stage: an elementwise op moved up beside its sibling, so that they fuse") \
    X(COMPILE_FUSION, 1, "compiler stage: elementwise ops and reductions fused into kernels")    \
    X(COMPILE_CODEGEN, 1, "compiler stage: generated kernels (off: the graph runs through the ordinary kernels)") \
    X(COMPILE_SYMBOLIC, 1, "compiler stage: sizes symbolic in generated code, one kernel for every size") \
    X(COMPILE_OVERLAP, 1, "compiler stage: collectives started early and waited for late, under compute") \
    X(COMPILE_REUSE, 1, "compiler stage: an elementwise kernel's output takes the buffer of an input it reads last") \
    X(COMPILE_EPILOGUE, 0, "compiler stage, off by default (no faster here, docs/perf-log.md): a kernel that reads a cpu bf16 matmul's result row by row runs inside its GEMM, on each block of rows while it is in cache")

typedef enum {
#define KILN__OPT_ENUM(name, dflt, help) KILN__OPT_##name,
    KILN__OPTS(KILN__OPT_ENUM)
    KILN__COMPILE_STAGES(KILN__OPT_ENUM)
#undef KILN__OPT_ENUM
    KILN__OPT_COUNT
} kiln__opt_id;

/* The switches before this id are read once; the compiler stages, from it on, when asked. */
#define KILN__OPT_PLUS_ONE(name, dflt, help) +1
enum { KILN__OPT_FIRST_STAGE = 0 KILN__OPTS(KILN__OPT_PLUS_ONE) };
#undef KILN__OPT_PLUS_ONE

bool kiln__opt(kiln__opt_id id);
/* fn decides auto switch id's value when its variable is unset; called once, at the first
 * read of any switch, inside that read: it must not read a switch itself. Registered by
 * a room's constructor (KILN__REGISTER), before any switch is read. */
void kiln__opt_auto(kiln__opt_id id, bool (*fn)(void));
/* Whether switch id's default is auto (-1 in the table). */
bool kiln__opt_is_auto(kiln__opt_id id);
/* Whether KILN_LOGS names stage (graph, fusion, code, perf, dist, ...). */
bool kiln__log_on(const char *stage);
#endif
