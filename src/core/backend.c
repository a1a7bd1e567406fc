/* The backend registry and library start-up. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "core/tensor_impl.h"
#include "core/env.h"
#include "core/intercept.h"
#include "core/threadpool.h"

#define MAX_BACKENDS 16 /* the cpu, up to 4 OpenCL devices, up to 8 GPUs */

static kiln__backend *backends[MAX_BACKENDS];
static int n_backends;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int requested_threads;

/* Who makes the backends (src/core/intercept.h): registered before main by each backend
 * room; the cpu's at start-up, the devices' on first need. */
#define MAX_PROVIDERS 8
typedef struct {
    const char *name;
    int (*make)(int nthreads);
    bool at_init;
} backend_provider;
static backend_provider providers[MAX_PROVIDERS];
static int n_providers;

kiln_status kiln__backend_provider_register(const char *name, int (*make)(int nthreads), bool at_init)
{
    if (!name || !make) return kiln__err(KILN_ERR_ARG, "backend_provider_register: name or make is NULL");
    if (n_providers == MAX_PROVIDERS) return kiln__err(KILN_ERR_ARG, "too many backend providers (at most %d)", MAX_PROVIDERS);
    providers[n_providers++] = (backend_provider){name, make, at_init};
    return KILN_OK;
}

/* Runs the providers made at start-up (at_init) or those probed later. */
static void run_providers(bool at_init, int nthreads)
{
    for (int i = 0; i < n_providers; i++)
        if (providers[i].at_init == at_init) providers[i].make(nthreads);
}

kiln_status kiln__backend_register(kiln__backend *be)
{
    if (!be || !be->name) return kiln__err(KILN_ERR_ARG, "backend_register: backend or its name is NULL");
    if (be->abi_version != KILN_BACKEND_ABI_VERSION)
        return kiln__err(KILN_ERR_UNSUPPORTED, "backend '%s' speaks contract version %d, kiln speaks %d", be->name,
                         be->abi_version, KILN_BACKEND_ABI_VERSION);
    /* The required entries: those core calls through backend_calls.c (backend.h's list),
     * free, memset and the kernel table. */
    const char *missing = !be->free ? "free" : !be->memset ? "memset" : !be->kernels ? "kernels" : NULL;
#define KILN__BE_MISSING(type, entry, ...) if (!be->entry) missing = #entry;
    KILN__BE_REQUIRED_CALLS(KILN__BE_MISSING)
#undef KILN__BE_MISSING
    if (missing)
        return kiln__err(KILN_ERR_ARG, "backend '%s' lacks a required entry of the contract (%s)", be->name, missing);
    for (int i = 0; i < n_backends; i++)
        if (!strcmp(backends[i]->name, be->name))
            return kiln__err(KILN_ERR_ARG, "a backend named '%s' is already registered", be->name);
    if (n_backends == MAX_BACKENDS) return kiln__err(KILN_ERR_ARG, "too many backends (at most %d)", MAX_BACKENDS);
    backends[n_backends++] = be;
    return KILN_OK;
}

/* "opencl" is the first OpenCL device, "opencl:0"; other names are exact. */
static kiln__backend *find_name(const char *name)
{
    size_t n = strlen(name);
    for (int i = 0; i < n_backends; i++) {
        const char *b = backends[i]->name;
        if (!strcmp(b, name) || (!strncmp(b, name, n) && !strcmp(b + n, ":0"))) return backends[i];
    }
    return NULL;
}

/* The device backends are probed on first need (a device named, or listed), so that a
 * process that stays on the cpu never loads an OpenCL platform or looks for a GPU. */
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;

static void do_probe(void) { run_providers(false, 0); }

static void probe_devices(void) { pthread_once(&probe_once, do_probe); }

kiln__backend *kiln__backend_find(const char *name)
{
    kiln__ensure_init();
    if (!name) return NULL;
    kiln__backend *be = find_name(name);
    if (!be) {
        probe_devices();
        be = find_name(name);
    }
    return be;
}

bool kiln__backend_is(const kiln__backend *be, const char *kind)
{
    size_t len = strcspn(be->name, ":");
    return strlen(kind) == len && !strncmp(kind, be->name, len);
}

static _Atomic(kiln__backend *) default_be;

static _Thread_local kiln__backend *here; /* kiln__backend_here: made next to a tensor */

kiln__backend *kiln__backend_default(void)
{
    kiln__ensure_init();
    return here ? here : atomic_load(&default_be);
}

kiln__backend *kiln__backend_here(kiln__backend *be)
{
    kiln__backend *was = here;
    here = be;
    return was;
}

/* "cpu, opencl:0" into buf, returned. */
static const char *device_list(char *buf, size_t n)
{
    size_t w = 0;
    buf[0] = '\0';
    for (int i = 0; i < n_backends && w < n; i++) w += (size_t)snprintf(buf + w, n - w, "%s%s", i ? ", " : "", backends[i]->name);
    return buf;
}

