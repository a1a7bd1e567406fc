/* Training checkpoints (kiln/nn.h, "Training checkpoints"; docs/model.md, "Checkpoints"):
 * a run folder's model file and training state, written and read back so that a resumed
 * run repeats the losses of an uninterrupted one bit for bit. `kiln train` (tools/cmd_train.c)
 * is one user; the format is this file's. */
#include <errno.h>
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "core/file.h" /* kiln__file_check_target */
#include "core/parse.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/optim.h"

static char *join(const char *dir, const char *file)
{
    size_t n = strlen(dir) + strlen(file) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, file);
    return p;
}

/* ts[i] = parameter i whole: an expert shard gathered from every rank (a collective
 * that every rank of the model's group runs; the others are the parameters themselves),
 * names[i] its name. Call inside a scope. */
static kiln_status whole_params(kiln_gpt_t *m, const char **names, kiln_tensor_t **ts)
{
    for (int i = 0; i < kiln_gpt_num_params(m); i++)
        if (!(ts[i] = kiln_gpt_gather_param(m, i, kiln_gpt_param(m, i, &names[i])))) return kiln_last_status();
    return KILN_OK;
}

/* The model file from its whole parameters ts (whole_params). */
static kiln_status save_model_file(const char *dir, kiln_gpt_t *m, const char **names, kiln_tensor_t **ts,
                                   const kiln_checkpoint_info *info)
{
    char *cfg = kiln_gpt_config_to_json(kiln_gpt_get_config(m)), *path = join(dir, KILN_CHECKPOINT_MODEL), stepbuf[32];
    kiln_status s = cfg && path ? KILN_OK : kiln_error(KILN_ERR_OOM, "checkpoint: out of memory");
    snprintf(stepbuf, sizeof stepbuf, "%lld", (long long)info->step);
    const char *meta[] = {"format", "kiln-gpt-1", "config", cfg, "tokenizer", info->tokenizer ? info->tokenizer : "byte",
                          "step", stepbuf, info->chat_template ? "chat_template" : NULL, info->chat_template, NULL};
    if (s == KILN_OK) s = kiln_safetensors_save(path, names, ts, kiln_gpt_num_params(m), meta);
    free(cfg);
    free(path);
    return s;
}

kiln_status kiln_checkpoint_save_model(const char *dir, kiln_gpt_t *m, const kiln_checkpoint_info *info)
{
    if (!dir || !m || !info) return kiln_error(KILN_ERR_ARG, "checkpoint_save_model: dir, model and info must not be NULL");
    int n = kiln_gpt_num_params(m);
    const char **names = malloc(sizeof *names * (size_t)n);
    kiln_tensor_t **ts = malloc(sizeof *ts * (size_t)n);
    kiln_status s = names && ts ? KILN_OK : kiln_error(KILN_ERR_OOM, "checkpoint: out of memory");
    kiln_scope_begin();
    if (s == KILN_OK) s = whole_params(m, names, ts);
    if (s == KILN_OK) s = save_model_file(dir, m, names, ts, info);
    kiln_scope_end();
    free(names);
    free(ts);
    return s;
}

/* The model file and the training state. A model whose experts are sharded is
 * gathered first on every rank of its group, of which only the one with write set
 * writes the files. */
