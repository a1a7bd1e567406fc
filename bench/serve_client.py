"""N concurrent streaming clients against a running kiln serve (or another
OpenAI-compatible server: --peer names it, --extra adds fields to each request), each asking for the
same prompt length and number of new tokens (seeds differ). Prints one JSON line:
median time to first token, median per-stream decode tokens/s (after the first token)
and total generated tokens/s over the wall time of the whole round.

All N connections are driven from one thread through a selector (non-blocking
sockets, HTTP/1.1 chunked responses parsed here), so that the measuring side costs
the 2-core machine one thread, whatever N: a thread per client made N Python threads
fight over the GIL and the cores for every token the server sent.

  python3 bench/serve_client.py --port PORT --clients 16 [--prompt-len 64] [--tokens 128]
"""
import argparse
import json
import selectors
import socket
import statistics
import time


class Stream:
    """One request: sends it, then undoes the chunked encoding and splits the SSE events."""

    def __init__(self, port, body):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setblocking(False)
        data = json.dumps(body).encode()
        self.out = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(data)) + data
        self.raw, self.body, self.headers_done = b"", b"", False
        self.start, self.first, self.end, self.tokens, self.done = time.perf_counter(), None, None, 0, False
        self.usage, self.chunks = None, 0

    def on_read(self, now):
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return
        if not chunk:
            self.finish(now)
            return
        self.raw += chunk
        if not self.headers_done:
            if b"\r\n\r\n" not in self.raw:
                return
            head, self.raw = self.raw.split(b"\r\n\r\n", 1)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError("server answered " + head.split(b"\r\n")[0].decode())
            self.headers_done = True
        last = False
        while not last:  # chunked transfer coding: size in hex, CRLF, data, CRLF; size 0 ends
            nl = self.raw.find(b"\r\n")
            if nl < 0:
                break
            size = int(self.raw[:nl].split(b";")[0], 16)
            if len(self.raw) < nl + 2 + size + 2:
                break
            self.body += self.raw[nl + 2:nl + 2 + size]
            self.raw = self.raw[nl + 2 + size + 2:]
            last = size == 0
        while b"\n\n" in self.body:
            ev, self.body = self.body.split(b"\n\n", 1)
            d = ev[6:]
            if d == b"[DONE]":
                continue
            j = json.loads(d)
            if j.get("usage"):
                self.usage = j["usage"]["completion_tokens"]
            elif j.get("choices") and j["choices"][0].get("text"):
                self.chunks += 1  # a token a chunk, for a server that reports no usage
                if self.first is None:
                    self.first = now
        if last:
            self.finish(now)

    def finish(self, now):
        self.end, self.done = now, True
        self.tokens = self.usage if self.usage is not None else self.chunks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--model", default=None)
    p.add_argument("--peer", default="kiln", help="the name printed for the server")
    p.add_argument("--extra", default="{}", help="JSON fields added to each request")
    a = p.parse_args()
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(a.prompt_len))  # byte tokenizer: one token each
    sel = selectors.DefaultSelector()
    streams = []
    for i in range(a.clients):
        body = {"prompt": prompt, "max_tokens": a.tokens, "temperature": 0.8, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}}
        if a.model:
            body["model"] = a.model
        body.update(json.loads(a.extra))
        s = Stream(a.port, body)
        streams.append(s)
        sel.register(s.sock, selectors.EVENT_WRITE, s)
    live = len(streams)
    while live:
        for key, ev in sel.select(timeout=600):
            s, now = key.data, time.perf_counter()
            if ev & selectors.EVENT_WRITE:
                n = s.sock.send(s.out)
                s.out = s.out[n:]
                if not s.out:
                    sel.modify(s.sock, selectors.EVENT_READ, s)
                continue
            s.on_read(now)
            if s.done:
                sel.unregister(s.sock)
                s.sock.close()
                live -= 1
    wall = max(s.end for s in streams) - min(s.start for s in streams)
    total = sum(s.tokens for s in streams)
    print(json.dumps({"peer": a.peer, "clients": a.clients, "prompt_len": a.prompt_len, "tokens": a.tokens,
                      "ttft_ms": 1e3 * statistics.median((s.first or s.end) - s.start for s in streams),
                      "decode_tok_s": statistics.median((s.tokens - 1) / max(s.end - (s.first or s.end), 1e-9)
                                                        for s in streams),
                      "total_tok_s": total / wall, "generated": total}))


if __name__ == "__main__":
    main()
