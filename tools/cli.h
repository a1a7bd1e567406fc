/* Shared pieces of the kiln command-line program: options tables and messages. */
#ifndef KILN_TOOLS_CLI_H
#define KILN_TOOLS_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include "kiln/kiln.h"
#include "kiln/nn.h"

typedef enum { OPT_INT, OPT_DOUBLE, OPT_STRING, OPT_FLAG, OPT_GROUP, OPT_ALIAS } opt_type;

/* One option of a command: --name VALUE (or --name=VALUE); flags take no value (or
 * =true, =false). A flag named no-X with the destination of a flag X is its negation:
 * it sets the bool false, so of the two the last on the command line wins. Two
 * kinds of row are not options: CLI_GROUP starts a heading of --help for the rows after
 * it, and CLI_ALIAS keeps an old name working as another option (with a note that it is
 * deprecated; --help lists it beside the new one). */
typedef struct {
    const char *name;
    opt_type type;
    void *dst;        /* int64_t*, double*, const char**, bool* */
    const char *help; /* CLI_GROUP: the heading; CLI_ALIAS: the option's name now */
} cli_opt;
#define CLI_GROUP(heading) {"", OPT_GROUP, NULL, heading}
#define CLI_ALIAS(old, now) {old, OPT_ALIAS, NULL, now}

/* Parses argv against opts (NULL-name terminated). Positional arguments go to pos[]
 * (up to max_pos). Returns 0 on success, 1 after printing --help, 2 on a bad option
 * (with the reason on stderr). */
int cli_parse(const char *cmd, const char *usage, const cli_opt *opts, int argc, char **argv, const char **pos,
              int max_pos, int *n_pos);
/* Applies a JSON object of option values ({"steps": 100, ...}) from a file. */
int cli_load_config(const char *cmd, const cli_opt *opts, const char *path);
/* The name among names[0..n) closest to a typo of one (a few edits away, or the only one
 * it starts), else NULL: what "did you mean" offers. */
const char *cli_closest(const char *typo, const char *const *names, int n);
/* 1 (after saying why on stderr) when writing out would replace what the command reads
 * from in: the same file or folder, the folder a model file is read with, or an existing
 * file of in's folder that a model is read from (every file there, folder_is_input: a
 * corpus folder); else 0 (tools/cli_paths.c). */
int cli_refuse_own_input(const char *cmd, const char *in, const char *out, bool folder_is_input);
/* Prints "kiln CMD: MESSAGE" for the last kiln error (or msg) and returns 1. */
int cli_fail(const char *cmd, const char *msg);

int cmd_train(int argc, char **argv);
int cmd_sample(int argc, char **argv);
int cmd_ext(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_tokenizer(int argc, char **argv);
int cmd_plot(int argc, char **argv);
int cmd_doctor(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_compile(int argc, char **argv);
int cmd_import(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_quantize(int argc, char **argv);

/* A run folder's model file, as kiln train writes it (kiln_checkpoint_save_model, with
 * serving's default chat template; tools/cmd_train.c). */
struct kiln_gpt;
kiln_status cli_save_model(const char *dir, struct kiln_gpt *m, const char *tok_kind, int64_t step);

/* Checkpoint files inside a run folder. */
#define RUN_MODEL KILN_CHECKPOINT_MODEL /* (the checkpoint's files: kiln/nn.h) */
#define RUN_STATE KILN_CHECKPOINT_STATE
#define RUN_STATE_PREV KILN_CHECKPOINT_STATE_PREV
#define RUN_METRICS "metrics.jsonl"
#define RUN_CHART "loss.svg"
#define RUN_ROUTER_CHART "router.svg" /* a mixture-of-experts run's */
#define RUN_TOKENIZER "tokenizer.json"
#define RUN_INFO "run.json"


#endif
