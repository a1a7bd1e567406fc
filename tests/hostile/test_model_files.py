"""Hostile model files (issue 51, classes 6 and 7): a Hugging Face folder whose
config.json is lax, malformed or not a file, or whose weights are of the wrong type or
stored twice, is refused by `kiln sample` with an error that names the key, the tensor
or the parse position (never "not a kiln model checkpoint"), and nothing in the folder
is touched. The folder is made by kiln itself (train a tiny LLaMA, export hf); the
safetensors files are rewritten here by hand from the format's definition."""
import array
import json
import os
import shutil
import struct
from hostile import Suite

s = Suite(__doc__)
d = s.dir("models")
corpus = s.corpus(d)
run = os.path.join(d, "run")
p, out = s.run(["train", "--data", corpus, "--out", run, "--arch", "llama", "--layers", "1", "--width", "64",
                "--heads", "4", "--kv-heads", "2", "--steps", "2", "--batch", "2", "--context", "32", "--quiet",
                "--eval-every", "0", "--threads", "1"], timeout=300)
base = os.path.join(d, "hf")
s.check(p is not None and p.returncode == 0, "a tiny LLaMA trains (set-up): " + out[-300:])
p, out = s.run(["export", "hf", run, base], timeout=120)
s.check(p is not None and p.returncode == 0, "it exports to a Hugging Face folder (set-up): " + out[-300:])
cfg = json.load(open(os.path.join(base, "config.json")))


def sample(folder, what, msg, rc=1):
    s.case(what, ["sample", folder, "--max-tokens", "2", "--threads", "1"], rc=rc, msg=msg,
           nomsg=r"not a kiln model checkpoint", untouched=[folder])


def variant(name, edit=None, raw=None):
    v = os.path.join(d, name)
    shutil.copytree(base, v)
    if raw is None:
        c = dict(cfg)
        edit(c)
        raw = json.dumps(c).encode()
    with open(os.path.join(v, "config.json"), "wb") as f:
        f.write(raw)
    return v


sample(base, "the exported folder itself loads (control)", r"", rc=0)
# class 6: lax fields are errors naming the key
sample(variant("tie_yes", lambda c: c.update(tie_word_embeddings="yes")), "a boolean given as a string",
       r"'tie_word_embeddings' must be true or false, not \"yes\"")
sample(variant("bias_one", lambda c: c.update(attention_bias=1)), "a boolean given as 1",
       r"'attention_bias' must be true or false")
sample(variant("rope_str", lambda c: c.update(rope_scaling="linear")), "rope_scaling as a string",
       r"'rope_scaling' must be an object or null")
sample(variant("head_dim0", lambda c: c.update(head_dim=0)), "head_dim 0", r"'head_dim' must be an integer from 1")
sample(variant("ffn0", lambda c: c.update(intermediate_size=0)), "intermediate_size 0",
       r"'intermediate_size' must be an integer from 1")
sample(variant("heads_neg", lambda c: c.update(num_attention_heads=-4)), "a negative head count",
       r"'num_attention_heads' must be an integer from 1")
sample(variant("layers_real", lambda c: c.update(num_hidden_layers=1.5)), "a layer count that is not whole",
       r"'num_hidden_layers' must be an integer")
sample(variant("type_num", lambda c: c.update(model_type=7)), "model_type not a string",
       r"'model_type' must be a string")
sample(variant("type_gone", lambda c: c.pop("model_type")), "model_type missing but architectures there",
       r"'model_type' is missing")
# class 7: a malformed config.json is reported as what it is, with its position
text = json.dumps(cfg).encode()
sample(variant("truncated", raw=text[:60]), "a truncated config.json", r"config.json: line 1, column \d+: ")
sample(variant("empty", raw=b""), "an empty config.json", r"config.json: the file is empty")
sample(variant("bom", raw=b"\xef\xbb\xbf" + text), "a config.json with a byte-order mark", r"byte-order mark")
sample(variant("nan", raw=text.replace(b'"rope_theta": 10000.0', b'"rope_theta": NaN')), "NaN in config.json",
       r"config.json: line 1, column \d+: invalid token")
sample(variant("huge", raw=text.replace(b'"hidden_size": 64', b'"hidden_size": 18446744073709551616')),
       "2^64 in config.json", r"too big integer")
sample(variant("array", raw=b"[1, 2]"), "config.json an array", r"config.json: not a JSON object")
sample(variant("dup", raw=text[:-1] + b', "hidden_size": 128}'), "a key given twice",
       r"config.json: line 1, column \d+: duplicate object key")
