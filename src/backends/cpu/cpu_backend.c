/* The cpu backend: host memory, synchronous "streams", and the kernel table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include "backends/cpu/cpu.h"
#include "backends/cpu/gemm.h"
#include "core/opts.h"

#if defined(KILN_BLAS_BLIS)
void bli_thread_set_num_threads(long n);
char *bli_info_get_version_str(void);
#define BLAS_SET_THREADS(n) bli_thread_set_num_threads(n)
#define BLAS_NAME "BLIS"
#define BLAS_CORE() NULL
#define BLAS_CONFIG() bli_info_get_version_str()
#elif defined(KILN_BLAS_OPENBLAS)
void openblas_set_num_threads(int n);
char *openblas_get_corename(void);
char *openblas_get_config(void);
#define BLAS_SET_THREADS(n) openblas_set_num_threads(n)
#define BLAS_NAME "OpenBLAS"
#define BLAS_CORE() openblas_get_corename()
#define BLAS_CONFIG() openblas_get_config()
#endif

/* What kiln's own GEMM will run bf16 on, from the processor's flags alone: asking Linux
 * for AMX's tile state (which kiln__gemm_kernel_name would) is left to the first bf16
 * product, not done at every start-up. */
static const char *bf16_kernels(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("amx-bf16")) return "AMX where Linux grants it";
    if (__builtin_cpu_supports("avx512bf16"))
        return "AVX512-BF16's vdpbf16ps if it measures at least 1.25x AVX-512 FMAs on bf16 values at the first "
               "bf16 product, else those";
    if (__builtin_cpu_supports("avx512f")) return "AVX-512 on bf16 values";
#endif
    return "f32 kernels on bf16 values";
}

/* What kiln doctor says of the cpu: what kiln's own GEMM runs bf16 on, and with
 * OpenBLAS, which of its kernels it picked for
 * this processor. A processor it does not recognise (a new one, or one a hypervisor
 * shows under an odd family) gets an old generic kernel: on a Sapphire Rapids VM it
 * chose "Prescott" (SSE3), and OPENBLAS_CORETYPE=SkylakeX made a config S step 3.4x
 * faster (docs/perf-log.md); the description says so, and that kiln's own GEMM then
 * takes the f32 matmuls. */
static char description[512] = "host CPU (AVX2/FMA kernels where available, BLAS for GEMM)";

static bool generic_core(const char *core)
{
    static const char *const generic[] = {"Prescott", "Core2", "Katmai", "Coppermine", "Northwood", "Banias", "Atom"};
    bool old = false;
    for (size_t i = 0; core && i < sizeof generic / sizeof generic[0]; i++) old |= !strcasecmp(core, generic[i]);
    return old;
}

static void describe(void)
{
    const char *core = BLAS_CORE();
    bool old = generic_core(core);
    bool own = kiln__opt(KILN__OPT_OWN_GEMM);
    char f32[256];
    if (own)
        snprintf(f32, sizeof f32, "f32 GEMM and attention on kiln's own, %s%s", kiln__gemm_kernel_name(KILN__GEMM_F32),
                 old ? ", as the BLAS runs a generic core here (set OPENBLAS_CORETYPE to the processor's family)" : "");
    else
        snprintf(f32, sizeof f32, "f32 GEMM by %s%s%s%s%s", BLAS_NAME, core ? ", its " : "", core ? core : "",
                 core ? " kernels" : "", old ? ": a generic core for this processor, set OPENBLAS_CORETYPE to its family" : "");
    snprintf(description, sizeof description, "host CPU (AVX2/FMA kernels where available; %s; bf16%s on kiln's own, %s)",
             f32, own ? "" : " GEMM and attention", bf16_kernels());
}

/* KILN_OPT_OWN_GEMM left unset: kiln's own f32 GEMM where the BLAS runs a generic core
 * and kiln's has vector kernels for this processor. Measured on a Sapphire Rapids VM
 * where OpenBLAS runs its Prescott kernels: a config S step 763-1012 ms on them, 233-272
 * ms on kiln's GEMM, 213-219 ms on OpenBLAS's SkylakeX kernels (docs/perf-log.md). */
static bool own_gemm_auto(void)
{
    return generic_core(BLAS_CORE()) && strcmp(kiln__gemm_kernel_name(KILN__GEMM_F32), "c") != 0;
}

