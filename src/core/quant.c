/* ggml's tensor types and their block formats, back to f32 (quant.h). The block layouts
 * are ggml's (ggml-common.h); each function computes its values in f32 with the
 * operations, and in the order, of llama.cpp's `gguf` Python package, which is the oracle
 * (tests/gguf/test_gguf_read.py), so the two agree bit for bit. This file is compiled
 * with -ffp-contract=off (CMakeLists.txt): a fused multiply-add would round d * q - m
 * once where the oracle rounds twice. */
#include <math.h>
#include <string.h>
#include "core/dtype.h"
#include "core/quant.h"

#define QK_K 256 /* the K-quants' and IQ4_XS's super-block */

static float f16_at(const uint8_t *p) { return kiln__f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

/* ---- the 32-element formats ---- */

static void deq_q4_0(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[2 + j] & 0x0F) - 8);
        y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

static void deq_q4_1(const uint8_t *b, float *y)
{
    float d = f16_at(b), m = f16_at(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b[4 + j] & 0x0F) + m;
        y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

/* Q5_0 and Q5_1: the fifth bit of value j is bit j of the 32-bit qh. */
static uint32_t qh_at(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

static void deq_q5_0(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    uint32_t qh = qh_at(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0F) | (int)((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (float)(lo - 16);
        y[j + 16] = d * (float)(hi - 16);
    }
}

static void deq_q5_1(const uint8_t *b, float *y)
{
    float d = f16_at(b), m = f16_at(b + 2);
    uint32_t qh = qh_at(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0F) | (int)((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (float)lo + m;
        y[j + 16] = d * (float)hi + m;
    }
}

static void deq_q8_0(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    for (int j = 0; j < 32; j++)
        y[j] = (float)(int8_t)b[2 + j] * d;
}

/* The 16 values IQ4_NL's and IQ4_XS's 4-bit indices stand for. */
static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static void deq_iq4_nl(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)iq4_values[b[2 + j] & 0x0F];
        y[j + 16] = d * (float)iq4_values[b[2 + j] >> 4];
    }
}

/* ---- the 256-element super-blocks ---- */

/* Q2_K: scales[16] (a 4-bit scale and a 4-bit min each), qs[64] (2 bits a value), d,
 * dmin. Each 128 values take 32 bytes of qs, four shifts of them, 32 values a shift. */
static void deq_q2_k(const uint8_t *b, float *y)
{
    const uint8_t *sc = b, *qs = b + 16;
    float d = f16_at(b + 80), dmin = f16_at(b + 82);
    for (int v = 0; v < QK_K; v++) {
        int half = v / 128, shift = (v % 128) / 32 * 2, l = v % 32, s = sc[v / 16];
        float dl = d * (float)(s & 0x0F), ml = dmin * (float)(s >> 4);
        y[v] = dl * (float)((qs[half * 32 + l] >> shift) & 3) - ml;
    }
}

/* Q3_K: hmask[32] (the third bit, inverted: a clear bit subtracts 4), qs[64], scales[12]
 * (sixteen 6-bit scales: the low nibbles in bytes 0-7, the top two bits in 8-11), d. */
static void deq_q3_k(const uint8_t *b, float *y)
{
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    float d = f16_at(b + 108);
    for (int v = 0; v < QK_K; v++) {
        int i = v / 16, group = v / 32, half = v / 128, shift = (v % 128) / 32 * 2, l = v % 32;
        int low = i < 8 ? sc[i] & 0x0F : sc[i - 8] >> 4, high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        float dl = d * (float)((int8_t)(low | high << 4) - 32);
        int q = ((qs[half * 32 + l] >> shift) & 3) - (((hm[l] >> group) & 1) ^ 1) * 4;
        y[v] = dl * (float)q;
    }
}

/* Q4_K's and Q5_K's eight 6-bit scales and mins, packed in 12 bytes. */
static void scale_min_k4(const uint8_t *s, int j, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 0x3F;
        *m = s[j + 4] & 0x3F;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
        *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

/* Q4_K: d, dmin, scales[12], qs[128]: each 64 values take 32 bytes, the low nibbles
 * then the high ones, 32 values to a scale. */
static void deq_q4_k(const uint8_t *b, float *y)
{
    float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(b + 4, j, &sc, &m);
        float dl = d * (float)sc, ml = dmin * (float)m;
        for (int l = 0; l < 32; l++)
            y[j * 32 + l] = dl * (float)((qs[j / 2 * 32 + l] >> (4 * (j % 2))) & 0x0F) - ml;
    }
}

/* Q5_K: Q4_K's layout with qh[32] before qs: the fifth bit of value j*32+l is bit j of qh[l]. */
static void deq_q5_k(const uint8_t *b, float *y)
{
    float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(b + 4, j, &sc, &m);
        float dl = d * (float)sc, ml = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int q = ((qs[j / 2 * 32 + l] >> (4 * (j % 2))) & 0x0F) | ((qh[l] >> j) & 1) << 4;
            y[j * 32 + l] = dl * (float)q - ml;
        }
    }
}

/* Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d. Each 128
 * values take 64 bytes of ql and 32 of qh, in four groups of 32. */
static void deq_q6_k(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16_at(b + 208);
    for (int v = 0; v < QK_K; v++) {
        int half = v / 128, g = (v % 128) / 32, l = v % 32;
        int lo = (ql[half * 64 + (g % 2) * 32 + l] >> (4 * (g / 2))) & 0x0F;
        int hi = (qh[half * 32 + l] >> (2 * g)) & 3;
        y[v] = d * (float)sc[v / 16] * (float)((int8_t)(lo | hi << 4) - 32);
    }
}

/* IQ4_XS: d, scales_h (16 bits: 2 a sub-block), scales_l[4] (4 bits a sub-block),
 * qs[128]: eight sub-blocks of 32 values, 16 bytes each, low nibbles then high. */
static void deq_iq4_xs(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    unsigned sh = (unsigned)b[2] | (unsigned)b[3] << 8;
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0x0F) | (int)((sh >> (2 * ib)) & 3) << 4;
        float dl = d * (float)((int8_t)ls - 32);
        for (int j = 0; j < 16; j++) {
            y[ib * 32 + j] = dl * (float)iq4_values[qs[ib * 16 + j] & 0x0F];
            y[ib * 32 + j + 16] = dl * (float)iq4_values[qs[ib * 16 + j] >> 4];
        }
    }
}

/* ---- quantizing: ggml's reference quantizers ---- */

