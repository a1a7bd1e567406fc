/* Numbers from text, the one way kiln reads them: command-line options, KILN_*
 * variables, attention specs and presets, config fields and checkpoint metadata all
 * come through here, so that a spec that trains also serves, with the same value.
 *
 *     int64_t w;
 *     if (kiln__parse_i64(arg, 1, INT64_MAX, "window:W", &w) != KILN_OK) return kiln_last_status();
 *     // "window:W must be a whole number >= 1, got '1e1'"
 *
 * The whole string is the number, nothing before or after it (no space, no '+'): a whole
 * number is decimal digits after an optional '-'; a real may add a fraction and an
 * exponent (1.5, .5, 2e-3). Hex, inf, nan, a real that overflows a double and a whole
 * number outside int64 are not numbers; the value must lie in [lo, hi] (a real's lo
 * excluded with KILN__PARSE_ABOVE_LO, its hi with KILN__PARSE_BELOW_HI). A failure is KILN_ERR_ARG with the thing named
 * first, then what it must be, then the text as given (shortened past 40 characters). */
#ifndef KILN_CORE_PARSE_H
#define KILN_CORE_PARSE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kiln/tensor.h"

#define KILN__PARSE_ABOVE_LO 1u /* a real must be > lo, not >= lo */
#define KILN__PARSE_BELOW_HI 2u /* a real must be < hi, not <= hi */

/* The syntax and int64 / finite double checks alone, no range and no error set (for
 * readers with their own message, such as the environment table's). */
bool kiln__scan_i64(const char *s, int64_t *out);
bool kiln__scan_f64(const char *s, double *out);

kiln_status kiln__parse_i64(const char *s, int64_t lo, int64_t hi, const char *what, int64_t *out);
kiln_status kiln__parse_f64(const char *s, double lo, double hi, unsigned flags, const char *what, double *out);
/* What a range holds, as the errors say it: "a whole number from 0 to 1024", "a number
 * above 0 and at most 1", ... (for help texts). */
void kiln__describe_i64(int64_t lo, int64_t hi, char *out, size_t n);
void kiln__describe_f64(double lo, double hi, unsigned flags, char *out, size_t n);
/* A whole number from 0 to 2^64 - 1 (an RNG's seed and offset as written). */
kiln_status kiln__parse_u64(const char *s, const char *what, uint64_t *out);

/* The length of the number's syntax at the start of s (0: none): digits, then for a
 * real a '.' and digits and an exponent; no sign. *integer says whether it has only
 * digits. For a scanner of a larger text (flex's expressions) to find a literal's end
 * before kiln__parse_f64 judges it. */
size_t kiln__number_len(const char *s, bool *integer);

/* s, or the part of it around byte `at` (at most about max bytes, cut ends marked with
 * "…", never inside a UTF-8 character), into buf: for messages that quote what they
 * refuse without burying the reason under it. Returns buf. */
const char *kiln__excerpt(const char *s, size_t at, size_t max, char *buf, size_t cap);
#endif
