/* kiln's GPT parameters against the names of other formats (Hugging Face folders, hf.c;
 * GGUF files, gguf.c): one pair a name, a block's with its index as %d, looked up the
 * same way by both (the families' lists of pairs are src/nn/arch.c's), and what every
 * export refuses. */
#ifndef KILN_NN_NAMES_H
#define KILN_NN_NAMES_H
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include "kiln/nn.h"

typedef struct {
    const char *kiln, *other;
    bool transposed; /* stored (in, out) there: GPT-2's Conv1D weights */
} kiln__name_pair;

/* The entry of t[0..n) for kiln's parameter `name`; its block index in *layer (-1 for
 * none) and its name after "blocks.N." in *rest, found or not. */
static inline const kiln__name_pair *kiln__name_lookup(const kiln__name_pair *t, size_t n, const char *name,
                                                       int *layer, const char **rest)
{
    int i = -1;
    *rest = name;
    /* "blocks.N." with N of 1 to 9 digits (sscanf's %d would take a sign, space and an
     * overflowing count) */
    if (!strncmp(name, "blocks.", 7)) {
        const char *d = name + 7, *e = d;
        while (*e >= '0' && *e <= '9' && e - d < 10) e++;
        if (e > d && e - d <= 9 && *e == '.') {
            i = 0;
            for (; d < e; d++) i = i * 10 + (*d - '0');
            *rest = e + 1;
        }
    }
    *layer = i;
    for (size_t k = 0; k < n; k++)
        if (!strcmp(*rest, t[k].kiln) && (i >= 0) == (strchr(t[k].other, '%') != NULL)) return &t[k];
    return NULL;
}

/* Whether the config's attention is a flex variant (not "" or "causal"), which the
 * paged serving path and the exports refuse. */
static inline bool kiln__gpt_has_variant(const kiln_gpt_config *c)
{
    return c->attention[0] && strcmp(c->attention, "causal") != 0;
}

/* Whether a format whose runtime (peer: "llama.cpp would", "transformers' LLaMA and
 * GPT-2") runs causal attention over dense MLPs can hold the model: an error of who's
 * naming what it cannot write, or KILN_OK. */
static inline kiln_status kiln__gpt_exportable(const kiln_gpt_config *c, const char *who, const char *peer)
{
    if (c->n_routed_experts > 0 || c->mla_kv_rank > 0)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: the model has %s, which this export does not write yet", who,
                          c->n_routed_experts > 0 ? "mixture-of-experts blocks" : "multi-head latent attention");
    if (kiln__gpt_has_variant(c))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: the model's attention is '%s'; %s run causal attention, so the "
                          "exported model would compute something else", who, c->attention, peer);
    return KILN_OK;
}

#endif
