/* Entry points of the fused kernels (softmax, norms, cross-entropy, rotary, attention)
 * for f32 and f64; the bodies are in cpu_fused_impl.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include "backends/cpu/cpu.h"
#include "backends/cpu/gemm.h"
#include "core/opts.h"

/* expr_T(x): exp for the tiles of attention; the fast f32 one behind KILN_OPT_FAST_EXP. */
static inline float expr_f32(float x) { return kiln__fast_expf(x); }
static inline double expr_f64(double x) { return exp(x); }

/* The loops written in AVX and AVX-512 registers below, where the build keeps more than
 * one version of the hot loops (not the sanitizer build: KILN_SIMD's condition). */
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(KILN_NO_CLONES)
#define CPU_FUSED_INTRINSICS 1
#include <immintrin.h>
#endif

/* transpose_fast_T(dst, src, T, D, ld): dst (D, T) = src (T, D) (row stride ld) in 8x8
 * AVX register blocks when the processor has AVX and both sizes are multiples of 8;
 * false leaves it to the plain loop. (The compiler turns neither loop order of a
 * transpose into vector code by itself.) */
#ifdef CPU_FUSED_INTRINSICS
__attribute__((target("avx"))) static void transpose_avx_f32(float *dst, const float *src, int64_t T, int64_t D,
                                                             int64_t ld)
{
    for (int64_t j0 = 0; j0 < T; j0 += 8)
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8], t[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + (j0 + i) * ld + d0);
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
                r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
                r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
                r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
            }
            for (int i = 0; i < 4; i++) {
                t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
                t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + (d0 + i) * T + j0, t[i]);
        }
}

static bool transpose_fast_f32(float *dst, const float *src, int64_t T, int64_t D, int64_t ld)
{
    if (T % 8 || D % 8 || !__builtin_cpu_supports("avx")) return false;
    transpose_avx_f32(dst, src, T, D, ld);
    return true;
}
#else
static bool transpose_fast_f32(float *dst, const float *src, int64_t T, int64_t D, int64_t ld) { return false; }
#endif
static bool transpose_fast_f64(double *dst, const double *src, int64_t T, int64_t D, int64_t ld) { return false; }

/* A dim of one element may carry any stride; the BLAS wants a row stride of at least D. */
static void strides3(const kiln_tensor_t *t, int64_t *s)
{
    for (int d = 0; d < 3; d++) s[d] = t->stride[d];
    if (t->shape[2] == 1 || s[2] < t->shape[3]) s[2] = t->shape[3] > 1 ? t->shape[3] : 1;
}

/* Attention's tasks call the BLAS: in parallel when the BLAS is single-threaded
 * (POOL_GEMM), else one after another with the BLAS threading each tile. */
static void att_run(int64_t tasks, kiln__range_fn fn, void *ctx)
{
    if (kiln__opt(KILN__OPT_POOL_GEMM)) kiln__parallel_for(tasks, 1, fn, ctx);
    else fn(ctx, 0, tasks);
}

static int64_t rows_of(const kiln_tensor_t *x) { return x->ndim ? kiln__numel(x->ndim - 1, x->shape) : 1; }
static int64_t last_dim(const kiln_tensor_t *x) { return x->ndim ? x->shape[x->ndim - 1] : 1; }

#define R float
#define SFX f32
#define GEMM kiln__cpu_sgemm
#include "backends/cpu/cpu_fused_impl.h"
#undef R
#undef SFX
#undef GEMM
#define R double
#define SFX f64
#define GEMM cblas_dgemm
#include "backends/cpu/cpu_fused_impl.h"
#undef R
#undef SFX
#undef GEMM

/* ---- a row of attention's scores to its unnormalized weights (flex attention's forward) ---- */

/* A row whose maximum is not above -inf (the max skips NaN): with a NaN in it, the row
 * is NaN (its weights, max and sum), as the dense path computes it and as NaN
 * propagates through a softmax; else it sees no key: zeros, and a sum of 0. */
