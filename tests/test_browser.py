"""Load the built documentation site in headless Chromium and check it works as a reader sees it.

The test builds the site with `mkdocs build` into a temporary folder, serves it on 127.0.0.1
with `http.server` in a thread, and drives headless Chromium over the DevTools protocol (a
websocket, through `websocket-client`). For each page it checks that no script threw, nothing
called `console.error`, no file of the site itself failed to load, and the page shows what it
is for. It then types `resolve_alias` into Material's search box and expects the cross-engine
guide among the results.

Screenshots of every page land in `build/screenshots/*.png` (look at them after a change to the
theme, the CSS or the diagrams).

Without Chromium the test is skipped, except under `CI=true`, where `.ci/run` installs it and a
missing browser is a failure. Set `CHROMIUM=/path/to/chrome` to use another binary. Requests
to other hosts (Material's web fonts) may fail offline; they are not counted as errors.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import pytest

from docs_harness import ci_is_on

REPO = pathlib.Path(__file__).resolve().parents[1]
SHOTS = REPO / "build" / "screenshots"
VIEWPORT = {"width": 1280, "height": 900}

#: screenshot name -> (path under the site, JavaScript returning a truthy value when the page
#: shows what it is for)
PAGES = {
    "home": ("", "document.querySelector('h1').textContent.includes('TorchLens')"),
    "cross-engine": (
        "guides/cross-engine/",
        "document.querySelector('h1').textContent.includes('Cross-engine checks')"
        " && document.querySelectorAll('.highlight').length >= 3",
    ),
    "alias-table-nnterp": (
        "aliases/nnterp/",
        "document.querySelector('h1').textContent.includes('nnterp')"
        " && Array.from(document.querySelectorAll('table'))"
        "      .some(t => t.querySelectorAll('tbody tr').length >= 12)",
    ),
    "api-mechinterp": (
        "api/mechinterp/",
        "!!document.getElementById('torchlens.mechinterp.resolve_alias')"
        " && !!document.getElementById('torchlens.mechinterp.alias_report')",
    ),
    "diagrams": (
        "guides/diagrams/",
        "document.querySelectorAll('.tl-diagram img').length === 8"
        " && Array.from(document.querySelectorAll('.tl-diagram img'))"
        "      .every(i => i.complete && i.naturalWidth > 1000)",
    ),
}

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _find_chromium() -> str | None:
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    for name in ("/usr/bin/chromium", *CHROMIUM_NAMES):
        found = shutil.which(name)
        if found:
            return found
    return None


# -- a minimal DevTools protocol client ------------------------------------------------------------


class DevTools:
    """One websocket to the browser; pages are flat sessions on it."""

    def __init__(self, url: str):
        import websocket  # websocket-client

        self._ws = websocket.create_connection(url, timeout=30, suppress_origin=True)
        self._timeout_error = websocket.WebSocketTimeoutException
        self._id = 0
        self.events: list[dict] = []

    def close(self):
        with contextlib.suppress(Exception):
            self._ws.close()

    def _receive(self, deadline: float) -> dict | None:
        self._ws.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            return json.loads(self._ws.recv())
        except self._timeout_error:
            return None

    def call(self, method: str, session: str | None = None, timeout: float = 30, **params) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        self._ws.send(json.dumps(message))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data = self._receive(deadline)
            if data is None:
                continue
            if data.get("id") == self._id:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data.get("result", {})
            if "method" in data:
                self.events.append(data)
        raise TimeoutError(f"no answer to {method} within {timeout} s")

    def pump(self, seconds: float) -> None:
        """Collect events for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            data = self._receive(deadline)
            if data is not None and "method" in data:
                self.events.append(data)

    def wait_for(self, method: str, session: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        seen = lambda: any(e["method"] == method and e.get("sessionId") == session for e in self.events)  # noqa: E731
        while not seen():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {timeout} s")
            data = self._receive(deadline)
            if data is not None and "method" in data:
                self.events.append(data)


class Page:
    def __init__(self, tools: DevTools, origin: str):
        self.tools = tools
        self.origin = origin
        target = tools.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = tools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=False, **VIEWPORT)

    def call(self, method: str, **params) -> dict:
        return self.tools.call(method, self.session, **params)

    def open(self, url: str) -> None:
        self.tools.events.clear()
        self.call("Page.navigate", url=url)
        self.tools.wait_for("Page.loadEventFired", self.session, timeout=20)
        self.tools.pump(0.6)  # scripts that run after load (search index, instant navigation)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_until(self, expression: str, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value or time.monotonic() > deadline:
                return value
            self.tools.pump(0.2)

    def screenshot(self, name: str) -> pathlib.Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        SHOTS.mkdir(parents=True, exist_ok=True)
        path = SHOTS / f"{name}.png"
        path.write_bytes(base64.b64decode(data))
        return path

    def problems(self) -> tuple[list[str], list[str]]:
        """(errors, failed requests to other hosts) since the last `open`."""
        errors, external = [], []
        for event in self.tools.events:
            if event.get("sessionId") != self.session:
                continue
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                text = details.get("exception", {}).get("description") or details.get("text", "")
                errors.append(f"uncaught exception: {text}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                errors.append(f"console.{params['type']}: {args}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                url = entry.get("url", "")
                if url and not url.startswith(self.origin):
                    external.append(f"{url}: {entry.get('text', '')}")
                else:
                    errors.append(f"{entry.get('source', 'log')}: {entry.get('text', '')} {url}".strip())
        return errors, external


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    path = _find_chromium()
    if path is None:
        if ci_is_on():
            pytest.fail("CI is on but Chromium is not installed: .ci/run installs it with apt-get")
        pytest.skip("Chromium is not installed (apt-get install -y chromium, or set CHROMIUM=/path/to/chrome)")
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, f"mkdocs build failed:\n{done.stdout}\n{done.stderr}"
    assert (out / "index.html").exists() and (out / "search" / "search_index.json").exists()
    return out


@pytest.fixture(scope="module")
def origin(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(chromium, tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium-profile")
    process = subprocess.Popen(
        [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
            f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"Chromium did not start ({chromium}, exit {process.poll()})")
        time.sleep(0.1)
    port, path = port_file.read_text().splitlines()[:2]
    tools = DevTools(f"ws://127.0.0.1:{port}{path}")
    try:
        yield tools
    finally:
        with contextlib.suppress(Exception):
            tools.call("Browser.close", timeout=5)
        tools.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def page(browser, origin):
    return Page(browser, origin)


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PAGES))
def test_page_loads_without_errors(page, origin, name):
    path, shows = PAGES[name]
    page.open(origin + path)
    shown = page.wait_until(shows, timeout=10)
    if name == "diagrams":  # show a diagram rather than the page's introduction
        page.evaluate("document.querySelector('.tl-diagram').scrollIntoView()")
        page.tools.pump(0.3)
    shot = page.screenshot(name)
    errors, _ = page.problems()
    assert not errors, f"{path or '/'}: " + "; ".join(errors)
    assert shown, f"{path or '/'} does not show what it should ({shows}); see {shot}"


def test_search_finds_the_cross_engine_guide(page, origin):
    page.open(origin)
    page.evaluate("document.querySelector('input.md-search__input').focus()")
    page.call("Input.insertText", text="resolve_alias")
    page.evaluate(
        "document.querySelector('input.md-search__input')"
        ".dispatchEvent(new KeyboardEvent('keyup', {key: 's', bubbles: true}))"
    )
    links = page.wait_until(
        "Array.from(document.querySelectorAll('.md-search-result__item a')).map(a => a.href)", timeout=20
    )
    page.tools.pump(0.5)  # let the search overlay finish its transition before the screenshot
    page.screenshot("search-resolve_alias")
    errors, _ = page.problems()
    assert not errors, "; ".join(errors)
    assert links, "Material's search returned no result for 'resolve_alias'"
    assert any("/guides/cross-engine/" in link for link in links), links


def test_the_error_checks_can_fail(page, origin):
    """The checks above are not vacuous: a thrown error, console.error and a missing file of the
    site are all caught."""
    page.open(origin)
    page.evaluate(
        "setTimeout(() => { throw new Error('thrown on purpose') }, 0);"
        "console.error('logged on purpose');"
        "const img = document.createElement('img'); img.src = '/no-such-file.png';"
        "document.body.appendChild(img); true"
    )
    page.tools.pump(1.0)
    errors, _ = page.problems()
    text = "\n".join(errors)
    assert "thrown on purpose" in text
    assert "console.error: logged on purpose" in text
    assert "no-such-file.png" in text
