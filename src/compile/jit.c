/* Compiling generated C and caching it. The source of a program's kernels is hashed
 * together with the compiler, its flags and the kiln version; the shared object lives
 * under the cache dir ($KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln)
 * as <hash>.so beside its <hash>.c. A second run of the same program finds it and only
 * loads it. Two processes compiling the same program at once each write their own
 * temporary files and rename them into place, so a reader sees a whole file or none.
 * The compiler is the system's C compiler ($KILN_CC, default cc): kiln needs no code
 * generator library of its own, and the generated C can be read and rebuilt by hand. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include "compile/compile_impl.h"
#include "core/file.h"
#include "core/env.h"
#include "core/cache.h"

extern char **environ;

static const char *cflags[] = {"-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
                               "-ffp-contract=fast", "-w"};
#define N_CFLAGS (int)(sizeof cflags / sizeof cflags[0])

static const char *compiler(void) { return kiln__env_text(KILN__ENV_CC); }

/* Writes text to path, which must not exist yet (exclusive: EEXIST is returned as is,
 * with no error set, for the caller to pick another name). */
static int write_new_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0 && errno == EEXIST) return EEXIST;
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        return kiln__err(KILN_ERR_IO, "compile: cannot write %s: %s", path, strerror(errno));
    }
    size_t n = strlen(text);
    bool ok = fwrite(text, 1, n, f) == n;
    ok &= fclose(f) == 0;
    return ok ? KILN_OK : kiln__err(KILN_ERR_IO, "compile: cannot write %s: %s", path, strerror(errno));
}

/* The first kernel function the compiler's log names, for the error. */
static void kernel_in_log(const char *log_path, char *name, size_t n)
{
    snprintf(name, n, "(unknown kernel)");
    FILE *f = fopen(log_path, "r");
    if (!f) return;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        char *p = strstr(line, "function");
        if (!p) continue;
        char *k = strchr(p, 'k');
        if (!k) continue;
        size_t len = strspn(k, "abcdefghijklmnopqrstuvwxyz0123456789_");
        if (len > 1 && len < n) {
            memcpy(name, k, len);
            name[len] = 0;
            break;
        }
    }
    fclose(f);
}

/* Runs the compiler on src_path into so_path, its output into log_path. */
static kiln_status run_cc(const char *src_path, const char *so_path, const char *log_path)
{
    const char *argv[N_CFLAGS + 8];
    int a = 0;
    argv[a++] = compiler();
    for (int i = 0; i < N_CFLAGS; i++) argv[a++] = cflags[i];
    argv[a++] = "-o";
    argv[a++] = so_path;
    argv[a++] = src_path;
    argv[a++] = "-lm";
    argv[a] = NULL;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, NULL, (char *const *)argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0)
        return kiln__err(KILN_ERR_IO, "compile: cannot run the C compiler '%s': %s (install gcc, or set KILN_CC)",
                         argv[0], strerror(rc));
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        char k[96];
        kernel_in_log(log_path, k, sizeof k);
        return kiln__err(KILN_ERR_COMPILE, "compile: the C compiler failed on kernel %s; source kept at %s, the "
                         "compiler's output at %s", k, src_path, log_path);
    }
    return KILN_OK;
}

void kiln__jit_unload(void *so) { dlclose(so); }

