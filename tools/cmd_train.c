/* kiln train: the pretraining loop. One step = accum micro-batches forward and
 * backward, gradients averaged over the process group, clipped, one optimizer update.
 * Everything a resumed run needs (weights, moments, step, RNG) is in the checkpoint,
 * and batches are a function of (seed, step), so a resumed run repeats the losses of
 * an uninterrupted one bit for bit. */
#include <errno.h>
#include <float.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <time.h>
#include "cli.h"
#include "core/parse.h"
#include "core/file.h" /* kiln__file_check_target */
#include "core/util.h"
#include "kiln/data.h"
#include "kiln/graph.h"
#include "kiln/dist.h"
#include "kiln/io.h"
#include "kiln/metrics.h"
#include "kiln/nn.h"
#include "kiln/optim.h"
#include "kiln/tokenizer.h"
#include "train.h"

static char *join(const char *dir, const char *file)
{
    size_t n = strlen(dir) + strlen(file) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, file);
    return p;
}

static kiln_status mkdir_p(const char *path)
{
    char buf[4096];
    if (strlen(path) >= sizeof buf) return kiln_error(KILN_ERR_ARG, "path too long: %s", path);
    strcpy(buf, path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return kiln_error(KILN_ERR_IO, "cannot create '%s': %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return kiln_error(KILN_ERR_IO, "cannot create '%s': %s", buf, strerror(errno));
    return KILN_OK;
}

static bool has_flag(const char *flag) { return flag != NULL; }

/* Option --flag's text as enum value *out, one of names (NULL after the last). */
static kiln_status enum_option(const char *flag, const char *text, const char *const *names, size_t n, int *out)
{
    char list[128] = "";
    for (size_t i = 0; i < n && names[i]; i++) {
        if (text && !strcmp(text, names[i])) return *out = (int)i, KILN_OK;
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? " or " : "", names[i]);
    }
    return kiln_error(KILN_ERR_ARG, "--%s must be %s, not '%s'", flag, list, text ? text : "");
}

/* The model config of --arch with the model options (kiln/gpt_config.def's rows with a
 * flag) over it: a number as it is, an enum by its name; --kv-heads 0 keeps the
 * family's count (--heads for gpt2); --attention's doc becomes doc:EOT. */
#define COPY_INT(member, names, flag) c->member = (int)a->m.member;
#define COPY_NUM(member, names, flag) c->member = a->m.member;
#define COPY_BOOL(member, names, flag) c->member = a->m.member;
#define COPY_ENUM(member, names, flag) \
    { \
        static const char *const v[] = {UNPAREN names}; \
        int e = 0; \
        if (enum_option(flag, a->m.member, v, sizeof v / sizeof v[0], &e) != KILN_OK) return kiln_last_status(); \
        c->member = e; \
    }
#define COPY_STR(member, names, flag) /* (--attention: below) */
#define KILN_GPT_NAMES(...) (__VA_ARGS__) /* (parenthesised: one argument of the macros below) */
#define UNPAREN(...) __VA_ARGS__
static kiln_status model_config(const train_args *a, int vocab, int eot, kiln_gpt_config *c)
{
    if (!strcmp(a->model, "gpt2")) *c = kiln_gpt_config_gpt2();
    else if (!strcmp(a->model, "llama")) *c = kiln_gpt_config_llama();
    else return kiln_error(KILN_ERR_ARG, "--arch must be gpt2 or llama, not '%s'", a->model);
    int family_kv = c->n_kv_head;
#define KILN_GPT_FIELD(member, ctype, kind, def, lo, hi, flags, names, when, flag, ...) \
    if (has_flag(flag)) COPY_##kind(member, names, flag)
#define KILN_GPT_MEMBER(...)
#define KILN_GPT_PART(...)
#include "kiln/gpt_config.def"
#undef KILN_GPT_FIELD
#undef KILN_GPT_MEMBER
#undef KILN_GPT_PART
    if (a->m.n_kv_head <= 0) c->n_kv_head = !strcmp(a->model, "gpt2") ? c->n_head : family_kv;
    c->vocab_size = vocab;
    /* --attention: "doc" is document masking at the tokenizer's end-of-text token */
    char *w = c->attention;
    size_t cap = sizeof c->attention, n = 0;
    for (const char *p = a->m.attention ? a->m.attention : ""; *p && n < cap;) {
        size_t k = strcspn(p, "+");
        bool doc = k == 3 && !strncmp(p, "doc", 3);
        if (doc && eot < 0) return kiln_error(KILN_ERR_ARG, "--attention doc: the tokenizer has no end-of-text token");
        n += (size_t)(doc ? snprintf(w + n, cap - n, "%sdoc:%d", n ? "+" : "", eot)
                          : snprintf(w + n, cap - n, "%s%.*s", n ? "+" : "", (int)k, p));
        p += k + (p[k] == '+');
    }
    char q[96];
    if (n >= cap)
        return kiln_error(KILN_ERR_ARG, "--attention is too long: at most %zu characters as the model's config holds it, "
                          "in '%s'", cap - 1, kiln__excerpt(a->m.attention, 0, 60, q, sizeof q));
    return kiln_gpt_config_check(c);
}
#undef KILN_GPT_NAMES
#undef UNPAREN

/* Reads the tokenizer k names (--tokenizer, or on resume the run's own): "byte", "bpe:N"
 * (train one of vocab N on the corpus and save it into the run), or a tokenizer.json path. */
static kiln_status get_tokenizer(const train_args *a, const char *k, const char *text, size_t len,
                                 kiln_tokenizer_t **tok)
{
    if (!strcmp(k, "byte")) {
        *tok = kiln_tokenizer_byte();
        return *tok ? KILN_OK : kiln_last_status();
    }
    if (!strncmp(k, "bpe:", 4)) {
        int64_t vocab;
        if (kiln__parse_i64(k + 4, 256, 1 << 24, "VOCAB of --tokenizer bpe:VOCAB", &vocab) != KILN_OK)
            return kiln_last_status();
        if (!a->quiet) printf("training a BPE tokenizer of %d tokens on %zu bytes...\n", (int)vocab, len);
        return kiln_tokenizer_train_bpe(text, len, (int)vocab, tok);
    }
    return kiln_tokenizer_load(k, tok);
}

kiln_status cli_save_model(const char *dir, kiln_gpt_t *m, const char *tok_kind, int64_t step)
{
    kiln_checkpoint_info info = {.step = step, .tokenizer = tok_kind, .chat_template = kiln_chat_template_default()};
    return kiln_checkpoint_save_model(dir, m, &info);
}

/* A resumed run repeats the steps after its checkpoint: drop their old rows first.
 * dropped: how many rows went, the steps first..last. */
static kiln_status keep_metrics_upto(const char *path, int64_t step, size_t *dropped, int64_t *first, int64_t *last)
{
    kiln_metrics_row *rows = NULL;
    size_t n = 0, keep = 0;
    struct stat st;
    if (stat(path, &st) != 0) return KILN_OK;
    kiln_status s = kiln_metrics_read(path, &rows, &n);
    if (s != KILN_OK) return s;
    while (keep < n && rows[keep].step <= step) keep++;
    *dropped = n - keep;
    if (keep < n) {
        *first = rows[keep].step;
        *last = rows[n - 1].step;
        kiln_metrics_t *m;
        s = kiln_metrics_open(path, false, &m);
        for (size_t i = 0; s == KILN_OK && i < keep; i++) s = kiln_metrics_write(m, &rows[i]);
        if (s == KILN_OK) kiln_metrics_close(m);
    }
    free(rows);
    return s;
}

static void fmt_eta(double s, char *buf, size_t n)
{
    if (!(s >= 0) || s > 1e7) snprintf(buf, n, "?");
    else if (s >= 3600) snprintf(buf, n, "%dh%02dm", (int)(s / 3600), (int)(s / 60) % 60);
    else if (s >= 60) snprintf(buf, n, "%dm%02ds", (int)(s / 60), (int)s % 60);
    else snprintf(buf, n, "%ds", (int)s);
}

/* The validation loss: every rank the whole batches, or with sharded experts (whose
 * exchange buffers grow with the rows a rank routes) each rank its share of them, the
 * loss averaged over pg. */
static kiln_status eval_loss(kiln_gpt_t *m, kiln_dataset_t *ds, const train_args *a, kiln_pg_t *pg, double *out)
{
    double sum = 0;
    bool prev = kiln_set_grad_enabled(false), share = a->expert_parallel && kiln_pg_world_size(pg) > 1;
    int rank = share ? kiln_pg_rank(pg) : 0, world = share ? kiln_pg_world_size(pg) : 1;
    kiln_status s = KILN_OK;
    for (int64_t k = 0; s == KILN_OK && k < a->eval_batches; k++) {
        kiln_scope_begin();
        kiln_tensor_t *x, *y, *loss;
        s = kiln_dataset_batch(ds, KILN_SPLIT_VAL, (int)a->batch, (int)a->m.block_size, (uint64_t)a->seed, k, rank, world, &x,
                               &y);
        if (s == KILN_OK && !kiln_gpt_forward(m, x, y, false, &loss)) s = kiln_last_status();
        if (s == KILN_OK && share) s = kiln_pg_allreduce(pg, loss, KILN_REDUCE_AVG);
        double v = 0;
        if (s == KILN_OK) s = kiln_tensor_item(loss, &v);
        sum += v;
        kiln_scope_end();
    }
    kiln_set_grad_enabled(prev);
    *out = sum / (double)(a->eval_batches > 0 ? a->eval_batches : 1);
    return s;
}

/* The micro-batches step * accum + k (k < accum) of one process as (accum, B, T) idx and
 * targets, for the whole step with --compile: the same data the eager micro-batch loop
 * reads. */
static kiln_status stacked_batches(kiln_dataset_t *ds, int B, int T, uint64_t seed, int64_t step, int accum, int rank,
                                   int world, kiln_tensor_t **in)
{
    size_t per = (size_t)B * (size_t)T;
    int64_t *h[2] = {malloc(sizeof(int64_t) * per * (size_t)accum), malloc(sizeof(int64_t) * per * (size_t)accum)};
    kiln_status s = h[0] && h[1] ? KILN_OK : kiln_error(KILN_ERR_OOM, "train: out of memory");
    for (int k = 0; s == KILN_OK && k < accum; k++) {
        kiln_tensor_t *xy[2];
        s = kiln_dataset_batch(ds, KILN_SPLIT_TRAIN, B, T, seed, step * accum + k, rank, world, &xy[0], &xy[1]);
        for (int j = 0; s == KILN_OK && j < 2; j++) {
            kiln_tensor_t *c = kiln_cast(xy[j], KILN_DTYPE_I64);
            s = c ? kiln_tensor_to_host(c, h[j] + per * (size_t)k, sizeof(int64_t) * per) : kiln_last_status();
        }
    }
    int64_t shape[3] = {accum, B, T};
    for (int j = 0; s == KILN_OK && j < 2; j++)
        if (!(in[j] = kiln_from_data(h[j], shape, 3, KILN_DTYPE_I64))) s = kiln_last_status();
    free(h[0]);
    free(h[1]);
    return s;
}

/* ---- the run, as a sequence of steps ----
 * Each step is a function over the run's state that returns GO_ON, or the exit code
 * to return with (after printing why). An early exit leaves what was made to the
 * process's end, as it did when cmd_train was one function. */

/* ---- stopping on a signal ----
 * SIGINT or SIGTERM sets stop_signal, and nothing else (it is all a handler may safely
 * do); the loop finishes its step, writes a checkpoint, says how to resume and exits
 * with 128 + the signal. A second signal while it does so kills the process at once
 * (the default action; a save cut short leaves the previous checkpoint, which
 * resumes). With several ranks the flag travels with the loss's allreduce
 * (step_reduce_update), so every rank stops after the same step and saves the same
 * checkpoint, even when only one of them was signalled. */
static volatile sig_atomic_t stop_signal;

static void on_stop_signal(int sig)
{
    if (stop_signal) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    stop_signal = sig;
}

static const int stop_signals[2] = {SIGINT, SIGTERM};

/* Catches the stop signals (old: the actions they had), or with old_in restores them. */
static void catch_stop_signals(struct sigaction old[2], const struct sigaction *old_in)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART; /* a file write or collective under way goes on */
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 2; i++) sigaction(stop_signals[i], old_in ? &old_in[i] : &sa, old_in ? NULL : &old[i]);
}

