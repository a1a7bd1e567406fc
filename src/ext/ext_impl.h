/* Private pieces of the ext room shared by lang.c (the languages, their commands) and
 * build.c (kiln_ext_build). */
#ifndef KILN_EXT_IMPL_H
#define KILN_EXT_IMPL_H
#include <stdbool.h>
#include <stddef.h>

/* Appends s to the growing NUL-terminated buffer (*b, *n bytes, *cap allocated), quoted
 * for the shell ('...', each ' written '\'') when quoted. False when out of memory. */
bool kiln__ext_append(char **b, size_t *n, size_t *cap, const char *s, bool quoted);

#endif
