"""Hostile numbers (issue 51, classes 1 and 2, and the flex parts of 5 and 7): every number
the kiln program reads (options, --config fields, KILN_* variables, attention specs,
checkpoint metadata) goes through one strict reader (src/core/parse.h). Out-of-range,
non-finite, hex, exponent-for-an-integer and padded values are refused with the thing
named first; training, kiln sample and kiln serve take or refuse an attention spec the
same way; thread counts are capped, not started by the thousand; an attention spec too
long for the model's config (10,000 parentheses, 50,000 '-') is refused with a short
message. No command takes a raw flex expression (--attention takes presets), so the
expression parser's depth limit and literal rules are checked in tests/test_flex.c."""
import json
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import time
from hostile import Suite

s = Suite(__doc__)
d = s.dir("numbers")
corpus = os.path.join(d, "corpus.txt")
random.seed(1)
words = "the quick brown fox jumps over a lazy dog and runs far away".split()
with open(corpus, "w") as f:
    f.write(" ".join(random.choice(words) for _ in range(3000)))
MODEL = ["--data", corpus, "--layers", "1", "--width", "32", "--heads", "1", "--context", "16", "--batch", "2",
         "--eval-batches", "1", "--quiet"]
TINY = [*MODEL, "--steps", "1", "--threads", "1"]
runs = s.dir("runs")  # runs that must not appear are checked by name under here


def out(name):
    return os.path.join(runs, name)


# ---- options: the range, the option named first ----
for args, what in [(["--threads", "-5"], r"--threads must be a whole number from 0 to 1024, got '-5'"),
                   (["--threads", "2000000"], r"--threads must be a whole number from 0 to 1024, got '2000000'"),
                   (["--lr", "-1"], r"--lr must be a number above 0, got '-1'"),
                   (["--lr", "nan"], r"--lr must be a number above 0, got 'nan'"),
                   (["--lr", "1e400"], r"--lr must be a number above 0, got '1e400'"),
                   (["--steps", "-3"], r"--steps must be a whole number from 0 to \d+, got '-3'"),
                   (["--steps", "0x10"], r"--steps must be a whole number .*, got '0x10'"),
                   (["--steps", "1e1"], r"--steps must be a whole number .*, got '1e1'"),
                   (["--steps", " 5"], r"--steps must be a whole number .*, got ' 5'"),
                   (["--steps", "99999999999999999999"], r"--steps must be a whole number"),
                   (["--dropout", "1"], r"--dropout must be a number >= 0 and below 1, got '1'")]:
    s.case("train %s is refused naming the option first" % " ".join(args), ["train", *args, "--out", out("o")],
           rc=2, msg=r"^kiln train: " + what, untouched=[runs])
s.case("sample --temperature nan is refused", ["sample", "--temperature", "nan"], rc=2,
       msg=r"^kiln sample: --temperature must be a number >= 0, got 'nan'")
s.case("sample --top-p 2 is refused", ["sample", "--top-p", "2"], rc=2,
       msg=r"^kiln sample: --top-p must be a number above 0 and at most 1, got '2'")
s.case("sample --threads -5 is refused", ["sample", "--threads", "-5"], rc=2, msg=r"^kiln sample: --threads must be")
s.case("serve --threads 2000000 is refused", ["serve", "--threads", "2000000"], rc=2,
       msg=r"^kiln serve: --threads must be a whole number from 0 to 1024")
s.case("serve --port 70000 is refused", ["serve", "--port", "70000"], rc=2,
       msg=r"^kiln serve: --port must be a whole number from 0 to 65535, got '70000'")
s.case("import --threads 0x10 is refused", ["import", "x", "y", "--threads", "0x10"], rc=2,
       msg=r"--threads must be a whole number")
s.case("tokenizer decode of a hex id is refused", ["tokenizer", "decode", "0x10"], rc=1,
       msg=r"a token id must be a whole number from 0 to \d+, got '0x10'")
