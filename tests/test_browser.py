"""Load the built documentation site in headless Chromium and check it works as a reader sees it.

The test builds the site with `mkdocs build` into a temporary folder, serves it on 127.0.0.1
with `http.server` in a thread, and drives headless Chromium over the DevTools protocol (a
websocket, through `websocket-client`). For each page it checks that no script threw, nothing
called `console.error`, no file of the site itself failed to load, and the page shows what it
is for. At a phone's width (390 px) and at 1280 and 1920 px it checks that no page is wider than
the window, no table hides a column, nothing cuts text off and no word breaks in the middle, and
that the block diagrams' text is legible. It then types names into Material's search box
(`resolve_alias`, hook names as readers paste them), also on the site opened from disk (file://),
and checks what it finds.

Screenshots of every page land in `build/screenshots/*.png` (look at them after a change to the
theme, the CSS or the diagrams).

Without Chromium the test is skipped, except under `CI=true`, where `.ci/run` installs it and a
missing browser is a failure. Set `CHROMIUM=/path/to/chrome` to use another binary. No page may
request anything from another host: the site works offline.
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
#: The window widths every page is checked at for clipped and mid-word-broken text: a phone's, and
#: two desktop windows.
WIDTHS = (390, 1280, 1920)
#: A window at most this wide is a phone's: a code block or a drawing may scroll inside its box.
PHONE_MAX = 600

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
    "op-graph": (
        "guides/op-graph/",
        "document.querySelectorAll('.tl-opgraph img').length >= 9"
        " && Array.from(document.querySelectorAll('.tl-opgraph img'))"
        "      .every(i => i.complete && i.naturalWidth > 0)",
    ),
    "diagrams": (
        "guides/diagrams/",
        "document.querySelectorAll('.tl-diagram img').length === 8"
        " && Array.from(document.querySelectorAll('.tl-diagram img'))"
        "      .every(i => i.complete && i.naturalWidth > 500)",
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
        seen = lambda: any(
            e["method"] == method and e.get("sessionId") == session for e in self.events
        )
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
        self.session = tools.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=False, **VIEWPORT
        )

    def call(self, method: str, **params) -> dict:
        return self.tools.call(method, self.session, **params)

    def open(self, url: str) -> None:
        self.tools.events.clear()
        self.call("Page.navigate", url=url)
        self.tools.wait_for("Page.loadEventFired", self.session, timeout=20)
        self.tools.pump(0.6)  # scripts that run after load (search index, instant navigation)

    def evaluate(self, expression: str):
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_until(self, expression: str, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError as error:  # the page is navigating: ask the next one
                if "navigated" not in str(error) and "context" not in str(error).lower():
                    raise
                value = None
            if value or time.monotonic() > deadline:
                return value
            self.tools.pump(0.2)

    def resize(self, width: int, height: int = VIEWPORT["height"]) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            deviceScaleFactor=1,
            mobile=False,
            width=width,
            height=height,
        )

    def screenshot(self, name: str, full_page: bool = False) -> pathlib.Path:
        params = {"format": "png"}
        if full_page:  # the whole page, up to 12000 px tall
            height = min(12000, int(self.evaluate("document.documentElement.scrollHeight")))
            width = int(self.evaluate("document.documentElement.clientWidth"))
            params.update(
                captureBeyondViewport=True,
                clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
            )
        data = self.call("Page.captureScreenshot", **params)["data"]
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
                args = " ".join(
                    str(a.get("value", a.get("description", ""))) for a in params.get("args", [])
                )
                errors.append(f"console.{params['type']}: {args}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                url = entry.get("url", "")
                if url and not url.startswith(self.origin):
                    external.append(f"{url}: {entry.get('text', '')}")
                else:
                    errors.append(
                        f"{entry.get('source', 'log')}: {entry.get('text', '')} {url}".strip()
                    )
        return errors, external


#: Returns a list of problems a reader would see in the page's content column, given `narrow`
#: (whether the window is a phone's, narrower than `PHONE_MAX` px):
#: - "clipped": content a reader cannot see whole: a page wider than the window (it scrolls
#:   sideways); an element that cuts its content off (overflow hidden); an element that scrolls
#:   sideways (a table's scroll wrapper: a column out of sight), except, on a phone, a code block or
#:   a drawing scrolling inside its own box; inline code that sticks out of its paragraph;
#: - "broken": a word (a run of non-space characters) that the browser split across two lines
#:   anywhere but after a hyphen, a slash, a dash, a `.`, `_` or `:` (where a dotted name may
#:   wrap: "blocks.0." / "hook_resid_post") or before an opening bracket; in a code block, anywhere
#:   next to punctuation (where the browser's line breaking wraps code), never between two letters.
LAYOUT_PROBLEMS_JS = r"""
((narrow) => {
  const problems = [];
  const root = document.querySelector('article.md-content__inner') || document.body;
  const say = el => {
    const text = (el.textContent || '').trim().replace(/\s+/g, ' ').slice(0, 70);
    return `<${el.tagName.toLowerCase()}${el.className && typeof el.className === 'string' ? ' class="' + el.className + '"' : ''}> "${text}"`;
  };
  const doc = document.documentElement;
  if (doc.scrollWidth > doc.clientWidth + 1) problems.push(`clipped: the page scrolls sideways (${doc.scrollWidth} > ${doc.clientWidth} px)`);
  const visible = el => el.getClientRects().length > 0 && getComputedStyle(el).visibility !== 'hidden';
  const ownScroll = el => narrow && el.matches('pre, pre > code, .tl-diagram, .tl-opgraph');
  for (const el of root.querySelectorAll('*')) {
    if (!visible(el)) continue;
    const style = getComputedStyle(el);
    if (!['auto', 'scroll', 'hidden', 'clip'].includes(style.overflowX)) continue;
    if (el.scrollWidth <= el.clientWidth + 1) continue;
    if (['auto', 'scroll'].includes(style.overflowX) && ownScroll(el)) continue;
    problems.push(`clipped: ${say(el)} (${el.scrollWidth} > ${el.clientWidth} px)`);
  }
  for (const el of root.querySelectorAll(':not(pre) > code')) {
    if (!visible(el) || el.closest('.tl-diagram')) continue;
    const box = el.parentElement.closest('p,li,td,th,dd,dt,h1,h2,h3,h4,h5,h6,div,summary');
    if (box && el.getBoundingClientRect().right > box.getBoundingClientRect().right + 1)
      problems.push(`clipped: ${say(el)} sticks out of ${say(box)}`);
  }
  const allowedBefore = /[-\/\u2013\u2014._:]$/, allowedAfter = /^[(\[{]/;
  const range = document.createRange();
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (!node.parentElement || !visible(node.parentElement)) continue;
    const text = node.textContent;
    for (const m of text.matchAll(/\S{2,}/g)) {
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      const rects = Array.from(range.getClientRects()).filter(r => r.width > 0.5);
      if (rects.length < 2 || Math.max(...rects.map(r => r.top)) - Math.min(...rects.map(r => r.top)) < 4) continue;
      // find where the line changes, and allow a break after a hyphen, slash or dash
      let firstTop = null, breakAt = -1;
      for (let i = 0; i < m[0].length; i++) {
        range.setStart(node, m.index + i);
        range.setEnd(node, m.index + i + 1);
        const r = Array.from(range.getClientRects()).find(r => r.width > 0.5);
        if (!r) continue;
        if (firstTop === null) firstTop = r.top;
        else if (r.top - firstTop > 4) { breakAt = i; break; }
      }
      const before = m[0].slice(0, breakAt), after = m[0].slice(breakAt);
      if (breakAt > 0 && (allowedBefore.test(before) || allowedAfter.test(after))) continue;
      // a code block wraps where the browser's line breaking allows: next to punctuation
      if (breakAt > 0 && node.parentElement.closest('pre') && (/\W$/.test(before) || /^\W/.test(after))) continue;
      const where = node.parentElement.closest('td,th,li,p,pre,h1,h2,h3,h4,h5,div') || node.parentElement;
      problems.push(`broken: "${m[0].slice(0, breakAt)} / ${m[0].slice(breakAt)}" in ${say(where)}`);
    }
  }
  return problems;
})(NARROW)
"""


def layout_problems(page: Page, width: int) -> list[str]:
    """`LAYOUT_PROBLEMS_JS` on the page shown at `width` px."""
    narrow = "true" if width <= PHONE_MAX else "false"
    return page.evaluate(LAYOUT_PROBLEMS_JS.replace("})(NARROW)", f"}})({narrow})"))


def _site_pages(site: pathlib.Path) -> list[str]:
    """Every page of the built site, as a path under its root (`""` for the home page)."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        relative = index.parent.relative_to(site).as_posix()
        if relative.split("/")[0] in ("search", "assets"):
            continue
        pages.append("" if relative == "." else relative + "/")
    return pages


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    path = _find_chromium()
    if path is None:
        if ci_is_on():
            pytest.fail("CI is on but Chromium is not installed: .ci/run installs it with apt-get")
        pytest.skip(
            "Chromium is not installed (apt-get install -y chromium, or set CHROMIUM=/path/to/chrome)"
        )
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"mkdocs build failed:\n{done.stdout}\n{done.stderr}"
    assert (out / "index.html").exists() and (out / "search" / "search_index.json").exists()
    return out


@pytest.fixture(scope="module")
def origin(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site))
    )
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
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
    if name in ("diagrams", "op-graph"):  # show a drawing rather than the page's introduction
        page.evaluate(
            f"document.querySelector('{'.tl-diagram' if name == 'diagrams' else '.tl-opgraph'}')"
            ".scrollIntoView()"
        )
        page.tools.pump(0.3)
    shot = page.screenshot(name)
    errors, external = page.problems()
    assert not errors, f"{path or '/'}: " + "; ".join(errors)
    assert not external, (
        f"{path or '/'} requests files from other hosts (it must work offline): {external}"
    )
    assert shown, f"{path or '/'} does not show what it should ({shows}); see {shot}"


