/* Hugging Face model folders loaded as kiln models (kiln_hf_load, src/nn/hf.c).
 *
 * Oracle: transformers 5.25 on the same folders. tests/reference/hf/ holds tiny models
 * it made with random weights (tests/reference/hf_ref.py: LLaMA untied in f32, LLaMA
 * tied in bf16 with rope_theta 5e5, LLaMA with LLaMA 3.1's rope scaling, Mistral in f16
 * over two shards with a sliding window shorter than its context, Qwen2 with q/k/v
 * biases, Qwen2 with linear rope scaling, GPT-2 with Conv1D weights; Qwen3 with q/k norms
 * from a numpy reference of transformers' Qwen3, tests/reference/qwen3_ref.py),
 * each with its logits for two rows of 12 tokens, computed in float32 on the stored
 * weights, read back in float32. kiln's logits must be within 1e-5 of them everywhere
 * (|logits| up to about 2.2; measured 6e-7 to 1e-6 on 2026-12-06, float32
 * reassociation). Then bad folders: each refused with a message that names what is
 * wrong. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kiln/io.h"
#include "kiln/kiln.h"
#include "kiln/nn.h"
#include "kiln/ops.h"
#include "kiln/tokenizer.h"
#include "test_sp_json.h"
#include "test_util.h"

static char *ref_dir(const char *name)
{
    const char *src = getenv("KILN_SOURCE_DIR");
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/tests/reference/hf/%s", src ? src : ".", name);
    return buf;
}

static void matches_transformers(const char *name, int want_block_size)
{
    char dir[4096], exp[4200];
    snprintf(dir, sizeof dir, "%s", ref_dir(name));
    snprintf(exp, sizeof exp, "%s/expected.safetensors", dir);
    kiln_gpt_t *m;
    if (kiln_hf_load(dir, &m) != KILN_OK) fail_msg("%s: %s", name, kiln_last_error());
    assert_int_equal(kiln_gpt_get_config(m)->block_size, want_block_size);
    kiln_safetensors_t *f;
    assert_int_equal(kiln_safetensors_load(exp, &f), KILN_OK);
    kiln_scope_begin();
    kiln_tensor_t *idx = kiln_safetensors_get(f, "idx"), *want = kiln_safetensors_get(f, "logits");
    kiln_tensor_t *got = kiln_gpt_forward(m, idx, NULL, false, NULL);
    if (!got) fail_msg("%s: forward: %s", name, kiln_last_error());
    int64_t n = kiln_tensor_numel(want);
    assert_int_equal(kiln_tensor_numel(got), n);
    float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
    assert_int_equal(kiln_tensor_to_host(kiln_contiguous(got), a, sizeof(float) * (size_t)n), KILN_OK);
    assert_int_equal(kiln_tensor_to_host(want, b, sizeof(float) * (size_t)n), KILN_OK);
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= worst)) worst = d; /* a NaN makes worst NaN */
    }
    printf("# %s: logits max |kiln - transformers| = %.3g\n", name, worst);
    if (!(worst <= 1e-5)) fail_msg("%s: logits differ from transformers' by %g (tolerance 1e-5)", name, worst);
    free(a);
    free(b);
    kiln_scope_end();
    kiln_safetensors_free(f);
    kiln_gpt_free(m);
}

static void llama_matches_transformers(void **state) { matches_transformers("llama", 64); }
static void llama_tied_bf16_matches_transformers(void **state) { matches_transformers("llama_tied_bf16", 64); }
/* (its sliding window, 32, is shorter than its 64 positions: the context stops there) */
static void mistral_sharded_f16_matches_transformers(void **state) { matches_transformers("mistral_sharded_f16", 32); }
static void qwen2_matches_transformers(void **state) { matches_transformers("qwen2", 64); }
static void gpt2_matches_transformers(void **state) { matches_transformers("gpt2", 64); }
/* rope scaling: LLaMA 3.1's (a frequency in each of its three bands) and linear */
static void llama31_scaled_matches_transformers(void **state) { matches_transformers("llama31_scaled", 64); }
static void qwen2_linear_matches_transformers(void **state) { matches_transformers("qwen2_linear", 64); }
/* Qwen3 (q/k norms: each head's query and key RMS-normed before RoPE; tied embeddings).
 * Its expected logits are tests/reference/qwen3_ref.py's: transformers' Qwen3 forward
 * written in numpy, in float64 on the stored f32 weights, with the norms' weights random
 * (torch is not in the test venv; hf_ref.py makes the same folder with transformers where
 * it is). Same tolerance, 1e-5. */
static void qwen3_matches_reference(void **state) { matches_transformers("qwen3", 64); }

/* kiln_hf_load takes the f32 tensors of the files as they are, over the mapped file
 * (KILN_OPT_MMAP, on by default): of the LLaMA model's parameters only the stacked
 * q/k/v are new memory in kiln's allocator. With the switch off, all of them are. */
static void hf_load_maps_f32_weights_instead_of_copying(void **state)
{
    bool mapped = test_opt_on("MMAP");
    size_t before = kiln_memory_allocated();
    kiln_gpt_t *m;
    assert_int_equal(kiln_hf_load(ref_dir("llama"), &m), KILN_OK);
    size_t got = kiln_memory_allocated() - before, all = 0, qkv = 0;
    for (int i = 0; i < kiln_gpt_num_params(m); i++) {
        const char *name;
        size_t b = kiln_tensor_nbytes(kiln_gpt_param(m, i, &name));
        all += b;
        if (strstr(name, "attn.qkv")) qkv += b;
    }
    printf("# llama: %zu of %zu parameter bytes allocated (q/k/v stacked: %zu), mmap %s\n", got, all, qkv,
           mapped ? "on" : "off");
    assert_true(got >= qkv);
    if (mapped) assert_true(got < all / 4);
    else assert_true(got >= all);
    kiln_gpt_free(m);
    assert_int_equal(kiln_memory_allocated(), before);
}

/* kiln_model_load takes the folder as it is: the model, and bytes for a folder with no
 * tokenizer.json (these have 256 tokens). */
