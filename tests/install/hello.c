/* A program outside the tree: a tensor, an op and its gradient through the installed
 * library. Prints the gradient of sum(x*x) at x = (1, 2, 3), which is 2x. */
#include <stdio.h>
#include "kiln/ops.h"

int main(void)
{
    float v[3] = {1, 2, 3}, g[3];
    int64_t n = 3;
    kiln_tensor_t *x = kiln_from_data(v, &n, 1, KILN_DTYPE_F32);
    kiln_tensor_set_requires_grad(x, true);
    kiln_tensor_t *y = kiln_sum(kiln_mul(x, x), NULL, 0, false);
    if (!y || kiln_backward(y) != KILN_OK || kiln_tensor_to_host(kiln_tensor_grad(x), g, sizeof g) != KILN_OK) {
        fprintf(stderr, "hello: %s\n", kiln_last_error());
        return 1;
    }
    printf("grad %g %g %g on %s\n", g[0], g[1], g[2], kiln_device());
    return g[0] == 2 && g[1] == 4 && g[2] == 6 ? 0 : 1;
}
