/* Allocation fault injection in SQLite's manner: the program is linked with
 * -Wl,--wrap for every allocation function (tests/fault/tests.cmake), so that each of
 * kiln's allocations (and jansson's, routed here by json_set_alloc_funcs) passes through
 * fault_tick(). Armed with fault_arm(n), the nth allocation from then on fails (returns
 * NULL) and the others succeed; fault_count() says how many there were. Written by hand:
 * no Debian library injects failures into a static library's own calls. */
#include <execinfo.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include "fault_alloc.h"

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
char *__real_strdup(const char *s);
char *__real_strndup(const char *s, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
int __real_posix_memalign(void **p, size_t align, size_t n);

static atomic_long counted, fail_at; /* fail_at 0: none armed */
static atomic_bool failed;

void fault_arm(long n)
{
    atomic_store(&counted, 0);
    atomic_store(&failed, false);
    atomic_store(&fail_at, n);
}

long fault_count(void) { return atomic_load(&counted); }
bool fault_fired(void) { return atomic_load(&failed); }

/* Whether this allocation is the one to fail. */
static bool tick(void)
{
    long n = atomic_fetch_add(&counted, 1) + 1, at = atomic_load(&fail_at);
    if (at > 0 && n == at) {
        atomic_store(&failed, true);
        if (getenv("FAULT_TRACE")) { /* where the failing allocation was asked for */
            void *frames[24];
            backtrace_symbols_fd(frames, backtrace(frames, 24), 2);
        }
        return true;
    }
    return false;
}

void *__wrap_malloc(size_t n) { return tick() ? NULL : __real_malloc(n); }
void *__wrap_calloc(size_t n, size_t size) { return tick() ? NULL : __real_calloc(n, size); }
/* (a failed realloc leaves p as it was, as the real one does) */
void *__wrap_realloc(void *p, size_t n) { return tick() ? NULL : __real_realloc(p, n); }
char *__wrap_strdup(const char *s) { return tick() ? NULL : __real_strdup(s); }
char *__wrap_strndup(const char *s, size_t n) { return tick() ? NULL : __real_strndup(s, n); }
void *__wrap_aligned_alloc(size_t align, size_t n) { return tick() ? NULL : __real_aligned_alloc(align, n); }
int __wrap_posix_memalign(void **p, size_t align, size_t n) { return tick() ? 12 /* ENOMEM */ : __real_posix_memalign(p, align, n); }

/* For jansson (a shared library, which --wrap does not reach), unless fault_json(false). */
static atomic_bool json_faults = true;
void fault_json(bool on) { atomic_store(&json_faults, on); }
void *fault_json_malloc(size_t n) { return atomic_load(&json_faults) ? __wrap_malloc(n) : __real_malloc(n); }