def search(page, url: str, query: str) -> list[str]:
    """Type `query` into Material's search box on `url`; the links of the results it lists, best first."""
    page.open(url)
    page.evaluate("document.querySelector('input.md-search__input').focus()")
    page.call("Input.insertText", text=query)
    page.evaluate(
        "document.querySelector('input.md-search__input')"
        ".dispatchEvent(new KeyboardEvent('keyup', {key: 's', bubbles: true}))"
    )
    links = page.wait_until(
        "Array.from(document.querySelectorAll('.md-search-result__item > a')).map(a => a.href)",
        timeout=20,
    )
    page.tools.pump(0.5)  # let the search overlay finish its transition before the screenshot
    meta = page.evaluate("document.querySelector('.md-search-result__meta').textContent.trim()")
    assert links, f"no search result for {query!r} on {url} (the search box says {meta!r})"
    return links


def test_search_finds_resolve_alias_in_the_api_reference(page, origin):
    links = search(page, origin, "resolve_alias")
    page.screenshot("search-resolve_alias")
    errors, _ = page.problems()
    assert not errors, "; ".join(errors)
    assert any(
        "/api/mechinterp/" in link and link.endswith("#torchlens.mechinterp.resolve_alias")
        for link in links
    ), links


#: Names as readers paste them: with a layer, as the tables write them, and a part of one.
HOOK_NAMES = (
    "blocks.3.hook_mlp_out",
    "blocks.{L}.hook_mlp_out",
    "hook_mlp_out",
    "layers_output[1]",
    "resid_post.5",
    "blocks.0.attn.hook_pattern",
    "mlps_output[-1]",
)


