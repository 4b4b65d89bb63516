"""Headless Chromium driven by Playwright, for tests that look at a page as a person does.

The browser is Debian's `chromium` (`make browser` installs it with apt-get when run as root;
its package brings the system libraries it needs). Playwright's own browser download
(`playwright install`) is not used: it fetches a build from Playwright's CDN, which machines
limited to package registries cannot reach. `MEMWAL_CHROMIUM` names another Chromium or Chrome
binary. When there is none, or it cannot start, `launch` skips the test and says how to fix it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

# As a closed network needs: no background connections (refused, many at a time, and slow).
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
HOW = ("install Debian's chromium (`make browser`, i.e. `apt-get install -y chromium` as root) "
       "or set MEMWAL_CHROMIUM to a Chromium binary")


def chromium_path() -> str | None:
    """`MEMWAL_CHROMIUM`, else `chromium` on PATH, else None."""
    path = os.environ.get("MEMWAL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return path if path and os.access(path, os.X_OK) else None


def missing_libraries(path: str) -> list[str]:
    """The shared libraries `ldd` cannot find for the browser (Debian's launcher is a script:
    the binary beside it in /usr/lib/chromium is the one to check)."""
    real = os.path.realpath(path)
    candidates = [real, "/usr/lib/chromium/chromium"]
    binary = next((c for c in candidates if os.path.isfile(c) and open(c, "rb").read(4) == b"\x7fELF"), None)
    if binary is None or shutil.which("ldd") is None:
        return []
    out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    return sorted(set(re.findall(r"^\s*(\S+) => not found", out, re.M)))


def unavailable() -> str | None:
    """Why no browser test can run here (Playwright or Chromium missing, and how to fix it), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is missing: `pip install -e '.[dev]'`"
    return None if chromium_path() else f"no Chromium found: {HOW}"


def require() -> str:
    """Skips the test when `unavailable`; returns Chromium's path."""
    if why := unavailable():
        pytest.skip(why)
    return chromium_path()


@contextmanager
def launch() -> Iterator[object]:
    """A headless Playwright `Browser` on the system's Chromium; skips (saying how to fix it)
    when Playwright or Chromium is missing or Chromium cannot start for want of a library."""
    path = require()
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=path, args=ARGS, headless=True)
        except sync_api.Error as e:
            missing = missing_libraries(path)
            if missing:
                pytest.skip(f"{path} cannot start, missing libraries {', '.join(missing)}: {HOW}")
            raise AssertionError(f"{path} did not start: {e}") from e
        try:
            yield browser
        finally:
            browser.close()
