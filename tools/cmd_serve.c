/* kiln serve: an OpenAI-compatible HTTP server for a trained checkpoint. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "cli.h"
#include "kiln/serve.h"

/* SIGINT and SIGTERM end kiln serve from its first moment: a start-up that is slow (a
 * large model) or stuck still ends on them, promptly, with a message; once the model is
 * ready they stop the server. Threads kiln starts have them blocked, and one thread takes
 * them in sigwait; threads that libraries started before ours (OpenBLAS's) may take one
 * through the handler instead. Either way stop() runs, which is async-signal-safe. */
static sigset_t stop_signals;
static atomic_int ready, stop_requested;
static int wake[2] = {-1, -1}; /* the main thread waits on wake[0] once the model is ready */

static void stop(int sig)
{
    if (!atomic_load(&ready)) {
        static const char term[] = "kiln serve: stopped by SIGTERM during start-up\n",
                          intr[] = "kiln serve: stopped by SIGINT during start-up\n";
        if (sig == SIGINT) (void)!write(2, intr, sizeof intr - 1);
        else (void)!write(2, term, sizeof term - 1);
        _exit(128 + sig); /* the loading thread may be anywhere: nothing to unwind safely */
    }
    atomic_store(&stop_requested, sig);
    char c = 1;
    (void)!write(wake[1], &c, 1);
}

static void on_signal(int sig)
{
    int e = errno;
    stop(sig);
    errno = e;
}

static void *signal_thread(void *arg)
{
    (void)arg;
    for (int sig; ;)
        if (sigwait(&stop_signals, &sig) == 0) stop(sig);
    return NULL;
}

