/* The OpenCL backend's own kernels: what the compiler's lowering does not cover.
 * Embedded into kiln at build time (cmake/embed.cmake) as kiln__opencl_kernel_source,
 * built once per device on first use (opencl_ops.c, kiln__opencl_builtin()).
 *
 * Written by hand because no OpenCL library on Debian does batched strided GEMM with
 * kiln's layouts (clBLAS is unmaintained): a tiled matmul over up to 4 broadcast batch
 * dims (f32, and bf16 stored as 16-bit values), and the in-place updates (add_, scale_, adamw_) the lowering leaves out.
 * The mixture-of-experts routing ops (topk, moe_sort, the grouped matmul, whose host
 * side is opencl_moe.c) are at the end.
 *
 * Every buffer argument is a (__global char *, ulong byte offset) pair: the host passes
 * an OpenCL buffer and the offset inside it of the tensor's first element. BUF(x) is
 * that pair, gx and ox; AT(T, x) is the tensor's first element as a T pointer. */
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#define BUF(x) __global char *g##x, ulong o##x
#define AT(T, x) ((__global T *)(g##x + o##x))
/* The bits a kernel raises in the device's error word (opencl_impl.h's KILN__CL_ERR_*):
 * an index or target, an expert index, a grouped matmul's offsets. */
#define ERR_INDEX 1
#define ERR_EXPERT 2
#define ERR_OFFSETS 4

/* Batch bt's element offsets into A (.x) and B (.y): its index split over the batch
 * dims (sizes d1..d3 inside, the rest outermost), each with its stride in A and in B
 * (0 where that operand is broadcast). C is dense, batch after batch. */
inline long2 batch_offsets(long bt, long d1, long d2, long d3, long a0, long a1, long a2, long a3, long b0, long b1,
                           long b2, long b3)
{
    long r = bt;
    const long i3 = r % d3; r /= d3;
    const long i2 = r % d2; r /= d2;
    const long i1 = r % d1; r /= d1;
    const long i0 = r;
    return (long2)(i0 * a0 + i1 * a1 + i2 * a2 + i3 * a3, i0 * b0 + i1 * b1 + i2 * b2 + i3 * b3);
}

/* The matmul kernels' parameters, and their operands A, B and C (of element type T) of
 * batch bt. */
#define MATMUL_PARAMS                                                                                   \
    BUF(a), BUF(b), BUF(c), long M, long N, long K, long sam, long sak, long sbk, long sbn, long d1, long d2, \
        long d3, long a0, long a1, long a2, long a3, long b0, long b1, long b2, long b3
#define MATMUL_OPERANDS_T(bt, T)                                                                        \
    const long2 at = batch_offsets(bt, d1, d2, d3, a0, a1, a2, a3, b0, b1, b2, b3);                      \
    __global const T *A = AT(const T, a) + at.x, *B = AT(const T, b) + at.y;                           \
    __global T *C = AT(T, c) + bt * M * N
#define MATMUL_OPERANDS(bt) MATMUL_OPERANDS_T(bt, float)

/* bf16 as stored 16-bit values: widened exactly on load, rounded to nearest even (a NaN
 * kept quiet) on store, as kiln__f32_to_bf16 (src/core/dtype.h) rounds. */
