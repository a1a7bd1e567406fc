/* The op table's schema columns: what dispatch needs to know of every op to check, infer
 * and run a call (src/core/ops.def is the list; src/core/op_table.c renders it). The
 * columns that belong to rooms above (backward formulas, decompositions, code
 * generation) are rendered from the same list by those rooms (src/ops/registry.c), so
 * that every fact about an op is written once, in ops.def or beside its name there. */
#ifndef KILN_CORE_OP_TABLE_H
#define KILN_CORE_OP_TABLE_H

#include "core/attrs.h"
#include "core/tensor_impl.h"
#include "kiln/ops.h" /* kiln_amp_policy */

#define KILN__SI(i) (1u << (i))
#define KILN__SO(j) (1u << (8 + (j)))
#define KILN__MAX_OUT 4

/* For the rows of include/kiln/pointwise.def: what an op saves for its backward formula
 * (grad column OP and X: x; Y: y; NONE: nothing), and KILN__PW_IF_OP(grad, text), the text
 * only for a row with its own backward op. */
#define KILN__PW_SAVE_OP KILN__SI(0)
#define KILN__PW_SAVE_X KILN__SI(0)
#define KILN__PW_SAVE_Y KILN__SO(0)
#define KILN__PW_SAVE_NONE 0
#define KILN__PW_IF_OP(grad, ...) KILN__PW_IF_OP_##grad(__VA_ARGS__)
#define KILN__PW_IF_OP_OP(...) __VA_ARGS__
#define KILN__PW_IF_OP_X(...)
#define KILN__PW_IF_OP_Y(...)
#define KILN__PW_IF_OP_NONE(...)

typedef enum {
#define KILN_OP(ID, name, kind, nin, nout, nvis, writes, grad, save, amp) KILN_OP_##ID,
#include "core/ops.def"
#undef KILN_OP
    KILN_OP_COUNT
} kiln__op_id;

/* Fills out[0..n_out) with the output shapes and dtypes, or returns an error that names
 * the op, the shapes and dtypes. View ops also fill stride and offset (relative to
 * input 0's storage). */
typedef kiln_status (*kiln__infer_fn)(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                      kiln__meta *out);

/* An op's kind (ops.def's kind column): what the passes and the compiler ask of it. */
typedef enum {
    KILN__KIND_POINTWISE,
    KILN__KIND_REDUCTION,
    KILN__KIND_VIEW,
    KILN__KIND_SOURCE,
    KILN__KIND_INDEXING,
    KILN__KIND_CONTRACTION,
    KILN__KIND_COMPOSITE,
    KILN__KIND_INPLACE,
    KILN__KIND_COLLECTIVE,
} kiln__op_kind;

typedef struct {
    const char *name;
    kiln__op_kind kind;
    int n_in, n_out, n_visible;
    unsigned writes; /* the inputs it updates in place, a bit each */
    unsigned save;   /* what backward keeps: KILN__SI(i) input i, KILN__SO(j) output j */
    bool has_grad;   /* has a backward formula (src/ops/backward.c) */
    bool is_view;
    bool is_inplace;
    kiln_amp_policy amp; /* its type under autocast (kiln/ops.h; src/ops/autocast.c) */
    kiln__infer_fn infer;
} kiln__op_def;

/* Ops defined at run time (kiln/op.h; src/ops/custom.c) take the ids from KILN_OP_COUNT
 * up, their rows written once when they are defined and never changed after. */
#define KILN__CUSTOM_MAX 256
#define KILN__OP_MAX (KILN_OP_COUNT + KILN__CUSTOM_MAX)
extern kiln__op_def kiln__ops[KILN__OP_MAX];
/* The ops there are: the built-in ones and those defined so far. */
int kiln__op_total(void);
static inline bool kiln__op_is_custom(int op) { return op >= KILN_OP_COUNT; }
/* The id of the op named name, built-in or defined so far; -1 when there is none. */
int kiln__op_by_name(const char *name);
/* Adds row as a new op, its name not taken by any other: its id in *id. kernel runs it
 * on the backends named in devices[0..n_devices) (a backend's name up to its ':': every
 * opencl device for "opencl"). Serialized; an op's row is complete before its id is
 * handed out. */
kiln_status kiln__op_add(const kiln__op_def *row, kiln__kernel_fn kernel, const char *const *devices, int n_devices,
                         int *id);
/* The kernel op has on be: the backend's own (a built-in op), the one given at
 * kiln__op_add for a custom op that names be, or NULL. */
kiln__kernel_fn kiln__be_kernel(const kiln__backend *be, int op);

/* The math of a pointwise op defined by it (include/kiln/pointwise.def): name is the
 * kmath.h function family (km_<name>, km_<name>d and their _dx derivatives), NULL for
 * every other op; dx marks the backward op (g * dy/dx); fast is the row's fast column. */
typedef enum { KILN__PW_EXACT, KILN__PW_SWITCH, KILN__PW_GEN } kiln__pw_fast;
typedef struct {
    const char *name;
    bool dx;
    kiln__pw_fast fast;
} kiln__op_math_t;
extern const kiln__op_math_t kiln__op_math[KILN__OP_MAX]; /* custom ops: none */

/* The inputs an op writes, as a bit mask (ops.def's writes column). */
static inline unsigned kiln__written_inputs(kiln__op_id op) { return kiln__ops[op].writes; }

#define KILN_OP(ID, name, kind, nin, nout, nvis, writes, grad, save, amp)                                        \
    kiln_status kiln__infer_##name(kiln_tensor_t *const *in, int n_in, const kiln__attrs *a, \
                                   kiln__meta *out);
#include "core/ops.def"
#undef KILN_OP

/* Runs op on its inputs' backend: checks, infers, lets this thread's interceptors watch
 * or take the call, runs it through the first kernel provider that has it
 * (src/core/intercept.h). out[] receives n_out new references (the caller keeps or
 * frees them). */
kiln_status kiln__dispatch(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                           kiln_tensor_t **out);
/* Dispatch returning the first output registered with the scope (NULL on error);
 * hidden outputs are dropped. */
kiln_tensor_t *kiln__call(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a);
/* Dispatch for work a kernel does on its own behalf (a strided source made dense before
 * a copy): no interceptor sees it, so autograd does not record it and a replay does not
 * note it; the kernel's own launch stands for it. */
kiln_status kiln__dispatch_quiet(kiln__op_id op, kiln_tensor_t *const *in, int n_in, const kiln__attrs *a,
                                 kiln_tensor_t **out);
/* t itself when contiguous, else a contiguous copy on its device made so; a new
 * reference (NULL on error). */
kiln_tensor_t *kiln__dense(kiln_tensor_t *t);

/* Shape helpers shared by inference and the rooms above. kiln__shape_text: t's dtype and
 * shape as text for an error message, in one of eight buffers of this thread used in turn
 * (so that a message can name several tensors). */
const char *kiln__shape_text(const kiln_tensor_t *t);
kiln_status kiln__broadcast_shapes(const char *op, int n, kiln_tensor_t *const *ts, kiln__meta *out);
int kiln__norm_dim(int dim, int ndim);
kiln_dtype kiln__promote(kiln_dtype a, kiln_dtype b);

#endif
