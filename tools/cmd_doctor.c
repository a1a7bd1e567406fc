/* kiln doctor: every layer kiln stands on, its version, and whether it fits the others.
 *
 * The plain form is a list of rows, each OK, WARN or FAIL, with one line saying how to
 * fix a WARN or FAIL; --json gives the same rows to scripts; the exit status is 1 when
 * a row fails. What may be wrong is one table of rules (compat_rules below, as a
 * platform vendor's compatibility matrix is): each row names the rules it applied, and
 * a rule's verdict where it does not hold is data, not code. docs/doctor.md describes
 * every row and rule. --ops and --env are the op coverage and environment listings. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <ifaddrs.h>
#include <jansson.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "core/cache.h" /* kiln__make_dirs, the kernel cache's own mkdir -p */
#include "cli.h"
#include "kiln/dist.h"
#include "kiln/ext.h"
#include "kiln/serve.h"

typedef enum { V_OK, V_WARN, V_FAIL } verdict;
static const char *const verdict_names[] = {"OK", "WARN", "FAIL"};

/* ---- the rules ---- */

/* One rule: what it requires, the verdict where that does not hold, the fix, and where
 * the fact comes from. need is the least version, for the rules that compare one. */
typedef struct {
    const char *id, *requires;
    verdict broken;
    int need[3];
    const char *fix, *source;
} compat_rule;

static const compat_rule compat_rules[] = {
    {"cuda-driver", "an NVIDIA driver (libcuda.so.1) is installed", V_WARN, {0}, "none on a machine without an NVIDIA "
     "GPU; else install the driver (cuda devices are unavailable without it)", "the cuda backend opens libcuda.so.1 first"},
    {"cuda-driver-major", "the driver's CUDA major >= the runtime's (CUDA 11+ minor-version compatibility)", V_FAIL,
     {0}, "install a driver of the runtime's major: >= 450.80.02 for CUDA 11.x, >= 525.60.13 for 12.x, >= 580 for 13.x",
     "NVIDIA, CUDA Compatibility, 'Minor Version Compatibility' (docs.nvidia.com/deploy/cuda-compatibility)"},
    {"cuda-driver-ptx", "the driver's CUDA version >= NVRTC's", V_FAIL, {0}, "upgrade the driver, or use the toolkit "
     "(NVRTC) of the driver's CUDA version: the driver cannot load PTX newer than itself",
     "NVIDIA, CUDA Compatibility: minor-version compatibility does not cover PTX from a newer toolkit; kiln's kernels "
     "are NVRTC's PTX loaded with cuModuleLoadData (src/backends/cuda)"},
    {"nccl-major", "NCCL's major is 2", V_WARN, {2}, "install NCCL 2 (libnccl.so.2); collectives on cuda tensors need it",
     "src/dist/nccl.c opens libnccl.so.2 and calls NCCL 2's API"},
    {"openblas-version", "OpenBLAS >= 0.3.7", V_WARN, {0, 3, 7}, "install OpenBLAS 0.3.7 or later (apt-get install "
     "libopenblas0-pthread)", "OpenBLAS changelog: 0.3.4 serialised concurrent level-3 calls and 0.3.7 added "
     "USE_LOCKING for callers on several threads, which kiln's POOL_GEMM is"},
    {"openblas-core", "OpenBLAS recognised the processor (its kernels are not an old generic core)", V_WARN, {0},
     "set OPENBLAS_CORETYPE to the processor's family", "docs/perf-log.md: OpenBLAS chose Prescott on a Sapphire Rapids "
     "VM; OPENBLAS_CORETYPE=SkylakeX made a config S step 1.22x faster"},
    {"mpi-library", "kiln was built with MPI", V_WARN, {0}, "apt-get install libopenmpi-dev openmpi-bin, then rebuild "
     "kiln (without MPI it runs as one process)", "CMakeLists.txt: find_package(MPI)"},
    {"mpi-launcher", "an MPI launcher (mpirun or mpiexec) is on PATH", V_WARN, {0}, "install the launcher of kiln's MPI "
     "(apt-get install openmpi-bin)", "docs/dist.md: kiln train runs under mpirun"},
    {"mpi-family", "the launcher's MPI family (Open MPI or MPICH) is the library's", V_FAIL, {0}, "put the launcher of "
     "kiln's MPI first on PATH", "MPI fixes no ABI across implementations: Open MPI's and MPICH's launchers speak "
     "different process-management protocols, so ranks started by the other family come up as singletons"},
    {"opencl-icd", "an OpenCL ICD is installed", V_WARN, {0}, "apt-get install pocl-opencl-icd (or a vendor's ICD) "
     "for opencl devices", "the OpenCL ICD loader reads /etc/OpenCL/vendors/*.icd, or OCL_ICD_VENDORS"},
    {"opencl-platform", "every ICD's platform answers", V_WARN, {0}, "check that the library each .icd file names is "
     "installed (clinfo lists what answers)", "the ICD loader skips a platform whose library does not load"},
    {"pocl-command-buffers", "PoCL >= 3.1 (cl_khr_command_buffer) while DEVICE_GRAPHS is on", V_WARN, {3, 1, 0},
     "install PoCL 3.1 or later, or set KILN_OPT_DEVICE_GRAPHS=0: replays run launch by launch",
     "PoCL 3.1 CHANGES: basic support for cl_khr_command_buffer"},
    {"opencl-command-buffers", "devices have command buffers kiln takes (cl_khr_command_buffer 0.9.0-0.9.4) while "
     "DEVICE_GRAPHS is on", V_WARN, {0}, "none needed (replays run launch by launch); a platform with revision "
     "0.9.0-0.9.4 of the extension makes them the device's own graphs",
     "src/backends/opencl/opencl_capture.c: the provisional extension's entry points changed after 0.9.4"},
    {"cpu-avx2", "the processor has AVX2 and FMA", V_WARN, {0}, "none on this processor: kiln runs its plain C kernels "
     "(slow); a processor with AVX2 runs the x86-64-v3 clones", "src/backends/cpu/cpu.h: hot loops are cloned for "
     "x86-64-v4, x86-64-v3 and plain x86-64"},
    {"threads-cores", "kiln's threads <= the cores this process may run on", V_WARN, {0}, "set KILN_NUM_THREADS to at "
     "most the cores (0 is one per core)", "a pool thread more than the cores waits for one at every barrier"},
    {"jit-compiler", "the C compiler of generated cpu kernels ($KILN_CC, default cc) is found", V_WARN, {0},
     "install gcc, or set KILN_CC: compiled graphs on the cpu (kiln_compiled_call, kiln train --compile) cannot be "
     "built without it", "src/compile/jit.c runs $KILN_CC on the generated C"},
    {"cache-writable", "the kernel cache folder exists or can be made, and is writable", V_FAIL, {0},
     "set KILN_CACHE_DIR to a writable folder", "src/core/cache.c: compiled kernels are written there"},
    {"ext-languages", "the extension languages' file is valid", V_FAIL, {0}, "fix the file (docs/ext.md)",
     "kiln ext refuses a malformed languages.json"},
    {"ext-compiler", "each extension language's compiler is found", V_WARN, {0}, "install the compiler, or point the "
     "language's command at it in languages.json (docs/ext.md)", "kiln_ext_compiler_found (src/ext/lang.c)"},
    {"env-valid", "every KILN_* variable set holds a value of its type and range", V_FAIL, {0},
     "set the value the message asks for, or unset it", "src/core/env.def (kiln doctor --env)"},
    {"env-honoured", "kiln does what a KILN_* variable set asks (KILN_DEVICE names a device that is here)", V_WARN,
     {0}, "name a device kiln doctor lists under devices:, or unset it",
     "src/core/backend.c: a KILN_DEVICE that is not here leaves the cpu"},
    {"rendezvous-complete", "KILN_MASTER_ADDR comes with KILN_MASTER_PORT", V_WARN, {0}, "set KILN_MASTER_PORT too",
     "src/dist/rendezvous.c needs both"},
    {"rendezvous-resolves", "KILN_MASTER_ADDR resolves", V_FAIL, {0}, "use rank 0's IP address, or a name this "
     "machine resolves", "src/dist/rendezvous.c resolves it with getaddrinfo"},
    {"rendezvous-fast", "KILN_MASTER_ADDR resolves within 1 s", V_WARN, {0}, "put the name in /etc/hosts or use its "
     "IP address: every rank pays the look-up at start-up (the slow-bootstrap cause)", "getaddrinfo timed here"},
    {"rendezvous-rank0-local", "rank 0's KILN_MASTER_ADDR is an address of this machine", V_FAIL, {0}, "run rank 0 on "
     "that host, or set KILN_MASTER_ADDR to this machine's address (or KILN_SOCKET_IFNAME)",
     "src/dist/rendezvous.c: rank 0 listens on that address"},
};
#define N_RULES (int)(sizeof compat_rules / sizeof compat_rules[0])

