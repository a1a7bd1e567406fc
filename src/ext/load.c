/* kiln_ext_load (kiln/ext.h): a module opened with dlopen, checked for the kiln it was
 * built for, and its kiln_ext_init run with a view of its folder (the .cl sources the
 * build copied there). Modules stay loaded: their ops' kernels are their code. */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/ext.h"
#include "kiln/data.h"

typedef kiln_status (*init_fn)(const kiln_ext_module *m);

/* The texts read for one kiln_ext_init, freed when it returns. */
typedef struct {
    char *text[32];
    int n;
} texts;

static const char *source(const kiln_ext_module *m, const char *name)
{
    texts *t = m->priv;
    if (!name || !*name || strchr(name, '/')) {
        kiln_error(KILN_ERR_ARG, "%s: source: '%s' is not a file name in the module's folder", m->path,
                   name ? name : "(null)");
        return NULL;
    }
    if (t->n == (int)(sizeof t->text / sizeof t->text[0])) {
        kiln_error(KILN_ERR_ARG, "%s: source: more than 32 sources read", m->path);
        return NULL;
    }
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", m->dir, name);
    char *text = NULL;
    size_t len;
    if (kiln_text_read(path, &text, &len) != KILN_OK) return NULL;
    t->text[t->n++] = text;
    return text;
}

/* The modules loaded, by their real path; failed[i]: its kiln_ext_init failed (it stays
 * open: the ops it defined before failing run its code). */
static char *loaded[256];
static bool failed[256];
static int n_loaded;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local bool in_init; /* a module's kiln_ext_init is running on this thread */

static kiln_status load(const char *path, int *n_ops)
{
    char real[PATH_MAX];
    if (!realpath(path, real))
        return kiln_error(KILN_ERR_IO, "ext_load: %s: %s", path, strerror(errno));
    for (int i = 0; i < n_loaded; i++)
        if (!strcmp(loaded[i], real))
            return failed[i] ? kiln_error(KILN_ERR_ARG, "ext_load: %s was loaded before and its kiln_ext_init failed; "
                                          "a process runs a module's init once (start a new one)", path)
                             : KILN_OK;
    if (n_loaded == (int)(sizeof loaded / sizeof loaded[0]))
        return kiln_error(KILN_ERR_ARG, "ext_load: %s: %d modules are loaded already", path, n_loaded);
    dlerror();
    void *h = dlopen(real, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *why = dlerror();
        const char *sym = why ? strstr(why, "undefined symbol: ") : NULL;
        bool undefined = sym && !strncmp(sym + strlen("undefined symbol: "), "kiln", 4); /* one of kiln's */
        return kiln_error(KILN_ERR_FORMAT, "ext_load: %s is not a module this program can load: %s%s", path,
                          why ? why : "(dlopen gave no reason)",
                          undefined ? " (a program linked with the static libkiln exports its symbols for modules "
                                      "with -rdynamic, CMake's ENABLE_EXPORTS; or link the shared libkiln)"
                                    : "");
    }
    const int *abi = dlsym(h, "kiln_ext_abi");
    init_fn init = (init_fn)dlsym(h, "kiln_ext_init");
    kiln_status s = KILN_OK;
    if (!abi)
        s = kiln_error(KILN_ERR_FORMAT, "ext_load: %s has no kiln_ext_abi: not a kiln module, or one built before "
                       "modules said their version (put KILN_EXT_MODULE; in one of its sources)", path);
    else if (*abi != KILN_EXT_ABI)
        s = kiln_error(KILN_ERR_FORMAT, "ext_load: %s was built for kiln's module version %d, this kiln loads %d: "
                       "build it again against this kiln's headers", path, *abi, KILN_EXT_ABI);
    else if (!init)
        s = kiln_error(KILN_ERR_FORMAT, "ext_load: %s has no kiln_ext_init, the function a module defines its ops in",
                       path);
    if (s != KILN_OK) {
        dlclose(h);
        return s;
    }
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", real);
    *strrchr(dir, '/') = 0;
    texts t = {.n = 0};
    kiln_ext_module m = {.path = real, .dir = dir, .source = source, .priv = &t};
    int before = kiln_op_count();
    kiln_clear_error();
    in_init = true;
    s = init(&m);
    in_init = false;
    for (int i = 0; i < t.n; i++) free(t.text[i]);
    if (n_ops) *n_ops = kiln_op_count() - before;
    loaded[n_loaded] = strdup(real);
    failed[n_loaded] = s != KILN_OK;
    if (loaded[n_loaded]) n_loaded++;
    if (s != KILN_OK) {
        char why[2048];
        snprintf(why, sizeof why, "%s", kiln_last_status() ? kiln_last_error() : "(it gave no message)");
        /* left loaded: the ops it defined before failing run its code */
        return kiln_error(s, "ext_load: %s: kiln_ext_init failed: %s", path, why);
    }
    return KILN_OK;
}

kiln_status kiln_ext_load(const char *path, int *n_ops)
{
    if (n_ops) *n_ops = 0;
    if (!path) return kiln_error(KILN_ERR_ARG, "ext_load: NULL path");
    if (in_init) /* the lock is held by the load that runs this init */
        return kiln_error(KILN_ERR_ARG, "ext_load: %s: called from a module's kiln_ext_init; load modules one after "
                          "the other", path);
    pthread_mutex_lock(&lock);
    kiln_status s = load(path, n_ops);
    pthread_mutex_unlock(&lock);
    return s;
}
