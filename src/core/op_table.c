/* The op table's schema columns, rendered from ops.def. */
#include "core/op_table.h"

#define KILN__GRAD_Y true
#define KILN__GRAD_N false

const kiln__op_def kiln__ops[KILN_OP_COUNT] = {
#define KILN_OP(ID, nm, kd, nin, nout, nvis, wr, grad, sv, pol)                                                   \
    [KILN_OP_##ID] = {                                                                               \
        .name = #nm,                                                                                 \
        .kind = KILN__KIND_##kd,                                                                     \
        .n_in = nin,                                                                                 \
        .writes = wr,                                                                                 \
        .n_out = nout,                                                                               \
        .n_visible = nvis,                                                                           \
        .save = sv,                                                                                  \
        .has_grad = KILN__GRAD_##grad,                                                               \
        .is_view = KILN__KIND_##kd == KILN__KIND_VIEW,                                               \
        .is_inplace = (nout) == 0,                                                                   \
        .amp = KILN_AMP_##pol,                                                                       \
        .infer = kiln__infer_##nm,                                                                   \
    },
#include "core/ops.def"
#undef KILN_OP
};

const kiln__op_math_t kiln__op_math[KILN_OP_COUNT] = {
#define KILN_PW(ID, nm, dtypes, grad, fast)                       \
    [KILN_OP_##ID] = {#nm, false, KILN__PW_##fast},               \
    KILN__PW_IF_OP(grad, [KILN_OP_##ID##_BACKWARD] = {#nm, true, KILN__PW_##fast}, )
#include "kiln/pointwise.def"
#undef KILN_PW
};
