"""The benchmark scripts' summary: JSON lines of a run, and each engine's best thread count."""
import json
import statistics


def rows_of(path):
    """The JSON lines of a benchmark's output file (other lines skipped)."""
    return [json.loads(line) for line in open(path) if line.startswith("{")]


def best(rows, pred, key="tokens_per_s"):
    """Of the rows pred accepts, the median of key by thread count: (best threads, its
    median, every thread count's median)."""
    by = {}
    for r in rows:
        if pred(r):
            by.setdefault(r["threads"], []).append(r[key])
    med = {t: statistics.median(v) for t, v in by.items()}
    t = max(med, key=med.get)
    return t, med[t], med
