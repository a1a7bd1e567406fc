#!/usr/bin/env python3
"""kiln's GGUF reader (src/io/gguf_read.c, src/core/quant.c) against llama.cpp's own
`gguf` Python package (PyPI, in build/venv), the oracle:

- every tensor type kiln reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K,
  Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), as random blocks (every bit pattern of scales and
  indices, NaN and infinite scales included) and, for the types the package quantizes,
  as quantized random weights, in 1-D to 4-D tensors, written by the package's
  GGUFWriter and dequantized by kiln (gguf_probe) bit for bit as gguf.quants.dequantize
  does (NaN where it gives NaN: the payload of a NaN is not compared);
- metadata of every value type and arrays of them, read back as written;
- malformed files (truncated anywhere in the header, wrong magic, version 1 and a
  big-endian one, a tensor past the end, an unknown type, a row that blocks do not
  divide, a misaligned offset, keys and tensor names given twice, lengths larger than
  the file, an array of arrays, a value of the wrong type) refused with a message
  naming the key or tensor, never a crash; a type kiln does not read (IQ2_XXS) opens
  and its tensor is refused by name.
Exits 77 (skip, never a pass) without numpy and gguf.
    python tests/gguf/test_gguf_read.py --probe build/gguf_probe --workdir DIR
"""
import argparse
import os
import struct
import subprocess
import sys

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as Q
except ImportError:
    print("skip: numpy and gguf are not installed (run scripts/install-test-deps.sh)")
    sys.exit(77)

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS"]
QUANTIZABLE = {"F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
passed = failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
        print("ok   " + what)
    else:
        failed += 1
        print("FAIL " + what)
    return ok


def probe(a, path):
    out = os.path.join(a.workdir, "out")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        os.remove(os.path.join(out, f))
    try:
        r = subprocess.run([a.probe, path, out], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None, "", "hung"
    return r.returncode, r.stdout, r.stderr.strip()


def random_tensors(rng, name):
    """(name, raw array, shape in numpy's order, type) for every type: random bytes, and
    quantized weights where the package quantizes."""
    out = []
    shapes = [(256,), (3, 512), (2, 2, 256), (2, 1, 2, 256)]
    for k, t in enumerate(TYPES):
        qt = Q[t]
        block, size = gguf.GGML_QUANT_SIZES[qt]
        shape = shapes[k % len(shapes)]
        n = int(np.prod(shape))
        raw = rng.integers(0, 256, size=n // block * size, dtype=np.uint8)
        byte_shape = shape[:-1] + (shape[-1] // block * size,)
        out.append((f"{t}.random", raw.reshape(byte_shape), qt))
        if t in QUANTIZABLE:
            w = (rng.standard_normal(n) * rng.uniform(0.01, 3)).astype(np.float32).reshape(shape)
            out.append((f"{t}.weights", gguf.quants.quantize(w, qt), qt))
        if t == "F32":
            out.append(("F32.weights", rng.standard_normal(n).astype(np.float32).reshape(shape), qt))
    return out


def check_types(a, rng):
    path = os.path.join(a.workdir, "types.gguf")
    w = gguf.GGUFWriter(path, "llama")
    tensors = random_tensors(rng, "t")
    for name, arr, qt in tensors:
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, out, err = probe(a, path)
    if not check(rc == 0, f"a file of {len(tensors)} tensors of the {len(TYPES)} types opens ({err})"):
        return
    info = subprocess.run([a.kiln, "info", path], capture_output=True, text=True, timeout=120)
    rows = {l.split()[0]: l.split()[1:3] for l in info.stdout.splitlines()[2:] if l.startswith("  ") and "." in l}
    want_rows = {n: [qt.name, "x".join(str(d) for d in arr.shape[:-1] + (arr.shape[-1] // gguf.GGML_QUANT_SIZES[qt][1]
                                                                           * gguf.GGML_QUANT_SIZES[qt][0],))]
                 for n, arr, qt in tensors if arr.dtype == np.uint8}
    check(info.returncode == 0 and all(rows.get(n) == r for n, r in want_rows.items()) and
          f"{len(tensors)} tensors" in info.stdout,
          f"kiln info lists every tensor with its type and shape ({info.stderr.strip()})")
    lines = {l.split()[1]: l.split() for l in out.splitlines() if l.startswith("tensor ")}
    reader = gguf.GGUFReader(path)
    for i, t in enumerate(reader.tensors):
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        got = np.fromfile(os.path.join(a.workdir, "out", f"{i}.f32"), dtype=np.float32)
        shape = "x".join(str(int(d)) for d in reversed(t.shape))
        line = lines.get(t.name, [])
        same_nan = np.isnan(got) == np.isnan(want)
        bits = got.view(np.uint32) == want.view(np.uint32)
        ok = (len(got) == len(want) and same_nan.all() and (bits | np.isnan(want)).all() and
              line[2:4] == [t.tensor_type.name, shape] and int(line[4]) == t.data_offset)
        bad = "" if ok else (f": {int((~bits & ~np.isnan(want)).sum()) if len(got) == len(want) else 'a different count of'}"
                             f" values differ; kiln says {line[2:]}, gguf {t.tensor_type.name} {shape} {t.data_offset}")
        check(ok, f"{t.name}: {len(want)} values ({int(np.isnan(want).sum())} NaN) dequantized bit for bit as "
                  f"gguf does{bad}")


def check_metadata(a):
    path = os.path.join(a.workdir, "meta.gguf")
    w = gguf.GGUFWriter(path, "qwen3")
    V = gguf.GGUFValueType
    kv = [("t.u8", 200, V.UINT8), ("t.i8", -100, V.INT8), ("t.u16", 60000, V.UINT16), ("t.i16", -30000, V.INT16),
          ("t.u32", 4000000000, V.UINT32), ("t.i32", -2000000000, V.INT32), ("t.f32", 0.1, V.FLOAT32),
          ("t.bool", True, V.BOOL), ("t.str", "héllo wörld", V.STRING), ("t.u64", 2 ** 63 - 1, V.UINT64),
          ("t.i64", -2 ** 62, V.INT64), ("t.f64", 1e-300, V.FLOAT64)]
    for k, v, t in kv:
        w.add_key_value(k, v, t)
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_key_value("t.i32s", [1, -2, 3], V.ARRAY, V.INT32)
    w.add_key_value("t.f32s", [0.5, 1.5], V.ARRAY, V.FLOAT32)
    w.add_tensor("x", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, out, err = probe(a, path)
    if not check(rc == 0, f"a file with keys of every value type opens ({err})"):
        return
    got = {l.split(" ", 2)[1]: l.split(" ", 2)[2] for l in out.splitlines() if l.startswith("key ")}
    names = {V.UINT8: "u8", V.INT8: "i8", V.UINT16: "u16", V.INT16: "i16", V.UINT32: "u32", V.INT32: "i32",
             V.FLOAT32: "f32", V.BOOL: "bool", V.STRING: "string", V.UINT64: "u64", V.INT64: "i64", V.FLOAT64: "f64"}
    for k, v, t in kv:
        if t == V.FLOAT32:
            want = "%.17g" % float(np.float32(v))
        elif t == V.FLOAT64:
            want = "%.17g" % v
        elif t == V.BOOL:
            want = "true" if v else "false"
        else:
            want = str(v)
        check(got.get(k) == f"{names[t]} {want}", f"{k} reads back as {names[t]} {want} (kiln: {got.get(k)})")
    check(got.get("general.architecture") == "string qwen3", "general.architecture reads back")
    check(got.get("t.strs") == "array string 3 a", f"an array of strings reads back ({got.get('t.strs')})")
    check(got.get("t.i32s") == "array i32 3 3", f"an array of i32 reads back ({got.get('t.i32s')})")
    check(got.get("t.f32s") == "array f32 2 0.5", f"an array of f32 reads back ({got.get('t.f32s')})")


def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def build(keys=(), tensors=(), version=3, magic=b"GGUF", n_keys=None, n_tensors=None, data=b"", align=32):
    """A GGUF file by hand: keys as (name, type, packed value), tensors as (name, dims,
    type, offset)."""
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(keys) if n_keys is None else n_keys)
    for k, t, v in keys:
        head += gstr(k) + struct.pack("<I", t) + v
    for name, dims, t, off in tensors:
        head += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        head += struct.pack("<IQ", t, off)
    head += b"\0" * (-len(head) % align)
    return head + data


def check_malformed(a):
    good = build(keys=[("general.architecture", 8, gstr("llama"))], tensors=[("w", [32, 2], 0, 0)],
                 data=b"\0" * 256)
    cases = [
        ("a wrong magic", good.replace(b"GGUF", b"GGML", 1), "not a GGUF file"),
        ("version 1", build(version=1), "version 1"),
        ("a big-endian file", build(version=3 << 24), "big-endian"),
        ("a tensor past the end of the file", build(tensors=[("w.past", [32, 4], 0, 0)], data=b"\0" * 100),
         "w.past.*past the end"),
        ("an unknown tensor type", build(tensors=[("w.type", [32], 99, 0)], data=b"\0" * 128), "w.type.*type 99"),
        ("a row that blocks do not divide", build(tensors=[("w.row", [48], 8, 0)], data=b"\0" * 128),
         "w.row.*48 values.*Q8_0"),
        ("a misaligned offset", build(tensors=[("w.align", [8], 0, 4)], data=b"\0" * 128), "w.align.*multiple"),
        ("a key given twice", build(keys=[("k", 4, struct.pack("<I", 1))] * 2), "k: the key is given twice"),
        ("a tensor name given twice", build(tensors=[("w2", [8], 0, 0), ("w2", [8], 0, 32)], data=b"\0" * 128),
         "w2: the name is given twice"),
        ("a string longer than the file", build(keys=[("k.long", 8, struct.pack("<Q", 2 ** 40) + b"x")]),
         "k.long.*truncated"),
        ("an array longer than the file", build(keys=[("k.arr", 9, struct.pack("<IQ", 4, 2 ** 60))]),
         "k.arr.*truncated"),
        ("a string array longer than the file", build(keys=[("k.sarr", 9, struct.pack("<IQ", 8, 2 ** 60))]),
         "k.sarr.*more than the file"),
        ("an array of arrays", build(keys=[("k.nest", 9, struct.pack("<IQ", 9, 1))]), "k.nest.*array of arrays"),
        ("an unknown value type", build(keys=[("k.type", 77, b"")]), "k.type.*value type 77"),
        ("a bool of 2", build(keys=[("k.bool", 7, b"\x02")]), "k.bool.*neither 0 nor 1"),
        ("more keys than the file holds", build(n_keys=2 ** 60), "more than its .* bytes can hold"),
        ("a zero dimension", build(tensors=[("w.zero", [0, 4], 0, 0)]), "w.zero.*zero dimension"),
        ("five dimensions", build(tensors=[("w.five", [1, 1, 1, 1, 1], 0, 0)]), "w.five.*5 dimensions"),
        ("an alignment that is not a power of two", build(keys=[("general.alignment", 4, struct.pack("<I", 24))]),
         "general.alignment.*power of two"),
        ("an alignment of the wrong type", build(keys=[("general.alignment", 8, gstr("32"))]),
         "general.alignment.*u32"),
        ("an empty file", b"", "empty"),
    ]
    for cut in (3, 7, 15, 23, 40, len(good) - 300):
        cases.append((f"the good file cut at byte {cut}", good[:cut], "truncated|not a GGUF|past the end"))
    rc, out, err = probe(a, write(a, "good.gguf", good))
    check(rc == 0 and "tensor w F32 2x32" in out, f"the hand-made good file opens ({err})")
    import re
    for what, blob, msg in cases:
        rc, out, err = probe(a, write(a, "bad.gguf", blob))
        check(rc == 1 and re.search(msg, err) and "bad.gguf" in err,
              f"{what} is refused naming it: exit {rc}, {err!r}")
    # a type ggml has and kiln does not read: the file opens, the tensor is refused by name
    bad = subprocess.run([a.kiln, "info", write(a, "bad.gguf", build(tensors=[("w.past", [32, 4], 0, 0)],
                                                                    data=b"\0" * 100))],
                         capture_output=True, text=True, timeout=120)
    check(bad.returncode == 1 and "kiln info:" in bad.stderr and "w.past" in bad.stderr,
          f"kiln info on a malformed GGUF file names the tensor: {bad.stderr.strip()!r}")
    rc, out, err = probe(a, write(a, "iq2.gguf", build(tensors=[("w.iq2", [256], 16, 0)], data=b"\0" * 96)))
    check(rc == 1 and "w.iq2" in err and "IQ2_XXS" in err and "does not read" in err,
          f"an IQ2_XXS tensor is refused by name when read: {err!r}")


def write(a, name, blob):
    p = os.path.join(a.workdir, name)
    with open(p, "wb") as f:
        f.write(blob)
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", required=True)
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    rng = np.random.default_rng(47)
    check_types(a, rng)
    check_metadata(a)
    check_malformed(a)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
