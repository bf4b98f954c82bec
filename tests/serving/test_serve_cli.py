"""`palimpsest serve` runs the app until SIGTERM and then shuts everything down cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.serving.conftest import free_port, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]


def test_serve_stops_cleanly_on_sigterm(tiny_dir, tiny_memory, tmp_path):
    cfg = tiny_config(tiny_dir, tiny_memory, tmp_path / "ledger.db")
    cfg["memory"]["model"] = None  # soft memory off: the arms with memory serve text only
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    exe = Path(sys.executable).with_name("palimpsest")
    proc = subprocess.Popen([str(exe), "serve", "--config", str(tmp_path / "serve.yaml"), "--port", str(port)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not any("serving at" in ln for ln in lines):
            time.sleep(0.5)
        assert any("serving at" in ln for ln in lines), "".join(lines)[-2000:]
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=60).json()
        assert ready["ready"] and ready["memory"]["models"]["default"]["enabled"] is False
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        reader.join(timeout=10)
        err = "".join(lines)
        assert proc.returncode == 0, err[-2000:]
        assert "shutting down" in err
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
