/* Training metrics: JSON lines in and out, and the loss chart as SVG.
 *
 * JSON goes through jansson rather than hand-written printf/scanf: a metrics file is
 * also read and written by other tools (Python notebooks, jq, a dashboard), so the
 * reader must take any valid JSON (escapes, exponents, spacing, key order, unknown
 * keys) and report bad JSON with a position; jansson does that, and it formats numbers
 * the same way whatever the process locale is. The SVG is plain text and is built by
 * hand.
 */
#include <errno.h>
#include <fcntl.h>
#include <locale.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "core/util.h"
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

/* ---- the chart ---- */

typedef kiln__sbuf strbuf;
#define sb_printf kiln__sbuf_put

/* Appends s as XML character data (also safe inside an attribute). Control bytes that
 * XML 1.0 forbids become spaces, so no title can make the file unreadable. */
static void sb_escape(strbuf *b, const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        switch (c) {
        case '&': sb_printf(b, "&amp;"); break;
        case '<': sb_printf(b, "&lt;"); break;
        case '>': sb_printf(b, "&gt;"); break;
        case '"': sb_printf(b, "&quot;"); break;
        case '\'': sb_printf(b, "&apos;"); break;
        default: sb_printf(b, "%c", c < 0x20 ? ' ' : (char)c); break;
        }
    }
}

/* Layout in SVG user units (pixels). The plot area is [left, PX1] x [PY0, PY1], where
 * left leaves room for the widest y tick label. */
enum { W = 800, H = 480, PX1 = W - 24, PY0 = 52, PY1 = H - 58 };
#define FONT "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\""
#define COLOR_LOSS "#1f77b4"
#define COLOR_VAL "#d62728"
#define COLOR_BASE "#555555"
#define MARKER_MAX 60 /* series with at most this many points also get a dot per point */

typedef struct {
    double lo, hi;
} range;

/* A 1-2-5 tick spacing giving about `target` ticks over r. */
static double nice_step(range r, int target)
{
    double raw = (r.hi - r.lo) / target;
    double mag = pow(10, floor(log10(raw)));
    double norm = raw / mag;
    double k = norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10;
    return k * mag;
}

/* Decimals needed to print multiples of step exactly: 0.05 -> 2, 0.5 -> 1, 20 -> 0. */
static int step_decimals(double step)
{
    int d = -(int)floor(log10(step) + 1e-9);
    return d < 0 ? 0 : d > 12 ? 12 : d;
}

/* The next coarser 1-2-5 spacing: 1 -> 2 -> 5 -> 10. */
static double coarser_step(double step)
{
    double mag = pow(10, floor(log10(step) + 1e-9));
    double norm = step / mag;
    return (norm < 1.5 ? 2 : norm < 3 ? 5 : 10) * mag;
}

/* The k-th tick at or after lo; 0 is printed as 0, not -0.00. */
static double tick_at(range r, double step, int k)
{
    double t = ceil(r.lo / step - 1e-9) * step + k * step;
    return fabs(t) < step * 1e-9 ? 0.0 : t;
}

static bool tick_in(range r, double step, double t) { return t <= r.hi + step * 1e-9; }

/* Widest label among the ticks of r, in pixels at 11 px. */
static double widest_tick(range r, double step, int decimals)
{
    double w = 0;
    char buf[64];
    for (int k = 0; k < 100; k++) {
        double t = tick_at(r, step, k);
        if (!tick_in(r, step, t)) break;
        int len = snprintf(buf, sizeof buf, "%.*f", decimals, t);
        if (len * 11 * 0.6 > w) w = len * 11 * 0.6;
    }
    return w;
}

typedef struct {
    range x, y;
    double xs, ys; /* tick spacing */
    int xd, yd;    /* decimals in tick labels */
    int left;      /* left edge of the plot area */
    int ylabel_x;  /* where the rotated "loss" goes */
} axes;

static double px(const axes *a, double x) { return a->left + (x - a->x.lo) / (a->x.hi - a->x.lo) * (PX1 - a->left); }
static double py(const axes *a, double y) { return PY1 - (y - a->y.lo) / (a->y.hi - a->y.lo) * (PY1 - PY0); }

static double series_value(const kiln_metrics_row *r, int series) { return series == 0 ? r->loss : r->val_loss; }

/* How much of the curves a box hides, used to keep the legend and the baseline label
 * off them: the data points (of both series) inside it, and samples of the segments
 * between them, since a curve of few points can pass through a box that holds none. */
