/* Mixture-of-experts routing kernels: topk (the router's choice) and moe_sort (the
 * assignments grouped by expert). The grouped GEMM is in cpu_matmul.c, beside the
 * matmul whose BLAS calls it shares. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "backends/cpu/cpu.h"

/* Does a rank before b? Larger first, NaN above every number; equal values keep their
 * order (the caller visits indices in ascending order), so the lower index wins a tie. */
static inline bool ranks_before(double a, double b) { return (isnan(a) && !isnan(b)) || a > b; }

typedef struct {
    const char *x;
    char *vals;
    int64_t *idx;
    kiln_dtype dt;
    int64_t E, k;
} topk_ctx;

/* Rows [r0, r1): insertion into the row's k best so far, kept in rank order in the
 * row's indices (the values read back from x). An element goes after every kept one it
 * does not rank before, so among equal values the earlier index stays ahead. O(E k) a
 * row: k is small (the experts a token uses). */
static void topk_rows(void *c, int64_t r0, int64_t r1)
{
    const topk_ctx *t = c;
    int64_t es = (int64_t)kiln_dtype_size(t->dt);
    for (int64_t r = r0; r < r1; r++) {
        const char *row = t->x + r * t->E * es;
        int64_t *at = t->idx + r * t->k, n = 0;
#define KEPT(j) kiln__load(row + at[j] * es, t->dt)
        for (int64_t i = 0; i < t->E; i++) {
            double v = kiln__load(row + i * es, t->dt);
            if (n == t->k && !ranks_before(v, KEPT(n - 1))) continue;
            int64_t p = n < t->k ? n++ : n - 1; /* the slot it may take: a new one, or the last */
            for (; p > 0 && ranks_before(v, KEPT(p - 1)); p--) at[p] = at[p - 1];
            at[p] = i;
        }
#undef KEPT
        for (int64_t j = 0; j < t->k; j++) memcpy(t->vals + (r * t->k + j) * es, row + at[j] * es, (size_t)es);
    }
}

/* x (..., E) -> values, indices (..., k); each row alone, so the result does not depend
 * on the thread count. */
kiln_status kiln__cpu_topk(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *tx, *x = cpu_contig(in[0], &tx);
    if (!x) return kiln_last_status();
    int64_t E = x->shape[x->ndim - 1], k = a->op.topk.k;
    topk_ctx t = {kiln__data(x), kiln__data(out[0]), kiln__data(out[1]), x->dtype, E, k};
    int64_t rows = E ? kiln__numel(x->ndim, x->shape) / E : 0;
    kiln__parallel_for(rows, CPU_GRAIN / (E * k > 0 ? E * k : 1) + 1, topk_rows, &t);
    kiln_tensor_free(tx);
    return KILN_OK;
}

/* indices (n assignments) -> order (n), offsets (E + 1): a counting sort, stable because
 * the assignments are placed in ascending order. */
kiln_status kiln__cpu_moe_sort(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *ti, *idx = cpu_contig(in[0], &ti);
    if (!idx) return kiln_last_status();
    int64_t E = a->op.moe_sort.n_experts, n = kiln__numel(idx->ndim, idx->shape);
    kiln_status s = cpu_check_indices("moe_sort", idx, E, NULL, NULL);
    if (s == KILN_OK) {
        const char *ip = kiln__data(idx);
        size_t isz = kiln_dtype_size(idx->dtype);
        int64_t *order = kiln__data(out[0]), *off = kiln__data(out[1]);
        memset(off, 0, sizeof *off * (size_t)(E + 1));
        for (int64_t i = 0; i < n; i++) off[kiln__load_index(ip + i * (int64_t)isz, idx->dtype) + 1]++;
        for (int64_t e = 0; e < E; e++) off[e + 1] += off[e];
        /* next[e]: where expert e's next assignment goes, from offsets[e] up. */
        int64_t *next = malloc(sizeof *next * (size_t)(E ? E : 1));
        if (!next) {
            s = kiln__err(KILN_ERR_OOM, "moe_sort: out of memory for %lld experts", (long long)E);
        } else {
            memcpy(next, off, sizeof *next * (size_t)E);
            for (int64_t i = 0; i < n; i++) order[next[kiln__load_index(ip + i * (int64_t)isz, idx->dtype)]++] = i;
            free(next);
        }
    }
    kiln_tensor_free(ti);
    return s;
}

/* all_to_all: the exchange is the process group's, which the op carries (the backends
 * know nothing of groups, src/dist/pg.c); here its inputs are made contiguous. */
kiln_status kiln__cpu_all_to_all(KILN__KERNEL_ARGS)
{
    kiln_tensor_t *c[2], *tmp[2];
    if (!cpu_contig_n(in, 2, c, tmp, NULL)) return kiln_last_status();
    kiln__all_to_all_fn run = (kiln__all_to_all_fn)(uintptr_t)a->op.collective.ops;
    kiln_status s = run(a->op.collective.group, c[0], c[1], out[0], out[1]);
    cpu_free_n(tmp, 2);
    return s;
}
