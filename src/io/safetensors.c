/* safetensors checkpoints: load (validate everything, then copy tensors out on demand,
 * or hand out tensors over the file's mapped bytes) and an atomic save.
 *
 * JSON goes through jansson: it is packaged by Debian (libjansson), it is a strict
 * parser (rejects trailing garbage, bad UTF-8, NUL in strings, and with
 * JSON_REJECT_DUPLICATES duplicate keys) and it is small. Since 2.8 it keeps object
 * keys in insertion order, which the writer relies on to lay the header out as the
 * reference writer does.
 *
 * Apart from core/util.h's inline helpers this file uses the public API, as src/io/
 * should. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "core/file.h"
#include "core/util.h"
#include "kiln/io.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; a big-endian host would need byte swaps here"
#endif

/* The reference implementation refuses headers above this; so do we, so that a
 * corrupt length cannot make us allocate gigabytes before finding out. */
#define MAX_HEADER_BYTES 100000000ull
#define META_KEY "__metadata__"

/* Each kiln dtype's safetensors name: one table, used both ways. */
static const char *const st_names[] = {
    [KILN_DTYPE_F32] = "F32", [KILN_DTYPE_F64] = "F64", [KILN_DTYPE_F16] = "F16", [KILN_DTYPE_BF16] = "BF16",
    [KILN_DTYPE_I32] = "I32", [KILN_DTYPE_I64] = "I64", [KILN_DTYPE_U8] = "U8",   [KILN_DTYPE_BOOL] = "BOOL",
};
_Static_assert(sizeof st_names / sizeof st_names[0] == KILN_DTYPE_COUNT, "every kiln dtype needs a safetensors name");

static bool dtype_from_st(const char *name, kiln_dtype *out)
{
    for (*out = 0; *out < KILN_DTYPE_COUNT; (*out)++)
        if (strcmp(st_names[*out], name) == 0) return true;
    return false;
}

typedef struct {
    const char *name; /* borrowed from the parsed header */
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    uint64_t begin, end; /* byte offsets into the data buffer */
    int header_index;    /* position in the header, to keep the sort stable */
} entry;

/* The file mapped whole, copy-on-write (a tensor over it may be written, as a model's
 * parameters are in training, and the file stays as it is). The file handle and every
 * view hold a reference; the last one unmaps it. */
typedef struct {
    atomic_int refs;
    void *base;
    size_t len;
    int *views;          /* per entry, its views alive */
    pthread_mutex_t mu;  /* over views and the giving back of pages */
} file_map;

static void map_release(void *ctx)
{
    file_map *m = ctx;
    if (atomic_fetch_sub(&m->refs, 1) != 1) return;
    munmap(m->base, m->len);
    pthread_mutex_destroy(&m->mu);
    free(m->views);
    free(m);
}

/* A view's hold on the mapping: its entry and bytes. */
typedef struct {
    file_map *m;
    int entry;
    unsigned char *lo, *hi;
} view_ref;

/* When an entry's last view goes while the mapping stays (other tensors still view
 * it), the whole pages inside the entry's bytes are given back (MADV_DONTNEED): a model
 * whose f32 weights were replaced by 16-bit copies (kiln serve --weights bf16) would
 * otherwise keep every page it read resident, 852 MB where reading the file gave 529
 * (docs/perf-log.md). Entries never overlap, so no other tensor sees those pages; what
 * was written through the views is dropped with them, and the entry read again later
 * comes from the file. Under the map's lock, so that a view of the entry taken
 * meanwhile (get) is counted before the pages go, or taken after. */
static void view_release(void *ctx)
{
    view_ref *v = ctx;
    pthread_mutex_lock(&v->m->mu);
    if (--v->m->views[v->entry] == 0 && atomic_load(&v->m->refs) > 1) {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t lo = ((uintptr_t)v->lo + page - 1) / page * page, hi = (uintptr_t)v->hi / page * page;
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
    }
    pthread_mutex_unlock(&v->m->mu);
    map_release(v->m);
    free(v);
}

/* Whether KILN_OPT_MMAP is on (the switch table is the core's; found by name). */
static bool mmap_on(void)
{
    for (int i = 0; i < kiln_opt_count(); i++)
        if (!strcmp(kiln_opt_name(i), "MMAP")) return kiln_opt_enabled(i);
    return false;
}

