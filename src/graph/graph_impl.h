/* Private layout of the graph IR (src/graph/graph.c), for its passes (passes.c) and the
 * compiler (src/compile/). */
#ifndef KILN_GRAPH_IMPL_H
#define KILN_GRAPH_IMPL_H

#include <string.h>
#include "core/tensor_impl.h"
#include "kiln/graph.h"
#include "ops/registry.h"

enum { V_ARG, V_CONST, V_OP };

typedef struct {
    int kind, index; /* argument number, or the producing node */
    int out;         /* which output of that node */
    kiln__meta meta;
    kiln_tensor_t *t; /* V_CONST: the captured tensor (retained) */
    kiln__backend *be; /* V_ARG: the device its example was on */
} value;

typedef struct {
    kiln__op_id op;
    kiln__attrs attrs;
    int n_in, n_out;
    int *in;                 /* value numbers */
    int out[KILN__MAX_OUT];  /* value numbers; 0 for an in-place op */
} node;

/* A real leaf whose gradient the graph computes, reads or clears. At the end of a run
 * the leaf's gradient is freed if `clear`, then `value` is added into it unless
 * `dropped` (the function zeroed it after using it: the gradient lives only inside the
 * graph). A graph that `read` the gradient needs the leaf to hold none when it starts. */
typedef struct {
    kiln_tensor_t *leaf; /* retained */
    int value;           /* the gradient computed; 0 when dropped */
    kiln_tensor_t *acc;  /* during capture: the meta tensor of the sum so far */
    bool read, dropped, clear;
} leaf_grad;

struct kiln_graph {
    leaf_grad *lg;
    int n_lg;
    size_t cap_lg;
    value *v;
    int n_v; /* value 0 is unused: 0 means "a real tensor" in a tensor header */
    size_t cap_v;
    node *nd;
    int n_nd;
    size_t cap_nd;
    int n_args;
    int outs[KILN_GRAPH_MAX_OUT], n_outs;
    kiln_status failed; /* the first error of a hook that cannot return one, reported at the end of capture */
    char failed_msg[320];
};

/* One run of a graph (the interpreter's, and a compiled program's): rt[v] holds value
 * v's tensor; arguments and captured tensors are bound at the start, grad mode is off
 * until the end. */
typedef struct {
    kiln_tensor_t **rt;
    bool grad_was;
} kiln__graph_frame;

/* kiln_graph_capture, with `strided`: the arguments keep their examples' strides (the
 * graph then assumes them; kiln_graph_capture assumes contiguous arguments). */
kiln_status kiln__graph_capture_as(kiln_graph_fn fn, void *ctx, kiln_tensor_t *const *example, int n_in, bool strided,
                                   kiln_graph_t **out);
/* Checks the arguments and binds them (nothing to end on failure). */
kiln_status kiln__graph_frame_begin(const kiln_graph_t *g, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out,
                                    int max_out, int *n_out, kiln__graph_frame *f);
/* Runs node k through dispatch at step `now`: outputs nothing reads (last 0) are dropped,
 * inputs whose last step is now are freed. */
kiln_status kiln__graph_run_node(const kiln_graph_t *g, int k, kiln__graph_frame *f, const int *last, int now);
/* last[v] = 1 + the index of the last node that reads v; n_nd + 1 for the outputs and
 * leaf gradients; 0 for values nothing reads (last has n_v zeroed entries). */
void kiln__graph_last_use(const kiln_graph_t *g, int *last);
/* Passes drop ops but keep value numbers: is v still made (its op still outputs it)? */
bool kiln__graph_live(const kiln_graph_t *g, int v);
/* The value whose memory v lives in: v, or the base that its views lead back to. */
int kiln__graph_root(const kiln_graph_t *g, int v);
/* kiln_graph_decompose; all: every op that has a decomposition takes it. */
kiln_status kiln__graph_decompose(kiln_graph_t *g, bool all, int *decomposed);
/* Is op elementwise (each output element from the same element of each input: the
 * arithmetic, activations and their backwards, comparisons, where, cast)? */
bool kiln__graph_elementwise(kiln__op_id op);
/* Does op with attributes a draw random numbers (rand, dropout with p > 0)? In a graph
 * its seed and offset are taken afresh at the start of every run. */
bool kiln__graph_random(kiln__op_id op, const kiln__attrs *a);
/* res[v] = true for each value the graph returns or adds into a leaf's gradient. */
void kiln__graph_mark_results(const kiln_graph_t *g, bool *res);
/* Frees value v if step `now` is its last read (intermediates only). */
void kiln__graph_release(const kiln_graph_t *g, kiln__graph_frame *f, int v, const int *last, int now);
/* After status s: adds the leaf gradients, gives the outputs (in the caller's scope),
 * frees the rest; returns s or the first new error. */
kiln_status kiln__graph_frame_end(const kiln_graph_t *g, kiln__graph_frame *f, kiln_status s, kiln_tensor_t **out,
                                  int *n_out);

/* Re-points the outputs of nodes [from, to) at their nodes' places (after nodes moved). */
void kiln__graph_reindex(kiln_graph_t *g, int from, int to);
/* Removes the nodes k with drop[k] (their values keep their numbers), the others moving
 * down in order; returns how many went. */
int kiln__graph_drop(kiln_graph_t *g, const bool *drop);
/* mut[v] = true for each value updated in place, or, back through views, aliased by
 * one that is. */
void kiln__graph_mutated(const kiln_graph_t *g, bool *mut);
/* Inserts a copy of node n (one output, a new value, number in *out_value) at position
 * at; the nodes from there move up one. */
kiln_status kiln__graph_insert_node(kiln_graph_t *g, int at, const node *n, int *out_value);
/* A rewrite: the graph replayed in capture mode into a new one that then takes its
 * place, each node recorded as it is unless `rule` records it (and the `*used - 1`
 * nodes after it) in another form: rule(g, k, ins, map, ctx, used) gets node k's input
 * tensors, sets map[] for the outputs of the nodes it took, and leaves *used 0 to take
 * none. Values are renumbered; inputs, captured tensors, outputs and leaf gradients
 * keep their meaning. */
typedef kiln_status (*kiln__graph_rule)(const kiln_graph_t *g, int k, kiln_tensor_t **ins, kiln_tensor_t **map,
                                        void *ctx, int *used);
kiln_status kiln__graph_rewrite(kiln_graph_t *g, const char *who, kiln__graph_rule rule, void *ctx, int *count);

/* A launch made outside dispatch (a compiled program's generated kernel on be): the
 * replay calls call(ctx) in its place, and free_ctx(ctx) when it is freed; the replay
 * takes ctx, also when noting fails. call NULL: the caller ran out of memory making
 * ctx, and the recording fails. */
void kiln__replay_note_call(kiln__backend *be, kiln_status (*call)(void *ctx), void *ctx, void (*free_ctx)(void *ctx));

#endif