static void f16_put(uint8_t *p, float v)
{
    uint16_t h = kiln__f32_to_f16(v);
    p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

static float inverse(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

/* The value of largest magnitude (the first of equals), with its sign. */
static float signed_max(const float *x, int n)
{
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++)
        if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
    return max;
}

/* roundf: halves away from zero, as ggml's and numpy's np_roundf */
static void q_q8_0(const float *x, uint8_t *b)
{
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f, id = inverse(d);
    f16_put(b, d);
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* truncf(v) of a value in [0, 255.5) as a byte, clipped to hi */
static uint8_t trunc_clip(float v, int hi)
{
    int q = v > 0.0f ? (int)v : 0;
    return (uint8_t)(q > hi ? hi : q);
}

static void q_q4_0(const float *x, uint8_t *b)
{
    float d = signed_max(x, 32) / -8.0f, id = inverse(d);
    f16_put(b, d);
    for (int j = 0; j < 16; j++)
        b[2 + j] = (uint8_t)(trunc_clip(x[j] * id + 8.5f, 15) | trunc_clip(x[j + 16] * id + 8.5f, 15) << 4);
}

static void min_max(const float *x, int n, float *lo, float *hi)
{
    *lo = *hi = x[0];
    for (int j = 1; j < n; j++) *lo = fminf(*lo, x[j]), *hi = fmaxf(*hi, x[j]);
}

static void q_q4_1(const float *x, uint8_t *b)
{
    float lo, hi;
    min_max(x, 32, &lo, &hi);
    float d = (hi - lo) / 15.0f, id = inverse(d);
    f16_put(b, d);
    f16_put(b + 2, lo);
    for (int j = 0; j < 16; j++)
        b[4 + j] = (uint8_t)(trunc_clip((x[j] - lo) * id + 0.5f, 15) | trunc_clip((x[j + 16] - lo) * id + 0.5f, 15) << 4);
}

/* Q5_0 and Q5_1: the low nibbles in qs, the fifth bits in the 32-bit qh, value j's at bit j. */
static void put5(const uint8_t *q, uint8_t *qh, uint8_t *qs)
{
    uint32_t h = 0;
    for (int j = 0; j < 32; j++) h |= (uint32_t)(q[j] >> 4) << j;
    for (int i = 0; i < 4; i++) qh[i] = (uint8_t)(h >> (8 * i));
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((q[j] & 0x0F) | (q[j + 16] & 0x0F) << 4);
}

static void q_q5_0(const float *x, uint8_t *b)
{
    float d = signed_max(x, 32) / -16.0f, id = inverse(d);
    uint8_t q[32];
    for (int j = 0; j < 32; j++) q[j] = trunc_clip(x[j] * id + 16.5f, 31);
    f16_put(b, d);
    put5(q, b + 2, b + 6);
}

static void q_q5_1(const float *x, uint8_t *b)
{
    float lo, hi;
    min_max(x, 32, &lo, &hi);
    float d = (hi - lo) / 31.0f, id = inverse(d);
    uint8_t q[32];
    for (int j = 0; j < 32; j++) q[j] = trunc_clip((x[j] - lo) * id + 0.5f, 31);
    f16_put(b, d);
    f16_put(b + 2, lo);
    put5(q, b + 4, b + 8);
}

/* ---- the K-quants: ggml's reference quantizers, from their published description ---- */

/* Round to nearest, halves to even (as ggml's nearest_int, valid for |v| < 2^22). */
static int nearest(float v) { return (int)lrintf(v); }

static int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* A block's scale and minimum for n values in 0..nmax with per-value weights w: the
 * plain fit of (min, max), then nstep trials of a slightly stretched scale, each
 * refined by the weighted least-squares scale and offset of its integers, the one of
 * least weighted squared error kept. L gets the integers; *mn the minimum's magnitude. */
static float fit_scale_min(int n, int nmax, const float *x, const float *w, uint8_t *L, float *mn, float rmin,
                           float rdelta, int nstep)
{
    float lo = x[0], hi = x[0], sum_w = w[0], sum_x = w[0] * x[0];
    for (int i = 1; i < n; i++) {
        lo = fminf(lo, x[i]), hi = fmaxf(hi, x[i]);
        sum_w += w[i], sum_x += w[i] * x[i];
    }
    if (lo > 0) lo = 0;
    if (hi == lo) {
        memset(L, 0, (size_t)n);
        *mn = -lo;
        return 0.0f;
    }
    float iscale = (float)nmax / (hi - lo), scale = 1.0f / iscale, best = 0.0f;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)clampi(nearest(iscale * (x[i] - lo)), 0, nmax);
        float diff = scale * L[i] + lo - x[i];
        diff = diff * diff;
        best += w[i] * diff;
    }
    uint8_t aux[32];
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * (float)is + (float)nmax) / (hi - lo);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = clampi(nearest(iscale * (x[i] - lo)), 0, nmax);
            aux[i] = (uint8_t)l;
            sum_l += w[i] * (float)l, sum_l2 += w[i] * (float)l * (float)l, sum_xl += w[i] * (float)l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D, this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) this_min = 0, this_scale = sum_xl / sum_l2;
            float err = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * aux[i] + this_min - x[i];
                diff = diff * diff;
                err += w[i] * diff;
            }
            if (err < best) memcpy(L, aux, (size_t)n), best = err, scale = this_scale, lo = this_min;
        }
    }
    *mn = -lo;
    return scale;
}

