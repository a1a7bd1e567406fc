#!/usr/bin/python3
"""PyTorch reference for kiln's GPT model (docs/model.md) and the golden-file generator.

    /usr/bin/python3 tests/reference/gpt_ref.py --out tests/reference/

writes golden_gpt2.safetensors and golden_llama.safetensors (see tests/reference/README.md).
Needs only torch (Debian: apt-get install python3-torch); safetensors files are read and
written by the small reader/writer below, not by the `safetensors` package.

Everything is float32, one thread, deterministic algorithms.
"""
import argparse
import json
import math
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------
# safetensors, by hand
#   file = u64 LE header length N | N bytes of JSON (padded with spaces to a multiple of 8)
#          | data buffer (little-endian, row-major; data_offsets are relative to its start)
# ---------------------------------------------------------------------------------------

_DTYPES = {  # safetensors name -> (torch dtype, struct code, bytes per element)
    "F32": (torch.float32, "f", 4),
    "F64": (torch.float64, "d", 8),
    "I64": (torch.int64, "q", 8),
    "I32": (torch.int32, "i", 4),
    "U8": (torch.uint8, "B", 1),
}
_NAME_OF = {v[0]: k for k, v in _DTYPES.items()}


def save_safetensors(path, tensors, metadata=None):
    """tensors: dict name -> torch.Tensor (F32/F64/I64/I32/U8); metadata: dict str -> str."""
    header, chunks, off = {}, [], 0
    for name in tensors:  # insertion order is kept in the data buffer
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in _NAME_OF:
            raise ValueError("%s: dtype %s not supported" % (name, t.dtype))
        st = _NAME_OF[t.dtype]
        code, size = _DTYPES[st][1], _DTYPES[st][2]
        vals = t.reshape(-1).tolist()
        data = struct.pack("<%d%s" % (len(vals), code), *vals)  # exact: f32 -> double -> f32
        assert len(data) == t.numel() * size
        header[name] = {"dtype": st, "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        chunks.append(data)
        off += len(data)
    if metadata:
        for k, v in metadata.items():
            if not isinstance(v, str):
                raise ValueError("__metadata__ values must be strings (%s)" % k)
        header["__metadata__"] = dict(metadata)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for c in chunks:
            f.write(c)


def load_safetensors(path):
    """Returns (dict name -> torch.Tensor in file order, metadata dict)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError("%s: too short" % path)
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError("%s: header length %d past end of file" % (path, n))
    header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    base = 8 + n
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dt, code, size = _DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        shape = info["shape"]
        numel = 1
        for d in shape:
            numel *= d
        if e - b != numel * size or base + e > len(raw):
            raise ValueError("%s: tensor %s has bad offsets %s" % (path, name, info["data_offsets"]))
        vals = struct.unpack("<%d%s" % (numel, code), raw[base + b : base + e])
        out[name] = torch.tensor(vals, dtype=dt).reshape(shape)
    return out, meta


# ---------------------------------------------------------------------------------------
# the model (docs/model.md)
# ---------------------------------------------------------------------------------------

def gpt2_config(**kw):
    c = dict(n_layer=2, n_head=4, n_kv_head=4, n_embd=32, block_size=16, vocab_size=64,
             norm="layernorm", pos="learned", mlp="gelu", ffn_hidden=0, bias=True, tied=True,
             norm_eps=1e-5, rope_theta=10000.0)
    c.update(kw)
    return c


def llama_config(**kw):
    c = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, vocab_size=64,
             norm="rmsnorm", pos="rope", mlp="swiglu", ffn_hidden=0, bias=False, tied=False,
             norm_eps=1e-5, rope_theta=10000.0)
    c.update(kw)
    return c


def ffn_hidden(cfg):
    if cfg["ffn_hidden"] > 0:
        return cfg["ffn_hidden"]
    C = cfg["n_embd"]
    if cfg["mlp"] == "gelu":
        return 4 * C
    return 64 * ((8 * C + 3 * 64 - 1) // (3 * 64))  # 64 * ceil((8C/3) / 64), in integers


class Norm(nn.Module):
    def __init__(self, C, kind, eps):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(C))
        self.bias = nn.Parameter(torch.zeros(C)) if kind == "layernorm" else None

    def forward(self, x):
        if self.kind == "layernorm":  # biased variance, eps inside the sqrt
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        # rmsnorm: x / sqrt(mean(x^2) + eps) * w
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def rope_tables(T, hs, theta):
    """cos, sin of shape (T, hs/2), the plain float32 way."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hs, 2).float() / hs))  # (hs/2,) f32
    t = torch.arange(T).float()
    ang = t[:, None] * inv_freq[None, :]  # f32
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x, cos, sin):
    """x (B, n, T, hs); rotate-half: pairs (i, i + hs/2)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, H, Hk = cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"]
        self.H, self.Hk, self.hs = H, Hk, C // H
        self.rope, self.theta = cfg["pos"] == "rope", cfg["rope_theta"]
        self.qkv = nn.Linear(C, (H + 2 * Hk) * self.hs, bias=cfg["bias"])
        self.proj = nn.Linear(C, C, bias=cfg["bias"])

    def forward(self, x):
        B, T, C = x.shape
        H, Hk, hs = self.H, self.Hk, self.hs
        q, k, v = self.qkv(x).split([H * hs, Hk * hs, Hk * hs], dim=-1)
        q = q.view(B, T, H, hs).transpose(1, 2)
        k = k.view(B, T, Hk, hs).transpose(1, 2)
        v = v.view(B, T, Hk, hs).transpose(1, 2)
        if self.rope:
            cos, sin = rope_tables(T, hs, self.theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if Hk != H:  # query head h uses kv head h // (H / Hk)
            k = k.repeat_interleave(H // Hk, dim=1)
            v = v.repeat_interleave(H // Hk, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, Fh, b = cfg["n_embd"], ffn_hidden(cfg), cfg["bias"]
        self.kind = cfg["mlp"]
        if self.kind == "gelu":
            self.fc = nn.Linear(C, Fh, bias=b)
            self.proj = nn.Linear(Fh, C, bias=b)
        else:
            self.gate = nn.Linear(C, Fh, bias=b)
            self.up = nn.Linear(C, Fh, bias=b)
            self.down = nn.Linear(Fh, C, bias=b)

    def forward(self, x):
        if self.kind == "gelu":
            return self.proj(gelu_tanh(self.fc(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["n_embd"]
        # attribute order = parameter order = docs/model.md order
        self.norm1 = Norm(C, cfg["norm"], cfg["norm_eps"])
        self.attn = Attention(cfg)
        self.norm2 = Norm(C, cfg["norm"], cfg["norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        C, V = cfg["n_embd"], cfg["vocab_size"]
        self.tok_emb = nn.Embedding(V, C)
        self.pos_emb = nn.Embedding(cfg["block_size"], C) if cfg["pos"] == "learned" else None
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg["n_layer"])])
        self.norm_f = Norm(C, cfg["norm"], cfg["norm_eps"])
        self.lm_head = None if cfg["tied"] else nn.Linear(C, V, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """docs/model.md: N(0, 0.02) for embeddings and Linear weights, the residual projections
        0.02/sqrt(2 n_layer), biases 0, norm weights 1; drawn in named_parameters() order."""
        rstd = 0.02 / math.sqrt(2 * self.cfg["n_layer"])
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                resid = name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight") \
                    or name.endswith("mlp.down.weight")
                p.normal_(0.0, rstd if resid else 0.02)
            elif ".norm" in "." + name:  # norm1/norm2/norm_f weights (and biases)
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.zero_()

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.cfg["block_size"]
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb.weight[:T]
        for blk in self.blocks:
            x = blk(x)
        x = self.norm_f(x)
        W = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        logits = x @ W.t()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T), ignore_index=-1)
        return logits, loss


def make_optimizer(model, lr, betas, eps, wd):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


# ---------------------------------------------------------------------------------------
# golden files
# ---------------------------------------------------------------------------------------

OPTIM = dict(name="adamw", lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1,
             weight_decay_applies_to="params with dim >= 2", steps=10)
SEED = 1234


def golden(cfg, B, T, steps=OPTIM["steps"]):
    torch.manual_seed(SEED)
    model = GPT(cfg)
    # the batch is drawn from the same generator, right after the weights
    idx = torch.randint(0, cfg["vocab_size"], (B, T), dtype=torch.int64)
    targets = torch.randint(0, cfg["vocab_size"], (B, T), dtype=torch.int64)
    targets[B - 1, T // 2] = -1  # one ignored target
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
    out["input.idx"] = idx
    out["input.targets"] = targets

    logits, loss = model(idx, targets)
    loss.backward()
    out["out.logits"] = logits.detach().clone()
    out["out.loss"] = loss.detach().clone().reshape(())
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().clone()

    model.zero_grad(set_to_none=True)
    opt = make_optimizer(model, OPTIM["lr"], tuple(OPTIM["betas"]), OPTIM["eps"], OPTIM["weight_decay"])
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _, l = model(idx, targets)
        losses.append(l.item())  # the loss before update k
        l.backward()
        opt.step()
    out["out.losses"] = torch.tensor(losses, dtype=torch.float32)
    assert abs(losses[0] - loss.item()) == 0.0, "step-0 loss differs from out.loss"

    meta = {
        "config": json.dumps(cfg, sort_keys=True),
        "train": json.dumps({"batch": B, "T": T, "seed": SEED, "ffn_hidden_resolved": ffn_hidden(cfg),
                             "ignored_target": [B - 1, T // 2], "optimizer": OPTIM}, sort_keys=True),
        "torch_version": torch.__version__,
        "generator": "tests/reference/gpt_ref.py",
        "param_names": json.dumps([n for n, _ in model.named_parameters()]),
    }
    return out, meta


AMP_STEPS = 20


def amp_golden(weights_path):
    """Mixed precision on the golden file's weights and batch: AMP_STEPS AdamW steps (OPTIM,
    no clipping) under torch.autocast("cpu") in bf16, and in f16 with torch.amp.GradScaler
    (its defaults: scale 2**16, x2 every 2000 good steps, x0.5 and the step skipped on an inf
    or nan gradient), and the same steps in f32 for scale. Stores the losses (before each
    update), the f16 scale each step used, and the step-0 logits under bf16 autocast."""
    t, meta = load_safetensors(weights_path)
    cfg = json.loads(meta["config"])
    idx, targets = t["input.idx"], t["input.targets"]
    out = {}
    for prec in ("f32", "bf16", "f16"):
        model = GPT(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(t[name])
        opt = make_optimizer(model, OPTIM["lr"], tuple(OPTIM["betas"]), OPTIM["eps"], OPTIM["weight_decay"])
        scaler = torch.amp.GradScaler("cpu") if prec == "f16" else None
        dt = {"bf16": torch.bfloat16, "f16": torch.float16}.get(prec)
        losses, scales = [], []
        for k in range(AMP_STEPS):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dt or torch.bfloat16, enabled=dt is not None):
                logits, l = model(idx, targets)
            if k == 0 and prec == "bf16":
                assert logits.dtype == torch.bfloat16 and l.dtype == torch.float32
                out["bf16.logits"] = logits.detach().float()
            losses.append(l.item())
            if scaler:
                scales.append(scaler.get_scale())
                scaler.scale(l).backward()
                scaler.step(opt)
                scaler.update()
            else:
                l.backward()
                opt.step()
        out[prec + ".losses"] = torch.tensor(losses, dtype=torch.float64)
        if scaler:
            out["f16.scales"] = torch.tensor(scales, dtype=torch.float64)
    meta = {"config": meta["config"], "weights_from": os.path.basename(weights_path),
            "train": json.dumps({"steps": AMP_STEPS, "optimizer": OPTIM, "clip": None,
                                 "autocast": "torch.autocast('cpu', dtype)", "f16_scaler": "torch.amp.GradScaler('cpu')"},
                                sort_keys=True),
            "torch_version": torch.__version__, "generator": "tests/reference/gpt_ref.py --amp"}
    return out, meta


def check_file(path, verbose=True):
    t, meta = load_safetensors(path)
    cfg = json.loads(meta["config"])
    if verbose:
        print("== %s (%d bytes, torch %s)" % (path, os.path.getsize(path), meta.get("torch_version")))
        print("   config:", meta["config"])
        print("   train: ", meta["train"])
        for name, x in t.items():
            print("   %-32s %-4s %s" % (name, _NAME_OF[x.dtype], list(x.shape)))
    losses = t["out.losses"].tolist()
    print("   out.loss = %.7f  (ln V = %.4f)" % (t["out.loss"].item(), math.log(cfg["vocab_size"])))
    print("   out.losses =", " ".join("%.5f" % v for v in losses))
    dec = all(b < a for a, b in zip(losses, losses[1:]))
    print("   losses strictly decrease:", dec)
    # recompute forward/backward from the stored weights and compare bitwise
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(t[name])
    logits, loss = model(t["input.idx"], t["input.targets"])
    loss.backward()
    ok = torch.equal(logits, t["out.logits"]) and torch.equal(loss.reshape(()), t["out.loss"])
    for name, p in model.named_parameters():
        ok = ok and torch.equal(p.grad, t["grad." + name])
    print("   reload + recompute matches bitwise:", ok)
    return dec and ok


def check_with_safetensors_package(path):
    try:
        from safetensors.torch import load_file  # noqa
    except Exception:
        print("   (safetensors package not importable; cross-check skipped)")
        return None
    a = load_file(path)
    b, _ = load_safetensors(path)
    same = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    print("   safetensors package reads it identically:", same)
    return same


# ---------------------------------------------------------------------------------------
# self-checks of the reference itself (--selfcheck)
# ---------------------------------------------------------------------------------------

def _naive_attention(attn, x):
    """Per-head loops with explicit kv-head selection and explicit rope pairs: an independent
    spelling of docs/model.md's attention, to check Attention.forward against."""
    B, T, C = x.shape
    H, Hk, hs = attn.H, attn.Hk, attn.hs
    qkv = x @ attn.qkv.weight.t() + (attn.qkv.bias if attn.qkv.bias is not None else 0)
    out = torch.zeros(B, T, C, dtype=x.dtype)
    half = hs // 2
    for b in range(B):
        for h in range(H):
            g = h // (H // Hk)
            q = qkv[b, :, h * hs:(h + 1) * hs].clone()
            k = qkv[b, :, H * hs + g * hs:H * hs + (g + 1) * hs].clone()
            v = qkv[b, :, (H + Hk) * hs + g * hs:(H + Hk) * hs + (g + 1) * hs]
            if attn.rope:
                for t in range(T):
                    for i in range(half):
                        inv = 1.0 / attn.theta ** (2 * i / hs)
                        a = t * inv
                        c, s_ = math.cos(a), math.sin(a)
                        for z in (q, k):
                            x1, x2 = z[t, i].item(), z[t, i + half].item()
                            z[t, i], z[t, i + half] = x1 * c - x2 * s_, x1 * s_ + x2 * c
            for t in range(T):
                sc = (q[t] @ k[:t + 1].t()) / math.sqrt(hs)
                out[b, t, h * hs:(h + 1) * hs] = torch.softmax(sc, -1) @ v[:t + 1]
    return attn.proj(out)


