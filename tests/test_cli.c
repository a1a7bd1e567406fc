/* The kiln program end to end: train, checkpoint, resume bit for bit, sample, info,
 * plot, and clear errors on bad input. Runs the real binary ($KILN_TOOL). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "test_util.h"

static char dir[256];
static char corpus[300];

/* Runs a shell command; returns its exit status and its output (stdout+stderr). */
static int run(char *out, size_t n, const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[4200];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    assert_non_null(p);
    size_t got = 0;
    if (out && n) {
        got = fread(out, 1, n - 1, p);
        out[got] = '\0';
    }
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {
    }
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static const char *tool(void)
{
    const char *t = getenv("KILN_TOOL");
    return t ? t : "./kiln";
}

/* A small made-up corpus: enough tokens for batches, varied enough to learn from. */
static int corpus_setup(void **state)
{
    snprintf(dir, sizeof dir, "/tmp/kiln-cli-XXXXXX");
    if (!mkdtemp(dir)) return -1;
    snprintf(corpus, sizeof corpus, "%s/corpus.txt", dir);
    FILE *f = fopen(corpus, "w");
    if (!f) return -1;
    const char *words[] = {"the", "light", "was", "good", "and", "darkness", "upon", "face", "of", "deep", "waters"};
    unsigned x = 1;
    for (int i = 0; i < 6000; i++) {
        x = x * 1103515245u + 12345u;
        fprintf(f, "%s%s", words[(x >> 16) % 11], i % 12 == 11 ? ".\n" : " ");
    }
    fclose(f);
    return 0;
}

static int corpus_teardown(void **state)
{
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

#define TINY "--layers 2 --width 32 --heads 4 --context 32 --batch 4 --eval-batches 2 --lr 3e-3 --warmup 2 --threads 1"

/* The loss column of a metrics.jsonl, as written (exact text). */
static int losses(const char *path, char lines[][64], int max)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char buf[1024];
    int n = 0;
    while (n < max && fgets(buf, sizeof buf, f)) {
        char *p = strstr(buf, "\"loss\":");
        assert_non_null(p);
        snprintf(lines[n], 64, "%.40s", p + 7);
        char *comma = strchr(lines[n], ',');
        if (comma) *comma = '\0';
        n++;
    }
    fclose(f);
    return n;
}

static void train_writes_checkpoint_metrics_and_chart(void **state)
{
    char out[8192];
    int rc = run(out, sizeof out, "%s train --data %s --out %s/a --steps 6 --save-every 3 --eval-every 3 " TINY,
                 tool(), corpus, dir);
    if (rc != 0) fail_msg("kiln train failed (%d): %s", rc, out);
    assert_non_null(strstr(out, "step     6/6"));
    assert_non_null(strstr(out, "val"));
    static const char *files[] = {"model.safetensors", "train_state.safetensors", "metrics.jsonl", "loss.svg", "run.json"};
    for (int i = 0; i < 5; i++) {
        char p[512];
        struct stat st;
        snprintf(p, sizeof p, "%s/a/%s", dir, files[i]);
        if (stat(p, &st) != 0 || st.st_size == 0) fail_msg("missing %s", p);
    }
}

/* Oracle: the uninterrupted run of the previous test. Stopping at step 3 and resuming
 * must give the same losses, character for character. */
/* The runs in dir/run_a (uninterrupted) and dir/run_b (resumed) logged n steps each,
 * with the same losses, character for character. */
static void same_run_losses(const char *run_a, const char *run_b, int n)
{
    char a[8][64], b[8][64], pa[512], pb[512];
    assert_true(n <= 8);
    snprintf(pa, sizeof pa, "%s/%s/metrics.jsonl", dir, run_a);
    snprintf(pb, sizeof pb, "%s/%s/metrics.jsonl", dir, run_b);
    assert_int_equal(losses(pa, a, 8), n);
    assert_int_equal(losses(pb, b, 8), n);
    for (int i = 0; i < n; i++)
        if (strcmp(a[i], b[i])) fail_msg("%s step %d: uninterrupted loss %s, resumed %s", run_b, i + 1, a[i], b[i]);
}

static void resume_repeats_the_uninterrupted_losses(void **state)
{
    char out[8192];
    int rc = run(out, sizeof out, "%s train --data %s --out %s/b --steps 3 --save-every 3 --eval-every 3 --quiet " TINY,
                 tool(), corpus, dir);
    if (rc != 0) fail_msg("first half failed: %s", out);
    /* A run that crashed after its checkpoint left a row for step 4 behind: the resumed
     * run must replace it, not add a second step 4. */
    char pm[512];
    snprintf(pm, sizeof pm, "%s/b/metrics.jsonl", dir);
    FILE *fm = fopen(pm, "a");
    assert_non_null(fm);
    fprintf(fm, "{\"step\":4,\"loss\":9.99}\n");
    fclose(fm);
    rc = run(out, sizeof out, "%s train --data %s --out %s/b --steps 6 --save-every 3 --eval-every 3 --resume " TINY,
             tool(), corpus, dir);
    if (rc != 0) fail_msg("resume failed: %s", out);
    assert_non_null(strstr(out, "resumed"));
    same_run_losses("a", "b", 6);
}

/* f16 with a loss scale that overflows: steps 1-5 are skipped, halving it each time. A
 * run stopped after step 4 and resumed must carry the scale over (from its checkpoint,
 * not --loss-scale again): oracle, the uninterrupted run's losses, character for
 * character. */
static void resume_keeps_the_f16_loss_scale(void **state)
{
    char out[16384];
    const char *f16 = "--precision f16 --loss-scale 4e6 --eval-every 0 --save-every 4";
    int rc = run(out, sizeof out, "%s train --data %s --out %s/s1 --steps 8 %s " TINY, tool(), corpus, dir, f16);
    if (rc != 0) fail_msg("uninterrupted f16 run failed: %s", out);
    assert_non_null(strstr(out, "step 5 skipped"));
    assert_null(strstr(out, "step 6 skipped"));
    rc = run(out, sizeof out, "%s train --data %s --out %s/s2 --steps 4 %s " TINY, tool(), corpus, dir, f16);
    if (rc != 0) fail_msg("first half failed: %s", out);
    rc = run(out, sizeof out, "%s train --data %s --out %s/s2 --steps 8 --resume %s " TINY, tool(), corpus, dir, f16);
    if (rc != 0) fail_msg("resume failed: %s", out);
    assert_non_null(strstr(out, "step 5 skipped"));
    same_run_losses("s1", "s2", 8);
}

static void resume_refuses_a_changed_optimizer_or_seed(void **state)
{
    char out[8192];
    assert_int_equal(run(out, sizeof out, "%s train --data %s --out %s/a --steps 8 --resume --optimizer sgd " TINY,
                         tool(), corpus, dir), 1);
    assert_non_null(strstr(out, "optimizer adamw"));
    assert_int_equal(run(out, sizeof out, "%s train --data %s --out %s/a --steps 8 --resume --seed 7 " TINY, tool(),
                         corpus, dir), 1);
    assert_non_null(strstr(out, "--seed"));
    assert_int_equal(run(out, sizeof out, "%s train --data %s --out %s/a --steps 4 --resume " TINY, tool(), corpus,
                         dir), 1);
    assert_non_null(strstr(out, "already at step 6"));
}

/* A save interrupted between its two files (new training state, old model) must still
 * resume, from the kept previous state, and repeat the uninterrupted losses. */
static void resume_survives_a_save_cut_between_its_files(void **state)
{
    char out[8192];
    int rc = run(out, sizeof out, "%s train --data %s --out %s/f --steps 3 --eval-every 3 --quiet " TINY, tool(),
                 corpus, dir);
    if (rc != 0) fail_msg("first part failed: %s", out);
    assert_int_equal(run(NULL, 0, "cp %s/f/model.safetensors %s/model3.safetensors", dir, dir), 0);
    rc = run(out, sizeof out, "%s train --data %s --out %s/f --steps 6 --eval-every 3 --resume --quiet " TINY, tool(),
             corpus, dir);
    if (rc != 0) fail_msg("second part failed: %s", out);
    /* Now as if the model file of step 6 had never been written. */
    assert_int_equal(run(NULL, 0, "cp %s/model3.safetensors %s/f/model.safetensors", dir, dir), 0);
    rc = run(out, sizeof out, "%s train --data %s --out %s/f --steps 6 --eval-every 3 --resume " TINY, tool(), corpus,
             dir);
    if (rc != 0) fail_msg("resume after the cut save failed: %s", out);
    assert_non_null(strstr(out, "resumed"));
    assert_non_null(strstr(out, "at step 3"));
    char a[8][64], f[8][64], pa[512], pf[512];
    snprintf(pa, sizeof pa, "%s/a/metrics.jsonl", dir);
    snprintf(pf, sizeof pf, "%s/f/metrics.jsonl", dir);
    assert_int_equal(losses(pa, a, 8), 6);
    assert_int_equal(losses(pf, f, 8), 6);
    for (int i = 0; i < 6; i++)
        if (strcmp(a[i], f[i])) fail_msg("step %d: uninterrupted loss %s, after the cut save %s", i + 1, a[i], f[i]);
}

static void sample_continues_the_prompt(void **state)
{
    char out[8192];
    int rc = run(out, sizeof out, "%s sample %s/a --prompt 'the light' --max-tokens 40 --seed 3 --threads 1", tool(), dir);
    if (rc != 0) fail_msg("kiln sample failed: %s", out);
    assert_true(strncmp(out, "the light", 9) == 0);
    assert_true(strlen(out) >= 9 + 40);
    char again[8192];
    run(again, sizeof again, "%s sample %s/a --prompt 'the light' --max-tokens 40 --seed 3 --threads 1", tool(), dir);
    assert_string_equal(out, again); /* same seed, same text */
}

static void info_and_plot_work_on_the_run(void **state)
{
    char out[16384];
    int rc = run(out, sizeof out, "%s info %s/a/model.safetensors", tool(), dir);
    if (rc != 0) fail_msg("kiln info failed: %s", out);
    assert_non_null(strstr(out, "blocks.1.attn.qkv.weight"));
    assert_non_null(strstr(out, "kiln-gpt-1"));
    /* the run folder itself, as sample and serve take it: the same description */
    char folder[16384];
    rc = run(folder, sizeof folder, "%s info %s/a", tool(), dir);
    if (rc != 0) fail_msg("kiln info RUN_DIR failed: %s", folder);
    assert_string_equal(folder, out);
    rc = run(out, sizeof out, "%s plot %s/a", tool(), dir);
    if (rc != 0) fail_msg("kiln plot failed: %s", out);
    assert_non_null(strstr(out, "loss.svg"));
}

/* A mixture-of-experts run: kiln train draws router.svg beside loss.svg (at each
 * validation), and kiln plot redraws it with a curve for the one MoE block; kiln plot
 * of a dense run (dir/a) writes no router chart and does not mention one. */
static void plot_draws_the_router_chart_of_an_moe_run(void **state)
{
    char out[8192], svg[512];
    int rc = run(out, sizeof out,
                 "%s train --data %s --out %s/moe --arch llama --experts 4 --experts-per-token 2 --dense-layers 1 --steps 4 "
                 "--eval-every 2 --quiet " TINY,
                 tool(), corpus, dir);
    if (rc != 0) fail_msg("MoE training failed: %s", out);
    snprintf(svg, sizeof svg, "%s/moe/router.svg", dir);
    assert_int_equal(access(svg, F_OK), 0);
    assert_int_equal(unlink(svg), 0);
    rc = run(out, sizeof out, "%s plot %s/moe", tool(), dir);
    if (rc != 0) fail_msg("kiln plot of the MoE run failed: %s", out);
    assert_non_null(strstr(out, "loss.svg"));
    assert_non_null(strstr(out, "router.svg (1 MoE block)"));
    static char text[65536];
    assert_true(test_read_text(svg, text, sizeof text));
    assert_non_null(strstr(text, "<polyline class=\"block_1\""));
    assert_non_null(strstr(text, "<line class=\"baseline\""));
    rc = run(out, sizeof out, "%s plot %s/a", tool(), dir);
    if (rc != 0) fail_msg("kiln plot of the dense run failed: %s", out);
    assert_null(strstr(out, "router"));
    snprintf(svg, sizeof svg, "%s/a/router.svg", dir);
    assert_int_equal(access(svg, F_OK), -1);
}

/* kiln compile --dump: the training step's graph written out, its loss equal to eager
 * (the command itself compares the two and fails if they differ). */
/* Oracle: the eager run of the first test. The same run with every step compiled into
 * one graph gives the same losses within 1e-5 relative (generated kernels sum in
 * another order); so does --accum 2 compiled (both micro-batches' forward and backward
 * in the one graph) against --accum 2 eager. */
/* The runs in dir/eager and dir/compiled both logged n losses, equal within 1e-5 relative. */
static void same_losses(const char *eager, const char *compiled, int n, const char *what)
{
    char a[8][64], c[8][64], pa[512], pc[512];
    snprintf(pa, sizeof pa, "%s/%s/metrics.jsonl", dir, eager);
    snprintf(pc, sizeof pc, "%s/%s/metrics.jsonl", dir, compiled);
    assert_int_equal(losses(pa, a, 8), n);
    assert_int_equal(losses(pc, c, 8), n);
    for (int i = 0; i < n; i++) {
        double want = strtod(a[i], NULL), got = strtod(c[i], NULL);
        if (!(fabs(got - want) <= 1e-5 * fabs(want)))
            fail_msg("%sstep %d: eager loss %s, compiled %s", what, i + 1, a[i], c[i]);
    }
}

static void train_compile_matches_eager(void **state)
{
    char out[8192];
    int rc = run(out, sizeof out, "%s train --data %s --out %s/c --steps 6 --save-every 3 --eval-every 3 --compile " TINY,
                 tool(), corpus, dir);
    if (rc != 0) fail_msg("kiln train --compile failed (%d): %s", rc, out);
    assert_non_null(strstr(out, "compiled the training step"));
    same_losses("a", "c", 6, "");
    rc = run(out, sizeof out, "%s train --data %s --out %s/e --steps 4 --eval-every 4 --accum 2 " TINY, tool(), corpus, dir);
    if (rc != 0) fail_msg("kiln train --accum 2 failed (%d): %s", rc, out);
    rc = run(out, sizeof out, "%s train --data %s --out %s/d --steps 4 --eval-every 4 --accum 2 --compile " TINY, tool(),
             corpus, dir);
    if (rc != 0) fail_msg("kiln train --accum 2 --compile failed (%d): %s", rc, out);
    same_losses("e", "d", 4, "--accum 2 ");
    /* Dropout in the compiled step draws its masks when the graph runs, the same stream
     * as the eager step from the same seed: the same losses (oracle: the eager run,
     * relative 1e-5), and not those without dropout. */
    rc = run(out, sizeof out, "%s train --data %s --out %s/g --steps 4 --eval-every 4 --dropout 0.1 " TINY, tool(), corpus,
             dir);
    if (rc != 0) fail_msg("kiln train --dropout 0.1 failed (%d): %s", rc, out);
    rc = run(out, sizeof out, "%s train --data %s --out %s/gc --steps 4 --eval-every 4 --dropout 0.1 --compile " TINY,
             tool(), corpus, dir);
    if (rc != 0) fail_msg("kiln train --dropout 0.1 --compile failed (%d): %s", rc, out);
    same_losses("g", "gc", 4, "--dropout 0.1 ");
    char a[8][64], g[8][64], pa[512], pg[512];
    snprintf(pa, sizeof pa, "%s/a/metrics.jsonl", dir);
    snprintf(pg, sizeof pg, "%s/g/metrics.jsonl", dir);
    assert_true(losses(pa, a, 8) >= 1 && losses(pg, g, 8) == 4);
    if (strtod(a[0], NULL) == strtod(g[0], NULL)) fail_msg("dropout 0.1 left the first loss as it was: %s", g[0]);
}

/* f16's loss scaling inside a compiled step and with ZeRO-1 (a world of one), eager
 * and compiled: the same skipped steps as the eager run of resume_keeps_the_f16_loss_scale
 * (steps 1-5 overflow at --loss-scale 4e6) and the same losses (oracle: that run,
 * relative 1e-5). */
static void f16_scaling_compiles_and_shards(void **state)
{
    const char *how[3] = {"--compile", "--zero1", "--zero1 --compile"};
    for (int i = 0; i < 3; i++) {
        char out[16384], name[16], what[64];
        snprintf(name, sizeof name, "s%d", 3 + i);
        int rc = run(out, sizeof out, "%s train --data %s --out %s/%s --steps 8 %s --precision f16 --loss-scale 4e6 "
                     "--eval-every 0 " TINY, tool(), corpus, dir, name, how[i]);
        if (rc != 0) fail_msg("f16 %s failed (%d): %s", how[i], rc, out);
        if (!strstr(out, "step 5 skipped") || strstr(out, "step 6 skipped"))
            fail_msg("f16 %s: not the eager run's skipped steps (1-5): %s", how[i], out);
        snprintf(what, sizeof what, "f16 %s: ", how[i]);
        same_losses("s1", name, 8, what);
    }
}

/* kiln import hf, kiln export hf, and a Hugging Face folder taken as it is by kiln
 * sample: greedy text from the folder itself, from its import and from the import of
 * its export is the same (oracle: the first; tests/test_hf.c checks the logits against
 * transformers); bad arguments are refused by name. */
static void hf_folders_import_sample_and_export(void **state)
{
    char out[8192], a[8192], hf[4096];
    const char *src = getenv("KILN_SOURCE_DIR");
    snprintf(hf, sizeof hf, "%s/tests/reference/hf/llama", src ? src : ".");
    const char *greedy = "--max-tokens 12 --temperature 0 --prompt 'in the'";
    int rc = run(a, sizeof a, "%s sample %s %s", tool(), hf, greedy);
    if (rc != 0) fail_msg("kiln sample on a Hugging Face folder failed: %s", a);
    rc = run(out, sizeof out, "%s import hf %s %s/hfrun", tool(), hf, dir);
    if (rc != 0 || !strstr(out, "imported")) fail_msg("kiln import hf failed: %s", out);
    rc = run(out, sizeof out, "%s sample %s/hfrun %s", tool(), dir, greedy);
    if (rc != 0 || strcmp(out, a)) fail_msg("the imported run samples '%s', the folder '%s'", out, a);
    rc = run(out, sizeof out, "%s export hf %s/hfrun %s/hfout", tool(), dir, dir);
    if (rc != 0 || !strstr(out, "exported")) fail_msg("kiln export hf failed: %s", out);
    rc = run(out, sizeof out, "%s import hf %s/hfout %s/hfrun2", tool(), dir, dir);
    if (rc != 0) fail_msg("importing the export failed: %s", out);
    rc = run(out, sizeof out, "%s sample %s/hfrun2 %s", tool(), dir, greedy);
    if (rc != 0 || strcmp(out, a)) fail_msg("the export's import samples '%s', the folder '%s'", out, a);
    /* kiln train --init: the folder's weights, architecture and tokenizer. With a
     * learning rate of 1e-12 the trained run samples what the folder does. */
    rc = run(out, sizeof out, "%s train --init %s --data %s --out %s/initrun --steps 1 --warmup 0 --lr 1e-12 "
             "--min-lr 1e-12 --context 32 --batch 2 --eval-batches 1 --threads 1", tool(), hf, corpus, dir);
    if (rc != 0 || !strstr(out, "starting from") || !strstr(out, "2 layers, C=32, 4 heads (2 kv), T=64, vocab 256"))
        fail_msg("kiln train --init failed or took another model: %s", out);
    rc = run(out, sizeof out, "%s sample %s/initrun %s", tool(), dir, greedy);
    if (rc != 0 || strcmp(out, a)) fail_msg("the --init run samples '%s', the folder '%s'", out, a);
    assert_int_equal(run(out, sizeof out, "%s train --init %s --data %s --out %s/x --tokenizer bpe:300", tool(), hf,
                         corpus, dir), 1);
    assert_non_null(strstr(out, "--init brings its own tokenizer"));
    assert_int_equal(run(out, sizeof out, "%s train --init %s --data %s --out %s/x --context 65", tool(), hf, corpus,
                         dir), 1);
    assert_non_null(strstr(out, "longer than the --init model's 64 positions"));
    rc = run(out, sizeof out, "%s export gguf %s/hfrun %s/m.gguf --dtype q8_0", tool(), dir, dir);
    if (rc != 0 || !strstr(out, "q8_0 weights")) fail_msg("kiln export gguf failed: %s", out);
    char gg[4200];
    snprintf(gg, sizeof gg, "%s/m.gguf", dir);
    FILE *gf = fopen(gg, "rb");
    char magic[4] = {0};
    assert_non_null(gf);
    assert_int_equal(fread(magic, 1, 4, gf), 4);
    fclose(gf);
    assert_memory_equal(magic, "GGUF", 4);
    assert_int_equal(run(out, sizeof out, "%s export gguf %s/hfrun %s/m.gguf --dtype q2_K", tool(), dir, dir), 1);
    assert_non_null(strstr(out, "--dtype must be f32, bf16, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K, "
                                "q4_K_M or q5_K_M for gguf"));
    assert_int_equal(run(out, sizeof out, "%s import gguf %s %s/x", tool(), hf, dir), 1);
    assert_non_null(strstr(out, "is a directory, not a regular file"));
    assert_int_equal(run(out, sizeof out, "%s import safetensors %s %s/x", tool(), hf, dir), 2);
    assert_non_null(strstr(out, "format 'safetensors' is not known"));
    assert_int_equal(run(out, sizeof out, "%s import hf %s %s/x", tool(), dir, dir), 1);
    assert_non_null(strstr(out, "not a Hugging Face model folder"));
    assert_int_equal(run(out, sizeof out, "%s export hf %s/hfrun %s/x --dtype i8", tool(), dir, dir), 1);
    assert_non_null(strstr(out, "--dtype must be f32, bf16 or f16"));
}

static void compile_dumps_the_training_step(void **state)
{
    char out[4096], path[1024];
    int rc = run(out, sizeof out, "%s compile --dump %s/dump --layers 2 --width 32 --heads 4 --context 16 --batch 2",
                 tool(), dir);
    if (rc != 0) fail_msg("kiln compile failed: %s", out);
    assert_non_null(strstr(out, "train_step-0"));
    snprintf(path, sizeof path, "%s/dump/train_step-0/after_passes.txt", dir);
    char text[65536];
    assert_true(test_read_text(path, text, sizeof text));
    assert_non_null(strstr(text, "cross_entropy_backward("));
    /* the update is in the graph, decomposed: its step check and its in-place copies */
    assert_non_null(strstr(text, "check_min("));
    assert_non_null(strstr(text, "copy_("));
    assert_null(strstr(text, "adamw_("));
    assert_non_null(strstr(text, "grad(%"));
    snprintf(path, sizeof path, "%s/dump/train_step-0/captured.txt", dir);
    assert_true(test_read_text(path, text, sizeof text));
    assert_non_null(strstr(text, "adamw_(")); /* as captured, whole */
    snprintf(path, sizeof path, "%s/dump/train_step-0/guards.txt", dir);
    assert_true(test_read_text(path, text, sizeof text));
    assert_non_null(strstr(text, "input 0 is i64[2,16]"));
    assert_non_null(strstr(text, "attribute clip is 1\n")); /* the numbers the step is built with */
    assert_non_null(strstr(text, "attribute accum is 1\n"));
    snprintf(path, sizeof path, "%s/dump/train_step-0/kernels.c", dir);
    assert_int_equal(access(path, R_OK), 0);
    rc = run(out, sizeof out, "%s compile", tool());
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "--dump DIR is required"));
}

