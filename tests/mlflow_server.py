"""A real MLflow tracking server on 127.0.0.1 for the tests that check training and serving against one
(SQLite backend store, proxied artifacts under the test's folder)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tests.serving.conftest import free_port


@contextmanager
def mlflow_server(root: Path, timeout_s: float = 120.0) -> Iterator[str]:
    port = free_port()
    exe = Path(sys.executable).with_name("mlflow")
    log = open(root / "mlflow-server.log", "w")
    proc = subprocess.Popen(
        [str(exe), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=os.environ | {"MLFLOW_DISABLE_TELEMETRY": "true"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the MLflow server did not start: "
                                   f"{(root / 'mlflow-server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
