#!/usr/bin/python3
"""PyTorch reference for kiln's mixture-of-experts blocks (docs/model.md, "Mixture of
experts") and the golden-file generator for them.

    ~/torch2/bin/python tests/reference/moe_ref.py --out tests/reference/

writes golden_moe_softmax.safetensors and golden_moe_sigmoid.safetensors: a LLaMA-style
model (gpt_ref.py's attention, norms and dense MLP) whose blocks after n_dense_layers
are MoE blocks, written as the common PyTorch implementation does it: a loop over the
experts, each taking its rows with nonzero() and adding them back with index_add_.
Besides what gpt_ref.py's golden files hold it stores the balancing bias of every MoE
block after each of the 10 AdamW steps (`out.router_bias`, (steps, layers, E)) and the
balance loss of the first forward (`out.balance`).

Everything is float32, one thread, deterministic algorithms.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_ref  # noqa: E402  (the safetensors I/O, Norm, Attention, MLP, AdamW groups)


def moe_ffn(cfg):
    if cfg["moe_ffn"] > 0:
        return cfg["moe_ffn"]
    return (gpt_ref.ffn_hidden(cfg) // 4 + 7) // 8 * 8


def topk_lower_index(x, k):
    """The k largest per row, ties to the lower index: a stable descending sort."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


class Router(nn.Module):
    def __init__(self, C, E):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, C))
        self.bias = nn.Parameter(torch.zeros(E), requires_grad=False)  # moved by the balancing rule


class Experts(nn.Module):
    def __init__(self, C, E, Fe):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(E, C, Fe))
        self.up = nn.Parameter(torch.empty(E, C, Fe))
        self.down = nn.Parameter(torch.empty(E, Fe, C))


