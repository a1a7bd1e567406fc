/* kiln info, tokenizer, plot. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli.h"
#include "core/parse.h"
#include "core/file.h"
#include "io/json_file.h"
#include "kiln/data.h"
#include "kiln/gguf.h"
#include "kiln/io.h"
#include "kiln/metrics.h"
#include "kiln/tokenizer.h"

/* A value shown on one line: strings cut to 60 bytes with control bytes escaped, arrays
 * as their length and type. */
static void gguf_value(const kiln_gguf_t *g, int64_t i)
{
    const char *k = kiln_gguf_key(g, i);
    kiln_gguf_type t = kiln_gguf_key_type(g, i);
    if (t == KILN_GGUF_ARRAY) {
        printf("[%llu %s]", (unsigned long long)kiln_gguf_array_len(g, i), kiln_gguf_type_name(kiln_gguf_array_type(g, i)));
    } else if (t == KILN_GGUF_STRING) {
        const char *v = "";
        kiln_gguf_get_str(g, k, &v);
        size_t n = strlen(v);
        for (size_t j = 0; j < n && j < 60; j++)
            if ((unsigned char)v[j] < 0x20 || v[j] == 0x7f) printf("\\x%02x", (unsigned char)v[j]);
            else putchar(v[j]);
        if (n > 60) printf("... (%zu bytes)", n);
    } else if (t == KILN_GGUF_F32 || t == KILN_GGUF_F64) {
        double v = 0;
        kiln_gguf_get_real(g, k, &v);
        printf("%g", v);
    } else if (t == KILN_GGUF_BOOL) {
        bool v = false;
        kiln_gguf_get_bool(g, k, &v);
        printf("%s", v ? "true" : "false");
    } else {
        int64_t v = 0;
        if (kiln_gguf_get_int(g, k, &v) == KILN_OK) printf("%lld", (long long)v);
        else printf("(above 2^63)");
    }
    kiln_clear_error();
}

/* kiln info FILE.gguf: the metadata, every tensor, and the weights by type. */
static int info_gguf(const char *path)
{
    kiln_gguf_t *g;
    if (kiln_gguf_open(path, &g) != KILN_OK) return cli_fail("info", NULL);
    printf("%s: GGUF version %u, %lld keys, %lld tensors\n", path, kiln_gguf_version(g), (long long)kiln_gguf_n_keys(g),
           (long long)kiln_gguf_n_tensors(g));
    for (int64_t i = 0; i < kiln_gguf_n_keys(g); i++) {
        printf("  %-40s ", kiln_gguf_key(g, i));
        gguf_value(g, i);
        printf("\n");
    }
    int64_t count[64] = {0}, elems[64] = {0}, total = 0;
    uint64_t bytes[64] = {0}, all = 0;
    for (int64_t i = 0; i < kiln_gguf_n_tensors(g); i++) {
        kiln_gguf_tensor t;
        kiln_gguf_tensor_at(g, i, &t);
        char shape[96] = "";
        for (int d = 0, o = 0; d < t.ndim; d++) o += snprintf(shape + o, sizeof shape - (size_t)o, d ? "x%lld" : "%lld", (long long)t.shape[d]);
        printf("  %-40s %-7s %-20s %.2f MiB\n", t.name, kiln_gguf_tensor_type_name(t.type), shape, (double)t.bytes / 1048576.0);
        if (t.type >= 0 && t.type < 64) count[t.type]++, elems[t.type] += t.elements, bytes[t.type] += t.bytes;
        total += t.elements;
        all += t.bytes;
    }
    printf("  weights:");
    for (int k = 0; k < 64; k++)
        if (count[k])
            printf(" %s %lld tensor%s (%.2fM),", kiln_gguf_tensor_type_name(k), (long long)count[k], count[k] == 1 ? "" : "s",
                   (double)elems[k] / 1e6);
    printf(" %.2fM in all, %.2f MiB, %.2f bits a weight\n", (double)total / 1e6, (double)all / 1048576.0,
           total ? 8.0 * (double)all / (double)total : 0.0);
    kiln_gguf_free(g);
    return 0;
}

/* Whether path is a file that starts with GGUF's magic. */
static bool is_gguf_file(const char *path)
{
    FILE *f = kiln__file_fopen_read(path, NULL);
    char magic[4] = {0};
    bool yes = f && fread(magic, 1, 4, f) == 4 && !memcmp(magic, "GGUF", 4);
    if (f) fclose(f);
    kiln_clear_error();
    return yes;
}

