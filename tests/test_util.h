/* Shared test fixture: every test runs inside a scope with a clear error, so that
 * LeakSanitizer sees nothing left at exit. */
#ifndef KILN_TEST_UTIL_H
#define KILN_TEST_UTIL_H
#include "kiln/tensor.h"

static int setup(void **state)
{
    (void)state;
    kiln_clear_error();
    kiln_scope_begin();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kiln_scope_end();
    return 0;
}
#endif
