/* Flex attention (kiln/flex.h): score and mask modifiers as small expressions, parsed
 * once into a tree; presets and their joins written as such expressions; the block
 * mask; and the attention itself, computed densely with kiln's ops (the reference that
 * fused kernels are checked against, differentiable through autograd). The expression
 * language is written here by hand: it is twenty lines of grammar, and no library
 * parses C's expressions into a tree a code generator can walk as well. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/dtype.h"
#include "core/op_table.h"
#include "core/opts.h"
#include "core/parse.h"
#include "flex/flex_impl.h"
#include "kiln/ops.h"
#include "ops/autocast.h"


const char *const kiln__flex_var_names[N_VARS] = {"score", "b", "h", "q_idx", "kv_idx", "q_len", "kv_len"};
const char *const kiln__flex_fn_names[N_FNS] = {"tanh", "exp", "log", "abs", "sqrt", "min", "max"};
static const int fn_args[N_FNS] = {1, 1, 1, 1, 1, 2, 2};
#define var_names kiln__flex_var_names
#define fn_names kiln__flex_fn_names

/* The reason first, then where: "flex score_mod: unknown name bogus, at column 9 of
 * \"score + bogus\"" (a long expression quoted around the column). */
static kiln_status fail(parser *ps, const char *fmt, const char *detail)
{
    char q[160];
    size_t at = (size_t)(ps->p - ps->text);
    if (ps->err == KILN_OK)
        ps->err = kiln_error(KILN_ERR_ARG, "flex %s: %s%s, at column %zu of \"%s\"", ps->what, fmt, detail ? detail : "",
                             at + 1, kiln__excerpt(ps->text, at, 60, q, sizeof q));
    return ps->err;
}

/* The expression, quoted short, for a message that puts its reason first. */
#define QUOTED(ps, buf) kiln__excerpt((ps)->text, 0, 60, buf, sizeof buf)