int cmd_info(int argc, char **argv)
{
    const cli_opt opts[] = {{NULL, 0, NULL, NULL}};
    const char *pos[1];
    int np = 0;
    int r = cli_parse("info", "RUN_DIR|CHECKPOINT.safetensors|MODEL.gguf", opts, argc, argv, pos, 1, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np != 1) return cli_fail("info", "give one run folder, checkpoint file or GGUF file (see kiln info --help)");
    if (is_gguf_file(pos[0])) return info_gguf(pos[0]);
    /* a run folder, as sample and serve take it: its model file */
    char path[4200];
    kiln_safetensors_t *f;
    if (kiln_model_file(pos[0], path, sizeof path) != KILN_OK || kiln_safetensors_load(path, &f) != KILN_OK)
        return cli_fail("info", NULL);
    printf("%s: %d tensors\n", path, kiln_safetensors_count(f));
    static const char *keys[] = {"format", "step", "tokenizer", "config", "optimizer", NULL};
    for (int k = 0; keys[k]; k++) {
        const char *v = kiln_safetensors_meta(f, keys[k]);
        if (v) printf("  %-10s %s\n", keys[k], v);
    }
    int64_t total = 0;
    kiln_scope_begin();
    for (int i = 0; i < kiln_safetensors_count(f); i++) {
        kiln_tensor_t *t = kiln_safetensors_get(f, kiln_safetensors_name(f, i));
        char b[96];
        if (!t) {
            kiln_scope_end();
            kiln_safetensors_free(f);
            return cli_fail("info", NULL);
        }
        total += kiln_tensor_numel(t);
        printf("  %-40s %s\n", kiln_safetensors_name(f, i), kiln_tensor_describe(t, b, sizeof b));
    }
    kiln_scope_end();
    printf("  total %lld elements (%.2fM)\n", (long long)total, (double)total / 1e6);
    kiln_safetensors_free(f);
    return 0;
}

static int tok_train(int argc, char **argv)
{
    const char *data = kiln_env_or_default("KILN_DATA"), *out = "tokenizer.json";
    int64_t vocab = 1024;
    const cli_opt opts[] = {
        {"data", OPT_STRING, &data, "text file or folder"},
        {"vocab", OPT_INT, &vocab, "vocabulary size (>= 256)"},
        {"out", OPT_STRING, &out, "where to write the HuggingFace tokenizer.json"},
        {NULL, 0, NULL, NULL},
    };
    int r = cli_parse("tokenizer train", "[options]", opts, argc, argv, NULL, 0, NULL);
    if (r) return r == 1 ? 0 : 2;
    if (cli_refuse_own_input("tokenizer train", data, out, true)) return 1;
    char *text;
    size_t len;
    kiln_tokenizer_t *t;
    if (kiln_text_read(data, &text, &len) != KILN_OK || kiln_tokenizer_train_bpe(text, len, (int)vocab, &t) != KILN_OK ||
        kiln_tokenizer_save(t, out) != KILN_OK)
        return cli_fail("tokenizer train", NULL);
    printf("wrote %s: %d tokens learned from %zu bytes of %s\n", out, kiln_tokenizer_vocab_size(t), len, data);
    free(text);
    kiln_tokenizer_free(t);
    return 0;
}

