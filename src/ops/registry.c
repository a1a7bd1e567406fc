/* The op registry, expanded from ops.def. */
#include "ops/registry.h"

#define KILN__BW_Y(name) kiln__bw_##name
#define KILN__BW_N(name) NULL
#define KILN__IS(ID, X) (KILN_OP_##ID == KILN_OP_##X)


const kiln__op_def kiln__ops[KILN_OP_COUNT] = {
#define KILN_OP(ID, nm, nin, nout, nvis, grad, sv)                                                   \
    [KILN_OP_##ID] = {                                                                               \
        .name = #nm,                                                                                 \
        .n_in = nin,                                                                                 \
        .n_out = nout,                                                                               \
        .n_visible = nvis,                                                                           \
        .save = sv,                                                                                  \
        .is_view = KILN__IS(ID, VIEW) || KILN__IS(ID, PERMUTE) || KILN__IS(ID, SLICE) || KILN__IS(ID, EXPAND), \
        .is_inplace = (nout) == 0,                                                                   \
        .infer = kiln__infer_##nm,                                                                   \
        .backward = KILN__BW_##grad(nm),                                                             \
    },
#include "ops/ops.def"
#undef KILN_OP
};
_Static_assert(sizeof kiln__ops / sizeof kiln__ops[0] == KILN_OP_COUNT, "one registry entry per op");
