/* Loading a trained model as `kiln train` leaves it: a run folder (or the model file in
 * one) whose safetensors metadata names the config, the tokenizer and the chat template. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "core/file.h"
#include "io/json_file.h" /* kiln__path_exists */
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/tokenizer.h"
#include "nn/gpt_impl.h"

#define MODEL_FILE "model.safetensors"
#define TOKENIZER_FILE "tokenizer.json"

kiln_status kiln_model_file(const char *path, char *out, size_t n)
{
    if (!path || !out) return kiln_error(KILN_ERR_ARG, "model_file: path and out must not be NULL");
    struct stat st;
    bool dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
    int w = dir ? snprintf(out, n, "%s/%s", path, MODEL_FILE) : snprintf(out, n, "%s", path);
    if (w < 0 || (size_t)w >= n) return kiln_error(KILN_ERR_ARG, "path too long: %s", path);
    return KILN_OK;
}

/* The run folder and model file of a path that is either: the file's folder. */
static kiln_status split_path(const char *arg, char *dir, size_t dn, char *file, size_t fn)
{
    kiln_status s = kiln_model_file(arg, file, fn);
    if (s != KILN_OK) return s;
    const char *slash = strrchr(file, '/');
    int w = slash ? snprintf(dir, dn, "%.*s", (int)(slash - file), file) : snprintf(dir, dn, ".");
    if (w < 0 || (size_t)w >= dn) return kiln_error(KILN_ERR_ARG, "path too long: %s", arg);
    return KILN_OK;
}

static kiln_status tokenizer_for(const char *dir, const char *kind, kiln_tokenizer_t **out)
{
    if (!kind || !strcmp(kind, "byte")) {
        *out = kiln_tokenizer_byte();
        return *out ? KILN_OK : kiln_last_status();
    }
    char path[4200];
    if (snprintf(path, sizeof path, "%s/%s", dir, TOKENIZER_FILE) >= (int)sizeof path)
        return kiln_error(KILN_ERR_ARG, "path too long: %s", dir);
    return kiln_tokenizer_load(path, out);
}

/* A Hugging Face folder: the model and its tokenizer.json. A folder without one is refused,
 * never read as bytes: a model's text through the wrong tokenizer is junk, not an error. */
static kiln_status hf_model(const char *dir, kiln_gpt_t **model, kiln_tokenizer_t **tok)
{
    char path[4200];
    if (snprintf(path, sizeof path, "%s/%s", dir, TOKENIZER_FILE) >= (int)sizeof path)
        return kiln_error(KILN_ERR_ARG, "path too long: %s", dir);
    if (!kiln__path_exists(path)) {
        char spm[4200];
        snprintf(spm, sizeof spm, "%s/tokenizer.model", dir);
        return kiln_error(KILN_ERR_FORMAT, "%s has no tokenizer.json, the file kiln reads a model's tokenizer from%s", dir,
                          kiln__path_exists(spm) ? " (not its tokenizer.model, SentencePiece's: transformers' "
                                                   "AutoTokenizer save_pretrained writes a tokenizer.json)"
                                                 : "; copy the model's tokenizer.json into the folder");
    }
    kiln_gpt_t *m = NULL;
    kiln_tokenizer_t *t = NULL;
    kiln_status s = tokenizer_for(dir, "json", &t);
    if (s == KILN_OK) s = kiln_hf_load(dir, &m);
    if (s == KILN_OK && kiln_tokenizer_vocab_size(t) != kiln_gpt_get_config(m)->vocab_size)
        s = kiln_error(KILN_ERR_FORMAT, "%s: the model has %d tokens but its tokenizer.json %d", dir,
                       kiln_gpt_get_config(m)->vocab_size, kiln_tokenizer_vocab_size(t));
    if (s != KILN_OK) {
        kiln_gpt_free(m);
        kiln_tokenizer_free(t);
        return s;
    }
    *model = m;
    *tok = t;
    return KILN_OK;
}

/* Whether the file begins with GGUF's magic: such a file gets an error that says what
 * it is, not one from the safetensors reader about an absurd header. */
static bool is_gguf(const char *file)
{
    char magic[4] = {0};
    int fd = kiln__file_open_read(file, NULL, NULL); /* (regular files only, never blocking) */
    if (fd < 0) {
        kiln_clear_error(); /* not one to read: the safetensors reader says why */
        return false;
    }
    bool yes = read(fd, magic, 4) == 4 && !memcmp(magic, "GGUF", 4);
    close(fd);
    return yes;
}

kiln_status kiln_model_load(const char *path, kiln_gpt_t **model, kiln_tokenizer_t **tok, char **chat_template)
{
    if (!path || !model || !tok) return kiln_error(KILN_ERR_ARG, "model_load: path, model and tok must not be NULL");
    *model = NULL;
    *tok = NULL;
    if (chat_template) *chat_template = NULL;
    if (kiln_hf_is_folder(path)) return hf_model(path, model, tok);
    char dir[4096], file[4200];
    struct stat st;
    if (stat(path, &st) != 0)
        return kiln_error(KILN_ERR_IO, "%s: %s (give a kiln run folder, its model file, a Hugging Face folder or a GGUF file)", path,
                          strerror(errno));
    kiln_status s = split_path(path, dir, sizeof dir, file, sizeof file);
    if (s == KILN_OK && S_ISDIR(st.st_mode) && stat(file, &st) != 0)
        return kiln_error(KILN_ERR_IO, "%s: neither a kiln run folder (no %s) nor a Hugging Face folder (no config.json)",
                          path, MODEL_FILE);
    kiln_safetensors_t *f = NULL;
    if (s == KILN_OK && is_gguf(file)) return kiln_gguf_load(file, model, tok, chat_template);
    if (s == KILN_OK) s = kiln_safetensors_load(file, &f);
    if (s != KILN_OK) return s;
    const char *cfg_json = kiln_safetensors_meta(f, "config");
    kiln_gpt_config cfg;
    kiln_tokenizer_t *t = NULL;
    kiln_gpt_t *m = NULL;
    char *tmpl = NULL;
    if (!cfg_json) s = kiln_error(KILN_ERR_FORMAT, "%s has no 'config' metadata: not a kiln model checkpoint", file);
    else s = kiln_gpt_config_from_json(cfg_json, &cfg);
    if (s == KILN_OK) s = tokenizer_for(dir, kiln_safetensors_meta(f, "tokenizer"), &t);
    if (s == KILN_OK && kiln_tokenizer_vocab_size(t) != cfg.vocab_size)
        s = kiln_error(KILN_ERR_FORMAT, "%s: the model has %d tokens but its tokenizer %d", file, cfg.vocab_size,
                       kiln_tokenizer_vocab_size(t));
    const char *ct = kiln_safetensors_meta(f, "chat_template");
    if (s == KILN_OK && ct && chat_template && !(tmpl = strdup(ct))) s = kiln_error(KILN_ERR_OOM, "model_load: out of memory");
    if (s == KILN_OK) s = kiln__gpt_new_from_file(&cfg, f, file, &m);
    kiln_safetensors_free(f);
    if (s != KILN_OK) {
        kiln_gpt_free(m);
        kiln_tokenizer_free(t);
        free(tmpl);
        return s;
    }
    *model = m;
    *tok = t;
    if (chat_template) *chat_template = tmpl;
    return KILN_OK;
}
