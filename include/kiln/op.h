/* kiln/op.h — custom ops: an op defined at run time, by a program or by an extension
 * module (kiln/ext.h), that becomes a row of the op table like the built-in ones. Once
 * defined it runs eagerly on every device it has a kernel for (and on the others
 * through the cpu, with copies), is recorded by autograd, captured into graphs,
 * compiled (fused where it gave an expression, else its own step between the generated
 * kernels), replayed, and listed by `kiln doctor --ops`.
 *
 * A worked example: y = x * scale, with a cpu kernel and its backward.
 *
 *     static kiln_status shape(const kiln_op_args *a, kiln_op_meta *out)
 *     {
 *         out[0].dtype = kiln_tensor_dtype(a->in[0]);           // y is shaped like x
 *         out[0].ndim = kiln_tensor_ndim(a->in[0]);
 *         memcpy(out[0].shape, kiln_tensor_shape(a->in[0]), sizeof(int64_t) * out[0].ndim);
 *         return kiln_tensor_dtype(a->in[0]) == KILN_DTYPE_F32
 *                    ? KILN_OK : kiln_error(KILN_ERR_DTYPE, "scale_by: x must be f32");
 *     }
 *     static kiln_status cpu(const kiln_op_args *a)
 *     {
 *         const float *x = kiln_op_data(a->in[0]);
 *         float *y = kiln_op_data(a->out[0]);
 *         for (int64_t i = 0; i < kiln_tensor_numel(a->in[0]); i++) y[i] = x[i] * a->attr[0].f;
 *         return KILN_OK;
 *     }
 *     static kiln_status backward(const kiln_op_args *a, kiln_tensor_t *const *gy, kiln_tensor_t **gx)
 *     {
 *         gx[0] = kiln_mul_scalar(gy[0], a->attr[0].f);          // with kiln ops
 *         return gx[0] ? KILN_OK : kiln_last_status();
 *     }
 *     static const kiln_op_kernel kernels[] = {{.device = "cpu", .fn = cpu}};
 *     int id;
 *     kiln_op_define(&(kiln_op_decl){.name = "scale_by", .n_in = 1, .n_out = 1, .attrs = "scale:f64",
 *                                    .shape = shape, .kernels = kernels, .n_kernels = 1,
 *                                    .backward = backward}, &id);
 *     kiln_tensor_t *y = kiln_op_call(id, &x, 1, &(kiln_op_value){.f = 2.0}, 1);
 *
 * Kernels. A kernel is given contiguous inputs and contiguous, uninitialised outputs on
 * one device. Either a C function (fn), which reads and writes the tensors' memory
 * through kiln_op_data: on the cpu host memory, on CUDA device memory (a function that
 * launches its own CUDA kernels, built from a .cu source); or source in the device's
 * kernel language (source and entry; OpenCL C on opencl devices), which the backend
 * builds once per device and launches over one work-item per element (KILN_OP_GRID_ELEMENTS)
 * or per row (KILN_OP_GRID_ROWS) of output 0, with these arguments in order: each
 * input, then each output, as a (__global T *buffer, ulong byte_offset) pair; then
 * long n (the work-items), long cols (output 0's last dim); then each attribute, an
 * f64 one as float and an i64 one as long. A cpu kernel is required: it is the
 * reference every device falls back to.
 *
 * Attributes are declared as text, "name:type" separated by commas, each type f64 or
 * i64 (at most 8): "eps:f64,groups:i64". A call passes their values in that order.
 *
 * Outputs: n_out of them (at most 4), of which the first n_visible are returned to
 * callers and the rest kept for the backward (statistics: an RMS norm's 1/rms). The
 * backward is given every input and output of the call (a->in, a->out) and the
 * gradients of the outputs (gout[j], NULL where an output got none), and sets gin[i]
 * for each input it can, with kiln ops (so a backward of it can be taken again).
 *
 * expr (optional, for a pointwise op: one output, shaped as its inputs broadcast
 * together): the op as one C expression of x0, x1, ... (its inputs, as float) and a0,
 * a1, ... (its attributes), numbers, INFINITY, C's operators and kiln's kmath functions
 * (km_exp, km_tanh, km_max, ...), nothing else: the compiler puts it inside the kernels
 * it generates, fused with its neighbours, on every device (C and OpenCL C), for an op
 * of at most 3 inputs (one of more runs as its own step). decompose (optional): the op
 * written with kiln ops, which the compiler may use instead.
 *
 * An op is a pure function of its inputs and attributes: the compiler may merge two
 * calls with the same inputs and attributes, fold a call on constants, and compute a
 * call again in the backward instead of keeping its result. An op that draws random
 * numbers takes its seed as an attribute or an input.
 *
 * Names are unique: a name that a built-in or an earlier custom op has is refused,
 * naming it. A bad declaration (a count out of range, a malformed attribute list, no
 * cpu kernel) is KILN_ERR_ARG naming the op and the field; nothing is defined then.
 * Ops are defined for the life of the process (at most 256). */
