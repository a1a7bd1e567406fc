/* Reading a JSON file through core's regular-file check (src/io/json_file.c), for every
 * room that loads one (configs, indexes, run.json, languages.json): jansson's
 * json_load_file would block on a FIFO and read a device. */
#ifndef KILN_IO_JSON_FILE_H
#define KILN_IO_JSON_FILE_H

#include <jansson.h>

/* json_load_file(path, flags, err) for a regular file only. NULL on failure, with
 * kiln's error set ("WHO: PATH is a FIFO, not a regular file", or the parse error with
 * its line) and err (may be NULL) filled as jansson fills it (line -1 when the file
 * could not be opened: then err->text is the reason). */
json_t *kiln__json_load(const char *path, size_t flags, json_error_t *err, const char *who);

#endif