inline float bf16_ld(ushort h) { return as_float((uint)h << 16); }
inline ushort bf16_st(float f)
{
    uint x = as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (ushort)((x >> 16) | 0x40u);
    return (ushort)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
/* LD(p, i): element i of p as a float; ST(p, i, v): v stored as element i. f16 goes
 * through the core vload_half / vstore_half_rte (nearest even), which need no
 * cl_khr_fp16. */
#define F32_LD(p, i) ((p)[i])
#define F32_ST(p, i, v) ((p)[i] = (v))
#define BF16_LD(p, i) bf16_ld((p)[i])
#define BF16_ST(p, i, v) ((p)[i] = bf16_st(v))
#define F16_LD(p, i) vload_half((i), (p))
#define F16_ST(p, i, v) vstore_half_rte((v), (i), (p))

/* 64x64 output tiles per 16x16 work-group, each work-item a 4x4 block of them held
 * in registers; A and B tiles of depth 16 staged in local memory, as floats. Written
 * once for element type T, loaded by LD and stored by ST: f32, and bf16 and f16 (the
 * products of their values summed in f32, each result rounded once). */
#define TM 64
#define TK 16
#define WPT 4
#define MATMUL_TILED(NAME, T, LD, ST)                                                                   \
    __kernel __attribute__((reqd_work_group_size(16, 16, 1))) void NAME(MATMUL_PARAMS)                  \
    {                                                                                                   \
        const int lr = get_local_id(1), lc = get_local_id(0);                                           \
        const long row0 = get_group_id(1) * TM, col0 = get_group_id(0) * TM, bt = get_global_id(2);     \
        MATMUL_OPERANDS_T(bt, T);                                                                       \
        __local float As[TK][TM], Bs[TK][TM];                                                           \
        float acc[WPT][WPT];                                                                            \
        for (int i = 0; i < WPT; i++)                                                                   \
            for (int j = 0; j < WPT; j++) acc[i][j] = 0.0f;                                             \
        const int tid = lr * 16 + lc;                                                                   \
        for (long t = 0; t < K; t += TK) {                                                              \
            for (int q = tid; q < TK * TM; q += 256) {                                                  \
                const int kk = q / TM, mm = q % TM;                                                     \
                const long gm = row0 + mm, gk = t + kk, gn = col0 + mm;                                 \
                As[kk][mm] = gm < M && gk < K ? LD(A, gm * sam + gk * sak) : 0.0f;                      \
                Bs[kk][mm] = gk < K && gn < N ? LD(B, gk * sbk + gn * sbn) : 0.0f;                      \
            }                                                                                           \
            barrier(CLK_LOCAL_MEM_FENCE);                                                               \
            for (int k = 0; k < TK; k++) {                                                              \
                float a[WPT], b[WPT];                                                                   \
                for (int i = 0; i < WPT; i++) a[i] = As[k][lr + 16 * i];                                \
                for (int j = 0; j < WPT; j++) b[j] = Bs[k][lc + 16 * j];                                \
                for (int i = 0; i < WPT; i++)                                                           \
                    for (int j = 0; j < WPT; j++) acc[i][j] = fma(a[i], b[j], acc[i][j]);               \
            }                                                                                           \
            barrier(CLK_LOCAL_MEM_FENCE);                                                               \
        }                                                                                               \
        for (int i = 0; i < WPT; i++)                                                                   \
            for (int j = 0; j < WPT; j++) {                                                             \
                const long gm = row0 + lr + 16 * i, gn = col0 + lc + 16 * j;                            \
                if (gm < M && gn < N) ST(C, gm * N + gn, acc[i][j]);                                    \
            }                                                                                           \
    }
MATMUL_TILED(kiln_matmul, float, F32_LD, F32_ST)
MATMUL_TILED(kiln_matmul_bf16, ushort, BF16_LD, BF16_ST)
MATMUL_TILED(kiln_matmul_f16, half, F16_LD, F16_ST)

/* KILN_OPT_CL_MATMUL_TILES=0: the first kernel, 16x16 tiles, one output each. */
__kernel __attribute__((reqd_work_group_size(16, 16, 1))) void kiln_matmul_simple(MATMUL_PARAMS)
{
    const int lr = get_local_id(1), lc = get_local_id(0);
    const long row = get_group_id(1) * 16 + lr, col = get_group_id(0) * 16 + lc, bt = get_global_id(2);
    MATMUL_OPERANDS(bt);
    __local float As[16][16], Bs[16][16];
    float acc = 0.0f;
    for (long t = 0; t < K; t += 16) {
        const long ka = t + lc, kb = t + lr;
        As[lr][lc] = row < M && ka < K ? A[row * sam + ka * sak] : 0.0f;
        Bs[lr][lc] = kb < K && col < N ? B[kb * sbk + col * sbn] : 0.0f;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int k = 0; k < 16; k++) acc = fma(As[lr][k], Bs[k][lc], acc);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (row < M && col < N) C[row * N + col] = acc;
}

/* Embedding rows and their gradient: each work-item of the gradient owns one column
 * and adds the rows in order, so the sum is the cpu's. Indices are checked on the
 * host before an eager launch; inside a command buffer (no host in between) a bad one
 * is clamped to 0 and raised in the device's error word, which a replay reads after
 * it runs. */
long kiln_index(__global const char *gi, ulong oi, long i, long idx64, long V, __global int *err)
{
    const long v = idx64 ? ((__global const long *)(gi + oi))[i] : (long)((__global const int *)(gi + oi))[i];
    if (v < 0 || v >= V) { atomic_or(err, ERR_INDEX); return 0; }
    return v;
}
__kernel void kiln_embedding(BUF(w), BUF(i), BUF(o), long C, long n, long V, long idx64, BUF(e))
{
    const long q = get_global_id(0);
    if (q >= n * C) return;
    const long v = kiln_index(gi, oi, q / C, idx64, V, AT(int, e));
    AT(float, o)[q] = AT(const float, w)[v * C + q % C];
}
__kernel void kiln_embedding_backward(BUF(g), BUF(i), BUF(d), long C, long N, long V, long idx64, BUF(e))
{
    const long c = get_global_id(0);
    if (c >= C) return;
    __global float *d = AT(float, d);
    for (long v = 0; v < V; v++) d[v * C + c] = 0.0f;
    for (long i = 0; i < N; i++) d[kiln_index(gi, oi, i, idx64, V, AT(int, e)) * C + c] += AT(const float, g)[i * C + c];
}

/* Cross-entropy rows in double, as the cpu's: the loss of each row (0 for an ignored
 * one) and its log-sum-exp; the rows that count by one work-item, in row order as the
 * cpu sums, for the mean (forward) or the upstream gradient over the count (backward),
 * both read on the device; the gradient from the log-sum-exp. A target outside [0, V)
 * (and not ignore) is raised in the error word and counts as ignored. */
long kiln_target(__global const char *gt, ulong ot, long n, long t64, long V, long ignore, __global int *err)
{
    const long t = t64 ? ((__global const long *)(gt + ot))[n] : (long)((__global const int *)(gt + ot))[n];
    if (t != ignore && (t < 0 || t >= V)) { atomic_or(err, ERR_INDEX); return ignore; }
    return t;
}
__kernel void kiln_ce_rows(BUF(x), BUF(t), BUF(l), BUF(rl), long N, long V, long ignore, long t64, BUF(e))
{
    const long n = get_global_id(0);
    if (n >= N) return;
    __global const float *x = AT(const float, x) + n * V;
    double m = -INFINITY, s = 0;
    for (long v = 0; v < V; v++) if (x[v] > m) m = x[v];
    for (long v = 0; v < V; v++) s += exp((double)x[v] - m);
    const double lse = m + log(s);
    AT(float, l)[n] = (float)lse;
    const long t = kiln_target(gt, ot, n, t64, V, ignore, AT(int, e));
    AT(double, rl)[n] = t == ignore ? 0.0 : lse - (double)x[t];
}
/* Forward: o (float) = the mean of the row losses rl (double), NaN for no row that
 * counts. Backward: o (double) = the gradient rl (float) over the count, 0 for none. */
__kernel void kiln_ce_count(BUF(rl), BUF(t), BUF(o), long N, long V, long ignore, long t64, BUF(e), long bwd)
{
    if (get_global_id(0) != 0) return;
    double sum = 0;
    long count = 0;
    for (long n = 0; n < N; n++) {
        if (!bwd) sum += AT(const double, rl)[n];
        count += kiln_target(gt, ot, n, t64, V, ignore, AT(int, e)) != ignore;
    }
    if (bwd) AT(double, o)[0] = count ? AT(const float, rl)[0] / (double)count : 0.0;
    else AT(float, o)[0] = (float)(count ? sum / (double)count : NAN);
}
__kernel void kiln_ce_backward(BUF(x), BUF(t), BUF(l), BUF(d), long N, long V, long ignore, long t64, BUF(e), BUF(s))
{
    const long q = get_global_id(0);
    if (q >= N * V) return;
    const long n = q / V, v = q % V;
    const long t = kiln_target(gt, ot, n, t64, V, ignore, AT(int, e));
    __global float *dx = AT(float, d);
    if (t == ignore) { dx[q] = 0.0f; return; }
    const double gscale = AT(const double, s)[0], lse = AT(const float, l)[n];
    float d = (float)(gscale * exp((double)AT(const float, x)[q] - lse));
    if (v == t) d -= (float)gscale;
    dx[q] = d;
}

/* Attention, one work-item per query row (forward, dQ) or key row (dK, dV): scores
 * recomputed from q and k, softmax online in the forward and from the saved
 * log-sum-exp in the backward; rows of at most ATT_D values in private memory, in
 * small work-groups (PoCL keeps a group's private arrays on one thread's stack:
 * 256 work-items of 2 KiB each overflowed it). Query i sees
 * keys j < i + (Tk - Tq) + 1 when causal. Heads share kv heads in groups of H / Hkv. */
#define ATT_D 128
#define ATT_DIMS long B, long H, long Hkv, long Tq, long Tk, long D, float scale, long causal
long att_keys(long i, long Tq, long Tk, long causal)
{
    if (!causal) return Tk;
    const long n = i + (Tk - Tq) + 1;
    return n < Tk ? n : Tk;
}
/* Written once for element type T of q, k, v, o and the gradients, loaded by LD and
 * stored by ST (the matmul's): f32, and bf16 and f16, computed on the values widened
 * and each output rounded once. The log-sum-exp is f32 in every case. */
#define ATTENTION_KERNELS(SFX, T, LD, ST)                                                               \
    __kernel void kiln_attention##SFX(BUF(q), BUF(k), BUF(v), BUF(o), BUF(l), ATT_DIMS)                \
    {                                                                                                   \
        const long row = get_global_id(0);                                                              \
        if (row >= B * H * Tq) return;                                                                  \
        const long i = row % Tq, bh = row / Tq, b = bh / H, h = bh % H, hk = h / (H / Hkv);            \
        __global const T *q = AT(const T, q) + row * D;                                                 \
        __global const T *K = AT(const T, k) + (b * Hkv + hk) * Tk * D;                                 \
        __global const T *V = AT(const T, v) + (b * Hkv + hk) * Tk * D;                                 \
        __global T *o = AT(T, o) + row * D;                                                             \
        float acc[ATT_D];                                                                               \
        for (long d = 0; d < D; d++) acc[d] = 0.0f;                                                     \
        float m = -INFINITY;                                                                            \
        double l = 0;                                                                                   \
        const long nk = att_keys(i, Tq, Tk, causal);                                                    \
        for (long j = 0; j < nk; j++) {                                                                 \
            float sc = 0.0f;                                                                            \
            for (long d = 0; d < D; d++) sc = fma(LD(q, d), LD(K, j * D + d), sc);                      \
            sc *= scale;                                                                                \
            if (sc > m) { /* a new maximum: what was summed is rescaled */                              \
                const float f = exp(m - sc);                                                            \
                l *= f;                                                                                 \
                for (long d = 0; d < D; d++) acc[d] *= f;                                               \
                m = sc;                                                                                 \
            }                                                                                           \
            const float p = exp(sc - m);                                                                \
            l += p;                                                                                     \
            for (long d = 0; d < D; d++) acc[d] = fma(p, LD(V, j * D + d), acc[d]);                     \
        }                                                                                               \
        const float inv = nk ? (float)(1.0 / l) : 0.0f;                                                 \
        for (long d = 0; d < D; d++) ST(o, d, acc[d] * inv);                                            \
        AT(float, l)[row] = nk ? (float)((double)m + log(l)) : -INFINITY;                               \
    }                                                                                                   \
                                                                                                        \
    /* dQ_i = scale sum_j dS_ij K_j, dS_ij = P_ij (dO_i . V_j - dO_i . O_i) */                         \
    __kernel void kiln_attention_dq##SFX(BUF(g), BUF(q), BUF(k), BUF(v), BUF(o), BUF(l), BUF(d), ATT_DIMS) \
    {                                                                                                   \
        const long row = get_global_id(0);                                                              \
        if (row >= B * H * Tq) return;                                                                  \
        const long i = row % Tq, bh = row / Tq, b = bh / H, h = bh % H, hk = h / (H / Hkv);            \
        __global const T *q = AT(const T, q) + row * D, *g = AT(const T, g) + row * D;                  \
        __global const T *o = AT(const T, o) + row * D;                                                 \
        __global const T *K = AT(const T, k) + (b * Hkv + hk) * Tk * D;                                 \
        __global const T *V = AT(const T, v) + (b * Hkv + hk) * Tk * D;                                 \
        const float lse = AT(const float, l)[row];                                                      \
        float Di = 0.0f, dq[ATT_D];                                                                     \
        for (long d = 0; d < D; d++) {                                                                  \
            Di = fma(LD(g, d), LD(o, d), Di);                                                           \
            dq[d] = 0.0f;                                                                               \
        }                                                                                               \
        const long nk = att_keys(i, Tq, Tk, causal);                                                    \
        for (long j = 0; j < nk; j++) {                                                                 \
            float sc = 0.0f, dp = 0.0f;                                                                 \
            for (long d = 0; d < D; d++) {                                                              \
                sc = fma(LD(q, d), LD(K, j * D + d), sc);                                               \
                dp = fma(LD(g, d), LD(V, j * D + d), dp);                                               \
            }                                                                                           \
            const float ds = exp(sc * scale - lse) * (dp - Di);                                         \
            for (long d = 0; d < D; d++) dq[d] = fma(ds, LD(K, j * D + d), dq[d]);                      \
        }                                                                                               \
        __global T *out = AT(T, d) + row * D;                                                           \
        for (long d = 0; d < D; d++) ST(out, d, dq[d] * scale);                                         \
    }                                                                                                   \
                                                                                                        \
    /* dK_j = scale sum_{h in group, i} dS_ij Q_i, dV_j = sum P_ij dO_i */                             \
    __kernel void kiln_attention_dkv##SFX(BUF(g), BUF(q), BUF(k), BUF(v), BUF(o), BUF(l), BUF(dk), BUF(dv), \
                                          ATT_DIMS)                                                     \
    {                                                                                                   \
        const long kr = get_global_id(0);                                                               \
        if (kr >= B * Hkv * Tk) return;                                                                 \
        const long j = kr % Tk, bhk = kr / Tk, b = bhk / Hkv, hk = bhk % Hkv, grp = H / Hkv;           \
        __global const T *k = AT(const T, k) + kr * D, *v = AT(const T, v) + kr * D;                    \
        float dk[ATT_D], dv[ATT_D];                                                                     \
        for (long d = 0; d < D; d++) {                                                                  \
            dk[d] = 0.0f;                                                                               \
            dv[d] = 0.0f;                                                                               \
        }                                                                                               \
        for (long h = hk * grp; h < (hk + 1) * grp; h++)                                                \
            for (long i = 0; i < Tq; i++) {                                                             \
                if (j >= att_keys(i, Tq, Tk, causal)) continue;                                         \
                const long row = (b * H + h) * Tq + i;                                                  \
                __global const T *q = AT(const T, q) + row * D, *g = AT(const T, g) + row * D;          \
                __global const T *o = AT(const T, o) + row * D;                                         \
                float sc = 0.0f, dp = 0.0f, Di = 0.0f;                                                  \
                for (long d = 0; d < D; d++) {                                                          \
                    sc = fma(LD(q, d), LD(k, d), sc);                                                   \
                    dp = fma(LD(g, d), LD(v, d), dp);                                                   \
                    Di = fma(LD(g, d), LD(o, d), Di);                                                   \
                }                                                                                       \
                const float p = exp(sc * scale - AT(const float, l)[row]), ds = p * (dp - Di);          \
                for (long d = 0; d < D; d++) {                                                          \
                    dv[d] = fma(p, LD(g, d), dv[d]);                                                    \
                    dk[d] = fma(ds, LD(q, d), dk[d]);                                                   \
                }                                                                                       \
            }                                                                                           \
        __global T *dko = AT(T, dk) + kr * D, *dvo = AT(T, dv) + kr * D;                                \
        for (long d = 0; d < D; d++) {                                                                  \
            ST(dko, d, dk[d] * scale);                                                                  \
            ST(dvo, d, dv[d]);                                                                          \
        }                                                                                               \
    }
