"""kiln doctor against a faked broken stack (tools/cmd_doctor.c, docs/doctor.md).

- The stack as it is here (a writable cache of the test's own): --json parses, has a
  row per line of the text form with the same verdicts, the cache row is OK, and the
  exit status is 1 exactly when a row FAILs.
- A compiler that is not there: a languages.json whose .zz row names a compiler that
  does not exist gives that row WARN naming it; PATH pointing at an empty folder makes
  the jit-compiler row (cc) WARN with "not found".
- An unwritable cache: KILN_CACHE_DIR under a regular file (mkdir fails even for root)
  makes the cache row FAIL with the KILN_CACHE_DIR fix, and the exit status 1.
- A slow resolver: an LD_PRELOAD module (tests/doctor/slow_resolver.c) delays
  getaddrinfo by 1.5 s; with KILN_MASTER_ADDR=localhost the rendezvous row is WARN under
  the rendezvous-fast rule and names the time; without the module the row is OK.
- An MPI launcher of the other family (a stand-in mpirun that answers as MPICH's Hydra)
  against kiln's Open MPI: the mpi-launcher row FAILs under mpi-family.
- An invalid KILN_* value (KILN_NUM_THREADS=lots) is a FAIL row named for it.
- docs/doctor.md's rules table lists every rule `kiln doctor --rules` prints.
  python3 tests/doctor/test_doctor.py --kiln build/kiln --preload build/libslow_resolver.so --workdir /tmp/d
"""
import argparse
import json
import os
import re
import subprocess
import sys

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def doctor(kiln, env, *args):
    """(exit status, text form's rows {name: verdict}, text, json rows {name: row}, json status)."""
    t = subprocess.run([kiln, "doctor", *args], env=env, capture_output=True, text=True, timeout=120)
    j = subprocess.run([kiln, "doctor", "--json", *args], env=env, capture_output=True, text=True, timeout=120)
    text_rows = {}
    for line in t.stdout.splitlines():
        m = re.match(r"(OK|WARN|FAIL) +(\S+(?: \S+)?)  ", line)  # a name may hold one space ("ext .c")
        if m:
            text_rows[m.group(2)] = m.group(1)
    try:
        rows = json.loads(j.stdout)
    except ValueError as e:
        check(False, "--json parses (%s): %s" % (e, j.stdout[:400]))
        rows = []
    by_name = {r["name"]: r for r in rows}
    check(all(set(r) >= {"name", "verdict", "value", "fix", "rules"} for r in rows),
          "every JSON row has name, verdict, value, fix and rules")
    check({n: r["verdict"] for n, r in by_name.items()} == text_rows,
          "the JSON rows and verdicts are the text form's (%d rows)" % len(rows))
    fails = any(r["verdict"] == "FAIL" for r in rows)
    check(t.returncode == j.returncode == (1 if fails else 0),
          "exit status %d (text) and %d (--json) is 1 exactly when a row FAILs" % (t.returncode, j.returncode))
    return t.returncode, text_rows, t.stdout, by_name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--preload", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--docs", help="docs/doctor.md, whose rules table must list every rule")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k in ("KILN_SOURCE_DIR",)}
    cache = os.path.join(a.workdir, "cache")
    base["KILN_CACHE_DIR"] = cache

    h = subprocess.run([a.kiln, "doctor", "--help"], capture_output=True, text=True)
    check(h.returncode == 0 and "Exit status: 1 when a row FAILs" in h.stdout, "--help states the exit status")

    if a.docs:
        ids = [l.split()[0] for l in subprocess.run([a.kiln, "doctor", "--rules"], capture_output=True,
                                                     text=True).stdout.splitlines()[1:] if l[:1].strip()]
        doc = open(a.docs).read()
        missing = [i for i in ids if "| `%s` |" % i not in doc]
        check(ids and not missing, "docs/doctor.md's rules table has every rule of kiln doctor --rules (missing: %s)"
              % missing)

    # The stack as it is.
    rc, text, out, rows = doctor(a.kiln, base)
    check(rows.get("cache", {}).get("verdict") == "OK" and cache in rows["cache"]["value"],
          "a writable cache is OK: %s" % rows.get("cache", {}).get("value"))
    check(rows.get("rendezvous", {}).get("verdict") == "OK", "no KILN_MASTER_ADDR: the rendezvous row is OK")
    for name in ("kiln", "compiler", "jit-compiler", "blas", "mpi", "libmicrohttpd", "cuda", "nccl", "cpu", "threads"):
        check(name in rows, "a %s row" % name)
    check("devices:\n  cpu: " in out and "DEVICE_GRAPHS" not in out, "the devices follow the rows, not the switches")
    check(re.match(r"\d+ rows: \d+ OK, \d+ WARN, \d+ FAIL", out) is not None, "the summary comes first: " + out[:80])
    sw = subprocess.run([a.kiln, "doctor", "--switches"], env=base, capture_output=True, text=True, timeout=120)
    check("DEVICE_GRAPHS" in sw.stdout, "--switches lists the optimization switches")

    # A variable kiln will not honour is a WARN; one whose value is not UTF-8 is escaped.
    rc, text, out, rows = doctor(a.kiln, dict(base, KILN_DEVICE="garbage"))
    dev = rows.get("KILN_DEVICE", {})
    check(dev.get("verdict") == "WARN" and "env-honoured" in dev.get("rules", []) and "uses cpu" in dev.get("fix", ""),
          "KILN_DEVICE=garbage is a WARN under env-honoured: %s" % dev)
    check(text.get("KILN_DEVICE") == "WARN", "and so in the text form")
    rc, text, out, rows = doctor(a.kiln, dict(base, KILN_DEVICE="cpu"))
    check(rows.get("KILN_DEVICE", {}).get("verdict") == "OK", "KILN_DEVICE=cpu is OK")
    envb = {k.encode(): v.encode() for k, v in base.items()}
    envb[b"KILN_CACHE_DIR"] = os.path.join(a.workdir, "cache").encode() + b"\xff\x01"
    j = subprocess.run([a.kiln, "doctor", "--json"], env=envb, capture_output=True, timeout=120)
    try:
        jrows = {r["name"]: r for r in json.loads(j.stdout)}
    except ValueError:
        jrows = {}
    cd = jrows.get("KILN_CACHE_DIR", {})
    check("\\xFF\\x01" in cd.get("value", "") and "fix" in cd,
          "a value that is not UTF-8 keeps its value and fix in --json, escaped: %s" % cd)

    # A compiler that is not there, cc missing from PATH, an unwritable cache.
    empty = os.path.join(a.workdir, "empty-bin")
    os.makedirs(empty, exist_ok=True)
    langs = os.path.join(a.workdir, "languages.json")
    with open(langs, "w") as f:
        json.dump({"languages": [{"suffix": ".zz", "command": "kiln-no-such-compiler {flags} -c {src} -o {out}",
                                  "flags": "", "object": ".o", "depfile": "", "load": "shared"}]}, f)
    blocker = os.path.join(a.workdir, "a-file")
    open(blocker, "w").close()
    broken = dict(base, PATH=empty, KILN_CACHE_DIR=os.path.join(blocker, "kiln"))
    rc, text, out, rows = doctor(a.kiln, broken, "--languages", langs)
    zz = rows.get("ext .zz", {})
    check(zz.get("verdict") == "WARN" and "kiln-no-such-compiler" in zz.get("value", "") and "ext-compiler" in zz.get("rules", []),
          "a language whose compiler is not there is WARN naming it: %s" % zz.get("value"))
    jit = rows.get("jit-compiler", {})
    check(jit.get("verdict") == "WARN" and "not found" in jit.get("value", "") and jit.get("fix"),
          "cc missing from PATH: the jit-compiler row says so: %s" % jit.get("value"))
    c = rows.get("cache", {})
    check(c.get("verdict") == "FAIL" and "KILN_CACHE_DIR" in c.get("fix", "") and "cache-writable" in c.get("rules", []),
          "a cache under a regular file FAILs with the KILN_CACHE_DIR fix: %s" % c.get("value"))
    check(rc == 1, "a FAIL row makes the exit status 1 (got %d)" % rc)
    check("FAIL  cache" in out and "fix: set KILN_CACHE_DIR" in out, "the text form shows the FAIL and its fix")
    # The same languages file with cc where it is: the .c row is OK again, .zz still WARN.
    rc, text, out, rows = doctor(a.kiln, base, "--languages", langs)
    check(text.get("ext .zz") == "WARN" and rc in (0, 1), "the missing compiler is WARN, which alone exits 0")

    # A slow resolver, then the same name without it.
    asan = base.get("ASAN_OPTIONS", "")
    slow = dict(base, KILN_MASTER_ADDR="localhost", KILN_MASTER_PORT="29511", LD_PRELOAD=a.preload,
                ASAN_OPTIONS=(asan + ":" if asan else "") + "verify_asan_link_order=0")
    slow["PATH"] = empty  # no mpirun --version under the module
    rc, text, out, rows = doctor(a.kiln, slow)
    r = rows.get("rendezvous", {})
    check(r.get("verdict") == "WARN" and "rendezvous-fast" in r.get("rules", []) and "took 1." in r.get("fix", "")
          and "/etc/hosts" in r.get("fix", ""), "a 1.5 s look-up is WARN naming the time: %s" % r.get("fix"))
    check("an address of this machine" in r.get("value", ""), "localhost is reported local: %s" % r.get("value"))
    fast = dict(base, KILN_MASTER_ADDR="localhost", KILN_MASTER_PORT="29511")
    rc, text, out, rows = doctor(a.kiln, fast)
    r = rows.get("rendezvous", {})
    check(r.get("verdict") == "OK" and "rendezvous-fast" in r.get("rules", []),
          "without the slow resolver the same address is OK: %s" % r.get("value"))
    # Rank 0 of a group whose rendezvous address is not this machine's.
    far = dict(base, KILN_MASTER_ADDR="192.0.2.1", KILN_MASTER_PORT="29511", KILN_RANK="0", KILN_WORLD_SIZE="2")
    rc, text, out, rows = doctor(a.kiln, far)
    r = rows.get("rendezvous", {})
    check(r.get("verdict") == "FAIL" and "rendezvous-rank0-local" in r.get("rules", []) and rc == 1,
          "rank 0 with an address that is not local FAILs: %s" % r.get("fix"))

    # An MPI launcher of the other family first on PATH (a stand-in that answers --version
    # as MPICH's Hydra does) against kiln's Open MPI.
    fake = os.path.join(a.workdir, "fake-mpich")
    os.makedirs(fake, exist_ok=True)
    with open(os.path.join(fake, "mpirun"), "w") as f:
        f.write("#!/bin/sh\necho 'HYDRA build details:'\necho '    Version: 4.0.2'\n")
    os.chmod(os.path.join(fake, "mpirun"), 0o755)
    rc, text, out, rows = doctor(a.kiln, dict(base, PATH=fake + ":" + base.get("PATH", "")))
    if "Open MPI" in rows.get("mpi", {}).get("value", ""):
        r = rows.get("mpi-launcher", {})
        check(r.get("verdict") == "FAIL" and "mpi-family" in r.get("rules", []) and "Open MPI" in r.get("fix", "")
              and rc == 1, "MPICH's launcher for kiln's Open MPI FAILs: %s" % r.get("fix"))
    else:
        print("skip  the MPI family check: kiln is not built with Open MPI here")

    # A KILN_* value kiln refuses.
    rc, text, out, rows = doctor(a.kiln, dict(base, KILN_NUM_THREADS="lots"))
    r = rows.get("KILN_NUM_THREADS", {})
    check(r.get("verdict") == "FAIL" and "env-valid" in r.get("rules", []) and rc == 1,
          "KILN_NUM_THREADS=lots is a FAIL row: %s" % r.get("fix"))

    if failures:
        print("%d check(s) failed" % len(failures))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
