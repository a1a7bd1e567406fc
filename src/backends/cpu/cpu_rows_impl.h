/* matmul_rows' inner kernels, written once for a vector type RV of RW floats and
 * included by cpu_paged.c for each lane count (RV, RSFX, RLANES_SUM, RATTR defined
 * there). Each element is summed in RW lanes over K (lane l takes k = l mod RW), the
 * lanes added in RLANES_SUM's fixed tree, then the tail in order. */
#define RCAT_(a, b) a##_##b
#define RCAT(a, b) RCAT_(a, b)
#define RFN(name) RCAT(name, RSFX)
#define RW ((int64_t)(sizeof(RV) / sizeof(float)))
#define RLOAD(dst, p) memcpy(&(dst), (p), sizeof(RV))

/* out[r][j] = x[r] . w[j] for two rows of x and four of w. */
RATTR static void RFN(dot_2x4)(const float *const *x, const float *const *w, int64_t K, float out[2][4])
{
    int64_t KL = K / RW * RW;
    RV a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    for (int64_t i = 0; i < KL; i += RW) {
        RV x0, x1, w0, w1, w2, w3;
        RLOAD(x0, x[0] + i);
        RLOAD(x1, x[1] + i);
        RLOAD(w0, w[0] + i);
        RLOAD(w1, w[1] + i);
        RLOAD(w2, w[2] + i);
        RLOAD(w3, w[3] + i);
        a00 += x0 * w0;
        a01 += x0 * w1;
        a02 += x0 * w2;
        a03 += x0 * w3;
        a10 += x1 * w0;
        a11 += x1 * w1;
        a12 += x1 * w2;
        a13 += x1 * w3;
    }
    RV acc[2][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}};
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) {
            float s = RLANES_SUM(acc[r][j]);
            for (int64_t i = KL; i < K; i++) s += x[r][i] * w[j][i];
            out[r][j] = s;
        }
}

/* The same sums for one row of x: an odd last row, summed exactly as dot_2x4 would. */
RATTR static void RFN(dot_1x4)(const float *x, const float *const *w, int64_t K, float out[4])
{
    int64_t KL = K / RW * RW;
    RV a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t i = 0; i < KL; i += RW) {
        RV x0, w0, w1, w2, w3;
        RLOAD(x0, x + i);
        RLOAD(w0, w[0] + i);
        RLOAD(w1, w[1] + i);
        RLOAD(w2, w[2] + i);
        RLOAD(w3, w[3] + i);
        a0 += x0 * w0;
        a1 += x0 * w1;
        a2 += x0 * w2;
        a3 += x0 * w3;
    }
    RV acc[4] = {a0, a1, a2, a3};
    for (int j = 0; j < 4; j++) {
        float s = RLANES_SUM(acc[j]);
        for (int64_t i = KL; i < K; i++) s += x[i] * w[j][i];
        out[j] = s;
    }
}

#if RQUAD
/* Four rows of x and four of w: sixteen sums in flight, half the loads per product of
 * dot_2x4 (for the 32-register lane width only). */
RATTR static void RFN(dot_4x4)(const float *const *x, const float *const *w, int64_t K, float out[4][4])
{
    int64_t KL = K / RW * RW;
    RV a[4][4] = {{{0}}};
    for (int64_t i = 0; i < KL; i += RW) {
        RV w0, w1, w2, w3;
        RLOAD(w0, w[0] + i);
        RLOAD(w1, w[1] + i);
        RLOAD(w2, w[2] + i);
        RLOAD(w3, w[3] + i);
        for (int r = 0; r < 4; r++) {
            RV xr;
            RLOAD(xr, x[r] + i);
            a[r][0] += xr * w0;
            a[r][1] += xr * w1;
            a[r][2] += xr * w2;
            a[r][3] += xr * w3;
        }
    }
    RQUAD_REDUCE(a, out);
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) {
            float s = out[r][j];
            for (int64_t i = KL; i < K; i++) s += x[r][i] * w[j][i];
            out[r][j] = s;
        }
}
#endif

#undef RCAT_
#undef RCAT
#undef RFN
#undef RW
#undef RLOAD