/* Q4_K's and Q5_K's scales and mins (6 bits each) into their 12 bytes. */
static void put_scale_min_k4(uint8_t *s, int j, int ls, int lm)
{
    if (j < 4) {
        s[j] = (uint8_t)ls, s[j + 4] = (uint8_t)lm;
    } else {
        s[j + 4] = (uint8_t)((ls & 0x0F) | (lm & 0x0F) << 4);
        s[j - 4] |= (uint8_t)((ls >> 4) << 6);
        s[j] |= (uint8_t)((lm >> 4) << 6);
    }
}

/* Q4_K (nmax 15) and Q5_K (nmax 31): eight sub-blocks of 32, each fitted with weights
 * mean-magnitude + |x|, the scales and mins then quantized to 6 bits against the
 * largest, and the values again against those. L gets the final integers. */
static void k_scales(const float *x, int nmax, float rmin, int nstep, uint8_t *b, uint8_t *L)
{
    float scales[8], mins[8], w[32], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += x[32 * j + l] * x[32 * j + l];
        float av = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av + fabsf(x[32 * j + l]);
        scales[j] = fit_scale_min(32, nmax, x + 32 * j, w, L + 32 * j, &mins[j], rmin, 0.1f, nstep);
        max_scale = fmaxf(max_scale, scales[j]), max_min = fmaxf(max_min, mins[j]);
    }
    float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f, inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    uint8_t *sc = b + 4;
    memset(sc, 0, 12);
    for (int j = 0; j < 8; j++)
        put_scale_min_k4(sc, j, clampi(nearest(inv_scale * scales[j]), 0, 63), clampi(nearest(inv_min * mins[j]), 0, 63));
    f16_put(b, max_scale / 63.0f);
    f16_put(b + 2, max_min / 63.0f);
    float d = f16_at(b), dmin = f16_at(b + 2);
    for (int j = 0; j < 8; j++) {
        int s, m;
        scale_min_k4(sc, j, &s, &m);
        float dl = d * (float)s, ml = dmin * (float)m;
        if (dl == 0.0f) continue;
        for (int l = 0; l < 32; l++) L[32 * j + l] = (uint8_t)clampi(nearest((x[32 * j + l] + ml) / dl), 0, nmax);
    }
}

static void q_q4_k(const float *x, uint8_t *b)
{
    uint8_t L[QK_K] = {0};
    k_scales(x, 15, -1.0f, 20, b, L);
    uint8_t *qs = b + 16;
    for (int j = 0; j < QK_K; j += 64)
        for (int l = 0; l < 32; l++) qs[j / 2 + l] = (uint8_t)(L[j + l] | L[j + l + 32] << 4);
}

static void q_q5_k(const float *x, uint8_t *b)
{
    uint8_t L[QK_K] = {0};
    k_scales(x, 31, -0.5f, 15, b, L);
    uint8_t *qh = b + 16, *qs = b + 48;
    memset(qh, 0, 32);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int lo = L[64 * c + l], hi = L[64 * c + l + 32];
            qh[l] |= (uint8_t)((lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1));
            qs[32 * c + l] = (uint8_t)((lo & 0x0F) | (hi & 0x0F) << 4);
        }
}

/* Q6_K's sub-block scale for 16 values in -32..31: from the value of largest magnitude,
 * then the weighted (x^2) least-squares scale, tried at 18 stretches, the best kept. */
static float fit_scale_sym(const float *x, int8_t *L)
{
    const int n = 16, nmax = 32;
    float amax = 0, max = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax < 1e-15f) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = -(float)nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = clampi(nearest(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * (float)l, suml2 += w * (float)l * (float)l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -((float)nmax + 0.1f * (float)is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = clampi(nearest(iscale * x[i]), -nmax, nmax - 1);
            float w = x[i] * x[i];
            sumlx += w * x[i] * (float)l, suml2 += w * (float)l * (float)l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) L[i] = (int8_t)clampi(nearest(iscale * x[i]), -nmax, nmax - 1);
            scale = sumlx / suml2, best = scale * sumlx;
        }
    }
    return scale;
}

