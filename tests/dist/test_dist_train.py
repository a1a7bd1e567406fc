"""Data-parallel `kiln train` under Open MPI's mpirun, against the one-process run.

Oracle: the same command on one process (world_size 1) over the same global batch.
With N ranks each takes batch/N rows of every global batch and the gradients are
averaged, so the losses match one process within float reassociation: the mean loss
of N equal shares against the mean over all rows, and gradients summed in another
order. Tolerance 1e-5 relative on every logged loss over 8 AdamW steps (measured
differences are about 1e-7), also for `--compile` on 2 ranks (the step one graph with
the gradients' allreduce in it; generated kernels round differently from eager ones). Two runs at the same N must give bitwise the same
losses. A mixture-of-experts model with its experts sharded over the ranks
(--expert-parallel, rows exchanged by all-to-all) on 2 and 4 ranks, eager and compiled
and saved on 2 and resumed on 4, must match the same model on one process, with the
same tolerance; the saved model holds every expert. A world size above 1 without an MPI launcher must fail with an error that
says to use mpirun, and a batch that does not split evenly must be refused.

Exits 77 (skip) when mpirun is missing or the kiln build has no MPI.
  python3 tests/dist/test_dist_train.py --kiln build/kiln --workdir DIR
"""
import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys

from mpi_session import own_session_dir

SKIP = 77


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--kiln", required=True)
    p.add_argument("--workdir", required=True)
    return p.parse_args()


def corpus(path):
    r = random.Random(5)
    words = "in the beginning god created heaven and earth and the earth was without form and void".split()
    with open(path, "w") as f:
        f.write("\n".join(" ".join(r.choice(words) for _ in range(12)) for _ in range(3000)))


DEFAULTS = {"--arch": "gpt2", "--layers": "2", "--width": "64", "--heads": "4", "--context": "32", "--batch": "8",
            "--steps": "8", "--log-every": "1", "--eval-every": "1000", "--seed": "3"}


def train(kiln, data, out, ranks, extra=(), env=None):
    """extra: flags with values ("--steps", "4") override DEFAULTS; bare flags ("--zero1") are added."""
    opts, flags, extra = dict(DEFAULTS), [], list(extra)
    while extra:
        f = extra.pop(0)
        if extra and not extra[0].startswith("--"):
            opts[f] = extra.pop(0)
        else:
            flags.append(f)
    if "--resume" not in flags:  # a new run: kiln train refuses to replace one left by an earlier session
        shutil.rmtree(out, ignore_errors=True)
    cmd = [kiln, "train", "--data", data, "--out", out, "--quiet", *flags]
    for k, v in opts.items():
        cmd += [k, v]
    if ranks > 1:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def losses(out, key="loss"):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)[key] for line in f if line.strip()]


def worst_of(got, want):
    """The largest relative difference of two equally long series; inf when either is short."""
    if len(got) != len(want) or not want:
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(got, want))