v = os.path.join(d, "dir")
shutil.copytree(base, v)
os.remove(os.path.join(v, "config.json"))
os.mkdir(os.path.join(v, "config.json"))
sample(v, "config.json a directory", r"config.json is a directory, not a regular file")
v = os.path.join(d, "loop")
shutil.copytree(base, v)
os.remove(os.path.join(v, "config.json"))
os.symlink("config.json", os.path.join(v, "config.json"))
sample(v, "config.json a link to itself", r"cannot open \S*config.json: Too many levels of symbolic links")
v = os.path.join(d, "fifo")
shutil.copytree(base, v)
os.remove(os.path.join(v, "config.json"))
os.mkfifo(os.path.join(v, "config.json"))
sample(v, "config.json a FIFO (no hang)", r"config.json is a FIFO, not a regular file")
s.case("a folder with neither a checkpoint nor a config", ["sample", s.dir("empty_folder")], rc=1,
       msg=r"neither a kiln run folder \(no model.safetensors\) nor a Hugging Face folder")
s.case("a path that is not there", ["sample", os.path.join(d, "absent")], rc=1, msg=r"absent: No such file")


v = os.path.join(d, "tokcfg")
shutil.copytree(base, v)
with open(os.path.join(v, "tokenizer_config.json"), "w") as f:
    f.write('{"chat_template": "{% for')
s.case("a truncated tokenizer_config.json stops serve, naming its position", ["serve", v, "--port", "0"], rc=1,
       msg=r"tokenizer_config.json: line 1, column \d+", untouched=[v], timeout=120)


# weights: the safetensors format by hand (8-byte little-endian header length, JSON, data)
def st_read(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    h.pop("__metadata__", None)
    data = b[8 + n:]
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in h.items()}


def st_write(path, tensors):
    h, off, blobs = {}, 0, []
    for k, (dt, shape, raw) in tensors.items():
        h[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    hj = json.dumps(h).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj + b"".join(blobs))


T = st_read(os.path.join(base, "model.safetensors"))
name = "model.norm.weight"
vals = array.array("f")
vals.frombytes(T[name][2])


def weights(vname, tensors):
    v = os.path.join(d, vname)
    shutil.copytree(base, v)
    st_write(os.path.join(v, "model.safetensors"), tensors)
    return v


sample(weights("i32", dict(T, **{name: ("I32", T[name][1], array.array("i", [int(x) for x in vals]).tobytes())})),
       "an I32 weight is refused, not converted by value", r"tensor 'model.norm.weight' is i32: a weight must be")
sample(weights("f64", dict(T, **{name: ("F64", T[name][1], array.array("d", vals).tobytes())})),
       "an F64 weight is taken (narrowed, as transformers does)", r"", rc=0)
half = len(vals) // 2
sample(weights("f64_short", dict(T, **{name: ("F64", [half], array.array("d", vals[:half]).tobytes())})),
       "a short F64 weight is named f64, not f32", r"model.norm.weight is f64")
v = os.path.join(d, "twice")
shutil.copytree(base, v)
os.remove(os.path.join(v, "model.safetensors"))
keys = list(T)
a = {k: T[k] for k in keys[:len(keys) // 2]}
b = {k: T[k] for k in keys[len(keys) // 2:]}
b[keys[0]] = T[keys[0]]
st_write(os.path.join(v, "a.safetensors"), a)
st_write(os.path.join(v, "b.safetensors"), b)
wm = {k: "a.safetensors" for k in a}
wm.update({k: "b.safetensors" for k in b if k not in a})
json.dump({"weight_map": wm}, open(os.path.join(v, "model.safetensors.index.json"), "w"))
sample(v, "a tensor stored in two shards", r"tensor '%s' is stored twice" % keys[0])
v = os.path.join(d, "bad_index")
shutil.copytree(base, v)
with open(os.path.join(v, "model.safetensors.index.json"), "w") as f:
    f.write('{"weight_map": {"a": ')
sample(v, "a truncated shard index", r"model.safetensors.index.json: line 1, column \d+")
# a GGUF file is named as one
gguf = os.path.join(d, "m.gguf")
p, out = s.run(["export", "gguf", run, gguf], timeout=120)
s.check(p is not None and p.returncode == 0, "it exports to GGUF (set-up): " + out[-300:])
s.case("a GGUF file samples as the model it holds", ["sample", gguf, "--tokens", "2"], rc=0, untouched=[d])
cut = os.path.join(d, "cut.gguf")
with open(gguf, "rb") as f, open(cut, "wb") as g:
    g.write(f.read()[:300])
s.case("a truncated GGUF file is named as a GGUF problem, not as a broken safetensors", ["sample", cut], rc=1,
       msg=r"cut\.gguf: .*truncated", nomsg=r"safetensors", untouched=[d])
s.case("kiln info of a truncated GGUF file names the problem", ["info", cut], rc=1, msg=r"truncated")
# a long path keeps the reason at the end of the message
longp = os.path.join(d, *(["x" * 200] * 12), "model")
s.case("a long path does not push the reason out of the message", ["sample", longp], rc=1,
       msg=r"No such file or directory")
s.done()