kiln_status kiln__device_load(kiln__program *p, const char *src, const char *debug_dir)
{
    kiln__backend *be = p->be;
    kiln__debug_dump(debug_dir, !strcmp(be->language, "cuda-c") ? "kernels.cu" : "kernels.cl", src, NULL, NULL);
    if (p->n_k == 0) return KILN_OK;
    /* The backend builds the source once (it keeps its programs by the source's hash)
     * and takes each kernel out of it. */
    if (!(p->kern = calloc((size_t)p->n_k, sizeof *p->kern))) return kiln__err(KILN_ERR_OOM, "compile: out of memory");
    kiln_status s = KILN_OK;
    for (int i = 0; s == KILN_OK && i < p->n_k; i++) s = kiln__be_compile_kernel(be, src, p->k[i].name, &p->kern[i]);
    /* OpenCL kernels with symbolic sizes read them from a device buffer (codegen_c.c),
     * one per kernel, filled once: a program's sizes do not change. */
    if (s == KILN_OK && p->symbolic && kiln__codegen_for(be) == kiln__codegen_opencl) {
        if (!(p->dsz = calloc((size_t)p->n_k, sizeof *p->dsz))) s = kiln__err(KILN_ERR_OOM, "compile: out of memory");
        for (int i = 0; s == KILN_OK && i < p->n_k; i++) {
            if (!(p->dsz[i] = kiln__be_alloc(be, KC_SZ_BYTES(&p->k[i]))))
                s = kiln__err(KILN_ERR_OOM, "compile: out of %s memory for a kernel's sizes", be->name);
            else if (p->k[i].n_sz > 0)
                s = kiln__be_copy_h2d(be, p->dsz[i], p->k[i].sz, sizeof(int64_t) * (size_t)p->k[i].n_sz);
        }
    }
    if (s != KILN_OK) { /* what did compile goes back */
        for (int i = 0; i < p->n_k; i++)
            kiln__be_kernel_free(be, p->kern[i]);
        free(p->kern);
        p->kern = NULL;
    }
    return s; /* device sizes made so far go with the program (kiln__program_free) */
}

/* The host processor's identity for the cache key: -march=native makes code for this
 * processor only, so a cache folder shared by machines (a home directory on NFS) must
 * not hand one machine another's. A hash of the first processor's model name and flags
 * from /proc/cpuinfo (nothing where there is no such file), read once per process. */
static uint64_t cpu_id;
static void read_cpu_id(void)
{
    uint64_t h = KILN__FNV_SEED;
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[8192];
    for (int found = 0; f && found < 2 && fgets(line, sizeof line, f);)
        if (!strncmp(line, "model name", 10) || !strncmp(line, "flags", 5) || !strncmp(line, "Features", 8)) {
            h = kiln__fnv(h, line, strlen(line));
            found++;
        }
    if (f) fclose(f);
    cpu_id = h;
}

/* The cache key of src: the source, the compiler (its resolved file's size and time,
 * so that an upgrade misses the cache), the flags, kiln's version and the processor. */
static uint64_t cache_key(const char *src)
{
    uint64_t h = kiln__fnv(KILN__FNV_SEED, src, strlen(src));
    const char *cc = compiler();
    h = kiln__fnv(h, cc, strlen(cc));
    struct stat ccst;
    char ccpath[1024] = "";
    if (!strchr(cc, '/')) {
        const char *path = getenv("PATH");
        for (const char *q = path ? path : "/usr/bin"; q && *q;) {
            const char *e = strchr(q, ':');
            size_t len = e ? (size_t)(e - q) : strlen(q);
            snprintf(ccpath, sizeof ccpath, "%.*s/%s", (int)len, q, cc);
            if (stat(ccpath, &ccst) == 0) break;
            *ccpath = 0;
            q = e ? e + 1 : NULL;
        }
    } else {
        snprintf(ccpath, sizeof ccpath, "%s", cc);
    }
    if (*ccpath && stat(ccpath, &ccst) == 0) {
        h = kiln__fnv(h, &ccst.st_size, sizeof ccst.st_size);
        h = kiln__fnv(h, &ccst.st_mtime, sizeof ccst.st_mtime);
    }
    for (int i = 0; i < N_CFLAGS; i++) h = kiln__fnv(h, cflags[i], strlen(cflags[i]));
    h = kiln__fnv(h, KILN_VERSION, strlen(KILN_VERSION));
    static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;
    pthread_once(&cpu_once, read_cpu_id);
    return kiln__fnv(h, &cpu_id, sizeof cpu_id);
}

/* Compiles src into dir as so (and keeps it as c_path beside it), through temporary
 * files of this call alone, renamed into place when complete: the source is created
 * exclusively under a name of this host, process and call (processes on two machines
 * sharing the cache, two threads of one), another name tried while one exists, and the
 * object and log take its stem. */