@pytest.mark.parametrize("query", HOOK_NAMES)
def test_search_puts_the_alias_and_translation_tables_first_for_a_hook_name(page, origin, query):
    links = search(page, origin, query)
    pages = list(dict.fromkeys(link.split("?")[0].split("#")[0] for link in links))
    assert any("/aliases/" in p for p in pages[:3]), (query, pages[:6])


def test_search_and_links_work_on_the_site_opened_from_disk(page, site):
    """From file:// Chromium starts no Web Worker, so Material's search stayed at "Initializing search",
    and a link to a directory showed its file listing (docs/javascripts/file-protocol.js)."""
    home = (site / "index.html").as_uri()
    links = search(page, home, "hook_mlp_out")
    assert any("/aliases/" in link for link in links[:3]), links[:5]
    page.tools.events.clear()
    page.evaluate("document.querySelector('.md-search-result__item > a').click()")
    # Wait for the result's page itself: the home page, still shown while the click's navigation
    # starts, is complete and ends with /index.html too (a loaded machine lost that race once).
    facets_link = (
        "Array.from(document.querySelectorAll('a.md-nav__link'))"
        ".some(a => a.textContent.trim() === 'Facets')"
    )
    page.wait_until(
        "document.readyState === 'complete' && location.pathname.includes('/aliases/') && "
        + facets_link,
        timeout=10,
    )
    assert "/aliases/" in page.evaluate("location.pathname")
    page.evaluate(
        "Array.from(document.querySelectorAll('a.md-nav__link'))"
        ".find(a => a.textContent.trim() === 'Facets').click()"
    )
    title = page.wait_until(
        "location.pathname.endsWith('/guides/facets/index.html') && document.title", timeout=10
    )
    assert title and title.startswith("Facets"), title
    errors, _ = page.problems()
    assert not errors, "; ".join(errors)


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


