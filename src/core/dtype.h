/* Element conversion shared by the core and the backends. */
#ifndef KILN_CORE_DTYPE_H
#define KILN_CORE_DTYPE_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include "kiln/tensor.h"

/* A float's bits, and the float of some bits. */
static inline uint32_t kiln__f32_bits(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static inline float kiln__bits_f32(uint32_t b)
{
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline float kiln__f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    return kiln__bits_f32(bits);
}

/* Round to nearest even, as IEEE 754 and PyTorch do. */
static inline uint16_t kiln__f32_to_f16(float f)
{
    uint32_t x = kiln__f32_bits(f), sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t h = sign | ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)h;
}

/* The 16-bit float types, which kernels compute in f32 (widened) and round back. */
static inline bool kiln__is_half(kiln_dtype dt) { return dt == KILN_DTYPE_F16 || dt == KILN_DTYPE_BF16; }
/* f32, bf16 or f16: the types computed in f32 (a 16-bit value is the float it equals),
 * and the storage types of weights, KV caches and mixed precision. */
static inline bool kiln__f32_or_half(kiln_dtype dt) { return dt == KILN_DTYPE_F32 || kiln__is_half(dt); }

static inline float kiln__bf16_to_f32(uint16_t b) { return kiln__bits_f32((uint32_t)b << 16); }

static inline uint16_t kiln__f32_to_bf16(float f)
{
    uint32_t x = kiln__f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

/* v as f32 rounded to odd (truncate, then set the last bit if anything was dropped).
 * Rounding that to f16 or bf16 to nearest even gives the correctly rounded result;
 * a plain (float)v would round twice and can land on a midpoint. */
static inline float kiln__f64_to_f32_odd(double v)
{
    float f = (float)v;
    if (!isfinite(f) || (double)f == v) return f;
    if (fabs((double)f) > fabs(v)) f = nextafterf(f, 0.0f);
    return kiln__bits_f32(kiln__f32_bits(f) | 1);
}

static inline double kiln__load(const void *p, kiln_dtype dt)
{
    switch (dt) {
    case KILN_DTYPE_F32: return *(const float *)p;
    case KILN_DTYPE_F64: return *(const double *)p;
    case KILN_DTYPE_F16: return kiln__f16_to_f32(*(const uint16_t *)p);
    case KILN_DTYPE_BF16: return kiln__bf16_to_f32(*(const uint16_t *)p);
    case KILN_DTYPE_I32: return *(const int32_t *)p;
    case KILN_DTYPE_I64: return (double)*(const int64_t *)p;
    case KILN_DTYPE_U8: return *(const uint8_t *)p;
    case KILN_DTYPE_BOOL: return *(const uint8_t *)p ? 1.0 : 0.0;
    default: return 0.0;
    }
}

static inline void kiln__store(void *p, kiln_dtype dt, double v)
{
    switch (dt) {
    case KILN_DTYPE_F32: *(float *)p = (float)v; break;
    case KILN_DTYPE_F64: *(double *)p = v; break;
    case KILN_DTYPE_F16: *(uint16_t *)p = kiln__f32_to_f16(kiln__f64_to_f32_odd(v)); break;
    case KILN_DTYPE_BF16: *(uint16_t *)p = kiln__f32_to_bf16(kiln__f64_to_f32_odd(v)); break;
    /* Out-of-range and NaN values saturate (NaN to 0): a plain C cast of them is
     * undefined behaviour. */
    case KILN_DTYPE_I32: *(int32_t *)p = v != v ? 0 : v >= 2147483647.0 ? INT32_MAX : v <= -2147483648.0 ? INT32_MIN : (int32_t)v; break;
    case KILN_DTYPE_I64: *(int64_t *)p = v != v ? 0 : v >= 9223372036854775807.0 ? INT64_MAX : v <= -9223372036854775808.0 ? INT64_MIN : (int64_t)v; break;
    case KILN_DTYPE_U8: *(uint8_t *)p = v != v || v <= 0 ? 0 : v >= 255.0 ? 255 : (uint8_t)v; break;
    case KILN_DTYPE_BOOL: *(uint8_t *)p = v != 0.0; break;
    default: break;
    }
}

/* Integer elements read exactly (i64 beyond 2^53 would not survive a double). */
static inline int64_t kiln__load_index(const void *p, kiln_dtype dt)
{
    return dt == KILN_DTYPE_I64 ? *(const int64_t *)p : (int64_t)*(const int32_t *)p;
}

#endif