/* Two processes compiling the same step into one empty kernel cache at once: both
 * succeed, and the cache ends with one shared object and its source, no temporary
 * files (each writes its own and renames it into place). */
static void two_processes_compile_into_one_cache(void **state)
{
    char out[8192], cmd[2048];
    snprintf(cmd, sizeof cmd, "%s compile --layers 2 --width 32 --heads 4 --context 16 --batch 2 --dump", tool());
    int rc = run(out, sizeof out,
                 "export KILN_CACHE_DIR=%s/shared-cache; (%s %s/p1 >/dev/null 2>&1; echo rc1=$?) & "
                 "(%s %s/p2 >/dev/null 2>&1; echo rc2=$?) & wait; ls $KILN_CACHE_DIR",
                 dir, cmd, dir, cmd, dir);
    if (rc != 0 || !strstr(out, "rc1=0") || !strstr(out, "rc2=0")) fail_msg("two compiles at once: %s", out);
    int so = 0, c = 0, other = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        size_t n = strlen(line);
        if (!strncmp(line, "rc", 2)) continue;
        if (n == 19 && !strcmp(line + 16, ".so")) so++;
        else if (n == 18 && !strcmp(line + 16, ".c")) c++;
        else other++;
    }
    if (so != 1 || c != 1 || other) fail_msg("the cache after two compiles at once: %d .so, %d .c, %d others", so, c, other);
}

