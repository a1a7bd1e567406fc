/* Metrics files (JSON lines), the SVG loss chart and the MoE router chart. */
#include <dirent.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kiln/metrics.h"

/* ---- helpers ---- */

static char tmpdir[256];

static int make_dir(void **state)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kiln_metrics_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int remove_dir(void **state)
{
    DIR *d = opendir(tmpdir);
    if (!d) return 0;
    struct dirent *e;
    char p[512];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", tmpdir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(tmpdir);
    return 0;
}

static const char *path_in(const char *name)
{
    static char p[512];
    snprintf(p, sizeof p, "%s/%s", tmpdir, name);
    return p;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    assert_non_null(s);
    assert_int_equal(fread(s, 1, (size_t)n, f), (size_t)n);
    s[n] = 0;
    fclose(f);
    return s;
}

static void spit(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static kiln_metrics_row row(int64_t step, double loss, double val)
{
    return (kiln_metrics_row){.step = step, .loss = loss, .val_loss = val, .lr = 6e-4,
                              .tokens_per_s = 5120.5, .grad_norm = 0.91, .ms_per_step = 400.1};
}

static void write_rows(const char *path, bool append, const kiln_metrics_row *r, size_t n)
{
    kiln_metrics_t *m;
    assert_int_equal(kiln_metrics_open(path, append, &m), KILN_OK);
    for (size_t i = 0; i < n; i++) assert_int_equal(kiln_metrics_write(m, &r[i]), KILN_OK);
    kiln_metrics_close(m);
}

static size_t count_of(const char *s, const char *needle)
{
    size_t k = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) k++;
    return k;
}

/* Number of "x,y" pairs in the points attribute of the polyline with the given class,
 * or -1 if there is no such polyline. */
static long polyline_points(const char *svg, const char *cls)
{
    char key[64];
    snprintf(key, sizeof key, "<polyline class=\"%s\"", cls);
    const char *p = strstr(svg, key);
    if (!p) return -1;
    p = strstr(p, "points=\"");
    assert_non_null(p);
    p += strlen("points=\"");
    const char *end = strchr(p, '"');
    assert_non_null(end);
    long pairs = 0;
    for (const char *q = p; q < end; q++)
        if (*q == ',') pairs++;
    return pairs;
}

/* A small well-formedness check: every tag is closed in order and every '&' starts one
 * of the five XML entities. Enough to catch an unescaped title or a dropped tag. */
static bool xml_balanced(const char *s)
{
    const char *stack[64];
    size_t lens[64], depth = 0;
    for (const char *p = s; *p; p++) {
        if (*p == '&') {
            static const char *ents[] = {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"};
            bool ok = false;
            for (int i = 0; i < 5; i++) ok |= strncmp(p, ents[i], strlen(ents[i])) == 0;
            if (!ok) return false;
        }
        if (*p != '<') continue;
        const char *close = strchr(p, '>');
        if (!close) return false;
        if (p[1] == '/') {
            size_t n = strcspn(p + 2, " >");
            if (depth == 0 || lens[depth - 1] != n || strncmp(stack[depth - 1], p + 2, n)) return false;
            depth--;
        } else if (close[-1] != '/') {
            if (depth == 64) return false;
            stack[depth] = p + 1;
            lens[depth] = strcspn(p + 1, " />");
            depth++;
        }
        p = close;
    }
    return depth == 0;
}

/* ~200 steps of a decaying loss, val loss every 20 steps. */
static kiln_metrics_row *fake_run(size_t n)
{
    kiln_metrics_row *r = malloc(n * sizeof *r);
    assert_non_null(r);
    for (size_t i = 0; i < n; i++) {
        double loss = 2.0 + 3.0 * exp(-(double)i / 40.0) + 0.05 * sin((double)i * 1.7);
        r[i] = row((int64_t)i, loss, i % 20 == 0 ? loss + 0.1 : NAN);
    }
    return r;
}

/* ---- the metrics file ---- */

static void test_write_read_round_trip(void **state)
{
    kiln_metrics_row in[3] = {row(0, 5.5, 5.6), row(10, 2.31, NAN), row(20, 2.125, 2.4)};
    in[1].grad_norm = NAN;
    write_rows(path_in("rt.jsonl"), false, in, 3);
    kiln_metrics_row *out;
    size_t n;
    assert_int_equal(kiln_metrics_read(path_in("rt.jsonl"), &out, &n), KILN_OK);
    assert_int_equal(n, 3);
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(out[i].step, in[i].step);
        assert_true(out[i].loss == in[i].loss);
        assert_true(out[i].lr == in[i].lr);
        assert_true(out[i].tokens_per_s == in[i].tokens_per_s);
        assert_true(out[i].ms_per_step == in[i].ms_per_step);
    }
    assert_true(out[0].val_loss == 5.6);
    assert_true(isnan(out[1].val_loss));
    assert_true(isnan(out[1].grad_norm));
    assert_true(out[2].val_loss == 2.4);
    free(out);
}

