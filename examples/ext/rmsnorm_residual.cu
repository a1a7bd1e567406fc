// rmsnorm_residual's CUDA kernel (built by nvcc where the CUDA toolkit is): one block
// a row, its threads summing the squares together; launched on kiln's stream for the
// output's device, so that it runs in order with kiln's own work.
#include <cuda_runtime.h>
#include "kiln/op.h"

__global__ void rmsnorm_residual_kernel(const float *x, const float *r, const float *w, float *y, float *h,
                                        float *rstd, long cols, float eps)
{
    __shared__ float part[256];
    long row = blockIdx.x;
    const float *xi = x + row * cols, *ri = r + row * cols;
    float *hi = h + row * cols, *yi = y + row * cols;
    float ss = 0;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = xi[j] + ri[j];
        hi[j] = v;
        ss += v * v;
    }
    part[threadIdx.x] = ss;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    float inv = rsqrtf(part[0] / (float)cols + eps);
    if (threadIdx.x == 0) rstd[row] = inv;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) yi[j] = hi[j] * inv * w[j];
}

extern "C" kiln_status rmsnorm_residual_cuda(const kiln_op_args *a)
{
    long cols = (long)kiln_tensor_shape(a->in[2])[0], rows = cols ? (long)(kiln_tensor_numel(a->in[0]) / cols) : 0;
    if (!rows) return KILN_OK;
    cudaStream_t st = (cudaStream_t)kiln_op_stream(a->out[0]);
    rmsnorm_residual_kernel<<<(unsigned)rows, 256, 0, st>>>(
        (const float *)kiln_op_data(a->in[0]), (const float *)kiln_op_data(a->in[1]),
        (const float *)kiln_op_data(a->in[2]), (float *)kiln_op_data(a->out[0]), (float *)kiln_op_data(a->out[1]),
        (float *)kiln_op_data(a->out[2]), cols, (float)a->attr[0].f);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? KILN_OK : kiln_error(KILN_ERR_DEVICE, "rmsnorm_residual: launch: %s", cudaGetErrorString(e));
}
