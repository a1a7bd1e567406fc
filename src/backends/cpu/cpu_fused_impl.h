/* Fused kernels, written once for a real type R and included for float and double by
 * cpu_fused.c (R, SFX defined there). Inputs are contiguous here. Sums run in double
 * for both types; each output row is computed by one thread in a fixed order. */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

/* A dot product with independent partial sums, which the compiler vectorizes without
 * reassociating a single accumulator. */
static inline double FN(dot)(const R *a, const R *b, int64_t n)
{
    R acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    double s = 0;
    for (int l = 0; l < 8; l++) s += acc[l];
    for (; i < n; i++) s += (double)a[i] * b[i];
    return s;
}


/* Row loops of softmax-like kernels in 16 independent lanes, so they vectorize: the
 * maximum is exact in any order, and a sum adds each lane in order and then the lanes
 * in order, so results do not depend on the thread count. */
#define ROW_LANES 16

/* The maximum of a row's first nk entries, in a buffer row of cap >= nk: the lanes run
 * whole blocks while they start below nk and fit in cap, masking the entries past nk
 * (a causal row's last block), so only what is left of a short buffer row is scalar. */
static inline R FN(row_max)(const R *row, int64_t nk, int64_t cap)
{
    R mx[ROW_LANES];
    for (int l = 0; l < ROW_LANES; l++) mx[l] = -INFINITY;
    int64_t j = 0;
    for (; j < nk && j + ROW_LANES <= cap; j += ROW_LANES)
        for (int l = 0; l < ROW_LANES; l++) mx[l] = j + l < nk && row[j + l] > mx[l] ? row[j + l] : mx[l];
    R m = -INFINITY;
    for (int l = 0; l < ROW_LANES; l++) m = mx[l] > m ? mx[l] : m;
    for (; j < nk; j++) m = row[j] > m ? row[j] : m;
    return m;
}

/* The sum of exp(row[j] - m) over j < n, in double lanes; the row is not written. */
static inline double FN(row_expsum)(const R *row, int64_t n, R m, bool fast)
{
    double acc[ROW_LANES] = {0}, s = 0, t = 0;
    int64_t j = 0;
    if (fast)
        for (; j + ROW_LANES <= n; j += ROW_LANES)
            for (int l = 0; l < ROW_LANES; l++) acc[l] += FN(expr)(row[j + l] - m);
    for (; j < n; j++) s += fast ? FN(expr)(row[j] - m) : exp((double)row[j] - (double)m);
    for (int l = 0; l < ROW_LANES; l++) t += acc[l];
    return t + s;
}

/* ---- softmax / log_softmax over dim: x viewed as (outer, L, inner) ---- */
typedef struct {
    const R *x;
    R *y;
    int64_t L, inner;
    bool log;
} FN(sm_ctx);

KILN_SIMD static void FN(sm_range)(void *c, int64_t b, int64_t e)
{
    const FN(sm_ctx) *k = c;
    for (int64_t line = b; line < e; line++) {
        int64_t o = line / k->inner, in = line % k->inner, base = o * k->L * k->inner + in, st = k->inner;
        const R *x = k->x + base;
        R *y = k->y + base;
        double m = -INFINITY;
        for (int64_t j = 0; j < k->L; j++)
            if (x[j * st] > m || x[j * st] != x[j * st]) m = x[j * st];
        double s = 0;
        for (int64_t j = 0; j < k->L; j++) s += exp((double)x[j * st] - m);
        if (k->log) {
            double lse = m + log(s);
            for (int64_t j = 0; j < k->L; j++) y[j * st] = (R)((double)x[j * st] - lse);
        } else {
            double inv = 1.0 / s;
            for (int64_t j = 0; j < k->L; j++) y[j * st] = (R)(exp((double)x[j * st] - m) * inv);
        }
    }
}

