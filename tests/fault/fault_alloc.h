#ifndef KILN_TESTS_FAULT_ALLOC_H
#define KILN_TESTS_FAULT_ALLOC_H
#include <stdbool.h>
#include <stddef.h>
/* Counts allocations from now on; the nth fails (n 0: none). */
void fault_arm(long n);
/* Allocations since the last fault_arm. */
long fault_count(void);
/* Whether the armed one has failed. */
bool fault_fired(void);
void *fault_json_malloc(size_t n);
/* Whether jansson's allocations are counted and failed too (true at first). */
void fault_json(bool on);
#endif