static int tok_encode(int argc, char **argv)
{
    const char *path = "byte", *text = NULL, *file = NULL;
    const cli_opt opts[] = {
        {"tokenizer", OPT_STRING, &path, "tokenizer.json, or byte"},
        {"text", OPT_STRING, &text, "text to encode"},
        {"file", OPT_STRING, &file, "a file whose bytes to encode (in place of --text)"},
        {NULL, 0, NULL, NULL},
    };
    int r = cli_parse("tokenizer encode", "--text TEXT | --file FILE [--tokenizer FILE]", opts, argc, argv, NULL, 0,
                      NULL);
    if (r) return r == 1 ? 0 : 2;
    if (!text == !file) return cli_fail("tokenizer encode", "give --text or --file");
    char *read = NULL;
    size_t n = text ? strlen(text) : 0, got = 0;
    if (file && kiln_text_read(file, &read, &n) != KILN_OK) return cli_fail("tokenizer encode", NULL);
    if (file) text = read;
    kiln_tokenizer_t *t;
    kiln_status s = strcmp(path, "byte") ? kiln_tokenizer_load(path, &t) : ((t = kiln_tokenizer_byte()) ? KILN_OK : kiln_last_status());
    if (s != KILN_OK) return cli_fail("tokenizer encode", NULL);
    int32_t *ids = NULL;
    if (kiln_tokenizer_encode_new(t, text, n, 0, &ids, &got) != KILN_OK) {
        kiln_tokenizer_free(t);
        free(read);
        return cli_fail("tokenizer encode", NULL);
    }
    for (size_t i = 0; i < got; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    free(ids);
    free(read);
    kiln_tokenizer_free(t);
    return 0;
}

static int tok_decode(int argc, char **argv)
{
    const char *path = "byte";
    const cli_opt opts[] = {{"tokenizer", OPT_STRING, &path, "tokenizer.json, or byte"}, {NULL, 0, NULL, NULL}};
    const char *pos[4096];
    int np = 0;
    int r = cli_parse("tokenizer decode", "[--tokenizer FILE] ID...", opts, argc, argv, pos, 4096, &np);
    if (r) return r == 1 ? 0 : 2;
    kiln_tokenizer_t *t;
    kiln_status s = strcmp(path, "byte") ? kiln_tokenizer_load(path, &t) : ((t = kiln_tokenizer_byte()) ? KILN_OK : kiln_last_status());
    if (s != KILN_OK) return cli_fail("tokenizer decode", NULL);
    int32_t *ids = malloc(sizeof *ids * (size_t)(np + 1));
    for (int i = 0; ids && i < np; i++) {
        int64_t v;
        if (kiln__parse_i64(pos[i], 0, INT32_MAX, "a token id", &v) != KILN_OK) return cli_fail("tokenizer decode", NULL);
        ids[i] = (int32_t)v;
    }
    char *text;
    if (!ids || kiln_tokenizer_decode(t, ids, (size_t)np, &text) != KILN_OK) return cli_fail("tokenizer decode", NULL);
    printf("%s\n", text);
    free(text);
    free(ids);
    kiln_tokenizer_free(t);
    return 0;
}

int cmd_tokenizer(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "train")) return tok_train(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "encode")) return tok_encode(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "decode")) return tok_decode(argc - 1, argv + 1);
    bool help = argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
    fprintf(help ? stdout : stderr,
            "usage: kiln tokenizer train|encode|decode [options]   (each takes --help)\n"
            "  train    learn a byte-level BPE from a corpus, saved as a HuggingFace tokenizer.json\n"
            "  encode   print the ids of --text\n"
            "  decode   print the text of ids\n");
    return help ? 0 : 2;
}

int cmd_plot(int argc, char **argv)
{
    const cli_opt opts[] = {{NULL, 0, NULL, NULL}};
    const char *pos[1];
    int np = 0;
    int r = cli_parse("plot",
                      "RUN_DIR\n\nRedraws RUN_DIR/" RUN_CHART " (train and val loss against step) from RUN_DIR/"
                      RUN_METRICS ", and, for a mixture-of-experts run (its lines carry \"moe\" members), RUN_DIR/"
                      RUN_ROUTER_CHART ": per MoE block, the busiest expert's load over the mean load against step "
                      "(1 is balanced; a block whose curve climbs towards experts / top-k is collapsing).",
                      opts, argc, argv, pos, 1, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np != 1) return cli_fail("plot", "give the run folder (see kiln plot --help)");
    char mpath[4096], spath[4096], ipath[4096], rpath[4096];
    snprintf(mpath, sizeof mpath, "%s/%s", pos[0], RUN_METRICS);
    snprintf(spath, sizeof spath, "%s/%s", pos[0], RUN_CHART);
    snprintf(ipath, sizeof ipath, "%s/%s", pos[0], RUN_INFO);
    snprintf(rpath, sizeof rpath, "%s/%s", pos[0], RUN_ROUTER_CHART);
    double baseline = NAN;
    json_t *info = kiln__json_load(ipath, 0, NULL, NULL); /* (none: no baseline) */
    if (info && json_is_number(json_object_get(info, "unigram_entropy")))
        baseline = json_number_value(json_object_get(info, "unigram_entropy"));
    json_decref(info);
    kiln_metrics_row *rows;
    size_t n;
    if (kiln_metrics_read(mpath, &rows, &n) != KILN_OK ||
        kiln_metrics_plot_svg(rows, n, "kiln train: loss", baseline, "unigram baseline", spath) != KILN_OK)
        return cli_fail("plot", NULL);
    printf("wrote %s (%zu steps)\n", spath, n);
    free(rows);
    int blocks;
    kiln_status s = kiln_metrics_plot_router_svg(mpath, "kiln train: router balance", rpath, &blocks);
    if (s == KILN_OK) printf("wrote %s (%d MoE block%s)\n", rpath, blocks, blocks == 1 ? "" : "s");
    else if (s != KILN_ERR_UNSUPPORTED) return cli_fail("plot", NULL); /* UNSUPPORTED: a dense run, no router */
    return 0;
}
