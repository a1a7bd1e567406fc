"""The page at / in headless Chromium (Debian's `chromium`), driven over the DevTools
protocol, against a real `kiln serve`. Each feature is exercised the way a user would
(typing, clicking) and checked against the server's own answers as the oracle:

  completion   the output streams in and equals the non-streamed answer (same seed)
  chat         two turns; both show in the list, each answer equals the server's
               non-streamed chat answer for the same messages and seed; tokens/s shown
  history      the conversation survives a reload (localStorage); new chat, delete
  seed         with the seed field empty each request gets a new random seed, shown,
               and typing it reproduces the answer
  stop         Stop mid-stream (the network throttled so that the stream is slow)
               leaves a prefix of the full answer and the status reads "stopped"
  clamp        max tokens past the context is clamped (chat and completion), with a note
  markdown     the renderer turns a fenced block into <pre><code>, escapes <script>,
               makes only http(s) links
  template     the panel shows GET /v1/kiln/props's template and rendered example
  api key      against a server with --api-key: the key field appears after a 401,
               a message that failed is handed back; a wrong key is refused, and
               with the right one typed the page works (and remembers it)

Screenshots of both modes are saved in the workdir and checked to be real, non-blank
PNGs. Exits 77 (skip) when chromium or python3-websocket is missing."""
import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(__file__))
import harness as H  # noqa: E402

A = H.args()
CHROME = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    import websocket
except ImportError:
    websocket = None
if not CHROME or websocket is None:
    print("skip: needs chromium and python3-websocket (run scripts/install-test-deps.sh)")
    sys.exit(H.SKIP)

RUN = H.model(A.kiln, A.workdir)
NAME = os.path.basename(RUN)
KEY = "page-test-key"
SHOTS = {m: os.path.join(A.workdir, f"serve-page-{m}.png") for m in ("completion", "chat")}


class Page:
    """One tab over the DevTools protocol."""

    def __init__(self, ws_url):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.n = 0

    def call(self, method, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            m = json.loads(self.ws.recv())
            if m.get("id") == self.n:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})

    def js(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr, what, timeout=60):
        """Polls expr until it is truthy; its value."""
        deadline, v = time.time() + timeout, None
        while time.time() < deadline:
            try:
                v = self.js(expr)
            except RuntimeError:  # a navigation tore the context down under us: not yet
                v = None
            if v:
                return v
            time.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what} (last: {v!r})")

    def set(self, **fields):
        self.js(";".join(f"document.getElementById({k!r}).value = {json.dumps(v)}" for k, v in fields.items()) + ";true")

    def type(self, id, text):
        """Types into a field through input events, as a user would."""
        self.js(f"document.getElementById({id!r}).focus(); true")
        self.call("Input.insertText", text=text)

    def click(self, id):
        self.js(f"document.getElementById({id!r}).click(); true")

    def text(self, id):
        return self.js(f"document.getElementById({id!r}).textContent")

    def state(self):
        return self.js("document.getElementById('status').dataset.state || ''")

    def finish(self, timeout=120):
        """Waits for the request under way to end; its status line."""
        self.wait("['done', 'error', 'stopped'].includes(document.getElementById('status').dataset.state)",
                  "the request to end", timeout)
        return self.text("status")

    def load(self, port, ready="document.getElementById('model').textContent === " + json.dumps(NAME)):
        self.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
        self.wait(f"document.readyState === 'complete' && ({ready})", "the page to load and name the model")

    def chats(self):
        return self.js("JSON.parse(localStorage.getItem('kiln.chats') || '[]')")

    def shot(self, path):
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        with open(path, "wb") as f:
            f.write(data)
        print(f"  screenshot: {path} ({len(data)} bytes)")