static const compat_rule *rule_find(const char *id)
{
    for (int i = 0; i < N_RULES; i++)
        if (!strcmp(compat_rules[i].id, id)) return &compat_rules[i];
    fprintf(stderr, "kiln doctor: no rule '%s'\n", id); /* a typo in this file */
    abort();
}

/* ---- the rows ---- */

typedef struct {
    char name[48];
    verdict v;
    char value[1024];
    char fix[512];
    char rules[96]; /* the ids of the rules applied, comma-separated */
} row;

typedef struct {
    row *r;
    int n, cap;
} report;

/* s rewritten in place so that it can be shown and put in JSON: a byte that is not part
 * of valid UTF-8, and a control character, become \xNN (cut where the buffer of n
 * bytes ends, never inside an escape). */
static void shown(char *s, size_t n)
{
    char out[1024];
    size_t o = 0, cap = sizeof out < n ? sizeof out : n;
    const unsigned char *p = (const unsigned char *)s;
    while (*p && o + 5 < cap) {
        int len = *p < 0x80 ? 1 : (*p & 0xE0) == 0xC0 && *p >= 0xC2 ? 2 : (*p & 0xF0) == 0xE0 ? 3
                  : (*p & 0xF8) == 0xF0 && *p <= 0xF4 ? 4 : 0;
        for (int k = 1; k < len; k++)
            if ((p[k] & 0xC0) != 0x80) len = 0;
        /* overlong three-byte forms and surrogates are not UTF-8 either */
        if (len == 3 && ((*p == 0xE0 && p[1] < 0xA0) || (*p == 0xED && p[1] >= 0xA0))) len = 0;
        if (len == 4 && ((*p == 0xF0 && p[1] < 0x90) || (*p == 0xF4 && p[1] >= 0x90))) len = 0;
        if (len == 1 && (*p < 0x20 || *p == 0x7F)) len = 0;
        if (len == 0) {
            o += (size_t)snprintf(out + o, cap - o, "\\x%02X", *p++);
            continue;
        }
        if (o + (size_t)len >= cap) break;
        memcpy(out + o, p, (size_t)len);
        o += (size_t)len, p += len;
    }
    out[o] = '\0';
    memcpy(s, out, o + 1);
}

