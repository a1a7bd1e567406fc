#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "core/opts.h"
#include "core/threadpool.h"
#include "core/util.h"

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
    atomic_int active;   /* workers still running this job */
    atomic_ulong gen;    /* bumps per job; published after the fields above */
} job;

static _Thread_local int in_pool_task;

/* With KILN_OPT_POOL_SPIN a thread that waits (a worker for the next job, the caller
 * for the workers) first polls for this long before it sleeps on a condition variable.
 * Waking a sleeping thread costs tens of microseconds on a virtual machine, which is
 * more than a whole decode-sized matmul; a model step issues jobs microseconds apart,
 * so they find the workers still polling. Past the window, a thread sleeps and an idle
 * process uses no CPU. */
#define SPIN_S 200e-6

static inline void cpu_pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Polls until done(arg) or the spin window ends; true when done. */
static bool spin_until(bool (*done)(const void *), const void *arg)
{
    if (!kiln__opt(KILN__OPT_POOL_SPIN)) return done(arg);
    double end = 0;
    for (unsigned i = 0;; i++) {
        if (done(arg)) return true;
        cpu_pause();
        if ((i & 63) == 63) {
            double t = kiln__now_s();
            if (!end) end = t + SPIN_S;
            else if (t >= end) return false;
        }
    }
}

static bool new_job(const void *seen) { return atomic_load_explicit(&job.gen, memory_order_acquire) != *(const unsigned long *)seen; }
static bool job_done(const void *unused)
{
    (void)unused;
    return atomic_load_explicit(&job.active, memory_order_acquire) == 0;
}

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
    for (;;) {
        if (!spin_until(new_job, &seen)) {
            pthread_mutex_lock(&mu);
            while (!new_job(&seen)) pthread_cond_wait(&cv_work, &mu);
            pthread_mutex_unlock(&mu);
        }
        seen = atomic_load_explicit(&job.gen, memory_order_acquire);
        run_chunks();
        if (atomic_fetch_sub_explicit(&job.active, 1, memory_order_acq_rel) == 1) {
            /* Under mu, so a caller that saw active > 0 under mu is already waiting. */
            pthread_mutex_lock(&mu);
            pthread_cond_signal(&cv_done);
            pthread_mutex_unlock(&mu);
        }
    }
    return NULL;
}

void kiln__pool_start(int nthreads)
{
    if (workers || nthreads <= 1) return; /* n_threads stays 1 until workers run */
    workers = calloc((size_t)nthreads - 1, sizeof *workers);
    if (!workers) return;
    int started = 0;
    for (int i = 0; i < nthreads - 1; i++)
        if (pthread_create(&workers[i], NULL, worker, NULL) == 0) {
            pthread_detach(workers[i]);
            started++;
        }
    n_threads = started + 1;
}

int kiln__pool_threads(int n, const char *from)
{
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online < 1) online = 1;
    if (n <= 0) return (int)(online < KILN__MAX_THREADS ? online : KILN__MAX_THREADS);
    long cap = online * KILN__MAX_THREADS_PER_CORE;
    if (cap > KILN__MAX_THREADS) cap = KILN__MAX_THREADS;
    if (n > cap) {
        fprintf(stderr, "kiln: %d threads asked for (%s); using %ld, at most %d per online core (%ld online) and %d "
                "in all\n", n, from, cap, KILN__MAX_THREADS_PER_CORE, online, KILN__MAX_THREADS);
        n = (int)cap;
    }
    return n;
}

int kiln__pool_size(void) { return n_threads; }
bool kiln__pool_inline(void) { return n_threads == 1 || in_pool_task; }

/* Runs fn over [0, n) in chunks of `chunk` items, taken in order by whichever thread is
 * free; inline where nested, on a pool of one, or when one chunk holds everything. */
static void run_job(int64_t n, int64_t chunk, kiln__range_fn fn, void *ctx)
{
    if (n <= 0) return;
    if (n_threads == 1 || in_pool_task || n <= chunk) {
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&submit_mu);
    job.fn = fn;
    job.ctx = ctx;
    job.n = n;
    job.chunk = chunk;
    atomic_store(&job.next, 0);
    atomic_store(&job.active, n_threads - 1);
    /* The bump publishes the fields; taking mu for it means a worker that checked gen
     * under mu and went to sleep gets the broadcast. */
    pthread_mutex_lock(&mu);
    atomic_fetch_add_explicit(&job.gen, 1, memory_order_release);
    pthread_cond_broadcast(&cv_work);
    pthread_mutex_unlock(&mu);
    in_pool_task = 1;
    run_chunks();
    in_pool_task = 0;
    if (!spin_until(job_done, NULL)) {
        pthread_mutex_lock(&mu);
        while (!job_done(NULL)) pthread_cond_wait(&cv_done, &mu);
        pthread_mutex_unlock(&mu);
    }
    pthread_mutex_unlock(&submit_mu);
}

void kiln__parallel_for(int64_t n, int64_t grain, kiln__range_fn fn, void *ctx)
{
    if (grain < 1) grain = 1;
    int64_t chunk = (n + n_threads * 4 - 1) / (n_threads * 4);
    run_job(n, chunk < grain ? grain : chunk, fn, ctx);
}

void kiln__parallel_items(int64_t n, kiln__range_fn fn, void *ctx) { run_job(n, 1, fn, ctx); }
