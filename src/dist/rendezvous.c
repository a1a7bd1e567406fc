/* The TCP rendezvous: how ranks that no MPI launcher started find each other (a
 * scheduler that sets KILN_RANK, KILN_WORLD_SIZE, KILN_MASTER_ADDR, KILN_MASTER_PORT),
 * and what will carry the NCCL unique id to cuda ranks. Rank 0 listens; every other
 * rank connects, sends a handshake (magic, version, job id, world size, rank) and its
 * payload; rank 0 checks each (a wrong job, world size or version, a rank out of range
 * or already taken is refused with a message the client reports), and once all have
 * checked in sends everyone every payload, in rank order. Written on plain sockets:
 * the whole protocol is two messages, and what matters is the failure reporting.
 *
 * One global deadline covers it all. Clients retry refused or unreachable connects
 * with exponential backoff and jitter until then; at the deadline rank 0 lists the
 * ranks that never checked in, and each client names the address it could not reach
 * and the last reason. Addresses are numeric, or a host name resolved once (logged);
 * nothing does reverse DNS. KILN_SOCKET_IFNAME picks the interface clients connect
 * from (and rank 0 listens on). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include "core/env.h"
#include "core/util.h"
#include "kiln/dist.h"

#define MAGIC 0x4b494c4e52445a31ULL /* "KILNRDZ1" */
#define VERSION 1
#define JOB_LEN 64

typedef struct {
    uint64_t magic;
    uint32_t version, world, rank, len;
    char job[JOB_LEN];
} hello;

/* Reads or writes exactly n bytes before the deadline; false on EOF, error or time. */
static bool io_all(int fd, void *buf, size_t n, bool write_it, double deadline)
{
    char *p = buf;
    while (n) {
        int ms = (int)((deadline - kiln__now_s()) * 1e3);
        if (ms <= 0) return false;
        struct pollfd pf = {fd, (short)(write_it ? POLLOUT : POLLIN), 0};
        if (poll(&pf, 1, ms) <= 0) return false;
        ssize_t k = write_it ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k <= 0) {
            if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            return false;
        }
        p += k;
        n -= (size_t)k;
    }
    return true;
}

/* The IPv4 address of interface name, for KILN_SOCKET_IFNAME. */
static kiln_status iface_addr(const char *name, struct in_addr *out)
{
    struct ifaddrs *ifs, *i;
    if (getifaddrs(&ifs) != 0) return kiln_error(KILN_ERR_DIST, "rendezvous: cannot list interfaces: %s", strerror(errno));
    bool found = false;
    for (i = ifs; i && !found; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && !strcmp(i->ifa_name, name)) {
            *out = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
            found = true;
        }
    freeifaddrs(ifs);
    return found ? KILN_OK : kiln_error(KILN_ERR_DIST, "rendezvous: KILN_SOCKET_IFNAME=%s has no IPv4 address here", name);
}

/* addr:port as a sockaddr; a name is resolved once and the result logged. */
static kiln_status resolve(const char *addr, int port, struct sockaddr_in *sa)
{
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, addr, &sa->sin_addr) == 1) return KILN_OK;
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res;
    int rc = getaddrinfo(addr, NULL, &hints, &res);
    if (rc != 0) return kiln_error(KILN_ERR_DIST, "rendezvous: cannot resolve KILN_MASTER_ADDR %s: %s", addr, gai_strerror(rc));
    sa->sin_addr = ((struct sockaddr_in *)res->ai_addr)->sin_addr;
    freeaddrinfo(res);
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &sa->sin_addr, ip, sizeof ip);
    fprintf(stderr, "kiln: rendezvous host %s resolved to %s\n", addr, ip);
    return KILN_OK;
}

static void fill_hello(hello *h, const kiln_rdzv_opts *o, size_t len)
{
    memset(h, 0, sizeof *h);
    h->magic = MAGIC;
    h->version = VERSION;
    h->world = (uint32_t)o->world;
    h->rank = (uint32_t)o->rank;
    h->len = (uint32_t)len;
    snprintf(h->job, JOB_LEN, "%s", o->job_id ? o->job_id : "kiln");
}

