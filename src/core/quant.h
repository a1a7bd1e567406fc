/* ggml's tensor types: the plain ones and the quantized block formats GGUF files hold
 * (src/core/quant.c). One table, by ggml's type number: the name, how many elements a
 * block holds and in how many bytes, and, for the types kiln reads, the function that
 * turns blocks back into f32 values. Every room above core that meets a GGUF tensor
 * (the reader in io, the models in nn, the kernels in the backends) asks here.
 *
 * The layouts are ggml's (ggml-common.h); the dequantized values are the ones llama.cpp's
 * `gguf` Python package gives, bit for bit (tests/gguf/test_gguf_read.py checks every
 * type against it): each block's scales are widened from f16 to f32 and the values
 * computed in f32 in the same order of operations.
 *
 *     int64_t be, bb;
 *     if (!kiln__quant_block(KILN__GGML_Q4_K, &be, &bb)) ...      // 256 values in 144 bytes
 *     kiln__quant_dequant(KILN__GGML_Q4_K, blocks, out, n);        // n a multiple of be */
#ifndef KILN_CORE_QUANT_H
#define KILN_CORE_QUANT_H

#include <stdbool.h>
#include <stdint.h>

/* ggml's type numbers, as GGUF files store them (gaps are types ggml removed). */
enum {
    KILN__GGML_F32 = 0,
    KILN__GGML_F16 = 1,
    KILN__GGML_Q4_0 = 2,
    KILN__GGML_Q4_1 = 3,
    KILN__GGML_Q5_0 = 6,
    KILN__GGML_Q5_1 = 7,
    KILN__GGML_Q8_0 = 8,
    KILN__GGML_Q8_1 = 9,
    KILN__GGML_Q2_K = 10,
    KILN__GGML_Q3_K = 11,
    KILN__GGML_Q4_K = 12,
    KILN__GGML_Q5_K = 13,
    KILN__GGML_Q6_K = 14,
    KILN__GGML_Q8_K = 15,
    KILN__GGML_IQ2_XXS = 16,
    KILN__GGML_IQ2_XS = 17,
    KILN__GGML_IQ3_XXS = 18,
    KILN__GGML_IQ1_S = 19,
    KILN__GGML_IQ4_NL = 20,
    KILN__GGML_IQ3_S = 21,
    KILN__GGML_IQ2_S = 22,
    KILN__GGML_IQ4_XS = 23,
    KILN__GGML_I8 = 24,
    KILN__GGML_I16 = 25,
    KILN__GGML_I32 = 26,
    KILN__GGML_I64 = 27,
    KILN__GGML_F64 = 28,
    KILN__GGML_IQ1_M = 29,
    KILN__GGML_BF16 = 30,
    KILN__GGML_TQ1_0 = 34,
    KILN__GGML_TQ2_0 = 35,
    KILN__GGML_MXFP4 = 39,
    KILN__GGML_COUNT = 40 /* one past the largest number the table knows */
};

/* The name ggml gives type t ("Q4_K"), or NULL for a number it does not define. */
const char *kiln__quant_name(int t);
/* Elements per block and bytes per block of type t (1 and the element size for the plain
 * types); false for a number ggml does not define. */
bool kiln__quant_block(int t, int64_t *elems, int64_t *bytes);
/* Whether kiln turns type t into f32 values (kiln__quant_dequant). */
bool kiln__quant_readable(int t);
/* The n values (a whole number of blocks) stored in src as type t, into dst as f32. t
 * must be readable. src need not be aligned. */
void kiln__quant_dequant(int t, const void *src, float *dst, int64_t n);
/* Whether kiln writes type t (kiln__quant_quant): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
 * Q5_1. */
bool kiln__quant_writable(int t);
/* The n values of src (a whole number of blocks; finite) as type t into dst, as ggml's
 * reference quantizers (and the gguf package) make them, bit for bit: a block's scale
 * from its largest magnitude (and, for _1, its smallest value), values multiplied by the
 * scale's inverse and rounded. t must be writable. */
void kiln__quant_quant(int t, const float *src, void *dst, int64_t n);

#endif