#define ROW_UNSEEN(SFX, R)                                                             \
    static double row_unseen_##SFX(R *row, int64_t n, R *max)                          \
    {                                                                                  \
        bool nan = false;                                                              \
        for (int64_t j = 0; j < n; j++) nan |= row[j] != row[j];                       \
        for (int64_t j = 0; j < n; j++) row[j] = nan ? (R)NAN : 0;                     \
        if (nan) *max = (R)NAN;                                                        \
        return nan ? NAN : 0;                                                          \
    }
ROW_UNSEEN(f32, float)
ROW_UNSEEN(f64, double)

#ifdef CPU_FUSED_INTRINSICS
#define ROW_EXP_AVX512 __attribute__((target("avx512f")))
/* km_exp_fast (src/core/kmath.h, its constants) on 16 lanes: its clamps, rounding and
 * polynomial, with 2^n applied by vscalefps; 0 below KM_EXP_LO, NaN kept. */
ROW_EXP_AVX512 static inline __m512 exp16(__m512 x0)
{
    __m512 x = _mm512_min_ps(_mm512_max_ps(x0, _mm512_set1_ps(KM_EXP_LO)), _mm512_set1_ps(KM_EXP_HI)); /* NaN: LO */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(KM_EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KM_EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(KM_EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(KM_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_EXP_P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    p = _mm512_scalef_ps(p, n);
    p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, _mm512_set1_ps(KM_EXP_LO), _CMP_NLT_UQ), p);
    return _mm512_mask_mov_ps(p, _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q), x0);
}

static inline __mmask16 lanes_left(int64_t left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1); }

ROW_EXP_AVX512 static double row_exp_avx512(float *row, int64_t n, float *max)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 m0 = ninf, m1 = ninf; /* vmaxps passes over a NaN entry (its second operand is kept) */
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        m0 = _mm512_max_ps(_mm512_loadu_ps(row + j), m0);
        m1 = _mm512_max_ps(_mm512_loadu_ps(row + j + 16), m1);
    }
    for (; j < n; j += 16) m0 = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, lanes_left(n - j), row + j), m0);
    float m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    *max = m;
    if (!(m > -INFINITY)) return row_unseen_f32(row, n, max);
    const __m512 vm = _mm512_set1_ps(m);
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (j = 0; j < n; j += 16) {
        __mmask16 k = lanes_left(n - j);
        __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), vm)));
        _mm512_mask_storeu_ps(row + j, k, e);
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
}
#endif

/* The plain loops (where the processor has no AVX-512, and f64): dense attention's
 * row_max and att_row_exp over the whole row, compiled for the processor's vector unit
 * as the other hot loops are; a row with nothing above -inf is zeros. */
#define ROW_EXP_PLAIN(SFX, R, FAST)                                                   \
    KILN_SIMD static double row_exp_plain_##SFX(R *row, int64_t n, R *max)            \
    {                                                                                 \
        R m = *max = row_max_##SFX(row, n, n);                                        \
        if (!(m > -INFINITY)) return row_unseen_##SFX(row, n, max);                   \
        return att_row_exp_##SFX(row, n, n, m, FAST);                                 \
    }
ROW_EXP_PLAIN(f32, float, true)
ROW_EXP_PLAIN(f64, double, false)

double kiln__cpu_att_row_exp_f32(float *row, int64_t n, float *max, bool vec)
{
#ifdef CPU_FUSED_INTRINSICS
    if (vec && __builtin_cpu_supports("avx512f")) return row_exp_avx512(row, n, max);
#else
    (void)vec;
#endif
    return row_exp_plain_f32(row, n, max);
}

double kiln__cpu_att_row_exp_f64(double *row, int64_t n, double *max, bool vec)
{
    (void)vec;
    return row_exp_plain_f64(row, n, max);
}

void kiln__cpu_transpose_f32(float *dst, const float *src, int64_t T, int64_t D, int64_t ld)
{
    att_transpose_f32(dst, src, T, D, ld);
}

void kiln__cpu_transpose_f64(double *dst, const double *src, int64_t T, int64_t D, int64_t ld)
{
    att_transpose_f64(dst, src, T, D, ld);
}

