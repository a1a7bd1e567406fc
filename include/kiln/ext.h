/* kiln/ext.h — extension languages: how a source file of a custom op becomes something
 * kiln loads. The languages are data, a table kiln ships (.c, .cpp, .cl, .cu) that a
 * user extends or overrides with a JSON file, without rebuilding kiln:
 *
 *     {"languages": [{"suffix": ".asc", "command": "bisheng -x asc {flags} -I{include}
 *                      -c {src} -o {out}", "flags": "-O2", "object": ".o",
 *                      "depfile": "-MD -MF {dep}", "load": "shared"}]}
 *
 * A worked example:
 *
 *     kiln_ext_langs_t *langs;
 *     if (kiln_ext_langs_load(NULL, &langs) != KILN_OK)   // built-ins + the user's file
 *         fprintf(stderr, "kiln: %s\n", kiln_last_error());
 *     const kiln_ext_lang *l = kiln_ext_langs_find(langs, "rmsnorm.asc");
 *     char *cmd;
 *     kiln_ext_command(l, "rmsnorm.asc", "out/rmsnorm.o", "/usr/include", &cmd);
 *     ...                                                 // run it, then free(cmd)
 *     kiln_ext_langs_free(langs);
 *
 * A language's fields:
 *   suffix   what a source's name ends with (".c"); the longest suffix that matches wins
 *   command  the compiler's command line, a template: {src} the source, {out} the
 *            object, {flags} the flags below and then the depfile flags, {include}
 *            kiln's header folder, {dep} the dependency file ({out} with ".d" after
 *            it); each path is quoted for the shell. Empty for a language
 *            whose sources are handed to a backend at load time.
 *   flags    default flags put at {flags}
 *   object   the suffix of what the command makes (".o")
 *   depfile  the flags that make the compiler write {dep}, the sources the object
 *            depends on (for incremental builds); empty when it cannot
 *   load     "shared": objects linked into a loadable module; "backend": the source
 *            itself handed to the backend named by `backend` ("opencl") when loaded
 *   link     flags for the module's link when one of its sources is in this language
 *            (a runtime library: "-lcudart"); {compiler_dir} is the folder of the
 *            compiler the command runs
 * A file's entry with the suffix of an earlier one (a built-in, or the same file's)
 * replaces it; kiln_ext_lang.origin says where each came from. A malformed entry (a
 * missing field, an unknown placeholder, another load kind) is an error naming the
 * file, the entry and the field.
 *
 * Ownership: the table owns every string it hands out; free it with kiln_ext_langs_free.
 */
#ifndef KILN_EXT_H
#define KILN_EXT_H

#include "kiln/tensor.h"
#include "kiln/ops.h" /* what a module writes its backward with */
#include "kiln/op.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *suffix, *command, *flags, *object, *depfile;
    const char *load;    /* "shared" or "backend" */
    const char *backend; /* load "backend": the backend's name; else "" */
    const char *link;    /* flags the module's link gets when a source is in this language */
    const char *origin;  /* "built-in", or the file that added or replaced it */
} kiln_ext_lang;

typedef struct kiln_ext_langs kiln_ext_langs_t;

/* The built-in languages, then the entries of the JSON file at path; path NULL: the
 * user's file, $XDG_CONFIG_HOME/kiln/languages.json (else ~/.config/kiln/...), when it
 * exists. A path given that does not exist is an error. */
kiln_status kiln_ext_langs_load(const char *path, kiln_ext_langs_t **out);
void kiln_ext_langs_free(kiln_ext_langs_t *l);
int kiln_ext_langs_count(const kiln_ext_langs_t *l);
/* Language i in the table's order (built-ins first, then the file's new ones); NULL
 * outside [0, count). Borrowed. */
const kiln_ext_lang *kiln_ext_langs_at(const kiln_ext_langs_t *l, int i);
/* The language of a source by its name's longest matching suffix, or NULL (with an
 * error naming the source and the suffixes there are). Borrowed. */