def selfcheck():
    ok = True
    for cfg in (gpt2_config(), llama_config()):
        tag = cfg["norm"]
        torch.manual_seed(SEED)
        m64 = GPT(cfg).double()
        x = torch.randn(2, 8, cfg["n_embd"], dtype=torch.float64)
        with torch.no_grad():
            d = (m64.blocks[0].attn(x) - _naive_attention(m64.blocks[0].attn, x)).abs().max().item()
        print("[%s] attention vs naive per-head loop (f64): max|d| = %.3g" % (tag, d))
        ok = ok and d < 1e-9  # not ~1e-16: the model's rope tables are float32 even in a double model
        # autograd vs central finite differences, f64, a few coordinates of each parameter
        idx = torch.randint(0, cfg["vocab_size"], (2, 8))
        tg = torch.randint(0, cfg["vocab_size"], (2, 8))
        tg[1, 3] = -1
        m64.zero_grad()
        _, loss = m64(idx, tg)
        loss.backward()
        worst = 0.0
        g = torch.Generator().manual_seed(7)
        for name, p in m64.named_parameters():
            for _ in range(3):
                j = torch.randint(0, p.numel(), (1,), generator=g).item()
                flat = p.data.view(-1)
                old = flat[j].item()
                with torch.no_grad():
                    flat[j] = old + 1e-6
                    lp = m64(idx, tg)[1].item()
                    flat[j] = old - 1e-6
                    lm = m64(idx, tg)[1].item()
                    flat[j] = old
                fd = (lp - lm) / 2e-6
                an = p.grad.view(-1)[j].item()
                worst = max(worst, abs(fd - an) / (1e-6 + 1e-4 * abs(an)))
        print("[%s] autograd vs finite differences (f64): worst |fd-an| / (1e-6 + 1e-4|an|) = %.3g" % (tag, worst))
        ok = ok and worst < 1.0
        # AdamW as docs/model.md spells it vs torch.optim.AdamW, 3 steps
        torch.manual_seed(SEED)
        ma = GPT(cfg)
        mb = GPT(cfg)
        mb.load_state_dict(ma.state_dict())
        opt = make_optimizer(ma, 1e-3, (0.9, 0.95), 1e-8, 0.1)
        st = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in mb.named_parameters()}
        for k in range(1, 4):
            for mm in (ma, mb):
                mm.zero_grad(set_to_none=True)
                mm(idx, tg)[1].backward()
            opt.step()
            with torch.no_grad():
                for n, p in mb.named_parameters():
                    mo, v = st[n]
                    if p.dim() >= 2:
                        p.mul_(1 - 1e-3 * 0.1)
                    mo.mul_(0.9).add_(p.grad, alpha=0.1)
                    v.mul_(0.95).addcmul_(p.grad, p.grad, value=0.05)
                    mhat, vhat = mo / (1 - 0.9 ** k), v / (1 - 0.95 ** k)
                    p.sub_(1e-3 * mhat / (vhat.sqrt() + 1e-8))
        # the key part of attn.qkv.bias is left out: its gradient is exactly 0 in exact arithmetic
        # (softmax ignores a per-row constant), so in float32 it is rounding noise of ~1e-11 that
        # Adam turns into noise-driven steps; it has no effect on the loss.
        d = max((a - b).abs().max().item() for (n, a), b in zip(ma.named_parameters(), mb.parameters())
                if not n.endswith("attn.qkv.bias"))
        print("[%s] torch AdamW vs hand-written AdamW, 3 steps (k-bias left out): max|d| = %.3g" % (tag, d))
        ok = ok and d < 1e-6
        # how far float32 is from float64 on the golden batch (headroom for the C tolerances)
        t32, _ = golden(cfg, B=2, T=cfg["block_size"], steps=10)
        m = GPT(cfg).double()
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(t32[n].double())
        lg, l = m(t32["input.idx"], t32["input.targets"])
        l.backward()
        dl = (lg - t32["out.logits"].double()).abs().max().item()
        rel = abs(l.item() - t32["out.loss"].item()) / abs(l.item())
        gr = max(((p.grad - t32["grad." + n].double()).abs().max() / p.grad.abs().max()).item()
                 for n, p in m.named_parameters())
        print("[%s] f32 golden vs f64 recompute: logits max|d| = %.3g, loss rel = %.3g, worst grad rel = %.3g"
              % (tag, dl, rel, gr))
    print("selfcheck:", "OK" if ok else "FAILED")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--check", action="store_true", help="only read back and check existing files")
    ap.add_argument("--selfcheck", action="store_true", help="check the reference itself (f64 finite "
                    "differences, naive attention, hand-written AdamW, f32-vs-f64 headroom)")
    ap.add_argument("--amp", action="store_true", help="write golden_<model>_amp.safetensors from the golden "
                    "files' weights: losses under autocast bf16 and f16 (PyTorch 2.x)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    if a.selfcheck:
        return 0 if selfcheck() else 1
    os.makedirs(a.out, exist_ok=True)
    if a.amp:
        for name in ("gpt2", "llama"):
            tensors, meta = amp_golden(os.path.join(a.out, "golden_%s.safetensors" % name))
            save_safetensors(os.path.join(a.out, "golden_%s_amp.safetensors" % name), tensors, meta)
            print("golden_%s_amp: bf16 %s\n  f16 %s\n  f32 %s" % (name, tensors["bf16.losses"].tolist()[-3:],
                  tensors["f16.losses"].tolist()[-3:], tensors["f32.losses"].tolist()[-3:]))
        return 0
    jobs = [("golden_gpt2.safetensors", gpt2_config()), ("golden_llama.safetensors", llama_config())]
    ok = True
    for fname, cfg in jobs:
        path = os.path.join(a.out, fname)
        if not a.check:
            tensors, meta = golden(cfg, B=2, T=cfg["block_size"])
            save_safetensors(path, tensors, meta)
        ok = check_file(path) and ok
        check_with_safetensors_package(path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