static kiln_status FN(softmax)(const kiln_tensor_t *x, kiln_tensor_t *y, int dim, bool log)
{
    FN(sm_ctx) k = {kiln__data(x), kiln__data(y), x->ndim ? x->shape[dim] : 1, 1, log};
    int64_t outer = 1;
    for (int d = 0; d < dim; d++) outer *= x->shape[d];
    for (int d = dim + 1; d < x->ndim; d++) k.inner *= x->shape[d];
    int64_t lines = outer * k.inner;
    kiln__parallel_for(lines, k.L >= CPU_GRAIN ? 1 : CPU_GRAIN / (k.L ? k.L : 1), FN(sm_range), &k);
    return KILN_OK;
}

/* ---- layer norm and RMS norm over the last dim, x viewed as (N, C) ---- */
typedef struct {
    const R *x, *w, *b, *g;
    R *y, *mean, *rstd, *dx;
    double *part; /* per block: dw[C], db[C] */
    int64_t N, C;
    double eps;
    bool rms;
} FN(ln_ctx);

#define LN_BLOCK 32
#define LN_LANES 4

/* The sum over a row x of C of x (sq false) or of (x - mu)^2, in LN_LANES independent
 * partials (they vectorize), added in order. */
static inline double FN(ln_sum)(const R *x, int64_t C, double mu, bool sq)
{
    double s = 0, ls[LN_LANES] = {0};
    int64_t i0 = C - C % LN_LANES;
    for (int64_t i = 0; i < i0; i += LN_LANES)
        for (int l = 0; l < LN_LANES; l++) ls[l] += sq ? ((double)x[i + l] - mu) * ((double)x[i + l] - mu) : x[i + l];
    for (int l = 0; l < LN_LANES; l++) s += ls[l];
    for (int64_t i = i0; i < C; i++) s += sq ? ((double)x[i] - mu) * ((double)x[i] - mu) : x[i];
    return s;
}

KILN_SIMD static void FN(ln_fwd_range)(void *c, int64_t b, int64_t e)
{
    const FN(ln_ctx) *k = c;
    int64_t C = k->C;
    for (int64_t n = b; n < e; n++) {
        const R *x = k->x + n * C;
        R *y = k->y + n * C;
        double mu = k->rms ? 0 : FN(ln_sum)(x, C, 0, false) / (double)C;
        double rs = 1.0 / sqrt(FN(ln_sum)(x, C, mu, true) / (double)C + k->eps);
        R rsr = (R)rs, mur = (R)mu;
        if (k->rms)
            for (int64_t i = 0; i < C; i++) y[i] = x[i] * rsr * k->w[i];
        else
            for (int64_t i = 0; i < C; i++) y[i] = (x[i] - mur) * rsr * k->w[i] + k->b[i];
        if (!k->rms) k->mean[n] = (R)mu;
        k->rstd[n] = (R)rs;
    }
}

/* in: x, w, [b] -> y, [mean,] rstd */
static kiln_status FN(norm_fwd)(kiln_tensor_t *const *c, kiln_tensor_t *const *out, const kiln__attrs *a, bool rms)
{
    FN(ln_ctx) k = {.x = kiln__data(c[0]), .w = kiln__data(c[1]), .b = rms ? NULL : kiln__data(c[2]),
                    .y = kiln__data(out[0]), .mean = rms ? NULL : kiln__data(out[1]),
                    .rstd = kiln__data(out[rms ? 1 : 2]), .N = rows_of(c[0]), .C = last_dim(c[0]),
                    .eps = a->op.norm.eps, .rms = rms};
    kiln__parallel_for(k.N, CPU_GRAIN / (k.C ? k.C : 1) + 1, FN(ln_fwd_range), &k);
    return KILN_OK;
}

/* dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)); RMS norm drops the mean terms
 * of mu. dw, db are summed per block of LN_BLOCK rows, then over blocks in order. */
