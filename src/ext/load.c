/* kiln_ext_load (kiln/ext.h): a module opened with dlopen, checked for the kiln it was
 * built for, and its kiln_ext_init run with a view of its folder (the .cl sources the
 * build copied there). Modules stay loaded: their ops' kernels are their code. */
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "core/file.h"
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

/* The ELF machine this program runs on (0: not checked). */
#if defined(__x86_64__)
#define HOST_MACHINE EM_X86_64
#elif defined(__aarch64__)
#define HOST_MACHINE EM_AARCH64
#elif defined(__i386__)
#define HOST_MACHINE EM_386
#elif defined(__powerpc64__)
#define HOST_MACHINE EM_PPC64
#elif defined(__riscv)
#define HOST_MACHINE EM_RISCV
#else
#define HOST_MACHINE 0
#endif

static bool within(uint64_t off, uint64_t count, uint64_t size, uint64_t file)
{
    return off <= file && (size == 0 || count <= (file - off) / size);
}

/* Why the ELF header eh is not of a shared object this program can load, or NULL. */
static const char *not_ours(const ElfW(Ehdr) *eh, char *buf, size_t n)
{
    if (eh->e_ident[EI_CLASS] != (sizeof(void *) == 8 ? ELFCLASS64 : ELFCLASS32))
        return "an ELF file of the other word size";
    if (eh->e_type != ET_DYN) return "an ELF file that is not a shared object";
    if (HOST_MACHINE && eh->e_machine != HOST_MACHINE) {
        snprintf(buf, n, "built for ELF machine %u, this one is %u", (unsigned)eh->e_machine, (unsigned)HOST_MACHINE);
        return buf;
    }
    return NULL;
}

/* Why the file (fd, file bytes) is cut short of what its header eh describes, or NULL. */
static const char *cut_short(int fd, const ElfW(Ehdr) *eh, uint64_t file, char *buf, size_t n)
{
    ElfW(Phdr) ph;
    if (eh->e_phentsize != sizeof ph || eh->e_phnum == 0 || !within(eh->e_phoff, eh->e_phnum, eh->e_phentsize, file))
        return "its program headers lie past the end of the file";
    if (eh->e_shoff &&
        (eh->e_shentsize != sizeof(ElfW(Shdr)) || !within(eh->e_shoff, eh->e_shnum, eh->e_shentsize, file)))
        return "its section headers lie past the end of the file";
    for (unsigned i = 0; i < eh->e_phnum; i++) {
        if (pread(fd, &ph, sizeof ph, (off_t)(eh->e_phoff + (uint64_t)i * sizeof ph)) != (ssize_t)sizeof ph)
            return "its program headers cannot be read";
        if (ph.p_type != PT_NULL && !within(ph.p_offset, ph.p_filesz, 1, file)) {
            snprintf(buf, n, "segment %u, bytes %llu to %llu, lies past the end", i, (unsigned long long)ph.p_offset,
                     (unsigned long long)(ph.p_offset + ph.p_filesz));
            return buf;
        }
    }
    return NULL;
}

/* dlopen maps a module and reads its headers where they say they are: a file cut short
 * (a copy that stopped, a build that died while linking) faults inside the loader
 * (SIGBUS), which no error can report. So the headers are checked against the file's
 * size first: an ELF shared object of this machine's class and machine, whose program
 * and section header tables and every segment's bytes lie within the file. */
static kiln_status check_elf(const char *real, const char *path)
{
    int64_t size = 0;
    int fd = kiln__file_open_read(real, NULL, &size);
    if (fd < 0) return kiln_last_status();
    ElfW(Ehdr) eh;
    char buf[160];
    const char *other = NULL, *cut = NULL;
    ssize_t got = pread(fd, &eh, sizeof eh, 0);
    if (got >= SELFMAG && memcmp(eh.e_ident, ELFMAG, SELFMAG)) other = "not an ELF file";
    else if (got != (ssize_t)sizeof eh) cut = "shorter than an ELF header";
    else if (!(other = not_ours(&eh, buf, sizeof buf))) cut = cut_short(fd, &eh, (uint64_t)size, buf, sizeof buf);
    close(fd);
    if (other)
        return kiln_error(KILN_ERR_FORMAT, "%s is not a module this program can load: %s", path, other);
    if (cut)
        return kiln_error(KILN_ERR_FORMAT, "%s is not a module this program can load: not a complete shared "
                          "object (%lld bytes: %s)", path, (long long)size, cut);
    return KILN_OK;
}

static kiln_status load(const char *path, int *n_ops)
{
    char real[PATH_MAX];
    if (!realpath(path, real))
        return kiln_error(KILN_ERR_IO, "%s: %s", path, strerror(errno));
    for (int i = 0; i < n_loaded; i++)
        if (!strcmp(loaded[i], real))
            return failed[i] ? kiln_error(KILN_ERR_ARG, "%s was loaded before and its kiln_ext_init failed; "
                                          "a process runs a module's init once (start a new one)", path)
                             : KILN_OK;
    if (n_loaded == (int)(sizeof loaded / sizeof loaded[0]))
        return kiln_error(KILN_ERR_ARG, "%s: %d modules are loaded already", path, n_loaded);
    kiln_status c = check_elf(real, path);
    if (c != KILN_OK) return c;
    dlerror();
    void *h = dlopen(real, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *why = dlerror();
        const char *sym = why ? strstr(why, "undefined symbol: ") : NULL;
        bool undefined = sym && !strncmp(sym + strlen("undefined symbol: "), "kiln", 4); /* one of kiln's */
        return kiln_error(KILN_ERR_FORMAT, "%s is not a module this program can load: %s%s", path,
                          why ? why : "(dlopen gave no reason)",
                          undefined ? " (a program linked with the static libkiln exports its symbols for modules "
                                      "with -rdynamic, CMake's ENABLE_EXPORTS; or link the shared libkiln)"
                                    : "");
    }
    const int *abi = dlsym(h, "kiln_ext_abi");
    init_fn init = (init_fn)dlsym(h, "kiln_ext_init");
    kiln_status s = KILN_OK;
    if (!abi)
        s = kiln_error(KILN_ERR_FORMAT, "%s has no kiln_ext_abi: not a kiln module, or one built before "
                       "modules said their version (put KILN_EXT_MODULE; in one of its sources)", path);
    else if (*abi != KILN_EXT_ABI)
        s = kiln_error(KILN_ERR_FORMAT, "%s was built for kiln's module version %d, this kiln loads %d: "
                       "build it again against this kiln's headers", path, *abi, KILN_EXT_ABI);
    else if (!init)
        s = kiln_error(KILN_ERR_FORMAT, "%s has no kiln_ext_init, the function a module defines its ops in",
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
        return kiln_error(s, "%s: kiln_ext_init failed: %s", path, why);
    }
    return KILN_OK;
}

kiln_status kiln_ext_load(const char *path, int *n_ops)
{
    if (n_ops) *n_ops = 0;
    if (!path) return kiln_error(KILN_ERR_ARG, "kiln_ext_load: the path is NULL");
    if (in_init) /* the lock is held by the load that runs this init */
        return kiln_error(KILN_ERR_ARG, "%s: called from a module's kiln_ext_init; load modules one after "
                          "the other", path);
    pthread_mutex_lock(&lock);
    kiln_status s = load(path, n_ops);
    pthread_mutex_unlock(&lock);
    return s;
}
