/* The compiler's private structures: the loop IR of a kernel and the compiled program
 * (a list of steps, each an op run through dispatch or a generated kernel).
 *
 * Loop IR. A kernel runs over an index space `dom` of ndim dims: the outer dims are
 * the rows (split over the thread pool), the last is the inner loop. Its expressions
 * are loads (a buffer through element strides over the domain; stride 0 broadcasts),
 * constants, indices (arange), pointwise ops, and accumulators: an accumulator reduces
 * one expression over the inner dim, and reading it is an expression that depends only
 * on the row. Expressions come in a valid evaluation order (operands first). A store
 * writes an expression into an output buffer through strides. A row kernel evaluates
 * its accumulators in phases (an accumulator whose expression reads another one comes
 * a phase later), each phase one pass over the inner dim, then the stores. */
#ifndef KILN_COMPILE_IMPL_H
#define KILN_COMPILE_IMPL_H
#include "core/opts.h"

#include "graph/graph_impl.h"

typedef enum { E_LOAD, E_CONST, E_INDEX, E_OP, E_ACC } kc_ekind;

typedef struct {
    kc_ekind kind;
    kiln__op_id op;      /* E_OP */
    kiln__attrs attrs;   /* E_OP: the op's; E_CONST: f[0] the value; E_INDEX: f[0] start, f[1] step */
    int arg[3], n_arg;   /* E_OP operands (expression numbers) */
    int buf;             /* E_LOAD: buffer slot; E_ACC: accumulator number */
    int64_t st[KILN_MAX_DIMS]; /* E_LOAD, E_INDEX: element strides over the domain */
    kiln_dtype dt;
    bool row;  /* the same for every inner index */
    int phase; /* the first phase whose pass can evaluate it */
} kc_expr;

typedef struct {
    kiln__op_id op; /* KILN_OP_SUM or KILN_OP_MAX */
    int expr, phase;
} kc_acc;

typedef struct {
    int expr, buf;
    int64_t st[KILN_MAX_DIMS];
} kc_store;

typedef struct {
    int value;    /* the graph value it holds */
    bool output;  /* written by the kernel */
    bool inplace; /* output: an existing tensor (a copy_'s destination), loaded and stored
                   * through this one pointer, each element read only where it is written */
    int reuse;    /* output: an input value read for the last time here, each element only
                   * where this output's is written, whose buffer it takes at launch when no
                   * one else holds that buffer (kc_options.reuse); 0 for none */
    kiln_dtype dt;
    int64_t st[KILN_MAX_DIMS]; /* inputs: the strides the loads assume (checked at launch) */
} kc_buf;

typedef struct {
    char name[80];      /* C function name: k<n>_<ops> */
    char ops[400];      /* the ops it fused, in order */
    int n_ops;
    int ndim;
    int64_t dom[KILN_MAX_DIMS];
    kc_expr *e;
    int n_e;
    size_t cap_e;
    kc_acc *acc;
    int n_acc;
    size_t cap_acc;
    kc_store *st;
    int n_st;
    size_t cap_st;
    kc_buf *buf;
    int n_buf;
    size_t cap_buf;
    int64_t chunks; /* inner-dim pieces per row (pointwise kernels over long rows) */
    int64_t tasks, grain;
    int64_t *sz; /* the sizes its code reads, by slot (below) */
    int n_sz;
#define KC_SZ_BYTES(k) (sizeof(int64_t) * (size_t)((k)->n_sz > 0 ? (k)->n_sz : 1)) /* its device copy's size */
    void (*fn)(char *const *b, const int64_t *sz, int64_t t0, int64_t t1); /* once loaded */
} kc_kernel;

/* Sizes are symbolic in the generated C: a kernel reads its domain, its task split and
 * its accesses' strides from its sz[] argument, bound at launch from the program's
 * shapes, so that graphs differing only in sizes have the same source, one cache entry
 * and one shared object. What stays in the text: the structure, constants, and inner-dim
 * strides of 0 and 1 (they decide how the inner loop vectorizes). With
 * KILN_COMPILE_DISABLE=symbolic (and in the CUDA dialect) sizes are literals; OpenCL
 * kernels read their slots from a device copy of sz[] (kiln__program.dsz).
 * Slots: the inner size, pieces per row, elements per piece, the outer dims, then each
 * load or index expression's strides and each store's, ndim apiece. */
