/* RoPE's frequencies, written once for every place that needs them: the cpu kernel
 * (src/backends/cpu/cpu_fused.c), the checks of an op's attributes (infer.c) and the
 * GGUF writer, which stores a scaled model's frequency divisors (src/nn/gguf.c). */
#include <math.h>
#include "kiln/ops.h"

kiln_status kiln_rope_scaling_check(const kiln_rope_scaling *s)
{
    if (!s || s->kind == KILN_ROPE_SCALING_NONE) return KILN_OK;
    if (s->kind != KILN_ROPE_SCALING_LINEAR && s->kind != KILN_ROPE_SCALING_LLAMA3)
        return kiln_error(KILN_ERR_ARG, "rope scaling: unknown kind %d", (int)s->kind);
    if (!(s->factor > 0 && isfinite(s->factor)))
        return kiln_error(KILN_ERR_ARG, "rope scaling: factor = %g must be positive", s->factor);
    if (s->kind == KILN_ROPE_SCALING_LLAMA3) {
        if (!(s->low_freq_factor > 0 && s->high_freq_factor > s->low_freq_factor && isfinite(s->high_freq_factor)))
            return kiln_error(KILN_ERR_ARG, "rope scaling: llama3 needs 0 < low_freq_factor (%g) < high_freq_factor (%g)",
                             s->low_freq_factor, s->high_freq_factor);
        if (s->original_context < 1)
            return kiln_error(KILN_ERR_ARG, "rope scaling: llama3's original_context = %d must be positive",
                             s->original_context);
    }
    return KILN_OK;
}

/* In f32 step by step, as transformers computes inv_freq and its llama3 variant (torch
 * f32 tensors), so that kiln's angles are the reference's. */
kiln_status kiln_rope_frequencies(double theta, int64_t D, const kiln_rope_scaling *s, float *freq)
{
    if (!(theta > 0) || D < 2 || D % 2 || !freq)
        return kiln_error(KILN_ERR_ARG, "rope: theta = %g must be positive and D = %lld even", theta, (long long)D);
    kiln_status st = kiln_rope_scaling_check(s);
    if (st != KILN_OK) return st;
    kiln_rope_scaling_kind kind = s ? s->kind : KILN_ROPE_SCALING_NONE;
    for (int64_t i = 0; i < D / 2; i++) {
        float f = 1.0f / powf((float)theta, (float)(2 * i) / (float)D);
        if (kind == KILN_ROPE_SCALING_LINEAR) {
            f = f / (float)s->factor;
        } else if (kind == KILN_ROPE_SCALING_LLAMA3) {
            float factor = (float)s->factor, ctx = (float)s->original_context;
            float lo = (float)s->low_freq_factor, hi = (float)s->high_freq_factor;
            float wavelen = 2.0f * (float)M_PI / f;
            /* the two bounds are Python floats (doubles) there, rounded once to f32 */
            float lo_wavelen = (float)(s->original_context / s->low_freq_factor);
            float hi_wavelen = (float)(s->original_context / s->high_freq_factor);
            if (wavelen > lo_wavelen) {
                f = f / factor;
            } else if (!(wavelen < hi_wavelen)) {
                float smooth = (ctx / wavelen - lo) / (hi - lo);
                f = (1.0f - smooth) * f / factor + smooth * f;
            }
        }
        freq[i] = f;
    }
    return KILN_OK;
}
