"""Open an HTML report in a real headless Chromium and observe what happens: script errors, network requests,
and whether every plotly figure drew its SVG.

Driven over the Chrome DevTools Protocol (websocket), so the checks are observations, not guesses from the
file text: `Runtime.exceptionThrown`, console errors and `Log` errors are collected as JS errors; every
`Network.requestWillBeSent` / `Network.webSocketCreated` whose URL is not file:, data: or blob: is a network
request. The browser runs with flags for a closed network (no background services, every host name resolving
to nothing), a fresh profile, and is killed in a `finally`.

    with HeadlessChromium() as browser:
        check = browser.check("runs/x_demo/report.html", expected_plots=3)
        assert not check.problems(expected_plots=3), check.problems(expected_plots=3)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_ENV = "DFLASH_CHROMIUM"  # an explicit browser binary overrides the search below
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CLOSED_NETWORK_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--disable-extensions", "--disable-dev-shm-usage", "--no-pings", "--mute-audio", "--disable-breakpad",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # a request that slips out fails at once
    "--remote-debugging-port=0",  # the chosen port is written to <profile>/DevToolsActivePort
)
LOCAL_SCHEMES = ("file", "data", "blob")  # URLs of these schemes are not network requests
_PLOT_COUNT_JS = """(() => {
  const divs = document.querySelectorAll('.plotly-graph-div, .js-plotly-plot');
  const drawn = [...document.querySelectorAll('.js-plotly-plot')].filter(d => d.querySelector('svg.main-svg'));
  return {plots: divs.length, rendered: drawn.length, ready: document.readyState};
})()"""


class BrowserUnavailable(RuntimeError):
    """No usable Chromium here (not installed, or it would not start)."""


class BrowserCheckError(RuntimeError):
    """The browser started but the page could not be driven to a verdict (navigation failed, protocol error)."""


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


@dataclass
class PageCheck:
    """What the browser saw while loading one page."""

    url: str  # the file:// URL loaded
    loaded: bool  # the load event fired within the timeout
    js_errors: list[str] = field(default_factory=list)  # uncaught exceptions, console.error, Log errors
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


class HeadlessChromium:
    """One headless Chromium process with a throwaway profile; `check` opens each page in a fresh tab."""

    def __init__(self, binary: str | None = None, start_timeout_s: float = 60.0) -> None:
        self.binary = binary or find_chromium()
        if not self.binary:
            raise BrowserUnavailable(f"no Chromium found (set ${CHROMIUM_ENV} or install Debian's `chromium`; "
                                     f"looked for {', '.join(CHROMIUM_CANDIDATES)})")
        self.start_timeout_s = start_timeout_s
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._port = 0
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy

    def __enter__(self) -> "HeadlessChromium":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        """Launch the browser and wait (bounded) for its DevTools port."""
        self._profile = tempfile.TemporaryDirectory(prefix="dflash-chromium-")
        profile = Path(self._profile.name)
        log = open(profile / "chromium.log", "wb")
        try:
            self._proc = subprocess.Popen(
                [self.binary, *CLOSED_NETWORK_FLAGS, f"--user-data-dir={profile / 'profile'}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        except OSError as e:
            self.close()
            raise BrowserUnavailable(f"cannot start {self.binary}: {e}") from None
        finally:
            log.close()
        port_file = profile / "profile" / "DevToolsActivePort"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self._log_tail()
                self.close()
                raise BrowserUnavailable(f"{self.binary} exited with code {self._proc.returncode}: {tail}")
            text = port_file.read_text() if port_file.exists() else ""
            if text.strip():
                self._port = int(text.split()[0])
                return
            time.sleep(0.05)
        tail = self._log_tail()
        self.close()
        raise BrowserUnavailable(f"{self.binary} wrote no DevToolsActivePort within {self.start_timeout_s} s: {tail}")

    def close(self) -> None:
        """Stop the browser (its whole process group, which it alone is in) and delete the profile."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # renderer/zygote children left behind, if any
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._profile is not None:
            self._profile.cleanup()
            self._profile = None

    def check(self, path: str | Path, expected_plots: int | None = None, timeout_s: float = 60.0,
              settle_s: float = 0.5) -> PageCheck:
        """Load `path` in a fresh tab and report what happened.

        Waits (at most `timeout_s`) for the load event, then until every plot div holds its SVG (or
        `expected_plots` are drawn), then `settle_s` more for late errors and requests.
        """
        if self._proc is None:
            raise BrowserCheckError("HeadlessChromium.check called before start()")
        path = Path(path).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"page to check not found: {path}")
        target = self._json("PUT", "/json/new?about:blank")
        try:
            with _Cdp(target["webSocketDebuggerUrl"]) as cdp:
                return self._observe(cdp, path.as_uri(), expected_plots, timeout_s, settle_s)
        finally:
            try:
                self._http.open(f"http://127.0.0.1:{self._port}/json/close/{target['id']}", timeout=5).read()
            except OSError:
                pass  # the browser is closed anyway when the check ends

    def _observe(self, cdp: "_Cdp", url: str, expected_plots: int | None, timeout_s: float,
                 settle_s: float) -> PageCheck:
        check = PageCheck(url=url, loaded=False)
        cdp.on_event = lambda method, params: _record(check, method, params)
        for domain in ("Runtime", "Log", "Network", "Page"):
            cdp.call(f"{domain}.enable")
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        nav = cdp.call("Page.navigate", {"url": url})
        if nav.get("errorText"):
            raise BrowserCheckError(f"navigating to {url} failed: {nav['errorText']}")
        check.loaded = cdp.wait_for("Page.loadEventFired", deadline)
        while time.monotonic() < deadline:
            counts = cdp.call("Runtime.evaluate", {"expression": _PLOT_COUNT_JS, "returnByValue": True})
            value = counts.get("result", {}).get("value") or {}
            check.plots, check.plots_rendered = int(value.get("plots", 0)), int(value.get("rendered", 0))
            want = expected_plots if expected_plots is not None else check.plots
            if check.loaded and check.plots_rendered >= want:
                break
            cdp.pump(min(0.1, max(0.0, deadline - time.monotonic())))
        cdp.pump(settle_s)
        check.seconds = time.monotonic() - t0
        return check

    def _json(self, method: str, route: str) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self._port}{route}", method=method)
        try:
            with self._http.open(req, timeout=10) as resp:
                return json.loads(resp.read())
        except OSError as e:
            raise BrowserCheckError(f"DevTools endpoint {route} on port {self._port} failed: {e}") from None

    def _log_tail(self, chars: int = 800) -> str:
        if self._profile is None:
            return ""
        log = Path(self._profile.name) / "chromium.log"
        return log.read_text(errors="replace")[-chars:].strip() if log.exists() else ""


