"""Hostile training runs (issue 50): work is never lost and a run remembers itself.

- A signal: SIGINT (or SIGTERM) to a real `kiln train` after it has logged some steps
  finishes the step, writes its checkpoint, names the step and how to resume, and exits
  130 (143); the checkpoint's step is the last logged one, and --resume continues from
  it and says so. A second signal while it stops kills it at once (death by signal, no
  resume line). Steps logged past the checkpoint are dropped on resume, and said so.
- The run's settings: a resume with no flags takes the architecture and the data from
  run.json; a changed --width, --tokenizer or --arch is refused naming the flag and
  both values, the run untouched; --steps and --lr may change, and are listed.
- A run folder is never replaced by accident: kiln train into a finished or a stopped
  run without --resume or --overwrite is refused, naming both, every file untouched;
  --overwrite trains a new run there; --resume with --overwrite is a usage error.

Every wait is for an event (a logged step, the process's end) with a deadline, never a
fixed sleep.
"""
import json
import os
import random
import re
import signal
import subprocess
import time
from hostile import Suite

s = Suite(__doc__)
d = s.dir("train_run")
corpus = os.path.join(d, "corpus.txt")
rng = random.Random(3)
words = "the light was good and darkness upon face of deep waters".split()
with open(corpus, "w") as f:
    f.write("".join(rng.choice(words) + (".\n" if i % 12 == 11 else " ") for i in range(6000)))

TINY = ["--layers", "2", "--width", "32", "--heads", "4", "--context", "32", "--batch", "4", "--eval-batches", "2",
        "--lr", "3e-3", "--warmup", "2"]
DEADLINE = 60  # seconds for any one event


def model_step(run):
    """The step in a run's model.safetensors metadata (None when unreadable)."""
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


def start(run, *extra):
    """kiln train on RUN in the background, its output to RUN.log; (process, log path)."""
    log = run + ".log"
    cmd = [s.kiln, "train", "--data", corpus, "--out", run, "--threads", "1", "--eval-every", "0", *extra]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=s.work), log


def wait_logged(p, log, step):
    """Waits until the run's output shows step STEP done; False on a deadline or an early end."""
    t = time.time() + DEADLINE
    while time.time() < t and p.poll() is None:
        with open(log) as f:
            done = [int(m) for m in re.findall(r"^step +(\d+)/", f.read(), re.M)]
        if done and max(done) >= step:
            return True
        time.sleep(0.05)
    return False


def finish(p):
    try:
        return p.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None


def text(log):
    with open(log) as f:
        return f.read()


# ---- a signal stops the run with a checkpoint ----
for sig, code, name in ((signal.SIGINT, 130, "interrupted \\(SIGINT\\)"), (signal.SIGTERM, 143, "terminated \\(SIGTERM\\)")):
    run = os.path.join(d, "sig%d" % sig)
    p, log = start(run, "--steps", "100000", "--save-every", "1000", *TINY)
    if not s.check(wait_logged(p, log, 3), "%s: the run logs 3 steps within %ds" % (sig.name, DEADLINE)):
        p.kill()
        print("      output: " + text(log)[-800:])
        continue
    p.send_signal(sig)
    rc = finish(p)
    out = text(log)
    s.check(rc == code, "%s: kiln train exits %d (got %s)" % (sig.name, code, rc))
    m = re.search(r"kiln train: %s at step (\d+); saved (\S+) \(step (\d+)\)\. Resume with: kiln train --out (\S+) "
                  r"--resume" % name, out)
    if not s.check(m is not None, "%s: the message names the step and how to resume" % sig.name):
        print("      output: " + out[-800:])
        continue
    n = int(m.group(1))
    logged = logged_steps(run)
    s.check(int(m.group(3)) == n and m.group(2) == run and m.group(4) == run,
            "%s: it saved the run it names, at that step" % sig.name)
    s.check(model_step(run) == n and logged and logged[-1] == n and logged == list(range(1, n + 1)),
            "%s: the checkpoint's step (%s) is the last logged one (%s), named in the message (%d)"
            % (sig.name, model_step(run), logged[-1] if logged else None, n))
    # The stopped run is not replaced by accident: refused, every file untouched.
    s.case("%s: training into the stopped run without --resume is refused" % sig.name,
           ["train", "--data", corpus, "--out", run, "--steps", "5", "--threads", "1", *TINY], rc=1,
           msg=r"holds a run stopped at step %d of 100000; --resume continues it, --overwrite" % n, untouched=[run])
    # The command the message gives resumes it (with --steps, to end).
    r = s.case("%s: the resume continues from the checkpoint's step and says so" % sig.name,
               ["train", "--out", run, "--resume", "--steps", str(n + 2), "--threads", "1"], rc=0,
               msg=r"resumed %s at step %d\n" % (re.escape(run), n), nomsg=r"dropped")
    s.check(logged_steps(run) == list(range(1, n + 3)) and model_step(run) == n + 2,
            "%s: the resumed run logs steps %d-%d after the kept ones: %s" % (sig.name, n + 1, n + 2, logged_steps(run)[-4:]))