KILN_SIMD static void FN(ln_bwd_range)(void *c, int64_t bb, int64_t be)
{
    const FN(ln_ctx) *k = c;
    int64_t C = k->C;
    for (int64_t blk = bb; blk < be; blk++) {
        double *dw = k->part + blk * 2 * C, *db = dw + C;
        memset(dw, 0, sizeof(double) * 2 * (size_t)C);
        int64_t n1 = (blk + 1) * LN_BLOCK < k->N ? (blk + 1) * LN_BLOCK : k->N;
        for (int64_t n = blk * LN_BLOCK; n < n1; n++) {
            const R *x = k->x + n * C, *g = k->g + n * C;
            R *dx = k->dx + n * C;
            double mu = k->rms ? 0.0 : (double)k->mean[n], rs = k->rstd[n];
            double s1 = 0, s2 = 0, l1[LN_LANES] = {0}, l2[LN_LANES] = {0};
            int64_t i0 = C - C % LN_LANES;
            for (int64_t i = 0; i < i0; i += LN_LANES)
                for (int l = 0; l < LN_LANES; l++) {
                    double xh = ((double)x[i + l] - mu) * rs, gw = (double)g[i + l] * k->w[i + l];
                    l1[l] += gw;
                    l2[l] += gw * xh;
                    dw[i + l] += (double)g[i + l] * xh;
                    db[i + l] += g[i + l];
                }
            for (int l = 0; l < LN_LANES; l++) {
                s1 += l1[l];
                s2 += l2[l];
            }
            for (int64_t i = i0; i < C; i++) {
                double xh = ((double)x[i] - mu) * rs, gw = (double)g[i] * k->w[i];
                s1 += gw;
                s2 += gw * xh;
                dw[i] += (double)g[i] * xh;
                db[i] += g[i];
            }
            s1 /= (double)C;
            s2 /= (double)C;
            if (k->rms) s1 = 0;
            for (int64_t i = 0; i < C; i++) {
                double xh = ((double)x[i] - mu) * rs;
                dx[i] = (R)(rs * ((double)g[i] * k->w[i] - s1 - xh * s2));
            }
        }
    }
}

/* in: g, x, w, [mean,] rstd -> dx, dw, [db] */
static kiln_status FN(norm_bwd)(kiln_tensor_t *const *c, kiln_tensor_t *const *out, bool rms)
{
    FN(ln_ctx) k = {.g = kiln__data(c[0]), .x = kiln__data(c[1]), .w = kiln__data(c[2]),
                    .mean = rms ? NULL : kiln__data(c[3]), .rstd = kiln__data(c[rms ? 3 : 4]), .dx = kiln__data(out[0]),
                    .N = rows_of(c[1]), .C = last_dim(c[1]), .rms = rms};
    R *dw = kiln__data(out[1]), *db = rms ? NULL : kiln__data(out[2]);
    int64_t nblk = (k.N + LN_BLOCK - 1) / LN_BLOCK;
    k.part = malloc(sizeof(double) * 2 * (size_t)k.C * (size_t)(nblk ? nblk : 1));
    if (!k.part) return kiln__err(KILN_ERR_OOM, "norm backward: out of memory for partial sums");
    kiln__parallel_for(nblk, 1, FN(ln_bwd_range), &k);
    for (int64_t i = 0; i < k.C; i++) {
        double sw = 0, sb = 0;
        for (int64_t blk = 0; blk < nblk; blk++) {
            sw += k.part[blk * 2 * k.C + i];
            sb += k.part[blk * 2 * k.C + k.C + i];
        }
        dw[i] = (R)sw;
        if (db) db[i] = (R)sb;
    }
    free(k.part);
    return KILN_OK;
}

/* ---- cross-entropy: logits (N, V), targets (N) ---- */
typedef struct {
    const R *x;
    const void *t;
    kiln_dtype tdt;
    R *lse, *dx;
    double *loss;
    int64_t N, V, ignore;
    double gscale;
    bool fast; /* KILN_OPT_FAST_EXP for the f32 exponentials */
} FN(ce_ctx);

KILN_SIMD static void FN(ce_fwd_range)(void *c, int64_t b, int64_t e)
{
    const FN(ce_ctx) *k = c;
    for (int64_t n = b; n < e; n++) {
        const R *x = k->x + n * k->V;
        R mr = FN(row_max)(x, k->V, k->V);
        double m = mr, s = FN(row_expsum)(x, k->V, mr, k->fast);
        double lse = m + log(s);
        k->lse[n] = (R)lse;
        int64_t t = kiln__load_index((const char *)k->t + n * (int64_t)kiln_dtype_size(k->tdt), k->tdt);
        k->loss[n] = t == k->ignore ? 0.0 : lse - (double)x[t];
    }
}

