/* The logits kiln computes for a model file, for tests/gguf/test_gguf_load.py:
 *     gguf_logits MODEL EXPECTED.safetensors OUT.f32
 * loads MODEL with kiln_model_load (a GGUF file, a run folder or a Hugging Face folder),
 * runs the forward on EXPECTED's idx (B,T) and writes the logits (B,T,V) as raw f32 to
 * OUT. Prints the config it made; exit 1 with kiln's message on any error. */
#include <stdio.h>
#include <stdlib.h>
#include "kiln/io.h"
#include "kiln/nn.h"
#include "kiln/tokenizer.h"

static int die(void)
{
    fprintf(stderr, "%s\n", kiln_last_error());
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: gguf_logits MODEL EXPECTED.safetensors OUT.f32\n");
        return 2;
    }
    kiln_gpt_t *m;
    kiln_tokenizer_t *tok;
    char *tmpl = NULL;
    kiln_safetensors_t *f;
    if (kiln_model_load(argv[1], &m, &tok, &tmpl) != KILN_OK || kiln_safetensors_load(argv[2], &f) != KILN_OK) return die();
    char *cfg = kiln_gpt_config_to_json(kiln_gpt_get_config(m));
    printf("config %s\ntokens %d\nchat_template %s\n", cfg ? cfg : "?", kiln_tokenizer_vocab_size(tok), tmpl ? tmpl : "(none)");
    free(cfg);
    kiln_scope_begin();
    kiln_tensor_t *got = kiln_gpt_forward(m, kiln_safetensors_get(f, "idx"), NULL, false, NULL);
    if (!got) return die();
    size_t n = (size_t)kiln_tensor_numel(got);
    float *a = malloc(sizeof(float) * n);
    FILE *o = fopen(argv[3], "wb");
    if (!a || !o || kiln_tensor_to_host(kiln_contiguous(got), a, sizeof(float) * n) != KILN_OK ||
        fwrite(a, sizeof(float), n, o) != n || fclose(o) != 0)
        return die();
    free(a);
    kiln_scope_end();
    kiln_safetensors_free(f);
    kiln_gpt_free(m);
    kiln_tokenizer_free(tok);
    free(tmpl);
    return 0;
}
