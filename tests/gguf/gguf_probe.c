/* What kiln's GGUF reader makes of a file, for tests/gguf/test_gguf_read.py:
 *     gguf_probe FILE OUT_DIR
 * prints "key TYPE VALUE" for every scalar key (arrays: "key array TYPE LEN FIRST"),
 * "tensor NAME TYPE d0xd1... OFFSET", and writes each readable tensor's values as f32 to
 * OUT_DIR/<index>.f32 (kiln_gguf_tensor_f32). Exit 1 with kiln's message on any error. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include "kiln/gguf.h"

static int die(void)
{
    fprintf(stderr, "%s\n", kiln_last_error());
    return 1;
}

static int key_line(const kiln_gguf_t *g, int64_t i)
{
    const char *k = kiln_gguf_key(g, i);
    kiln_gguf_type t = kiln_gguf_key_type(g, i), at = kiln_gguf_array_type(g, i);
    if (t == KILN_GGUF_ARRAY) {
        printf("key %s array %s %" PRIu64, k, kiln_gguf_type_name(at), kiln_gguf_array_len(g, i));
        size_t n = 0;
        if (at == KILN_GGUF_STRING) {
            const char *const *s;
            if (kiln_gguf_get_strs(g, k, &s, &n) != KILN_OK) return die();
            if (n) printf(" %s", s[0]);
        } else if (at == KILN_GGUF_F32 || at == KILN_GGUF_F64) {
            double *v;
            if (kiln_gguf_get_reals(g, k, &v, &n) != KILN_OK) return die();
            if (n) printf(" %.17g", v[0]);
            free(v);
        } else if (at != KILN_GGUF_BOOL) {
            int64_t *v;
            if (kiln_gguf_get_ints(g, k, &v, &n) != KILN_OK) return die();
            if (n) printf(" %" PRId64, v[n - 1]);
            free(v);
        }
        printf("\n");
        return 0;
    }
    printf("key %s %s ", k, kiln_gguf_type_name(t));
    if (t == KILN_GGUF_STRING) {
        const char *s;
        if (kiln_gguf_get_str(g, k, &s) != KILN_OK) return die();
        printf("%s\n", s);
    } else if (t == KILN_GGUF_F32 || t == KILN_GGUF_F64) {
        double v;
        if (kiln_gguf_get_real(g, k, &v) != KILN_OK) return die();
        printf("%.17g\n", v);
    } else if (t == KILN_GGUF_BOOL) {
        bool v;
        if (kiln_gguf_get_bool(g, k, &v) != KILN_OK) return die();
        printf("%s\n", v ? "true" : "false");
    } else {
        int64_t v;
        if (kiln_gguf_get_int(g, k, &v) != KILN_OK) return die();
        printf("%" PRId64 "\n", v);
    }
    return 0;
}

static int run(const kiln_gguf_t *g, const char *out_dir);

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: gguf_probe FILE OUT_DIR\n");
        return 2;
    }
    kiln_gguf_t *g;
    if (kiln_gguf_open(argv[1], &g) != KILN_OK) return die();
    int rc = run(g, argv[2]);
    kiln_gguf_free(g); /* (on an error too: a leak checker sees the probe's own exits) */
    return rc;
}

static int run(const kiln_gguf_t *g, const char *out_dir)
{
    printf("version %u\n", kiln_gguf_version(g));
    for (int64_t i = 0; i < kiln_gguf_n_keys(g); i++)
        if (key_line(g, i)) return 1;
    for (int64_t i = 0; i < kiln_gguf_n_tensors(g); i++) {
        kiln_gguf_tensor t;
        if (kiln_gguf_tensor_at(g, i, &t) != KILN_OK) return die();
        printf("tensor %s %s ", t.name, kiln_gguf_tensor_type_name(t.type));
        for (int d = 0; d < t.ndim; d++) printf("%s%" PRId64, d ? "x" : "", t.shape[d]);
        printf(" %" PRIu64 "\n", t.offset);
        kiln_tensor_t *f = kiln_gguf_tensor_f32(g, i);
        if (!f) return die();
        /* (f, buf and o leak on a failed write: the probe then exits at once) */
        float *buf = malloc((size_t)t.elements * sizeof *buf);
        char path[4096];
        snprintf(path, sizeof path, "%s/%" PRId64 ".f32", out_dir, i);
        FILE *o = fopen(path, "wb");
        if (!buf || !o || kiln_tensor_to_host(f, buf, (size_t)t.elements * sizeof *buf) != KILN_OK ||
            fwrite(buf, sizeof *buf, (size_t)t.elements, o) != (size_t)t.elements || fclose(o) != 0) {
            fprintf(stderr, "gguf_probe: cannot write %s\n", path);
            return 1;
        }
        free(buf);
        kiln_tensor_free(f);
    }
    return 0;
}