kiln_status kiln_checkpoint_save(const char *dir, kiln_gpt_t *m, kiln_optim_t *opt, const kiln_checkpoint_info *info,
                                 bool write)
{
    if (!dir || !m || !opt || !info || !info->optimizer)
        return kiln_error(KILN_ERR_ARG, "checkpoint_save: dir, model, optimizer and info (with its optimizer's name) "
                          "must not be NULL");
    const kiln_loss_scaler *scaler = info->scaler;
    int n = kiln_gpt_num_params(m);
    const char **names = malloc(sizeof *names * (size_t)(3 * n + 1));
    kiln_tensor_t **ts = malloc(sizeof *ts * (size_t)(3 * n + 1));
    char **owned = calloc((size_t)(3 * n + 1), sizeof *owned);
    kiln_status s = names && ts && owned ? KILN_OK : kiln_error(KILN_ERR_OOM, "checkpoint: out of memory");
    char stepbuf[32], seedbuf[32], offbuf[32], dseed[32];
    snprintf(stepbuf, sizeof stepbuf, "%lld", (long long)info->step);
    kiln_rng_state rng = kiln_rng_get_state();
    snprintf(seedbuf, sizeof seedbuf, "%llu", (unsigned long long)rng.seed);
    snprintf(offbuf, sizeof offbuf, "%llu", (unsigned long long)rng.offset);
    snprintf(dseed, sizeof dseed, "%lld", (long long)info->data_seed);
    /* f16's loss scaler: its scale and counts, so that a resumed run skips and grows
     * where the uninterrupted one would */
    char scale[32] = "", good[32] = "", skipped[32] = "", osteps[32];
    /* the optimizer's own step count: below the run's step by the skipped ones */
    snprintf(osteps, sizeof osteps, "%lld", (long long)kiln_optim_steps(opt));
    if (scaler) {
        snprintf(scale, sizeof scale, "%.17g", scaler->scale);
        snprintf(good, sizeof good, "%lld", (long long)scaler->good);
        snprintf(skipped, sizeof skipped, "%lld", (long long)scaler->skipped);
    }
    char *state_path = join(dir, KILN_CHECKPOINT_STATE);
    kiln_scope_begin();
    if (s == KILN_OK) s = whole_params(m, names, ts);
    if (s == KILN_OK) {
        /* The training state first: a model file newer than its state is detected on
         * resume by the step numbers, never silently mixed. */
        int k = 0;
        for (int i = 0; s == KILN_OK && i < n; i++)
            for (int slot = 0; s == KILN_OK && slot < kiln_optim_num_slots(opt); slot++) {
                kiln_tensor_t *t = kiln_optim_state(opt, i, slot);
                if (!t) continue;
                if (!(t = kiln_gpt_gather_param(m, i, t))) {
                    s = kiln_last_status();
                    break;
                }
                size_t len = strlen(names[i]) + 16;
                owned[k] = malloc(len);
                snprintf(owned[k], len, "opt.%d.%s", slot, names[i]);
                names[n + k] = owned[k];
                ts[n + k] = t;
                k++;
            }
        const char *smeta[] = {"format", "kiln-train-state-1", "step", stepbuf, "rng_seed", seedbuf, "rng_offset", offbuf,
                               "optimizer", info->optimizer, "data_seed", dseed, "optim_steps", osteps, "precision",
                               kiln_dtype_name(info->precision),
                               scaler ? "loss_scale" : NULL, scale, "loss_scale_good", good,
                               "loss_scale_skipped", skipped, NULL};
        /* The previous state stays as KILN_CHECKPOINT_STATE_PREV until the new pair is written, so a
         * crash between the two files leaves a state that matches the model file. */
        char *prev_path = join(dir, KILN_CHECKPOINT_STATE_PREV);
        struct stat st;
        if (s == KILN_OK && write && prev_path && stat(state_path, &st) == 0 &&
            (s = kiln__file_check_target(prev_path, NULL)) == KILN_OK && rename(state_path, prev_path) != 0)
            s = kiln_error(KILN_ERR_IO, "cannot keep %s as %s: %s", state_path, prev_path, strerror(errno));
        if (s == KILN_OK && write) s = kiln_safetensors_save(state_path, names + n, ts + n, k, smeta);
        if (s == KILN_OK && write) s = save_model_file(dir, m, names, ts, info);
        free(prev_path);
    }
    kiln_scope_end();
    for (int i = 0; owned && i < 3 * n + 1; i++) free(owned[i]);
    free(owned);
    free(names);
    free(ts);
    free(state_path);
    return s;
}

/* Do the two files record the same step? */
static bool state_matches_model(const char *state_path, const char *model_path)
{
    kiln_safetensors_t *a = NULL, *b = NULL;
    bool ok = kiln_safetensors_load(state_path, &a) == KILN_OK && kiln_safetensors_load(model_path, &b) == KILN_OK &&
              kiln_safetensors_meta(a, "step") && kiln_safetensors_meta(b, "step") &&
              !strcmp(kiln_safetensors_meta(a, "step"), kiln_safetensors_meta(b, "step"));
    kiln_safetensors_free(a);
    kiln_safetensors_free(b);
    kiln_clear_error();
    return ok;
}

/* A number of a checkpoint's metadata as core/parse.h read it (s): a malformed one is
 * an error naming the file and the key. True when it is one. */
static bool meta_number(const char *path, const char *key, kiln_status s)
{
    if (s == KILN_OK) return false;
    char why[512];
    snprintf(why, sizeof why, "%s", kiln_last_error());
    kiln_error(KILN_ERR_FORMAT, "%s: the metadata key %s is malformed: %s", path, key, why);
    return true;
}

