/* Reading GGUF files (kiln/gguf.h). The file is mapped read-only; the header, the
 * metadata and the tensor table are parsed once by a cursor that never reads past the
 * mapping, and every count, length, offset and shape is checked against what is left
 * of the file before anything is allocated for it, so a hostile file costs no more
 * memory than its own size. Metadata strings are copied (NUL-terminated) into one
 * arena; tensor data stays in the mapping. The GGUF layout (version 2 and 3, little-
 * endian): magic "GGUF", u32 version, u64 tensor count, u64 key count, the keys (a
 * string, a u32 type, the value), the tensors (name, u32 dims, u64 ne[dims], u32 type,
 * u64 offset), padding to general.alignment (default 32), the data. */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "core/file.h"
#include "core/quant.h"
#include "kiln/gguf.h"

#define MAX_DIMS 4
#define DEFAULT_ALIGN 32

typedef struct {
    char *key;
    kiln_gguf_type type, arr_type;
    uint64_t n;        /* array elements; 1 for a scalar */
    const uint8_t *at; /* the value (an array's first element) in the mapping */
    char *str;         /* a string value, copied */
    char **strs;       /* an array of strings, copied */
} kv_row;

struct kiln_gguf {
    char *path;
    uint8_t *map;
    size_t size;
    uint32_t version;
    int64_t n_kv, n_tensors;
    kv_row *kv;
    kiln_gguf_tensor *tensors;
    char **names; /* the tensors' names, owned */
};

/* ---- the cursor ---- */

typedef struct {
    const uint8_t *p;
    size_t n, at;
    const char *path;
    const char *what; /* the key or tensor being read, for messages */
    kiln_status st;
} cursor;

static bool fail(cursor *c, kiln_status s, const char *fmt, const char *detail)
{
    if (c->st == KILN_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, fmt, detail ? detail : "");
        c->st = kiln_error(s, "%s: %s%s%s", c->path, c->what ? c->what : "", c->what ? ": " : "", msg);
    }
    return false;
}

static bool need(cursor *c, uint64_t bytes)
{
    if (c->st != KILN_OK) return false;
    if (bytes > c->n - c->at) {
        char at[96];
        snprintf(at, sizeof at, "%zu bytes and ends inside what starts at byte %zu", c->n, c->at);
        return fail(c, KILN_ERR_FORMAT, "the file is %s (truncated?)", at);
    }
    return true;
}

static uint64_t le(const uint8_t *p, int bytes)
{
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static uint64_t take(cursor *c, int bytes)
{
    if (!need(c, (uint64_t)bytes)) return 0;
    uint64_t v = le(c->p + c->at, bytes);
    c->at += (size_t)bytes;
    return v;
}

/* A GGUF string: u64 length, bytes. Returns a pointer into the mapping and its length. */
static const uint8_t *take_str(cursor *c, uint64_t *len)
{
    *len = take(c, 8);
    if (!need(c, *len)) return NULL;
    const uint8_t *s = c->p + c->at;
    c->at += (size_t)*len;
    return s;
}

static char *copy_str(cursor *c, const uint8_t *s, uint64_t len)
{
    char *out = malloc((size_t)len + 1);
    if (!out) {
        fail(c, KILN_ERR_OOM, "out of memory%s", NULL);
        return NULL;
    }
    memcpy(out, s, (size_t)len);
    out[len] = '\0';
    return out;
}

/* ---- metadata ---- */

static int scalar_size(kiln_gguf_type t)
{
    switch (t) {
    case KILN_GGUF_U8: case KILN_GGUF_I8: case KILN_GGUF_BOOL: return 1;
    case KILN_GGUF_U16: case KILN_GGUF_I16: return 2;
    case KILN_GGUF_U32: case KILN_GGUF_I32: case KILN_GGUF_F32: return 4;
    case KILN_GGUF_U64: case KILN_GGUF_I64: case KILN_GGUF_F64: return 8;
    default: return 0;
    }
}

const char *kiln_gguf_type_name(kiln_gguf_type t)
{
    static const char *names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64",
                                  "i64", "f64"};
    return (unsigned)t < sizeof names / sizeof *names ? names[t] : "?";
}