struct kiln_safetensors {
    char *path;
    file_map *map;      /* the mapping buf lies in, or NULL when buf was read into memory */
    json_t *header; /* owns the name and metadata strings */
    json_t *meta;   /* borrowed from header, or NULL */
    entry *entries; /* sorted by data offset: "file order" */
    int n;
    unsigned char *buf; /* the data buffer */
    size_t buf_size;
};

/* ---- loading ---------------------------------------------------------------- */

static kiln_status read_at(int fd, const char *path, void *dst, size_t n, off_t off)
{
    unsigned char *p = dst;
    while (n > 0) {
        ssize_t got = pread(fd, p, n, off);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return kiln_error(KILN_ERR_IO, "cannot read %s: %s", path, strerror(errno));
        if (got == 0) return kiln_error(KILN_ERR_IO, "safetensors: %s shrank while it was being read", path);
        p += got;
        n -= (size_t)got;
        off += got;
    }
    return KILN_OK;
}

/* A JSON integer >= 0, or false. */
static bool get_nonneg(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

/* Checks one header entry against the rules of the format and fills e. */
static kiln_status parse_entry(const char *path, const char *name, const json_t *v, uint64_t buf_size, entry *e)
{
    if (!json_is_object(v))
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: entry '%.200s' is not a JSON object", path, name);
    const json_t *dtype = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape"),
                 *offs = json_object_get(v, "data_offsets");
    if (!dtype || !shape || !offs)
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: entry '%.200s' is missing \"%s\"", path, name,
                         !dtype ? "dtype" : !shape ? "shape" : "data_offsets");
    if (!json_is_string(dtype))
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: dtype of '%.200s' is not a string", path, name);
    if (!dtype_from_st(json_string_value(dtype), &e->dtype))
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: unknown dtype '%.40s' for '%.200s' (kiln reads F32 F64 "
                         "F16 BF16 I32 I64 U8 BOOL)", path, json_string_value(dtype), name);
    if (!json_is_array(shape))
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: shape of '%.200s' is not an array", path, name);
    if (json_array_size(shape) > KILN_MAX_DIMS)
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: '%.200s' has %zu dims, more than kiln's %d", path, name,
                         json_array_size(shape), KILN_MAX_DIMS);
    e->ndim = (int)json_array_size(shape);
    /* span, the product with zero dims counted as 1, must fit int64 too: the core
     * computes strides that way, even for a tensor with no elements. */
    uint64_t numel = 1, span = 1;
    for (int i = 0; i < e->ndim; i++) {
        uint64_t d;
        if (!get_nonneg(json_array_get(shape, (size_t)i), &d))
            return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: dim %d of '%.200s' is not an integer >= 0", path, i,
                             name);
        e->shape[i] = (int64_t)d;
        if (__builtin_mul_overflow(numel, d, &numel) || __builtin_mul_overflow(span, d ? d : 1, &span) ||
            span > INT64_MAX)
            return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: the shape of '%.200s' overflows 64 bits", path, name);
    }
    if (!json_is_array(offs) || json_array_size(offs) != 2 || !get_nonneg(json_array_get(offs, 0), &e->begin) ||
        !get_nonneg(json_array_get(offs, 1), &e->end))
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: data_offsets of '%.200s' is not [begin, end] with "
                         "integers >= 0", path, name);
    if (e->end < e->begin)
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: data_offsets [%llu, %llu] of '%.200s' run backwards",
                         path, (unsigned long long)e->begin, (unsigned long long)e->end, name);
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, (uint64_t)kiln_dtype_size(e->dtype), &nbytes) || nbytes != e->end - e->begin)
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: '%.200s' has %llu %s elements but data_offsets [%llu, "
                         "%llu] hold %llu bytes", path, name, (unsigned long long)numel, json_string_value(dtype),
                         (unsigned long long)e->begin, (unsigned long long)e->end,
                         (unsigned long long)(e->end - e->begin));
    if (e->end > buf_size)
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: data_offsets [%llu, %llu] of '%.200s' are beyond the "
                         "%llu-byte data buffer (truncated file?)", path, (unsigned long long)e->begin,
                         (unsigned long long)e->end, name, (unsigned long long)buf_size);
    e->name = name;
    return KILN_OK;
}

static int entry_cmp(const void *a, const void *b)
{
    const entry *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->header_index - y->header_index;
}