s.case("train --help prints each number option's range", ["train", "--help"], rc=0,
       msg=r"--threads .*a whole number from 0 to 1024")

# ---- a --config file's numbers: the same reader, naming the file and key ----
for body, what in [({"steps": -3}, r"steps must be a whole number"), ({"lr": "nan"}, r"lr must be a number above 0"),
                   ({"threads": 2000000}, r"threads must be a whole number from 0 to 1024"),
                   ({"steps": 1.5}, r"steps must be a whole number .*, got '1.5'"),
                   ({"steps": "0x10"}, r"steps must be a whole number")]:
    cfg = os.path.join(d, "cfg.json")
    with open(cfg, "w") as f:
        json.dump(body, f)
    s.case("a config file's %s is refused" % json.dumps(body), ["train", "--config", cfg, "--out", out("c")], rc=2,
           msg=r"^kiln train: config '[^']*cfg.json': " + what, untouched=[runs])

# ---- threads from the environment: capped, not started by the million ----
s.case("KILN_NUM_THREADS=1000000 is said and the default used (the run is quick)",
       ["train", *MODEL, "--steps", "1", "--out", out("env_threads")], env={"KILN_NUM_THREADS": "1000000"}, rc=0,
       msg=r"KILN_NUM_THREADS='1000000' is not a whole number from 0 to 1024; using 0", timeout=120)
s.case("KILN_NUM_THREADS=0x10 is not a number", ["train", *MODEL, "--steps", "1", "--out", out("env_hex")],
       env={"KILN_NUM_THREADS": "0x10"}, rc=0, msg=r"KILN_NUM_THREADS='0x10' is not a whole number")
if 8 * (os.cpu_count() or 1) < 1000:
    s.case("--threads 1000 past 8 per core is capped with a warning",
           ["train", *MODEL, "--steps", "1", "--threads", "1000", "--out", out("capped")],
           rc=0, msg=r"kiln: 1000 threads asked for \(.*\); using %d, at most 8 per online core"
           % (8 * (os.cpu_count() or 1)), timeout=120)

# ---- attention specs: training refuses what serving would read otherwise ----
base = out("base")
s.case("a window model trains (the base of the cases below)", ["train", *TINY, "--attention", "window:4",
                                                                 "--out", base], rc=0)
bad_specs = {"window:inf": r"W of window:W must be a whole number from 1 to \d+, got 'inf'",
             "window:1e300": r"W of window:W must be a whole number .*, got '1e300'",
             "window:99999999999999999999": r"W of window:W must be a whole number .*, got '99999999999999999999'",
             "window:0x10": r"W of window:W must be a whole number .*, got '0x10'",
             "window:1e1": r"W of window:W must be a whole number .*, got '1e1'",
             "prefix:inf": r"P of prefix:P must be a whole number .*, got 'inf'",
             "softcap:1e-320": r"C of softcap:C \(a normal positive float\) must be a number from .*, got '1e-320'",
             "softcap:1e400": r"C of softcap:C \(a normal positive float\) must be a number from .*, got '1e400'"}
for spec, why in bad_specs.items():
    s.case("train --attention %s is refused" % spec, ["train", *TINY, "--attention", spec, "--out", out("a")], rc=1,
           msg=r"kiln train: .*attention '%s': .*" % spec + why)