const kiln_ext_lang *kiln_ext_langs_find(const kiln_ext_langs_t *l, const char *source);
/* The language's command for one source: its template with {src}, {out}, {include}
 * and {dep} (out with ".d" after it) quoted for the shell and {flags} as they are. A
 * new string in *cmd (the caller frees it); KILN_ERR_UNSUPPORTED for a language with
 * no command (load "backend"). */
kiln_status kiln_ext_command(const kiln_ext_lang *lang, const char *src, const char *out, const char *include,
                             char **cmd);
/* Builds sources[0..n) into out_dir (made if missing; NULL: the kernel cache's folder
 * ext/<name>, under $KILN_CACHE_DIR or its default): each source of a "shared"
 * language compiled with its command into out_dir/<its file name><object> (a.c into a.c.o),
 * unless the stamp beside the object is the hash of that command and the source's bytes
 * and the object is newer than every file its dependency file lists (an incremental
 * build; the compiles that are due run at once, one a core, and every file is written
 * under this process's name and renamed into place, so two builds at once are safe); the objects then linked into the module
 * out_dir/lib<name>.so (`cc -shared`), which *module gets (malloc'd; the caller frees
 * it); a "backend" language's source copied into out_dir as it is, for its backend to
 * build when loaded. include: kiln's header folder, for {include}. *rebuilt (may be
 * NULL) gets how many sources were compiled. A compiler that fails or is not there is
 * KILN_ERR_IO with a message naming the source, the exact command and the compiler's
 * output. */
kiln_status kiln_ext_build(const kiln_ext_langs_t *langs, const char *const *sources, int n, const char *out_dir,
                           const char *name, const char *include, char **module, int *rebuilt);
/* Modules. A module is a shared object that defines custom ops (kiln/op.h) in its
 * function kiln_ext_init, and says which kiln it was built for with KILN_EXT_MODULE:
 *
 *     #include "kiln/ext.h"
 *     KILN_EXT_MODULE;
 *     kiln_status kiln_ext_init(const kiln_ext_module *m)
 *     {
 *         const char *cl = m->source(m, "rmsnorm.cl");      // a .cl copied beside it
 *         ...                                               // kiln_op_define(...)
 *     }
 *
 * Its kiln symbols are those of the program that loads it: a program linked with the
 * static libkiln must export them (-rdynamic; CMake's ENABLE_EXPORTS), as the kiln
 * tool does; with the shared libkiln they are there already. A module is never
 * unloaded (its ops live as long as the process). */
#define KILN_EXT_ABI 1
#ifdef __cplusplus
#define KILN_EXT_MODULE extern "C" __attribute__((visibility("default"))) const int kiln_ext_abi = KILN_EXT_ABI
#else
#define KILN_EXT_MODULE __attribute__((visibility("default"))) const int kiln_ext_abi = KILN_EXT_ABI
#endif

typedef struct kiln_ext_module {
    const char *path; /* the module's file */
    const char *dir;  /* its folder, where the sources its backends build lie */
    /* The text of the file `name` in dir (a .cl source the build copied there), kept
     * until kiln_ext_init returns; NULL (with the error set) when it cannot be read. */
    const char *(*source)(const struct kiln_ext_module *m, const char *name);
    void *priv;
} kiln_ext_module;

/* Loads the module at path and runs its kiln_ext_init: *n_ops (may be NULL) gets how
 * many ops it defined. A module already loaded (the same file) is not run again
 * (*n_ops 0). Errors name the module: a file that is not there or not a shared object,
 * a symbol kiln's program does not export, no kiln_ext_abi (or another version's), no
 * kiln_ext_init, or the error kiln_ext_init returned (ops it defined before failing
 * stay defined). */
kiln_status kiln_ext_load(const char *path, int *n_ops);
/* The function a module defines (not kiln): declared here so that a C++ module's has
 * C linkage. */
kiln_status kiln_ext_init(const kiln_ext_module *m);

/* Whether the program the language's command runs (its first word) is there: a path
 * that is executable, or a name found on $PATH; the file found in buf. False for a
 * language with no command. (kiln doctor reports it for every row.) */
bool kiln_ext_compiler_found(const kiln_ext_lang *lang, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif
