"""The playground page in headless Chromium (Debian's `chromium`), driven over the
DevTools protocol: type a prompt, click Generate, watch the output grow token by token
while the status reads "streaming", then "done"; the text must equal the server's
non-streamed answer for the same prompt, seed and temperature (the oracle), and a
screenshot is saved. Exits 77 (skip) when chromium or python3-websocket is missing."""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

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
SHOT = os.path.join(A.workdir, "serve-page.png")


class Page:
    """One tab over the DevTools protocol."""

    def __init__(self, ws_url):
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
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


def test_page_streams_a_completion(port, page):
    page.call("Page.enable")
    page.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
    # Until the navigation commits, the tab may still hold about:blank (no #model) or
    # an execution context that is torn down under the evaluation: both mean "not yet".
    deadline, state = time.time() + 30, None
    while time.time() < deadline and state != "complete|serve-model":
        try:
            state = page.js("document.readyState + '|' + (document.getElementById('model') || {}).textContent")
        except RuntimeError:
            state = None
        time.sleep(0.05)
    assert state == "complete|serve-model", f"the page did not load and name the model: {state}"
    page.js("document.getElementById('prompt').value = 'And God said'; "
            "document.getElementById('max_tokens').value = '60'; document.getElementById('temperature').value = '0.8';"
            "document.getElementById('seed').value = '3'; true")
    # Type one more character the way a user would, through input events.
    page.js("document.getElementById('prompt').focus(); true")
    page.call("Input.insertText", text=",")
    page.js("document.getElementById('generate').click(); true")
    seen_streaming, lengths = False, []
    deadline = time.time() + 60
    while time.time() < deadline:
        st, out = page.js("[document.getElementById('status').textContent, document.getElementById('output').textContent]")
        seen_streaming |= st == "streaming"
        lengths.append(len(out))
        if st == "done" or st.startswith("error"):
            break
        time.sleep(0.002)
    assert st == "done", st
    assert seen_streaming, "the status never read 'streaming'"
    out = page.js("document.getElementById('output').textContent")
    s, want = H.post(port, "/v1/completions", {"prompt": "And God said,", "max_tokens": 60, "temperature": 0.8,
                                                "seed": 3})
    assert s == 200
    assert out == "And God said," + want["choices"][0]["text"], (out, want)
    grew = sorted(set(lengths))
    print(f"  output lengths seen while streaming: {len(grew)} distinct ({grew[:6]}...)")
    shot = page.call("Page.captureScreenshot", format="png")
    with open(SHOT, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    print(f"  screenshot: {SHOT}")


def main():
    profile = tempfile.mkdtemp(prefix="kiln-chromium-")
    chrome = None
    rc = 1
    try:
        with H.Server(A.kiln, RUN, log=os.path.join(A.workdir, "serve-page.log")) as s:
            chrome = subprocess.Popen([CHROME, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                       "--remote-debugging-port=0", "--remote-allow-origins=*",
                                       f"--user-data-dir={profile}", "--window-size=900,700", "about:blank"],
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
            rc = H.run_tests([lambda: test_page_streams_a_completion(s.port, page)])
    finally:
        if chrome:
            chrome.kill()
            chrome.wait()
        shutil.rmtree(profile, ignore_errors=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
