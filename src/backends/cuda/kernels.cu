/* The CUDA backend's own kernels: in-place updates and fills, the same formulas as the
 * cpu's (fma where it contracts). Embedded into kiln at build time (cmake/embed.cmake)
 * as kiln__cuda_kernel_source and compiled with NVRTC on first use (cuda_backend.c).
 * Every buffer argument is a (pointer, unsigned long long byte offset) pair, as the
 * generated kernels take them; the host passes offset 0. */
extern "C" __global__ void kiln_add_(float *d, unsigned long long od, const float *s, unsigned long long os,
                                      float alpha, long long n)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) d[i] = fmaf(alpha, s[i], d[i]);
}
extern "C" __global__ void kiln_scale_(float *d, unsigned long long od, float a, long long n)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) d[i] *= a;
}
__device__ double one_value(const char *p, long long f64)
{
    return f64 ? *(const double *)p : (double)*(const float *)p;
}
extern "C" __global__ void kiln_adamw_(float *p, unsigned long long op, const float *g, unsigned long long og,
    float *m, unsigned long long om, float *v, unsigned long long ov, const char *lrp, unsigned long long olr,
    const char *tp, unsigned long long ot, const char *gsp, unsigned long long ogs, long long f64s, float wd,
    double b1, double b2, float eps, long long n)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double gsd = one_value(gsp, f64s & 4);
    if (!isfinite(gsd)) return; /* a skipped step */
    double t = one_value(tp, f64s & 2);
    float lr = (float)one_value(lrp, f64s & 1), gs = (float)gsd;
    float c1 = (float)(1.0 - pow(b1, t)), c2 = (float)(1.0 - pow(b2, t)), fb1 = (float)b1, fb2 = (float)b2;
    float gi = g[i] * gs;
    float mi = fb1 * m[i] + (1.0f - fb1) * gi, vi = fb2 * v[i] + (1.0f - fb2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float pi = p[i] * (1.0f - lr * wd);
    p[i] = pi - lr * (mi / c1) / (sqrtf(vi / c2) + eps);
}
extern "C" __global__ void kiln_fill(char *d, unsigned long long od, long long pattern, long long esize, long long n)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (esize == 8) ((long long *)d)[i] = pattern;
    else if (esize == 4) ((int *)d)[i] = (int)pattern;
    else if (esize == 2) ((short *)d)[i] = (short)pattern;
    else d[i] = (char)pattern;
}
