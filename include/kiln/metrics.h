/* kiln/metrics.h — training metrics as JSON lines, and the loss and router charts.
 *
 * A worked example:
 *
 *     kiln_metrics_t *m;
 *     if (kiln_metrics_open("run/metrics.jsonl", false, &m) != KILN_OK) return die();
 *     for (int64_t step = 0; step < steps; step++) {
 *         kiln_metrics_row r = {.step = step, .loss = loss, .val_loss = NAN, .lr = lr,
 *                               .tokens_per_s = tps, .grad_norm = gn, .ms_per_step = ms};
 *         if (step % 20 == 0) r.val_loss = val;          // measured only now and then
 *         if (kiln_metrics_write(m, &r) != KILN_OK) return die();
 *     }
 *     kiln_metrics_close(m);
 *
 *     kiln_metrics_row *rows;                              // later, or in another program
 *     size_t n;
 *     if (kiln_metrics_read("run/metrics.jsonl", &rows, &n) != KILN_OK) return die();
 *     kiln_status s = kiln_metrics_plot_svg(rows, n, "gpt-tiny on KJV", 4.5,
 *                                           "unigram entropy", "run/loss.svg");
 *     free(rows);
 *     if (s != KILN_OK) return die();       // die() prints kiln_last_error()
 *
 *     // A mixture-of-experts run's lines also carry {"moe":{...}}: its router chart.
 *     int blocks;
 *     s = kiln_metrics_plot_router_svg("run/metrics.jsonl", NULL, "run/router.svg", &blocks);
 *     if (s != KILN_OK && s != KILN_ERR_UNSUPPORTED) return die(); // UNSUPPORTED: a dense run
 *
 * Each line of a metrics file is one JSON object:
 *     {"step":10,"loss":2.31,"val_loss":2.4,"lr":0.0006,"tokens_per_s":5120.5,
 *      "grad_norm":0.91,"ms_per_step":400.1}
 * A field that was not measured (NaN, or not finite) is left out of the line and reads
 * back as NaN. Numbers are written with 10 significant digits. Readers ignore keys they
 * do not know, so a newer writer may add fields.
 *
 * Errors are reported as everywhere in kiln: a kiln_status, with the message in
 * kiln_last_error().
 */
#ifndef KILN_METRICS_H
#define KILN_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t step;
    double loss;         /* training loss of that step */
    double val_loss;     /* NAN when not measured at this step */
    double lr;           /* learning rate used at that step */
    double tokens_per_s; /* training throughput */
    double grad_norm;    /* global gradient norm before clipping */
    double ms_per_step;  /* wall time of the step */
    /* Writing: a JSON object whose members are added to the line (NULL: none), e.g. a
     * mixture-of-experts model's router statistics, {"moe":{...}} (kiln train; docs/model.md).
     * Reading: NULL (the members stay in the file for other readers: kiln plot). */
    const char *extra;
} kiln_metrics_row;

/* An open metrics.jsonl, written one line at a time. */
typedef struct kiln_metrics kiln_metrics_t;

/* Opens path for writing: append keeps the lines already there (a resumed run), else the
 * file is truncated. If an appended file ends in a partial line (a crash mid-write), the
 * new lines start on a fresh line. *out is closed with kiln_metrics_close(). */
kiln_status kiln_metrics_open(const char *path, bool append, kiln_metrics_t **out);
/* Writes row (borrowed) as one JSON object on one line and flushes it, so a crash loses
 * at most the line being written. Non-finite fields are omitted. */
kiln_status kiln_metrics_write(kiln_metrics_t *m, const kiln_metrics_row *row);
/* Flushes and closes m; NULL is fine. */
void kiln_metrics_close(kiln_metrics_t *m);

/* Reads a whole metrics.jsonl. Blank lines are skipped; every other line must be a JSON
 * object with an integer "step", and the known fields, when present, must be numbers (or
 * null, read as NaN). A malformed line gives KILN_ERR_FORMAT naming the file and the line
 * number. On success *rows is malloc'd (the caller frees it; NULL when *n is 0). */
kiln_status kiln_metrics_read(const char *path, kiln_metrics_row **rows, size_t *n);

/* Draws loss and val loss against step as a standalone SVG file: linear axes with ticks
 * and labels, a legend, the title (any text; it is escaped), and, when baseline is
 * finite, a dashed horizontal line at that loss named baseline_label (NULL reads
 * "baseline"), e.g. the unigram entropy of the data. Non-finite values are skipped and
 * the series drawn through the rest; 0 or 1 rows and flat series still give a valid
 * chart. rows is borrowed. The file is written to a temporary name and renamed over
 * svg_path, so a reader never sees half a chart. */
kiln_status kiln_metrics_plot_svg(const kiln_metrics_row *rows, size_t n, const char *title, double baseline,
                                  const char *baseline_label, const char *svg_path);

/* Reads the "moe" members of the metrics file at metrics_path (a mixture-of-experts
 * run's router statistics, written by kiln train: docs/model.md) and draws the router
 * chart: per MoE block, one curve of max_over_mean (the busiest expert's load over the
 * mean load: 1 is balanced, E / k means one expert takes every choice) against step,
 * named "block L" for block index L, with a dashed line at 1 ("balanced"), so a collapse
 * in one block shows even where the average over blocks hides it. title may be NULL
 * ("router balance"). Written like kiln_metrics_plot_svg (a temporary file renamed over
 * svg_path). Lines without "moe" are skipped. On success *n_blocks (may be NULL) is the
 * number of curves.
 * Errors: KILN_ERR_UNSUPPORTED, naming the file, when no line has a "moe" member with
 * blocks (a dense model's run: a caller drawing whatever a run has can test for it and
 * skip the chart); KILN_ERR_FORMAT naming the file and line for a malformed line or a
 * "moe" member without arrays "layers" (integers >= 0) and "max_over_mean" (numbers or
 * null) of one length; KILN_ERR_IO when the file cannot be read or the chart written. */
kiln_status kiln_metrics_plot_router_svg(const char *metrics_path, const char *title, const char *svg_path,
                                         int *n_blocks);

#ifdef __cplusplus
}
#endif

#endif
