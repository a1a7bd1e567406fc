/* ZeRO stage 1: AdamW whose moments are sharded across the ranks. The parameters are
 * split in two flat groups (weight-decayed or not), each padded to a multiple of the
 * world size; rank r owns elements [r * shard, (r + 1) * shard) of each. A step
 * reduce-scatters the gradients into the owned shard (averaged), clips by the global
 * norm (the shards' squared norms summed over ranks), runs the fused AdamW update on
 * the shard, and all-gathers the updated shards back into every rank's parameters.
 * Each element sees exactly the update kiln_adamw_new's optimizer would give it, so
 * the losses match the replicated optimizer within float reassociation; the moments
 * take 1/world of the memory. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "core/file.h"
#include "core/parse.h"
#include "core/tensor_impl.h"
#include "core/util.h"
#include "dist/flat.h"
#include "kiln/graph.h"
#include "kiln/dist.h"
#include "kiln/io.h"
#include "kiln/optim.h"

typedef struct {
    int n;        /* parameters in the group */
    int *idx;     /* their indices in the caller's list */
    int64_t *off; /* offset of each in the flat group */
    int64_t total, shard;
    kiln_tensor_t *flat; /* (shard * world): gradients in, then parameters out */
    kiln_tensor_t *g;    /* (shard): this rank's gradient */
    kiln_tensor_t *pmv[3]; /* (shard): this rank's master copy and moments m, v (optimizer slots 0, 1) */
    bool decay;
} group;

struct kiln_zero1 {
    kiln_pg_t *pg;
    kiln_tensor_t **params;
    int n;
    double beta1, beta2, eps, wd;
    kiln_tensor_t *step, *one; /* f64 (1): the steps taken, advanced in place (also inside a graph) */
    group gr[2];
};

enum { PARAMS = -1, GRADS = -2 };

/* Copies the group's parameters, their gradients, or (slot >= 0) their optimizer slot
 * from full into flat, zeros where there is none. */
static kiln_status gather_local(kiln_zero1_t *z, group *g, kiln_optim_t *full, int slot)
{
    kiln_status s = kiln_fill_(g->flat, 0);
    for (int k = 0; s == KILN_OK && k < g->n; k++) {
        kiln_tensor_t *p = z->params[g->idx[k]];
        kiln_tensor_t *src = slot == PARAMS ? p : slot == GRADS ? kiln_tensor_grad(p)
                           : full ? kiln_optim_state(full, g->idx[k], slot) : NULL;
        if (!src) continue;
        s = kiln_tensor_copy_(kiln_narrow(g->flat, 0, g->off[k], kiln_tensor_numel(src)), kiln__flat_of(src));
    }
    return s;
}

