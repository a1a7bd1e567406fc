"""Shared pieces of the kiln serve end-to-end tests: a tiny trained model (cached in
the build folder), a real `kiln serve` process on a free loopback port, small HTTP
helpers, and a test runner that prints 'N passed, N failed'. Standard library only;
every wait is bounded, and every request goes to 127.0.0.1."""
import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import traceback

SKIP = 77


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--kiln", required=True, help="the kiln binary")
    p.add_argument("--workdir", required=True, help="a folder for the model and logs")
    a = p.parse_args()
    if not os.access(a.kiln, os.X_OK):
        print(f"skip: no kiln binary at {a.kiln}")
        sys.exit(SKIP)
    os.makedirs(a.workdir, exist_ok=True)
    return a


def model(kiln, workdir):
    """A 2-layer byte-level GPT trained for a few seconds on generated text; reused."""
    run = os.path.join(workdir, "serve-model")
    if os.path.exists(os.path.join(run, "model.safetensors")):
        return run
    rng = random.Random(7)
    words = ("the of and to in a is that for it as was with be by on not he this are or his from at "
             "which but have an they you were her she there been one all we their has would when").split()
    corpus = os.path.join(workdir, "serve-corpus.txt")
    with open(corpus, "w") as f:
        for _ in range(3000):
            f.write(" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + ".\n")
    subprocess.run([kiln, "train", "--data", corpus, "--out", run, "--arch", "gpt2", "--layers", "2",
                    "--width", "64", "--heads", "2", "--context", "128", "--batch", "8", "--steps", "150",
                    "--log-every", "50", "--eval-every", "1000", "--seed", "1"],
                   check=True, stdout=subprocess.DEVNULL, timeout=300)
    return run


class Server:
    """`kiln serve` on a free port; stopped (SIGTERM, then SIGKILL) on exit. Its stderr is
    a pipe read until it says "ready", or with stderr_path a file (all of it kept, for
    tests that read what the server writes there while it runs)."""

    def __init__(self, kiln, run, *extra, log=None, stderr_path=None):
        self.log = open(log or os.devnull, "w")
        self.stderr_path = stderr_path
        err = open(stderr_path, "w") if stderr_path else subprocess.PIPE
        self.p = subprocess.Popen([kiln, "serve", run, "--port", "0", *extra], stdout=self.log, stderr=err, text=True)
        if stderr_path:
            err.close()
        self.port = None
        deadline = time.time() + 60
        lines = []
        while time.time() < deadline:
            if stderr_path:
                with open(stderr_path, errors="replace") as f:
                    lines = f.readlines()
                if "ready" in "".join(lines) or self.p.poll() is not None:
                    break
                time.sleep(0.05)
                continue
            line = self.p.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "ready" in line:
                break
        for line in lines:
            m = re.search(r"listening on http://[\d.]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
        if not self.port or "ready" not in "".join(lines):
            self.stop()
            raise RuntimeError("kiln serve did not come up: " + "".join(lines))

    def stderr_text(self):
        """What the server has written to its stderr file so far."""
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
        if self.p.stderr:
            self.p.stderr.close()
        return self.p.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def request(port, method, path, body=None, headers=None, timeout=60, raw=None):
    """(status, headers dict, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    out = r.read()
    hd = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, hd, out


def post(port, path, body, **kw):
    s, h, b = request(port, "POST", path, body, **kw)
    return s, json.loads(b) if b else None


def sse(port, path, body, headers=None, timeout=60):
    """Events of a streamed request, parsed; the last is the string '[DONE]'."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request("POST", path, body=json.dumps(body).encode(), headers=h)
    r = c.getresponse()
    assert r.status == 200, (r.status, r.read())
    assert r.getheader("Content-Type").startswith("text/event-stream")
    events, buf = [], b""
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            assert ev.startswith(b"data: "), ev
            d = ev[6:].decode()
            events.append(d if d == "[DONE]" else json.loads(d))
    c.close()
    return events


def metric(port, name):
    s, h, b = request(port, "GET", "/metrics")
    for line in b.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def run_tests(tests):
    passed = failed = 0
    for t in tests:
        t0 = time.time()
        try:
            t()
            passed += 1
            print(f"PASS {t.__name__} ({time.time() - t0:.1f} s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {t.__name__}", flush=True)
            traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1
