/* The request log: one line per finished request, through kiln_server_opts.log_request.
 *
 * A request's conn_state is made when its request line arrives (MHD's URI log callback),
 * not when kiln's access handler first sees it, for two reasons: its time starts there,
 * and libmicrohttpd calls the completion callback only for requests it has shown to
 * kiln, so a request it refuses itself (a Content-Length it cannot read) would otherwise
 * end unseen. Every request that has a request line thus reaches on_completed exactly
 * once, which logs it and frees its state: a line is neither lost nor doubled.
 *
 * The status is libmicrohttpd's record of the response queued on the connection (its
 * own refusals included), so the log says what was sent, not what kiln meant to send. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "serve/server_impl.h"

void *kiln__serve_on_uri(void *cls, const char *uri, struct MHD_Connection *conn)
{
    (void)conn;
    kiln_server_t *s = cls;
    conn_state *cs = calloc(1, sizeof *cs);
    if (!cs) return NULL; /* the access handler makes it then (the request's time starts later) */
    cs->t_start = kiln__now_s();
    if (s->o.log_request && uri) {
        size_t n = strlen(uri);
        cs->target_cut = n > KILN__LOG_TARGET;
        cs->target = strndup(uri, cs->target_cut ? KILN__LOG_TARGET : n); /* NULL (out of memory): logged as "-" */
    }
    return cs;
}

/* Writes src[0..n) into dst with every byte a client could use to end a line, start a
 * field or drive a terminal escaped: printable ASCII but space and backslash as it is, a
 * backslash as \\, the rest as \xHH. At most max characters are written; where src does
 * not fit (or cut says it was cut before) "..." follows. dst holds max + 4 bytes. */
static void escape(char *dst, size_t max, const char *src, size_t n, bool cut)
{
    static const char hex[] = "0123456789abcdef";
    size_t k = 0, i = 0;
    for (; i < n; i++) {
        unsigned char b = (unsigned char)src[i];
        size_t w = b > 0x20 && b < 0x7f ? (b == '\\' ? 2 : 1) : 4;
        if (k + w > max) break;
        if (w == 1) dst[k] = (char)b;
        else if (w == 2) dst[k] = '\\', dst[k + 1] = '\\';
        else dst[k] = '\\', dst[k + 1] = 'x', dst[k + 2] = hex[b >> 4], dst[k + 3] = hex[b & 15];
        k += w;
    }
    if (i < n || cut) memcpy(dst + k, "...", 3), k += 3;
    if (!k) dst[k++] = '-'; /* an empty field would shift the ones after it */
    dst[k] = '\0';
}

static void client_address(struct MHD_Connection *conn, char *buf, size_t n)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    const struct sockaddr *sa = ci ? ci->client_addr : NULL;
    char ip[INET6_ADDRSTRLEN];
    if (sa && sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        if (inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip)) {
            snprintf(buf, n, "%s:%u", ip, (unsigned)ntohs(a->sin_port));
            return;
        }
    } else if (sa && sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
        if (inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip)) {
            snprintf(buf, n, "[%s]:%u", ip, (unsigned)ntohs(a->sin6_port));
            return;
        }
    }
    snprintf(buf, n, "-");
}

void kiln__serve_log_request(kiln_server_t *s, struct MHD_Connection *conn, conn_state *cs)
{
    if (!s->o.log_request) return;
    kiln_request_log r = {.prompt_tokens = 0};
    char client[INET6_ADDRSTRLEN + 16], method[32 + 4], target[KILN__LOG_TARGET + 4], end[64] = "-";
    client_address(conn, client, sizeof client);
    escape(method, 32, cs->method, strlen(cs->method), cs->method_cut);
    escape(target, KILN__LOG_TARGET, cs->target ? cs->target : "", cs->target ? strlen(cs->target) : 0,
           cs->target_cut);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_HTTP_STATUS);
    r.status = ci ? (int)ci->http_status : 0;
    if (cs->j) {
        pthread_mutex_lock(&cs->j->mu);
        kiln__serve_job_outcome(cs->j, end, sizeof end, &r.prompt_tokens, &r.completion_tokens);
        pthread_mutex_unlock(&cs->j->mu);
    }
    r.ms = cs->t_start > 0 ? 1e3 * (kiln__now_s() - cs->t_start) : 0;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    r.time = (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
    struct tm tm;
    char when[48] = "-";
    size_t w = gmtime_r(&now.tv_sec, &tm) ? strftime(when, sizeof when - 6, "%Y-%m-%dT%H:%M:%S", &tm) : 0;
    if (w) snprintf(when + w, sizeof when - w, ".%03dZ", (int)(now.tv_nsec / 1000000) % 1000);
    r.client = client;
    r.method = method;
    r.target = target;
    r.end = end;
    /* About 1,300 bytes at most: under PIPE_BUF (4,096), so one write(2) of it to a pipe
     * is atomic. */
    char line[sizeof when + sizeof client + sizeof method + sizeof target + sizeof end + 96];
    snprintf(line, sizeof line, "%s %s %s %s %d prompt=%d completion=%d ms=%.1f end=%s", when, client, method, target,
             r.status, r.prompt_tokens, r.completion_tokens, r.ms, end);
    r.line = line;
    s->o.log_request(s->o.log_user, &r);
}

void kiln_request_log_stderr(void *user, const kiln_request_log *r)
{
    (void)user;
    if (!r || !r->line) return;
    char buf[2048];
    int n = snprintf(buf, sizeof buf, "%s\n", r->line);
    if (n < 0) return;
    if ((size_t)n >= sizeof buf) n = (int)sizeof buf - 1, buf[n - 1] = '\n';
    /* A closed pipe must not raise SIGPIPE in a program that has not ignored it: the
     * signal is blocked on this thread around the write, and one that the write raised is
     * taken before it is unblocked. */
    int saved = errno;
    sigset_t pipe_only, old, pending;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    sigemptyset(&pending);
    bool masked = pthread_sigmask(SIG_BLOCK, &pipe_only, &old) == 0;
    bool was_pending = masked && sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE);
    bool broken = false;
    size_t off = 0;
    for (int tries = 0; off < (size_t)n && tries < 100;) {
        ssize_t w = write(2, buf + off, (size_t)n - off);
        if (w > 0) {
            off += (size_t)w;
        } else if (w < 0 && errno == EINTR) {
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) { /* a non-blocking stderr that is full: 1 s at most */
            struct pollfd p = {.fd = 2, .events = POLLOUT};
            poll(&p, 1, 10);
            tries++;
        } else {
            broken = w < 0 && errno == EPIPE;
            break; /* a closed pipe, a full disk, no stderr: the line is dropped */
        }
    }
    if (masked && broken && !was_pending) {
        struct timespec zero = {0, 0};
        while (sigtimedwait(&pipe_only, NULL, &zero) < 0 && errno == EINTR) {
        }
    }
    if (masked) pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = saved;
}
