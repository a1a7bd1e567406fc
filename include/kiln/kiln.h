/* kiln.h — the whole public API. */
#ifndef KILN_H
#define KILN_H
#include "kiln/tensor.h"
#include "kiln/ops.h"
#endif
