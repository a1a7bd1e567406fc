#include <stdlib.h>
#include <string.h>
#include "backends/cpu/cpu.h"
#include "backends/cpu/gemm.h" /* the row conversions between f32 and bf16 or f16 */

void cpu_iter_init(cpu_iter *it, int nops, kiln_tensor_t *const *ops)
{
    const kiln_tensor_t *o = ops[0];
    int nd = o->ndim;
    memset(it, 0, sizeof *it);
    it->nops = nops;
    int64_t shape[KILN_MAX_DIMS] = {0}, st[CPU_MAX_OPS][KILN_MAX_DIMS] = {{0}};
    for (int k = 0; k < nops; k++) {
        const kiln_tensor_t *t = ops[k];
        it->base[k] = kiln__data(t);
        it->esize[k] = kiln_dtype_size(t->dtype);
        for (int d = 0; d < nd; d++) {
            int j = d - (nd - t->ndim);
            st[k][d] = (j < 0 || t->shape[j] == 1) ? 0 : t->stride[j];
        }
    }
    for (int d = 0; d < nd; d++) shape[d] = o->shape[d];
    /* Drop size-1 dims, then merge dims that are contiguous for every operand. */
    int n = 0;
    for (int d = 0; d < nd; d++) {
        if (shape[d] == 1) continue;
        if (n > 0) {
            bool merge = true;
            for (int k = 0; k < nops && merge; k++) merge = it->st[k][n - 1] == st[k][d] * shape[d];
            if (merge) {
                it->shape[n - 1] *= shape[d];
                for (int k = 0; k < nops; k++) it->st[k][n - 1] = st[k][d];
                continue;
            }
        }
        it->shape[n] = shape[d];
        for (int k = 0; k < nops; k++) it->st[k][n] = st[k][d];
        n++;
    }
    if (n == 0) { /* a scalar, or all dims of size 1 */
        it->shape[0] = kiln__numel(nd, shape);
        for (int k = 0; k < nops; k++) it->st[k][0] = 0;
        n = 1;
    }
    it->ndim = n;
}

typedef struct {
    const cpu_iter *it;
    cpu_row_fn fn;
    void *ctx;
} run_ctx;

static void run_rows(void *p, int64_t b, int64_t e)
{
    run_ctx *rc = p;
    const cpu_iter *it = rc->it;
    int nd = it->ndim, inner = nd - 1;
    int64_t s[CPU_MAX_OPS];
    for (int k = 0; k < it->nops; k++) s[k] = it->st[k][inner];
    for (int64_t r = b; r < e; r++) {
        char *ptr[CPU_MAX_OPS];
        int64_t rem = r;
        for (int k = 0; k < it->nops; k++) ptr[k] = it->base[k];
        for (int d = inner - 1; d >= 0; d--) {
            int64_t i = rem % it->shape[d];
            rem /= it->shape[d];
            for (int k = 0; k < it->nops; k++) ptr[k] += (int64_t)it->esize[k] * i * it->st[k][d];
        }
        rc->fn(rc->ctx, ptr, s, it->shape[inner]);
    }
}

void cpu_iter_run(const cpu_iter *it, cpu_row_fn fn, void *ctx)
{
    int64_t rows = 1, len = it->shape[it->ndim - 1];
    for (int d = 0; d < it->ndim - 1; d++) rows *= it->shape[d];
    if (rows == 0 || len == 0) return;
    run_ctx rc = {it, fn, ctx};
    int64_t grain = len >= CPU_GRAIN ? 1 : CPU_GRAIN / len;
    if (rows == 1 && len > CPU_GRAIN && kiln__pool_size() > 1) {
        /* One long row: split it into pieces so every thread gets some. */
        int64_t pieces = (len + CPU_GRAIN - 1) / CPU_GRAIN;
        cpu_iter sub = *it;
        sub.ndim = 2;
        int64_t piece = (len + pieces - 1) / pieces;
        if (len % piece == 0) {
            sub.shape[0] = len / piece;
            sub.shape[1] = piece;
            for (int k = 0; k < it->nops; k++) {
                sub.st[k][0] = it->st[k][0] * piece;
                sub.st[k][1] = it->st[k][0];
            }
            run_ctx rs = {&sub, fn, ctx};
            kiln__parallel_for(sub.shape[0], 1, run_rows, &rs);
            return;
        }
    }
    kiln__parallel_for(rows, grain, run_rows, &rc);
}

