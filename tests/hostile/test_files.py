"""Hostile files (issue 51, classes 3 and 4): a save never destroys what is not its own,
and a read never blocks or crashes.

Writes: a target that exists and is not a regular file (a device, a FIFO, a folder, a
symbolic link) is refused and left as it was; an output that is the command's own input
is refused; a folder that does not exist, or a path under a regular file, is an error
naming it; a full disk or a failed fsync during a save (tests/hostile/shim.c, preloaded)
is an error naming it, and the previous file is byte for byte what it was, with no
temporary left beside it.

Reads: a FIFO or a folder where a model, config.json, tokenizer.json, a --config file or
an extension should be is refused at once, by name; a truncated shared object given to
`kiln ext load` or KILN_EXT is refused before dlopen (it used to die of SIGBUS inside
it); `kiln serve` ends promptly on SIGTERM and SIGINT during a stuck start-up, and stops
cleanly on them once ready."""
import os
import shutil
import signal
import stat
import subprocess
import time
from hostile import Suite

s = Suite(__doc__)
w = s.dir("files")
ARCH = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--batch", "2", "--eval-batches", "1",
        "--quiet", "--threads", "1"]
TINY = ["--steps", "1"] + ARCH


def path(*p):
    return os.path.join(w, *p)


def fifo(p):
    os.mkfifo(p)
    return p


def write(p, text):
    with open(p, "w") as f:
        f.write(text)
    return p