kiln_status kiln_zero1_new(kiln_pg_t *pg, kiln_tensor_t *const *params, int n, const bool *decay, double beta1,
                           double beta2, double eps, double weight_decay, kiln_optim_t *resume_from, kiln_zero1_t **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "zero1_new: out is NULL");
    *out = NULL;
    if (!pg || !params || n < 1) return kiln_error(KILN_ERR_ARG, "zero1_new: needs a group and parameters");
    kiln_zero1_t *z = calloc(1, sizeof *z);
    if (!z) return kiln_error(KILN_ERR_OOM, "zero1_new: out of memory");
    bool prev = kiln_set_grad_enabled(false);
    z->pg = pg;
    z->n = n;
    z->beta1 = beta1, z->beta2 = beta2, z->eps = eps, z->wd = weight_decay;
    z->params = malloc(sizeof *z->params * (size_t)n);
    kiln_status s = z->params ? KILN_OK : kiln_error(KILN_ERR_OOM, "zero1_new: out of memory");
    int64_t one = 1;
    double steps = resume_from ? (double)kiln_optim_steps(resume_from) : 0, unit = 1;
    if (s == KILN_OK && (!(z->step = kiln_keep(kiln_from_data(&steps, &one, 1, KILN_DTYPE_F64))) ||
                         !(z->one = kiln_keep(kiln_from_data(&unit, &one, 1, KILN_DTYPE_F64)))))
        s = kiln_last_status();
    for (int i = 0; s == KILN_OK && i < n; i++)
        if (kiln_tensor_dtype(z->params[i] = params[i]) != KILN_DTYPE_F32)
            s = kiln_error(KILN_ERR_DTYPE, "zero1_new: parameter %d is %s; ZeRO-1 takes f32", i,
                           kiln_dtype_name(kiln_tensor_dtype(params[i])));
    int world = kiln_pg_world_size(pg), rank = kiln_pg_rank(pg);
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        group *g = &z->gr[gi];
        g->decay = gi == 0;
        g->idx = malloc(sizeof *g->idx * (size_t)n);
        g->off = malloc(sizeof *g->off * (size_t)n);
        if (!g->idx || !g->off) s = kiln_error(KILN_ERR_OOM, "zero1_new: out of memory");
        for (int i = 0; s == KILN_OK && i < n; i++) {
            if ((decay ? decay[i] : kiln_tensor_ndim(params[i]) >= 2) != g->decay) continue;
            g->idx[g->n] = i;
            g->off[g->n++] = g->total;
            g->total += kiln_tensor_numel(params[i]);
        }
        g->shard = (g->total + world - 1) / world;
        if (s != KILN_OK || g->shard == 0) continue;
        int64_t all = g->shard * world, sh = g->shard;
        kiln_scope_begin();
        g->flat = kiln_keep(kiln_zeros(&all, 1, KILN_DTYPE_F32));
        g->g = kiln_keep(kiln_zeros(&sh, 1, KILN_DTYPE_F32));
        if (!g->flat || !g->g) s = kiln_last_status();
        /* The master copy from the parameters, the moments from resume_from (or zeros). */
        for (int k = 0; s == KILN_OK && k < 3; k++) {
            if (!(g->pmv[k] = kiln_keep(kiln_zeros(&sh, 1, KILN_DTYPE_F32)))) s = kiln_last_status();
            if (s == KILN_OK) s = gather_local(z, g, resume_from, k - 1);
            if (s == KILN_OK) s = kiln_tensor_copy_(g->pmv[k], kiln_narrow(g->flat, 0, rank * sh, sh));
        }
        kiln_scope_end();
    }
    kiln_set_grad_enabled(prev);
    if (s == KILN_OK) *out = z;
    else kiln_zero1_free(z);
    return s;
}

void kiln_zero1_free(kiln_zero1_t *z)
{
    if (!z) return;
    for (int gi = 0; gi < 2; gi++) {
        group *g = &z->gr[gi];
        kiln_tensor_t *t[5] = {g->flat, g->g, g->pmv[0], g->pmv[1], g->pmv[2]};
        for (int k = 0; k < 5; k++) kiln_tensor_free(t[k]);
        KILN__FREE(g->idx, g->off);
    }
    kiln_tensor_free(z->step);
    kiln_tensor_free(z->one);
    KILN__FREE(z->params, z);
}

int64_t kiln_zero1_state_bytes(const kiln_zero1_t *z)
{
    int64_t b = 0;
    for (int gi = 0; z && gi < 2; gi++) b += z->gr[gi].shard * 3 * (int64_t)sizeof(float); /* p, m, v */
    return b;
}

/* Every value that changes from step to step is a tensor read when the update runs (the
 * learning rate, the step count, the clipping coefficient computed from the global
 * norm), and every collective is recorded when capturing: the same code runs eagerly
 * and inside a captured training step (kiln train --zero1 --compile). */
