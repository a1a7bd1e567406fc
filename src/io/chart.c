/* A line chart over training steps as a standalone SVG: axes with 1-2-5 ticks, the
 * curves, an optional dashed baseline, and a legend placed where it hides the least.
 * The SVG is plain text and is built by hand. */
#include <errno.h>
#include <fcntl.h>
#include <locale.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/file.h"
#include "core/util.h"
#include "io/chart_impl.h"

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
#define COLOR_BASE "#555555"
#define MARKER_MAX 60 /* series with at most this many points also get a dot per point */

/* Series s is drawn in PALETTE[s % NPALETTE]: matplotlib's colours, blue and red first
 * (train and val loss), then those that stay apart from both. */
static const char *const PALETTE[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                      "#9467bd", "#8c564b", "#e377c2", "#17becf"};
#define NPALETTE (sizeof PALETTE / sizeof PALETTE[0])
static const char *series_color(int s) { return PALETTE[(size_t)s % NPALETTE]; }

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
    int ylabel_x;  /* where the rotated y label goes */
} axes;

static double px(const axes *a, double x) { return a->left + (x - a->x.lo) / (a->x.hi - a->x.lo) * (PX1 - a->left); }
static double py(const axes *a, double y) { return PY1 - (y - a->y.lo) / (a->y.hi - a->y.lo) * (PY1 - PY0); }

/* How much of the curves a box hides, used to keep the legend and the baseline label
 * off them: the data points (of every series) inside it, and samples of the segments
 * between them, since a curve of few points can pass through a box that holds none. */
typedef struct {
    double x0, y0, x1, y1;
} box;

static bool in_box(box b, double x, double y) { return x >= b.x0 && x <= b.x1 && y >= b.y0 && y <= b.y1; }

