/* matmul_rows_packed on q8_0 weights (kiln_matmul_rows_pack_q8_0's layout, kiln/ops.h):
 * out (M,N) = a (M,K) w (N,K)^T with a quantized once per call to q8_0 blocks per row
 * (ggml's quantizer: d = amax/127, q = roundf(x/d)), an exact int32 dot product per
 * 32-value block and the blocks summed in order in f32 as
 *     acc = fmaf((float)dot, d_w * d_a, acc)
 * in every kernel, so the bits do not depend on M, on the thread split (threads take
 * whole panels) or on the kernel: the plain C one, or AVX2's maddubs (KILN_OPT_ROWS_Q8_SIMD)
 * with the sign trick (|a| unsigned times w carrying a's sign; no q8_0 value is -128,
 * and two products of 127 x 127 fit maddubs's int16). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "backends/cpu/cpu.h"
#include "core/dtype.h"
#include "core/opts.h"
#include "core/quant.h"
#include "kiln/ops.h"

#define QB KILN_ROWS_Q8_BLOCK
#define QP KILN_ROWS_PANEL
#define QBYTES KILN_ROWS_Q8_BYTES

typedef struct {
    const int8_t *aq; /* (M, K) a's q8_0 values */
    const float *ad;  /* (M, KB) a's block scales, widened from f16 */
    const uint8_t *w; /* (P, KB, QBYTES) */
    float *out;       /* (M, N) */
    int64_t M, N, K, KB, P;
} q8_ctx;

static float scale_at(const uint8_t *blk, int j)
{
    uint16_t h;
    memcpy(&h, blk + 2 * j, 2);
    return kiln__f16_to_f32(h);
}

/* The reference: one output element at a time. */
static void q8_range_c(void *c, int64_t b, int64_t e)
{
    const q8_ctx *k = c;
    for (int64_t p = b; p < e; p++) {
        const uint8_t *pw = k->w + p * k->KB * QBYTES;
        int64_t c0 = p * QP, nc = k->N - c0 < QP ? k->N - c0 : QP;
        for (int64_t m = 0; m < k->M; m++) {
            const int8_t *a = k->aq + m * k->K;
            const float *da = k->ad + m * k->KB;
            float acc[QP] = {0};
            for (int64_t bb = 0; bb < k->KB; bb++) {
                const uint8_t *blk = pw + bb * QBYTES;
                const int8_t *q = (const int8_t *)(blk + 2 * QP), *ab = a + bb * QB;
                for (int j = 0; j < QP; j++) {
                    int32_t s = 0;
                    for (int g = 0; g < QB / 4; g++)
                        for (int t = 0; t < 4; t++) s += (int32_t)ab[4 * g + t] * q[g * 4 * QP + 4 * j + t];
                    float d = scale_at(blk, j) * da[bb];
                    acc[j] = fmaf((float)s, d, acc[j]);
                }
            }
            memcpy(k->out + m * k->N + c0, acc, sizeof(float) * (size_t)nc);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define Q8_AVX2 1
#define AVX2_TARGET "avx2,fma,f16c"

/* MR rows of a by one panel: the 16 columns as two vectors of 8 int32 lanes (lane j =
 * row j of the panel, whose 4 values of a group are one lane's 4 bytes), a row's group
 * of 4 values broadcast to every lane. */
static inline __attribute__((always_inline, target(AVX2_TARGET))) void
q8_tile_avx2(int MR, const uint8_t *pw, int64_t KB, const int8_t *a, int64_t K, const float *da, float *t)
{
    __m256 acc[4][2];
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t bb = 0; bb < KB; bb++) {
        const uint8_t *blk = pw + bb * QBYTES;
        __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)blk));
        __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(blk + 16)));
        __m256i s[4][2];
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < QB / 4; g++) {
            const uint8_t *wg = blk + 2 * QP + g * 4 * QP;
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(const void *)wg);
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(const void *)(wg + 32));
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++) {
                int32_t a4;
                memcpy(&a4, a + r * K + bb * QB + 4 * g, 4);
                __m256i av = _mm256_set1_epi32(a4), ax = _mm256_sign_epi8(av, av);
                s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, av)), ones));
                s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, av)), ones));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
            __m256 d = _mm256_set1_ps(da[r * KB + bb]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(dw0, d), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(dw1, d), acc[r][1]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(t + r * QP, acc[r][0]);
        _mm256_storeu_ps(t + r * QP + 8, acc[r][1]);
    }
}

