/* kiln/gguf.h — reading GGUF files, llama.cpp's format: metadata and tensors, the tensors'
 * bytes mapped from the file, never copied, and turned into f32 on demand. Writing a
 * model as GGUF is kiln_gguf_save (kiln/io.h).
 *
 *     kiln_gguf_t *g;
 *     if (kiln_gguf_open("model.gguf", &g) != KILN_OK) die(kiln_last_error());
 *     const char *arch;
 *     int64_t n_layer;
 *     kiln_gguf_get_str(g, "general.architecture", &arch);
 *     kiln_gguf_get_int(g, "llama.block_count", &n_layer);
 *     int64_t i = kiln_gguf_find_tensor(g, "token_embd.weight");
 *     kiln_tensor_t *w = kiln_gguf_tensor_f32(g, i);        // (vocab, n_embd), f32
 *     kiln_gguf_free(g);                                    // (w stays valid: it is a copy)
 *
 * Everything the file says is checked when it opens: the magic and version (2 or 3),
 * every string, array and tensor within the file, the tensors' types, shapes, offsets
 * and alignment, no key or tensor name twice. A file that breaks a rule is refused with a
 * message naming the key or tensor and the rule; nothing past the mapping is ever read.
 * The types kiln turns into f32 (docs/gguf.md): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
 * Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; a file holding others opens, and
 * those tensors are refused by name when read. */
#ifndef KILN_GGUF_H
#define KILN_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_gguf kiln_gguf_t;

/* GGUF's value types, by the numbers the file stores. */
typedef enum {
    KILN_GGUF_U8 = 0,
    KILN_GGUF_I8 = 1,
    KILN_GGUF_U16 = 2,
    KILN_GGUF_I16 = 3,
    KILN_GGUF_U32 = 4,
    KILN_GGUF_I32 = 5,
    KILN_GGUF_F32 = 6,
    KILN_GGUF_BOOL = 7,
    KILN_GGUF_STRING = 8,
    KILN_GGUF_ARRAY = 9,
    KILN_GGUF_U64 = 10,
    KILN_GGUF_I64 = 11,
    KILN_GGUF_F64 = 12,
} kiln_gguf_type;
const char *kiln_gguf_type_name(kiln_gguf_type t); /* "u32", "string", ...; "?" for others */

/* Maps and checks path (a regular file). */
kiln_status kiln_gguf_open(const char *path, kiln_gguf_t **out);
void kiln_gguf_free(kiln_gguf_t *g); /* NULL is fine */
uint32_t kiln_gguf_version(const kiln_gguf_t *g);
const char *kiln_gguf_path(const kiln_gguf_t *g); /* as given to kiln_gguf_open */

/* ---- metadata ---- */

int64_t kiln_gguf_n_keys(const kiln_gguf_t *g);
const char *kiln_gguf_key(const kiln_gguf_t *g, int64_t i); /* NULL outside [0, n) */
int64_t kiln_gguf_find_key(const kiln_gguf_t *g, const char *key); /* -1 when absent */
/* The value type of key i, and for an array its elements' type and count. */
kiln_gguf_type kiln_gguf_key_type(const kiln_gguf_t *g, int64_t i);
kiln_gguf_type kiln_gguf_array_type(const kiln_gguf_t *g, int64_t i);
uint64_t kiln_gguf_array_len(const kiln_gguf_t *g, int64_t i);

/* A value by key. Each is KILN_ERR_NOT_FOUND when the key is absent (the message names
 * it; callers with a default check kiln_gguf_find_key first) and KILN_ERR_FORMAT, naming
 * the key and both types, when it holds another type. _int takes any integer type and
 * refuses a u64 above INT64_MAX; _real takes f32 and f64. A string is borrowed from g,
 * NUL-terminated (a string holding a NUL is refused at _get_str). */
kiln_status kiln_gguf_get_int(const kiln_gguf_t *g, const char *key, int64_t *out);
kiln_status kiln_gguf_get_real(const kiln_gguf_t *g, const char *key, double *out);
kiln_status kiln_gguf_get_bool(const kiln_gguf_t *g, const char *key, bool *out);
kiln_status kiln_gguf_get_str(const kiln_gguf_t *g, const char *key, const char **out);
/* Array elements: strings (borrowed from g; *n of them), or numbers copied into a new
 * malloc'd array of int64_t or double the caller frees (any integer type, or f32/f64). */
kiln_status kiln_gguf_get_strs(const kiln_gguf_t *g, const char *key, const char *const **out, size_t *n);
kiln_status kiln_gguf_get_ints(const kiln_gguf_t *g, const char *key, int64_t **out, size_t *n);
kiln_status kiln_gguf_get_reals(const kiln_gguf_t *g, const char *key, double **out, size_t *n);

/* ---- tensors ---- */

typedef struct {
    const char *name;  /* borrowed from g */
    int type;          /* ggml's type number (kiln_gguf_tensor_type_name) */
    int ndim;          /* 1 to 4 */
    int64_t shape[4];  /* kiln's order: row-major, the last dimension contiguous (GGUF
                        * lists them the other way round, ne[0] first) */
    int64_t elements;
    uint64_t offset;   /* from the start of the file */
    uint64_t bytes;
    const void *data;  /* the bytes, in the mapping (borrowed from g) */
} kiln_gguf_tensor;

int64_t kiln_gguf_n_tensors(const kiln_gguf_t *g);
int64_t kiln_gguf_find_tensor(const kiln_gguf_t *g, const char *name); /* -1 when absent */
kiln_status kiln_gguf_tensor_at(const kiln_gguf_t *g, int64_t i, kiln_gguf_tensor *out);
/* ggml's name for a tensor type number ("Q4_K"), or NULL for a number it does not define. */
const char *kiln_gguf_tensor_type_name(int type);
/* Tensor i's values as f32 into out (n = its element count); an error naming the tensor
 * and its type for a type kiln does not read. */
kiln_status kiln_gguf_read_f32(const kiln_gguf_t *g, int64_t i, float *out, int64_t n);
/* The same as a new f32 cpu tensor of its shape (kiln's order), or NULL with the error set. */
kiln_tensor_t *kiln_gguf_tensor_f32(const kiln_gguf_t *g, int64_t i);

/* ---- the tokenizer ---- */

/* The tokenizer the file's metadata describes: tokenizer.ggml.model "gpt2" (byte-level
 * BPE: tokens, merges, the pre-tokenizer named by tokenizer.ggml.pre: gpt-2, llama-bpe
 * or qwen2) or "llama" (SentencePiece's BPE: tokens and scores, byte fallback,
 * add_space_prefix); control, unknown and user-defined tokens as special tokens; the end
 * and start of a text from the eos and bos ids. Another model or pre-tokenizer is refused
 * by name. It encodes as `tokenizers` encodes the tokenizer.json the same model ships. */
struct kiln_tokenizer;
kiln_status kiln_gguf_tokenizer(const kiln_gguf_t *g, struct kiln_tokenizer **out);

#ifdef __cplusplus
}
#endif

#endif
