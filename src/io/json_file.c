/* JSON files: opened only when regular (core/file.c), read whole, parsed by jansson
 * (json_file.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "core/file.h"
#include "io/json_file.h"

bool kiln__path_exists(const char *path)
{
    struct stat st;
    return path && lstat(path, &st) == 0;
}

/* err as jansson leaves it for a file it could not read: line -1, the reason in text. */
static json_t *unread(json_error_t *err, const char *path)
{
    memset(err, 0, sizeof *err);
    err->line = err->column = -1;
    snprintf(err->text, sizeof err->text, "%s", kiln_last_error());
    snprintf(err->source, sizeof err->source, "%s", path ? path : "");
    return NULL;
}

json_t *kiln__json_load(const char *path, size_t flags, json_error_t *err, const char *who)
{
    json_error_t local;
    if (!err) err = &local;
    int64_t size = 0;
    int fd = kiln__file_open_read(path, who, &size);
    if (fd < 0) return unread(err, path);
    if ((size_t)size > KILN__JSON_FILE_MAX) {
        close(fd);
        kiln_error(KILN_ERR_FORMAT, "%s: %lld bytes is more than the %zu MiB a JSON file may have", path,
                   (long long)size, KILN__JSON_FILE_MAX >> 20);
        return unread(err, path);
    }
    size_t n = (size_t)size, got = 0;
    char *buf = malloc(n + 1);
    if (!buf) {
        close(fd);
        kiln_error(KILN_ERR_OOM, "%s: out of memory reading it", path);
        return unread(err, path);
    }
    while (got < n) { /* (a file that shrank while read is parsed as far as it went) */
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    int e = errno;
    close(fd);
    json_t *root = NULL;
    if (got == 0 && n > 0) kiln_error(KILN_ERR_IO, "%s: cannot read it: %s", path, strerror(e));
    else if (got == 0) kiln_error(KILN_ERR_FORMAT, "%s: the file is empty", path);
    else if (got >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3))
        kiln_error(KILN_ERR_FORMAT, "%s: starts with a UTF-8 byte-order mark, which JSON does not allow", path);
    else if (!(root = json_loadb(buf, got, flags, err)))
        kiln_error(KILN_ERR_FORMAT, "%s: line %d, column %d: %s", path, err->line, err->column, err->text);
    free(buf);
    if (!root && err->line == 0) unread(err, path); /* (not jansson's own error: say so as it would) */
    return root;
}