__attribute__((target(AVX2_TARGET))) static void q8_range_avx2(void *c, int64_t b, int64_t e)
{
    const q8_ctx *k = c;
    float t[4 * QP];
    for (int64_t p = b; p < e; p++) {
        const uint8_t *pw = k->w + p * k->KB * QBYTES;
        int64_t c0 = p * QP, nc = k->N - c0 < QP ? k->N - c0 : QP;
        for (int64_t m = 0; m < k->M;) {
            int64_t left = k->M - m;
            int mr = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const int8_t *a = k->aq + m * k->K;
            const float *da = k->ad + m * k->KB;
            if (mr == 4) q8_tile_avx2(4, pw, k->KB, a, k->K, da, t);
            else if (mr == 2) q8_tile_avx2(2, pw, k->KB, a, k->K, da, t);
            else q8_tile_avx2(1, pw, k->KB, a, k->K, da, t);
            for (int r = 0; r < mr; r++) memcpy(k->out + (m + r) * k->N + c0, t + r * QP, sizeof(float) * (size_t)nc);
            m += mr;
        }
    }
}
#else
#define Q8_AVX2 0
#endif

/* The kernel for this call: AVX2 where KILN_OPT_ROWS_Q8_SIMD and the processor allow. */
static kiln__range_fn q8_kernel(void)
{
#if Q8_AVX2
    __builtin_cpu_init();
    if (kiln__opt(KILN__OPT_ROWS_Q8_SIMD) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return q8_range_avx2;
#endif
    return q8_range_c;
}

kiln_status kiln__cpu_matmul_rows_q8(kiln_tensor_t *a, kiln_tensor_t *w, kiln_tensor_t *out)
{
    int64_t M = a->shape[0], K = a->shape[1], KB = K / QB;
    if (M == 0) return KILN_OK;
    int8_t *aq = malloc((size_t)(M * K));
    float *ad = malloc(sizeof(float) * (size_t)(M * KB));
    uint8_t *blocks = malloc((size_t)(KB * (2 + QB)));
    if (!aq || !ad || !blocks) {
        free(aq);
        free(ad);
        free(blocks);
        return kiln__err(KILN_ERR_OOM, "matmul_rows_packed: out of memory for a's q8_0 blocks (%lld x %lld)",
                         (long long)M, (long long)K);
    }
    /* a's rows as ggml's q8_0 (the activations' blocks llama.cpp's Q8_0 product uses). */
    const float *af = kiln__data(a);
    for (int64_t m = 0; m < M; m++) {
        kiln__quant_quant(KILN__GGML_Q8_0, af + m * K, blocks, K);
        for (int64_t bb = 0; bb < KB; bb++) {
            const uint8_t *src = blocks + bb * (2 + QB);
            uint16_t h;
            memcpy(&h, src, 2);
            ad[m * KB + bb] = kiln__f16_to_f32(h);
            memcpy(aq + m * K + bb * QB, src + 2, QB);
        }
    }
    q8_ctx k = {aq, ad, kiln__data(w), kiln__data(out), M, out->shape[1], K, KB, w->shape[0]};
    int64_t work = M * K * QP;
    kiln__parallel_for(k.P, 1 + CPU_GRAIN * 4 / (work ? work : 1), q8_kernel(), &k);
    free(aq);
    free(ad);
    free(blocks);
    return KILN_OK;
}