/* The format wants the tensors to tile the buffer exactly: no overlap, no gap. */
static kiln_status check_coverage(const kiln_safetensors_t *f)
{
    uint64_t cursor = 0;
    const entry *last = NULL;
    for (int i = 0; i < f->n; i++) {
        const entry *e = &f->entries[i];
        if (e->begin < cursor)
            return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: tensors '%.200s' [%llu, %llu] and '%.200s' [%llu, "
                             "%llu] overlap", f->path, last->name, (unsigned long long)last->begin,
                             (unsigned long long)last->end, e->name, (unsigned long long)e->begin,
                             (unsigned long long)e->end);
        if (e->begin > cursor)
            return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: gap in the data buffer: bytes [%llu, %llu) belong to "
                             "no tensor", f->path, (unsigned long long)cursor, (unsigned long long)e->begin);
        cursor = e->end;
        last = e;
    }
    if (cursor != f->buf_size)
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: gap in the data buffer: bytes [%llu, %llu) at its end "
                         "belong to no tensor", f->path, (unsigned long long)cursor, (unsigned long long)f->buf_size);
    return KILN_OK;
}

static kiln_status parse_header(kiln_safetensors_t *f, const char *text, size_t len)
{
    if (len == 0 || text[0] != '{')
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: the header does not start with '{'", f->path);
    json_error_t jerr;
    f->header = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!f->header) {
        if (json_error_code(&jerr) == json_error_duplicate_key)
            return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: duplicate name in the header (line %d, column %d): "
                             "%s", f->path, jerr.line, jerr.column, jerr.text);
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: the header is not valid JSON (line %d, column %d): %s",
                         f->path, jerr.line, jerr.column, jerr.text);
    }
    if (!json_is_object(f->header))
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: the header is not a JSON object", f->path);
    f->meta = json_object_get(f->header, META_KEY);
    if (f->meta) {
        if (!json_is_object(f->meta))
            return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: " META_KEY " is not a JSON object", f->path);
        const char *k;
        json_t *v;
        json_object_foreach(f->meta, k, v) {
            if (!json_is_string(v))
                return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: " META_KEY " value of '%.200s' is not a string",
                                 f->path, k);
        }
    }
    size_t n = json_object_size(f->header) - (f->meta ? 1 : 0);
    if (n > INT32_MAX) return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: too many tensors (%zu)", f->path, n);
    f->entries = calloc(n ? n : 1, sizeof *f->entries);
    if (!f->entries) return kiln_error(KILN_ERR_OOM, "safetensors: %s: out of memory for %zu entries", f->path, n);
    const char *k;
    json_t *v;
    json_object_foreach(f->header, k, v) {
        if (strcmp(k, META_KEY) == 0) continue;
        entry *e = &f->entries[f->n];
        e->header_index = f->n;
        kiln_status s = parse_entry(f->path, k, v, f->buf_size, e);
        if (s != KILN_OK) return s;
        f->n++;
    }
    qsort(f->entries, (size_t)f->n, sizeof *f->entries, entry_cmp);
    return check_coverage(f);
}