def check_page(path: str | Path, expected_plots: int | None = None, timeout_s: float = 60.0) -> PageCheck:
    """Start a browser, check one page, stop the browser."""
    with HeadlessChromium() as browser:
        return browser.check(path, expected_plots, timeout_s)


def _record(check: PageCheck, method: str, params: dict[str, Any]) -> None:
    """Sort one DevTools event into the check's error and request lists."""
    if method == "Runtime.exceptionThrown":
        d = params.get("exceptionDetails", {})
        desc = (d.get("exception") or {}).get("description") or d.get("text", "exception")
        check.js_errors.append(f"{desc} ({d.get('url', '')}:{d.get('lineNumber', '?')})")
    elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
        args = [a.get("value", a.get("description", "")) for a in params.get("args", [])]
        check.js_errors.append("console.%s: %s" % (params["type"], " ".join(str(a) for a in args)))
    elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
        e = params["entry"]
        check.js_errors.append(f"{e.get('source', 'log')}: {e.get('text', '')} {e.get('url', '')}".strip())
    elif method in ("Network.requestWillBeSent", "Network.webSocketCreated"):
        if method == "Network.requestWillBeSent":
            request_url = params.get("request", {}).get("url")
        else:
            request_url = params.get("url")
        if request_url and request_url.split(":", 1)[0].lower() not in LOCAL_SCHEMES:
            check.network_requests.append(request_url)


class _Cdp:
    """A minimal DevTools Protocol session on one tab: numbered calls, events handed to `on_event`."""

    def __init__(self, ws_url: str) -> None:
        try:
            import websocket  # websocket-client (a jupyter-server dependency)
        except ImportError as e:
            raise BrowserUnavailable(f"the websocket-client package is needed to drive Chromium: {e}") from None
        self._ws = websocket.create_connection(ws_url, timeout=10, suppress_origin=True)
        self._timeout_exc = websocket.WebSocketTimeoutException
        self._next_id = 0
        self.on_event = lambda method, params: None
        self._seen: set[str] = set()

    def __enter__(self) -> "_Cdp":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ws.close()

    def call(self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        """Send one command and return its result (events that arrive meanwhile are dispatched)."""
        self._next_id += 1
        my_id = self._next_id
        self._ws.send(json.dumps({"id": my_id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self._receive(deadline - time.monotonic())
            if msg is not None and msg.get("id") == my_id:
                if "error" in msg:
                    raise BrowserCheckError(f"DevTools {method} failed: {msg['error']}")
                return msg.get("result", {})
        raise BrowserCheckError(f"DevTools {method} got no answer within {timeout_s} s")

    def wait_for(self, event: str, deadline: float) -> bool:
        """Dispatch events until `event` has arrived (True) or the monotonic `deadline` passes (False)."""
        while event not in self._seen and time.monotonic() < deadline:
            self._receive(deadline - time.monotonic())
        return event in self._seen

    def pump(self, seconds: float) -> None:
        """Dispatch whatever events arrive during `seconds`."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._receive(end - time.monotonic())

    def _receive(self, wait_s: float) -> dict[str, Any] | None:
        self._ws.settimeout(max(0.01, min(wait_s, 1.0)))
        try:
            msg = json.loads(self._ws.recv())
        except self._timeout_exc:
            return None
        if "method" in msg:
            self._seen.add(msg["method"])
            self.on_event(msg["method"], msg.get("params", {}))
        return msg