KILN_SIMD static void FN(ce_bwd_range)(void *c, int64_t b, int64_t e)
{
    const FN(ce_ctx) *k = c;
    for (int64_t n = b; n < e; n++) {
        const R *x = k->x + n * k->V;
        R *dx = k->dx + n * k->V;
        int64_t t = kiln__load_index((const char *)k->t + n * (int64_t)kiln_dtype_size(k->tdt), k->tdt);
        if (t == k->ignore) {
            memset(dx, 0, sizeof(R) * (size_t)k->V);
            continue;
        }
        double lse = k->lse[n];
        if (k->fast) {
            R l = k->lse[n], gs = (R)k->gscale;
            for (int64_t v = 0; v < k->V; v++) dx[v] = gs * (R)FN(expr)(x[v] - l);
        } else {
            for (int64_t v = 0; v < k->V; v++) dx[v] = (R)(k->gscale * exp((double)x[v] - lse));
        }
        dx[t] -= (R)k->gscale;
    }
}

/* Cross-entropy of logits c[0] (N, V) and targets c[1] (count of them not ignored):
 * out[0] the mean loss, out[1] each row's log-sum-exp; loss (N) holds the rows' losses. */
static kiln_status FN(ce_fwd)(kiln_tensor_t *const *c, kiln_tensor_t *const *out, const kiln__attrs *a, int64_t count,
                              double *loss)
{
    int64_t N = c[0]->shape[0], V = c[0]->shape[1];
    FN(ce_ctx) k = {kiln__data(c[0]), kiln__data(c[1]), c[1]->dtype, kiln__data(out[1]), NULL, loss, N, V,
                    a->op.cross_entropy.ignore_index, 0, kiln__opt(KILN__OPT_FAST_EXP)};
    kiln__parallel_for(N, CPU_GRAIN / (V ? V : 1) + 1, FN(ce_fwd_range), &k);
    double sum = 0;
    for (int64_t i = 0; i < N; i++) sum += loss[i];
    *(R *)kiln__data(out[0]) = (R)(count ? sum / (double)count : NAN);
    return KILN_OK;
}

/* in: g (scalar, read as g), logits, targets, lse -> dx */
static kiln_status FN(ce_bwd)(kiln_tensor_t *const *c, kiln_tensor_t *const *out, const kiln__attrs *a, int64_t count,
                              double g)
{
    int64_t N = c[1]->shape[0], V = c[1]->shape[1];
    FN(ce_ctx) k = {kiln__data(c[1]), kiln__data(c[2]), c[2]->dtype, kiln__data(c[3]), kiln__data(out[0]), NULL, N, V,
                    a->op.cross_entropy.ignore_index, count ? g / (double)count : 0, kiln__opt(KILN__OPT_FAST_EXP)};
    kiln__parallel_for(N, CPU_GRAIN / (V ? V : 1) + 1, FN(ce_bwd_range), &k);
    return KILN_OK;
}

/* ---- rotary embedding: x (rows, D); row r uses angle row (r / per) % T of cs ---- */
typedef struct {
    const R *x;
    R *y;
    const double *cs; /* (T, D/2, 2): cos, sin */
    int64_t T, D;
    double sign;
    int64_t per; /* consecutive rows that share a position: 1 for rope, H for rope_at */
} FN(rope_ctx);

KILN_SIMD static void FN(rope_range)(void *c, int64_t b, int64_t e)
{
    const FN(rope_ctx) *k = c;
    int64_t h = k->D / 2;
    for (int64_t r = b; r < e; r++) {
        const R *x = k->x + r * k->D;
        R *y = k->y + r * k->D;
        const double *cs = k->cs + ((r / k->per) % k->T) * h * 2;
        for (int64_t i = 0; i < h; i++) {
            double co = cs[2 * i], si = k->sign * cs[2 * i + 1], x1 = x[i], x2 = x[i + h];
            y[i] = (R)(x1 * co - x2 * si);
            y[i + h] = (R)(x1 * si + x2 * co);
        }
    }
}

