"""Run the composed app on this machine: a local Ray, Serve's HTTP proxy on host:port, and a readiness
wait. Used by `palimpsest serve`, the demo, the benchmarks and the end-to-end tests."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

from palimpsest.platform.types import PalimpsestError
from palimpsest.serving.serve_config import ServeConfig, parse_serve_config


def wait_ready(url: str, timeout_s: float) -> dict:
    """Poll ``url``/readyz until it answers 200 (the ingress connects to every child on its first call)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=min(60.0, max(1.0, deadline - time.monotonic()))) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            last = e.read().decode(errors="replace")[:300]
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(1.0)
    raise PalimpsestError(f"the app at {url} was not ready within {timeout_s:.0f} s: {last}")


class LocalServer:
    def __init__(self, config: ServeConfig | dict | None = None, host: str = "127.0.0.1", port: int = 8000,
                 num_cpus: int | None = None):
        self.cfg = parse_serve_config(config)
        self.cfg.check_exposure(host)
        self.host, self.port = host, port
        self.num_cpus = num_cpus
        self.info: dict = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 900.0) -> "LocalServer":
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray
        from ray import serve

        # deferred: loads ray
        from palimpsest.serving.app import build_app

        app = build_app(self.cfg)  # config and model paths are checked before Ray starts
        if not ray.is_initialized():
            ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        # One HTTP proxy, on the head node: the single entry point of a local cluster (several raylets of one
        # machine cannot all bind host:port).
        serve.start(proxy_location="HeadOnly", http_options={"host": self.host, "port": self.port})
        serve.run(app, name=self.cfg.name, route_prefix=self.cfg.route_prefix, blocking=False)
        deadline = time.monotonic() + timeout_s
        self.info = wait_ready(self.url, timeout_s)
        self._wait_all_replicas(deadline)
        return self

    def _wait_all_replicas(self, deadline: float) -> None:
        """/readyz answers once one ingress replica is up; the app is RUNNING once every replica of every
        deployment is (a second ingress replica on another node may still be starting)."""
        from ray import serve

        status = None
        while time.monotonic() < deadline:
            app = serve.status().applications.get(self.cfg.name)
            status = app.status if app else None
            if status == "RUNNING":
                return
            time.sleep(1.0)
        raise PalimpsestError(f"the app {self.cfg.name!r} did not reach RUNNING (last status {status})")

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