static void model_load_takes_a_hf_folder(void **state)
{
    kiln_gpt_t *m;
    kiln_tokenizer_t *t;
    assert_true(kiln_hf_is_folder(ref_dir("gpt2")));
    if (kiln_model_load(ref_dir("gpt2"), &m, &t, NULL) != KILN_OK) fail_msg("%s", kiln_last_error());
    assert_int_equal(kiln_tokenizer_vocab_size(t), 256);
    assert_int_equal(kiln_gpt_get_config(m)->n_layer, 2);
    kiln_tokenizer_free(t);
    kiln_gpt_free(m);
}

/* ---- out and back ---- */

static float *logits_of(kiln_gpt_t *m, int64_t *n)
{
    int64_t ids[2 * 12];
    for (int i = 0; i < 24; i++) ids[i] = (i * 37 + 11) % 256;
    kiln_scope_begin();
    kiln_tensor_t *x = kiln_from_data(ids, (int64_t[]){2, 12}, 2, KILN_DTYPE_I64);
    kiln_tensor_t *y = kiln_contiguous(kiln_gpt_forward(m, x, NULL, false, NULL));
    assert_non_null(y);
    *n = kiln_tensor_numel(y);
    float *out = malloc(sizeof(float) * (size_t)*n);
    assert_int_equal(kiln_tensor_to_host(y, out, sizeof(float) * (size_t)*n), KILN_OK);
    kiln_scope_end();
    return out;
}

static char tmp[64];

/* kiln_hf_save, then kiln_hf_load: the same model, bitwise the same logits in f32 (the
 * LLaMA, Qwen3 and GPT-2 layouts, tied and untied, with and without biases); in bf16 each
 * weight rounded once, the logits within 0.05 of f32's (|logits| ~2, weights ~0.1 with
 * 8 bits). The written config.json names the architecture transformers builds. */
static void a_saved_folder_loads_back_as_the_same_model(void **state)
{
    const char *models[] = {"llama", "llama_tied_bf16", "qwen2", "gpt2", "llama31_scaled", "qwen2_linear", "qwen3"};
    for (size_t k = 0; k < sizeof models / sizeof models[0]; k++)
        for (int bf = 0; bf < 2; bf++) {
            kiln_gpt_t *m, *back;
            assert_int_equal(kiln_hf_load(ref_dir(models[k]), &m), KILN_OK);
            char out[4200];
            snprintf(out, sizeof out, "%s/out-%s-%d", tmp, models[k], bf);
            if (kiln_hf_save(m, NULL, out, bf ? KILN_DTYPE_BF16 : KILN_DTYPE_F32) != KILN_OK)
                fail_msg("%s: %s", models[k], kiln_last_error());
            if (kiln_hf_load(out, &back) != KILN_OK) fail_msg("%s back: %s", models[k], kiln_last_error());
            int64_t n, n2;
            float *a = logits_of(m, &n), *b = logits_of(back, &n2);
            assert_int_equal(n, n2);
            double worst = 0;
            for (int64_t i = 0; i < n; i++)
                if (!(fabs((double)a[i] - b[i]) <= worst)) worst = fabs((double)a[i] - b[i]);
            if (bf ? !(worst <= 0.05) : worst != 0)
                fail_msg("%s %s: logits after the round trip differ by %g", models[k], bf ? "bf16" : "f32", worst);
            char cfg[4300], text[4096] = {0};
            snprintf(cfg, sizeof cfg, "%s/config.json", out);
            FILE *f = fopen(cfg, "r");
            assert_non_null(f);
            assert_true(fread(text, 1, sizeof text - 1, f) > 0);
            fclose(f);
            assert_non_null(strstr(text, !strcmp(models[k], "gpt2")    ? "GPT2LMHeadModel"
                                         : !strcmp(models[k], "qwen3") ? "Qwen3ForCausalLM"
                                                                       : "LlamaForCausalLM"));
            free(a);
            free(b);
            kiln_gpt_free(m);
            kiln_gpt_free(back);
        }
    /* Saved over a folder that holds a sharded model: its index, its shards and its
     * tokenizer.json go, and the folder loads as the new model. */
    {
        char over[4200], cmd[17000];
        snprintf(over, sizeof over, "%s/over", tmp);
        snprintf(cmd, sizeof cmd, "cp -r %s %s && echo '{}' > %s/tokenizer.json", ref_dir("mistral_sharded_f16"), over, over);
        assert_int_equal(system(cmd), 0);
        kiln_gpt_t *src, *back;
        assert_int_equal(kiln_hf_load(ref_dir("llama"), &src), KILN_OK);
        assert_int_equal(kiln_hf_save(src, NULL, over, KILN_DTYPE_F32), KILN_OK);
        if (kiln_hf_load(over, &back) != KILN_OK) fail_msg("%s", kiln_last_error());
        int64_t n, n2;
        float *a = logits_of(src, &n), *b = logits_of(back, &n2);
        assert_int_equal(n, n2);
        assert_memory_equal(a, b, sizeof(float) * (size_t)n);
        char probe[4300];
        struct stat st;
        snprintf(probe, sizeof probe, "%s/model.safetensors.index.json", over);
        assert_int_not_equal(stat(probe, &st), 0);
        snprintf(probe, sizeof probe, "%s/model-00001-of-00002.safetensors", over);
        assert_int_not_equal(stat(probe, &st), 0);
        snprintf(probe, sizeof probe, "%s/tokenizer.json", over);
        assert_int_not_equal(stat(probe, &st), 0);
        free(a);
        free(b);
        kiln_gpt_free(src);
        kiln_gpt_free(back);
    }
    /* a model neither family describes */
    kiln_gpt_config c = kiln_gpt_config_gpt2();
    c.pos = KILN_POS_ROPE;
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 1, &m), KILN_OK);
    char out[4200];
    snprintf(out, sizeof out, "%s/out-mixed", tmp);
    assert_int_equal(kiln_hf_save(m, NULL, out, KILN_DTYPE_F32), KILN_ERR_UNSUPPORTED);
    assert_non_null(strstr(kiln_last_error(), "neither a LLaMA"));
    kiln_clear_error();
    kiln_gpt_free(m);
}

