#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "core/opts.h"
#include "kiln/tensor.h"

static const struct {
    const char *name;
    bool dflt;
    const char *help;
} table[KILN__OPT_COUNT] = {
#define KILN__OPT_ROW(name, dflt, help) {#name, dflt, help},
    KILN__OPTS(KILN__OPT_ROW)
#undef KILN__OPT_ROW
};

static bool value[KILN__OPT_COUNT];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void read_env(void)
{
    for (int i = 0; i < KILN__OPT_COUNT; i++) {
        char var[64] = "KILN_OPT_";
        strncat(var, table[i].name, sizeof var - strlen(var) - 1);
        const char *v = getenv(var);
        value[i] = v && *v ? strcmp(v, "0") != 0 : table[i].dflt;
    }
}

bool kiln__opt(kiln__opt_id id)
{
    pthread_once(&once, read_env);
    return value[id];
}

int kiln_opt_count(void) { return KILN__OPT_COUNT; }

const char *kiln_opt_name(int i) { return i >= 0 && i < KILN__OPT_COUNT ? table[i].name : NULL; }
const char *kiln_opt_help(int i) { return i >= 0 && i < KILN__OPT_COUNT ? table[i].help : NULL; }
bool kiln_opt_enabled(int i) { return i >= 0 && i < KILN__OPT_COUNT && kiln__opt((kiln__opt_id)i); }

/* KILN_LOGS (a comma list; "all" for every stage) names stage. */
bool kiln__log_on(const char *stage)
{
    const char *v = getenv("KILN_LOGS");
    if (!v || !*v) return false;
    size_t n = strlen(stage);
    for (const char *p = v; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if ((len == n && !strncmp(p, stage, n)) || (len == 3 && !strncmp(p, "all", 3))) return true;
        p += len + (e ? 1 : 0);
    }
    return false;
}
