/* Runs of f16 values converted to and from f32: the widening of f16 operands for the
 * kernels that compute in f32 (matmul, attention, the pointwise loops) and the rounding
 * of their results. One value at a time (kiln__f16_to_f32, kiln__f32_to_f16 in
 * core/dtype.h) costs a branchy function call per element, which made f16 training
 * slower than f32; F16C's vcvtph2ps and vcvtps2ph convert 16 (AVX-512) or 8 (AVX2) at
 * once. The hardware rounds to nearest even as the scalar functions do and is exact on
 * subnormals; only NaNs differ (it sets the quiet bit and keeps the payload, the scalar
 * rule does not), so those lanes are given the scalar rule's bits: every path converts
 * to the same bits (tests/test_tensor.c checks all 65,536 f16 values and the f32
 * rounding edges). KILN_OPT_F16C=0 keeps the scalar loop. */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include "backends/cpu/gemm.h"
#include "core/opts.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__x86_64__)
#define AVX512_HALF __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AVX2_HALF __attribute__((target("avx2,f16c")))

static inline __mmask16 first16(int64_t n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1); }

AVX512_HALF static void widen16(const uint16_t *src, float *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = first16(n - i);
        __m256i h = _mm256_maskz_loadu_epi16(m, src + i);
        __m512 f = _mm512_cvtph_ps(h);
        __m512i w = _mm512_cvtepu16_epi32(h);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(w, _mm512_set1_epi32(0x7fff)), _mm512_set1_epi32(0x7c00));
        if (nan) { /* sign, all-ones exponent, the payload as it was */
            __m512i s = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x8000)), 16),
                                        _mm512_set1_epi32(0x7f800000));
            s = _mm512_or_si512(s, _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x3ff)), 13));
            f = _mm512_mask_blend_ps(nan, f, _mm512_castsi512_ps(s));
        }
        _mm512_mask_storeu_ps(dst + i, m, f);
    }
}

AVX512_HALF static void narrow16(const float *src, uint16_t *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = first16(n - i);
        __m512 f = _mm512_maskz_loadu_ps(m, src + i);
        __m256i h = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
        if (nan) { /* sign | 0x7e00 */
            __m512i u = _mm512_castps_si512(f);
            __m512i s = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
                                        _mm512_set1_epi32(0x7e00));
            h = _mm256_mask_blend_epi16(nan, h, _mm512_cvtepi32_epi16(s));
        }
        _mm256_mask_storeu_epi16(dst + i, m, h);
    }
}

/* AVX2: whole groups of 8, the tail one value at a time. */
AVX2_HALF static int64_t widen8(const uint16_t *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        __m256i w = _mm256_cvtepu16_epi32(h);
        __m256 f = _mm256_cvtph_ps(h);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7fff)), _mm256_set1_epi32(0x7c00));
        __m256i s = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16),
                                    _mm256_set1_epi32(0x7f800000));
        s = _mm256_or_si256(s, _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x3ff)), 13));
        _mm256_storeu_ps(dst + i, _mm256_blendv_ps(f, _mm256_castsi256_ps(s), _mm256_castsi256_ps(nan)));
    }
    return i;
}

AVX2_HALF static int64_t narrow8(const float *src, uint16_t *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_loadu_ps(src + i);
        __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i u = _mm256_castps_si256(f);
        __m256i s = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                    _mm256_set1_epi32(0x7e00));
        __m128i s16 = _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
        __m128i nan = _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
        _mm_storeu_si128((__m128i *)(dst + i), _mm_blendv_epi8(h, s16, nan));
    }
    return i;
}
#endif

typedef enum { HALF_C, HALF_AVX2, HALF_AVX512 } half_isa;

static int limit = HALF_AVX512; /* kiln__half_limit */
void kiln__half_limit(int level) { limit = level; }

/* The processor's best with KILN_OPT_F16C (which is read once, as every such switch),
 * found once; tests lower it with kiln__half_limit to check each width. A call costs a
 * pthread_once and a compare: the GEMM's f16 packers call this for rows of 6 to 32. */
static int found;
static pthread_once_t found_once = PTHREAD_ONCE_INIT;
static void find(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    found = !kiln__opt(KILN__OPT_F16C) || !__builtin_cpu_supports("f16c") ? HALF_C
            : __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl")
                ? HALF_AVX512
            : __builtin_cpu_supports("avx2") ? HALF_AVX2
                                             : HALF_C;
#else
    found = HALF_C;
#endif
}

static half_isa isa(void)
{
    pthread_once(&found_once, find);
    return found < limit ? (half_isa)found : (half_isa)limit;
}

void kiln__f16_to_f32_n(const uint16_t *src, float *dst, int64_t n)
{
    int64_t i = 0;
#if defined(__x86_64__)
    half_isa k = isa();
    if (k == HALF_AVX512) {
        widen16(src, dst, n);
        return;
    }
    if (k == HALF_AVX2) i = widen8(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = kiln__f16_to_f32(src[i]);
}

void kiln__f32_to_f16_n(const float *src, uint16_t *dst, int64_t n)
{
    int64_t i = 0;
#if defined(__x86_64__)
    half_isa k = isa();
    if (k == HALF_AVX512) {
        narrow16(src, dst, n);
        return;
    }
    if (k == HALF_AVX2) i = narrow8(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = kiln__f32_to_f16(src[i]);
}
