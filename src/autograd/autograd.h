/* Autograd's state on tensors, for the rooms above it (graph capture reads and sets a
 * leaf's gradient; a capture routes the gradients of real leaves into its graph). */
#ifndef KILN_AUTOGRAD_AUTOGRAD_H
#define KILN_AUTOGRAD_AUTOGRAD_H

#include "ops/registry.h"

/* Whether t takes part in autograd: a leaf that wants a gradient, or made by a recorded op. */
bool kiln__tracks(const kiln_tensor_t *t);
/* A leaf's accumulated gradient as it is held (borrowed; NULL when none), without the
 * capture's view of it that kiln_tensor_grad gives. */
kiln_tensor_t *kiln__autograd_grad(const kiln_tensor_t *t);
/* Replaces t's held gradient with g (the reference is taken; NULL drops it). */
kiln_status kiln__autograd_set_grad(kiln_tensor_t *t, kiln_tensor_t *g);

/* Where the gradients of real leaves go while a graph is captured on this thread: the
 * capture's values instead of the leaves (src/graph/graph.c). grad_of and zero_grad
 * stand for kiln_tensor_grad and kiln_tensor_zero_grad on a real leaf, accumulate for
 * the backward engine's sum into one. */
typedef struct {
    kiln_tensor_t *(*grad_of)(void *ctx, const kiln_tensor_t *leaf);
    void (*zero_grad)(void *ctx, kiln_tensor_t *leaf);
    kiln_status (*accumulate)(void *ctx, kiln_tensor_t *leaf, kiln_tensor_t *g);
    void *ctx;
} kiln__leaf_sink;
/* Sets this thread's sink (NULL: none); returns the one it replaces. */
const kiln__leaf_sink *kiln__autograd_set_leaf_sink(const kiln__leaf_sink *sink);

#endif