kiln_status kiln_set_device(const char *name)
{
    kiln__backend *be = kiln__backend_find(name);
    char have[256];
    if (!be)
        return kiln__err(KILN_ERR_DEVICE, "no device named '%s' (this build and machine have: %s)", name ? name : "(null)",
                         device_list(have, sizeof have));
    atomic_store(&default_be, be);
    return KILN_OK;
}

const char *kiln_device(void) { return kiln__backend_default()->name; }

kiln_status kiln_host_pin(const char *device, void *ptr, size_t n, bool *pinned)
{
    if (pinned) *pinned = false;
    kiln__backend *be = kiln__backend_find(device);
    if (!be) return kiln_set_device(device) == KILN_OK ? KILN_OK : kiln_last_status(); /* names the devices */
    if (!ptr || !n || !be->host_register) return KILN_OK; /* nothing to pin, or a backend without it */
    kiln_status s = kiln__be_host_register(be, ptr, n);
    if (s == KILN_OK && pinned) *pinned = true;
    return s;
}

kiln_status kiln_host_unpin(const char *device, void *ptr)
{
    kiln__backend *be = kiln__backend_find(device);
    if (!be) return kiln_set_device(device) == KILN_OK ? KILN_OK : kiln_last_status();
    return ptr && be->host_unregister ? kiln__be_host_unregister(be, ptr) : KILN_OK;
}

kiln_status kiln_device_synchronize(const char *device)
{
    kiln__backend *be = kiln__backend_find(device);
    if (!be) return kiln_set_device(device) == KILN_OK ? KILN_OK : kiln_last_status(); /* names the devices */
    return kiln__be_synchronize(be);
}

int kiln__backend_count(void)
{
    kiln__ensure_init();
    return n_backends;
}

int kiln_device_count(void)
{
    kiln__ensure_init();
    probe_devices();
    return n_backends;
}

kiln__backend *kiln__backend_at(int i) { return i >= 0 && i < n_backends ? backends[i] : NULL; }

static void do_init(void)
{
    int n = requested_threads;
    const char *from = "kiln_init";
    if (n <= 0) n = (int)kiln__env_int(KILN__ENV_NUM_THREADS), from = "KILN_NUM_THREADS";
    n = kiln__pool_threads(n, from);
    kiln__pool_start(n);
    run_providers(true, n);
    if (!n_backends) { /* a build without the cpu room: nothing can run */
        fprintf(stderr, "kiln: no backend was registered at start-up (a build without src/backends/cpu)\n");
        abort();
    }
    atomic_store(&default_be, backends[0]);
    /* KILN_DEVICE picks the device new tensors go to; a name that is not here leaves the
     * cpu, with a warning (tools check it up front with kiln_set_device). */
    const char *dev = kiln__env_str(KILN__ENV_DEVICE);
    if (dev && *dev && strcmp(dev, "cpu")) probe_devices();
    char have[256];
    if (dev && *dev && !find_name(dev))
        fprintf(stderr, "kiln: KILN_DEVICE=%s is not a device here (have: %s); using cpu\n", dev,
                device_list(have, sizeof have));
    else if (dev && *dev)
        atomic_store(&default_be, find_name(dev));
}

void kiln__ensure_init(void) { pthread_once(&init_once, do_init); }

kiln_status kiln_init(int num_threads)
{
    requested_threads = num_threads;
    kiln__ensure_init();
    return KILN_OK;
}

int kiln_num_threads(void)
{
    kiln__ensure_init();
    return kiln__pool_size();
}

const char *kiln_version(void) { return KILN_VERSION; }

const char *kiln_build_info(void)
{
    return "blas="
#if defined(KILN_BLAS_BLIS)
           "BLIS"
#elif defined(KILN_BLAS_OPENBLAS)
           "OpenBLAS"
#else
           "none"
#endif
#if defined(__SANITIZE_ADDRESS__)
           " sanitizers=address,undefined"
#endif
           " simd=avx2+fma (runtime-selected clones), plain C fallback";
}


const char *kiln_device_name(int i)
{
    kiln__backend *be = (kiln__ensure_init(), kiln__backend_at(i));
    return be ? be->name : NULL;
}

const char *kiln_device_describe(int i, char *buf, size_t n)
{
    kiln__backend *be = (kiln__ensure_init(), kiln__backend_at(i));
    kiln__device_info info = {0};
    if (!be || !buf || kiln__be_device_info(be, &info) != KILN_OK) return NULL;
    snprintf(buf, n, "%s: %s, %.1f GiB, %d compute units", be->name, info.description ? info.description : "",
             (double)info.total_memory / (1024.0 * 1024.0 * 1024.0), info.compute_units);
    return buf;
}

static _Thread_local kiln__epilogue *offered; /* kiln__epilogue_offer */

void kiln__epilogue_offer(kiln__epilogue *e) { offered = e; }

kiln__epilogue *kiln__epilogue_take(int64_t rows, int64_t cols)
{
    kiln__epilogue *e = offered;
    offered = NULL;
    return e && e->rows == rows && e->cols == cols ? e : NULL;
}