# ---- a second signal exits at once ----
# A model whose steps take a while, so that the second signal comes while the first is
# being honoured (SIGINT then SIGTERM: two different signals, never merged into one).
run = os.path.join(d, "twice")
p, log = start(run, "--steps", "100000", "--save-every", "2", "--layers", "2", "--width", "128", "--heads", "4",
               "--context", "64", "--batch", "8", "--eval-batches", "1")
if s.check(wait_logged(p, log, 3), "the slower run logs 3 steps within %ds" % DEADLINE):
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGTERM)
    rc = finish(p)
    out = text(log)
    s.check(rc in (-signal.SIGINT, -signal.SIGTERM) and "Resume with" not in out,
            "a second signal kills the run at once (exit %s; wanted death by SIGINT or SIGTERM, no resume line)" % rc)
    # Whatever the last periodic save was, the resume starts there and drops (and says
    # so) exactly the steps logged past it.
    ck, logged = model_step(run), logged_steps(run)
    if s.check(ck is not None and logged, "the killed run left a checkpoint (step %s) and metrics" % ck):
        past = [x for x in logged if x > ck]
        want = (r"resumed %s at step %d; dropped %d logged steps? \(%d-%d\) past the checkpoint from metrics.jsonl"
                % (re.escape(run), ck, len(past), past[0], past[-1])) if past else r"resumed %s at step %d\n" % (
                    re.escape(run), ck)
        s.case("the resume after a kill reports the steps it drops (%d)" % len(past),
               ["train", "--out", run, "--resume", "--steps", str(ck + 1), "--threads", "1"], rc=0, msg=want)
        s.check(logged_steps(run) == list(range(1, ck + 2)), "the metrics hold steps 1-%d once each" % (ck + 1))
else:
    p.kill()
    p.wait()

# Steps logged past the checkpoint, as a kill leaves them, made by hand: the count and
# range are named even with --quiet, and the rows are replaced, not repeated.
run = os.path.join(d, "sig%d" % signal.SIGINT)
n = model_step(run)
if s.check(n is not None, "the SIGINT run's checkpoint is there for the drop test"):
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        for k in range(1, 4):
            f.write(json.dumps({"step": n + k, "loss": 9.99}) + "\n")
    s.case("a resume names the logged steps past the checkpoint that it drops",
           ["train", "--out", run, "--resume", "--steps", str(n + 1), "--threads", "1", "--quiet"], rc=0,
           msg=r"resumed %s at step %d; dropped 3 logged steps \(%d-%d\) past the checkpoint from metrics.jsonl"
           % (re.escape(run), n, n + 1, n + 3))
    s.check(logged_steps(run) == list(range(1, n + 2)), "the dropped rows are gone: steps 1-%d once each" % (n + 1))

# ---- a run remembers its settings ----
run = os.path.join(d, "wide")
s.case("a run with a width, depth and context of its own trains",
       ["train", "--data", corpus, "--out", run, "--steps", "4", "--save-every", "2", "--threads", "1", "--layers", "1",
        "--width", "64", "--heads", "2", "--context", "16", "--batch", "4", "--eval-batches", "1", "--lr", "3e-3"],
       rc=0, msg=r"1 layer, C=64, 2 heads")