def main():
    a = args()
    if not shutil.which("mpirun"):
        print("skip: mpirun not found (apt-get install openmpi-bin libopenmpi-dev)")
        return SKIP
    os.makedirs(a.workdir, exist_ok=True)
    own_session_dir(a.workdir)
    data = os.path.join(a.workdir, "corpus.txt")
    corpus(data)
    env = dict(os.environ, KILN_WORLD_SIZE="2", KILN_RANK="0")
    r = train(a.kiln, data, os.path.join(a.workdir, "nompi"), 1, env=env)
    if "built without MPI" in r.stderr:
        print("skip: this kiln was built without MPI")
        return SKIP
    failed = 0

    def check(ok, what):
        nonlocal failed
        print(("ok   " if ok else "FAIL ") + what)
        failed += not ok

    check(r.returncode != 0 and "mpirun" in r.stderr,
          f"world size 2 without a launcher is refused and names mpirun: {r.stderr.strip()[:160]}")
    one = os.path.join(a.workdir, "w1")
    r = train(a.kiln, data, one, 1)
    check(r.returncode == 0, f"one process trains ({r.stderr.strip()[:200]})")
    want = losses(one)
    check(len(want) == 8, "one process logs 8 losses")
    for n in (2, 4):
        outs = [os.path.join(a.workdir, f"w{n}-{k}") for k in (0, 1)]
        got = []
        for out in outs:
            r = train(a.kiln, data, out, n)
            check(r.returncode == 0, f"mpirun -np {n} trains ({r.stderr.strip()[-300:]})")
            got.append(losses(out) if r.returncode == 0 else [])
        if not all(len(g) == 8 for g in got):
            check(False, f"mpirun -np {n} logs 8 losses")
            continue
        worst = max(abs(x - y) / abs(y) for x, y in zip(got[0], want))
        check(worst <= 1e-5, f"-np {n} matches one process: worst relative difference {worst:.2e} (tolerance 1e-5)")
        check(got[0] == got[1], f"two -np {n} runs give bitwise the same losses")
    # Gradient buckets of 50 KiB (about ten here, the first one smaller), and none (one
    # tensor at a time after backward): the same losses as one process.
    for mb in ("0.05", "0"):
        out = os.path.join(a.workdir, f"buckets-{mb}")
        r = train(a.kiln, data, out, 2, extra=("--bucket-mb", mb))
        ok = r.returncode == 0 and len(losses(out)) == 8
        worst = max(abs(x - y) / abs(y) for x, y in zip(losses(out), want)) if ok else float("inf")
        check(ok and worst <= 1e-5, f"--bucket-mb {mb} on 2 ranks matches one process: worst {worst:.2e}")
    # --compile on 2 ranks: the whole step as one graph with the gradients' allreduce in
    # it (and with --accum 2, two micro-batches per rank in the graph): the same losses
    # as one eager process, and no --compile run refused.
    for extra in ((), ("--accum", "2", "--batch", "4")):
        out = os.path.join(a.workdir, "compile" + "".join(extra))
        r = train(a.kiln, data, out, 2, extra=("--compile", *extra), env=dict(os.environ, KILN_LOGS="graph"))
        check(r.returncode == 0 and "allreduce_(" in r.stderr, f"--compile {' '.join(extra)}: the graph holds the allreduce")
        # The per-tensor allreduces are coalesced into buckets (one of 4 MiB holds all of
        # this small model's gradients): one allreduce_ line per graph printed.
        coalesced = re.findall(r"(\d+) allreduces coalesced", r.stderr)
        check(coalesced and int(coalesced[0]) > 0 and r.stderr.count("allreduce_(") == len(coalesced),
              f"--compile {' '.join(extra)}: the allreduces are coalesced ({coalesced}, "
              f"{r.stderr.count('allreduce_(')} in the graphs)")
        ref = want
        if extra:
            ref_out = os.path.join(a.workdir, "w1" + "".join(extra))
            ref = losses(ref_out) if train(a.kiln, data, ref_out, 1, extra=extra).returncode == 0 else []
        ok = r.returncode == 0 and len(losses(out)) == 8 and len(ref) == 8
        worst = max(abs(x - y) / abs(y) for x, y in zip(losses(out), ref)) if ok else float("inf")
        check(ok and worst <= 1e-5, f"--compile {' '.join(extra)} on 2 ranks matches one eager process: worst "
              f"{worst:.2e} ({r.stderr.strip()[-300:] if r.returncode else ''})")
    # ZeRO-1: the moments sharded, the same losses.
    z = os.path.join(a.workdir, "zero1")
    r = train(a.kiln, data, z, 2, extra=("--zero1",))
    ok = r.returncode == 0 and len(losses(z)) == 8
    worst = max(abs(x - y) / abs(y) for x, y in zip(losses(z), want)) if ok else float("inf")
    check(ok and worst <= 1e-5, f"--zero1 on 2 ranks matches one process: worst {worst:.2e} ({r.stderr.strip()[-200:]})")
    # ZeRO-1 inside the compiled step: reduce-scatter, norm allreduce, sharded AdamW and
    # allgather in the graph; the same losses as one eager process, also when saved at
    # step 4 and resumed (with --compile) on 4 ranks.
    zc = os.path.join(a.workdir, "zero1-compile")
    r = train(a.kiln, data, zc, 2, extra=("--zero1", "--compile", "--steps", "4"), env=dict(os.environ, KILN_LOGS="graph"))
    check(r.returncode == 0 and "reduce_scatter_(" in r.stderr and "allgather_(" in r.stderr,
          f"--zero1 --compile: the graph holds the reduce-scatter and the allgather ({r.stderr.strip()[-200:] if r.returncode else ''})")
    r2 = train(a.kiln, data, zc, 4, extra=("--zero1", "--compile", "--resume"))
    ok = r.returncode == 0 and r2.returncode == 0 and len(losses(zc)) == 8
    worst = max(abs(x - y) / abs(y) for x, y in zip(losses(zc), want)) if ok else float("inf")
    check(ok and worst <= 1e-5, f"--zero1 --compile on 2 ranks, resumed on 4, matches one eager process: worst "
          f"{worst:.2e} ({r2.stderr.strip()[-200:]})")
    # A ZeRO-1 run checkpointed at step 4 on 2 ranks and resumed on 4 continues the same curve.
    zr = os.path.join(a.workdir, "zero1-resume")
    r1 = train(a.kiln, data, zr, 2, extra=("--zero1", "--steps", "4"))
    r2 = train(a.kiln, data, zr, 4, extra=("--zero1", "--resume"))
    ok = r1.returncode == 0 and r2.returncode == 0 and len(losses(zr)) == 8
    worst = max(abs(x - y) / abs(y) for x, y in zip(losses(zr), want)) if ok else float("inf")
    check(ok and worst <= 1e-5, f"--zero1 saved on 2 ranks, resumed on 4: worst {worst:.2e} ({r2.stderr.strip()[-200:]})")
    files = sorted(f for f in os.listdir(zr) if f.startswith("zero1."))
    want_files = ["zero1.complete"] + [f"zero1.step8.rank{r}.safetensors" for r in range(4)]
    marker = open(os.path.join(zr, "zero1.complete")).read().strip() if os.path.exists(os.path.join(zr, "zero1.complete")) else ""
    check(files == want_files and marker == '{"step": 8, "world": 4}',
          f"per-rank shards of step 8 and the marker, the step-4 shards gone: {files} {marker}")
    # (--zero1=false: a resume takes --zero1 from the run's run.json otherwise)
    r = train(a.kiln, data, zr, 1, extra=("--steps", "10", "--resume", "--zero1=false"))
    check(r.returncode != 0 and "sharded (ZeRO-1)" in r.stderr, "sharded state resumed without --zero1 is refused")
    with open(os.path.join(zr, "zero1.complete"), "w") as f:  # as if the step-8 save had not finished
        f.write('{"step": 4, "world": 2}\n')
    r = train(a.kiln, data, zr, 2, extra=("--zero1", "--steps", "10", "--resume"))
    check(r.returncode != 0 and "it is not loaded" in r.stderr,
          f"a marker that does not name the checkpoint's step: not loaded ({r.stderr.strip()[-160:]})")
    # Expert parallelism: 4 experts (top 2) sharded over 2 and 4 ranks against the same
    # model on one process, whose experts are all there.
    moe = ("--arch", "llama", "--experts", "4", "--experts-per-token", "2")
    ref_out = os.path.join(a.workdir, "moe-w1")
    r = train(a.kiln, data, ref_out, 1, extra=moe)
    ref = losses(ref_out) if r.returncode == 0 else []
    ref_norm = losses(ref_out, "grad_norm") if r.returncode == 0 else []
    check(len(ref) == 8, f"an MoE model trains on one process ({r.stderr.strip()[-200:]})")
    # The gradient norm too, before clipping: the losses of 8 early AdamW steps barely see
    # the experts' gradients' scale (divided by the ranks) or their part of the norm
    # (summed over the ranks), the norm does (a missing division moves it by 0.35%).
    for n, extra in ((2, ()), (4, ()), (2, ("--compile",))):
        out = os.path.join(a.workdir, f"ep{n}" + "".join(extra))
        r = train(a.kiln, data, out, n, extra=(*moe, "--expert-parallel", *extra), env=dict(os.environ, KILN_LOGS="graph"))
        ok = r.returncode == 0 and len(losses(out)) == 8
        worst = worst_of(losses(out), ref) if ok else float("inf")
        worst_norm = worst_of(losses(out, "grad_norm"), ref_norm) if ok else float("inf")
        check(ok and worst <= 1e-5 and worst_norm <= 1e-5,
              f"--expert-parallel {' '.join(extra)} on {n} ranks matches one process: worst loss {worst:.2e}, gradient "
              f"norm {worst_norm:.2e} ({r.stderr.strip()[-300:] if r.returncode else ''})")
        if extra:
            check("all_to_all(" in r.stderr, "--expert-parallel --compile: the graph holds the all-to-alls")
    epr = os.path.join(a.workdir, "ep-resume")
    r1 = train(a.kiln, data, epr, 2, extra=(*moe, "--expert-parallel", "--steps", "4"))
    shapes = {}
    try:
        with open(os.path.join(epr, "model.safetensors"), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            shapes = {k: v["shape"] for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
    except OSError:
        pass
    check(shapes.get("blocks.0.mlp.experts.gate", [0])[0] == 4 and shapes.get("blocks.1.mlp.experts.down", [0])[0] == 4,
          f"the model saved on 2 ranks holds all 4 experts: {shapes.get('blocks.0.mlp.experts.gate')}")
    r2 = train(a.kiln, data, epr, 4, extra=(*moe, "--expert-parallel", "--resume"))
    ok = r1.returncode == 0 and r2.returncode == 0 and len(losses(epr)) == 8
    worst = worst_of(losses(epr), ref) if ok else float("inf")
    check(ok and worst <= 1e-5, f"--expert-parallel saved on 2 ranks, resumed on 4: worst {worst:.2e} "
          f"({(r1.stderr + r2.stderr).strip()[-200:]})")
    r = train(a.kiln, data, os.path.join(a.workdir, "ep-odd"), 2,
              extra=("--arch", "llama", "--experts", "3", "--experts-per-token", "2", "--expert-parallel"))
    check(r.returncode != 0 and "do not split evenly over 2 ranks" in r.stderr,
          f"3 experts over 2 ranks is refused ({r.stderr.strip()[-160:]})")
    r = train(a.kiln, data, os.path.join(a.workdir, "odd"), 2, extra=("--batch", "7"))
    check(r.returncode != 0 and "multiple of the world size" in r.stderr, "a batch of 7 on 2 ranks is refused")
    print(f"{'FAILED' if failed else 'passed'}: {failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
