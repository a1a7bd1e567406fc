"""kiln serve end to end over real HTTP: every endpoint, OpenAI shapes, streaming,
determinism (alone vs batched, streamed vs not), concurrency, and bad input. Runs the
real server binary on a free loopback port; standard library and curl only.
Oracles: answers of the same server to the same request run alone; /tokenize for
token counts; the OpenAI API reference for shapes and status codes."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import harness as H  # noqa: E402

A = H.args()
RUN = H.model(A.kiln, A.workdir)
NAME = "serve-model"
srv = None  # the main server, started in main()


def completion(body, **kw):
    s, r = H.post(srv.port, "/v1/completions", dict({"model": NAME}, **body), **kw)
    assert s == 200, (s, r)
    return r


def streamed_text(events, chat=False):
    assert events[-1] == "[DONE]", events[-1]
    out = {}
    for e in events[:-1]:
        for c in e["choices"]:
            piece = c["delta"].get("content", "") if chat else c["text"]
            out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return out


def test_health_models_page_metrics():
    s, h, b = H.request(srv.port, "GET", "/health")
    assert s == 200 and json.loads(b) == {"status": "ok"}
    s, h, b = H.request(srv.port, "GET", "/v1/models")
    m = json.loads(b)
    assert s == 200 and m["object"] == "list" and m["data"][0]["id"] == NAME and m["data"][0]["object"] == "model"
    s, h, b = H.request(srv.port, "GET", "/")
    assert s == 200 and h["content-type"].startswith("text/html")
    for ident in (b'id="prompt"', b'id="generate"', b'id="output"', b'id="status"', b'id="messages"', b'id="send"'):
        assert ident in b, ident
    s, h, b = H.request(srv.port, "GET", "/metrics")
    text = b.decode()
    assert s == 200 and h["content-type"].startswith("text/plain")
    for name in ("kiln_requests_total", "kiln_prompt_tokens_total", "kiln_generation_tokens_total", "kiln_queue_depth",
                 "kiln_time_to_first_token_seconds_bucket", "kiln_generation_tokens_per_second"):
        assert name in text, name
    s, h, b = H.request(srv.port, "OPTIONS", "/v1/completions", headers={"Origin": "http://x"})
    assert s == 204 and h["access-control-allow-origin"] == "*" and "POST" in h["access-control-allow-methods"]


def test_tokenize_and_usage():
    s, t = H.post(srv.port, "/tokenize", {"prompt": "And God said"})
    assert s == 200 and t["count"] == len(t["tokens"]) == len("And God said")  # byte tokenizer
    s, d = H.post(srv.port, "/detokenize", {"tokens": t["tokens"]})
    assert s == 200 and d["prompt"] == "And God said"
    r = completion({"prompt": "And God said", "max_tokens": 8, "seed": 1})
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == NAME
    assert isinstance(r["created"], int)
    c = r["choices"][0]
    assert c["index"] == 0 and isinstance(c["text"], str) and c["finish_reason"] in ("length", "stop")
    u = r["usage"]
    assert u["prompt_tokens"] == t["count"] and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 1 <= u["completion_tokens"] <= 8


def test_stream_equals_plain():
    body = {"prompt": "The", "max_tokens": 40, "seed": 5, "temperature": 0.9}
    plain = completion(body)
    ev = H.sse(srv.port, "/v1/completions", dict(body, model=NAME, stream=True, stream_options={"include_usage": True}))
    assert streamed_text(ev) == {0: plain["choices"][0]["text"]}
    assert ev[-2]["choices"] == [] and ev[-2]["usage"] == plain["usage"]
    finals = [c["finish_reason"] for e in ev[:-2] for c in e["choices"] if c["finish_reason"]]
    assert finals == [plain["choices"][0]["finish_reason"]]
    assert all(e["object"] == "text_completion" and e["id"] == ev[0]["id"] for e in ev[:-1])


def test_chat_stream_equals_plain():
    body = {"model": NAME, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi"}],
            "max_tokens": 30, "seed": 3, "temperature": 0.7}
    s, plain = H.post(srv.port, "/v1/chat/completions", body)
    assert s == 200 and plain["object"] == "chat.completion" and plain["id"].startswith("chatcmpl-")
    msg = plain["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    ev = H.sse(srv.port, "/v1/chat/completions", dict(body, stream=True))
    assert ev[0]["object"] == "chat.completion.chunk" and ev[0]["choices"][0]["delta"].get("role") == "assistant"
    assert streamed_text(ev, chat=True) == {0: msg["content"]}
    # the template's stop strings apply: the answer never runs into a new turn
    assert "\nuser:" not in msg["content"]


def test_same_seed_alone_or_batched():
    body = {"prompt": "He said", "max_tokens": 30, "seed": 11, "temperature": 1.0}
    alone = completion(body)["choices"][0]["text"]
    out, errs = {}, []

    def other(i):
        try:
            completion({"prompt": "x" * (3 + 7 * i), "max_tokens": 40, "seed": 100 + i})
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=other, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    time.sleep(0.05)
    out["batched"] = completion(body)["choices"][0]["text"]
    for t in ts:
        t.join(60)
    assert not errs, errs
    assert out["batched"] == alone, (out["batched"], alone)


def test_n_choices_and_seed_offsets():
    one = completion({"prompt": "In", "max_tokens": 12, "seed": 21})["choices"][0]["text"]
    two = completion({"prompt": "In", "max_tokens": 12, "seed": 21, "n": 2})
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["text"] == one
    nxt = completion({"prompt": "In", "max_tokens": 12, "seed": 22})["choices"][0]["text"]
    assert two["choices"][1]["text"] == nxt


def test_stop_sequence_cuts():
    full = completion({"prompt": "The", "max_tokens": 40, "seed": 8})["choices"][0]["text"]
    stop = full[10:12]
    assert len(stop) == 2
    r = completion({"prompt": "The", "max_tokens": 40, "seed": 8, "stop": [stop]})["choices"][0]
    assert r["text"] == full[:full.index(stop)] and r["finish_reason"] == "stop", (r, full, stop)
    ev = H.sse(srv.port, "/v1/completions", {"model": NAME, "prompt": "The", "max_tokens": 40, "seed": 8,
                                             "stop": stop, "stream": True})
    assert streamed_text(ev) == {0: r["text"]}


def test_logprobs_shape():
    r = completion({"prompt": "The", "max_tokens": 6, "seed": 2, "logprobs": 2})
    lp = r["choices"][0]["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    s, c = H.post(srv.port, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "a"}],
                                                     "max_tokens": 4, "logprobs": True, "top_logprobs": 1, "seed": 1})
    content = c["choices"][0]["logprobs"]["content"]
    assert s == 200 and all("token" in t and t["logprob"] <= 0 and len(t["top_logprobs"]) == 1 for t in content)


def test_32_concurrent_clients():
    bodies = [{"prompt": f"Line {i}:", "max_tokens": 24, "seed": 1000 + i, "temperature": 0.8} for i in range(32)]
    want = [completion(b)["choices"][0]["text"] for b in bodies]
    got, errs = [None] * 32, []

    def client(i):
        try:
            if i % 2:
                got[i] = streamed_text(H.sse(srv.port, "/v1/completions", dict(bodies[i], model=NAME, stream=True)))[0]
            else:
                got[i] = completion(bodies[i])["choices"][0]["text"]
        except Exception as e:  # noqa: BLE001
            errs.append((i, repr(e)))

    ts = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs, errs
    assert got == want, [i for i in range(32) if got[i] != want[i]]


def error_of(status, resp, want_status, param=None, code=None):
    assert status == want_status, (status, resp)
    e = resp["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    if param is not None:
        assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e


def test_bad_input():
    p = srv.port
    s, h, b = H.request(p, "POST", "/v1/completions", raw=b'{"prompt": "x", ')
    error_of(s, json.loads(b), 400)
    error_of(*H.post(p, "/v1/completions", {"prompt": "x", "max_tokens": "ten"}), 400, "max_tokens")
    error_of(*H.post(p, "/v1/completions", {"prompt": "x", "max_tokens": -3}), 400, "max_tokens")
    error_of(*H.post(p, "/v1/completions", {"prompt": "x", "max_tokens": 10 ** 9}), 400, "max_tokens")
    error_of(*H.post(p, "/v1/completions", {"prompt": "x", "max_tokens": 5000}), 400, "max_tokens",
             "context_length_exceeded")
    error_of(*H.post(p, "/v1/completions", {"prompt": 5}), 400, "prompt")
    error_of(*H.post(p, "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400, "temperature")
    error_of(*H.post(p, "/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    error_of(*H.post(p, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model", "model_not_found")
    s, h, b = H.request(p, "POST", "/v1/completions", raw=b'{"prompt":"x"}', headers={"Content-Type": "text/plain"})
    error_of(s, json.loads(b), 415)
    s, h, b = H.request(p, "POST", "/v1/completions", raw=b'{"prompt":"' + b"x" * 70000 + b'"}')
    error_of(s, json.loads(b), 413)
    s, h, b = H.request(p, "GET", "/v1/nothing")
    error_of(s, json.loads(b), 404)
    # a path that decodes to bytes that are not UTF-8 is a 404 too (its message quotes it as '?')
    s, h, b = H.request(p, "GET", "/v1/%ff%c3b")
    error_of(s, json.loads(b), 404)
    assert "/v1/??b" in json.loads(b)["error"]["message"], b
    s, h, b = H.request(p, "GET", "/v1/completions")
    error_of(s, json.loads(b), 405)
    s, h, b = H.request(p, "POST", "/detokenize", {"tokens": [1, 99999]})
    error_of(s, json.loads(b), 400, "tokens")
    # the server still answers after all that
    assert completion({"prompt": "ok", "max_tokens": 2})["choices"]


def test_slow_headers_are_dropped_and_others_served():
    sk = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    for ch in b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le":
        sk.send(bytes([ch]))
        time.sleep(0.005)
    # it stalls now; others are served meanwhile
    t0 = time.time()
    assert completion({"prompt": "meanwhile", "max_tokens": 4})["choices"]
    assert H.request(srv.port, "GET", "/health")[0] == 200
    # and the server drops it after its idle timeout (2 s here)
    sk.settimeout(15)
    try:
        data = sk.recv(100)
    except (ConnectionResetError, socket.timeout) as e:
        data = repr(e).encode()
    assert data == b"" or b"Reset" in data, data
    assert time.time() - t0 < 14
    sk.close()


def test_disconnect_mid_stream_frees_the_slot():
    before = H.metric(srv.port, "kiln_generation_tokens_total")
    sk = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    # 16 choices of 100 tokens: far more work than the few tokens made before the close is seen
    body = json.dumps({"model": NAME, "prompt": "Long", "max_tokens": 100, "stream": True, "seed": 4,
                       "n": 16}).encode()
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: " not in got:
        got += sk.recv(4096)
    sk.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    sk.close()
    deadline = time.time() + 10
    while time.time() < deadline and H.metric(srv.port, "kiln_running_requests") != 0:
        time.sleep(0.05)
    assert H.metric(srv.port, "kiln_running_requests") == 0
    assert H.metric(srv.port, "kiln_kv_blocks_free") == H.metric(srv.port, "kiln_kv_blocks_total")
    made = H.metric(srv.port, "kiln_generation_tokens_total") - before
    assert made < 0.75 * 1600, f"{made} tokens were generated for a client that left"
    print(f"  tokens made for the client that left: {made:.0f} of 1600")
    assert completion({"prompt": "after", "max_tokens": 3})["choices"]


def test_curl():
    if not shutil.which("curl"):
        raise AssertionError("curl is not installed (scripts/install-test-deps.sh)")
    url = f"http://127.0.0.1:{srv.port}/v1/completions"
    body = json.dumps({"model": NAME, "prompt": "The", "max_tokens": 10, "seed": 9})
    out = subprocess.run(["curl", "-sS", url, "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    plain = json.loads(out)["choices"][0]["text"]
    body = json.dumps({"model": NAME, "prompt": "The", "max_tokens": 10, "seed": 9, "stream": True})
    out = subprocess.run(["curl", "-sS", "-N", url, "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = [x[6:] for x in out.split("\n\n") if x.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == plain


def test_api_key():
    with H.Server(A.kiln, RUN, "--api-key", "sesame") as k:
        body = {"prompt": "x", "max_tokens": 2}
        error_of(*H.post(k.port, "/v1/completions", body), 401)
        error_of(*H.post(k.port, "/v1/completions", body, headers={"Authorization": "Bearer nope"}), 401)
        s, r = H.post(k.port, "/v1/completions", body, headers={"Authorization": "Bearer sesame"})
        assert s == 200, r
        assert H.request(k.port, "GET", "/health")[0] == 200


def test_props_show_the_template_chat_renders_with():
    """GET /v1/kiln/props: the template as its JSON (a --chat-template with roles and a
    prefix), and an example prompt that is what chat prompts the model with: as many
    tokens as the chat request for the same messages counts."""
    mistral = {"prefix": "<s>", "message": "[INST] {content} [/INST]", "roles": {"assistant": "{content}</s>"},
               "generation": "", "stop": ["</s>"]}
    with H.Server(A.kiln, RUN, "--chat-template", "mistral", "--api-key", "sesame") as k:
        assert H.request(k.port, "GET", "/v1/kiln/props")[0] == 401
        auth = {"Authorization": "Bearer sesame"}
        s, h, b = H.request(k.port, "GET", "/v1/kiln/props", headers=auth)
        p = json.loads(b)
        assert s == 200 and p["model"] == NAME and p["max_model_len"] == 128 and p["max_tokens_default"] == 16, p
        assert p["chat_template"] == mistral, p["chat_template"]
        ex = p["chat_template_example"]
        want = "<s>" + "".join((mistral["roles"].get(m["role"], mistral["message"])).replace("{content}", m["content"])
                               for m in ex["messages"])
        assert ex["prompt"] == want, ex
        s, t = H.post(k.port, "/tokenize", {"prompt": ex["prompt"]}, headers=auth)
        s, r = H.post(k.port, "/v1/chat/completions", {"messages": ex["messages"], "max_tokens": 1}, headers=auth)
        assert s == 200 and r["usage"]["prompt_tokens"] == t["count"], (r, t)
        assert H.metric(k.port, 'kiln_requests_total{endpoint="/v1/kiln/props",code="200"}') == 1


def test_queue_full_gives_429():
    with H.Server(A.kiln, RUN, "--max-queue", "1", "--max-batch", "1") as q:
        res = []

        def client():
            try:
                s, h, b = H.request(q.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 100})
                res.append((s, h.get("retry-after")))
            except Exception as e:  # noqa: BLE001
                res.append((repr(e), None))

        ts = [threading.Thread(target=client) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        codes = sorted(s for s, _ in res)
        assert 200 in codes and 429 in codes, codes
        assert all(ra == "1" for s, ra in res if s == 429)
        assert set(codes) <= {200, 429}, codes


def main():
    global srv
    with H.Server(A.kiln, RUN, "--max-body", "65536", "--idle-timeout", "2",
                  log=os.path.join(A.workdir, "serve-http.log")) as s:
        srv = s
        rc = H.run_tests([
            test_health_models_page_metrics, test_tokenize_and_usage, test_stream_equals_plain,
            test_chat_stream_equals_plain, test_same_seed_alone_or_batched, test_n_choices_and_seed_offsets,
            test_stop_sequence_cuts, test_logprobs_shape, test_32_concurrent_clients, test_bad_input,
            test_slow_headers_are_dropped_and_others_served, test_disconnect_mid_stream_frees_the_slot, test_curl,
            test_api_key, test_props_show_the_template_chat_renders_with, test_queue_full_gives_429])
        code = s.stop()
        if code != 0:
            print(f"kiln serve exited with {code} on SIGTERM")
            rc = 1
    sys.exit(rc)


if __name__ == "__main__":
    main()
