/* libFuzzer target over flex attention's front end (src/flex): modifier expressions and
 * preset specs, as `kiln train --attention` and the C API take them. The first byte picks
 * the mode (even: a score modifier and a mask modifier split at the first NUL; odd: a
 * preset spec). Besides crashes, sanitizer reports and stack overflows, it checks that an
 * accepted modifier prints as text that parses again to the same text, and that its block
 * mask over a small shape can be built (every index it reads is evaluated). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/flex.h"

static char *dup_n(const uint8_t *p, size_t n)
{
    char *s = malloc(n + 1);
    if (!s) __builtin_trap();
    memcpy(s, p, n);
    s[n] = '\0';
    return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    int mode = data[0] & 1;
    data++, size--;
    kiln_flex_t *f = NULL;
    if (mode == 0) {
        const uint8_t *nul = memchr(data, 0, size);
        size_t n1 = nul ? (size_t)(nul - data) : size;
        char *score = dup_n(data, n1), *mask = nul ? dup_n(nul + 1, size - n1 - 1) : NULL;
        if (kiln_flex_new(*score ? score : NULL, mask && *mask ? mask : NULL, NULL, 0, &f) == KILN_OK) {
            /* printed text parses again, to the same text */
            char *s1 = strdup(kiln_flex_score_text(f)), *m1 = strdup(kiln_flex_mask_text(f));
            kiln_flex_t *g = NULL;
            if (kiln_flex_new(*s1 ? s1 : NULL, *m1 ? m1 : NULL, NULL, 0, &g) != KILN_OK) __builtin_trap();
            if (strcmp(kiln_flex_score_text(g), s1) || strcmp(kiln_flex_mask_text(g), m1)) __builtin_trap();
            kiln_flex_free(g);
            free(s1);
            free(m1);
        }
        free(score);
        free(mask);
    } else {
        char *spec = dup_n(data, size);
        kiln_flex_inputs in = {.heads = 2};
        kiln_flex_preset(spec, &in, &f);
        free(spec);
    }
    if (f) {
        kiln_block_mask_t *m = NULL;
        if (kiln_block_mask_new(f, 1, 2, 8, 8, 4, 4, &m) == KILN_OK) kiln_block_mask_free(m);
        kiln_flex_free(f);
    }
    return 0;
}
