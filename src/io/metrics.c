/* Training metrics: JSON lines in and out, and the charts drawn from them (chart.c
 * draws; this file says what).
 *
 * JSON goes through jansson rather than hand-written printf/scanf: a metrics file is
 * also read and written by other tools (Python notebooks, jq, a dashboard), so the
 * reader must take any valid JSON (escapes, exponents, spacing, key order, unknown
 * keys) and report bad JSON with a position; jansson does that, and it formats numbers
 * the same way whatever the process locale is.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "core/file.h"
#include "core/util.h"
#include "io/chart_impl.h"
#include "kiln/metrics.h"

/* ---- the fields of a row: one table, walked by the writer and the reader ---- */

typedef struct {
    const char *name;
    size_t offset; /* of a double in kiln_metrics_row */
} field_def;

static const field_def FIELDS[] = {
    {"loss", offsetof(kiln_metrics_row, loss)},
    {"val_loss", offsetof(kiln_metrics_row, val_loss)},
    {"lr", offsetof(kiln_metrics_row, lr)},
    {"tokens_per_s", offsetof(kiln_metrics_row, tokens_per_s)},
    {"grad_norm", offsetof(kiln_metrics_row, grad_norm)},
    {"ms_per_step", offsetof(kiln_metrics_row, ms_per_step)},
};
#define NFIELDS (sizeof FIELDS / sizeof FIELDS[0])

static double *field_ptr(kiln_metrics_row *r, size_t i) { return (double *)((char *)r + FIELDS[i].offset); }
static double field_get(const kiln_metrics_row *r, size_t i)
{
    return *(const double *)((const char *)r + FIELDS[i].offset);
}

/* ---- writing ---- */

struct kiln_metrics {
    FILE *f;
    char *path; /* for error messages */
};

kiln_status kiln_metrics_open(const char *path, bool append, kiln_metrics_t **out)
{
    if (!path || !out) return kiln_error(KILN_ERR_ARG, "metrics_open: path and out must not be NULL");
    *out = NULL;
    /* A regular file only (core/file.h: a FIFO would block, a device swallow the rows);
     * "a+" so that we can look at the last byte; writes still always go to the end. */
    int fd = kiln__file_open_append(path, NULL);
    if (fd < 0) return kiln_last_status();
    FILE *f = !append && ftruncate(fd, 0) != 0 ? NULL : fdopen(fd, "a+");
    if (!f) {
        kiln_status s = kiln_error(KILN_ERR_IO, "cannot open %s: %s", path, strerror(errno));
        close(fd);
        return s;
    }
    if (append && fseek(f, -1, SEEK_END) == 0) {
        int last = fgetc(f);
        /* A run that died mid-write leaves a partial line; start ours on a fresh one so
         * that only the broken line is malformed, not the first new one too. */
        if (last != EOF && last != '\n' && fputc('\n', f) == EOF) {
            fclose(f);
            return kiln_error(KILN_ERR_IO, "cannot write %s: %s", path, strerror(errno));
        }
    }
    kiln_metrics_t *m = calloc(1, sizeof *m);
    char *p = strdup(path);
    if (!m || !p) {
        KILN__FREE(m, p);
        fclose(f);
        return kiln_error(KILN_ERR_OOM, "metrics_open: out of memory");
    }
    m->f = f;
    m->path = p;
    *out = m;
    return KILN_OK;
}