static bool read_value(cursor *c, kv_row *r)
{
    r->type = (kiln_gguf_type)take(c, 4);
    r->n = 1;
    r->arr_type = r->type;
    if (r->type == KILN_GGUF_ARRAY) {
        r->arr_type = (kiln_gguf_type)take(c, 4);
        r->n = take(c, 8);
        if (c->st != KILN_OK) return false;
        if (r->arr_type == KILN_GGUF_ARRAY) return fail(c, KILN_ERR_UNSUPPORTED, "an array of arrays (kiln reads "
                                                                              "arrays of numbers and strings)%s", NULL);
    }
    r->at = c->p + c->at;
    if (r->arr_type == KILN_GGUF_STRING) {
        /* every string takes at least its 8-byte length: a count the file cannot hold is refused before
         * anything is allocated for it */
        if (r->n > (c->n - c->at) / 8) return fail(c, KILN_ERR_FORMAT, "%sthe array's length is more than the "
                                                                      "file can hold", "");
        if (r->type == KILN_GGUF_ARRAY && !(r->strs = calloc((size_t)r->n + 1, sizeof *r->strs)))
            return fail(c, KILN_ERR_OOM, "out of memory%s", NULL);
        for (uint64_t i = 0; i < r->n && c->st == KILN_OK; i++) {
            uint64_t len;
            const uint8_t *s = take_str(c, &len);
            char *copy = s ? copy_str(c, s, len) : NULL;
            if (r->type == KILN_GGUF_ARRAY) r->strs[i] = copy;
            else r->str = copy;
        }
        return c->st == KILN_OK;
    }
    int size = scalar_size(r->arr_type);
    if (!size) {
        char t[32];
        snprintf(t, sizeof t, "%u", (unsigned)r->arr_type);
        return fail(c, KILN_ERR_FORMAT, "value type %s is not one of GGUF's (0 to 12)", t);
    }
    if (r->n > (c->n - c->at) / (uint64_t)size) return need(c, UINT64_MAX);
    c->at += (size_t)(r->n * (uint64_t)size);
    if (r->arr_type == KILN_GGUF_BOOL)
        for (uint64_t i = 0; i < r->n; i++)
            if (r->at[i] > 1) return fail(c, KILN_ERR_FORMAT, "a bool that is neither 0 nor 1%s", NULL);
    return true;
}

int64_t kiln_gguf_find_key(const kiln_gguf_t *g, const char *key)
{
    for (int64_t i = 0; g && key && i < g->n_kv; i++)
        if (!strcmp(g->kv[i].key, key)) return i;
    return -1;
}

/* ---- tensors ---- */

static bool read_tensor(cursor *c, kiln_gguf_t *g, int64_t i)
{
    kiln_gguf_tensor *t = &g->tensors[i];
    uint64_t len;
    const uint8_t *s = take_str(c, &len);
    if (!s) return false;
    if (!(g->names[i] = copy_str(c, s, len))) return false;
    t->name = g->names[i];
    c->what = t->name;
    if (memchr(t->name, '\0', (size_t)len)) return fail(c, KILN_ERR_FORMAT, "the name holds a NUL byte%s", NULL);
    uint32_t ndim = (uint32_t)take(c, 4);
    if (c->st == KILN_OK && (ndim < 1 || ndim > MAX_DIMS)) {
        char d[16];
        snprintf(d, sizeof d, "%u", ndim);
        return fail(c, KILN_ERR_FORMAT, "%s dimensions (GGUF tensors have 1 to 4)", d);
    }
    uint64_t ne[MAX_DIMS], elements = 1;
    for (uint32_t d = 0; d < ndim; d++) {
        ne[d] = take(c, 8);
        if (c->st != KILN_OK) return false;
        if (ne[d] == 0 || ne[d] > (uint64_t)INT64_MAX || elements > (uint64_t)INT64_MAX / ne[d])
            return fail(c, KILN_ERR_FORMAT, "a shape with a zero dimension, or more than 2^63 elements%s", NULL);
        elements *= ne[d];
    }
    t->type = (int)take(c, 4);
    t->offset = take(c, 8);
    if (c->st != KILN_OK) return false;
    int64_t be, bb;
    if (!kiln__quant_block(t->type, &be, &bb)) {
        char n[16];
        snprintf(n, sizeof n, "%d", t->type);
        return fail(c, KILN_ERR_FORMAT, "tensor type %s is not one of ggml's", n);
    }
    if (ne[0] % (uint64_t)be) {
        char m[96];
        snprintf(m, sizeof m, "rows of %llu values do not divide into %s blocks of %lld", (unsigned long long)ne[0],
                 kiln__quant_name(t->type), (long long)be);
        return fail(c, KILN_ERR_FORMAT, "%s", m);
    }
    t->ndim = (int)ndim;
    for (uint32_t d = 0; d < ndim; d++) t->shape[ndim - 1 - d] = (int64_t)ne[d]; /* kiln's order */
    t->elements = (int64_t)elements;
    uint64_t blocks = elements / (uint64_t)be;
    if (blocks > UINT64_MAX / (uint64_t)bb) return fail(c, KILN_ERR_FORMAT, "its size overflows 64 bits%s", NULL);
    t->bytes = blocks * (uint64_t)bb;
    c->what = NULL;
    return true;
}

