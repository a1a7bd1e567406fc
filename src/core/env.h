/* kiln's environment variables: one table (env.def, and a KILN_OPT_<NAME> row per
 * switch of opts.h), read only through these accessors, by id:
 *
 *     int limit = (int)kiln__env_int(KILN__ENV_RECOMPILE_LIMIT); // 8 when unset
 *     if (kiln__env_list_has(KILN__ENV_LOGS, "fusion")) ...
 *
 * Values are read from the environment at each call (tests and tools set them between
 * calls); the switch table caches its own (opts.c). The first read also warns once
 * about each KILN_* variable set in the environment that the table does not have,
 * naming the closest one that it has (a typo guard). */
#ifndef KILN_CORE_ENV_H
#define KILN_CORE_ENV_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "core/opts.h"
#include "kiln/tensor.h"

typedef enum {
#define KILN__ENV(id, type, who, dflt, lo, hi, help) KILN__ENV_##id,
#include "core/env.def"
#undef KILN__ENV
    KILN__ENV_OPT_FIRST, /* then KILN_OPT_<NAME>, one per switch, in kiln__opt_id order */
    KILN__ENV_COUNT = KILN__ENV_OPT_FIRST + KILN__OPT_COUNT
} kiln__env_id;

/* The row of switch o (a kiln__opt_id). */
#define KILN__ENV_OPT(o) ((kiln__env_id)(KILN__ENV_OPT_FIRST + (int)(o)))

typedef enum { KILN__ENVT_BOOL, KILN__ENVT_INT, KILN__ENVT_NUM, KILN__ENVT_STRING, KILN__ENVT_LIST, KILN__ENVT_PATH } kiln__env_type;
typedef enum { KILN__ENVW_LIB, KILN__ENVW_TOOL, KILN__ENVW_TEST } kiln__env_who;

typedef struct {
    const char *name; /* KILN_... */
    kiln__env_type type;
    kiln__env_who who;
    const char *dflt; /* a value of the type, "" (none), or "(a description)" */
    double lo, hi;    /* INT: [lo, hi]; NUM: (lo, hi] */
    const char *help;
} kiln__env_row;

/* Row id of the table; NULL past its end. */
const kiln__env_row *kiln__env_row_at(int id);
/* The id of the variable called name, or -1 when the table has none. */
int kiln__env_find(const char *name);
/* Edit distance between a and b (a typo's distance from a name), capped at 99: the
 * typo guards of the KILN_* variables and of the kiln program's verbs and flags. */
int kiln__edit_distance(const char *a, const char *b);

/* The value as set, NULL when unset or empty (any type). */
const char *kiln__env_str(kiln__env_id id);
/* The value as set, else the row's default when it is a value (not "" or a description). */
const char *kiln__env_text(kiln__env_id id);
/* A typed value: the value as set, else the row's default (0 or false for none). A value
 * that does not parse as the row's type, or is out of its range, is said once on stderr,
 * naming the variable, the value and what it should be, and the default is used. */
int64_t kiln__env_int(kiln__env_id id);
double kiln__env_num(kiln__env_id id);
bool kiln__env_bool(kiln__env_id id);
/* Whether the variable is set to a value of its row's type (nothing said either way). */
bool kiln__env_valid(kiln__env_id id);
/* Whether the comma list of variable id names item. */
bool kiln__env_list_has(kiln__env_id id, const char *item);
/* The next item of comma list *p (advanced past it): its start, its length in *n; NULL
 * at the end. Empty items are skipped. */
const char *kiln__env_list_next(const char **p, size_t *n);
/* KILN_OK when variable id is unset or holds a value of its type and range; else
 * KILN_ERR_ARG, with the variable, its value and what it should be in the last error
 * (for readers that fail on a bad value rather than use the default). */
kiln_status kiln__env_check(kiln__env_id id);
/* The type's name ("bool", "int", "number", "string", "list", "path"). */
const char *kiln__env_type_name(kiln__env_type t);
#endif
