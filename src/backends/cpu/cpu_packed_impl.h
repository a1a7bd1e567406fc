/* matmul_rows_packed's kernel, written once for a vector type KV and included by
 * cpu_paged.c for each lane count (KV, KATTR, KGROUP, KMR, KBCAST, defined there for
 * both weight types) and weight type (KSFX, KWT the packed weights' element type and
 * KLOADW(v, p) loading KW of them into v as floats, undefined at the end; and KINL,
 * the tile's qualifier where KLOADW needs a target's intrinsics, else always_inline).
 * The
 * weights come as panels of KILN_ROWS_PANEL output columns stored k-major, so a tile of
 * KMR rows by KGROUP panels keeps its sums in registers while the panels stream by:
 * for each k, a row's a[m][k] is broadcast and multiplied into every column vector.
 * Each output element is one chain of multiply-adds over k in order, whatever the tile
 * (rows go in tiles of KMR, 4, 2, 1), the panel group or the thread. */
#define KCAT_(a, b) a##_##b
#define KCAT(a, b) KCAT_(a, b)
#define KFN(name) KCAT(name, KSFX)
#define KW ((int)(sizeof(KV) / sizeof(float)))
#define KVP (KILN_ROWS_PANEL / KW) /* vectors per panel */
#define KMAXV (KGROUP * KVP)
#ifndef KINL
#define KINL static inline __attribute__((always_inline))
#endif

/* t[r][0 .. NV*KW) for MR rows of a: MR and NV are constants at every call, so the
 * loops unroll and acc lives in registers. */
KINL void KFN(tile)(int MR, int NV, const float *a, int64_t K, const KWT *const *col, float *t)
{
    KV acc[KMR][KMAXV];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 6
        for (int j = 0; j < NV; j++) acc[r][j] = (KV){0};
    for (int64_t k = 0; k < K; k++) {
        KV w[KMAXV];
#pragma GCC unroll 6
        for (int j = 0; j < NV; j++) KLOADW(w[j], col[j] + k * KILN_ROWS_PANEL);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            float s = a[r * K + k];
            KV x = KBCAST(s);
#pragma GCC unroll 6
            for (int j = 0; j < NV; j++) acc[r][j] += x * w[j];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 6
        for (int j = 0; j < NV; j++) memcpy(t + r * KMAXV * KW + j * KW, &acc[r][j], sizeof(KV));
}

KATTR static void KFN(packed_range)(void *c, int64_t b, int64_t e)
{
    const packed_ctx *k = c;
    int64_t K = k->K, N = k->N;
    float t[KMR * KMAXV * KW];
    for (int64_t g = b; g < e; g++) {
        int64_t p0 = g * KGROUP, np = k->P - p0 < KGROUP ? k->P - p0 : KGROUP, c0 = p0 * KILN_ROWS_PANEL;
        int nv = (int)np * KVP;
        int64_t nc = N - c0 < np * KILN_ROWS_PANEL ? N - c0 : np * KILN_ROWS_PANEL;
        const KWT *col[KMAXV];
        for (int j = 0; j < nv; j++) col[j] = (const KWT *)k->w + (p0 + j / KVP) * K * KILN_ROWS_PANEL + (j % KVP) * KW;
        for (int64_t m = 0; m < k->M;) {
            int64_t left = k->M - m;
            int mr = left >= KMR ? KMR : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const float *am = k->a + m * K;
#define KT(MR, NV) else if (mr == MR && nv == NV) KFN(tile)(MR, NV, am, K, col, t);
#if KMR > 4
#define KT8(NV) KT(8, NV)
#else
#define KT8(NV)
#endif
#define KT_ROWS(NV) KT(1, NV) KT(2, NV) KT(4, NV) KT8(NV)
            if (0) {
            }
            KT_ROWS(KVP)
#if KGROUP > 1
            KT_ROWS(2 * KVP)
#endif
#if KGROUP > 2
            KT_ROWS(3 * KVP)
#endif
#undef KT
#undef KT8
#undef KT_ROWS
            for (int r = 0; r < mr; r++) memcpy(k->out + (m + r) * N + c0, t + r * KMAXV * KW, sizeof(float) * (size_t)nc);
            m += mr;
        }
    }
}

#undef KCAT_
#undef KCAT
#undef KFN
#undef KW
#undef KVP
#undef KMAXV
#undef KSFX
#undef KWT
#undef KLOADW
#undef KINL