void kiln_blas_info_get(kiln_blas_info *out)
{
    const char *core = BLAS_CORE(), *config = BLAS_CONFIG();
    *out = (kiln_blas_info){BLAS_NAME, config ? config : "", core ? core : "", generic_core(core)};
}

void kiln_cpu_info_get(kiln_cpu_info *out)
{
    *out = (kiln_cpu_info){.clone = "default", .gemm_f32 = kiln__gemm_kernel_name(KILN__GEMM_F32),
                           .gemm_bf16 = bf16_kernels()};
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    out->avx2 = __builtin_cpu_supports("avx2");
    out->fma = __builtin_cpu_supports("fma");
    out->f16c = __builtin_cpu_supports("f16c");
    out->avx512f = __builtin_cpu_supports("avx512f");
    out->avx512bw = __builtin_cpu_supports("avx512bw");
    out->avx512vl = __builtin_cpu_supports("avx512vl");
    out->avx512bf16 = __builtin_cpu_supports("avx512bf16");
    out->amx_bf16 = __builtin_cpu_supports("amx-bf16");
#if !defined(__SANITIZE_ADDRESS__) && !defined(KILN_NO_CLONES) /* KILN_SIMD's clones (cpu.h) */
    out->clone = __builtin_cpu_supports("x86-64-v4") ? "x86-64-v4" : __builtin_cpu_supports("x86-64-v3") ? "x86-64-v3"
                                                                                                       : "default";
#endif
#endif
}

static const kiln__kernel_fn cpu_kernels[KILN_OP_COUNT] = {
#define KILN_OP(ID, name, kind, nin, nout, nvis, writes, grad, save, amp) [KILN_OP_##ID] = kiln__cpu_##name,
#include "core/ops.def"
#undef KILN_OP
};

static kiln_status cpu_device_info(kiln__backend *be, kiln__device_info *out)
{
    long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    out->name = "cpu";
    out->description = description;
    out->total_memory = pages > 0 && psize > 0 ? (size_t)pages * (size_t)psize : 0;
    out->compute_units = kiln__pool_size();
    return KILN_OK;
}

/* 64-byte alignment: one cache line, and what AVX-512 loads would want. */
static void *cpu_alloc(kiln__backend *be, size_t n)
{
    void *p = NULL;
    return posix_memalign(&p, 64, n ? n : 64) == 0 ? p : NULL;
}

static void cpu_free(kiln__backend *be, void *p, size_t n) { free(p); }

static kiln_status cpu_copy_bytes(kiln__backend *be, void *dst, const void *src, size_t n)
{
    memmove(dst, src, n);
    return KILN_OK;
}

static kiln_status cpu_memset(kiln__backend *be, void *dst, int byte, size_t n)
{
    memset(dst, byte, n);
    return KILN_OK;
}

/* Work on the cpu is synchronous, so the event entries are left NULL: the core's
 * default (an event is a synchronize, here nothing) is what it needs. */
static kiln_status cpu_synchronize(kiln__backend *be) { return KILN_OK; }

static kiln__backend cpu_backend = {
    .abi_version = KILN_BACKEND_ABI_VERSION,
    .name = "cpu",
    .device_info = cpu_device_info,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_h2d = cpu_copy_bytes,
    .copy_d2h = cpu_copy_bytes,
    .copy_d2d = cpu_copy_bytes,
    .memset = cpu_memset,
    .synchronize = cpu_synchronize,
    .kernels = cpu_kernels,
    /* The optional entries, which the cpu does not offer yet, are NULL. */
};

/* The cpu is made at start-up, first, so that it is device 0. */
static int make_cpu(int nthreads)
{
    BLAS_SET_THREADS(kiln__opt(KILN__OPT_POOL_GEMM) ? 1 : nthreads);
    describe();
    return kiln__backend_register(&cpu_backend) == KILN_OK;
}

KILN__REGISTER(register_cpu)
{
    kiln__opt_auto(KILN__OPT_OWN_GEMM, own_gemm_auto);
    kiln__backend_provider_register("cpu", make_cpu, true);
}

/* View ops alias their input's storage and the core never launches a kernel for them;
 * the table still has a slot per op so that a missing kernel elsewhere fails to link. */
#define VIEW_OP(name) \
    kiln_status kiln__cpu_##name(KILN__KERNEL_ARGS) \
    { return kiln__err(KILN_ERR_INTERNAL, #name " is a view and has no kernel"); }
VIEW_OP(view)
VIEW_OP(permute)
VIEW_OP(slice)
VIEW_OP(expand)