/* After the table: the data's start, and every tensor inside the data, aligned. */
static bool place_tensors(cursor *c, kiln_gguf_t *g)
{
    uint64_t align = DEFAULT_ALIGN;
    int64_t k = kiln_gguf_find_key(g, "general.alignment");
    if (k >= 0) {
        c->what = "general.alignment";
        if (g->kv[k].type != KILN_GGUF_U32) return fail(c, KILN_ERR_FORMAT, "must be a u32, not %s",
                                                        kiln_gguf_type_name(g->kv[k].type));
        align = le(g->kv[k].at, 4);
        if (align == 0 || (align & (align - 1))) return fail(c, KILN_ERR_FORMAT, "must be a power of two%s", NULL);
        c->what = NULL;
    }
    uint64_t data = ((uint64_t)c->at + align - 1) / align * align;
    if (g->n_tensors > 0 && data > c->n) return need(c, data - c->at);
    for (int64_t i = 0; i < g->n_tensors; i++) {
        kiln_gguf_tensor *t = &g->tensors[i];
        c->what = t->name;
        if (t->offset % align) {
            char a[32];
            snprintf(a, sizeof a, "%llu", (unsigned long long)align);
            return fail(c, KILN_ERR_FORMAT, "its data offset is not a multiple of the alignment, %s", a);
        }
        uint64_t room = c->n - data;
        if (t->offset > room || t->bytes > room - t->offset) {
            char m[160];
            snprintf(m, sizeof m, "its %llu bytes at data offset %llu run past the end of the file (%zu bytes)",
                     (unsigned long long)t->bytes, (unsigned long long)t->offset, c->n);
            return fail(c, KILN_ERR_FORMAT, "%s", m);
        }
        t->offset += data;
        t->data = c->p + t->offset;
        for (int64_t j = 0; j < i; j++)
            if (!strcmp(g->tensors[j].name, t->name)) return fail(c, KILN_ERR_FORMAT, "the name is given twice%s", NULL);
    }
    c->what = NULL;
    return true;
}

/* ---- opening ---- */

static kiln_status parse(kiln_gguf_t *g)
{
    cursor c = {.p = g->map, .n = g->size, .path = g->path};
    if (g->size < 4 || memcmp(g->map, "GGUF", 4)) {
        fail(&c, KILN_ERR_FORMAT, "not a GGUF file (it does not start with \"GGUF\")%s", NULL);
        return c.st;
    }
    c.at = 4;
    g->version = (uint32_t)take(&c, 4);
    if (c.st == KILN_OK && g->version != 2 && g->version != 3) {
        char v[96];
        snprintf(v, sizeof v, "%u%s", g->version,
                 (g->version & 0xFFFF) == 0 ? " (a big-endian file? kiln reads little-endian ones)" : "");
        fail(&c, KILN_ERR_UNSUPPORTED, "GGUF version %s is not read (2 and 3 are)", v);
    }
    uint64_t n_tensors = take(&c, 8), n_kv = take(&c, 8);
    if (c.st != KILN_OK) return c.st;
    /* a key takes at least 8 + 1 + 4 bytes, a tensor 8 + 4 + 8 + 4 + 8 */
    if (n_kv > (c.n - c.at) / 13 || n_tensors > (c.n - c.at) / 32) {
        char m[160];
        snprintf(m, sizeof m, "%llu keys and %llu tensors, more than its %zu bytes can hold", (unsigned long long)n_kv,
                 (unsigned long long)n_tensors, c.n);
        fail(&c, KILN_ERR_FORMAT, "it says it holds %s (truncated?)", m);
        return c.st;
    }
    if (!(g->kv = calloc((size_t)n_kv + 1, sizeof *g->kv)) ||
        !(g->tensors = calloc((size_t)n_tensors + 1, sizeof *g->tensors)) ||
        !(g->names = calloc((size_t)n_tensors + 1, sizeof *g->names)))
        return kiln_error(KILN_ERR_OOM, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < n_kv && c.st == KILN_OK; i++) {
        uint64_t len;
        const uint8_t *s = take_str(&c, &len);
        if (!s || !(g->kv[i].key = copy_str(&c, s, len))) break;
        g->n_kv = (int64_t)i + 1;
        c.what = g->kv[i].key;
        if (memchr(g->kv[i].key, '\0', (size_t)len)) fail(&c, KILN_ERR_FORMAT, "a key holds a NUL byte%s", NULL);
        else if (kiln_gguf_find_key(g, g->kv[i].key) != (int64_t)i) fail(&c, KILN_ERR_FORMAT, "the key is given twice%s", NULL);
        else read_value(&c, &g->kv[i]);
        c.what = NULL;
    }
    for (uint64_t i = 0; i < n_tensors && c.st == KILN_OK; i++) {
        g->n_tensors = (int64_t)i + 1;
        read_tensor(&c, g, (int64_t)i);
    }
    if (c.st == KILN_OK) place_tensors(&c, g);
    return c.st;
}