static void write_text(const char *dir, const char *file, const char *text);

/* ---- GGUF ---- */

/* A reader for what kiln_gguf_save writes, written from the format's description (not
 * from the writer): the header, the key/value pairs (scalars kept by key), the tensor
 * infos, and where the data starts. */
typedef struct {
    const unsigned char *p;
    size_t n, at;
} rd;

static uint64_t rd_u(rd *r, int bytes)
{
    assert_true(r->at + (size_t)bytes <= r->n);
    uint64_t v = 0;
    memcpy(&v, r->p + r->at, (size_t)bytes);
    r->at += (size_t)bytes;
    return v;
}

static void rd_str(rd *r, char *out, size_t cap)
{
    uint64_t len = rd_u(r, 8);
    assert_true(r->at + len <= r->n && len < cap);
    memcpy(out, r->p + r->at, len);
    out[len] = 0;
    r->at += len;
}

static void rd_skip_value(rd *r, uint32_t type)
{
    static const int size[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    char tmp[4096];
    if (type == 8) rd_str(r, tmp, sizeof tmp);
    else if (type == 9) {
        uint32_t et = (uint32_t)rd_u(r, 4);
        uint64_t count = rd_u(r, 8);
        for (uint64_t i = 0; i < count; i++) rd_skip_value(r, et);
    } else {
        assert_true(type <= 12);
        r->at += (size_t)size[type];
    }
}

typedef struct {
    char name[64];
    uint32_t nd, type;
    uint64_t ne[4], off;
} rd_tensor;

/* The vocabulary's token types and scores of the file read last (up to 4096 tokens). */
static int32_t rd_types[4096];
static float rd_scores[4096];

/* The file's tensors (at most 64) and the start of its data; *keys gets the pairs whose
 * value is a u32 (as "key=value;") or a string ("key='value';"); rd_types and rd_scores
 * the vocabulary's arrays. */
static size_t read_gguf(const unsigned char *p, size_t n, rd_tensor *ts, uint64_t *nt, char *keys, size_t kcap)
{
    rd r = {p, n, 0};
    assert_memory_equal(p, "GGUF", 4);
    r.at = 4;
    assert_int_equal(rd_u(&r, 4), 3);
    *nt = rd_u(&r, 8);
    uint64_t nkv = rd_u(&r, 8);
    assert_true(*nt <= 64);
    keys[0] = 0;
    for (uint64_t i = 0; i < nkv; i++) {
        char k[256], v[256];
        rd_str(&r, k, sizeof k);
        uint32_t type = (uint32_t)rd_u(&r, 4);
        size_t len = strlen(keys);
        if (type == 4) snprintf(keys + len, kcap - len, "%s=%u;", k, (unsigned)rd_u(&r, 4));
        else if (type == 8) {
            rd_str(&r, v, sizeof v);
            snprintf(keys + len, kcap - len, "%s='%s';", k, v);
        } else if (type == 9 && (!strcmp(k, "tokenizer.ggml.token_type") || !strcmp(k, "tokenizer.ggml.scores"))) {
            uint32_t et = (uint32_t)rd_u(&r, 4);
            uint64_t count = rd_u(&r, 8);
            assert_true(et == (strstr(k, "scores") ? 6u : 5u) && count <= 4096 && r.at + 4 * count <= r.n);
            memcpy(strstr(k, "scores") ? (void *)rd_scores : (void *)rd_types, r.p + r.at, 4 * count);
            r.at += 4 * count;
        } else if (type == 9 && !strcmp(k, "tokenizer.ggml.tokens")) {
            size_t at = r.at;
            assert_int_equal(rd_u(&r, 4), 8);
            snprintf(keys + len, kcap - len, "%s=[%llu];", k, (unsigned long long)rd_u(&r, 8));
            r.at = at;
            rd_skip_value(&r, type);
        } else {
            rd_skip_value(&r, type);
        }
    }
    for (uint64_t i = 0; i < *nt; i++) {
        rd_str(&r, ts[i].name, sizeof ts[i].name);
        ts[i].nd = (uint32_t)rd_u(&r, 4);
        assert_true(ts[i].nd >= 1 && ts[i].nd <= 4);
        for (uint32_t d = 0; d < ts[i].nd; d++) ts[i].ne[d] = rd_u(&r, 8);
        ts[i].type = (uint32_t)rd_u(&r, 4);
        ts[i].off = rd_u(&r, 8);
        assert_int_equal(ts[i].off % 32, 0); /* each tensor aligned */
    }
    return (r.at + 31) / 32 * 32; /* the data, at the next multiple of the alignment */
}

/* The GGUF file at path read whole (into a buffer kept until the next call) and its
 * parts read as read_gguf does; *file gets the bytes, the return value the data's start. */
static size_t load_gguf(const char *path, const unsigned char **file, rd_tensor *ts, uint64_t *nt, char *keys,
                        size_t kcap)
{
    static unsigned char buf[1 << 20];
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    *file = buf;
    return read_gguf(buf, n, ts, nt, keys, kcap);
}

static const rd_tensor *find_t(const rd_tensor *ts, uint64_t nt, const char *name)
{
    for (uint64_t i = 0; i < nt; i++)
        if (!strcmp(ts[i].name, name)) return &ts[i];
    fail_msg("no tensor %s in the GGUF file", name);
    return NULL;
}

/* kiln_gguf_save on the LLaMA golden model, read back by the reader above: the header
 * and llama.cpp's keys with the model's values; blk.0.attn_q and attn_k are kiln's query
 * and key rows with each head's two halves interleaved (llama.cpp's rope pairs; k over
 * the 2 key heads of grouped-query attention, not the 4 query heads), bitwise in f32,
 * and attn_v its value rows as they are; in q8_0 every matrix whose rows are a multiple of
 * 32 long is blocks of an f16 scale d and 32 bytes, each value within 0.6 d of kiln's
 * (half a step, and the scale's f16 rounding). A GPT-2 model goes to llama.cpp's gpt2
 * architecture with its qkv as it is; a model neither architecture describes is
 * refused by name. */
static void gguf_holds_the_model_as_llama_cpp_reads_it(void **state)
{
    kiln_gpt_t *m;
    assert_int_equal(kiln_hf_load(ref_dir("llama"), &m), KILN_OK);
    kiln_tokenizer_t *tok = kiln_tokenizer_byte();
    const kiln_gpt_config *c = kiln_gpt_get_config(m);
    int64_t C = c->n_embd, hs = C / c->n_head;
    float *qkv = malloc(sizeof(float) * (size_t)((c->n_head + 2 * c->n_kv_head) * hs * C));
    assert_int_equal(kiln_tensor_to_host(kiln_gpt_find_param(m, "blocks.0.attn.qkv.weight"), qkv,
                                         sizeof(float) * (size_t)((c->n_head + 2 * c->n_kv_head) * hs * C)),
                     KILN_OK);
    for (int q8 = 0; q8 < 2; q8++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/model%d.gguf", tmp, q8);
        if (kiln_gguf_save(m, tok, path, KILN_DTYPE_F32, q8) != KILN_OK) fail_msg("%s", kiln_last_error());
        const unsigned char *file;
        rd_tensor ts[64];
        uint64_t nt;
        char keys[8192];
        size_t data = load_gguf(path, &file, ts, &nt, keys, sizeof keys);
        assert_int_equal(nt, 2 * 9 + 3); /* 9 a block, the embedding, the final norm, the head */
        const char *want[] = {"general.architecture='llama';", "llama.block_count=2;", "llama.context_length=64;",
                              "llama.embedding_length=32;", "llama.feed_forward_length=80;",
                              "llama.attention.head_count=4;", "llama.attention.head_count_kv=2;",
                              "llama.rope.dimension_count=8;", "tokenizer.ggml.model='gpt2';",
                              "tokenizer.ggml.tokens=[256];"};
        for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
            if (!strstr(keys, want[k])) fail_msg("the GGUF keys lack %s: %s", want[k], keys);
        assert_non_null(strstr(keys, q8 ? "general.file_type=7;" : "general.file_type=0;"));
        const rd_tensor *tq = find_t(ts, nt, "blk.0.attn_q.weight"), *tk = find_t(ts, nt, "blk.0.attn_k.weight"),
                        *tv = find_t(ts, nt, "blk.0.attn_v.weight");
        assert_true(tq->nd == 2 && tq->ne[0] == (uint64_t)C && tq->ne[1] == (uint64_t)(c->n_head * hs));
        assert_true(tk->nd == 2 && tk->ne[0] == (uint64_t)C && tk->ne[1] == (uint64_t)(c->n_kv_head * hs));
        assert_true(tv->nd == 2 && tv->ne[0] == (uint64_t)C && tv->ne[1] == (uint64_t)(c->n_kv_head * hs));
        assert_int_equal(tq->type, q8 ? 8 : 0);
        assert_int_equal(find_t(ts, nt, "blk.0.ffn_down.weight")->type, 0); /* rows of 80: f32 */
        /* Which kiln row each file row holds, as llama.cpp's convert_hf_to_gguf.py permutes
         * q and k: w.reshape(heads, 2, hs / 2, C).swapaxes(1, 2).reshape(rows, C), with
         * heads = n_kv_head for k (grouped-query attention: 2 key heads, 4 query heads
         * here). The file's row h hs + 2 j + half is kiln's row h hs + half hs / 2 + j; v
         * is not permuted. */
        int64_t nq = c->n_head * hs, nk = c->n_kv_head * hs, *src = malloc(sizeof(int64_t) * (size_t)(nq + 2 * nk));
        const int64_t base[3] = {0, nq, nq + nk}, heads[3] = {c->n_head, c->n_kv_head, 0}, nrows[3] = {nq, nk, nk};
        for (int part = 0; part < 3; part++) {
            if (!heads[part])
                for (int64_t rr = 0; rr < nrows[part]; rr++) src[base[part] + rr] = base[part] + rr;
            for (int64_t h = 0; h < heads[part]; h++)
                for (int64_t half = 0; half < 2; half++)
                    for (int64_t j = 0; j < hs / 2; j++)
                        src[base[part] + h * hs + 2 * j + half] = base[part] + h * hs + half * (hs / 2) + j;
        }
        for (int64_t r = 0; r < nq + 2 * nk; r++) {
            int part = r < nq ? 0 : r < nq + nk ? 1 : 2;
            const rd_tensor *t = part == 0 ? tq : part == 1 ? tk : tv;
            int64_t rr = r - base[part];
            for (int64_t col = 0; col < C; col++) {
                float want_v = qkv[src[r] * C + col], got;
                if (t->type == 0) {
                    memcpy(&got, file + data + t->off + (size_t)(rr * C + col) * 4, 4);
                    if (got != want_v) fail_msg("%s row %lld col %lld: %g, kiln %g", t->name, (long long)rr,
                                                (long long)col, got, want_v);
                } else {
                    const unsigned char *blk = file + data + t->off + (size_t)((rr * C + col) / 32) * 34;
                    uint16_t dh;
                    memcpy(&dh, blk, 2);
                    kiln_scope_begin();
                    kiln_tensor_t *dt = kiln_cast(kiln_from_data(&dh, (int64_t[]){1}, 1, KILN_DTYPE_F16), KILN_DTYPE_F32);
                    float d;
                    assert_int_equal(kiln_tensor_to_host(dt, &d, 4), KILN_OK);
                    kiln_scope_end();
                    got = d * (float)(int8_t)blk[2 + (rr * C + col) % 32];
                    if (!(fabsf(got - want_v) <= 0.6f * d))
                        fail_msg("%s q8_0 row %lld col %lld: %g, kiln %g, scale %g", t->name, (long long)rr,
                                 (long long)col, got, want_v, d);
                }
            }
        }
        free(src);
    }
    free(qkv);
    kiln_gpt_free(m);
    /* GPT-2: llama.cpp's gpt2 architecture, kiln's fused qkv as it is (bitwise), its
     * biases and learned positions */
    kiln_gpt_t *g;
    assert_int_equal(kiln_hf_load(ref_dir("gpt2"), &g), KILN_OK);
    char path[4200];
    snprintf(path, sizeof path, "%s/gpt2.gguf", tmp);
    if (kiln_gguf_save(g, tok, path, KILN_DTYPE_F32, false) != KILN_OK) fail_msg("%s", kiln_last_error());
    {
        const unsigned char *file;
        rd_tensor ts[64];
        uint64_t nt;
        char keys[8192];
        size_t data = load_gguf(path, &file, ts, &nt, keys, sizeof keys);
        assert_int_equal(nt, 2 * 12 + 4); /* 12 a block; embeddings, positions, the final norm's two */
        assert_non_null(strstr(keys, "general.architecture='gpt2';"));
        assert_non_null(strstr(keys, "gpt2.block_count=2;"));
        assert_non_null(strstr(keys, "gpt2.context_length=64;"));
        const rd_tensor *t = find_t(ts, nt, "blk.1.attn_qkv.weight");
        assert_true(t->nd == 2 && t->ne[0] == 32 && t->ne[1] == 96 && t->type == 0);
        float want[96 * 32];
        assert_int_equal(kiln_tensor_to_host(kiln_gpt_find_param(g, "blocks.1.attn.qkv.weight"), want, sizeof want),
                         KILN_OK);
        assert_memory_equal(file + data + t->off, want, sizeof want);
        assert_int_equal(find_t(ts, nt, "position_embd.weight")->ne[1], 64);
        assert_int_equal(find_t(ts, nt, "blk.0.ffn_down.bias")->type, 0);
    }
    kiln_gpt_free(g);
    /* Qwen3: llama.cpp's qwen3 architecture, which rotates halves as kiln does: q, k and v
     * split out of kiln's qkv as they are (bitwise, no reordering), and the heads' q and
     * k norms as blk.N.attn_q_norm / attn_k_norm */
    assert_int_equal(kiln_hf_load(ref_dir("qwen3"), &g), KILN_OK);
    snprintf(path, sizeof path, "%s/qwen3.gguf", tmp);
    if (kiln_gguf_save(g, tok, path, KILN_DTYPE_F32, false) != KILN_OK) fail_msg("%s", kiln_last_error());
    {
        const unsigned char *file;
        rd_tensor ts[64];
        uint64_t nt;
        char keys[8192];
        size_t data = load_gguf(path, &file, ts, &nt, keys, sizeof keys);
        assert_int_equal(nt, 2 * 11 + 2); /* 11 a block, the embedding (tied: no head), the final norm */
        const char *want_keys[] = {"general.architecture='qwen3';", "qwen3.block_count=2;",
                                   "qwen3.attention.head_count_kv=2;", "qwen3.rope.dimension_count=8;"};
        for (size_t k = 0; k < sizeof want_keys / sizeof want_keys[0]; k++)
            if (!strstr(keys, want_keys[k])) fail_msg("the GGUF keys lack %s: %s", want_keys[k], keys);
        float qkv3[64 * 32], qn[8];
        assert_int_equal(kiln_tensor_to_host(kiln_gpt_find_param(g, "blocks.1.attn.qkv.weight"), qkv3, sizeof qkv3),
                         KILN_OK);
        const rd_tensor *tq = find_t(ts, nt, "blk.1.attn_q.weight"), *tk = find_t(ts, nt, "blk.1.attn_k.weight");
        assert_true(tq->ne[1] == 32 && tk->ne[1] == 16);
        assert_memory_equal(file + data + tq->off, qkv3, sizeof(float) * 32 * 32);
        assert_memory_equal(file + data + tk->off, qkv3 + 32 * 32, sizeof(float) * 16 * 32);
        assert_int_equal(kiln_tensor_to_host(kiln_gpt_find_param(g, "blocks.1.attn.k_head_norm.weight"), qn, sizeof qn),
                         KILN_OK);
        const rd_tensor *tn = find_t(ts, nt, "blk.1.attn_k_norm.weight");
        assert_true(tn->nd == 1 && tn->ne[0] == 8 && tn->type == 0);
        assert_memory_equal(file + data + tn->off, qn, sizeof qn);
    }
    kiln_gpt_free(g);
    /* neither: layer norm with rope */
    kiln_gpt_config mc = kiln_gpt_config_gpt2();
    mc.pos = KILN_POS_ROPE;
    mc.vocab_size = 256;
    assert_int_equal(kiln_gpt_new(&mc, 1, &g), KILN_OK);
    assert_int_equal(kiln_gguf_save(g, tok, path, KILN_DTYPE_F32, false), KILN_ERR_UNSUPPORTED);
    assert_non_null(strstr(kiln_last_error(), "this model is neither"));
    kiln_clear_error();
    kiln_gpt_free(g);
    kiln_tokenizer_free(tok);
}

/* Rope scaling in the GGUF file as llama.cpp reads it: LLaMA 3.1's as rope_freqs.weight,
 * each unscaled frequency's divisor, against the rule transformers and llama.cpp's
 * converter state (computed here in double: 1 where the wavelength is shorter than
 * original_context / high_freq_factor, the factor where it is longer than
 * original_context / low_freq_factor, else 1 / ((1 - s) / factor + s)), within 1e-5;
 * linear scaling as llama.rope.scaling.type. (check_gguf.py runs llama.cpp on both.) */
/* A SentencePiece-style tokenizer (LLaMA-2's shape: <unk> <s> </s>, the 256 byte tokens,
 * characters, and four merges making "▁h", "el", "lo", "▁hel") goes to llama.cpp's
 * "llama" vocabulary: no pre-tokenizer name and no merges; token types 2 for <unk>, 3
 * for <s> and </s>, 6 for the byte tokens, 1 for the rest; a merged token scores minus
 * its merge's rank, every other token lower; the space prefix on (Metaspace "first");
 * <s>, </s> and <unk> named. (llama-cpp-python on such a file gave tokenizers' ids for
 * tests/tokenizer's multilingual text: docs/hf.md.) */
static void gguf_writes_a_sentencepiece_vocabulary(void **state)
{
    const char *json = sp_json("null", sp_first, sp_decoder, "", "");
    char tp[4200], gp[4200], keys[8192];
    snprintf(tp, sizeof tp, "%s/sp.json", tmp);
    FILE *f = fopen(tp, "w");
    assert_non_null(f);
    fputs(json, f);
    fclose(f);
    kiln_tokenizer_t *t;
    if (kiln_tokenizer_load(tp, &t) != KILN_OK) fail_msg("%s", kiln_last_error());
    kiln_gpt_config c = kiln_gpt_config_llama();
    c.n_layer = 1, c.n_embd = 32, c.n_head = 4, c.n_kv_head = 2, c.block_size = 16, c.bias = false;
    c.vocab_size = kiln_tokenizer_vocab_size(t);
    kiln_gpt_t *m;
    assert_int_equal(kiln_gpt_new(&c, 1, &m), KILN_OK);
    snprintf(gp, sizeof gp, "%s/sp.gguf", tmp);
    if (kiln_gguf_save(m, t, gp, KILN_DTYPE_F32, false) != KILN_OK) fail_msg("%s", kiln_last_error());
    const unsigned char *file;
    rd_tensor ts[64];
    uint64_t nt;
    size_t data = load_gguf(gp, &file, ts, &nt, keys, sizeof keys);
    assert_non_null(strstr(keys, "tokenizer.ggml.model='llama';"));
    assert_null(strstr(keys, "tokenizer.ggml.pre="));
    assert_non_null(strstr(keys, "tokenizer.ggml.tokens=[272];"));
    assert_non_null(strstr(keys, "tokenizer.ggml.unknown_token_id=0;"));
    assert_non_null(strstr(keys, "tokenizer.ggml.bos_token_id=1;"));
    assert_non_null(strstr(keys, "tokenizer.ggml.eos_token_id=2;"));
    assert_int_equal(rd_types[0], 2);
    assert_int_equal(rd_types[1], 3);
    assert_int_equal(rd_types[2], 3);
    for (int id = 3; id < 259; id++) assert_int_equal(rd_types[id], 6);
    for (int id = 259; id < 272; id++) assert_int_equal(rd_types[id], 1);
    for (int r = 0; r < 4; r++) assert_true(rd_scores[268 + r] == -(float)r);
    for (int id = 0; id < 268; id++) assert_true(rd_scores[id] < -3);
    /* the space prefix: a bool, read here from the bytes after its key */
    const char *want = "tokenizer.ggml.add_space_prefix";
    bool found = false;
    for (size_t i = 0; i + strlen(want) + 5 < data && !found; i++) /* in the header, before the data */
        if (!memcmp(file + i, want, strlen(want))) {
            found = true;
            assert_int_equal(file[i + strlen(want)], 7); /* bool */
            assert_int_equal(file[i + strlen(want) + 4], 1);
        }
    assert_true(found);
    kiln_gpt_free(m);
    kiln_tokenizer_free(t);
}

static char *variant(const char *name, const char *from, const char *to);

static void gguf_holds_rope_scaling(void **state)
{
    kiln_gpt_t *m;
    assert_int_equal(kiln_hf_load(ref_dir("llama31_scaled"), &m), KILN_OK);
    kiln_tokenizer_t *tok = kiln_tokenizer_byte();
    char path[4200], keys[8192];
    snprintf(path, sizeof path, "%s/scaled.gguf", tmp);
    if (kiln_gguf_save(m, tok, path, KILN_DTYPE_F32, false) != KILN_OK) fail_msg("%s", kiln_last_error());
    const unsigned char *file;
    rd_tensor ts[64];
    uint64_t nt;
    size_t data = load_gguf(path, &file, ts, &nt, keys, sizeof keys);
    const rd_tensor *t = find_t(ts, nt, "rope_freqs.weight");
    assert_int_equal(t->nd, 1);
    assert_int_equal(t->ne[0], 4);
    assert_int_equal(t->type, 0);
    const kiln_rope_scaling *r = &kiln_gpt_get_config(m)->rope_scaling;
    assert_int_equal(r->kind, KILN_ROPE_SCALING_LLAMA3);
    int bands[3] = {0};
    for (int i = 0; i < 4; i++) {
        double f = pow(kiln_gpt_get_config(m)->rope_theta, -2.0 * i / 8), wl = 2 * M_PI / f, want;
        double lo = r->original_context / r->low_freq_factor, hi = r->original_context / r->high_freq_factor;
        double sm = (r->original_context / wl - r->low_freq_factor) / (r->high_freq_factor - r->low_freq_factor);
        want = wl < hi ? 1 : wl > lo ? r->factor : 1 / ((1 - sm) / r->factor + sm);
        bands[wl < hi ? 0 : wl > lo ? 2 : 1]++;
        float got;
        memcpy(&got, file + data + t->off + 4 * (size_t)i, 4);
        if (!(fabs(got - want) <= 1e-5 * want)) fail_msg("rope_freqs[%d] = %g, want %g", i, got, want);
    }
    assert_true(bands[0] && bands[1] && bands[2]); /* the model touches all three */
    kiln_gpt_free(m);
    /* linear, on the LLaMA model with its rope_type changed */
    assert_int_equal(kiln_hf_load(variant("linear", "\"rope_type\": \"default\"", "\"rope_type\": \"linear\", \"factor\": 2.0"),
                                  &m), KILN_OK);
    assert_int_equal(kiln_gpt_get_config(m)->rope_scaling.kind, KILN_ROPE_SCALING_LINEAR);
    assert_int_equal(kiln_gguf_save(m, tok, path, KILN_DTYPE_F32, false), KILN_OK);
    load_gguf(path, &file, ts, &nt, keys, sizeof keys);
    assert_non_null(strstr(keys, "llama.rope.scaling.type='linear';"));
    for (uint64_t i = 0; i < nt; i++) assert_string_not_equal(ts[i].name, "rope_freqs.weight");
    kiln_gpt_free(m);
    kiln_tokenizer_free(tok);
}

/* The tokenizer's pre-tokenizer is named as llama.cpp names it (LLaMA-3's Split pattern:
 * llama-bpe); a pattern llama.cpp has no name for is refused, and so is a tokenizer of
 * another size than the model's vocabulary. */
static void gguf_names_the_pre_tokenizer_or_refuses_it(void **state)
{
    static const char *llama3 = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| "
                                "?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+";
    kiln_gpt_t *m;
    assert_int_equal(kiln_hf_load(ref_dir("llama"), &m), KILN_OK);
    kiln_tokenizer_t *byte = kiln_tokenizer_byte();
    char *text = kiln_tokenizer_to_json(byte);
    assert_non_null(text);
    for (int k = 0; k < 2; k++) {
        /* the byte vocabulary with a Split on LLaMA-3's pattern, or on one of our own */
        const char *at = strstr(text, "\"pre_tokenizer\"");
        assert_non_null(at);
        const char *end = strstr(at, "\"post_processor\"");
        assert_non_null(end);
        char *j = malloc(strlen(text) + 4096);
        snprintf(j, strlen(text) + 4096,
                 "%.*s\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", "
                 "\"pattern\": {\"Regex\": \"%s\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": "
                 "\"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": false}]}, %s",
                 (int)(at - text), text, k ? "\\\\\\\\p{L}+|." : llama3, end);
        char tp[4200], gp[4200];
        snprintf(tp, sizeof tp, "%s/split%d.json", tmp, k);
        FILE *f = fopen(tp, "w");
        assert_non_null(f);
        fputs(j, f);
        fclose(f);
        free(j);
        kiln_tokenizer_t *t;
        if (kiln_tokenizer_load(tp, &t) != KILN_OK) fail_msg("%s", kiln_last_error());
        snprintf(gp, sizeof gp, "%s/split%d.gguf", tmp, k);
        kiln_status s = kiln_gguf_save(m, t, gp, KILN_DTYPE_F32, false);
        if (k == 0) {
            if (s != KILN_OK) fail_msg("%s", kiln_last_error());
            FILE *g = fopen(gp, "rb");
            static char file[1 << 20];
            size_t n = fread(file, 1, sizeof file, g);
            fclose(g);
            bool named = false;
            for (size_t i = 0; i + 9 < n && !named; i++) named = !memcmp(file + i, "llama-bpe", 9);
            assert_true(named);
        } else {
            assert_int_equal(s, KILN_ERR_UNSUPPORTED);
            assert_non_null(strstr(kiln_last_error(), "none that llama.cpp names"));
            kiln_clear_error();
        }
        kiln_tokenizer_free(t);
    }
    free(text);
    /* a tokenizer of another size */
    kiln_gpt_config c = *kiln_gpt_get_config(m);
    c.vocab_size = 300;
    kiln_gpt_t *big;
    assert_int_equal(kiln_gpt_new(&c, 1, &big), KILN_OK);
    char gp[4200];
    snprintf(gp, sizeof gp, "%s/big.gguf", tmp);
    assert_int_equal(kiln_gguf_save(big, byte, gp, KILN_DTYPE_F32, false), KILN_ERR_ARG);
    assert_non_null(strstr(kiln_last_error(), "the model has 300 tokens but its tokenizer 256"));
    kiln_clear_error();
    kiln_gpt_free(big);
    kiln_tokenizer_free(byte);
    kiln_gpt_free(m);
    /* a kiln run folder that keeps its options in a config.json is not a HF folder */
    char opt[4200];
    snprintf(opt, sizeof opt, "%s/optrun", tmp);
    mkdir(opt, 0755);
    write_text(opt, "config.json", "{\"steps\": 10}");
    assert_false(kiln_hf_is_folder(opt));
}

