/* src/core/kmath.h for C compiled into kiln (the cpu backend's kernels): the helpers
 * inline always, so that the vectorizer sees through them. */
#ifndef KILN_CORE_KMATH_C_H
#define KILN_CORE_KMATH_C_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define KM_FN static inline __attribute__((always_inline))
static inline __attribute__((always_inline)) float km_bits(int32_t b)
{
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static inline __attribute__((always_inline)) int32_t km_fbits(float f)
{
    int32_t b;
    memcpy(&b, &f, 4);
    return b;
}
#include "core/kmath.h"

#endif
