/* kiln/io.h — safetensors checkpoints.
 *
 * A worked example (save two tensors with a note, read one back):
 *
 *     const char *names[] = {"wte", "step"};
 *     kiln_tensor_t *ts[] = {wte, step};
 *     const char *meta[] = {"format", "pt", NULL};
 *     if (kiln_safetensors_save("ckpt.safetensors", names, ts, 2, meta) != KILN_OK)
 *         fprintf(stderr, "kiln: %s\n", kiln_last_error());
 *
 *     kiln_safetensors_t *f;
 *     if (kiln_safetensors_load("ckpt.safetensors", &f) != KILN_OK)
 *         fprintf(stderr, "kiln: %s\n", kiln_last_error());
 *     kiln_scope_begin();
 *     kiln_tensor_t *w = kiln_safetensors_get(f, "wte");   // a copy; the scope holds it
 *     printf("%d tensors, format=%s\n", kiln_safetensors_count(f),
 *            kiln_safetensors_meta(f, "format"));
 *     kiln_scope_end();
 *     kiln_safetensors_free(f);
 *
 * The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian
 * header length N, N bytes of JSON naming each tensor's dtype, shape and
 * [begin, end) byte offsets into the buffer that follows, then the buffer itself
 * (little-endian, row-major). Files written here open in the Python package and
 * files from it open here, for the dtypes kiln has (F32 F64 F16 BF16 I32 I64 U8 BOOL).
 *
 * Errors. A malformed file is KILN_ERR_FORMAT and a file that cannot be opened, read
 * or written is KILN_ERR_IO; the message names the file and what is wrong. No input
 * file can crash the loader or make it read outside what it read in.
 */
#ifndef KILN_IO_H
#define KILN_IO_H

#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A safetensors file read into memory and checked; immutable once loaded, so several
 * threads may read one at once. */
typedef struct kiln_safetensors kiln_safetensors_t;

/* Reads and validates path. On success *out is a new handle for
 * kiln_safetensors_free; on failure *out is NULL. */
kiln_status kiln_safetensors_load(const char *path, kiln_safetensors_t **out);
int kiln_safetensors_count(const kiln_safetensors_t *f);
/* The i-th tensor's name in file order (by data offset); borrowed from f, NULL when i
 * is out of range. */
const char *kiln_safetensors_name(const kiln_safetensors_t *f, int i);
/* A new tensor copied out of the file (ownership as in kiln/tensor.h: the open scope
 * holds it, else the caller does), or NULL with KILN_ERR_ARG when f has no such name. */
kiln_tensor_t *kiln_safetensors_get(const kiln_safetensors_t *f, const char *name);
/* The same tensor without a copy where it can be: over the file's mapped bytes (the
 * file is mapped copy-on-write, KILN_OPT_MMAP, on by default), so that only the pages
 * read are brought in; writes to it change this process's pages, never the file. It
 * keeps the mapping alive after kiln_safetensors_free. When the last tensor viewing an
 * entry is freed while the mapping stays, the whole pages inside the entry are given
 * back, so what was written through those views may be gone: a later get or view of
 * the entry reads the file's bytes there (and the written ones in the pages it shares
 * with its neighbours); while any view of it is alive, they read the written ones. A copy when the file was read
 * instead (the switch off, a file system that cannot map) or the tensor's bytes are
 * not aligned to its element size. As with any mapped file, the file must not be
 * truncated while such a tensor is in use. */
kiln_tensor_t *kiln_safetensors_view(const kiln_safetensors_t *f, const char *name);
/* The __metadata__ value for key, borrowed from f, or NULL when there is none. */
const char *kiln_safetensors_meta(const kiln_safetensors_t *f, const char *key);
void kiln_safetensors_free(kiln_safetensors_t *f); /* NULL is fine */

/* Writes n tensors (borrowed; any layout, any device) under names to path,
 * atomically: the data goes to PATH.tmp.PID, is flushed and fsync'd, then renamed over
 * path and the directory fsync'd, so path holds either the old file or the whole new
 * one. meta is NULL or {"key", "value", ..., NULL}. As the reference writer does,
 * tensors are laid out by element size, largest first (stable otherwise), so every
 * tensor is aligned to its element size; kiln_safetensors_name reports that order. */
kiln_status kiln_safetensors_save(const char *path, const char *const *names, kiln_tensor_t *const *tensors,
                                  int n, const char *const *meta);