/* Rotates the rows of x (contiguous) into y with the angles cs; per rows share one. */
static kiln_status FN(rope)(const kiln_tensor_t *x, kiln_tensor_t *y, const double *cs, int64_t T, int64_t per,
                            double sign)
{
    int64_t D = x->shape[x->ndim - 1], rows = kiln__numel(x->ndim - 1, x->shape);
    FN(rope_ctx) k = {kiln__data(x), kiln__data(y), cs, T, D, sign, per};
    kiln__parallel_for(rows, CPU_GRAIN / D + 1, FN(rope_range), &k);
    return KILN_OK;
}

/* ---- attention: q (B,H,Tq,D), k, v (B,Hkv,Tk,D), o (B,H,Tq,D), lse (B,H,Tq) ---- */
typedef struct {
    const R *q, *k, *v, *o, *g, *lse_in;
    R *out, *lse, *dq, *dk, *dv;
    int64_t B, H, Hkv, Tq, Tk, D;
    /* Strides (elements) of dims 0-2 of the inputs q, k, v, g, o: their rows need only
     * be contiguous (the heads of a fused qkv projection are read where they lie). The
     * outputs are contiguous. */
    int64_t qs[3], ks[3], vs[3], gs[3], os[3];
    double scale;
    bool causal;
    atomic_int oom; /* a task could not get its tile buffer */
    bool fast;      /* KILN_OPT_FAST_EXP for the f32 exponentials */
    bool kt;        /* KILN_OPT_ATT_KT: Q K^T and dO V^T on transposed copies of K and V */
} FN(att_ctx);

/* dst (D, T), row stride T = src (T, D) with row stride ld: in 8x8 AVX register blocks
 * where transpose_fast takes it, else in 16x16 blocks. The BLAS runs A B (NN) on these
 * tiles about 1.6x faster than A B^T (NT). */
static void FN(att_transpose)(R *dst, const R *src, int64_t T, int64_t D, int64_t ld)
{
    if (FN(transpose_fast)(dst, src, T, D, ld)) return;
    for (int64_t j0 = 0; j0 < T; j0 += 16)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            int64_t j1 = j0 + 16 < T ? j0 + 16 : T, d1 = d0 + 16 < D ? d0 + 16 : D;
            for (int64_t j = j0; j < j1; j++)
                for (int64_t d = d0; d < d1; d++) dst[d * T + j] = src[j * ld + d];
        }
}

/* S (rows, nblk) = scale A B^T, with B (nblk, D) given as itself (ld ldb), as the
 * panels of its transpose (pan: kiln__cpu_att_panels_wanted_f32) or, when Bt is set, as its
 * transpose Bt (D, Tk). */
static inline void FN(att_abt)(int64_t rows, int64_t nblk, int64_t D, R scale, const R *A, int64_t lda, const R *B,
                               int64_t ldb, const kiln__gemm_panels *pan, const R *Bt, int64_t Tk, R *S)
{
    if (CAT(kiln__cpu_att_gemm, SFX)(rows, nblk, D, A, lda, pan, 0, 0, scale, 0, S, nblk)) return;
    if (Bt)
        GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)nblk, (int)D, scale, A, (int)lda, Bt, (int)Tk, 0,
             S, (int)nblk);
    else
        GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)nblk, (int)D, scale, A, (int)lda, B, (int)ldb, 0,
             S, (int)nblk);
}

static inline int64_t FN(att_keys)(const FN(att_ctx) *a, int64_t i)
{
    if (!a->causal) return a->Tk;
    int64_t n = i + (a->Tk - a->Tq) + 1;
    return n < a->Tk ? n : a->Tk;
}