typedef struct {
    int argc;
    char **argv;
    train_args a;
    kiln_pg_t *pg;
    int rank, world;
    int64_t rank_batch;                  /* sequences per micro-batch on this rank */
    char *tok_path, *metrics_path, *chart_path, *router_path; /* router_path: an MoE model's chart */
    kiln_tokenizer_t *tok;
    const char *tok_kind;
    int vocab;
    kiln_dataset_t *ds;
    double unigram;                      /* the unigram baseline, in nats */
    kiln_gpt_config cfg;
    kiln_gpt_t *m;
    kiln_gpt_t *init;                    /* --init: the model the run starts from, until copied */
    int np;
    kiln_tensor_t **params;
    kiln_optim_t *opt;
    int64_t start;                       /* the first step to run: 0, or the checkpoint's */
    kiln_metrics_t *metrics;
    bool whole;                          /* the step is one call of kiln_gpt_train_step */
    kiln_gpt_step step_fn;
    kiln_loss_scaler scaler;             /* --precision f16 */
    int64_t skipped_seen;                /* the scaler's skipped steps already reported */
    kiln_compiled_t *compiled;
    bool sharded;                        /* resuming from ZeRO-1 shards */
    kiln_zero1_t *zero;
    int64_t committed;                   /* the step of the ZeRO-1 shards the marker names */
    kiln_ddp_t *ddp;
    int64_t tokens_per_step;
    double t_begin, val, comm_after;     /* comm_after: gradient reduction left after backward */
    int64_t timed;                       /* steps run, for the ETA */
    train_folder folder;                 /* what the options found in --out */
    int64_t saved;                       /* the step of the last checkpoint this process wrote, or -1 */
    bool stop;                           /* a signal asked every rank to stop after this step */
    int exit_code;                       /* 0, or 128 + the signal after a stop */
} train_run;

