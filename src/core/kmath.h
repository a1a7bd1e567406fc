/* kiln's pointwise math, written once for every place that computes it: the cpu
 * backend's kernels include it (src/core/kmath_c.h), and every generated kernel, in C,
 * OpenCL C or CUDA C, starts with its text (embedded at build time, src/compile/
 * codegen_c.c), so that eager and compiled results agree to rounding on every device.
 *
 * It is written in the subset the three dialects share, over three names the includer
 * defines first: KM_FN, the qualifier of a helper function ("static inline", "inline",
 * "__device__ inline"), km_bits(b), a float made from the bits of an int32_t, and
 * km_fbits(f), the bits of a float as an int32_t. The C
 * library's f-suffixed names (expf, tanhf, erff, log1pf, ...) are used as in C; the
 * OpenCL header maps them onto its overloaded builtins. The double forms are left out
 * where KM_NO_F64 is defined (an OpenCL device without cl_khr_fp64). No #include: each
 * dialect has its own. */
#ifndef KILN_CORE_KMATH_H
#define KILN_CORE_KMATH_H

/* bf16 in generated kernels: a bf16 value is held as the float it equals. km_round_bf16
 * rounds a float to the nearest bf16 (ties to even, a NaN kept quiet), as
 * kiln__f32_to_bf16 does (src/core/dtype.h), so a fused bf16 op rounds where the eager
 * one does; km_from_bf16 widens stored bits, km_to_bf16 gives a rounded value's bits. */
KM_FN float km_round_bf16(float x)
{
    int32_t b = km_fbits(x);
    if ((b & 0x7fffffff) > 0x7f800000) return km_bits((b | 0x00400000) & ~0xffff);
    return km_bits((b + 0x7fff + ((b >> 16) & 1)) & ~0xffff);
}
KM_FN float km_from_bf16(int32_t h) { return km_bits((int32_t)((unsigned)(h & 0xffff) << 16)); }
KM_FN int32_t km_to_bf16(float rounded) { return (km_fbits(rounded) >> 16) & 0xffff; }

/* f16 likewise, as kiln__f32_to_f16 and kiln__f16_to_f32 (src/core/dtype.h) do it:
 * nearest even, subnormals (multiples of 2^-24 below 2^-14), above 65504 infinity. */
KM_FN float km_round_f16(float x)
{
    int32_t b = km_fbits(x), a = b & 0x7fffffff, sign = b & (int32_t)0x80000000;
    if (a > 0x7f800000) return x;
    if (a < 0x38800000) /* the subnormal grid: 0.75 + x has ulp 2^-24 there */
        return km_bits(km_fbits((x + 0.75f) - 0.75f) | sign);
    int32_t r = (b + 0xfff + ((b >> 13) & 1)) & ~0x1fff;
    return km_bits((r & 0x7fffffff) > 0x477fe000 ? (sign | 0x7f800000) : r);
}
KM_FN float km_from_f16(int32_t h)
{
    int32_t sign = (int32_t)((unsigned)(h & 0x8000) << 16), e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float sub = (float)m * 5.9604644775390625e-8f; /* m 2^-24 */
    int32_t bits = e == 31 ? (sign | 0x7f800000 | (m << 13)) : (sign | ((e + 112) << 23) | (m << 13));
    return e == 0 ? km_bits(km_fbits(sub) | sign) : km_bits(bits);
}
KM_FN int32_t km_to_f16(float rounded)
{
    int32_t b = km_fbits(rounded), sign = (b >> 16) & 0x8000, a = b & 0x7fffffff;
    if (a > 0x7f800000) return sign | 0x7e00;
    if (a >= 0x47800000) return sign | 0x7c00;
    if (a < 0x38800000) return sign | (int32_t)(km_bits(a) * 16777216.0f);
    return sign | (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3ff);
}

/* KM_PW(name, F, D): km_<name>(float x) returning F, and km_<name>d(double x)
 * returning D where the dialect has doubles. */
#ifdef KM_NO_F64
#define KM_PW(name, F, D) KM_FN float km_##name(float x) { return F; }
#else
#define KM_PW(name, F, D)                          \
    KM_FN float km_##name(float x) { return F; }   \
    KM_FN double km_##name##d(double x) { return D; }
#endif

/* exp(x) by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (the Cephes
 * coefficients), about 2 ulp, written with selects and a rounding constant so that a
 * compiler vectorizes it (libm's expf is a call per element): the fast-exp switch's
 * form (KILN_OPT_FAST_EXP), and the generated kernels' exp. Below -87 the true value
 * is under FLT_MIN: 0, as exp(-inf) must be, and never a denormal, which would slow
 * every multiply that reads it (a masked softmax's weights in a GEMM ran 25x slower).
 * NaN stays NaN. */
/* Its constants, which the cpu backend's AVX-512 form (cpu_fused.c's exp16) shares: the
 * clamps, log2(e), ln 2 in two parts, and the polynomial's coefficients, highest first. */