typedef struct {
    kiln_dtype dt, st;
} copy_ctx;

static void copy_row(void *c, char **p, const int64_t *s, int64_t n)
{
    const copy_ctx *cc = c;
    size_t dsz = kiln_dtype_size(cc->dt), ssz = kiln_dtype_size(cc->st);
    if (cc->dt == cc->st) {
        if (s[0] == 1 && s[1] == 1) {
            memcpy(p[0], p[1], (size_t)n * dsz);
            return;
        }
        for (int64_t i = 0; i < n; i++) memcpy(p[0] + i * s[0] * (int64_t)dsz, p[1] + i * s[1] * (int64_t)ssz, dsz);
        return;
    }
    if (kiln__is_half(cc->dt) && cc->st == KILN_DTYPE_F32 && s[1] == 1) {
        cpu_narrow_row(p[0], s[0], (const float *)p[1], n, cc->dt);
        return;
    }
    if (cc->dt == KILN_DTYPE_F32 && kiln__is_half(cc->st) && s[0] == 1) {
        cpu_widen_row((float *)p[0], p[1], s[1], n, cc->st);
        return;
    }
    bool ints = !kiln_dtype_is_float(cc->dt) && !kiln_dtype_is_float(cc->st);
    for (int64_t i = 0; i < n; i++) {
        char *d = p[0] + i * s[0] * (int64_t)dsz, *x = p[1] + i * s[1] * (int64_t)ssz;
        if (ints && cc->dt != KILN_DTYPE_BOOL) {
            int64_t v = cc->st == KILN_DTYPE_I64 ? *(int64_t *)x : cc->st == KILN_DTYPE_I32 ? *(int32_t *)x : *(uint8_t *)x;
            if (cc->dt == KILN_DTYPE_I64) *(int64_t *)d = v;
            else if (cc->dt == KILN_DTYPE_I32) *(int32_t *)d = (int32_t)v;
            else *(uint8_t *)d = (uint8_t)v;
        } else {
            kiln__store(d, cc->dt, kiln__load(x, cc->st));
        }
    }
}

void cpu_widen_row(float *dst, const void *src, int64_t s, int64_t n, kiln_dtype dt)
{
    const uint16_t *h = src;
    if (dt == KILN_DTYPE_BF16 && s == 1) kiln__bf16_to_f32_n(h, dst, n);
    else if (dt == KILN_DTYPE_BF16) for (int64_t i = 0; i < n; i++) dst[i] = kiln__bf16_to_f32(h[i * s]);
    else if (s == 1) kiln__f16_to_f32_n(h, dst, n);
    else for (int64_t i = 0; i < n; i++) dst[i] = kiln__f16_to_f32(h[i * s]);
}

void cpu_narrow_row(void *dst, int64_t s, const float *src, int64_t n, kiln_dtype dt)
{
    uint16_t *h = dst;
    if (dt == KILN_DTYPE_BF16 && s == 1) kiln__f32_to_bf16_n(src, h, n);
    else if (dt == KILN_DTYPE_BF16) for (int64_t i = 0; i < n; i++) h[i * s] = kiln__f32_to_bf16(src[i]);
    else if (s == 1) kiln__f32_to_f16_n(src, h, n);
    else for (int64_t i = 0; i < n; i++) h[i * s] = kiln__f32_to_f16(src[i]);
}

