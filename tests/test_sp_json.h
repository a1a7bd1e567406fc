/* A small SentencePiece-style (LLaMA-2) tokenizer.json for the tests: tests/test_tokenizer.c
 * checks kiln's ids on it against tokenizers', tests/test_hf.c its GGUF vocabulary. */
#ifndef KILN_TEST_SP_JSON_H
#define KILN_TEST_SP_JSON_H
#include <stdio.h>

#define SP "\xe2\x96\x81" /* U+2581, SentencePiece's space */
static const char *const sp_decoder = "{\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": "
                                      "{\"String\": \"" SP "\"}, \"content\": \" \"}, {\"type\": \"ByteFallback\"}, "
                                      "{\"type\": \"Fuse\"}, {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, "
                                      "\"stop\": 0}]}";
static const char *const sp_first = "{\"type\": \"Metaspace\", \"replacement\": \"" SP "\", \"prepend_scheme\": "
                                    "\"first\", \"split\": false}";
/* A small tokenizer.json of LLaMA-2's shape: ids 0..2 <unk> <s> </s> (also added tokens;
 * unk_extra adds fields to <unk>'s), 3..258 <0x00>..<0xFF>, then SP a b c d e h l o (259..)
 * and the merges' tokens SP h (268), el (269), lo (270), SP hel (271). model_extra's
 * fields override the model's (a later JSON key wins). The ids the tests expect of it
 * are what `tokenizers` 0.23.3 gives for the same file (the oracle), recorded here. */
static inline const char *sp_json(const char *normalizer, const char *pre, const char *decoder, const char *model_extra,
                           const char *unk_extra)
{
    static char buf[1 << 15];
    int o = snprintf(buf, sizeof buf,
                     "{\"added_tokens\": [{\"id\": 0, \"content\": \"<unk>\", \"special\": true%s}, {\"id\": 1, "
                     "\"content\": \"<s>\", \"special\": true}, {\"id\": 2, \"content\": \"</s>\", \"special\": true}], "
                     "\"normalizer\": %s, \"pre_tokenizer\": %s, \"decoder\": %s, \"model\": {\"type\": \"BPE\", "
                     "\"byte_fallback\": true, \"unk_token\": \"<unk>\", \"fuse_unk\": true%s, \"vocab\": {\"<unk>\": "
                     "0, \"<s>\": 1, \"</s>\": 2",
                     unk_extra, normalizer, pre, decoder, model_extra);
    for (int b = 0; b < 256; b++)
        o += snprintf(buf + o, sizeof buf - (size_t)o, ", \"<0x%02X>\": %d", b, 3 + b);
    const char *chars[] = {SP, "a", "b", "c", "d", "e", "h", "l", "o", SP "h", "el", "lo", SP "hel"};
    for (int k = 0; k < 13; k++)
        o += snprintf(buf + o, sizeof buf - (size_t)o, ", \"%s\": %d", chars[k], 259 + k);
    snprintf(buf + o, sizeof buf - (size_t)o,
             "}, \"merges\": [[\"" SP "\", \"h\"], [\"e\", \"l\"], [\"l\", \"o\"], [\"" SP "h\", \"el\"]]}}");
    return buf;
}

#endif
