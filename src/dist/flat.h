/* Helpers shared by the gradient buckets (ddp.c) and ZeRO-1 (zero.c). */
#ifndef KILN_DIST_FLAT_H
#define KILN_DIST_FLAT_H
#include "kiln/ops.h"

/* A 1-D view of all of t's elements (t contiguous: parameters and their gradients). */
static inline kiln_tensor_t *kiln__flat_of(kiln_tensor_t *t)
{
    int64_t n = kiln_tensor_numel(t);
    return kiln_reshape(t, &n, 1);
}
#endif
