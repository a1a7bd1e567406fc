"""The hostile suite's harness (tests/hostile/): runs the kiln program on bad input and
checks what a user sees.

A test file does
    from hostile import Suite
    s = Suite(__doc__)                  # parses --kiln and --workdir
    d = s.dir("name")                   # a fresh folder under the work dir
    s.case("what it checks", ["train", "--threads", "-5"],
           rc=2, msg=r"--threads", files=[d])
    s.done()                            # prints 'N passed, N failed', exits 1 on a failure

case() runs `kiln ARGS` with a deadline (a hang is a failure, never a wait forever),
checks the exit status (an int, or a collection of allowed ones; a signal death is
always a failure), that the combined output matches msg (a regex, searched), and that
every path listed in `untouched` has the same content, type and mode after as before
(files and folders, recursively). It returns the CompletedProcess for further checks.

s.args.shim is the LD_PRELOAD module of tests/hostile/shim.c (a disk that fills up, an
fsync that fails, a file slow to open), or None where the suite was run without it.
"""
import argparse
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time


def snapshot(path):
    """{relative path: (type, mode, sha256 of content or link target)} under path."""
    out = {}

    def one(p, rel):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            out[rel] = ("absent",)
            return
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", mode, os.readlink(p))
        elif stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                out[rel] = ("file", mode, hashlib.sha256(f.read()).hexdigest())
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", mode)
            for name in sorted(os.listdir(p)):
                one(os.path.join(p, name), os.path.join(rel, name))
        else:
            out[rel] = ("special", stat.S_IFMT(st.st_mode), st.st_rdev)

    one(path, ".")
    return out


class Suite:
    def __init__(self, doc=None):
        ap = argparse.ArgumentParser(description=doc)
        ap.add_argument("--kiln", required=True)
        ap.add_argument("--workdir", required=True)
        ap.add_argument("--shim", help="the LD_PRELOAD module of a full disk and a slow file (shim.c)")
        self.args = ap.parse_args()
        self.kiln = os.path.abspath(self.args.kiln)
        self.work = os.path.abspath(self.args.workdir)
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        self.passed = 0
        self.failed = []

    def dir(self, name):
        d = os.path.join(self.work, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d

    def corpus(self, d, words=6000):
        """A small made-up text in d/corpus.txt (enough tokens for tiny batches); its path."""
        path = os.path.join(d, "corpus.txt")
        vocab = "the light was good and darkness upon face of deep waters".split()
        with open(path, "w") as f:
            f.write(" ".join(vocab[(i * 7 + i // 3) % len(vocab)] for i in range(words)))
        return path

    def serve(self, args, env=None, deadline=120):
        """Starts `kiln serve ARGS` and reads its stderr until it says where it listens:
        (the process, the port or None, what it said)."""
        e = dict(os.environ)
        e.update(env or {})
        p = subprocess.Popen([self.kiln, "serve", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=e)
        port, seen, end = None, "", time.time() + deadline
        while port is None and time.time() < end:
            line = p.stderr.readline()
            if not line:
                break
            seen += line
            m = re.search(r"listening on http://[\d.]+:(\d+)", line)
            port = int(m.group(1)) if m else None
        return p, port, seen

    @staticmethod
    def stop(p):
        """SIGTERM, then SIGKILL after 30 s; the exit status."""
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        return p.returncode

    def check(self, cond, what):
        print(("ok    " if cond else "FAIL  ") + what, flush=True)
        if cond:
            self.passed += 1
        else:
            self.failed.append(what)
        return cond

    def run(self, args, env=None, timeout=120, stdin=None, cwd=None):
        """Runs kiln ARGS; returns (CompletedProcess or None on a hang, output text)."""
        e = dict(os.environ)
        e.update(env or {})
        try:
            p = subprocess.run([self.kiln, *args], env=e, capture_output=True, timeout=timeout,
                               input=stdin, cwd=cwd or self.work)
        except subprocess.TimeoutExpired:
            return None, ""
        out = (p.stdout + p.stderr).decode("utf-8", "replace")
        return p, out

    def case(self, what, args, rc=None, msg=None, nomsg=None, untouched=(), env=None, timeout=120,
             stdin=None, cwd=None):
        before = {u: snapshot(u) for u in untouched}
        p, out = self.run(args, env=env, timeout=timeout, stdin=stdin, cwd=cwd)
        why = []
        if p is None:
            why.append("hung past %ds" % timeout)
        else:
            if p.returncode < 0:
                why.append("died of signal %d" % -p.returncode)
            elif rc is not None:
                ok = p.returncode in rc if isinstance(rc, (list, tuple, set)) else p.returncode == rc
                if not ok:
                    why.append("exit %d, wanted %s" % (p.returncode, rc))
            if msg is not None and not re.search(msg, out):
                why.append("output lacks /%s/" % msg)
            if nomsg is not None and re.search(nomsg, out):
                why.append("output has /%s/" % nomsg)
            if "AddressSanitizer" in out or "runtime error:" in out:
                why.append("sanitizer report")
        for u in untouched:
            if snapshot(u) != before[u]:
                why.append("%s changed" % u)
        label = ("%s: kiln %s" % (what, " ".join(args)))[:200]
        if not self.check(not why, label + ("" if not why else " -- " + "; ".join(why))):
            print("      output: " + out[-1500:].replace("\n", "\n      "), flush=True)
        return p

    def done(self):
        print("%d passed, %d failed" % (self.passed, len(self.failed)))
        for f in self.failed:
            print("FAILED: " + f)
        sys.exit(1 if self.failed else 0)