kiln_status kiln_metrics_write(kiln_metrics_t *m, const kiln_metrics_row *row)
{
    if (!m || !row) return kiln_error(KILN_ERR_ARG, "metrics_write: metrics and row must not be NULL");
    json_t *obj = json_object();
    if (!obj || json_object_set_new(obj, "step", json_integer((json_int_t)row->step)) != 0) goto oom;
    for (size_t i = 0; i < NFIELDS; i++) {
        double v = field_get(row, i);
        /* JSON has no NaN or infinity; an unmeasured field is simply absent. */
        if (!isfinite(v)) continue;
        if (json_object_set_new(obj, FIELDS[i].name, json_real(v)) != 0) goto oom;
    }
    if (row->extra) {
        json_error_t err;
        json_t *x = json_loads(row->extra, 0, &err);
        bool ok = x && json_is_object(x) && json_object_update(obj, x) == 0;
        json_decref(x);
        if (!ok) {
            json_decref(obj);
            return kiln_error(KILN_ERR_ARG, "metrics_write: the row's extra members are not a JSON object (%s)",
                              x ? "not an object" : err.text);
        }
    }
    /* Ten significant digits keep a line short and readable and lose nothing a metric
     * needs; jansson's default of 17 writes 2.31 as 2.3100000000000001. */
    char *line = json_dumps(obj, JSON_COMPACT | JSON_REAL_PRECISION(10));
    json_decref(obj);
    if (!line) return kiln_error(KILN_ERR_OOM, "metrics_write: out of memory");
    int bad = fputs(line, m->f) == EOF || fputc('\n', m->f) == EOF || fflush(m->f) != 0;
    free(line);
    if (bad) return kiln_error(KILN_ERR_IO, "cannot write %s: %s", m->path, strerror(errno));
    return KILN_OK;
oom:
    json_decref(obj);
    return kiln_error(KILN_ERR_OOM, "metrics_write: out of memory");
}

void kiln_metrics_close(kiln_metrics_t *m)
{
    if (!m) return;
    fclose(m->f);
    KILN__FREE(m->path, m);
}

/* ---- reading ---- */

static bool is_blank(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n') return false;
    return true;
}

/* Called with each non-blank line of a metrics file, decoded (an object with an integer
 * "step"); returns KILN_OK, KILN_ERR_FORMAT with the reason written into why, or
 * KILN_ERR_OOM. */
typedef kiln_status (*line_fn)(json_t *obj, int64_t step, void *ctx, char *why, size_t why_n);

/* Walks the lines of path; a malformed one gives KILN_ERR_FORMAT naming the file and the
 * line number. */
