/* kiln/graph.h — capturing ordinary kiln code into a graph, without changing it.
 *
 *     static kiln_status mlp(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out)
 *     {
 *         const my_weights *w = ctx;
 *         out[0] = kiln_gelu(kiln_add(kiln_matmul(in[0], w->w1), w->b1), true);
 *         *n_out = 1;
 *         return out[0] ? KILN_OK : kiln_last_status();
 *     }
 *     kiln_graph_t *g;
 *     kiln_graph_capture(mlp, &w, &x, 1, &g);      // records; computes nothing
 *     kiln_tensor_t *y;
 *     int n;
 *     kiln_graph_run(g, &x2, 1, &y, 1, &n);       // runs the recorded ops on x2
 *
 * In capture mode every kiln op called by the function is recorded with the shapes and
 * dtypes of its results, on tensors that have no data (meta tensors); the same function
 * runs eagerly when not captured. The function's arguments are the graph's inputs
 * (their shapes and dtypes are what it assumes, checked on every run); any real tensor
 * it uses (parameters, constants) is captured by reference, so a run sees its contents
 * at that time, and an in-place update of one is applied to it by every run. Reading a
 * captured tensor's value (kiln_tensor_item, kiln_tensor_to_host) is an error naming the
 * op that made it: the graph could not replay a decision taken on data.
 *
 * Autograd works during capture: a kiln_backward inside the function records the
 * backward ops into the same graph (the joint graph), and the gradients of real leaves
 * (parameters) become values of the graph that each run adds into those leaves, as
 * kiln_backward would; nothing touches them while capturing.
 *
 * This is the first stage of kiln compile: kiln_graph_run interprets the graph through
 * the ordinary kernels (bitwise the eager results), freeing each intermediate after its
 * last use; lowering to fused generated kernels comes next.
 */
#ifndef KILN_GRAPH_H
#define KILN_GRAPH_H

#include <stdio.h>
#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_graph kiln_graph_t;

/* The function captured: in[0..n_in) are its arguments; it sets out[0..*n_out) (at most
 * KILN_GRAPH_MAX_OUT) and returns KILN_OK, or an error. */
#define KILN_GRAPH_MAX_OUT 16
typedef kiln_status (*kiln_graph_fn)(void *ctx, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int *n_out);

/* Runs fn once in capture mode with arguments shaped like example[0..n_in). */
kiln_status kiln_graph_capture(kiln_graph_fn fn, void *ctx, kiln_tensor_t *const *example, int n_in,
                               kiln_graph_t **out);
/* Runs the graph on in[0..n_in) (their shapes and dtypes must be those captured);
 * out[0..*n_out) get its results, in the caller's scope. Random ops (dropout, rand) take
 * their counters from the generator at the start of each run and keep them in the
 * graph's nodes: one graph is not run from two threads at once. */
kiln_status kiln_graph_run(kiln_graph_t *g, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int max_out,
                           int *n_out);
/* Dead-code elimination: drops the ops whose results nothing uses (in-place updates
 * always stay). Returns how many were dropped in *removed. */
kiln_status kiln_graph_dce(kiln_graph_t *g, int *removed);
/* Common-subexpression elimination: an op repeated on the same values with the same
 * attributes is computed once (never across an in-place update). */
kiln_status kiln_graph_cse(kiln_graph_t *g, int *removed);
/* Decomposition: each composite op with a decomposition (softmax, log_softmax,
 * layer_norm, rms_norm, AdamW on the cpu; cross_entropy and attention where their
 * backend has no fused kernel of its own) is replaced by the primitive ops it is made
 * of, which the compiler can fuse. Returns how many were replaced in *decomposed.
 * KILN_COMPILE_DECOMPOSE=all makes kiln compile take every decomposition there is
 * (cross_entropy, attention and gelu's tanh form too). */
kiln_status kiln_graph_decompose(kiln_graph_t *g, int *decomposed);
/* Constant folding: each op whose inputs are all constants of the graph (full, arange,
 * and what is computed from them alone) is computed once, now, and its result (if
 * small) kept as a captured tensor; captured tensors themselves are never constants.
 * Returns how many ops were folded in *folded; run kiln_graph_dce after. */
