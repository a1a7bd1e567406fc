/* kiln compile --dump DIR: captures a model's training step (forward, loss and
 * backward) for a config, without training, runs the graph passes and writes what the
 * compiler saw into DIR (one folder per graph: the graph as captured, after the passes,
 * its guards, the loop IR before and after fusion, the generated C and the compile
 * log), then checks the compiled loss against eager. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli.h"
#include "kiln/kiln.h"

int cmd_compile(int argc, char **argv)
{
    const char *dump = NULL, *model = "gpt2";
    int64_t layers = 4, width = 256, heads = 4, context = 128, vocab = 256, batch = 16;
    const cli_opt opts[] = {
        {"dump", OPT_STRING, &dump, "folder to write each captured graph into (required)"},
        {"arch", OPT_STRING, &model, "gpt2 or llama"},
        {"layers", OPT_INT, &layers, "transformer blocks"},
        {"width", OPT_INT, &width, "embedding width C"},
        {"heads", OPT_INT, &heads, "attention heads"},
        {"context", OPT_INT, &context, "sequence length T"},
        {"vocab", OPT_INT, &vocab, "vocabulary size"},
        {"batch", OPT_INT, &batch, "sequences per step B"},
        CLI_ALIAS("model", "arch"),
        {NULL, 0, NULL, NULL},
    };
    const char *pos[1];
    int np = 0;
    int r = cli_parse("compile", "--dump DIR [options]   (defaults: config S)", opts, argc, argv, pos, 0, &np);
    if (r) return r == 1 ? 0 : 2;
    if (!dump) return cli_fail("compile", "--dump DIR is required (where the graphs are written)");
    if (strcmp(model, "gpt2") && strcmp(model, "llama")) return cli_fail("compile", "--arch must be gpt2 or llama");
    if (layers < 1 || width < 1 || heads < 1 || width % heads || context < 2 || vocab < 2 || batch < 1 ||
        layers > 1024 || width > 1 << 16 || context > 1 << 16 || vocab > 1 << 22 || batch > 1 << 16)
        return cli_fail("compile", "an option is out of range (width must be a multiple of heads)");
    kiln_gpt_config cfg = strcmp(model, "llama") ? kiln_gpt_config_gpt2() : kiln_gpt_config_llama();
    cfg.n_layer = (int)layers;
    cfg.n_embd = (int)width;
    cfg.n_head = cfg.n_kv_head = (int)heads;
    cfg.block_size = (int)context;
    cfg.vocab_size = (int)vocab;
    /* Two twins from one seed: the whole training step (forward, backward, clipping,
     * AdamW) compiled on one, eager on the other; the first loss must agree. */
    kiln_gpt_t *m[2] = {NULL, NULL};
    kiln_optim_t *opt[2] = {NULL, NULL};
    kiln_tensor_t **ps[2] = {NULL, NULL};
    kiln_status s = KILN_OK;
    int nparams = 0;
    for (int k = 0; k < 2 && s == KILN_OK; k++) {
        if ((s = kiln_gpt_new(&cfg, 1, &m[k])) != KILN_OK) break;
        nparams = kiln_gpt_num_params(m[k]);
        if (!(ps[k] = malloc(sizeof *ps[k] * (size_t)nparams))) {
            s = kiln_error(KILN_ERR_OOM, "out of memory");
            break;
        }
        for (int i = 0; i < nparams; i++) ps[k][i] = kiln_gpt_param(m[k], i, NULL);
        s = kiln_adamw_new(ps[k], nparams, NULL, 0.9, 0.95, 1e-8, 0.1, &opt[k]);
    }
    int64_t n = batch * context, shape[2] = {batch, context}, one = 1;
    int64_t *ids = s == KILN_OK ? malloc(sizeof *ids * (size_t)(n + 1)) : NULL;
    if (s == KILN_OK && !ids) s = kiln_error(KILN_ERR_OOM, "out of memory");
    for (int64_t i = 0; ids && i <= n; i++) ids[i] = (i * 7919 + 13) % vocab;
    kiln_scope_begin();
    double lr = 3e-4;
    kiln_tensor_t *in[3] = {NULL, NULL, NULL};
    if (s == KILN_OK) {
        in[0] = kiln_from_data(ids, shape, 2, KILN_DTYPE_I64);
        in[1] = kiln_from_data(ids + 1, shape, 2, KILN_DTYPE_I64);
        in[2] = kiln_from_data(&lr, &one, 1, KILN_DTYPE_F64);
    }
    free(ids);
    setenv("KILN_DEBUG_DIR", dump, 1);
    kiln_compiled_t *fn = NULL;
    kiln_gpt_step st[2] = {{m[0], opt[0], ps[0], nparams, 1.0, 1, NULL, NULL, NULL},
                           {m[1], opt[1], ps[1], nparams, 1.0, 1, NULL, NULL, NULL}};
    kiln_tensor_t *got[2], *want[2];
    int nout = 0;
    if (s == KILN_OK) s = kiln_compiled_new(kiln_gpt_train_step, &st[0], "train_step", &fn);
    if (s == KILN_OK) s = kiln_compiled_guard(fn, "clip", &st[0].clip, sizeof st[0].clip);
    if (s == KILN_OK) s = kiln_compiled_guard(fn, "accum", &st[0].accum, sizeof st[0].accum);
    if (s == KILN_OK) s = kiln_compiled_call(fn, in, 3, got, 2, &nout);
    double got_v = 0, want_v = 0;
    if (s == KILN_OK) s = kiln_tensor_item(got[0], &got_v);
    if (s == KILN_OK) s = kiln_gpt_train_step(&st[1], in, 3, want, &nout);
    if (s == KILN_OK) s = kiln_tensor_item(want[0], &want_v);
    if (s == KILN_OK)
        printf("kiln compile: %s, %d layer%s, C=%d, T=%d, B=%d: the training step's graph is in %s/train_step-0/\n"
               "              (captured.txt, after_passes.txt, guards.txt, loop_ir_before_fusion.txt,\n"
               "              loop_ir_after_fusion.txt, kernels.c, compile.log); its loss %.6f, eager %.6f\n",
               model, cfg.n_layer, cfg.n_layer == 1 ? "" : "s", cfg.n_embd, cfg.block_size, (int)batch, dump, got_v, want_v);
    kiln_compiled_free(fn);
    kiln_scope_end();
    for (int k = 0; k < 2; k++) {
        kiln_optim_free(opt[k]);
        kiln_gpt_free(m[k]);
        free(ps[k]);
    }
    if (s != KILN_OK) return cli_fail("compile", NULL);
    /* Generated kernels sum in another order than the eager ones: 1e-5 relative. */
    return fabs(got_v - want_v) <= 1e-5 * fabs(want_v) ? 0 : cli_fail("compile", "the compiled loss differs from eager");
}
