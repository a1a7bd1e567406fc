/* kiln sample: text from a checkpoint, with a KV cache, temperature, top-k and top-p. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "cli.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/tokenizer.h"

/* The run folder of a checkpoint argument (a folder, or a model file inside one). */
static void split_model_arg(const char *arg, char *dir, size_t dn, char *file, size_t fn)
{
    struct stat st;
    if (stat(arg, &st) == 0 && S_ISDIR(st.st_mode)) {
        snprintf(dir, dn, "%s", arg);
        snprintf(file, fn, "%s/%s", arg, RUN_MODEL);
        return;
    }
    snprintf(file, fn, "%s", arg);
    const char *slash = strrchr(arg, '/');
    if (slash) snprintf(dir, dn, "%.*s", (int)(slash - arg), arg);
    else snprintf(dir, dn, ".");
}

kiln_status cli_tokenizer_for(const char *run_dir, const char *kind, kiln_tokenizer_t **out)
{
    if (!kind || !strcmp(kind, "byte")) {
        *out = kiln_tokenizer_byte();
        return *out ? KILN_OK : kiln_last_status();
    }
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", run_dir, RUN_TOKENIZER) >= (int)sizeof path)
        return kiln_error(KILN_ERR_ARG, "path too long: %s", run_dir);
    return kiln_tokenizer_load(path, out);
}

