/* bench/stream_read: the machine's read bandwidth as decoding sees it: T threads each
 * summing its share of a buffer of N MiB of floats (far beyond the caches), best of R
 * passes. Prints one JSON line with GB/s (1e9 bytes).
 *   build/bench_stream_read [--threads T] [--mib N] [--passes R] */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bench.h"

typedef struct {
    const float *p;
    size_t n;
    float sum;
} part;

/* Eight independent sums, so that the loop is bound by loads, not by one chain of adds. */
static void *run(void *arg)
{
    part *q = arg;
    float s[8] = {0};
    for (size_t i = 0; i + 8 <= q->n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += q->p[i + j];
    q->sum = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
    return NULL;
}

int main(int argc, char **argv)
{
    int T = 2, passes = 7;
    size_t mib = 1024;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) T = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--mib")) mib = (size_t)atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--passes")) passes = atoi(argv[i + 1]);
    }
    if (T < 1 || T > 256 || mib < 1 || passes < 1) return 2;
    size_t n = mib * 1024 * 1024 / sizeof(float);
    float *buf = malloc(n * sizeof(float));
    if (!buf) return 1;
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023);
    double best = 1e30, total = 0;
    part parts[256];
    pthread_t th[256];
    for (int r = 0; r < passes; r++) {
        double t0 = bench_now_s();
        for (int t = 0; t < T; t++) {
            parts[t] = (part){buf + n / T * t, n / T, 0};
            pthread_create(&th[t], NULL, run, &parts[t]);
        }
        for (int t = 0; t < T; t++) pthread_join(th[t], NULL), total += parts[t].sum;
        double dt = bench_now_s() - t0;
        if (dt < best) best = dt;
    }
    printf("{\"bench\":\"stream_read\",\"threads\":%d,\"mib\":%zu,\"GBps\":%.2f,\"check\":%.0f}\n", T, mib,
           (double)(n / T * T) * sizeof(float) / best / 1e9, total > 0 ? 1.0 : 0.0);
    free(buf);
    return 0;
}
