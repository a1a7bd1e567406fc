/* kiln_ext_build (kiln/ext.h): sources through their languages' commands into objects,
 * incrementally, then linked into one loadable module. An object is kept when the
 * stamp beside it is the hash of its command and its source's bytes, and it is newer
 * than every file its dependency file lists. The compiles that are due run in
 * parallel, one a core, through the shell, each one's output kept for the error
 * message. Two builds of one folder at once are safe, as the kernel cache's are
 * (src/compile/jit.c): each writes files of its own and renames them into place. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "core/cache.h"
#include "core/file.h"
#include "ext/ext_impl.h"
#include "kiln/ext.h"

/* Runs cmd through the shell; its output (both streams) in *out (malloc'd, or NULL).
 * Returns the exit status, or -1 when it could not be run. */
/* All of f's bytes, NUL-terminated (malloc'd; NULL when out of memory). */
static char *read_all(FILE *f)
{
    size_t len = 0, cap = 4096;
    char *b = malloc(cap);
    for (size_t got; b && (got = fread(b + len, 1, cap - len - 1, f)) > 0;) {
        len += got;
        if (cap - len < 2) {
            char *q = realloc(b, cap * 2);
            if (!q) break;
            b = q, cap *= 2;
        }
    }
    if (b) b[len] = 0;
    return b;
}

