/* Opening files for reading (regular files only, never blocking) and writing them
 * atomically (a temporary beside the target, checked writes, fsync, rename); the
 * rules are in file.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "core/file.h"

/* Messages start with who and a colon when the caller names what the user knows (a flag, a
 * variable, a kind of file); NULL when the path says enough. */
#define WHO(w) (w) ? (w) : "", (w) ? ": " : ""

/* What a path that is not a regular file is, for a message. */
static const char *kind_of(mode_t m)
{
    if (S_ISDIR(m)) return "a directory";
    if (S_ISLNK(m)) return "a symbolic link";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISSOCK(m)) return "a socket";
    return "not a regular file";
}

int kiln__file_open_read(const char *path, const char *who, int64_t *size)
{
    if (!path) return kiln_error(KILN_ERR_ARG, "%s%sthe path is NULL", WHO(who)), -1;
    /* O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return kiln_error(KILN_ERR_IO, "%s%scannot open %s: %s", WHO(who), path, strerror(errno)), -1;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        kiln_error(KILN_ERR_IO, "%s%scannot stat %s: %s", WHO(who), path, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        kiln_error(KILN_ERR_IO, "%s%s%s is %s, not a regular file", WHO(who), path, kind_of(st.st_mode));
        close(fd);
        return -1;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        kiln_error(KILN_ERR_IO, "%s%s%s: %s", WHO(who), path, strerror(errno));
        close(fd);
        return -1;
    }
    if (size) *size = (int64_t)st.st_size;
    return fd;
}

FILE *kiln__file_fopen_read(const char *path, const char *who)
{
    int fd = kiln__file_open_read(path, who, NULL);
    if (fd < 0) return NULL;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        kiln_error(KILN_ERR_IO, "%s%scannot read %s: %s", WHO(who), path, strerror(errno));
        close(fd);
    }
    return f;
}

kiln_status kiln__file_check_regular(const char *path, const char *who)
{
    struct stat st;
    if (!path || stat(path, &st) != 0 || S_ISREG(st.st_mode)) return KILN_OK;
    return kiln_error(KILN_ERR_IO, "%s%s%s is %s, not a regular file", WHO(who), path, kind_of(st.st_mode));
}

kiln_status kiln__file_check_target(const char *path, const char *who)
{
    struct stat st;
    if (!path) return kiln_error(KILN_ERR_ARG, "%s%sthe path is NULL", WHO(who));
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return KILN_OK;
        return kiln_error(KILN_ERR_IO, "%s%scannot write %s: %s", WHO(who), path, strerror(errno));
    }
    if (S_ISREG(st.st_mode)) return KILN_OK;
    if (S_ISLNK(st.st_mode))
        return kiln_error(KILN_ERR_IO, "%s%srefusing to write %s: it is a symbolic link (kiln replaces only regular "
                          "files; name the file it points to)", WHO(who), path);
    return kiln_error(KILN_ERR_IO, "%s%srefusing to write %s: it is %s, not a regular file", WHO(who), path,
                      kind_of(st.st_mode));
}

/* fsync of the folder makes the rename itself durable. */
static kiln_status sync_dir(const char *path, const char *who)
{
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    if (!dir) return kiln_error(KILN_ERR_OOM, "%s%sout of memory", WHO(who));
    kiln_status s = KILN_OK;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    /* Some file systems cannot fsync a folder (EINVAL); the file itself is safe. */
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL))
        s = kiln_error(KILN_ERR_IO, "%s%s%s was written, but syncing its folder %s failed: %s", WHO(who), path, dir,
                       strerror(errno));
    if (fd >= 0) close(fd);
    free(dir);
    return s;
}

static void afile_free(kiln__afile *a)
{
    free(a->path);
    free(a->tmp);
    a->path = a->tmp = NULL;
    a->fd = -1;
}

