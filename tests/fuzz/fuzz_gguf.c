/* libFuzzer target over GGUF files (kiln/gguf.h), each read from a real file as a user
 * gives it. Besides crashes and sanitizer reports it checks that every refusal sets a
 * message, that every key of a file that opens reads back through the getter of its
 * type, and that every tensor of a readable type turns into f32 (the reader promised
 * that its bytes lie inside the file). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "fuzz_common.h"
#include "kiln/gguf.h"

static void refused_says_why(kiln_status s)
{
    if (s != KILN_OK && (!*kiln_last_error() || !strcmp(kiln_last_error(), "no error"))) __builtin_trap();
}

static void keys(const kiln_gguf_t *g)
{
    for (int64_t i = 0; i < kiln_gguf_n_keys(g); i++) {
        const char *k = kiln_gguf_key(g, i);
        kiln_gguf_type t = kiln_gguf_key_type(g, i), at = kiln_gguf_array_type(g, i);
        kiln_status s;
        if (t == KILN_GGUF_ARRAY) {
            size_t n;
            if (at == KILN_GGUF_STRING) {
                const char *const *v;
                s = kiln_gguf_get_strs(g, k, &v, &n);
            } else if (at == KILN_GGUF_F32 || at == KILN_GGUF_F64) {
                double *v = NULL;
                s = kiln_gguf_get_reals(g, k, &v, &n);
                free(v);
            } else {
                int64_t *v = NULL;
                s = kiln_gguf_get_ints(g, k, &v, &n); /* (bools are refused: a message) */
                free(v);
            }
        } else if (t == KILN_GGUF_STRING) {
            const char *v;
            s = kiln_gguf_get_str(g, k, &v);
        } else if (t == KILN_GGUF_F32 || t == KILN_GGUF_F64) {
            double v;
            s = kiln_gguf_get_real(g, k, &v);
        } else if (t == KILN_GGUF_BOOL) {
            bool v;
            s = kiln_gguf_get_bool(g, k, &v);
        } else {
            int64_t v;
            s = kiln_gguf_get_int(g, k, &v);
        }
        refused_says_why(s);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kiln_clear_error();
    kiln_gguf_t *g = NULL;
    kiln_status s = kiln_gguf_open(fuzz_write("gguf", "m.gguf", data, size), &g);
    refused_says_why(s);
    if (s != KILN_OK) return 0;
    keys(g);
    kiln_scope_begin();
    for (int64_t i = 0; i < kiln_gguf_n_tensors(g); i++) {
        kiln_gguf_tensor t;
        if (kiln_gguf_tensor_at(g, i, &t) != KILN_OK) __builtin_trap();
        if (t.bytes > size || t.offset > size - t.bytes)
            __builtin_trap(); /* the reader promised the bytes lie in the file */
        kiln_clear_error();
        if (!kiln_gguf_tensor_f32(g, i)) refused_says_why(kiln_last_status());
    }
    kiln_scope_end();
    kiln_gguf_free(g);
    return 0;
}