static void test_write_omits_nan_fields(void **state)
{
    kiln_metrics_row r = row(10, 2.31, NAN);
    write_rows(path_in("nan.jsonl"), false, &r, 1);
    char *text = slurp(path_in("nan.jsonl"));
    assert_string_equal(text, "{\"step\":10,\"loss\":2.31,\"lr\":0.0006,\"tokens_per_s\":5120.5,"
                              "\"grad_norm\":0.91,\"ms_per_step\":400.1}\n");
    free(text);
}

static void test_write_flushes_each_line(void **state)
{
    kiln_metrics_t *m;
    assert_int_equal(kiln_metrics_open(path_in("flush.jsonl"), false, &m), KILN_OK);
    kiln_metrics_row r = row(1, 3.0, NAN);
    assert_int_equal(kiln_metrics_write(m, &r), KILN_OK);
    kiln_metrics_row *out;
    size_t n;
    /* Read while the writer is still open: the line must already be on disk. */
    assert_int_equal(kiln_metrics_read(path_in("flush.jsonl"), &out, &n), KILN_OK);
    assert_int_equal(n, 1);
    free(out);
    kiln_metrics_close(m);
}

static void test_append_keeps_earlier_lines(void **state)
{
    kiln_metrics_row a[2] = {row(0, 4.0, NAN), row(1, 3.5, NAN)}, b = row(2, 3.0, 3.2);
    write_rows(path_in("app.jsonl"), false, a, 2);
    write_rows(path_in("app.jsonl"), true, &b, 1);
    kiln_metrics_row *out;
    size_t n;
    assert_int_equal(kiln_metrics_read(path_in("app.jsonl"), &out, &n), KILN_OK);
    assert_int_equal(n, 3);
    assert_int_equal(out[0].step, 0);
    assert_int_equal(out[1].step, 1);
    assert_int_equal(out[2].step, 2);
    free(out);
}

static void test_open_without_append_truncates(void **state)
{
    kiln_metrics_row a[2] = {row(0, 4.0, NAN), row(1, 3.5, NAN)}, b = row(7, 3.0, NAN);
    write_rows(path_in("trunc.jsonl"), false, a, 2);
    write_rows(path_in("trunc.jsonl"), false, &b, 1);
    kiln_metrics_row *out;
    size_t n;
    assert_int_equal(kiln_metrics_read(path_in("trunc.jsonl"), &out, &n), KILN_OK);
    assert_int_equal(n, 1);
    assert_int_equal(out[0].step, 7);
    free(out);
}

static void test_append_after_partial_line_starts_a_new_line(void **state)
{
    spit(path_in("partial.jsonl"), "{\"step\":1,\"loss\":3}\n{\"step\":2,\"lo");
    kiln_metrics_row r = row(3, 2.0, NAN);
    write_rows(path_in("partial.jsonl"), true, &r, 1);
    char *text = slurp(path_in("partial.jsonl"));
    assert_non_null(strstr(text, "{\"step\":2,\"lo\n{\"step\":3,"));
    free(text);
}

