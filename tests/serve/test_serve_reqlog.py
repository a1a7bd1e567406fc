"""kiln serve's request log (issue 50, item 4): `--log-requests` writes one line to
stderr per finished request, after its response is complete (a stream too, and a client
that leaves mid-stream), with the status really sent, the tokens its usage says and how
it ended; what a client sends cannot add a line; it is off where stderr is not a
terminal, on where it is; and a stderr that cannot be written does not hurt serving.
Oracles: the responses themselves (status, usage, finish_reason) and the client's own
socket address; docs/serve.md for the format."""
import http.client
import json
import os
import pty
import re
import select
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import harness as H  # noqa: E402

A = H.args()
RUN = H.model(A.kiln, A.workdir)
NAME = "serve-model"
KEY = "sesame"
AUTH = {"Authorization": "Bearer " + KEY}
LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (\S+) (\S+) (\S+) (\d+) prompt=(\d+) completion=(\d+) "
                  r"ms=(\d+\.\d) end=(\S+)$")
srv = None  # the logging server (--log-requests --api-key), started in main()


def log_lines(text):
    """The request-log lines of a stderr text, parsed (kiln serve's own lines and
    libmicrohttpd's messages are not)."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out.append({"time": m[1], "client": m[2], "method": m[3], "target": m[4], "status": int(m[5]),
                        "prompt": int(m[6]), "completion": int(m[7]), "ms": float(m[8]), "end": m[9], "line": line})
    return out


def new_lines(before, k, server=None, wait=15):
    """The lines logged since `before` lines were: exactly k (waiting for them, then a
    little more, so that a doubled line would be seen)."""
    server = server or srv
    deadline = time.time() + wait
    while time.time() < deadline and len(log_lines(server.stderr_text())) < before + k:
        time.sleep(0.02)
    time.sleep(0.3)
    got = log_lines(server.stderr_text())[before:]
    assert len(got) == k, f"{len(got)} lines where {k} were wanted: {got}"
    return got


def count():
    return len(log_lines(srv.stderr_text()))


def call(method, path, body=None, headers=None, raw=None, port=None):
    """(status, body bytes, the client's address as the log writes it)."""
    c = http.client.HTTPConnection("127.0.0.1", port or srv.port, timeout=60)
    c.connect()
    me = "%s:%d" % c.sock.getsockname()
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    out = r.read()
    c.close()
    return r.status, out, me


def raw_exchange(data, port=None, leave=False):
    """Sends bytes as they are; the response's status (0 when none came) and the
    client's address. leave: close the connection, the request unfinished, and read
    nothing. (A moment after the bytes: libmicrohttpd may not see a close that arrives
    with the bytes it reads until its idle timeout.)"""
    sk = socket.create_connection(("127.0.0.1", port or srv.port), timeout=15)
    me = "%s:%d" % sk.getsockname()
    sk.sendall(data)
    if leave:
        time.sleep(0.3)
        sk.close()
        return 0, me
    got = b""
    try:
        while b"\r\n" not in got:
            chunk = sk.recv(4096)
            if not chunk:
                break
            got += chunk
    finally:
        sk.close()
    m = re.match(rb"HTTP/1\.[01] (\d{3})", got)
    return (int(m.group(1)) if m else 0), me


def check(line, me, method, target, status, prompt=0, completion=0, end="-"):
    assert line["client"] == me, (line, me)
    assert (line["method"], line["target"], line["status"]) == (method, target, status), line
    assert (line["prompt"], line["completion"], line["end"]) == (prompt, completion, end), line
    assert 0 <= line["ms"] < 60000, line


def test_completion():
    n = count()
    s, b, me = call("POST", "/v1/completions", {"prompt": "And God said", "max_tokens": 9, "seed": 1}, AUTH)
    r = json.loads(b)
    assert s == 200, r
    u = r["usage"]
    [line] = new_lines(n, 1)
    check(line, me, "POST", "/v1/completions", 200, u["prompt_tokens"], u["completion_tokens"],
          r["choices"][0]["finish_reason"])
    assert u["completion_tokens"] >= 1


def test_n_choices_count_together():
    n = count()
    s, b, me = call("POST", "/v1/completions", {"prompt": "In", "max_tokens": 7, "seed": 3, "n": 3}, AUTH)
    r = json.loads(b)
    assert s == 200, r
    [line] = new_lines(n, 1)
    ends = []
    for c in r["choices"]:
        if c["finish_reason"] not in ends:
            ends.append(c["finish_reason"])
    check(line, me, "POST", "/v1/completions", 200, r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"],
          ",".join(ends))


def test_streamed_chat():
    n = count()
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "seed": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c.connect()
    me = "%s:%d" % c.sock.getsockname()
    c.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
              headers=dict(AUTH, **{"Content-Type": "application/json"}))
    r = c.getresponse()
    assert r.status == 200
    events = [e[6:] for e in r.read().decode().split("\n\n") if e.startswith("data: ")]
    c.close()
    assert events[-1] == "[DONE]", events[-1]
    usage = json.loads(events[-2])["usage"]
    finish = [ch["finish_reason"] for e in events[:-2] for ch in json.loads(e)["choices"] if ch["finish_reason"]]
    [line] = new_lines(n, 1)
    check(line, me, "POST", "/v1/chat/completions", 200, usage["prompt_tokens"], usage["completion_tokens"],
          finish[0])


