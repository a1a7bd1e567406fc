/* kiln train's options: one table of them with what a run keeps of each, the run
 * folder's run.json that records them, and what --resume and --overwrite do with a run
 * already in --out (tools/train.h; the training is tools/cmd_train.c). */
#include <errno.h>
#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include "cli.h"
#include "core/parse.h" /* the one strict number parser */
#include "io/json_file.h" /* a regular file only: a FIFO run.json must not hang */
#include "kiln/io.h"
#include "train.h"

static const char *default_data(void) { return kiln_env_or_default("KILN_DATA"); }

/* dir/name, allocated. */
static char *run_file(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* One table: each option's name, type, field of train_args, what a run keeps of it,
 * and its help. run.json records every kept option ("options"); --resume starts from
 * those values, so that a run continues with the flags it began with, and then takes
 * the flags given: a KEEP_FREE one changes, a KEEP_FIXED one (the checkpoint's tensors,
 * tokens or batches depend on it) must equal the recorded value or the resume is
 * refused. */
typedef enum {
    KEEP_NOT,   /* this invocation's alone: where the run is, how loud, this machine's threads and device */
    KEEP_FREE,  /* remembered; a flag on --resume changes it (schedule, cadences, data, precision, run modes) */
    KEEP_FIXED, /* remembered; may not change on --resume (architecture, tokenizer, seed, optimizer) */
} keep_kind;

typedef struct {
    const char *name;
    opt_type type;
    size_t field; /* offset in train_args */
    keep_kind keep;
    const char *help; /* OPT_GROUP: the heading of --help; OPT_ALIAS: the option's name now */
} train_opt;

#define ARG(f) offsetof(train_args, f)
static const train_opt head_opts[] = {
    {"", OPT_GROUP, 0, KEEP_NOT, "data"},
    {"data", OPT_STRING, ARG(data), KEEP_FREE, "text file or folder to train on ($KILN_DATA)"},
    {"tokenizer", OPT_STRING, ARG(tokenizer), KEEP_FIXED, "byte, bpe:VOCAB (trained on the data), or a tokenizer.json"},
    {"val-fraction", OPT_DOUBLE, ARG(val_fraction), KEEP_FREE, "tail of the corpus kept for validation"},
    {"", OPT_GROUP, 0, KEEP_NOT, "model"},
    {"arch", OPT_STRING, ARG(model), KEEP_FIXED, "the architecture: gpt2 (LayerNorm, learned positions, GELU) or llama (RMSNorm, RoPE, "
                                                  "SwiGLU)"},
    {"init", OPT_STRING, ARG(init), KEEP_FIXED, "start from this model: a kiln run folder or model file, or a Hugging "
                                                "Face folder (docs/hf.md); its weights, architecture and tokenizer "
                                                "replace --arch, --layers, --width, --heads, --kv-heads, --ffn and "
                                                "--tokenizer"},
    };

/* The model config's options: kiln/gpt_config.def's rows (those without a flag left out
 * when the table is put together), under "model" or, for the mixture of experts' fields,
 * under their own heading. */
#define OPT_TYPE_INT OPT_INT
#define OPT_TYPE_NUM OPT_DOUBLE
#define OPT_TYPE_BOOL OPT_FLAG
#define OPT_TYPE_ENUM OPT_STRING
#define OPT_TYPE_STR OPT_STRING
#define WHEN_ALWAYS false
#define WHEN_SET false
#define WHEN_ROPE false
#define WHEN_MLA false
#define WHEN_MOE true
static const struct {
    train_opt o;
    bool moe;
} model_opts[] = {
#define KILN_GPT_FIELD(member, ctype, kind, def, lo, hi, flags, names, when, flag, keep, help) \
    {{flag, OPT_TYPE_##kind, ARG(m.member), KEEP_##keep, help}, WHEN_##when},
#define KILN_GPT_MEMBER(...)
#define KILN_GPT_PART(...)
#include "kiln/gpt_config.def"
#undef KILN_GPT_FIELD
#undef KILN_GPT_MEMBER
#undef KILN_GPT_PART
};

static const train_opt tail_opts[] = {
    {"", OPT_GROUP, 0, KEEP_NOT, "optimization"},
    {"steps", OPT_INT, ARG(steps), KEEP_FREE, "optimizer steps in total"},
    {"batch", OPT_INT, ARG(batch), KEEP_FREE, "sequences per micro-batch B, all ranks together (each rank takes B / "
                                              "world)"},
    {"accum", OPT_INT, ARG(accum), KEEP_FREE, "micro-batches per step (gradient accumulation)"},
    {"optimizer", OPT_STRING, ARG(optimizer), KEEP_FIXED, "adamw or sgd"},
    {"lr", OPT_DOUBLE, ARG(lr), KEEP_FREE, "peak learning rate"},
    {"min-lr", OPT_DOUBLE, ARG(min_lr), KEEP_FREE, "final learning rate of the cosine schedule"},
    {"warmup", OPT_INT, ARG(warmup), KEEP_FREE, "linear warmup steps"},
    {"wd", OPT_DOUBLE, ARG(wd), KEEP_FREE, "weight decay (matrices and embeddings only)"},
    {"momentum", OPT_DOUBLE, ARG(momentum), KEEP_FREE, "SGD momentum"},
    {"clip", OPT_DOUBLE, ARG(clip), KEEP_FREE, "global gradient-norm clip; 0 = off"},
    {"seed", OPT_INT, ARG(seed), KEEP_FIXED, "seed for weights, batches and dropout"},
    {"", OPT_GROUP, 0, KEEP_NOT, "precision and speed"},
    {"precision", OPT_STRING, ARG(precision), KEEP_FREE, "f32, or bf16 / f16 mixed precision: matmuls and attention "
                                                         "in that type, weights, optimizer state, norms and loss in "
                                                         "f32 (f16 with dynamic loss scaling)"},
    {"loss-scale", OPT_DOUBLE, ARG(loss_scale), KEEP_FREE, "--precision f16: the loss scale to start from (halved on "
                                                           "an inf or NaN gradient, doubled after 2000 good steps; "
                                                           "kept in checkpoints)"},
    {"compile", OPT_FLAG, ARG(compile), KEEP_FREE, "run each step (forward, backward of every --accum micro-batch, "
                                                   "clipping, update) as one graph of generated kernels (kiln compile)"},
    {"threads", OPT_INT, ARG(threads), KEEP_NOT, "threads per rank; 0 = the cores over the ranks on this machine "
                                                 "($KILN_NUM_THREADS)"},
    {"device", OPT_STRING, ARG(device), KEEP_NOT, "where the model and batches live: cpu, opencl[:N] (`kiln doctor` "
                                                  "lists them; default $KILN_DEVICE, else cpu)"},
    {"", OPT_GROUP, 0, KEEP_NOT, "parallelism (several processes)"},
    {"zero1", OPT_FLAG, ARG(zero1), KEEP_FREE, "shard AdamW's moments across the ranks (ZeRO stage 1)"},
    {"expert-parallel", OPT_FLAG, ARG(expert_parallel), KEEP_FREE, "shard each MoE block's routed experts across the "
                                                                   "ranks (--experts a multiple of them): rows go to "
                                                                   "their experts' rank and back by all-to-all"},
    {"bucket-mb", OPT_DOUBLE, ARG(bucket_mb), KEEP_FREE, "with several ranks: gradient buckets of this many MiB "
                                                         "reduced during backward (0: one tensor at a time after it)"},
    {"", OPT_GROUP, 0, KEEP_NOT, "output and the run folder"},
    {"out", OPT_STRING, ARG(out), KEEP_NOT, "run folder: checkpoints, metrics.jsonl, loss.svg, run.json (the settings "
                                            "--resume takes)"},
    {"resume", OPT_FLAG, ARG(resume), KEEP_NOT, "continue the run in --out from its checkpoint, with the settings in "
                                                "its run.json (flags change the schedule and cadences, not the "
                                                "architecture, tokenizer, seed or optimizer)"},
    {"overwrite", OPT_FLAG, ARG(overwrite), KEEP_NOT, "train a new run in --out even though it holds one (its "
                                                      "checkpoint is deleted)"},
    {"config", OPT_STRING, ARG(config), KEEP_NOT, "JSON file of these options ({\"steps\": 500, ...}); flags win"},
    {"eval-every", OPT_INT, ARG(eval_every), KEEP_FREE, "steps between validation losses; 0 = only at the end"},
    {"eval-batches", OPT_INT, ARG(eval_batches), KEEP_FREE, "validation batches per evaluation"},
    {"save-every", OPT_INT, ARG(save_every), KEEP_FREE, "steps between checkpoints (and one at the end, and one on "
                                                        "SIGINT or SIGTERM)"},
    {"log-every", OPT_INT, ARG(log_every), KEEP_FREE, "steps between progress lines"},
    {"quiet", OPT_FLAG, ARG(quiet), KEEP_NOT, "only errors and the final summary"},
    /* old names, still taken (with a note) */
    {"model", OPT_ALIAS, 0, KEEP_NOT, "arch"},
    {"top-k", OPT_ALIAS, 0, KEEP_NOT, "experts-per-token"},
};
#undef ARG

/* One table of every option: head_opts, the model's, the heading of the mixture of
 * experts and its options, tail_opts. */
enum { MAX_TRAIN_OPTS = 128 };
static train_opt train_opts[MAX_TRAIN_OPTS];
static size_t N_TRAIN_OPTS;

static void train_opts_init(void)
{
    if (N_TRAIN_OPTS) return;
    size_t n = 0;
    for (size_t i = 0; i < sizeof head_opts / sizeof head_opts[0]; i++) train_opts[n++] = head_opts[i];
    for (int moe = 0; moe < 2; moe++) {
        if (moe) train_opts[n++] = (train_opt){"", OPT_GROUP, 0, KEEP_NOT, "mixture of experts (--arch llama)"};
        for (size_t i = 0; i < sizeof model_opts / sizeof model_opts[0]; i++)
            if (model_opts[i].o.name && model_opts[i].moe == moe) train_opts[n++] = model_opts[i].o;
    }
    for (size_t i = 0; i < sizeof tail_opts / sizeof tail_opts[0]; i++) train_opts[n++] = tail_opts[i];
    N_TRAIN_OPTS = n;
}
_Static_assert(sizeof head_opts / sizeof head_opts[0] + sizeof model_opts / sizeof model_opts[0] + 1 +
                   sizeof tail_opts / sizeof tail_opts[0] <= MAX_TRAIN_OPTS, "MAX_TRAIN_OPTS");

/* The defaults: the model's from kiln/gpt_config.def (an enum as its name, an empty
 * string as none), the others here. */
#define TRAIN_DEF_INT(member, def, names) .m.member = def,
#define TRAIN_DEF_NUM(member, def, names) .m.member = def,
#define TRAIN_DEF_BOOL(member, def, names) .m.member = def,
#define TRAIN_DEF_ENUM(member, def, names) .m.member = ((const char *const[]){UNPAREN names})[def],
#define TRAIN_DEF_STR(member, def, names) .m.member = *def ? def : NULL,
#define KILN_GPT_NAMES(...) (__VA_ARGS__) /* (parenthesised: one argument of the macros below) */
#define UNPAREN(...) __VA_ARGS__
static train_args train_defaults(void)
{
    train_args a = {
#define KILN_GPT_FIELD(member, ctype, kind, def, lo, hi, flags, names, ...) TRAIN_DEF_##kind(member, def, names)
#define KILN_GPT_MEMBER(...)
#define KILN_GPT_PART(...)
#include "kiln/gpt_config.def"
#undef KILN_GPT_FIELD
#undef KILN_GPT_MEMBER
#undef KILN_GPT_PART
        .data = default_data(), .out = "runs/default", .config = NULL, .model = "gpt2", .tokenizer = "byte",
        .optimizer = "adamw", .batch = 16, .steps = 1000, .warmup = 50, .accum = 1, .eval_every = 100,
        .eval_batches = 8, .save_every = 500, .log_every = 1, .seed = 1337, .threads = 0, .lr = 1e-3, .min_lr = 1e-4,
        .wd = 0.1, .clip = 1.0, .val_fraction = 0.1, .momentum = 0.9, .bucket_mb = 25, .precision = "f32",
        .loss_scale = 65536,
    };
    a.m.n_kv_head = 0; /* --kv-heads 0: the model's default (as many as --heads for gpt2) */
    return a;
}
#undef KILN_GPT_NAMES
#undef UNPAREN

static void *opt_field(train_args *a, const train_opt *o) { return (char *)a + o->field; }
static const void *opt_cfield(const train_args *a, const train_opt *o) { return (const char *)a + o->field; }

/* An option's value as run.json records it. */
static json_t *opt_to_json(const train_args *a, const train_opt *o)
{
    const void *p = opt_cfield(a, o);
    switch (o->type) {
    case OPT_INT: return json_integer((json_int_t) * (const int64_t *)p);
    case OPT_DOUBLE: return json_real(*(const double *)p);
    case OPT_STRING: return *(const char *const *)p ? json_string(*(const char *const *)p) : json_null();
    case OPT_FLAG: return json_boolean(*(const bool *)p);
    case OPT_GROUP:
    case OPT_ALIAS: break; /* (not options: KEEP_NOT) */
    }
    return NULL;
}

/* Sets an option from run.json's value; false if the value has another type. Strings
 * point into v, which must outlive a. */
static bool opt_from_json(train_args *a, const train_opt *o, const json_t *v)
{
    void *p = opt_field(a, o);
    switch (o->type) {
    case OPT_INT:
        if (!json_is_integer(v)) return false;
        *(int64_t *)p = (int64_t)json_integer_value(v);
        return true;
    case OPT_DOUBLE:
        if (!json_is_number(v)) return false;
        *(double *)p = json_number_value(v);
        return true;
    case OPT_STRING:
        if (!json_is_string(v) && !json_is_null(v)) return false;
        *(const char **)p = json_string_value(v); /* NULL for null */
        return true;
    case OPT_FLAG:
        if (!json_is_boolean(v)) return false;
        *(bool *)p = json_is_true(v);
        return true;
    case OPT_GROUP:
    case OPT_ALIAS: break;
    }
    return false;
}

static bool opt_equal(const train_args *x, const train_args *y, const train_opt *o)
{
    const void *p = opt_cfield(x, o), *q = opt_cfield(y, o);
    switch (o->type) {
    case OPT_INT: return *(const int64_t *)p == *(const int64_t *)q;
    case OPT_DOUBLE: return *(const double *)p == *(const double *)q;
    case OPT_FLAG: return *(const bool *)p == *(const bool *)q;
    case OPT_STRING: {
        const char *s = *(const char *const *)p, *t = *(const char *const *)q;
        return s == t || (s && t && !strcmp(s, t));
    }
    case OPT_GROUP:
    case OPT_ALIAS: return true;
    }
    return false;
}

/* An option's value as a flag would give it. */
static void opt_text(const train_args *a, const train_opt *o, char *buf, size_t n)
{
    const void *p = opt_cfield(a, o);
    switch (o->type) {
    case OPT_INT: snprintf(buf, n, "%lld", (long long)*(const int64_t *)p); break;
    case OPT_DOUBLE: snprintf(buf, n, "%.10g", *(const double *)p); break;
    case OPT_FLAG: snprintf(buf, n, "%s", *(const bool *)p ? "true" : "false"); break;
    case OPT_STRING: snprintf(buf, n, "%s", *(const char *const *)p ? *(const char *const *)p : "(none)"); break;
    case OPT_GROUP:
    case OPT_ALIAS: *buf = '\0'; break;
    }
}

/* Sets the options a run recorded (run.json's "options") over a; 1 after an error. */
static int apply_kept(train_args *a, const char *out, const json_t *kept)
{
    for (size_t i = 0; kept && i < N_TRAIN_OPTS; i++) {
        const train_opt *o = &train_opts[i];
        const json_t *v = o->keep != KEEP_NOT ? json_object_get(kept, o->name) : NULL;
        for (size_t k = 0; !v && o->keep != KEEP_NOT && k < N_TRAIN_OPTS; k++) /* recorded under an old name */
            if (train_opts[k].type == OPT_ALIAS && !strcmp(train_opts[k].help, o->name))
                v = json_object_get(kept, train_opts[k].name);
        if (v && !opt_from_json(a, o, v)) {
            fprintf(stderr, "kiln train: %s/%s: option \"%s\" has the wrong type\n", out, RUN_INFO, o->name);
            return 1;
        }
    }
    return 0;
}

/* The defaults, then the options a run recorded (kept, or NULL), then a --config file,
 * then the flags. */
static int parse_flags(int argc, char **argv, train_args *a, const json_t *kept)
{
    const char *out = a->out;
    *a = train_defaults();
    if (apply_kept(a, out, kept)) return 1;
    cli_opt opts[MAX_TRAIN_OPTS + 1];
    for (size_t i = 0; i < N_TRAIN_OPTS; i++)
        opts[i] = (cli_opt){train_opts[i].name, train_opts[i].type,
                            train_opts[i].type >= OPT_GROUP ? NULL : opt_field(a, &train_opts[i]), train_opts[i].help};
    opts[N_TRAIN_OPTS] = (cli_opt){NULL, 0, NULL, NULL};
    /* A config file first, so that flags given with it override it. */
    for (int i = 1; i < argc; i++) {
        const char *cfg = !strcmp(argv[i], "--config") && i + 1 < argc ? argv[i + 1]
                        : !strncmp(argv[i], "--config=", 9)             ? argv[i] + 9
                                                                         : NULL;
        if (cfg && cli_load_config("train", opts, cfg)) return 2;
    }
    int rc = cli_parse("train", "[options]", opts, argc, argv, NULL, 0, NULL);
    if (rc) return rc == 1 ? 0 : 2;
    return GO_ON;
}

/* The step recorded in a model file; -1 if it has none or cannot be read. */
static int64_t checkpoint_step(const char *model_path)
{
    kiln_safetensors_t *f = NULL;
    int64_t step = -1;
    if (kiln_safetensors_load(model_path, &f) == KILN_OK && kiln_safetensors_meta(f, "step") &&
        kiln__parse_i64(kiln_safetensors_meta(f, "step"), 0, INT64_MAX, "the model's step", &step) != KILN_OK)
        step = -1;
    kiln_safetensors_free(f);
    kiln_clear_error();
    return step;
}

/* --out's run.json as found (NULL if none): the options' strings point into it, so it
 * lives as long as the program (a global, so leak checkers see it as reachable). */
static json_t *recorded_run;

/* A run already in --out (it has a model file). Without --resume or --overwrite it is
 * refused, finished or stopped, so that no run is replaced by accident. With --resume
 * the flags are parsed again over the options its run.json recorded; a KEEP_FIXED one
 * that differs is refused naming both values, and f->changed lists the KEEP_FREE ones
 * that differ. (A run.json from before "options" gives none: the flags alone.) */
static int adopt_run(int argc, char **argv, train_args *a, train_folder *f)
{
    if (a->resume && a->overwrite) {
        fprintf(stderr, "kiln train: --resume continues the run in %s and --overwrite replaces it: give one\n", a->out);
        return 2;
    }
    char *info_path = run_file(a->out, RUN_INFO), *model_path = run_file(a->out, RUN_MODEL);
    if (!info_path || !model_path) return cli_fail("train", "out of memory");
    struct stat st;
    f->replacing = stat(model_path, &st) == 0;
    recorded_run = kiln__json_load(info_path, 0, NULL, NULL); /* (none, or not a file: no settings recorded) */
    if (!recorded_run) kiln_clear_error();
    const json_t *kept = json_object_get(recorded_run, "options");
    f->recorded = json_is_object(kept);
    int rc = GO_ON;
    if (!a->resume && !a->overwrite && f->replacing) {
        int64_t step = checkpoint_step(model_path);
        const json_t *target = json_object_get(recorded_run, "steps"); /* (older run.json files have it too) */
        int64_t steps = json_is_integer(target) ? (int64_t)json_integer_value(target) : -1;
        if (step >= 0 && steps >= 0 && step >= steps)
            fprintf(stderr, "kiln train: %s holds a finished run (step %lld of %lld); --resume --steps N (N > %lld) "
                            "trains it on, --overwrite trains a new run in its place\n",
                    a->out, (long long)step, (long long)steps, (long long)step);
        else if (step >= 0 && steps >= 0)
            fprintf(stderr, "kiln train: %s holds a run stopped at step %lld of %lld; --resume continues it, "
                            "--overwrite trains a new run in its place\n",
                    a->out, (long long)step, (long long)steps);
        else
            fprintf(stderr, "kiln train: %s holds a run (%s); --resume continues it, --overwrite trains a new run in "
                            "its place\n", a->out, RUN_MODEL);
        rc = 1;
    } else if (a->resume && !f->replacing) {
        fprintf(stderr, "kiln train: --resume: %s holds no checkpoint (%s) to continue from\n", a->out, RUN_MODEL);
        rc = 1;
    } else if (a->resume && json_is_object(kept)) {
        train_args was = train_defaults(); /* the run as recorded */
        rc = apply_kept(&was, a->out, kept) ? 1 : parse_flags(argc, argv, a, kept);
        size_t used = 0;
        for (size_t i = 0; rc == GO_ON && i < N_TRAIN_OPTS; i++) {
            const train_opt *o = &train_opts[i];
            if (o->keep == KEEP_NOT || opt_equal(a, &was, o)) continue;
            char now[256], then[256];
            opt_text(a, o, now, sizeof now);
            opt_text(&was, o, then, sizeof then);
            if (o->keep == KEEP_FIXED) {
                fprintf(stderr, "kiln train: --%s %s does not match the run: it was trained with --%s %s (%s); a run's "
                                "architecture, tokenizer, seed and optimizer cannot change on --resume (leave out "
                                "--%s, or train a new run: another --out, or --overwrite)\n",
                        o->name, now, o->name, then, info_path, o->name);
                rc = 1;
            } else if (used < sizeof f->changed) {
                used += (size_t)snprintf(f->changed + used, sizeof f->changed - used, "%s--%s %s (was %s)",
                                         used ? ", " : "", o->name, now, then);
            }
        }
    }
    free(info_path);
    free(model_path);
    return rc;
}

kiln_status train_delete_replaced_run(const char *dir)
{
    const char *files[] = {RUN_MODEL, RUN_STATE, RUN_STATE_PREV, RUN_CHART, RUN_ROUTER_CHART, "zero1.complete"};
    kiln_status s = KILN_OK;
    for (size_t i = 0; s == KILN_OK && i < sizeof files / sizeof files[0]; i++) {
        char *p = run_file(dir, files[i]);
        if (!p) s = kiln_error(KILN_ERR_OOM, "out of memory");
        else if (unlink(p) != 0 && errno != ENOENT) s = kiln_error(KILN_ERR_IO, "--overwrite: cannot delete %s: %s", p, strerror(errno));
        free(p);
    }
    return s;
}

void train_write_run_info(const char *dir, double unigram, const char *tok, const kiln_gpt_config *c, const train_args *a)
{
    train_opts_init();
    char *path = run_file(dir, RUN_INFO), *cfg = kiln_gpt_config_to_json(c);
    json_t *cj = cfg ? json_loads(cfg, 0, NULL) : NULL, *opts = json_object();
    for (size_t i = 0; opts && i < N_TRAIN_OPTS; i++)
        if (train_opts[i].keep != KEEP_NOT) json_object_set_new(opts, train_opts[i].name, opt_to_json(a, &train_opts[i]));
    json_t *o = json_pack("{s:f,s:s,s:o?,s:s?,s:I,s:I,s:f,s:o?}", "unigram_entropy", unigram, "tokenizer", tok, "config",
                          cj, "data", a->data, "steps", (json_int_t)a->steps, "batch", (json_int_t)a->batch, "lr", a->lr,
                          "options", opts);
    if (o && path) json_dump_file(o, path, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(o);
    free(cfg);
    free(path);
}

/* The options' values checked, each and together. */
static int check_options(train_args *a)
{
    const struct {
        const char *name;
        int64_t v, lo;
    } ints[] = {{"layers", a->m.n_layer, 1}, {"heads", a->m.n_head, 1}, {"kv-heads", a->m.n_kv_head, 0},
                {"width", a->m.n_embd, 1}, {"context", a->m.block_size, 1}, {"ffn", a->m.ffn_hidden, 0},
                {"batch", a->batch, 1}, {"threads", a->threads, 0}};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (ints[i].v < ints[i].lo || ints[i].v > (1 << 24)) {
            fprintf(stderr, "kiln train: --%s = %lld is outside %lld..%d\n", ints[i].name, (long long)ints[i].v,
                    (long long)ints[i].lo, 1 << 24);
            return 2;
        }
    if (a->batch < 1 || a->steps < 0 || a->accum < 1 || a->m.block_size < 1 || a->eval_batches < 1 || a->log_every < 1 ||
        !(a->lr > 0) || a->min_lr < 0)
        return cli_fail("train", "--batch, --accum, --context, --eval-batches, --log-every must be >= 1, --steps >= 0, "
                                 "--lr > 0, --min-lr >= 0");
    if (strcmp(a->optimizer, "adamw") && strcmp(a->optimizer, "sgd"))
        return cli_fail("train", "--optimizer must be adamw or sgd");
    if (kiln_dtype_parse(a->precision, &a->prec) != KILN_OK ||
        !kiln_dtype_is_f32_or_half(a->prec))
        return cli_fail("train", "--precision must be f32, bf16 or f16");
    if (!(a->loss_scale >= 1 && a->loss_scale <= 1e30))
        return cli_fail("train", "--loss-scale must be in 1..1e30");
    if (a->expert_parallel && a->zero1)
        return cli_fail("train", "--expert-parallel and --zero1 do not go together (ZeRO-1's shards assume every rank "
                                 "holds every parameter)");
    return GO_ON;
}

int train_options_parse(int argc, char **argv, train_args *a, train_folder *f)
{
    /* The first parse finds --out and --resume, and a bad value is named before any run
     * folder is looked at; adopt_run parses again over the run's recorded options when
     * it resumes one. */
    train_opts_init();
    *f = (train_folder){0};
    *a = (train_args){0};
    int rc = parse_flags(argc, argv, a, NULL);
    if (rc == GO_ON) rc = check_options(a);
    /* --init X --out X: said as such before the run in X is (a start that would replace
     * the model it starts from) */
    if (rc == GO_ON && a->init && !a->resume && cli_refuse_own_input("train", a->init, a->out, false)) rc = 1;
    if (rc == GO_ON) rc = adopt_run(argc, argv, a, f);
    if (rc == GO_ON) rc = check_options(a);
    return rc;
}

void train_hint_unrecorded_config(const char *dir, const kiln_gpt_config *cfg)
{
    char *path = run_file(dir, RUN_MODEL), *mine = kiln_gpt_config_to_json(cfg), list[1024];
    kiln_safetensors_t *f = NULL;
    json_t *built = mine ? json_loads(mine, 0, NULL) : NULL, *saved = NULL;
    if (path && kiln_safetensors_load(path, &f) == KILN_OK && kiln_safetensors_meta(f, "config"))
        saved = json_loads(kiln_safetensors_meta(f, "config"), 0, NULL);
    size_t n = 0;
    const char *key;
    json_t *v;
    json_object_foreach(saved, key, v)
    {
        json_t *b = json_object_get(built, key);
        if (b && json_equal(v, b)) continue;
        char *was = json_dumps(v, JSON_ENCODE_ANY), *now = b ? json_dumps(b, JSON_ENCODE_ANY) : NULL;
        n += (size_t)snprintf(list + n, sizeof list - n, "%s%s %s (these flags: %s)", n ? ", " : "", key,
                              was ? was : "?", now ? now : "none");
        free(was);
        free(now);
        if (n >= sizeof list) break; /* (cut short) */
    }
    if (n)
        fprintf(stderr, "kiln train: the checkpoint's model differs from the one these flags build: %s; its %s "
                        "records no settings (older than that), so give the flags it was trained with\n", list, RUN_INFO);
    json_decref(built);
    json_decref(saved);
    kiln_safetensors_free(f);
    kiln_clear_error();
    free(mine);
    free(path);
}
