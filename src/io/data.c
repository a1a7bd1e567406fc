/* Corpus reading and reproducible random batches. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "core/util.h"
#include "kiln/data.h"

struct kiln_dataset {
    int32_t *ids;
    size_t n, n_train;
};

static kiln_status append_file(const char *path, char **buf, size_t *len, size_t *cap)
{
    FILE *f = fopen(path, "rb");
    if (!f) return kiln_error(KILN_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    char chunk[1 << 16];
    size_t got;
    kiln_status s = KILN_OK;
    while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (!kiln__reserve(buf, cap, *len + got + 2, 1 << 20)) {
            s = kiln_error(KILN_ERR_OOM, "out of memory reading '%s'", path);
            break;
        }
        memcpy(*buf + *len, chunk, got);
        *len += got;
    }
    if (s == KILN_OK && ferror(f)) s = kiln_error(KILN_ERR_IO, "error reading '%s': %s", path, strerror(errno));
    fclose(f);
    return s;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

kiln_status kiln_text_read(const char *path, char **text, size_t *len)
{
    if (!path || !text || !len) return kiln_error(KILN_ERR_ARG, "text_read: NULL argument");
    struct stat st;
    if (stat(path, &st) != 0) return kiln_error(KILN_ERR_IO, "cannot read '%s': %s", path, strerror(errno));
    char *buf = NULL;
    size_t n = 0, cap = 0;
    kiln_status s = KILN_OK;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (!d) return kiln_error(KILN_ERR_IO, "cannot open folder '%s': %s", path, strerror(errno));
        char **names = NULL;
        size_t nn = 0, names_cap = 0;
        struct dirent *e;
        void *tmp;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            if (!KILN__GROW(names, nn, &names_cap, 16, tmp) ||
                !(names[nn] = malloc(strlen(path) + strlen(e->d_name) + 2))) {
                s = kiln_error(KILN_ERR_OOM, "out of memory listing folder '%s'", path);
                break;
            }
            sprintf(names[nn++], "%s/%s", path, e->d_name);
        }
        closedir(d);
        qsort(names, nn, sizeof *names, cmp_str);
        for (size_t i = 0; i < nn; i++) {
            struct stat fs;
            if (s == KILN_OK && stat(names[i], &fs) == 0 && S_ISREG(fs.st_mode)) {
                s = append_file(names[i], &buf, &n, &cap);
                if (s == KILN_OK && n > 0 && buf[n - 1] != '\n') buf[n++] = '\n';
            }
            free(names[i]);
        }
        free(names);
    } else {
        s = append_file(path, &buf, &n, &cap);
    }
    if (s == KILN_OK && n == 0) s = kiln_error(KILN_ERR_FORMAT, "'%s' holds no text", path);
    if (s != KILN_OK) {
        free(buf);
        return s;
    }
    buf[n] = '\0';
    *text = buf;
    *len = n;
    return KILN_OK;
}

kiln_status kiln_dataset_new(const int32_t *ids, size_t n, double val_fraction, kiln_dataset_t **out)
{
    if (!ids || !out || !(val_fraction >= 0 && val_fraction < 1))
        return kiln_error(KILN_ERR_ARG, "dataset_new: NULL ids or val_fraction %g outside [0, 1)", val_fraction);
    kiln_dataset_t *d = calloc(1, sizeof *d);
    if (!d || !(d->ids = malloc(sizeof(int32_t) * (n ? n : 1)))) {
        free(d);
        return kiln_error(KILN_ERR_OOM, "dataset_new: out of memory for %zu tokens", n);
    }
    memcpy(d->ids, ids, sizeof(int32_t) * n);
    d->n = n;
    d->n_train = n - (size_t)((double)n * val_fraction);
    *out = d;
    return KILN_OK;
}

void kiln_dataset_free(kiln_dataset_t *d)
{
    if (!d) return;
    free(d->ids);
    free(d);
}

size_t kiln_dataset_len(const kiln_dataset_t *d, kiln_data_split split)
{
    return !d ? 0 : split == KILN_SPLIT_TRAIN ? d->n_train : d->n - d->n_train;
}

kiln_status kiln_dataset_batch(const kiln_dataset_t *d, kiln_data_split split, int B, int T, uint64_t seed, int64_t step,
                               int rank, int world, kiln_tensor_t **x, kiln_tensor_t **y)
{
    if (!d || !x || !y || B < 1 || T < 1 || world < 1 || rank < 0 || rank >= world)
        return kiln_error(KILN_ERR_ARG, "dataset_batch: bad arguments (B=%d T=%d rank=%d world=%d)", B, T, rank, world);
    size_t base = split == KILN_SPLIT_TRAIN ? 0 : d->n_train, len = kiln_dataset_len(d, split);
    if (len < (size_t)T + 1)
        return kiln_error(KILN_ERR_ARG, "dataset_batch: the %s split has %zu tokens, fewer than T + 1 = %d",
                          split == KILN_SPLIT_TRAIN ? "train" : "validation", len, T + 1);
    int64_t *xs = malloc(sizeof(int64_t) * (size_t)B * (size_t)T), *ys = malloc(sizeof(int64_t) * (size_t)B * (size_t)T);
    if (!xs || !ys) {
        free(xs);
        free(ys);
        return kiln_error(KILN_ERR_OOM, "dataset_batch: out of memory");
    }
    uint64_t range = len - (size_t)T; /* window starts 0 .. len - T - 1: T + 1 tokens each */
    for (int b = 0; b < B; b++) {
        uint64_t w = (uint64_t)rank * (uint64_t)B + (uint64_t)b;
        /* A window's offset depends only on its coordinates. */
        uint64_t h = kiln__splitmix64(seed ^ kiln__splitmix64((uint64_t)step * 2 + (uint64_t)split) ^
                                      kiln__splitmix64(w + 0x1234567ULL));
        size_t off = base + (size_t)(h % range);
        for (int t = 0; t < T; t++) {
            xs[(size_t)b * T + t] = d->ids[off + t];
            ys[(size_t)b * T + t] = d->ids[off + t + 1];
        }
    }
    int64_t shape[2] = {B, T};
    *x = kiln_from_data(xs, shape, 2, KILN_DTYPE_I64);
    *y = *x ? kiln_from_data(ys, shape, 2, KILN_DTYPE_I64) : NULL;
    free(xs);
    free(ys);
    return *x && *y ? KILN_OK : kiln_last_status();
}

double kiln_dataset_unigram_entropy(const kiln_dataset_t *d, int vocab_size)
{
    if (!d || vocab_size < 1 || d->n_train == 0) return NAN;
    double *count = calloc((size_t)vocab_size, sizeof *count);
    if (!count) return NAN;
    for (size_t i = 0; i < d->n_train; i++)
        if (d->ids[i] >= 0 && d->ids[i] < vocab_size) count[d->ids[i]] += 1;
    double h = 0, n = (double)d->n_train;
    for (int v = 0; v < vocab_size; v++)
        if (count[v] > 0) h -= count[v] / n * log(count[v] / n);
    free(count);
    return h;
}