static kiln_status load_fd(kiln_safetensors_t *f, int fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0) return kiln_error(KILN_ERR_IO, "cannot stat %s: %s", f->path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return kiln_error(KILN_ERR_IO, "safetensors: %s is not a regular file", f->path);
    uint64_t file_size = (uint64_t)st.st_size;
    if (file_size < 8)
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s is %llu bytes, shorter than the 8-byte header length",
                         f->path, (unsigned long long)file_size);
    unsigned char lenbuf[8];
    kiln_status s = read_at(fd, f->path, lenbuf, 8, 0);
    if (s != KILN_OK) return s;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | lenbuf[i];
    if (hlen > MAX_HEADER_BYTES)
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: header length %llu is absurd (more than 100 MB)", f->path,
                         (unsigned long long)hlen);
    if (hlen > file_size - 8)
        return kiln_error(KILN_ERR_FORMAT, "safetensors: %s: header length %llu runs past the end of the %llu-byte "
                         "file", f->path, (unsigned long long)hlen, (unsigned long long)file_size);
    if (file_size - 8 - hlen > SIZE_MAX)
        return kiln_error(KILN_ERR_OOM, "safetensors: %s is too large for this address space", f->path);
    f->buf_size = (size_t)(file_size - 8 - hlen);

    char *text = malloc(hlen ? hlen : 1);
    if (!text) return kiln_error(KILN_ERR_OOM, "safetensors: %s: out of memory for a %llu-byte header", f->path,
                                (unsigned long long)hlen);
    s = read_at(fd, f->path, text, hlen, 8);
    /* Parse before reading the buffer, so a bad header costs nothing more. */
    if (s == KILN_OK) s = parse_header(f, text, hlen);
    free(text);
    if (s != KILN_OK) return s;

    if (f->buf_size > 0 && mmap_on()) {
        void *base = mmap(NULL, (size_t)file_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
        file_map *m = base != MAP_FAILED ? malloc(sizeof *m) : NULL;
        if (m && !(m->views = calloc((size_t)(f->n > 0 ? f->n : 1), sizeof *m->views))) {
            free(m);
            m = NULL;
        }
        if (m) {
            pthread_mutex_init(&m->mu, NULL);
            atomic_init(&m->refs, 1);
            m->base = base;
            m->len = (size_t)file_size;
            f->map = m;
            f->buf = (unsigned char *)base + 8 + hlen;
            return KILN_OK;
        }
        if (base != MAP_FAILED) munmap(base, (size_t)file_size);
        /* a file system that cannot map it: read it, as with the switch off */
    }
    f->buf = malloc(f->buf_size ? f->buf_size : 1);
    if (!f->buf) return kiln_error(KILN_ERR_OOM, "safetensors: %s: out of memory for %zu bytes of tensor data",
                                  f->path, f->buf_size);
    return read_at(fd, f->path, f->buf, f->buf_size, (off_t)(8 + hlen));
}

kiln_status kiln_safetensors_load(const char *path, kiln_safetensors_t **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "safetensors_load: out is NULL");
    *out = NULL;
    if (!path) return kiln_error(KILN_ERR_ARG, "safetensors_load: path is NULL");
    kiln_safetensors_t *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return kiln_error(KILN_ERR_OOM, "safetensors_load: out of memory");
    }
    /* a regular file only: a FIFO would block the open, a device the mapping */
    int fd = kiln__file_open_read(path, NULL, NULL);
    if (fd < 0) {
        kiln_status s = kiln_last_status();
        kiln_safetensors_free(f);
        return s;
    }
    kiln_status s = load_fd(f, fd);
    close(fd);
    if (s == KILN_OK) *out = f;
    else kiln_safetensors_free(f);
    return s;
}

int kiln_safetensors_count(const kiln_safetensors_t *f) { return f ? f->n : 0; }

const char *kiln_safetensors_name(const kiln_safetensors_t *f, int i)
{
    return f && i >= 0 && i < f->n ? f->entries[i].name : NULL;
}

static kiln_tensor_t *get(const kiln_safetensors_t *f, const char *name, bool view)
{
    if (!f || !name)
        return kiln_error(KILN_ERR_ARG, "safetensors_%s: %s is NULL", view ? "view" : "get", f ? "name" : "file"), NULL;
    for (int i = 0; i < f->n; i++) {
        const entry *e = &f->entries[i];
        if (strcmp(e->name, name) != 0) continue;
        unsigned char *at = f->buf + e->begin;
        /* kiln_from_data copies and registers the result with the open scope;
         * kiln_tensor_wrap does not copy (and registers it too) */
        if (!f->map) return kiln_from_data(at, e->shape, e->ndim, e->dtype);
        if (!view || (uintptr_t)at % kiln_dtype_size(e->dtype)) {
            /* a copy, not while the entry's last view gives its pages back (view_release) */
            pthread_mutex_lock(&f->map->mu);
            kiln_tensor_t *t = kiln_from_data(at, e->shape, e->ndim, e->dtype);
            pthread_mutex_unlock(&f->map->mu);
            return t;
        }
        view_ref *v = malloc(sizeof *v);
        if (!v) return kiln_error(KILN_ERR_OOM, "safetensors_view: out of memory"), NULL;
        *v = (view_ref){f->map, i, at, f->buf + e->end};
        atomic_fetch_add(&f->map->refs, 1);
        pthread_mutex_lock(&f->map->mu);
        f->map->views[i]++;
        pthread_mutex_unlock(&f->map->mu);
        kiln_tensor_t *t = kiln_tensor_wrap(at, e->shape, e->ndim, e->dtype, view_release, v);
        if (!t) view_release(v);
        return t;
    }
    kiln_error(KILN_ERR_ARG, "safetensors: no tensor named '%.200s' in %s", name, f->path);
    return NULL;
}

