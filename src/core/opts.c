#include <assert.h>
#include <ctype.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "core/env.h"
#include "core/opts.h"
#include "kiln/tensor.h"

/* Switch i's row of the environment table (env.c): KILN_OPT_<name>, its help, its default. */
static const kiln__env_row *row(int i) { return kiln__env_row_at(KILN__ENV_OPT(i)); }
static const char *name_of(int i) { return row(i)->name + strlen("KILN_OPT_"); }

static bool value[KILN__OPT_COUNT];
static pthread_once_t once = PTHREAD_ONCE_INIT;
static atomic_bool warned_disable; /* an unknown name in KILN_COMPILE_DISABLE is said once */

static bool (*auto_fn[KILN__OPT_COUNT])(void); /* what decides an auto switch left unset */

#define KILN__OPT_AUTO(name, dflt, help) [KILN__OPT_##name] = (dflt) < 0,
static const bool is_auto[KILN__OPT_COUNT] = {KILN__OPTS(KILN__OPT_AUTO) KILN__COMPILE_STAGES(KILN__OPT_AUTO)};
#undef KILN__OPT_AUTO

/* The compiler's stages are read each time and never auto. */
#define KILN__OPT_NOT_AUTO(name, dflt, help) _Static_assert((dflt) >= 0, "stage " #name " cannot be auto");
KILN__COMPILE_STAGES(KILN__OPT_NOT_AUTO)
#undef KILN__OPT_NOT_AUTO

bool kiln__opt_is_auto(kiln__opt_id id) { return (int)id >= 0 && id < KILN__OPT_COUNT && is_auto[id]; }

static atomic_bool was_read; /* the switches have been read: a later kiln__opt_auto is too late */

void kiln__opt_auto(kiln__opt_id id, bool (*fn)(void))
{
    assert(kiln__opt_is_auto(id) && (int)id < KILN__OPT_FIRST_STAGE && !atomic_load(&was_read));
    if (kiln__opt_is_auto(id)) auto_fn[id] = fn;
}

static void read_env(void)
{
    atomic_store(&was_read, true);
    for (int i = 0; i < KILN__OPT_FIRST_STAGE; i++) {
        /* an auto switch set to no bool is said ("ignored") and stays auto */
        bool as_set = kiln__env_bool(KILN__ENV_OPT(i));
        value[i] = is_auto[i] && !kiln__env_valid(KILN__ENV_OPT(i)) ? auto_fn[i] && auto_fn[i]() : as_set;
    }
}

#define STAGE_PREFIX "COMPILE_"

/* Whether KILN_COMPILE_DISABLE names stage id (its name after COMPILE_, in any case);
 * a name that is no stage is said once and ignored. */
static bool disabled_by_alias(kiln__opt_id id)
{
    const char *p = kiln__env_str(KILN__ENV_COMPILE_DISABLE), *it;
    size_t n, pre = strlen(STAGE_PREFIX);
    bool off = false;
    while (p && (it = kiln__env_list_next(&p, &n))) {
        int hit = -1;
        for (int s = KILN__OPT_FIRST_STAGE; s < KILN__OPT_COUNT && hit < 0; s++)
            if (strlen(name_of(s) + pre) == n && !strncasecmp(it, name_of(s) + pre, n)) hit = s;
        if (hit == (int)id) off = true;
        if (hit < 0 && !atomic_exchange(&warned_disable, true)) {
            char all[400] = "";
            for (int s = KILN__OPT_FIRST_STAGE; s < KILN__OPT_COUNT; s++)
                snprintf(all + strlen(all), sizeof all - strlen(all), "%s%s", s > KILN__OPT_FIRST_STAGE ? ", " : "",
                         name_of(s) + pre);
            for (char *c = all; *c; c++) *c = (char)tolower(*c);
            fprintf(stderr, "kiln: KILN_COMPILE_DISABLE: no stage '%.*s' (the stages: %s); ignored\n", (int)n, it, all);
        }
    }
    return off;
}

bool kiln__opt(kiln__opt_id id)
{
    if ((int)id >= KILN__OPT_FIRST_STAGE) return kiln__env_bool(KILN__ENV_OPT(id)) && !disabled_by_alias(id);
    pthread_once(&once, read_env);
    return value[id];
}

int kiln_opt_count(void) { return KILN__OPT_COUNT; }

const char *kiln_opt_name(int i) { return i >= 0 && i < KILN__OPT_COUNT ? name_of(i) : NULL; }
const char *kiln_opt_help(int i) { return i >= 0 && i < KILN__OPT_COUNT ? row(i)->help : NULL; }
bool kiln_opt_enabled(int i) { return i >= 0 && i < KILN__OPT_COUNT && kiln__opt((kiln__opt_id)i); }

/* KILN_LOGS (a comma list; "all" for every stage) names stage. */
bool kiln__log_on(const char *stage)
{
    return kiln__env_list_has(KILN__ENV_LOGS, stage) || kiln__env_list_has(KILN__ENV_LOGS, "all");
}