/* Attention by tiles of QB query rows on the BLAS (f32: kiln__cpu_sgemm, the BLAS or
 * kiln's own GEMM), one task per (batch, head) in the
 * forward and per (batch, kv head) in the backward: a tile's scores (QB, Tk) live in a
 * per-task buffer, so the (B,H,Tq,Tk) matrix never exists; a backward task owns dK and
 * dV of its kv head, so no two tasks write one gradient and sums keep a fixed order. */
#define ATT_QB 64

/* row[j] = exp(row[j] - m) for j < nk, 0 past nk in the blocks the lanes ran (as in
 * row_max); returns the sum (double lanes, in order). */
static inline double FN(att_row_exp)(R *row, int64_t nk, int64_t cap, R m, bool fast)
{
    double acc[ROW_LANES] = {0};
    int64_t j = 0;
    if (fast) {
        for (; j < nk && j + ROW_LANES <= cap; j += ROW_LANES)
            for (int l = 0; l < ROW_LANES; l++) {
                R e = (R)FN(expr)(row[j + l] - m);
                row[j + l] = j + l < nk ? e : 0;
                acc[l] += row[j + l];
            }
    }
    double s = 0;
    for (; j < nk; j++) {
        row[j] = (R)(fast ? FN(expr)(row[j] - m) : exp((double)row[j] - (double)m));
        s += row[j];
    }
    double t = 0;
    for (int l = 0; l < ROW_LANES; l++) t += acc[l];
    return t + s;
}

static inline void FN(att_softmax_rows)(const FN(att_ctx) *a, int64_t i0, int64_t rows, int64_t nblk, R *S,
                                         const R *lse_in, R *lse_out, bool fast)
{
    for (int64_t r = 0; r < rows; r++) {
        R *row = S + r * nblk;
        int64_t nk = FN(att_keys)(a, i0 + r);
        if (lse_in) { /* backward: P from the saved log-sum-exp */
            (void)FN(att_row_exp)(row, nk, nblk, lse_in[r], fast);
        } else {
            R m = FN(row_max)(row, nk, nblk);
            double l = FN(att_row_exp)(row, nk, nblk, m, fast);
            R inv = (R)(nk ? 1.0 / l : 0.0);
            for (int64_t j = 0; j < nk; j++) row[j] *= inv;
            lse_out[r] = nk ? (R)((double)m + log(l)) : (R)-INFINITY;
        }
        for (int64_t j = nk; j < nblk; j++) row[j] = 0;
    }
}

KILN_SIMD static void FN(att_fwd_range)(void *c, int64_t b, int64_t e)
{
    FN(att_ctx) *a = c;
    int64_t D = a->D, grp = a->H / a->Hkv, Tk = a->Tk;
    /* K^T and V packed into kiln's GEMM's panels once per kv head, straight from K and V;
     * else, with KILN_OPT_ATT_KT, K transposed into Kt for the BLAS */
    const bool want = CAT(kiln__cpu_att_panels_wanted, SFX)(0);
    kiln__cpu_att_panels kp = {0};
    bool pan = false;
    R *S = malloc(sizeof(R) * (size_t)((ATT_QB + (a->kt ? D : 0)) * (Tk ? Tk : 1)));
    if (!S) {
        atomic_store(&a->oom, 1);
        return;
    }
    R *Kt = a->kt ? S + ATT_QB * Tk : NULL;
    int64_t kt_of = -1; /* the kv head the panels or Kt hold: query heads of one group run in a row */
    bool fast = a->fast;
    for (int64_t t = b; t < e; t++) {
        int64_t bb = t / a->H, h = t % a->H, hk = h / grp;
        const R *K = a->k + bb * a->ks[0] + hk * a->ks[1], *V = a->v + bb * a->vs[0] + hk * a->vs[1];
        if ((want || Kt) && kt_of != bb * a->Hkv + hk) {
            kt_of = bb * a->Hkv + hk;
            pan = want && CAT(kiln__cpu_att_pack_fwd, SFX)(&kp, K, a->ks[2], V, a->vs[2], Tk, D);
            if (Kt && !pan) FN(att_transpose)(Kt, K, Tk, D, a->ks[2]);
        }
        for (int64_t i0 = 0; i0 < a->Tq; i0 += ATT_QB) {
            int64_t rows = a->Tq - i0 < ATT_QB ? a->Tq - i0 : ATT_QB;
            int64_t nblk = FN(att_keys)(a, i0 + rows - 1);
            const R *Q = a->q + bb * a->qs[0] + h * a->qs[1] + i0 * a->qs[2];
            R *O = a->out + (t * a->Tq + i0) * D;
            if (nblk == 0) {
                memset(O, 0, sizeof(R) * (size_t)(rows * D));
                for (int64_t r = 0; r < rows; r++) a->lse[t * a->Tq + i0 + r] = (R)-INFINITY;
                continue;
            }
            /* (with the panels, Kt is not made: a product on them that fails reads K) */
            FN(att_abt)(rows, nblk, D, (R)a->scale, Q, a->qs[2], K, a->ks[2], pan ? &kp.kt : NULL, pan ? NULL : Kt,
                        Tk, S);
            FN(att_softmax_rows)(a, i0, rows, nblk, S, NULL, a->lse + t * a->Tq + i0, fast);
            if (!CAT(kiln__cpu_att_gemm, SFX)(rows, D, nblk, S, nblk, pan ? &kp.v : NULL, 0, 0, 1, 0, O, D))
                GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)D, (int)nblk, 1, S, (int)nblk, V,
                     (int)a->vs[2], 0, O, (int)D);
        }
    }
    kiln__cpu_att_panels_free(&kp);
    free(S);
}

