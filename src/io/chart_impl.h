/* Private: a line chart over training steps as a standalone SVG file, drawn by chart.c
 * for metrics.c's charts (the loss chart, the router chart). */
#ifndef KILN_IO_CHART_IMPL_H
#define KILN_IO_CHART_IMPL_H

#include <stddef.h>
#include "kiln/tensor.h"

/* One curve. Its colour is the chart palette's entry for its position in the chart. */
typedef struct {
    const char *name;  /* in the legend */
    const char *cls;   /* the polyline's class attribute (a plain word: not escaped) */
    double width;      /* of the stroke, in pixels */
    const double *y;   /* (n): a non-finite value is a missing point; the curve is drawn through the rest */
} kiln__chart_series;

/* A chart of ns series over the same n steps. Everything is borrowed. */
typedef struct {
    const char *title;  /* any text; escaped */
    const char *ylabel; /* the y axis's label; escaped */
    size_t n;
    const double *x; /* (n) steps; NULL only when n is 0 */
    const kiln__chart_series *series;
    int ns;
    double baseline;            /* a dashed horizontal line at this y; NaN: none */
    const char *baseline_label; /* its label, followed by its value */
} kiln__chart;

/* Draws c and writes it to a temporary file beside svg_path, renamed over it. */
kiln_status kiln__chart_write_svg(const kiln__chart *c, const char *svg_path);

#endif