kiln_status kiln_gguf_open(const char *path, kiln_gguf_t **out)
{
    if (!path || !out) return kiln_error(KILN_ERR_ARG, "kiln_gguf_open: path and out must not be NULL");
    *out = NULL;
    int64_t size = 0;
    int fd = kiln__file_open_read(path, NULL, &size);
    if (fd < 0) return kiln_last_status();
    kiln_gguf_t *g = calloc(1, sizeof *g);
    kiln_status s = g && (g->path = strdup(path)) ? KILN_OK : kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
    if (s == KILN_OK && size == 0) s = kiln_error(KILN_ERR_FORMAT, "%s: the file is empty, not a GGUF file", path);
    if (s == KILN_OK) {
        g->size = (size_t)size;
        void *m = mmap(NULL, g->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) s = kiln_error(KILN_ERR_IO, "%s: cannot map it: %s", path, strerror(errno));
        else g->map = m;
    }
    close(fd);
    if (s == KILN_OK) s = parse(g);
    if (s != KILN_OK) {
        kiln_gguf_free(g);
        return s;
    }
    *out = g;
    return KILN_OK;
}

void kiln_gguf_free(kiln_gguf_t *g)
{
    if (!g) return;
    for (int64_t i = 0; g->kv && i < g->n_kv; i++) {
        free(g->kv[i].key);
        free(g->kv[i].str);
        for (uint64_t j = 0; g->kv[i].strs && j < g->kv[i].n; j++) free(g->kv[i].strs[j]);
        free(g->kv[i].strs);
    }
    for (int64_t i = 0; g->names && i < g->n_tensors; i++) free(g->names[i]);
    if (g->map) munmap(g->map, g->size);
    free(g->kv);
    free(g->tensors);
    free(g->names);
    free(g->path);
    free(g);
}

uint32_t kiln_gguf_version(const kiln_gguf_t *g) { return g ? g->version : 0; }
const char *kiln_gguf_path(const kiln_gguf_t *g) { return g ? g->path : NULL; }
int64_t kiln_gguf_n_keys(const kiln_gguf_t *g) { return g ? g->n_kv : 0; }
const char *kiln_gguf_key(const kiln_gguf_t *g, int64_t i) { return g && i >= 0 && i < g->n_kv ? g->kv[i].key : NULL; }

static const kv_row *row_at(const kiln_gguf_t *g, int64_t i) { return g && i >= 0 && i < g->n_kv ? &g->kv[i] : NULL; }
kiln_gguf_type kiln_gguf_key_type(const kiln_gguf_t *g, int64_t i) { return row_at(g, i) ? row_at(g, i)->type : (kiln_gguf_type)-1; }
kiln_gguf_type kiln_gguf_array_type(const kiln_gguf_t *g, int64_t i) { return row_at(g, i) ? row_at(g, i)->arr_type : (kiln_gguf_type)-1; }
uint64_t kiln_gguf_array_len(const kiln_gguf_t *g, int64_t i) { return row_at(g, i) ? row_at(g, i)->n : 0; }

/* ---- values ---- */

static bool is_int(kiln_gguf_type t) { return t <= KILN_GGUF_I32 || t == KILN_GGUF_U64 || t == KILN_GGUF_I64; }
static bool is_real(kiln_gguf_type t) { return t == KILN_GGUF_F32 || t == KILN_GGUF_F64; }