/* ---- bad folders ---- */

static int make_tmp(void **state)
{
    snprintf(tmp, sizeof tmp, "/tmp/kiln-hf-XXXXXX");
    return mkdtemp(tmp) ? 0 : -1;
}

static int remove_tmp(void **state)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    return system(cmd) == 0 ? 0 : -1;
}

static void write_text(const char *dir, const char *file, const char *text)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* A copy of the llama folder at DIR/name whose config.json has `from` replaced by
 * `to` (or is `to` whole when from is NULL). */
static char *variant(const char *name, const char *from, const char *to)
{
    static char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", tmp, name);
    mkdir(dir, 0755);
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "cp %s/model.safetensors %s/", ref_dir("llama"), dir);
    assert_int_equal(system(cmd), 0);
    char path[4200], text[8192];
    snprintf(path, sizeof path, "%s/config.json", ref_dir("llama"));
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    if (!from) {
        write_text(dir, "config.json", to);
        return dir;
    }
    char *at = strstr(text, from), out[8400];
    assert_non_null(at);
    snprintf(out, sizeof out, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    write_text(dir, "config.json", out);
    return dir;
}

static void refused(const char *dir, kiln_status want, const char *says)
{
    kiln_gpt_t *m = (kiln_gpt_t *)1;
    kiln_status s = kiln_hf_load(dir, &m);
    if (s != want || !strstr(kiln_last_error(), says))
        fail_msg("%s: status %d, message '%s'; wanted %d naming '%s'", dir, s, kiln_last_error(), want, says);
    assert_null(m);
    kiln_clear_error();
}

