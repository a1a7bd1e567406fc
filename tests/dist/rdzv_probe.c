/* One rank of the TCP rendezvous, configured by the environment (KILN_RANK,
 * KILN_WORLD_SIZE, KILN_MASTER_ADDR, KILN_MASTER_PORT, KILN_RENDEZVOUS_TIMEOUT,
 * KILN_JOB_ID); driven by tests/dist/test_dist_rendezvous.py. Each rank gives
 * "rank R" as its payload; on success prints
 *   ok rank R of W in S s: rank 0|rank 1|...
 * and on failure "error: MESSAGE" (exit 1). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/kiln.h"

int main(void)
{
    kiln_rdzv_opts o;
    if (kiln_rdzv_opts_from_env(&o) != KILN_OK) {
        printf("error: %s\n", kiln_last_error());
        return 1;
    }
    enum { LEN = 16 };
    char mine[LEN] = {0}, *all = calloc((size_t)(o.world > 0 ? o.world : 1), LEN);
    snprintf(mine, LEN, "rank %d", o.rank);
    double secs = 0;
    if (!all || kiln_rendezvous(&o, mine, LEN, all, &secs) != KILN_OK) {
        printf("error: %s\n", kiln_last_error());
        free(all);
        return 1;
    }
    printf("ok rank %d of %d in %.4f s:", o.rank, o.world, secs);
    for (int r = 0; r < o.world; r++) printf("%s%s", r ? "|" : " ", all + (size_t)r * LEN);
    printf("\n");
    free(all);
    return 0;
}