/* The options (tools/train_options.c). */
static int parse_options(train_run *r) { return train_options_parse(r->argc, r->argv, &r->a, &r->folder); }

/* Threads, the device, the process group, and the run folder. */
static int setup_devices(train_run *r)
{
    train_args *a = &r->a;
    /* N ranks on one machine share its cores rather than each taking all of them. */
    int local = kiln_pg_local_size_from_env();
    if (a->threads == 0 && !kiln_env("KILN_NUM_THREADS") && local > 1) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        a->threads = cores / local > 1 ? cores / local : 1;
    }
    kiln_init((int)a->threads);
    if (!a->device) a->device = kiln_env_or_default("KILN_DEVICE");
    if (kiln_set_device(a->device) != KILN_OK) return cli_fail("train", NULL);

    if (kiln_pg_new_from_env(&r->pg) != KILN_OK) return cli_fail("train", NULL);
    r->rank = kiln_pg_rank(r->pg);
    r->world = kiln_pg_world_size(r->pg);
    if (a->batch % r->world)
        return cli_fail("train", "--batch is the batch of all ranks together and must be a multiple of the world size");
    r->rank_batch = a->batch / r->world;
    if (mkdir_p(a->out) != KILN_OK) return cli_fail("train", NULL);
    return GO_ON;
}

/* The corpus, its tokenizer (trained or loaded, and saved in the run), and the
 * dataset of its token ids. */
static int setup_data(train_run *r)
{
    train_args *a = &r->a;
    char *text;
    size_t len;
    if (kiln_text_read(a->data, &text, &len) != KILN_OK) {
        fprintf(stderr, "kiln train: %s\n(the default corpus is made by `make demo`, or: bible -l200 Gen1:1-Rev22:21 > data/kjv.txt)\n",
                kiln_last_error());
        return 1;
    }
    /* On resume the run's own tokenizer is used (a->tokenizer stays as given: run.json
     * records it). */
    r->tok_path = join(a->out, RUN_TOKENIZER);
    const char *tok_spec = a->tokenizer;
    if (a->resume && strcmp(a->tokenizer, "byte")) {
        struct stat st;
        if (stat(r->tok_path, &st) == 0) tok_spec = r->tok_path;
    }
    if (a->init) { /* the model's own tokenizer */
        if (strcmp(tok_spec, "byte") && strcmp(tok_spec, r->tok_path))
            return cli_fail("train", "--init brings its own tokenizer; leave out --tokenizer");
        if (kiln_model_load(a->init, &r->init, &r->tok, NULL) != KILN_OK) return cli_fail("train", NULL);
        int T = kiln_gpt_get_config(r->init)->block_size;
        if (a->m.block_size > T) {
            fprintf(stderr, "kiln train: --context %lld is longer than the --init model's %d positions\n",
                    (long long)a->m.block_size, T);
            return 1;
        }
    } else if (get_tokenizer(a, tok_spec, text, len, &r->tok) != KILN_OK) {
        return cli_fail("train", NULL);
    }
    r->tok_kind = kiln_tokenizer_kind(r->tok);
    if (strcmp(r->tok_kind, "byte") && kiln_tokenizer_save(r->tok, r->tok_path) != KILN_OK) return cli_fail("train", NULL);
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (kiln_tokenizer_encode_new(r->tok, text, len, 0, &ids, &n_ids) != KILN_OK) return cli_fail("train", NULL);
    free(text);
    if (kiln_dataset_new(ids, n_ids, a->val_fraction, &r->ds) != KILN_OK) return cli_fail("train", NULL);
    free(ids);
    /* Both splits must hold a window, or the run would fail at its first evaluation. */
    if (kiln_dataset_len(r->ds, KILN_SPLIT_TRAIN) < (size_t)a->m.block_size + 1 ||
        kiln_dataset_len(r->ds, KILN_SPLIT_VAL) < (size_t)a->m.block_size + 1) {
        fprintf(stderr, "kiln train: %s gives %zu training and %zu validation tokens; each split needs at least "
                        "--context + 1 = %lld (raise --val-fraction, lower --context, or give more text)\n",
                a->data, kiln_dataset_len(r->ds, KILN_SPLIT_TRAIN), kiln_dataset_len(r->ds, KILN_SPLIT_VAL),
                (long long)a->m.block_size + 1);
        return 1;
    }
    r->vocab = kiln_tokenizer_vocab_size(r->tok);
    r->unigram = kiln_dataset_unigram_entropy(r->ds, r->vocab);
    return GO_ON;
}

