"""`make lab` starts JupyterLab on loopback, serves /lab and lists the notebooks; then it stops cleanly."""

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from dflash_lib.rundir import REPO_ROOT
from loopback import free_port


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


@pytest.mark.slow
def test_make_lab_serves_lab_and_lists_notebooks(tmp_path):
    port, token = free_port(), "dflashtest"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_PORT={port}",
                             f"LAB_ARGS=--IdentityProvider.token={token} --ServerApp.open_browser=False"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            try:
                status, _ = _get(f"{base}/lab?token={token}")
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"jupyter lab exited: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.5)  # waiting for an external server to bind: nothing to block on
        assert status == 200
        status, body = _get(f"{base}/api/contents/notebooks?token={token}")
        names = {item["name"] for item in json.loads(body)["content"]}
        expected = {p.name for p in (REPO_ROOT / "notebooks").glob("*.ipynb")}
        assert expected and expected <= names
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # it already exited (the failure above says why)
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with pytest.raises(OSError):
        _get(f"{base}/lab?token={token}")
