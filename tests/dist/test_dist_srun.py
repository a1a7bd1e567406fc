"""`kiln train` launched by Slurm's srun (PMIx), against the one-process run.

The test starts its own one-node Slurm cluster (slurmctld and slurmd from Debian's
slurm-wlm, no munge: auth/none) in the work folder on private ports, runs
`srun --mpi=pmix -n 2 kiln train` there, and stops it. Oracle: the same command on one
process over the same global batch (as in test_dist_train.py): every logged loss within
1e-5 relative. It also checks that the ranks took their rank and world size from srun
(PMIx), and that srun without --mpi=pmix (ranks no MPI launcher started,
without a TCP rendezvous address) is refused with an error that names what to do.

Exits 77 (skip) when slurmctld, slurmd or srun is missing, when not root (the daemons
run as root here), or when the kiln build has no MPI.
  python3 tests/dist/test_dist_srun.py --kiln build/kiln --workdir DIR
"""
import os
import shutil
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_dist_train import args, corpus, losses, train  # noqa: E402

SKIP = 77


def start_cluster(work):
    """A one-node cluster in work/slurm; returns (env for srun, daemons) or (None, why)."""
    d = os.path.join(work, "slurm")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "state"))
    os.makedirs(os.path.join(d, "spool"))
    host = socket.gethostname().split(".")[0]
    port = 26800 + os.getpid() % 500 * 2
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(f"""ClusterName=kilntest
SlurmctldHost={host}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
SlurmctldPort={port}
SlurmdPort={port + 1}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/linear
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=kiln Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = dict(os.environ, SLURM_CONF=conf)
    daemons = [subprocess.Popen([exe, "-D", "-f", conf], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
               for exe in ("slurmctld", "slurmd")]
    deadline = time.time() + 30
    while time.time() < deadline:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == "idle":
            return env, daemons
        time.sleep(0.5)
    stop(daemons)
    logs = ""
    for name in ("slurmctld.log", "slurmd.log"):
        p = os.path.join(d, name)
        if os.path.exists(p):
            logs += f" {name}: " + open(p).read()[-300:]
    return None, f"the one-node cluster did not come up in 30 s:{logs}"


def stop(daemons):
    for p in daemons:
        p.terminate()
    for p in daemons:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def main():
    a = args()
    missing = [exe for exe in ("slurmctld", "slurmd", "srun", "sinfo") if not shutil.which(exe)]
    if missing:
        print(f"skip: {', '.join(missing)} not found (apt-get install slurmctld slurmd slurm-client)")
        return SKIP
    if os.geteuid() != 0:
        print("skip: the test's own Slurm daemons run as root")
        return SKIP
    os.makedirs(a.workdir, exist_ok=True)
    data = os.path.join(a.workdir, "corpus.txt")
    corpus(data)
    one = os.path.join(a.workdir, "srun-w1")
    r = train(a.kiln, data, one, 1)
    if r.returncode != 0:
        print(f"FAIL one process trains: {r.stderr.strip()[-300:]}")
        return 1
    want = losses(one)
    env, daemons = start_cluster(a.workdir)
    if env is None:
        print(f"FAIL {daemons}")
        return 1
    failed = 0

    def check(ok, what):
        nonlocal failed
        print(("ok   " if ok else "FAIL ") + what)
        failed += not ok

    try:
        out = os.path.join(a.workdir, "srun-w2")
        shutil.rmtree(out, ignore_errors=True)  # kiln train refuses to replace a run an earlier session left
        cmd = [a.kiln, "train", "--data", data, "--out", out]
        for k, v in __import__("test_dist_train").DEFAULTS.items():
            cmd += [k, v]
        # The ranks take no KILN_* variables: rank and world size come from srun.
        clean = {k: v for k, v in env.items() if not k.startswith(("KILN_RANK", "KILN_WORLD", "OMPI_", "PMIX_"))}
        r = subprocess.run(["srun", "--mpi=pmix", "-n", "2", "--oversubscribe", "-t", "5", *cmd], env=clean,
                           capture_output=True, text=True, timeout=300)
        if "built without MPI" in r.stderr:
            print("skip: this kiln was built without MPI")
            return SKIP
        got = losses(out) if r.returncode == 0 and os.path.exists(os.path.join(out, "metrics.jsonl")) else []
        check(r.returncode == 0 and len(got) == len(want) == 8,
              f"srun --mpi=pmix -n 2 kiln train runs 8 steps ({r.stderr.strip()[-300:]})")
        # Two ranks of one group, not two one-rank runs: the header (rank 0's) says so.
        check("2 ranks x" in r.stdout and "1 rank x" not in r.stdout,
              f"the ranks form one group of 2 from srun's PMIx: {[l for l in r.stdout.splitlines() if ' rank' in l]}")
        if got and len(got) == len(want):
            worst = max(abs(x - y) / abs(y) for x, y in zip(got, want))
            check(worst <= 1e-5, f"srun -n 2 matches one process: worst relative difference {worst:.2e} (tolerance 1e-5)")
        out = os.path.join(a.workdir, "srun-nompi")
        shutil.rmtree(out, ignore_errors=True)
        cmd[cmd.index("--out") + 1] = out
        r = subprocess.run(["srun", "--mpi=none", "-n", "2", "--oversubscribe", "-t", "5", *cmd], env=clean,
                           capture_output=True, text=True, timeout=120)
        check(r.returncode != 0 and "srun --mpi" in r.stderr,
              f"srun without PMIx is refused, naming what to do: {r.stderr.strip()[:200]}")
    finally:
        stop(daemons)
    print(f"{'FAILED' if failed else 'passed'}: {failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
