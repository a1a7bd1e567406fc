#!/usr/bin/python3
"""Draws several kiln runs' losses on one SVG chart: each run's training loss (thin) and
validation loss (points joined), read from RUN_DIR/metrics.jsonl. Standard library only.

    python3 bench/plot_runs.py OUT.svg LABEL=RUN_DIR [LABEL=RUN_DIR ...]
"""
import json
import sys

W, H, L, R, T, B = 760, 420, 60, 150, 30, 40
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def load(run):
    rows = [json.loads(x) for x in open(run + "/metrics.jsonl") if x.strip()]
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    return train, val


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    runs = [(a.split("=", 1)[0], load(a.split("=", 1)[1])) for a in sys.argv[2:]]
    pts = [p for _, (t, v) in runs for p in t + v]
    x1 = max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    sx = lambda x: L + (W - L - R) * x / x1
    sy = lambda y: T + (H - T - B) * (y1 - y) / (y1 - y0)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="18">loss by step</text>']
    for k in range(6):
        y = y0 + (y1 - y0) * k / 5
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#ddd"/>'
                   f'<text x="{L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
    for k in range(6):
        x = x1 * k / 5
        out.append(f'<text x="{sx(x):.1f}" y="{H - B + 16}" text-anchor="middle">{x:.0f}</text>')
    for i, (label, (train, val)) in enumerate(runs):
        c = COLORS[i % len(COLORS)]
        line = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in train)
        out.append(f'<polyline points="{line}" fill="none" stroke="{c}" stroke-width="0.8" opacity="0.6"/>')
        vline = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in val)
        out.append(f'<polyline points="{vline}" fill="none" stroke="{c}" stroke-width="2"/>')
        out += [f'<circle cx="{sx(s):.1f}" cy="{sy(v):.1f}" r="3" fill="{c}"/>' for s, v in val]
        out.append(f'<text x="{W - R + 10}" y="{T + 20 * i + 10}" fill="{c}">{label} (val: thick)</text>')
    out.append("</svg>")
    open(sys.argv[1], "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
