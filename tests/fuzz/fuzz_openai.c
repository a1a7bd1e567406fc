/* libFuzzer target over what the server does with bytes from the network before the
 * model sees them: the request parser (completions and chat), chat templates, and the
 * text stream (UTF-8 repair, stop strings). Besides crashes and sanitizer reports it
 * checks that streamed text is always valid UTF-8 and that splitting the same bytes
 * into other tokens never changes it. Run by scripts/fuzz.sh. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kiln/serve.h"
#include "serve/openai.h"

static int valid_utf8(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t l = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (!l || i + l > n || c == 0) return 0;
        for (size_t k = 1; k < l; k++)
            if ((s[i + k] & 0xC0) != 0x80) return 0;
        i += l;
    }
    return 1;
}

/* Streams data split at every byte equal to sep (sep < 0: one piece), dropping the
 * separators; returns the text sent (malloc'd). */
static char *stream(const uint8_t *data, size_t size, int sep, const char *const *stops, int n_stops, size_t *n_out)
{
    kiln__textstream ts;
    kiln__textstream_init(&ts, stops, n_stops);
    char *out = malloc(size * 3 + 8);
    size_t o = 0, start = 0, from, len;
    for (size_t i = 0; i <= size; i++) {
        if (i < size && (sep < 0 || data[i] != sep)) continue;
        kiln__textstream_push(&ts, (const char *)data + start, i - start);
        start = i + 1;
        kiln__textstream_take(&ts, i == size, &from, &len);
        if (!valid_utf8((const unsigned char *)ts.text + from, len)) __builtin_trap();
        memcpy(out + o, ts.text + from, len);
        o += len;
        if (ts.stopped) break;
    }
    kiln__textstream_free(&ts);
    *n_out = o;
    return out;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint8_t mode = data[0] % 4;
    data++;
    size--;
    if (mode < 2) {
        kiln__oai_req r;
        char err[512];
        const char *param;
        int st = kiln__oai_parse((const char *)data, size, mode == 1, &r, err, sizeof err, &param);
        if (st != 0 && st != 400) __builtin_trap();
        if (st == 0 && (r.n < 1 || r.n > KILN__MAX_N || r.n_stop > 4 || (!mode && !r.prompt && r.n_prompt_ids < 1)))
            __builtin_trap();
        kiln__oai_free(&r);
    } else if (mode == 2) {
        char *text = malloc(size + 1);
        memcpy(text, data, size);
        text[size] = '\0';
        kiln__chat_template t;
        char err[256];
        if (kiln__chat_template_parse(text, &t, err, sizeof err)) {
            kiln__chat_msg m[2] = {{"user", "{content}{role}"}, {"assistant", ""}};
            free(kiln__chat_render(&t, m, 2));
            kiln__chat_template_free(&t);
        }
        free(text);
    } else {
        /* The same bytes split at one separator and as one piece give the same text
         * (bytes equal to the separator are dropped from both). */
        static const char *stops[] = {"\nuser:", "\xC3\xA9", "zz"};
        uint8_t sep = size ? data[0] : 0;
        size_t n1, n2;
        char *a = stream(data, size, sep, stops, 3, &n1);
        uint8_t *joined = malloc(size + 1);
        size_t m = 0;
        for (size_t i = 0; i < size; i++)
            if (data[i] != sep) joined[m++] = data[i];
        char *b = stream(joined, m, -1, stops, 3, &n2);
        if (n1 != n2 || memcmp(a, b, n1)) __builtin_trap();
        free(a);
        free(b);
        free(joined);
    }
    return 0;
}
