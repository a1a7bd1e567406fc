/* kiln train's options and its run folder's record of them (tools/train_options.c),
 * for the training loop (tools/cmd_train.c). */
#ifndef KILN_TOOLS_TRAIN_H
#define KILN_TOOLS_TRAIN_H

#include <stdbool.h>
#include <stdint.h>
#include "kiln/kiln.h"
#include "kiln/nn.h"

/* A step of kiln train returns GO_ON to go on, or the exit status (after printing why). */
enum { GO_ON = -1 };

/* The model config's options: a member for each row of kiln/gpt_config.def (those with a
 * flag are options; the others stay unused), a number as int64_t or double, an enum or a
 * string as its text. */
#define TRAIN_ARG_INT int64_t
#define TRAIN_ARG_NUM double
#define TRAIN_ARG_BOOL bool
#define TRAIN_ARG_ENUM const char *
#define TRAIN_ARG_STR const char *
typedef struct {
#define KILN_GPT_FIELD(member, ctype, kind, ...) TRAIN_ARG_##kind member;
#define KILN_GPT_MEMBER(...)
#define KILN_GPT_PART(...)
#include "kiln/gpt_config.def"
#undef KILN_GPT_FIELD
#undef KILN_GPT_MEMBER
#undef KILN_GPT_PART
} train_model_args;

/* Every option's value, as parsed (--help lists them). */
typedef struct {
    const char *data, *out, *config, *model, *tokenizer, *optimizer, *device, *precision, *init;
    train_model_args m; /* --layers, --heads, ...: the model config's (kiln/gpt_config.def) */
    int64_t batch, steps, warmup, accum, eval_every, eval_batches;
    int64_t save_every, log_every, seed, threads;
    double lr, min_lr, wd, clip, val_fraction, momentum, loss_scale;
    kiln_dtype prec; /* --precision, parsed */
    bool resume, overwrite, quiet, zero1, compile, expert_parallel;
    double bucket_mb;
} train_args;

/* What the options found in --out. */
typedef struct {
    bool replacing;     /* it holds a model file: resumed, or replaced with --overwrite */
    bool recorded;      /* its run.json records the options (one written before them does not) */
    char changed[1024]; /* --resume: the recorded options the flags change, as text */
} train_folder;

/* The options: defaults, then (on --resume) those the run in --out recorded, then a
 * --config file, then the flags; checked. A run already in --out is refused without
 * --resume or --overwrite, and on --resume a flag that would change its architecture,
 * tokenizer, seed or optimizer is refused naming both values. GO_ON, or the exit
 * status (0 after --help). */
int train_options_parse(int argc, char **argv, train_args *a, train_folder *f);

/* DIR/run.json: the unigram baseline (kiln plot reads it), the tokenizer, the model
 * config, and every option the run keeps ("options"), which --resume starts from. */
void train_write_run_info(const char *dir, double unigram, const char *tok, const kiln_gpt_config *c,
                          const train_args *a);

/* --overwrite: the replaced run's checkpoint, previous training state, ZeRO-1 marker and
 * charts deleted before the new run writes its own, so that none pairs with its files. */
kiln_status train_delete_replaced_run(const char *dir);

/* After a failed resume of a run whose run.json records no options (older than them, so
 * the flags had to give the architecture again): prints the model config's fields in
 * which DIR's checkpoint differs from cfg, the one the flags built. */
void train_hint_unrecorded_config(const char *dir, const kiln_gpt_config *cfg);

#endif