static int run(const char *cmd, char **out)
{
    size_t n = strlen(cmd) + 8;
    char *full = malloc(n);
    *out = NULL;
    if (!full) return -1;
    snprintf(full, n, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    free(full);
    if (!p) return -1;
    *out = read_all(p);
    int st = pclose(p);
    return st == -1 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static kiln_status failed(const char *what, const char *cmd, int st, const char *log)
{
    size_t l = log ? strlen(log) : 0;
    return kiln_error(KILN_ERR_IO, "%s %s\n  command: %s\n%.*s", what,
                      st < 0 ? "could not be run" : st == 127 ? "was not found (exit status 127)" : "failed", cmd,
                      (int)(l > 3000 ? 3000 : l), log ? log : "");
}

/* The modification time of path, or -1 when it is not there. */
static double mtime(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) return -1;
    return (double)st.st_mtim.tv_sec + 1e-9 * (double)st.st_mtim.tv_nsec;
}

/* Whether obj is newer than src and than every file its make-style dependency file dep
 * lists ("obj: a b \ c"); a dependency file that is missing or names a file that is
 * gone means no. */
static bool up_to_date(const char *obj, const char *src, const char *dep, bool has_dep)
{
    double t = mtime(obj);
    if (t < 0 || mtime(src) < 0 || mtime(src) > t) return false;
    if (!has_dep) return true;
    FILE *f = kiln__file_fopen_read(dep, NULL);
    if (!f) return false;
    char word[4096];
    bool ok = true, past_colon = false;
    while (ok && fscanf(f, "%4095s", word) == 1) {
        size_t n = strlen(word);
        if (!past_colon) {
            past_colon = n && word[n - 1] == ':';
            continue;
        }
        if (!strcmp(word, "\\")) continue;
        double d = mtime(word);
        ok = d >= 0 && d <= t;
    }
    fclose(f);
    return ok && past_colon;
}

/* One source's compile: what it makes and whether it must be made. */
typedef struct {
    const kiln_ext_lang *lang;
    const char *src;
    char obj[4300], dep[4310], tmp[4330], log[4330];
    char *cmd;
    uint64_t hash; /* of the command and the source's bytes: the stamp beside obj */
    pid_t pid;
    int status;
} job;

/* FNV-1a of the command and of the source's bytes; 0 when the source cannot be read
 * (a regular file only: a FIFO would block the build), with the error set. */
static uint64_t hash_of(const char *cmd, const char *src)
{
    uint64_t h = kiln__fnv(KILN__FNV_SEED, cmd, strlen(cmd) + 1);
    FILE *f = kiln__file_fopen_read(src, NULL);
    if (!f) return 0;
    unsigned char buf[1 << 14];
    for (size_t n; (n = fread(buf, 1, sizeof buf, f)) > 0;) h = kiln__fnv(h, buf, n);
    fclose(f);
    return h ? h : 1;
}

/* Whether obj is there with the stamp of this command and source, and newer than every
 * file its dependency file lists. */
static bool current(const job *j)
{
    char stamp[4400], text[32] = "", want[32];
    snprintf(stamp, sizeof stamp, "%s.stamp", j->obj);
    snprintf(want, sizeof want, "%016llx", (unsigned long long)j->hash);
    FILE *f = kiln__file_fopen_read(stamp, NULL);
    bool same = f && fgets(text, sizeof text, f) && !strncmp(text, want, 16);
    if (f) fclose(f);
    return same && up_to_date(j->obj, j->src, j->dep, *j->lang->depfile != 0);
}

/* Starts cmd through the shell, its output into log; the child's pid, or -1. */
static pid_t start(const char *cmd, const char *log)
{
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static char *read_log(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *text = f ? read_all(f) : NULL;
    if (f) fclose(f);
    return text;
}

/* The compiles that are due, at most `width` at once: each writes its object (and
 * dependency file) under a name of this process, renamed into place when it succeeded,
 * so that two builds of the same folder at once never see half an object. */
static void run_jobs(job **due, int n, int width)
{
    int next = 0, running = 0;
    while (next < n || running) {
        while (next < n && running < width) {
            job *j = due[next++];
            j->pid = start(j->cmd, j->log);
            if (j->pid < 0) j->status = -1;
            else running++;
        }
        /* only our own children, by pid: a plain wait() would reap the program's other
         * children and lose their statuses */
        bool any = false;
        for (int i = 0; i < next; i++) {
            int st = 0;
            pid_t got = due[i]->pid > 0 ? waitpid(due[i]->pid, &st, WNOHANG) : 0;
            if (got == 0 || (got < 0 && errno == EINTR)) continue;
            /* gone without a status (SIGCHLD ignored): said as a command that failed */
            due[i]->status = got < 0 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128;
            due[i]->pid = 0;
            running--;
            any = true;
        }
        if (!any && running) nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
}

/* The language's link flags with {compiler_dir} filled in. */
static bool add_link_flags(char **link, size_t *len, size_t *cap, const kiln_ext_lang *l)
{
    if (!*l->link) return true;
    char found[1200] = "", dir[1200];
    kiln_ext_compiler_found(l, found, sizeof found);
    snprintf(dir, sizeof dir, "%s", found);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    if (strstr(*link ? *link : "", l->link) && !strstr(l->link, "{compiler_dir}")) return true; /* said already */
    bool ok = kiln__ext_append(link, len, cap, " ", false);
    for (const char *p = l->link; ok && *p;) {
        const char *h = strstr(p, "{compiler_dir}");
        size_t n = h ? (size_t)(h - p) : strlen(p);
        char piece[1300];
        snprintf(piece, sizeof piece, "%.*s", (int)n, p);
        ok = kiln__ext_append(link, len, cap, piece, false) && (!h || kiln__ext_append(link, len, cap, dir, true));
        p += n + (h ? strlen("{compiler_dir}") : 0);
    }
    return ok;
}

kiln_status kiln_ext_build(const kiln_ext_langs_t *langs, const char *const *sources, int n, const char *out_dir,
                           const char *name, const char *include, char **module, int *rebuilt)
{
    if (!langs || (!sources && n) || n < 0 || !name || !*name || !module)
        return kiln_error(KILN_ERR_ARG, "ext_build: NULL table, sources, name or module");
    *module = NULL;
    if (rebuilt) *rebuilt = 0;
    if (strchr(name, '/')) return kiln_error(KILN_ERR_ARG, "the module's name '%s' has a '/'", name);
    char in_cache[1200], sub[300];
    if (!out_dir) { /* the kernel cache's folder, ext/<name> */
        snprintf(sub, sizeof sub, "ext/%s", name);
        kiln_status c = kiln__cache_dir(sub, in_cache, sizeof in_cache);
        if (c != KILN_OK) return c;
        out_dir = in_cache;
    }
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
        return kiln_error(KILN_ERR_IO, "cannot make the folder %s: %s", out_dir, strerror(errno));
    size_t mlen = strlen(out_dir) + strlen(name) + 16, link_len = 0, link_cap = 0;
    char *mod = malloc(mlen), *link = NULL, tmp_mod[4400]; /* the link: cc -shared -o 'tmp' 'object'... */
    job *jobs = calloc((size_t)(n ? n : 1), sizeof *jobs);
    job **due = calloc((size_t)(n ? n : 1), sizeof *due);
    kiln_status s = mod && jobs && due ? KILN_OK : kiln_error(KILN_ERR_OOM, "ext_build: out of memory");
    if (s == KILN_OK) {
        snprintf(mod, mlen, "%s/lib%s.so", out_dir, name);
        snprintf(tmp_mod, sizeof tmp_mod, "%s.%d.tmp", mod, (int)getpid());
    }
    if (s == KILN_OK && !(kiln__ext_append(&link, &link_len, &link_cap, "cc -shared -o ", false) &&
                          kiln__ext_append(&link, &link_len, &link_cap, tmp_mod, true)))
        s = kiln_error(KILN_ERR_OOM, "ext_build: out of memory");
    size_t link_tail = link_len; /* what follows the output's name: the objects and flags */
    int objects = 0, n_due = 0;
    double newest = 0; /* of the objects: a module older than one is linked again */
    for (int i = 0; s == KILN_OK && i < n; i++) {
        job *j = &jobs[i];
        if (!(j->lang = kiln_ext_langs_find(langs, sources[i]))) {
            s = kiln_last_status();
            break;
        }
        j->src = sources[i];
        const char *base = strrchr(sources[i], '/') ? strrchr(sources[i], '/') + 1 : sources[i];
        if (!*j->lang->command) { /* its backend builds it when it is loaded */
            snprintf(j->obj, sizeof j->obj, "%s/%s", out_dir, base);
            char *text = read_log(sources[i]);
            s = text ? (kiln__write_whole(j->obj, text, strlen(text)) ? KILN_OK
                                                 : kiln_error(KILN_ERR_IO, "%s: cannot write %s: %s", sources[i],
                                                              j->obj, strerror(errno)))
                     : kiln_error(KILN_ERR_IO, "%s: cannot read it: %s", sources[i], strerror(errno));
            free(text);
            continue;
        }
        /* the whole name, suffix and all: a.c and a.cu make a.c.o and a.cu.o */
        snprintf(j->obj, sizeof j->obj, "%s/%s%s", out_dir, base, j->lang->object);
        for (int k = 0; k < i; k++)
            if (!strcmp(jobs[k].obj, j->obj))
                s = kiln_error(KILN_ERR_ARG, "%s and %s would both be built into %s: rename one", jobs[k].src,
                               sources[i], j->obj);
        if (s != KILN_OK) break;
        snprintf(j->dep, sizeof j->dep, "%s.d", j->obj);
        snprintf(j->tmp, sizeof j->tmp, "%s.%d.tmp", j->obj, (int)getpid());
        snprintf(j->log, sizeof j->log, "%s.%d.log", j->obj, (int)getpid());
        if (!kiln__ext_append(&link, &link_len, &link_cap, " ", false) ||
            !kiln__ext_append(&link, &link_len, &link_cap, j->obj, true)) {
            s = kiln_error(KILN_ERR_OOM, "ext_build: out of memory");
            break;
        }
        objects++;
        if ((s = kiln_ext_command(j->lang, sources[i], j->tmp, include, &j->cmd)) != KILN_OK) break;
        /* the stamp hashes the command as it would name the object, not this process's
         * temporary name */
        char *named = NULL;
        if ((s = kiln_ext_command(j->lang, sources[i], j->obj, include, &named)) != KILN_OK) break;
        j->hash = hash_of(named, sources[i]);
        free(named);
        if (!j->hash) {
            s = kiln_last_status(); /* (hash_of named the source and why) */
            break;
        }
        if (current(j)) {
            if (mtime(j->obj) > newest) newest = mtime(j->obj);
        } else {
            due[n_due++] = j;
        }
    }
    for (int i = 0; s == KILN_OK && i < n; i++)
        if (jobs[i].lang && *jobs[i].lang->command && !add_link_flags(&link, &link_len, &link_cap, jobs[i].lang))
            s = kiln_error(KILN_ERR_OOM, "ext_build: out of memory");
    if (s == KILN_OK && n_due) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        run_jobs(due, n_due, cores > 0 ? (int)cores : 1);
    }
    for (int i = 0; i < n_due; i++) { /* in the sources' order: the first failure is the one named */
        job *j = due[i];
        char tmp_dep[4400], stamp[4400], hex[32];
        snprintf(tmp_dep, sizeof tmp_dep, "%s.d", j->tmp);
        if (s == KILN_OK && j->status != 0) {
            char what[4400], *log = read_log(j->log);
            snprintf(what, sizeof what, "%s: the %s compiler", j->src, j->lang->suffix);
            s = failed(what, j->cmd, j->status, log);
            free(log);
        }
        /* (core/file.h: never over what is not a regular file) */
        if (s == KILN_OK && (s = kiln__file_place(j->tmp, j->obj, NULL)) == KILN_OK && *j->lang->depfile)
            s = kiln__file_place(tmp_dep, j->dep, NULL);
        snprintf(stamp, sizeof stamp, "%s.stamp", j->obj);
        snprintf(hex, sizeof hex, "%016llx\n", (unsigned long long)j->hash);
        /* without the stamp the next build compiles again: no harm */
        if (s == KILN_OK) kiln__write_whole(stamp, hex, strlen(hex));
        if (s == KILN_OK && rebuilt) (*rebuilt)++;
        remove(j->tmp);
        remove(tmp_dep);
        remove(j->log);
    }
    /* the module's stamp: its objects and link flags (a language's link flags changed
     * link it again) */
    char mod_stamp[4400], link_hex[32], text[32] = "";
    snprintf(mod_stamp, sizeof mod_stamp, "%s.stamp", mod ? mod : "");
    snprintf(link_hex, sizeof link_hex, "%016llx\n",
             (unsigned long long)(link ? kiln__fnv(KILN__FNV_SEED, link + link_tail, link_len - link_tail) : 0));
    FILE *f = s == KILN_OK ? fopen(mod_stamp, "r") : NULL;
    bool same_link = f && fgets(text, sizeof text, f) && !strcmp(text, link_hex);
    if (f) fclose(f);
    if (s == KILN_OK && objects && (n_due || !same_link || mtime(mod) < newest || mtime(mod) < 0)) {
        char *log = NULL;
        int st = run(link, &log);
        if (st != 0) s = failed("the module's link", link, st, log);
        else if ((s = kiln__file_place(tmp_mod, mod, NULL)) == KILN_OK)
            kiln__write_whole(mod_stamp, link_hex, strlen(link_hex));
        remove(tmp_mod);
        free(log);
    }
    for (int i = 0; jobs && i < n; i++) free(jobs[i].cmd);
    free(jobs);
    free(due);
    free(link);
    if (s == KILN_OK && objects) *module = mod;
    else free(mod);
    return s;
}