kiln_status kiln_zero1_step_t(kiln_zero1_t *z, kiln_tensor_t *lr, kiln_tensor_t *scale, double max_norm,
                              kiln_tensor_t **norm)
{
    if (norm) *norm = NULL;
    if (!z || !lr) return kiln_error(KILN_ERR_ARG, "zero1_step_t: NULL state or learning rate");
    if (kiln_tensor_numel(lr) != 1 ||
        (kiln_tensor_dtype(lr) != KILN_DTYPE_F32 && kiln_tensor_dtype(lr) != KILN_DTYPE_F64))
        return kiln_error(KILN_ERR_SHAPE, "zero1_step_t: the learning rate must be a one-element f32 or f64 tensor");
    bool prev = kiln_set_grad_enabled(false);
    kiln_status s = KILN_OK;
    kiln_scope_begin();
    /* Gradients in, averaged over the ranks, this rank's shard out. */
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        group *g = &z->gr[gi];
        if (!g->shard) continue;
        s = gather_local(z, g, NULL, GRADS);
        if (s == KILN_OK) s = kiln_pg_reduce_scatter(z->pg, g->flat, g->g, KILN_REDUCE_AVG);
    }
    /* The global norm: every shard's squared norm (in f32, as kiln_grad_norm's), summed
     * in f64 over the groups and the ranks. */
    kiln_tensor_t *sq = NULL, *nrm = NULL, *coef = NULL;
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        group *g = &z->gr[gi];
        if (!g->shard) continue;
        kiln_tensor_t *t = kiln_cast(kiln_sum(kiln_mul(g->g, g->g), NULL, 0, false), KILN_DTYPE_F64);
        if (!(sq = !t || !sq ? t : kiln_add(sq, t))) s = kiln_last_status();
    }
    if (s == KILN_OK && !sq && !(sq = kiln_scalar(0, KILN_DTYPE_F64))) s = kiln_last_status();
    if (s == KILN_OK) s = kiln_pg_allreduce(z->pg, sq, KILN_REDUCE_SUM);
    if (s == KILN_OK && !(nrm = kiln_sqrt(sq))) s = kiln_last_status();
    /* Loss-scaled: the norm and the coefficient unscaled, NaN on a step whose gradients
     * overflowed, which every rank skips alike (the norm is the same on all), not
     * counting it. */
    if (s == KILN_OK && !(coef = scale ? kiln_loss_scale_coef(nrm, scale, max_norm, &nrm) : kiln_clip_coef(nrm, max_norm)))
        s = kiln_last_status();
    kiln_tensor_t *inc = !coef ? NULL
                         : scale ? kiln_cast(kiln_lt(kiln_abs(coef), kiln_scalar(INFINITY, KILN_DTYPE_F32)), KILN_DTYPE_F64)
                                 : z->one;
    if (s == KILN_OK && !inc) s = kiln_last_status();
    bool counted = s == KILN_OK && (s = kiln_add_(z->step, inc, 1.0)) == KILN_OK;
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        group *g = &z->gr[gi];
        if (!g->shard) continue;
        s = kiln_adamw_step_(g->pmv[0], g->g, g->pmv[1], g->pmv[2], lr, z->step, coef, z->beta1, z->beta2, z->eps,
                             g->decay ? z->wd : 0.0);
        /* Every rank's updated shard, back into every rank's parameters. */
        if (s == KILN_OK) s = kiln_pg_allgather(z->pg, g->pmv[0], g->flat);
        for (int k = 0; s == KILN_OK && k < g->n; k++) {
            kiln_tensor_t *p = z->params[g->idx[k]];
            s = kiln_tensor_copy_(kiln__flat_of(p), kiln_narrow(g->flat, 0, g->off[k], kiln_tensor_numel(p)));
        }
    }
    if (s == KILN_OK && norm) *norm = kiln_keep(nrm);
    /* An eager step that failed after counting itself is not counted (inside a capture
     * nothing ran yet: the graph's run fails as a whole). */
    if (s != KILN_OK && counted && !kiln_graph_capturing()) kiln_add_(z->step, inc, -1.0);
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    if (norm && *norm) *norm = kiln__scoped(*norm); /* in the caller's scope */
    return s;
}

kiln_status kiln_zero1_step(kiln_zero1_t *z, double lr, double max_norm, double *norm)
{
    if (!z) return kiln_error(KILN_ERR_ARG, "zero1_step: NULL");
    if (kiln_graph_capturing())
        return kiln_error(KILN_ERR_UNSUPPORTED, "zero1_step during graph capture: a learning rate given as a number "
                          "would be frozen, and the norm read; use kiln_zero1_step_t");
    int64_t one = 1;
    kiln_scope_begin();
    kiln_tensor_t *lr_t = kiln_from_data(&lr, &one, 1, KILN_DTYPE_F64), *nrm = NULL;
    kiln_status s = lr_t ? kiln_zero1_step_t(z, lr_t, NULL, max_norm, &nrm) : kiln_last_status();
    double v = 0;
    if (s == KILN_OK) s = kiln_tensor_item(nrm, &v);
    if (s == KILN_OK && norm) *norm = v;
    kiln_scope_end();
    return s;
}