kiln_status kiln_graph_fold(kiln_graph_t *g, int *folded);
/* Saved or recomputed: a pointwise result read in the forward part and again far later
 * (in backward) gets its late reads from a copy computed again just before them, from
 * values alive there anyway, instead of being kept alive in between (less memory, one
 * more fused kernel). Returns how many results were recomputed in *recomputed; run it
 * after kiln_graph_cse, which would merge the copies back. */
kiln_status kiln_graph_recompute(kiln_graph_t *g, int *recomputed);
/* Merging slice scatters: the sum of zero fills that are only written through copies
 * into disjoint slices of one dim (the backward of an input read through several
 * slices) becomes one fill with every copy into it. Returns how many adds were merged
 * away in *merged; run kiln_graph_dce after, which drops them and the spare fills. */
kiln_status kiln_graph_merge_slices(kiln_graph_t *g, int *merged);
/* Coalescing allreduces: a run of consecutive in-graph allreduces (kiln_pg_allreduce
 * while capturing) with one group, reduce op, dtype and device becomes, for each bucket
 * of at most bucket_bytes (a tensor larger than that is a bucket of its own), one
 * allreduce of the tensors flattened into one buffer; later reads of each tensor read its
 * range of the buffer, and a tensor whose memory something else reads later (its base,
 * another view, an argument's or captured tensor's real buffer) is copied back into.
 * Returns how many allreduces were merged away in *merged. */
kiln_status kiln_graph_coalesce_allreduce(kiln_graph_t *g, int64_t bucket_bytes, int *merged);
/* Sinking views: an elementwise op whose inputs are all reshapes of contiguous values of
 * one shape is computed in that shape and its result reshaped (gelu(view(add)) becomes
 * view(gelu(add)), which fuse). Returns how many ops were moved in *sunk; run
 * kiln_graph_dce after, which drops the views nothing reads any more. */
kiln_status kiln_graph_sink_views(kiln_graph_t *g, int *sunk);
/* Hoisting siblings: an elementwise op moves up (at most 32 ops) to just after an
 * earlier elementwise op of its shape that reads one of its inputs, when its inputs
 * exist there and nothing in between writes them, so that the two fuse. Returns how many
 * ops moved in *moved. */
kiln_status kiln_graph_hoist_siblings(kiln_graph_t *g, int *moved);
int kiln_graph_num_ops(const kiln_graph_t *g);
/* True while this thread is capturing a function. */
bool kiln_graph_capturing(void);
/* State that a captured or recorded function makes on its first call and keeps
 * (optimizer moments, caches) must be real tensors, made once, not values of the graph
 * or launches of the replay: kiln_graph_suspend pauses this thread's capture and replay
 * recording and returns a token (NULL if neither was running); ops then run eagerly
 * and unrecorded until kiln_graph_resume(token). */
void *kiln_graph_suspend(void);
void kiln_graph_resume(void *token);
/* One line per op: "%5 = gelu(%4) f32[8,32]  tanh=1", inputs and captured tensors first. */
kiln_status kiln_graph_print(const kiln_graph_t *g, FILE *f);
void kiln_graph_free(kiln_graph_t *g); /* NULL is fine */

/* A function kept as graphs, each with the guards it was captured under: every
 * input's dtype, shape and device (at most KILN_GRAPH_MAX_IN inputs), grad mode, which
 * of the tensors the function read (its parameters) required gradients, and the
 * attributes declared with kiln_compiled_guard. A call that matches a graph's guards
 * runs that graph; otherwise the function is captured
 * again (KILN_LOGS=recompiles says which guard failed, old -> new), up to
 * KILN_RECOMPILE_LIMIT graphs (default 8), after which non-matching calls run eagerly,
 * with one warning. KILN_LOGS=graph prints each captured graph (after its passes),
 * KILN_LOGS=guards its guards; KILN_LOGS=all, every stage. KILN_DEBUG_DIR=DIR writes
 * DIR/<name>-<n>/captured.txt and after_passes.txt for each graph. */
#define KILN_GRAPH_MAX_IN 16
typedef struct kiln_compiled kiln_compiled_t;
kiln_status kiln_compiled_new(kiln_graph_fn fn, void *ctx, const char *name, kiln_compiled_t **out);
/* An input that requires gradients is refused (KILN_ERR_UNSUPPORTED): a graph computes
 * gradients only for the tensors the function reads itself. */
