/* rmsnorm_residual's OpenCL kernel: one work-item a row (KILN_OP_GRID_ROWS). Each
 * tensor comes as (buffer, byte offset); then the rows, the columns and eps. */
#define AT(T, p, off) ((__global T *)((__global char *)(p) + (off)))

__kernel void rmsnorm_residual(__global float *x, ulong xo, __global float *r, ulong ro, __global float *w, ulong wo,
                               __global float *y, ulong yo, __global float *h, ulong ho, __global float *rstd,
                               ulong so, long rows, long cols, float eps)
{
    long i = get_global_id(0);
    if (i >= rows) return;
    __global const float *xi = AT(float, x, xo) + i * cols, *ri = AT(float, r, ro) + i * cols;
    __global const float *wp = AT(float, w, wo);
    __global float *hi = AT(float, h, ho) + i * cols, *yi = AT(float, y, yo) + i * cols;
    float ss = 0;
    for (long j = 0; j < cols; j++) {
        float v = xi[j] + ri[j];
        hi[j] = v;
        ss += v * v;
    }
    float inv = 1.0f / sqrt(ss / (float)cols + eps);
    AT(float, rstd, so)[i] = inv;
    for (long j = 0; j < cols; j++) yi[j] = hi[j] * inv * wp[j];
}