/* Loads the model a checkpoint describes. */
static kiln_status load_model(const char *file, const char *dir, kiln_gpt_t **m, kiln_tokenizer_t **tok)
{
    kiln_safetensors_t *f;
    kiln_status s = kiln_safetensors_load(file, &f);
    if (s != KILN_OK) return s;
    const char *cfg_json = kiln_safetensors_meta(f, "config");
    kiln_gpt_config cfg;
    if (!cfg_json) s = kiln_error(KILN_ERR_FORMAT, "%s has no 'config' metadata: not a kiln model checkpoint", file);
    else s = kiln_gpt_config_from_json(cfg_json, &cfg);
    if (s == KILN_OK) s = cli_tokenizer_for(dir, kiln_safetensors_meta(f, "tokenizer"), tok);
    if (s == KILN_OK && kiln_tokenizer_vocab_size(*tok) != cfg.vocab_size)
        s = kiln_error(KILN_ERR_FORMAT, "%s: the model has %d tokens but its tokenizer %d", file, cfg.vocab_size,
                       kiln_tokenizer_vocab_size(*tok));
    kiln_safetensors_free(f);
    if (s == KILN_OK) s = kiln_gpt_new(&cfg, 0, m);
    if (s == KILN_OK) s = kiln_gpt_load_weights(*m, file);
    return s;
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* Does s end in the middle of a UTF-8 sequence? */
static bool utf8_incomplete(const char *s)
{
    size_t n = strlen(s);
    for (size_t back = 1; back <= 4 && back <= n; back++) {
        unsigned char c = (unsigned char)s[n - back];
        if ((c & 0xC0) == 0x80) continue; /* continuation byte: look further back */
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return need > back;
    }
    return false;
}

typedef struct {
    float p;
    int id;
} cand;

static int by_prob(const void *a, const void *b)
{
    float x = ((const cand *)a)->p, y = ((const cand *)b)->p;
    return x < y ? 1 : x > y ? -1 : ((const cand *)a)->id - ((const cand *)b)->id;
}

/* Picks the next token from logits (V) on the host. */
static int pick(const float *logits, int V, double temperature, int top_k, double top_p, uint64_t seed, int64_t i, cand *c)
{
    if (temperature <= 0) {
        int best = 0;
        for (int v = 1; v < V; v++)
            if (logits[v] > logits[best]) best = v;
        return best;
    }
    float mx = -INFINITY;
    for (int v = 0; v < V; v++) mx = logits[v] > mx ? logits[v] : mx;
    double sum = 0;
    for (int v = 0; v < V; v++) {
        c[v].id = v;
        c[v].p = (float)exp((logits[v] - mx) / temperature);
        sum += c[v].p;
    }
    for (int v = 0; v < V; v++) c[v].p = (float)(c[v].p / sum);
    qsort(c, (size_t)V, sizeof *c, by_prob);
    int keep = top_k > 0 && top_k < V ? top_k : V;
    double cum = 0;
    for (int k = 0; k < keep; k++) {
        cum += c[k].p;
        if (cum >= top_p) {
            keep = k + 1;
            break;
        }
    }
    double total = 0;
    for (int k = 0; k < keep; k++) total += c[k].p;
    double u = (double)(mix(seed ^ mix((uint64_t)i)) >> 11) * (1.0 / 9007199254740992.0) * total;
    for (int k = 0; k < keep; k++) {
        u -= c[k].p;
        if (u <= 0) return c[k].id;
    }
    return c[keep - 1].id;
}

int cmd_sample(int argc, char **argv)
{
    const char *model = "runs/default", *prompt = "\n";
    int64_t tokens = 200, top_k = 0, seed = 0, threads = 0;
    double temperature = 0.8, top_p = 1.0;
    const cli_opt opts[] = {
        {"model", OPT_STRING, &model, "run folder or model.safetensors"},
        {"prompt", OPT_STRING, &prompt, "text to continue"},
        {"tokens", OPT_INT, &tokens, "tokens to generate"},
        {"temperature", OPT_DOUBLE, &temperature, "softmax temperature; 0 = greedy"},
        {"top-k", OPT_INT, &top_k, "sample among the k likeliest tokens; 0 = all"},
        {"top-p", OPT_DOUBLE, &top_p, "sample among the likeliest tokens holding this much probability"},
        {"seed", OPT_INT, &seed, "seed of the sampler"},
        {"threads", OPT_INT, &threads, "threads; 0 = all cores"},
        {NULL, 0, NULL, NULL},
    };
    const char *pos[1];
    int np = 0;
    int r = cli_parse("sample", "[RUN_DIR|MODEL] [options]", opts, argc, argv, pos, 1, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np == 1) model = pos[0];
    if (tokens < 0 || tokens > 1 << 24 || !(top_p > 0 && top_p <= 1) || top_k < 0 || top_k > 1 << 24 || temperature < 0)
        return cli_fail("sample", "--tokens and --top-k in 0..2^24, 0 < --top-p <= 1 and --temperature >= 0, please");
    kiln_init((int)threads);
    char dir[4096], file[4200];
    split_model_arg(model, dir, sizeof dir, file, sizeof file);
    kiln_gpt_t *m;
    kiln_tokenizer_t *tok;
    if (load_model(file, dir, &m, &tok) != KILN_OK) return cli_fail("sample", NULL);
    const kiln_gpt_config *cfg = kiln_gpt_get_config(m);
    size_t plen = strlen(prompt), n = 0;
    int64_t cap = cfg->block_size;
    int32_t *ids = malloc(sizeof *ids * (plen + (size_t)tokens + 2));
    cand *c = malloc(sizeof *c * (size_t)cfg->vocab_size);
    float *row = malloc(sizeof *row * (size_t)cfg->vocab_size);
    if (!ids || !c || !row) return cli_fail("sample", "out of memory");
    if (kiln_tokenizer_encode(tok, prompt, plen, ids, plen + 1, &n) != KILN_OK) return cli_fail("sample", NULL);
    if (n == 0) return cli_fail("sample", "the prompt is empty after tokenizing; give --prompt some text");
    kiln_kv_cache_t *kv;
    if (kiln_kv_cache_new(m, 1, &kv) != KILN_OK) return cli_fail("sample", NULL);
    fwrite(prompt, 1, plen, stdout);
    size_t fed = 0; /* ids[0..fed) are in the cache */
    size_t printed = n;
    kiln_status s = KILN_OK;
    for (int64_t t = 0; t < tokens && s == KILN_OK; t++) {
        /* A full cache restarts from the last half-context of tokens. */
        if ((int64_t)(n - fed) + kiln_kv_cache_len(kv) > cap) {
            kiln_kv_cache_reset(kv);
            size_t keep = cap / 2 > 0 ? (size_t)cap / 2 : 1;
            fed = n > keep ? n - keep : 0;
        }
        kiln_scope_begin();
        int64_t chunk[2] = {1, (int64_t)(n - fed)};
        int64_t *buf = malloc(sizeof *buf * (size_t)chunk[1]);
        for (int64_t k = 0; buf && k < chunk[1]; k++) buf[k] = ids[fed + (size_t)k];
        kiln_tensor_t *x = buf ? kiln_from_data(buf, chunk, 2, KILN_DTYPE_I64) : NULL;
        free(buf);
        kiln_tensor_t *logits = kiln_gpt_forward_cached(m, kv, x);
        kiln_tensor_t *last = logits ? kiln_contiguous(kiln_narrow(logits, 1, chunk[1] - 1, 1)) : NULL;
        s = last ? kiln_tensor_to_host(last, row, sizeof *row * (size_t)cfg->vocab_size) : kiln_last_status();
        kiln_scope_end();
        if (s != KILN_OK) break;
        fed = n;
        ids[n++] = pick(row, cfg->vocab_size, temperature, (int)top_k, top_p, (uint64_t)seed, t, c);
        char *text;
        if ((s = kiln_tokenizer_decode(tok, ids + printed, n - printed, &text)) == KILN_OK) {
            /* A token may end inside a UTF-8 character: hold it back until the
             * character is complete (or 4 tokens have passed). */
            if (!utf8_incomplete(text) || n - printed >= 4) {
                fputs(text, stdout);
                fflush(stdout);
                printed = n;
            }
            free(text);
        }
    }
    /* Whatever was held back for an unfinished character goes out as it is. */
    char *rest;
    if (s == KILN_OK && printed < n && (s = kiln_tokenizer_decode(tok, ids + printed, n - printed, &rest)) == KILN_OK) {
        fputs(rest, stdout);
        free(rest);
    }
    printf("\n");
    kiln_kv_cache_free(kv);
    kiln_gpt_free(m);
    kiln_tokenizer_free(tok);
    free(ids);
    free(c);
    free(row);
    return s == KILN_OK ? 0 : cli_fail("sample", NULL);
}