static void test_malformed_line_reports_its_line_number(void **state)
{
    const char *p = path_in("bad.jsonl");
    spit(p, "{\"step\":1,\"loss\":3}\n\n{\"step\":2,\"loss\":oops}\n{\"step\":3,\"loss\":1}\n");
    kiln_metrics_row *out = (kiln_metrics_row *)1;
    size_t n = 99;
    assert_int_equal(kiln_metrics_read(p, &out, &n), KILN_ERR_FORMAT);
    char want[600];
    snprintf(want, sizeof want, "%s:3:", p);
    assert_non_null(strstr(kiln_last_error(), want));
    assert_null(out);
    assert_int_equal(n, 0);
}

static void test_line_without_step_is_malformed(void **state)
{
    const char *p = path_in("nostep.jsonl");
    spit(p, "{\"step\":1,\"loss\":3}\n{\"loss\":2}\n");
    kiln_metrics_row *out;
    size_t n;
    assert_int_equal(kiln_metrics_read(p, &out, &n), KILN_ERR_FORMAT);
    char want[600];
    snprintf(want, sizeof want, "%s:2: no \"step\"", p);
    assert_non_null(strstr(kiln_last_error(), want));
}

static void test_field_of_wrong_type_is_malformed(void **state)
{
    const char *p = path_in("type.jsonl");
    spit(p, "{\"step\":1,\"loss\":\"3.0\"}\n");
    kiln_metrics_row *out;
    size_t n;
    assert_int_equal(kiln_metrics_read(p, &out, &n), KILN_ERR_FORMAT);
    assert_non_null(strstr(kiln_last_error(), ":1: \"loss\" must be a number"));
}

static void test_read_takes_foreign_json(void **state)
{
    /* Another writer: spaces, other key order, integers, null, an unknown key, CRLF. */
    const char *p = path_in("foreign.jsonl");
    spit(p, "  \n{ \"loss\" : 3 , \"step\" : 5, \"val_loss\": null, \"epoch\": 1, \"lr\": 1e-3 }\r\n   \n");
    kiln_metrics_row *out;
    size_t n;
    assert_int_equal(kiln_metrics_read(p, &out, &n), KILN_OK);
    assert_int_equal(n, 1);
    assert_int_equal(out[0].step, 5);
    assert_true(out[0].loss == 3.0);
    assert_true(out[0].lr == 1e-3);
    assert_true(isnan(out[0].val_loss));
    assert_true(isnan(out[0].grad_norm));
    free(out);
}

static void test_read_empty_file_gives_no_rows(void **state)
{
    spit(path_in("empty.jsonl"), "\n\n");
    kiln_metrics_row *out = (kiln_metrics_row *)1;
    size_t n = 99;
    assert_int_equal(kiln_metrics_read(path_in("empty.jsonl"), &out, &n), KILN_OK);
    assert_int_equal(n, 0);
    assert_null(out);
}

static void test_read_missing_file_is_io_error(void **state)
{
    kiln_metrics_row *out;
    size_t n;
    assert_int_equal(kiln_metrics_read(path_in("does-not-exist.jsonl"), &out, &n), KILN_ERR_IO);
    assert_non_null(strstr(kiln_last_error(), "does-not-exist.jsonl"));
}

/* ---- the chart ---- */

static void test_svg_has_one_polyline_per_series_with_all_points(void **state)
{
    kiln_metrics_row *r = fake_run(200);
    assert_int_equal(kiln_metrics_plot_svg(r, 200, "run", NAN, NULL, path_in("run.svg")), KILN_OK);
    char *svg = slurp(path_in("run.svg"));
    assert_int_equal(strncmp(svg, "<svg", 4), 0);
    size_t len = strlen(svg);
    assert_true(len > 8 && strcmp(svg + len - 7, "</svg>\n") == 0);
    assert_int_equal(count_of(svg, "<polyline"), 2);
    assert_int_equal(polyline_points(svg, "loss"), 200);
    assert_int_equal(polyline_points(svg, "val_loss"), 10);
    assert_true(xml_balanced(svg));
    free(svg);
    free(r);
}

static void test_svg_escapes_title(void **state)
{
    kiln_metrics_row *r = fake_run(50);
    assert_int_equal(kiln_metrics_plot_svg(r, 50, "lr<1e-3 & bs>8 \"x\"", NAN, NULL, path_in("esc.svg")), KILN_OK);
    char *svg = slurp(path_in("esc.svg"));
    assert_non_null(strstr(svg, "lr&lt;1e-3 &amp; bs&gt;8 &quot;x&quot;"));
    assert_null(strstr(svg, "& bs"));
    assert_true(xml_balanced(svg));
    free(svg);
    free(r);
}

