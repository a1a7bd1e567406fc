/* The OpenAI-compatible HTTP server in front of the engine: its options, start, model
 * load and shutdown. The rest is split by concern; server_impl.h lists the files.
 *
 * HTTP is libmicrohttpd: a Debian-packaged (libmicrohttpd-dev), maintained HTTP/1.1
 * stack in C with its own thread pool over epoll, request-size and idle-time limits,
 * and suspend/resume, which lets a waiting or streaming client hold no thread: its
 * connection is suspended until the engine has tokens for it, then resumed from the
 * engine's thread. JSON is jansson, which kiln already uses for configs (Debian's
 * libjansson-dev). Writing either by hand would only add places for bugs.
 *
 * A request's life: the access handler (http.c) collects the body and routes it; a
 * generation request is parsed (openai.c), its chat messages rendered, its prompt
 * tokenized, and one engine request submitted per choice into a job (generate.c,
 * jobs.c), whose tokens are streamed (sse.c) or answered at the end. */
#include <arpa/inet.h>
#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>
#include <netinet/in.h>
#include <stdlib.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <string.h>
#include "core/util.h"
#include "kiln/io.h"
#include "serve/server_impl.h"

const char *kiln_server_http_version(void) { return MHD_get_version(); }

kiln_server_opts kiln_server_opts_default(void)
{
    kiln_server_opts o = {
        .host = "127.0.0.1",
        .port = 8000,
        .api_key = NULL,
        .model_name = NULL,
        .cors_origin = "*",
        .http_threads = 4,
        .max_body = 1 << 20,
        .request_timeout = 300,
        .idle_timeout = 30,
        .max_tokens_default = 16,
        .engine = kiln_engine_opts_default(),
    };
    return o;
}

static char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

kiln_status kiln_server_new(const kiln_server_opts *o, kiln_server_t **out)
{
    if (!o || !out) return kiln_error(KILN_ERR_ARG, "server_new: opts and out must not be NULL");
    *out = NULL;
    if (o->port < 0 || o->port > 65535) return kiln_error(KILN_ERR_ARG, "server: port %d is not in 0..65535", o->port);
    if (o->http_threads < 1 || o->http_threads > 1024)
        return kiln_error(KILN_ERR_ARG, "server: http_threads %d is not in 1..1024", o->http_threads);
    if (o->max_body < 16) return kiln_error(KILN_ERR_ARG, "server: max_body %zu is under 16 bytes", o->max_body);
    if (!(o->request_timeout > 0)) return kiln_error(KILN_ERR_ARG, "server: request_timeout must be positive");
    if (o->max_tokens_default < 1) return kiln_error(KILN_ERR_ARG, "server: max_tokens_default must be >= 1");
    if (o->idle_timeout < 1) return kiln_error(KILN_ERR_ARG, "server: idle_timeout must be >= 1 second");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o->port)};
    const char *host = o->host ? o->host : "127.0.0.1";
    if (inet_pton(AF_INET, !strcmp(host, "localhost") ? "127.0.0.1" : host, &addr.sin_addr) != 1)
        return kiln_error(KILN_ERR_ARG, "server: host '%s' is not an IPv4 address", host);
    kiln_server_t *s = calloc(1, sizeof *s);
    if (!s) return kiln_error(KILN_ERR_OOM, "server_start: out of memory");
    s->o = *o;
    s->host = strdup(host);
    s->api_key = dup_or_null(o->api_key && *o->api_key ? o->api_key : NULL);
    s->cors = strdup(o->cors_origin ? o->cors_origin : "*");
    s->name_opt = dup_or_null(o->model_name);
    s->tmpl_opt = dup_or_null(o->chat_template);
    s->o.chat_template = s->tmpl_opt;
    s->o.host = s->host;
    s->o.api_key = s->api_key;
    s->o.cors_origin = s->cors;
    s->o.model_name = s->name_opt;
    s->eot = -1;
    s->bos = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (!s->host || !s->cors || (o->api_key && *o->api_key && !s->api_key) || (o->model_name && !s->name_opt) ||
        (o->chat_template && !s->tmpl_opt)) {
        kiln_server_free(s);
        return kiln_error(KILN_ERR_OOM, "server_start: out of memory");
    }
    *out = s;
    return KILN_OK;
}