/* ---- sharded checkpoints ----
 * Each rank writes its shards to DIR/zero1.step<S>.rank<R>.safetensors; once every
 * rank has (a barrier), rank 0 writes DIR/zero1.complete, naming the step and the world
 * size, last, and removes the previous step's shards. A resume loads the shards only
 * for the step the marker names, so shards of a save that did not finish are never
 * used; any world size can read them (each rank reassembles the groups and takes its
 * new shard). */
#define MARKER "zero1.complete"

static char *shard_path(const char *dir, int64_t step, int rank)
{
    size_t n = strlen(dir) + 64;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/zero1.step%lld.rank%d.safetensors", dir, (long long)step, rank);
    return p;
}

static char *marker_path(const char *dir)
{
    size_t n = strlen(dir) + sizeof MARKER + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, MARKER);
    return p;
}

kiln_status kiln_zero1_read_marker(const char *dir, int64_t *step, int *world)
{
    char *path = marker_path(dir);
    if (!path) return kiln_error(KILN_ERR_OOM, "zero1: out of memory");
    FILE *f = kiln__file_fopen_read(path, NULL);
    long long s = -1;
    int w = 0;
    kiln_status st = KILN_OK;
    if (!f) {
        char why[512]; /* (the message is rewritten from a copy: kiln_error writes the buffer it would read) */
        snprintf(why, sizeof why, "%s", kiln_last_error());
        st = kiln_error(KILN_ERR_IO, "no ZeRO-1 completion marker (%s)", why);
    }
    else if (fscanf(f, "{\"step\": %lld, \"world\": %d}", &s, &w) != 2 || s < 0 || w < 1)
        st = kiln_error(KILN_ERR_FORMAT, "%s: not a ZeRO-1 completion marker", path);
    if (f) fclose(f);
    free(path);
    if (st == KILN_OK) {
        *step = s;
        *world = w;
    }
    return st;
}

kiln_status kiln_zero1_save(kiln_zero1_t *z, const char *dir, int64_t step)
{
    if (!z || !dir) return kiln_error(KILN_ERR_ARG, "zero1_save: NULL");
    int rank = kiln_pg_rank(z->pg), world = kiln_pg_world_size(z->pg);
    const char *names[6];
    kiln_tensor_t *ts[6];
    char nm[6][16], totals[2][32], sbuf[32], wbuf[16], rbuf[16];
    int k = 0;
    for (int gi = 0; gi < 2; gi++) {
        snprintf(totals[gi], sizeof totals[gi], "%lld", (long long)z->gr[gi].total);
        if (!z->gr[gi].shard) continue;
        for (int j = 0; j < 3; j++, k++) {
            snprintf(nm[k], sizeof nm[k], "g%d.%c", gi, "pmv"[j]);
            names[k] = nm[k];
            ts[k] = z->gr[gi].pmv[j];
        }
    }
    snprintf(sbuf, sizeof sbuf, "%lld", (long long)step);
    snprintf(wbuf, sizeof wbuf, "%d", world);
    snprintf(rbuf, sizeof rbuf, "%d", rank);
    const char *meta[] = {"format", "kiln-zero1-shard-1", "step", sbuf, "world", wbuf, "rank", rbuf,
                          "total0", totals[0], "total1", totals[1], NULL};
    char *path = shard_path(dir, step, rank);
    kiln_status s = path ? kiln_safetensors_save(path, names, ts, k, meta) : kiln_error(KILN_ERR_OOM, "zero1: out of memory");
    free(path);
    /* Every rank's shard is on disk before the marker says so. A failure on one rank
     * still reaches the barrier, so that the others do not wait for it in vain. */
    kiln_status b = kiln_pg_barrier(z->pg);
    if (s == KILN_OK) s = b;
    return s;
}

