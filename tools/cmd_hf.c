/* kiln import hf / kiln export hf: Hugging Face model folders into kiln run folders and
 * back (src/nn/hf.c does the mapping). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "cli.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/tokenizer.h"
#include "kiln/serve.h" /* kiln_chat_template_default */

/* A run folder as `kiln train` leaves one, for a model that has taken no step: the
 * model file, and the tokenizer.json unless it is bytes. */
static kiln_status write_run(const char *dir, kiln_gpt_t *m, kiln_tokenizer_t *tok, const char *chat_template)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return kiln_error(KILN_ERR_IO, "cannot make %s: %s", dir, strerror(errno));
    char path[4200];
    const char *kind = kiln_tokenizer_kind(tok);
    snprintf(path, sizeof path, "%s/%s", dir, RUN_TOKENIZER);
    kiln_status s = strcmp(kind, "byte") ? kiln_tokenizer_save(tok, path) : KILN_OK;
    kiln_checkpoint_info info = {.step = 0, .tokenizer = kind,
                                 .chat_template = chat_template ? chat_template : kiln_chat_template_default()};
    return s == KILN_OK ? kiln_checkpoint_save_model(dir, m, &info) : s;
}

static int check_kind(const char *cmd, int np, const char **pos)
{
    if (np != 3) return cli_fail(cmd, "give the format and two paths (see --help)");
    if (strcmp(pos[0], "hf") && strcmp(pos[0], "gguf")) {
        fprintf(stderr, "kiln %s: format '%s' is not known: hf (a Hugging Face model folder) and gguf (llama.cpp's "
                "file) are\n", cmd, pos[0]);
        return 2;
    }
    return 0;
}

int cmd_import(int argc, char **argv)
{
    int64_t threads = 0;
    const cli_opt opts[] = {{"threads", OPT_INT, &threads, "threads; 0 = all cores"}, {NULL, 0, NULL, NULL}};
    const char *pos[3];
    int np = 0;
    int r = cli_parse("import",
                      "hf HF_DIR RUN_DIR | gguf MODEL.gguf RUN_DIR\n\n"
                      "Reads a Hugging Face model folder (config.json, model.safetensors or its shards,\n"
                      "tokenizer.json) or a GGUF file (llama.cpp's: the weights of any type kiln reads,\n"
                      "turned into f32, its tokenizer and chat template) and writes a kiln run folder that\n"
                      "kiln sample, serve and train read. LLaMA, Mistral, Qwen2, Qwen3 and GPT-2; a config\n"
                      "field or tensor kiln cannot honour is an error naming it. kiln sample and serve also\n"
                      "take the folder or the file as it is (docs/hf.md, docs/gguf.md).",
                      opts, argc, argv, pos, 3, &np);
    if (r) return r == 1 ? 0 : 2;
    if ((r = check_kind("import", np, pos))) return r;
    if (cli_refuse_own_input("import", pos[1], pos[2], false)) return 1;
    kiln_init((int)threads);
    kiln_gpt_t *m;
    kiln_tokenizer_t *tok;
    char *tmpl = NULL;
    bool gguf = !strcmp(pos[0], "gguf");
    if (!gguf && !kiln_hf_is_folder(pos[1])) {
        fprintf(stderr, "kiln import: %s is not a Hugging Face model folder (no config.json)\n", pos[1]);
        return 1;
    }
    if ((gguf ? kiln_gguf_load(pos[1], &m, &tok, &tmpl) : kiln_model_load(pos[1], &m, &tok, NULL)) != KILN_OK)
        return cli_fail("import", NULL);
    kiln_status s = write_run(pos[2], m, tok, tmpl);
    free(tmpl);
    if (s == KILN_OK) {
        const kiln_gpt_config *c = kiln_gpt_get_config(m);
        printf("imported %s into %s: %d layers, width %d, %d heads (%d for keys), %d tokens, context %d, %.2fM "
               "parameters, tokenizer %s\n", pos[1], pos[2], c->n_layer, c->n_embd, c->n_head, c->n_kv_head,
               c->vocab_size, c->block_size, (double)kiln_gpt_param_elements(m) / 1e6, kiln_tokenizer_kind(tok));
    }
    kiln_gpt_free(m);
    kiln_tokenizer_free(tok);
    return s == KILN_OK ? 0 : cli_fail("import", NULL);
}

/* The types kiln_gguf_write takes. */
static bool gguf_type_known(const char *t)
{
    static const char *const known[] = {"f32",  "f16",  "bf16", "q8_0", "q4_0",   "q4_1",  "q5_0",
                                        "q5_1", "q4_K", "q5_K", "q6_K", "q4_K_M", "q5_K_M"};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (!strcmp(t, known[i])) return true;
    return false;
}

