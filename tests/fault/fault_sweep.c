/* Allocation fault injection over kiln's API (issue 51's proof), SQLite's way: each
 * scenario below is run once to count its allocations, then again for each n with the
 * nth allocation failing (tests/fault/fault_alloc.c). Every run is a child process of
 * its own (started fresh: kiln initialised in it), so that a crash, a hang or a leak is
 * that run's alone. A run passes when the scenario returns an error that says why
 * (kiln_last_error set), or succeeds all the same with the result of a clean run (the
 * digest each scenario computes from its outputs); and when, after it, a clean run in
 * the same process still gets that result and leaves no more tensor memory than the
 * clean run did (a process-wide cache, as flex's, is allowed; a leak grows), and, in
 * the ASan build, LeakSanitizer finds no leak at its end.
 *   fault_sweep [SCENARIO] [--max-runs N]     KILN_FAULT_ALLOC=N: that one run alone
 *   FAULT_INLINE=1 KILN_FAULT_ALLOC=N gdb --args fault_sweep SCENARIO    without a fork
 * Prints one line a scenario and 'N passed, N failed' at the end. */
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "core/parse.h" /* the one strict number parser */
#include "fault_alloc.h"
#include "kiln/flex.h"
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/ops.h"
#include "kiln/tokenizer.h"

static char dir[256];

#define TRY(x)                                                                                                         \
    do {                                                                                                               \
        if (!(x)) {                                                                                                    \
            s = kiln_last_status() ? kiln_last_status() : KILN_ERR_INTERNAL;                                           \
            goto out;                                                                                                  \
        }                                                                                                              \
    } while (0)

/* ---- the scenarios: each frees all it made, whatever fails ---- */

static kiln_status sc_autograd(double *digest)
{
    kiln_status s = KILN_OK;
    int64_t sa[2] = {4, 3}, sb[2] = {3, 5};
    kiln_tensor_t *a = kiln_randn(sa, 2, KILN_DTYPE_F32), *b = kiln_randn(sb, 2, KILN_DTYPE_F32);
    kiln_scope_begin();
    TRY(a && b);
    kiln_tensor_set_requires_grad(a, true);
    kiln_tensor_t *y = kiln_softmax(kiln_gelu(kiln_matmul(a, b), true), -1);
    TRY(y);
    kiln_tensor_t *loss = kiln_sum(kiln_mul(y, y), NULL, 0, false);
    TRY(loss);
    s = kiln_backward(loss);
    kiln_tensor_t *g = s == KILN_OK ? kiln_sum(kiln_tensor_grad(a), NULL, 0, false) : NULL;
    double v = 0, w = 0;
    if (s == KILN_OK) TRY(g && kiln_tensor_item(g, &v) == KILN_OK && kiln_tensor_item(loss, &w) == KILN_OK);
    *digest = v + w;
out:
    kiln_scope_end();
    kiln_tensor_free(a);
    kiln_tensor_free(b);
    return s;
}

static kiln_status sc_safetensors(double *digest)
{
    kiln_status s = KILN_OK;
    char path[400];
    snprintf(path, sizeof path, "%s/st.safetensors", dir);
    int64_t sh[2] = {3, 4};
    kiln_tensor_t *t[2] = {kiln_randn(sh, 2, KILN_DTYPE_F32), kiln_randn(sh, 1, KILN_DTYPE_BF16)};
    const char *names[2] = {"a", "b.c"};
    kiln_safetensors_t *f = NULL;
    TRY(t[0] && t[1]);
    const char *meta[] = {"format", "pt", NULL};
    if ((s = kiln_safetensors_save(path, names, t, 2, meta)) != KILN_OK) goto out;
    if ((s = kiln_safetensors_load(path, &f)) != KILN_OK) goto out;
    kiln_scope_begin();
    kiln_tensor_t *g = kiln_safetensors_get(f, "b.c"), *sum = g ? kiln_sum(kiln_cast(g, KILN_DTYPE_F32), NULL, 0, false) : NULL;
    s = sum ? kiln_tensor_item(sum, digest) : kiln_last_status();
    kiln_scope_end();
out:
    kiln_safetensors_free(f);
    kiln_tensor_free(t[0]);
    kiln_tensor_free(t[1]);
    return s;
}