/* The model from its configuration and the seed, and its optimizer. */
static int build_model(train_run *r)
{
    train_args *a = &r->a;
    if (r->init) { /* its config (with this run's dropout) and a copy of its weights */
        r->cfg = *kiln_gpt_get_config(r->init);
        r->cfg.dropout = a->m.dropout;
        if (kiln_gpt_new(&r->cfg, (uint64_t)a->seed, &r->m) != KILN_OK) return cli_fail("train", NULL);
        bool prev = kiln_set_grad_enabled(false);
        kiln_status s = KILN_OK;
        for (int i = 0; s == KILN_OK && i < kiln_gpt_num_params(r->m); i++)
            s = kiln_tensor_copy_(kiln_gpt_param(r->m, i, NULL), kiln_gpt_param(r->init, i, NULL));
        kiln_set_grad_enabled(prev);
        kiln_gpt_free(r->init);
        r->init = NULL;
        if (s != KILN_OK) return cli_fail("train", NULL);
        if (!a->quiet && r->rank == 0) printf("starting from %s\n", a->init);
    } else if (model_config(a, r->vocab, kiln_tokenizer_eot(r->tok), &r->cfg) != KILN_OK ||
               kiln_gpt_new(&r->cfg, (uint64_t)a->seed, &r->m) != KILN_OK) {
        return cli_fail("train", NULL);
    }
    if (kiln_gpt_set_precision(r->m, a->prec) != KILN_OK) return cli_fail("train", NULL);
    if (a->expert_parallel && kiln_gpt_shard_experts(r->m, r->pg) != KILN_OK) return cli_fail("train", NULL);
    r->scaler = kiln_loss_scaler_default(); /* a resumed run's replaces it (load_checkpoint) */
    r->scaler.scale = a->loss_scale;
    r->np = kiln_gpt_num_params(r->m);
    r->params = malloc(sizeof *r->params * (size_t)r->np);
    for (int i = 0; i < r->np; i++) r->params[i] = kiln_gpt_param(r->m, i, NULL);
    kiln_status s = !strcmp(a->optimizer, "adamw")
                        ? kiln_adamw_new(r->params, r->np, NULL, 0.9, 0.95, 1e-8, a->wd, &r->opt)
                        : kiln_sgd_new(r->params, r->np, NULL, a->momentum, a->wd, &r->opt);
    if (s != KILN_OK) return cli_fail("train", NULL);
    return GO_ON;
}

/* With --resume, the checkpoint's weights, optimizer state and step; then the run's
 * description and its metrics file (cut back to the checkpoint's step). */
static int load_checkpoint(train_run *r)
{
    train_args *a = &r->a;
    r->start = 0;
    r->saved = -1;
    kiln_manual_seed((uint64_t)a->seed);
    if (a->resume) {
        kiln_checkpoint_info ck = {.optimizer = a->optimizer, .data_seed = a->seed,
                                   .scaler = a->prec == KILN_DTYPE_F16 ? &r->scaler : NULL};
        if (kiln_checkpoint_load(a->out, r->m, r->opt, &ck) != KILN_OK) {
            int rc = cli_fail("train", NULL);
            if (!r->folder.recorded) train_hint_unrecorded_config(a->out, &r->cfg);
            return rc;
        }
        r->start = ck.step;
        r->skipped_seen = r->scaler.skipped; /* the loaded run's skips are not news */
        if (r->start >= a->steps) {
            fprintf(stderr, "kiln train: %s is already at step %lld; give --steps above it to train on\n", a->out,
                    (long long)r->start);
            return 1;
        }
        r->saved = r->start;
    } else if (r->folder.replacing && train_delete_replaced_run(a->out) != KILN_OK) { /* --overwrite */
        return cli_fail("train", NULL);
    }
    if (r->rank == 0) train_write_run_info(a->out, r->unigram, r->tok_kind, &r->cfg, a);
    r->metrics_path = join(a->out, RUN_METRICS);
    r->chart_path = join(a->out, RUN_CHART);
    r->router_path = join(a->out, RUN_ROUTER_CHART);
    size_t dropped = 0;
    int64_t first = 0, last = 0;
    if (r->rank == 0 && a->resume && keep_metrics_upto(r->metrics_path, r->start, &dropped, &first, &last) != KILN_OK)
        return cli_fail("train", NULL);
    /* Steps logged past the checkpoint (a run killed between saves) are news even with
     * --quiet: they are gone from the chart and trained again. */
    if (r->rank == 0 && a->resume && (!a->quiet || dropped)) {
        printf("resumed %s at step %lld", a->out, (long long)r->start);
        if (dropped)
            printf("; dropped %zu logged step%s (%lld-%lld) past the checkpoint from %s: they are trained again",
                   dropped, dropped == 1 ? "" : "s", (long long)first, (long long)last, RUN_METRICS);
        printf("\n");
    }
    if (r->rank == 0 && a->resume && !a->quiet && r->folder.changed[0])
        printf("changed from %s: %s\n", RUN_INFO, r->folder.changed);
    if (r->rank == 0 && kiln_metrics_open(r->metrics_path, a->resume, &r->metrics) != KILN_OK)
        return cli_fail("train", NULL);
    return GO_ON;
}

/* How a step runs. One process and one micro-batch, or --compile: the step is one
 * function, kiln_gpt_train_step, run eagerly or compiled into one graph (with several
 * processes its gradients' allreduce is in the graph too, coalesced into buckets, each
 * started as soon as its gradients are made and finished where the update reads them;
 * without --compile they use kiln_ddp's buckets, also overlapped with backward). */
static int setup_step(train_run *r)
{
    train_args *a = &r->a;
    int np = r->np, world = r->world;
    kiln_tensor_t **params = r->params;
    r->tokens_per_step = a->batch * a->m.block_size * a->accum;
    bool scaled = a->prec == KILN_DTYPE_F16; /* the step function does the scaling, with any accum and world */
    /* sharded experts: the step function divides their gradients where it averages the others' */
    r->whole = a->compile || scaled || a->expert_parallel || (world == 1 && !a->zero1 && a->accum == 1);
    r->step_fn = (kiln_gpt_step){r->m, r->opt, params, np, a->clip, (int)a->accum, world > 1 ? r->pg : NULL, NULL,
                                 scaled};
    /* The clipping norm and the micro-batch count are numbers the graph is built with. */
    if (a->compile &&
        (kiln_compiled_new(kiln_gpt_train_step, &r->step_fn, "train_step", &r->compiled) != KILN_OK ||
         kiln_compiled_guard(r->compiled, "clip", &r->step_fn.clip, sizeof r->step_fn.clip) != KILN_OK ||
         kiln_compiled_guard(r->compiled, "accum", &r->step_fn.accum, sizeof r->step_fn.accum) != KILN_OK)) {
        int fs = cli_fail("train", NULL); /* prints the error before the free can replace it */
        kiln_compiled_free(r->compiled);
        return fs;
    }
    /* Every rank starts from rank 0's parameters (the same seed gives them anyway; this
     * makes it so whatever was loaded). */
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && world > 1 && i < np; i++)
        if (!kiln_gpt_param_sharded(r->m, i)) s = kiln_pg_broadcast(r->pg, params[i], 0); /* not a rank's own experts */
    if (s != KILN_OK) return cli_fail("train", NULL);
    return GO_ON;
}