@pytest.mark.parametrize("width", WIDTHS)
def test_no_clipped_or_broken_text(page, site, origin, width):
    """At each width, no page of the site cuts text off or breaks a word in the middle.

    Every page gets a screenshot, `build/screenshots/layout-<page>@<width>.png` (the alias-table
    pages the whole page, the others what the window shows)."""
    pages = _site_pages(site)
    assert len(pages) >= 20, pages
    found = {}
    page.resize(width)
    try:
        for path in pages:
            page.open(origin + path)
            page.tools.pump(0.2)
            name = (path.strip("/").replace("/", "-") or "home") + f"@{width}"
            page.screenshot("layout-" + name, full_page=path.startswith("aliases/"))
            problems = layout_problems(page, width)
            if problems:
                found[path or "/"] = problems
    finally:
        page.resize(VIEWPORT["width"])
    listing = "\n".join(
        f"{p}: {len(v)} problems\n    " + "\n    ".join(v[:8]) for p, v in found.items()
    )
    assert not found, f"at {width} px:\n{listing}"


#: Returns the problems of the op-graph drawings on the page as a reader sees them:
#: - "scaled": an image shown smaller than its own size (its 11 px text would be smaller);
#: - "clipped": an image that sticks out of the window or of its container (in a window narrower
#:   than the drawing, the drawing scrolls sideways inside its box, and that box must fit the window);
#: - "overlap": two images on top of each other, or, inside one drawing laid out by the browser
#:   with its own fonts, two text lines whose boxes intersect or a line that sticks out of its
#:   node or box title.
OP_GRAPH_PROBLEMS_JS = r"""
(async () => {
  const problems = [];
  const imgs = Array.from(document.querySelectorAll('.tl-opgraph img'));
  const view = document.documentElement.clientWidth;
  const rects = imgs.map(i => i.getBoundingClientRect());
  imgs.forEach((img, k) => {
    const r = rects[k], name = img.getAttribute('src');
    if (r.width < img.naturalWidth - 0.5) problems.push(`scaled: ${name} shown ${r.width} px wide, drawn ${img.naturalWidth}`);
    const frame = img.closest('.tl-opgraph') || img.parentElement;
    const box = img.parentElement.getBoundingClientRect(), framed = frame.getBoundingClientRect();
    if (['auto', 'scroll'].includes(getComputedStyle(frame).overflowX) && frame.scrollWidth > frame.clientWidth + 1) {
      // wider than the window: the drawing scrolls sideways inside its own box, which must fit the window
      if (framed.left < -0.5 || framed.right > view + 0.5)
        problems.push(`clipped: the box of ${name} spans ${framed.left}..${framed.right}, window 0..${view}`);
    } else if (r.left < -0.5 || r.right > view + 0.5 || r.right > box.right + 0.5 || r.left < box.left - 0.5)
      problems.push(`clipped: ${name} spans ${r.left}..${r.right}, window 0..${view}, container ${box.left}..${box.right}`);
    for (let j = 0; j < k; j++) {
      const o = rects[j];
      if (r.left < o.right - 0.5 && o.left < r.right - 0.5 && r.top < o.bottom - 0.5 && o.top < r.bottom - 0.5)
        problems.push(`overlap: ${name} and ${imgs[j].getAttribute('src')}`);
    }
  });
  const host = document.createElement('div');
  host.style.cssText = 'position:absolute;left:0;top:0;visibility:hidden;';
  document.body.appendChild(host);
  const inter = (a, b) => a.x < b.x + b.width - 0.5 && b.x < a.x + a.width - 0.5 && a.y < b.y + b.height - 0.5 && b.y < a.y + a.height - 0.5;
  for (const img of imgs) {
    const text = await (await fetch(img.src)).text();
    const svg = new DOMParser().parseFromString(text, 'image/svg+xml').documentElement;
    host.replaceChildren(document.importNode(svg, true));
    const drawn = host.firstElementChild, name = img.getAttribute('src');
    const boxes = Array.from(drawn.querySelectorAll('text')).map(t => ({t, b: t.getBBox()}));
    for (let i = 0; i < boxes.length; i++)
      for (let j = 0; j < i; j++)
        if (inter(boxes[i].b, boxes[j].b))
          problems.push(`overlap: in ${name}, "${boxes[i].t.textContent}" and "${boxes[j].t.textContent}"`);
    for (const g of drawn.querySelectorAll('g.node, g.box-label')) {
      const r = g.querySelector('rect').getBBox();
      for (const t of g.querySelectorAll('text')) {
        const b = t.getBBox();
        if (b.x < r.x - 0.5 || b.x + b.width > r.x + r.width + 0.5)
          problems.push(`overlap: in ${name}, "${t.textContent}" sticks out of its ${g.getAttribute('class')}`);
      }
    }
  }
  host.remove();
  return problems;
})()
"""


