/* JSON files read the same way everywhere (config.json, tokenizer_config.json, shard
 * indexes, run.json, languages.json, option files): through core's regular-file check
 * (core/file.h: a FIFO, a device or a directory is refused without blocking on it),
 * read whole, and parsed by jansson; a parse error keeps its line and column, and an
 * empty file or a UTF-8 byte-order mark is named as such. jansson's json_load_file would
 * block on a FIFO and read a device. */
#ifndef KILN_IO_JSON_FILE_H
#define KILN_IO_JSON_FILE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include "kiln/kiln.h"

/* The largest JSON file read whole: tokenizer_config.json files of real models run to a
 * few MiB (added tokens), configs to a few KiB. */
#define KILN__JSON_FILE_MAX ((size_t)256 << 20)

/* json_load_file(path, flags, err) for a regular file only. NULL on failure, with
 * kiln's error set ("WHO: PATH is a FIFO, not a regular file"; "PATH: line L, column C:
 * the parser's reason"), and err (may be NULL) filled as jansson fills it (line -1 when
 * the file could not be opened or read: then err->text is the reason). */
json_t *kiln__json_load(const char *path, size_t flags, json_error_t *err, const char *who);

/* Whether path exists in any form (a dangling or looping link included). */
bool kiln__path_exists(const char *path);

#endif