kiln_status kiln_zero1_commit(const char *dir, int64_t step, int world, int64_t prev_step)
{
    char *path = marker_path(dir), text[96];
    if (!path) return kiln_error(KILN_ERR_OOM, "zero1: out of memory");
    int n = snprintf(text, sizeof text, "{\"step\": %lld, \"world\": %d}\n", (long long)step, world);
    /* whole or not at all (core/file.h): a marker names a complete set of shards */
    kiln_status s = kiln__file_write_atomic(path, text, (size_t)n, "the ZeRO-1 completion marker");
    free(path);
    /* The previous step's shards are now unreferenced. */
    for (int r = 0; s == KILN_OK && prev_step >= 0 && prev_step != step; r++) {
        char *old = shard_path(dir, prev_step, r);
        int gone = old ? unlink(old) : -1;
        free(old);
        if (gone != 0) break;
    }
    return s;
}

kiln_status kiln_zero1_load(kiln_zero1_t *z, const char *dir, int64_t step)
{
    if (!z || !dir) return kiln_error(KILN_ERR_ARG, "zero1_load: NULL");
    int64_t mstep;
    int old_world;
    kiln_status s = kiln_zero1_read_marker(dir, &mstep, &old_world);
    if (s != KILN_OK) return s;
    if (mstep != step)
        return kiln_error(KILN_ERR_FORMAT, "%s: the model is at step %lld but the last complete ZeRO-1 state is at step "
                          "%lld: the checkpoint is incomplete, and its shards are not loaded", dir, (long long)step,
                          (long long)mstep);
    bool prev = kiln_set_grad_enabled(false);
    int rank = kiln_pg_rank(z->pg);
    kiln_scope_begin();
    for (int gi = 0; s == KILN_OK && gi < 2; gi++) {
        group *g = &z->gr[gi];
        if (!g->shard) continue;
        int64_t old_shard = (g->total + old_world - 1) / old_world;
        for (int j = 0; s == KILN_OK && j < 3; j++) {
            /* This rank's new shard [rank * shard, ...) gathered from the old shards. */
            int64_t lo = rank * g->shard, hi = lo + g->shard < g->total ? lo + g->shard : g->total;
            s = kiln_fill_(g->pmv[j], 0);
            for (int r = 0; s == KILN_OK && r < old_world; r++) {
                int64_t olo = r * old_shard, ohi = olo + old_shard < g->total ? olo + old_shard : g->total;
                int64_t a = lo > olo ? lo : olo, b = hi < ohi ? hi : ohi;
                if (a >= b) continue;
                char *path = shard_path(dir, step, r), name[16];
                kiln_safetensors_t *f = NULL;
                s = path ? kiln_safetensors_load(path, &f) : kiln_error(KILN_ERR_OOM, "zero1: out of memory");
                snprintf(name, sizeof name, "g%d.%c", gi, "pmv"[j]);
                const char *fw = f ? kiln_safetensors_meta(f, "world") : NULL, *fs = f ? kiln_safetensors_meta(f, "step") : NULL;
                kiln_tensor_t *t = f ? kiln_safetensors_get(f, name) : NULL;
                int64_t fwn = -1, fsn = -1; /* as written: strict (core/parse.h), else not this shard */
                if (fw && !kiln__scan_i64(fw, &fwn)) fwn = -1;
                if (fs && !kiln__scan_i64(fs, &fsn)) fsn = -1;
                if (s == KILN_OK && (fwn != old_world || fsn != step))
                    s = kiln_error(KILN_ERR_FORMAT, "%s: not the shard of step %lld of %d ranks", path, (long long)step,
                                   old_world);
                else if (s == KILN_OK && (!t || kiln_tensor_numel(t) != old_shard))
                    s = kiln_error(KILN_ERR_FORMAT, "%s: %s is missing or not %lld elements", path, name,
                                   (long long)old_shard);
                if (s == KILN_OK)
                    s = kiln_tensor_copy_(kiln_narrow(g->pmv[j], 0, a - lo, b - a), kiln_narrow(t, 0, a - olo, b - a));
                kiln_safetensors_free(f);
                free(path);
            }
        }
    }
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    if (s == KILN_OK) s = kiln_fill_(z->step, (double)step);
    return s;
}