KILN_SIMD static void FN(att_bwd_range)(void *c, int64_t b, int64_t e)
{
    FN(att_ctx) *a = c;
    int64_t D = a->D, grp = a->H / a->Hkv, Tk = a->Tk;
    /* K^T, V^T and K packed into kiln's GEMM's panels once per kv head, straight from K
     * and V; else, with KILN_OPT_ATT_KT, K and V transposed into Kt and Vt for the BLAS */
    const bool want = CAT(kiln__cpu_att_panels_wanted, SFX)(0);
    kiln__cpu_att_panels kp = {0};
    R *P = malloc(sizeof(R) * (size_t)((2 * ATT_QB + (a->kt ? 2 * D : 0)) * (Tk ? Tk : 1)));
    if (!P) {
        atomic_store(&a->oom, 1);
        return;
    }
    R *dP = P + ATT_QB * Tk, *Kt = a->kt ? dP + ATT_QB * Tk : NULL, *Vt = Kt ? Kt + D * Tk : NULL;
    bool fast = a->fast;
    for (int64_t t = b; t < e; t++) {
        int64_t bb = t / a->Hkv, hk = t % a->Hkv;
        const R *K = a->k + bb * a->ks[0] + hk * a->ks[1], *V = a->v + bb * a->vs[0] + hk * a->vs[1];
        R *dK = a->dk + t * Tk * D, *dV = a->dv + t * Tk * D;
        const bool pan = want && CAT(kiln__cpu_att_pack_bwd, SFX)(&kp, K, a->ks[2], V, a->vs[2], Tk, D);
        if (Kt && !pan) {
            FN(att_transpose)(Kt, K, Tk, D, a->ks[2]);
            FN(att_transpose)(Vt, V, Tk, D, a->vs[2]);
        }
        memset(dK, 0, sizeof(R) * (size_t)(Tk * D));
        memset(dV, 0, sizeof(R) * (size_t)(Tk * D));
        for (int64_t h = hk * grp; h < (hk + 1) * grp; h++) {
            int64_t qh = bb * a->H + h;
            for (int64_t i0 = 0; i0 < a->Tq; i0 += ATT_QB) {
                int64_t rows = a->Tq - i0 < ATT_QB ? a->Tq - i0 : ATT_QB;
                int64_t nblk = FN(att_keys)(a, i0 + rows - 1), base = (qh * a->Tq + i0) * D;
                const R *Q = a->q + bb * a->qs[0] + h * a->qs[1] + i0 * a->qs[2];
                const R *G = a->g + bb * a->gs[0] + h * a->gs[1] + i0 * a->gs[2];
                const R *O = a->o + bb * a->os[0] + h * a->os[1] + i0 * a->os[2];
                int64_t ldq = a->qs[2], ldg = a->gs[2], ldk = a->ks[2], ldv = a->vs[2];
                R *dQ = a->dq + base;
                if (nblk == 0) {
                    memset(dQ, 0, sizeof(R) * (size_t)(rows * D));
                    continue;
                }
                FN(att_abt)(rows, nblk, D, (R)a->scale, Q, ldq, K, ldk, pan ? &kp.kt : NULL, pan ? NULL : Kt, Tk, P);
                FN(att_softmax_rows)(a, i0, rows, nblk, P, a->lse_in + qh * a->Tq + i0, NULL, fast);
                /* dV += P^T dO; dP = dO V^T */
                GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nblk, (int)D, (int)rows, 1, P, (int)nblk, G,
                     (int)ldg, 1, dV, (int)D);
                FN(att_abt)(rows, nblk, D, 1, G, ldg, V, ldv, pan ? &kp.vt : NULL, pan ? NULL : Vt, Tk, dP);
                /* scale dS = scale P * (dP - rowsum(dO * O)), in place in dP: scaled here, so
                 * that dK's accumulating product has alpha 1 (kiln's GEMM adds it in place) */
                const R sc = (R)a->scale;
                for (int64_t r = 0; r < rows; r++) {
                    R Di = (R)FN(dot)(G + r * ldg, O + r * a->os[2], D);
                    R *pr = P + r * nblk, *dr = dP + r * nblk;
                    for (int64_t j = 0; j < nblk; j++) dr[j] = pr[j] * (dr[j] - Di) * sc;
                }
                /* dQ = (scale dS) K; dK += (scale dS)^T Q */
                if (!CAT(kiln__cpu_att_gemm, SFX)(rows, D, nblk, dP, nblk, pan ? &kp.k : NULL, 0, 0, 1, 0, dQ, D))
                    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)D, (int)nblk, 1, dP, (int)nblk, K,
                         (int)ldk, 0, dQ, (int)D);
                GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nblk, (int)D, (int)rows, 1, dP, (int)nblk, Q, (int)ldq,
                     1, dK, (int)D);
            }
        }
    }
    kiln__cpu_att_panels_free(&kp);
    free(P);
}