static row *add(report *rep, const char *name, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static row *add(report *rep, const char *name, const char *fmt, ...)
{
    if (rep->n == rep->cap) {
        int cap = rep->cap ? 2 * rep->cap : 32;
        row *r = realloc(rep->r, sizeof *r * (size_t)cap);
        if (!r) {
            fprintf(stderr, "kiln doctor: out of memory\n");
            exit(1);
        }
        rep->r = r, rep->cap = cap;
    }
    row *w = &rep->r[rep->n++];
    memset(w, 0, sizeof *w);
    snprintf(w->name, sizeof w->name, "%s", name);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->value, sizeof w->value, fmt, ap);
    va_end(ap);
    shown(w->value, sizeof w->value);
    return w;
}

/* Notes that rule id was applied to w and held. */
static void held(row *w, const char *id)
{
    rule_find(id);
    size_t n = strlen(w->rules);
    snprintf(w->rules + n, sizeof w->rules - n, "%s%s", n ? "," : "", id);
}

/* Rule id was applied to w and did not hold: the rule's verdict (the worse one stays)
 * and its fix, or fix_fmt's when given. */
static void broke(row *w, const char *id, const char *fix_fmt, ...) __attribute__((format(printf, 3, 4)));
static void broke(row *w, const char *id, const char *fix_fmt, ...)
{
    const compat_rule *r = rule_find(id);
    held(w, id);
    if (r->broken < w->v) return;
    w->v = r->broken;
    if (!fix_fmt) {
        snprintf(w->fix, sizeof w->fix, "%s", r->fix);
        return;
    }
    va_list ap;
    va_start(ap, fix_fmt);
    vsnprintf(w->fix, sizeof w->fix, fix_fmt, ap);
    va_end(ap);
    shown(w->fix, sizeof w->fix);
}

/* ---- small helpers ---- */

/* The first "A.B.C" after the first `after` in s (after NULL: anywhere); missing parts 0. */
static bool parse_version(const char *s, const char *after, int v[3])
{
    const char *p = after ? strstr(s, after) : s;
    if (!p) return false;
    p += after ? strlen(after) : 0;
    while (*p && (*p < '0' || *p > '9')) p++;
    v[0] = v[1] = v[2] = 0;
    return *p && sscanf(p, "%d.%d.%d", &v[0], &v[1], &v[2]) >= 1;
}

static bool at_least(const int v[3], const int need[3])
{
    for (int i = 0; i < 3; i++)
        if (v[i] != need[i]) return v[i] > need[i];
    return true;
}

/* A program on $PATH (or a path), as kiln ext finds a compiler: its file into buf. */
static bool find_program(const char *name, char *buf, size_t n)
{
    kiln_ext_lang l = {.command = name};
    return kiln_ext_compiler_found(&l, buf, n);
}