typedef struct {
    double x0, y0, x1, y1;
} box;

static bool in_box(box b, double x, double y) { return x >= b.x0 && x <= b.x1 && y >= b.y0 && y <= b.y1; }

static size_t curve_hits_box(const axes *a, const kiln_metrics_row *rows, size_t n, box b)
{
    size_t hits = 0;
    for (int s = 0; s < 2; s++) {
        double lx = NAN, ly = NAN;
        for (size_t i = 0; i < n; i++) {
            double v = series_value(&rows[i], s);
            if (!isfinite(v)) continue;
            double x = px(a, (double)rows[i].step), y = py(a, v);
            hits += in_box(b, x, y);
            /* Sample the segment; exact clipping is not worth its lines here. */
            for (int k = 1; isfinite(lx) && k < 8; k++) {
                double t = k / 8.0;
                hits += in_box(b, lx + t * (x - lx), ly + t * (y - ly));
            }
            lx = x;
            ly = y;
        }
    }
    return hits;
}

/* Text width estimate for an 11-12 px sans font: good enough to size boxes. */
static double text_width(const char *s, double font_px)
{
    size_t chars = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if ((*p & 0xC0) != 0x80) chars++; /* count UTF-8 code points, not bytes */
    return (double)chars * font_px * 0.6;
}

/* The polyline of a series of count finite points, and a dot per point when few. */
static void draw_series(strbuf *b, const axes *a, const kiln_metrics_row *rows, size_t n, int series,
                        const char *color, size_t count)
{
    if (count == 0) return;
    sb_printf(b, "<polyline class=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"%s\" "
                 "stroke-linejoin=\"round\" stroke-linecap=\"round\" points=\"",
              series == 0 ? "loss" : "val_loss", color, series == 0 ? "1.6" : "2");
    const char *sep = "";
    for (size_t i = 0; i < n; i++) {
        double v = series_value(&rows[i], series);
        if (!isfinite(v)) continue;
        sb_printf(b, "%s%.2f,%.2f", sep, px(a, (double)rows[i].step), py(a, v));
        sep = " ";
    }
    sb_printf(b, "\"/>\n");
    if (count > MARKER_MAX) return;
    for (size_t i = 0; i < n; i++) {
        double v = series_value(&rows[i], series);
        if (!isfinite(v)) continue;
        sb_printf(b, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"3\" fill=\"%s\" stroke=\"white\" stroke-width=\"1\"/>\n",
                  px(a, (double)rows[i].step), py(a, v), color);
    }
}

/* The axis ranges: every finite value and the baseline fit, with a little air. */
static axes choose_axes(const kiln_metrics_row *rows, size_t n, double baseline)
{
    axes a = {.x = {INFINITY, -INFINITY}, .y = {INFINITY, -INFINITY}};
    for (size_t i = 0; i < n; i++) {
        double s = (double)rows[i].step;
        a.x = (range){fmin(a.x.lo, s), fmax(a.x.hi, s)};
        for (int k = 0; k < 2; k++) {
            double v = series_value(&rows[i], k);
            if (isfinite(v)) a.y = (range){fmin(a.y.lo, v), fmax(a.y.hi, v)};
        }
    }
    if (isfinite(baseline)) a.y = (range){fmin(a.y.lo, baseline), fmax(a.y.hi, baseline)};
    if (n == 0) a.x = (range){0, 1};
    if (a.x.lo == a.x.hi) a.x = (range){a.x.lo - 1, a.x.hi + 1};
    if (!isfinite(a.y.lo)) a.y = (range){0, 1};
    double pad = a.y.lo != a.y.hi ? (a.y.hi - a.y.lo) * 0.06 : a.y.lo == 0 ? 1 : fabs(a.y.lo) * 0.1;
    a.y = (range){a.y.lo - pad, a.y.hi + pad};
    a.ys = nice_step(a.y, 6);
    a.yd = step_decimals(a.ys);
    double yw = widest_tick(a.y, a.ys, a.yd);
    a.left = (int)ceil(yw) + 40; /* tick, gap, label, gap, rotated axis label */
    if (a.left < 64) a.left = 64;
    a.ylabel_x = a.left - 8 - (int)ceil(yw) - 14;
    /* x ticks: steps are integers, so never closer than 1 apart; and never so close that
     * their labels run into each other. */
    a.xs = nice_step(a.x, 8);
    if (a.xs < 1) a.xs = 1;
    for (int tries = 0; tries < 20; tries++) {
        a.xd = step_decimals(a.xs);
        double spacing = a.xs / (a.x.hi - a.x.lo) * (PX1 - a.left);
        if (widest_tick(a.x, a.xs, a.xd) + 16 <= spacing) break;
        a.xs = coarser_step(a.xs);
    }
    return a;
}

