#!/usr/bin/env python3
"""The README's recipes, run exactly as written (issue 50: a README a newcomer can follow).

    python3 tests/readme/test_readme.py --src SRC --build BUILD --workdir DIR

Every fenced block under "## Recipes" runs in order, in one fresh folder, as a newcomer
would from the kiln folder after `make build`: `build` there is the build folder, `sh`
blocks run under bash (-e, pipefail) line for line as the README has them, and a `c`
block is saved under the name its first comment gives. What the README assumes a user
has is put in place first, never downloaded:

- `notes.txt`, "any UTF-8 text": the project's own docs/*.md;
- `qwen2.5-0.5b-instruct-q8_0.gguf`, "a GGUF file": tests/reference/hf/qwen3 written
  by `kiln export gguf --dtype q8_0` (a Qwen3, not a Qwen2.5, and tiny: a stand-in);
- `smollm`, "a folder transformers saves": tests/reference/hf/llama (random weights,
  a byte-level tokenizer.json), its max_position_embeddings raised to 2048 as a real
  model's is (the tiny folder says 64, shorter than `kiln train`'s default context);
- `make install && ldconfig` (as root, into /usr/local) is the one line not run as
  written: the tree is installed into a private prefix instead, which PKG_CONFIG_PATH
  and LD_LIBRARY_PATH then name, so that a test never writes to the system.

Each recipe's result is then checked: the run folders hold their checkpoints, sample
continues its prompt, the server answered the completion, the MPI run finished, and
greedy.c prints exactly what `kiln sample --temperature 0` prints (two decoders: the C
program's loop over the KV cache, and the serving engine the kiln program uses).
"""
import argparse
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys

INSTALL_LINE = "make install && ldconfig"


def recipes(readme):
    """[(title, [(lang, text), ...]), ...] of the section "## Recipes"."""
    text = open(readme, encoding="utf-8").read()
    m = re.search(r"^## Recipes\n(.*?)(?=^## )", text, re.S | re.M)
    if not m:
        sys.exit("FAIL: README.md has no '## Recipes' section")
    out = []
    for part in re.split(r"^### ", m.group(1), flags=re.M)[1:]:
        title = part.split("\n", 1)[0].strip()
        blocks = re.findall(r"^```(\w+)\n(.*?)^```", part, re.S | re.M)
        out.append((title, blocks))
    return out


GGUF_FILE = "qwen2.5-0.5b-instruct-q8_0.gguf"


