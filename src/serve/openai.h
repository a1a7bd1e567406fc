/* The OpenAI request and response formats, and the text of a generation as a client
 * sees it, with no HTTP and no engine in sight: pure functions that the server calls
 * and that tests/test_openai.c and the fuzzer (tests/fuzz/) drive directly. */
#ifndef KILN_SERVE_OPENAI_H
#define KILN_SERVE_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kiln/tokenizer.h" /* kiln_text_span */

#define KILN__MAX_STOPS 8 /* 4 from the request, the rest from the chat template */
#define KILN__MAX_N 16

typedef struct {
    char *role, *content;
} kiln__chat_msg;

/* A parsed /v1/completions or /v1/chat/completions body. Strings are owned. */
typedef struct {
    bool chat;
    char *model;                  /* NULL when absent */
    char *prompt;                 /* completions: the text ... */
    size_t prompt_len;
    int32_t *prompt_ids;          /* ... or token ids (prompt NULL then) */
    int n_prompt_ids;
    kiln__chat_msg *msgs;         /* chat */
    int n_msgs;
    int max_tokens;               /* -1: the server's default */
    double temperature, top_p;
    int top_k, n;
    double min_p, presence_penalty, frequency_penalty, repetition_penalty; /* 0: off */
    int32_t *bias_ids;            /* logit_bias: token id -> bias, n_bias of them */
    float *bias_vals;
    int n_bias;
    char *stop[KILN__MAX_STOPS];
    int n_stop;
    bool has_seed;
    uint64_t seed;
    bool stream, include_usage;
    int logprobs;                 /* -1: none, else how many alternatives (0..20) */
    bool parse_special;           /* chat: special-token text in contents taken as the tokens (kiln's
                                     "parse_special": true); by default it is plain text */
} kiln__oai_req;

/* Parses body[0..len). 0 on success; else the HTTP status (400), with a message in
 * err and the offending field in *param (NULL when none). r is always safe to free. */
int kiln__oai_parse(const char *body, size_t len, bool chat, kiln__oai_req *r, char *err, size_t n_err,
                    const char **param);
void kiln__oai_free(kiln__oai_req *r);

/* {"error": {"message", "type", "param", "code"}} as a new string. */
char *kiln__oai_error_json(const char *message, const char *type, const char *param, const char *code);

/* ---- chat templates (chat.c) ---- */

#define KILN__MAX_ROLES 8
typedef struct {
    char *prefix, *message, *generation;
    char *role[KILN__MAX_ROLES], *role_message[KILN__MAX_ROLES]; /* per-role messages */
    int n_roles;
    char *stop[KILN__MAX_STOPS];
    int n_stop;
} kiln__chat_template;

/* The kiln template of the family whose marker a Hugging Face (Jinja) template holds,
 * or NULL. */
const char *kiln__chat_family_of(const char *jinja);
/* --chat-template's value as a template: a family's name (kiln_chat_template_named), the
 * JSON itself (it starts with '{'), or a file that holds it; a new string in *out. */
kiln_status kiln__chat_template_resolve(const char *what, char **out);
/* Parses a template (kiln_chat_template_default's format); false with a reason in err. */
bool kiln__chat_template_parse(const char *json, kiln__chat_template *t, char *err, size_t n_err);
void kiln__chat_template_free(kiln__chat_template *t);
/* The prompt for msgs: a new string, or NULL when out of memory. With spans (room for n)
 * non-NULL, spans[i] is where message i's content lies in it, for the tokenizer to
 * read as plain text (kiln_tokenizer_encode_plain_new). */
char *kiln__chat_render(const kiln__chat_template *t, const kiln__chat_msg *msgs, int n);
char *kiln__chat_render_spans(const kiln__chat_template *t, const kiln__chat_msg *msgs, int n, kiln_text_span *spans);

/* Whether role is one a chat message may have (system, developer, user, assistant, tool,
 * function): any other is refused, so that a role cannot carry template text. */
bool kiln__chat_role_known(const char *role);

/* ---- the text of one generated sequence ----
 * Tokens arrive as bytes; the client must see valid UTF-8 (invalid bytes become
 * U+FFFD), nothing past a stop string, and, while streaming, nothing that a later
 * token could still change: a trailing incomplete UTF-8 character, or a tail that may
 * be the start of a stop string. Feeding the same bytes always yields the same text, so
 * a streamed answer equals the non-streamed one. */
typedef struct {
    char *bytes;          /* raw bytes of the generated tokens */
    size_t n_bytes, cap_bytes;
    char *text;           /* bytes made valid UTF-8 (recomputed on each push) */
    size_t n_text, cap_text;
    size_t emitted;       /* text[0..emitted) is final and sent */
    const char *const *stop;
    int n_stop;
    bool stopped;         /* a stop string was found: text ends before it */
} kiln__textstream;

void kiln__textstream_init(kiln__textstream *ts, const char *const *stop, int n_stop);
void kiln__textstream_free(kiln__textstream *ts);
/* Appends a token's bytes. Returns false when out of memory. */
bool kiln__textstream_push(kiln__textstream *ts, const char *bytes, size_t n);
/* Text that became final since the last call: [*from, *from + *len) of ts->text. With
 * end, the sequence is over and everything left is final. Sets ts->stopped when a stop
 * string appears (and the text then ends before it). */
void kiln__textstream_take(kiln__textstream *ts, bool end, size_t *from, size_t *len);

#endif
