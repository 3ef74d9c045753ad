"""Headless Chromium for page tests: load a URL, read back the DOM after rendering, take a screenshot.

Debian's `chromium` (`apt-get install -y chromium`); `browser()` skips the calling test with the reason
when it is not installed. Elements carrying `data-k` (and `data-value`) are what a page offers a reader.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def browser() -> str:
    """The Chromium binary, or skip the test saying how to install one."""
    found = os.environ.get("PRIME_CHROMIUM") or next((p for p in map(shutil.which, CANDIDATES) if p), None)
    if not found:
        pytest.skip("no headless Chromium here: `apt-get update && apt-get install -y chromium` (Debian) "
                    "or PRIME_CHROMIUM=/path/to/chrome")
    return found


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: containers and root (CI) have no user namespaces for Chromium's sandbox; the pages
    # loaded are this repository's own, from 127.0.0.1 or a temp file.
    cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--disable-extensions", "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def dump_dom(url: str, timeout: float = 60.0) -> str:
    """The document as Chromium rendered it."""
    run = _run(["--dump-dom", url], timeout)
    assert run.returncode == 0 and "<html" in run.stdout, run.stderr[-2000:]
    return run.stdout


def screenshot(url: str, path: Path, width: int = 1280, height: int = 1200, timeout: float = 60.0) -> Path:
    run = _run([f"--window-size={width},{height}", f"--screenshot={path}", url], timeout)
    assert run.returncode == 0 and path.is_file() and path.stat().st_size > 1000, run.stderr[-2000:]
    return path


class Marked(HTMLParser):
    """Every element's attributes, and for each `data-k` key the values shown (`data-value`, else the text)."""

    VOID = {"meta", "link", "br", "img", "input", "hr", "area", "base", "col", "source", "wbr"}

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, list[str]] = {}
        self.elements: list[dict[str, str]] = []
        self._open: list[tuple[str, dict[str, str], list[str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.elements.append({"<tag>": tag, **a})
        if tag not in self.VOID:
            self._open.append((tag, a, []))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append({"<tag>": tag, **{k: v or "" for k, v in attrs}})

    def handle_data(self, data: str) -> None:
        for _, _, text in self._open:
            text.append(data)

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            t, a, text = self._open.pop()
            if "data-k" in a:
                self.values.setdefault(a["data-k"], []).append(a.get("data-value") or "".join(text).strip())
            if t == tag:
                break

    def one(self, key: str) -> str:
        """The single value shown for `key`."""
        found = self.values.get(key, [])
        assert len(found) == 1, (key, found)
        return found[0]


def marked(html: str) -> Marked:
    parser = Marked()
    parser.feed(html)
    return parser
