/* One of kiln's quantizers on raw values, for tests/gguf/test_gguf_load.py:
 *     quant_probe TYPE IN.f32 OUT.bin
 * TYPE is ggml's type number; IN holds f32 values (a whole number of blocks); OUT gets
 * kiln__quant_quant's blocks (src/core/quant.c). Exit 1 on a type kiln does not write. */
#include <stdio.h>
#include <stdlib.h>
#include "core/quant.h"

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: quant_probe TYPE IN.f32 OUT.bin\n");
        return 2;
    }
    int t = atoi(argv[1]);
    int64_t be, bb;
    if (!kiln__quant_writable(t) || !kiln__quant_block(t, &be, &bb)) {
        fprintf(stderr, "quant_probe: kiln does not write type %d\n", t);
        return 1;
    }
    FILE *f = fopen(argv[2], "rb");
    if (!f || fseek(f, 0, SEEK_END) != 0) return 1;
    long n = ftell(f) / 4;
    rewind(f);
    float *x = malloc((size_t)n * 4 + 4);
    unsigned char *q = malloc((size_t)(n / be * bb) + 1);
    if (!x || !q || fread(x, 4, (size_t)n, f) != (size_t)n || n % be) return 1;
    fclose(f);
    kiln__quant_quant(t, x, q, n);
    FILE *o = fopen(argv[3], "wb");
    if (!o || fwrite(q, 1, (size_t)(n / be * bb), o) != (size_t)(n / be * bb) || fclose(o)) return 1;
    free(x);
    free(q);
    return 0;
}