/* Where the gradients and the optimizer state go with several ranks: kiln_ddp's
 * buckets, or ZeRO-1's shards of AdamW's moments (loaded from the checkpoint's shards
 * on resume). */
static int setup_gradients(train_run *r)
{
    train_args *a = &r->a;
    int np = r->np, world = r->world;
    kiln_tensor_t **params = r->params;
    r->committed = -1;
    int64_t mstep;
    int mworld;
    r->sharded = a->resume && kiln_zero1_read_marker(a->out, &mstep, &mworld) == KILN_OK && mstep == r->start;
    kiln_clear_error();
    if (r->sharded && !a->zero1)
        return cli_fail("train", "this run's optimizer state is sharded (ZeRO-1): resume it with --zero1");
    bool has_state = false;
    for (int i = 0; i < np && !has_state; i++) has_state = kiln_optim_state(r->opt, i, 0) != NULL;
    /* (an f16 run whose steps were all skipped has taken none yet) */
    bool none_taken = r->step_fn.scaled && r->scaler.skipped >= r->start;
    if (a->resume && r->start > 0 && !strcmp(a->optimizer, "adamw") && !has_state && !r->sharded && !none_taken)
        return cli_fail("train", "the checkpoint holds no optimizer state for its step, and no complete ZeRO-1 shards "
                                 "for it (a sharded save that did not finish); it is not loaded");
    /* buckets: a first one of 1 MiB (or --bucket-mb if smaller), then --bucket-mb */
    if (!(a->bucket_mb >= 0 && a->bucket_mb <= 1 << 20)) return cli_fail("train", "--bucket-mb must be in 0..1048576");
    int64_t bucket = (int64_t)(a->bucket_mb * (1 << 20)), first = bucket < (1 << 20) ? bucket : (1 << 20);
    if (world > 1 && !r->whole && !a->zero1 && bucket > 0 &&
        kiln_ddp_new(r->pg, params, np, first > 0 ? first : 1, bucket, &r->ddp) != KILN_OK)
        return cli_fail("train", NULL);
    if (a->zero1) {
        if (strcmp(a->optimizer, "adamw")) return cli_fail("train", "--zero1 shards AdamW; it needs --optimizer adamw");
        if (kiln_zero1_new(r->pg, params, np, NULL, 0.9, 0.95, 1e-8, a->wd, r->opt, &r->zero) != KILN_OK)
            return cli_fail("train", NULL);
        if (r->sharded && kiln_zero1_load(r->zero, a->out, r->start) != KILN_OK) return cli_fail("train", NULL);
        if (r->sharded) r->committed = r->start;
        /* The moments live in the shards from here on: the replicated optimizer keeps
         * none, so that a checkpoint's train state carries only its metadata. */
        kiln_optim_free(r->opt);
        if (kiln_adamw_new(params, np, NULL, 0.9, 0.95, 1e-8, a->wd, &r->opt) != KILN_OK) return cli_fail("train", NULL);
        r->step_fn.opt = r->opt; /* --compile: the sharded update inside the graph (captured at the first call) */
        r->step_fn.zero = r->zero;
        if (!a->quiet && r->rank == 0)
            printf("ZeRO-1: optimizer state %.2f MiB per rank (moments and a master copy of this rank's shard), "
                   "against %.2f MiB of moments on every rank unsharded\n",
                   (double)kiln_zero1_state_bytes(r->zero) / (1 << 20),
                   (double)kiln_gpt_param_elements(r->m) * 2 * sizeof(float) / (1 << 20));
    }
    return GO_ON;
}

static int print_banner(train_run *r)
{
    train_args *a = &r->a;
    if (!a->quiet && r->rank == 0)
        printf("kiln train: %s model, %d layer%s, C=%d, %d head%s (%d kv), T=%d, vocab %d (%s), %.2fM parameters\n"
               "            %zu train / %zu val tokens, %lld tokens per step, %d rank%s x %d thread%s on %s, "
               "%s, unigram baseline %.3f nats\n",
               a->init ? (r->cfg.pos == KILN_POS_ROPE ? "llama-style" : "gpt2-style") : a->model, r->cfg.n_layer,
               r->cfg.n_layer == 1 ? "" : "s", r->cfg.n_embd, r->cfg.n_head, r->cfg.n_head == 1 ? "" : "s", r->cfg.n_kv_head, r->cfg.block_size, r->vocab,
               r->tok_kind, (double)kiln_gpt_param_elements(r->m) / 1e6, kiln_dataset_len(r->ds, KILN_SPLIT_TRAIN),
               kiln_dataset_len(r->ds, KILN_SPLIT_VAL), (long long)r->tokens_per_step, r->world, r->world == 1 ? "" : "s", kiln_num_threads(),
               kiln_num_threads() == 1 ? "" : "s", kiln_device(), a->prec == KILN_DTYPE_F32 ? "f32" : a->prec == KILN_DTYPE_BF16
                   ? "mixed precision bf16" : "mixed precision f16 with loss scaling", r->unigram);
    return GO_ON;
}

/* Forward, backward and update of one step as one call of kiln_gpt_train_step, eager
 * or compiled; the sum of the micro-batches' losses and the gradient norm. f16: the
 * step takes the loss scale and skips itself on an overflow; the scaler moves here,
 * from the norm it gives back. */