static kiln_status unsupported(const char *op, kiln_dtype dt)
{
    return kiln__err(KILN_ERR_UNSUPPORTED, "%s: dtype %s is not supported by the cpu backend (cast to f32)", op,
                     kiln_dtype_name(dt));
}

/* The template's f_f32(...) or f_f64(...), by the dtype dt; any other is unsupported in op. */
#define BY_REAL(dt, op, f, ...) \
    ((dt) == KILN_DTYPE_F32   ? f##_f32(__VA_ARGS__) \
     : (dt) == KILN_DTYPE_F64 ? f##_f64(__VA_ARGS__) \
                              : unsupported(op, dt))


static kiln_status softmax_k(kiln_tensor_t *const *in, kiln_tensor_t *const *out, const kiln__attrs *a, bool log)
{
    kiln_tensor_t *c[1], *tmp[1];
    if (!cpu_contig_n(in, 1, c, tmp, NULL)) return kiln_last_status();
    const char *op = log ? "log_softmax" : "softmax";
    kiln_status s = BY_REAL(c[0]->dtype, op, softmax, c[0], out[0], (int)a->op.dim.dim, log);
    cpu_free_n(tmp, 1);
    return s;
}

/* The exported kernels: each computes in f32 or f64 (BY_REAL), and takes f16 and bf16
 * on widened copies (CPU_WIDEN). */