/* The first non-empty line `PROGRAM --version` writes (stdout and stderr). */
static bool version_line(const char *program, char *buf, size_t n)
{
    char cmd[1200];
    if (strchr(program, '\'')) return false;
    snprintf(cmd, sizeof cmd, "'%s' --version 2>&1 </dev/null", program);
    FILE *p = popen(cmd, "r");
    if (!p) return false;
    char line[512];
    bool got = false;
    while (!got && fgets(line, sizeof line, p)) {
        line[strcspn(line, "\r\n")] = 0;
        if (*line) got = snprintf(buf, n, "%s", line) >= 0;
    }
    while (fgets(line, sizeof line, p)) {} /* let it finish writing */
    pclose(p);
    return got;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ---- the rows, layer by layer ---- */

static void check_kiln(report *rep)
{
    add(rep, "kiln", "%s; %s", kiln_version(), kiln_build_info());
#if defined(__clang__)
    add(rep, "compiler", "kiln was built with clang " __VERSION__);
#elif defined(__GNUC__)
    add(rep, "compiler", "kiln was built with GCC " __VERSION__);
#else
    add(rep, "compiler", "kiln was built with an unnamed C compiler");
#endif
    const char *cc = kiln_env_or_default("KILN_CC");
    char found[1024], ver[256] = "";
    if (find_program(cc, found, sizeof found)) {
        version_line(found, ver, sizeof ver);
        held(add(rep, "jit-compiler", "%s (%s), for generated cpu kernels: %s", cc, found, *ver ? ver : "?"),
             "jit-compiler");
    } else {
        row *w = add(rep, "jit-compiler", "%s not found on PATH: compiled graphs on the cpu cannot be built", found);
        broke(w, "jit-compiler", NULL);
    }
}

static bool switch_on(const char *name)
{
    for (int i = 0; i < kiln_opt_count(); i++)
        if (!strcmp(kiln_opt_name(i), name)) return kiln_opt_enabled(i);
    return false;
}

static void check_blas(report *rep)
{
    kiln_blas_info b;
    kiln_blas_info_get(&b);
    row *w = add(rep, "blas", "%s%s%s", *b.config ? b.config : b.name, *b.core ? "; kernels for " : "", b.core);
    if (strcmp(b.name, "OpenBLAS")) return;
    int v[3];
    if (!parse_version(b.config, "OpenBLAS", v) || !at_least(v, rule_find("openblas-version")->need))
        broke(w, "openblas-version", NULL);
    else held(w, "openblas-version");
    if (b.generic_core) {
        kiln_cpu_info c;
        kiln_cpu_info_get(&c);
        broke(w, "openblas-core", "set OPENBLAS_CORETYPE=%s: OpenBLAS did not recognise this processor and runs its "
              "generic %s kernels%s", c.avx512f ? "SkylakeX" : c.avx2 ? "Haswell" : "Nehalem", b.core,
              switch_on("OWN_GEMM") ? "; meanwhile kiln's f32 matmuls and attention run on kiln's own GEMM "
                                      "(KILN_OPT_OWN_GEMM unset is auto)" : "");
    } else held(w, "openblas-core");
}

/* "Open MPI", "MPICH" (MPICH, Intel MPI, MVAPICH and Hydra's launchers) or NULL. */
static const char *mpi_family(const char *s)
{
    if (strstr(s, "Open MPI") || strstr(s, "OpenRTE")) return "Open MPI";
    if (strstr(s, "MPICH") || strstr(s, "HYDRA") || strstr(s, "Intel(R) MPI") || strstr(s, "MVAPICH")) return "MPICH";
    return NULL;
}

static void check_mpi(report *rep)
{
    char lib[256] = "", path[1024], line[256] = "";
    bool have = kiln_dist_mpi_version(lib, sizeof lib);
    row *w = add(rep, "mpi", "%s", have ? lib : "kiln was built without MPI: one process only");
    if (have) held(w, "mpi-library");
    else broke(w, "mpi-library", NULL);
    const char *names[] = {"mpirun", "mpiexec"};
    bool found = false;
    for (int i = 0; i < 2 && !found; i++) found = find_program(names[i], path, sizeof path);
    if (!found) {
        row *l = add(rep, "mpi-launcher", "no mpirun or mpiexec on PATH");
        if (have) broke(l, "mpi-launcher", NULL);
        return;
    }
    version_line(path, line, sizeof line);
    row *l = add(rep, "mpi-launcher", "%s: %s", path, *line ? line : "(no --version)");
    held(l, "mpi-launcher");
    const char *lf = have ? mpi_family(lib) : NULL, *rf = mpi_family(line);
    if (!lf || !rf) return;
    if (strcmp(lf, rf)) broke(l, "mpi-family", "kiln's MPI is %s but %s is %s's: put %s's launcher first on PATH", lf,
                              path, rf, lf);
    else held(l, "mpi-family");
}

static void check_http(report *rep)
{
    add(rep, "libmicrohttpd", "%s (kiln serve's HTTP server)", kiln_server_http_version());
}

/* One ICD file into buf as "label (library)". */
static void icd_note(char *buf, size_t n, int *count, const char *label, const char *path)
{
    char lib[512] = "";
    FILE *f = fopen(path, "r");
    if (f && fgets(lib, sizeof lib, f)) lib[strcspn(lib, "\r\n")] = 0;
    if (f) fclose(f);
    size_t used = strlen(buf);
    snprintf(buf + used, n - used, "%s%s (%s)", (*count)++ ? ", " : "", label, *lib ? lib : "empty");
}

/* The ICD files the loader reads: OCL_ICD_VENDORS (a folder, or one .icd file), else
 * /etc/OpenCL/vendors, into buf as "file (library), ..."; how many. */
static int icd_files(char *buf, size_t n, const char **where)
{
    const char *env = getenv("OCL_ICD_VENDORS"), *dir = env && *env ? env : "/etc/OpenCL/vendors";
    size_t len = strlen(dir);
    int count = 0;
    *where = dir;
    *buf = 0;
    if (len > 4 && !strcmp(dir + len - 4, ".icd")) {
        icd_note(buf, n, &count, dir, dir);
        return count;
    }
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        size_t nl = strlen(e->d_name);
        if (nl < 5 || strcmp(e->d_name + nl - 4, ".icd")) continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        icd_note(buf, n, &count, e->d_name, path);
    }
    if (d) closedir(d);
    return count;
}


static void check_opencl(report *rep)
{
    kiln_opencl_platform p[8];
    int np = kiln_opencl_platforms(p, 8);
    if (np < 0) {
        add(rep, "opencl", "kiln was built without OpenCL (install ocl-icd-opencl-dev and rebuild for opencl devices)");
        return;
    }
    char icds[1024];
    const char *where;
    int n_icd = icd_files(icds, sizeof icds, &where);
    row *w = add(rep, "opencl-icd", "%s: %s", where, n_icd ? icds : "no .icd files");
    if (n_icd) held(w, "opencl-icd");
    else broke(w, "opencl-icd", NULL);
    if (n_icd && np == 0) broke(w, "opencl-platform", NULL);
    bool graphs = switch_on("DEVICE_GRAPHS");
    for (int i = 0; i < np && i < 8; i++) {
        char name[64];
        snprintf(name, sizeof name, "opencl-platform:%d", i);
        w = add(rep, name, "%s, %s: %d device(s), %d with command buffers", p[i].name, p[i].version, p[i].devices,
                p[i].command_buffers);
        int v[3];
        if (parse_version(p[i].version, "PoCL", v) && graphs) {
            if (at_least(v, rule_find("pocl-command-buffers")->need)) held(w, "pocl-command-buffers");
            else broke(w, "pocl-command-buffers", NULL);
        }
        if (graphs && p[i].command_buffers < p[i].devices) broke(w, "opencl-command-buffers", NULL);
        else if (graphs) held(w, "opencl-command-buffers");
    }
}

