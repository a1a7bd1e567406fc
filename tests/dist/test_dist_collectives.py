"""The process group's collectives and its guards, under Open MPI's mpirun, through
tests/dist/dist_probe.c (one scenario per run).

- values (2 and 4 ranks): allreduce sum/avg, broadcast, allgather, reduce_scatter and
  an async allreduce against closed-form results (oracle: rank r contributes r + 1,
  so sums are W(W+1)/2; tolerance 1e-6 relative, f32).
- order: two threads issue allreduce(10) and allreduce(20), rank 0 in one order and
  rank 1 in the other. With KILN_DIST_DEBUG=1 both ranks must fail with the order error
  naming both ranks' signatures; without it they must still fail (MPI's own error),
  within the deadline, not hang.
- step: rank 0 sums where rank 1 averages; kiln_pg_check_step must fail on both.
- graph (2 and 4 ranks): two allreduces inside a compiled function, which the program
  starts early and finishes late (src/compile/overlap.c), with reads of the value before
  its allreduce, against closed-form results (tolerance as for values); and with
  KILN_COMPILE_DISABLE=overlap.
- alltoall (2 and 4 ranks; 2 with KILN_DIST_DEBUG=1): kiln_pg_all_to_all's rows, the
  zeros after them, the counts and the gradient sent back, against the closed form the
  probe builds them by (exact: the values are moved, not computed), eager and in a
  compiled function that runs two count patterns on one graph; rank 1's negative count
  fails every rank (rank 1 naming its count, the others naming rank 1), as does an
  out_rows too small for what a rank receives, and the group then still works.
- lag: rank 1 sleeps 30 s before its collectives; with KILN_DIST_TIMEOUT=3, rank 0 must
  fail within 12 s naming rank 1, and write its ring buffer with the waiting collective;
  a second collective it has in flight must then fail at once (under 1 s), not after a
  deadline of its own.

Exits 77 (skip) when mpirun is missing or the kiln build has no MPI.
  python3 tests/dist/test_dist_collectives.py --probe build/dist_probe --workdir DIR
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time

from mpi_session import own_session_dir

SKIP = 77


def mpirun(probe, n, scenario, env_extra, timeout=120):
    env = dict(os.environ, **env_extra)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n), probe, scenario]
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, time.time() - t0
    return r, time.time() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--probe", required=True)
    p.add_argument("--workdir", required=True)
    a = p.parse_args()
    if not shutil.which("mpirun"):
        print("skip: mpirun not found (apt-get install openmpi-bin libopenmpi-dev)")
        return SKIP
    os.makedirs(a.workdir, exist_ok=True)
    own_session_dir(a.workdir)
    failed = 0

    def check(ok, what):
        nonlocal failed
        print(("ok   " if ok else "FAIL ") + what)
        failed += not ok

    r, _ = mpirun(a.probe, 2, "values", {})
    if r is not None and "built without MPI" in r.stderr:
        print("skip: this kiln was built without MPI")
        return SKIP
    for n in (2, 4):
        r, _ = mpirun(a.probe, n, "values", {})
        check(r is not None and r.returncode == 0 and r.stdout.count("values ok") == n,
              f"{n} ranks: every collective gives the closed-form result"
              + ("" if r is None or r.returncode == 0 else f" ({r.stderr.strip()[-300:]})"))

    for n, env in ((2, {}), (4, {}), (2, {"KILN_COMPILE_DISABLE": "overlap"})):
        r, _ = mpirun(a.probe, n, "graph", env)
        check(r is not None and r.returncode == 0 and r.stdout.count("graph ok") == n,
              f"{n} ranks{' ' + str(env) if env else ''}: allreduces in a compiled function give the closed-form result"
              + ("" if r is None or r.returncode == 0 else f" ({r.stderr.strip()[-300:]})"))
    for n, env in ((2, {}), (4, {}), (2, {"KILN_DIST_DEBUG": "1"})):
        r, _ = mpirun(a.probe, n, "alltoall", env)
        out = r.stdout if r else ""
        check(r is not None and r.returncode == 0 and out.count("alltoall ok, 1 graph(s)") == n,
              f"{n} ranks{' ' + str(env) if env else ''}: all-to-all rows, counts and gradients, eager and compiled on "
              "one graph" + ("" if r is None or r.returncode == 0 else f" ({r.stderr.strip()[-300:]})"))
        named = out.count("rank 1's send counts are negative") == n - 1 and "send_counts[0] = -2 is negative" in out
        check(named and out.count("would receive") == n,
              f"{n} ranks: bad counts on rank 1 and a small out_rows fail every rank, naming the cause")
    r, dt = mpirun(a.probe, 2, "order", {"KILN_DIST_DEBUG": "1", "KILN_DIST_TIMEOUT": "10"})
    out = r.stdout if r else ""
    want = "rank 0: #1 allreduce f32 x 10 sum; rank 1: #1 allreduce f32 x 20 sum"
    check(r is not None and out.count("different orders") >= 2 and want in out,
          f"KILN_DIST_DEBUG: both ranks name both signatures, in {dt:.1f} s: {out.splitlines()[0] if out else r}")

    r, dt = mpirun(a.probe, 2, "order", {"KILN_DIST_TIMEOUT": "10"}, timeout=60)
    check(r is not None and "error:" in r.stdout and dt < 30,
          f"without KILN_DIST_DEBUG the mismatch still fails, not hangs ({dt:.1f} s)")

    r, dt = mpirun(a.probe, 2, "step", {})
    check(r is not None and r.stdout.count("different orders or shapes") == 2,
          f"check_step: a sum against an average is caught on both ranks ({r.stdout.strip()[:120] if r else r})")

    dump = os.path.join(a.workdir, "dumps")
    os.makedirs(dump, exist_ok=True)
    ring = os.path.join(dump, "kiln-dist-rank0.txt")
    if os.path.exists(ring):
        os.remove(ring)
    r, dt = mpirun(a.probe, 2, "lag", {"KILN_DIST_TIMEOUT": "3", "LAG": "30", "KILN_DIST_DUMP_DIR": dump}, timeout=60)
    out = r.stdout if r else ""
    check(r is not None and "collective timeout" in out and "rank 1 did not answer" in out and dt < 12,
          f"a lagging rank: rank 0 stops in {dt:.1f} s (deadline 3 s) naming rank 1: {out.strip()[:160]}")
    m = re.search(r"then, after ([0-9.]+) s: (.*)", out)
    check(m is not None and float(m.group(1)) < 1 and "left unfinished" in m.group(2),
          f"the second collective in flight on the broken group fails at once ({m.group(0) if m else out.strip()[-160:]})")
    text = open(ring).read() if os.path.exists(ring) else ""
    check("#1 allreduce f32 x 16 sum   <- waiting here" in text, f"the ring buffer names the waiting collective ({ring})")
    print(f"{'FAILED' if failed else 'passed'}: {failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
