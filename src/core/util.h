/* Small helpers that several rooms need: a monotonic clock, 64-bit mixers, freeing many
 * buffers at once, and growing arrays. */
#ifndef KILN_CORE_UTIL_H
#define KILN_CORE_UTIL_H
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
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

/* SplitMix64's output function (Steele, Lea, Flood 2014): a counter-based hash, for draws
 * that depend only on their coordinates. */
static inline uint64_t kiln__splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static inline void kiln__free_n(void *const *p, size_t n)
{
    for (size_t i = 0; i < n; i++) free(p[i]);
}

/* free() of each argument: for an object whose free would list every buffer it holds. */
#define KILN__FREE(...) \
    kiln__free_n((void *const[]){__VA_ARGS__}, sizeof((void *const[]){__VA_ARGS__}) / sizeof(void *))

/* The array p (n items of size bytes, room for *cap) with room for one more: p itself,
 * or a larger copy with *cap doubled (from first); NULL when out of memory, and then p
 * is still the caller's and *cap is as it was. */
static inline void *kiln__grow(void *p, size_t n, size_t *cap, size_t first, size_t size)
{
    if (n < *cap) return p;
    size_t c = *cap ? 2 * *cap : first;
    void *q = realloc(p, c * size);
    if (q) *cap = c;
    return q;
}

/* kiln__grow on the array p in place, through tmp (a void *): true, or false when out
 * of memory (p and *cap are then as they were). */
#define KILN__GROW(p, n, cap, first, tmp) \
    (((tmp) = kiln__grow((p), (size_t)(n), (cap), (first), sizeof *(p))) != NULL && ((p) = (tmp), true))

/* Resizes the array p to n items, through tmp (a void *): true, or false when out of
 * memory (p is then as it was). */
#define KILN__RESIZE(p, n, tmp) (((tmp) = realloc((p), (size_t)(n) * sizeof *(p))) != NULL && ((p) = (tmp), true))

/* Room for need bytes in *p (capacity *cap, doubled up from first); false when out of
 * memory, and then *p and *cap are as they were. */
static inline bool kiln__reserve(char **p, size_t *cap, size_t need, size_t first)
{
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : first;
    while (c < need) c *= 2;
    char *q = realloc(*p, c);
    if (!q) return false;
    *p = q;
    *cap = c;
    return true;
}
#endif