static void draw_axes(strbuf *b, const axes *a)
{
    sb_printf(b, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"white\"/>\n", a->left, PY0,
              PX1 - a->left, PY1 - PY0);
    sb_printf(b, "<g class=\"xticks\" " FONT " font-size=\"11\" fill=\"#333\" text-anchor=\"middle\">\n");
    for (int k = 0; k < 100; k++) {
        double t = tick_at(a->x, a->xs, k);
        if (!tick_in(a->x, a->xs, t)) break;
        double x = px(a, t);
        sb_printf(b, "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" stroke=\"#e6e6e6\"/>\n", x, PY0, x, PY1);
        sb_printf(b, "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" stroke=\"#333\"/>\n", x, PY1, x, PY1 + 5);
        sb_printf(b, "<text x=\"%.2f\" y=\"%d\">%.*f</text>\n", x, PY1 + 19, a->xd, t);
    }
    sb_printf(b, "</g>\n");
    sb_printf(b, "<g class=\"yticks\" " FONT " font-size=\"11\" fill=\"#333\" text-anchor=\"end\">\n");
    for (int k = 0; k < 100; k++) {
        double t = tick_at(a->y, a->ys, k);
        if (!tick_in(a->y, a->ys, t)) break;
        double y = py(a, t);
        sb_printf(b, "<line x1=\"%d\" y1=\"%.2f\" x2=\"%d\" y2=\"%.2f\" stroke=\"#e6e6e6\"/>\n", a->left, y, PX1, y);
        sb_printf(b, "<line x1=\"%d\" y1=\"%.2f\" x2=\"%d\" y2=\"%.2f\" stroke=\"#333\"/>\n", a->left - 5, y, a->left,
                  y);
        sb_printf(b, "<text x=\"%d\" y=\"%.2f\">%.*f</text>\n", a->left - 8, y + 4, a->yd, t);
    }
    sb_printf(b, "</g>\n");
    sb_printf(b, "<text " FONT " font-size=\"13\" fill=\"#222\" text-anchor=\"middle\" x=\"%d\" y=\"%d\">step</text>\n",
              (a->left + PX1) / 2, H - 16);
    sb_printf(b,
              "<text " FONT " font-size=\"13\" fill=\"#222\" text-anchor=\"middle\" "
              "transform=\"translate(%d %d) rotate(-90)\">loss</text>\n",
              a->ylabel_x, (PY0 + PY1) / 2);
}

static bool boxes_overlap(box p, box q) { return p.x0 < q.x1 && q.x0 < p.x1 && p.y0 < q.y1 && q.y0 < p.y1; }

/* Of nc candidate boxes, the one that hides the least: the fewest points of the curves,
 * not the box avoid (if any) and, if it can be helped, not the line at avoid_y; never one
 * that leaves the plot. */
static int least_hidden(const axes *a, const kiln_metrics_row *rows, size_t n, const box *cand, int nc,
                        const box *avoid, double avoid_y)
{
    int best = 0;
    size_t best_hits = (size_t)-1;
    for (int c = 0; c < nc; c++) {
        if (cand[c].y0 < PY0 || cand[c].y1 > PY1) continue;
        size_t hits = curve_hits_box(a, rows, n, cand[c]);
        if (avoid && boxes_overlap(cand[c], *avoid)) hits += 1000;
        if (isfinite(avoid_y) && avoid_y >= cand[c].y0 - 2 && avoid_y <= cand[c].y1 + 2) hits += 20;
        if (hits < best_hits) {
            best_hits = hits;
            best = c;
        }
    }
    return best;
}

/* The dashed baseline and its label, placed at whichever end and side of the line
 * keeps the label off the curves. Returns the label's box, for the legend to avoid. */