static kiln_status each_line(const char *path, line_fn fn, void *ctx)
{
    FILE *f = kiln__file_fopen_read(path, NULL);
    if (!f) return kiln_last_status();
    size_t lineno = 0;
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t len;
    kiln_status st = KILN_OK;
    errno = 0;
    while (st == KILN_OK && (len = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        if (is_blank(line, (size_t)len)) continue;
        json_error_t jerr;
        json_t *obj = json_loadb(line, (size_t)len, JSON_REJECT_DUPLICATES, &jerr);
        if (!obj) {
            st = kiln_error(KILN_ERR_FORMAT, "%s:%zu: not valid JSON (column %d): %s", path, lineno, jerr.column,
                            jerr.text);
            break;
        }
        char why[160];
        json_t *step = json_object_get(obj, "step");
        kiln_status got = KILN_ERR_FORMAT;
        if (!json_is_object(obj))
            snprintf(why, sizeof why, "expected a JSON object");
        else if (!json_is_integer(step))
            snprintf(why, sizeof why, step ? "\"step\" must be an integer" : "no \"step\"");
        else
            got = fn(obj, (int64_t)json_integer_value(step), ctx, why, sizeof why);
        json_decref(obj);
        if (got == KILN_ERR_OOM) st = kiln_error(KILN_ERR_OOM, "out of memory at %s:%zu", path, lineno);
        else if (got != KILN_OK) st = kiln_error(got, "%s:%zu: %s", path, lineno, why);
    }
    if (st == KILN_OK && ferror(f))
        st = kiln_error(KILN_ERR_IO, "cannot read %s: %s", path, strerror(errno ? errno : EIO));
    free(line);
    fclose(f);
    return st;
}

typedef struct {
    kiln_metrics_row *rows;
    size_t n, cap;
} row_list;

/* A line as a row of the known fields. */
static kiln_status row_from_json(json_t *obj, int64_t step, void *ctx, char *why, size_t why_n)
{
    row_list *l = ctx;
    void *tmp;
    if (!KILN__GROW(l->rows, l->n, &l->cap, 256, tmp)) return KILN_ERR_OOM;
    kiln_metrics_row *r = &l->rows[l->n];
    r->step = step;
    r->extra = NULL;
    for (size_t i = 0; i < NFIELDS; i++) {
        json_t *v = json_object_get(obj, FIELDS[i].name);
        if (!v || json_is_null(v)) {
            *field_ptr(r, i) = NAN;
        } else if (json_is_number(v)) {
            *field_ptr(r, i) = json_number_value(v);
        } else {
            snprintf(why, why_n, "\"%s\" must be a number", FIELDS[i].name);
            return KILN_ERR_FORMAT;
        }
    }
    l->n++;
    return KILN_OK;
}

kiln_status kiln_metrics_read(const char *path, kiln_metrics_row **rows, size_t *n)
{
    if (!path || !rows || !n) return kiln_error(KILN_ERR_ARG, "metrics_read: path, rows and n must not be NULL");
    *rows = NULL;
    *n = 0;
    row_list l = {0};
    kiln_status st = each_line(path, row_from_json, &l);
    if (st != KILN_OK) {
        free(l.rows);
        return st;
    }
    *rows = l.rows; /* NULL when there is no row: it grows with the first */
    *n = l.n;
    return KILN_OK;
}

/* ---- the charts ---- */

kiln_status kiln_metrics_plot_svg(const kiln_metrics_row *rows, size_t n, const char *title, double baseline,
                                  const char *baseline_label, const char *svg_path)
{
    if (!svg_path || (n > 0 && !rows))
        return kiln_error(KILN_ERR_ARG, "metrics_plot_svg: svg_path must be given, and rows when n > 0");
    double *x = malloc(sizeof *x * (n * 3 + 1)), *loss = x + n, *val = loss + n;
    if (!x) return kiln_error(KILN_ERR_OOM, "metrics_plot_svg: out of memory");
    for (size_t i = 0; i < n; i++) {
        x[i] = (double)rows[i].step;
        loss[i] = rows[i].loss;
        val[i] = rows[i].val_loss;
    }
    const kiln__chart_series series[] = {
        {.name = "train loss", .cls = "loss", .width = 1.6, .y = loss},
        {.name = "val loss", .cls = "val_loss", .width = 2, .y = val},
    };
    kiln__chart c = {
        .title = title ? title : "loss",
        .ylabel = "loss",
        .n = n,
        .x = x,
        .series = series,
        .ns = 2,
        .baseline = baseline,
        .baseline_label = baseline_label ? baseline_label : "baseline",
    };
    kiln_status st = kiln__chart_write_svg(&c, svg_path);
    free(x);
    return st;
}

/* The router chart's data as read: the steps of the lines with a "moe" member, and one
 * point per MoE block named in each of those lines. */
typedef struct {
    size_t row;    /* into steps */
    int64_t block; /* the block index, from "layers" */
    double v;      /* its max_over_mean; NaN for null */
} router_point;

typedef struct {
    double *steps;
    size_t n, cap;
    router_point *pts;
    size_t npts, pcap;
} router_data;

/* A line's "moe" member, if it has one (kiln train's moe_stats_json writes it). */
static kiln_status router_from_json(json_t *obj, int64_t step, void *ctx, char *why, size_t why_n)
{
    router_data *d = ctx;
    json_t *moe = json_object_get(obj, "moe");
    if (!moe || json_is_null(moe)) return KILN_OK; /* a line without router statistics */
    json_t *layers = json_object_get(moe, "layers"), *ratio = json_object_get(moe, "max_over_mean");
    if (!json_is_object(moe)) {
        snprintf(why, why_n, "\"moe\" must be an object");
        return KILN_ERR_FORMAT;
    }
    if (!json_is_array(layers) || !json_is_array(ratio) || json_array_size(layers) != json_array_size(ratio)) {
        snprintf(why, why_n, "\"moe\" must have arrays \"layers\" and \"max_over_mean\" of the same length");
        return KILN_ERR_FORMAT;
    }
    void *tmp;
    if (!KILN__GROW(d->steps, d->n, &d->cap, 256, tmp)) return KILN_ERR_OOM;
    for (size_t j = 0; j < json_array_size(layers); j++) {
        json_t *l = json_array_get(layers, j), *v = json_array_get(ratio, j);
        if (!json_is_integer(l) || json_integer_value(l) < 0) {
            snprintf(why, why_n, "\"moe\".\"layers\"[%zu] must be a block index (an integer >= 0)", j);
            return KILN_ERR_FORMAT;
        }
        if (!json_is_number(v) && !json_is_null(v)) {
            snprintf(why, why_n, "\"moe\".\"max_over_mean\"[%zu] must be a number", j);
            return KILN_ERR_FORMAT;
        }
        if (!KILN__GROW(d->pts, d->npts, &d->pcap, 1024, tmp)) return KILN_ERR_OOM;
        d->pts[d->npts++] = (router_point){d->n, (int64_t)json_integer_value(l), v ? json_number_value(v) : NAN};
    }
    d->steps[d->n++] = (double)step;
    return KILN_OK;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* One curve per block named anywhere in d, in block order, NaN where a line does not
 * name it; drawn to svg_path. */
static kiln_status draw_router(const router_data *d, const char *title, const char *svg_path, int *n_blocks)
{
    int64_t *blocks = malloc(sizeof *blocks * (d->npts + 1));
    if (!blocks) return kiln_error(KILN_ERR_OOM, "out of memory drawing %s", svg_path);
    for (size_t i = 0; i < d->npts; i++) blocks[i] = d->pts[i].block;
    qsort(blocks, d->npts, sizeof *blocks, cmp_i64);
    size_t nb = 0;
    for (size_t i = 0; i < d->npts; i++)
        if (nb == 0 || blocks[nb - 1] != blocks[i]) blocks[nb++] = blocks[i];

    typedef char label[2][32]; /* the legend's name and the polyline's class */
    double *y = malloc(sizeof *y * (nb * d->n + 1));
    kiln__chart_series *series = malloc(sizeof *series * (nb + 1));
    label *names = malloc(sizeof *names * (nb + 1));
    kiln_status st = KILN_OK;
    if (!y || !series || !names) {
        st = kiln_error(KILN_ERR_OOM, "out of memory drawing %s", svg_path);
        goto done;
    }
    for (size_t i = 0; i < nb * d->n; i++) y[i] = NAN;
    for (size_t i = 0; i < d->npts; i++) {
        const int64_t *b = bsearch(&d->pts[i].block, blocks, nb, sizeof *blocks, cmp_i64);
        y[(size_t)(b - blocks) * d->n + d->pts[i].row] = d->pts[i].v;
    }
    for (size_t b = 0; b < nb; b++) {
        snprintf(names[b][0], sizeof names[b][0], "block %lld", (long long)blocks[b]);
        snprintf(names[b][1], sizeof names[b][1], "block_%lld", (long long)blocks[b]);
        series[b] = (kiln__chart_series){.name = names[b][0], .cls = names[b][1], .width = 1.8, .y = y + b * d->n};
    }
    kiln__chart c = {
        .title = title ? title : "router balance",
        .ylabel = "max load / mean",
        .n = d->n,
        .x = d->steps,
        .series = series,
        .ns = (int)nb,
        .baseline = 1,
        .baseline_label = "balanced",
    };
    st = kiln__chart_write_svg(&c, svg_path);
    if (st == KILN_OK && n_blocks) *n_blocks = (int)nb;
done:
    KILN__FREE(blocks, y, series, names);
    return st;
}

kiln_status kiln_metrics_plot_router_svg(const char *metrics_path, const char *title, const char *svg_path,
                                         int *n_blocks)
{
    if (n_blocks) *n_blocks = 0;
    if (!metrics_path || !svg_path)
        return kiln_error(KILN_ERR_ARG, "metrics_plot_router_svg: metrics_path and svg_path must not be NULL");
    router_data d = {0};
    kiln_status st = each_line(metrics_path, router_from_json, &d);
    if (st == KILN_OK && d.npts == 0)
        st = kiln_error(KILN_ERR_UNSUPPORTED,
                        "metrics_plot_router_svg: '%s' has no \"moe\" members with blocks: not a mixture-of-experts "
                        "run, so there are no router statistics to draw",
                        metrics_path);
    if (st == KILN_OK) st = draw_router(&d, title, svg_path, n_blocks);
    KILN__FREE(d.steps, d.pts);
    return st;
}