kiln_tensor_t *kiln_safetensors_get(const kiln_safetensors_t *f, const char *name) { return get(f, name, false); }
kiln_tensor_t *kiln_safetensors_view(const kiln_safetensors_t *f, const char *name) { return get(f, name, true); }

const char *kiln_safetensors_meta(const kiln_safetensors_t *f, const char *key)
{
    if (!f || !f->meta || !key) return NULL;
    return json_string_value(json_object_get(f->meta, key));
}

void kiln_safetensors_free(kiln_safetensors_t *f)
{
    if (!f) return;
    json_decref(f->header);
    if (f->map) map_release(f->map);
    else free(f->buf);
    KILN__FREE(f->entries, f->path, f);
}

/* ---- saving ----------------------------------------------------------------- */

typedef struct {
    int index;
    size_t elsize;
} order_item;

/* Largest element first, so that each tensor starts aligned to its element size
 * (the header is padded to 8); the given order otherwise. */
static int order_cmp(const void *a, const void *b)
{
    const order_item *x = a, *y = b;
    if (x->elsize != y->elsize) return x->elsize > y->elsize ? -1 : 1;
    return x->index - y->index;
}

/* The JSON header for tensors laid out in `order`, padded with spaces to a multiple of
 * 8 bytes; *len gets the padded length. NULL with the error set on failure. */
static char *build_header(const char *const *names, kiln_tensor_t *const *tensors, const order_item *order, int n,
                          const char *const *meta, size_t *len)
{
    json_t *root = json_object(), *m = NULL;
    char *text = NULL, *padded;
    if (!root) goto oom;
    if (meta && meta[0]) {
        if (!(m = json_object()) || json_object_set_new(root, META_KEY, m) != 0) goto oom;
        for (int i = 0; meta[i]; i += 2) {
            if (!meta[i + 1]) {
                kiln_error(KILN_ERR_ARG, "safetensors_save: meta key '%.200s' has no value (meta is {\"key\", "
                          "\"value\", ..., NULL})", meta[i]);
                goto fail;
            }
            if (json_object_get(m, meta[i])) {
                kiln_error(KILN_ERR_ARG, "safetensors_save: meta key '%.200s' appears twice", meta[i]);
                goto fail;
            }
            json_t *v = json_string(meta[i + 1]);
            if (!v || json_object_set_new(m, meta[i], v) != 0) {
                kiln_error(KILN_ERR_ARG, "safetensors_save: meta '%.200s' is not valid UTF-8", meta[i]);
                goto fail;
            }
        }
    }
    uint64_t offset = 0;
    for (int k = 0; k < n; k++) {
        int i = order[k].index;
        const kiln_tensor_t *t = tensors[i];
        uint64_t nbytes = kiln_tensor_nbytes(t);
        /* The appends and json_pack take their values even when they fail, so a shape
         * shorter than the tensor's is an allocation that failed on the way. */
        json_t *shape = json_array();
        for (int d = 0; d < kiln_tensor_ndim(t); d++)
            json_array_append_new(shape, json_integer((json_int_t)kiln_tensor_dim(t, d)));
        json_t *e = json_pack("{s:s, s:o, s:[I, I]}", "dtype", st_names[kiln_tensor_dtype(t)], "shape", shape,
                              "data_offsets", (json_int_t)offset, (json_int_t)(offset + nbytes));
        if (!e || json_array_size(json_object_get(e, "shape")) != (size_t)kiln_tensor_ndim(t)) {
            json_decref(e);
            goto oom;
        }
        if (json_object_set_new(root, names[i], e) != 0) {
            kiln_error(KILN_ERR_ARG, "safetensors_save: name %d is not valid UTF-8", i);
            goto fail;
        }
        offset += nbytes;
    }
    if (!(text = json_dumps(root, JSON_COMPACT))) goto oom;
    size_t raw = strlen(text);
    *len = (raw + 7) / 8 * 8;
    if (!(padded = realloc(text, *len))) goto oom;
    memset(padded + raw, ' ', *len - raw);
    json_decref(root);
    return padded;
oom:
    kiln_error(KILN_ERR_OOM, "safetensors_save: out of memory building the header");
fail:
    free(text);
    json_decref(root);
    return NULL;
}