static box draw_baseline(strbuf *b, const axes *a, const kiln_metrics_row *rows, size_t n, double baseline,
                         const char *label)
{
    double y = py(a, baseline);
    sb_printf(b,
              "<line class=\"baseline\" x1=\"%d\" y1=\"%.2f\" x2=\"%d\" y2=\"%.2f\" stroke=\"" COLOR_BASE
              "\" stroke-width=\"1.4\" stroke-dasharray=\"6 4\"/>\n",
              a->left, y, PX1, y);
    char value[32];
    snprintf(value, sizeof value, " (%.4g)", baseline);
    double w = text_width(label, 11) + text_width(value, 11);
    /* Right-aligned above the line, left-aligned above, then the same below. */
    double x0[2] = {PX1 - 6 - w, a->left + 6}, y0[4] = {y - 17, y - 17, y + 3, y + 3};
    box cand[4];
    for (int c = 0; c < 4; c++) cand[c] = (box){x0[c % 2], y0[c], x0[c % 2] + w, y0[c] + 14};
    int best = least_hidden(a, rows, n, cand, 4, NULL, NAN);
    bool right = best % 2 == 0;
    sb_printf(b, "<text " FONT " font-size=\"11\" fill=\"" COLOR_BASE "\" text-anchor=\"%s\" x=\"%.2f\" y=\"%.2f\">",
              right ? "end" : "start", right ? PX1 - 6.0 : a->left + 6.0, cand[best].y0 + 11);
    sb_escape(b, label);
    sb_printf(b, "%s</text>\n", value);
    return cand[best];
}

typedef struct {
    const char *label;
    const char *color;
    bool dashed, marker;
} legend_entry;

/* The legend goes in the corner of the plot that hides the least: the fewest points of
 * the curves, and neither the baseline's label nor (if it can be helped) its line. */
static void draw_legend(strbuf *b, const axes *a, const kiln_metrics_row *rows, size_t n,
                        const legend_entry *e, int ne, const box *avoid, double avoid_y)
{
    if (ne == 0) return;
    double w = 0;
    for (int i = 0; i < ne; i++) {
        double tw = text_width(e[i].label, 12);
        if (tw > w) w = tw;
    }
    w += 48;
    double h = 10 + 18.0 * ne;
    const double m = 10;
    double corners[4][2] = {
        {PX1 - m - w, PY0 + m}, {a->left + m, PY1 - m - h}, {PX1 - m - w, PY1 - m - h}, {a->left + m, PY0 + m}};
    box cand[4];
    for (int c = 0; c < 4; c++) cand[c] = (box){corners[c][0], corners[c][1], corners[c][0] + w, corners[c][1] + h};
    int best = least_hidden(a, rows, n, cand, 4, avoid, avoid_y);
    double x = cand[best].x0, y = cand[best].y0;
    sb_printf(b, "<g class=\"legend\" " FONT " font-size=\"12\" fill=\"#222\">\n");
    sb_printf(b,
              "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" rx=\"3\" fill=\"white\" "
              "fill-opacity=\"0.9\" stroke=\"#bbbbbb\"/>\n",
              x, y, w, h);
    for (int i = 0; i < ne; i++) {
        double ly = y + 14 + 18.0 * i;
        sb_printf(b, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"%s\" stroke-width=\"2\"%s/>\n",
                  x + 8, ly, x + 32, ly, e[i].color, e[i].dashed ? " stroke-dasharray=\"6 4\"" : "");
        if (e[i].marker)
            sb_printf(b, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"3\" fill=\"%s\" stroke=\"white\"/>\n", x + 20, ly,
                      e[i].color);
        sb_printf(b, "<text x=\"%.2f\" y=\"%.2f\">", x + 40, ly + 4);
        sb_escape(b, e[i].label);
        sb_printf(b, "</text>\n");
    }
    sb_printf(b, "</g>\n");
}

