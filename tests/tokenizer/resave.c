/* Reads a tokenizer.json with kiln and writes it back with kiln_tokenizer_save, for
 * test_hf_tokenizers.py to load in `tokenizers`; prints the tokenizer's kind.
 *     tokenizer_resave IN.json OUT.json */
#include <stdio.h>
#include "kiln/kiln.h"
#include "kiln/tokenizer.h"

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: tokenizer_resave IN.json OUT.json\n");
        return 2;
    }
    kiln_tokenizer_t *t;
    if (kiln_tokenizer_load(argv[1], &t) != KILN_OK || kiln_tokenizer_save(t, argv[2]) != KILN_OK) {
        fprintf(stderr, "tokenizer_resave: %s\n", kiln_last_error());
        return 1;
    }
    printf("%s\n", kiln_tokenizer_kind(t));
    kiln_tokenizer_free(t);
    return 0;
}
