/* Strict numbers from text (parse.h): the syntax checked by hand, so that what strtoll
 * and strtod would also take (leading space, '+', hex, inf, nan, a prefix of the text)
 * is refused the same way everywhere. */
#include "core/parse.h"
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool digit(char c) { return c >= '0' && c <= '9'; }

size_t kiln__number_len(const char *s, bool *integer)
{
    size_t n = 0, mant = 0;
    bool whole = true;
    while (digit(s[n])) n++, mant++;
    if (s[n] == '.') {
        whole = false;
        n++;
        while (digit(s[n])) n++, mant++;
    }
    if (!mant) return 0;
    if (s[n] == 'e' || s[n] == 'E') {
        size_t e = n + 1;
        if (s[e] == '+' || s[e] == '-') e++;
        if (digit(s[e])) {
            while (digit(s[e])) e++;
            n = e;
            whole = false;
        }
    }
    if (integer) *integer = whole;
    return n;
}

const char *kiln__excerpt(const char *s, size_t at, size_t max, char *buf, size_t cap)
{
    size_t len = strlen(s);
    if (len <= max) {
        snprintf(buf, cap, "%s", s);
        return buf;
    }
    size_t b = at > len ? len : at;
    b = b > max / 2 ? b - max / 2 : 0;
    size_t e = b + max < len ? b + max : len;
    if (e == len && len > max) b = len - max;
    while (b > 0 && ((unsigned char)s[b] & 0xC0) == 0x80) b--; /* not inside a character */
    while (e < len && ((unsigned char)s[e] & 0xC0) == 0x80) e++;
    snprintf(buf, cap, "%s%.*s%s", b ? "…" : "", (int)(e - b), s + b, e < len ? "…" : "");
    return buf;
}

static kiln_status refuse(const char *what, const char *range, const char *s)
{
    char q[64];
    return kiln_error(KILN_ERR_ARG, "%s must be %s, got '%s'", what, range, s ? kiln__excerpt(s, 0, 40, q, sizeof q) : "");
}

bool kiln__scan_i64(const char *s, int64_t *out)
{
    const char *p = s;
    bool neg = p && *p == '-';
    if (!p || !digit(p[neg])) return false;
    p += neg;
    uint64_t v = 0, limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; digit(*p); p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (limit - d) / 10) return false; /* outside int64 */
        v = v * 10 + d;
    }
    if (*p) return false;
    *out = neg ? (v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v) : (int64_t)v;
    return true;
}

bool kiln__scan_f64(const char *s, double *out)
{
    const char *p = s ? s + (*s == '-') : NULL;
    size_t n = p ? kiln__number_len(p, NULL) : 0;
    if (!n || p[n]) return false;
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    /* an overflow is refused; an underflow is the tiny value (or 0) it rounds to */
    if (*end || !isfinite(v) || (errno == ERANGE && fabs(v) > 1)) return false;
    *out = v;
    return true;
}

void kiln__describe_i64(int64_t lo, int64_t hi, char *out, size_t n)
{
    if (lo == INT64_MIN && hi == INT64_MAX) snprintf(out, n, "a whole number");
    else if (hi == INT64_MAX) snprintf(out, n, "a whole number >= %lld", (long long)lo);
    else if (lo == INT64_MIN) snprintf(out, n, "a whole number <= %lld", (long long)hi);
    else snprintf(out, n, "a whole number from %lld to %lld", (long long)lo, (long long)hi);
}

kiln_status kiln__parse_i64(const char *s, int64_t lo, int64_t hi, const char *what, int64_t *out)
{
    int64_t x;
    if (kiln__scan_i64(s, &x) && x >= lo && x <= hi) {
        *out = x;
        return KILN_OK;
    }
    char range[96];
    kiln__describe_i64(lo, hi, range, sizeof range);
    return refuse(what, range, s);
}

kiln_status kiln__parse_u64(const char *s, const char *what, uint64_t *out)
{
    uint64_t v = 0;
    const char *p = s;
    bool ok = p && digit(*p);
    for (; ok && digit(*p); p++) {
        unsigned d = (unsigned)(*p - '0');
        ok = v <= (UINT64_MAX - d) / 10;
        v = v * 10 + d;
    }
    if (ok && !*p) {
        *out = v;
        return KILN_OK;
    }
    return refuse(what, "a whole number from 0 to 18446744073709551615", s);
}

/* "a number from 0 to 1", "a number above 0", "a number >= 0 and below 1", ... */
void kiln__describe_f64(double lo, double hi, unsigned flags, char *out, size_t n)
{
    bool above = flags & KILN__PARSE_ABOVE_LO, below = flags & KILN__PARSE_BELOW_HI;
    char l[48] = "", h[48] = "";
    if (lo > -DBL_MAX) snprintf(l, sizeof l, "%s %g", above ? "above" : ">=", lo);
    if (hi < DBL_MAX) snprintf(h, sizeof h, "%s %g", below ? "below" : "at most", hi);
    if (!*l && !*h) snprintf(out, n, "a finite number");
    else if (!above && !below && *l && *h) snprintf(out, n, "a number from %g to %g", lo, hi);
    else snprintf(out, n, "a number %s%s%s", l, *l && *h ? " and " : "", h);
}

kiln_status kiln__parse_f64(const char *s, double lo, double hi, unsigned flags, const char *what, double *out)
{
    double v;
    if (kiln__scan_f64(s, &v) && v >= lo && v <= hi && !((flags & KILN__PARSE_ABOVE_LO) && v == lo) &&
        !((flags & KILN__PARSE_BELOW_HI) && v == hi)) {
        *out = v;
        return KILN_OK;
    }
    char range[128];
    kiln__describe_f64(lo, hi, flags, range, sizeof range);
    return refuse(what, range, s);
}
