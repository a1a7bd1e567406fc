/* A JSON file loaded only if it is a regular file (io/json_file.h). */
#include <stdio.h>
#include <string.h>
#include "core/file.h"
#include "io/json_file.h"

json_t *kiln__json_load(const char *path, size_t flags, json_error_t *err, const char *who)
{
    json_error_t local;
    if (!err) err = &local;
    FILE *f = kiln__file_fopen_read(path, who);
    if (!f) {
        memset(err, 0, sizeof *err);
        err->line = err->column = -1;
        snprintf(err->text, sizeof err->text, "%s", kiln_last_error());
        snprintf(err->source, sizeof err->source, "%s", path ? path : "");
        return NULL;
    }
    json_t *root = json_loadf(f, flags, err);
    fclose(f);
    if (!root) kiln_error(KILN_ERR_FORMAT, "%s: %s: line %d: %s", who, path, err->line, err->text);
    return root;
}