static kiln_status step_whole(train_run *r, int64_t step, double lr, double *loss_sum, double *gnorm)
{
    train_args *a = &r->a;
    kiln_scope_begin();
    kiln_tensor_t *in[4], *out[2];
    int n_in = 3 + r->step_fn.scaled;
    int n_out = 0;
    int64_t one = 1;
    kiln_status s;
    if (a->accum == 1)
        s = kiln_dataset_batch(r->ds, KILN_SPLIT_TRAIN, (int)r->rank_batch, (int)a->m.block_size, (uint64_t)a->seed, step,
                               (int)r->rank, (int)r->world, &in[0], &in[1]);
    else
        s = stacked_batches(r->ds, (int)r->rank_batch, (int)a->m.block_size, (uint64_t)a->seed, step, (int)a->accum,
                            (int)r->rank, (int)r->world, in);
    if (s == KILN_OK && !(in[2] = kiln_from_data(&lr, &one, 1, KILN_DTYPE_F64))) s = kiln_last_status();
    if (s == KILN_OK && r->step_fn.scaled && !(in[3] = kiln_from_data(&r->scaler.scale, &one, 1, KILN_DTYPE_F64)))
        s = kiln_last_status();
    if (s == KILN_OK)
        s = r->compiled ? kiln_compiled_call(r->compiled, in, n_in, out, 2, &n_out)
                        : kiln_gpt_train_step(&r->step_fn, in, n_in, out, &n_out);
    if (s == KILN_OK) s = kiln_tensor_item(out[0], loss_sum);
    *loss_sum *= (double)a->accum; /* the step gives the micro-batches' mean */
    if (s == KILN_OK) s = kiln_tensor_item(out[1], gnorm);
    if (s == KILN_OK && r->step_fn.scaled) kiln_loss_scaler_update(&r->scaler, *gnorm);
    kiln_scope_end();
    if (s == KILN_OK && r->compiled && step == r->start && !a->quiet && r->rank == 0) {
        int kernels = 0, ops = 0;
        kiln_compiled_plan(r->compiled, 0, &kernels, &ops, NULL, NULL);
        if (kernels + ops > 0)
            printf("compiled the training step: %d generated kernels and %d ops through the backend; the first "
                   "step's time includes compiling (or loading them from the cache)\n", kernels, ops);
        else
            printf("captured the training step as one graph; on %s it runs through the device's kernels (the "
                   "compiler generates whole graphs for the cpu only so far)\n", kiln_device());
    }
    return s;
}

/* Forward and backward of --accum micro-batches, eager; the sum of their losses. With
 * kiln_ddp, the gradients' reduction starts during the last backward. */
static kiln_status step_micro_batches(train_run *r, int64_t step, double *loss_sum)
{
    train_args *a = &r->a;
    kiln_status s = KILN_OK;
    for (int64_t micro = 0; micro < a->accum && s == KILN_OK; micro++) {
        kiln_scope_begin();
        kiln_tensor_t *x, *y, *loss;
        s = kiln_dataset_batch(r->ds, KILN_SPLIT_TRAIN, (int)r->rank_batch, (int)a->m.block_size, (uint64_t)a->seed,
                               step * a->accum + micro, r->rank, r->world, &x, &y);
        if (s == KILN_OK && !kiln_gpt_forward(r->m, x, y, true, &loss)) s = kiln_last_status();
        double v = 0;
        if (s == KILN_OK) s = kiln_tensor_item(loss, &v);
        if (s == KILN_OK && r->ddp && micro == a->accum - 1) s = kiln_ddp_begin(r->ddp); /* reduce during the last backward */
        if (s == KILN_OK) s = kiln_backward(a->accum > 1 ? kiln_mul_scalar(loss, 1.0 / (double)a->accum) : loss);
        *loss_sum += v;
        kiln_scope_end();
    }
    return s;
}

/* After backward: the gradients reduced over the ranks (unless the step did it), the
 * ranks' collectives checked, the loss averaged over the ranks, and (unless the step
 * did it) clipping and the update. */
static kiln_status step_reduce_update(train_run *r, double lr, double *loss_sum, double *gnorm)
{
    train_args *a = &r->a;
    kiln_status s = KILN_OK;
    double t_comm = kiln__now_s();
    if (!r->whole && r->ddp) s = kiln_ddp_finish(r->ddp);
    for (int i = 0; s == KILN_OK && !r->whole && !r->zero && !r->ddp && i < r->np; i++)
        if (kiln_tensor_grad(r->params[i]))
            s = kiln_pg_allreduce(r->pg, kiln_tensor_grad(r->params[i]), KILN_REDUCE_AVG);
    r->comm_after += kiln__now_s() - t_comm;
    if (s == KILN_OK) s = kiln_pg_check_step(r->pg); /* every rank ran the same collectives this step */
    if (s == KILN_OK && r->world > 1) {
        /* The loss of the whole batch: the mean of the ranks' equal shares; and with it
         * whether any rank was signalled to stop (a mean above 0), so that every rank
         * stops after the same step. */
        kiln_scope_begin();
        double v[2] = {*loss_sum, stop_signal ? 1.0 : 0.0};
        int64_t two = 2;
        kiln_tensor_t *l = kiln_from_data(v, &two, 1, KILN_DTYPE_F64);
        s = l ? kiln_pg_allreduce(r->pg, l, KILN_REDUCE_AVG) : kiln_last_status();
        if (s == KILN_OK) s = kiln_tensor_to_host(l, v, sizeof v);
        *loss_sum = v[0];
        r->stop = v[1] > 0;
        kiln_scope_end();
    }
    if (s == KILN_OK && r->zero && !r->whole) s = kiln_zero1_step(r->zero, lr, a->clip, gnorm);
    if (s == KILN_OK && !r->zero && !r->whole) s = kiln_clip_grad_norm(r->params, r->np, a->clip, gnorm);
    if (s == KILN_OK && !r->zero && !r->whole) s = kiln_optim_step(r->opt, lr);
    if (s == KILN_OK && !r->whole) s = kiln_gpt_moe_update(r->m, r->world > 1 ? r->pg : NULL); /* MoE balancing */
    return s;
}

/* A mixture-of-experts model's router statistics of the last step as the metrics line's
 * members {"moe":{"layers":[..],"load":[[..]..],"bias":[[..]..],"max_over_mean":[..],
 * "dropped":0}}: per MoE block the rows each expert got (all ranks), its balancing biases,
 * and its busiest expert's load over the mean (1: balanced; E / k: one expert takes every
 * token's choices); the rows the capacity dropped, all blocks together. NULL for a dense
 * model (or out of memory). */