kiln_status kiln_server_listen(kiln_server_t *s)
{
    if (!s) return kiln_error(KILN_ERR_ARG, "server_listen: server must not be NULL");
    if (s->d) return kiln_error(KILN_ERR_ARG, "server_listen: it listens already");
    const kiln_server_opts *o = &s->o;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o->port)};
    inet_pton(AF_INET, !strcmp(s->host, "localhost") ? "127.0.0.1" : s->host, &addr.sin_addr); /* (checked by new) */
    /* The socket bound here rather than by libmicrohttpd, so that a port in use is one
     * clear error (libmicrohttpd would log its own line as well) */
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd < 0) return kiln_error(KILN_ERR_IO, "server: cannot make a socket: %s", strerror(errno));
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 128) != 0) {
        int e = errno;
        close(fd);
        if (e == EADDRINUSE)
            return kiln_error(KILN_ERR_IO, "port %d on %s is in use (another kiln serve?); --port 0 picks a free one",
                              o->port, s->host);
        return kiln_error(KILN_ERR_IO, "cannot listen on %s:%d: %s", s->host, o->port, strerror(e));
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    s->d = MHD_start_daemon(flags, (uint16_t)o->port, NULL, NULL, kiln__serve_on_request, s, MHD_OPTION_LISTEN_SOCKET, fd,
                            MHD_OPTION_THREAD_POOL_SIZE, (unsigned)o->http_threads, MHD_OPTION_CONNECTION_TIMEOUT,
                            (unsigned)o->idle_timeout, MHD_OPTION_CONNECTION_LIMIT, (unsigned)1024, MHD_OPTION_NOTIFY_COMPLETED,
                            kiln__serve_on_completed, s, MHD_OPTION_URI_LOG_CALLBACK, kiln__serve_on_uri, s,
                            MHD_OPTION_END);
    if (!s->d) {
        close(fd);
        return kiln_error(KILN_ERR_IO, "server: cannot serve on %s:%d (libmicrohttpd refused)", s->host, o->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : o->port;
    if (pthread_create(&s->watchdog, NULL, kiln__serve_watchdog_main, s) == 0) s->watchdog_started = true;
    return KILN_OK;
}

kiln_status kiln_server_start(const kiln_server_opts *o, kiln_server_t **out)
{
    kiln_status st = kiln_server_new(o, out);
    if (st != KILN_OK) return st;
    if ((st = kiln_server_listen(*out)) != KILN_OK) {
        kiln_server_free(*out);
        *out = NULL;
    }
    return st;
}

int kiln_server_port(const kiln_server_t *s) { return s ? s->port : 0; }

/* The model's name: the run folder's, or the file's without ".safetensors". */
static char *name_from_path(const char *path)
{
    char *p = strdup(path), *e = p ? p + strlen(p) : NULL;
    if (!p) return NULL;
    while (e > p + 1 && e[-1] == '/') *--e = '\0';
    size_t n = strlen(p);
    if (n > 5 && !strcmp(p + n - 5, ".gguf")) p[n - 5] = '\0'; /* model-Q8_0.gguf: model-Q8_0 */
    if (n > 12 && !strcmp(p + n - 12, ".safetensors")) {
        p[n - 12] = '\0';
        char *slash = strrchr(p, '/');
        if (slash && !strcmp(slash + 1, "model")) *slash = '\0'; /* run/model.safetensors: the run's name */
    }
    char *slash = strrchr(p, '/');
    char *name = strdup(slash && slash[1] ? slash + 1 : p);
    free(p);
    return name;
}

/* Whether a template is kiln's JSON form ({"message": ...}) rather than a Jinja program
 * ("{% for ...", "{{ bos_token }}", text). */
static bool json_template(const char *t)
{
    t += strspn(t, " \n\t\r");
    if (*t++ != '{') return false;
    t += strspn(t, " \n\t\r");
    return *t == '"';
}

kiln_status kiln_server_load(kiln_server_t *s, const char *model_path)
{
    if (!s || !model_path) return kiln_error(KILN_ERR_ARG, "server_load: server and path must not be NULL");
    if (atomic_load(&s->loaded)) return kiln_error(KILN_ERR_ARG, "server_load: a model is loaded already");
    char *tmpl = NULL;
    kiln_status st = kiln_model_load(model_path, &s->model, &s->tok, &tmpl);
    if (st != KILN_OK) return st;
    /* --chat-template first, else a Hugging Face folder's own (an error naming the
     * option when kiln cannot render it), else the checkpoint's (a HF folder brings none
     * through kiln_model_load, so only a path without one is looked at again) */
    if (s->tmpl_opt || (!tmpl && kiln_hf_is_folder(model_path))) {
        free(tmpl);
        tmpl = NULL;
        st = s->tmpl_opt ? kiln__chat_template_resolve(s->tmpl_opt, &tmpl) : kiln_chat_template_from_hf(model_path, &tmpl);
        if (st != KILN_OK) return st;
    }
    /* a GGUF file's template is a Jinja program, as a Hugging Face folder's: taken by its
     * family until kiln runs Jinja itself */
    if (tmpl && !json_template(tmpl)) {
        const char *family = kiln__chat_family_of(tmpl);
        free(tmpl);
        tmpl = NULL;
        if (!family)
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: its chat template is none of the families kiln renders (chatml, "
                              "llama3, mistral); give kiln serve --chat-template NAME, FILE or a JSON template",
                              model_path);
        if (!(tmpl = strdup(family))) return kiln_error(KILN_ERR_OOM, "server_load: out of memory");
    }
    char err[256];
    bool ok = kiln__chat_template_parse(tmpl ? tmpl : kiln_chat_template_default(), &s->tmpl, err, sizeof err);
    free(tmpl);
    if (!ok) return kiln_error(KILN_ERR_FORMAT, "%s: %s", model_path, err);
    s->name = s->name_opt ? strdup(s->name_opt) : name_from_path(model_path);
    if (!s->name) return kiln_error(KILN_ERR_OOM, "server_load: out of memory");
    s->ctx = kiln_gpt_get_config(s->model)->block_size;
    s->vocab = kiln_gpt_get_config(s->model)->vocab_size;
    if (kiln_tokenizer_vocab_size(s->tok) > s->vocab)
        return kiln_error(KILN_ERR_FORMAT, "%s: the tokenizer has %d tokens, the model %d", model_path,
                          kiln_tokenizer_vocab_size(s->tok), s->vocab);
    s->eot = kiln_tokenizer_eot(s->tok);
    s->bos = kiln_tokenizer_bos(s->tok);
    /* 16-bit weights for decoding: the model's own copy in that type as well, so that the
     * weights take half the memory of f32 serving (the packed copy and this one) */
    if (s->o.engine.weight_dtype != KILN_DTYPE_F32 &&
        (st = kiln_gpt_store_linear(s->model, s->o.engine.weight_dtype)) != KILN_OK)
        return st;
    if ((st = kiln_engine_new(s->model, &s->o.engine, &s->engine)) != KILN_OK) return st;
    /* Loading freed about twice what it keeps (the file's tensors, the model's random
     * initial weights, f32 weights stored again as bf16): the allocator's cached blocks
     * and the heap's free pages go back to the system, so the server's memory is what
     * it holds (a 340 MB checkpoint: 1,009 MB resident after loading, 341 MB after). */
    kiln_memory_empty_cache();
#ifdef __GLIBC__
    malloc_trim(0);
#endif
    atomic_store(&s->loaded, true);
    return KILN_OK;
}

void kiln_server_free(kiln_server_t *s)
{
    if (!s) return;
    if (s->d) MHD_quiesce_daemon(s->d); /* no new connections */
    atomic_store(&s->loaded, false);    /* and requests on open ones get 503 */
    kiln__serve_jobs_stop(s);
    if (s->d) MHD_stop_daemon(s->d);
    kiln_engine_free(s->engine);
    kiln__chat_template_free(&s->tmpl);
    kiln_tokenizer_free(s->tok);
    kiln_gpt_free(s->model);
    KILN__FREE(s->name, s->host, s->api_key, s->cors, s->name_opt, s->tmpl_opt);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
