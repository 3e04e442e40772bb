"""How we reach an engine over HTTP: a loopback address directly (proxy settings ignored: clusters often set
HTTP_PROXY / ALL_PROXY without NO_PROXY for 127.0.0.1, which would send every request, token ids included,
through the proxy), with the API key of an engine started here (held in this process only: never in argv or a
log) or else the one the environment names, as `Authorization: Bearer`. `EngineError`: an engine that does not
start or stops answering, in one line naming its log. docs/serving.md, "Who may talk to the engine"."""

from __future__ import annotations

import ipaddress
import os
import threading
from pathlib import Path

import httpx

KEY_ENV = "VLLM_API_KEY"  # what vLLM's server reads its key from, and a server started by hand is asked for


class EngineError(RuntimeError):
    """An engine that did not start or stopped answering; the message is one line and names its log when the
    engine was started here."""


_STARTED: dict[str, tuple[str, Path]] = {}  # origin of an engine started here -> (its API key, its log)
_LOCK = threading.Lock()


def origin(url: str) -> str:
    """"scheme://host:port" of `url` (the port made explicit)."""
    u = httpx.URL(url)
    return f"{u.scheme}://{u.host}:{u.port or (443 if u.scheme == 'https' else 80)}"


def is_loopback(url: str) -> bool:
    """`url` names this machine (localhost, 127.0.0.0/8, ::1)."""
    host = httpx.URL(url).host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def register(url: str, key: str, log: str | Path) -> None:
    """Remember the key and log of the engine started here at `url` (until `forget`)."""
    with _LOCK:
        _STARTED[origin(url)] = (key, Path(log))


def forget(url: str) -> None:
    with _LOCK:
        _STARTED.pop(origin(url), None)


def api_key(url: str, env: str = KEY_ENV) -> str:
    """The key to send to `url`: the one of the engine started here there, else $`env` ("" = none)."""
    with _LOCK:
        started = _STARTED.get(origin(url))
    return started[0] if started else os.environ.get(env, "")


def log_note(url: str) -> str:
    """"; its log: PATH" for an engine started here at `url`, else ""."""
    with _LOCK:
        started = _STARTED.get(origin(url))
    return f"; its log: {started[1]}" if started else ""


def http_client(url: str, timeout_s: float, transport: httpx.BaseTransport | None = None, env: str = KEY_ENV,
                **kwargs: object) -> httpx.Client:
    """An httpx client for the server at `url`: its key as a bearer token (`api_key`), proxies and the rest of
    the environment's settings ignored for a loopback address (`transport`: tests stand in a server)."""
    key = api_key(url, env)
    return httpx.Client(timeout=timeout_s, transport=transport, trust_env=not is_loopback(url),
                        headers={"Authorization": f"Bearer {key}"} if key else None, **kwargs)  # type: ignore[arg-type]
