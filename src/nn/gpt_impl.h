/* The GPT model's pieces for the rest of the nn room (model_load.c). */
#ifndef KILN_NN_GPT_IMPL_H
#define KILN_NN_GPT_IMPL_H
#include "kiln/io.h"
#include "kiln/nn.h"

/* A model of config cfg whose parameters are the tensors of the kiln model file f (read
 * from path, which messages name) of their names: over the mapped file where they are
 * f32 (kiln_safetensors_view: nothing copied, only the pages read brought in), else
 * widened. A tensor missing or of another shape is an error naming it. */
kiln_status kiln__gpt_new_from_file(const kiln_gpt_config *cfg, const kiln_safetensors_t *f, const char *path,
                                    kiln_gpt_t **out);

#endif