#define KM_EXP_LO -87.0f
#define KM_EXP_HI 88.0f
#define KM_EXP_LOG2E 1.44269504088896341f
#define KM_EXP_LN2_HI 0.693359375f
#define KM_EXP_LN2_LO 2.12194440e-4f
#define KM_EXP_P0 1.9875691500e-4f
#define KM_EXP_P1 1.3981999507e-3f
#define KM_EXP_P2 8.3334519073e-3f
#define KM_EXP_P3 4.1665795894e-2f
#define KM_EXP_P4 1.6666665459e-1f
#define KM_EXP_P5 5.0000001201e-1f
KM_FN float km_exp_fast(float x0)
{
    float x = x0 > KM_EXP_LO ? x0 : KM_EXP_LO; /* a NaN too, so the conversion below stays in range */
    x = x < KM_EXP_HI ? x : KM_EXP_HI;
    float n = (x * KM_EXP_LOG2E + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * KM_EXP_LN2_HI + n * KM_EXP_LN2_LO;
    float p = KM_EXP_P0;
    p = p * r + KM_EXP_P1;
    p = p * r + KM_EXP_P2;
    p = p * r + KM_EXP_P3;
    p = p * r + KM_EXP_P4;
    p = p * r + KM_EXP_P5;
    p = p * r * r + r + 1.0f;
    return x0 == x0 ? (x0 < KM_EXP_LO ? 0.0f : p * km_bits(((int32_t)n + 127) << 23)) : x0;
}

/* The pointwise ops of include/kiln/pointwise.def, each row's functions (and the
 * _fast forms of the rows that have them): neg, abs, exp, log, sqrt, rsqrt, tanh,
 * sigmoid, relu, silu (with its derivative), softplus (with its derivative). */
KM_PW(neg, -x, -x)
KM_PW(abs, fabsf(x), fabs(x))
KM_PW(exp, expf(x), exp(x))
KM_PW(log, logf(x), log(x))
KM_PW(sqrt, sqrtf(x), sqrt(x))
KM_PW(rsqrt, 1.0f / sqrtf(x), 1.0 / sqrt(x))
KM_PW(tanh, tanhf(x), tanh(x))
KM_PW(sigmoid, 1.0f / (1.0f + expf(-x)), 1.0 / (1.0 + exp(-x)))
KM_PW(relu, x > 0 ? x : 0.0f, x > 0 ? x : 0.0)
/* tanh(u) = 1 - 2 / (exp(2u) + 1): exact limits at both ends; absolute error ~1e-7. */
KM_FN float km_tanh_fast(float u) { return 1.0f - 2.0f / (km_exp_fast(2.0f * u) + 1.0f); }
KM_FN float km_sigmoid_fast(float x) { return 1.0f / (1.0f + km_exp_fast(-x)); }

/* silu(x) = x sigmoid(x); its derivative s (1 + x (1 - s)), s = sigmoid(x). */
KM_PW(silu, x * km_sigmoid(x), x * km_sigmoidd(x))
KM_PW(silu_dx, km_sigmoid(x) * (1.0f + x * (1.0f - km_sigmoid(x))), km_sigmoidd(x) * (1.0 + x * (1.0 - km_sigmoidd(x))))
KM_FN float km_silu_fast(float x) { return x * km_sigmoid_fast(x); }
KM_FN float km_silu_dx_fast(float x) { return km_sigmoid_fast(x) * (1.0f + x * (1.0f - km_sigmoid_fast(x))); }

/* softplus(x) = log(1 + exp(x)), and x itself above 20 (where they agree to rounding),
 * as PyTorch's default threshold; its derivative is the sigmoid (1 above 20). */
KM_PW(softplus, x > 20.0f ? x : log1pf(expf(x)), x > 20.0 ? x : log1p(exp(x)))
KM_PW(softplus_dx, x > 20.0f ? 1.0f : 1.0f / (1.0f + expf(-x)), x > 20.0 ? 1.0 : 1.0 / (1.0 + exp(-x)))

/* NaN propagates through maximum and minimum, as in PyTorch. */
KM_FN float km_max(float x, float y) { return x != x || x > y ? x : y; }
KM_FN float km_min(float x, float y) { return x != x || x < y ? x : y; }
#ifndef KM_NO_F64
KM_FN double km_maxd(double x, double y) { return x != x || x > y ? x : y; }
KM_FN double km_mind(double x, double y) { return x != x || x < y ? x : y; }
#endif

/* GELU: the tanh approximation (sqrt(2/pi) and 0.044715), its fast-exp form, and the
 * erf form; each with its derivative. */
#define KM_C0 0.7978845608028654f
#define KM_C1 0.044715f
KM_FN float km_gelu_fast(float x) { return 0.5f * x * (1.0f + km_tanh_fast(KM_C0 * (x + KM_C1 * x * x * x))); }
KM_FN float km_gelu_tanh(float x) { return 0.5f * x * (1.0f + tanhf(KM_C0 * (x + KM_C1 * x * x * x))); }
KM_FN float km_gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678f)); }
/* The tanh form's derivative from t = tanh(sqrt(2/pi) (x + 0.044715 x^3)). */
KM_FN float km_gelu_grad_t(float x, float t)
{
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * KM_C0 * (1.0f + 3.0f * KM_C1 * x * x);
}
KM_FN float km_gelu_grad_fast(float x) { return km_gelu_grad_t(x, km_tanh_fast(KM_C0 * (x + KM_C1 * x * x * x))); }
KM_FN float km_gelu_grad_tanh(float x) { return km_gelu_grad_t(x, tanhf(KM_C0 * (x + KM_C1 * x * x * x))); }
KM_FN float km_gelu_grad_erf(float x)
{
    return 0.5f * (1.0f + erff(x * 0.70710678f)) + x * expf(-0.5f * x * x) * 0.39894228f;
}

#endif