static void cuda_str(int v, char *buf, size_t n)
{
    if (v) snprintf(buf, n, "%d.%d", v / 1000, v % 1000 / 10);
    else snprintf(buf, n, "none");
}

static void check_cuda(report *rep)
{
    int drv, rt, nv;
    kiln_cuda_versions(&drv, &rt, &nv);
    char d[16], r[16], n[16];
    cuda_str(drv, d, sizeof d), cuda_str(rt, r, sizeof r), cuda_str(nv, n, sizeof n);
    int gpus = 0;
    for (int i = 0; i < kiln_device_count(); i++) gpus += !strncmp(kiln_device_name(i), "cuda", 4);
    row *w = add(rep, "cuda", "driver CUDA %s, runtime %s, NVRTC %s: %s", d, r, n, kiln_cuda_status());
    if (!drv) broke(w, "cuda-driver", "none on a machine without an NVIDIA GPU: no NVIDIA driver, so cuda devices are "
                    "unavailable (else install the driver)");
    else {
        held(w, "cuda-driver");
        if (rt && drv / 1000 < rt / 1000)
            broke(w, "cuda-driver-major", "the driver supports CUDA %s but the runtime is %s: install a driver for CUDA "
                  "%d.x (>= 525.60.13 for 12.x, >= 580 for 13.x)", d, r, rt / 1000);
        else if (rt) held(w, "cuda-driver-major");
        if (nv && drv < nv)
            broke(w, "cuda-driver-ptx", "NVRTC %s writes PTX the CUDA %s driver cannot load: upgrade the driver, or use "
                  "NVRTC %s", n, d, d);
        else if (nv) held(w, "cuda-driver-ptx");
    }
    char nccl[160];
    bool have = kiln_dist_nccl_version(nccl, sizeof nccl);
    w = add(rep, "nccl", "%s (collectives on cuda tensors)", nccl);
    int v[3];
    if (have && parse_version(nccl, "NCCL", v)) {
        if (v[0] == rule_find("nccl-major")->need[0]) held(w, "nccl-major");
        else broke(w, "nccl-major", NULL);
    } else if (gpus) broke(w, "nccl-major", NULL);
}

static void check_cpu(report *rep)
{
    kiln_cpu_info c;
    kiln_cpu_info_get(&c);
    char model[256] = "", flags[256] = "", line[512];
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && !*model && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            char *m = strchr(line, ':') + 1;
            m += strspn(m, " \t");
            m[strcspn(m, "\n")] = 0;
            snprintf(model, sizeof model, "%s: ", m);
        }
    if (f) fclose(f);
    const struct {
        const char *name;
        bool has;
    } ext[] = {{"avx2", c.avx2}, {"fma", c.fma}, {"f16c", c.f16c}, {"avx512f", c.avx512f}, {"avx512bw", c.avx512bw},
               {"avx512vl", c.avx512vl}, {"avx512bf16", c.avx512bf16}, {"amx-bf16", c.amx_bf16}};
    for (size_t i = 0; i < sizeof ext / sizeof ext[0]; i++) {
        size_t n = strlen(flags);
        snprintf(flags + n, sizeof flags - n, "%s%s%s", n ? " " : "", ext[i].has ? "" : "no-", ext[i].name);
    }
    row *w = add(rep, "cpu", "%s%s; hot loops: the %s clone; own GEMM f32: %s; bf16: %s; f16 conversions: %s", model,
                 flags, c.clone, c.gemm_f32, c.gemm_bf16, c.f16c ? "F16C" : "plain C");
    if (c.avx2 && c.fma) held(w, "cpu-avx2");
    else broke(w, "cpu-avx2", NULL);

    cpu_set_t set;
    int online = (int)sysconf(_SC_NPROCESSORS_ONLN), mine = online;
    if (sched_getaffinity(0, sizeof set, &set) == 0) mine = CPU_COUNT(&set);
    int t = kiln_num_threads();
    w = add(rep, "threads", "%d (KILN_NUM_THREADS %s); %d core(s) online, %d this process may use", t,
            kiln_env("KILN_NUM_THREADS") ? kiln_env("KILN_NUM_THREADS") : "unset", online, mine);
    if (t > mine) broke(w, "threads-cores", "set KILN_NUM_THREADS to at most %d (0 is one per core)", mine);
    else held(w, "threads-cores");
}

static long long du_bytes, du_files; /* nftw's callback takes no context */
static int du_one(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)path, (void)ftw;
    if (type == FTW_F) du_bytes += (long long)st->st_blocks * 512, du_files++;
    return 0;
}