static void config_fields_kiln_cannot_honour_are_refused_by_name(void **state)
{
    refused(variant("rope", "\"rope_type\": \"default\"", "\"rope_type\": \"yarn\", \"factor\": 8.0"),
            KILN_ERR_UNSUPPORTED, "rope scaling 'yarn'");
    refused(variant("ropedyn", "\"rope_type\": \"default\"", "\"rope_type\": \"dynamic\", \"factor\": 8.0"),
            KILN_ERR_UNSUPPORTED, "rope scaling 'dynamic'");
    refused(variant("rope3", "\"rope_type\": \"default\"", "\"rope_type\": \"llama3\", \"factor\": 8.0"),
            KILN_ERR_FORMAT, "rope scaling needs 'low_freq_factor'");
    refused(variant("ropebands", "\"rope_type\": \"default\"",
                    "\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 4, \"high_freq_factor\": 1, "
                    "\"original_max_position_embeddings\": 64"),
            KILN_ERR_FORMAT, "low_freq_factor (4) < high_freq_factor (1)");
    refused(variant("ropelin", "\"rope_type\": \"default\"", "\"rope_type\": \"linear\", \"factor\": -2"),
            KILN_ERR_FORMAT, "factor = -2 must be positive");
    refused(variant("partial", "\"rope_type\": \"default\"", "\"rope_type\": \"default\", \"partial_rotary_factor\": 0.5"),
            KILN_ERR_UNSUPPORTED, "partial_rotary_factor 0.5");
    refused(variant("act", "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""), KILN_ERR_UNSUPPORTED,
            "hidden_act 'gelu'");
    refused(variant("headdim", "\"head_dim\": 8", "\"head_dim\": 16"), KILN_ERR_UNSUPPORTED, "head_dim 16");
    refused(variant("type", "\"model_type\": \"llama\"", "\"model_type\": \"falcon\""), KILN_ERR_UNSUPPORTED,
            "model_type 'falcon'");
    refused(variant("nolayers", "\"num_hidden_layers\": 2,", ""), KILN_ERR_FORMAT, "'num_hidden_layers' is missing");
    refused(variant("json", NULL, "{\"model_type\": \"llama\", "), KILN_ERR_FORMAT, "config.json: line");
    refused(variant("heads", "\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"), KILN_ERR_UNSUPPORTED,
            "n_kv_head");
    char none[4200];
    snprintf(none, sizeof none, "%s/none", tmp);
    refused(none, KILN_ERR_IO, "not a Hugging Face model folder");
}

/* A config that makes other shapes than the weights', a tensor missing, and a tensor
 * no parameter takes: each named. */
static void weights_that_do_not_fit_are_refused_by_name(void **state)
{
    refused(variant("ffn", "\"intermediate_size\": 80", "\"intermediate_size\": 96"), KILN_ERR_FORMAT,
            "model.layers.0.mlp.gate_proj.weight is");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", variant("extra", "x", "x"));
    kiln_safetensors_t *f;
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(kiln_safetensors_load(path, &f), KILN_OK);
    int n = kiln_safetensors_count(f);
    const char **names = malloc(sizeof *names * (size_t)(n + 1));
    kiln_tensor_t **ts = malloc(sizeof *ts * (size_t)(n + 1));
    kiln_scope_begin();
    int k = 0;
    for (int i = 0; i < n; i++) {
        const char *nm = kiln_safetensors_name(f, i);
        if (!strcmp(nm, "model.norm.weight")) continue; /* dropped */
        names[k] = nm;
        ts[k++] = kiln_safetensors_get(f, nm);
    }
    names[k] = "model.layers.0.self_attn.q_norm.weight"; /* a tensor kiln has no place for */
    ts[k++] = kiln_ones((int64_t[]){8}, 1, KILN_DTYPE_F32);
    char missing[4096];
    snprintf(missing, sizeof missing, "%s", variant("missing", "x", "x"));
    char p2[4200];
    snprintf(p2, sizeof p2, "%s/model.safetensors", missing);
    assert_int_equal(kiln_safetensors_save(p2, names, ts, k - 1, NULL), KILN_OK);
    /* the extra one, with the norm put back */
    names[k - 1] = "model.norm.weight";
    ts[k - 1] = kiln_ones((int64_t[]){32}, 1, KILN_DTYPE_F32);
    names[k] = "model.layers.0.self_attn.q_norm.weight";
    ts[k] = kiln_ones((int64_t[]){8}, 1, KILN_DTYPE_F32);
    assert_int_equal(kiln_safetensors_save(path, names, ts, k + 1, NULL), KILN_OK);
    kiln_scope_end();
    kiln_safetensors_free(f);
    free(names);
    free(ts);
    refused(missing, KILN_ERR_FORMAT, "no tensor model.norm.weight for kiln's norm_f.weight");
    refused(dir, KILN_ERR_UNSUPPORTED, "tensor 'model.layers.0.self_attn.q_norm.weight' has no place");
}

int main(void)
{
    kiln_init(1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(llama_matches_transformers),
        cmocka_unit_test(llama_tied_bf16_matches_transformers),
        cmocka_unit_test(mistral_sharded_f16_matches_transformers),
        cmocka_unit_test(llama31_scaled_matches_transformers),
        cmocka_unit_test(hf_load_maps_f32_weights_instead_of_copying),
        cmocka_unit_test(qwen2_linear_matches_transformers),
        cmocka_unit_test(qwen2_matches_transformers),
        cmocka_unit_test(qwen3_matches_reference),
        cmocka_unit_test(gpt2_matches_transformers),
        cmocka_unit_test(model_load_takes_a_hf_folder),
        cmocka_unit_test(a_saved_folder_loads_back_as_the_same_model),
        cmocka_unit_test(gguf_holds_the_model_as_llama_cpp_reads_it),
        cmocka_unit_test(gguf_names_the_pre_tokenizer_or_refuses_it),
        cmocka_unit_test(gguf_holds_rope_scaling),
        cmocka_unit_test(gguf_writes_a_sentencepiece_vocabulary),
        cmocka_unit_test(config_fields_kiln_cannot_honour_are_refused_by_name),
        cmocka_unit_test(weights_that_do_not_fit_are_refused_by_name),
    };
    return cmocka_run_group_tests(tests, make_tmp, remove_tmp);
}
