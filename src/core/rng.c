/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
 * A draw of n numbers takes n counters from the global generator; element i of that
 * draw is a pure function of (seed, offset + i), so any thread may compute any element
 * and the stream does not depend on the thread count. */
#include <math.h>
#include <pthread.h>
#include "core/rng.h"
#include "core/intercept.h"
#include "core/tensor_impl.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static kiln_rng_state state = {.seed = 0x6b696c6eULL, .offset = 0};

kiln_rng_state kiln_rng_get_state(void)
{
    pthread_mutex_lock(&lock);
    kiln_rng_state s = state;
    pthread_mutex_unlock(&lock);
    return s;
}

void kiln_rng_set_state(kiln_rng_state s)
{
    pthread_mutex_lock(&lock);
    state = s;
    pthread_mutex_unlock(&lock);
}

void kiln_manual_seed(uint64_t seed) { kiln_rng_set_state((kiln_rng_state){.seed = seed, .offset = 0}); }

/* Reserves n counters (rounded up to whole Philox blocks of 4); returns the first. While
 * this thread captures a graph nothing is reserved (seed and offset 0): the graph takes
 * the counters each time it runs (src/graph/graph.c, draw_random). */
uint64_t kiln__rng_take(uint64_t n, uint64_t *seed)
{
    if (kiln__dispatch_tracing()) {
        *seed = 0;
        return 0;
    }
    pthread_mutex_lock(&lock);
    uint64_t first = state.offset;
    *seed = state.seed;
    state.offset += (n + 3) / 4 * 4;
    pthread_mutex_unlock(&lock);
    return first;
}

static inline uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t *hi)
{
    uint64_t p = (uint64_t)a * b;
    *hi = (uint32_t)(p >> 32);
    return (uint32_t)p;
}

void kiln__philox(uint64_t seed, uint64_t counter, uint32_t out[4])
{
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint32_t hi0, hi1;
        uint32_t lo0 = mulhilo(0xD2511F53u, c0, &hi0);
        uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* Element i of a draw: the (i % 4)th word of block (offset + i) / 4. */
double kiln__rng_uniform(uint64_t seed, uint64_t offset, uint64_t i)
{
    uint32_t w[4];
    kiln__philox(seed, (offset + i) / 4, w);
    return ((double)(w[(offset + i) % 4] >> 8) + 0.5) * (1.0 / 16777216.0); /* (0, 1) */
}

/* Box-Muller on two words of the element's own block, so element i needs no neighbour. */
double kiln__rng_normal(uint64_t seed, uint64_t offset, uint64_t i)
{
    uint32_t w[4];
    uint64_t j = offset + i;
    kiln__philox(seed ^ 0x9e3779b97f4a7c15ULL, j, w);
    double u1 = ((double)w[0] + 0.5) * (1.0 / 4294967296.0);
    double u2 = ((double)w[1] + 0.5) * (1.0 / 4294967296.0);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