/* Rank 0: accept, check, collect, answer. */
static kiln_status serve(const kiln_rdzv_opts *o, const struct sockaddr_in *sa, const void *mine, size_t len, char *all,
                         double deadline)
{
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ls < 0) return kiln_error(KILN_ERR_DIST, "rendezvous: socket: %s", strerror(errno));
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &sa->sin_addr, ip, sizeof ip);
    if (bind(ls, (const struct sockaddr *)sa, sizeof *sa) != 0 || listen(ls, 128) != 0) {
        kiln_status s = kiln_error(KILN_ERR_DIST, "rendezvous: rank 0 cannot listen on %s:%d: %s", ip, o->port, strerror(errno));
        close(ls);
        return s;
    }
    int *fds = malloc(sizeof(int) * (size_t)o->world);
    if (!fds) {
        close(ls);
        return kiln_error(KILN_ERR_OOM, "rendezvous: out of memory");
    }
    for (int r = 0; r < o->world; r++) fds[r] = -1;
    memcpy(all, mine, len);
    int joined = 1;
    kiln_status s = KILN_OK;
    while (joined < o->world) {
        int ms = (int)((deadline - kiln__now_s()) * 1e3);
        struct pollfd pf = {ls, POLLIN, 0};
        if (ms <= 0 || poll(&pf, 1, ms) <= 0) break;
        int c = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) continue;
        hello h;
        char why[200] = "";
        if (!io_all(c, &h, sizeof h, false, deadline)) {
            close(c);
            continue;
        }
        h.job[JOB_LEN - 1] = 0;
        char want[JOB_LEN];
        snprintf(want, sizeof want, "%s", o->job_id ? o->job_id : "kiln");
        if (h.magic != MAGIC) snprintf(why, sizeof why, "not a kiln rendezvous handshake");
        else if (h.version != VERSION) snprintf(why, sizeof why, "protocol version %u, rank 0 speaks %d", h.version, VERSION);
        else if (strcmp(h.job, want)) snprintf(why, sizeof why, "job id '%s', rank 0's is '%s'", h.job, want);
        else if ((int)h.world != o->world) snprintf(why, sizeof why, "world size %u, rank 0's is %d", h.world, o->world);
        else if (h.rank == 0 || (int)h.rank >= o->world) snprintf(why, sizeof why, "rank %u is outside 1..%d", h.rank, o->world - 1);
        else if (fds[h.rank] >= 0) snprintf(why, sizeof why, "rank %u has already checked in", h.rank);
        else if (h.len != len) snprintf(why, sizeof why, "a payload of %u bytes, rank 0's is %zu", h.len, len);
        uint32_t n = (uint32_t)strlen(why);
        if (n) { /* refused: tell the client why, and go on waiting for the right one */
            io_all(c, &n, sizeof n, true, deadline);
            io_all(c, why, n, true, deadline);
            fprintf(stderr, "kiln: rendezvous refused a rank: %s\n", why);
            close(c);
            continue;
        }
        if (!io_all(c, all + (size_t)h.rank * len, len, false, deadline)) {
            close(c);
            continue;
        }
        fds[h.rank] = c;
        joined++;
    }
    if (joined < o->world) {
        char miss[512] = "";
        size_t used = 0;
        int n_miss = 0;
        for (int r = 1; r < o->world && used < sizeof miss - 16; r++)
            if (fds[r] < 0) used += (size_t)snprintf(miss + used, sizeof miss - used, "%s%d", n_miss++ ? ", " : "", r);
        s = kiln_error(KILN_ERR_DIST, "rendezvous: on %s:%d, %d of %d ranks never checked in within %g s: rank%s %s", ip,
                       o->port, n_miss, o->world, o->timeout, n_miss > 1 ? "s" : "", miss);
    }
    uint32_t ok = 0;
    for (int r = 1; r < o->world; r++) {
        if (fds[r] < 0) continue;
        if (s == KILN_OK && (!io_all(fds[r], &ok, sizeof ok, true, deadline) ||
                             !io_all(fds[r], all, len * (size_t)o->world, true, deadline)))
            s = kiln_error(KILN_ERR_DIST, "rendezvous: rank 0 could not send the group to rank %d", r);
        close(fds[r]);
    }
    free(fds);
    close(ls);
    return s;
}

/* One connect attempt, bounded by ms; 0 or an errno. */
static int try_connect(int fd, const struct sockaddr_in *sa, int ms)
{
    int fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    int rc = connect(fd, (const struct sockaddr *)sa, sizeof *sa);
    if (rc != 0 && errno != EINPROGRESS) return errno;
    if (rc != 0) {
        struct pollfd pf = {fd, POLLOUT, 0};
        if (poll(&pf, 1, ms) <= 0) return ETIMEDOUT;
        int err = 0;
        socklen_t el = sizeof err;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        if (err) return err;
    }
    fcntl(fd, F_SETFL, fl);
    return 0;
}