@pytest.mark.parametrize("width", WIDTHS)
def test_op_graph_drawings_are_shown_whole_and_legible(page, origin, width):
    page.resize(width)
    try:
        page.open(origin + "guides/op-graph/")
        assert page.wait_until(PAGES["op-graph"][1], timeout=20)
        problems = page.evaluate(OP_GRAPH_PROBLEMS_JS)
        page.evaluate("document.querySelector('.tl-opgraph').scrollIntoView()")
        page.screenshot(f"op-graph@{width}")
    finally:
        page.resize(VIEWPORT["width"])
    assert not problems, f"at {width} px:\n" + "\n".join(problems[:20])


#: The smallest text a block diagram may show, in CSS pixels, at every width in `WIDTHS`.
MIN_DIAGRAM_TEXT_PX = 11

#: Returns, for each block diagram on the page, its file, the size its smallest text is shown at
#: (the smallest `font-size` of its SVG times the width it is shown at over its viewBox's width),
#: and where its box lies against the window.
DIAGRAM_TEXT_JS = r"""
(async () => {
  const view = document.documentElement.clientWidth, found = [];
  for (const img of document.querySelectorAll('.tl-diagram img')) {
    const svg = new DOMParser().parseFromString(await (await fetch(img.src)).text(), 'image/svg+xml').documentElement;
    const viewBoxWidth = Number(svg.getAttribute('viewBox').trim().split(/[\s,]+/)[2]);
    const sizes = Array.from(svg.querySelectorAll('text')).map(t => parseFloat(t.getAttribute('font-size') || svg.getAttribute('font-size')));
    const frame = img.closest('.tl-diagram').getBoundingClientRect();
    found.push({name: img.getAttribute('src'), smallest: Math.min(...sizes) * img.getBoundingClientRect().width / viewBoxWidth,
                left: frame.left, right: frame.right, view});
  }
  return found;
})()
"""