static char *moe_stats_json(const kiln_gpt_t *m)
{
    const kiln_gpt_config *c = kiln_gpt_get_config(m);
    int E = c->n_routed_experts;
    if (E <= 0) return NULL;
    float *load = malloc(sizeof *load * (size_t)E * 2), *bias = load ? load + E : NULL;
    json_t *o = json_object(), *layers = json_array(), *loads = json_array(), *biases = json_array(),
           *ratio = json_array();
    double all_dropped = 0;
    for (int i = 0; load && i < c->n_layer; i++) {
        double dropped = 0;
        if (!kiln_gpt_moe_stats(m, i, load, bias, &dropped)) continue;
        all_dropped += dropped;
        json_t *l = json_array(), *b = json_array();
        double sum = 0, max = 0;
        for (int e = 0; e < E; e++) {
            json_array_append_new(l, json_integer((json_int_t)load[e]));
            json_array_append_new(b, json_real(bias[e]));
            sum += load[e];
            max = load[e] > max ? load[e] : max;
        }
        json_array_append_new(layers, json_integer(i));
        json_array_append_new(loads, l);
        json_array_append_new(biases, b);
        json_array_append_new(ratio, json_real(sum > 0 ? max / (sum / E) : 0));
    }
    json_t *moe = json_object();
    json_object_set_new(moe, "layers", layers);
    json_object_set_new(moe, "load", loads);
    json_object_set_new(moe, "bias", biases);
    json_object_set_new(moe, "max_over_mean", ratio);
    json_object_set_new(moe, "dropped", json_integer((json_int_t)all_dropped));
    json_object_set_new(o, "moe", moe);
    char *text = load ? json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(6)) : NULL;
    json_decref(o);
    free(load);
    return text;
}

/* A checkpoint at step (the number of steps done): ZeRO-1's shards on every rank, the
 * model and train state on rank 0, then the marker that names the complete shards (in
 * place of those of step r->committed). */
static kiln_status save(train_run *r, int64_t step)
{
    kiln_status s = KILN_OK;
    if (r->zero) s = kiln_zero1_save(r->zero, r->a.out, step); /* every rank, then a barrier */
    /* sharded experts are gathered on every rank, for rank 0 to write */
    kiln_checkpoint_info ck = {.step = step, .tokenizer = r->tok_kind, .chat_template = kiln_chat_template_default(),
                               .optimizer = r->a.optimizer, .data_seed = r->a.seed, .precision = r->a.prec,
                               .scaler = r->step_fn.scaled ? &r->scaler : NULL};
    if (s == KILN_OK && (r->rank == 0 || r->a.expert_parallel))
        s = kiln_checkpoint_save(r->a.out, r->m, r->opt, &ck, r->rank == 0);
    if (s == KILN_OK && r->rank == 0 && r->zero) s = kiln_zero1_commit(r->a.out, step, r->world, r->committed);
    return s;
}

static bool is_moe(const train_run *r) { return kiln_gpt_get_config(r->m)->n_routed_experts > 0; }

/* The loss chart, and an MoE model's router chart, redrawn from the metrics file
 * (closed for the read, reopened unless the run is over). A chart that cannot be drawn
 * does not stop the run. */
static kiln_status redraw_chart(train_run *r, bool last)
{
    kiln_metrics_close(r->metrics);
    r->metrics = NULL;
    kiln_metrics_row *rows;
    size_t nrows;
    if (kiln_metrics_read(r->metrics_path, &rows, &nrows) == KILN_OK) {
        kiln_metrics_plot_svg(rows, nrows, "kiln train: loss", r->unigram, "unigram baseline", r->chart_path);
        free(rows);
    }
    if (is_moe(r)) kiln_metrics_plot_router_svg(r->metrics_path, "kiln train: router balance", r->router_path, NULL);
    return last ? KILN_OK : kiln_metrics_open(r->metrics_path, true, &r->metrics);
}

/* After a step: the validation loss when it is due, the progress line, the metrics
 * row, a checkpoint when it is due, and the chart after each validation. */
static kiln_status step_report(train_run *r, int64_t step, double lr, double loss, double gnorm, double ms)
{
    train_args *a = &r->a;
    kiln_status s = KILN_OK;
    r->timed++;
    bool last = step + 1 == a->steps;
    r->val = NAN;
    if ((a->eval_every > 0 && (step + 1) % a->eval_every == 0) || last) s = eval_loss(r->m, r->ds, a, r->pg, &r->val);
    double elapsed = kiln__now_s() - r->t_begin, tps = (double)r->tokens_per_step / (ms / 1e3);
    char eta[32];
    fmt_eta(elapsed / (double)r->timed * (double)(a->steps - step - 1), eta, sizeof eta);
    if (!a->quiet && r->rank == 0 && ((step + 1) % a->log_every == 0 || last || !isnan(r->val))) {
        printf("step %5lld/%lld | loss %.4f | lr %.2e | %7.1f ms | %7.0f tok/s | norm %.3f | ETA %s",
               (long long)step + 1, (long long)a->steps, loss, lr, ms, tps, gnorm, eta);
        if (!isnan(r->val)) printf(" | val %.4f", r->val);
        if (r->step_fn.scaled) printf(" | scale %g", r->scaler.scale);
        printf("\n");
        fflush(stdout);
    }
    if (r->step_fn.scaled && r->scaler.skipped > r->skipped_seen && r->rank == 0)
        printf("step %lld skipped: an inf or NaN gradient at f16 loss scale %g; the scale is now %g (%lld steps "
               "skipped so far)\n", (long long)step + 1, r->scaler.scale / r->scaler.backoff, r->scaler.scale,
               (long long)r->scaler.skipped);
    r->skipped_seen = r->scaler.skipped;
    if (r->metrics) {
        char *moe = moe_stats_json(r->m);
        kiln_metrics_row row = {step + 1, loss, r->val, lr, tps, gnorm, ms, moe};
        if (kiln_metrics_write(r->metrics, &row) != KILN_OK) s = kiln_last_status();
        free(moe);
    }
    bool due = (a->save_every > 0 && (step + 1) % a->save_every == 0) || last;
    if (s == KILN_OK && due) s = save(r, step + 1);
    if (s == KILN_OK && due) r->saved = step + 1;
    if (due && r->zero) r->committed = step + 1;
    if (s == KILN_OK && r->rank == 0 && !isnan(r->val) && r->metrics) s = redraw_chart(r, last);
    return s;
}

/* A stop asked for by a signal, after step done: the checkpoint of that step (unless
 * the step wrote it), the chart, and how to resume. */
