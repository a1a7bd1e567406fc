/* The on-disk cache kiln keeps for compiled kernels (generated C as shared objects,
 * OpenCL program binaries): where it is, and the hash that names its files. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "core/cache.h"
#include "core/env.h"
#include "core/file.h"

uint64_t kiln__fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ULL;
    return h;
}

bool kiln__write_whole(const char *path, const void *p, size_t n)
{
    return kiln__file_write_atomic(path, p, n, "the kernel cache") == KILN_OK;
}

int kiln__make_dirs(const char *path)
{
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -1;
            *p = '/';
        }
    return mkdir(tmp, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

void kiln_cache_dir(char *buf, size_t n)
{
    const char *d = kiln__env_str(KILN__ENV_CACHE_DIR), *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
    if (!buf || !n) return;
    if (d) snprintf(buf, n, "%s", d);
    else if (x && *x) snprintf(buf, n, "%s/kiln", x);
    else if (h && *h) snprintf(buf, n, "%s/.cache/kiln", h);
    else snprintf(buf, n, "/tmp/kiln-cache-%d", (int)getuid());
}

kiln_status kiln__cache_dir(const char *sub, char *out, size_t n)
{
    char base[900];
    kiln_cache_dir(base, sizeof base);
    if (sub && *sub) snprintf(out, n, "%s/%s", base, sub);
    else snprintf(out, n, "%s", base);
    if (kiln__make_dirs(out) != 0)
        return kiln__err(KILN_ERR_IO, "cannot make the kernel cache dir %s: %s (set KILN_CACHE_DIR)", out, strerror(errno));
    return KILN_OK;
}