def _diagram_problems(found: list[dict]) -> list[str]:
    problems = []
    for d in found:
        if d["smallest"] < MIN_DIAGRAM_TEXT_PX - 0.05:
            problems.append(f"{d['name']}: its smallest text is shown at {d['smallest']:.1f} px")
        if d["left"] < -0.5 or d["right"] > d["view"] + 0.5:
            problems.append(
                f"{d['name']}: its box spans {d['left']}..{d['right']}, window 0..{d['view']}"
            )
    return problems


@pytest.mark.parametrize("width", WIDTHS)
def test_block_diagrams_text_is_legible(page, origin, width):
    """Issue 27, item 9: fitted to the column at 1280 px, the diagrams' text was about 8 px. At
    every width their smallest text is shown at `MIN_DIAGRAM_TEXT_PX` or more (on a phone a
    diagram keeps its own size and scrolls sideways in its box, which fits the window)."""
    page.resize(width)
    try:
        page.open(origin + "guides/diagrams/")
        assert page.wait_until(PAGES["diagrams"][1], timeout=20)
        found = page.evaluate(DIAGRAM_TEXT_JS)
        page.evaluate("document.querySelector('.tl-diagram').scrollIntoView()")
        page.screenshot(f"diagrams@{width}")
    finally:
        page.resize(VIEWPORT["width"])
    assert len(found) == 8, found
    problems = _diagram_problems(found)
    assert not problems, f"at {width} px:\n" + "\n".join(problems)


def test_the_diagram_text_check_can_fail(page, origin):
    """A diagram shown at half its width has text below the minimum; one pushed out of the window
    is outside it."""
    page.open(origin + "guides/diagrams/")
    page.wait_until(PAGES["diagrams"][1], timeout=20)
    page.evaluate(
        "const boxes = document.querySelectorAll('.tl-diagram');"
        "boxes[0].querySelector('img').style.width = (boxes[0].querySelector('img').naturalWidth / 2.5) + 'px';"
        "boxes[1].style.marginLeft = '3000px'; true"
    )
    problems = _diagram_problems(page.evaluate(DIAGRAM_TEXT_JS))
    assert any("smallest text" in p for p in problems), problems
    assert any("its box spans" in p for p in problems), problems