enum { KC_SZ_INNER, KC_SZ_CHUNKS, KC_SZ_PER, KC_SZ_DOM };
static inline int kc_sz_load(const kc_kernel *k, int e, int d) { return KC_SZ_DOM + KILN_MAX_DIMS + e * k->ndim + d; }
static inline int kc_sz_store(const kc_kernel *k, int s, int d) { return kc_sz_load(k, k->n_e, 0) + s * k->ndim + d; }

enum { STEP_OP, STEP_KERNEL };
typedef struct {
    int kind, index; /* graph node, or kernel */
    int until; /* an overlapped collective (src/compile/overlap.c): started here, finished
                * before step `until` (n_steps: at the end); 0 for every other step */
    int epi;   /* a matmul whose result the next step's kernel reads row by row
                * (src/compile/epilogue.c): that kernel's buffer slot of the result, plus 1;
                * 0 for every other step */
} kc_step;

/* What each pass may do: the stage switches of core/opts.h (KILN_OPT_COMPILE_<STAGE>=0,
 * or KILN_COMPILE_DISABLE naming them) turn them off one at a time, to find the one that
 * breaks a result. */
typedef struct {
    bool decompose, fold, cse, dce, fusion, codegen, recompute, symbolic, slices, coalesce, views, hoist, overlap;
    bool reuse; /* an elementwise kernel's output takes the buffer of an input it reads last */
    bool epilogue; /* a kernel reading a cpu bf16 matmul's result runs inside its GEMM (epilogue.c) */
    bool decompose_all; /* KILN_COMPILE_DECOMPOSE=all: every decomposition there is */
    int max_fuse;       /* ops per kernel */
    int64_t bucket_bytes; /* per coalesced allreduce (KILN_COMPILE_BUCKET_MB, default 4) */
    kiln__backend *target; /* whose kernels are generated: its can_fuse hook is asked */
} kc_options;

struct kiln__program {
    kiln_graph_t *g; /* borrowed */
    kc_kernel *k;
    int n_k;
    kc_step *steps;
    int n_steps;
    int *last; /* per value: the last step that reads it (n_steps: kept to the end) */
    void *so;  /* the loaded shared object */
    kiln__backend *be; /* where its kernels run: the cpu (fn, over the thread pool), or a
                        * device with a kernel language (kern[i], through be->launch) */
    void **kern;
    void **dsz;    /* OpenCL with symbolic sizes: each kernel's sz[] copied to the device (be->alloc) */
    bool symbolic; /* the C reads sizes from sz[] (kc_options.symbolic) */
    int64_t planned_peak, eager_peak; /* bytes of intermediates, from the liveness */
    int n_overlapped;                 /* collectives marked to overlap, and moved up */
    int n_hoisted;
    int n_epilogues; /* matmul steps whose next kernel runs inside their GEMM */
    /* KILN_LOGS=profile: seconds spent in each step over the runs after the first, and
     * the runs so far; printed when the program is freed (kiln__program_profile_print). */
    double *prof, prof_wait; /* prof_wait: finishing overlapped collectives */
    int64_t prof_runs;
};
typedef struct kiln__program kiln__program;

void kiln__compile_options(kc_options *o);
/* Runs the passes on g and compiles it; *out stays NULL when codegen is switched off
 * (the graph is then interpreted). dir: KILN_DEBUG_DIR's folder for this graph, or NULL. */
kiln_status kiln__compile_graph(kiln_graph_t *g, const char *dir, const char *name, int index, kiln__program **out);
/* Moves each cpu bf16 matmul whose result a later kernel reads row by row down to just
 * before that kernel, across the kernels and views between them, and marks it (kc_step.epi), so
 * that the program can hand the kernel to the GEMM as its epilogue (epilogue.c). Before
 * the liveness, which it changes. */
void kiln__program_epilogues(kiln__program *p);
/* The step's matmul, with its epilogue kernel (the next step) offered to the GEMM; the
 * kernel runs after the matmul when the GEMM did not take it. */