static void test_svg_draws_labelled_dashed_baseline(void **state)
{
    kiln_metrics_row *r = fake_run(200);
    assert_int_equal(kiln_metrics_plot_svg(r, 200, "run", 2.5, "unigram <entropy>", path_in("base.svg")), KILN_OK);
    char *svg = slurp(path_in("base.svg"));
    const char *line = strstr(svg, "<line class=\"baseline\"");
    assert_non_null(line);
    assert_non_null(strstr(line, "stroke-dasharray"));
    assert_non_null(strstr(svg, "unigram &lt;entropy&gt; (2.5)"));
    assert_true(xml_balanced(svg));
    free(svg);
    free(r);
}

static void test_svg_without_baseline_has_none(void **state)
{
    kiln_metrics_row *r = fake_run(20);
    assert_int_equal(kiln_metrics_plot_svg(r, 20, "run", NAN, "unused", path_in("nobase.svg")), KILN_OK);
    char *svg = slurp(path_in("nobase.svg"));
    assert_null(strstr(svg, "baseline"));
    assert_null(strstr(svg, "unused"));
    free(svg);
    free(r);
}

static void test_svg_has_legend_and_axis_labels(void **state)
{
    kiln_metrics_row *r = fake_run(200);
    assert_int_equal(kiln_metrics_plot_svg(r, 200, "run", 2.5, "entropy", path_in("legend.svg")), KILN_OK);
    char *svg = slurp(path_in("legend.svg"));
    const char *legend = strstr(svg, "<g class=\"legend\"");
    assert_non_null(legend);
    assert_non_null(strstr(legend, ">train loss<"));
    assert_non_null(strstr(legend, ">val loss<"));
    assert_non_null(strstr(legend, ">entropy<"));
    assert_non_null(strstr(svg, ">step</text>"));
    assert_non_null(strstr(svg, ">loss</text>"));
    assert_non_null(strstr(svg, "<g class=\"xticks\""));
    assert_non_null(strstr(svg, "<g class=\"yticks\""));
    free(svg);
    free(r);
}

static void test_svg_with_no_rows_is_valid(void **state)
{
    assert_int_equal(kiln_metrics_plot_svg(NULL, 0, "empty", NAN, NULL, path_in("zero.svg")), KILN_OK);
    char *svg = slurp(path_in("zero.svg"));
    assert_int_equal(strncmp(svg, "<svg", 4), 0);
    assert_int_equal(count_of(svg, "<polyline"), 0);
    assert_non_null(strstr(svg, "no data"));
    assert_null(strstr(svg, "nan"));
    assert_true(xml_balanced(svg));
    free(svg);
}

static void test_svg_with_one_row_marks_the_point(void **state)
{
    kiln_metrics_row r = row(5, 3.0, 3.0);
    assert_int_equal(kiln_metrics_plot_svg(&r, 1, "one", 3.0, "flat", path_in("one.svg")), KILN_OK);
    char *svg = slurp(path_in("one.svg"));
    assert_int_equal(polyline_points(svg, "loss"), 1);
    assert_int_equal(polyline_points(svg, "val_loss"), 1);
    assert_true(count_of(svg, "<circle") >= 2); /* a lone point needs a dot to be seen */
    assert_null(strstr(svg, "nan"));
    assert_null(strstr(svg, "inf"));
    assert_true(xml_balanced(svg));
    free(svg);
}

static void test_svg_with_identical_values_has_finite_coordinates(void **state)
{
    kiln_metrics_row r[30];
    for (int i = 0; i < 30; i++) r[i] = row(7, 0.0, NAN); /* same step and same loss */
    assert_int_equal(kiln_metrics_plot_svg(r, 30, "flat", NAN, NULL, path_in("flat.svg")), KILN_OK);
    char *svg = slurp(path_in("flat.svg"));
    assert_int_equal(polyline_points(svg, "loss"), 30);
    assert_null(strstr(svg, "nan"));
    assert_null(strstr(svg, "inf"));
    free(svg);
}

