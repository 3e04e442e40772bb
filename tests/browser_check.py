"""Open an HTML page in Debian's Chromium through Playwright and record what the browser saw: script errors,
network requests, and whether every plotly figure drew its SVG. A test helper (Playwright is a `dev` extra), not
part of the package.

Playwright drives the system browser through `executable_path` (nothing downloads a browser). The checks are
observations: uncaught exceptions (`pageerror`) and console/log errors (`console` of type error or assert) are JS
errors; every request or web socket of the browser context whose URL is not file:, data: or blob: is a network
request. The browser runs with flags for a closed network (every host name resolves to nothing, no background
services) and a fresh profile; each page gets a fresh context.

    with ReportBrowser() as browser:
        check = browser.check("runs/x_demo/report.html", expected_plots=3)
        assert not check.problems(expected_plots=3), check.problems(expected_plots=3)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_ENV = "DFLASH_CHROMIUM"  # an explicit browser binary overrides the search below
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CLOSED_NETWORK_ARGS = (  # on top of Playwright's own (headless, no sandbox, no background networking, ...)
    "--disable-gpu", "--disable-quic", "--no-pings", "--disable-dev-shm-usage",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # a request that slips out fails at once
)
LOCAL_SCHEMES = ("file", "data", "blob")  # URLs of these schemes are not network requests
_PLOT_COUNT_JS = """() => {
  const divs = document.querySelectorAll('.plotly-graph-div, .js-plotly-plot');
  const drawn = [...document.querySelectorAll('.js-plotly-plot')].filter(d => d.querySelector('svg.main-svg'));
  return {plots: divs.length, rendered: drawn.length};
}"""


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary: $DFLASH_CHROMIUM, else the first of CHROMIUM_CANDIDATES found."""
    explicit = os.environ.get(CHROMIUM_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in CHROMIUM_CANDIDATES:
        path = name if os.path.isabs(name) and os.access(name, os.X_OK) else shutil.which(name)
        if path:
            return path
    return None


def unavailable_reason() -> str | None:
    """Why no page can be checked here (None when Playwright and a Chromium are both present)."""
    missing = []
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package is not installed (it is in the `dev` extra: "
                       "pip install -e '.[dev]')")
    if find_chromium() is None:
        missing.append(f"no Chromium found (looked for ${CHROMIUM_ENV}, {', '.join(CHROMIUM_CANDIDATES)}; "
                       "`make test` installs Debian's chromium with apt-get when /usr/bin/chromium is missing and "
                       "it runs as root or with sudo, and that install failed or was not run)")
    return "; ".join(missing) or None


@dataclass
class PageCheck:
    """What the browser saw while loading one page."""

    url: str  # the file:// URL loaded
    loaded: bool  # the load event fired within the timeout
    js_errors: list[str] = field(default_factory=list)  # uncaught exceptions, console.error/assert, log errors
    network_requests: list[str] = field(default_factory=list)  # URLs requested that are not file:/data:/blob:
    plots: int = 0  # plotly figure divs on the page
    plots_rendered: int = 0  # of which hold a drawn svg.main-svg
    seconds: float = 0.0  # time from navigation to verdict

    def problems(self, expected_plots: int | None = None) -> list[str]:
        """Human-readable failures; empty when the page loaded clean and drew every plot div on it
        (and, when given, exactly `expected_plots` of them)."""
        out = []
        if not self.loaded:
            out.append(f"{self.url}: the load event did not fire")
        out += [f"JS error: {e}" for e in self.js_errors]
        out += [f"network request: {u}" for u in self.network_requests]
        want = self.plots if expected_plots is None else expected_plots
        if self.plots != want or self.plots_rendered != want:
            out.append(f"expected {want} rendered plots, found {self.plots_rendered} rendered "
                       f"of {self.plots} plot divs")
        return out


class ReportBrowser:
    """One headless Chromium launched by Playwright; `check` opens each page in a fresh browser context."""

    def __init__(self, binary: str | None = None) -> None:
        reason = unavailable_reason() if binary is None else None
        if reason:
            raise RuntimeError(reason)
        self.binary = binary or find_chromium()
        self._playwright: Any = None
        self._browser: Any = None

    def __enter__(self) -> "ReportBrowser":
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        try:
            self._browser = self._playwright.chromium.launch(executable_path=self.binary,
                                                             args=list(CLOSED_NETWORK_ARGS))
        except BaseException:
            self._playwright.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._browser is not None:
                self._browser.close()
        finally:
            self._playwright.stop()

    def check(self, path: str | Path, expected_plots: int | None = None, timeout_s: float = 60.0,
              settle_s: float = 0.5) -> PageCheck:
        """Load `path` and report what happened.

        Waits (at most `timeout_s` seconds) for the load event, then until every plot div holds its SVG (or
        `expected_plots` are drawn, or a JS error has already failed the page), then `settle_s` seconds more for
        late errors and requests.
        """
        from playwright.sync_api import Error as PlaywrightError

        path = Path(path).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"page to check not found: {path}")
        check = PageCheck(url=path.as_uri(), loaded=False)
        context = self._browser.new_context()
        try:
            page = context.new_page()
            page.on("pageerror", lambda e: check.js_errors.append(f"{e.name}: {e.message}"))
            page.on("console", lambda m: _record_console(check, m))
            context.on("request", lambda r: _record_request(check, r.url))
            page.on("websocket", lambda ws: _record_request(check, ws.url))
            t0 = time.monotonic()
            deadline = t0 + timeout_s
            try:
                page.goto(check.url, wait_until="load", timeout=timeout_s * 1000)
                check.loaded = True
            except PlaywrightError as e:
                if "Timeout" not in type(e).__name__:
                    raise
            while True:
                counts = page.evaluate(_PLOT_COUNT_JS)
                check.plots, check.plots_rendered = int(counts["plots"]), int(counts["rendered"])
                want = expected_plots if expected_plots is not None else check.plots
                done = check.loaded and (check.plots_rendered >= want or check.js_errors)
                if done or time.monotonic() >= deadline:
                    break
                page.wait_for_timeout(100)
            page.wait_for_timeout(settle_s * 1000)
            check.seconds = time.monotonic() - t0
            return check
        finally:
            context.close()


def check_page(path: str | Path, expected_plots: int | None = None, timeout_s: float = 60.0) -> PageCheck:
    """Start a browser, check one page, stop the browser."""
    with ReportBrowser() as browser:
        return browser.check(path, expected_plots, timeout_s)


def _record_console(check: PageCheck, message: Any) -> None:
    """console.error / console.assert and the browser's own error log entries (a failed resource load, ...)."""
    if message.type in ("error", "assert"):
        where = message.location.get("url", "")
        check.js_errors.append(f"console.{message.type}: {message.text}" + (f" ({where})" if where else ""))


def _record_request(check: PageCheck, url: str) -> None:
    if url and url.split(":", 1)[0].lower() not in LOCAL_SCHEMES:
        check.network_requests.append(url)