static void build_svg(strbuf *b, const kiln_metrics_row *rows, size_t n, const char *title, double baseline,
                      const char *baseline_label)
{
    axes a = choose_axes(rows, n, baseline);
    sb_printf(b,
              "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%d\" height=\"%d\" "
              "viewBox=\"0 0 %d %d\">\n",
              W, H, W, H);
    sb_printf(b, "<rect width=\"100%%\" height=\"100%%\" fill=\"#fafafa\"/>\n");
    /* A long title is set smaller rather than cut off (bold runs ~0.65 em a glyph). */
    double title_px = 16, title_w = text_width(title, 16) * 1.08;
    if (title_w > W - 24) title_px = fmax(8, 16 * (W - 24) / title_w);
    sb_printf(b, "<text " FONT " font-size=\"%.1f\" font-weight=\"bold\" fill=\"#111\" text-anchor=\"middle\" "
                 "x=\"%d\" y=\"30\">",
              title_px, W / 2);
    sb_escape(b, title);
    sb_printf(b, "</text>\n");
    draw_axes(b, &a);

    size_t n_loss = 0, n_val = 0;
    for (size_t i = 0; i < n; i++) {
        n_loss += isfinite(rows[i].loss) != 0;
        n_val += isfinite(rows[i].val_loss) != 0;
    }
    /* The frame goes under the curves so that a point on the edge stays visible. */
    sb_printf(b, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#333\"/>\n", a.left, PY0,
              PX1 - a.left, PY1 - PY0);
    box label_box = {0, 0, 0, 0};
    double baseline_y = NAN;
    if (isfinite(baseline)) {
        label_box = draw_baseline(b, &a, rows, n, baseline, baseline_label);
        baseline_y = py(&a, baseline);
    }
    draw_series(b, &a, rows, n, 0, COLOR_LOSS, n_loss);
    draw_series(b, &a, rows, n, 1, COLOR_VAL, n_val);
    if (n_loss == 0 && n_val == 0)
        sb_printf(b, "<text " FONT " font-size=\"14\" fill=\"#888\" text-anchor=\"middle\" x=\"%d\" y=\"%d\">"
                     "no data</text>\n",
                  (a.left + PX1) / 2, (PY0 + PY1) / 2);

    legend_entry e[3];
    int ne = 0;
    if (n_loss) e[ne++] = (legend_entry){"train loss", COLOR_LOSS, false, n_loss <= MARKER_MAX};
    if (n_val) e[ne++] = (legend_entry){"val loss", COLOR_VAL, false, n_val <= MARKER_MAX};
    if (isfinite(baseline)) e[ne++] = (legend_entry){baseline_label, COLOR_BASE, true, false};
    draw_legend(b, &a, rows, n, e, ne, isfinite(baseline) ? &label_box : NULL, baseline_y);
    sb_printf(b, "</svg>\n");
}

/* Writes data to a fresh temporary file beside path and renames it over path. */
static kiln_status write_atomically(const char *path, const char *data, size_t len)
{
    static atomic_uint counter;
    size_t plen = strlen(path) + 48;
    char *tmp = malloc(plen);
    if (!tmp) return kiln_error(KILN_ERR_OOM, "metrics_plot_svg: out of memory");
    snprintf(tmp, plen, "%s.tmp.%ld.%u", path, (long)getpid(), atomic_fetch_add(&counter, 1));
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
    if (fd < 0) {
        kiln_status st = kiln_error(KILN_ERR_IO, "metrics_plot_svg: cannot create '%s': %s", tmp, strerror(errno));
        free(tmp);
        return st;
    }
    size_t done = 0;
    while (done < len) {
        ssize_t k = write(fd, data + done, len - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        done += (size_t)k;
    }
    int err = done == len ? 0 : errno ? errno : EIO;
    if (!err && fsync(fd) != 0) err = errno;
    if (close(fd) != 0 && !err) err = errno;
    if (!err && rename(tmp, path) != 0) err = errno;
    if (err) {
        unlink(tmp);
        free(tmp);
        return kiln_error(KILN_ERR_IO, "metrics_plot_svg: cannot write '%s': %s", path, strerror(err));
    }
    free(tmp);
    return KILN_OK;
}

kiln_status kiln_metrics_plot_svg(const kiln_metrics_row *rows, size_t n, const char *title, double baseline,
                                  const char *baseline_label, const char *svg_path)
{
    if (!svg_path || (n > 0 && !rows))
        return kiln_error(KILN_ERR_ARG, "metrics_plot_svg: svg_path must be given, and rows when n > 0");
    if (!title) title = "loss";
    if (!baseline_label) baseline_label = "baseline";

    /* SVG numbers need a '.' decimal point whatever locale the program has set. */
    locale_t c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    if (c_locale == (locale_t)0) return kiln_error(KILN_ERR_OOM, "metrics_plot_svg: cannot make the C locale");
    locale_t old = uselocale(c_locale);
    strbuf b = {0};
    build_svg(&b, rows, n, title, baseline, baseline_label);
    uselocale(old);
    freelocale(c_locale);

    if (b.failed) {
        free(b.s);
        return kiln_error(KILN_ERR_OOM, "metrics_plot_svg: out of memory building the chart");
    }
    kiln_status st = write_atomically(svg_path, b.s, b.n);
    free(b.s);
    return st;
}