static kiln_status sc_tokenizer(double *digest)
{
    static const char text[] = "the light was good and the darkness was upon the face of the deep waters; "
                               "and the light was good. <|endoftext|> caf\xc3\xa9 na\xc3\xafve 12345";
    kiln_status s;
    kiln_tokenizer_t *t = NULL, *u = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    char *back = NULL, path[400];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if ((s = kiln_tokenizer_train_bpe(text, sizeof text - 1, 280, &t)) != KILN_OK) goto out;
    if ((s = kiln_tokenizer_encode_new(t, text, sizeof text - 1, 0, &ids, &n)) != KILN_OK) goto out;
    if ((s = kiln_tokenizer_decode(t, ids, n, &back)) != KILN_OK) goto out;
    if (strcmp(back, text)) s = kiln_error(KILN_ERR_INTERNAL, "fault_sweep: the round trip changed the text");
    if (s == KILN_OK) s = kiln_tokenizer_save(t, path);
    if (s == KILN_OK) s = kiln_tokenizer_load(path, &u);
    *digest = (double)n;
    for (size_t i = 0; i < n; i++) *digest += (double)ids[i] * (double)(i + 1);
out:
    free(back);
    free(ids);
    kiln_tokenizer_free(t);
    kiln_tokenizer_free(u);
    return s;
}

static kiln_gpt_config tiny(void)
{
    kiln_gpt_config c = kiln_gpt_config_llama();
    c.n_layer = 1, c.n_head = 2, c.n_kv_head = 1, c.n_embd = 32, c.block_size = 16, c.vocab_size = 256;
    return c;
}

static kiln_status sc_gpt(double *digest)
{
    kiln_status s = KILN_OK;
    kiln_gpt_config c = tiny();
    kiln_gpt_t *m = NULL;
    if ((s = kiln_gpt_new(&c, 7, &m)) != KILN_OK) return s;
    kiln_scope_begin();
    kiln_tensor_t *idx = kiln_arange(0, 16, 1, KILN_DTYPE_I64), *tg = kiln_arange(1, 17, 1, KILN_DTYPE_I64), *loss = NULL;
    TRY(idx && tg);
    int64_t sh[2] = {2, 8};
    idx = kiln_reshape(idx, sh, 2), tg = kiln_reshape(tg, sh, 2);
    TRY(idx && tg);
    TRY(kiln_gpt_forward(m, idx, tg, true, &loss) && loss);
    s = kiln_backward(loss);
    if (s == KILN_OK) s = kiln_tensor_item(loss, digest);
    kiln_tensor_t *g = kiln_tensor_grad(kiln_gpt_param(m, 0, NULL));
    double v = 0;
    if (s == KILN_OK) TRY(g && kiln_tensor_item(kiln_sum(g, NULL, 0, false), &v) == KILN_OK);
    *digest += v;
out:
    kiln_scope_end();
    kiln_gpt_free(m);
    return s;
}

static kiln_status sc_hf_load(double *digest)
{
    char path[400];
    snprintf(path, sizeof path, "%s/hf", dir);
    kiln_gpt_t *m = NULL;
    kiln_tokenizer_t *t = NULL;
    char *tmpl = NULL;
    kiln_status s = kiln_model_load(path, &m, &t, &tmpl);
    if (s == KILN_OK) {
        kiln_scope_begin();
        kiln_tensor_t *p = kiln_gpt_param(m, 0, NULL), *sum = p ? kiln_sum(p, NULL, 0, false) : NULL;
        s = sum ? kiln_tensor_item(sum, digest) : kiln_last_status();
        kiln_scope_end();
    }
    kiln_gpt_free(m);
    kiln_tokenizer_free(t);
    free(tmpl);
    return s;
}