static void q_q6_k(const float *x, uint8_t *b)
{
    float scales[16], max_scale = 0, max_abs = 0;
    int8_t Ls[QK_K];
    uint8_t L[QK_K];
    for (int ib = 0; ib < 16; ib++) {
        scales[ib] = fit_scale_sym(x + 16 * ib, Ls + 16 * ib);
        if (fabsf(scales[ib]) > max_abs) max_abs = fabsf(scales[ib]), max_scale = scales[ib];
    }
    uint8_t *ql = b, *qh = b + 128;
    int8_t *sc = (int8_t *)(b + 192);
    memset(b, 0, 210);
    if (max_abs < 1e-15f) return; /* all zero: zero scales and values */
    float iscale = -128.0f / max_scale;
    f16_put(b + 208, 1.0f / iscale);
    for (int ib = 0; ib < 16; ib++) sc[ib] = (int8_t)(nearest(iscale * scales[ib]) > 127 ? 127 : nearest(iscale * scales[ib]));
    float d = f16_at(b + 208);
    for (int j = 0; j < 16; j++) {
        float dl = d * (float)sc[j];
        for (int i = 0; i < 16; i++)
            L[16 * j + i] = (uint8_t)((dl == 0.0f ? Ls[16 * j + i] : clampi(nearest(x[16 * j + i] / dl), -32, 31)) + 32);
    }
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *q = L + 128 * h;
            ql[64 * h + l] = (uint8_t)((q[l] & 0x0F) | (q[l + 64] & 0x0F) << 4);
            ql[64 * h + l + 32] = (uint8_t)((q[l + 32] & 0x0F) | (q[l + 96] & 0x0F) << 4);
            qh[32 * h + l] = (uint8_t)((q[l] >> 4) | (q[l + 32] >> 4) << 2 | (q[l + 64] >> 4) << 4 | (q[l + 96] >> 4) << 6);
        }
}

static void q_f32(const float *x, uint8_t *b) { memcpy(b, x, 4); }
static void q_f16(const float *x, uint8_t *b) { f16_put(b, *x); }
static void q_bf16(const float *x, uint8_t *b)
{
    uint16_t h = kiln__f32_to_bf16(*x);
    b[0] = (uint8_t)h, b[1] = (uint8_t)(h >> 8);
}

/* ---- the plain types ---- */

static void deq_f32(const uint8_t *b, float *y) { memcpy(y, b, 4); }
static void deq_f16(const uint8_t *b, float *y) { *y = f16_at(b); }
static void deq_bf16(const uint8_t *b, float *y) { *y = kiln__bf16_to_f32((uint16_t)(b[0] | b[1] << 8)); }

typedef struct {
    const char *name;
    int elems, bytes;                        /* a block's */
    void (*dequant)(const uint8_t *, float *); /* one block; NULL: kiln does not read the type */
    void (*quant)(const float *, uint8_t *);   /* one block; NULL: kiln does not write the type */
} type_row;

