/* kiln/tokenizer.h — byte, byte-level BPE and SentencePiece-style BPE tokenizers, read and
 * saved as HuggingFace tokenizer.json.
 *
 * A worked example:
 *
 *     kiln_tokenizer_t *tok;
 *     if (kiln_tokenizer_train_bpe(corpus, corpus_len, 1024, &tok) != KILN_OK ||
 *         kiln_tokenizer_save(tok, "tokenizer.json") != KILN_OK)
 *         fprintf(stderr, "kiln: %s\n", kiln_last_error());
 *     int32_t ids[64];
 *     size_t n;
 *     kiln_tokenizer_encode(tok, "Hello world", 11, ids, 64, &n);  // e.g. n == 2
 *     char *s;
 *     kiln_tokenizer_decode(tok, ids, n, &s);                      // s == "Hello world"
 *     free(s);
 *     kiln_tokenizer_free(tok);
 *
 * Two kinds. "byte" has 256 ids, id = byte value. "bpe" is BPE, in one of two forms:
 *
 * Byte-level, as GPT-2: the tokens are byte strings. Trained by kiln: ids 0..255 are
 * the bytes, then one id per learned merge in rank order, then the special token
 * "<|endoftext|>" as the last id. Pre-tokenization is a regular expression matched with
 * Unicode's classes (PCRE2 with Unicode properties, as `tokenizers` matches): GPT-2's
 * (HF ByteLevel, use_regex=true, add_prefix_space=false),
 *     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * or, for a tokenizer.json whose pre_tokenizer is a Sequence of a Split on a Regex
 * (behavior Isolated) and a ByteLevel without a regex (LLaMA-3's and Qwen2's shape),
 * that Split's pattern. A pre-token is a match or the text between two. Bytes that are
 * not UTF-8 are pre-tokens of their own. Encoding then decoding is lossless for any
 * bytes.
 *
 * SentencePiece-style (char-level), as LLaMA-2 and Mistral ship it: a BPE model with
 * byte_fallback (the vocab holds "<0x00>".."<0xFF>"), unk_token and fuse_unk, and no
 * ByteLevel. The text's spaces become "▁" and a "▁" is put in front, by the Metaspace
 * pre-tokenizer (prepend_scheme "always": every text between special tokens; "first":
 * only the text that starts the input, not one after a special token; "never"; split or
 * not at each "▁") or by the older normalizers Prepend("▁") and Replace(" ", "▁") with no
 * pre-tokenizer. A word's symbols are its characters looked up in the vocab; one the
 * vocab lacks becomes its UTF-8 bytes' "<0xXX>" tokens, else "<unk>" (one for a run with
 * fuse_unk), as `tokenizers` does; then the merges apply. Decoding follows the decoder
 * Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)] or Metaspace's, as
 * `tokenizers` decodes with skip_special_tokens=False: the decoded text loses the one
 * leading space the "▁" prefix stands for, so "Hello" comes back as "Hello" (and, as in
 * `tokenizers`, " Hi" through Metaspace as "Hi", since Metaspace adds no "▁" before one
 * there is). A run of byte tokens that is not UTF-8 comes back as its bytes
 * (`tokenizers` writes U+FFFD for each); bytes of the input that are not UTF-8 fall back
 * to their byte tokens, so encoding then decoding keeps them.
 *
 * Either form: the tokenizer.json's normalizer applies first to the text between
 * special tokens: NFC, NFD, NFKC, NFKD (utf8proc), Prepend, Replace of a literal string,
 * or a Sequence of them. Added tokens (special or not: "<|endoftext|>", "<s>", "</s>")
 * are cut out of the text first, as `tokenizers` does: the first in the text, the
 * longest of those there. The post_processor (a template that adds "<s>" or "<|begin_of_text|>") is not
 * applied and not saved: encode gives the text's ids alone, as `tokenizers`' encode with
 * add_special_tokens=False; a caller that wants BOS puts it in front. tests/tokenizer/
 * checks against `tokenizers` on a multilingual text: GPT-2, LLaMA-3, Qwen2 and LLaMA-2
 * shapes give the same ids and decode alike.
 *
 * Errors. Functions return kiln_status; the message is read with kiln_last_error().
 * Ownership. Constructors and load return a new tokenizer that the caller frees with
 * kiln_tokenizer_free(); text and id arguments are borrowed.
 */
#ifndef KILN_TOKENIZER_H
#define KILN_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>
#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_tokenizer kiln_tokenizer_t;

/* The byte tokenizer: 256 ids, id = byte value. NULL only when out of memory. */
kiln_tokenizer_t *kiln_tokenizer_byte(void);

/* Learns byte-level BPE merges from text[0..len) until the vocabulary, counting the 256
 * bytes and the one special token "<|endoftext|>", holds vocab_size ids (vocab_size >= 257).
 * The most frequent adjacent pair is merged first; ties go to the pair with the smaller
 * (left id, right id). If the text runs out of pairs first, the vocabulary is smaller
 * than asked: kiln_tokenizer_vocab_size() says what it is. Deterministic. */
kiln_status kiln_tokenizer_train_bpe(const char *text, size_t len, int vocab_size, kiln_tokenizer_t **out);

/* Writes a HuggingFace tokenizer.json that Python `tokenizers` loads and that encodes to
 * the same ids (with add_special_tokens=False: no post_processor is written) and decodes
 * alike. The byte kind is written as a BPE model with no merges. */
