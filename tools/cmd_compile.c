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
        {"model", OPT_STRING, &model, "gpt2 or llama"},
        {"layers", OPT_INT, &layers, "transformer blocks"},
        {"width", OPT_INT, &width, "embedding width C"},
        {"heads", OPT_INT, &heads, "attention heads"},
        {"context", OPT_INT, &context, "sequence length T"},
        {"vocab", OPT_INT, &vocab, "vocabulary size"},
        {"batch", OPT_INT, &batch, "sequences per step B"},
        {NULL, 0, NULL, NULL},
    };
    const char *pos[1];
    int np = 0;
    int r = cli_parse("compile", "--dump DIR [options]   (defaults: config S)", opts, argc, argv, pos, 0, &np);
    if (r) return r == 1 ? 0 : 2;
    if (!dump) return cli_fail("compile", "--dump DIR is required (where the graphs are written)");
    if (strcmp(model, "gpt2") && strcmp(model, "llama")) return cli_fail("compile", "--model must be gpt2 or llama");
    if (layers < 1 || width < 1 || heads < 1 || width % heads || context < 2 || vocab < 2 || batch < 1 ||
        layers > 1024 || width > 1 << 16 || context > 1 << 16 || vocab > 1 << 22 || batch > 1 << 16)
        return cli_fail("compile", "an option is out of range (width must be a multiple of heads)");
    kiln_gpt_config cfg = strcmp(model, "llama") ? kiln_gpt_config_gpt2() : kiln_gpt_config_llama();
    cfg.n_layer = (int)layers;
    cfg.n_embd = (int)width;
    cfg.n_head = cfg.n_kv_head = (int)heads;
    cfg.block_size = (int)context;
    cfg.vocab_size = (int)vocab;
    kiln_gpt_t *m;
    if (kiln_gpt_new(&cfg, 1, &m) != KILN_OK) return cli_fail("compile", NULL);
    int64_t n = batch * context, shape[2] = {batch, context};
    int64_t *ids = malloc(sizeof *ids * (size_t)(n + 1));
    if (!ids) return cli_fail("compile", "out of memory");
    for (int64_t i = 0; i <= n; i++) ids[i] = (i * 7919 + 13) % vocab;
    kiln_scope_begin();
    kiln_tensor_t *xy[2] = {kiln_from_data(ids, shape, 2, KILN_DTYPE_I64), kiln_from_data(ids + 1, shape, 2, KILN_DTYPE_I64)};
    free(ids);
    setenv("KILN_DEBUG_DIR", dump, 1);
    kiln_compiled_t *fn;
    kiln_tensor_t *loss = NULL, *want = NULL;
    int nout = 0;
    kiln_status s = kiln_compiled_new(kiln_gpt_loss_backward, m, "train_step", &fn);
    if (s == KILN_OK) s = kiln_compiled_call(fn, xy, 2, &loss, 1, &nout);
    double got_v = 0, want_v = 0;
    if (s == KILN_OK) s = kiln_tensor_item(loss, &got_v);
    /* The same step eagerly, from zeroed gradients: the graph's loss must match. */
    for (int i = 0; s == KILN_OK && i < kiln_gpt_num_params(m); i++) kiln_tensor_zero_grad(kiln_gpt_param(m, i, NULL));
    if (s == KILN_OK) s = kiln_gpt_loss_backward(m, xy, 2, &want, &nout);
    if (s == KILN_OK) s = kiln_tensor_item(want, &want_v);
    if (s == KILN_OK)
        printf("kiln compile: %s, %d layers, C=%d, T=%d, B=%d: the training step's graph is in %s/train_step-0/\n"
               "              (captured.txt, after_passes.txt, guards.txt, loop_ir_before_fusion.txt,\n"
               "              loop_ir_after_fusion.txt, kernels.c, compile.log); its loss %.6f, eager %.6f\n",
               model, cfg.n_layer, cfg.n_embd, cfg.block_size, (int)batch, dump, got_v, want_v);
    kiln_compiled_free(fn);
    kiln_scope_end();
    kiln_gpt_free(m);
    if (s != KILN_OK) return cli_fail("compile", NULL);
    /* Generated kernels sum in another order than the eager ones: 1e-5 relative. */
    return fabs(got_v - want_v) <= 1e-5 * fabs(want_v) ? 0 : cli_fail("compile", "the compiled loss differs from eager");
}
