/* The one thread pool. Work is split into contiguous ranges; the calling thread takes
 * part. With KILN_OPT_POOL_GEMM (the default) the BLAS runs single-threaded inside pool
 * tasks; without it the BLAS threads itself and is called only outside pool tasks, so
 * its threads and the pool's never compute at once. */
#ifndef KILN_CORE_THREADPOOL_H
#define KILN_CORE_THREADPOOL_H
#include <stdbool.h>
#include <stdint.h>

typedef void (*kiln__range_fn)(void *ctx, int64_t begin, int64_t end);

/* Runs fn over [0, n) in chunks of at least `grain` items, on all pool threads. */
void kiln__parallel_for(int64_t n, int64_t grain, kiln__range_fn fn, void *ctx);
/* The same one item at a time: a free thread takes the next item, so items of equal
 * cost, as many as a multiple of the threads, end level (kiln__parallel_for takes them
 * in chunks of up to n / (4 threads), which can leave one thread a chunk more). */
void kiln__parallel_items(int64_t n, kiln__range_fn fn, void *ctx);
int kiln__pool_size(void);
/* Whether a kiln__parallel_for called here runs on the calling thread alone (inside a
 * pool task, or a pool of one thread). */
bool kiln__pool_inline(void);
void kiln__pool_start(int nthreads);

/* The most threads a pool may have whatever the cores (KILN_NUM_THREADS's range, the
 * tools' --threads), and the most per online core: a count past either is capped with a
 * warning at start-up (kiln__pool_threads), not thousands of threads started. */
#define KILN__MAX_THREADS 1024
#define KILN__MAX_THREADS_PER_CORE 8
/* The pool size for a request of n threads (n <= 0: one per online core), capped as
 * above; a cap is said on stderr, naming where the count came from (from). */
int kiln__pool_threads(int n, const char *from);
#endif
