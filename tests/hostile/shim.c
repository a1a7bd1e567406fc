/* An LD_PRELOAD module for tests/hostile/test_files.py: a disk that fills up, and a
 * file that is slow to open.
 *
 * A full disk: write()
 * to a file whose path contains $FULL_DISK_MATCH succeeds for the first
 * $FULL_DISK_BYTES bytes (default 0) of the process's writes to such files, then fails
 * with ENOSPC, as a full file system does; with FULL_DISK_FSYNC=1 it is fsync() on such
 * a file that fails (EIO), as on a device that lost the data. Other files are not
 * touched. (glibc's own stdio writes do not come through here: the module checks what
 * kiln writes with write() and fsync(), core/file.c's way.)
 *
 * A slow file: open() of a path that contains $SLOW_OPEN_MATCH first sleeps
 * $SLOW_OPEN_MS milliseconds (default 30000), as a file on a hung network mount does:
 * a start-up that is stuck, for the signal cases. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static size_t written;

static int matches(int fd)
{
    const char *m = getenv("FULL_DISK_MATCH");
    char link[64], path[4096];
    if (!m || !*m) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) return 0;
    path[n] = 0;
    return strstr(path, m) != NULL;
}

ssize_t write(int fd, const void *p, size_t n)
{
    typedef ssize_t (*real_fn)(int, const void *, size_t);
    static real_fn real;
    if (!real) real = (real_fn)dlsym(RTLD_NEXT, "write");
    if (!getenv("FULL_DISK_FSYNC") && matches(fd)) {
        const char *b = getenv("FULL_DISK_BYTES");
        size_t room = b ? (size_t)atoll(b) : 0, left = written < room ? room - written : 0;
        if (!left) {
            errno = ENOSPC;
            return -1;
        }
        if (n > left) n = left; /* a short write, then ENOSPC on the next */
        ssize_t k = real(fd, p, n);
        if (k > 0) written += (size_t)k;
        return k;
    }
    return real(fd, p, n);
}

int fsync(int fd)
{
    typedef int (*real_fn)(int);
    static real_fn real;
    if (!real) real = (real_fn)dlsym(RTLD_NEXT, "fsync");
    if (getenv("FULL_DISK_FSYNC") && matches(fd)) {
        errno = EIO;
        return -1;
    }
    return real(fd);
}

static void slow(const char *path)
{
    const char *m = getenv("SLOW_OPEN_MATCH"), *ms = getenv("SLOW_OPEN_MS");
    if (!m || !*m || !path || !strstr(path, m)) return;
    long wait = ms ? atol(ms) : 30000;
    struct timespec t = {wait / 1000, (wait % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {}
}

#define OPEN_SHIM(name)                                                      \
    int name(const char *path, int flags, ...)                               \
    {                                                                        \
        typedef int (*real_fn)(const char *, int, ...);                      \
        static real_fn real;                                                 \
        if (!real) real = (real_fn)dlsym(RTLD_NEXT, #name);                  \
        va_list ap;                                                          \
        va_start(ap, flags);                                                 \
        int mode = flags & (O_CREAT | O_TMPFILE) ? va_arg(ap, int) : 0;      \
        va_end(ap);                                                          \
        slow(path);                                                          \
        return real(path, flags, mode);                                      \
    }
OPEN_SHIM(open)
OPEN_SHIM(open64)
