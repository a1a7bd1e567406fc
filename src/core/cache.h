/* The kernel cache on disk (src/core/cache.c), shared by the compiler and backends. */
#ifndef KILN_CORE_CACHE_H
#define KILN_CORE_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "core/tensor_impl.h"

#define KILN__FNV_SEED 1469598103934665603ULL
/* FNV-1a over n bytes, continuing from h (start from KILN__FNV_SEED). */
uint64_t kiln__fnv(uint64_t h, const void *p, size_t n);
/* Writes n bytes to path through a temporary name of this process, renamed into place
 * (kiln__file_write_atomic, core/file.h): a reader (or another process writing the same
 * file) sees a whole file or the one before. False when it could not (nothing is left
 * behind then, and the error is set). */
bool kiln__write_whole(const char *path, const void *p, size_t n);
/* mkdir -p; 0 or -1 with errno. */
int kiln__make_dirs(const char *path);
/* $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln, then /sub (if any):
 * made if missing, into out. */
kiln_status kiln__cache_dir(const char *sub, char *out, size_t n);

#endif