/* kiln doctor's rows name the build's MPI (this build finds Open MPI), what the cuda
 * backend found (or why not) and NCCL; the devices and every switch follow. The rows'
 * verdicts against a broken stack are tests/doctor/test_doctor.py's. */
static void doctor_lists_mpi_and_switches(void **state)
{
    char out[16384];
    int rc = run(out, sizeof out, "%s doctor", tool());
    if (rc != 0) fail_msg("kiln doctor failed (a FAIL row?): %s", out);
    /* the summary comes first; the switches only under --switches */
    assert_true(strstr(out, " rows: ") && strstr(out, " rows: ") < strstr(out, "OK  "));
    assert_null(strstr(out, "POOL_SPIN"));
    rc = run(out, sizeof out, "%s doctor --switches", tool());
    if (rc != 0) fail_msg("kiln doctor --switches failed (a FAIL row?): %s", out);
    assert_non_null(strstr(out, "mpi  "));
    assert_non_null(strstr(out, "Open MPI"));
    assert_non_null(strstr(out, "POOL_SPIN"));
    assert_non_null(strstr(out, "ROWS_AVX512"));
    assert_non_null(strstr(out, "  cpu: ")); /* the devices */
    assert_non_null(strstr(out, " cuda  "));
    assert_non_null(strstr(out, " nccl  "));
    rc = run(out, sizeof out, "%s doctor --ops cpu", tool());
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "matmul"));
    assert_non_null(strstr(out, "0 on the cpu with copies")); /* the cpu runs all its own */
    rc = run(out, sizeof out, "%s doctor --ops npu", tool());
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "no device named 'npu'"));
}

