#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "core/tensor_impl.h"

static _Thread_local char last_msg[1024] = "no error";
static _Thread_local kiln_status last_status = KILN_OK;

/* A message longer than the buffer keeps its head and its tail with " ... " between:
 * messages name what they are about first and say what is wrong last, so a long path or
 * quoted input must not push the reason out. */
#define HEAD 320

kiln_status kiln_error(kiln_status s, const char *fmt, ...)
{
    static _Thread_local char full[16384];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(full, sizeof full, fmt, ap);
    va_end(ap);
    if (n < 0) snprintf(last_msg, sizeof last_msg, "(an error whose message could not be formatted)");
    else if ((size_t)n < sizeof last_msg) memcpy(last_msg, full, (size_t)n + 1);
    else {
        size_t len = (size_t)n < sizeof full ? (size_t)n : sizeof full - 1, tail = sizeof last_msg - HEAD - 6;
        memcpy(last_msg, full, HEAD);
        memcpy(last_msg + HEAD, " ... ", 5);
        memcpy(last_msg + HEAD + 5, full + len - tail, tail);
        last_msg[sizeof last_msg - 1] = '\0';
    }
    last_status = s;
    return s;
}

kiln_status kiln__null_arg(const char *op)
{
    if (last_status != KILN_OK) return last_status;
    return kiln__err(KILN_ERR_ARG, "%s: a tensor argument is NULL", op);
}

const char *kiln_last_error(void) { return last_msg; }
kiln_status kiln_last_status(void) { return last_status; }

void kiln_clear_error(void)
{
    last_status = KILN_OK;
    snprintf(last_msg, sizeof last_msg, "no error");
}

const char *kiln_status_name(kiln_status s)
{
    switch (s) {
    case KILN_OK: return "ok";
    case KILN_ERR_ARG: return "bad argument";
    case KILN_ERR_SHAPE: return "shape mismatch";
    case KILN_ERR_DTYPE: return "bad dtype";
    case KILN_ERR_INDEX: return "index out of range";
    case KILN_ERR_OOM: return "out of memory";
    case KILN_ERR_IO: return "i/o error";
    case KILN_ERR_FORMAT: return "malformed input";
    case KILN_ERR_UNSUPPORTED: return "unsupported";
    case KILN_ERR_DEVICE: return "device error";
    case KILN_ERR_AUTOGRAD: return "autograd error";
    case KILN_ERR_INTERNAL: return "internal error";
    case KILN_ERR_BUSY: return "busy";
    case KILN_ERR_CANCELLED: return "cancelled";
    case KILN_ERR_DIST: return "distributed";
    case KILN_ERR_COMPILE: return "compile";
    }
    return "unknown status";
}