def png_pixels(path):
    """(width, height, distinct colors, share of the commonest color) of an 8-bit RGB(A)
    PNG, decoded with the standard library (IDAT inflated, rows unfiltered)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    pos, idat, w = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), f"{path}: depth {depth}, color type {ctype}"
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride, prev, counts = w * bpp, bytearray(w * bpp), {}
    for y in range(h):
        f, row = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = row[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                row[i] = (row[i] + a) & 255
            elif f == 2:
                row[i] = (row[i] + b) & 255
            elif f == 3:
                row[i] = (row[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y % 4 == 0:  # every fourth row is plenty to tell a page from a blank
            for x in range(0, stride, bpp * 2):
                k = bytes(row[x:x + 3])
                counts[k] = counts.get(k, 0) + 1
        prev = row
    return w, h, len(counts), max(counts.values()) / sum(counts.values())


def oracle_chat(port, messages, seed, **extra):
    s, j = H.post(port, "/v1/chat/completions", {"messages": messages, "seed": seed, "temperature": 0.8, "top_p": 1,
                                                  **extra})
    assert s == 200, (s, j)
    return j["choices"][0]["message"]["content"]


def test_completion_streams_and_matches_the_server(port, page):
    page.load(port)
    page.click("tab-completion")
    page.set(prompt="And God said", max_tokens="60", temperature="0.8", seed="3")
    page.type("prompt", ",")
    page.click("generate")
    seen_streaming, lengths = False, []
    deadline = time.time() + 60
    while time.time() < deadline:
        st, out = page.js("[document.getElementById('status').dataset.state, "
                          "document.getElementById('output').textContent]")
        seen_streaming |= st == "streaming"
        lengths.append(len(out))
        if st in ("done", "error"):
            break
        time.sleep(0.002)
    assert st == "done", page.text("status")
    assert seen_streaming, "the status never read 'streaming'"
    out = page.text("output")
    s, want = H.post(port, "/v1/completions", {"prompt": "And God said,", "max_tokens": 60, "temperature": 0.8,
                                                "seed": 3})
    assert s == 200
    assert out == "And God said," + want["choices"][0]["text"], (out, want)
    assert "tok/s" in page.text("tps") and page.text("seed-used") == "seed 3", (page.text("tps"), page.text("seed-used"))
    print(f"  output lengths seen while streaming: {len(set(lengths))} distinct")
    page.shot(SHOTS["completion"])


def test_random_seed_by_default_and_reproducible(port, page):
    page.load(port)
    page.click("tab-completion")
    page.set(prompt="The", max_tokens="12", seed="")
    seeds, outs = [], []
    for _ in range(2):
        page.click("generate")
        assert page.finish().startswith("done"), page.text("status")
        seeds.append(int(page.text("seed-used").split()[1]))
        outs.append(page.text("output"))
    assert seeds[0] != seeds[1], f"two requests with no seed typed got the same seed {seeds}"
    s, want = H.post(port, "/v1/completions", {"prompt": "The", "max_tokens": 12, "temperature": 0.8, "seed": seeds[1]})
    assert outs[1] == "The" + want["choices"][0]["text"], "the seed shown does not reproduce the answer"
    print(f"  seeds {seeds}")


def test_chat_two_turns_match_the_server(port, page):
    page.load(port)
    page.click("tab-chat")
    page.click("new-chat")
    page.set(max_tokens="24", seed="", temperature="0.8", top_p="1")
    turns = ["Hi there", "And then?"]
    for t in turns:
        page.type("chat-input", t)
        page.click("send")
        st = page.finish()
        assert st.startswith("done"), st
        tps = page.text("tps")
        assert " tok/s" in tps and float(tps.split(" · ")[1].split()[0]) > 0, tps
    c = page.chats()[0]
    msgs = [(m["role"], m["content"]) for m in c["messages"]]
    assert [m[0] for m in msgs] == ["user", "assistant", "user", "assistant"], msgs
    assert [msgs[0][1], msgs[2][1]] == turns
    a1, a2 = c["messages"][1], c["messages"][3]
    assert a1["seed"] != a2["seed"]
    want1 = oracle_chat(port, [{"role": "user", "content": turns[0]}], a1["seed"], max_tokens=24)
    want2 = oracle_chat(port, [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": want1},
                               {"role": "user", "content": turns[1]}], a2["seed"], max_tokens=24)
    assert (a1["content"], a2["content"]) == (want1, want2), ((a1["content"], a2["content"]), (want1, want2))
    shown = page.js("[...document.querySelectorAll('#messages .msg')].map(d => [d.className, "
                    "d.querySelector('.body').innerText])")
    norm = lambda s: " ".join(s.split())  # noqa: E731 (markdown sets a paragraph's lines apart with <br>)
    assert [(k, norm(t)) for k, t in shown] == [("msg " + r, norm(t)) for r, t in msgs], (shown, msgs)
    assert page.text("chats").startswith(turns[0]), page.text("chats")
    page.js("document.getElementById('template-panel').open = true; true")
    page.shot(SHOTS["chat"])
    page.js("document.getElementById('template-panel').open = false; true")


def test_history_survives_a_reload(port, page):
    page.load(port)
    page.click("tab-chat")
    before = page.chats()
    assert before and len(before[0]["messages"]) == 4, before
    page.load(port)
    n = page.wait("document.querySelectorAll('#messages .msg').length", "the conversation to be drawn again")
    assert n == 4, n
    assert page.js("document.querySelector('#chats li.on .t').textContent") == before[0]["title"]
    # A system prompt is kept per conversation; a new chat starts empty; delete removes one.
    page.click("new-chat")
    page.type("system", "Be brief.")
    page.load(port)
    assert page.js("document.getElementById('system').value") == "Be brief."
    assert len(page.chats()) == len(before) + 1
    page.js("document.querySelector('#chats li.on .del').click(); true")
    assert len(page.chats()) == len(before)
    assert page.js("document.querySelectorAll('#messages .msg').length") == 4, "deleting did not go back to a chat"


def test_stop_leaves_a_partial_answer(port, page):
    page.load(port)
    page.click("tab-chat")
    page.click("new-chat")
    page.set(max_tokens="", seed="11")
    # A slow line, so that the stream is still running when Stop is clicked whatever
    # the model's speed: a chunk is ~200 bytes, so about five a second.
    page.call("Network.enable")
    page.call("Network.emulateNetworkConditions", offline=False, latency=0, downloadThroughput=1000,
              uploadThroughput=-1)
    try:
        page.type("chat-input", "Tell me a long story")
        page.click("send")
        page.wait("document.getElementById('status').dataset.state === 'streaming' && "
                  "document.querySelector('#messages .msg.assistant:last-child .body').textContent.length > 0",
                  "the first chunk")
        live = page.text("tps")
        page.click("chat-stop")
        st = page.finish()
    finally:
        page.call("Network.emulateNetworkConditions", offline=False, latency=0, downloadThroughput=-1,
                  uploadThroughput=-1)
        page.call("Network.disable")
    assert st.startswith("stopped"), st
    assert "tok/s" in live, f"no tokens/s while streaming: {live!r}"
    a = page.chats()[0]["messages"][-1]
    assert a["role"] == "assistant" and a.get("stopped"), a
    full = oracle_chat(port, [{"role": "user", "content": "Tell me a long story"}], 11)
    assert a["content"] and full.startswith(a["content"]) and len(a["content"]) < len(full), (a["content"], full)
    assert "stopped" in page.js("document.querySelector('#messages .msg.assistant:last-child .meta').textContent")
    print(f"  stopped after {len(a['content'])} of {len(full)} characters")


def test_max_tokens_is_clamped_to_the_context(port, page):
    page.load(port)
    ctx = page.js("kiln.server.ctx")
    # Chat: the server's context_length_exceeded names the prompt's size; the page retries.
    page.click("tab-chat")
    page.click("new-chat")
    page.set(max_tokens=str(ctx * 10), seed="5")
    page.type("chat-input", "Go on")
    page.click("send")
    st = page.finish()
    assert st.startswith("done"), st
    assert "clamped" in page.text("note"), page.text("note")
    # Completion: /tokenize counts the prompt first.
    page.click("tab-completion")
    page.set(prompt="In the beginning", max_tokens=str(ctx * 10), seed="5")
    page.click("generate")
    st = page.finish()
    assert st.startswith("done"), st
    s, t = H.post(port, "/tokenize", {"prompt": "In the beginning"})
    room = ctx - t["count"]
    assert f"to {room} " in page.text("note"), (page.text("note"), room)
    print(f"  notes: {page.text('note')!r}")


MD = ("# Title\n\nSome **bold**, *italic* and `inline <b>` code.\n\n```python\nprint('<script>alert(1)</script>')\n```\n\n"
      "- one\n- two\n\n1. first\n2. second\n\n[ok](https://example.org/a_b_) [bad](javascript:alert(1)) "
      "<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\">")


def test_markdown_renders_safely(port, page):
    page.load(port)
    r = page.js(f"""(() => {{
        const d = document.createElement('div'); d.innerHTML = kiln.markdown({json.dumps(MD)});
        document.body.appendChild(d);
        const code = d.querySelector('pre code'), a = [...d.querySelectorAll('a')];
        const r = {{h1: d.querySelector('h1') && d.querySelector('h1').textContent,
            strong: d.querySelector('strong') && d.querySelector('strong').textContent,
            em: d.querySelector('em') && d.querySelector('em').textContent,
            inline: d.querySelector('p code') && d.querySelector('p code').textContent,
            code: code && code.textContent, lang: d.querySelector('.codeblock .lang') && d.querySelector('.codeblock .lang').textContent,
            ul: d.querySelectorAll('ul > li').length, ol: d.querySelectorAll('ol > li').length,
            links: a.map(x => [x.getAttribute('href'), x.rel]), scripts: d.querySelectorAll('script, img').length,
            text: d.textContent}};
        d.remove(); return r; }})()""")
    assert r["h1"] == "Title" and r["strong"] == "bold" and r["em"] == "italic", r
    assert r["inline"] == "inline <b>", r
    assert r["code"] == "print('<script>alert(1)</script>')" and r["lang"] == "python", r
    assert r["ul"] == 2 and r["ol"] == 2, r
    assert r["links"] == [["https://example.org/a_b_", "noopener noreferrer"]], r["links"]
    assert r["scripts"] == 0 and "<script>window.pwned = 1</script>" in r["text"], r
    time.sleep(0.2)
    assert page.js("window.pwned === undefined"), "markup in the text ran"


def test_template_panel_shows_the_servers_template(port, page):
    s, h, b = H.request(port, "GET", "/v1/kiln/props")
    assert s == 200, (s, b)
    props = json.loads(b)
    t = props["chat_template"]
    assert t["message"] == "{role}: {content}\n" and t["generation"] == "assistant:", t
    # The example is the template applied to the example messages, as chat renders them.
    want = t["prefix"] + "".join(t.get("roles", {}).get(m["role"], t["message"]).replace("{role}", m["role"])
                                 .replace("{content}", m["content"]) for m in props["chat_template_example"]["messages"])
    assert props["chat_template_example"]["prompt"] == want + t["generation"], props
    page.load(port)
    page.click("tab-chat")
    page.js("document.getElementById('template-panel').open = true; true")
    shown = page.wait("document.getElementById('template-json').textContent.startsWith('{') && "
                      "document.getElementById('template-json').textContent", "the template")
    assert json.loads(shown) == t, shown
    assert page.text("template-example") == props["chat_template_example"]["prompt"]
    assert page.js("document.getElementById('template-json').getBoundingClientRect().height") > 0


def test_api_key_flow(page, log):
    with H.Server(A.kiln, RUN, "--api-key", KEY, log=log) as s:
        for path in ("/v1/models", "/v1/kiln/props"):
            st, h, b = H.request(s.port, "GET", path)
            assert st == 401 and h.get("www-authenticate") == "Bearer", (path, st)
        page.load(s.port, ready="document.getElementById('key-row').classList.contains('on')")
        assert page.text("model") != NAME
        # A message sent without the key fails, and is handed back to be sent again.
        page.click("tab-chat")
        page.click("new-chat")
        page.set(max_tokens="8", seed="")
        page.type("chat-input", "Hello")
        page.click("send")
        assert page.finish().startswith("error"), page.text("status")
        assert page.js("document.getElementById('chat-input').value") == "Hello"
        assert page.chats()[0]["messages"] == [] and not page.js("document.querySelector('#messages .msg')")
        page.type("api-key", "wrong")
        page.click("key-save")
        page.wait("document.getElementById('key-msg').textContent.includes('refused')", "a wrong key to be refused")
        page.type("api-key", KEY)
        page.click("key-save")
        page.wait(f"document.getElementById('model').textContent === {json.dumps(NAME)}", "the model after the key")
        assert not page.js("document.getElementById('key-row').classList.contains('on')")
        page.click("send")
        assert page.finish().startswith("done"), page.text("status")
        assert [m["role"] for m in page.chats()[0]["messages"]] == ["user", "assistant"]
        assert page.js("document.getElementById('template-json').textContent.startsWith('{')")
        page.load(s.port)  # the key is remembered
        assert not page.js("document.getElementById('key-row').classList.contains('on')")


def test_screenshots_are_real_images():
    for mode, path in SHOTS.items():
        w, h, colors, top = png_pixels(path)
        print(f"  {mode}: {w}x{h}, {os.path.getsize(path)} bytes, {colors} colors, commonest {top:.0%}")
        assert w >= 600 and h >= 400, (w, h)
        assert os.path.getsize(path) > 5000, "too small to hold a page"
        assert colors >= 8 and top < 0.97, f"{path} looks blank"


def main():
    profile = tempfile.mkdtemp(prefix="kiln-chromium-")
    chrome = None
    rc = 1
    for p in SHOTS.values():
        if os.path.exists(p):
            os.remove(p)
    try:
        with H.Server(A.kiln, RUN, log=os.path.join(A.workdir, "serve-page.log")) as s:
            chrome = subprocess.Popen([CHROME, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                       "--remote-debugging-port=0", "--remote-allow-origins=*",
                                       f"--user-data-dir={profile}", "--window-size=1100,760", "about:blank"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            port_file = os.path.join(profile, "DevToolsActivePort")
            deadline = time.time() + 60
            while time.time() < deadline and not os.path.exists(port_file):
                time.sleep(0.1)
            if not os.path.exists(port_file):
                raise RuntimeError("chromium did not start its DevTools server")
            time.sleep(0.2)
            dport = int(open(port_file).read().split()[0])
            st, hd, body = H.request(dport, "GET", "/json/list")
            tab = next(t for t in json.loads(body) if t.get("type") == "page")
            page = Page(tab["webSocketDebuggerUrl"])
            page.call("Page.enable")
            p = s.port

            def named(f, *a):
                g = lambda: f(*a)  # noqa: E731
                g.__name__ = f.__name__
                return g
            rc = H.run_tests([
                named(test_completion_streams_and_matches_the_server, p, page),
                named(test_random_seed_by_default_and_reproducible, p, page),
                named(test_chat_two_turns_match_the_server, p, page),
                named(test_history_survives_a_reload, p, page),
                named(test_stop_leaves_a_partial_answer, p, page),
                named(test_max_tokens_is_clamped_to_the_context, p, page),
                named(test_markdown_renders_safely, p, page),
                named(test_template_panel_shows_the_servers_template, p, page),
                named(test_api_key_flow, page, os.path.join(A.workdir, "serve-page-key.log")),
                test_screenshots_are_real_images,
            ])
    finally:
        if chrome:
            chrome.kill()
            chrome.wait()
        shutil.rmtree(profile, ignore_errors=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