static kiln_status sc_flex(double *digest)
{
    kiln_flex_t *f = NULL, *g = NULL, *h = NULL;
    kiln_block_mask_t *bm = NULL;
    kiln_status s = kiln_flex_new("30.0 * tanh(score / 30.0) + (kv_idx - q_idx) * 0.25",
                                  "q_idx >= kv_idx && q_idx - kv_idx < 6", NULL, 0, &f);
    kiln_flex_inputs in = {.heads = 2};
    if (s == KILN_OK) s = kiln_flex_preset("window:4+softcap:20+alibi", &in, &g);
    if (s == KILN_OK) s = kiln_flex_and(f, g, &h);
    if (s == KILN_OK) s = kiln_block_mask_new(h, 1, 2, 16, 16, 4, 4, &bm);
    if (s == KILN_OK) {
        int64_t full, partial, empty;
        double density;
        kiln_block_mask_stats(bm, &full, &partial, &empty, &density);
        *digest = (double)full * 1e6 + (double)partial * 1e3 + (double)empty + density;
    }
    kiln_block_mask_free(bm);
    kiln_flex_free(f);
    kiln_flex_free(g);
    kiln_flex_free(h);
    return s;
}

static const struct {
    const char *name;
    kiln_status (*run)(double *digest);
} scenarios[] = {
    {"autograd", sc_autograd}, {"safetensors", sc_safetensors}, {"tokenizer", sc_tokenizer},
    {"gpt", sc_gpt},           {"hf_load", sc_hf_load},         {"flex", sc_flex},
};

/* ---- the runs ---- */

enum { OK_ERROR = 0, OK_SUCCEEDED = 1, NO_MESSAGE = 3, LEAKED = 4, WRONG = 5, BROKEN = 6, LSAN_LEAK = 7 };

/* LeakSanitizer's check, in the ASan build (NULL in the others). A child ends with
 * _exit, which skips the check LeakSanitizer makes at exit, so it asks for one itself. */
int __lsan_do_recoverable_leak_check(void) __attribute__((weak));

/* What a run tells the sweep: the allocations it counted, the digest of its results, and
 * the tensor memory it left (a process-wide cache: flex's compiled modifiers). */
typedef struct {
    long count;
    double digest;
    long long left;
} report;

/* In the child: kiln set up, the scenario run with the nth allocation failing, then run
 * again with none failing: the library must still work (the same digest as ref's) and
 * leave no more memory than a clean run does (a leak grows, a cache does not). */
static int child(int sc, long n, const report *ref, int report_fd)
{
    alarm(120); /* a hang is a failure: SIGALRM ends it */
    kiln_init(1);
    size_t before = kiln_memory_allocated();
    kiln_clear_error();
    double digest = 0;
    fault_arm(n);
    kiln_manual_seed(1234); /* every run draws the same numbers */
    kiln_status s = scenarios[sc].run(&digest);
    report r = {fault_count(), digest, (long long)(kiln_memory_allocated() - before)};
    fault_arm(0);
    if (report_fd >= 0) (void)!write(report_fd, &r, sizeof r);
    const char *name = scenarios[sc].name;
    if (s != KILN_OK && (!strcmp(kiln_last_error(), "no error") || !*kiln_last_error())) {
        fprintf(stderr, "fault %s n=%ld: status %d without a message\n", name, n, s);
        return NO_MESSAGE;
    }
    if (s == KILN_OK && ref && digest != ref->digest) {
        fprintf(stderr, "fault %s n=%ld: succeeded with a different result (%.17g, not %.17g)\n", name, n, digest,
                ref->digest);
        return WRONG;
    }
    kiln_manual_seed(1234);
    kiln_status s2 = scenarios[sc].run(&digest);
    long long left = (long long)(kiln_memory_allocated() - before);
    if (s2 != KILN_OK || (ref && digest != ref->digest)) {
        fprintf(stderr, "fault %s n=%ld: after it, a clean run %s (%s)\n", name, n, s2 ? "fails" : "differs",
                kiln_last_error());
        return BROKEN;
    }
    long long cache = ref ? ref->left : r.left;
    if (left != cache) {
        fprintf(stderr, "fault %s n=%ld: %lld tensor bytes left after a clean run where %lld are cached (status %d: "
                "%s)\n", name, n, left, cache, s, kiln_last_error());
        return LEAKED;
    }
    return s == KILN_OK ? OK_SUCCEEDED : OK_ERROR;
}