static kiln_status stop_after(train_run *r, int64_t done)
{
    kiln_status s = r->saved == done ? KILN_OK : save(r, done);
    if (s == KILN_OK) r->saved = done;
    if (r->rank == 0 && r->metrics) redraw_chart(r, true);
    int sig = stop_signal; /* 0: this rank stops because another was signalled */
    r->exit_code = 128 + (sig ? sig : SIGTERM);
    fflush(stdout);
    if (s == KILN_OK && r->rank == 0)
        fprintf(stderr, "kiln train: %s at step %lld; saved %s (step %lld). Resume with: kiln train --out %s --resume\n",
                sig == SIGINT ? "interrupted (SIGINT)" : sig == SIGTERM ? "terminated (SIGTERM)"
                                                       : "stopped (another rank was signalled)",
                (long long)done, r->a.out, (long long)done, r->a.out);
    return s;
}

/* The steps from r->start to --steps, or to a stop asked for by SIGINT or SIGTERM. */
static int train_loop(train_run *r)
{
    train_args *a = &r->a;
    kiln_status s = KILN_OK;
    r->t_begin = kiln__now_s();
    r->val = NAN;
    r->comm_after = 0;
    r->timed = 0;
    struct sigaction old[2];
    catch_stop_signals(old, NULL);
    for (int64_t step = r->start; step < a->steps && s == KILN_OK; step++) {
        double t0 = kiln__now_s(), lr = kiln_lr_cosine(step, a->warmup, a->steps, a->lr, a->min_lr), loss_sum = 0;
        double gnorm = 0;
        s = r->whole ? step_whole(r, step, lr, &loss_sum, &gnorm) : step_micro_batches(r, step, &loss_sum);
        if (s == KILN_OK) s = step_reduce_update(r, lr, &loss_sum, &gnorm);
        kiln_optim_zero_grad(r->opt);
        if (s != KILN_OK) break;
        double ms = (kiln__now_s() - t0) * 1e3, loss = loss_sum / (double)a->accum;
        /* A step whose loss or gradient norm is not finite has spoiled the weights: the run
         * stops there, before anything is saved, and says so (an f16 run's loss scaler
         * skips such steps by its own rule instead, and says that). */
        if (!isfinite(loss)) {
            s = kiln_error(KILN_ERR_ARG, "the loss became %s at step %lld; nothing of it was saved (the last checkpoint "
                           "is kept); lower --lr or raise --warmup", isnan(loss) ? "NaN" : loss > 0 ? "inf" : "-inf",
                           (long long)step + 1);
            break;
        }
        if (!isfinite(gnorm) && !r->step_fn.scaled) {
            s = kiln_error(KILN_ERR_ARG, "the gradient norm became %s at step %lld (loss %.4f); nothing of it was saved "
                           "(the last checkpoint is kept); check --attention's numbers, or lower --lr",
                           isnan(gnorm) ? "NaN" : "inf", (long long)step + 1, loss);
            break;
        }
        s = step_report(r, step, lr, loss, gnorm, ms);
        if (r->world == 1) r->stop = stop_signal != 0; /* (several ranks: agreed in step_reduce_update) */
        if (s == KILN_OK && r->stop && step + 1 < a->steps) { /* at the last step the run is done anyway */
            s = stop_after(r, step + 1);
            break;
        }
    }
    kiln_metrics_close(r->metrics);
    r->metrics = NULL;
    catch_stop_signals(NULL, old);
    if (s != KILN_OK) return cli_fail("train", NULL);
    return GO_ON;
}

/* The summary lines (unless a signal stopped the run), and everything freed; the exit
 * status. */
static int report(train_run *r)
{
    train_args *a = &r->a;
    bool ran = !a->quiet && r->rank == 0 && r->start < a->steps && !r->exit_code; /* not after a stop */
    if (ran)
        printf("done: %lld steps in %.1f s; final val loss %.4f vs unigram baseline %.4f; checkpoint %s/%s, "
               "chart %s%s%s\n",
               (long long)(a->steps - r->start), kiln__now_s() - r->t_begin, r->val, r->unigram, a->out, RUN_MODEL,
               r->chart_path, is_moe(r) ? ", router chart " : "", is_moe(r) ? r->router_path : "");
    if (r->world > 1 && r->compiled && ran)
        printf("gradient reduction: inside the compiled training step, in buckets of up to KILN_COMPILE_BUCKET_MB "
               "(default 4 MiB; KILN_COMPILE_DISABLE=coalesce: one tensor at a time), each overlapped with the rest of "
               "backward (KILN_COMPILE_DISABLE=overlap: run where the step calls it)%s\n",
               a->expert_parallel ? "; the sharded experts' gradients are not reduced" : "");
    else if (r->world > 1 && r->whole && ran)
        printf("gradient reduction: one tensor at a time after backward, inside the step function (add --compile for "
               "buckets overlapped with backward)%s\n",
               a->expert_parallel ? "; the sharded experts' gradients are not reduced" : "");
    if (r->world > 1 && !r->zero && !r->whole && ran) {
        char how[64] = "one tensor at a time after backward";
        if (r->ddp) snprintf(how, sizeof how, "%d bucket(s) during backward", kiln_ddp_num_buckets(r->ddp));
        printf("gradient reduction (%s): %.2f ms a step left after backward\n", how,
               1e3 * r->comm_after / (double)(a->steps - r->start));
    }
    kiln_compiled_free(r->compiled);
    kiln_ddp_free(r->ddp);
    kiln_zero1_free(r->zero);
    kiln_optim_free(r->opt);
    free(r->params);
    kiln_gpt_free(r->m);
    kiln_dataset_free(r->ds);
    kiln_tokenizer_free(r->tok);
    kiln_pg_free(r->pg);
    free(r->metrics_path);
    free(r->chart_path);
    free(r->router_path);
    free(r->tok_path);
    return r->exit_code;
}

int cmd_train(int argc, char **argv)
{
    static int (*const steps[])(train_run *) = {
        parse_options,   /* the flags, over a --config file */
        setup_devices,   /* threads, the device, the process group, the run folder */
        setup_data,      /* the corpus, its tokenizer, the dataset */
        build_model,     /* the model and its optimizer */
        load_checkpoint, /* --resume: weights, optimizer state, step; the metrics file */
        setup_step,      /* eager or compiled, and rank 0's parameters on every rank */
        setup_gradients, /* kiln_ddp's buckets or ZeRO-1's shards */
        print_banner,
        train_loop,      /* the steps, with evaluation, logging and checkpoints */
        report,          /* the summary, and everything freed */
    };
    train_run r = {.argc = argc, .argv = argv};
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        int rc = steps[i](&r);
        if (rc != GO_ON) return rc;
    }
    return 0;
}