/* A copy whose source runs along one dim (u) and destination along another (v), as
 * when a transposed weight is cast or made contiguous: row by row it reads one of the
 * two an element at a time, each a cache miss (such copies were 7% of a bf16 training
 * step). It goes in TILE x TILE blocks instead: each block read along u into a buffer
 * in the destination's type (copy_row's conversions, whole runs at a time), then
 * written along v. Other dims (batched transposes) are looped. */
#define TILE 32
typedef struct {
    const cpu_iter *it;
    int u, v;
    int64_t tiles_u, tiles_v;
    copy_ctx cc;
} tiled_ctx;

static void tiled_range(void *c, int64_t b, int64_t e)
{
    const tiled_ctx *tc = c;
    const cpu_iter *it = tc->it;
    int u = tc->u, v = tc->v;
    int64_t dsz = (int64_t)it->esize[0], ssz = (int64_t)it->esize[1];
    _Alignas(64) char buf[TILE * TILE * 8];
    for (int64_t t = b; t < e; t++) {
        int64_t rem = t, jv = rem % tc->tiles_v, ju = (rem /= tc->tiles_v) % tc->tiles_u;
        rem /= tc->tiles_u;
        char *d = it->base[0], *s = it->base[1];
        for (int dd = it->ndim - 1; dd >= 0; dd--) {
            if (dd == u || dd == v) continue;
            int64_t i = rem % it->shape[dd];
            rem /= it->shape[dd];
            d += dsz * i * it->st[0][dd];
            s += ssz * i * it->st[1][dd];
        }
        int64_t u0 = ju * TILE, v0 = jv * TILE;
        int64_t nu = it->shape[u] - u0 < TILE ? it->shape[u] - u0 : TILE;
        int64_t nv = it->shape[v] - v0 < TILE ? it->shape[v] - v0 : TILE;
        d += dsz * (u0 * it->st[0][u] + v0);
        s += ssz * (u0 + v0 * it->st[1][v]);
        for (int64_t j = 0; j < nv; j++) /* buf[j][i] = src (i, j), i along u */
            copy_row((void *)&tc->cc, (char *[]){buf + j * TILE * dsz, s + j * it->st[1][v] * ssz}, (int64_t[]){1, 1},
                     nu);
        int64_t du = it->st[0][u];
        for (int64_t i = 0; i < nu; i++) { /* dst (i, j) = buf[j][i], j along v */
            char *row = d + i * du * dsz;
            switch (dsz) {
            case 2:
                for (int64_t j = 0; j < nv; j++) ((uint16_t *)row)[j] = ((const uint16_t *)buf)[j * TILE + i];
                break;
            case 4:
                for (int64_t j = 0; j < nv; j++) ((uint32_t *)row)[j] = ((const uint32_t *)buf)[j * TILE + i];
                break;
            case 8:
                for (int64_t j = 0; j < nv; j++) ((uint64_t *)row)[j] = ((const uint64_t *)buf)[j * TILE + i];
                break;
            default:
                for (int64_t j = 0; j < nv; j++) memcpy(row + j * dsz, buf + (j * TILE + i) * dsz, (size_t)dsz);
            }
        }
    }
}

/* Whether the copy is a transpose worth tiling, and if so runs it. */
static bool copy_tiled(const cpu_iter *it, copy_ctx cc)
{
    int u = -1, v = it->ndim - 1;
    if (it->ndim < 2 || it->st[0][v] != 1 || it->st[1][v] == 1 || it->esize[0] > 8) return false;
    for (int d = 0; d < v; d++)
        if (it->st[1][d] == 1) u = d;
    if (u < 0 || it->shape[u] < 8 || it->shape[v] < 8 || it->st[1][v] == 0 || it->st[0][u] == 0) return false;
    tiled_ctx tc = {it, u, v, (it->shape[u] + TILE - 1) / TILE, (it->shape[v] + TILE - 1) / TILE, cc};
    int64_t tiles = tc.tiles_u * tc.tiles_v;
    for (int d = 0; d < it->ndim; d++)
        if (d != u && d != v) tiles *= it->shape[d];
    kiln__parallel_for(tiles, 4, tiled_range, &tc);
    return true;
}

