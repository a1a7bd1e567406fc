/* bench/device_graph: what a recorded replay saves on a device, and what capturing it as
 * the device's own graph (an OpenCL command buffer, a CUDA graph) adds. A block of
 * LAYERS x (matmul, GELU, layer norm) then a softmax and an in-place update of a state
 * (y = x; y = layer_norm(gelu(y @ w_l)); state += -1e-3 * softmax(y)), ROWS x WIDTH,
 * all of it on the device's own and generated kernels, run three ways in one process,
 * interleaved round by round: eagerly (dispatch per op), and replayed from one
 * recording. Whether the replay is a launch list or the device's graph is
 * KILN_OPT_DEVICE_GRAPHS (bench/device_graph.sh runs both). Prints one JSON line: median
 * ms per step of each, and what the replay ran as.
 *   build/bench_device_graph [--device opencl:0] [--rows 16] [--width 64] [--layers 4]
 *                            [--steps 50] [--rounds 5] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "kiln/kiln.h"

typedef struct {
    int layers;
    kiln_tensor_t *w[16], *state;
} block;

static kiln_status step(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
{
    block *b = ctx;
    kiln_tensor_t *y = in[0];
    for (int l = 0; l < b->layers && y; l++) y = kiln_layer_norm(kiln_gelu(kiln_matmul(y, b->w[l]), true), NULL, NULL, 1e-5);
    y = y ? kiln_softmax(y, -1) : NULL;
    kiln_status s = y ? kiln_add_(b->state, y, -1e-3) : kiln_last_status();
    out[0] = y;
    *n_out = 1;
    return s;
}

static kiln_tensor_t *on(const char *dev, int64_t r, int64_t c, double scale, unsigned seed)
{
    float *h = malloc(sizeof(float) * (size_t)(r * c));
    for (int64_t i = 0; i < r * c; i++) {
        seed = seed * 1103515245u + 12345u;
        h[i] = (float)(((seed >> 8) & 0xffff) / 65536.0 - 0.5) * (float)scale;
    }
    kiln_tensor_t *t = kiln_tensor_to(kiln_from_data(h, (int64_t[]){r, c}, 2, KILN_DTYPE_F32), dev);
    free(h);
    return t;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return v[n / 2];
}

int main(int argc, char **argv)
{
    const char *dev = "opencl:0";
    int rows = 16, width = 64, layers = 4, steps = 50, rounds = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--device")) dev = argv[i + 1];
        else if (!strcmp(argv[i], "--rows")) rows = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--width")) width = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--layers")) layers = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "bench_device_graph: unknown flag %s\n", argv[i]);
            return 2;
        }
    }
    if (rows < 1 || width < 1 || layers < 1 || layers > 16 || steps < 1 || rounds < 1 || rounds > 64) {
        fprintf(stderr, "bench_device_graph: --rows, --width, --steps >= 1, --layers 1..16, --rounds 1..64\n");
        return 2;
    }
    kiln_init(1);
    if (kiln_set_device(dev) != KILN_OK) {
        fprintf(stderr, "bench_device_graph: %s\n", kiln_last_error());
        return 1;
    }
    block b = {layers, {0}, NULL};
    for (int l = 0; l < layers; l++) b.w[l] = kiln_keep(on(dev, width, width, 2.0 / width, 7 + l));
    kiln_tensor_t *x = kiln_keep(on(dev, rows, width, 1.0, 3));
    b.state = kiln_keep(on(dev, rows, width, 1.0, 5));
    kiln_replay_t *r = NULL;
    kiln_tensor_t *y;
    int n;
    kiln_scope_begin();
    if (kiln_replay_record(step, &b, &x, 1, &r, &y, 1, &n) != KILN_OK) {
        fprintf(stderr, "bench_device_graph: %s\n", kiln_last_error());
        return 1;
    }
    kiln_scope_end();
    char why[256];
    bool native = kiln_replay_native(r, why, sizeof why);
    double eager[64], replay[64];
    for (int k = 0; k < rounds; k++) {
        kiln_device_synchronize(dev);
        double t0 = bench_now_s();
        for (int i = 0; i < steps; i++) {
            kiln_scope_begin();
            if (step(&b, &x, 1, &y, &n) != KILN_OK) return fprintf(stderr, "%s\n", kiln_last_error()), 1;
            kiln_scope_end();
        }
        kiln_device_synchronize(dev);
        double t1 = bench_now_s();
        for (int i = 0; i < steps; i++) {
            kiln_scope_begin();
            if (kiln_replay_run(r, &x, 1, &y, 1, &n) != KILN_OK) return fprintf(stderr, "%s\n", kiln_last_error()), 1;
            kiln_scope_end();
        }
        kiln_device_synchronize(dev);
        double t2 = bench_now_s();
        eager[k] = (t1 - t0) / steps * 1e3;
        replay[k] = (t2 - t1) / steps * 1e3;
    }
    printf("{\"device\": \"%s\", \"rows\": %d, \"width\": %d, \"layers\": %d, \"launches\": %d, \"eager_ms\": %.4f, "
           "\"replay_ms\": %.4f, \"replay_as\": \"%s\", \"native\": %s}\n",
           dev, rows, width, layers, kiln_replay_num_launches(r), median(eager, rounds), median(replay, rounds), why,
           native ? "true" : "false");
    kiln_replay_free(r);
    return 0;
}