#ifndef KILN_OP_H
#define KILN_OP_H

#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One attribute's value: f for an f64 attribute, i for an i64 one. */
typedef union {
    double f;
    int64_t i;
} kiln_op_value;

/* What a custom op's functions are given. */
typedef struct {
    int op; /* the op's id */
    kiln_tensor_t *const *in;
    int n_in;
    kiln_tensor_t *const *out; /* kernel: the outputs to fill; backward: the call's outputs; shape: NULL */
    int n_out;
    const kiln_op_value *attr; /* in the declared order */
    int n_attr;
    void *user; /* the declaration's user pointer */
} kiln_op_args;

/* An output's dtype and shape, filled by a shape function. */
typedef struct {
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
} kiln_op_meta;

/* Fills out[0..n_out); an error (kiln_error) refuses the call, its message kept. */
typedef kiln_status (*kiln_op_shape_fn)(const kiln_op_args *a, kiln_op_meta *out);
typedef kiln_status (*kiln_op_kernel_fn)(const kiln_op_args *a);
typedef kiln_status (*kiln_op_backward_fn)(const kiln_op_args *a, kiln_tensor_t *const *gout, kiln_tensor_t **gin);
/* The op written with kiln ops: sets out[0..n_out). */
typedef kiln_status (*kiln_op_decompose_fn)(const kiln_op_args *a, kiln_tensor_t **out);

typedef enum { KILN_OP_GRID_ELEMENTS, KILN_OP_GRID_ROWS } kiln_op_grid;

typedef struct {
    const char *device;    /* "cpu", "opencl", "cuda": every device of that backend */
    kiln_op_kernel_fn fn;  /* a C function, or: */
    const char *source;    /* source in the device's kernel language, */
    const char *entry;     /* the kernel's name in it, */
    kiln_op_grid grid;     /* and its work-items */
} kiln_op_kernel;

#define KILN_OP_MAX_IN 12
typedef struct {
    const char *name;
    int n_in;            /* 1 .. KILN_OP_MAX_IN */
    int n_out;           /* 1 .. 4 */
    int n_visible;       /* 1 .. n_out; 0: n_out */
    const char *attrs;   /* "name:f64,name:i64"; NULL or "": none */
    kiln_op_shape_fn shape; /* NULL only with expr: the inputs broadcast, f32 */
    const kiln_op_kernel *kernels;
    int n_kernels;
    kiln_op_backward_fn backward;   /* NULL: not differentiable */
    kiln_op_decompose_fn decompose; /* NULL: none */
    const char *expr;               /* NULL: not pointwise */
    void *user;
} kiln_op_decl;

/* Defines the op (the declaration's strings and kernels are copied); its id in *id. */
kiln_status kiln_op_define(const kiln_op_decl *d, int *id);
/* The id of the op of that name, built-in or custom; -1 when there is none. */
int kiln_op_find(const char *name);
/* Calls op id: its visible outputs in out[0..n_visible) (new references, registered
 * with the open scope as every op's are). */
kiln_status kiln_op_run(int id, kiln_tensor_t *const *in, int n_in, const kiln_op_value *attr, int n_attr,
                        kiln_tensor_t **out);
/* kiln_op_run's first output, NULL on error (the op's other outputs dropped). */
kiln_tensor_t *kiln_op_call(int id, kiln_tensor_t *const *in, int n_in, const kiln_op_value *attr, int n_attr);
/* The memory of a kernel's tensor: its first element, on its device. */
void *kiln_op_data(const kiln_tensor_t *t);
/* The queue a kernel on t's device enqueues its work on, so that it runs in order with
 * kiln's: a cudaStream_t on CUDA, a cl_command_queue on OpenCL; NULL on the cpu. */
void *kiln_op_stream(const kiln_tensor_t *t);

#ifdef __cplusplus
}
#endif
#endif
