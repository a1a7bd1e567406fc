/* bench/flex: flex attention's forward on the cpu (issue 27), without gradients, in one
 * run: for each T, kiln's dense causal attention (kiln_attention, the peer), flex
 * attention with the causal preset, and with a sliding window of T/8 (and of a fixed
 * W, to show the time growing linearly in T); B x H heads of D, f32. Each a median over
 * ROUNDS interleaved rounds. Prints one JSON line per T with the ms and the ratios
 * dense causal / flex, and the peak bytes kiln's allocator held during one call of the
 * T/8 window (beyond what was held before it; per T, to show it grows as O(T)). With
 * --backward 1, each call is the forward and the backward (gradients of q, k, v), the
 * backward seeded with a dense random gradient of the output, as the layer above
 * attention hands it one (--seed sum: the gradient of the output's sum, a broadcast of
 * ones that attention's backward first copies into a dense tensor, as this benchmark
 * ran until 2026-12-07). With
 * --device opencl the tensors live there (the fused forward is OpenCL C; kiln's dense
 * attention is the cpu's with copies there). Before the timed rounds of each T, every
 * variant runs for at least --warm-ms (200) ms.
 *   build/bench_flex [--T 512,1024,2048,4096] [--B 1] [--H 8] [--D 64] [--W 256] [--block 32] [--kv-block 32] [--rounds 5] [--backward 0|1] [--seed dense|sum] [--device cpu|opencl] [--warm-ms 200] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "kiln/kiln.h"

static bool backward; /* --backward: forward and backward (gradients of q, k, v) */
static kiln_tensor_t *dy; /* the output's gradient, with --backward (NULL: --seed sum) */

static double time_one(int which, kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v, kiln_flex_t *const *f,
                       kiln_block_mask_t *const *bm)
{
    kiln_scope_begin();
    kiln_tensor_t *in[3] = {q, k, v};
    for (int i = 0; backward && i < 3; i++) {
        in[i] = kiln_detach(in[i]);
        kiln_tensor_set_requires_grad(in[i], true);
    }
    double t0 = bench_now_s();
    kiln_tensor_t *y = which == 0 ? kiln_attention(in[0], in[1], in[2], true, 0)
                                  : kiln_flex_attention(in[0], in[1], in[2], f[which - 1], bm[which - 1], 0, NULL);
    if (y && backward && (dy ? kiln_backward_with(y, dy) : kiln_backward(kiln_sum(y, NULL, 0, false))) != KILN_OK)
        y = NULL;
    if (y && kiln_device_synchronize(kiln_tensor_device(y)) != KILN_OK) y = NULL; /* a device's queue runs behind */
    double dt = bench_now_s() - t0;
    if (!y) {
        fprintf(stderr, "bench_flex: %s\n", kiln_last_error());
        exit(1);
    }
    kiln_scope_end();
    return dt * 1e3;
}

