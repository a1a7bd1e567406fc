"""kiln serve starts in the right order (issue 50, item 4): the model is loaded and
checked before the port is bound, so a model that does not load gets its error and no
URL; a port in use is one line that names it and suggests --port 0; "listening" is said
once the server can answer, and then /health says ok."""
import os
import re
import signal
import subprocess
import time
import urllib.request
from hostile import Suite

s = Suite(__doc__)
d = s.dir("serve_start")
corpus = os.path.join(d, "corpus.txt")
with open(corpus, "w") as f:
    words = "the light was good and darkness upon face of deep waters".split()
    f.write(" ".join(words[(i * 7 + i // 3) % len(words)] for i in range(6000)))
run = os.path.join(d, "run")
p, out = s.run(["train", "--data", corpus, "--out", run, "--layers", "1", "--width", "32", "--heads", "2", "--steps",
                "2", "--batch", "2", "--context", "32", "--quiet", "--eval-every", "0", "--threads", "1"], timeout=300)
s.check(p is not None and p.returncode == 0, "a tiny model trains (set-up): " + out[-300:])

s.case("a model folder that is not there: its error, and no URL", ["serve", os.path.join(d, "absent"), "--port", "0"],
       rc=1, msg=r"absent: No such file", nomsg=r"listening|http://")
s.case("a folder of neither kind: its error, and no URL", ["serve", s.dir("empty"), "--port", "0"], rc=1,
       msg=r"neither a kiln run folder", nomsg=r"listening|http://")

first = subprocess.Popen([s.kiln, "serve", run, "--port", "0", "--threads", "1"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
port, seen, deadline = None, "", time.time() + 120
while port is None and time.time() < deadline:
    line = first.stderr.readline()
    if not line:
        break
    seen += line
    m = re.search(r"ready; listening on http://[\d.]+:(\d+)", line)
    port = int(m.group(1)) if m else None
try:
    if s.check(port is not None, "the server says 'ready; listening' with its port (%s)" % seen[-200:]):
        s.check("loading" in seen and seen.index("loading") < seen.index("listening"),
                "it says it is loading before it says it is listening")
        with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=60) as r:
            s.check(r.status == 200, "once it says listening, /health answers 200")
        p = s.case("a port in use is one line naming it and --port 0",
                   ["serve", run, "--port", str(port), "--threads", "1"], rc=1,
                   msg=r"port %d on 127\.0\.0\.1 is in use.*--port 0 picks a free one" % port, nomsg=r"listening")
        if p is not None:
            lines = [l for l in (p.stdout + p.stderr).decode().splitlines() if l.strip()]
            s.check(len(lines) == 2 and "loading" in lines[0], "... after the loading line, nothing else: %s" % lines)
finally:
    first.send_signal(signal.SIGTERM)
    try:
        first.wait(timeout=30)
    except subprocess.TimeoutExpired:
        first.kill()
        first.wait()
s.check(first.returncode == 0, "the first server stops cleanly on SIGTERM")
s.done()
