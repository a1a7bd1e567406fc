/* The environment table (env.def and the switch table) and its accessors: the one
 * place that calls getenv for a KILN_* variable (tests/test_env.c checks). */
#include "core/env.h"
#include "core/parse.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

extern char **environ;

static const kiln__env_row rows[] = {
#define KILN__ENV(id, type, who, dflt, lo, hi, help) {"KILN_" #id, KILN__ENVT_##type, KILN__ENVW_##who, dflt, lo, hi, help},
#include "core/env.def"
#undef KILN__ENV
#define OPT_ROW(name, dflt, help)                                                                  \
    {"KILN_OPT_" #name, KILN__ENVT_BOOL, KILN__ENVW_LIB, (dflt) < 0 ? "(auto)" : (dflt) ? "1" : "0", 0, 0, help},
    KILN__OPTS(OPT_ROW) KILN__COMPILE_STAGES(OPT_ROW)
#undef OPT_ROW
};
_Static_assert(sizeof rows / sizeof rows[0] == KILN__ENV_COUNT, "one row per id: env.def and the switch table");

static atomic_bool warned[KILN__ENV_COUNT]; /* a bad value is said once per variable */
static pthread_once_t scan_once = PTHREAD_ONCE_INIT;

const kiln__env_row *kiln__env_row_at(int id) { return id >= 0 && id < KILN__ENV_COUNT ? &rows[id] : NULL; }

int kiln__env_find(const char *name)
{
    for (int i = 0; name && i < KILN__ENV_COUNT; i++)
        if (!strcmp(rows[i].name, name)) return i;
    return -1;
}

const char *kiln__env_type_name(kiln__env_type t)
{
    static const char *const names[] = {"bool", "int", "number", "string", "list", "path"};
    return t >= 0 && t <= KILN__ENVT_PATH ? names[t] : "?";
}

static const char *who_name(kiln__env_who w)
{
    static const char *const names[] = {"library", "kiln program", "tests"};
    return w >= 0 && w <= KILN__ENVW_TEST ? names[w] : "?";
}

int kiln__edit_distance(const char *a, const char *b)
{
    size_t n = strlen(b);
    if (n > 98) return 99;
    int row[100];
    for (size_t j = 0; j <= n; j++) row[j] = (int)j;
    for (size_t i = 1; a[i - 1]; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= n; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[n] > 99 ? 99 : row[n];
}

/* The typo guard: each KILN_* variable in the environment that no row names, said once,
 * with the closest name that a row has when it is a few edits away. */
static void scan_environment(void)
{
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, "KILN_", 5)) continue;
        const char *eq = strchr(*e, '=');
        size_t len = eq ? (size_t)(eq - *e) : strlen(*e);
        char name[128];
        if (len >= sizeof name) len = sizeof name - 1;
        memcpy(name, *e, len);
        name[len] = 0;
        if (kiln__env_find(name) >= 0) continue;
        int best = -1, d = 99;
        for (int i = 0; i < KILN__ENV_COUNT; i++) {
            int di = kiln__edit_distance(name, rows[i].name);
            if (di < d) d = di, best = i;
        }
        if (best >= 0 && d <= 3)
            fprintf(stderr, "kiln: %s is set, but kiln reads no such variable; did you mean %s? (kiln doctor --env lists them)\n",
                    name, rows[best].name);
        else
            fprintf(stderr, "kiln: %s is set, but kiln reads no such variable (kiln doctor --env lists them)\n", name);
    }
}

const char *kiln__env_str(kiln__env_id id)
{
    pthread_once(&scan_once, scan_environment);
    if (id < 0 || id >= KILN__ENV_COUNT) return NULL;
    const char *v = getenv(rows[id].name);
    return v && *v ? v : NULL;
}

static bool default_is_value(const kiln__env_row *r) { return *r->dflt && *r->dflt != '('; }

const char *kiln__env_text(kiln__env_id id)
{
    const char *v = kiln__env_str(id);
    if (v) return v;
    return id >= 0 && id < KILN__ENV_COUNT && default_is_value(&rows[id]) ? rows[id].dflt : NULL;
}

/* Parses s as row r's type into *num (bools as 0/1); false when it is not one, with
 * what it should be in expect. Strings, lists and paths are always values. */
