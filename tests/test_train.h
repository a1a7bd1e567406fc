/* A GPT model with AdamW over all its parameters and the whole-step function on them,
 * as the training tests set them up (include after cmocka.h: it fails the test on an
 * error). */
#ifndef KILN_TEST_TRAIN_H
#define KILN_TEST_TRAIN_H
#include <stdlib.h>
#include "kiln/nn.h"
#include "kiln/optim.h"

typedef struct {
    kiln_gpt_t *m;
    kiln_optim_t *opt;
    kiln_tensor_t **ps; /* the model's parameters, in its order */
    int np;
    kiln_gpt_step step; /* kiln_gpt_train_step's context: clipping at the given norm */
} test_trainer;

/* A small GPT-2 for the training tests: one or two blocks, C = 32, T = 16, 40 tokens. */
static inline kiln_gpt_config test_small_gpt2(int n_layer)
{
    kiln_gpt_config cfg = kiln_gpt_config_gpt2();
    cfg.n_layer = n_layer;
    cfg.n_head = 2;
    cfg.n_kv_head = 2;
    cfg.n_embd = 32;
    cfg.block_size = 16;
    cfg.vocab_size = 40;
    return cfg;
}

/* The model of cfg from seed, AdamW (0.9, 0.95, 1e-8, weight decay 0.1), clip norm clip. */
static inline void test_trainer_new(test_trainer *t, const kiln_gpt_config *cfg, uint64_t seed, double clip)
{
    assert_int_equal(kiln_gpt_new(cfg, seed, &t->m), KILN_OK);
    t->np = kiln_gpt_num_params(t->m);
    t->ps = malloc(sizeof *t->ps * (size_t)t->np);
    assert_non_null(t->ps);
    for (int i = 0; i < t->np; i++) t->ps[i] = kiln_gpt_param(t->m, i, NULL);
    assert_int_equal(kiln_adamw_new(t->ps, t->np, NULL, 0.9, 0.95, 1e-8, 0.1, &t->opt), KILN_OK);
    t->step = (kiln_gpt_step){t->m, t->opt, t->ps, t->np, clip, 1, NULL, NULL, NULL};
}

static inline void test_trainer_free(test_trainer *t)
{
    kiln_optim_free(t->opt);
    kiln_gpt_free(t->m);
    free(t->ps);
}
#endif
