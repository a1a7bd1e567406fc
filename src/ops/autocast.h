/* Autocast's hooks for the rooms above (kiln/ops.h has the user's side). */
#ifndef KILN_OPS_AUTOCAST_H
#define KILN_OPS_AUTOCAST_H
#include <stdbool.h>
#include "core/op_table.h"

/* Pauses this thread's autocast (a backward runs in the types forward chose) and puts
 * it back as it was; pauses nest through the value returned. */
bool kiln__autocast_pause(void);
void kiln__autocast_resume(bool was);

#endif
