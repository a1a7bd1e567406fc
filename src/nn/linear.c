/* Functional layers built from kiln ops. */
#include "kiln/nn.h"

kiln_tensor_t *kiln_linear(kiln_tensor_t *x, kiln_tensor_t *w, kiln_tensor_t *b)
{
    if (!x || !w) return kiln_matmul(x, w); /* keeps or sets the error */
    int nd = kiln_tensor_ndim(x);
    int64_t in = kiln_tensor_dim(x, -1), out = kiln_tensor_dim(w, 0);
    int64_t rows = nd ? kiln_tensor_numel(x) / (in ? in : 1) : 1;
    int64_t flat[2] = {rows, in};
    kiln_tensor_t *y = kiln_matmul(kiln_reshape(x, flat, 2), kiln_transpose(w, 0, 1));
    /* A bf16 or f16 product (under autocast) takes its bias in its own type, so that the
     * layer's output is of that type, as PyTorch's linear is. */
    kiln_dtype yt = y ? kiln_tensor_dtype(y) : KILN_DTYPE_F32;
    if (b && (yt == KILN_DTYPE_BF16 || yt == KILN_DTYPE_F16)) b = kiln_cast(b, yt);
    if (b) y = kiln_add(y, b);
    int64_t shape[KILN_MAX_DIMS];
    for (int i = 0; i < nd - 1; i++) shape[i] = kiln_tensor_dim(x, i);
    shape[nd > 0 ? nd - 1 : 0] = out;
    return kiln_reshape(y, shape, nd > 0 ? nd : 1);
}