/* A trained model from a run folder or its model.safetensors, as `kiln train` writes
 * them: the config and weights, the tokenizer (byte-level, or the folder's
 * tokenizer.json), and the chat template stored in the metadata key "chat_template"
 * (*chat_template is malloc'd, or NULL when the checkpoint has none; pass NULL to skip).
 * On failure nothing is returned and the message names the file and the problem. */
struct kiln_gpt;
struct kiln_tokenizer;
kiln_status kiln_model_load(const char *path, struct kiln_gpt **model, struct kiln_tokenizer **tok,
                            char **chat_template);
/* The model file kiln_model_load reads for path: a run folder's model.safetensors, else
 * path itself, into out (n bytes); an error when it does not fit. */
kiln_status kiln_model_file(const char *path, char *out, size_t n);

/* A Hugging Face model folder as a kiln model with f32 weights: config.json, and
 * model.safetensors or the shards model.safetensors.index.json lists (f32, f16 or bf16).
 * LLaMA, Mistral and Qwen2 (model_type llama, mistral, qwen2) and GPT-2 (gpt2). A config
 * field kiln cannot honour (YaRN rope scaling, another activation, ...) is an error naming
 * it, and so is a tensor of the files that no parameter of kiln's model takes: the
 * model loaded is the one the folder describes, or none. kiln_model_load takes such a
 * folder too (with its tokenizer.json, which it needs). */
kiln_status kiln_hf_load(const char *dir, struct kiln_gpt **model);
/* A kiln model written as a Hugging Face folder that transformers loads: config.json
 * (LlamaForCausalLM for rmsnorm + rope + swiglu models, GPT2LMHeadModel for layernorm +
 * learned positions + gelu with biases; anything else is an error naming what fits
 * neither), model.safetensors with weights in dt (f32, bf16 or f16), and tok's
 * tokenizer.json when tok is not NULL. dir is made if missing; files in it are
 * replaced. kiln_hf_load reads the folder back to the same model (bitwise in f32). */
kiln_status kiln_hf_save(const struct kiln_gpt *m, const struct kiln_tokenizer *tok, const char *dir, kiln_dtype dt);
/* A kiln model as a GGUF file that llama.cpp loads (its llama architecture for
 * LLaMA-style models, rmsnorm + rope + swiglu without biases; its gpt2 architecture for
 * GPT-2 style ones, layernorm + learned positions + gelu with biases; another model is
 * an error), with tok as its byte-level BPE vocabulary. The matrices in dt (f32, f16 or bf16), or in q8_0 when q8_0 is set
 * (blocks of 32 values: an f16 scale and 32 signed bytes); norms stay f32. Written to a
 * temporary name and renamed: path is the old file or the whole new one. */
kiln_status kiln_gguf_save(const struct kiln_gpt *m, const struct kiln_tokenizer *tok, const char *path,
                           kiln_dtype dt, bool q8_0);
/* The same with the matrices in any type kiln writes, by its name: "f32", "f16", "bf16",
 * "q8_0", "q4_0", "q4_1", "q5_0" or "q5_1" (blocks of 32 values as ggml's reference
 * quantizers make them, bit for bit; a matrix whose rows the blocks do not divide, and
 * every vector, stays f32). Another name is an error listing these. */
kiln_status kiln_gguf_write(const struct kiln_gpt *m, const struct kiln_tokenizer *tok, const char *path,
                            const char *type);
/* A GGUF file (llama.cpp's; kiln/gguf.h reads any) as a kiln model with f32 weights:
 * general.architecture llama (LLaMA 1-3.x, Mistral, SmolLM, TinyLlama), qwen2, qwen3 or
 * gpt2, the hyperparameters from the architecture's keys, every tensor of a type kiln
 * reads turned into f32 (q and k rows of llama's pair-rotating rope put back in halves
 * order), the tokenizer (kiln_gguf_tokenizer; tok may be NULL to skip it) and the chat
 * template (tokenizer.chat_template; *chat_template malloc'd or NULL; NULL to skip). A
 * key or tensor kiln's model would not compute the same (another rope scaling, a head
 * size of its own, experts, a tensor with no place) is an error naming it.
 * kiln_model_load takes such a file too. */
kiln_status kiln_gguf_load(const char *path, struct kiln_gpt **model, struct kiln_tokenizer **tok,
                           char **chat_template);
/* Whether path is a Hugging Face model folder: a folder with a config.json that names a
 * model_type (kiln's run folders have none), or with a config.json that is not a regular
 * file (a FIFO, a folder), which the loader then refuses by name. */
bool kiln_hf_is_folder(const char *path);

#ifdef __cplusplus
}
#endif
#endif