ATTENTION_KERNELS(, float, F32_LD, F32_ST)
ATTENTION_KERNELS(_bf16, ushort, BF16_LD, BF16_ST)
ATTENTION_KERNELS(_f16, half, F16_LD, F16_ST)

/* Layer / RMS norm backward in double as the cpu's: dx a work-item per row; dw and
 * db a work-item per column, its rows summed in order. mean is unused for RMS. */
__kernel void kiln_norm_dx(BUF(g), BUF(x), BUF(w), BUF(m), BUF(rstd), BUF(d), long N, long C, long rms)
{
    const long n = get_global_id(0);
    if (n >= N) return;
    __global const float *g = AT(const float, g) + n * C, *x = AT(const float, x) + n * C, *w = AT(const float, w);
    const double mu = rms ? 0.0 : AT(const float, m)[n], rs = AT(const float, rstd)[n];
    double s1 = 0, s2 = 0;
    for (long i = 0; i < C; i++) {
        const double xh = ((double)x[i] - mu) * rs, gwv = (double)g[i] * w[i];
        s1 += gwv;
        s2 += gwv * xh;
    }
    s1 = rms ? 0.0 : s1 / (double)C;
    s2 /= (double)C;
    __global float *dx = AT(float, d) + n * C;
    for (long i = 0; i < C; i++) {
        const double xh = ((double)x[i] - mu) * rs;
        dx[i] = (float)(rs * ((double)g[i] * w[i] - s1 - xh * s2));
    }
}
__kernel void kiln_norm_dwb(BUF(g), BUF(x), BUF(m), BUF(rstd), BUF(dw), BUF(db), long N, long C, long rms)
{
    const long i = get_global_id(0);
    if (i >= C) return;
    double sw = 0, sb = 0;
    for (long n = 0; n < N; n++) {
        const double mu = rms ? 0.0 : AT(const float, m)[n];
        const double xh = ((double)AT(const float, x)[n * C + i] - mu) * AT(const float, rstd)[n];
        const float g = AT(const float, g)[n * C + i];
        sw += (double)g * xh;
        sb += g;
    }
    AT(float, dw)[i] = (float)sw;
    if (!rms) AT(float, db)[i] = (float)sb;
}

