"""Open a rendered report in headless Chromium (Debian's `chromium`) and check it as a person would.

Uses Playwright's Python API with the system browser (``executable_path``), so no browser is
downloaded. Chromium is started with the flags that keep it off the network (this project's
machines reach only package registries).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["find_chromium", "PageCheck", "check_page"]

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
