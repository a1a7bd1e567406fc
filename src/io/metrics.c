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
    /* "a+" so that we can look at the last byte; writes still always go to the end. */
    FILE *f = fopen(path, append ? "a+" : "w");
    if (!f) return kiln_error(KILN_ERR_IO, "metrics_open: cannot open '%s': %s", path, strerror(errno));
    if (append && fseek(f, -1, SEEK_END) == 0) {
        int last = fgetc(f);
        /* A run that died mid-write leaves a partial line; start ours on a fresh one so
         * that only the broken line is malformed, not the first new one too. */
        if (last != EOF && last != '\n' && fputc('\n', f) == EOF) {
            fclose(f);
            return kiln_error(KILN_ERR_IO, "metrics_open: cannot write '%s': %s", path, strerror(errno));
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
    if (bad) return kiln_error(KILN_ERR_IO, "metrics_write: cannot write '%s': %s", m->path, strerror(errno));
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

/* Fills *r from one decoded line; on a problem writes it into why and returns false. */
static bool row_from_json(json_t *obj, kiln_metrics_row *r, char *why, size_t why_n)
{
    if (!json_is_object(obj)) {
        snprintf(why, why_n, "expected a JSON object");
        return false;
    }
    json_t *step = json_object_get(obj, "step");
    if (!json_is_integer(step)) {
        snprintf(why, why_n, step ? "\"step\" must be an integer" : "no \"step\"");
        return false;
    }
    r->step = (int64_t)json_integer_value(step);
    r->extra = NULL;
    for (size_t i = 0; i < NFIELDS; i++) {
        json_t *v = json_object_get(obj, FIELDS[i].name);
        if (!v || json_is_null(v)) {
            *field_ptr(r, i) = NAN;
        } else if (json_is_number(v)) {
            *field_ptr(r, i) = json_number_value(v);
        } else {
            snprintf(why, why_n, "\"%s\" must be a number", FIELDS[i].name);
            return false;
        }
    }
    return true;
}

kiln_status kiln_metrics_read(const char *path, kiln_metrics_row **rows, size_t *n)
{
    if (!path || !rows || !n) return kiln_error(KILN_ERR_ARG, "metrics_read: path, rows and n must not be NULL");
    *rows = NULL;
    *n = 0;
    FILE *f = fopen(path, "r");
    if (!f) return kiln_error(KILN_ERR_IO, "metrics_read: cannot open '%s': %s", path, strerror(errno));

    kiln_metrics_row *out = NULL;
    size_t count = 0, cap = 0, lineno = 0;
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t len;
    kiln_status st = KILN_OK;
    errno = 0;
    while ((len = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        if (is_blank(line, (size_t)len)) continue;
        json_error_t jerr;
        json_t *obj = json_loadb(line, (size_t)len, JSON_REJECT_DUPLICATES, &jerr);
        if (!obj) {
            st = kiln_error(KILN_ERR_FORMAT, "%s:%zu: not valid JSON (column %d): %s", path, lineno, jerr.column,
                            jerr.text);
            break;
        }
        kiln_metrics_row *grown = kiln__grow(out, count, &cap, 256, sizeof *out);
        if (!grown) {
            json_decref(obj);
            st = kiln_error(KILN_ERR_OOM, "metrics_read: out of memory at %s:%zu", path, lineno);
            break;
        }
        out = grown;
        char why[128];
        bool ok = row_from_json(obj, &out[count], why, sizeof why);
        json_decref(obj);
        if (!ok) {
            st = kiln_error(KILN_ERR_FORMAT, "%s:%zu: %s", path, lineno, why);
            break;
        }
        count++;
    }
    if (st == KILN_OK && ferror(f))
        st = kiln_error(KILN_ERR_IO, "metrics_read: cannot read '%s': %s", path, strerror(errno ? errno : EIO));
    free(line);
    fclose(f);
    if (st != KILN_OK) {
        free(out);
        return st;
    }
    *rows = out; /* NULL when there is no row: it grows with the first */
    *n = count;
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
    kiln_status st = kiln__chart_write_svg(&c, svg_path, "metrics_plot_svg");
    free(x);
    return st;
}
