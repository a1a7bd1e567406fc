/* JSON files read the same way everywhere (config.json, tokenizer_config.json, run.json,
 * languages.json, option files): only a regular file is opened (a FIFO, a device or a
 * directory is refused without blocking on it), its size is bounded, and a parse error
 * keeps its line and column, with a UTF-8 byte-order mark named as such. */
#ifndef KILN_IO_JSON_FILE_H
#define KILN_IO_JSON_FILE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include "kiln/kiln.h"

/* The largest JSON file read whole: tokenizer_config.json files of real models run to a
 * few MiB (added tokens), configs to a few KiB. */
#define KILN__JSON_FILE_MAX ((size_t)256 << 20)

/* Parses the file at path into *out (a new reference; the caller decrefs). flags are
 * jansson's decoding flags. Errors: KILN_ERR_IO when it cannot be opened or read, or is
 * not a regular file (the message says what it is); KILN_ERR_FORMAT for bad JSON, with
 * the file, line and column and the parser's reason. *out is NULL on failure. */
kiln_status kiln__json_load(const char *path, size_t flags, json_t **out);

/* Whether path exists in any form (a dangling or looping link included). */
bool kiln__path_exists(const char *path);

#endif