/* Attention forward (c: q, k, v -> out: o, lse) or backward (c: g, q, k, v, o, lse ->
 * out: dq, dk, dv); false when a task had no memory for its buffer. */
static bool FN(att)(kiln_tensor_t *const *c, kiln_tensor_t *const *out, const kiln__attrs *a, bool bwd)
{
    const kiln_tensor_t *q = c[bwd], *kk = c[bwd + 1], *vv = c[bwd + 2];
    FN(att_ctx) k = {.q = kiln__data(q), .k = kiln__data(kk), .v = kiln__data(vv), .B = q->shape[0], .H = q->shape[1],
                     .Hkv = kk->shape[1], .Tq = q->shape[2], .Tk = kk->shape[2], .D = q->shape[3],
                     .scale = a->op.attention.scale, .causal = a->op.attention.causal,
                     .fast = kiln__opt(KILN__OPT_FAST_EXP), .kt = kiln__opt(KILN__OPT_ATT_KT)};
    strides3(q, k.qs);
    strides3(kk, k.ks);
    strides3(vv, k.vs);
    if (bwd) {
        k.g = kiln__data(c[0]);
        k.o = kiln__data(c[4]);
        strides3(c[0], k.gs);
        strides3(c[4], k.os);
        k.lse_in = kiln__data(c[5]);
        k.dq = kiln__data(out[0]);
        k.dk = kiln__data(out[1]);
        k.dv = kiln__data(out[2]);
        att_run(k.B * k.Hkv, FN(att_bwd_range), &k);
    } else {
        k.out = kiln__data(out[0]);
        k.lse = kiln__data(out[1]);
        att_run(k.B * k.H, FN(att_fwd_range), &k);
    }
    return !atomic_load(&k.oom);
}

#undef FN
#undef CAT
#undef CAT_