words = ["the", "lord", "said", "unto", "moses", "and", "of", "in", "land", "people"]
corpus = write(path("corpus.txt"), " ".join(words[(i * 7 + i // 3) % len(words)] for i in range(3000)) + "\n")
run = path("run")
p, out = s.run(["train", "--data", corpus, "--out", run] + TINY)
if not s.check(p is not None and p.returncode == 0, "a tiny run to export and import"):
    print(out)
    s.done()
hf = path("hf")
p, out = s.run(["export", "hf", run, hf])
s.check(p is not None and p.returncode == 0, "the tiny run as a Hugging Face folder")

# ---- writes onto what is not a regular file ----
shim = s.args.shim
d = s.dir("targets")


def device(name, real):
    """A character device like real (/dev/full, /dev/null) of the suite's own, where the
    suite may make one (as root): a build that still renames over a device then breaks
    a node in the work dir, not the machine's. Elsewhere real itself, which a user who
    may not write /dev cannot replace anyway."""
    p = os.path.join(devices, name)
    try:
        st = os.stat(real)
        os.mknod(p, stat.S_IFCHR | 0o666, st.st_rdev)
        return p
    except OSError:
        return real


devices = s.dir("devices")
full = device("full", "/dev/full")
null = device("null", "/dev/null")
secret = write(os.path.join(d, "passwd"), "root:x:0:0:root:/root:/bin/sh\n")
os.symlink("passwd", os.path.join(d, "link"))
fifo(os.path.join(d, "fifo"))
os.mkdir(os.path.join(d, "folder"))
write(os.path.join(d, "folder", "keep"), "keep\n")
s.case("export gguf to /dev/full is refused and the device stays", ["export", "gguf", run, full], rc=1,
       msg=r"refusing to write .*full: it is a character device", untouched=[full, run])
s.case("export gguf to a FIFO is refused without waiting for a reader",
       ["export", "gguf", run, os.path.join(d, "fifo")], rc=1, msg=r"FIFO", untouched=[d, run], timeout=60)
s.case("export gguf to a folder is refused", ["export", "gguf", run, os.path.join(d, "folder")], rc=1,
       msg=r"is a directory", untouched=[d])
s.case("export gguf to a symbolic link is refused and the file it names is untouched",
       ["export", "gguf", run, os.path.join(d, "link")], rc=1, msg=r"symbolic link", untouched=[d])
s.case("export gguf into a folder that does not exist names it", ["export", "gguf", run, path("nope", "m.gguf")],
       rc=1, msg=r"nope/m\.gguf.*No such file or directory", untouched=[w])
s.case("export gguf under a regular file names it", ["export", "gguf", run, os.path.join(secret, "m.gguf")], rc=1,
       msg=r"Not a directory", untouched=[d])
s.case("export hf onto /dev/null is an error", ["export", "hf", run, null], rc=1, untouched=[null])
s.case("tokenizer train --out /dev/full is refused", ["tokenizer", "train", "--data", corpus, "--vocab", "260",
                                                      "--out", full], rc=1, msg=r"character device",
       untouched=[full])
s.case("train --out /dev/null is an error, not a run into the device", ["train", "--data", corpus, "--out",
                                                                        null] + TINY, rc=1,
       msg=r"null", untouched=[null])
s.case("train --out under a regular file names it", ["train", "--data", corpus, "--out",
                                                      os.path.join(secret, "run")] + TINY, rc=1,
       msg=r"Not a directory", untouched=[d])
r2 = s.dir("run_fifo_metrics")
fifo(os.path.join(r2, "metrics.jsonl"))
s.case("train into a folder whose metrics.jsonl is a FIFO is refused without blocking",
       ["train", "--data", corpus, "--out", r2] + TINY, rc=1, msg=r"metrics\.jsonl.*FIFO", timeout=60)
r3 = path("run_plot")
shutil.copytree(run, r3)
os.remove(os.path.join(r3, "loss.svg"))
os.symlink("metrics.jsonl", os.path.join(r3, "loss.svg"))
s.case("plot over a loss.svg that links to its own metrics is refused, the metrics intact", ["plot", r3], rc=1,
       msg=r"symbolic link", untouched=[r3])

# ---- an output that is its own input ----
s.case("import hf X X is refused and X is untouched", ["import", "hf", hf, hf], rc=1, msg=r"is the input",
       untouched=[hf])
s.case("export hf RUN RUN is refused and the run is untouched", ["export", "hf", run, run], rc=1,
       msg=r"is the input", untouched=[run])
s.case("export hf from a model file into its own folder is refused",
       ["export", "hf", os.path.join(run, "model.safetensors"), run], rc=1, msg=r"read from", untouched=[run])
s.case("export gguf over the model file it reads is refused",
       ["export", "gguf", run, os.path.join(run, "model.safetensors")], rc=1, msg=r"read from", untouched=[run])
s.case("export gguf over the model file, spelt another way, is refused",
       ["export", "gguf", os.path.join(run, "."), os.path.join(run, "..", "run", "model.safetensors")], rc=1,
       msg=r"read from", untouched=[run])
os.symlink(run, path("run_link"))
s.case("export hf through a link to the run folder is refused", ["export", "hf", run, path("run_link")], rc=1,
       msg=r"is the input", untouched=[run])
s.case("train --init X --out X is refused and X is untouched",
       ["train", "--data", corpus, "--init", hf, "--out", hf] + TINY, rc=1, msg=r"is the input", untouched=[hf])
s.case("tokenizer train over its own corpus is refused and the corpus kept",
       ["tokenizer", "train", "--data", corpus, "--vocab", "260", "--out", corpus], rc=1, msg=r"is the input",
       untouched=[corpus])

# ---- a full disk, a failed fsync ----
if not shim:
    s.check(False, "the suite was given the full-disk shim (--shim)")
else:
    pre = {"LD_PRELOAD": shim, "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "") + ":verify_asan_link_order=0"}
    g = s.dir("full")
    good = os.path.join(g, "m.gguf")
    p, out = s.run(["export", "gguf", run, good])
    s.check(p is not None and p.returncode == 0 and os.path.getsize(good) > 4096, "a good GGUF to save over")
    s.case("export gguf on a full disk fails naming ENOSPC, the old file intact, no temporary left",
           ["export", "gguf", run, good], rc=1, msg=r"No space left on device", untouched=[g],
           env=dict(pre, FULL_DISK_MATCH="full/m.gguf", FULL_DISK_BYTES="4096"))
    s.case("export gguf with a failing fsync fails, the old file intact", ["export", "gguf", run, good], rc=1,
           msg=r"fsync failed", untouched=[g], env=dict(pre, FULL_DISK_MATCH="full/m.gguf", FULL_DISK_FSYNC="1"))
    h2 = os.path.join(g, "hf")
    s.run(["export", "hf", run, h2])
    s.case("export hf on a full disk fails, the old folder intact", ["export", "hf", run, h2, "--dtype", "bf16"],
           rc=1, msg=r"model\.safetensors: No space left on device", untouched=[g],
           env=dict(pre, FULL_DISK_MATCH="full/hf/", FULL_DISK_BYTES="1000"))
    tok = os.path.join(g, "tok.json")
    s.run(["tokenizer", "train", "--data", corpus, "--vocab", "260", "--out", tok])
    s.case("tokenizer train on a full disk fails, the old tokenizer.json intact",
           ["tokenizer", "train", "--data", corpus, "--vocab", "270", "--out", tok], rc=1, msg=r"No space left",
           untouched=[g], env=dict(pre, FULL_DISK_MATCH="full/tok.json", FULL_DISK_BYTES="100"))
    r6 = os.path.join(g, "plot")
    shutil.copytree(run, r6)
    s.case("plot on a full disk fails, the old loss.svg intact", ["plot", r6], rc=1, msg=r"No space left",
           untouched=[g], env=dict(pre, FULL_DISK_MATCH="full/plot/loss.svg", FULL_DISK_BYTES="200"))
    r4 = os.path.join(g, "run")
    shutil.copytree(run, r4)
    model = os.path.join(r4, "model.safetensors")
    s.case("a checkpoint on a full disk fails the run, the previous model file intact",
           ["train", "--data", corpus, "--out", r4, "--resume", "--steps", "2"] + ARCH,
           rc=1, msg=r"No space left", untouched=[model],
           env=dict(pre, FULL_DISK_MATCH="full/run/model.safetensors", FULL_DISK_BYTES="0"))
    s.check(not [f for f in os.listdir(r4) if ".tmp" in f], "no temporary left in the run folder")

# ---- reads of what is not a regular file ----
h3 = path("hf_fifo")
shutil.copytree(hf, h3)
os.remove(os.path.join(h3, "config.json"))
fifo(os.path.join(h3, "config.json"))
s.case("sample with a FIFO as config.json is refused at once", ["sample", h3, "--tokens", "2"], rc=1,
       msg=r"config\.json is a FIFO", timeout=60)
s.case("serve with a FIFO as config.json is refused at once", ["serve", h3, "--port", "0"], rc=1,
       msg=r"config\.json is a FIFO", timeout=60)
s.case("import hf with a FIFO as config.json is refused at once", ["import", "hf", h3, path("imp")], rc=1,
       msg=r"FIFO", timeout=60)
s.case("info of a Hugging Face folder whose config.json is a FIFO does not block", ["info", h3], rc=(0, 1),
       timeout=60)
h4 = path("hf_dir")
shutil.copytree(hf, h4)
os.remove(os.path.join(h4, "config.json"))
os.mkdir(os.path.join(h4, "config.json"))
s.case("a folder as config.json is named as a folder", ["sample", h4, "--tokens", "2"], rc=1,
       msg=r"config\.json is a directory")
h5 = path("hf_tok_fifo")
shutil.copytree(hf, h5)
if os.path.exists(os.path.join(h5, "tokenizer.json")):
    os.remove(os.path.join(h5, "tokenizer.json"))
fifo(os.path.join(h5, "tokenizer.json"))
s.case("a FIFO as tokenizer.json is refused at once", ["sample", h5, "--tokens", "2"], rc=1,
       msg=r"tokenizer\.json is a FIFO", timeout=60)
h6 = path("hf_no_tokenizer")
shutil.copytree(hf, h6)
if os.path.exists(os.path.join(h6, "tokenizer.json")):
    os.remove(os.path.join(h6, "tokenizer.json"))
s.case("a Hugging Face folder without tokenizer.json is refused, never read as bytes",
       ["sample", h6, "--tokens", "2"], rc=1, msg=r"has no tokenizer\.json")
open(os.path.join(h6, "tokenizer.model"), "wb").close()
s.case("a folder with only SentencePiece's tokenizer.model says which file kiln wants",
       ["serve", h6, "--port", "0"], rc=1, msg=r"no tokenizer\.json.*tokenizer\.model")
# errors name the file, never kiln's internal functions
INTERNAL = r"(metrics_read|metrics_open|model_load|ext_load|ext_build|hf_save|kiln_tokenizer_\w+|safetensors): cannot"
s.case("a missing model file is named without internal names", ["info", path("nope.safetensors")], rc=1,
       msg=r"cannot open .*nope\.safetensors", nomsg=INTERNAL)
s.case("plot of a folder without metrics names the file", ["plot", s.dir("empty_run")], rc=1,
       msg=r"cannot open .*metrics\.jsonl", nomsg=INTERNAL)
m = fifo(path("model_fifo.safetensors"))
s.case("info of a FIFO model file is refused at once", ["info", m], rc=1, msg=r"FIFO", timeout=60)
s.case("sample of a FIFO model file is refused at once", ["sample", m], rc=1, msg=r"FIFO", timeout=60)
s.case("a FIFO as --config is refused at once", ["train", "--config", fifo(path("cfg.json")), "--data", corpus,
                                                 "--out", path("cfgrun")], rc=2, msg=r"FIFO", timeout=60)

r5 = path("run_fifo_reads")
shutil.copytree(run, r5)
os.remove(os.path.join(r5, "run.json"))
fifo(os.path.join(r5, "run.json"))
s.case("plot with a FIFO as run.json draws without its baseline, without blocking", ["plot", r5], rc=0,
       msg=r"wrote", timeout=60)
os.remove(os.path.join(r5, "metrics.jsonl"))
fifo(os.path.join(r5, "metrics.jsonl"))
s.case("plot with a FIFO as metrics.jsonl is refused at once", ["plot", r5], rc=1, msg=r"metrics\.jsonl is a FIFO",
       timeout=60)
s.case("serve with a FIFO as --chat-template is refused at once",
       ["serve", run, "--port", "0", "--chat-template", fifo(path("tmpl_fifo"))], rc=1, msg=r"tmpl_fifo is a FIFO",
       timeout=60)

dump = path("dump", "train_step-0")
os.makedirs(dump)
fifo(os.path.join(dump, "guards.txt"))
s.case("compile --dump into a folder with a FIFO where a dump goes warns and goes on, never blocks",
       ["compile", "--dump", path("dump"), "--layers", "1", "--width", "32", "--heads", "2", "--context", "16",
        "--batch", "2"], rc=0, msg=r"guards\.txt: it is a FIFO", timeout=300)

# ---- extensions cut short ----
if shim:
    so = open(shim, "rb").read()
    trunc = path("trunc.so")
    with open(trunc, "wb") as f:
        f.write(so[: len(so) // 2])
    s.case("a truncated .so to ext load is refused, not SIGBUS", ["ext", "load", trunc], rc=1,
           msg=r"not a complete shared object")
    s.case("a truncated .so in KILN_EXT is refused, not SIGBUS", ["info", run], rc=1,
           msg=r"KILN_EXT.*not a complete shared object", env={"KILN_EXT": trunc})
    tiny = path("tiny.so")
    with open(tiny, "wb") as f:
        f.write(so[:40])
    s.case("a .so shorter than an ELF header is refused", ["ext", "load", tiny], rc=1,
           msg=r"shorter than an ELF header")
    alien = path("alien.so")
    b = bytearray(so)
    b[18] ^= 0x01  # e_machine's low byte: another machine
    with open(alien, "wb") as f:
        f.write(bytes(b))
    s.case("a .so of another machine is refused", ["ext", "load", alien], rc=1, msg=r"built for ELF machine")
s.case("a FIFO as a source to ext build is refused at once",
       ["ext", "build", fifo(path("src_fifo.c")), "--out", path("extout")], rc=1, msg=r"src_fifo\.c is a FIFO",
       timeout=60)
s.case("a FIFO to ext load is refused at once", ["ext", "load", fifo(path("ext_fifo.so"))], rc=1, msg=r"FIFO",
       timeout=60)


# ---- signals during serve's start-up ----
def serve_signal(what, sig, env, wait_for, rc, msg):
    e = dict(os.environ)
    e.update(env)
    proc = subprocess.Popen([s.kiln, "serve", run, "--port", "0", "--threads", "1"], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=w)
    seen = ""
    t0 = time.time()
    while wait_for not in seen and time.time() - t0 < 60:
        line = proc.stderr.readline().decode("utf-8", "replace")
        if not line:
            break
        seen += line
    time.sleep(0.5)
    t = time.time()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=10)
        seen += err.decode("utf-8", "replace")
        took = time.time() - t
        ok = proc.returncode == rc and msg in seen and took < 5
        s.check(ok, "%s (exit %d in %.1fs)" % (what, proc.returncode, took))
        if not ok:
            print("      output: " + seen[-1500:])
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        s.check(False, "%s -- still running 10 s after the signal" % what)


if shim:
    slow = {"LD_PRELOAD": shim, "SLOW_OPEN_MATCH": "model.safetensors", "SLOW_OPEN_MS": "60000",
            "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "") + ":verify_asan_link_order=0"}
    serve_signal("serve stuck opening its model ends promptly on SIGTERM", signal.SIGTERM, slow, "loading",
                 128 + signal.SIGTERM, "stopped by SIGTERM during start-up")
    serve_signal("serve stuck opening its model ends promptly on SIGINT", signal.SIGINT, slow, "loading",
                 128 + signal.SIGINT, "stopped by SIGINT during start-up")
serve_signal("serve, once ready, stops on SIGTERM", signal.SIGTERM, {}, "ready", 0, "stopping (signal 15)")
serve_signal("serve, once ready, stops on SIGINT", signal.SIGINT, {}, "ready", 0, "stopping (signal 2)")
s.done()