static kiln_status compile_into_cache(const char *src, const char *dir, uint64_t h, const char *so, const char *c_path,
                                      const char *debug_dir)
{
    static atomic_uint calls;
    char host[64] = "host", tmp_c[1250], tmp_so[1250], log[1250];
    gethostname(host, sizeof host - 1);
    host[strcspn(host, "/")] = 0;
    int pid = (int)getpid(), w = EEXIST;
    for (int tries = 0; w == EEXIST && tries < 64; tries++) {
        unsigned call = atomic_fetch_add(&calls, 1);
        char stem[1200];
        snprintf(stem, sizeof stem, "%s/%016llx.%s.%d.%u", dir, (unsigned long long)h, host, pid, call);
        snprintf(tmp_c, sizeof tmp_c, "%s.c", stem);
        snprintf(tmp_so, sizeof tmp_so, "%s.so", stem);
        snprintf(log, sizeof log, "%s.log", stem);
        w = write_new_file(tmp_c, src);
    }
    if (w == EEXIST) return kiln__err(KILN_ERR_IO, "compile: no free temporary name in %s", dir);
    if (w != KILN_OK) return (kiln_status)w;
    kiln_status s = run_cc(tmp_c, tmp_so, log);
    FILE *df;
    if ((df = kiln__debug_open(debug_dir, "compile.log"))) {
        /* The command, then what the compiler said. */
        fprintf(df, "%s", compiler());
        for (int i = 0; i < N_CFLAGS; i++) fprintf(df, " %s", cflags[i]);
        fprintf(df, " -o %s %s -lm\n", so, c_path);
        FILE *in = fopen(log, "r");
        char chunk[512];
        size_t n;
        while (in && (n = fread(chunk, 1, sizeof chunk, in)) > 0) fwrite(chunk, 1, n, df);
        if (in) fclose(in);
        fclose(df);
    }
    if (s != KILN_OK) return s; /* the source and the log stay, named in the error */
    unlink(log);
    /* (core/file.h: never over what is not a regular file) */
    if ((s = kiln__file_place(tmp_c, c_path, "the kernel cache")) != KILN_OK ||
        (s = kiln__file_place(tmp_so, so, "the kernel cache")) != KILN_OK) {
        unlink(tmp_c);
        unlink(tmp_so);
    }
    return s;
}

kiln_status kiln__jit_open(const char *src, const char *debug_dir, void **lib_out)
{
    uint64_t h = cache_key(src);
    char dir[1024];
    kiln_status s = kiln__cache_dir(NULL, dir, sizeof dir);
    if (s != KILN_OK) return s;
    char so[1100], c_path[1100];
    snprintf(so, sizeof so, "%s/%016llx.so", dir, (unsigned long long)h);
    snprintf(c_path, sizeof c_path, "%s/%016llx.c", dir, (unsigned long long)h);
    bool hit = access(so, R_OK) == 0;
    FILE *df;
    kiln__debug_dump(debug_dir, "kernels.c", src, NULL, NULL);
    if (kiln__log_on("perf") || kiln__log_on("code"))
        fprintf(stderr, "kiln [perf] kernel cache %s: %s\n", hit ? "hit" : "miss", so);
    if (hit && (df = kiln__debug_open(debug_dir, "compile.log"))) {
        fprintf(df, "cache hit: %s, built earlier from %s; the compiler was not run\n", so, c_path);
        fclose(df);
    }
    if (!hit && (s = compile_into_cache(src, dir, h, so, c_path, debug_dir)) != KILN_OK) return s;
    void *lib = dlopen(so, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return kiln__err(KILN_ERR_IO, "compile: cannot load %s: %s (remove it to recompile)", so, dlerror());
    *lib_out = lib;
    return KILN_OK;
}

kiln_status kiln__jit_load(kiln__program *p, const char *src, const char *debug_dir)
{
    if (p->n_k == 0) return KILN_OK;
    void *lib;
    kiln_status s = kiln__jit_open(src, debug_dir, &lib);
    if (s != KILN_OK) return s;
    for (int i = 0; i < p->n_k; i++) {
        *(void **)&p->k[i].fn = dlsym(lib, p->k[i].name);
        if (!p->k[i].fn) {
            dlclose(lib);
            return kiln__err(KILN_ERR_IO, "compile: the kernel library has no kernel %s (a stale cache file? remove "
                             "it)", p->k[i].name);
        }
    }
    p->so = lib;
    return KILN_OK;
}