/* d += alpha s, in the element type T. */
#define ADD_(name, T)                                                                                 \
    __kernel void name(BUF(d), BUF(s), T alpha, long n)                                               \
    {                                                                                                 \
        const long i = get_global_id(0);                                                              \
        if (i < n) AT(T, d)[i] = fma(alpha, AT(const T, s)[i], AT(T, d)[i]);                          \
    }
ADD_(kiln_add_, float)
ADD_(kiln_add_f64_, double)

/* A copy between any two layouts of the same shape (up to 6 dims, element strides),
 * one element per work-item, es bytes each: what slicing's backward writes into a
 * strided view. */
__kernel void kiln_copy_nd(BUF(d), BUF(s), long n, long es, long nd, long n0, long n1, long n2, long n3, long n4,
                           long n5, long d0, long d1, long d2, long d3, long d4, long d5, long r0, long r1, long r2,
                           long r3, long r4, long r5)
{
    const long q = get_global_id(0);
    if (q >= n) return;
    const long sh[6] = {n0, n1, n2, n3, n4, n5}, ds[6] = {d0, d1, d2, d3, d4, d5}, rs[6] = {r0, r1, r2, r3, r4, r5};
    long rem = q, dofs = 0, sofs = 0;
    for (long d = nd - 1; d >= 0; d--) {
        const long i = rem % sh[d];
        rem /= sh[d];
        dofs += i * ds[d];
        sofs += i * rs[d];
    }
    __global char *dst = AT(char, d) + dofs * es;
    __global const char *src = AT(const char, s) + sofs * es;
    for (long b = 0; b < es; b++) dst[b] = src[b];
}
__kernel void kiln_scale_(BUF(d), float s, long n)
{
    const long i = get_global_id(0);
    if (i < n) AT(float, d)[i] = AT(float, d)[i] * s;
}
double one_value(__global const char *g, ulong o, long f64)
{
    return f64 ? *(__global const double *)(g + o) : (double)*(__global const float *)(g + o);
}
__kernel void kiln_adamw_(BUF(p), BUF(g), BUF(m), BUF(v), BUF(lr), BUF(t), BUF(s), long f64s, float wd, double b1,
                          double b2, float eps, long n)
{
    const long i = get_global_id(0);
    if (i >= n) return;
    const double gsd = one_value(gs, os, f64s & 4);
    if (!isfinite(gsd)) return; /* a skipped step */
    const double t = one_value(gt, ot, f64s & 2);
    const float lr = (float)one_value(glr, olr, f64s & 1), gsc = (float)gsd;
    const float c1 = (float)(1.0 - pow(b1, t)), c2 = (float)(1.0 - pow(b2, t)), fb1 = (float)b1, fb2 = (float)b2;
    __global float *p = AT(float, p), *m = AT(float, m), *v = AT(float, v);
    const float g = AT(const float, g)[i] * gsc;
    const float mi = fb1 * m[i] + (1.0f - fb1) * g, vi = fb2 * v[i] + (1.0f - fb2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float pi = p[i] * (1.0f - lr * wd);
    p[i] = pi - lr * (mi / c1) / (sqrt(vi / c2) + eps);
}

/* ---- Mixture-of-experts routing: topk, moe_sort, the grouped matmul ---- */

/* Element i of p, of float type dt (0 f32, 1 f64, 2 bf16, 3 f16, as opencl_moe.c numbers
 * them), as the double it equals. */
double moe_load(__global const char *p, long i, long dt)
{
    switch (dt) {
    case 0: return ((__global const float *)p)[i];
    case 1: return ((__global const double *)p)[i];
    case 2: return bf16_ld(((__global const ushort *)p)[i]);
    default: return vload_half(i, (__global const half *)p);
    }
}
/* Does a rank before b? Larger first, NaN above every number (the cpu's rule). */
bool moe_ranks_before(double a, double b) { return (isnan(a) && !isnan(b)) || a > b; }

/* topk: a work-item per row of x (rows, E) of es-byte elements, the cpu's insertion into
 * the row's k best kept in rank order in its indices (so the same indices, ties to the
 * lower index); the values copied as they are. */
__kernel void kiln_topk(BUF(x), BUF(v), BUF(i), long rows, long E, long k, long dt, long es)
{
    const long r = get_global_id(0);
    if (r >= rows) return;
    __global const char *row = AT(const char, x) + r * E * es;
    __global long *at = AT(long, i) + r * k;
    long n = 0;
    for (long c = 0; c < E; c++) {
        const double val = moe_load(row, c, dt);
        if (n == k && !moe_ranks_before(val, moe_load(row, at[n - 1], dt))) continue;
        long p = n < k ? n++ : n - 1; /* the slot it may take: a new one, or the last */
        for (; p > 0 && moe_ranks_before(val, moe_load(row, at[p - 1], dt)); p--) at[p] = at[p - 1];
        at[p] = c;
    }
    __global char *vals = AT(char, v) + r * k * es;
    for (long j = 0; j < k; j++)
        for (long b = 0; b < es; b++) vals[j * es + b] = row[at[j] * es + b];
}

long moe_index(__global const char *g, ulong o, long i, long i64)
{
    return i64 ? ((__global const long *)(g + o))[i] : (long)((__global const int *)(g + o))[i];
}

/* moe_sort: a work-item per expert x and one more (x = E). Each counts the assignments
 * to the experts below it, its offset, and puts its own assignments from there in
 * ascending order: a stable counting sort, each expert's list written by one work-item.
 * An index outside [0, E) (the host checks them before an eager launch) goes to no
 * expert: work-item E puts those after the last expert's, so that order stays a
 * permutation of 0..n-1 for what reads it, and raises ERR_EXPERT. */
__kernel void kiln_moe_sort(BUF(i), BUF(o), BUF(f), long n, long E, long i64, BUF(e))
{
    const long x = get_global_id(0);
    if (x > E) return;
    long at = 0;
    for (long a = 0; a < n; a++) {
        const long v = moe_index(gi, oi, a, i64);
        at += v >= 0 && v < x;
    }
    AT(long, f)[x] = at;
    __global long *order = AT(long, o);
    const long first = at;
    for (long a = 0; a < n; a++) {
        const long v = moe_index(gi, oi, a, i64);
        if (x < E ? v == x : (v < 0 || v >= E)) order[at++] = a;
    }
    if (x == E && at != first) atomic_or(AT(int, e), ERR_EXPERT);
}

/* offsets[j] of the grouped matmul (i32 or i64, element stride sf). */
long moe_offset(__global const char *g, ulong o, long j, long sf, long f64)
{
    return f64 ? ((__global const long *)(g + o))[j * sf] : (long)((__global const int *)(g + o))[j * sf];
}

/* The grouped matmul's row tile `tile` (one of at most ceil(M / 64) + E + 2): the rows
 * are cut into segments, those before offsets[0] (no expert's), each expert's, those
 * from offsets[E] on (no expert's), and each segment into tiles of at most 64 rows. The
 * offsets are clamped to rise within [0, M], so that bad ones (the host's to report, or
 * the error word's) read no row outside x. Sets the tile's rows [lo, hi) and expert x
 * (-1: none, the rows are zero); false for a spare tile. */
bool moe_tile(long tile, __global const char *gf, ulong of, long sf, long f64, long M, long E, long *lo, long *hi,
              long *x)
{
    long prev = 0;
    for (long s = 0; s <= E + 1; s++) {
        const long end = s <= E ? min(max(moe_offset(gf, of, s, sf, f64), prev), M) : M;
        const long tiles = (end - prev + TM - 1) / TM;
        if (tile < tiles) {
            *lo = prev + tile * TM;
            *hi = min(end, *lo + TM);
            *x = s >= 1 && s <= E ? s - 1 : -1;
            return true;
        }
        tile -= tiles;
        prev = end;
    }
    return false;
}

/* Whether offsets[0..E] rise from 0 or more to at most M. */
bool moe_offsets_ok(__global const char *gf, ulong of, long sf, long f64, long M, long E)
{
    long prev = 0;
    for (long j = 0; j <= E; j++) {
        const long v = moe_offset(gf, of, j, sf, f64);
        if (v < prev || v > M) return false;
        prev = v;
    }
    return true;
}

/* acc (WPT x WPT of ACC) += A B for the 64x64 tile at (row0, col0), as the tiled matmul
 * sums it: A (R, D) with element (r, d) at A[r sar + d sad], B (D, NC) with (d, c) at
 * B[d sbd + c sbc], staged in the local tiles As and Bs; what is outside reads as 0. */
#define TILE_PRODUCT(ACC, LD, A, sar, sad, R, B, sbd, sbc, NC, D)                                      \
    for (long t0 = 0; t0 < (D); t0 += TK) {                                                             \
        for (int q = tid; q < TK * TM; q += 256) {                                                      \
            const int kk = q / TM, mm = q % TM;                                                         \
            const long gm = row0 + mm, gk = t0 + kk, gn = col0 + mm;                                    \
            As[kk][mm] = gm < (R) && gk < (D) ? (ACC)LD(A, gm * (sar) + gk * (sad)) : (ACC)0;           \
            Bs[kk][mm] = gk < (D) && gn < (NC) ? (ACC)LD(B, gk * (sbd) + gn * (sbc)) : (ACC)0;          \
        }                                                                                               \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                   \
        for (int kk = 0; kk < TK; kk++) {                                                               \
            ACC av[WPT], bv[WPT];                                                                       \
            for (int i = 0; i < WPT; i++) av[i] = As[kk][lr + 16 * i];                                  \
            for (int j = 0; j < WPT; j++) bv[j] = Bs[kk][lc + 16 * j];                                  \
            for (int i = 0; i < WPT; i++)                                                               \
                for (int j = 0; j < WPT; j++) acc[i][j] = fma(av[i], bv[j], acc[i][j]);                 \
        }                                                                                               \
        barrier(CLK_LOCAL_MEM_FENCE);                                                                   \
    }

/* The grouped matmul in one launch for every expert, written once for element type T
 * (summed in ACC, loaded by LD, stored by ST: f32, f64, and bf16 and f16 summed in f32
 * and rounded once, as the matmul's).
 *
 * kiln_grouped: C (M, N) = A (M, K) times B[x] (K, N) for the rows of expert x, zero for
 * the rows of none: 64x64 output tiles per 16x16 work-group, the row tiles found from
 * the offsets on the device (moe_tile), so that the counts stay data. The forward (A =
 * x, B = w) and dx (A = g, B = w transposed, by its strides). Work-group (0, 0) raises
 * ERR_OFFSETS for bad offsets.
 *
 * kiln_grouped_dw: C[x] (K, N) = A_x^T (K, rows) times B_x (rows, N) over expert x's rows
 * (zero for none): dw from x and g. The experts are the fastest-varying part of the
 * work-group's first index (then the column tile), so that a run of consecutive
 * work-groups, as PoCL hands them to a thread, holds every expert's share alike however
 * skewed the counts. */
#define GROUPED_KERNELS(SFX, T, ACC, LD, ST)                                                            \
    __kernel __attribute__((reqd_work_group_size(16, 16, 1))) void kiln_grouped##SFX(                   \
        BUF(a), BUF(b), BUF(c), BUF(f), long M, long N, long K, long E, long sam, long sak, long sbe,   \
        long sbk, long sbn, long sf, long f64, BUF(e))                                                  \
    {                                                                                                   \
        const int lr = get_local_id(1), lc = get_local_id(0), tid = lr * 16 + lc;                       \
        const long row0 = 0, col0 = get_group_id(0) * TM;                                               \
        __local ACC As[TK][TM], Bs[TK][TM];                                                             \
        if (get_group_id(0) == 0 && get_group_id(1) == 0 && tid == 0 &&                                 \
            !moe_offsets_ok(gf, of, sf, f64, M, E))                                                     \
            atomic_or(AT(int, e), ERR_OFFSETS);                                                         \
        long lo, hi, x;                                                                                 \
        if (!moe_tile(get_group_id(1), gf, of, sf, f64, M, E, &lo, &hi, &x)) return;                    \
        __global const T *A = AT(const T, a) + lo * sam, *B = AT(const T, b) + (x < 0 ? 0 : x) * sbe;   \
        const long R = hi - lo, D = x < 0 ? 0 : K;                                                      \
        ACC acc[WPT][WPT];                                                                              \
        for (int i = 0; i < WPT; i++)                                                                   \
            for (int j = 0; j < WPT; j++) acc[i][j] = 0;                                                \
        TILE_PRODUCT(ACC, LD, A, sam, sak, R, B, sbk, sbn, N, D)                                        \
        __global T *C = AT(T, c) + lo * N;                                                              \
        for (int i = 0; i < WPT; i++)                                                                   \
            for (int j = 0; j < WPT; j++) {                                                             \
                const long gm = lr + 16 * i, gn = col0 + lc + 16 * j;                                   \
                if (gm < R && gn < N) ST(C, gm * N + gn, acc[i][j]);                                    \
            }                                                                                           \
    }                                                                                                   \
                                                                                                        \
    __kernel __attribute__((reqd_work_group_size(16, 16, 1))) void kiln_grouped_dw##SFX(                \
        BUF(a), BUF(b), BUF(c), BUF(f), long M, long N, long K, long E, long sam, long sak, long sbm,   \
        long sbn, long sf, long f64)                                                                    \
    {                                                                                                   \
        const int lr = get_local_id(1), lc = get_local_id(0), tid = lr * 16 + lc;                       \
        const long x = get_group_id(0) % E, row0 = get_group_id(1) * TM, col0 = get_group_id(0) / E * TM; \
        __local ACC As[TK][TM], Bs[TK][TM];                                                             \
        const long lo = min(max(moe_offset(gf, of, x, sf, f64), 0L), M);                                \
        const long hi = min(max(moe_offset(gf, of, x + 1, sf, f64), lo), M);                            \
        __global const T *A = AT(const T, a) + lo * sam, *B = AT(const T, b) + lo * sbm;                \
        ACC acc[WPT][WPT];                                                                              \
        for (int i = 0; i < WPT; i++)                                                                   \
            for (int j = 0; j < WPT; j++) acc[i][j] = 0;                                                \
        TILE_PRODUCT(ACC, LD, A, sak, sam, K, B, sbm, sbn, N, hi - lo)                                  \
        __global T *C = AT(T, c) + x * K * N;                                                           \
        for (int i = 0; i < WPT; i++)                                                                   \
            for (int j = 0; j < WPT; j++) {                                                             \
                const long gm = row0 + lr + 16 * i, gn = col0 + lc + 16 * j;                            \
                if (gm < K && gn < N) ST(C, gm * N + gn, acc[i][j]);                                    \
            }                                                                                           \
    }
GROUPED_KERNELS(, float, float, F32_LD, F32_ST)
GROUPED_KERNELS(_f64, double, double, F32_LD, F32_ST)
GROUPED_KERNELS(_bf16, ushort, float, BF16_LD, BF16_ST)
GROUPED_KERNELS(_f16, half, float, F16_LD, F16_ST)