def patched(name, spec):
    """A copy of the base run whose model config says attention SPEC (as a hand-edited
    or foreign checkpoint might)."""
    dst = out(name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(base, dst)
    p = os.path.join(dst, "model.safetensors")
    with open(p, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    cfg = json.loads(h["__metadata__"]["config"])
    cfg["attention"] = spec
    h["__metadata__"]["config"] = json.dumps(cfg)
    hb = json.dumps(h).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b[8 + n:])
    return dst


if os.path.exists(os.path.join(base, "model.safetensors")):
    ok = patched("window8", "window:8")
    s.case("a patched valid spec samples (the patching is sound)", ["sample", ok, "--tokens", "2", "--threads", "1"],
           rc=0)
    for i, spec in enumerate(["window:1e1", "window:0x10", "window:inf", "softcap:1e-320", "prefix:inf"]):
        m = patched("p%d" % i, spec)
        why = bad_specs[spec]
        s.case("sample refuses %s as training does" % spec, ["sample", m, "--tokens", "2", "--threads", "1"], rc=1,
               msg=why, untouched=[m])
        s.case("serve refuses %s as training does" % spec, ["serve", m, "--port", "0", "--threads", "1"], rc=1,
               msg=why, untouched=[m], timeout=60)

    # ---- a checkpoint's train_state numbers: strict, the key named ----
    r = out("resume")
    shutil.rmtree(r, ignore_errors=True)
    shutil.copytree(base, r)
    p = os.path.join(r, "train_state.safetensors")
    with open(p, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    h["__metadata__"]["rng_seed"] = "1337abc"
    hb = json.dumps(h).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b[8 + n:])
    s.case("a malformed train_state number is an error naming the key",
           ["train", *MODEL, "--steps", "2", "--threads", "1", "--attention", "window:4", "--resume", "--out", r], rc=1,
           msg=r"the metadata key rng_seed is malformed: rng_seed must be a whole number .*, got '1337abc'")

# ---- HTTP: a Content-Length that is not a whole number is a 400, not a guess ----
def http_status(port, length):
    """The status code kiln serve answers a POST whose Content-Length header is length."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
        c.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   "Content-Length: %s\r\nConnection: close\r\n\r\n" % length).encode())
        reply = b""
        while b"\r\n" not in reply:
            chunk = c.recv(4096)
            if not chunk:
                break
            reply += chunk
    m = re.match(rb"HTTP/1\.[01] (\d+)", reply)
    return int(m.group(1)) if m else None


if os.path.exists(os.path.join(base, "model.safetensors")):
    srv = subprocess.Popen([s.kiln, "serve", base, "--port", "0", "--threads", "1", "--max-body", "1000"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    port = None
    deadline = time.time() + 60
    while port is None and time.time() < deadline:
        line = srv.stderr.readline().decode("utf-8", "replace")
        if not line:
            break
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        port = int(m.group(1)) if m else None
    if s.check(port is not None, "kiln serve starts on a free port for the Content-Length cases"):
        # (libmicrohttpd answers these itself before kiln's handler sees them, an
        # overflowing count with its own 413; src/serve/http.c's strict reading is the
        # second line, for a version of it that passes them through)
        for length, want in [("12abc", (400,)), ("-1", (400,)), ("0x10", (400,)),
                             ("99999999999999999999", (400, 413))]:
            st = http_status(port, length)
            s.check(st in want, "Content-Length: %s is refused, %s (got %s)" % (length, " or ".join(map(str, want)), st))
        st = http_status(port, "5000")
        s.check(st == 413, "Content-Length: 5000 over --max-body 1000 is still a 413 (got %s)" % st)
    srv.terminate()
    try:
        srv.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.kill()
        s.check(False, "kiln serve stops on SIGTERM")

# ---- flex expressions through the CLI: the spec is capped, the message short ----
# (not checked: that the refused run leaves no folder; kiln train makes --out before it
# builds the model's config, a defect of its own class)
for what, spec in [("10,000 nested parentheses", "(" * 10000 + "causal" + ")" * 10000),
                   ("50,000 unary minus", "window:" + "-" * 50000 + "5")]:
    p = s.case("--attention of %s is refused with a short message" % what,
               ["train", *TINY, "--attention", spec, "--out", out("deep")], rc=1,
               msg=r"^kiln train: --attention is too long: at most 63 characters .*…'$")
    if p is not None:
        s.check(len(p.stderr) < 400, "the message about %s is short (%d bytes)" % (what, len(p.stderr)))
s.done()