int main(int argc, char **argv)
{
    const char *Ts = "512,1024,2048,4096";
    int64_t B = 1, H = 8, D = 64, W = 256, block = KILN_FLEX_BLOCK, kv_block = KILN_FLEX_BLOCK;
    int rounds = 5;
    double warm_ms = 200;
    const char *device = "cpu", *seed = "dense";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--T")) Ts = argv[i + 1];
        else if (!strcmp(argv[i], "--B")) B = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--H")) H = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--D")) D = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--W")) W = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--block")) block = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--kv-block")) kv_block = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--backward")) backward = atoi(argv[i + 1]) != 0;
        else if (!strcmp(argv[i], "--device")) device = argv[i + 1];
        else if (!strcmp(argv[i], "--seed") && (!strcmp(argv[i + 1], "dense") || !strcmp(argv[i + 1], "sum"))) seed = argv[i + 1];
        else if (!strcmp(argv[i], "--warm-ms")) warm_ms = atof(argv[i + 1]);
        else {
            fprintf(stderr, "usage: bench_flex [--T LIST] [--B N] [--H N] [--D N] [--W N] [--block N] [--kv-block N] [--rounds N] [--backward 0|1] [--seed dense|sum] [--device NAME] [--warm-ms MS]\n");
            return 2;
        }
    }
    if (rounds < 1 || rounds > 64) rounds = 5;
    kiln_init(0);
    kiln_set_grad_enabled(backward);
    if (kiln_set_device(device) != KILN_OK) {
        fprintf(stderr, "bench_flex: %s\n", kiln_last_error());
        return 1;
    }
    for (const char *p = Ts; *p;) {
        int64_t T = atoll(p);
        p += strcspn(p, ",");
        if (*p) p++;
        if (T < 8) continue;
        char win[64], fixed[64];
        snprintf(win, sizeof win, "window:%lld", (long long)(T / 8));
        snprintf(fixed, sizeof fixed, "window:%lld", (long long)W);
        kiln_flex_t *f[3];
        kiln_block_mask_t *bm[3];
        const char *specs[3] = {"causal", win, fixed};
        for (int i = 0; i < 3; i++)
            if (kiln_flex_preset(specs[i], NULL, &f[i]) != KILN_OK || kiln_block_mask_new(f[i], 1, 1, T, T, block, kv_block, &bm[i]) != KILN_OK) {
                fprintf(stderr, "bench_flex: %s\n", kiln_last_error());
                return 1;
            }
        int64_t shape[4] = {B, H, T, D};
        kiln_manual_seed(1);
        kiln_tensor_t *q = kiln_keep(kiln_randn(shape, 4, KILN_DTYPE_F32)), *k = kiln_keep(kiln_randn(shape, 4, KILN_DTYPE_F32)),
                      *v = kiln_keep(kiln_randn(shape, 4, KILN_DTYPE_F32));
        dy = backward && !strcmp(seed, "dense") ? kiln_keep(kiln_randn(shape, 4, KILN_DTYPE_F32)) : NULL;
        /* warm-up: kernels built, caches, and both vCPUs busy for warm_ms (an idle vCPU of
         * a virtual machine comes back slowly: short runs at 2 threads read up to 2x slow) */
        double warm_end = bench_now_s() + warm_ms / 1e3;
        do {
            for (int w = 0; w < 4; w++) time_one(w, q, k, v, f, bm);
        } while (bench_now_s() < warm_end);
        double ms[4][64];
        for (int r = 0; r < rounds; r++)
            for (int w = 0; w < 4; w++) ms[w][r] = time_one(w, q, k, v, f, bm);
        double med[4];
        for (int w = 0; w < 4; w++) {
            qsort(ms[w], (size_t)rounds, sizeof(double), bench_cmp_double);
            med[w] = ms[w][rounds / 2];
        }
        /* the peak of kiln's allocator over one call of the T/8 window, less what was
         * held before it (q, k, v) */
        size_t held = kiln_memory_peak();
        kiln_memory_reset_peak();
        size_t before = kiln_memory_peak();
        time_one(2, q, k, v, f, bm);
        size_t peak = kiln_memory_peak() - before;
        (void)held;
        printf("{\"bench\":\"flex\",\"device\":\"%s\",\"block\":%lld,\"kv_block\":%lld,\"T\":%lld,\"B\":%lld,\"H\":%lld,\"D\":%lld,\"threads\":%d,\"dense_causal_ms\":%.3f,"
               "\"flex_causal_ms\":%.3f,\"flex_window_T8_ms\":%.3f,\"flex_window_%lld_ms\":%.3f,"
               "\"dense_over_flex_causal\":%.3f,\"dense_over_window_T8\":%.3f,\"window_T8_peak_bytes\":%zu,"
               "\"window_T8_peak_bytes_per_T\":%.0f,\"backward\":%s}\n",
               device, (long long)block, (long long)kv_block, (long long)T, (long long)B, (long long)H, (long long)D, kiln_num_threads(), med[0], med[1], med[2],
               (long long)W, med[3], med[0] / med[1], med[0] / med[2], peak, (double)peak / (double)T,
               backward ? "true" : "false");
        fflush(stdout);
        for (int i = 0; i < 3; i++) {
            kiln_block_mask_free(bm[i]);
            kiln_flex_free(f[i]);
        }
        kiln_tensor_free(q), kiln_tensor_free(k), kiln_tensor_free(v), kiln_tensor_free(dy);
    }
    return 0;
}