static size_t curve_hits_box(const axes *a, const kiln__chart *c, box b)
{
    size_t hits = 0;
    for (int s = 0; s < c->ns; s++) {
        double lx = NAN, ly = NAN;
        for (size_t i = 0; i < c->n; i++) {
            double v = c->series[s].y[i];
            if (!isfinite(v)) continue;
            double x = px(a, c->x[i]), y = py(a, v);
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

/* The finite points of series s. */
static size_t series_count(const kiln__chart *c, int s)
{
    size_t count = 0;
    for (size_t i = 0; i < c->n; i++) count += isfinite(c->series[s].y[i]) != 0;
    return count;
}

/* The polyline of series s, of count finite points, and a dot per point when few. */
static void draw_series(strbuf *b, const axes *a, const kiln__chart *c, int s, size_t count)
{
    if (count == 0) return;
    const kiln__chart_series *se = &c->series[s];
    const char *color = series_color(s);
    sb_printf(b, "<polyline class=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"%g\" "
                 "stroke-linejoin=\"round\" stroke-linecap=\"round\" points=\"",
              se->cls, color, se->width);
    const char *sep = "";
    for (size_t i = 0; i < c->n; i++) {
        if (!isfinite(se->y[i])) continue;
        sb_printf(b, "%s%.2f,%.2f", sep, px(a, c->x[i]), py(a, se->y[i]));
        sep = " ";
    }
    sb_printf(b, "\"/>\n");
    if (count > MARKER_MAX) return;
    for (size_t i = 0; i < c->n; i++) {
        if (!isfinite(se->y[i])) continue;
        sb_printf(b, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"3\" fill=\"%s\" stroke=\"white\" stroke-width=\"1\"/>\n",
                  px(a, c->x[i]), py(a, se->y[i]), color);
    }
}

/* The axis ranges: every finite value and the baseline fit, with a little air. */
static axes choose_axes(const kiln__chart *c)
{
    axes a = {.x = {INFINITY, -INFINITY}, .y = {INFINITY, -INFINITY}};
    for (size_t i = 0; i < c->n; i++) {
        a.x = (range){fmin(a.x.lo, c->x[i]), fmax(a.x.hi, c->x[i])};
        for (int s = 0; s < c->ns; s++) {
            double v = c->series[s].y[i];
            if (isfinite(v)) a.y = (range){fmin(a.y.lo, v), fmax(a.y.hi, v)};
        }
    }
    if (isfinite(c->baseline)) a.y = (range){fmin(a.y.lo, c->baseline), fmax(a.y.hi, c->baseline)};
    if (c->n == 0) a.x = (range){0, 1};
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

static void draw_axes(strbuf *b, const axes *a, const char *ylabel)
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
              "transform=\"translate(%d %d) rotate(-90)\">",
              a->ylabel_x, (PY0 + PY1) / 2);
    sb_escape(b, ylabel);
    sb_printf(b, "</text>\n");
}

static bool boxes_overlap(box p, box q) { return p.x0 < q.x1 && q.x0 < p.x1 && p.y0 < q.y1 && q.y0 < p.y1; }

/* Of nc candidate boxes, the one that hides the least: the fewest points of the curves,
 * not the box avoid (if any) and, if it can be helped, not the line at avoid_y; never one
 * that leaves the plot. */
static int least_hidden(const axes *a, const kiln__chart *c, const box *cand, int nc, const box *avoid,
                        double avoid_y)
{
    int best = 0;
    size_t best_hits = (size_t)-1;
    for (int k = 0; k < nc; k++) {
        if (cand[k].y0 < PY0 || cand[k].y1 > PY1) continue;
        size_t hits = curve_hits_box(a, c, cand[k]);
        if (avoid && boxes_overlap(cand[k], *avoid)) hits += 1000;
        if (isfinite(avoid_y) && avoid_y >= cand[k].y0 - 2 && avoid_y <= cand[k].y1 + 2) hits += 20;
        if (hits < best_hits) {
            best_hits = hits;
            best = k;
        }
    }
    return best;
}

/* The dashed baseline and its label, placed at whichever end and side of the line
 * keeps the label off the curves. Returns the label's box, for the legend to avoid. */
static box draw_baseline(strbuf *b, const axes *a, const kiln__chart *c)
{
    double baseline = c->baseline;
    const char *label = c->baseline_label;
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
    for (int k = 0; k < 4; k++) cand[k] = (box){x0[k % 2], y0[k], x0[k % 2] + w, y0[k] + 14};
    int best = least_hidden(a, c, cand, 4, NULL, NAN);
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
static void draw_legend(strbuf *b, const axes *a, const kiln__chart *c, const legend_entry *e, int ne,
                        const box *avoid, double avoid_y)
{
    if (ne == 0) return;
    double cw = 0;
    for (int i = 0; i < ne; i++) {
        double tw = text_width(e[i].label, 12);
        if (tw > cw) cw = tw;
    }
    cw += 48;
    const double m = 10;
    /* More entries than the plot is tall (a model of many MoE blocks) go in columns. */
    int fit = (int)((PY1 - PY0 - 2 * m - 10) / 18), cols = (ne + fit - 1) / fit, per_col = (ne + cols - 1) / cols;
    double w = cw * cols, h = 10 + 18.0 * per_col;
    double corners[4][2] = {
        {PX1 - m - w, PY0 + m}, {a->left + m, PY1 - m - h}, {PX1 - m - w, PY1 - m - h}, {a->left + m, PY0 + m}};
    box cand[4];
    for (int k = 0; k < 4; k++) cand[k] = (box){corners[k][0], corners[k][1], corners[k][0] + w, corners[k][1] + h};
    int best = least_hidden(a, c, cand, 4, avoid, avoid_y);
    double y = cand[best].y0;
    sb_printf(b, "<g class=\"legend\" " FONT " font-size=\"12\" fill=\"#222\">\n");
    sb_printf(b,
              "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" rx=\"3\" fill=\"white\" "
              "fill-opacity=\"0.9\" stroke=\"#bbbbbb\"/>\n",
              cand[best].x0, y, w, h);
    for (int i = 0; i < ne; i++) {
        double x = cand[best].x0 + cw * (i / per_col), ly = y + 14 + 18.0 * (i % per_col);
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

static void build_svg(strbuf *b, const kiln__chart *c)
{
    size_t *count = calloc((size_t)c->ns + 1, sizeof *count);
    legend_entry *e = calloc((size_t)c->ns + 1, sizeof *e);
    if (!count || !e) {
        KILN__FREE(count, e);
        b->failed = true;
        return;
    }
    axes a = choose_axes(c);
    sb_printf(b,
              "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%d\" height=\"%d\" "
              "viewBox=\"0 0 %d %d\">\n",
              W, H, W, H);
    sb_printf(b, "<rect width=\"100%%\" height=\"100%%\" fill=\"#fafafa\"/>\n");
    /* A long title is set smaller rather than cut off (bold runs ~0.65 em a glyph). */
    double title_px = 16, title_w = text_width(c->title, 16) * 1.08;
    if (title_w > W - 24) title_px = fmax(8, 16 * (W - 24) / title_w);
    sb_printf(b, "<text " FONT " font-size=\"%.1f\" font-weight=\"bold\" fill=\"#111\" text-anchor=\"middle\" "
                 "x=\"%d\" y=\"30\">",
              title_px, W / 2);
    sb_escape(b, c->title);
    sb_printf(b, "</text>\n");
    draw_axes(b, &a, c->ylabel);

    size_t points = 0;
    for (int s = 0; s < c->ns; s++) points += count[s] = series_count(c, s);
    /* The frame goes under the curves so that a point on the edge stays visible. */
    sb_printf(b, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#333\"/>\n", a.left, PY0,
              PX1 - a.left, PY1 - PY0);
    box label_box = {0, 0, 0, 0};
    double baseline_y = NAN;
    if (isfinite(c->baseline)) {
        label_box = draw_baseline(b, &a, c);
        baseline_y = py(&a, c->baseline);
    }
    for (int s = 0; s < c->ns; s++) draw_series(b, &a, c, s, count[s]);
    if (points == 0)
        sb_printf(b, "<text " FONT " font-size=\"14\" fill=\"#888\" text-anchor=\"middle\" x=\"%d\" y=\"%d\">"
                     "no data</text>\n",
                  (a.left + PX1) / 2, (PY0 + PY1) / 2);

    int ne = 0;
    for (int s = 0; s < c->ns; s++)
        if (count[s]) e[ne++] = (legend_entry){c->series[s].name, series_color(s), false, count[s] <= MARKER_MAX};
    if (isfinite(c->baseline)) e[ne++] = (legend_entry){c->baseline_label, COLOR_BASE, true, false};
    draw_legend(b, &a, c, e, ne, isfinite(c->baseline) ? &label_box : NULL, baseline_y);
    sb_printf(b, "</svg>\n");
    KILN__FREE(count, e);
}

kiln_status kiln__chart_write_svg(const kiln__chart *c, const char *svg_path)
{
    /* SVG numbers need a '.' decimal point whatever locale the program has set. */
    locale_t c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    if (c_locale == (locale_t)0) return kiln_error(KILN_ERR_OOM, "cannot make the C locale to write %s", svg_path);
    locale_t old = uselocale(c_locale);
    strbuf b = {0};
    build_svg(&b, c);
    uselocale(old);
    freelocale(c_locale);

    if (b.failed) {
        free(b.s);
        return kiln_error(KILN_ERR_OOM, "out of memory building the chart %s", svg_path);
    }
    kiln_status st = kiln__file_write_atomic(svg_path, b.s, b.n, NULL);
    free(b.s);
    return st;
}
