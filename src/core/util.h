/* Small helpers that several rooms need: a monotonic clock, a 64-bit mixer, and a
 * growing array. */
#ifndef KILN_CORE_UTIL_H
#define KILN_CORE_UTIL_H
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* Room for one more element in the array whose pointer is at arrp (any element type:
 * the pointer is moved by memcpy, not through a cast), n elements in use, *cap
 * allocated, of elem bytes each: the capacity doubles, from first. False when out of
 * memory, the array as it was. */
static inline bool kiln__grow(void *arrp, int n, int *cap, size_t elem, int first)
{
    if (n < *cap) return true;
    int c = *cap ? 2 * *cap : first;
    void *a;
    memcpy(&a, arrp, sizeof a);
    if (!(a = realloc(a, elem * (size_t)c))) return false;
    memcpy(arrp, &a, sizeof a);
    *cap = c;
    return true;
}
#endif