class Shared(nn.Module):
    def __init__(self, C, W):
        super().__init__()
        self.gate = nn.Linear(C, W, bias=False)
        self.up = nn.Linear(C, W, bias=False)
        self.down = nn.Linear(W, C, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, E, S, Fe = cfg["n_embd"], cfg["n_routed_experts"], cfg["n_shared_experts"], moe_ffn(cfg)
        self.cfg, self.E, self.k = cfg, E, cfg["moe_top_k"]
        self.router = Router(C, E)
        self.experts = Experts(C, E, Fe)
        self.shared = Shared(C, S * Fe) if S > 0 else None
        self.last_load = None

    def forward(self, x):
        B, T, C = x.shape
        E, k, cfg = self.E, self.k, self.cfg
        xf = x.reshape(B * T, C)
        logits = xf @ self.router.weight.t()
        s = torch.softmax(logits, dim=-1) if cfg["moe_router"] == "softmax" else torch.sigmoid(logits)
        choice = s.detach() + self.router.bias
        G = cfg["moe_n_group"]
        if G > 1:  # group-limited: a group's score is its two best choices; the rest of the groups out (-inf)
            gscore = choice.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros(choice.shape[0], G).scatter_(1, topk_lower_index(gscore, cfg["moe_topk_group"]), 1.0)
            keep = keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        idx = topk_lower_index(choice, k)
        w = s.gather(1, idx)
        if cfg["moe_norm_topk"]:
            w = w / w.sum(-1, keepdim=True)
        w = w * cfg["moe_scale"]
        out = torch.zeros_like(xf)
        g, u, d = self.experts.gate, self.experts.up, self.experts.down
        cap = math.ceil(cfg["moe_capacity"] * B * T * k / E) if cfg["moe_capacity"] > 0 else B * T * k
        self.last_dropped = 0
        for e in range(E):  # the loop over experts
            rows, slots = (idx == e).nonzero(as_tuple=True)  # in token order
            self.last_dropped += max(0, rows.numel() - cap)
            rows, slots = rows[:cap], slots[:cap]  # past its capacity an expert drops the rest
            if rows.numel() == 0:
                continue
            xe = xf[rows]
            he = (F.silu(xe @ g[e]) * (xe @ u[e])) @ d[e]
            out.index_add_(0, rows, he * w[rows, slots].unsqueeze(-1))
        if self.shared is not None:
            out = out + self.shared(xf)
        self.last_load = torch.bincount(idx.reshape(-1), minlength=E).to(torch.float32)
        balance = torch.zeros(())
        if cfg["moe_balance_loss"] > 0:
            sp = (s / s.sum(-1, keepdim=True)).reshape(B, T, E)
            P = sp.mean(1)  # (B, E)
            onehot = torch.zeros(B * T, E).scatter_(1, idx, 1.0).reshape(B, T, E)
            f = onehot.sum(1) * (E / (k * T))  # (B, E), no gradient
            balance = cfg["moe_balance_loss"] * (f * P).sum(-1).mean()
        return out.reshape(B, T, C), balance

    @torch.no_grad()
    def update_bias(self):
        g = self.cfg["moe_bias_speed"]
        if g > 0 and self.last_load is not None:
            mean = self.last_load.sum() / self.E
            self.router.bias += g * torch.sign(mean - self.last_load)


class MLA(nn.Module):
    """Multi-head latent attention (docs/model.md): queries through a latent of rank
    mla_q_rank (or directly), keys and values through one of mla_kv_rank; each head's query
    and key a part of mla_nope_dim and a rotary part of mla_rope_dim (the keys' one computed
    once and shared by the heads), values of mla_v_dim; scores scaled by 1/sqrt(nope + rope)."""

    def __init__(self, cfg):
        super().__init__()
        C, H = cfg["n_embd"], cfg["n_head"]
        hs = C // H
        self.H, self.eps, self.theta = H, cfg["norm_eps"], cfg["rope_theta"]
        self.dn = cfg["mla_nope_dim"] or hs
        self.dv = cfg["mla_v_dim"] or hs
        self.dr, self.rq, self.rkv = cfg["mla_rope_dim"], cfg["mla_q_rank"], cfg["mla_kv_rank"]
        D = self.dn + self.dr
        if self.rq > 0:  # registration order = docs/model.md's parameter order
            self.q_a = nn.Linear(C, self.rq, bias=False)
            self.q_norm = gpt_ref.Norm(self.rq, "rmsnorm", self.eps)
            self.q_b = nn.Linear(self.rq, H * D, bias=False)
        else:
            self.q = nn.Linear(C, H * D, bias=False)
        self.kv_a = nn.Linear(C, self.rkv + self.dr, bias=False)
        self.kv_norm = gpt_ref.Norm(self.rkv, "rmsnorm", self.eps)
        self.kv_b = nn.Linear(self.rkv, H * (self.dn + self.dv), bias=False)
        self.proj = nn.Linear(H * self.dv, C, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        H, dn, dr, dv = self.H, self.dn, self.dr, self.dv
        q = self.q_b(self.q_norm(self.q_a(x))) if self.rq > 0 else self.q(x)
        q = q.view(B, T, H, dn + dr).transpose(1, 2)
        ckv = self.kv_a(x)
        kv = self.kv_b(self.kv_norm(ckv[..., :self.rkv])).view(B, T, H, dn + dv).transpose(1, 2)
        cos, sin = gpt_ref.rope_tables(T, dr, self.theta)
        q_pe = gpt_ref.apply_rope(q[..., dn:], cos, sin)
        k_pe = gpt_ref.apply_rope(ckv[..., self.rkv:].unsqueeze(1), cos, sin).expand(B, H, T, dr)
        qq = torch.cat([q[..., :dn], q_pe], dim=-1)
        kk = torch.cat([kv[..., :dn], k_pe], dim=-1)
        v = kv[..., dn:]
        att = (qq @ kk.transpose(-2, -1)) * (1.0 / math.sqrt(dn + dr))
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = (torch.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, H * dv)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        C = cfg["n_embd"]
        self.norm1 = gpt_ref.Norm(C, cfg["norm"], cfg["norm_eps"])
        self.attn = MLA(cfg) if cfg["mla_kv_rank"] > 0 else gpt_ref.Attention(cfg)
        self.norm2 = gpt_ref.Norm(C, cfg["norm"], cfg["norm_eps"])
        self.mlp = MoE(cfg) if moe else gpt_ref.MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        if isinstance(self.mlp, MoE):
            m, bal = self.mlp(self.norm2(x))
            return x + m, bal
        return x + self.mlp(self.norm2(x)), torch.zeros(())


class MoEGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        C, V = cfg["n_embd"], cfg["vocab_size"]
        self.tok_emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([Block(cfg, i >= cfg["n_dense_layers"]) for i in range(cfg["n_layer"])])
        self.norm_f = gpt_ref.Norm(C, cfg["norm"], cfg["norm_eps"])
        self.lm_head = nn.Linear(C, V, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """docs/model.md's init, MoE included, in named_parameters() order."""
        rstd = 0.02 / math.sqrt(2 * self.cfg["n_layer"])
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                resid = name.endswith(("attn.proj.weight", "mlp.down.weight", "experts.down", "shared.down.weight"))
                p.normal_(0.0, rstd if resid else 0.02)
            elif ".norm" in "." + name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.zero_()

    def moe_blocks(self):
        return [b.mlp for b in self.blocks if isinstance(b.mlp, MoE)]

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.tok_emb(idx)
        balance = torch.zeros(())
        for blk in self.blocks:
            x, bal = blk(x)
            balance = balance + bal
        x = self.norm_f(x)
        logits = x @ self.lm_head.weight.t()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T), ignore_index=-1) + balance
        return logits, loss, balance


def moe_config(**kw):
    c = gpt_ref.llama_config(n_layer=2, n_embd=32, block_size=16, vocab_size=64)
    c.update(n_routed_experts=8, n_shared_experts=0, moe_top_k=2, moe_ffn=16, moe_router="softmax",
             moe_norm_topk=True, moe_scale=1.0, n_dense_layers=1, moe_bias_speed=0.01, moe_balance_loss=0.0,
             moe_n_group=1, moe_topk_group=1, moe_capacity=0.0,
             mla_kv_rank=0, mla_q_rank=0, mla_rope_dim=0, mla_nope_dim=0, mla_v_dim=0)
    c.update(kw)
    return c


SEED = 4321


def golden(cfg, B=2, steps=10):
    torch.manual_seed(SEED)
    model = MoEGPT(cfg)
    T = cfg["block_size"]
    idx = torch.randint(0, cfg["vocab_size"], (B, T), dtype=torch.int64)
    targets = torch.randint(0, cfg["vocab_size"], (B, T), dtype=torch.int64)
    targets[B - 1, T // 2] = -1
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    out["input.idx"], out["input.targets"] = idx, targets
    logits, loss, balance = model(idx, targets)
    loss.backward()
    out["out.logits"] = logits.detach().clone()
    out["out.loss"] = loss.detach().clone().reshape(())
    out["out.balance"] = balance.detach().clone().reshape(())
    out["out.dropped"] = torch.tensor([mb.last_dropped for mb in model.moe_blocks()], dtype=torch.float32)
    for name, p in model.named_parameters():
        if p.requires_grad:
            out["grad." + name] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    o = gpt_ref.OPTIM
    opt = gpt_ref.make_optimizer(model, o["lr"], tuple(o["betas"]), o["eps"], o["weight_decay"])
    losses, biases = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _, l, _ = model(idx, targets)
        losses.append(l.item())
        l.backward()
        opt.step()
        for mb in model.moe_blocks():
            mb.update_bias()
        biases.append(torch.stack([mb.router.bias.detach().clone() for mb in model.moe_blocks()]))
    out["out.losses"] = torch.tensor(losses, dtype=torch.float32)
    out["out.router_bias"] = torch.stack(biases)
    meta = {
        "config": json.dumps(cfg, sort_keys=True),
        "train": json.dumps({"batch": B, "T": T, "seed": SEED, "ignored_target": [B - 1, T // 2], "optimizer": o,
                             "bias_update": "after each optimizer step"}, sort_keys=True),
        "torch_version": torch.__version__,
        "generator": "tests/reference/moe_ref.py",
        "param_names": json.dumps([n for n, _ in model.named_parameters()]),
    }
    return out, meta


JOBS = [
    ("golden_moe_softmax.safetensors", moe_config(moe_balance_loss=0.01, moe_capacity=1.0)),
    ("golden_moe_sigmoid.safetensors", moe_config(moe_router="sigmoid", n_shared_experts=1, moe_scale=2.5,
                                                  moe_bias_speed=0.05, moe_top_k=3, moe_n_group=4, moe_topk_group=2)),
    ("golden_moe_mla.safetensors", moe_config(mla_kv_rank=16, mla_q_rank=12, mla_rope_dim=8, mla_nope_dim=8,
                                              mla_v_dim=6, moe_balance_loss=0.01)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for fname, cfg in JOBS:
        tensors, meta = golden(cfg)
        gpt_ref.save_safetensors(os.path.join(a.out, fname), tensors, meta)
        print("%s: loss %.6f balance %.6f dropped %s losses %s bias[-1] %s" % (
            fname, tensors["out.loss"].item(), tensors["out.balance"].item(), tensors["out.dropped"].tolist(),
            " ".join("%.4f" % v for v in tensors["out.losses"].tolist()), tensors["out.router_bias"][-1].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