int cmd_quantize(int argc, char **argv)
{
    const char *type = "q8_0";
    int64_t threads = 0;
    const cli_opt opts[] = {{"type", OPT_STRING, &type,
                             "q4_K_M, q5_K_M (llama.cpp's mixes), q4_K, q5_K, q6_K, q8_0, q4_0, q4_1, q5_0, q5_1, f16, bf16 or f32"},
                            {"threads", OPT_INT, &threads, "threads; 0 = all cores"},
                            {NULL, 0, NULL, NULL}};
    const char *pos[2];
    int np = 0;
    int r = cli_parse("quantize",
                      "MODEL OUT.gguf [--type q4_K_M|q5_K_M|q4_K|q5_K|q6_K|q8_0|q4_0|q4_1|q5_0|q5_1|f16|bf16|f32]\n\n"
                      "Writes a model (a kiln run folder or model file, a Hugging Face folder, or a GGUF file)\n"
                      "as a GGUF file that llama.cpp and kiln load, its matrices in --type's blocks, byte for\n"
                      "byte as llama.cpp's quantizer makes them: q4_K_M and q5_K_M are its mixes (the output\n"
                      "and some layers' value and down projections in q6_K); the K types put the output in\n"
                      "q6_K and fall back as llama.cpp does where 256 does not divide a row; the others are\n"
                      "written as asked everywhere. Norms stay f32 (docs/gguf.md).",
                      opts, argc, argv, pos, 2, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np != 2) return cli_fail("quantize", "give the model and the GGUF file to write (see kiln quantize --help)");
    if (!gguf_type_known(type)) {
        fprintf(stderr, "kiln quantize: --type %s is not one kiln writes: q4_K_M, q5_K_M, q4_K, q5_K, q6_K, q8_0, q4_0, "
                "q4_1, q5_0, q5_1, f16, bf16, f32%s\n", type,
                !strcmp(type, "Q4_K_M") || !strcmp(type, "q4_k_m") ? " (llama.cpp's spelling is q4_K_M)" : "");
        return 2;
    }
    if (cli_refuse_own_input("quantize", pos[0], pos[1], false)) return 1;
    kiln_init((int)threads);
    kiln_gpt_t *m;
    kiln_tokenizer_t *tok;
    if (kiln_model_load(pos[0], &m, &tok, NULL) != KILN_OK) return cli_fail("quantize", NULL);
    kiln_status s = kiln_gguf_write(m, tok, pos[1], type);
    if (s == KILN_OK)
        printf("wrote %s: %s in %s (%.2fM parameters)\n", pos[1], pos[0], type, (double)kiln_gpt_param_elements(m) / 1e6);
    kiln_gpt_free(m);
    kiln_tokenizer_free(tok);
    return s == KILN_OK ? 0 : cli_fail("quantize", NULL);
}

int cmd_export(int argc, char **argv)
{
    const char *dtype = "f32";
    const cli_opt opts[] = {{"dtype", OPT_STRING, &dtype, "f32, bf16 or f16 (and q8_0 for gguf): the weights' type"},
                            {NULL, 0, NULL, NULL}};
    const char *pos[3];
    int np = 0;
    int r = cli_parse("export",
                      "hf RUN_DIR HF_DIR [--dtype f32|bf16|f16]\n"
                      "       kiln export gguf RUN_DIR FILE.gguf [--dtype f32|bf16|f16|q8_0|q4_K_M|... (kiln quantize --help)]\n\n"
                      "hf: a Hugging Face folder that transformers loads: config.json (LlamaForCausalLM,\n"
                      "Qwen3ForCausalLM for models with q/k norms, or GPT2LMHeadModel for GPT-2 style models),\n"
                      "model.safetensors and tokenizer.json.\n"
                      "gguf: one file that llama.cpp loads (LLaMA-, Qwen3- and GPT-2-style models), with the tokenizer\n"
                      "in it.",
                      opts, argc, argv, pos, 3, &np);
    if (r) return r == 1 ? 0 : 2;
    bool gguf = np == 3 && !strcmp(pos[0], "gguf");
    if (!gguf && (r = check_kind("export", np, pos))) return r;
    kiln_dtype dt = KILN_DTYPE_F32;
    if (gguf && !gguf_type_known(dtype))
        return cli_fail("export", "--dtype must be f32, bf16, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K, "
                        "q4_K_M or q5_K_M for gguf");
    if (!gguf && (kiln_dtype_parse(dtype, &dt) != KILN_OK || !kiln_dtype_is_f32_or_half(dt)))
        return cli_fail("export", "--dtype must be f32, bf16 or f16");
    if (cli_refuse_own_input("export", pos[1], pos[2], false)) return 1;
    kiln_init(0);
    kiln_gpt_t *m;
    kiln_tokenizer_t *tok;
    if (kiln_model_load(pos[1], &m, &tok, NULL) != KILN_OK) return cli_fail("export", NULL);
    kiln_status s = gguf ? kiln_gguf_write(m, tok, pos[2], dtype) : kiln_hf_save(m, tok, pos[2], dt);
    if (s == KILN_OK) printf("exported %s to %s (%s weights)\n", pos[1], pos[2], gguf ? dtype : kiln_dtype_name(dt));
    kiln_gpt_free(m);
    kiln_tokenizer_free(tok);
    return s == KILN_OK ? 0 : cli_fail("export", NULL);
}