s.case("a finished run is not replaced without --overwrite; every file untouched",
       ["train", "--data", corpus, "--out", run, "--steps", "4", "--threads", "1"], rc=1,
       msg=r"holds a finished run \(step 4 of 4\); --resume --steps N \(N > 4\) trains it on, --overwrite", untouched=[run])
s.case("a finished run is not replaced by the same flags either",
       ["train", "--data", corpus, "--out", run, "--steps", "4", "--threads", "1", "--layers", "1", "--width", "64",
        "--heads", "2", "--context", "16", "--batch", "4"], rc=1, msg=r"holds a finished run", untouched=[run])
for flag, value, was in (("--width", "128", "64"), ("--tokenizer", "bpe:300", "byte"), ("--arch", "llama", "gpt2"),
                         ("--seed", "7", "1337")):
    s.case("resume with a different %s is refused naming it and both values" % flag,
           ["train", "--out", run, "--resume", "--steps", "6", "--threads", "1", flag, value], rc=1,
           msg=r"%s %s does not match the run: it was trained with %s %s \(" % (flag, re.escape(value), flag, was),
           untouched=[run])
s.case("resume with the same architecture flags again is fine (nothing to refuse)",
       ["train", "--out", run, "--resume", "--steps", "5", "--threads", "1", "--width", "64", "--layers", "1"], rc=0,
       msg=r"resumed %s at step 4\n.*\n?.*1 layer, C=64, 2 heads \(2 kv\), T=16" % re.escape(run))
s.case("resume with no flags but --steps takes the architecture and data from run.json; --steps and --lr change",
       ["train", "--out", run, "--resume", "--steps", "7", "--lr", "1e-3", "--threads", "1"], rc=0,
       msg=r"changed from run.json: --steps 7 \(was 5\), --lr 0.001 \(was 0.003\)\n(.*\n)*.*1 layer, C=64, 2 heads")
s.check(logged_steps(run) == list(range(1, 8)) and model_step(run) == 7, "the resumed run reached step 7")
# A run.json from before "options": the flags alone, as then; a shape that does not fit
# is named by field, both values, after the load's own error.
old = os.path.join(d, "old")
s.case("a run to make old-style", ["train", "--data", corpus, "--out", old, "--steps", "2", "--threads", "1",
                                   "--layers", "1", "--width", "64", "--heads", "2", "--context", "16", "--batch", "2"],
       rc=0)
with open(os.path.join(old, "run.json")) as f:
    info = json.load(f)
del info["options"]
with open(os.path.join(old, "run.json"), "w") as f:
    json.dump(info, f)
s.case("resuming a run whose run.json records no settings, without its --width, names the field and both values",
       ["train", "--data", corpus, "--out", old, "--resume", "--steps", "3", "--threads", "1", "--layers", "1",
        "--heads", "2", "--context", "16", "--batch", "2"], rc=1,
       msg=r"differs from the one these flags build: n_embd 64 \(these flags: 256\); its run.json records no settings",
       untouched=[old])
s.case("... and with it, resumes (and records its settings from then on)",
       ["train", "--data", corpus, "--out", old, "--resume", "--steps", "3", "--threads", "1", "--layers", "1",
        "--width", "64", "--heads", "2", "--context", "16", "--batch", "2"], rc=0, msg=r"resumed .* at step 2")
s.case("... so that the next resume needs no flags", ["train", "--out", old, "--resume", "--steps", "4",
                                                      "--threads", "1"], rc=0, msg=r"C=64")
s.case("--resume and --overwrite together are a usage error", ["train", "--out", run, "--resume", "--overwrite"], rc=2,
       msg=r"give one", untouched=[run])
s.case("--resume where there is no run is refused by name",
       ["train", "--out", os.path.join(d, "nothing"), "--resume"], rc=1, msg=r"holds no checkpoint")
s.case("--overwrite trains a new run in its place, with other settings",
       ["train", "--data", corpus, "--out", run, "--overwrite", "--steps", "2", "--threads", "1", *TINY], rc=0,
       msg=r"2 layers, C=32, 4 heads")
s.check(logged_steps(run) == [1, 2] and model_step(run) == 2 and
        not os.path.exists(os.path.join(run, "train_state.prev.safetensors")),
        "the new run's files replace the old run's (metrics 1-2, step 2, no old previous state)")
s.done()