int cmd_serve(int argc, char **argv)
{
    kiln_server_opts o = kiln_server_opts_default();
    const char *model = "runs/default", *kv_dtype = "f32", *weights = "f32", *host = o.host, *api_key = NULL, *name = NULL, *cors = o.cors_origin,
               *chat_template = NULL;
    int64_t port = o.port, max_batch = o.engine.max_batch, max_queue = o.engine.max_queue, threads = 0,
            http_threads = o.http_threads, max_body = (int64_t)o.max_body, kv_mb = o.engine.kv_memory_mb,
            block_len = o.engine.block_len, step_tokens = o.engine.max_step_tokens, max_tokens = o.max_tokens_default;
    double timeout = o.request_timeout;
    int64_t idle = o.idle_timeout;
    bool no_prefix_cache = false;
    bool log_requests = isatty(2); /* on in a terminal, as a server's log is when someone watches it */
    const cli_opt opts[] = {
        {"model", OPT_STRING, &model, "run folder or model.safetensors"},
        {"host", OPT_STRING, &host, "address to listen on (127.0.0.1; 0.0.0.0 for every interface)"},
        {"port", OPT_INT, &port, "TCP port; 0 = any free port (printed when listening)"},
        {"api-key", OPT_STRING, &api_key, "require 'Authorization: Bearer KEY' on /v1 ($KILN_API_KEY)"},
        {"name", OPT_STRING, &name, "model id in /v1/models and responses (default: the run folder's name)"},
        {"chat-template", OPT_STRING, &chat_template, "the chat template: chatml, llama3, mistral, a JSON template or "
                                                      "a file with one (default: the model's own)"},
        {"max-batch", OPT_INT, &max_batch, "sequences decoded together in one step"},
        {"max-queue", OPT_INT, &max_queue, "waiting requests before new ones get 429"},
        {"max-step-tokens", OPT_INT, &step_tokens, "prompt tokens prefilled per step, all requests together"},
        {"kv-memory", OPT_INT, &kv_mb, "KV cache size in MiB"},
        {"block-len", OPT_INT, &block_len, "positions per KV cache block"},
        {"kv-dtype", OPT_STRING, &kv_dtype, "KV cache storage: f32, or f16 / bf16 (half the memory, keys and values rounded)"},
        {"weights", OPT_STRING, &weights, "the linear layers' weights as decoding reads them: f32, or bf16 / f16 (each "
                                         "rounded once: half the bytes of the packed copy, and of what each token "
                                         "streams), or q8_0 (ggml's 8-bit blocks, 1.0625 bytes a weight, activations quantized to 8 bits "
                                         "per product as llama.cpp's Q8_0 does)"},
        {"no-prefix-cache", OPT_FLAG, &no_prefix_cache, "do not share the KV blocks of common prompt prefixes"},
        {"log-requests", OPT_FLAG, &log_requests, "a line on stderr per finished request: time, client, method, path, "
                                                  "status, tokens, milliseconds, how it ended (default: on when "
                                                  "stderr is a terminal)"},
        {"no-log-requests", OPT_FLAG, &log_requests, "no request log"},
        {"max-body", OPT_INT, &max_body, "request body limit in bytes"},
        {"timeout", OPT_DOUBLE, &timeout, "seconds a request may take in all"},
        {"idle-timeout", OPT_INT, &idle, "seconds a connection may stay silent before it is dropped"},
        {"max-tokens", OPT_INT, &max_tokens, "max_tokens of a request that names none"},
        {"cors-origin", OPT_STRING, &cors, "Access-Control-Allow-Origin for browsers"},
        {"http-threads", OPT_INT, &http_threads, "HTTP worker threads"},
        {"threads", OPT_INT, &threads, "compute threads; 0 = all cores ($KILN_NUM_THREADS)"},
        {NULL, 0, NULL, NULL},
    };
    const char *pos[1];
    int np = 0;
    int r = cli_parse("serve", "[RUN_DIR|MODEL] [options]", opts, argc, argv, pos, 1, &np);
    if (r) return r == 1 ? 0 : 2;
    if (np == 1) model = pos[0];
    if (port < 0 || port > 65535) return cli_fail("serve", "--port must be in 0..65535");
    if (max_batch < 1 || max_batch > 4096 || max_queue < 0 || max_queue > 1 << 20 || http_threads < 1 ||
        http_threads > 1024 || max_body < 1 || max_body > ((int64_t)1 << 32) || kv_mb < 1 || kv_mb > (1 << 24) ||
        block_len < 1 || block_len > 1024 || step_tokens < 2 || step_tokens > 1 << 20 || max_tokens < 1 ||
        max_tokens > 1 << 24 || !(timeout > 0) || idle < 1 || idle > 86400)
        return cli_fail("serve", "an option is out of range (see kiln serve --help)");
    kiln_dtype kvt;
    if (kiln_dtype_parse(kv_dtype, &kvt) != KILN_OK ||
        !kiln_dtype_is_f32_or_half(kvt))
        return cli_fail("serve", "--kv-dtype must be f32, f16 or bf16");
    kiln_dtype wt = KILN_DTYPE_F32;
    bool q8 = strcmp(weights, "q8_0") == 0;
    if (!q8 && (kiln_dtype_parse(weights, &wt) != KILN_OK || !kiln_dtype_is_f32_or_half(wt)))
        return cli_fail("serve", "--weights must be f32, bf16, f16 or q8_0");
    if (!api_key) api_key = kiln_env("KILN_API_KEY");
    o.host = host;
    o.port = (int)port;
    o.api_key = api_key && *api_key ? api_key : NULL;
    o.model_name = name;
    o.chat_template = chat_template;
    o.cors_origin = cors;
    o.http_threads = (int)http_threads;
    o.max_body = (size_t)max_body;
    o.request_timeout = timeout;
    o.idle_timeout = (int)idle;
    o.max_tokens_default = (int)max_tokens;
    o.engine.max_batch = (int)max_batch;
    o.engine.max_queue = (int)max_queue;
    o.engine.max_step_tokens = (int)(step_tokens > max_batch ? step_tokens : max_batch + 1);
    o.engine.kv_memory_mb = kv_mb;
    o.engine.block_len = (int)block_len;
    o.engine.prefix_cache = !no_prefix_cache;
    o.engine.kv_dtype = kvt;
    o.engine.weight_dtype = wt;
    o.engine.weight_quant = q8 ? KILN_WEIGHT_QUANT_Q8_0 : KILN_WEIGHT_QUANT_NONE;
    if (log_requests) o.log_request = kiln_request_log_stderr;

    /* SIGINT and SIGTERM: blocked here before kiln starts a thread (they inherit it) and
     * taken by signal_thread; the handler for threads that do not block them. */
    signal(SIGPIPE, SIG_IGN); /* a client that goes away must not end the server */
    if (pipe(wake) != 0) return cli_fail("serve", "cannot make a pipe");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    sa.sa_mask = stop_signals;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    pthread_sigmask(SIG_BLOCK, &stop_signals, NULL);
    pthread_t sig_thread;
    if (pthread_create(&sig_thread, NULL, signal_thread, NULL) != 0) return cli_fail("serve", "cannot start a thread");
    pthread_detach(sig_thread);
    if (kiln_init((int)threads) != KILN_OK) return cli_fail("serve", NULL);

    /* The model is loaded and checked first, then the port is bound, and only then is
     * "listening" said: a model that does not load never gets a URL printed, and a
     * port in use is said in one line. */
    kiln_server_t *srv;
    if (kiln_server_new(&o, &srv) != KILN_OK) return cli_fail("serve", NULL);
    fprintf(stderr, "kiln serve: loading %s\n", model);
    if (kiln_server_load(srv, model) != KILN_OK || kiln_server_listen(srv) != KILN_OK) {
        int rc = cli_fail("serve", NULL);
        kiln_server_free(srv);
        return rc;
    }
    atomic_store(&ready, 1);
    fprintf(stderr, "kiln serve: model %s ready; listening on http://%s:%d\n", model, host, kiln_server_port(srv));
    char c;
    while (read(wake[0], &c, 1) < 0 && errno == EINTR) {
    }
    fprintf(stderr, "kiln serve: stopping (signal %d)\n", atomic_load(&stop_requested));
    kiln_server_free(srv);
    return 0;
}
