/* The ops room's column of the op table: each op's backward formula, rendered from
 * ops.def's grad column. */
#include "ops/registry.h"

#define KILN__BW_Y(name) kiln__bw_##name
#define KILN__BW_N(name) NULL

const kiln__backward_fn kiln__op_backward[KILN_OP_COUNT] = {
#define KILN_OP(ID, nm, kd, nin, nout, nvis, wr, grad, sv, amp) [KILN_OP_##ID] = KILN__BW_##grad(nm),
#include "core/ops.def"
#undef KILN_OP
};
