/* JSON files: opened only when regular, read whole, parsed by jansson (json_file.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "io/json_file.h"

static const char *kind_of(mode_t m)
{
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO" : S_ISCHR(m) ? "a character device"
           : S_ISBLK(m) ? "a block device" : S_ISSOCK(m) ? "a socket" : "something else";
}

bool kiln__path_exists(const char *path)
{
    struct stat st;
    return path && lstat(path, &st) == 0;
}

kiln_status kiln__json_load(const char *path, size_t flags, json_t **out)
{
    *out = NULL;
    /* O_NONBLOCK: opening a FIFO with no writer would wait for one forever */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return kiln_error(KILN_ERR_IO, "%s: cannot open it: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kiln_error(KILN_ERR_IO, "%s: cannot read it: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kiln_error(KILN_ERR_IO, "%s: cannot read it: it is %s, not a file", path, kind_of(st.st_mode));
    }
    if ((size_t)st.st_size > KILN__JSON_FILE_MAX) {
        close(fd);
        return kiln_error(KILN_ERR_FORMAT, "%s: %lld bytes is more than the %zu MiB a JSON file may have", path,
                          (long long)st.st_size, KILN__JSON_FILE_MAX >> 20);
    }
    size_t n = (size_t)st.st_size, got = 0;
    char *buf = malloc(n + 1);
    if (!buf) {
        close(fd);
        return kiln_error(KILN_ERR_OOM, "%s: out of memory reading it", path);
    }
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break; /* (a file that shrank while read: parsed as far as it went) */
        got += (size_t)r;
    }
    int e = errno;
    close(fd);
    if (got == 0 && n > 0) {
        free(buf);
        return kiln_error(KILN_ERR_IO, "%s: cannot read it: %s", path, strerror(e));
    }
    kiln_status s = KILN_OK;
    if (got >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3))
        s = kiln_error(KILN_ERR_FORMAT, "%s: starts with a UTF-8 byte-order mark, which JSON does not allow", path);
    json_error_t je;
    if (s == KILN_OK && !(*out = json_loadb(buf, got, flags, &je))) {
        if (got == 0) s = kiln_error(KILN_ERR_FORMAT, "%s: the file is empty", path);
        else
            s = kiln_error(KILN_ERR_FORMAT, "%s: line %d, column %d: %s", path, je.line, je.column, je.text);
    }
    free(buf);
    return s;
}