static void skip(parser *ps)
{
    while (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n') ps->p++;
}

static bool eat(parser *ps, const char *tok)
{
    skip(ps);
    size_t n = strlen(tok);
    if (strncmp(ps->p, tok, n)) return false;
    /* "<" is not "<=", "&" alone is not an operator */
    if (n == 1 && (*tok == '<' || *tok == '>' || *tok == '!' || *tok == '=') && ps->p[1] == '=') return false;
    ps->p += n;
    return true;
}

static int node(parser *ps, anode a)
{
    if (ps->count == MAX_NODES) {
        fail(ps, "the expression is too long", NULL);
        return -1;
    }
    ps->n[ps->count] = a;
    return ps->count++;
}

static int expr(parser *ps);

static int primary(parser *ps)
{
    skip(ps);
    const char *s = ps->p;
    bool integer;
    size_t len = kiln__number_len(s, &integer);
    if (len) {
        /* A literal is a finite float whatever the path computes in (the f32 kernels
         * would make 1e39 inf, and 1e400 is no C literal), and a whole number that int64
         * cannot hold (2^63 and up) is a float: the dense and fused paths then compute
         * it the same. */
        char lit[64], q[48];
        double v = 0;
        snprintf(lit, sizeof lit, "%.*s", (int)(len < sizeof lit - 1 ? len : sizeof lit - 1), s);
        if (len >= sizeof lit || !kiln__scan_f64(lit, &v) || fabs(v) > FLT_MAX)
            return fail(ps, "a literal that is not a finite float (at most 3.4e38): ",
                        kiln__excerpt(lit, 0, 40, q, sizeof q)), -1;
        if (integer && v >= 0x1p63) integer = false;
        ps->p = s + len;
        if (*ps->p == 'f') ps->p++; /* 1.5f as C writes it */
        return node(ps, (anode){.kind = A_NUM, .num = v, .integer = integer});
    }
    if (eat(ps, "(")) {
        int e = expr(ps);
        if (e >= 0 && !eat(ps, ")")) return fail(ps, "')' expected", NULL), -1;
        return e;
    }
    if (!(*s == '_' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z')))
        return fail(ps, *s ? "a value expected" : "the expression ends too soon", NULL), -1;
    const char *e = s;
    while (*e == '_' || (*e >= 'a' && *e <= 'z') || (*e >= 'A' && *e <= 'Z') || (*e >= '0' && *e <= '9')) e++;
    len = (size_t)(e - s);
    char word[32];
    snprintf(word, sizeof word, "%.*s", (int)(len < 31 ? len : 31), s);
    ps->p = e;
    for (int v = 0; v < N_VARS; v++)
        if (!strcmp(word, var_names[v])) return node(ps, (anode){.kind = A_NAME, .op = v});
    if (word[0] == 'c' && len == 2 && word[1] >= '0' && word[1] < '0' + MAX_CAPTURED) {
        anode a = {.kind = A_CAP, .op = word[1] - '0'};
        if (!eat(ps, "[")) return fail(ps, "a captured tensor is read at indices: ", "c0[h]"), -1;
        do {
            if (a.n_arg == 4) return fail(ps, "more than 4 indices", NULL), -1;
            if ((a.arg[a.n_arg++] = expr(ps)) < 0) return -1;
        } while (eat(ps, ","));
        if (!eat(ps, "]")) return fail(ps, "']' expected", NULL), -1;
        return node(ps, a);
    }
    for (int f = 0; f < N_FNS; f++)
        if (!strcmp(word, fn_names[f])) {
            anode a = {.kind = A_CALL, .op = f};
            if (!eat(ps, "(")) return fail(ps, "'(' expected after ", fn_names[f]), -1;
            do {
                if (a.n_arg == fn_args[f]) return fail(ps, "too many arguments to ", fn_names[f]), -1;
                if ((a.arg[a.n_arg++] = expr(ps)) < 0) return -1;
            } while (eat(ps, ","));
            if (a.n_arg != fn_args[f]) return fail(ps, "too few arguments to ", fn_names[f]), -1;
            if (!eat(ps, ")")) return fail(ps, "')' expected", NULL), -1;
            return node(ps, a);
        }
    ps->p = s;
    return fail(ps, "unknown name ", word), -1;
}

/* One level deeper (an expression inside parentheses, a call, an index or a ?: branch;
 * a unary operator's operand); false past KILN_FLEX_MAX_DEPTH, with the error. The
 * grammar recurses once per level, so this bounds the stack (10,000 parentheses or
 * 50,000 '-' would overflow it); the tree's walks after it are bounded by MAX_NODES. */
static bool deeper(parser *ps)
{
    if (++ps->depth <= KILN_FLEX_MAX_DEPTH) return true;
    char why[96];
    snprintf(why, sizeof why, "nested more than KILN_FLEX_MAX_DEPTH (%d) levels deep", KILN_FLEX_MAX_DEPTH);
    fail(ps, why, NULL);
    return false;
}

static int unary(parser *ps)
{
    akind k = eat(ps, "-") ? A_NEG : eat(ps, "!") ? A_NOT : A_NUM;
    if (k == A_NUM) return primary(ps);
    if (!deeper(ps)) return -1;
    int a = unary(ps);
    ps->depth--;
    return a < 0 ? -1 : node(ps, (anode){.kind = k, .n_arg = 1, .arg = {a}});
}

/* One level of left-associative binary operators: ops[i] is binop codes[i]. */
static int level(parser *ps, int (*next)(parser *), const char *const *ops, const binop *codes, int n_ops)
{
    int l = next(ps);
    while (l >= 0) {
        int k = 0;
        while (k < n_ops && !eat(ps, ops[k])) k++;
        if (k == n_ops) break;
        int r = next(ps);
        if (r < 0) return -1;
        l = node(ps, (anode){.kind = A_BIN, .op = codes[k], .n_arg = 2, .arg = {l, r}});
    }
    return l;
}

static int mul(parser *ps) { return level(ps, unary, (const char *const[]){"*", "/"}, (binop[]){B_MUL, B_DIV}, 2); }
static int add(parser *ps) { return level(ps, mul, (const char *const[]){"+", "-"}, (binop[]){B_ADD, B_SUB}, 2); }
static int cmp(parser *ps)
{
    return level(ps, add, (const char *const[]){"<=", ">=", "==", "!=", "<", ">"},
                 (binop[]){B_LE, B_GE, B_EQ, B_NE, B_LT, B_GT}, 6);
}
static int and_(parser *ps) { return level(ps, cmp, (const char *const[]){"&&"}, (binop[]){B_AND}, 1); }
static int or_(parser *ps) { return level(ps, and_, (const char *const[]){"||"}, (binop[]){B_OR}, 1); }

static int expr(parser *ps)
{
    if (!deeper(ps)) return -1;
    int c = or_(ps), r = c;
    if (c >= 0 && eat(ps, "?")) {
        int a = expr(ps), b = -1;
        if (a >= 0 && !eat(ps, ":")) fail(ps, "':' expected", NULL);
        else if (a >= 0) b = expr(ps);
        r = b < 0 ? -1 : node(ps, (anode){.kind = A_TERN, .n_arg = 3, .arg = {c, a, b}});
    }
    ps->depth--;
    return r;
}

/* Which names and captured tensors a tree reads. */
static void uses(const parser *ps, int i, bool *vars, bool *caps)
{
    const anode *a = &ps->n[i];
    if (a->kind == A_NAME) vars[a->op] = true;
    if (a->kind == A_CAP) caps[a->op] = true;
    for (int j = 0; j < a->n_arg; j++) uses(ps, a->arg[j], vars, caps);
}

/* ---- the modifiers ---- */

void kiln_flex_free(kiln_flex_t *f)
{
    if (!f) return;
    for (int i = 0; i < f->n_cap; i++) kiln_tensor_free(f->cap[i]);
    free(f->ps[0]);
    free(f->ps[1]);
    free(f->score);
    free(f->mask);
    free(f);
}

/* Node i's type by the language's rules (0 bool, 1 integer, 2 float); the reads of
 * captured tensors checked against them on the way: as many indices as dims, none a
 * float. */
static int type_of(const kiln_flex_t *f, const parser *ps, int i, kiln_status *s)
{
    const anode *a = &ps->n[i];
    int t[4] = {0};
    for (int j = 0; j < a->n_arg; j++) t[j] = type_of(f, ps, a->arg[j], s);
    switch (a->kind) {
    case A_NUM: return a->integer ? 1 : 2;
    case A_NAME: return a->op == V_SCORE ? 2 : 1;
    case A_NEG: return t[0] ? t[0] : 1;
    case A_NOT: return 0;
    case A_TERN: return t[1] > t[2] ? t[1] : t[2];
    case A_CALL:
        if (a->op == F_MIN || a->op == F_MAX) return (t[0] > t[1] ? t[0] : t[1]) ? (t[0] > t[1] ? t[0] : t[1]) : 1;
        return a->op == F_ABS && t[0] < 2 ? 1 : 2;
    case A_CAP: {
        kiln_tensor_t *c = f->cap[a->op];
        char q[96];
        if (*s == KILN_OK && kiln_tensor_ndim(c) != a->n_arg)
            *s = kiln_error(KILN_ERR_SHAPE, "flex %s: c%d has %d dims, read at %d indices, in \"%s\"", ps->what, a->op,
                            kiln_tensor_ndim(c), a->n_arg, QUOTED(ps, q));
        for (int j = 0; j < a->n_arg && *s == KILN_OK; j++)
            if (t[j] == 2)
                *s = kiln_error(KILN_ERR_ARG, "flex %s: an index of c%d is a float, in \"%s\"", ps->what, a->op,
                                QUOTED(ps, q));
        return kiln__flex_elem_type(kiln_tensor_dtype(c));
    }
    case A_BIN:
        if (a->op >= B_LT) return 0; /* comparisons, && and || */
        return a->op == B_DIV ? 2 : (t[0] > t[1] ? t[0] : t[1]) ? (t[0] > t[1] ? t[0] : t[1]) : 1;
    }
    return 2;
}

static kiln_status parse(kiln_flex_t *f, int which, const char *text)
{
    if (!text || !*text) return KILN_OK;
    parser *ps = calloc(1, sizeof *ps);
    if (!ps) return kiln_error(KILN_ERR_OOM, "flex: out of memory");
    f->ps[which] = ps;
    ps->text = ps->p = text;
    ps->what = which ? "mask_mod" : "score_mod";
    ps->root = expr(ps);
    skip(ps);
    if (ps->err == KILN_OK && *ps->p) fail(ps, "unexpected text after the expression", NULL);
    if (ps->err != KILN_OK) return ps->err;
    uses(ps, ps->root, f->vars[which], f->caps[which]);
    char q[96];
    if (which == 1 && f->vars[1][V_SCORE])
        return kiln_error(KILN_ERR_ARG, "flex mask_mod: a mask reads no score (a score_mod changes scores), in \"%s\"",
                          QUOTED(ps, q));
    for (int c = 0; c < MAX_CAPTURED; c++)
        if (f->caps[which][c] && c >= f->n_cap)
            return kiln_error(KILN_ERR_ARG, "flex %s: c%d is read but %d tensor(s) are captured, in \"%s\"", ps->what, c,
                              f->n_cap, QUOTED(ps, q));
    kiln_status s = KILN_OK;
    type_of(f, ps, ps->root, &s);
    return s;
}

kiln_status kiln_flex_new(const char *score_mod, const char *mask_mod, kiln_tensor_t *const *captured, int n_captured,
                          kiln_flex_t **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "flex_new: NULL out");
    *out = NULL;
    if (n_captured < 0 || n_captured > MAX_CAPTURED || (n_captured && !captured))
        return kiln_error(KILN_ERR_ARG, "flex_new: %d captured tensors (0 to %d)", n_captured, MAX_CAPTURED);
    for (int i = 0; i < n_captured; i++)
        if (!captured[i]) return kiln_error(KILN_ERR_ARG, "flex_new: captured tensor %d is NULL", i);
    kiln_flex_t *f = calloc(1, sizeof *f);
    if (!f) return kiln_error(KILN_ERR_OOM, "flex: out of memory");
    f->score = strdup(score_mod ? score_mod : "");
    f->mask = strdup(mask_mod ? mask_mod : "");
    for (int i = 0; i < n_captured; i++) f->cap[f->n_cap++] = kiln_tensor_retain(captured[i]);
    kiln_status s = f->score && f->mask ? KILN_OK : kiln_error(KILN_ERR_OOM, "flex: out of memory");
    if (s == KILN_OK) s = parse(f, 0, f->score);
    if (s == KILN_OK) s = parse(f, 1, f->mask);
    if (s != KILN_OK) {
        kiln_flex_free(f);
        return s;
    }
    *out = f;
    return KILN_OK;
}

const char *kiln_flex_score_text(const kiln_flex_t *f) { return f ? f->score : ""; }
const char *kiln_flex_mask_text(const kiln_flex_t *f) { return f ? f->mask : ""; }

/* text with every c<i> renumbered c<i + shift>, and (for a score) every `score` replaced
 * by inner; appended to buf. */
static void rewrite(char *buf, size_t cap, const char *text, int shift, const char *inner)
{
    size_t n = strlen(buf);
    for (const char *p = text; *p && n + 64 < cap;) {
        bool word_start = (*p == '_' || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z')) &&
                          (p == text || !(p[-1] == '_' || (p[-1] >= 'a' && p[-1] <= 'z') ||
                                          (p[-1] >= 'A' && p[-1] <= 'Z') || (p[-1] >= '0' && p[-1] <= '9')));
        const char *e = p;
        if (word_start)
            while (*e == '_' || (*e >= 'a' && *e <= 'z') || (*e >= 'A' && *e <= 'Z') || (*e >= '0' && *e <= '9')) e++;
        size_t len = (size_t)(e - p);
        if (word_start && len == 2 && p[0] == 'c' && p[1] >= '0' && p[1] <= '9') {
            n += (size_t)snprintf(buf + n, cap - n, "c%d", p[1] - '0' + shift);
            p = e;
        } else if (word_start && inner && len == 5 && !strncmp(p, "score", 5)) {
            n += (size_t)snprintf(buf + n, cap - n, "(%s)", inner);
            p = e;
        } else if (word_start) {
            n += (size_t)snprintf(buf + n, cap - n, "%.*s", (int)len, p);
            p = e;
        } else {
            buf[n++] = *p++;
            buf[n] = 0;
        }
    }
}

static kiln_status join(const kiln_flex_t *a, const kiln_flex_t *b, const char *op, kiln_flex_t **out)
{
    if (!a || !b || !out) return kiln_error(KILN_ERR_ARG, "flex_%s: NULL argument", *op == '&' ? "and" : "or");
    if (a->n_cap + b->n_cap > MAX_CAPTURED)
        return kiln_error(KILN_ERR_ARG, "flex: %d captured tensors joined, at most %d", a->n_cap + b->n_cap, MAX_CAPTURED);
    size_t cap = 4 * (strlen(a->score) + strlen(a->mask) + strlen(b->score) + strlen(b->mask)) + 256;
    char *score = calloc(1, cap), *mask = calloc(1, cap);
    kiln_status s = score && mask ? KILN_OK : kiln_error(KILN_ERR_OOM, "flex: out of memory");
    if (s == KILN_OK) {
        if (*b->score) rewrite(score, cap, b->score, a->n_cap, *a->score ? a->score : NULL);
        else rewrite(score, cap, a->score, 0, NULL);
        if (*a->mask && *b->mask) {
            strcpy(mask, "(");
            rewrite(mask, cap, a->mask, 0, NULL);
            strcat(mask, ") ");
            strcat(mask, op);
            strcat(mask, " (");
            rewrite(mask, cap, b->mask, a->n_cap, NULL);
            strcat(mask, ")");
        } else if (*op == '&') { /* no mask is "every key": and keeps the other */
            rewrite(mask, cap, *a->mask ? a->mask : b->mask, *a->mask ? 0 : a->n_cap, NULL);
        } /* or with "every key" is every key: no mask */
        kiln_tensor_t *caps[MAX_CAPTURED];
        for (int i = 0; i < a->n_cap; i++) caps[i] = a->cap[i];
        for (int i = 0; i < b->n_cap; i++) caps[a->n_cap + i] = b->cap[i];
        s = kiln_flex_new(score, mask, caps, a->n_cap + b->n_cap, out);
    }
    free(score);
    free(mask);
    return s;
}

kiln_status kiln_flex_and(const kiln_flex_t *a, const kiln_flex_t *b, kiln_flex_t **out) { return join(a, b, "&&", out); }
kiln_status kiln_flex_or(const kiln_flex_t *a, const kiln_flex_t *b, kiln_flex_t **out) { return join(a, b, "||", out); }

#define CAUSAL "q_idx + kv_len - q_len >= kv_idx"

/* The largest window and prefix: a position of kiln's int rows. */
#define MAX_SPAN INT32_MAX

/* One preset, by name and argument. Its numbers are read by core/parse.h's parser, as the
 * paged serving path (src/nn/gpt_config.c) reads the same spec: window:1e1, window:0x10 and
 * window:inf are refused by both, not read two ways. A softcap is a normal positive
 * float: C * tanh(score / C) of a subnormal C divides by a float 0. */
static kiln_status preset(const char *name, const char *arg, const kiln_flex_inputs *in, kiln_flex_t **out)
{
    char text[256];
    int64_t n = 0;
    double v = 0;
    kiln_status s = KILN_OK;
    if (!strcmp(name, "causal") && !arg) return kiln_flex_new(NULL, CAUSAL, NULL, 0, out);
    if (!strcmp(name, "window") && arg && (s = kiln__parse_i64(arg, 1, MAX_SPAN, "W of window:W", &n)) == KILN_OK) {
        snprintf(text, sizeof text, CAUSAL " && q_idx + kv_len - q_len - kv_idx < %lld", (long long)n);
        return kiln_flex_new(NULL, text, NULL, 0, out);
    }
    if (!strcmp(name, "prefix") && arg && (s = kiln__parse_i64(arg, 0, MAX_SPAN, "P of prefix:P", &n)) == KILN_OK) {
        snprintf(text, sizeof text, "kv_idx < %lld || " CAUSAL, (long long)n);
        return kiln_flex_new(NULL, text, NULL, 0, out);
    }
    if (!strcmp(name, "softcap") && arg &&
        (s = kiln__parse_f64(arg, FLT_MIN, FLT_MAX, 0, "C of softcap:C (a normal positive float)", &v)) == KILN_OK) {
        snprintf(text, sizeof text, "%.17g * tanh(score / %.17g)", v, v);
        return kiln_flex_new(text, NULL, NULL, 0, out);
    }
    if (s != KILN_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", kiln_last_error());
        return kiln_error(s, "flex preset: %s", why);
    }
    if (!strcmp(name, "doc") && !arg) {
        if (!in || !in->doc_ids)
            return kiln_error(KILN_ERR_ARG, "flex preset doc: give the (B, T) document ids (kiln_flex_inputs.doc_ids)");
        return kiln_flex_new(NULL, "c0[b, q_idx + kv_len - q_len] == c0[b, kv_idx]", &in->doc_ids, 1, out);
    }
    if (!strcmp(name, "alibi") && !arg) {
        kiln_tensor_t *slopes = in ? in->alibi_slopes : NULL;
        bool made = false;
        if (!slopes) {
            int64_t H = in ? in->heads : 0;
            if (H < 1 || H > 4096)
                return kiln_error(KILN_ERR_ARG, "flex preset alibi: give the slopes or the number of heads "
                                  "(kiln_flex_inputs.alibi_slopes or .heads)");
            float *s = malloc(sizeof(float) * (size_t)H);
            if (!s) return kiln_error(KILN_ERR_OOM, "flex: out of memory");
            for (int64_t h = 0; h < H; h++) s[h] = (float)exp2(-8.0 * (double)(h + 1) / (double)H);
            slopes = kiln_from_data(s, &H, 1, KILN_DTYPE_F32);
            free(s);
            if (!slopes) return kiln_last_status();
            slopes = kiln_keep(slopes);
            made = true;
        }
        kiln_status s = kiln_flex_new("score + c0[h] * (kv_idx - (q_idx + kv_len - q_len))", NULL, &slopes, 1, out);
        if (made) kiln_tensor_free(slopes);
        return s;
    }
    return kiln_error(KILN_ERR_ARG, "flex preset '%s%s%s': not one of causal, window:W, prefix:P, doc, alibi, "
                      "softcap:C (W and P whole numbers >= 1 and >= 0, C > 0)", name, arg ? ":" : "", arg ? arg : "");
}

kiln_status kiln_flex_preset(const char *spec, const kiln_flex_inputs *in, kiln_flex_t **out)
{
    if (!spec || !out) return kiln_error(KILN_ERR_ARG, "flex_preset: NULL spec or out");
    *out = NULL;
    kiln_flex_t *acc = NULL;
    kiln_status s = KILN_OK;
    for (const char *p = spec; s == KILN_OK;) {
        size_t n = strcspn(p, "+");
        char part[128];
        if (n == 0 || n >= sizeof part) {
            s = kiln_error(KILN_ERR_ARG, "flex preset \"%s\": an empty or too long part", spec);
            break;
        }
        snprintf(part, sizeof part, "%.*s", (int)n, p);
        char *colon = strchr(part, ':');
        if (colon) *colon = 0;
        kiln_flex_t *one = NULL, *both = NULL;
        s = preset(part, colon ? colon + 1 : NULL, in, &one);
        if (s == KILN_OK && acc) {
            s = kiln_flex_and(acc, one, &both);
            kiln_flex_free(acc);
            kiln_flex_free(one);
            acc = both;
        } else if (s == KILN_OK) {
            acc = one;
        }
        if (!p[n]) break;
        p += n + 1;
    }
    if (s != KILN_OK) {
        kiln_flex_free(acc);
        return s;
    }
    *out = acc;
    return KILN_OK;
}

/* ---- evaluation with kiln's ops, over broadcast index tensors ---- */

typedef enum { T_BOOL, T_INT, T_FLOAT } vtype; /* as kiln__flex_elem_type numbers them */
typedef struct {
    kiln_tensor_t *t;
    vtype type;
} val;

typedef struct {
    const kiln_flex_t *f;
    const parser *ps;
    kiln_tensor_t *score, *idx[N_VARS]; /* idx[V_B..V_KVLEN] */
    kiln_dtype F;                        /* the scores' float type */
} env;

static val as(val x, vtype t, kiln_dtype F)
{
    if (!x.t || x.type == t) return x;
    return (val){kiln_cast(x.t, t == T_FLOAT ? F : t == T_INT ? KILN_DTYPE_I64 : KILN_DTYPE_BOOL), t};
}

static val truth(val x, kiln_dtype F) /* a value as a bool: != 0 */
{
    if (!x.t || x.type == T_BOOL) return x;
    return (val){kiln_ne(x.t, kiln_scalar(0, kiln_tensor_dtype(x.t))), T_BOOL};
}

static val eval(const env *e, int i)
{
    const anode *a = &e->ps->n[i];
    val x[4] = {{0}};
    for (int j = 0; j < a->n_arg && a->kind != A_CAP; j++)
        if (!(x[j] = eval(e, a->arg[j])).t) return (val){0};
    switch (a->kind) {
    case A_NUM:
        return a->integer ? (val){kiln_scalar(a->num, KILN_DTYPE_I64), T_INT} : (val){kiln_scalar(a->num, e->F), T_FLOAT};
    case A_NAME:
        return a->op == V_SCORE ? (val){e->score, T_FLOAT} : (val){e->idx[a->op], T_INT};
    case A_NEG:
        if (x[0].type == T_BOOL) x[0] = as(x[0], T_INT, e->F);
        return (val){kiln_neg(x[0].t), x[0].type};
    case A_NOT:
        return (val){kiln_eq(as(truth(x[0], e->F), T_INT, e->F).t, kiln_scalar(0, KILN_DTYPE_I64)), T_BOOL};
    case A_TERN: {
        vtype t = x[1].type > x[2].type ? x[1].type : x[2].type;
        val c = truth(x[0], e->F), l = as(x[1], t, e->F), r = as(x[2], t, e->F);
        return l.t && r.t ? (val){kiln_where(c.t, l.t, r.t), t} : (val){0};
    }
    case A_CALL: {
        if (a->op == F_MIN || a->op == F_MAX) {
            vtype t = x[0].type > x[1].type ? x[0].type : x[1].type;
            if (t == T_BOOL) t = T_INT;
            val l = as(x[0], t, e->F), r = as(x[1], t, e->F);
            return (val){a->op == F_MIN ? kiln_minimum(l.t, r.t) : kiln_maximum(l.t, r.t), t};
        }
        if (a->op == F_ABS && x[0].type == T_INT) return (val){kiln_abs(x[0].t), T_INT};
        kiln_tensor_t *y = as(x[0], T_FLOAT, e->F).t;
        kiln_tensor_t *(*f1[])(kiln_tensor_t *) = {kiln_tanh, kiln_exp, kiln_log, kiln_abs, kiln_sqrt};
        return (val){y ? f1[a->op](y) : NULL, T_FLOAT};
    }
    case A_CAP: { /* c[i0, i1, ...]: the flat tensor's element at the row-major index */
        kiln_tensor_t *c = e->f->cap[a->op];
        char q[96];
        int nd = kiln_tensor_ndim(c);
        if (nd != a->n_arg) {
            kiln_error(KILN_ERR_SHAPE, "flex %s: c%d has %d dims, read at %d indices, in \"%s\"", e->ps->what,
                       a->op, nd, a->n_arg, QUOTED(e->ps, q));
            return (val){0};
        }
        kiln_tensor_t *lin = NULL;
        for (int d = 0; d < nd; d++) {
            val ix = eval(e, a->arg[d]);
            if (!ix.t) return (val){0};
            if (ix.type == T_FLOAT) {
                kiln_error(KILN_ERR_ARG, "flex %s: an index of c%d is a float, in \"%s\"", e->ps->what, a->op,
                           QUOTED(e->ps, q));
                return (val){0};
            }
            ix = as(ix, T_INT, e->F);
            lin = lin ? kiln_add(kiln_mul(lin, kiln_scalar((double)kiln_tensor_shape(c)[d], KILN_DTYPE_I64)), ix.t) : ix.t;
        }
        int64_t numel = kiln_tensor_numel(c);
        kiln_tensor_t *flat = kiln_reshape(c, &numel, 1);
        if (!lin || !flat) return (val){0};
        const int64_t *ls = kiln_tensor_shape(lin);
        int lnd = kiln_tensor_ndim(lin);
        int64_t ln = kiln_tensor_numel(lin);
        kiln_tensor_t *picked = kiln_index_select(flat, 0, kiln_reshape(kiln_contiguous(lin), &ln, 1));
        kiln_tensor_t *y = picked ? kiln_reshape(picked, ls, lnd) : NULL;
        kiln_dtype dt = kiln_tensor_dtype(c);
        vtype t = (vtype)kiln__flex_elem_type(dt);
        if (y && t == T_FLOAT && dt != e->F) y = kiln_cast(y, e->F);
        if (y && t == T_INT && dt != KILN_DTYPE_I64) y = kiln_cast(y, KILN_DTYPE_I64);
        return (val){y, t};
    }
    case A_BIN:
        break;
    }
    binop op = (binop)a->op;
    if (op == B_AND || op == B_OR) {
        kiln_tensor_t *l = as(truth(x[0], e->F), T_INT, e->F).t, *r = as(truth(x[1], e->F), T_INT, e->F).t;
        kiln_tensor_t *v = op == B_AND ? kiln_mul(l, r) : kiln_add(l, r);
        return (val){kiln_gt(v, kiln_scalar(0, KILN_DTYPE_I64)), T_BOOL};
    }
    vtype t = x[0].type > x[1].type ? x[0].type : x[1].type;
    if (t == T_BOOL || op == B_DIV) t = op == B_DIV ? T_FLOAT : T_INT;
    kiln_tensor_t *l = as(x[0], t, e->F).t, *r = as(x[1], t, e->F).t;
    if (!l || !r) return (val){0};
    switch (op) {
    case B_ADD: return (val){kiln_add(l, r), t};
    case B_SUB: return (val){kiln_sub(l, r), t};
    case B_MUL: return (val){kiln_mul(l, r), t};
    case B_DIV: return (val){kiln_div(l, r), t};
    case B_LT: return (val){kiln_lt(l, r), T_BOOL};
    case B_LE: return (val){kiln_le(l, r), T_BOOL};
    case B_GT: return (val){kiln_gt(l, r), T_BOOL};
    case B_GE: return (val){kiln_ge(l, r), T_BOOL};
    case B_EQ: return (val){kiln_eq(l, r), T_BOOL};
    case B_NE: return (val){kiln_ne(l, r), T_BOOL};
    default: return (val){0};
    }
}

/* The index tensors for sizes B, H, Tq, Tk: b (B,1,1,1), h (1,H,1,1), q_idx (1,1,Tq,1),
 * kv_idx (1,1,1,Tk), q_len and kv_len scalars. */
static void indices(env *e, int64_t B, int64_t H, int64_t Tq, int64_t Tk)
{
    int64_t n[4] = {B, H, Tq, Tk};
    for (int d = 0; d < 4; d++) {
        int64_t shape[4] = {1, 1, 1, 1};
        shape[d] = n[d];
        kiln_tensor_t *r = kiln_arange(0, (double)n[d], 1, KILN_DTYPE_I64);
        e->idx[V_B + d] = r ? kiln_reshape(r, shape, 4) : NULL;
    }
    e->idx[V_QLEN] = kiln_scalar((double)Tq, KILN_DTYPE_I64);
    e->idx[V_KVLEN] = kiln_scalar((double)Tk, KILN_DTYPE_I64);
}

/* f's mask for these sizes, a bool tensor broadcastable to (B, H, Tq, Tk), or NULL with
 * the error set (*none: f has no mask). */
static kiln_tensor_t *mask_of(const kiln_flex_t *f, env *e, bool *none)
{
    *none = !f->ps[1];
    if (*none) return NULL;
    e->ps = f->ps[1];
    val m = eval(e, f->ps[1]->root);
    return m.t ? truth(m, e->F).t : NULL;
}

/* ---- the block mask ---- */

void kiln_block_mask_free(kiln_block_mask_t *m)
{
    if (!m) return;
    free(m->n_full);
    free(m->n_partial);
    free(m->start);
    free(m->kv);
    free(m);
}

/* m's blocks' counts of pairs let through, from the dense mask evaluated with kiln's
 * ops on the mask's device (a (B, H, Tq, Tk) byte mask on the host meanwhile). */
static kiln_status dense_counts(const kiln_flex_t *f, const kiln_block_mask_t *m, int64_t *on)
{
    int64_t Tq = m->Tq, Tk = m->Tk;
    uint8_t *dense = malloc((size_t)(m->B * m->H * Tq * Tk));
    if (!dense)
        return kiln_error(KILN_ERR_OOM, "block_mask_new: out of memory for the dense mask %lld x %lld x %lld x %lld",
                          (long long)m->B, (long long)m->H, (long long)Tq, (long long)Tk);
    kiln_scope_begin();
    bool was = kiln_set_grad_enabled(false);
    env e = {.f = f, .F = KILN_DTYPE_F32};
    indices(&e, m->B, m->H, Tq, Tk);
    bool none;
    kiln_tensor_t *mk = mask_of(f, &e, &none);
    int64_t shape[4] = {m->B, m->H, Tq, Tk};
    if (none) mk = kiln_full(shape, 4, 1, KILN_DTYPE_U8);
    else if (mk) mk = kiln_contiguous(kiln_expand(kiln_cast(mk, KILN_DTYPE_U8), shape, 4));
    kiln_status s = mk ? kiln_tensor_to_host(mk, dense, (size_t)(m->B * m->H * Tq * Tk)) : kiln_last_status();
    kiln_set_grad_enabled(was);
    kiln_scope_end();
    for (int64_t r = 0; s == KILN_OK && r < m->B * m->H * m->nq; r++) {
        int64_t bh = r / m->nq, qb = r % m->nq, q0 = qb * m->block, q1 = q0 + m->block < Tq ? q0 + m->block : Tq;
        const uint8_t *plane = dense + bh * Tq * Tk;
        for (int64_t kb = 0; kb < m->nk; kb++) {
            int64_t k0 = kb * m->kv_block, k1 = k0 + m->kv_block < Tk ? k0 + m->kv_block : Tk, n = 0;
            for (int64_t qi = q0; qi < q1; qi++)
                for (int64_t ki = k0; ki < k1; ki++) n += plane[qi * Tk + ki] != 0;
            on[r * m->nk + kb] = n;
        }
    }
    free(dense);
    return s;
}

kiln_status kiln_block_mask_new(const kiln_flex_t *f, int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t block,
                                int64_t kv_block, kiln_block_mask_t **out)
{
    if (!f || !out) return kiln_error(KILN_ERR_ARG, "block_mask_new: NULL flex or out");
    *out = NULL;
    if (kv_block == 0) kv_block = block;
    if (B < 1 || H < 1 || Tq < 1 || Tk < 1 || block < 1 || kv_block < 1)
        return kiln_error(KILN_ERR_ARG, "block_mask_new: sizes B %lld, H %lld, Tq %lld, Tk %lld, block %lld, kv_block "
                          "%lld must be >= 1", (long long)B, (long long)H, (long long)Tq, (long long)Tk, (long long)block,
                          (long long)kv_block);
    kiln_block_mask_t *m = calloc(1, sizeof *m);
    if (!m) return kiln_error(KILN_ERR_OOM, "block_mask_new: out of memory");
    m->B = f->vars[1][V_B] ? B : 1;
    m->H = f->vars[1][V_H] ? H : 1;
    m->Tq = Tq, m->Tk = Tk, m->block = block, m->kv_block = kv_block;
    m->nq = (Tq + block - 1) / block, m->nk = (Tk + kv_block - 1) / kv_block;
    int64_t rows = m->B * m->H * m->nq;
    m->n_full = calloc((size_t)rows, sizeof *m->n_full);
    m->n_partial = calloc((size_t)rows, sizeof *m->n_partial);
    m->start = calloc((size_t)rows + 1, sizeof *m->start);
    m->kv = malloc(sizeof *m->kv * (size_t)(rows * m->nk + 1));
    /* each block's count of pairs let through: from the generated classifier (O(blocks)
     * memory), else from the dense mask evaluated with kiln's ops */
    int64_t *on = malloc(sizeof *on * (size_t)(rows * m->nk + 1));
    kiln_status s = m->n_full && m->n_partial && m->start && m->kv && on
                        ? KILN_OK
                        : kiln_error(KILN_ERR_OOM, "block_mask_new: out of memory for %lld x %lld x %lld blocks",
                                     (long long)rows, (long long)m->nk, (long long)m->nk);
    bool ran = false;
    if (s == KILN_OK) s = kiln__flex_classify(f, m->B, m->H, Tq, Tk, block, kv_block, on, &ran);
    if (s == KILN_OK && !ran) s = dense_counts(f, m, on);
    for (int64_t r = 0; s == KILN_OK && r < rows; r++) {
        int64_t qb = r % m->nq, q0 = qb * block, q1 = q0 + block < Tq ? q0 + block : Tq;
        m->start[r] = r ? m->start[r - 1] + m->n_full[r - 1] + m->n_partial[r - 1] : 0;
        int64_t *kv = m->kv + m->start[r], nf = 0, np = 0, partial[4096], *pp = NULL;
        /* full ones first, then partial: partial ones kept aside, in a buffer when few */
        if (m->nk > 4096 && !(pp = malloc(sizeof *pp * (size_t)m->nk))) {
            s = kiln_error(KILN_ERR_OOM, "block_mask_new: out of memory");
            break;
        }
        int64_t *part = pp ? pp : partial;
        for (int64_t kb = 0; kb < m->nk; kb++) {
            int64_t k0 = kb * kv_block, k1 = k0 + kv_block < Tk ? k0 + kv_block : Tk, n = on[r * m->nk + kb];
            m->seen += n;
            if (n == 0) m->empty++;
            else if (n == (q1 - q0) * (k1 - k0)) kv[nf++] = kb, m->full++;
            else part[np++] = kb, m->partial++;
        }
        memcpy(kv + nf, part, sizeof *kv * (size_t)np);
        free(pp);
        m->n_full[r] = (int32_t)nf;
        m->n_partial[r] = (int32_t)np;
    }
    free(on);
    if (s != KILN_OK) {
        kiln_block_mask_free(m);
        return s;
    }
    *out = m;
    return KILN_OK;
}

void kiln_block_mask_stats(const kiln_block_mask_t *m, int64_t *full, int64_t *partial, int64_t *empty, double *density)
{
    if (full) *full = m ? m->full : 0;
    if (partial) *partial = m ? m->partial : 0;
    if (empty) *empty = m ? m->empty : 0;
    if (density) *density = m ? (double)m->seen / (double)(m->B * m->H * m->Tq * m->Tk) : 0;
}

bool kiln_block_mask_row(const kiln_block_mask_t *m, int64_t b, int64_t h, int64_t qb, int64_t *kv, int64_t cap,
                         int64_t *n_full, int64_t *n_partial)
{
    if (!m || b < 0 || h < 0 || qb < 0 || qb >= m->nq) return false;
    int64_t r = ((m->B == 1 ? 0 : b) * m->H + (m->H == 1 ? 0 : h)) * m->nq + qb;
    if ((m->B > 1 && b >= m->B) || (m->H > 1 && h >= m->H)) return false;
    int64_t n = m->n_full[r] + m->n_partial[r];
    if (n > cap) return false;
    memcpy(kv, m->kv + m->start[r], sizeof *kv * (size_t)n);
    *n_full = m->n_full[r];
    *n_partial = m->n_partial[r];
    return true;
}

/* ---- the block mask as a tensor ----
 * i64 (mB, mH, nq, KILN__MASK_HEAD + nk): row ((b mH + h) nq + qb) holds its count of
 * full key blocks, of partial ones, the block and kv_block sizes, then its key blocks
 * (full ones first; the rest of the row unused). Its shape depends on the mask's sizes
 * only, so masks of one size but other blocks are the same shape of data. */

kiln_status kiln__block_mask_pack(const kiln_block_mask_t *m, int64_t *w)
{
    int64_t W = KILN__MASK_HEAD + m->nk, rows = m->B * m->H * m->nq;
    for (int64_t r = 0; r < rows; r++) {
        int64_t *row = w + r * W, n = m->n_full[r] + m->n_partial[r];
        row[0] = m->n_full[r], row[1] = m->n_partial[r], row[2] = m->block, row[3] = m->kv_block;
        memcpy(row + KILN__MASK_HEAD, m->kv + m->start[r], sizeof *row * (size_t)n);
        for (int64_t j = KILN__MASK_HEAD + n; j < W; j++) row[j] = -1;
    }
    return KILN_OK;
}

kiln_status kiln__block_mask_unpack(const int64_t *w, const int64_t *shape, int64_t B, int64_t H, int64_t Tq,
                                    int64_t Tk, kiln_block_mask_t **out)
{
    *out = NULL;
    int64_t mB = shape[0], mH = shape[1], nq = shape[2], nk = shape[3] - KILN__MASK_HEAD, rows = mB * mH * nq;
    int64_t block = rows ? w[2] : 0, kv_block = rows ? w[3] : 0;
#define BAD(...) kiln_error(KILN_ERR_ARG, "flex_attention: the block mask tensor " __VA_ARGS__)
    if ((mB != 1 && mB != B) || (mH != 1 && mH != H) || nk < 1 || block < 1 || kv_block < 1 ||
        nq != (Tq + block - 1) / block || nk != (Tk + kv_block - 1) / kv_block)
        return BAD("(%lld, %lld, %lld, %lld) with blocks of %lld x %lld is not a mask for B %lld, H %lld, Tq %lld, Tk "
                   "%lld (make it with kiln_flex_block_mask or kiln_block_mask_tensor for these sizes)",
                   (long long)mB, (long long)mH, (long long)nq, (long long)shape[3], (long long)block,
                   (long long)kv_block, (long long)B, (long long)H, (long long)Tq, (long long)Tk);
    kiln_block_mask_t *m = calloc(1, sizeof *m);
    if (!m) return kiln_error(KILN_ERR_OOM, "flex_attention: out of memory");
    *m = (kiln_block_mask_t){.B = mB, .H = mH, .Tq = Tq, .Tk = Tk, .block = block, .kv_block = kv_block, .nq = nq,
                             .nk = nk};
    m->n_full = malloc(sizeof *m->n_full * (size_t)rows);
    m->n_partial = malloc(sizeof *m->n_partial * (size_t)rows);
    m->start = malloc(sizeof *m->start * (size_t)(rows + 1));
    m->kv = malloc(sizeof *m->kv * (size_t)(rows * nk + 1));
    uint8_t *seen = calloc((size_t)nk, 1); /* a row's key blocks, each at most once */
    kiln_status s = m->n_full && m->n_partial && m->start && m->kv && seen
                        ? KILN_OK
                        : kiln_error(KILN_ERR_OOM, "flex_attention: out of memory");
    int64_t at = 0;
    for (int64_t r = 0; s == KILN_OK && r < rows; r++) {
        const int64_t *row = w + r * (KILN__MASK_HEAD + nk);
        if (row[0] < 0 || row[1] < 0 || row[0] + row[1] > nk || row[2] != block || row[3] != kv_block) {
            s = BAD("row %lld holds %lld full and %lld partial blocks of %lld x %lld; want at most %lld in all, of "
                    "%lld x %lld", (long long)r, (long long)row[0], (long long)row[1], (long long)row[2],
                    (long long)row[3], (long long)nk, (long long)block, (long long)kv_block);
            break;
        }
        m->n_full[r] = (int32_t)row[0], m->n_partial[r] = (int32_t)row[1], m->start[r] = at;
        for (int64_t j = 0; s == KILN_OK && j < row[0] + row[1]; j++) {
            int64_t kb = row[KILN__MASK_HEAD + j];
            if (kb < 0 || kb >= nk) s = BAD("row %lld lists key block %lld of %lld", (long long)r, (long long)kb,
                                            (long long)nk);
            else if (seen[kb]++) s = BAD("row %lld lists key block %lld twice", (long long)r, (long long)kb);
            m->kv[at++] = kb;
        }
        for (int64_t j = 0; j < row[0] + row[1] && j < nk; j++) { /* cleared for the next row */
            int64_t kb = row[KILN__MASK_HEAD + j];
            if (kb >= 0 && kb < nk) seen[kb] = 0;
        }
        m->full += row[0], m->partial += row[1];
    }
#undef BAD
    free(seen);
    if (m->start) m->start[rows] = at;
    m->empty = rows * nk - m->full - m->partial;
    if (s != KILN_OK) {
        kiln_block_mask_free(m);
        return s;
    }
    *out = m;
    return KILN_OK;
}

kiln_tensor_t *kiln_block_mask_tensor(const kiln_block_mask_t *m)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "block_mask_tensor: NULL mask"), NULL;
    int64_t shape[4] = {m->B, m->H, m->nq, KILN__MASK_HEAD + m->nk}, n = shape[0] * shape[1] * shape[2] * shape[3];
    int64_t *w = malloc(sizeof *w * (size_t)n);
    if (!w) return kiln_error(KILN_ERR_OOM, "block_mask_tensor: out of memory"), NULL;
    kiln__block_mask_pack(m, w);
    kiln_tensor_t *t = kiln_from_data(w, shape, 4, KILN_DTYPE_I64);
    free(w);
    return t;
}

/* ---- the attention, densely ---- */

kiln_tensor_t *kiln_flex_attention(kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v, const kiln_flex_t *f,
                                   const kiln_block_mask_t *bm, double scale, kiln_tensor_t **lse)
{
    if (lse) *lse = NULL;
    if (bm && q && k && kiln_tensor_ndim(q) == 4 && kiln_tensor_ndim(k) == 4) {
        const int64_t *qs = kiln_tensor_shape(q), Tk = kiln_tensor_shape(k)[2];
        if (bm->Tq != qs[2] || bm->Tk != Tk || (bm->B != 1 && bm->B != qs[0]) || (bm->H != 1 && bm->H != qs[1])) {
            kiln_error(KILN_ERR_SHAPE, "flex_attention: the block mask is for B %lld, H %lld, Tq %lld, Tk %lld; the "
                       "call's are %lld, %lld, %lld, %lld", (long long)bm->B, (long long)bm->H, (long long)bm->Tq,
                       (long long)bm->Tk, (long long)qs[0], (long long)qs[1], (long long)qs[2], (long long)Tk);
            return NULL;
        }
    }
    kiln_tensor_t *mask = NULL;
    if (bm && kiln__opt(KILN__OPT_FLEX_FUSED) && !(mask = kiln_block_mask_tensor(bm))) return NULL;
    return kiln_flex_attention_masked(q, k, v, f, mask, scale, lse);
}

kiln_tensor_t *kiln_flex_attention_masked(kiln_tensor_t *q, kiln_tensor_t *k, kiln_tensor_t *v, const kiln_flex_t *f,
                                          kiln_tensor_t *mask, double scale, kiln_tensor_t **lse)
{
    if (lse) *lse = NULL;
    if (!q || !k || !v || !f) {
        if (!kiln_last_status()) kiln_error(KILN_ERR_ARG, "flex_attention: NULL q, k, v or modifiers");
        return NULL;
    }
    kiln_dtype F = kiln_tensor_dtype(q);
    const int64_t *qs = kiln_tensor_shape(q), *ks = kiln_tensor_shape(k), *vs = kiln_tensor_shape(v);
    if (kiln_tensor_ndim(q) != 4 || kiln_tensor_ndim(k) != 4 || kiln_tensor_ndim(v) != 4 || ks[0] != qs[0] ||
        vs[0] != qs[0] || ks[1] != vs[1] || ks[2] != vs[2] || ks[3] != qs[3] || vs[3] != qs[3] || ks[1] < 1 ||
        qs[1] % ks[1]) {
        kiln_error(KILN_ERR_SHAPE, "flex_attention: q %s, k %s, v %s: want q (B, H, Tq, D), k and v (B, Hkv, Tk, D) "
                   "with H a multiple of Hkv", kiln__shape_text(q), kiln__shape_text(k), kiln__shape_text(v));
        return NULL;
    }
    kiln_dtype Fk = kiln_tensor_dtype(k), Fv = kiln_tensor_dtype(v);
    bool half = kiln__is_half(F) || kiln__is_half(Fk) || kiln__is_half(Fv);
    if (half ? !kiln_dtype_is_f32_or_half(F) || !kiln_dtype_is_f32_or_half(Fk) || !kiln_dtype_is_f32_or_half(Fv)
             : (F != KILN_DTYPE_F32 && F != KILN_DTYPE_F64) || Fk != F || Fv != F) {
        kiln_error(KILN_ERR_DTYPE, "flex_attention: q, k and v are %s, %s, %s; f32 or f64 all alike, or bf16, f16 "
                   "and f32", kiln_dtype_name(F), kiln_dtype_name(Fk), kiln_dtype_name(Fv));
        return NULL;
    }
    if (half) {
        /* bf16 or f16 (mixed precision: the linear layers' outputs, a 16-bit q over an
         * f32 cache): the f32 kernels on widened copies, softmax and sums in f32, the
         * output rounded once to q's type and the log-sum-exp left f32. The casts are
         * ops, so autograd brings the gradients back in each input's type and a captured
         * function records them; the backward keeps the widened copies (twice the 16-bit
         * bytes, O(T) as before). Autocast is paused meanwhile: the dense path's matmuls
         * would cast the copies back to 16 bits. */
        bool was = kiln__autocast_pause();
        kiln_tensor_t *y = kiln_flex_attention_masked(kiln_cast(q, KILN_DTYPE_F32), kiln_cast(k, KILN_DTYPE_F32),
                                                      kiln_cast(v, KILN_DTYPE_F32), f, mask, scale, lse);
        kiln__autocast_resume(was);
        if (y && F != KILN_DTYPE_F32) y = kiln_cast(y, F);
        if (!y && lse) *lse = NULL;
        return y;
    }
    int64_t B = qs[0], H = qs[1], Tq = qs[2], D = qs[3], Hkv = ks[1], Tk = ks[2], G = H / Hkv;
    if (mask) { /* its sizes; its blocks are data, checked where they are read */
        const int64_t *ms = kiln_tensor_shape(mask);
        if (kiln_tensor_dtype(mask) != KILN_DTYPE_I64 || kiln_tensor_ndim(mask) != 4 || (ms[0] != 1 && ms[0] != B) ||
            (ms[1] != 1 && ms[1] != H) || ms[2] < 1 || ms[3] <= KILN__MASK_HEAD) {
            kiln_error(KILN_ERR_SHAPE, "flex_attention: the block mask tensor %s for q %s: want i64 (1 or B, 1 or H, "
                       "query blocks, %d + key blocks), from kiln_flex_block_mask or kiln_block_mask_tensor",
                       kiln__shape_text(mask), kiln__shape_text(q), KILN__MASK_HEAD);
            return NULL;
        }
    }
    if (scale <= 0) scale = 1.0 / sqrt((double)D);
    /* the fused kernels, where they run (flex_gen.c) */
    if (kiln__opt(KILN__OPT_FLEX_FUSED)) {
        kiln_tensor_t *y = NULL, *l = NULL;
        bool ran;
        if (kiln__flex_fused(f, mask, q, k, v, scale, &y, &l, &ran) != KILN_OK) return NULL;
        if (ran) {
            if (lse) *lse = l;
            return y;
        }
    }
    /* keys and values of each query head's group: (B, Hkv, Tk, D) -> (B, H, Tk, D) */
    kiln_tensor_t *kk = k, *vv = v;
    if (G > 1) {
        int64_t e5[5] = {B, Hkv, G, Tk, D}, s4[4] = {B, H, Tk, D};
        kk = kiln_reshape(kiln_contiguous(kiln_expand(kiln_unsqueeze(k, 2), e5, 5)), s4, 4);
        vv = kiln_reshape(kiln_contiguous(kiln_expand(kiln_unsqueeze(v, 2), e5, 5)), s4, 4);
    }
    kiln_tensor_t *s = kiln_mul_scalar(kiln_matmul(q, kiln_transpose(kk, 2, 3)), scale);
    if (!s) return NULL;
    env e = {.f = f, .F = F, .score = s};
    indices(&e, B, H, Tq, Tk);
    if (f->ps[0]) {
        e.ps = f->ps[0];
        val m = eval(&e, f->ps[0]->root);
        if (!m.t) return NULL;
        s = m.type == T_FLOAT ? m.t : kiln_cast(m.t, F);
        /* a score_mod that reads no score (or not every index) has fewer dims: widened */
        int64_t full[4] = {B, H, Tq, Tk}, padded[4] = {1, 1, 1, 1};
        int nd = s ? kiln_tensor_ndim(s) : 0;
        for (int d = 0; d < nd; d++) padded[4 - nd + d] = kiln_tensor_shape(s)[d];
        if (s && (nd != 4 || memcmp(padded, full, sizeof full)))
            s = kiln_contiguous(kiln_expand(kiln_reshape(s, padded, 4), full, 4));
    }
    bool none;
    kiln_tensor_t *dense_mask = mask_of(f, &e, &none);
    if (!s || (!none && !dense_mask)) return NULL;
    int last = 3;
    /* A row that sees no key (masked, or every score -inf from the score modifier): its
     * scores made 0 (no -inf - -inf), its weights 0 and its log-sum-exp -inf, as
     * PyTorch's flex_attention gives and the fused kernels do. A NaN score is seen (it is
     * not -inf): its row comes out NaN, as a softmax of it does. */
    kiln_tensor_t *ninf = kiln_scalar(-INFINITY, F), *zero = kiln_scalar(0, F);
    kiln_tensor_t *masked = none ? s : kiln_where(dense_mask, s, ninf);
    kiln_tensor_t *sees = kiln_gt(kiln_max(kiln_cast(kiln_ne(masked, ninf), KILN_DTYPE_I64), &last, 1, true),
                                  kiln_scalar(0, KILN_DTYPE_I64));
    kiln_tensor_t *safe = kiln_where(sees, masked, zero);
    kiln_tensor_t *p = kiln_mul(kiln_softmax(safe, 3), kiln_cast(sees, F));
    kiln_tensor_t *l = kiln_where(sees, kiln_logsumexp(safe, &last, 1, true), ninf);
    kiln_tensor_t *y = kiln_matmul(p, vv);
    if (lse && y && l) *lse = kiln_reshape(l, (int64_t[]){B, H, Tq}, 3);
    return y;
}