static void bad_inputs_fail_with_a_reason(void **state)
{
    char out[8192];
    assert_int_equal(run(out, sizeof out, "%s train --data %s/nope.txt --out %s/nodata --steps 1", tool(), dir, dir), 1);
    assert_non_null(strstr(out, "nope.txt"));
    assert_int_equal(run(out, sizeof out, "%s train --steps many", tool()), 2);
    assert_non_null(strstr(out, "--steps"));
    assert_int_equal(run(out, sizeof out, "%s train --bogus 1", tool()), 2);
    assert_non_null(strstr(out, "unknown option"));
    assert_int_equal(run(out, sizeof out, "%s frobnicate", tool()), 2);
    /* Too little validation text is refused before any training. */
    assert_int_equal(run(out, sizeof out, "%s train --data %s --out %s/noval --steps 3 --val-fraction 0 " TINY, tool(),
                         corpus, dir), 1);
    assert_non_null(strstr(out, "validation"));
    /* A width that does not fit is refused, not truncated. */
    assert_int_equal(run(out, sizeof out, "%s train --data %s --out %s/d --width 4294967328", tool(), corpus, dir), 2);
    assert_non_null(strstr(out, "--width"));
    /* --config=FILE is read like --config FILE. */
    char cfg[512];
    snprintf(cfg, sizeof cfg, "%s/cfg.json", dir);
    FILE *fc = fopen(cfg, "w");
    assert_non_null(fc);
    fprintf(fc, "{\"steps\": 2, \"layers\": 1, \"width\": 16, \"heads\": 2, \"context\": 16, \"batch\": 2, \"threads\": 1}\n");
    fclose(fc);
    assert_int_equal(run(out, sizeof out, "%s train --data %s --out %s/cfg --config=%s", tool(), corpus, dir, cfg), 0);
    assert_non_null(strstr(out, "1 layer, C=16"));
    assert_non_null(strstr(out, "step     2/2"));
    /* A truncated checkpoint is refused with a message, not a crash. */
    char p[512], q[512];
    snprintf(p, sizeof p, "%s/a/model.safetensors", dir);
    snprintf(q, sizeof q, "%s/cut.safetensors", dir);
    assert_int_equal(run(NULL, 0, "head -c 1000 %s > %s", p, q), 0);
    int rc = run(out, sizeof out, "%s sample %s --max-tokens 5", tool(), q);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "cut.safetensors"));
    assert_int_equal(run(out, sizeof out, "%s train --help", tool()), 0);
    assert_non_null(strstr(out, "--resume"));
    /* Mixed precision: an unknown type is refused by name; serving's weight type
     * likewise. */
    assert_int_equal(run(out, sizeof out, "%s train --data %s --out %s/f --precision f8", tool(), corpus, dir), 1);
    assert_non_null(strstr(out, "--precision must be f32, bf16 or f16"));
    assert_int_equal(run(out, sizeof out, "%s serve %s/a --weights i8", tool(), dir), 1);
    assert_non_null(strstr(out, "--weights must be f32, bf16, f16 or q8_0"));
}

