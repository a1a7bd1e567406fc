"""kiln serve starts in the right order (issue 50, item 4): the model is loaded and
checked before the port is bound, so a model that does not load gets its error and no
URL; a port in use is one line that names it and suggests --port 0; "listening" is said
once the server can answer, and then /health says ok."""
import os
import urllib.request
from hostile import Suite

s = Suite(__doc__)
d = s.dir("serve_start")
corpus = s.corpus(d)
run = os.path.join(d, "run")
p, out = s.run(["train", "--data", corpus, "--out", run, "--layers", "1", "--width", "32", "--heads", "2", "--steps",
                "2", "--batch", "2", "--context", "32", "--quiet", "--eval-every", "0", "--threads", "1"], timeout=300)
s.check(p is not None and p.returncode == 0, "a tiny model trains (set-up): " + out[-300:])

s.case("a model folder that is not there: its error, and no URL", ["serve", os.path.join(d, "absent"), "--port", "0"],
       rc=1, msg=r"absent: No such file", nomsg=r"listening|http://")
s.case("a folder of neither kind: its error, and no URL", ["serve", s.dir("empty"), "--port", "0"], rc=1,
       msg=r"neither a kiln run folder", nomsg=r"listening|http://")

first, port, seen = s.serve([run, "--port", "0", "--threads", "1"])
try:
    if s.check(port is not None and "ready; listening" in seen,
               "the server says 'ready; listening' with its port (%s)" % seen[-200:]):
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
    rc = s.stop(first)
s.check(rc == 0, "the first server stops cleanly on SIGTERM")
s.done()