kiln_status kiln__afile_begin(kiln__afile *a, const char *path, const char *who)
{
    static atomic_uint calls;
    *a = (kiln__afile){.fd = -1, .who = who};
    kiln_status s = kiln__file_check_target(path, a->who);
    if (s != KILN_OK) return s;
    size_t n = strlen(path) + 48;
    if (!(a->path = strdup(path)) || !(a->tmp = malloc(n))) {
        afile_free(a);
        return kiln_error(KILN_ERR_OOM, "%s%sout of memory", WHO(a->who));
    }
    /* a name of this process and call, created exclusively (never through a link) */
    for (int tries = 0; a->fd < 0 && tries < 16; tries++) {
        snprintf(a->tmp, n, "%s.tmp.%ld.%u", path, (long)getpid(), atomic_fetch_add(&calls, 1));
        a->fd = open(a->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
        if (a->fd < 0 && errno != EEXIST) break;
    }
    if (a->fd < 0) {
        s = kiln_error(KILN_ERR_IO, "%s%scannot write %s: cannot create %s: %s", WHO(a->who), path, a->tmp, strerror(errno));
        afile_free(a);
    }
    return s;
}

kiln_status kiln__afile_write(kiln__afile *a, const void *p, size_t n)
{
    const char *c = p;
    if (a->fd < 0) return kiln_error(KILN_ERR_IO, "%s%scannot write %s: the file is not open", WHO(a->who), a->path);
    while (n) {
        ssize_t k = write(a->fd, c, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            a->err = k < 0 ? errno : ENOSPC; /* a write of nothing is a full device */
            kiln_status s = kiln_error(KILN_ERR_IO, "%s%scannot write %s: %s", WHO(a->who), a->path, strerror(a->err));
            close(a->fd);
            a->fd = -1; /* commit fails, abort cleans up */
            return s;
        }
        c += k;
        n -= (size_t)k;
    }
    return KILN_OK;
}

kiln_status kiln__afile_commit(kiln__afile *a)
{
    kiln_status s = KILN_OK;
    if (a->fd < 0)
        s = kiln_error(KILN_ERR_IO, "%s%scannot write %s: %s", WHO(a->who), a->path, strerror(a->err ? a->err : EBADF));
    else if (fsync(a->fd) != 0)
        s = kiln_error(KILN_ERR_IO, "%s%scannot write %s: fsync failed: %s", WHO(a->who), a->path, strerror(errno));
    if (a->fd >= 0 && close(a->fd) != 0 && s == KILN_OK)
        s = kiln_error(KILN_ERR_IO, "%s%scannot write %s: close failed: %s", WHO(a->who), a->path, strerror(errno));
    a->fd = -1;
    /* the target again: it may have become something else while we wrote */
    if (s == KILN_OK) s = kiln__file_check_target(a->path, a->who);
    if (s == KILN_OK && rename(a->tmp, a->path) != 0)
        s = kiln_error(KILN_ERR_IO, "%s%scannot put %s in place: %s", WHO(a->who), a->path, strerror(errno));
    if (s != KILN_OK) unlink(a->tmp);
    else s = sync_dir(a->path, a->who);
    afile_free(a);
    return s;
}

void kiln__afile_abort(kiln__afile *a)
{
    if (a->fd >= 0) close(a->fd);
    if (a->tmp) unlink(a->tmp);
    afile_free(a);
}

kiln_status kiln__file_write_atomic(const char *path, const void *p, size_t n, const char *who)
{
    kiln__afile a;
    kiln_status s = kiln__afile_begin(&a, path, who);
    if (s != KILN_OK) return s;
    s = kiln__afile_write(&a, p, n);
    if (s != KILN_OK) {
        kiln__afile_abort(&a);
        return s;
    }
    return kiln__afile_commit(&a);
}

kiln_status kiln__file_place(const char *tmp, const char *path, const char *who)
{
    kiln_status s = kiln__file_check_target(path, who);
    if (s == KILN_OK && rename(tmp, path) != 0)
        s = kiln_error(KILN_ERR_IO, "%s%scannot put %s in place: %s", WHO(who), path, strerror(errno));
    if (s != KILN_OK) unlink(tmp);
    return s;
}

int kiln__file_open_append(const char *path, const char *who)
{
    if (kiln__file_check_target(path, who) != KILN_OK) return -1;
    int fd = open(path, O_RDWR | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0666);
    if (fd < 0) return kiln_error(KILN_ERR_IO, "%s%scannot open %s: %s", WHO(who), path, strerror(errno)), -1;
    struct stat st;
    int fl = fcntl(fd, F_GETFL);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        kiln_error(KILN_ERR_IO, "%s%srefusing to write %s: it is not a regular file", WHO(who), path);
        close(fd);
        return -1;
    }
    return fd;
}

bool kiln__file_same(const char *a, const char *b)
{
    struct stat x, y;
    return a && b && stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}