/* kiln train --precision bf16 and f16 train (the loss falls) and log what they run;
 * f16 shows its loss scale. Oracle: the first logged loss of the same run. */
static void train_in_mixed_precision(void **state)
{
    const char *prec[2] = {"bf16", "f16"};
    for (int i = 0; i < 2; i++) {
        char out[16384];
        int rc = run(out, sizeof out, "%s train --data %s --out %s/mp%d --steps 8 --log-every 1 --precision %s " TINY,
                     tool(), corpus, dir, i, prec[i]);
        if (rc != 0) fail_msg("kiln train --precision %s failed (%d): %s", prec[i], rc, out);
        assert_non_null(strstr(out, i ? "mixed precision f16 with loss scaling" : "mixed precision bf16"));
        if (i) assert_non_null(strstr(out, "| scale 65536"));
        const char *first = strstr(out, "step     1/8 | loss "), *last = strstr(out, "step     8/8 | loss ");
        assert_non_null(first);
        assert_non_null(last);
        double l1 = atof(first + strlen("step     1/8 | loss ")), l8 = atof(last + strlen("step     8/8 | loss "));
        if (!(l8 < l1)) fail_msg("--precision %s: loss %g after 8 steps, %g at the first", prec[i], l8, l1);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(train_writes_checkpoint_metrics_and_chart),
        cmocka_unit_test(resume_repeats_the_uninterrupted_losses),
        cmocka_unit_test(resume_refuses_a_changed_optimizer_or_seed),
        cmocka_unit_test(resume_survives_a_save_cut_between_its_files),
        cmocka_unit_test(sample_continues_the_prompt),
        cmocka_unit_test(info_and_plot_work_on_the_run),
        cmocka_unit_test(plot_draws_the_router_chart_of_an_moe_run),
        cmocka_unit_test(train_compile_matches_eager),
        cmocka_unit_test(compile_dumps_the_training_step),
        cmocka_unit_test(two_processes_compile_into_one_cache),
        cmocka_unit_test(doctor_lists_mpi_and_switches),
        cmocka_unit_test(bad_inputs_fail_with_a_reason),
        cmocka_unit_test(train_in_mixed_precision),
        cmocka_unit_test(resume_keeps_the_f16_loss_scale),
        cmocka_unit_test(f16_scaling_compiles_and_shards), /* after it: its eager run is the oracle */
        cmocka_unit_test(hf_folders_import_sample_and_export),
    };
    return cmocka_run_group_tests(tests, corpus_setup, corpus_teardown);
}