void cpu_copy(kiln_tensor_t *dst, kiln_tensor_t *src)
{
    kiln_tensor_t *ops[2] = {dst, src};
    cpu_iter it;
    cpu_iter_init(&it, 2, ops);
    copy_ctx cc = {dst->dtype, src->dtype};
    if (!copy_tiled(&it, cc)) cpu_iter_run(&it, copy_row, &cc);
}

kiln_tensor_t *cpu_contig(kiln_tensor_t *t, kiln_tensor_t **tmp)
{
    *tmp = NULL;
    if (kiln__is_contiguous(t)) return t;
    *tmp = kiln__tensor_alloc(t->st->be, t->dtype, t->shape, t->ndim);
    if (!*tmp) return NULL;
    cpu_copy(*tmp, t);
    return *tmp;
}

bool cpu_contig_n(kiln_tensor_t *const *in, int n, kiln_tensor_t **c, kiln_tensor_t **tmp,
                  bool (*as_is)(const kiln_tensor_t *))
{
    for (int i = 0; i < n; i++) tmp[i] = NULL;
    for (int i = 0; i < n; i++) {
        c[i] = as_is && as_is(in[i]) ? in[i] : cpu_contig(in[i], &tmp[i]);
        if (!c[i]) return false;
    }
    return true;
}

void cpu_free_n(kiln_tensor_t **tmp, int n)
{
    for (int i = 0; i < n; i++) kiln_tensor_free(tmp[i]);
}

void cpu_view(kiln_tensor_t *v, const kiln_tensor_t *t, int ndim, const int64_t *shape, const int64_t *stride,
              int64_t offset)
{
    *v = (kiln_tensor_t){.st = t->st, .dtype = t->dtype, .ndim = ndim, .offset = offset};
    memcpy(v->shape, shape, sizeof(int64_t) * (size_t)ndim);
    memcpy(v->stride, stride, sizeof(int64_t) * (size_t)ndim);
}

#define WIDEN_MAX 12 /* attention_backward: 6 inputs and 3 outputs */

bool cpu_has_half(kiln_tensor_t *const *in, int n_in, kiln_tensor_t *const *out, int n_out)
{
    for (int i = 0; i < n_in; i++)
        if (kiln__is_half(in[i]->dtype)) return true;
    for (int j = 0; j < n_out; j++)
        if (kiln__is_half(out[j]->dtype)) return true;
    return false;
}

kiln_status cpu_widened(kiln__kernel_fn k, KILN__KERNEL_ARGS)
{
    kiln_tensor_t *w[WIDEN_MAX] = {0};
    if (n_in + n_out > WIDEN_MAX)
        return kiln__err(KILN_ERR_INTERNAL, "cpu: %d inputs and outputs to widen, at most %d", n_in + n_out,
                         WIDEN_MAX);
    kiln_status s = KILN_OK;
    for (int i = 0; i < n_in + n_out && s == KILN_OK; i++) {
        kiln_tensor_t *t = i < n_in ? in[i] : out[i - n_in];
        if (!kiln__is_half(t->dtype)) continue;
        if (!(w[i] = kiln__tensor_alloc(be, KILN_DTYPE_F32, t->shape, t->ndim))) s = kiln_last_status();
        else if (i < n_in) cpu_copy(w[i], t);
    }
    kiln_tensor_t *wi[WIDEN_MAX] = {0};
    for (int i = 0; i < n_in + n_out; i++) wi[i] = w[i] ? w[i] : i < n_in ? in[i] : out[i - n_in];
    if (s == KILN_OK) s = k(be, wi, n_in, a, wi + n_in, n_out);
    for (int j = 0; s == KILN_OK && j < n_out; j++)
        if (w[n_in + j]) cpu_copy(out[j], w[n_in + j]);
    for (int i = 0; i < n_in + n_out; i++) kiln_tensor_free(w[i]);
    return s;
}