def setup(src, build, work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    with open(os.path.join(work, "notes.txt"), "w", encoding="utf-8") as f:
        for p in sorted(glob.glob(os.path.join(src, "docs", "*.md"))):
            f.write(open(p, encoding="utf-8").read())
    hf = os.path.join(work, "smollm")
    shutil.copytree(os.path.join(src, "tests", "reference", "hf", "llama"), hf)
    os.remove(os.path.join(hf, "expected.safetensors"))
    cfg_path = os.path.join(hf, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["max_position_embeddings"] = 2048
    json.dump(cfg, open(cfg_path, "w"), indent=2)
    # the GGUF file "downloaded": the tiny Qwen3 reference folder, written by kiln in q8_0
    r = subprocess.run([os.path.join(build, "kiln"), "export", "gguf", os.path.join(src, "tests", "reference", "hf",
                        "qwen3"), os.path.join(work, GGUF_FILE), "--dtype", "q8_0"], capture_output=True, text=True)
    if r.returncode:
        sys.exit("FAIL: could not make the stand-in GGUF file: " + r.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    src, build, work = (os.path.abspath(p) for p in (a.src, a.build, a.workdir))
    setup(src, build, work)
    os.symlink(build, os.path.join(work, "build"))
    env = dict(os.environ)
    prefix = os.path.join(work, "prefix")
    failed, ran = [], 0
    with socket.socket() as s:  # the serve recipe listens on kiln's default port
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            sys.exit("FAIL: port 8000 is in use here, and the README's serve recipe listens on it")
    out = {}
    for title, blocks in recipes(os.path.join(src, "README.md")):
        if not blocks:
            failed.append("%s: no code block" % title)
        log = ""
        for lang, body in blocks:
            if lang == "c":
                name = re.match(r"/\* (\S+\.c):", body)
                if not name:
                    failed.append("%s: a c block must start with /* NAME.c: ... */" % title)
                    continue
                open(os.path.join(work, name.group(1)), "w").write(body)
                continue
            if lang != "sh":
                failed.append("%s: a ```%s block (only sh and c run)" % (title, lang))
                continue
            lines = []
            for line in body.splitlines():
                if line.startswith(INSTALL_LINE):
                    r = subprocess.run(["cmake", "--install", build, "--prefix", prefix], capture_output=True,
                                       text=True)
                    if r.returncode:
                        failed.append("%s: cmake --install failed: %s" % (title, r.stdout + r.stderr))
                    lib = os.path.dirname(glob.glob(os.path.join(prefix, "lib*", "pkgconfig"))[0])
                    env["PKG_CONFIG_PATH"] = os.path.join(lib, "pkgconfig")
                    env["LD_LIBRARY_PATH"] = lib
                    continue
                lines.append(line)
            script = "\n".join(lines) + "\n"
            print("## %s\n%s" % (title, script), flush=True)
            try:
                r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=work, env=env,
                                   capture_output=True, text=True, errors="replace", timeout=900)
                rc, text = r.returncode, r.stdout + "\n" + r.stderr
            except subprocess.TimeoutExpired as e:
                rc, text = "timeout", str(e.stdout or "") + str(e.stderr or "")
            print(text[-3000:], flush=True)
            log += text
            if rc != 0:
                failed.append("%s: exit %s" % (title, rc))
        out[title] = log
        ran += 1

    def need(ok, what):
        if not ok:
            failed.append(what)

    def exists(p):
        return os.path.exists(os.path.join(work, p))

    titles = list(out)
    need(len(titles) == 5, "the README has %d recipes, the test knows 5: %s" % (len(titles), titles))
    t = next((x for x in titles if x.startswith("Train on your own text")), None)
    need(t and exists("runs/notes/model.safetensors") and exists("runs/notes/tokenizer.json"),
         "train recipe: runs/notes holds no model.safetensors and tokenizer.json")
    need(t and re.search(r"^The .{20,}", out[t], re.M | re.S), "sample recipe: no continuation of 'The '")
    t = next((x for x in titles if x.startswith("Fine-tune")), None)
    need(t and exists("runs/smol-notes/model.safetensors"), "fine-tune recipe: no runs/smol-notes checkpoint")
    answer = re.search(r'^\{.*"choices".*\}$', out.get(t, ""), re.M)
    need(answer and json.loads(answer.group(0))["choices"][0]["text"] != "" and
         json.loads(answer.group(0))["usage"]["completion_tokens"] >= 1,
         "serve recipe: no completion with text in curl's answer")
    t = next((x for x in titles if x.startswith("Run a GGUF file")), None)
    need(t and re.search(r"^The capital of France is", out[t], re.M) and re.search(r"bits a weight", out[t]),
         "GGUF recipe: info's summary line and sample's continuation")
    t = next((x for x in titles if x.startswith("Several processes")), None)
    need(t and re.search(r"^done: 50 steps", out[t], re.M) and exists("runs/notes-mpi/model.safetensors"),
         "MPI recipe: the run did not finish 50 steps")
    t = next((x for x in titles if x.startswith("The C API")), None)
    if t:
        mine = subprocess.run([os.path.join(work, "greedy"), "runs/notes", "The "], cwd=work, env=env,
                              capture_output=True)
        theirs = subprocess.run([os.path.join(build, "kiln"), "sample", "runs/notes", "--prompt", "The ",
                                 "--max-tokens", "40", "--temperature", "0"], cwd=work, capture_output=True)
        need(mine.returncode == 0 and mine.stdout and mine.stdout == theirs.stdout,
             "greedy.c printed %r, kiln sample --temperature 0 %r" % (mine.stdout[-200:], theirs.stdout[-200:]))
    else:
        failed.append("no C API recipe")
    for f in failed:
        print("FAIL: " + f)
    print("%d recipes run, %d failures" % (ran, len(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