static void test_svg_skips_nonfinite_losses(void **state)
{
    kiln_metrics_row *r = fake_run(100);
    r[10].loss = NAN;
    r[11].loss = INFINITY;
    r[12].loss = -INFINITY;
    assert_int_equal(kiln_metrics_plot_svg(r, 100, "gaps", NAN, NULL, path_in("gaps.svg")), KILN_OK);
    char *svg = slurp(path_in("gaps.svg"));
    assert_int_equal(polyline_points(svg, "loss"), 97);
    assert_null(strstr(svg, "nan"));
    assert_null(strstr(svg, "inf"));
    free(svg);
    free(r);
}

static void test_svg_write_leaves_no_temporary_file(void **state)
{
    kiln_metrics_row *r = fake_run(20);
    spit(path_in("atomic.svg"), "old chart");
    assert_int_equal(kiln_metrics_plot_svg(r, 20, "run", NAN, NULL, path_in("atomic.svg")), KILN_OK);
    char *svg = slurp(path_in("atomic.svg"));
    assert_int_equal(strncmp(svg, "<svg", 4), 0); /* replaced, not appended to */
    free(svg);
    DIR *d = opendir(tmpdir);
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d))) assert_null(strstr(e->d_name, ".tmp."));
    closedir(d);
    free(r);
}

static void test_svg_to_unwritable_path_is_io_error(void **state)
{
    kiln_metrics_row r = row(0, 1.0, NAN);
    assert_int_equal(kiln_metrics_plot_svg(&r, 1, "x", NAN, NULL, path_in("no/such/dir/x.svg")), KILN_ERR_IO);
}

/* ---- the router chart ---- */

/* Six steps of a model with MoE blocks 1 and 2, E = 8 experts, top-2: block 1 collapses
 * (its max_over_mean climbs to E / k = 4, one expert taking every choice) while block 2
 * stays near balance, and their mean (at most 2.55) would hide it. One line (step 3) has
 * no router statistics. */
static const char *const COLLAPSE =
    "{\"step\":1,\"loss\":5.5,\"moe\":{\"layers\":[1,2],\"load\":[[64,64,64,64,64,64,64,64],[64,64,64,64,64,64,64,64]],"
    "\"bias\":[[0,0,0,0,0,0,0,0],[0,0,0,0,0,0,0,0]],\"max_over_mean\":[1,1],\"dropped\":0}}\n"
    "{\"step\":2,\"loss\":5.1,\"moe\":{\"layers\":[1,2],\"max_over_mean\":[1.6,1.12],\"dropped\":0}}\n"
    "{\"step\":3,\"loss\":4.9}\n"
    "\n"
    "{\"step\":4,\"loss\":4.7,\"moe\":{\"layers\":[1,2],\"max_over_mean\":[2.68,1.3],\"dropped\":0}}\n"
    "{\"step\":5,\"loss\":4.6,\"moe\":{\"layers\":[1,2],\"max_over_mean\":[3.5,1.2],\"dropped\":0}}\n"
    "{\"step\":6,\"loss\":4.6,\"moe\":{\"layers\":[1,2],\"max_over_mean\":[3.9,1.15],\"dropped\":0}}\n"
    "{\"step\":7,\"loss\":4.5,\"moe\":{\"layers\":[1,2],\"load\":[[0,0,0,512,0,0,0,0],[70,60,64,64,58,66,60,70]],"
    "\"max_over_mean\":[4,1.1],\"dropped\":0}}\n";

/* Where the router chart of metrics file m goes: path_in's buffer holds one path at a
 * time. */
static const char *svg_for(const char *m)
{
    static char p[600];
    snprintf(p, sizeof p, "%s.svg", m);
    return p;
}

/* The y coordinate of the last point of the polyline with the given class. */
static double last_point_y(const char *svg, const char *cls)
{
    char key[64];
    snprintf(key, sizeof key, "<polyline class=\"%s\"", cls);
    const char *p = strstr(svg, key);
    assert_non_null(p);
    const char *end = strstr(p, "\"/>");
    assert_non_null(end);
    const char *comma = end;
    while (*comma != ',') comma--;
    return strtod(comma + 1, NULL);
}

