#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include "core/threadpool.h"

static pthread_t *workers;
static int n_threads = 1; /* including the caller */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_work = PTHREAD_COND_INITIALIZER, cv_done = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t submit_mu = PTHREAD_MUTEX_INITIALIZER;

static struct {
    kiln__range_fn fn;
    void *ctx;
    int64_t n, chunk;
    atomic_llong next;
    int active;        /* workers still running this job */
    unsigned long gen; /* bumps per job */
} job;

static _Thread_local int in_pool_task;

static void run_chunks(void)
{
    for (;;) {
        int64_t b = atomic_fetch_add(&job.next, job.chunk);
        if (b >= job.n) break;
        int64_t e = b + job.chunk < job.n ? b + job.chunk : job.n;
        job.fn(job.ctx, b, e);
    }
}

static void *worker(void *arg)
{
    (void)arg;
    in_pool_task = 1;
    unsigned long seen = 0;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (job.gen == seen) pthread_cond_wait(&cv_work, &mu);
        seen = job.gen;
        pthread_mutex_unlock(&mu);
        run_chunks();
        pthread_mutex_lock(&mu);
        if (--job.active == 0) pthread_cond_signal(&cv_done);
    }
    return NULL;
}

void kiln__pool_start(int nthreads)
{
    if (workers || nthreads <= 1) {
        if (!workers) n_threads = 1;
        return;
    }
    workers = calloc((size_t)nthreads - 1, sizeof *workers);
    if (!workers) return;
    int started = 0;
    for (int i = 0; i < nthreads - 1; i++) {
        pthread_attr_t at;
        pthread_attr_init(&at);
        if (pthread_create(&workers[i], &at, worker, NULL) == 0) {
            pthread_detach(workers[i]);
            started++;
        }
        pthread_attr_destroy(&at);
    }
    n_threads = started + 1;
}

int kiln__pool_size(void) { return n_threads; }

void kiln__parallel_for(int64_t n, int64_t grain, kiln__range_fn fn, void *ctx)
{
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    /* Nested calls and small jobs run inline. */
    if (n_threads == 1 || in_pool_task || n <= grain) {
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&submit_mu);
    int64_t chunk = (n + n_threads * 4 - 1) / (n_threads * 4);
    if (chunk < grain) chunk = grain;
    pthread_mutex_lock(&mu);
    job.fn = fn;
    job.ctx = ctx;
    job.n = n;
    job.chunk = chunk;
    atomic_store(&job.next, 0);
    job.active = n_threads - 1;
    job.gen++;
    pthread_cond_broadcast(&cv_work);
    pthread_mutex_unlock(&mu);
    in_pool_task = 1;
    run_chunks();
    in_pool_task = 0;
    pthread_mutex_lock(&mu);
    while (job.active > 0) pthread_cond_wait(&cv_done, &mu);
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&submit_mu);
}
