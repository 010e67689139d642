"""`make lab` starts JupyterLab as root, bound to 127.0.0.1, and prints its URL with the token."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lab_command() -> list[str]:
    venv = Path(sys.executable).parent.parent
    out = subprocess.run(["make", "-n", "lab", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    line = next(x for x in out.splitlines() if "jupyter lab" in x)
    return shlex.split(line)


def test_make_lab_binds_localhost_and_allows_root():
    cmd = _lab_command()
    assert "--allow-root" in cmd and "--ip=127.0.0.1" in cmd and "--notebook-dir=notebooks" in cmd


@pytest.mark.slow
def test_make_lab_starts_and_prints_its_url_with_token(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = _lab_command() + ["--no-browser", f"--port={port}", f"--ServerApp.runtime_dir={tmp_path}"]
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url, seen, t0 = None, [], time.time()
        while url is None and time.time() - t0 < 120:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(rf"http://127\.0\.0\.1:{port}/lab\?token=[0-9a-f]+", line)
            url = m.group(0) if m else None
        assert url, "".join(seen[-30:])
        assert "Running as root is not recommended" not in "".join(seen)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
