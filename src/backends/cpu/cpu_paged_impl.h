/* Paged attention's kernel, written once for the KV cache's element type and included
 * by cpu_paged.c for each (KT, KLOAD8, KSCALAR, PSFX, PATTR, PINL defined there; the
 * four that differ for every type are undefined at the end): keys and values are
 * widened to f32 as they are loaded, and all arithmetic is f32. */
#define PCAT_(a, b) a##_##b
#define PCAT(a, b) PCAT_(a, b)
#define PFN(name) PCAT(name, PSFX)

/* x . y in eight lanes, then the tail: one fixed order. */
PINL float PFN(dot)(const float *x, const KT *y, int64_t n)
{
    int64_t n8 = n / 8 * 8;
    v8 acc = {0};
    for (int64_t i = 0; i < n8; i += 8) {
        v8 a, b;
        LOAD8(a, x + i);
        KLOAD8(b, y + i);
        acc += a * b;
    }
    float s = LANES_SUM(acc);
    for (int64_t i = n8; i < n; i++) s += x[i] * KSCALAR(y[i]);
    return s;
}

/* q . y[r * stride] for four rows of y at once (four chains in flight), each summed
 * exactly as dot sums it. */
PINL void PFN(dot4)(const float *q, const KT *y, int64_t stride, int64_t n,
                                                            float out[4])
{
    int64_t n8 = n / 8 * 8;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t i = 0; i < n8; i += 8) {
        v8 x, y0, y1, y2, y3;
        LOAD8(x, q + i);
        KLOAD8(y0, y + i);
        KLOAD8(y1, y + stride + i);
        KLOAD8(y2, y + 2 * stride + i);
        KLOAD8(y3, y + 3 * stride + i);
        a0 += x * y0;
        a1 += x * y1;
        a2 += x * y2;
        a3 += x * y3;
    }
    v8 acc[4] = {a0, a1, a2, a3};
    for (int r = 0; r < 4; r++) {
        float s = LANES_SUM(acc[r]);
        for (int64_t i = n8; i < n; i++) s += q[i] * KSCALAR(y[r * stride + i]);
        out[r] = s;
    }
}

/* One task is one query row and a group of its heads. Positions (those of the window,
 * when the variant has one) are walked block by
 * block (a position's heads sit side by side in a block, so the reads are contiguous
 * runs), four positions per pass for the scores and 32 output lanes per pass for the
 * values. For each (row, head) the arithmetic is a function of that row alone: scores
 * j = 0..p each summed by dot's order, the softmax over j in eight lanes and a fixed
 * tree, then the values accumulated over j ascending. */