kiln_status kiln__program_run_epilogue(kiln__program *p, int t, kiln__graph_frame *f);
/* Kernel k's buffers: the inputs from rt, the outputs allocated (or an input's buffer
 * reused); the slot of value `pending`, not made yet, is left NULL (program.c). */
kiln_status kiln__program_bind(kiln__program *p, const kc_kernel *k, kiln_tensor_t **rt, char **b, int pending);
kiln_status kiln__program_launch(const kiln__program *p, const kc_kernel *k, char *const *b);
/* A launch as a replay being recorded keeps it (program.c). */
void kiln__program_note_launch(const kiln__program *p, const kc_kernel *k, char *const *b);
/* The element strides of value v as the graph left it: views keep the strides their
 * inference gave, arguments those they were captured with, everything else is
 * contiguous (src/compile/fuse.c). */
void kiln__compile_value_strides(const kiln_graph_t *g, int v, int64_t *st);
/* Groups the graph's ops into kernels and steps (src/compile/fuse.c). */
kiln_status kiln__program_build(kiln_graph_t *g, const kc_options *o, kiln__program **out);
/* Generates C for every kernel into *src (malloc'd; src/compile/codegen_c.c). */
kiln_status kiln__codegen_c(const kiln__program *p, char **src);
/* The same kernels in OpenCL C, one __kernel per kernel (same file). */
kiln_status kiln__codegen_opencl(const kiln__program *p, char **src);
/* ... and in CUDA C for NVRTC, one extern "C" __global__ function per kernel. */
kiln_status kiln__codegen_cuda(const kiln__program *p, char **src);
/* The generator for a device's kernel language (OpenCL C, CUDA C), or NULL. */
typedef kiln_status (*kiln__codegen_fn)(const kiln__program *p, char **src);
kiln__codegen_fn kiln__codegen_for(const kiln__backend *be);
/* Moves each allreduce step (and the views and cat that gather its input) up to just
 * after what it depends on, and marks it to run overlapped with the steps after it
 * (kc_step.until); *moved: how many moved (src/compile/overlap.c). */
kiln_status kiln__program_overlap(kiln__program *p, int *moved);
/* Compiles src into a cached shared object and resolves each kernel (src/compile/jit.c). */
kiln_status kiln__jit_load(kiln__program *p, const char *src, const char *debug_dir);
/* C source compiled (or found in the kernel cache, by its hash with the compiler, flags,
 * kiln's version and the processor) and loaded: its dlopen handle in *lib, kept for the
 * process. The rooms above (flex attention) build their own kernels through it. */
kiln_status kiln__jit_open(const char *src, const char *debug_dir, void **lib);
/* What every generated C file starts with: the includes and kmath.h's helpers. */
const char *kiln__codegen_prelude_c(void);
const char *kiln__codegen_prelude_cl(void);   /* the same for OpenCL C */
const char *kiln__codegen_prelude_cuda(void); /* and for CUDA C (NVRTC) */
/* Compiles each kernel of src (in p->be's language) into p->kern with
 * p->be->compile_kernel; on failure none is kept. */
kiln_status kiln__device_load(kiln__program *p, const char *src, const char *debug_dir);
/* Launches kernel k of p on p->be over its buffers b[] (one work-item per task). */
kiln_status kiln__device_launch(const kiln__program *p, const kc_kernel *k, char *const *b);
kiln_status kiln__program_run(kiln__program *p, kiln_tensor_t *const *in, int n_in, kiln_tensor_t **out,
                              int max_out, int *n_out);
void kiln__program_free(kiln__program *p);
void kiln__program_print(const kiln__program *p, FILE *f);
/* The KILN_LOGS=profile table: the steps taking most time per run, and the totals of
 * generated kernels and of each op run through dispatch. */
void kiln__program_profile_print(const kiln__program *p, FILE *f);
/* DIR/file opened for writing (KILN_DEBUG_DIR output); NULL when dir is NULL or empty,
 * or after a warning. */
FILE *kiln__debug_open(const char *dir, const char *file);
/* Into DIR/file, whichever are given: text, graph g, and program p's steps and the loop
 * IR of its kernels. */
void kiln__debug_dump(const char *dir, const char *file, const char *text, const kiln_graph_t *g,
                      const kiln__program *p);

#endif