static kiln_status join(const kiln_rdzv_opts *o, const struct sockaddr_in *sa, const struct in_addr *from,
                        const void *mine, size_t len, char *all, double deadline)
{
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &sa->sin_addr, ip, sizeof ip);
    unsigned seed = (unsigned)(o->rank * 2654435761u) ^ (unsigned)getpid();
    double backoff = 0.01; /* refused: rank 0 is usually a few ms from listening */
    int attempts = 0, last = 0;
    while (kiln__now_s() < deadline) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) return kiln_error(KILN_ERR_DIST, "rendezvous: socket: %s", strerror(errno));
        if (from) {
            struct sockaddr_in me = {.sin_family = AF_INET, .sin_addr = *from};
            if (bind(fd, (struct sockaddr *)&me, sizeof me) != 0) {
                close(fd);
                return kiln_error(KILN_ERR_DIST, "rendezvous: rank %d cannot bind to KILN_SOCKET_IFNAME's address: %s",
                                  o->rank, strerror(errno));
            }
        }
        double left = deadline - kiln__now_s();
        attempts++;
        last = try_connect(fd, sa, (int)((left < 2 ? left : 2) * 1e3));
        if (last == 0) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            hello h;
            fill_hello(&h, o, len);
            uint32_t reply = 0;
            kiln_status s = KILN_OK;
            if (!io_all(fd, &h, sizeof h, true, deadline) || !io_all(fd, (void *)mine, len, true, deadline) ||
                !io_all(fd, &reply, sizeof reply, false, deadline))
                s = kiln_error(KILN_ERR_DIST, "rendezvous: rank %d reached %s:%d, but rank 0 did not answer before the "
                               "deadline (%g s)", o->rank, ip, o->port, o->timeout);
            else if (reply != 0) {
                char why[256] = "";
                uint32_t n = reply < sizeof why ? reply : sizeof why - 1;
                io_all(fd, why, n, false, deadline);
                s = kiln_error(KILN_ERR_DIST, "rendezvous: rank 0 at %s:%d refused rank %d: %s", ip, o->port, o->rank, why);
            } else if (!io_all(fd, all, len * (size_t)o->world, false, deadline))
                s = kiln_error(KILN_ERR_DIST, "rendezvous: rank %d lost rank 0 at %s:%d before the group arrived", o->rank,
                               ip, o->port);
            close(fd);
            return s;
        }
        close(fd);
        /* Refused (rank 0 not up yet), unreachable, timed out: back off and retry. */
        double wait = backoff * (0.5 + (double)(rand_r(&seed) % 1000) / 1000.0);
        left = deadline - kiln__now_s();
        if (wait > left) wait = left;
        if (wait > 0) usleep((useconds_t)(wait * 1e6));
        backoff = backoff * 2 < 1.0 ? backoff * 2 : 1.0;
    }
    return kiln_error(KILN_ERR_DIST, "rendezvous: rank %d could not reach rank 0 at %s:%d within %g s: %s (%d attempts)",
                      o->rank, ip, o->port, o->timeout, last ? strerror(last) : "no attempt finished", attempts);
}

kiln_status kiln_rendezvous(const kiln_rdzv_opts *o, const void *mine, size_t len, void *all, double *seconds)
{
    if (!o || !o->addr || (!mine && len) || !all)
        return kiln_error(KILN_ERR_ARG, "rendezvous: needs options with an address, a payload and room for the group");
    if (o->world < 1 || o->rank < 0 || o->rank >= o->world || o->port < 1 || o->port > 65535 || !(o->timeout > 0))
        return kiln_error(KILN_ERR_ARG, "rendezvous: rank %d of %d, port %d, timeout %g: out of range", o->rank, o->world,
                          o->port, o->timeout);
    double t0 = kiln__now_s(), deadline = t0 + o->timeout;
    struct sockaddr_in sa;
    kiln_status s = resolve(o->addr, o->port, &sa);
    struct in_addr from, *fromp = NULL;
    const char *ifn = kiln__env_str(KILN__ENV_SOCKET_IFNAME);
    if (s == KILN_OK && ifn && (s = iface_addr(ifn, &from)) == KILN_OK) fromp = &from;
    if (s == KILN_OK) {
        if (o->world == 1) memcpy(all, mine, len);
        else if (o->rank == 0) {
            if (fromp) sa.sin_addr = from;
            s = serve(o, &sa, mine, len, all, deadline);
        } else {
            s = join(o, &sa, fromp, mine, len, all, deadline);
        }
    }
    if (seconds) *seconds = kiln__now_s() - t0;
    return s;
}

kiln_status kiln_rdzv_opts_from_env(kiln_rdzv_opts *o)
{
    if (!o) return kiln_error(KILN_ERR_ARG, "rendezvous: NULL options");
    memset(o, 0, sizeof *o);
    if (!kiln__env_str(KILN__ENV_WORLD_SIZE) || !kiln__env_str(KILN__ENV_RANK) || !kiln__env_str(KILN__ENV_MASTER_ADDR) ||
        !kiln__env_str(KILN__ENV_MASTER_PORT))
        return kiln_error(KILN_ERR_ARG, "rendezvous: set KILN_RANK, KILN_WORLD_SIZE, KILN_MASTER_ADDR and KILN_MASTER_PORT");
    static const kiln__env_id numbers[] = {KILN__ENV_WORLD_SIZE, KILN__ENV_RANK, KILN__ENV_MASTER_PORT,
                                           KILN__ENV_RENDEZVOUS_TIMEOUT};
    for (size_t i = 0; i < sizeof numbers / sizeof numbers[0]; i++)
        if (kiln__env_check(numbers[i]) != KILN_OK) return KILN_ERR_ARG; /* the message names the variable */
    o->world = (int)kiln__env_int(KILN__ENV_WORLD_SIZE);
    o->rank = (int)kiln__env_int(KILN__ENV_RANK);
    o->addr = kiln__env_str(KILN__ENV_MASTER_ADDR);
    o->port = (int)kiln__env_int(KILN__ENV_MASTER_PORT);
    o->timeout = kiln__env_num(KILN__ENV_RENDEZVOUS_TIMEOUT);
    o->job_id = kiln__env_str(KILN__ENV_JOB_ID);
    return KILN_OK;
}
