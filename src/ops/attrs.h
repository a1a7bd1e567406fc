/* Attributes of one op call: a fixed-size plain struct so that it can be copied into an
 * autograd node, compared and hashed (zero it before filling it). */
#ifndef KILN_OPS_ATTRS_H
#define KILN_OPS_ATTRS_H

#include <stdbool.h>
#include <stdint.h>
#include "kiln/tensor.h"

typedef struct {
    int64_t shape[KILN_MAX_DIMS]; /* a shape, or a list of dims */
    int ndim;                     /* entries used in shape */
    int64_t i[4];                 /* op-specific integers (see ops.def) */
    double f[2];                  /* op-specific reals */
    uint64_t u[2];                /* random seed and counter offset */
    bool keepdim;
} kiln__attrs;

#endif