static bool parse(const kiln__env_row *r, const char *s, double *num, char *expect, size_t n)
{
    switch (r->type) {
    case KILN__ENVT_BOOL:
        snprintf(expect, n, "0 or 1 (true/false, on/off, yes/no)");
        for (int i = 0; i < 2; i++) {
            static const char *const words[2][4] = {{"0", "false", "off", "no"}, {"1", "true", "on", "yes"}};
            for (int j = 0; j < 4; j++)
                if (!strcasecmp(s, words[i][j])) return *num = i, true;
        }
        return false;
    case KILN__ENVT_INT: { /* core/parse.h's syntax: the whole text, decimal, in int64 */
        snprintf(expect, n, "a whole number from %.0f to %.0f", r->lo, r->hi);
        int64_t v = 0;
        bool ok = kiln__scan_i64(s, &v);
        *num = (double)v;
        return ok && *num >= r->lo && *num <= r->hi;
    }
    case KILN__ENVT_NUM: {
        snprintf(expect, n, "a number above %g, at most %g", r->lo, r->hi);
        bool ok = kiln__scan_f64(s, num);
        return ok && *num > r->lo && *num <= r->hi;
    }
    default:
        *num = 0;
        return true;
    }
}

/* The value of a typed variable as a number: as set, else the default (0 for none). */
static double typed(kiln__env_id id)
{
    const char *v = kiln__env_str(id);
    if (id < 0 || id >= KILN__ENV_COUNT) return 0;
    const kiln__env_row *r = &rows[id];
    double x, d = 0;
    char expect[96];
    if (default_is_value(r) && !parse(r, r->dflt, &d, expect, sizeof expect)) d = 0;
    if (!v) return d;
    if (parse(r, v, &x, expect, sizeof expect)) return x;
    if (!atomic_exchange(&warned[id], true)) {
        if (default_is_value(r))
            fprintf(stderr, "kiln: %s='%s' is not %s; using %s\n", r->name, v, expect, r->dflt);
        else
            fprintf(stderr, "kiln: %s='%s' is not %s; ignored\n", r->name, v, expect);
    }
    return d;
}

int64_t kiln__env_int(kiln__env_id id) { return (int64_t)typed(id); }
double kiln__env_num(kiln__env_id id) { return typed(id); }
bool kiln__env_bool(kiln__env_id id) { return typed(id) != 0; }

const char *kiln__env_list_next(const char **p, size_t *n)
{
    while (**p == ',') ++*p;
    if (!**p) return NULL;
    const char *item = *p, *e = strchr(item, ',');
    *n = e ? (size_t)(e - item) : strlen(item);
    *p = item + *n;
    return item;
}

bool kiln__env_list_has(kiln__env_id id, const char *item)
{
    const char *p = kiln__env_str(id), *it;
    size_t n, want = strlen(item);
    if (!p) return false;
    while ((it = kiln__env_list_next(&p, &n)))
        if (n == want && !strncmp(it, item, n)) return true;
    return false;
}

bool kiln__env_valid(kiln__env_id id)
{
    const char *v = kiln__env_str(id);
    double x;
    char expect[96];
    return v && parse(&rows[id], v, &x, expect, sizeof expect);
}

kiln_status kiln__env_check(kiln__env_id id)
{
    const char *v = kiln__env_str(id);
    if (!v) return KILN_OK;
    double x;
    char expect[96];
    if (parse(&rows[id], v, &x, expect, sizeof expect)) return KILN_OK;
    return kiln_error(KILN_ERR_ARG, "%s='%s' is not %s", rows[id].name, v, expect);
}

/* ---- the public listing and lookup (kiln/tensor.h) ---- */

int kiln_env_count(void) { return KILN__ENV_COUNT; }

bool kiln_env_var_at(int i, kiln_env_var *out)
{
    const kiln__env_row *r = kiln__env_row_at(i);
    if (!r || !out) return false;
    *out = (kiln_env_var){r->name, kiln__env_type_name(r->type), who_name(r->who), r->dflt, r->help,
                          kiln__env_str((kiln__env_id)i)};
    return true;
}

static int known(const char *name)
{
    int id = kiln__env_find(name);
    if (id < 0) kiln_error(KILN_ERR_ARG, "no environment variable %s in kiln's table (kiln doctor --env lists them)",
                          name ? name : "(null)");
    return id;
}

const char *kiln_env(const char *name)
{
    int id = known(name);
    return id < 0 ? NULL : kiln__env_str((kiln__env_id)id);
}

const char *kiln_env_or_default(const char *name)
{
    int id = known(name);
    return id < 0 ? NULL : kiln__env_text((kiln__env_id)id);
}

kiln_status kiln_env_check(const char *name)
{
    int id = known(name);
    return id < 0 ? KILN_ERR_ARG : kiln__env_check((kiln__env_id)id);
}