def test_the_op_graph_check_can_fail(page, origin):
    """The drawing check sees a scaled-down drawing, one that sticks out of the window, and two text
    lines drawn on top of each other."""
    page.open(origin + "guides/op-graph/")
    page.wait_until(PAGES["op-graph"][1], timeout=20)
    page.evaluate(
        "const imgs = document.querySelectorAll('.tl-opgraph img');"
        "imgs[0].style.width = (imgs[0].naturalWidth / 2) + 'px';"
        "imgs[1].style.position = 'relative'; imgs[1].style.left = '2000px';"
        "imgs[1].closest('.tl-opgraph').style.overflowX = 'visible'; true"
    )
    problems = page.evaluate(OP_GRAPH_PROBLEMS_JS)
    assert any(p.startswith("scaled: ") for p in problems), problems
    assert any(p.startswith("clipped: ") for p in problems), problems
    # a drawing whose two labels overlap: the first drawing with its second text moved onto its first
    page.evaluate(
        "window._fetch = window.fetch;"
        "window.fetch = async (url) => { const r = await window._fetch(url); const t = await r.text();"
        "  const doc = new DOMParser().parseFromString(t, 'image/svg+xml');"
        "  const texts = doc.querySelectorAll('g.node text');"
        "  texts[1].setAttribute('x', texts[0].getAttribute('x')); texts[1].setAttribute('y', texts[0].getAttribute('y'));"
        "  const s = new XMLSerializer().serializeToString(doc); return {text: async () => s}; }; true"
    )
    problems = page.evaluate(OP_GRAPH_PROBLEMS_JS)
    page.evaluate("window.fetch = window._fetch; true")
    assert any(p.startswith("overlap: in ") for p in problems), problems


def test_the_layout_check_can_fail(page, origin):
    """The layout check sees a clipped code block, a word broken in the middle (between two letters,
    not after a `.` or `_`) and inline code sticking out of its paragraph."""
    page.open(origin)
    page.evaluate(
        "const a = document.createElement('pre'); a.style.overflowX = 'auto'; a.style.width = '200px';"
        "a.textContent = 'x'.repeat(400);"
        "const b = document.createElement('p'); b.style.width = '60px'; b.style.wordBreak = 'break-all';"
        "b.textContent = 'hookresidpost';"
        "const c = document.createElement('p'); c.style.width = '80px';"
        "c.innerHTML = 'see <code>trace.modules.facets.resid_post</code>';"
        "document.querySelector('article.md-content__inner').append(a, b, c); true"
    )
    problems = layout_problems(page, 1280)
    assert any(p.startswith("clipped: <pre") for p in problems), problems
    assert any(
        p.startswith("broken:") and "hookresidpost" in p.replace(" / ", "") for p in problems
    ), problems
    assert any(p.startswith("clipped: <code>") and "sticks out" in p for p in problems), problems


def test_the_phone_layout_check_can_fail(page, origin):
    """At a phone's width a code block may scroll inside its own box, but a table that scrolls
    sideways (a column out of sight), a box that cuts its content off and a page wider than the
    window are caught; a wide table is shown as cards, which fit."""
    page.resize(390)
    try:
        page.open(origin + "aliases/nnterp/")
        page.wait_until(PAGES["alias-table-nnterp"][1], timeout=10)
        assert page.evaluate("document.querySelectorAll('table[data-cards]').length") >= 1
        assert layout_problems(page, 390) == []
        page.evaluate(
            "const t = document.querySelector('table[data-cards]'); t.removeAttribute('data-cards');"
            "const a = document.createElement('pre'); a.style.overflowX = 'auto';"
            "a.textContent = 'x'.repeat(400);"
            "const b = document.createElement('div'); b.style.overflowX = 'hidden'; b.style.whiteSpace = 'nowrap';"
            "b.textContent = 'y'.repeat(400);"
            "document.querySelector('article.md-content__inner').append(a, b); true"
        )
        problems = layout_problems(page, 390)
        assert any("md-typeset__scrollwrap" in p for p in problems), problems
        assert any(p.startswith("clipped: <div") and "yyyy" in p for p in problems), problems
        assert not any(p.startswith("clipped: <pre") for p in problems), problems
        page.evaluate(
            "const w = document.createElement('p'); w.style.width = '800px'; w.textContent = 'wide';"
            "document.querySelector('article.md-content__inner').append(w); true"
        )
        assert any("the page scrolls sideways" in p for p in layout_problems(page, 390))
    finally:
        page.resize(VIEWPORT["width"])