static void test_router_chart_has_a_curve_per_block_and_the_balanced_line(void **state)
{
    const char *m = path_in("moe.jsonl"), *svg_path = svg_for(m);
    spit(m, COLLAPSE);
    int blocks = -1;
    assert_int_equal(kiln_metrics_plot_router_svg(m, "router", svg_path, &blocks), KILN_OK);
    assert_int_equal(blocks, 2);
    char *svg = slurp(svg_path);
    assert_int_equal(strncmp(svg, "<svg", 4), 0);
    assert_true(xml_balanced(svg));
    assert_int_equal(count_of(svg, "<polyline"), 2);
    assert_int_equal(polyline_points(svg, "block_1"), 6); /* the step without "moe" is skipped */
    assert_int_equal(polyline_points(svg, "block_2"), 6);
    const char *legend = strstr(svg, "<g class=\"legend\"");
    assert_non_null(legend);
    assert_non_null(strstr(legend, ">block 1<"));
    assert_non_null(strstr(legend, ">block 2<"));
    assert_non_null(strstr(legend, ">balanced<"));
    const char *line = strstr(svg, "<line class=\"baseline\"");
    assert_non_null(line);
    assert_non_null(strstr(line, "stroke-dasharray"));
    assert_non_null(strstr(svg, "balanced (1)"));
    assert_non_null(strstr(svg, ">max load / mean</text>"));
    assert_non_null(strstr(svg, ">4.0</text>")); /* the axis reaches E / k */
    /* The collapsed block ends high on the chart (small y), the balanced one low. */
    assert_true(last_point_y(svg, "block_1") + 200 < last_point_y(svg, "block_2"));
    free(svg);
}

static void test_router_chart_reads_what_the_writer_wrote(void **state)
{
    kiln_metrics_row r[3] = {row(1, 5.0, NAN), row(2, 4.0, NAN), row(3, 3.5, 3.6)};
    r[0].extra = "{\"moe\":{\"layers\":[2,5,9],\"max_over_mean\":[1.2,1.5,1.1],\"dropped\":0}}";
    r[1].extra = "{\"moe\":{\"layers\":[2,5,9],\"max_over_mean\":[1.1,2.5,1.05],\"dropped\":0}}";
    r[2].extra = "{\"moe\":{\"layers\":[2,5,9],\"max_over_mean\":[1.0,3.5,1.0],\"dropped\":0}}";
    const char *m = path_in("w.jsonl"), *svg_path = svg_for(m);
    write_rows(m, false, r, 3);
    int blocks = -1;
    assert_int_equal(kiln_metrics_plot_router_svg(m, NULL, svg_path, &blocks), KILN_OK);
    assert_int_equal(blocks, 3);
    char *svg = slurp(svg_path);
    assert_int_equal(count_of(svg, "<polyline"), 3);
    assert_int_equal(polyline_points(svg, "block_2"), 3);
    assert_int_equal(polyline_points(svg, "block_5"), 3);
    assert_int_equal(polyline_points(svg, "block_9"), 3);
    assert_non_null(strstr(svg, ">block 9<"));
    assert_non_null(strstr(svg, ">router balance</text>")); /* the title when none is given */
    free(svg);
}

static void test_router_chart_of_a_dense_run_is_unsupported(void **state)
{
    const char *m = path_in("dense.jsonl"), *svg = svg_for(m);
    kiln_metrics_row *r = fake_run(20);
    write_rows(m, false, r, 20);
    free(r);
    int blocks = -1;
    assert_int_equal(kiln_metrics_plot_router_svg(m, NULL, svg, &blocks), KILN_ERR_UNSUPPORTED);
    assert_int_equal(blocks, 0);
    assert_non_null(strstr(kiln_last_error(), "dense.jsonl"));
    assert_non_null(strstr(kiln_last_error(), "no \"moe\" members"));
    assert_int_equal(access(svg, F_OK), -1); /* nothing written */
}