kiln_status kiln_compiled_call(kiln_compiled_t *c, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int max_out,
                               int *n_out);
void kiln_compiled_stats(const kiln_compiled_t *c, uint64_t *calls, uint64_t *hits, uint64_t *recompiles, int *graphs);
/* Guards n bytes (1..64) at ptr, a value the function reads from its ctx and bakes into
 * the graph (a clipping norm, a number of micro-batches, a training flag): each graph
 * keeps the bytes it was captured with, and a call where they differ captures again
 * (KILN_LOGS=recompiles: "attribute NAME changed: old -> new"). At most 8 per function,
 * declared before its first call; ptr must stay valid as long as c. */
kiln_status kiln_compiled_guard(kiln_compiled_t *c, const char *name, const void *ptr, size_t n);
/* How graph number `graph` of c runs: *kernels generated kernels and *ops ops through
 * dispatch (matmul, attention, views, ...); both 0 for an interpreted graph
 * (KILN_COMPILE_DISABLE=codegen). *planned_peak and *eager_peak: bytes of
 * intermediates live at once, as compiled and as eager would hold them. Any out
 * pointer may be NULL. */
kiln_status kiln_compiled_plan(const kiln_compiled_t *c, int graph, int *kernels, int *ops, int64_t *planned_peak,
                               int64_t *eager_peak);
void kiln_compiled_free(kiln_compiled_t *c);

/* Recorded replay: the launch list of one real run, replayed without dispatch.
 *
 *     kiln_replay_t *r;
 *     kiln_replay_record(kiln_gpt_train_step, &step, in, 3, &r, out, 2, &n); // step 1, recorded
 *     for (...) kiln_replay_run(r, next_in, 3, out, 2, &n);                 // steps 2, 3, ...
 *
 * kiln_replay_record runs fn once on in[] for real (its effects happen, its outputs come
 * back) while noting every kernel launched: the backend's own, the compiler's generated
 * ones, the cpu fallback. kiln_replay_run copies new inputs (same dtypes and shapes;
 * another shape is an error that says to record again) into the recorded inputs'
 * buffers and launches the list again on the same buffers: no checks, inference,
 * allocation or autograd. Its outputs are the recorded output tensors, rewritten by
 * every run (clone them to keep one). Host-side decisions the function took are frozen
 * (as in CUDA graphs): it must take the same path every time, e.g. start each step with
 * empty gradients. Everything it touched (parameters, optimizer state) must outlive the
 * replay; random ops (dropout > 0) cannot be recorded. A compiled function's call can
 * be (its generated kernels become launches of the list, and the compiled function must
 * outlive the replay), once it has been compiled for those shapes: a call that would
 * capture and compile inside the recording is an error, as is one whose program
 * overlaps collectives.
 *
 * Where every launch went to one device whose backend has graph capture (OpenCL's
 * cl_khr_command_buffer, CUDA graphs), the list is also captured once as that device's
 * own graph, and each run enqueues that instead of launching op by op; a list the
 * device cannot capture (a launch on the cpu, a copy through the host, a second device)
 * stays a launch list. KILN_OPT_DEVICE_GRAPHS=0 turns the capture off;
 * kiln_replay_native says which one runs, and why. */
typedef struct kiln_replay kiln_replay_t;
kiln_status kiln_replay_record(kiln_graph_fn fn, void *ctx, kiln_tensor_t *const *in, int n_in, kiln_replay_t **r,
                               kiln_tensor_t **out, int max_out, int *n_out);
kiln_status kiln_replay_run(kiln_replay_t *r, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out, int max_out,
                            int *n_out);
int kiln_replay_num_launches(const kiln_replay_t *r);
/* Whether runs enqueue the device's own graph; why gets "opencl:0 command buffer of N
 * launches" or the reason it is a launch list (may be NULL). */
bool kiln_replay_native(const kiln_replay_t *r, char *why, size_t n);
bool kiln_replay_recording(void); /* true while this thread records a replay */
void kiln_replay_free(kiln_replay_t *r); /* NULL is fine */

#ifdef __cplusplus
}
#endif
#endif
