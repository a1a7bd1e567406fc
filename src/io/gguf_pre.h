/* llama.cpp's names for the pre-tokenizers kiln has (tokenizer.ggml.pre), one table in
 * src/io/gguf_tokenizer.c that the GGUF reader (a name to a pattern) and kiln's GGUF
 * export (src/nn/gguf.c: a pattern to a name) share. */
#ifndef KILN_IO_GGUF_PRE_H
#define KILN_IO_GGUF_PRE_H

/* The name llama.cpp gives the Split pattern split ahead of a ByteLevel without its own
 * regex ("llama-bpe", "qwen2"), or for NULL, GPT-2's ByteLevel ("gpt-2"); NULL for a
 * pattern llama.cpp would split differently. */
const char *kiln__gguf_pre_name(const char *split);

#endif