static kiln_status check_save_args(const char *path, const char *const *names, kiln_tensor_t *const *tensors, int n)
{
    if (!path) return kiln_error(KILN_ERR_ARG, "safetensors_save: path is NULL");
    if (n < 0) return kiln_error(KILN_ERR_ARG, "safetensors_save: n is %d", n);
    if (n > 0 && (!names || !tensors))
        return kiln_error(KILN_ERR_ARG, "safetensors_save: %s is NULL", !names ? "names" : "tensors");
    for (int i = 0; i < n; i++) {
        /* A NULL tensor keeps the first error, as ops do, so a failed chain reports its cause. */
        if (!tensors[i])
            return kiln_last_status() ? kiln_last_status()
                                      : kiln_error(KILN_ERR_ARG, "safetensors_save: tensor %d is NULL", i);
        if (!names[i]) return kiln_error(KILN_ERR_ARG, "safetensors_save: name %d is NULL", i);
        if (strcmp(names[i], META_KEY) == 0)
            return kiln_error(KILN_ERR_ARG, "safetensors_save: '" META_KEY "' is reserved for metadata");
        for (int j = 0; j < i; j++)
            if (strcmp(names[i], names[j]) == 0)
                return kiln_error(KILN_ERR_ARG, "safetensors_save: name '%.200s' appears twice", names[i]);
    }
    return KILN_OK;
}

kiln_status kiln_safetensors_save(const char *path, const char *const *names, kiln_tensor_t *const *tensors, int n,
                                  const char *const *meta)
{
    kiln_status s = check_save_args(path, names, tensors, n);
    if (s != KILN_OK) return s;
    order_item *order = malloc((n > 0 ? (size_t)n : 1) * sizeof *order);
    if (!order) return kiln_error(KILN_ERR_OOM, "safetensors_save: out of memory");
    size_t max_bytes = 0;
    for (int i = 0; i < n; i++) {
        order[i] = (order_item){i, kiln_dtype_size(kiln_tensor_dtype(tensors[i]))};
        size_t nb = kiln_tensor_nbytes(tensors[i]);
        if (nb > max_bytes) max_bytes = nb;
    }
    qsort(order, (size_t)n, sizeof *order, order_cmp);
    size_t hlen = 0;
    char *header = build_header(names, tensors, order, n, meta, &hlen);
    void *scratch = NULL;
    kiln__afile af;
    if (!header) {
        s = kiln_last_status();
        goto done;
    }
    if (!(scratch = malloc(max_bytes ? max_bytes : 1))) {
        s = kiln_error(KILN_ERR_OOM, "safetensors_save: out of memory for %zu bytes", max_bytes);
        goto done;
    }
    /* a temporary beside path, renamed over it when whole (core/file.h): the old file,
     * if any, is never touched before then */
    if ((s = kiln__afile_begin(&af, path, NULL)) != KILN_OK) goto done;
    unsigned char lenbuf[8];
    for (int i = 0; i < 8; i++) lenbuf[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    s = kiln__afile_write(&af, lenbuf, 8);
    if (s == KILN_OK) s = kiln__afile_write(&af, header, hlen);
    /* Tensors on a device come through the scratch buffer: pinned, where that device's
     * backend can pin host memory, for faster copies; as it is where it cannot. */
    const char *dev = NULL;
    for (int k = 0; k < n && !dev; k++)
        if (strcmp(kiln_tensor_device(tensors[k]), "cpu")) dev = kiln_tensor_device(tensors[k]);
    bool pinned = false;
    if (dev && kiln_host_pin(dev, scratch, max_bytes, &pinned) != KILN_OK) kiln_clear_error(); /* only slower */
    for (int k = 0; k < n && s == KILN_OK; k++) {
        const kiln_tensor_t *t = tensors[order[k].index];
        size_t nb = kiln_tensor_nbytes(t);
        s = kiln_tensor_to_host(t, scratch, nb);
        if (s == KILN_OK) s = kiln__afile_write(&af, scratch, nb);
    }
    if (pinned) kiln_host_unpin(dev, scratch);
    if (s == KILN_OK) s = kiln__afile_commit(&af);
    else kiln__afile_abort(&af);
done:
    KILN__FREE(scratch, header, order);
    return s;
}