static void check_cache(report *rep)
{
    char dir[1024], probe[1100];
    kiln_cache_dir(dir, sizeof dir);
    struct stat st;
    bool existed = stat(dir, &st) == 0 && S_ISDIR(st.st_mode);
    const char *why = NULL;
    int err = 0;
    if (!existed && kiln__make_dirs(dir) != 0) why = "cannot be made", err = errno;
    if (!why) {
        snprintf(probe, sizeof probe, "%s/.kiln-doctor-XXXXXX", dir);
        int fd = mkstemp(probe);
        if (fd < 0 || write(fd, "k", 1) != 1) why = "is not writable", err = errno;
        if (fd >= 0) close(fd), unlink(probe);
    }
    if (why) {
        row *w = add(rep, "cache", "%s %s: %s", dir, why, strerror(err));
        broke(w, "cache-writable", "set KILN_CACHE_DIR to a writable folder (%s %s)", dir, why);
        return;
    }
    du_bytes = du_files = 0;
    nftw(dir, du_one, 16, FTW_PHYS);
    held(add(rep, "cache", "%s%s: writable, %.1f MiB in %lld files", dir, existed ? "" : " (made now)",
             (double)du_bytes / (1024.0 * 1024.0), du_files),
         "cache-writable");
}

static void check_languages(report *rep, const char *file)
{
    kiln_ext_langs_t *t;
    if (kiln_ext_langs_load(file, &t) != KILN_OK) {
        row *w = add(rep, "ext", "%s", kiln_last_error());
        broke(w, "ext-languages", NULL);
        return;
    }
    for (int i = 0; i < kiln_ext_langs_count(t); i++) {
        const kiln_ext_lang *l = kiln_ext_langs_at(t, i);
        char name[48], found[1200];
        snprintf(name, sizeof name, "ext %s", l->suffix);
        if (!*l->command) {
            add(rep, name, "%s: handed to the %s backend when loaded", l->origin, l->backend);
            continue;
        }
        if (kiln_ext_compiler_found(l, found, sizeof found)) {
            held(add(rep, name, "%s: %s", l->origin, found), "ext-compiler");
            continue;
        }
        row *w = add(rep, name, "%s: %s not found: %s sources cannot be built here", l->origin, found, l->suffix);
        broke(w, "ext-compiler", "install %s, or point the %s row's command at a compiler that is there (%s; docs/ext.md)",
              found, l->suffix, strcmp(l->origin, "built-in") ? l->origin : "languages.json");
    }
    kiln_ext_langs_free(t);
}

static void check_env(report *rep)
{
    kiln_env_var v;
    int set = 0;
    for (int i = 0; kiln_env_var_at(i, &v); i++) {
        if (!v.value) continue;
        set++;
        row *w = add(rep, v.name, "=%s: %s", v.value, v.help);
        if (kiln_env_check(v.name) == KILN_OK) held(w, "env-valid");
        else broke(w, "env-valid", "%s", kiln_last_error());
        if (!strcmp(v.name, "KILN_DEVICE")) {
            /* the device kiln took from it: "opencl" is opencl:0 */
            const char *cur = kiln_device();
            size_t n = strlen(v.value);
            bool same = !strcmp(cur, v.value) || (!strchr(v.value, ':') && !strncmp(cur, v.value, n) &&
                                                  !strcmp(cur + n, ":0"));
            if (same) held(w, "env-honoured");
            else broke(w, "env-honoured", "KILN_DEVICE=%s is not a device here, so kiln uses %s: name one kiln doctor "
                       "lists under devices:, or unset it", v.value, cur);
        }
    }
    if (!set) add(rep, "environment", "no KILN_* variable set (kiln doctor --env lists the %d kiln reads)", kiln_env_count());
}

/* Whether a (IPv4, network order) is one of this machine's: on an interface, or
 * loopback (all of 127/8 is). The interface's name into ifname. */
static bool local_address(struct in_addr a, char *ifname, size_t n)
{
    if ((ntohl(a.s_addr) >> 24) == 127) return snprintf(ifname, n, "loopback"), true;
    struct ifaddrs *ifs = NULL, *i;
    bool found = false;
    if (getifaddrs(&ifs) != 0) return false;
    for (i = ifs; i && !found; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET &&
            ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr == a.s_addr)
            found = true, snprintf(ifname, n, "%s", i->ifa_name);
    freeifaddrs(ifs);
    return found;
}