def test_refusals():
    """404, 400 (bad JSON), 401, 405, 415, 413 before the body is read, and a
    Content-Length that libmicrohttpd refuses itself (no method: kiln never saw the
    request): each one line with the status sent."""
    n = count()
    want = []
    s, b, me = call("GET", "/v1/nothing", headers=AUTH)
    want.append((me, "GET", "/v1/nothing", s))
    assert s == 404
    s, b, me = call("POST", "/v1/completions", raw=b'{"prompt": "x", ', headers=AUTH)
    want.append((me, "POST", "/v1/completions", s))
    assert s == 400
    s, b, me = call("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    want.append((me, "POST", "/v1/completions", s))
    assert s == 401
    s, b, me = call("POST", "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    want.append((me, "POST", "/v1/completions", s))
    assert s == 401
    s, b, me = call("DELETE", "/v1/models", headers=AUTH)
    want.append((me, "DELETE", "/v1/models", s))
    assert s == 405
    s, b, me = call("POST", "/tokenize", raw=b'{"prompt":"x"}', headers=dict(AUTH, **{"Content-Type": "text/plain"}))
    want.append((me, "POST", "/tokenize", s))
    assert s == 415
    s, me = raw_exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\n")
    want.append((me, "POST", "/v1/completions", s))
    assert s == 413
    s, me = raw_exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n{}")
    want.append((me, "-", "/v1/completions", s))
    assert s == 400
    s, b, me = call("OPTIONS", "/v1/completions", headers={"Origin": "http://x"})
    want.append((me, "OPTIONS", "/v1/completions", s))
    assert s == 204
    # a client that leaves after its request line, and one that leaves before its body
    # is all there: no status was sent
    s, me = raw_exchange(b"GET /health HTTP/1.1\r\nHost: x\r\n", leave=True)
    want.append((me, "-", "/health", s))
    s, me = raw_exchange(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 50\r\n\r\n{\"pro",
                         leave=True)
    want.append((me, "POST", "/tokenize", s))
    assert s == 0
    got = new_lines(n, len(want))
    for line, (me, method, target, status) in zip(got, want):
        check(line, me, method, target, status)


def test_keep_alive_each_request_its_own_status():
    """Several requests on one connection: a line each, each with its own status."""
    n = count()
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c.connect()
    me = "%s:%d" % c.sock.getsockname()
    statuses = []
    for path in ("/v1/nothing", "/health", "/v1/models", "/nowhere"):
        c.request("GET", path, headers=AUTH)
        r = c.getresponse()
        r.read()
        statuses.append((path, r.status))
    c.close()
    assert [s for _, s in statuses] == [404, 200, 200, 404], statuses
    got = new_lines(n, 4)
    for line, (path, status) in zip(got, statuses):
        check(line, me, "GET", path, status)


def test_disconnect_mid_stream():
    n = count()
    sk = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    me = "%s:%d" % sk.getsockname()
    body = json.dumps({"model": NAME, "prompt": "Long", "max_tokens": 100, "stream": True, "seed": 4,
                       "n": 16}).encode()
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
               + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: " not in got:
        got += sk.recv(4096)
    sk.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    sk.close()
    [line] = new_lines(n, 1)
    s, t = H.post(srv.port, "/tokenize", {"prompt": "Long"}, headers=AUTH)
    assert line["end"] == "cancelled", line
    assert line["status"] == 200 and line["client"] == me and line["prompt"] == t["count"], line
    assert 1 <= line["completion"] < 1600, line
    assert H.request(srv.port, "GET", "/health")[0] == 200
    new_lines(n + 1, 2)  # the /tokenize and /health above, one line each


def test_concurrent_clients_a_line_each():
    """32 clients at once, half of them streaming: 32 lines, each whole, each client's
    once, with its own status and usage."""
    import threading
    n = count()
    res, errs = [None] * 32, []

    def client(i):
        try:
            body = {"prompt": f"Line {i}:", "max_tokens": 8 + i, "seed": 1000 + i, "stream": bool(i % 2),
                    "stream_options": {"include_usage": True}}
            s, b, me = call("POST", "/v1/completions", body, AUTH)
            if i % 2:
                events = [e[6:] for e in b.decode().split("\n\n") if e.startswith("data: ")]
                usage = json.loads(events[-2])["usage"]
            else:
                usage = json.loads(b)["usage"]
            res[i] = (me, s, usage)
        except Exception as e:  # noqa: BLE001
            errs.append((i, repr(e)))

    ts = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs, errs
    got = {line["client"]: line for line in new_lines(n, 32)}
    assert len(got) == 32
    for me, s, u in res:
        line = got[me]
        assert (line["status"], line["prompt"], line["completion"]) == (s, u["prompt_tokens"], u["completion_tokens"]), \
            (line, s, u)


def test_forged_lines():
    """A path with %0a, raw control bytes, a terminal escape, a space-like byte or a
    backslash: one line for each request, with those bytes escaped."""
    n = count()
    s1, b, me1 = call("GET", "/v1/x%0a2026-01-01T00:00:00.000Z 1.2.3.4:5 GET /admin 200 prompt=0 completion=0 "
                             "ms=0.1 end=-".replace(" ", "%20"), headers=AUTH)
    s2, me2 = raw_exchange(b"GET /a\x01b\x1b[31mred\x7f\x80\xff\\q\tz HTTP/1.1\r\nHost: x\r\n\r\n")
    s3, me3 = raw_exchange(b"GE\x1bT /a\rb HTTP/1.1\r\nHost: x\r\n\r\n")
    s4, b, me4 = call("GET", "/" + "%0a" * 1000, headers=AUTH)
    got = new_lines(n, 4)
    check(got[3], me4, "GET", "/" + "%0a" * 333 + "...", s4)  # cut at 1,000 characters
    # the raw target, percent-encoding as sent: %0a is three characters, not a newline
    check(got[0], me1, "GET", "/v1/x%0a2026-01-01T00:00:00.000Z%201.2.3.4:5%20GET%20/admin%20200%20prompt=0%20"
                              "completion=0%20ms=0.1%20end=-", s1)
    for line in got[1:3]:
        assert not re.search(r"[\x00-\x1f\x7f-\xff]", line["line"]), line
    assert got[1]["client"] == me2 and got[1]["status"] == s2 and s2 in (400, 404), (got[1], s2)
    if s2 == 404:  # where libmicrohttpd takes the request line, its bytes are all there, escaped
        assert got[1]["target"] == r"/a\x01b\x1b[31mred\x7f\x80\xff\\q\x09z", got[1]
    assert got[2]["client"] == me3 and got[2]["status"] == s3, (got[2], s3)
    text = srv.stderr_text()
    assert "\x1b" not in text and "\x01" not in text, "a control byte reached stderr"


def test_format_is_greppable():
    """Every line of the log is one request, in the documented format, and nothing else
    on stderr claims to be one (a line of kiln's own starts with 'kiln serve:')."""
    lines = [l for l in srv.stderr_text().splitlines() if l]
    for l in lines:
        assert LINE.match(l) or l.startswith("kiln serve:") or not re.match(r"^\d{4}-", l), l


def quiet_server(*flags, expect=0):
    """A server with these flags and stderr a file: how many lines it logged for two
    requests (waiting up to 15 s for `expect` of them: a line is written after the
    response, and a loaded machine may be slow to get there; then a moment more)."""
    path = os.path.join(A.workdir, "reqlog-flags.err")
    with H.Server(A.kiln, RUN, *flags, stderr_path=path) as k:
        assert H.request(k.port, "GET", "/health")[0] == 200
        assert H.post(k.port, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
        deadline = time.time() + 15
        while expect and time.time() < deadline and len(log_lines(k.stderr_text())) < expect:
            time.sleep(0.05)
        time.sleep(0.5)
        lines = log_lines(k.stderr_text())
    return len(lines)


def test_timeout():
    """A request past --timeout: a plain one is a 504 and a stream a 200 whose last event
    is the timeout's error; either way the line says end=timeout. (With one sequence a
    step, 16 choices of 100 tokens take longer than the watchdog's first look, 0.1 s.)"""
    path = os.path.join(A.workdir, "reqlog-timeout.err")
    body = {"prompt": "Long", "max_tokens": 100, "n": 16, "seed": 1}
    with H.Server(A.kiln, RUN, "--log-requests", "--timeout", "0.001", "--max-batch", "1",
                  stderr_path=path) as k:
        s, b, me = call("POST", "/v1/completions", body, port=k.port)
        assert s == 504 and json.loads(b)["error"]["code"] == "timeout", (s, b)
        [line] = new_lines(0, 1, server=k)
        check(line, me, "POST", "/v1/completions", 504, 4, line["completion"], "timeout")
        ev = H.sse(k.port, "/v1/completions", dict(body, stream=True))
        assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "timeout", ev[-2:]
        [line] = new_lines(1, 1, server=k)
        assert (line["status"], line["prompt"], line["end"]) == (200, 4, "timeout"), line


def test_queue_full_429():
    """A full queue: the 429s and the 200s each logged with the status that client got,
    and a 429 with no tokens (it never ran)."""
    import threading
    path = os.path.join(A.workdir, "reqlog-429.err")
    with H.Server(A.kiln, RUN, "--log-requests", "--max-queue", "1", "--max-batch", "1", stderr_path=path) as k:
        res = []

        def client():
            try:
                s, b, me = call("POST", "/v1/completions", {"prompt": "x", "max_tokens": 100}, port=k.port)
                res.append((me, s, json.loads(b)))
            except Exception as e:  # noqa: BLE001
                res.append((None, repr(e), None))

        ts = [threading.Thread(target=client) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        codes = sorted(s for _, s, _ in res)
        assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
        got = {line["client"]: line for line in new_lines(0, 8, server=k)}
        for me, s, b in res:
            if s == 200:
                check(got[me], me, "POST", "/v1/completions", 200, b["usage"]["prompt_tokens"],
                      b["usage"]["completion_tokens"], b["choices"][0]["finish_reason"])
            else:
                check(got[me], me, "POST", "/v1/completions", 429)


def test_stopping_logs_what_runs():
    """SIGTERM while a stream runs: the stream ends (cancelled), and its line is written
    before the server exits."""
    import threading
    path = os.path.join(A.workdir, "reqlog-stop.err")
    k = H.Server(A.kiln, RUN, "--log-requests", "--max-batch", "1", stderr_path=path)
    out = {}

    def stream():
        try:
            out["events"] = H.sse(k.port, "/v1/completions", {"prompt": "Long", "max_tokens": 100, "n": 16,
                                                              "stream": True})
        except Exception as e:  # noqa: BLE001
            out["error"] = repr(e)

    t = threading.Thread(target=stream)
    try:
        t.start()
        deadline = time.time() + 10
        while time.time() < deadline and H.metric(k.port, "kiln_running_requests") != 1:
            time.sleep(0.01)
        assert H.metric(k.port, "kiln_running_requests") == 1
    finally:
        rc = k.stop()
        t.join(30)
    assert rc == 0, rc
    lines = [l for l in log_lines(k.stderr_text()) if l["target"] == "/v1/completions"]
    assert len(lines) == 1 and lines[0]["end"] == "cancelled" and lines[0]["status"] == 200, (lines, out)


def test_off_where_stderr_is_not_a_terminal():
    assert quiet_server() == 0
    assert quiet_server("--log-requests", "--no-log-requests") == 0
    assert quiet_server("--log-requests=false") == 0
    assert quiet_server("--no-log-requests", "--log-requests", expect=2) == 2


def on_a_terminal(*flags):
    """A server with its stderr a terminal (a pseudo-terminal here): what it wrote there
    after one request."""
    master, slave = pty.openpty()
    p = subprocess.Popen([A.kiln, "serve", RUN, "--port", "0", *flags], stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    text, port = "", None

    def read(until, wait=60):
        nonlocal text
        deadline = time.time() + wait
        while time.time() < deadline and not until():
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    text += os.read(master, 65536).decode(errors="replace").replace("\r\n", "\n")
                except OSError:
                    break

    try:
        read(lambda: "ready" in text)
        m = re.search(r"listening on http://[\d.]+:(\d+)", text)
        assert m, text
        port = int(m.group(1))
        assert H.request(port, "GET", "/health")[0] == 200
        read(lambda: log_lines(text), wait=3)  # (none comes with --no-log-requests)
        read(lambda: False, wait=0.5)  # and no second one
    finally:
        p.terminate()
        p.wait(20)
        os.close(master)
    return log_lines(text)


def test_on_where_stderr_is_a_terminal():
    lines = on_a_terminal()
    assert len(lines) == 1 and lines[0]["target"] == "/health" and lines[0]["status"] == 200, lines
    assert on_a_terminal("--no-log-requests") == []


def test_a_stderr_that_fails_does_not_hurt():
    """Logging to a pipe nobody reads any more (EPIPE), and to a full disk (/dev/full):
    every request is still answered, and the server stops cleanly."""
    k = H.Server(A.kiln, RUN, "--log-requests")
    try:
        k.p.stderr.close()  # the read end: each line's write now fails with EPIPE
        for i in range(20):
            assert H.request(k.port, "GET", "/health")[0] == 200
            assert H.post(k.port, "/v1/completions", {"prompt": "x", "max_tokens": 3})[0] == 200
        ev = H.sse(k.port, "/v1/completions", {"prompt": "x", "max_tokens": 5, "stream": True})
        assert ev[-1] == "[DONE]"
        assert k.p.poll() is None
    finally:
        rc = k.stop()
    assert rc == 0, rc
    sk = socket.socket()
    sk.bind(("127.0.0.1", 0))
    port = sk.getsockname()[1]
    sk.close()
    with open("/dev/full", "w") as full:
        p = subprocess.Popen([A.kiln, "serve", RUN, "--port", str(port), "--log-requests"], stdout=subprocess.DEVNULL,
                             stderr=full)
    try:
        deadline = time.time() + 60
        up = False
        while time.time() < deadline and not up and p.poll() is None:
            try:
                up = H.request(port, "GET", "/health", timeout=5)[0] == 200
            except OSError:
                time.sleep(0.1)
        assert up, "the server with stderr on /dev/full did not come up"
        for i in range(10):
            assert H.post(port, "/v1/completions", {"prompt": "x", "max_tokens": 3})[0] == 200
    finally:
        p.terminate()
        p.wait(20)
    assert p.returncode == 0, p.returncode


def main():
    global srv
    path = os.path.join(A.workdir, "reqlog.err")
    with H.Server(A.kiln, RUN, "--log-requests", "--api-key", KEY, "--max-body", "65536", stderr_path=path) as s:
        srv = s
        rc = H.run_tests([
            test_completion, test_n_choices_count_together, test_streamed_chat, test_refusals,
            test_keep_alive_each_request_its_own_status, test_disconnect_mid_stream,
            test_concurrent_clients_a_line_each, test_forged_lines,
            test_format_is_greppable])
        code = s.stop()
        if code != 0:
            print(f"kiln serve exited with {code} on SIGTERM")
            rc = 1
    rc |= H.run_tests([test_timeout, test_queue_full_429, test_stopping_logs_what_runs, test_off_where_stderr_is_not_a_terminal, test_on_where_stderr_is_a_terminal,
                       test_a_stderr_that_fails_does_not_hurt])
    sys.exit(rc)


if __name__ == "__main__":
    main()
