/* kiln sample: text from a checkpoint, with a KV cache, temperature, top-k and top-p. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/tokenizer.h"
#include "kiln/serve.h"

/* Does s[0..n) end in the middle of a UTF-8 sequence? */
static bool utf8_incomplete(const char *s, size_t n)
{
    for (size_t back = 1; back <= 4 && back <= n; back++) {
        unsigned char c = (unsigned char)s[n - back];
        if ((c & 0xC0) == 0x80) continue; /* continuation byte: look further back */
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return need > back;
    }
    return false;
}

/* The text of ids[0..n) as it continues what came before: their tokens' bytes joined
 * (kiln_tokenizer_decode would strip a leading space from each piece, as it does from a
 * whole text). A new buffer in *out, *len bytes. */
static kiln_status token_text(const kiln_tokenizer_t *tok, const int32_t *ids, size_t n, char **out, size_t *len)
{
    size_t total = 0, l;
    for (size_t i = 0; i < n; i++) total += kiln_tokenizer_token_bytes(tok, ids[i], &l) ? l : 0;
    char *p = *out = malloc(total + 1);
    if (!p) return kiln_error(KILN_ERR_OOM, "sample: out of memory");
    for (size_t i = 0; i < n; i++) {
        const char *b = kiln_tokenizer_token_bytes(tok, ids[i], &l);
        if (b) memcpy(p, b, l), p += l;
    }
    *len = total;
    return KILN_OK;
}

int cmd_sample(int argc, char **argv)
{
    const char *model = "runs/default", *prompt = "\n";
    int64_t tokens = 200, top_k = 0, seed = 0, threads = 0;
    double temperature = 0.8, top_p = 1.0, min_p = 0, presence = 0, frequency = 0, repetition = 1;
    const cli_opt opts[] = {
        {"model", OPT_STRING, &model, "run folder or model.safetensors"},
        {"prompt", OPT_STRING, &prompt, "text to continue"},
        {"max-tokens", OPT_INT, &tokens, "tokens to generate at most"},
        {"temperature", OPT_DOUBLE, &temperature, "softmax temperature; 0 = greedy"},
        {"top-k", OPT_INT, &top_k, "sample among the k likeliest tokens; 0 = all"},
        {"top-p", OPT_DOUBLE, &top_p, "sample among the likeliest tokens holding this much probability"},
        {"min-p", OPT_DOUBLE, &min_p, "keep the tokens at least this many times as likely as the likeliest; 0 = all"},
        {"repetition-penalty", OPT_DOUBLE, &repetition,
         "a logit of a token in the prompt or the output divided by it (multiplied when negative); 1 = off"},
        {"presence-penalty", OPT_DOUBLE, &presence, "subtracted from the logit of each token generated so far"},
        {"frequency-penalty", OPT_DOUBLE, &frequency, "subtracted once per time a token was generated"},
        {"seed", OPT_INT, &seed, "seed of the sampler"},
        {"threads", OPT_INT, &threads, "threads; 0 = all cores"},
        CLI_ALIAS("tokens", "max-tokens"),
        {NULL, 0, NULL, NULL},
    };
    const char *pos[1];
    int np = 0;
    int r = cli_parse("sample", "[RUN_DIR|MODEL] [options]", opts, argc, argv, pos, 1, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np == 1) model = pos[0];
    if (tokens < 0 || tokens > 1 << 24 || !(top_p > 0 && top_p <= 1) || top_k < 0 || top_k > 1 << 24 || temperature < 0)
        return cli_fail("sample", "--max-tokens and --top-k in 0..2^24, 0 < --top-p <= 1 and --temperature >= 0, please");
    kiln_init((int)threads);
    kiln_gpt_t *m;
    kiln_tokenizer_t *tok;
    if (kiln_model_load(model, &m, &tok, NULL) != KILN_OK) return cli_fail("sample", NULL);
    const kiln_gpt_config *cfg = kiln_gpt_get_config(m);
    size_t plen = strlen(prompt), n = 0;
    int64_t cap = cfg->block_size;
    int32_t *ids = NULL;
    void *c = malloc(kiln_sample_scratch_bytes(cfg->vocab_size));
    float *row = malloc(sizeof *row * (size_t)cfg->vocab_size);
    if (!c || !row) return cli_fail("sample", "out of memory");
    if (kiln_tokenizer_encode_new(tok, prompt, plen, (size_t)tokens + 2, &ids, &n) != KILN_OK)
        return cli_fail("sample", NULL);
    if (n == 0) return cli_fail("sample", "the prompt is empty after tokenizing; give --prompt some text");
    if (kiln_tokenizer_adds_bos(tok) && ids[0] != kiln_tokenizer_bos(tok)) { /* as the model was trained: the
                                                                                 tokenizer's start of text first */
        memmove(ids + 1, ids, sizeof *ids * n);
        ids[0] = kiln_tokenizer_bos(tok);
        n++;
    }
    kiln_sampling sp = {.temperature = temperature, .top_k = (int)top_k, .top_p = top_p, .seed = (uint64_t)seed,
                        .min_p = min_p, .presence_penalty = presence, .frequency_penalty = frequency,
                        .repetition_penalty = repetition};
    int32_t *counts = kiln_sampling_adjusts(&sp) ? calloc((size_t)cfg->vocab_size, sizeof *counts) : NULL;
    if (kiln_sampling_adjusts(&sp) && !counts) return cli_fail("sample", "out of memory");
    size_t n_prompt = n;
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
        if (counts) kiln_sample_adjust(row, cfg->vocab_size, &sp, ids, (int)n_prompt, (int)n, counts);
        ids[n++] = kiln_sample_token(row, cfg->vocab_size, &sp, t, c);
        char *text;
        size_t len;
        if ((s = token_text(tok, ids + printed, n - printed, &text, &len)) == KILN_OK) {
            /* A token may end inside a UTF-8 character: hold it back until the
             * character is complete (or 4 tokens have passed). */
            if (!utf8_incomplete(text, len) || n - printed >= 4) {
                fwrite(text, 1, len, stdout);
                fflush(stdout);
                printed = n;
            }
            free(text);
        }
    }
    /* Whatever was held back for an unfinished character goes out as it is. */
    char *rest;
    size_t len;
    if (s == KILN_OK && printed < n && (s = token_text(tok, ids + printed, n - printed, &rest, &len)) == KILN_OK) {
        fwrite(rest, 1, len, stdout);
        free(rest);
    }
    printf("\n");
    kiln_kv_cache_free(kv);
    kiln_gpt_free(m);
    kiln_tokenizer_free(tok);
    free(ids);
    free(c);
    free(row);
    free(counts);
    return s == KILN_OK ? 0 : cli_fail("sample", NULL);
}