static void check_rendezvous(report *rep)
{
    const char *addr = kiln_env("KILN_MASTER_ADDR");
    if (!addr) {
        add(rep, "rendezvous", "the TCP rendezvous is not configured (KILN_MASTER_ADDR unset): groups come from an MPI "
            "launcher, or this is one process");
        return;
    }
    struct in_addr a;
    double took = 0;
    bool numeric = inet_pton(AF_INET, addr, &a) == 1;
    if (!numeric) { /* as src/dist/rendezvous.c resolves it */
        struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res = NULL;
        double t0 = now_s();
        int rc = getaddrinfo(addr, NULL, &hints, &res);
        took = now_s() - t0;
        if (rc != 0) {
            row *w = add(rep, "rendezvous", "KILN_MASTER_ADDR %s does not resolve (%s, after %.2f s)", addr,
                         gai_strerror(rc), took);
            broke(w, "rendezvous-resolves", NULL);
            return;
        }
        a = ((struct sockaddr_in *)res->ai_addr)->sin_addr;
        freeaddrinfo(res);
    }
    char ip[INET_ADDRSTRLEN], ifname[64] = "";
    inet_ntop(AF_INET, &a, ip, sizeof ip);
    bool local = local_address(a, ifname, sizeof ifname);
    const char *port = kiln_env("KILN_MASTER_PORT"), *rank = kiln_env("KILN_RANK"), *world = kiln_env("KILN_WORLD_SIZE");
    char when[64];
    if (numeric) snprintf(when, sizeof when, "a numeric address (no look-up)");
    else snprintf(when, sizeof when, "resolved to %s in %.2f s", ip, took);
    char where[96];
    if (local) snprintf(where, sizeof where, "an address of this machine (%s)", ifname);
    else snprintf(where, sizeof where, "not an address of this machine");
    row *w = add(rep, "rendezvous", "KILN_MASTER_ADDR %s:%s %s, %s; this is rank %s of %s", addr, port ? port : "?",
                 when, where, rank ? rank : "?", world ? world : "?");
    if (port) held(w, "rendezvous-complete");
    else broke(w, "rendezvous-complete", NULL);
    if (!numeric) held(w, "rendezvous-resolves");
    if (!numeric && took > 1.0)
        broke(w, "rendezvous-fast", "resolving %s took %.2f s, which every rank pays at start-up: put it in /etc/hosts "
              "or set KILN_MASTER_ADDR to its IP address (%s)", addr, took, ip);
    else if (!numeric) held(w, "rendezvous-fast");
    bool rank0 = rank && !strcmp(rank, "0") && world && strcmp(world, "1");
    if (rank0 && !local && !kiln_env("KILN_SOCKET_IFNAME"))
        broke(w, "rendezvous-rank0-local", "rank 0 listens on KILN_MASTER_ADDR, and %s is not this machine's: run "
              "rank 0 on that host, or set KILN_MASTER_ADDR to an address of this one", ip);
    else if (rank0) held(w, "rendezvous-rank0-local");
}

/* ---- output ---- */

static void print_text(const report *rep, bool switches)
{
    int w = 8, count[3] = {0, 0, 0};
    for (int i = 0; i < rep->n; i++) w = (int)strlen(rep->r[i].name) > w ? (int)strlen(rep->r[i].name) : w;
    for (int i = 0; i < rep->n; i++) count[rep->r[i].v]++;
    printf("%d rows: %d OK, %d WARN, %d FAIL (docs/doctor.md; kiln doctor --rules lists the rules, kiln doctor --env "
           "the variables, kiln doctor --switches the optimization switches)\n", rep->n, count[V_OK], count[V_WARN],
           count[V_FAIL]);
    /* what needs doing first: the FAIL and WARN rows, then the rest */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < rep->n; i++) {
            const row *r = &rep->r[i];
            if ((r->v == V_OK) != (pass == 1)) continue;
            printf("%-4s  %-*s  %s", verdict_names[r->v], w, r->name, r->value);
            if (*r->rules) printf("  [%s]", r->rules);
            printf("\n");
            if (r->v != V_OK) printf("%-4s  %-*s  fix: %s\n", "", w, "", r->fix);
        }
    printf("devices:\n");
    for (int i = 0; i < kiln_device_count(); i++) {
        char buf[512];
        printf("  %s\n", kiln_device_describe(i, buf, sizeof buf) ? buf : kiln_device_name(i));
    }
    if (!switches) return;
    printf("optimization switches (KILN_OPT_<NAME>=0|1; the compiler's stages also KILN_COMPILE_DISABLE=<stage>,...):\n");
    int sw = 0;
    for (int i = 0; i < kiln_opt_count(); i++) sw = (int)strlen(kiln_opt_name(i)) > sw ? (int)strlen(kiln_opt_name(i)) : sw;
    for (int i = 0; i < kiln_opt_count(); i++)
        printf("  %-*s %s  %s\n", sw, kiln_opt_name(i), kiln_opt_enabled(i) ? "on " : "off", kiln_opt_help(i));
}

static int print_json(const report *rep)
{
    json_t *a = json_array();
    for (int i = 0; a && i < rep->n; i++) {
        const row *r = &rep->r[i];
        json_t *o = json_object(), *rules = json_array();
        char ids[sizeof r->rules];
        snprintf(ids, sizeof ids, "%s", r->rules);
        for (char *save = NULL, *t = strtok_r(ids, ",", &save); t; t = strtok_r(NULL, ",", &save))
            json_array_append_new(rules, json_string(t));
        json_object_set_new(o, "name", json_string(r->name));
        json_object_set_new(o, "verdict", json_string(verdict_names[r->v]));
        json_object_set_new(o, "value", json_string(r->value));
        json_object_set_new(o, "fix", json_string(r->v == V_OK ? "" : r->fix));
        json_object_set_new(o, "rules", rules);
        json_array_append_new(a, o);
    }
    char *s = a ? json_dumps(a, JSON_INDENT(2)) : NULL;
    json_decref(a);
    if (!s) return cli_fail("doctor", "cannot write the JSON (out of memory, or a value that is not UTF-8)");
    printf("%s\n", s);
    free(s);
    return 0;
}

static void print_rules(void)
{
    printf("%-24s %-5s %s\n", "rule", "else", "requires (fix; where the fact comes from)");
    for (int i = 0; i < N_RULES; i++) {
        const compat_rule *r = &compat_rules[i];
        printf("%-24s %-5s %s\n%-30s fix: %s\n%-30s from: %s\n", r->id, verdict_names[r->broken], r->requires, "",
               r->fix, "", r->source);
    }
}

/* ---- kiln doctor --env, --ops ---- */

