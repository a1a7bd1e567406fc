"""The TCP rendezvous (src/dist/rendezvous.c) through tests/dist/rdzv_probe.c.

- Loopback: groups of 2, 4 and 8 ranks form; every rank gets every payload in rank
  order; the bootstrap time (the slowest rank's) is printed.
- Two "hosts" made with network namespaces and a veth pair (10.77.0.1 and 10.77.0.2;
  needs root and `ip netns`, else the test skips with exit 77): a group forms across
  them, also with KILN_SOCKET_IFNAME choosing the interface.
- Errors, each within its deadline (3 s) plus 3 s: an address nobody answers on (the
  client names it and the reason), a port nobody listens on ("refused"), a job id
  that differs (the client reports rank 0's refusal, rank 0 names the rank that never
  checked in), a rank that checks in twice, and a host name, which is resolved once
  and logged.
- A process group formed over TCP (`kiln train` with KILN_MASTER_ADDR, no mpirun): rank
  0's NCCL unique id reaches rank 1 (KILN_LOGS=dist prints its hash on each rank), and a
  rank without NCCL or a cuda device refuses the group for every rank, each such rank
  named with its reason (on a machine with one GPU per rank the group forms instead).
  python3 tests/dist/test_dist_rendezvous.py --probe build/rdzv_probe --kiln build/kiln
"""
import argparse
import os
import subprocess
import sys
import time

SKIP = 77
NS = ("kiln-rdzv-a", "kiln-rdzv-b")


def env(rank, world, addr, port, timeout=3, **extra):
    e = dict(os.environ, KILN_RANK=str(rank), KILN_WORLD_SIZE=str(world), KILN_MASTER_ADDR=addr,
             KILN_MASTER_PORT=str(port), KILN_RENDEZVOUS_TIMEOUT=str(timeout))
    e.update({k: str(v) for k, v in extra.items()})
    return e


def group(probe, ranks, timeout=30):
    """ranks: list of (netns or None, env); probe: a program, or its argv. Returns (outputs, wall seconds)."""
    t0 = time.time()
    procs = []
    for ns, e in ranks:
        cmd = ([ "ip", "netns", "exec", ns] if ns else []) + (probe if isinstance(probe, list) else [probe])
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            o, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            o, err = p.communicate()
            o += "\n(hung)"
        outs.append((p.returncode, o.strip(), err.strip()))
    return outs, time.time() - t0


def sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def make_hosts():
    for ns in NS:
        sh("ip", "netns", "del", ns)
    steps = [("ip", "netns", "add", NS[0]), ("ip", "netns", "add", NS[1]),
             ("ip", "link", "add", "kveth-a", "type", "veth", "peer", "name", "kveth-b"),
             ("ip", "link", "set", "kveth-a", "netns", NS[0]), ("ip", "link", "set", "kveth-b", "netns", NS[1]),
             ("ip", "-n", NS[0], "addr", "add", "10.77.0.1/24", "dev", "kveth-a"),
             ("ip", "-n", NS[1], "addr", "add", "10.77.0.2/24", "dev", "kveth-b"),
             ("ip", "-n", NS[0], "link", "set", "kveth-a", "up"), ("ip", "-n", NS[1], "link", "set", "kveth-b", "up"),
             ("ip", "-n", NS[0], "link", "set", "lo", "up"), ("ip", "-n", NS[1], "link", "set", "lo", "up")]
    for c in steps:
        r = sh(*c)
        if r.returncode != 0:
            return f"{' '.join(c)}: {r.stderr.strip()}"
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--probe", required=True)
    p.add_argument("--kiln", help="the kiln program, for the process group formed over TCP")
    a = p.parse_args()
    failed = 0

    def check(ok, what):
        nonlocal failed
        print(("ok   " if ok else "FAIL ") + what)
        failed += not ok

    port = 29600 + os.getpid() % 200
    for n in (2, 4, 8):
        outs, _ = group(a.probe, [(None, env(r, n, "127.0.0.1", port + n, timeout=10)) for r in range(n)])
        want = "|".join(f"rank {r}" for r in range(n))
        times = [float(o.split(" in ")[1].split(" s")[0]) for rc, o, _ in outs if rc == 0 and " in " in o]
        check(all(rc == 0 and o.endswith(want) for rc, o, _ in outs) and len(times) == n,
              f"loopback, {n} ranks: every rank has every payload in order; bootstrap {max(times or [0]) * 1e3:.1f} ms")

    outs, dt = group(a.probe, [(None, env(0, 2, "localhost", port + 20)), (None, env(1, 2, "localhost", port + 20))])
    check(all(rc == 0 for rc, _, _ in outs) and "resolved to 127.0.0.1" in outs[1][2],
          f"a host name is resolved once and logged: {outs[1][2][:80]}")

    outs, dt = group(a.probe, [(None, env(1, 2, "127.0.0.1", port + 21))])
    rc, o, _ = outs[0]
    check(rc == 1 and "could not reach rank 0 at 127.0.0.1" in o and "refused" in o and dt < 6,
          f"nobody listening: refused, named, in {dt:.1f} s: {o[:150]}")

    outs, dt = group(a.probe, [(None, env(0, 2, "127.0.0.1", port + 22, KILN_JOB_ID="train-a")),
                               (None, env(1, 2, "127.0.0.1", port + 22, KILN_JOB_ID="train-b"))])
    check("refused rank 1: job id 'train-b', rank 0's is 'train-a'" in outs[1][1] and "rank 1" in outs[0][1]
          and "never checked in" in outs[0][1] and dt < 6, f"a different job id is refused and reported: {outs[1][1][:120]}")

    outs, dt = group(a.probe, [(None, env(0, 3, "127.0.0.1", port + 23)), (None, env(1, 3, "127.0.0.1", port + 23)),
                               (None, env(1, 3, "127.0.0.1", port + 23))])
    dup = [o for rc, o, _ in outs[1:] if "already checked in" in o]
    check(len(dup) == 1 and "1 of 3 ranks never checked in" in outs[0][1] and outs[0][1].endswith("rank 2"),
          f"a rank twice: one copy refused ({dup[0][:90] if dup else 'none'}), rank 0 names rank 2: {outs[0][1][:120]}")

    if a.kiln:
        import re
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            argv = [a.kiln, "train", "--steps", "1", "--out", tmp]
            outs, dt = group(argv, [(None, env(r, 2, "127.0.0.1", port + 24, KILN_LOGS="dist")) for r in range(2)])
        hashes = [re.findall(r"NCCL unique id from rank 0 \(.*\), hash ([0-9a-f]{16})", err) for _, _, err in outs]
        nccl = bool(hashes[0])
        check(not nccl or (len(hashes[1]) == 1 and hashes[0] == hashes[1]),
              f"tcp group: rank 0's NCCL id reaches rank 1 unchanged: {hashes if nccl else 'no NCCL in this build'}")
        refused = [err for rc, _, err in outs if rc != 0]
        if refused:
            check(len(refused) == 2 and all("met over TCP" in e and "need MPI" in e and
                                            re.search(r"rank 0 \(.*\): no (cuda device|NCCL)", e) and
                                            re.search(r"rank 1 \(.*\): no (cuda device|NCCL)", e) for e in refused),
                  f"tcp group without a cuda device per rank: refused on both, each rank named: {refused[0][-260:]}")
        else:
            check("group formed over TCP" in outs[0][2], "tcp group: formed through NCCL")

    if os.geteuid() != 0:
        print("skip: the two-host checks need root for ip netns")
        return 1 if failed else SKIP
    why = make_hosts()
    if why:
        print(f"skip: network namespaces are not available here ({why})")
        for ns in NS:
            sh("ip", "netns", "del", ns)
        return 1 if failed else SKIP
    try:
        outs, dt = group(a.probe, [(NS[0], env(0, 2, "10.77.0.1", port + 30)),
                                   (NS[1], env(1, 2, "10.77.0.1", port + 30))])
        check(all(rc == 0 and o.endswith("rank 0|rank 1") for rc, o, _ in outs),
              f"two hosts (netns, veth): the group forms in {dt:.2f} s ({outs[1][1][:60]})")
        outs, dt = group(a.probe, [(NS[0], env(0, 2, "10.77.0.1", port + 31, KILN_SOCKET_IFNAME="kveth-a")),
                                   (NS[1], env(1, 2, "10.77.0.1", port + 31, KILN_SOCKET_IFNAME="kveth-b"))])
        check(all(rc == 0 for rc, _, _ in outs), f"with KILN_SOCKET_IFNAME: {outs[1][1][:60] or outs[1][2][:80]}")
        outs, dt = group(a.probe, [(NS[1], env(1, 2, "10.77.0.9", port + 32))])
        rc, o, _ = outs[0]
        check(rc == 1 and "10.77.0.9" in o and "within 3 s" in o and dt < 6,
              f"an address nobody answers on: named with the reason, in {dt:.1f} s: {o[:160]}")
        outs, dt = group(a.probe, [(NS[0], env(0, 2, "10.77.0.1", port + 33))])
        check(outs[0][0] == 1 and "never checked in" in outs[0][1] and "rank 1" in outs[0][1] and dt < 6,
              f"rank 0 alone: names the missing rank in {dt:.1f} s: {outs[0][1][:120]}")
    finally:
        for ns in NS:
            sh("ip", "netns", "del", ns)
    print(f"{'FAILED' if failed else 'passed'}: {failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