kiln_status kiln_tokenizer_save(const kiln_tokenizer_t *t, const char *path);
/* The same tokenizer.json as text (malloc'd; the caller frees), or NULL with the error
 * set. */
char *kiln_tokenizer_to_json(const kiln_tokenizer_t *t);

/* Reads a tokenizer.json: what kiln_tokenizer_save writes, byte-level BPE files (GPT-2's
 * ByteLevel, or a Split on a regex then a ByteLevel, as LLaMA-3 and Qwen2 ship) and
 * SentencePiece-style ones (Metaspace or Prepend/Replace, byte fallback, as LLaMA-2 and
 * Mistral ship). A missing file is KILN_ERR_IO; a malformed one (a pattern that does not
 * compile, an unk_token not in the vocab among them) is KILN_ERR_FORMAT, and one needing
 * a feature kiln lacks (another normalizer, pre-tokenizer, decoder or model, BPE dropout,
 * a Regex Replace) is KILN_ERR_UNSUPPORTED, each with a message naming the file and the
 * field. */
kiln_status kiln_tokenizer_load(const char *path, kiln_tokenizer_t **out);

int kiln_tokenizer_vocab_size(const kiln_tokenizer_t *t);

/* Encodes text[0..len) into ids[0..cap); *n_out = the number of ids. If cap is too small
 * it returns KILN_ERR_ARG with *n_out = the number needed (ids then holds the first cap).
 * len + 1 ids are not always enough: a normalizer that lengthens the text (NFKC's
 * "㌀" is four characters) or a "▁" put before each text between special tokens can
 * make more ids than bytes. */
kiln_status kiln_tokenizer_encode(const kiln_tokenizer_t *t, const char *text, size_t len, int32_t *ids,
                                  size_t cap, size_t *n_out);
/* The same into a new array (*ids, malloc'd; the caller frees it) with room for extra
 * more ids after the *n_out it holds, however many ids the text makes. */
kiln_status kiln_tokenizer_encode_new(const kiln_tokenizer_t *t, const char *text, size_t len, size_t extra,
                                      int32_t **ids, size_t *n_out);

/* A byte range [begin, end) of a text. */
typedef struct {
    size_t begin, end;
} kiln_text_span;

/* kiln_tokenizer_encode_new where special tokens are not recognised inside the spans
 * plain[0..n_plain) (sorted by begin, not overlapping, within the text): the text
 * there is tokenized as text even where it spells a special token, so that a chat
 * message holding "<|im_end|>" cannot close its turn and forge another. A special
 * token that would start or end inside a span is not taken either. */
kiln_status kiln_tokenizer_encode_plain_new(const kiln_tokenizer_t *t, const char *text, size_t len,
                                            const kiln_text_span *plain, int n_plain, size_t extra, int32_t **ids,
                                            size_t *n_out);

/* Decodes ids[0..n) into a new malloc'd NUL-terminated string the caller frees; the bytes
 * may themselves hold NULs. An id outside [0, vocab size) is KILN_ERR_INDEX. A
 * SentencePiece-style decoder strips the text's leading space, as `tokenizers` does, so
 * ids that continue a text are decoded by joining their kiln_tokenizer_token_bytes. */
kiln_status kiln_tokenizer_decode(const kiln_tokenizer_t *t, const int32_t *ids, size_t n, char **out);

/* The bytes of token id (borrowed from t, not NUL-terminated) and their count in *len;
 * NULL (and *len 0) for an id outside [0, vocab size). What streaming decoders need:
 * a token's bytes may be part of a UTF-8 character or a NUL. They are what the token
 * decodes to after other tokens: a SentencePiece-style "▁Hello" gives " Hello" (the
 * space kiln_tokenizer_decode strips from the start of a text is kept), "<0xE6>" the
 * byte 0xE6. */
const char *kiln_tokenizer_token_bytes(const kiln_tokenizer_t *t, int32_t id, size_t *len);

/* The special token that ends a text: "<|endoftext|>" (GPT-2's, kiln's own), else
 * "</s>" (SentencePiece's: LLaMA-2, Mistral), else "<|end_of_text|>" (LLaMA-3's); -1
 * when the tokenizer has none of them. Generation stops on it. */
int32_t kiln_tokenizer_eot(const kiln_tokenizer_t *t);
/* The special token that starts a text: "<s>", else "<|begin_of_text|>", else the
 * end-of-text token (GPT-2 starts with it); -1 when none. */
int32_t kiln_tokenizer_bos(const kiln_tokenizer_t *t);
/* Whether a prompt for generation starts with the start-of-text token, as the model was
 * trained: a tokenizer.json whose post_processor (TemplateProcessing, alone or in a
 * Sequence) puts a special token before the text (LLaMA 2 and 3, Mistral), or a GGUF
 * file's tokenizer.ggml.add_bos_token (llama.cpp's default: on for SentencePiece
 * vocabularies). kiln_tokenizer_encode never adds it; kiln sample and kiln serve put
 * kiln_tokenizer_bos before a prompt's text where this says so. */
bool kiln_tokenizer_adds_bos(const kiln_tokenizer_t *t);

/* "byte" or "bpe" (byte-level or SentencePiece-style: both read from and saved as
 * tokenizer.json). */
const char *kiln_tokenizer_kind(const kiln_tokenizer_t *t);

void kiln_tokenizer_free(kiln_tokenizer_t *t);

#ifdef __cplusplus
}
#endif

#endif
