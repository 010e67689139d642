"""Open a rendered report in headless Chromium (Debian's `chromium`) and check it as a person would.

Uses Playwright's Python API with the system browser (``executable_path``), so no browser is
downloaded. Chromium is started with the flags that keep it off the network (this project's
machines reach only package registries).
"""

from __future__ import annotations

import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["find_chromium", "require_chromium", "PageCheck", "check_page", "PageView", "view_pages", "ENGINE_LOG", "FIGURE_CELL",
           "page_problems", "launch", "view_alone"]

CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def find_chromium() -> str | None:
    """Path of a Chromium executable (``chromium`` or ``chromium-browser`` on PATH), else None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def require_chromium() -> str:
    """Chromium's path; installs Debian's ``chromium`` with apt-get when absent and running as root,
    else skips the calling test (``pytest.skip``)."""
    import os
    import subprocess

    import pytest

    exe = find_chromium()
    if exe is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], capture_output=True, timeout=1200,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        exe = find_chromium()
    if exe is None:
        pytest.skip("Debian's chromium package could not be installed here (not root, or no apt-get)")
    return exe


@dataclass
class PageCheck:
    """What a headless browser saw on a page.

    Attributes:
        title: the document title.
        js_errors: uncaught JavaScript errors and console errors.
        images: number of <img> elements.
        broken_images: src of each image that did not load (naturalWidth == 0).
        failed_requests: URLs whose loading failed.
        screenshot: PNG of the full page.
    """

    title: str
    js_errors: list[str] = field(default_factory=list)
    images: int = 0
    broken_images: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    screenshot: Path | None = None


def check_page(html_file: str | Path, screenshot: str | Path, executable: str | None = None,
               timeout_ms: int = 30000) -> PageCheck:
    """Load ``html_file`` (file://) in headless Chromium, collect errors, save a full-page screenshot.

    Raises:
        FileNotFoundError: no Chromium executable found or the HTML file does not exist.
    """
    from playwright.sync_api import sync_playwright

    html_file = Path(html_file).resolve()
    if not html_file.exists():
        raise FileNotFoundError(html_file)
    exe = executable or find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium executable on PATH (apt-get install chromium)")
    errors: list[str] = []
    failed: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("requestfailed", lambda r: failed.append(r.url))
            page.goto(html_file.as_uri(), wait_until="load", timeout=timeout_ms)
            images = page.evaluate("Array.from(document.images).map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])")
            shot = Path(screenshot)
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            title = page.title()
        finally:
            browser.close()
    return PageCheck(title=title, js_errors=errors, images=len(images),
                     broken_images=[src for src, ok in images if not ok], failed_requests=failed, screenshot=shot)


@contextmanager
def launch(executable: str | None = None):
    """A headless Chromium (Playwright's sync API) with :data:`CHROMIUM_ARGS`, closed on exit."""
    from playwright.sync_api import sync_playwright

    exe = executable or find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium executable on PATH (apt-get install chromium)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


# vLLM's logger ("INFO 12-01 12:26:27 [core.py:93] ...", "(EngineCore_DP0 pid=77) WARNING ...") and
# the engine processes' prefixes: none of it belongs on a report page (engine logs go to files).
ENGINE_LOG = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR) +\d{2}-\d{2} \d{2}:\d{2}:\d{2}|\((?:EngineCore|APIServer)\w* pid=")
# a code cell that shows a figure: matplotlib Figures from the package's report modules, saved PNGs
FIGURE_CELL = re.compile(r"\bfigs?\b|\bfig_\w+\(|\bplot_\w+\(|\.figures\(|\bImage\(")
_LATEX = re.compile(r"\$[^$]+\$|\\(?:hat|sum|prod|mathrm|frac|tau|le|cdot)\b")

_VIEW_JS = """() => {
  const cells = Array.from(document.querySelectorAll('.jp-Cell')).map(c => ({
    kind: c.classList.contains('jp-CodeCell') ? 'code' : (c.classList.contains('jp-MarkdownCell') ? 'markdown' : 'raw'),
    source: (c.querySelector('.jp-InputArea-editor') || {innerText: ''}).innerText,
    markdown: c.classList.contains('jp-MarkdownCell') ? c.innerText : '',
    output: Array.from(c.querySelectorAll('.jp-OutputArea-output')).map(o => o.innerText).join('\\n'),
    images: Array.from(c.querySelectorAll('.jp-OutputArea-output img')).map(i => [i.complete && i.naturalWidth > 0, i.naturalWidth]),
    tables: Array.from(c.querySelectorAll('.jp-OutputArea-output table')).map(t => t.innerText),
  }));
  const imgs = Array.from(document.images).map(i => ({src: i.getAttribute('src'), ok: i.complete && i.naturalWidth > 0,
                                                      natural: i.naturalWidth, shown: i.getBoundingClientRect().width}));
  const heads = Array.from(document.querySelectorAll('h1, h2, h3')).map(h => [h.tagName.toLowerCase(), h.innerText.trim()]);
  return {title: document.title, text: document.body.innerText, cells, imgs, heads};
}"""


@dataclass
class PageView:
    """What a person sees on one report page (from the rendered DOM, not the HTML source).

    Attributes:
        name: the file name.
        title: the document title.
        text: the page's visible text (``innerText``).
        cells: one dict per notebook cell: ``kind`` (code/markdown), ``source`` (input text),
            ``markdown`` (rendered text), ``output`` (visible output text), ``images`` ([loaded, natural
            width]), ``tables`` (the text of each output table).
        imgs: every <img>: ``src``, ``ok`` (loaded), ``natural`` and ``shown`` width in CSS pixels.
        heads: ``[(tag, text)]`` of the h1/h2/h3 headings in document order.
        js_errors: uncaught errors and console errors while loading.
        page: the live Playwright page (open while the :func:`view_pages` block runs).
    """

    name: str
    title: str
    text: str
    cells: list[dict]
    imgs: list[dict]
    heads: list[tuple[str, str]]
    js_errors: list[str]
    page: object = None


def view_pages(browser, files, viewport=(1200, 900), timeout_ms: int = 30000) -> dict[str, PageView]:
    """Open each HTML file (file://) in ``browser`` and read what it shows: ``{file name: PageView}``."""
    out = {}
    for f in files:
        f = Path(f).resolve()
        page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
        errors: list[str] = []
        page.on("pageerror", lambda e, errors=errors: errors.append(f"pageerror: {e}"))
        page.on("console", lambda m, errors=errors: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.goto(f.as_uri(), wait_until="load", timeout=timeout_ms)
        v = page.evaluate(_VIEW_JS)
        out[f.name] = PageView(f.name, v["title"], v["text"], v["cells"], v["imgs"], [tuple(h) for h in v["heads"]],
                               errors, page)
    return out


def view_alone(browser, html_file, viewport=(1200, 900), timeout_ms: int = 30000) -> tuple[PageView, list[str]]:
    """Open ``html_file`` as a file sent alone would open: every request other than the file itself
    (a ``data:`` URI is inside the file) is recorded and refused. Returns the page as
    :func:`view_pages` reads it and the URLs it asked for outside the file."""
    f = Path(html_file).resolve()
    page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
    outside: list[str] = []
    errors: list[str] = []

    def leaves(url: str) -> bool:
        return url != f.as_uri() and not url.startswith("data:")

    def route(r):  # refused, so that a page that works only beside its files fails here
        if leaves(r.request.url):
            outside.append(r.request.url)
            r.abort()
        else:
            r.continue_()

    page.route("**/*", route)
    # a request the router does not see (a file:// URL) is still a request event
    page.on("request", lambda q: outside.append(q.url) if leaves(q.url) else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.goto(f.as_uri(), wait_until="load", timeout=timeout_ms)
    v = page.evaluate(_VIEW_JS)
    view = PageView(f.name, v["title"], v["text"], v["cells"], v["imgs"], [tuple(h) for h in v["heads"]], errors, page)
    return view, sorted(set(outside))


def page_problems(v: PageView) -> list[str]:
    """What is wrong with a rendered stage page, as a person reading it would say (empty: nothing).

    Checks: every figure cell (:data:`FIGURE_CELL`) shows at least one loaded image; no engine log
    line (:data:`ENGINE_LOG`); no ``<Figure size ...>`` repr (a figure that did not render); no
    progress bar frozen at its first state ("0%|"); no widget repr (``VBox(``, ``HBox(``); no raw
    LaTeX in the rendered markdown; no table shown twice in one cell.
    """
    bad = []
    m = ENGINE_LOG.search(v.text)
    if m:
        bad.append(f"an engine log line: {v.text[max(0, m.start() - 20): m.end() + 60]!r}")
    if "<Figure size" in v.text:
        bad.append("a '<Figure size' repr (a figure that did not render)")
    for i, c in enumerate(v.cells):
        if c["kind"] == "code" and FIGURE_CELL.search(c["source"]) and not any(ok for ok, _ in c["images"]):
            bad.append(f"cell {i}: a figure cell without an image: {c['source'][:80]!r}")
        if c["kind"] == "markdown" and _LATEX.search(c["markdown"]):
            bad.append(f"cell {i}: raw LaTeX {_LATEX.search(c['markdown']).group(0)!r}")
        for pat in ("0%|", "VBox(", "HBox("):
            if pat in c["output"]:
                bad.append(f"cell {i}: {pat!r} in the output: {c['output'][:120]!r}")
        if len(c["tables"]) != len(set(c["tables"])):
            bad.append(f"cell {i}: a table shown twice")
    return bad