/* s for a Markdown table cell: < > and | escaped. */
static void md_print(const char *s)
{
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", stdout);
        else if (*s == '>') fputs("&gt;", stdout);
        else if (*s == '|') fputs("\\|", stdout);
        else putchar(*s);
    }
}

/* kiln doctor --env [--markdown]: every KILN_* variable kiln reads, from its one table
 * (src/core/env.def); the Markdown form is docs/env.md's table. */
static int doctor_env(bool markdown)
{
    kiln_env_var v;
    if (markdown) {
        printf("| variable | type | default | read by | meaning |\n|---|---|---|---|---|\n");
        for (int i = 0; kiln_env_var_at(i, &v); i++) {
            printf("| `%s` | %s | ", v.name, v.type);
            if (*v.dflt == '(') md_print(v.dflt);
            else if (*v.dflt) printf("`%s`", v.dflt);
            else printf("(none)");
            printf(" | %s | ", v.who);
            md_print(v.help);
            printf(" |\n");
        }
        return 0;
    }
    int w = 8, set = 0, bad = 0;
    for (int i = 0; kiln_env_var_at(i, &v); i++) w = (int)strlen(v.name) > w ? (int)strlen(v.name) : w;
    printf("%-*s  %-6s  %-12s  %s\n", w, "variable", "type", "value", "meaning (default; who reads it)");
    for (int i = 0; kiln_env_var_at(i, &v); i++) {
        printf("%-*s  %-6s  %-12s  %s (default %s; %s)\n", w, v.name, v.type, v.value ? v.value : "-", v.help,
               *v.dflt ? v.dflt : "none", v.who);
        set += v.value != NULL;
        if (v.value && kiln_env_check(v.name) != KILN_OK) printf("%-*s  ^ %s\n", w, "", kiln_last_error()), bad++;
    }
    printf("%d variables, %d set here%s\n", kiln_env_count(), set, bad ? ", some not valid (^)" : "");
    return 0;
}

static int doctor_ops(const char *ops)
{
    if (kiln_set_device(ops) != KILN_OK) return cli_fail("doctor", NULL);
    kiln_set_device("cpu");
    int count[4] = {0, 0, 0, 0};
    static const char *how[4] = {"not supported", "on the cpu (copies)", "native", "generated kernel"};
    printf("%-26s %s\n", "op", ops);
    for (int i = 0; i < kiln_op_count(); i++) {
        kiln_op_support k = kiln_device_op_support(ops, i);
        count[k]++;
        printf("%-26s %s\n", kiln_op_name(i), how[k]);
    }
    printf("%d ops: %d native, %d generated kernels, %d on the cpu with copies, %d not supported\n", kiln_op_count(),
           count[2], count[3], count[1], count[0]);
    return 0;
}

int cmd_doctor(int argc, char **argv)
{
    const char *ops = NULL, *languages = NULL;
    bool env = false, markdown = false, json = false, rules = false, switches = false;
    const cli_opt opts[] = {
        {"json", OPT_FLAG, &json, "the rows as a JSON array of {name, verdict, value, fix, rules}, for scripts"},
        {"languages", OPT_STRING, &languages, "a languages.json (default: $XDG_CONFIG_HOME/kiln/languages.json)"},
        {"rules", OPT_FLAG, &rules, "print the compatibility rules the rows apply"},
        {"ops", OPT_STRING, &ops, "print which ops DEVICE runs with its own kernels and which on the cpu"},
        {"env", OPT_FLAG, &env, "print every KILN_* environment variable kiln reads: type, value here, meaning, default"},
        {"markdown", OPT_FLAG, &markdown, "with --env: as a Markdown table (docs/env.md)"},
        {"switches", OPT_FLAG, &switches, "also list the optimization switches (KILN_OPT_*) and whether each is on"},
        {NULL, 0, NULL, NULL},
    };
    int r = cli_parse("doctor",
                      "[--json] [--switches] [--languages FILE] | --rules | --ops DEVICE | --env [--markdown]\n\n"
                      "Checks every layer kiln stands on (build, compilers, BLAS, MPI, libmicrohttpd, OpenCL, CUDA\n"
                      "and NCCL, the processor, threads, the kernel cache, extension languages, KILN_* variables,\n"
                      "the rendezvous address): one row each, OK, WARN or FAIL, with how to fix a WARN or FAIL.\n"
                      "Exit status: 1 when a row FAILs, else 0 (WARN is 0); 2 for a bad option. docs/doctor.md.",
                      opts, argc, argv, NULL, 0, NULL);
    if (r) return r == 1 ? 0 : 2;
    if (markdown && !env) return cli_fail("doctor", "--markdown goes with --env");
    if (env) return doctor_env(markdown);
    if (ops) return doctor_ops(ops);
    if (rules) {
        print_rules();
        return 0;
    }
    report rep = {0};
    check_kiln(&rep);
    check_blas(&rep);
    check_mpi(&rep);
    check_http(&rep);
    check_opencl(&rep);
    check_cuda(&rep);
    check_cpu(&rep);
    check_cache(&rep);
    check_languages(&rep, languages);
    check_env(&rep);
    check_rendezvous(&rep);
    int rc = json ? print_json(&rep) : (print_text(&rep, switches), 0);
    for (int i = 0; i < rep.n && !rc; i++) rc = rep.r[i].v == V_FAIL;
    free(rep.r);
    return rc;
}
