/* Small helpers that several rooms need: a monotonic clock and a 64-bit mixer. */
#ifndef KILN_CORE_UTIL_H
#define KILN_CORE_UTIL_H
#include <stdint.h>
#include <time.h>

/* Seconds on the monotonic clock. */
static inline double kiln__now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The murmur3 finalizer: every input bit moves every output bit (hashes, seeds). */
static inline uint64_t kiln__mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}
#endif
