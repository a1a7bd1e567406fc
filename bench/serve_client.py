"""N concurrent streaming clients against a running kiln serve, each asking for the
same prompt length and number of new tokens (seeds differ). Prints one JSON line:
median time to first token, median per-stream decode tokens/s (after the first token)
and total generated tokens/s over the wall time of the whole round.

  python3 bench/serve_client.py --port PORT --clients 16 [--prompt-len 64] [--tokens 128]
"""
import argparse
import http.client
import json
import statistics
import threading
import time


def one(port, body, out, i):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    t_first, usage, buf = None, None, b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            d = ev[6:]
            if d == b"[DONE]":
                continue
            j = json.loads(d)
            if j.get("usage"):
                usage = j["usage"]
            elif t_first is None and j["choices"] and j["choices"][0]["text"]:
                t_first = time.perf_counter()
    t_end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    out[i] = {"start": t0, "first": t_first or t_end, "end": t_end, "tokens": n}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--model", default=None)
    a = p.parse_args()
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(a.prompt_len))  # byte tokenizer: one token each
    out = [None] * a.clients
    ts = []
    for i in range(a.clients):
        body = {"prompt": prompt, "max_tokens": a.tokens, "temperature": 0.8, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}}
        if a.model:
            body["model"] = a.model
        ts.append(threading.Thread(target=one, args=(a.port, body, out, i)))
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = max(o["end"] for o in out) - min(o["start"] for o in out)
    total = sum(o["tokens"] for o in out)
    print(json.dumps({"peer": "kiln", "clients": a.clients, "prompt_len": a.prompt_len, "tokens": a.tokens,
                      "ttft_ms": 1e3 * statistics.median(o["first"] - o["start"] for o in out),
                      "decode_tok_s": statistics.median((o["tokens"] - 1) / max(o["end"] - o["first"], 1e-9) for o in out),
                      "total_tok_s": total / wall, "generated": total}))


if __name__ == "__main__":
    main()