kiln_status kiln_checkpoint_load(const char *dir, kiln_gpt_t *m, kiln_optim_t *opt, kiln_checkpoint_info *info)
{
    if (!dir || !m || !opt || !info || !info->optimizer)
        return kiln_error(KILN_ERR_ARG, "checkpoint_load: dir, model, optimizer and info (with its optimizer's name) "
                          "must not be NULL");
    kiln_loss_scaler *scaler = info->scaler;
    int64_t *step = &info->step;
    char *model_path = join(dir, KILN_CHECKPOINT_MODEL), *state_path = join(dir, KILN_CHECKPOINT_STATE);
    if (!model_path || !state_path) {
        free(model_path);
        free(state_path);
        return kiln_error(KILN_ERR_OOM, "checkpoint: out of memory");
    }
    kiln_safetensors_t *f = NULL;
    kiln_status s = kiln_gpt_load_weights(m, model_path);
    if (s == KILN_OK && !state_matches_model(state_path, model_path)) {
        /* A save interrupted between its two files: the kept previous state matches. */
        char *prev = join(dir, KILN_CHECKPOINT_STATE_PREV);
        if (prev && state_matches_model(prev, model_path)) {
            free(state_path);
            state_path = prev;
        } else {
            free(prev);
        }
    }
    if (s == KILN_OK) s = kiln_safetensors_load(state_path, &f);
    if (s == KILN_OK) {
        const char *st = kiln_safetensors_meta(f, "step"), *rs = kiln_safetensors_meta(f, "rng_seed"),
                   *ro = kiln_safetensors_meta(f, "rng_offset");
        kiln_safetensors_t *mf = NULL;
        const char *mst = NULL;
        if (kiln_safetensors_load(model_path, &mf) == KILN_OK) mst = kiln_safetensors_meta(mf, "step");
        const char *opt_name = kiln_safetensors_meta(f, "optimizer"), *dseed = kiln_safetensors_meta(f, "data_seed");
        char seedbuf[32];
        snprintf(seedbuf, sizeof seedbuf, "%lld", (long long)info->data_seed);
        if (!st || !rs || !ro) s = kiln_error(KILN_ERR_FORMAT, "%s: missing step or RNG state", state_path);
        else if (!opt_name || strcmp(opt_name, info->optimizer))
            s = kiln_error(KILN_ERR_ARG, "%s was trained with --optimizer %s; resume with the same optimizer",
                           state_path, opt_name ? opt_name : "?");
        else if (!dseed || strcmp(dseed, seedbuf))
            s = kiln_error(KILN_ERR_ARG, "%s was trained with --seed %s; resume with the same seed (it fixes the batches)",
                           state_path, dseed ? dseed : "?");
        else if (!mst || strcmp(mst, st))
            s = kiln_error(KILN_ERR_FORMAT, "%s is at step %s but %s at step %s: the checkpoint is incomplete", model_path,
                           mst ? mst : "?", state_path, st);
        kiln_safetensors_free(mf);
        /* f16: the scaler as it was (a state saved without one, from a bf16 or f32 run,
         * starts from the default) */
        const char *ls = kiln_safetensors_meta(f, "loss_scale"), *lg = kiln_safetensors_meta(f, "loss_scale_good"),
                   *lk = kiln_safetensors_meta(f, "loss_scale_skipped");
        if (s == KILN_OK && scaler && ls) {
            double v = 0;
            int64_t good = 0, skipped = 0;
            if (!lg || !lk)
                s = kiln_error(KILN_ERR_FORMAT, "%s: loss_scale's counts are missing", state_path);
            else if (meta_number(state_path, "loss_scale",
                                 kiln__parse_f64(ls, 0, DBL_MAX, KILN__PARSE_ABOVE_LO, "loss_scale", &v)) ||
                     meta_number(state_path, "loss_scale_good",
                                 kiln__parse_i64(lg, 0, INT64_MAX, "loss_scale_good", &good)) ||
                     meta_number(state_path, "loss_scale_skipped",
                                 kiln__parse_i64(lk, 0, INT64_MAX, "loss_scale_skipped", &skipped)))
                s = KILN_ERR_FORMAT;
            else
                scaler->scale = v, scaler->good = good, scaler->skipped = skipped;
        }
        const char *os = kiln_safetensors_meta(f, "optim_steps");
        int64_t osteps = 0;
        uint64_t rseed = 0, roff = 0;
        if (s == KILN_OK &&
            (meta_number(state_path, "step", kiln__parse_i64(st, 0, INT64_MAX, "step", step)) ||
             meta_number(state_path, "optim_steps",
                         kiln__parse_i64(os ? os : st, 0, INT64_MAX, "optim_steps", &osteps)) ||
             meta_number(state_path, "rng_seed", kiln__parse_u64(rs, "rng_seed", &rseed)) ||
             meta_number(state_path, "rng_offset", kiln__parse_u64(ro, "rng_offset", &roff))))
            s = KILN_ERR_FORMAT;
        if (s == KILN_OK) { /* optim_steps: a state from before it took every step */
            kiln_rng_set_state((kiln_rng_state){rseed, roff});
            kiln_scope_begin();
            for (int i = 0; s == KILN_OK && i < kiln_gpt_num_params(m); i++) {
                const char *name;
                kiln_gpt_param(m, i, &name);
                for (int slot = 0; s == KILN_OK && slot < kiln_optim_num_slots(opt); slot++) {
                    char key[512];
                    snprintf(key, sizeof key, "opt.%d.%s", slot, name);
                    bool present = false;
                    for (int j = 0; j < kiln_safetensors_count(f) && !present; j++)
                        present = !strcmp(kiln_safetensors_name(f, j), key);
                    kiln_tensor_t *t = present ? kiln_safetensors_get(f, key) : NULL;
                    if (t) t = kiln_gpt_shard_param(m, i, t); /* a sharded expert's: this rank's part */
                    if (present && !t) s = kiln_last_status();
                    else s = kiln_optim_set_state(opt, osteps, i, slot, t);
                }
            }
            kiln_scope_end();
        }
    }
    kiln_safetensors_free(f);
    free(model_path);
    free(state_path);
    return s;
}