PATTR static void PFN(paged_range)(void *c, int64_t b, int64_t e)
{
    paged_ctx *k = c;
    int64_t D = k->D, HD = k->Hkv * D, group = k->H / k->Hkv, bl = k->bl, P = k->max_pos;
    float *w = malloc(sizeof(float) * (size_t)(k->hg * (P + 8)));
    if (!w) {
        atomic_store(&k->oom, 1);
        return;
    }
    bool fast = kiln__opt(KILN__OPT_FAST_EXP);
    for (int64_t t = b; t < e; t++) {
        int64_t n = t / k->per_row, h0 = t % k->per_row * k->hg, h1 = h0 + k->hg < k->H ? h0 + k->hg : k->H;
        int64_t seq = k->sp[n * 2], p = k->sp[n * 2 + 1], L = p + 1, lo = paged_first(p, k->window);
        const int32_t *row = k->bt + seq * k->max_blocks;
        const float *q = k->q + n * k->H * D;
        float *o = k->out + n * k->H * D;
        for (int64_t h = h0; h < h1; h++) {
            const float *qh = q + h * D;
            float *wh = w + (h - h0) * (P + 8);
            for (int64_t j0 = lo / bl * bl; j0 < L; j0 += bl) {
                const KT *kb = (const KT *)k->k + (int64_t)row[j0 / bl] * bl * HD + h / group * D;
                int64_t jn = L - j0 < bl ? L - j0 : bl, i = j0 < lo ? lo - j0 : 0;
                for (; i + 4 <= jn; i += 4) PFN(dot4)(qh, kb + i * HD, HD, D, wh + j0 + i);
                for (; i < jn; i++) wh[j0 + i] = PFN(dot)(qh, kb + i * HD, D);
            }
            float m = -INFINITY;
            if (k->softcap > 0 || k->alibi) { /* the variant's scores, as the flex presets compute them */
                float slope = (float)exp2(-8.0 * (double)(h + 1) / (double)k->H), cap = k->softcap;
                for (int64_t j = lo; j < L; j++) {
                    float sc = wh[j] * k->scale;
                    if (k->alibi == 1) sc = sc + slope * (float)(j - p);
                    if (cap > 0) sc = cap * tanhf(sc / cap);
                    if (k->alibi == 2) sc = sc + slope * (float)(j - p);
                    wh[j] = sc;
                    m = sc > m ? sc : m;
                }
            } else {
                for (int64_t j = lo; j < L; j++) {
                    wh[j] *= k->scale;
                    m = wh[j] > m ? wh[j] : m;
                }
            }
            if (fast)
                for (int64_t j = lo; j < L; j++) wh[j] = kiln__fast_expf(wh[j] - m);
            else
                for (int64_t j = lo; j < L; j++) wh[j] = expf(wh[j] - m);
            int64_t L8 = lo + (L - lo + 7) / 8 * 8;
            for (int64_t j = L; j < L8; j++) wh[j] = 0;
            v8 acc = {0};
            for (int64_t j = lo; j < L8; j += 8) {
                v8 x;
                LOAD8(x, wh + j);
                acc += x;
            }
            float inv = 1.0f / LANES_SUM(acc);
            for (int64_t j = lo; j < L; j++) wh[j] *= inv;
            float *oh = o + h * D;
            int64_t d0 = 0;
            for (; d0 + 32 <= D; d0 += 32) {
                v8 o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
                for (int64_t j0 = lo / bl * bl; j0 < L; j0 += bl) {
                    const KT *vb = (const KT *)k->v + (int64_t)row[j0 / bl] * bl * HD + h / group * D + d0;
                    int64_t jn = L - j0 < bl ? L - j0 : bl;
                    for (int64_t i = j0 < lo ? lo - j0 : 0; i < jn; i++) {
                        v8 x0, x1, x2, x3, wj = {0};
                        wj += wh[j0 + i];
                        KLOAD8(x0, vb + i * HD);
                        KLOAD8(x1, vb + i * HD + 8);
                        KLOAD8(x2, vb + i * HD + 16);
                        KLOAD8(x3, vb + i * HD + 24);
                        o0 += wj * x0;
                        o1 += wj * x1;
                        o2 += wj * x2;
                        o3 += wj * x3;
                    }
                }
                memcpy(oh + d0, &o0, sizeof o0);
                memcpy(oh + d0 + 8, &o1, sizeof o1);
                memcpy(oh + d0 + 16, &o2, sizeof o2);
                memcpy(oh + d0 + 24, &o3, sizeof o3);
            }
            for (; d0 < D; d0++) {
                float sd = 0;
                for (int64_t j0 = lo / bl * bl; j0 < L; j0 += bl) {
                    const KT *vb = (const KT *)k->v + (int64_t)row[j0 / bl] * bl * HD + h / group * D + d0;
                    int64_t jn = L - j0 < bl ? L - j0 : bl;
                    for (int64_t i = j0 < lo ? lo - j0 : 0; i < jn; i++) sd += wh[j0 + i] * KSCALAR(vb[i * HD]);
                }
                oh[d0] = sd;
            }
        }
    }
    free(w);
}

#undef PCAT_
#undef PCAT
#undef PFN
#undef KLOAD8
#undef KSCALAR
#undef PSFX
#undef PATTR