static void test_router_chart_with_a_malformed_moe_member_names_the_line(void **state)
{
    static const char *const bad[][2] = {
        {"{\"step\":2,\"moe\":[1,2]}", "\"moe\" must be an object"},
        {"{\"step\":2,\"moe\":{\"layers\":[1,2],\"max_over_mean\":[1.5]}}", "of the same length"},
        {"{\"step\":2,\"moe\":{\"max_over_mean\":[1.5]}}", "of the same length"},
        {"{\"step\":2,\"moe\":{\"layers\":[1,\"2\"],\"max_over_mean\":[1.5,1]}}", "\"layers\"[1] must be a block"},
        {"{\"step\":2,\"moe\":{\"layers\":[-1],\"max_over_mean\":[1.5]}}", "\"layers\"[0] must be a block"},
        {"{\"step\":2,\"moe\":{\"layers\":[1,2],\"max_over_mean\":[1.5,\"x\"]}}",
         "\"max_over_mean\"[1] must be a number"},
        {"{\"moe\":{\"layers\":[1],\"max_over_mean\":[1.5]}}", "no \"step\""},
    };
    const char *p = path_in("badmoe.jsonl"), *svg = svg_for(p);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[512], want[600];
        snprintf(text, sizeof text, "{\"step\":1,\"moe\":{\"layers\":[1,2],\"max_over_mean\":[1,1]}}\n%s\n", bad[i][0]);
        spit(p, text);
        assert_int_equal(kiln_metrics_plot_router_svg(p, NULL, svg, NULL), KILN_ERR_FORMAT);
        snprintf(want, sizeof want, "%s:2: ", p);
        if (!strstr(kiln_last_error(), want) || !strstr(kiln_last_error(), bad[i][1]))
            fail_msg("case %zu: got \"%s\", want \"%s\" and \"%s\"", i, kiln_last_error(), want, bad[i][1]);
    }
    assert_int_equal(access(svg, F_OK), -1);
}

static void test_router_chart_of_a_missing_file_is_io_error(void **state)
{
    const char *m = path_in("none.jsonl");
    assert_int_equal(kiln_metrics_plot_router_svg(m, NULL, svg_for(m), NULL), KILN_ERR_IO);
    assert_non_null(strstr(kiln_last_error(), "none.jsonl"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_read_round_trip),
        cmocka_unit_test(test_write_omits_nan_fields),
        cmocka_unit_test(test_write_flushes_each_line),
        cmocka_unit_test(test_append_keeps_earlier_lines),
        cmocka_unit_test(test_open_without_append_truncates),
        cmocka_unit_test(test_append_after_partial_line_starts_a_new_line),
        cmocka_unit_test(test_malformed_line_reports_its_line_number),
        cmocka_unit_test(test_line_without_step_is_malformed),
        cmocka_unit_test(test_field_of_wrong_type_is_malformed),
        cmocka_unit_test(test_read_takes_foreign_json),
        cmocka_unit_test(test_read_empty_file_gives_no_rows),
        cmocka_unit_test(test_read_missing_file_is_io_error),
        cmocka_unit_test(test_svg_has_one_polyline_per_series_with_all_points),
        cmocka_unit_test(test_svg_escapes_title),
        cmocka_unit_test(test_svg_draws_labelled_dashed_baseline),
        cmocka_unit_test(test_svg_without_baseline_has_none),
        cmocka_unit_test(test_svg_has_legend_and_axis_labels),
        cmocka_unit_test(test_svg_with_no_rows_is_valid),
        cmocka_unit_test(test_svg_with_one_row_marks_the_point),
        cmocka_unit_test(test_svg_with_identical_values_has_finite_coordinates),
        cmocka_unit_test(test_svg_skips_nonfinite_losses),
        cmocka_unit_test(test_svg_write_leaves_no_temporary_file),
        cmocka_unit_test(test_svg_to_unwritable_path_is_io_error),
        cmocka_unit_test(test_router_chart_has_a_curve_per_block_and_the_balanced_line),
        cmocka_unit_test(test_router_chart_reads_what_the_writer_wrote),
        cmocka_unit_test(test_router_chart_of_a_dense_run_is_unsupported),
        cmocka_unit_test(test_router_chart_with_a_malformed_moe_member_names_the_line),
        cmocka_unit_test(test_router_chart_of_a_missing_file_is_io_error),
    };
    return cmocka_run_group_tests(tests, make_dir, remove_dir);
}
