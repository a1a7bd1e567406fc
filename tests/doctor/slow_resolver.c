/* An LD_PRELOAD module for tests/doctor/test_doctor.py: getaddrinfo of a name sleeps
 * SLOW_RESOLVER_MS milliseconds (default 1500) before the real look-up, as a resolver
 * that waits on an unreachable DNS server does. A numeric address is not delayed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <stdlib.h>
#include <time.h>

int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints, struct addrinfo **res)
{
    typedef int (*real_fn)(const char *, const char *, const struct addrinfo *, struct addrinfo **);
    real_fn real = (real_fn)dlsym(RTLD_NEXT, "getaddrinfo");
    if (!real) return EAI_FAIL;
    const char *ms = getenv("SLOW_RESOLVER_MS");
    long wait = ms ? atol(ms) : 1500;
    if (node && wait > 0) {
        struct timespec t = {wait / 1000, (wait % 1000) * 1000000L};
        while (nanosleep(&t, &t) != 0) {}
    }
    return real(node, service, hints, res);
}
