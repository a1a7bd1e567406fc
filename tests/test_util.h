/* Shared test fixture: every test runs inside a scope with a clear error, so that
 * LeakSanitizer sees nothing left at exit. */
#ifndef KILN_TEST_UTIL_H
#define KILN_TEST_UTIL_H
#include <stdio.h>
#include "kiln/tensor.h"

static inline int setup(void **state)
{
    (void)state;
    kiln_clear_error();
    kiln_scope_begin();
    return 0;
}

static inline int teardown(void **state)
{
    (void)state;
    kiln_scope_end();
    return 0;
}
/* Reads up to n - 1 bytes of the file at path into buf, NUL-terminated; false if the
 * file cannot be opened. */
static inline bool test_read_text(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    buf[fread(buf, 1, n - 1, f)] = 0;
    fclose(f);
    return true;
}
#endif
