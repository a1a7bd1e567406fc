#ifndef KILN_CORE_RNG_H
#define KILN_CORE_RNG_H
#include <stdint.h>
void kiln__philox(uint64_t seed, uint64_t counter, uint32_t out[4]);
/* Element i of a draw that reserved counters from offset on. */
double kiln__rng_uniform(uint64_t seed, uint64_t offset, uint64_t i);
double kiln__rng_normal(uint64_t seed, uint64_t offset, uint64_t i);
uint64_t kiln__rng_take(uint64_t n, uint64_t *seed);
#endif