/* Element i of an integer value as int64; false for a u64 above INT64_MAX. */
static bool int_at(const kv_row *r, uint64_t i, int64_t *out)
{
    int size = scalar_size(r->arr_type);
    uint64_t v = le(r->at + i * (uint64_t)size, size);
    bool sgn = r->arr_type == KILN_GGUF_I8 || r->arr_type == KILN_GGUF_I16 || r->arr_type == KILN_GGUF_I32 ||
               r->arr_type == KILN_GGUF_I64;
    if (sgn && size < 8 && (v >> (size * 8 - 1)) & 1) v |= ~0ull << (size * 8); /* sign-extend */
    if (!sgn && v > (uint64_t)INT64_MAX) return false;
    *out = (int64_t)v;
    return true;
}

static double real_at(const kv_row *r, uint64_t i)
{
    if (r->arr_type == KILN_GGUF_F32) {
        uint32_t b = (uint32_t)le(r->at + i * 4, 4);
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    uint64_t b = le(r->at + i * 8, 8);
    double d;
    memcpy(&d, &b, 8);
    return d;
}

/* The key's row, if it is there with a value of the wanted kind (array or not); else the error. */
static const kv_row *want(const kiln_gguf_t *g, const char *key, bool array, const char *kind, kiln_status *s)
{
    const kv_row *r = row_at(g, kiln_gguf_find_key(g, key));
    *s = KILN_OK;
    if (!g || !key) *s = kiln_error(KILN_ERR_ARG, "kiln_gguf_get: g and key must not be NULL");
    else if (!r) *s = kiln_error(KILN_ERR_FORMAT, "%s: the file has no key '%s'", g->path, key);
    else if ((r->type == KILN_GGUF_ARRAY) != array)
        *s = kiln_error(KILN_ERR_FORMAT, "%s: %s is %s%s, not %s", g->path, key, r->type == KILN_GGUF_ARRAY ? "an array of " : "a ",
                        kiln_gguf_type_name(r->arr_type), kind);
    return *s == KILN_OK ? r : NULL;
}

static kiln_status wrong_type(const kiln_gguf_t *g, const char *key, const kv_row *r, const char *kind)
{
    return kiln_error(KILN_ERR_FORMAT, "%s: %s holds %s, not %s", g->path, key, kiln_gguf_type_name(r->arr_type), kind);
}

kiln_status kiln_gguf_get_int(const kiln_gguf_t *g, const char *key, int64_t *out)
{
    kiln_status s;
    const kv_row *r = want(g, key, false, "an integer", &s);
    if (!r) return s;
    if (!is_int(r->arr_type)) return wrong_type(g, key, r, "an integer");
    if (!int_at(r, 0, out)) return kiln_error(KILN_ERR_FORMAT, "%s: %s is above 2^63 - 1", g->path, key);
    return KILN_OK;
}

kiln_status kiln_gguf_get_real(const kiln_gguf_t *g, const char *key, double *out)
{
    kiln_status s;
    const kv_row *r = want(g, key, false, "a real number", &s);
    if (!r) return s;
    if (!is_real(r->arr_type)) return wrong_type(g, key, r, "a real number (f32 or f64)");
    *out = real_at(r, 0);
    return KILN_OK;
}

kiln_status kiln_gguf_get_bool(const kiln_gguf_t *g, const char *key, bool *out)
{
    kiln_status s;
    const kv_row *r = want(g, key, false, "a bool", &s);
    if (!r) return s;
    if (r->arr_type != KILN_GGUF_BOOL) return wrong_type(g, key, r, "a bool");
    *out = r->at[0] == 1;
    return KILN_OK;
}

kiln_status kiln_gguf_get_str(const kiln_gguf_t *g, const char *key, const char **out)
{
    kiln_status s;
    const kv_row *r = want(g, key, false, "a string", &s);
    if (!r) return s;
    if (r->arr_type != KILN_GGUF_STRING) return wrong_type(g, key, r, "a string");
    uint64_t len = le(r->at, 8);
    if (strlen(r->str) != len) return kiln_error(KILN_ERR_FORMAT, "%s: %s holds a NUL byte", g->path, key);
    *out = r->str;
    return KILN_OK;
}

kiln_status kiln_gguf_get_strs(const kiln_gguf_t *g, const char *key, const char *const **out, size_t *n)
{
    kiln_status s;
    const kv_row *r = want(g, key, true, "an array", &s);
    if (!r) return s;
    if (r->arr_type != KILN_GGUF_STRING) return wrong_type(g, key, r, "strings");
    *out = (const char *const *)r->strs;
    *n = (size_t)r->n;
    return KILN_OK;
}

kiln_status kiln_gguf_get_ints(const kiln_gguf_t *g, const char *key, int64_t **out, size_t *n)
{
    kiln_status s;
    const kv_row *r = want(g, key, true, "an array", &s);
    if (!r) return s;
    if (!is_int(r->arr_type)) return wrong_type(g, key, r, "integers");
    int64_t *v = malloc(sizeof *v * ((size_t)r->n + 1));
    if (!v) return kiln_error(KILN_ERR_OOM, "%s: out of memory reading %s", g->path, key);
    for (uint64_t i = 0; i < r->n; i++)
        if (!int_at(r, i, &v[i])) {
            free(v);
            return kiln_error(KILN_ERR_FORMAT, "%s: %s[%llu] is above 2^63 - 1", g->path, key, (unsigned long long)i);
        }
    *out = v;
    *n = (size_t)r->n;
    return KILN_OK;
}

kiln_status kiln_gguf_get_reals(const kiln_gguf_t *g, const char *key, double **out, size_t *n)
{
    kiln_status s;
    const kv_row *r = want(g, key, true, "an array", &s);
    if (!r) return s;
    if (!is_real(r->arr_type)) return wrong_type(g, key, r, "real numbers");
    double *v = malloc(sizeof *v * ((size_t)r->n + 1));
    if (!v) return kiln_error(KILN_ERR_OOM, "%s: out of memory reading %s", g->path, key);
    for (uint64_t i = 0; i < r->n; i++) v[i] = real_at(r, i);
    *out = v;
    *n = (size_t)r->n;
    return KILN_OK;
}

/* ---- tensors ---- */

int64_t kiln_gguf_n_tensors(const kiln_gguf_t *g) { return g ? g->n_tensors : 0; }

int64_t kiln_gguf_find_tensor(const kiln_gguf_t *g, const char *name)
{
    for (int64_t i = 0; g && name && i < g->n_tensors; i++)
        if (!strcmp(g->tensors[i].name, name)) return i;
    return -1;
}

kiln_status kiln_gguf_tensor_at(const kiln_gguf_t *g, int64_t i, kiln_gguf_tensor *out)
{
    if (!g || !out || i < 0 || i >= g->n_tensors)
        return kiln_error(KILN_ERR_INDEX, "kiln_gguf_tensor_at: tensor %lld of %lld", (long long)i,
                          (long long)kiln_gguf_n_tensors(g));
    *out = g->tensors[i];
    return KILN_OK;
}

const char *kiln_gguf_tensor_type_name(int type) { return kiln__quant_name(type); }

kiln_status kiln_gguf_read_f32(const kiln_gguf_t *g, int64_t i, float *out, int64_t n)
{
    kiln_gguf_tensor t;
    kiln_status s = kiln_gguf_tensor_at(g, i, &t);
    if (s != KILN_OK) return s;
    if (!out || n != t.elements)
        return kiln_error(KILN_ERR_ARG, "%s: %s has %lld values, the buffer %lld", g->path, t.name,
                          (long long)t.elements, (long long)n);
    if (!kiln__quant_readable(t.type))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s is of type %s, which kiln does not read (F32, F16, BF16, "
                          "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS are)",
                          g->path, t.name, kiln__quant_name(t.type));
    kiln__quant_dequant(t.type, t.data, out, n);
    return KILN_OK;
}

kiln_tensor_t *kiln_gguf_tensor_f32(const kiln_gguf_t *g, int64_t i)
{
    kiln_gguf_tensor t;
    if (kiln_gguf_tensor_at(g, i, &t) != KILN_OK) return NULL;
    if ((uint64_t)t.elements > SIZE_MAX / sizeof(float)) {
        kiln_error(KILN_ERR_OOM, "%s: %s is too large for this machine", g->path, t.name);
        return NULL;
    }
    float *buf = malloc((size_t)t.elements * sizeof *buf);
    if (!buf) {
        kiln_error(KILN_ERR_OOM, "%s: out of memory for %s (%lld values)", g->path, t.name, (long long)t.elements);
        return NULL;
    }
    kiln_tensor_t *out = NULL;
    if (kiln_gguf_read_f32(g, i, buf, t.elements) != KILN_OK ||
        !(out = kiln_tensor_wrap(buf, t.shape, t.ndim, KILN_DTYPE_F32, free, buf)))
        free(buf);
    return out;
}