#define WIDENED(name, call)                    \
    kiln_status kiln__cpu_##name(KILN__KERNEL_ARGS) \
    {                                          \
        CPU_WIDEN(kiln__cpu_##name);           \
        return call;                           \
    }

WIDENED(softmax, softmax_k(in, out, a, false))
WIDENED(log_softmax, softmax_k(in, out, a, true))

/* Layer norm (rms false) and RMS norm, forward (nin inputs) or backward; x is input 0
 * forward, 1 backward. */
static kiln_status norm_k(kiln_tensor_t *const *in, int nin, kiln_tensor_t *const *out, const kiln__attrs *a, bool rms,
                          bool bwd)
{
    kiln_tensor_t *c[5], *tmp[5];
    if (!cpu_contig_n(in, nin, c, tmp, NULL)) return kiln_last_status();
    const char *op = rms ? "rms_norm" : "layer_norm";
    kiln_status s = bwd ? BY_REAL(c[1]->dtype, op, norm_bwd, c, out, rms)
                        : BY_REAL(c[0]->dtype, op, norm_fwd, c, out, a, rms);
    cpu_free_n(tmp, nin);
    return s;
}

WIDENED(layer_norm, norm_k(in, 3, out, a, false, false))
WIDENED(rms_norm, norm_k(in, 2, out, a, true, false))
WIDENED(layer_norm_backward, norm_k(in, 5, out, a, false, true))
WIDENED(rms_norm_backward, norm_k(in, 4, out, a, true, true))

/* Forward in: logits, targets; backward in: g (scalar), logits, targets, lse. */
static kiln_status ce_k(kiln_tensor_t *const *in, kiln_tensor_t *const *out, const kiln__attrs *a, bool bwd)
{
    int n = bwd ? 4 : 2;
    kiln_tensor_t *c[4], *tmp[4];
    if (!cpu_contig_n(in, n, c, tmp, NULL)) return kiln_last_status();
    const kiln_tensor_t *x = c[bwd];
    int64_t N = x->shape[0], count = 0;
    /* Every target is checked before any work: an out-of-range class is an error, not a
     * read outside the row. */
    kiln_status s = cpu_check_indices("cross_entropy", c[bwd + 1], x->shape[1], &a->op.cross_entropy.ignore_index, &count);
    double *loss = s == KILN_OK && !bwd ? malloc(sizeof(double) * (size_t)(N ? N : 1)) : NULL;
    if (s == KILN_OK && !bwd && !loss) s = kiln__err(KILN_ERR_OOM, "cross_entropy: out of memory");
    if (s == KILN_OK)
        s = bwd ? BY_REAL(x->dtype, "cross_entropy", ce_bwd, c, out, a, count, kiln__load(kiln__data(c[0]), c[0]->dtype))
                : BY_REAL(x->dtype, "cross_entropy", ce_fwd, c, out, a, count, loss);
    free(loss);
    cpu_free_n(tmp, n);
    return s;
}

WIDENED(cross_entropy, ce_k(in, out, a, false))
WIDENED(cross_entropy_backward, ce_k(in, out, a, true))

/* Fills cs (T, D/2, 2) with the cos and sin of position pos(t): frequencies in f32 as
 * LLaMA's reference computes them (kiln_rope_frequencies, with the op's scaling),
 * angles in double. */
static kiln_status rope_angles(double *cs, int64_t T, int64_t D, const kiln__rope_attrs *r, int64_t pos0,
                               const kiln_tensor_t *pos)
{
    int64_t h = D / 2;
    size_t isz = pos ? kiln_dtype_size(pos->dtype) : 0;
    float stack[256], *freq = h <= 256 ? stack : malloc(sizeof(float) * (size_t)h); /* a head's worth, usually */
    if (!freq) return kiln__err(KILN_ERR_OOM, "rope: out of memory");
    kiln_status s = kiln_rope_frequencies(r->theta, D, &r->scaling, freq);
    for (int64_t i = 0; s == KILN_OK && i < h; i++) {
        for (int64_t t = 0; t < T; t++) {
            int64_t p = pos ? kiln__load_index((const char *)kiln__data(pos) + t * (int64_t)isz, pos->dtype) : pos0 + t;
            float ang = (float)p * freq[i];
            cs[(t * h + i) * 2] = cos((double)ang);
            cs[(t * h + i) * 2 + 1] = sin((double)ang);
        }
    }
    if (freq != stack) free(freq);
    return s;
}

/* rope: x (..., T, D), row r at position pos0 + r % T. rope_at: x (N, H, D), pos (N),
 * row n at position pos[n] for its H heads. */
static kiln_status rope_k(const char *op, kiln_tensor_t *const *in, int n_in, kiln_tensor_t *out, const kiln__attrs *a)
{
    kiln_tensor_t *c[2], *tmp[2];
    if (!cpu_contig_n(in, n_in, c, tmp, NULL)) return kiln_last_status();
    const kiln_tensor_t *x = c[0];
    bool at = n_in == 2;
    int64_t D = x->shape[x->ndim - 1], T = at ? x->shape[0] : x->shape[x->ndim - 2];
    double *cs = malloc(sizeof(double) * (size_t)(T * D + 1));
    kiln_status s = cs ? KILN_OK : kiln__err(KILN_ERR_OOM, "%s: out of memory", op);
    if (s == KILN_OK) s = rope_angles(cs, T, D, &a->op.rope, at ? 0 : a->op.rope.pos0, at ? c[1] : NULL);
    if (s == KILN_OK)
        s = BY_REAL(x->dtype, op, rope, x, out, cs, T, at ? x->shape[1] : 1, !at && a->op.rope.inverse ? -1.0 : 1.0);
    free(cs);
    cpu_free_n(tmp, n_in);
    return s;
}

WIDENED(rope, rope_k("rope", in, 1, out[0], a))
kiln_status kiln__cpu_rope_at(KILN__KERNEL_ARGS) { return rope_k("rope_at", in, 2, out[0], a); }

/* Attention reads (B, H, T, D) inputs through their strides when each row of D is
 * contiguous and rows do not overlap (the BLAS takes a leading dimension); others are
 * copied. */
static bool att_rows(const kiln_tensor_t *t)
{
    return t->ndim == 4 && (t->stride[3] == 1 || t->shape[3] == 1) && (t->stride[2] >= t->shape[3] || t->shape[2] == 1) &&
           t->stride[0] >= 0 && t->stride[1] >= 0 && t->stride[2] <= INT32_MAX;
}

/* Forward in: q, k, v; backward in: g, q, k, v, o, lse (3-D, made contiguous). */
static kiln_status att_k(kiln_tensor_t *const *in, kiln_tensor_t *const *out, const kiln__attrs *a, bool bwd)
{
    int n = bwd ? 6 : 3;
    kiln_tensor_t *c[6], *tmp[6];
    kiln_status s = cpu_contig_n(in, n, c, tmp, att_rows) ? KILN_OK : kiln_last_status();
    if (s == KILN_OK && !(c[bwd]->dtype == KILN_DTYPE_F32 ? att_f32(c, out, a, bwd) : att_f64(c, out, a, bwd)))
        s = kiln__err(KILN_ERR_OOM, bwd ? "attention backward: out of memory for a tile buffer"
                                        : "attention: out of memory for a row buffer");
    cpu_free_n(tmp, n);
    return s;
}

/* ---- bf16 attention: the tiles' products on kiln's own GEMM (bf16 values, f32 sums;
 * AMX where the processor has it), the softmax in f32 as for f32 inputs. P and dS are
 * rounded to bf16 before they are multiplied, as PyTorch's bf16 attention rounds them
 * (its CPU flash attention and autocast's matmuls alike); scores, the log-sum-exp and
 * the dK, dV sums stay f32, and each output is rounded once. Before this the inputs
 * were widened to f32 copies and the tiles ran on the f32 BLAS: 15% of a compiled bf16
 * training step, docs/perf-log.md. ---- */
typedef struct {
    att_ctx_f32 c; /* shapes, strides (elements), scale, causal, fast; c.oom */
    const uint16_t *q, *k, *v, *g, *o;
    uint16_t *out, *dq, *dk, *dv;
} att16_ctx;

static kiln__gemm_operand op16(const uint16_t *p, int64_t rs, int64_t cs)
{
    return (kiln__gemm_operand){p, KILN__GEMM_BF16, rs, cs};
}

/* S (rows, nblk) = scale Q K^T, f32. */
KILN_SIMD static bool att16_scores(const att16_ctx *x, int64_t rows, int64_t nblk, const uint16_t *Q, const uint16_t *K, float *S)
{
    const att_ctx_f32 *a = &x->c;
    if (!kiln__gemm(rows, nblk, a->D, op16(Q, a->qs[2], 1), op16(K, 1, a->ks[2]), S, nblk, false, KILN__GEMM_BF16))
        return false;
    float scale = (float)a->scale;
    for (int64_t i = 0; i < rows * nblk; i++) S[i] *= scale;
    return true;
}

KILN_SIMD static void att16_fwd_range(void *p, int64_t b, int64_t e)
{
    att16_ctx *x = p;
    att_ctx_f32 *a = &x->c;
    int64_t D = a->D, grp = a->H / a->Hkv, Tk = a->Tk ? a->Tk : 1;
    float *S = malloc(sizeof(float) * (size_t)(ATT_QB * Tk));
    uint16_t *Pb = malloc(sizeof(uint16_t) * (size_t)(ATT_QB * Tk));
    bool ok = S && Pb;
    for (int64_t t = b; t < e && ok; t++) {
        int64_t bb = t / a->H, h = t % a->H, hk = h / grp;
        const uint16_t *K = x->k + bb * a->ks[0] + hk * a->ks[1], *V = x->v + bb * a->vs[0] + hk * a->vs[1];
        for (int64_t i0 = 0; i0 < a->Tq && ok; i0 += ATT_QB) {
            int64_t rows = a->Tq - i0 < ATT_QB ? a->Tq - i0 : ATT_QB, nblk = att_keys_f32(a, i0 + rows - 1);
            const uint16_t *Q = x->q + bb * a->qs[0] + h * a->qs[1] + i0 * a->qs[2];
            uint16_t *O = x->out + (t * a->Tq + i0) * D;
            if (nblk == 0) {
                memset(O, 0, sizeof(uint16_t) * (size_t)(rows * D));
                for (int64_t r = 0; r < rows; r++) a->lse[t * a->Tq + i0 + r] = -INFINITY;
                continue;
            }
            if (!(ok = att16_scores(x, rows, nblk, Q, K, S))) break;
            att_softmax_rows_f32(a, i0, rows, nblk, S, NULL, a->lse + t * a->Tq + i0, a->fast);
            kiln__f32_to_bf16_n(S, Pb, rows * nblk);
            ok = ok && kiln__gemm_bf16(rows, D, nblk, op16(Pb, nblk, 1), op16(V, a->vs[2], 1), O, D);
        }
    }
    if (!ok) atomic_store(&a->oom, 1);
    free(S);
    free(Pb);
}

KILN_SIMD static void att16_bwd_range(void *p, int64_t b, int64_t e)
{
    att16_ctx *x = p;
    att_ctx_f32 *a = &x->c;
    int64_t D = a->D, grp = a->H / a->Hkv, Tk = a->Tk ? a->Tk : 1;
    float *P = malloc(sizeof(float) * (size_t)(2 * ATT_QB * Tk + 2 * Tk * D + ATT_QB * D));
    uint16_t *Pb = malloc(sizeof(uint16_t) * (size_t)(ATT_QB * Tk));
    float *dP = P ? P + ATT_QB * Tk : NULL, *dK = P ? dP + ATT_QB * Tk : NULL, *dV = P ? dK + Tk * D : NULL;
    float *dQ = P ? dV + Tk * D : NULL;
    bool ok = P && Pb;
    float scale = (float)a->scale;
    for (int64_t t = b; t < e && ok; t++) {
        int64_t bb = t / a->Hkv, hk = t % a->Hkv;
        const uint16_t *K = x->k + bb * a->ks[0] + hk * a->ks[1], *V = x->v + bb * a->vs[0] + hk * a->vs[1];
        memset(dK, 0, sizeof(float) * (size_t)(a->Tk * D));
        memset(dV, 0, sizeof(float) * (size_t)(a->Tk * D));
        for (int64_t h = hk * grp; h < (hk + 1) * grp && ok; h++) {
            int64_t qh = bb * a->H + h;
            for (int64_t i0 = 0; i0 < a->Tq && ok; i0 += ATT_QB) {
                int64_t rows = a->Tq - i0 < ATT_QB ? a->Tq - i0 : ATT_QB, nblk = att_keys_f32(a, i0 + rows - 1);
                const uint16_t *Q = x->q + bb * a->qs[0] + h * a->qs[1] + i0 * a->qs[2];
                const uint16_t *G = x->g + bb * a->gs[0] + h * a->gs[1] + i0 * a->gs[2];
                const uint16_t *O = x->o + bb * a->os[0] + h * a->os[1] + i0 * a->os[2];
                uint16_t *dQb = x->dq + (qh * a->Tq + i0) * D;
                if (nblk == 0) {
                    memset(dQb, 0, sizeof(uint16_t) * (size_t)(rows * D));
                    continue;
                }
                if (!(ok = att16_scores(x, rows, nblk, Q, K, P))) break;
                att_softmax_rows_f32(a, i0, rows, nblk, P, a->lse_in + qh * a->Tq + i0, NULL, a->fast);
                kiln__f32_to_bf16_n(P, Pb, rows * nblk);
                /* dV += P^T dO; dP = dO V^T */
                ok = ok && kiln__gemm(nblk, D, rows, op16(Pb, 1, nblk), op16(G, a->gs[2], 1), dV, D, true,
                                      KILN__GEMM_BF16);
                ok = ok && kiln__gemm(rows, nblk, D, op16(G, a->gs[2], 1), op16(V, 1, a->vs[2]), dP, nblk, false,
                                      KILN__GEMM_BF16);
                /* dS = P (dP - rowsum(dO O)), rounded to bf16 for its two products */
                for (int64_t r = 0; r < rows; r++) {
                    double di = 0;
                    for (int64_t d = 0; d < D; d++)
                        di += (double)kiln__bf16_to_f32(G[r * a->gs[2] + d]) * kiln__bf16_to_f32(O[r * a->os[2] + d]);
                    float *pr = P + r * nblk, *dr = dP + r * nblk;
                    for (int64_t j = 0; j < nblk; j++) dr[j] = pr[j] * (dr[j] - (float)di);
                }
                kiln__f32_to_bf16_n(dP, Pb, rows * nblk);
                /* dQ = scale dS K; dK += dS^T Q (scaled at the end) */
                ok = ok && kiln__gemm(rows, D, nblk, op16(Pb, nblk, 1), op16(K, a->ks[2], 1), dQ, D, false,
                                      KILN__GEMM_BF16);
                for (int64_t i = 0; i < rows * D; i++) dQ[i] *= scale;
                kiln__f32_to_bf16_n(dQ, dQb, rows * D);
                ok = ok && kiln__gemm(nblk, D, rows, op16(Pb, 1, nblk), op16(Q, a->qs[2], 1), dK, D, true,
                                      KILN__GEMM_BF16);
            }
        }
        for (int64_t i = 0; i < a->Tk * D; i++) dK[i] *= scale;
        kiln__f32_to_bf16_n(dK, x->dk + t * a->Tk * D, a->Tk * D);
        kiln__f32_to_bf16_n(dV, x->dv + t * a->Tk * D, a->Tk * D);
    }
    if (!ok) atomic_store(&a->oom, 1);
    free(P);
    free(Pb);
}

/* Forward in: q, k, v (bf16) -> o (bf16), lse (f32); backward in: g, q, k, v, o, lse ->
 * dq, dk, dv (bf16). */
static kiln_status att16_k(kiln_tensor_t *const *in, kiln_tensor_t *const *out, const kiln__attrs *at, bool bwd)
{
    int n = bwd ? 6 : 3;
    kiln_tensor_t *c[6], *tmp[6];
    if (!cpu_contig_n(in, n, c, tmp, att_rows)) return kiln_last_status();
    const kiln_tensor_t *q = c[bwd], *kk = c[bwd + 1], *vv = c[bwd + 2];
    att16_ctx x = {.c = {.B = q->shape[0], .H = q->shape[1], .Hkv = kk->shape[1], .Tq = q->shape[2],
                         .Tk = kk->shape[2], .D = q->shape[3], .scale = at->op.attention.scale,
                         .causal = at->op.attention.causal, .fast = kiln__opt(KILN__OPT_FAST_EXP)},
                   .q = kiln__data(q), .k = kiln__data(kk), .v = kiln__data(vv)};
    strides3(q, x.c.qs);
    strides3(kk, x.c.ks);
    strides3(vv, x.c.vs);
    if (bwd) {
        x.g = kiln__data(c[0]);
        x.o = kiln__data(c[4]);
        strides3(c[0], x.c.gs);
        strides3(c[4], x.c.os);
        x.c.lse_in = kiln__data(c[5]);
        x.dq = kiln__data(out[0]);
        x.dk = kiln__data(out[1]);
        x.dv = kiln__data(out[2]);
        kiln__parallel_for(x.c.B * x.c.Hkv, 1, att16_bwd_range, &x);
    } else {
        x.out = kiln__data(out[0]);
        x.c.lse = kiln__data(out[1]);
        kiln__parallel_for(x.c.B * x.c.H, 1, att16_fwd_range, &x);
    }
    cpu_free_n(tmp, n);
    return atomic_load(&x.c.oom) ? kiln__err(KILN_ERR_OOM, "attention%s: out of memory for a bf16 tile buffer",
                                             bwd ? " backward" : "")
                                 : KILN_OK;
}

/* bf16 attention on kiln's GEMM (above); f16 widened to f32. */
kiln_status kiln__cpu_attention(KILN__KERNEL_ARGS)
{
    if (in[0]->dtype == KILN_DTYPE_BF16 && kiln__opt(KILN__OPT_ATT_BF16)) return att16_k(in, out, a, false);
    CPU_WIDEN(kiln__cpu_attention);
    return att_k(in, out, a, false);
}

kiln_status kiln__cpu_attention_backward(KILN__KERNEL_ARGS)
{
    if (in[1]->dtype == KILN_DTYPE_BF16 && kiln__opt(KILN__OPT_ATT_BF16)) return att16_k(in, out, a, true);
    CPU_WIDEN(kiln__cpu_attention_backward);
    return att_k(in, out, a, true);
}