static const type_row types[KILN__GGML_COUNT] = {
    [KILN__GGML_F32] = {"F32", 1, 4, deq_f32, q_f32},
    [KILN__GGML_F16] = {"F16", 1, 2, deq_f16, q_f16},
    [KILN__GGML_Q4_0] = {"Q4_0", 32, 18, deq_q4_0, q_q4_0},
    [KILN__GGML_Q4_1] = {"Q4_1", 32, 20, deq_q4_1, q_q4_1},
    [KILN__GGML_Q5_0] = {"Q5_0", 32, 22, deq_q5_0, q_q5_0},
    [KILN__GGML_Q5_1] = {"Q5_1", 32, 24, deq_q5_1, q_q5_1},
    [KILN__GGML_Q8_0] = {"Q8_0", 32, 34, deq_q8_0, q_q8_0},
    [KILN__GGML_Q8_1] = {"Q8_1", 32, 36, NULL, NULL},
    [KILN__GGML_Q2_K] = {"Q2_K", QK_K, 84, deq_q2_k, NULL},
    [KILN__GGML_Q3_K] = {"Q3_K", QK_K, 110, deq_q3_k, NULL},
    [KILN__GGML_Q4_K] = {"Q4_K", QK_K, 144, deq_q4_k, q_q4_k},
    [KILN__GGML_Q5_K] = {"Q5_K", QK_K, 176, deq_q5_k, q_q5_k},
    [KILN__GGML_Q6_K] = {"Q6_K", QK_K, 210, deq_q6_k, q_q6_k},
    [KILN__GGML_Q8_K] = {"Q8_K", QK_K, 292, NULL, NULL},
    [KILN__GGML_IQ2_XXS] = {"IQ2_XXS", QK_K, 66, NULL, NULL},
    [KILN__GGML_IQ2_XS] = {"IQ2_XS", QK_K, 74, NULL, NULL},
    [KILN__GGML_IQ3_XXS] = {"IQ3_XXS", QK_K, 98, NULL, NULL},
    [KILN__GGML_IQ1_S] = {"IQ1_S", QK_K, 50, NULL, NULL},
    [KILN__GGML_IQ4_NL] = {"IQ4_NL", 32, 18, deq_iq4_nl, NULL},
    [KILN__GGML_IQ3_S] = {"IQ3_S", QK_K, 110, NULL, NULL},
    [KILN__GGML_IQ2_S] = {"IQ2_S", QK_K, 82, NULL, NULL},
    [KILN__GGML_IQ4_XS] = {"IQ4_XS", QK_K, 136, deq_iq4_xs, NULL},
    [KILN__GGML_I8] = {"I8", 1, 1, NULL, NULL},
    [KILN__GGML_I16] = {"I16", 1, 2, NULL, NULL},
    [KILN__GGML_I32] = {"I32", 1, 4, NULL, NULL},
    [KILN__GGML_I64] = {"I64", 1, 8, NULL, NULL},
    [KILN__GGML_F64] = {"F64", 1, 8, NULL, NULL},
    [KILN__GGML_IQ1_M] = {"IQ1_M", QK_K, 56, NULL, NULL},
    [KILN__GGML_BF16] = {"BF16", 1, 2, deq_bf16, q_bf16},
    [KILN__GGML_TQ1_0] = {"TQ1_0", QK_K, 54, NULL, NULL},
    [KILN__GGML_TQ2_0] = {"TQ2_0", QK_K, 66, NULL, NULL},
    [KILN__GGML_MXFP4] = {"MXFP4", 32, 17, NULL, NULL},
};

static const type_row *row_of(int t) { return t >= 0 && t < KILN__GGML_COUNT && types[t].name ? &types[t] : NULL; }

const char *kiln__quant_name(int t) { return row_of(t) ? row_of(t)->name : NULL; }

bool kiln__quant_block(int t, int64_t *elems, int64_t *bytes)
{
    const type_row *r = row_of(t);
    if (!r) return false;
    *elems = r->elems;
    *bytes = r->bytes;
    return true;
}

bool kiln__quant_readable(int t) { return row_of(t) && row_of(t)->dequant; }
bool kiln__quant_writable(int t) { return row_of(t) && row_of(t)->quant; }

void kiln__quant_quant(int t, const float *src, void *dst, int64_t n)
{
    const type_row *r = row_of(t);
    uint8_t *b = dst;
    for (int64_t i = 0; i < n / r->elems; i++)
        r->quant(src + i * r->elems, b + i * r->bytes);
}

void kiln__quant_dequant(int t, const void *src, float *dst, int64_t n)
{
    const type_row *r = row_of(t);
    const uint8_t *b = src;
    for (int64_t i = 0; i < n / r->elems; i++)
        r->dequant(b + i * r->bytes, dst + i * r->elems);
}
