/* The server's counters and the /metrics page (Prometheus text format): requests by
 * endpoint and status code, tokens, the time to the first token, and the engine's own
 * statistics read when the page is asked for. */
#include <stdio.h>
#include <stdlib.h>
#include "serve/server_impl.h"

static const int codes[] = {200, 204, 400, 401, 404, 405, 413, 415, 429, 500, 503, 504};
_Static_assert(sizeof codes / sizeof codes[0] == KILN__SERVE_N_CODES, "KILN__SERVE_N_CODES counts codes[]");
static const double ttft_bounds[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
_Static_assert(sizeof ttft_bounds / sizeof ttft_bounds[0] == KILN__SERVE_N_TTFT, "KILN__SERVE_N_TTFT counts ttft_bounds[]");

void kiln__serve_count_request(kiln_server_t *s, int ep, int code)
{
    int k = KILN__SERVE_N_CODES;
    for (int i = 0; i < KILN__SERVE_N_CODES; i++)
        if (codes[i] == code) k = i;
    pthread_mutex_lock(&s->mu);
    s->m.requests[ep][k]++;
    pthread_mutex_unlock(&s->mu);
}

void kiln__serve_count_ttft(kiln_server_t *s, double t)
{
    pthread_mutex_lock(&s->mu);
    int b = 0;
    while (b < KILN__SERVE_N_TTFT && t > ttft_bounds[b]) b++;
    s->m.ttft_buckets[b]++;
    s->m.ttft_count++;
    s->m.ttft_sum += t;
    pthread_mutex_unlock(&s->mu);
}

void kiln__serve_count_prompt(kiln_server_t *s, int n_tokens)
{
    pthread_mutex_lock(&s->mu);
    s->m.prompt_tokens += (uint64_t)n_tokens;
    pthread_mutex_unlock(&s->mu);
}

enum MHD_Result kiln__serve_metrics(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    kiln_engine_stats es = {0};
    if (atomic_load(&s->loaded)) kiln_engine_get_stats(s->engine, &es);
    size_t cap = 16384, len = 0;
    char *b = malloc(cap);
    if (!b) return kiln__serve_send_error(s, conn, cs->endpoint, 500, NULL, NULL, "out of memory");
#define P(...) (len += (size_t)snprintf(b + len, len < cap ? cap - len : 0, __VA_ARGS__))
    pthread_mutex_lock(&s->mu);
    kiln__serve_metrics_t m = s->m;
    pthread_mutex_unlock(&s->mu);
    P("# HELP kiln_requests_total HTTP requests answered, by endpoint and status code.\n# TYPE kiln_requests_total counter\n");
    for (int e = 0; e < EP_COUNT; e++)
        for (int k = 0; k <= KILN__SERVE_N_CODES; k++)
            if (m.requests[e][k]) {
                const char *ep = kiln__serve_endpoint_name(e);
                unsigned long long n = (unsigned long long)m.requests[e][k];
                if (k < KILN__SERVE_N_CODES) P("kiln_requests_total{endpoint=\"%s\",code=\"%d\"} %llu\n", ep, codes[k], n);
                else P("kiln_requests_total{endpoint=\"%s\",code=\"other\"} %llu\n", ep, n);
            }
    P("# HELP kiln_prompt_tokens_total Prompt tokens of accepted generation requests.\n# TYPE kiln_prompt_tokens_total counter\n");
    P("kiln_prompt_tokens_total %llu\n", (unsigned long long)m.prompt_tokens);
    P("# HELP kiln_generation_tokens_total Tokens generated.\n# TYPE kiln_generation_tokens_total counter\n");
    P("kiln_generation_tokens_total %llu\n", (unsigned long long)es.generated_tokens);
    P("# HELP kiln_queue_depth Requests waiting for a batch slot or KV memory.\n# TYPE kiln_queue_depth gauge\n");
    P("kiln_queue_depth %d\n", es.waiting);
    P("# HELP kiln_running_requests Sequences in the running batch.\n# TYPE kiln_running_requests gauge\n");
    P("kiln_running_requests %d\n", es.running);
    P("# HELP kiln_kv_blocks_free KV cache blocks free or reclaimable.\n# TYPE kiln_kv_blocks_free gauge\n");
    P("kiln_kv_blocks_free %d\n", es.kv_blocks_free);
    P("# HELP kiln_kv_blocks_total KV cache blocks.\n# TYPE kiln_kv_blocks_total gauge\n");
    P("kiln_kv_blocks_total %d\n", es.kv_blocks_total);
    P("# HELP kiln_prefix_cache_hit_tokens_total Prompt tokens whose keys and values came from the prefix cache.\n"
      "# TYPE kiln_prefix_cache_hit_tokens_total counter\n");
    P("kiln_prefix_cache_hit_tokens_total %llu\n", (unsigned long long)es.prefix_hit_tokens);
    P("# HELP kiln_engine_steps_total Batched model steps.\n# TYPE kiln_engine_steps_total counter\n");
    P("kiln_engine_steps_total %llu\n", (unsigned long long)es.steps);
    P("# HELP kiln_generation_tokens_per_second Tokens generated per second of model time, since start.\n"
      "# TYPE kiln_generation_tokens_per_second gauge\n");
    P("kiln_generation_tokens_per_second %.3f\n", es.busy_seconds > 0 ? (double)es.generated_tokens / es.busy_seconds : 0.0);
    P("# HELP kiln_time_to_first_token_seconds From a request's arrival to its first token.\n"
      "# TYPE kiln_time_to_first_token_seconds histogram\n");
    uint64_t cum = 0;
    for (int i = 0; i < KILN__SERVE_N_TTFT; i++) {
        cum += m.ttft_buckets[i];
        P("kiln_time_to_first_token_seconds_bucket{le=\"%g\"} %llu\n", ttft_bounds[i], (unsigned long long)cum);
    }
    cum += m.ttft_buckets[KILN__SERVE_N_TTFT];
    P("kiln_time_to_first_token_seconds_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)cum);
    P("kiln_time_to_first_token_seconds_sum %.6f\n", m.ttft_sum);
    P("kiln_time_to_first_token_seconds_count %llu\n", (unsigned long long)m.ttft_count);
#undef P
    enum MHD_Result r =
        len < cap ? kiln__serve_send_buf(s, conn, cs->endpoint, 200, "text/plain; version=0.0.4", b, len, true, NULL)
                  : kiln__serve_send_error(s, conn, cs->endpoint, 500, NULL, NULL, "metrics page too long");
    free(b);
    return r;
}
