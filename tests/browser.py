"""Helpers for the tests that open vlmprobe's pages: a served app on a free local port (uvicorn in a thread of the
test), and a headless Chromium driven by Playwright that records console errors and every request leaving the
page's own origin.

The browser is the system's Chromium (Debian: `apt-get install -y chromium` -> /usr/bin/chromium, or
VLMPROBE_CHROMIUM=PATH), launched through Playwright's `executable_path`: Playwright's own browser downloads are
never used. A test needing it skips, saying why, where playwright or the browser is missing.

`python tests/browser.py docs/img` writes the screenshots docs/web.md shows (a tiny sweep's report.html and the
served page answering a tiny model's question; estimates, made on this machine).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

__all__ = ["Browser", "chromium", "free_port", "open_browser", "served"]


def chromium() -> str | None:
    """The Chromium to drive: $VLMPROBE_CHROMIUM, else the system's (Debian's package installs /usr/bin/chromium)."""
    given = os.environ.get("VLMPROBE_CHROMIUM")
    if given:
        return given if Path(given).is_file() else None
    for name in ("chromium", "chromium-browser"):
        if found := shutil.which(name):
            return found
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(results_dir: Path, run=None):
    """The web app (vlmprobe.web.app.make_app) on 127.0.0.1 in a thread; yields (its base URL, the app)."""
    uvicorn = pytest.importorskip("uvicorn", reason="the web extra is not installed: pip install -e '.[web]'")
    pytest.importorskip("fastapi", reason="the web extra is not installed: pip install -e '.[web]'")
    from vlmprobe.web.app import make_app

    app = make_app(results_dir, run)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class Browser:
    """A page of a headless Chromium; `errors`: console errors and page errors; `requests`: every URL asked for."""

    def __init__(self, page):
        self.page = page
        self.errors: list[str] = []
        self.requests: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("request", lambda r: self.requests.append(r.url))


@contextlib.contextmanager
def open_browser(width: int = 1100, height: int = 900):
    """A Browser on a fresh page; skips the test where playwright or Chromium is missing."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install playwright")
    path = chromium()
    if path is None:
        pytest.skip("no Chromium: apt-get install -y chromium (or set VLMPROBE_CHROMIUM=PATH)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, headless=True)
        try:
            yield Browser(browser.new_page(viewport={"width": width, "height": height}))
        finally:
            browser.close()


def screenshots(folder: Path) -> None:
    """docs/img/report_html.png and docs/img/serve.png, from estimates made here."""
    import tempfile

    from vlmprobe.api import run

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = run("+sweep=smoke", "sweep.axes.data.batch_size=[1,2,4]", results_dir=tmp, device="rtx4090",
                     **{"measure.backend": "estimate", "launcher": "local"})
        with open_browser() as b:
            b.page.goto((result.out_dir / "report.html").as_uri())
            b.page.screenshot(path=str(folder / "report_html.png"), full_page=True)
        with served(Path(tmp)) as (url, _), open_browser(1100, 1300) as b:
            b.page.goto(f"{url}/?model=qwen2_vl_tiny&device=rtx4090&data.batch_size=2&data.lm_max_length=128&run=1")
            b.page.wait_for_selector("li.verdict", timeout=120_000)
            b.page.screenshot(path=str(folder / "serve.png"), full_page=True)


if __name__ == "__main__":
    screenshots(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img"))
