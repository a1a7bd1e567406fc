/* What the file-parser fuzz targets share: the input written to a file of its own (the
 * parsers take paths, as users give them), in memory-backed /dev/shm where it exists. */
#ifndef KILN_FUZZ_COMMON_H
#define KILN_FUZZ_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* dir/sub/name in a folder of this process's (sub made when missing): each mode of a
 * target has a folder of its own, so that one input's files never meet another's. */
static const char *fuzz_path(const char *sub, const char *name)
{
    static char dir[256], path[400];
    if (!*dir) {
        snprintf(dir, sizeof dir, "%s/kiln-fuzz-%d", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", (int)getpid());
        mkdir(dir, 0700);
    }
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    mkdir(path, 0700);
    snprintf(path, sizeof path, "%s/%s/%s", dir, sub, name);
    return path;
}

/* Writes data[0..size) to dir/sub/name; returns its path. Traps when it cannot (a
 * broken harness, not a finding). */
static const char *fuzz_write(const char *sub, const char *name, const uint8_t *data, size_t size)
{
    const char *p = fuzz_path(sub, name);
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) __builtin_trap();
    return p;
}

#endif
