"""`kiln train` on 2 ranks under Open MPI's mpirun, stopped by a signal (issue 50).

- Ctrl-C to mpirun (which sends SIGTERM to every rank): the ranks stop after the same
  step, rank 0 writes the checkpoint of that step and names it with the resume command,
  nothing hangs.
- SIGTERM to rank 1 alone: rank 0 was not signalled, yet both stop after the same step
  (the stop request travels with the loss's allreduce), and the checkpoint is that step.
- Each stopped run resumes on 2 ranks from the step it names, and says so.

Oracle: the checkpoint's step (model.safetensors metadata) equals the last step in
metrics.jsonl and the step in the message. Every wait is for an event with a deadline.
Exits 77 (skip) when mpirun is missing or the kiln build has no MPI.
  python3 tests/dist/test_dist_stop.py --kiln build/kiln --workdir DIR
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from mpi_session import own_session_dir
from test_dist_train import SKIP, args, corpus

DEADLINE = 120
# (mpirun's SIGKILL follows its SIGTERM after odls_base_sigkill_timeout seconds, 1 by
# default, and its SIGTERM itself comes that long after a Ctrl-C: too short for a step
# and a save on a loaded machine, so the test gives 10)
MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "odls_base_sigkill_timeout", "10", "-np", "2"]
TINY = ["--layers", "2", "--width", "32", "--heads", "4", "--context", "32", "--batch", "4", "--threads", "1",
        "--eval-every", "0"]


def model_step(run):
    try:
        with open(os.path.join(run, "model.safetensors"), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return int(json.loads(f.read(n))["__metadata__"]["step"])
    except (OSError, KeyError, ValueError):
        return None


def logged_steps(run):
    try:
        with open(os.path.join(run, "metrics.jsonl")) as f:
            return [json.loads(line)["step"] for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def rank_pid(out, rank):
    """The pid of the kiln process of RANK training into OUT (found by its command line and
    Open MPI's rank variable); None if not there."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if os.path.basename(cmd[0]) == b"kiln" and out.encode() in cmd and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return int(pid)
    return None


def main():
    a = args()
    if not shutil.which("mpirun"):
        print("skip: mpirun not found")
        return SKIP
    os.makedirs(a.workdir, exist_ok=True)
    own_session_dir(a.workdir)
    data = os.path.join(a.workdir, "stop-corpus.txt")
    corpus(data)
    failed = 0

    def check(ok, what):
        nonlocal failed
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        failed += not ok
        return ok

    for how in ("SIGINT to mpirun", "SIGTERM to rank 1"):
        out = os.path.join(a.workdir, "stop-" + how.split()[0].lower())
        shutil.rmtree(out, ignore_errors=True)
        log = out + ".log"
        # --quiet: once mpirun has its SIGINT it stops passing the ranks' output on, and a
        # rank that fills the pipe with a progress line a step blocks in write() before it
        # can stop (docs/dist.md); the metrics file, which the test waits on, has every step
        p = subprocess.Popen([*MPI, a.kiln, "train", "--data", data, "--out", out, "--steps", "100000",
                              "--save-every", "1000", "--quiet", *TINY], stdout=open(log, "w"),
                             stderr=subprocess.STDOUT)
        t = time.time() + DEADLINE
        while time.time() < t and p.poll() is None and len(logged_steps(out)) < 3:
            time.sleep(0.05)
        text = open(log).read()
        if "built without MPI" in text:
            print("skip: this kiln was built without MPI")
            return SKIP
        if not check(len(logged_steps(out)) >= 3, f"{how}: 2 ranks log 3 steps within {DEADLINE}s ({text[-300:]})"):
            p.kill()
            p.wait()
            continue
        if how.startswith("SIGINT"):
            p.send_signal(signal.SIGINT)
        else:
            pid = rank_pid(out, 1)
            if not check(pid is not None, f"{how}: rank 1's process is found"):
                p.kill()
                p.wait()
                continue
            os.kill(pid, signal.SIGTERM)
        try:
            rc = p.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
        text = open(log).read()
        check(rc is not None and rc != 0, f"{how}: the job ends, non-zero (exit {rc}; None: hung past {DEADLINE}s)")
        m = re.search(r"kiln train: .* at step (\d+); saved (\S+) \(step (\d+)\)\. Resume with: kiln train --out (\S+) "
                      r"--resume", text)
        if not check(m is not None and m.group(2) == out and m.group(1) == m.group(3),
                     f"{how}: rank 0 names the step it saved and the resume command ({text[-400:]})"):
            continue
        n = int(m.group(1))
        check(model_step(out) == n and logged_steps(out) == list(range(1, n + 1)),
              f"{how}: the checkpoint's step ({model_step(out)}) is the last logged one "
              f"({logged_steps(out)[-1:]}) and the message's ({n})")
        r = subprocess.run([*MPI, a.kiln, "train", "--out", out, "--resume", "--steps", str(n + 2), "--threads", "1"],
                           capture_output=True, text=True, timeout=300)
        check(r.returncode == 0 and f"resumed {out} at step {n}\n" in r.stdout and
              logged_steps(out) == list(range(1, n + 3)),
              f"{how}: 2 ranks resume from step {n} and say so ({(r.stdout + r.stderr).strip()[-300:]})")
    print(f"{'FAILED' if failed else 'passed'}: {failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