/* Runs one child; its exit status (or 128 + the signal that ended it). */
static int spawn(int sc, long n, const report *ref, report *got)
{
    int fds[2];
    if (pipe(fds) != 0) return 200;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        int st = child(sc, n, ref, fds[1]);
        if ((st == OK_ERROR || st == OK_SUCCEEDED) && __lsan_do_recoverable_leak_check &&
            __lsan_do_recoverable_leak_check())
            st = LSAN_LEAK; /* (its report is on stderr) */
        _exit(st);
    }
    close(fds[1]);
    report r = {-1, 0, 0};
    if (read(fds[0], &r, sizeof r) != (ssize_t)sizeof r) r.count = -1;
    close(fds[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    if (got) *got = r;
    return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st);
}

static int setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/kiln-fault-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) { /* the HF folder hf_load reads: made in a child, so the parent stays fresh */
        kiln_gpt_config c = tiny();
        kiln_gpt_t *m = NULL;
        kiln_tokenizer_t *t = kiln_tokenizer_byte();
        char path[400];
        snprintf(path, sizeof path, "%s/hf", dir);
        int bad = kiln_gpt_new(&c, 7, &m) != KILN_OK || kiln_hf_save(m, t, path, KILN_DTYPE_BF16) != KILN_OK;
        if (bad) fprintf(stderr, "fault_sweep: set-up: %s\n", kiln_last_error());
        _exit(bad);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return !WIFEXITED(st) || WEXITSTATUS(st) != 0;
}

int main(int argc, char **argv)
{
    const char *only = NULL;
    int64_t max_runs = 400, at = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--max-runs") || i + 1 == argc) only = argv[i];
        else if (kiln__parse_i64(argv[++i], 1, INT64_MAX, "--max-runs", &max_runs) != KILN_OK)
            return fprintf(stderr, "fault_sweep: %s\n", kiln_last_error()), 2;
    }
    setenv("KILN_NUM_THREADS", "1", 1); /* one thread: the nth allocation is the same one every run */
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    json_set_alloc_funcs(fault_json_malloc, free);
    if (setup()) return 1;
    const char *one = getenv("KILN_FAULT_ALLOC"); /* (src/core/env.def lists it) */
    if (one && kiln__parse_i64(one, 0, 1 << 30, "KILN_FAULT_ALLOC", &at) != KILN_OK)
        return fprintf(stderr, "fault_sweep: %s\n", kiln_last_error()), 2;
    if (at == 0) one = NULL; /* (0: sweep them all, as env.def says) */
    if (one && only && getenv("FAULT_INLINE")) /* one run in this process, for a debugger */
        for (size_t sc = 0; sc < sizeof scenarios / sizeof scenarios[0]; sc++)
            if (!strcmp(only, scenarios[sc].name)) return child((int)sc, (long)at, NULL, -1);
    int passed = 0, failed = 0;
    for (size_t sc = 0; sc < sizeof scenarios / sizeof scenarios[0]; sc++) {
        if (only && strcmp(only, scenarios[sc].name)) continue;
        report ref;
        int st = spawn((int)sc, 0, NULL, &ref);
        long k = ref.count;
        if (st != OK_SUCCEEDED || k <= 0) {
            printf("FAIL  %s: does not run without faults (exit %d)\n", scenarios[sc].name, st);
            failed++;
            continue;
        }
        long step = k > max_runs ? (k + max_runs - 1) / max_runs : 1, first = 1;
        if (one) first = (long)at, k = first, step = 1;
        int errors = 0, succeeded = 0, bad = 0;
        for (long n = first; n <= k; n += step) {
            st = spawn((int)sc, n, &ref, NULL);
            if (st == OK_ERROR) errors++;
            else if (st == OK_SUCCEEDED) succeeded++;
            else {
                bad++;
                printf("      %s: allocation %ld failing: %s (exit %d)\n", scenarios[sc].name, n,
                       st > 128 ? "crashed or hung" : st == LEAKED ? "leaked tensor memory" :
                       st == NO_MESSAGE ? "an error without a message" : st == WRONG ? "a wrong result" :
                       st == BROKEN ? "the library broken after it" : st == LSAN_LEAK ? "a leak (LeakSanitizer)" :
                       "an ASan report or another failure", st);
            }
        }
        printf("%s  %s: %ld allocations, %d runs each failing one (every %ld): %d errors said, %d recovered, %d bad\n",
               bad ? "FAIL" : "ok  ", scenarios[sc].name, one ? 1 : k, errors + succeeded + bad, step, errors,
               succeeded, bad);
        bad ? failed++ : passed++;
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
